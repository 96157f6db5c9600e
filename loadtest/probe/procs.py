"""Processes the probe starts (gateways, sim workers, redis-server) and /proc readers;
``Ctx`` is what each item gets."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

# NOTE: each item's time box in probe_hardening.run_item; item 11 sizes its waits from it too.
ITEM_BOX_S = {1: 150, 2: 330, 3: 150, 7: 120, 8: 90, 9: 160, 10: 90, 11: 300, 12: 120, 13: 150}
READY_TIMEOUT_S = 90.0
WORKER_START_TIMEOUT_S = 90.0
LOCAL = "127.0.0.1"
MODEL = "demo"  # the served model name: the model directory's name


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCAL, 0))
        return s.getsockname()[1]


def proc_state(pid: int) -> str | None:
    """The /proc state letter (R, S, Z, ...) of ``pid``; None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def is_alive(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z", "X")


def parent_pid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    """All live-or-zombie descendants of ``pid`` (scans /proc once)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (ppid := parent_pid(int(entry.name))) is not None:
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def worker_pids(pid: int) -> list[int]:
    """Descendants of ``pid`` that run ``engine.worker``."""
    return [p for p in descendants(pid) if "engine.worker" in cmdline(p)]


def rss_mb(pid: int, key: str = "VmRSS") -> float | None:
    """``VmRSS`` / ``VmHWM`` of ``pid`` in MB (None when gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def tree_rss_mb(pid: int) -> float:
    """RSS of ``pid`` plus its non-worker descendants (a tokenizer pool, if any)."""
    pids = [pid] + [p for p in descendants(pid) if "engine.worker" not in cmdline(p)]
    return sum(rss_mb(p) or 0.0 for p in pids)


def kill_quietly(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


class Procs:
    """Everything one item starts; ``close()`` kills it all, descendants included."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pids: set[int] = set()

    def spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        log = (self.root / f"{name}.log").open("ab")
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=full_env)
        log.close()
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def adopt(self, pids: list[int]) -> None:
        self.pids.update(pids)

    def close(self) -> None:
        for proc in self.procs:
            self.pids.update(descendants(proc.pid))
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        deadline = time.monotonic() + 5
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for pid in self.pids | {p.pid for p in self.procs}:
            kill_quietly(pid)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    port: int
    name: str

    @property
    def url(self) -> str:
        return f"http://{LOCAL}:{self.port}"

    def workers(self) -> list[int]:
        return worker_pids(self.proc.pid)


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    port: int
    events_port: int

    @property
    def endpoint(self) -> str:
        return f"tcp://{LOCAL}:{self.port}"


@dataclass
class Ctx:
    """What an item gets: its processes, the model dir, and a recorder of figures."""

    procs: Procs
    model_dir: Path
    out_path: Path
    figures: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def rec(self, **values: Any) -> None:
        """Record figures; written at once so a hung item still reports what it had."""
        with self.lock:
            self.figures.update(values)
            self.out_path.write_text(json.dumps(self.figures, default=str))

    def gateway(self, *args: str, workers: int | None = 1, wait: str = "/ready",
                name: str = "gateway") -> Gateway:
        port = free_port()
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--model", str(self.model_dir),
               "--backend", "sim", "--host", LOCAL, "--port", str(port), *args]
        if workers is not None:
            cmd += ["--workers", str(workers)]
        gw = Gateway(self.procs.spawn(name, cmd), port, name)
        if wait:
            wait_http(gw, wait, READY_TIMEOUT_S, self.procs)
        return gw

    def worker(self, *, port: int | None = None, events_port: int | None = None,
               cost: str = "cpu", env: dict[str, str] | None = None, name: str = "worker",
               trigger: Path | None = None) -> Worker:
        """A sim worker; with ``trigger``, it imports everything first and binds only once that
        file exists (call ``wait_worker`` then), so it can replace a killed one within ~1 s."""
        port, events_port = port or free_port(), events_port or free_port()
        args = ["--backend", "sim", "--model", str(self.model_dir), "--listen",
                f"tcp://{LOCAL}:{port}", "--events", f"tcp://{LOCAL}:{events_port}", "--cost", cost]
        if trigger is None:
            proc = self.procs.spawn(name, [sys.executable, "-m", "engine.worker", *args], env)
            self.wait_worker(name, proc)
        else:
            cmd = [sys.executable, "-c", _STANDBY_WORKER, str(trigger), *args]
            proc = self.procs.spawn(name, cmd, env)
        return Worker(proc, port, events_port)

    def wait_worker(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while "listening on" not in self.procs.log(name):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start:\n{self.procs.log(name)[-2000:]}")
            time.sleep(0.02)

    def redis(self, port: int | None = None, name: str = "redis") -> tuple[subprocess.Popen[bytes],
                                                                           int]:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed")
        port = port or free_port()
        data = self.procs.root / f"{name}-data"
        data.mkdir(exist_ok=True)
        proc = self.procs.spawn(name, [exe, "--port", str(port), "--bind", LOCAL, "--save", "",
                                       "--appendonly", "yes", "--appendfsync", "always",
                                       "--dir", str(data)])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(OSError), socket.create_connection((LOCAL, port), 1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, port
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start:\n{self.procs.log(name)[-2000:]}")


# NOTE: `python -m engine.worker`, but with its imports done before it waits for a trigger file,
# so that a replacement binds the old worker's port within ~1 s of the kill (item 9).
_STANDBY_WORKER = """
import pathlib, runpy, sys, time
import engine.sim
try:  # NOTE: engine/worker/ (a package) since issue 9; before that the module engine/worker.py
    import engine.worker.server
except ImportError:
    import engine.worker
trigger = pathlib.Path(sys.argv[1])
while not trigger.exists():
    time.sleep(0.01)
sys.argv = ["engine.worker", *sys.argv[2:]]
runpy.run_module("engine.worker", run_name="__main__", alter_sys=True)
"""


def wait_http(gw: Gateway, path: str, timeout_s: float, procs: Procs) -> float:
    """Poll ``path`` until 200; returns the seconds it took. Raises if the gateway exits."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if gw.proc.poll() is not None:
            raise RuntimeError(f"gateway exited rc={gw.proc.returncode}:\n"
                               f"{procs.log(gw.name)[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(gw.url + path, timeout=2).status_code == 200:
                return time.monotonic() - start
        time.sleep(0.2)
    raise RuntimeError(f"{gw.url}{path} not 200 within {timeout_s} s:\n"
                       f"{procs.log(gw.name)[-2000:]}")
