"""Two ``tailserve serve`` replicas behind vllm-router (deploy/router/serve_replicas.py).

One run of the script, then, read from each replica's ``/metrics``:

* balance: four unrelated prompt families through the router land on both replicas;
* prefix affinity (``cache_aware``): each family's repeat goes to the replica that served it
  first, so the two small pools together keep all four heads, and the repeats' prefix-cache
  hit rate is above a single replica's for the same traffic (one 14-block pool cannot keep
  four heads of 4 blocks; cycling through them evicts each before it comes back);
* a replica killed (SIGKILL, engine too) under load: every request ends — a 200 or a clean
  error status — and later requests are all served by the survivor.

Skips, with the reason, only where the vllm-router executable is missing or cannot run.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_util import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "deploy" / "router" / "serve_replicas.py"
MODEL = "SmolLM2-135M-Instruct"
# Replica settings the eviction arithmetic above depends on: 16-token blocks, a 14-block pool.
SERVE_ARGS = ["--num-kv-blocks", "14", "--block-size", "16", "--max-model-len", "128",
              "--max-num-seqs", "4", "--watermark", "0", "--log-level", "warning"]
WORDS = [
    "apple", "river", "stone", "cloud", "tiger", "lamp", "forest", "ocean", "violin", "copper",
    "silver", "garden", "window", "rocket", "pencil", "desert", "island", "meadow", "thunder",
    "candle", "bridge", "castle", "dragon", "mirror", "planet", "sugar", "winter", "summer",
    "autumn", "spring", "engine", "harbor",
]


def router_bin() -> str:
    path = Path(sys.executable).with_name("vllm-router")
    found = str(path) if path.exists() else shutil.which("vllm-router")
    if found is None:
        pytest.skip("vllm-router is not installed (pip install vllm-router; dev extra)")
    try:
        subprocess.run([found, "--help"], capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"vllm-router cannot run here: {type(exc).__name__}: {exc}")
    return found


@contextlib.contextmanager
def start_cluster(folder: Path, serve_args: list[str],
                  script_args: Sequence[str] = ()) -> Iterator[dict[str, Any]]:
    """serve_replicas.py with two replicas (``serve_args`` to each, ``script_args`` to the
    script); yields its state file (the router's and the replicas' URLs and pids)."""
    binary = router_bin()
    state_file = folder / "state.json"
    log = open(state_file.with_suffix(".log"), "wb")  # noqa: SIM115 - read on failure
    cmd = [sys.executable, str(SCRIPT), "--replicas", "2", "--port", str(free_port()),
           "--replica-base-port", str(two_free_ports()), "--router-bin", binary,
           "--state-file", str(state_file), "--threads", str(os.cpu_count() or 2),
           *script_args, "--", *serve_args]
    # The torch paths: routing is under test, not kernels, and they start seconds sooner.
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "TAILSERVE_CPU_KERNELS": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 240
        while not state_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail("serve_replicas.py did not come up:\n"
                            + state_file.with_suffix(".log").read_text()[-4000:])
            time.sleep(0.25)
        yield json.loads(state_file.read_text())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with start_cluster(tmp_path_factory.mktemp("router"), SERVE_ARGS) as state:
        yield state


def two_free_ports() -> int:
    """A free port whose successor is free too (the script puts replica i on base + i)."""
    for _ in range(50):
        base = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise RuntimeError("no two consecutive free ports")


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "num_requests_running"):
        m = re.search(rf"^tailserve:{name} (\S+)$", text, re.M)
        assert m is not None, f"{name} missing from {url}/metrics"
        out[name] = float(m.group(1))
    return out


def complete(url: str, prompt: str, max_tokens: int = 2, timeout: float = 60.0) -> int:
    r = httpx.post(url + "/v1/completions", timeout=timeout, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    return r.status_code


def families(rnd: random.Random, n: int) -> list[str]:
    """``n`` heads of 48 words, each opening with its own word so that no two share a leading
    character (the router's prefix tree matches characters)."""
    firsts = rnd.sample([w for w in WORDS if w[0] in "arstlfocgwpdimbke"], n)
    heads = []
    for first in firsts:
        if any(h[0] == first[0] for h in heads):
            continue
        heads.append(" ".join([first, *(rnd.choice(WORDS) for _ in range(47))]))
    assert len(heads) == n
    return heads


def served(before: list[dict[str, float]], after: list[dict[str, float]]) -> tuple[int, float]:
    """Which replica a sequential request went to, and the prompt tokens it found cached."""
    q = [a["prefix_cache_queries_total"] - b["prefix_cache_queries_total"]
         for a, b in zip(after, before, strict=True)]
    assert sorted(v > 0 for v in q) == [False, True], f"queries moved on {q}"
    i = 0 if q[0] > 0 else 1
    return i, after[i]["prefix_cache_hits_total"] - before[i]["prefix_cache_hits_total"]


def hit_rate(urls: list[str], prompts: list[str], target: str) -> tuple[float, list[int]]:
    """Send ``prompts`` one by one to ``target``; the hit rate over all of them (from the
    replicas' counters) and the replica each went to."""
    where, hits, queries = [], 0.0, 0.0
    for p in prompts:
        before = [counters(u) for u in urls]
        assert complete(target, p) == 200
        after = [counters(u) for u in urls]
        i, h = served(before, after)
        where.append(i)
        hits += h
        queries += after[i]["prefix_cache_queries_total"] - before[i]["prefix_cache_queries_total"]
    return hits / queries, where


def test_balance_affinity_and_a_dead_replica(cluster: dict[str, Any]) -> None:
    router = cluster["router_url"]
    urls = [r["url"] for r in cluster["replicas"]]
    rnd = random.Random(5)

    def tails(heads: list[str]) -> list[str]:
        return [f"{h} {' '.join(rnd.choice(WORDS) for _ in range(6))}" for h in heads]

    # The 1-replica baseline: four families cycled twice straight into replica 0.
    heads = families(rnd, 4)
    hit_rate(urls, tails(heads), urls[0])
    baseline, where = hit_rate(urls, tails(heads), urls[0])
    assert where == [0, 0, 0, 0]

    # Through the router: four new families at once (the router balances them by load) ...
    heads = families(rnd, 4)
    before = [counters(u) for u in urls]
    with cf.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda p: complete(router, p), tails(heads))) == [200] * 4
    moved = [counters(u)["prefix_cache_queries_total"] - b["prefix_cache_queries_total"]
             for u, b in zip(urls, before, strict=True)]
    assert all(m > 0 for m in moved), f"one replica took all four families: {moved}"
    # ... then their repeats, one by one: each to the replica holding its head.
    hits = queries = 0.0
    for p in tails(heads):
        before = [counters(u) for u in urls]
        assert complete(router, p) == 200
        after = [counters(u) for u in urls]
        i, h = served(before, after)
        assert h >= 32, f"a repeated prefix missed on replica {i} ({h} tokens cached)"
        hits += h
        queries += after[i]["prefix_cache_queries_total"] - before[i]["prefix_cache_queries_total"]
    routed = hits / queries
    assert routed > baseline, (routed, baseline)
    print(f"prefix-cache hit rate of the repeats: {routed:.2f} routed over 2 replicas, "
          f"{baseline:.2f} on 1 replica")

    # Kill replica 1 (its whole process group: server and engine) with requests in flight.
    victim = cluster["replicas"][1]
    prompts = [f"{rnd.choice(WORDS)} {i} " + " ".join(rnd.choice(WORDS) for _ in range(20))
               for i in range(4)]
    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, router, p, 16, 90.0) for p in prompts]
        deadline = time.monotonic() + 60
        while counters(victim["url"])["num_requests_running"] < 1:
            assert time.monotonic() < deadline, "replica 1 never got a request"
            time.sleep(0.05)
        os.killpg(victim["pid"], signal.SIGKILL)
        # None hangs: each ends (a client timeout would raise here) with a status.
        statuses = [f.result(timeout=120) for f in futures]
    assert all(s == 200 or 500 <= s < 600 for s in statuses), statuses
    assert statuses.count(200) >= 1
    print(f"statuses of the requests in flight when replica 1 died: {statuses}")
    # The survivor takes everything from now on.
    later = [complete(router, p, 2, 60.0) for p in prompts[:3]]
    assert later == [200, 200, 200], (statuses, later)
