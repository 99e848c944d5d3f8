"""Tenants as a scheduling unit (engine/tenant_share.py), on the fake runner: a flooding
tenant does not hold back another's prompt, backlogged tenants get prefill tokens by weight,
a continuous flood starves nobody, the KV pool and the full queue are shared by weight, and
with one tenant the schedule is exactly the policy's. Helpers as in test_scheduler.py."""

from __future__ import annotations

import random
import zlib

import pytest

from fake_runner import EOS, FakeRunner
from tailserve.data.step import BlockedReason
from tailserve.engine.scheduler import Scheduler
from tailserve.engine.step_time import queue_overdue, shared_step_cap
from tailserve.engine.tenant_share import TENANT_PRESENCE_S
from tailserve.errors import InvalidRequestError, QueueFullError
from tailserve.request import SLO, Request
from tailserve.sampling_params import SamplingParams
from test_scheduler import make
from test_scheduler_time import Clock
from test_scheduler_time import make as make_timed
from test_scheduler_time import step as timed_step

Step = tuple[list[tuple[str, int]], BlockedReason | None]


def treq(rid: str, tenant: str | None, n_prompt: int, weight: float = 1.0,
         max_tokens: int = 1, arrival: float = 0.0) -> Request:
    prompt = [(zlib.crc32(rid.encode()) + i) % 40 + 1 for i in range(n_prompt)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=arrival, eos_token_ids=(EOS,), tenant=tenant,
                   tenant_weight=weight)


def sched(s: Scheduler, runner: FakeRunner) -> Step:
    out = s.schedule()
    s.update_from_output(out, runner.execute(out), 0.001)
    s.check_invariants()
    return [(x.request_id, len(x.token_ids)) for x in out.scheduled], out.admission_blocked_by


def held(s: Scheduler, tenant: str | None) -> int:
    return sum(len(s.kv.req_to_blocks[r.request_id]) for r in s.running if r.tenant == tenant)


@pytest.mark.parametrize("tenants", [True, False])
def test_a_flood_does_not_hold_back_another_tenants_prompt(tenants: bool) -> None:
    s = make(enable_prefix_caching=False)
    runner = FakeRunner()
    for i in range(10):
        s.add_request(treq(f"f{i}", "flood" if tenants else None, 40))
    s.add_request(treq("q0", "quiet" if tenants else None, 8, arrival=1.0))
    steps = [sched(s, runner)[0] for _ in range(3)]
    if tenants:
        # q0's finish tag (8 tokens) is below the flood's first (40): first, in step one,
        # and alone: f0's chunk would not complete its prompt, only delay q0's first token.
        assert steps == [[("q0", 8)], [("f0", 32)], [("f0", 8), ("f1", 24)]]
    else:
        # One tenant: deadline order (arrival), q0 behind the whole flood.
        assert steps == [[("f0", 32)], [("f0", 8), ("f1", 24)], [("f1", 16), ("f2", 16)]]


def test_backlogged_tenants_get_prefill_tokens_by_weight() -> None:
    s = make(max_num_batched_tokens=8, enable_prefix_caching=False)
    runner = FakeRunner()
    for i in range(12):
        s.add_request(treq(f"a{i}", "a", 8, weight=3))
    for i in range(12):
        s.add_request(treq(f"b{i}", "b", 8, weight=1))
    order = [sched(s, runner)[0] for _ in range(12)]
    assert [ids for ((ids, _),) in order] == [
        "a0", "a1", "a2", "b0", "a3", "a4", "a5", "b1", "a6", "a7", "a8", "b2"]


def test_a_continuous_flood_starves_no_tenant() -> None:
    """Tenant a (weight 4) adds two prompts every step, more than the budget serves; b's three
    prompts still get one step in five."""
    s = make(max_num_batched_tokens=8, enable_prefix_caching=False)
    runner = FakeRunner()
    for i in range(3):
        s.add_request(treq(f"b{i}", "b", 8))
    served: list[str] = []
    for k in range(16):
        for j in range(2):
            s.add_request(treq(f"a{2 * k + j}", "a", 8, weight=4, arrival=float(k)))
        (ids, _), = sched(s, runner)[0]
        served.append(ids)
    assert [i for i, rid in enumerate(served) if rid.startswith("b")] == [3, 8, 13]
    assert served[:3] == ["a0", "a1", "a2"] and len(s.waiting) == 32 - 13


def test_with_one_tenant_the_schedule_is_the_policys() -> None:
    """A random mixed load (preemptions, a full pool): every step the same, whether its
    requests carry no tenant or all the same one (of any weight)."""
    def run(tenant: str | None, weight: float) -> list[Step]:
        s = make(num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4)
        runner, rng, log = FakeRunner(), random.Random(7), []
        for k in range(200):
            if k < 30 and rng.random() < 0.6:
                s.add_request(treq(f"r{k}", tenant, rng.randint(3, 40), weight=weight,
                                   max_tokens=rng.randint(1, 12), arrival=float(k)))
            if s.has_unfinished_requests():
                log.append(sched(s, runner))
        assert not s.has_unfinished_requests()
        return log

    plain = run(None, 1.0)
    # The load is one that preempts and fills the pool: it exercises every path.
    assert len(plain) == 72 and [why for _, why in plain].count(BlockedReason.PREEMPTION) == 4
    assert run("solo", 2.5) == plain


@pytest.mark.parametrize("tenants", [True, False])
def test_a_tenant_is_not_admitted_past_its_kv_share_while_another_waits(tenants: bool) -> None:
    """A pool of 16 blocks: the flood holds 12 (four running requests) when q0 (7 blocks)
    arrives with four more flood prompts. With tenants the flood is at its share (8) and gets
    no admission while q0 waits; q0 starts in the first step the pool has room for it. One
    tenant: the flood's prompts go first and preempt, and q0 has not started by step 10."""
    flood, quiet = ("flood", "quiet") if tenants else (None, None)
    s = make(num_kv_blocks=16, max_num_batched_tokens=64, enable_prefix_caching=False)
    runner = FakeRunner()
    for i in range(4):
        s.add_request(treq(f"f{i}", flood, 8, max_tokens=8))
    assert sched(s, runner)[0] == [(f"f{i}", 8) for i in range(4)]
    s.add_request(treq("q0", quiet, 28, max_tokens=2))
    for i in range(4, 8):
        s.add_request(treq(f"f{i}", flood, 8, max_tokens=8))
    steps = [sched(s, runner)[0] for _ in range(8)]
    decodes = [(f"f{i}", 1) for i in range(4)]
    if tenants:
        assert steps[:7] == [decodes] * 7 and held(s, flood) == 8
        assert steps[7] == [("f4", 8), ("f5", 8), ("f6", 8), ("q0", 28), ("f7", 8)]
    else:
        assert steps[0] == [*decodes, ("f4", 8), ("f5", 8)]
        assert all("q0" not in dict(step) for step in steps)


def test_the_full_queue_sheds_the_tenant_over_its_share() -> None:
    s = make(max_num_seqs=1, max_queue_len=2)
    for i in range(3):
        s.add_request(treq(f"f{i}", "flood", 8))
    with pytest.raises(QueueFullError, match=r"^the waiting queue is full \(2 of 2 waiting"):
        s.add_request(treq("f3", "flood", 8))  # one tenant: the plain bound
    s.add_request(treq("q0", "quiet", 8))  # within its share (1 of 2 places): queued
    with pytest.raises(QueueFullError, match=(
            r"^tenant 'quiet' is over its share of the waiting queue \(1 waiting; weight 1 of "
            r"2 gives it 1 of max_queue_len 2\); predicted wait")):
        s.add_request(treq("q1", "quiet", 8))
    with pytest.raises(QueueFullError, match=(
            r"^tenant 'flood' is over its share of the waiting queue \(3 waiting; weight 1 of "
            r"2 gives it 1 of max_queue_len 2\)")):
        s.add_request(treq("f3", "flood", 8))
    s.add_request(treq("h0", "heavy", 8, weight=4))  # 4 of 6 by weight: 1 place
    assert [r.request_id for r in s.waiting] == ["f0", "f1", "f2", "q0", "h0"]


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), 1001.0])
def test_a_bad_tenant_weight_is_refused(weight: float) -> None:
    with pytest.raises(InvalidRequestError, match=r"tenant_weight must be in \(0, 1000\]"):
        make().add_request(treq("a", "t", 8, weight=weight))


def test_one_tenants_overdue_queue_keeps_steps_capped_while_another_is_present(
        itl_cap_only: None) -> None:
    """An overdue queue lifts the ITL cap of a step with no decode (the whole token budget),
    but not while another tenant is present: its next prompt would wait for that step in
    flight. Once the other tenant has had nothing in the engine and no arrival for
    TENANT_PRESENCE_S, the overdue flood takes the whole budget again."""
    def tenant_req(rid: str, tenant: str, n: int, arrival: float) -> Request:
        r = treq(rid, tenant, n, arrival=arrival)
        r.slo = SLO(1.0, None)
        return r

    def run(quiet: bool) -> list[list[tuple[str, int]]]:
        clock = Clock()
        # 10 ms a step + 1 ms a prompt token; a 31 ms cap: 16 tokens with no decode.
        s = make_timed(clock, target_s=0.031, slo_ttft_s=1.0)
        runner = FakeRunner()
        s.add_request(tenant_req("f0", "flood", 600, 0.0))
        s.add_request(tenant_req("f1", "flood", 600, 0.0))
        steps = [timed_step(s, runner, clock)]
        if quiet:
            clock.t = 1.4
            s.add_request(tenant_req("q0", "quiet", 8, clock.t))
            steps.append(timed_step(s, runner, clock))  # q0 in, then done (1 token)
        clock.t = 1.5
        assert queue_overdue(s, clock.t) is not quiet
        steps.append(timed_step(s, runner, clock))
        clock.t = 1.4 + TENANT_PRESENCE_S + 0.01
        assert queue_overdue(s, clock.t)
        steps.append(timed_step(s, runner, clock))
        return steps

    assert run(quiet=False) == [[("f0", 16)], [("f0", 512)], [("f0", 72), ("f1", 440)]]
    # q0 goes by fair share and alone; then capped steps, not the whole budget.
    assert run(quiet=True) == [[("f0", 16)], [("q0", 8)], [("f0", 16)], [("f0", 512)]]


def test_prompts_that_complete_share_a_step_across_tenants() -> None:
    """Only a chunk that completes no prompt stays out of a step that completes another
    tenant's: two tenants' short prompts go together; a prompt that would be left part-way
    waits one step, whichever tenant's it is."""
    s = make(enable_prefix_caching=False)
    runner = FakeRunner()
    s.add_request(treq("a0", "a", 8))
    s.add_request(treq("b0", "b", 8))
    assert sched(s, runner)[0] == [("a0", 8), ("b0", 8)]
    s = make(enable_prefix_caching=False)
    s.add_request(treq("f0", "flood", 20))
    s.add_request(treq("q0", "quiet", 24))
    assert [sched(s, runner)[0] for _ in range(2)] == [[("f0", 20)], [("q0", 24)]]


def test_while_two_tenants_are_present_a_step_is_capped_at_the_shared_cap() -> None:
    """With one tenant a step with no decode takes the whole token budget within a loose ITL
    cap; once a second tenant has arrived (even with nothing left in the engine) steps stay
    within ``shared_step_cap``: twice a 32-token prompt's own step, 2 x (10 + 32) = 84 ms
    here, so 64 tokens."""
    clock = Clock()
    s = make_timed(clock, target_s=1.0)
    runner = FakeRunner()
    s.add_request(treq("f0", "flood", 1000))
    assert timed_step(s, runner, clock) == [("f0", 512)]
    s.add_request(treq("q0", "quiet", 8, arrival=clock.t))
    assert timed_step(s, runner, clock) == [("q0", 8)]  # alone: f0 would not complete
    assert shared_step_cap(s) == pytest.approx(0.084)
    assert timed_step(s, runner, clock) == [("f0", 64)]
    clock.t += TENANT_PRESENCE_S + 0.01
    assert timed_step(s, runner, clock) == [("f0", 424)]  # the rest, one tenant again


@pytest.mark.parametrize("shared", [False, True])
def test_a_prompts_rest_runs_past_the_cap_only_while_one_tenant_is_present(
        shared: bool) -> None:
    # An 84 ms ITL cap: 64 tokens; the 100-token prompt's rest (110 ms) is within twice it.
    clock = Clock()
    s = make_timed(clock, target_s=0.084)
    runner = FakeRunner()
    if shared:
        s.add_request(treq("q0", "quiet", 8))
        assert timed_step(s, runner, clock) == [("q0", 8)]
    s.add_request(treq("f0", "flood", 100, arrival=clock.t))
    assert timed_step(s, runner, clock) == [("f0", 64 if shared else 100)]
