"""``loadtest/locust.sh`` end to end, once for the module: a sim gateway (one worker, H200
pacing) under 8 Locust agents (two of each kind) for 15 s. The run exits 0; Locust's CSV shows
turns of every kind, TTFT and ITL entries for the streamed kinds, and no failure or locustfile
exception; the gateway and its workers are gone afterwards. Skipped without locust (the
``test`` extra). The pure parts of the workload (SSE parsing, think times) are tested here too.

NOTE: locust is never imported into pytest's process: importing it monkey-patches the standard
library for gevent. ``find_spec`` only looks for it.
"""

import csv
import importlib.util
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from loadtest.locust_report import read_exceptions, read_failures, read_stats, report
from loadtest.locust_workload import (
    LoadConfig,
    Reply,
    RequestFailure,
    StreamClock,
    filler,
    read_chat_chunks,
    read_turn_events,
    sse_data,
    think_time_s,
)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "loadtest" / "locust.sh"
KINDS, STREAMED = ("rest", "sse", "ws", "chat"), ("sse", "ws", "chat")
USERS, RUN_S, STOP_TIMEOUT_S = 8, 15, 15
SCRIPT_TIMEOUT_S, CLEANUP_TIMEOUT_S = 150, 60
CONFIG = LoadConfig(api_key="", think_dist="pareto", think_scale_s=0.25, think_shape=1.5,
                    think_max_s=10.0, steps_min=2, steps_max=8, max_tokens=48,
                    tool_fraction=0.3, long_fraction=0.15, long_min_kb=8, long_max_kb=30,
                    request_timeout_s=120.0, seed=0)
needs_locust = pytest.mark.skipif(
    importlib.util.find_spec("locust") is None,
    reason="locust is not installed: pip install -e '.[test]' (or 'locust>=2.40,<3')")


@dataclass(frozen=True, slots=True)
class Run:
    rc: int
    output: str
    out: Path

    @property
    def prefix(self) -> Path:
        return self.out / "locust"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    out = tmp_path_factory.mktemp("locust")
    # NOTE: the script's and the workload's own settings come from the flags below, never from
    # the environment of whoever runs the tests (a key would need a gateway with --api-keys)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LOADTEST_", "LOCUST_")) and k != "AGENTGATE_API_KEY"}
    cmd = [str(SCRIPT), "--workers", "1", "--users", str(USERS), "--spawn-rate", str(USERS),
           "--run-time", str(RUN_S), "--stop-timeout", str(STOP_TIMEOUT_S), "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env | {"PYTHON": sys.executable}, cwd=REPO)
    try:
        output, _ = proc.communicate(timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # NOTE: SIGTERM, so that the script's trap stops the gateway; SIGKILL would orphan it
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=CLEANUP_TIMEOUT_S)
        pytest.fail(f"locust.sh ran past {SCRIPT_TIMEOUT_S} s:\n{output}")
    yield Run(proc.returncode, output, out)


@needs_locust
def test_the_run_exits_0(run: Run) -> None:
    assert run.rc == 0, _context(run)


@needs_locust
def test_every_kind_made_turns(run: Run) -> None:
    stats = read_stats(run.prefix)
    turns = {kind: stats["TURN", kind].num_requests for kind in KINDS if ("TURN", kind) in stats}
    assert all(turns.get(kind, 0) > 0 for kind in KINDS), (turns, _context(run))
    for entry in (("POST", "/v1/sessions"), ("WS", "connect"), ("GET", "/v1/models")):
        assert stats.get(entry) and stats[entry].num_requests > 0, (entry, _context(run))


@needs_locust
def test_streamed_kinds_measure_ttft_and_itl(run: Run) -> None:
    stats = read_stats(run.prefix)
    for kind in STREAMED:
        for measure in ("TTFT", "ITL"):
            row = stats.get((measure, kind))
            assert row and row.num_requests > 0 and row.p50_ms is not None, (
                measure, kind, row, _context(run))
    assert ("TTFT", "rest") not in stats, "a non-streamed turn has no TTFT"


@needs_locust
def test_no_failures_and_no_exceptions(run: Run) -> None:
    failures, exceptions = read_failures(run.prefix), read_exceptions(run.prefix)
    assert failures == [] and exceptions == [], (failures, exceptions, _context(run))
    summary = [line for line in run.output.splitlines() if line.startswith("summary:")]
    assert len(summary) == 1 and summary[0].endswith(" 0 failures"), run.output


@needs_locust
def test_the_reports_are_written(run: Run) -> None:
    for name in ("locust_stats.csv", "locust_failures.csv", "report.html", "gateway.log"):
        assert (run.out / name).stat().st_size > 0, (name, _context(run))
    assert report(run.prefix) in run.output, run.output


@needs_locust
def test_nothing_is_left_running(run: Run) -> None:
    roles = [line.split() for line in (run.out / "pids").read_text().splitlines()]
    pids = {int(pid): role for role, pid in roles}
    assert list(pids.values()).count("gateway") == 1 and "worker" in pids.values(), pids
    alive = {pid: role for pid, role in pids.items() if _alive(pid)}
    assert alive == {}, alive
    # NOTE: and whatever the pids file missed: every process of the run names OUT/model
    strays = [pid for pid in _all_pids() if str(run.out).encode() in _cmdline(pid)]
    assert strays == [], [_cmdline(pid) for pid in strays]


def test_sse_data_parses_events_split_anywhere() -> None:
    body = b'data: {"a": 1}\n\nevent: error\ndata: {"b": [2]}\n\n: ping\ndata: [DONE]\n\ndata: 3\n'
    expected = [{"a": 1}, {"b": [2]}]
    for size in (1, 2, 7, len(body)):
        chunks = [body[i:i + size] for i in range(0, len(body), size)]
        assert list(sse_data(chunks)) == expected, size


def test_read_chat_chunks_joins_tool_call_deltas_and_times_content() -> None:
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "find", "arguments": ""}}
    chunks = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hi"}),
              _chunk({"tool_calls": [call]}),
              _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"q": '}}]}),
              _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"x"}'}}]}),
              _chunk({}, "tool_calls"), {"choices": [], "usage": {"completion_tokens": 9}}]
    clock = StreamClock(start=0.0)
    reply, num_tokens = read_chat_chunks(iter(chunks), clock)
    joined = {**call, "function": {"name": "find", "arguments": '{"q": "x"}'}}
    del joined["index"]
    assert reply == Reply("Hi", [joined]) and num_tokens == 9, reply
    assert len(clock.times) == 1, "only the non-empty content delta is a content event"


def test_readers_name_what_failed() -> None:
    clock = StreamClock(start=0.0)
    error = {"error": {"message": "lost", "type": "server_error", "code": None}}
    busy = {"type": "error", "error": {"type": "invalid_request_error",
                                       "code": "turn_in_progress"}}
    with pytest.raises(RequestFailure, match="^SSE error event server_error$"):
        read_chat_chunks(iter([_chunk({"content": "a"}), error]), clock)
    with pytest.raises(RequestFailure, match="^no finish_reason$"):
        read_chat_chunks(iter([_chunk({"content": "a"})]), clock)
    with pytest.raises(RequestFailure, match="^WS error frame turn_in_progress$"):
        read_turn_events(iter([busy]), clock, "WS error frame")
    with pytest.raises(RequestFailure, match="^no turn_end$"):
        read_turn_events(iter([{"type": "turn_start"}, {"type": "delta", "content": "a"}]), clock)


def test_think_times_are_capped_and_heavy_tailed() -> None:
    rng = random.Random(0)
    for cfg in (CONFIG, replace(CONFIG, think_dist="lognormal", think_shape=1.0)):
        draws = sorted(think_time_s(rng, cfg) for _ in range(20_000))
        assert draws[0] > 0 and draws[-1] <= cfg.think_max_s, (cfg.think_dist, draws[0],
                                                              draws[-1])
        median, p99 = draws[len(draws) // 2], draws[int(len(draws) * 0.99)]
        assert p99 > 5 * median, (cfg.think_dist, median, p99)


def test_filler_and_stream_clock() -> None:
    text = filler(random.Random(1), 30 * 1024)
    assert 30 * 1024 <= len(text) < 30 * 1024 + 20, len(text)
    clock = StreamClock(start=0.0)
    clock.times = [0.1, 0.15, 0.35]
    assert clock.ttft_ms == pytest.approx(100) and clock.itl_ms == pytest.approx([50, 200])


def _chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # NOTE: a zombie has exited


def _all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _context(run: Run) -> str:
    """The script's output and the ends of the logs, for a failure message."""
    logs = [f"--- {name}:\n" + "\n".join((run.out / name).read_text().splitlines()[-20:])
            for name in ("locust.log", "gateway.log") if (run.out / name).exists()]
    failures = run.prefix.with_name("locust_failures.csv")
    rows = list(csv.reader(failures.open())) if failures.exists() else []
    return "\n".join([f"rc={run.rc}", run.output, *logs, f"failures: {rows}"])
