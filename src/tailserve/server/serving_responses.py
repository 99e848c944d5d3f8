"""POST /v1/responses: check the request under this endpoint's names, translate it
(``responses.py``), serve it through the chat path, and answer in one body or as the event
stream (``responses_stream.py``)."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tailserve.errors import InvalidRequestError
from tailserve.server.errors import APIError, bad_request
from tailserve.server.request_fields import check_fields
from tailserve.server.responses import PARAM_NAMES, ResponsesRequest, chat_request, from_chat
from tailserve.server.responses_stream import response_stream
from tailserve.server.serving import OpenAIServing
from tailserve.server.streaming import GenerationStream


class OpenAIServingResponses:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, body: ResponsesRequest, http: Request) -> Response:
        # What the chat path checks first, under this endpoint's names.
        self.serving.ctx.check_model(body.model)
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options requires stream: true", param="stream_options")
        check_fields(body, "responses")
        chat = chat_request(body)
        try:
            answer = await self.serving.chat(chat, http)
        except APIError as exc:
            raise _renamed(exc) from None
        except InvalidRequestError as exc:
            raise _renamed(bad_request(exc.message, exc.param)) from None
        rid = f"resp_{http.state.request_id}"
        if isinstance(answer, GenerationStream):
            return response_stream(answer, body, rid, self.serving.ctx.model_name())
        assert isinstance(answer, JSONResponse)
        return JSONResponse(from_chat(body, rid, json.loads(bytes(answer.body))))


def _renamed(exc: APIError) -> APIError:
    """The chat path's error, naming the field as this endpoint calls it."""
    if exc.param in PARAM_NAMES:
        exc.param = PARAM_NAMES[exc.param]
    return exc
