"""The Dispatcher asking a ``gateway.routing`` router, against real sim worker subprocesses on
127.0.0.1 with real ZeroMQ event streams (``--events`` and ``--replay``): the KV index follows
the workers' events, a follow-up lands where its prefix is cached, the router hears of every
attempt's end (errors, aborts, retries too), a lost worker leaves the index and the routing, and
closing leaves no subscriber thread behind.
"""

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any

import pytest

from engine.protocol import Finished, Generate, SamplingSpec, TokenDelta
from gateway import generation
from gateway.dispatch import Dispatcher, WorkerClient
from gateway.generation import route_request
from gateway.kv_feed import resolve_endpoint
from gateway.routing.baselines import LeastLoadedRouter
from gateway.routing.types import Decision, RouteRequest
from gateway.serve import ANY_PORT, ServeError, WorkerProcess, spawn_worker
from tests.gateway.live import WORKER_START_TIMEOUT_S

TEST_TIMEOUT_S = 60.0
PROMPT_TOKENS = 400  # NOTE: 24 full pages of 16 tokens
WAIT_S = 10.0


def start_worker(worker_id: str, cost: str = "zero", replay: bool = True) -> WorkerProcess:
    try:
        return spawn_worker(model_dir=None, backend="sim", worker_id=worker_id,
                            extra_args=("--cost", cost), timeout_s=WORKER_START_TIMEOUT_S,
                            replay=ANY_PORT if replay else None)
    except ServeError as e:
        pytest.fail(str(e))


@contextlib.contextmanager
def workers(*specs: tuple[str, str, bool]) -> Iterator[list[WorkerProcess]]:
    with contextlib.ExitStack() as stack:
        out = []
        for worker_id, cost, replay in specs:
            worker = start_worker(worker_id, cost, replay)
            stack.callback(worker.stop)
            out.append(worker)
        yield out


@pytest.fixture(scope="module")
def pair() -> Iterator[list[WorkerProcess]]:
    with workers(("rd-a", "zero", True), ("rd-b", "zero", False)) as out:
        yield out


def test_the_index_follows_the_workers_events_with_and_without_replay(
    pair: list[WorkerProcess],
) -> None:
    async def main() -> None:
        async with dispatching(pair, "dynamo") as d:
            assert d.page_size == 16 and d.index_workers == 2
            placed = {}
            for i in range(4):  # NOTE: round robin on ties puts prompts on both workers
                items = await run(d, prompt(i), f"first-{i}")
                placed[i] = d.link.worker_id(_client_of(d, items))  # type: ignore[union-attr]
            assert set(placed.values()) == {"rd-a", "rd-b"}, placed
            index = d.link.index  # type: ignore[union-attr]
            for i, worker_id in placed.items():
                hashes = route_request(d, _generate(prompt(i), "x")).page_hashes
                await _until(lambda h=hashes, w=worker_id: w in _match(d, h),
                             f"prompt {i} in the index under {worker_id}")
            assert index.num_pages >= 4 * (PROMPT_TOKENS // 16 - 1)

    _run(main())


def test_a_follow_up_lands_on_the_worker_that_holds_its_prefix(pair: list[WorkerProcess]) -> None:
    async def main() -> None:
        async with dispatching(pair, "dynamo") as d:
            for i in range(10, 14):
                first = await run(d, prompt(i), f"f{i}")
                home = _client_of(d, first)
                hashes = route_request(d, _generate(prompt(i), "x")).page_hashes
                await _until(lambda h=hashes: len(_match(d, h)) > 0, "the first turn's pages")
                follow = await run(d, prompt(i) + [7] * 40, f"g{i}")
                assert _client_of(d, follow) is home, f"prompt {i} moved off its worker"
                delta = follow[0]
                assert isinstance(delta, TokenDelta) and delta.cached_tokens > 0, delta
            assert d.routing.decisions.get(("dynamo", "prefix"), 0) >= 4, d.routing.decisions

    _run(main())


def test_a_long_keyless_prompt_hashed_off_the_loop_still_finds_its_prefix(
    pair: list[WorkerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(generation, "OFF_LOOP_HASH_TOKENS", 100)

    async def main() -> None:
        async with dispatching(pair, "dynamo") as d:
            first = await _started_items(d, prompt(70), "off1")
            home = _client_of(d, first)
            hashes = route_request(d, _generate(prompt(70), "x")).page_hashes
            await _until(lambda: len(_match(d, hashes)) > 0, "the first request's pages")
            follow = await _started_items(d, prompt(70) + [9] * 30, "off2")
            assert _client_of(d, follow) is home
            assert d.routing.decisions.get(("dynamo", "prefix"), 0) >= 1, d.routing.decisions

    _run(main())


def test_the_router_hears_the_end_of_every_attempt() -> None:
    """Finished requests, a stream closed early (abort), and a retry after a worker died before
    its first token: every ``dispatched`` id gets exactly one ``finished``."""

    async def main() -> None:
        with workers(("spy-a", "cpu", True), ("spy-b", "zero", True)) as (paced, fast):
            recorder = _Recording()
            async with dispatching([paced, fast], lambda index: recorder) as d:
                await run(d, prompt(30), "done")
                stream = d.generate(_generate(prompt(31), "cut", 4000))
                assert isinstance(await anext(stream), TokenDelta)
                await stream.aclose()  # type: ignore[attr-defined]
                recorder.pin = "spy-a"  # NOTE: the paced one: its request is surely pending
                paced.stop(signal.SIGKILL)
                items = await run(d, prompt(32), "retried", max_new_tokens=4)
                assert isinstance(items[-1], Finished), items
                await _until(lambda: "spy-a" in recorder.removed, "the lost worker removed")
            dispatched, finished = recorder.dispatched_ids, recorder.finished_ids
            assert dispatched, "nothing dispatched"
            for rid in dispatched:
                assert finished.count(rid) == 1, (rid, finished)
            assert {"retried", "retried.retry1"} <= set(dispatched), dispatched
            assert set(recorder.first_token_ids) <= set(dispatched)
            assert {"done", "cut"} <= set(recorder.first_token_ids), recorder.first_token_ids

    _run(main())


def test_a_killed_worker_leaves_the_index_and_the_routing() -> None:
    async def main() -> None:
        with workers(("kill-a", "zero", True), ("kill-b", "zero", True)) as (a, b):
            async with dispatching([a, b], "dynamo") as d:
                for i in range(40, 44):
                    await run(d, prompt(i), f"k{i}")
                index = d.link.index  # type: ignore[union-attr]
                await _until(lambda: set(index.workers()) == {"kill-a", "kill-b"}, "both")
                a.stop(signal.SIGKILL)
                await _until(lambda: "kill-a" not in index.workers(), "kill-a out of the index")
                await _until(lambda: d.index_workers == 1, "one subscriber left")
                for i in range(40, 44):  # NOTE: even the prompts kill-a held
                    items = await run(d, prompt(i) + [3] * 20, f"after{i}")
                    assert d.link.worker_id(_client_of(d, items)) == "kill-b"  # type: ignore[union-attr]
                assert all(w == "kill-b" for w in _match(d, route_request(
                    d, _generate(prompt(40), "x")).page_hashes))

    _run(main())


def test_a_restarted_worker_is_followed_on_its_new_event_endpoints() -> None:
    """The same ROUTER endpoint, a new process with new (free) events and replay ports: the
    dispatcher subscribes to the ones its new ``Welcome`` announces, and routes to it again."""

    async def main() -> None:
        with workers(("re-b", "zero", True)) as (b,):
            a = start_worker("re-a")
            try:
                async with dispatching([a, b], "dynamo") as d:
                    client_a = d.clients[0]
                    first_events = client_a.welcome.events_endpoint  # type: ignore[union-attr]
                    a.stop(signal.SIGKILL)
                    await _until(lambda: d.index_workers == 1, "re-a's subscriber stopped")
                    a = _start_on(a.listen, "re-a")
                    await _until(lambda: client_a.is_alive and d.index_workers == 2,
                                 "re-a followed again")
                    assert client_a.welcome.events_endpoint != first_events  # type: ignore[union-attr]
                    await run(d, prompt(60), "back")
                    hashes = route_request(d, _generate(prompt(60), "x")).page_hashes
                    await _until(lambda: len(_match(d, hashes)) == 1, "its pages indexed")
                    for i in range(4):  # NOTE: round robin over idle workers reaches re-a
                        await run(d, prompt(61 + i), f"rr{i}")
                    assert "re-a" in d.link.index.workers()  # type: ignore[union-attr]
                    assert d.routing.workers[a.listen].requests >= 1, d.routing.workers
            finally:
                a.stop()

    _run(main())


@pytest.mark.parametrize("router", ["least-loaded", "agentgate"])
def test_ties_follow_the_configured_order_not_the_order_workers_came_up(router: str) -> None:
    """The first-listed worker comes up last: an idle pick still goes to it (it used to go to
    whichever worker's Welcome arrived first, a flake in tests/gateway/test_worker_death.py)."""

    async def main() -> None:
        with workers(("up-first", "zero", True)) as (early,):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                late_listen = f"tcp://127.0.0.1:{s.getsockname()[1]}"
            clients = [WorkerClient(endpoint, first_token_timeout_s=30.0, dead_after_s=2.0,
                                    heartbeat_s=0.5) for endpoint in (late_listen, early.listen)]
            d = Dispatcher(clients, router=router, retry_wait_s=5.0)
            for c in clients:
                c.start()
            late = None
            try:
                await clients[1].wait_welcome()
                await _until(lambda: d.link is not None and d.link.worker_id(clients[1]),
                             "up-first routable")
                late = _start_on(late_listen, "up-last")
                await clients[0].wait_welcome()
                await _until(lambda: d.link.worker_id(clients[0]) is not None,  # type: ignore[union-attr]
                             "up-last routable")
                items = await run(d, prompt(70), "idle-pick")
                assert _client_of(d, items) is clients[0], "the tie went to the worker up first"
            finally:
                for c in clients:
                    c.close()
                await d.close()
                if late is not None:
                    late.stop()

    _run(main())


def test_closing_leaves_no_subscriber_thread(pair: list[WorkerProcess]) -> None:
    async def main() -> None:
        async with dispatching(pair, "least-loaded") as d:
            await run(d, prompt(50), "t")
            assert _subscriber_threads(), "no KV event subscriber ran"
        assert not _subscriber_threads(), _subscriber_threads()

    _run(main())


def test_a_wildcard_events_host_means_the_workers_host() -> None:
    assert resolve_endpoint("tcp://0.0.0.0:5556", "tcp://10.1.2.3:5555") == "tcp://10.1.2.3:5556"
    assert resolve_endpoint("tcp://*:5556", "tcp://gpu-7:5555") == "tcp://gpu-7:5556"
    assert resolve_endpoint("tcp://127.0.0.1:9", "tcp://gpu-7:5555") == "tcp://127.0.0.1:9"
    assert resolve_endpoint("ipc:///tmp/ev", "tcp://gpu-7:5555") == "ipc:///tmp/ev"


# ---------------------------------------------------------------------- helpers


@contextlib.asynccontextmanager
async def dispatching(ws: Sequence[WorkerProcess], router: Any) -> Any:
    clients = [WorkerClient(w.listen, first_token_timeout_s=30.0, dead_after_s=2.0,
                            heartbeat_s=0.5) for w in ws]
    d = Dispatcher(clients, router=router, retry_wait_s=5.0)
    for c in clients:
        c.start()
    try:
        await asyncio.gather(*(c.wait_welcome() for c in clients))
        yield d
    finally:
        for c in clients:
            c.close()
        await d.close()


def _start_on(listen: str, worker_id: str) -> WorkerProcess:
    try:
        return spawn_worker(model_dir=None, backend="sim", worker_id=worker_id,
                            extra_args=("--cost", "zero", "--listen", listen),
                            timeout_s=WORKER_START_TIMEOUT_S, replay=ANY_PORT)
    except ServeError as e:
        pytest.fail(str(e))


def prompt(i: int) -> list[int]:
    return [(i * 7919 + j * 31) % 300 + 1 for j in range(PROMPT_TOKENS)]


def _generate(input_ids: list[int], rid: str, max_new_tokens: int = 2) -> Generate:
    return Generate(request_id=rid, input_ids=input_ids,
                    sampling=SamplingSpec(max_new_tokens=max_new_tokens, ignore_eos=True))


async def run(d: Dispatcher, input_ids: list[int], rid: str, max_new_tokens: int = 2) -> list[Any]:
    g = _generate(input_ids, rid, max_new_tokens)
    return [item async for item in d.generate(g, route_request(d, g))]


async def _started_items(d: Dispatcher, input_ids: list[int], rid: str) -> list[Any]:
    """The items of a request sent the way the HTTP handlers send it (``generation.start``)."""
    started = await generation.start(d, _generate(input_ids, rid))
    return [item async for item in started.items()]


def _client_of(d: Dispatcher, items: list[Any]) -> WorkerClient:
    """The client that ran a finished request (``Dispatcher.retain``'s memory of it)."""
    finished = items[-1]
    assert isinstance(finished, Finished), items
    client, _wire_id = d._finished_on[finished.request_id]  # NOTE: no retry: the same id
    return client


def _match(d: Dispatcher, hashes: Sequence[int]) -> dict[str, Any]:
    assert d.link is not None and d.link.feed is not None
    with d.link.feed.lock:
        return d.link.feed.index.match(hashes)


def _subscriber_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kv-events-")]


async def _until(check: Any, what: str) -> None:
    async with asyncio.timeout(WAIT_S):
        while not check():
            await asyncio.sleep(0.05)
    assert check(), what


def _run(coro: Coroutine[Any, Any, None]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(TEST_TIMEOUT_S):
            await coro

    asyncio.run(bounded())


class _Recording(LeastLoadedRouter):
    """The real least-loaded router, noting every call (``pin``: route there while it is a
    candidate, so a test knows which worker a request went to)."""

    def __init__(self) -> None:
        super().__init__()
        self.dispatched_ids: list[str] = []
        self.first_token_ids: list[str] = []
        self.finished_ids: list[str] = []
        self.removed: list[str] = []
        self.pin: str | None = None

    def route(self, req: RouteRequest, candidates: Sequence[str]) -> Decision:
        if self.pin in candidates:
            return Decision(self.pin, reason="affinity")
        return super().route(req, candidates)

    def remove_worker(self, worker_id: str) -> None:
        self.removed.append(worker_id)
        super().remove_worker(worker_id)

    def dispatched(self, req: RouteRequest, worker_id: str, now_s: float) -> None:  # type: ignore[override]
        self.dispatched_ids.append(req.request_id)
        super().dispatched(req, worker_id, now_s)

    def first_token(self, request_id: str, now_s: float) -> None:  # type: ignore[override]
        self.first_token_ids.append(request_id)
        super().first_token(request_id, now_s)

    def finished(self, request_id: str, now_s: float) -> None:  # type: ignore[override]
        self.finished_ids.append(request_id)
        super().finished(request_id, now_s)

