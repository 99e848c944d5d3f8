"""The ranks of a tensor-parallel engine, as the model runner sees them.

Rank 0 is the engine (scheduler, sampling, outputs); ranks 1..T-1 run the same forward on
their shards. Three process groups:

- the default group (gloo on CPU, NCCL on CUDA) carries the all-reduces inside the forward,
  with a timeout: a rank that dies mid-step fails the step instead of hanging it;
- a gloo group carries the start-up collectives (the barrier after every rank built its
  runner, the KV pool's size), with the same timeout: a rank that hangs while loading fails
  start-up with the ranks named (``describe_ranks``), it does not hold the others for days;
- a gloo group carries each step's inputs from rank 0: a fixed header, then one int64 tensor
  of the scheduled sequences (what ``ModelRunner._prepare`` reads), so every rank flattens the
  same batch with the same code. Its timeout is long: a worker waits in it while the engine
  is idle; a dead engine closes the connection, which ends the wait at once.

Only token ids, positions and block ids cross, never sampling state: only rank 0 samples.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tailserve.data.step import ScheduledRequest, SchedulerOutput
from tailserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# A step's header: [op, number of sequences, payload length]; ops:
_STEP, _STOP = 1, 2
_HEADER = 3
# Per sequence in the payload: num_computed_tokens, len(token_ids), len(block_ids), is_prefill,
# sample; then its token ids and block ids.
_PER_SEQ = 5
IDLE_TIMEOUT = timedelta(days=7)
_GREEDY = SamplingParams(temperature=0.0)  # workers never sample; a placeholder


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel engine failed (not a user mistake: the engine stops)."""


def _failed(exc: RuntimeError) -> TensorParallelError:
    # gloo / NCCL messages carry source paths and peer addresses: reported by type only.
    return TensorParallelError(f"a tensor-parallel rank failed during a step "
                               f"({type(exc).__name__}); the engine stops")


@dataclass
class TensorParallelGroup:
    """This process's place among the ranks, after ``init_process_group``."""

    rank: int
    world_size: int
    device: torch.device
    step_group: dist.ProcessGroup  # gloo: step inputs
    startup_group: dist.ProcessGroup  # gloo, bounded by ``timeout``: start-up collectives
    timeout: timedelta
    # Rank 0: raises when a worker has exited (checked before each step is sent).
    check_workers: Callable[[], None] | None = None
    # Rank 0: what each worker is doing (or how it ended), for a failed start-up collective.
    describe_ranks: Callable[[], str] | None = None

    @classmethod
    def init(cls, rank: int, world_size: int, init_method: str, device: torch.device,
             timeout: timedelta) -> TensorParallelGroup:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout)
        startup_group = dist.new_group(backend="gloo", timeout=timeout)
        step_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        assert step_group is not None and startup_group is not None
        return cls(rank, world_size, device, step_group, startup_group, timeout)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (``RowParallelLinear``)."""
        try:
            dist.all_reduce(x)
        except RuntimeError as exc:  # a peer died: its connection closed
            raise _failed(exc) from exc
        return x

    def all_agree(self, ok: bool) -> bool:
        """True on every rank when every rank passes ``ok`` (a start-up barrier that also
        says whether some rank failed)."""
        flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
        self._startup_all_reduce(flag, dist.ReduceOp.SUM,
                                 "the start-up barrier (every rank's runner built)")
        return int(flag.item()) == 0

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` of all ranks (the KV bytes every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        self._startup_all_reduce(t, dist.ReduceOp.MIN, "sizing the KV pool (every rank's "
                                 "measurement)")
        return int(t.item())

    def _startup_all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType,
                            what: str) -> None:
        try:
            dist.all_reduce(t, op=op, group=self.startup_group)
        except RuntimeError as exc:  # a rank hung (the timeout) or died (a closed connection)
            waited = self.timeout.total_seconds()
            ranks = self.describe_ranks() if self.describe_ranks is not None else (
                "rank 0 (the engine) or another worker did not arrive")
            raise TensorParallelError(
                f"tensor-parallel start-up failed at {what} on rank {self.rank} after waiting "
                f"up to {waited:g} s (TAILSERVE_TP_TIMEOUT_S; raise it if a rank is only "
                f"slow): {ranks}") from exc

    # -------------------------------------------------------------- rank 0 -> workers
    def send_step(self, scheduled: list[ScheduledRequest]) -> None:
        if self.check_workers is not None:
            self.check_workers()
        fields: list[int] = []
        for s in scheduled:
            fields += [s.num_computed_tokens, len(s.token_ids), len(s.block_ids),
                       int(s.is_prefill), int(s.sample)]
            fields += s.token_ids
            fields += s.block_ids
        payload = torch.tensor(fields, dtype=torch.int64)
        self._broadcast(torch.tensor([_STEP, len(scheduled), payload.numel()],
                                     dtype=torch.int64))
        self._broadcast(payload)

    def send_stop(self) -> None:
        self._broadcast(torch.tensor([_STOP, 0, 0], dtype=torch.int64))

    def recv_step(self) -> SchedulerOutput | None:
        """A worker's next step, as a ``SchedulerOutput`` that flattens exactly as rank 0's
        did (None: stop)."""
        header = torch.empty(_HEADER, dtype=torch.int64)
        self._broadcast(header)
        op, num_seqs, length = header.tolist()
        if op == _STOP:
            return None
        payload = torch.empty(length, dtype=torch.int64)
        self._broadcast(payload)
        values = payload.tolist()
        scheduled = []
        i = 0
        for n in range(num_seqs):
            computed, num_tokens, num_blocks, is_prefill, sample = values[i:i + _PER_SEQ]
            i += _PER_SEQ
            tokens = values[i:i + num_tokens]
            i += num_tokens
            blocks = values[i:i + num_blocks]
            i += num_blocks
            scheduled.append(ScheduledRequest(
                request_id=str(n), token_ids=tokens, num_computed_tokens=computed,
                block_ids=blocks, sample=bool(sample), is_prefill=bool(is_prefill),
                sampling_params=_GREEDY, prompt_token_ids=(), output_token_ids=(),
                eos_token_ids=(),
            ))
        prefill = sum(len(s.token_ids) for s in scheduled if s.is_prefill)
        return SchedulerOutput(scheduled, num_prefill_tokens=prefill,
                               num_decode_seqs=sum(not s.is_prefill for s in scheduled))

    def _broadcast(self, t: torch.Tensor) -> None:
        try:
            if self.rank == 0:
                # The sender is bounded by ``timeout``: a send to a worker killed between the
                # liveness check and this step usually fails at once, but now and then the
                # connection is not yet seen closed and the send waited out the group's
                # IDLE_TIMEOUT (a test run hung there). Workers wait unbounded: for rank 0.
                work = dist.broadcast(t, src=0, group=self.step_group, async_op=True)
                if work is not None:
                    work.wait(timeout=self.timeout)
            else:
                dist.broadcast(t, src=0, group=self.step_group)
        except RuntimeError as exc:
            raise _failed(exc) from exc

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
