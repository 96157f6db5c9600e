"""ModelRunner: one forward of the native model over a scheduled batch, then sampling.

A step may first load prefix pages from host memory (``loads``, issue 12): layer by layer while
the forward runs (``layerwise.py``), or all of them before it (load-then-compute).

Prefill rows inside a request's media spans take the image's embeddings (``Sequence.media``):
only the rows this step computes, so a chunk may take part of an image, and a prefix-cache hit
none of the cached part (equal placeholder ids mean an equal image, hence equal KV).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv.layerwise import LayerwiseLoad, PageCopy, load_pages
from engine.kv.layout import KVLayout
from engine.kv.paged import PagedBatch, SeqPages
from engine.kv.pool import KVPool
from engine.models.mimo_v2 import MiMoV2ForCausalLM
from engine.sampler import (
    SampleOutput,
    Sampler,
    grammar_mask,
    penalty_history,
    position_seed,
)
from engine.scheduler import Scheduled
from engine.sequence import media_rows


class ModelRunner:
    """Runs the model on paged KV; owns the device pool behind the allocator's page ids."""

    def __init__(self, model: MiMoV2ForCausalLM, layout: KVLayout, num_chunks: int) -> None:
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.layout = layout
        self.pool = KVPool(layout, num_chunks, dtype=self.dtype, device=self.device)
        self.sampler = Sampler()

    @torch.inference_mode()
    def run(
        self,
        batch: Sequence[Scheduled],
        pages: Sequence[SeqPages],
        loads: Sequence[PageCopy] = (),
        layerwise: bool = True,
    ) -> SampleOutput | None:
        """Forward every scheduled token; sample for the requests whose last token ran.

        Args:
            loads: host pages to copy into ``self.pool`` before their layers run; every copy
                has finished when ``run`` returns or raises, so their host pages may be reused.
            layerwise: copy layer by layer while the forward runs, else all before it.
        Raises:
            BaseException: a failed copy's error, or the forward's.
        """
        hidden, kv = self.forward(batch, pages, loads, layerwise)
        rows = [row for s, row in zip(batch, kv.last_token_rows()) if s.samples]
        if not rows:
            return None
        sampling = [s.seq for s in batch if s.samples]
        for q in sampling:
            if q.generator is not None:  # NOTE: a seeded draw depends on its position alone
                q.generator.manual_seed(position_seed(q.params.seed, q.num_tokens))
        logits = self.model.compute_logits(hidden[rows])
        allowed = grammar_mask([q.grammar for q in sampling], logits.shape[-1], self.device)
        return self.sampler.sample(logits, [q.params for q in sampling],
                                   [q.generator for q in sampling], allowed,
                                   history=_text_only(penalty_history(sampling),
                                                      logits.shape[-1]))

    @torch.inference_mode()
    def forward(
        self,
        batch: Sequence[Scheduled],
        pages: Sequence[SeqPages],
        loads: Sequence[PageCopy] = (),
        layerwise: bool = True,
    ) -> tuple[torch.Tensor, PagedBatch]:
        """The final hidden states of every scheduled token ([num_tokens, hidden]) and the KV
        context they ran in; a verify step's rows take its drafts (``Sequence.step_token``)."""
        ids: list[int] = []
        for s in batch:
            q, lo = s.seq, s.seq.num_computed
            hi = lo + s.query_len
            if hi <= len(q.prompt_ids):
                ids += q.prompt_ids[lo:hi]
            else:
                ids += [q.step_token(j) for j in range(lo, hi)]
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        embeds = self._media_embeds(batch) if any(s.seq.media for s in batch) else None
        return self._forward(input_ids, pages, loads, layerwise, embeds)

    def _media_embeds(self, batch: Sequence[Scheduled]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the flat batch, their embeddings) for the media rows this step computes;
        None when it computes none (decodes, text chunks, cached images)."""
        rows: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        base = 0
        for s in batch:
            start = s.seq.num_computed
            for m, lo, hi in media_rows(s.seq.media, start, start + s.query_len):
                assert m.embeds is not None, f"{s.seq.request_id}: media without embeddings"
                rows.append(torch.arange(base + lo - start, base + hi - start))
                values.append(m.embeds[lo - m.offset : hi - m.offset])
            base += s.query_len
        if not rows:
            return None
        return torch.cat(rows).to(self.device), torch.cat(values).to(self.device, self.dtype)

    def _forward(
        self,
        input_ids: torch.Tensor,
        pages: Sequence[SeqPages],
        loads: Sequence[PageCopy],
        layerwise: bool,
        embeds: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, PagedBatch]:
        if not loads or not layerwise:
            load_pages(self.pool, loads)  # load-then-compute (nothing to do without loads)
            kv = PagedBatch(self.pool, self.layout, pages)
            return self.model(input_ids, kv.positions(self.device), kv, embeds), kv
        with LayerwiseLoad(self.pool, self.layout, loads, self.device) as load:
            kv = PagedBatch(self.pool, self.layout, pages, wait_layer=load.wait_layer)
            return self.model(input_ids, kv.positions(self.device), kv, embeds), kv


def _text_only(history: list[Sequence[int] | None] | None,
               vocab_size: int) -> list[Sequence[int] | None] | None:
    """``history`` without media placeholder ids (outside the vocabulary): a repetition penalty
    applies to text tokens only."""
    if history is None:
        return None
    return [h if h is None or max(h, default=0) < vocab_size
            else [t for t in h if t < vocab_size] for h in history]
