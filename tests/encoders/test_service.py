"""The encoder service and client over real ZeroMQ sockets on 127.0.0.1: dynamic batching across
concurrent requests, the cache in front of the tower, per-item errors, Lookup by key, bounded
queues, two replicas (both used; a stopped one times out clearly and the other takes over), and
the ``agentgate encoder`` command line stopping cleanly on a signal."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq

from encoders.cli import main as cli_main
from encoders.embed_cache import EmbeddingCache, from_embedding
from encoders.protocol import (
    EmbeddingKey,
    Embeddings,
    EncodeError,
    EncodeItem,
    Lookup,
    decode_reply,
    encode,
)
from encoders.service import (
    EncoderClient,
    EncoderRejected,
    EncoderService,
    EncoderTimeout,
)
from tests.encoders.encoder_proc import wait_for_start_line

ROOT = Path(__file__).resolve().parents[2]
TEST_TIMEOUT_S = 15.0
DIM = 8
_PROJECTION = torch.randn(32, DIM, generator=torch.Generator().manual_seed(0))


def _embed(data: bytes) -> torch.Tensor:
    """The fake tower: a fixed random projection of the bytes' sha256; 1 to 3 tokens."""
    digest = torch.tensor(list(hashlib.sha256(data).digest()), dtype=torch.float32)
    return (digest @ _PROJECTION).repeat(1 + len(data) % 3, 1)


class _FakeTower:
    """``encode_fn`` that records each batch, may sleep or wait for ``release``, and raises
    for items that start with b"bad"."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.batches: list[list[bytes]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def __call__(self, datas: list[bytes]) -> list[torch.Tensor | Exception]:
        self.batches.append(list(datas))
        self.entered.set()
        self.release.wait(TEST_TIMEOUT_S)
        time.sleep(self.delay_s)
        return [ValueError(f"cannot decode {d[:8]!r}") if d.startswith(b"bad") else _embed(d)
                for d in datas]

    @property
    def batch_sizes(self) -> list[int]:
        return [len(b) for b in self.batches]

    @property
    def seen(self) -> list[bytes]:
        return [d for b in self.batches for d in b]


def _make_item(data: bytes, salt: str = "", tower: str = "t0") -> EncodeItem:
    return EncodeItem(key=EmbeddingKey(cache_salt=salt, content_hash=hashlib.sha256(
        data).hexdigest(), preprocess_id="p0", tower_fingerprint=tower), data=data)


@contextlib.contextmanager
def _serving(encode_fn: Any, cache: EmbeddingCache | None = None,
             **kwargs: Any) -> Iterator[EncoderService]:
    service = EncoderService(encode_fn, cache or EmbeddingCache(), **kwargs)
    service.serve("tcp://127.0.0.1:0")
    try:
        yield service
    finally:
        service.close()


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, TEST_TIMEOUT_S))


async def _encode_all(client: EncoderClient, requests: list[list[EncodeItem]],
                      **kwargs: Any) -> list[Embeddings]:
    try:
        return list(await asyncio.gather(*(client.encode(r, **kwargs) for r in requests)))
    finally:
        await client.aclose()


def _assert_embeds(reply: Embeddings, datas: list[bytes | None]) -> None:
    """``reply.results[i]`` is the embedding of ``datas[i]`` (None: a failed item)."""
    assert len(reply.results) == len(datas), reply
    for i, (emb, data) in enumerate(zip(reply.results, datas)):
        if data is None:
            assert emb is None, f"item {i} should have failed: {emb}"
            continue
        assert emb is not None and emb.index == i, f"item {i}: {emb}"
        got, want = from_embedding(emb), _embed(data)
        assert torch.equal(got, want), f"item {i}: {got} != {want}"


# ---------------------------------------------------------------------- batching and cache


def test_concurrent_requests_are_batched() -> None:
    tower = _FakeTower(delay_s=0.05)
    datas = [f"image-{i}".encode() for i in range(12)]
    with _serving(tower, max_batch=8, max_wait_ms=5) as service:
        client = EncoderClient([service.endpoint or ""], timeout_s=10)
        replies = _run(_encode_all(client, [[_make_item(d)] for d in datas]))
    for reply, data in zip(replies, datas):
        _assert_embeds(reply, [data])
    assert sorted(tower.seen) == sorted(datas), "each item encoded exactly once"
    assert max(tower.batch_sizes) > 1, f"no batch held two requests' items: {tower.batch_sizes}"
    assert max(tower.batch_sizes) <= 8, tower.batch_sizes
    assert service.stats.batches == len(tower.batches) < len(datas), service.stats


def test_cached_items_skip_the_tower() -> None:
    tower = _FakeTower()
    cache = EmbeddingCache()
    cache.put(_make_item(b"put-before").key, _embed(b"put-before"))
    with _serving(tower, cache) as service:
        client = EncoderClient([service.endpoint or ""])

        async def calls() -> list[Embeddings]:
            first = await client.encode([_make_item(b"a"), _make_item(b"b")])
            second = await client.encode([_make_item(d) for d in (b"a", b"b", b"c",
                                                                   b"put-before")])
            await client.aclose()
            return [first, second]

        first, second = _run(calls())
    _assert_embeds(first, [b"a", b"b"])
    _assert_embeds(second, [b"a", b"b", b"c", b"put-before"])
    assert sorted(tower.seen) == [b"a", b"b", b"c"], tower.batches
    assert service.stats.cache_hits == 3, service.stats


def test_equal_keys_in_one_batch_are_encoded_once() -> None:
    tower = _FakeTower()
    with _serving(tower, max_batch=16, max_wait_ms=50) as service:
        client = EncoderClient([service.endpoint or ""])
        (reply,) = _run(_encode_all(client, [[_make_item(b"same")] * 3]))
    _assert_embeds(reply, [b"same"] * 3)
    assert tower.seen == [b"same"], tower.batches


def test_with_data_false_answers_dtype_and_shape_only() -> None:
    with _serving(_FakeTower()) as service:
        client = EncoderClient([service.endpoint or ""])
        (reply,) = _run(_encode_all(client, [[_make_item(b"xy")]], with_data=False))
    (emb,) = reply.results
    assert emb is not None and emb.data == b"", emb
    assert (emb.dtype, emb.shape) == ("float32", list(_embed(b"xy").shape)), emb


# ---------------------------------------------------------------------- errors


def test_an_item_error_fails_only_that_item_and_is_not_cached() -> None:
    tower = _FakeTower()
    with _serving(tower) as service:
        client = EncoderClient([service.endpoint or ""])
        (reply,) = _run(_encode_all(client, [[_make_item(d) for d in (b"ok1", b"bad!", b"ok2")]]))
        assert client.lookup([_make_item(b"bad!").key], timeout_s=5) == [None]
        client.close()
    _assert_embeds(reply, [b"ok1", None, b"ok2"])
    assert [(e.index, e.code) for e in reply.errors] == [(1, "encode_failed")], reply.errors
    assert "cannot decode" in reply.errors[0].reason, reply.errors


def test_a_tower_that_raises_or_miscounts_fails_its_batch_and_the_service_goes_on() -> None:
    calls: list[int] = []

    def flaky(datas: list[bytes]) -> list[torch.Tensor | Exception]:
        calls.append(len(datas))
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory")
        if len(calls) == 2:
            return []
        return [_embed(d) for d in datas]

    with _serving(flaky) as service:
        client = EncoderClient([service.endpoint or ""])

        async def three() -> list[Embeddings]:
            replies = [await client.encode([_make_item(b"x")]) for _ in range(3)]
            await client.aclose()
            return replies

        oom, short, ok = _run(three())
    assert oom.results == [None] and "CUDA out of memory" in oom.errors[0].reason, oom
    assert short.results == [None] and "0 results for 1" in short.errors[0].reason, short
    _assert_embeds(ok, [b"x"])


def test_an_undecodable_message_is_answered_and_the_service_goes_on() -> None:
    with _serving(_FakeTower()) as service:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(service.endpoint or "")
        try:
            replies = []
            for payload in (b"\xc1garbage", msgspec.msgpack.encode(
                    {"type": "encode", "request_id": "r7", "items": "nope"})):
                sock.send(payload)
                assert sock.poll(5000), "no answer to a bad message"
                replies.append(decode_reply(sock.recv()))
            sock.send(encode(Lookup(request_id="r8", keys=[_make_item(b"q").key])))
            assert sock.poll(5000)
            good = decode_reply(sock.recv())
        finally:
            sock.close()
    assert [(r.request_id, r.code) for r in replies if isinstance(r, EncodeError)] == [
        ("", "bad_message"), ("r7", "bad_message")], replies
    assert isinstance(good, Embeddings) and good.results == [None], good


def test_a_full_request_queue_answers_overloaded_at_once() -> None:
    entered, release = threading.Event(), threading.Event()

    class _SlowCache(EmbeddingCache):
        def get_many(self, keys: Any) -> Any:
            entered.set()
            release.wait(TEST_TIMEOUT_S)
            return super().get_many(keys)

    with _serving(_FakeTower(), _SlowCache(), max_queued_requests=1) as service:
        client = EncoderClient([service.endpoint or ""])

        async def flood() -> tuple[list[Embeddings], EncoderRejected, float]:
            held = [asyncio.create_task(client.encode([_make_item(b"1")]))]
            assert await asyncio.to_thread(entered.wait, 5), "the cache thread never started"
            held.append(asyncio.create_task(client.encode([_make_item(b"2")])))
            await asyncio.sleep(0.05)  # NOTE: the second is queued: the one free place
            start = time.monotonic()
            with pytest.raises(EncoderRejected) as refused:
                await client.encode([_make_item(b"3")])
            elapsed = time.monotonic() - start
            release.set()
            done = list(await asyncio.gather(*held))
            await client.aclose()
            return done, refused.value, elapsed

        done, refused, elapsed = _run(flood())
    assert refused.error.code == "overloaded", refused
    assert elapsed < 1.0, f"the refusal took {elapsed:.2f} s"
    _assert_embeds(done[0], [b"1"])
    _assert_embeds(done[1], [b"2"])


def test_more_items_than_the_queue_holds_is_an_invalid_request() -> None:
    with _serving(_FakeTower(), max_queued_items=2) as service:
        client = EncoderClient([service.endpoint or ""])
        with pytest.raises(EncoderRejected, match="invalid_request"):
            _run(_encode_all(client, [[_make_item(bytes([i])) for i in range(3)]]))


# ---------------------------------------------------------------------- Lookup


def test_lookup_answers_from_the_cache_only() -> None:
    tower = _FakeTower()
    with _serving(tower) as service:
        client = EncoderClient([service.endpoint or ""])
        _run(_encode_all(client, [[_make_item(b"seen", salt="s1")]]))
        got = client.lookup([_make_item(d, salt=s).key for d, s in (
            (b"seen", "s1"), (b"never", "s1"), (b"seen", "s2"))], timeout_s=5)
        client.close()
    assert got[0] is not None and torch.equal(got[0], _embed(b"seen")), got
    assert got[1:] == [None, None], "a Lookup miss, or another tenant's key, must not hit"
    assert tower.seen == [b"seen"], "Lookup must never encode"


def test_a_worker_looks_up_what_another_replica_encoded_through_redis(redis_url: str) -> None:
    tower_id = uuid.uuid4().hex[:12]
    with _serving(_FakeTower(), EmbeddingCache(redis_url=redis_url)) as a, \
            _serving(_FakeTower(), EmbeddingCache(redis_url=redis_url)) as b:
        _run(_encode_all(EncoderClient([a.endpoint or ""]),
                         [[_make_item(b"shared", tower=tower_id)]]))
        worker = EncoderClient([b.endpoint or ""])
        (got,) = worker.lookup([_make_item(b"shared", tower=tower_id).key], timeout_s=5)
        worker.close()
        assert b.cache.stats.hits_redis == 1, b.cache.stats
    assert got is not None and torch.equal(got, _embed(b"shared")), got


# ---------------------------------------------------------------------- replicas


def test_two_replicas_are_both_used() -> None:
    towers = [_FakeTower(delay_s=0.03), _FakeTower(delay_s=0.03)]
    with _serving(towers[0]) as a, _serving(towers[1]) as b:
        client = EncoderClient([a.endpoint or "", b.endpoint or ""])
        datas = [f"r{i}".encode() for i in range(10)]
        replies = _run(_encode_all(client, [[_make_item(d)] for d in datas]))
    for reply, data in zip(replies, datas):
        _assert_embeds(reply, [data])
    answered = [r.answered for r in client.replicas]
    assert all(n > 0 for n in answered) and sum(answered) == 10, client.replicas
    assert [s.stats.requests for s in (a, b)] == answered, (a.stats, b.stats)


def test_a_stopped_replica_times_out_clearly_and_the_other_takes_over() -> None:
    with _serving(_FakeTower()) as live:
        dead = EncoderService(_FakeTower(), EmbeddingCache())
        dead_endpoint = dead.serve("tcp://127.0.0.1:0")
        client = EncoderClient([dead_endpoint, live.endpoint or ""], timeout_s=0.5, down_s=30)

        async def calls() -> list[Embeddings | EncoderTimeout]:
            _assert_embeds(await client.encode([_make_item(b"warm-0")]), [b"warm-0"])
            _assert_embeds(await client.encode([_make_item(b"warm-1")]), [b"warm-1"])
            dead.close()
            out: list[Embeddings | EncoderTimeout] = []
            for i in range(4):
                try:
                    out.append(await client.encode([_make_item(b"after-%d" % i)]))
                except EncoderTimeout as exc:
                    out.append(exc)
            got = client.lookup([_make_item(b"after-3").key], timeout_s=2)
            assert got[0] is not None, "the lookup went to the stopped replica"
            await client.aclose()
            return out

        out = _run(calls())
    timeouts = [r for r in out if isinstance(r, EncoderTimeout)]
    assert len(timeouts) == 1, out
    assert dead_endpoint in str(timeouts[0]) and "within 0.5 s" in str(timeouts[0]), timeouts
    after = out[out.index(timeouts[0]) + 1:]
    assert after and all(isinstance(r, Embeddings) for r in after), out
    # NOTE: the live one answered warm-1, every call after the timeout, and the lookup
    assert client.replicas[0].timeouts == 1, client.replicas
    assert client.replicas[1].answered == 1 + len(after) + 1, client.replicas


# ---------------------------------------------------------------------- command line


_CLI = textwrap.dedent("""
    import sys, torch
    from encoders.cli import main
    def make(args):
        return lambda datas: [torch.full((1, 4), float(len(d))) for d in datas]
    sys.exit(main(sys.argv[1:], make, prog="agentgate encoder"))
""")


def test_the_command_line_serves_until_sigterm_or_sigint() -> None:
    # NOTE: both processes start at once: each spends most of its start importing torch
    procs = {sig: subprocess.Popen(
        [sys.executable, "-c", _CLI, "--listen", "tcp://127.0.0.1:0", "--max-batch", "4"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    ) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for sig, proc in procs.items():
            client = EncoderClient([wait_for_start_line(proc, TEST_TIMEOUT_S)], timeout_s=5)
            (reply,) = _run(_encode_all(client, [[_make_item(b"abc")]]))
            assert reply.results[0] is not None
            assert torch.equal(from_embedding(reply.results[0]), torch.full((1, 4), 3.0))
            proc.send_signal(sig)
        for sig, proc in procs.items():
            assert proc.wait(timeout=10) == 0, f"rc={proc.returncode} after {sig.name}"
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_the_command_line_refuses_a_non_loopback_endpoint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli_main(["--listen", "tcp://0.0.0.0:5999"], lambda args: _FakeTower()) == 2
    assert "not a loopback address" in capsys.readouterr().err
