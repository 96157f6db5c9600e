"""The worker's command line, shared by ``python -m engine.worker`` and ``agentgate worker``.

    agentgate worker --listen tcp://127.0.0.1:5555 --events tcp://127.0.0.1:5556 \\
        [--model DIR] [--backend native|sim] [--replay tcp://...] [...]   (see --help)

``run`` serves until SIGINT/SIGTERM and prints one start line on stderr (``worker ID listening on
ENDPOINT, events on ENDPOINT``) that ``gateway.serve.spawn_worker`` waits for.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

import zmq

import engine.worker
from engine.config import EngineConfig
from engine.worker import COSTS, Worker, WorkerConfig

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_DESCRIPTION = (engine.worker.__doc__ or "").split("\n\n")[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's flags (shared by ``python -m engine.worker`` and ``agentgate worker``)."""
    add = parser.add_argument
    add("--model", help="model directory (config.json + safetensors); the sim backend "
                        "defaults to the built-in demo geometry")
    add("--listen", required=True, help="ROUTER endpoint for requests, e.g. tcp://127.0.0.1:5555")
    add("--events", required=True, help="PUB endpoint for KV events (topic kv) and load "
                                        "reports (topic load)")
    add("--replay", help="ROUTER endpoint for KV event replay (default: none)")
    add("--backend", choices=("native", "sim"), help="default native (or AGENTGATE_BACKEND)")
    add("--page-size", type=int, help="tokens per KV page (a power of 2; default 16)")
    add("--kv-budget-mb", type=int, help="KV byte budget in MiB (default 256)")
    add("--max-batched-tokens", type=int, help="token budget per step (default 512)")
    add("--no-prefix-cache", action="store_const", const=False, dest="prefix_cache",
        help="keep no KV of finished requests")
    add("--worker-id", help="name in Welcome and LoadReport (default host-pid)")
    add("--cost", choices=COSTS, default="cpu", help="sim backend step-time preset")
    add("--dtype", help="native backend: float32, bfloat16 or auto")
    add("--device", help="native backend: cpu or cuda (default: cuda if available)")


def run(args: argparse.Namespace) -> int:
    """Start a worker from parsed flags and serve until SIGINT/SIGTERM; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format=_LOG_FORMAT)
    engine_cfg = EngineConfig.from_env(
        model_path=args.model, backend=args.backend, page_size=args.page_size,
        kv_budget_bytes=args.kv_budget_mb * 2**20 if args.kv_budget_mb else None,
        max_num_batched_tokens=args.max_batched_tokens, enable_prefix_cache=args.prefix_cache,
        dtype=args.dtype, device=args.device,
    )
    if engine_cfg.backend == "native" and engine_cfg.model_path is None:
        raise ValueError("--model is required with the native backend")
    extra = {"worker_id": args.worker_id} if args.worker_id else {}
    cfg = WorkerConfig(listen=args.listen, events=args.events, replay=args.replay,
                       cost=args.cost, **extra)
    worker = Worker(cfg, engine_cfg)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: worker.stop())
    listen, events = worker.endpoints
    print(f"worker {cfg.worker_id} listening on {listen}, events on {events}",
          file=sys.stderr, flush=True)
    try:
        worker.serve()
    finally:
        worker.close()
    return 0


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=_DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (AssertionError, ValueError, FileNotFoundError, zmq.ZMQError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
