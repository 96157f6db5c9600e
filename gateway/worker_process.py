"""One engine worker subprocess (``python -m engine.worker``) as ``agentgate serve`` and the tests
start it: ``spawn_worker`` waits for its start line and keeps its stderr (the last
``STDERR_KEEP_LINES`` lines; echoed to this process's stderr once ``echo_worker_logs()``)."""

import collections
import contextlib
import os
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
PUMP_DRAIN_S = 1.0  # NOTE: how long a dead child's last stderr lines may take to be read
STDERR_KEEP_LINES = 1000  # NOTE: a worker logs for as long as it runs: keep a bounded tail


class ServeError(Exception):
    """A worker did not start, the port is taken, or no ASGI server is installed."""


@dataclass
class WorkerProcess:
    """One worker subprocess; ``stderr`` keeps the last lines it wrote (drained by a thread)."""

    proc: subprocess.Popen[str]
    worker_id: str
    listen: str
    events: str
    stderr: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=STDERR_KEEP_LINES))

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
    listen: str = ANY_PORT,
    events: str = ANY_PORT,
    die_with_parent: bool = False,
    cancel: threading.Event | None = None,
    replay: str | None = None,
) -> WorkerProcess:
    """Start a worker on ``listen``/``events`` (free ports by default) and wait (at most
    ``timeout_s``) for its start line.

    Args:
        die_with_parent: the worker stops when this process dies (``--parent-pid``), and runs in
            its own session, so a terminal's Ctrl-C reaches only this process, which drains
            before it stops the workers. Spawn such workers only from a thread that outlives
            them (see ``engine.worker.cli._die_with_parent``).
        cancel: give up (ServeError) as soon as it is set.
        replay: the worker's KV event replay endpoint (``--replay``; ``ANY_PORT`` for a free
            port, announced in its ``Welcome``); None: no replay (a router resyncs on a gap).

    Raises:
        ServeError: the worker exited, did not print its start line in time (its stderr), or
            ``cancel`` was set.
    """
    cmd = [sys.executable, "-m", "engine.worker", "--backend", backend,
           "--listen", listen, "--events", events, *extra_args]
    if model_dir is not None:
        cmd += ["--model", str(model_dir)]
    if worker_id is not None:
        cmd += ["--worker-id", worker_id]
    if replay is not None:
        cmd += ["--replay", replay]
    if die_with_parent:
        cmd += ["--parent-pid", str(os.getpid())]
    proc, m, lines = spawn_child(cmd, START_LINE, timeout_s, cancel,
                                 new_session=die_with_parent, what="worker")
    return WorkerProcess(proc, m[1], m[2], m[3], lines)


def spawn_child(
    cmd: Sequence[str],
    start_line: re.Pattern[str],
    timeout_s: float,
    cancel: threading.Event | None = None,
    *,
    new_session: bool = False,
    stdin: bytes | None = None,
    what: str = "process",
) -> tuple[subprocess.Popen[str], re.Match[str], collections.deque[str]]:
    """Start ``cmd`` (``stdin`` written to it, then closed) and wait (at most ``timeout_s``) for a
    stderr line matching ``start_line``; a thread keeps draining its stderr afterwards. A child
    that printed it is returned even if it has exited since.

    Raises:
        ServeError: it exited, did not print the line in time (its stderr), or ``cancel`` was
            set.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                            start_new_session=new_session)
    if stdin is not None:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # NOTE: it died at once: reported below
            proc.stdin.buffer.write(stdin)  # type: ignore[attr-defined]
            proc.stdin.close()
    lines: collections.deque[str] = collections.deque(maxlen=STDERR_KEEP_LINES)
    start: list[re.Match[str]] = []  # NOTE: the start line's match, set by the pump thread
    pump = threading.Thread(target=_pump, args=(proc, lines, start, start_line), daemon=True)
    pump.start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            # NOTE: its last lines may still be in the pipe: a child that printed its start line
            # and died since is started (the caller's supervisor sees the exit), not refused
            pump.join(PUMP_DRAIN_S)
            if start:
                return proc, start[0], lines
            break
        if cancel is not None and cancel.is_set():
            break
        if start:
            return proc, start[0], lines
        time.sleep(0.05)
    WorkerProcess(proc, "?", "", "").stop()
    raise ServeError(f"{what} did not start (rc={proc.returncode}):\n{''.join(lines)}")


def echo_worker_logs() -> None:
    """From now on, copy every worker's stderr lines to this process's stderr (as written: the
    workers log in the same format, ``engine.logs``)."""
    _ECHO.set()


def _pump(proc: subprocess.Popen[str], lines: collections.deque[str],
          start: list[re.Match[str]], start_line: re.Pattern[str]) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        if not start and (m := start_line.search(line)):
            start.append(m)
        if _ECHO.is_set():
            sys.stderr.write(line)


_ECHO = threading.Event()
