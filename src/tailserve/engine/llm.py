"""LLM: the offline API. ``LLM(model=None, **engine_args).generate(prompts, params)``."""

from __future__ import annotations

import gc
import itertools
import typing
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tailserve.config import EngineArgs, check_removed_args
from tailserve.data.step import StepStats
from tailserve.engine.core import EngineCore
from tailserve.engine.input_processor import (
    InputProcessor,
    Message,
    ParentRequest,
    Prompt,
    PromptType,
)
from tailserve.engine.output_processor import OutputProcessor
from tailserve.errors import InvalidRequestError
from tailserve.model.loader import LoadedModel
from tailserve.outputs import RequestOutput
from tailserve.request import Request, RequestStatus
from tailserve.sampling_params import SamplingParams


class LLM:
    """Batch generation with continuous batching. A prompt is a string or
    ``{"prompt_token_ids": [...]}``; ``sampling_params`` is one for all or one per prompt."""

    def __init__(self, model: str | None = None, *, keep_checkpoint: bool = False,
                 **engine_args: Any) -> None:
        """``keep_checkpoint``: keep the loaded tensors in ``engine.loaded.weights`` after
        the runner is built (by default they go: the runner holds what it serves)."""
        check_removed_args(engine_args)
        self._setup(EngineArgs(model=model, **engine_args), None, keep_checkpoint)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, **engine_args: Any) -> LLM:
        """An LLM over weights already in memory (several engines, one load)."""
        check_removed_args(engine_args)
        llm = cls.__new__(cls)
        llm._setup(EngineArgs(model=loaded.source, **engine_args), loaded)
        return llm

    def _setup(self, args: EngineArgs, loaded: LoadedModel | None,
               keep_checkpoint: bool = False) -> None:
        self.engine_args = args
        self._engine: EngineCore | None = EngineCore.from_args(
            args, loaded, keep_checkpoint=keep_checkpoint)
        tokenizer = self.engine.loaded.tokenizer
        if tokenizer is None:
            raise ValueError("LLM needs a tokenizer: load the model with with_tokenizer=True")
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(self.tokenizer, self.engine.config.request_limits)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        # Recent per-step statistics, for tools that want to look at what the engine did.
        self.step_stats: deque[StepStats] = deque(maxlen=100_000)

    @property
    def engine(self) -> EngineCore:
        if self._engine is None:
            raise RuntimeError("this LLM is closed: build a new one to generate again")
        return self._engine

    def close(self) -> None:
        """Release the engine's memory now (the KV pool, weights, CUDA graphs) rather than
        when the garbage collector finds its reference cycles: a second engine built in the
        same process sizes its KV pool from the memory free at that moment, so without this
        it would see the first one's pool still held."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        device = engine.config.runner.device
        engine.close()
        del engine
        self.step_stats.clear()
        gc.collect()
        if device.startswith("cuda"):
            import torch  # only here: the offline API imports no torch at module level

            torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        Invalid input raises ``ValueError`` before anything of this call is queued.
        """
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts))
        return self._generate(
            (self.input_processor.prompt(p) for p in prompts), params, priority
        )

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        single = bool(messages) and isinstance(messages[0], Mapping)
        conversations = typing.cast(
            list[Sequence[Message]], [messages] if single else list(messages)
        )
        params = _params_per_prompt(sampling_params, len(conversations))
        return self._generate(
            (self.input_processor.chat(c, add_generation_prompt) for c in conversations), params
        )

    def _generate(
        self,
        prompts: Iterable[Prompt],
        params: list[SamplingParams],
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        # Every prompt is shaped and validated before the first one is submitted.
        parents = [
            self.input_processor.fan_out(str(next(self._ids)), prompt, sp)
            for prompt, sp in zip(prompts, params, strict=True)
        ]
        prios = list(priority) if priority is not None else [0] * len(parents)
        submitted: list[str] = []
        try:
            for parent, prio in zip(parents, prios, strict=True):
                self._submit(parent, prio)
                submitted.append(parent.request_id)
        except Exception:  # the engine refused one (queue full): leave nothing of this call
            for rid in submitted:
                self.engine.finish_requests(
                    self.output_processor.abort(rid), RequestStatus.FINISHED_ABORTED
                )
            raise
        results = self._run()
        return [results[parent.request_id] for parent in parents]

    def _submit(self, parent: ParentRequest, priority: int) -> None:
        ids = parent.prompt.token_ids
        added: list[str] = []
        try:
            for child_id, child_params in parent.children.items():
                self.engine.add_request(Request(child_id, ids, child_params, priority=priority))
                added.append(child_id)
        except Exception:
            self.engine.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        self.output_processor.add_request(
            parent.request_id, parent.prompt.text, ids, parent.children
        )

    def _run(self) -> dict[str, RequestOutput]:
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            outputs, stats = self.engine.step()
            if self.engine.rejected:  # refused when its grammar's matcher was built
                _, exc = self.engine.rejected.pop(0)
                raise exc
            if stats is not None:
                self.step_stats.append(stats)
            finished, to_stop = self.output_processor.process(outputs)
            if to_stop:
                stopped = self.engine.finish_requests(to_stop, RequestStatus.FINISHED_STOPPED)
                more, _ = self.output_processor.process(stopped)
                finished.extend(more)
            for ro in finished:
                results[ro.request_id] = ro
        return results


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    """One params for every prompt, or one per prompt. Frozen, so sharing one is safe."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise InvalidRequestError(
            f"got {len(params)} sampling_params for {num_prompts} prompts",
            param="sampling_params",
        )
    return params
