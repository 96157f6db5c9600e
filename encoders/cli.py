"""The encoder service's command line (``agentgate encoder``).

    agentgate encoder --model DIR --listen tcp://127.0.0.1:5570 [--device auto] \\
        [--num-frames 8] [--redis redis://host:6379/0] [--cache-mb 256] [--max-batch 16] \\
        [--max-wait-ms 5]

``run`` serves until SIGINT/SIGTERM and logs one start line on stderr (``encoder listening on
ENDPOINT``). The model is not loaded here: ``run`` takes ``make_encode_fn(args)``, which returns
the ``encode_fn`` (decode + preprocess + tower) the service batches into; the real one is
``encoders.encode.make_encode_fn`` (``python -m encoders``), which needs ``--model``. Like a
worker without CURVE keys, it refuses a non-loopback ``--listen`` unless ``--insecure-expose``:
a client that reaches it can fill the shared embedding cache.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

import zmq

from encoders.service import EncodeFn
from engine.logs import configure_logging
from engine.worker.cli import _die_with_parent, watch_parent
from engine.worker.curve import is_loopback_endpoint

MakeEncodeFn = Callable[[argparse.Namespace], EncodeFn]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The encoder service's flags."""
    add = parser.add_argument
    add("--listen", required=True, help="ROUTER endpoint, e.g. tcp://127.0.0.1:5570")
    add("--model", metavar="DIR", help="the model directory holding the vision tower "
                                       "(vision_tower.safetensors + config.json's vision_config)")
    add("--device", default="auto",
        help="where the tower runs: cpu, cuda, cuda:N, or auto (cuda when available; default: "
             "%(default)s)")
    add("--num-frames", type=int, default=8,
        help="frames sampled uniformly from each video clip (default: %(default)s)")
    add("--redis", metavar="URL", help="share embeddings through this Redis "
                                       "(redis://[[user]:password@]host:port/db; default: "
                                       "process cache only)")
    add("--cache-mb", type=int, default=256,
        help="process embedding cache (LRU) bound in MiB (default: %(default)s)")
    add("--max-batch", type=int, default=16,
        help="most items in one tower call (default: %(default)s)")
    add("--max-wait-ms", type=float, default=5.0,
        help="how long a queued item waits for others to join its batch (default: "
             "%(default)s)")
    add("--redis-ttl-s", type=float, default=86400.0,
        help="lifetime of an embedding in Redis (default: %(default)s)")
    add("--parent-pid", type=int,
        help="stop when this process dies (agentgate serve sets it)")
    add("--insecure-expose", action="store_true",
        help="serve a non-loopback --listen endpoint (anyone who reaches it can use it)")


def run(args: argparse.Namespace, make_encode_fn: MakeEncodeFn) -> int:
    """Serve from parsed flags until SIGINT/SIGTERM; returns the exit status.

    Raises:
        ValueError: a flag out of range, a non-loopback endpoint without --insecure-expose, or
            whatever ``make_encode_fn`` refuses (e.g. a --model without a vision tower).
    """
    _check(args)
    configure_logging("encoder")
    if args.parent_pid is not None:
        _die_with_parent()
        if os.getppid() != args.parent_pid:  # NOTE: the parent died before prctl took effect
            logger.warning("parent process %d is gone before the start", args.parent_pid)
            return 0
    from encoders.embed_cache import EmbeddingCache
    from encoders.service import EncoderService

    encode_fn = make_encode_fn(args)  # NOTE: before the cache: a bad --model opens nothing
    cache = EmbeddingCache(max_bytes=args.cache_mb * 2**20, redis_url=args.redis,
                           ttl_s=args.redis_ttl_s)
    service = EncoderService(encode_fn, cache, max_batch=args.max_batch,
                             max_wait_ms=args.max_wait_ms)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: service.stop())
    if args.parent_pid is not None:
        watch_parent(args.parent_pid, service.stop)
    try:
        endpoint = service.bind(args.listen)
        logger.info("encoder listening on %s (cache %d MiB, redis %s, max batch %d)", endpoint,
                    args.cache_mb, "on" if args.redis else "off", args.max_batch)
        service.run()
    finally:
        service.close()
        cache.close()
    logger.info("encoder stopped: %s; cache %s", service.stats.as_dict(), cache.stats.as_dict())
    return 0


def main(argv: Sequence[str] | None, make_encode_fn: MakeEncodeFn,
         prog: str | None = None) -> int:
    """Parse ``argv`` and ``run``; a bad flag or endpoint prints one error line and returns 2."""
    parser = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args, make_encode_fn)
    except (ValueError, zmq.ZMQError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


def _check(args: argparse.Namespace) -> None:
    if args.cache_mb < 0 or args.max_batch < 1 or args.max_wait_ms < 0:
        raise ValueError(f"--cache-mb {args.cache_mb} (>= 0), --max-batch {args.max_batch} "
                         f"(>= 1), --max-wait-ms {args.max_wait_ms} (>= 0): out of range")
    if args.num_frames < 1:
        raise ValueError(f"--num-frames {args.num_frames}: must be >= 1")
    if args.redis_ttl_s < 1:
        raise ValueError(f"--redis-ttl-s {args.redis_ttl_s}: must be >= 1")
    if not args.insecure_expose and not is_loopback_endpoint(args.listen):
        raise ValueError(f"--listen {args.listen}: not a loopback address; anyone who reaches "
                         "it could fill the shared embedding cache (--insecure-expose to serve "
                         "it anyway)")
