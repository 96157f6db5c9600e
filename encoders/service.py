"""The encoder service (``EncoderService``) and its client (``EncoderClient``), over ZeroMQ.

The service serves ``encoders.protocol`` on a ROUTER socket with three threads, so that neither
Redis nor the tower ever stalls the socket::

    io thread      ROUTER: decode a request, queue it (full queue: "overloaded"), send replies
    cache thread   Lookup: answer from the cache; Encode: answer the cached items, queue the rest
    batch thread   gather queued items of any requests (up to max_batch, or max_wait_ms after
                   the first), one encode_fn call, put the results into the cache, answer

``encode_fn(list[bytes]) -> list[torch.Tensor | Exception]`` gets the raw media bytes of one
batch and returns one embedding (float32/float16/bfloat16, any device) or one exception per item;
an exception fails only its item. Items with the same key in one batch are encoded once.

The client spreads calls over replicas (least outstanding calls, ties round robin). A call that
times out marks its replica down for ``down_s``: the next calls go to the others (to all again
when every replica is down). This module imports no torch (the gateway imports the client);
``EncoderClient.lookup`` does, to return tensors.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio

from encoders.protocol import (
    Describe,
    Description,
    Embedding,
    EmbeddingKey,
    Embeddings,
    Encode,
    EncodeError,
    EncodeErrorCode,
    EncodeItem,
    Lookup,
    ProtocolError,
    ServiceReply,
    ServiceRequest,
    decode_reply,
    decode_request,
    encode,
)

if TYPE_CHECKING:
    import torch

    from encoders.embed_cache import EmbeddingCache

__all__ = ["EncodeFn", "EncoderClient", "EncoderError", "EncoderRejected", "EncoderService",
           "EncoderTimeout", "EncoderUnavailable", "ServiceStats"]

logger = logging.getLogger(__name__)

EncodeFn = Callable[[list[bytes]], "list[torch.Tensor | Exception]"]
POLL_S = 0.1  # NOTE: how soon a thread notices stop()
DRAIN_MAX = 256  # messages handled per socket and poll, so neither direction starves the other
JOIN_TIMEOUT_S = 10.0
REPLY_TIMEOUT_S = 1.0  # the longest a worker thread waits to hand a reply to the io thread
DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20


@dataclass(slots=True)
class ServiceStats:
    """Counters of one service (monotonic; a lost increment across threads is harmless)."""

    requests: int = 0  # Encode and Lookup messages that decoded
    cache_hits: int = 0  # Encode items answered from the cache
    encoded: int = 0  # items passed to encode_fn (after merging equal keys in a batch)
    batches: int = 0  # encode_fn calls
    failed_items: int = 0
    overloaded: int = 0
    bad_messages: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class EncoderService:
    """Args:
    encode_fn: decode + preprocess + tower of one batch (see the module docstring); called on
        the batch thread only.
    cache: the embedding cache the service reads first and fills.
    max_batch: the most items in one ``encode_fn`` call.
    max_wait_ms: how long the first queued item waits for others to join its batch.
    max_queued_requests, max_queued_items: queue bounds; a request that finds its queue full is
        answered "overloaded" at once, one with more items than ``max_queued_items``
        "invalid_request".
    max_message_bytes: a larger request drops its client's connection (ZeroMQ MAXMSGSIZE).
    description: what ``Describe`` answers (default: ``encode_fn.description`` when it has
        one); without, ``Describe`` is an "invalid_request".
    """

    def __init__(self, encode_fn: EncodeFn, cache: EmbeddingCache, max_batch: int = 16,
                 max_wait_ms: float = 5.0, *, max_queued_requests: int = 256,
                 max_queued_items: int = 1024,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 context: zmq.Context[Any] | None = None,
                 description: Description | None = None) -> None:
        assert max_batch >= 1, f"max_batch={max_batch}: must be >= 1"
        assert max_wait_ms >= 0, f"max_wait_ms={max_wait_ms}: must be >= 0"
        assert max_queued_requests >= 1 and max_queued_items >= 1, "queue bounds must be >= 1"
        self.encode_fn, self.cache = encode_fn, cache
        self.max_batch, self.max_wait_s = max_batch, max_wait_ms / 1000
        self.max_message_bytes = max_message_bytes
        self.stats = ServiceStats()
        self.description = description or getattr(encode_fn, "description", None)
        self.endpoint: str | None = None
        self._ctx = context or zmq.Context.instance()
        self._jobs: queue.Queue[_Job] = queue.Queue(max_queued_requests)
        self._work: queue.Queue[_Work] = queue.Queue(max_queued_items)
        self._outbox_endpoint = f"inproc://encoder-outbox-{uuid.uuid4().hex}"
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._router: zmq.Socket[Any] | None = None
        self._outbox: zmq.Socket[Any] | None = None

    def bind(self, endpoint: str) -> str:
        """Bind the ROUTER (``tcp://127.0.0.1:0`` picks a port) and start the cache and batch
        threads; returns the bound endpoint. ``run()`` then serves."""
        assert self._router is None, "bind() once"
        self._outbox = self._ctx.socket(zmq.PULL)
        self._outbox.bind(self._outbox_endpoint)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        self._router.bind(endpoint[:-2] + ":*" if endpoint.endswith(":0") else endpoint)
        self.endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        for name, target in (("encoder-cache", self._cache_loop),
                             ("encoder-batch", self._batch_loop)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self.endpoint

    def run(self) -> None:
        """Serve until ``stop()`` (safe from a signal handler); needs ``bind()`` first."""
        assert self._router is not None and self._outbox is not None, "bind() first"
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._outbox, zmq.POLLIN)
        while not self._stopping.is_set():
            ready = dict(poller.poll(int(POLL_S * 1000)))
            if self._router in ready:
                self._drain_requests()
            if self._outbox in ready:
                self._drain_outbox()

    def serve(self, endpoint: str) -> str:
        """``bind(endpoint)`` and ``run()`` on a thread of its own; returns the endpoint."""
        bound = self.bind(endpoint)
        thread = threading.Thread(target=self.run, name="encoder-io", daemon=True)
        thread.start()
        self._threads.append(thread)
        return bound

    def stop(self) -> None:
        self._stopping.set()

    def close(self) -> None:
        """Stop, wait for the threads (an ``encode_fn`` call in progress finishes first), close
        the sockets. Requests not answered yet never are."""
        self.stop()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(JOIN_TIMEOUT_S)
                if thread.is_alive():
                    logger.warning("encoder: thread %s still busy after %g s (encode_fn?)",
                                   thread.name, JOIN_TIMEOUT_S)
        for sock in (self._router, self._outbox):
            if sock is not None:
                sock.close(linger=0)

    # ------------------------------------------------------------------ io thread

    def _drain_requests(self) -> None:
        assert self._router is not None
        for _ in range(DRAIN_MAX):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            envelope, data = frames[:-1], frames[-1]
            try:
                msg = decode_request(data)
            except ProtocolError as exc:
                self.stats.bad_messages += 1
                self._send(envelope, _error(_request_id_of(data), "bad_message", str(exc)))
                continue
            self.stats.requests += 1
            if isinstance(msg, Describe):
                self._send(envelope, self._describe(msg.request_id))
                continue
            try:
                self._jobs.put_nowait(_Job(envelope, msg))
            except queue.Full:
                self.stats.overloaded += 1
                self._send(envelope, _error(msg.request_id, "overloaded",
                                            f"{self._jobs.maxsize} requests queued"))

    def _describe(self, request_id: str) -> ServiceReply:
        if self.description is None:
            return _error(request_id, "invalid_request", "this encoder has no description")
        return msgspec.structs.replace(self.description, request_id=request_id)

    def _drain_outbox(self) -> None:
        assert self._outbox is not None
        for _ in range(DRAIN_MAX):
            try:
                frames = self._outbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._send(frames[:-1], frames[-1])

    def _send(self, envelope: list[bytes], reply: bytes | ServiceReply) -> None:
        assert self._router is not None
        payload = reply if isinstance(reply, bytes) else encode(reply)
        # NOTE: a ROUTER never blocks: a reply to a gone client, or past its HWM, is dropped
        self._router.send_multipart([*envelope, payload], zmq.NOBLOCK)

    # ------------------------------------------------------------------ cache thread

    def _cache_loop(self) -> None:
        replies = _Replies(self._ctx, self._outbox_endpoint)
        try:
            while not self._stopping.is_set():
                try:
                    job = self._jobs.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                try:
                    self._handle(job, replies)
                except Exception as exc:
                    logger.exception("encoder: request %s failed", job.msg.request_id)
                    replies.send(job.envelope, _error(job.msg.request_id, "internal", repr(exc)))
        finally:
            replies.close()

    def _handle(self, job: _Job, replies: _Replies) -> None:
        from encoders.embed_cache import to_embedding

        msg = job.msg
        if isinstance(msg, Lookup):
            tensors = self.cache.get_many(msg.keys)
            results = [None if t is None else to_embedding(i, t) for i, t in enumerate(tensors)]
            replies.send(job.envelope, Embeddings(request_id=msg.request_id, results=results))
            return
        if len(msg.items) > self._work.maxsize:
            replies.send(job.envelope, _error(msg.request_id, "invalid_request",
                                              f"{len(msg.items)} items: at most "
                                              f"{self._work.maxsize} per request"))
            return
        tensors = self.cache.get_many([item.key for item in msg.items])
        misses = [i for i, t in enumerate(tensors) if t is None]
        # NOTE: this thread is the only producer, so the room seen here cannot shrink
        if self._work.qsize() + len(misses) > self._work.maxsize:
            self.stats.overloaded += 1
            replies.send(job.envelope, _error(msg.request_id, "overloaded",
                                              f"{self._work.qsize()} items queued"))
            return
        pending = _Pending(job.envelope, msg.request_id, msg.with_data, len(misses))
        pending.results = [None if t is None else to_embedding(i, t, msg.with_data)
                           for i, t in enumerate(tensors)]
        self.stats.cache_hits += len(msg.items) - len(misses)
        if not misses:
            replies.send(job.envelope, pending.reply())
        for i in misses:
            self._work.put_nowait(_Work(pending, i, msg.items[i]))

    # ------------------------------------------------------------------ batch thread

    def _batch_loop(self) -> None:
        replies = _Replies(self._ctx, self._outbox_endpoint)
        try:
            while not self._stopping.is_set():
                batch = self._gather()
                try:
                    self._encode(batch, replies)
                except Exception as exc:
                    logger.exception("encoder: a batch of %d items failed", len(batch))
                    for pending in {id(w.pending): w.pending for w in batch}.values():
                        if pending.remaining > 0:
                            pending.remaining = 0
                            replies.send(pending.envelope, _error(
                                pending.request_id, "internal", repr(exc)))
        finally:
            replies.close()

    def _gather(self) -> list[_Work]:
        """Up to ``max_batch`` queued items: the first, then those that come within
        ``max_wait_s`` of it (and those already queued by then)."""
        try:
            batch = [self._work.get(timeout=POLL_S)]
        except queue.Empty:
            return []
        deadline = time.monotonic() + self.max_wait_s
        while len(batch) < self.max_batch:
            left = deadline - time.monotonic()
            try:
                batch.append(self._work.get(timeout=left) if left > 0 else self._work.get_nowait())
            except queue.Empty:
                break
        return batch

    def _encode(self, batch: list[_Work], replies: _Replies) -> None:
        from encoders.embed_cache import to_embedding

        if not batch:
            return
        by_key: dict[EmbeddingKey, list[_Work]] = {}
        for work in batch:
            by_key.setdefault(work.item.key, []).append(work)
        outs = self._call_encode_fn([works[0].item.data for works in by_key.values()])
        done: list[tuple[EmbeddingKey, Any]] = []
        for (key, works), out in zip(by_key.items(), outs):
            for work in works:
                if not isinstance(out, BaseException):
                    try:
                        out = out.detach().to("cpu")
                        work.pending.results[work.index] = to_embedding(
                            work.index, out, work.pending.with_data)
                    except Exception as exc:  # noqa: BLE001 (not a tensor, or a bad dtype)
                        out = exc
                if isinstance(out, BaseException):
                    self.stats.failed_items += 1
                    work.pending.errors.append(_error(
                        work.pending.request_id, "encode_failed", _reason(out), work.index))
            if not isinstance(out, BaseException):
                done.append((key, out))
        try:
            self.cache.put_many(done)
        except ValueError:  # NOTE: e.g. > 8 dims: answered, just not cached
            logger.exception("encoder: could not cache %d embeddings", len(done))
        for work in batch:
            work.pending.remaining -= 1
            if work.pending.remaining == 0:
                replies.send(work.pending.envelope, work.pending.reply())

    def _call_encode_fn(self, datas: list[bytes]) -> list[Any]:
        self.stats.batches += 1
        self.stats.encoded += len(datas)
        try:
            outs = list(self.encode_fn(datas))
        except Exception as exc:  # noqa: BLE001 (the whole batch fails, the service goes on)
            logger.exception("encoder: encode_fn raised on a batch of %d", len(datas))
            return [exc] * len(datas)
        if len(outs) != len(datas):
            exc = RuntimeError(f"encode_fn returned {len(outs)} results for {len(datas)} items")
            logger.error("encoder: %s", exc)
            return [exc] * len(datas)
        return outs


class EncoderError(Exception):
    """A call to the encoder service failed as a whole."""


class EncoderTimeout(EncoderError):
    """A replica did not answer in time (it is then avoided for ``down_s``)."""


class EncoderUnavailable(EncoderError):
    """The call could not be sent: too many calls outstanding, or a replica's send queue full."""


class EncoderRejected(EncoderError):
    """The service answered the request with a top-level ``EncodeError``."""

    def __init__(self, endpoint: str, error: EncodeError) -> None:
        super().__init__(f"encoder {endpoint} refused request {error.request_id}: "
                         f"{error.code}: {error.reason}")
        self.error = error


@dataclass(slots=True)
class ReplicaStats:
    endpoint: str
    sent: int = 0
    answered: int = 0
    timeouts: int = 0
    outstanding: int = 0
    down_until: float = 0.0  # time.monotonic(); the replica is skipped before it


class EncoderClient:
    """Calls a set of encoder service replicas.

    ``encode`` is a coroutine: use it from one event loop (its sockets are made in the loop of
    the first call). ``lookup`` is synchronous, for a worker's own (non-asyncio) thread; lookups
    from several threads take turns. Call ``close()`` when done.

    Args:
        endpoints: the replicas' ROUTER endpoints.
        timeout_s: default per-call timeout.
        down_s: how long a replica that timed out is skipped.
        max_outstanding: the most calls in flight; more raise ``EncoderUnavailable``.
    """

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 10.0, down_s: float = 5.0,
                 max_outstanding: int = 1024) -> None:
        assert endpoints, "at least one encoder endpoint"
        assert timeout_s > 0 and down_s >= 0 and max_outstanding >= 1
        self.endpoints = list(endpoints)
        self.timeout_s, self.down_s, self.max_outstanding = timeout_s, down_s, max_outstanding
        self.replicas = [ReplicaStats(ep) for ep in self.endpoints]
        self._lock = threading.Lock()
        self._next = 0
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]
        self._actx: zmq.asyncio.Context | None = None
        self._asocks: list[zmq.asyncio.Socket] = []
        self._readers: list[asyncio.Task[None]] = []
        self._futures: dict[str, asyncio.Future[ServiceReply]] = {}
        self._sctx: zmq.Context[Any] | None = None
        self._ssocks: list[zmq.Socket[Any]] = []
        self._sync_lock = threading.Lock()

    async def encode(self, items: Sequence[EncodeItem], *, with_data: bool = True,
                     timeout_s: float | None = None) -> Embeddings:
        """The embeddings of ``items`` (cached ones are not encoded again); items that failed
        are None in ``results``, with their ``EncodeError`` in ``errors``.

        Raises:
            EncoderTimeout: the chosen replica did not answer within ``timeout_s``.
            EncoderUnavailable: too many calls outstanding, or the replica's queue is full.
            EncoderRejected: the service refused the request (e.g. "overloaded").
        """
        self._open_async()
        i = self._pick()
        request_id = self._request_id()
        payload = encode(Encode(request_id=request_id, items=list(items), with_data=with_data))
        future: asyncio.Future[ServiceReply] = asyncio.get_running_loop().create_future()
        self._futures[request_id] = future
        try:
            try:
                await self._asocks[i].send(payload, zmq.NOBLOCK)
            except zmq.Again:
                raise self._queue_full(i) from None
            try:
                reply = await asyncio.wait_for(future, timeout_s or self.timeout_s)
            except TimeoutError:
                raise self._timed_out(i, "encode", request_id, timeout_s) from None
        finally:
            self._futures.pop(request_id, None)
            self._finished(i)
        return self._answered(i, reply)

    async def describe(self, timeout_s: float | None = None) -> Description:
        """What the encoder encodes with (``Description``), from the replica ``_pick`` chooses.

        Raises:
            EncoderTimeout, EncoderUnavailable, EncoderRejected: as ``encode``.
        """
        self._open_async()
        i = self._pick()
        request_id = self._request_id()
        future: asyncio.Future[ServiceReply] = asyncio.get_running_loop().create_future()
        self._futures[request_id] = future
        try:
            try:
                await self._asocks[i].send(encode(Describe(request_id=request_id)), zmq.NOBLOCK)
            except zmq.Again:
                raise self._queue_full(i) from None
            try:
                reply = await asyncio.wait_for(future, timeout_s or self.timeout_s)
            except TimeoutError:
                raise self._timed_out(i, "describe", request_id, timeout_s) from None
        finally:
            self._futures.pop(request_id, None)
            self._finished(i)
        return self._answered(i, reply)  # type: ignore[return-value]

    def lookup(self, keys: Sequence[EmbeddingKey],
               timeout_s: float | None = None) -> list[torch.Tensor | None]:
        """The cached embeddings of ``keys`` (CPU tensors), None where not cached; blocking.

        Raises:
            EncoderTimeout, EncoderUnavailable, EncoderRejected: as ``encode``.
        """
        from encoders.embed_cache import from_embedding

        timeout_s = timeout_s or self.timeout_s
        with self._sync_lock:
            i = self._pick()
            try:
                sock = self._sync_socket(i)
                request_id = self._request_id()
                try:
                    sock.send(encode(Lookup(request_id=request_id, keys=list(keys))), zmq.NOBLOCK)
                except zmq.Again:
                    raise self._queue_full(i) from None
                reply = _recv_reply(sock, request_id, time.monotonic() + timeout_s)
            finally:
                self._finished(i)
            if reply is None:
                raise self._timed_out(i, "lookup", request_id, timeout_s)
        embeddings = self._answered(i, reply)
        return [None if e is None else from_embedding(e) for e in embeddings.results]

    async def aclose(self) -> None:
        """``close()``, from the event loop that ran ``encode``, after its readers stopped."""
        for task in self._readers:
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        self.close()

    def close(self) -> None:
        """Close every socket (``aclose()`` is cleaner from the loop that ran ``encode``)."""
        for task in self._readers:
            task.cancel()
        for sock in (*self._asocks, *self._ssocks):
            sock.close(linger=0)
        for ctx in (self._actx, self._sctx):
            if ctx is not None:
                ctx.term()
        self._asocks, self._ssocks, self._readers = [], [], []
        self._actx = self._sctx = None

    # ------------------------------------------------------------------ replicas

    def _pick(self) -> int:
        """The up replica with the fewest calls in flight, ties in turn (all replicas are
        candidates when every one is down); counts the call as in flight."""
        with self._lock:
            if sum(r.outstanding for r in self.replicas) >= self.max_outstanding:
                raise EncoderUnavailable(f"{self.max_outstanding} encoder calls outstanding")
            now = time.monotonic()
            up = [r.down_until <= now for r in self.replicas]
            if not any(up):
                up = [True] * len(self.replicas)
            fewest = min(r.outstanding for r, ok in zip(self.replicas, up) if ok)
            n = len(self.replicas)
            i = next(j % n for j in range(self._next, self._next + n)
                     if up[j % n] and self.replicas[j % n].outstanding == fewest)
            self._next = (i + 1) % n
            self.replicas[i].outstanding += 1
            self.replicas[i].sent += 1
            return i

    def _finished(self, i: int) -> None:
        with self._lock:
            self.replicas[i].outstanding -= 1

    def _answered(self, i: int, reply: ServiceReply) -> Embeddings:
        """NOTE: typed for ``encode`` and ``lookup``; ``describe`` gets its ``Description``."""
        with self._lock:
            self.replicas[i].answered += 1
            self.replicas[i].down_until = 0.0
        if isinstance(reply, EncodeError):
            raise EncoderRejected(self.endpoints[i], reply)
        return reply

    def _timed_out(self, i: int, what: str, request_id: str,
                   timeout_s: float | None) -> EncoderTimeout:
        with self._lock:
            self.replicas[i].timeouts += 1
            self.replicas[i].down_until = time.monotonic() + self.down_s
        return EncoderTimeout(
            f"encoder {self.endpoints[i]} did not answer {what} request {request_id} within "
            f"{timeout_s or self.timeout_s:g} s; other replicas get the next calls for "
            f"{self.down_s:g} s")

    def _queue_full(self, i: int) -> EncoderUnavailable:
        return EncoderUnavailable(f"encoder {self.endpoints[i]}: send queue full")

    # ------------------------------------------------------------------ sockets

    def _request_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def _open_async(self) -> None:
        if self._actx is not None:
            return
        self._actx = zmq.asyncio.Context()
        for endpoint in self.endpoints:
            sock = self._actx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._asocks.append(sock)
            self._readers.append(asyncio.get_running_loop().create_task(self._read(sock)))

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            data = await sock.recv()
            try:
                reply = decode_reply(data)
            except ProtocolError as exc:
                logger.warning("encoder client: dropped a reply: %s", exc)
                continue
            future = self._futures.get(reply.request_id)
            if future is not None and not future.done():  # NOTE: else late, after a timeout
                future.set_result(reply)

    def _sync_socket(self, i: int) -> zmq.Socket[Any]:
        """NOTE: only under ``_sync_lock``."""
        if self._sctx is None:
            self._sctx = zmq.Context()
            for endpoint in self.endpoints:
                sock = self._sctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(endpoint)
                self._ssocks.append(sock)
        return self._ssocks[i]


# ---------------------------------------------------------------------- helpers


@dataclass(slots=True)
class _Job:
    envelope: list[bytes]
    msg: ServiceRequest


@dataclass(slots=True)
class _Pending:
    """An Encode waiting for its uncached items. NOTE: the cache thread fills it before it
    queues the items; from then on only the batch thread touches it."""

    envelope: list[bytes]
    request_id: str
    with_data: bool
    remaining: int
    results: list[Embedding | None] = field(default_factory=list)
    errors: list[EncodeError] = field(default_factory=list)

    def reply(self) -> Embeddings:
        return Embeddings(request_id=self.request_id, results=self.results,
                          errors=sorted(self.errors, key=lambda e: e.index or 0))


@dataclass(slots=True)
class _Work:
    pending: _Pending
    index: int
    item: EncodeItem


class _Replies:
    """A worker thread's way to the io thread, which alone may use the ROUTER."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, int(REPLY_TIMEOUT_S * 1000))
        self._sock.connect(endpoint)

    def send(self, envelope: list[bytes], reply: ServiceReply) -> None:
        try:
            self._sock.send_multipart([*envelope, encode(reply)])
        except zmq.Again:  # NOTE: the io thread stopped (or is far behind): the client times out
            logger.warning("encoder: reply to %s dropped (io thread not reading)",
                           reply.request_id)

    def close(self) -> None:
        self._sock.close(linger=0)


def _error(request_id: str, code: EncodeErrorCode, reason: str,
           index: int | None = None) -> EncodeError:
    return EncodeError(request_id=request_id, code=code, reason=reason, index=index)


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def _request_id_of(data: bytes) -> str:
    """The request id of a message that did not decode, when it has one; else ""."""
    try:
        raw = msgspec.msgpack.decode(data)
    except Exception:  # noqa: BLE001
        return ""
    request_id = raw.get("request_id") if isinstance(raw, dict) else None
    return request_id if isinstance(request_id, str) else ""


def _recv_reply(sock: zmq.Socket[Any], request_id: str, deadline: float) -> ServiceReply | None:
    """The reply to ``request_id`` (late replies to earlier calls are dropped), or None when
    ``deadline`` passes first."""
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(max(1, int(left * 1000))):
            continue
        try:
            reply = decode_reply(sock.recv())
        except ProtocolError as exc:
            logger.warning("encoder client: dropped a reply: %s", exc)
            continue
        if reply.request_id == request_id:
            return reply
    return None
