"""Mooncake FAST'25 traces (../shared/traces): records, deterministic tokens, page hashes.

A record's ``hash_ids`` name 512-token blocks, prefix-chained (an equal id means an equal block
and an equal prefix). Block b becomes 512 pseudo-random token ids seeded by b; the last block is
cut to ``input_length``. Page hashes are ``engine.hashing.page_hashes`` of those tokens, memoized
per block (valid because an id fixes its whole prefix).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.hashing import page_hashes
from replay.tokens import block_token_ids

BLOCK_TOKENS = 512
TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


@dataclass(frozen=True, slots=True)
class Record:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load(name: str, limit: int | None = None) -> list[Record]:
    path = Path(name) if Path(name).is_file() else TRACES / f"{name}_trace.jsonl"
    out = []
    with path.open() as f:
        for line in f:
            r = json.loads(line)
            out.append(Record(r["timestamp"], r["input_length"], r["output_length"],
                              tuple(r["hash_ids"])))
            if limit is not None and len(out) >= limit:
                break
    return out


def block_tokens(block_id: int, vocab_size: int) -> np.ndarray:
    """512 deterministic token ids for one block id (splitmix64 of id and position); the one
    definition is ``replay.tokens.block_token_ids``, which ``agentgate replay`` uses too."""
    return block_token_ids([block_id], BLOCK_TOKENS, vocab_size)


class TokenSource:
    """Tokens and page hashes of records, with the per-block page hashes memoized."""

    def __init__(self, vocab_size: int, page_size: int) -> None:
        assert BLOCK_TOKENS % page_size == 0
        self.vocab_size, self.page_size = vocab_size, page_size
        self._block_hashes: dict[int, list[int]] = {}

    def tokens(self, rec: Record) -> list[int]:
        parts = [block_tokens(b, self.vocab_size) for b in rec.hash_ids]
        return np.concatenate(parts)[: rec.input_length].tolist()

    def hashes(self, rec: Record) -> list[int]:
        out: list[int] = []
        for b in rec.hash_ids:
            if b not in self._block_hashes:
                prev = out[-1] if out else None
                toks = block_tokens(b, self.vocab_size)
                self._block_hashes[b] = page_hashes(toks.tolist(), self.page_size, prev=prev)
            out += self._block_hashes[b]
        return out[: rec.input_length // self.page_size]


def iter_with_tokens(records: list[Record], src: TokenSource) -> Iterator[tuple[Record, list[int],
                                                                                 list[int]]]:
    for rec in records:
        yield rec, src.tokens(rec), src.hashes(rec)
