"""Command-line flags generated from dataclass fields, so that every default is written once: on
the field. ``max_num_seqs`` becomes ``--max-num-seqs``; booleans ``--x`` / ``--no-x``; a
``Literal`` gives the choices.

A field's ``metadata`` may refine its flag:

    help    the help text ("(default: X)" is appended from the field's default)
    flag    the flag's name where it is not the field's (``timeout_s`` -> ``timeout``)
    parse   turns what was typed into the field's value, e.g. "1,2,4" -> [1.0, 2.0, 4.0]; it
            runs in ``from_namespace``, so its ValueError reaches the command's error handler
    choices, nargs, metavar   as in argparse
    group   the help section the flag is listed under
    cli     False: not a flag (set by the program)

argparse itself holds no defaults (``SUPPRESS``): a flag that was not given is absent from the
namespace and ``from_namespace`` leaves the field to its dataclass default.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypeVar, get_args, get_origin

T = TypeVar("T")


def _unwrap_optional(tp: Any) -> Any:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def flag_name(f: dataclasses.Field[Any], rename: Mapping[str, str] | None = None) -> str:
    """The dest of a field's flag (underscores): ``rename``, its ``flag`` metadata or its
    name."""
    name = (rename or {}).get(f.name) or f.metadata.get("flag", f.name)
    return str(name).replace("-", "_")


def field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _shown(value: Any) -> str | None:
    """How a default reads in --help; None where the help text says what unset means."""
    if value is None or value is dataclasses.MISSING or value == {} or value == []:
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:g}"
    if isinstance(value, list):
        return ",".join(_shown(v) or "" for v in value)
    return str(value)


def cli_fields(cls: type, skip: Iterable[str] = ()) -> list[dataclasses.Field[Any]]:
    skipped = set(skip)
    return [f for f in dataclasses.fields(cls)
            if f.metadata.get("cli", True) and f.name not in skipped]


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    skip: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
    rename: Mapping[str, str] | None = None,
    help: Mapping[str, str] | None = None,
    group: str | None = None,
    groups: dict[str, Any] | None = None,
) -> None:
    """One flag per field of the dataclass ``cls`` (but ``skip`` and ``cli: False`` fields).

    ``defaults`` replaces field defaults for this command only (``generate`` samples greedily
    where SamplingParams defaults to temperature 1); those are real argparse defaults.
    ``rename`` gives flags their names where two dataclasses of one command share a field
    name (``SamplingParams.seed`` is ``--sample-seed`` beside the engine's ``--seed``).
    ``help`` gives help texts for fields without one; flags go to the argument group named by
    their ``group`` metadata, else ``group``; ``groups`` shares those between calls.
    """
    hints = typing.get_type_hints(cls)
    overrides = dict(defaults or {})
    if groups is None:
        groups = {}

    def target(title: str | None) -> Any:
        if title is None:
            return parser
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        return groups[title]

    for f in cli_fields(cls, skip):
        meta = f.metadata
        dest = flag_name(f, rename)
        option = "--" + dest.replace("_", "-")
        default = overrides.get(f.name, field_default(f))
        help_text = str(meta.get("help", (help or {}).get(f.name, "")))
        shown = _shown(default)
        if shown is not None:
            help_text = f"{help_text} (default: {shown})".strip()
        kwargs: dict[str, Any] = {
            "dest": dest,
            "help": help_text or None,
            "default": overrides.get(f.name, argparse.SUPPRESS),
        }
        tp = _unwrap_optional(hints[f.name])
        if "parse" in meta:
            pass  # a string (or list of them, with nargs) for the parser to turn into a value
        elif tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_origin(tp) is Literal:
            kwargs["choices"] = get_args(tp)
        elif get_origin(tp) in (list, tuple):
            kwargs["action"] = "append"
            kwargs["type"] = get_args(tp)[0]
        elif tp in (int, float):
            kwargs["type"] = tp
        for key in ("choices", "nargs", "metavar"):
            if key in meta:
                kwargs[key] = meta[key]
        target(meta.get("group", group)).add_argument(option, **kwargs)


def from_namespace(
    cls: type[T],
    ns: argparse.Namespace,
    *,
    skip: Iterable[str] = (),
    rename: Mapping[str, str] | None = None,
    **extra: Any,
) -> T:
    """Build ``cls`` from the flags that were given (others keep the field's default);
    ``extra`` sets fields that are no flags."""
    given = vars(ns)
    kwargs: dict[str, Any] = {}
    for f in cli_fields(cls, skip):
        dest = flag_name(f, rename)
        if dest in given:
            value = given[dest]
            parse = f.metadata.get("parse")
            kwargs[f.name] = parse(value) if parse is not None else value
    kwargs.update(extra)
    return cls(**kwargs)
