"""Run a real ``tailserve serve`` process on loopback for tests.

    with ServerProcess(["--max-num-seqs", "2"], model=tiny_dir) as srv:
        httpx.get(srv.url + "/health")
    srv.returncode  # after exit

The server is the installed CLI in a child process (its engine in a grandchild), bound to a
free port; its output goes to a log file that a failing test prints.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_health(url: str, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Poll ``url``/health until it answers 200 (True), or until ``proc`` exits or ``timeout``
    seconds pass (False; ``proc.poll()`` tells which)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    return False


class ServerProcess:
    def __init__(
        self,
        args: list[str] | None = None,
        model: str | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 180.0,
        wait_healthy: bool = True,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tailserve.cli", "serve"]
        if model is not None:
            cmd.append(model)
        # Small KV pools: several test servers may be up at once on a 24 GiB machine.
        defaults = ["--kv-cache-memory", "0.25", "--log-level", "warning"]
        self.cmd = [*cmd, "--port", str(self.port), *defaults, *(args or [])]
        self.env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
        self.startup_timeout = startup_timeout
        self.wait_healthy = wait_healthy
        self.proc: subprocess.Popen[bytes] | None = None
        # Closed in __exit__: the server's output outlives any one block of this class.
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix="tailserve-test-", suffix=".log", delete=False
        )
        self.engine_pids: list[int] = []

    def __enter__(self) -> ServerProcess:
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=self.env)
        if self.wait_healthy:
            try:
                self.wait_until_healthy()
            except BaseException:
                # __exit__ does not run when __enter__ raises: stop the server here, or it
                # (and its engine) outlives the test that gave up on it.
                self.__exit__(None, None, None)
                raise
        return self

    def wait_until_healthy(self) -> None:
        assert self.proc is not None
        if wait_for_health(self.url, self.proc, self.startup_timeout):
            self.engine_pids = [
                c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)
            ]
            return
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
        raise RuntimeError(f"server not healthy after {self.startup_timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()[-20000:]

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def leftover_engines(self) -> list[int]:
        return [pid for pid in self.engine_pids if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in self.leftover_engines():
            os.kill(pid, signal.SIGKILL)
        self.log.close()
        os.unlink(self.log.name)


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """One sample's value from Prometheus text (``name`` is the full sample name)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and (labels is None or all(
                sample.labels.get(k) == v for k, v in labels.items()
            )):
                return float(sample.value)
    return None
