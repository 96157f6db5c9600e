"""CUDA smoke: the same model on the GPU agrees with the CPU run (skipped without CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams


@pytest.mark.gpu
@torch.inference_mode()
def test_cuda_matches_cpu(tiny_model_dir: Path) -> None:
    cpu = LLM(tiny_model_dir, dtype="float32", device="cpu")
    gpu = LLM(tiny_model_dir, dtype="float32", device="cuda")
    prompt = list(range(1, 30))
    err = (gpu.prompt_logits(prompt).cpu() - cpu.prompt_logits(prompt)).abs().max().item()
    assert err < 1e-3, f"max |cuda - cpu| logits = {err}"
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    [on_gpu], [on_cpu] = gpu.generate([prompt], params), cpu.generate([prompt], params)
    assert on_gpu.token_ids == on_cpu.token_ids
