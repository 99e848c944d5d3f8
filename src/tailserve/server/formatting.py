"""OpenAI response formats: one formatter per endpoint.

A formatter turns a generation's choices into the endpoint's JSON: the body of a non-streamed
response, one streamed chunk, and the logprobs in the endpoint's shape. Everything the two
endpoints share (the envelope, the key order, finish and stop reasons, timing) is written once
in ``OpenAIFormatter``; the endpoints differ only in the fields between a choice's ``index``
and its ``finish_reason``, in ``choice_fields`` and ``delta_fields``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

from tailserve.server.chat_output import (
    ChatDelta,
    ChatOutput,
    ChatOutputParser,
    parse_chat_output,
)
from tailserve.server.generation import Choice, Delta, Generation
from tailserve.server.reasoning import ReasoningParserName
from tailserve.server.tools import ToolRequest


class OpenAIFormatter(ABC):
    """One request's formatter: built with the tokenizer (token texts for logprobs), the model
    name responses carry and the number of top logprobs the request asked for."""

    # The response id is ``{id_prefix}-{x-request-id}``.
    id_prefix: str
    object_name: str
    chunk_object_name: str

    def __init__(self, tokenizer: Any, model: str, top_logprobs: int) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.k = top_logprobs

    # ---------------------------------------------------------------- endpoint-specific
    @abstractmethod
    def choice_fields(self, c: Choice) -> dict[str, Any]:
        """The fields of a non-streamed choice between ``index`` and ``finish_reason``."""

    @abstractmethod
    def delta_fields(self, d: Delta, first: bool) -> dict[str, Any]:
        """The fields of a streamed choice between ``index`` and ``finish_reason``;
        ``first``: the choice's first chunk."""

    def finish_reason(self, c: Choice) -> str | None:
        """The choice's finish_reason once it finished (after its fields were built)."""
        return c.out.finish_reason

    # ---------------------------------------------------------------- shared
    def response(self, rid: str, gen: Generation) -> dict[str, Any]:
        """The body of a non-streamed response (``gen`` is done)."""
        choices = []
        for c in gen.ordered_choices():
            fields = self.choice_fields(c)
            choices.append({
                "index": c.index,
                **fields,
                "finish_reason": self.finish_reason(c),
                "stop_reason": c.out.stop_reason,
                # With several choices each carries its own; the response's is the first's.
                **({"tailserve_timing": c.timing} if len(gen.choices) > 1 else {}),
            })
        return {
            "id": rid, "object": self.object_name, "created": int(time.time()),
            "model": self.model, "choices": choices,
            "usage": gen.usage(), "tailserve_timing": gen.ordered_choices()[0].timing,
        }

    def chunk(self, rid: str, deltas: list[Delta], started: set[int]) -> dict[str, Any]:
        """One streamed chunk; ``started``: the indexes of choices already streamed."""
        choices = []
        for d in deltas:
            fields = self.delta_fields(d, d.choice.index not in started)
            choices.append({
                "index": d.choice.index,
                **fields,
                "finish_reason": self.finish_reason(d.choice) if d.finish_reason else None,
                "stop_reason": d.choice.out.stop_reason if d.finish_reason else None,
            })
        return {
            "id": rid, "object": self.chunk_object_name, "created": int(time.time()),
            "model": self.model, "choices": choices,
        }

    def usage_chunk(self, rid: str, last: dict[str, Any], gen: Generation) -> dict[str, Any]:
        """The final chunk ``stream_options.include_usage`` asks for (stamped like ``last``)."""
        return {
            "id": rid, "object": last["object"], "created": last["created"],
            "model": last["model"], "choices": [], "usage": gen.usage(),
            "tailserve_timing": gen.ordered_choices()[0].timing,
        }

    # ---------------------------------------------------------------- logprobs helpers
    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def top(self, lp: dict[int, float]) -> list[tuple[int, float]]:
        # The engine sends the top-k plus the sampled token when it ranks lower.
        return sorted(lp.items(), key=lambda kv: kv[1], reverse=True)[: self.k]


class CompletionFormatter(OpenAIFormatter):
    """/v1/completions: ``text`` and the legacy logprobs (tokens, token_logprobs, top_logprobs,
    text_offset)."""

    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, tokenizer: Any, model: str, top_logprobs: int) -> None:
        super().__init__(tokenizer, model, top_logprobs)
        # Per choice index: where its next streamed token starts in the choice's text, so
        # text_offset counts from the start of the completion in every chunk, as it does in
        # the non-streamed body.
        self._offsets: dict[int, int] = {}

    def choice_fields(self, c: Choice) -> dict[str, Any]:
        return {
            "text": c.out.text, "logprobs": self.logprobs(c.out.token_ids, c.out.logprobs)[0]
        }

    def delta_fields(self, d: Delta, first: bool) -> dict[str, Any]:
        index = d.choice.index
        logprobs, end = self.logprobs(d.token_ids, d.logprobs, self._offsets.get(index, 0))
        self._offsets[index] = end
        return {"text": d.text, "logprobs": logprobs}

    def logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]] | None, start: int = 0
    ) -> tuple[dict[str, Any] | None, int]:
        """The legacy logprobs of ``token_ids`` whose text begins at offset ``start``, and the
        offset after them."""
        if logprobs is None:
            return None, start
        tokens = [self.token_text(t) for t in token_ids]
        offsets, pos = [], start
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        token_logprobs = [lp.get(t) for t, lp in zip(token_ids, logprobs, strict=False)]
        if self.k == 0:
            # logprobs=0 asks for the sampled tokens' logprobs only: each entry names the
            # sampled token (as vLLM answers), never an empty dict that names nothing.
            top = [
                {text: value} for text, value in zip(tokens, token_logprobs, strict=False)
                if value is not None
            ]
        else:
            top = [{self.token_text(i): v for i, v in self.top(lp)} for lp in logprobs]
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }, pos


class ChatFormatter(OpenAIFormatter):
    """/v1/chat/completions: an assistant ``message`` (or ``delta``, with the role in a
    choice's first chunk) and logprobs as ``{"content": [...]}``."""

    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, tokenizer: Any, model: str, top_logprobs: int,
                 tools: ToolRequest | None = None,
                 reasoning: ReasoningParserName | None = None,
                 include_reasoning: bool = True) -> None:
        super().__init__(tokenizer, model, top_logprobs)
        self.tools = tools
        self.reasoning = reasoning
        # vLLM's include_reasoning: false still splits the thinking off, and leaves it out.
        self.show_reasoning = reasoning is not None and include_reasoning
        # Per choice index: the parsed message (non-streamed) or the stream's parser.
        self.outputs: dict[int, ChatOutput] = {}
        self._streams: dict[int, ChatOutputParser] = {}

    def output(self, c: Choice) -> ChatOutput:
        """The finished choice's message as data: content, reasoning, tool calls."""
        if c.index not in self.outputs:
            self.outputs[c.index] = parse_chat_output(c.out.text, self.tools, self.reasoning)
        return self.outputs[c.index]

    def finish_reason(self, c: Choice) -> str | None:
        if self.tools is None:
            return c.out.finish_reason
        stream = self._streams.get(c.index)
        calls = stream.num_calls if stream is not None else len(self.output(c).tool_calls)
        # A call the model finished (its own end, or the grammar's) is OpenAI's "tool_calls".
        if calls and c.out.finish_reason == "stop":
            return "tool_calls"
        return c.out.finish_reason

    def choice_fields(self, c: Choice) -> dict[str, Any]:
        out = self.output(c)
        message: dict[str, Any] = {"role": "assistant", "content": out.content}
        if self.show_reasoning:
            message["reasoning_content"] = out.reasoning_content
        if out.tool_calls:
            message["tool_calls"] = [call.openai() for call in out.tool_calls]
        return {"message": message, "logprobs": self.logprobs(c.out.token_ids, c.out.logprobs)}

    def delta_fields(self, d: Delta, first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if self.tools is None and self.reasoning is None:
            delta["content"] = d.text
        else:
            parser = self._streams.get(d.choice.index)
            if parser is None:
                parser = self._streams[d.choice.index] = ChatOutputParser(
                    self.tools, self.reasoning)
            part = parser.feed(d.text)
            if d.finish_reason is not None:
                end = parser.finish()
                part = ChatDelta(part.content + end.content,
                                 part.reasoning_content + end.reasoning_content,
                                 part.tool_calls + end.tool_calls)
            thought = part.reasoning_content if self.show_reasoning else ""
            if thought:
                delta["reasoning_content"] = thought
            if part.content or not (thought or part.tool_calls):
                delta["content"] = part.content
            if part.tool_calls:
                delta["tool_calls"] = [t.openai() for t in part.tool_calls]
        return {"delta": delta, "logprobs": self.logprobs(d.token_ids, d.logprobs)}

    def logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]] | None
    ) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        content = []
        for t, lp in zip(token_ids, logprobs, strict=False):
            text = self.token_text(t)
            top = []
            for i, v in self.top(lp):
                s = self.token_text(i)
                top.append({"token": s, "logprob": v, "bytes": list(s.encode())})
            content.append({
                "token": text, "logprob": lp.get(t), "bytes": list(text.encode()),
                "top_logprobs": top,
            })
        return {"content": content}
