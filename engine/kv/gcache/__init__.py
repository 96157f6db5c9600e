"""L3 "GCache": KV pages in a store shared by workers (files or Redis), keyed by page hash."""

from engine.kv.gcache.format import (
    KIND_NAMES,
    decode_page,
    encode_page,
    model_fingerprint,
    page_key,
    page_shape,
)
from engine.kv.gcache.store import PageStore, StoreStats, open_store
from engine.kv.gcache.writer import BackgroundWriter

__all__ = [
    "KIND_NAMES",
    "BackgroundWriter",
    "PageStore",
    "StoreStats",
    "decode_page",
    "encode_page",
    "model_fingerprint",
    "open_store",
    "page_key",
    "page_shape",
]
