"""KVEventSubscriber against a real sim worker subprocess: a raw DEALER client sends Generate
requests; the index, fed over the worker's PUB and replay sockets, credits exactly the prefix
the worker then reports as cached (``Finished.cached_tokens`` of a follow-up request)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from engine.hashing import page_hashes
from engine.protocol import (
    ErrorReply,
    Finished,
    Generate,
    SamplingSpec,
    decode_worker_items,
    encode,
)
from engine.worker.events import BlockStored, EventPublisher
from gateway.routing import KVEventSubscriber, KVIndex, MatchResult
from gateway.serve import ServeError, WorkerProcess, spawn_worker
from tests.gateway.live import WORKER_START_TIMEOUT_S, free_port

PAGE = 16  # the worker's default page size
WINDOW_PAGES = 2  # the sim's demo geometry: W = 32
TIMEOUT_S = 10.0


@pytest.fixture
def worker() -> Iterator[tuple[WorkerProcess, str]]:
    replay = f"tcp://127.0.0.1:{free_port()}"
    try:
        proc = spawn_worker(model_dir=None, backend="sim", worker_id="kv0",
                            extra_args=("--cost", "zero", "--replay", replay),
                            timeout_s=WORKER_START_TIMEOUT_S)
    except ServeError as e:
        pytest.fail(str(e))
    yield proc, replay
    proc.stop()


class _Client:
    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def run(self, request_id: str, prompt: list[int], max_new_tokens: int = 4) -> Finished:
        """Send one Generate (greedy) and wait for its end."""
        sampling = SamplingSpec(max_new_tokens=max_new_tokens, temperature=0.0)
        self.sock.send(encode(Generate(request_id=request_id, input_ids=prompt,
                                       sampling=sampling)))
        while True:
            assert self.sock.poll(int(TIMEOUT_S * 1000)), f"{request_id}: no reply"
            for msg in decode_worker_items(self.sock.recv()):
                assert not isinstance(msg, ErrorReply), msg
                if isinstance(msg, Finished) and msg.request_id == request_id:
                    return msg


def _prompt(start: int, num_pages: int) -> list[int]:
    return [(start + i) % 300 + 1 for i in range(num_pages * PAGE)]


def _wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_index_follows_a_live_worker(worker: tuple[WorkerProcess, str]) -> None:
    proc, replay = worker
    client = _Client(proc.listen)
    early, late = _prompt(0, 5), _prompt(1000, 4)
    client.run("early", early)  # before anyone subscribes: only the replay can tell the index

    index = KVIndex(PAGE)
    sub = KVEventSubscriber(index, "kv0", proc.events, replay_endpoint=replay)
    sub.start()
    try:
        client.run("late", late)

        def match(prompt: list[int]) -> MatchResult:
            with sub.lock:
                return index.match(page_hashes(prompt, PAGE)).get("kv0", MatchResult(0, 0))

        # a follow-up turn: the prompt, then new tokens; its prompt end is a checkpoint
        early_next, late_next = early + [7] * 20, late + [9] * 20
        _wait_for(lambda: match(early_next).usable_pages == 5, "the replayed pages")
        _wait_for(lambda: match(late_next).usable_pages == 4, "the live pages")
        assert index.window_pages("kv0") == WINDOW_PAGES
        assert match(early_next) == MatchResult(5, 5)
        assert match(late_next) == MatchResult(4, 4)
        assert match(_prompt(2000, 3)) == MatchResult(0, 0)
        # what the worker really holds: its own window-safe hit on the same follow-ups
        assert client.run("early-next", early_next).cached_tokens == 5 * PAGE
        assert client.run("late-next", late_next).cached_tokens == 4 * PAGE
        _wait_for(lambda: sub.last_load is not None, "a load report")
        assert index.stats.resyncs == 0 and index.stats.restarts == 0
    finally:
        sub.stop()
    assert index.workers() == []


def test_worker_restart_is_forgotten() -> None:
    events, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))

    def start() -> WorkerProcess:
        try:
            return spawn_worker(model_dir=None, backend="sim", worker_id="kv1", events=events,
                                extra_args=("--cost", "zero", "--replay", replay),
                                timeout_s=WORKER_START_TIMEOUT_S)
        except ServeError as e:
            pytest.fail(str(e))

    index = KVIndex(PAGE)
    old_prompt, new_prompt = _prompt(0, 3), _prompt(500, 3)

    def usable(prompt: list[int]) -> int:
        with sub.lock:
            return index.match(page_hashes(prompt + [5] * 20, PAGE)).get(
                "kv1", MatchResult(0, 0)).usable_pages

    proc = start()
    sub = KVEventSubscriber(index, "kv1", events, replay_endpoint=replay)
    sub.start()
    try:
        _Client(proc.listen).run("old", old_prompt)
        _wait_for(lambda: usable(old_prompt) == 3, "the first instance's pages")
        _wait_for(lambda: sub.last_load is not None, "a load report")
        proc.stop()
        proc = start()
        _Client(proc.listen).run("new", new_prompt)
        _wait_for(lambda: usable(new_prompt) == 3, "the second instance's pages")
        _wait_for(lambda: usable(old_prompt) == 0, "the first instance forgotten")
        assert index.stats.restarts >= 1
    finally:
        sub.stop()
        proc.stop()


@pytest.mark.parametrize("with_replay", [True, False])
def test_gap_is_replayed_or_resynced(with_replay: bool) -> None:
    """Batches published before the SUB socket joined are lost on the stream; the first one that
    arrives shows the gap, and the replay socket (an in-process EventPublisher) fills it."""
    pub = EventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic="kv")
    stop = threading.Event()

    def serve_replays() -> None:
        while not stop.is_set():
            pub.poll_replay()
            time.sleep(0.005)

    server = threading.Thread(target=serve_replays, daemon=True)
    server.start()
    hashes = list(range(1, 200))
    pub.publish([_stored_page(hashes, 0)])  # nobody listens yet: lost on the stream
    index = KVIndex(PAGE)
    sub = KVEventSubscriber(index, "p", pub.endpoint,
                            replay_endpoint=pub.replay_endpoint if with_replay else None)
    try:
        i = 1
        deadline = time.monotonic() + TIMEOUT_S
        while not sub.poll(0.05):  # NOTE: the SUB socket joins after a while ("slow joiner")
            assert time.monotonic() < deadline, "the subscriber never joined"
            pub.publish([_stored_page(hashes, i)])
            i += 1
        assert index.stats.gaps == 1
        full = index.match(hashes[:i]).get("p", MatchResult(0, 0)).full_pages
        if with_replay:
            assert full == i and index.stats.resyncs == 0
        else:  # forgotten: only what came after the gap, which no match from page 0 reaches
            assert full == 0 and index.stats.resyncs == 1
            assert index.match(hashes[i - 1 : i]) == {"p": MatchResult(1, 0)}
    finally:
        stop.set()
        server.join()
        sub.stop()
        pub.close()


def _stored_page(hashes: list[int], i: int) -> BlockStored:
    return BlockStored(block_hashes=[hashes[i]], parent_block_hash=hashes[i - 1] if i else None,
                       token_ids=[1] * PAGE, block_size=PAGE)
