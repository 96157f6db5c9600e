"""MTP speculative decoding: draft K tokens with the checkpoint's MTP layers, verify them in the
base model's next forward, commit what it accepts (issue 14).

One step of a request with drafts d_1..d_K after its last token t_m (position m):

    base forward   rows m .. m+K, tokens [t_m, d_1 .. d_K]   (one batch with everything else)
    verify         row j draws x_j from the base model's distribution, exactly as a step
                   without MTP would (same grammar state, penalties and per-position seed);
                   d_{j+1} is accepted iff x_j == d_{j+1}; emitted: x_0 .. x_e-1 (e <= K + 1)
    commit         e tokens of base KV (positions m .. m+e-1); the rest is left to be
                   overwritten (the pages stay reserved, nothing reaches the prefix cache)
    draft          MTP layer k runs rows F+1-ish .. F+k (F = m + e, the last known token) and
                   its last row drafts d'_{k+1}; the next step verifies them

Drafts are greedy (the draft distribution q is a point mass), for which rejection sampling
(accept d with probability min(1, p(d) / q(d)) = p(d), else draw from the residual
max(0, p - q), i.e. p without d, renormalized) is the same law as "draw x ~ p, accept iff
x == d", which is what ``verify`` does: every emitted token is drawn from the base model's
distribution at its position, with the same generator state as without MTP. So greedy output
is identical with MTP on and off, a seeded request draws the same tokens, grammar masks and
penalties apply at verification, and logprobs are the base model's.

MTP layer k (0-based) stores its KV at slot s = the position of the token it embeds:

    row at slot s   inputs  embed(token[s]), h_{k-1}[s - 1]   (h_{-1}: the base model's final
                                                              hidden state, h_k: layer k's
                                                              pre-norm output)
                    output  logits of token[s + 1]; rope position s - 1 - k (SGLang's p)

so slot s depends on tokens <= s only, and an MTP layer's KV lives in the same SWA pages as the
base model's SWA layers (layer ids num_hidden_layers + k): the prefix cache, L2 and L3 keep it
under the same window rules. Rows whose slot is known (<= F) are final; the draft rows above F
are recomputed by the next step (from its own frontier), which is the MTP rollback.

SWA-aware MTP prefill ("window", the default): the first drafts after a prompt of P tokens need
layer K-1's keys at slots >= P - W and its input, layer K-2's output, exact from there; that
output needs layer K-2's keys from P - 2W - 1, and so on: layer k computes rows from

    start_k = P - W - (K - 1 - k) * (W + 1)

(at least k + 1, its first slot) and never reads keys below start_k. The drafts are exactly those
of a "full" MTP prefill (every slot), at O(K^2 W) rows instead of O(K P).

A prefix-cache hit of h tokens costs no MTP recompute. Every cached page whose MTP KV its writer
computed exactly is marked (``Node.mtp``), and a page whose end the MTP layers had passed exactly
also keeps their continuation state there: [h_base, h_0 .. h_{K-2}] at its last slot (K x hidden
values per page, outside the KV budget). A hit whose last page has that state, with every page of
its window marked, continues from it: rows from slot h on, the cached window's MTP keys read as
they are, drafts exactly those of a run without the hit. Otherwise (a page another request wrote
inexactly, one loaded from L2 or L3 as a new node) the MTP layers start cold after the hit (slot
h + 1 + k, nothing below read): still no recompute, drafts that see keys from the hit on only.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.kv.layout import PageKind
from engine.kv.paged import PagedBatch, SeqPages

if TYPE_CHECKING:
    from engine.kv.layout import KVLayout
    from engine.kv.pool import KVPool
    from engine.models.mimo_v2 import MiMoV2ForCausalLM
    from engine.sequence import Sequence


# NOTE: a request's MTP rows in a decode step (accepted + K at most) attend batched as decode
# rows (``SeqPages.rows``); a prefill's many rows take the per-sequence path
_ROWS_AS_DECODES = 16


@dataclass(slots=True)
class MTPState:
    """One request's MTP progress since its admission.

    Attributes:
        start: per layer k, the first slot it computes; keys below it are never read.
        carry: per layer k >= 1, h_{k-1} at the slot before its next row ([hidden]), saved
            by the step that computed it; None where no row needs it.
        rows: MTP rows computed (for tests and benchmarks).
    """

    start: list[int]
    carry: list[torch.Tensor | None]
    rows: int = 0
    # the first slot from which every MTP layer's KV and output are those of a from-scratch
    # chain: page ends from here on get their continuation state (``Node.mtp``)
    exact_from: int = 0
    # the first slot from which every MTP layer's KV is: pages from here on are marked exact
    kv_exact_from: int = 0
    # the first step continues a cache hit's state (rows from the hit's first slot)
    resume: bool = False


def mtp_starts(num_layers: int, window: int, num_computed: int, num_tokens: int,
               full: bool = False) -> list[int]:
    """``MTPState.start`` for a request admitted with ``num_computed`` tokens cached of
    ``num_tokens`` (see the module docstring)."""
    out = []
    for k in range(num_layers):
        lo = k + 1 if num_computed == 0 else num_computed + 1 + k
        need = 0 if full else num_tokens - window - (num_layers - 1 - k) * (window + 1)
        out.append(max(lo, need))
    return out


@dataclass(slots=True)
class DraftJob:
    """One request's part of a step, for the MTP layers.

    Attributes:
        seq: the request (its tokens already include what the step emitted).
        pages: its pages this step (path + pending: the step's reservation covers the MTP rows).
        hidden: the base model's final hidden states of the step's rows, positions
            ``first .. first + len(hidden) - 1``.
        first: the step's first position (``num_computed`` before it).
        known: F, the last position whose token is known and whose base input row ran
            (first + committed tokens).
        draft: whether to draft (the request sampled and goes on).
        num_tokens: the request's tokens before the step emitted any (the prompt's length at
            its first step: where the MTP layers start).
    """

    seq: Sequence
    pages: SeqPages
    hidden: torch.Tensor
    first: int
    known: int
    draft: bool
    num_tokens: int
    drafts: list[int] = field(default_factory=list)


class Drafter:
    """Runs the MTP layers over a step's requests (see the module docstring)."""

    def __init__(self, model: MiMoV2ForCausalLM, pool: KVPool, layout: KVLayout,
                 full_prefill: bool = False) -> None:
        assert model.mtp is not None, "the model was loaded without MTP layers"
        self.model, self.mtp = model, model.mtp
        self.pool, self.layout = pool, layout
        self.full_prefill = full_prefill
        self.device = next(model.parameters()).device
        self.num_layers: int = self.mtp.num_layers

    def state(self, job: DraftJob) -> MTPState:
        """The request's state, made at its first step after an admission: from the cache
        hit's continuation state when its last page has one and every page in its window was
        written exact (``Node.mtp``), else from ``mtp_starts``."""
        seq = job.seq
        if seq.mtp is None:
            n, w = self.num_layers, self.layout.window
            resumed = self._resumed(seq, job.first)
            if resumed is not None:
                seq.mtp = MTPState([k + 1 for k in range(n)], list(resumed.unbind(0)),
                                   exact_from=job.first, kv_exact_from=job.first, resume=True)
            else:
                starts = mtp_starts(n, w, job.first, job.num_tokens, self.full_prefill)
                exact = max(k + 1 if s == k + 1 else s + w for k, s in enumerate(starts))
                seq.mtp = MTPState(starts, [None] * n, exact_from=exact,
                                   kv_exact_from=0 if exact == n else max(starts))
        assert isinstance(seq.mtp, MTPState)
        st = seq.mtp
        if seq.mtp_taint:  # NOTE: all is exact again once K windows passed it
            clean = seq.mtp_taint + self.num_layers * (self.layout.window + 1)
            st.exact_from = max(st.exact_from, clean)
            st.kv_exact_from = max(st.kv_exact_from, clean)
        return st

    def _resumed(self, seq: Sequence, first: int) -> torch.Tensor | None:
        """The continuation state at a cache hit of ``first`` tokens, or None."""
        p = self.layout.page_size
        if first == 0 or len(seq.path) * p != first:
            return None
        window = -(-(self.layout.window + 1) // p)  # NOTE: pages holding keys first - W - 1 on
        nodes = seq.path[-window:]
        carry = nodes[-1].mtp
        if not isinstance(carry, torch.Tensor) or any(n.mtp is None for n in nodes):
            return None
        return carry

    @torch.inference_mode()
    def run(self, jobs: Seq[DraftJob]) -> None:
        """Compute every job's MTP rows and fill ``job.drafts`` (K tokens where ``job.draft``)."""
        states = [self.state(j) for j in jobs]
        # per job: the previous layer's outputs (first slot, rows); layer 0 reads the base
        prev: list[tuple[int, torch.Tensor]] = [(j.first, j.hidden) for j in jobs]
        embed = self.model.model.embed_tokens
        vocab = embed.num_embeddings
        carries: list[tuple[int, int, torch.Tensor]] = []
        outs: list[list[tuple[int, torch.Tensor]]] = [[] for _ in jobs]  # per job, per layer
        for k in range(self.num_layers):
            plan: list[tuple[int, int, int]] = []  # (job index, first slot, last slot)
            inputs, tokens, pages = [], [], []
            for i, (job, st) in enumerate(zip(jobs, states)):
                lo = job.first if st.resume else max(job.first + 1, st.start[k])
                hi = job.known + (k if job.draft else 0)
                if lo > hi or (job.draft and len(job.drafts) < k):
                    continue
                h = self._inputs(k, lo, hi, prev[i], st)
                if h is None:
                    continue
                plan.append((i, lo, hi))
                inputs.append(h)
                tokens += [self._token(job, s) for s in range(lo, hi + 1)]
                p = job.pages
                pages.append(SeqPages(p.full_pages, p.swa_pages, num_cached=lo,
                                      query_len=hi - lo + 1, min_pos=st.start[k],
                                      rows=hi - lo < _ROWS_AS_DECODES))
            if not plan:
                prev = [(0, jobs[i].hidden[:0]) for i in range(len(jobs))]
                continue
            ids = torch.tensor(tokens, dtype=torch.long, device=self.device).clamp_(max=vocab - 1)
            kv = PagedBatch(self.pool, self.layout, pages, kinds=(PageKind.SWA,))
            # NOTE: rope at SGLang's positions (the hidden state's, s - 1 - k); attention is
            # relative, the KV slots are s
            positions = kv.positions(self.device) - (1 + k)
            out = self.mtp(k, embed(ids), torch.cat(inputs), positions, kv)
            ends = torch.tensor([hi - lo for _, lo, hi in plan]).cumsum(0) + torch.arange(
                len(plan))
            drafting = [r for r, (i, _, _) in enumerate(plan) if jobs[i].draft]
            if drafting:
                rows = ends[drafting].to(self.device)
                picks = self.model.compute_logits(out.hidden[rows]).argmax(-1).tolist()
                for r, token in zip(drafting, picks):
                    jobs[plan[r][0]].drafts.append(int(token))
            new_prev = [(0, jobs[i].hidden[:0]) for i in range(len(jobs))]
            offset = 0
            for i, lo, hi in plan:
                rows = out.residual[offset : offset + hi - lo + 1]
                offset += hi - lo + 1
                new_prev[i] = (lo, rows)
                outs[i].append((lo, rows))
                states[i].rows += hi - lo + 1
                if k + 1 < self.num_layers and lo <= jobs[i].known <= hi:
                    # NOTE: the next step's layer k + 1 starts at known + 1 (set after the last
                    # layer: this step's layer k + 1 still reads the old one)
                    carries.append((i, k + 1, rows[jobs[i].known - lo].clone()))
            prev = new_prev
        for job, st, layers in zip(jobs, states, outs):
            self._page_states(job, st, layers)
        for i, k, h in carries:
            states[i].carry[k] = h
        for st in states:
            st.resume = False
        for job in jobs:
            if job.draft and len(job.drafts) < self.num_layers:
                job.drafts.clear()  # NOTE: a layer had no input (cannot happen after a prefill)

    def _page_states(self, job: DraftJob, st: MTPState,
                     layers: list[tuple[int, torch.Tensor]]) -> None:
        """Record the continuation state (h_base, h_0 .. h_{K-2} at its last slot) of every
        page this step completed where the MTP layers are exact (``Node.mtp``)."""
        p, n = self.layout.page_size, self.num_layers
        first_end = -(-(job.first + 1) // p) * p - 1  # NOTE: the first slot e >= first, p | e + 1
        for end in range(first_end, job.known, p):
            if end - p + 1 >= st.kv_exact_from and end < st.exact_from:
                job.seq.mtp_pages[end // p] = True  # NOTE: exact KV, no continuation state
        if len(layers) < n:
            return
        lo = max(job.first, st.exact_from)
        for end in range(-(-(lo + 1) // p) * p - 1, job.known, p):
            rows = [job.hidden[end - job.first]]
            for k in range(n - 1):
                first, out = layers[k]
                if end >= first:
                    rows.append(out[end - first])
                elif end == first - 1 and st.carry[k + 1] is not None:
                    rows.append(st.carry[k + 1])  # type: ignore[arg-type]
                else:
                    break
            if len(rows) == n:
                job.seq.mtp_pages[end // p] = torch.stack(rows)

    @staticmethod
    def _token(job: DraftJob, slot: int) -> int:
        seq = job.seq
        return seq.token(slot) if slot < seq.num_tokens else job.drafts[slot - seq.num_tokens]

    @staticmethod
    def _inputs(k: int, lo: int, hi: int, prev: tuple[int, torch.Tensor],
                st: MTPState) -> torch.Tensor | None:
        """h_{k-1} at slots lo - 1 .. hi - 1: the previous layer's rows of this step, the first
        one from the carry when that layer's rows start at lo; None when missing."""
        first, rows = prev
        need_last = hi - 1 - first
        if need_last >= rows.shape[0]:
            return None
        if lo - 1 >= first:
            return rows[lo - 1 - first : need_last + 1]
        if lo - 1 != first - 1 or st.carry[k] is None:
            return None
        return torch.cat([st.carry[k][None], rows[: need_last + 1]])  # type: ignore[index]
