"""Open-loop sending: the arrival schedule, and the loop that sends each request at its time.

A step sends N requests at times drawn *before* it starts from a gamma renewal process
(``arrival_times``), each in its own task (``open_loop``), so a slow server cannot slow the
arrivals: there is no coordinated omission. With ``--max-concurrency`` a request whose time
has come waits for a free slot; either way the lag between its scheduled and actual send is
recorded. bench/step.py runs one step with it; bench/canary.py one step split over two servers.
"""

from __future__ import annotations

import asyncio
import os
from time import perf_counter

import numpy as np

from tailserve.bench import BenchError
from tailserve.bench.client import BenchClient, RequestResult
from tailserve.bench.report import Progress

INF = float("inf")
# --busy-poll: the sender stops sleeping this long before a scheduled send and spins to it, so
# the timer's OS wake-up (up to a millisecond or two late on a busy VM) lands before the send,
# not inside it.
BUSY_POLL_LEAD_S = 0.002
# --busy-poll spins only while at most this many requests are in flight: with more, the event
# loop has reads to serve anyway and a spinner would only take CPU from them (and from a server
# on the same host), so the loop waits in epoll as it does without the option.
BUSY_POLL_MAX_IN_FLIGHT = 4


def arrival_times(n: int, rate: float, burstiness: float,
                  rng: np.random.Generator) -> np.ndarray:
    """Scheduled send times (seconds after the step starts) of ``n`` requests.

    The gaps are gamma distributed with mean 1/rate and shape ``burstiness``: 1 is a Poisson
    process, below 1 burstier, above 1 more regular (gap CV = 1/sqrt(burstiness)); vLLM's
    parametrisation. The first request goes at 0. Unlike vLLM the schedule is not rescaled
    to end at exactly N/rate: rescaling would make every run's mean rate exact by fiat.
    """
    if not rate > 0:
        raise BenchError(f"--request-rate must be > 0 (or inf), got {rate}")
    if not burstiness > 0:
        raise BenchError(f"--burstiness must be > 0, got {burstiness}")
    if rate == INF:
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(0, n - 1))
    return np.concatenate([np.zeros(min(n, 1)), np.cumsum(gaps)])


def _yield_cpu() -> None:
    """One turn of a busy-poll spin: give the CPU to anything waiting for it (the server
    this client just woke up, say). Without it a spinner on a 2-core host with one core
    taken holds its core for a whole scheduler slice (measured: the server waited ~4 ms,
    one 250 Hz tick, for 1% of requests); with it the waiting task runs at once and the
    spin resumes when it is done. A no-op syscall when nothing waits."""
    if _sched_yield is not None:
        _sched_yield()


_sched_yield = getattr(os, "sched_yield", None)


async def open_loop(clients: list[BenchClient], payloads: list[bytes],
                     results: list[RequestResult],
                     max_concurrency: int | None, t0: float, progress: Progress,
                     busy_poll: bool = False) -> None:
    """Send every request at its scheduled time, each in its own task.

    ``busy_poll`` (``--busy-poll``): for low-rate latency measurements on a host where the
    client has a core to itself. Waiting in the event loop, the client pays the OS's wake-up
    latency twice per request: the timer's wake-up before the send and epoll's after the
    response lands. With ``busy_poll`` the sender sleeps until ``BUSY_POLL_LEAD_S`` before a
    send and then spins to it, and while 1 to ``BUSY_POLL_MAX_IN_FLIGHT`` requests are in
    flight a spinner task yields to the loop without ever sleeping: each loop turn then
    polls the sockets with a zero timeout, so a read is taken (and stamped by the client's
    read callback, where it always is) as soon as it arrives. The stamps stay where they are:
    the send stamp right before the write, the first-byte stamp at the read that carried the
    first content. With nothing due and nothing in flight, or more than
    ``BUSY_POLL_MAX_IN_FLIGHT`` in flight, the loop waits in epoll as without the option.
    """
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    next_send = [INF]  # perf_counter time of the next scheduled send, for the progress bar
    in_flight = [0]
    spin_wake = asyncio.Event()  # set when in_flight changes: the parked spinner re-checks

    async def spin() -> None:
        while True:
            if 0 < in_flight[0] <= BUSY_POLL_MAX_IN_FLIGHT:
                # A ready callback makes the next loop turn poll with timeout 0: this
                # process never sleeps while a response it is waiting for can arrive.
                _yield_cpu()
                await asyncio.sleep(0)
            else:
                spin_wake.clear()
                await spin_wake.wait()

    async def one(i: int) -> None:
        try:
            await clients[i].send(payloads[i], results[i], t0)  # per request: a canary's arm
        except asyncio.CancelledError:
            results[i].error_type = "cancelled"
            results[i].error = "the run was interrupted while this request was in flight"
            raise
        finally:
            in_flight[0] -= 1
            spin_wake.set()
            if sem is not None:
                sem.release()
            progress.finished(results[i].success)
            # Just after a response and (if this was the last in flight) long before the
            # next send: the one moment a redraw delays nothing that is measured.
            progress.idle(next_send[0] - perf_counter())

    tasks = []
    watcher = asyncio.create_task(progress.watch())
    spinner = asyncio.create_task(spin()) if busy_poll else None
    try:
        for i, res in enumerate(results):
            due = next_send[0] = t0 + res.scheduled_s
            # A loop, not one sleep: the event loop's timers have millisecond resolution and
            # can fire up to half a millisecond early; a request must never go before its time.
            while (delay := due - perf_counter()) > 0:
                if not busy_poll or in_flight[0] > BUSY_POLL_MAX_IN_FLIGHT:
                    await asyncio.sleep(delay)
                elif delay > BUSY_POLL_LEAD_S:
                    await asyncio.sleep(delay - BUSY_POLL_LEAD_S)
                else:
                    _yield_cpu()
                    await asyncio.sleep(0)  # spin: I/O is still served every turn
            if sem is not None:
                await sem.acquire()
            progress.sent()
            in_flight[0] += 1
            spin_wake.set()
            tasks.append(asyncio.create_task(one(i)))
        next_send[0] = INF
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        # Ctrl-C: stop sending, cancel what is in flight, let the caller report what was sent.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        watcher.cancel()
        if spinner is not None:
            spinner.cancel()
