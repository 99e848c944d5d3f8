"""The kernel cache under faults: a build killed midway does not hang the next one; the build
is keyed by what the sources say, not where the checkout lives.

Each build runs in a child process (a loaded library stays loaded), on a probe library of one
plain C function (it compiles in well under a second, so the machinery is what is tested: the
real kernels' build is tested by test_cpu_kernels.py). The compiler is the real one behind a
wrapper that logs each compile and, when asked, hangs in it: the honest way to stop a build
midway is to kill it while its compiler runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tailserve.kernels import _build_dir

SRC = str(Path(__file__).resolve().parents[1] / "src")
FLAGS = ("-O0",)
# The harness's bound on a child build (the probe takes a few seconds: importing torch):
# without the fix, the build after a killed one waits on torch's lock file for ever.
BUILD_BOUND_S = 120
PROBE = 'extern "C" int tailserve_probe_answer() {{ return {answer}; }}\n'
CHILD = """
import ctypes, sys
from pathlib import Path
from tailserve.kernels import build_library
d = build_library("tailserve_probe", Path(sys.argv[1]), tuple(sys.argv[3:]), Path(sys.argv[2]))
print(d)
print(ctypes.CDLL(str(d / "tailserve_probe.so")).tailserve_probe_answer())
"""

real_cxx = shutil.which(os.environ.get("CXX") or "c++")
pytestmark = pytest.mark.skipif(real_cxx is None or shutil.which("ninja") is None,
                                reason="needs a C++ compiler and ninja")


@pytest.fixture
def cxx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The real compiler behind a wrapper: a compile is logged to $PROBE_LOG and, with
    $PROBE_HANG set, writes its pid to that file and sleeps instead (a build to kill midway)."""
    path = tmp_path / "bin" / "c++"
    path.parent.mkdir()
    path.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" -c "*)\n'
        '  echo "$*" >> "$PROBE_LOG"\n'
        '  if [ -n "$PROBE_HANG" ]; then\n'
        '    echo $$ > "$PROBE_HANG.tmp"; mv "$PROBE_HANG.tmp" "$PROBE_HANG"\n'
        '    exec sleep 600\n'
        '  fi;;\n'
        "esac\n"
        f'exec {real_cxx} "$@"\n')
    path.chmod(0o755)
    monkeypatch.setenv("CXX", str(path))  # _build_dir below asks the same compiler
    return path


def write_probe(csrc: Path, answer: int) -> Path:
    csrc.mkdir(parents=True, exist_ok=True)
    (csrc / "probe.cpp").write_text(PROBE.format(answer=answer))
    return csrc


def child_env(tmp_path: Path, cxx: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE_")}
    env.update(PYTHONPATH=SRC, CXX=str(cxx), PROBE_LOG=str(tmp_path / "compiles.log"), **extra)
    return env


def child_argv(csrc: Path, cache: Path) -> list[str]:
    return [sys.executable, "-c", CHILD, str(csrc), str(cache), *FLAGS]


def build(tmp_path: Path, cxx: Path, csrc: Path, cache: Path) -> tuple[Path, int, str]:
    """A build in a child: its build directory, the probe's answer, its stderr."""
    done = subprocess.run(child_argv(csrc, cache), env=child_env(tmp_path, cxx),
                          capture_output=True, text=True, timeout=BUILD_BOUND_S)
    assert done.returncode == 0, done.stderr
    build_dir, answer = done.stdout.split()
    return Path(build_dir), int(answer), done.stderr


def compiles(tmp_path: Path) -> int:
    log = tmp_path / "compiles.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_build_killed_midway_does_not_hang_the_next(tmp_path: Path, cxx: Path) -> None:
    csrc, cache = write_probe(tmp_path / "csrc", 41), tmp_path / "cache"
    hung = tmp_path / "compiler-started"
    first = subprocess.Popen(child_argv(csrc, cache),
                             env=child_env(tmp_path, cxx, PROBE_HANG=str(hung)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + BUILD_BOUND_S  # a bound on the harness, not a check
        while not hung.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hung.exists(), "the first build never reached its compiler"
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # python and ninja: Ctrl-C's worst
        first.wait()
        # ninja starts each command in a process group of its own: the hung compiler is
        # not in the one above, and would sleep on for 10 minutes after the test.
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(hung.read_text()), signal.SIGKILL)
    build_dir = _build_dir(csrc, FLAGS, cache)
    assert (build_dir / "lock").exists()  # torch's baton, left behind: the trap

    got_dir, answer, stderr = build(tmp_path, cxx, csrc, cache)
    assert (got_dir, answer) == (build_dir, 41)
    assert "left by a build that was stopped midway" in stderr
    assert not (build_dir / "lock").exists()


def test_clones_share_a_build_and_a_changed_source_builds_anew(tmp_path: Path,
                                                                cxx: Path) -> None:
    cache = tmp_path / "cache"
    clone_a, clone_b = (write_probe(tmp_path / name / "csrc", 41) for name in ("a", "b"))
    dir_a, answer, _ = build(tmp_path, cxx, clone_a, cache)
    assert answer == 41 and compiles(tmp_path) == 1
    # Same sources at another path: the same build, nothing compiled again.
    dir_b, answer, _ = build(tmp_path, cxx, clone_b, cache)
    assert (dir_b, answer) == (dir_a, 41) and compiles(tmp_path) == 1
    # A changed source: a new key, a new build, the new code.
    write_probe(clone_b, 42)
    dir_c, answer, _ = build(tmp_path, cxx, clone_b, cache)
    assert dir_c != dir_a and answer == 42 and compiles(tmp_path) == 2
    # The first build is still there for clone a (no rebuild going back either).
    assert build(tmp_path, cxx, clone_a, cache)[:2] == (dir_a, 41) and compiles(tmp_path) == 2


def test_the_build_runs_the_ninja_package_whatever_path_finds_first(tmp_path: Path,
                                                                    cxx: Path) -> None:
    """Ninja versions hash ``.ninja_log``'s commands differently (1.11 and 1.13 do), so a
    library built by one was built again in full by the other: ``make setup`` put the venv's
    ninja first on PATH, a later ``pytest`` or ``tailserve serve`` found the system's. A decoy
    ninja first on PATH (logging, then running the real one) must never be run."""
    import ninja

    decoy = tmp_path / "decoy" / "ninja"
    decoy.parent.mkdir()
    decoy.write_text('#!/bin/sh\necho "$*" >> "$DECOY_LOG"\n'
                     f'exec {Path(ninja.BIN_DIR) / "ninja"} "$@"\n')
    decoy.chmod(0o755)
    csrc, cache = write_probe(tmp_path / "csrc", 41), tmp_path / "cache"
    env = child_env(tmp_path, cxx, DECOY_LOG=str(tmp_path / "decoy.log"),
                    PATH=os.pathsep.join([str(decoy.parent), os.environ["PATH"]]))
    for _ in range(2):
        done = subprocess.run(child_argv(csrc, cache), env=env, capture_output=True,
                              text=True, timeout=BUILD_BOUND_S)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[1] == "41"
    assert not (tmp_path / "decoy.log").exists()
    assert compiles(tmp_path) == 1


def test_another_torch_install_is_another_build(tmp_path: Path, cxx: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """torch writes its include and library paths into build.ninja, so a second virtual
    environment sharing the key would rebuild the first one's library in turn, for ever."""
    import torch

    csrc, cache = write_probe(tmp_path / "csrc", 41), tmp_path / "cache"
    here = _build_dir(csrc, FLAGS, cache)
    assert _build_dir(csrc, FLAGS, cache) == here  # the key is stable
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert _build_dir(csrc, FLAGS, cache) != here
