"""The L3 value format: one page of one layer kind as bytes, and the key it is stored under.

A value is a fixed little-endian header, the page's raw bytes, and a CRC-32 of both::

    magic "AGKV" | version u8 | dtype code u8 | ndim u8 | shape u32[ndim] | payload_len u64
    | payload (the contiguous tensor's bytes, native = little-endian) | crc32 u32 (header+payload)

CRC-32 catches every error burst up to 32 bits (so any single flipped byte) and any truncation is
a length mismatch; ``decode_page`` turns all of these into a miss, never an exception.

A key names the page's content: the model (``model_fingerprint``: identity + KV geometry), the
layer kind, and the chained page hash, which already folds in the tenant's ``cache_salt``::

    ag:v1:<fingerprint>:<full|swa>:<page hash as 16 hex digits, two's complement>
"""

from __future__ import annotations

import hashlib
import math
import struct
import zlib
from collections.abc import Sequence

import torch

from engine.kv.layout import KVLayout, PageKind

KEY_PREFIX = b"ag:v1:"
KIND_NAMES = {PageKind.FULL: "full", PageKind.SWA: "swa"}
MAGIC = b"AGKV"
FORMAT_VERSION = 1
MAX_NDIM = 8

_FIXED = struct.Struct("<4sBBB")  # magic, version, dtype code, ndim
_LEN = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_U64_MASK = 2**64 - 1
# NOTE: codes are part of the format: never renumber, only append
_DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
for _code, _name in ((4, "float8_e4m3fn"), (5, "float8_e5m2")):
    if hasattr(torch, _name):
        _DTYPE_CODES[getattr(torch, _name)] = _code
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


def page_key(fingerprint: str, kind: str, page_hash: int) -> bytes:
    """The store key of one page of one kind.

    Args:
        fingerprint: ``model_fingerprint(...)`` of the model whose KV this is.
        kind: "full" or "swa" (``KIND_NAMES[PageKind]``).
        page_hash: the chained page hash, signed int64 (unsigned accepted: same key).

    Raises:
        ValueError: an unknown kind, a fingerprint with ':', or a hash outside 64 bits.
    """
    if kind not in ("full", "swa"):
        raise ValueError(f"kind={kind!r}: must be 'full' or 'swa'")
    if not fingerprint or ":" in fingerprint:
        raise ValueError(f"fingerprint={fingerprint!r}: must be non-empty, without ':'")
    if not -(2**63) <= page_hash <= _U64_MASK:
        raise ValueError(f"page_hash={page_hash}: not a 64-bit integer")
    return b"%s%s:%s:%016x" % (KEY_PREFIX, fingerprint.encode(), kind.encode(),
                               page_hash & _U64_MASK)


def model_fingerprint(layout: KVLayout, model_id: str, kv_dtype: str | None = None) -> str:
    """16 hex digits of sha256 over the model's identity and KV geometry.

    Two models, two page sizes, or two KV layouts never share a fingerprint, hence never read
    each other's pages. ``kv_dtype`` (e.g. "bfloat16") separates dtypes of the same width, which
    ``layout.dtype_bytes`` alone cannot; pass it whenever it is known.
    """
    ident = "|".join(str(part) for part in (
        "agentgate-gcache-v1", model_id, kv_dtype or "", layout.page_size, layout.dtype_bytes,
        layout.full_layer_ids, layout.swa_layer_ids, layout.full_head_dims,
        layout.swa_head_dims, layout.window,
    ))
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def page_shape(layout: KVLayout, kind: PageKind) -> tuple[int, int, int, int]:
    """Shape of one page of ``kind``, as ``KVPool.view(kind)[chunk, slot]`` holds it."""
    num_kv_heads, head_dim, v_head_dim = layout.head_dims(kind)
    return (layout.num_layers(kind), layout.page_size, num_kv_heads, head_dim + v_head_dim)


def encode_page(kv: torch.Tensor) -> bytes:
    """The value bytes of one page (any device; copied to host here if it is not there yet).

    Raises:
        ValueError: a dtype without a code, or more than ``MAX_NDIM`` dims.
    """
    code = _DTYPE_CODES.get(kv.dtype)
    if code is None:
        known = sorted(map(str, _DTYPE_CODES))
        raise ValueError(f"dtype {kv.dtype}: no GCache dtype code (known: {known})")
    if kv.dim() > MAX_NDIM:
        raise ValueError(f"{kv.dim()} dims: at most {MAX_NDIM}")
    # NOTE: through a uint8 view: bf16 and fp8 have no numpy dtype, uint8 always has
    flat = kv.detach().to("cpu").contiguous().reshape(-1)
    payload = flat.view(torch.uint8).numpy().tobytes()
    header = (_FIXED.pack(MAGIC, FORMAT_VERSION, code, kv.dim())
              + struct.pack(f"<{kv.dim()}I", *kv.shape) + _LEN.pack(len(payload)))
    crc = zlib.crc32(payload, zlib.crc32(header))
    return b"".join((header, payload, _CRC.pack(crc)))


def decode_page(
    data: bytes, expected_shape: Sequence[int], expected_dtype: torch.dtype
) -> torch.Tensor | None:
    """The page in ``data`` (a fresh CPU tensor), or None when ``data`` is not exactly a valid
    value of that shape and dtype: bad magic or version, other shape or dtype, truncated or
    padded, checksum mismatch. Never raises on bad data."""
    try:
        return _decode(memoryview(data), tuple(expected_shape), expected_dtype)
    except (struct.error, ValueError, TypeError, RuntimeError):
        return None


def _decode(
    data: memoryview, expected_shape: tuple[int, ...], expected_dtype: torch.dtype
) -> torch.Tensor | None:
    if len(data) < _FIXED.size:
        return None
    magic, version, code, ndim = _FIXED.unpack_from(data, 0)
    if magic != MAGIC or version != FORMAT_VERSION or ndim != len(expected_shape):
        return None
    if _CODE_DTYPES.get(code) != expected_dtype:
        return None
    shape = struct.unpack_from(f"<{ndim}I", data, _FIXED.size)
    (payload_len,) = _LEN.unpack_from(data, _FIXED.size + 4 * ndim)
    header_len = _FIXED.size + 4 * ndim + _LEN.size
    itemsize = torch.empty((), dtype=expected_dtype).element_size()
    if shape != expected_shape or payload_len != math.prod(shape) * itemsize:
        return None
    if len(data) != header_len + payload_len + _CRC.size:
        return None
    (crc,) = _CRC.unpack_from(data, header_len + payload_len)
    if zlib.crc32(data[: header_len + payload_len]) != crc:
        return None
    if payload_len == 0:
        return torch.empty(shape, dtype=expected_dtype)
    payload = bytearray(data[header_len : header_len + payload_len])  # NOTE: a writable copy
    return torch.frombuffer(payload, dtype=torch.uint8).view(expected_dtype).view(shape)
