"""Waiting-queue policies: where a waiting request sits, in what order the prefill budget
serves requests, and whom preemption picks. One interface, one class per policy
(``--scheduling-policy``): ``fcfs``, ``priority`` and ``deadline`` (earliest TTFT deadline
first). The scheduler asks the policy and never branches on its name.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Literal

from tailserve.request import Request

PrefillOrder = Literal["srpt", "fcfs"]


class WaitingQueue(ABC):
    """The requests waiting to be admitted (new ones, and preempted ones back from running).

    ``prefill_key`` orders the prefill budget over running partial prefills and waiting
    requests alike (lowest first); ``index`` is a request's position in the scheduler's list
    (running partial prefills first, then this queue in its own order); ``now`` is the step's
    time. ``victim`` picks whom to preempt among running requests not yet scheduled this step.
    """

    @abstractmethod
    def push(self, req: Request, front: bool = False) -> None: ...

    @abstractmethod
    def remove(self, req: Request) -> None: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def prefill_key(self, req: Request, index: int, now: float) -> tuple[float, ...]: ...

    def victim(self, candidates: Sequence[Request], now: float) -> Request:
        """The newest admission: it has the least work to lose."""
        return max(candidates, key=lambda r: r.admit_seq)


def srpt_place(req: Request, aging_s_per_token: float) -> float:
    """The earliest *place* ``arrival + served + remaining x aging`` (shortest remaining
    prefill first among requests that arrived together; a request is never passed by one that
    arrived after its place, whose key is at least its arrival + one token's aging: that bounds
    its wait). ``served`` is the time of the steps that carried its prompt: a request ages
    while it waits, not while it is being prefilled. Without it a long prompt part-way through
    its prefill had "waited" its own prefill time, its place came before any new arrival's,
    and a 100-token prompt arriving in the last ~20% of a 4,000-token one waited for all of it
    (long-mix). A request that gets no tokens keeps its place, so the bound holds."""
    remaining = req.num_tokens - req.num_computed_tokens
    return req.arrival_time + req.timestamps.prefill_time + remaining * aging_s_per_token


class FCFSQueue(WaitingQueue):
    """Arrival order (a deque; preempted requests return to the front). The prefill budget
    goes by ``srpt_place`` (``srpt``) or in list order (``fcfs``: running first, then queue
    order)."""

    def __init__(self, prefill_order: PrefillOrder = "srpt",
                 aging_s_per_token: float = 2e-3) -> None:
        self.prefill_order = prefill_order
        self.aging_s_per_token = aging_s_per_token
        self._deque: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._deque)

    def push(self, req: Request, front: bool = False) -> None:
        if front:
            self._deque.appendleft(req)
        else:
            self._deque.append(req)

    def remove(self, req: Request) -> None:
        self._deque.remove(req)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._deque))

    def _lead(self, req: Request) -> float:
        return 0.0

    def prefill_key(self, req: Request, index: int, now: float) -> tuple[float, ...]:
        lead = self._lead(req)
        if self.prefill_order == "fcfs":
            return (lead, float(index))
        return (lead, srpt_place(req, self.aging_s_per_token), float(index))


class PriorityQueue(FCFSQueue):
    """By ``(priority, arrival_time)``, lower value first, as vLLM orders it (a heap); the
    priority leads the prefill order too, and preemption takes the lowest priority first."""

    def __init__(self, prefill_order: PrefillOrder = "srpt",
                 aging_s_per_token: float = 2e-3) -> None:
        super().__init__(prefill_order, aging_s_per_token)
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, req: Request, front: bool = False) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._seq), req))

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not req]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter([e[3] for e in sorted(self._heap)])

    def _lead(self, req: Request) -> float:
        return float(req.priority)

    def victim(self, candidates: Sequence[Request], now: float) -> Request:
        return max(candidates, key=lambda r: (r.priority, r.admit_seq))


def make_waiting_queue(policy: str, prefill_order: PrefillOrder,
                       aging_s_per_token: float) -> WaitingQueue:
    """The queue of ``--scheduling-policy``."""
    if policy == "priority":
        return PriorityQueue(prefill_order, aging_s_per_token)
    return FCFSQueue(prefill_order, aging_s_per_token)
