"""Tenants: who sent a request, from the API key they hold (``--api-keys FILE``) or, behind a
proxy the operator trusts, from a header (``--tenant-header``); their limits; and the prefix-cache
salt that keeps one tenant from probing another's cached prompts (``--cache-salt-by-tenant``).

The keys file has one JSON object per line (blank lines and ``#`` comments are skipped)::

    {"key": "sk-team-a-...", "name": "team-a", "weight": 2, "max_concurrency": 16}
    {"key": "sk-team-b-...", "name": "team-b", "max_requests_per_s": 5}

``name`` labels the tenant in records and errors; ``weight`` is its share when tenants compete
(1 by default); ``max_concurrency`` (engine requests in flight) and ``max_requests_per_s`` (a
token bucket with a burst of one second's worth) are refused with 429 naming the limit. Keys are
compared by their SHA-256 digest, so lookup time does not depend on how much of a key matched.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tailserve.errors import ConfigError, json_object
from tailserve.server.errors import APIError

# Tenant names become labels and salts: short and printable. A header-supplied name outside
# this shape is refused (400) rather than cleaned, so two proxies cannot alias one tenant.
_NAME = re.compile(r"^[A-Za-z0-9._:@\-]{1,64}$")
_FIELDS = {"key", "name", "weight", "max_concurrency", "max_requests_per_s"}
DEFAULT_TENANT = "default"  # the tenant of --api-key's single key, and of unauthenticated use


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0
    max_concurrency: int | None = None
    max_requests_per_s: float | None = None


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def load_api_keys(path: str) -> dict[bytes, Tenant]:
    """The keys file as {SHA-256 of the key: tenant}; a ``ConfigError`` naming the line for
    anything wrong (unreadable file, bad JSON, unknown or missing field, bad value, a key or
    name given twice, no key at all)."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"api_keys: cannot read {path!r}: {exc.__class__.__name__}") from None
    keys: dict[bytes, Tenant] = {}
    names: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        where = f"api_keys {path!r} line {number}"
        tenant, key = _tenant(json_object(text, where, _FIELDS), where)
        digest = _digest(key.encode())
        if digest in keys:
            raise ConfigError(f"{where}: the key is already given to tenant "
                              f"{keys[digest].name!r}")
        if tenant.name in names:
            raise ConfigError(f"{where}: tenant {tenant.name!r} is already named on line "
                              f"{names[tenant.name]}")
        names[tenant.name] = number
        keys[digest] = tenant
    if not keys:
        raise ConfigError(f"api_keys {path!r} holds no key")
    return keys


def _tenant(entry: dict[str, Any], where: str) -> tuple[Tenant, str]:
    key, name = entry.get("key"), entry.get("name")
    if not isinstance(key, str) or len(key) < 8:
        raise ConfigError(f"{where}: 'key' must be a string of at least 8 characters")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{where}: 'name' must be 1-64 characters of letters, digits and "
                          f"._:@- (got {name!r})")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) \
            or not (math.isfinite(weight) and 0 < weight <= 1000):
        raise ConfigError(f"{where}: 'weight' must be a number in (0, 1000], got {weight!r}")
    conc = entry.get("max_concurrency")
    if conc is not None and (isinstance(conc, bool) or not isinstance(conc, int) or conc < 1):
        raise ConfigError(f"{where}: 'max_concurrency' must be an integer >= 1, got {conc!r}")
    rate = entry.get("max_requests_per_s")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int | float)
                             or not (math.isfinite(rate) and rate > 0)):
        raise ConfigError(f"{where}: 'max_requests_per_s' must be a number > 0, got {rate!r}")
    return Tenant(name, float(weight), conc, None if rate is None else float(rate)), key


def check_tenant_name(name: str, header: str) -> str:
    """A tenant named by a trusted proxy's header; 400 when it is not a sane label."""
    if not _NAME.match(name):
        raise APIError(400, f"header {header!r}: a tenant name is 1-64 characters of letters, "
                       f"digits and ._:@-", param=header, code="invalid_tenant")
    return name


def tenant_salt(tenant: str, cache_salt: str | None) -> str:
    """The salt a request's blocks are keyed with when the cache is salted by tenant: the
    tenant first and length-prefixed, so no salt a client chooses reaches another tenant's
    blocks."""
    return f"{len(tenant)}:{tenant}:{cache_salt or ''}"


@dataclass
class _Usage:
    weight: float = 1.0
    request_ids: list[str] = field(default_factory=list)
    tokens: float = 0.0  # the rate bucket's level
    refilled: float | None = None  # when it was last refilled (monotonic); None: never


class TenantLimits:
    """Per-tenant concurrency and rate limits, checked before a request is admitted.

    In-flight engine requests are counted from the engine client's own books (``is_inflight``,
    exact on every path: finished, aborted, rejected), so nothing here must be given back.
    """

    def __init__(self, is_inflight: Callable[[str], bool],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._is_inflight = is_inflight
        self._clock = clock
        self._usage: dict[str, _Usage] = {}

    def inflight(self, tenant: str) -> int:
        usage = self._usage.get(tenant)
        if usage is None:
            return 0
        usage.request_ids = [r for r in usage.request_ids if self._is_inflight(r)]
        return len(usage.request_ids)

    def admit(self, tenant: Tenant, num_requests: int) -> None:
        """429 naming the limit when ``num_requests`` more engine requests would pass the
        tenant's concurrency, or its rate bucket is empty; else the rate token is spent."""
        usage = self._usage.setdefault(tenant.name, _Usage())
        if tenant.max_concurrency is not None:
            now_inflight = self.inflight(tenant.name)
            if now_inflight + num_requests > tenant.max_concurrency:
                raise APIError(
                    429, f"tenant {tenant.name!r} is at its max_concurrency "
                    f"({now_inflight} of {tenant.max_concurrency} requests in flight)",
                    "rate_limit_error", None, "tenant_concurrency", headers={"Retry-After": "1"})
        rate = tenant.max_requests_per_s
        if rate is not None:
            now = self._clock()
            burst = max(1.0, rate)
            if usage.refilled is None:
                usage.tokens = burst
            else:
                usage.tokens = min(burst, usage.tokens + (now - usage.refilled) * rate)
            usage.refilled = now
            if usage.tokens < 1.0:
                wait = (1.0 - usage.tokens) / rate
                raise APIError(
                    429, f"tenant {tenant.name!r} is over its max_requests_per_s ({rate:g})",
                    "rate_limit_error", None, "tenant_rate",
                    headers={"Retry-After": str(max(1, math.ceil(wait)))})
            usage.tokens -= 1.0

    def register(self, tenant: Tenant, request_ids: list[str]) -> None:
        usage = self._usage.setdefault(tenant.name, _Usage())
        usage.weight = tenant.weight
        usage.request_ids.extend(request_ids)

    def capacity_share(self, tenant: Tenant, num_requests: int,
                       capacity: int) -> tuple[bool, str] | None:
        """When the server is at capacity (``max_num_seqs + max_queue_len`` in flight) and
        other tenants have requests in flight: whether ``num_requests`` more keep ``tenant``
        within its weighted share of that capacity (at least one), and a sentence naming
        the share; None with no other tenant in flight (the plain bound applies). So a flood
        sheds the flooder, and its neighbours are still admitted."""
        others = 0.0
        for name, usage in self._usage.items():
            if name != tenant.name and self.inflight(name):
                others += usage.weight
        if others == 0.0:
            return None
        total = others + tenant.weight
        places = max(1, math.floor(capacity * tenant.weight / total))
        mine = self.inflight(tenant.name)
        why = (f"tenant {tenant.name!r} is over its share of the server's capacity ({mine} "
               f"requests in flight; weight {tenant.weight:g} of {total:g} gives it {places} "
               f"of max_num_seqs + max_queue_len = {capacity})")
        return mine + num_requests <= places, why
