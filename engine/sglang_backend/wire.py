"""SGLang's KV event wire format, both layouts, decoded into one normalized form.

SGLang publishes KV events on a ZMQ PUB socket as ``[topic, seq (u64 big-endian), payload]``;
the payload is a msgpack array ``[ts, events, attn_dp_rank]``. The events' layout changed
between releases, so a payload is decoded by its shape, never by a version switch:

- array layout (sglang 0.5.3 era, ``python/sglang/srt/disaggregation/kv_events.py`` @612d579;
  ``array_like=True, omit_defaults=True, tag=True``): each event is a tagged array,
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id]``,
  ``["BlockRemoved", block_hashes]``, ``["AllBlocksCleared"]`` (msgspec writes every field of
  an ``array_like`` struct, ``omit_defaults`` or not). At @006d053 the batch had no
  ``attn_dp_rank`` yet: ``[ts, events]``.
- map layout (sglang 0.5.23, same path; ``omit_defaults=True, tag=True``): each event is a
  tagged map ``{"type": "BlockStored", "block_hashes": ..., ...}``; fields whose default is None
  (``medium``, ``cache_salt``, ``session_id``, ``lora_name``) are left out when None, while
  ``lora_id`` (no default) is always there. The batch stays a 3-element array.

``decode_batch`` turns either into an ``SGLangBatch`` of ``Sg*`` events, one type per kind. An
event it cannot use (an unknown type, a malformed event, bigram token pages) becomes an
``SgSkippedEvent`` saying why, so the translator can count it and go on; only a payload whose
batch structure is broken raises ``SGLangWireError``.

Nothing here imports sglang or torch: the worker decodes SGLang's events in its own process.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "SGLangBatch",
    "SGLangEvent",
    "SGLangWireError",
    "SgAllBlocksCleared",
    "SgBlockRemoved",
    "SgBlockStored",
    "SgSkippedEvent",
    "decode_batch",
]

# NOTE: sglang declares ``token_ids: list[int]``, but a bigram radix cache (EAGLE) publishes
# each token as a pair; the mirrors accept both so such an event is skipped, not "malformed".
_TokenIds = list[int | tuple[int, ...]]


class SGLangWireError(ValueError):
    """A payload that is not an SGLang KV event batch in either layout."""


# ------------------------------------------------------------------ normalized events


class SgBlockStored(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Pages entered SGLang's cache, in chain order (either layout).

    Attributes:
        block_hashes: SGLang's opaque hash of each page; each page's parent is the one before.
        parent_block_hash: SGLang's hash of the page before the first; None at the root.
        token_ids: the pages' tokens, concatenated (``block_size`` per page).
        block_size: tokens per page; SGLang writes ``len(page_tokens)``, so a short last page
            of a radix node shows as a smaller ``block_size`` (in an event of its own).
        lora_id, lora_name: the adapter whose KV this is; None for the base model.
        medium: SGLang's ``StorageMedium`` value (None in the array layout: the GPU).
        cache_salt: the tenant salt the request was stored under; None when unsalted.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    lora_name: str | None = None


class SgBlockRemoved(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Pages left ``medium`` of SGLang's cache (None: the GPU)."""

    block_hashes: list[int]
    medium: str | None = None


class SgAllBlocksCleared(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """SGLang dropped its whole cache (``flush_cache``)."""


class SgSkippedEvent(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """An event that was decoded but cannot be used.

    Attributes:
        type: its tag (None when it had none).
        reason: why it is skipped ("unknown event type", "bigram token pages", "malformed: ...").
    """

    type: str | None
    reason: str


SGLangEvent = SgBlockStored | SgBlockRemoved | SgAllBlocksCleared | SgSkippedEvent


class SGLangBatch(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One published batch: ``ts`` (seconds), its events in order, and the attention-DP rank
    of the publishing scheduler (None when the payload had none)."""

    ts: float
    events: list[SGLangEvent]
    dp_rank: int | None = None


# ------------------------------------------------------------------ wire mirrors


class ArrayBlockStored(
    msgspec.Struct, tag="BlockStored", array_like=True, omit_defaults=True, gc=False
):
    """``BlockStored`` of sglang @612d579 (0.5.3 era), disaggregation/kv_events.py."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: _TokenIds
    block_size: int
    lora_id: int | None


class ArrayBlockRemoved(
    msgspec.Struct, tag="BlockRemoved", array_like=True, omit_defaults=True, gc=False
):
    """``BlockRemoved`` of sglang @612d579 (0.5.3 era), disaggregation/kv_events.py."""

    block_hashes: list[int]


class ArrayAllBlocksCleared(
    msgspec.Struct, tag="AllBlocksCleared", array_like=True, omit_defaults=True, gc=False
):
    """``AllBlocksCleared`` of sglang @612d579 (0.5.3 era), disaggregation/kv_events.py."""


class MapBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    """``BlockStored`` of sglang 0.5.23, disaggregation/kv_events.py."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: _TokenIds
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class MapBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    """``BlockRemoved`` of sglang 0.5.23, disaggregation/kv_events.py."""

    block_hashes: list[int]
    medium: str | None = None


class MapAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    """``AllBlocksCleared`` of sglang 0.5.23, disaggregation/kv_events.py."""


_Mirror = (ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared
           | MapBlockStored | MapBlockRemoved | MapAllBlocksCleared)
_ARRAY_MIRRORS: dict[str, type[Any]] = {
    "BlockStored": ArrayBlockStored,
    "BlockRemoved": ArrayBlockRemoved,
    "AllBlocksCleared": ArrayAllBlocksCleared,
}
_MAP_MIRRORS: dict[str, type[Any]] = {
    "BlockStored": MapBlockStored,
    "BlockRemoved": MapBlockRemoved,
    "AllBlocksCleared": MapAllBlocksCleared,
}


def decode_batch(payload: bytes) -> SGLangBatch:
    """Decode one PUB payload (the third frame) of either layout.

    Raises:
        SGLangWireError: the payload is not msgpack, or not ``[ts, events(, rank)]``.
    """
    try:
        obj = msgspec.msgpack.decode(payload)
    except msgspec.MsgspecError as exc:
        raise SGLangWireError(f"SGLang KV event payload is not msgpack: {exc}") from None
    # NOTE: elements past the third are ignored, as msgspec's own array_like decoding does
    if not isinstance(obj, list) or len(obj) < 2:
        raise SGLangWireError(f"SGLang KV event batch must be [ts, events, rank]: {obj!r:.80}")
    ts, events = obj[0], obj[1]
    rank = obj[2] if len(obj) > 2 else None
    if not _is_number(ts) or not isinstance(events, list):
        raise SGLangWireError(f"SGLang KV event batch has bad ts/events: {obj!r:.80}")
    if rank is not None and not _is_int(rank):
        raise SGLangWireError(f"SGLang KV event batch has a bad attn_dp_rank: {rank!r:.80}")
    return SGLangBatch(ts=float(ts), events=[_decode_event(e) for e in events], dp_rank=rank)


def _decode_event(obj: object) -> SGLangEvent:
    if isinstance(obj, list):
        tag = obj[0] if obj and isinstance(obj[0], str) else None
        mirrors = _ARRAY_MIRRORS
    elif isinstance(obj, dict):
        tag = obj.get("type")
        tag = tag if isinstance(tag, str) else None
        mirrors = _MAP_MIRRORS
    else:
        return SgSkippedEvent(type=None, reason=f"not an event: {obj!r:.80}")
    mirror = mirrors.get(tag) if tag is not None else None
    if mirror is None:
        return SgSkippedEvent(type=tag, reason="unknown event type")
    try:
        return _normalize(msgspec.convert(obj, mirror))
    except msgspec.ValidationError as exc:
        return SgSkippedEvent(type=tag, reason=f"malformed: {exc}")


def _normalize(event: _Mirror) -> SGLangEvent:
    if isinstance(event, ArrayAllBlocksCleared | MapAllBlocksCleared):
        return SgAllBlocksCleared()
    if isinstance(event, ArrayBlockRemoved):
        return SgBlockRemoved(block_hashes=event.block_hashes)
    if isinstance(event, MapBlockRemoved):
        return SgBlockRemoved(block_hashes=event.block_hashes, medium=event.medium)
    if any(isinstance(t, tuple) for t in event.token_ids):
        return SgSkippedEvent(type="BlockStored", reason="bigram token pages")
    token_ids: list[int] = event.token_ids  # type: ignore[assignment]  # NOTE: no pairs left
    if isinstance(event, ArrayBlockStored):
        return SgBlockStored(block_hashes=event.block_hashes,
                             parent_block_hash=event.parent_block_hash, token_ids=token_ids,
                             block_size=event.block_size, lora_id=event.lora_id)
    return SgBlockStored(block_hashes=event.block_hashes,
                         parent_block_hash=event.parent_block_hash, token_ids=token_ids,
                         block_size=event.block_size, lora_id=event.lora_id,
                         medium=event.medium, cache_salt=event.cache_salt,
                         lora_name=event.lora_name)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_int(value) or isinstance(value, float)
