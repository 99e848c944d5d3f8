"""Every environment switch is declared in tailserve/envs.py and read nowhere else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tailserve import envs

SRC = Path(__file__).resolve().parents[1] / "src" / "tailserve"
README = SRC.parents[1] / "README.md"
DOCS = SRC.parents[1] / "docs"
DECLARED = {s.name: s for s in envs.SWITCHES}


def test_every_switch_is_listed_once_with_its_help() -> None:
    module_level = [v for v in vars(envs).values() if isinstance(v, envs.EnvSwitch)]
    assert sorted(s.name for s in module_level) == sorted(DECLARED)
    assert len(DECLARED) == len(envs.SWITCHES)
    for name, switch in DECLARED.items():
        assert getattr(envs, name) is switch  # the attribute is named after the variable
        assert switch.help


def test_nothing_else_in_src_reads_the_environment() -> None:
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.name == "envs.py" and path.parent == SRC:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\benviron\b|\bgetenv\b|\bputenv\b", line):
                offenders.append(f"{path.relative_to(SRC)}:{lineno}: {line.strip()}")
    assert offenders == []


def test_every_variable_named_in_src_and_the_docs_is_declared() -> None:
    named: set[str] = set()
    docs = [README, *DOCS.glob("*.md")]
    for path in [*SRC.rglob("*.py"), *SRC.rglob("*.cpp"), *SRC.rglob("*.h"), *docs]:
        named.update(re.findall(r"\bTAILSERVE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert named - set(DECLARED) == set()
    # The C++ kernels read their own: each is declared with where it is read.
    for path in SRC.rglob("*.cpp"):
        for name in re.findall(r'getenv\("([A-Z0-9_]+)"\)', path.read_text()):
            assert DECLARED[name].read_by == f"kernels/csrc/{path.name}"


def test_get_reads_the_environment_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TAILSERVE_CPU_KERNELS", raising=False)
    assert envs.TAILSERVE_CPU_KERNELS.get() is True
    for off in ("0", "false", "no", "off"):
        monkeypatch.setenv("TAILSERVE_CPU_KERNELS", off)
        assert envs.TAILSERVE_CPU_KERNELS.get() is False
    monkeypatch.setenv("TAILSERVE_CPU_KERNELS", "")  # empty: the default
    assert envs.TAILSERVE_CPU_KERNELS.get() is True
    monkeypatch.setenv("TAILSERVE_TP_TIMEOUT_S", "5")
    assert envs.TAILSERVE_TP_TIMEOUT_S.get() == 5.0
    monkeypatch.setenv("TAILSERVE_API_KEY", "")
    assert envs.TAILSERVE_API_KEY.get() is None


def test_import_sets_a_passive_openmp_unless_the_user_chose() -> None:
    """OpenMP reads OMP_WAIT_POLICY when torch loads it, so ``import tailserve`` sets it first."""
    import os
    import subprocess
    import sys

    code = "import os, tailserve, torch; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "PASSIVE"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "ACTIVE"


def test_path_first_puts_a_directory_first_and_restores_path(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import os

    monkeypatch.setenv("PATH", "/usr/bin")
    with envs.path_first(str(tmp_path)):
        assert os.environ["PATH"].split(os.pathsep) == [str(tmp_path), "/usr/bin"]
    assert os.environ["PATH"] == "/usr/bin"
    monkeypatch.delenv("PATH")
    with envs.path_first(str(tmp_path)):
        assert os.environ["PATH"].split(os.pathsep)[0] == str(tmp_path)
    assert "PATH" not in os.environ
    with envs.path_first(None):
        assert "PATH" not in os.environ
