"""What one step still has to give while the scheduler builds it: tokens, time, and what has
been handed out. The scheduler's phases (``engine/step_phases.py``) each take from one
``StepBudget`` in turn: running decodes, then partial prefills and admissions in the waiting
policy's order; the output phase turns what was taken into a ``SchedulerOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tailserve.data.step import BlockedReason
from tailserve.stepcost import StepShape


@dataclass
class StepBudget:
    # Tokens the step may still carry (max_num_batched_tokens at the start).
    tokens: int
    # The step's time (the scheduler's clock when it began building).
    now: float
    # What the step's predicted time may reach (None: not sized by time).
    target_s: float | None = None
    # The smallest slack (next token's deadline - now) among the decodes taken; None: none
    # of them holds an ITL SLO.
    min_slack_s: float | None = None
    # The step as the step-time model sees it, grown with every decode and chunk taken.
    shape: StepShape = field(default_factory=StepShape)
    # request_id -> tokens it gets in this step.
    num_new: dict[str, int] = field(default_factory=dict)
    # Requests preempted while building this step (their blocks are already freed).
    preempted: list[str] = field(default_factory=list)
    # Requests left part-way through their prompt after this step (max_num_partial_prefills).
    partial_ids: set[str] = field(default_factory=set)
    # Why the waiting queue's head was held back (the first reason found), and whether later
    # waiting requests may still be admitted (strict order keeps the aging bound).
    blocked_by: BlockedReason | None = None
    admitting: bool = True
    # The tenants present when the step began (``TenantShares.present``).
    present: set[str | None] = field(default_factory=set)
    # Tenants whose prompt (or recompute) completes in this step: it gives them a token.
    completing_tenants: set[str | None] = field(default_factory=set)

    @property
    def shared(self) -> bool:
        """More than one tenant is present: another tenant's prompt may arrive into this
        step's time."""
        return len(self.present) > 1

    def take_decode(self, request_id: str, context: int) -> None:
        """One decode token of a request whose context (computed tokens + 1) is ``context``."""
        self.num_new[request_id] = 1
        self.tokens -= 1
        self.shape = self.shape.plus_decode(context)

    def take_chunk(self, request_id: str, start: int, n: int) -> None:
        """``n`` prompt tokens of a request after ``start`` computed ones."""
        self.num_new[request_id] = n
        self.tokens -= n
        self.shape = self.shape.plus_chunk(start, n)

    def note(self, reason: BlockedReason) -> None:
        """Record ``reason`` unless an earlier one was found; admission goes on."""
        self.blocked_by = self.blocked_by or reason

    def stop_admitting(self, reason: BlockedReason, overwrite: bool = True) -> None:
        """No later waiting request is admitted in this step."""
        self.blocked_by = reason if overwrite else (self.blocked_by or reason)
        self.admitting = False
