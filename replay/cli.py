"""``agentgate replay``: replay a trace through every routing policy on in-process sim workers.

    agentgate replay TRACE.jsonl | --synthetic agent [--seed S] [--sessions N]
        [--preset conversation] [--workers 8] [--policies agentgate,least-loaded,...]
        [--kv-budget TOKENS] [--block-size 512] [--limit N] [--rate-scale X]
        [--capacity 1,1.5,2] [--admission on|off] [--retention on|off] [--jobs 2]
        [--json OUT] [--plots DIR] [--live N]

Policies run in parallel processes (``--jobs``); a progress bar on stderr, then one table.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing import get_context
from typing import Any

# NOTE: sizes chosen with the benchmark in the README (the global pool's hit rate ~30 % on
# conversation_trace.jsonl); a preset only sets defaults, any flag given wins
PRESETS: dict[str, dict[str, Any]] = {
    "conversation": {"kv_budget": "0.6M", "workers": 8, "cost": "h200", "block_size": 512},
}
DEFAULT_POLICIES = ("agentgate", "round-robin", "least-loaded", "session-hash",
                    "sglang-cache-aware", "dynamo", "llm-d", "lmetric", "global")


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What to replay, rebuilt in each worker process (cheaper than pickling the requests)."""

    trace: str | None
    synthetic: str | None
    seed: int
    sessions: int
    block_size: int
    limit: int | None

    def load(self) -> list[Any]:
        from replay import workloads

        if self.synthetic is not None:
            reqs = workloads.agent_workload(self.seed, self.sessions, block_size=self.block_size)
            return reqs[: self.limit] if self.limit else reqs
        assert self.trace is not None
        return workloads.load_mooncake(self.trace, self.block_size, self.limit)

    def describe(self, requests: Sequence[Any]) -> dict[str, Any]:
        from replay.workloads import summary

        return {"trace": self.trace, "synthetic": self.synthetic, "seed": self.seed,
                "limit": self.limit, "block_size": self.block_size, **summary(list(requests))}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``agentgate replay`` flags (also used by ``gateway.cli``)."""
    add = p.add_argument
    add("trace", nargs="?", help="Mooncake JSONL trace (timestamp ms, input_length, "
                                 "output_length, hash_ids[, session_id])")
    add("--synthetic", choices=("agent",), help="the built-in agent-session workload instead")
    add("--seed", type=int, default=0, help="seed of --synthetic (default 0)")
    add("--sessions", type=int, default=64, help="top-level sessions of --synthetic (64)")
    add("--preset", choices=sorted(PRESETS), help="defaults sized for a known trace: "
        + "; ".join(f"{k}: {v}" for k, v in PRESETS.items()))
    add("--workers", type=int, default=None, help="sim workers (default 8)")
    add("--policies", default=",".join(DEFAULT_POLICIES),
        help="comma-separated routing policies; 'global' = one pool of N x capacity")
    add("--kv-budget", default=None, metavar="TOKENS",
        help="KV per worker in full-attention token equivalents, e.g. 1.25M (default 1M)")
    add("--cost", default=None, help="sim step-cost preset: cpu, h200, zero (default h200)")
    add("--block-size", type=int, default=None, help="tokens per trace block = page (512)")
    add("--limit", type=int, default=None, help="replay only the first N requests")
    add("--rate-scale", type=float, default=1.0,
        help="arrival-rate multiplier (timestamps and think times / X)")
    add("--capacity", default=None, metavar="SCALES",
        help="also run each policy at these rate scales, e.g. 1.25,1.5,2; capacity = the "
             "highest scale whose TTFT p99 stays within least-loaded's at scale 1")
    add("--admission", choices=("on", "off"), default="off",
        help="length buckets and cache-first priority (gateway.routing.admission)")
    add("--retention", choices=("on", "off"), default="on",
        help="retain tool-call turns' KV for the learned pause (Engine.retain)")
    add("--mtp", type=int, default=0, metavar="K",
        help="model MTP speculative decoding on every worker: K drafts per decode step (0)")
    add("--mtp-acceptance", type=float, default=0.7,
        help="with --mtp: the probability a draft is accepted (0.7)")
    add("--jobs", type=int, default=2, help="policies replayed in parallel processes (2)")
    add("--json", dest="json_out", metavar="OUT", help="write the results as JSON")
    add("--plots", metavar="DIR", help="write PNG plots (needs matplotlib)")
    add("--live", type=int, default=None, metavar="N",
        help="also replay the first N requests through a real `agentgate serve --backend sim` "
             "(the first policy listed, over HTTP and ZeroMQ) and check that the in-process "
             "replay agrees (replay.live)")
    add("--quiet", action="store_true", help="no progress bar")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="agentgate replay", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run ``agentgate replay`` with parsed ``args``; returns the exit status.

    Raises:
        ValueError: a bad flag value (the message names it).
    """
    from replay import report

    spec, cfg, policies, scales = _setup(args)
    requests = spec.load()
    if not requests:
        raise ValueError("the workload has no requests")
    if args.plots:
        _check_matplotlib()
    # NOTE: (policy, scale): scale multiplies --rate-scale; 1.0 is the main run
    tasks = [(name, 1.0) for name in policies]
    tasks += [(name, s) for s in scales for name in policies if name != "global" and s != 1.0]
    results = _run_all(spec, cfg, tasks, args.jobs, quiet=args.quiet)
    main_runs = {name: results[(name, 1.0)] for name in policies}
    capacity = _capacity(results, policies, scales)
    doc = report.document(spec.describe(requests), cfg, main_runs, capacity)
    print(report.table(doc))
    if args.live:
        doc["live"] = _live(requests, cfg, policies, args.live)
    if args.json_out:
        report.write_json(doc, args.json_out)
        print(f"wrote {args.json_out}", file=sys.stderr)
    if args.plots:
        for path in report.write_plots(doc, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def replay_task(spec: WorkloadSpec, cfg: Any, policy: str, scale: float) -> dict[str, Any]:
    """One replay in a worker process, at ``scale`` x the configured rate; returns its JSON
    entry."""
    from replay.harness import replay
    from replay.report import policy_entry

    requests = spec.load()
    key = f"{policy}@{scale:g}"
    result = replay(requests, policy, replace(cfg, rate_scale=cfg.rate_scale * scale),
                    progress=lambda done, total: _report_progress(key, done, total))
    return policy_entry(result)


def _live(requests: Sequence[Any], cfg: Any, policies: Sequence[str], limit: int) -> dict:
    from replay.live import compare_live

    policy = next((p for p in policies if p != "global"), "agentgate")
    comparison = compare_live(requests, cfg, limit, router=policy)
    verdict = "agrees" if comparison.agreement.ok() else "DISAGREES"
    print(f"live ({policy}, {len(comparison.requests)} requests): "
          f"{comparison.agreement.line()}: {verdict}")
    return comparison.to_dict()


# ---------------------------------------------------------------------------- setup


def _setup(args: argparse.Namespace) -> tuple[WorkloadSpec, Any, list[str], list[float]]:
    from replay.harness import ReplayConfig
    from replay.routers import policy_names

    preset = PRESETS.get(args.preset or "", {})
    if (args.trace is None) == (args.synthetic is None):
        raise ValueError("give a TRACE file or --synthetic agent (exactly one)")
    block = args.block_size or preset.get("block_size", 512)
    if args.trace is not None and not os.path.isfile(args.trace):
        raise FileNotFoundError(f"trace {args.trace!r}: no such file")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in policy_names()]
    if unknown or not policies:
        raise ValueError(f"--policies: unknown {unknown}; known: {', '.join(policy_names())}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit={args.limit}: must be >= 1")
    if args.jobs < 1:
        raise ValueError(f"--jobs={args.jobs}: must be >= 1")
    if args.live is not None and args.live < 1:
        raise ValueError(f"--live={args.live}: must be >= 1")
    try:
        cfg = ReplayConfig(
            num_workers=args.workers or preset.get("workers", 8),
            kv_budget_tokens=parse_tokens(args.kv_budget or preset.get("kv_budget", "1M")),
            block_size=block, cost=args.cost or preset.get("cost", "h200"),
            admission=args.admission == "on", retention=args.retention == "on",
            rate_scale=args.rate_scale, speculative_tokens=args.mtp,
            mtp_acceptance=args.mtp_acceptance)
        if args.mtp < 0 or not 0 <= args.mtp_acceptance < 1:
            raise ValueError(f"--mtp={args.mtp} (>= 0), --mtp-acceptance={args.mtp_acceptance} "
                             "(in [0, 1))")
    except AssertionError as e:
        raise ValueError(str(e)) from None
    scales = sorted({1.0, *(_floats(args.capacity, "--capacity"))}) if args.capacity else []
    spec = WorkloadSpec(args.trace, args.synthetic, args.seed, args.sessions, block, args.limit)
    return spec, cfg, policies, scales


def parse_tokens(text: str) -> int:
    """'1.25M' -> 1250000, '800k' -> 800000, '5000' -> 5000."""
    t = str(text).strip().lower()
    mult = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if mult != 1 else t) * mult
    except ValueError:
        raise ValueError(f"--kv-budget={text!r}: a token count such as 1.25M or 800k") from None
    if not value >= 1:
        raise ValueError(f"--kv-budget={text!r}: must be >= 1 token")
    return int(value)


def _floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}={text!r}: comma-separated numbers") from None
    if not values or any(not v > 0 for v in values):
        raise ValueError(f"{flag}={text!r}: numbers > 0")
    return values


def _check_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plots needs matplotlib: pip install 'agentgate[plots]'") from None


def _capacity(results: dict[tuple[str, float], dict[str, Any]], policies: Sequence[str],
              scales: Sequence[float]) -> dict[str, Any] | None:
    from replay.report import capacity_entry

    ref = "least-loaded"
    if not scales or (ref, 1.0) not in results:
        return None
    ref_p99 = results[(ref, 1.0)]["summary"]["ttft_p99_s"]
    runs = {name: {s: results[(name, s)]["summary"] for s in scales}
            for name in policies if name != "global"}
    return capacity_entry(ref, ref_p99, scales, runs)


# ---------------------------------------------------------------------------- running

_QUEUE: Any = None


def _init_worker(queue: Any) -> None:
    global _QUEUE
    _QUEUE = queue


def _report_progress(key: str, done: int, total: int) -> None:
    if _QUEUE is not None:
        _QUEUE.put((key, done, total))


def _run_all(spec: WorkloadSpec, cfg: Any, tasks: list[tuple[str, float]], jobs: int,
             quiet: bool) -> dict[tuple[str, float], dict[str, Any]]:
    if jobs == 1 or len(tasks) == 1:
        return _run_here(spec, cfg, tasks, quiet)
    # NOTE: spawn, not fork: the parent may hold torch's threads
    ctx = get_context("spawn")
    queue = ctx.Queue()
    bar = ProgressBar([f"{n}@{s:g}" for n, s in tasks], enabled=not quiet)
    stop = threading.Event()
    reader = threading.Thread(target=_pump, args=(queue, bar, stop), daemon=True)
    reader.start()
    try:
        with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=ctx,
                                 initializer=_init_worker, initargs=(queue,)) as pool:
            futures = {t: pool.submit(replay_task, spec, cfg, *t) for t in tasks}
            return {t: f.result() for t, f in futures.items()}
    finally:
        stop.set()
        reader.join(timeout=2.0)
        bar.close()


def _run_here(spec: WorkloadSpec, cfg: Any, tasks: list[tuple[str, float]],
              quiet: bool) -> dict[tuple[str, float], dict[str, Any]]:
    """--jobs 1: every run in this process, one after the other."""
    global _QUEUE
    bar = ProgressBar([f"{n}@{s:g}" for n, s in tasks], enabled=not quiet)
    _QUEUE = _BarFeed(bar)
    try:
        return {t: replay_task(spec, cfg, *t) for t in tasks}
    finally:
        _QUEUE = None
        bar.close()


class _BarFeed:
    """Stands in for the progress queue when the runs are in this process."""

    def __init__(self, bar: ProgressBar) -> None:
        self.bar = bar

    def put(self, item: tuple[str, int, int]) -> None:
        self.bar.update(*item)


def _pump(queue: Any, bar: ProgressBar, stop: threading.Event) -> None:
    import queue as queue_mod

    while not stop.is_set():
        try:
            key, done, total = queue.get(timeout=0.2)
        except (queue_mod.Empty, EOFError, OSError):
            continue
        bar.update(key, done, total)


class ProgressBar:
    """One line on stderr: overall done / total requests over every run, and the runs going."""

    def __init__(self, keys: Sequence[str], enabled: bool = True, width: int = 30) -> None:
        self.done = dict.fromkeys(keys, 0)
        self.total = dict.fromkeys(keys, 0)
        self.enabled, self.width = enabled, width
        self.t0 = time.monotonic()
        self._last_draw = 0.0
        self._lock = threading.Lock()

    def update(self, key: str, done: int, total: int) -> None:
        with self._lock:
            self.done[key], self.total[key] = done, total
            now = time.monotonic()
            if now - self._last_draw >= 0.5 or done == total:
                self._last_draw = now
                self._draw()

    def close(self) -> None:
        if self.enabled:
            with self._lock:
                self._draw()
                sys.stderr.write("\n")
                sys.stderr.flush()

    def _draw(self) -> None:
        if not self.enabled:
            return
        total = sum(self.total.values()) or 1
        known = sum(1 for t in self.total.values() if t) or 1
        # NOTE: runs not started yet count as the size of the ones that did
        total = total + (len(self.total) - known) * (total // known)
        frac = min(1.0, sum(self.done.values()) / total)
        filled = int(frac * self.width)
        running = [k for k in self.done if self.total[k] and self.done[k] < self.total[k]]
        line = (f"\rreplay [{'#' * filled}{'.' * (self.width - filled)}] {frac:6.1%} "
                f"{time.monotonic() - self.t0:6.0f}s  {' '.join(running)[:60]:<60}")
        sys.stderr.write(line)
        sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
