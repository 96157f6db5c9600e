"""``RedisStore``: GCache pages in a Redis server or a Redis Cluster, binary values, pipelined.

Every key gets a TTL (``SET key value NX EX ttl``), so pages nobody reads go away even on a
server without an eviction policy. All requests of a call go out as one pipeline (a Cluster
pipeline groups them by node, since keys hash to different slots). Sockets time out after
``timeout_s``; a connection refused, a timeout or a restarted server never raises out of a call:
it reads as misses or as nothing written, counted in ``stats`` and logged once per outage.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from engine.kv.gcache.store import DEFAULT_TIMEOUT_S, DEFAULT_TTL_S, OutageLog, StoreStats

Client = redis.Redis | RedisCluster


class RedisStore:
    """Args:
    connect: makes the client (``decode_responses=False``); called lazily, again after a
        failure to connect, so a store opened while Redis is down works once it is up.
    ttl_s: lifetime of each stored page, in seconds.
    name: for the log.
    """

    def __init__(
        self, connect: Callable[[], Client], ttl_s: float = DEFAULT_TTL_S, name: str = "redis"
    ) -> None:
        assert ttl_s >= 1, f"ttl_s={ttl_s}: must be >= 1"
        self._connect, self.ttl_s = connect, int(ttl_s)
        self._client: Client | None = None
        self._lock = threading.Lock()
        self.stats = StoreStats()
        self._outage = OutageLog(name)

    @classmethod
    def standalone(
        cls, host: str, port: int, db: int = 0, *, ttl_s: float = DEFAULT_TTL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S, ssl: bool = False, username: str | None = None,
        password: str | None = None,
    ) -> RedisStore:
        def connect() -> Client:
            # NOTE: one immediate retry on a connection error only: it replaces a pooled
            # connection a restarted server closed; a timeout is never retried (it already
            # cost timeout_s). redis-py's default (3 retries with backoff) would stall the step.
            return redis.Redis(
                host=host, port=port, db=db, ssl=ssl, username=username, password=password,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            )

        return cls(connect, ttl_s, name=f"redis {host}:{port}/{db}")

    @classmethod
    def cluster(
        cls, nodes: Sequence[tuple[str, int]], *, ttl_s: float = DEFAULT_TTL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S, username: str | None = None,
        password: str | None = None,
    ) -> RedisStore:
        startup = [ClusterNode(host, port) for host, port in nodes]

        def connect() -> Client:
            return RedisCluster(
                startup_nodes=startup, username=username, password=password,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1),
            )

        names = ",".join(f"{host}:{port}" for host, port in nodes)
        return cls(connect, ttl_s, name=f"redis cluster {names}")

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        self.stats.gets += len(keys)
        values = self._call("get", lambda pipe: [pipe.get(k) for k in keys], len(keys))
        out: list[bytes | None] = (
            [None] * len(keys) if values is None else list(values)
        )
        hits = sum(v is not None for v in out)
        self.stats.hits += hits
        self.stats.misses += len(keys) - hits
        return out

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        found = self._call("exists", lambda pipe: [pipe.exists(k) for k in keys], len(keys))
        return [False] * len(keys) if found is None else [bool(n) for n in found]

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        self.stats.puts += len(items)
        # NOTE: NX alone keeps put set-if-absent; asking first saves sending values stored
        # already, the common case when several workers offload the same shared prefix
        present = self._call("exists", lambda pipe: [pipe.exists(k) for k, _ in items],
                             len(items))
        if present is None:
            return 0
        todo = [item for item, n in zip(items, present) if not n]
        written = self._call(
            "put", lambda pipe: [pipe.set(k, v, nx=True, ex=self.ttl_s) for k, v in todo],
            len(todo),
        )
        if written is None:
            return 0
        num_written = sum(bool(ok) for ok in written)
        self.stats.skipped_existing += len(items) - num_written
        self.stats.put_bytes += sum(len(v) for (_, v), ok in zip(todo, written) if ok)
        return num_written

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _call(self, what: str, queue: Callable[[Any], object], n: int) -> list[Any] | None:
        """Run the commands ``queue`` adds to a pipeline; their replies, or None on any error."""
        if n == 0:
            return []
        try:
            with self._client_now().pipeline(transaction=False) as pipe:
                queue(pipe)
                replies = pipe.execute()
        # NOTE: anything at all: a cache failure must never reach the step loop
        except Exception as exc:  # noqa: BLE001
            self._failed(what, exc)
            return None
        self._outage.succeeded()
        return replies

    def _client_now(self) -> Client:
        """The client, made on first use (a Cluster client reads the topology when made, so
        it fails while the Cluster is down: the next call tries again)."""
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            return self._client

    def _failed(self, what: str, exc: Exception) -> None:
        self.stats.errors += 1
        if is_timeout(exc):
            self.stats.timeouts += 1
        self._outage.failed(what, exc)


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a Redis or socket timeout."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, RedisTimeoutError | TimeoutError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
