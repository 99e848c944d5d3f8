"""tailserve bench's ``structured`` dataset: a seeded pool of realistic JSON schemas, Zipf-like
repeats, OpenAI's response_format in the body, every schema valid JSON Schema that llguidance
accepts; and short runs against one live server: every constrained answer is JSON, and every
``tool_choice: "required"`` call of the ``tools`` dataset parses and validates."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from server_util import ServerProcess
from tailserve.bench import BenchError
from tailserve.bench.client import build_payload
from tailserve.bench.datasets import DatasetOptions, load_dataset
from tailserve.bench.schemas import MAX_PROPERTIES, MIN_PROPERTIES
from tailserve.bench.tool_pool import TOOLS
from tailserve.cli import main
from tailserve.engine.structured_output import check_syntax, grammar_of
from tailserve.sampling_params import StructuredOutputsParams
from test_bench_datasets import WordCounter


def _opts(**kw: object) -> DatasetOptions:
    fields: dict[str, object] = dict(name="structured", num_prompts=300, num_schemas=20,
                                     input_len=12, seed=3)
    fields.update(kw)
    return DatasetOptions(**fields)  # type: ignore[arg-type]


def test_pool_of_realistic_schemas_with_repeats() -> None:
    ds = load_dataset(_opts(), WordCounter())
    assert len(ds.requests) == 300 and ds.name == "structured"
    names: Counter[str] = Counter()
    schemas = {}
    for r in ds.requests:
        assert r.prompt_len == len(r.prompt.split()) == 12 + 9  # the ask is 9 words
        assert r.output_len == 512
        assert r.extra is not None
        fmt = r.extra["response_format"]
        assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
        name = fmt["json_schema"]["name"]
        names[name] += 1
        schemas[name] = fmt["json_schema"]["schema"]
    assert len(names) <= 20
    # Zipf-like: the first schema is about 1/H(20) = 28% of requests; some come once or twice.
    assert names["record_0"] == max(names.values()) and 60 <= names["record_0"] <= 110
    assert min(names.values()) <= 5
    for schema in schemas.values():
        jsonschema.Draft202012Validator.check_schema(schema)
        assert MIN_PROPERTIES <= len(schema["properties"]) <= MAX_PROPERTIES
        assert schema["required"] == list(schema["properties"])
        assert schema["additionalProperties"] is False
        check_syntax(grammar_of(StructuredOutputsParams(json=json.dumps(schema))))
    # The seed decides everything.
    again = load_dataset(_opts(), WordCounter())
    assert [r.extra for r in again.requests] == [r.extra for r in ds.requests]


def test_share_and_payload_and_errors() -> None:
    ds = load_dataset(_opts(structured_share=0.5, num_prompts=400), WordCounter())
    constrained = sum(r.extra is not None for r in ds.requests)
    assert constrained / 400 == pytest.approx(0.5, abs=0.07)
    assert f"{constrained} of 400 requests constrained" in ds.notes[0]
    r = next(r for r in ds.requests if r.extra is not None)
    body = json.loads(build_payload(r, "chat", "m", ignore_eos=False))
    assert body["response_format"] == r.extra["response_format"]  # type: ignore[index]
    assert "ignore_eos" not in body
    for bad in (dict(num_schemas=0), dict(structured_share=1.5)):
        with pytest.raises(BenchError, match="--num-schemas"):
            load_dataset(_opts(**bad), WordCounter())


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(["--max-model-len", "1024"]) as srv:
        yield srv


@pytest.mark.slow
def test_structured_run_against_a_live_server(server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    code = main(["bench", "--base-url", server.url, "--endpoint", "chat",
                 "--dataset", "structured", "--num-prompts", "6", "--num-schemas", "3",
                 "--input-len", "16", "--output-len", "600", "--request-rate", "inf",
                 "--save-result", str(out), "--save-detailed", "--no-progress"])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    records = result["tailserve"]["requests"]
    assert all(q["server_timing"]["grammar_s"] > 0 for q in records)
    # The grammar ended an answer where its JSON object did (a 135M model may still fill a
    # long record past max_tokens: "length", its text cut).
    reasons = [q["finish_reason"] for q in records]
    assert set(reasons) <= {"stop", "length"} and "stop" in reasons, reasons
    for reason, text in zip(reasons, result["generated_texts"], strict=True):
        if reason == "stop":
            assert isinstance(json.loads(text), dict), text
    # The client's own check agrees: what finished is valid against its schema.
    block = result["tailserve"]["answers"]["by_form"]["json_schema"]
    assert block["requests"] == 6 and block["valid_share_finished"] == 1.0, block


@pytest.mark.slow
def test_tools_run_required_calls_all_validate(server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "tools.json"
    code = main(["bench", "--base-url", server.url, "--endpoint", "chat", "--dataset", "tools",
                 "--tool-choice", "required", "--num-tools", "2", "--output-len", "200",
                 # One call each: with parallel calls (OpenAI's default) the grammar allows
                 # an array of them, and the 135M model may repeat a call until max_tokens.
                 "--extra-body", '{"parallel_tool_calls": false}',
                 "--num-prompts", "4", "--request-rate", "inf",
                 "--save-result", str(out), "--save-detailed", "--no-progress"])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["failed"] == 0
    block = result["tailserve"]["answers"]
    required = block["by_form"]["required"]
    # Every answer that finished is a valid call. The 135M model may instead repeat a phrase in
    # a free-form string until max_tokens (greedy output moves with the batch it ran in): such
    # an answer is counted as cut, not as valid, and is left out of the check below.
    cut = required["cut_by_max_tokens"]
    assert required["requests"] == 4 and cut <= 2 and required["valid_share_finished"] == 1.0, block
    assert required["calls"] == 4 and required["calls_valid"] == 4 - cut
    assert block["grammar"]["requests"] == 4 and block["grammar"]["grammar_ms"]["max"] > 0
    reasons = [q["finish_reason"] for q in result["tailserve"]["requests"]]
    assert reasons.count("length") == cut and reasons.count("tool_calls") == 4 - cut
    for q in result["tailserve"]["requests"]:
        assert q["ttft_s"] > 0 and len(q["tool_calls"]) == 1
        if q["finish_reason"] == "length":
            continue
        for call in q["tool_calls"]:
            tool = next(t for t in TOOLS if t.name == call["name"])
            jsonschema.validate(json.loads(call["arguments"]), tool.parameters)
