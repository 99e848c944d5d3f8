"""Memory roofline for single-stream decode: bytes one decoded token must read ÷ bandwidth.

At batch size 1 every weight is read once per token and reused zero times, so decode is
memory-bound: the fastest a token can come is (bytes of weights read) / (memory bandwidth).
Both factors are measured or counted here, never taken from a datasheet.

    python benchmarks/roofline.py            # bandwidth of this machine only
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from tailserve.model.quant.formats import is_packed

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class Bandwidth:
    copy_gbps: float  # (bytes read + bytes written) / time of dst.copy_(src), best of N
    read_gbps: float  # bytes read / time of the faster reader (read_seconds), best of N
    read_by: str  # that reader: "torch.sum" or "quant_linear"
    copy_mib: int
    read_mib: int
    repeats: int
    threads: int


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # first touch: page faults would otherwise be timed as bandwidth
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _copy_seconds(mib: int, repeats: int) -> float:
    src = torch.ones(mib * MIB // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return best_seconds(lambda: dst.copy_(src), repeats)


def readers(mib: int) -> list[tuple[str, Callable[[], object]]]:
    """Ways to read ``mib`` MiB once, built once (a caller timing them again and again keeps
    them): torch's sum, and where the kernels are built the packed product kernel. A reduction
    reads every byte once and writes one scalar; but the product kernel, which must also read
    every byte of its weight, reads faster: one row of x against Q4_1 tiles read 5-30% more
    GB/s than torch's sum, amax or any over the same bytes in the same moment (Zen 4, 88 MB;
    benchmarks/notes/decode.md). A roofline is only as tight as its fastest reader."""
    out: list[tuple[str, Callable[[], object]]] = [
        ("torch.sum", torch.ones(mib * MIB // 4, dtype=torch.float32).sum)]
    product = _kernel_reader(mib)
    if product is not None:
        out.append(("quant_linear", product))
    return out


def fastest_read(ways: list[tuple[str, Callable[[], object]]], repeats: int
                 ) -> tuple[float, str]:
    """Seconds of the fastest of ``readers``' ways, best of ``repeats`` each, and its name."""
    return min((best_seconds(fn, repeats), name) for name, fn in ways)


def read_seconds(mib: int, repeats: int) -> tuple[float, str]:
    """Seconds to read ``mib`` MiB once by the fastest reader (``readers``), and which one."""
    return fastest_read(readers(mib), repeats)


def _kernel_reader(mib: int) -> Callable[[], object] | None:
    """One row of x against ``mib`` MiB of random Q4_1 blocks in the tiles the runner serves
    (rows of 576 values), or None without the compiled kernels."""
    from tailserve import kernels

    if not kernels.cpu_ops_available():
        return None
    from decode_products import random_blocks

    k, type_size = 576, 20
    tiles = random_blocks(max(16, mib * MIB // (k // 32 * type_size) // 16 * 16), k, type_size)
    x = torch.ones(1, k)
    op = torch.ops.tailserve.quant_linear
    return lambda: op(x, tiles, None)


def measure_bandwidth(copy_mib: int = 512, read_mib: int = 1024, repeats: int = 5) -> Bandwidth:
    """Best of ``repeats``: on a shared machine the best run is the one least disturbed by
    neighbours, which is the number a roofline should use."""
    copy_s = _copy_seconds(copy_mib, repeats)
    read_s, read_by = read_seconds(read_mib, repeats)
    return Bandwidth(
        copy_gbps=2 * copy_mib * MIB / copy_s / 1e9,
        read_gbps=read_mib * MIB / read_s / 1e9,
        read_by=read_by,
        copy_mib=copy_mib,
        read_mib=read_mib,
        repeats=repeats,
        threads=torch.get_num_threads(),
    )


@dataclass(frozen=True)
class DecodeBytes:
    """What one decode step of one sequence reads, in the serving dtype."""

    linear_bytes: int  # every projection matrix of every layer (q, k, v, o, gate, up, down)
    lm_head_bytes: int  # the whole [vocab, hidden] matrix: every logit needs every row
    norm_bytes: int  # RMSNorm weights (and biases, if any)
    embedding_row_bytes: int  # the embedding lookup is a gather of one row, not a table read
    kv_bytes_per_context_token: int  # K and V of one cached token across all layers
    element_size: int

    @property
    def weight_bytes(self) -> int:
        return self.linear_bytes + self.lm_head_bytes + self.norm_bytes + self.embedding_row_bytes

    def kv_bytes(self, context_len: float) -> float:
        return self.kv_bytes_per_context_token * context_len


def decode_bytes(
    weights: dict[str, torch.Tensor],
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    element_size: int,
) -> DecodeBytes:
    """Count from Hugging Face-named tensors. With tied embeddings there is no
    ``lm_head.weight``: the LM head *is* the embedding matrix, counted once, as the LM head.
    Packed GGUF blocks (uint8 ``[rows, blocks, type_size]``) count as stored: they are what the
    kernels read; float tensors count at ``element_size`` (the serving dtype)."""

    def nbytes(w: torch.Tensor) -> int:
        return w.numel() if is_packed(w) else w.numel() * element_size

    embed = weights["model.embed_tokens.weight"]
    lm_head = weights.get("lm_head.weight", embed)
    linear = norms = 0
    for name, w in weights.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            continue
        if w.dim() >= 2:
            linear += nbytes(w)
        else:
            norms += nbytes(w)
    return DecodeBytes(
        linear_bytes=linear,
        lm_head_bytes=nbytes(lm_head),
        norm_bytes=norms,
        embedding_row_bytes=nbytes(embed) // embed.shape[0],
        kv_bytes_per_context_token=num_layers * 2 * num_kv_heads * head_dim * element_size,
        element_size=element_size,
    )


def served_decode_bytes(kv_cache_dtype: str, context: float, model: str | None = None
                        ) -> tuple[int, float]:
    """(weight bytes, KV bytes) one decoded token of one sequence reads from a tailserve
    server, counted as ``tailserve plan`` counts them (the loader's bytes: a GGUF's blocks
    as stored) at ``context`` cached tokens, in a resolved ``kv_cache_dtype`` (float32,
    bfloat16, float16: the caller knows what its server resolved auto to)."""
    from tailserve.analyze.plan import PlanInputs, load_config, make_plan

    cfg, path, file_bytes = load_config(model)
    plan = make_plan(cfg, PlanInputs(model=model, dtype="auto", kv_dtype=kv_cache_dtype),
                     path, file_bytes)
    # Tied embeddings are stored once and read once per token, as the LM head (the lookup
    # reads one row of them: left out).
    return plan.weight_bytes, plan.kv_bytes_per_token * context


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--copy-mib", type=int, default=512)
    p.add_argument("--read-mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    bw = measure_bandwidth(a.copy_mib, a.read_mib, a.repeats)
    for k, v in asdict(bw).items():
        print(f"{k:>10}: {v:.2f}" if isinstance(v, float) else f"{k:>10}: {v}")


if __name__ == "__main__":
    main()
