"""One look at a running server: its ``/metrics`` page parsed, and (tailserve) the timeline's
step records since the previous look.

Fetching uses the standard library (one GET every few seconds needs no client library);
every network or format failure becomes a :class:`WatchError` with one line saying what is
wrong and what to check, never a traceback.
"""

from __future__ import annotations

import json
import math
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tailserve.analyze.watch.hist import BucketError, Buckets

TIMEOUT_S = 10.0
# /metrics pages are a few hundred KiB at most; a body far beyond that is not one.
MAX_BODY_BYTES = 32 * 2**20


class WatchError(ValueError):
    """Something the user can fix: a URL that is no server, a page that is not Prometheus'."""


@dataclass
class Scrape:
    """``values``: every sample but histogram buckets, keyed ``name{labels}`` as the bench
    stores them (engines.build_series reads that form); ``hists``: each histogram family's
    buckets summed over its label sets; ``bad_hists``: families whose buckets could not be
    read, with why; ``steps``: timeline step records (tailserve only)."""

    t: float
    values: dict[str, float]
    hists: dict[str, Buckets]
    bad_hists: dict[str, str] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)


def _key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def parse_page(text: str, t: float) -> Scrape:
    """A Prometheus text page as a :class:`Scrape`; WatchError when it is not one."""
    values: dict[str, float] = {}
    per_set: dict[str, dict[str, list[tuple[float, float]]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if family.type == "histogram" and s.name.endswith("_bucket"):
                    le = float(s.labels.get("le", "nan"))
                    rest = {k: v for k, v in s.labels.items() if k != "le"}
                    per_set.setdefault(family.name, {}).setdefault(
                        _key("", rest), []).append((le, float(s.value)))
                    continue
                values[_key(s.name, s.labels)] = float(s.value)
    except ValueError as exc:
        raise WatchError(f"the page is not Prometheus text ({str(exc)[:80]})") from None
    hists: dict[str, Buckets] = {}
    bad: dict[str, str] = {}
    for name, sets in per_set.items():
        try:
            total: Buckets | None = None
            for pairs in sets.values():
                if any(math.isnan(le) for le, _ in pairs):
                    raise BucketError("a bucket without an le label")
                b = Buckets.of(pairs)
                total = b if total is None else total + b
            if total is not None:
                hists[name] = total
        except BucketError as exc:
            bad[name] = str(exc)
    return Scrape(t, values, hists, bad)


class Fetcher:
    """GETs against one server; ``url`` is its base (``http://HOST:PORT``)."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = TIMEOUT_S
                 ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise WatchError(f"URL must look like http://HOST:PORT, got {url!r}")
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s

    def get(self, path: str) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url + path, headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return int(resp.status), resp.read(MAX_BODY_BYTES)
        except urllib.error.HTTPError as exc:
            return int(exc.code), b""
        except urllib.error.URLError as exc:
            raise WatchError(self._why(exc.reason)) from None
        except TimeoutError:
            raise WatchError(f"{self.url} did not answer GET {path} within "
                             f"{self.timeout_s:g} s") from None
        except OSError as exc:
            raise WatchError(self._why(exc)) from None

    def _why(self, reason: object) -> str:
        if isinstance(reason, ConnectionRefusedError):
            return f"connection refused at {self.url}: nothing is listening there"
        if isinstance(reason, socket.gaierror):
            return f"cannot resolve the host of {self.url}"
        if isinstance(reason, (TimeoutError, socket.timeout)):
            return f"{self.url} did not answer within {self.timeout_s:g} s"
        text = getattr(reason, "strerror", None) or str(reason)
        return f"cannot reach {self.url}: {text}"

    def metrics(self, t: float) -> Scrape:
        status, body = self.get("/metrics")
        if status == 404:
            raise WatchError(f"{self.url}/metrics answered HTTP 404: the server exports no "
                             "Prometheus metrics (vLLM and tailserve always do; SGLang needs "
                             "--enable-metrics, llama-server --metrics)")
        if status != 200:
            raise WatchError(f"{self.url}/metrics answered HTTP {status}")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise WatchError(f"{self.url}/metrics is not text") from None
        try:
            return parse_page(text, t)
        except WatchError as exc:
            raise WatchError(f"{self.url}/metrics: {exc}") from None

    def timeline_steps(self, since: float) -> tuple[list[dict[str, Any]], float] | None:
        """tailserve's step records after ``since`` and the server's clock now; None when the
        server has no timeline (or refuses it: the key, a proxy)."""
        status, body = self.get(f"/debug/timeline?since={since!r}")
        if status != 200:
            return None
        try:
            doc = json.loads(body)
        except ValueError:
            return None
        if not isinstance(doc, dict) or not isinstance(doc.get("records"), list):
            return None
        steps = [r for r in doc["records"] if isinstance(r, dict) and r.get("kind") == "step"
                 and isinstance(r.get("t"), (int, float))]
        now = doc.get("now")
        return steps, float(now) if isinstance(now, (int, float)) else since
