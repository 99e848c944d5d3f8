"""/v1/completions and /v1/chat/completions: OpenAI requests in, OpenAI responses out."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tailserve.engine.client import EngineDeadError
from tailserve.engine.scheduler import check_request_lengths
from tailserve.errors import InvalidRequestError, QueueFullError
from tailserve.sampling_params import MAX_LOGPROBS, SamplingParams
from tailserve.server.context import ServerContext
from tailserve.server.errors import APIError, bad_request, engine_error, error_body
from tailserve.server.generation import Choice, ClientGone, Delta, Generation
from tailserve.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields


class OpenAIServing:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.tokenizer = ctx.tokenizer

    # ---------------------------------------------------------------- endpoints
    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        arrival = time.monotonic()
        self.ctx.check_model(body.model)
        if body.echo:
            raise bad_request("echo is not supported", param="echo")
        if body.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise bad_request(f"best_of must equal n ({body.n}), got {body.best_of}", "best_of")
        if body.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")
        prompts = self._completion_prompts(body.prompt)
        params = self._sampling_params(body, body.max_tokens, body.logprobs)
        gen = self._start(http, prompts, params, arrival, body.priority)
        k = params.logprobs or 0

        def choice(c: Choice) -> dict[str, Any]:
            return {
                "text": c.out.text,
                "logprobs": self._completion_logprobs(c.out.token_ids, c.out.logprobs, k)
                if c.out.logprobs is not None else None,
            }

        return await self._respond(
            gen, http, body, "cmpl", "text_completion", self._completion_chunk, choice
        )

    async def chat(self, body: ChatCompletionRequest, http: Request) -> Response:
        arrival = time.monotonic()
        self.ctx.check_model(body.model)
        if body.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")
        if body.tools:
            raise bad_request("tools are not supported", param="tools")
        ids = self.ctx.chat_token_ids(body.messages, body.add_generation_prompt)
        max_tokens = (
            body.max_completion_tokens if body.max_completion_tokens is not None
            else body.max_tokens
        )
        if body.max_completion_tokens is not None and body.max_completion_tokens < 1:
            raise bad_request(
                f"max_completion_tokens must be at least 1, got {body.max_completion_tokens}",
                param="max_completion_tokens",
            )
        top = body.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            # Checked here so the error names the chat field (SamplingParams says "logprobs").
            raise bad_request(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", param="top_logprobs"
            )
        logprobs = None
        if body.logprobs:
            logprobs = body.top_logprobs or 0
        elif body.top_logprobs is not None:
            raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
        params = self._sampling_params(body, max_tokens, logprobs)
        gen = self._start(http, [(None, ids)], params, arrival, body.priority)
        k = params.logprobs or 0

        def choice(c: Choice) -> dict[str, Any]:
            return {
                "message": {"role": "assistant", "content": c.out.text},
                "logprobs": {"content": self._chat_logprobs(c.out.token_ids, c.out.logprobs, k)}
                if c.out.logprobs is not None else None,
            }

        return await self._respond(
            gen, http, body, "chatcmpl", "chat.completion", self._chat_chunk, choice
        )

    async def _respond(
        self,
        gen: Generation,
        http: Request,
        body: CompletionRequest | ChatCompletionRequest,
        id_prefix: str,
        object_name: str,
        make_chunk: Callable[[Generation, str, Any, list[Delta], set[int]], dict[str, Any]],
        choice_body: Callable[[Choice], dict[str, Any]],
    ) -> Response:
        """Stream the generation, or wait for it and answer with one body."""
        rid = _response_id(http, id_prefix)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await self._stream(gen, http, rid, body, include_usage, make_chunk)
        await self._collect(gen, http)
        choices = [
            {
                "index": c.index,
                **choice_body(c),
                "finish_reason": c.out.finish_reason,
                "stop_reason": c.out.stop_reason,
                **_choice_timing(gen, c),
            }
            for c in gen.ordered_choices()
        ]
        return JSONResponse({
            "id": rid, "object": object_name, "created": int(time.time()),
            "model": self.ctx.model_name(body.model), "choices": choices,
            "usage": gen.usage(), "tailserve_timing": gen.ordered_choices()[0].timing,
        })

    # ---------------------------------------------------------------- building a request
    def _completion_prompts(self, prompt: Any) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            items = [list(prompt)]
        else:
            items = list(prompt)
        if not items:
            raise bad_request("prompt must not be empty", param="prompt")
        out: list[tuple[str | None, list[int]]] = []
        vocab = self.ctx.config.model.vocab_size
        for item in items:
            if isinstance(item, str):
                out.append((item, list(self.tokenizer(item).input_ids)))
            else:
                bad = [t for t in item if not 0 <= t < vocab]
                if bad:
                    raise bad_request(
                        f"prompt token ids must be in [0, {vocab}); got {bad[:5]}", "prompt"
                    )
                out.append((None, list(item)))
        return out

    def _sampling_params(
        self, body: _SamplingFields, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        given = {
            k: getattr(body, k)
            for k in (
                "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                "frequency_penalty", "repetition_penalty",
            )
            if getattr(body, k) is not None
        }
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            return SamplingParams(
                n=body.n, max_tokens=max_tokens, min_tokens=body.min_tokens, seed=body.seed,
                stop=stop, stop_token_ids=body.stop_token_ids or [],
                include_stop_str_in_output=body.include_stop_str_in_output,
                ignore_eos=body.ignore_eos, logprobs=logprobs,
                skip_special_tokens=body.skip_special_tokens, **given,
            )
        except InvalidRequestError as exc:
            raise bad_request(exc.message, exc.param) from None

    def _start(
        self,
        http: Request,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams,
        arrival: float,
        priority: int,
    ) -> Generation:
        ctx = self.ctx
        for _, ids in prompts:
            try:
                check_request_lengths(
                    ctx.config.scheduler, ctx.config.cache, len(ids), params.max_tokens
                )
            except InvalidRequestError as exc:
                raise bad_request(exc.message, exc.param) from None
        ctx.admit(len(prompts) * params.n)
        gen = Generation(
            ctx.client, self.tokenizer, _engine_id(), prompts, params, arrival, priority,
            ctx.on_choice_finished(http, params), record_id=http.state.request_id,
        )
        try:
            gen.submit()
        except EngineDeadError:
            raise ctx.dead_error() from None
        return gen

    # ---------------------------------------------------------------- running it
    async def _collect(self, gen: Generation, http: Request) -> None:
        while not gen.done:
            await self._next_outputs(gen, http)

    async def _next_outputs(self, gen: Generation, http: Request) -> list[Choice]:
        """The next outputs while the HTTP status is still ours to choose: a rejection or a
        dead engine becomes its API error, a vanished client a 499."""
        try:
            return await gen.next_outputs(http.is_disconnected)
        except ClientGone:
            raise APIError(499, "client closed the request", "client_closed") from None
        except BaseException as exc:
            gen.abort()
            raise self._map(exc) from None

    def _map(self, exc: BaseException) -> BaseException:
        if isinstance(exc, QueueFullError):
            # Counted in requests_rejected_total by the app's APIError handler (429).
            return self.ctx.queue_full_error(str(exc))
        if isinstance(exc, InvalidRequestError):
            return bad_request(exc.message, exc.param)
        if isinstance(exc, EngineDeadError):
            return engine_error(f"the engine failed: {exc}")
        return exc

    async def _stream(
        self,
        gen: Generation,
        http: Request,
        rid: str,
        body: Any,
        include_usage: bool,
        make_chunk: Callable[[Generation, str, Any, list[Delta], set[int]], dict[str, Any]],
    ) -> Response:
        # Wait for the first output before answering, so a rejection still gets its status.
        first = await self._next_outputs(gen, http)

        async def events() -> AsyncIterator[str]:
            changed = first
            started: set[int] = set()
            try:
                while True:
                    deltas = []
                    for c in sorted(changed, key=lambda c: c.index):
                        d = gen.delta(c, holdback=True)
                        if d.text or d.finish_reason or c.index not in started:
                            deltas.append(d)
                    if deltas:
                        chunk = make_chunk(gen, rid, body, deltas, started)
                        started.update(d.choice.index for d in deltas)
                        if gen.done and not include_usage:
                            chunk["tailserve_timing"] = gen.ordered_choices()[0].timing
                        yield _sse(chunk)
                    if gen.done:
                        break
                    changed = await gen.next_outputs()
                if include_usage:
                    yield _sse({
                        "id": rid, "object": chunk["object"], "created": chunk["created"],
                        "model": chunk["model"], "choices": [], "usage": gen.usage(),
                        "tailserve_timing": gen.ordered_choices()[0].timing,
                    })
            except EngineDeadError as exc:
                err = engine_error(f"the engine failed: {exc}")
                yield _sse(error_body(err.message, err.type, None, err.code))
            finally:
                # Client gone (the task is cancelled here) or any failure: free the blocks.
                if not gen.done:
                    gen.abort()
            yield "data: [DONE]\n\n"

        return StreamingResponse(
            events(), media_type="text/event-stream",
            headers={"x-request-id": http.state.request_id, "cache-control": "no-cache"},
        )

    # ---------------------------------------------------------------- chunk formats
    def _completion_chunk(
        self, gen: Generation, rid: str, body: Any, deltas: list[Delta], started: set[int]
    ) -> dict[str, Any]:
        k = gen.params.logprobs or 0
        choices = []
        for d in deltas:
            choices.append({
                "index": d.choice.index,
                "text": d.text,
                "logprobs": self._completion_logprobs(d.token_ids, d.logprobs, k)
                if d.logprobs is not None else None,
                "finish_reason": d.finish_reason,
                "stop_reason": d.choice.out.stop_reason if d.finish_reason else None,
            })
        return {
            "id": rid, "object": "text_completion", "created": int(time.time()),
            "model": self.ctx.model_name(body.model), "choices": choices,
        }

    def _chat_chunk(
        self, gen: Generation, rid: str, body: Any, deltas: list[Delta], started: set[int]
    ) -> dict[str, Any]:
        k = gen.params.logprobs or 0
        choices = []
        for d in deltas:
            delta: dict[str, Any] = {}
            if d.choice.index not in started:
                delta["role"] = "assistant"
            delta["content"] = d.text
            choices.append({
                "index": d.choice.index,
                "delta": delta,
                "logprobs": {"content": self._chat_logprobs(d.token_ids, d.logprobs, k)}
                if d.logprobs is not None else None,
                "finish_reason": d.finish_reason,
                "stop_reason": d.choice.out.stop_reason if d.finish_reason else None,
            })
        return {
            "id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": self.ctx.model_name(body.model), "choices": choices,
        }

    # ---------------------------------------------------------------- logprobs
    def _token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    @staticmethod
    def _top(lp: dict[int, float], k: int) -> list[tuple[int, float]]:
        # The engine sends the top-k plus the sampled token when it ranks lower.
        return sorted(lp.items(), key=lambda kv: kv[1], reverse=True)[:k]

    def _completion_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]], k: int, offset: int = 0
    ) -> dict[str, Any]:
        tokens = [self._token_text(t) for t in token_ids]
        offsets, pos = [], offset
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.get(t) for t, lp in zip(token_ids, logprobs, strict=False)],
            "top_logprobs": [
                {self._token_text(i): v for i, v in self._top(lp, k)} for lp in logprobs
            ],
            "text_offset": offsets,
        }

    def _chat_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]], k: int
    ) -> list[dict[str, Any]]:
        content = []
        for t, lp in zip(token_ids, logprobs, strict=False):
            text = self._token_text(t)
            top = []
            for i, v in self._top(lp, k):
                s = self._token_text(i)
                top.append({"token": s, "logprob": v, "bytes": list(s.encode())})
            content.append({
                "token": text, "logprob": lp.get(t), "bytes": list(text.encode()),
                "top_logprobs": top,
            })
        return content


def _choice_timing(gen: Generation, c: Choice) -> dict[str, Any]:
    return {"tailserve_timing": c.timing} if len(gen.choices) > 1 else {}


def _engine_id() -> str:
    return uuid.uuid4().hex


def _response_id(http: Request, prefix: str) -> str:
    return f"{prefix}-{http.state.request_id}"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
