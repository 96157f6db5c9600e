"""The L3 page store interface (``PageStore``), its counters, and ``open_store(spec)``.

A store maps keys (``format.page_key``) to opaque values (``format.encode_page``). It is a cache:
every call answers, and a failing backend reads as misses (``get_many``, ``exists_many``) or as
nothing written (``put_many``), counted in ``stats`` and logged once per outage. This module and
the backends never import torch.

Specs::

    file:DIR[?max_bytes=N]  or a bare path          FileStore (default max_bytes: 16 GiB)
    redis://[[user]:password@]host:port/db[?ttl_s=S&timeout_s=T]   RedisStore on one server
                                                     (rediss:// for TLS; the password is
                                                     never shown in a message)
    redis+cluster://host:port[,host:port...][?ttl_s=S&timeout_s=T]   RedisStore on a Cluster
"""

from __future__ import annotations

import logging
import threading
import urllib.parse
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

logger = logging.getLogger("engine.kv.gcache")

DEFAULT_FILE_MAX_BYTES = 16 * 2**30
DEFAULT_TTL_S = 7 * 24 * 3600.0
DEFAULT_TIMEOUT_S = 0.2


@dataclass(slots=True)
class StoreStats:
    """Counters of one store (monotonic; read them, never reset them).

    ``corrupt`` is counted by the caller, who decodes: ``stats.count_corrupt()``.
    NOTE: updated without a lock from the caller's and the writer's threads; a lost increment
    is possible in theory and harmless (these are diagnostics).
    """

    gets: int = 0  # keys asked for
    hits: int = 0
    misses: int = 0
    puts: int = 0  # keys offered to put_many
    put_bytes: int = 0  # bytes actually written
    skipped_existing: int = 0
    skipped_too_large: int = 0
    errors: int = 0  # failed calls (timeouts included)
    timeouts: int = 0
    evictions: int = 0
    corrupt: int = 0

    def count_corrupt(self, n: int = 1) -> None:
        self.corrupt += n

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class PageStore(Protocol):
    """A key -> bytes cache shared by workers. No method raises on a backend failure."""

    stats: StoreStats

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The value of each key, None for a miss; all None on any error."""
        ...

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Store each (key, value) whose key is absent (set-if-absent). Returns how many were
        written; 0 on any error."""
        ...

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored; all False on any error."""
        ...

    def close(self) -> None: ...


class OutageLog:
    """One warning per outage: the first failure logs, the next ones stay quiet until a call
    succeeds again. Thread-safe. ``what`` names the service in the lines (``gcache``) and
    ``meanwhile`` says what callers get while it is down; ``log`` is the caller's logger."""

    def __init__(self, name: str, what: str = "gcache",
                 meanwhile: str = "serving misses", log: logging.Logger = logger) -> None:
        self.name, self.what, self.meanwhile, self.log = name, what, meanwhile, log
        self._down = False
        self._lock = threading.Lock()

    def failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            was_down, self._down = self._down, True
        if not was_down:
            self.log.warning("%s %s unavailable (%s: %s: %s); %s until it is back", self.what,
                             self.name, what, type(exc).__name__, exc, self.meanwhile)

    def succeeded(self) -> None:
        if self._down:
            with self._lock:
                self._down = False
            self.log.info("%s %s is back", self.what, self.name)


def open_store(spec: str) -> PageStore:
    """The store a spec names (see the module docstring).

    Raises:
        ValueError: an empty spec, an unknown scheme, or a bad or unknown parameter.
    """
    spec = spec.strip()
    if not spec:
        raise ValueError("empty GCache store spec: want file:DIR, redis://host:port/db or "
                         "redis+cluster://host:port[,host:port...]")
    scheme = spec.split("://", 1)[0] if "://" in spec else ""
    if spec.startswith("file:") or not scheme:
        return _open_file(spec)
    if scheme in ("redis", "rediss", "redis+cluster"):
        return _open_redis(spec, cluster=scheme == "redis+cluster")
    raise ValueError(f"GCache store spec {spec!r}: unknown scheme {scheme!r} "
                     "(want file:, redis:// or redis+cluster://)")


def _open_file(spec: str) -> PageStore:
    from engine.kv.gcache.file_store import FileStore

    body = spec.removeprefix("file:")
    if body.startswith("//"):
        body = urllib.parse.urlsplit("file:" + body).path
    path, _, query = body.partition("?")
    params = _params(spec, query, {"max_bytes"})
    if not path:
        raise ValueError(f"GCache store spec {spec!r}: no directory")
    max_bytes = _number(spec, params, "max_bytes", DEFAULT_FILE_MAX_BYTES)
    if max_bytes != int(max_bytes):
        raise ValueError(f"GCache store spec {spec!r}: max_bytes={max_bytes} is not an integer")
    return FileStore(Path(path), int(max_bytes))


def _open_redis(spec: str, cluster: bool) -> PageStore:
    from engine.kv.gcache.redis_store import RedisStore

    url = urllib.parse.urlsplit(spec)
    auth = {"username": url.username or None, "password": url.password or None}
    spec = redacted(spec)  # NOTE: from here on only messages use it: no password in them
    params = _params(spec, url.query, {"ttl_s", "timeout_s"})
    ttl_s = _number(spec, params, "ttl_s", DEFAULT_TTL_S)
    timeout_s = _number(spec, params, "timeout_s", DEFAULT_TIMEOUT_S)
    nodes = [_host_port(spec, node) for node in url.netloc.rpartition("@")[2].split(",")]
    if cluster:
        return RedisStore.cluster(nodes, ttl_s=ttl_s, timeout_s=timeout_s, **auth)
    if len(nodes) != 1:
        raise ValueError(f"GCache store spec {spec!r}: one host:port (use redis+cluster:// "
                         "for a Cluster)")
    path = url.path.strip("/") or "0"
    if not path.isdigit():
        raise ValueError(f"GCache store spec {spec!r}: database {path!r} is not a number")
    return RedisStore.standalone(nodes[0][0], nodes[0][1], int(path), ttl_s=ttl_s,
                                 timeout_s=timeout_s, ssl=url.scheme == "rediss", **auth)


def redacted(spec: str) -> str:
    """``spec`` with the password of its user info replaced by ``***``."""
    scheme, sep, rest = spec.partition("://")
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return spec
    user = userinfo.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{hosts}{slash}{tail}"


def _params(spec: str, query: str, known: set[str]) -> dict[str, str]:
    try:
        params = dict(urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=True)
                      if query else [])
    except ValueError as exc:
        raise ValueError(f"GCache store spec {spec!r}: bad query {query!r}") from exc
    unknown = set(params) - known
    if unknown:
        raise ValueError(f"GCache store spec {spec!r}: unknown parameter(s) {sorted(unknown)} "
                         f"(known: {sorted(known)})")
    return params


def _number(spec: str, params: dict[str, str], name: str, default: float) -> float:
    if name not in params:
        return default
    try:
        value = float(params[name])
    except ValueError:
        raise ValueError(f"GCache store spec {spec!r}: {name}={params[name]!r} is not "
                         "a number") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"GCache store spec {spec!r}: {name}={params[name]} must be > 0")
    return value


def _host_port(spec: str, node: str) -> tuple[str, int]:
    host, sep, port = node.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"GCache store spec {spec!r}: {node!r} is not host:port")
    return host.strip("[]"), int(port)
