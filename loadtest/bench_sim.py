"""What the "sim" backend costs in CPU (issue 15): µs per generated token at 16 and 64 running
requests, and µs per prefill page (page 16), against targets of 20 and 5 µs.

1. engine: an ``Engine(backend="sim", cost=ZERO_COST)`` on the demo geometry, prefix cache on,
   its cache events collected by a ``KVEventBuffer`` drained every step (as the worker does);
   CPU is this process's. Prefill runs three rounds of 64 x 4096 tokens: the third evicts. Run
   twice: with Python's default GC, then with the worker's (``engine.worker.cli.tune_gc``).
2. worker: a sim worker process (``spawn_worker``, ``--cost zero`` and ``--cost h200``, paced),
   driven by a DEALER sending ``Generate``s; its CPU is read from /proc/<pid>/task/*/schedstat
   (ns; /proc/<pid>/stat ticks at 10 ms, too coarse for the paced runs). Beside each decode
   figure: the floor of the protocol alone (msgspec encode + ZeroMQ send/recv of one
   ``TokenDelta`` per token, measured here in this run) and the ratio worker / floor.

    python loadtest/bench_sim.py [--parts engine,worker] [--costs zero,h200]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import zmq

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model_config import ModelConfig
from engine.models.checkpoint import DEMO_CONFIG
from engine.protocol import (
    Finished,
    Generate,
    SamplingSpec,
    TokenDelta,
    decode_worker_items,
    encode,
)
from engine.sampling_params import SamplingParams
from engine.sim import ZERO_COST
from engine.worker.cli import tune_gc
from engine.worker.publisher import KVEventBuffer
from gateway.worker_process import spawn_worker

SEED, PAGE, RUNNING, PROMPT = 0, 16, 64, 256
DECODE_STEPS, PREFILL_REQS, PREFILL_TOKENS, ROUNDS = 200, 64, 4096, 3
# worker runs: (streams, new tokens) per cost; prefill (requests, prompt tokens) per cost
WORKER_DECODE = {"zero": [(16, 400), (64, 400)], "h200": [(16, 120), (64, 120)]}
WORKER_PREFILL = {"zero": (64, 4096), "h200": (16, 2048)}
TARGET_TOKEN_US, TARGET_PAGE_US = 20.0, 5.0
rng = random.Random(SEED)


def prompt(n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def bench_engine(gc_name: str) -> None:
    cfg = EngineConfig(backend="sim", max_running_requests=RUNNING, kv_budget_bytes=1 << 30)
    model = ModelConfig.from_dict(DEMO_CONFIG)
    events = KVEventBuffer(PAGE, model.sliding_window)
    e = Engine(cfg, model_config=model, cost=ZERO_COST, on_cache_event=events.add)

    def add(tag: str, n: int, plen: int, new: int) -> None:
        for i in range(n):
            params = SamplingParams(max_new_tokens=new, ignore_eos=True)
            e.add(e.make_sequence(f"{tag}{i}", prompt(plen), params), bounded=False)

    def step() -> int:
        out = e.step()
        events.drain()
        return len(out)

    add("d", RUNNING, PROMPT, DECODE_STEPS + 50)
    while e.scheduler.waiting or any(s.num_uncomputed > 1 for s in e.scheduler.running):
        step()
    t, n = time.process_time(), sum(step() for _ in range(DECODE_STEPS))
    us = (time.process_time() - t) / n * 1e6
    print(f"engine  {gc_name:6} decode {RUNNING} running: {us:6.1f} us/token   "
          f"(target {TARGET_TOKEN_US})")
    while e.has_work:
        step()
    rounds = []
    for r in range(ROUNDS):
        add(f"p{r}-", PREFILL_REQS, PREFILL_TOKENS, 1)
        t = time.process_time()
        while e.has_work:
            step()
        rounds.append((time.process_time() - t) / (PREFILL_REQS * PREFILL_TOKENS // PAGE) * 1e6)
    print(f"engine  {gc_name:6} prefill: {sum(rounds) / ROUNDS:6.1f} us/page   (rounds "
          f"{', '.join(f'{us:.1f}' for us in rounds)}; target {TARGET_PAGE_US})")


def cpu_s(pid: int) -> float:
    tasks = Path(f"/proc/{pid}/task")
    return sum(int((t / "schedstat").read_text().split()[0]) for t in tasks.iterdir()) / 1e9


def protocol_floor_us(n: int = 20_000, burst: int = 64) -> float:
    """CPU per token of encoding one TokenDelta and sending it over ROUTER -> DEALER."""
    ctx = zmq.Context.instance()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"c")
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"hi")
    identity, _ = router.recv_multipart()
    t = time.process_time()
    for i in range(0, n, burst):
        for j in range(burst):
            delta = TokenDelta(request_id=f"r{j}", token_ids=[i + j])
            router.send_multipart([identity, encode(delta)])
        for _ in range(burst):
            dealer.recv()
    us = (time.process_time() - t) / n * 1e6
    router.close(0)
    dealer.close(0)
    return us


def run_worker(sock: zmq.Socket, pid: int, n: int, new: int, plen: int) -> tuple[float, int]:
    """(worker CPU seconds, tokens streamed) for ``n`` concurrent requests."""
    reqs = [Generate(request_id=f"r{i}-{time.monotonic()}", input_ids=prompt(plen),
                     sampling=SamplingSpec(max_new_tokens=new, ignore_eos=True))
            for i in range(n)]
    c0, done, tokens = cpu_s(pid), 0, 0
    for g in reqs:
        sock.send(encode(g))
    while done < n:
        for m in decode_worker_items(sock.recv()):
            tokens += len(m.token_ids) if isinstance(m, TokenDelta) else 0
            done += isinstance(m, Finished)
    return cpu_s(pid) - c0, tokens


def bench_worker(cost: str, floor_us: float) -> None:
    w = spawn_worker(model_dir=None, backend="sim", extra_args=["--cost", cost])
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(w.listen)
    try:
        pid = w.proc.pid
        run_worker(sock, pid, 16, 10, 64)  # warm-up
        for n, new in WORKER_DECODE[cost]:
            cpu, tokens = run_worker(sock, pid, n, new, 64)
            us = cpu / tokens * 1e6
            print(f"worker  --cost {cost:4} decode {n:2} streams: {us:6.1f} us/token   floor "
                  f"{floor_us:4.1f}   ratio {us / floor_us:4.1f}x   (target {TARGET_TOKEN_US})")
        n, plen = WORKER_PREFILL[cost]
        cpu, _ = run_worker(sock, pid, n, 1, plen)
        us = cpu / (n * plen // PAGE) * 1e6
        print(f"worker  --cost {cost:4} prefill {n} x {plen}: {us:6.1f} us/page   "
              f"(target {TARGET_PAGE_US})")
    finally:
        sock.close(0)
        w.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="engine,worker")
    ap.add_argument("--costs", default="zero,h200")
    args = ap.parse_args()
    t = time.monotonic()
    if "engine" in args.parts:
        bench_engine("gc")
        tune_gc()
        bench_engine("tuned")
    if "worker" in args.parts:
        floor_us = protocol_floor_us()
        print(f"protocol floor (encode + send/recv of one TokenDelta): {floor_us:.1f} us/token")
        for cost in args.costs.split(","):
            bench_worker(cost, floor_us)
    print(f"bench_sim: done in {time.monotonic() - t:.0f} s (pid {os.getpid()})")


if __name__ == "__main__":
    main()
