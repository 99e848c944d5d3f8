#!/usr/bin/env bash
# The source files one streamed chat request runs, in both processes of `tailserve serve`.
#
# usage: benchmarks/trace_request.sh [PORT] [extra `tailserve serve` flags...]
#   env: PYTHON (default: python), TRACE_FUNCS=1 to list file:function instead of files,
#        TRACE_CALLS=1 to add "caller -> callee" file pairs (the counts then count lines),
#        TRACE_KEEP=DIR to keep each process's list there (trace-<pid>.txt) and the server log.
#
# Starts `tailserve serve` (default model, CPU) with benchmarks/tracehook/sitecustomize.py on
# PYTHONPATH, sends `POST /v1/chat/completions` with "stream": true and max_tokens=1 twice, and
# traces only the second (so start-up, first-use imports and warm-up are not counted): the
# window is arrival to the first (and last) streamed token. Prints the files under
# src/tailserve/ that ran (any function called, in either process), sorted, then the count.
# This is the count docs/ARCHITECTURE.md ("One request, file by file") states.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PORT=${1:-18431}
shift || true
PYTHON=${PYTHON:-python}
if [ -n "${TRACE_KEEP:-}" ]; then
  OUT=$TRACE_KEEP
  mkdir -p "$OUT"
  rm -f "$OUT"/trace-*.txt
else
  OUT=$(mktemp -d)
  trap 'rm -rf "$OUT"' EXIT
fi

TRACE_SRC=$REPO/src/tailserve/ TRACE_OUT=$OUT PYTHONPATH=$REPO/benchmarks/tracehook:$REPO/src \
  TAILSERVE_API_KEY='' setsid "$PYTHON" -m tailserve.cli serve --port "$PORT" \
  --log-level warning "$@" >"$OUT/serve.log" 2>&1 &
SPID=$!  # setsid: the server's pid is its process group id; the engine process is in the group
stop_server() {
  kill -TERM "$SPID" 2>/dev/null || true
  for _ in $(seq 1 30); do kill -0 "$SPID" 2>/dev/null || break; sleep 1; done
  kill -9 -- "-$SPID" 2>/dev/null || true
  wait "$SPID" 2>/dev/null || true
}

for _ in $(seq 1 180); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 "$SPID" 2>/dev/null || { cat "$OUT/serve.log" >&2; exit 1; }
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { stop_server; cat "$OUT/serve.log" >&2; exit 1; }

body='{"model":"SmolLM2-135M-Instruct","messages":[{"role":"user","content":"Hi there"}],'
body+='"max_tokens":1,"stream":true}'
chat() {
  curl -sf -N "http://127.0.0.1:$PORT/v1/chat/completions" \
    -H 'content-type: application/json' -d "$body" >/dev/null
}
chat        # warm-up: not traced
sleep 1
kill -USR1 -- "-$SPID"; sleep 0.5
chat        # the traced request
sleep 1     # let the engine's step finish and its stats reach the API process
kill -USR2 -- "-$SPID"; sleep 1
stop_server

cat "$OUT"/trace-*.txt | sort -u >"$OUT/files.txt"
cat "$OUT/files.txt"
api=$(wc -l <"$OUT/trace-$SPID.txt")
engine=$(for f in "$OUT"/trace-*.txt; do [ "$f" != "$OUT/trace-$SPID.txt" ] && cat "$f"; done | sort -u | wc -l)
what="source files ran"
[ -n "${TRACE_FUNCS:-}${TRACE_CALLS:-}" ] && what="lines (TRACE_FUNCS / TRACE_CALLS)"
echo "$(wc -l <"$OUT/files.txt") $what (API process $api, engine process $engine;" \
  "a file both run counts once)"
