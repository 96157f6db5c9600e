"""Reference figures: the CPU SGLang's Rust router (``sglang-router``, 0.3.2) spends per streamed
SSE chunk and per non-streamed request, in front of ``loadtest/openai_stub_worker.py``.

``measure`` starts stub worker(s) and the router (``python -m sglang_router.launch_router``, its
own process group; the Rust server runs inside that Python process, on tokio threads), drives it
from raw-socket asyncio clients in this process and reads the router's CPU as the sum of its
threads' ``/proc/<pid>/task/*/schedstat`` run time (ns; descendants included, none in 0.3.2),
minus its idle rate measured over ``IDLE_S`` before the cells. It installs nothing: without
``sglang_router`` it prints why and returns ``[]``. Cells:

* stream: ``c`` clients, each one streamed chat completion after another (``stream_tokens``
  tokens, ``stream_options.include_usage``), once per worker pacing in ``step_ms`` (0: the stub
  writes events as fast as it can; 20: one event per stream every 20 ms, like an H200 decode
  step, so the router forwards every event on its own: the costliest case per chunk). The
  per-chunk figures include each stream's request cost spread over its ``stream_tokens``.
* plain: ``c`` clients, non-streamed chat completions of ``max_tokens`` 8 whose messages total
  ~SIZE characters (a system prompt shared by all requests, then a unique user message).

Seen with 0.3.2: the router forwards each upstream HTTP chunk as one downstream chunk (one SSE
event each: no re-chunking, no buffering), but its client sockets lack TCP_NODELAY, so on a
reused keep-alive connection the first event waits ~40 ms (Nagle + delayed ACK; ``ttft``).
The cache-aware tree keeps the text of every prompt routed: RSS grows by about the prompt bytes
(unique ones) until its eviction pass (every 60 s by default); see ``rss_mb``.

    python loadtest/sglang_router_ref.py [--duration S] [--stream-tokens N] [--workers N]
                                         [--step-ms 0,20] [--log-level warn]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from httpbench import WORDS, cpu_s, free_port, post_stream, request, rss_mb

IDLE_S, READY_TIMEOUT_S, KILL_WAIT_S, PLAIN_TOKENS = 3.0, 60.0, 5.0, 8
BODY_SIZES = {"2k": 2048, "20k": 20480}
STUB = Path(__file__).with_name("openai_stub_worker.py")
_ids = itertools.count()


def measure(duration_s: float = 5.0, stream_concurrency: Sequence[int] = (16, 64),
            stream_tokens: int = 256, plain_concurrency: Sequence[int] = (1, 16, 64),
            body_sizes: Mapping[str, int] = BODY_SIZES, *, step_ms: Sequence[float] = (0.0, 20.0),
            workers: int = 1, policy: str = "cache_aware",
            log_level: str = "warn") -> list[dict[str, Any]]:
    """Run the cells (``duration_s`` of load each; a stream in flight at the end is finished and
    counted) and return one dict per cell: ``kind`` ("stream"/"plain"), ``concurrency``,
    ``step_ms`` or ``size``/``body_bytes``, counts and rates, ``cpu_us_per_chunk`` and
    ``cpu_us_per_token`` or ``cpu_us_per_request`` (above idle), ``idle_ms_per_s``,
    ``rss_mb`` (start, max, end). ``workers`` stub workers sit behind one router with ``policy``;
    ``log_level`` is the router's (NOTE: "info" logs two lines per request, costing CPU)."""
    if importlib.util.find_spec("sglang_router") is None:
        print("sglang-router reference skipped: sglang_router is not installed "
              "(pip install sglang-router==0.3.2)")
        return []
    rows: list[dict[str, Any]] = []
    # NOTE: plain cells need an unpaced worker: paced, each request would wait 8 steps
    paces = sorted(set(step_ms) | ({0.0} if plain_concurrency and body_sizes else set()))
    for pace in paces:
        with _stack(workers, pace, policy, log_level) as (pid, port):
            asyncio.run(_cells(rows, pid, port, pace, duration_s,
                               stream_concurrency if pace in step_ms else (), stream_tokens,
                               plain_concurrency if pace == 0.0 else (), body_sizes))
    return rows


async def _cells(rows: list[dict[str, Any]], pid: int, port: int, pace: float, duration_s: float,
                 stream_concurrency: Sequence[int], stream_tokens: int,
                 plain_concurrency: Sequence[int], body_sizes: Mapping[str, int]) -> None:
    await _run_streams(port, 4, 0.5, min(stream_tokens, 16), pid, pace)  # NOTE: warm-up
    t0, cpu0 = time.perf_counter(), cpu_s(pid)
    await asyncio.sleep(IDLE_S)
    idle_per_s = (cpu_s(pid) - cpu0) / (time.perf_counter() - t0)
    for c in stream_concurrency:
        rss0, t0, cpu0 = rss_mb(pid), time.perf_counter(), cpu_s(pid)
        got = await _run_streams(port, c, duration_s, stream_tokens, pid, pace)
        elapsed = time.perf_counter() - t0
        cpu = max(0.0, cpu_s(pid) - cpu0 - idle_per_s * elapsed)
        chunks, tokens = max(got["chunks"], 1), max(got["tokens"], 1)
        rows.append({"kind": "stream", "step_ms": pace, "concurrency": c,
                     "requests": got["requests"], "chunks": got["chunks"], "tokens": got["tokens"],
                     "chunks_per_s": got["chunks"] / elapsed, "tokens_per_chunk": tokens / chunks,
                     "events_per_chunk": got["events"] / max(got["http_chunks"], 1),
                     "ttft_p50_ms": statistics.median(got["ttft"]) * 1e3,
                     "cpu_us_per_chunk": cpu / chunks * 1e6, "cpu_us_per_token": cpu / tokens * 1e6,
                     "idle_ms_per_s": idle_per_s * 1e3,
                     "rss_mb": (rss0, got["rss_max"], rss_mb(pid))})
    for size_name, size in body_sizes.items():
        system, text = plain_prompt(size)
        for c in plain_concurrency:
            rss0, t0, cpu0 = rss_mb(pid), time.perf_counter(), cpu_s(pid)
            got = await run_plain(port, c, duration_s, system, text, pid)
            elapsed = time.perf_counter() - t0
            cpu = max(0.0, cpu_s(pid) - cpu0 - idle_per_s * elapsed)
            n, lat = len(got["latency"]), got["latency"]
            q = statistics.quantiles(lat, n=100) if n > 1 else lat * 99
            rows.append({"kind": "plain", "size": size_name, "body_bytes": got["body_bytes"],
                         "concurrency": c, "requests": n, "rps": n / elapsed,
                         "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3,
                         "cpu_us_per_request": cpu / max(n, 1) * 1e6,
                         "idle_ms_per_s": idle_per_s * 1e3,
                         "rss_mb": (rss0, got["rss_max"], rss_mb(pid))})


async def _run_streams(port: int, concurrency: int, duration_s: float, tokens: int,
                       pid: int, step_ms: float) -> dict[str, Any]:
    got: dict[str, Any] = {"requests": 0, "chunks": 0, "tokens": 0, "events": 0, "http_chunks": 0,
                           "ttft": []}
    deadline = time.perf_counter() + duration_s

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < deadline:
                body = json.dumps({
                    "model": "stub", "stream": True, "max_tokens": tokens,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": f"Stream {next(_ids)}: a story."}],
                }).encode()
                one = await post_stream(reader, writer, body)
                got["requests"] += 1
                for key, value in one.items():
                    if key == "ttft":
                        got["ttft"].append(value)
                    else:
                        got[key] += value
        finally:
            writer.close()

    # NOTE: the slack covers one whole stream started just before the deadline
    slack_s = 60 + tokens * step_ms / 1e3 * 2
    return await _with_sampler(got, pid, client, concurrency, duration_s + slack_s)


async def run_plain(port: int, concurrency: int, duration_s: float, system: str, text: str,
                     pid: int) -> dict[str, Any]:
    got: dict[str, Any] = {"latency": [], "body_bytes": 0}
    deadline = time.perf_counter() + duration_s

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < deadline:
                body = json.dumps({"model": "stub", "max_tokens": PLAIN_TOKENS, "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"Request {next(_ids)}.\n{text}"}]}).encode()
                start = time.perf_counter()
                status, reply = await request(reader, writer, "POST", "/v1/chat/completions", body)
                got["latency"].append(time.perf_counter() - start)
                got["body_bytes"] = len(body)
                if status != 200:
                    raise RuntimeError(f"router answered {status}: {reply[:300]!r}")
        finally:
            writer.close()

    return await _with_sampler(got, pid, client, concurrency, duration_s + 60)


async def _with_sampler(got: dict[str, Any], pid: int,
                        client: Callable[[], Awaitable[None]], concurrency: int,
                        timeout_s: float) -> dict[str, Any]:
    """Run ``concurrency`` clients while sampling the router's threads (an exiting thread's CPU
    is kept up to its last sample) and its RSS, for at most ``timeout_s``."""
    got["rss_max"] = 0.0

    async def sample() -> None:
        while True:
            cpu_s(pid)
            got["rss_max"] = max(got["rss_max"], rss_mb(pid))
            await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample())
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        sampler.cancel()
    return got


def plain_prompt(size: int) -> tuple[str, str]:
    """(system prompt, user text): ~size/4 and ~3*size/4 characters of words."""
    rng = random.Random(size)
    text = " ".join(rng.choice(WORDS) for _ in range(size // 3))[:size]
    return text[: size // 4], text[size // 4:]


@contextlib.contextmanager
def _stack(workers: int, step_ms: float, policy: str, log_level: str) -> Iterator[tuple[int, int]]:
    """Stub workers and a router over them, each in its own process group: (router pid, port).
    Always killed on the way out (SIGTERM to the group, then SIGKILL)."""
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryFile() as log:
        try:
            urls = []
            for _ in range(workers):
                port = free_port()
                procs.append(subprocess.Popen(
                    [sys.executable, str(STUB), "--port", str(port), "--step-ms", str(step_ms)],
                    stdout=subprocess.DEVNULL, stderr=log, start_new_session=True))
                urls.append(f"http://127.0.0.1:{port}")
            port = free_port()
            # NOTE: the Prometheus exporter binds 0.0.0.0:29000 unless told otherwise
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls,
                 "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                 "--log-level", log_level],
                stdout=log, stderr=log, start_new_session=True))
            asyncio.run(_wait_ready(port, procs, log))
            yield procs[-1].pid, port
        finally:
            _kill(procs)


async def _wait_ready(port: int, procs: list[subprocess.Popen[bytes]], log: Any) -> None:
    """Until a chat completion through the router succeeds (the router registers its workers in
    the background: ``/health`` answers before it can route)."""
    body = json.dumps({"model": "stub", "max_tokens": 1,
                       "messages": [{"role": "user", "content": "ready?"}]}).encode()
    deadline, status = time.monotonic() + READY_TIMEOUT_S, 0
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            break
        with contextlib.suppress(OSError, ValueError, asyncio.IncompleteReadError, TimeoutError):
            async with asyncio.timeout(5):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                try:
                    status, _ = await request(reader, writer, "POST", "/v1/chat/completions", body)
                finally:
                    writer.close()
        if status == 200:
            return
        await asyncio.sleep(0.2)
    log.seek(0)
    tail = log.read()[-2000:].decode(errors="replace")
    raise RuntimeError(f"the router did not get ready (last status {status}):\n{tail}")


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, sig)
        deadline = time.monotonic() + KILL_WAIT_S
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        if all(p.poll() is not None for p in procs):
            return


def print_table(rows: list[dict[str, Any]]) -> None:
    """The cells as two small tables (streams, then plain requests)."""
    streams = [r for r in rows if r["kind"] == "stream"]
    if streams:
        print(f"{'step':>6} {'conc':>4} | {'chunk/s':>7} {'ev/chnk':>7} {'ttft':>7} | "
              f"{'CPU/chunk':>9} {'CPU/tok':>8} {'idle':>9} | {'RSS MB start/max/end':>20}")
        for r in streams:
            print(f"{r['step_ms']:4.0f}ms {r['concurrency']:>4} | {r['chunks_per_s']:7.0f} "
                  f"{r['events_per_chunk']:7.2f} {r['ttft_p50_ms']:5.1f}ms | "
                  f"{r['cpu_us_per_chunk']:7.1f}us {r['cpu_us_per_token']:6.1f}us "
                  f"{r['idle_ms_per_s']:5.2f}ms/s | {_rss(r)}")
    plain = [r for r in rows if r["kind"] == "plain"]
    if plain:
        print(f"{'size':>4} {'conc':>4} | {'req/s':>6} {'p50':>7} {'p99':>7} | {'CPU/req':>8} "
              f"{'idle':>9} | {'RSS MB start/max/end':>20}")
        for r in plain:
            print(f"{r['size']:>4} {r['concurrency']:>4} | {r['rps']:6.0f} {r['p50_ms']:5.2f}ms "
                  f"{r['p99_ms']:5.2f}ms | {r['cpu_us_per_request']:6.1f}us "
                  f"{r['idle_ms_per_s']:5.2f}ms/s | {_rss(r)}")


def _rss(row: dict[str, Any]) -> str:
    return "{:6.0f}/{:5.0f}/{:5.0f}".format(*row["rss_mb"])


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=3.0, help="seconds of load per cell")
    parser.add_argument("--stream-concurrency", type=_ints, default=[16, 64])
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=_ints, default=[1, 16, 64], help="plain cells")
    parser.add_argument("--step-ms", default=[0.0, 20.0],
                        type=lambda s: [float(x) for x in s.split(",") if x])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--log-level", default="warn", choices=["debug", "info", "warn", "error"])
    args = parser.parse_args()
    # NOTE: SIGTERM as Ctrl-C, so that measure()'s finally still kills the router
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print_table(measure(args.duration, args.stream_concurrency, args.stream_tokens,
                        args.concurrency, step_ms=args.step_ms, workers=args.workers,
                        log_level=args.log_level))
