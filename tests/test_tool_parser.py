"""Tool calls and reasoning read out of completion text (server/tool_parser.py,
server/reasoning.py, server/chat_output.py), as units: exact results for each documented form,
and the streamed parse equal to the whole one however the text is cut into deltas."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailserve.server.chat_output import ChatOutput, ChatOutputParser, parse_chat_output
from tailserve.server.errors import APIError
from tailserve.server.reasoning import split_reasoning
from tailserve.server.tool_parser import ToolCallDelta, accumulate
from tailserve.server.tools import (
    ToolRequest,
    check_tool_schemas,
    generic_messages,
    tool_request,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _tools(choice: Any, parallel: bool | None = None) -> ToolRequest:
    tools = tool_request([WEATHER, TIME], choice, parallel)
    assert tools is not None
    return tools


AUTO = _tools(None)
AUTO_ONE = _tools("auto", False)
REQUIRED = _tools("required")
REQUIRED_ONE = _tools("required", False)
NAMED = _tools({"type": "function", "function": {"name": "get_weather"}})


def _calls(out: ChatOutput) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in out.tool_calls]


def _streamed(text: str, cuts: list[int], tools: ToolRequest | None,
              reasoning: Any = None) -> tuple[str, str, list[tuple[str, str]]]:
    parser = ChatOutputParser(tools, reasoning)
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    content, thought, deltas = "", "", []
    for a, b in itertools.pairwise(bounds):
        part = parser.feed(text[a:b])
        content, thought = content + part.content, thought + part.reasoning_content
        deltas += part.tool_calls
    end = parser.finish()
    content, thought = content + end.content, thought + end.reasoning_content
    deltas += end.tool_calls
    # Each call's first delta announces it (id, name, no arguments yet); the rest are pieces.
    seen: set[int] = set()
    for d in deltas:
        if d.index not in seen:
            assert d.id is not None and d.id.startswith("call_") and d.arguments == ""
            seen.add(d.index)
        else:
            assert d.id is None and d.name is None
    return content, thought, [(c.name, c.arguments) for c in accumulate(deltas)]


CASES: list[tuple[str, ToolRequest | None, Any, ChatOutput]] = [
    ('Sure.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n',
     AUTO, None, ChatOutput("Sure.", None)),
    ('  {"name": "get_time", "arguments": {}}', AUTO, None, ChatOutput(None, None)),
    ('<tool_call>{"name": "get_time", "parameters": {}}</tool_call> <tool_call>{"name": '
     '"get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call> Done.', AUTO, None,
     ChatOutput("Done.", None)),
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": '
     '"get_time", "arguments": {}}</tool_call>', AUTO_ONE, None, ChatOutput(None, None)),
    ("Hello <tool_call>not json</tool_call> there  ", AUTO, None,
     ChatOutput("Hello <tool_call>not json</tool_call> there  ", None)),
    ('<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>', AUTO, None,
     ChatOutput('<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>', None)),
    ("Hello <tool_cal", AUTO, None, ChatOutput("Hello <tool_cal", None)),
    ('{"name": ["get_time"], "arguments": {}}', AUTO, None,
     ChatOutput('{"name": ["get_time"], "arguments": {}}', None)),
    ("[1, 2] are numbers", AUTO, None, ChatOutput("[1, 2] are numbers", None)),
    ("  \n", AUTO, None, ChatOutput("  \n", None)),
    ('[{"name":"get_weather","arguments":{"city":"P\\"x}"}},{"name":"get_time","arguments":'
     '{}}]', REQUIRED, None, ChatOutput(None, None)),
    ('{"name":"get_time","arguments":{}}', REQUIRED_ONE, None, ChatOutput(None, None)),
    ('[{"name":"get_weather","arguments":{"ci', REQUIRED, None, ChatOutput(None, None)),
    ('[{"na', REQUIRED, None, ChatOutput('{"na', None)),
    ('{"city":"Rome"}', NAMED, None, ChatOutput(None, None)),
    ('{"city":"Rome"}', NAMED, "deepseek_r1", ChatOutput(None, None)),
    ("<think>hmm </thi</think>\n\nAnswer", None, "qwen3",
     ChatOutput("\n\nAnswer", "hmm </thi")),
    ("I think so", None, "qwen3", ChatOutput("I think so", None)),
    ("plan first</think>Answer", None, "deepseek_r1", ChatOutput("Answer", "plan first")),
    ("\n<think>still thinking", None, "deepseek_r1", ChatOutput(None, "still thinking")),
    ("<think>a</think>b", None, None, ChatOutput("<think>a</think>b", None)),
    ('<think>need the time</think><tool_call>{"name": "get_time", "arguments": {}}'
     "</tool_call>", AUTO, "qwen3", ChatOutput(None, "need the time")),
]
EXPECTED_CALLS = [
    [("get_weather", '{"city": "Paris"}')], [("get_time", "{}")],
    [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')], [("get_time", "{}")],
    [], [], [], [], [], [],
    [("get_weather", '{"city":"P\\"x}"}'), ("get_time", "{}")], [("get_time", "{}")],
    [("get_weather", '{"ci')], [], [("get_weather", '{"city":"Rome"}')],
    [("get_weather", '{"city":"Rome"}')], [], [], [], [], [], [("get_time", "{}")],
]


@pytest.mark.parametrize(("case", "calls"), list(zip(CASES, EXPECTED_CALLS, strict=True)))
def test_whole_text(case: tuple[str, Any, Any, ChatOutput], calls: list[Any]) -> None:
    text, tools, reasoning, expected = case
    out = parse_chat_output(text, tools, reasoning)
    assert (out.content, out.reasoning_content) == (expected.content,
                                                   expected.reasoning_content)
    assert _calls(out) == calls
    assert len({c.id for c in out.tool_calls}) == len(calls)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(CASES) - 1), st.lists(st.integers(0, 120), max_size=12))
def test_streamed_in_any_pieces_is_the_whole(i: int, cuts: list[int]) -> None:
    text, tools, reasoning, _ = CASES[i]
    whole = parse_chat_output(text, tools, reasoning)
    assert _streamed(text, cuts, tools, reasoning) == (
        whole.content or "", whole.reasoning_content or "", _calls(whole))


def test_required_streams_arguments_as_they_come() -> None:
    parser = ChatOutputParser(REQUIRED, None)
    assert parser.feed('[{"name":"get_wea').tool_calls == []
    head = parser.feed('ther","arguments":{"ci').tool_calls
    assert [(d.index, d.name, d.arguments) for d in head] == [
        (0, "get_weather", ""), (0, None, '{"ci')]
    assert parser.feed('ty":"Oslo"}}').tool_calls == [ToolCallDelta(0, 'ty":"Oslo"}')]
    assert parser.finish().tool_calls == []


def test_split_reasoning() -> None:
    assert split_reasoning("<think>x</think>y", "deepseek_r1") == ("x", "y")
    assert split_reasoning("", "deepseek_r1") == (None, "")
    assert split_reasoning("<thi", "qwen3") == (None, "<thi")
    assert split_reasoning("<thi", "deepseek_r1") == ("<thi", "")


def _bad(tools: Any, choice: Any) -> APIError:
    with pytest.raises(APIError) as info:
        tool_request(tools, choice, None)
    return info.value


def test_bad_tools_name_their_field() -> None:
    nameless = {"type": "function", "function": {"parameters": {"type": "object"}}}
    assert _bad([nameless], None).param == "tools"
    assert _bad([{"type": "retrieval", "function": {"name": "f"}}], None).param == "tools"
    assert _bad([WEATHER, WEATHER], None).param == "tools"
    bad_params = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}
    assert _bad([bad_params], None).param == "tools"
    unknown = {"type": "function", "function": {"name": "nope"}}
    err = _bad([WEATHER], unknown)
    assert err.param == "tool_choice" and "'nope'" in err.message
    assert _bad(None, "auto").param == "tool_choice"
    assert _bad([WEATHER], "sometimes").param == "tool_choice"
    assert tool_request(None, None, True) is None


def test_a_parameters_schema_llguidance_cannot_read_is_a_400() -> None:
    bogus = tool_request([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "bogus"}}}}}], None, None)
    assert bogus is not None
    with pytest.raises(APIError) as info:
        check_tool_schemas(bogus)
    assert info.value.param == "tools" and "tools[0].function.parameters" in info.value.message
    check_tool_schemas(AUTO)


def test_grammars() -> None:
    def schema(tools: ToolRequest) -> Any:
        grammar = tools.grammar()
        assert grammar is not None and grammar.json is not None
        return json.loads(grammar.json)

    assert schema(NAMED) == WEATHER["function"]["parameters"]  # type: ignore[index]
    one = schema(REQUIRED_ONE)
    assert [c["properties"]["name"] for c in one["anyOf"]] == [
        {"const": "get_weather"}, {"const": "get_time"}]
    many = schema(REQUIRED)
    assert many["type"] == "array" and many["minItems"] == 1 and many["items"] == one
    assert AUTO.grammar() is None


def test_generic_prompt_renders_the_exchange() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
    ]
    out = generic_messages(messages, AUTO)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert '{"name": "get_weather", "description": "The weather in a city"' in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>{"name": "get_weather", "arguments": {"city": '
                                 '"Paris"}}</tool_call>')
    assert out[3]["content"] == ("<tool_response>\n18 C\n</tool_response>\n"
                                 "<tool_response>\nsunny\n</tool_response>")
    # The assistant's own call is read back by the parser as the same call.
    assert _calls(parse_chat_output(out[2]["content"], AUTO, None)) == [
        ("get_weather", '{"city": "Paris"}')]
