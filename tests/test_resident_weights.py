"""The weight bytes an engine reports (start-up log, ``tailserve:model_weight_bytes``) are the
bytes its runner's tensors hold after the transforms, and the checkpoint it loaded itself is
let go once the runner holds its own tensors (benchmarks/resident_memory.py measures the
process)."""

from __future__ import annotations

import gc
import typing
import weakref

import torch

from tailserve import LLM
from tailserve.analyze.plan import load_config
from tailserve.config import EngineArgs
from tailserve.engine.core import EngineCore
from tailserve.model.loader import load_model
from tailserve.model.resident_weights import resident_weight_bytes
from tailserve.model.transforms.linear16 import Linear16
from tailserve.model.weight_storage import bytes_by_format, planned_storage

TINY = {"kv_cache_memory": 0.02, "max_model_len": 256}


def test_float32_checkpoint_served_as_bfloat16_counts_bfloat16_bytes(
    tiny_model_dir: str,
) -> None:
    core = EngineCore.from_args(EngineArgs(model=tiny_model_dir, dtype="bfloat16", **TINY))
    runner = core.runner
    assert (runner.config.dtype, runner.config.compute_dtype) == ("bfloat16", "float32")
    assert isinstance(runner.model.layers[0].mlp.down_proj, Linear16)
    cfg, _, _ = load_config(tiny_model_dir)
    # What the runner holds is the checkpoint at 16 bits (the tiny model's dims are multiples
    # of 16: Linear16's panels hold no padding), norms in float32: exactly the shared count.
    stored = bytes_by_format(planned_storage(cfg, dtype="bfloat16", compute_dtype="float32"))
    assert runner.weight_bytes == stored
    as_loaded = bytes_by_format(planned_storage(cfg, dtype="float32"))
    # Before, the count was the checkpoint's dtype: float32, twice these bytes.
    assert sum(runner.weight_bytes.values()) < 0.51 * sum(as_loaded.values())
    # The checkpoint's float32 dict is gone; config, tokenizer and source stay.
    assert core.loaded.weights == {}
    assert core.loaded.tokenizer is not None and core.loaded.source == tiny_model_dir


def test_checkpoint_released_unless_handed_in_or_kept(tiny_model_dir: str) -> None:
    loaded = load_model(tiny_model_dir)
    probe = weakref.ref(loaded.weights["model.layers.0.mlp.up_proj.weight"])
    shared = LLM.from_loaded(loaded, **TINY)  # its owner may build more engines from it
    assert shared.engine.loaded.weights is loaded.weights
    kept = LLM(tiny_model_dir, keep_checkpoint=True, **TINY)
    assert set(kept.engine.loaded.weights) == set(loaded.weights)
    del shared, kept, loaded
    gc.collect()
    assert probe() is None  # nothing else held the checkpoint's tensors
    own = LLM(tiny_model_dir, **TINY)
    assert own.engine.loaded.weights == {}
    out = own.generate("Hello", None)
    assert out[0].outputs[0].token_ids


def test_packed_gguf_counts_the_file_blocks_once() -> None:
    """The bundled GGUF as served by default: its blocks (q/k/v and gate/up concatenated
    once, the tied head the table itself), norms in float32; the rope table is not counted."""
    llm = LLM(None, **TINY)
    runner = llm.engine.runner
    assert runner.weight_bytes == {"Q4_1": 66_355_200, "Q8_0": 30_081_024, "float32": 140_544}
    assert llm.engine.loaded.weights == {}
    rope = typing.cast(torch.Tensor, runner.model.rope.cos)
    assert rope.numel() > 0  # present, and left out of the count
    assert resident_weight_bytes(runner.model) == runner.weight_bytes


def test_engine_process_loads_no_tokenizer() -> None:
    """The engine process loads without a tokenizer (the API process tokenizes): a GGUF's stop
    and start ids are then its metadata's, the same ones its tokenizer is built from."""
    bare = load_model(None, gguf_weights="packed", with_tokenizer=False)
    full = load_model(None, gguf_weights="packed")
    assert bare.tokenizer is None and full.tokenizer is not None
    assert bare.config == full.config
    assert full.config.eos_token_ids == (full.tokenizer.eos_token_id,)
