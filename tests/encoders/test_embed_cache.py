"""``EmbeddingCache`` against the real thing: the byte-bounded LRU, a real redis-server shared by
two processes, a Redis that dies, freezes and comes back (misses, quickly, one warning per
outage), corrupt values (misses, never wrong data) and tenant isolation."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
import torch

from encoders.embed_cache import (
    EmbeddingCache,
    EmbeddingKey,
    decode_value,
    encode_value,
    from_embedding,
    redis_key,
    to_embedding,
)
from tests.sessions.redis_server import redis_server

ROOT = Path(__file__).resolve().parents[2]
CALL_LIMIT_S = 1.0
TENSOR_BYTES = 64  # _make_tensor(): 4 x 4 float32


def _make_key(content: str, salt: str = "", tower: str | None = None) -> EmbeddingKey:
    # NOTE: a fresh tower per test unless given: the redis_url server is shared by the run
    return EmbeddingKey(cache_salt=salt, content_hash=content, preprocess_id="img336",
                        tower_fingerprint=tower or uuid.uuid4().hex[:16])


def _make_tensor(fill: float, shape: tuple[int, ...] = (4, 4),
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(
        shape).add(fill).to(dtype)


def _assert_same(got: torch.Tensor | None, want: torch.Tensor) -> None:
    assert got is not None, "a miss where a hit was expected"
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape)
    assert torch.equal(got, want), f"values differ: {got} != {want}"


def _timed(call: object, *args: object) -> object:
    start = time.monotonic()
    result = call(*args)  # type: ignore[operator]
    elapsed = time.monotonic() - start
    assert elapsed < CALL_LIMIT_S, f"{call} took {elapsed:.2f} s during an outage"
    return result


def _outage_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "encoders.embed_cache" and r.levelno == logging.WARNING]


# ---------------------------------------------------------------------- process LRU


def test_lru_is_bounded_by_bytes_and_evicts_least_recently_used() -> None:
    cache = EmbeddingCache(max_bytes=3 * TENSOR_BYTES)
    tower = uuid.uuid4().hex[:16]
    a, b, c, d = (_make_key(h, tower=tower) for h in ("0a", "0b", "0c", "0d"))
    for i, key in enumerate((a, b, c)):
        cache.put(key, _make_tensor(i))
    _assert_same(cache.get(a), _make_tensor(0))  # NOTE: a is now the most recent; b the least
    cache.put(d, _make_tensor(3))
    assert cache.local_bytes == 3 * TENSOR_BYTES, cache.local_bytes
    assert cache.get(b) is None, "b was the least recently used: it should have gone"
    for i, key in ((0, a), (2, c), (3, d)):
        _assert_same(cache.get(key), _make_tensor(i))
    assert cache.stats.evictions == 1 and cache.stats.misses == 1, cache.stats


def test_a_tensor_larger_than_the_bound_is_not_kept_locally() -> None:
    cache = EmbeddingCache(max_bytes=TENSOR_BYTES)
    small, big = _make_key("01"), _make_key("02")
    cache.put(small, _make_tensor(1))
    cache.put(big, _make_tensor(2, shape=(8, 4)))
    assert cache.get(big) is None
    _assert_same(cache.get(small), _make_tensor(1))  # NOTE: not evicted to make room for it
    assert cache.local_bytes == TENSOR_BYTES


def test_putting_a_key_again_replaces_it_without_double_counting() -> None:
    cache = EmbeddingCache(max_bytes=10 * TENSOR_BYTES)
    key = _make_key("ab")
    cache.put(key, _make_tensor(1))
    cache.put(key, _make_tensor(2, shape=(2, 4)))
    _assert_same(cache.get(key), _make_tensor(2, shape=(2, 4)))
    assert cache.local_bytes == TENSOR_BYTES // 2, cache.local_bytes


def test_concurrent_use_keeps_the_byte_bound() -> None:
    cache = EmbeddingCache(max_bytes=5 * TENSOR_BYTES)
    keys = [_make_key(f"{i:04x}") for i in range(40)]
    errors: list[BaseException] = []

    def hammer(offset: int) -> None:
        try:
            for n in range(200):
                key = keys[(n * 7 + offset) % len(keys)]
                got = cache.get(key)
                if got is not None:
                    _assert_same(got, _make_tensor(keys.index(key)))
                else:
                    cache.put(key, _make_tensor(keys.index(key)))
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert cache.local_bytes <= 5 * TENSOR_BYTES, cache.local_bytes


# ---------------------------------------------------------------------- value format


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5), (1, 2, 3), (0, 4), ()])
def test_value_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = _make_tensor(0.5, shape, dtype)
    _assert_same(decode_value(encode_value(tensor)), tensor)
    _assert_same(from_embedding(to_embedding(0, tensor)), tensor)


def test_every_flipped_byte_truncation_and_padding_is_a_miss() -> None:
    value = encode_value(_make_tensor(1.0, (2, 3)))
    for i in range(len(value)):
        flipped = bytearray(value)
        flipped[i] ^= 0x40
        assert decode_value(bytes(flipped)) is None, f"byte {i} flipped still decoded"
    for n in range(len(value)):
        assert decode_value(value[:n]) is None, f"truncated to {n} bytes still decoded"
    assert decode_value(value + b"\0") is None
    assert decode_value(b"") is None and decode_value(b"\xff" * 64) is None


def test_unsupported_dtype_is_refused_on_put() -> None:
    with pytest.raises(ValueError, match="int64"):
        EmbeddingCache().put(_make_key("aa"), torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize(("field", "value"), [
    ("content_hash", "XYZ"), ("content_hash", ""), ("content_hash", "a" * 129),
    ("preprocess_id", "a:b"), ("preprocess_id", ""), ("tower_fingerprint", ""),
])
def test_a_malformed_key_is_refused(field: str, value: str) -> None:
    fields = {"content_hash": "ab", "preprocess_id": "p", "tower_fingerprint": "t", field: value}
    with pytest.raises(ValueError, match=field):
        EmbeddingKey(**fields)


# ---------------------------------------------------------------------- Redis


def test_round_trip_through_redis_fills_the_lru(redis_url: str) -> None:
    key = _make_key("c0ffee")
    writer, reader = EmbeddingCache(redis_url=redis_url), EmbeddingCache(redis_url=redis_url)
    tensor = _make_tensor(7.0, (3, 8), torch.bfloat16)
    writer.put(key, tensor)
    _assert_same(reader.get(key), tensor)
    assert (reader.stats.hits_redis, reader.stats.hits_local) == (1, 0), reader.stats
    _assert_same(reader.get(key), tensor)
    assert (reader.stats.hits_redis, reader.stats.hits_local) == (1, 1), reader.stats
    assert 0 < redis.Redis.from_url(redis_url).ttl(redis_key(key)) <= 86400
    writer.close()
    reader.close()


def test_get_many_mixes_local_redis_and_misses(redis_url: str) -> None:
    tower = uuid.uuid4().hex[:16]
    keys = [_make_key(h, tower=tower) for h in ("01", "02", "03")]
    writer = EmbeddingCache(redis_url=redis_url)
    writer.put_many([(keys[0], _make_tensor(0)), (keys[1], _make_tensor(1))])
    reader = EmbeddingCache(redis_url=redis_url)
    reader.put(keys[0], _make_tensor(0))  # NOTE: local in the reader too
    got = reader.get_many(keys)
    _assert_same(got[0], _make_tensor(0))
    _assert_same(got[1], _make_tensor(1))
    assert got[2] is None
    stats = reader.stats
    assert (stats.hits_local, stats.hits_redis, stats.misses) == (1, 1, 1), stats


_PUTTER = textwrap.dedent("""
    import sys, torch
    from encoders.embed_cache import EmbeddingCache, EmbeddingKey
    url, tower = sys.argv[1], sys.argv[2]
    cache = EmbeddingCache(redis_url=url)
    key = EmbeddingKey(cache_salt="t1", content_hash="beef", preprocess_id="img336",
                       tower_fingerprint=tower)
    cache.put(key, torch.arange(12, dtype=torch.float16).reshape(3, 4) * 0.25)
    print(cache.stats.puts, cache.stats.errors)
""")


def test_another_process_gets_an_embedding_this_one_put(redis_url: str) -> None:
    tower = uuid.uuid4().hex[:16]
    result = subprocess.run([sys.executable, "-c", _PUTTER, redis_url, tower],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "0"], result.stdout
    cache = EmbeddingCache(redis_url=redis_url)
    key = _make_key("beef", salt="t1", tower=tower)
    _assert_same(cache.get(key), torch.arange(12, dtype=torch.float16).reshape(3, 4) * 0.25)
    assert (cache.stats.hits_redis, cache.stats.hits_local) == (1, 0), cache.stats


def test_a_corrupt_or_truncated_redis_value_is_a_miss(redis_url: str) -> None:
    tower = uuid.uuid4().hex[:16]
    flipped, truncated = _make_key("aa", tower=tower), _make_key("bb", tower=tower)
    EmbeddingCache(redis_url=redis_url).put_many(
        [(flipped, _make_tensor(1)), (truncated, _make_tensor(2))])
    raw = redis.Redis.from_url(redis_url)
    value = bytearray(raw.get(redis_key(flipped)) or b"")
    value[30] ^= 0x01
    raw.set(redis_key(flipped), bytes(value))
    raw.set(redis_key(truncated), (raw.get(redis_key(truncated)) or b"")[:-9])
    reader = EmbeddingCache(redis_url=redis_url)
    assert reader.get_many([flipped, truncated]) == [None, None]
    assert (reader.stats.corrupt, reader.stats.misses, reader.stats.hits_redis) == (2, 2, 0), \
        reader.stats
    assert reader.local_bytes == 0, "a corrupt value must not enter the LRU"


def test_a_tenant_never_gets_another_tenants_embedding(redis_url: str) -> None:
    tower = uuid.uuid4().hex[:16]
    a_key = _make_key("feed", salt="tenant-a-secret", tower=tower)
    b_key, no_salt = (_make_key("feed", salt=s, tower=tower) for s in ("tenant-b", ""))
    tenant_a = EmbeddingCache(redis_url=redis_url)
    tenant_a.put(a_key, _make_tensor(1))
    assert redis_key(a_key) != redis_key(b_key) != redis_key(no_salt)
    for reader in (tenant_a, EmbeddingCache(redis_url=redis_url)):  # NOTE: local, then Redis
        assert reader.get_many([b_key, no_salt]) == [None, None]
    _assert_same(EmbeddingCache(redis_url=redis_url).get(a_key), _make_tensor(1))
    stored = [k.decode() for k in redis.Redis.from_url(redis_url).scan_iter(f"*{tower}*")]
    assert stored == [redis_key(a_key).decode()], stored
    assert all("tenant-a-secret" not in k for k in stored), "the salt shows in a key"


def test_redis_killed_mid_run_reads_as_misses_then_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="encoders.embed_cache")
    keys = [_make_key(f"{i:02x}") for i in range(5)]
    with redis_server(tmp_path) as server:
        cache = EmbeddingCache(max_bytes=0, redis_url=server.url)  # NOTE: every get asks Redis
        cache.put_many([(k, _make_tensor(i)) for i, k in enumerate(keys)])
        _assert_same(cache.get(keys[0]), _make_tensor(0))
        server.kill()
        for _ in range(3):
            assert _timed(cache.get_many, keys) == [None] * 5
            _timed(cache.put, keys[0], _make_tensor(9))
        assert cache.stats.errors >= 6 and cache.stats.misses >= 15, cache.stats
        assert len(_outage_warnings(caplog)) == 1, _outage_warnings(caplog)
        server.start()  # NOTE: same port, no persistence: the values are gone
        assert cache.get(keys[1]) is None
        cache.put(keys[1], _make_tensor(1))
        _assert_same(cache.get(keys[1]), _make_tensor(1))
        server.kill()
        assert _timed(cache.get, keys[1]) is None
        assert len(_outage_warnings(caplog)) == 2, "a second outage logs again"
        cache.close()


def test_the_lru_still_serves_while_redis_is_down(tmp_path: Path) -> None:
    key = _make_key("dd")
    with redis_server(tmp_path) as server:
        cache = EmbeddingCache(redis_url=server.url)
        cache.put(key, _make_tensor(4))
        server.kill()
        _assert_same(_timed(cache.get, key), _make_tensor(4))  # type: ignore[arg-type]


def test_frozen_redis_times_out(tmp_path: Path) -> None:
    key = _make_key("ee")
    with redis_server(tmp_path) as server:
        cache = EmbeddingCache(max_bytes=0, redis_url=server.url, timeout_s=0.2)
        cache.put(key, _make_tensor(5))
        server.freeze()
        try:
            assert _timed(cache.get, key) is None
            _timed(cache.put, key, _make_tensor(5))
            assert cache.stats.timeouts >= 1, cache.stats
        finally:
            server.thaw()
        cache.close()


def test_a_cache_opened_while_redis_is_down_works_once_it_is_up(tmp_path: Path) -> None:
    from tests.sessions.redis_server import RedisServer

    server = RedisServer(tmp_path)
    cache = EmbeddingCache(max_bytes=0, redis_url=server.url)
    key = _make_key("ff")
    _timed(cache.put, key, _make_tensor(6))
    server.start()
    try:
        cache.put(key, _make_tensor(6))
        _assert_same(cache.get(key), _make_tensor(6))
    finally:
        server.kill()
        cache.close()


def test_a_restarted_redis_costs_no_error(tmp_path: Path) -> None:
    key = _make_key("0f")
    with redis_server(tmp_path) as server:
        cache = EmbeddingCache(max_bytes=0, redis_url=server.url)
        cache.put(key, _make_tensor(1))
        server.kill()
        server.start()  # NOTE: no call in between: the pooled connection is stale
        cache.put(key, _make_tensor(2))
        _assert_same(cache.get(key), _make_tensor(2))
        assert cache.stats.errors == 0, f"the reconnect failed a call: {cache.stats}"
        cache.close()
