"""``tailserve bench``: an open-loop load generator for any OpenAI-compatible server.

    datasets.py  what to send (random, mixed, prefix, structured, tools, sharegpt, jsonl),
                 lengths in tokens; schemas.py the structured dataset's JSON schemas,
                 tool_pool.py the tools dataset's functions and questions
    tokens.py    how long a text is in the target model's tokens (local, server, estimate)
    preflight.py the checks before any load: URL, key, model, what the server offers
    client.py    one streamed request, timed chunk by chunk (aiohttp; the SSE parser)
    http11.py    the lean HTTP/1.1 client for http:// (default): prebuilt requests
    observe.py   the server's side: /metrics samples and /debug/timeline records
    metrics.py   the numbers, defined as vLLM's ``bench serve`` defines them
    validity.py  structured and tool-call answers checked against their schemas
                 (schema_check.py, a small validator), grammar time from the server
    result.py    the result file: vLLM's keys plus a ``tailserve`` block
    report.py    the terminal tables and the latency-vs-rate plot
    run.py       a run: flags checked, pre-flight, stepped rates and the sweep
    step.py      one step against one server, from prepared requests to its result
    open_loop.py the arrival schedule and the open loop that sends at it
    canary.py    --base-url-b: users split between two servers in one run
    replicas.py  --replica: the replicas behind a router, each request's replica
"""

from __future__ import annotations

# Here, not in datasets.py, so building the CLI parser imports neither numpy nor aiohttp.
DATASETS = ("random", "mixed", "prefix", "structured", "tools", "sharegpt", "jsonl")
DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 128
DEFAULT_MIX = "128:0.7,1024:0.2,8192:0.1"


class BenchError(ValueError):
    """A mistake the user can fix (wrong URL, refused connection, bad key, bad flag or file).

    Raised before any load is sent, with what to do in the message; the CLI prints it
    without a traceback and exits 2.
    """
