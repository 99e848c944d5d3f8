"""The scheduler serving SLOs, on the fake runner and a fake clock with a given step-time model
(exact chunk sizes, orders and victims): step budgets from the decodes' slack, earliest TTFT
deadline first, yielding of requests that can no longer meet theirs and its starvation bound,
preemption by slack, per-request SLOs, the queue bound on what can start, and each request's
SLO attainment in its timing. Helpers as in test_scheduler_time.py."""

from __future__ import annotations

import argparse

import pytest

from fake_runner import FakeRunner
from tailserve.cli import add_engine_args, engine_args_from
from tailserve.config import check_removed_args
from tailserve.data.step import BlockedReason, EngineOutput
from tailserve.engine.latency import step_time_budget
from tailserve.engine.scheduler import Scheduler
from tailserve.engine.step_time import queue_overdue
from tailserve.engine.waiting_queue import LATE_SERVED_WEIGHT, DeadlineQueue
from tailserve.errors import ConfigError, QueueFullError, SLOUnattainableError
from tailserve.request import SLO
from tailserve.stepcost import StepTimeModel
from test_scheduler_time import COEF, MARGIN, Clock, _running, make, req, step


def test_a_steps_budget_is_the_smallest_slack_of_its_decodes_less_the_margin() -> None:
    # COEF: 10 ms a step, 1 ms a prompt token, 2 ms a decode. "a" holds its own ITL SLO of
    # 62 ms, "b" the server's 102 ms; right after a step their slack is all of it.
    clock = Clock()
    s = make(clock, target_s=0.100)
    runner = FakeRunner()
    s.add_request(req("a", 8, 0.0, max_tokens=4, slo_itl_s=0.060 + MARGIN))
    s.add_request(req("b", 8, 0.0, max_tokens=50))
    assert step(s, runner, clock) == [("a", 8), ("b", 8)]
    s.add_request(req("long", 600, clock.t))
    # a's slack 62 ms - the 2 ms margin = 60 ms; the decodes take 14: 46 tokens -> 32.
    assert step(s, runner, clock) == [("a", 1), ("b", 1), ("long", 32)]
    assert s.min_decode_slack_s == pytest.approx(0.062)
    assert s.itl_target_s == pytest.approx(0.060)
    # The next step starts 20 ms late: 42 ms of slack, 40 - 14 = 26 ms: 16 tokens.
    clock.t += 0.020
    assert step(s, runner, clock) == [("a", 1), ("b", 1), ("long", 16)]
    assert s.min_decode_slack_s == pytest.approx(0.042)
    # A model less sure of its predictions keeps more margin: 2 x 6 ms + 2 ms = 14 ms,
    # 62 - 14 - 14 = 34 ms: 32 tokens. ("a" has its 4 tokens after this step.)
    s.step_model.sigma_s = 0.006
    assert step(s, runner, clock) == [("a", 1), ("b", 1), ("long", 32)]
    assert s.itl_target_s == pytest.approx(0.048)
    assert "a" not in s.requests
    # ... but never more than a quarter of the slack (a deviation of 170 ms on a host shared
    # with busy processes would leave no 100 ms SLO any prefill at all).
    noisy = StepTimeModel(COEF)
    noisy.sigma_s = 0.170
    assert step_time_budget(noisy, 0.062) == pytest.approx(0.062 * 0.75)
    # Only "b" now: 102 - 2 - 12 = 88 ms of prefill: 64 tokens.
    assert step(s, runner, clock) == [("b", 1), ("long", 64)]
    assert s.itl_target_s == pytest.approx(0.100)
    # Every step stayed within its budget: each decode's gap within its ITL SLO.
    assert all(s.step_model.predict(s.shape_of(o)) <= 0.060 + 1e-9 for o in runner.steps[1:3])


def test_without_an_itl_slo_prefill_takes_the_whole_token_budget_beside_decodes() -> None:
    clock = Clock()
    s = make(clock)  # slo_itl_s None
    runner = FakeRunner()
    s.add_request(req("a", 8, 0.0, max_tokens=50))
    step(s, runner, clock)
    s.add_request(req("long", 600, clock.t))
    assert step(s, runner, clock) == [("a", 1), ("long", 511)]
    assert s.min_decode_slack_s is None and s.itl_target_s is None


def test_a_queue_past_its_ttft_deadline_takes_the_whole_token_budget(itl_cap_only: None) -> None:
    # Two decodes with an ITL SLO that budgets 31 ms: 17 ms of prefill, 16 tokens a step.
    # "late" waits (one long partial prefill at a time). Once a request still waiting for its
    # first token is past its TTFT deadline though its own prefill (610 ms) fits its 1 s SLO,
    # the queue goes first: the step takes the whole token budget the decodes leave.
    clock = Clock()
    s, runner = _running(clock, 2, target_s=0.031, slo_ttft_s=1.0)
    s.add_request(req("long", 600, clock.t))
    s.add_request(req("late", 600, clock.t))
    assert step(s, runner, clock) == [("d0", 1), ("d1", 1), ("long", 16)]
    assert not queue_overdue(s, clock.t + 0.9)
    clock.t += 1.0
    assert queue_overdue(s, clock.t)
    assert step(s, runner, clock) == [("d0", 1), ("d1", 1), ("long", 510)]
    # Late by its own size (a 0.5 s SLO under its 610 ms prefill): best effort, no override
    # until it has waited unscheduled past its starvation bound (its SLO, then its own
    # prefill, the longer: 0.5 + 0.61 s).
    s2, _ = _running(Clock(), 2, target_s=0.031, slo_ttft_s=0.5)
    s2.add_request(req("big", 600, s2._clock()))
    t0 = s2._clock()
    assert not queue_overdue(s2, t0 + 1.10) and queue_overdue(s2, t0 + 1.12)
    # Nor does the ITL SLO cap a step without decodes while the queue is overdue.
    clock = Clock()
    s3 = make(clock, target_s=0.031, slo_ttft_s=1.0)
    s3.add_request(req("a", 600, 0.0))
    assert step(s3, FakeRunner(), clock) == [("a", 16)]  # 10 + 16 ms within the 31 ms cap
    clock.t = 1.5
    assert step(s3, FakeRunner(), clock) == [("a", 512)]


def _three(policy: str) -> list[list[tuple[str, int]]]:
    clock = Clock()
    s = make(clock, max_num_batched_tokens=64, scheduling_policy=policy, slo_ttft_s=1.0)
    s.add_request(req("x", 40, 0.000, slo_ttft_s=2.0))  # due at 2.0
    s.add_request(req("y", 40, 0.001))  # the server's 1 s: due at 1.001
    s.add_request(req("z", 40, 0.002, slo_ttft_s=0.5))  # due at 0.502
    runner = FakeRunner()
    return [step(s, runner, clock) for _ in range(2)]


def test_first_tokens_go_by_ttft_deadline_earliest_first() -> None:
    assert _three("deadline") == [[("z", 40), ("y", 24)], [("y", 16), ("x", 40)]]
    # FCFS (arrival order; SRPT places are equal for equal prompts) for comparison.
    assert _three("fcfs") == [[("x", 40), ("y", 24)], [("y", 16), ("z", 40)]]


def test_a_request_that_can_no_longer_meet_its_deadline_yields_to_one_that_can() -> None:
    # TTFT SLO 100 ms. "big" (200 tokens: 210 ms alone) can no longer meet it: its key moves
    # later by its own prefill, longer than the SLO (0.1 + 0.21 = 0.31), behind "small" (50
    # tokens, 60 ms: due at 0.101), which goes first though it arrived later; big takes what
    # is left (best effort).
    clock = Clock()
    s = make(clock, max_num_batched_tokens=128, scheduling_policy="deadline", slo_ttft_s=0.1)
    s.add_request(req("big", 200, 0.0))
    s.add_request(req("small", 50, 0.001))
    assert s.waiting.prefill_key(s.requests["big"], 0, 0.0)[0] == pytest.approx(0.31)
    assert s.waiting.prefill_key(s.requests["small"], 1, 0.0)[0] == pytest.approx(0.101)
    runner = FakeRunner()
    assert step(s, runner, clock) == [("small", 50), ("big", 78)]
    # Both still feasible: deadline order (big first).
    clock2 = Clock()
    s2 = make(clock2, max_num_batched_tokens=128, scheduling_policy="deadline", slo_ttft_s=1.0)
    s2.add_request(req("big", 200, 0.0))
    s2.add_request(req("small", 50, 0.001))
    assert step(s2, FakeRunner(), clock2) == [("big", 128)]


def test_a_late_request_is_passed_only_by_requests_that_arrived_before_its_bound() -> None:
    """The starvation bound: a late request's key is arrival + its TTFT SLO + the larger of
    that SLO and its own prefill alone (0.3 + 0.41 s here) + twice the time it has been
    prefilled (``LATE_SERVED_WEIGHT``), which grows only while it gets tokens, and every key
    is at least its request's arrival, so no request that arrives after that bound gets its
    first token before it, however many keep coming (here more than the engine serves), and it
    is done by the time the clock reaches that key; before it gets the budget it takes what
    the others leave."""
    clock = Clock()
    slo = 0.3
    s = make(clock, max_num_batched_tokens=64, scheduling_policy="deadline", slo_ttft_s=slo,
             enable_prefix_caching=False)
    runner = FakeRunner()
    s.add_request(req("big", 400, 0.0))  # 410 ms alone: late from the start
    big = s.requests["big"]
    assert isinstance(s.waiting, DeadlineQueue)
    assert s.waiting.starvation_bound(big) == pytest.approx(slo + 0.410)
    arrived: dict[str, float] = {}
    done: dict[str, int] = {}  # the step of each request's first (and only) token
    next_arrival, k = 0.0, 0
    for n in range(300):
        while next_arrival <= clock.t:  # a 40-token prompt every 40 ms; a step takes 74 ms
            rid = f"s{k}"
            s.add_request(req(rid, 40, next_arrival))
            arrived[rid] = next_arrival
            next_arrival += 0.040
            k += 1
        step(s, runner, clock)
        done |= {rid: n for rid in arrived | {"big": 0.0}
                 if rid not in s.requests and rid not in done}
        if "big" in done:
            break
    assert "big" in done
    # Its key at the end: the bound, plus its served time counted LATE_SERVED_WEIGHT times
    # (the steps that carried its prompt, taking what the on-time ones left).
    served = big.timestamps.prefill_time
    assert served > 0
    bound = slo + 0.410 + LATE_SERVED_WEIGHT * served
    before = [r for r, n in done.items() if r != "big" and n < done["big"]]
    assert before and max(arrived[r] for r in before) <= bound
    # However many keep coming, it got its first token by the time the clock reached that
    # key (within a step): each second it is served moves the key two, so once the key is
    # passed nothing newer goes first and it keeps at least half of the time before that.
    assert clock.t <= bound + 0.1


def test_a_late_prompt_being_prefilled_is_passed_by_a_short_one_that_is_on_time() -> None:
    """A late request's key moves on by the time of the steps that carry its prompt: "big"
    (400 tokens, late from the start; its old bound 0.71 s) shares its steps with a 40-token
    prompt every 60 ms (they arrive before its key and go first) and is still being
    prefilled past 0.71 s. A 40-token prompt arriving then, on time, takes its whole prompt
    first and big the rest. With the key fixed at 0.71 big went first and such a prompt got
    what big's chunk left, a few tokens a step, for as long as big's prefill lasted."""
    clock = Clock()
    s = make(clock, max_num_batched_tokens=64, scheduling_policy="deadline", slo_ttft_s=0.3,
             enable_prefix_caching=False)
    runner = FakeRunner()
    s.add_request(req("big", 400, 0.0))
    big = s.requests["big"]
    assert isinstance(s.waiting, DeadlineQueue)
    k, next_arrival = 0, 0.0
    while clock.t <= 0.75:
        while next_arrival <= clock.t:
            s.add_request(req(f"f{k}", 40, next_arrival))
            k, next_arrival = k + 1, next_arrival + 0.060
        step(s, runner, clock)
    assert big.num_computed_tokens < 400  # still in its prompt, past its old bound
    served = big.timestamps.prefill_time
    assert 0 < served <= clock.t
    assert s.waiting.starvation_bound(big) == pytest.approx(0.71 + LATE_SERVED_WEIGHT * served)
    assert s.waiting.starvation_bound(big) > clock.t + 0.3  # the newcomer's key
    s.add_request(req("small", 40, clock.t))
    assert dict(step(s, runner, clock)) == {"big": 24, "small": 40}


def _preempted(policy: str) -> list[str]:
    """Two decodes in a 4-block pool of 4 tokens: "loose" (ITL SLO 1 s) admitted first,
    "tight" (50 ms) second; their third blocks do not fit."""
    clock = Clock()
    s = make(clock, block_size=4, num_kv_blocks=4, max_model_len=16, scheduling_policy=policy)
    s.add_request(req("loose", 4, 0.0, max_tokens=10, slo_itl_s=1.0))
    s.add_request(req("tight", 4, 0.001, max_tokens=10, slo_itl_s=0.05))
    runner = FakeRunner()
    for _ in range(10):
        out = s.schedule()
        clock.t += 0.012
        s.update_from_output(out, runner.execute(out), 0.012)
        s.check_invariants()
        if out.preempted_request_ids:
            return out.preempted_request_ids
    raise AssertionError("no preemption")


def test_preemption_takes_the_decode_with_the_most_slack() -> None:
    assert _preempted("deadline") == ["loose"]
    assert _preempted("fcfs") == ["tight"]  # the newest admission


def test_a_request_is_held_to_its_own_slo_over_the_servers() -> None:
    clock = Clock()
    s = make(clock, target_s=1.0, slo_ttft_s=1.0)
    r = req("own", 20, 0.0, slo_ttft_s=0.5)
    s.add_request(r)
    assert r.slo == SLO(0.5, 1.0 + MARGIN, None) and r.slo_given_ttft
    # 200 tokens take 210 ms alone: a TTFT SLO of its own under that is a 400 that says so
    # (no idle engine could meet it), with admission by SLO off ...
    with pytest.raises(SLOUnattainableError, match=r"200 tokens .* 210 ms .* 100 ms"):
        s.add_request(req("impossible", 200, 0.0, slo_ttft_s=0.1))
    assert "impossible" not in s.requests
    # ... while the server's own SLO, when it cannot be met, is served best effort.
    tight = make(Clock(), target_s=1.0, slo_ttft_s=0.1)
    tight.add_request(req("long", 200, 0.0))
    assert "long" in tight.requests


def test_the_queue_bound_counts_what_fits_the_kv_pool() -> None:
    # 400 blocks of 16 tokens; a 2,000-token prompt needs 125: three fit at once. With
    # --max-queue-len 2 five are held (three that can start, two waiting) and the sixth is
    # refused, not queued behind sixteen seats' worth.
    clock = Clock()
    s = make(clock, max_queue_len=2, max_num_seqs=16, num_kv_blocks=400, max_model_len=4096)
    for i in range(5):
        s.add_request(req(f"long{i}", 2000, 0.0))
    with pytest.raises(QueueFullError, match=r"2 of 2 waiting beyond the 3 that fit .* "
                       r"predicted wait \d+ ms") as exc:
        s.add_request(req("long5", 2000, 0.0))
    assert exc.value.retry_after_s is not None and exc.value.retry_after_s >= 1.0
    # Short prompts: the sixteen seats bound them (16 start, 2 wait, the 19th is refused).
    s = make(Clock(), max_queue_len=2, max_num_seqs=16, num_kv_blocks=400, max_model_len=4096)
    for i in range(18):
        s.add_request(req(f"short{i}", 10, 0.0))
    with pytest.raises(QueueFullError, match="2 of 2 waiting beyond the 16"):
        s.add_request(req("short18", 10, 0.0))


def _run_one(delay_s: float) -> EngineOutput:
    clock = Clock()
    s: Scheduler = make(clock, slo_ttft_s=0.5, slo_itl_s=0.1, slo_tpot_s=0.05)
    runner = FakeRunner()
    s.add_request(req("r", 8, 0.0, max_tokens=4))
    finished = None
    for n in range(4):
        if n == 2:
            clock.t += delay_s  # the host stalls before the third token's step
        out = s.schedule()
        took = s.step_model.predict(s.shape_of(out))
        clock.t += took
        for eo in s.update_from_output(out, runner.execute(out), took):
            finished = eo if eo.finished else finished
    assert finished is not None and finished.timing is not None
    return finished


def test_each_request_says_which_slo_it_met() -> None:
    # First token after 18 ms (10 + 8); then gaps of 12, 12 + delay, 12 ms.
    ok = _run_one(0.0).timing
    assert ok is not None and ok["slo"] == {
        "ttft_s": 0.5, "itl_s": 0.1, "tpot_s": 0.05,
        "ttft_met": True, "itl_met": True, "tpot_met": True}
    late = _run_one(0.2).timing
    # One gap of 212 ms: ITL missed; mean gap (12 + 212 + 12) / 3 = 79 ms: TPOT missed.
    assert late is not None and late["slo"] == {
        "ttft_s": 0.5, "itl_s": 0.1, "tpot_s": 0.05,
        "ttft_met": True, "itl_met": False, "tpot_met": False}


def test_removed_flags_name_their_replacement() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(ConfigError, match=r"--itl-target-factor .* removed; use --slo-itl-ms"):
        engine_args_from(parser.parse_args(["--itl-target-factor", "2"]))
    with pytest.raises(ConfigError, match=r"--enable-itl-target .* removed; use --slo-itl-ms"):
        engine_args_from(parser.parse_args(["--no-enable-itl-target"]))
    with pytest.raises(ConfigError, match=r"--ttft-slo-ms .* --slo-ttft-ms with "
                       r"--enable-slo-admission"):
        check_removed_args({"ttft_slo_ms": 500})
    args = engine_args_from(parser.parse_args(["--slo-itl-ms", "none", "--slo-ttft-ms", "800"]))
    assert args.slo_itl_ms is None and args.slo_ttft_ms == 800.0
    with pytest.raises(ConfigError, match=r"expected milliseconds or 'none', got 'fast'"):
        engine_args_from(parser.parse_args(["--slo-itl-ms", "fast"]))


def test_blocked_reasons_keep_the_strings_the_timeline_carries() -> None:
    assert [r.value for r in BlockedReason] == [
        "kv_cache", "max_num_seqs", "token_budget", "preemption", "itl_target",
        "partial_prefills", "tenant_share"]
    assert str(BlockedReason.STEP_TIME) == "itl_target" and BlockedReason("kv_cache") == "kv_cache"
    # COEF is what these schedules were computed with.
    assert COEF == (0.010, 1.0, 0.020, 0.0, 0.0)
