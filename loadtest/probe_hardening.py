"""Fault-and-abuse probe for issue 8: before/after figures for items 1-3 and 7-13.

    python loadtest/probe_hardening.py [--items 1,2,3,7,8,9,10,11,12,13] [--json out.json]

Starts real processes on 127.0.0.1 only (``python -m gateway.cli serve``, sim workers via
``python -m engine.worker``, ``redis-server``), measures, prints one line per item, and kills
everything it started. Each item runs in its own process group with a time box: a hang is
reported as ``hung > N s`` with whatever figures it had by then. Uses only flags that exist in
both the pre-fix tree (bef7ef4) and later ones, so the same script measures both: run it with
``PYTHONPATH=<tree>`` (and cwd there) to measure another checkout than the installed one.

Figures are wall-clock times on whatever box runs it; on a shared 2-core box they are noisy, so
read them as "seconds vs. a minute", not to the millisecond.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ALL_ITEMS = (1, 2, 3, 7, 8, 9, 10, 11, 12, 13)
ITEM_BOX_S = {1: 150, 2: 330, 3: 150, 7: 120, 8: 90, 9: 160, 10: 90, 11: 300, 12: 120, 13: 150}
READY_TIMEOUT_S = 90.0
WORKER_START_TIMEOUT_S = 90.0
LOCAL = "127.0.0.1"
MODEL = "demo"  # the served model name: the model directory's name

# --- processes ------------------------------------------------------------------------------


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


# --- HTTP ------------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int | str  # an HTTP status, or the exception's class name
    elapsed_s: float
    body: str = ""
    headers: dict[str, str] = field(default_factory=dict)

    def code(self) -> str:
        """The OpenAI error code (or type), when the body is an error."""
        with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
            err = json.loads(self.body)["error"]
            return str(err.get("code") or err.get("type"))
        return ""

    def short(self) -> str:
        code = self.code()
        return f"{self.status}{f' {code}' if code else ''} in {self.elapsed_s:.1f} s"


def post(url: str, body: Any, timeout_s: float, headers: dict[str, str] | None = None) -> Reply:
    """POST JSON (``body`` may be pre-encoded bytes); never raises."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    start = time.monotonic()
    try:
        r = httpx.post(url, content=data, timeout=timeout_s,
                       headers={"content-type": "application/json", **(headers or {})})
        return Reply(r.status_code, time.monotonic() - start, r.text[:2000], dict(r.headers))
    except httpx.HTTPError as e:
        return Reply(type(e).__name__, time.monotonic() - start)


@dataclass
class Stream:
    """One SSE response read to its end: status, frames, whether it carried an error."""

    status: int | str = "not started"
    frames: list[str] = field(default_factory=list)  # data payloads
    events: list[str] = field(default_factory=list)  # `event:` names
    done: bool = False  # saw `data: [DONE]`
    elapsed_s: float = 0.0
    first_frame_s: float | None = None

    @property
    def has_error(self) -> bool:
        return "error" in self.events or any('"error"' in f[:200] for f in self.frames)

    @property
    def failed(self) -> bool:
        return self.status != 200 or self.has_error or not (self.done or self.last_type())

    def last_type(self) -> str:
        with contextlib.suppress(ValueError, IndexError, AttributeError, TypeError):
            return str(json.loads(self.frames[-1]).get("type") or "")
        return ""

    def short(self) -> str:
        tail = "error frame" if self.has_error else ("[DONE]" if self.done else self.last_type())
        return f"{self.status}, {tail or 'no end frame'}, {self.elapsed_s:.1f} s"


def stream(url: str, body: dict[str, Any], timeout_s: float, started: threading.Event | None = None
           ) -> Stream:
    """POST and read an SSE body to its end, at most ``timeout_s`` in all; never raises."""
    out, start = Stream(), time.monotonic()
    try:
        with httpx.stream("POST", url, json=body, timeout=httpx.Timeout(timeout_s)) as r:
            out.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("event:"):
                    out.events.append(line[6:].strip())
                elif line.startswith("data:"):
                    data = line[5:].strip()
                    if out.first_frame_s is None:
                        out.first_frame_s = time.monotonic() - start
                        if started is not None:
                            started.set()
                    out.done = out.done or data == "[DONE]"
                    if data != "[DONE]":
                        out.frames.append(data)
                if time.monotonic() - start > timeout_s:
                    out.status = f"{out.status} cut at {timeout_s} s"
                    break
    except httpx.HTTPError as e:
        out.status = f"{out.status}/{type(e).__name__}"
    out.elapsed_s = time.monotonic() - start
    return out


def in_thread(fn: Callable[[], Any]) -> Callable[[float], Any]:
    """Run ``fn`` in a daemon thread; returns ``join(timeout_s) -> result or None``."""
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    thread.start()

    def join(timeout_s: float) -> Any:
        thread.join(timeout_s)
        return box[0] if box else None

    return join


class HealthWatch:
    """Polls ``/health`` (and samples the gateway's RSS) in a thread; ``max_s`` is the worst
    latency seen, counting a call still in flight when it stops."""

    def __init__(self, gw: Gateway, interval_s: float = 0.1) -> None:
        self.gw, self.interval_s = gw, interval_s
        self.max_s, self.calls, self.failures, self.rss_peak_mb = 0.0, 0, 0, 0.0
        self._stop = threading.Event()
        self._in_flight_since: float | None = None
        self._threads = [threading.Thread(target=self._health, daemon=True),
                         threading.Thread(target=self._rss, daemon=True)]

    def __enter__(self) -> HealthWatch:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if (since := self._in_flight_since) is not None:
            self.max_s = max(self.max_s, time.monotonic() - since)

    def _health(self) -> None:
        with httpx.Client(timeout=300) as client:
            while not self._stop.is_set():
                self._in_flight_since = start = time.monotonic()
                try:
                    ok = client.get(self.gw.url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self._in_flight_since = None
                self.max_s = max(self.max_s, time.monotonic() - start)
                self.calls, self.failures = self.calls + 1, self.failures + (not ok)
                self._stop.wait(self.interval_s)

    def _rss(self) -> None:
        while not self._stop.is_set():
            self.rss_peak_mb = max(self.rss_peak_mb, tree_rss_mb(self.gw.proc.pid))
            self._stop.wait(0.1)


def chat(model_max_tokens: int, content: str = "Tell me a long story.", **extra: Any
         ) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": model_max_tokens,
            "messages": [{"role": "user", "content": content}], **extra}


def read_load(events_port: int, wait_s: float = 3.0) -> dict[str, Any] | None:
    """The newest ``LoadReport`` a worker publishes on its PUB socket within ``wait_s``."""
    import zmq

    from engine.protocol import decode_worker

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"load")
    sub.connect(f"tcp://{LOCAL}:{events_port}")
    report: dict[str, Any] | None = None
    try:
        deadline = time.monotonic() + wait_s
        while (left_s := deadline - time.monotonic()) > 0:
            if sub.poll(int(max(1, left_s * 1000))):
                msg = decode_worker(sub.recv_multipart()[-1])
                report = {"num_running": msg.num_running, "num_waiting": msg.num_waiting}
    finally:
        sub.close()
    return report


def gateway_worker_events(log_text: str) -> list[int]:
    """Events ports of the workers a gateway spawned, from their start lines in its log."""
    ports = []
    for line in log_text.splitlines():
        if "listening on" in line and "events on" in line:
            with contextlib.suppress(ValueError, IndexError):
                ports.append(int(line.split("events on")[1].strip().split(":")[-1].rstrip(",")))
    return ports


# --- items -----------------------------------------------------------------------------------


def item1_grammar(ctx: Ctx) -> str:
    """20 unrelated streams on a 2-worker gateway while one request has a 7,000-property
    response_format schema."""
    gw = ctx.gateway(workers=2)
    props = {f"p{i:04d}": {"type": "integer"} for i in range(7000)}
    schema = {"type": "object", "properties": props}
    huge = chat(16, response_format={"type": "json_schema", "json_schema": {
        "name": "big", "schema": schema}})
    ctx.rec(schema_kb=round(len(json.dumps(schema)) / 1024))
    url, started = gw.url + "/v1/chat/completions", threading.Event()
    body = chat(1500, stream=True)
    joins = [in_thread(lambda: stream(url, body, 100, started)) for _ in range(20)]
    started.wait(30)
    time.sleep(1.0)
    with HealthWatch(gw) as health:
        huge_reply = post(url, huge, 100)
        results = [j(110) for j in joins]
    failed = sum(1 for s in results if s is None or s.failed)
    ctx.rec(unrelated_failed=failed, huge=huge_reply.short(), health_max_s=health.max_s)
    return (f"unrelated streams failed {failed}/20; huge-schema request ({ctx.figures['schema_kb']}"
            f" kB) {huge_reply.short()}; max /health {health.max_s:.2f} s")


def item2_huge_bodies(ctx: Ctx) -> str:
    """A ~15 MiB chat body, 400k empty messages, 10k tools: status, time, /health, RSS."""
    gw = ctx.gateway(workers=1)
    url, pid = gw.url + "/v1/chat/completions", gw.proc.pid
    rss_before = tree_rss_mb(pid)
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9)))
             for _ in range(5000)]
    text = " ".join(rng.choices(words, k=2_600_000))[: 15 * 2**20 - 1000]
    big = json.dumps(chat(8, text)).encode()
    del text
    parts = [f"before {rss_before:.0f} MB"]
    with HealthWatch(gw) as health:
        reply = post(url, big, 150)
    del big
    hwm = rss_mb(pid, "VmHWM") or 0.0
    time.sleep(3.0)
    rss_after = tree_rss_mb(pid)
    ctx.rec(body15_mib=reply.short(), body15_health_max_s=health.max_s, rss_before_mb=rss_before,
            rss_peak_mb=max(hwm, health.rss_peak_mb), rss_after_3s_mb=rss_after)
    parts.append(f"peak {max(hwm, health.rss_peak_mb):.0f} MB, after {rss_after:.0f} MB")
    lines = [f"15 MiB body {reply.short()}, max /health {health.max_s:.1f} s"]
    empty = json.dumps({"model": MODEL, "max_tokens": 8,
                        "messages": [{"role": "user", "content": ""}] * 400_000}).encode()
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Tool number {i}.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
        for i in range(10_000)]
    for name, body in (("400k empty messages", empty),
                       ("10k tools", json.dumps(chat(8, tools=tools)).encode())):
        with HealthWatch(gw) as health:
            reply = post(url, body, 150)
        key = name.split()[0]
        ctx.rec(**{f"{key}": reply.short(), f"{key}_health_max_s": health.max_s})
        lines.append(f"{name} {reply.short()}, max /health {health.max_s:.1f} s")
    ctx.rec(rss_after_all_mb=tree_rss_mb(pid))
    return "; ".join(lines) + f"; gateway RSS {', '.join(parts)}"


def item3_stop_strings(ctx: Ctx) -> str:
    """A stop string of 1M characters on a 1,000-token answer."""
    gw = ctx.gateway(workers=1)
    stop = ("never-matches-" * 80_000)[:1_000_000]
    with HealthWatch(gw) as health:
        reply = post(gw.url + "/v1/chat/completions", chat(1000, stop=[stop]), 120)
    ctx.rec(stop_1m=reply.short(), health_max_s=health.max_s)
    return f"1M-char stop string: {reply.short()}, max /health {health.max_s:.1f} s"


def item7_sigterm(ctx: Ctx) -> str:
    """Workers alive 5 s after SIGTERM (idle, and with 2 streams in flight) and after SIGKILL
    of `serve --workers 2`; requests still running on the workers then."""
    parts = [_signal_gateway(ctx, signal.SIGTERM, busy=False),
             _signal_gateway(ctx, signal.SIGTERM, busy=True),
             _signal_gateway(ctx, signal.SIGKILL, busy=True)]
    return "; ".join(parts)


def _signal_gateway(ctx: Ctx, sig: int, busy: bool) -> str:
    name = f"{signal.Signals(sig).name}-{'busy' if busy else 'idle'}"
    gw = ctx.gateway(workers=2, name=f"gateway-{name}")
    pids = gw.workers()
    ctx.procs.adopt(pids)
    url, body = gw.url + "/v1/chat/completions", chat(3000, stream=True)
    joins = [in_thread(lambda: stream(url, body, 40)) for _ in range(2 if busy else 0)]
    time.sleep(2.0)
    signalled = time.monotonic()
    gw.proc.send_signal(sig)
    exited_at = in_thread(lambda: _wait_exit(gw.proc, 45))
    time.sleep(5.0)
    alive = [p for p in pids if is_alive(p)]
    orphaned = sum(1 for p in alive if parent_pid(p) != gw.proc.pid)
    running = [load["num_running"] for port in gateway_worker_events(ctx.procs.log(gw.name))
               if (load := read_load(port, 2.0)) is not None]
    gw_exit = gw.proc.poll()
    ctx.rec(**{f"{name}_workers": len(pids), f"{name}_alive_5s": len(alive),
               f"{name}_reparented": orphaned, f"{name}_gateway_rc_5s": gw_exit,
               f"{name}_requests_still_running": sum(running)})
    line = (f"{name}: {len(alive)}/{len(pids)} workers alive after 5 s ({orphaned} re-parented),"
            f" gateway rc at 5 s={gw_exit}")
    if busy:
        line += f", requests still running on workers={sum(running)}"
        ends = [j(45) for j in joins]
        streams = ", ".join("hung" if e is None else e.short() for e in ends)
        line += f", in-flight streams: [{streams}]"
        if (at := exited_at(50)) is None:
            exited = "still running 45 s after the signal"
        else:
            time.sleep(max(0.0, at + 5 - time.monotonic()))
            left = sum(1 for p in pids if is_alive(p))
            exited = (f"exited {at - signalled:.1f} s after the signal (rc={gw.proc.returncode}),"
                      f" workers alive 5 s after that: {left}/{len(pids)}")
        ctx.rec(**{f"{name}_streams": streams, f"{name}_gateway": exited})
        line += f", gateway {exited}"
    for pid in pids:
        kill_quietly(pid)
    gw.proc.kill()
    return line


def _wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> float | None:
    """When ``proc`` exited (monotonic), or None if it is still running after ``timeout_s``."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout_s)
        return time.monotonic()
    return None


def item8_worker_kill(ctx: Ctx) -> str:
    """kill -9 the one spawned worker: zombie? restarted within 15 s? /ready over time?"""
    gw = ctx.gateway(workers=1)
    [pid] = gw.workers()
    ctx.procs.adopt([pid])
    before = httpx.get(gw.url + "/ready", timeout=5).status_code
    kill_quietly(pid)
    start, ready_log, new_pid, zombie = time.monotonic(), [f"0s:{before}"], None, None
    last = before
    while time.monotonic() - start < 15:
        t = time.monotonic() - start
        if zombie is None and t >= 3:
            zombie = proc_state(pid)
        if new_pid is None and (fresh := [p for p in gw.workers() if p != pid and is_alive(p)]):
            new_pid = (fresh[0], round(t, 1))
            ctx.procs.adopt(fresh)
        with contextlib.suppress(httpx.HTTPError):
            status = httpx.get(gw.url + "/ready", timeout=5).status_code
            if status != last:
                ready_log.append(f"{t:.1f}s:{status}")
                last = status
        time.sleep(0.3)
    state = {None: "gone (reaped)", "Z": "zombie"}.get(zombie, f"state {zombie}")
    ok = post(gw.url + "/v1/chat/completions", chat(4), 20)
    ctx.rec(state_after_3s=state, restarted=new_pid, ready=ready_log, request_after=ok.short())
    restarted = f"yes ({new_pid[1]} s)" if new_pid else "no"
    return (f"killed worker after 3 s: {state}; new worker within 15 s: {restarted}; "
            f"/ready {' -> '.join(ready_log)}; a request at 15 s: {ok.short()}")


def item9_same_port_restart(ctx: Ctx) -> str:
    """A worker restarted on the same port within ~1 s under a streamed + a non-streamed
    request (the replacement is pre-imported, so only its bind and engine setup remain)."""
    port, events = free_port(), free_port()
    worker = ctx.worker(port=port, events_port=events, name="worker-a")
    trigger = ctx.procs.root / "start-worker-b"
    standby = ctx.worker(port=port, events_port=events, name="worker-b", trigger=trigger)
    gw = ctx.gateway("--worker", worker.endpoint, workers=None)
    url, started = gw.url + "/v1/chat/completions", threading.Event()
    s_join = in_thread(lambda: stream(url, chat(3000, stream=True), 75, started))
    n_join = in_thread(lambda: post(url, chat(3000), 75))
    started.wait(30)
    time.sleep(2.0)  # NOTE: standby imports finish meanwhile; the non-streamed one is running
    worker.proc.kill()
    worker.proc.wait(10)
    killed_at = time.monotonic()
    trigger.touch()
    ctx.wait_worker("worker-b", standby.proc)
    back_s = time.monotonic() - killed_at
    ctx.rec(restart_s=back_s)
    streamed, plain = s_join(80), n_join(80)
    s_txt = "no result" if streamed is None else streamed.short()
    n_txt = "no result" if plain is None else plain.short()
    ctx.rec(streamed=s_txt, non_streamed=n_txt)
    return (f"worker back on the same port {back_s:.1f} s after kill -9; streamed (running for "
            f"~2 s at the kill): {s_txt}; non-streamed: {n_txt} (times from their start; "
            f"max_tokens 3000 at cost cpu; client cap 75 s)")


def item10_late_worker(ctx: Ctx) -> str:
    """`serve --worker tcp://...` with nothing there: time to listen; then the worker starts."""
    port = free_port()
    start = time.monotonic()
    gw = ctx.gateway("--worker", f"tcp://{LOCAL}:{port}", workers=None, wait="")
    try:
        listen_s = wait_http(gw, "/health", 60, ctx.procs)
    except RuntimeError as e:
        ctx.rec(listen="never", error=str(e)[:300])
        return f"gateway never listened within 60 s ({str(e).splitlines()[0]})"
    ctx.rec(listen_s=time.monotonic() - start)
    ctx.worker(port=port, cost="zero")
    up = time.monotonic()
    result = "no"
    while time.monotonic() - up < 15:
        reply = post(gw.url + "/v1/chat/completions", chat(4), 5)
        if reply.status == 200:
            result = f"yes, {time.monotonic() - up:.1f} s after the worker started"
            break
        time.sleep(0.5)
    ctx.rec(request_within_15s=result, last_reply=reply.short())
    return (f"gateway listening {listen_s:.1f} s after start (worker absent); request after "
            f"the worker came up succeeded within 15 s: {result} (last: {reply.short()})")


def item11_redis_outage(ctx: Ctx) -> str:
    """A session turn across an 8 s Redis freeze, and across a 3 s Redis kill + restart."""
    variants = {"freeze 8 s": _freeze_redis, "kill 3 s": _kill_redis}
    joins = {name: in_thread(lambda fn=fn, name=name: _session_outage(ctx, name, fn))
             for name, fn in variants.items()}
    lines = [f"{name}: {joins[name](ITEM_BOX_S[11] - 20) or 'hung'}" for name in variants]
    return "; ".join(lines)


def _freeze_redis(ctx: Ctx, redis: subprocess.Popen[bytes], port: int, name: str
                  ) -> subprocess.Popen[bytes]:
    redis.send_signal(signal.SIGSTOP)
    time.sleep(8)
    redis.send_signal(signal.SIGCONT)
    return redis


def _kill_redis(ctx: Ctx, redis: subprocess.Popen[bytes], port: int, name: str
                ) -> subprocess.Popen[bytes]:
    redis.kill()
    redis.wait(5)
    time.sleep(3)
    return ctx.redis(port, name=name)[0]


def _session_outage(ctx: Ctx, name: str, outage: Callable[..., subprocess.Popen[bytes]]) -> str:
    """Start a short streamed turn, begin the outage at its first frame (so the turn ends, and
    writes its answer, while Redis is away), then poll for a new turn."""
    key = name.split()[0]
    redis, port = ctx.redis(name=f"redis-{key}")
    gw = ctx.gateway("--redis", f"redis://{LOCAL}:{port}/0", workers=1, name=f"gateway-{key}")
    sid = json.loads(post(gw.url + "/v1/sessions", {"system": "Be brief."}, 20).body)["id"]
    turns, started = gw.url + f"/v1/sessions/{sid}/turns", threading.Event()
    turn = in_thread(lambda: stream(turns, {"max_tokens": 200, "stream": True, "messages": [
        {"role": "user", "content": "Tell me a story."}]}, 60, started))
    started.wait(30)
    outage(ctx, redis, port, f"redis-{key}")
    back = time.monotonic()
    first = turn(65)
    state = httpx.get(gw.url + f"/v1/sessions/{sid}", timeout=10)
    recorded = state.status_code == 200 and len(state.json().get("turns", [])) > 0
    after, last = None, None
    while time.monotonic() - back < 90:
        last = post(turns, {"max_tokens": 2, "messages": [
            {"role": "user", "content": "Again."}]}, 20)
        if last.status != 409:
            after = time.monotonic() - back
            break
        time.sleep(2)
    first_txt = "no reply" if first is None else first.short()
    accepted = f"{after:.1f} s ({last.short()})" if after is not None else "> 90 s (409)"
    ctx.rec(**{f"{key}_turn": first_txt, f"{key}_answer_recorded": recorded,
               f"{key}_new_turn_accepted_after": accepted})
    return (f"streamed turn {first_txt}, answer recorded: {'yes' if recorded else 'no'}, "
            f"new turn accepted {accepted} after Redis was back")


def item12_redis_dies_at_turn_end(ctx: Ctx) -> str:
    """Redis killed while an SSE turn and a WebSocket turn run: do both get an error frame?"""
    from websockets.sync.client import connect

    redis, port = ctx.redis()
    gw = ctx.gateway("--redis", f"redis://{LOCAL}:{port}/0", workers=1)
    sids = [json.loads(post(gw.url + "/v1/sessions", {}, 20).body)["id"] for _ in range(2)]
    turn = {"max_tokens": 1000, "messages": [{"role": "user", "content": "Tell me a story."}]}
    sse = in_thread(lambda: stream(gw.url + f"/v1/sessions/{sids[0]}/turns",
                                   {**turn, "stream": True}, 45))
    ws_url = gw.url.replace("http://", "ws://") + f"/v1/sessions/{sids[1]}/ws"
    frames: list[str] = []

    def ws_turn() -> str:
        try:
            with connect(ws_url, open_timeout=20) as ws:
                ws.send(json.dumps({"type": "turn", **turn}))
                deadline = time.monotonic() + 45
                while time.monotonic() < deadline:
                    frame = json.loads(ws.recv(timeout=deadline - time.monotonic()))
                    frames.append(frame["type"])
                    if frame["type"] in ("turn_end", "error"):
                        return frame["type"]
                return "no turn_end or error within 45 s"
        except TimeoutError:
            return "no turn_end or error within 45 s"
        except Exception as e:  # noqa: BLE001 - the probe reports whatever ended the socket
            return f"socket ended ({type(e).__name__}) without turn_end or error"

    ws_join = in_thread(ws_turn)
    time.sleep(2.0)
    redis.kill()
    sse_result, ws_result = sse(50), ws_join(50)
    sse_txt = "no result" if sse_result is None else (
        f"{sse_result.short()}, error frame: {'yes' if sse_result.has_error else 'no'}, "
        f"last frame type: {sse_result.last_type() or '-'}")
    ctx.rec(sse=sse_txt, websocket=ws_result or "hung", ws_frames=len(frames))
    return f"SSE turn: {sse_txt}; WebSocket turn: {ws_result or 'hung'} ({len(frames)} frames)"


def item13_backpressure(ctx: Ctx) -> str:
    """A full worker queue: 429 vs 503 and Retry-After; then 50 clients that disconnect."""
    tiny = ctx.worker(cost="cpu", name="worker-tiny", env={
        "AGENTGATE_MAX_RUNNING_REQUESTS": "1", "AGENTGATE_MAX_WAITING_REQUESTS": "1"})
    gw = ctx.gateway("--worker", tiny.endpoint, workers=None, name="gateway-tiny")
    url = gw.url + "/v1/chat/completions"
    joins = [in_thread(lambda: post(url, chat(300), 60)) for _ in range(20)]
    replies = [j(70) for j in joins]
    counts: dict[str, int] = {}
    for r in replies:
        key = "hung" if r is None else str(r.status) + (f" {r.code()}" if r.code() else "")
        counts[key] = counts.get(key, 0) + 1
    retry_after = sum(1 for r in replies if r is not None and "retry-after" in r.headers)
    rejected = sum(1 for r in replies if r is not None and r.status in (429, 503))
    ctx.rec(flood_statuses=counts, retry_after=f"{retry_after}/{rejected}")
    worker = ctx.worker(cost="cpu", name="worker-default")
    gw2 = ctx.gateway("--worker", worker.endpoint, workers=None, name="gateway-default")
    url2 = gw2.url + "/v1/chat/completions"
    quitters = [in_thread(lambda: post(url2, chat(3000), 2.0)) for _ in range(50)]
    during = read_load(worker.events_port, 1.5)
    for join in quitters:
        join(30)
    time.sleep(3.0)
    load = read_load(worker.events_port, 3.0)
    ctx.rec(during_load=during, after_disconnect_load=load)
    return (f"20 requests on a 1-running/1-waiting worker: {counts}, Retry-After on "
            f"{retry_after} of {rejected} 429/503; 50 clients that disconnect after 2 s: worker "
            f"load while they wait {during}, 3 s after they left {load}")


ITEMS: dict[int, Callable[[Ctx], str]] = {
    1: item1_grammar, 2: item2_huge_bodies, 3: item3_stop_strings, 7: item7_sigterm,
    8: item8_worker_kill, 9: item9_same_port_restart, 10: item10_late_worker,
    11: item11_redis_outage, 12: item12_redis_dies_at_turn_end, 13: item13_backpressure,
}


# --- driver ----------------------------------------------------------------------------------


def run_one(item: int, root: Path, model_dir: Path, out_path: Path) -> int:
    """Child-process entry: run one item, write its figures and summary line to ``out_path``."""
    procs = Procs(root)
    ctx = Ctx(procs, model_dir, out_path)
    try:
        ctx.rec(line=ITEMS[item](ctx))
    except Exception as e:  # noqa: BLE001 - reported as the item's line
        ctx.rec(line=f"could not run: {type(e).__name__}: {str(e)[:600]}")
    finally:
        procs.close()
    return 0


def run_item(item: int, root: Path, model_dir: Path) -> dict[str, Any]:
    """Run ``item`` in its own process group, killed (all of it) after its time box."""
    item_root = root / f"item{item}"
    item_root.mkdir()
    out_path = item_root / "result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_one", str(item),
           "--_root", str(item_root), "--model", str(model_dir)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=(item_root / "driver.log").open("wb"), stderr=subprocess.STDOUT)
    hung = False
    try:
        proc.wait(timeout=ITEM_BOX_S[item])
    except subprocess.TimeoutExpired:
        hung = True
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    figures = json.loads(out_path.read_text()) if out_path.exists() else {}
    figures["elapsed_s"] = round(time.monotonic() - start, 1)
    if hung:
        figures["line"] = f"hung > {ITEM_BOX_S[item]} s (partial: {figures})"
    elif "line" not in figures:
        log = (item_root / "driver.log").read_text(errors="replace")[-600:]
        figures["line"] = f"could not run (rc={proc.returncode}): {log}"
    return figures


def ensure_model(root: Path, given: Path | None) -> Path:
    """The model dir, named ``demo``: later trees serve a model under its directory's name
    (issue 8 item 16) and refuse others, earlier ones accept any name."""
    model_dir = root / MODEL
    if given is not None:
        model_dir.symlink_to(given.resolve(), target_is_directory=True)
        return model_dir
    subprocess.run([sys.executable, "-m", "gateway.cli", "model", "init", str(model_dir)],
                   check=True, stdout=subprocess.DEVNULL, timeout=300)
    return model_dir


def tree_info() -> dict[str, Any]:
    """Which checkout is measured: subprocesses inherit PYTHONPATH, so they import the same."""
    import engine
    import gateway

    tree = Path(gateway.__file__).resolve().parent.parent
    rev = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "-uno"],
                           capture_output=True, text=True).stdout.strip()
    return {"tree": str(tree), "commit": rev + ("+dirty" if dirty else ""),
            "engine": str(Path(engine.__file__).resolve().parent),
            "loadavg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", default=",".join(map(str, ALL_ITEMS)))
    parser.add_argument("--json", type=Path, help="write all figures here")
    parser.add_argument("--model", type=Path, help="model dir (default: the demo model, written "
                        "fresh); served as 'demo'")
    parser.add_argument("--_one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._one is not None:
        return run_one(args._one, args._root, args.model, args._root / "result.json")
    items = [int(i) for i in args.items.split(",") if i.strip()]
    unknown = set(items) - set(ITEMS)
    if unknown:
        parser.error(f"--items: no such item(s) {sorted(unknown)}; known: {list(ITEMS)}")
    info = tree_info()
    print(f"probe_hardening: tree {info['tree']} @ {info['commit']} (engine from "
          f"{info['engine']}), loadavg "
          f"{info['loadavg'][0]:.1f}, {info['date']}", flush=True)
    results: dict[str, Any] = {"meta": info}
    with tempfile.TemporaryDirectory(prefix="probe-hardening-") as tmp:
        root = Path(tmp)
        model_dir = ensure_model(root, args.model)
        for item in items:
            figures = run_item(item, root, model_dir)
            results[str(item)] = figures
            print(f"item {item}: {figures['line']}  [{figures['elapsed_s']} s]", flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
