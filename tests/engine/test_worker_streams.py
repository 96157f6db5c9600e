"""The worker's token streams over real ZeroMQ on 127.0.0.1: deltas then one ``Finished``,
concurrent streams, cached prompt tokens, aborts, and a native worker against ``LLM.generate``.

Most tests share the paced sim worker subprocess of ``conftest.py`` (paced by the CPU cost model,
so a long request is reliably still running when it is aborted); one runs the native backend on a
tiny checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import zmq

from engine.protocol import (
    Abort,
    Finished,
    GetLoad,
    LoadReport,
    Replies,
    TokenDelta,
    WorkerMsg,
    decode_worker,
    decode_worker_items,
    replies_in,
)
from gateway.serve import WorkerProcess
from tests.engine.worker_harness import (
    NATIVE_KV_BUDGET_MB,
    PAGE,
    REPLY_TIMEOUT_S,
    VOCAB,
    Client,
    assert_finished,
    make_prompt,
    running,
    start_native_worker,
    tokens,
)


def test_generate_streams_deltas_then_one_finished(client: Client) -> None:
    prompt = make_prompt(20)
    client.generate("r", prompt, max_new_tokens=8)  # no Hello first: accepted
    deltas, last = client.collect("r")
    assert_finished(last, "length", 8)
    assert len(tokens(deltas)) == 8 and all(0 <= t < VOCAB for t in tokens(deltas))
    assert (last.prompt_tokens, last.cached_tokens, last.cached_tokens_host) == (20, 0, 0)
    client.assert_silent()


def test_two_concurrent_streams_interleave_and_each_finishes_once(
    sim_worker: WorkerProcess, connect: Callable[[str], Client]
) -> None:
    a, b = connect(sim_worker.listen), connect(sim_worker.listen)
    for c in (a, b):  # NOTE: the same request id from two clients: ids are per client
        c.generate("same-id", make_prompt(24), max_new_tokens=20)
    poller = zmq.Poller()
    for c in (a, b):
        poller.register(c.sock, zmq.POLLIN)
    timeline: list[tuple[str, WorkerMsg]] = []
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    while sum(isinstance(m, Finished) for _, m in timeline) < 2 and time.monotonic() < deadline:
        for sock, _ in poller.poll(100):
            name = "a" if sock is a.sock else "b"
            timeline += [(name, m) for m in decode_worker_items(sock.recv())]
    for name, c in (("a", a), ("b", b)):
        msgs = [m for n, m in timeline if n == name]
        assert_finished(msgs[-1], "length", 20)
        assert sum(isinstance(m, Finished) for m in msgs) == 1, msgs
        assert len(tokens([m for m in msgs if isinstance(m, TokenDelta)])) == 20
        c.assert_silent()
    first_finished = next(i for i, (_, m) in enumerate(timeline) if isinstance(m, Finished))
    senders = {n for n, m in timeline[:first_finished] if isinstance(m, TokenDelta)}
    assert senders == {"a", "b"}, f"streams did not interleave: {timeline}"


def test_repeated_prompt_reports_cached_tokens(client: Client) -> None:
    prompt = make_prompt(4 * PAGE)
    cached = []
    for rid in ("first", "second"):
        client.generate(rid, prompt, max_new_tokens=3)
        deltas, last = client.collect(rid)
        last = assert_finished(last, "length", 3)
        assert deltas[0].cached_tokens == last.cached_tokens == last.cached_tokens_device
        assert all(d.cached_tokens == 0 for d in deltas[1:])
        cached.append(last.cached_tokens)
    # the last prompt token is always recomputed, so the hit stops at the page before it
    assert cached == [0, 3 * PAGE], cached


def test_abort_mid_stream_ends_with_finished_abort(client: Client) -> None:
    client.generate("long", make_prompt(10), max_new_tokens=4000)
    first = client.recv()
    assert isinstance(first, TokenDelta), first
    client.send(Abort(request_id="long"))
    deltas, last = client.collect("long")
    received = len(tokens([first, *deltas]))
    last = assert_finished(last, "abort", received)
    assert received < 4000
    client.send(Abort(request_id="long"))  # already finished: ignored
    client.send(Abort(request_id="never-sent"))
    client.send(GetLoad())
    assert isinstance(client.recv(), LoadReport)  # nothing came before it


def test_native_worker_streams_the_same_tokens_as_llm_generate(
    make_checkpoint: Callable[..., Path], connect: Callable[[str], Client]
) -> None:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    model_dir = make_checkpoint(layers="FSSF", sliding_window=4)
    prompt = [(5 * i + 3) % 300 for i in range(40)]
    kv_budget_bytes = NATIVE_KV_BUDGET_MB * 2**20
    [expected] = LLM(model_dir, device="cpu", kv_budget_bytes=kv_budget_bytes).generate(
        [prompt], SamplingParams(max_new_tokens=12, temperature=0.0))
    with running(start_native_worker(model_dir)) as worker:
        client = connect(worker.listen)
        for rid in ("cold", "warm"):  # the second one resumes from the prefix cache
            client.generate(rid, prompt, max_new_tokens=12, temperature=0.0)
            deltas, last = client.collect(rid)
            last = assert_finished(last, expected.finish_reason, len(expected.token_ids))
            assert tokens(deltas) == list(expected.token_ids), rid
        assert last.cached_tokens == 2 * PAGE, last


def test_a_steps_replies_to_one_client_travel_as_one_message(
    sim_worker: WorkerProcess, connect: Callable[[str], Client]
) -> None:
    """Four streams on one client: a step's deltas (and ends) for them come as one ``Replies``
    (one ZeroMQ message for the gateway to read, not four), each stream still complete and in
    order; a reply with nothing beside it travels alone (no wrapper, no wait)."""
    c = connect(sim_worker.listen)
    for i in range(4):
        c.generate(f"r{i}", make_prompt(16 + i), max_new_tokens=12)
    raw: list[WorkerMsg] = []
    ended: set[str] = set()
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    while len(ended) < 4 and time.monotonic() < deadline:
        if c.sock.poll(100):
            msg = decode_worker(c.sock.recv())
            raw.append(msg)
            ended |= {m.request_id for m in replies_in(msg) if isinstance(m, Finished)}
    batches = [m for m in raw if isinstance(m, Replies)]
    assert batches, "four running streams never shared a message"
    assert all(len(b.items) > 1 for b in batches), "a lone reply must not be wrapped"
    flat = [m for msg in raw for m in replies_in(msg)]
    for i in range(4):
        mine = [m for m in flat if m.request_id == f"r{i}"]
        assert_finished(mine[-1], "length", 12)
        assert len(tokens([m for m in mine if isinstance(m, TokenDelta)])) == 12
    c.assert_silent()
    c.generate("alone", make_prompt(16), max_new_tokens=3)
    alone: list[WorkerMsg] = []
    while not alone or not any(isinstance(m, Finished) for m in replies_in(alone[-1])):
        assert c.sock.poll(int(REPLY_TIMEOUT_S * 1000)), "no reply"
        alone.append(decode_worker(c.sock.recv()))
    # NOTE: its last step's delta and end may share a message; every delta before goes alone
    assert all(isinstance(m, TokenDelta) for m in alone[:-1]), alone
    assert len(tokens([m for msg in alone for m in replies_in(msg)
                       if isinstance(m, TokenDelta)])) == 3

