"""benchmarks/scheduler_sim.py: the real scheduler on a simulated engine (seeded, no torch)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location(
    "scheduler_sim", os.path.join(HERE, "..", "benchmarks", "scheduler_sim.py"))
assert spec is not None and spec.loader is not None
sim = importlib.util.module_from_spec(spec)
sys.modules["scheduler_sim"] = sim  # its dataclasses look their module up
spec.loader.exec_module(sim)


def test_every_request_gets_its_tokens_and_the_itl_slo_bounds_the_gaps() -> None:
    w = sim.Workload("small", 40, 512, 16, range_ratio=0.9, request_rate=1.0)
    runs = {label: [sim.simulate(w, flags, sim.MEASURED_COEF, sim.MEASURED_SIGMA, seed)
                    for seed in range(2)]
            for label, flags in (("default", []), ("off", ["--slo-itl-ms", "none"]))}
    for traces in runs["default"]:
        assert len(traces) == 40
        assert all(len(t.token_times) == 16 and t.token_times[0] > t.arrival
                   for t in traces.values())
    default = sim.summarize(runs["default"], 0)
    off = sim.summarize(runs["off"], 0)
    # Whole-budget prefill steps beside decodes make the gap tail several times longer.
    assert default["itl_p99_ms"] * 2 < off["itl_p99_ms"]
    assert default["itl_p50_ms"] == pytest.approx(off["itl_p50_ms"], rel=0.2)


def test_the_same_seed_gives_the_same_run() -> None:
    w = sim.WORKLOADS["long-mix"]
    a = sim.summarize([sim.simulate(w, [], sim.MEASURED_COEF, 0.2, 3)], w.long_len)
    b = sim.summarize([sim.simulate(w, [], sim.MEASURED_COEF, 0.2, 3)], w.long_len)
    assert a == b and "short_ratio" in a
