"""``loadtest/bench_gcache.py`` at toy sizes: the L3 bytes of a 2k-token session (one request,
and two turns) and the resume cells at a 256-token history on a tiny random model. Structural
facts only (pages by kind, where each cell's KV came from); timings are never asserted."""

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

from engine.models.checkpoint import mimo_config, write_random_checkpoint
from engine.utils import cdiv

LOADTEST = Path(__file__).resolve().parents[2] / "loadtest"
CONTEXT = 256


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    # NOTE: the benchmarks import their siblings by bare name (run as scripts from loadtest/)
    sys.path.insert(0, str(LOADTEST))
    try:
        return importlib.import_module("bench_gcache")
    finally:
        sys.path.remove(str(LOADTEST))


@pytest.mark.parametrize("turns", [1, 2])
def test_l3_bytes_are_full_pages_and_end_windows(bench: ModuleType, turns: int) -> None:
    r = bench.l3_bytes(turns, session_tokens=2048, decode=32)
    window_pages = cdiv(bench.WINDOW, bench.PAGE)
    assert r.full_pages == r.total_tokens // bench.PAGE, r
    assert r.swa_pages == turns * window_pages, (r, "one window per turn end, no SWA history")
    assert r.num_bytes < r.all_layers_bytes / 4, r
    assert r.num_bytes <= 1.5 * r.ideal_per_resume_bytes, r
    if turns == 1:
        assert r.num_bytes <= 1.5 * r.ideal_bytes, r


def test_resume_cells_come_from_their_tier(bench: ModuleType, tmp_path: Path,
                                           redis_url: str) -> None:
    config = mimo_config(layers="FSFS", mlp="DDDD", sliding_window=32,
                         max_position_embeddings=4096)
    model_dir = write_random_checkpoint(tmp_path / "model", config, seed=0)
    stores = {"file": f"file:{tmp_path / 'gcache'}", "redis": redis_url}
    cells = bench.resume_cells(model_dir, CONTEXT, 1, stores)
    assert set(cells) == {"recompute", "L1", "L2 lw=on", "L2 lw=off", "L3 file lw=on",
                          "L3 file lw=off", "L3 redis lw=on", "L3 redis lw=off"}
    got = {name: (c.cached, c.host, c.storage) for name, c in cells.items()}
    assert got["recompute"] == (0, 0, 0), got
    assert got["L1"] == (CONTEXT, 0, 0), got
    for lw in bench.LW:
        assert got[f"L2 lw={lw}"] == (CONTEXT, CONTEXT, 0), got
        for store in stores:
            assert got[f"L3 {store} lw={lw}"] == (CONTEXT, 0, CONTEXT), got
    assert all(len(c.ttft_s) == 1 and c.median_s > 0 for c in cells.values()), cells
