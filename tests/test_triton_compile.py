"""The CUDA path's Triton kernels compile for a real GPU target (sm_90), on this CPU-only
machine: the interpreter tests check what they compute, this checks that the compiler takes
them (tests/triton_aot.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_compiles_to_a_cubin_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when it is unset
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_aot.py"), "90"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    compiled = [json.loads(line) for line in run.stdout.splitlines()]
    kernels = {(c["dtype"], c["kernel"]) for c in compiled}
    names = {"_write_kv_kernel", "_reduce_splits_kernel", "_paged_prefill_kernel",
             "_paged_decode_kernel", "_rms_norm_kernel", "_rope_kernel",
             "_silu_and_mul_kernel"}
    assert kernels == {(dt, n) for dt in ("bf16", "fp32") for n in names}
    assert all(c["cubin_bytes"] > 0 for c in compiled)
