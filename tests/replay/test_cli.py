"""`agentgate replay` end to end: flags, JSON document, plots, capacity, clear errors."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from gateway.cli import main
from replay.cli import ProgressBar, parse_tokens

POLICIES = ("least-loaded", "round-robin", "global")


def _write_trace(path: Path, n: int = 40, seed: int = 0) -> Path:
    """A small Mooncake trace: a shared first block, short answers, 20 ms apart."""
    rng = random.Random(seed)
    lines, next_id = [], 1
    for i in range(n):
        blocks = rng.randint(1, 4)
        ids = [0, *range(next_id, next_id + blocks)]
        next_id += blocks
        length = 512 * blocks + rng.randint(1, 511)
        lines.append(json.dumps({"timestamp": 20 * i, "input_length": length,
                                 "output_length": rng.randint(2, 12), "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("replay")
    trace = _write_trace(out / "trace.jsonl")
    args = ["replay", str(trace), "--workers", "2", "--kv-budget", "100k", "--policies",
            ",".join(POLICIES), "--capacity", "2", "--jobs", "1", "--json",
            str(out / "out.json"), "--quiet"]
    if importlib.util.find_spec("matplotlib") is not None:
        args += ["--plots", str(out / "plots")]
    assert main(args) == 0
    return out


def test_json_document_has_every_policy_and_its_figures(run_dir: Path) -> None:
    doc = json.loads((run_dir / "out.json").read_text())
    assert doc["schema_version"] == 1
    assert doc["workload"]["requests"] == 40
    assert doc["config"]["num_workers"] == 2 and doc["config"]["kv_budget_tokens"] == 100_000
    assert list(doc["policies"]) == list(POLICIES)
    for name, entry in doc["policies"].items():
        s = entry["summary"]
        assert s["policy"] == name and s["num_requests"] == 40 and s["num_finished"] == 40
        assert 0.0 <= s["hit_rate"] <= 1.0
        assert 0 < s["ttft_p50_s"] <= s["ttft_p99_s"], s
        assert s["load_imbalance"] >= 1.0
        cdf = entry["ttft_cdf"]
        assert len(cdf["q"]) == len(cdf["ttft_s"]) and cdf["ttft_s"] == sorted(cdf["ttft_s"])
        workers = entry["load_over_time"]["prompt_tokens_per_s"]
        assert len(workers) == (1 if name == "global" else 2)
    assert doc["policies"]["global"]["summary"]["hit_rate"] > 0  # the shared first block


def test_capacity_compares_each_policy_with_least_loaded_p99(run_dir: Path) -> None:
    cap = json.loads((run_dir / "out.json").read_text())["capacity"]
    ll = json.loads((run_dir / "out.json").read_text())["policies"]["least-loaded"]["summary"]
    assert cap["reference_policy"] == "least-loaded"
    assert cap["reference_p99_s"] == ll["ttft_p99_s"]
    assert cap["scales"] == [1.0, 2.0]
    assert set(cap["policies"]) == {"least-loaded", "round-robin"}  # global is the bound
    assert cap["policies"]["least-loaded"]["scale"] in (1.0, 2.0)  # its own p99 passes at 1
    for c in cap["policies"].values():
        assert set(c["runs"]) == {"1.0", "2.0"}


def test_plots_are_written(run_dir: Path) -> None:
    pytest.importorskip("matplotlib")
    for name in ("ttft_cdf.png", "hit_rate.png", "load_per_worker.png"):
        data = (run_dir / "plots" / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000, name


def test_parallel_jobs_give_the_same_results_as_one_process(run_dir: Path) -> None:
    """--jobs 2 runs policies in spawned processes: same figures (deterministic ids, hashes)."""
    out = run_dir / "parallel.json"
    args = ["replay", str(run_dir / "trace.jsonl"), "--workers", "2", "--kv-budget", "100k",
            "--policies", "least-loaded,round-robin", "--jobs", "2", "--json", str(out),
            "--quiet"]
    assert main(args) == 0
    parallel = json.loads(out.read_text())["policies"]
    serial = json.loads((run_dir / "out.json").read_text())["policies"]
    for name in ("least-loaded", "round-robin"):
        assert parallel[name]["summary"] == serial[name]["summary"], name


@pytest.mark.parametrize(("args", "says"), [
    (["--policies", "nope"], "--policies"),
    (["--kv-budget", "lots"], "--kv-budget"),
    (["--limit", "0"], "--limit"),
    (["--capacity", "1,x"], "--capacity"),
])
def test_bad_flags_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    args: list[str], says: str) -> None:
    trace = _write_trace(tmp_path / "t.jsonl", n=3)
    assert main(["replay", str(trace), "--quiet", *args]) == 2
    assert says in capsys.readouterr().err


def test_missing_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--quiet"]) == 2
    assert "TRACE" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "none.jsonl"), "--quiet"]) == 2
    assert "none.jsonl" in capsys.readouterr().err


def test_parse_tokens() -> None:
    assert parse_tokens("1.25M") == 1_250_000
    assert parse_tokens("800k") == 800_000
    assert parse_tokens("5000") == 5000


def test_progress_bar_draws_overall_fraction(capsys: pytest.CaptureFixture[str]) -> None:
    bar = ProgressBar(["a@1", "b@1"])
    bar.update("a@1", 5, 10)
    bar.update("a@1", 10, 10)
    bar.close()
    err = capsys.readouterr().err
    assert "50.0%" in err, err  # b not started: counted as big as a


def test_synthetic_agent_workload_replays_with_admission_and_retention(tmp_path: Path) -> None:
    out = tmp_path / "agent.json"
    args = ["replay", "--synthetic", "agent", "--seed", "1", "--sessions", "8", "--limit", "30",
            "--workers", "2", "--kv-budget", "200k", "--policies", "agentgate,global",
            "--admission", "on", "--retention", "on", "--jobs", "1", "--json", str(out),
            "--quiet"]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["workload"]["synthetic"] == "agent" and doc["workload"]["requests"] == 30
    assert doc["config"]["admission"] is True and doc["config"]["retention"] is True
    for entry in doc["policies"].values():
        assert entry["summary"]["num_finished"] + entry["summary"]["num_rejected"] == 30
    assert "hit_vs_global" in doc["targets"]
