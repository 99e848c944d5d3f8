"""Tool calling and the reasoning split over HTTP, driven by the official ``openai`` client on
loopback with the bundled model (its template does not read tools: the generic prompt).

Forced calls (``tool_choice`` required or named) always parse and validate against their
schema; ``auto`` reads calls out of the text; streamed calls are reassembled by the SDK into the
non-streamed answer; tool messages round-trip; bad tool input is a 400 naming its field; with
``--reasoning-parser`` the thinking lands in ``reasoning_content``, streamed apart."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from server_util import ServerProcess
from tailserve.server.errors import APIError
from tailserve.server.tools import generic_messages, tool_request

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False,
}
ADD_PARAMS = {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather",
                                      "description": "The current weather in a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": ADD_PARAMS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class GetWeather(BaseModel):
    city: str
    unit: str


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(["--max-model-len", "1024", "--reasoning-parser", "qwen3"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _check_calls(message: Any, names: set[str]) -> list[tuple[str, dict[str, Any]]]:
    """Every call is well formed: a call_ id, a declared name, arguments valid against its
    function's schema; returns (name, arguments)."""
    assert message.tool_calls, message
    out = []
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


@pytest.mark.slow
def test_required_and_named_calls_always_validate(client: openai.OpenAI) -> None:
    # Sampled (temperature 1, a seed each): 8 answers per form, every one a valid call.
    forms: list[tuple[Any, bool, set[str]]] = [
        ("required", False, {"get_weather", "add"}),
        ("required", True, {"get_weather", "add"}),
        ({"type": "function", "function": {"name": "add"}}, True, {"add"}),
    ]
    for choice, parallel, names in forms:
        for seed in range(8):
            done = client.chat.completions.create(
                model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                parallel_tool_calls=parallel, temperature=1.0, seed=seed, max_tokens=200)
            c = done.choices[0]
            assert c.finish_reason == "tool_calls", (choice, seed, c)
            calls = _check_calls(c.message, names)
            assert c.message.content is None
            if not parallel:
                assert len(calls) == 1


@pytest.mark.slow
def test_parse_reads_a_required_call_into_the_model(client: openai.OpenAI) -> None:
    done = client.chat.completions.parse(
        model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=200)
    call = done.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


@pytest.mark.slow
def test_streamed_calls_reassemble_to_the_whole(client: openai.OpenAI) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kwargs: dict[str, Any] = dict(model=MODEL, messages=ASK, tools=TOOLS,
                                      tool_choice=choice, temperature=0, max_tokens=200)
        whole = client.chat.completions.create(**kwargs).choices[0].message
        expected = [(c.function.name, c.function.arguments) for c in whole.tool_calls or []]
        assert expected
        # The SDK's streaming helper.
        with client.chat.completions.stream(**kwargs) as stream:
            final = stream.get_final_completion()
        got = final.choices[0]
        assert got.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments)
                for c in got.message.tool_calls or []] == expected
        # Plain create(stream=True), accumulated as OpenAI's docs do; several argument
        # fragments arrive, the first delta of each call has its id and name.
        calls: dict[int, dict[str, str]] = {}
        fragments = 0
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            for tc in delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.id.startswith("call_") and tc.function is not None
                    assert tc.function.arguments == ""
                    calls[tc.index] = {"name": tc.function.name or "", "arguments": ""}
                else:
                    assert tc.id is None
                    fragments += 1
                    calls[tc.index]["arguments"] += (tc.function.arguments or "")  # type: ignore[union-attr]
            finish = chunk.choices[0].finish_reason or finish
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected
        assert fragments > 1 and finish == "tool_calls"


@pytest.mark.slow
def test_auto_reads_calls_in_the_documented_format(client: openai.OpenAI) -> None:
    # The live auto path, held to the documented format by a regex (the 135M model does not
    # write it on its own reliably): the text becomes a call, streamed and not.
    regex = (r'Let me check\.\n<tool_call>\{"name": "get_weather", "arguments": '
             r'\{"city": "Paris", "unit": "celsius"\}\}</tool_call>')
    kwargs: dict[str, Any] = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                  max_tokens=80, extra_body={"structured_outputs": {
                                      "regex": regex}})
    c = client.chat.completions.create(**kwargs).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
    assert _check_calls(c.message, {"get_weather"}) == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.message.content == "Let me check."
    assert [(t.function.name, t.function.arguments) for t in final.message.tool_calls or []] \
        == [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    # tool_choice none: the same text is all content.
    none = client.chat.completions.create(**{**kwargs, "tool_choice": "none"}).choices[0]
    assert none.finish_reason == "stop" and none.message.tool_calls is None
    assert none.message.content is not None and "<tool_call>" in none.message.content


@pytest.mark.slow
def test_strict_auto_calls_always_validate(client: openai.OpenAI) -> None:
    # tool_choice auto (the default) with a strict function: the grammar lets the text run
    # free and holds each <tool_call> to the schema. Two earlier exchanges in the history (as
    # the generic prompt writes calls back) make the 135M model call in some samples.
    strict = [{"type": "function", "function": {**t["function"], "strict": True}}
              for t in TOOLS]
    history: list[Any] = []
    for i, city in enumerate(["London", "Rome"]):
        history += [
            {"role": "user", "content": f"What is the weather like in {city} today?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{i}", "type": "function", "function": {
                    "name": "get_weather",
                    "arguments": json.dumps({"city": city, "unit": "celsius"})}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": '{"temperature": 18}'},
            {"role": "assistant", "content": f"It is 18 degrees in {city}."},
        ]
    called = 0
    for seed in range(16):
        c = client.chat.completions.create(
            model=MODEL, messages=[*history, *ASK], tools=strict, temperature=1.0, seed=seed,
            max_tokens=80).choices[0]
        if c.message.tool_calls:
            assert c.finish_reason in ("tool_calls", "length"), (seed, c)
            called += 1
            if c.finish_reason == "tool_calls":  # (a call cut by max_tokens is not returned)
                _check_calls(c.message, {"get_weather", "add"})
        if c.finish_reason != "length":  # every tag the model wrote became a valid call
            assert "<tool_call>" not in (c.message.content or ""), (seed, c)
    assert called > 0  # otherwise nothing was checked (2 of 8 seeds called when written)
    # With a JSON response_format beside them (an agent's typed final output): the answer is
    # that JSON or valid calls, nothing else.
    answer = {"type": "object", "properties": {"temperature": {"type": "integer"}},
              "required": ["temperature"], "additionalProperties": False}
    for seed in range(4):
        c = client.chat.completions.create(
            model=MODEL, messages=[*history, *ASK], tools=strict, temperature=1.0, seed=seed,
            max_tokens=80, response_format={"type": "json_schema", "json_schema": {
                "name": "weather", "schema": answer}}).choices[0]
        if c.finish_reason == "tool_calls":
            _check_calls(c.message, {"get_weather", "add"})
            assert c.message.content is None
        elif c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content or ""), answer)


@pytest.mark.slow
def test_auto_with_a_tool_using_prompt(client: openai.OpenAI) -> None:
    # The bundled 135M model, greedy, answers these in prose (it never wrote the call format
    # on its own in 5 prompts tried, few-shot included): auto leaves its text as content and
    # makes no call out of it. The forced-format test above covers the parse.
    for content in ("Add 2 and 3 with the add tool.", ASK[0]["content"]):
        c = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], tools=TOOLS,
            temperature=0, max_tokens=120).choices[0]
        # (stop or length: the prose's length varies with what ran before on this server)
        assert c.finish_reason in ("stop", "length") and c.message.tool_calls is None
        assert c.message.content and "<tool_call>" not in c.message.content


@pytest.mark.slow
def test_tool_messages_round_trip(server: ServerProcess, client: openai.OpenAI) -> None:
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 18}'},
    ]
    done = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                          temperature=0, max_tokens=30)
    assert done.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The prompt is exactly the generic rendering of the exchange (tools.py).
    rendered = generic_messages(history, tool_request(TOOLS, None, None))
    r = httpx.post(server.url + "/tokenize", json={"messages": rendered}, timeout=60)
    assert r.status_code == 200, r.text
    assert done.usage is not None and done.usage.prompt_tokens == r.json()["count"]
    assert "<tool_response>" in rendered[-1]["content"]


@pytest.mark.slow
def test_bad_tool_input_is_a_400_naming_its_field(server: ServerProcess) -> None:
    fn = {"name": "f", "parameters": {"type": "object"}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools"),
        ({"tools": [{"type": "function", "function": fn}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": fn}], "tool_choice": "maybe"},
         "tool_choice"),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {
                "a": {"type": "bogus"}}}}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {
                "a": {"type": "bogus"}}}}}], "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "function", "function": fn}], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {**fn, "strict": True}}],
          "structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "strict": True, "parameters": {"type": "object", "properties": {
                "a": {"type": "bogus"}}}}}]}, "tools"),
        ({"messages": [{"role": "tool", "content": "18"}]}, "messages"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
         "messages"),
    ]
    for extra, param in cases:
        body = {"messages": ASK, "max_tokens": 4, **extra}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.text)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "max_tokens": 2})
    assert r.status_code == 200  # and the engine keeps serving


def test_unknown_tool_keys_are_refused_by_name() -> None:
    # No server: tool_request checks the body's tools before anything is queued.
    fn = {"name": "f", "parameters": ADD_PARAMS}
    ok = tool_request([{"type": "function", "function": {**fn, "strict": True}}], None, None)
    assert ok is not None and list(ok.functions) == ["f"]
    for tool, word in (
        ({"type": "function", "function": {**fn, "defer_loading": True}}, "function.defer_loading"),
        ({"type": "function", "function": fn, "cache_control": {"type": "x"}}, "cache_control"),
        ({"type": "function", "function": {**fn, "strict": "yes"}}, "strict must be a boolean"),
    ):
        with pytest.raises(APIError) as err:
            tool_request([tool], None, None)
        assert err.value.param == "tools" and word in err.value.message, err.value.message
    # A key sent as null asks for nothing.
    assert tool_request([{"type": "function", "function": {**fn, "strict": None}}], None, None)


THINK = r"<think>[a-z]{2,8}( [a-z]{2,8}){1,4}</think>[A-Z][a-z]{1,8}( [a-z]{1,8}){1,3}\."


@pytest.mark.slow
def test_reasoning_is_split_streamed_and_not(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL, messages=[{"role": "user", "content": "Think, then answer: is ice cold?"}],
        temperature=0, max_tokens=60, extra_body={"structured_outputs": {"regex": THINK}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]  # type: ignore[index]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert message.content and message.content[0].isupper() and message.content.endswith(".")
    thought, content, n_reasoning = "", "", 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        part = (delta.model_extra or {}).get("reasoning_content")
        if part:
            assert not delta.content  # apart from content
            thought += part
            n_reasoning += 1
        content += delta.content or ""
    assert (thought, content) == (reasoning, message.content) and n_reasoning > 1
    # include_reasoning false leaves it out; without the tags, there is none.
    hidden = client.chat.completions.create(
        **{**kwargs, "extra_body": {**kwargs["extra_body"], "include_reasoning": False}})
    assert hidden.choices[0].message.content == message.content
    assert "reasoning_content" not in (hidden.choices[0].message.model_extra or {})
    plain = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0,
                                           max_tokens=8)
    assert plain.choices[0].message.model_extra["reasoning_content"] is None  # type: ignore[index]
