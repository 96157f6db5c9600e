"""What the HTTP benchmarks share (``bench_gateway.py``, ``sglang_router_ref.py``): raw
keep-alive HTTP/1.1 requests from asyncio (a raw client spends less CPU than httpx), a streamed
chat completion read to its end, a process's CPU and RSS from ``/proc``, free ports, and the
word list prompts are made of."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORDS = ("the", "agent", "calls", "a", "tool", "reads", "its", "output", "then", "edits", "file",
         "and", "runs", "tests", "again", "until", "they", "pass", "or", "asks", "user", "what")
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")
_MAX_CHUNKS = 1 << 24  # NOTE: bounds a chunked body's read loop
_seen_ns: dict[int, dict[int, int]] = {}  # process id -> thread id -> last schedstat run time


async def request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, method: str,
                  path: str, body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP/1.1 keep-alive request: (status, reply body, by length or chunks)."""
    writer.write(b"%s %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s"
                 % (method.encode(), path.encode(), len(body), body))
    head = await reader.readuntil(b"\r\n\r\n")
    if length := re.search(rb"(?i)\r\ncontent-length: *(\d+)", head):
        return int(head[9:12]), await reader.readexactly(int(length[1]))
    data, _ = await _chunked(reader)
    return int(head[9:12]), data


async def post_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      body: bytes) -> dict[str, Any]:
    """One streamed chat completion (``stream_options.include_usage`` set): content events,
    completion tokens (from the usage), SSE events and HTTP chunks received, seconds to the first
    content event. Raises ``RuntimeError`` for anything but a whole 200 stream."""
    start = time.perf_counter()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    head = await reader.readuntil(b"\r\n\r\n")
    if head[9:12] != b"200" or b"chunked" not in head.lower():
        raise RuntimeError(f"unexpected stream response head: {head[:300]!r}")
    first: list[float] = []

    def seen(piece: bytes) -> None:
        if not first and b'"content"' in piece:
            first.append(time.perf_counter() - start)

    data, http_chunks = await _chunked(reader, seen)
    events = [e for e in data.split(b"\n\n") if e.startswith(b"data: ")]
    usage = [json.loads(e[6:])["usage"] for e in events if b'"usage":{' in e]
    if not events or events[-1] != b"data: [DONE]" or not usage:
        raise RuntimeError(f"incomplete stream: {data[-300:]!r}")
    return {"chunks": sum(1 for e in events if b'"content"' in e),
            "tokens": usage[-1]["completion_tokens"], "events": len(events),
            "http_chunks": http_chunks, "ttft": first[0] if first else 0.0}


async def _chunked(reader: asyncio.StreamReader,
                   seen: Callable[[bytes], None] | None = None) -> tuple[bytes, int]:
    """A chunked body to its zero-size chunk (no trailers), and its number of chunks; ``seen``
    is called with each chunk as it comes."""
    data, count = bytearray(), 0
    for _ in range(_MAX_CHUNKS):
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if not size:
            break
        piece = (await reader.readexactly(size + 2))[:-2]
        count += 1
        if seen is not None:
            seen(piece)
        data += piece
    await reader.readexactly(2)  # NOTE: the last chunk's CRLF
    return bytes(data), count


def cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its descendants: each thread's ``schedstat`` run time (ns),
    the last value seen kept for a thread that has exited since (call it before and after what
    it measures); utime + stime from ``stat`` (10 ms ticks) where no ``schedstat`` is readable."""
    seen = _seen_ns.setdefault(pid, {})
    for p in _tree(pid):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    seen[int(task.name)] = int((task / "schedstat").read_text().split()[0])
    if seen:
        return sum(seen.values()) / 1e9
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # NOTE: utime, stime (fields 14, 15)


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants, MB."""
    total = 0.0
    for p in _tree(pid):
        with contextlib.suppress(OSError, TypeError):
            status = Path(f"/proc/{p}/status").read_text()
            total += int(re.search(r"VmRSS:\s+(\d+)", status)[1]) / 1024  # type: ignore[index]
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (``/proc/<pid>/task/*/children``), bounded."""
    out, todo = [], [pid]
    while todo and len(out) < 256:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                with contextlib.suppress(OSError):
                    todo += [int(c) for c in (task / "children").read_text().split()]
    return out
