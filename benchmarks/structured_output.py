"""Structured output's costs on the bundled vocabulary (49,152 tokens), printed as a table:

- llguidance: tokenizer build, then per new 30-property schema the grammar conversion, the
  matcher build and the first mask — flat schemas of three kinds, then ten of the realistic
  kinds ``tailserve bench --dataset structured`` sends (bench/schemas.py: patterns, enums,
  bounds, a nested address, line items), each new to the process, with the sum (the issue's
  target: <= 20 ms); per-step mask time over a valid 330-token document;
- the sampler: one step of 64 greedy rows without any mask, with 16 masked rows, all masked.

    PYTHONPATH=src python benchmarks/structured_output.py
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from tailserve.bench.schemas import make_schema
from tailserve.engine.structured_output import (
    build_matcher,
    fill_bitmask,
    grammar_of,
    lltokenizer_from_hf,
)
from tailserve.model.loader import load_tokenizer
from tailserve.model.sampler import Sampler, SamplingRow
from tailserve.sampling_params import SamplingParams, StructuredOutputsParams


def schema(n: int, salt: int) -> dict[str, Any]:
    kinds: list[dict[str, Any]] = [
        {"type": "string"}, {"type": "integer"}, {"type": "array", "items": {"type": "number"}},
    ]
    props = {f"field_{salt}_{i}": kinds[i % 3] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def first_use(tok: Any, count: int = 10) -> None:
    """Realistic 30-property schemas, each new: conversion + matcher + first mask."""
    rng = np.random.default_rng(33)
    mask = np.empty(-(-tok.vocab_size // 32), dtype=np.int32)
    totals, parts = [], []
    for _ in range(count):
        s = make_schema(rng, num_properties=30)
        a = time.perf_counter()
        g = grammar_of(StructuredOutputsParams(json=json.dumps(s)))
        b = time.perf_counter()
        m = build_matcher(tok, g)
        c = time.perf_counter()
        fill_bitmask(m, mask)
        d = time.perf_counter()
        totals.append((d - a) * 1e3)
        parts.append(((b - a) * 1e3, (c - b) * 1e3, (d - c) * 1e3))
    medians = [statistics.median(p[i] for p in parts) for i in range(3)]
    print(f"realistic 30-property schema (bench/schemas.py), first use = convert + matcher + "
          f"first mask: median {statistics.median(totals):.2f} ms, max {max(totals):.2f} ms "
          f"over {count} (medians: convert {medians[0]:.2f}, matcher {medians[1]:.2f}, "
          f"first mask {medians[2]:.2f} ms)")


def main() -> None:
    hf = load_tokenizer(None)
    t0 = time.perf_counter()
    tok = lltokenizer_from_hf(hf)
    print(f"LLTokenizer build: {time.perf_counter() - t0:.2f} s (once per process)")
    rows = []
    for salt in range(5):
        s = schema(30, salt)
        a = time.perf_counter()
        g = grammar_of(StructuredOutputsParams(json=json.dumps(s)))
        b = time.perf_counter()
        m = build_matcher(tok, g)
        c = time.perf_counter()
        mask = np.empty(-(-tok.vocab_size // 32), dtype=np.int32)
        fill_bitmask(m, mask)
        d = time.perf_counter()
        rows.append((b - a, c - b, d - c))
    for name, i in (("convert", 0), ("matcher", 1), ("first mask", 2)):
        v = [r[i] * 1e3 for r in rows]
        print(f"new 30-property schema, {name}: median {statistics.median(v):.2f} ms, "
              f"max {max(v):.2f} ms over {len(v)}")
    first_use(tok)
    s = schema(30, 0)
    doc = {k: ("abc def" if v["type"] == "string" else 42 if v["type"] == "integer" else [1.5, 2])
           for k, v in s["properties"].items()}
    ids = hf.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False)
    m = build_matcher(tok, grammar_of(StructuredOutputsParams(json=json.dumps(s))))
    steps = []
    for t in ids:
        a = time.perf_counter()
        fill_bitmask(m, mask)
        steps.append(time.perf_counter() - a)
        assert m.consume_token(t), m.get_error()
    steps_us = sorted(x * 1e6 for x in steps)
    print(f"per-step mask over {len(ids)} tokens: p50 {steps_us[len(steps_us) // 2]:.0f} us, "
          f"p99 {steps_us[int(len(steps_us) * 0.99)]:.0f} us, max {steps_us[-1]:.0f} us")

    vocab = hf.vocab_size
    sampler = Sampler(vocab, torch.Generator().manual_seed(0))
    logits = torch.randn(64, vocab)
    allowed = np.full(-(-vocab // 32), 0x0F0F0F0F, dtype=np.int32)
    greedy = SamplingParams(temperature=0)
    for label, n_masked in (("no mask", 0), ("16 of 64 masked", 16), ("64 of 64 masked", 64)):
        batch = [SamplingRow(greedy, [1], [], token_bitmask=allowed if i < n_masked else None)
                 for i in range(64)]
        for _ in range(5):
            sampler(logits, batch)
        times = []
        for _ in range(50):
            a = time.perf_counter()
            sampler(logits, batch)
            times.append(time.perf_counter() - a)
        print(f"sampler, 64 greedy rows, {label}: median {statistics.median(times) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
