"""Live vs in-process replay agreement (issue 9: hit rate within 2 points, TTFT p50 within 15 %).

    python loadtest/bench_live_replay.py [conversation|agent] [--requests 100] [--workers 8]
        [--router agentgate] [--kv-budget 1250000] [--max-output N] [--rate-scale X]

Replays the first N requests (in arrival order) of the trace, or of the agent workload, through
a real ``agentgate serve --backend sim`` (h200 cost, wall time) and through
``replay.harness.replay`` (virtual time), and prints both side by side and one summary line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replay.harness import ReplayConfig  # noqa: E402
from replay.live import compare_live  # noqa: E402
from replay.workloads import agent_workload, load_mooncake  # noqa: E402

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workload", nargs="?", default="conversation",
                   choices=("conversation", "synthetic", "agent"))
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--router", default="agentgate")
    p.add_argument("--kv-budget", type=int, default=1_250_000)
    p.add_argument("--max-output", type=int, default=None)
    p.add_argument("--max-think", type=float, default=1.0)
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.workload == "agent":
        reqs = agent_workload(args.seed, 16)
    else:
        reqs = load_mooncake(TRACES / f"{args.workload}_trace.jsonl", limit=args.requests * 2)
    cfg = ReplayConfig(num_workers=args.workers, kv_budget_tokens=args.kv_budget, cost="h200",
                       rate_scale=args.rate_scale)
    t0 = time.perf_counter()
    c = compare_live(reqs, cfg, args.requests, router=args.router, max_think_s=args.max_think,
                     max_output_tokens=args.max_output)
    wall_s = time.perf_counter() - t0
    print(f"{'':12} {'hit':>7} {'TTFT mean':>10} {'p50':>8} {'p99':>8}  ok/err")
    for name, s in (("live", c.live.summary), ("in-process", c.sim.summary)):
        print(f"{name:12} {s.hit_rate:7.2%} {s.ttft_mean_s:10.3f} {s.ttft_p50_s:8.3f} "
              f"{s.ttft_p99_s:8.3f}  {s.num_finished}/{s.num_errors}")
    a = c.agreement
    print(f"{args.workload} {len(c.requests)} requests, {args.workers} workers, "
          f"router {args.router}: hit rate diff {a.hit_rate_points:.2f} points (<= 2), "
          f"TTFT p50 diff {a.ttft_p50_rel:.1%} (<= 15 %; idle round trip "
          f"{a.round_trip_s * 1e3:.0f} ms), agrees={a.ok()}, "
          f"live {c.live.wall_s:.0f} s, total {wall_s:.0f} s")


if __name__ == "__main__":
    main()
