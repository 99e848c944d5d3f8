"""The seeds' GPU memory watermark in a bench run: the bench's observer reads this host's NVML
beside every /metrics sample (bench/observe.py, bench/gpu.py), and diagnose reports each
device's peak, when it came and the 95% alert. NVML is a fake here (test_watch.FakeNvml): the
host has no GPU.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from multiprocessing import Pipe
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tailserve.analyze.data import run_from_result
from tailserve.analyze.diagnose import diagnose
from tailserve.bench.gpu import GpuWatermark
from tailserve.bench.observe import _observer_main
from test_watch import FakeNvml

GIB = 2.0**30
FIXTURES = Path(__file__).parent / "fixtures" / "diagnose"


class ClimbingNvml(FakeNvml):
    """One device whose used memory rises by 1 GiB at every read, from 70 of 80 GiB."""

    def __init__(self) -> None:
        super().__init__([(b"NVIDIA H100 80GB HBM3", 70.0 * GIB, 80.0 * GIB)])
        self.reads = 0

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        used = 70.0 * GIB + self.reads * GIB
        self.reads += 1
        return SimpleNamespace(used=used, total=80.0 * GIB, free=80.0 * GIB - used)


def observe(gpu: bool | GpuWatermark, seconds: float = 0.3) -> list[dict[str, Any]]:
    """The observer's loop in a thread (no server: a target with nothing to scrape)."""
    parent, child = Pipe()
    th = threading.Thread(target=_observer_main, args=(
        child, [("http://127.0.0.1:9", False, False, False)], {}, 0.05, gpu))
    th.start()
    assert parent.poll(10) and parent.recv_bytes() == b"ready"
    time.sleep(seconds)
    parent.send_bytes(b"stop")
    assert parent.poll(10)
    out: list[dict[str, Any]] = json.loads(parent.recv_bytes())
    th.join(10)
    return out


def test_the_observer_reads_the_watermark_with_every_sample() -> None:
    [server] = observe(GpuWatermark(ClimbingNvml()))
    gpu = server["gpu_samples"]
    assert "gpu_why_not" not in server and len(gpu) >= 3
    assert gpu[0]["phase"] == "before" and gpu[-1]["phase"] == "after"
    assert {x["phase"] for x in gpu[1:-1]} == {"during"}
    used = [x["devices"][0]["used_bytes"] for x in gpu]
    assert used == [70.0 * GIB + k * GIB for k in range(len(gpu))]
    assert gpu[0]["devices"][0] == {"index": 0, "name": "NVIDIA H100 80GB HBM3",
                                    "used_bytes": 70.0 * GIB, "total_bytes": 80.0 * GIB,
                                    "used_fraction": 0.875, "alert": False}
    assert [x["t"] for x in gpu] == sorted(x["t"] for x in gpu)


def test_no_nvml_is_said_once_not_sampled() -> None:
    [server] = observe(GpuWatermark(FakeNvml([], fail=True)), 0.1)
    assert server["gpu_samples"] == []
    assert server["gpu_why_not"] == "NVML did not start (RuntimeError): no NVIDIA driver here"
    [plain] = observe(False, 0.1)  # bench with the watermark off
    assert "gpu_samples" not in plain and "gpu_why_not" not in plain


def _vllm_run_with(gpu_samples: list[dict[str, Any]] | None, why_not: str | None = None) -> Any:
    with gzip.open(FIXTURES / "vllm-starved.json.gz", "rt", encoding="utf-8") as f:
        result = json.load(f)
    server = result["tailserve"]["server"]
    # The recording's own: no NVML on the host it was made on.
    server.pop("gpu_samples", None)
    server.pop("gpu_why_not", None)
    if gpu_samples is not None:
        server["gpu_samples"] = gpu_samples
    if why_not is not None:
        server["gpu_why_not"] = why_not
    return run_from_result(result)


def _sample(t: float, used_gib: float) -> dict[str, Any]:
    return {"t": t, "phase": "during", "devices": [
        {"index": 0, "name": "NVIDIA H100", "used_bytes": used_gib * GIB,
         "total_bytes": 80.0 * GIB, "used_fraction": used_gib / 80.0, "alert": False}]}


def test_diagnose_reports_the_peak_and_the_alert() -> None:
    run = _vllm_run_with([])
    start = run.start_time or 0.0
    d = diagnose(_vllm_run_with([_sample(start + 1.0, 72.0), _sample(start + 30.0, 78.0),
                                 _sample(start + 31.0, 76.0)]))
    wm = d.as_json()["gpu_memory"]
    assert wm["devices"] == [{"index": 0, "name": "NVIDIA H100", "total_bytes": 80.0 * GIB,
                              "first_used_fraction": 0.9, "peak_used_fraction": 0.975,
                              "peak_used_bytes": 78.0 * GIB, "peak_at_s": 30.0,
                              "alert": True}]
    assert wm["alert_fraction"] == 0.95 and wm["samples"] == 3
    assert ("GPU 0 (NVIDIA H100) used 98% of its 80 GiB at t=30 s, at or above the 95% alert "
            "(it started the run at 90%: a flat line is memory reserved at start-up, a climb "
            "is allocation while serving).") in d.findings


def test_below_the_alert_no_finding_and_without_nvml_the_reason() -> None:
    run = _vllm_run_with([])
    start = run.start_time or 0.0
    d = diagnose(_vllm_run_with([_sample(start + 1.0, 60.0), _sample(start + 2.0, 75.0)]))
    assert d.as_json()["gpu_memory"]["devices"][0]["alert"] is False
    assert not [f for f in d.findings if f.startswith("GPU ")]
    d = diagnose(_vllm_run_with([], "NVML sees no NVIDIA device on this host"))
    assert d.as_json()["gpu_memory"] == {"devices": [],
                                         "why_not": "NVML sees no NVIDIA device on this host"}
    assert diagnose(_vllm_run_with(None)).as_json()["gpu_memory"] is None
    # A malformed entry is skipped, not a crash.
    bad = {"t": start + 1.0, "devices": [{"index": "x"}, {"name": "no numbers"}]}
    assert diagnose(_vllm_run_with([bad])).as_json()["gpu_memory"] is None


def test_the_watermark_sits_in_the_p99_jump_windows() -> None:
    # The seeds' joined view: GPU memory in the same time window as the latency. 60 of 80
    # GiB all run, 76 GiB during one of the windows where the starved vLLM run's P99 jumps.
    start = _vllm_run_with([]).start_time or 0.0
    jump = diagnose(_vllm_run_with(None)).windows[-1]
    samples = [_sample(start + t / 4, 76.0 if jump["start_s"] <= t / 4 <= jump["end_s"]
                       else 60.0) for t in range(0, 100)]
    d = diagnose(_vllm_run_with(samples))
    w = next(w for w in d.windows if w["start_s"] == jump["start_s"])
    # The baseline is the run's median window (short run: the spike's own share lifts it).
    change = w["changes"]["gpu_used_share"]
    assert change["window"] == 0.95 and 0.75 <= change["baseline"] < 0.8
    other = next(w for w in d.windows if w["end_s"] < jump["start_s"])  # a jump of its own
    assert other["changes"]["gpu_used_share"]["window"] == 0.75
    assert all("gpu_used_share" not in w["changes"] for w in diagnose(_vllm_run_with(None)).windows)
