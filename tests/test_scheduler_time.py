"""Time-budgeted steps (under the ITL SLO), SRPT with aging, max_num_partial_prefills and
TTFT-SLO admission, with a fake runner, a fake clock and a given step-time model (exact chunk
sizes and bounds). A step's budget is the smallest slack of its decodes less the margin:
here the model's error is 0, so the margin is SLACK_FLOOR_S, and right after a step every
decode's slack is its whole ITL SLO: an SLO of ``target + MARGIN`` budgets ``target``."""

from __future__ import annotations

import dataclasses
import itertools
import zlib

import pytest

from fake_runner import EOS, FakeRunner
from tailserve.config import CacheConfig, EngineArgs, SchedulerConfig
from tailserve.engine.calibrate import PLAN
from tailserve.engine.latency import SLACK_FLOOR_S, chunk_under_load, time_limited_chunk
from tailserve.engine.scheduler import MIN_PREFILL_CHUNK, PREFILL_ALIGN, Scheduler
from tailserve.engine.step_phases import RIDER_SCALE
from tailserve.engine.step_time import FIXED_COST_MULTIPLE, prefill_step_cap
from tailserve.errors import ConfigError, QueueFullError, SLORefusedError, SLOUnattainableError
from tailserve.request import SLO, Request
from tailserve.sampling_params import SamplingParams
from tailserve.stepcost import StepShape, StepTimeModel, prefill_attention_pairs

# The engine these tests pretend to run: 10 ms a step + 1 ms a prefill token + 2 ms a decode
# (seconds per scaled feature: base, per 1k prefill tokens, per 10 decodes, context, pairs).
COEF = (0.010, 1.0, 0.020, 0.0, 0.0)
MARGIN = SLACK_FLOOR_S


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(clock: Clock, target_s: float | None = None, **kw: object) -> Scheduler:
    """``target_s``: the budget of a step right after the one before (ITL SLO - MARGIN)."""
    base: dict[str, object] = dict(
        max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024, block_size=16,
        num_kv_blocks=512, watermark=0.0,
        slo_itl_s=None if target_s is None else target_s + MARGIN,
    )
    base.update(kw)
    cache_fields = {f.name for f in dataclasses.fields(CacheConfig)}
    cache = {k: v for k, v in base.items() if k in cache_fields}
    sched = {k: v for k, v in base.items() if k not in cache_fields}
    s = Scheduler(SchedulerConfig(**sched),  # type: ignore[arg-type]
                  CacheConfig(block_bytes=1024, **cache), clock=clock)  # type: ignore[arg-type]
    s.step_model = StepTimeModel(COEF)
    return s


def req(rid: str, n_prompt: int, arrival: float, max_tokens: int = 1,
        priority: int = 0, slo_ttft_s: float | None = None,
        slo_itl_s: float | None = None) -> Request:
    prompt = [(zlib.crc32(rid.encode()) + i) % 40 + 1 for i in range(n_prompt)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=arrival, priority=priority, eos_token_ids=(EOS,),
                   slo=SLO(slo_ttft_s, slo_itl_s))


def step(s: Scheduler, runner: FakeRunner, clock: Clock) -> list[tuple[str, int]]:
    """One step that takes exactly what the model says (so the model stays as given)."""
    out = s.schedule()
    took = s.step_model.predict(s.shape_of(out))
    assert out.predicted_s == pytest.approx(took) or not out.scheduled
    clock.t += took
    s.update_from_output(out, runner.execute(out), took)
    s.check_invariants()
    return [(x.request_id, len(x.token_ids)) for x in out.scheduled]


def test_with_decodes_each_chunk_is_the_largest_aligned_one_within_the_target() -> None:
    clock = Clock()
    # 2 decodes: 10 + 2x2 = 14 ms; 80 ms leaves 66 tokens -> 64 (a multiple of 32).
    s = make(clock, target_s=0.080)
    runner = FakeRunner()
    for rid in ("a", "b"):
        s.add_request(req(rid, 8, 0.0, max_tokens=50))
    assert step(s, runner, clock) == [("a", 8), ("b", 8)]  # no decodes yet: whole budget
    s.add_request(req("long", 200, clock.t))
    sizes = [step(s, runner, clock) for _ in range(4)]
    assert sizes == [[("a", 1), ("b", 1), ("long", 64)]] * 3 + [[("a", 1), ("b", 1),
                                                                  ("long", 8)]]
    assert all(s.step_model.predict(s.shape_of(o)) <= 0.080 for o in runner.steps)
    # Without the target the same prompt is one chunk of the token budget left.
    s2 = make(Clock())
    for rid in ("a", "b"):
        s2.add_request(req(rid, 8, 0.0, max_tokens=50))
    step(s2, FakeRunner(), Clock())
    s2.add_request(req("long", 200, 0.0))
    assert step(s2, FakeRunner(), Clock()) == [("a", 1), ("b", 1), ("long", 200)]


def _running(clock: Clock, decodes: int, coef: tuple[float, ...] = COEF,
             **kw: object) -> tuple[Scheduler, FakeRunner]:
    """A scheduler with ``decodes`` requests decoding."""
    s = make(clock, **{"max_num_seqs": 32, **kw})  # type: ignore[arg-type]
    s.step_model = StepTimeModel(coef)
    runner = FakeRunner()
    for i in range(decodes):
        s.add_request(req(f"d{i}", 8, 0.0, max_tokens=100))
    step(s, runner, clock)  # their prefill: no decodes yet, the whole budget
    return s, runner


def test_no_decodes_means_the_whole_token_budget_within_the_itl_slo() -> None:
    clock = Clock()
    s = make(clock, target_s=1.0, max_num_batched_tokens=256)
    s.add_request(req("long", 600, 0.0))
    assert step(s, FakeRunner(), clock) == [("long", 256)]


def test_a_step_without_decodes_is_capped_by_the_itl_slo() -> None:
    # An ITL SLO that budgets 126 ms: a prefill-only step may take that (what a decode would
    # allow right after its token): 116 prompt tokens -> 96 (aligned), not the 256 of the
    # budget (266 ms). A short prompt arriving meanwhile waits for one such step, then goes
    # first; the long one rides behind its first token in at most as much time again
    # (RIDER_SCALE x the 50 ms step: 32 tokens, not the 64 the 126 ms cap would leave).
    clock = Clock()
    s = make(clock, target_s=0.126, max_num_batched_tokens=256)
    runner = FakeRunner()
    assert prefill_step_cap(s) == pytest.approx(0.126)
    s.add_request(req("long", 600, 0.0))
    assert step(s, runner, clock) == [("long", 96)]
    arrived = clock.t - 0.050  # mid-step
    s.add_request(req("short", 40, arrived))
    assert step(s, runner, clock) == [("long", 32), ("short", 40)]
    assert "short" not in s.requests and clock.t - arrived <= 0.050 + 0.100  # its first token
    assert s.step_model.predict(s.shape_of(runner.steps[-1])) <= RIDER_SCALE * s.step_model.predict(
        StepShape().plus_chunk(0, 40)) + 1e-12
    assert all(s.step_model.predict(s.shape_of(o)) <= 0.126 + 1e-12 for o in runner.steps)
    # Never more than a budget-sized first chunk (266 ms); a running request's own, tighter
    # ITL SLO caps it too, down to FIXED_COST_MULTIPLE x the step's fixed cost (10 x 10 ms);
    # no ITL SLO, no cap.
    assert prefill_step_cap(make(Clock(), max_num_batched_tokens=256,
                                 target_s=5.0)) == pytest.approx(0.266)
    tight = make(Clock(), target_s=5.0)
    tight.running.append(req("t", 8, 0.0, slo_itl_s=0.030 + MARGIN))
    assert prefill_step_cap(tight) == pytest.approx(FIXED_COST_MULTIPLE * 0.010)
    assert prefill_step_cap(make(Clock())) is None


@pytest.mark.parametrize(("slo_ttft_s", "ride"), [(2.0, 32), (0.5, 0)])
def test_a_prompt_past_its_ttft_slo_alone_does_not_ride_behind_a_first_token(
        slo_ttft_s: float, ride: int) -> None:
    """A 600-token prompt takes 610 ms alone, in 96-token steps under a 126 ms cap. A short
    prompt arrives mid-step and goes first. Held to the server's 2 s TTFT SLO the long one
    can meet it and rides behind the short one's first token in at most as much time again
    (RIDER_SCALE x 50 ms: 32 tokens); held to 0.5 s it cannot even alone, is served best
    effort and does not ride: the short step is its own 50 ms."""
    clock = Clock()
    s = make(clock, target_s=0.126, max_num_batched_tokens=256, slo_ttft_s=slo_ttft_s)
    runner = FakeRunner()
    s.add_request(req("long", 600, 0.0))
    assert step(s, runner, clock) == [("long", 96)]
    arrived = clock.t - 0.050  # mid-step
    s.add_request(req("short", 40, arrived))
    assert step(s, runner, clock) == ([("long", ride)] if ride else []) + [("short", 40)]
    assert "short" not in s.requests
    assert clock.t - arrived == pytest.approx(0.050 + 0.050 + 0.001 * ride)
    assert step(s, runner, clock) == [("long", 96)]  # then the cap again


def test_a_lone_prompt_on_a_heavy_model_is_not_cut_into_tiny_steps() -> None:
    """A model whose every step costs 30 ms before its tokens (its weights streamed), 2.5 ms
    a prompt token (the Llama-3.2-1B shape's figures on 2 cores): the ITL SLO's 98 ms would
    allow 16-token steps, each mostly the fixed cost. The cap is 10 x 30 ms instead: 96-token
    steps, the fixed cost ~1/9 of the prefill."""
    clock = Clock()
    s = make(clock, target_s=0.098, max_num_batched_tokens=512)
    s.step_model = StepTimeModel((0.030, 2.5, 0.020, 0.0, 0.0))
    assert prefill_step_cap(s) == pytest.approx(0.300)
    s.add_request(req("long", 1000, 0.0))
    runner = FakeRunner()
    assert step(s, runner, clock) == [("long", 96)]
    assert step(s, runner, clock) == [("long", 96)]


def test_prefill_progresses_when_decodes_alone_fill_the_target() -> None:
    clock = Clock()
    s = make(clock, target_s=0.012)  # one decode step is 12 ms: nothing is left
    runner = FakeRunner()
    s.add_request(req("a", 8, 0.0, max_tokens=50))
    step(s, runner, clock)
    s.add_request(req("long", 100, clock.t))
    out = s.schedule()
    assert [(x.request_id, len(x.token_ids)) for x in out.scheduled] == [
        ("a", 1), ("long", PREFILL_ALIGN)]
    assert out.admission_blocked_by is None


@pytest.mark.parametrize(("target_ms", "chunk"), [
    # One decode: 12 ms alone (COEF: 10 + 2), then 1 ms a prompt token. 30 ms leaves 18 ->
    # no multiple of 32, but 16; 21 ms leaves 9 -> 8; 12.5 leaves 0.5: nothing fits, and
    # the decodes alone are within the target, so the smallest chunk (the step nearest it).
    (30.0, 16), (21.0, 8), (12.5, MIN_PREFILL_CHUNK), (50.0, 32), (80.0, 64),
])
def test_below_the_aligned_sizes_the_chunk_is_16_or_8_tokens(target_ms: float,
                                                              chunk: int) -> None:
    clock = Clock()
    s = make(clock, target_s=target_ms / 1e3)
    runner = FakeRunner()
    s.add_request(req("a", 8, 0.0, max_tokens=50))
    step(s, runner, clock)
    s.add_request(req("long", 100, clock.t))
    assert step(s, runner, clock) == [("a", 1), ("long", chunk)]
    # The TTFT prediction sizes a new prompt's chunks the same way.
    assert chunk_under_load(s.step_model, 512, target_ms / 1e3, StepShape(0, 1, 9, 0)) == chunk


def test_a_late_chunk_of_a_long_prompt_shrinks_with_its_attention() -> None:
    # Attention pairs cost (1 ms per 1k): the same target leaves fewer tokens the further
    # into the prompt a chunk starts, down to 16 and then 8 tokens.
    coef = (0.010, 1.0, 0.020, 0.0, 1.0)
    sizes = []
    for start in (0, 300, 900):
        model = StepTimeModel(coef)
        base = StepShape(0, 1, 100, 0)
        sizes.append(time_limited_chunk(model, base, start, 500, 0.040, first_chunk=True))
    assert sizes == [16, 16, 8]
    model = StepTimeModel(coef)
    assert model.predict(StepShape(0, 1, 100, 0).plus_chunk(900, 16)) > 0.040
    assert model.predict(StepShape(0, 1, 100, 0).plus_chunk(900, 8)) <= 0.040
    # Not the step's first chunk: nothing rather than over the target.
    assert time_limited_chunk(StepTimeModel(coef), StepShape(0, 1, 100, 0).plus_chunk(0, 16),
                              2000, 500, 0.040, first_chunk=False) == 0


def test_with_no_decode_a_step_is_capped_at_a_budget_sized_first_chunk(
        no_arrival_risk: None) -> None:
    # 10 ms a step + 1 ms a prompt token + 3 us an attention pair; budget 64: the first
    # chunk (64 tokens, 2,080 pairs) is predicted at 80.24 ms, the cap. Later chunks read
    # more context and are cut (multiples of 32, then 16 / 8) so no step passes it.
    coef = (0.010, 1.0, 0.020, 0.0, 3.0)
    clock = Clock()
    s = make(clock, target_s=1.0, max_num_batched_tokens=64, max_num_seqs=16)
    s.step_model = StepTimeModel(coef)
    runner = FakeRunner()
    s.add_request(req("long", 1000, 0.0))
    cap = prefill_step_cap(s)
    assert cap == pytest.approx(0.010 + 0.064 + 3 * 0.002080)
    chunks = []
    while sum(chunks) < 1000:
        chunks += [n for rid, n in step(s, runner, clock) if rid == "long"]
    assert chunks[:3] == [64, 32, 32]
    assert chunks[-1] == 1000 - sum(chunks[:-1])
    assert all(b <= a for a, b in itertools.pairwise(chunks[:-1]))
    assert {8, 16} & set(chunks)  # deep into the prompt, 32 tokens no longer fit
    # The last chunk completes the prompt: it may take the step to twice the cap.
    assert all(s.step_model.predict(s.shape_of(o)) <= cap + 1e-12 for o in runner.steps[:-1])
    assert s.step_model.predict(s.shape_of(runner.steps[-1])) <= 2 * cap + 1e-12
    # A short prompt arriving meanwhile goes first in the next step (its place is earlier
    # than the long one's: arrival + 1,000 x 2 ms of aging), and the long one rides behind
    # its first token in at most as much time again (RIDER_SCALE): 16 tokens.
    clock = Clock()
    s = make(clock, target_s=1.0, max_num_batched_tokens=64, max_num_seqs=16)
    s.step_model = StepTimeModel(coef)
    s.add_request(req("long", 1000, 0.0))
    for _ in range(3):
        step(s, runner, clock)
    s.add_request(req("short", 20, clock.t))
    sizes = dict(step(s, runner, clock))
    assert sizes["short"] == 20 and sizes["long"] == 16
    assert s.step_model.predict(s.shape_of(runner.steps[-1])) <= cap + 1e-12
    # Steps not sized by time: every chunk is the token budget.
    clock = Clock()
    s = make(clock, max_num_batched_tokens=64)
    s.step_model = StepTimeModel(coef)
    assert prefill_step_cap(s) is None
    s.add_request(req("long", 1000, 0.0))
    assert [step(s, runner, clock) for _ in range(3)] == [[("long", 64)]] * 3


@pytest.mark.parametrize(("short_len", "chunk"), [(30, 30), (50, 50), (70, 8)])
def test_without_decodes_a_prompt_that_completes_may_take_the_step_to_twice_the_cap(
        short_len: int, chunk: int, itl_cap_only: None) -> None:
    # A 50 ms cap (10 ms a step + 1 ms a token): the long prompt goes first (fcfs) with 32
    # tokens (42 ms). A short prompt that completes goes whole while the step stays within
    # 100 ms (30 or 50 more tokens); one that would not (70) gets what the cap leaves (8).
    clock = Clock()
    s = make(clock, target_s=0.050, max_num_batched_tokens=256, prefill_scheduling="fcfs")
    runner = FakeRunner()
    s.add_request(req("long", 600, 0.0))
    assert step(s, runner, clock) == [("long", 32)]
    s.add_request(req("short", short_len, clock.t))
    assert step(s, runner, clock) == [("long", 32), ("short", chunk)]
    # With decodes running their slack has no such exception.
    # (Two decodes: 14 ms; 31 ms leaves 17 tokens: 16, and the short prompt does not complete.)
    clock = Clock()
    s, runner = _running(clock, 2, coef=COEF, target_s=0.031)
    s.add_request(req("short", 30, clock.t))
    assert step(s, runner, clock)[-1] == ("short", 16)


def test_srpt_serves_the_shortest_remaining_prefill_first() -> None:
    clock = Clock()
    s = make(clock, max_num_batched_tokens=64)
    s.add_request(req("long", 300, 0.000))
    s.add_request(req("mid", 100, 0.001))
    s.add_request(req("short", 20, 0.002))
    # Places: long 0.15 s, mid 0.051, short 0.012 (arrival + 0.5 ms per token).
    assert step(s, FakeRunner(), clock) == [("short", 20), ("mid", 44)]
    fcfs = make(Clock(), max_num_batched_tokens=64, prefill_scheduling="fcfs")
    for r in (req("long", 300, 0.0), req("mid", 100, 0.001), req("short", 20, 0.002)):
        fcfs.add_request(r)
    assert step(fcfs, FakeRunner(), Clock()) == [("long", 64)]


def test_a_prompt_ages_while_it_waits_not_while_it_is_prefilled() -> None:
    # A 600-token prompt alone, 64 tokens a step (74 ms: 10 + 64 x 1 ms). After 6 steps
    # (t = 0.444 s) it has 216 tokens left: counted from its arrival alone its place would
    # be 0 + 216 x 2 ms = 0.432 s, before a 40-token prompt arriving now (0.444 + 0.080),
    # which would wait for all of it. Its place counts the 0.444 s it was being served too
    # (0.876 s), so the short prompt goes first; the long one keeps the rest of the budget.
    clock = Clock()
    s = make(clock, target_s=1.0, max_num_batched_tokens=64)
    runner = FakeRunner()
    s.add_request(req("long", 600, 0.0))
    for _ in range(6):
        assert step(s, runner, clock) == [("long", 64)]
    assert clock.t == pytest.approx(0.444)
    s.add_request(req("short", 40, clock.t))
    assert step(s, runner, clock) == [("long", 24), ("short", 40)]
    assert "short" not in s.requests
    # One that was never served keeps its place: arrival + 600 x 2 ms (the aging bound).
    waiting = req("queued", 600, 0.0)
    assert s.waiting.prefill_key(waiting, 0, clock.t)[1] == pytest.approx(1.2)


@pytest.mark.parametrize(("aging", "max_tokens"), [(0.5e-3, 1), (1.0, 1), (0.5e-3, 3)])
def test_aging_bounds_the_wait_of_a_long_prompt(aging: float, max_tokens: int) -> None:
    """A 400-token prompt at t=0 among 32-token prompts arriving faster than they are served:
    its place is 0 + 400 x aging; no prompt that arrived after place - 32 x aging passes it.
    With aging that slow (1 s a token: pure SRPT for these 8 s) it is starved for as long as
    short prompts keep coming. With outputs of 3 tokens decodes run beside the prefills and
    their slack under the ITL SLO sizes the chunks: the order, and so the bound, holds."""
    clock = Clock()
    # No prefix cache: a short prompt sharing a block with an earlier one would cost less.
    s = make(clock, target_s=0.060, max_num_batched_tokens=32, prefill_aging_s_per_token=aging,
             enable_prefix_caching=False)
    runner = FakeRunner()
    s.add_request(req("long", 400, 0.0))
    arrived: dict[str, float] = {}
    first: dict[str, int] = {}
    next_arrival, k = 0.0, 0
    for n in range(200):
        while next_arrival <= clock.t:  # one short prompt every 30 ms; a step takes 42 ms
            rid = f"s{k}"
            s.add_request(req(rid, 32, next_arrival, max_tokens=max_tokens))
            arrived[rid] = next_arrival
            next_arrival += 0.030
            k += 1
        for rid, _ in step(s, runner, clock):
            first.setdefault(rid, n)
        if "long" in first:
            break
    bound = (400 - 32) * aging
    if bound > clock.t:
        assert "long" not in first  # starved for all 200 steps
        return
    started = first["long"]
    passed = [rid for rid, n in first.items() if rid != "long" and n <= started]
    assert passed and max(arrived[r] for r in passed) <= bound
    # And it did wait for every short prompt that arrived before its bound and was queued.
    assert all(first.get(r, started + 1) <= started for r, t in arrived.items()
               if t < bound - 0.030 and r in first)


def test_only_a_long_prompt_rides_behind_a_first_token_and_its_last_chunk_keeps_the_cap(
        ) -> None:
    # 10 ms a step + 1 ms a token, a 96-token budget: the cap is its chunk's 106 ms. p0 and
    # p1 complete (26 ms); p2's 90 tokens alone (100 ms) fit the cap, so it is a short
    # prompt: cut by the token budget, it rides in full (80 tokens), not held to twice the
    # 26 ms step (16), so a step of many prompts is not cut to the size of the first ones.
    clock = Clock()
    s = make(clock, target_s=0.126, max_num_batched_tokens=96)
    assert prefill_step_cap(s) == pytest.approx(0.106)
    runner = FakeRunner()
    for i, n in enumerate((8, 8, 90)):
        s.add_request(req(f"p{i}", n, 0.0))
    assert step(s, runner, clock) == [("p0", 8), ("p1", 8), ("p2", 80)]
    # A long prompt's last chunk alone keeps to the cap (no step to twice it: an arrival
    # would wait for it), where a short prompt's rest may go whole (the test below).
    clock = Clock()
    s = make(clock, target_s=0.126, max_num_batched_tokens=512)
    s.add_request(req("long", 420, 0.0))
    sizes = [step(s, runner, clock)[0][1] for _ in range(4)]
    assert sizes[:3] == [96, 96, 96] and sum(sizes) < 420  # 132 left: 142 ms alone > 126
    assert all(s.step_model.predict(s.shape_of(o)) <= 0.126 + 1e-12 for o in runner.steps[-4:])
    # Its last chunk rides behind a short prompt's first token like any other (30 ms with
    # the short one's 20 tokens: 60 ms at most, 16 tokens), not to the cap.
    clock = Clock()
    s = make(clock, target_s=0.126, max_num_batched_tokens=512)
    s.add_request(req("long", 420, 0.0))
    for _ in range(3):
        step(s, runner, clock)
    s.add_request(req("short", 20, clock.t))
    assert step(s, runner, clock) == [("long", 16), ("short", 20)]


def test_max_num_partial_prefills_is_enforced() -> None:
    def first_step(limit: int, long_limit: int = 1) -> tuple[list[tuple[str, int]], str | None]:
        clock = Clock()
        s = make(clock, max_num_batched_tokens=96, long_prefill_token_threshold=32,
                 max_num_partial_prefills=limit, max_long_partial_prefills=long_limit)
        s.add_request(req("a", 200, 0.0))
        s.add_request(req("b", 200, 0.001))
        s.add_request(req("c", 10, 0.002))
        out = s.schedule()
        return [(x.request_id, len(x.token_ids)) for x in out.scheduled], \
            out.admission_blocked_by

    # c (done in this step) goes first; a is left part-way; b would be a second partial
    # (and a second long one: 200 tokens are over the 32-token threshold).
    assert first_step(1) == ([("c", 10), ("a", 32)], "partial_prefills")
    assert first_step(2) == ([("c", 10), ("a", 32)], "partial_prefills")
    assert first_step(2, long_limit=2) == ([("c", 10), ("a", 32), ("b", 32)], None)


def test_a_short_prompt_starts_beside_a_long_partial_prefill() -> None:
    # One decode (12 ms) under a fixed 46 ms target leaves 34 tokens: 32-token chunks. The
    # long prompt (600 > the 512 budget) is part-way when a 100-token one arrives: with one
    # partial prefill allowed in all it waits for the whole long prompt; with the default
    # (4 in all, 1 long) it goes first (its SRPT place is earlier) and the long one waits,
    # then rides behind the short one's last 4 tokens in as much time again (RIDER_SCALE).
    def steps(**kw: object) -> tuple[list[list[tuple[str, int]]], Scheduler]:
        clock = Clock()
        s = make(clock, target_s=0.046, **kw)
        runner = FakeRunner()
        s.add_request(req("a", 8, 0.0, max_tokens=100))
        step(s, runner, clock)
        s.add_request(req("long", 600, clock.t))
        step(s, runner, clock)
        s.add_request(req("short", 100, clock.t))
        return [step(s, runner, clock) for _ in range(4)], s

    held, s = steps(max_num_partial_prefills=1)
    assert held == [[("a", 1), ("long", 32)]] * 4
    assert s.requests["short"].status.name == "WAITING"
    went, s = steps()
    assert went == [[("a", 1), ("short", 32)]] * 3 + [[("a", 1), ("long", 8), ("short", 4)]]
    assert "short" not in s.requests  # its one token came in the fourth step


def test_ttft_slo_refuses_with_the_prediction_and_admits_priority_ahead() -> None:
    clock = Clock()
    # Steps without decodes capped at 1 s: a prompt goes in one step.
    s = make(clock, target_s=1.0, slo_ttft_s=0.100, enable_slo_admission=True,
             scheduling_policy="priority")
    # On an idle engine 200 tokens take 10 + 200 = 210 ms: never within 100 ms.
    with pytest.raises(SLOUnattainableError, match=r"200 tokens .* 210 ms .* idle engine"):
        s.add_request(req("big", 200, 0.0))
    # Capped at 96 ms they go in chunks of 64: 3 x 74 + 18 = 240 ms.
    assert make(Clock(), target_s=0.096).predict_ttft(req("big", 200, 0.0)) == \
        pytest.approx((0.240, 0.240))
    s.add_request(req("first", 50, 0.0))  # 60 ms: admitted
    with pytest.raises(SLORefusedError, match=r"predicted time to first token 120 ms exceeds "
                       r"the TTFT SLO of 100 ms") as exc:
        s.add_request(req("second", 50, 0.001))
    assert isinstance(exc.value, QueueFullError)  # a 429
    assert exc.value.predicted_ttft_s == pytest.approx(0.120)
    assert exc.value.retry_after_s == 1.0
    # A more urgent request does not count the queue behind it.
    s.add_request(req("urgent", 50, 0.002, priority=-1))
    assert [r.request_id for r in s.waiting] == ["urgent", "first"]


@pytest.mark.parametrize(("field", "value"), [
    ("slo_itl_ms", 0.0), ("slo_itl_ms", -5.0), ("slo_itl_ms", 1e9),
    ("slo_itl_ms", float("nan")), ("slo_ttft_ms", 0.0), ("slo_ttft_ms", -1.0),
    ("slo_ttft_ms", 1e12), ("slo_tpot_ms", 0.0), ("slo_tpot_ms", float("inf")),
    ("max_num_partial_prefills", 0), ("max_long_partial_prefills", 0),
    ("max_long_partial_prefills", 5), ("prefill_aging_s_per_1k_tokens", 0.0),
])
def test_bad_flag_values_fail_at_start_up_with_the_numbers(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=rf"{field} must be .*got {value}"):
        EngineArgs(**{field: value})  # type: ignore[arg-type]


def test_the_engines_model_follows_a_throttled_runner() -> None:
    """The scheduler's own model, fed the fake runner's step times: the host turns twice as
    slow at step 60 and the predictions the scheduler budgets with follow within FOLLOW_STEPS
    (the host's multiplier moves at most 7.5% a step, so a 2x change takes ~10 to be seen)."""
    FOLLOW_STEPS = 40
    clock = Clock()
    s = make(clock, target_s=0.200)
    # Seeded as the engine seeds it: the calibration plan's shapes, timed on this "host".
    s.step_model = StepTimeModel()
    plan = [StepShape(c, d, d * ctx, prefill_attention_pairs(st, c)) for d, ctx, c, st in PLAN]
    s.step_model.seed(plan, [StepTimeModel(COEF).predict(sh) for sh in plan])
    runner = FakeRunner()
    errors: list[float] = []
    k = 0
    for n in range(120):
        if n % 3 == 0:  # a stream of mixed prompts keeps prefill and decodes in the steps
            s.add_request(req(f"r{k}", 16 + 48 * (k % 5), clock.t, max_tokens=12))
            k += 1
        out = s.schedule()
        truth = StepTimeModel(COEF).predict(s.shape_of(out)) * (2.0 if n >= 60 else 1.0)
        if n >= 10 and out.predicted_s is not None:
            errors.append(abs(out.predicted_s - truth) / truth)
        clock.t += truth
        s.update_from_output(out, runner.execute(out), truth)
    before, surprise, after = errors[40:50], errors[50], errors[50 + FOLLOW_STEPS:]
    # Followed: every prediction within 15% again, half of them within 6% (the multiplier
    # chases step-to-step ratios, so the structure of the fit wobbles a little around it).
    assert max(before) < 0.05 and surprise > 0.4, (before, surprise)
    assert max(after) < 0.15 and sorted(after)[len(after) // 2] < 0.06, after


@pytest.mark.parametrize("max_seqs", [1, 2, 8, 64])
def test_calibration_steps_never_exceed_max_num_seqs(max_seqs: int) -> None:
    """A CUDA runner's step buffers and graphs are sized by max_num_seqs and refuse a wider
    step (found on an H200: max_num_seqs=8 failed at start-up on the plan's 16-decode step)."""
    from tailserve.data.step import RunnerOutput, SchedulerOutput
    from tailserve.engine.calibrate import calibrate

    widths: list[int] = []

    class Rows:
        def execute(self, sched: SchedulerOutput) -> RunnerOutput:
            widths.append(len(sched.scheduled))
            return RunnerOutput({})

    timed = calibrate(Rows(), StepTimeModel(), block_size=16, num_blocks=4096,
                      max_tokens=2048, max_model_len=4096, max_seqs=max_seqs, budget_s=10.0)
    assert widths and max(widths) <= max_seqs
    assert timed == sum(1 for d, _, c, _ in PLAN if d + (c > 0) <= max_seqs)


def test_calibration_on_a_slow_host_determines_every_coefficient(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a host where each step outlasts the budget the plan stops at MIN_STEPS; those steps
    must still pin all five coefficients. Truth shaped like the Llama-3.2-3B Q4_0 shape on 2
    cores (60 ms a step's fixed cost, 5.4 ms a prompt token, 1.8 s per million attention
    pairs): the seed recovers it, so the floor under steps without decodes (10x the fixed
    cost) is there from the first prompt on."""
    import tailserve.engine.calibrate as cal
    from tailserve.data.step import RunnerOutput, SchedulerOutput

    truth = StepTimeModel((0.060, 5.4, 0.012, 0.002, 1.8))
    clock = Clock()
    monkeypatch.setattr(cal.time, "perf_counter", lambda: clock.t)

    class SlowHost:
        def execute(self, sched: SchedulerOutput) -> RunnerOutput:
            clock.t += truth.predict(StepShape(
                sched.num_prefill_tokens, sched.num_decode_seqs,
                sched.num_decode_context_tokens, sched.prefill_attention_pairs))
            return RunnerOutput({})

    model = StepTimeModel()
    timed = cal.calibrate(SlowHost(), model, block_size=16, num_blocks=4096, max_tokens=2048,
                          max_model_len=4096, max_seqs=64, budget_s=0.05)
    assert timed == cal.MIN_STEPS
    assert model.coef == pytest.approx(truth.coef, rel=1e-3, abs=1e-6)
