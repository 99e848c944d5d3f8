"""Canary split: one open-loop run whose users are split between server A and server B.

``tailserve bench --base-url A --base-url-b B --split 0.1 --users 100`` sends one arrival
schedule; each request belongs to a synthetic user, and each user goes to A or B by the
FNV-1a hash of its id (``user-17``), so a user sticks to its arm and the same users land on
the same arms in every run (the hash depends on nothing but the id, unlike Python's
``hash``). Both arms see the same moments of the same load, interleaved, which a pair of
separate runs cannot promise; each arm's result is saved on its own for ``tailserve compare``.

The server-side observer (/metrics, timeline) is not run in a split: it would have to watch
two servers, and each arm's result is about what its users saw.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from time import perf_counter
from typing import TYPE_CHECKING, Any

import numpy as np

from tailserve.bench import BenchError
from tailserve.bench.client import BenchClient, RequestResult
from tailserve.bench.datasets import load_dataset
from tailserve.bench.open_loop import arrival_times, open_loop
from tailserve.bench.report import Progress, print_step
from tailserve.bench.result import StepData, _write_json, build_result, environment

if TYPE_CHECKING:
    from tailserve.bench.config import BenchConfig
    from tailserve.bench.step import StepRunner

FNV_OFFSET_32 = 0x811C9DC5
FNV_PRIME_32 = 0x01000193
ARMS = ("A", "B")
SPLIT_BUCKETS = 10_000


def fnv1a_32(data: bytes) -> int:
    h = FNV_OFFSET_32
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME_32) & 0xFFFFFFFF
    return h


def user_arm(user_id: str, split: float) -> str:
    """"B" for the users whose hash lands in the first ``split`` of 10,000 buckets.

    Buckets by the remainder, not by the hash's top bits: ids that differ only in the last
    character (``user-1`` ... ``user-9``) differ little in FNV-1a's high bits, and with 20
    users a 30% split of the raw range sent none to B. A non-power-of-two modulus uses them
    all. Raising the split only moves users from A to B.
    """
    return "B" if fnv1a_32(user_id.encode()) % SPLIT_BUCKETS < split * SPLIT_BUCKETS else "A"


def validate(cfg: BenchConfig) -> None:
    if not 0.0 < cfg.split < 1.0:
        raise BenchError(f"--split is the share of users sent to B, in (0, 1); got {cfg.split}")
    if cfg.users < 2:
        raise BenchError(f"--users must be >= 2 to split them, got {cfg.users}")
    if cfg.sweep or cfg.request_rates:
        raise BenchError("--base-url-b runs one step: use --request-rate, not --request-rates "
                         "or --sweep")
    arms = {user_arm(f"user-{u}", cfg.split) for u in range(cfg.users)}
    if arms != set(ARMS):
        raise BenchError(f"with --users {cfg.users} and --split {cfg.split:g} every user "
                         f"hashes to arm {arms.pop()}: use more users or a larger split")


async def canary_step(runners: dict[str, StepRunner], console: Any) -> list[dict[str, Any]]:
    """One step over both arms; one result per arm (A's first)."""
    a = runners["A"]
    cfg = a.cfg
    ds = load_dataset(a.dataset_opts(0), a.counter)
    n = len(ds.requests)
    # Users from their own stream (seed, 0, 2): the arrivals' stream is (seed, 0, 1).
    users = np.random.default_rng([cfg.seed, 0, 2]).integers(0, cfg.users, size=n)
    arm_of_user = {u: user_arm(f"user-{u}", cfg.split) for u in range(cfg.users)}
    arms = [arm_of_user[int(u)] for u in users]
    clients: list[BenchClient] = [runners[arm].client for arm in arms]
    arrivals = arrival_times(n, cfg.request_rate, cfg.burstiness,
                             np.random.default_rng([cfg.seed, 0, 1]))
    results = [RequestResult(i, f"bench-{a.run_id}-{arms[i]}-{i}", r.prompt_len, r.output_len,
                             float(arrivals[i])) for i, r in enumerate(ds.requests)]
    payloads = [runners[arm].client.prepare(runners[arm].payload(req), res)
                for arm, req, res in zip(arms, ds.requests, results, strict=True)]
    console.print(f"canary step: {n} {ds.name} requests from {cfg.users} users, "
                  f"{arms.count('B')} to B ({cfg.split:.0%} of users by FNV-1a of the user id)")
    load_before = os.getloadavg()
    gc.collect()
    gc.freeze()  # as in step.py: no full collection inside the measured window
    interrupted = False
    try:
        with Progress(console, n, "canary", cfg.progress) as progress:
            t0_wall, t0 = time.time(), perf_counter()  # after the bar's first draw
            try:
                await open_loop(clients, payloads, results, cfg.max_concurrency, t0,
                                 progress, cfg.busy_poll)
            finally:
                duration = perf_counter() - t0
    except asyncio.CancelledError:
        interrupted = True
    finally:
        gc.unfreeze()
    out = []
    for arm in ARMS:
        runner = runners[arm]
        mine = [r for r, x in zip(results, arms, strict=True) if x == arm
                and (not interrupted or r.send_s is not None)]
        runner.fill_output_tokens(mine)
        result = build_result(cfg, runner.info, runner.counter, StepData(
            index=0, name=f"canary {arm}", rate=cfg.request_rate,
            max_concurrency=cfg.max_concurrency, dataset=ds, dataset_options=a.dataset_opts(0),
            ignore_eos=runner.ignore_eos, results=mine, duration_s=duration, start_time=t0_wall,
            start_perf_counter=t0, server=None, warnings=list(ds.notes),
            interrupted=interrupted, run_id=a.run_id,
            environment=environment(cfg.argv, runner.info, runner.loop_name, load_before,
                                    runner.client_name, cfg.busy_poll),
        ), runner.slos)
        result["label"] = f"{cfg.label or 'canary'} {arm}"
        result["tailserve"]["canary"] = {
            "arm": arm, "split": cfg.split, "users": cfg.users,
            "base_url_a": runners["A"].info.base_url, "base_url_b": runners["B"].info.base_url,
            "user_ids": [f"user-{int(users[r.index])}" for r in mine],
        }
        print_step(console, result, cfg.percentiles)
        out.append(result)
    return out


def save_arms(path: str, results: list[dict[str, Any]], console: Any) -> list[str]:
    """PATH's stem + ``-A`` / ``-B``: the two files ``tailserve compare`` takes."""
    stem, ext = os.path.splitext(path)
    paths = []
    for arm, result in zip(ARMS, results, strict=True):
        p = f"{stem}-{arm}{ext or '.json'}"
        _write_json(p, result)
        paths.append(p)
    console.print(f"arm results saved to {paths[0]} and {paths[1]}: "
                  f"tailserve compare {paths[0]} {paths[1]}")
    return paths
