#!/usr/bin/env bash
# Starts llama.cpp's llama-server on the shared GGUF: start_llamacpp.sh [PORT] [extra args...]
# MODEL_GGUF overrides the model (e.g. an F16 copy from llama-quantize for equal precision).
# -c is split among the --parallel slots unless --kv-unified. Threads: LLAMA_THREADS, default
# all cores; with another process holding a core that is pathological (shared/PEERS.md), so
# measure on a quiet machine (a smoke run on a busy one: LLAMA_THREADS=1).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/common.sh"
port="${1:-8200}"; shift || true
[ -x "$LLAMA_BIN/llama-server" ] || { echo "llama-server not built: run $here/install_llamacpp.sh" >&2; exit 1; }
repo="$(cd "$here/../.." && pwd)"
TS_PY="${TAILSERVE_PYTHON:-$repo/.venv/bin/python}"
gguf="${MODEL_GGUF:-$(PYTHONPATH="$repo/src" "$TS_PY" -c \
  'from tailserve.model.loader import default_model_path; print(default_model_path())')}"
exec "$LLAMA_BIN/llama-server" -m "$gguf" --host 127.0.0.1 --port "$port" -c 32768 \
  --parallel 32 --kv-unified -t "${LLAMA_THREADS:-$(nproc)}" --metrics --alias "$SERVED_NAME" "$@"
