"""Which of the worker's clients are still there: the last time each ROUTER identity sent anything.

A gateway sends a ``GetLoad`` heartbeat every second on the socket its requests came from, so a
client silent for ``timeout_s`` has died (SIGKILL, a lost host) or stopped listening; the worker
then aborts its requests instead of running them to completion for nobody. ZeroMQ does not tell a
ROUTER that a peer went away, so silence is the only signal.
"""

from __future__ import annotations


class ClientWatch:
    """Last-seen times per client identity, checked at most every ``check_interval_s``.

    Args:
        timeout_s: silence after which a client counts as gone.
        check_interval_s: how often ``silent`` looks (keeps the step loop's cost flat).
    """

    def __init__(self, timeout_s: float, check_interval_s: float = 0.5) -> None:
        assert timeout_s > 0, f"timeout_s={timeout_s}: must be > 0"
        self.timeout_s = timeout_s
        self.check_interval_s = check_interval_s
        self._last_seen_s: dict[bytes, float] = {}
        self._last_check_s = 0.0

    def seen(self, identity: bytes, now_s: float) -> None:
        """``identity`` sent a message at ``now_s``."""
        self._last_seen_s[identity] = now_s

    def silent(self, now_s: float) -> list[bytes]:
        """Clients silent for more than ``timeout_s``, each reported once (then forgotten, so
        memory stays bounded by the clients heard from within the timeout); [] between checks."""
        if now_s - self._last_check_s < self.check_interval_s:
            return []
        self._last_check_s = now_s
        gone = [c for c, t in self._last_seen_s.items() if now_s - t > self.timeout_s]
        for identity in gone:
            del self._last_seen_s[identity]
        return gone

    @property
    def num_clients(self) -> int:
        return len(self._last_seen_s)
