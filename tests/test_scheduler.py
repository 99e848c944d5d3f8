"""Scheduler + block manager with a fake runner: budgets, chunking, preemption, admission."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_runner import EOS, FakeRunner, next_token
from tailserve.config import CacheConfig, SchedulerConfig
from tailserve.data.step import EngineOutput
from tailserve.engine.scheduler import Scheduler
from tailserve.errors import ConfigError, InvalidRequestError, QueueFullError
from tailserve.request import Request, RequestStatus
from tailserve.sampling_params import SamplingParams


def make(**kw: object) -> Scheduler:
    """A scheduler over a pool of 64 blocks of 4 tokens; ``kw`` sets fields of either config."""
    base: dict[str, object] = dict(
        max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64, block_size=4,
        num_kv_blocks=64, watermark=0.0,
    )
    base.update(kw)
    cache_fields = {f.name for f in dataclasses.fields(CacheConfig)}
    cache = {k: v for k, v in base.items() if k in cache_fields}
    sched = {k: v for k, v in base.items() if k not in cache_fields}
    return Scheduler(
        SchedulerConfig(**sched),  # type: ignore[arg-type]
        CacheConfig(block_bytes=1024, **cache),  # type: ignore[arg-type]
    )


def req(rid: str, n_prompt: int, max_tokens: int = 4, priority: int = 0,
        arrival: float = 0.0) -> Request:
    # crc32, not hash(): str hashes change per process, and two ids whose hashes agree mod 40
    # would share a prompt (and the prefix cache) in one run in forty.
    prompt = [(zlib.crc32(rid.encode()) + i) % 40 + 1 for i in range(n_prompt)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=False),
                   arrival_time=arrival, priority=priority, eos_token_ids=(EOS,))


def step(s: Scheduler, runner: FakeRunner) -> list[EngineOutput]:
    out = s.schedule()
    res = runner.execute(out)
    outputs = s.update_from_output(out, res, 0.001)
    s.check_invariants()
    return outputs


def run_all(s: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        for o in step(s, runner):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert not s.has_unfinished_requests()
    return tokens


def expected_tokens(r: Request, n: int) -> list[int]:
    known = list(r.prompt_token_ids)
    for _ in range(n):
        known.append(next_token(known))
    return known[len(r.prompt_token_ids):]


def test_scheduler_modules_do_not_import_torch() -> None:
    code = ("import sys, tailserve.engine.scheduler, tailserve.kv.manager; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_decodes_are_scheduled_before_prefill_chunks() -> None:
    s = make(max_num_batched_tokens=16, max_num_seqs=4)
    runner = FakeRunner()
    s.add_request(req("a", 3, max_tokens=10))
    step(s, runner)  # a prefills its 3 tokens and samples
    s.add_request(req("long", 40, max_tokens=2))
    out = s.schedule()
    # a's decode comes first; long takes the 15 tokens left of the budget.
    assert [(x.request_id, len(x.token_ids), x.is_prefill) for x in out.scheduled] == [
        ("a", 1, False), ("long", 15, True)]
    assert out.num_prefill_tokens == 15 and out.num_decode_seqs == 1
    assert not out.scheduled[1].sample  # a partial chunk samples nothing


def test_long_prefill_threshold_caps_a_chunk() -> None:
    s = make(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    s.add_request(req("long", 30))
    out = s.schedule()
    assert [len(x.token_ids) for x in out.scheduled] == [8]


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    s = make(max_num_batched_tokens=64, enable_chunked_prefill=False)
    runner = FakeRunner()
    s.add_request(req("a", 40, max_tokens=8))
    s.add_request(req("b", 40, max_tokens=8))
    out = s.schedule()
    assert [(x.request_id, len(x.token_ids)) for x in out.scheduled] == [("a", 40)]
    assert out.admission_blocked_by == "token_budget"
    s.update_from_output(out, runner.execute(out), 0.0)


def test_chunked_output_equals_unchunked_output() -> None:
    results = []
    for chunked in (True, False):
        s = make(max_num_batched_tokens=64 if not chunked else 8,
                 enable_chunked_prefill=chunked)
        reqs = [req(f"r{i}", 5 + 7 * i, max_tokens=6) for i in range(5)]
        for r in reqs:
            s.add_request(r)
        results.append(run_all(s, FakeRunner()))
    assert results[0] == results[1]
    assert results[0]["r3"] == expected_tokens(req("r3", 26, 6), 6)


def test_preemption_takes_newest_and_recomputes_to_the_same_answer() -> None:
    # 12 blocks of 4 tokens: three 14-token prompts growing by 10 tokens cannot all fit.
    s = make(num_kv_blocks=12, max_num_batched_tokens=64, max_model_len=48)
    runner = FakeRunner()
    reqs = [req(f"r{i}", 14, max_tokens=10) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    tokens = run_all(s, runner)
    preempted = [rid for step_out in runner.steps for rid in step_out.preempted_request_ids]
    assert preempted, "the pool was sized to force a preemption"
    assert preempted[0] == "r2"  # the newest admission goes first
    assert reqs[2].num_preemptions >= 1
    assert reqs[2].timestamps.preempted and reqs[2].timestamps.resumed
    for r in reqs:
        assert tokens[r.request_id] == expected_tokens(r, 10)


def test_reserve_policy_never_preempts() -> None:
    s = make(num_kv_blocks=12, max_num_batched_tokens=64, max_model_len=48,
             admission_policy="reserve")
    runner = FakeRunner()
    reqs = [req(f"r{i}", 14, max_tokens=10) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    first = s.schedule()
    # 24 tokens = 6 blocks each: two fit in 12, the third waits instead of being preempted later.
    assert [x.request_id for x in first.scheduled] == ["r0", "r1"]
    assert first.admission_blocked_by == "kv_cache"
    s.update_from_output(first, runner.execute(first), 0.0)
    tokens = run_all(s, runner)
    assert all(not st.preempted_request_ids for st in runner.steps)
    assert tokens["r2"] == expected_tokens(reqs[2], 10)


def test_max_num_seqs_bounds_running() -> None:
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add_request(req(f"r{i}", 3))
    out = s.schedule()
    assert [x.request_id for x in out.scheduled] == ["r0", "r1"]
    assert out.admission_blocked_by == "max_num_seqs"
    assert s.snapshot().num_waiting == 2


def test_priority_policy_admits_lowest_value_first() -> None:
    s = make(max_num_seqs=1, scheduling_policy="priority")
    s.add_request(req("late_urgent", 3, priority=0, arrival=2.0))
    s.add_request(req("early_lax", 3, priority=5, arrival=1.0))
    s.add_request(req("early_urgent", 3, priority=0, arrival=1.0))
    assert [x.request_id for x in s.schedule().scheduled] == ["early_urgent"]


def test_stop_conditions_and_finish_reasons() -> None:
    s = make()
    runner = FakeRunner()
    r = req("a", 3, max_tokens=3)
    s.add_request(r)
    outs = [o for _ in range(3) for o in step(s, runner)]
    assert outs[-1].finish_reason is not None and outs[-1].finish_reason.value == "length"
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    timing = outs[-1].timing
    assert timing is not None and timing["output_tokens"] == 3 and timing["num_steps"] == 3
    # A stop token id ends it with finish_reason stop and the id as stop_reason.
    first = expected_tokens(req("b", 3), 1)[0]
    b = req("b", 3, max_tokens=5)
    # SamplingParams are frozen: the request gets params that carry the stop id.
    b.sampling_params = dataclasses.replace(b.sampling_params, stop_token_ids=[first])
    s.add_request(b)
    (o,) = step(s, runner)
    assert o.finish_reason is not None and o.finish_reason.value == "stop"
    assert o.stop_reason == first


def test_snapshot_reports_queues_blocks_bands_and_prefix_counters() -> None:
    s = make(max_num_seqs=2)  # 64 blocks of 4 tokens: 32 bands of 2 block ids
    for rid in ("a", "b", "c"):
        s.add_request(req(rid, 5, max_tokens=8))
    s.schedule()
    snap = s.snapshot()
    assert (snap.num_running, snap.num_waiting, snap.num_preemptions_total) == (2, 1, 0)
    # a and b: 5 prompt tokens -> 2 blocks each, taken from the front of the free queue.
    assert (snap.kv.num_blocks, snap.kv.num_free_blocks) == (64, 60)
    assert snap.kv.band_used == (2, 2) + (0,) * 30
    assert (snap.kv.prefix_cache_queries, snap.kv.prefix_cache_hits) == (10, 0)
    with pytest.raises(AttributeError):
        snap.num_running = 0  # type: ignore[misc]  # frozen: a value, not a view


def test_abort_frees_blocks_and_reports_to_runner() -> None:
    s = make()
    runner = FakeRunner()
    s.add_request(req("a", 10, max_tokens=20))
    step(s, runner)
    assert s.snapshot().kv.num_free_blocks < 64
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert s.snapshot().kv.num_free_blocks == 64
    assert s.schedule().finished_request_ids == ["a"]
    s.check_invariants()


def test_validation_rejects_with_numbers() -> None:
    s = make(max_model_len=64, num_kv_blocks=20)
    with pytest.raises(InvalidRequestError, match="0 tokens"):
        s.add_request(req("e", 0))
    with pytest.raises(InvalidRequestError, match=r"70 tokens but max_model_len is 64") as e:
        s.add_request(req("long", 70))
    assert e.value.param == "input_tokens"
    with pytest.raises(InvalidRequestError, match=r"\(60 tokens\) \+ max_tokens \(10\) = 70") as e:
        s.add_request(req("mt", 60, max_tokens=10))
    assert e.value.param == "max_tokens"
    assert not s.has_unfinished_requests()


def test_a_request_that_could_never_fit_the_pool_is_rejected() -> None:
    with pytest.raises(ConfigError, match="needs 16 KV blocks"):
        make(max_model_len=64, num_kv_blocks=10)
    s = make(max_model_len=64, num_kv_blocks=16)
    s.add_request(req("ok", 60, max_tokens=4))


def test_queue_bound() -> None:
    # Free running slots are not queue: one slot and a queue of one hold two requests.
    s = make(max_queue_len=1, max_num_seqs=1)
    s.add_request(req("a", 3))
    s.add_request(req("b", 3))
    with pytest.raises(QueueFullError, match="1 of 1 waiting"):
        s.add_request(req("c", 3))
    # max_queue_len 0: no queue, but max_num_seqs still run at once.
    s = make(max_queue_len=0, max_num_seqs=2)
    s.add_request(req("a", 3))
    s.add_request(req("b", 3))
    with pytest.raises(QueueFullError, match="0 of 0 waiting"):
        s.add_request(req("c", 3))


def test_prefix_cache_hit_skips_computation() -> None:
    s = make()
    runner = FakeRunner()
    a = req("a", 12, max_tokens=2)
    s.add_request(a)
    run_all(s, runner)
    b = Request("b", list(a.prompt_token_ids), SamplingParams(max_tokens=2),
                eos_token_ids=(EOS,))
    s.add_request(b)
    out = s.schedule()
    # 12 prompt tokens, 4 per block: 2 blocks hit, the last block is recomputed.
    assert out.scheduled[0].num_computed_tokens == 8 and len(out.scheduled[0].token_ids) == 4
    assert b.num_cached_tokens == 8
    assert s.kv.prefix_cache_hits == 8


# ------------------------------------------------------------------ property-based accounting
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12)),
        st.tuples(st.just("step"), st.just(0), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 50), st.just(0)),
    ),
    min_size=1, max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(10, 40),
    budget=st.sampled_from([8, 16, 64]),
    caching=st.booleans(),
    policy=st.sampled_from(["optimistic", "reserve"]),
    watermark=st.sampled_from([0.0, 0.1]),
)
def test_block_accounting_property(
    ops: list[tuple[str, int, int]], num_blocks: int, budget: int, caching: bool,
    policy: str, watermark: float,
) -> None:
    s = make(num_kv_blocks=num_blocks, max_num_batched_tokens=budget, max_model_len=40,
             max_num_seqs=6, enable_prefix_caching=caching, admission_policy=policy,
             watermark=watermark)
    runner = FakeRunner()
    added: list[Request] = []
    for op, a, b in ops:
        if op == "add":
            prompt = [(len(added) % 3) + 1] * a  # repeated prompts exercise prefix hits
            r = Request(f"r{len(added)}", prompt, SamplingParams(max_tokens=b),
                        eos_token_ids=(EOS,))
            try:
                s.add_request(r)
                added.append(r)
            except InvalidRequestError:
                pass
        elif op == "abort" and added:
            s.finish_requests([added[a % len(added)].request_id], RequestStatus.FINISHED_ABORTED)
        else:
            step(s, runner)
        s.check_invariants()
    run_all(s, runner, max_steps=2000)
    s.check_invariants()
    assert s.snapshot().kv.num_free_blocks == num_blocks
    assert not s.kv.req_to_blocks
    for r in added:
        if r.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            assert r.output_token_ids == expected_tokens(r, r.max_tokens)
