"""Compile every Triton kernel of the CUDA path to a cubin for a GPU target, without a GPU
(Triton's front end, its MLIR passes and the bundled ptxas). Run as a script by
tests/test_triton_compile.py, in a process without TRITON_INTERPRET, since the interpreter
accepts programs the compiler refuses (scalar masks, dot shapes, dtype mixes).

    python tests/triton_aot.py 90   # compute capability, e.g. 80 (A100) or 90 (H100/H200)
"""

from __future__ import annotations

import json
import sys
from typing import Any

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import tailserve.model.triton_kernels.attention as tk
import tailserve.model.triton_kernels.elementwise as te


def compile_kernel(fn: Any, pointers: dict[str, str], floats: tuple[str, ...],
                   consts: dict[str, Any], target: GPUTarget) -> dict[str, Any]:
    """``pointers``: element type per pointer argument (``default`` for the rest); other
    runtime arguments are int64 unless listed in ``floats``."""
    signature = {}
    for name in fn.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointers.get(name, pointers["default"])
        else:
            signature[name] = "fp32" if name in floats else "i64"
    kernel = triton.compile(ASTSource(fn, signature, constexprs=consts), target=target)
    return {"kernel": fn.__name__, "shared": kernel.metadata.shared,
            "cubin_bytes": len(kernel.asm["cubin"])}


def main() -> None:
    target = GPUTarget("cuda", int(sys.argv[1]), 32)
    i64 = {"block_tables_ptr": "i64", "seq_lens_ptr": "i64", "query_start_loc_ptr": "i64",
           "slot_ptr": "i64"}
    for dt, dot, precision in (("bf16", tl.bfloat16, "tf32"), ("fp32", tl.float32, "ieee")):
        ptrs = {"default": dt, **i64}
        results = [
            compile_kernel(tk._write_kv_kernel, ptrs, (), dict(
                NUM_KV_HEADS=3, HEADS_PAD=4, HEAD_DIM=64, DIM_PAD=64), target),
            compile_kernel(tk._reduce_splits_kernel, {"default": "fp32", "out_ptr": dt}, (),
                           dict(NUM_HEADS=9, NUM_SPLITS=3, SPLITS_PAD=4, HEAD_DIM=64,
                                DIM_PAD=64), target),
            compile_kernel(tk._paged_prefill_kernel, ptrs, ("scale",), dict(
                QUERY_GROUP=3, HEAD_DIM=64, DIM_PAD=64, BLOCK_SIZE=16,
                BLOCK_M=tk.PREFILL_BLOCK_M, BLOCK_N=tk.PREFILL_BLOCK_N, DOT_DTYPE=dot,
                PRECISION=precision), target),
            compile_kernel(te._rms_norm_kernel, {"default": dt}, ("eps",), dict(
                HIDDEN=576, BLOCK=1024, HAS_RESIDUAL=True), target),
            compile_kernel(te._rope_kernel, {"default": dt, "cos_ptr": "fp32",
                                             "sin_ptr": "fp32"}, (), dict(
                NUM_HEADS=12, HEADS_PAD=16, HALF=32, HALF_PAD=32), target),
            compile_kernel(te._silu_and_mul_kernel, {"default": dt}, (), dict(
                INTER=1536, BLOCK=1024), target),
        ]
        for splits in (1, 4):
            results.append(compile_kernel(
                tk._paged_decode_kernel,
                {**ptrs, "part_out_ptr": "fp32", "part_ml_ptr": "fp32"}, ("scale",),
                dict(QUERY_GROUP=3, GROUP_PAD=16, HEAD_DIM=64, DIM_PAD=64, BLOCK_SIZE=16,
                     BLOCK_N=tk.DECODE_BLOCK_N, NUM_SPLITS=splits, NUM_HEADS=9,
                     DOT_DTYPE=dot, PRECISION=precision), target))
        for r in results:
            print(json.dumps({"dtype": dt, **r}), flush=True)


if __name__ == "__main__":
    main()
