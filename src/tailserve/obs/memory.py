"""Engine-process memory: sampled with every engine step and heartbeat, so it must stay cheap.

Keys (bytes unless noted, as ``EngineState.memory`` / ``StepStats.memory`` carry them):

- always: ``rss_bytes`` (this process), ``memory_alerts_total`` (a count), and
  ``kv_cache_bytes`` (the KV pool, allocated once at start-up) when the pool is known;
- on CPU: ``host_used_bytes`` / ``host_total_bytes`` (the machine's RAM, what the alert watches);
- on an initialized CUDA device: ``torch_allocated_bytes``, ``torch_reserved_bytes``,
  ``torch_inactive_split_bytes`` (reserved blocks split but not in use: fragmentation),
  ``device_used_bytes`` / ``device_total_bytes`` (NVML when present, else ``cudaMemGetInfo``)
  and, with NVML, ``device_process_bytes`` (this process's share of the device).

Cost: the RSS is one ``pread`` of ``/proc/self/statm`` through a descriptor kept open (~1.5 µs;
psutil's ``memory_info`` opens, reads, parses and closes it, ~11 µs alone and ~0.1 ms inside
the engine's step loop) and runs every call; torch's ``memory_allocated`` /
``memory_reserved`` are host-side counters. The rest (NVML, ``torch.cuda.memory_stats``,
``/proc/meminfo``) is refreshed at most once per ``slow_interval_s`` and reused in between.
Nothing here synchronizes the device.

NVML (``nvidia-ml-py``, module ``pynvml``) is imported lazily, on CUDA only; a machine without
it, or without NVIDIA's driver library, gets the torch view and a debug log line, no error.

The alert: when used / total of the watched memory (the device on CUDA, host RAM on CPU) rises
above ``alert_threshold``, one warning names the top consumers and ``memory_alerts_total``
counts one alert; it re-arms once usage falls back below the threshold.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import psutil

from tailserve import envs

logger = logging.getLogger(__name__)

DEFAULT_ALERT_THRESHOLD = 0.95
_GIB = float(1 << 30)

# Cached per pid: a Process object made before a fork would keep reporting the parent's
# RSS in the engine child, so the cache is invalidated when the pid changes.
_process: psutil.Process | None = None
_process_pid: int | None = None


def _this_process() -> psutil.Process:
    global _process, _process_pid
    pid = os.getpid()
    if _process is None or _process_pid != pid:
        _process, _process_pid = psutil.Process(pid), pid
    return _process


# (pid, descriptor of /proc/self/statm): reopened when the pid changes, since a descriptor
# inherited across a fork still reads the parent's.
_statm: tuple[int, int] | None = None
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """This process's resident set: /proc/self/statm's second field (what psutil reports),
    read through a kept descriptor; psutil where there is no /proc."""
    global _statm
    pid = os.getpid()
    if _statm is None or _statm[0] != pid:
        if _statm is not None:
            os.close(_statm[1])
            _statm = None
        try:
            _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY))
        except OSError:
            return int(_this_process().memory_info().rss)
    try:
        return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return int(_this_process().memory_info().rss)


def sample_memory(device: str) -> dict[str, float]:
    """Memory of this process (and of ``device`` when it is an initialized CUDA device)."""
    out: dict[str, float] = {"rss_bytes": float(rss_bytes())}
    if device.startswith("cuda"):
        out.update(_torch_cuda_memory(device, _torch()))
    return out


def _torch() -> Any:
    # torch is looked up, never imported: this module must load without torch, importing it
    # here would cost seconds inside the step loop, and a process that has not imported it
    # has no CUDA context to report on anyway.
    torch: Any = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        # Asking before the context exists would create one (hundreds of MB on the device).
        return None
    return torch


def _torch_cuda_memory(device: str, torch: Any) -> dict[str, float]:
    if torch is None:
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {
        "torch_allocated_bytes": float(torch.cuda.memory_allocated(device)),
        "torch_reserved_bytes": float(torch.cuda.memory_reserved(device)),
        "device_used_bytes": float(total - free),
        "device_total_bytes": float(total),
    }


def _cuda_index(device: str) -> int:
    """The NVML index of a torch device name (CUDA_VISIBLE_DEVICES renumbers devices)."""
    _, _, idx = device.partition(":")
    local = int(idx) if idx.isdigit() else 0
    visible = envs.CUDA_VISIBLE_DEVICES.get()
    if visible:
        ids = [v.strip() for v in visible.split(",")]
        if local < len(ids) and ids[local].isdigit():
            return int(ids[local])
    return local


class MemoryMonitor:
    """Samples memory for one engine (see the module docstring) and raises the memory alert."""

    def __init__(
        self,
        device: str,
        kv_cache_bytes: int | None = None,
        alert_threshold: float | None = DEFAULT_ALERT_THRESHOLD,
        slow_interval_s: float = 1.0,
    ) -> None:
        self.device = device
        self.is_cuda = device.startswith("cuda")
        self.kv_cache_bytes = kv_cache_bytes
        self.alert_threshold = alert_threshold
        self.slow_interval_s = slow_interval_s
        self.alerts_total = 0
        self.alerting = False
        self._slow: dict[str, float] = {}
        self._slow_at: float | None = None
        self._nvml: Any = None
        self._nvml_handle: Any = None
        self._nvml_tried = False

    # ------------------------------------------------------------------ sampling
    def sample(self) -> dict[str, float]:
        out = {"rss_bytes": float(rss_bytes())}
        if self.kv_cache_bytes:
            out["kv_cache_bytes"] = float(self.kv_cache_bytes)
        now = time.monotonic()
        if self._slow_at is None or now - self._slow_at >= self.slow_interval_s:
            self._slow_at = now
            self._slow = self._sample_slow()
            self._check_alert(self._slow)
        out.update(self._slow)
        if self.is_cuda and (torch := _torch()) is not None:
            # Cheap host-side counters: fresh every step.
            out["torch_allocated_bytes"] = float(torch.cuda.memory_allocated(self.device))
            out["torch_reserved_bytes"] = float(torch.cuda.memory_reserved(self.device))
        out["memory_alerts_total"] = float(self.alerts_total)
        return out

    def _sample_slow(self) -> dict[str, float]:
        if not self.is_cuda:
            vm = psutil.virtual_memory()
            return {"host_used_bytes": float(vm.total - vm.available),
                    "host_total_bytes": float(vm.total)}
        out: dict[str, float] = {}
        torch = _torch()
        if torch is not None:
            out.update(_torch_cuda_memory(self.device, torch))
            stats = torch.cuda.memory_stats(self.device)
            out["torch_inactive_split_bytes"] = float(
                stats.get("inactive_split_bytes.all.current", 0)
            )
        nvml = self._nvml_module()
        if nvml is not None:
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(self._nvml_handle)
                out["device_used_bytes"] = float(info.used)
                out["device_total_bytes"] = float(info.total)
                mine = [p for p in self._nvml_processes() if p[0] == os.getpid()]
                if mine:
                    out["device_process_bytes"] = float(mine[0][1])
            except Exception as exc:  # a driver hiccup must not stop the engine
                logger.debug("NVML query failed: %s", exc)
        return out

    def _nvml_module(self) -> Any:
        if self._nvml_tried:
            return self._nvml
        self._nvml_tried = True
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml_handle = pynvml.nvmlDeviceGetHandleByIndex(_cuda_index(self.device))
            self._nvml = pynvml
        except Exception as exc:  # not installed, no driver library, no such device
            logger.debug("NVML unavailable (%s); device memory from torch only", exc)
            self._nvml = None
        return self._nvml

    def _nvml_processes(self) -> list[tuple[int, float]]:
        """(pid, device bytes) of the processes on this device, largest first."""
        nvml = self._nvml
        if nvml is None:
            return []
        procs = nvml.nvmlDeviceGetComputeRunningProcesses(self._nvml_handle)
        out = [(int(p.pid), float(p.usedGpuMemory or 0)) for p in procs]
        return sorted(out, key=lambda p: -p[1])

    # ------------------------------------------------------------------ alert
    def usage(self, slow: dict[str, float]) -> float | None:
        used_key, total_key = (
            ("device_used_bytes", "device_total_bytes") if self.is_cuda
            else ("host_used_bytes", "host_total_bytes")
        )
        total = slow.get(total_key)
        if not total or used_key not in slow:
            return None
        return slow[used_key] / total

    def _check_alert(self, slow: dict[str, float]) -> None:
        if self.alert_threshold is None:
            return
        usage = self.usage(slow)
        if usage is None:
            return
        if usage <= self.alert_threshold:
            self.alerting = False
            return
        if self.alerting:
            return
        self.alerting = True
        self.alerts_total += 1
        what = f"device {self.device}" if self.is_cuda else "host memory"
        logger.warning(
            "memory alert: %s at %.1f%% (threshold %.1f%%); top consumers: %s",
            what, 100 * usage, 100 * self.alert_threshold, "; ".join(self.top_consumers(slow)),
        )

    def top_consumers(self, slow: dict[str, float], n: int = 5) -> list[str]:
        """Human-readable lines: the biggest processes, then this engine's own breakdown."""
        lines = []
        if self.is_cuda:
            procs = self._nvml_processes()
        else:
            procs = []
            for p in psutil.process_iter(["pid", "memory_info"]):
                mi = p.info.get("memory_info")
                if mi is not None:
                    procs.append((int(p.info["pid"]), float(mi.rss)))
            procs.sort(key=lambda p: -p[1])
        for pid, nbytes in procs[:n]:
            lines.append(f"pid {pid} ({_process_name(pid)}) {nbytes / _GIB:.2f} GiB")
        own = [("KV cache", self.kv_cache_bytes),
               ("torch allocated", slow.get("torch_allocated_bytes")),
               ("torch reserved", slow.get("torch_reserved_bytes")),
               ("inactive split", slow.get("torch_inactive_split_bytes"))]
        engine = ", ".join(f"{k} {v / _GIB:.2f} GiB" for k, v in own if v)
        if engine:
            lines.append(f"this engine: {engine}")
        return lines


def _process_name(pid: int) -> str:
    try:
        return str(psutil.Process(pid).name())
    except (psutil.Error, OSError):
        return "?"


class SteadyMemoryCheck:
    """``--assert-steady-memory``: after warm-up, memory must not grow with traffic.

    Watched: torch's reserved bytes on CUDA (the caching allocator's footprint), the KV pool
    plus the process RSS on CPU. The baseline is the peak seen until ``warmup_requests``
    requests have finished (so warm-up should include the longest prompts); afterwards
    ``growth`` is the watched value minus that baseline. Growth beyond ``tolerance_bytes``
    logs a warning — with the largest live allocations and their Python frames on CUDA,
    where torch records them — and counts a violation; the next warning waits for another
    tolerance of growth.
    """

    def __init__(self, is_cuda: bool, tolerance_bytes: float, warmup_requests: int) -> None:
        self.is_cuda = is_cuda
        self.tolerance_bytes = tolerance_bytes
        self.warmup_requests = warmup_requests
        self.baseline: float | None = None
        self.warmup_peak = 0.0
        self.growth = 0.0
        self.violations = 0
        self._next_warning_at = tolerance_bytes

    def watched(self, mem: dict[str, float]) -> float | None:
        if self.is_cuda:
            return mem.get("torch_reserved_bytes")
        return mem.get("rss_bytes", 0.0) + mem.get("kv_cache_bytes", 0.0)

    def observe(self, mem: dict[str, float], num_finished: int) -> None:
        """Feed one sample (``MemoryMonitor.sample()``); adds the ``steady_*`` keys to it."""
        value = self.watched(mem)
        if value is None:
            return
        if self.baseline is None:
            self.warmup_peak = max(self.warmup_peak, value)
            if num_finished < self.warmup_requests:
                return
            self.baseline = self.warmup_peak
            logger.info("steady memory: baseline %.1f MiB after %d requests (tolerance %.1f "
                        "MiB)", self.baseline / (1 << 20), num_finished,
                        self.tolerance_bytes / (1 << 20))
            _start_cuda_history(self.is_cuda)
        self.growth = max(self.growth, value - self.baseline)
        if self.growth > self._next_warning_at:
            self.violations += 1
            self._next_warning_at = self.growth + self.tolerance_bytes
            logger.warning(
                "steady memory: %s grew %.1f MiB over the post-warm-up baseline %.1f MiB "
                "(tolerance %.1f MiB); %s",
                "torch reserved" if self.is_cuda else "RSS + KV pool",
                self.growth / (1 << 20), self.baseline / (1 << 20),
                self.tolerance_bytes / (1 << 20), _allocation_sites(self.is_cuda),
            )
        mem["steady_baseline_bytes"] = self.baseline
        mem["steady_growth_bytes"] = self.growth
        mem["steady_violations_total"] = float(self.violations)


def _start_cuda_history(is_cuda: bool) -> None:
    torch = _torch() if is_cuda else None
    if torch is None:
        return
    try:  # records a stack per allocation from here on: the sites a warning can name.
        # Python frames only: the warning names .py sites, and unwinding C++ stacks on every
        # allocation of an eager prefill step would slow the loop being watched.
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=100000)
    except Exception as exc:
        logger.info("steady memory: torch cannot record allocation sites (%s)", exc)


def _allocation_sites(is_cuda: bool, n: int = 3) -> str:
    torch = _torch() if is_cuda else None
    if torch is None:
        return "allocation sites: not known on CPU (torch records them for CUDA only)"
    try:
        blocks = [
            b for seg in torch.cuda.memory._snapshot().get("segments", [])
            for b in seg.get("blocks", []) if b.get("state") == "active_allocated"
        ]
        blocks.sort(key=lambda b: -int(b.get("size", 0)))
        sites = []
        for b in blocks[:n]:
            frames = [f for f in b.get("frames", []) if f.get("filename", "").endswith(".py")]
            where = (f"{frames[0]['filename']}:{frames[0]['line']} {frames[0]['name']}"
                     if frames else "unknown site")
            sites.append(f"{int(b['size']) / (1 << 20):.1f} MiB at {where}")
        return "largest live allocations: " + ("; ".join(sites) or "none recorded")
    except Exception as exc:
        return f"allocation sites unavailable ({type(exc).__name__})"
