"""The rate of arrivals that find the engine busy (engine/arrival_watch.py), and the cap it
lifts: a step without decodes may take as long as keeps the arrivals expected meanwhile under
ARRIVAL_RISK. With a fake clock and the fake runner; helpers as in test_scheduler_time.py."""

from __future__ import annotations

import math

import pytest

from fake_runner import FakeRunner
from tailserve.engine.arrival_watch import DECAY_S, PRIOR_BUSY_S, ArrivalWatch
from tailserve.engine.scheduler import Scheduler
from tailserve.engine.step_time import ARRIVAL_RISK, prefill_step_cap
from test_scheduler_time import Clock, make, req, step


def test_the_rate_starts_at_the_prior_and_falls_with_work_nobody_arrives_during() -> None:
    w = ArrivalWatch(0.0)
    assert w.rate(0.0) == pytest.approx(1.0 / PRIOR_BUSY_S)
    w.stepped(2.0, 2.0)  # two seconds of steps, nobody arrived
    assert w.rate(2.0) == pytest.approx(1.0 / (2.0 + PRIOR_BUSY_S))
    # An arrival while requests were there counts; one into an idle engine after the last
    # step ended does not (a closed-loop client's next request).
    w.arrived(arrival_time=2.5, now=2.5, engine_busy=False)
    assert w.busy_arrivals == 0.0
    w.arrived(arrival_time=2.5, now=2.5, engine_busy=True)
    assert w.busy_arrivals == pytest.approx(1.0)
    # One that came before the latest step ended waited for it, even if that step finished
    # every request (the engine looks idle when it is added).
    w.stepped(3.0, 0.4)
    w.arrived(arrival_time=2.9, now=3.01, engine_busy=False)
    assert w.busy_arrivals == pytest.approx(1.0 * math.exp(-0.51 / DECAY_S) + 1.0)


def test_counts_decay_with_wall_time_so_an_idle_engine_returns_to_the_prior() -> None:
    w = ArrivalWatch(0.0)
    for i in range(20):
        w.stepped(float(i + 1), 1.0)
    alone = w.rate(20.0)
    assert alone < 0.1
    # Ten minutes idle: the work alone is forgotten, the engine assumes company again.
    assert w.rate(620.0) == pytest.approx(1.0 / PRIOR_BUSY_S, rel=1e-6)
    # Arrivals while busy at 2/s of work: the rate reads about that.
    w = ArrivalWatch(0.0)
    for i in range(60):
        w.stepped(float(i + 1), 1.0)
        w.arrived(i + 0.5, i + 1.0, engine_busy=True)
        w.arrived(i + 0.7, i + 1.0, engine_busy=True)
    assert 1.8 < w.rate(60.0) < 2.0


def _closed_loop(s: Scheduler, runner: FakeRunner, clock: Clock, n_prompts: int,
                 tokens: int) -> list[list[int]]:
    """Prompts sent one after another, each when the last one's answer came: the chunk
    sizes of each."""
    sizes = []
    for k in range(n_prompts):
        rid = f"closed{k}"
        s.add_request(req(rid, tokens, clock.t))
        chunks = []
        while rid in s.requests:
            chunks += [n for r, n in step(s, runner, clock) if r == rid]
        sizes.append(chunks)
    return sizes


def test_a_closed_loop_client_gets_whole_budget_steps_and_arrivals_bring_the_cap_back(
        ) -> None:
    """10 ms a step + 1 ms a prompt token, a 256-token budget (266 ms whole), an ITL SLO that
    caps a step without decodes at 126 ms (96 tokens). Cold, the watch assumes one arrival a
    second: the step that keeps 0.02 arrivals expected is 20 ms, under the cap, so 96-token
    chunks. A client sending one 600-token prompt after another never arrives while the
    engine works; once it has ~12.3 s of work behind it (decayed: rate 1 / (12.3 + 1), so
    0.266 s expects 0.02) its prompts go in whole-budget steps. Then short prompts arriving
    every 150 ms while a long one runs bring the cap back after one step."""
    clock = Clock()
    # No prefix cache: the fake prompts repeat every 40 tokens.
    s = make(clock, target_s=0.126, max_num_batched_tokens=256, enable_prefix_caching=False,
             max_model_len=4200, num_kv_blocks=640)
    runner = FakeRunner()
    assert prefill_step_cap(s) == pytest.approx(0.126)
    assert s.snapshot().prefill_step_cap_by == "itl_slo"
    sizes = _closed_loop(s, runner, clock, 30, 600)
    assert sizes[0] == sizes[8] == [96] * 6 + [24]
    # The first chunk grows with the work done alone (0.02 x (work + 1 s)), never shrinks.
    firsts = [c[0] for c in sizes]
    assert firsts == sorted(firsts) and sizes[-1] == [256, 256, 88]
    whole = next(i for i, c in enumerate(sizes) if c == [256, 256, 88])
    assert 15 < whole < 30, firsts
    assert s.arrivals.busy_arrivals == 0.0
    # Past a whole budget's first chunk (266 ms): a late chunk of a long prompt may take
    # that long too.
    assert prefill_step_cap(s) == pytest.approx(ARRIVAL_RISK / s.arrivals.rate(clock.t))
    assert prefill_step_cap(s) > 0.266
    snap = s.snapshot()
    assert (snap.prefill_step_cap_s, snap.prefill_step_cap_by) == (prefill_step_cap(s),
                                                                   "arrivals")
    assert snap.busy_arrival_rate == s.arrivals.rate(clock.t)
    # Open loop: a 4,000-token prompt, and 20-token prompts arriving every 150 ms.
    s.add_request(req("long", 4000, clock.t))
    next_short, k, late = clock.t + 0.15, 0, []
    while "long" in s.requests:
        while next_short <= clock.t:
            s.add_request(req(f"s{k}", 20, next_short))
            next_short += 0.15
            k += 1
        late.append(dict(step(s, runner, clock)).get("long", 0))
    # One whole-budget step (266 ms: a short prompt waited for it), then the cap.
    assert late[0] == 256 and max(late[1:]) <= 96
    assert s.arrivals.rate(clock.t) > 1.0
    assert prefill_step_cap(s) == pytest.approx(0.126)
    assert s.snapshot().prefill_step_cap_by == "itl_slo"
    assert ARRIVAL_RISK / s.arrivals.rate(clock.t) < 0.126


def test_the_metric_help_states_the_risk_the_engine_uses() -> None:
    """obs/ may not import engine/ (DESIGN.md), so the gauge's help on /metrics repeats the
    risk as a number; this keeps the two equal when one of them changes."""
    from tailserve.obs.metrics import ServerMetrics

    page = ServerMetrics().render()[0].decode()
    help_line = next(line for line in page.splitlines()
                     if line.startswith("# HELP tailserve:busy_arrival_rate "))
    assert f"may take {ARRIVAL_RISK:g} / this" in help_line
