"""``agentgate serve --gateway-procs N`` (issue 10): N gateway processes on one port over the
same workers, with sessions in Redis. Real processes and real signals: both processes answer
(each scrape names the one that answered), a session's turns work whichever process takes them,
a killed gateway process is restarted, SIGTERM to the parent and SIGKILL of the parent both
leave nothing running; without Redis it refuses to start, saying why."""

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.live import free_port
from tests.gateway.serve_proc import (
    ServeProc,
    _cmdline,
    alive,
    children,
    post_json,
    serve_proc,
    wait_until,
)

PROCS = 2


@pytest.fixture
def served(sim_model_dir: Path, tmp_path: Path, redis_url: str) -> Iterator[ServeProc]:
    with serve_proc(sim_model_dir, tmp_path, "--gateway-procs", str(PROCS), "--redis",
                    redis_url) as serve:
        try:
            yield serve
        finally:
            pids = _gateway_pids(serve)
            if serve.proc.poll() is None:
                serve.proc.kill()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _gateway_pids(serve: ServeProc) -> list[int]:
    return [pid for pid in alive(children(serve.proc.pid)) if b"gateway.procs" in _cmdline(pid)]


def _answering(serve: ServeProc, timeout_s: float = 30.0) -> set[str]:
    """The process indexes that answered ``/metrics`` over fresh connections (until all have,
    or ``timeout_s``: the parent's own server starts after the others)."""
    seen = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{serve.base_url}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("agentgate_gateway_process{"):
                    seen.add(line.split('index="')[1].split('"')[0])
        if len(seen) == PROCS:
            break
    return seen


def test_every_process_answers_and_sessions_work_across_them(served: ServeProc) -> None:
    assert len(_gateway_pids(served)) == PROCS - 1
    assert _answering(served) == {str(i) for i in range(PROCS)}
    session = post_json(f"{served.base_url}/v1/sessions", {})
    for turn in range(6):  # NOTE: each on a fresh connection, so on either process
        end = post_json(f"{served.base_url}/v1/sessions/{session['id']}/turns",
                        {"messages": [{"role": "user", "content": f"turn {turn}"}],
                         "max_tokens": 2})
        assert end["turn"] == turn, end
    assert served.chat()["usage"]["completion_tokens"] == 3


def test_a_killed_gateway_process_is_restarted(served: ServeProc) -> None:
    (old,) = _gateway_pids(served)
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: "gateway process gateway-1 restarted" in served.output(), 60,
               "the gateway process restarted (serving again)")
    assert len([p for p in _gateway_pids(served) if p != old]) == 1
    assert _answering(served) == {str(i) for i in range(PROCS)}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_parent_leaves_nothing_running(served: ServeProc, sig: int) -> None:
    pids = [*_gateway_pids(served), *served.worker_pids()]
    assert len(pids) == PROCS  # NOTE: one more gateway process, one worker
    served.proc.send_signal(sig)
    served.proc.wait(60)
    wait_until(lambda: not alive(pids), 30, f"every child gone after signal {sig}")


def test_several_processes_without_redis_are_refused(sim_model_dir: Path) -> None:
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--backend", "sim", "--model",
           str(sim_model_dir), "--port", str(free_port()), "--gateway-procs", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--gateway-procs 2 needs --redis" in done.stderr
    assert "engine.worker" not in done.stderr  # NOTE: refused before any worker started
