"""The Dispatcher's routing and retry rules against real sim worker subprocesses (issue 8, items 1,
13 and 14):

- sessions started one at a time (no load anywhere, every worker ties) spread over the workers,
  so that their later concurrent turns do too;
- a request that fails for its own reason (``invalid_grammar``, ``invalid_request``,
  ``context_too_long``) is never retried on another worker;
- an overloaded worker's request moves to another one; when every live worker is overloaded the
  error is ``WorkersBusy`` (429 + Retry-After over HTTP), not "no live worker".
"""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.protocol import Finished, Generate, SamplingSpec, TokenDelta
from engine.sampling_params import StructuredSpec
from gateway.app import GatewayConfig
from gateway.dispatch import Dispatcher, WorkerClient, WorkerError, WorkersBusy
from gateway.serve import WorkerProcess
from tests.gateway.dispatch_live import Served, serve_app, sim_request
from tests.gateway.live import sim_workers

LONG_TOKENS = 8000  # NOTE: ~45 s on a paced worker: in flight for the whole test
NUM_SESSIONS = 20
TEST_TIMEOUT_S = 60.0
_ids = iter(range(1, 10**6))


@pytest.fixture(scope="module")
def paced() -> Iterator[tuple[WorkerProcess, ...]]:
    with sim_workers(("paced-a", "cpu"), ("paced-b", "cpu")) as pair:
        yield pair


@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[WorkerProcess, ...]]:
    """Two paced workers that hold one running and one waiting request each: a third is
    refused as ``overloaded``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENTGATE_MAX_RUNNING_REQUESTS", "1")
        mp.setenv("AGENTGATE_MAX_WAITING_REQUESTS", "1")
        with sim_workers(("tiny-a", "cpu"), ("tiny-b", "cpu")) as pair:
            mp.undo()  # NOTE: the workers' environment only
            yield pair


def test_sessions_started_one_at_a_time_spread_over_the_workers(
    paced: tuple[WorkerProcess, WorkerProcess],
) -> None:
    async def main(dispatcher: Dispatcher) -> None:
        for i in range(NUM_SESSIONS):  # NOTE: one at a time: no load anywhere at each pick
            finals = [x async for x in dispatcher.generate(sim_request(2, f"s{i}"))
                      if isinstance(x, Finished)]
            assert len(finals) == 1, finals
        streams = [dispatcher.generate(sim_request(LONG_TOKENS, f"s{i}"))
                   for i in range(NUM_SESSIONS)]
        try:
            firsts = await asyncio.gather(*(anext(s) for s in streams))
            assert all(isinstance(f, TokenDelta) for f in firsts), firsts
            counts = [c.num_in_flight for c in dispatcher.clients]
            assert sum(counts) == NUM_SESSIONS and min(counts) >= 6, (
                f"in flight per worker: {counts}")
        finally:
            for stream in streams:
                await stream.aclose()  # type: ignore[attr-defined]

    _run_on(paced, main)


def test_session_turns_over_http_spread_over_the_workers(
    paced: tuple[WorkerProcess, WorkerProcess], tokenizer_dir: Path
) -> None:
    """The issue's scenario through the session API: 20 sessions, each with a first turn one at
    a time, then 20 concurrent turns (paced: ~300 tokens take seconds, so all are in flight)."""
    cfg = GatewayConfig(model_dir=tokenizer_dir, workers=(paced[0].listen, paced[1].listen),
                        model_name="demo")
    with serve_app(cfg, timeout_s=TEST_TIMEOUT_S) as served:
        sids = []
        for _ in range(NUM_SESSIONS):
            resp = served.http.post("/v1/sessions", json={"system": "Be brief."})
            assert resp.status_code in (200, 201), resp.text
            sids.append(resp.json()["id"])
            assert _turn(served, sids[-1], 2).status_code == 200
        clients = served.app.state.dispatcher.clients
        peak = [0, 0]
        with ThreadPoolExecutor(NUM_SESSIONS) as pool:
            turns = [pool.submit(_turn, served, sid, 300) for sid in sids]
            deadline = time.monotonic() + TEST_TIMEOUT_S
            while (sum(peak) < NUM_SESSIONS and not all(t.done() for t in turns)
                   and time.monotonic() < deadline):
                counts = [c.num_in_flight for c in clients]
                if sum(counts) > sum(peak):
                    peak = counts
                time.sleep(0.01)
            statuses = [t.result().status_code for t in turns]
        assert statuses == [200] * NUM_SESSIONS, statuses
        assert min(peak) >= 6, f"in flight per worker at the peak: {peak}"


@pytest.mark.parametrize("case", ["invalid_grammar", "invalid_request", "context_too_long"])
def test_a_request_that_fails_for_its_own_reason_is_not_retried(
    paced: tuple[WorkerProcess, WorkerProcess], case: str
) -> None:
    sampling = {
        "invalid_grammar": SamplingSpec(max_new_tokens=4, structured=StructuredSpec(
            json_schema='{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}')),
        "invalid_request": SamplingSpec(max_new_tokens=4, temperature=-1.0),
        "context_too_long": SamplingSpec(max_new_tokens=10**6),
    }[case]

    async def main(dispatcher: Dispatcher) -> None:
        request = Generate(request_id=f"bad{next(_ids)}", input_ids=[1, 2, 3], sampling=sampling)
        with pytest.raises(WorkerError) as info:
            async for _ in dispatcher.generate(request):
                pytest.fail(f"a {case} request streamed")
        assert info.value.code == case, info.value
        assert sum(dispatcher.num_retries.values()) == 0, dispatcher.num_retries
        assert all(c.is_alive and c.num_in_flight == 0 for c in dispatcher.clients)

    _run_on(paced, main)


def test_an_overloaded_workers_request_moves_to_another(
    tiny: tuple[WorkerProcess, WorkerProcess],
) -> None:
    async def main(dispatcher: Dispatcher) -> None:
        async with _filled(tiny[0]):
            # NOTE: the filler is another client: to this dispatcher both workers tie, the
            # first one is tried first and refuses
            finals = [x async for x in dispatcher.generate(sim_request(3))
                      if isinstance(x, Finished)]
            assert [f.completion_tokens for f in finals] == [3], finals
            assert dispatcher.num_retries["overloaded"] == 1, dispatcher.num_retries

    _run_on(tiny, main)


def test_every_worker_overloaded_is_workers_busy(
    tiny: tuple[WorkerProcess, WorkerProcess],
) -> None:
    async def main(dispatcher: Dispatcher) -> None:
        async with _filled(tiny[0]), _filled(tiny[1]):
            with pytest.raises(WorkersBusy):
                async for _ in dispatcher.generate(sim_request(3)):
                    pytest.fail("an overloaded worker streamed")
            assert dispatcher.num_retries["overloaded"] == 1, dispatcher.num_retries

    _run_on(tiny, main)


def test_every_worker_overloaded_is_429_with_retry_after(
    tiny: tuple[WorkerProcess, WorkerProcess], tokenizer_dir: Path
) -> None:
    async def fill_and_post() -> Any:
        async with _filled(tiny[0]), _filled(tiny[1]):
            return await asyncio.to_thread(served.http.post, "/v1/chat/completions", json={
                "model": "demo", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3})

    cfg = GatewayConfig(model_dir=tokenizer_dir, workers=(tiny[0].listen, tiny[1].listen),
                        model_name="demo")
    with serve_app(cfg) as served:
        resp = asyncio.run(asyncio.wait_for(fill_and_post(), TEST_TIMEOUT_S))
    assert resp.status_code == 429, (resp.status_code, resp.text)
    assert int(resp.headers["retry-after"]) >= 1, resp.headers
    assert resp.json()["error"]["type"] == "rate_limit_error", resp.text


# ---------------------------------------------------------------------- helpers


@contextlib.asynccontextmanager
async def _filled(worker: WorkerProcess) -> AsyncIterator[None]:
    """``worker`` holding one running and one waiting long request (of a client of its own)."""
    client = WorkerClient(worker.listen, first_token_timeout_s=TEST_TIMEOUT_S,
                          idle_timeout_s=TEST_TIMEOUT_S)
    await client.connect()
    streams = [client.generate(sim_request(LONG_TOKENS)) for _ in range(2)]
    pending: asyncio.Future[Any] | None = None
    try:
        assert isinstance(await anext(streams[0]), TokenDelta)
        pending = asyncio.ensure_future(anext(streams[1]))  # NOTE: waits behind the first
        for _ in range(100):
            if (await client.load()).num_waiting == 1:
                break
            await asyncio.sleep(0.05)
        assert (await client.load()).num_waiting == 1, "the second request is not waiting"
        yield
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]
        client.close()


def _run_on(
    workers: tuple[WorkerProcess, WorkerProcess],
    test: Any,
) -> None:
    async def main() -> None:
        clients = [WorkerClient(w.listen, first_token_timeout_s=TEST_TIMEOUT_S,
                                idle_timeout_s=TEST_TIMEOUT_S) for w in workers]
        try:
            for client in clients:
                await client.connect()
            await test(Dispatcher(clients))
        finally:
            for client in clients:
                client.close()

    _run(main())


def _turn(served: Served, session_id: str, max_tokens: int) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": max_tokens}
    return served.http.post(f"/v1/sessions/{session_id}/turns", json=body)


def _run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, TEST_TIMEOUT_S))
