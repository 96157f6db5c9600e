"""Chained page hashes: the ONE definition of a page's identity, shared by gateway and engine.

A page hash names the KV of one full page *and everything before it*: page ``i`` hashes the hash
of page ``i - 1`` together with its own token ids, so two sequences share page ``i``'s hash only
when they share tokens ``[0, (i + 1) * page_size)``. The first page of a chain hashes a seed
derived from the request's ``cache_salt`` instead, which keeps tenants' hashes apart.

Byte layout hashed with xxh3-64 (all integers little-endian)::

    first page:   seed (u64)        || ids as u32[page_len]
    later pages:  prev hash (u64)   || ids as u32[page_len]
    any id >= 2**32 in the page: the u32 form is replaced by  0xFF || ids as u64[page_len]

The tagged u64 form is 1 + 8n bytes long and the u32 form 4n, so the two can never produce the
same input bytes. Hashes are returned as signed int64 (two's complement), the type SGLang's and
vLLM's KV events carry; ``prev`` may be given signed or unsigned.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import numpy as np
import xxhash

SEED_DOMAIN = b"agentgate-page-v1\x00"
MAX_TOKEN_ID = 2**64 - 1

_U32_LIMIT = 2**32
_U64_MASK = 2**64 - 1
_WIDE_TAG = b"\xff"
# NOTE: an array("I") holds the u32 form's bytes as they are (``page_hashes``' fast path)
_NATIVE_U32 = array("I").itemsize == 4 and sys.byteorder == "little"


def salt_seed(cache_salt: str | None) -> int:
    """The unsigned 64-bit seed of a chain: xxh3-64 of ``SEED_DOMAIN`` + utf-8 ``cache_salt``.

    ``None`` and ``""`` name the same (unsalted) namespace.
    """
    return xxhash.xxh3_64_intdigest(SEED_DOMAIN + (cache_salt or "").encode("utf-8"))


def page_hash(prev: int | None, token_ids: Sequence[int], seed: int) -> int:
    """Hash of one page, chained to the page before it.

    Args:
        prev: hash of the previous page (signed or unsigned 64-bit), None for the first page.
        token_ids: the page's token ids, each in ``[0, 2**64)``.
        seed: ``salt_seed(cache_salt)``; used only when ``prev`` is None.

    Returns:
        The page's hash as a signed int64.

    Raises:
        ValueError: a token id is negative, too large, or not an integer.
    """
    ids = _as_id_array(token_ids)
    chain = seed if prev is None else prev
    return _hash_page(_u64_bytes(chain), ids)


def page_hashes(
    token_ids: Sequence[int],
    page_size: int,
    cache_salt: str | None = None,
    prev: int | None = None,
) -> list[int]:
    """Hashes of the full pages of ``token_ids``; a trailing partial page has none.

    Args:
        token_ids: the tokens, starting at a page boundary.
        page_size: tokens per page, >= 1.
        cache_salt: tenant namespace; seeds the first page when ``prev`` is None.
        prev: hash of the page just before ``token_ids[0]``, to extend an existing chain (the salt
            is then already folded into ``prev`` and is not used again).

    Returns:
        ``len(token_ids) // page_size`` signed int64 hashes, equal to calling ``page_hash`` page
        by page.

    Raises:
        ValueError: ``page_size < 1``, or a token id is negative, too large, or not an integer.

    NOTE: an ``array("I")`` of ids (valid by its type: ``u32_ids``) skips the checks and numpy.
    """
    if page_size < 1:
        raise ValueError(f"page_size={page_size}: must be >= 1")
    chain = _u64_bytes(salt_seed(cache_salt) if prev is None else prev)
    if _NATIVE_U32 and isinstance(token_ids, array) and token_ids.typecode == "I":
        num_pages = len(token_ids) // page_size
        return _hash_u32_pages(token_ids[: num_pages * page_size].tobytes(), page_size, chain)
    ids = _as_id_array(token_ids)
    num_pages = len(ids) // page_size
    if num_pages == 0:
        return []
    pages = ids[: num_pages * page_size].reshape(num_pages, page_size)
    if int(pages.max()) >= _U32_LIMIT:
        return _hash_pages_slow(pages, chain)
    return _hash_u32_pages(pages.astype("<u4").tobytes(), page_size, chain)


def u32_ids(token_ids: Sequence[int]) -> Sequence[int]:
    """``token_ids`` as an ``array("I")`` for ``page_hashes``' fast path (the same hashes),
    or as given when one does not fit a u32.

    NOTE: for ids known to be ints (a ``Sequence``'s): ``array`` takes a bool as 0 or 1, where
    ``page_hashes`` rejects it.
    """
    try:
        return array("I", token_ids)
    except (OverflowError, TypeError):
        return token_ids


def _hash_u32_pages(data: bytes, page_size: int, chain: bytes) -> list[int]:
    """The chain over ``data``, pages of ``page_size`` ids as u32 little-endian.

    NOTE: one numpy-free pass: each hash stays in its little-endian u64 bytes (the next page's
    prefix), and one ``array("q")`` reads them all back as signed ints at the end;
    ``iter_unpack`` hands out each page's bytes with no index arithmetic or slice per page
    (the per-page hot path of a prefill).
    """
    chains: list[bytes] = []
    append, digest = chains.append, xxhash.xxh3_64_intdigest
    for (page,) in struct.iter_unpack(f"{4 * page_size}s", data):
        chain = digest(chain + page).to_bytes(8, "little")
        append(chain)
    out = array("q")
    out.frombytes(b"".join(chains))
    if sys.byteorder != "little":
        out.byteswap()
    return out.tolist()


def _hash_pages_slow(pages: np.ndarray, chain: bytes) -> list[int]:
    hashes = []
    for page in pages:
        signed = _hash_page(chain, page)
        hashes.append(signed)
        chain = _u64_bytes(signed)
    return hashes


def _hash_page(chain: bytes, ids: np.ndarray) -> int:
    if len(ids) and int(ids.max()) >= _U32_LIMIT:
        body = _WIDE_TAG + ids.astype("<u8").tobytes()
    else:
        body = ids.astype("<u4").tobytes()
    return _to_signed(xxhash.xxh3_64_intdigest(chain + body))


def _as_id_array(token_ids: Sequence[int]) -> np.ndarray:
    """``token_ids`` as a 1-D integer array, validated to lie in ``[0, 2**64)``."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1:
        raise ValueError(f"token ids must be a flat sequence, got shape {ids.shape}")
    if ids.size == 0:
        return ids.astype(np.uint64)
    if ids.dtype.kind not in "iu":
        # NOTE: numpy picks float64 or object for Python ints beyond int64, so anything that is
        # not an integer array is checked element by element (this also rejects floats, bools).
        return _checked_u64(np.asarray(token_ids, dtype=object))
    if ids.dtype.kind == "i" and int(ids.min()) < 0:
        raise ValueError(f"token ids must be >= 0, got {int(ids.min())}")
    return ids


def _checked_u64(ids: np.ndarray) -> np.ndarray:
    for value in ids:
        if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
            raise ValueError(f"token ids must be integers in [0, 2**64), got {value!r}")
        if not 0 <= value <= MAX_TOKEN_ID:
            raise ValueError(f"token ids must be integers in [0, 2**64), got {value}")
    return ids.astype(np.uint64)


def _u64_bytes(value: int) -> bytes:
    return (value & _U64_MASK).to_bytes(8, "little")


def _to_signed(unsigned: int) -> int:
    return unsigned - 2**64 if unsigned >= 2**63 else unsigned
