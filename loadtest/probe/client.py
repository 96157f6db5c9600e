"""HTTP helpers of the probe: one-shot POSTs, SSE streams, a /health watcher, worker load."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from probe.procs import LOCAL, MODEL, Gateway, tree_rss_mb


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
