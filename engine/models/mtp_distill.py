"""Distil a checkpoint's MTP layers from its own base model, so a random demo model drafts well.

The base model writes its own text: random prompts, then greedy continuations for half the
sequences and samples at temperature 1 for the other half (seeded). One base forward over that
text gives the final hidden states h and the next-token log-probabilities at every position.
MTP layer k (module docstring of ``engine.models.mtp``) is then trained on rows p = 0 .. T-2-k:

    inputs  hidden  h[p] (k = 0) or layer k-1's residual at row p (trained before it)
            embeds  embed(token[p+1+k])
            rope    p; attention causal within a sequence, sliding window W, sinks
    target  the base's distribution at position p+1+k (that of token[p+2+k]), by KL divergence

Adam, one layer after the other, on minibatches of sequences; the embedding and the LM head are
the base model's and stay frozen. Deterministic: seeded generators and one torch thread.
``DistillResult.agreement`` is the acceptance proxy: on held-out greedy text, how often layer
k's argmax equals the base's argmax at the same position (teacher-forced: true tokens as inputs).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.layers.attention import AttentionSpec, attention_with_sinks, visible_mask
from engine.models.loader import load_model, safetensors_files
from engine.models.mimo_v2 import MiMoV2ForCausalLM
from engine.models.mtp import MTPHead, mtp_config_of


class DistillResult(NamedTuple):
    agreement: tuple[float, ...]  # per MTP layer: top-1 agreement with the base, held out
    untrained_agreement: tuple[float, ...]  # the same before training
    seconds: float


class Text(NamedTuple):
    """Base-generated sequences with the base model's view of them."""

    tokens: torch.Tensor  # [B, T] long
    hidden: torch.Tensor  # [B, T, hidden], the base model's final (normed) hidden states
    logprobs: torch.Tensor  # [B, T, vocab], its next-token log-probabilities


def distill_mtp(
    model: MiMoV2ForCausalLM | str | Path,
    *,
    steps: int = 100,
    seed: int = 0,
    num_seqs: int = 128,
    prompt_len: int = 32,
    new_tokens: int = 64,
    batch_seqs: int = 16,
    lr: float = 5e-3,
) -> DistillResult:
    """Train ``model.mtp`` in place to predict the base model (``steps`` Adam steps per layer).

    Given a checkpoint directory, loads it (fp32, every declared MTP layer) and writes the
    trained MTP tensors back into its safetensors files (split layout only).

    Raises:
        ValueError: the model has no MTP layers.
    """
    start = time.perf_counter()
    model_dir = None if isinstance(model, MiMoV2ForCausalLM) else Path(model)
    if model_dir is not None:
        num_mtp = mtp_config_of(json.loads((model_dir / "config.json").read_text()))
        model = load_model(model_dir, dtype="float32", mtp_layers=num_mtp)
    assert isinstance(model, MiMoV2ForCausalLM)
    if model.mtp is None:
        raise ValueError("the model has no MTP layers (load it with mtp_layers=n)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed)
        train = base_text(model, num_seqs, prompt_len, new_tokens, gen, greedy_seqs=num_seqs // 2)
        held_out = base_text(model, 32, prompt_len, new_tokens, gen, greedy_seqs=32)
        before = mtp_agreement(model, held_out)
        _train(model, model.mtp, train, steps, batch_seqs, lr, gen)
        after = mtp_agreement(model, held_out)
    finally:
        torch.set_num_threads(threads)
    if model_dir is not None:
        save_mtp(model, model_dir)
    return DistillResult(after, before, time.perf_counter() - start)


@torch.no_grad()
def base_text(
    model: MiMoV2ForCausalLM,
    num_seqs: int,
    prompt_len: int,
    new_tokens: int,
    gen: torch.Generator,
    *,
    greedy_seqs: int,
) -> Text:
    """``num_seqs`` random prompts continued by the base model (the first ``greedy_seqs``
    greedily, the rest sampled at temperature 1), with its hidden states and log-probs."""
    vocab = model.config.vocab_size
    prompts = torch.randint(1, min(vocab, 256), (num_seqs, prompt_len), generator=gen)
    kv = DenseKV(num_seqs)
    tokens = [prompts]
    logits = _last_logits(model, prompts, 0, kv)
    greedy = torch.arange(num_seqs) < greedy_seqs
    for step in range(new_tokens):
        sampled = torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]
        nxt = torch.where(greedy, logits.argmax(-1), sampled)[:, None]
        tokens.append(nxt)
        if step + 1 < new_tokens:
            logits = _last_logits(model, nxt, prompt_len + step, kv)
    ids = torch.cat(tokens, dim=1)
    hidden = _base_hidden(model, ids)
    logprobs = model.compute_logits(hidden).log_softmax(-1)
    return Text(ids, hidden, logprobs)


@torch.no_grad()
def mtp_agreement(model: MiMoV2ForCausalLM, text: Text) -> tuple[float, ...]:
    """Per MTP layer, the fraction of rows whose argmax is the base model's (module docstring)."""
    assert model.mtp is not None
    out = []
    hidden = text.hidden
    for k in range(model.mtp.num_layers):
        rows = text.tokens.shape[1] - 1 - k
        logits, hidden = _mtp_rows(model, model.mtp, k, text.tokens, hidden[:, :rows])
        want = text.logprobs[:, 1 + k :].argmax(-1)
        out.append((logits.argmax(-1) == want).float().mean().item())
    return tuple(out)


def save_mtp(model: MiMoV2ForCausalLM, model_dir: str | Path) -> None:
    """Overwrite the ``model.mtp.layers.{i}.*`` tensors in ``model_dir``'s files with
    ``model.mtp``'s (each in its stored dtype).

    Raises:
        ValueError: the checkpoint stores MTP tensors another way (fp8, fused qkv) or not at all.
    """
    assert model.mtp is not None
    params = {n: p.detach() for n, p in model.mtp.named_parameters(prefix="model.mtp")}
    done: set[str] = set()
    for path in safetensors_files(Path(model_dir)):
        tensors = load_file(path)
        hits = [n for n in tensors if n in params]
        for name in hits:
            stored = tensors[name]
            if stored.dtype.itemsize < 2 or stored.shape != params[name].shape:
                raise ValueError(f"{path}: {name!r} is not stored plainly; cannot rewrite it")
            tensors[name] = params[name].to(stored.dtype).contiguous()
        if hits:
            save_file(tensors, str(path), metadata={"format": "pt"})
            done.update(hits)
    missing = sorted(set(params) - done)
    if missing:
        raise ValueError(f"{model_dir}: no tensor {missing[0]!r} (and {len(missing) - 1} more)")


class DenseKV:
    """``KVContext`` for B sequences of equal length run together, their rows sequence-major.

    Every call appends each sequence's n new keys per layer (nothing is evicted: for short texts)
    and attends its n queries, at positions ``kept .. kept + n - 1``, causally with the layer's
    window and sinks. Differentiable, so it also serves MTP training.
    """

    def __init__(self, num_seqs: int) -> None:
        self.num_seqs = num_seqs
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor:
        b = self.num_seqs
        n = q.shape[0] // b
        q, k, v = q.view(b, n, *q.shape[1:]), k.view(b, n, *k.shape[1:]), v.view(b, n, *v.shape[1:])
        if spec.layer_id in self.k:
            k = torch.cat([self.k[spec.layer_id], k], dim=1)
            v = torch.cat([self.v[spec.layer_id], v], dim=1)
        self.k[spec.layer_id], self.v[spec.layer_id] = k, v
        total = k.shape[1]
        visible = visible_mask(torch.arange(total - n, total), torch.arange(total), spec.window)
        out = attention_with_sinks(q, k, v, visible, spec.scale, spec.sinks)
        return out.reshape(b * n, *out.shape[2:])


def _train(
    model: MiMoV2ForCausalLM,
    mtp: MTPHead,
    text: Text,
    steps: int,
    batch_seqs: int,
    lr: float,
    gen: torch.Generator,
) -> None:
    hidden = text.hidden
    for k in range(mtp.num_layers):
        rows = text.tokens.shape[1] - 1 - k
        hidden = hidden[:, :rows]
        target = text.logprobs[:, 1 + k :]
        layer = mtp.layers[k].requires_grad_(True)
        opt = torch.optim.Adam(layer.parameters(), lr=lr)
        for _ in range(steps):
            idx = torch.randperm(text.tokens.shape[0], generator=gen)[:batch_seqs]
            logits, _ = _mtp_rows(model, mtp, k, text.tokens[idx], hidden[idx])
            loss = F.kl_div(
                logits.log_softmax(-1).flatten(0, 1),
                target[idx].flatten(0, 1),
                log_target=True,
                reduction="batchmean",
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
        layer.requires_grad_(False)
        with torch.no_grad():
            _, hidden = _mtp_rows(model, mtp, k, text.tokens, hidden)


def _mtp_rows(
    model: MiMoV2ForCausalLM, mtp: MTPHead, k: int, tokens: torch.Tensor, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer k over every sequence's rows 0 .. R-1 (``hidden``: [B, R, hidden] its inputs):
    returns (logits [B, R, vocab], residual [B, R, hidden])."""
    b, rows = hidden.shape[:2]
    embeds = model.model.embed_tokens(tokens[:, 1 + k : 1 + k + rows])
    positions = torch.arange(rows).repeat(b)
    out = mtp(k, embeds.flatten(0, 1), hidden.flatten(0, 1), positions, DenseKV(b))
    logits = model.lm_head(out.hidden).float()
    return logits.view(b, rows, -1), out.residual.view(b, rows, -1)


def _last_logits(
    model: MiMoV2ForCausalLM, ids: torch.Tensor, first: int, kv: DenseKV
) -> torch.Tensor:
    b, n = ids.shape
    positions = torch.arange(first, first + n).repeat(b)
    hidden = model(ids.flatten(), positions, kv).view(b, n, -1)
    return model.compute_logits(hidden[:, -1])


def _base_hidden(model: MiMoV2ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    b, n = ids.shape
    return model(ids.flatten(), torch.arange(n).repeat(b), DenseKV(b)).view(b, n, -1)
