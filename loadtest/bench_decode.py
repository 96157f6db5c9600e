"""Decode tok/s with continuous batching (engine.LLM) vs transformers generate(), batch 1/8/32.

Both run greedy on the same random demo-architecture checkpoint, one thread, prompts of equal
length (no padding for transformers), our prefix cache off. Decode time = time(N new tokens) -
time(1 new token), each the best of REPEATS runs that alternate ours/theirs (the least disturbed
run of each on a noisy shared box; the same estimator for both sides).

    python loadtest/bench_decode.py
"""

from __future__ import annotations

import tempfile
import time

import torch
import transformers

from engine import LLM, SamplingParams
from engine.models.checkpoint import DEMO_CONFIG, write_random_checkpoint

PROMPT_LEN, NEW_TOKENS, BATCHES, REPEATS, SEED = 128, 32, (1, 8, 32), 5, 0


def bench_decode() -> None:
    torch.set_num_threads(1)
    model_dir = write_random_checkpoint(tempfile.mkdtemp(), DEMO_CONFIG, seed=SEED)
    ours = LLM(model_dir, dtype="float32", device="cpu", enable_prefix_cache=False,
               max_running_requests=64)
    ref = transformers.MiMoV2FlashForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(SEED)

    def run_ours(prompts: list[list[int]], n: int) -> list[list[int]]:
        p = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        return [list(o.token_ids) for o in ours.generate(prompts, p)]

    @torch.inference_mode()
    def run_ref(prompts: list[list[int]], n: int) -> list[list[int]]:
        ids = torch.tensor(prompts)
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[:, PROMPT_LEN:].tolist()

    print(f"decode: prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens, fp32, 1 thread, greedy")
    print(f"{'batch':>5} {'ours tok/s':>11} {'hf tok/s':>10} {'ratio':>6}  tokens")
    for b in BATCHES:
        prompts = torch.randint(0, 256, (b, PROMPT_LEN), generator=gen).tolist()
        same = run_ours(prompts, NEW_TOKENS) == run_ref(prompts, NEW_TOKENS)
        best: dict[tuple[str, int], float] = {}
        for _ in range(REPEATS):
            for name, fn in (("ours", run_ours), ("hf", run_ref)):
                for n in (1, NEW_TOKENS):
                    t = _timed(fn, prompts, n)
                    best[name, n] = min(best.get((name, n), t), t)
        o, h = (b * (NEW_TOKENS - 1) / max(best[name, NEW_TOKENS] - best[name, 1], 1e-9)
                for name in ("ours", "hf"))
        print(f"{b:>5} {o:11.1f} {h:10.1f} {o / h:6.2f}  {'identical' if same else 'DIFFER'}",
              flush=True)


def _timed(fn, prompts: list[list[int]], n: int) -> float:  # noqa: ANN001
    start = time.perf_counter()
    fn(prompts, n)
    return time.perf_counter() - start


if __name__ == "__main__":
    bench_decode()
