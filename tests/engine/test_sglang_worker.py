"""The sglang worker (``engine.sglang_backend.worker``) over real ZeroMQ on 127.0.0.1, with a
stand-in for SGLang's engine (``sglang_standin``: SGLang needs a GPU; the mapping functions have
byte-exact goldens of SGLang's own formats in ``test_sglang_mapping.py`` / ``_events.py``).

What is checked: the protocol as the gateway sees it (Welcome, streams, one last message, the
refusals, Abort, GetLoad, Flush, Retain), SGLang's KV events re-published in agentgate's format
with agentgate's hashes, and the command line without SGLang installed.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from msgspec.structs import replace

from encoders.protocol import EmbeddingKey
from engine.hashing import page_hashes
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
    MediaSpan,
    Retain,
    SamplingSpec,
    Welcome,
)
from engine.sampling_params import StructuredSpec
from engine.sglang_backend.worker import ModelInfo, SGLangWorker
from engine.worker.config import WorkerConfig
from engine.worker.events import AllBlocksCleared, BlockStored
from tests.engine.sglang_standin import StandInSGLang, serving
from tests.engine.sglang_standin import ipc_endpoint as _ipc
from tests.engine.worker_harness import ANY_PORT, ROOT, Client, Subscription

PAGE = 16
VOCAB = 320
MODEL = ModelInfo("standin", None, VOCAB)


@pytest.fixture
def standin() -> StandInSGLang:
    return StandInSGLang(_ipc(), page_size=PAGE, vocab=VOCAB)


@pytest.fixture
def worker(standin: StandInSGLang) -> Iterator[SGLangWorker]:
    with serving(standin) as w:
        yield w


@pytest.fixture
def client(worker: SGLangWorker) -> Iterator[Client]:
    c = Client(worker.endpoints[0])
    yield c
    c.close()


def _prompt(n: int, start: int = 1) -> list[int]:
    return [(start + i) % VOCAB for i in range(n)]


def _expected_tokens(prompt: list[int], n: int) -> list[int]:
    return [(sum(prompt) + i) % VOCAB for i in range(n)]


# ---------------------------------------------------------------------- protocol


def test_welcome_announces_the_page_size_and_no_swa_events(client: Client,
                                                            worker: SGLangWorker) -> None:
    client.send(Hello(version=PROTOCOL_VERSION, client_id="t"))
    welcome = client.recv()
    assert isinstance(welcome, Welcome), welcome
    assert (welcome.page_size, welcome.model, welcome.max_context) == (PAGE, "standin", 4096)
    assert welcome.swa_page_events is False  # NOTE: SGLang's events say nothing of SWA
    assert welcome.events_endpoint == worker.endpoints[1]
    assert welcome.replay_endpoint is not None and welcome.instance_id == worker.instance_id
    client.send(Hello(version=PROTOCOL_VERSION + 1, client_id="t"))
    error = client.recv()
    assert isinstance(error, ErrorReply) and error.code == "version_mismatch", error


def test_a_stream_is_sglangs_ids_then_one_finished(client: Client,
                                                   standin: StandInSGLang) -> None:
    prompt = _prompt(20)
    client.send(Generate(request_id="r1", input_ids=prompt, priority=3,
                         sampling=SamplingSpec(max_new_tokens=6, temperature=0.0)))
    deltas, last = client.collect("r1")
    assert [t for d in deltas for t in d.token_ids] == _expected_tokens(prompt, 6)
    assert isinstance(last, Finished), last
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == ("length", 20, 6)
    call = standin.calls[-1]
    assert call["input_ids"] == prompt and call["stream"] is True
    assert call["sampling_params"]["max_new_tokens"] == 6 and call["priority"] == 3
    client.assert_silent()


def test_a_second_turn_reports_cached_tokens_and_the_events_carry_our_hashes(
        worker: SGLangWorker, client: Client) -> None:
    sub = Subscription(worker.endpoints[1])
    try:
        prompt = _prompt(40)
        client.generate("t1", prompt, max_new_tokens=8)
        first, end1 = client.collect("t1")
        assert isinstance(end1, Finished) and end1.cached_tokens == 0
        turn1 = prompt + [t for d in first for t in d.token_ids]
        expected = page_hashes(turn1, PAGE, None)  # 48 tokens: 3 pages
        stored: list[int] = []
        sub.wait_for(lambda: stored.extend(
            h for e in sub.kv if isinstance(e, BlockStored) for h in e.block_hashes
        ) or sub.kv.clear() or len(stored) >= 3, "the first turn's pages")
        assert stored == expected
        turn2 = turn1 + _prompt(10, start=7)
        client.generate("t2", turn2, max_new_tokens=4)
        second, end2 = client.collect("t2")
        assert second[0].cached_tokens == 48 and isinstance(end2, Finished)
        assert end2.cached_tokens == end2.cached_tokens_device == 48
    finally:
        sub.close()


def test_a_salt_reaches_sglang_and_salts_the_published_hashes(worker: SGLangWorker,
                                                               client: Client,
                                                               standin: StandInSGLang) -> None:
    sub = Subscription(worker.endpoints[1])
    try:
        prompt = _prompt(16)
        client.send(Generate(request_id="s", input_ids=prompt, cache_salt="tenant-a",
                             sampling=SamplingSpec(max_new_tokens=16)))
        deltas, last = client.collect("s")
        assert isinstance(last, Finished)
        assert standin.calls[-1]["cache_salt"] == "tenant-a"
        sub.wait_for(lambda: any(isinstance(e, BlockStored) for e in sub.kv), "a store")
        store = next(e for e in sub.kv if isinstance(e, BlockStored))
        tokens = prompt + [t for d in deltas for t in d.token_ids]
        assert store.block_hashes == page_hashes(tokens, PAGE, "tenant-a")
        assert store.block_hashes != page_hashes(tokens, PAGE, None)
    finally:
        sub.close()


def test_salted_requests_are_refused_where_sglang_has_no_isolation_key() -> None:
    engine = StandInSGLang(_ipc(), supports_cache_salt=False)
    with serving(engine) as w:
        c = Client(w.endpoints[0])
        c.send(Generate(request_id="s", input_ids=_prompt(8), cache_salt="tenant-a",
                        sampling=SamplingSpec(max_new_tokens=2)))
        _, last = c.collect("s")
        assert isinstance(last, ErrorReply) and last.code == "invalid_request", last
        assert "salt" in last.message
        assert engine.calls == []  # NOTE: never sent unsalted
        c.generate("plain", _prompt(8), max_new_tokens=2)
        assert isinstance(c.collect("plain")[1], Finished)
        c.close()


@pytest.mark.parametrize(("change", "code", "word"), [
    (dict(media=[MediaSpan(offset=0, length=2, key=EmbeddingKey(
        content_hash="ab" * 32, preprocess_id="p", tower_fingerprint="t"))]),
     "invalid_request", "image"),
    (dict(sampling=SamplingSpec(structured=StructuredSpec(json_schema='{"type": "object"}'))),
     "invalid_grammar", "skip_tokenizer_init"),
    (dict(sampling=SamplingSpec(temperature=-1.0)), "invalid_request", "temperature"),
    (dict(input_ids=[VOCAB + 5]), "invalid_request", "vocab"),
    (dict(sampling=SamplingSpec(max_new_tokens=5000)), "context_too_long", "context"),
    (dict(stream_interval_s=60.0), "invalid_request", "stream_interval_s"),
])
def test_refusals_name_what_to_fix(client: Client, standin: StandInSGLang, change: dict,
                                   code: str, word: str) -> None:
    msg = replace(Generate(request_id="x", input_ids=_prompt(8), sampling=SamplingSpec()),
                  **change)
    client.send(msg)
    _, last = client.collect("x")
    assert isinstance(last, ErrorReply) and last.code == code, last
    assert word in last.message.lower() or word in last.message, last.message
    assert standin.calls == []


def test_abort_ends_the_stream_with_finished_abort(client: Client,
                                                   standin: StandInSGLang) -> None:
    standin.step_s = 0.01
    client.generate("long", _prompt(8), max_new_tokens=2000)
    first = client.recv()
    assert getattr(first, "request_id", None) == "long"
    client.send(Abort(request_id="long"))
    _, last = client.collect("long")
    assert isinstance(last, Finished) and last.finish_reason == "abort", last
    client.send(Abort(request_id="long"))  # NOTE: unknown by now: ignored
    client.assert_silent()


def test_a_running_request_id_is_a_duplicate(client: Client, standin: StandInSGLang) -> None:
    standin.step_s = 0.01
    client.generate("d", _prompt(8), max_new_tokens=50)
    client.generate("d", _prompt(8), max_new_tokens=1)
    seen: list[object] = []
    while not any(isinstance(m, Finished) for m in seen):
        seen.append(client.recv())
    errors = [m for m in seen if isinstance(m, ErrorReply)]
    assert [e.code for e in errors] == ["duplicate_request"], seen
    assert len(standin.calls) == 1


def test_an_sglang_error_is_one_error_reply(client: Client, standin: StandInSGLang) -> None:
    standin.fail_with = RuntimeError("CUDA error: an illegal memory access")
    client.generate("e", _prompt(8), max_new_tokens=3)
    _, last = client.collect("e")
    assert isinstance(last, ErrorReply) and last.code == "internal", last
    client.generate("ok", _prompt(8), max_new_tokens=3)
    assert isinstance(client.collect("ok")[1], Finished)


def test_retention_hints_are_accepted_and_counted(client: Client) -> None:
    client.send(GetLoad())
    before = client.recv()
    assert isinstance(before, LoadReport) and before.unsupported_hints == 0
    client.send(Retain(request_id="nobody", ttl_s=30.0))
    client.send(Generate(request_id="r", input_ids=_prompt(8), retain_ttl_s=60.0,
                         sampling=SamplingSpec(max_new_tokens=2)))
    assert isinstance(client.collect("r")[1], Finished)
    client.send(GetLoad())
    after = client.recv()
    assert isinstance(after, LoadReport) and after.unsupported_hints == 2, after
    assert (after.total_bytes, after.free_full_pages) == (4096, 4096 // PAGE)


def test_flush_clears_sglangs_cache_and_the_published_view(worker: SGLangWorker, client: Client,
                                                            standin: StandInSGLang) -> None:
    sub = Subscription(worker.endpoints[1])
    try:
        client.send(Flush())
        assert isinstance(client.recv(), LoadReport)
        assert standin.flushes == 1
        sub.wait_for(lambda: any(isinstance(e, AllBlocksCleared) for e in sub.kv), "a clear")
    finally:
        sub.close()


def test_a_stream_interval_merges_deltas(client: Client) -> None:
    prompt = _prompt(8)
    client.send(Generate(request_id="i", input_ids=prompt, stream_interval_s=5.0,
                         sampling=SamplingSpec(max_new_tokens=12)))
    deltas, last = client.collect("i")
    assert isinstance(last, Finished)
    assert len(deltas) <= 2  # NOTE: the first may go at once; the rest come merged at the end
    assert [t for d in deltas for t in d.token_ids] == _expected_tokens(prompt, 12)


def test_a_silent_client_has_its_requests_aborted() -> None:
    engine = StandInSGLang(_ipc(), step_s=0.01)
    with serving(engine, client_timeout_s=0.3) as w:
        c = Client(w.endpoints[0])
        c.generate("gone", _prompt(8), max_new_tokens=4000)
        c.recv()
        _, last = c.collect("gone")  # NOTE: silent since: aborted after ~0.3 s
        assert isinstance(last, Finished) and last.finish_reason == "abort", last
        c.close()


def test_a_page_size_sglang_cannot_map_is_refused() -> None:
    engine = StandInSGLang(_ipc(), page_size=16)
    try:
        with pytest.raises(ValueError, match="multiple of SGLang's page size"):
            SGLangWorker(WorkerConfig(listen=ANY_PORT, events=ANY_PORT), engine, MODEL,
                         page_size=24)
    finally:
        engine.close()


# ---------------------------------------------------------------------- command line


def test_the_sglang_backend_without_sglang_says_how_to_install_it(tmp_path) -> None:
    if _has_sglang():
        pytest.skip("SGLang is installed here")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # NOTE: SGLang reads it, after the import fails
    proc = subprocess.run(
        [sys.executable, "-m", "engine.worker", "--backend", "sglang", "--model", str(model),
         "--listen", "tcp://127.0.0.1:0", "--events", "tcp://127.0.0.1:0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'agentgate[sglang]'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def _has_sglang() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def test_serve_forwards_the_sglang_flags_to_its_workers() -> None:
    import argparse

    from engine.worker.cli import add_engine_arguments, engine_argv

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--tp", "2", "--sglang-arg", "mem_fraction_static=0.8",
                              "--sglang-arg", "swa_full_tokens_ratio=0.5"])
    assert engine_argv(args) == ["--tp", "2", "--sglang-arg", "mem_fraction_static=0.8",
                                 "--sglang-arg", "swa_full_tokens_ratio=0.5"]
    assert engine_argv(parser.parse_args([])) == []


def test_sglangs_server_arguments() -> None:
    """Golden: the keyword arguments of ``sglang.Engine`` (0.5.23 ``arg_groups/fields``:
    ``skip_tokenizer_init``, ``incremental_streaming_output``, ``enable_priority_scheduling``,
    ``grammar_backend``, ``page_size``, ``tp_size``; ``kv_events_config`` is the JSON text of
    ``KVEventsConfig`` in ``disaggregation/kv_events.py``)."""
    from engine.sglang_backend.launch import server_kwargs

    got = server_kwargs("/m", page_size=16, events="ipc:///tmp/x-kv", tp_size=2,
                        dtype="bfloat16", user_args={"mem_fraction_static": 0.8})
    assert got == {
        "model_path": "/m", "tp_size": 2, "page_size": 16, "skip_tokenizer_init": True,
        "incremental_streaming_output": True, "enable_priority_scheduling": True,
        "grammar_backend": "llguidance", "log_level": "warning", "dtype": "bfloat16",
        "kv_events_config": '{"publisher":"zmq","endpoint":"ipc:///tmp/x-kv","topic":""}',
        "mem_fraction_static": 0.8}
    with pytest.raises(ValueError, match="incremental_streaming_output"):
        server_kwargs("/m", page_size=16, events="ipc:///tmp/x-kv",
                      user_args={"incremental_streaming_output": False})


def test_an_abort_right_behind_its_generate_still_aborts(client: Client,
                                                         standin: StandInSGLang) -> None:
    """The Abort can be handled before SGLang knows the request (its task has not run yet),
    where SGLang's abort_request ignores the unknown id: the worker aborts again once it does."""
    standin.step_s = 0.005
    client.generate("quick", _prompt(8), max_new_tokens=2000)
    client.send(Abort(request_id="quick"))
    _, last = client.collect("quick")
    assert isinstance(last, Finished) and last.finish_reason == "abort", last
    assert last.completion_tokens < 2000


def test_a_lost_sglang_batch_makes_the_worker_forget_what_it_published(
        worker: SGLangWorker, client: Client, standin: StandInSGLang) -> None:
    """A lost batch may have held a removal: the worker clears its published view (the router
    forgets this worker's pages) rather than let the router credit pages that may be gone."""
    sub = Subscription(worker.endpoints[1])
    try:
        client.generate("a", _prompt(32), max_new_tokens=4)
        assert isinstance(client.collect("a")[1], Finished)
        sub.wait_for(lambda: any(isinstance(e, BlockStored) for e in sub.kv), "a store")
        assert not any(isinstance(e, AllBlocksCleared) for e in sub.kv)
        standin.lose_a_batch()
        client.generate("b", _prompt(32, start=50), max_new_tokens=4)
        assert isinstance(client.collect("b")[1], Finished)

        def after_clear() -> list[object]:
            kinds = [isinstance(e, AllBlocksCleared) for e in sub.kv]
            return sub.kv[kinds.index(True):] if True in kinds else []

        sub.wait_for(lambda: any(isinstance(e, BlockStored) for e in after_clear()),
                     "a clear, then the batch's store")
        after = after_clear()
        stored = [h for e in after if isinstance(e, BlockStored) for h in e.block_hashes]
        assert stored == page_hashes(_prompt(32, start=50) + _expected_tokens(
            _prompt(32, start=50), 4), PAGE, None)[:2]  # NOTE: a root chain maps again
        assert worker.counters.event_gaps == 1
    finally:
        sub.close()


def test_a_failing_loop_task_ends_serve_instead_of_a_deaf_worker(standin: StandInSGLang) -> None:
    """A bug in one of the worker's loop tasks (here the housekeeping's client check) ends
    ``serve`` with the error, so the process exits and is restarted, rather than leaving a worker
    that no longer publishes or notices SIGTERM."""
    worker = SGLangWorker(WorkerConfig(listen=ANY_PORT, events=ANY_PORT), standin,
                          ModelInfo("standin", None, VOCAB), page_size=PAGE)

    def broken(now_s: float) -> list[bytes]:
        raise RuntimeError("a bug in the client check")

    worker._clients.silent = broken  # type: ignore[method-assign]  # noqa: SLF001
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(RuntimeError, match="a bug in the client check"):
            loop.run_until_complete(asyncio.wait_for(worker.serve(), 10))
    finally:
        loop.close()
        worker.close()
        standin.close()
