"""InputProcessor and request limits: prompt forms, the chat template, ``n`` fan-out ids and
seeds, every validation error with its message and param, and frozen SamplingParams that no
path changes (the offline path is in test_llm.py)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import subprocess
import sys
from typing import Any

import pytest

from tailserve.config import EngineArgs, ModelConfig
from tailserve.engine.input_processor import InputProcessor, ParentRequest, Prompt
from tailserve.errors import InvalidRequestError
from tailserve.platforms import Platform
from tailserve.request import RequestLimits, check_request_lengths
from tailserve.sampling_params import SamplingParams

VOCAB = 49152  # the bundled SmolLM2 tokenizer's
# 64 tokens in 4 blocks of 16 fit the pool; a 5th block does not exist.
LIMITS = RequestLimits(vocab_size=VOCAB, max_model_len=64, block_size=16, num_kv_blocks=4,
                       max_request_tokens=64)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from tailserve.model.loader import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def processor(tokenizer: Any) -> InputProcessor:
    return InputProcessor(tokenizer, LIMITS)


def test_input_processing_imports_no_torch() -> None:
    code = ("import sys, tailserve.engine.input_processor, tailserve.request; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_limits_are_read_from_the_engine_config() -> None:
    model = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    config = EngineArgs(device="cpu", dtype="float32", max_model_len=64, block_size=16,
                        num_kv_blocks=4, max_num_seqs=4).resolve(model, Platform(False))
    assert config.request_limits == LIMITS


# ------------------------------------------------------------------------------ prompts
def test_text_and_token_id_prompts(processor: InputProcessor, tokenizer: Any) -> None:
    text = "The capital of France is"
    assert processor.prompt(text) == Prompt(text, list(tokenizer(text).input_ids))
    assert processor.prompt({"prompt_token_ids": [5, 6, 7]}) == Prompt(None, [5, 6, 7])
    # vLLM's form may carry the text the ids came from.
    assert processor.prompt({"prompt": "x", "prompt_token_ids": [9]}) == Prompt("x", [9])
    assert processor.tokenize(text, add_special_tokens=False) == list(
        tokenizer(text, add_special_tokens=False).input_ids
    )


def test_a_prompt_of_another_type_is_refused(processor: InputProcessor) -> None:
    with pytest.raises(InvalidRequestError, match="a prompt must be a string or") as e:
        processor.prompt([1, 2, 3])  # type: ignore[arg-type]
    assert e.value.param == "prompt" and "list" in e.value.message
    with pytest.raises(InvalidRequestError) as e:
        processor.prompt({"prompt": "no ids"})
    assert e.value.param == "prompt"


def test_token_ids_outside_the_vocabulary(processor: InputProcessor) -> None:
    with pytest.raises(InvalidRequestError) as e:
        processor.prompt({"prompt_token_ids": [1, VOCAB, -3, 2]})
    assert e.value.message == f"prompt token ids must be in [0, {VOCAB}); got [{VOCAB}, -3]"
    assert e.value.param == "prompt"
    assert processor.prompt({"prompt_token_ids": [0, VOCAB - 1]}).token_ids == [0, VOCAB - 1]


def test_chat_applies_the_template_once(processor: InputProcessor, tokenizer: Any) -> None:
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    p = processor.chat(conv)
    assert p.text == tokenizer.apply_chat_template(conv, tokenize=False,
                                                   add_generation_prompt=True)
    assert p.text is not None and p.text.endswith("<|im_start|>assistant\n")
    assert p.text.count("<|im_start|>user\nHi<|im_end|>") == 1
    # The template wrote the special tokens: tokenized without adding any.
    assert p.token_ids == list(tokenizer(p.text, add_special_tokens=False).input_ids)
    bare = processor.chat(conv, add_generation_prompt=False)
    assert bare.text is not None and not bare.text.endswith("<|im_start|>assistant\n")
    assert p.text.startswith(bare.text)


def test_chat_takes_openai_content_parts(processor: InputProcessor) -> None:
    # What the server passes on (and LLM.chat accepts): text parts are joined, no content is "".
    parts = [{"role": "system", "content": None},
             {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                          {"type": "text", "text": "there"}]}]
    plain = [{"role": "system", "content": ""}, {"role": "user", "content": "Hi there"}]
    assert processor.chat(parts) == processor.chat(plain)
    assert processor.chat(parts).text != processor.chat([plain[1]]).text


def test_a_conversation_the_template_rejects(tokenizer: Any) -> None:
    class Refusing:
        def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
            raise RuntimeError("Conversation roles must alternate user/assistant")

    with pytest.raises(InvalidRequestError) as e:
        InputProcessor(Refusing(), LIMITS).chat([{"role": "user", "content": "x"}])
    assert e.value.param == "messages"
    assert e.value.message == ("the chat template rejected these messages: Conversation roles "
                               "must alternate user/assistant")


# ------------------------------------------------------------------------------ lone surrogates
# JSON's "\ud800" decodes to a str no UTF-8 can hold: the fast tokenizer raises TypeError on
# it, so each text field refuses it by name before the tokenizer sees it.
@pytest.mark.parametrize(("call", "message", "param"), [
    (lambda p: p.prompt("\ud800"),
     "prompt contains a lone surrogate (U+D800) at index 0; text must be valid Unicode",
     "prompt"),
    (lambda p: p.prompt("ok \udfff", what="prompt[2]"),
     "prompt[2] contains a lone surrogate (U+DFFF) at index 3; text must be valid Unicode",
     "prompt"),
    (lambda p: p.tokenize("ab\udc00c"),
     "prompt contains a lone surrogate (U+DC00) at index 2; text must be valid Unicode",
     "prompt"),
    (lambda p: p.chat([{"role": "user", "content": "hi"}, {"role": "user", "content": "\ud83d"}]),
     "messages[1].content contains a lone surrogate (U+D83D) at index 0; text must be valid "
     "Unicode", "messages"),
    (lambda p: p.chat([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                    {"type": "text", "text": "b\ud800"}]}]),
     "messages[0].content[1].text contains a lone surrogate (U+D800) at index 1; text must be "
     "valid Unicode", "messages"),
    (lambda p: p.chat([{"role": "us\ud800er", "content": "hi"}]),
     "messages[0].role contains a lone surrogate (U+D800) at index 2; text must be valid "
     "Unicode", "messages"),
])
def test_a_lone_surrogate_is_refused_by_name(
    processor: InputProcessor, call: Any, message: str, param: str
) -> None:
    with pytest.raises(InvalidRequestError) as e:
        call(processor)
    assert (e.value.message, e.value.param) == (message, param)


def test_a_surrogate_pair_is_valid_text(processor: InputProcessor, tokenizer: Any) -> None:
    # What JSON's "\ud83d\ude00" decodes to: one code point, U+1F600.
    text = "smile \U0001F600"
    assert processor.prompt(text) == Prompt(text, list(tokenizer(text).input_ids))


def test_a_lone_surrogate_in_a_stop_string_is_refused() -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop=["fine", "x\udfff"])
    assert e.value.param == "stop"
    assert e.value.message == ("stop[1] contains a lone surrogate (U+DFFF) at index 1; text "
                               "must be valid Unicode")
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop=["ok", 3])  # type: ignore[list-item]
    assert (e.value.message, e.value.param) == ("stop[1] must be a string, got int", "stop")
    assert SamplingParams(stop=["\U0001F600"]).stop == ["\U0001F600"]


# ------------------------------------------------------------------------------ fan-out
def test_one_completion_keeps_the_parent_id_and_params(processor: InputProcessor) -> None:
    prompt = Prompt(None, [5] * 10)
    params = SamplingParams(max_tokens=8, seed=3)
    parent = processor.fan_out("7", prompt, params)
    assert parent == ParentRequest("7", prompt, {"7": params})
    assert parent.children["7"] is params  # frozen: sharing is safe
    # The server's ids always carry the completion index.
    server = processor.fan_out("abc-0", prompt, params, always_suffix=True)
    assert list(server.children) == ["abc-0-0"] and server.children["abc-0-0"] is params


def test_n_fans_out_with_index_ids_and_seed_plus_i(processor: InputProcessor) -> None:
    params = SamplingParams(n=3, max_tokens=8, seed=40, temperature=0.7, stop=["\n"])
    for always_suffix in (False, True):
        parent = processor.fan_out("r", Prompt("t", [5] * 10), params,
                                   always_suffix=always_suffix)
        assert list(parent.children) == ["r-0", "r-1", "r-2"]
        assert [c.seed for c in parent.children.values()] == [40, 41, 42]
        for child in parent.children.values():
            assert child == dataclasses.replace(params, n=1, seed=child.seed)
    unseeded = processor.fan_out("u", Prompt(None, [5]), SamplingParams(n=2, max_tokens=4))
    assert [c.seed for c in unseeded.children.values()] == [None, None]
    assert [c.n for c in unseeded.children.values()] == [1, 1]


@pytest.mark.parametrize(("n_prompt", "max_tokens", "message", "param"), [
    (0, 4, "the prompt is empty (0 tokens)", "prompt"),
    (64, 1, "the prompt has 64 tokens but max_model_len is 64; at most 63 prompt tokens leave "
     "room for one output token", "input_tokens"),
    (80, None, "the prompt has 80 tokens but max_model_len is 64; at most 63 prompt tokens "
     "leave room for one output token", "input_tokens"),
    (60, 5, "prompt (60 tokens) + max_tokens (5) = 65 exceeds max_model_len (64)", "max_tokens"),
])
def test_length_errors_name_the_numbers_and_param(
    processor: InputProcessor, n_prompt: int, max_tokens: int | None, message: str, param: str
) -> None:
    with pytest.raises(InvalidRequestError) as e:
        processor.fan_out("x", Prompt(None, [5] * n_prompt), SamplingParams(max_tokens=max_tokens))
    assert (e.value.message, e.value.param) == (message, param)


def test_a_request_larger_than_the_kv_pool(processor: InputProcessor) -> None:
    small_pool = InputProcessor(processor.tokenizer, dataclasses.replace(LIMITS, num_kv_blocks=3))
    # max_tokens=None asks for the room left under max_model_len: 64 tokens, 4 blocks.
    with pytest.raises(InvalidRequestError) as e:
        small_pool.fan_out("x", Prompt(None, [5] * 10), SamplingParams(max_tokens=None))
    assert e.value.message == ("prompt + max_tokens = 64 tokens need 4 KV blocks but the whole "
                               "pool has 3")
    assert e.value.param == "input_tokens"
    assert small_pool.fan_out("y", Prompt(None, [5] * 10), SamplingParams(max_tokens=38))


def test_check_request_lengths_resolves_max_tokens() -> None:
    assert check_request_lengths(LIMITS, 10, None) == 54
    assert check_request_lengths(LIMITS, 10, 54) == 54
    assert check_request_lengths(LIMITS, 63, 1) == 1
    # n sequences share the per-request cap (64 tokens here, the pool's total): None gives
    # each of 4 sequences of 10 prompt tokens 64 // 4 - 10 = 6 output tokens.
    assert check_request_lengths(LIMITS, 10, None, n=4) == 6


@pytest.mark.parametrize(("n", "n_prompt", "max_tokens", "message", "param"), [
    (4, 10, 7, "n (4) x (prompt (10 tokens) + max_tokens (7)) = 68 tokens exceeds "
     "max_request_tokens (64)", "n"),
    (16, 4, None, "n (16) x (prompt (4 tokens) + 1 output token) = 80 tokens exceeds "
     "max_request_tokens (64)", "n"),
])
def test_n_times_the_tokens_beyond_the_cap_is_refused(
    n: int, n_prompt: int, max_tokens: int | None, message: str, param: str
) -> None:
    with pytest.raises(InvalidRequestError) as e:
        check_request_lengths(LIMITS, n_prompt, max_tokens, n=n)
    assert (e.value.message, e.value.param) == (message, param)
    assert check_request_lengths(LIMITS, 10, 6, n=4) == 6  # 4 x 16 = 64: the boundary fits


def test_a_configured_cap_applies_to_one_sequence_too() -> None:
    limits = dataclasses.replace(LIMITS, max_request_tokens=20)
    with pytest.raises(InvalidRequestError) as e:
        check_request_lengths(limits, 10, 11)
    assert (e.value.message, e.value.param) == (
        "n (1) x (prompt (10 tokens) + max_tokens (11)) = 21 tokens exceeds "
        "max_request_tokens (20)", "max_tokens")
    assert check_request_lengths(limits, 10, None) == 10


def test_fan_out_resolves_a_missing_max_tokens_for_all_children(
    processor: InputProcessor,
) -> None:
    parent = processor.fan_out("m", Prompt(None, [5] * 10), SamplingParams(n=4, max_tokens=None))
    assert [c.max_tokens for c in parent.children.values()] == [6, 6, 6, 6]


def test_stop_token_ids_outside_the_vocabulary(processor: InputProcessor) -> None:
    for bad in ([VOCAB], [-1, 3]):
        with pytest.raises(InvalidRequestError) as e:
            processor.fan_out("s", Prompt(None, [5]), SamplingParams(stop_token_ids=bad))
        assert e.value.param == "stop_token_ids"
        assert e.value.message == f"stop_token_ids must be in [0, {VOCAB}); got {bad[:1]}"
    assert processor.fan_out("s", Prompt(None, [5]), SamplingParams(stop_token_ids=[VOCAB - 1]))


@pytest.mark.parametrize(("kwargs", "param", "message"), [
    ({"top_k": -2}, "top_k", "top_k must be -1 or 0 (disabled) or a positive number, got -2"),
    ({"seed": 2**63 - 1, "n": 2}, "seed",
     f"seed must be in [{-(2**63)}, {2**63 - 2}] with n 2, got {2**63 - 1}"),
    ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2], got 2.5"),
    ({"repetition_penalty": 0.0}, "repetition_penalty",
     "repetition_penalty must be a finite number > 0, got 0.0"),
])
def test_sampling_params_outside_their_ranges(
    kwargs: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert (e.value.message, e.value.param) == (message, param)
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(seed=2**63 - 1).seed == 2**63 - 1


# ------------------------------------------------------------------------------ frozen params
def test_sampling_params_are_frozen_and_own_their_lists() -> None:
    stop = ["a"]
    sp = SamplingParams(stop=stop, stop_token_ids=[3], top_k=-1)
    assert sp.top_k == 0 and sp.stop == ["a"]  # normalized on construction
    stop.append("b")
    assert sp.stop == ["a"]  # a copy: the caller's list is not shared
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.max_tokens = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.seed = 1  # type: ignore[misc]
    assert SamplingParams(stop="\n").stop == ["\n"]
    # A variant is a new object, validated like any other.
    with pytest.raises(InvalidRequestError, match="n must be in"):
        dataclasses.replace(sp, n=0)


def test_fan_out_changes_no_params(processor: InputProcessor) -> None:
    params = SamplingParams(n=3, max_tokens=None, seed=9, stop=["x"])
    before = copy.deepcopy(params)
    processor.fan_out("p", Prompt(None, [5] * 10), params)
    with pytest.raises(InvalidRequestError):
        processor.fan_out("q", Prompt(None, [5] * 70), params)
    assert params == before


def test_the_server_path_changes_no_params(tiny_model_dir: str) -> None:
    """Input processor + Generation + an in-process engine (which shares the params objects):
    the request's params are as given after the run, max_tokens=None included; the children
    carry the budget the input processor resolved for all n of them."""
    from tailserve.engine.inproc_client import InprocEngineClient
    from tailserve.model.loader import load_tokenizer
    from tailserve.server.generation import Generation

    async def scenario() -> None:
        client = InprocEngineClient(EngineArgs(model=tiny_model_dir, kv_cache_memory=0.05,
                                               max_model_len=64))
        info = await client.start()
        try:
            tokenizer = load_tokenizer(tiny_model_dir)
            inputs = InputProcessor(tokenizer, info.config.request_limits)
            for params in (SamplingParams(max_tokens=None, seed=1, ignore_eos=True),
                           SamplingParams(n=2, max_tokens=None, seed=1, ignore_eos=True)):
                before = copy.deepcopy(params)
                parents = [inputs.fan_out(f"g-{p}", inputs.prompt(text), params,
                                          always_suffix=True)
                           for p, text in enumerate(["Hello", "Bonjour tout le monde"])]
                children = [c for parent in parents for c in parent.children.values()]
                gen = Generation(client, tokenizer, parents, params, 0.0, 0,
                                 lambda rec: None, record_id="g")
                gen.submit()
                while not gen.done:
                    await asyncio.wait_for(gen.next_outputs(), 60)
                assert params == before
                # max_tokens=None ran to max_model_len (the pool is far larger than n x 64).
                for c in gen.ordered_choices():
                    n_prompt = len(parents[c.prompt_index].prompt.token_ids)
                    assert children[c.index].max_tokens == 64 - n_prompt
                    assert len(c.out.token_ids) == 64 - n_prompt
                    assert c.out.finish_reason == "length"
        finally:
            await client.shutdown()

    asyncio.run(scenario())


# ------------------------------------------------------------------------------ the byte bound
class CountingTokenizer:
    """The real tokenizer, counting the texts it is asked to tokenize or template."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner.apply_chat_template(*args, **kwargs)


def test_the_longest_token_of_the_bundled_vocabulary(tokenizer: Any) -> None:
    from tailserve.engine.input_processor import max_token_bytes

    # SmolLM2's longest token decodes to 81 bytes; + 1 for a stripped leading space.
    assert max_token_bytes(tokenizer) == 82
    assert InputProcessor(tokenizer, LIMITS).max_text_bytes == 64 * 82
    # A tokenizer that cannot list its vocabulary gets no bound (none is safe to assume).
    assert max_token_bytes(object()) is None


def test_a_text_just_at_the_bound_is_tokenized_above_it_is_refused_untokenized(
    tokenizer: Any,
) -> None:
    counting = CountingTokenizer(tokenizer)
    inputs = InputProcessor(counting, LIMITS)
    assert len(inputs.tokenize("a" * 5248)) > 0  # 5248 = 64 x 82: could (in principle) fit
    assert counting.calls == 1
    # "é" is two UTF-8 bytes: 2625 characters are 5250 bytes, over the bound.
    for text, size in (("a" * 5249, 5249), ("é" * 2625, 5250)):
        with pytest.raises(InvalidRequestError) as e:
            inputs.prompt(text, what="prompt[1]")
        assert e.value.param == "prompt"
        assert e.value.message == (
            f"prompt[1] is {size} bytes of text, more than 5248 (max_model_len 64 x 82 bytes, "
            "the longest token): it cannot fit in max_model_len tokens")
    assert counting.calls == 1


def test_chat_messages_over_the_bound_are_refused_before_the_template(tokenizer: Any) -> None:
    counting = CountingTokenizer(tokenizer)
    inputs = InputProcessor(counting, LIMITS)
    # The parts and messages are summed: 2000 + 2000 + 1249 = 5249 bytes.
    messages = [
        {"role": "system", "content": "s" * 2000},
        {"role": "user", "content": [{"type": "text", "text": "u" * 2000},
                                     {"type": "text", "text": "v" * 1249}]},
    ]
    with pytest.raises(InvalidRequestError) as e:
        inputs.chat(messages)
    assert e.value.param == "messages"
    assert e.value.message == (
        "messages is 5249 bytes of text, more than 5248 (max_model_len 64 x 82 bytes, the "
        "longest token): it cannot fit in max_model_len tokens")
    assert counting.calls == 0
    messages[1]["content"][1]["text"] = "v" * 1248  # type: ignore[index]
    # At the bound the messages are templated; the template's text (80 bytes of role
    # markers more) is over the bound in turn, so it is refused without being tokenized.
    with pytest.raises(InvalidRequestError) as e:
        inputs.chat(messages)
    assert e.value.message.startswith("messages is 5328 bytes of text, more than 5248 ")
    assert counting.calls == 1
    messages[0]["content"] = "s" * 1900
    assert len(inputs.chat(messages).token_ids) > 64  # fan_out refuses it by its token count
    assert counting.calls == 3


# A template that reads tools (as Hermes / Qwen templates do), reduced to what it shows.
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}"
    "{% endfor %}{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}{{ '\n' }}"
    "{% endfor %}"
)


def test_tools_reach_a_template_that_reads_them(tokenizer: Any) -> None:
    from tailserve.server.tools import template_messages

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOLS_TEMPLATE
    reads = InputProcessor(tok, LIMITS)
    assert reads.template_reads_tools
    assert not InputProcessor(tokenizer, LIMITS).template_reads_tools  # SmolLM2's does not
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = template_messages([
        {"role": "user", "content": "Paris?", "tool_calls": None},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
    ])
    p = reads.chat(messages, add_generation_prompt=False, tools=tools)
    assert p.text == ("TOOLS get_weather\nuser: Paris?\nassistant: CALL get_weather Paris\n"
                      "tool: 18 C [call_1]\n")
