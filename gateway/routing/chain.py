"""Page hash chains for routing, computed incrementally: a session's 100k-token history is hashed
once, and each later turn hashes only its new pages.

``PrefixHasher.hashes(token_ids, cache_salt, key)`` returns exactly
``engine.hashing.page_hashes(token_ids, page_size, cache_salt)``. With a ``key`` (a session id, a
prompt-cache key) it remembers, per ``(key, cache_salt)``, the tokens it hashed last time in the
form of a fingerprint and the hashes themselves; when the new tokens extend the remembered ones it
hashes only the pages after them (``prev=`` the last remembered hash).

The fingerprint (checked in O(page_size + num_samples), never O(history)):

* the number of tokens hashed (``n``, a page multiple): the new tokens must be at least as long;
* the first and the last hashed page's tokens, compared in full;
* ``num_samples`` positions in ``[0, n - page_size)``, one drawn at random (per hasher, from
  ``os.urandom``) inside each of ``num_samples`` equal strides, compared by value.

NOTE (what the fingerprint can miss): new tokens that agree with the remembered ones on the first
and last remembered pages and on every sampled position, but differ somewhere else before the
last page. Appending, truncating, or any edit that shifts the tokens after it (an inserted or
deleted token, a compaction) is caught unless the shifted tokens happen to equal the old ones at
every sampled position. A same-length substitution of m tokens in the middle of an old turn (a
timestamp rewritten in place) escapes with probability about ``(1 - m / n) ** num_samples``:
likely for small m. The result is then the old prompt's chain (plus correct hashes for the new
pages chained onto it), and stays so for that key until the fingerprint fails or the key is
dropped. It affects routing only (the router credits a prefix the worker will not match; the
engine hashes the prompt itself, so generation is never wrong). ``verify="full"`` compares the
whole remembered prefix instead (exact, O(n) at C speed).
"""

from __future__ import annotations

import os
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.hashing import page_hashes

DEFAULT_MAX_KEYS = 4096
DEFAULT_NUM_SAMPLES = 32


def routable_hashes(hashes: Sequence[int], num_tokens: int, page_size: int) -> Sequence[int]:
    """The pages a worker could serve from cache for a ``num_tokens`` prompt: all full pages but
    never the last prompt token (the engine always computes it, to sample from its logits).

        tokens   0 ........................ num_tokens - 1
        pages    [p0][p1]...[p(m-1)]         m = (num_tokens - 1) // page_size
    """
    return hashes[: max(0, (num_tokens - 1) // page_size)]


@dataclass(slots=True)
class _Entry:
    num_tokens: int  # tokens hashed: len(hashes) * page_size
    hashes: list[int]
    first_page: list[int]  # tokens [0, page_size)
    last_page: list[int]  # tokens [num_tokens - page_size, num_tokens)
    samples: list[tuple[int, int]]  # (position, token id) in [0, num_tokens - page_size)
    tokens: list[int] | None  # verify="full" only: the whole hashed prefix


class PrefixHasher:
    """Incremental ``page_hashes`` per key (see the module docstring).

    Args:
        page_size: tokens per page (the workers' ``Welcome.page_size``).
        max_keys: keys remembered (least recently used dropped); memory is about
            ``max_keys * (8 * pages + 40 * num_samples)`` bytes plus the hash lists.
        num_samples: sampled positions per fingerprint.
        verify: "sample" (the fingerprint) or "full" (exact, O(n) per call, keeps a copy of the
            tokens: 8 bytes a token).
    """

    def __init__(
        self,
        page_size: int,
        max_keys: int = DEFAULT_MAX_KEYS,
        *,
        num_samples: int = DEFAULT_NUM_SAMPLES,
        verify: str = "sample",
    ) -> None:
        if page_size < 1 or max_keys < 1 or num_samples < 0:
            raise ValueError(f"page_size={page_size}, max_keys={max_keys}, "
                             f"num_samples={num_samples}: must be >= 1, >= 1, >= 0")
        if verify not in ("sample", "full"):
            raise ValueError(f"verify={verify!r}: 'sample' or 'full'")
        self.page_size, self.max_keys = page_size, max_keys
        self.num_samples, self.verify = num_samples, verify
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._rng = random.Random(os.urandom(16))
        self.num_full = 0  # calls that hashed from scratch
        self.num_incremental = 0  # calls that extended a remembered chain

    def hashes(
        self, token_ids: Sequence[int], cache_salt: str | None, key: str | None = None
    ) -> list[int]:
        """``page_hashes(token_ids, page_size, cache_salt)``, incrementally under ``key``.

        The list returned under a key is shared with the hasher's memory: read it, never change
        it (each call that extends a chain returns a new list).

        Raises:
            ValueError: as ``page_hashes`` (bad token ids).
        """
        if key is None:
            self.num_full += 1
            return page_hashes(token_ids, self.page_size, cache_salt)
        ident = (key, cache_salt or "")
        entry = self._entries.get(ident)
        if entry is not None and self._extends(entry, token_ids):
            self._entries.move_to_end(ident)
            self.num_incremental += 1
            if entry.hashes:
                new = page_hashes(token_ids[entry.num_tokens :], self.page_size,
                                  prev=entry.hashes[-1])
            else:
                new = page_hashes(token_ids, self.page_size, cache_salt)
            if not new:
                return entry.hashes  # NOTE: the fingerprint stands as it is
            hashes = entry.hashes + new
        else:
            self.num_full += 1
            hashes = page_hashes(token_ids, self.page_size, cache_salt)
        self._remember(ident, token_ids, hashes)
        return hashes

    def forget(self, key: str, cache_salt: str | None = None) -> None:
        self._entries.pop((key, cache_salt or ""), None)

    def __len__(self) -> int:
        return len(self._entries)

    # ---------------------------------------------------------------- internals

    def _extends(self, entry: _Entry, token_ids: Sequence[int]) -> bool:
        n, p = entry.num_tokens, self.page_size
        if len(token_ids) < n:
            return False
        if entry.tokens is not None:
            return list(token_ids[:n]) == entry.tokens
        if n and (list(token_ids[n - p : n]) != entry.last_page
                  or list(token_ids[:p]) != entry.first_page):
            return False
        return all(token_ids[i] == v for i, v in entry.samples)

    def _remember(
        self, ident: tuple[str, str], token_ids: Sequence[int], hashes: list[int]
    ) -> None:
        p = self.page_size
        n = len(hashes) * p
        tokens = list(map(int, token_ids[:n])) if self.verify == "full" else None
        self._entries[ident] = _Entry(
            n, hashes, list(map(int, token_ids[:p])) if n else [],
            list(map(int, token_ids[n - p : n])) if n else [],
            self._samples(token_ids, n - p), tokens)
        self._entries.move_to_end(ident)
        while len(self._entries) > self.max_keys:
            self._entries.popitem(last=False)

    def _samples(self, token_ids: Sequence[int], limit: int) -> list[tuple[int, int]]:
        """One random position in each of ``num_samples`` strides of ``[0, limit)``."""
        if limit <= 0 or self.num_samples == 0:
            return []
        count = min(self.num_samples, limit)
        bounds = [limit * i // count for i in range(count + 1)]
        positions = (self._rng.randrange(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo)
        return [(i, int(token_ids[i])) for i in positions]
