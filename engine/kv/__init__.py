"""KV memory behind the ``KVContext`` interface the model attends through."""

from engine.kv.allocator import OutOfPages, PageAllocator
from engine.kv.contiguous import ContiguousBatch, SequenceKV
from engine.kv.layout import KVLayout, PageKind, num_pages, swa_first_needed_page
from engine.kv.paged import PagedBatch, SeqPages
from engine.kv.pool import KVPool

__all__ = [
    "ContiguousBatch",
    "KVLayout",
    "KVPool",
    "OutOfPages",
    "PageAllocator",
    "PageKind",
    "PagedBatch",
    "SeqPages",
    "SequenceKV",
    "num_pages",
    "swa_first_needed_page",
]
