"""Cross-tenant prefix probe: can tenant B tell that tenant A recently sent some prompt?
Issue 34's isolation target, measured from outside as an attacker would.

Each trial: tenant A sends a secret prompt (random token ids, ``--tokens`` long), so the
server caches it under A's salt. Tenant B (another key) then sends, in random order, the same
secret (the *probe*) and a fresh prompt of the same length, each streamed with
``max_tokens=1``. Per request the script keeps the client's time to the first streamed chunk
(what a prober sees), the engine's ``ttft_s`` and ``cached_prompt_tokens`` from
``tailserve_timing``, and the change of ``tailserve:prefix_cache_hits_total`` across the
request (requests go one at a time, so that change is the request's own hits). Last, A sends
its secret again: the hit within a tenant the salt must keep.

Phases, a fresh server each (``--api-keys`` with two keys):

  salted  -- ``--cache-salt-by-tenant``: B must get no hit and no TTFT difference;
  shared  -- the positive control, the cache shared by every key: B's probe hits and is
             visibly faster, so the probe can fail;
  queue   -- salted, the side channel that remains (``--queue-trials``): B sends a short
             prompt ``--queue-delay-ms`` after A sends a secret, once when A's secret is new
             to A's cache (A prefills all of it) and once when A sends it again (a hit). B
             cannot reach A's blocks, but B's first token waits for the step in flight.

For probe against fresh the report gives the difference of mean and of median TTFT (probe
minus fresh) with 95% bootstrap intervals (``analyze/bootstrap.py``, 10,000 resamples of each
side; and of the per-trial differences, the two requests of a trial having run back to
back), and how often the probe was the faster of its pair (0.5 when nothing leaks; a
two-sided sign test). The target: with salts, hit rate 0 and both intervals contain 0; in the
control, a hit rate above 0 and intervals that exclude 0.

    python benchmarks/prefix_probe.py
    python benchmarks/prefix_probe.py --trials 40 --tokens 1024 --phases salted shared queue
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import numpy as np
from scipy.stats import binomtest

from tailserve.analyze.bootstrap import (
    GroupedSample,
    bootstrap_percentiles,
    percentile_interval,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_util import ServerProcess, metric_value

KEYS = {"team-a": "sk-probe-team-a-0123", "team-b": "sk-probe-team-b-4567"}
HITS = "tailserve:prefix_cache_hits_total"
# SmolLM2's vocabulary is 49,152 ids; the first hundred hold special and control tokens.
VOCAB = (100, 49_000)
RESAMPLES = 10_000


@dataclass
class Sample:
    trial: int
    role: str  # a_cache | b_probe | b_fresh | a_repeat | b_beside_miss | b_beside_hit
    tenant: str
    client_ttft_s: float
    engine_ttft_s: float
    cached_prompt_tokens: int
    metrics_hit_tokens: int | None  # None when something else ran beside it (queue phase)


async def hits_total(client: httpx.AsyncClient, url: str) -> int:
    return int(metric_value((await client.get(url + "/metrics")).text, HITS) or 0)


async def stream_one(client: httpx.AsyncClient, url: str, tenant: str, ids: list[int],
                     max_tokens: int = 1) -> tuple[float, dict[str, Any]]:
    """Client TTFT (to the first chunk with a choice) and the final chunk's timing."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    first: float | None = None
    timing: dict[str, Any] = {}
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{tenant}: HTTP {resp.status_code}: {(await resp.aread())!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if first is None and chunk.get("choices"):
                first = time.monotonic() - sent
            if chunk.get("tailserve_timing"):
                timing = chunk["tailserve_timing"]
    assert first is not None and timing, "the stream ended without a token or its timing"
    return first, timing


async def measured(client: httpx.AsyncClient, url: str, trial: int, role: str, tenant: str,
                   ids: list[int]) -> Sample:
    before = await hits_total(client, url)
    ttft, timing = await stream_one(client, url, tenant, ids)
    after = await hits_total(client, url)
    return Sample(trial, role, tenant, ttft, float(timing["ttft_s"]),
                  int(timing["cached_prompt_tokens"]), after - before)


async def probe_phase(url: str, args: argparse.Namespace) -> list[Sample]:
    rng = random.Random(args.seed)
    out: list[Sample] = []

    def prompt() -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(args.tokens)]

    async with httpx.AsyncClient(timeout=600) as client:
        # Warm-up, not recorded: the first requests of a fresh server pay one-off costs.
        for tenant in ("team-a", "team-b"):
            await stream_one(client, url, tenant, prompt())
        for t in range(args.trials):
            secret, fresh = prompt(), prompt()
            out.append(await measured(client, url, t, "a_cache", "team-a", secret))
            pair = [("b_probe", secret), ("b_fresh", fresh)]
            rng.shuffle(pair)
            for role, ids in pair:
                out.append(await measured(client, url, t, role, "team-b", ids))
            out.append(await measured(client, url, t, "a_repeat", "team-a", secret))
    return out


async def queue_phase(url: str, args: argparse.Namespace) -> list[Sample]:
    """B's short prompt beside A's request for a secret: A's first send (a miss, A prefills
    it all) against A's second (a hit in A's own cache)."""
    rng = random.Random(args.seed + 1)
    out: list[Sample] = []

    async def beside(client: httpx.AsyncClient, trial: int, role: str,
                     secret: list[int]) -> None:
        # A decodes 16 tokens, so that it is still in flight when B arrives on a hit too.
        a = asyncio.ensure_future(stream_one(client, url, "team-a", secret, max_tokens=16))
        # Not /metrics: the engine reports its queue between steps, so A shows there only
        # once its first prefill step is over, too late for B to queue behind that step.
        await asyncio.sleep(args.queue_delay_ms / 1e3)
        short = [rng.randrange(*VOCAB) for _ in range(args.short_tokens)]
        ttft, timing = await stream_one(client, url, "team-b", short)
        await a
        out.append(Sample(trial, role, "team-b", ttft, float(timing["ttft_s"]),
                          int(timing["cached_prompt_tokens"]), None))

    async with httpx.AsyncClient(timeout=600) as client:
        await stream_one(client, url, "team-a", [rng.randrange(*VOCAB) for _ in range(64)])
        for t in range(args.queue_trials):
            secret = [rng.randrange(*VOCAB) for _ in range(args.tokens)]
            await beside(client, t, "b_beside_miss", secret)
            await beside(client, t, "b_beside_hit", secret)
    return out


def difference_ci(x: list[float], y: list[float], seed: int) -> dict[str, Any]:
    """Mean and median of x minus those of y (seconds), each with a 95% bootstrap interval:
    x and y resampled independently, each request its own group."""
    rng = np.random.default_rng(seed)
    xs, ys = np.asarray(x), np.asarray(y)
    res: dict[str, Any] = {}
    med_x = bootstrap_percentiles(GroupedSample.independent(xs), [50.0], RESAMPLES, rng)[:, 0]
    med_y = bootstrap_percentiles(GroupedSample.independent(ys), [50.0], RESAMPLES, rng)[:, 0]
    mean_x = xs[rng.integers(0, len(xs), (RESAMPLES, len(xs)))].mean(axis=1)
    mean_y = ys[rng.integers(0, len(ys), (RESAMPLES, len(ys)))].mean(axis=1)
    for name, point, boot in (
        ("median", float(np.median(xs) - np.median(ys)), med_x - med_y),
        ("mean", float(xs.mean() - ys.mean()), mean_x - mean_y),
    ):
        lo, hi = percentile_interval(boot, 0.95)
        res[f"{name}_diff_ms"] = round(point * 1e3, 2)
        res[f"{name}_ci95_ms"] = [round(lo * 1e3, 2), round(hi * 1e3, 2)]
        res[f"{name}_ci_contains_0"] = lo <= 0.0 <= hi
    return res


def paired_ci(d: list[float], seed: int) -> dict[str, Any]:
    """Mean and median of per-trial differences (the two requests of a trial ran back to back,
    so a load swing on the host moves both): point and 95% bootstrap interval, in ms."""
    rng = np.random.default_rng(seed)
    ds = np.asarray(d)
    med = bootstrap_percentiles(GroupedSample.independent(ds), [50.0], RESAMPLES, rng)[:, 0]
    mean = ds[rng.integers(0, len(ds), (RESAMPLES, len(ds)))].mean(axis=1)
    res: dict[str, Any] = {}
    for name, point, boot in (("median", float(np.median(ds)), med),
                              ("mean", float(ds.mean()), mean)):
        lo, hi = percentile_interval(boot, 0.95)
        res[f"paired_{name}_ms"] = round(point * 1e3, 2)
        res[f"paired_{name}_ci95_ms"] = [round(lo * 1e3, 2), round(hi * 1e3, 2)]
    return res


def ms(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)) * 1e3, 1)


def summarize_probe(samples: list[Sample], seed: int) -> dict[str, Any]:
    by = {role: [s for s in samples if s.role == role]
          for role in ("a_cache", "b_probe", "b_fresh", "a_repeat")}
    probe, fresh = by["b_probe"], by["b_fresh"]
    res: dict[str, Any] = {"trials": len(probe)}
    for role, ss in by.items():
        res[f"{role}_hit_rate"] = round(sum(s.cached_prompt_tokens > 0 for s in ss) / len(ss), 3)
        res[f"{role}_cached_tokens"] = sum(s.cached_prompt_tokens for s in ss)
        res[f"{role}_metrics_hit_tokens"] = sum(s.metrics_hit_tokens or 0 for s in ss)
        res[f"{role}_client_ttft_p50_ms"] = ms([s.client_ttft_s for s in ss], 50)
    for clock in ("client", "engine"):
        key = f"{clock}_ttft_s"
        x = [getattr(s, key) for s in probe]
        y = [getattr(s, key) for s in fresh]
        res[f"{clock}_probe_minus_fresh"] = difference_ci(x, y, seed)
    # Pairs: was the probe the faster of its trial's two? 0.5 expected when nothing leaks.
    fresh_of = {s.trial: s.client_ttft_s for s in fresh}
    faster = sum(s.client_ttft_s < fresh_of[s.trial] for s in probe)
    res["client_paired_probe_minus_fresh"] = paired_ci(
        [s.client_ttft_s - fresh_of[s.trial] for s in probe], seed)
    res["probe_faster_in_pairs"] = f"{faster}/{len(probe)}"
    res["sign_test_p"] = round(binomtest(faster, len(probe), 0.5).pvalue, 4)
    return res


def summarize_queue(samples: list[Sample], seed: int) -> dict[str, Any]:
    miss = [s for s in samples if s.role == "b_beside_miss"]
    hit = [s for s in samples if s.role == "b_beside_hit"]
    res: dict[str, Any] = {"trials": len(miss),
                           "b_cached_tokens": sum(s.cached_prompt_tokens for s in samples)}
    for role, ss in (("beside_a_miss", miss), ("beside_a_hit", hit)):
        res[f"b_{role}_client_ttft_p50_ms"] = ms([s.client_ttft_s for s in ss], 50)
        res[f"b_{role}_client_ttft_p90_ms"] = ms([s.client_ttft_s for s in ss], 90)
    res["client_miss_minus_hit"] = difference_ci(
        [s.client_ttft_s for s in miss], [s.client_ttft_s for s in hit], seed)
    hit_of = {s.trial: s.client_ttft_s for s in hit}
    slower = sum(s.client_ttft_s > hit_of[s.trial] for s in miss)
    res["b_slower_beside_a_miss_in_pairs"] = f"{slower}/{len(miss)}"
    return res


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--tokens", type=int, default=1024, help="secret and fresh prompt length")
    p.add_argument("--queue-trials", type=int, default=20)
    p.add_argument("--short-tokens", type=int, default=32, help="B's prompt in the queue phase")
    p.add_argument("--queue-delay-ms", type=float, default=50.0,
                   help="B sends this long after A in the queue phase")
    p.add_argument("--phases", nargs="+", default=["salted", "shared", "queue"],
                   choices=["salted", "shared", "queue"])
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more argument for tailserve serve (repeat)")
    p.add_argument("--seed", type=int, default=34)
    p.add_argument("--out", default=None, help="write every sample and the summary as JSON")
    args = p.parse_args()
    keys = os.path.join(tempfile.mkdtemp(prefix="tailserve-probe-"), "keys.jsonl")
    with open(keys, "w") as f:
        for name, key in KEYS.items():
            f.write(json.dumps({"key": key, "name": name}) + "\n")
    base = ["--api-keys", keys, "--max-model-len", str(args.tokens + 64),
            "--kv-cache-memory", "1", *args.serve_arg]
    report: dict[str, Any] = {"args": vars(args), "phases": {}}
    ok = True
    for name in args.phases:
        serve = base if name == "shared" else [*base, "--cache-salt-by-tenant"]
        t0, load0 = time.time(), load()
        with ServerProcess(serve, model=args.model, startup_timeout=600) as srv:
            if name == "queue":
                samples = asyncio.run(queue_phase(srv.url, args))
                summary = summarize_queue(samples, args.seed)
            else:
                samples = asyncio.run(probe_phase(srv.url, args))
                summary = summarize_probe(samples, args.seed)
        summary["seconds"] = round(time.time() - t0, 1)
        summary["load_before_after"] = [load0, load()]
        report["phases"][name] = {"summary": summary, "samples": [asdict(s) for s in samples]}
        print(name, json.dumps(summary), flush=True)
        if name == "salted":
            closed = (summary["b_probe_cached_tokens"] == 0
                      and summary["b_probe_metrics_hit_tokens"] == 0
                      and summary["a_repeat_hit_rate"] == 1.0
                      and all(summary[f"{c}_probe_minus_fresh"][f"{m}_ci_contains_0"]
                              for c in ("client", "engine") for m in ("mean", "median")))
            print(f"salted: B's hit rate on A's prompts 0 and TTFT indistinguishable, A hits "
                  f"its own: {'yes' if closed else 'NO'}", flush=True)
            ok &= closed
        elif name == "shared":
            seen = (summary["b_probe_hit_rate"] > 0 and not summary[
                "client_probe_minus_fresh"]["median_ci_contains_0"])
            print(f"shared (control): the probe sees A's prompts: {'yes' if seen else 'NO'}",
                  flush=True)
            ok &= seen
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
