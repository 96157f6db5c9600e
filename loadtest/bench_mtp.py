"""MTP speculative decoding (issue 14): acceptance and tok/s, and SWA-aware MTP prefill.

    python loadtest/bench_mtp.py decode    # K = 0..3 at batch 1 / 8 / 32
    python loadtest/bench_mtp.py prefill   # time to the first 16 tokens after a long prompt

``decode``: the demo model (``agentgate model init``: MTP layers distilled from the base), greedy,
fp32, one thread, prompts of PROMPT_LEN random tokens, NEW_TOKENS new tokens, prefix cache off.
Each cell is the median of REPEATS runs; K and K = 0 alternate, so the ratios are side by side.
The tokens are checked identical to K = 0 in every run.

``prefill``: one prompt of --tokens tokens (a copy of the demo checkpoint whose context is raised
to fit it), then 16 greedy tokens with K = 3: MTP prefill over the last ~K W positions
("window", the default) vs every position ("full"), and no MTP at all; time to the 16th token,
the MTP rows computed, and whether the tokens and drafts are identical.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.spec import MTPState

PROMPT_LEN, NEW_TOKENS, BATCHES, KS, REPEATS, SEED = 128, 64, (1, 8, 32), (1, 2, 3), 3, 0


def demo_dir() -> Path:
    from gateway.cli import init_demo_model

    out = Path(tempfile.mkdtemp(prefix="bench-mtp-")) / "demo"
    t0 = time.perf_counter()
    init_demo_model(out)
    print(f"demo model (MTP distilled at init) in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def bench_decode(model_dir: Path, batches: tuple[int, ...], new_tokens: int) -> None:
    torch.set_num_threads(1)
    llms = {k: LLM(model_dir, dtype="float32", device="cpu", enable_prefix_cache=False,
                   max_running_requests=64, speculative_tokens=k) for k in (0, *KS)}
    gen = torch.Generator().manual_seed(SEED)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    print(f"decode: prompt {PROMPT_LEN}, {new_tokens} new tokens, fp32, 1 thread, greedy")
    print(f"{'batch':>5} {'K':>2} {'accept len':>10} {'tok/s':>8} {'K=0 tok/s':>9} "
          f"{'ratio':>6}  tokens")
    for b in batches:
        vocab = llms[0].config.vocab_size
        prompts = torch.randint(1, min(vocab, 256), (b, PROMPT_LEN), generator=gen).tolist()
        want = [list(o.token_ids) for o in llms[0].generate(prompts, params)]
        for k in KS:
            rates: dict[int, list[float]] = {0: [], k: []}
            same = True
            stats = llms[k].engine.spec_stats
            steps0, emitted0 = stats.verify_steps, stats.emitted
            for _ in range(REPEATS):
                for kk in (0, k):
                    t0 = time.perf_counter()
                    out = llms[kk].generate(prompts, params)
                    dt = time.perf_counter() - t0
                    rates[kk].append(b * new_tokens / dt)
                    same &= [list(o.token_ids) for o in out] == want
            accept = (stats.emitted - emitted0) / max(1, stats.verify_steps - steps0)
            ours, base = statistics.median(rates[k]), statistics.median(rates[0])
            print(f"{b:>5} {k:>2} {accept:10.2f} {ours:8.1f} {base:9.1f} {ours / base:6.2f}  "
                  f"{'identical' if same else 'DIFFER'}", flush=True)


def bench_prefill(model_dir: Path, tokens: int, new_tokens: int = 16) -> None:
    torch.set_num_threads(1)
    long_dir = model_dir.parent / "long"
    shutil.copytree(model_dir, long_dir, dirs_exist_ok=True)
    config = json.loads((long_dir / "config.json").read_text())
    config["max_position_embeddings"] = max(config["max_position_embeddings"],
                                            tokens + new_tokens + 64)
    (long_dir / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(1, 256, (tokens,), generator=gen).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    print(f"prefill: one prompt of {tokens} tokens, then {new_tokens} greedy tokens, K = 3, "
          f"fp32, 1 thread, W = {config['sliding_window_size']}")
    print(f"{'MTP prefill':>12} {'seconds':>8} {'vs full':>8} {'MTP rows':>9}  tokens, drafts")
    results: dict[str, tuple[float, int, list[int], list[list[int]]]] = {}
    for mode in ("full", "window", "off"):
        k = 0 if mode == "off" else 3
        llm = LLM(long_dir, dtype="float32", device="cpu", enable_prefix_cache=False,
                  speculative_tokens=k, mtp_prefill="full" if mode == "full" else "window")
        seq = llm.engine.make_sequence(f"long-{mode}", prompt, params)
        drafts: list[list[int]] = []
        t0 = time.perf_counter()
        llm.engine.add(seq)
        while llm.engine.has_work:
            llm.engine.step()
            if seq.draft_ids:
                drafts.append(list(seq.draft_ids))
        dt = time.perf_counter() - t0
        rows = seq.mtp.rows if isinstance(seq.mtp, MTPState) else 0
        results[mode] = (dt, rows, list(seq.output_ids), drafts)
    full = results["full"]
    for mode, (dt, rows, out, drafts) in results.items():
        same = out == full[2] and (mode == "off" or drafts == full[3])
        print(f"{mode:>12} {dt:8.2f} {dt / full[0]:8.2f} {rows:9d}  "
              f"{'identical' if same else 'DIFFER'}", flush=True)
    # after a cache hit: the same prompt + 64 new tokens, the prefix cache on. The MTP layers
    # start at the hit (nothing recomputed); "full" has no cached MTP state to start from, so
    # its baseline is the miss above (a full MTP prefill needs the prefix's hidden states)
    print(f"after a {tokens}-token cache hit (+64 new prompt tokens):")
    tail = torch.randint(1, 256, (64,), generator=gen).tolist()
    for mode in ("window", "off"):
        llm = LLM(long_dir, dtype="float32", device="cpu", speculative_tokens=0 if mode == "off"
                  else 3)
        llm.generate([prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))
        seq = llm.engine.make_sequence(f"hit-{mode}", [*prompt, *tail], params)
        t0 = time.perf_counter()
        llm.engine.add(seq)
        while llm.engine.has_work:
            llm.engine.step()
        dt = time.perf_counter() - t0
        rows = seq.mtp.rows if isinstance(seq.mtp, MTPState) else 0
        print(f"{'hit ' + mode:>12} {dt:8.2f} {dt / full[0]:8.2f} {rows:9d}  "
              f"cached {seq.num_cached} tokens", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("decode", "prefill", "all"), nargs="?", default="all")
    parser.add_argument("--tokens", type=int, default=32768, help="prefill: prompt length")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--model", type=Path, help="a model dir with MTP layers (default: "
                                                   "a fresh demo model)")
    args = parser.parse_args()
    model_dir = args.model or demo_dir()
    if args.what in ("decode", "all"):
        bench_decode(model_dir, tuple(int(b) for b in args.batches.split(",")), args.new_tokens)
    if args.what in ("prefill", "all"):
        bench_prefill(model_dir, args.tokens)


if __name__ == "__main__":
    main()
