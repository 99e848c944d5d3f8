"""cpu_contention: the host's CPU other work took, read from /proc by bench beside the server
(bench/host_cpu.py), and named by diagnose (analyze/contention.py) instead of an engine stall.

The /proc readers run against this host's real /proc (a socket this test listens on, its own
CPU burned) and against a small fake tree for the cases a live host cannot stage (a process
of the server's tree that exits). The diagnosis runs on the simulator's runs with host
samples planted beside them."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from diagnose_sim import T0, Sim, simulate, without_server
from tailserve.analyze.contention import host_windows, lost_share, mean_share
from tailserve.analyze.data import run_from_result
from tailserve.analyze.diagnose import diagnose
from tailserve.bench.host_cpu import HostCpu, is_local, pid_listening, trees

LINUX = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="no /proc on this host")


def test_loopback_urls_are_local_and_others_are_not() -> None:
    for url in ("http://127.0.0.1:8000", "http://localhost:8000/v1", "http://[::1]:80",
                "127.0.0.5:9000"):
        assert is_local(url), url
    for url in ("http://10.0.0.4:8000", "https://api.example.com/v1", "http://vllm:8000"):
        assert not is_local(url), url
    hc = HostCpu("http://10.0.0.4:8000", os.getpid())
    hc.sample("during")
    assert hc.samples == [] and "not on this host" in hc.result()["host_cpu_why_not"]


@LINUX
def test_the_listening_process_is_found_and_its_cpu_counted() -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        assert pid_listening(port) == os.getpid()
        hc = HostCpu(f"http://127.0.0.1:{port}", os.getppid())
        assert hc.server_pid == os.getpid() and hc.why_not == ""
        hc.sample("before")
        end = time.process_time() + 0.3
        while time.process_time() < end:  # this process is "the server": burn its CPU
            pass
        hc.sample("after")
    a, b = hc.samples
    assert b["server_s"] - a["server_s"] >= 0.2
    assert b["host_busy_s"] - a["host_busy_s"] >= b["server_s"] - a["server_s"] - 0.05
    assert b["ncpu"] == os.cpu_count() and b["t"] > a["t"]
    if "server_run_s" in b:  # the kernel keeps schedstat: the threads' run time agrees
        assert b["server_run_s"] - a["server_run_s"] >= 0.2
        assert b["server_wait_s"] >= a["server_wait_s"] >= 0.0
    # Nobody listens on a port just closed: said, not guessed.
    assert "no process of this user listens" in HostCpu(
        f"http://127.0.0.1:{port}", os.getpid()).why_not


def _fake_proc(root: Path, procs: dict[int, tuple[int, int]]) -> str:
    """A /proc with ``pid -> (ppid, ticks)`` processes (the stat fields diagnose reads)."""
    for pid, (ppid, ticks) in procs.items():
        d = root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        # pid (comm) state ppid ... utime (14th) stime (15th): a name with spaces and ")".
        fields = ["S", str(ppid)] + ["0"] * 9 + [str(ticks), "0"] + ["0"] * 5
        (d / "stat").write_text(f"{pid} (a (b) c) " + " ".join(fields) + "\n")
    return str(root)


def test_a_tree_counts_every_descendant_and_nothing_else(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, {1: (0, 5), 100: (1, 10), 101: (100, 20), 102: (101, 40),
                                 200: (1, 1000), 300: (200, 7)})
    assert [t for t, _ in trees([100, 200, 999], proc)] == [70, 1007, 0]
    # The server (101) started by the client (100): counted once, as the server's.
    assert [t for t, _ in trees([101, 100], proc)] == [60, 10]


def _host(t: float, busy: float, server: float, client: float = 0.0,
          ncpu: int = 2) -> dict[str, Any]:
    return {"t": t, "phase": "during", "host_busy_s": busy, "host_all_s": ncpu * t,
            "server_s": server, "client_s": client, "ncpu": ncpu}


def test_other_share_per_window() -> None:
    xs = [_host(0, 0, 0), _host(1, 2.0, 0.5, 0.1), _host(2, 2.5, 1.0, 0.1),
          # a worker of the server exited: its ticks leave the sum, not the host's
          _host(3, 3.0, 0.2, 0.1), _host(4, 3.0, 0.2, 0.1), {"t": 5, "phase": "during"}]
    t0, t1, f, g = host_windows(xs)
    assert list(t0) == [0, 1, 2, 3] and list(t1) == [1, 2, 3, 4]
    assert f == pytest.approx([0.7, 0.0, 0.25, 0.0])
    assert np.isnan(g).all()  # no schedstat in these samples
    # Time-weighted over an interval; a point takes its window's share.
    got = mean_share(t0, t1, f, np.array([0.5, 2.0, 0.2, 9.0]), np.array([1.5, 3.0, 0.2, 10.0]))
    assert got == pytest.approx([0.35, 0.25, 0.7, 0.0])


def test_a_spinning_server_loses_more_than_its_cpu_time_shows() -> None:
    # Its threads waited for a CPU 80% of the time they were ready while others took 30% of
    # the host (they kept their CPU time spinning): 80% less the 20% of its quiet windows.
    f = np.array([0.0, 0.01, 0.3, 0.3, 0.02])
    g = np.array([0.2, 0.2, 0.8, np.nan, 0.9])
    assert lost_share(f, g) == pytest.approx([0.0, 0.0, 0.6, 0.3, 0.0])


def _contended(host_share: float, window: tuple[float, float], slow: float) -> dict[str, Any]:
    """Requests that rarely overlap; inside ``window`` (seconds from the start) other work takes
    ``host_share`` of the host and the server's steps take ``slow``x as long."""
    lo, hi = window
    res = simulate(Sim(n=30, rate=1, prompt=lambda i, rng: 32, output=32, base_s=0.005,
                       per_decode_s=0.0, max_num_seqs=8, noise=0.02, seed=3,
                       stall=lambda k, t, rng: 0.005 * (slow - 1) if lo <= t < hi else 0.0))
    end = res["duration"] + 1.0
    samples, busy, server = [], 0.0, 0.0
    for k in range(int(end) + 2):
        samples.append(_host(T0 + k, busy, server))
        share = host_share if lo <= k < hi else 0.01
        busy += 2 * share + 0.6
        server += 0.6
    res["tailserve"]["server"]["host_cpu_samples"] = samples
    return res


def test_a_contended_window_is_cpu_contention_not_an_engine_stall() -> None:
    res = _contended(0.75, (10.0, 18.0), slow=4.0)
    d = diagnose(run_from_result(res))
    for m in ("itl", "ttft"):
        assert d.tails[m].causes[0].cause == "cpu_contention", (m, d.findings)
        assert "engine_stall" not in [c.cause for c in d.tails[m].causes[:1]]
    c = d.tails["itl"].causes[0]
    assert c.evidence["host_cores"] == 2 and c.evidence["other_cores_tail_mean"] > 1.0
    assert "Other processes on the server's host used" in c.text
    assert "taskset" in c.advice and "bench on the server's host" in c.basis
    assert "cpu_contention" not in d.cannot_judge
    # The same run without the host's samples: the cause is not there to name.
    res["tailserve"]["server"].pop("host_cpu_samples")
    d = diagnose(run_from_result(res))
    assert "cpu_contention" not in [c.cause for t in d.tails.values() for c in t.causes]
    assert "cpu_contention" in d.cannot_judge
    assert "run bench on the server's host" in d.cannot_why["cpu_contention"]


def test_a_quiet_hosts_daemons_are_never_named() -> None:
    # 1% of the host everywhere, and a healthy server: nothing to name.
    d = diagnose(run_from_result(_contended(0.01, (10.0, 18.0), slow=1.0)))
    for m, t in d.tails.items():
        assert [c.cause for c in t.causes] == ["none"], (m, d.as_json()["tail"][m])


def test_another_engine_read_from_the_client_names_it_in_its_own_words() -> None:
    res = without_server(_contended(0.75, (10.0, 18.0), slow=4.0))
    res["tailserve"]["server"] = {"metric_names": ["vllm:num_requests_running"],
                                  "metric_samples": [],
                                  "host_cpu_samples": _contended(0.75, (10.0, 18.0), 4.0)[
                                      "tailserve"]["server"]["host_cpu_samples"]}
    d = diagnose(run_from_result(res))
    assert d.run.engine.family == "vllm"
    assert d.tails["itl"].causes[0].cause == "cpu_contention", d.findings
    assert "VLLM_CPU_OMP_THREADS_BIND" in d.tails["itl"].causes[0].advice
