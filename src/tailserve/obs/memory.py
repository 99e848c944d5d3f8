"""Engine-process memory, sampled once per engine step (so it must stay cheap).

Keys (bytes, as ``EngineState.memory`` / ``StepStats.memory`` carry them):
``rss_bytes`` always; on an initialized CUDA device also ``torch_allocated_bytes``,
``torch_reserved_bytes``, ``device_used_bytes`` and ``device_total_bytes``.

Cost: ``psutil.Process.memory_info`` is one read of ``/proc/<pid>/statm`` on Linux (~10-20 µs
on a busy 2-core box); the CUDA calls are host-side counters plus one ``cudaMemGetInfo``.
Nothing here synchronizes the device.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import psutil

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


def sample_memory(device: str) -> dict[str, float]:
    """Memory of this process (and of ``device`` when it is an initialized CUDA device)."""
    out: dict[str, float] = {"rss_bytes": float(_this_process().memory_info().rss)}
    if device.startswith("cuda"):
        out.update(_cuda_memory(device))
    return out


def _cuda_memory(device: str) -> dict[str, float]:
    # torch is looked up, never imported: this module must load without torch, importing it
    # here would cost seconds inside the step loop, and a process that has not imported it
    # has no CUDA context to report on anyway.
    torch: Any = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        # Asking before the context exists would create one (hundreds of MB on the device).
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {
        "torch_allocated_bytes": float(torch.cuda.memory_allocated(device)),
        "torch_reserved_bytes": float(torch.cuda.memory_reserved(device)),
        "device_used_bytes": float(total - free),
        "device_total_bytes": float(total),
    }
