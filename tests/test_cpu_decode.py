"""The one-call step path (CpuDecodeGraph / decode_layers) against the module forward, on
decode-only and mixed steps (decode rows, then prefill chunks)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tailserve import LLM, SamplingParams
from tailserve.config import EngineArgs
from tailserve.model.attention import AttentionMetadata
from tailserve.model.attention.torch_ref import TorchAttentionBackend
from tailserve.model.cpu_decode import CpuDecodeGraph
from tailserve.model.device import detect_platform
from tailserve.model.layers import SiluAndMul
from tailserve.model.llama import LlamaDecoderLayer
from tailserve.model.loader import load_model
from tailserve.model.runner import ModelRunner
from tailserve.model.transforms.kernel_linear import PANEL_MAX_ROWS
from tiny_models import build_tiny_llama, build_tiny_qwen2

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # fails, not skips, where a compiler runs

BLOCK_SIZE = 16


def make_runner(path: str, **args: Any) -> ModelRunner:
    loaded = load_model(path)
    config = EngineArgs(
        model=path, device="cpu", dtype="float32", num_kv_blocks=128, max_model_len=512, **args
    ).resolve(loaded.config, detect_platform())
    runner = ModelRunner(config.model, config.runner, config.scheduler.max_model_len,
                         loaded.weights)
    runner.allocate_kv_cache(config.cache)
    return runner


def decode_batch(
    runner: ModelRunner, lens: list[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One decode token per sequence at position len - 1, scattered block tables."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-max(lens) // BLOCK_SIZE)
    blocks = torch.randperm(runner.num_kv_blocks, generator=g)[: len(lens) * per_seq]
    tables = blocks.view(len(lens), per_seq).long()
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.stack([tables[i, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                         for i, p in enumerate(positions.tolist())])
    ids = torch.randint(20, runner.model_config.vocab_size, (len(lens),), generator=g)
    meta = AttentionMetadata(
        num_decodes=len(lens), slot_mapping=slots, query_start_loc=list(range(len(lens) + 1)),
        query_lens=[1] * len(lens), seq_lens_list=lens, seq_lens=torch.tensor(lens),
        block_tables=tables, block_size=BLOCK_SIZE, scale=runner.scale,
    )
    return ids, positions, meta


def mixed_batch(
    runner: ModelRunner, decode_lens: list[int], chunks: list[tuple[int, int]], seed: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A step laid out as the runner lays it out: one decode token per ``decode_lens`` entry
    (at position len - 1), then a chunk of n tokens from position start for each (start, n)
    of ``chunks``, over scattered block tables."""
    g = torch.Generator().manual_seed(seed)
    lens = decode_lens + [start + n for start, n in chunks]
    query_lens = [1] * len(decode_lens) + [n for _, n in chunks]
    per_seq = -(-max(lens) // BLOCK_SIZE)
    blocks = torch.randperm(runner.num_kv_blocks, generator=g)[: len(lens) * per_seq]
    tables = blocks.view(len(lens), per_seq).long()
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(lens, query_lens, strict=True)])
    seq_of = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(query_lens))
    slots = tables[seq_of, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    ids = torch.randint(20, runner.model_config.vocab_size, (len(positions),), generator=g)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        num_decodes=len(decode_lens), slot_mapping=slots, query_start_loc=starts,
        query_lens=query_lens, seq_lens_list=lens, seq_lens=torch.tensor(lens),
        block_tables=tables, block_size=BLOCK_SIZE, scale=runner.scale,
    )
    return ids, positions, meta


def assert_graph_matches_module_forward(
    runner: ModelRunner, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
) -> None:
    """The graph's hidden states and K/V writes are bit-identical to the module forward's."""
    graph = runner.decode_graph
    assert graph is not None and graph.supports(meta)
    torch.manual_seed(0)
    runner.kv_cache.normal_()  # earlier tokens' K/V, the same for both paths
    pools = runner.kv_cache.clone()
    with torch.inference_mode():
        runner.backend.begin_step(meta)
        want = runner.model(ids, positions, runner.kv_caches, meta)
        got = graph(ids, positions, list(pools.unbind(0)), meta)
    assert torch.equal(got, want)
    # This step's K/V were written to the same slots, and nothing else changed.
    assert torch.equal(pools, runner.kv_cache)


# (decode contexts, prefill chunks as (start, tokens)): a first chunk, one deep in a prompt
# with odd lengths, two chunks behind decodes, a step of chunks alone, and a short chunk after
# a long start.
MIXED_STEPS = {
    "3dec+first-chunk": ([5, 40, 17], [(0, 23)]),
    "2dec+deep-chunk": ([130, 9], [(201, 37)]),
    "4dec+two-chunks": ([300, 1, 16, 33], [(96, 19), (0, 7)]),
    "chunks-only": ([], [(17, 1), (45, 50)]),
    # A short chunk deep in a prompt: few work items, so the kernel splits their keys.
    "1dec+split-chunk": ([40], [(300, 12)]),
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("decode")
    return {
        "llama-d16": build_tiny_llama(root / "llama"),
        # head_dim 64: the attention kernel's AVX2 path; 3 layers.
        "llama-d64-gqa4": build_tiny_llama(root / "llama64", hidden_size=256,
                                           intermediate_size=512, num_attention_heads=4,
                                           num_key_value_heads=1, num_hidden_layers=3),
        "qwen2-bias": build_tiny_qwen2(root / "qwen2"),
    }


@pytest.mark.parametrize("model", ["llama-d16", "llama-d64-gqa4", "qwen2-bias"])
@pytest.mark.parametrize("lens", [[1], [130], [5, 300, 17, 16, 33]], ids=["one", "long", "five"])
def test_decode_graph_is_bit_identical_to_the_module_forward(
    tiny_dirs: dict[str, str], model: str, lens: list[int]
) -> None:
    runner = make_runner(tiny_dirs[model])
    graph = runner.decode_graph
    assert graph is not None
    torch.manual_seed(0)
    runner.kv_cache.normal_()  # earlier tokens' K/V, the same for both paths
    pools = runner.kv_cache.clone()
    ids, positions, meta = decode_batch(runner, lens, seed=len(lens))
    assert graph.supports(meta)
    with torch.inference_mode():
        want = runner.model(ids, positions, runner.kv_caches, meta)
        got = graph(ids, positions, list(pools.unbind(0)), meta)
    assert torch.equal(got, want)
    # This step's K/V were written to the same slots, and nothing else changed.
    assert torch.equal(pools, runner.kv_cache)


@pytest.mark.parametrize("model", ["llama-d16", "llama-d64-gqa4", "qwen2-bias"])
@pytest.mark.parametrize("step", list(MIXED_STEPS))
def test_mixed_step_is_bit_identical_to_the_module_forward(
    tiny_dirs: dict[str, str], model: str, step: str
) -> None:
    runner = make_runner(tiny_dirs[model])
    decode_lens, chunks = MIXED_STEPS[step]
    assert_graph_matches_module_forward(runner, *mixed_batch(runner, decode_lens, chunks, seed=4))


def test_engine_output_is_the_same_with_enforce_eager(tiny_dirs: dict[str, str]) -> None:
    path = tiny_dirs["qwen2-bias"]
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(20, 40000, (n,), generator=g).tolist()}
               for n in (1, 9, 70, 200)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)]
    results = []
    for eager in (True, False):
        # Steps sized by the token budget alone, in arrival order: sized by time (the
        # default), each engine cut its chunks by its own measured step times, so on a loaded
        # host the two runs batched differently, rounded differently and, sampling at
        # temperature 0.8, drew other tokens (3 failures in 4 runs beside another process's
        # benchmarks); the deadline policy's order also reads the measured step times.
        llm = LLM(model=path, dtype="float32", kv_cache_memory=0.05, enforce_eager=eager,
                  slo_itl_ms=None, scheduling_policy="fcfs")
        assert (llm.engine.runner.decode_graph is None) == eager
        outs = llm.generate(prompts, [params[i % 2] for i in range(len(prompts))])
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    assert results[0] == results[1]
    assert all(len(ids) >= 24 for ids, _ in results[1])


def test_float_panels_run_here_only_up_to_panel_rows(tiny_dirs: dict[str, str]) -> None:
    """Decode-only and mixed steps alike, up to PANEL_MAX_ROWS tokens: above it the module
    forward gives float32 panels' products to oneDNN, which rounds differently."""
    runner = make_runner(tiny_dirs["llama-d16"])
    graph = runner.decode_graph
    assert graph is not None and graph.max_tokens == PANEL_MAX_ROWS
    _, _, meta = decode_batch(runner, [4, 9], seed=1)
    assert graph.supports(meta)
    meta.num_decodes = 1  # the second sequence is now a (one-token) prefill chunk
    assert graph.supports(meta)
    for decodes, chunk in (([], PANEL_MAX_ROWS), ([7], PANEL_MAX_ROWS - 1)):
        _, _, meta = mixed_batch(runner, decodes, [(3, chunk)], seed=2)
        assert graph.supports(meta)
    for decodes, chunk in (([], PANEL_MAX_ROWS + 1), ([7, 8], PANEL_MAX_ROWS - 1)):
        _, _, meta = mixed_batch(runner, decodes, [(3, chunk)], seed=2)
        assert not graph.supports(meta)  # the module forward runs it
    n = PANEL_MAX_ROWS + 1
    wide = AttentionMetadata(
        num_decodes=n, slot_mapping=torch.zeros(n, dtype=torch.long),
        query_start_loc=list(range(n + 1)), query_lens=[1] * n, seq_lens_list=[1] * n,
        seq_lens=torch.ones(n, dtype=torch.long), block_tables=torch.zeros(n, 1, dtype=torch.long),
        block_size=BLOCK_SIZE, scale=1.0,
    )
    assert not graph.supports(wide)


def refusal(caplog: pytest.LogCaptureFixture, model: nn.Module) -> str:
    """Builds the graph, which must refuse; the one line it logged."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tailserve.model.cpu_decode"):
        assert CpuDecodeGraph.build(model) is None
    lines = [r.getMessage() for r in caplog.records if r.name == "tailserve.model.cpu_decode"]
    assert len(lines) == 1, lines
    return lines[0]


def test_decode_graph_needs_every_piece_on_the_kernels(
    tiny_dirs: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert make_runner(tiny_dirs["llama-d16"], enforce_eager=True).decode_graph is None
    runner = make_runner(tiny_dirs["llama-d16"])
    assert CpuDecodeGraph.build(runner.model) is not None
    runner.model.layers[1].mlp.act = SiluAndMul()  # one fused op missing
    assert refusal(caplog, runner.model).endswith(
        "layers.1.mlp.act is SiluAndMul, not the FusedSiluAndMul it runs")
    runner = make_runner(tiny_dirs["llama-d16"])
    runner.model.layers[0].self_attn.backend = TorchAttentionBackend()
    assert refusal(caplog, runner.model).endswith(
        "layers.0.self_attn uses TorchAttentionBackend, not the CpuKernelAttentionBackend it runs")
    # hidden 72: o_proj and down_proj have 72 outputs, no panel copy (not a multiple of 16).
    odd = build_tiny_llama(tmp_path / "odd", hidden_size=72, num_attention_heads=4,
                           num_key_value_heads=2)
    runner = make_runner(odd)
    assert runner.decode_graph is None
    assert refusal(caplog, runner.model).endswith(
        "layers.0.self_attn.o_proj has no panel copy (72 outputs, not a multiple of 16)")
    # head_dim 24: every projection has panels, but the module forward's attention takes the
    # reference path for such heads (and the prefill kernel refuses them).
    odd = build_tiny_llama(tmp_path / "d24", hidden_size=96, num_attention_heads=4,
                           num_key_value_heads=2)
    runner = make_runner(odd)
    assert runner.decode_graph is None
    assert refusal(caplog, runner.model).endswith(
        "head_dim 24 is not a multiple of 16, which the attention kernels need")


def test_decode_graph_refuses_modules_it_does_not_know(
    tiny_dirs: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """A model feature the one-call path does not compute (an extra module in a layer, a
    layer subclass with its own forward) turns it off with the module named, rather than
    being skipped on decode-only steps while the module forward runs it."""
    runner = make_runner(tiny_dirs["llama-d16"])
    runner.model.layers[1].mlp.extra_norm = nn.LayerNorm(4)
    assert refusal(caplog, runner.model).endswith(
        "layers.1.mlp.extra_norm (LayerNorm) is not a module it knows")

    class SandwichLayer(LlamaDecoderLayer):  # e.g. an extra norm in its forward
        pass

    runner = make_runner(tiny_dirs["llama-d16"])
    layer = runner.model.layers[0]
    layer.__class__ = SandwichLayer
    assert refusal(caplog, runner.model).endswith(
        "layers.0 is SandwichLayer, not the LlamaDecoderLayer it runs")

    runner = make_runner(tiny_dirs["llama-d16"])
    runner.model.final_softcap = nn.Tanh()
    assert refusal(caplog, runner.model).endswith(
        "final_softcap (Tanh) is not a module it knows")

    runner = make_runner(tiny_dirs["llama-d16"])
    runner.model.layers[0].mlp.register_forward_hook(lambda *_: None)
    assert refusal(caplog, runner.model).endswith("layers.0.mlp has forward hooks")


def test_decode_graph_weights_are_the_layers_own(tiny_dirs: dict[str, str]) -> None:
    """Each layer's fields are its modules' tensors (no copies), the bias only where the
    model has one, flattened seven per layer for decode_layers."""
    for name, has_bias in (("llama-d16", False), ("qwen2-bias", True)):
        runner = make_runner(tiny_dirs[name])
        graph = runner.decode_graph
        assert graph is not None
        assert len(graph.layers) == len(runner.model.layers)
        assert len(graph.flat_weights) == 7 * len(graph.layers)
        for weights, layer in zip(graph.layers, runner.model.layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            assert weights.qkv is attn.qkv_proj.panel and weights.o is attn.o_proj.panel
            assert weights.gate_up is mlp.gate_up_proj.panel
            assert weights.down is mlp.down_proj.panel
            assert weights.input_norm.data_ptr() == layer.input_layernorm.weight.data_ptr()
            assert (weights.post_attention_norm.data_ptr()
                    == layer.post_attention_layernorm.weight.data_ptr())
            assert (weights.qkv_bias is not None) == has_bias
            flat = weights.op_args()
            assert flat[2].numel() == (attn.qkv_proj.out_features if has_bias else 0)


def test_decode_layers_rejects_bad_arguments(tiny_dirs: dict[str, str]) -> None:
    runner = make_runner(tiny_dirs["llama-d16"])
    graph = runner.decode_graph
    assert graph is not None
    ids, positions, meta = decode_batch(runner, [3, 20], seed=2)
    with torch.inference_mode():
        embeds = runner.model.embed_tokens(ids)
        cos, sin = runner.model.rope.lookup(positions)
        norm = runner.model.norm.weight
        starts = torch.tensor(meta.query_start_loc)
        args = (meta.block_tables, meta.seq_lens, starts, meta.num_decodes, norm,
                graph.num_heads, graph.eps, meta.scale)
        with pytest.raises(RuntimeError, match="13 weights for 2 layers"):
            torch.ops.tailserve.decode_layers(embeds, cos, sin, graph.flat_weights[:-1],
                                              runner.kv_caches, meta.slot_mapping, *args)
        bad_slots = meta.slot_mapping.clone()
        bad_slots[1] = runner.num_kv_blocks * BLOCK_SIZE
        before = runner.kv_cache.clone()
        with pytest.raises(RuntimeError, match="outside the pool"):
            torch.ops.tailserve.decode_layers(embeds, cos, sin, graph.flat_weights,
                                              runner.kv_caches, bad_slots, *args)
        assert torch.equal(runner.kv_cache, before)  # checked before anything is written


def test_decode_layers_rejects_a_bad_step_layout(tiny_dirs: dict[str, str]) -> None:
    """query_start_loc and num_decodes are checked before anything is written."""
    runner = make_runner(tiny_dirs["llama-d16"])
    graph = runner.decode_graph
    assert graph is not None
    ids, positions, meta = mixed_batch(runner, [3, 20], [(5, 6)], seed=2)  # 8 tokens
    with torch.inference_mode():
        embeds = runner.model.embed_tokens(ids)
        cos, sin = runner.model.rope.lookup(positions)

        def call(starts: list[int], num_decodes: int, seq_lens: torch.Tensor = meta.seq_lens,
                 block_tables: torch.Tensor = meta.block_tables) -> None:
            torch.ops.tailserve.decode_layers(
                embeds.clone(), cos, sin, graph.flat_weights, runner.kv_caches,
                meta.slot_mapping, block_tables, seq_lens, torch.tensor(starts), num_decodes,
                runner.model.norm.weight, graph.num_heads, graph.eps, meta.scale)

        before = runner.kv_cache.clone()
        with pytest.raises(RuntimeError, match=r"query_start_loc must be int64 \[4\] for 3"):
            call([0, 1, 2], 2)
        with pytest.raises(RuntimeError, match="4 decodes of 3 sequences"):
            call([0, 1, 2, 8], 4)
        with pytest.raises(RuntimeError, match="sequence 1 has 2 tokens"):
            call([0, 1, 3, 8], 2)  # a decode row of two tokens
        with pytest.raises(RuntimeError, match="sequence 2 has 0 tokens"):
            call([0, 1, 2, 2], 2)
        with pytest.raises(RuntimeError, match="runs from 0 to 7 for 3 sequences, the step has 8"):
            call([0, 1, 2, 7], 2)
        short = meta.seq_lens.clone()
        short[2] = 5  # a chunk of 6 tokens in a context of 5
        with pytest.raises(RuntimeError, match="sequence 2 has 6 new tokens, context 5"):
            call([0, 1, 2, 8], 2, seq_lens=short)
        with pytest.raises(RuntimeError, match="block_tables must be int64"):
            call([0, 1, 2, 8], 2, block_tables=meta.block_tables[:2])
        assert torch.equal(runner.kv_cache, before)
        call([0, 1, 2, 8], 2)  # the same step, well formed
