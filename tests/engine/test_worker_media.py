"""Images through the worker (issue 13), with real processes, sockets and Redis: a native worker
started with ``--encoder`` looks up what a client had a real encoder service encode and answers
with the offline engine's greedy tokens; a key found nowhere or an embedding of the wrong shape
ends that request alone; two workers on one Redis (``--embed-redis``) both find what one
``EmbeddingCache.put`` wrote; a stalled encoder times out one request and lets an Abort end
another at once while the worker keeps serving; the sim validates spans and fetches nothing."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import torch
import zmq

from encoders.embed_cache import EmbeddingCache
from encoders.protocol import EmbeddingKey, EncodeItem
from encoders.service import EncoderClient, EncoderService
from engine.config import EngineConfig
from engine.llm import LLM
from engine.protocol import MEDIA_ID_BASE, Abort, ErrorReply, Finished, Generate, MediaSpan
from engine.protocol import SamplingSpec as Spec
from engine.sampling_params import SamplingParams, StructuredSpec
from engine.worker.server import WorkerConfig
from gateway.serve import WorkerProcess, spawn_worker
from gateway.tokenizer import write_demo_tokenizer
from tests.engine.worker_harness import ANY_PORT, Client, running, tokens, worker_thread

PAGE = 4
TOKENS = 8  # placeholder tokens per image (the fake tower's)
HIDDEN = 64  # the tiny model's hidden size
NEW_TOKENS = 6
_PROJECTION = torch.randn(32, TOKENS * HIDDEN, generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------- the fake tower


def _embed(data: bytes, tokens: int = TOKENS) -> torch.Tensor:
    """The fake tower: a fixed random projection of the bytes' sha256, [tokens, HIDDEN]."""
    digest = torch.tensor(list(hashlib.sha256(data).digest()), dtype=torch.float32) / 255 - 0.5
    return (digest @ _PROJECTION)[: tokens * HIDDEN].view(tokens, HIDDEN) * 0.2


def _encode_fn(datas: list[bytes]) -> list[torch.Tensor | Exception]:
    return [_embed(d) for d in datas]


def _key(data: bytes) -> EmbeddingKey:
    return EmbeddingKey(content_hash=hashlib.sha256(data).hexdigest(), preprocess_id="p0",
                        tower_fingerprint="t0")


def _placeholders(data: bytes, n: int = TOKENS) -> list[int]:
    """The image's placeholder ids, from its content hash (as the gateway derives them)."""
    base = MEDIA_ID_BASE + (int(hashlib.sha256(data).hexdigest()[:6], 16) << 5)
    return [base + j for j in range(n)]


def _image_prompt(data: bytes, head: int = 5, tail: int = 6) -> tuple[list[int], int]:
    """(a prompt with the image at ``head``, the offset)."""
    return [11 + i for i in range(head)] + _placeholders(data) + [40 + i for i in range(tail)], head


def _generate(rid: str, prompt: list[int], spans: list[MediaSpan]) -> Generate:
    return Generate(request_id=rid, input_ids=prompt, media=spans,
                    sampling=Spec(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))


def _ask(client: Client, rid: str, data: bytes, key: EmbeddingKey | None = None,
         ) -> tuple[list[int], Finished | ErrorReply]:
    prompt, offset = _image_prompt(data)
    client.send(_generate(rid, prompt, [MediaSpan(offset=offset, length=TOKENS,
                                                  key=key or _key(data))]))
    deltas, last = client.collect(rid)
    return tokens(deltas), last


def _offline_tokens(model_dir: Path, data: bytes) -> list[int]:
    """What the offline engine answers for the same prompt and embedding."""
    llm = LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE)
    prompt, offset = _image_prompt(data)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return list(llm.generate([prompt], params, media=[[(offset, _embed(data))]])[0].token_ids)


def _assert_error(last: object, code: str, *parts: str) -> None:
    assert isinstance(last, ErrorReply) and last.code == code, last
    for part in parts:
        assert part in last.message, f"{part!r} not in {last.message!r}"


# ---------------------------------------------------------------------- fixtures


@contextmanager
def _encoder_service(cache: EmbeddingCache) -> Iterator[str]:
    service = EncoderService(_encode_fn, cache)
    endpoint = service.serve("tcp://127.0.0.1:0")
    try:
        yield endpoint
    finally:
        service.close()


def _native(model_dir: Path, *flags: str) -> WorkerProcess:
    return spawn_worker(model_dir=model_dir, backend="native", extra_args=[
        "--device", "cpu", "--kv-budget-mb", "8", "--page-size", str(PAGE), "--cost", "zero",
        *flags])


def _encode(endpoint: str, datas: list[bytes]) -> None:
    """A client (the gateway's part) has the service encode ``datas``."""
    client = EncoderClient([endpoint], timeout_s=10)

    async def call() -> None:
        try:
            reply = await client.encode([EncodeItem(key=_key(d), data=d) for d in datas],
                                        with_data=False)
            assert all(r is not None for r in reply.results), reply
        finally:
            await client.aclose()

    asyncio.run(call())


# ---------------------------------------------------------------------- worker processes


def test_a_worker_with_encoder_serves_an_encoded_image(tiny_model_dir: Path, connect) -> None:
    cache = EmbeddingCache()
    cache.put(_key(b"narrow"), torch.zeros(TOKENS, 32))  # NOTE: a tower of another width
    with _encoder_service(cache) as endpoint:
        _encode(endpoint, [b"cat.png"])
        with running(_native(tiny_model_dir, "--encoder", endpoint)) as worker:
            client = connect(worker.listen)
            got, last = _ask(client, "img", b"cat.png")
            assert isinstance(last, Finished) and last.finish_reason == "length", last
            _, missing = _ask(client, "missing", b"never encoded")
            _, narrow = _ask(client, "narrow", b"narrow")
            again, last_again = _ask(client, "img-again", b"cat.png")
            client.generate("text", [1, 2, 3, 4, 5], max_new_tokens=2, ignore_eos=True)
            _, text_last = client.collect("text")
    assert got == _offline_tokens(tiny_model_dir, b"cat.png"), "the image's tokens"
    _assert_error(missing, "invalid_request", "media[0]: no embedding for key "
                  f"{_key(b'never encoded').content_hash[:16]}", "retry the request")
    _assert_error(narrow, "invalid_request", "media[0]: the embedding for key",
                  "has shape [8, 32]; want [length, hidden_size] = [8, 64]")
    assert again == got and isinstance(last_again, Finished), last_again
    assert last_again.cached_tokens >= 12, f"the same image was not a cache hit: {last_again}"
    assert isinstance(text_last, Finished), text_last


def test_two_workers_find_embeddings_in_one_redis(tiny_model_dir: Path, redis_url: str,
                                                  connect) -> None:
    data = b"shared.jpg"
    writer = EmbeddingCache(redis_url=redis_url)
    writer.put(_key(data), _embed(data))
    writer.close()
    flags = ("--embed-redis", redis_url, "--embed-cache-mb", "1")
    with ExitStack() as stack:
        workers = [stack.enter_context(running(_native(tiny_model_dir, *flags)))
                   for _ in range(2)]
        answers = [_ask(connect(w.listen), f"r{i}", data) for i, w in enumerate(workers)]
    want = _offline_tokens(tiny_model_dir, data)
    for i, (got, last) in enumerate(answers):
        assert isinstance(last, Finished), f"worker {i}: {last}"
        assert got == want, f"worker {i}: {got} != {want}"


# ---------------------------------------------------------------------- in-process workers


def _native_config(model_dir: Path) -> EngineConfig:
    return EngineConfig(model_path=str(model_dir), device="cpu", dtype="float32",
                        page_size=PAGE, kv_budget_bytes=8 * 2**20)


def test_a_stalled_encoder_times_out_and_abort_ends_a_fetch(tiny_model_dir: Path,
                                                            connect) -> None:
    """An encoder that never answers (a bare ROUTER): Abort ends a fetching request at once; an
    unaborted one fails after --embed-timeout-s; text requests run meanwhile."""
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:*")
    cfg = WorkerConfig(listen=ANY_PORT, events=ANY_PORT, worker_id="stalled", cost="zero",
                       encoders=(silent.getsockopt_string(zmq.LAST_ENDPOINT),),
                       embed_timeout_s=1.5)
    try:
        with worker_thread(_native_config(tiny_model_dir), cfg) as worker:
            client = connect(worker.listen_endpoint)
            prompt, offset = _image_prompt(b"slow")
            span = [MediaSpan(offset=offset, length=TOKENS, key=_key(b"slow"))]
            start = time.monotonic()
            client.send(_generate("aborted", prompt, span))
            client.send(_generate("late", prompt, span))
            client.send(Abort(request_id="aborted"))
            _, aborted = client.collect("aborted")
            assert isinstance(aborted, Finished) and aborted.finish_reason == "abort", aborted
            assert time.monotonic() - start < 1.0, "the abort waited for the fetch"
            client.generate("text", [1, 2, 3], max_new_tokens=3, ignore_eos=True)
            _, text = client.collect("text")
            assert isinstance(text, Finished) and time.monotonic() - start < 1.5, text
            _, late = client.collect("late")
            waited = time.monotonic() - start
    finally:
        silent.close(linger=0)
    _assert_error(late, "invalid_request", "did not arrive within 1.5 s", "--embed-timeout-s")
    assert 1.5 <= waited < 5.0, waited


def test_a_request_with_a_grammar_and_an_image_waits_for_both(tiny_model_dir: Path,
                                                              tmp_path: Path, connect) -> None:
    """Its grammar compiles while its embedding is fetched; admitted once both are there, it
    answers what the offline engine answers with the same grammar and embedding."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    write_demo_tokenizer(model_dir)
    schema = StructuredSpec(json_schema='{"type": "object", "properties": {"n": '
                                        '{"type": "integer"}}}')
    data = b"grammar.png"
    cache = EmbeddingCache()
    cache.put(_key(data), _embed(data))
    prompt, offset = _image_prompt(data)
    with _encoder_service(cache) as endpoint, worker_thread(
            _native_config(model_dir), WorkerConfig(listen=ANY_PORT, events=ANY_PORT,
                                                    cost="zero", encoders=(endpoint,))) as w:
        client = connect(w.listen_endpoint)
        client.send(Generate(
            request_id="both", input_ids=prompt,
            media=[MediaSpan(offset=offset, length=TOKENS, key=_key(data))],
            sampling=Spec(max_new_tokens=NEW_TOKENS, temperature=0.0, structured=schema)))
        deltas, last = client.collect("both")
    assert isinstance(last, Finished), last
    llm = LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, structured=schema)
    [want] = llm.generate([prompt], params, media=[[(offset, _embed(data))]])
    assert tokens(deltas) == list(want.token_ids), (tokens(deltas), want.token_ids)


def test_a_worker_without_an_embedding_source_refuses_media(tiny_model_dir: Path,
                                                            connect) -> None:
    with worker_thread(_native_config(tiny_model_dir)) as worker:
        client = connect(worker.listen_endpoint)
        _, last = _ask(client, "img", b"cat.png")
    _assert_error(last, "invalid_request", "no embedding source", "--encoder", "--embed-redis")


@pytest.mark.parametrize(("spans", "message"), [
    ([(5, 9)], "media[0]: (position, id) [(13, 40)] are not media placeholder ids"),
    ([(5, 8), (7, 2)], "media[1]: offset 7 overlaps or precedes media[0], which ends at 13"),
    ([(15, 8)], "media[0]: offset 15 + length 8 exceeds the prompt's 19 tokens"),
    ([(5, 0)], "media[0]: length 0: must be >= 1"),
    ([], "outside the vocabulary [0, 320) (media placeholder ids need a media span)"),
])
def test_invalid_spans_are_refused_by_name(spans: list[tuple[int, int]], message: str,
                                           connect) -> None:
    with worker_thread(EngineConfig(backend="sim", page_size=PAGE)) as worker:
        client = connect(worker.listen_endpoint)
        prompt, _ = _image_prompt(b"x")
        client.send(_generate("bad", prompt, [
            MediaSpan(offset=o, length=n, key=_key(b"x")) for o, n in spans]))
        _, last = client.collect("bad")
    _assert_error(last, "invalid_request", message)


def test_the_sim_accepts_media_without_fetching(connect) -> None:
    """No embedding source: the sim takes the spans (it has no hidden states) and runs."""
    with worker_thread(EngineConfig(backend="sim", page_size=PAGE)) as worker:
        client = connect(worker.listen_endpoint)
        got, last = _ask(client, "img", b"x")
    assert isinstance(last, Finished) and last.finish_reason == "length", last
    assert len(got) == NEW_TOKENS, got
