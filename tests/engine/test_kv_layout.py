"""KV page geometry and the SWA window's page arithmetic (issue 3, "KV memory")."""

from __future__ import annotations

import pytest

from engine.kv import KVLayout, PageKind
from engine.kv.layout import num_pages, swa_first_needed_page
from engine.model_config import ModelConfig
from engine.models.checkpoint import mimo_config

FULL, SWA = PageKind.FULL, PageKind.SWA


def test_page_bytes_on_mimo_v25_pro_geometry() -> None:
    """70 layers, 10 full (4 KV heads), 60 SWA (8 KV heads), head dims 192 / 128, bf16."""
    layout = KVLayout.from_model(_make_mimo_pro_config(), page_size=16, dtype_bytes=2)
    full_page = 16 * 10 * 4 * (192 + 128) * 2
    swa_page = 16 * 60 * 8 * (192 + 128) * 2
    got = (layout.page_bytes(FULL), layout.page_bytes(SWA), layout.chunk_bytes)
    assert got == (full_page, swa_page, swa_page), f"(full, swa, chunk) bytes = {got}"
    assert (layout.slots_per_chunk(FULL), layout.slots_per_chunk(SWA)) == (12, 1)
    assert layout.window == 128 and len(layout.swa_layer_ids) == 60
    assert layout.layer_index(0) == (FULL, 0) and layout.layer_index(7) == (FULL, 1)
    assert layout.layer_index(1) == (SWA, 0) and layout.layer_index(69) == (SWA, 59)


def test_layer_index_rejects_unknown_layer() -> None:
    layout = KVLayout.from_model(_make_mimo_pro_config(), page_size=16, dtype_bytes=2)
    with pytest.raises(ValueError, match="layer 70"):
        layout.layer_index(70)


@pytest.mark.parametrize(
    ("num_tokens", "page_size", "expected"), [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2)]
)
def test_num_pages(num_tokens: int, page_size: int, expected: int) -> None:
    assert num_pages(num_tokens, page_size) == expected


# W = 16, page 4. A step of `chunk` queries ending at seq_len reads [seq_len - 16 - chunk, seq_len).
#   seq_len  chunk  oldest read   first needed page
SWA_TABLE = [
    (1, 1, 0, 0),
    (17, 1, 0, 0),
    (20, 1, 3, 0),  # position 3 is still read: page 0 stays
    (21, 1, 4, 1),  # page 0 = [0, 4) is entirely older: releasable
    (24, 1, 7, 1),
    (25, 1, 8, 2),
    (24, 8, 0, 0),
    (28, 8, 4, 1),
    (31, 8, 7, 1),
    (32, 8, 8, 2),
    (100, 8, 76, 19),
]


@pytest.mark.parametrize(("seq_len", "chunk", "oldest_read", "first_page"), SWA_TABLE)
def test_swa_first_needed_page_table(
    seq_len: int, chunk: int, oldest_read: int, first_page: int
) -> None:
    assert max(0, seq_len - 16 - chunk) == oldest_read, "table row is inconsistent"
    got = swa_first_needed_page(seq_len, window=16, chunk=chunk, page_size=4)
    assert got == first_page, f"seq_len={seq_len} chunk={chunk}: page {got}, want {first_page}"


@pytest.mark.parametrize(("window", "page_size"), [(16, 4), (5, 4), (3, 8), (128, 16)])
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_swa_first_needed_page_matches_brute_force(window: int, page_size: int, chunk: int) -> None:
    for seq_len in range(chunk, 3 * (window + chunk + page_size)):
        lo = max(0, seq_len - window - chunk)
        brute = min(i for i in range(num_pages(seq_len, page_size)) if (i + 1) * page_size > lo)
        got = swa_first_needed_page(seq_len, window, chunk, page_size)
        assert got == brute, f"seq_len={seq_len}: {got} != brute force {brute}"


def _make_mimo_pro_config() -> ModelConfig:
    layers = "".join("F" if i % 7 == 0 else "S" for i in range(70))
    raw = mimo_config(
        layers=layers,
        sliding_window=128,
        num_attention_heads=64,
        num_key_value_heads=4,  # SWA layers get 2x in this dialect
        head_dim=192,
        v_head_dim=128,
    )
    return ModelConfig.from_dict(raw)
