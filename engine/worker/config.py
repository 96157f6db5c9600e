"""The worker process's own settings (``engine.worker``; the engine's are an ``EngineConfig``)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from engine.grammar import MAX_GRAMMAR_CACHE_BYTES
from engine.worker.curve import exposure_error

COSTS = ("cpu", "h200", "zero")  # engine.sim.COST_PRESETS
# NOTE: half the engine's waiting queue (EngineConfig.max_waiting_requests, 1024), so that no one
# client (a gateway process, a runaway script) can fill it and starve the others
DEFAULT_MAX_QUEUED_PER_CLIENT = 512
MAX_STREAM_INTERVAL_S = 10.0  # NOTE: well below a client's idle timeout (the gateway's: 30 s)
DEFAULT_EMBED_CACHE_BYTES = 64 * 2**20


def stream_interval_error(interval_s: float) -> str | None:
    """Why ``Generate.stream_interval_s`` is refused (``invalid_request``); None when it is in
    ``[0, MAX_STREAM_INTERVAL_S]`` (NOTE: NaN is not)."""
    if 0.0 <= interval_s <= MAX_STREAM_INTERVAL_S:
        return None
    return f"stream_interval_s={interval_s}: must be in [0, {MAX_STREAM_INTERVAL_S}]"


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """The worker process's own settings (the engine's are an ``EngineConfig``).

    Attributes:
        listen: ROUTER endpoint for requests; port 0 binds a free port (printed at start).
        events: PUB endpoint for KV events and load reports; port 0 as for ``listen``.
        replay: ROUTER endpoint for KV event replay; None for none.
        cost: the sim backend's cost preset (``engine.sim.COST_PRESETS``).
        max_messages_per_poll: messages handled between two engine steps at most.
        grammar_timeout_s: how long a grammar may compile before its request fails with
            ``invalid_grammar``.
        max_grammar_bytes: the largest ``json_schema``/``lark`` text accepted (UTF-8 bytes);
            compile time grows faster than linearly with it.
        grammar_threads: grammar compiles running at once for requests that wait on them
            (``engine.worker.grammar_jobs``).
        grammar_cache_bytes: the compiled-grammar cache's bound (estimated bytes).
        max_compiling_requests: requests waiting for their grammar at most (then overloaded).
        client_timeout_s: a client silent this long is gone and its requests are aborted.
        max_queued_per_client: requests one client (ROUTER identity) may have waiting in the
            worker (queued in the engine, not yet running, or waiting for their grammar); more
            are refused ``overloaded``.
        curve_keys: a key directory (``engine.worker.curve``): the sockets become CURVE servers
            and accept only its authorized clients. None: no authentication, which is refused
            when an endpoint is not loopback unless ``insecure_no_curve``.
        insecure_no_curve: allow a non-loopback endpoint without ``curve_keys`` (logged).
        encoders: encoder service endpoints whose caches the worker looks media embeddings up
            in (``EncoderClient.lookup``), after its own cache (``engine.worker.media_jobs``).
        embed_redis: the Redis shared with the encoders (``EmbeddingCache``), read before the
            encoder services; None: none.
        embed_cache_bytes: the process LRU of embeddings, looked in first.
        embed_timeout_s: how long a request may wait for its embeddings (then it fails with
            ``invalid_request``); also each encoder call's timeout.
        media_threads: embedding fetches running at once.
        max_fetching_requests: requests waiting for their embeddings at most (then overloaded).

    Raises:
        ValueError: an endpoint is not loopback and neither ``curve_keys`` nor
            ``insecure_no_curve`` is set.
    """

    listen: str
    events: str
    replay: str | None = None
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    cost: str = "cpu"
    max_messages_per_poll: int = 256
    idle_poll_s: float = 0.05
    load_interval_s: float = 1.0
    busy_load_interval_s: float = 0.1
    grammar_timeout_s: float = 10.0
    max_grammar_bytes: int = 256 * 2**10
    grammar_threads: int = 2
    grammar_cache_bytes: int = MAX_GRAMMAR_CACHE_BYTES
    max_compiling_requests: int = 64
    client_timeout_s: float = 10.0
    max_queued_per_client: int = DEFAULT_MAX_QUEUED_PER_CLIENT
    curve_keys: str | None = None
    insecure_no_curve: bool = False
    encoders: tuple[str, ...] = ()
    embed_redis: str | None = field(default=None, repr=False)  # NOTE: may hold a password
    embed_cache_bytes: int = DEFAULT_EMBED_CACHE_BYTES
    embed_timeout_s: float = 5.0
    media_threads: int = 2
    max_fetching_requests: int = 256

    def __post_init__(self) -> None:
        assert self.cost in COSTS, f"cost={self.cost!r}: one of {COSTS}"
        assert self.max_messages_per_poll >= 1, "max_messages_per_poll must be >= 1"
        assert self.idle_poll_s > 0, f"idle_poll_s={self.idle_poll_s}: must be > 0"
        assert self.grammar_timeout_s > 0, f"grammar_timeout_s={self.grammar_timeout_s}: > 0"
        assert self.max_grammar_bytes > 0, f"max_grammar_bytes={self.max_grammar_bytes}: > 0"
        assert self.grammar_threads >= 1, f"grammar_threads={self.grammar_threads}: >= 1"
        assert self.grammar_cache_bytes >= 0, "grammar_cache_bytes must be >= 0"
        assert self.max_compiling_requests >= 1, "max_compiling_requests must be >= 1"
        assert self.client_timeout_s > 0, f"client_timeout_s={self.client_timeout_s}: > 0"
        assert self.max_queued_per_client >= 1, "max_queued_per_client must be >= 1"
        assert self.embed_cache_bytes >= 0, f"embed_cache_bytes={self.embed_cache_bytes}: >= 0"
        assert self.embed_timeout_s > 0, f"embed_timeout_s={self.embed_timeout_s}: > 0"
        assert self.media_threads >= 1, f"media_threads={self.media_threads}: >= 1"
        assert self.max_fetching_requests >= 1, "max_fetching_requests must be >= 1"
        if self.curve_keys is None and not self.insecure_no_curve:
            # NOTE: a ValueError, not an assert: a user's flags, refused even under python -O
            error = exposure_error(self.endpoints)
            if error is not None:
                raise ValueError(error)

    @property
    def has_embedding_source(self) -> bool:
        """Whether media embeddings can be found anywhere (an encoder service or a Redis)."""
        return bool(self.encoders or self.embed_redis)

    @property
    def endpoints(self) -> dict[str, str]:
        """The bound endpoints by flag: ``{"--listen": ..., "--events": ..., "--replay": ...}``."""
        named = {"--listen": self.listen, "--events": self.events, "--replay": self.replay}
        return {flag: endpoint for flag, endpoint in named.items() if endpoint is not None}
