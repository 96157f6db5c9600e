"""Stop a request's work when its HTTP client goes away before the answer.

A streamed answer needs nothing here: litestar's streaming response listens for the client's
``http.disconnect`` and cancels the body's generator, whose ``finally`` aborts the worker request.
A non-streamed handler, though, is awaited to its end: the ASGI server reports a disconnect only
to a ``receive()`` call, and nobody calls ``receive()`` once the body is read. So a client that
sent a long request and went away (a timeout, a flood of retries) left it running on a worker.

``until_disconnect(request, work)`` awaits ``work`` in the handler's task while a watcher task
waits on ``receive()``; a disconnect cancels the handler's task, so the ``finally`` blocks under
``work`` abort the worker request (``WorkerClient.generate`` sends ``Abort``), and the handler
raises ``ClientDisconnected`` (499, nginx's "client closed request": counted in the metrics, sent
to nobody).
"""

import asyncio
import inspect
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from litestar.exceptions import HTTPException, InternalServerException
from litestar.types import Receive

if TYPE_CHECKING:
    from gateway.lean_request import HttpRequest

CLIENT_CLOSED_REQUEST = 499
_T = TypeVar("_T")


class ClientDisconnected(HTTPException):
    """The client closed the connection before the answer; its work was cancelled."""

    status_code = CLIENT_CLOSED_REQUEST


async def read_body(request: "HttpRequest") -> bytes:
    """The request's body (read once, then cached).

    Raises:
        ClientDisconnected: the client left before the whole body came (a 499, not a 500).
    """
    try:
        return await request.body()
    except InternalServerException:
        # NOTE: litestar's Request.stream raises this for one reason only: an ``http.disconnect``
        # before the last body chunk (the lane's LeanRequest raises ClientDisconnected itself)
        raise ClientDisconnected(detail="client closed request") from None


async def until_disconnect(request: "HttpRequest", work: Awaitable[_T]) -> _T:
    """``await work``, cancelled when the client disconnects first.

    NOTE: reads (and caches) the body first, so that the watcher's ``receive()`` never races the
    handler's reading of it. Not around a litestar streamed body (its response listens for the
    disconnect itself, and two listeners would race); the lane writes its streams inside one.

    Raises:
        ClientDisconnected: the client went away; ``work`` was cancelled and has unwound.
    """
    try:
        await read_body(request)
    except BaseException:
        if inspect.iscoroutine(work):
            work.close()  # NOTE: never started; closing it spares a "never awaited" warning
        raise
    task = asyncio.current_task()
    assert task is not None, "until_disconnect() outside a task"
    gone = asyncio.Event()
    watcher = asyncio.get_running_loop().create_task(_cancel_on_disconnect(request.receive,
                                                                           task, gone))
    try:
        return await work
    except asyncio.CancelledError:
        if not gone.is_set():
            raise
        task.uncancel()  # NOTE: our own cancel, not the server's: it ends here
        raise ClientDisconnected(detail="client closed request") from None
    finally:
        watcher.cancel()


async def _cancel_on_disconnect(receive: Receive, task: asyncio.Task[Any],
                                gone: asyncio.Event) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
            task.cancel()
            return
