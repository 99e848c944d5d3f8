"""The CUDA path's device-agnostic parts, on CPU: persistent step buffers, decode padding for
CUDA graphs and the bucket choice, the runner's buffer seam, and the start-up memory budget
arithmetic. (The copies, the graph capture and the profiling forward itself need a GPU:
benchmarks/gpu_check.sh.)"""

from __future__ import annotations

import contextlib
import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tailserve import SamplingParams
from tailserve.config import EngineArgs
from tailserve.data.step import ScheduledRequest, SchedulerOutput
from tailserve.model.attention.triton import TritonAttentionBackend
from tailserve.model.cuda_graphs import bucket_for, decode_metadata, graph_batch_sizes
from tailserve.model.device import detect_platform
from tailserve.model.loader import load_model
from tailserve.model.memory_profile import graph_reserve_bytes, kv_budget
from tailserve.model.runner import ModelRunner
from tailserve.model.step_buffers import StepInputBuffers, step_buffer_bytes
from tiny_models import build_tiny_llama

CPU = torch.device("cpu")


def test_fill_writes_in_place_and_views_the_same_storage_every_step() -> None:
    buf = StepInputBuffers(16, 4, 3, num_slots=64, device=CPU)
    buf.fill([5, 6, 7], [0, 1, 9], [32, 33, 9], [0, 2, 3], [2, 10], [[2], [0, 1]], [1, 2])
    first = buf.copy_to_device()
    assert first.input_ids.tolist() == [5, 6, 7]
    assert first.positions.tolist() == [0, 1, 9]
    assert first.slot_mapping.tolist() == [32, 33, 9]
    assert first.query_start_loc.tolist() == [0, 2, 3]
    assert first.seq_lens.tolist() == [2, 10]
    assert first.block_tables.tolist() == [[2, 0], [0, 1]]  # padded with block 0 to width
    assert first.logits_indices.tolist() == [1, 2]
    buf.fill([8], [10], [10], [0, 1], [11], [[0, 1, 2]], [0])
    second = buf.copy_to_device()
    assert second.block_tables.tolist() == [[0, 1, 2]]
    # Same storage: nothing was allocated for the second step.
    for a, b in zip((first.input_ids, first.block_tables, first.seq_lens),
                    (second.input_ids, second.block_tables, second.seq_lens), strict=True):
        assert a.data_ptr() == b.data_ptr()
    assert buf.nbytes == 8 * (3 * 16 + 4 + 5 + 4 * 3 + 4) == step_buffer_bytes(16, 4, 3)


def test_fill_refuses_steps_beyond_the_bounds() -> None:
    buf = StepInputBuffers(4, 2, 2, num_slots=32, device=CPU)
    with pytest.raises(ValueError, match=r"5 tokens, 1 sequences, 1 blocks .* \(4, 2, 2\)"):
        buf.fill([1] * 5, [0] * 5, [0] * 5, [0, 5], [5], [[0]], [4])
    with pytest.raises(ValueError, match="3 blocks per sequence"):
        buf.fill([1], [0], [0], [0, 1], [1], [[0, 1, 2]], [0])


def test_pad_decodes_adds_rows_that_touch_no_slot() -> None:
    buf = StepInputBuffers(8, 8, 4, num_slots=128, device=CPU)
    buf.fill([3, 4], [20, 5], [40, 70], [0, 1, 2], [21, 6], [[1, 2], [4]], [0, 1])
    buf.pad_decodes(4)
    inputs = buf.copy_to_device()
    assert inputs.input_ids.tolist() == [3, 4, 0, 0]
    assert inputs.slot_mapping.tolist() == [40, 70, 128, 128]  # one past the pool
    assert inputs.seq_lens.tolist() == [21, 6, 0, 0]
    assert inputs.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert inputs.block_tables.shape == (4, 4)  # full width: the captured graph's shape
    with pytest.raises(ValueError, match="cannot pad"):
        buf.pad_decodes(1)  # smaller than the batch
    buf.fill([1, 2, 3], [0, 1, 2], [0, 1, 2], [0, 3], [3], [[0]], [2])
    with pytest.raises(ValueError, match="3 tokens in 1 sequences"):
        buf.pad_decodes(4)  # a prefill step is never captured


def test_graph_buckets() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert [bucket_for(n, sizes) for n in (1, 3, 8, 9, 250, 256)] == [1, 4, 8, 16, 256, 256]
    assert bucket_for(257, sizes) is None  # the module forward runs it


def test_which_steps_replay_a_graph_and_which_run_eager() -> None:
    from tailserve.model.attention.torch_ref import TorchAttentionBackend
    from tailserve.model.cuda_graphs import graph_batch_for, wants_cuda_graphs

    sizes = graph_batch_sizes(16)  # [1, 2, 4, 8, 16]
    assert graph_batch_for(3, 3, sizes) == 4  # decode-only: the next bucket, padded
    assert graph_batch_for(2, 3, sizes) is None  # a prefill chunk in the step: eager
    assert graph_batch_for(17, 17, graph_batch_sizes(64)[:5]) is None  # past the largest
    assert graph_batch_for(3, 3, None) is None  # no graphs captured
    triton_backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    assert wants_cuda_graphs("cuda", False, triton_backend)
    assert not wants_cuda_graphs("cuda", True, triton_backend)  # --enforce-eager
    assert not wants_cuda_graphs("cuda", False, torch_backend)  # not capturable
    assert not wants_cuda_graphs("cpu", False, triton_backend)  # CpuDecodeGraph's place


def test_padded_decode_batch_through_triton_equals_the_unpadded_one() -> None:
    # What a captured graph computes: the real rows as without padding; the pool unchanged
    # but for the real rows' slots.
    g = torch.Generator().manual_seed(0)
    block_size, heads, kv_heads, dim = 16, 4, 2, 64
    pool = torch.randn(2, 12, block_size, kv_heads, dim, generator=g)
    tables = [[3, 7], [5], [9, 1, 2]]
    lens = [20, 9, 40]
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size
             for t, n in zip(tables, lens, strict=True)]
    q = torch.randn(4, heads, dim, generator=g)
    k = torch.randn(4, kv_heads, dim, generator=g)
    v = torch.randn(4, kv_heads, dim, generator=g)
    results = []
    for padded in (False, True):
        buf = StepInputBuffers(8, 4, 3, num_slots=12 * block_size, device=CPU)
        buf.fill([1, 2, 3], [n - 1 for n in lens], slots, [0, 1, 2, 3], lens, tables,
                 [0, 1, 2])
        size = 4 if padded else 3
        if padded:
            buf.pad_decodes(size)
        inputs = buf.copy_to_device()
        meta = decode_metadata(inputs, size, block_size, 1 / math.sqrt(dim), 64)
        backend = TritonAttentionBackend()
        backend.set_graph_max_seq_len(64)
        backend.begin_step(meta)
        cache = pool.clone()
        out = backend.forward(q[:size], k[:size], v[:size], cache, meta)
        results.append((out, cache))
    (plain, plain_cache), (padded_out, padded_cache) = results
    torch.testing.assert_close(padded_out[:3], plain, atol=1e-6, rtol=1e-6)
    assert torch.equal(padded_out[3], torch.zeros(heads, dim))
    assert torch.equal(padded_cache, plain_cache)


def test_kv_budget_arithmetic() -> None:
    gib = 1 << 30
    # 80 GiB at 0.9: 72 GiB less 1 (others), 16 (weights), 4 (activations), 0.5 (graphs)
    assert kv_budget(80 * gib, 0.9, gib, 16 * gib, 4 * gib, gib // 2) == int(50.5 * gib)
    assert kv_budget(8 * gib, 0.5, 0, 6 * gib, 0, 0) == 0  # never negative
    # the persistent step and sampling buffers come off the pool too
    assert kv_budget(80 * gib, 0.9, gib, 16 * gib, 4 * gib, gib // 2, gib // 4) == int(
        50.25 * gib)
    # graphs: the activations of max_num_seqs tokens out of the profiled budget, + margin
    assert graph_reserve_bytes(4096 << 20, 4096, 256) == (256 << 20) + (64 << 20)
    assert graph_reserve_bytes(100, 8, 64) == 100 + (64 << 20)


# ------------------------------------------------------------------ the runner seam
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _request(rid: str, prompt: list[int], done: int, new: list[int],
             blocks: list[int], params: SamplingParams = GREEDY,
             output: list[int] | None = None) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=rid, token_ids=new, num_computed_tokens=done, block_ids=blocks,
        sample=True, is_prefill=done < len(prompt), sampling_params=params,
        prompt_token_ids=prompt, output_token_ids=output or [], eos_token_ids=(2,),
    )


class RecordingOrder:
    """A ``CopyOrder`` for CPU: the staged path runs (separate staging twins, copies) and the
    calls are recorded, so the test can check their order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def wait_staging_free(self, slot: int) -> None:
        self.calls.append(("wait_staging_free", slot))

    @contextlib.contextmanager
    def copying(self, slot: int) -> Iterator[None]:
        self.calls.append(("copy_waits_consumed", slot))
        yield
        self.calls.append(("compute_waits_copied", slot))

    def mark_consumed(self) -> None:
        self.calls.append(("mark_consumed", -1))


def test_staging_is_double_buffered_and_the_events_keep_the_order() -> None:
    order = RecordingOrder()
    buf = StepInputBuffers(8, 2, 2, num_slots=64, device=CPU, copy_order=order)
    steps = [([5, 6], [0, 1]), ([7], [2]), ([8], [3])]
    seen = []
    for ids, pos in steps:
        buf.fill(ids, pos, pos, [0, len(ids)], [pos[-1] + 1], [[0]], [len(ids) - 1])
        inputs = buf.copy_to_device()
        seen.append(inputs.input_ids.tolist())
        buf.mark_consumed()
    assert seen == [[5, 6], [7], [8]]
    # Step N fills slot N % 2 once that slot's last copy (step N-2's) is done; each copy
    # waits for the previous forward's reads; each forward waits for its copy.
    assert order.calls == [
        ("wait_staging_free", 0), ("copy_waits_consumed", 0), ("compute_waits_copied", 0),
        ("mark_consumed", -1),
        ("wait_staging_free", 1), ("copy_waits_consumed", 1), ("compute_waits_copied", 1),
        ("mark_consumed", -1),
        ("wait_staging_free", 0), ("copy_waits_consumed", 0), ("compute_waits_copied", 0),
        ("mark_consumed", -1),
    ]
    # Filling step N+1 leaves step N's staging and device values alone (its copy may still
    # be in flight on CUDA): two staging twins, one device tensor.
    buf.fill([9, 9, 9], [0, 1, 2], [0, 1, 2], [0, 3], [3], [[1]], [2])
    assert buf._input_ids.host[0][:1].tolist() == [8]  # step 3's slot, untouched
    assert buf._input_ids.device[:1].tolist() == [8]  # nothing copied before copy_to_device
    assert buf.copy_to_device().input_ids.tolist() == [9, 9, 9]
    host = {t.data_ptr() for t in buf._input_ids.host}
    assert len(host) == 2 and buf._input_ids.device.data_ptr() not in host


def _no_tensor_from_host_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, building a tensor out of host values fails the test: on CUDA each
    such call is an allocation and a synchronous copy from pageable memory.

    What a step passing under it proves: the runner's CUDA step path (``_stage``, the
    Triton backend, the sampler over ``SamplingBuffers``; the same code, on CPU tensors)
    takes every host value through the persistent buffers. What it does not: device
    intermediates (activations, logits, sampler temporaries) still come from torch's caching
    allocator each eager step; that they reuse its cached blocks (no cudaMalloc after warm-up)
    only a GPU can show (``benchmarks/gpu_check.py memory``)."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a tensor built from host values inside the step")

    for name in ("tensor", "as_tensor", "from_numpy"):
        monkeypatch.setattr(torch, name, refuse)


def test_runner_steps_on_the_persistent_buffers_match_the_list_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The seam, not the kernels: the torch paths (the runner takes the buffers on CUDA only,
    # so they are handed to it here).
    from tailserve.model.sampling_buffers import SamplingBuffers

    monkeypatch.setenv("TAILSERVE_CPU_KERNELS", "0")
    path = build_tiny_llama(tmp_path / "llama")
    loaded = load_model(path)
    config = EngineArgs(model=path, device="cpu", dtype="float32", num_kv_blocks=32,
                        max_model_len=128, enforce_eager=True).resolve(
                            loaded.config, detect_platform())
    runner = ModelRunner(config.model, config.runner, 128, loaded.weights)
    runner.allocate_kv_cache(config.cache)
    runner.prepare_steps(config.scheduler)
    assert runner.step_buffers is None and runner.cuda_graphs is None  # CPU: nothing
    prompts = {"a": list(range(10, 30)), "b": list(range(40, 45))}
    blocks = {"a": [4, 9], "b": [2]}
    # Every sampler tensor made from host values: penalties, min_tokens, logprobs, a greedy
    # and a seeded random row (the greedy / random index vectors), top-p.
    params = {
        "a": SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                            min_tokens=3, stop_token_ids=[3, 4], logprobs=2, max_tokens=8),
        "b": SamplingParams(temperature=0.8, top_p=0.9, seed=7, frequency_penalty=0.2,
                            max_tokens=8),
    }

    def run(refuse_host_tensors: bool = False) -> list[dict[str, int]]:
        runner.kv_cache.zero_()
        with monkeypatch.context() as patch:
            if refuse_host_tensors:
                _no_tensor_from_host_values(patch)
            out = runner.execute(SchedulerOutput(
                [_request(r, p, 0, p, blocks[r], params[r]) for r, p in prompts.items()], 25,
                0, finished_request_ids=list(prompts)))  # a fresh generator for "b"
            got = [out.sampled_token_ids]
            outputs = {r: [t] for r, t in out.sampled_token_ids.items()}
            for step in range(3):  # decodes, one crossing into block 9 for "a"
                sched = [_request(r, p, len(p) + step, [outputs[r][-1]], blocks[r], params[r],
                                  outputs[r][:-1]) for r, p in prompts.items()]
                out = runner.execute(SchedulerOutput(sched, 0, 2))
                got.append(out.sampled_token_ids)
                for r, t in out.sampled_token_ids.items():
                    outputs[r].append(t)
        return got

    expected = run()
    with pytest.raises(AssertionError, match="host values"):
        run(refuse_host_tensors=True)  # the list path builds them: the check can fail
    scheduler = config.scheduler
    runner.step_buffers = StepInputBuffers(
        scheduler.max_num_batched_tokens, scheduler.max_num_seqs, 8, 32 * 16, CPU)
    runner.sampler.buffers = SamplingBuffers(scheduler.max_num_seqs, CPU, 64)
    assert run(refuse_host_tensors=True) == expected
    # The whole CUDA forward on CPU: Triton attention and fused ops (interpreted) over
    # staged buffers (separate staging twins and copies, as on CUDA, minus the streams), as
    # prepare_steps + get_attention_backend + apply_triton_kernels set it up.
    from tailserve.model.transforms.triton_kernels import apply_triton_kernels

    order = RecordingOrder()
    runner.step_buffers = StepInputBuffers(
        scheduler.max_num_batched_tokens, scheduler.max_num_seqs, 8, 32 * 16, CPU,
        copy_order=order)
    backend = TritonAttentionBackend()
    runner.backend = backend
    for layer in runner.model.layers:
        layer.self_attn.backend = backend
    report = apply_triton_kernels(runner.model)
    assert report.swapped == {"RMSNorm": 5, "ApplyRope": 2, "SiluAndMul": 2}
    assert run(refuse_host_tensors=True) == expected
    assert [c for c, _ in order.calls].count("mark_consumed") == 4  # one per step
    assert runner.sampler.buffers.grown == 0


# ------------------------------------------------------------------ the device check
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only host")
def test_gpu_check_refuses_clearly_without_cuda(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util
    import subprocess
    import sys

    for script in ("gpu_check.sh", "gpu_bundle.sh"):
        bash = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)],
                              capture_output=True, text=True)
        assert bash.returncode == 0, bash.stderr
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" /
                                                  "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert sorted(gpu_check.PARTS) == ["decode", "kernels", "memory", "nvml", "parity", "profile"]
    for part in gpu_check.PARTS:
        monkeypatch.setattr(sys, "argv", ["gpu_check.py", part])
        with pytest.raises(SystemExit) as exit_info:
            gpu_check.main()
        assert exit_info.value.code == 2
        captured = capsys.readouterr()
        assert "no CUDA device" in captured.err and captured.out == ""


def test_sampler_on_persistent_buffers_draws_the_same_tokens() -> None:
    # Greedy and random rows mixed, top-k, top-p (a nucleus wider than the first candidates,
    # so the retry path puts the same names twice) and min-p, each row seeded.
    from tailserve.model.sampler import Sampler, SamplingRow
    from tailserve.model.sampling_buffers import SamplingBuffers

    vocab = 1000
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)) * 0.1
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=20),
              SamplingParams(temperature=1.0, top_p=0.999), SamplingParams(temperature=1.3,
                                                                           min_p=0.05),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=5,
                                                              top_p=0.5)]

    def draw(buffers: SamplingBuffers | None) -> list[int]:
        rows = [SamplingRow(params=p, prompt_token_ids=[1], output_token_ids=[],
                            generator=torch.Generator().manual_seed(i))
                for i, p in enumerate(params)]
        return Sampler(vocab, buffers=buffers)(logits, rows).token_ids

    buffers = SamplingBuffers(8, CPU)
    expected = draw(None)
    assert draw(buffers) == expected
    assert draw(buffers) == expected  # reused in place
    with pytest.raises(ValueError, match="9 sampling rows exceed the buffers' 8"):
        buffers.put("temperature", [1.0] * 9)


def test_sampling_buffers_ragged_vectors_grow_once_past_their_start_size() -> None:
    from tailserve.model.sampling_buffers import SamplingBuffers, sampling_buffer_bytes

    buffers = SamplingBuffers(2, CPU, ragged_capacity=4)
    assert buffers.nbytes == sampling_buffer_bytes(2, 4)  # what the start-up budget counts
    first = buffers.put("penalty_keys", [7, 8, 9])
    assert first.tolist() == [7, 8, 9] and buffers.grown == 0
    assert buffers.put("penalty_keys", [1]).data_ptr() == first.data_ptr()  # in place
    assert buffers.capacity("min_tokens_keys") == 32  # 16 a row
    keys = buffers.put("min_tokens_keys", list(range(40)))  # a request with many stop ids
    assert keys.tolist() == list(range(40))
    assert buffers.grown == 1 and buffers.capacity("min_tokens_keys") == 80
    assert buffers.put("min_tokens_keys", [3]).data_ptr() == keys.data_ptr()
    with pytest.raises(ValueError, match="3 sampling rows exceed the buffers' 2"):
        buffers.put("logprob_index", [0, 1, 2])  # per-row vectors never grow
