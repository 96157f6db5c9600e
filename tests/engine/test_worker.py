"""The worker process over real ZeroMQ on 127.0.0.1: handshake, streaming, errors, KV events, load.

Most tests share one sim worker subprocess (``--backend sim``, paced by the CPU cost model, so a
long request is reliably still running when it is aborted); one runs the native backend on a tiny
checkpoint, one the ``agentgate worker`` command with fixed ports, one a worker in a thread (to
make its engine fail).
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import zmq

from engine.config import EngineConfig
from engine.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSubscriber,
    KVEvent,
    SwaCheckpointDropped,
    SwaCheckpointStored,
    decode_batch,
)
from engine.hashing import page_hashes
from engine.kv.prefix_cache import CacheEvent
from engine.protocol import (
    PROTOCOL_VERSION,
    Abort,
    ErrorReply,
    Finished,
    Flush,
    Generate,
    GetLoad,
    Hello,
    LoadReport,
    SamplingSpec,
    TokenDelta,
    Welcome,
    WorkerMsg,
    decode_worker,
    encode,
)
from engine.sequence import Sequence
from engine.worker import Worker, WorkerConfig
from engine.worker_events import KVEventBuffer

ROOT = Path(__file__).resolve().parents[2]
ANY_PORT = "tcp://127.0.0.1:0"
PAGE = 16  # the worker's default page size
VOCAB = 320  # the demo geometry of the sim worker
WINDOW = 32
_START_TIMEOUT_S = 60.0
_REPLY_TIMEOUT_S = 10.0
_LINE = re.compile(r"worker (\S+) listening on (\S+), events on (\S+)")
_prompt_ids = iter(range(1, 10**6))


# ---------------------------------------------------------------------- worker processes


@dataclass
class WorkerProc:
    proc: subprocess.Popen[str]
    worker_id: str
    listen: str
    events: str
    stderr: list[str] = field(default_factory=list)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def _start_worker(*flags: str, command: tuple[str, ...] = ("-m", "engine.worker")) -> WorkerProc:
    """Start a worker and wait for its "listening" line (bounded); the caller stops it."""
    proc = subprocess.Popen(
        [sys.executable, *command, *flags], cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )
    lines: list[str] = []  # NOTE: appended by the pump thread for the worker's whole life
    threading.Thread(target=_pump, args=(proc, lines), daemon=True).start()
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        if m := next(filter(None, map(_LINE.search, list(lines))), None):
            return WorkerProc(proc, m[1], m[2], m[3], lines)
        time.sleep(0.05)
    proc.kill()
    proc.wait(timeout=10)
    pytest.fail(f"worker did not start (rc={proc.returncode}):\n{''.join(lines)}")


def _pump(proc: subprocess.Popen[str], lines: list[str]) -> None:
    assert proc.stderr is not None
    lines.extend(proc.stderr)  # NOTE: keeps the pipe drained


@contextmanager
def _running(worker: WorkerProc) -> Iterator[WorkerProc]:
    """Stops ``worker`` on exit (SIGTERM, which must exit 0); a failure shows the worker's log."""
    try:
        yield worker
    except BaseException as e:
        worker.stop(signal.SIGKILL)
        raise AssertionError(f"{e}\n--- worker log ---\n{''.join(worker.stderr)}") from e
    rc = worker.stop(signal.SIGTERM)
    assert rc == 0, f"worker exited with {rc}:\n{''.join(worker.stderr)}"


@pytest.fixture(scope="module")
def sim_worker() -> Iterator[WorkerProc]:
    worker = _start_worker("--backend", "sim", "--listen", ANY_PORT, "--events", ANY_PORT,
                           "--worker-id", "sim-test")
    try:
        yield worker
    finally:
        worker.stop()


# ---------------------------------------------------------------------- clients


class Client:
    """A DEALER on the worker's ROUTER, with bounded waits."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, msg: object) -> None:
        self.sock.send(msg if isinstance(msg, bytes) else encode(msg))  # type: ignore[arg-type]

    def recv(self, timeout_s: float = _REPLY_TIMEOUT_S) -> WorkerMsg:
        assert self.sock.poll(int(timeout_s * 1000)), f"no reply within {timeout_s} s"
        return decode_worker(self.sock.recv())

    def assert_silent(self, timeout_s: float = 0.3) -> None:
        if self.sock.poll(int(timeout_s * 1000)):
            pytest.fail(f"unexpected reply: {decode_worker(self.sock.recv())}")

    def generate(self, request_id: str, prompt: list[int], **sampling: object) -> None:
        spec = SamplingSpec(**sampling)  # type: ignore[arg-type]
        self.send(Generate(request_id=request_id, input_ids=prompt, sampling=spec))

    def collect(self, request_id: str) -> tuple[list[TokenDelta], Finished | ErrorReply]:
        """Deltas of one request until its last message (other requests' replies are skipped)."""
        deltas: list[TokenDelta] = []
        while True:
            msg = self.recv()
            if getattr(msg, "request_id", None) != request_id:
                continue
            if isinstance(msg, TokenDelta):
                deltas.append(msg)
            else:
                assert isinstance(msg, Finished | ErrorReply), msg
                return deltas, msg

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def connect() -> Iterator[Callable[[str], Client]]:
    clients: list[Client] = []

    def make(endpoint: str) -> Client:
        clients.append(Client(endpoint))
        return clients[-1]

    yield make
    for c in clients:
        c.close()


@pytest.fixture
def client(sim_worker: WorkerProc, connect: Callable[[str], Client]) -> Client:
    return connect(sim_worker.listen)


def _make_prompt(n: int) -> list[int]:
    """A prompt no other test uses (so its pages are new to the cache)."""
    k = next(_prompt_ids)
    return [(k * 7919 + i * 31) % 300 for i in range(n)]


def _tokens(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def _assert_finished(last: object, reason: str, completion_tokens: int) -> Finished:
    assert isinstance(last, Finished), f"expected Finished({reason!r}), got {last}"
    assert (last.finish_reason, last.completion_tokens) == (reason, completion_tokens), last
    return last


def _assert_error(msg: object, request_id: str | None, code: str) -> None:
    assert isinstance(msg, ErrorReply), f"expected ErrorReply({code!r}), got {msg}"
    assert (msg.request_id, msg.code) == (request_id, code), msg


# ---------------------------------------------------------------------- handshake, streaming


def test_hello_is_answered_with_the_workers_geometry(client: Client) -> None:
    client.send(Hello(version=PROTOCOL_VERSION, client_id="t"))
    welcome = client.recv()
    assert welcome == Welcome(version=PROTOCOL_VERSION, worker_id="sim-test", model="demo",
                              page_size=PAGE, sliding_window=WINDOW, max_context=8192)


def test_version_mismatch_is_refused_and_the_worker_keeps_serving(client: Client) -> None:
    client.send(Hello(version=PROTOCOL_VERSION + 1, client_id="t"))
    _assert_error(client.recv(), None, "version_mismatch")
    client.send(Hello(version=PROTOCOL_VERSION, client_id="t"))
    assert isinstance(client.recv(), Welcome)


def test_generate_streams_deltas_then_one_finished(client: Client) -> None:
    prompt = _make_prompt(20)
    client.generate("r", prompt, max_new_tokens=8)  # no Hello first: accepted
    deltas, last = client.collect("r")
    _assert_finished(last, "length", 8)
    assert len(_tokens(deltas)) == 8 and all(0 <= t < VOCAB for t in _tokens(deltas))
    assert (last.prompt_tokens, last.cached_tokens, last.cached_tokens_host) == (20, 0, 0)
    client.assert_silent()


def test_two_concurrent_streams_interleave_and_each_finishes_once(
    sim_worker: WorkerProc, connect: Callable[[str], Client]
) -> None:
    a, b = connect(sim_worker.listen), connect(sim_worker.listen)
    for c in (a, b):  # NOTE: the same request id from two clients: ids are per client
        c.generate("same-id", _make_prompt(24), max_new_tokens=20)
    poller = zmq.Poller()
    for c in (a, b):
        poller.register(c.sock, zmq.POLLIN)
    timeline: list[tuple[str, WorkerMsg]] = []
    deadline = time.monotonic() + _REPLY_TIMEOUT_S
    while sum(isinstance(m, Finished) for _, m in timeline) < 2 and time.monotonic() < deadline:
        for sock, _ in poller.poll(100):
            timeline.append(("a" if sock is a.sock else "b", decode_worker(sock.recv())))
    for name, c in (("a", a), ("b", b)):
        msgs = [m for n, m in timeline if n == name]
        _assert_finished(msgs[-1], "length", 20)
        assert sum(isinstance(m, Finished) for m in msgs) == 1, msgs
        assert len(_tokens([m for m in msgs if isinstance(m, TokenDelta)])) == 20
        c.assert_silent()
    first_finished = next(i for i, (_, m) in enumerate(timeline) if isinstance(m, Finished))
    senders = {n for n, m in timeline[:first_finished] if isinstance(m, TokenDelta)}
    assert senders == {"a", "b"}, f"streams did not interleave: {timeline}"


def test_repeated_prompt_reports_cached_tokens(client: Client) -> None:
    prompt = _make_prompt(4 * PAGE)
    cached = []
    for rid in ("first", "second"):
        client.generate(rid, prompt, max_new_tokens=3)
        deltas, last = client.collect(rid)
        last = _assert_finished(last, "length", 3)
        assert deltas[0].cached_tokens == last.cached_tokens == last.cached_tokens_device
        assert all(d.cached_tokens == 0 for d in deltas[1:])
        cached.append(last.cached_tokens)
    # the last prompt token is always recomputed, so the hit stops at the page before it
    assert cached == [0, 3 * PAGE], cached


def test_abort_mid_stream_ends_with_finished_abort(client: Client) -> None:
    client.generate("long", _make_prompt(10), max_new_tokens=4000)
    first = client.recv()
    assert isinstance(first, TokenDelta), first
    client.send(Abort(request_id="long"))
    deltas, last = client.collect("long")
    received = len(_tokens([first, *deltas]))
    last = _assert_finished(last, "abort", received)
    assert received < 4000
    client.send(Abort(request_id="long"))  # already finished: ignored
    client.send(Abort(request_id="never-sent"))
    client.send(GetLoad())
    assert isinstance(client.recv(), LoadReport)  # nothing came before it


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
    _assert_error(client.recv(), None, "bad_message")
    client.generate("after", _make_prompt(5), max_new_tokens=2)
    _assert_finished(client.collect("after")[1], "length", 2)


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
    _assert_error(client.recv(), "bad", code)


def test_duplicate_running_request_id_is_refused(client: Client) -> None:
    client.generate("dup", _make_prompt(8), max_new_tokens=4000)
    client.generate("dup", _make_prompt(8), max_new_tokens=4)
    before, last = client.collect("dup")
    _assert_error(last, "dup", "duplicate_request")  # NOTE: the running "dup" goes on
    client.send(Abort(request_id="dup"))
    after, last = client.collect("dup")
    _assert_finished(last, "abort", len(_tokens(before + after)))


# ---------------------------------------------------------------------- load and KV events


def test_load_report_numbers_are_sane(client: Client) -> None:
    client.send(GetLoad())
    report = client.recv()
    assert isinstance(report, LoadReport), report
    assert report.worker_id == "sim-test"
    assert report.free_full_pages > 0 and report.free_swa_pages > 0, report
    assert 0 <= report.used_bytes <= report.total_bytes, report
    assert report.num_running >= 0 and report.num_waiting >= 0, report


class Subscription:
    """A SUB socket on both topics, ready once a load report arrived (no slow-joiner loss)."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        for topic in (b"kv", b"load"):
            self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.loads: list[LoadReport] = []
        self.kv: list[KVEvent] = []
        self.wait_for(lambda: bool(self.loads), "a load report")

    def wait_for(self, done: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0 and self.sock.poll(left_ms), f"no {what} within {timeout_s} s"
            topic, seq, payload = self.sock.recv_multipart()
            assert len(seq) == 8, f"seq frame of {len(seq)} bytes"
            if topic == b"load":
                self.loads.append(msgspec.msgpack.decode(payload, type=LoadReport))
            else:
                assert topic == b"kv", topic
                self.kv += decode_batch(payload).events

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def subscription(sim_worker: WorkerProc) -> Iterator[Subscription]:
    sub = Subscription(sim_worker.events)
    yield sub
    sub.close()


def test_request_publishes_chained_block_stored_and_a_checkpoint(
    client: Client, subscription: Subscription
) -> None:
    prompt = _make_prompt(3 * PAGE)
    hashes = page_hashes(prompt, PAGE)
    client.generate("ev", prompt, max_new_tokens=4)  # stays inside the partial 4th page
    _assert_finished(client.collect("ev")[1], "length", 4)

    def stored() -> list[BlockStored]:
        return [e for e in subscription.kv
                if isinstance(e, BlockStored) and set(e.block_hashes) & set(hashes)]

    def checkpointed() -> bool:
        return any(isinstance(e, SwaCheckpointStored) and hashes[-1] in e.block_hashes
                   for e in subscription.kv)

    subscription.wait_for(lambda: sum(len(e.block_hashes) for e in stored()) >= 3 and
                          checkpointed(), "BlockStored + SwaCheckpointStored")
    events = stored()
    assert [h for e in events for h in e.block_hashes] == hashes, events
    parents = [None, *hashes]
    for e in events:
        assert e.parent_block_hash == parents[hashes.index(e.block_hashes[0])], e
        assert e.block_size == PAGE and len(e.token_ids) == PAGE * len(e.block_hashes), e
    assert [t for e in events for t in e.token_ids] == prompt
    ckpt = next(e for e in subscription.kv
                if isinstance(e, SwaCheckpointStored) and hashes[-1] in e.block_hashes)
    assert ckpt.window == WINDOW, ckpt


def test_flush_publishes_all_blocks_cleared(client: Client, subscription: Subscription) -> None:
    client.generate("fill", _make_prompt(2 * PAGE), max_new_tokens=2)
    client.collect("fill")
    client.send(Flush())
    report = client.recv()
    assert isinstance(report, LoadReport), report
    assert (report.cached_pages, report.used_bytes) == (0, 0), report
    subscription.wait_for(lambda: any(isinstance(e, AllBlocksCleared) for e in subscription.kv),
                          "AllBlocksCleared")


def test_load_reports_are_published(client: Client, subscription: Subscription) -> None:
    client.generate("busy", _make_prompt(8), max_new_tokens=300)  # ~2 s of sim decode
    subscription.wait_for(lambda: any(r.num_running == 1 for r in subscription.loads),
                          "a load report showing the running request")
    client.send(Abort(request_id="busy"))
    client.collect("busy")
    assert all(r.worker_id == "sim-test" for r in subscription.loads)


def test_kv_event_buffer_merges_runs_that_keep_their_meaning() -> None:
    buf = KVEventBuffer(page_size=2, window=4)
    for ev in [
        CacheEvent("stored", 1, None, (1, 2)), CacheEvent("stored", 2, 1, (3, 4)),
        CacheEvent("stored", 9, 5, (7, 7)),  # another branch: a new BlockStored
        CacheEvent("ckpt_stored", 2), CacheEvent("ckpt_stored", 9),
        CacheEvent("ckpt_dropped", 2), CacheEvent("removed", 2), CacheEvent("removed", 1),
        CacheEvent("cleared"), CacheEvent("cleared"),
    ]:
        buf.add(ev)
    assert buf.drain() == [
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                    block_size=2),
        BlockStored(block_hashes=[9], parent_block_hash=5, token_ids=[7, 7], block_size=2),
        SwaCheckpointStored(block_hashes=[2, 9], window=4),
        SwaCheckpointDropped(block_hashes=[2]),
        BlockRemoved(block_hashes=[2, 1]),
        AllBlocksCleared(),
    ]
    assert buf.drain() == []


# ---------------------------------------------------------------------- other workers


def test_native_worker_streams_the_same_tokens_as_llm_generate(
    make_checkpoint: Callable[..., Path], connect: Callable[[str], Client]
) -> None:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    model_dir = make_checkpoint(layers="FSSF", sliding_window=4)
    prompt = [(5 * i + 3) % 300 for i in range(40)]
    [expected] = LLM(model_dir, device="cpu", kv_budget_bytes=8 * 2**20).generate(
        [prompt], SamplingParams(max_new_tokens=12, temperature=0.0))
    worker = _start_worker("--backend", "native", "--model", str(model_dir), "--device", "cpu",
                           "--kv-budget-mb", "8", "--listen", ANY_PORT, "--events", ANY_PORT)
    with _running(worker):
        client = connect(worker.listen)
        for rid in ("cold", "warm"):  # the second one resumes from the prefix cache
            client.generate(rid, prompt, max_new_tokens=12, temperature=0.0)
            deltas, last = client.collect(rid)
            last = _assert_finished(last, expected.finish_reason, len(expected.token_ids))
            assert _tokens(deltas) == list(expected.token_ids), rid
        assert last.cached_tokens == 2 * PAGE, last


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_agentgate_worker_command_serves_replays_and_exits_on_sigterm(
    connect: Callable[[str], Client],
) -> None:
    listen, events, replay = (f"tcp://127.0.0.1:{_free_port()}" for _ in range(3))
    worker = _start_worker("worker", "--backend", "sim", "--cost", "zero", "--worker-id", "cli",
                           "--listen", listen, "--events", events, "--replay", replay,
                           command=("-m", "gateway.cli"))
    with _running(worker):  # NOTE: ends with SIGTERM, which must exit 0
        assert (worker.listen, worker.events, worker.worker_id) == (listen, events, "cli")
        client = connect(listen)
        client.send(Hello(version=PROTOCOL_VERSION, client_id="cli-test"))
        assert isinstance(client.recv(), Welcome)
        prompt = _make_prompt(PAGE)
        client.generate("r", prompt, max_new_tokens=1)
        _assert_finished(client.collect("r")[1], "length", 1)
        with EventSubscriber(events, replay_endpoint=replay, topic="kv") as sub:
            replayed = [e for _, batch in sub.replay(0, timeout_s=5.0) for e in batch.events]
        assert BlockStored(block_hashes=page_hashes(prompt, PAGE), parent_block_hash=None,
                           token_ids=prompt, block_size=PAGE) in replayed, replayed


@contextmanager
def _worker_thread(engine_cfg: EngineConfig) -> Iterator[Worker]:
    """A worker serving from a thread of this process (so a test can reach into its engine)."""
    cfg = WorkerConfig(listen=ANY_PORT, events=ANY_PORT, worker_id="inproc", cost="zero")
    worker = Worker(cfg, engine_cfg)
    thread = threading.Thread(target=worker.serve, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(timeout=5)
        worker.close()
    assert not thread.is_alive(), "Worker.serve() did not return after stop()"


def test_engine_failure_fails_running_requests_and_the_worker_keeps_serving(
    connect: Callable[[str], Client], caplog: pytest.LogCaptureFixture
) -> None:
    with _worker_thread(EngineConfig(backend="sim")) as worker:
        real_step, calls = worker.engine.step, iter(range(10**6))

        def step_failing_once() -> list[Sequence]:
            if next(calls) == 1:
                raise RuntimeError("injected failure")
            return real_step()

        worker.engine.step = step_failing_once  # type: ignore[method-assign]
        client = connect(worker.endpoints[0])
        client.generate("doomed", _make_prompt(8), max_new_tokens=50)
        _assert_error(client.collect("doomed")[1], "doomed", "internal")
        client.generate("next", _make_prompt(8), max_new_tokens=5)
        _assert_finished(client.collect("next")[1], "length", 5)
        client.send(GetLoad())
        report = client.recv()
        assert isinstance(report, LoadReport) and report.num_running == 0, report
    assert any("engine step failed" in r.getMessage() for r in caplog.records)


def test_request_that_cannot_fit_in_kv_memory_ends_with_context_too_long(
    connect: Callable[[str], Client],
) -> None:
    # NOTE: 1 MiB of KV holds 153 full pages of the demo geometry (about 2,400 tokens)
    with _worker_thread(EngineConfig(backend="sim", kv_budget_bytes=2**20)) as worker:
        client = connect(worker.endpoints[0])
        client.generate("big-prompt", _make_prompt(4000), max_new_tokens=8)
        deltas, last = client.collect("big-prompt")
        _assert_error(last, "big-prompt", "context_too_long")
        assert deltas == []
        client.generate("long-output", _make_prompt(100), max_new_tokens=4000)
        deltas, last = client.collect("long-output")  # fails once decoding outgrows memory
        _assert_error(last, "long-output", "context_too_long")
        assert 0 < len(_tokens(deltas)) < 4000
        client.generate("small", _make_prompt(100), max_new_tokens=4)
        _assert_finished(client.collect("small")[1], "length", 4)
