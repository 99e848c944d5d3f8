"""Waiting-queue policies: where a waiting request sits, in what order the prefill budget
serves requests, and whom preemption picks. One interface, one class per policy
(``--scheduling-policy``): ``fcfs``, ``priority`` and ``deadline`` (earliest deadline first,
``DeadlineQueue``). The scheduler asks the policy and never branches on its name.
"""

from __future__ import annotations

import heapq
import itertools
import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Sequence
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


# How many times a late request's served prefill time counts in its key. Above 1 its key
# outruns the clock while it is served, so a prompt that arrives on time during a late one's
# prefill goes first however late that one was (at 1 the key only kept pace with the clock: a
# short prompt arriving 12 s after a late 3,900-token one still waited 750 ms behind its chunks,
# the quiet run of 2026-12-04 07:46); at 2 the late request still gets at least half of the
# prefill time while on-time prompts keep arriving, since each second it is served moves its key
# two seconds on.
LATE_SERVED_WEIGHT = 2.0


def late_yield_s(req: Request, idle_prefill_s: float) -> float:
    """How much later a request that can no longer meet its deadline is keyed: its TTFT SLO,
    or its whole prompt's prefill alone (``idle_prefill_s``) when that is longer. The
    deadline policy's key and the scheduler's overdue-queue rule share it."""
    return max(req.slo.ttft_s or 0.0, idle_prefill_s)


class DeadlineQueue(FCFSQueue):
    """Earliest deadline first: the prefill budget goes to the request whose next token is
    due first (``Request.next_token_deadline``: arrival + its TTFT SLO for a first token; a
    preempted request that already streamed is due by its ITL SLO). EDF meets every deadline
    that any order would meet when the load allows it, and with one SLO for all it is
    arrival order.

    A request that can no longer meet its deadline (``now`` + its own remaining prefill,
    predicted as one step, is past it) yields: its key moves later by the larger of its TTFT
    SLO and its whole prompt's prefill alone (``yield_s``), behind those that still can, best
    effort after them. Its key is ``arrival + TTFT SLO + yield_s`` plus the time of the steps
    that have carried its prompt so far (``timestamps.prefill_time``, counted
    ``LATE_SERVED_WEIGHT`` times): it moves only while the
    request is being served, and every key is at least its request's arrival, so a request
    that gets no tokens is passed by nothing that arrives after its key: the starvation bound
    (``starvation_bound``). It scales with the request's own size: a prompt that needs 4 s
    alone may be passed for ~4 s, not one SLO. With one SLO's yield, short prompts that
    arrived more than an SLO after a 4,000-token prompt waited for all of it (3-12 s behind
    three of them, issue 29's long-mix run of 2026-12-03); without the served time, those that
    arrived more than its own prefill time after it waited behind each of its chunks, 8-32
    tokens a step beside it, 465-760 ms against a median of 87 (the quiet run of 2026-12-04
    00:31), though the long prompt was progressing all along. Preemption takes the running
    request with the most slack (the newest admission among equals).
    """

    def __init__(self, own_prefill_s: Callable[[Request], float],
                 idle_prefill_s: Callable[[Request], float]) -> None:
        super().__init__("fcfs")
        self._own_prefill_s = own_prefill_s
        self._idle_prefill_s = idle_prefill_s

    def yield_s(self, req: Request) -> float:
        return late_yield_s(req, self._idle_prefill_s(req))

    def starvation_bound(self, req: Request) -> float | None:
        """The latest key the request can have until it is served again (None without a
        deadline)."""
        due = req.next_token_deadline()
        if due is None:
            return None
        return due + self.yield_s(req) + LATE_SERVED_WEIGHT * req.timestamps.prefill_time

    def deadline(self, req: Request, now: float) -> float:
        """The request's key: its next token's deadline; when it can no longer meet it, that
        plus its yield and the time it has been prefilled; a request without an SLO is due at
        its arrival."""
        due = req.next_token_deadline()
        if due is None:
            return req.arrival_time
        if now + self._own_prefill_s(req) > due:
            due += self.yield_s(req) + LATE_SERVED_WEIGHT * req.timestamps.prefill_time
        return due

    def prefill_key(self, req: Request, index: int, now: float) -> tuple[float, ...]:
        return (self.deadline(req, now), float(index))

    def victim(self, candidates: Sequence[Request], now: float) -> Request:
        def slack(r: Request) -> float:
            due = r.next_token_deadline()
            return math.inf if due is None else due - now

        return max(candidates, key=lambda r: (slack(r), r.admit_seq))


def make_waiting_queue(policy: str, prefill_order: PrefillOrder, aging_s_per_token: float,
                       own_prefill_s: Callable[[Request], float],
                       idle_prefill_s: Callable[[Request], float]) -> WaitingQueue:
    """The queue of ``--scheduling-policy``; ``own_prefill_s`` predicts a request's remaining
    prefill alone (the deadline policy's feasibility test), ``idle_prefill_s`` its whole
    prompt's (how far a late request yields)."""
    if policy == "deadline":
        return DeadlineQueue(own_prefill_s, idle_prefill_s)
    if policy == "priority":
        return PriorityQueue(prefill_order, aging_s_per_token)
    return FCFSQueue(prefill_order, aging_s_per_token)
