"""WorkerClient and Dispatcher against real sim worker subprocesses on 127.0.0.1.

Two workers are shared by the module: "paced" (``--cost cpu``, ~6 ms a step, so a long request
is surely still running when a test cuts it) and "fast" (``--cost zero``). The tests that kill a
worker start their own paced one. Each test runs its coroutine with ``asyncio.run`` under a
bounded ``asyncio.timeout``.
"""

import asyncio
import contextlib
import signal
import socket
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest

from engine.protocol import PROTOCOL_VERSION, Finished, Generate, SamplingSpec, TokenDelta
from gateway.dispatch import (
    Dispatcher,
    DispatchTimeout,
    HandshakeError,
    WorkerClient,
    WorkerDead,
    WorkerError,
)
from gateway.serve import WorkerProcess
from tests.gateway.dispatch_live import sim_request
from tests.gateway.live import sim_workers

LONG_TOKENS = 8000  # NOTE: the demo max_context is 8192; ~45 s on a paced worker
_TEST_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[WorkerProcess, ...]]:
    with sim_workers(("paced", "cpu"), ("fast", "zero")) as pair:
        yield pair


# ---------------------------------------------------------------------- WorkerClient


def test_connect_returns_the_workers_welcome(workers: tuple[WorkerProcess, WorkerProcess]) -> None:
    async def main() -> None:
        client = await _make_client(workers[0])
        try:
            assert client.welcome is not None and client.is_alive
            assert (client.welcome.version, client.welcome.worker_id) == (
                PROTOCOL_VERSION, "paced"), client.welcome
            assert client.name == "paced"
        finally:
            client.close()

    _run(main())


def test_concurrent_streams_each_end_with_one_finished(
    workers: tuple[WorkerProcess, WorkerProcess],
) -> None:
    async def one(client: WorkerClient, n: int) -> tuple[int, list[Finished]]:
        tokens, finals = 0, []
        async with contextlib.aclosing(client.generate(sim_request(n))) as stream:
            async for item in stream:
                if isinstance(item, TokenDelta):
                    assert not finals, f"a delta after Finished: {item}"
                    tokens += len(item.token_ids)
                else:
                    finals.append(item)
        return tokens, finals

    async def main() -> None:
        client = await _make_client(workers[1])
        try:
            sizes = [5 + 7 * i for i in range(8)]
            results = await asyncio.gather(*(one(client, n) for n in sizes))
            for n, (tokens, finals) in zip(sizes, results, strict=True):
                assert len(finals) == 1, f"{n} tokens: {finals}"
                _assert_finished(finals[0], "length", n)
                assert tokens == n, f"streamed {tokens} tokens, Finished says {n}"
            assert client.num_in_flight == 0
        finally:
            client.close()

    _run(main())


def test_aclose_mid_stream_aborts_the_request(workers: tuple[WorkerProcess, WorkerProcess]) -> None:
    async def main() -> None:
        client = await _make_client(workers[0])
        try:
            stream = client.generate(sim_request(LONG_TOKENS))
            assert isinstance(await anext(stream), TokenDelta)
            assert (await client.load()).num_running == 1, "the request ended by itself"
            await stream.aclose()
            assert client.num_in_flight == 0
            await _assert_stops_running(client)
        finally:
            client.close()

    _run(main())


Workers = tuple[WorkerProcess, WorkerProcess]


def test_close_aborts_what_is_in_flight(workers: tuple[WorkerProcess, WorkerProcess]) -> None:
    """A gateway that shuts down (or ends its requests at the drain timeout) leaves nothing
    running on a worker it attached to."""

    async def main() -> None:
        client, watcher = await _make_client(workers[0]), await _make_client(workers[0])
        try:
            stream = client.generate(sim_request(LONG_TOKENS))
            assert isinstance(await anext(stream), TokenDelta)
            assert (await watcher.load()).num_running == 1, "the request ended by itself"
            client.close()
            await _assert_stops_running(watcher)
        finally:
            client.close()
            watcher.close()

    _run(main())


def test_first_token_timeout_raises_and_aborts(workers: Workers) -> None:
    async def main() -> None:
        client = await _make_client(workers[0])
        try:
            stream = client.generate(sim_request(LONG_TOKENS), first_token_timeout_s=1e-6)
            with pytest.raises(DispatchTimeout):
                await anext(stream)
            assert client.num_in_flight == 0 and client.is_alive
            await _assert_stops_running(client)
        finally:
            client.close()

    _run(main())


def test_connect_without_a_worker_raises_handshake_error() -> None:
    async def main() -> None:
        with socket.socket() as s:  # NOTE: a free port nobody listens on
            s.bind(("127.0.0.1", 0))
            endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        client = WorkerClient(endpoint, connect_timeout_s=0.3)
        started = time.monotonic()
        with pytest.raises(HandshakeError):
            await client.connect()
        assert time.monotonic() - started < 2.0 and not client.is_alive

    _run(main())


async def _assert_stops_running(client: WorkerClient) -> None:
    for _ in range(50):  # NOTE: the Abort lands within a step or two
        if (report := await client.load()).num_running == 0:
            break
        await asyncio.sleep(0.05)
    assert (report.num_running, report.num_waiting) == (0, 0), report


def test_invalid_request_raises_worker_error(workers: tuple[WorkerProcess, WorkerProcess]) -> None:
    async def main() -> None:
        client = await _make_client(workers[0])
        try:
            bad = Generate(request_id="bad", input_ids=[], sampling=SamplingSpec())
            with pytest.raises(WorkerError) as info:
                async for _ in client.generate(bad):
                    pytest.fail("an empty prompt streamed")
            assert info.value.code == "invalid_request", info.value
            assert client.num_in_flight == 0 and client.is_alive
        finally:
            client.close()

    _run(main())


def test_killed_worker_fails_a_started_stream(victim: WorkerProcess) -> None:
    dead_after_s = 1.0

    async def main() -> None:
        client = await _make_client(victim, dead_after_s=dead_after_s)
        try:
            stream = client.generate(sim_request(LONG_TOKENS))
            assert isinstance(await anext(stream), TokenDelta)
            victim.stop(signal.SIGKILL)
            killed_at = time.monotonic()
            with pytest.raises(WorkerDead) as info:
                async for _ in stream:
                    pass
            waited_s = time.monotonic() - killed_at
            assert info.value.started, info.value
            assert waited_s < dead_after_s + 1.0, f"death noticed after {waited_s:.2f} s"
            assert not client.is_alive and client.num_in_flight == 0
        finally:
            client.close()

    _run(main())


# ---------------------------------------------------------------------- Dispatcher


def test_dispatcher_retries_a_request_whose_worker_died_before_streaming(
    victim: WorkerProcess, workers: tuple[WorkerProcess, WorkerProcess],
) -> None:
    async def main() -> None:
        doomed = await _make_client(victim, dead_after_s=1.0)
        spare = await _make_client(workers[1], dead_after_s=1.0)
        dispatcher = Dispatcher([doomed, spare])
        try:
            assert dispatcher.pick("s") is doomed  # NOTE: both idle, the first one wins
            victim.stop(signal.SIGKILL)
            finals = [
                item async for item in dispatcher.generate(sim_request(6, session_id="s"))
                if isinstance(item, Finished)
            ]
            assert len(finals) == 1, finals
            _assert_finished(finals[0], "length", 6)
            assert not doomed.is_alive and dispatcher.pick("s") is spare
        finally:
            doomed.close()
            spare.close()

    _run(main())


def test_dispatcher_keeps_a_session_on_its_worker(
    workers: tuple[WorkerProcess, WorkerProcess],
) -> None:
    async def main() -> None:
        a, b = await _make_client(workers[0]), await _make_client(workers[1])
        dispatcher = Dispatcher([a, b])
        try:
            busy = a.generate(sim_request(LONG_TOKENS))
            assert isinstance(await anext(busy), TokenDelta)  # a now has one in flight
            assert dispatcher.pick("s1") is b and dispatcher.pick() is b
            await busy.aclose()
            assert a.num_in_flight == 0
            first = [i async for i in dispatcher.generate(sim_request(3, session_id="s1"))]
            assert isinstance(first[-1], Finished), first
            holder = b.generate(sim_request(LONG_TOKENS))  # b now busier than a
            assert isinstance(await anext(holder), TokenDelta)
            assert dispatcher.pick("s1") is b, "the session left its live worker"
            assert dispatcher.pick("s2") is a and dispatcher.pick() is a
            await holder.aclose()
        finally:
            a.close()
            b.close()

    _run(main())


# ---------------------------------------------------------------------- helpers


def _run(coro: Coroutine[Any, Any, None]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(_TEST_TIMEOUT_S):
            await coro

    asyncio.run(bounded())


async def _make_client(worker: WorkerProcess, dead_after_s: float = 3.0) -> WorkerClient:
    client = WorkerClient(
        worker.listen, connect_timeout_s=10.0, first_token_timeout_s=10.0, idle_timeout_s=10.0,
        heartbeat_s=dead_after_s / 4, dead_after_s=dead_after_s,
    )
    await client.connect()
    return client


def _assert_finished(last: object, reason: str, completion_tokens: int) -> None:
    assert isinstance(last, Finished), f"expected Finished({reason!r}), got {last}"
    assert (last.finish_reason, last.completion_tokens) == (reason, completion_tokens), last


