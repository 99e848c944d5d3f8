"""Storage dtypes end to end: 16-bit weights served as stored (float32 compute on the CPU
kernels) and a 16-bit KV cache (--kv-cache-dtype): resolution, pool sizing, what the runner
keeps in memory, the one-call decode against the module forward, and greedy output against
float32 on the default model."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from prometheus_client import generate_latest

from tailserve import LLM, SamplingParams
from tailserve.cli import main
from tailserve.config import EngineArgs, ModelConfig
from tailserve.errors import ConfigError
from tailserve.model.device import detect_platform
from tailserve.model.loader import load_model
from tailserve.model.runner import ModelRunner
from tailserve.model.transforms import Linear16, WideEmbedding
from tailserve.obs.metrics import ServerMetrics
from tailserve.platforms import Platform
from test_cpu_decode import assert_graph_matches_module_forward, decode_batch, mixed_batch
from tiny_models import build_tiny_llama

pytestmark = pytest.mark.usefixtures("cpu_kernels")
ops = torch.ops.tailserve

MODEL = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
    tie_word_embeddings=True, checkpoint_dtype="bfloat16",
)
KERNELS = Platform(cuda_available=False, cpu_bf16_native=True, cpu_kernels=True)


def test_kv_cache_dtype_halves_block_bytes_and_doubles_the_blocks() -> None:
    """2 layers x 2 KV heads x 16 x 16 tokens x (K, V): 8192 bytes a block in float32, 4096 in
    16 bits, so the same 2 GiB holds twice the blocks."""
    blocks = {}
    for kv in ("auto", "float32", "bfloat16", "float16"):
        c = EngineArgs(device="cpu", dtype="float32", kv_cache_dtype=kv).resolve(MODEL, KERNELS)
        blocks[kv] = (c.cache.block_bytes, c.cache.num_kv_blocks, c.runner.kv_cache_dtype)
    assert blocks == {"auto": (8192, 262144, "float32"), "float32": (8192, 262144, "float32"),
                      "bfloat16": (4096, 524288, "bfloat16"),
                      "float16": (4096, 524288, "float16")}
    with pytest.raises(ConfigError, match="kv_cache_dtype must be auto, float32, bfloat16 or "
                                          "float16, got 'int8'"):
        EngineArgs(device="cpu", kv_cache_dtype="int8").resolve(MODEL, KERNELS)  # type: ignore[arg-type]


@pytest.mark.parametrize(("platform", "dtype", "want"), [
    # CPU kernels: a bf16 checkpoint stays bf16, computed in float32; float32 on request
    (KERNELS, "auto", ("bfloat16", "float32", "float32")),
    (KERNELS, "float32", ("float32", "float32", "float32")),
    (KERNELS, "float16", ("float16", "float32", "float32")),
    # torch's own ops compute in the weights' dtype, and the cache follows
    (Platform(cuda_available=False, cpu_bf16_native=True), "auto",
     ("bfloat16", "bfloat16", "bfloat16")),
    (Platform(cuda_available=False), "auto", ("float32", "float32", "float32")),
    (Platform(cuda_available=True, cuda_bf16=True), "auto", ("bfloat16", "bfloat16", "bfloat16")),
])
def test_weight_compute_and_cache_dtypes_resolve_apart(
    platform: Platform, dtype: str, want: tuple[str, str, str]
) -> None:
    r = EngineArgs(dtype=dtype).resolve(MODEL, platform, kv_cache_bytes=1 << 20).runner  # type: ignore[arg-type]
    assert (r.dtype, r.compute_dtype, r.kv_cache_dtype) == want


def test_dtype_info_is_rendered() -> None:
    m = ServerMetrics()
    m.on_dtypes(weight_dtype="bfloat16", compute_dtype="float32", cache_dtype="float16")
    text = generate_latest(m.registry).decode()
    assert ('tailserve:dtype_info{cache_dtype="float16",compute_dtype="float32",'
            'weight_dtype="bfloat16"} 1.0') in text


def make_runner(path: str, **args: Any) -> ModelRunner:
    loaded = load_model(path)
    config = EngineArgs(model=path, device="cpu", num_kv_blocks=128, max_model_len=512,
                        **args).resolve(loaded.config, detect_platform())
    runner = ModelRunner(config.model, config.runner, config.scheduler.max_model_len,
                         loaded.weights)
    runner.allocate_kv_cache(config.cache)
    return runner


@pytest.fixture(scope="module")
def bf16_tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    # head_dim 64 (the attention kernel's AVX2 path), tied embeddings (one 16-bit table)
    return build_tiny_llama(tmp_path_factory.mktemp("b16") / "llama", dtype=torch.bfloat16,
                            hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2, tie_word_embeddings=True)


@pytest.fixture(params=["widen", "native"])
def bf16_path(request: pytest.FixtureRequest) -> Iterator[str]:
    native = request.param == "native"
    if native and not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("this CPU has no AVX512-BF16")
    ops.set_bf16_dot(native)
    yield request.param
    ops.set_bf16_dot(True)


def test_a_bf16_checkpoint_is_served_as_stored(bf16_tiny: str) -> None:
    loaded = load_model(bf16_tiny)
    assert loaded.config.checkpoint_dtype == "bfloat16"
    assert {w.dtype for w in loaded.weights.values()} == {torch.bfloat16}
    runner = make_runner(bf16_tiny, dtype="auto")
    model = runner.model
    assert type(model.embed_tokens) is WideEmbedding
    linears = [m for m in model.modules() if type(m) is Linear16]
    assert len(linears) == 2 * 4 + 1 and all(m.panel.dtype == torch.bfloat16 for m in linears)
    # float32 only where compute needs it: norms (no float32 copy of any weight)
    wide = {n: p.numel() for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert wide and all(n.endswith("norm.weight") for n in wide)
    # the tied table is kept once, as the head's panels
    assert model.embed_tokens.weight is None and model.lm_head.weight is None
    assert runner.decode_graph is not None


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "float16"])
def test_decode_graph_is_bit_identical_with_16bit_weights_and_cache(
    bf16_tiny: str, bf16_path: str, kv: str
) -> None:
    runner = make_runner(bf16_tiny, dtype="auto", kv_cache_dtype=kv)
    assert runner.kv_cache.dtype == getattr(torch, kv)
    graph = runner.decode_graph
    assert graph is not None
    torch.manual_seed(0)
    runner.kv_cache.normal_()
    pools = runner.kv_cache.clone()
    ids, positions, meta = decode_batch(runner, [5, 300, 17, 16, 33], seed=3)
    with torch.inference_mode():
        want = runner.model(ids, positions, runner.kv_caches, meta)
        got = graph(ids, positions, list(pools.unbind(0)), meta)
    assert torch.equal(got, want)
    assert torch.equal(pools, runner.kv_cache)  # the same rounded K/V in the same slots
    # Decodes and a prefill chunk, more tokens than float32 panels run here: panel16_linear
    # serves every row count in both paths.
    assert graph.max_tokens is None
    assert_graph_matches_module_forward(
        runner, *mixed_batch(runner, [5, 300, 17], [(40, 141)], seed=3))


def test_16bit_weights_against_their_float32_widening(bf16_tiny: str, bf16_path: str) -> None:
    """A prefill forward on the 16-bit kernels against the same checkpoint widened to float32
    (oneDNN / panel float32 kernels): exact products up to float32 rounding when widened in
    registers, within bfloat16 activation rounding on the native dot product."""
    prompt = torch.randint(20, 4000, (40,), generator=torch.Generator().manual_seed(2))
    logits = {}
    for dtype in ("auto", "float32"):
        runner = make_runner(bf16_tiny, dtype=dtype)
        _, _, meta = decode_batch(runner, [40], seed=1)
        table = meta.block_tables[0]
        slots = torch.stack([table[p // 16] * 16 + p % 16 for p in range(40)])
        meta.num_decodes, meta.slot_mapping = 0, slots
        meta.query_start_loc, meta.query_lens = [0, 40], [40]
        with torch.inference_mode():
            runner.backend.begin_step(meta)
            hidden = runner.model(prompt, torch.arange(40), runner.kv_caches, meta)
            logits[dtype] = runner.model.compute_logits(hidden).double()
    err = (logits["auto"] - logits["float32"]).abs().max().item()
    scale = logits["float32"].abs().max().item()
    assert err < (3e-2 if bf16_path == "native" else 1e-4) * scale


def eager_and_graph(llm: LLM, run: Callable[[LLM], list[list[int]]]
                    ) -> tuple[list[list[int]], list[list[int]]]:
    """What ``run`` generates through the one-call decode, then through the module forward
    alone (the same engine with its graph taken away, as --enforce-eager builds it)."""
    runner = llm.engine.runner
    assert runner.decode_graph is not None
    graph = run(llm)
    runner.decode_graph = None
    return graph, run(llm)


def test_engine_tokens_are_the_same_with_enforce_eager_in_16_bits(bf16_tiny: str) -> None:
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(20, 4000, (n,), generator=g).tolist()}
               for n in (1, 9, 70)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(model=bf16_tiny, kv_cache_dtype="bfloat16", kv_cache_memory=0.05)
    assert llm.engine.config.runner.dtype == "bfloat16"
    graph, eager = eager_and_graph(
        llm, lambda e: [list(o.outputs[0].token_ids) for o in e.generate(prompts, params)])
    assert graph == eager


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a robot"]
SMALL = {"kv_cache_memory": 0.1, "max_model_len": 512}
# The GGUF's float32 dequantization: the packed path's int8 activations would add their own
# differences to the 16-bit ones these tests measure (tests/test_gguf_packed.py covers those).
FLOAT_GGUF = {"gguf_weights": "dequantize", **SMALL}


def greedy(llm: LLM, n: int = 20) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of tokens before the first divergence, over all prompts."""
    same = 0
    for x, y in zip(a, b, strict=True):
        for s, t in zip(x, y, strict=True):
            if s != t:
                break
            same += 1
    return same / sum(len(x) for x in a)


@pytest.fixture(scope="module")
def default_float32() -> list[list[int]]:
    return greedy(LLM(**FLOAT_GGUF))  # type: ignore[arg-type]


def test_default_model_with_a_bf16_kv_cache(default_float32: list[list[int]]) -> None:
    """bf16 K/V against the float32 cache on the bundled model (fp16 is covered by the kernel
    and tiny-model tests): greedy continuations agree (near-ties may flip late)."""
    llm = LLM(kv_cache_dtype="bfloat16", **FLOAT_GGUF)  # type: ignore[arg-type]
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    assert llm.engine.config.cache.block_bytes * 2 == LLM_BLOCK_BYTES_F32
    assert agreement(greedy(llm), default_float32) >= 0.75


# SmolLM2-135M: 30 layers x 3 KV heads x 64 x 16 tokens x (K, V) x 4 bytes
LLM_BLOCK_BYTES_F32 = 30 * 3 * 64 * 16 * 2 * 4


def test_default_model_as_a_bf16_checkpoint(default_bf16_folder: str,
                                            default_float32: list[list[int]]) -> None:
    """The bundled model written as a bf16 HF folder: served in 16 bits, the one-call decode
    gives the module forward's tokens, and greedy output follows the float32 GGUF's."""
    folder = default_bf16_folder  # the session's (conftest.py), shared with test_rtn.py
    llm = LLM(model=folder, **SMALL)
    assert llm.engine.config.runner.dtype == "bfloat16"
    graph, eager = eager_and_graph(llm, greedy)
    assert graph == eager
    assert agreement(graph, default_float32) >= 0.5


def test_plan_sizes_the_pool_by_the_kv_cache_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    """`tailserve plan --kv-cache-dtype` (serve's name): 16-bit KV, half the bytes per token
    of float32 and twice the blocks in the same memory (the bundled model's config)."""
    out = {}
    for kv in ("float32", "bfloat16"):
        assert main(["plan", "--dtype", "float32", "--kv-cache-dtype", kv, "--device-memory",
                     "4", "--json"]) == 0
        out[kv] = json.loads(capsys.readouterr().out)
    assert out["float32"]["kv_bytes_per_token"] == 2 * out["bfloat16"]["kv_bytes_per_token"]
    assert out["bfloat16"]["kv_bytes_per_token"] == 30 * 3 * 64 * 2 * 2
    assert out["bfloat16"]["num_blocks"] in (2 * out["float32"]["num_blocks"],
                                             2 * out["float32"]["num_blocks"] + 1)
