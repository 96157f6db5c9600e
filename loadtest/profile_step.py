"""Where one engine decode step's time goes: a breakdown by component and a cProfile top list.

Native: the demo model, fp32, one thread, B requests of a 128-token prompt, 32 decode steps
timed once every prefill is done (the cells of ``bench_decode.py``). Each component is timed by
wrapping it (perf_counter, ~1 us per call); components nest (``attn`` holds ``attend``).

    python loadtest/profile_step.py [--batch 32] [--steps 32] [--top 15]

Run it from another checkout (``PYTHONPATH=/path/to/old python loadtest/profile_step.py``) to
profile an older engine the same way: only components that exist there are wrapped.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.models.checkpoint import DEMO_CONFIG, write_random_checkpoint

PROMPT_LEN, SEED = 128, 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = write_random_checkpoint(tempfile.mkdtemp(), DEMO_CONFIG, seed=SEED)
    llm = LLM(model_dir, dtype="float32", device="cpu", enable_prefix_cache=False,
              max_running_requests=64)
    engine = llm.engine
    times: collections.Counter[str] = collections.Counter()
    _wrap_components(engine, times)
    gen = torch.Generator().manual_seed(SEED)
    for run in ("timed", "profiled"):
        _start(engine, args.batch, args.steps, gen, run)
        times.clear()
        prof = cProfile.Profile() if run == "profiled" else None
        start = time.perf_counter()
        if prof is not None:
            prof.enable()
        for _ in range(args.steps):
            engine.step()
        if prof is not None:
            prof.disable()
            _print_profile(prof, args.top)
            continue
        step_ms = (time.perf_counter() - start) / args.steps * 1e3
        print(f"native decode, demo model, fp32, 1 thread, batch {args.batch}: "
              f"{step_ms:.2f} ms/step, {args.batch / step_ms * 1e3:.0f} tok/s")
        for name, total in times.most_common():
            print(f"  {name:<22} {total / args.steps * 1e3:7.3f} ms/step")
    engine.close()


def _start(engine, batch: int, steps: int, gen: torch.Generator, tag: str) -> None:  # noqa: ANN001
    """Queue ``batch`` requests and step until each has its first token (prefills done)."""
    params = SamplingParams(max_new_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(torch.randint(0, 256, (batch, PROMPT_LEN), generator=gen).tolist()):
        engine.add(engine.make_sequence(f"{tag}-{i}", prompt, params), bounded=False)
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()
    engine.step()


def _wrap_components(engine, times: collections.Counter[str]) -> None:  # noqa: ANN001
    import engine.kv.paged as paged
    import engine.layers.attention as attention
    import engine.layers.moe as moe
    import engine.layers.norm as norm

    runner = engine.runner
    targets: list[tuple[object, str, str]] = [
        (engine.scheduler, "schedule", "schedule"),
        (engine.kv, "commit", "kv.commit"),
        (runner, "run", "runner.run"),
        (runner.model, "forward", "model forward"),
        (runner.model, "compute_logits", "logits"),
        (runner.sampler, "sample", "sample"),
        (attention.Attention, "forward", "attn"),
        (paged.PagedBatch, "__init__", "PagedBatch init"),
        (paged.PagedBatch, "attend", "attend"),
        (runner.pool, "read_slots", "KV gather"),
        (runner.pool, "write_at", "KV write"),
        (moe.MoE, "forward", "moe"),
        (moe, "route", "moe route"),
        (norm.RMSNorm, "forward", "rms norm"),
    ]
    for obj, name, label in targets:
        if hasattr(obj, name):
            setattr(obj, name, _timed(getattr(obj, name), label, times))


def _timed(fn: Callable, label: str, times: collections.Counter[str]) -> Callable:
    def wrapper(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[label] += time.perf_counter() - start

    return wrapper


def _print_profile(prof: cProfile.Profile, top: int) -> None:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    print(f"cProfile, top {top} by own time:")
    for line in lines[start:]:
        print("  " + line.replace(str(Path.cwd()) + "/", ""))


if __name__ == "__main__":
    main()
