"""The dispatcher's built-in policy (``Dispatcher(router=None)``), as before issue 9: a session
stays on its worker while that worker is alive; otherwise the live worker with the fewest
requests in flight, on a tie the one with the fewest sessions assigned, then the next in
round-robin order after the last pick (so that sessions started one at a time, when no worker
has load yet, spread over the workers instead of all landing on the first one)."""

from collections import Counter, OrderedDict
from collections.abc import Sequence

from gateway.routing.types import Decision
from gateway.worker_client import WorkerClient


class BuiltinPolicy:
    """Args:
    clients: every worker's client, in the tie-break order.
    max_sessions: the bound of the session -> worker map (least recently used go first).
    """

    name = "builtin"

    def __init__(self, clients: Sequence[WorkerClient], max_sessions: int) -> None:
        self.clients = list(clients)
        self.max_sessions = max_sessions
        self._index = {c: i for i, c in enumerate(self.clients)}
        self._sessions: OrderedDict[str, WorkerClient] = OrderedDict()
        self._num_sessions: Counter[WorkerClient] = Counter()  # NOTE: of each worker
        self._next = 0  # NOTE: where the round robin of ties starts

    def pick(
        self, session_id: str | None, live: Sequence[WorkerClient]
    ) -> tuple[WorkerClient, Decision]:
        """The pick among ``live`` (not empty); ``Decision.worker_id`` is its endpoint."""
        if (sticky := self._sticky(session_id, live)) is not None:
            return sticky, Decision(sticky.endpoint, reason="affinity")
        n, index = len(self.clients), self._index
        client = min(live, key=lambda c: (c.num_in_flight, self._num_sessions[c],
                                          (index[c] - self._next) % n))
        self._next = (index[client] + 1) % n
        if session_id is not None:
            self._remember(session_id, client)
        return client, Decision(client.endpoint, reason="load")

    def _sticky(self, session_id: str | None, live: Sequence[WorkerClient]
                ) -> WorkerClient | None:
        if session_id is None or (client := self._sessions.get(session_id)) is None:
            return None
        if client not in live:
            return None
        self._sessions.move_to_end(session_id)
        return client

    def _remember(self, session_id: str, client: WorkerClient) -> None:
        if (previous := self._sessions.get(session_id)) is not None:
            self._num_sessions[previous] -= 1
        self._sessions[session_id] = client
        self._num_sessions[client] += 1
        self._sessions.move_to_end(session_id)
        if len(self._sessions) > self.max_sessions:
            _, evicted = self._sessions.popitem(last=False)
            self._num_sessions[evicted] -= 1
