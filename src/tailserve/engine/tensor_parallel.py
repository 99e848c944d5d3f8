"""Tensor-parallel ranks as processes: rank 0 is the engine, ranks 1..T-1 are workers.

``TensorParallelWorkers`` (rank 0, from ``EngineBuilder.build_engine``) starts one worker
process per extra rank with ``python -m tailserve.engine.tensor_parallel``: a plain
subprocess, because the engine process is itself a daemon and may not have multiprocessing
children. Each worker joins the process group (a file store in a private directory), then
takes rank 0's start-up steps with the same ``EngineBuilder`` (``engine/build.py``): loads the
model, builds its ``ModelRunner`` on its shards, sizes its KV pool exactly as rank 0 does (the
same ``EngineArgs`` resolved the same way; on CUDA the smallest measurement of all ranks),
then runs every step rank 0 broadcasts until told to stop (``model/parallel.py``).

Failure is never a hang: a worker that fails at start-up says so at the start-up barrier; one
that hangs there (loading a model from a stuck disk) fails it after ``TAILSERVE_TP_TIMEOUT_S``,
every start-up collective being bounded by it, with each worker's last reported phase named
(``describe``: the workers write it in the group's private directory); one that exits later is
seen before the next step is sent (``check``) or by the step's collective (gloo reports a
closed connection at once; otherwise ``TAILSERVE_TP_TIMEOUT_S``). A worker exits when its
engine does (the closed connection, or its parent's pid changing).

The CPU threads are split between the ranks: ``torch.get_num_threads() // T`` each.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

import torch

from tailserve import envs
from tailserve.config import EngineArgs, UnsizedEngineConfig
from tailserve.model.parallel import TensorParallelError, TensorParallelGroup

__all__ = ["TensorParallelError", "TensorParallelWorkers", "worker_main"]

log = logging.getLogger(__name__)


def threads_per_rank(tensor_parallel_size: int) -> int:
    return max(1, torch.get_num_threads() // tensor_parallel_size)


def _device(unsized: UnsizedEngineConfig, rank: int) -> torch.device:
    return torch.device("cuda", rank) if unsized.runner.device == "cuda" else torch.device("cpu")


class TensorParallelWorkers:
    """Rank 0's handle on the worker processes and the process group they share."""

    def __init__(self, args: EngineArgs, unsized: UnsizedEngineConfig) -> None:
        if torch.distributed.is_initialized():
            raise TensorParallelError(
                "one tensor-parallel engine per process (torch.distributed has one default "
                "group): close the other first (LLM.engine.close())")
        world = args.tensor_parallel_size
        self.threads = threads_per_rank(world)
        self._dir = tempfile.mkdtemp(prefix="tailserve-tp-")
        init_method = f"file://{os.path.join(self._dir, 'store')}"
        payload = json.dumps(dataclasses.asdict(args))
        self.processes = [
            subprocess.Popen([
                sys.executable, "-m", "tailserve.engine.tensor_parallel", payload, str(rank),
                str(world), init_method, str(self.threads), str(os.getpid()),
                logging.getLevelName(logging.getLogger().getEffectiveLevel()), self._dir,
            ])
            for rank in range(1, world)
        ]
        self._closed = False
        self.group: TensorParallelGroup | None = None
        atexit.register(self.shutdown)
        self._threads_before = torch.get_num_threads()  # given back at shutdown (LLM users)
        torch.set_num_threads(self.threads)
        log.info("tensor parallel: %d ranks (workers pid %s), %d CPU thread(s) each", world,
                 ", ".join(str(p.pid) for p in self.processes), self.threads)
        timeout = envs.TAILSERVE_TP_TIMEOUT_S.get()
        try:
            self.group = TensorParallelGroup.init(
                0, world, init_method, _device(unsized, 0), timedelta(seconds=timeout))
        except Exception as exc:
            ranks = self.describe()  # before the kill below rewrites their exit codes
            self.shutdown(graceful=False)
            if torch.distributed.is_initialized():  # half made: the next engine may try again
                torch.distributed.destroy_process_group()
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise TensorParallelError(
                f"the tensor-parallel ranks did not meet (waited up to {timeout:g} s, "
                f"TAILSERVE_TP_TIMEOUT_S): {ranks} ({first})") from None
        self.group.check_workers = self.check
        self.group.describe_ranks = self.describe

    def check(self) -> None:
        """Raise when a worker has exited (called before each step is sent)."""
        for rank, proc in enumerate(self.processes, 1):
            code = proc.poll()
            if code is not None:
                raise TensorParallelError(
                    f"tensor-parallel worker rank {rank} exited with code {code}; "
                    "the engine stops")

    def describe(self) -> str:
        """Each worker's state, for a failed start-up: its exit code, else the phase it last
        reported (``_report``)."""
        parts = []
        for rank, proc in enumerate(self.processes, 1):
            code = proc.poll()
            if code is not None:
                parts.append(f"worker rank {rank} exited with code {code}")
                continue
            try:
                with open(_phase_path(self._dir, rank)) as f:
                    phase = f.read()
            except OSError:
                phase = "starting (it had not reached the process group)"
            parts.append(f"worker rank {rank} (pid {proc.pid}) was {phase}")
        return "; ".join(parts) + "; the engine stops"

    def ready(self, ok: bool) -> None:
        """The start-up barrier after every rank built its runner (or failed to)."""
        assert self.group is not None
        try:
            agreed = self.group.all_agree(ok)
        except TensorParallelError as exc:
            if ok:
                raise
            # Rank 0 failed itself: its own error is the one to report, raised by the caller.
            log.warning("tensor parallel: %s", exc)
            return
        if not agreed and ok:
            raise TensorParallelError("a tensor-parallel worker failed at start-up "
                                      "(its log says why)")

    def shutdown(self, timeout_s: float = 10.0, graceful: bool = True) -> None:
        """Stop the workers (idempotent): a stop message, then a kill after ``timeout_s``;
        ``graceful=False`` (start-up failed, the ranks may be in different calls): a kill."""
        if self._closed:
            return
        self._closed = True
        group = self.group
        if not graceful:
            for proc in self.processes:
                proc.kill()
        elif group is not None and all(p.poll() is None for p in self.processes):
            try:
                group.send_stop()
            except Exception as exc:  # a worker went away meanwhile: the kill below
                log.warning("tensor parallel: stop message failed: %s", exc)
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if group is not None:
            group.destroy()
        shutil.rmtree(self._dir, ignore_errors=True)
        torch.set_num_threads(self._threads_before)
        atexit.unregister(self.shutdown)


def _phase_path(status_dir: str, rank: int) -> str:
    return os.path.join(status_dir, f"rank{rank}.phase")


def _report(status_dir: str, rank: int, phase: str) -> None:
    """Write what this worker is doing now, for rank 0's ``describe`` (through a rename:
    rank 0 reads a whole phase or the one before)."""
    path = _phase_path(status_dir, rank)
    with open(path + ".tmp", "w") as f:
        f.write(phase)
    os.replace(path + ".tmp", path)


def _watch_parent(parent: int) -> None:
    """Exit when the engine (our parent) is gone, whatever this rank is waiting in."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(1.0)


def worker_main(args_json: str, rank: int, world: int, init_method: str, threads: int,
                parent: int, status_dir: str) -> int:
    from tailserve.engine.build import EngineBuilder

    # The engine decides when to stop (it drains first): Ctrl-C to the group is not ours.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(threads)
    args = EngineArgs(**json.loads(args_json))
    # The steps rank 0 takes (engine/build.py), each reported as this worker's phase.
    builder = EngineBuilder(args, rank=rank,
                            report=lambda phase: _report(status_dir, rank, phase))
    runner_config = args.resolve_runner(builder.platform)
    device = torch.device("cuda", rank) if runner_config.device == "cuda" else torch.device("cpu")
    _report(status_dir, rank, "joining the process group")
    group = TensorParallelGroup.init(rank, world, init_method, device,
                                     timedelta(seconds=envs.TAILSERVE_TP_TIMEOUT_S.get()))
    try:
        loaded = builder.load(with_tokenizer=False)
        unsized = builder.resolve(loaded)
        runner = builder.build_runner(loaded, unsized, group)
        del loaded  # the runner copied its shards; the whole checkpoint can go
        ok = True
    except Exception:
        log.exception("tensor-parallel worker rank %d failed at start-up", rank)
        ok = False
    _report(status_dir, rank, "waiting at the start-up barrier")
    try:
        if not group.all_agree(ok):
            return 1
        # A profiling forward (CUDA) is a collective: the same one as rank 0's.
        config = builder.size(runner, unsized)
    except TensorParallelError as exc:  # the engine hung or went away: nothing to serve
        log.error("tensor-parallel worker rank %d: %s", rank, exc)
        return 1
    builder.allocate(runner, config)
    _report(status_dir, rank, "serving")
    log.info("tensor-parallel worker rank %d/%d ready: %d KV blocks", rank, world,
             config.cache.num_kv_blocks)
    while (sched := group.recv_step()) is not None:
        runner.execute_worker(sched)
    group.destroy()
    return 0


if __name__ == "__main__":
    logging.basicConfig(
        level=sys.argv[7], format=f"%(asctime)s tp-rank{sys.argv[2]} %(levelname)s "
        "%(name)s: %(message)s")
    sys.exit(worker_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                         int(sys.argv[5]), int(sys.argv[6]), sys.argv[8]))
