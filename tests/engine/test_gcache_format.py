"""GCache value format and keys (engine/kv/gcache/format.py): exact round trips, namespacing,
and every damaged value reads as a miss, never as an exception or as other data."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.gcache.format import (
    decode_page,
    encode_page,
    model_fingerprint,
    page_key,
    page_shape,
)
from engine.kv.layout import KVLayout, PageKind

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _make_layout(**changes: object) -> KVLayout:
    base = KVLayout(page_size=16, dtype_bytes=2, full_layer_ids=(0, 3), swa_layer_ids=(1, 2),
                    full_head_dims=(2, 64, 64), swa_head_dims=(4, 32, 16), window=128)
    return dataclasses.replace(base, **changes)


def _make_page(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 100).to(dtype)


def _assert_same(got: torch.Tensor | None, want: torch.Tensor) -> None:
    assert got is not None, "decode_page returned a miss for a valid value"
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    # NOTE: bitwise, through uint8: NaN-safe and exact
    assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(PageKind), ids=lambda k: k.name)
def test_round_trip_of_a_layout_page(dtype: torch.dtype, kind: PageKind) -> None:
    shape = page_shape(_make_layout(), kind)
    page = _make_page(shape, dtype)
    _assert_same(decode_page(encode_page(page), shape, dtype), page)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (3, 4, 2, 24), (0, 4, 2, 8), (7,), (2, 3)])
def test_round_trip_of_any_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    page = _make_page(shape, dtype, seed=len(shape))
    _assert_same(decode_page(encode_page(page), shape, dtype), page)


def test_a_non_contiguous_page_round_trips_as_its_values() -> None:
    page = _make_page((4, 8, 2, 6), torch.bfloat16).transpose(0, 1)
    _assert_same(decode_page(encode_page(page), page.shape, torch.bfloat16), page)


def test_nan_and_inf_survive_bitwise() -> None:
    page = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=torch.bfloat16)
    _assert_same(decode_page(encode_page(page), (4,), torch.bfloat16), page)


@pytest.mark.parametrize(("shape", "dtype"), [
    ((2, 4, 2, 8), torch.float16),  # same bytes, other dtype
    ((2, 4, 2, 8), torch.float32),
    ((4, 2, 2, 8), torch.bfloat16),  # same numel, other shape
    ((2, 4, 2), torch.bfloat16),
    ((2, 4, 2, 8, 1), torch.bfloat16),
])
def test_another_shape_or_dtype_is_a_miss(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    data = encode_page(_make_page((2, 4, 2, 8), torch.bfloat16))
    assert decode_page(data, shape, dtype) is None


def test_an_unsupported_dtype_is_refused_at_encode() -> None:
    with pytest.raises(ValueError, match="dtype"):
        encode_page(torch.zeros(2, 2, dtype=torch.int32))


def test_keys_are_namespaced_by_fingerprint_kind_and_hash() -> None:
    keys = {
        page_key(fp, kind, h)
        for fp in ("a" * 16, "b" * 16) for kind in ("full", "swa") for h in (0, 1, -1, 2**62)
    }
    assert len(keys) == 2 * 2 * 4
    assert page_key("f00d", "swa", -1) == b"ag:v1:f00d:swa:ffffffffffffffff"
    assert page_key("f00d", "full", 5) == b"ag:v1:f00d:full:0000000000000005"


def test_a_signed_hash_and_its_unsigned_form_name_one_key() -> None:
    assert page_key("fp", "full", -2) == page_key("fp", "full", 2**64 - 2)


@pytest.mark.parametrize(("fp", "kind", "h"), [
    ("fp", "FULL", 0), ("fp", "window", 0), ("", "full", 0), ("a:b", "full", 0),
    ("fp", "full", 2**64), ("fp", "full", -(2**63) - 1),
])
def test_a_bad_key_part_is_refused(fp: str, kind: str, h: int) -> None:
    with pytest.raises(ValueError):
        page_key(fp, kind, h)


@pytest.mark.parametrize("change", [
    {"page_size": 32}, {"dtype_bytes": 4}, {"full_layer_ids": (0, 4)},
    {"swa_layer_ids": (1, 2, 4)}, {"full_head_dims": (2, 64, 32)}, {"swa_head_dims": (2, 32, 16)},
    {"window": 64},
], ids=lambda c: next(iter(c)))
def test_fingerprint_changes_with_the_geometry(change: dict[str, object]) -> None:
    base = model_fingerprint(_make_layout(), "org/model")
    assert model_fingerprint(_make_layout(**change), "org/model") != base


def test_fingerprint_changes_with_model_and_kv_dtype_and_is_stable() -> None:
    layout = _make_layout()
    fp = model_fingerprint(layout, "org/model")
    assert fp == model_fingerprint(_make_layout(), "org/model")
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert model_fingerprint(layout, "org/other") != fp
    assert model_fingerprint(layout, "org/model", "bfloat16") != model_fingerprint(
        layout, "org/model", "float16")
    # NOTE: pinned: a change here orphans every stored page (bump "agentgate-gcache-v1" instead)
    assert fp == "f4a8888ba436220c", fp


_PAGE = _make_page((2, 4, 2, 8), torch.bfloat16, seed=7)
_DATA = encode_page(_PAGE)


@settings(max_examples=300, deadline=None)
@given(index=st.integers(0, len(_DATA) - 1), flip=st.integers(1, 255))
def test_any_flipped_byte_is_a_miss(index: int, flip: int) -> None:
    damaged = bytearray(_DATA)
    damaged[index] ^= flip
    assert decode_page(bytes(damaged), _PAGE.shape, torch.bfloat16) is None


@settings(max_examples=200, deadline=None)
@given(length=st.integers(0, len(_DATA) - 1))
def test_any_truncation_is_a_miss(length: int) -> None:
    assert decode_page(_DATA[:length], _PAGE.shape, torch.bfloat16) is None


@settings(max_examples=50, deadline=None)
@given(tail=st.binary(min_size=1, max_size=16))
def test_trailing_bytes_are_a_miss(tail: bytes) -> None:
    assert decode_page(_DATA + tail, _PAGE.shape, torch.bfloat16) is None


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=512) | st.binary(max_size=64).map(lambda b: b"AGKV\x01\x03\x04" + b))
def test_arbitrary_bytes_never_raise(data: bytes) -> None:
    got = decode_page(data, _PAGE.shape, torch.bfloat16)
    assert got is None or torch.equal(got.view(torch.uint8), _PAGE.view(torch.uint8))
