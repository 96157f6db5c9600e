"""API keys: who may call the gateway, as which tenant, and how much (``agentgate serve --api-keys
FILE``, or the file named by ``AGENTGATE_API_KEYS``).

The file is TOML, one table per tenant:

    [tenants.acme]
    keys = ["sk-acme-4f9c2e...", "sha256:9b1d0a..."]  # the keys, or their SHA-256 in hex
    weight = 2.0                  # admission's weighted fair share (default 1)
    requests_per_minute = 600     # default: no limit
    tokens_per_minute = 2000000   # prompt + completion tokens (default: no limit)
    max_concurrent = 32           # requests in flight at once (default: no limit)

With keys configured, every request needs ``Authorization: Bearer KEY`` except the probes
(``/health``, ``/ready``, ``/metrics``) and CORS preflights: a missing or unknown key is a 401,
a limit a 429 with ``Retry-After`` (``AuthGate``). The request then runs as the key's tenant:
its sessions, its prefix-cache namespace (``cache_salt``) and its admission share are the
tenant's, whichever of its keys it used, so keys can be rotated without losing sessions.

Keys are never stored or logged as they are: the file's keys are hashed (SHA-256) when it is
read, and a request's key is hashed and looked up by its digest, then confirmed with
``hmac.compare_digest``. The time a check takes depends only on that digest, never on how much
of a valid key a guess shares. A file can hold the ``sha256:`` form alone
(``printf %s KEY | sha256sum``), so the gateway's host never needs the keys themselves.

Limits are token buckets refilled continuously (a minute's allowance is also the largest
burst). Requests are counted when they arrive; tokens when the worker reports them (a prompt's
when it is sent, a completion's when it ends), so a request may overdraw the token budget once
and the next ones wait until it is paid back. Each gateway process keeps its own buckets: with
``--gateway-procs N`` a tenant's effective limits are up to N times the file's.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import time
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.tenancy import ANONYMOUS

MIN_KEY_CHARS = 16  # NOTE: a shorter key can be guessed online; refuse it at load
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_DIGEST = re.compile(r"sha256:([0-9a-fA-F]{64})")
_FIELDS = {"keys", "weight", "requests_per_minute", "tokens_per_minute", "max_concurrent"}


class ApiKeysError(ValueError):
    """The keys file is unreadable or wrong: the message says where (never a key)."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant's share and limits (None: no limit)."""

    name: str
    weight: float = 1.0
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_concurrent: int | None = None


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """The tenants and the SHA-256 digests of their keys (picklable: ``--gateway-procs``
    passes it to the other gateway processes)."""

    tenants: tuple[Tenant, ...]
    # NOTE: key digest -> (that digest as stored, tenant name)
    digests: dict[bytes, tuple[bytes, str]] = field(repr=False)

    def tenant_of_key(self, key: str) -> Tenant | None:
        """The tenant ``key`` belongs to, or None for an unknown key."""
        digest = hashlib.sha256(key.encode()).digest()
        stored, name = self.digests.get(digest, (b"", ""))
        if not hmac.compare_digest(stored, digest):
            return None
        return self.tenant(name)

    def tenant(self, name: str) -> Tenant:
        return next(t for t in self.tenants if t.name == name)


def load_api_keys(path: Path) -> ApiKeys:
    """Read and check a keys file.

    Raises:
        ApiKeysError: unreadable, not TOML, no tenants, a bad name or field, a key too short or
            given to two tenants (the message names the tenant and the key's position).
    """
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ApiKeysError(f"--api-keys {path}: cannot read it: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ApiKeysError(f"--api-keys {path}: not TOML: {exc}") from None
    return parse_api_keys(data, str(path))


def parse_api_keys(data: dict[str, Any], source: str = "api keys") -> ApiKeys:
    """``ApiKeys`` of a parsed keys file (see ``load_api_keys``)."""
    tables = data.get("tenants")
    if set(data) - {"tenants"} or not isinstance(tables, dict) or not tables:
        raise ApiKeysError(f"{source}: expected [tenants.NAME] tables and nothing else, with "
                           "at least one tenant")
    tenants, digests = [], {}
    for name, table in tables.items():
        where = f"{source}: [tenants.{name}]"
        if not TENANT_NAME.fullmatch(name) or name == ANONYMOUS:
            raise ApiKeysError(f"{where}: a tenant name is 1-64 letters, digits, '_', '.' or "
                               f"'-', starting with a letter or digit, and not {ANONYMOUS!r}")
        if not isinstance(table, dict):
            raise ApiKeysError(f"{where}: a table of {sorted(_FIELDS)}")
        if unknown := set(table) - _FIELDS:
            raise ApiKeysError(f"{where}: unknown fields {sorted(unknown)}; known: "
                               f"{sorted(_FIELDS)}")
        keys = table.get("keys")
        if not isinstance(keys, list) or not keys:
            raise ApiKeysError(f"{where}: keys must be a non-empty list of strings")
        for i, key in enumerate(keys):
            digest = _digest_of(key, f"{where}: keys[{i}]")
            if digest in digests:
                raise ApiKeysError(f"{where}: keys[{i}] is also a key of tenant "
                                   f"{digests[digest][1]!r}: a key belongs to one tenant")
            digests[digest] = (digest, name)
        tenants.append(Tenant(
            name, weight=_number(table, "weight", where, 1.0),
            requests_per_minute=_number(table, "requests_per_minute", where),
            tokens_per_minute=_number(table, "tokens_per_minute", where),
            max_concurrent=_count(table, "max_concurrent", where)))
    return ApiKeys(tuple(tenants), digests)


def _digest_of(key: Any, where: str) -> bytes:
    if not isinstance(key, str):
        raise ApiKeysError(f"{where}: a key is a string")
    if match := _DIGEST.fullmatch(key):
        return bytes.fromhex(match[1])
    if key.startswith("sha256:"):
        raise ApiKeysError(f"{where}: 'sha256:' must be followed by 64 hex digits")
    if len(key) < MIN_KEY_CHARS or key != key.strip() or any(c.isspace() for c in key):
        raise ApiKeysError(f"{where}: a key has at least {MIN_KEY_CHARS} characters and no "
                           "whitespace")
    return hashlib.sha256(key.encode()).digest()


def _number(table: dict[str, Any], name: str, where: str,
            default: float | None = None) -> float | None:
    value = table.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 or (
            not math.isfinite(value)):
        raise ApiKeysError(f"{where}: {name} must be a number > 0")
    return float(value)


def _count(table: dict[str, Any], name: str, where: str) -> int | None:
    value = table.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiKeysError(f"{where}: {name} must be an integer >= 1")
    return value


class _Bucket:
    """A token bucket: ``capacity`` (a minute's allowance), refilled at ``capacity / 60`` a
    second; the level may go below 0 (a charge after the fact), never above capacity."""

    __slots__ = ("capacity", "rate", "level", "stamp")

    def __init__(self, per_minute: float, now: float) -> None:
        self.capacity = per_minute
        self.rate = per_minute / 60.0
        self.level = per_minute
        self.stamp = now

    def refill(self, now: float) -> float:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.level

    def wait_for(self, amount: float) -> float:
        """Seconds until the level reaches ``amount`` (after ``refill``)."""
        return max(0.0, (amount - self.level) / self.rate)


@dataclass(slots=True)
class Limited:
    """Why a request was refused: ``limit`` is ``requests_per_minute``, ``tokens_per_minute``
    or ``max_concurrent``; ``retry_after_s`` when the client may try again."""

    limit: str
    retry_after_s: float


class TenantLimiter:
    """Each tenant's buckets and requests in flight, on the event loop (no locks)."""

    def __init__(self, tenants: Iterable[Tenant], clock: Any = time.monotonic) -> None:
        self._clock = clock
        now = clock()
        self._tenants = {t.name: t for t in tenants}
        self._requests = {t.name: _Bucket(t.requests_per_minute, now)
                          for t in self._tenants.values() if t.requests_per_minute}
        self._tokens = {t.name: _Bucket(t.tokens_per_minute, now)
                        for t in self._tenants.values() if t.tokens_per_minute}
        self.in_flight = dict.fromkeys(self._tenants, 0)
        self.refused: dict[tuple[str, str], int] = {}  # NOTE: (tenant, limit) -> requests

    def acquire(self, name: str) -> Limited | None:
        """Take a request slot for tenant ``name`` (``release`` it when the request ends), or
        say which limit refuses it now. Nothing is taken from a refused request."""
        tenant, now = self._tenants[name], self._clock()
        refusal = None
        if tenant.max_concurrent is not None and self.in_flight[name] >= tenant.max_concurrent:
            refusal = Limited("max_concurrent", 1.0)
        elif (tokens := self._tokens.get(name)) is not None and tokens.refill(now) <= 0:
            refusal = Limited("tokens_per_minute", tokens.wait_for(1.0))
        elif (requests := self._requests.get(name)) is not None and requests.refill(now) < 1:
            refusal = Limited("requests_per_minute", requests.wait_for(1.0))
        if refusal is not None:
            key = (name, refusal.limit)
            self.refused[key] = self.refused.get(key, 0) + 1
            return refusal
        if requests is not None:
            requests.level -= 1
        self.in_flight[name] += 1
        return None

    def release(self, name: str) -> None:
        self.in_flight[name] -= 1

    def charge(self, name: str | None, tokens: int) -> None:
        """Tokens used by tenant ``name`` (None or unknown: not a keyed tenant; ignored)."""
        bucket = self._tokens.get(name) if name is not None else None
        if bucket is not None and tokens > 0:
            bucket.refill(self._clock())
            # NOTE: the debt is bounded by a minute's allowance, so one huge request cannot
            # lock its tenant out for longer than a minute
            bucket.level = max(-bucket.capacity, bucket.level - tokens)
