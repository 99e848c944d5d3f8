"""How often requests arrive while the engine is working: the risk a long step poses.

A step without decodes is capped (``step_time.prefill_step_cap``) for one reason: a request
that arrives while it runs waits for all of it. Where nobody arrives while the engine works
(one user, a closed-loop client, a batch job sending one prompt at a time) the cap protects
no one and costs the prompt it cuts: on the bundled model, 2 cores, a lone 1,000-token
prompt took 478 ms in ~100 ms steps and 393 ms in whole-budget ones, a 2,000-token prompt
1,120 ms against 890 (benchmarks/notes/scheduling.md, 2026-12-05).

``ArrivalWatch`` estimates the rate of arrivals that found the engine busy (a request running
or waiting, or a step in flight) per second of the engine's work: both counts decay with wall
time (``DECAY_S``), so the estimate follows the load of the last minute or so. It starts from
a prior of one such arrival per ``PRIOR_BUSY_S`` of work, so that a fresh or long-idle engine
assumes company until it has worked a while alone. Under Poisson arrivals the share of
arrivals that find the engine busy is its busy share, so arrivals-while-busy per busy second
estimates the arrival rate itself; a closed-loop client, which sends its next request only
after the last answer, never arrives while busy and drives it to zero. Torch-free, data in,
data out: the scheduler tells it of arrivals and steps, and asks for the ``rate`` (a step of
T seconds expects rate x T arrivals).
"""

from __future__ import annotations

import math

# Counts decay by e every DECAY_S of wall time: the load of the last ~30-60 s decides.
DECAY_S = 30.0
# The prior: one arrival while busy per PRIOR_BUSY_S of work. Cold, the rate reads 1/s (a
# step of 0.2 s expects 0.2 arrivals); after 2 s of work with nobody arriving, 0.33/s; after
# 5 s, 0.17/s.
PRIOR_BUSY_S = 1.0


class ArrivalWatch:
    def __init__(self, now: float = 0.0) -> None:
        self._t = now
        self.busy_arrivals = 0.0  # arrivals that found the engine busy, decayed
        self.busy_s = 0.0  # seconds of steps, decayed
        self.last_step_end: float | None = None

    def _decay(self, now: float) -> None:
        if now > self._t:
            keep = math.exp(-(now - self._t) / DECAY_S)
            self.busy_arrivals *= keep
            self.busy_s *= keep
            self._t = now

    def arrived(self, arrival_time: float, now: float, engine_busy: bool) -> None:
        """A request was added at ``now``; it arrived at ``arrival_time``. It found the
        engine busy if requests were there, or if it came before the latest step ended
        (it waited for that step, even if the step finished everyone)."""
        self._decay(now)
        stepping = self.last_step_end is not None and arrival_time < self.last_step_end
        if engine_busy or stepping:
            self.busy_arrivals += 1.0

    def stepped(self, now: float, step_s: float) -> None:
        """A step of ``step_s`` seconds ended at ``now``."""
        self._decay(now)
        self.busy_s += max(step_s, 0.0)
        self.last_step_end = now

    def rate(self, now: float) -> float:
        """Arrivals while busy per second of work, with the prior (per second)."""
        self._decay(now)
        return (self.busy_arrivals + 1.0) / (self.busy_s + PRIOR_BUSY_S)
