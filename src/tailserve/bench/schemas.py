"""The ``structured`` dataset's JSON schemas: a seeded pool of records of realistic size.

Each schema is an object of 8 to 30 properties drawn from the kinds an application asks a
model to fill (ids, names, e-mails, dates, enums, bounded numbers, booleans, string lists, a
nested address, a list of line items; free text with a maxLength), every property required
and no others allowed (what OpenAI's ``strict`` asks for, so the same body is valid on every
server). Requests pick a schema with Zipf-like weights (the k-th schema ∝ 1/k): the first
few repeat often and are compiled once, the rare ones keep arriving cold through the run, as
a population of agents with their own tools would send them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

MIN_PROPERTIES = 8
MAX_PROPERTIES = 30

Schema = dict[str, Any]


def _obj(props: dict[str, Schema]) -> Schema:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def _text(max_length: int) -> Schema:
    # Bounded, as an application's schema bounds its fields: a small model given an
    # unbounded string may fill max_tokens with it.
    return {"type": "string", "maxLength": max_length}


def _enum(rng: np.random.Generator) -> Schema:
    words = ["low", "medium", "high", "urgent", "open", "closed", "pending", "draft",
             "approved", "rejected", "red", "green", "blue", "north", "south", "east", "west"]
    k = int(rng.integers(2, 6))
    return {"type": "string", "enum": [str(w) for w in rng.choice(words, k, replace=False)]}


def _number(rng: np.random.Generator) -> Schema:
    top = float(rng.choice([1.0, 5.0, 100.0, 1000.0]))
    return {"type": "number", "minimum": 0, "maximum": top}


def _integer(rng: np.random.Generator) -> Schema:
    return {"type": "integer", "minimum": 0, "maximum": int(rng.choice([10, 120, 10_000]))}


def _address(rng: np.random.Generator) -> Schema:
    return _obj({"street": _text(40), "city": _text(30),
                 "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                 "country": _text(30)})


def _items(rng: np.random.Generator) -> Schema:
    line = _obj({"sku": _text(12), "quantity": _integer(rng), "price": _number(rng)})
    return {"type": "array", "items": line, "minItems": 1, "maxItems": int(rng.integers(2, 5))}


def _tags(rng: np.random.Generator) -> Schema:
    return {"type": "array", "items": _text(20), "maxItems": int(rng.integers(2, 6))}


# (property stem, how to make its schema); a stem used twice in one schema gets a suffix.
_KINDS: list[tuple[str, Callable[[np.random.Generator], Schema]]] = [
    ("id", lambda r: _text(16)),
    ("name", lambda r: _text(40)),
    ("title", lambda r: _text(60)),
    ("summary", lambda r: _text(160)),
    # Bounded repeats: a small model in an open [a-z]+ may loop until max_tokens.
    ("email", lambda r: {"type": "string",
                         "pattern": "^[a-z]{1,16}@[a-z]{1,16}\\.[a-z]{2,3}$"}),
    ("created_date", lambda r: {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}),
    ("status", _enum),
    ("priority", _enum),
    ("category", _enum),
    ("score", _number),
    ("price", _number),
    ("count", _integer),
    ("age", _integer),
    ("active", lambda r: {"type": "boolean"}),
    ("verified", lambda r: {"type": "boolean"}),
    ("tags", _tags),
    ("address", _address),
    ("items", _items),
]


def make_schema(rng: np.random.Generator, num_properties: int | None = None) -> Schema:
    """One schema; ``num_properties`` fixes its size (benchmarks), else 8 to 30."""
    n = num_properties or int(rng.integers(MIN_PROPERTIES, MAX_PROPERTIES + 1))
    props: dict[str, Schema] = {}
    for k in rng.integers(0, len(_KINDS), size=n):
        stem, make = _KINDS[int(k)]
        name = stem if stem not in props else f"{stem}_{len(props)}"
        props[name] = make(rng)
    return _obj(props)


def schema_pool(num_schemas: int, rng: np.random.Generator) -> list[Schema]:
    return [make_schema(rng) for _ in range(num_schemas)]


def zipf_weights(n: int) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1)
    return w / w.sum()


def response_format(schema: Schema, index: int) -> dict[str, Any]:
    """OpenAI's ``response_format`` for ``schema`` (vLLM and llama-server take it too)."""
    return {"type": "json_schema",
            "json_schema": {"name": f"record_{index}", "schema": schema, "strict": True}}
