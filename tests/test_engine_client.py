"""InprocEngineClient: the same EngineLoop and driver as the engine process, no sockets. One
test per behaviour of the client interface; the wire format is in test_engine_messages.py."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tailserve.config import EngineArgs
from tailserve.data.records import EngineState
from tailserve.data.step import EngineOutput
from tailserve.engine.client import EngineDeadError, StreamItem
from tailserve.engine.inproc_client import InprocEngineClient
from tailserve.engine.loop import HEARTBEAT_S
from tailserve.engine.messages import AddRequest, Ready, Shutdown
from tailserve.errors import InvalidRequestError, QueueFullError
from tailserve.request import FinishReason, RequestStatus
from tailserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# Long enough to still be running whenever a test looks (the tiny model never stops early).
LONG = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
PROMPTS = [[10, 11, 12, 13], [20, 21], [30, 31, 32]]

Scenario = Callable[[InprocEngineClient], Awaitable[None]]


@pytest.fixture(scope="module")
def args(tiny_model_dir: str) -> EngineArgs:
    return EngineArgs(model=tiny_model_dir, kv_cache_memory=0.05, max_num_seqs=2,
                      max_queue_len=4)


@pytest.fixture(scope="module")
def loaded(args: EngineArgs) -> Any:
    from tailserve.model.loader import load_model

    return load_model(args.model)


@pytest.fixture
def run(args: EngineArgs, loaded: Any) -> Callable[[Scenario], None]:
    """Run ``scenario(client)`` against a started client; shut it down afterwards."""

    def go(scenario: Scenario) -> None:
        async def main() -> None:
            client = InprocEngineClient(args, loaded)
            await client.start()
            try:
                await scenario(client)
            finally:
                await client.shutdown()
            assert not client.engine_alive()

        asyncio.run(main())

    return go


async def _next(q: asyncio.Queue[StreamItem], timeout_s: float = 60.0) -> EngineOutput:
    item = await asyncio.wait_for(q.get(), timeout_s)
    if isinstance(item, BaseException):
        raise item
    return item[1]


async def _until_finished(q: asyncio.Queue[StreamItem]) -> list[EngineOutput]:
    outs = [await _next(q)]
    while not outs[-1].finished:
        outs.append(await _next(q))
    return outs


async def _state_where(client: InprocEngineClient,
                       ok: Callable[[EngineState], bool]) -> EngineState:
    for _ in range(500):
        if client.state is not None and ok(client.state):
            return client.state
        await asyncio.sleep(0.01)
    raise AssertionError(f"no engine state matched; last {client.state}")


def _idle(st: EngineState) -> bool:
    return st.num_running == 0 and st.num_waiting == 0 and st.free_blocks == st.total_blocks


def test_start_returns_ready_with_the_resolved_config(run: Callable[[Scenario], None],
                                                       args: EngineArgs) -> None:
    async def scenario(client: InprocEngineClient) -> None:
        info = client.info
        assert isinstance(info, Ready) and info.config.runner.device == "cpu" and info.pid > 0
        cfg = info.config.scheduler
        assert (cfg.max_num_seqs, cfg.max_queue_len) == (2, 4)
        assert info.config.cache.block_size == args.block_size
        assert info.config.model.vocab_size == 49152
        assert client.healthy() and client.engine_alive() and client.num_inflight == 0

    run(scenario)


def test_outputs_match_the_offline_engine(run: Callable[[Scenario], None],
                                          args: EngineArgs, loaded: Any) -> None:
    from tailserve import LLM

    same = {k: v for k, v in vars(args).items() if k != "model"}
    llm = LLM.from_loaded(loaded, **same)
    expected = [o.outputs[0].token_ids
                for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]

    async def scenario(client: InprocEngineClient) -> None:
        queues = [client.add_request(AddRequest(f"r{i}", p, GREEDY, time.monotonic()))
                  for i, p in enumerate(PROMPTS)]
        assert client.num_inflight == 3
        for i, q in enumerate(queues):
            outs = await _until_finished(q)
            assert [t for eo in outs for t in eo.new_token_ids] == expected[i]
            assert all(eo.request_id == f"r{i}" for eo in outs)
            last = outs[-1]
            assert last.finish_reason is FinishReason.LENGTH
            assert last.timing is not None and last.timing["output_tokens"] == 8
            assert last.timing["prompt_tokens"] == len(PROMPTS[i])
        assert client.num_inflight == 0

    run(scenario)


def test_requests_sharing_a_queue_arrive_on_it(run: Callable[[Scenario], None]) -> None:
    async def scenario(client: InprocEngineClient) -> None:
        q: asyncio.Queue[StreamItem] = asyncio.Queue()
        for i, p in enumerate(PROMPTS):
            assert client.add_request(AddRequest(f"s{i}", p, GREEDY, 0.0), q) is q
        tokens: dict[str, int] = {}
        while len(tokens) < 3 or not all(n == 8 for n in tokens.values()):
            eo = await _next(q)
            tokens[eo.request_id] = tokens.get(eo.request_id, 0) + len(eo.new_token_ids)
        assert tokens == {"s0": 8, "s1": 8, "s2": 8}

    run(scenario)


def test_idle_engine_sends_heartbeats(run: Callable[[Scenario], None]) -> None:
    async def scenario(client: InprocEngineClient) -> None:
        states: list[EngineState] = []
        client.state_listeners.append(states.append)
        for _ in range(500):
            if len(states) >= 4:
                break
            await asyncio.sleep(0.01)
        assert len(states) >= 4, f"{len(states)} heartbeats in 5 s"
        assert client.info is not None
        total = client.info.config.cache.num_kv_blocks
        for st in states:
            assert (st.num_running, st.num_waiting, st.free_blocks, st.total_blocks) == (
                0, 0, total, total)
        gaps = [b.t - a.t for a, b in itertools.pairwise(states)]
        # Never more often than HEARTBEAT_S (1 ms of slack for the wall clock).
        assert min(gaps) >= HEARTBEAT_S - 0.001, gaps

    run(scenario)


def test_finish_without_final_drops_the_stream_and_frees_blocks(
    run: Callable[[Scenario], None],
) -> None:
    async def scenario(client: InprocEngineClient) -> None:
        q = client.add_request(AddRequest("long", [1, 2, 3], LONG, 0.0))
        await _next(q)  # running
        client.finish(["long"], RequestStatus.FINISHED_ABORTED, deliver_final=False)
        assert client.num_inflight == 0
        await _state_where(client, _idle)
        await asyncio.sleep(3 * HEARTBEAT_S)
        # Outputs already queued before the finish may be there; nothing after it arrives.
        leftovers = []
        while not q.empty():
            leftovers.append(q.get_nowait())
        assert all(not isinstance(x, BaseException) and not x[1].finished for x in leftovers)

    run(scenario)


@pytest.mark.parametrize(("status", "reason"), [
    (RequestStatus.FINISHED_ABORTED, FinishReason.ABORT),
    (RequestStatus.FINISHED_STOPPED, FinishReason.STOP),
])
def test_finish_with_final_delivers_one_last_output(
    run: Callable[[Scenario], None], status: RequestStatus, reason: FinishReason,
) -> None:
    async def scenario(client: InprocEngineClient) -> None:
        q = client.add_request(AddRequest("long", [1, 2, 3], LONG, 0.0))
        first = await _next(q)
        client.finish(["long"], status, deliver_final=True)
        assert client.inflight_request_ids == ["long"]  # until its final output arrives
        outs = await _until_finished(q)
        last = outs[-1]
        assert (last.request_id, last.new_token_ids, last.finish_reason) == ("long", [], reason)
        assert last.timing is not None
        n_tokens = len(first.new_token_ids) + sum(len(eo.new_token_ids) for eo in outs)
        assert last.timing["output_tokens"] == n_tokens < 500
        assert client.num_inflight == 0
        await _state_where(client, _idle)

    run(scenario)


def test_finish_skips_unknown_ids_and_refuses_a_live_status(
    run: Callable[[Scenario], None],
) -> None:
    async def scenario(client: InprocEngineClient) -> None:
        client.finish(["never-added"], RequestStatus.FINISHED_ABORTED, deliver_final=False)
        client.finish(["never-added"], RequestStatus.FINISHED_ABORTED, deliver_final=True)
        assert client.num_inflight == 0
        q = client.add_request(AddRequest("a", [1, 2], LONG, 0.0))
        with pytest.raises(ValueError, match="finish needs a finished status, got RUNNING"):
            client.finish(["a"], RequestStatus.RUNNING, deliver_final=True)
        assert client.inflight_request_ids == ["a"]
        await _next(q)  # still running: the refused call sent nothing
        client.finish(["a"], RequestStatus.FINISHED_ABORTED, deliver_final=False)

    run(scenario)


def test_engine_length_check_comes_back_on_the_queue(run: Callable[[Scenario], None]) -> None:
    async def scenario(client: InprocEngineClient) -> None:
        q = client.add_request(AddRequest("toolong", [1] * 600, GREEDY, 0.0))
        err = await asyncio.wait_for(q.get(), 10)
        assert isinstance(err, InvalidRequestError) and err.param == "input_tokens"
        assert "the prompt has 600 tokens but max_model_len is 512" in str(err)
        assert client.num_inflight == 0

    run(scenario)


def test_a_request_id_in_flight_cannot_be_reused(run: Callable[[Scenario], None]) -> None:
    async def scenario(client: InprocEngineClient) -> None:
        client.add_request(AddRequest("dup", [1], LONG, 0.0))
        with pytest.raises(InvalidRequestError, match="request_id 'dup' is already in use"):
            client.add_request(AddRequest("dup", [1], LONG, 0.0))
        assert client.inflight_request_ids == ["dup"]
        client.finish(["dup"], RequestStatus.FINISHED_ABORTED, deliver_final=False)

    run(scenario)


def test_a_burst_beyond_running_plus_queue_is_refused(run: Callable[[Scenario], None]) -> None:
    async def scenario(client: InprocEngineClient) -> None:
        # max_num_seqs 2 + max_queue_len 4: six are taken, however the burst is batched.
        queues = {f"b{i}": client.add_request(AddRequest(f"b{i}", [5, 6], LONG, 0.0))
                  for i in range(8)}
        for rid in ("b6", "b7"):
            err = await asyncio.wait_for(queues[rid].get(), 10)
            assert isinstance(err, QueueFullError), err
            assert "the waiting queue is full" in str(err)
        assert sorted(client.inflight_request_ids) == [f"b{i}" for i in range(6)]
        st = await _state_where(client, lambda s: s.num_running == 2)
        assert st.num_waiting == 4
        client.finish(list(queues), RequestStatus.FINISHED_ABORTED, deliver_final=False)
        await _state_where(client, _idle)

    run(scenario)


def test_a_dead_engine_fails_streams_and_refuses_new_requests(
    run: Callable[[Scenario], None],
) -> None:
    async def scenario(client: InprocEngineClient) -> None:
        deaths: list[str] = []
        client.death_listeners.append(deaths.append)
        q = client.add_request(AddRequest("inflight", [1, 2], LONG, 0.0))
        client._die("test: engine gone")
        assert deaths == ["test: engine gone"] and client.dead_reason == "test: engine gone"
        assert not client.healthy() and client.num_inflight == 0
        items = []
        while not q.empty():
            items.append(q.get_nowait())
        assert isinstance(items[-1], EngineDeadError) and str(items[-1]) == "test: engine gone"
        with pytest.raises(EngineDeadError, match="test: engine gone"):
            client.add_request(AddRequest("late", [1], GREEDY, 0.0))
        # Finishing after death sends nothing and raises nothing.
        client.finish(["inflight"], RequestStatus.FINISHED_ABORTED, deliver_final=True)

    run(scenario)


def test_a_failed_send_registers_nothing(
    run: Callable[[Scenario], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A send that raises (msgpack refusing a field, a closed socket) hands nothing over, so
    the request must not stay counted in flight: no output would ever come to end it."""

    async def scenario(client: InprocEngineClient) -> None:
        real = client._send

        def refuse(msg: Any) -> None:
            raise UnicodeEncodeError("utf-8", "\udfff", 0, 1, "surrogates not allowed")

        monkeypatch.setattr(client, "_send", refuse)
        with pytest.raises(UnicodeEncodeError):
            client.add_request(AddRequest("lost", [1, 2], GREEDY, 0.0))
        assert client.num_inflight == 0 and client.inflight_request_ids == []
        monkeypatch.setattr(client, "_send", real)
        # The id is free again, and the engine never saw the first attempt.
        outs = await _until_finished(client.add_request(AddRequest("lost", [1, 2], GREEDY, 0.0)))
        assert len([t for o in outs for t in o.new_token_ids]) == 8
        assert client.num_inflight == 0

    run(scenario)


def test_a_stopped_engine_refuses_before_any_death_notice(
    run: Callable[[Scenario], None],
) -> None:
    """The engine is gone but nothing has said so yet (the watchdog ticks every 0.25 s): a
    new request is refused at once instead of waiting on an engine that will never answer."""

    async def scenario(client: InprocEngineClient) -> None:
        client._send(Shutdown())  # the engine thread ends; no EngineDead is sent
        assert client._thread is not None
        await asyncio.to_thread(client._thread.join, 10)
        assert client.dead_reason is None and not client.engine_alive()
        assert client.gone_reason == "the engine thread has stopped"
        with pytest.raises(EngineDeadError, match=r"^the engine thread has stopped$"):
            client.add_request(AddRequest("late", [1], GREEDY, 0.0))
        assert client.num_inflight == 0 and not client.healthy()

    run(scenario)


def test_a_rejected_add_leaves_the_engine_counts_as_they_were(
    run: Callable[[Scenario], None],
) -> None:
    """Rejections (too long, a reused id) take no place in the engine: afterwards the whole
    max_num_seqs 2 + max_queue_len 4 is still taken by a burst, and a seventh is refused."""

    async def scenario(client: InprocEngineClient) -> None:
        for rid in ("toolong1", "toolong2"):
            q = client.add_request(AddRequest(rid, [1] * 600, GREEDY, 0.0))
            assert isinstance(await asyncio.wait_for(q.get(), 10), InvalidRequestError)
        assert client.num_inflight == 0
        queues = {f"b{i}": client.add_request(AddRequest(f"b{i}", [5, 6], LONG, 0.0))
                  for i in range(7)}
        err = await asyncio.wait_for(queues["b6"].get(), 10)
        assert isinstance(err, QueueFullError), err
        st = await _state_where(client, lambda s: s.num_running == 2)
        assert st.num_waiting == 4
        assert sorted(client.inflight_request_ids) == [f"b{i}" for i in range(6)]
        client.finish(list(queues), RequestStatus.FINISHED_ABORTED, deliver_final=False)
        await _state_where(client, _idle)

    run(scenario)
