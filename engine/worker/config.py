"""The worker process's own settings (``engine.worker``; the engine's are an ``EngineConfig``)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from engine.grammar import MAX_GRAMMAR_CACHE_BYTES

COSTS = ("cpu", "h200", "zero")  # engine.sim.COST_PRESETS
MAX_STREAM_INTERVAL_S = 10.0  # NOTE: well below a client's idle timeout (the gateway's: 30 s)


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
