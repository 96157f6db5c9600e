"""Tool-pause retention: re-prefilled tokens and TTFT of the turns after a tool pause, with and
without, while cold traffic churns the KV cache.

    python loadtest/bench_retention.py [--seed 0] [--sessions 24] [--pause 20] [--kv 100k]

A seeded mix on the in-process replay (``replay.harness``: real scheduler, prefix cache and
engine retention, ``h200`` cost, one worker): SESSIONS agent sessions whose first turn
(SESSION_TOKENS) ends in a tool call; each resumes after ``--pause`` seconds with the tool result
(prompt = the first turn's prompt + answer + NEW_TOKENS). Cold one-shot prompts (FILLER_TOKENS,
FILLER_RATE_PER_S) fill the KV cache meanwhile. Prints, with retention off and on: the share of
the resumable tokens that had to be prefilled again, the resumed turns' TTFT p50 / p99, and the
fillers' TTFT p50, then one summary line.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replay.harness import ReplayConfig, replay  # noqa: E402
from replay.workloads import TraceRequest  # noqa: E402

BLOCK = 512
SESSION_TOKENS = 16_384
NEW_TOKENS = 512
OUTPUT_TOKENS = 64
FILLER_TOKENS = 8192
FILLER_RATE_PER_S = 1.0
SESSION_RATE_PER_S = 0.5


def workload(seed: int, sessions: int, pause_s: float) -> list[TraceRequest]:
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    block = 0

    def blocks(n: int) -> tuple[int, ...]:
        nonlocal block
        ids = tuple(range(block, block + -(-n // BLOCK)))
        block += len(ids)
        return ids

    t = 0.0
    for i in range(sessions):
        t += rng.expovariate(SESSION_RATE_PER_S)
        first = TraceRequest(f"s{i}.0", f"s{i}", "", t, None, 0.0, False,
                             blocks(SESSION_TOKENS), SESSION_TOKENS, OUTPUT_TOKENS,
                             ends_in_tool_call=True, tool_names=("bash",))
        total = SESSION_TOKENS + OUTPUT_TOKENS + NEW_TOKENS
        resume = TraceRequest(f"s{i}.1", f"s{i}", "", None, first.request_id, pause_s, True,
                              blocks(NEW_TOKENS), total, OUTPUT_TOKENS,
                              parent_tool_names=("bash",))
        out += [first, resume]
    end_s, t, n = t + pause_s + 10.0, 0.0, 0
    while t < end_s:
        t += rng.expovariate(FILLER_RATE_PER_S)
        out.append(TraceRequest(f"f{n}", None, "", t, None, 0.0, False, blocks(FILLER_TOKENS),
                                FILLER_TOKENS, OUTPUT_TOKENS))
        n += 1
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run(requests: list[TraceRequest], retention: bool, kv_tokens: int) -> dict[str, float]:
    cfg = ReplayConfig(num_workers=1, block_size=BLOCK, kv_budget_tokens=kv_tokens,
                       retention=retention)
    records = replay(requests, "least-loaded", cfg).records
    resumed = [r for r in records if r.request_id.endswith(".1")]
    fillers = [r.ttft_s for r in records if r.request_id.startswith("f") and r.ttft_s]
    resumable = sum(r.resumable_tokens for r in resumed)
    lost = sum(max(0, r.resumable_tokens - r.cached_tokens) for r in resumed)
    ttft = [r.ttft_s for r in resumed if r.ttft_s is not None]
    return {"reprefill": lost / max(1, resumable), "p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99),
            "filler_p50": pct(fillers, 0.5)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--pause", type=float, default=20.0, help="tool pause, seconds")
    parser.add_argument("--kv", default="100k", help="KV per worker, tokens (k/M suffix)")
    args = parser.parse_args()
    kv = int(float(args.kv.lower().rstrip("km")) * (1_000_000 if args.kv[-1] in "mM" else
                                                     1000 if args.kv[-1] in "kK" else 1))
    requests = workload(args.seed, args.sessions, args.pause)
    rows = {mode: run(requests, mode == "on", kv) for mode in ("off", "on")}
    print(f"{'retention':>9} {'re-prefilled':>12} {'resumed TTFT p50':>16} {'p99':>7} "
          f"{'filler p50':>10}")
    for mode, r in rows.items():
        print(f"{mode:>9} {r['reprefill']:>12.1%} {r['p50']:>16.3f} {r['p99']:>7.3f} "
              f"{r['filler_p50']:>10.3f}")
    off, on = rows["off"], rows["on"]
    print(f"re-prefilled after a pause: {off['reprefill']:.1%} off, {on['reprefill']:.1%} on; "
          f"resumed TTFT p99 off/on = {off['p99'] / on['p99']:.2f}x")


if __name__ == "__main__":
    main()
