"""Predicted time to first token, from the step-time model, for ``--ttft-slo-ms`` admission.

A new request waits for the prefill of everyone the scheduler serves before it (running
partial prefills and waiting requests that come first in the waiting policy's
``prefill_key`` order) and then its own, in chunks of the size the running decodes leave
under the step's ITL target (``step_target_s``). The prediction is refused at once when
over the SLO (429 with ``Retry-After``), and as a 400 when even an idle engine could not
meet it.
Torch-free, like the scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tailserve.config import AUTO_ITL_MIN_MS
from tailserve.errors import SLORefusedError, SLOUnattainableError
from tailserve.request import Request
from tailserve.stepcost import StepShape, StepTimeModel

# Time-limited prefill chunks are multiples of PREFILL_ALIGN tokens, unless a chunk is the
# rest of its prompt; when not even PREFILL_ALIGN fits beside the decodes (a chunk late in a
# long prompt, whose attention reads its whole context), the largest of SMALL_CHUNKS that
# does. A 32-token chunk late in a 900-token prompt took 30 ms beside one decode (of 4 ms)
# where 8 tokens took 12 (benchmarks/RESULTS.md): with 32 as the only small size, the steps of
# a long prompt's last chunks were 3-7x a decode-only step whatever the target said. Below 8
# tokens a step's fixed cost outweighs its prefill and a prompt would take hundreds of steps.
PREFILL_ALIGN = 32
SMALL_CHUNKS = (16, 8)
MIN_PREFILL_CHUNK = SMALL_CHUNKS[-1]


def step_target_s(model: StepTimeModel, decode: StepShape, fixed_s: float | None,
                  factor: float) -> float:
    """The time a step carrying the decodes ``decode`` may take: ``fixed_s`` when given
    (``--itl-target-ms``), else ``factor`` x their predicted decode-only step, at least
    AUTO_ITL_MIN_MS. Relative to the batch actually running, so prefill gets about
    (factor - 1) / factor of every step's time at any concurrency (a fixed target is filled
    by the decodes alone once enough run, and prefill starves at the minimum chunk), and a
    step is at most ~factor x a decode-only step of the same batch: the ITL a decode sees
    while prompts prefill stays within factor x the ITL it sees when none do. The model
    follows the host, so the target follows a host that turns slower."""
    if fixed_s is not None:
        return fixed_s
    return max(factor * model.predict(decode), AUTO_ITL_MIN_MS / 1e3)


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


def chunk_under_load(model: StepTimeModel, budget: int, itl_target_s: float | None,
                     decode: StepShape, prefill_cap_s: float | None = None) -> int:
    """The prefill tokens a step carries next to ``decode`` (as ``schedule`` sizes them, for
    a chunk at the start of a prompt), ``itl_target_s`` the step's target (``step_target_s``
    of ``decode``); with no decodes, ``prefill_cap_s`` (``Scheduler.prefill_step_cap``)."""
    left = max(budget - decode.decode_seqs, 1)
    target = itl_target_s if decode.decode_seqs else prefill_cap_s
    if target is None:
        return left
    return time_limited_chunk(model, decode, 0, left, target, first_chunk=True)


def predict_ttft(model: StepTimeModel, budget: int, itl_target_s: float | None,
                 running: Sequence[Request], ahead: Sequence[Request],
                 req: Request, prefill_cap_s: float | None = None) -> tuple[float, float]:
    """(predicted TTFT now, predicted TTFT on an idle engine) of ``req``, which waits for
    the rest of every prompt in ``ahead``; ``itl_target_s`` is the target of a step carrying
    the running decodes, ``prefill_cap_s`` the most a step without decodes may take."""
    own = req.num_prompt_tokens
    idle = model.prefill_time(own, 0, StepShape(),
                              chunk_under_load(model, budget, None, StepShape(), prefill_cap_s))
    decode = decode_shape(running)
    chunk = chunk_under_load(model, budget, itl_target_s, decode, prefill_cap_s)
    t = model.prefill_time(own, 0, decode, chunk)
    for r in ahead:
        t += model.prefill_time(r.num_tokens - r.num_computed_tokens, r.num_computed_tokens,
                                decode, chunk)
    return t, idle


def check_slo(req: Request, slo_s: float, predicted: float, idle: float, num_waiting: int,
              num_running: int) -> None:
    if idle > slo_s:
        raise SLOUnattainableError(
            f"the prompt's {req.num_prompt_tokens} tokens are predicted to take "
            f"{idle * 1e3:.0f} ms to prefill even on an idle engine, over the TTFT SLO "
            f"of {slo_s * 1e3:.0f} ms (--ttft-slo-ms): shorten the prompt",
            param="prompt",
        )
    if predicted > slo_s:
        # The queue ahead should have drained by then (and the SLO be met again).
        retry = max(1.0, math.ceil(predicted - slo_s))
        raise SLORefusedError(
            f"predicted time to first token {predicted * 1e3:.0f} ms exceeds the TTFT SLO "
            f"of {slo_s * 1e3:.0f} ms ({num_waiting} waiting, {num_running} running; "
            f"{idle * 1e3:.0f} ms of it is this prompt's own prefill); retry in {retry:.0f} s",
            predicted_ttft_s=predicted, retry_after_s=retry,
        )
