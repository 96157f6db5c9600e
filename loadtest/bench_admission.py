"""Admission's length buckets: short agent turns beside long cold prefills, with and without.

    python loadtest/bench_admission.py [--seed 0] [--requests 400] [--long-share 0.1] [--rate 3]

A seeded open-loop mix on the in-process replay (``replay.harness``, real scheduler and prefix
cache, ``h200`` cost): SHORT_TOKENS-token turns and LONG_TOKENS-token cold prompts (none
cached), Poisson arrivals at ``--rate`` per second over NUM_WORKERS workers (least-loaded
routing, so the difference is admission's alone; 3/s is ~80 % of their prefill capacity).
Prints the short and long requests' TTFT p50 / p99 with admission off and on, side by side,
then one summary line.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replay.harness import ReplayConfig, replay  # noqa: E402
from replay.workloads import TraceRequest  # noqa: E402

NUM_WORKERS = 2
SHORT_TOKENS = 1024
LONG_TOKENS = 100_000
BLOCK = 512
POLICY = "least-loaded"


def workload(seed: int, num_requests: int, long_share: float,
             rate_per_s: float) -> list[TraceRequest]:
    rng = random.Random(seed)
    t, block, out = 0.0, 0, []
    for i in range(num_requests):
        t += rng.expovariate(rate_per_s)
        n = LONG_TOKENS if rng.random() < long_share else SHORT_TOKENS
        blocks = tuple(range(block, block + -(-n // BLOCK)))  # NOTE: fresh blocks: all cold
        block += len(blocks)
        out.append(TraceRequest(f"r{i}", None, "", t, None, 0.0, False, blocks, n, 16))
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run(requests: list[TraceRequest], admission: bool) -> dict[str, list[float]]:
    cfg = ReplayConfig(num_workers=NUM_WORKERS, block_size=BLOCK, admission=admission,
                       retention=False, kv_budget_tokens=2_000_000)
    result = replay(requests, POLICY, cfg)
    ttft: dict[str, list[float]] = {"short": [], "long": []}
    for rec in result.records:
        if rec.ttft_s is not None:
            ttft["long" if rec.prompt_tokens >= LONG_TOKENS else "short"].append(rec.ttft_s)
    return ttft


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--long-share", type=float, default=0.1)
    parser.add_argument("--rate", type=float, default=3.0, help="arrivals per second")
    args = parser.parse_args()
    requests = workload(args.seed, args.requests, args.long_share, args.rate)
    rows = {mode: run(requests, mode == "on") for mode in ("off", "on")}
    print(f"{'admission':>9} {'kind':>5} {'n':>4} {'TTFT p50':>9} {'p99':>8} {'mean':>8}")
    for mode, ttft in rows.items():
        for kind, values in ttft.items():
            print(f"{mode:>9} {kind:>5} {len(values):>4} {pct(values, 0.5):>9.3f} "
                  f"{pct(values, 0.99):>8.3f} {statistics.fmean(values or [0]):>8.3f}")
    off, on = rows["off"]["short"], rows["on"]["short"]
    print(f"short-turn TTFT p99 off/on = {pct(off, 0.99) / pct(on, 0.99):.2f}x, "
          f"p50 off/on = {pct(off, 0.5) / pct(on, 0.5):.2f}x")


if __name__ == "__main__":
    main()
