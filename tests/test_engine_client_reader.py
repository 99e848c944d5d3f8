"""MPEngineClient's reader over a real ZMQ IPC socket, with a test socket in the engine's place
(no engine process): every message arrives, those queued before the reader started too, and
one it cannot handle is logged without stopping the ones after it."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

import pytest
import zmq

from tailserve.config import EngineArgs
from tailserve.data.records import EngineState
from tailserve.engine.messages import Heartbeat, message_encoder
from tailserve.engine.mp_client import MPEngineClient


def heartbeat(n: int) -> bytes:
    return message_encoder.encode(Heartbeat(EngineState(float(n), n, 0, 10, 10, 0), float(n)))


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_reader_delivers_queued_and_later_messages_past_a_bad_one(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        client = MPEngineClient(EngineArgs(), watchdog_timeout_s=60.0)
        addr = f"ipc://{os.path.join(client._dir, 'out')}"
        client._out.bind(addr)
        engine = zmq.Context.instance().socket(zmq.PUSH)
        engine.connect(addr)
        seen: list[int] = []
        client.state_listeners.append(lambda s: seen.append(s.num_running))
        try:
            for n in range(1, 51):  # queued before the reader watches the socket
                engine.send(heartbeat(n))
            await asyncio.sleep(0.1)
            client._start_reader(asyncio.get_running_loop())
            await until(lambda: len(seen) == 50)
            engine.send(b"\x00not msgpack")
            for n in range(51, 61):
                engine.send(heartbeat(n))
                await asyncio.sleep(0.001)
            await until(lambda: len(seen) == 60)
            assert seen == list(range(1, 61))
            assert client.state is not None and client.state.num_running == 60
        finally:
            client._stop_reader()
            engine.close(linger=0)
            await client.shutdown(timeout_s=1.0)

    with caplog.at_level(logging.ERROR, logger="tailserve.engine.mp_client"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records] == ["engine message not handled"]
