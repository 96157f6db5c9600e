"""Encoder service throughput with the shared embedding cache vs without (issue 13), side by side.

A real ``EncoderService`` (``MediaEncoder`` on the demo tower, CPU) and ``EncoderClient``s over
ZeroMQ on 127.0.0.1; ``--clients`` coroutines send one-image requests. Seeded workload: every
image is sent twice, in shuffled order, so half the requests repeat an earlier image. Rows: no
cache (an LRU of 0 bytes), the process LRU, and with ``--redis URL|local`` Redis alone as the
shared tier (LRU 0: each hit is a Redis read). The reference system's figure is 2x.

    python loadtest/bench_encoder.py [--requests 256] [--clients 8] [--size 640x480]
        [--max-batch 16] [--max-wait-ms 5] [--repeats 3] [--redis URL|local]

NOTE: the service runs in this process (its threads share the GIL with the clients' loop), as in
tests/encoders/test_service.py; the rows differ only in the cache.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import NamedTuple

import torch
from bench_media import make_jpegs  # loadtest/ is the script's directory
from redis_local import local_redis

from encoders.embed_cache import EmbeddingCache
from encoders.encode import MediaEncoder, load_media_encoder
from encoders.media import content_hash
from encoders.protocol import EmbeddingKey, EncodeItem
from encoders.service import EncoderClient, EncoderService
from encoders.vision import init_tower, save_tower
from encoders.vision_config import demo_vision_config

REQUESTS, CLIENTS, SIZE, MAX_BATCH, MAX_WAIT_MS, HIDDEN, SEED = 256, 8, "640x480", 16, 5.0, 64, 0
REPEATS = 3


def workload(num_requests: int, size: str, seed: int) -> list[bytes]:
    w, h = (int(v) for v in size.split("x"))
    images = make_jpegs(w, h, max(1, num_requests // 2), 90, seed)
    order = images * 2
    random.Random(seed).shuffle(order)
    return order[:num_requests]


async def drive(endpoint: str, enc: MediaEncoder, datas: list[bytes], clients: int,
                salt: str) -> tuple[float, list[float]]:
    """(seconds for all requests, each request's latency in seconds)."""
    todo, latencies = iter(datas), []

    async def client() -> None:
        c = EncoderClient([endpoint], timeout_s=60)
        try:
            for data in todo:
                key = EmbeddingKey(cache_salt=salt, content_hash=content_hash(data),
                                   preprocess_id=enc.preprocess_id,
                                   tower_fingerprint=enc.tower_fingerprint)
                start = time.perf_counter()
                reply = await c.encode([EncodeItem(key=key, data=data)])
                latencies.append(time.perf_counter() - start)
                assert reply.results[0] is not None, reply.errors
        finally:
            await c.aclose()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - start, latencies


class Row(NamedTuple):
    rps: float
    p50_ms: float
    p99_ms: float
    encoded: int


def run_row(make_cache: Callable[[], EmbeddingCache], enc: MediaEncoder, datas: list[bytes],
            args: argparse.Namespace) -> Row:
    cache = make_cache()
    service = EncoderService(enc, cache, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms)
    try:
        endpoint = service.serve("tcp://127.0.0.1:0")
        asyncio.run(drive(endpoint, enc, datas[:4], 2, uuid.uuid4().hex))  # warm up
        warm = service.stats.encoded
        seconds, lat = asyncio.run(drive(endpoint, enc, datas, args.clients, uuid.uuid4().hex))
    finally:
        service.close()
        cache.close()
    lat_ms = sorted(x * 1000 for x in lat)
    return Row(len(datas) / seconds, statistics.median(lat_ms),
               lat_ms[round(0.99 * (len(lat_ms) - 1))], service.stats.encoded - warm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=REQUESTS)
    ap.add_argument("--clients", type=int, default=CLIENTS)
    ap.add_argument("--size", default=SIZE, help="WxH of the JPEGs (default: %(default)s)")
    ap.add_argument("--max-batch", type=int, default=MAX_BATCH)
    ap.add_argument("--max-wait-ms", type=float, default=MAX_WAIT_MS)
    ap.add_argument("--repeats", type=int, default=REPEATS, help="rounds of every row, "
                    "alternated; each row keeps its best (default: %(default)s)")
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--redis", metavar="URL", help="also Redis as the shared tier ('local': "
                                                   "start a redis-server)")
    args = ap.parse_args()
    # NOTE: OpenMP threads on a busy 2-core box stall on each other (tiny tower ops: ~60x slower);
    # MediaEncoder decodes on its own threads, one per core
    torch.set_num_threads(args.torch_threads)
    datas = workload(args.requests, args.size, SEED)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        cfg = demo_vision_config(out_hidden_size=HIDDEN)
        save_tower(init_tower(cfg, seed=SEED), tmp, config=cfg)
        enc = load_media_encoder(tmp)
        assert enc is not None
        redis_url = stack.enter_context(local_redis()) if args.redis == "local" else args.redis
        rows: dict[str, Callable[[], EmbeddingCache]] = {
            "none": lambda: EmbeddingCache(max_bytes=0), "lru": EmbeddingCache}
        if redis_url:
            rows["redis"] = lambda: EmbeddingCache(max_bytes=0, redis_url=redis_url, ttl_s=600)
        best: dict[str, Row] = {}
        for r in range(args.repeats):
            for name in list(rows)[:: 1 if r % 2 == 0 else -1]:
                row = run_row(rows[name], enc, datas, args)
                best[name] = max(best.get(name, row), row, key=lambda r: r.rps)
    print(f"{'cache':>6} {'requests':>8} {'clients':>7} {'req/s':>8} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'encoded':>8}")
    for name, row in best.items():
        print(f"{name:>6} {len(datas):>8} {args.clients:>7} {row.rps:>8.1f} {row.p50_ms:>7.1f} "
              f"{row.p99_ms:>7.1f} {row.encoded:>8}")
    ratios = ", ".join(f"{name} vs none: {best[name].rps / best['none'].rps:.2f}x req/s"
                       for name in best if name != "none")
    print(f"summary: {ratios} ({len(datas)} one-image requests, half repeats, best of "
          f"{args.repeats}; reference system: 2x)")


if __name__ == "__main__":
    main()
