"""The serve / bench / generate flags are generated from dataclasses: their defaults are the
fields' defaults, every flag name of before is still there, and values reach the fields."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from tailserve.bench.config import BenchConfig, DatasetOptions
from tailserve.cli import (
    GENERATE_SAMPLING_DEFAULTS,
    GENERATE_SAMPLING_FIELDS,
    bench_config_from,
    build_parser,
    engine_args_from,
    main,
    sampling_params_from,
    server_settings_from,
)
from tailserve.config import EngineArgs
from tailserve.sampling_params import SamplingParams
from tailserve.server.settings import ServerSettings

SERVE_FLAGS = [
    "--host", "--port", "--api-key", "--served-model-name", "--max-request-bytes",
    "--max-header-bytes", "--shutdown-timeout", "--timeline", "--timeline-buffer",
    "--otlp-traces-endpoint", "--watchdog-timeout", "--enable-profiling", "--profile-dir",
    "--log-level",
]
BENCH_FLAGS = [
    "--base-url", "--base-url-b", "--split", "--users", "--endpoint", "--model", "--api-key",
    "--http-client", "--busy-poll", "--timeout", "--extra-body", "--ignore-eos",
    "--no-ignore-eos", "--dataset", "--dataset-path", "--num-prompts", "--input-len",
    "--output-len", "--range-ratio", "--mix", "--prefix-len", "--num-prefixes", "--num-schemas",
    "--structured-share", "--num-tools", "--tool-choice", "--tokenizer",
    "--seed", "--request-rate", "--request-rates", "--sweep", "--sweep-steps", "--burstiness",
    "--max-concurrency", "--warmup", "--goodput", "--percentiles", "--save-result",
    "--save-detailed", "--label", "--no-progress", "--no-observe", "--metrics-interval",
]
GENERATE_FLAGS = [
    "--model", "--prompt", "--chat", "--max-tokens", "--temperature", "--top-p", "--top-k",
    "--min-p", "--repetition-penalty", "--sample-seed", "--stop", "--n", "--ignore-eos",
    "--json",
]
ENGINE_FLAGS = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(EngineArgs)
                if f.name != "model"]


@pytest.fixture(autouse=True)
def _no_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TAILSERVE_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def options(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {o for action in sub.choices[command]._actions for o in action.option_strings}


@pytest.mark.parametrize(("command", "flags"), [
    ("serve", SERVE_FLAGS + ENGINE_FLAGS), ("bench", BENCH_FLAGS),
    ("generate", GENERATE_FLAGS + ENGINE_FLAGS),
])
def test_every_flag_name_is_kept(command: str, flags: list[str]) -> None:
    assert set(flags) - options(command) == set()


def test_no_flags_give_the_dataclass_defaults() -> None:
    ns = parse("serve")
    assert server_settings_from(ns) == ServerSettings()
    assert engine_args_from(ns) == EngineArgs()
    assert bench_config_from(parse("bench"), argv=[]) == BenchConfig()
    ns = parse("generate", "--prompt", "hi")
    assert engine_args_from(ns) == EngineArgs()
    params = sampling_params_from(ns)
    # generate's two own defaults (greedy, 128 tokens); every other one is SamplingParams'.
    assert GENERATE_SAMPLING_DEFAULTS == {"max_tokens": 128, "temperature": 0.0}
    assert params == SamplingParams(max_tokens=128, temperature=0.0)
    for name in GENERATE_SAMPLING_FIELDS:
        expected = GENERATE_SAMPLING_DEFAULTS.get(name, getattr(SamplingParams(), name))
        assert getattr(params, name) == expected


def test_help_shows_the_field_defaults() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {o: a.help or "" for a in sub.choices["serve"]._actions for o in a.option_strings}
    assert "(default: 4194304)" in helps["--max-request-bytes"]
    assert "(default: 20000)" in helps["--timeline-buffer"]
    assert "(default: 30)" in helps["--shutdown-timeout"]
    helps = {o: a.help or "" for a in sub.choices["bench"]._actions for o in a.option_strings}
    assert "(default: 600)" in helps["--timeout"]
    assert "(default: 50,90,99,99.9)" in helps["--percentiles"]


def test_serve_values_reach_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    ns = parse("serve", "m.gguf", "--port", "9000", "--max-request-bytes", "10",
               "--shutdown-timeout", "2.5", "--enable-profiling", "--log-level", "debug",
               "--max-num-seqs", "3", "--no-enable-prefix-caching")
    s = server_settings_from(ns)
    assert (s.port, s.max_request_bytes, s.shutdown_timeout) == (9000, 10, 2.5)
    assert s.enable_profiling and s.log_level == "debug" and s.api_key is None
    args = engine_args_from(ns)
    assert args.max_num_seqs == 3 and args.enable_prefix_caching is False
    monkeypatch.setenv("TAILSERVE_API_KEY", "from-env")
    assert server_settings_from(parse("serve")).api_key == "from-env"
    assert server_settings_from(parse("serve", "--api-key", "flag")).api_key == "flag"


def test_bench_values_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    ns = parse("bench", "--timeout", "0", "--no-progress", "--no-observe",
               "--request-rates", "1,2", "--goodput", "ttft:500", "tpot:50",
               "--percentiles", "50,99", "--extra-body", '{"a": 1}', "--dataset", "mixed",
               "--dataset-path", "p.jsonl", "--num-prompts", "5", "--metrics-interval", "0.5",
               "--seed", "7", "--endpoint", "chat", "--http-client", "aiohttp")
    cfg = bench_config_from(ns, argv=["x"])
    assert cfg.timeout_s is None and not cfg.progress and not cfg.observe
    assert cfg.request_rates == [1.0, 2.0]
    assert cfg.goodput == {"ttft": 500.0, "tpot": 50.0}
    assert cfg.percentiles == [50.0, 99.0]
    assert cfg.extra_body == {"a": 1}
    assert cfg.dataset == DatasetOptions(name="mixed", path="p.jsonl", num_prompts=5)
    assert (cfg.metrics_interval_s, cfg.seed, cfg.endpoint, cfg.http_client) == \
        (0.5, 7, "chat", "aiohttp")
    assert cfg.argv == ["x"]
    assert bench_config_from(parse("bench", "--timeout", "2.5"), argv=[]).timeout_s == 2.5
    monkeypatch.setenv("TAILSERVE_API_KEY", "ts")
    assert bench_config_from(parse("bench"), argv=[]).api_key == "ts"
    monkeypatch.setenv("OPENAI_API_KEY", "oa")
    assert bench_config_from(parse("bench"), argv=[]).api_key == "oa"


def test_generate_values_reach_the_sampling_params() -> None:
    ns = parse("generate", "--prompt", "x", "--sample-seed", "3", "--seed", "9", "--stop", "a",
               "--stop", "b", "--ignore-eos", "--n", "2", "--top-k", "5", "--temperature", "0.7")
    p = sampling_params_from(ns)
    assert (p.seed, list(p.stop), p.ignore_eos, p.n, p.top_k, p.temperature) == \
        (3, ["a", "b"], True, 2, 5, 0.7)
    assert engine_args_from(ns).seed == 9


@pytest.mark.parametrize(("argv", "message"), [
    (["--request-rates", "1,x"], "--request-rates wants numbers like 1,2,4,8"),
    (["--extra-body", "[1]"], "--extra-body: not a JSON object (an array)"),
    (["--percentiles", "0"], "--percentiles must be in (0, 100]"),
])
def test_bench_flag_mistakes_exit_2(argv: list[str], message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err
