"""Layer-wise KV loading (issue 12) vs load-then-compute, side by side in one run.

A request whose PREFIX tokens sit in host pages (L2) runs its last CHUNK tokens; per context:
(a) the forward with the prefix copied in layer by layer while it runs, (b) all pages copied
first, then the forward, (c) the forward alone with the pages already in the pool, and the copy
alone. Loads are what the tier manager copies: every full page of the prefix, and the SWA pages
the chunk's window reads. KV values are random (timing does not depend on them). Cells alternate
(a b c copy a b c ...) so machine drift hits all alike; each is the median of REPEATS.
Columns: copy = the copy alone, compute = (c), a/b, copy/b = the copy's share of (b), and
hidden = (b - a) / copy, the share of the copy time that the overlap took off (< 0: a cost).

    python loadtest/bench_layerwise.py [--contexts 2048,8192] [--chunk 64] [--threads 1]
        [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from engine.kv import KVLayout, KVPool, PageAllocator, PageKind, SeqPages
from engine.kv.layerwise import PageCopy, load_pages
from engine.kv.layout import num_pages, swa_first_needed_page
from engine.model_runner import ModelRunner
from engine.models.checkpoint import mimo_config, write_random_checkpoint
from engine.models.loader import load_model
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduled
from engine.sequence import Sequence

PAGE, WINDOW, LAYERS = 16, 128, "FSFSFSFS"  # 4 full + 4 SWA layers, dense MLPs
CONFIG = dict(layers=LAYERS, mlp="D" * len(LAYERS), sliding_window=WINDOW, hidden_size=256,
              num_attention_heads=4, num_key_value_heads=4, head_dim=64, v_head_dim=64,
              swa_num_key_value_heads=4, intermediate_size=512,
              max_position_embeddings=1 << 16)
CONTEXTS, CHUNK, REPEATS, SEED = (2048, 8192), 64, 9, 0
# NOTE: one intra-op thread, so on a 2-core box the copier thread has a core of its own (on CUDA
# the copy engine is its own hardware); more threads just make the two fight over the cores.
NUM_THREADS = 1


def main() -> None:
    args = _parse_args()
    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(write_random_checkpoint(tmp, mimo_config(**CONFIG), seed=SEED),
                           dtype="float32", device=args.device)
    layout = KVLayout.from_model(model.config, PAGE, 4)
    print(f"float32 {args.device}, {args.threads} thread(s), median of {args.repeats}; "
          f"layers {LAYERS} W={WINDOW} page={PAGE} hidden={CONFIG['hidden_size']} heads=kv_heads="
          f"{CONFIG['num_key_value_heads']} head_dim=v_head_dim={CONFIG['head_dim']}")
    print(f"{'context':>7} {'chunk':>5} {'load MB':>7} {'copy ms':>7} {'compute':>7} "
          f"{'(b) ltc':>7} {'(a) lw':>7} {'a/b':>5} {'copy/b':>6} {'hidden':>6}")
    cells = [_bench(model, layout, ctx, args.chunk, args.repeats) for ctx in args.contexts]
    print("summary: layerwise/load-then-compute " + ", ".join(cells))


def _bench(model: torch.nn.Module, layout: KVLayout, context: int, chunk: int,
           repeats: int) -> str:
    """Prints one context's row; returns its summary cell."""
    seq_len = context + chunk
    n = num_pages(seq_len, PAGE)
    runner = ModelRunner(model, layout, num_chunks=2 * n)  # type: ignore[arg-type]
    alloc = PageAllocator(layout, 2 * n * layout.chunk_bytes)
    full, swa = alloc.allocate(PageKind.FULL, n), alloc.allocate(PageKind.SWA, n)
    loads = _host_loads(layout, context, chunk, full, swa, pin=runner.device.type == "cuda")
    prompt = torch.randint(0, model.config.vocab_size, (seq_len,)).tolist()
    seq = Sequence("bench", tuple(prompt), SamplingParams(max_new_tokens=1, temperature=0.0))
    seq.num_computed = context
    batch, pages = [Scheduled(seq, chunk)], [SeqPages(full, list(swa), context, chunk)]
    runs: dict[str, Callable[[], object]] = {
        "a": lambda: runner.run(batch, pages, loads, layerwise=True),
        "b": lambda: runner.run(batch, pages, loads, layerwise=False),
        "c": lambda: runner.run(batch, pages),
        "copy": lambda: load_pages(runner.pool, loads),
    }
    t = _median_times(runs, repeats)
    mb = sum(c.src.numel() * c.src.element_size() for c in loads) / 2**20
    hidden = (t["b"] - t["a"]) / t["copy"]  # share of the copy time the overlap took off
    print(f"{context:>7} {chunk:>5} {mb:>7.1f} {t['copy']:>7.1f} {t['c']:>7.1f} {t['b']:>7.1f} "
          f"{t['a']:>7.1f} {t['a'] / t['b']:>5.2f} {t['copy'] / t['b']:>6.2f} {hidden:>6.2f}")
    return f"{context // 1024}k x{t['a'] / t['b']:.2f}"


def _host_loads(layout: KVLayout, context: int, chunk: int, full: list[int], swa: list[int],
                pin: bool) -> list[PageCopy]:
    """Random host pages (one host arena, as L2 keeps them) for the prefix's loads."""
    prefix = num_pages(context, PAGE)
    first_swa = swa_first_needed_page(context + chunk, WINDOW, chunk, PAGE)
    want = [(PageKind.FULL, p) for p in full[:prefix]]
    want += [(PageKind.SWA, p) for p in swa[first_swa:prefix]]
    host = KVPool(layout, len(want), torch.float32, "cpu", pin_memory=pin)
    host.arena.normal_()
    host_alloc = PageAllocator(layout, len(want) * layout.chunk_bytes)
    return [PageCopy(k, host.page(k, host_alloc.allocate(k, 1)[0]), p) for k, p in want]


def _median_times(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Milliseconds per run, interleaved, after one warm-up each."""
    for fn in runs.values():
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="layer-wise KV loading vs load-then-compute")
    parser.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")],
                        default=list(CONTEXTS), help="prefix tokens in host pages")
    parser.add_argument("--chunk", type=int, default=CHUNK, help="tokens the step computes")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--threads", type=int, default=NUM_THREADS)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (host pages pinned)")
    return parser.parse_args()


if __name__ == "__main__":
    main()
