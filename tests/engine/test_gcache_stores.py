"""GCache page stores against the real thing: files in a temp dir, a real redis-server, a real
3-node Redis Cluster. Set-if-absent, TTLs, LRU bounds, two writer processes, and a Redis that
dies, freezes and comes back (misses and zero writes, quickly, one warning per outage)."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis
import torch

from engine.kv.gcache.file_store import FileStore
from engine.kv.gcache.format import decode_page, encode_page, page_key
from engine.kv.gcache.redis_store import RedisStore
from engine.kv.gcache.store import DEFAULT_TTL_S, PageStore, open_store
from engine.kv.gcache.writer import BackgroundWriter
from tests.engine.redis_cluster import (  # noqa: F401 (a fixture, used by name)
    RedisClusterInfo,
    redis_cluster,
    running_cluster,
)
from tests.sessions.redis_server import RedisServer, redis_server

SHAPE = (2, 4, 2, 8)
DTYPE = torch.float32
BACKENDS = ("file", "redis", "redis-cluster")
CALL_LIMIT_S = 1.0
ROOT = Path(__file__).resolve().parents[2]


def _make_value(fill: float) -> bytes:
    return encode_page(torch.full(SHAPE, fill, dtype=DTYPE))


def _fill_of(data: bytes | None) -> float | None:
    page = None if data is None else decode_page(data, SHAPE, DTYPE)
    if page is None:
        return None
    assert bool((page == page.flatten()[0]).all()), "a page mixes two writers' values"
    return float(page.flatten()[0])


def _make_keys(n: int, kind: str = "full") -> list[bytes]:
    fingerprint = uuid.uuid4().hex[:16]  # NOTE: fresh per test: the Redis servers are shared
    return [page_key(fingerprint, kind, h) for h in range(-(n // 2), n - n // 2)]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def spec(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if backend == "file":
        return f"file:{tmp_path / 'gcache'}?max_bytes={2**30}"
    if backend == "redis":
        return request.getfixturevalue("redis_url") + "?ttl_s=600"
    return request.getfixturevalue("redis_cluster").spec + "?ttl_s=600"


@pytest.fixture
def store(spec: str) -> Iterator[PageStore]:
    opened = open_store(spec)
    yield opened
    opened.close()


def _raw_set(store: PageStore, key: bytes, value: bytes) -> None:
    """Overwrite a stored value behind the store's back (a damaged disk or a bad writer)."""
    if isinstance(store, FileStore):
        store._path(_file_name(key)).write_bytes(value)
    else:
        assert isinstance(store, RedisStore)
        store._client_now().set(key, value)


def _file_name(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()


def test_round_trip_of_many_keys(store: PageStore) -> None:
    keys = _make_keys(300)
    items = [(k, _make_value(i)) for i, k in enumerate(keys)]
    assert store.put_many(items) == len(items)
    absent = _make_keys(3)
    asked = [absent[0], *keys, absent[1]]
    got = store.get_many(asked)
    assert got[0] is None and got[-1] is None
    assert [_fill_of(v) for v in got[1:-1]] == [float(i) for i in range(len(keys))]
    assert store.stats.hits == len(keys) and store.stats.misses == 2, store.stats
    assert store.get_many([]) == [] and store.put_many([]) == 0 and store.exists_many([]) == []


def test_put_is_set_if_absent(store: PageStore) -> None:
    keys = _make_keys(4)
    assert store.put_many([(k, _make_value(1.0)) for k in keys[:2]]) == 2
    assert store.put_many([(k, _make_value(2.0)) for k in keys]) == 2
    assert [_fill_of(v) for v in store.get_many(keys)] == [1.0, 1.0, 2.0, 2.0]
    assert store.stats.skipped_existing == 2, store.stats


def test_exists_many(store: PageStore) -> None:
    keys = _make_keys(6)
    store.put_many([(k, _make_value(0.5)) for k in keys[::2]])
    assert store.exists_many(keys) == [True, False] * 3


def test_a_corrupted_value_decodes_to_a_miss(store: PageStore) -> None:
    key, other = _make_keys(2)
    value = _make_value(3.0)
    store.put_many([(key, value), (other, value)])
    damaged = bytearray(value)
    damaged[len(damaged) // 2] ^= 0x40
    _raw_set(store, key, bytes(damaged))
    _raw_set(store, other, value[:-5])
    for data in store.get_many([key, other]):
        assert data is not None, "the store should return the damaged bytes as they are"
        assert decode_page(data, SHAPE, DTYPE) is None


@pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
def test_redis_keys_have_a_ttl(store: PageStore) -> None:
    assert isinstance(store, RedisStore)
    keys = _make_keys(20)
    store.put_many([(k, _make_value(0.0)) for k in keys])
    client = store._client_now()
    ttls = [client.ttl(k) for k in keys]
    assert all(0 < ttl <= 600 for ttl in ttls), ttls


def test_the_default_ttl_is_a_week(redis_url: str) -> None:
    store = open_store(redis_url)
    assert isinstance(store, RedisStore) and store.ttl_s == DEFAULT_TTL_S == 7 * 24 * 3600
    key = _make_keys(1)[0]
    store.put_many([(key, _make_value(0.0))])
    assert 6 * 24 * 3600 < store._client_now().ttl(key) <= 7 * 24 * 3600
    store.close()


def test_cluster_spreads_keys_over_nodes(request: pytest.FixtureRequest) -> None:
    cluster: RedisClusterInfo = request.getfixturevalue("redis_cluster")
    store = open_store(cluster.spec)
    keys = _make_keys(64)
    assert store.put_many([(k, b"v") for k in keys]) == 64
    held = []
    for port in cluster.ports:
        node = redis.Redis(port=port)
        # NOTE: a node answers GETKEYSINSLOT from its own keys only (none for others' slots);
        # the cluster is shared with other tests, so only this test's keys are counted
        slots = {node.cluster("keyslot", k) for k in keys}
        mine = set(keys)
        held.append(sum(len(mine.intersection(node.execute_command(
            "CLUSTER", "GETKEYSINSLOT", slot, 1000))) for slot in slots))
        node.close()
    assert sum(held) == 64 and sum(n > 0 for n in held) >= 2, f"keys per node: {held}"
    store.close()


def test_file_store_evicts_least_recently_used(tmp_path: Path) -> None:
    value_len = len(_make_value(0.0))
    store = FileStore(tmp_path, max_bytes=4 * value_len)
    keys = _make_keys(6)
    assert store.put_many([(k, _make_value(i)) for i, k in enumerate(keys[:4])]) == 4
    assert store.get_many([keys[0]])[0] is not None  # NOTE: now the most recently used
    assert store.put_many([(keys[4], _make_value(4.0))]) == 1
    assert store.exists_many(keys[:5]) == [True, False, True, True, True]
    assert store.total_bytes <= store.max_bytes and store.stats.evictions == 1, store.stats
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == 4 and sum(p.stat().st_size for p in files) == store.total_bytes


def test_file_store_refuses_a_value_above_the_bound(tmp_path: Path) -> None:
    store = FileStore(tmp_path, max_bytes=100)
    key = _make_keys(1)[0]
    assert store.put_many([(key, b"x" * 101)]) == 0
    assert store.exists_many([key]) == [False] and store.stats.skipped_too_large == 1


def test_file_store_reopens_with_its_lru_order(tmp_path: Path) -> None:
    value_len = len(_make_value(0.0))
    keys = _make_keys(4)
    first = FileStore(tmp_path, max_bytes=3 * value_len)
    for i, key in enumerate(keys[:3]):
        first.put_many([(key, _make_value(i))])
        os.utime(first._path(_file_name(key)), (1000 + i, 1000 + i))
    os.utime(first._path(_file_name(keys[0])), (2000, 2000))  # NOTE: as if read last
    second = FileStore(tmp_path, max_bytes=3 * value_len)
    assert len(second) == 3 and second.total_bytes == 3 * value_len
    second.put_many([(keys[3], _make_value(3.0))])
    assert second.exists_many(keys) == [True, False, True, True]


_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from engine.kv.gcache.store import open_store
    spec, keys_file, value_file, go = sys.argv[1:]
    keys = Path(keys_file).read_bytes().split(b"\\n")
    value = Path(value_file).read_bytes()
    store = open_store(spec)
    deadline = time.monotonic() + 20
    while not Path(go).exists() and time.monotonic() < deadline:
        time.sleep(0.001)
    written = sum(store.put_many([(k, value)]) for k in keys)
    print(written, store.stats.errors)
""")


def test_two_processes_writing_the_same_keys_leave_one_valid_value(
    spec: str, store: PageStore, tmp_path: Path
) -> None:
    keys = _make_keys(200)
    (tmp_path / "keys").write_bytes(b"\n".join(keys))
    go = tmp_path / "go"
    procs = []
    for fill in (1.0, 2.0):
        (tmp_path / f"value-{fill}").write_bytes(_make_value(fill))
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _WRITER, spec, str(tmp_path / "keys"),
             str(tmp_path / f"value-{fill}"), str(go)],
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
        ))
    time.sleep(0.5)
    go.touch()
    counts = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs), counts
    assert [int(errors) for _, errors in counts] == [0, 0], counts
    assert sum(int(written) for written, _ in counts) == len(keys), counts
    fills = [_fill_of(v) for v in store.get_many(keys)]
    assert set(fills) <= {1.0, 2.0}, "a key lost its value or holds a broken one"
    if isinstance(store, FileStore):
        assert not [p for p in store.root.rglob(".tmp-*")], "temp files left behind"


def _timed(call: object, *args: object) -> object:
    start = time.monotonic()
    result = call(*args)  # type: ignore[operator]
    elapsed = time.monotonic() - start
    assert elapsed < CALL_LIMIT_S, f"{call} took {elapsed:.2f} s during an outage"
    return result


def _outage_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "engine.kv.gcache" and r.levelno == logging.WARNING]


def _assert_down(store: PageStore, keys: Sequence[bytes]) -> None:
    assert _timed(store.get_many, keys) == [None] * len(keys)
    assert _timed(store.put_many, [(k, b"v") for k in keys]) == 0
    assert _timed(store.exists_many, keys) == [False] * len(keys)


def test_redis_killed_then_restarted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="engine.kv.gcache")
    keys = _make_keys(10)
    with redis_server(tmp_path) as server:
        store = open_store(server.url)
        assert store.put_many([(k, _make_value(1.0)) for k in keys]) == 10
        server.kill()
        for _ in range(3):
            _assert_down(store, keys)
        assert len(_outage_warnings(caplog)) == 1, _outage_warnings(caplog)
        assert store.stats.errors >= 9, store.stats
        server.start()  # NOTE: same port, no persistence: the pages are gone
        assert store.put_many([(k, _make_value(2.0)) for k in keys]) == 10
        assert [_fill_of(v) for v in store.get_many(keys)] == [2.0] * 10
        server.kill()
        _assert_down(store, keys)
        assert len(_outage_warnings(caplog)) == 2, "a second outage logs again"
        store.close()


def test_frozen_redis_times_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys = _make_keys(5)
    with redis_server(tmp_path) as server:
        store = open_store(server.url + "?timeout_s=0.2")
        assert store.put_many([(k, b"v") for k in keys]) == 5
        server.freeze()
        try:
            _assert_down(store, keys)
            assert store.stats.timeouts >= 1 and store.stats.errors >= 3, store.stats
            assert len(_outage_warnings(caplog)) == 1, _outage_warnings(caplog)
        finally:
            server.thaw()
        deadline = time.monotonic() + 5
        while store.get_many(keys[:1]) != [b"v"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.get_many(keys) == [b"v"] * 5
        store.close()


def test_a_store_opened_while_redis_is_down_works_once_it_is_up(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    store = open_store(server.url)
    key = _make_keys(1)[0]
    assert _timed(store.put_many, [(key, b"v")]) == 0
    server.start()
    try:
        assert store.put_many([(key, b"v")]) == 1 and store.get_many([key]) == [b"v"]
    finally:
        server.kill()
        store.close()


def test_a_cluster_node_killed_reads_as_misses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = _make_keys(30)
    with running_cluster(tmp_path) as cluster:
        store = open_store(cluster.spec)
        assert store.put_many([(k, b"v") for k in keys]) == 30
        cluster.kill_node(0)
        for _ in range(3):
            _assert_down(store, keys)
        assert len(_outage_warnings(caplog)) == 1, _outage_warnings(caplog)
        assert store.stats.errors >= 9, store.stats
        store.close()


def test_a_cluster_down_at_open_reads_as_misses() -> None:
    store = open_store("redis+cluster://127.0.0.1:1,127.0.0.1:2")
    key = _make_keys(1)[0]
    assert _timed(store.get_many, [key]) == [None]
    assert _timed(store.put_many, [(key, b"v")]) == 0
    assert store.stats.errors == 2


class _BlockedStore:
    """A FileStore whose ``put_many`` waits for ``release`` (to hold the writer thread)."""

    def __init__(self, inner: FileStore) -> None:
        self.inner, self.stats = inner, inner.stats
        self.release, self.entered = threading.Event(), threading.Event()

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        self.entered.set()
        assert self.release.wait(10)
        return self.inner.put_many(items)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self.inner.get_many(keys)

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self.inner.exists_many(keys)

    def close(self) -> None:
        self.inner.close()


def test_writer_drops_when_full_without_blocking(tmp_path: Path) -> None:
    store = _BlockedStore(FileStore(tmp_path, 2**30))
    writer = BackgroundWriter(store, max_queue=2)
    keys = _make_keys(4)
    try:
        assert writer.submit([(keys[0], b"a")])
        assert store.entered.wait(5), "the writer never called put_many"
        assert writer.submit([(keys[1], b"b")]) and writer.submit([(keys[2], b"c")])
        start = time.monotonic()
        accepted = writer.submit([(keys[3], b"d")])
        elapsed = time.monotonic() - start
        assert not accepted and writer.dropped == 1 and elapsed < 0.05, (accepted, elapsed)
        assert not writer.flush(0.1), "flush returned while the store was blocked"
    finally:
        store.release.set()
    assert writer.flush(5)
    assert store.exists_many(keys) == [True, True, True, False]
    writer.close()


def test_writer_flush_writes_every_submission(tmp_path: Path) -> None:
    store = FileStore(tmp_path, 2**30)
    writer = BackgroundWriter(store, max_queue=1000, batch_items=7)
    keys = _make_keys(100)
    threads: list[str] = []

    def encode(chunk: list[bytes]) -> list[tuple[bytes, bytes]]:
        threads.append(threading.current_thread().name)
        return [(k, _make_value(float(i))) for i, k in enumerate(chunk)]

    for start in range(0, 100, 10):
        chunk = keys[start : start + 10]
        assert writer.submit(lambda chunk=chunk: encode(chunk))
    assert writer.submit(lambda: 1 / 0)  # NOTE: a failing encoder is counted, not fatal
    assert writer.flush(10)
    assert writer.written == 100 and writer.failed == 1 and writer.dropped == 0
    assert all(store.exists_many(keys)) and set(threads) == {"gcache-writer"}
    writer.close()
    assert not writer.submit([(keys[0], b"x")]) and writer.dropped == 1


@pytest.mark.parametrize(("spec", "message"), [
    ("", "empty"), ("ftp://x", "unknown scheme"), ("file:", "no directory"),
    ("file:/tmp/x?max_bytes=abc", "not a number"), ("file:/tmp/x?max_bytes=-5", "> 0"),
    ("file:/tmp/x?max_bytes=1.5", "integer"), ("file:/tmp/x?size=3", "unknown parameter"),
    ("redis://127.0.0.1", "host:port"), ("redis://127.0.0.1:99999/0", "host:port"),
    ("redis://127.0.0.1:6379/x", "database"), ("redis://a:1,b:2/0", r"redis\+cluster"),
    ("redis://127.0.0.1:6379/0?ttl_s=0", "> 0"), ("redis://127.0.0.1:6379?timeout=1", "unknown"),
    ("redis+cluster://127.0.0.1:1,nope", "host:port"),
])
def test_a_bad_spec_is_a_clear_error(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        open_store(spec)


def test_spec_forms(tmp_path: Path) -> None:
    for spec in (str(tmp_path / "a"), f"file:{tmp_path / 'b'}", f"file://{tmp_path / 'c'}"):
        assert isinstance(open_store(spec), FileStore), spec
    assert open_store(f"file:{tmp_path}?max_bytes=1000").max_bytes == 1000  # type: ignore[attr-defined]
    redis_store = open_store("redis://127.0.0.1:1/3?ttl_s=60&timeout_s=0.5")
    assert isinstance(redis_store, RedisStore) and redis_store.ttl_s == 60
    assert isinstance(open_store("redis+cluster://127.0.0.1:1,127.0.0.1:2"), RedisStore)


def test_redis_credentials_come_from_the_url_and_never_show(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import redis as redis_py

    secret = "gcache-s3cret-pw"
    with redis_server(tmp_path) as server:
        redis_py.Redis(port=server.port).config_set("requirepass", secret)
        keys = _make_keys(3)
        items = [(k, _make_value(1.0)) for k in keys]
        authed = open_store(f"redis://:{secret}@127.0.0.1:{server.port}/0")
        assert authed.put_many(items) == 3
        assert [_fill_of(v) for v in authed.get_many(keys)] == [1.0] * 3
        anonymous = open_store(f"redis://127.0.0.1:{server.port}/0")
        assert anonymous.get_many(keys) == [None] * 3  # NOTE: refused: a miss, not an error
        for store in (authed, anonymous):
            store.close()
    with pytest.raises(ValueError) as bad:
        open_store(f"redis://user:{secret}@127.0.0.1:{server.port}/x")
    assert secret not in str(bad.value) and "***" in str(bad.value), str(bad.value)
    assert secret not in caplog.text
