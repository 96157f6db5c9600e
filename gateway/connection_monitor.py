"""``ConnectionMonitor``: a ZeroMQ socket monitor read on the event loop, telling its owner at once
when the socket's TCP connection comes up or goes down (``zmq.EVENT_CONNECTED`` /
``EVENT_DISCONNECTED``). A killed worker's kernel closes the connection, so its loss is known
without waiting for a heartbeat to go unanswered. Used by ``gateway.worker_client.WorkerClient``.
"""

import asyncio
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

_MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class ConnectionMonitor:
    """Calls ``on_connected()`` / ``on_disconnected()`` from the loop for ``sock``'s connection.

    ``start`` before ``sock.connect`` (so the first connection is seen); ``close`` before the
    socket is closed. Both run on the loop's thread.
    """

    def __init__(
        self,
        sock: zmq.Socket[Any],
        loop: asyncio.AbstractEventLoop,
        on_connected: Callable[[], None],
        on_disconnected: Callable[[], None],
    ) -> None:
        self._sock, self._loop = sock, loop
        self._on_connected, self._on_disconnected = on_connected, on_disconnected
        self._monitor: zmq.Socket[bytes] | None = None

    def start(self) -> None:
        monitor = self._monitor = self._sock.get_monitor_socket(_MONITOR_EVENTS)
        self._loop.add_reader(monitor.getsockopt(zmq.FD), self.drain)
        self._loop.call_soon(self.drain)  # NOTE: an event may have come before add_reader

    def drain(self) -> None:
        """Handle every queued event (edge-triggered FD: read until POLLIN is off)."""
        monitor = self._monitor
        while monitor is not None and monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._on_connected()
            elif event == zmq.EVENT_DISCONNECTED:
                self._on_disconnected()
            monitor = self._monitor  # NOTE: a callback may have closed it

    def close(self) -> None:
        """Stop reading and close the monitor socket. Safe to call twice."""
        monitor, self._monitor = self._monitor, None
        if monitor is None:
            return
        if not self._loop.is_closed():
            self._loop.remove_reader(monitor.getsockopt(zmq.FD))
        self._sock.disable_monitor()
        monitor.close(linger=0)
