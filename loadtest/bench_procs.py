"""Gateway processes (``agentgate serve --gateway-procs N``): the same non-streamed multi-turn
chat load as ``bench_gateway.py`` (stateless clients resending the history, ~SIZE characters at
the last turn) through 1, 2, ... gateway processes on one port, over one ``--backend sim --cost
zero`` worker and a real ``redis-server`` (the session store several processes need), run one
after another in one run. Per N: requests/s, its ratio to one process, the CPU of all gateway
processes per request, and how many cores the gateways, the worker and this client used (the
gateways scale until the cores run out: the worker and the client share them).

    python loadtest/bench_procs.py [--procs 1,2] [--concurrency 32] [--size 2k] [--duration S]
"""

import argparse
import asyncio
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from bench_gateway import (
    SIZES,
    conversation,
    gateway_session,
    run_mode,
    wait_ready,
    write_model_dir,
)
from httpbench import cpu_s, free_port, request

from gateway.serve import WorkerProcess, spawn_worker

SIZES = SIZES | {"256": 256}  # NOTE: short chats: the gateway's own work, not the worker's
HEADER = (f"{'procs':>5} {'conc':>4} | {'req/s':>7} {'x 1 proc':>8} | {'gw CPU/req':>10} | "
          f"{'cores: gw':>9} {'worker':>6} {'client':>6} | {'p50':>8} {'p99':>8}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", default="1,2", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--size", default="2k", choices=sorted(SIZES))
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per cell")
    args = parser.parse_args()
    model_dir = write_model_dir()
    worker = spawn_worker(model_dir=model_dir, backend="sim", worker_id="bench",
                          extra_args=["--cost", "zero", "--max-batched-tokens", "32768"])
    print(f"{HEADER}\n{'-' * len(HEADER)}")
    base_rps = None
    try:
        with _redis() as redis_url:
            for n in args.procs:
                with _gateway(model_dir, worker, n, redis_url) as (pid, port):
                    row = asyncio.run(_cell(pid, port, worker, n, args))
                base_rps = base_rps or row["rps"]
                print(f"{n:>5} {args.concurrency:>4} | {row['rps']:>7.0f} "
                      f"{row['rps'] / base_rps:>7.2f}x | {row['gw_us']:>8.0f}us | "
                      f"{row['gw_cores']:>9.2f} {row['worker_cores']:>6.2f} "
                      f"{row['client_cores']:>6.2f} | {row['p50']:>6.2f}ms {row['p99']:>6.2f}ms")
    finally:
        worker.stop()


async def _cell(pid: int, port: int, worker: WorkerProcess, n: int,
                args: argparse.Namespace) -> dict[str, float]:
    convo = conversation(SIZES[args.size])
    await _wait_for_processes(port, n)
    await run_mode(gateway_session(port, convo), args.concurrency, 1.0)  # NOTE: warm-up
    gw0, w0, c0, t0 = cpu_s(pid), cpu_s(worker.proc.pid), time.process_time(), time.perf_counter()
    row = await run_mode(gateway_session(port, convo), args.concurrency, args.duration)
    wall_s = time.perf_counter() - t0
    return row | {"gw_us": (cpu_s(pid) - gw0) / row["n"] * 1e6,
                  "gw_cores": (cpu_s(pid) - gw0) / wall_s,
                  "worker_cores": (cpu_s(worker.proc.pid) - w0) / wall_s,
                  "client_cores": (time.process_time() - c0) / wall_s}


async def _wait_for_processes(port: int, n: int, timeout_s: float = 60.0) -> None:
    """Until every gateway process has answered a scrape (fresh connections)."""
    seen: set[bytes] = set()
    deadline = time.monotonic() + timeout_s
    while len(seen) < n:
        assert time.monotonic() < deadline, f"only processes {seen} of {n} answered"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        _, text = await request(reader, writer, "GET", "/metrics")
        writer.close()
        seen.update(line.split(b'index="')[1].split(b'"')[0] for line in text.splitlines()
                    if line.startswith(b"agentgate_gateway_process{"))


@contextmanager
def _gateway(model_dir: object, worker: WorkerProcess, n: int,
             redis_url: str) -> Iterator[tuple[int, int]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--model", str(model_dir), "--worker",
         worker.listen, "--port", str(port), "--served-model-name", "bench", "--redis",
         redis_url, "--gateway-procs", str(n)], stderr=subprocess.DEVNULL)
    try:
        asyncio.run(wait_ready(port))
        yield proc.pid, port
    finally:
        proc.terminate()
        proc.wait(30)


@contextmanager
def _redis() -> Iterator[str]:
    exe = shutil.which("redis-server")
    assert exe is not None, "redis-server is not installed (apt-get install -y redis-server)"
    port = free_port()
    with tempfile.TemporaryDirectory() as work:
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", work],
                                stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10.0
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline and proc.poll() is None, "no redis"
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
