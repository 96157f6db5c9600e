"""Helpers of the tests of the in-process app (``test_dispatch_*``, the Session API): a sim worker
on a port of the test's choosing (so it can be killed and started again on the same address),
requests that run for a given number of tokens, a ``TestClient`` on the app, and the real app on
a real HTTP server in a thread (``TestClient`` buffers a streamed body whole and never disconnects
mid-request)."""

import asyncio
import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest
import uvicorn
from litestar import Litestar
from litestar.testing import TestClient

from engine.protocol import Generate, SamplingSpec
from gateway.app import GatewayConfig, create_app
from gateway.http_server import GuardedHttpProtocol
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


_request_ids = itertools.count(1)


def sim_request(max_new_tokens: int, session_id: str | None = None) -> Generate:
    """A request of 20 prompt tokens that no other one in this process uses, which runs for
    exactly ``max_new_tokens`` (``ignore_eos``)."""
    k = next(_request_ids)
    return Generate(
        request_id=f"r{k}", input_ids=[(k * 7919 + i * 31) % 300 for i in range(20)],
        sampling=SamplingSpec(max_new_tokens=max_new_tokens, ignore_eos=True),
        session_id=session_id,
    )


def free_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def app_client(worker: WorkerProcess, model_dir: Path, **cfg: Any) -> TestClient[Litestar]:
    """A ``TestClient`` (to enter) on the app serving ``model_dir`` as "demo" from ``worker``,
    with ``cfg`` as further ``GatewayConfig`` fields; a server error comes back as a 500."""
    config = GatewayConfig(model_dir=model_dir, workers=(worker.listen,), model_name="demo", **cfg)
    return TestClient(create_app(config), raise_server_exceptions=False)


@contextlib.contextmanager
def serve_app(cfg: GatewayConfig, timeout_s: float = 30.0) -> Iterator[Served]:
    """``create_app(cfg)`` on uvicorn in a daemon thread, with an ``httpx.Client`` to it. The
    HTTP protocol is ``agentgate serve``'s own (its limits, and the ``BodyWriter`` that plain
    content streams are written through)."""
    port = free_port()
    started = time.monotonic()
    app = create_app(cfg)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           http=GuardedHttpProtocol,
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


ZMTP_GREETING_BYTES = 64  # NOTE: ZMTP 3.x, which libzmq 4.x speaks to itself


class SwapProxy:
    """A TCP proxy in front of a worker that keeps its client's connection when the worker
    behind it is replaced, as a restart no socket monitor can see (a NAT or a load balancer in
    between): ``swap()`` connects to the new worker, replays the client's ZMTP handshake
    (greeting + READY) to it and swallows the new worker's, so the client's ZeroMQ socket never
    learns that its peer changed. Bytes the client sends while no worker is behind are dropped.
    Run on the test's event loop; ``close()`` at the end."""

    def __init__(self, backend_port: int) -> None:
        self.backend_port = backend_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._client: asyncio.StreamWriter | None = None
        self._backend: asyncio.StreamWriter | None = None
        self._handshake = b""
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_client, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def swap(self) -> None:
        """Put the worker now listening on ``backend_port`` behind the client's connection."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.backend_port)
        writer.write(self._handshake)
        await reader.readexactly(ZMTP_GREETING_BYTES)
        await _read_zmtp_command(reader)
        self._backend = writer
        self._spawn(self._pump_to_client(reader))

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for writer in (self._client, self._backend):
            if writer is not None:
                writer.close()
        if self._server is not None:
            self._server.close()

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._client is None, "SwapProxy serves one client connection"
        self._client = writer
        back_reader, self._backend = await asyncio.open_connection("127.0.0.1", self.backend_port)
        self._spawn(self._pump_to_client(back_reader))
        self._spawn(self._pump_to_backend(reader))

    async def _pump_to_backend(self, reader: asyncio.StreamReader) -> None:
        pending = b""  # NOTE: the client's handshake, kept for swap()
        while data := await reader.read(65536):
            if not self._handshake:
                pending += data
                self._handshake = _zmtp_handshake(pending)
            if self._backend is not None and not self._backend.is_closing():
                self._backend.write(data)

    async def _pump_to_client(self, reader: asyncio.StreamReader) -> None:
        while data := await reader.read(65536):
            assert self._client is not None
            self._client.write(data)
        self._backend = None  # NOTE: the worker is gone; the client's connection stays

    def _spawn(self, coro: Any) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coro))


def _zmtp_handshake(data: bytes) -> bytes:
    """The greeting and the first command of ``data`` once complete, else ``b""``."""
    rest = data[ZMTP_GREETING_BYTES:]
    if len(rest) < 2:
        return b""
    header, size = (9, int.from_bytes(rest[1:9])) if rest[0] & 0x02 else (2, rest[1])
    end = ZMTP_GREETING_BYTES + header + size
    return data[:end] if len(data) >= end else b""


async def _read_zmtp_command(reader: asyncio.StreamReader) -> bytes:
    flags = await reader.readexactly(1)
    size_bytes = await reader.readexactly(8 if flags[0] & 0x02 else 1)
    return flags + size_bytes + await reader.readexactly(int.from_bytes(size_bytes))
