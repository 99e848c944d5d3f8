"""A fake model runner: isolates the scheduler and block manager from torch.

Its "model" draws the next token as a pure function of the request's known tokens, so any
lost, duplicated or reordered token (say, across a preemption) changes the output.
"""

from __future__ import annotations

import zlib

from tailserve.data.step import RunnerOutput, SchedulerOutput

VOCAB = 50
EOS = 0


def next_token(tokens: list[int]) -> int:
    return zlib.crc32(bytes(str(tokens), "ascii")) % (VOCAB - 1) + 1  # never EOS


class FakeRunner:
    def __init__(self) -> None:
        self.steps: list[SchedulerOutput] = []

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.steps.append(sched)
        sampled = {}
        for s in sched.scheduled:
            if s.sample:
                known = list(s.prompt_token_ids) + list(s.output_token_ids)
                # The chunk must end exactly at the last known token.
                assert s.num_computed_tokens + len(s.token_ids) == len(known)
                assert s.token_ids == known[s.num_computed_tokens :]
                sampled[s.request_id] = next_token(known)
        return RunnerOutput(sampled_token_ids=sampled)
