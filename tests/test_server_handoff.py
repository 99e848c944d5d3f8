"""The hand-off of one HTTP request to the engine is all or nothing (issue 18, item 0).

A request of ``prompts x n`` engine requests is admitted, registered and sent child by child;
a failure at any step must leave the counts admission reads exactly as they were. The real
app, served by uvicorn on loopback, over the real in-process engine (``InprocEngineClient``);
the one fake is the fault: the client's k-th send raises, once. A slot lost to a failure would
show as a 429 for the request that fills the whole capacity afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
import uvicorn

from server_util import free_port, metric_value
from tailserve.config import EngineArgs
from tailserve.engine.client import EngineDeadError
from tailserve.engine.inproc_client import InprocEngineClient
from tailserve.engine.messages import AddRequest, EngineInput, FinishRequests
from tailserve.engine.output_processor import OutputProcessor
from tailserve.obs.metrics import ServerMetrics
from tailserve.obs.timeline import Timeline
from tailserve.request import RequestStatus
from tailserve.server.app import create_app
from tailserve.server.context import ServerContext
from tailserve.server.settings import ServerSettings

MAX_NUM_SEQS, MAX_QUEUE_LEN = 4, 8
CAPACITY = MAX_NUM_SEQS + MAX_QUEUE_LEN


class FaultySendClient(InprocEngineClient):
    """The in-process engine, whose ``fail_send(k, exc)``-th send from now raises ``exc``
    instead of sending (once). Every send that went through is kept in ``sent``."""

    def __init__(self, args: EngineArgs, loaded: Any) -> None:
        super().__init__(args, loaded)
        self.sent: list[EngineInput] = []
        self._countdown = 0
        self._fault: BaseException | None = None

    def fail_send(self, k: int, exc: BaseException) -> None:
        self.sent.clear()
        self._countdown, self._fault = k, exc

    def _send(self, msg: EngineInput) -> None:
        if self._fault is not None:
            self._countdown -= 1
            if self._countdown == 0:
                exc, self._fault = self._fault, None
                raise exc
        super()._send(msg)
        self.sent.append(msg)


@pytest.fixture(scope="module")
def args(tiny_model_dir: str) -> EngineArgs:
    return EngineArgs(model=tiny_model_dir, kv_cache_memory=0.1, max_num_seqs=MAX_NUM_SEQS,
                      max_queue_len=MAX_QUEUE_LEN)


@pytest.fixture(scope="module")
def loaded(args: EngineArgs) -> Any:
    from tailserve.model.loader import load_model

    return load_model(args.model)


@pytest.fixture(scope="module")
def tokenizer(args: EngineArgs) -> Any:
    from tailserve.model.loader import load_tokenizer

    return load_tokenizer(args.model)


Scenario = Callable[[httpx.AsyncClient, FaultySendClient, ServerContext], Awaitable[None]]


@contextlib.asynccontextmanager
async def served(
    args: EngineArgs, loaded: Any, tokenizer: Any
) -> AsyncIterator[tuple[str, FaultySendClient, ServerContext]]:
    engine = FaultySendClient(args, loaded)
    await engine.start()
    port = free_port()
    settings = ServerSettings(port=port, log_level="warning")
    ctx = ServerContext(settings, engine, tokenizer, ["tiny"], ServerMetrics(),
                        Timeline(maxlen=1000))
    server = uvicorn.Server(uvicorn.Config(
        create_app(ctx), host="127.0.0.1", port=port, log_level="warning", lifespan="off",
        access_log=False,
    ))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done(), "uvicorn stopped during start-up"
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}", engine, ctx
    finally:
        server.should_exit = True
        await task
        await engine.shutdown()


@pytest.fixture
def run(args: EngineArgs, loaded: Any, tokenizer: Any) -> Callable[[Scenario], None]:
    def go(scenario: Scenario) -> None:
        async def main() -> None:
            async with served(args, loaded, tokenizer) as (url, engine, ctx), \
                    httpx.AsyncClient(base_url=url, timeout=60) as http:
                await scenario(http, engine, ctx)

        asyncio.run(main())

    return go


def body(n: int, prompt: str | list[str] = "Hello there", max_tokens: int = 4) -> dict[str, Any]:
    return {"prompt": prompt, "n": n, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0}


async def assert_nothing_in_flight(http: httpx.AsyncClient, engine: FaultySendClient) -> None:
    """No request registered here, none running or waiting in the engine, and the whole
    capacity still admits: one request of exactly max_num_seqs + max_queue_len sequences."""
    deadline = time.monotonic() + 30
    while True:
        text = (await http.get("/metrics")).text
        counts = (engine.num_inflight, metric_value(text, "tailserve:num_requests_running"),
                  metric_value(text, "tailserve:num_requests_waiting"))
        if counts == (0, 0, 0) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert counts == (0, 0, 0), engine.inflight_request_ids
    full = await http.post("/v1/completions", json=body(CAPACITY, max_tokens=2))
    assert full.status_code == 200, full.text
    choices = full.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(CAPACITY))
    assert all(c["finish_reason"] == "length" for c in choices), choices
    assert engine.num_inflight == 0
    assert (await http.get("/health")).status_code == 200


# ------------------------------------------------------------------------------ faults
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize(("fault", "status", "code"), [
    (RuntimeError("injected send failure"), 500, "internal_error"),
    (EngineDeadError("injected: the engine is gone"), 503, "engine_dead"),
])
def test_a_failed_send_at_any_child_leaves_nothing_in_flight(
    run: Callable[[Scenario], None], k: int, fault: BaseException, status: int, code: str
) -> None:
    """n=3: the k-th child's send fails. The k-1 children already sent are finished in the
    engine, the k-th is not registered, the third never sent; the user gets the error."""

    async def scenario(http: httpx.AsyncClient, engine: FaultySendClient,
                       ctx: ServerContext) -> None:
        engine.fail_send(k, fault)
        r = await http.post("/v1/completions", json=body(3))
        assert r.status_code == status, r.text
        assert r.json()["error"]["code"] == code
        if status == 503:
            assert r.json()["error"]["message"] == (
                "the engine is not running: injected: the engine is gone"
            )
        sent_ids = [m.request_id for m in engine.sent if isinstance(m, AddRequest)]
        assert len(sent_ids) == k - 1
        finishes = [m for m in engine.sent if isinstance(m, FinishRequests)]
        if k == 1:
            assert finishes == []
        else:
            assert [(f.request_ids, f.status) for f in finishes] == [
                (sent_ids, RequestStatus.FINISHED_ABORTED)
            ]
        assert len(engine.sent) == len(sent_ids) + len(finishes)  # nothing else was sent
        await assert_nothing_in_flight(http, engine)

    run(scenario)


def test_a_fault_between_two_prompts_leaves_nothing_in_flight(
    run: Callable[[Scenario], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two prompts, n=2: the first prompt's children are sent, then registering the second
    prompt with the output processor fails. Both sent children are finished."""
    real = OutputProcessor.add_request
    calls = 0

    def second_fails(self: OutputProcessor, *a: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("injected failure between prompts")
        return real(self, *a, **kw)

    monkeypatch.setattr(OutputProcessor, "add_request", second_fails)

    async def scenario(http: httpx.AsyncClient, engine: FaultySendClient,
                       ctx: ServerContext) -> None:
        engine.sent.clear()
        r = await http.post("/v1/completions", json=body(2, prompt=["one", "two"]))
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "internal_error"
        adds = [m.request_id for m in engine.sent if isinstance(m, AddRequest)]
        assert len(adds) == 2
        assert [(m.request_ids, m.status) for m in engine.sent
                if isinstance(m, FinishRequests)] == [(adds, RequestStatus.FINISHED_ABORTED)]
        monkeypatch.setattr(OutputProcessor, "add_request", real)
        await assert_nothing_in_flight(http, engine)

    run(scenario)


def test_a_failed_send_in_a_full_server_gives_the_slots_back(
    run: Callable[[Scenario], None],
) -> None:
    """Eleven of twelve slots busy; a request of one fails to send. The twelfth slot is free
    again at once: the next request of one is admitted, the one after it is 429. The held
    requests are then given up by their clients (aborted in the engine)."""

    async def scenario(http: httpx.AsyncClient, engine: FaultySendClient,
                       ctx: ServerContext) -> None:
        hold: list[asyncio.Task[httpx.Response]] = [
            asyncio.create_task(http.post("/v1/completions", json=body(1, max_tokens=500)))
            for _ in range(CAPACITY - 1)
        ]
        deadline = time.monotonic() + 30
        while engine.num_inflight < CAPACITY - 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert engine.num_inflight == CAPACITY - 1
        engine.fail_send(1, RuntimeError("injected send failure"))
        failed = await http.post("/v1/completions", json=body(1))
        assert failed.status_code == 500, failed.text
        assert engine.num_inflight == CAPACITY - 1
        last = asyncio.create_task(http.post("/v1/completions", json=body(1, max_tokens=500)))
        while engine.num_inflight < CAPACITY and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert engine.num_inflight == CAPACITY
        over = await http.post("/v1/completions", json=body(1))
        assert over.status_code == 429, over.text
        assert over.json()["error"]["message"] == (
            f"the server is at capacity ({CAPACITY} requests in flight; max_num_seqs "
            f"{MAX_NUM_SEQS} + max_queue_len {MAX_QUEUE_LEN})"
        )
        assert not any(t.done() for t in [*hold, last])  # all of them were still running
        for t in [*hold, last]:
            t.cancel()
        await asyncio.gather(*hold, last, return_exceptions=True)
        await assert_nothing_in_flight(http, engine)

    run(scenario)
