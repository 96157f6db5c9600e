"""Gateway overhead: the same multi-turn chat load through ``agentgate serve`` (HTTP) and straight
to the worker (ZeroMQ, pre-tokenized), side by side, over one ``--backend sim --cost zero`` worker.

Load: ``c`` concurrent stateless clients; each runs conversations of TURNS turns that resend the
whole history every turn (system prompt, then per turn one new user message + the previous
assistant reply), so a conversation's last prompt is ~SIZE characters (demo tokenizer: ~1 token
per character): the system prompt is SIZE/4 and the same in every conversation (as an agent's
is), each user message 3*SIZE/4/TURNS; the first user message starts with a unique line, so
conversations share only the system prompt. Each request asks for
MAX_TOKENS tokens, non-streamed. Measured per (size, concurrency) cell, for --duration seconds
per mode: req/s; gateway CPU us per request (``/proc/<pid>/stat`` utime+stime delta / requests);
p50/p99 latency and the added latency (gateway - direct); gateway RSS (``/proc/<pid>/status``)
at start / max / end of the cell; the prompt cache's reuse (tokens reused / prompt tokens, from
``/metrics``); "prompt": the part of the gateway's CPU spent rendering and tokenizing prompts
(``agentgate_prompt_cache_cpu_seconds_total``); "full": what rendering and tokenizing each whole
prompt would cost instead (measured in this process: the tokens-once saving); the client's own
CPU us per request (it shares the cores).

    python loadtest/bench_gateway.py [--sizes 2k,20k] [--concurrency 1,16,64] [--duration S]
                                     [--quick]
"""

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from engine.protocol import Finished, Generate, SamplingSpec
from gateway.dispatch import WorkerClient
from gateway.serve import WorkerProcess, spawn_worker
from gateway.tokenizer import Tokenizer, write_demo_tokenizer

SIZES = {"2k": 2048, "20k": 20480}
TURNS, MAX_TOKENS, CONTEXT, SEED = 8, 8, 65536, 0
REF_CPU_US, REF_ADDED_P50_MS, REF_RSS = (190, 370), 0.3, "0.8-1.3 GB within a minute"
WORDS = ("the", "agent", "calls", "a", "tool", "reads", "its", "output", "then", "edits", "file",
         "and", "runs", "tests", "again", "until", "they", "pass", "or", "asks", "user", "what")
_JSON = msgspec.json.Encoder()
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")
_session_ids = itertools.count()
Session = Callable[[float, list[float]], Awaitable[None]]  # (deadline, latencies) -> runs turns


def main() -> None:
    args = _parse_args()
    model_dir = _write_model_dir()
    tokenizer = Tokenizer.from_dir(model_dir)
    worker = spawn_worker(model_dir=model_dir, backend="sim", worker_id="bench",
                          extra_args=["--cost", "zero", "--max-batched-tokens", "32768"])
    port = _free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--model", str(model_dir), "--worker",
         worker.listen, "--port", str(port), "--served-model-name", "bench"],
        stderr=subprocess.DEVNULL)
    try:
        asyncio.run(_bench(args, tokenizer, worker, gateway.pid, port))
    finally:
        gateway.terminate()
        gateway.wait(10)
        worker.stop()


async def _bench(args: argparse.Namespace, tok: Tokenizer, worker: WorkerProcess, pid: int,
                 port: int) -> None:
    await _wait_ready(port)
    direct = WorkerClient(worker.listen)
    await direct.connect()
    rows = []
    print(f"\n{HEADER}\n{'-' * len(HEADER)}")
    for size_name in args.sizes:
        convo = _conversation(SIZES[size_name])
        full_us = _full_render_us(tok, convo)
        template_ids = [tok.encode_chat(_messages(convo, t, "x" * MAX_TOKENS)) for t in
                        range(TURNS)]
        system_len = len(tok.encode_chat(_messages(convo, 0, "")[:1], add_generation_prompt=False))
        await _run_mode(_gateway_session(port, convo), 16, 1.0)  # NOTE: warm-up
        for c in args.concurrency:
            rss0 = _rss_mb(pid)
            cache0, cpu0 = await _scrape(port), _cpu_s(pid)
            gw = await _run_mode(_gateway_session(port, convo), c, args.duration, pid)
            gw_cpu_us = (_cpu_s(pid) - cpu0) / gw["n"] * 1e6
            cache1 = await _scrape(port)
            direct_session = _direct_session(direct, template_ids, system_len)
            dr = await _run_mode(direct_session, c, args.duration)
            reused = cache1[0] - cache0[0]
            reuse = reused / max(reused + cache1[1] - cache0[1], 1)
            prompt_us = (cache1[2] - cache0[2]) / gw["n"] * 1e6
            rows.append((size_name, c, gw, dr, gw_cpu_us, rss0, _rss_mb(pid), reuse, prompt_us,
                         full_us))
            _print_row(rows[-1])
    direct.close()
    _print_summary(rows)


async def _run_mode(
    session: Session, concurrency: int, duration_s: float, pid: int | None = None
) -> dict[str, float]:
    latencies: list[float] = []
    peak = [0.0]
    deadline = time.perf_counter() + duration_s
    cpu0, t0 = time.process_time(), time.perf_counter()

    async def sample_rss() -> None:
        while pid is not None:
            peak[0] = max(peak[0], _rss_mb(pid))
            await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample_rss())
    await asyncio.gather(*(session(deadline, latencies) for _ in range(concurrency)))
    sampler.cancel()
    elapsed_s, n = time.perf_counter() - t0, len(latencies)
    q = statistics.quantiles(latencies, n=100) if n > 1 else latencies * 99
    return {"n": n, "rps": n / elapsed_s, "p50": q[49] * 1e3, "p99": q[98] * 1e3,
            "client_us": (time.process_time() - cpu0) / max(n, 1) * 1e6, "rss_max": peak[0]}


def _gateway_session(port: int, convo: tuple[str, list[str]]) -> Session:
    async def session(deadline: float, latencies: list[float]) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.perf_counter() < deadline:
            n = next(_session_ids)
            messages = [{"role": "system", "content": convo[0]}]
            for turn, user in enumerate(convo[1]):
                unique = f"Session {n}.\n" if turn == 0 else ""
                messages.append({"role": "user", "content": unique + user})
                body = _JSON.encode({"model": "bench", "messages": messages,
                                     "max_tokens": MAX_TOKENS})
                start = time.perf_counter()
                status, reply = await _post(reader, writer, "/v1/chat/completions", body)
                latencies.append(time.perf_counter() - start)
                assert status == 200, reply[:300]
                content = msgspec.json.decode(reply)["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": content or ""})
        writer.close()

    return session


def _direct_session(
    client: WorkerClient, template_ids: list[list[int]], system_len: int
) -> Session:
    sampling = SamplingSpec(max_new_tokens=MAX_TOKENS)

    async def session(deadline: float, latencies: list[float]) -> None:
        while time.perf_counter() < deadline:
            n = next(_session_ids)
            unique = [32 + n % 200, 32 + n // 200 % 200, 32 + n // 40000 % 200]
            for turn_ids in template_ids:
                request = Generate(request_id=f"d{n}-{len(latencies)}",
                                   input_ids=[*turn_ids[:system_len], *unique,
                                              *turn_ids[system_len:]], sampling=sampling)
                start = time.perf_counter()
                async for item in client.generate(request):
                    if isinstance(item, Finished):
                        break
                latencies.append(time.perf_counter() - start)

    return session


async def _post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str,
                body: bytes) -> tuple[int, bytes]:
    """One HTTP/1.1 keep-alive request; a raw client spends less CPU than httpx."""
    method = b"POST" if body else b"GET"
    writer.write(b"%s %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (method, path.encode(), len(body), body))
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])  # type: ignore[index]
    return int(head[9:12]), await reader.readexactly(length)


async def _scrape(port: int) -> tuple[float, float, float]:
    """(reused, tokenized) prompt tokens and CPU seconds of the gateway's prompt cache so far."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    _, text = await _post(reader, writer, "/metrics", b"")
    writer.close()
    values = dict(re.findall(rb"^(agentgate_prompt_cache_\w+_total) (\S+)$", text, re.M))
    return (float(values[b"agentgate_prompt_cache_reused_tokens_total"]),
            float(values[b"agentgate_prompt_cache_tokenized_tokens_total"]),
            float(values[b"agentgate_prompt_cache_cpu_seconds_total"]))


def _full_render_us(tok: Tokenizer, convo: tuple[str, list[str]]) -> float:
    """CPU us per request to render and tokenize every turn's whole prompt (what a gateway that
    re-tokenizes the history would spend), measured here, averaged over the turns."""
    prompts = [_messages(convo, t, "x" * MAX_TOKENS) for t in range(TURNS)]
    t0 = time.process_time()
    for _ in range(5):
        for messages in prompts:
            tok.encode_chat(messages)
    return (time.process_time() - t0) / (5 * TURNS) * 1e6


async def _wait_ready(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            status, _ = await _post(reader, writer, "/ready", b"")
            writer.close()
            if status == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, "the gateway did not get ready"
        await asyncio.sleep(0.2)


def _conversation(size: int) -> tuple[str, list[str]]:
    """(system prompt, user messages) for a conversation whose last prompt is ~size chars."""
    rng = random.Random(SEED + size)
    text = " ".join(rng.choice(WORDS) for _ in range(size))
    system, per_turn = size // 4, 3 * size // 4 // TURNS
    users = [text[system + i * per_turn: system + (i + 1) * per_turn] for i in range(TURNS)]
    return text[:system], users


def _messages(convo: tuple[str, list[str]], turn: int, reply: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": convo[0]}]
    for user in convo[1][:turn]:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return [*messages, {"role": "user", "content": convo[1][turn]}]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # NOTE: utime, stime (fields 14, 15)


def _rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status)[1]) / 1024  # type: ignore[index]


def _write_model_dir() -> Path:
    from engine.models.checkpoint import DEMO_CONFIG

    out = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    write_demo_tokenizer(out)
    (out / "config.json").write_text(json.dumps(DEMO_CONFIG | {"max_position_embeddings":
                                                              CONTEXT}))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HEADER = (f"{'size':>4} {'conc':>4} | {'req/s gw':>8} {'direct':>7} | {'gw CPU':>7} "
          f"{'prompt':>7} {'full':>7} | "
          f"{'p50 gw':>7} {'direct':>7} {'added':>6} | {'p99 gw':>7} {'direct':>7} "
          f"{'added':>6} | {'RSS MB start/max/end':>20} | {'reuse':>5} | {'client us/req':>13}")


def _print_row(row: tuple) -> None:  # type: ignore[type-arg]
    size, c, gw, dr, cpu_us, rss0, rss1, reuse, prompt_us, full_us = row
    print(f"{size:>4} {c:>4} | {gw['rps']:8.0f} {dr['rps']:7.0f} | {cpu_us:5.0f}us "
          f"{prompt_us:5.0f}us {full_us:5.0f}us | "
          f"{gw['p50']:5.2f}ms {dr['p50']:5.2f}ms {gw['p50'] - dr['p50']:6.2f} | "
          f"{gw['p99']:5.2f}ms {dr['p99']:5.2f}ms {gw['p99'] - dr['p99']:6.2f} | "
          f"{rss0:6.0f}/{gw['rss_max']:5.0f}/{rss1:5.0f}  | {reuse:5.0%} | "
          f"{gw['client_us']:5.0f} / {dr['client_us']:5.0f}", flush=True)


def _print_summary(rows: list[tuple]) -> None:  # type: ignore[type-arg]
    cpu = max(r[4] for r in rows)
    one = [r[2]["p50"] - r[3]["p50"] for r in rows if r[1] == 1]
    rss = [r[5] for r in rows] + [r[2]["rss_max"] for r in rows] + [r[6] for r in rows]
    print(f"\nreference (SGLang router 0.3.2, cache_aware, 2 workers): {REF_CPU_US[0]}-"
          f"{REF_CPU_US[1]} us CPU/request, +{REF_ADDED_P50_MS} ms p50 at c=1, RSS {REF_RSS}")
    print(f"agentgate: max {cpu:.0f} us CPU/request "
          f"({'meets' if cpu <= REF_CPU_US[1] else 'MISSES'} <= {REF_CPU_US[1]} us); "
          f"added p50 at c=1 {max(one, default=float('nan')):.2f} ms "
          f"({'meets' if one and max(one) <= REF_ADDED_P50_MS else 'MISSES'} <= "
          f"{REF_ADDED_P50_MS} ms); RSS {min(rss):.0f}-{max(rss):.0f} MB over the run")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2k,20k", type=lambda s: s.split(","))
    parser.add_argument("--concurrency", default="1,16,64",
                        type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--duration", type=float, default=12.0, help="seconds per cell and mode")
    parser.add_argument("--quick", action="store_true", help="--duration 3")
    args = parser.parse_args()
    if args.quick:
        args.duration = 3.0
    return args


if __name__ == "__main__":
    main()
