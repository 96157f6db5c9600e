"""Issue 8, item 1: a grammar that takes seconds to compile must not stall its worker.

A sim worker subprocess (demo geometry and byte-level tokenizer, real ZeroMQ) compiles a JSON
schema with thousands of optional properties (several seconds on one core) while other clients'
heartbeats and streams go on; the request gets ``invalid_grammar`` once its compile exceeds the
time budget, one beyond the size budget gets it at once, and an Abort ends a compiling request.
The compiled-grammar cache is bounded in (estimated) bytes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.grammar import GrammarCompiler
from engine.models.checkpoint import DEMO_CONFIG
from engine.protocol import Abort, Finished, GetLoad, LoadReport
from engine.sampling_params import StructuredSpec
from engine.worker.config import WorkerConfig
from engine.worker.grammar_jobs import GrammarJobs
from gateway.serve import WorkerProcess, spawn_worker
from gateway.tokenizer import write_demo_tokenizer
from tests.engine.worker_harness import (
    ANY_PORT,
    START_TIMEOUT_S,
    Client,
    assert_error,
    assert_finished,
    make_prompt,
    worker_thread,
)

EOS = (258, 256)
VOCAB = 320
# NOTE: ~200 kB of schema text, the case: 5-10 s to compile here (it grows ~quadratically)
HUGE_PROPERTIES = 7000
GRAMMAR_TIMEOUT_S = 1.5
WORKER_FLAGS = ("--grammar-timeout-s", str(GRAMMAR_TIMEOUT_S))
HEARTBEAT_LIMIT_S = 1.0


def _schema(num_properties: int, tag: str = "p") -> str:
    """An object of ``num_properties`` optional string properties (slow to compile when large)."""
    props = {f"{tag}{i}": {"type": "string"} for i in range(num_properties)}
    return json.dumps({"type": "object", "properties": props})


def _structured(num_properties: int, tag: str = "p") -> dict[str, object]:
    return {"structured": StructuredSpec(json_schema=_schema(num_properties, tag))}


@pytest.fixture(scope="module")
def grammar_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo geometry (config.json only: the sim loads no weights) and the demo tokenizer."""
    out = tmp_path_factory.mktemp("grammar-sim")
    (out / "config.json").write_text(json.dumps(DEMO_CONFIG))
    write_demo_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def grammar_worker(grammar_model_dir: Path) -> Iterator[WorkerProcess]:
    worker = spawn_worker(model_dir=grammar_model_dir, backend="sim", worker_id="grammar-test",
                          extra_args=WORKER_FLAGS, timeout_s=START_TIMEOUT_S)
    try:
        yield worker
    finally:
        worker.stop()


def test_heartbeats_and_other_streams_go_on_while_a_huge_grammar_compiles(
    grammar_worker: WorkerProcess, connect: Callable[[str], Client]
) -> None:
    slow, other, beat = (connect(grammar_worker.listen) for _ in range(3))
    slow.generate("huge", make_prompt(8), max_new_tokens=4, **_structured(HUGE_PROPERTIES))
    sent_s = time.monotonic()
    time.sleep(0.3)  # NOTE: the worker has the Generate and is compiling it
    for i in range(3):
        other.generate(f"plain-{i}", make_prompt(12), max_new_tokens=6)
    latencies_s = [_heartbeat_latency(beat) for _ in range(4)]
    assert max(latencies_s) <= HEARTBEAT_LIMIT_S, f"GetLoad answered after {latencies_s} s"
    for i in range(3):
        _, last = other.collect(f"plain-{i}")
        assert_finished(last, "length", 6)
    _, last = slow.collect("huge")
    waited_s = time.monotonic() - sent_s
    assert_error(last, "huge", "invalid_grammar")
    assert "took longer than" in last.message and f"{GRAMMAR_TIMEOUT_S:g} s" in last.message, last
    assert waited_s < GRAMMAR_TIMEOUT_S + 5.0, f"the budget error came after {waited_s:.1f} s"
    other.assert_silent()


def test_a_grammar_beyond_the_size_budget_is_refused_at_once(client_of_grammar: Client) -> None:
    sent_s = time.monotonic()
    client_of_grammar.generate("big", make_prompt(8), **_structured(9500, "q"))  # ~275 kB
    _, last = client_of_grammar.collect("big")
    assert_error(last, "big", "invalid_grammar")
    assert "262144 bytes" in last.message, last
    assert time.monotonic() - sent_s < 2.0


def test_abort_of_a_compiling_request_ends_it_at_once(client_of_grammar: Client) -> None:
    client_of_grammar.generate("slow", make_prompt(8), **_structured(5000, "a"))
    time.sleep(0.3)
    sent_s = time.monotonic()
    client_of_grammar.send(Abort(request_id="slow"))
    _, last = client_of_grammar.collect("slow")
    assert isinstance(last, Finished) and last.finish_reason == "abort", last
    assert (last.prompt_tokens, last.completion_tokens) == (8, 0), last
    assert time.monotonic() - sent_s < HEARTBEAT_LIMIT_S + 1.0
    client_of_grammar.assert_silent(GRAMMAR_TIMEOUT_S + 0.5)  # no late budget error either


def test_a_small_grammar_compiles_off_the_loop_and_is_followed(
    client_of_grammar: Client,
) -> None:
    for rid in ("first", "cached"):  # NOTE: the second one hits the compiled-grammar cache
        client_of_grammar.generate(rid, make_prompt(8), max_new_tokens=200,
                                   **_structured(3, "s"))
        deltas, last = client_of_grammar.collect(rid)
        assert isinstance(last, Finished) and last.finish_reason == "stop", last
        text = bytes(t for d in deltas for t in d.token_ids if t < 256).decode()
        assert isinstance(json.loads(text), dict), text


def test_a_compile_that_ends_after_its_budget_is_dropped(grammar_model_dir: Path) -> None:
    cfg = WorkerConfig(listen=ANY_PORT, events=ANY_PORT, worker_id="inproc", cost="zero",
                       grammar_timeout_s=0.1)
    engine_cfg = EngineConfig(model_path=str(grammar_model_dir), backend="sim")
    with worker_thread(engine_cfg, cfg) as worker:
        client = Client(worker.endpoints[0])
        try:
            spec = _structured(3000, "late")
            client.generate("late", make_prompt(8), **spec)
            _, last = client.collect("late")
            assert_error(last, "late", "invalid_grammar")
            client.generate("again", make_prompt(8), **spec)  # NOTE: joins the late compile
            _, last = client.collect("again")
            assert_error(last, "again", "invalid_grammar")
            _wait_until(lambda: worker.num_compiling_grammars == 0, "the late compile to end")
            assert worker.engine.grammars.num_cached == 0
            assert worker.engine.grammars.cache_bytes == 0
        finally:
            client.close()


def test_the_grammar_cache_is_bounded_in_bytes(grammar_model_dir: Path) -> None:
    specs = [StructuredSpec(json_schema=_schema(40, f"k{i}_")) for i in range(4)]
    one = GrammarCompiler(str(grammar_model_dir), VOCAB, EOS).compile(specs[0])
    budget = 2 * one.num_bytes + one.num_bytes // 2  # room for two
    compiler = GrammarCompiler(str(grammar_model_dir), VOCAB, EOS, max_cache_bytes=budget)
    assert one.num_bytes >= 100 * len(specs[0].json_schema or ""), one.num_bytes
    for spec in specs:
        compiler.matcher(spec)
        assert compiler.cache_bytes <= budget, (compiler.cache_bytes, budget)
    assert compiler.num_cached == 2
    assert compiler.cached(specs[0]) is None and compiler.cached(specs[3]) is not None
    too_big = GrammarCompiler(str(grammar_model_dir), VOCAB, EOS, max_cache_bytes=100)
    matcher = too_big.matcher(specs[0])  # NOTE: usable, just not kept
    assert matcher.allowed(VOCAB).any() and too_big.num_cached == 0 == too_big.cache_bytes


def test_a_compile_nobody_waits_for_does_not_hold_a_thread(grammar_model_dir: Path) -> None:
    compiler = GrammarCompiler(str(grammar_model_dir), VOCAB, EOS)
    jobs = GrammarJobs(compiler, num_threads=1, timeout_s=60.0)
    slow = StructuredSpec(json_schema=_schema(4000, "slow"))
    jobs.submit("slow", slow)
    jobs.submit("small", StructuredSpec(json_schema=_schema(3, "small")))
    assert jobs.poll() == [] and jobs.num_waiting == 2  # NOTE: "small" queued behind "slow"
    jobs.cancel("slow")
    results = _poll_until(jobs, 1)
    assert [type(r).__name__ for r in results] == ["Ready"] and results[0].request_id == "small"
    assert jobs.num_jobs == 1, "the slow compile runs on (it cannot be interrupted)"
    _wait_until(lambda: not jobs.poll() and jobs.num_jobs == 0, "the slow compile to end")
    assert compiler.cached(slow) is not None, "a compile that ended in budget is kept for a retry"


# ---------------------------------------------------------------------- helpers


def _poll_until(jobs: GrammarJobs, num_results: int, timeout_s: float = 60.0) -> list[object]:
    """``jobs.poll()`` until ``num_results`` came (bounded)."""
    results: list[object] = []
    deadline = time.monotonic() + timeout_s
    while len(results) < num_results:
        assert time.monotonic() < deadline, f"{results} after {timeout_s} s"
        results += jobs.poll()
        time.sleep(0.02)
    return results



@pytest.fixture
def client_of_grammar(grammar_worker: WorkerProcess, connect: Callable[[str], Client]) -> Client:
    return connect(grammar_worker.listen)


def _heartbeat_latency(client: Client) -> float:
    """Seconds until the worker answers a GetLoad (``client`` runs no requests)."""
    start = time.monotonic()
    client.send(GetLoad())
    msg = client.recv()
    assert isinstance(msg, LoadReport), msg
    return time.monotonic() - start


def _wait_until(done: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.05)

