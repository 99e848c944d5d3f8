"""The GPU memory watermark of the host bench or watch runs on, through NVML (``nvidia-ml-py``,
module ``pynvml``, an optional dependency: ``pip install tailserve[nvml]``).

Per device, memory used (every process) against its capacity: bench's observer reads it with
every ``/metrics`` sample (bench/observe.py; diagnose reports the peak), watch once per
window; at or above ``ALERT_FRACTION`` it is an alert (the same 95% as ``tailserve serve
--memory-alert``'s default). NVML sees this host only: run bench or watch on the server's
host to see its GPUs. No pynvml, no driver, no device: no watermark, with the reason
(``why_not``). It lives in bench/ because bench is the lower of its two users (analyze may
import bench, not the other way round).

The NVML module is a seam (``nvml=``): tests pass an object with the same few functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ALERT_FRACTION = 0.95


@dataclass(frozen=True)
class DeviceMemory:
    index: int
    name: str
    used_bytes: float
    total_bytes: float

    @property
    def fraction(self) -> float:
        return self.used_bytes / self.total_bytes if self.total_bytes > 0 else 0.0

    @property
    def alert(self) -> bool:
        return self.fraction >= ALERT_FRACTION

    def as_json(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "used_bytes": self.used_bytes,
                "total_bytes": self.total_bytes, "used_fraction": round(self.fraction, 4),
                "alert": self.alert}


class GpuWatermark:
    """``read()`` gives every device's memory now, or None (``why_not`` says why)."""

    def __init__(self, nvml: Any = None) -> None:
        self.why_not = ""
        self._nvml: Any = None
        self._count = 0
        if nvml is None:
            try:
                import pynvml  # optional: tailserve[nvml]

                nvml = pynvml
            except ImportError:
                self.why_not = "no NVML on this host (pip install tailserve[nvml] on a GPU host)"
                return
        try:
            nvml.nvmlInit()
            self._count = int(nvml.nvmlDeviceGetCount())
        except Exception as exc:  # NVMLError_* (no driver, no device) is the library's own type
            self.why_not = f"NVML did not start ({type(exc).__name__}): no NVIDIA driver here"
            return
        if self._count == 0:
            self.why_not = "NVML sees no NVIDIA device on this host"
            return
        self._nvml = nvml

    def read(self) -> list[DeviceMemory] | None:
        nvml = self._nvml
        if nvml is None:
            return None
        out = []
        try:
            for i in range(self._count):
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                info = nvml.nvmlDeviceGetMemoryInfo(h)
                name = nvml.nvmlDeviceGetName(h)
                if isinstance(name, bytes):  # older bindings return bytes
                    name = name.decode(errors="replace")
                out.append(DeviceMemory(i, str(name), float(info.used), float(info.total)))
        except Exception as exc:  # a device lost mid-run: this window has no watermark
            self.why_not = f"NVML query failed ({type(exc).__name__})"
            return None
        return out
