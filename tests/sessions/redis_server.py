"""``RedisServer``: a real ``redis-server`` a test controls (kill, restart on the same port,
freeze with SIGSTOP and thaw with SIGCONT), for the fault tests of the session store. The
suite-wide ``redis_url`` fixture (tests/conftest.py) is shared and never disturbed."""

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

START_TIMEOUT_S = 10.0


class RedisServer:
    """One redis-server on a fixed 127.0.0.1 port, restartable. ``persistent``: an append-only
    file fsynced on every write in ``work`` (what a restart, even after SIGKILL, reads back);
    otherwise no persistence at all."""

    def __init__(self, work: Path, persistent: bool = False) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed: apt-get install -y redis-server")
        self.exe, self.work, self.persistent = exe, work, persistent
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port: int = s.getsockname()[1]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.persistent else "no", "--appendfsync", "always",
             "--dir", str(self.work),
             "--logfile", str(self.work / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", self.port), 1
            ) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.05)
        pytest.fail(f"redis-server did not start on port {self.port} (rc={self.proc.poll()})")

    def kill(self) -> None:
        """SIGKILL (without persistence every session is lost)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)

    def freeze(self) -> None:
        """SIGSTOP: connections stay open, nothing answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


@contextlib.contextmanager
def redis_server(work: Path, persistent: bool = False) -> Iterator[RedisServer]:
    """A started ``RedisServer``, killed when the block ends (frozen or not)."""
    server = RedisServer(work, persistent)
    server.start()
    try:
        yield server
    finally:
        server.kill()
