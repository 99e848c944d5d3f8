"""What to send: a list of ``BenchRequest`` (prompt, its length in tokens, max_tokens).

- ``random``: word prompts of ``--input-len`` tokens (± ``--range-ratio``), ``--output-len``
  outputs; sent with ignore_eos so outputs have exactly the asked length.
- ``mixed``: input lengths drawn from a mixture, ``--mix "128:0.7,1024:0.2,8192:0.1"``
  (``LEN:WEIGHT``, or ``IN/OUT:WEIGHT`` to give a component its own output length): the
  long-and-short traffic whose tail this project is about.
- ``prefix``: ``--num-prefixes`` shared system prompts of ``--prefix-len`` tokens, each
  request one of them plus its own ``--input-len`` tokens: exercises prefix caching.
- ``structured``: ``--input-len`` token prompts asking for a JSON record, a
  ``--structured-share`` of them with OpenAI's ``response_format`` json_schema (strict), the
  schema one of a seeded pool of ``--num-schemas`` (schemas.py: 8 to 30 properties, some
  nested; Zipf-like popularity, so some repeat and some arrive cold); outputs end where the
  JSON does (max_tokens ``--output-len``, 512 by default).
- ``tools`` (chat only): a user question written for one of twelve function tools
  (tool_pool.py: weather, search, calendar, SQL, ...), sent with ``--num-tools`` of them and a
  ``tool_choice`` drawn from ``--tool-choice`` (auto, required, named); ``--input-len`` is not
  used (the question and the tool list are the prompt); max_tokens ``--output-len``, 256 by
  default. validity.py checks each call against its function's schema.
- ``sharegpt``: the ShareGPT JSON (a list of ``{id, conversations: [{from, value}]}``); the
  first human turn is the prompt, the first reply after it gives the output length; sampled
  with the seed and filtered as vLLM does (prompt and reply >= 4 tokens, prompt <= 1024,
  prompt + reply <= 2048).
- ``jsonl``: one ``{"prompt": str}`` or ``{"messages": [...]}`` per line, with an optional
  ``max_tokens``; taken in file order.

Malformed entries in files are skipped and counted by reason (``Dataset.skipped``), never a
crash; entries filtered by length are counted in ``Dataset.filtered``.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tailserve.bench import (
    DATASETS,
    DEFAULT_OUTPUT_LEN,
    BenchError,
)
from tailserve.bench.config import DatasetOptions
from tailserve.bench.schemas import response_format, schema_pool, zipf_weights
from tailserve.bench.tokens import PromptSynth, TokenCounter
from tailserve.bench.tool_pool import (
    TOOLS,
    parse_tool_choices,
    question,
    tool_choice_value,
    tool_list,
)

# vLLM's ShareGPT filter (benchmarks/datasets.py is_valid_sequence).
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
_HUMAN = frozenset({"human", "user"})
_REPLY = frozenset({"gpt", "assistant", "chatgpt", "bard", "bing", "model"})


@dataclass(frozen=True)
class BenchRequest:
    prompt: str  # the completions prompt (with the shared prefix, if any)
    prompt_len: int  # tokens of ``prompt``, as counted by the TokenCounter
    output_len: int  # max_tokens
    system: str | None = None  # prefix dataset on chat: the shared system prompt
    user: str | None = None  # prefix dataset on chat: the request's own part
    messages: list[dict[str, Any]] | None = None  # jsonl lines given as messages
    extra: dict[str, Any] | None = None  # body fields of this request (structured: the schema)

    def chat_messages(self) -> list[dict[str, Any]]:
        if self.messages is not None:
            return self.messages
        if self.system is not None:
            return [{"role": "system", "content": self.system},
                    {"role": "user", "content": self.user or ""}]
        return [{"role": "user", "content": self.prompt}]


@dataclass
class Dataset:
    name: str
    requests: list[BenchRequest]
    skipped: dict[str, int] = field(default_factory=dict)  # malformed entries, by reason
    filtered: dict[str, int] = field(default_factory=dict)  # valid but outside the length rules
    notes: list[str] = field(default_factory=list)


def load_dataset(opts: DatasetOptions, counter: TokenCounter) -> Dataset:
    if opts.num_prompts < 1:
        raise BenchError(f"--num-prompts must be at least 1, got {opts.num_prompts}")
    if not 0.0 <= opts.range_ratio < 1.0:
        raise BenchError(f"--range-ratio must be in [0, 1), got {opts.range_ratio}")
    rng = np.random.default_rng(opts.seed)
    if opts.name in ("sharegpt", "jsonl") and not opts.path:
        raise BenchError(f"--dataset {opts.name} needs --dataset-path")
    if opts.name == "random":
        return _random(opts, counter, rng)
    if opts.name == "mixed":
        return _mixed(opts, counter, rng)
    if opts.name == "prefix":
        return _prefix(opts, counter, rng)
    if opts.name == "structured":
        return _structured(opts, counter, rng)
    if opts.name == "tools":
        return _tools(opts, counter, rng)
    if opts.name == "sharegpt":
        return _sharegpt(opts, counter, rng)
    if opts.name == "jsonl":
        return _jsonl(opts, counter)
    raise BenchError(f"--dataset must be one of {', '.join(DATASETS)}; got {opts.name!r}")


# ---------------------------------------------------------------- synthetic
def jitter(rng: np.random.Generator, length: int, ratio: float, size: int) -> np.ndarray:
    """Integers uniform in [length·(1−ratio), length·(1+ratio)], at least 1 (vLLM's rule)."""
    if length < 1:
        raise BenchError(f"lengths must be at least 1 token, got {length}")
    low = max(1, int(length * (1 - ratio)))
    high = max(low, int(length * (1 + ratio)))
    return rng.integers(low, high + 1, size=size)


def parse_mix(spec: str, default_output: int) -> list[tuple[int, int, float]]:
    """``"128:0.7,1024/256:0.3"`` -> [(input, output, probability)], weights normalized."""
    parts: list[tuple[int, int, float]] = []
    for item in spec.split(","):
        item = item.strip()
        try:
            lens, weight_s = item.split(":")
            in_s, _, out_s = lens.partition("/")
            parts.append((int(in_s), int(out_s) if out_s else default_output, float(weight_s)))
        except ValueError:
            raise BenchError(
                f"--mix wants LEN:WEIGHT or IN/OUT:WEIGHT items separated by commas, "
                f"e.g. '128:0.7,1024:0.2,8192:0.1'; cannot read {item!r}"
            ) from None
    if not parts or any(i < 1 or o < 1 or w <= 0 for i, o, w in parts):
        raise BenchError(f"--mix lengths must be >= 1 and weights > 0, got {spec!r}")
    total = sum(w for _, _, w in parts)
    return [(i, o, w / total) for i, o, w in parts]


def _random(opts: DatasetOptions, counter: TokenCounter, rng: np.random.Generator) -> Dataset:
    n = opts.num_prompts
    ins = jitter(rng, opts.input_len, opts.range_ratio, n)
    outs = jitter(rng, opts.output_len or DEFAULT_OUTPUT_LEN, opts.range_ratio, n)
    synth = PromptSynth(counter, rng)
    reqs = []
    for i, o in zip(ins, outs, strict=True):
        text, count = synth.text(int(i))
        reqs.append(BenchRequest(text, count, int(o)))
    return Dataset("random", reqs)


def _mixed(opts: DatasetOptions, counter: TokenCounter, rng: np.random.Generator) -> Dataset:
    mix = parse_mix(opts.mix, opts.output_len or DEFAULT_OUTPUT_LEN)
    picks = rng.choice(len(mix), size=opts.num_prompts, p=[w for _, _, w in mix])
    synth = PromptSynth(counter, rng)
    reqs = []
    for k in picks:
        in_len, out_len, _ = mix[int(k)]
        i = int(jitter(rng, in_len, opts.range_ratio, 1)[0])
        o = int(jitter(rng, out_len, opts.range_ratio, 1)[0])
        text, count = synth.text(i)
        reqs.append(BenchRequest(text, count, o))
    return Dataset("mixed", reqs, notes=[f"mix: {mix}"])


def _prefix(opts: DatasetOptions, counter: TokenCounter, rng: np.random.Generator) -> Dataset:
    if opts.num_prefixes < 1 or opts.prefix_len < 1:
        raise BenchError(f"--num-prefixes and --prefix-len must be >= 1, got "
                         f"{opts.num_prefixes} and {opts.prefix_len}")
    synth = PromptSynth(counter, rng)
    prefixes = [synth.text(opts.prefix_len) for _ in range(opts.num_prefixes)]
    n = opts.num_prompts
    which = rng.integers(0, opts.num_prefixes, size=n)
    ins = jitter(rng, opts.input_len, opts.range_ratio, n)
    outs = jitter(rng, opts.output_len or DEFAULT_OUTPUT_LEN, opts.range_ratio, n)
    reqs = []
    for k, i, o in zip(which, ins, outs, strict=True):
        prefix, prefix_count = prefixes[int(k)]
        suffix, suffix_count = synth.text(int(i))
        if opts.endpoint == "chat":
            # The template separates the two messages; their sum is the text length.
            reqs.append(BenchRequest(prefix + " " + suffix, prefix_count + suffix_count, int(o),
                                     system=prefix, user=suffix))
        else:
            # A space keeps the prefix's tokens unchanged at the join, so the whole prefix is
            # shared in the KV cache.
            prompt = prefix + " " + suffix
            reqs.append(BenchRequest(prompt, counter.count(prompt), int(o)))
    return Dataset("prefix", reqs, notes=[
        f"{opts.num_prefixes} shared prefixes of {opts.prefix_len} tokens"
    ])


STRUCTURED_OUTPUT_LEN = 512  # room for a 30-property record with nested items
_ASK = "Fill in the record as JSON from these notes: "


def _structured(opts: DatasetOptions, counter: TokenCounter,
                rng: np.random.Generator) -> Dataset:
    if opts.num_schemas < 1 or not 0.0 <= opts.structured_share <= 1.0:
        raise BenchError(f"--num-schemas must be >= 1 and --structured-share in [0, 1], got "
                         f"{opts.num_schemas} and {opts.structured_share}")
    pool = schema_pool(opts.num_schemas, rng)
    n = opts.num_prompts
    which = rng.choice(len(pool), size=n, p=zipf_weights(len(pool)))
    constrained = rng.random(n) < opts.structured_share
    ins = jitter(rng, opts.input_len, opts.range_ratio, n)
    out_len = opts.output_len or STRUCTURED_OUTPUT_LEN
    synth = PromptSynth(counter, rng)
    reqs = []
    for k, c, i in zip(which, constrained, ins, strict=True):
        notes, _ = synth.text(int(i))
        prompt = _ASK + notes
        extra = {"response_format": response_format(pool[int(k)], int(k))} if c else None
        reqs.append(BenchRequest(prompt, counter.count(prompt), out_len, extra=extra))
    used = len({int(k) for k, c in zip(which, constrained, strict=True) if c})
    return Dataset("structured", reqs, notes=[
        f"{int(constrained.sum())} of {n} requests constrained by {used} of "
        f"{opts.num_schemas} schemas (Zipf-like popularity)"
    ])


TOOLS_OUTPUT_LEN = 256  # a call's arguments, or a short answer under auto


def _tools(opts: DatasetOptions, counter: TokenCounter, rng: np.random.Generator) -> Dataset:
    if opts.endpoint != "chat":
        raise BenchError("--dataset tools sends tools and tool_choice, which only chat "
                         "completions take: add --endpoint chat")
    if not 1 <= opts.num_tools <= len(TOOLS):
        raise BenchError(f"--num-tools must be in [1, {len(TOOLS)}], got {opts.num_tools}")
    forms = parse_tool_choices(opts.tool_choice)
    out_len = opts.output_len or TOOLS_OUTPUT_LEN
    reqs = []
    for _ in range(opts.num_prompts):
        target = int(rng.integers(0, len(TOOLS)))
        form = forms[int(rng.integers(0, len(forms)))]
        ask = question(TOOLS[target], rng)
        extra = {"tools": tool_list(target, opts.num_tools, rng),
                 "tool_choice": tool_choice_value(form, TOOLS[target].name)}
        reqs.append(BenchRequest(ask, counter.count(ask), out_len,
                                 messages=[{"role": "user", "content": ask}], extra=extra))
    return Dataset("tools", reqs, notes=[
        f"{opts.num_prompts} chats with {opts.num_tools} of {len(TOOLS)} tools each, "
        f"tool_choice from {forms}"
    ])


# ---------------------------------------------------------------- files
def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise BenchError(f"dataset file {path} not found") from None
    except json.JSONDecodeError as exc:
        raise BenchError(f"dataset file {path} is not JSON: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchError(f"cannot read dataset file {path}: {exc}") from None


def sharegpt_pairs(data: Any) -> tuple[list[tuple[str, str]], Counter[str]]:
    """(first human turn, the reply after it) per well-formed entry; bad ones counted."""
    if not isinstance(data, list):
        raise BenchError(f"a ShareGPT file is a JSON list of {{id, conversations}}; "
                         f"this one is a {type(data).__name__}")
    pairs: list[tuple[str, str]] = []
    skipped: Counter[str] = Counter()
    for entry in data:
        if not isinstance(entry, dict):
            skipped["not_an_object"] += 1
            continue
        conv = entry.get("conversations")
        if not isinstance(conv, list):
            skipped["no_conversations"] += 1
            continue
        if not all(isinstance(t, dict) and isinstance(t.get("from"), str)
                   and isinstance(t.get("value"), str) for t in conv):
            skipped["malformed_turn"] += 1
            continue
        human = next((i for i, t in enumerate(conv) if t["from"].lower() in _HUMAN), None)
        if human is None or not conv[human]["value"].strip():
            skipped["no_human_turn"] += 1
            continue
        reply = next((t for t in conv[human + 1:] if t["from"].lower() in _REPLY), None)
        if reply is None or not reply["value"].strip():
            skipped["no_reply"] += 1
            continue
        pairs.append((conv[human]["value"], reply["value"]))
    return pairs, skipped


def _sharegpt(opts: DatasetOptions, counter: TokenCounter, rng: np.random.Generator) -> Dataset:
    assert opts.path is not None  # checked in load_dataset
    pairs, skipped = sharegpt_pairs(_read_json(opts.path))
    filtered: Counter[str] = Counter()
    reqs: list[BenchRequest] = []
    for k in rng.permutation(len(pairs)):
        if len(reqs) == opts.num_prompts:
            break
        prompt, reply = pairs[int(k)]
        prompt_len = counter.count(prompt)
        output_len = opts.output_len or counter.count(reply)
        if prompt_len < SHAREGPT_MIN_LEN or output_len < SHAREGPT_MIN_LEN:
            filtered["too_short"] += 1
        elif (prompt_len > SHAREGPT_MAX_PROMPT_LEN
              or prompt_len + output_len > SHAREGPT_MAX_TOTAL_LEN):
            filtered["too_long"] += 1
        else:
            reqs.append(BenchRequest(prompt, prompt_len, output_len))
    ds = Dataset("sharegpt", reqs, dict(skipped), dict(filtered))
    return _fill(ds, opts.num_prompts, opts.path, rng)


def _jsonl(opts: DatasetOptions, counter: TokenCounter) -> Dataset:
    assert opts.path is not None  # checked in load_dataset
    skipped: Counter[str] = Counter()
    reqs: list[BenchRequest] = []
    try:
        f = open(opts.path, encoding="utf-8")  # noqa: SIM115 (closed below)
    except FileNotFoundError:
        raise BenchError(f"dataset file {opts.path} not found") from None
    except OSError as exc:
        raise BenchError(f"cannot read dataset file {opts.path}: {exc}") from None
    with f:
        for line in f:
            if len(reqs) == opts.num_prompts:
                break
            if not line.strip():
                continue
            req = _jsonl_request(line, opts, counter, skipped)
            if req is not None:
                reqs.append(req)
    ds = Dataset("jsonl", reqs, dict(skipped))
    return _fill(ds, opts.num_prompts, opts.path, None)


def _jsonl_request(line: str, opts: DatasetOptions, counter: TokenCounter,
                   skipped: Counter[str]) -> BenchRequest | None:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        skipped["bad_json"] += 1
        return None
    if not isinstance(obj, dict):
        skipped["not_an_object"] += 1
        return None
    max_tokens = obj.get("max_tokens", obj.get("max_completion_tokens"))
    if max_tokens is None:
        max_tokens = opts.output_len or DEFAULT_OUTPUT_LEN
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        skipped["bad_max_tokens"] += 1
        return None
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if isinstance(prompt, str) and prompt:
        return BenchRequest(prompt, counter.count(prompt), max_tokens)
    if isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in messages
    ):
        if opts.endpoint != "chat":
            skipped["messages_need_chat_endpoint"] += 1
            return None
        text = "\n".join(m["content"] for m in messages)
        return BenchRequest(text, counter.count(text), max_tokens, messages=messages)
    skipped["no_prompt_or_messages"] += 1
    return None


def _fill(ds: Dataset, n: int, path: str, rng: np.random.Generator | None) -> Dataset:
    """Too few usable entries: repeat them (with the seed, or in order) to reach N, and say
    so; none at all is an error that lists why each entry was dropped."""
    if not ds.requests:
        raise BenchError(f"no usable requests in {path}: skipped {ds.skipped or {}}, "
                         f"filtered by length {ds.filtered or {}}")
    have = len(ds.requests)
    if have < n:
        extra = (rng.integers(0, have, size=n - have) if rng is not None
                 else np.arange(n - have) % have)
        ds.requests += [ds.requests[int(k)] for k in extra]
        ds.notes.append(f"only {have} usable entries for --num-prompts {n}: some repeat")
    return ds
