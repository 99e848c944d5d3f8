"""Tenants (issue 34): the keys file, per-tenant limits, and a prefix cache salted by tenant so one
tenant can neither hit nor time another's cached prompt."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from server_util import ServerProcess
from tailserve.errors import ConfigError
from tailserve.server.errors import APIError
from tailserve.server.tenants import (
    Tenant,
    TenantLimits,
    check_tenant_name,
    load_api_keys,
    tenant_salt,
)

KEY_A, KEY_B = "sk-team-a-0123456789", "sk-team-b-9876543210"


def write_keys(path: Path, *lines: str) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_keys_file_names_each_tenant_and_its_limits(tmp_path: Path) -> None:
    path = write_keys(
        tmp_path / "keys.jsonl", "# team keys", "",
        json.dumps({"key": KEY_A, "name": "team-a", "weight": 2, "max_concurrency": 1}),
        json.dumps({"key": KEY_B, "name": "team-b", "max_requests_per_s": 0.5}),
    )
    keys = load_api_keys(path)
    assert sorted(keys.values(), key=lambda t: t.name) == [
        Tenant("team-a", 2.0, 1, None), Tenant("team-b", 1.0, None, 0.5)]
    assert KEY_A.encode() not in keys  # stored as digests, never as the keys themselves


@pytest.mark.parametrize("lines,message", [
    (["{not json"], "line 1: not a JSON object"),
    (["[1, 2]"], "line 1: not a JSON object"),
    (['{"key": "sk-0123456789", "name": "a", "colour": "red"}'], "unknown field(s) colour"),
    (['{"key": "short", "name": "a"}'], "'key' must be a string of at least 8"),
    (['{"key": "sk-0123456789", "name": "a b"}'], "'name' must be 1-64 characters"),
    (['{"key": "sk-0123456789", "name": "a", "weight": 0}'], "'weight' must be a number"),
    (['{"key": "sk-0123456789", "name": "a", "weight": true}'], "'weight' must be a number"),
    (['{"key": "sk-0123456789", "name": "a", "max_concurrency": 0}'], "'max_concurrency'"),
    (['{"key": "sk-0123456789", "name": "a", "max_requests_per_s": -1}'],
     "'max_requests_per_s'"),
    (['{"key": "sk-0123456789", "name": "a"}', "", '{"key": "sk-0123456789", "name": "b"}'],
     "line 3: the key is already given to tenant 'a'"),
    (['{"key": "sk-0123456789", "name": "a"}', '{"key": "sk-9999999999", "name": "a"}'],
     "line 2: tenant 'a' is already named on line 1"),
    (["# nothing but a comment"], "holds no key"),
])
def test_a_bad_keys_file_is_refused_naming_the_line(
    tmp_path: Path, lines: list[str], message: str
) -> None:
    path = write_keys(tmp_path / "keys.jsonl", *lines)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_api_keys(path)


def test_a_missing_keys_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="api_keys: cannot read"):
        load_api_keys(str(tmp_path / "absent.jsonl"))


def test_concurrency_limit_counts_what_the_engine_client_holds() -> None:
    live: set[str] = set()
    limits = TenantLimits(live.__contains__)
    team = Tenant("team-a", max_concurrency=2)
    limits.admit(team, 2)
    limits.register("team-a", ["r1", "r2"])
    live.update({"r1", "r2"})
    with pytest.raises(APIError, match=r"at its max_concurrency \(2 of 2 requests in flight\)") \
            as err:
        limits.admit(team, 1)
    assert err.value.status == 429 and err.value.code == "tenant_concurrency"
    limits.admit(Tenant("team-b", max_concurrency=2), 2)  # another tenant is not counted
    live.discard("r1")  # finished, aborted or rejected: the client no longer holds it
    limits.admit(team, 1)
    assert limits.inflight("team-a") == 1


def test_rate_limit_is_a_token_bucket_with_a_second_of_burst() -> None:
    now = [100.0]
    limits = TenantLimits(lambda rid: False, clock=lambda: now[0])
    team = Tenant("team-a", max_requests_per_s=2.0)
    limits.admit(team, 1)
    limits.admit(team, 1)
    with pytest.raises(APIError, match=r"over its max_requests_per_s \(2\)") as err:
        limits.admit(team, 1)
    assert err.value.code == "tenant_rate" and err.value.headers == {"Retry-After": "1"}
    now[0] += 0.5  # one token back
    limits.admit(team, 1)
    with pytest.raises(APIError):
        limits.admit(team, 1)


def test_tenant_names_and_salts() -> None:
    assert check_tenant_name("team-a@corp", "x-tenant") == "team-a@corp"
    with pytest.raises(APIError, match="header 'x-tenant'"):
        check_tenant_name("a b", "x-tenant")
    # No salt a client picks reaches another tenant's chain.
    assert tenant_salt("a", "b\x00c") != tenant_salt("a\x00b", "c")
    assert tenant_salt("a", None) == tenant_salt("a", "") != tenant_salt("b", None)


@pytest.mark.slow
def test_tenants_on_a_live_server(tmp_path: Path) -> None:
    """Two keys, the cache salted by tenant: team-b gets no hit on a prompt team-a cached while
    team-a hits its own; team-a's concurrency limit refuses team-a only; a wrong key is a 401;
    a trusted proxy's header names the tenant."""
    keys = write_keys(
        tmp_path / "keys.jsonl",
        json.dumps({"key": KEY_A, "name": "team-a", "max_concurrency": 1}),
        json.dumps({"key": KEY_B, "name": "team-b"}),
    )
    doc = " ".join(f"Crate {i} carries {i * 5 % 11} brass keys." for i in range(40))
    with ServerProcess(["--api-keys", keys, "--cache-salt-by-tenant", "--max-model-len", "2048",
                        "--tenant-header", "x-tenant-id"]) as srv:
        def complete(key: str, max_tokens: int = 1, **headers: str) -> httpx.Response:
            return httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "prompt": doc, "max_tokens": max_tokens, "temperature": 0},
                headers={"Authorization": f"Bearer {key}", **headers})

        def cached(key: str, **headers: str) -> int:
            r = complete(key, **headers)
            assert r.status_code == 200, r.text
            return int(r.json()["tailserve_timing"]["cached_prompt_tokens"])

        assert cached(KEY_A) == 0
        assert cached(KEY_A) > 300
        assert cached(KEY_B) == 0  # the same prompt, another tenant: no hit
        assert cached(KEY_B) > 300
        # Behind the trusted proxy the header names the tenant: a third salt.
        assert cached(KEY_B, **{"x-tenant-id": "team-c"}) == 0
        bad = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"},
                         headers={"Authorization": "Bearer sk-not-a-key-000"})
        assert bad.status_code == 401
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"},
                          headers={"Authorization": f"Bearer {KEY_B}",
                                   "x-tenant-id": "a b"}).status_code == 400

        async def at_once() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                def post(key: str) -> asyncio.Future[httpx.Response]:
                    return asyncio.ensure_future(client.post(
                        srv.url + "/v1/completions",
                        json={"prompt": "Count to fifty:", "max_tokens": 200,
                              "ignore_eos": True},
                        headers={"Authorization": f"Bearer {key}"}))
                first = post(KEY_A)
                await asyncio.sleep(1.0)  # admitted and decoding
                return list(await asyncio.gather(first, post(KEY_A), post(KEY_B)))

        first, second, other = asyncio.run(at_once())
        assert first.status_code == 200 and other.status_code == 200
        assert second.status_code == 429, second.text
        assert second.json()["error"]["code"] == "tenant_concurrency"
        assert "tenant 'team-a' is at its max_concurrency (1 of 1" in second.text


def test_a_bad_keys_file_stops_the_server_at_start(tmp_path: Path) -> None:
    keys = write_keys(tmp_path / "keys.jsonl", '{"key": "sk-0123456789", "name": "a"}',
                      '{"key": "sk-0123456789", "name": "b"}')
    srv = ServerProcess(["--api-keys", keys], wait_healthy=False)
    with srv:
        assert srv.wait(120) == 1
        assert "line 2: the key is already given to tenant 'a'" in srv.output()
