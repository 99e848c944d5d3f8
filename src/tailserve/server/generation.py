"""One HTTP request's generation: submit its engine requests, follow their outputs, record them.

A request with several prompts and ``n`` completions each arrives shaped by the input processor
(one ``ParentRequest`` per prompt); its ``prompts x n`` engine requests share one output queue
here. Text, stop strings and ``n`` grouping are the ``OutputProcessor``'s; this module adds what
the HTTP edge needs: per-choice deltas for streaming, client-disconnect handling, and one
``RequestRecord`` per finished choice for the metrics, the timeline and traces.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tailserve.data.records import RequestRecord
from tailserve.data.step import EngineOutput
from tailserve.engine.client import EngineClient, EngineDeadError, StreamItem
from tailserve.engine.input_processor import ParentRequest
from tailserve.engine.messages import AddRequest
from tailserve.engine.output_processor import OutputProcessor
from tailserve.outputs import CompletionOutput
from tailserve.request import SLO, FinishReason, RequestStatus
from tailserve.sampling_params import SamplingParams

# How often a non-streamed request checks whether its client is still there.
DISCONNECT_POLL_S = 0.1


class ClientGone(Exception):
    """The HTTP client disconnected; the engine requests have been aborted."""


def wall_from_monotonic(t: float) -> float:
    return time.time() - (time.monotonic() - t)


@dataclass
class Choice:
    """One completion: prompt ``prompt_index``, sample ``sample_index`` -> OpenAI ``index``."""

    index: int
    prompt_index: int
    engine_id: str
    out: CompletionOutput
    sent_chars: int = 0
    sent_tokens: int = 0
    last_t: float | None = None
    first_t: float | None = None  # engine-stamped, when its first token's step ended
    itl_s: list[float] = field(default_factory=list)
    timing: dict[str, Any] | None = None
    finished: bool = False


@dataclass
class Delta:
    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


class Generation:
    def __init__(
        self,
        client: EngineClient,
        tokenizer: Any,
        parents: list[ParentRequest],
        params: SamplingParams,
        arrival_time: float,
        priority: int,
        on_choice_finished: Callable[[RequestRecord], None],
        record_id: str,
        slo: SLO | None = None,
        cache_salt: str | None = None,
        tenant: str | None = None,
        tenant_weight: float = 1.0,
    ) -> None:
        """``parents``: the request's prompts, shaped and validated by the input processor,
        each with its ``n`` engine requests; ``params`` is what the request asked for."""
        self.client = client
        # The id records carry (the HTTP x-request-id), so client and server views join.
        self.record_id = record_id
        self.parents = parents
        self.params = params
        self.arrival_time = arrival_time
        self.priority = priority
        self.slo = slo or SLO()
        self.cache_salt = cache_salt
        self.tenant = tenant
        self.tenant_weight = tenant_weight
        self.on_choice_finished = on_choice_finished
        self.processor = OutputProcessor(tokenizer)
        self.queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self.choices: dict[str, Choice] = {}
        self._disconnect_checked = time.monotonic()
        # Children the output processor found a stop string in: their engine requests were
        # ended from here, and their records say so.
        self._stopped_by_string: set[str] = set()
        # Streaming holds back the last characters that could begin a stop string.
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        # Seconds the API spent compiling this request's grammar (server/structured.py),
        # added to each choice's engine-side grammar_s in tailserve_timing.
        self.api_grammar_s = 0.0

    # ---------------------------------------------------------------- submit
    def submit(self) -> None:
        """Send every engine request of this HTTP request, or none.

        A failure at any child (a dead engine, a failed send) finishes the children already
        sent, in the engine too, and re-raises: nothing of this request stays in flight, so
        admission counts what it counted before. ``add_request`` itself leaves nothing behind
        for the child that failed.
        """
        added: list[str] = []
        index = 0
        try:
            for p, parent in enumerate(self.parents):
                ids = parent.prompt.token_ids
                self.processor.add_request(
                    parent.request_id, parent.prompt.text, ids, parent.children
                )
                ro = self.processor.get(parent.request_id)
                assert ro is not None
                for i, (child_id, child_params) in enumerate(parent.children.items()):
                    self.choices[child_id] = Choice(index, p, child_id, ro.outputs[i])
                    index += 1
                    self.client.add_request(
                        AddRequest(child_id, ids, child_params, self.arrival_time, self.priority,
                                   self.slo.ttft_s, self.slo.itl_s, self.slo.tpot_s,
                                   cache_salt=self.cache_salt, tenant=self.tenant,
                                   tenant_weight=self.tenant_weight),
                        self.queue,
                    )
                    added.append(child_id)
        except BaseException:
            self.client.finish(added, RequestStatus.FINISHED_ABORTED, deliver_final=False)
            raise

    def fail(self, error_type: str) -> None:
        """Record every unfinished choice as failed (the engine died under it)."""
        for choice in self.choices.values():
            if not choice.finished:
                choice.finished = True
                choice.out.finish_reason = FinishReason.ERROR.value
                rec = self._record(choice, None)
                rec.error_type = error_type
                rec.http_status = 500
                rec.abort_reason = "engine_error"
                self.on_choice_finished(rec)

    def abort(self, reason: str | None) -> None:
        """Abort every unfinished choice; nothing more arrives for them.

        With ``reason`` (one of ``ABORT_REASONS``) each is recorded as finished with
        finish_reason "abort", so metrics and the timeline count it; ``None`` for a request the
        engine rejected, which is counted as a rejection where its error status is chosen.
        """
        unfinished = [c for c in self.choices.values() if not c.finished]
        self.client.finish(
            [c.engine_id for c in unfinished], RequestStatus.FINISHED_ABORTED,
            deliver_final=False,
        )
        if reason is None:
            return
        for choice in unfinished:
            choice.finished = True
            choice.out.finish_reason = FinishReason.ABORT.value
            rec = self._record(choice, None)
            rec.abort_reason = reason
            self.on_choice_finished(rec)

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices.values())

    # ---------------------------------------------------------------- consume
    async def next_outputs(
        self, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> list[Choice]:
        """Wait for the next engine output(s); returns the choices that changed.

        Raises the engine's rejection / death as an exception, or ``ClientGone``.
        """
        item = await self._get(is_disconnected)
        items = [item]
        while not self.queue.empty():  # apply everything that is already here at once
            items.append(self.queue.get_nowait())
        changed: dict[str, Choice] = {}
        for it in items:
            if isinstance(it, BaseException):
                if isinstance(it, EngineDeadError):
                    self.fail("engine_error")
                self.abort(None)  # a rejection (or nothing left after fail)
                raise it
            t, eo = it
            choice = self.choices.get(eo.request_id)
            if choice is None:
                continue
            self._apply(choice, t, eo)
            changed[choice.engine_id] = choice
        return list(changed.values())

    async def _get(self, is_disconnected: Callable[[], Awaitable[bool]] | None) -> StreamItem:
        if is_disconnected is None:
            return await self.queue.get()
        while True:
            # Check on a clock, not only when the queue is quiet: a busy engine sends an
            # output every step, and a hung-up client must still be noticed within the poll.
            now = time.monotonic()
            if now - self._disconnect_checked >= DISCONNECT_POLL_S:
                self._disconnect_checked = now
                if await is_disconnected():
                    self.abort("client_disconnect")
                    raise ClientGone()
            if not self.queue.empty():
                return self.queue.get_nowait()
            try:
                return await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue

    def _apply(self, choice: Choice, t: float, eo: EngineOutput) -> None:
        if eo.new_token_ids:
            if choice.last_t is not None:
                choice.itl_s.append(t - choice.last_t)
            else:
                choice.first_t = t
            choice.last_t = t
        _, to_stop = self.processor.process([eo])
        if to_stop:
            # Their final outputs (finish_reason "stop") still come, and finish the choices.
            self._stopped_by_string.update(to_stop)
            self.client.finish(to_stop, RequestStatus.FINISHED_STOPPED, deliver_final=True)
        if eo.finished:
            choice.finished = True
            choice.timing = eo.timing
            if choice.timing is not None and self.api_grammar_s:
                choice.timing["grammar_s"] = choice.timing.get("grammar_s", 0.0) \
                    + self.api_grammar_s
            rec = self._record(choice, eo)
            if choice.engine_id in self._stopped_by_string:
                rec.abort_reason = "stop_string"
            elif rec.finish_reason == FinishReason.ABORT.value:
                # The only abort the engine delivers a final output for is the drain's
                # (ServerContext.drain); every other one is recorded in abort().
                rec.abort_reason = "drain"
            self.on_choice_finished(rec)

    def _record(self, choice: Choice, eo: EngineOutput | None) -> RequestRecord:
        ts = eo.timestamps if eo is not None else None
        # Without a final output (an abort from here) the API's own stamps stand in.
        first = ts.first_token if ts is not None else choice.first_t
        finished = ts.finished if ts is not None and ts.finished is not None else time.monotonic()
        return RequestRecord(
            t=time.time(),
            request_id=self.record_id if len(self.choices) == 1
            else f"{self.record_id}-{choice.index}",
            finish_reason=choice.out.finish_reason,
            prompt_tokens=len(self.parents[choice.prompt_index].prompt.token_ids),
            output_tokens=len(choice.out.token_ids),
            timing=eo.timing if eo is not None else None,
            arrival_time=wall_from_monotonic(self.arrival_time),
            first_token_time=wall_from_monotonic(first) if first is not None else None,
            finished_time=wall_from_monotonic(finished),
            itl_s=choice.itl_s,
            priority=self.priority,
            tenant=self.tenant,
        )

    def delta(self, choice: Choice, holdback: bool) -> Delta:
        """What of ``choice`` has not been streamed yet (text minus a stop-string holdback)."""
        out = choice.out
        end = len(out.text)
        if holdback and not choice.finished:
            end = max(choice.sent_chars, end - self.holdback)
        text = out.text[choice.sent_chars : end]
        choice.sent_chars = end
        tokens = out.token_ids[choice.sent_tokens :]
        logprobs = out.logprobs[choice.sent_tokens :] if out.logprobs is not None else None
        choice.sent_tokens = len(out.token_ids)
        reason = out.finish_reason if choice.finished else None
        return Delta(choice, text, tokens, logprobs, reason)

    def usage(self) -> dict[str, int]:
        prompt = sum(len(parent.prompt.token_ids) for parent in self.parents)
        completion = sum(len(c.out.token_ids) for c in self.choices.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def ordered_choices(self) -> list[Choice]:
        return sorted(self.choices.values(), key=lambda c: c.index)
