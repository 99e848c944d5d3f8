"""kernels/csrc/isa.h, the one place the kernels ask which instructions to run: the level in
use, whether the 16-bit dots run AVX512-BF16, and the AMX probe (CPUID, the OS's tile state,
Linux's tile permission) with its reason where AMX cannot serve."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import gguf
import pytest
import torch

from tailserve.kernels import QUANT_ISAS, _log_isa, isa_info, set_quant_isa, set_weight_prefetch
from tailserve.model.quant.formats import PACKED_FORMATS, tile_blocks
from test_quant_kernels import random_blocks

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # fails, not skips, where a compiler runs


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        line = next(ln for ln in f if ln.startswith("flags"))
    return set(line.split(":", 1)[1].split())


FLAGS = _cpu_flags()
HAS_AMX = {"amx_tile", "amx_int8"} <= FLAGS


@pytest.fixture
def auto_after() -> Iterator[None]:
    yield
    set_quant_isa("auto")


def test_the_level_in_use_is_the_one_set(auto_after: None) -> None:
    best = set_quant_isa("auto")
    info = isa_info()
    assert (info.level, info.best) == (best, best)
    if info.amx_permitted:  # AMX's products are VNNI's bit for bit: auto chooses them
        assert (best, info.supported) == ("amx", "amx")
    elif {"avx512_bf16", "avx512_vnni", "avx512bw"} <= FLAGS:  # bf16 is there, and opt-in
        assert (best, info.supported) == ("avx512vnni", "avx512bf16")
    if {"avx512_bf16", "avx512_vnni", "avx512bw"} <= FLAGS:
        assert set_quant_isa("avx512bf16") == "avx512bf16"
        assert isa_info().level == "avx512bf16"
    assert QUANT_ISAS[info.supported] >= QUANT_ISAS[best]
    # the 16-bit panels' vdpbf16ps runs at the AVX512 levels, as it did before isa.h
    assert info.avx512bf16 == ("avx512_bf16" in FLAGS and QUANT_ISAS[best] >= QUANT_ISAS["avx512"])
    if QUANT_ISAS[best] >= QUANT_ISAS["avx2"]:
        assert set_quant_isa("avx2") == "avx2"
        info = isa_info()
        # forced below AVX512, the 16-bit dots leave vdpbf16ps too: one switch for every kernel
        assert (info.level, info.best, info.avx512bf16) == ("avx2", best, False)
    with pytest.raises(RuntimeError, match="is not -1"):
        torch.ops.tailserve.set_quant_isa(7)


@pytest.mark.skipif(HAS_AMX, reason="this CPU has AMX (amx_tile, amx_int8 in /proc/cpuinfo)")
def test_amx_absent_is_reported_with_its_reason(auto_after: None) -> None:
    best = set_quant_isa("auto")
    info = isa_info()
    assert (info.amx_cpu, info.amx_os, info.amx_permitted) == (False, False, False)
    assert info.amx_reason == ("the CPU has no AMX (CPUID.(7,0):EDX AMX-TILE bit 24 = 0, "
                               "AMX-INT8 bit 25 = 0)")
    with pytest.raises(RuntimeError, match=r"AMX asked, not available: the CPU has no AMX"):
        set_quant_isa("amx")
    assert isa_info().level == best  # a refused level changes nothing


@pytest.mark.skipif(HAS_AMX, reason="this CPU has AMX (amx_tile, amx_int8 in /proc/cpuinfo)")
def test_the_reason_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tailserve.kernels"):
        _log_isa()
    assert f"level {isa_info().level}" in caplog.text
    assert "no AMX: the CPU has no AMX (CPUID.(7,0):EDX AMX-TILE bit 24 = 0" in caplog.text


@pytest.mark.skipif(not HAS_AMX, reason="needs a CPU with AMX-TILE and AMX-INT8 (this one has "
                    "none: its AMX probe is tested by test_amx_absent_is_reported_with_its_reason)")
def test_amx_probe_on_an_amx_cpu(auto_after: None) -> None:
    info = isa_info()
    assert info.amx_cpu and info.amx_bf16 == ("amx_bf16" in FLAGS)
    if info.amx_permitted:  # the tile products serve, and auto chooses them
        assert info.amx_os and info.amx_reason is None
        assert set_quant_isa("avx512vnni") == "avx512vnni"
        assert set_quant_isa("amx") == "amx" and isa_info().level == "amx"
        assert set_quant_isa("auto") == "amx"
    else:  # the OS or Linux's permission said no, and the reason says which
        assert info.amx_reason is not None
        assert "XCR0" in info.amx_reason or "arch_prctl" in info.amx_reason
        with pytest.raises(RuntimeError, match=info.amx_reason.split(" (")[0]):
            set_quant_isa("amx")


PROMPT = ("Write a short history of the lighthouse keepers of the northern coast. " * 3 + " ".join(
    f"In year {1800 + 7 * i} the keeper of light {i % 5} logged {3 * i % 11} ships, a storm "
    f"from the {['north', 'east', 'south', 'west'][i % 4]}, and oil for {i % 9 + 2} nights."
    for i in range(24)))


def test_greedy_output_is_the_same_at_every_level_here(auto_after: None) -> None:
    """The bundled model's greedy tokens after a ~900-token prompt (prefilled in 512-token
    steps: the many-row products and the prefill attention over earlier chunks' keys) at the
    levels that serve by default here and at AVX2 (AMX's tile products included where the CPU
    has them): the products' integer sums and their float sequence are the same at every level,
    the attention float32 FMAs at the vector levels and split bf16 tiles (near float32) at amx.
    (The opt-in
    avx512bf16 level is not among them: its bf16 rounding moved the 6th of these 24 tokens, a
    digit, 38 -> 39.)"""
    from tailserve import LLM, SamplingParams

    best = set_quant_isa("auto")
    levels = [lv for lv in ("amx", "avx512vnni", "avx2") if QUANT_ISAS[lv] <= QUANT_ISAS[best]
              and (lv != "amx" or best == "amx")]
    llm = LLM(None, enable_prefix_caching=False, max_num_batched_tokens=512,
              slo_itl_ms=None)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    for level in levels:
        set_quant_isa(level)
        out = llm.generate(PROMPT, params)[0]
        outputs[level] = out.outputs[0].token_ids
    assert len(out.prompt_token_ids) > 512  # two prefill steps
    first = outputs[levels[0]]
    assert all(tokens == first for tokens in outputs.values()), outputs


def _vendor() -> str:
    with open("/proc/cpuinfo") as f:
        return next(ln for ln in f if ln.startswith("vendor_id")).split(":", 1)[1].strip()


def test_the_weight_prefetch_is_the_cpus_and_changes_no_answer() -> None:
    """The decode rows' weight prefetch (csrc/isa.h) defaults by vendor, L2 8 KiB ahead on
    Intel (measured on the Xeon with AMX) and L1 4 KiB elsewhere (as tuned on Zen); either
    way the products are bit for bit the same, tiled Q4_0 and stored Q4_K, at 1 and 3 rows
    (and 40: the prefill rows' first pass prefetches too). A bad setting is refused by name."""
    default = set_weight_prefetch("auto")
    try:
        assert default == ("l2:8192" if _vendor() == "GenuineIntel" else "l1:4096")
        assert isa_info().weight_prefetch == default
        op = torch.ops.tailserve.quant_linear
        for qtype in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_K):
            w = tile_blocks(random_blocks(PACKED_FORMATS[qtype], 64, 2048, seed=1))
            for rows in (1, 3, 40):
                x = torch.randn(rows, 2048, generator=torch.Generator().manual_seed(rows))
                got = {}
                for spec in ("l1:4096", "l2:8192", "l2:0"):
                    assert set_weight_prefetch(spec) == spec
                    got[spec] = op(x, w, None)
                first = got["l1:4096"]
                assert all(torch.equal(first, y) for y in got.values()), (qtype, rows)
        for bad in ("l3:64", "l2:-1", "l2:2000000", "L2:64", "fast"):
            with pytest.raises(ValueError, match="TAILSERVE_WEIGHT_PREFETCH"):
                set_weight_prefetch(bad)
    finally:
        set_weight_prefetch("auto")
