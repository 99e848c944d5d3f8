"""Were the machine-readable answers right? The ``answers`` block of a step's result.

For every successful request that asked for structure, its answer is checked against what it
asked for, by this client (schema_check.py), never by the server's own grammar engine:

- ``response_format`` ``json_schema``: the text parses as JSON and validates against the
  schema;
- ``tools``: each streamed call (client.py reassembles them) names a declared function (under
  a named ``tool_choice``, that one), its arguments parse as a JSON object and validate against
  the function's ``parameters``. ``required`` and named ask for a call: a request without one
  fails; under ``auto`` a plain-text answer is allowed, and the share that called is reported.

Counts are per form (``json_schema``, ``auto``, ``required``, ``named``), with the requests
cut by max_tokens (finish_reason ``length``, where a cut JSON cannot be valid) counted apart;
``valid_share`` is over all successful requests of the form, ``valid_share_finished`` over
those the model finished. Latency is split by form and against the unconstrained requests of
the same step (TTFT P50/P99, ITL P50), and the server's ``grammar_s`` (tailserve_timing:
compile, matcher build and masks) is summed as a share of its end-to-end time.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from tailserve.bench.client import RequestResult
from tailserve.bench.datasets import BenchRequest
from tailserve.bench.metrics import distribution
from tailserve.bench.schema_check import Unchecked, errors

UNCONSTRAINED = "unconstrained"
_TAILS = (50.0, 99.0)


def form_of(req: BenchRequest) -> str:
    """What the request asked for: ``json_schema``, a tool_choice form, or unconstrained."""
    extra = req.extra or {}
    if extra.get("tools"):
        choice = extra.get("tool_choice", "auto")
        return "named" if isinstance(choice, dict) else str(choice)
    fmt = extra.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return "json_schema"
    return UNCONSTRAINED


def check_json_schema(req: BenchRequest, res: RequestResult) -> tuple[bool, str | None]:
    """(valid, why not) for a ``response_format`` json_schema answer."""
    schema = (req.extra or {})["response_format"]["json_schema"]["schema"]
    try:
        doc = json.loads(res.text)
    except ValueError:
        return False, f"not JSON: {res.text[:80]!r}"
    return _validate(doc, schema)


def check_tool_calls(req: BenchRequest, res: RequestResult) -> tuple[int, int, str | None]:
    """(calls made, calls valid, the first reason one was not) for a tools request."""
    extra = req.extra or {}
    declared = {t["function"]["name"]: t["function"].get("parameters") or {}
                for t in extra["tools"]}
    choice = extra.get("tool_choice", "auto")
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    valid, why = 0, None
    for call in res.tool_calls:
        ok, reason = _check_call(call, declared, named)
        valid += ok
        why = why or reason
    return len(res.tool_calls), valid, why


def _check_call(call: dict[str, str], declared: dict[str, Any],
                named: str | None) -> tuple[bool, str | None]:
    name = call["name"]
    if name not in declared:
        return False, f"calls {name!r}, which is not declared"
    if named is not None and name != named:
        return False, f"calls {name!r}, not the named {named!r}"
    try:
        args = json.loads(call["arguments"])
    except ValueError:
        return False, f"{name}: arguments are not JSON: {call['arguments'][:80]!r}"
    if not isinstance(args, dict):
        return False, f"{name}: arguments are a {type(args).__name__}, not an object"
    ok, why = _validate(args, declared[name])
    return ok, None if ok else f"{name}: {why}"


def _validate(doc: Any, schema: Any) -> tuple[bool, str | None]:
    try:
        problems = errors(doc, schema)
    except Unchecked as exc:
        return False, f"unchecked: {exc}"
    return not problems, "; ".join(problems[:2]) or None


def answers(requests: Sequence[BenchRequest], results: Sequence[RequestResult]
            ) -> dict[str, Any] | None:
    """The step's ``answers`` block; None when no request asked for structure."""
    forms = [form_of(requests[r.index]) for r in results]
    if all(f == UNCONSTRAINED for f in forms):
        return None
    by_form: dict[str, Counter[str]] = defaultdict(Counter)
    examples: dict[str, str] = {}
    for res, form in zip(results, forms, strict=True):
        if form == UNCONSTRAINED or not res.success:
            continue
        c = by_form[form]
        c["requests"] += 1
        cut = res.finish_reason == "length"
        c["cut_by_max_tokens"] += cut
        req = requests[res.index]
        if form == "json_schema":
            ok, why = check_json_schema(req, res)
        else:
            made, good, why = check_tool_calls(req, res)
            c["with_calls"] += made > 0
            c["calls"] += made
            c["calls_valid"] += good
            if made == 0 and form != "auto":
                why = why or f"no tool call (finish_reason {res.finish_reason})"
            # auto may answer in text; a request that called must call right.
            ok = good == made and (made > 0 or form == "auto")
        c["valid"] += ok
        c["valid_finished"] += ok and not cut
        if not ok and why:
            examples.setdefault(form, why)
    out: dict[str, Any] = {"by_form": {}, "examples": examples,
                           "latency_ms": latency_by_form(results, forms),
                           "grammar": grammar_share(results, forms)}
    for form, c in sorted(by_form.items()):
        finished = c["requests"] - c["cut_by_max_tokens"]
        row: dict[str, Any] = dict(c)
        row["valid_share"] = c["valid"] / c["requests"]
        row["valid_share_finished"] = c["valid_finished"] / finished if finished else None
        if form != "json_schema":
            row["calls_valid_share"] = c["calls_valid"] / c["calls"] if c["calls"] else None
            row["called_share"] = c["with_calls"] / c["requests"]
        out["by_form"][form] = row
    return out


def latency_by_form(results: Sequence[RequestResult], forms: Sequence[str]
                    ) -> dict[str, dict[str, float]]:
    """TTFT P50/P99 and ITL P50 (ms) of the successful requests of each form."""
    groups: dict[str, list[RequestResult]] = defaultdict(list)
    for res, form in zip(results, forms, strict=True):
        if res.success:
            groups[form].append(res)
    out = {}
    for form, rs in sorted(groups.items()):
        ttft = distribution([r.ttft_s for r in rs if r.ttft_s is not None], _TAILS, 1000.0)
        itl = distribution([g for r in rs for g in r.itl_s], _TAILS, 1000.0)
        out[form] = {"requests": float(len(rs)), "p50_ttft_ms": ttft["p50"],
                     "p99_ttft_ms": ttft["p99"], "p50_itl_ms": itl["p50"],
                     "p99_itl_ms": itl["p99"]}
    return out


def grammar_share(results: Sequence[RequestResult], forms: Sequence[str]
                  ) -> dict[str, Any] | None:
    """The server's grammar time (``tailserve_timing.grammar_s``) over the constrained
    requests: its distribution (ms) and its sum as a share of their end-to-end time; None
    when the server sends no such timing (another server)."""
    pairs = []
    for res, form in zip(results, forms, strict=True):
        t = res.server_timing
        if form == UNCONSTRAINED or not res.success or not t:
            continue
        g, e2e = t.get("grammar_s"), t.get("e2e_s")
        if isinstance(g, (int, float)) and isinstance(e2e, (int, float)):
            pairs.append((float(g), float(e2e)))
    if not pairs:
        return None
    total_e2e = sum(e for _, e in pairs)
    return {"requests": len(pairs),
            "grammar_ms": {**distribution([g for g, _ in pairs], _TAILS, 1000.0),
                           "max": 1000.0 * max(g for g, _ in pairs)},
            "share_of_e2e": sum(g for g, _ in pairs) / total_e2e if total_e2e > 0 else None}
