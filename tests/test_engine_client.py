"""EngineClient in-process (same EngineLoop and messages as the engine process, no sockets),
and the msgpack wire format of every message."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tailserve.config import EngineArgs
from tailserve.engine.client import EngineDeadError, InprocEngineClient, StreamItem
from tailserve.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineDead,
    Heartbeat,
    Ready,
    Rejected,
    Shutdown,
    StepResult,
    input_decoder,
    input_encoder,
    message_decoder,
    message_encoder,
)
from tailserve.engine.outputs import EngineOutput, StepStats
from tailserve.errors import InvalidRequestError, QueueFullError
from tailserve.obs.records import EngineState
from tailserve.request import FinishReason, RequestTimestamps
from tailserve.sampling_params import SamplingParams


def test_every_message_survives_msgpack() -> None:
    sp = SamplingParams(max_tokens=3, stop=["x"], logprobs=2, seed=7, temperature=0.5)
    for msg in (AddRequest("a", [1, 2], sp, 12.5, priority=3), AbortRequests(["a", "b"], True),
                Shutdown()):
        assert input_decoder.decode(input_encoder.encode(msg)) == msg
    state = EngineState(1.0, 2, 3, 4, 5, 6, {"rss_bytes": 7.0}, "cpu")
    out = EngineOutput("a", [5], [{5: -0.5, 9: -1.5}], FinishReason.STOP, stop_reason="x",
                       timestamps=RequestTimestamps(1.0, 1.1, 1.2, 1.3, [1.15], [1.16]),
                       timing={"e2e_s": 0.3})
    stats = StepStats(1.0, 0.01, 3, 2, 3, 2, 0, 10, 20, 0, 1, 1, 1, "kv_cache", {"rss_bytes": 1})
    for m in (StepResult([out], stats, state, 9.0), Heartbeat(state, 9.5),
              Rejected("a", "queue_full", "full"), EngineDead("boom", ["a"])):
        assert message_decoder.decode(message_encoder.encode(m)) == m


def test_invalid_sampling_params_are_refused_at_decode() -> None:
    raw = input_encoder.encode(AddRequest("a", [1], SamplingParams(), 0.0))
    import msgspec

    bad = msgspec.msgpack.decode(raw)
    bad["sampling_params"]["n"] = 0
    with pytest.raises(msgspec.ValidationError, match="n must be in"):
        input_decoder.decode(msgspec.msgpack.encode(bad))


async def _drain(q: asyncio.Queue[StreamItem], n: int) -> dict[str, list[Any]]:
    got: dict[str, list[Any]] = {}
    finished = 0
    while finished < n:
        item = await asyncio.wait_for(q.get(), 60)
        if isinstance(item, BaseException):
            raise item
        _, eo = item
        got.setdefault(eo.request_id, []).append(eo)
        finished += eo.finished
    return got


def test_inproc_client_matches_offline_and_aborts(tiny_model_dir: str) -> None:
    from tailserve import LLM

    args = EngineArgs(model=tiny_model_dir, kv_cache_memory=0.05, max_num_seqs=2, max_queue_len=4)
    prompts = [[10, 11, 12, 13], [20, 21], [30, 31, 32]]
    llm = LLM(**{**args.__dict__})
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy)]

    async def scenario() -> None:
        client = InprocEngineClient(args)
        info = await client.start()
        assert isinstance(info, Ready) and info.config.scheduler.max_queue_len == 4
        q: asyncio.Queue[StreamItem] = asyncio.Queue()
        for i, p in enumerate(prompts):
            client.add_request(AddRequest(f"r{i}", p, greedy, 0.0), q)
        got = await _drain(q, len(prompts))
        for i in range(len(prompts)):
            tokens = [t for eo in got[f"r{i}"] for t in eo.new_token_ids]
            assert tokens == expected[i]
            assert got[f"r{i}"][-1].timing["output_tokens"] == 8

        # Abort mid-way: the stream is dropped here and the engine frees the blocks.
        long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        q2 = client.add_request(AddRequest("long", [1, 2, 3], long, 0.0))
        await asyncio.wait_for(q2.get(), 60)
        client.abort(["long"])
        assert client.num_inflight == 0
        for _ in range(200):
            await asyncio.sleep(0.01)
            st = client.state
            if st and st.num_running == 0 and st.free_blocks == st.total_blocks:
                break
        assert client.state is not None and client.state.num_running == 0
        assert client.state.free_blocks == client.state.total_blocks

        # The engine's own checks come back as exceptions on the request's queue.
        q3 = client.add_request(AddRequest("toolong", [1] * 600, greedy, 0.0))
        err = await asyncio.wait_for(q3.get(), 10)
        assert isinstance(err, InvalidRequestError) and err.param == "input_tokens"
        with pytest.raises(InvalidRequestError, match="already in use"):
            client.add_request(AddRequest("dup", [1], long, 0.0))
            client.add_request(AddRequest("dup", [1], long, 0.0))
        client.abort(["dup"])
        # 2 running + 4 waiting: a burst larger than that is refused by the engine.
        q4: asyncio.Queue[StreamItem] = asyncio.Queue()
        for i in range(8):
            client.add_request(AddRequest(f"b{i}", [5, 6], long, 0.0), q4)
        refused = 0
        for _ in range(8):
            item = await asyncio.wait_for(q4.get(), 10)
            if isinstance(item, QueueFullError):
                refused += 1
            if refused and q4.empty():
                break
        assert refused >= 1
        client.abort([f"b{i}" for i in range(8)])

        client._die("test: engine gone")
        assert not client.healthy()
        with pytest.raises(EngineDeadError):
            client.add_request(AddRequest("late", [1], greedy, 0.0))
        await client.shutdown()
        assert not client.engine_alive()

    asyncio.run(scenario())
