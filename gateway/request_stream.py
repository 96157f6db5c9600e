"""``RequestStream``: the reply queue of one request in flight on a ``WorkerClient``, with the
two timeouts (first token, next token) and the bound on unread deltas (a slow consumer)."""

import asyncio

from engine.protocol import ErrorReply, Finished, TokenDelta
from gateway.dispatch_errors import DispatchError, DispatchTimeout, StreamOverflow

StreamEvent = TokenDelta | Finished | ErrorReply | DispatchError


class RequestStream:
    """What the client's reader delivers to one request (``deliver``) and its generator reads
    (``next``). ``started``: a delta came; ``overflowed``: the consumer fell too far behind."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self.started = False
        self.overflowed = False

    def deliver(self, msg: TokenDelta | Finished | ErrorReply, max_pending: int) -> None:
        """Queue a reply; past ``max_pending`` unread deltas queue a ``StreamOverflow`` instead
        and drop the rest (the generator's ``finally`` aborts the request)."""
        if self.overflowed:
            return
        if isinstance(msg, TokenDelta):
            self.started = True
            if self.queue.qsize() >= max_pending:
                self.overflowed = True
                self.queue.put_nowait(
                    StreamOverflow(f"{msg.request_id}: over {max_pending} unread"))
                return
        self.queue.put_nowait(msg)

    async def next(self, first_s: float, idle_s: float, worker: str) -> StreamEvent:
        """The next event, or a ``DispatchTimeout`` (returned, not raised) when none came in
        ``first_s`` (before the first delta) or ``idle_s`` (after it)."""
        timeout_s, what = (idle_s, "next") if self.started else (first_s, "first")
        if not self.queue.empty():  # NOTE: no timer when the item is already here
            return self.queue.get_nowait()
        try:
            async with asyncio.timeout(timeout_s):  # NOTE: wait_for would start a Task per item
                return await self.queue.get()
        except TimeoutError:
            return DispatchTimeout(
                f"{self.request_id}: no {what} token from {worker} in {timeout_s} s")
