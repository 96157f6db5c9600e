"""The worker's messages over real ZeroMQ on 127.0.0.1: the handshake, typed errors for bad
messages and requests, engine failures, and the ``agentgate worker`` command line.

Most tests share the paced sim worker subprocess of ``conftest.py``; two run a worker in a thread
(to make its engine fail, or to give it little KV memory), one the ``agentgate worker`` command
with fixed ports.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from engine.config import EngineConfig
from engine.cost import COST_PRESETS
from engine.hashing import page_hashes
from engine.protocol import PROTOCOL_VERSION, Abort, GetLoad, Hello, LoadReport, Welcome
from engine.sequence import Sequence
from engine.worker.events import BlockStored, EventSubscriber
from tests.engine.worker_harness import (
    PAGE,
    VOCAB,
    WINDOW,
    Client,
    assert_error,
    assert_finished,
    free_port,
    make_prompt,
    running,
    start_cli_worker,
    tokens,
    worker_thread,
)

# ---------------------------------------------------------------------- handshake


def test_hello_is_answered_with_the_workers_geometry(client: Client) -> None:
    client.send(Hello(version=PROTOCOL_VERSION, client_id="t"))
    welcome = client.recv()
    assert isinstance(welcome, Welcome) and len(welcome.instance_id) == 32
    assert welcome.events_endpoint and welcome.events_endpoint.startswith("tcp://127.0.0.1:")
    assert welcome == Welcome(version=PROTOCOL_VERSION, worker_id="sim-test",
                              instance_id=welcome.instance_id, model="demo",
                              page_size=PAGE, sliding_window=WINDOW, max_context=8192,
                              cost=COST_PRESETS["cpu"],
                              max_batched_tokens=welcome.max_batched_tokens,
                              events_endpoint=welcome.events_endpoint, replay_endpoint=None,
                              swa_page_events=True)
    assert welcome.max_batched_tokens > 0


def test_version_mismatch_is_refused_and_the_worker_keeps_serving(client: Client) -> None:
    client.send(Hello(version=PROTOCOL_VERSION + 1, client_id="t"))
    assert_error(client.recv(), None, "version_mismatch")
    client.send(Hello(version=PROTOCOL_VERSION, client_id="t"))
    assert isinstance(client.recv(), Welcome)


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never valid msgpack
        b"garbage",
        msgspec.msgpack.encode({"type": "no_such_message"}),
        msgspec.msgpack.encode({"type": "generate", "request_id": "x"}),  # fields missing
        [b"two", b"frames"],
    ],
    ids=["invalid-msgpack", "not-a-map", "unknown-tag", "missing-fields", "multipart"],
)
def test_malformed_message_gets_bad_message_and_serving_continues(
    client: Client, payload: bytes | list[bytes]
) -> None:
    if isinstance(payload, list):
        client.sock.send_multipart(payload)
    else:
        client.send(payload)
    assert_error(client.recv(), None, "bad_message")
    client.generate("after", make_prompt(5), max_new_tokens=2)
    assert_finished(client.collect("after")[1], "length", 2)


@pytest.mark.parametrize(
    ("prompt", "sampling", "code"),
    [
        ([1, 2, VOCAB], {}, "invalid_request"),  # token id outside the vocabulary
        ([], {}, "invalid_request"),
        ([1, 2, 3], {"temperature": -1.0}, "invalid_request"),
        ([1, 2, 3], {"max_new_tokens": 8192}, "context_too_long"),
        ([1] * 8000, {"max_new_tokens": 500}, "context_too_long"),
    ],
    ids=["token-out-of-range", "empty-prompt", "bad-temperature", "max-new-tokens", "long-prompt"],
)
def test_invalid_request_gets_a_typed_error(
    client: Client, prompt: list[int], sampling: dict[str, object], code: str
) -> None:
    client.generate("bad", prompt, **sampling)
    assert_error(client.recv(), "bad", code)


def test_duplicate_running_request_id_is_refused(client: Client) -> None:
    client.generate("dup", make_prompt(8), max_new_tokens=4000)
    client.generate("dup", make_prompt(8), max_new_tokens=4)
    before, last = client.collect("dup")
    assert_error(last, "dup", "duplicate_request")  # NOTE: the running "dup" goes on
    client.send(Abort(request_id="dup"))
    after, last = client.collect("dup")
    assert_finished(last, "abort", len(tokens(before + after)))


def test_engine_failure_fails_running_requests_and_the_worker_keeps_serving(
    connect: Callable[[str], Client], caplog: pytest.LogCaptureFixture
) -> None:
    with worker_thread(EngineConfig(backend="sim")) as worker:
        real_step, calls = worker.engine.step, iter(range(10**6))

        def step_failing_once() -> list[Sequence]:
            if next(calls) == 1:
                raise RuntimeError("injected failure")
            return real_step()

        worker.engine.step = step_failing_once  # type: ignore[method-assign]
        client = connect(worker.endpoints[0])
        client.generate("doomed", make_prompt(8), max_new_tokens=50)
        assert_error(client.collect("doomed")[1], "doomed", "internal")
        client.generate("next", make_prompt(8), max_new_tokens=5)
        assert_finished(client.collect("next")[1], "length", 5)
        client.send(GetLoad())
        report = client.recv()
        assert isinstance(report, LoadReport) and report.num_running == 0, report
    assert any("engine step failed" in r.getMessage() for r in caplog.records)


def test_request_that_cannot_fit_in_kv_memory_ends_with_context_too_long(
    connect: Callable[[str], Client],
) -> None:
    # NOTE: 1 MiB of KV holds 153 full pages of the demo geometry (about 2,400 tokens)
    with worker_thread(EngineConfig(backend="sim", kv_budget_bytes=2**20)) as worker:
        client = connect(worker.endpoints[0])
        client.generate("big-prompt", make_prompt(4000), max_new_tokens=8)
        deltas, last = client.collect("big-prompt")
        assert_error(last, "big-prompt", "context_too_long")
        assert deltas == []
        client.generate("long-output", make_prompt(100), max_new_tokens=4000)
        deltas, last = client.collect("long-output")  # fails once decoding outgrows memory
        assert_error(last, "long-output", "context_too_long")
        assert 0 < len(tokens(deltas)) < 4000
        client.generate("small", make_prompt(100), max_new_tokens=4)
        assert_finished(client.collect("small")[1], "length", 4)


# ---------------------------------------------------------------------- the command line


def test_agentgate_worker_command_serves_replays_and_exits_on_sigterm(
    connect: Callable[[str], Client],
) -> None:
    listen, events, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    worker = start_cli_worker("--backend", "sim", "--cost", "zero", "--worker-id", "cli",
                              "--listen", listen, "--events", events, "--replay", replay)
    with running(worker):  # NOTE: ends with SIGTERM, which must exit 0
        assert (worker.listen, worker.events, worker.worker_id) == (listen, events, "cli")
        client = connect(listen)
        client.send(Hello(version=PROTOCOL_VERSION, client_id="cli-test"))
        assert isinstance(client.recv(), Welcome)
        prompt = make_prompt(PAGE)
        client.generate("r", prompt, max_new_tokens=1)
        assert_finished(client.collect("r")[1], "length", 1)
        with EventSubscriber(events, replay_endpoint=replay, topic="kv") as sub:
            replayed = [e for _, batch in sub.replay(0, timeout_s=5.0) for e in batch.events]
        assert BlockStored(block_hashes=page_hashes(prompt, PAGE), parent_block_hash=None,
                           token_ids=prompt, block_size=PAGE) in replayed, replayed
