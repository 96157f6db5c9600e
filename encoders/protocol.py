"""Client <-> encoder service messages: two tagged unions of msgspec Structs, msgpack on the wire.

A client (the gateway, or an engine worker) sends ``ServiceRequest``; the service answers each
request with exactly one ``ServiceReply`` carrying the same ``request_id``:

- ``Encode(items)`` -> ``Embeddings``: ``results[i]`` is item i's ``Embedding`` (from the
  cache, or encoded now and put into the cache), or None when item i failed; each failed item
  has one ``EncodeError(index=i, code="encode_failed")`` in ``Embeddings.errors``. Items of
  concurrent requests are batched together; items whose key is cached are never encoded.
  With ``with_data=False`` each ``Embedding`` carries its dtype and shape but empty ``data``
  (the gateway needs the token count of an image, not its embedding).
- ``Lookup(keys)`` -> ``Embeddings``: from the cache only (process LRU, then Redis), never
  encoded; ``results[i]`` is None for a key that is not cached. ``errors`` stays empty. This is
  how a worker fetches the embeddings the gateway had encoded, by key.
- ``Describe`` -> ``Description``: the tower's fingerprint, preprocessing and tokens per image
  (what a gateway needs to key media and size their spans before any encode returns).
- A request that fails as a whole -> one top-level ``EncodeError(index=None)``:
  ``bad_message`` (did not decode; then ``request_id`` is "" when it could not be found),
  ``invalid_request`` (decoded, but e.g. more items than the service queues),
  ``overloaded`` (a queue is full: retry elsewhere or later), ``internal``.

Each direction has one decoder; anything that does not decode raises ``ProtocolError``. Keys
(``EmbeddingKey``) name content, never its bytes: tenant salt, content hash, preprocessing and
tower; ``encoders.embed_cache.redis_key`` turns one into a storage key. An ``Embedding`` is a
tensor as (dtype name, shape, C-contiguous little-endian bytes), ``encoders.embed_cache.
to_embedding`` / ``from_embedding`` convert. This module must not import torch: the gateway
imports it.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

ItemKind = Literal["image", "frame", "video"]
EncodeErrorCode = Literal[
    "bad_message",  # the bytes did not decode as a ServiceRequest
    "invalid_request",  # decoded, but not acceptable (too many items, ...)
    "overloaded",  # a queue of the service is full; retry elsewhere or later
    "encode_failed",  # one item: the decoder or the tower raised on it (index is set)
    "internal",  # a bug in the service; the request is gone
]
DTYPE_NAMES = ("float32", "float16", "bfloat16")

_HEX = re.compile(r"[0-9a-f]+")
_MAX_HASH_CHARS = 128


class ProtocolError(ValueError):
    """Bytes that are not a valid message of this protocol."""


class EmbeddingKey(msgspec.Struct, frozen=True, kw_only=True):
    """What an embedding is of: equal keys mean interchangeable embeddings (hashable).

    Attributes:
        cache_salt: the tenant namespace: the request's ``cache_salt`` or "". Two salts never
            share an embedding, even of the same content.
        content_hash: lower-case hex digest of the media bytes (at most 128 digits).
        preprocess_id: names the decode + preprocessing (resize, crop, normalization, frame
            sampling); non-empty, no ':'.
        tower_fingerprint: names the vision tower's weights and config; non-empty, no ':'.

    Raises:
        ValueError: a field out of its form (``msgspec.ValidationError`` when decoding).
    """

    cache_salt: str = ""
    content_hash: str
    preprocess_id: str
    tower_fingerprint: str

    def __post_init__(self) -> None:
        if len(self.content_hash) > _MAX_HASH_CHARS or not _HEX.fullmatch(self.content_hash):
            raise ValueError(f"content_hash={self.content_hash[:140]!r}: want 1 to "
                             f"{_MAX_HASH_CHARS} lower-case hex digits")
        for name in ("preprocess_id", "tower_fingerprint"):
            value = getattr(self, name)
            if not value or ":" in value:
                raise ValueError(f"{name}={value!r}: must be non-empty, without ':'")


class EncodeItem(msgspec.Struct, frozen=True, kw_only=True):
    """One medium to encode: its key and its raw (still compressed) bytes."""

    key: EmbeddingKey
    kind: ItemKind = "image"
    data: bytes


class Embedding(msgspec.Struct, frozen=True, kw_only=True):
    """One item's embedding: a tensor of ``dtype`` (a ``DTYPE_NAMES`` entry) and ``shape``, its
    bytes C-contiguous and little-endian (empty when the request asked ``with_data=False``).
    ``index`` is the item's position in its request."""

    index: int
    dtype: str
    shape: list[int]
    data: bytes = b""


# --- client -> service -----------------------------------------------------------------------


class Encode(msgspec.Struct, tag="encode", frozen=True, kw_only=True):
    """Embeddings of ``items``, encoding those not cached; answered by ``Embeddings``."""

    request_id: str
    items: list[EncodeItem]
    with_data: bool = True


class Lookup(msgspec.Struct, tag="lookup", frozen=True, kw_only=True):
    """The cached embeddings of ``keys`` (never encoded); answered by ``Embeddings``."""

    request_id: str
    keys: list[EmbeddingKey]


class Describe(msgspec.Struct, tag="describe", frozen=True, kw_only=True):
    """What the service encodes with; answered by ``Description`` (from the io thread, so it
    answers even while the tower is busy)."""

    request_id: str


ServiceRequest = Encode | Lookup | Describe


# --- service -> client -----------------------------------------------------------------------


class EncodeError(msgspec.Struct, tag="encode_error", frozen=True, kw_only=True):
    """A failure. With ``index`` it is one item's, inside ``Embeddings.errors``; without, it is
    the whole request's answer (a top-level message)."""

    request_id: str
    code: EncodeErrorCode
    reason: str
    index: int | None = None


class Embeddings(msgspec.Struct, tag="embeddings", frozen=True, kw_only=True):
    """The answer to an ``Encode`` or a ``Lookup``: one result per item or key, in order."""

    request_id: str
    results: list[Embedding | None]
    errors: list[EncodeError] = []


class Description(msgspec.Struct, tag="description", frozen=True, kw_only=True):
    """The encoder's identity and geometry, which a gateway needs before it can key or place an
    image: ``tokens_per_image`` placeholder tokens per image or frame, ``num_frames`` sampled
    from a clip, the ``preprocess_id`` and ``tower_fingerprint`` of every ``EmbeddingKey`` it
    makes, and the embedding width (the LLM's hidden size)."""

    request_id: str = ""
    tokens_per_image: int
    num_frames: int
    preprocess_id: str
    tower_fingerprint: str
    hidden_size: int

    def tokens_for(self, kind: ItemKind) -> int:
        """Placeholder tokens of one item of ``kind`` (a clip: ``num_frames`` frames)."""
        return self.tokens_per_image * (self.num_frames if kind == "video" else 1)


ServiceReply = Embeddings | EncodeError | Description

_ENCODER = msgspec.msgpack.Encoder()
_REQUEST_DECODER = msgspec.msgpack.Decoder(ServiceRequest)
_REPLY_DECODER = msgspec.msgpack.Decoder(ServiceReply)


def encode(msg: ServiceRequest | ServiceReply) -> bytes:
    """msgpack bytes of one message (a map with its tag under ``"type"``)."""
    return _ENCODER.encode(msg)


def decode_request(data: bytes) -> ServiceRequest:
    """Decode a client -> service message.

    Raises:
        ProtocolError: ``data`` is not a ``ServiceRequest``; the message names the bad field.
    """
    return _decode(_REQUEST_DECODER, data, "request")


def decode_reply(data: bytes) -> ServiceReply:
    """Decode a service -> client message.

    Raises:
        ProtocolError: ``data`` is not a ``ServiceReply``; the message names the bad field.
    """
    return _decode(_REPLY_DECODER, data, "reply")


def _decode(decoder: msgspec.msgpack.Decoder[Any], data: bytes, direction: str) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid encoder {direction}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(
            f"undecodable encoder {direction} ({len(data)} bytes): {exc}") from None
