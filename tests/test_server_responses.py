"""/v1/responses, stateless: the translation to the chat path and back, the event sequence
checked event by event against the ``openai`` SDK's own types and stream accumulator, and a
real server on loopback driven by the SDK (``responses.create`` streaming and not,
``responses.stream``, ``responses.parse`` with a pydantic model), with its 400s named."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.responses import response_create_params as create_params
from pydantic import BaseModel, TypeAdapter

from server_util import ServerProcess, metric_value
from tailserve.server import responses as responses_module
from tailserve.server.errors import APIError
from tailserve.server.request_fields import BY_ENDPOINT
from tailserve.server.responses import ResponsesRequest, chat_request, from_chat
from tailserve.server.responses_stream import ResponseEvents

MODEL = "SmolLM2-135M-Instruct"
EVENT = TypeAdapter(ResponseStreamEvent)


def _request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "Hi", **fields})


# ---------------------------------------------------------------- the field table
def test_every_sdk_field_is_in_the_table() -> None:
    sdk = set(create_params.ResponseCreateParamsBase.__annotations__) | {"stream"}
    missing = sdk - set(BY_ENDPOINT["responses"])
    assert not missing, f"{sorted(missing)} are in no table"


def test_every_declared_and_passed_through_field_is_served() -> None:
    table = BY_ENDPOINT["responses"]
    for name in (*ResponsesRequest.model_fields, *responses_module.PASSTHROUGH):
        assert name in table, name
        assert table[name].support == "served" or name in ("stream_options", "metadata",
                                                            "user"), name


# ---------------------------------------------------------------- translation
def test_instructions_and_items_become_chat_messages() -> None:
    chat = chat_request(_request(
        instructions="Be brief.", max_output_tokens=7, temperature=0.0, top_k=3,
        input=[
            {"role": "user", "content": "Hello"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Hi!", "annotations": []}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Name "},
                                         {"type": "input_text", "text": "a city."}]},
        ],
        text={"format": {"type": "json_schema", "name": "city", "strict": True,
                         "schema": {"type": "object"}}},
    ))
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}]},
        {"role": "user", "content": [{"type": "text", "text": "Name "},
                                     {"type": "text", "text": "a city."}]},
    ]
    assert chat.max_completion_tokens == 7 and chat.temperature == 0.0 and chat.top_k == 3
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.json_schema == {"type": "object"}
    assert chat.response_format.json_schema.strict is True
    assert chat.stream is False and chat.stream_options is None


def test_function_call_items_become_tool_turns() -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    messages = responses_module._messages([
        {"role": "user", "content": "Weather in Paris and Rome?"},
        call, {**call, "call_id": "call_2", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
    ])
    assert messages == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "call_2", "type": "function",
             "function": {"name": "f", "arguments": '{"city": "Rome"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]
    tool = {"type": "function", "name": "f", "description": "d", "strict": True,
            "parameters": {"type": "object"}}
    assert responses_module._chat_tool(tool, 0) == {"type": "function", "function": {
        "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}}
    assert responses_module._chat_tool_choice({"type": "function", "name": "f"}) == {
        "type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "input[0].content[0]: only input_text and output_text"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "no item_reference"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "input[0].role must be"),
    ({"input": []}, "input", "input must not be empty"),
    ({"max_output_tokens": 0}, "max_output_tokens", "at least 1, got 0"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice requires tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs a schema"),
    ({"text": {"verbosity": "low"}}, "text", "no verbosity control"),
])
def test_bad_input_is_a_400_naming_its_field(fields: dict[str, Any], param: str,
                                             words: str) -> None:
    with pytest.raises(APIError) as err:
        chat_request(_request(**fields))
    assert err.value.status == 400 and err.value.param == param
    assert words in err.value.message, err.value.message


def test_built_in_tools_and_other_choices_are_refused_by_name() -> None:
    with pytest.raises(APIError) as err:
        chat_request(_request(tools=[{"type": "web_search"}]))
    assert err.value.param == "tools" and "only function tools" in err.value.message
    with pytest.raises(APIError) as err:
        chat_request(_request(tools=[{"type": "function", "name": "f", "defer_loading": True}]))
    assert err.value.param == "tools" and "defer_loading" in err.value.message
    with pytest.raises(APIError) as err:
        chat_request(_request(tools=[{"type": "function", "name": "f"}],
                              tool_choice={"type": "allowed_tools", "tools": []}))
    assert err.value.param == "tool_choice"


def test_a_chat_answer_becomes_a_response() -> None:
    body = _request(max_output_tokens=4, metadata={"k": "v"})
    chat = {"id": "chatcmpl-x", "created": 1700000000, "model": MODEL, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "One two"},
         "finish_reason": "length"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13},
        "tailserve_timing": {"cached_prompt_tokens": 2, "grammar_s": 0.0}}
    r = Response.model_validate(from_chat(body, "resp_1", chat))
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "One two" and r.metadata == {"k": "v"}
    assert r.usage is not None and (r.usage.input_tokens, r.usage.output_tokens,
                                    r.usage.total_tokens) == (9, 4, 13)
    assert r.usage.input_tokens_details.cached_tokens == 2
    calls = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    chat["choices"] = [{"index": 0, "message": calls, "finish_reason": "tool_calls"}]
    r = Response.model_validate(from_chat(body, "resp_1", chat))
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    assert (r.output[0].call_id, r.output[0].name, r.output[0].arguments) == (  # type: ignore[union-attr]
        "call_9", "f", "{}")


# ---------------------------------------------------------------- the event sequence
def _events(machine: ResponseEvents, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    sse = machine.start()
    for chunk in chunks:
        sse += machine.on_chunk(chunk)
    sse += machine.finish()
    out = []
    for text in sse:
        name, data = text.strip().split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        out.append(payload)
    return out


def _delta(content: str | None = None, tool_calls: Any = None,
           finish: str | None = None) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if content is not None:
        delta["content"] = content
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _accumulate(events: list[dict[str, Any]], text_format: Any = openai.omit) -> Any:
    """Validate every event with the SDK's types and run them through its accumulator."""
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=openai.omit,
                                                          text_format=text_format)
    for seq, payload in enumerate(events):
        assert payload["sequence_number"] == seq
        state.handle_event(EVENT.validate_python(payload))
    return state


def test_text_then_two_tool_calls_stream_as_openai_sends_them() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9,
                                      "total_tokens": 14},
             "tailserve_timing": {"cached_prompt_tokens": 0}}
    chunks = [
        _delta(content="Let me"), _delta(content=" check."),
        _delta(tool_calls=[{"index": 0, "id": "call_a", "type": "function",
                            "function": {"name": "weather", "arguments": ""}}]),
        _delta(tool_calls=[{"index": 0, "function": {"arguments": '{"city": '}}]),
        _delta(tool_calls=[{"index": 0, "function": {"arguments": '"Paris"}'}}]),
        _delta(tool_calls=[{"index": 1, "id": "call_b", "type": "function",
                            "function": {"name": "time", "arguments": "{}"}}]),
        _delta(finish="tool_calls"), usage,
    ]
    events = _events(ResponseEvents(_request(), "resp_1", MODEL), chunks)
    assert [e["type"].removeprefix("response.") for e in events] == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta",
        "function_call_arguments.delta",
        "output_item.added", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done",
        "function_call_arguments.done", "output_item.done",
        "completed",
    ]
    state = _accumulate(events)
    final = state._completed_response
    assert final is not None and final.status == "completed"
    assert final.output_text == "Let me check."
    calls = [(o.call_id, o.name, o.arguments) for o in final.output if o.type == "function_call"]
    assert calls == [("call_a", "weather", '{"city": "Paris"}'), ("call_b", "time", "{}")]
    assert final.usage is not None and final.usage.total_tokens == 14


def test_an_empty_answer_still_has_its_message_and_a_cut_one_is_incomplete() -> None:
    events = _events(ResponseEvents(_request(), "resp_2", MODEL), [_delta(finish="stop")])
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    _accumulate(events)
    events = _events(ResponseEvents(_request(), "resp_3", MODEL),
                     [_delta(content="a b"), _delta(finish="length")])
    final = Response.model_validate(events[-1]["response"])
    assert events[-1]["type"] == "response.incomplete" and final.status == "incomplete"
    assert final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete"  # type: ignore[union-attr]
    _accumulate(events)


def test_an_engine_failure_mid_stream_fails_the_response() -> None:
    chunks = [_delta(content="x"), {"error": {"message": "the engine failed: boom",
                                              "type": "engine_error"}}]
    events = _events(ResponseEvents(_request(), "resp_4", MODEL), chunks)
    final = Response.model_validate(events[-1]["response"])
    assert events[-1]["type"] == "response.failed" and final.status == "failed"
    assert final.error is not None and final.error.code == "server_error"
    assert "boom" in final.error.message


# ---------------------------------------------------------------- a real server
class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(["--max-model-len", "1024"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.mark.slow
def test_create_streamed_and_not_agree(client: openai.OpenAI, server: ServerProcess) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, instructions="Answer in one sentence.",
                                  input="What is the capital of France?", temperature=0,
                                  max_output_tokens=24)
    whole = client.responses.create(**kwargs)
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    assert whole.output_text and whole.usage is not None
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert 0 < whole.usage.output_tokens <= 24
    raw = httpx.post(server.url + "/v1/responses", json=kwargs, timeout=120).json()
    Response.model_validate(raw)  # strict: every required field present and typed
    assert raw["output"][0]["content"][0]["text"] == whole.output_text
    assert "tailserve_timing" in raw

    seen = [e.type for e in client.responses.create(stream=True, **kwargs)]
    assert seen[:4] == ["response.created", "response.in_progress",
                        "response.output_item.added", "response.content_part.added"]
    assert seen[-4:] == ["response.output_text.done", "response.content_part.done",
                         "response.output_item.done", f"response.{whole.status}"]
    assert set(seen[4:-4]) == {"response.output_text.delta"}
    if whole.status == "completed":
        with client.responses.stream(**kwargs) as stream:
            final = stream.get_final_response()
        assert final.output_text == whole.output_text
        assert final.usage is not None and final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.slow
def test_cut_by_max_output_tokens(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Count from one to fifty.", temperature=0,
                                max_output_tokens=3, extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3


@pytest.mark.slow
def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL, text_format=City, temperature=0, max_output_tokens=60,
        input="Paris is in France. Give the city's name and country as JSON.")
    parsed = client.responses.parse(**kwargs)
    assert isinstance(parsed.output_parsed, City), parsed.output_text
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed
    # json_object through text.format
    r = client.responses.create(model=MODEL, input='Answer with the JSON object {"ok": true}.',
                                text={"format": {"type": "json_object"}}, temperature=0,
                                max_output_tokens=40)
    assert isinstance(json.loads(r.output_text), dict)
    # The compile of City's schema is on /metrics (server/structured.py -> obs/metrics.py).
    page = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics", timeout=10).text
    count = [line for line in page.splitlines()
             if line.startswith("tailserve:grammar_compile_seconds_count")]
    assert count and float(count[0].split()[-1]) >= 1, count


@pytest.mark.slow
def test_refusals_name_their_field(server: ServerProcess) -> None:
    def post(extra: dict[str, Any]) -> httpx.Response:
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 1, **extra}
        return httpx.post(server.url + "/v1/responses", json=body, timeout=60)

    for extra, param in (
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "x",
                              "schema": {"type": "object", "minProperties": "x"}}}}, "text"),
        ({"text": {"format": {"type": "xml"}}}, "text"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ):
        r = post(extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    assert post({"store": False}).status_code == 200
    r = post({"model": "other"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


SAMPLES: dict[str, Any] = {
    "conversation": "conv_1", "prompt": {"id": "pmpt_1"}, "background": True,
    "background_options": {"completion_window": "2h"}, "include": ["reasoning.encrypted_content"],
    "top_logprobs": 2, "truncation": "auto", "reasoning": {"effort": "high"},
    "context_management": [{"type": "compaction"}], "moderation": {"model": "m"},
    "access_programs": {"cyber": "standard"}, "image": {"x": 1}, "metadata": {"k": "v"},
    "stream_options": {"include_obfuscation": False}, "max_tool_calls": 2,
}


@pytest.mark.slow
def test_walk_refused_and_ignored_fields(server: ServerProcess) -> None:
    for name, field in BY_ENDPOINT["responses"].items():
        if field.support == "served":
            continue
        body: dict[str, Any] = {"input": "Hi", "max_output_tokens": 1,
                                name: SAMPLES.get(name, "x")}
        if name == "stream_options":
            body["stream"] = True
        r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
        if field.support == "ignored":
            assert r.status_code == 200, (name, r.text)
        else:
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
            for value in field.neutral[1:]:
                body[name] = value
                r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
                assert r.status_code == 200, (name, value, r.text)


@pytest.mark.slow
def test_a_client_that_leaves_mid_stream_aborts_its_generation(server: ServerProcess) -> None:
    """The Responses stream wraps the chat path's: a hang-up after the first text delta ends
    the engine request at once, counted as a client disconnect (not run to max tokens)."""
    def aborted() -> float:
        page = httpx.get(server.url + "/metrics", timeout=10).text
        return metric_value(page, "tailserve:request_aborts_total",
                            {"reason": "client_disconnect"}) or 0.0

    before = aborted()
    body = {"input": "Write a very long story.", "max_output_tokens": 900, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "event: response.output_text.delta":
                break
    deadline = time.monotonic() + 10
    while aborted() != before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted() == before + 1
    page = httpx.get(server.url + "/metrics", timeout=10).text
    assert metric_value(page, "tailserve:num_requests_running") == 0


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "strict": True, "parameters": {
               "type": "object", "properties": {"city": {"type": "string"}},
               "required": ["city"], "additionalProperties": False}}


@pytest.mark.slow
def test_function_tools_call_stream_and_round_trip(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, input="What is the weather in Paris?",
                                  tools=[WEATHER], tool_choice="required", temperature=0,
                                  parallel_tool_calls=False, max_output_tokens=60)
    r = client.responses.create(**kwargs)
    calls = [o for o in r.output if o.type == "function_call"]
    # One call, forced well formed by the grammar, which also ends the answer.
    assert len(calls) == 1 and r.status == "completed", r.output
    assert calls[0].name == "get_weather" and calls[0].call_id
    assert set(json.loads(calls[0].arguments)) == {"city"}
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    streamed = [o for o in final.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    # The call and its output sent back as items: the model answers in text.
    follow = client.responses.create(model=MODEL, temperature=0, max_output_tokens=30,
                                     tools=[WEATHER], input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id,
         "output": "sunny, 24 C"}])
    assert follow.status in ("completed", "incomplete") and follow.output_text
