"""Offline API: ``LLM(model_dir).generate(prompts, SamplingParams)`` on token ids.

Runs the same engine as the worker (paged two-pool KV, prefix cache, continuous batching with
chunked prefill), stepping it until every request is done.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.engine import Engine, _validate_prompt
from engine.kv import ContiguousBatch, SequenceKV
from engine.sampling_params import SamplingParams
from engine.sequence import Media
from engine.sequence import Sequence as SeqState

_ids = itertools.count()

MediaInput = tuple[int, torch.Tensor]  # (offset in the prompt, embeddings [length, hidden])


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One finished request.

    ``token_ids`` includes the stop token when the request stopped on one (``finish_reason``
    "stop"); "length" means ``max_new_tokens`` was reached.
    """

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    cached_tokens: int = 0  # prompt tokens served by the prefix cache
    cached_tokens_host: int = 0  # of which the host tier (L2) served
    cached_tokens_storage: int = 0  # of which came from L3 (GCache)


class LLM:
    """A MiMo-V2 model loaded for offline generation on the paged engine.

    Args:
        model_dir: config.json + *.safetensors (+ optional generation_config.json).
        dtype: "float32", "bfloat16", "float16" or "auto" (the config's torch_dtype).
        device: "cpu", "cuda", ...; default CUDA when available.
        **engine_kwargs: ``EngineConfig`` fields (page_size, kv_budget_bytes,
            enable_prefix_cache, max_num_batched_tokens, max_running_requests).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "auto",
        device: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self.model_dir = Path(model_dir)
        cfg = EngineConfig(model_path=str(model_dir), dtype=dtype, device=device, **engine_kwargs)
        self.engine = Engine(cfg)
        self.config = self.engine.model_config
        self.model = self.engine.model
        self.device = next(self.model.parameters()).device
        self.eos_token_ids = self.engine.eos_token_ids

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        media: Sequence[Sequence[MediaInput]] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (lists of token ids); outputs come in prompt order.

        Args:
            media: per prompt, its images as ``(offset, embeddings)``, sorted by offset: the
                prompt's ids ``[offset, offset + len(embeddings))`` are media placeholder ids
                (``engine.protocol.MEDIA_ID_BASE`` and up) whose rows take the embeddings
                ([length, hidden_size]) instead of token embeddings.

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, a media span that is
                out of order, outside the prompt, not over placeholder ids or of the wrong
                shape, a prompt plus ``max_new_tokens`` longer than the model's context, or a
                params or media list whose length differs from the prompts'.
        """
        if params is None or isinstance(params, SamplingParams):
            plist = [params or SamplingParams()] * len(prompts)
        else:
            plist = list(params)
            if len(plist) != len(prompts):
                raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        mlist = [()] * len(prompts) if media is None else list(media)
        if len(mlist) != len(prompts):
            raise ValueError(f"got {len(mlist)} media lists for {len(prompts)} prompts")
        seqs = [self.engine.make_sequence(f"offline-{next(_ids)}", list(p), sp,
                                          media=_as_media(m))
                for p, sp, m in zip(prompts, plist, mlist)]
        for seq in seqs:
            self.engine.add(seq, bounded=False)  # offline: no queue bound
        while self.engine.has_work:
            if self.engine.only_fetching:
                time.sleep(0.001)  # NOTE: L3 prefetches in flight, nothing else to run
            self.engine.step()
            self.engine.tick()
        return [_to_output(seq) for seq in seqs]

    def close(self) -> None:
        """Stop the engine's L3 threads (after writing what is queued)."""
        self.engine.close()

    @torch.inference_mode()
    def prompt_logits(self, token_ids: Sequence[int],
                      media: Sequence[MediaInput] = ()) -> torch.Tensor:
        """Logits for every position of one prompt, [len, vocab] float32 (a single prefill on the
        contiguous reference KV, independent of the paged engine); ``media`` as in
        ``generate``."""
        items = self.engine.prepare_media(_as_media(media))
        _validate_prompt(list(token_ids), 0, self.config, [(m.offset, m.length) for m in items])
        batch = ContiguousBatch([SequenceKV(self.config.num_hidden_layers)], [len(token_ids)])
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        embeds = None
        if items:
            rows = torch.cat([torch.arange(m.offset, m.end) for m in items]).to(self.device)
            embeds = rows, torch.cat([m.embeds for m in items])  # type: ignore[misc]
        hidden = self.model(ids, batch.positions(self.device), batch, embeds)
        return self.model.compute_logits(hidden)


def _as_media(items: Sequence[MediaInput]) -> tuple[Media, ...]:
    return tuple(Media(int(offset), len(embeds), embeds) for offset, embeds in items)


def _to_output(seq: SeqState) -> RequestOutput:
    want = seq.params.logprobs
    return RequestOutput(
        prompt_token_ids=seq.prompt_ids,
        token_ids=tuple(seq.output_ids),
        finish_reason=seq.finish_reason or "length",
        logprobs=tuple(seq.logprobs) if want is not None else None,
        top_logprobs=tuple(seq.top_logprobs) if want else None,
        cached_tokens=seq.num_cached,
        cached_tokens_host=seq.num_cached_host,
        cached_tokens_storage=seq.num_cached_storage,
    )
