"""The errors of dispatch: every ``WorkerClient`` and ``Dispatcher`` call raises a
``DispatchError`` (``gateway.errors`` maps them to HTTP). Re-exported by ``gateway.dispatch``."""


class DispatchError(Exception):
    """Base of every error a dispatch call raises."""


class HandshakeError(DispatchError):
    """``connect()`` got no ``Welcome`` in time, or the worker speaks another protocol version."""


class DispatchTimeout(DispatchError):
    """A request waited too long for its first token or its next one; it was aborted."""


class StreamOverflow(DispatchError):
    """The consumer fell more than ``max_pending_deltas`` behind; the request was aborted."""


class NoWorkerAvailable(DispatchError):
    """No live worker is left to take a request."""


class WorkerError(DispatchError):
    """The worker ended the request with ``ErrorReply(code, message)``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class WorkerDead(DispatchError):
    """The worker stopped answering, lost its connection or restarted. ``started``: the request
    had streamed at least one delta."""

    def __init__(self, worker: str, started: bool) -> None:
        super().__init__(f"worker {worker} is not answering (started={started})")
        self.started = started
