"""Prefill and decode tok/s of ``engine.LLM`` vs transformers' ``generate()`` on one checkpoint.

Prefill: a greedy generate of 1 new token, BATCH * PROMPT_LEN tokens. Decode: a generate of
NEW_TOKENS new tokens minus that prefill time, BATCH * (NEW_TOKENS - 1) tokens. Ours and theirs
alternate (A B A B ...) so machine drift hits both alike; each cell is the median of REPEATS.
The same run checks that both pick identical greedy tokens. Ours runs without the prefix cache:
the repeats reuse the same prompts, and a cache hit would skip the prefill transformers redoes.

    python loadtest/bench_model.py [--model DIR] [--dtype bfloat16] [--experts eager]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from engine import LLM, SamplingParams
from engine.models.checkpoint import DEMO_CONFIG, write_random_checkpoint

PROMPT_LEN = 256
NEW_TOKENS = 64
BATCH_SIZES = (1, 8)
REPEATS = 3
SEED = 0
# NOTE: the same for both. One thread: on a shared 2-core box a second OpenMP thread stalls every
# small op whenever another process holds the other core, which skews the many-op engine most.
NUM_THREADS = 1

Generate = Callable[[list[list[int]], int], list[list[int]]]


def main() -> None:
    args = _parse_args()
    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model or write_random_checkpoint(tmp, DEMO_CONFIG, seed=SEED))
        # NOTE: no prefix cache, so both sides do the same work on every repeat.
        llm = LLM(model_dir, dtype=args.dtype, device="cpu", enable_prefix_cache=False)
        ref = transformers.MiMoV2FlashForCausalLM.from_pretrained(
            model_dir,
            dtype=getattr(torch, args.dtype),
            attn_implementation="eager",
            experts_implementation=args.experts,  # None: transformers' default
        ).eval()
        print(
            f"{args.dtype}, prompt {PROMPT_LEN}, new {NEW_TOKENS}, median of {REPEATS}, "
            f"{args.threads} thread(s); ours prefix cache off; transformers attn=eager "
            f"experts={ref.config._experts_implementation}"
        )
        print(f"{'batch':>5} {'phase':>7} {'ours tok/s':>11} {'hf tok/s':>11} {'ratio':>6}")
        cells = [cell for b in BATCH_SIZES for cell in _bench(b, llm, ref)]
    print(f"summary: {args.dtype} ours/transformers tok/s " + ", ".join(cells))


def _bench(batch: int, llm: LLM, ref: transformers.MiMoV2FlashForCausalLM) -> list[str]:
    """Prints the prefill and decode rows for one batch size; returns summary cells."""
    gen = torch.Generator().manual_seed(SEED + batch)
    prompts = torch.randint(0, llm.config.vocab_size, (batch, PROMPT_LEN), generator=gen).tolist()
    runs = {"ours": _ours(llm), "hf": _theirs(ref)}
    for fn in runs.values():
        fn(prompts, 2)  # warm-up
    times: dict[tuple[str, int], list[float]] = {}
    outs: dict[str, list[list[int]]] = {}
    for _ in range(REPEATS):
        for n in (1, NEW_TOKENS):
            for name, fn in runs.items():  # interleaved: ours, hf, ours, hf, ...
                start = time.perf_counter()
                outs[name] = fn(prompts, n)
                times.setdefault((name, n), []).append(time.perf_counter() - start)
    t = {k: statistics.median(v) for k, v in times.items()}
    cells = []
    for phase, num_tokens, secs in (
        ("prefill", batch * PROMPT_LEN, {k: t[k, 1] for k in runs}),
        ("decode", batch * (NEW_TOKENS - 1), {k: t[k, NEW_TOKENS] - t[k, 1] for k in runs}),
    ):
        a, b = num_tokens / secs["ours"], num_tokens / secs["hf"]
        print(f"{batch:>5} {phase:>7} {a:>11.1f} {b:>11.1f} {a / b:>6.2f}")
        cells.append(f"{phase} b{batch} x{a / b:.2f}")
    diverge = [_first_diff(o, h) for o, h in zip(outs["ours"], outs["hf"])]
    bad = [i for i in diverge if i is not None]
    verdict = f"MISMATCH in {len(bad)} request(s), first at token {min(bad)}" if bad else "OK"
    print(f"{batch:>5} greedy tokens ({batch} x {NEW_TOKENS}): {verdict}")
    return [*cells, f"greedy b{batch} {'OK' if not bad else 'MISMATCH'}"]


def _ours(llm: LLM) -> Generate:
    def run(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        return [list(out.token_ids) for out in llm.generate(prompts, params)]

    return run


def _theirs(ref: transformers.MiMoV2FlashForCausalLM) -> Generate:
    @torch.inference_mode()
    def run(prompts: list[list[int]], n: int) -> list[list[int]]:
        ids = torch.tensor(prompts)  # equal lengths: no padding needed
        out = ref.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
        )
        return out[:, ids.shape[1] :].tolist()

    return run


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="engine.LLM vs transformers tok/s")
    parser.add_argument("--model", help="checkpoint dir (default: random DEMO_CONFIG weights)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=NUM_THREADS)
    parser.add_argument("--experts", help="transformers experts_implementation, e.g. eager")
    return parser.parse_args()


if __name__ == "__main__":
    main()
