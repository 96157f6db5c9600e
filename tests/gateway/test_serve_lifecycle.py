"""``agentgate serve`` as a process supervisor, with real signals: SIGTERM and SIGINT drain and
leave no worker behind, workers die with a SIGKILLed gateway, and a worker killed with -9 is
reaped and restarted on the same port."""

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.live import free_port, spawn_serve
from tests.gateway.serve_proc import ServeProc, alive, proc_state, serve_proc, wait_until

WORKERS_GONE_S = 15.0  # NOTE: generous for a noisy 2-core box; the mechanism takes ~1 s


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_gateway_and_its_workers(
    sim_model_dir: Path, tmp_path: Path, sig: int
) -> None:
    with serve_proc(sim_model_dir, tmp_path, "--workers", "2") as serve:
        pids = wait_until(lambda: len(serve.worker_pids()) == 2 and serve.worker_pids(), 30,
                          "two workers")
        assert serve.chat()["usage"]["completion_tokens"] == 3
        rc = serve.stop(sig)
        assert rc == 0, serve.output()
        wait_until(lambda: not alive(pids), WORKERS_GONE_S, f"workers {pids} gone after {sig}")


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGINT"])
def test_signal_while_workers_start_stops_them(
    sim_model_dir: Path, tmp_path: Path, sig: int, status: int
) -> None:
    """A signal while ``serve`` still waits for its first worker: every worker spawned so far is
    stopped, and SIGTERM (a supervisor's stop) is a clean exit 0, as it is once serving; SIGINT
    (Ctrl-C) keeps the shell's 130. ``serve`` starts with SIGINT ignored, as a shell starts a
    background job (``agentgate serve &``, nohup, CI): it must still honour it, as it does
    once serving."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = spawn_serve(sim_model_dir, port, "--workers", "2", stdout=log,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    serve = ServeProc(proc, port, log_path)
    pids: list[int] = []
    try:
        pids = wait_until(serve.worker_pids, 30, "the first worker spawned")
        assert serve.stop(sig) == status, serve.output()
        assert "gateway on http" not in serve.output(), "it was serving already"
        wait_until(lambda: not alive(pids), WORKERS_GONE_S, f"workers {pids} gone after {sig}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in alive(pids):
            os.kill(pid, signal.SIGKILL)


def test_workers_die_with_a_sigkilled_gateway(sim_model_dir: Path, tmp_path: Path) -> None:
    with serve_proc(sim_model_dir, tmp_path, "--workers", "2") as serve:
        pids = wait_until(lambda: len(serve.worker_pids()) == 2 and serve.worker_pids(), 30,
                          "two workers")
        serve.stop(signal.SIGKILL)
        wait_until(lambda: not alive(pids), WORKERS_GONE_S,
                   f"workers {alive(pids)} still running after the gateway was killed")


def test_sigterm_drains_short_requests_and_ends_long_ones_with_an_error(
    sim_model_dir: Path, tmp_path: Path
) -> None:
    """``--cost cpu`` paces the sim worker (~6 ms a step): 100 tokens finish within the drain
    timeout, 4000 tokens (~25 s) do not and end with an SSE error event and [DONE]."""
    args = ("--workers", "1", "--cost", "cpu", "--drain-timeout", "4")
    with serve_proc(sim_model_dir, tmp_path, *args) as serve:
        [pid] = serve.worker_pids()
        short, long = _Stream(serve, 100), _Stream(serve, 4000)
        wait_until(lambda: short.started.is_set() and long.started.is_set(), 30, "two streams")
        sent_at = time.monotonic()
        serve.proc.send_signal(signal.SIGTERM)
        short.thread.join(30)
        long.thread.join(30)
        ended_s = time.monotonic() - sent_at
        assert short.events[-2:-1] and json.loads(short.events[-2])["choices"][0][
            "finish_reason"] == "length", short.events[-3:]
        assert short.events[-1] == "[DONE]", short.events[-3:]
        assert long.events[-1] == "[DONE]", long.events[-3:]
        assert "error" in json.loads(long.events[-2]), long.events[-3:]
        assert ended_s < 20, f"the long stream ended {ended_s:.1f} s after SIGTERM"
        assert serve.proc.wait(30) == 0, serve.output()
        wait_until(lambda: not alive([pid]), WORKERS_GONE_S, "the worker gone")


def test_killed_worker_is_reaped_and_restarted_on_the_same_port(
    sim_model_dir: Path, tmp_path: Path
) -> None:
    with serve_proc(sim_model_dir, tmp_path, "--workers", "1") as serve:
        [pid] = serve.worker_pids()
        [endpoint] = _listen_endpoints(serve.output())
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: proc_state(pid) is None, 10, f"worker {pid} reaped (no zombie)")
        wait_until(lambda: len(_listen_endpoints(serve.output())) == 2, 60,
                   "the start line of a restarted worker")
        assert _listen_endpoints(serve.output()) == [endpoint, endpoint], serve.output()
        [new_pid] = serve.worker_pids()
        assert new_pid != pid
        assert re.search(r"worker w0 .*exited.*-9|worker w0 .*SIGKILL", serve.output()), (
            serve.output())
        reply = wait_until(lambda: _try_chat(serve), 30, "a chat completion after the restart")
        assert reply["usage"]["completion_tokens"] == 3
        metrics = httpx.get(f"{serve.base_url}/metrics", timeout=10).text
        assert f'agentgate_worker_restarts_total{{worker="{endpoint}"}} 1.0' in metrics, metrics


class _Stream:
    """A streamed chat completion read in a thread; ``events`` are its SSE data lines."""

    def __init__(self, serve: ServeProc, max_tokens: int) -> None:
        self.events: list[str] = []
        self.started = threading.Event()
        body = {"model": "m", "messages": [{"role": "user", "content": "count"}],
                "max_tokens": max_tokens, "stream": True}
        self.thread = threading.Thread(target=self._read, args=(serve.base_url, body),
                                       daemon=True)
        self.thread.start()

    def _read(self, base_url: str, body: dict[str, Any]) -> None:
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                          timeout=60) as resp:
            for line in _data_lines(resp.iter_lines()):
                self.events.append(line)
                if '"content"' in line:
                    self.started.set()


def _data_lines(lines: Iterator[str]) -> Iterator[str]:
    try:
        for line in lines:
            if line.startswith("data: "):
                yield line.removeprefix("data: ")
    except httpx.HTTPError:
        return


def _listen_endpoints(output: str) -> list[str]:
    return re.findall(r"worker w0 listening on (\S+),", output)


def _try_chat(serve: ServeProc) -> dict[str, Any] | None:
    try:
        return serve.chat(timeout_s=10)
    except OSError:
        return None
