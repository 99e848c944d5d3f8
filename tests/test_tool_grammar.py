"""``tool_choice: "auto"`` with ``strict`` functions: the Lark grammar (server/tools.py's
``auto_lark``) checked token by token on the bundled model's tokenizer with llguidance, so
what it accepts is exact: free text, calls in the generic prompt's format with a declared name
and (strict) valid arguments, nothing else once ``<tool_call>`` is written."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tailserve.engine.structured_output import (
    build_matcher,
    check_syntax,
    grammar_of,
    lltokenizer_from_hf,
)
from tailserve.model.loader import load_tokenizer
from tailserve.sampling_params import StructuredOutputsParams as SO
from tailserve.server.tool_parser import parse_tool_calls
from tailserve.server.tools import ToolRequest, auto_lark, tool_request

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True,
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"], "additionalProperties": False}}}
# Not strict: any object as arguments, but the name is still one of the declared ones.
NOTE = {"type": "function", "function": {"name": "take_note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}}}}
CALL = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris","days":3}}</tool_call>'


@pytest.fixture(scope="module")
def hf() -> Any:
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def lltok(hf: Any) -> Any:
    return lltokenizer_from_hf(hf)


def _tools(parallel: bool = True) -> ToolRequest:
    tools = tool_request([WEATHER, NOTE], "auto", parallel)
    assert tools is not None and tools.strict_auto
    return tools


def _accepts(hf: Any, lltok: Any, tools: ToolRequest, text: str,
             answer: str | None = None) -> bool:
    """Whether the grammar takes ``text``'s tokens, one by one, and may end after them."""
    so = tools.grammar() if answer is None else SO(grammar=auto_lark(tools, answer))
    assert so is not None and so.grammar is not None
    grammar = grammar_of(so)
    check_syntax(grammar)
    matcher = build_matcher(lltok, grammar)
    for token in hf.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return bool(matcher.is_accepting())


@pytest.mark.parametrize("text", [
    "", "The weather in Paris is mild today.", "Use <tool and <tool_call but not a tag.\n",
    CALL, "Let me check.\n" + CALL, CALL + "\nDone.",
    CALL + "\n" + '<tool_call>{"name":"take_note","arguments":{"anything":[1,{"x":null}]}}'
    "</tool_call>",
])
def test_free_text_and_valid_calls_are_accepted(hf: Any, lltok: Any, text: str) -> None:
    assert _accepts(hf, lltok, _tools(), text)


@pytest.mark.parametrize("text", [
    # a strict function's argument of the wrong type, a missing one, an extra one
    '<tool_call>{"name":"get_weather","arguments":{"city":"Paris","days":"3"}}</tool_call>',
    '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>',
    '<tool_call>{"name":"get_weather","arguments":{"city":"Paris","days":3,"x":1}}'
    "</tool_call>",
    # a function that was not declared
    '<tool_call>{"name":"get_wether","arguments":{"city":"Paris","days":3}}</tool_call>',
    # the tag, then no call; a call never closed (the text cannot end inside it)
    "Sure. <tool_call> just kidding", CALL[:-len("</tool_call>")],
    # a non-strict function's arguments must still be an object
    '<tool_call>{"name":"take_note","arguments":"hello"}</tool_call>',
])
def test_bad_calls_are_rejected(hf: Any, lltok: Any, text: str) -> None:
    assert not _accepts(hf, lltok, _tools(), text)


def test_without_parallel_calls_a_second_call_is_rejected(hf: Any, lltok: Any) -> None:
    one = _tools(parallel=False)
    assert _accepts(hf, lltok, one, "Checking. " + CALL + " That is all.")
    assert not _accepts(hf, lltok, one, CALL + CALL)
    assert not _accepts(hf, lltok, one, CALL + " and <tool_call>")


def test_only_strict_auto_is_constrained_and_read_from_tags_only() -> None:
    plain = tool_request([NOTE], "auto", None)
    assert plain is not None and not plain.strict_auto and plain.grammar() is None
    # Under the grammar a bare JSON text is free text, never a call (nothing checked it).
    bare = json.dumps({"name": "get_weather", "arguments": {"city": 1}})
    assert parse_tool_calls(bare, _tools()) == (bare, [])
    loose = tool_request([{"type": "function", "function": {
        k: v for k, v in WEATHER["function"].items() if k != "strict"}}], "auto", None)
    assert [c.name for c in parse_tool_calls(bare, loose)[1]] == ["get_weather"]  # unchecked
    content, calls = parse_tool_calls("Let me check.\n" + CALL, _tools())
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] \
        == [("get_weather", {"city": "Paris", "days": 3})]


def test_with_a_json_answer_the_output_is_the_answer_or_calls(hf: Any, lltok: Any) -> None:
    # response_format beside strict tools (an agent's typed final output): one or the other.
    answer = json.dumps({"type": "object", "properties": {"summary": {"type": "string"}},
                         "required": ["summary"], "additionalProperties": False})
    for text, ok in [('{"summary":"Mild."}', True), (CALL, True), (CALL + "\n" + CALL, True),
                     ('{"summary":3}', False), ("It is mild.", False),
                     ('{"summary":"Mild."}' + CALL, False),
                     (CALL.replace('"days":3', '"days":"3"'), False)]:
        assert _accepts(hf, lltok, _tools(), text, answer) is ok, text
    assert not _accepts(hf, lltok, _tools(parallel=False), CALL + "\n" + CALL, answer)
