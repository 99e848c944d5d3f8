"""Engine step times on the bundled GGUF with the tiled blocks the runner serves against the
stored blocks (the same modules with their tensors untiled, as before tiling), in one run.

    python benchmarks/step_tiles_bench.py [--repeats 9] [--threads 1]

``--threads 1`` times the process's CPU time (what a shared machine disturbs least); otherwise
wall time at torch's thread count. Each shape is (decodes, context, prefill chunk):
``runner.execute`` on the calibration batches (``engine/calibrate._batch``), median of
``--repeats`` after two warm-up steps; the two forms alternate shape by shape so a shared
machine's load falls on both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time
import typing

import torch

from tailserve.config import EngineArgs
from tailserve.engine.calibrate import _batch
from tailserve.model.cpu_decode import CpuDecodeGraph
from tailserve.model.device import detect_platform
from tailserve.model.loader import load_model
from tailserve.model.quant.formats import untile_blocks
from tailserve.model.runner import ModelRunner
from tailserve.model.transforms.gguf_linear import GGUFEmbedding, GGUFLinear

SHAPES = [(1, 64, 0), (1, 64, 16), (16, 256, 0), (16, 256, 64), (32, 512, 0), (0, 0, 128)]


def untiled(runner: ModelRunner) -> ModelRunner:
    """The runner's GGUF modules on stored blocks (the tied table stays one tensor)."""
    seen: dict[int, torch.Tensor] = {}

    def stored(t: torch.Tensor) -> torch.Tensor:
        return seen.setdefault(id(t), untile_blocks(t))

    for module in runner.model.modules():
        if isinstance(module, GGUFLinear):
            for i in range(module.num_parts):
                setattr(module, f"part{i}", stored(getattr(module, f"part{i}")))
        elif isinstance(module, GGUFEmbedding):
            module.table = stored(module.table)
    runner.decode_graph = CpuDecodeGraph.build(runner.model)
    return runner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    path = EngineArgs().model
    loaded = load_model(path, gguf_weights="packed")
    config = EngineArgs(model=path, device="cpu", num_kv_blocks=2048,
                        max_model_len=2048).resolve(loaded.config, detect_platform())
    runners = {}
    for label in ("stored", "tiled"):
        runner = ModelRunner(config.model, config.runner, config.scheduler.max_model_len,
                             dict(loaded.weights))
        runner.allocate_kv_cache(config.cache)
        runners[label] = untiled(runner) if label == "stored" else runner
    assert all(r.decode_graph is not None for r in runners.values())
    print(f"threads {torch.get_num_threads()}")
    for decodes, ctx, chunk in SHAPES:
        batch = typing.cast(typing.Any, _batch(decodes, ctx, chunk, 0, config.cache.block_size,
                                               2048))
        ms = {}
        for label, runner in runners.items():
            runner.execute(batch)
            runner.execute(batch)
            times = []
            for _ in range(args.repeats):
                t0 = clock()
                runner.execute(batch)
                times.append(clock() - t0)
            ms[label] = statistics.median(times) * 1e3
        print(f"decodes {decodes:2d} ctx {ctx:3d} chunk {chunk:3d}: stored {ms['stored']:6.1f} ms"
              f"  tiled {ms['tiled']:6.1f} ms  x{ms['stored'] / ms['tiled']:.2f}")


if __name__ == "__main__":
    main()
