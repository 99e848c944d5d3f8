"""A request's own SLO, from its headers and body: ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` (what
llm-d's gateway sends) and ``x-slo-itl-ms``, or the body extension ``"slo": {"ttft_ms": ...,
"itl_ms": ..., "tpot_ms": ...}`` (the body wins where both are given). A part not given is the
server's (``--slo-ttft-ms`` ...), filled in by the scheduler. Other ``x-slo-*`` headers, and
other keys of ``slo``, are ignored: a gateway may send more than this server serves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tailserve.config import MAX_ITL_SLO_MS, MAX_TTFT_SLO_MS
from tailserve.request import SLO
from tailserve.server.errors import bad_request

# part -> (header, body key, the largest value that is no typo, ms)
PARTS = {
    "ttft": ("x-slo-ttft-ms", "ttft_ms", MAX_TTFT_SLO_MS),
    "itl": ("x-slo-itl-ms", "itl_ms", MAX_ITL_SLO_MS),
    "tpot": ("x-slo-tpot-ms", "tpot_ms", MAX_ITL_SLO_MS),
}


def _seconds(value: Any, where: str, top_ms: float) -> float:
    """Milliseconds (a number, or a header's text) as seconds; a 400 naming ``where`` and the
    value when it is not a number in (0, top_ms]."""
    ms: float | None = None
    if isinstance(value, str):
        try:
            ms = float(value.strip())
        except ValueError:
            ms = None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        ms = float(value)
    # ``not 0 < ms <= top`` also catches NaN; inf is over any top.
    if ms is None or not 0.0 < ms <= top_ms or not math.isfinite(ms):
        raise bad_request(f"{where} must be milliseconds in (0, {top_ms:.0f}], got {value!r}",
                          param=where)
    return ms / 1e3


def request_slo(headers: Mapping[str, str], body_slo: Any) -> SLO:
    """The SLO the request asks for (None where it says nothing)."""
    if body_slo is not None and not isinstance(body_slo, dict):
        raise bad_request(f"slo must be an object like {{\"ttft_ms\": 1000, \"itl_ms\": 100}}, "
                          f"got {body_slo!r}", param="slo")
    got: dict[str, float | None] = {}
    for part, (header, key, top) in PARTS.items():
        value: float | None = None
        if header in headers:
            value = _seconds(headers[header], header, top)
        if body_slo is not None and body_slo.get(key) is not None:
            value = _seconds(body_slo[key], f"slo.{key}", top)
        got[part] = value
    return SLO(got["ttft"], got["itl"], got["tpot"])
