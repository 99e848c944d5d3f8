"""tailserve bench's ``tools`` dataset and the answer checks: a seeded pool of realistic
function tools, every tool_choice form, OpenAI's body; the small JSON Schema validator agreeing
with ``jsonschema`` on valid and broken arguments; streamed tool-call deltas reassembled and
timed; the ``answers`` block's exact counts. The live run is in test_bench_structured.py (it
shares that module's server)."""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

import jsonschema
import numpy as np
import pytest

from tailserve.bench import BenchError
from tailserve.bench.client import RequestResult, SseParser, build_payload
from tailserve.bench.datasets import BenchRequest, DatasetOptions, load_dataset
from tailserve.bench.schema_check import Unchecked, errors
from tailserve.bench.schemas import schema_pool
from tailserve.bench.tool_pool import BY_NAME, TOOLS
from tailserve.bench.validity import answers
from tailserve.engine.structured_output import check_syntax, grammar_of
from tailserve.sampling_params import StructuredOutputsParams
from test_bench_datasets import WordCounter

# One valid call per tool, as an agent would fill it.
GOOD_ARGS: dict[str, dict[str, Any]] = {
    "get_weather": {"city": "Paris", "unit": "celsius", "days": 3},
    "web_search": {"query": "news about pricing", "num_results": 5, "recency": "week"},
    "create_calendar_event": {"title": "Budget", "date": "2027-01-08", "start_time": "09:30",
                              "duration_minutes": 60, "attendees": ["maria@example.com"]},
    "run_sql_query": {"database": "sales", "query": "SELECT 1", "max_rows": 10},
    "send_email": {"to": "chen.li@example.com", "subject": "Review", "body": "Moved.",
                   "cc": []},
    "get_stock_price": {"ticker": "MSFT", "exchange": "NASDAQ"},
    "convert_currency": {"amount": 250.5, "from_currency": "USD", "to_currency": "EUR"},
    "search_flights": {"origin": "JFK", "destination": "SFO", "date": "2027-02-21",
                       "passengers": 2, "cabin": "business"},
    "create_support_ticket": {"title": "Crash", "description": "On login", "priority": "urgent",
                              "customer": {"name": "Omar", "email": "omar@example.com"},
                              "tags": ["login"]},
    "get_directions": {"origin": "station", "destination": "museum", "mode": "transit"},
    "lookup_order": {"order_id": "ORD-104233", "include_items": True},
    "set_reminder": {"text": "Call Priya", "date": "2026-12-14", "time": "14:15",
                     "repeat": "none"},
}


def _opts(**kw: object) -> DatasetOptions:
    fields: dict[str, object] = dict(name="tools", num_prompts=120, endpoint="chat", seed=5)
    fields.update(kw)
    return DatasetOptions(**fields)  # type: ignore[arg-type]


def test_pool_of_tools_and_forms_deterministic() -> None:
    assert sorted(GOOD_ARGS) == sorted(BY_NAME) and len(TOOLS) == 12
    for tool in TOOLS:
        params = tool.parameters
        jsonschema.Draft202012Validator.check_schema(params)
        assert params["required"] == list(params["properties"])
        assert params["additionalProperties"] is False
        check_syntax(grammar_of(StructuredOutputsParams(json=json.dumps(params))))
        jsonschema.validate(GOOD_ARGS[tool.name], params)
    ds = load_dataset(_opts(), WordCounter())
    assert ds.name == "tools" and len(ds.requests) == 120
    forms: Counter[str] = Counter()
    for r in ds.requests:
        assert r.output_len == 256 and r.messages == [{"role": "user", "content": r.prompt}]
        assert r.prompt_len == len(r.prompt.split()) and "{" not in r.prompt
        assert r.extra is not None
        names = [t["function"]["name"] for t in r.extra["tools"]]
        assert len(names) == len(set(names)) == 4
        choice = r.extra["tool_choice"]
        if isinstance(choice, dict):
            assert choice["function"]["name"] in names
            forms["named"] += 1
        else:
            forms[choice] += 1
    assert set(forms) == {"auto", "required", "named"} and min(forms.values()) >= 25
    again = load_dataset(_opts(), WordCounter())
    assert [(r.prompt, r.extra) for r in again.requests] == [
        (r.prompt, r.extra) for r in ds.requests]
    only = load_dataset(_opts(tool_choice="required", num_tools=1), WordCounter())
    assert {r.extra["tool_choice"] for r in only.requests} == {"required"}  # type: ignore[index]
    body = json.loads(build_payload(only.requests[0], "chat", "m", ignore_eos=False))
    assert body["tools"] == only.requests[0].extra["tools"]  # type: ignore[index]
    assert body["tool_choice"] == "required" and "ignore_eos" not in body


@pytest.mark.parametrize(("kw", "match"), [
    (dict(endpoint="completions"), "--endpoint chat"),
    (dict(num_tools=13), "--num-tools must be in"),
    (dict(num_tools=0), "--num-tools must be in"),
    (dict(tool_choice="auto,sometimes"), "--tool-choice wants"),
])
def test_tools_dataset_errors(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(BenchError, match=match):
        load_dataset(_opts(**kw), WordCounter())


def _broken(doc: dict[str, Any], schema: dict[str, Any]) -> list[dict[str, Any]]:
    """``doc`` broken one way at a time: a missing key, an extra key, each property with a
    wrong type, and each bound crossed."""
    out = []
    for name in schema["properties"]:
        d = copy.deepcopy(doc)
        del d[name]
        out.append(d)
    out.append({**doc, "unexpected": 1})
    for name, prop in schema["properties"].items():
        kind = prop.get("type")
        out.append({**doc, name: [] if kind != "array" else "x"})
        out.append({**doc, name: True if kind != "boolean" else 1})
        if "maxLength" in prop:
            out.append({**doc, name: "a" * (prop["maxLength"] + 1)})
        if "pattern" in prop:
            out.append({**doc, name: "no match here"})
        if "enum" in prop:
            out.append({**doc, name: "not-in-enum"})
        if "maximum" in prop:
            out.append({**doc, name: prop["maximum"] + 1})
            out.append({**doc, name: prop["minimum"] - 0.5})
        if kind == "integer":
            out.append({**doc, name: 2.5})
            out.append({**doc, name: 3.0})  # an integer in JSON Schema
        if "maxItems" in prop:
            out.append({**doc, name: [doc[name][0] if doc[name] else "x"]
                        * (prop["maxItems"] + 1)})
    return out


def test_validator_agrees_with_jsonschema() -> None:
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for tool in TOOLS:
        good = GOOD_ARGS[tool.name]
        cases += [(good, tool.parameters)] + [(d, tool.parameters)
                                              for d in _broken(good, tool.parameters)]
    ticket = BY_NAME["create_support_ticket"].parameters
    good = GOOD_ARGS["create_support_ticket"]
    cases += [({**good, "customer": c}, ticket)
              for c in _broken(good["customer"], ticket["properties"]["customer"])]
    assert len(cases) == 215
    for doc, schema in cases:
        expected = jsonschema.Draft202012Validator(schema).is_valid(doc)
        assert (errors(doc, schema) == []) == expected, (doc, errors(doc, schema))
    # The structured pool's schemas: a nested array of objects, anyOf and oneOf.
    for schema in schema_pool(8, np.random.default_rng(1)):
        assert errors({}, schema) and not jsonschema.Draft202012Validator(schema).is_valid({})
    one_of = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
    assert errors(2.5, one_of) == []
    assert errors(2, one_of) == ["$: 2 of the 2 oneOf branches match"]
    assert errors({"a": [1, "x"]}, {"properties": {"a": {"items": {"type": "integer"}}}}) == [
        "$.a[1]: str is not of type integer"]
    assert errors(True, {"type": "integer"}) == ["$: bool is not of type integer"]
    assert errors(1, {"const": True}) == ["$: 1 is not True"]
    with pytest.raises(Unchecked, match="uniqueItems"):
        errors([1], {"type": "array", "uniqueItems": True})


def _events(*chunks: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)


def test_sse_parser_reassembles_and_times_tool_calls() -> None:
    res = RequestResult(0, "r", 5, 64, 0.0)
    parser = SseParser(res, st=10.0)
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}

    def call(index: int, args: str, name: str | None = None) -> dict[str, Any]:
        fn: dict[str, Any] = {"arguments": args}
        tc: dict[str, Any] = {"index": index, "function": fn}
        if name:
            fn["name"], tc["id"], tc["type"] = name, f"call_{index}", "function"
        return {"choices": [{"index": 0, "delta": {"tool_calls": [tc]}}]}

    parser.feed(_events(role), 10.5)  # the role is not a token
    parser.feed(_events(call(0, "", "get_weather")), 11.0)
    parser.feed(_events(call(0, '{"city":'), call(0, '"Paris"}')), 11.25)
    parser.feed(_events(call(1, '{"a":1}', "add")), 12.0)
    done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}
    parser.feed(_events(done) + b"data: [DONE]\n\n", 12.5)
    parser.finish()
    assert res.error_type is None and res.finish_reason == "tool_calls"
    assert res.ttft_s == 1.0 and res.itl_s == [0.25, 0.0, 0.75] and res.e2el_s == 2.5
    assert res.tool_calls == [{"name": "get_weather", "arguments": '{"city":"Paris"}'},
                              {"name": "add", "arguments": '{"a":1}'}]
    assert res.text == ""


def _req(choice: Any = None, fmt: dict[str, Any] | None = None) -> BenchRequest:
    if fmt is not None:
        return BenchRequest("p", 1, 8, extra={"response_format": fmt})
    if choice is None:
        return BenchRequest("p", 1, 8)
    tools = [BY_NAME["get_weather"].openai(), BY_NAME["lookup_order"].openai()]
    return BenchRequest("p", 1, 8, extra={"tools": tools, "tool_choice": choice})


def _res(i: int, finish: str, text: str = "", calls: Sequence[tuple[str, Any]] = (),
         ttft: float = 0.1) -> RequestResult:
    r = RequestResult(i, f"r{i}", 1, 8, 0.0, send_s=0.0, ttft_s=ttft, e2el_s=1.0,
                      finish_reason=finish, text=text)
    r.tool_calls = [{"name": n, "arguments": a if isinstance(a, str) else json.dumps(a)}
                    for n, a in calls]
    r.server_timing = {"grammar_s": 0.01, "e2e_s": 1.0} if i % 2 == 0 else None
    return r


def test_answers_block_counts_exactly() -> None:
    weather = GOOD_ARGS["get_weather"]
    order = GOOD_ARGS["lookup_order"]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    named = {"type": "function", "function": {"name": "lookup_order"}}
    requests = [_req("required"), _req("required"), _req("required"), _req(named), _req(named),
                _req("auto"), _req("auto"), _req(fmt=fmt), _req(fmt=fmt), _req(fmt=fmt), _req()]
    results = [
        _res(0, "tool_calls", calls=[("get_weather", weather), ("lookup_order", order)]),
        _res(1, "tool_calls", calls=[("get_weather", {**weather, "days": 9})]),  # max 7
        _res(2, "length", calls=[("get_weather", '{"city":"Par')]),
        _res(3, "tool_calls", calls=[("lookup_order", order)]),
        _res(4, "tool_calls", calls=[("get_weather", weather)]),  # not the named one
        _res(5, "stop", text="It is sunny."),
        _res(6, "tool_calls", calls=[("send_email", {})]),  # not declared
        _res(7, "stop", text='{"n": 3}'),
        _res(8, "stop", text='{"n": "3"}'),
        _res(9, "length", text='{"n": 3'),
        _res(10, "stop", text="free text", ttft=0.5),
    ]
    block = answers(requests, results)
    assert block is not None
    by = block["by_form"]
    assert by["required"] == {
        "requests": 3, "cut_by_max_tokens": 1, "with_calls": 3, "calls": 4, "calls_valid": 2,
        "valid": 1, "valid_finished": 1, "valid_share": 1 / 3, "valid_share_finished": 0.5,
        "calls_valid_share": 0.5, "called_share": 1.0}
    assert (by["named"]["valid"], by["named"]["calls_valid"]) == (1, 1)
    assert (by["auto"]["valid"], by["auto"]["with_calls"], by["auto"]["called_share"]) == (
        1, 1, 0.5)
    assert by["json_schema"] == {"requests": 3, "cut_by_max_tokens": 1, "valid": 1,
                                 "valid_finished": 1, "valid_share": 1 / 3,
                                 "valid_share_finished": 0.5}
    assert block["examples"]["named"] == "calls 'get_weather', not the named 'lookup_order'"
    assert block["examples"]["auto"] == "calls 'send_email', which is not declared"
    assert block["examples"]["json_schema"].startswith("$.n: str is not of type integer")
    assert block["examples"]["required"] == "get_weather: $.days: 9 is above maximum 7"
    assert block["latency_ms"]["unconstrained"]["p99_ttft_ms"] == pytest.approx(500.0)
    assert block["latency_ms"]["required"]["requests"] == 3.0
    grammar = block["grammar"]
    assert grammar["requests"] == 5 and grammar["share_of_e2e"] == pytest.approx(0.01)
    # Nothing asked for structure: no block.
    assert answers([_req()], [_res(0, "stop", text="x")]) is None
