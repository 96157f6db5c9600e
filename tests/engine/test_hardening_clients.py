"""Issue 8, item 7 (worker side): requests of a client that went silent are dropped.

A gateway heartbeats every second; after a SIGKILL it says nothing more, and its requests must
not run on to completion. A raw DEALER starts a long generation on a real sim worker subprocess
and goes away; the worker's load report shows it dropped within ``--client-timeout-s``. A client
that keeps sending heartbeats keeps its request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from engine.protocol import Finished, GetLoad, LoadReport
from gateway.serve import WorkerProcess, spawn_worker
from tests.engine.worker_harness import START_TIMEOUT_S, Client, make_prompt

CLIENT_TIMEOUT_S = 2.0
# NOTE: ~15 s of paced (CPU cost model) decode: far longer than the timeout
LONG_TOKENS = 3000


@pytest.fixture(scope="module")
def watched_worker() -> Iterator[WorkerProcess]:
    worker = spawn_worker(model_dir=None, backend="sim", worker_id="client-watch",
                          extra_args=("--client-timeout-s", str(CLIENT_TIMEOUT_S)),
                          timeout_s=START_TIMEOUT_S)
    try:
        yield worker
    finally:
        worker.stop()


def test_requests_of_a_silent_client_are_dropped(
    watched_worker: WorkerProcess, connect: Callable[[str], Client]
) -> None:
    observer = connect(watched_worker.listen)
    gone = Client(watched_worker.listen)
    gone.generate("long", make_prompt(16), max_new_tokens=LONG_TOKENS, ignore_eos=True)
    _wait_for_running(observer, lambda n: n >= 1, "running long request")
    gone.close()  # NOTE: as a SIGKILLed gateway: no Abort, no more heartbeats
    dropped_s = _wait_for_running(observer, lambda n: n == 0, "drop of the request",
                                  timeout_s=CLIENT_TIMEOUT_S + 8.0)
    assert dropped_s >= CLIENT_TIMEOUT_S - 0.5, f"dropped after {dropped_s:.1f} s: too early"


def test_a_client_that_keeps_heartbeating_keeps_its_request(
    watched_worker: WorkerProcess, connect: Callable[[str], Client]
) -> None:
    client = connect(watched_worker.listen)
    client.generate("kept", make_prompt(16), max_new_tokens=LONG_TOKENS, ignore_eos=True)
    deadline = time.monotonic() + 2.5 * CLIENT_TIMEOUT_S
    finished: list[Finished] = []
    while time.monotonic() < deadline:  # NOTE: bounded: ~13 heartbeats
        client.send(GetLoad())
        end = time.monotonic() + 0.4
        while (left_s := end - time.monotonic()) > 0 and client.sock.poll(int(left_s * 1000)):
            msg = client.recv()
            if isinstance(msg, Finished):
                finished.append(msg)
    assert not finished, f"the request of a live client ended: {finished}"
    _assert_running(client, 1)


# ---------------------------------------------------------------------- helpers


def _wait_for_running(observer: Client, done: Callable[[int], bool], what: str,
                      timeout_s: float = 10.0) -> float:
    """Polls GetLoad until ``done(num_running)``; returns the seconds it took."""
    start = time.monotonic()
    while True:
        observer.send(GetLoad())
        report = observer.recv()
        assert isinstance(report, LoadReport), report
        if done(report.num_running):
            return time.monotonic() - start
        assert time.monotonic() - start < timeout_s, f"no {what} within {timeout_s} s: {report}"
        time.sleep(0.2)


def _assert_running(client: Client, expected: int) -> None:
    client.send(GetLoad())
    while not isinstance(msg := client.recv(), LoadReport):
        pass
    assert msg.num_running == expected, msg
