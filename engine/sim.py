"""The "sim" backend: the real scheduler, pools and prefix cache; the forward is a cost model.

No tensors, so a laptop can replay a production trace against many workers. Step time is

    t = step_overhead_s + prefill_s_per_token * prefill tokens
        + decode_s_per_token * decode tokens + attn_s_per_qk * (query, key) pairs attended

Sampled tokens are a deterministic function of (request id, position), never a stop token, so a
request runs to ``max_new_tokens`` (trace replays set it to the recorded output length).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv.paged import SeqPages
from engine.sampler import SampleOutput
from engine.scheduler import Scheduled


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per step. Defaults: fitted to the native backend on the demo model, CPU, one thread
    (``python loadtest/calibrate_sim.py``: 148 steps, 11% total error, 6% median per step)."""

    step_overhead_s: float = 4.4e-3
    prefill_s_per_token: float = 3.6e-5
    decode_s_per_token: float = 1.31e-4
    attn_s_per_qk: float = 3.0e-7

    def step_time(self, prefill_tokens: int, decode_tokens: int, qk_pairs: int) -> float:
        return (self.step_overhead_s + self.prefill_s_per_token * prefill_tokens
                + self.decode_s_per_token * decode_tokens
                + self.attn_s_per_qk * qk_pairs)


# An H200-class node serving MiMo-V2-Flash (DP 2 x TP 4). Decode: SGLang's day-0 blog reports
# ~150 tok/s per request at 16 requests per DP rank with MTP accept length 3.6 (16k-64k inputs),
# i.e. ~24 ms per step: 20 ms fixed + 0.25 ms per request. Prefill: 20k tok/s per rank is an
# assumption (the blog's prefill figures are only in a chart). SWA keeps attention nearly flat.
H200_COST = CostModel(step_overhead_s=2.0e-2, prefill_s_per_token=5e-5, decode_s_per_token=2.5e-4,
                      attn_s_per_qk=2e-11)
ZERO_COST = CostModel(0.0, 0.0, 0.0, 0.0)
COST_PRESETS = {"cpu": CostModel(), "h200": H200_COST, "zero": ZERO_COST}


class SimRunner:
    """Stands in for ``ModelRunner``; ``clock_s`` is the simulated time spent so far."""

    def __init__(self, vocab_size: int, cost: CostModel | None = None) -> None:
        self.vocab_size = vocab_size
        self.cost = cost or CostModel()
        self.clock_s = 0.0
        self.last_step_s = 0.0

    def run(self, batch: Sequence[Scheduled], pages: Sequence[SeqPages]) -> SampleOutput | None:
        prefill = sum(s.query_len for s in batch if s.query_len > 1)
        decode = sum(s.query_len for s in batch if s.query_len == 1)
        # attention work: every query token attends to the keys before it (quadratic in prefill)
        read = sum(s.query_len * p.seq_len for s, p in zip(batch, pages))
        self.last_step_s = self.cost.step_time(prefill, decode, read)
        self.clock_s += self.last_step_s
        sampling = [s.seq for s in batch if s.samples]
        if not sampling:
            return None
        tokens = [self._token(q.request_id, q.num_tokens, q.stop_ids) for q in sampling]
        return SampleOutput(torch.tensor(tokens), None, [None] * len(tokens))

    def _token(self, request_id: str, position: int, avoid: frozenset[int]) -> int:
        digest = hashlib.blake2b(f"{request_id}:{position}".encode(), digest_size=8).digest()
        token = int.from_bytes(digest, "little") % self.vocab_size
        while token in avoid:
            token = (token + 1) % self.vocab_size
        return token
