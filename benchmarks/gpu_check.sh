#!/usr/bin/env bash
# The CUDA path's device check: under 8 minutes on one GPU. Run from the repository root on a
# machine with a CUDA build of torch, triton and this package installed (`make setup` on a
# CUDA host, or `pip install -e '.[gpu]'` into an environment with CUDA torch).
#
#   bash benchmarks/gpu_check.sh            # every part; JSON lines in $OUT (default ./gpu_check_out)
#   PARTS="kernels nvml" bash benchmarks/gpu_check.sh
#
# Parts (benchmarks/gpu_check.py): kernels (each Triton kernel vs the torch reference),
# parity (greedy tokens vs transformers on CUDA and vs the CPU path), decode (tokens/s at batch
# 1/64/256 with CUDA graphs on and off, against the measured HBM roofline), memory (steady
# memory over a mixed run, cudaMalloc count), nvml (the memory alert path).
# Each part has its own time limit; the sum is 440 s. Exit status: 0 all passed, 1 a check
# failed or a part timed out, 2 no CUDA device.
set -u -o pipefail

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-gpu_check_out}
PARTS=${PARTS:-"kernels parity decode memory nvml"}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.jsonl"
: > "$LOG"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
then
    echo "gpu_check: $PY has no torch, or torch sees no CUDA device; set PYTHON to an" \
         "environment with a CUDA build of torch and triton" >&2
    exit 2
fi
"$PY" - <<'PYEOF' | tee -a "$LOG"
import json, torch, triton
p = torch.cuda.get_device_properties(0)
print(json.dumps({"device": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                  "sms": p.multi_processor_count, "torch": torch.__version__,
                  "cuda": torch.version.cuda, "triton": triton.__version__}))
PYEOF

limit() {
    case "$1" in
        kernels) echo 60 ;; parity) echo 120 ;; decode) echo 180 ;; memory) echo 60 ;;
        nvml) echo 20 ;; *) echo 60 ;;
    esac
}

status=0
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
for part in $PARTS; do
    echo "== $part (limit $(limit "$part") s)" >&2
    timeout "$(limit "$part")" "$PY" benchmarks/gpu_check.py "$part" 2> "$OUT/$part.stderr" \
        | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "gpu_check: part $part failed (exit $rc; stderr in $OUT/$part.stderr)" >&2
        tail -5 "$OUT/$part.stderr" >&2
        status=1
    fi
done
echo "gpu_check: $( [ $status -eq 0 ] && echo all passed || echo FAILED ); results in $LOG" >&2
exit $status
