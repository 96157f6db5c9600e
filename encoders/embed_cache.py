"""``EmbeddingCache``: embeddings by content key, in a process LRU bounded by bytes, then Redis.

A lookup tries the process LRU first, then Redis (one MGET for all the keys the LRU missed); a
Redis hit fills the LRU. ``put`` writes both (``SET key value EX ttl_s``), so the same image
costs one encode across every process sharing the Redis, and every turn.

Keys (``redis_key``) never contain the tenant's salt, only a digest of it::

    ag:emb:v1:<tower_fingerprint>:<preprocess_id>:<sha256(salt), 32 hex>:<content_hash>

Values are a fixed little-endian header, the tensor's raw bytes, and a CRC-32 of both::

    magic "AGEM" | version u8 | dtype code u8 | ndim u8 | shape u32[ndim] | payload_len u64
    | payload (C-contiguous, little-endian) | crc32 u32 (header + payload)

so a truncated, padded or corrupted value is a miss (counted in ``stats.corrupt``), never an
exception and never wrong data. Redis failures (refused, timed out, restarted) never raise out
of a call either: after ``timeout_s`` at most they read as misses or as nothing written, are
counted in ``stats.errors`` and logged once per outage; nothing is retried but the one
reconnect that replaces a connection a restarted server closed.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import redis
import torch
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

from encoders.protocol import DTYPE_NAMES, Embedding, EmbeddingKey
from engine.kv.gcache.redis_store import is_timeout
from engine.kv.gcache.store import OutageLog, redacted

__all__ = ["CacheStats", "EmbeddingCache", "EmbeddingKey", "decode_value", "encode_value",
           "from_embedding", "redis_key", "to_embedding"]

logger = logging.getLogger(__name__)

KEY_PREFIX = "ag:emb:v1:"
MAGIC = b"AGEM"
FORMAT_VERSION = 1
MAX_NDIM = 8
DEFAULT_MAX_BYTES = 256 * 2**20
DEFAULT_TTL_S = 86400.0
DEFAULT_TIMEOUT_S = 0.2

_FIXED = struct.Struct("<4sBBB")  # magic, version, dtype code, ndim
_LEN = struct.Struct("<Q")
_CRC = struct.Struct("<I")
# NOTE: codes are part of the format: never renumber, only append
_DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_NAME_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass(slots=True)
class CacheStats:
    """Counters of one cache (monotonic; read them, never reset them). Updated under the
    cache's lock, except ``errors``/``timeouts`` (a lost increment is harmless)."""

    hits_local: int = 0
    hits_redis: int = 0
    misses: int = 0  # keys found nowhere (corrupt values included)
    errors: int = 0  # failed Redis calls (timeouts included)
    timeouts: int = 0
    corrupt: int = 0  # Redis values that did not decode
    puts: int = 0  # tensors offered to put / put_many
    evictions: int = 0  # LRU entries dropped for space

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class EmbeddingCache:
    """Embeddings by ``EmbeddingKey``. Thread-safe; no method raises on a Redis failure.

    Args:
        max_bytes: bound of the process LRU (tensor bytes); 0 keeps nothing locally. A tensor
            larger than this goes to Redis only.
        redis_url: ``redis://[[user]:password@]host:port/db`` (``rediss://`` for TLS) shared by
            the processes that should share embeddings; None: local only.
        ttl_s: lifetime of each Redis value.
        timeout_s: the longest one Redis call (connect or command) may take.

    NOTE: ``get`` returns the tensor the LRU holds (CPU, contiguous), not a copy: treat it as
    read-only.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, redis_url: str | None = None,
                 ttl_s: float = DEFAULT_TTL_S, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        assert max_bytes >= 0, f"max_bytes={max_bytes}: must be >= 0"
        assert ttl_s >= 1, f"ttl_s={ttl_s}: must be >= 1"
        assert timeout_s > 0, f"timeout_s={timeout_s}: must be > 0"
        self.max_bytes, self.ttl_s, self.timeout_s = max_bytes, int(ttl_s), timeout_s
        self.stats = CacheStats()
        self._lru: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._lru_bytes = 0
        self._lock = threading.Lock()
        self._redis_url = redis_url
        self._client: redis.Redis | None = None
        self._outage = OutageLog(redacted(redis_url) if redis_url else "", "embedding cache: redis",
                                 "serving from the process LRU", logger)

    @property
    def local_bytes(self) -> int:
        """Bytes the process LRU holds now."""
        return self._lru_bytes

    def get(self, key: EmbeddingKey) -> torch.Tensor | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[EmbeddingKey]) -> list[torch.Tensor | None]:
        """The embedding of each key, None for a miss: LRU first, then one Redis MGET."""
        names = [redis_key(k) for k in keys]
        out = self._get_local(names)
        todo = [i for i, t in enumerate(out) if t is None]
        values = self._redis_mget([names[i] for i in todo]) if todo else []
        found: list[tuple[bytes, torch.Tensor]] = []
        num_corrupt = 0
        for i, value in zip(todo, values):
            tensor = None if value is None else decode_value(value)
            num_corrupt += value is not None and tensor is None
            if tensor is not None:
                out[i] = tensor
                found.append((names[i], tensor))
        with self._lock:
            for name, tensor in found:
                self._insert(name, tensor)
            self.stats.hits_redis += len(found)
            self.stats.corrupt += num_corrupt
            self.stats.misses += len(todo) - len(found)
        return out

    def put(self, key: EmbeddingKey, tensor: torch.Tensor) -> None:
        self.put_many([(key, tensor)])

    def put_many(self, items: Sequence[tuple[EmbeddingKey, torch.Tensor]]) -> None:
        """Store each (key, embedding) in the LRU and in Redis (one pipeline of SETs).

        Raises:
            ValueError: a dtype other than float32/float16/bfloat16, or more than 8 dims.
        """
        named = [(redis_key(k), _host(t)) for k, t in items]
        values = [(name, encode_value(t)) for name, t in named] if self._redis_url else []
        with self._lock:
            self.stats.puts += len(named)
            for name, tensor in named:
                self._insert(name, tensor)
        if values:
            self._redis_call("put", lambda pipe: [
                pipe.set(name, value, ex=self.ttl_s) for name, value in values])

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # ------------------------------------------------------------------ local LRU

    def _get_local(self, names: list[bytes]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        with self._lock:
            for name in names:
                tensor = self._lru.get(name)
                if tensor is not None:
                    self._lru.move_to_end(name)
                out.append(tensor)
            self.stats.hits_local += sum(t is not None for t in out)
        return out

    def _insert(self, name: bytes, tensor: torch.Tensor) -> None:
        """NOTE: only while locked."""
        size = tensor.nbytes
        old = self._lru.pop(name, None)
        if old is not None:
            self._lru_bytes -= old.nbytes
        if size > self.max_bytes:
            return
        while self._lru_bytes + size > self.max_bytes:
            _, evicted = self._lru.popitem(last=False)
            self._lru_bytes -= evicted.nbytes
            self.stats.evictions += 1
        self._lru[name] = tensor
        self._lru_bytes += size

    # ------------------------------------------------------------------ Redis

    def _redis_mget(self, names: list[bytes]) -> list[bytes | None]:
        if self._redis_url is None:
            return [None] * len(names)
        replies = self._redis_call("get", lambda pipe: pipe.mget(names))
        return [None] * len(names) if replies is None else list(replies[0])

    def _redis_call(self, what: str, queue: Callable[[Any], object]) -> list[Any] | None:
        """Run the commands ``queue`` adds to a pipeline; their replies, or None on any error."""
        try:
            with self._client_now().pipeline(transaction=False) as pipe:
                queue(pipe)
                replies = pipe.execute()
        # NOTE: anything at all: a cache failure must never fail an encode or a lookup
        except Exception as exc:  # noqa: BLE001
            self.stats.errors += 1
            self.stats.timeouts += is_timeout(exc)
            self._outage.failed(what, exc)
            return None
        self._outage.succeeded()
        return replies

    def _client_now(self) -> redis.Redis:
        with self._lock:
            if self._client is None:
                assert self._redis_url is not None
                # NOTE: one immediate retry on a connection error only: it replaces a pooled
                # connection a restarted server closed; a timeout is never retried (it already
                # cost timeout_s). redis-py's default (3 retries with backoff) would stall.
                self._client = redis.Redis.from_url(
                    self._redis_url, socket_timeout=self.timeout_s,
                    socket_connect_timeout=self.timeout_s,
                    retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
            return self._client


def redis_key(key: EmbeddingKey) -> bytes:
    """The storage key of ``key`` (the salt only as a digest: it never appears in a key)."""
    salt = hashlib.sha256(b"agentgate-emb-salt-v1|" + key.cache_salt.encode()).hexdigest()[:32]
    return (f"{KEY_PREFIX}{key.tower_fingerprint}:{key.preprocess_id}:{salt}:"
            f"{key.content_hash}").encode()


def encode_value(tensor: torch.Tensor) -> bytes:
    """The value bytes of one embedding (any device; copied to host here).

    Raises:
        ValueError: a dtype without a code, or more than ``MAX_NDIM`` dims.
    """
    code = _DTYPE_CODES.get(tensor.dtype)
    if code is None:
        raise ValueError(f"dtype {tensor.dtype}: no embedding dtype code (known: "
                         f"{sorted(map(str, _DTYPE_CODES))})")
    if tensor.dim() > MAX_NDIM:
        raise ValueError(f"{tensor.dim()} dims: at most {MAX_NDIM}")
    payload = _raw_bytes(tensor)
    header = (_FIXED.pack(MAGIC, FORMAT_VERSION, code, tensor.dim())
              + struct.pack(f"<{tensor.dim()}I", *tensor.shape) + _LEN.pack(len(payload)))
    return b"".join((header, payload, _CRC.pack(zlib.crc32(payload, zlib.crc32(header)))))


def decode_value(data: bytes) -> torch.Tensor | None:
    """The embedding in ``data`` (a fresh CPU tensor), or None when ``data`` is not exactly one
    valid value: bad magic, version or dtype, truncated or padded, checksum mismatch. Never
    raises on bad data."""
    try:
        return _decode(memoryview(data))
    except (struct.error, ValueError, TypeError, RuntimeError, OverflowError):
        return None


def to_embedding(index: int, tensor: torch.Tensor, with_data: bool = True) -> Embedding:
    """The wire form of one item's embedding (``with_data=False``: dtype and shape only).

    Raises:
        ValueError: a dtype other than float32/float16/bfloat16.
    """
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _NAME_DTYPES:
        raise ValueError(f"dtype {tensor.dtype}: not one of {DTYPE_NAMES}")
    return Embedding(index=index, dtype=name, shape=list(tensor.shape),
                     data=_raw_bytes(tensor) if with_data else b"")


def from_embedding(emb: Embedding) -> torch.Tensor:
    """The tensor of a wire ``Embedding`` (a fresh CPU tensor).

    Raises:
        ValueError: an unknown dtype, or ``data`` not exactly shape x itemsize bytes (e.g. one
            sent with ``with_data=False``).
    """
    dtype = _NAME_DTYPES.get(emb.dtype)
    if dtype is None:
        raise ValueError(f"embedding dtype {emb.dtype!r}: not one of {DTYPE_NAMES}")
    shape = tuple(emb.shape)
    if any(d < 0 for d in shape) or len(emb.data) != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"embedding of shape {shape} {emb.dtype}: {len(emb.data)} bytes")
    return _from_bytes(emb.data, dtype, shape)


# ---------------------------------------------------------------------- helpers


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU, contiguous, detached tensor (the input itself when it already is one)."""
    if tensor.dtype not in _DTYPE_CODES:
        raise ValueError(f"dtype {tensor.dtype}: not one of {DTYPE_NAMES}")
    return tensor.detach().to("cpu").contiguous()


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    # NOTE: through a uint8 view: bf16 has no numpy dtype, uint8 always has
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def _from_bytes(payload: bytes | memoryview, dtype: torch.dtype,
                shape: tuple[int, ...]) -> torch.Tensor:
    if len(payload) == 0:
        return torch.empty(shape, dtype=dtype)
    writable = bytearray(payload)  # NOTE: a copy: frombuffer shares memory, bytes are read-only
    return torch.frombuffer(writable, dtype=torch.uint8).view(dtype).view(shape)


def _decode(data: memoryview) -> torch.Tensor | None:
    if len(data) < _FIXED.size:
        return None
    magic, version, code, ndim = _FIXED.unpack_from(data, 0)
    dtype = _CODE_DTYPES.get(code)
    if magic != MAGIC or version != FORMAT_VERSION or dtype is None or ndim > MAX_NDIM:
        return None
    shape = struct.unpack_from(f"<{ndim}I", data, _FIXED.size)
    (payload_len,) = _LEN.unpack_from(data, _FIXED.size + 4 * ndim)
    header_len = _FIXED.size + 4 * ndim + _LEN.size
    if payload_len != math.prod(shape) * dtype.itemsize:
        return None
    if len(data) != header_len + payload_len + _CRC.size:
        return None
    (crc,) = _CRC.unpack_from(data, header_len + payload_len)
    if zlib.crc32(data[: header_len + payload_len]) != crc:
        return None
    return _from_bytes(data[header_len : header_len + payload_len], dtype, shape)
