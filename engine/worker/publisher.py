"""What the worker sends: each request's reply stream, KV events and load reports.

``RequestStream`` turns a request's progress into its ``TokenDelta``s and its one last message.

The PUB socket carries KV events (topic ``b"kv"``) and load reports (topic ``b"load"``).

Topics (SUB sockets filter on the prefix, so subscribe to exactly one of them):

    b"kv"    [b"kv", seq (u64 BE), msgpack [ts, [event, ...], dp_rank]]   engine.worker.events
    b"load"  [b"load", seq (u64 BE), msgpack LoadReport]                   engine.protocol

The two topics count their ``seq`` separately, so a KV event subscriber (``EventSubscriber(...,
topic="kv")``) sees no gaps caused by load reports. A subscriber to ``""`` gets both and must
dispatch on the first frame.

``KVEventBuffer`` collects the prefix cache's ``CacheEvent``s during a step and turns them into
``engine.worker.events`` types, merging consecutive events of one kind and one medium where the
merged event means the same (``BlockStored`` only when the pages chain; the SWA news of
consecutive ``BlockStored``s in one ``SwaBlocksStored`` after them). Each event carries its
``CacheEvent.medium`` ("GPU", "CPU" for L2, "GCACHE" for L3) in its ``medium`` field.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, cast

import zmq

from engine.engine import EngineStats
from engine.kv.prefix_cache import CacheEvent
from engine.protocol import ErrorReply, Finished, FinishReason, LoadReport, TokenDelta, encode
from engine.sequence import Sequence
from engine.worker.curve import CurveServerKeys
from engine.worker.events import (
    MEDIUM_GPU,
    SEQ_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisher,
    KVEvent,
    SwaBlocksDropped,
    SwaBlocksStored,
    SwaCheckpointDropped,
    SwaCheckpointStored,
)

KV_TOPIC = "kv"
LOAD_TOPIC = "load"


@dataclass(slots=True)
class RequestStream:
    """One ``Generate``'s replies: what its client has been sent, and how the stream ends.

    Attributes:
        identity: the client's ROUTER identity (replies go there).
        request_id: the client's id for the request (the engine's is ``seq.request_id``).
        num_sent: output tokens already sent.
        cached_tokens: the prefix cache hit, fixed by the first delta (a preempted request may
            hit again on resume; the client is told the first figure only).
    """

    identity: bytes
    request_id: str
    seq: Sequence
    num_sent: int = 0
    cached_tokens: int | None = None
    stream_interval_s: float = 0.0
    last_sent_s: float = 0.0  # time.monotonic() of the last delta (or of the request's start)

    def is_due(self, now_s: float) -> bool:
        """Whether new tokens go out now (always, unless a stream interval holds them back)."""
        return now_s - self.last_sent_s >= self.stream_interval_s

    def next_delta(self) -> TokenDelta | None:
        """The output tokens not sent yet (None if there are none); marks them sent."""
        seq, start = self.seq, self.num_sent
        new = seq.output_ids[start:]
        if not new:
            return None
        first = self.cached_tokens is None
        cached = self.cached_tokens = self._cached()
        want = seq.params.logprobs
        top = seq.top_logprobs[start:] if want else None
        self.num_sent = len(seq.output_ids)
        self.last_sent_s = time.monotonic()
        return TokenDelta(
            request_id=self.request_id, token_ids=new,
            logprobs=seq.logprobs[start:] if want is not None else None,
            top_logprobs=[list(t) for t in top] if top and len(top) == len(new) else None,
            cached_tokens=cached if first else 0,
        )

    def last_message(self) -> Finished | ErrorReply:
        """The stream's end, once ``seq`` is finished (send ``next_delta()`` first).

        NOTE: the engine's "error" (the request cannot fit in KV memory even alone) becomes
        ``ErrorReply(code="context_too_long")``, never ``Finished("error")``.
        """
        seq = self.seq
        if seq.finish_reason == "error":
            text = (f"request of {len(seq.prompt_ids)} prompt tokens + max_new_tokens="
                    f"{seq.params.max_new_tokens} does not fit in this worker's KV memory")
            return ErrorReply(request_id=self.request_id, code="context_too_long", message=text)
        cached = self._cached()
        storage = min(seq.num_cached_storage, cached)
        host = min(seq.num_cached_host, cached - storage)
        return Finished(
            request_id=self.request_id, finish_reason=cast(FinishReason, seq.finish_reason),
            prompt_tokens=len(seq.prompt_ids), completion_tokens=len(seq.output_ids),
            cached_tokens=cached, cached_tokens_device=cached - host - storage,
            cached_tokens_host=host, cached_tokens_storage=storage,
        )

    def _cached(self) -> int:
        if self.cached_tokens is not None:
            return self.cached_tokens
        return min(self.seq.num_cached, len(self.seq.prompt_ids))


def load_report(worker_id: str, stats: EngineStats, instance_id: str = "") -> LoadReport:
    s = stats
    return LoadReport(
        worker_id=worker_id, instance_id=instance_id,
        num_running=s.num_running, num_waiting=s.num_waiting,
        free_full_pages=s.free_full_pages, free_swa_pages=s.free_swa_pages,
        used_bytes=s.used_bytes, total_bytes=s.total_bytes, cached_pages=s.cached_pages,
        retained_pages=s.retained_pages, retains_expired=s.retains_expired,
        host_pages=s.host_pages, host_used_bytes=s.host_used_bytes,
        host_total_bytes=s.host_total_bytes, storage_hit_tokens=s.storage_hit_tokens,
        storage_written_pages=s.storage_written_pages,
        storage_write_dropped=s.storage_write_dropped, storage_errors=s.storage_errors,
        storage_corrupt=s.storage_corrupt, hibernated_sessions=s.hibernated_sessions,
        mtp_verify_steps=s.mtp_verify_steps, mtp_draft_tokens=s.mtp_draft_tokens,
        mtp_accepted_tokens=s.mtp_accepted_tokens,
    )


class WorkerPublisher(EventPublisher):
    """An ``EventPublisher`` on topic ``b"kv"`` that also sends load reports under ``b"load"``."""

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None,
                 context: zmq.Context[Any] | None = None,
                 curve: CurveServerKeys | None = None) -> None:
        super().__init__(endpoint, replay_endpoint=replay_endpoint, topic=KV_TOPIC,
                         context=context, curve=curve)
        self._load_topic = LOAD_TOPIC.encode("utf-8")
        self._load_seq = 0

    def publish_load(self, report: LoadReport) -> None:
        """Send one load report; dropped (never blocks) when subscribers are slow or absent."""
        seq = self._load_seq.to_bytes(SEQ_BYTES, "big")
        self._load_seq += 1
        # NOTE: the PUB socket is the base class's; a public "send under another topic" method on
        # EventPublisher would be cleaner (events.py is not this module's).
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart([self._load_topic, seq, encode(report)], zmq.NOBLOCK)


@dataclass(slots=True)
class _Run:
    """Consecutive cache events of one kind and medium, merged (mutable while the step runs)."""

    kind: str
    medium: str = MEDIUM_GPU
    hashes: list[int] = field(default_factory=list)
    parent: int | None = None
    token_ids: list[int] | None = None
    swa: list[int] = field(default_factory=list)  # NOTE: stored runs: the pages with SWA KV


class KVEventBuffer:
    """Collects ``CacheEvent``s (pass ``add`` as the engine's ``on_cache_event``) until ``drain``.

    Args:
        page_size: tokens per page (``BlockStored.block_size``).
        window: W of the SWA layers (``SwaCheckpointStored.window``).
    """

    def __init__(self, page_size: int, window: int) -> None:
        self.page_size, self.window = page_size, window
        self._runs: list[_Run] = []

    def add(self, event: CacheEvent) -> None:
        kind, _, parent, tokens, _, medium = event
        runs = self._runs
        last = runs[-1] if runs else None
        # NOTE: whether the event joins the last run without changing what the events say,
        # inlined (one check per cache event). A run is one medium (a page in L2 is not one in
        # L1); removals and checkpoint events are sets of hashes ("cleared" twice = once); one
        # BlockStored is a chain: page i's parent is page i - 1, and the tokens must be known
        # for every page, or the concatenated token_ids would not line up with the hashes.
        if last is None or kind != last.kind or medium != last.medium or (
                kind == "stored" and (last.token_ids is None or tokens is None
                                      or parent != last.hashes[-1])):
            last = _Run(kind, medium, parent=parent)
            if kind == "stored" and tokens is not None:
                last.token_ids = []
            runs.append(last)
        _append(last, event)

    def drain(self) -> list[KVEvent]:
        """The events collected since the last call, in order, merged; empties the buffer.

        The pages of consecutive ``BlockStored``s (one medium) that came with SWA KV follow
        them in one ``SwaBlocksStored``. NOTE: not one after each: the publisher sends the SWA
        extension in batches of its own, so a step whose requests each completed a page would
        cost two messages a request (``EventPublisher.publish``); delaying a page's SWA news
        past other pages' BlockStored changes nothing a router concludes (it needs the page
        stored first, and nothing in between removes it)."""
        runs, self._runs = self._runs, []
        out: list[KVEvent] = []
        swa: list[int] = []  # SWA pages of the stored runs since the last flush, in order
        medium = MEDIUM_GPU
        for run in runs:
            if swa and (run.kind != "stored" or run.medium != medium):
                out.append(SwaBlocksStored(block_hashes=swa, window=self.window, medium=medium))
                swa = []
            out.append(self._to_event(run))
            if run.kind == "stored" and run.swa:
                swa, medium = swa + run.swa, run.medium
        if swa:
            out.append(SwaBlocksStored(block_hashes=swa, window=self.window, medium=medium))
        return out

    def _to_event(self, run: _Run) -> KVEvent:
        medium = run.medium
        if run.kind == "stored":
            return BlockStored(block_hashes=run.hashes, parent_block_hash=run.parent,
                               token_ids=run.token_ids or [], block_size=self.page_size,
                               medium=medium)
        if run.kind == "removed":
            return BlockRemoved(block_hashes=run.hashes, medium=medium)
        if run.kind == "swa_stored":
            return SwaBlocksStored(block_hashes=run.hashes, window=self.window, medium=medium)
        if run.kind == "swa_dropped":
            return SwaBlocksDropped(block_hashes=run.hashes, medium=medium)
        if run.kind == "ckpt_stored":
            return SwaCheckpointStored(block_hashes=run.hashes, window=self.window, medium=medium)
        if run.kind == "ckpt_dropped":
            return SwaCheckpointDropped(block_hashes=run.hashes, medium=medium)
        assert run.kind == "cleared", f"unknown cache event kind {run.kind!r}"
        return AllBlocksCleared()  # NOTE: no medium on the wire (vLLM's has none either)


def _append(run: _Run, event: CacheEvent) -> None:
    if event.kind == "cleared":
        return
    assert event.page_hash is not None, f"{event.kind} event without a page hash"
    run.hashes.append(event.page_hash)
    if event.swa:
        run.swa.append(event.page_hash)
    if run.token_ids is not None and event.token_ids is not None:
        run.token_ids.extend(event.token_ids)
