"""Tenants (issue 34): the keys file, per-tenant limits, and a prefix cache salted by tenant so one
tenant can neither hit nor time another's cached prompt."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_util import ServerProcess, metric_value
from tailserve.data.records import RequestRecord
from tailserve.errors import ConfigError
from tailserve.obs.metrics import ServerMetrics
from tailserve.server.errors import APIError
from tailserve.server.tenants import (
    Tenant,
    TenantLimits,
    check_tenant_name,
    load_api_keys,
    tenant_salt,
)
from test_server_lifecycle import poll_metrics

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
    (["{not json"], "line 1: not JSON (Expecting property name"),
    (["[1, 2]"], "line 1: not a JSON object (an array)"),
    # A bare key on its own line is named by its type, never echoed into a log.
    (['"sk-0123456789"'], "line 1: not a JSON object (a string)"),
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


def test_a_keys_line_that_is_not_an_object_is_not_echoed(tmp_path: Path) -> None:
    path = write_keys(tmp_path / "keys.jsonl", '"sk-secret-0123456789"')
    with pytest.raises(ConfigError) as info:
        load_api_keys(path)
    assert str(info.value) == f"api_keys {path!r} line 1: not a JSON object (a string)"


def test_a_missing_keys_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="api_keys: cannot read"):
        load_api_keys(str(tmp_path / "absent.jsonl"))


def test_concurrency_limit_counts_what_the_engine_client_holds() -> None:
    live: set[str] = set()
    limits = TenantLimits(live.__contains__)
    team = Tenant("team-a", max_concurrency=2)
    limits.admit(team, 2)
    limits.register(team, ["r1", "r2"])
    live.update({"r1", "r2"})
    with pytest.raises(APIError, match=r"at its max_concurrency \(2 of 2 requests in flight\)") \
            as err:
        limits.admit(team, 1)
    assert err.value.status == 429 and err.value.code == "tenant_concurrency"
    limits.admit(Tenant("team-b", max_concurrency=2), 2)  # another tenant is not counted
    live.discard("r1")  # finished, aborted or rejected: the client no longer holds it
    limits.admit(team, 1)
    assert limits.inflight("team-a") == 1


def test_at_capacity_the_tenant_over_its_share_is_the_one_refused() -> None:
    live: set[str] = set()
    limits = TenantLimits(live.__contains__)
    flood, quiet = Tenant("flood"), Tenant("quiet", weight=3.0)
    limits.register(flood, ["f1", "f2", "f3", "f4"])
    live.update({"f1", "f2", "f3", "f4"})
    assert limits.capacity_share(flood, 1, 4) is None  # nobody else in flight: the plain bound
    assert limits.capacity_share(quiet, 3, 4) == (True, (
        "tenant 'quiet' is over its share of the server's capacity (0 requests in flight; "
        "weight 3 of 4 gives it 3 of max_num_seqs + max_queue_len = 4)"))
    assert limits.capacity_share(quiet, 4, 4) is not None
    assert not limits.capacity_share(quiet, 4, 4)[0]  # type: ignore[index]
    limits.register(quiet, ["q1"])
    live.add("q1")
    assert limits.capacity_share(flood, 1, 4) == (False, (
        "tenant 'flood' is over its share of the server's capacity (4 requests in flight; "
        "weight 1 of 4 gives it 1 of max_num_seqs + max_queue_len = 4)"))
    live.discard("q1")  # quiet's request finished: flood is alone again
    assert limits.capacity_share(flood, 1, 4) is None


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


def test_metrics_label_requests_by_tenant_within_the_keys_files_names() -> None:
    metrics = ServerMetrics(tenant_names=["team-a"])
    slo = {"ttft_s": 1.0, "itl_s": None, "tpot_s": None, "ttft_met": False, "itl_met": None,
           "tpot_met": None}
    timing = {"ttft_s": 2.0, "slo": slo}
    for tenant in ("team-a", "team-a", None, "stranger"):
        metrics.on_request_finished(RequestRecord(0.0, "r", "stop", 4, 1, timing=dict(timing),
                                                  tenant=tenant))
    metrics.on_request_finished(RequestRecord(0.0, "e", "error", 4, 0, error_type="engine_error",
                                              tenant="team-a"))
    metrics.on_rejected("queue_full", "team-a")
    metrics.on_rejected("unauthorized")  # nobody's
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render()[0].decode())
               if family.name.startswith("tailserve:tenant_") for s in family.samples
               if not s.name.endswith("_created")}

    def get(name: str, **labels: str) -> float:
        return samples.get((f"tailserve:{name}", tuple(sorted(labels.items()))), 0.0)

    assert [get("tenant_requests_total", tenant=t, outcome="success")
            for t in ("team-a", "default", "other", "stranger")] == [2, 1, 1, 0]
    assert get("tenant_requests_total", tenant="team-a", outcome="error") == 1
    assert get("tenant_requests_total", tenant="team-a", outcome="rejected") == 1
    assert get("tenant_requests_total", tenant="default", outcome="rejected") == 0
    assert get("tenant_time_to_first_token_seconds_count", tenant="team-a") == 2
    assert get("tenant_time_to_first_token_seconds_sum", tenant="other") == 2.0
    assert get("tenant_slo_missed_total", tenant="team-a", slo="ttft") == 2
    # Bounded: the file's names, default and other; never the stranger's own name.
    assert {dict(labels)["tenant"] for (_, labels) in samples} == {"team-a", "default", "other"}


def test_tenant_names_and_salts() -> None:
    assert check_tenant_name("team-a@corp", "x-tenant") == "team-a@corp"
    with pytest.raises(APIError, match="header 'x-tenant'"):
        check_tenant_name("a b", "x-tenant")
    # No salt a client picks reaches another tenant's chain.
    assert tenant_salt("a", "b\x00c") != tenant_salt("a\x00b", "c")
    assert tenant_salt("a", None) == tenant_salt("a", "") != tenant_salt("b", None)


@pytest.mark.slow
def test_tenants_on_a_live_server(tmp_path: Path) -> None:
    """Two keys, the cache salted by tenant: team-b gets no hit on a prompt team-a cached (in its
    timing and in /metrics' hit count; benchmarks/prefix_probe.py times it) while team-a hits its
    own; team-a's concurrency limit refuses team-a only; a wrong key is a 401;
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

        def hits() -> float:
            text = httpx.get(srv.url + "/metrics", timeout=30).text
            return metric_value(text, "tailserve:prefix_cache_hits_total") or 0.0

        def cached(key: str, **headers: str) -> int:
            before = hits()
            r = complete(key, **headers)
            assert r.status_code == 200, r.text
            n = int(r.json()["tailserve_timing"]["cached_prompt_tokens"])
            # The engine's own count agrees (one request at a time; a step's stats reach
            # /metrics before its outputs are answered): a 0 is no hit, not a hidden one.
            assert hits() - before == n
            return n

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

        async def at_once() -> tuple[httpx.Response, httpx.Response]:
            # team-a's first request streams a long answer and is held open until the two
            # others are answered, so no host is fast enough to finish it first.
            async with httpx.AsyncClient(timeout=120) as client:
                def post(key: str) -> asyncio.Future[httpx.Response]:
                    return asyncio.ensure_future(client.post(
                        srv.url + "/v1/completions",
                        json={"prompt": "Count to fifty:", "max_tokens": 8,
                              "ignore_eos": True},
                        headers={"Authorization": f"Bearer {key}"}))
                async with client.stream(
                    "POST", srv.url + "/v1/completions",
                    json={"prompt": "Count to fifty:", "max_tokens": 1500, "ignore_eos": True,
                          "stream": True},
                    headers={"Authorization": f"Bearer {KEY_A}"},
                ) as first:
                    assert first.status_code == 200
                    await poll_metrics(client, srv.url, lambda t: metric_value(
                        t, "tailserve:num_requests_running") == 1, timeout=60)
                    second, other = await asyncio.gather(post(KEY_A), post(KEY_B))
                return second, other

        second, other = asyncio.run(at_once())
        assert other.status_code == 200, other.text
        assert second.status_code == 429, second.text
        assert second.json()["error"]["code"] == "tenant_concurrency"
        assert "tenant 'team-a' is at its max_concurrency (1 of 1" in second.text


@pytest.mark.slow
def test_a_flooding_tenant_is_shed_and_its_neighbour_served_on_a_live_server(
    tmp_path: Path,
) -> None:
    """Capacity 4 (2 running + 2 queued), all taken by team-a: team-a's next request is the
    plain 429; team-b's is admitted (within its share) and served; team-a's next is refused
    naming its share. /metrics and the timing say who was who."""
    keys = write_keys(tmp_path / "keys.jsonl", json.dumps({"key": KEY_A, "name": "team-a"}),
                      json.dumps({"key": KEY_B, "name": "team-b"}))
    with ServerProcess(["--api-keys", keys, "--max-num-seqs", "2", "--max-queue-len", "2",
                        "--max-model-len", "1024"]) as srv:
        async def flood() -> tuple[list[httpx.Response], httpx.Response, str]:
            async with httpx.AsyncClient(timeout=300) as client:
                def post(key: str, max_tokens: int) -> asyncio.Future[httpx.Response]:
                    return asyncio.ensure_future(client.post(
                        srv.url + "/v1/completions",
                        json={"prompt": "Count to fifty:", "max_tokens": max_tokens,
                              "ignore_eos": True},
                        headers={"Authorization": f"Bearer {key}"}))

                async def until(running: int, waiting: int) -> None:
                    text = await poll_metrics(client, srv.url, lambda t: (
                        metric_value(t, "tailserve:num_requests_running") == running
                        and metric_value(t, "tailserve:num_requests_waiting") == waiting),
                        timeout=60)
                    assert metric_value(text, "tailserve:num_requests_waiting") == waiting

                floods = [post(KEY_A, 300) for _ in range(4)]
                await until(2, 2)
                plain = await post(KEY_A, 1)
                assert plain.status_code == 429, plain.text
                assert "the server is at capacity (4 requests in flight" in plain.text
                neighbour = post(KEY_B, 8)
                await until(2, 3)
                shed = await post(KEY_A, 1)
                done = list(await asyncio.gather(neighbour, *floods))
                return done, shed, (await client.get(srv.url + "/metrics")).text

        done, shed, metrics = asyncio.run(flood())
    assert [r.status_code for r in done] == [200] * 5
    assert done[0].json()["tailserve_timing"]["tenant"] == "team-b"
    assert shed.status_code == 429 and shed.json()["error"]["message"].startswith(
        "tenant 'team-a' is over its share of the server's capacity (4 requests in flight; "
        "weight 1 of 2 gives it 2 of max_num_seqs + max_queue_len = 4)")
    assert metric_value(metrics, "tailserve:tenant_requests_total",
                        {"tenant": "team-a", "outcome": "rejected"}) == 2
    assert metric_value(metrics, "tailserve:tenant_requests_total",
                        {"tenant": "team-b", "outcome": "success"}) == 1


def test_a_bad_keys_file_stops_the_server_at_start(tmp_path: Path) -> None:
    keys = write_keys(tmp_path / "keys.jsonl", '{"key": "sk-0123456789", "name": "a"}',
                      '{"key": "sk-0123456789", "name": "b"}')
    srv = ServerProcess(["--api-keys", keys], wait_healthy=False)
    with srv:
        assert srv.wait(120) == 1
        assert "line 2: the key is already given to tenant 'a'" in srv.output()
