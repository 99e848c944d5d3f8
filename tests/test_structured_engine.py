"""Structured output in the engine: masks in the sampler, matchers per request (built off the
step loop), stops at the grammar's end, preemption and prefix caching, abort.

The real engine (offline ``LLM`` / ``EngineCore``) on the bundled model; masks checked exactly
against the tokenizer's own token bytes."""

from __future__ import annotations

import json
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch

from tailserve import LLM, SamplingParams
from tailserve.config import EngineArgs
from tailserve.engine.core import EngineCore
from tailserve.engine.structured_output import (
    StructuredOutputManager,
    grammar_of,
    lltokenizer_from_hf,
)
from tailserve.errors import InvalidRequestError
from tailserve.model.grammar import apply_token_bitmasks, unpack_bitmask
from tailserve.model.sampler import Sampler, SamplingRow
from tailserve.request import Request, RequestStatus
from tailserve.sampling_params import StructuredOutputsParams as SO

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False,
}


def _packed(allowed: list[int], vocab: int) -> np.ndarray:
    words = np.zeros(-(-vocab // 32), dtype=np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    return words.view(np.int32)


def test_bitmask_masks_exactly_the_constrained_rows() -> None:
    vocab = 70  # three words, the last one partly past the vocabulary
    logits = torch.randn(3, vocab)
    raw = logits.clone()
    masks = [_packed([0, 31, 32, 69], vocab), None, _packed([5], vocab)]
    out = apply_token_bitmasks(logits, masks, raw=logits)
    assert torch.equal(logits, raw)  # the raw logits (logprobs) are never written
    finite = [set(torch.isfinite(out[i]).nonzero().flatten().tolist()) for i in range(3)]
    assert finite == [{0, 31, 32, 69}, set(range(vocab)), {5}]
    assert torch.equal(out[1], raw[1])
    assert unpack_bitmask(np.stack([_packed([3], 40)]), 80)[0].nonzero()[0].tolist() == [3]


def test_sampler_draws_only_allowed_tokens() -> None:
    vocab = 64
    sampler = Sampler(vocab, torch.Generator().manual_seed(0))
    logits = torch.zeros(2, vocab)
    logits[:, 7] = 50.0  # the unconstrained favourite
    rows = [
        SamplingRow(SamplingParams(temperature=0), [1], [], token_bitmask=_packed([9, 40], vocab)),
        SamplingRow(SamplingParams(temperature=1.0, logprobs=1), [1], [],
                    token_bitmask=_packed([3], vocab)),
    ]
    out = sampler(logits, rows)
    assert out.token_ids[0] in (9, 40) and out.token_ids[1] == 3
    # logprobs are the raw distribution's: token 7 is still the top one
    lp = out.logprobs[1]
    assert lp is not None and max(lp, key=lambda t: lp[t]) == 7 and 3 in lp
    assert math.isfinite(lp[3])
    plain = sampler(logits[:1], [SamplingRow(SamplingParams(temperature=0), [1], [])])
    assert plain.token_ids == [7]


@pytest.fixture(scope="module")
def manager(default_loaded: Any) -> StructuredOutputManager:
    return StructuredOutputManager(lambda: default_loaded.tokenizer,
                                   default_loaded.config.vocab_size)


def _built(manager: StructuredOutputManager, rid: str, so: SO) -> None:
    manager.add(rid, so)
    manager.wait_any(60)
    assert manager.ready(rid) and manager.take_error(rid) is None


def test_first_mask_is_exactly_the_tokens_that_begin_a_choice(
    manager: StructuredOutputManager, default_loaded: Any
) -> None:
    tok = default_loaded.tokenizer
    _built(manager, "c", SO(choice=["Paris", "Pa"]))
    mask = manager.bitmasks(["c"])["c"]
    allowed = set(unpack_bitmask(mask[None], tok.vocab_size)[0].nonzero()[0].tolist())
    # Every token whose text is a non-empty prefix of a choice, nothing else.
    vocab = tok.get_vocab()
    expected = {
        i for s, i in vocab.items()
        if i not in tok.all_special_ids
        and (text := tok.convert_tokens_to_string([s])) and "Paris".startswith(text)
    }
    assert allowed == expected
    manager.free("c")
    assert "c" not in manager


def test_bad_grammars_are_invalid_requests(manager: StructuredOutputManager) -> None:
    for so in (SO(json="[1]"), SO(json="{not json"), SO(regex="([a-z"),
               SO(grammar="start: (")):
        with pytest.raises(InvalidRequestError) as info:
            grammar = grammar_of(so)
            manager.add("bad", so)
            manager.wait_any(60)
            err = manager.take_error("bad")
            assert err is not None, grammar
            raise err
        assert info.value.param == "structured_outputs"
    assert len(manager) == 0
    with pytest.raises(InvalidRequestError):
        SO(regex="a", choice=["b"])


def test_outputs_follow_their_grammar(default_llm: LLM) -> None:
    sos = [SO(json=json.dumps(PERSON)), SO(regex=r"[0-9]{3}-[a-z]{2}"),
           SO(choice=["red", "green", "blue"]), SO(json_object=True),
           SO(grammar='root ::= "yes" | "no"')]
    asks = ["Describe Bob, aged 30, as JSON.", "Give a code like 123-ab.", "Pick a color.",
            'Answer with the JSON object {"ok": true}.', "Is the sky blue?"]
    outs = default_llm.chat(
        [[{"role": "user", "content": ask}] for ask in asks],
        [SamplingParams(max_tokens=60, temperature=0, structured_outputs=so) for so in sos])
    texts = [o.outputs[0].text for o in outs]
    person = json.loads(texts[0])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[1])
    assert texts[2] in ("red", "green", "blue")
    assert isinstance(json.loads(texts[3]), dict)
    assert texts[4] in ("yes", "no")
    # Each ended at its grammar's end (no EOS sampled), with its grammar time recorded.
    assert [o.outputs[0].finish_reason for o in outs] == ["stop"] * 5
    assert all(o.timing[0]["grammar_s"] > 0 for o in outs)
    plain = default_llm.generate("Hi", SamplingParams(max_tokens=2))[0]
    assert plain.timing[0]["grammar_s"] == 0.0
    assert len(default_llm.engine.structured) == 0  # every matcher freed at its finish


def test_preempted_constrained_requests_resume_with_the_same_output(
    default_loaded: Any
) -> None:
    # Six constrained requests with a shared prefix; 20 blocks of 16 tokens cannot hold them
    # all, so some are preempted (recompute) and resumed, with prefix caching on.
    prompts = [f"Write a long list of numbers, starting at {i}: " * 3 for i in range(6)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True,
                            structured_outputs=SO(regex=r"\[([0-9]{1,3}, ){5,40}[0-9]{1,3}\]"))
    roomy = LLM.from_loaded(default_loaded, dtype="float32", num_kv_blocks=400,
                            max_model_len=256, enable_prefix_caching=True)
    reference = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    tight = LLM.from_loaded(default_loaded, dtype="float32", num_kv_blocks=20,
                            max_model_len=256, watermark=0.0, enable_prefix_caching=True)
    outs = tight.generate(prompts, params)
    assert sum(t["num_preemptions"] for o in outs for t in o.timing) > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(re.fullmatch(r"\[([0-9]{1,3}, )*[0-9, \]]*", o.outputs[0].text) for o in outs)
    assert len(tight.engine.structured) == 0


def test_abort_frees_the_matcher(default_llm: LLM) -> None:
    core = default_llm.engine
    so = SO(json=json.dumps(PERSON))
    ids = default_llm.tokenizer.encode("Describe Bob as JSON:")
    for rid in ("running", "pending"):
        core.add_request(Request(rid, ids, SamplingParams(max_tokens=50, structured_outputs=so)))
        assert rid in core.structured
        if rid == "running":
            while not core.scheduler.requests.get(rid) or not core.scheduler.running:
                core.step()
            core.step()
        outs = core.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        assert [o.request_id for o in outs] == [rid] and outs[0].finish_reason == "abort"
        assert rid not in core.structured and len(core.structured) == 0
        assert not core.has_unfinished_requests()


def test_a_serving_engine_has_its_grammar_tokenizer_before_the_first_request(
    default_loaded: Any
) -> None:
    # Built at the first constrained request, llguidance's tokenizer put seconds of queue in
    # front of it. The engine process builds it in a thread beside its start-up and hands the
    # job to the builder (engine/process.py); this engine is built the same way.
    t0 = time.perf_counter()
    lltokenizer_from_hf(default_loaded.tokenizer)
    build_s = time.perf_counter() - t0
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(lltokenizer_from_hf, default_loaded.tokenizer)
        core = EngineCore.from_args(
            EngineArgs(model=default_loaded.source, dtype="float32", num_kv_blocks=64,
                       max_model_len=256),
            default_loaded, grammar_tokenizer=job)
    assert core.structured.tokenizer is not None and core.structured.tokenizer is job.result()
    ids = default_loaded.tokenizer.encode("Describe Bob, aged 30, as JSON.")
    core.add_request(Request("first", ids, SamplingParams(
        max_tokens=40, temperature=0, structured_outputs=SO(json=json.dumps(PERSON)))))
    finished = []
    while core.has_unfinished_requests():
        outs, _ = core.step()
        finished += [o for o in outs if o.finished]
    timing = finished[0].timing
    assert timing is not None and timing["grammar_s"] > 0
    # The matcher of a small schema is milliseconds; the tokenizer alone took build_s here.
    assert timing["queue_s"] + timing["grammar_s"] < build_s / 2, (timing, build_s)
    assert core.structured.build_tokenizer() == 0.0  # nothing left to build
