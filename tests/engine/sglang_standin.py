"""A stand-in for SGLang's engine, for the sglang worker's tests where SGLang and a GPU are not.

SGLang itself cannot run here (it needs CUDA), so the worker's plumbing is driven by this
stand-in, which speaks SGLang 0.5.23's surface as ``engine.sglang_backend.launch.SGLangHandle``
exposes it:

- ``generate`` yields the dicts ``TokenizerManager`` streams in token-id mode with
  ``incremental_streaming_output`` (``sglang/srt/managers/tokenizer_manager.py``: ``output_ids``
  holds the new ids, ``meta_info`` has ``id``, ``finish_reason`` (None, then
  ``{"type": "length", "length": n}`` or ``{"type": "abort", "message": ...,
  "status_code": ...}``), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``).
- Its "model" is a toy: token ``i`` of the output is ``(sum(prompt) + i) % vocab``.
- Its prefix cache holds the full pages of finished requests, namespaced by ``cache_salt``; a
  request's ``cached_tokens`` is its longest cached page-aligned prefix (at most prompt - 1).
- KV events go out on a ZMQ PUB socket as SGLang 0.5.23's ``ZmqEventPublisher`` sends them:
  ``[topic b"", seq (8 bytes BE), msgpack [ts, [event, ...], attn_dp_rank]]``, events as tagged
  maps (``sglang/srt/disaggregation/kv_events.py``), encoded with msgspec from plain dicts (the
  byte-exact goldens are in ``test_sglang_events.py``). Its block hashes are opaque numbers
  unrelated to agentgate's, as SGLang's are.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import xxhash
import zmq

from engine.sglang_backend.worker import ModelInfo, SGLangWorker
from engine.worker.config import WorkerConfig

ANY_PORT = "tcp://127.0.0.1:0"
STANDIN_MODEL = ModelInfo("standin", None, 320)


class StandInSGLang:
    """SGLang's engine surface (``SGLangHandle``) over a toy model; see the module docstring."""

    def __init__(self, events: str, *, page_size: int = 16, vocab: int = 320,
                 supports_cache_salt: bool = True, has_grammar: bool = False,
                 step_s: float = 0.002, max_context: int = 4096) -> None:
        self.page_size = page_size
        self.vocab = vocab
        self.max_context = max_context
        self.max_batched_tokens = 512
        self.supports_cache_salt = supports_cache_salt
        self.has_grammar = has_grammar
        self.incremental = True
        self.events = events
        self.step_s = step_s
        self.calls: list[dict[str, Any]] = []  # every generate's kwargs, in order
        self.fail_with: BaseException | None = None  # raised by the next generate
        self.flushes = 0
        self._aborted: set[str] = set()
        self._running: set[str] = set()
        self._cache: dict[tuple[str | None, tuple[int, ...]], int] = {}  # prefix -> block hash
        self._pub = zmq.Context.instance().socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(events)
        self._seq = 0

    async def generate(self, kwargs: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self.calls.append(kwargs)
        if self.fail_with is not None:
            exc, self.fail_with = self.fail_with, None
            raise exc
        rid, ids = kwargs["rid"], list(kwargs["input_ids"])
        salt = kwargs.get("cache_salt")
        n = kwargs["sampling_params"]["max_new_tokens"]
        cached = self._cached(salt, ids)
        # NOTE: SGLang registers a request only after its first await (the tokenizer manager's
        # send to the scheduler): an abort_request for it before then is ignored
        await asyncio.sleep(0.05)
        self._running.add(rid)
        out: list[int] = []
        try:
            for i in range(n):
                await asyncio.sleep(self.step_s)
                if rid in self._aborted:
                    yield self._out(rid, [], ids, out, cached, {
                        "type": "abort", "message": "Abort in waiting queue",
                        "status_code": None, "err_type": None})
                    return
                token = (sum(ids) + i) % self.vocab
                out.append(token)
                done = {"type": "length", "length": n} if i == n - 1 else None
                if done is not None:
                    self._store(salt, ids + out)
                yield self._out(rid, [token], ids, out, cached, done)
        finally:
            self._running.discard(rid)

    def abort(self, rid: str) -> None:
        if rid in self._running:
            self._aborted.add(rid)

    async def flush(self) -> None:
        self.flushes += 1
        self._cache.clear()
        self._publish([{"type": "AllBlocksCleared"}])

    async def load(self) -> dict[str, Any]:
        return {"num_running_reqs": len(self._running), "num_waiting_reqs": 0,
                "num_used_tokens": 64 * len(self._running), "max_total_num_tokens": 4096}

    def close(self) -> None:
        self._pub.close(linger=0)

    def lose_a_batch(self) -> None:
        """The next batch's seq skips one, as if a batch had been dropped on the way."""
        self._seq += 1

    # ------------------------------------------------------------------ internals

    def _out(self, rid: str, new: list[int], ids: list[int], out: list[int], cached: int,
             finish: dict[str, Any] | None) -> dict[str, Any]:
        return {"output_ids": new, "meta_info": {
            "id": rid, "finish_reason": finish, "prompt_tokens": len(ids),
            "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0,
            "completion_tokens": len(out), "cached_tokens": cached}}

    def _cached(self, salt: str | None, ids: list[int]) -> int:
        p = self.page_size
        n = 0
        while (n + 1) * p <= len(ids) - 1 and (salt, tuple(ids[:(n + 1) * p])) in self._cache:
            n += 1
        return n * p

    def _store(self, salt: str | None, tokens: list[int]) -> None:
        """Cache the full pages of ``tokens``; one coalesced BlockStored for the new ones, as
        SGLang's ``KVCacheEventRecorder`` sends a chain of pages."""
        p = self.page_size
        parent: int | None = None
        event: dict[str, Any] | None = None
        for end in range(p, len(tokens) + 1, p):
            key = (salt, tuple(tokens[:end]))
            block = self._cache.get(key)
            if block is None:
                block = xxhash.xxh64_intdigest(repr(key).encode()) - 2**63
                self._cache[key] = block
                if event is None:
                    event = {"type": "BlockStored", "block_hashes": [],
                             "parent_block_hash": parent, "token_ids": [], "block_size": p,
                             "lora_id": None, "medium": "GPU"}
                    if salt is not None:
                        event["cache_salt"] = salt
                event["block_hashes"].append(block)
                event["token_ids"] += tokens[end - p:end]
            parent = block
        if event is not None:
            self._publish([event])

    def _publish(self, events: list[dict[str, Any]]) -> None:
        payload = msgspec.msgpack.encode([time.time(), events, 0])
        self._pub.send_multipart([b"", self._seq.to_bytes(8, "big"), payload])
        self._seq += 1


def ipc_endpoint() -> str:
    """A fresh ipc endpoint for a stand-in's KV event socket."""
    return f"ipc://{tempfile.gettempdir()}/agentgate-test-sglang-{uuid.uuid4().hex[:12]}"


@contextmanager
def serving(engine: StandInSGLang, *, page_size: int = 16,
            model: ModelInfo = STANDIN_MODEL,
            **cfg: object) -> Iterator[SGLangWorker]:
    """An ``SGLangWorker`` on its own asyncio loop in a thread (as SGLang's loop runs it)."""
    config = WorkerConfig(listen=ANY_PORT, events=ANY_PORT, replay=ANY_PORT,
                          **cfg)  # type: ignore[arg-type]
    loop = asyncio.new_event_loop()
    worker = SGLangWorker(config, engine, model, page_size=page_size)
    thread = threading.Thread(target=loop.run_until_complete, args=(worker.serve(),),
                              daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(10)
        assert not thread.is_alive(), "the worker did not stop within 10 s"
        worker.close()
        loop.close()
        engine.close()
