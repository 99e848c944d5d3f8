"""/v1/completions and /v1/chat/completions: OpenAI requests in, OpenAI responses out.

An endpoint reads its OpenAI body into prompts (the input processor tokenizes, templates and
validates them) and ``SamplingParams``, starts a ``Generation`` and hands it, with the
endpoint's formatter (``formatting.py``), to the one path that answers in one body or in SSE.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tailserve.engine.client import EngineDeadError
from tailserve.engine.input_processor import Prompt
from tailserve.errors import InvalidRequestError, QueueFullError, SLOUnattainableError
from tailserve.request import SLO
from tailserve.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from tailserve.server.context import ServerContext
from tailserve.server.errors import APIError, bad_request, engine_error
from tailserve.server.formatting import ChatFormatter, CompletionFormatter, OpenAIFormatter
from tailserve.server.generation import Choice, ClientGone, Generation
from tailserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
)
from tailserve.server.request_fields import Endpoint, check_fields
from tailserve.server.slo import request_slo
from tailserve.server.streaming import GenerationStream, chat_events
from tailserve.server.structured import structured_outputs_of
from tailserve.server.tenants import DEFAULT_TENANT, Tenant, tenant_salt
from tailserve.server.tools import (
    ToolRequest,
    auto_lark,
    check_tool_messages,
    check_tool_schemas,
    generic_messages,
    template_messages,
    tool_request,
)


class OpenAIServing:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.tokenizer = ctx.tokenizer
        self.inputs = ctx.input_processor

    # ---------------------------------------------------------------- endpoints
    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        arrival = time.monotonic()
        self.ctx.check_model(body.model)
        _check_common(body, "completions")
        if body.echo:
            raise bad_request("echo is not supported", param="echo")
        if body.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise bad_request(f"best_of must equal n ({body.n}), got {body.best_of}", "best_of")
        if body.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")
        prompts = await self.ctx.off_loop(self._completion_prompts, body.prompt)
        structured, grammar_s = await self._structured(body)
        params = self._sampling_params(body, _completion_max_tokens(body), body.logprobs,
                                       structured)
        # Built before the hand-off: from _start on, only code that aborts the generation on
        # failure runs, so no error can strand its engine requests.
        fmt = CompletionFormatter(
            self.tokenizer, self.ctx.model_name(), params.logprobs or 0
        )
        slo = request_slo(http.headers, body.slo)
        gen = self._start(http, prompts, params, arrival, body.priority, slo, body.cache_salt)
        gen.api_grammar_s = grammar_s
        return await self._respond(gen, http, body, fmt)

    async def chat(self, body: ChatCompletionRequest, http: Request) -> Response:
        arrival = time.monotonic()
        self.ctx.check_model(body.model)
        tools = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls)
        _check_common(body, "chat")
        if body.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")
        prompt = await self.ctx.off_loop(self._chat_prompt, body, tools)
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
        structured, grammar_s = await self._structured(body, tools)
        params = self._sampling_params(body, max_tokens, logprobs, structured)
        if tools is not None and tools.choice == "none":
            tools = None  # the text is all content
        fmt = ChatFormatter(self.tokenizer, self.ctx.model_name(), params.logprobs or 0,
                            tools, self.ctx.settings.reasoning_parser, body.include_reasoning)
        slo = request_slo(http.headers, body.slo)
        gen = self._start(http, [prompt], params, arrival, body.priority, slo,
                          body.cache_salt)  # as in completions
        gen.api_grammar_s = grammar_s
        return await self._respond(gen, http, body, fmt)

    async def _respond(
        self,
        gen: Generation,
        http: Request,
        body: CompletionRequest | ChatCompletionRequest,
        fmt: OpenAIFormatter,
    ) -> Response:
        """Stream the generation, or wait for it and answer with one body."""
        rid = f"{fmt.id_prefix}-{http.state.request_id}"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await self._stream(gen, http, rid, include_usage, fmt)
        await self._collect(gen, http)
        return JSONResponse(fmt.response(rid, gen))

    # ---------------------------------------------------------------- building a request
    def _completion_prompts(self, prompt: Any) -> list[Prompt]:
        """OpenAI's four prompt shapes (a text, a list of texts, token ids, a list of token-id
        lists) as one list of prompts, tokenized and checked by the input processor."""
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
            whats = ["prompt"]
        elif prompt and all(isinstance(p, int) for p in prompt):
            items = [list(prompt)]
            whats = ["prompt"]
        else:
            items = list(prompt)
            # A list names its items in error messages: "prompt[2] contains ...".
            whats = [f"prompt[{i}]" for i in range(len(items))]
        if not items:
            raise bad_request("prompt must not be empty", param="prompt")
        return [
            self.inputs.prompt(item if isinstance(item, str) else {"prompt_token_ids": item}, what)
            for item, what in zip(items, whats, strict=True)
        ]

    def _chat_prompt(self, body: ChatCompletionRequest, tools: ToolRequest | None) -> Prompt:
        """The conversation through the chat template: with the tools and tool messages as
        they are when the template reads tools, else in the generic prompt (tools.py)."""
        messages = [m.model_dump(include={"role", "content", "name", "tool_calls",
                                          "tool_call_id"}) for m in body.messages]
        check_tool_messages(messages)
        has_tool_messages = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
        if tools is None and not has_tool_messages:
            plain = [{"role": m["role"], "content": m["content"]} for m in messages]
            return self.inputs.chat(plain, body.add_generation_prompt)
        if self.inputs.template_reads_tools:
            listed = None if tools is None or tools.choice == "none" else [
                f.openai() for f in tools.functions.values()]
            return self.inputs.chat(template_messages(messages), body.add_generation_prompt,
                                    tools=listed)
        return self.inputs.chat(generic_messages(messages, tools), body.add_generation_prompt)

    async def _structured(
        self, body: _SamplingFields, tools: ToolRequest | None = None
    ) -> tuple[StructuredOutputsParams | None, float]:
        """The body's grammar (or the one a forced tool call needs), compiled within
        --grammar-timeout-ms (or a 400), and the seconds that took here."""
        found = structured_outputs_of(body)
        forced = tools.grammar() if tools is not None else None
        if forced is not None:
            if found is not None and tools is not None and tools.strict_auto:
                # A typed answer or calls (an agent's final output type beside its tools):
                # one grammar of both. Other grammars do not compose with calls.
                so, param = found
                if so.json is None and not so.json_object:
                    raise bad_request(f"strict function tools under tool_choice auto can be "
                                      f"combined with a JSON schema or json_object only, "
                                      f"not with {param}'s other forms", param=param)
                forced = StructuredOutputsParams(grammar=auto_lark(
                    tools, so.json if so.json is not None else '{"type":"object"}'))
                found = None
            if found is not None:
                raise bad_request(f"a forced tool call (tool_choice required or a named "
                                  f"function) cannot be combined with {found[1]}",
                                  param="tool_choice")
            found = forced, "tools"
        elif tools is not None and tools.choice != "none":
            # auto: no grammar, but a parameters schema llguidance cannot read is still a 400.
            await self.ctx.off_loop(check_tool_schemas, tools)
        if found is None:
            return None, 0.0
        so, param = found
        return so, await self.ctx.grammar.check(so, param)

    def _sampling_params(
        self, body: _SamplingFields, max_tokens: int | None, logprobs: int | None,
        structured: StructuredOutputsParams | None = None,
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
        # An InvalidRequestError here (and from the input processor) is the app's 400.
        return SamplingParams(
            n=body.n, max_tokens=max_tokens, min_tokens=body.min_tokens, seed=body.seed,
            stop=stop, stop_token_ids=body.stop_token_ids or [],
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos, logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens, structured_outputs=structured,
            **given,
        )

    def _start(
        self,
        http: Request,
        prompts: list[Prompt],
        params: SamplingParams,
        arrival: float,
        priority: int,
        slo: SLO,
        cache_salt: str | None = None,
    ) -> Generation:
        """Validate the lengths and fan ``n`` out (input processor), admit, then submit."""
        ctx = self.ctx
        engine_id = _engine_id()
        parents = [
            self.inputs.fan_out(f"{engine_id}-{p}", prompt, params, always_suffix=True)
            for p, prompt in enumerate(prompts)
        ]
        # No await from here to the end of submit(): no other request is admitted between
        # the count and the registrations, and submit() is all or nothing.
        state = http.scope.get("state")
        ctx.admit(len(parents), params.n, state)
        tenant: Tenant | None = (state or {}).get("tenant")
        if tenant is not None:
            ctx.tenant_limits.admit(tenant, len(parents) * params.n)
        if ctx.settings.cache_salt_by_tenant:
            cache_salt = tenant_salt(tenant.name if tenant else DEFAULT_TENANT, cache_salt)
        gen = Generation(
            ctx.client, self.tokenizer, parents, params, arrival, priority,
            ctx.on_choice_finished(http, params), record_id=http.state.request_id, slo=slo,
            cache_salt=cache_salt, tenant=tenant.name if tenant else None,
            tenant_weight=tenant.weight if tenant else 1.0,
        )
        try:
            gen.submit()
        except EngineDeadError as exc:
            # Died between the admission and a child's send: nothing of it is left in flight.
            raise ctx.dead_error(str(exc)) from None
        if tenant is not None:
            ctx.tenant_limits.register(tenant, list(gen.choices))
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
        except asyncio.CancelledError:
            # The server cancels the handler of a connection that went away.
            gen.abort("client_disconnect")
            raise
        except BaseException as exc:
            gen.abort(None)  # the engine's rejection or death, accounted where it is mapped
            raise self._map(exc) from None

    def _map(self, exc: BaseException) -> BaseException:
        if isinstance(exc, QueueFullError):
            # Counted in requests_rejected_total by the app's APIError handler (429), by
            # reason: queue_full, or ttft_slo with the engine's own Retry-After.
            return self.ctx.queue_full_error(str(exc), exc.retry_after_s, exc.reason)
        if isinstance(exc, SLOUnattainableError):
            return bad_request(exc.message, exc.param, "ttft_slo_unattainable")
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
        include_usage: bool,
        fmt: OpenAIFormatter,
    ) -> Response:
        # Wait for the first output before answering, so a rejection still gets its status.
        first = await self._next_outputs(gen, http)

        headers = {"x-request-id": http.state.request_id, "cache-control": "no-cache"}
        return GenerationStream(chat_events(gen, first, rid, include_usage, fmt), gen, headers)


def _check_common(body: _SamplingFields, endpoint: Endpoint) -> None:
    """What OpenAI and vLLM refuse on both endpoints, then every refused field by name."""
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options requires stream: true", param="stream_options")
    check_fields(body, endpoint)


def _completion_max_tokens(body: CompletionRequest) -> int | None:
    """max_tokens, or chat's max_completion_tokens; both given must agree."""
    if body.max_completion_tokens is None:
        return body.max_tokens
    if "max_tokens" in body.model_fields_set and body.max_tokens != body.max_completion_tokens:
        raise bad_request(
            f"max_tokens ({body.max_tokens}) and max_completion_tokens "
            f"({body.max_completion_tokens}) disagree; give one", param="max_completion_tokens",
        )
    return body.max_completion_tokens


def _engine_id() -> str:
    return uuid.uuid4().hex
