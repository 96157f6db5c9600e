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
                                     [--stream-concurrency 16,64] [--stream-tokens N]
                                     [--no-plain] [--no-stream] [--quick] [--tokenizer bpe]

Streaming cells (after the non-streamed ones): ``c`` concurrent clients each running one streamed
chat completion after another (a short unique prompt, ``--stream-tokens`` output tokens,
``stream_options.include_usage``), through two gateways: one over a worker that steps as fast as
it can (``zero`` cost: tokens pile up and the gateway coalesces them, several per chunk) and one
over a worker paced like an H200 (``h200`` cost, ~20-40 ms a step: one token per stream per
step, so nearly every chunk carries one token, the case that costs the most per token). Per
cell: content chunks and tokens per second, tokens per chunk, and the gateway's CPU per chunk and
per token above its own idle CPU (measured before the cells: heartbeats, the KV event
subscriber).
"""

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import msgspec
from bpe_tokenizer import write_bpe_tokenizer
from httpbench import WORDS, cpu_s, free_port, post_stream, request, rss_mb

from engine.protocol import Finished, Generate, SamplingSpec
from gateway.dispatch import WorkerClient
from gateway.serve import WorkerProcess, spawn_worker
from gateway.tokenizer import Tokenizer, write_demo_tokenizer

SIZES = {"2k": 2048, "20k": 20480}
TURNS, MAX_TOKENS, CONTEXT, SEED = 8, 8, 65536, 0
PLAIN_TARGET_US, ADDED_P50_TARGET_MS, RSS_TARGET_MB = {"2k": 350, "20k": 700}, 0.4, 300
_JSON = msgspec.json.Encoder()
_session_ids = itertools.count()
Session = Callable[[float, list[float]], Awaitable[None]]  # (deadline, latencies) -> runs turns


def main() -> None:
    args = _parse_args()
    model_dir = write_model_dir(args.tokenizer)
    tokenizer = Tokenizer.from_dir(model_dir)
    text = tokenizer.apply_chat_template(_messages(conversation(SIZES["2k"]), TURNS - 1, "."))
    print(f"tokenizer: {args.tokenizer}, {len(text) / len(tokenizer.encode(text)):.2f} "
          "characters a token on the 2k conversation")
    worker = spawn_worker(model_dir=model_dir, backend="sim", worker_id="bench",
                          extra_args=["--cost", "zero", "--max-batched-tokens", "32768"])
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--model", str(model_dir), "--worker",
         worker.listen, "--port", str(port), "--served-model-name", "bench"],
        stderr=subprocess.DEVNULL)
    plain: list[tuple] = []  # type: ignore[type-arg]
    streams: list[dict[str, float]] = []
    try:
        if args.plain:
            plain = asyncio.run(_bench(args, tokenizer, worker, gateway.pid, port))
        if args.sessions:
            asyncio.run(_session_cells(args, gateway.pid, port))
        if args.stream:
            print(f"\n{STREAM_HEADER}\n{'-' * len(STREAM_HEADER)}")
            streams += asyncio.run(_stream_cells(args, "zero", gateway.pid, port))
            with _gateway_over(model_dir, "h200") as (paced_pid, paced_port):
                streams += asyncio.run(_stream_cells(args, "h200", paced_pid, paced_port))
            print(f"\ntarget (issue 10): <= {STREAM_TARGET_US} us of gateway CPU per chunk at 16 "
                  "and 64 streams")
    finally:
        gateway.terminate()
        gateway.wait(10)
        worker.stop()
    if args.reference:
        _reference(args, plain, streams)


def _reference(args: argparse.Namespace, plain: list[tuple],  # type: ignore[type-arg]
               streams: list[dict[str, float]]) -> None:
    """The same cells through SGLang's Rust router in front of a stub OpenAI worker, measured
    now on this machine (``loadtest/sglang_router_ref.py``), and ours / its ratios."""
    import sglang_router_ref

    print("\nreference: sglang-router 0.3.2 (cache_aware) in front of "
          "loadtest/openai_stub_worker.py, same machine, same run")
    rows = sglang_router_ref.measure(
        args.duration, args.stream_concurrency if args.stream else (), args.stream_tokens,
        args.concurrency if args.plain else (), {k: SIZES[k] for k in args.sizes},
        step_ms=tuple(REF_STEP_MS.values()))
    if not rows:
        return
    sglang_router_ref.print_table(rows)
    print("\nours / router (CPU):")
    for ours in streams:
        ref = next((r for r in rows if r["kind"] == "stream" and r["concurrency"] == ours["c"]
                    and r["step_ms"] == REF_STEP_MS[ours["cost"]]), None)
        if ref is not None:
            print(f"  stream {ours['cost']:>4} vs {ref['step_ms']:.0f} ms steps, c={ours['c']}: "
                  f"{ours['cpu_us_per_chunk'] / ref['cpu_us_per_chunk']:.2f}x per chunk, "
                  f"{ours['cpu_us_per_token'] / ref['cpu_us_per_token']:.2f}x per token")
    for size_name, c, *_rest in plain:
        ref = next((r for r in rows if r["kind"] == "plain" and r["concurrency"] == c
                    and r["size"] == size_name), None)
        if ref is not None:
            print(f"  plain {size_name} c={c}: {_rest[2] / ref['cpu_us_per_request']:.2f}x per "
                  "request")


@contextlib.contextmanager
def _gateway_over(model_dir: Path, cost: str) -> Iterator[tuple[int, int]]:
    """A sim worker with ``cost`` and a gateway over it: (gateway pid, port)."""
    worker = spawn_worker(model_dir=model_dir, backend="sim", worker_id=f"bench-{cost}",
                          extra_args=["--cost", cost, "--max-batched-tokens", "32768"])
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--model", str(model_dir), "--worker",
         worker.listen, "--port", str(port), "--served-model-name", "bench"],
        stderr=subprocess.DEVNULL)
    try:
        yield gateway.pid, port
    finally:
        gateway.terminate()
        gateway.wait(10)
        worker.stop()


async def _session_cells(args: argparse.Namespace, pid: int, port: int) -> None:
    """Sessions API turns: the same conversations as the plain cells, but each client creates a
    session (the system prompt) and sends only each turn's new user message; gateway CPU per
    turn (the worker's time is not the gateway's: a zero-cost worker's is ~0)."""
    print(f"\n{SESSION_HEADER}\n{'-' * len(SESSION_HEADER)}")
    await wait_ready(port)
    for size_name in args.sizes:
        convo = conversation(SIZES[size_name])
        await run_mode(_session_turns(port, convo), 4, 1.0)  # NOTE: warm-up
        for c in args.concurrency:
            cpu0 = cpu_s(pid)
            got = await run_mode(_session_turns(port, convo), c, args.duration, pid)
            cpu_us = (cpu_s(pid) - cpu0) / max(got["n"], 1) * 1e6
            print(f"{size_name:>4} {c:>4} | {got['rps']:8.0f} | {cpu_us:7.0f}us | "
                  f"{got['p50']:6.2f}ms {got['p99']:7.2f}ms | {got['rss_max']:5.0f}", flush=True)
    print(f"target (issue 10): <= {SESSION_TARGET_US} us of gateway CPU per turn above the "
          "worker's own time")


def _session_turns(port: int, convo: tuple[str, list[str]]) -> Session:
    async def session(deadline: float, latencies: list[float]) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.perf_counter() < deadline:
            n = next(_session_ids)
            body = _JSON.encode({"system": convo[0]})
            status, reply = await _post(reader, writer, "/v1/sessions", body)
            assert status == 200, reply[:300]
            sid = msgspec.json.decode(reply)["id"]
            for turn, user in enumerate(convo[1]):
                unique = f"Session {n}.\n" if turn == 0 else ""
                body = _JSON.encode({"messages": [{"role": "user", "content": unique + user}],
                                     "max_tokens": MAX_TOKENS})
                start = time.perf_counter()
                status, reply = await _post(reader, writer, f"/v1/sessions/{sid}/turns", body)
                latencies.append(time.perf_counter() - start)
                assert status == 200, reply[:300]
            await request(reader, writer, "DELETE", f"/v1/sessions/{sid}")
        writer.close()

    return session


async def _stream_cells(args: argparse.Namespace, cost: str, pid: int,
                        port: int) -> list[dict[str, float]]:
    await wait_ready(port)
    await _run_streams(port, 4, 1.0, args.stream_tokens)  # NOTE: warm-up
    idle0 = cpu_s(pid)
    await asyncio.sleep(IDLE_S)
    idle_cpu_per_s = (cpu_s(pid) - idle0) / IDLE_S
    rows = []
    for c in args.stream_concurrency:
        rss0, cpu0, t0 = rss_mb(pid), cpu_s(pid), time.perf_counter()
        got = await _run_streams(port, c, args.duration, args.stream_tokens)
        elapsed_s = time.perf_counter() - t0
        used_s = max(0.0, cpu_s(pid) - cpu0 - idle_cpu_per_s * elapsed_s)
        chunks, tokens = max(got["chunks"], 1), max(got["tokens"], 1)
        print(f"{cost:>5} {c:>4} | {got['requests'] / elapsed_s:6.1f} {chunks / elapsed_s:7.0f} "
              f"{tokens / elapsed_s:7.0f} {tokens / chunks:6.2f} | {used_s / chunks * 1e6:6.1f}us "
              f"{used_s / tokens * 1e6:6.1f}us {idle_cpu_per_s * 1e3:5.1f}ms/s | "
              f"{rss0:5.0f}/{rss_mb(pid):5.0f}", flush=True)
        rows.append({"cost": cost, "c": c, "cpu_us_per_chunk": used_s / chunks * 1e6,
                     "cpu_us_per_token": used_s / tokens * 1e6})
    return rows


async def _run_streams(port: int, concurrency: int, duration_s: float,
                       max_tokens: int) -> dict[str, int]:
    got = {"requests": 0, "chunks": 0, "tokens": 0}
    deadline = time.perf_counter() + duration_s

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.perf_counter() < deadline:
            n = next(_session_ids)
            body = _JSON.encode({
                "model": "bench", "stream": True, "max_tokens": max_tokens,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"Stream {n}: tell a long story."}]})
            one = await post_stream(reader, writer, body)
            got["requests"] += 1
            got["chunks"] += one["chunks"]
            got["tokens"] += one["tokens"]
        writer.close()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return got


async def _bench(args: argparse.Namespace, tok: Tokenizer, worker: WorkerProcess, pid: int,
                 port: int) -> list[tuple]:  # type: ignore[type-arg]
    await wait_ready(port)
    direct = WorkerClient(worker.listen)
    await direct.connect()
    rows = []
    print(f"\n{HEADER}\n{'-' * len(HEADER)}")
    for size_name in args.sizes:
        convo = conversation(SIZES[size_name])
        full_us = _full_render_us(tok, convo)
        template_ids = [tok.encode_chat(_messages(convo, t, "x" * MAX_TOKENS)) for t in
                        range(TURNS)]
        system_len = len(tok.encode_chat(_messages(convo, 0, "")[:1], add_generation_prompt=False))
        await run_mode(gateway_session(port, convo), 16, 1.0)  # NOTE: warm-up
        for c in args.concurrency:
            rss0 = rss_mb(pid)
            cache0, cpu0 = await _scrape(port), cpu_s(pid)
            gw = await run_mode(gateway_session(port, convo), c, args.duration, pid)
            gw_cpu_us = (cpu_s(pid) - cpu0) / gw["n"] * 1e6
            cache1 = await _scrape(port)
            direct_session = _direct_session(direct, template_ids, system_len)
            dr = await run_mode(direct_session, c, args.duration)
            reused = cache1[0] - cache0[0]
            reuse = reused / max(reused + cache1[1] - cache0[1], 1)
            prompt_us = (cache1[2] - cache0[2]) / gw["n"] * 1e6
            rows.append((size_name, c, gw, dr, gw_cpu_us, rss0, rss_mb(pid), reuse, prompt_us,
                         full_us))
            _print_row(rows[-1])
    direct.close()
    _print_summary(rows)
    return rows


async def run_mode(
    session: Session, concurrency: int, duration_s: float, pid: int | None = None
) -> dict[str, float]:
    latencies: list[float] = []
    peak = [0.0]
    deadline = time.perf_counter() + duration_s
    cpu0, t0 = time.process_time(), time.perf_counter()

    async def sample_rss() -> None:
        while pid is not None:
            peak[0] = max(peak[0], rss_mb(pid))
            await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample_rss())
    await asyncio.gather(*(session(deadline, latencies) for _ in range(concurrency)))
    sampler.cancel()
    elapsed_s, n = time.perf_counter() - t0, len(latencies)
    q = statistics.quantiles(latencies, n=100) if n > 1 else latencies * 99
    return {"n": n, "rps": n / elapsed_s, "p50": q[49] * 1e3, "p99": q[98] * 1e3,
            "client_us": (time.process_time() - cpu0) / max(n, 1) * 1e6, "rss_max": peak[0]}


def gateway_session(port: int, convo: tuple[str, list[str]]) -> Session:
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
    """A POST with ``body``, a GET without."""
    return await request(reader, writer, "POST" if body else "GET", path, body)


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


async def wait_ready(port: int, timeout_s: float = 60.0) -> None:
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


def conversation(size: int) -> tuple[str, list[str]]:
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


def write_model_dir(tokenizer: str = "demo") -> Path:
    """The benchmark's model dir: the demo model's config and the demo tokenizer (one token a
    byte), or with ``tokenizer="bpe"`` a BPE trained here (``bpe_tokenizer.py``, ~4.5
    characters a token as with production tokenizers; the same ids for the specials)."""
    from engine.models.checkpoint import DEMO_CONFIG

    out = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    write_demo_tokenizer(out)
    config = DEMO_CONFIG | {"max_position_embeddings": CONTEXT}
    if tokenizer == "bpe":
        config["vocab_size"] = max(write_bpe_tokenizer(out), config["vocab_size"])
    (out / "config.json").write_text(json.dumps(config))
    return out


STREAM_TARGET_US, SESSION_TARGET_US, IDLE_S = 40, 150, 3.0
REF_STEP_MS = {"zero": 0.0, "h200": 20.0}  # NOTE: the stub worker's pacing like our sim's
SESSION_HEADER = (f"{'size':>4} {'conc':>4} | {'turns/s':>8} | {'gw CPU':>9} | {'p50':>8} "
                  f"{'p99':>9} | {'RSS max':>5}")
STREAM_HEADER = (f"{'cost':>5} {'conc':>4} | {'req/s':>6} {'chunk/s':>7} {'tok/s':>7} "
                 f"{'tok/ch':>6} | {'CPU/chunk':>8} {'CPU/tok':>8} {'idle':>9} | "
                 f"{'RSS MB':>11}")
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
    """Issue 10's targets for the plain cells (the router's figures from this run, when it is
    installed, come after every cell)."""
    one = [r[2]["p50"] - r[3]["p50"] for r in rows if r[1] == 1]
    rss = [r[5] for r in rows] + [r[2]["rss_max"] for r in rows] + [r[6] for r in rows]
    print(f"\ntargets (issue 10): CPU per request at c=16 <= {PLAIN_TARGET_US}; added p50 at "
          f"c=1 <= {ADDED_P50_TARGET_MS} ms; RSS < {RSS_TARGET_MB} MB")
    for size_name, c, _gw, _dr, cpu_us, *_ in rows:
        target = PLAIN_TARGET_US.get(size_name)
        if c == 16 and target is not None:
            verdict = "meets" if cpu_us <= target else "MISSES"
            print(f"  {size_name} c=16: {cpu_us:.0f} us ({verdict} <= {target})")
    worst = max(one, default=float("nan"))
    print(f"  added p50 at c=1: {worst:.2f} ms "
          f"({'meets' if one and worst <= ADDED_P50_TARGET_MS else 'MISSES'}); RSS "
          f"{min(rss):.0f}-{max(rss):.0f} MB ({'meets' if max(rss) < RSS_TARGET_MB else 'MISSES'})")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2k,20k", type=lambda s: s.split(","))
    parser.add_argument("--concurrency", default="1,16,64",
                        type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--duration", type=float, default=12.0, help="seconds per cell and mode")
    parser.add_argument("--stream-concurrency", default="16,64",
                        type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--stream-tokens", type=int, default=256, help="output tokens a stream")
    parser.add_argument("--no-plain", dest="plain", action="store_false",
                        help="skip the non-streamed cells")
    parser.add_argument("--no-stream", dest="stream", action="store_false",
                        help="skip the streaming cells")
    parser.add_argument("--no-sessions", dest="sessions", action="store_false",
                        help="skip the Sessions API cells")
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="skip the sglang-router cells (run only when it is installed)")
    parser.add_argument("--quick", action="store_true", help="--duration 3")
    parser.add_argument("--tokenizer", choices=("demo", "bpe"), default="demo",
                        help="demo: one token a byte (the targets' figures); bpe: trained here, "
                        "~4.5 characters a token like production tokenizers")
    args = parser.parse_args()
    if args.quick:
        args.duration = 3.0
    return args


if __name__ == "__main__":
    main()
