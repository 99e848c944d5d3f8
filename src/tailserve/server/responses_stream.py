"""/v1/responses streamed: the chat path's chunks in, OpenAI's Responses events out.

The sequence, as OpenAI sends it::

    response.created, response.in_progress
    per output item:  response.output_item.added
      a message:      response.content_part.added, response.output_text.delta...,
                      response.output_text.done, response.content_part.done
      a function call: response.function_call_arguments.delta..., ...arguments.done
                      response.output_item.done
    response.completed | response.incomplete (cut by max_output_tokens) | response.failed

Every event carries ``type`` and a ``sequence_number`` counting from 0, and is sent as
``event: <type>`` + ``data: <json>``. A message item opens at its first text and closes when
a tool call begins or the generation ends; a response with no output at all still gets its one
(empty) message, as the non-streamed body does. The final event's response carries the usage
and ``tailserve_timing`` from the chat path's last chunk.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from tailserve.server.responses import (
    ResponsesRequest,
    function_call_item,
    message_item,
    outcome,
    response_object,
    text_part,
    usage,
)
from tailserve.server.streaming import GenerationStream

_FINAL_EVENT = {
    "completed": "response.completed", "incomplete": "response.incomplete",
    "failed": "response.failed",
}


class ResponseEvents:
    """One response's event sequence, fed the chat path's streamed chunks in order."""

    def __init__(self, body: ResponsesRequest, rid: str, model: str) -> None:
        self.body = body
        self.rid = rid
        self.model = model
        self.created = time.time()
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # output items in output_index order
        self.message: int | None = None  # output_index of the open message
        self.text = ""  # the open message's text so far
        self.calls: dict[int, int] = {}  # chat tool-call index -> output_index, while open
        self.finish_reason: str | None = None
        self.chat_usage: dict[str, int] | None = None
        self.timing: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None

    def _event(self, type: str, **fields: Any) -> str:
        payload = {"type": type, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def _snapshot(self, status: str, **rest: Any) -> dict[str, Any]:
        return response_object(self.body, self.rid, self.model, self.created, status,
                               [dict(item) for item in self.items], **rest)

    # ---------------------------------------------------------------- the sequence
    def start(self) -> list[str]:
        return [self._event("response.created", response=self._snapshot("in_progress")),
                self._event("response.in_progress", response=self._snapshot("in_progress"))]

    def on_chunk(self, chunk: dict[str, Any]) -> list[str]:
        if "error" in chunk:  # the engine failed mid-stream
            self.error = {"code": "server_error", "message": str(chunk["error"].get("message"))}
            return []
        if chunk.get("usage") is not None:
            self.chat_usage = chunk["usage"]
        if chunk.get("tailserve_timing") is not None:
            self.timing = chunk["tailserve_timing"]
        events: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[str]:
        """Close what is open and end the response (once the chat stream has ended)."""
        status, incomplete = outcome(self.finish_reason)
        if self.error is not None:
            status = "failed"
        elif self.finish_reason is None:
            status = "failed"
            self.error = {"code": "server_error", "message": "the generation ended early"}
        item_status = "incomplete" if status == "incomplete" else "completed"
        events: list[str] = []
        if not self.items and status != "failed":
            events += self._open_message()
        events += self._close_message(item_status)
        for index in list(self.calls.values()):
            events += self._close_call(index)
        self.calls.clear()
        final = self._snapshot(status, incomplete_details=incomplete, error=self.error,
                               usage=usage(self.chat_usage, self.timing),
                               tailserve_timing=self.timing)
        events.append(self._event(_FINAL_EVENT[status], response=final))
        return events

    # ---------------------------------------------------------------- a message's text
    def _open_message(self) -> list[str]:
        self.message = index = len(self.items)
        item = message_item(f"msg_{self.rid}", "", "in_progress")
        self.items.append(item)
        return [
            self._event("response.output_item.added", output_index=index, item=dict(item)),
            self._event("response.content_part.added", item_id=item["id"], output_index=index,
                        content_index=0, part=text_part("")),
        ]

    def _text(self, text: str) -> list[str]:
        events = self._open_message() if self.message is None else []
        assert self.message is not None
        item = self.items[self.message]
        self.text += text
        events.append(self._event("response.output_text.delta", item_id=item["id"],
                                  output_index=self.message, content_index=0, delta=text,
                                  logprobs=[]))
        return events

    def _close_message(self, status: str) -> list[str]:
        if self.message is None:
            return []
        index, self.message = self.message, None
        item = self.items[index]
        text, self.text = self.text, ""
        part = text_part(text)
        self.items[index] = done = message_item(item["id"], text, status)
        return [
            self._event("response.output_text.done", item_id=item["id"], output_index=index,
                        content_index=0, text=text, logprobs=[]),
            self._event("response.content_part.done", item_id=item["id"], output_index=index,
                        content_index=0, part=part),
            self._event("response.output_item.done", output_index=index, item=done),
        ]

    # ---------------------------------------------------------------- function calls
    def _call(self, call: dict[str, Any]) -> list[str]:
        """A chat tool-call delta: the first for its index opens a function_call item (with
        the call's id and name), each carries an arguments fragment."""
        k = int(call.get("index", 0))
        fn = call.get("function") or {}
        events: list[str] = []
        index = self.calls.get(k)
        if index is None:
            events += self._close_message("completed")  # text before a call is done
            index = self.calls[k] = len(self.items)
            item = function_call_item(f"fc_{self.rid}_{k}", str(call.get("id")),
                                      str(fn.get("name")), "", "in_progress")
            self.items.append(item)
            events.append(self._event("response.output_item.added", output_index=index,
                                      item=dict(item)))
        fragment = fn.get("arguments") or ""
        if fragment:
            item = self.items[index]
            item["arguments"] += fragment
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=index, delta=fragment))
        return events

    def _close_call(self, index: int) -> list[str]:
        item = self.items[index]
        item["status"] = "completed"
        return [
            self._event("response.function_call_arguments.done", item_id=item["id"],
                        output_index=index, arguments=item["arguments"]),
            self._event("response.output_item.done", output_index=index, item=dict(item)),
        ]


def response_stream(chat: GenerationStream, body: ResponsesRequest, rid: str,
                    model: str) -> GenerationStream:
    """The Responses event stream over the chat path's stream ``chat``; like it, it aborts
    the generation when the response ends before the generation did."""
    machine = ResponseEvents(body, rid, model)
    inner = chat.body_iterator

    async def events() -> AsyncIterator[str]:
        try:
            for event in machine.start():
                yield event
            async for sse in inner:
                text = sse if isinstance(sse, str) else bytes(sse).decode()
                for line in text.splitlines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for event in machine.on_chunk(json.loads(line[6:])):
                        yield event
            for event in machine.finish():
                yield event
        finally:
            # A client gone ends this generator: the chat stream's own cleanup records why.
            await inner.aclose()  # type: ignore[attr-defined]

    headers = {k: v for k, v in chat.headers.items() if k in ("x-request-id", "cache-control")}
    return GenerationStream(events(), chat.generation, headers=headers)
