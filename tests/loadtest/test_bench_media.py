"""``loadtest/bench_media.py`` at toy sizes, as a subprocess: one row per size with both decoders'
throughput and a positive ratio, and a summary line. Timings are never compared."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SIZES = ("64x48", "96x64")
ROW = re.compile(r"^\s*(\d+x\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x$")


def test_the_benchmark_prints_a_row_per_size_and_a_ratio() -> None:
    cmd = [sys.executable, "loadtest/bench_media.py", "--sizes", ",".join(SIZES), "--count",
           "3", "--repeats", "1"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr + result.stdout
    lines = result.stdout.splitlines()
    assert "ours img/s" in lines[0] and "pillow img/s" in lines[0], lines
    rows = {m[1]: m for line in lines if (m := ROW.match(line))}
    assert tuple(rows) == SIZES, result.stdout
    for size, row in rows.items():
        assert int(row[2]) == 3, row
        assert all(float(row[i]) > 0 for i in range(3, 8)), f"{size}: {row[0]}"
    summary = re.search(r"summary: decode_image \(simplejpeg\) vs Pillow: ([\d.]+)x",
                        result.stdout)
    assert summary and float(summary[1]) > 0, result.stdout
