"""``agentgate serve``: start worker subprocesses (``python -m engine.worker``) on free ports, wait
for their start lines, and run the gateway app on an ASGI server; stopping it stops the workers.

The gateway process never imports torch: the engine only runs in the worker subprocesses.
"""

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ANY_PORT = "tcp://127.0.0.1:0"
START_LINE = re.compile(r"worker (\S+) listening on (\S+), events on (\S+)")
START_TIMEOUT_S = 120.0


class ServeError(Exception):
    """A worker did not start, or no ASGI server is installed."""


@dataclass
class WorkerProcess:
    """One worker subprocess; ``stderr`` keeps every line it wrote (drained by a thread)."""

    proc: subprocess.Popen[str]
    worker_id: str
    listen: str
    events: str
    stderr: list[str] = field(default_factory=list)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        """Send ``sig``, then SIGKILL after ``timeout_s``. Safe to call twice."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)


def spawn_worker(
    *,
    model_dir: Path | None,
    backend: str = "native",
    worker_id: str | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float = START_TIMEOUT_S,
) -> WorkerProcess:
    """Start a worker on free ports and wait (at most ``timeout_s``) for its start line.

    Raises:
        ServeError: the worker exited or did not print its start line in time (its stderr).
    """
    cmd = [sys.executable, "-m", "engine.worker", "--backend", backend,
           "--listen", ANY_PORT, "--events", ANY_PORT, *extra_args]
    if model_dir is not None:
        cmd += ["--model", str(model_dir)]
    if worker_id is not None:
        cmd += ["--worker-id", worker_id]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=_pump, args=(proc, lines), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if m := next(filter(None, map(START_LINE.search, list(lines))), None):
            return WorkerProcess(proc, m[1], m[2], m[3], lines)
        time.sleep(0.05)
    WorkerProcess(proc, "?", "", "").stop()
    raise ServeError(f"worker did not start (rc={proc.returncode}):\n{''.join(lines)}")


def _pump(proc: subprocess.Popen[str], lines: list[str]) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        if _ECHO.is_set():
            sys.stderr.write(line)


_ECHO = threading.Event()  # NOTE: set by serve() so that worker logs reach the terminal


def serve(
    *,
    model_dir: Path,
    num_workers: int,
    attach: Sequence[str],
    host: str,
    port: int,
    backend: str,
    redis_url: str | None = None,
) -> int:
    """Spawn ``num_workers`` workers (none when ``attach`` is given and ``num_workers`` is 0),
    run the app until Ctrl-C, stop the workers. ``redis_url``: the session store (checked
    first: an unreachable Redis is a ``ServeError``); None keeps sessions in memory."""
    try:
        import uvicorn
    except ImportError:
        raise ServeError("no ASGI server installed: pip install uvicorn") from None
    from gateway.app import GatewayConfig, create_app

    if redis_url is not None:
        _check_redis(redis_url)
    _ECHO.set()
    workers: list[WorkerProcess] = []
    try:
        for i in range(num_workers):
            workers.append(spawn_worker(model_dir=model_dir, backend=backend, worker_id=f"w{i}"))
        endpoints = (*attach, *(w.listen for w in workers))
        cfg = GatewayConfig(model_dir=model_dir, workers=endpoints, host=host, port=port,
                            redis_url=redis_url)
        print(f"agentgate: gateway on http://{host}:{port}/v1 over {len(endpoints)} worker(s)",
              file=sys.stderr)
        # NOTE: no access log (one logging call per request on the hot path; /metrics counts
        # requests by endpoint and status instead)
        uvicorn.run(create_app(cfg), host=host, port=port, log_level="warning", access_log=False)
    finally:
        for worker in workers:
            worker.stop()
    return 0


def _check_redis(url: str) -> None:
    import asyncio

    from sessions import StoreUnavailable
    from sessions.redis import connect_redis

    async def ping() -> None:
        store = await connect_redis(url)
        await store.close()

    try:
        asyncio.run(ping())
    except StoreUnavailable as e:
        raise ServeError(f"--redis: {e}") from None
