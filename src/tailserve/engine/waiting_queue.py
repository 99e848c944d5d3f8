"""The waiting queue of the scheduler: FCFS or by priority."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from tailserve.request import Request


class WaitingQueue:
    """FCFS (a deque; preempted requests return to the front) or priority (a heap on
    ``(priority, arrival_time)``: lower value first, as vLLM orders it)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._deque: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._deque) if self.policy == "fcfs" else len(self._heap)

    def push(self, req: Request, front: bool = False) -> None:
        if self.policy == "fcfs":
            if front:
                self._deque.appendleft(req)
            else:
                self._deque.append(req)
        else:
            heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._seq), req))

    def peek(self) -> Request:
        return self._deque[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> Request:
        return self._deque.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._deque.remove(req)
        else:
            self._heap = [e for e in self._heap if e[3] is not req]
            heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        if self.policy == "fcfs":
            return iter(list(self._deque))
        return iter([e[3] for e in sorted(self._heap)])
