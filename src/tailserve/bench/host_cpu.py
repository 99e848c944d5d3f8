"""The CPU the server's host gave to other work, for the ``cpu_contention`` cause.

A CPU server slows down when other processes take the cores it computes on: every step, and
so every latency, stretches, and nothing the engine exports says why (its step model sees slow
steps, its gauges look normal). When bench runs on the server's host (a loopback URL), the
observer reads, at each ``/metrics`` sample, three cumulative CPU times from ``/proc``:

- the host's busy time (``/proc/stat``: user, nice, system, irq, softirq and steal; steal is
  time the hypervisor gave to other guests, which is contention too);
- the server's: the process listening on the URL's port and all its descendants (vLLM's
  engine core and tailserve's engine run as children of the HTTP process);
- the client's own: the bench process and its descendants (this observer among them);

and, where the kernel keeps scheduler statistics, how long the server's threads ran and how
long they waited, runnable, for a CPU (``schedstat``): a server whose threads spin while
they wait for each other (OpenMP, tailserve's work pool) keeps its CPU time under contention,
and only that wait shows what it lost.

Per window, what is left of the host's busy time after the server and the client is other
work (analyze/contention.py turns it into each sample's lost time). Elsewhere (another host,
no ``/proc``, a port no process of ours can see) there are no samples, and ``why_not`` says
why, so diagnose can list the cause as one it cannot judge.
"""

from __future__ import annotations

import ipaddress
import os
import time
from typing import Any
from urllib.parse import urlsplit

LOOPBACK_NAMES = ("localhost", "localhost.localdomain")
_LISTEN = "0A"  # /proc/net/tcp's st column for LISTEN


def is_local(base_url: str) -> bool:
    host = urlsplit(base_url if "//" in base_url else f"http://{base_url}").hostname or ""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listening_inodes(port: int, proc: str = "/proc") -> set[str]:
    """The socket inodes listening on ``port`` (IPv4 and IPv6)."""
    out: set[str] = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc, "net", name), encoding="ascii") as f:
                next(f, None)  # the header
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == _LISTEN and \
                            int(cols[1].rsplit(":", 1)[1], 16) == port:
                        out.add(cols[9])
        except OSError:
            continue
    return out


def pid_listening(port: int, proc: str = "/proc") -> int | None:
    """The process that holds the listening socket of ``port``, or None."""
    inodes = listening_inodes(port, proc)
    if not inodes:
        return None
    want = {f"socket:[{i}]" for i in inodes}
    for pid in _pids(proc):
        fd_dir = os.path.join(proc, str(pid), "fd")
        try:
            for fd in os.listdir(fd_dir):
                try:
                    if os.readlink(os.path.join(fd_dir, fd)) in want:
                        return pid
                except OSError:
                    continue
        except OSError:
            continue
    return None


def _pids(proc: str) -> list[int]:
    try:
        return [int(d) for d in os.listdir(proc) if d.isdigit()]
    except OSError:
        return []


def _stat(proc: str, pid: int) -> tuple[int, int] | None:
    """(parent pid, utime + stime in clock ticks) of one process."""
    try:
        with open(os.path.join(proc, str(pid), "stat"), encoding="ascii",
                  errors="replace") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: the fields follow the last ")".
    rest = raw[raw.rfind(")") + 2:].split()
    if len(rest) < 13:
        return None
    return int(rest[1]), int(rest[11]) + int(rest[12])


def trees(roots: list[int], proc: str = "/proc") -> list[tuple[int, list[int]]]:
    """For each root: the CPU ticks of it and all its descendants, and their pids, from one
    pass over ``proc``. A process is counted once, in the first root's tree that holds it (a
    test or harness that starts the server is the server's ancestor: the server's processes
    are not also the client's)."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for pid in _pids(proc):
        st = _stat(proc, pid)
        if st is not None:
            parent[pid], ticks[pid] = st
    out = []
    claimed: set[int] = set()
    for root in roots:
        members = []
        for pid in ticks:
            if pid in claimed:
                continue
            p = pid
            for _ in range(64):  # a process tree is never this deep; a cycle cannot hang us
                if p == root:
                    members.append(pid)
                    break
                p = parent.get(p, 0)
                if p <= 1:
                    break
        claimed.update(members)
        out.append((sum(ticks[p] for p in members), members))
    return out


def run_and_wait_s(pids: list[int], proc: str = "/proc") -> tuple[float, float] | None:
    """Seconds the threads of ``pids`` ran, and waited runnable for a CPU (the scheduler's
    run-queue delay, ``/proc/PID/task/TID/schedstat``); None where the kernel keeps no
    schedstat."""
    ran = waited = 0
    seen = False
    for pid in pids:
        task_dir = os.path.join(proc, str(pid), "task")
        try:
            tids = os.listdir(task_dir)
        except OSError:
            continue
        for tid in tids:
            try:
                with open(os.path.join(task_dir, tid, "schedstat"), encoding="ascii") as f:
                    cols = f.read().split()
                ran, waited, seen = ran + int(cols[0]), waited + int(cols[1]), True
            except (OSError, ValueError, IndexError):
                continue
    return (ran / 1e9, waited / 1e9) if seen else None


def host_ticks(proc: str = "/proc") -> tuple[int, int] | None:
    """(busy, all) clock ticks of the whole host since boot, from /proc/stat's cpu line."""
    try:
        with open(os.path.join(proc, "stat"), encoding="ascii") as f:
            cols = f.readline().split()
    except OSError:
        return None
    if not cols or cols[0] != "cpu" or len(cols) < 9:
        return None
    v = [int(x) for x in cols[1:9]]  # user nice system idle iowait irq softirq steal
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
    return busy, busy + v[3] + v[4]


class HostCpu:
    """``sample(phase)`` at each observer tick; ``result()`` the samples or ``why_not``.

    ``client_pid``: the bench process (the observer's parent), whose tree is the client.
    ``proc``: the /proc to read (tests point it at a fake tree).
    """

    def __init__(self, base_url: str, client_pid: int, proc: str = "/proc") -> None:
        self.proc, self.client_pid = proc, client_pid
        self.samples: list[dict[str, Any]] = []
        self.why_not = ""
        self.server_pid: int | None = None
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.ncpu = os.cpu_count() or 1  # the host's (/proc/stat's cpu line sums them all)
        if not is_local(base_url):
            self.why_not = ("the server is not on this host (its URL is not loopback): run "
                            "bench on the server's host to see the CPU other work took")
            return
        if host_ticks(proc) is None:
            self.why_not = "this host has no /proc/stat to read CPU time from"
            return
        parts = urlsplit(base_url if "//" in base_url else f"http://{base_url}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        self.server_pid = pid_listening(port, proc)
        if self.server_pid is None:
            self.why_not = (f"no process of this user listens on port {port} here (a "
                            "container or another user's server): its CPU time is not "
                            "readable")

    @property
    def active(self) -> bool:
        """Whether there is anything to sample (the server was found on this host)."""
        return self.server_pid is not None

    def sample(self, phase: str) -> None:
        if self.server_pid is None:
            return
        host = host_ticks(self.proc)
        if host is None:
            return
        (server, members), (client, _) = trees([self.server_pid, self.client_pid], self.proc)
        x = {"t": time.time(), "phase": phase, "host_busy_s": host[0] / self.hz,
             "host_all_s": host[1] / self.hz, "server_s": server / self.hz,
             "client_s": client / self.hz, "ncpu": self.ncpu}
        sched = run_and_wait_s(members, self.proc)
        if sched is not None:
            x["server_run_s"], x["server_wait_s"] = sched
        self.samples.append(x)

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"host_cpu_samples": self.samples}
        if self.why_not:
            out["host_cpu_why_not"] = self.why_not
        return out
