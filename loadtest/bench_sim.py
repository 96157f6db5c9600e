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
3. paced floor: a worker paced by ``--cost h200`` sleeps between steps (~36 ms at 64 streams)
   and wakes once a step; on a virtual machine the wake, and the work right after it on cold
   caches, cost far more CPU than the same work back to back (``loadtest/bench_wakeups.py``).
   The floor: part 1's engine decoding 64 running requests in this process, with one wake a
   step (a ZeroMQ poll for the step's time, as the worker waits), beside the same steps back to
   back and the wake alone; the h200 decode rows show the ratio worker / paced floor.

Each figure with a target ends in "met" or "MISSED" (the engine's prefill: its worst round).

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
from engine.sim import H200_COST, ZERO_COST
from engine.worker.cli import tune_gc
from engine.worker.publisher import KVEventBuffer
from gateway.worker_process import spawn_worker

SEED, PAGE, RUNNING, PROMPT = 0, 16, 64, 256
DECODE_STEPS, PREFILL_REQS, PREFILL_TOKENS, ROUNDS = 200, 64, 4096, 3
# worker runs: (streams, new tokens) per cost; prefill (requests, prompt tokens) per cost
WORKER_DECODE = {"zero": [(16, 400), (64, 400)], "h200": [(16, 120), (64, 120)]}
WORKER_PREFILL = {"zero": (64, 4096), "h200": (16, 2048)}
TARGET_TOKEN_US, TARGET_PAGE_US = 20.0, 5.0
PACED_STEPS = 40  # paced floor: steps of H200_COST's decode step time at RUNNING requests
rng = random.Random(SEED)


def prompt(n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def verdict(us: float, target: float) -> str:
    return f"target {target:4.1f}  {'met' if us <= target else 'MISSED'}"


def make_engine() -> tuple[Engine, KVEventBuffer]:
    cfg = EngineConfig(backend="sim", max_running_requests=RUNNING, kv_budget_bytes=1 << 30)
    model = ModelConfig.from_dict(DEMO_CONFIG)
    events = KVEventBuffer(PAGE, model.sliding_window)
    return Engine(cfg, model_config=model, cost=ZERO_COST, on_cache_event=events.add), events


def start_decode(e: Engine, events: KVEventBuffer, new: int) -> None:
    """RUNNING requests of PROMPT tokens, prefilled: every later step decodes them all."""
    for i in range(RUNNING):
        params = SamplingParams(max_new_tokens=new, ignore_eos=True)
        e.add(e.make_sequence(f"d{i}", prompt(PROMPT), params), bounded=False)
    while e.scheduler.waiting or any(s.num_uncomputed > 1 for s in e.scheduler.running):
        e.step()
        events.drain()


def bench_engine(gc_name: str) -> None:
    e, events = make_engine()

    def add(tag: str, n: int, plen: int, new: int) -> None:
        for i in range(n):
            params = SamplingParams(max_new_tokens=new, ignore_eos=True)
            e.add(e.make_sequence(f"{tag}{i}", prompt(plen), params), bounded=False)

    def step() -> int:
        out = e.step()
        events.drain()
        return len(out)

    start_decode(e, events, DECODE_STEPS + 50)
    t, n = time.process_time(), sum(step() for _ in range(DECODE_STEPS))
    us = (time.process_time() - t) / n * 1e6
    print(f"engine  {gc_name:6} decode {RUNNING} running: {us:6.1f} us/token   "
          f"{verdict(us, TARGET_TOKEN_US)}")
    while e.has_work:
        step()
    rounds = []
    for r in range(ROUNDS):
        add(f"p{r}-", PREFILL_REQS, PREFILL_TOKENS, 1)
        t = time.process_time()
        while e.has_work:
            step()
        rounds.append((time.process_time() - t) / (PREFILL_REQS * PREFILL_TOKENS // PAGE) * 1e6)
    print(f"engine  {gc_name:6} prefill: {max(rounds):6.1f} us/page (worst round)   "
          f"{verdict(max(rounds), TARGET_PAGE_US)}   (rounds "
          f"{', '.join(f'{us:.1f}' for us in rounds)})")


def paced_floor_us() -> float:
    """CPU per token of the engine's decode at RUNNING requests with one wake a step (a poll
    for H200_COST's step time on an idle socket), printed beside the same steps back to back
    and the wake alone (with the worker's GC settings)."""
    tune_gc()
    e, events = make_engine()
    start_decode(e, events, 3 * PACED_STEPS + 50)
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.bind_to_random_port("tcp://127.0.0.1")
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    step_ms = H200_COST.step_time(0, RUNNING, 0) * 1e3
    us = {}
    for label, wait_ms in (("hot", 0.0), ("paced", step_ms), ("wake", step_ms)):
        t, n = time.process_time(), 0
        for _ in range(PACED_STEPS):
            if wait_ms:
                poller.poll(wait_ms)
            if label != "wake":
                n += len(e.step())
                events.drain()
        us[label] = (time.process_time() - t) / (n or PACED_STEPS) * 1e6
    sock.close(0)
    print(f"paced floor (engine decode {RUNNING} running, one wake a {step_ms:.0f} ms step): "
          f"{us['paced']:.1f} us/token   (back to back {us['hot']:.1f}; a wake alone "
          f"{us['wake']:.0f} us = {us['wake'] / RUNNING:.1f} us/token)")
    return us["paced"]


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


def bench_worker(cost: str, floor_us: float, paced_us: float | None) -> None:
    w = spawn_worker(model_dir=None, backend="sim", extra_args=["--cost", cost])
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(w.listen)
    try:
        pid = w.proc.pid
        run_worker(sock, pid, 16, 10, 64)  # warm-up
        for n, new in WORKER_DECODE[cost]:
            cpu, tokens = run_worker(sock, pid, n, new, 64)
            us = cpu / tokens * 1e6
            target = verdict(us, TARGET_TOKEN_US) if n == RUNNING else "(no target)"
            paced = f"   paced floor {paced_us:4.1f}   ratio {us / paced_us:3.1f}x" if (
                paced_us and n == RUNNING) else ""
            print(f"worker  --cost {cost:4} decode {n:2} streams: {us:6.1f} us/token   "
                  f"{target}   protocol floor {floor_us:4.1f}   ratio {us / floor_us:4.1f}x"
                  f"{paced}")
        n, plen = WORKER_PREFILL[cost]
        cpu, _ = run_worker(sock, pid, n, 1, plen)
        us = cpu / (n * plen // PAGE) * 1e6
        print(f"worker  --cost {cost:4} prefill {n} x {plen}: {us:6.1f} us/page   "
              f"{verdict(us, TARGET_PAGE_US)}")
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
        costs = args.costs.split(",")
        paced_us = paced_floor_us() if "h200" in costs else None
        for cost in costs:
            bench_worker(cost, floor_us, paced_us if cost == "h200" else None)
    print(f"bench_sim: done in {time.monotonic() - t:.0f} s (pid {os.getpid()})")


if __name__ == "__main__":
    main()
