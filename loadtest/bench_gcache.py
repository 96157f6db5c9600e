"""GCache (L3) benchmarks (issue 12), each printed side by side with its baseline from the same run.

1. l3-bytes: L3 bytes written per 32k-token session on MiMo-V2.5-Pro geometry (sim backend, a
   file GCache; pages counted by kind through the store's keys), against storing every layer's
   KV for every token and against the ideal (10 L + 60 W) / (70 L); (a) one request (32k
   prompt + 256 decoded), (b) an agent session of 8 turns reaching 32k, each turn end a resume
   point.
2. resume: TTFT of a session's next turn (its history + 16 new tokens) on the native engine
   (CPU, float32, a random model) served from L1, L2 (host), L3 file and L3 Redis (--redis: a
   redis-server the benchmark starts), layer-wise loading on and off, against recomputing the
   prefix; medians of fresh, equal states.

    python loadtest/bench_gcache.py [l3-bytes|resume ...] [--contexts 2048,8192]
        [--repeats 3] [--redis]         # --contexts 32768: ~5 min more (1 repeat)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench_engine import (  # loadtest/ is the script's directory
    DEFAULT_INTERVAL,
    PAGE,
    SESSION_DECODE,
    SESSION_TOKENS,
    TOKEN_BYTES,
    WINDOW,
    sim_engine,
)
from redis_local import local_redis

from engine.engine import Engine
from engine.hashing import page_hashes
from engine.kv.gcache import KIND_NAMES, open_store, page_key
from engine.kv.layout import KVLayout, PageKind
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

TURNS, SEED = 8, 0
# resume: 4 full + 4 SWA layers, dense MLPs (a 32k prefill takes ~2 min on the 2-core box)
RESUME_CONFIG = dict(layers="FSFSFSFS", mlp="D" * 8, sliding_window=WINDOW, hidden_size=256,
                     num_attention_heads=4, num_key_value_heads=4, head_dim=64, v_head_dim=64,
                     swa_num_key_value_heads=4, intermediate_size=512, vocab_size=320,
                     max_position_embeddings=1 << 16)
CONTEXTS, NEW_TOKENS, REPEATS, CHUNK = (2048, 8192), 16, 3, 2048
LONG_CONTEXT, LONG_REPEATS = 16_384, 1  # contexts above: one repeat (a prefill takes minutes)
TARGET_CONTEXT, TARGET_RATIO = 8192, 0.3  # issue 12: L3 resume <= 0.3 x recompute at 8k
LW = ("on", "off")  # layerwise_load: copy in the forward, or all before it
REDIS_TIMEOUT_S = 5.0  # NOTE: a 32k fetch is one pipelined read of ~256 MiB


# ---------------------------------------------------------------- 1. L3 bytes of one session


@dataclass(frozen=True, slots=True)
class L3Bytes:
    total_tokens: int  # tokens with KV (the last sampled token has none)
    full_pages: int
    swa_pages: int
    num_bytes: int
    all_layers_bytes: int
    ideal_bytes: int  # 10 L + 60 W: one window
    ideal_per_resume_bytes: int  # 10 L + R x 60 W: one window per resume point


def l3_bytes(turns: int, session_tokens: int = SESSION_TOKENS,
             decode: int = SESSION_DECODE) -> L3Bytes:
    """One session written through to a fresh file GCache: ``turns`` requests, each the history
    plus new tokens, ``decode`` decoded; the last prompt is ``session_tokens`` long."""
    new = (session_tokens - (turns - 1) * decode) // turns
    rng = random.Random(SEED)
    with tempfile.TemporaryDirectory(prefix="bench-gcache-") as tmp:
        eng = sim_engine(2 * session_tokens, interval=DEFAULT_INTERVAL,
                         host_budget_tokens=2 * session_tokens, gcache=f"file:{tmp}")
        history: list[int] = []
        for turn in range(turns):
            history += [rng.randrange(eng.model_config.vocab_size) for _ in range(new)]
            seq = _run_sim(eng, f"turn{turn}", history, decode)
            history += seq.output_ids
        assert eng.storage is not None
        assert eng.storage.flush_writes(120.0), "L3 writes did not finish"
        counts = _count_pages(eng, history[:-1])
        num_files = _count_files(Path(tmp))
        eng.close()
    assert num_files == sum(counts.values()), f"{num_files} files, {counts} on the path"
    return _l3_bytes(eng.layout, len(history) - 1, counts, turns)


def bench_l3_bytes() -> None:
    print(f"l3-bytes: L3 bytes written per {SESSION_TOKENS}-token session, MiMo-V2.5-Pro "
          f"geometry (70 layers, 10 full, W = {WINDOW}, page {PAGE}, bf16), sim backend, file "
          f"GCache, checkpoint every {DEFAULT_INTERVAL} tokens (periodic checkpoints keep SWA "
          f"windows in L1/L2; write-through sends each request's end window only), L2 big "
          f"enough (no write-back)")
    print(f"{'session':>22} {'tokens':>6} {'full pg':>7} {'SWA pg':>6} {'L3 MiB':>8} "
          f"{'all-layers MiB':>14} {'/all':>6} {'ideal MiB':>9} {'/ideal':>6} "
          f"{'/ideal@R':>8} {'secs':>5}")
    for name, turns in (("(a) 1 request", 1), (f"(b) {TURNS}-turn agent", TURNS)):
        t0 = time.perf_counter()
        r = l3_bytes(turns)
        print(f"{name:>22} {r.total_tokens:6d} {r.full_pages:7d} {r.swa_pages:6d} "
              f"{_mib(r.num_bytes):8.1f} {_mib(r.all_layers_bytes):14.1f} "
              f"{r.num_bytes / r.all_layers_bytes:6.4f} {_mib(r.ideal_bytes):9.1f} "
              f"{r.num_bytes / r.ideal_bytes:6.3f} {r.num_bytes / r.ideal_per_resume_bytes:8.3f} "
              f"{time.perf_counter() - t0:5.1f}", flush=True)
    print("  ideal = (10 L + 60 W) x bytes per layer-token; ideal@R = (10 L + R x 60 W), one "
          "window per resume point R (turn end)")


# ---------------------------------------------------------------- 2. resume TTFT by tier


@dataclass(slots=True)
class Cell:
    """One column of the resume table: TTFTs of equal, fresh states, and where the KV came from
    (the last sample's ``cached_tokens``, of which from L2 and from L3)."""

    ttft_s: list[float] = field(default_factory=list)
    cached: int = 0
    host: int = 0
    storage: int = 0
    secs: float = 0.0  # wall time of the cell, engine setup included

    @property
    def median_s(self) -> float:
        return statistics.median(self.ttft_s)


def resume_cells(model_dir: Path, context: int, repeats: int,
                 stores: dict[str, str]) -> dict[str, Cell]:
    """TTFT of ``history + NEW_TOKENS`` (one token out, greedy) for a ``context``-token history,
    by where the history's KV is: nowhere (recompute), L1, L2 (after a demoting flush), or each
    L3 store of ``stores`` (a fresh engine, cold L1 and L2); L2 and L3 layer-wise on and off.

    The first store gets the history by write-through (an engine computes it, finishes, flushes
    its writes); the others are filled with those values, key by key. Each repeat builds fresh
    engines, so every sample starts from the same state.

    Raises:
        RuntimeError: a cell's KV did not come from the tier it measures.
    """
    layout = KVLayout.from_model(ModelConfig.from_dir(model_dir), PAGE, 4)
    rng = random.Random(context)
    prompt = [rng.randrange(_vocab(model_dir)) for _ in range(context + NEW_TOKENS)]
    first, *others = stores
    names = ["recompute", "L1", "L2 lw=on", "L2 lw=off"]
    cells = {n: Cell() for n in names + [f"L3 {s} lw={lw}" for s in stores for lw in LW]}
    recompute = _llm(model_dir, layout, context, enable_prefix_cache=False)
    _generate(recompute, _warm_prompt(rng, model_dir))
    writer = _llm(model_dir, layout, context, gcache=stores[first])
    t0 = time.perf_counter()
    _generate(writer, prompt[:context])
    assert writer.engine.storage is not None
    assert writer.engine.storage.flush_writes(600.0), "L3 writes did not finish"
    fp = writer.engine.storage.fingerprint
    print(f"  context {context}: history computed and written through in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    for name in others:
        _copy_pages(stores[first], stores[name], fp, prompt[:context])
    for _ in range(repeats):
        _measure(cells, "recompute", lambda: recompute, prompt)
        _measure(cells, "L1", lambda: writer, prompt)
        for name, spec in stores.items():
            for lw in LW:
                llm = _llm(model_dir, layout, context, gcache=spec, layerwise_load=lw)
                _generate(llm, _warm_prompt(rng, model_dir))
                _measure(cells, f"L3 {name} lw={lw}", lambda: llm, prompt)  # noqa: B023
                if name == first:
                    llm.engine.cache.flush(demote=True)
                    _measure(cells, f"L2 lw={lw}", lambda: llm, prompt)  # noqa: B023
                llm.close()
    recompute.close()
    writer.close()
    _check_sources(cells, context)
    return cells


def bench_resume(contexts: list[int], repeats: int, redis: bool) -> None:
    import torch

    print(f"resume: TTFT of the next turn (history + {NEW_TOKENS} new tokens, 1 token out, "
          f"greedy) by where the history's KV is; native engine, float32, CPU: "
          f"{os.cpu_count()} cores (a noisy 2-core box), torch threads "
          f"{torch.get_num_threads()}; max_num_batched_tokens {CHUNK}, checkpoint every "
          f"{DEFAULT_INTERVAL}")
    print(f"  random model: {RESUME_CONFIG}")
    print("  L2 = that engine after cache.flush(demote=True); L3 = a fresh engine (cold L1 and "
          "L2) on the shared store (file: OS page cache warm); lw = layer-wise loading")
    with tempfile.TemporaryDirectory(prefix="bench-gcache-") as tmp, local_redis() as url:
        from engine.models.checkpoint import mimo_config, write_random_checkpoint

        model_dir = write_random_checkpoint(Path(tmp) / "model", mimo_config(**RESUME_CONFIG),
                                            seed=SEED, dtype="float32")
        if redis and url is None:
            print("  L3 redis: skipped, redis-server is not installed")
        for context in contexts:
            stores = {"file": f"file:{tmp}/gcache-{context}"}
            if redis and url is not None:
                stores["redis"] = f"{url}?timeout_s={REDIS_TIMEOUT_S:g}"
            n = repeats if context <= LONG_CONTEXT else min(repeats, LONG_REPEATS)
            t0 = time.perf_counter()
            cells = resume_cells(model_dir, context, n, stores)
            _print_resume(context, n, cells)
            print(f"  context {context}: {time.perf_counter() - t0:.0f} s in all", flush=True)


# ---------------------------------------------------------------- helpers

def _run_sim(eng: Engine, request_id: str, prompt: list[int], decode: int) -> Sequence:
    seq = eng.make_sequence(request_id, prompt, SamplingParams(max_new_tokens=decode,
                                                               ignore_eos=True))
    eng.add(seq)
    while eng.has_work:
        if eng.only_fetching:
            time.sleep(0.0002)  # NOTE: an L3 prefetch in flight (its thread needs the GIL)
        eng.step()
    return seq


def _count_pages(eng: Engine, tokens: list[int]) -> dict[PageKind, int]:
    """Pages of each kind the store holds along ``tokens``' chain (asked key by key)."""
    assert eng.storage is not None
    hashes = page_hashes(tokens, PAGE)
    fp, store = eng.storage.fingerprint, eng.storage.store
    return {kind: sum(store.exists_many([page_key(fp, KIND_NAMES[kind], h) for h in hashes]))
            for kind in PageKind}


def _count_files(root: Path) -> int:
    """Values in a file store (one file per key, see engine/kv/gcache/file_store.py)."""
    return sum(1 for p in root.rglob("*") if p.is_file() and not p.name.startswith(".tmp-"))


def _l3_bytes(lay: KVLayout, total: int, counts: dict[PageKind, int], resumes: int) -> L3Bytes:
    n_full, n_swa = lay.num_layers(PageKind.FULL), lay.num_layers(PageKind.SWA)
    per_layer_token = TOKEN_BYTES // (n_full + n_swa)
    num_bytes = sum(n * lay.page_bytes(kind) for kind, n in counts.items())
    return L3Bytes(
        total_tokens=total, full_pages=counts[PageKind.FULL], swa_pages=counts[PageKind.SWA],
        num_bytes=num_bytes, all_layers_bytes=total * TOKEN_BYTES,
        ideal_bytes=(n_full * total + n_swa * WINDOW) * per_layer_token,
        ideal_per_resume_bytes=(n_full * total + resumes * n_swa * WINDOW) * per_layer_token,
    )


def _mib(n: int) -> float:
    return n / 2**20


def _llm(model_dir: Path, layout: KVLayout, context: int, **kwargs: object):  # noqa: ANN202
    """An offline engine whose L1 and L2 each hold the session (history, new tokens, one
    chunk) with room to spare; L3 prefetches are waited for as long as they take."""
    from engine.llm import LLM

    per_token = (layout.page_bytes(PageKind.FULL) + layout.page_bytes(PageKind.SWA)) / PAGE
    budget = int(1.25 * per_token * (context + NEW_TOKENS + CHUNK)) + 64 * layout.chunk_bytes
    host = budget if kwargs.get("gcache") else 0
    return LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE, kv_budget_bytes=budget,
               host_kv_budget_bytes=host, max_num_batched_tokens=CHUNK, gcache_wait_s=600.0,
               **kwargs)


def _generate(llm, prompt: list[int]):  # noqa: ANN001, ANN202
    [out] = llm.generate([prompt], SamplingParams(max_new_tokens=1, temperature=0.0,
                                                  ignore_eos=True))
    return out


def _measure(cells: dict[str, Cell], name: str, make, prompt: list[int]) -> None:  # noqa: ANN001
    cell = cells[name]
    llm = make()
    t0 = time.perf_counter()
    out = _generate(llm, prompt)
    cell.ttft_s.append(time.perf_counter() - t0)
    cell.cached, cell.host, cell.storage = (out.cached_tokens, out.cached_tokens_host,
                                            out.cached_tokens_storage)
    cell.secs += time.perf_counter() - t0


def _warm_prompt(rng: random.Random, model_dir: Path) -> list[int]:
    """A short unrelated prompt: a fresh engine's first forward pays one-time costs."""
    return [rng.randrange(_vocab(model_dir)) for _ in range(4 * PAGE)]


def _copy_pages(src_spec: str, dst_spec: str, fingerprint: str, tokens: list[int]) -> int:
    """Copy every page of ``tokens``' chain (both kinds) that ``src`` holds to ``dst``."""
    src, dst = open_store(src_spec), open_store(dst_spec)
    keys = [page_key(fingerprint, KIND_NAMES[kind], h)
            for h in page_hashes(tokens, PAGE) for kind in PageKind]
    copied = 0
    for i in range(0, len(keys), 256):
        batch = keys[i : i + 256]
        items = [(k, v) for k, v in zip(batch, src.get_many(batch)) if v is not None]
        copied += len(items)
        dst.put_many(items)
    src.close()
    dst.close()
    if dst.stats.errors:
        raise RuntimeError(f"copying pages to {dst_spec}: {dst.stats.errors} store errors")
    return copied


def _check_sources(cells: dict[str, Cell], context: int) -> None:
    """Fail loudly when a cell's KV did not come from the tier it is named for."""
    for name, c in cells.items():
        if name == "recompute":
            ok = c.cached == 0
        elif name == "L1":
            ok = c.cached >= context - PAGE and c.host == c.storage == 0
        elif name.startswith("L2"):
            ok = c.host > 0 and c.storage == 0
        else:
            ok = c.storage > 0
        if not ok:
            raise RuntimeError(f"{name}: cached {c.cached}, from L2 {c.host}, from L3 "
                               f"{c.storage}: the KV did not come from where the cell says")


def _print_resume(context: int, repeats: int, cells: dict[str, Cell]) -> None:
    base = cells["recompute"].median_s
    print(f"{'context':>7} {'cell':>17} {'N':>2} {'TTFT s':>7} {'/recompute':>10} "
          f"{'cached':>6} {'from L2':>7} {'from L3':>7} {'secs':>6}")
    for name, c in cells.items():
        print(f"{context:7d} {name:>17} {repeats:2d} {c.median_s:7.3f} "
              f"{c.median_s / base:10.3f} {c.cached:6d} {c.host:7d} {c.storage:7d} "
              f"{c.secs:6.1f}", flush=True)
    l3 = {n: c.median_s / base for n, c in cells.items() if n.startswith("L3")}
    if context == TARGET_CONTEXT:
        met = all(r <= TARGET_RATIO for r in l3.values())
        print(f"  target L3 resume <= {TARGET_RATIO} x recompute at {context}: "
              + ", ".join(f"{n} {r:.3f}" for n, r in l3.items())
              + f" -> {'met' if met else 'NOT met'}")
    tiers = sorted({n.rsplit(" lw=", 1)[0] for n in cells if " lw=" in n})
    print("  layer-wise / load-then-compute: " + ", ".join(
        f"{t} {cells[f'{t} lw=on'].median_s / cells[f'{t} lw=off'].median_s:.3f}"
        for t in tiers), flush=True)


def _vocab(model_dir: Path) -> int:
    return ModelConfig.from_dir(model_dir).vocab_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("parts", nargs="*", default=["l3-bytes", "resume"])
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)),
                    help="resume: history lengths in tokens")
    ap.add_argument("--repeats", type=int, default=REPEATS,
                    help=f"resume: samples per cell (contexts above {LONG_CONTEXT}: "
                         f"{LONG_REPEATS})")
    ap.add_argument("--redis", action="store_true",
                    help="resume: add L3 on a redis-server started here")
    args = ap.parse_args()
    if "l3-bytes" in args.parts:
        bench_l3_bytes()
    if "resume" in args.parts:
        bench_resume([int(c) for c in args.contexts.split(",")], args.repeats, args.redis)


if __name__ == "__main__":
    main()
