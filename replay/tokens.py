"""Deterministic prompt token ids for trace replays, and their page hashes.

A Mooncake block id names a block of ``block_size`` tokens and, prefix-chained, everything before
it. Block ``b`` becomes ``block_size`` pseudo-random ids, a splitmix64 of ``b * block_size +
position`` (the same ids as ``loadtest/mooncake.py``'s ``block_tokens``), so equal block ids give
equal tokens and so equal page hashes, in every process and every run.

A turn that continues its parent (``prefix_from_parent``) is the parent's prompt, the parent's
actual generated ids, then its own new blocks; its page hashes extend the parent's chain, so a
100k-token history is hashed once, not once per turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.hashing import page_hashes

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def block_token_ids(block_ids: Sequence[int], block_size: int, vocab_size: int) -> np.ndarray:
    """``len(block_ids) * block_size`` token ids in ``[0, vocab_size)``, block after block."""
    if not len(block_ids):
        return np.zeros(0, dtype=np.int64)
    b = np.asarray(block_ids, dtype=np.uint64)[:, None]
    x = (b * np.uint64(block_size) + np.arange(block_size, dtype=np.uint64) + _GOLDEN).ravel()
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(vocab_size)).astype(np.int64)


@dataclass(slots=True)
class Prompt:
    """A built prompt: its token ids and the hashes of its full pages (``engine.hashing``)."""

    ids: np.ndarray
    hashes: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.ids)


class PromptBuilder:
    """Builds prompts from block ids, alone or continuing a parent turn.

    Args:
        page_size: the engines' page size (hashes are per page).
        block_size: tokens per trace block.
        vocab_size: ids are drawn in ``[0, vocab_size)``.
    """

    def __init__(self, page_size: int, block_size: int, vocab_size: int) -> None:
        self.page_size, self.block_size, self.vocab_size = page_size, block_size, vocab_size

    def fresh(self, block_ids: Sequence[int], num_tokens: int) -> Prompt:
        """The blocks' ids cut to ``num_tokens`` (at least one token)."""
        ids = self._blocks(block_ids, max(1, num_tokens))
        return Prompt(ids, page_hashes(ids, self.page_size))

    def continued(self, parent: Prompt, output_ids: Sequence[int], block_ids: Sequence[int],
                  num_new_tokens: int) -> Prompt:
        """``parent.ids + output_ids + new``; the new blocks' ids cut to ``num_new_tokens``.

        Only the pages from the parent's last full page on are hashed (chained to it).
        """
        new = self._blocks(block_ids, max(0, num_new_tokens))
        ids = np.concatenate([parent.ids, np.asarray(output_ids, dtype=np.int64), new])
        if len(ids) == 0:
            ids = self._blocks(block_ids or (0,), 1)
        kept = min(len(parent.hashes), len(ids) // self.page_size)
        prev = parent.hashes[kept - 1] if kept else None
        tail = page_hashes(ids[kept * self.page_size:], self.page_size, prev=prev)
        return Prompt(ids, parent.hashes[:kept] + tail)

    def _blocks(self, block_ids: Sequence[int], num_tokens: int) -> np.ndarray:
        ids = block_token_ids(block_ids, self.block_size, self.vocab_size)
        if len(ids) < num_tokens:
            # NOTE: a record with fewer blocks than its length says: pad with ids of further
            # (never shared) blocks keyed past the record's last id
            last = int(block_ids[-1]) if len(block_ids) else 0
            more = -(-(num_tokens - len(ids)) // self.block_size)
            extra = [2**40 + last * 64 + i for i in range(more)]
            ids = np.concatenate([ids, block_token_ids(extra, self.block_size, self.vocab_size)])
        return ids[:num_tokens]
