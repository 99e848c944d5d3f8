"""The GPU memory watermark of a bench run: per device, the peak of NVML's used memory over
the run and when, against the 95% alert (bench/gpu.py; the bench's observer reads it beside
every ``/metrics`` sample, on the host the bench ran on).

NVML counts every process's memory, so a vLLM server that reserves its KV cache at start-up
sits near its ``--gpu-memory-utilization`` from the first sample: a high watermark with a
flat line is that reservation, not a leak; one that climbs during the run is allocation in
the serving loop. Both figures are given so a person can tell them apart.
"""

from __future__ import annotations

from typing import Any

from tailserve.analyze.data import RunData
from tailserve.bench.gpu import ALERT_FRACTION


def gpu_watermark(run: RunData) -> dict[str, Any] | None:
    """Per device: peak and first used fraction, when the peak came, and the alert; None when
    the bench read no GPU (``why_not`` then says why, if it tried)."""
    if not run.gpu_samples:
        return None if run.gpu_why_not is None else {"devices": [], "why_not": run.gpu_why_not}
    start = run.start_time or 0.0
    by_dev: dict[int, dict[str, Any]] = {}
    for s in sorted(run.gpu_samples, key=lambda x: float(x.get("t") or 0.0)):
        for d in s.get("devices") or []:
            try:
                idx, used, total = int(d["index"]), float(d["used_bytes"]), float(d["total_bytes"])
            except (KeyError, TypeError, ValueError):
                continue  # a malformed entry says nothing; it is not a crash
            if total <= 0:
                continue
            frac = used / total
            row = by_dev.setdefault(idx, {"index": idx, "name": str(d.get("name") or ""),
                                          "total_bytes": total, "first_used_fraction": frac,
                                          "peak_used_fraction": -1.0})
            if frac > row["peak_used_fraction"]:
                row |= {"peak_used_fraction": frac, "peak_used_bytes": used,
                        "peak_at_s": round(float(s.get("t") or 0.0) - start, 2)}
    devices = []
    for row in sorted(by_dev.values(), key=lambda r: r["index"]):
        row["first_used_fraction"] = round(row["first_used_fraction"], 4)
        row["peak_used_fraction"] = round(row["peak_used_fraction"], 4)
        row["alert"] = row["peak_used_fraction"] >= ALERT_FRACTION
        devices.append(row)
    return {"devices": devices, "alert_fraction": ALERT_FRACTION,
            "samples": len(run.gpu_samples)} if devices else None


def sentences(wm: dict[str, Any] | None) -> list[str]:
    """One finding per device at or above the alert: where it peaked and where it started."""
    out = []
    for d in (wm or {}).get("devices") or []:
        if not d["alert"]:
            continue
        gib = d["total_bytes"] / 2**30
        out.append(f"GPU {d['index']} ({d['name']}) used {d['peak_used_fraction']:.0%} of its "
                   f"{gib:.0f} GiB at t={d['peak_at_s']:g} s, at or above the "
                   f"{ALERT_FRACTION:.0%} alert (it started the run at "
                   f"{d['first_used_fraction']:.0%}: a flat line is memory reserved at "
                   "start-up, a climb is allocation while serving).")
    return out
