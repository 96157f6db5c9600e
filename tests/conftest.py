"""Suite-wide hooks: tests marked `gpu` are skipped when CUDA is not available, tests marked `slow`
unless `-m slow` selects them; `redis_url` runs a real redis-server for the session-store
tests."""

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REDIS_START_TIMEOUT_S = 10.0

# NOTE: the models under test are tiny; on a 2-core box shared with other work, torch's intra-op
# threads only add contention (each small op then waits on a busy core). One thread per process,
# set before anything imports torch; subprocesses (worker, CLI) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# NOTE: `agentgate serve` shares a file GCache under ~/.cache by default; tests that spawn it
# must neither write into the user's home nor find a page an earlier run left there (a cold
# prompt would hit). Tests that want L3 pass --gcache or their own AGENTGATE_GCACHE.
os.environ.setdefault("AGENTGATE_GCACHE", "off")
# NOTE: likewise `agentgate serve` starts an encoder process for a model with a vision tower
# (the demo model has one); tests that send images pass their own AGENTGATE_ENCODER="" or
# --encoder, the rest do not pay for a process they never use
os.environ.setdefault("AGENTGATE_ENCODER", "off")
# NOTE: `agentgate model init` distils the demo model's MTP layers (~20 s) and keeps the result;
# one cache for the whole session, outside the user's home, so tests that give a process its
# own HOME (a fresh demo model) do not distil again
if "AGENTGATE_MTP_CACHE" not in os.environ:
    _MTP_CACHE = tempfile.mkdtemp(prefix="agentgate-test-mtp-")
    os.environ["AGENTGATE_MTP_CACHE"] = _MTP_CACHE
    atexit.register(shutil.rmtree, _MTP_CACHE, True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # NOTE: `slow` tests (the soak) run only when asked for by marker: `-m slow`
    if "slow" not in (config.getoption("markexpr") or ""):
        skip_slow = pytest.mark.skip(reason="slow: run with -m slow")
        for item in items:
            if item.get_closest_marker("slow") is not None:
                item.add_marker(skip_slow)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # NOTE: lazy, so a run without gpu tests never pays for importing torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``redis-server`` on a free 127.0.0.1 port (no persistence) for the whole run."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: apt-get install -y redis-server "
                    "(scripts/test installs it)")
    work = tmp_path_factory.mktemp("redis")
    port = _free_port()
    log = work / "redis.log"
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(work), "--logfile", str(log)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    try:
        _wait_for_redis(port, proc, log)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_redis(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + REDIS_START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return
        time.sleep(0.05)
    text = log.read_text() if log.exists() else ""
    pytest.fail(f"redis-server did not start on port {port} (rc={proc.poll()}):\n{text}")


@pytest.fixture(scope="module")
def curve_key_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CURVE keys (``agentgate keys``) for one module's workers and clients."""
    from engine.worker.curve import write_keys

    out = tmp_path_factory.mktemp("curve")
    write_keys(out)
    return out


@pytest.fixture(scope="module")
def curve_worker(curve_key_dir: Path) -> Iterator[object]:
    """A sim worker with ``--curve-keys`` and a replay socket, for one module; SIGTERM must stop
    it cleanly (exit 0)."""
    from gateway.serve import ANY_PORT, spawn_worker
    from tests.engine.worker_harness import START_TIMEOUT_S, running

    worker = spawn_worker(model_dir=None, backend="sim", worker_id="curve", replay=ANY_PORT,
                          extra_args=["--curve-keys", str(curve_key_dir), "--cost", "zero"],
                          timeout_s=START_TIMEOUT_S)
    with running(worker):
        yield worker
