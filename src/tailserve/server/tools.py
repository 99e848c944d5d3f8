"""Tool calling at the edge: a chat body's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``
checked into one ``ToolRequest``, its prompt, and the grammar that forces a call.

The prompt: a chat template that reads ``tools`` (found by parsing it: ``tools`` is one of its
variables) gets them, and the conversation's tool messages, as it expects. Any other template
(the bundled SmolLM2's) gets the **generic prompt**: a system message that lists the functions
as JSON and states the format a call is written in::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

An assistant message's ``tool_calls`` are written back in that format, and a ``tool`` message
becomes a user message ``<tool_response>{...}</tool_response>`` (consecutive ones joined), so a
template that knows only system/user/assistant renders the whole exchange.

``tool_choice``: ``none`` leaves the functions out of the prompt and the output unparsed;
``auto`` parses the output for calls (``tool_parser.py``); ``required`` and a named function
constrain the output with a JSON-schema grammar (llguidance, as ``response_format``), so the
call is always well formed and its arguments follow the function's schema:

- named: the output *is* the arguments object (the function's ``parameters``);
- ``required``: ``{"name": ..., "arguments": {...}}``, an ``anyOf`` over the functions, or an
  array of them (at least one) when ``parallel_tool_calls`` (OpenAI's default);
- ``auto`` with a ``strict`` function: a Lark grammar (``auto_lark``) that lets the text run
  free until it writes ``<tool_call>``, then holds it to a call: a declared name, arguments
  valid against the schema of a strict function (any object for the others), the closing tag.
  Without ``strict`` functions ``auto`` is not constrained (the text is read as it comes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tailserve.engine.structured_output import check_syntax, grammar_of
from tailserve.errors import InvalidRequestError
from tailserve.sampling_params import StructuredOutputsParams
from tailserve.server.errors import bad_request

ToolChoice = Literal["none", "auto", "required", "named"]
# A function without parameters takes the empty object (and nothing else).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                 "additionalProperties": False}
# OpenAI's function tool, whole: another key (a newer field, another vendor's) is a 400 naming
# it, not dropped. ``strict``: required / named calls follow the schema either way; under
# ``auto`` it turns the grammar on (``auto_lark``).
TOOL_KEYS = frozenset({"type", "function"})
FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool = False

    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else NO_PARAMETERS

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI (and chat templates) write it."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.schema()
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asked of tools. ``named``: the function ``tool_choice`` names."""

    functions: dict[str, FunctionSpec]
    choice: ToolChoice
    named: str | None
    parallel: bool

    @property
    def strict_auto(self) -> bool:
        """``auto`` with a ``strict`` function: the output is constrained (``auto_lark``) and
        calls are read only from ``<tool_call>`` blocks, the ones the grammar checked."""
        return self.choice == "auto" and any(f.strict for f in self.functions.values())

    def grammar(self) -> StructuredOutputsParams | None:
        """The grammar that forces a call (``required`` / named) or checks the calls of a
        strict ``auto``, or None."""
        if self.choice == "named":
            assert self.named is not None
            schema = self.functions[self.named].schema()
        elif self.choice == "required":
            calls = [_call_schema(f) for f in self.functions.values()]
            one = calls[0] if len(calls) == 1 else {"anyOf": calls}
            schema = {"type": "array", "items": one, "minItems": 1} if self.parallel else one
        elif self.strict_auto:
            return StructuredOutputsParams(grammar=auto_lark(self))
        else:
            return None
        return StructuredOutputsParams(json=json.dumps(schema, sort_keys=False,
                                                       separators=(",", ":")))


def _call_schema(f: FunctionSpec, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
    # "name" before "arguments": llguidance writes properties in the schema's order, which
    # lets the stream announce the call before its arguments (tool_parser.py).
    return {"type": "object", "properties": {"name": {"const": f.name},
                                             "arguments": arguments or f.schema()},
            "required": ["name", "arguments"], "additionalProperties": False}


# Any text that does not contain the opening tag (llguidance's and/not regex operators).
_NO_CALL_TEXT = "/(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/"


def auto_lark(tools: ToolRequest, answer: str | None = None) -> str:
    """The Lark grammar of a strict ``auto``: free text, in which each ``<tool_call>`` opens a
    call in the generic prompt's format (compact JSON, as ``required`` writes it), closed by
    ``</tool_call>``; at most one call without ``parallel_tool_calls``. With ``answer`` (the
    JSON schema of a ``response_format``, as text) the output is either that JSON or the
    calls, one a line, and nothing else: how an agent that wants a typed final answer and
    tools asks (the two alternatives begin with different characters, so nothing is lazy).

    The text before a call and its opening tag are one *lazy* lexeme, which ends at the first
    ``<tool_call>``: the free text can never swallow the tag (a plain text lexeme followed by
    the tag would need the lexer to take back bytes it had already given the text). The text
    after the last call is a plain lexeme: with parallel calls a tag in it starts the next
    call by the same lazy lexeme; with one call at most, it may not hold a tag at all.
    Functions without ``strict`` take any object as arguments (OpenAI's non-strict tools are
    not held to their schema either); their names are still checked."""
    calls = [_call_schema(f, None if f.strict else {"type": "object"})
             for f in tools.functions.values()]
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}  # as structured_output
    call = json.dumps(schema, separators=(",", ":"))
    if answer is not None:
        body = {**json.loads(answer), "x-guidance": {"whitespace_flexible": False}}
        several = 'call ("\\n" call)*' if tools.parallel else "call"
        return (f"start: answer | {several}\n"
                f"answer: %json {json.dumps(body, separators=(',', ':'))}\n"
                f"call: \"<tool_call>\" %json {call} \"</tool_call>\"\n")
    repeat, tail = ("*", "/(?s:.*)/") if tools.parallel else ("?", _NO_CALL_TEXT)
    return (f"start: call{repeat} tail\n"
            f"call: head %json {call} \"</tool_call>\"\n"
            "head[lazy]: /(?s:.*)<tool_call>/\n"
            f"tail: TAIL\nTAIL: {tail}\n")


def tool_request(tools: list[Any] | None, tool_choice: Any,
                 parallel_tool_calls: bool | None) -> ToolRequest | None:
    """Check the body's tool fields (400s naming ``tools`` or ``tool_choice``); None when the
    request has no tools."""
    if not tools:
        if tool_choice is not None:
            raise bad_request("tool_choice requires tools", param="tool_choice")
        return None
    functions: dict[str, FunctionSpec] = {}
    for i, tool in enumerate(tools):
        spec = _function(tool, f"tools[{i}]")
        if spec.name in functions:
            raise bad_request(f"tools[{i}]: function {spec.name!r} is declared twice",
                              param="tools")
        functions[spec.name] = spec
    choice: ToolChoice
    named = None
    if tool_choice is None or tool_choice == "auto":
        choice = "auto"
    elif tool_choice in ("none", "required"):
        choice = tool_choice
    elif isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}',
                              param="tool_choice")
        if name not in functions:
            names = sorted(functions)
            known = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise bad_request(f"tool_choice names function {name!r}, which is not among "
                              f"the {len(functions)} tools ({known})", param="tool_choice")
        choice, named = "named", name
    else:
        raise bad_request(f'tool_choice must be "none", "auto", "required" or a named '
                          f"function, got {tool_choice!r}"[:300], param="tool_choice")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return ToolRequest(functions, choice, named, parallel)


def _function(tool: Any, where: str) -> FunctionSpec:
    if not isinstance(tool, dict):
        raise bad_request(f"{where} must be an object", param="tools")
    kind = tool.get("type")
    if kind != "function":
        raise bad_request(f'{where}.type must be "function", got {kind!r}'[:300],
                          param="tools")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{where}.function must be an object", param="tools")
    unknown = sorted([k for k, v in tool.items() if k not in TOOL_KEYS and v is not None]
                     + [f"function.{k}" for k, v in fn.items()
                        if k not in FUNCTION_KEYS and v is not None])
    if unknown:
        raise bad_request(f"{where}: {', '.join(unknown)} not supported"[:300], param="tools")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.function.strict must be a boolean", param="tools")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.function.name is required (a non-empty string)",
                          param="tools")
    if len(name) > 64 or not all(c.isascii() and (c.isalnum() or c in "_-") for c in name):
        raise bad_request(f"{where}.function.name must be at most 64 of a-z, A-Z, 0-9, _ and "
                          f"-, got {name!r}"[:300], param="tools")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.function.description must be a string", param="tools")
    parameters = fn.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object",
                              param="tools")
        if parameters.get("type", "object") != "object":
            raise bad_request(f"{where}.function.parameters must describe an object "
                              f"(type \"object\"), got type {parameters.get('type')!r}"[:300],
                              param="tools")
    return FunctionSpec(name, description, parameters, strict=bool(strict))


def check_tool_schemas(tools: ToolRequest) -> None:
    """Each function's parameters as a grammar llguidance reads (no tokenizer: cheap), so a
    bad schema is a 400 naming ``tools`` under ``auto`` too."""
    for i, f in enumerate(tools.functions.values()):
        so = StructuredOutputsParams(json=json.dumps(f.schema()))
        try:
            check_syntax(grammar_of(so))
        except InvalidRequestError as exc:
            raise bad_request(f"tools[{i}].function.parameters: {exc.message}",
                              param="tools") from None


def check_tool_messages(messages: list[dict[str, Any]]) -> None:
    """An assistant's ``tool_calls`` and a ``tool`` message's ``tool_call_id`` as OpenAI
    defines them (400s naming ``messages``)."""
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is not None:
            if m.get("role") != "assistant":
                raise bad_request(f"messages[{i}]: only assistant messages have tool_calls",
                                  param="messages")
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                        or not isinstance(fn.get("arguments"), str)):
                    raise bad_request(f"messages[{i}].tool_calls[{j}] needs function.name and "
                                      "function.arguments (a JSON string)", param="messages")
        if m.get("role") == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise bad_request(f"messages[{i}]: a tool message needs tool_call_id",
                              param="messages")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that reads tools: call arguments as objects, as such
    templates write them with ``tojson`` (a string that is not JSON stays a string)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {"name": c["function"]["name"],
                                   "arguments": _arguments(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def generic_messages(messages: list[dict[str, Any]],
                     tools: ToolRequest | None) -> list[dict[str, Any]]:
    """The conversation for a template that knows only system/user/assistant (the module's
    docstring has the format); ``tools`` None or ``none``: no function list."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m.get("role"), _text(m.get("content"))
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_response"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_response": True})
            continue
        if role == "assistant" and m.get("tool_calls"):
            calls = [
                "<tool_call>" + json.dumps({"name": c["function"]["name"],
                                            "arguments": _arguments(c["function"]["arguments"])},
                                           ensure_ascii=False) + "</tool_call>"
                for c in m["tool_calls"]
            ]
            content = "\n".join(([content] if content else []) + calls)
        out.append({"role": role, "content": content})
    for m in out:
        m.pop("tool_response", None)
    if tools is None or tools.choice == "none":
        return out
    block = tools_system_prompt(tools)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content or ""


def tools_system_prompt(tools: ToolRequest) -> str:
    """The generic prompt's block: the functions as JSON, one a line, and the call format."""
    listing = "\n".join(json.dumps(f.openai()["function"], ensure_ascii=False)
                        for f in tools.functions.values())
    if tools.choice == "named":
        when = f"You must call the function {tools.named}."
    elif tools.choice == "required":
        when = "You must call one or more of these functions."
    else:
        when = "Call a function when it helps to answer; otherwise answer in plain text."
    return (
        "You can call these functions:\n<tools>\n" + listing + "\n</tools>\n" + when + "\n"
        "To call a function, write one line per call, exactly:\n"
        '<tool_call>{"name": "<function name>", "arguments": {<arguments as JSON>}}'
        "</tool_call>\nThe results come back in <tool_response></tool_response>."
    )
