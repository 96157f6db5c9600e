"""SGLang's KV events: decoding both wire layouts (byte-exact golden payloads) and re-hashing
them into our KV events (engine.sglang_backend.wire, engine.sglang_backend.kv_events).

The golden payloads are written by hand, byte by byte, from SGLang's struct definitions:

- map layout: sglang 0.5.23, python/sglang/srt/disaggregation/kv_events.py (``KVCacheEvent``:
  ``omit_defaults=True, tag=True``; ``EventBatch``: ``array_like=True``).
- array layout: sglang @612d579 (0.5.3 era), same path (``KVCacheEvent`` and ``EventBatch``:
  ``array_like=True, omit_defaults=True``, events ``tag=True``), and @006d053 for the batch
  without ``attn_dp_rank``.

msgspec writes a struct's fields in definition order, the tag first; ints in their smallest
msgpack form (positive ones unsigned), floats as float64; an ``array_like`` struct writes every
field, defaults included (``omit_defaults`` only drops map keys). Nothing here encodes them with
msgspec.
"""

from __future__ import annotations

import logging
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.hashing import page_hashes
from engine.sglang_backend.kv_events import EventTranslator
from engine.sglang_backend.wire import (
    SgAllBlocksCleared,
    SgBlockRemoved,
    SgBlockStored,
    SGLangBatch,
    SGLangEvent,
    SGLangWireError,
    SgSkippedEvent,
    decode_batch,
)
from engine.worker.events import (
    MEDIUM_CPU,
    MEDIUM_GCACHE,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from engine.worker.events import decode_batch as decode_ours
from engine.worker.events import encode_batch as encode_ours
from gateway.routing import KVIndex, MatchResult


def _golden(*groups: str) -> bytes:
    """Hand-written hex groups (spaces ignored) -> the payload bytes."""
    return bytes.fromhex("".join(groups))


H1 = 0x0102030405060708  # a positive int64 hash: cf + 8 bytes (msgpack uint64)
H2 = -2  # negative fixint: fe
H3 = -0x0102030405060708  # d3 + two's complement fe fd fc fb fa f9 f8 f8 (msgpack int64)

# ---------------------------------------------------------------- map layout (sglang 0.5.23)

_TYPE = "a4 74797065"  # "type" (fixstr 4)
_BLOCK_STORED = "ab 426c6f636b53746f726564"  # "BlockStored" (fixstr 11)
_BLOCK_REMOVED = "ac 426c6f636b52656d6f766564"  # "BlockRemoved" (fixstr 12)
_ALL_CLEARED = "b0 416c6c426c6f636b73436c6561726564"  # "AllBlocksCleared" (fixstr 16)
_BLOCK_HASHES = "ac 626c6f636b5f686173686573"  # "block_hashes" (fixstr 12)
_PARENT = "b1 706172656e745f626c6f636b5f68617368"  # "parent_block_hash" (fixstr 17)
_TOKEN_IDS = "a9 746f6b656e5f696473"  # "token_ids" (fixstr 9)
_BLOCK_SIZE = "aa 626c6f636b5f73697a65"  # "block_size" (fixstr 10)
_LORA_ID = "a7 6c6f72615f6964"  # "lora_id" (fixstr 7)
_MEDIUM = "a6 6d656469756d"  # "medium" (fixstr 6)
_CACHE_SALT = "aa 63616368655f73616c74"  # "cache_salt" (fixstr 10)
_SESSION_ID = "aa 73657373696f6e5f6964"  # "session_id" (fixstr 10)

NEW_STORED_GPU = _golden(
    "93",  # batch: fixarray 3 [ts, events, attn_dp_rank]
    "cb 3ff8000000000000",  # ts: float64 1.5
    "91",  # events: fixarray 1
    "87",  # BlockStored: fixmap 7 (cache_salt, session_id, lora_name None: omitted)
    _TYPE, _BLOCK_STORED,
    _BLOCK_HASHES, "92 cf0102030405060708 fe",  # [H1, H2]
    _PARENT, "c0",  # nil: a root
    _TOKEN_IDS, "94 0a 0b 0c 0d",  # [10, 11, 12, 13]
    _BLOCK_SIZE, "02",  # 2
    _LORA_ID, "c0",  # nil (no default: always written)
    _MEDIUM, "a3 475055",  # "GPU"
    "00",  # attn_dp_rank: 0
)
NEW_STORED_CPU = _golden(
    "93",  # batch: fixarray 3
    "cb 4000000000000000",  # ts: float64 2.0
    "91",  # events: fixarray 1
    "87",  # BlockStored: fixmap 7
    _TYPE, _BLOCK_STORED,
    _BLOCK_HASHES, "92 cf0102030405060708 fe",  # [H1, H2]
    _PARENT, "c0",  # nil
    _TOKEN_IDS, "94 0a 0b 0c 0d",  # [10, 11, 12, 13]
    _BLOCK_SIZE, "02",  # 2
    _LORA_ID, "c0",  # nil
    _MEDIUM, "aa 4350555f50494e4e4544",  # "CPU_PINNED" (fixstr 10)
    "01",  # attn_dp_rank: 1
)
NEW_STORED_SALTED = _golden(
    "93",  # batch: fixarray 3
    "cb 3fe0000000000000",  # ts: float64 0.5
    "91",  # events: fixarray 1
    "89",  # BlockStored: fixmap 9 (lora_name None: omitted)
    _TYPE, _BLOCK_STORED,
    _BLOCK_HASHES, "92 d3fefdfcfbfaf9f8f8 05",  # [H3, 5]
    _PARENT, "c0",  # nil
    _TOKEN_IDS, "98 01 02 03 04 05 06 07 08",  # [1, ..., 8] (fixarray 8)
    _BLOCK_SIZE, "04",  # 4
    _LORA_ID, "c0",  # nil
    _MEDIUM, "a8 45585445524e414c",  # "EXTERNAL" (fixstr 8)
    _CACHE_SALT, "a2 7431",  # "t1"
    _SESSION_ID, "a2 7331",  # "s1"
    "00",  # attn_dp_rank: 0
)
NEW_REMOVED = _golden(
    "93",  # batch: fixarray 3
    "cb 4008000000000000",  # ts: float64 3.0
    "92",  # events: fixarray 2
    "83", _TYPE, _BLOCK_REMOVED,  # BlockRemoved: fixmap 3
    _BLOCK_HASHES, "92 fe cf0102030405060708",  # [H2, H1]
    _MEDIUM, "a3 475055",  # "GPU"
    "83", _TYPE, _BLOCK_REMOVED,  # BlockRemoved: fixmap 3
    _BLOCK_HASHES, "91 fe",  # [H2]
    _MEDIUM, "aa 4350555f50494e4e4544",  # "CPU_PINNED"
    "00",  # attn_dp_rank: 0
)
NEW_REMOVED_NO_MEDIUM = _golden(
    "93 cb 3ff0000000000000",  # batch: fixarray 3; ts: float64 1.0
    "91", "82", _TYPE, _BLOCK_REMOVED,  # events: [BlockRemoved: fixmap 2 (medium omitted)]
    _BLOCK_HASHES, "91 cf0102030405060708",  # [H1]
    "00",  # attn_dp_rank: 0
)
NEW_CLEARED = _golden(
    "93 cb 3ff0000000000000",  # batch: fixarray 3; ts: float64 1.0
    "91 81", _TYPE, _ALL_CLEARED,  # events: [AllBlocksCleared: fixmap 1]
    "c0",  # attn_dp_rank: nil
)
NEW_BIGRAM = _golden(
    "93 cb 3ff0000000000000",  # batch: fixarray 3; ts: float64 1.0
    "91 87", _TYPE, _BLOCK_STORED,  # events: [BlockStored: fixmap 7]
    _BLOCK_HASHES, "92 01 02",  # [1, 2]
    _PARENT, "c0",  # nil
    _TOKEN_IDS, "92 92 0a 0b 92 0b 0c",  # [(10, 11), (11, 12)]: bigram pages
    _BLOCK_SIZE, "01",  # 1
    _LORA_ID, "c0",  # nil
    _MEDIUM, "a3 475055",  # "GPU"
    "00",  # attn_dp_rank: 0
)

# ---------------------------------------------------------------- array layout (@612d579)

OLD_STORED = _golden(
    "93",  # batch: fixarray 3 [ts, events, attn_dp_rank]
    "cb 4000000000000000",  # ts: float64 2.0
    "91",  # events: fixarray 1
    "96", _BLOCK_STORED,  # BlockStored: fixarray 6, the tag first
    "92 07 08",  # block_hashes: [7, 8]
    "c0",  # parent_block_hash: nil
    "94 01 02 03 04",  # token_ids: [1, 2, 3, 4]
    "02",  # block_size: 2
    "c0",  # lora_id: nil
    "00",  # attn_dp_rank: 0
)
OLD_STORED_CHILD_NO_RANK = _golden(
    "92",  # batch: fixarray 2 [ts, events] (@006d053: EventBatch had no attn_dp_rank)
    "cb 4008000000000000",  # ts: float64 3.0
    "91",  # events: fixarray 1
    "96", _BLOCK_STORED,  # BlockStored: fixarray 6
    "91 09",  # block_hashes: [9]
    "08",  # parent_block_hash: 8
    "92 05 06",  # token_ids: [5, 6]
    "02",  # block_size: 2
    "c0",  # lora_id: nil
)
OLD_REMOVED_AND_CLEARED = _golden(
    "93 cb 3ff0000000000000",  # batch: fixarray 3; ts: float64 1.0
    "92",  # events: fixarray 2
    "92", _BLOCK_REMOVED, "92 08 07",  # ["BlockRemoved", [8, 7]]
    "91", _ALL_CLEARED,  # ["AllBlocksCleared"]
    "02",  # attn_dp_rank: 2
)
UNKNOWN_TAGS = _golden(
    "93 cb 3ff0000000000000",  # batch: fixarray 3; ts: float64 1.0
    "93",  # events: fixarray 3
    "82", _TYPE, "a3 466f6f", "a1 78 01",  # {"type": "Foo", "x": 1}
    "92 a3 466f6f 01",  # ["Foo", 1]
    "91", _ALL_CLEARED,  # ["AllBlocksCleared"]: still decoded
    "c0",  # attn_dp_rank: nil
)


def _stored(hashes: list[int], parent: int | None, tokens: list[int], b: int,
            **kwargs: str | None) -> SgBlockStored:
    return SgBlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                         block_size=b, **kwargs)


def _batch(*events: SGLangEvent) -> SGLangBatch:
    return SGLangBatch(ts=0.0, events=list(events))


DECODE_CASES = [
    ("new_stored_gpu", NEW_STORED_GPU, SGLangBatch(ts=1.5, dp_rank=0, events=[
        _stored([H1, H2], None, [10, 11, 12, 13], 2, medium="GPU")])),
    ("new_stored_cpu", NEW_STORED_CPU, SGLangBatch(ts=2.0, dp_rank=1, events=[
        _stored([H1, H2], None, [10, 11, 12, 13], 2, medium="CPU_PINNED")])),
    ("new_stored_salted", NEW_STORED_SALTED, SGLangBatch(ts=0.5, dp_rank=0, events=[
        _stored([H3, 5], None, list(range(1, 9)), 4, medium="EXTERNAL", cache_salt="t1")])),
    ("new_removed", NEW_REMOVED, SGLangBatch(ts=3.0, dp_rank=0, events=[
        SgBlockRemoved(block_hashes=[H2, H1], medium="GPU"),
        SgBlockRemoved(block_hashes=[H2], medium="CPU_PINNED")])),
    ("new_removed_no_medium", NEW_REMOVED_NO_MEDIUM, SGLangBatch(ts=1.0, dp_rank=0, events=[
        SgBlockRemoved(block_hashes=[H1])])),
    ("new_cleared", NEW_CLEARED, SGLangBatch(ts=1.0, events=[SgAllBlocksCleared()])),
    ("new_bigram", NEW_BIGRAM, SGLangBatch(ts=1.0, dp_rank=0, events=[
        SgSkippedEvent(type="BlockStored", reason="bigram token pages")])),
    ("old_stored", OLD_STORED, SGLangBatch(ts=2.0, dp_rank=0, events=[
        _stored([7, 8], None, [1, 2, 3, 4], 2)])),
    ("old_stored_child_no_rank", OLD_STORED_CHILD_NO_RANK, SGLangBatch(ts=3.0, events=[
        _stored([9], 8, [5, 6], 2)])),
    ("old_removed_and_cleared", OLD_REMOVED_AND_CLEARED, SGLangBatch(ts=1.0, dp_rank=2, events=[
        SgBlockRemoved(block_hashes=[8, 7]), SgAllBlocksCleared()])),
    ("unknown_tags", UNKNOWN_TAGS, SGLangBatch(ts=1.0, events=[
        SgSkippedEvent(type="Foo", reason="unknown event type"),
        SgSkippedEvent(type="Foo", reason="unknown event type"),
        SgAllBlocksCleared()])),
]


@pytest.mark.parametrize(("payload", "expected"), [c[1:] for c in DECODE_CASES],
                         ids=[c[0] for c in DECODE_CASES])
def test_decode_golden(payload: bytes, expected: SGLangBatch) -> None:
    assert decode_batch(payload) == expected


def _pages(tokens: list[int], page_size: int, salt: str | None = None) -> list[int]:
    """Our page hashes, computed independently over the whole chain."""
    return page_hashes(tokens, page_size, salt)


def _our_stored(tokens: list[int], page_size: int, first: int, num: int,
                medium: str = MEDIUM_GPU, salt: str | None = None) -> BlockStored:
    """Our BlockStored for pages [first, first + num) of the chain over ``tokens``."""
    hashes = _pages(tokens, page_size, salt)
    return BlockStored(block_hashes=hashes[first:first + num],
                       parent_block_hash=hashes[first - 1] if first else None,
                       token_ids=tokens[first * page_size:(first + num) * page_size],
                       block_size=page_size, medium=medium, cache_salt=salt)


def _translate(translator: EventTranslator, payload: bytes) -> list[KVEvent]:
    return translator.translate(decode_batch(payload))


TOKENS = [10, 11, 12, 13]
TRANSLATE_CASES = [
    ("new_store_then_other_medium_then_remove", 4, [
        (NEW_STORED_GPU, [_our_stored(TOKENS, 4, 0, 1)]),
        (NEW_STORED_CPU, [_our_stored(TOKENS, 4, 0, 1, MEDIUM_CPU)]),
        (NEW_REMOVED, [BlockRemoved(block_hashes=_pages(TOKENS, 4), medium=MEDIUM_GPU),
                       BlockRemoved(block_hashes=_pages(TOKENS, 4), medium=MEDIUM_CPU)]),
        (NEW_REMOVED_NO_MEDIUM, []),  # H1 left the GPU already (and completed no page)
        (NEW_CLEARED, [AllBlocksCleared()]),
    ]),
    ("new_b_equals_p_salted_external", 4, [
        (NEW_STORED_SALTED, [_our_stored(list(range(1, 9)), 4, 0, 2, MEDIUM_GCACHE, "t1")]),
    ]),
    ("new_b2_p2_pages_per_block", 2, [
        (NEW_STORED_GPU, [_our_stored(TOKENS, 2, 0, 2)]),
        (NEW_REMOVED_NO_MEDIUM, [BlockRemoved(block_hashes=_pages(TOKENS, 2)[:1])]),
    ]),
    ("old_store_child_remove_clear", 4, [
        (OLD_STORED, [_our_stored([1, 2, 3, 4], 4, 0, 1)]),
        (OLD_STORED_CHILD_NO_RANK, []),  # 2 tokens past page 0: no page of ours yet
        (OLD_REMOVED_AND_CLEARED, [BlockRemoved(block_hashes=_pages([1, 2, 3, 4], 4)),
                                   AllBlocksCleared()]),
    ]),
    ("old_b2_p8_partial", 8, [
        (OLD_STORED, []),
        (OLD_STORED_CHILD_NO_RANK, []),  # 6 of 8 tokens: never a page
        (OLD_REMOVED_AND_CLEARED, [AllBlocksCleared()]),
    ]),
    ("unknown_and_bigram_skipped", 4, [
        (NEW_BIGRAM, []),
        (UNKNOWN_TAGS, [AllBlocksCleared()]),
    ]),
]


@pytest.mark.parametrize(("page_size", "steps"), [c[1:] for c in TRANSLATE_CASES],
                         ids=[c[0] for c in TRANSLATE_CASES])
def test_translate_golden(page_size: int, steps: list[tuple[bytes, list[KVEvent]]]) -> None:
    translator = EventTranslator(page_size)
    for i, (payload, expected) in enumerate(steps):
        assert _translate(translator, payload) == expected, f"step {i}"


def test_translate_counts_skipped_events() -> None:
    translator = EventTranslator(4)
    _translate(translator, NEW_BIGRAM)
    _translate(translator, UNKNOWN_TAGS)
    assert translator.stats.skipped == 3
    assert translator.num_blocks == 0


@pytest.mark.parametrize("payload", [
    b"",  # nothing
    b"\xc1",  # the byte msgpack never uses
    b"\x93\xcb\x3f",  # truncated float
    _golden("a3 616263"),  # "abc": not an array
    _golden("91 cb 3ff0000000000000"),  # [1.0]: no events
    _golden("92 a1 78 90"),  # ["x", []]: ts not a number
    _golden("92 c3 90"),  # [true, []]: a bool is no ts
    _golden("92 cb 3ff0000000000000 80"),  # [1.0, {}]: events not an array
    _golden("93 cb 3ff0000000000000 90 a1 78"),  # [1.0, [], "x"]: rank not an int
    NEW_CLEARED + b"\x00",  # trailing bytes
])
def test_garbage_payload_raises(payload: bytes) -> None:
    with pytest.raises(SGLangWireError):
        decode_batch(payload)


def test_malformed_event_is_skipped_not_fatal() -> None:
    payload = _golden(
        "93 cb 3ff0000000000000",  # batch: fixarray 3; ts 1.0
        "93",  # events: fixarray 3
        "92", _BLOCK_STORED, "90",  # ["BlockStored", []]: too short
        "82", _TYPE, _BLOCK_REMOVED, _BLOCK_HASHES, "a1 78",  # block_hashes: "x"
        "05",  # not an event at all
        "00",  # attn_dp_rank: 0
    )
    events = decode_batch(payload).events
    assert [type(e) for e in events] == [SgSkippedEvent] * 3, events
    assert [getattr(e, "type", "?") for e in events] == ["BlockStored", "BlockRemoved", None]
    translator = EventTranslator(4)
    assert translator.translate(decode_batch(payload)) == []
    assert translator.stats.skipped == 3


# ---------------------------------------------------------------- translation rules


def _chain_events(tokens: list[int], b: int, *, first_hash: int = 1000, per_event: int = 1,
                  salt: str | None = None, medium: str | None = None) -> list[SgBlockStored]:
    """SGLang's stores of one chain over ``tokens``: block i has hash ``first_hash + i``."""
    num_blocks = len(tokens) // b
    events = []
    for start in range(0, num_blocks, per_event):
        stop = min(start + per_event, num_blocks)
        events.append(_stored(list(range(first_hash + start, first_hash + stop)),
                              first_hash + start - 1 if start else None,
                              tokens[start * b:stop * b], b, cache_salt=salt, medium=medium))
    return events


def _assert_stored_pages(events: list[KVEvent], expected: list[int]) -> None:
    got = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert got == expected, f"stored {got}, expected {expected}"


def test_b1_p4_aggregates_pages_and_never_emits_a_partial_tail() -> None:
    tokens = list(range(30, 40))  # 10 tokens: 2 full pages of 4, a tail of 2
    translator = EventTranslator(4)
    events = translator.translate(_batch(*_chain_events(tokens, 1)))
    # 10 consecutive stores of one chain in one batch: ONE event of ours, both full pages
    assert events == [_our_stored(tokens, 4, 0, 2)]
    assert translator.stats.stored == 10 and translator.stats.pages_stored == 2


def test_b1_p4_across_batches_keeps_the_partial_page_state() -> None:
    tokens = list(range(30, 42))
    translator = EventTranslator(4)
    out: list[KVEvent] = []
    for event in _chain_events(tokens, 1):  # one block per batch
        out += translator.translate(_batch(event))
    assert out == [_our_stored(tokens, 4, i, 1) for i in range(3)]


def test_b_equals_p_maps_one_to_one() -> None:
    tokens = list(range(100, 116))
    translator = EventTranslator(4)
    events = translator.translate(_batch(*_chain_events(tokens, 4, per_event=2)))
    assert events == [_our_stored(tokens, 4, 0, 4)]


def test_salted_chain_gives_salted_hashes() -> None:
    tokens = list(range(8))
    translator = EventTranslator(4)
    events = translator.translate(_batch(*_chain_events(tokens, 2, salt="tenant-a")))
    assert events == [_our_stored(tokens, 4, 0, 2, salt="tenant-a")]
    assert _pages(tokens, 4, "tenant-a") != _pages(tokens, 4)


def test_unknown_parent_is_unmapped_with_its_descendants() -> None:
    tokens = list(range(16))
    chain = _chain_events(tokens, 2)  # 8 blocks, hashes 1000..1007
    translator = EventTranslator(4)
    # the root block's store was lost: every later block is unmapped, nothing is emitted
    assert translator.translate(_batch(*chain[1:])) == []
    assert translator.stats.unmapped == 7 and translator.num_blocks == 0
    # a coalesced event under an unknown parent: all its blocks
    translator.translate(_batch(_stored([50, 51, 52], 49, [1] * 6, 2)))
    assert translator.stats.unmapped == 10


def test_removal_is_per_medium_and_forgets_a_block_in_no_medium() -> None:
    tokens = list(range(8))
    translator = EventTranslator(4)
    translator.translate(_batch(*_chain_events(tokens, 4, medium="GPU"),
                                *_chain_events(tokens, 4, medium="CPU_PINNED")))
    pages = _pages(tokens, 4)
    events = translator.translate(_batch(SgBlockRemoved(block_hashes=[1001, 1000])))
    assert events == [BlockRemoved(block_hashes=[pages[1], pages[0]], medium=MEDIUM_GPU)]
    assert translator.num_blocks == 2  # still on the host
    events = translator.translate(_batch(
        SgBlockRemoved(block_hashes=[1001], medium="CPU_PINNED"),
        SgBlockRemoved(block_hashes=[1000], medium="CPU_PINNED")))
    assert events == [BlockRemoved(block_hashes=[pages[1], pages[0]], medium=MEDIUM_CPU)]
    assert translator.num_blocks == 0 and translator.stats.removed == 4


def test_removing_a_block_that_completed_no_page_emits_nothing() -> None:
    tokens = list(range(6))
    translator = EventTranslator(4)
    translator.translate(_batch(*_chain_events(tokens, 2)))  # blocks 1000..1002
    assert translator.translate(_batch(SgBlockRemoved(block_hashes=[1002]))) == []
    assert translator.translate(_batch(SgBlockRemoved(block_hashes=[1000]))) == []
    assert translator.translate(_batch(SgBlockRemoved(block_hashes=[1001]))) == [
        BlockRemoved(block_hashes=_pages(tokens, 4))]


def test_all_blocks_cleared_forgets_the_map() -> None:
    tokens = list(range(8))
    chain = _chain_events(tokens, 4)
    translator = EventTranslator(4)
    translator.translate(_batch(chain[0]))
    assert translator.translate(_batch(SgAllBlocksCleared(), chain[1])) == [AllBlocksCleared()]
    assert translator.stats.unmapped == 1 and translator.num_blocks == 0


def test_reset_clears_the_map_and_tells_the_router() -> None:
    translator = EventTranslator(4)
    translator.translate(_batch(*_chain_events(list(range(8)), 4)))
    assert translator.reset() == [AllBlocksCleared()]
    assert translator.num_blocks == 0


def test_disk_is_tracked_but_never_emitted() -> None:
    tokens = list(range(8))
    translator = EventTranslator(4)
    first, second = _chain_events(tokens, 4)
    disk = _stored(first.block_hashes, None, first.token_ids, 4, medium="DISK")
    assert translator.translate(_batch(disk)) == []
    assert translator.stats.skipped == 1
    # a child stored on the GPU under the DISK-only block keeps its chain
    assert translator.translate(_batch(second)) == [_our_stored(tokens, 4, 1, 1)]
    assert translator.translate(_batch(SgBlockRemoved(block_hashes=[1000], medium="DISK"))) == []
    assert translator.stats.skipped == 2


def test_short_last_page_never_completes_a_page_and_ends_its_chain() -> None:
    # SGLang page size 2, ours 4: a node's short last page shows as block_size 1
    translator = EventTranslator(4)
    events = translator.translate(_batch(_stored([1, 2], None, [5, 6, 7, 8], 2),
                                         _stored([3], 2, [9], 1)))
    assert events == [_our_stored([5, 6, 7, 8], 4, 0, 1)]
    assert translator.translate(_batch(_stored([4], 3, [10, 11], 2))) == []
    assert translator.stats.unmapped == 1


def test_short_root_page_with_known_sglang_page_size() -> None:
    translator = EventTranslator(4, sglang_page_size=4)
    # SGLang's pages hold 4 tokens: a 2-token root block is a short page, and its child is
    # unmapped (it would complete a page of ours only by token count)
    assert translator.translate(_batch(_stored([1], None, [5, 6], 2))) == []
    assert translator.translate(_batch(_stored([2], 1, [7, 8, 9, 10], 4))) == []
    assert translator.stats.unmapped == 1


def test_block_size_not_dividing_ours_is_skipped_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    translator = EventTranslator(4)
    with caplog.at_level(logging.WARNING, logger="engine.sglang_backend.kv_events"):
        for h in (1, 2):
            assert translator.translate(_batch(_stored([h], None, [1, 2, 3], 3))) == []
    assert translator.stats.skipped == 2
    assert len([r for r in caplog.records if "does not divide" in r.message]) == 1
    with pytest.raises(ValueError, match="must divide"):
        EventTranslator(4, sglang_page_size=3)


def test_lora_pages_are_skipped() -> None:
    translator = EventTranslator(4)
    lora = _stored([1], None, [1, 2, 3, 4], 4, lora_name="adapter")
    assert translator.translate(_batch(lora)) == []
    assert translator.stats.skipped == 1 and translator.num_blocks == 0


def test_the_bound_evicts_the_oldest_and_reports_its_pages_removed() -> None:
    tokens = list(range(12))
    translator = EventTranslator(4, max_blocks=2)
    events = translator.translate(_batch(*_chain_events(tokens, 4)))
    pages = _pages(tokens, 4)
    # the chain's pages are stored, then page 0's block is dropped for room: removed at once
    assert events == [_our_stored(tokens, 4, 0, 2), BlockRemoved(block_hashes=pages[:1]),
                      _our_stored(tokens, 4, 2, 1)]
    assert translator.stats.evicted == 1 and translator.num_blocks == 2
    assert translator.translate(_batch(SgBlockRemoved(block_hashes=[1000]))) == []


def test_a_page_shared_by_two_sglang_blocks_is_removed_with_the_last() -> None:
    # the same tokens under two SGLang namespaces (opaque hashes 1000 and 2000): one page of ours
    tokens = [1, 2, 3, 4]
    translator = EventTranslator(4)
    events = translator.translate(_batch(*_chain_events(tokens, 4),
                                         *_chain_events(tokens, 4, first_hash=2000)))
    assert events == [_our_stored(tokens, 4, 0, 1)]
    assert translator.translate(_batch(SgBlockRemoved(block_hashes=[1000]))) == []
    assert translator.translate(_batch(SgBlockRemoved(block_hashes=[2000]))) == [
        BlockRemoved(block_hashes=_pages(tokens, 4))]


# ---------------------------------------------------------------- through our wire and index


def test_our_events_round_trip_and_the_index_credits_them() -> None:
    page_size = 2
    translator = EventTranslator(page_size)
    events = _translate(translator, NEW_STORED_GPU)
    batch = KVEventBatch(ts=1.5, events=events, data_parallel_rank=0)
    assert decode_ours(encode_ours(batch)) == batch
    index = KVIndex(page_size)
    index.add_worker("w0", window_pages=0)  # no SWA layers: full-KV credit counts
    assert index.apply("w0", 0, batch) is None
    request = TOKENS + [99]  # the prompt's full pages are TOKENS'
    assert index.match(page_hashes(request, page_size)) == {"w0": MatchResult(2, 2)}
    removed = KVEventBatch(ts=3.0, events=_translate(translator, NEW_REMOVED))
    assert index.apply("w0", 1, decode_ours(encode_ours(removed))) is None
    assert index.match(page_hashes(request, page_size)) == {}


# ---------------------------------------------------------------- property


_Store = tuple[int, int, list[int], str, str | None]  # parent pick, blocks, tokens, medium, salt


@st.composite
def _workloads(draw: st.DrawFn) -> tuple[int, int, list[_Store]]:
    """P, b (dividing P), and SGLang stores: each under a random live block or at a root."""
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    b = draw(st.sampled_from([d for d in (1, 2, 4, 8) if page_size % d == 0]))
    num_stores = draw(st.integers(1, 12))
    stores = []
    for _ in range(num_stores):
        parent_pick = draw(st.integers(0, 10))
        num_blocks = draw(st.integers(1, 4))
        tokens = draw(st.lists(st.integers(0, 2), min_size=num_blocks * b,
                               max_size=num_blocks * b))
        medium = draw(st.sampled_from(["GPU", "CPU_PINNED"]))
        salt = draw(st.sampled_from([None, "s"]))
        stores.append((parent_pick, num_blocks, tokens, medium, salt))
    return page_size, b, stores


_Key = tuple[str | None, tuple[int, ...]]  # (salt, token prefix): what an SGLang hash names


class _Model:
    """What SGLang holds: (key, medium) pairs, keys hashed to stable opaque ints."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.live: set[tuple[_Key, str]] = set()
        self.ids: dict[_Key, int] = {}

    def sg_hash(self, key: _Key) -> int:
        return self.ids.setdefault(key, 7919 * (len(self.ids) + 1))

    def live_keys(self) -> list[_Key]:
        return sorted({key for key, _ in self.live}, key=repr)

    def expected_pages(self) -> set[tuple[int, str]]:
        ours = {"GPU": MEDIUM_GPU, "CPU_PINNED": MEDIUM_CPU}
        return {(page_hashes(list(tokens), self.page_size, salt)[-1], ours[medium])
                for (salt, tokens), medium in self.live
                if tokens and len(tokens) % self.page_size == 0}


def _apply_ours(held: set[tuple[int, str]], events: list[KVEvent], page_size: int) -> None:
    for event in events:
        if isinstance(event, AllBlocksCleared):
            held.clear()
            continue
        assert isinstance(event, BlockStored | BlockRemoved), event
        if isinstance(event, BlockStored):
            prev = event.parent_block_hash
            salt = event.cache_salt if prev is None else None
            assert page_hashes(event.token_ids, page_size, salt, prev) == event.block_hashes
            held.update((h, event.medium or MEDIUM_GPU) for h in event.block_hashes)
        else:
            held.difference_update((h, event.medium or MEDIUM_GPU) for h in event.block_hashes)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_workloads(), st.randoms(use_true_random=False))
def test_property_stored_pages_are_the_chain_hashes(
    workload: tuple[int, int, list[_Store]], rng: random.Random,
) -> None:
    """Random trees of SGLang stores, then removals leaf first: after every batch the pages
    our events hold are exactly the chain hashes of the blocks SGLang holds that end a page."""
    page_size, b, stores = workload
    model, translator = _Model(page_size), EventTranslator(page_size)
    held: set[tuple[int, str]] = set()
    for parent_pick, num_blocks, tokens, medium, salt in stores:
        live = model.live_keys()
        parent = live[parent_pick % len(live)] if live and parent_pick % 3 else None
        key: _Key = parent if parent is not None else (salt, ())
        hashes = []
        for i in range(num_blocks):
            key = (key[0], key[1] + tuple(tokens[i * b:(i + 1) * b]))
            hashes.append(model.sg_hash(key))
            model.live.add((key, medium))
        event = _stored(hashes, None if parent is None else model.sg_hash(parent), tokens, b,
                        medium=medium, cache_salt=key[0])
        _apply_ours(held, translator.translate(_batch(event)), page_size)
        assert held == model.expected_pages()
    # removals, leaf first, one (block, medium) at a time, a few per batch
    while model.live:
        keys = {key for key, _ in model.live}
        leaves = [(k, m) for k, m in sorted(model.live, key=repr)
                  if not any(o[0] == k[0] and len(o[1]) > len(k[1]) and o[1][:len(k[1])] == k[1]
                             for o in keys)]
        chosen = rng.sample(leaves, min(len(leaves), rng.randint(1, 3)))
        model.live.difference_update(chosen)
        removals = [SgBlockRemoved(block_hashes=[model.sg_hash(k)], medium=m) for k, m in chosen]
        _apply_ours(held, translator.translate(_batch(*removals)), page_size)
        assert held == model.expected_pages()
    assert held == set() and translator.num_blocks == 0
    assert translator.stats.unmapped == 0 and translator.stats.evicted == 0
