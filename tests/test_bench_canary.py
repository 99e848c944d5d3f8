"""tailserve bench --base-url-b: users split by FNV-1a, both arms in one run, one result per
arm, and tailserve compare on the pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp import web

from tailserve.bench.canary import fnv1a_32, user_arm
from tailserve.cli import main
from test_bench import DONE, FakeServer, cmpl_chunk, sse


def test_fnv1a_reference_values() -> None:
    # The published FNV-1a 32-bit test vectors.
    assert fnv1a_32(b"") == 0x811C9DC5
    assert fnv1a_32(b"a") == 0xE40C292C
    assert fnv1a_32(b"foobar") == 0xBF9CF968


def test_users_split_in_proportion_and_stick_to_their_arm() -> None:
    arms = [user_arm(f"user-{u}", 0.1) for u in range(20000)]
    assert arms.count("B") / len(arms) == pytest.approx(0.1, abs=0.01)
    assert arms == [user_arm(f"user-{u}", 0.1) for u in range(20000)]
    # Growing the split only moves users from A to B, never back.
    assert all(user_arm(f"user-{u}", 0.3) == "B"
               for u, a in enumerate(arms) if a == "B")


def _server(delay_s: float, seen: list[str]) -> FakeServer:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("x-request-id", ""))
        script: list[bytes | float] = [delay_s, cmpl_chunk("a"), 0.002, cmpl_chunk("b"),
                                       cmpl_chunk("c", "length"), DONE]
        return await sse(script)(request)

    return FakeServer({("GET", "/v1/models"): models, ("POST", "/v1/completions"): completions})


def test_canary_run_saves_one_result_per_arm(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    seen_a: list[str] = []
    seen_b: list[str] = []
    path = tmp_path / "canary.json"
    with _server(0.08, seen_a) as a, _server(0.01, seen_b) as b:
        rc = main(["bench", "--base-url", a.url, "--base-url-b", b.url, "--split", "0.3",
                   "--users", "20", "--num-prompts", "60", "--input-len", "8",
                   "--request-rate", "200", "--no-progress", "--save-result", str(path)])
    assert rc == 0
    ra = json.loads((tmp_path / "canary-A.json").read_text())
    rb = json.loads((tmp_path / "canary-B.json").read_text())
    assert ra["completed"] + rb["completed"] == 60
    assert ra["completed"] > 0 and rb["completed"] > 0
    for arm, r, seen in (("A", ra, seen_a), ("B", rb, seen_b)):
        canary = r["tailserve"]["canary"]
        assert canary["arm"] == arm and canary["split"] == 0.3
        assert {user_arm(u, 0.3) for u in canary["user_ids"]} == {arm}
        # Each server saw its own test request plus exactly its arm's requests.
        assert len(seen) == r["completed"] + 1
    capsys.readouterr()
    # B is ~70 ms faster to its first token: compare finds it, and gates the reverse.
    assert main(["compare", str(tmp_path / "canary-A.json"), str(tmp_path / "canary-B.json"),
                 "--metric", "ttft", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["metrics"]["ttft"]["verdict"] == "better"
    assert main(["compare", str(tmp_path / "canary-B.json"), str(tmp_path / "canary-A.json"),
                 "--metric", "ttft"]) == 1


def test_canary_rejects_stepped_rates_and_degenerate_splits(
        capsys: pytest.CaptureFixture[str]) -> None:
    # Checked before any connection (nothing listens on port 9).
    base = ["bench", "--base-url", "http://127.0.0.1:9", "--base-url-b", "http://127.0.0.1:9"]
    assert main([*base, "--request-rates", "1,2"]) == 2
    assert "runs one step" in capsys.readouterr().err
    assert main([*base, "--split", "1.5"]) == 2
    assert "--split" in capsys.readouterr().err
    assert main([*base, "--users", "2", "--split", "0.01"]) == 2
    assert "every user hashes to arm A" in capsys.readouterr().err
