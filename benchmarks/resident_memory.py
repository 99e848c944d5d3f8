"""Resident memory of ``tailserve serve``'s engine process against the target of issue 15:
engine RSS <= model file size + KV pool bytes + 300 MB.

For each case (the bundled GGUF as served by default; the same model as a float32 HF folder
served ``--dtype bfloat16``; that folder with ``--quantization int8``) it starts a real server,
waits for /health, sends a few completions, then reads RSS and PSS (``/proc/PID/smaps_rollup``)
of the engine process and, separately, of the API process; the KV pool and the resident
weight bytes come from ``/metrics``. The KV pool is ``torch.zeros`` (calloc: pages a request
never wrote are not resident), so RSS is also shown against the pool's touched share.

``--breakdown`` then replays the engine's start-up in one fresh process and reads its RSS after
each stage (interpreter, ``import torch``, the kernel build loaded, tokenizer, checkpoint read,
runner + KV pool, a few requests, ``malloc_trim``): where the engine's bytes go.

    python benchmarks/resident_memory.py                     # all cases + the breakdown
    python benchmarks/resident_memory.py --cases gguf --no-breakdown
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
import psutil

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_util import ServerProcess, metric_value

MB = 1e6
SLACK = 300 * MB  # the target's allowance above file + KV pool
PROMPTS = ["The capital of France is", "Write a haiku about memory:",
           "List three prime numbers:" * 20]


def smaps_rollup(pid: int) -> dict[str, int]:
    """Rss / Pss / Anonymous / ... of a process, in bytes (Linux ``smaps_rollup``)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def largest_mappings(pid: int, n: int = 5) -> list[tuple[int, str]]:
    """The ``n`` mappings of a process with the most resident bytes: (Rss, name)."""
    out: list[tuple[int, str]] = []
    name = ""
    with open(f"/proc/{pid}/smaps") as fh:
        for line in fh:
            head = line.split()
            if not head[0].endswith(":"):  # a mapping's header line
                name = head[5] if len(head) > 5 else "[anon]"
            elif head[0] == "Rss:":
                out.append((int(head[1]) * 1024, name))
    return sorted(out, reverse=True)[:n]


def file_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
               if n.endswith(".safetensors"))


def weight_bytes(metrics: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.name == "tailserve:model_weight_bytes":
                out[s.labels["format"]] = s.value
    return out


def measure(name: str, model: str | None, args: list[str], kv_gib: float) -> dict[str, Any]:
    from tailserve.model.loader import resolve_model_path

    path = resolve_model_path(model)
    with ServerProcess(["--kv-cache-memory", str(kv_gib), "--log-level", "info", *args],
                       model=model, startup_timeout=600) as srv:
        for prompt in PROMPTS:
            r = httpx.post(srv.url + "/v1/completions", timeout=300,
                           json={"prompt": prompt, "max_tokens": 32, "temperature": 0})
            r.raise_for_status()
        time.sleep(1.0)
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        assert srv.proc is not None
        api = psutil.Process(srv.proc.pid)
        # The engine is the spawned child holding the model (multiprocessing's resource
        # tracker is a child too): the largest.
        engine_proc = max(api.children(recursive=True), key=lambda p: p.memory_info().rss)
        engine = smaps_rollup(engine_proc.pid)
        top = largest_mappings(engine_proc.pid)
        api_mem = smaps_rollup(api.pid)
        kv = metric_value(metrics, "tailserve:kv_cache_memory_bytes") or 0.0
        log = srv.output()
    size = file_bytes(path)
    wb = weight_bytes(metrics)
    target = size + kv + SLACK
    row: dict[str, Any] = {
        "case": name, "model": path, "args": args, "file_bytes": size, "kv_pool_bytes": kv,
        "weight_bytes": wb, "engine": engine, "api": api_mem, "target_bytes": target,
        "met": engine["Rss"] <= target, "largest_mappings": top,
        "startup_log": [ln for ln in log.splitlines() if "resident weights" in ln
                        or "engine ready" in ln],
    }
    print(f"\n== {name}: {os.path.basename(path)} {' '.join(args)}")
    for ln in row["startup_log"]:
        print("   log:", ln.split(": ", 1)[-1][:160])
    by_format = json.dumps({k: round(v / MB, 1) for k, v in wb.items()})
    print(f"   file {size / MB:8.1f} MB   KV pool {kv / MB:8.1f} MB   resident weights "
          f"(/metrics) {sum(wb.values()) / MB:.1f} MB {by_format}")
    for who, m in (("engine", engine), ("api", api_mem)):
        print(f"   {who:6s} RSS {m['Rss'] / MB:8.1f} MB  PSS {m['Pss'] / MB:8.1f} MB  "
              f"anon {m.get('Anonymous', 0) / MB:8.1f} MB  file-backed "
              f"{(m['Rss'] - m.get('Anonymous', 0)) / MB:8.1f} MB")
    print("   engine's largest mappings: " + ", ".join(
        f"{os.path.basename(n)} {b / MB:.0f} MB" for b, n in top))
    print(f"   target: engine RSS {engine['Rss'] / MB:.1f} MB <= file + KV pool + 300 MB = "
          f"{target / MB:.1f} MB: {'MET' if row['met'] else 'NOT MET'}"
          f" (file + 300 MB alone, the KV pool aside: "
          f"{(engine['Rss'] - size - SLACK) / MB:+.1f} MB)")
    return row


# ----------------------------------------------------------------------------- breakdown
BREAKDOWN = r"""
import ctypes, gc, json, os, sys, time
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
marks = [("interpreter", rss())]
import torch
marks.append(("import torch", rss()))
import tailserve
from tailserve.kernels import cpu_ops_available
cpu_ops_available()
marks.append(("import tailserve + kernels .so loaded", rss()))
from tailserve.model.loader import load_tokenizer, load_model, resolve_gguf_weights
model = sys.argv[1] if sys.argv[1] != "-" else None
tok = load_tokenizer(model)
marks.append(("tokenizer", rss()))
from tailserve.config import EngineArgs
from tailserve.engine.core import EngineCore
args = EngineArgs(model=model, kv_cache_memory=float(sys.argv[2]), **json.loads(sys.argv[3]))
core = EngineCore.from_args(args)
marks.append(("EngineCore (checkpoint read, runner, KV pool, calibrate)", rss()))
from tailserve.request import Request
from tailserve.sampling_params import SamplingParams
for i, n in enumerate((8, 200, 900)):
    params = SamplingParams(max_tokens=32, temperature=0)
    core.add_request(Request(f"r{i}", list(range(100, 100 + n)), params))
    while core.has_unfinished_requests():
        core.step()
marks.append(("after 3 requests (8 / 200 / 900 prompt tokens)", rss()))
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
marks.append(("malloc_trim(0)", rss()))
r = core.runner
kv = r.kv_cache_bytes
print(json.dumps({"marks": marks, "kv_pool_bytes": kv,
                  "weight_bytes": r.weight_bytes,
                  "checkpoint_dict_kept": core.loaded is not None and bool(core.loaded.weights)}))
"""


def breakdown(model: str | None, kv_gib: float, engine_args: dict[str, Any]) -> None:
    out = subprocess.run(
        [sys.executable, "-c", BREAKDOWN, model or "-", str(kv_gib), json.dumps(engine_args)],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    if out.returncode:
        print(out.stderr[-3000:])
        raise SystemExit(out.returncode)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n== breakdown of one engine's RSS ({model or 'bundled GGUF'} {engine_args}):")
    prev = 0
    for label, value in res["marks"]:
        print(f"   {value / MB:8.1f} MB  ({(value - prev) / MB:+8.1f})  {label}")
        prev = value
    print(f"   resident weights (runner): {sum(res['weight_bytes'].values()) / MB:.1f} MB; "
          f"KV pool {res['kv_pool_bytes'] / MB:.1f} MB (torch.zeros writes every page: "
          "all resident); "
          f"checkpoint dict still held by the engine: {res['checkpoint_dict_kept']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="gguf,hf-bf16,hf-int8")
    ap.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB (as served)")
    ap.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    cases = args.cases.split(",")
    rows = []
    hf_dir = None
    if any(c.startswith("hf") for c in cases):
        import torch

        from tiny_models import save_default_model_as_hf

        hf_dir = save_default_model_as_hf(os.path.join(tempfile.mkdtemp(), "smollm2-f32"),
                                          torch.float32)
    for case in cases:
        if case == "gguf":
            rows.append(measure(case, None, [], args.kv_cache_memory))
        elif case == "hf-bf16":
            rows.append(measure(case, hf_dir, ["--dtype", "bfloat16"], args.kv_cache_memory))
        elif case == "hf-int8":
            rows.append(measure(case, hf_dir, ["--quantization", "int8"], args.kv_cache_memory))
        else:
            raise SystemExit(f"unknown case {case!r}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if args.breakdown:
        breakdown(None, args.kv_cache_memory, {})
        if hf_dir is not None and "hf-bf16" in cases:
            breakdown(hf_dir, args.kv_cache_memory, {"dtype": "bfloat16"})


if __name__ == "__main__":
    main()
