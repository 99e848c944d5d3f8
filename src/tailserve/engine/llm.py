"""LLM: the offline API. ``LLM(model=None, **engine_args).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import itertools
import typing
from collections import deque
from collections.abc import Sequence
from typing import Any

from tailserve.config import EngineArgs
from tailserve.engine.core import EngineCore
from tailserve.engine.output_processor import OutputProcessor
from tailserve.engine.outputs import StepStats
from tailserve.errors import InvalidRequestError
from tailserve.model.loader import LoadedModel
from tailserve.outputs import RequestOutput
from tailserve.request import Request, RequestStatus
from tailserve.sampling_params import SamplingParams

PromptType = str | dict[str, Any]
Message = dict[str, str]


class LLM:
    """Batch generation with continuous batching. A prompt is a string or
    ``{"prompt_token_ids": [...]}``; ``sampling_params`` is one for all or one per prompt."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self._setup(EngineArgs(model=model, **engine_args), None)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, **engine_args: Any) -> LLM:
        """An LLM over weights already in memory (several engines, one load)."""
        llm = cls.__new__(cls)
        llm._setup(EngineArgs(model=loaded.source, **engine_args), loaded)
        return llm

    def _setup(self, args: EngineArgs, loaded: LoadedModel | None) -> None:
        self.engine_args = args
        self.engine = EngineCore.from_args(args, loaded)
        self.tokenizer = self.engine.loaded.tokenizer
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        # Recent per-step statistics, for tools that want to look at what the engine did.
        self.step_stats: deque[StepStats] = deque(maxlen=100_000)

    def _to_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        raise InvalidRequestError(
            f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt)}",
            param="prompt",
        )

    def _add(self, prompt: PromptType, params: SamplingParams, priority: int) -> str:
        text, ids = self._to_token_ids(prompt)
        rid = str(next(self._ids))
        children: dict[str, SamplingParams] = {}
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None else None
            children[rid if params.n == 1 else f"{rid}-{i}"] = dataclasses.replace(
                params, n=1, seed=seed
            )
        added: list[str] = []
        try:
            for child_id, child_params in children.items():
                self.engine.add_request(
                    Request(child_id, ids, child_params, priority=priority)
                )
                added.append(child_id)
        except Exception:
            self.engine.abort_requests(added)
            raise
        self.processor.add_request(rid, text, ids, children)
        return rid

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        Invalid input raises ``ValueError`` before anything of this call is left queued.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise InvalidRequestError(
                f"got {len(params)} sampling_params for {len(prompts)} prompts",
                param="sampling_params",
            )
        prios = list(priority) if priority is not None else [0] * len(prompts)
        order: list[str] = []
        try:
            for prompt, sp, prio in zip(prompts, params, prios, strict=True):
                order.append(self._add(prompt, dataclasses.replace(sp), prio))
        except Exception:
            for rid in order:
                self.engine.abort_requests(self.processor.abort(rid))
            raise
        results = self._run()
        return [results[rid] for rid in order]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = typing.cast(
            list[list[Message]], [messages] if single else messages
        )
        prompts: list[PromptType] = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params)

    def _run(self) -> dict[str, RequestOutput]:
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            outputs, stats = self.engine.step()
            if stats is not None:
                self.step_stats.append(stats)
            finished, to_stop = self.processor.process(outputs)
            if to_stop:
                stopped = self.engine.abort_requests(to_stop, RequestStatus.FINISHED_STOPPED)
                more, _ = self.processor.process(stopped)
                finished.extend(more)
            for ro in finished:
                results[ro.request_id] = ro
        return results
