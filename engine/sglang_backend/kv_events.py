"""SGLang's KV events (``engine.sglang_backend.wire``) re-told as ours (engine.worker.events).

The gateway's router names a page by ``engine.hashing`` over the request's tokens, with OUR page
size P. SGLang's block hashes are other, opaque numbers (and change with its version, its hash
mode and its LoRA namespaces), so nothing can be passed through: the translator re-hashes. It
keeps, per SGLang block hash, our chain state at the end of that block, and extends it with the
tokens of each stored child block. SGLang's page size b must divide P, so our pages end on
SGLang block boundaries and each of our pages is completed by exactly one SGLang block::

    tokens                  t0 t1 | t2 t3 | t4 t5 | t6            b = 2, P = 4
    SGLang blocks           A     | B     | C     | D (b = 1: a short last page)
    our pages               page 0        | page 1 ...

    block   parent   tokens             page
    A       None     (t0 t1)            None
    B       None     (t0 t1 t2 t3)      h0 = page_hash(None, t0..t3, salt_seed(cache_salt))
    C       h0       (t4 t5)            None
    D       h0       (t4 t5 t6)         None: a tail; it never completes a page, children of it
                                        are unmapped (SGLang matches whole pages only)

``parent`` is our hash of the page before the one the block ends in, ``tokens`` that page's
tokens up to the block's end (at most P), ``page`` its hash once the block completes it. A page
is emitted as our ``BlockStored`` when its completing block enters a medium, and as our
``BlockRemoved`` when that block leaves it; a run of new pages of one chain becomes one event.
The hashes equal ``engine.hashing.page_hashes(prompt, P, cache_salt)``, as the router's.

Conservative by construction (a router may under-credit, never credit a page that is gone):

- a block stored under a parent the translator never saw, or forgot, is ``unmapped`` (skipped),
  and so are its descendants: their tokens before the block are unknown.
- the map is bounded by ``max_blocks``; an entry dropped for room is ``evicted``, and its pages
  are reported removed right away, since their removal could no longer be translated.
- LoRA pages (``lora_id`` / ``lora_name``) are skipped: our hashes have no adapter namespace.
- two SGLang blocks may complete the same page of ours (namespaces our hash does not have);
  a page is removed only when the last of them leaves the medium (a reference count).

Media: SGLang's ``GPU`` is our ``MEDIUM_GPU`` (L1), ``CPU_PINNED`` our ``MEDIUM_CPU`` (L2),
``EXTERNAL`` (a shared store such as Mooncake) our ``MEDIUM_GCACHE`` (L3). ``DISK`` (node-local)
has no tier of ours: its events are counted as ``skipped`` and emit nothing, but the blocks are
still tracked, so children stored elsewhere under them keep their chain.

SGLang is SWA-blind: its events never say which pages still hold sliding-window KV. So the
translator NEVER emits ``SwaBlocksStored`` / ``SwaCheckpointStored``, and a router credits no
window-safe hit on an SWA model served by SGLang (full-KV credit only): conservative.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.hashing import page_hash, salt_seed
from engine.sglang_backend.wire import (
    SgAllBlocksCleared,
    SgBlockRemoved,
    SgBlockStored,
    SGLangBatch,
)
from engine.worker.events import (
    MEDIUM_CPU,
    MEDIUM_GCACHE,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

__all__ = ["DEFAULT_MAX_BLOCKS", "MEDIUMS", "EventTranslator", "TranslatorStats"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BLOCKS = 1 << 20
SGLANG_GPU = "GPU"  # SGLang's StorageMedium.GPU, also what a missing medium means
# NOTE: SGLang's StorageMedium values -> our tiers; any other (DISK) is tracked, never emitted
MEDIUMS: dict[str, str] = {
    SGLANG_GPU: MEDIUM_GPU,
    "CPU_PINNED": MEDIUM_CPU,
    "EXTERNAL": MEDIUM_GCACHE,
}


@dataclass(slots=True)
class TranslatorStats:
    stored: int = 0  # SGLang blocks stored (a store into one more medium counts again)
    removed: int = 0  # SGLang blocks removed from a medium they were in
    unmapped: int = 0  # SGLang blocks under a parent never seen or forgotten (descendants too)
    skipped: int = 0  # events: bigram/LoRA/unknown/malformed/bad block size/DISK medium
    evicted: int = 0  # map entries dropped by the max_blocks bound
    pages_stored: int = 0  # our pages announced stored (per medium)
    pages_removed: int = 0  # our pages announced removed (per medium)


class EventTranslator:
    """Turns SGLang KV event batches into ours, one publisher (one SGLang cache) per instance.

    Args:
        page_size: P, the page size our router hashes with.
        max_blocks: bound on the SGLang blocks remembered (oldest stored dropped first).
        sglang_page_size: SGLang's page size b when known (``--page-size`` as SGLang resolved
            it): a block with fewer tokens is a short tail. None: each chain's first block
            says it.

    Not thread-safe; feed batches in publication order.
    """

    def __init__(
        self, page_size: int, *, max_blocks: int = DEFAULT_MAX_BLOCKS,
        sglang_page_size: int | None = None,
    ) -> None:
        if page_size < 1 or max_blocks < 1:
            raise ValueError(f"page_size={page_size}, max_blocks={max_blocks}: must be >= 1")
        if sglang_page_size is not None and (
            sglang_page_size < 1 or page_size % sglang_page_size
        ):
            raise ValueError(f"SGLang page size {sglang_page_size} must divide ours, {page_size}")
        self.page_size = page_size
        self.max_blocks = max_blocks
        self.sglang_page_size = sglang_page_size
        self.stats = TranslatorStats()
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # NOTE: oldest stored first
        self._refs: dict[tuple[int, str], int] = {}  # (our page, our medium) -> SGLang blocks
        self._warned_block_size = False

    @property
    def num_blocks(self) -> int:
        """SGLang blocks remembered."""
        return len(self._blocks)

    def translate(self, batch: SGLangBatch) -> list[KVEvent]:
        """Our events for one SGLang batch, in order (empty when nothing of ours changed)."""
        out = _Output(self.page_size)
        for event in batch.events:
            if isinstance(event, SgBlockStored):
                self._store(event, out)
            elif isinstance(event, SgBlockRemoved):
                self._remove(event, out)
            elif isinstance(event, SgAllBlocksCleared):
                self._clear(out)
            else:
                self.stats.skipped += 1
        return out.events()

    def reset(self) -> list[KVEvent]:
        """Forget everything, e.g. after a batch was lost or could not be decoded (a removal
        in it can no longer be told): the events that make a router forget it too."""
        out = _Output(self.page_size)
        self._clear(out)
        return out.events()

    # ---------------------------------------------------------------- internals

    def _store(self, event: SgBlockStored, out: _Output) -> None:
        b, hashes = event.block_size, event.block_hashes
        if not self._is_usable(event):
            self.stats.skipped += 1
            return
        medium = event.medium or SGLANG_GPU
        if medium not in MEDIUMS:
            self.stats.skipped += 1  # NOTE: still tracked, for children stored elsewhere
        prev = self._start(event)
        for i, h in enumerate(hashes):
            if prev is None or prev.is_tail:
                self.stats.unmapped += len(hashes) - i
                return
            block = self._blocks.get(h)
            if block is None:
                try:
                    block = self._extend(prev, event.token_ids[i * b:(i + 1) * b], b)
                except ValueError as exc:  # NOTE: a token id page_hash refuses
                    logger.warning("skipping an SGLang BlockStored: %s", exc)
                    self.stats.skipped += 1
                    return
                self._insert(h, block, out)
            else:
                self._blocks.move_to_end(h)
            self.stats.stored += 1
            if medium not in block.mediums:
                block.mediums += (medium,)
                self._hold(block, medium, out)
            prev = block

    def _is_usable(self, event: SgBlockStored) -> bool:
        b = event.block_size
        if event.lora_id is not None or event.lora_name is not None:
            return False
        if b < 1 or not event.block_hashes or len(event.token_ids) != b * len(event.block_hashes):
            return False
        chain_b = self._chain_block_size(event)
        if chain_b is None:
            return True  # NOTE: an unknown parent: unmapped, whatever its size
        if b > chain_b:
            return False  # NOTE: longer than its chain's pages: not SGLang's layout
        if self.page_size % chain_b:
            if not self._warned_block_size:
                self._warned_block_size = True
                logger.warning("SGLang page size %d does not divide our page size %d: its KV "
                               "events are skipped", chain_b, self.page_size)
            return False
        return True

    def _chain_block_size(self, event: SgBlockStored) -> int | None:
        """b of the chain ``event`` extends; None when its parent is unknown."""
        if self.sglang_page_size is not None:
            return self.sglang_page_size
        if event.parent_block_hash is None:
            return event.block_size
        parent = self._blocks.get(event.parent_block_hash)
        return None if parent is None else parent.block_size

    def _start(self, event: SgBlockStored) -> _Block | None:
        """The state the event's first block extends: a fresh root, its parent's, or None."""
        if event.parent_block_hash is None:
            return _Block(parent=None, tokens=(), page=None, cache_salt=event.cache_salt,
                          block_size=self.sglang_page_size or event.block_size, is_tail=False)
        return self._blocks.get(event.parent_block_hash)

    def _extend(self, prev: _Block, token_ids: Sequence[int], block_size: int) -> _Block:
        """The state after a block of ``token_ids`` stored as a child of ``prev``."""
        parent: int | None = prev.page
        if parent is not None:
            tokens = tuple(token_ids)
        else:
            parent, tokens = prev.parent, prev.tokens + tuple(token_ids)
        is_tail = block_size < prev.block_size
        # NOTE: b | P and every non-tail block adds b tokens, so a window never overshoots P
        assert len(tokens) <= self.page_size, (len(tokens), self.page_size)
        page = None
        if len(tokens) == self.page_size and not is_tail:
            seed = salt_seed(prev.cache_salt) if parent is None else 0
            page = page_hash(parent, tokens, seed)
        return _Block(parent=parent, tokens=tokens, page=page, cache_salt=prev.cache_salt,
                      block_size=prev.block_size, is_tail=is_tail)

    def _insert(self, h: int, block: _Block, out: _Output) -> None:
        self._blocks[h] = block
        while len(self._blocks) > self.max_blocks:
            _, old = self._blocks.popitem(last=False)
            for medium in old.mediums:
                self._release(old, medium, out)
            self.stats.evicted += 1

    def _remove(self, event: SgBlockRemoved, out: _Output) -> None:
        medium = event.medium or SGLANG_GPU
        if medium not in MEDIUMS:
            self.stats.skipped += 1  # NOTE: still applied, as the store was tracked
        for h in event.block_hashes:
            block = self._blocks.get(h)
            if block is None or medium not in block.mediums:
                continue
            self.stats.removed += 1
            block.mediums = tuple(m for m in block.mediums if m != medium)
            self._release(block, medium, out)
            if not block.mediums:
                del self._blocks[h]

    def _clear(self, out: _Output) -> None:
        self._blocks.clear()
        self._refs.clear()
        out.cleared()

    def _hold(self, block: _Block, medium: str, out: _Output) -> None:
        ours = MEDIUMS.get(medium)
        if ours is None or block.page is None:
            return
        key = (block.page, ours)
        count = self._refs.get(key, 0)
        self._refs[key] = count + 1
        if count == 0:
            self.stats.pages_stored += 1
            out.stored(block.page, block.parent, block.tokens, ours, block.cache_salt)

    def _release(self, block: _Block, medium: str, out: _Output) -> None:
        ours = MEDIUMS.get(medium)
        if ours is None or block.page is None:
            return
        key = (block.page, ours)
        count = self._refs.pop(key, 0) - 1
        if count > 0:
            self._refs[key] = count
        else:
            self.stats.pages_removed += 1
            out.removed(block.page, ours)


@dataclass(slots=True)
class _Block:
    """Our chain state at the end of one SGLang block (see the module docstring's table)."""

    parent: int | None  # our hash of the page before the one this block ends in
    tokens: tuple[int, ...]  # that page's tokens, from its start to this block's end
    page: int | None  # its hash, when this block completes it
    cache_salt: str | None
    block_size: int  # b of the chain
    is_tail: bool  # a short page: it ends its chain
    mediums: tuple[str, ...] = ()  # SGLang media it is stored in


@dataclass(slots=True)
class _Run:
    """Our pages of one chain, one medium, stored (``parent`` set) or removed, being merged."""

    medium: str
    hashes: list[int]
    token_ids: list[int]
    parent: int | None = None
    cache_salt: str | None = None
    is_store: bool = True


class _Output:
    """Our events of one batch, in order; consecutive pages of one chain (stores) or of one
    medium (removals) merge into one event."""

    def __init__(self, page_size: int) -> None:
        self._page_size = page_size
        self._items: list[_Run | AllBlocksCleared] = []

    def stored(self, page: int, parent: int | None, tokens: Sequence[int], medium: str,
               cache_salt: str | None) -> None:
        last = self._items[-1] if self._items else None
        if (isinstance(last, _Run) and last.is_store and last.medium == medium
                and last.cache_salt == cache_salt and last.hashes[-1] == parent):
            last.hashes.append(page)
            last.token_ids.extend(tokens)
            return
        self._items.append(_Run(medium=medium, hashes=[page], token_ids=list(tokens),
                                parent=parent, cache_salt=cache_salt))

    def removed(self, page: int, medium: str) -> None:
        last = self._items[-1] if self._items else None
        if isinstance(last, _Run) and not last.is_store and last.medium == medium:
            last.hashes.append(page)
            return
        self._items.append(_Run(medium=medium, hashes=[page], token_ids=[], is_store=False))

    def cleared(self) -> None:
        self._items.append(AllBlocksCleared())

    def events(self) -> list[KVEvent]:
        return [self._event(item) for item in self._items]

    def _event(self, item: _Run | AllBlocksCleared) -> KVEvent:
        if isinstance(item, AllBlocksCleared):
            return item
        if not item.is_store:
            return BlockRemoved(block_hashes=item.hashes, medium=item.medium)
        return BlockStored(block_hashes=item.hashes, parent_block_hash=item.parent,
                           token_ids=item.token_ids, block_size=self._page_size,
                           medium=item.medium, cache_salt=item.cache_salt)
