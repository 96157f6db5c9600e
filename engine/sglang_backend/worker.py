"""``agentgate worker --backend sglang``: SGLang in-process behind agentgate's worker protocol.

The gateway cannot tell this worker from a native one: the same ROUTER socket and messages
(``engine.protocol``: Hello/Welcome, Generate -> TokenDelta... -> Finished | ErrorReply, Abort,
Retain, GetLoad, Flush), the same PUB socket with KV events (topic ``kv``) and load reports
(topic ``load``), the same replay socket, CURVE and loopback rules (``WorkerConfig``).

Inside, everything runs on SGLang's asyncio loop (its ``TokenizerManager`` lives there): one task
reads the ROUTER, one task per request drives ``Engine.async_generate`` and maps each streamed
output (``engine.sglang_backend.mapping.OutputMapper``), one task reads SGLang's own KV event
socket and re-publishes its batches in agentgate's format (``engine.sglang_backend.kv_events``:
re-hashed with ``engine.hashing`` at agentgate's page size), and a periodic task sends load
reports, serves event replays and aborts the requests of clients gone silent.

What this backend does not do (each answered, never silently wrong):

- ``cache_salt`` goes to SGLang's ``cache_salt`` (its radix key namespace); an SGLang without
  one refuses salted requests (``invalid_request``), never shares their prefixes.
- ``Retain`` and ``retain_ttl_s``: SGLang has no per-request retention; both are accepted,
  ignored and counted (``LoadReport.unsupported_hints``, the gateway's
  ``agentgate_worker_unsupported_hints_total``).
- Images (``Generate.media``): refused with ``invalid_request``.
- Structured output needs SGLang's grammar backend, which needs its tokenizer: in token-id mode
  (the default) a ``structured`` request is refused with ``invalid_grammar`` naming the flag that
  turns it on (``--sglang-arg skip_tokenizer_init=false``).
- SWA: SGLang's events do not say which pages still hold sliding-window KV, so none of the SWA
  extension events are sent and ``Welcome.swa_page_events`` is false; a router then credits an
  SWA model's hits on this worker only where it can prove the window (conservative).
- ``max_queued_per_client`` counts a client's requests in the worker (running and waiting:
  SGLang's queue is not visible per client).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import zmq
import zmq.asyncio

from engine.protocol import (
    PROTOCOL_VERSION,
    Abort,
    ClientMsg,
    ErrorCode,
    ErrorReply,
    Finished,
    Flush,
    Generate,
    GetLoad,
    Hello,
    LoadReport,
    ProtocolError,
    Retain,
    TokenDelta,
    Welcome,
    WorkerMsg,
    decode_client,
    encode,
    merge_deltas,
)
from engine.sglang_backend.kv_events import EventTranslator
from engine.sglang_backend.mapping import OutputMapper, Refused, generate_kwargs, unsupported_hints
from engine.sglang_backend.wire import SGLangWireError, decode_batch
from engine.worker.clients import ClientWatch
from engine.worker.config import WorkerConfig, stream_interval_error
from engine.worker.curve import any_port, start_authenticator
from engine.worker.publisher import WorkerPublisher

logger = logging.getLogger(__name__)

PERIODIC_S = 0.05  # NOTE: the housekeeping task's tick: replay requests, load reports, timeouts


class Engine(Protocol):
    """The SGLang surface the worker uses (``engine.sglang_backend.launch.SGLangHandle``)."""

    page_size: int
    max_context: int
    max_batched_tokens: int
    supports_cache_salt: bool
    has_grammar: bool
    incremental: bool
    events: str

    def generate(self, kwargs: dict[str, Any]) -> Any: ...  # an async iterator of output dicts
    def abort(self, rid: str) -> None: ...
    async def flush(self) -> None: ...
    async def load(self) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What ``Welcome`` says about the model: its name, W of its SWA layers (None without)."""

    name: str
    sliding_window: int | None
    vocab_size: int | None = None


@dataclass(slots=True)
class _Request:
    """One running ``Generate``: SGLang's id for it, its output mapper, its stream pacing."""

    identity: bytes
    request_id: str
    rid: str
    mapper: OutputMapper
    interval_s: float
    last_sent_s: float
    task: asyncio.Task[None] | None = None
    held: TokenDelta | None = None
    aborted: bool = False


@dataclass(slots=True)
class Counters:
    """Since start: hints this backend ignores, and SGLang event batches lost or unreadable."""

    unsupported_hints: int = 0
    event_gaps: int = 0
    bad_event_batches: int = 0


class SGLangWorker:
    """Serves one SGLang engine; ``await serve()`` runs until ``stop()``.

    Args:
        page_size: the page size announced to the gateway and used to re-hash SGLang's events
            (a multiple of SGLang's own, ``engine.page_size``).
    """

    def __init__(self, cfg: WorkerConfig, engine: Engine, model: ModelInfo, *, page_size: int,
                 context: zmq.Context[Any] | None = None) -> None:
        if page_size % engine.page_size:
            raise ValueError(f"--page-size {page_size} must be a multiple of SGLang's page size "
                             f"{engine.page_size} (set both, e.g. --sglang-arg page_size=N)")
        self.cfg = cfg
        self.engine = engine
        self.model = model
        self.page_size = page_size
        self.instance_id = uuid.uuid4().hex
        self.counters = Counters()
        self._ctx = context or zmq.Context.instance()
        self._actx = zmq.asyncio.Context(shadow=self._ctx)
        self._translator = EventTranslator(page_size, sglang_page_size=engine.page_size)
        self._requests: dict[tuple[bytes, str], _Request] = {}
        self._per_client: dict[bytes, int] = {}
        self._clients = ClientWatch(cfg.client_timeout_s)
        self._stop_requested = False
        self._last_load_s = 0.0
        self._sglang_seq: int | None = None
        self._auth, curve = start_authenticator(self._ctx, cfg.curve_keys, cfg.endpoints)
        self._router = self._actx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        try:
            if curve is not None:
                curve.apply(self._router)
            self._router.bind(any_port(cfg.listen))
            self.listen_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._pub = WorkerPublisher(cfg.events, replay_endpoint=cfg.replay,
                                        context=self._ctx, curve=curve)
        except Exception:
            self._router.close(linger=0)
            if self._auth is not None:
                self._auth.stop()
            raise
        self._sub = self._actx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(engine.events)

    @property
    def endpoints(self) -> tuple[str, str]:
        """The bound (listen, events) addresses (port 0 resolved)."""
        return self.listen_endpoint, self._pub.endpoint

    def welcome(self) -> Welcome:
        return Welcome(
            version=PROTOCOL_VERSION, worker_id=self.cfg.worker_id, instance_id=self.instance_id,
            model=self.model.name, page_size=self.page_size,
            sliding_window=self.model.sliding_window, max_context=self.engine.max_context,
            cost=None, max_batched_tokens=self.engine.max_batched_tokens,
            events_endpoint=self._pub.endpoint, replay_endpoint=self._pub.replay_endpoint,
            swa_page_events=False,  # NOTE: SGLang's events say nothing of SWA validity
        )

    async def serve(self) -> None:
        """Answer clients until ``stop()``; then abort what still runs and return."""
        tasks = [asyncio.create_task(coro) for coro in (
            self._read_clients(), self._read_events(), self._housekeeping())]
        try:
            # NOTE: housekeeping returns once stop() was called; a loop task that fails ends
            # serve too (and the process: a supervisor restarts it) instead of leaving a worker
            # that no longer reads, publishes or stops
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            for task in tasks:
                task.cancel()
            for req in list(self._requests.values()):
                self._abort(req)
                if req.task is not None:
                    req.task.cancel()
            await asyncio.gather(*tasks, *(r.task for r in self._requests.values() if r.task),
                                 return_exceptions=True)

    def stop(self) -> None:
        """Stop serving (safe from a signal handler: ``serve`` notices within ``PERIODIC_S``)."""
        self._stop_requested = True

    def close(self) -> None:
        self._router.close(linger=0)
        self._sub.close(linger=0)
        self._pub.close()
        if self._auth is not None:
            self._auth.stop()  # NOTE: after the sockets: they must never be open without it

    # ------------------------------------------------------------------ clients

    async def _read_clients(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            identity = frames[0]
            self._clients.seen(identity, time.monotonic())
            if len(frames) != 2:
                await self._error(identity, None, "bad_message",
                                  f"expected one frame per message, got {len(frames) - 1}")
                continue
            try:
                msg = decode_client(frames[1])
            except ProtocolError as e:
                await self._error(identity, None, "bad_message", str(e))
                continue
            try:
                await self._dispatch(identity, msg)
            except Exception as e:  # NOTE: a bug in one message must not take the worker down
                logger.exception("failed to handle a %s message", type(msg).__name__)
                await self._error(identity, getattr(msg, "request_id", None), "internal",
                                  f"{type(e).__name__} in the worker")

    async def _dispatch(self, identity: bytes, msg: ClientMsg) -> None:
        match msg:
            case Hello():
                if msg.version != PROTOCOL_VERSION:
                    await self._error(identity, None, "version_mismatch",
                                      f"worker speaks protocol version {PROTOCOL_VERSION}, "
                                      f"client {msg.version}")
                else:
                    await self._send(identity, self.welcome())
            case Generate():
                await self._generate(identity, msg)
            case Abort():
                req = self._requests.get((identity, msg.request_id))
                if req is not None:
                    self._abort(req)
            case Retain():
                self.counters.unsupported_hints += 1
            case GetLoad():
                await self._send(identity, await self._load_report())
            case Flush():
                await self.engine.flush()
                await self._send(identity, await self._load_report())

    async def _generate(self, identity: bytes, msg: Generate) -> None:
        rid = uuid.uuid4().hex
        try:
            self._check_admission(identity, msg)
            kwargs = generate_kwargs(msg, rid=rid,
                                     supports_cache_salt=self.engine.supports_cache_salt,
                                     vocab_size=self.model.vocab_size)
            self._check_context(msg)
        except Refused as e:
            await self._error(identity, msg.request_id, e.code, e.message)
            return
        self.counters.unsupported_hints += len(unsupported_hints(msg))
        mapper = OutputMapper(msg.request_id, prompt_tokens=len(msg.input_ids),
                              logprobs=msg.sampling.logprobs,
                              incremental=self.engine.incremental)
        req = _Request(identity, msg.request_id, rid, mapper, msg.stream_interval_s,
                       time.monotonic())
        self._requests[(identity, msg.request_id)] = req
        self._per_client[identity] = self._per_client.get(identity, 0) + 1
        req.task = asyncio.create_task(self._run(req, kwargs))

    def _check_admission(self, identity: bytes, msg: Generate) -> None:
        """Refuse (``Refused``) what this worker will not queue, before SGLang sees it."""
        if (identity, msg.request_id) in self._requests:
            raise Refused("duplicate_request", f"request {msg.request_id!r} is still running")
        if self._per_client.get(identity, 0) >= self.cfg.max_queued_per_client:
            raise Refused("overloaded", f"this client has {self.cfg.max_queued_per_client} "
                          "requests in the worker (max_queued_per_client)")
        if msg.sampling.structured is not None and not self.engine.has_grammar:
            raise Refused("invalid_grammar", "structured output on the sglang backend needs "
                          "SGLang's grammar backend, which needs its tokenizer: start the worker "
                          "with --sglang-arg skip_tokenizer_init=false")
        if (text := stream_interval_error(msg.stream_interval_s)) is not None:
            raise Refused("invalid_request", text)

    def _check_context(self, msg: Generate) -> None:
        limit, prompt = self.engine.max_context, len(msg.input_ids)
        if limit > 0 and prompt + msg.sampling.max_new_tokens > limit:
            raise Refused("context_too_long", f"prompt ({prompt} tokens) + max_new_tokens "
                          f"({msg.sampling.max_new_tokens}) exceeds the context of {limit}")

    async def _run(self, req: _Request, kwargs: dict[str, Any]) -> None:
        """Stream one request's outputs to its client; exactly one last message."""
        last: Finished | ErrorReply | None = None
        known = False
        try:
            async for out in self.engine.generate(kwargs):
                if not known:
                    known = True
                    if req.aborted:
                        # NOTE: the Abort may have come before SGLang knew the request (its
                        # abort_request ignores unknown ids): now it does, abort again
                        self.engine.abort(req.rid)
                for item in req.mapper.feed(out):
                    if isinstance(item, TokenDelta):
                        await self._delta(req, item)
                    else:
                        last = item
                if last is not None:
                    break
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.warning("request %s failed in SGLang: %s: %s", req.rid, type(e).__name__, e)
            last = req.mapper.error(e)
        finally:
            self._forget(req)
        if last is None:  # NOTE: SGLang's stream ended without a finish reason
            last = (Finished(request_id=req.request_id, finish_reason="abort",
                             prompt_tokens=req.mapper.prompt_tokens,
                             completion_tokens=req.mapper.num_sent)
                    if req.aborted else
                    ErrorReply(request_id=req.request_id, code="internal",
                               message="SGLang ended the stream without a finish reason"))
        if req.held is not None:
            await self._send(req.identity, req.held)
        await self._send(req.identity, last)

    async def _delta(self, req: _Request, delta: TokenDelta) -> None:
        """Send ``delta`` now, or hold it (merged) until ``stream_interval_s`` has passed."""
        delta = delta if req.held is None else merge_deltas([req.held, delta])
        now = time.monotonic()
        if now - req.last_sent_s >= req.interval_s:
            req.held = None
            req.last_sent_s = now
            await self._send(req.identity, delta)
        else:
            req.held = delta

    def _abort(self, req: _Request) -> None:
        if not req.aborted:
            req.aborted = True
            req.mapper.mark_aborted()
            self.engine.abort(req.rid)

    def _forget(self, req: _Request) -> None:
        if self._requests.pop((req.identity, req.request_id), None) is not None:
            left = self._per_client[req.identity] - 1
            if left:
                self._per_client[req.identity] = left
            else:
                del self._per_client[req.identity]

    async def _error(self, identity: bytes, request_id: str | None, code: ErrorCode,
                     message: str) -> None:
        await self._send(identity, ErrorReply(request_id=request_id, code=code, message=message))

    async def _send(self, identity: bytes, msg: WorkerMsg) -> None:
        with contextlib.suppress(zmq.ZMQError):  # NOTE: a client that is gone loses its reply
            await self._router.send_multipart([identity, encode(msg)])

    # ------------------------------------------------------------------ events and load

    async def _read_events(self) -> None:
        """SGLang's KV event batches, re-published in agentgate's format (``kv`` topic)."""
        while True:
            frames = await self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.counters.bad_event_batches += 1
                continue
            seq = int.from_bytes(frames[1], "big")
            lost = self._sglang_seq is not None and seq != self._sglang_seq + 1
            self._sglang_seq = seq
            try:
                batch = decode_batch(frames[2])
            except SGLangWireError as e:
                logger.warning("unreadable SGLang KV event batch %d: %s", seq, e)
                self.counters.bad_event_batches += 1
                batch, lost = None, True
            if lost:
                # NOTE: a lost batch may have held a removal, after which the router would credit
                # pages that are gone: forget all (the router too), and skip the stores that
                # chain to what was forgotten (the translator's "unmapped"): an under-report
                self.counters.event_gaps += 1
                logger.warning("SGLang KV events: batch lost before seq %d; forgetting the "
                               "worker's published pages", seq)
                self._pub.publish(self._translator.reset())
            events = self._translator.translate(batch) if batch is not None else []
            if events:
                self._pub.publish(events)

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(PERIODIC_S)
            if self._stop_requested:
                return
            self._pub.poll_replay()
            now = time.monotonic()
            for identity in self._clients.silent(now):
                for req in [r for r in self._requests.values() if r.identity == identity]:
                    logger.warning("client silent for %.0f s: aborting %s",
                                   self.cfg.client_timeout_s, req.request_id)
                    self._abort(req)
            interval = self.cfg.busy_load_interval_s if self._requests else (
                self.cfg.load_interval_s)
            if now - self._last_load_s >= interval:
                self._last_load_s = now
                with contextlib.suppress(Exception):  # NOTE: a report is best effort
                    self._pub.publish_load(await self._load_report())

    async def _load_report(self) -> LoadReport:
        """SGLang's load, in agentgate's terms. NOTE: SGLang counts KV in tokens, not bytes, so
        ``used_bytes``/``total_bytes`` are token counts here (their ratio is what is read), and
        one figure stands for both page kinds (SGLang's SWA pool is not reported apart)."""
        load = await self.engine.load()
        used = int(load.get("num_used_tokens", 0))
        total = int(load.get("max_total_num_tokens", 0))
        free_pages = max(0, total - used) // self.page_size
        return LoadReport(
            worker_id=self.cfg.worker_id, instance_id=self.instance_id,
            num_running=int(load.get("num_running_reqs", len(self._requests))),
            num_waiting=int(load.get("num_waiting_reqs", 0)),
            free_full_pages=free_pages, free_swa_pages=free_pages, used_bytes=used,
            total_bytes=total, cached_pages=0,
            unsupported_hints=self.counters.unsupported_hints,
        )

def run_until_stopped(worker: SGLangWorker, loop: asyncio.AbstractEventLoop,
                      on_started: Callable[[], None] | None = None) -> None:
    """Serve on ``loop`` (SGLang's own, where its TokenizerManager runs) until ``stop()``."""
    async def main() -> None:
        if on_started is not None:
            on_started()
        await worker.serve()

    loop.run_until_complete(main())
