"""``loadtest/bench_encoder.py`` at toy size, as a subprocess against the suite's Redis: the three
rows (no cache, process LRU, Redis), each answering every request, the cached rows encoding fewer
items than requests, and positive ratios. Timings are never compared."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REQUESTS = 16
ROW = re.compile(r"^\s*(none|lru|redis)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
                 r"\s+(\d+)$")


def test_the_benchmark_prints_each_cache_row_and_ratios(redis_url: str) -> None:
    cmd = [sys.executable, "loadtest/bench_encoder.py", "--requests", str(REQUESTS),
           "--clients", "2", "--size", "64x48", "--repeats", "1", "--redis", redis_url]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr + result.stdout
    rows = {m[1]: m for line in result.stdout.splitlines() if (m := ROW.match(line))}
    assert set(rows) == {"none", "lru", "redis"}, result.stdout
    for name, row in rows.items():
        assert (int(row[2]), int(row[3])) == (REQUESTS, 2), row[0]
        assert all(float(row[i]) > 0 for i in (4, 5, 6)), f"{name}: {row[0]}"
    # NOTE: half the requests repeat an image: a cache answers some of them without encoding
    assert int(rows["lru"][7]) < REQUESTS and int(rows["redis"][7]) < REQUESTS, result.stdout
    ratios = dict(re.findall(r"(lru|redis) vs none: ([\d.]+)x", result.stdout))
    assert set(ratios) == {"lru", "redis"} and all(float(r) > 0 for r in ratios.values()), (
        result.stdout)
