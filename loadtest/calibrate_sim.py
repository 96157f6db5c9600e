"""Fit the sim backend's CostModel to the native backend's measured step times (demo model).

Runs the native engine on prefill-only and decode-only batches of several sizes, records each
step's wall time with the tokens and KV positions it touched, and least-squares fits
``t = overhead + a * prefill_tokens + b * decode_tokens + c * (query, key) pairs``. Prints the fit,
the sim's prediction next to the measurement, and the CostModel(...) line for engine/sim.py.

    python loadtest/calibrate_sim.py
"""

from __future__ import annotations

import tempfile
import time

import numpy as np
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.models.checkpoint import DEMO_CONFIG, write_random_checkpoint
from engine.sampling_params import SamplingParams
from engine.sim import CostModel

SEED, PROMPTS, BATCHES, NEW_TOKENS = 0, (64, 256, 1024), (1, 4, 16), 16


def main() -> None:
    torch.set_num_threads(1)
    model_dir = write_random_checkpoint(tempfile.mkdtemp(), DEMO_CONFIG, seed=SEED)
    eng = Engine(EngineConfig(model_path=str(model_dir), enable_prefix_cache=False,
                              max_num_batched_tokens=4096, dtype="float32", device="cpu"))
    rows: list[tuple[int, int, int, float]] = []
    gen = torch.Generator().manual_seed(SEED)
    for prompt_len in PROMPTS:
        for batch in BATCHES:
            for i in range(batch):
                ids = torch.randint(0, 256, (prompt_len,), generator=gen).tolist()
                p = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
                eng.add(eng.make_sequence(f"{prompt_len}-{batch}-{i}", ids, p))
            while eng.has_work:
                rows.append(_timed_step(eng))
    x = np.array([[1.0, p, d, r] for p, d, r, _ in rows])
    t = np.array([row[3] for row in rows])
    # NOTE: weighted by 1/t: relative error per step, so 100 small decode steps count as much
    # as the few long prefill steps
    coef = _nonnegative_lstsq(x / t[:, None], np.ones_like(t))
    model = CostModel(*map(float, coef))
    pred = np.array([model.step_time(p, d, r) for p, d, r, _ in rows])
    err = np.abs(pred - t).sum() / t.sum()
    rel = float(np.median(np.abs(pred - t) / t))
    print(f"{len(rows)} steps measured; total {t.sum():.2f} s, sim predicts {pred.sum():.2f} s "
          f"(abs error {err:.1%} of the total, median per-step error {rel:.1%})")
    print(f"CostModel(step_overhead_s={coef[0]:.3g}, prefill_s_per_token={coef[1]:.3g}, "
          f"decode_s_per_token={coef[2]:.3g}, attn_s_per_qk={coef[3]:.3g})")


def _nonnegative_lstsq(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: refit without the most negative one until none is."""
    active = list(range(x.shape[1]))
    while True:
        sol, *_ = np.linalg.lstsq(x[:, active], t, rcond=None)
        if (sol >= 0).all():
            coef = np.zeros(x.shape[1])
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))


def _timed_step(eng: Engine) -> tuple[int, int, int, float]:
    batch, _ = eng.scheduler.schedule()
    prefill = sum(s.query_len for s in batch if s.query_len > 1)
    decode = sum(s.query_len for s in batch if s.query_len == 1)
    read = sum(s.query_len * (s.seq.num_computed + s.query_len) for s in batch)
    start = time.perf_counter()
    eng.run_scheduled(batch)
    return prefill, decode, read, time.perf_counter() - start


if __name__ == "__main__":
    main()
