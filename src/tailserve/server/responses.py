"""/v1/responses, stateless: OpenAI's Responses request in, a chat-completions request through
the one serving path, OpenAI's Responses body (or its event stream) out.

A Responses request is a chat request spelled differently: ``instructions`` is the system
message, ``input`` the conversation (text, or items: messages, ``function_call`` and
``function_call_output``), ``text.format`` the ``response_format``, ``max_output_tokens`` the
``max_completion_tokens``, function tools the chat ``tools``. So this module translates the
body into a ``ChatCompletionRequest`` and hands it to ``OpenAIServing.chat``: admission, the
grammar check, SLOs, tenants, records and metrics are the chat path's, unchanged. The chat
path's OpenAI answer (one body, or its chunks) is the contract read back here, so what the chat
endpoint serves (tool calls included) the Responses endpoint serves too. Nothing is stored:
``previous_response_id`` and ``store: true`` are 400s (``request_fields.py``).

This file: the request model and the translation both ways; ``responses_stream.py``: the event
sequence; ``serving_responses.py``: the route.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tailserve.server.errors import bad_request
from tailserve.server.protocol import ChatCompletionRequest, Int64, _Base

# Chat-path parameters that are served here under the same name (vLLM's sampling extensions
# and tailserve's own), handed to the chat request as they are.
PASSTHROUGH = (
    "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
    "stop", "stop_token_ids", "ignore_eos", "min_tokens", "priority", "cache_salt", "slo",
)
# The chat path's names for what a Responses request calls otherwise (an error names the
# field the client sent).
PARAM_NAMES = {
    "messages": "input", "response_format": "text",
    "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
}


class TextFormat(BaseModel):
    """``text.format``: text, json_object, or json_schema (with its name and schema)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Base):
    # Undeclared fields land in model_extra: the refused ones are found by check_fields, the
    # PASSTHROUGH ones go to the chat request.
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


# ---------------------------------------------------------------- request -> chat request
def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that asks for what ``body`` asks for."""
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        messages.extend(_messages(body.input))
    if not messages:
        raise bad_request("input must not be empty", param="input")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be at least 1, got {body.max_output_tokens}",
                          param="max_output_tokens")
    # A --reasoning-parser's reasoning_content has no place here (no reasoning items): it is
    # left out, as the request's "reasoning" field is refused.
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream,
                            "include_reasoning": False}
    if body.stream:
        # The chat path's last chunk then carries the usage the final event reports.
        chat["stream_options"] = {"include_usage": True}
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    for name in ("temperature", "top_p"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    fmt = body.text.format if body.text is not None else None
    if body.text is not None and body.text.verbosity is not None:
        raise bad_request("text.verbosity is not supported: the model has no verbosity control",
                          param="text")
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_request("text.format json_schema needs a schema", param="text")
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "description": fmt.description, "schema": fmt.json_schema,
            "strict": fmt.strict,
        }}
    if body.tools:
        chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(body.tools)]
        if body.parallel_tool_calls is not None:
            chat["parallel_tool_calls"] = body.parallel_tool_calls
        if body.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(body.tool_choice)
    elif body.tool_choice not in (None, "auto", "none"):
        raise bad_request("tool_choice requires tools", param="tool_choice")
    extra = body.model_extra or {}
    chat.update({k: extra[k] for k in PASSTHROUGH if k in extra})
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        param = PARAM_NAMES.get(loc[0], loc[0]) if loc else None
        raise bad_request(f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}",
                          param) from None


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages; consecutive function calls are one assistant turn."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer, "
                                  f"got {role!r}", param="input")
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind in ("function_call", "function_call_output"):
            messages.append(_tool_message(item, kind, where, messages))
        else:
            raise bad_request(f"{where}.type {kind!r} is not supported: input items are "
                              "messages, function_call and function_call_output (nothing is "
                              "stored, so no item_reference)", param="input")
    # Messages that became tool-call turns were merged into their predecessor.
    return [m for m in messages if m]


def _text(content: Any, where: str) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a text or a list of parts", param="input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{j}]: only input_text and output_text parts "
                              f"with a text are served (text only), got {kind!r}", param="input")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _tool_message(item: dict[str, Any], kind: str, where: str,
                  messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A function_call as an assistant tool call (joined to the assistant turn before it when
    that turn is one; an empty dict then), a function_call_output as a tool message."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{where}.call_id must be a non-empty string", param="input")
    if kind == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "tool_call_id": call_id,
                "content": _text(output, where) if not isinstance(output, str) else output}
    name, arguments = item.get("name"), item.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise bad_request(f"{where}: a function_call needs a name and its arguments as a "
                          "JSON text", param="input")
    call = {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last.get("role") == "assistant" and last.get("tool_calls"):
        last["tool_calls"].append(call)
        return {}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


_FUNCTION_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise bad_request(f"tools[{i}].type {tool.get('type')!r} is not supported: only "
                          "function tools are served", param="tools")
    unknown = sorted(k for k, v in tool.items() if k not in _FUNCTION_TOOL_KEYS and v is not None)
    if unknown:
        raise bad_request(f"tools[{i}]: {', '.join(unknown)} not supported", param="tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # auto, none, required: the chat path checks them
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(f"tool_choice {choice.get('type')!r} is not supported: give auto, none, "
                      "required or {\"type\": \"function\", \"name\": ...}", param="tool_choice")


# ---------------------------------------------------------------- chat answer -> response
def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)] if status != "in_progress" else []}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def outcome(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """The response's status and incomplete_details for the chat path's finish_reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":  # the server drained under it: cut short, not by a limit
        return "incomplete", None
    if finish_reason in ("stop", "tool_calls"):
        return "completed", None
    return "failed", None


def usage(chat_usage: dict[str, int] | None, timing: dict[str, Any] | None) -> dict[str, Any]:
    u = chat_usage or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    cached = int((timing or {}).get("cached_prompt_tokens") or 0)
    return {
        "input_tokens": u["prompt_tokens"],
        # cache_write_tokens counts OpenAI's explicit cache writes; the prefix cache keeps
        # blocks without any.
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


def response_object(body: ResponsesRequest, rid: str, model: str, created: float,
                    status: str, output: list[dict[str, Any]], **rest: Any) -> dict[str, Any]:
    """The Response object: what was asked echoed back, what came out, and ``rest``
    (usage, incomplete_details, error, tailserve_timing) where known."""
    fmt: dict[str, Any] = {"type": "text"}
    if body.text is not None and body.text.format is not None:
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True)
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "model": model, "output": output, "error": None, "incomplete_details": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls
        if body.parallel_tool_calls is not None else True,
        "previous_response_id": None, "reasoning": None, "store": False,
        "temperature": body.temperature, "top_p": body.top_p, "text": {"format": fmt},
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": body.tools or [], "truncation": "disabled", "user": body.user,
        "usage": None, **rest,
    }


def output_items(rid: str, message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """A chat answer's assistant message as output items: its text as a message (always one
    when there are no tool calls), each tool call as a function_call."""
    items: list[dict[str, Any]] = []
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    if text or not calls:
        items.append(message_item(f"msg_{rid}", text, status))
    for k, call in enumerate(calls):
        fn = call["function"]
        items.append(function_call_item(f"fc_{rid}_{k}", call["id"], fn["name"],
                                        fn["arguments"], "completed"))
    return items


def from_chat(body: ResponsesRequest, rid: str, chat: dict[str, Any]) -> dict[str, Any]:
    """The Response for the chat path's non-streamed answer."""
    choice = chat["choices"][0]
    status, incomplete = outcome(choice["finish_reason"])
    item_status = "incomplete" if status == "incomplete" else "completed"
    timing = chat.get("tailserve_timing")
    error = None
    if status == "failed":
        error = {"code": "server_error",
                 "message": f"the generation ended with finish_reason {choice['finish_reason']}"}
    return response_object(
        body, rid, chat["model"], chat.get("created", time.time()), status,
        output_items(rid, choice["message"], item_status), incomplete_details=incomplete,
        error=error, usage=usage(chat.get("usage"), timing), tailserve_timing=timing,
    )
