"""Every environment variable tailserve reads, declared once: name, type, default, purpose.

Nothing else in ``src/`` touches ``os.environ``; code reads a switch with ``envs.NAME.get()``,
which looks at the environment at that moment (so tests can set one with monkeypatch). An
unset or empty variable means the default.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def _flag(raw: str) -> bool:
    return raw.strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvSwitch(Generic[T]):
    name: str
    default: T
    parse: Callable[[str], T]
    help: str
    # Where it is read when not through get(): the C++ kernels read theirs themselves.
    read_by: str = "python"

    def get(self) -> T:
        raw = os.environ.get(self.name)
        return self.default if not raw else self.parse(raw)


TAILSERVE_API_KEY: EnvSwitch[str | None] = EnvSwitch(
    "TAILSERVE_API_KEY", None, str,
    "serve: the API key when --api-key is not given; bench: the key after $OPENAI_API_KEY",
)
OPENAI_API_KEY: EnvSwitch[str | None] = EnvSwitch(
    "OPENAI_API_KEY", None, str,
    "bench: the Bearer key when --api-key is not given (as the openai client reads it)",
)
TAILSERVE_KERNEL_CACHE: EnvSwitch[str | None] = EnvSwitch(
    "TAILSERVE_KERNEL_CACHE", None, str,
    "where the compiled CPU kernels are cached (default: ~/.cache/tailserve)",
)
TAILSERVE_CPU_KERNELS: EnvSwitch[bool] = EnvSwitch(
    "TAILSERVE_CPU_KERNELS", True, _flag,
    "0/false/no/off: never build or use the compiled CPU kernels (the torch paths run)",
)
TAILSERVE_REQUIRE_CPU_KERNELS: EnvSwitch[bool] = EnvSwitch(
    "TAILSERVE_REQUIRE_CPU_KERNELS", False, _flag,
    "1: a CPU-kernel build failure is an error even without a C++ compiler on PATH "
    "(.ci/run sets it, so the fast path is never silently skipped)",
)
CXX: EnvSwitch[str | None] = EnvSwitch(
    "CXX", None, str,
    "the C++ compiler torch's extension builder uses for the CPU kernels (default: c++)",
)
TAILSERVE_KERNEL_SPIN_US: EnvSwitch[int] = EnvSwitch(
    "TAILSERVE_KERNEL_SPIN_US", 200, int,
    "microseconds the CPU kernels' workers spin after a job before sleeping (0: never spin)",
    read_by="kernels/csrc/work_pool.cpp",
)
TAILSERVE_CPU_BF16_DOT: EnvSwitch[bool] = EnvSwitch(
    "TAILSERVE_CPU_BF16_DOT", True, _flag,
    "0/false/no/off: bfloat16 weights are widened to float32 in registers even on a CPU with "
    "AVX512-BF16 (default: its vdpbf16ps dot product, on activations rounded to bfloat16)",
    read_by="kernels/csrc/linear16.cpp",
)
TAILSERVE_QUANT_ISA: EnvSwitch[str] = EnvSwitch(
    "TAILSERVE_QUANT_ISA", "auto", str,
    "the instruction set of the packed-GGUF kernels, the attention kernels and the 16-bit dots "
    "(kernels/csrc/isa.h): auto (amx where the CPU, Linux and the build allow it, else the "
    "best this CPU has up to avx512vnni), amx (VNNI's kernels with the tiled GGUF products of "
    "16+ rows on AMX int8 tiles, bit for bit VNNI's products, and the prefill attention of "
    "long chunks on split bf16 tiles, near float32: 1.5-2.2x the float32 attention; refused with "
    "the reason where unavailable), amx-bf16 (opt-in: those products and the prefill "
    "attention on AMX bf16 tiles, ~2x each, not VNNI's answers: near-tied greedy tokens may "
    "move), avx512bf16 "
    "(opt-in: the prefill attention on bf16 dots, 1.2-1.3x faster on Zen 4, near-tied greedy "
    "tokens may move), avx512vnni, avx512, avx2 or scalar (to compare paths, or to test the "
    "AVX2 one on an AVX512 machine)",
)
TAILSERVE_WEIGHT_PREFETCH: EnvSwitch[str] = EnvSwitch(
    "TAILSERVE_WEIGHT_PREFETCH", "auto", str,
    "how far ahead, and into which cache, the decode rows' kernels prefetch the weights they "
    "stream from memory (kernels/csrc/isa.h): auto (this CPU's: l2:8192 on Intel, l1:4096 "
    "elsewhere), or l1:BYTES / l2:BYTES (to compare; BYTES 0 to 1048576)",
)
CUDA_VISIBLE_DEVICES: EnvSwitch[str | None] = EnvSwitch(
    "CUDA_VISIBLE_DEVICES", None, str,
    "CUDA's device renumbering; the memory monitor maps torch's index to NVML's through it",
)
OMP_WAIT_POLICY: EnvSwitch[str] = EnvSwitch(
    "OMP_WAIT_POLICY", "PASSIVE", str,
    "OpenMP's idle threads; tailserve sets PASSIVE (they sleep) when it is unset, as "
    "`import tailserve` runs and before torch loads: the few torch ops a step still runs on "
    "OpenMP must not spin against the CPU kernels' own work pool on the same cores",
    read_by="the OpenMP runtime, when torch loads it",
)
TAILSERVE_TEST_SWEEP: EnvSwitch[bool] = EnvSwitch(
    "TAILSERVE_TEST_SWEEP", False, _flag,
    "tests only: run the slow `tailserve plan --sweep` test (it starts servers)",
)
TRITON_INTERPRET: EnvSwitch[bool] = EnvSwitch(
    "TRITON_INTERPRET", False, _flag,
    "1: Triton runs its kernels in its interpreter (numpy, on CPU tensors); tailserve's "
    "Triton kernels then compute in float32, which the interpreter does exactly (tests); "
    "Triton itself reads it too, when a kernel is defined",
)
TAILSERVE_TP_TIMEOUT_S: EnvSwitch[float] = EnvSwitch(
    "TAILSERVE_TP_TIMEOUT_S", 120.0, float,
    "tensor parallelism: seconds a rank waits for the others at start-up (a worker's start "
    "and model load included) and inside a step's all-reduce before the engine fails (a dead "
    "worker usually fails it at once)",
)

SWITCHES: tuple[EnvSwitch[Any], ...] = (
    TAILSERVE_API_KEY, OPENAI_API_KEY, TAILSERVE_KERNEL_CACHE, TAILSERVE_CPU_KERNELS,
    TAILSERVE_REQUIRE_CPU_KERNELS, CXX, TAILSERVE_KERNEL_SPIN_US, TAILSERVE_CPU_BF16_DOT,
    TAILSERVE_QUANT_ISA, TAILSERVE_WEIGHT_PREFETCH, CUDA_VISIBLE_DEVICES, OMP_WAIT_POLICY,
    TAILSERVE_TEST_SWEEP,
    TRITON_INTERPRET, TAILSERVE_TP_TIMEOUT_S,
)


def apply_process_defaults() -> None:
    """Set the variables that only count when set before torch is imported (the OpenMP
    runtime reads them as torch loads it); a value the user set is kept. Measured on the 2-core
    Zen 5 host: PASSIVE vs OpenMP's default spin, 16 mixed requests, 1.19x output tok/s (two
    rounds each, load ~4), same single-stream TPOT (benchmarks/notes/cpu_kernels.md)."""
    if not os.environ.get(OMP_WAIT_POLICY.name):
        os.environ[OMP_WAIT_POLICY.name] = OMP_WAIT_POLICY.default


@contextlib.contextmanager
def path_first(directory: str | None) -> Iterator[None]:
    """Put ``directory`` first on PATH for the body, then restore PATH as it was (unset stays
    unset); ``None`` changes nothing. PATH is process-wide, so callers hold a lock across it."""
    before = os.environ.get("PATH")
    if directory is not None:
        os.environ["PATH"] = os.pathsep.join([directory, before or os.defpath])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before
