"""How the worker's replies reach its clients: the ROUTER send, and the batching that puts one
engine step's request replies to a client into one message (``Replies`` when there are several)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import zmq

from engine.protocol import (
    ErrorCode,
    ErrorReply,
    Finished,
    Replies,
    TokenDelta,
    WorkerMsg,
    encode,
)
from engine.worker.publisher import RequestStream

_BATCHED = (TokenDelta, Finished, ErrorReply)  # request replies: one Replies per client a step
logger = logging.getLogger(__name__)


class ReplySender:
    """Sends ``WorkerMsg``s to client identities on the worker's ROUTER socket.

    Inside ``batch()``, request replies (``TokenDelta``, ``Finished``, ``ErrorReply``) are
    collected per client and sent when it ends; anything else goes out at once.
    """

    def __init__(self, router: zmq.Socket[Any]) -> None:
        self._router = router
        # NOTE: inside batch(), client identity -> the replies it collects (None otherwise)
        self._batch: dict[bytes, list[TokenDelta | Finished | ErrorReply]] | None = None

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Collect request replies until the block ends, then send one message per client."""
        self._batch = batch = {}
        try:
            yield
        finally:
            self._batch = None
            for identity, items in batch.items():
                self.send(identity, items[0] if len(items) == 1 else Replies(items=items))

    def send(self, identity: bytes, msg: WorkerMsg) -> None:
        batch = self._batch
        if batch is not None and type(msg) in _BATCHED:
            batch.setdefault(identity, []).append(msg)  # NOTE: sent at the end of batch()
            return
        # NOTE: ROUTER drops (never blocks on) messages for a gone or too slow client
        try:
            self._router.send_multipart([identity, encode(msg)], zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("dropped a %s for a slow client", type(msg).__name__)

    def error(self, identity: bytes, request_id: str | None, code: ErrorCode, text: str) -> None:
        self.send(identity, ErrorReply(request_id=request_id, code=code, message=text))

    def send_delta(self, req: RequestStream) -> None:
        """Send the request's output tokens not sent yet, if any."""
        delta = req.next_delta()
        if delta is not None:
            self.send(req.identity, delta)
