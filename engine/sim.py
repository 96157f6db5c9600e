"""The "sim" backend: the real scheduler, pools and prefix cache; the forward is a cost model.

No tensors, so a laptop can replay a production trace against many workers. Step time is

    t = step_overhead_s + prefill_s_per_token * prefill tokens
        + decode_s_per_token * decode tokens + attn_s_per_qk * (query, key) pairs attended

Sampled tokens are a deterministic function of (request id, position), never a stop token, so a
request runs to ``max_new_tokens`` (trace replays set it to the recorded output length); with a
``seed``, of (seed, prompt, position) instead, so the same seed and prompt give the same tokens. A
request with a grammar draws the same way among the tokens its grammar allows, EOS included, so
its output matches the grammar and ends when the grammar can.

The sim's "model" has the same logit (0) for every token it may draw. A request with a
``logit_bias`` samples from those logits plus its bias through the real sampler's filters
(temperature, top-k, top-p, min-p; greedy picks among the top ties), with the same deterministic
draw. ``repetition_penalty`` scales a logit of 0 to 0, so it changes nothing here.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.kv.paged import SeqPages
from engine.sampler import SampleOutput, apply_logit_bias, filtered_probs
from engine.scheduler import Scheduled
from engine.sequence import Sequence as SeqState


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
_MAX_PROMPT_DIGESTS = 4096


class SimRunner:
    """Stands in for ``ModelRunner``; ``clock_s`` is the simulated time spent so far."""

    def __init__(self, vocab_size: int, cost: CostModel | None = None) -> None:
        self.vocab_size = vocab_size
        self.cost = cost or CostModel()
        self.clock_s = 0.0
        self.last_step_s = 0.0
        # NOTE: seeded requests' prompt digests (hashing the prompt every step would cost O(len))
        self._prompt_digests: OrderedDict[str, str] = OrderedDict()

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
        # NOTE: a grammar's allowed ids are computed once per row (a bitmask per call)
        allowed = [
            q.grammar.allowed(self.vocab_size).nonzero()[0] if q.grammar is not None else None
            for q in sampling
        ]
        tokens = [self._token(q, ids) for q, ids in zip(sampling, allowed)]
        if all(q.params.logprobs is None for q in sampling):
            return SampleOutput(torch.tensor(tokens), None, [None] * len(tokens))
        # NOTE: the sim's "model" is uniform over the tokens it may draw from (all but the stop
        # ids, or what the grammar allows), so every choice has the same logprob.
        logprobs = torch.tensor(
            [-math.log(self._num_choices(q, ids)) for q, ids in zip(sampling, allowed)]
        )
        top = [
            self._top(q, ids, t, float(lp))
            for q, ids, t, lp in zip(sampling, allowed, tokens, logprobs)
        ]
        return SampleOutput(torch.tensor(tokens), logprobs, top)

    def _num_choices(self, seq: SeqState, allowed: np.ndarray | None) -> int:
        if allowed is not None:
            return max(1, len(allowed))
        return self.vocab_size - len(seq.stop_ids)

    def _top(
        self, seq: SeqState, allowed: np.ndarray | None, token: int, logprob: float
    ) -> list[tuple[int, float]] | None:
        """The sampled token, then the lowest other ids it could have drawn (all tie)."""
        n = seq.params.logprobs
        if n is None or n == 0:
            return None if n is None else []
        if allowed is not None:
            choices = (int(t) for t in allowed)
        else:
            choices = (t for t in range(self.vocab_size) if t not in seq.stop_ids)
        others = itertools.islice((t for t in choices if t != token), n - 1)
        return [(token, logprob), *((t, logprob) for t in others)]

    def _token(self, seq: SeqState, allowed: np.ndarray | None) -> int:
        draw = self._draw(seq)
        if seq.params.logit_bias:
            return self._biased_token(seq, allowed, draw)
        if allowed is not None:
            return int(allowed[draw % len(allowed)])
        token = draw % self.vocab_size
        while token in seq.stop_ids:
            token = (token + 1) % self.vocab_size
        return token

    def _draw(self, seq: SeqState) -> int:
        """A uniform 64-bit draw for the request's next position."""
        if seq.params.seed is None:
            key = f"{seq.request_id}:{seq.num_tokens}"
        else:
            key = f"seed={seq.params.seed}:{self._prompt_digest(seq)}:{seq.num_tokens}"
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")

    def _prompt_digest(self, seq: SeqState) -> str:
        digest = self._prompt_digests.get(seq.request_id)
        if digest is None:
            data = np.asarray(seq.prompt_ids, dtype=np.int64).tobytes()
            digest = hashlib.blake2b(data, digest_size=16).hexdigest()
            self._prompt_digests[seq.request_id] = digest
            if len(self._prompt_digests) > _MAX_PROMPT_DIGESTS:
                self._prompt_digests.popitem(last=False)
        return digest

    def _biased_token(self, seq: SeqState, allowed: np.ndarray | None, draw: int) -> int:
        """Draw from logits 0 (-inf for stop ids and what the grammar forbids) plus the bias."""
        logits = torch.zeros(1, self.vocab_size)
        if allowed is not None:
            logits.fill_(-math.inf)
            logits[0, torch.from_numpy(allowed)] = 0.0
        if seq.stop_ids:
            logits[0, sorted(t for t in seq.stop_ids if t < self.vocab_size)] = -math.inf
        logits = apply_logit_bias(logits, [seq.params])
        if seq.params.is_greedy:
            top = (logits[0] == logits[0].max()).nonzero().flatten()
            return int(top[draw % len(top)])
        cum = filtered_probs(logits, [seq.params])[0].double().cumsum(0)
        target = torch.tensor([draw / 2**64 * float(cum[-1])], dtype=torch.float64)
        return min(int(torch.searchsorted(cum, target, right=True)), self.vocab_size - 1)
