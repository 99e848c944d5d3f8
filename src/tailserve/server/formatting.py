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

from tailserve.server.generation import Choice, Delta, Generation


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

    # ---------------------------------------------------------------- shared
    def response(self, rid: str, gen: Generation) -> dict[str, Any]:
        """The body of a non-streamed response (``gen`` is done)."""
        choices = [
            {
                "index": c.index,
                **self.choice_fields(c),
                "finish_reason": c.out.finish_reason,
                "stop_reason": c.out.stop_reason,
                # With several choices each carries its own; the response's is the first's.
                **({"tailserve_timing": c.timing} if len(gen.choices) > 1 else {}),
            }
            for c in gen.ordered_choices()
        ]
        return {
            "id": rid, "object": self.object_name, "created": int(time.time()),
            "model": self.model, "choices": choices,
            "usage": gen.usage(), "tailserve_timing": gen.ordered_choices()[0].timing,
        }

    def chunk(self, rid: str, deltas: list[Delta], started: set[int]) -> dict[str, Any]:
        """One streamed chunk; ``started``: the indexes of choices already streamed."""
        choices = [
            {
                "index": d.choice.index,
                **self.delta_fields(d, d.choice.index not in started),
                "finish_reason": d.finish_reason,
                "stop_reason": d.choice.out.stop_reason if d.finish_reason else None,
            }
            for d in deltas
        ]
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

    def choice_fields(self, c: Choice) -> dict[str, Any]:
        return {
            "message": {"role": "assistant", "content": c.out.text},
            "logprobs": self.logprobs(c.out.token_ids, c.out.logprobs),
        }

    def delta_fields(self, d: Delta, first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        delta["content"] = d.text
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
