"""``live_gateway``: a real ``agentgate serve`` subprocess on a free 127.0.0.1 port, for tests
that talk to it as clients do (urllib, the ``openai`` package, agent frameworks)."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.serve import ServeError, WorkerProcess, spawn_worker

READY_TIMEOUT_S = 90
WORKER_START_TIMEOUT_S = 60
TEST_TENANT_SECRET = "agentgate-test-tenant-secret"


@dataclass(frozen=True, slots=True)
class LiveGateway:
    base_url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen[str]

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 30) -> str:
        """Signal the gateway, wait for it; return what it printed."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out


def start_sim_worker(worker_id: str, cost: str = "zero") -> WorkerProcess:
    """A sim worker (``--cost cpu|h200|zero``) on free ports, started and awaited by the same
    code as ``agentgate serve``; a worker that does not start fails the test."""
    try:
        return spawn_worker(model_dir=None, backend="sim", worker_id=worker_id,
                            extra_args=("--cost", cost), timeout_s=WORKER_START_TIMEOUT_S)
    except ServeError as e:
        pytest.fail(str(e))


@contextlib.contextmanager
def sim_workers(*specs: tuple[str, str]) -> Iterator[tuple[WorkerProcess, ...]]:
    """``start_sim_worker(worker_id, cost)`` for each spec, in order; all are stopped (the last
    first) when the block ends, or when a later one does not start."""
    with contextlib.ExitStack() as stack:
        workers = []
        for worker_id, cost in specs:
            worker = start_sim_worker(worker_id, cost)
            stack.callback(worker.stop)
            workers.append(worker)
        yield tuple(workers)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_gateway(model_dir: Path, *args: str, backend: str = "sim",
                 env: dict[str, str] | None = None) -> Iterator[LiveGateway]:
    """``agentgate serve --model model_dir --backend backend ARGS`` until the block ends;
    ``env`` adds to its environment."""
    port = free_port()
    proc = spawn_serve(model_dir, port, *args, backend=backend, stdout=subprocess.PIPE, text=True,
                       env=env or {})
    gateway = LiveGateway(f"http://127.0.0.1:{port}", proc)
    try:
        wait_ready(proc, gateway.base_url, gateway.stop)
        yield gateway
    finally:
        gateway.stop()


def spawn_serve(
    model_dir: Path, port: int, *args: str, backend: str | None = "sim", **popen: Any
) -> subprocess.Popen[Any]:
    """``agentgate serve --model model_dir [--backend backend] ARGS`` on 127.0.0.1:``port``,
    its stderr into its stdout; ``popen`` goes to ``subprocess.Popen`` (where the output goes)."""
    cmd: Sequence[str] = [
        sys.executable, "-m", "gateway.cli", "serve", "--model", str(model_dir),
        *(("--backend", backend) if backend is not None else ()),
        "--host", "127.0.0.1", "--port", str(port), *args,
    ]
    # NOTE: a fixed tenant secret, so that tests never create one under the user's ~/.config
    # (and no GCache: tests/conftest.py); popen's env adds to or overrides these
    env = {**os.environ, "AGENTGATE_TENANT_SECRET": TEST_TENANT_SECRET, **popen.pop("env", {})}
    return subprocess.Popen(cmd, stderr=subprocess.STDOUT, env=env, **popen)


def wait_ready(
    proc: subprocess.Popen[Any], base_url: str, output: Callable[[], str],
    timeout_s: float = READY_TIMEOUT_S,
) -> None:
    """Poll ``base_url``/ready until it is 200; fail with ``output()`` if ``proc`` exits or
    ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"agentgate serve exited {proc.returncode}:\n{output()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"agentgate serve never got ready:\n{output()}")
        try:
            with urllib.request.urlopen(f"{base_url}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
