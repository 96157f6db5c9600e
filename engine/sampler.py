"""Next-token sampling for a batch: greedy argmax, or temperature, top-k, top-p and min-p filtering
followed by an exponential race whose noise comes from each request's own generator when seeded.

Before either, every row's logits go through its grammar mask (-inf), then ``logit_bias`` (added),
then ``repetition_penalty`` (CTRL, as vLLM and transformers: a token seen in the prompt or the
output has its logit divided by the penalty when positive, multiplied when negative). A row that
uses neither is left bit-identical.

Order for non-greedy rows: top-k -> logits / temperature -> top-p -> min-p -> softmax ->
argmax(probs / Exp(1) noise). (SGLang divides first; dividing by T > 0 keeps the order of the
logits, except that float32 can underflow two distinct tiny logits into a tie, which would let a
token below the k-th one through, so top-k looks at the raw logits.) min-p compares each token
with the top token, a ratio that the earlier masks never change, so its place in the order only
matters relative to top-p, which measures mass on the top-k-renormalized distribution.

Logprobs are those of the raw logits (before bias, penalty, temperature and filtering), like
vLLM's default (``raw_logprobs``), with one exception: a row under a grammar (``allowed``)
reports the logprobs of its masked logits (tokens the grammar forbids are -inf, the rest
renormalized), as vLLM does with structured output. Unconstrained rows in the same batch are
untouched, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.grammar import GrammarMatcher

_NEG_INF = float("-inf")


class _HasTokens(Protocol):
    @property
    def params(self) -> SamplingParams: ...

    @property
    def token_ids(self) -> list[int]: ...


class SampleOutput(NamedTuple):
    """One sampling step for B rows.

    Attributes:
        token_ids: int64 [B].
        logprobs: float32 [B], log-softmax of the raw logits (masked ones for a row under a
            grammar) at ``token_ids``; None when no row asked for logprobs (when one did, every
            row gets its value).
        top_logprobs: per row, the top-N ``(token_id, logprob)`` of the same distribution,
            highest first, without -inf entries; None for a row with ``logprobs=None``, ``[]``
            for ``logprobs=0``.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    """Stateless: everything a step needs comes in through ``sample``'s arguments."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        allowed: torch.Tensor | None = None,
        history: Sequence[Sequence[int] | None] | None = None,
    ) -> SampleOutput:
        """Pick one token per row.

        Args:
            logits: [B, V], any float dtype; the math runs in float32.
            params: one per row.
            generators: one per row, on ``logits.device``; None draws from torch's default RNG.
                A seeded row's draw depends only on its generator and its own logits.
            allowed: bool [B, V] on ``logits.device``, False for tokens a row's grammar forbids
                (set to -inf before everything else); None: no row is constrained.
            history: per row, the token ids so far (prompt + output) that ``repetition_penalty``
                looks at (``penalty_history``); None (or a None row): nothing to penalize.

        Raises:
            ValueError: if logits is not 2-D or the lengths of params/generators are not B.
        """
        _check_batch(logits, params, generators)
        logits = logits.float()
        if allowed is not None:
            logits = logits.masked_fill(~allowed, _NEG_INF)
        token_ids = sample_tokens(processed_logits(logits, params, history), params, generators)
        if all(p.logprobs is None for p in params):
            return SampleOutput(token_ids, None, [None] * len(params))
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
        return SampleOutput(token_ids, chosen, top_logprobs(logprobs, [p.logprobs for p in params]))


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draw for the token at ``position`` (its prompt + output
    so far): splitmix64 of the two, a function of them alone. So a request whose output so far
    is appended to its prompt (a stream resumed on another worker) draws what it would have."""
    x = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1  # NOTE: 63 bits, as torch's manual_seed takes


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator for one request's noise, or None (share the default RNG) when seed is None."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def penalty_history(seqs: Sequence[_HasTokens]) -> list[Sequence[int] | None] | None:
    """The ``history`` argument of ``Sampler.sample`` for requests (``engine.sequence.Sequence``):
    their prompt + output ids where a repetition penalty needs them; None when none does."""
    if all(q.params.repetition_penalty == 1.0 for q in seqs):
        return None
    return [q.token_ids if q.params.repetition_penalty != 1.0 else None for q in seqs]


def processed_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    history: Sequence[Sequence[int] | None] | None = None,
) -> torch.Tensor:
    """float32 [B, V]: ``logit_bias`` added, then ``repetition_penalty`` applied (rows that use
    neither are returned unchanged; ``logits`` itself is never written)."""
    if any(p.logit_bias for p in params):
        logits = apply_logit_bias(logits, params)
    if history is not None and any(p.repetition_penalty != 1.0 for p in params):
        logits = apply_repetition_penalty(logits, params, history)
    return logits


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """A copy of ``logits`` with each row's ``logit_bias`` added (a token listed twice: the last
    bias counts, as in a JSON object). Ids must be < V (the engine checks them on admission)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        bias = dict(p.logit_bias)
        rows += [row] * len(bias)
        cols += bias.keys()
        values += bias.values()
    out = logits.clone()
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    out.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device),
                   accumulate=True)
    return out


def apply_repetition_penalty(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    history: Sequence[Sequence[int] | None],
) -> torch.Tensor:
    """CTRL's penalty: per row, each token id in its history has its logit divided by the row's
    ``repetition_penalty`` when positive, multiplied when negative (-inf stays -inf).

    Args:
        logits: [B, V] float.
        history: per row, token ids (repeats allowed) < V; None: the row is unchanged.
    """
    seen = torch.zeros_like(logits, dtype=torch.bool)
    for row, (p, ids) in enumerate(zip(params, history)):
        if ids and p.repetition_penalty != 1.0:
            seen[row, torch.as_tensor(ids, device=logits.device)] = True
    penalty = _row_tensor([p.repetition_penalty for p in params], logits.device)[:, None]
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def grammar_mask(
    grammars: Sequence[GrammarMatcher | None], vocab_size: int, device: torch.device | str
) -> torch.Tensor | None:
    """bool [B, vocab_size]: each row's allowed next tokens (all True for a row without a
    grammar); None when no row has one, so an unconstrained batch pays nothing."""
    if all(g is None for g in grammars):
        return None
    rows = [np.ones(vocab_size, dtype=bool) if g is None else g.allowed(vocab_size)
            for g in grammars]
    return torch.from_numpy(np.stack(rows)).to(device)


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """int64 [B]: argmax for greedy rows, a filtered random draw for the others."""
    token_ids = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not rows:
        return token_ids
    index = torch.tensor(rows, device=logits.device)
    probs = filtered_probs(logits[index], [params[i] for i in rows])
    token_ids[index] = exponential_race(probs, [generators[i] for i in rows])
    return token_ids


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """float32 [B, V]: softmax of the logits after temperature, top-k, top-p and min-p.

    NOTE: a filter a row does not use leaves that row bit-identical, so skipping a filter that no
    row uses cannot change a seeded row's draw with the batch composition.
    """
    device, vocab_size = logits.device, logits.shape[-1]
    if any(p.top_k is not None for p in params):
        k = [min(p.top_k or vocab_size, vocab_size) for p in params]
        logits = apply_top_k(logits, torch.tensor(k, device=device))
    logits = logits / _row_tensor([p.temperature for p in params], device)[:, None]
    if any(p.top_p < 1 for p in params):
        logits = apply_top_p(logits, _row_tensor([p.top_p for p in params], device))
    if any(p.min_p > 0 for p in params):
        logits = apply_min_p(logits, _row_tensor([p.min_p for p in params], device))
    return logits.softmax(dim=-1)


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit below its row's k-th largest; ties with the k-th largest all stay.

    Args:
        logits: [B, V] float.
        k: int64 [B], each in [1, V]; k == V leaves the row unchanged.
    """
    top = logits.topk(int(k.max()), dim=-1).values  # [B, max k], descending
    kth_largest = top.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth_largest, _NEG_INF)


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the smallest set of most likely tokens whose probability reaches p.

    A token stays when the mass of the tokens ranked above it is < p, so the top token always
    stays. Ties rank the lower index first (stable sort).

    Args:
        logits: [B, V] float.
        p: float32 [B], each in (0, 1]; p == 1 leaves the row unchanged (no rounding in the
            cumulative sum can drop a tail token).
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    mass_above = F.pad(cum_probs[:, :-1], (1, 0))  # [B, V]; mass_above[:, 0] == 0
    keep_sorted = (mass_above < p[:, None]) | (p[:, None] >= 1)
    keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return logits.masked_fill(~keep, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token whose probability is below min_p times its row's top probability.

    Works in log space, p_i / p_max = exp(l_i - l_max), so no softmax is needed.

    Args:
        logits: [B, V] float.
        min_p: float32 [B], each in [0, 1]; 0 leaves the row unchanged (log 0 = -inf).
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]
    return logits.masked_fill(logits < threshold, _NEG_INF)


def exponential_race(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """int64 [B]: token i of each row with probability probs[row, i].

    argmax_i(probs_i / q_i) with q_i ~ Exp(1) i.i.d. is an exact categorical draw (the Gumbel-max
    trick in disguise); a token with probability 0 can never win. A row with a generator draws its
    V noise values from it alone; the other rows share torch's default RNG.
    """
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    # NOTE: a draw of exactly 0 would make 0 / 0 = NaN for a masked token, and argmax picks NaN.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def top_logprobs(
    logprobs: torch.Tensor, nums: Sequence[int | None]
) -> list[list[tuple[int, float]] | None]:
    """Per row, the ``nums[row]`` highest ``(token_id, logprob)`` pairs, highest first.

    Tokens with probability 0 (-inf: forbidden by a grammar) are left out, so a constrained row
    may get fewer than ``nums[row]``; -inf is no JSON number, and no alternative.

    Args:
        logprobs: float32 [B, V] log-probabilities.
        nums: per row, how many alternatives (None: the row gets None).
    """
    max_num = min(max((n for n in nums if n is not None), default=0), logprobs.shape[-1])
    values, ids = logprobs.topk(max_num, dim=-1)
    value_rows, id_rows = values.tolist(), ids.tolist()
    return [
        None if n is None
        else [(t, v) for t, v in zip(id_rows[row][:n], value_rows[row][:n]) if v != _NEG_INF]
        for row, n in enumerate(nums)
    ]


def _row_tensor(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _check_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits.shape={tuple(logits.shape)}: must be [batch, vocab]")
    batch_size = logits.shape[0]
    if len(params) != batch_size or len(generators) != batch_size:
        raise ValueError(
            f"len(params)={len(params)}, len(generators)={len(generators)}: "
            f"must both equal the batch size {batch_size}"
        )
