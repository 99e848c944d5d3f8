"""kernels/csrc/isa.h, the one place the kernels ask which instructions to run: the level in
use, whether the 16-bit dots run AVX512-BF16, and the AMX probe (CPUID, the OS's tile state,
Linux's tile permission) with its reason where AMX cannot serve."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tailserve.kernels import QUANT_ISAS, _log_isa, isa_info, set_quant_isa

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
    assert info.avx512bf16 == ("avx512_bf16" in FLAGS and QUANT_ISAS[best] >= QUANT_ISAS["avx512"])
    if QUANT_ISAS[best] >= QUANT_ISAS["avx2"]:
        assert set_quant_isa("avx2") == "avx2"
        info = isa_info()
        # forced below AVX512, the 16-bit dots leave vdpbf16ps too: one switch for every kernel
        assert (info.level, info.best, info.avx512bf16) == ("avx2", best, False)


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
    if info.amx_permitted:  # no tile kernel ships: the level is refused with that reason
        assert info.amx_os and info.amx_reason is None
        with pytest.raises(RuntimeError, match="no AMX tile kernels are built"):
            set_quant_isa("amx")
    else:  # the OS or Linux's permission said no, and the reason says which
        assert info.amx_reason is not None
        assert "XCR0" in info.amx_reason or "arch_prctl" in info.amx_reason
        with pytest.raises(RuntimeError, match=info.amx_reason.split(" (")[0]):
            set_quant_isa("amx")
