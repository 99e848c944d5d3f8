"""benchmarks/serving_peers.py's pieces that need no server: the long-mix workload (its file,
both clients' command lines, the short requests' TTFT apart) and --variant parsing."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sp() -> ModuleType:
    spec = importlib.util.spec_from_file_location("serving_peers",
                                                  ROOT / "benchmarks" / "serving_peers.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serving_peers"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_long_mix_file_has_exactly_the_long_share_at_the_target_lengths(
        sp: ModuleType, tmp_path: Path) -> None:
    # Short prompts keep the test quick; the tokenizer is the bundled model's.
    w = replace(sp.WORKLOADS["long-mix"], num_prompts=20, long_len=400, input_len=40)
    path = tmp_path / "lm.jsonl"
    lens = sp.write_long_mix(w, 7, str(path))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == len(lens) == 20
    assert all(x["max_tokens"] == x["output_tokens"] == w.output_len for x in lines)
    long = [n for n in lens if n >= 200]
    assert len(long) == 2  # round(20 x 10%)
    assert all(320 <= n <= 480 for n in long) and all(32 <= n <= 48 for n in lens
                                                       if n < 200)
    assert sp.write_long_mix(w, 7, str(tmp_path / "again.jsonl")) == lens  # seeded


def test_both_clients_send_the_long_mix_file(sp: ModuleType) -> None:
    w = sp.WORKLOADS["long-mix"]
    v = sp.vllm_bench_cmd("vllm", "/hf", "http://h", w, 3, "/o/r.json", "/o/lm.jsonl")
    i = v.index("--dataset-name")
    assert v[i + 1:i + 4] == ["custom", "--dataset-path", "/o/lm.jsonl"]
    assert "--custom-output-len" in v and "--random-input-len" not in v
    t = sp.tailserve_bench_cmd("http://h", w, 3, "/o/r.json", "/o/lm.jsonl")
    i = t.index("--dataset")
    assert t[i + 1:i + 4] == ["jsonl", "--dataset-path", "/o/lm.jsonl"]


def test_structured_workload_is_sent_by_tailserve_bench_and_summarized(sp: ModuleType) -> None:
    w = sp.WORKLOADS["structured"]
    cmd = sp.structured_bench_cmd("http://h", w, 3, "/o/r.json")
    i = cmd.index("--dataset")
    assert cmd[i + 1] == "structured" and "--ignore-eos" not in cmd
    assert cmd[cmd.index("--structured-share") + 1] == "0.5"
    assert cmd[cmd.index("--endpoint") + 1] == "chat"
    lat = {"json_schema": {"p99_ttft_ms": 300.0, "p50_itl_ms": 22.0},
           "unconstrained": {"p99_ttft_ms": 250.0, "p50_itl_ms": 20.0}}
    result = {"errors": ["", ""], "ttfts": [0.1, 0.2], "itls": [[], []], "completed": 2,
              "tailserve": {"answers": {"latency_ms": lat, "by_form": {
                  "json_schema": {"valid_share_finished": 1.0}}}}}
    row = sp.summarize(result, sp.Slos(ttft_ms=1000.0, itl_ms=100.0), w)
    assert row["p99_ttft_constrained_over_unconstrained"] == pytest.approx(1.2)
    assert row["p50_itl_constrained_over_unconstrained"] == pytest.approx(1.1)
    assert row["json_valid_share_finished"] == 1.0 and row["completed"] == 2


def test_short_requests_ttft_apart_from_the_long_ones(sp: ModuleType) -> None:
    w = sp.WORKLOADS["long-mix"]
    result = {"input_lens": [100, 4000, 90, 110, 3900, 95],
              "ttfts": [0.1, 5.0, 0.2, 0.3, 6.0, 9.0],
              "errors": ["", "", "", "", "", "timeout"]}  # a failed short one is left out
    got = sp.short_ttfts(result, w)
    assert got["short_count"] == 3
    assert got["short_median_ttft_ms"] == pytest.approx(200.0)
    assert got["short_p99_ttft_ms"] == pytest.approx(298.0)  # 200 + 0.98 x 100
    assert got["short_ttft_p99_over_p50"] == pytest.approx(1.49)


def test_variant_parsing(sp: ModuleType) -> None:
    v = sp.Variant.parse("off=--no-enable-itl-target --max-num-seqs 8")
    assert (v.label, v.tree, v.args) == ("off", None, ("--no-enable-itl-target",
                                                         "--max-num-seqs", "8"))
    before = sp.Variant.parse("before@/tmp/old=")
    assert (before.label, before.tree, before.args) == ("before", "/tmp/old", ())
    s = sp.server_for("tailserve", [], "/peers", None, before)
    assert s.label == "tailserve[before]" and s.env["PYTHONPATH"] == "/tmp/old/src"
    assert "TAILSERVE_KERNEL_CACHE" not in s.env  # builds are keyed by source bytes: shared
    with pytest.raises(ValueError, match="LABEL"):
        sp.Variant.parse("=--x")
    tiles = sp.Variant.parse("bf16=TAILSERVE_QUANT_ISA=amx-bf16 --slo-itl-ms none")
    assert tiles.args == ("--slo-itl-ms", "none")
    s = sp.server_for("tailserve", [], "/peers", None, tiles)
    assert s.env["TAILSERVE_QUANT_ISA"] == "amx-bf16" and "TAILSERVE_QUANT_ISA" not in s.cmd[-1]


def test_per_workload_rate_and_prompts(sp: ModuleType) -> None:
    args = sp.parse_args(["--client", "tailserve", "--rate", "long-mix=0.2",
                          "--prompts", "mixed=3", "--variant", "after="])
    assert args.rate == {"long-mix": 0.2} and args.prompts == {"mixed": 3}
    assert [v.label for v in args.variants] == ["after"]
    with pytest.raises(SystemExit):
        sp.parse_args(["--client", "tailserve", "--rate", "nope=1"])


def test_single_stream_roofline_counts_plans_bytes_over_the_best_bandwidth(
        sp: ModuleType) -> None:
    from roofline import served_decode_bytes

    w = sp.WORKLOADS["single"]
    context = w.input_len + (w.output_len - 1) / 2
    weights, kv32 = served_decode_bytes("float32", context)
    # The bundled GGUF as stored (Q4_1 layers, Q8_0 embeddings = LM head): ~96.6 MB; its
    # float32 K/V: 30 layers x K and V x 3 heads x 64 x 4 bytes per cached token.
    assert 90e6 < weights < 100e6
    assert kv32 == 30 * 2 * 3 * 64 * 4 * context
    ts = sp.Server("tailserve", ["python", "-m", "tailserve.cli", "serve"], {}, 1, "tailserve")
    row = sp.roofline_row({"median_tpot_ms": 6.0}, w, [30.0, 40.0], ts)
    roof_ms = (weights + kv32) / 40e9 * 1e3  # the better of the two bandwidths
    assert row["roofline_ms"] == pytest.approx(roof_ms, abs=1e-3)
    assert row["tpot_over_roofline"] == pytest.approx(6.0 / roof_ms, abs=1e-3)
    assert row["roofline_kv_dtype"] == "float32" and row["read_gbps"] == [30.0, 40.0]
    # A 16-bit cache halves the K/V bytes; the last flag wins, as serve's argparse reads it.
    ts16 = replace(ts, cmd=[*ts.cmd, "--kv-cache-dtype", "float32", "--kv-cache-dtype=bfloat16"])
    row16 = sp.roofline_row({"median_tpot_ms": 6.0}, w, [40.0], ts16)
    assert row16["roofline_kv_bytes"] == round(kv32 / 2)
    assert row16["roofline_ms"] < row["roofline_ms"]
    # A peer reads other bytes (float32 weights, a float16 cache): its bandwidth only.
    peer = sp.roofline_row({"median_tpot_ms": 6.0}, w, [40.0],
                           sp.Server("llama.cpp", ["bash"], {}, 1, "llama.cpp"))
    assert peer == {"read_gbps": [40.0]}


# ---------------------------------------------------------------- chat, agent, capacity
def test_chat_lengths_follow_the_published_sharegpt_statistics(sp: ModuleType) -> None:
    import numpy as np
    from peer_workloads import SHAREGPT_OUTPUT, SHAREGPT_PROMPT, chat_lengths, lognormal_params

    mu_p, s_p = lognormal_params(*SHAREGPT_PROMPT)
    assert (round(mu_p, 3), round(s_p, 3)) == (2.645, 1.951)
    mu_o, s_o = lognormal_params(*SHAREGPT_OUTPUT)
    assert (round(mu_o, 3), round(s_o, 3)) == (5.618, 0.686)
    # A lognormal with those parameters has the published mean and standard deviation.
    assert math.exp(mu_o + s_o ** 2 / 2) == pytest.approx(348.45)
    assert math.sqrt((math.exp(s_o ** 2) - 1) * math.exp(2 * mu_o + s_o ** 2)) == \
        pytest.approx(269.93)
    pairs = chat_lengths(20000, 0)
    p = np.array([a for a, _ in pairs])
    o = np.array([b for _, b in pairs])
    # Seeded: these exact figures (medians near exp(mu): 14 and 275 tokens; the clips at
    # 2,048 and 512 tokens cut the tails, so the means sit below the published ones).
    assert (float(np.median(p)), float(p.mean())) == (14.0, 80.04065)
    assert (float(np.median(o)), float(o.mean())) == (275.0, 297.89755)
    assert (int((p == 2048).sum()), int((o == 512).sum())) == (107, 3658)
    assert p.min() == 4 and o.min() >= 4
    assert chat_lengths(3, 0) == [(13, 196), (4, 286), (10, 511)] == chat_lengths(3, 0)


def test_agent_sessions_share_growing_prefixes(sp: ModuleType, tmp_path: Path) -> None:
    from peer_workloads import AgentShape, agent_sessions, write_agent

    shape = AgentShape()
    turns = agent_sessions(0, shape)
    assert len(turns) == 32 and [(t.session, t.turn) for t in turns[:9]] == [
        *((s, 0) for s in range(8)), (0, 1)]  # turn-major: every session's turn 1 first
    mine = [t for t in turns if t.session == 0]
    assert [t.prompt_len(shape) for t in mine] == [452, 607, 781, 1068]
    assert mine[3].user_lens[:3] == mine[2].user_lens  # the history only grows
    small = AgentShape(sessions=2, turns=3, system_len=40, user_median=10, output_len=8)
    path = tmp_path / "agent.jsonl"
    lens = write_agent(1, str(path), small)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == len(lens) == 6 and all(x["max_tokens"] == 8 for x in lines)
    system = lines[0]["prompt"].split("\nUser:")[0]
    for i, x in enumerate(lines):
        assert x["prompt"].startswith(system)  # one prefix shared by every request
        if i >= 2:  # a session's next turn extends its previous prompt (and its reply)
            assert x["prompt"].startswith(lines[i - 2]["prompt"])
            assert lens[i] > lens[i - 2]


def test_vllm_dtype_from_the_cpu_flags(sp: ModuleType) -> None:
    assert sp.best_vllm_dtype({"avx2", "avx512f", "avx512_bf16"}) == (
        "bfloat16", "the CPU has avx512_bf16")
    assert sp.best_vllm_dtype({"amx_bf16", "avx512_bf16"})[0] == "bfloat16"
    assert sp.best_vllm_dtype({"avx2", "fma"}) == (
        "float32", "the CPU has neither AVX512-BF16 nor AMX-BF16")
    s = sp.server_for("vllm", [], "/peers", None, None, "bfloat16")
    assert s.env["PEERS_VLLM_DTYPE"] == "bfloat16"
    args = sp.parse_args(["--client", "tailserve", "--vllm-dtype", "float32"])
    assert (args.vllm_dtype, args.vllm_dtype_why) == ("float32", "--vllm-dtype")
    # llama-server: --no-repack where its AMX repack would segfault, else its defaults.
    assert sp.best_llama_flags({"avx512_bf16", "amx_int8", "amx_tile"}) == (
        ["--no-repack"], "the CPU has amx_int8, amx_tile: its AMX repack segfaults")
    assert sp.best_llama_flags({"avx512_bf16"}) == ([], "no AMX: llama-server's defaults")


def test_capacity_sweep_against_a_fake_server(sp: ModuleType, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness's rate sweep: each rate is one client run; a fake client whose requests
    all meet the SLOs up to 2 req/s and none above."""
    seen: list[tuple[float, int]] = []
    sizes: list[int] = []

    def fake_client(client: str, args: Any, server: Any, w: Any, seed: int, out_dir: str,
                    tag: str) -> tuple[dict[str, Any], str]:
        seen.append((w.request_rate, seed))
        sizes.append(w.num_prompts)
        ttft = 0.2 if w.request_rate <= 2.0 else 5.0
        n = w.num_prompts
        return {"errors": [""] * n, "ttfts": [ttft] * n, "itls": [[0.01]] * n,
                "completed": n, "p99_ttft_ms": 1e3 * ttft, "duration": 10.0}, "cmd"

    monkeypatch.setattr(sp, "run_client", fake_client)
    args = sp.parse_args(["--client", "tailserve", "--capacity", "chat", "--capacity-start",
                          "1", "--capacity-steps", "5", "--capacity-prompts", "10"])
    cap = sp.capacity_sweep(args, sp.Server("x", [], {}, 1, "x"), "x", str(tmp_path),
                            sp.Slos(ttft_ms=1000.0, itl_ms=100.0))
    rates = [1.0, 2.0, 4.0, 2 * 2 ** 0.5, 2 * 2 ** 0.25]
    assert [r for r, _ in seen] == pytest.approx(rates)
    assert [s for _, s in seen] == [100, 101, 102, 103, 104]  # new prompts at every rate
    c90 = cap["targets"][0]
    assert (c90["capacity_req_s"], c90["lowest_missing_rate"]) == (
        2.0, pytest.approx(2 * 2 ** 0.25))
    assert [p["goodput_share"] for p in cap["points"]] == [1.0, 1.0, 0.0, 0.0, 0.0]
    # At least --capacity-seconds (60) of arrivals a rate: 60 requests at 1 req/s, not 10.
    assert sizes == [60, 120, 240, 170, 143]
    assert cap["points"][0]["request_goodput"] == pytest.approx(6.0)  # 60 good in 10 s
    assert cap["min_arrival_s"] == 60.0
    with pytest.raises(SystemExit):
        sp.parse_args(["--client", "tailserve", "--capacity", "single"])  # closed loop


def test_the_client_timeout_counts_from_the_last_arrival(sp: ModuleType, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """--client-timeout is what a run may take beyond its arrivals: a capacity point of 24
    chat requests at 0.025 req/s sends its last one ~960 s in, and a flat 900 s limit killed
    it (then counted as the server's miss). A closed-loop run has no arrival time to add. The
    same limit holds each request (llama-server's 32 saturated requests at 8B took over the
    bench client's own 600 s each)."""
    limits: list[float] = []
    cmds: list[list[str]] = []

    def fake_run(cmd: list[str], **kw: Any) -> Any:
        limits.append(kw["timeout"])
        cmds.append(cmd)
        return sp.subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(sp.subprocess, "run", fake_run)
    args = sp.parse_args(["--client", "tailserve", "--client-timeout", "900"])
    server = sp.Server("x", [], {}, 1, "x")
    slow = replace(sp.WORKLOADS["chat"], request_rate=0.025, num_prompts=24)
    assert sp.run_client("tailserve", args, server, slow, 100, str(tmp_path), "a")[0] is None
    sp.run_client("tailserve", args, server, sp.WORKLOADS["saturated"], 100, str(tmp_path), "b")
    assert limits == [pytest.approx(900 + 960), 900]
    # Each request may take as long as the run: tailserve bench's own limit is 600 s a request.
    assert all(c[c.index("--timeout") + 1] == "900" for c in cmds)


# ---------------------------------------------------------------- another model's files
def test_the_bundled_model_by_default(sp: ModuleType) -> None:
    ts = sp.server_for("tailserve", [], "/peers", None)
    assert ts.cmd[3:5] == ["serve", "--host"]  # no MODEL: the bundled one
    assert ts.cmd[ts.cmd.index("--served-model-name") + 1] == "SmolLM2-135M-Instruct"
    for name in ("llama.cpp", "vllm"):
        env = sp.server_for(name, [], "/peers", None).env
        assert not {"MODEL_GGUF", "MODEL_HF", "PEERS_SERVED_NAME"} & set(env)
    args = sp.parse_args(["--client", "tailserve"])
    assert args.served == sp.Served()
    t = sp.tailserve_bench_cmd("http://h", sp.WORKLOADS["single"], 3, "/o/r.json")
    assert t[t.index("--tokenizer") + 1] == "default"
    assert t[t.index("--model") + 1] == "SmolLM2-135M-Instruct"


def test_a_given_model_reaches_every_server_and_client(sp: ModuleType, tmp_path: Path) -> None:
    gguf, hf = tmp_path / "m.gguf", tmp_path / "hf"
    gguf.write_bytes(b"GGUF")
    hf.mkdir()
    args = sp.parse_args(["--client", "tailserve", "--model-gguf", str(gguf), "--model-hf",
                          str(hf), "--served-name", "m-Q4_0", "--workloads", "single,prompt256"])
    assert args.served == sp.Served("m-Q4_0", str(gguf), str(hf), str(hf))
    assert args.hf_folder == str(hf)
    ts = sp.server_for("tailserve", ["--x"], "/peers", None, served=args.served)
    assert ts.cmd[3:5] == ["serve", str(gguf)]
    assert ts.cmd[ts.cmd.index("--served-model-name") + 1] == "m-Q4_0" and ts.cmd[-1] == "--x"
    llama = sp.server_for("llama.cpp", [], "/peers", None, served=args.served)
    assert (llama.env["MODEL_GGUF"], llama.env["PEERS_SERVED_NAME"]) == (str(gguf), "m-Q4_0")
    vllm = sp.server_for("vllm", [], "/peers", None, served=args.served)
    assert (vllm.env["MODEL_HF"], vllm.env["PEERS_SERVED_NAME"]) == (str(hf), "m-Q4_0")
    w = sp.WORKLOADS["prompt256"]
    assert (w.input_len, w.output_len, w.max_concurrency) == (256, 8, 1)
    t = sp.tailserve_bench_cmd("http://h", w, 3, "/o/r.json", None, "m-Q4_0", str(hf))
    assert (t[t.index("--model") + 1], t[t.index("--tokenizer") + 1]) == ("m-Q4_0", str(hf))
    assert "--ignore-eos" in t
    v = sp.vllm_bench_cmd("vllm", str(hf), "http://h", w, 3, "/o/r.json", None, "m-Q4_0")
    assert (v[v.index("--model") + 1], v[v.index("--tokenizer") + 1]) == ("m-Q4_0", str(hf))
    assert "--ignore-eos" in v


def test_a_given_model_is_refused_where_it_cannot_be_served_alike(sp: ModuleType,
                                                                  tmp_path: Path) -> None:
    gguf, tok = tmp_path / "m.gguf", tmp_path / "tok"
    gguf.write_bytes(b"GGUF")
    tok.mkdir()
    ok = ["--client", "tailserve", "--servers", "tailserve,llama.cpp", "--workloads", "single"]
    args = sp.parse_args([*ok, "--model-gguf", str(gguf), "--tokenizer", str(tok)])
    assert args.served.tokenizer == str(tok) and args.served.hf is None
    for bad in (["--model-gguf", str(gguf)],  # no tokenizer: prompts in the wrong tokens
                ["--model-gguf", str(tmp_path / "none.gguf"), "--tokenizer", str(tok)],
                # long-mix's file is written in the bundled model's tokens
                ["--model-gguf", str(gguf), "--tokenizer", str(tok), "--workloads", "long-mix"],
                # vLLM would serve the bundled model
                ["--model-gguf", str(gguf), "--tokenizer", str(tok), "--servers", "vllm"]):
        with pytest.raises(SystemExit):
            sp.parse_args([*ok, *bad])


def test_roofline_of_a_given_gguf_for_tailserve_and_llama_server(sp: ModuleType) -> None:
    from roofline import served_decode_bytes
    from tailserve.model.loader import default_model_path

    path = default_model_path()  # any GGUF: its bytes are counted from the file
    w = sp.WORKLOADS["single"]
    context = w.input_len + (w.output_len - 1) / 2
    weights, kv32 = served_decode_bytes("float32", context, path)
    llama = sp.Server("llama.cpp", ["bash"], {}, 1, "llama.cpp")
    row = sp.roofline_row({"median_tpot_ms": 5.0}, w, [40.0], llama, path)
    # The same weights as stored; llama-server's K/V in float16: half of float32's.
    assert row["roofline_weight_bytes"] == weights and row["roofline_kv_dtype"] == "float16"
    assert row["roofline_kv_bytes"] == round(kv32 / 2)
    assert row["tpot_over_roofline"] == pytest.approx(
        5.0 / ((weights + kv32 / 2) / 40e9 * 1e3), abs=1e-3)
    vllm = sp.Server("vllm", ["bash"], {}, 1, "vllm")  # reads its own bf16/fp32 weights
    assert sp.roofline_row({"median_tpot_ms": 5.0}, w, [40.0], vllm, path) == {
        "read_gbps": [40.0]}


def test_real_sizes_calls_the_harness_with_its_model(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import real_sizes

    a = real_sizes.parse_args(["--shape", "llama-3.1-8b", "--qtype", "Q4_K_M", "--out",
                               str(tmp_path)])
    assert a.servers == ["tailserve", "llama.cpp"]  # no vLLM for the 8B unless --vllm
    argv = real_sizes.peers_argv(a, "/m.gguf", "/hf", a.servers)

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert (value("--model-gguf"), value("--tokenizer"), value("--served-name")) == (
        "/m.gguf", "/hf", "llama-3.1-8b-Q4_K_M")
    assert value("--workloads") == "single,saturated,prompt256,prompt2000"
    assert "--prompts=saturated=32" in argv and "--model-hf" not in argv
    assert "--tailserve-arg=--max-model-len=4096" in argv  # else 131,072 tokens of K/V
    a = real_sizes.parse_args(["--shape", "llama-3.2-1b", "--qtype", "Q4_0", "--out",
                               str(tmp_path), "--smoke"])
    argv = real_sizes.peers_argv(a, "/m.gguf", "/hf", a.servers)
    assert argv[argv.index("--model-hf") + 1] == "/hf" and "--vllm-arg=--max-model-len=4096" \
        in argv
    assert "--smoke" in argv and not any(x.startswith("--prompts") for x in argv)
