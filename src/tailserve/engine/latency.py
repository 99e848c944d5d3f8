"""Step time budgets from the requests' SLOs, and predicted time to first token.

**A step's time budget** (``step_time_budget``): each running decode's next token is due at
its last token's time + its ITL SLO (``Request.next_token_deadline``); a step may take the
smallest slack among the decodes it carries (deadline - now), less a margin of
``SLACK_SIGMAS`` robust deviations of the step-time model's own error (``sigma_s``) and
``SLACK_FLOOR_S`` for the host's time between steps. Prefill takes what that leaves, all of
it. A step without decodes is capped by the ITL SLO itself (less the margin): that is what
a decode would allow right after its token, and what a prompt arriving meanwhile waits; never
below ten times the step's fixed cost (``step_time.prefill_step_cap``).

**Chunks** (``time_limited_chunk``): the largest multiple of PREFILL_ALIGN, else one of
SMALL_CHUNKS, that keeps the step's predicted time within its budget.

**Predicted TTFT** (``predict_ttft``): a new request waits for the prefill of everyone the
scheduler serves before it (running partial prefills and waiting requests that come first
in the waiting policy's ``prefill_key`` order) and then its own, in chunks of the size the
running decodes leave under their budget. With ``--enable-slo-admission`` a prediction over
the request's TTFT SLO is refused at once (429 with ``Retry-After``); one that even an idle
engine could not meet is a 400 (also without it, when the request brought its own TTFT SLO).
Torch-free, like the scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tailserve.errors import SLORefusedError, SLOUnattainableError
from tailserve.request import Request
from tailserve.stepcost import StepShape, StepTimeModel

# Time-limited prefill chunks are multiples of PREFILL_ALIGN tokens, unless a chunk is the
# rest of its prompt; when not even PREFILL_ALIGN fits beside the decodes (a chunk late in a
# long prompt, whose attention reads its whole context), the largest of SMALL_CHUNKS that
# does. A 32-token chunk late in a 900-token prompt took 30 ms beside one decode (of 4 ms)
# where 8 tokens took 12 (benchmarks/notes/peers.md): with 32 as the only small size, the steps of
# a long prompt's last chunks were 3-7x a decode-only step whatever the target said. Below 8
# tokens a step's fixed cost outweighs its prefill and a prompt would take hundreds of steps.
PREFILL_ALIGN = 32
SMALL_CHUNKS = (16, 8)
MIN_PREFILL_CHUNK = SMALL_CHUNKS[-1]


# The margin a step's budget keeps below the smallest slack: SLACK_SIGMAS robust deviations of
# the step-time model's error (1.25 x its mean absolute residual: ~2.4 standard deviations of
# a normal error, ~1% of steps over), and SLACK_FLOOR_S for what happens between two steps
# (the token's way out, the next schedule), ~1 ms here. Never more than MAX_MARGIN_SHARE of the
# slack: on a host shared with busy processes the model's deviation reached 173 ms, a margin
# of 350 ms that left no 100 ms SLO any prefill: every prompt crawled in 8-24-token steps of
# 70-90 ms, and first tokens took tens of seconds while the ITL was missed anyway.
SLACK_SIGMAS = 2.0
SLACK_FLOOR_S = 2e-3
MAX_MARGIN_SHARE = 0.25


def slack_margin_s(model: StepTimeModel) -> float:
    return SLACK_SIGMAS * model.sigma_s + SLACK_FLOOR_S


def step_time_budget(model: StepTimeModel, min_slack_s: float) -> float:
    """The time a step may take when the tightest decode it carries has ``min_slack_s``
    left before its next token is due."""
    return min_slack_s - min(slack_margin_s(model), MAX_MARGIN_SHARE * abs(min_slack_s))


def is_decode(r: Request) -> bool:
    """A running request whose next step is one decode: one token left and past its prompt.
    (A prompt with one token left is a 1-token prefill chunk, counted as prefill in the
    step's stats, so the step-time model sees the same shape it was asked to predict.)"""
    return r.num_tokens - r.num_computed_tokens == 1 and r.num_output_tokens > 0


def decode_shape(running: Sequence[Request]) -> StepShape:
    """The decodes of the running batch, as the next step will carry them."""
    shape = StepShape()
    for r in running:
        if is_decode(r):
            shape = shape.plus_decode(r.num_tokens)
    return shape


def time_limited_chunk(model: StepTimeModel, shape: StepShape, start: int, n: int,
                       target_s: float, first_chunk: bool) -> int:
    """The most of ``n`` prompt tokens (after ``start``) a step already holding ``shape`` may
    add within ``target_s``: a multiple of PREFILL_ALIGN, else one of SMALL_CHUNKS, else (0)
    nothing. The step's first chunk always gets something, so prefill progresses: the
    smallest chunk when the decodes alone fit the target (the step stays nearest to it), and
    PREFILL_ALIGN when they alone exceed it (a fixed target filled by many decodes: no chunk
    size can meet it, so the prompt at least moves at a useful pace)."""
    fit = model.max_chunk(shape, start, n, target_s, PREFILL_ALIGN)
    if fit:
        return fit
    for size in SMALL_CHUNKS:
        if size < n and model.predict(shape.plus_chunk(start, size)) <= target_s:
            return size
    if not first_chunk:
        return 0
    floor = MIN_PREFILL_CHUNK if model.predict(shape) < target_s else PREFILL_ALIGN
    return min(n, floor)


def chunk_under_load(model: StepTimeModel, budget: int, step_budget_s: float | None,
                     decode: StepShape, prefill_cap_s: float | None = None) -> int:
    """The prefill tokens a step carries next to ``decode`` (as ``schedule`` sizes them, for
    a chunk at the start of a prompt), ``step_budget_s`` the step's budget with ``decode``;
    with no decodes, ``prefill_cap_s`` (``step_time.prefill_step_cap``)."""
    left = max(budget - decode.decode_seqs, 1)
    target = step_budget_s if decode.decode_seqs else prefill_cap_s
    if target is None:
        return left
    return time_limited_chunk(model, decode, 0, left, target, first_chunk=True)


def predict_ttft(model: StepTimeModel, budget: int, step_budget_s: float | None,
                 running: Sequence[Request], ahead: Sequence[Request],
                 req: Request, prefill_cap_s: float | None = None) -> tuple[float, float]:
    """(predicted TTFT now, predicted TTFT on an idle engine) of ``req``, which waits for
    the rest of every prompt in ``ahead``; ``step_budget_s`` is the budget of a step carrying
    the running decodes, ``prefill_cap_s`` the most a step without decodes may take."""
    own = req.num_prompt_tokens
    idle = model.prefill_time(own, 0, StepShape(),
                              chunk_under_load(model, budget, None, StepShape(), prefill_cap_s))
    decode = decode_shape(running)
    chunk = chunk_under_load(model, budget, step_budget_s, decode, prefill_cap_s)
    t = model.prefill_time(own, 0, decode, chunk)
    for r in ahead:
        t += model.prefill_time(r.num_tokens - r.num_computed_tokens, r.num_computed_tokens,
                                decode, chunk)
    return t, idle


def check_slo(req: Request, slo_s: float, predicted: float, idle: float, num_waiting: int,
              num_running: int, refuse: bool) -> None:
    """400 when even an idle engine misses ``slo_s``; with ``refuse``, 429 when the queue
    ahead makes the prediction miss it."""
    if idle > slo_s:
        raise SLOUnattainableError(
            f"the prompt's {req.num_prompt_tokens} tokens are predicted to take "
            f"{idle * 1e3:.0f} ms to prefill even on an idle engine, over the TTFT SLO "
            f"of {slo_s * 1e3:g} ms: shorten the prompt or raise the SLO",
            param="prompt",
        )
    if refuse and predicted > slo_s:
        # The queue ahead should have drained by then (and the SLO be met again).
        retry = max(1.0, math.ceil(predicted - slo_s))
        raise SLORefusedError(
            f"predicted time to first token {predicted * 1e3:.0f} ms exceeds the TTFT SLO "
            f"of {slo_s * 1e3:g} ms ({num_waiting} waiting, {num_running} running; "
            f"{idle * 1e3:.0f} ms of it is this prompt's own prefill); retry in {retry:.0f} s",
            predicted_ttft_s=predicted, retry_after_s=retry,
        )
