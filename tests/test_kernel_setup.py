"""``make setup``'s kernel step (``python -m tailserve.kernels``) and when the kernels are
required: a failed build fails setup and the kernel tests where a C++ compiler runs; without
one, setup warns and succeeds (the engine serves on its torch paths)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tailserve.kernels import cpu_ops_required, cxx_compiler

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture
def fake_cxx(tmp_path: Path) -> str:
    """A "compiler" that answers --version and fails every compile: a broken build."""
    path = tmp_path / "fake-c++"
    path.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "fake c++ 1.0"; exit 0; }\n'
                    'echo "fake c++: cannot compile" >&2\nexit 1\n')
    path.chmod(0o755)
    return str(path)


def build_kernels(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The setup step in a fresh cache, so it has to build."""
    # The host's own switches would decide for the test (.ci/run sets the first).
    drop = ("TAILSERVE_REQUIRE_CPU_KERNELS", "TAILSERVE_CPU_KERNELS")
    full = {k: v for k, v in os.environ.items() if k not in drop}
    full.update(PYTHONPATH=SRC, TAILSERVE_KERNEL_CACHE=str(tmp_path / "cache"), **env)
    return subprocess.run([sys.executable, "-m", "tailserve.kernels"], env=full,
                          capture_output=True, text=True, timeout=300)


def test_without_a_compiler_setup_warns_and_succeeds(tmp_path: Path) -> None:
    done = build_kernels(tmp_path, CXX="/bin/false")
    assert done.returncode == 0, done.stderr
    assert "tailserve CPU kernels: NOT available" in done.stderr
    assert "WARNING: the engine will run its slower torch fallbacks" in done.stderr
    assert "Install a C++ compiler" in done.stderr


def test_where_a_compiler_runs_a_failed_build_fails_setup(tmp_path: Path, fake_cxx: str) -> None:
    done = build_kernels(tmp_path, CXX=fake_cxx)
    assert done.returncode == 1
    assert f"they are required here (C++ compiler {fake_cxx})" in done.stderr


def test_required_by_the_environment_fails_setup_without_a_compiler(tmp_path: Path) -> None:
    done = build_kernels(tmp_path, CXX="/bin/false", TAILSERVE_REQUIRE_CPU_KERNELS="1")
    assert done.returncode == 1
    assert "they are required here (TAILSERVE_REQUIRE_CPU_KERNELS=1)" in done.stderr


def test_cpu_ops_required(monkeypatch: pytest.MonkeyPatch, fake_cxx: str) -> None:
    monkeypatch.delenv("TAILSERVE_REQUIRE_CPU_KERNELS", raising=False)
    monkeypatch.delenv("TAILSERVE_CPU_KERNELS", raising=False)
    monkeypatch.setenv("CXX", "/bin/false")  # on PATH, but not a compiler
    assert cxx_compiler() is None and not cpu_ops_required()
    monkeypatch.setenv("TAILSERVE_REQUIRE_CPU_KERNELS", "1")
    assert cpu_ops_required()
    monkeypatch.delenv("TAILSERVE_REQUIRE_CPU_KERNELS")
    monkeypatch.setenv("CXX", fake_cxx)
    assert cxx_compiler() == fake_cxx and cpu_ops_required()
    monkeypatch.setenv("TAILSERVE_CPU_KERNELS", "0")  # turned off on purpose: not required
    assert not cpu_ops_required()
