"""``RequestStream``: the reply queue of one request in flight on a ``WorkerClient``, with the
two timeouts (first token, next token) and the bound on unread deltas (a slow consumer).

Coalescing: ``next`` hands out every ``TokenDelta`` queued since the consumer last read as ONE
delta (token ids, logprobs and top logprobs concatenated in order). A consumer that keeps up sees
the worker's deltas one by one; one that fell behind (many streams on one event loop, a worker
that produced several steps since) catches up in one pass through the layers above (stop
strings, detokenizing, tool-call parsing, one SSE write) instead of one pass per token.

Push: a consumer whose per-token work is one synchronous function (a chat stream: decode,
parse tool calls, encode the chunks, write them to the connection) sets ``push``. While the
consumer waits in ``next`` with nothing queued, a delta goes to ``push`` right in the reader's
callback, and the consumer stays parked: no future, no task switch, no pass through the
generator layers. A delta ``push`` declines (returns False: the connection cannot take a write
now) is queued as usual, and so is every delta while anything is queued or the consumer is
busy, so the order is kept. The idle timer counts pushed deltas as arrivals.
"""

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from engine.protocol import ErrorReply, Finished, TokenDelta, merge_deltas
from gateway.dispatch_errors import DispatchError, DispatchTimeout, StreamOverflow

StreamEvent = TokenDelta | Finished | ErrorReply | DispatchError
Push = Callable[[TokenDelta], bool]  # True: the delta was consumed
logger = logging.getLogger(__name__)


class RequestStream:
    """What the client's reader delivers to one request (``deliver``) and its generator reads
    (``next``). ``started``: a delta came; ``overflowed``: the consumer fell too far behind;
    ``push``: see the module docstring."""

    __slots__ = ("request_id", "started", "overflowed", "push", "_items", "_num_deltas",
                 "_waiter", "_deadline", "_timer", "_idle_s")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.started = False
        self.overflowed = False
        self.push: Push | None = None
        self._items: deque[StreamEvent] = deque()
        self._num_deltas = 0  # unread TokenDelta messages
        self._waiter: asyncio.Future[bool] | None = None  # result: False = timed out
        self._deadline = 0.0  # loop time the current wait gives up at
        self._timer: asyncio.TimerHandle | None = None
        self._idle_s = 0.0  # the consumer's idle timeout, for pushed deltas

    def deliver(self, msg: TokenDelta | Finished | ErrorReply, max_pending: int) -> None:
        """Queue a reply; past ``max_pending`` unread deltas queue a ``StreamOverflow`` instead
        and drop the rest (the generator's ``finally`` aborts the request)."""
        if self.overflowed:
            return
        if type(msg) is TokenDelta:
            self.started = True
            waiter = self._waiter
            if self.push is not None and waiter is not None and not self._items and \
                    not waiter.done() and self._pushed(msg):
                self._deadline = waiter.get_loop().time() + self._idle_s
                return
            if self._num_deltas >= max_pending:
                self.overflowed = True
                self.fail(StreamOverflow(f"{msg.request_id}: over {max_pending} unread"))
                return
            self._num_deltas += 1
        self._put(msg)

    def _pushed(self, msg: TokenDelta) -> bool:
        """``push(msg)``; one that raises is dropped (logged), and ``msg`` takes the queued way:
        a consumer's error must not reach the reader, which serves every stream of the worker."""
        try:
            return self.push(msg)  # type: ignore[misc]
        except Exception:  # noqa: BLE001
            logger.exception("%s: pushing a delta failed; its stream reads them queued now",
                             self.request_id)
            self.push = None
            return False

    def fail(self, error: DispatchError) -> None:
        """Queue an error that ends the stream (after what is already queued)."""
        self._put(error)

    async def next(self, first_s: float, idle_s: float, worker: str) -> StreamEvent:
        """The next event (queued deltas merged into one), or a ``DispatchTimeout`` (returned,
        not raised) when none came in ``first_s`` (before the first delta) or ``idle_s``
        (after it)."""
        items = self._items
        self._idle_s = idle_s
        if not items:  # NOTE: no timer when the item is already here
            timeout_s = idle_s if self.started else first_s
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            self._deadline = loop.time() + timeout_s
            # NOTE: one timer per stream, re-armed only when it fires early (a timer per wait
            # cost more than the rest of a token's way through the gateway)
            if self._timer is None:
                self._timer = loop.call_at(self._deadline, self._expire)
            try:
                arrived = await waiter
            finally:
                self._waiter = None
            if not arrived:
                # NOTE: read after the wait: pushed deltas may have started the stream meanwhile
                timeout_s, what = (idle_s, "next") if self.started else (first_s, "first")
                return DispatchTimeout(
                    f"{self.request_id}: no {what} token from {worker} in {timeout_s} s")
        item = items.popleft()
        if type(item) is not TokenDelta:
            return item
        self._num_deltas -= 1
        if not items or type(items[0]) is not TokenDelta:
            return item
        run = [item]
        while items and type(items[0]) is TokenDelta and _same_shape(item, items[0]):
            run.append(items.popleft())  # type: ignore[arg-type]
        self._num_deltas -= len(run) - 1
        return merge_deltas(run) if len(run) > 1 else item

    def close(self) -> None:
        """Stop the timer (the stream is no longer read)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _put(self, event: StreamEvent) -> None:
        self._items.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    def _expire(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # NOTE: nobody waits: the next wait arms a timer again
        loop = waiter.get_loop()
        if loop.time() >= self._deadline:
            waiter.set_result(False)
        else:
            self._timer = loop.call_at(self._deadline, self._expire)


def _same_shape(a: TokenDelta, b: TokenDelta) -> bool:
    """Whether two deltas carry the same optional fields (merging keeps them aligned)."""
    return (a.logprobs is None) == (b.logprobs is None) and \
        (a.top_logprobs is None) == (b.top_logprobs is None)
