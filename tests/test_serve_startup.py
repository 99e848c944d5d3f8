"""``tailserve serve`` start-up mistakes end in one clear line on stderr and a non-zero exit,
before an engine loads a model for nothing: a model path that does not exist (exit 2, a usage
error), a port another process listens on (exit 1). A GGUF truncated mid-tensor is the
loader's to name (test_loader.py); the engine process passes its text through unchanged.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from server_util import free_port


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    # A bound for the harness: each of these fails in seconds (no model is loaded).
    return subprocess.run([sys.executable, "-m", "tailserve.cli", "serve", *args],
                          capture_output=True, text=True, timeout=120)


def error_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


def test_a_model_path_that_does_not_exist(tmp_path: Path) -> None:
    done = serve(str(tmp_path / "no-such-model"), "--port", str(free_port()))
    assert done.returncode == 2, done.stderr
    (line,) = error_lines(done)
    assert "no-such-model' does not exist" in line and ".gguf" in line, line
    assert "Traceback" not in done.stderr


def test_a_port_in_use() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = serve("--host", "127.0.0.1", "--port", str(port))  # the bundled model
    assert done.returncode == 1, done.stderr
    (line,) = error_lines(done)
    assert line == (f"error: cannot listen on 127.0.0.1:{port} (--host / --port): "
                    "Address already in use"), line
    # Refused before the engine started (it used to load the model, print the URL, then fail).
    assert "engine" not in done.stderr and "serving" not in done.stdout, done.stderr
