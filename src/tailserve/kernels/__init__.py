"""Compiled CPU kernels (``torch.ops.tailserve.*``), built once per machine.

The sources in ``csrc/`` (every ``*.cpp`` and ``*.h`` there, one file per concern) are compiled
with torch's C++ extension tooling the first time they are needed (``make setup`` does it ahead
of time: ``python -m tailserve.kernels``) into a cache directory keyed by the sources and torch
version, then loaded as a library of torch ops. Built with ``-march=native``: the cache is per
machine, like the kernels' speed.

When no C++ compiler is available, or ``TAILSERVE_CPU_KERNELS=0``, ``cpu_ops_available()`` is
False and callers keep their pure-torch paths: every kernel here has a torch equivalent that
the tests compare it against. Where a compiler *is* available a failed build is a bug, not a
fallback: ``cpu_ops_required()`` says so, and setup and the kernel tests fail on it.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import threading
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


def _sources() -> list[Path]:
    """Every translation unit in csrc/: a new file is built (and hashed) without a list to edit."""
    return sorted(_CSRC.glob("*.cpp"))


def _headers() -> list[Path]:
    return sorted(_CSRC.glob("*.h"))


def _build_dir() -> Path:
    digest = hashlib.sha256()
    for path in _sources() + _headers():
        digest.update(path.name.encode())  # a rename or a new file changes the key too
        digest.update(path.read_bytes())
    digest.update(" ".join(_FLAGS).encode())
    digest.update(torch.__version__.encode())
    return _cache_root() / "kernels" / digest.hexdigest()[:16]


def _cache_root() -> Path:
    """``TAILSERVE_KERNEL_CACHE``, else ``~/.cache/tailserve``."""
    return Path(envs.TAILSERVE_KERNEL_CACHE.get() or Path.home() / ".cache" / "tailserve")


def _enabled() -> bool:
    """``TAILSERVE_CPU_KERNELS=0`` turns the kernels off (the torch paths serve)."""
    return envs.TAILSERVE_CPU_KERNELS.get()


def _required_by_env() -> bool:
    """``TAILSERVE_REQUIRE_CPU_KERNELS=1`` (set by ``.ci/run``): a missing build is an error."""
    return envs.TAILSERVE_REQUIRE_CPU_KERNELS.get()


def cxx_compiler() -> str | None:
    """The C++ compiler torch's tooling would build with (``$CXX``, else ``c++``), if it runs."""
    cxx = envs.CXX.get() or "c++"
    path = shutil.which(cxx)
    if path is None:
        return None
    try:
        subprocess.run([path, "--version"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return path


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


# TAILSERVE_QUANT_ISA names -> the levels of set_quant_isa in csrc/quant_linear.cpp.
QUANT_ISAS = {"auto": -1, "scalar": 0, "avx2": 1, "avx512": 2, "avx512vnni": 3}


def set_quant_isa(name: str) -> str:
    """The packed-GGUF kernels' instruction set (``QUANT_ISAS``); returns the one in use.
    A level this CPU lacks is an error (the op names the best it has)."""
    if name not in QUANT_ISAS:
        raise ValueError(f"TAILSERVE_QUANT_ISA={name!r}: expected one of {', '.join(QUANT_ISAS)}")
    level = int(torch.ops.tailserve.set_quant_isa(QUANT_ISAS[name]))
    return next(k for k, v in QUANT_ISAS.items() if v == level)


def cpu_ops_available() -> bool:
    """Build (first time on this machine) and load the CPU kernels; False if they cannot be."""
    global _result
    if not _enabled():
        return False
    with _lock:
        if _result is not None:
            return _result.ok
        try:
            from torch.utils import cpp_extension

            build_dir = _build_dir()
            build_dir.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(
                name="tailserve_cpu_ops",
                sources=[str(s) for s in _sources()],
                extra_cflags=_FLAGS,
                # libgomp by soname: the copy torch already loaded, one OpenMP runtime.
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
            _result = _BuildResult(ok=True, error=None)
        except Exception as exc:  # no compiler, headers or ninja: the torch paths still work
            log.warning("tailserve CPU kernels unavailable, using torch fallbacks: %s", exc)
            _result = _BuildResult(ok=False, error=f"{type(exc).__name__}: {exc}")
        if _result.ok:  # outside the try: a bad TAILSERVE_QUANT_ISA is the user's to fix
            set_quant_isa(envs.TAILSERVE_QUANT_ISA.get())
        return _result.ok
