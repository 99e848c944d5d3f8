"""Compiled CPU kernels (``torch.ops.tailserve.*``), built once per machine.

The sources in ``csrc/`` (every ``*.cpp`` and ``*.h`` there, one file per concern) are compiled
with torch's C++ extension tooling the first time they are needed (``make setup`` does it ahead
of time: ``python -m tailserve.kernels``) into a cache directory keyed by what decides the
library (the sources' bytes, flags, torch, compiler and CPU; never the checkout's path), then
loaded as a library of torch ops. Built with ``-march=native``: the cache is per machine, like
the kernels' speed. One process builds a directory at a time, under an OS lock that dies with
its holder, so a build killed midway (Ctrl-C on the first ``tailserve serve``) costs the next
one a rebuild, never a hang (``_build_lock``).

When no C++ compiler is available, or ``TAILSERVE_CPU_KERNELS=0``, ``cpu_ops_available()`` is
False and callers keep their pure-torch paths: every kernel here has a torch equivalent that
the tests compare it against. Where a compiler *is* available a failed build is a bug, not a
fallback: ``cpu_ops_required()`` says so, and setup and the kernel tests fail on it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from tailserve import envs

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]
_lock = threading.Lock()


@dataclass(frozen=True)
class _BuildResult:
    ok: bool
    error: str | None  # why the build or load failed; None when ok


_result: _BuildResult | None = None


def _sources(csrc: Path = _CSRC) -> list[Path]:
    """Every translation unit in csrc/: a new file is built (and hashed) without a list to edit."""
    return sorted(csrc.glob("*.cpp"))


def _headers(csrc: Path = _CSRC) -> list[Path]:
    return sorted(csrc.glob("*.h"))


def _compiler_identity() -> str:
    """What the compiler says it is (``--version``), not where it lives: a new compiler builds
    anew, the same one found through another path does not."""
    found = _compiler()
    return found[1] if found is not None else ""


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux): ``-march=native`` compiles for them, so a cache on a
    home directory shared by different machines keeps one build per kind of CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build_dir(csrc: Path = _CSRC, flags: tuple[str, ...] = tuple(_FLAGS),
               cache_root: Path | None = None) -> Path:
    """The build's directory, keyed by what decides the library and nothing else: the
    sources' names and bytes, the flags, torch (its version and where it is installed), the
    compiler and the CPU. Never by the checkout's path, so two clones of the same sources share
    one build (``_stage``). torch's place is in the key because torch writes its include and
    library paths into build.ninja: two virtual environments sharing one directory rebuilt
    everything in turn (two minutes on two cores), and a server started by the other one's
    tests was not healthy within three minutes."""
    digest = hashlib.sha256()
    for path in _sources(csrc) + _headers(csrc):
        digest.update(path.name.encode())  # a rename or a new file changes the key too
        digest.update(path.read_bytes())
    torch_home = str(Path(torch.__file__).resolve().parent)
    for part in (" ".join(flags), torch.__version__, torch_home, _compiler_identity(),
                 _cpu_flags()):
        digest.update(b"\0" + part.encode())
    return (cache_root or _cache_root()) / "kernels" / digest.hexdigest()[:16]


def _stage(csrc: Path, build_dir: Path) -> list[Path]:
    """Copies of the sources inside the build directory, to build from: torch writes each
    source's absolute path into build.ninja, so building from the checkout made two clones
    with the same sources (one key) rebuild everything in turn. A copy is written only when
    missing or different (its mtime would rebuild it), through a rename (a build killed
    mid-copy leaves no half file)."""
    staged = build_dir / "src"
    staged.mkdir(parents=True, exist_ok=True)
    for path in _sources(csrc) + _headers(csrc):
        data = path.read_bytes()
        target = staged / path.name
        if target.exists() and target.read_bytes() == data:
            continue
        tmp = target.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)
    return [staged / path.name for path in _sources(csrc)]


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold the build directory (one builder at a time, across processes) with an OS lock the
    kernel releases when its holder dies, however it dies. Under it, a torch ``lock`` file
    (its FileBaton: torch waits, without bound, while one exists) is a leftover of a build
    stopped midway (Ctrl-C, a kill): removed, or every later build would hang on it."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "tailserve.flock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("tailserve CPU kernels: waiting for another process building them in %s",
                     build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            baton = build_dir / "lock"
            if baton.exists():
                log.warning("tailserve CPU kernels: removing %s, left by a build that was "
                            "stopped midway; building again", baton)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ninja_bin_dir() -> str | None:
    """The directory of the ``ninja`` package's binary (a dependency), or None without it."""
    try:
        import ninja
    except ImportError:
        return None
    bin_dir = getattr(ninja, "BIN_DIR", None)
    return bin_dir if bin_dir and shutil.which("ninja", path=bin_dir) else None


@contextlib.contextmanager
def _pinned_ninja() -> Iterator[None]:
    """Build with the ``ninja`` package's binary whatever PATH says. torch runs the first
    ``ninja`` on PATH, and ninja versions disagree on the hashes in ``.ninja_log`` (1.11 and
    1.13 do): a library ``make setup`` built through the venv's ninja was built again in full
    (two minutes on two cores) by the first ``tailserve serve`` or ``pytest`` whose PATH found
    the system's, and again by the next setup. PATH is process-wide, so it is set only for the
    build, under the build lock and ``_lock``."""
    with envs.path_first(_ninja_bin_dir()):
        yield


def build_library(name: str, csrc: Path = _CSRC, flags: tuple[str, ...] = tuple(_FLAGS),
                  cache_root: Path | None = None) -> Path:
    """Build (or find built) the ops library of ``csrc``'s sources and load it into this
    process; returns its build directory. Raises whatever the build raises."""
    from torch.utils import cpp_extension

    build_dir = _build_dir(csrc, flags, cache_root)
    with _build_lock(build_dir), _pinned_ninja():
        cpp_extension.load(
            name=name,
            sources=[str(s) for s in _stage(csrc, build_dir)],
            extra_cflags=list(flags),
            # libgomp by soname: the copy torch already loaded, one OpenMP runtime.
            extra_ldflags=["-fopenmp"] if "-fopenmp" in flags else [],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    return build_dir


def _cache_root() -> Path:
    """``TAILSERVE_KERNEL_CACHE``, else ``~/.cache/tailserve``."""
    return Path(envs.TAILSERVE_KERNEL_CACHE.get() or Path.home() / ".cache" / "tailserve")


def _enabled() -> bool:
    """``TAILSERVE_CPU_KERNELS=0`` turns the kernels off (the torch paths serve)."""
    return envs.TAILSERVE_CPU_KERNELS.get()


def _required_by_env() -> bool:
    """``TAILSERVE_REQUIRE_CPU_KERNELS=1`` (set by ``.ci/run``): a missing build is an error."""
    return envs.TAILSERVE_REQUIRE_CPU_KERNELS.get()


def _compiler() -> tuple[str, str] | None:
    """The C++ compiler torch's tooling would build with (``$CXX``, else ``c++``) and its
    ``--version``, if it runs."""
    cxx = envs.CXX.get() or "c++"
    path = shutil.which(cxx)
    if path is None:
        return None
    try:
        done = subprocess.run([path, "--version"], capture_output=True, check=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return path, done.stdout


def cxx_compiler() -> str | None:
    """The C++ compiler torch's tooling would build with (``$CXX``, else ``c++``), if it runs."""
    found = _compiler()
    return found[0] if found is not None else None


def cpu_ops_required() -> bool:
    """Whether the kernels must build here: asked for by the environment, or a C++ compiler
    runs on this host (then a failed build is a bug to report, never a silent fallback).
    ``TAILSERVE_CPU_KERNELS=0`` without the environment's demand means not required."""
    return _required_by_env() or (_enabled() and cxx_compiler() is not None)


def cpu_ops_error() -> str | None:
    """Why the kernels are not available (after ``cpu_ops_available()`` returned False)."""
    if not _enabled():
        return "turned off by TAILSERVE_CPU_KERNELS=0"
    return _result.error if _result is not None else None


# TAILSERVE_QUANT_ISA names -> the levels of csrc/isa.h (set_quant_isa). "amx" (what "auto"
# chooses where the CPU, Linux and the build allow it): VNNI's kernels with the tiled GGUF
# products on AMX int8 tiles (VNNI's integer sums and float sequence, bit for bit) and the
# prefill attention of long chunks on split bf16 tiles (near float32); refused with the reason
# elsewhere.
# amx-bf16 (opt-in, never "auto"): those products on AMX bf16 tiles (weights dequantized to bf16
# per call, x rounded to bf16) and the prefill attention on AMX bf16 tiles: the fastest
# prompts, not VNNI's answers.
# avx512bf16 (opt-in, never "auto"): the VNNI products, with the prefill attention's QK^T and PV
# on vdpbf16ps (1.2-1.3x the attention; its rounding moves near-tied greedy tokens).
QUANT_ISAS = {"auto": -1, "scalar": 0, "avx2": 1, "avx512": 2, "avx512vnni": 3, "avx512bf16": 4,
              "amx": 5, "amx-bf16": 6}


def set_quant_isa(name: str) -> str:
    """The instruction set of the packed-GGUF products, the attention kernels and the 16-bit
    dots (``QUANT_ISAS``; csrc/isa.h); returns the one in use. A level this CPU lacks is an
    error (the op names the best it has, or why AMX cannot serve)."""
    if name not in QUANT_ISAS:
        raise ValueError(f"TAILSERVE_QUANT_ISA={name!r}: expected one of {', '.join(QUANT_ISAS)}")
    level = int(torch.ops.tailserve.set_quant_isa(QUANT_ISAS[name]))
    return _isa_name(level)


def set_weight_prefetch(spec: str) -> str:
    """How far ahead, and into which cache, the decode rows prefetch their weights
    (``TAILSERVE_WEIGHT_PREFETCH``; csrc/isa.h): ``auto`` (this CPU's default), ``l1:BYTES`` or
    ``l2:BYTES``. Returns the one in use, in the same form. Answers never change with it."""
    cache, _, ahead = spec.partition(":")
    if spec == "auto":
        got = torch.ops.tailserve.set_weight_prefetch(-1, False)
    elif cache in ("l1", "l2") and ahead.isdigit() and int(ahead) <= 1 << 20:
        got = torch.ops.tailserve.set_weight_prefetch(int(ahead), cache == "l2")
    else:
        raise ValueError(f"TAILSERVE_WEIGHT_PREFETCH={spec!r}: expected auto, l1:BYTES or "
                         f"l2:BYTES with BYTES from 0 to {1 << 20}")
    return _prefetch_name(*got)


def _prefetch_name(ahead: int, l2: bool) -> str:
    return f"{'l2' if l2 else 'l1'}:{int(ahead)}"


def _isa_name(level: int) -> str:
    return next(k for k, v in QUANT_ISAS.items() if v == level)


@dataclass(frozen=True)
class IsaInfo:
    """What csrc/isa.h chose and found: the level in use and the best one, whether the 16-bit
    dots run AVX512-BF16, and the AMX probe (CPUID, the OS's tile state, Linux's permission)."""

    level: str
    best: str  # what "auto" chooses
    supported: str  # the highest level this CPU and build accept (avx512bf16 is opt-in)
    avx512bf16: bool  # the 16-bit panels' dot (linear16.cpp) runs vdpbf16ps
    amx_cpu: bool  # CPUID: AMX-TILE and AMX-INT8
    amx_bf16: bool  # CPUID: AMX-BF16
    amx_os: bool  # XCR0 enables tile state
    amx_permitted: bool  # arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) granted
    amx_reason: str | None  # why AMX is not usable here; None when it is
    weight_prefetch: str  # the decode rows' weight prefetch, "l2:8192" (TAILSERVE_WEIGHT_PREFETCH)


def isa_info() -> IsaInfo:
    """The kernels' instruction sets (after ``cpu_ops_available()`` returned True)."""
    level, best, supported, bf16, cpu, amx_bf16, os_ok, permitted, reason = (
        torch.ops.tailserve.isa_info())
    return IsaInfo(_isa_name(int(level)), _isa_name(int(best)), _isa_name(int(supported)),
                   bool(bf16), bool(cpu), bool(amx_bf16), bool(os_ok), bool(permitted),
                   str(reason) or None, _prefetch_name(*torch.ops.tailserve.weight_prefetch()))


def _log_isa() -> None:
    info = isa_info()
    amx = ("AMX tile products" + ("" if info.level == "amx" else " available, not in use")
           if info.supported == "amx" else f"no AMX: {info.amx_reason or 'not built'}")
    log.info("tailserve CPU kernels: level %s (auto %s, up to %s), AVX512-BF16 16-bit dots %s; "
             "%s; weights prefetched %s", info.level, info.best, info.supported,
             "on" if info.avx512bf16 else "off", amx, info.weight_prefetch)


def cpu_ops_available() -> bool:
    """Build (first time on this machine) and load the CPU kernels; False if they cannot be."""
    global _result
    if not _enabled():
        return False
    with _lock:
        if _result is not None:
            return _result.ok
        try:
            build_library("tailserve_cpu_ops")
            _result = _BuildResult(ok=True, error=None)
        except Exception as exc:  # no compiler, headers or ninja: the torch paths still work
            log.warning("tailserve CPU kernels unavailable, using torch fallbacks: %s", exc)
            _result = _BuildResult(ok=False, error=f"{type(exc).__name__}: {exc}")
        if _result.ok:  # outside the try: a bad TAILSERVE_QUANT_ISA is the user's to fix
            set_quant_isa(envs.TAILSERVE_QUANT_ISA.get())
            set_weight_prefetch(envs.TAILSERVE_WEIGHT_PREFETCH.get())
            _log_isa()
        return _result.ok
