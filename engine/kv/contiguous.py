"""Contiguous per-request KV: the simplest ``KVContext`` backend (offline ``LLM``, tests).

Full-attention layers keep every token. SWA layers keep only what the next query can see:

    positions   0 ............ seq_len-W-1 | seq_len-W ...... seq_len-1 | seq_len (next query)
    SWA kept                   (dropped)   |<-------- W tokens ------->|
    full kept   |<------------------------ seq_len tokens ------------>|

so a running request holds O(W) SWA KV (the paged backend does the same at page granularity).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.layers.attention import AttentionSpec, attention_with_sinks, visible_mask


class SequenceKV:
    """One request's cached K/V per layer, plus the position of the first kept token."""

    def __init__(self, num_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.start: list[int] = [0] * num_layers
        self.num_tokens = 0  # tokens whose KV has been computed

    def kept_tokens(self, layer_id: int) -> int:
        k = self.k[layer_id]
        return 0 if k is None else k.shape[0]


class ContiguousBatch:
    """``KVContext`` for one forward over several requests laid out back to back.

    Request i contributes ``query_lens[i]`` tokens at positions
    ``seqs[i].num_tokens .. seqs[i].num_tokens + query_lens[i] - 1``. Call ``commit()`` after the
    forward to advance every request by its query length.
    """

    def __init__(self, seqs: Sequence[SequenceKV], query_lens: Sequence[int]) -> None:
        assert len(seqs) == len(query_lens) and all(n > 0 for n in query_lens)
        self.seqs, self.query_lens = list(seqs), list(query_lens)
        self._offsets = [0]
        for n in query_lens:
            self._offsets.append(self._offsets[-1] + n)

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        parts = [
            torch.arange(s.num_tokens, s.num_tokens + n) for s, n in zip(self.seqs, self.query_lens)
        ]
        return torch.cat(parts).to(device)

    def last_token_rows(self) -> list[int]:
        return [end - 1 for end in self._offsets[1:]]

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor:
        outs = []
        for seq, lo, hi in zip(self.seqs, self._offsets[:-1], self._offsets[1:]):
            outs.append(self._attend_one(seq, q[lo:hi], k[lo:hi], v[lo:hi], spec))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def commit(self) -> None:
        for seq, n in zip(self.seqs, self.query_lens):
            seq.num_tokens += n

    def _attend_one(
        self,
        seq: SequenceKV,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        i = spec.layer_id
        old_k, old_v = seq.k[i], seq.v[i]
        keys = k if old_k is None else torch.cat([old_k, k])
        values = v if old_v is None else torch.cat([old_v, v])
        end = seq.num_tokens + q.shape[0]
        k_pos = torch.arange(end - keys.shape[0], end, device=q.device)
        q_pos = torch.arange(seq.num_tokens, end, device=q.device)
        out = attention_with_sinks(
            q, keys, values, visible_mask(q_pos, k_pos, spec.window), spec.scale, spec.sinks
        )
        if spec.window is not None and keys.shape[0] > spec.window:
            keys, values = keys[-spec.window :], values[-spec.window :]
        seq.k[i], seq.v[i], seq.start[i] = keys, values, end - keys.shape[0]
        return out
