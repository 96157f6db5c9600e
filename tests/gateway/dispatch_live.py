"""Helpers of the ``test_dispatch_*`` tests: a sim worker on a port of the test's choosing (so it
can be killed and started again on the same address) and the real app on a real HTTP server in a
thread (``TestClient`` buffers a streamed body whole and never disconnects mid-request)."""

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

import httpx
import pytest
import uvicorn
from litestar import Litestar

from gateway.app import GatewayConfig, create_app
from gateway.serve import ServeError, WorkerProcess, spawn_worker
from tests.gateway.live import WORKER_START_TIMEOUT_S, free_port

SERVER_START_TIMEOUT_S = 30.0


class Served(NamedTuple):
    app: Litestar
    http: httpx.Client
    base_url: str
    started_in_s: float  # from create_app to the server accepting connections


def start_worker_on(endpoint: str, worker_id: str, cost: str = "zero") -> WorkerProcess:
    """A sim worker listening on ``endpoint`` (``tcp://127.0.0.1:PORT``); fails the test if it
    does not start."""
    try:
        return spawn_worker(model_dir=None, backend="sim", worker_id=worker_id,
                            extra_args=("--listen", endpoint, "--cost", cost),
                            timeout_s=WORKER_START_TIMEOUT_S)
    except ServeError as e:
        pytest.fail(str(e))


def free_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@contextlib.contextmanager
def serve_app(cfg: GatewayConfig, timeout_s: float = 30.0) -> Iterator[Served]:
    """``create_app(cfg)`` on uvicorn in a daemon thread, with an ``httpx.Client`` to it."""
    port = free_port()
    started = time.monotonic()
    app = create_app(cfg)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        started_in_s = time.monotonic() - started
        base_url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base_url, timeout=timeout_s) as http:
            yield Served(app, http, base_url, started_in_s)
    finally:
        server.should_exit = True
        thread.join(15.0)


def close_abruptly(sock: socket.socket) -> None:
    """Close ``sock`` with a RST (SO_LINGER 0), as a client that gave up does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()
