"""Helpers for the worker tests over real ZeroMQ on 127.0.0.1: a DEALER client, a SUB subscription,
an ``agentgate worker`` subprocess on fixed ports, a worker in a thread, and the assertions.

Sim and native worker subprocesses come from ``gateway.serve.spawn_worker``; the fixtures that
share them are in ``tests/engine/conftest.py``.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest
import zmq

from engine.config import EngineConfig
from engine.protocol import (
    ErrorReply,
    Finished,
    Generate,
    LoadReport,
    SamplingSpec,
    TokenDelta,
    WorkerMsg,
    decode_worker_items,
    encode,
)
from engine.worker.curve import CurveClientKeys
from engine.worker.events import KVEvent, decode_batch
from engine.worker.server import Worker, WorkerConfig
from gateway.serve import START_LINE, WorkerProcess, spawn_worker

ROOT = Path(__file__).resolve().parents[2]
ANY_PORT = "tcp://127.0.0.1:0"
PAGE = 16  # the worker's default page size
VOCAB = 320  # the demo geometry of the sim worker
WINDOW = 32
START_TIMEOUT_S = 60.0
REPLY_TIMEOUT_S = 10.0
_prompt_ids = iter(range(1, 10**6))


# ---------------------------------------------------------------------- clients


class Client:
    """A DEALER on the worker's ROUTER, with bounded waits (a CURVE client with ``curve``)."""

    def __init__(self, endpoint: str, curve: CurveClientKeys | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self.sock)
        self.sock.connect(endpoint)
        self.pending: deque[WorkerMsg] = deque()

    def send(self, msg: object) -> None:
        self.sock.send(msg if isinstance(msg, bytes) else encode(msg))  # type: ignore[arg-type]

    def recv(self, timeout_s: float = REPLY_TIMEOUT_S) -> WorkerMsg:
        """The next reply (one of a ``Replies`` at a time, as the gateway's client sees them)."""
        if not self.pending:
            assert self.sock.poll(int(timeout_s * 1000)), f"no reply within {timeout_s} s"
            self.pending.extend(decode_worker_items(self.sock.recv()))
        return self.pending.popleft()

    def assert_silent(self, timeout_s: float = 0.3) -> None:
        if self.pending:
            pytest.fail(f"unexpected reply: {self.pending[0]}")
        if self.sock.poll(int(timeout_s * 1000)):
            pytest.fail(f"unexpected reply: {decode_worker_items(self.sock.recv())}")

    def generate(self, request_id: str, prompt: list[int], **sampling: object) -> None:
        spec = SamplingSpec(**sampling)  # type: ignore[arg-type]
        self.send(Generate(request_id=request_id, input_ids=prompt, sampling=spec))

    def collect(self, request_id: str) -> tuple[list[TokenDelta], Finished | ErrorReply]:
        """Deltas of one request until its last message (other requests' replies are skipped)."""
        deltas: list[TokenDelta] = []
        while True:
            msg = self.recv()
            if getattr(msg, "request_id", None) != request_id:
                continue
            if isinstance(msg, TokenDelta):
                deltas.append(msg)
            else:
                assert isinstance(msg, Finished | ErrorReply), msg
                return deltas, msg

    def close(self) -> None:
        self.sock.close(linger=0)


class Subscription:
    """A SUB socket on both topics, ready once a load report arrived (no slow-joiner loss); a
    CURVE client with ``curve``."""

    def __init__(self, endpoint: str, curve: CurveClientKeys | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self.sock)
        for topic in (b"kv", b"load"):
            self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.loads: list[LoadReport] = []
        self.kv: list[KVEvent] = []
        self.wait_for(lambda: bool(self.loads), "a load report")

    def wait_for(self, done: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0 and self.sock.poll(left_ms), f"no {what} within {timeout_s} s"
            topic, seq, payload = self.sock.recv_multipart()
            assert len(seq) == 8, f"seq frame of {len(seq)} bytes"
            if topic == b"load":
                self.loads.append(msgspec.msgpack.decode(payload, type=LoadReport))
            else:
                assert topic == b"kv", topic
                self.kv += decode_batch(payload).events

    def close(self) -> None:
        self.sock.close(linger=0)


# ---------------------------------------------------------------------- workers


def start_cli_worker(*flags: str) -> WorkerProcess:
    """``agentgate worker FLAGS`` (run as ``python -m gateway.cli``), waited for its start line
    (bounded); the caller stops it. Unlike ``spawn_worker``, the flags choose the ports."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "worker", *flags], cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    lines: list[str] = []  # NOTE: appended by the pump thread for the worker's whole life
    threading.Thread(target=_pump, args=(proc, lines), daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        if m := next(filter(None, map(START_LINE.search, list(lines))), None):
            return WorkerProcess(proc, m[1], m[2], m[3], lines)
        time.sleep(0.05)
    proc.kill()
    proc.wait(timeout=10)
    pytest.fail(f"worker did not start (rc={proc.returncode}):\n{''.join(lines)}")


NATIVE_KV_BUDGET_MB = 8


def start_native_worker(model_dir: Path) -> WorkerProcess:
    """A native worker on ``model_dir`` on the CPU with a ``NATIVE_KV_BUDGET_MB`` KV cache, on
    free ports; the caller stops it (``with running(...)``)."""
    return spawn_worker(model_dir=model_dir, backend="native", timeout_s=START_TIMEOUT_S,
                        extra_args=["--device", "cpu", "--kv-budget-mb", str(NATIVE_KV_BUDGET_MB)])


@contextmanager
def running(worker: WorkerProcess) -> Iterator[WorkerProcess]:
    """Stops ``worker`` on exit (SIGTERM, which must exit 0); a failure shows the worker's log."""
    try:
        yield worker
    except BaseException as e:
        worker.stop(signal.SIGKILL)
        raise AssertionError(f"{e}\n--- worker log ---\n{''.join(worker.stderr)}") from e
    worker.stop(signal.SIGTERM)
    rc = worker.proc.returncode
    assert rc == 0, f"worker exited with {rc}:\n{''.join(worker.stderr)}"


@contextmanager
def worker_thread(engine_cfg: EngineConfig, cfg: WorkerConfig | None = None) -> Iterator[Worker]:
    """A worker serving from a thread of this process (so a test can reach into its engine)."""
    cfg = cfg or WorkerConfig(listen=ANY_PORT, events=ANY_PORT, worker_id="inproc", cost="zero")
    worker = Worker(cfg, engine_cfg)
    thread = threading.Thread(target=worker.serve, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(timeout=5)
        worker.close()
    assert not thread.is_alive(), "Worker.serve() did not return after stop()"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- builders and assertions


def make_prompt(n: int) -> list[int]:
    """A prompt no other test uses (so its pages are new to the cache)."""
    k = next(_prompt_ids)
    return [(k * 7919 + i * 31) % 300 for i in range(n)]


def tokens(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def assert_finished(last: object, reason: str, completion_tokens: int) -> Finished:
    assert isinstance(last, Finished), f"expected Finished({reason!r}), got {last}"
    assert (last.finish_reason, last.completion_tokens) == (reason, completion_tokens), last
    return last


def assert_error(msg: object, request_id: str | None, code: str) -> None:
    assert isinstance(msg, ErrorReply), f"expected ErrorReply({code!r}), got {msg}"
    assert (msg.request_id, msg.code) == (request_id, code), msg


def _pump(proc: subprocess.Popen[str], lines: list[str]) -> None:
    assert proc.stderr is not None
    lines.extend(proc.stderr)  # NOTE: keeps the pipe drained
