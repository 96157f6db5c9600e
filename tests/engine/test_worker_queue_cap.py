"""The worker's per-client cap on waiting requests (``--max-queued-per-client``), on a real sim
worker subprocess over ZeroMQ on 127.0.0.1: a client past its cap gets ``overloaded`` for the
excess (never silence), while another client's requests are still queued and served."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from engine.protocol import Abort, TokenDelta
from gateway.serve import WorkerProcess, spawn_worker
from tests.engine.worker_harness import (
    START_TIMEOUT_S,
    Client,
    assert_error,
    assert_finished,
    make_prompt,
    running,
)

CAP = 2
LONG_TOKENS = 2000  # NOTE: paced by --cost cpu, so it holds the one running slot for seconds


@pytest.fixture
def capped_worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[WorkerProcess]:
    """A paced sim worker that runs one request at a time (``AGENTGATE_MAX_RUNNING_REQUESTS``),
    so that the others wait, with a cap of ``CAP`` waiting requests per client."""
    monkeypatch.setenv("AGENTGATE_MAX_RUNNING_REQUESTS", "1")
    worker = spawn_worker(model_dir=None, backend="sim", worker_id="capped",
                          extra_args=["--max-queued-per-client", str(CAP), "--cost", "cpu"],
                          timeout_s=START_TIMEOUT_S)
    with running(worker):
        yield worker


def test_client_over_its_cap_is_refused_and_another_is_not(
    capped_worker: WorkerProcess, connect: Callable[[str], Client]
) -> None:
    greedy, other = connect(capped_worker.listen), connect(capped_worker.listen)
    greedy.generate("running", make_prompt(8), max_new_tokens=LONG_TOKENS)
    assert isinstance(greedy.recv(), TokenDelta)  # NOTE: it runs: the next ones must wait
    for i in range(CAP + 2):
        greedy.generate(f"q{i}", make_prompt(8), max_new_tokens=2)
    for i in (CAP, CAP + 1):
        _, last = greedy.collect(f"q{i}")
        assert_error(last, f"q{i}", "overloaded")
    other.generate("o1", make_prompt(8), max_new_tokens=2)
    other.assert_silent(0.5)  # NOTE: queued behind the running request, not refused
    for rid in ("running", "q0", "q1"):
        greedy.send(Abort(request_id=rid))
    assert_finished(other.collect("o1")[1], "length", 2)
    greedy.generate("again", make_prompt(8), max_new_tokens=2)  # NOTE: below its cap again
    assert_finished(greedy.collect("again")[1], "length", 2)


def test_the_flag_default_is_the_config_default() -> None:
    from engine.worker import cli, config

    assert cli.DEFAULT_MAX_QUEUED_PER_CLIENT == config.DEFAULT_MAX_QUEUED_PER_CLIENT
