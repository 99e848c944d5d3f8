"""A small JSON Schema validator for the answers ``tailserve bench`` checks.

The load client judges what a server returned against the schema it was asked to follow, and
it must not use the server's own grammar engine to do so (a bug there would pass its own
check). ``jsonschema`` is a test dependency only, so this module checks the keywords that
applications' schemas use — the ones of ``schemas.py`` and ``tool_pool.py`` and OpenAI's
strict subset: ``type`` (one or a list), ``enum``, ``const``, ``properties``, ``required``,
``additionalProperties``, ``items``, ``minItems``/``maxItems``, ``minLength``/``maxLength``,
``pattern``, ``minimum``/``maximum`` and their exclusive forms, ``anyOf``/``oneOf``/``allOf``.
A keyword outside that list is reported as unchecked (``Unchecked``), never passed silently;
annotations (``description``, ``title``, ``default``, ``format``, ``$schema``) are ignored as
JSON Schema itself ignores them.

``errors(value, schema)`` returns the first reasons the value fails, with the path to each
(empty: valid). tests/test_bench_tools.py cross-checks it with ``jsonschema``.
"""

from __future__ import annotations

import re
from typing import Any

ANNOTATIONS = frozenset({"description", "title", "default", "format", "$schema", "$id",
                         "examples", "$comment"})
CHECKED = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "items",
    "minItems", "maxItems", "minLength", "maxLength", "pattern", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "anyOf", "oneOf", "allOf",
})
MAX_ERRORS = 8


class Unchecked(ValueError):
    """The schema uses a keyword this validator does not check: no verdict is given."""


def _is_type(value: Any, name: str) -> bool:
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if name == "string":
        return isinstance(value, str)
    if name == "boolean":
        return isinstance(value, bool)
    if name == "null":
        return value is None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if name == "number":
        return number
    if name == "integer":  # 3.0 is an integer in JSON Schema (2020-12: a zero fraction)
        return number and float(value).is_integer()
    raise Unchecked(f"unknown type {name!r}")


def _equal(a: Any, b: Any) -> bool:
    # JSON equality: true is not 1, 1 is 1.0.
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def errors(value: Any, schema: Any, path: str = "$") -> list[str]:
    """Why ``value`` fails ``schema`` (at most ``MAX_ERRORS`` reasons; empty: it is valid).
    Raises ``Unchecked`` for a keyword this module does not check."""
    out: list[str] = []
    _check(value, schema, path, out)
    return out[:MAX_ERRORS]


def _check(value: Any, schema: Any, path: str, out: list[str]) -> None:
    if schema is True or schema == {}:
        return
    if schema is False:
        out.append(f"{path}: no value is allowed here")
        return
    if not isinstance(schema, dict):
        raise Unchecked(f"{path}: a schema must be an object or a boolean")
    unknown = set(schema) - CHECKED - ANNOTATIONS
    if unknown:
        raise Unchecked(f"{path}: keywords not checked here: {sorted(unknown)}")
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not any(_is_type(value, k) for k in kinds):
            out.append(f"{path}: {type(value).__name__} is not of type {kind}")
            return
    if "const" in schema and not _equal(value, schema["const"]):
        out.append(f"{path}: {value!r} is not {schema['const']!r}"[:200])
    if "enum" in schema and not any(_equal(value, e) for e in schema["enum"]):
        out.append(f"{path}: {value!r} is not one of {schema['enum']}"[:200])
    if isinstance(value, dict):
        _object(value, schema, path, out)
    elif isinstance(value, list):
        _array(value, schema, path, out)
    elif isinstance(value, str):
        _string(value, schema, path, out)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        _number(value, schema, path, out)
    for k in ("anyOf", "oneOf"):
        if k in schema:
            passing = sum(not errors(value, s, path) for s in schema[k])
            if passing == 0 or (k == "oneOf" and passing > 1):
                out.append(f"{path}: {passing} of the {len(schema[k])} {k} branches match")
    for s in schema.get("allOf", []):
        _check(value, s, path, out)


def _object(value: dict[str, Any], schema: dict[str, Any], path: str, out: list[str]) -> None:
    props = schema.get("properties", {})
    for name in schema.get("required", []):
        if name not in value:
            out.append(f"{path}: required property {name!r} is missing")
    extra = schema.get("additionalProperties", True)
    for name, v in value.items():
        if name in props:
            _check(v, props[name], f"{path}.{name}", out)
        elif extra is False:
            out.append(f"{path}: property {name!r} is not allowed")
        else:
            _check(v, extra, f"{path}.{name}", out)


def _array(value: list[Any], schema: dict[str, Any], path: str, out: list[str]) -> None:
    if len(value) < schema.get("minItems", 0):
        out.append(f"{path}: {len(value)} items, fewer than minItems {schema['minItems']}")
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        out.append(f"{path}: {len(value)} items, more than maxItems {schema['maxItems']}")
    if "items" in schema:
        for i, v in enumerate(value):
            _check(v, schema["items"], f"{path}[{i}]", out)


def _string(value: str, schema: dict[str, Any], path: str, out: list[str]) -> None:
    n = len(value)  # code points, as JSON Schema counts
    if n < schema.get("minLength", 0):
        out.append(f"{path}: {n} characters, fewer than minLength {schema['minLength']}")
    if "maxLength" in schema and n > schema["maxLength"]:
        out.append(f"{path}: {n} characters, more than maxLength {schema['maxLength']}")
    if "pattern" in schema and re.search(schema["pattern"], value) is None:
        out.append(f"{path}: {value!r} does not match {schema['pattern']!r}"[:200])


def _number(value: float, schema: dict[str, Any], path: str, out: list[str]) -> None:
    if "minimum" in schema and value < schema["minimum"]:
        out.append(f"{path}: {value} is below minimum {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        out.append(f"{path}: {value} is above maximum {schema['maximum']}")
    if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        out.append(f"{path}: {value} is not above {schema['exclusiveMinimum']}")
    if "exclusiveMaximum" in schema and value >= schema["exclusiveMaximum"]:
        out.append(f"{path}: {value} is not below {schema['exclusiveMaximum']}")
