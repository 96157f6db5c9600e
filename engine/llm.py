"""Offline API: ``LLM(model_dir).generate(prompts, SamplingParams)`` on token ids.

All prompts are prefilled in one forward (laid out back to back), then every unfinished request
decodes one token per step in one batched forward until it stops.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.kv import ContiguousBatch, SequenceKV
from engine.model_config import ModelConfig
from engine.models.loader import load_model
from engine.sampler import Sampler, make_generator
from engine.sampling_params import SamplingParams


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


@dataclass(slots=True)
class _Request:
    prompt: tuple[int, ...]
    params: SamplingParams
    generator: torch.Generator | None
    kv: SequenceKV
    stop_ids: frozenset[int]
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    finish_reason: str | None = None


class LLM:
    """A MiMo-V2 model loaded for offline generation.

    Args:
        model_dir: config.json + *.safetensors (+ optional generation_config.json).
        dtype: "float32", "bfloat16", "float16" or "auto" (the config's torch_dtype).
        device: "cpu", "cuda", ...; default CUDA when available.
    """

    def __init__(
        self, model_dir: str | Path, *, dtype: str | torch.dtype = "auto", device: str | None = None
    ) -> None:
        self.model_dir = Path(model_dir)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.config = ModelConfig.from_dir(self.model_dir)
        self.model = load_model(self.model_dir, dtype=dtype, device=self.device)
        self.eos_token_ids = _eos_ids(self.model_dir, self.config)
        self.sampler = Sampler()

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (lists of token ids); outputs come in prompt order.

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, a prompt plus
                ``max_new_tokens`` longer than the model's context, or a params list whose
                length differs from the prompts'.
        """
        reqs = self._make_requests(prompts, params)
        active = list(reqs)
        query = [list(r.prompt) for r in active]
        while active:
            token_ids = self._step(active, query)
            for req, token_id in zip(active, token_ids):
                self._append(req, token_id)
            active = [r for r in active if r.finish_reason is None]
            query = [[r.out[-1]] for r in active]
        return [_to_output(r) for r in reqs]

    @torch.inference_mode()
    def prompt_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits for every position of one prompt, [len, vocab] float32 (a single prefill)."""
        self._validate_prompt(token_ids, 0)
        batch = ContiguousBatch([SequenceKV(self.config.num_hidden_layers)], [len(token_ids)])
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        return self.model.compute_logits(self.model(ids, batch.positions(self.device), batch))

    def _step(self, active: list[_Request], query: list[list[int]]) -> list[int]:
        batch = ContiguousBatch([r.kv for r in active], [len(q) for q in query])
        ids = torch.tensor([t for q in query for t in q], dtype=torch.long, device=self.device)
        hidden = self.model(ids, batch.positions(self.device), batch)
        batch.commit()
        logits = self.model.compute_logits(hidden[batch.last_token_rows()])
        sampled = self.sampler.sample(
            logits, [r.params for r in active], [r.generator for r in active]
        )
        for i, req in enumerate(active):
            if sampled.logprobs is not None and req.params.logprobs is not None:
                req.logprobs.append(float(sampled.logprobs[i]))
                top = sampled.top_logprobs[i]
                if req.params.logprobs > 0 and top is not None:
                    req.top_logprobs.append(tuple(top))
        return sampled.token_ids.tolist()

    def _append(self, req: _Request, token_id: int) -> None:
        req.out.append(token_id)
        if token_id in req.stop_ids:
            req.finish_reason = "stop"
        elif len(req.out) >= req.params.max_new_tokens:
            req.finish_reason = "length"

    def _make_requests(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[_Request]:
        if params is None or isinstance(params, SamplingParams):
            plist = [params or SamplingParams()] * len(prompts)
        else:
            plist = list(params)
            if len(plist) != len(prompts):
                raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        reqs = []
        for prompt, p in zip(prompts, plist):
            self._validate_prompt(prompt, p.max_new_tokens)
            stop = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            reqs.append(
                _Request(
                    prompt=tuple(int(t) for t in prompt),
                    params=p,
                    generator=make_generator(p.seed, self.device),
                    kv=SequenceKV(self.config.num_hidden_layers),
                    stop_ids=frozenset(stop),
                )
            )
        return reqs

    def _validate_prompt(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        if len(prompt) == 0:
            raise ValueError("prompt is empty: give at least one token id")
        vocab = self.config.vocab_size
        bad = [t for t in prompt if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        limit = self.config.max_position_embeddings
        if len(prompt) + max_new_tokens > limit:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} exceeds the "
                f"model's context of {limit} tokens"
            )


def _eos_ids(model_dir: Path, cfg: ModelConfig) -> tuple[int, ...]:
    ids = list(cfg.eos_token_ids)
    gen_cfg = model_dir / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return tuple(dict.fromkeys(ids))


def _to_output(req: _Request) -> RequestOutput:
    want = req.params.logprobs
    return RequestOutput(
        prompt_token_ids=req.prompt,
        token_ids=tuple(req.out),
        finish_reason=req.finish_reason or "length",
        logprobs=tuple(req.logprobs) if want is not None else None,
        top_logprobs=tuple(req.top_logprobs) if want else None,
    )
