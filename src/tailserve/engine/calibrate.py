"""Start-up calibration of the step-time model: a few timed steps of known shape.

The steps run through the real runner on synthetic batches (greedy, so no generator is
drawn from; block ids from the still-empty pool, whose contents the first real request
overwrites), from the cheapest up, and stop once ``budget_s`` is spent: on a slow host the
model starts from fewer points (at least MIN_STEPS) and the online fit does the rest. Two
warm-up steps (mixed, decode-only) come first, untimed: lazy kernel set-up and allocator
growth the first real request would otherwise pay.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from tailserve.data.step import RunnerOutput, ScheduledRequest, SchedulerOutput
from tailserve.sampling_params import SamplingParams
from tailserve.stepcost import StepShape, StepTimeModel

logger = logging.getLogger(__name__)

CALIBRATION_BUDGET_S = 1.0
# (decodes, decode context, prefill chunk, chunk start), cheapest first within each part.
# The first MIN_STEPS determine all five coefficients of the model: three decode-only steps
# whose context per decode differs (base, decode_seqs and decode_context_tokens apart), two
# chunk sizes from the start (prefill_tokens), one chunk deep in a prompt (the attention
# term). The budget may stop the plan after them, never before: with the four cheapest steps
# of the earlier order (two decode-only steps of equal context per decode, no deep chunk) the
# Llama-3.2-3B shape on 2 cores was seeded with 15x the attention cost; the online fit, undoing
# it on a lone 2,000-token prompt's steps, dropped the fixed cost to 0, so the floor under
# steps without decodes (step_time.py) was gone, and the prompt went in 8-16-token steps: 30 s
# instead of 15.
PLAN: tuple[tuple[int, int, int, int], ...] = (
    (1, 64, 0, 0), (0, 0, 32, 0), (16, 256, 0, 0), (8, 512, 0, 0), (0, 0, 128, 0),
    (2, 128, 128, 384),
    (4, 256, 64, 0), (0, 0, 256, 0), (8, 512, 256, 0), (0, 0, 512, 0), (0, 0, 256, 768),
)
MIN_STEPS = 6
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class _Runner(Protocol):
    def execute(self, sched: SchedulerOutput) -> RunnerOutput: ...


def _batch(decodes: int, context: int, chunk: int, start: int, block_size: int,
           num_blocks: int) -> SchedulerOutput | None:
    rows: list[ScheduledRequest] = []
    next_block = 0

    def blocks(tokens: int) -> list[int] | None:
        nonlocal next_block
        need = -(-tokens // block_size)
        if next_block + need > num_blocks:
            return None
        ids = list(range(next_block, next_block + need))
        next_block += need
        return ids

    for i in range(decodes):
        ids = blocks(context)
        if ids is None:
            return None
        prompt = [(7 * i + k) % 97 + 1 for k in range(context)]
        rows.append(ScheduledRequest(f"calibrate-d{i}", prompt[-1:], context - 1, ids, True,
                                     False, _GREEDY, prompt[:-1], prompt[-1:], ()))
    if chunk:
        ids = blocks(start + chunk)
        if ids is None:
            return None
        prompt = [k % 89 + 1 for k in range(start + chunk)]
        rows.append(ScheduledRequest("calibrate-p", prompt[start:], start, ids, True, True,
                                     _GREEDY, prompt, [], ()))
    pairs = chunk * start + chunk * (chunk + 1) // 2
    return SchedulerOutput(rows, num_prefill_tokens=chunk, num_decode_seqs=decodes,
                           num_decode_context_tokens=decodes * context,
                           prefill_attention_pairs=pairs)


def calibrate(runner: _Runner, model: StepTimeModel, block_size: int, num_blocks: int,
              max_tokens: int, max_model_len: int, max_seqs: int,
              budget_s: float = CALIBRATION_BUDGET_S) -> int:
    """Seed ``model`` with timed steps of ``PLAN`` (those that fit the pool, the token budget
    ``max_tokens``, ``max_model_len`` and ``max_seqs`` rows: a CUDA runner's step buffers and
    graphs are sized by max_num_seqs and refuse a wider step); returns how many were timed."""
    shapes: list[StepShape] = []
    times: list[float] = []
    t_warm = time.perf_counter()
    small = min(16, max_model_len)
    mixed = 1 if max_seqs >= 2 else 0  # a decode beside the chunk only where two rows fit
    for warm in (_batch(mixed, small, small, 0, block_size, num_blocks),
                 _batch(1, small, 0, 0, block_size, num_blocks)):
        if warm is not None:
            runner.execute(warm)
    t_start = time.perf_counter()
    for decodes, context, chunk, start in PLAN:
        if len(shapes) >= MIN_STEPS and time.perf_counter() - t_start > budget_s:
            break
        if (decodes + chunk > max_tokens or max(context, start + chunk) > max_model_len
                or decodes + (chunk > 0) > max_seqs):
            continue
        sched = _batch(decodes, context, chunk, start, block_size, num_blocks)
        if sched is None:
            continue
        t0 = time.perf_counter()
        runner.execute(sched)
        times.append(time.perf_counter() - t0)
        shapes.append(StepShape(chunk, decodes, decodes * context, sched.prefill_attention_pairs))
    if shapes:
        model.seed(shapes, times)
    logger.info("step-time model calibrated on %d steps in %.2fs (+%.2fs warm-up): %s",
                len(shapes), time.perf_counter() - t_start, t_start - t_warm,
                ", ".join(f"{k}={v:.3g}" for k, v in model.describe().items()))
    return len(shapes)

