"""The "sim" backend: the real scheduler, pools and prefix cache; the forward is a cost model.

No tensors, so a laptop can replay a production trace against many workers. Step time comes from
``engine.cost.CostModel`` (re-exported here with its presets).

Sampled tokens are a deterministic function of (request id, position), never a stop token, so a
request runs to ``max_new_tokens`` (trace replays set it to the recorded output length); with a
``seed``, of (seed, prompt, position) instead, so the same seed and prompt give the same tokens. A
request with a grammar draws the same way among the tokens its grammar allows, EOS included, so
its output matches the grammar and ends when the grammar can.

The sim's "model" has the same logit (0) for every token it may draw. A request with a
``logit_bias`` samples from those logits plus its bias through the real sampler's filters
(temperature, top-k, top-p, min-p; greedy picks among the top ties), with the same deterministic
draw. ``repetition_penalty`` scales a logit of 0 to 0, so it changes nothing here.

MTP (issue 14): with ``EngineConfig.speculative_tokens`` the engine drafts placeholder tokens, the
cost model prices the drafts and the verify rows, and each draft is accepted with probability
``CostModel.mtp_acceptance``; the tokens emitted are the same draws as without MTP (a function of
the position), so only the pace and the number of steps change.

Media (issue 13): the engine validates a request's media spans as for the native backend and
keeps no embeddings (``Engine.needs_media_embeds`` is False: a sim worker fetches none); the
placeholder ids count as prompt ids (page hashes, the seeded draw) like any other.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from engine.cost import COST_PRESETS, H200_COST, ZERO_COST, CostModel
from engine.kv.paged import SeqPages
from engine.sampler import SampleOutput, apply_logit_bias, filtered_probs
from engine.scheduler import Scheduled
from engine.sequence import Sequence as SeqState

__all__ = ["COST_PRESETS", "H200_COST", "ZERO_COST", "CostModel", "SimRunner"]


_MAX_PROMPT_DIGESTS = 4096


class SimRunner:
    """Stands in for ``ModelRunner``; ``clock_s`` is the simulated time spent so far."""

    def __init__(self, vocab_size: int, cost: CostModel | None = None) -> None:
        self.vocab_size = vocab_size
        self.cost = cost or CostModel()
        self.speculative_tokens = 0  # K: the engine's MTP drafts per decode step (engine.spec)
        self.clock_s = 0.0
        self.last_step_s = 0.0
        # NOTE: seeded requests' prompt digests (hashing the prompt every step would cost O(len))
        self._prompt_digests: OrderedDict[str, str] = OrderedDict()

    def run(self, batch: Sequence[Scheduled], pages: Sequence[SeqPages],
            loads: Sequence[object] = ()) -> SampleOutput | None:
        """``loads``: the native runner's host pages to copy; none on the sim (no KV bytes)."""
        self.advance_clock(batch, pages)
        sampling = [s.seq for s in batch if s.samples]
        if not sampling:
            return None
        return self.sample(sampling)

    def sample(self, sampling: Sequence[SeqState]) -> SampleOutput:
        """Each request's token at its next position (``num_tokens``), without a clock tick."""
        # NOTE: a grammar's allowed ids are computed once per row (a bitmask per call)
        allowed = [
            q.grammar.allowed(self.vocab_size).nonzero()[0] if q.grammar is not None else None
            for q in sampling
        ]
        tokens = [self._token(q, ids) for q, ids in zip(sampling, allowed)]
        if all(q.params.logprobs is None for q in sampling):
            return SampleOutput(_int64_tensor(tokens), None, [None] * len(tokens))
        # NOTE: the sim's "model" is uniform over the tokens it may draw from (all but the stop
        # ids, or what the grammar allows), so every choice has the same logprob.
        logprobs = torch.tensor(
            [-math.log(self._num_choices(q, ids)) for q, ids in zip(sampling, allowed)]
        )
        top = [
            self._top(q, ids, t, float(lp))
            for q, ids, t, lp in zip(sampling, allowed, tokens, logprobs)
        ]
        return SampleOutput(_int64_tensor(tokens), logprobs, top)

    def advance_clock(self, batch: Sequence[Scheduled], pages: Sequence[SeqPages]) -> None:
        """Price one step with the cost model: ``last_step_s``, and ``clock_s`` moves by it.
        Only ``seq_len`` of each request's pages is read."""
        # NOTE: a verify step (a decode with MTP drafts) prices its rows as decode tokens
        if self.speculative_tokens:
            decode = sum(s.query_len for s in batch if s.query_len == 1 or s.num_drafts)
            drafted = self.speculative_tokens * sum(1 for s in batch if s.samples)
        else:
            decode, drafted = sum(1 for s in batch if s.query_len == 1), 0
        prefill = sum(s.query_len for s in batch) - decode
        # attention work: every query token attends to the keys before it (quadratic in prefill)
        read = sum(s.query_len * p.seq_len for s, p in zip(batch, pages))
        self.last_step_s = self.cost.step_time(prefill, decode, read, drafted)
        self.clock_s += self.last_step_s

    def accepts(self, seq: SeqState) -> bool:
        """Whether the draft at the request's next position is accepted: probability
        ``cost.mtp_acceptance``, a deterministic draw of (request id, position)."""
        return _uniform64(f"accept:{seq.request_id}:{seq.num_tokens}") / 2**64 < (
            self.cost.mtp_acceptance)

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
        return _uniform64(key)

    def _prompt_digest(self, seq: SeqState) -> str:
        digest = self._prompt_digests.get(seq.request_id)
        if digest is None:
            # NOTE: a resumed request's earlier output is not its prompt (SamplingParams)
            prompt = seq.prompt_ids[:len(seq.prompt_ids) - seq.params.resumed_tokens]
            data = np.asarray(prompt, dtype=np.int64).tobytes()
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


def _int64_tensor(values: list[int]) -> torch.Tensor:
    """``torch.tensor(values)`` (int64 [B]); NOTE: through an array's buffer, ~5x cheaper for a
    step's tokens (the tensor keeps the array alive)."""
    if not values:
        return torch.tensor(values)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def _uniform64(key: str) -> int:
    """A uniform 64-bit draw, a function of ``key`` alone."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
