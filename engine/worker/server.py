"""The engine worker process: one ``Engine`` behind a ZeroMQ ROUTER, KV events on a PUB socket.

    python -m engine.worker --listen tcp://127.0.0.1:5555 --events tcp://127.0.0.1:5556 \\
        [--model DIR] [--backend native|sim] [--replay tcp://...] [...]   (see --help)

The command line (flags, signals, the start line) is ``engine.worker.cli``; each request's life
(admission, grammar waits, streams, ends) is ``engine.worker.requests``, and the sending of replies
(one message per client a step) ``engine.worker.replies``.

Clients are DEALER sockets sending single-frame ``engine.protocol`` messages; every reply goes to
the identity that sent the message. Message flow:

- ``Hello`` -> ``Welcome``; a different ``version`` -> ``ErrorReply(None, "version_mismatch")``.
  A Hello is expected first but not required.
- ``Generate`` -> ``TokenDelta``s (``cached_tokens`` on the first), then exactly one of:
  ``Finished`` (finish_reason "stop", "length" or "abort"), or ``ErrorReply(request_id, code)``:
  ``invalid_request`` (bad sampling values, empty prompt, token id outside the vocabulary),
  ``context_too_long`` (prompt + max_new_tokens > Welcome.max_context), ``invalid_grammar``
  (``sampling.structured`` does not compile, is larger than ``max_grammar_bytes``, takes longer
  than ``grammar_timeout_s`` to compile, or the worker has no tokenizer.json),
  ``overloaded`` (the waiting queue, or the queue of grammars to compile, is full, or this client
  already has ``max_queued_per_client`` requests waiting), ``internal`` (the engine raised; the
  request is gone). The exception:
  ``ErrorReply(request_id, "duplicate_request")`` refuses a Generate whose id this client
  already has running, and that running request goes on (its own end still comes).
  NOTE (failed requests): a request the scheduler cannot fit in KV memory even with nothing else
  running (engine finish_reason "error") ends with ``ErrorReply(request_id, "context_too_long")``,
  never with ``Finished("error")``: retrying it here cannot succeed. It is usually rejected before
  any token; after a preemption it may come after some ``TokenDelta``s.
- ``Abort`` -> ``Finished(finish_reason="abort")`` to the request's owner; unknown ids (finished,
  never sent, another client's) are ignored.
- ``Retain`` (no reply) keeps the SWA checkpoint at the end of one of this client's finished
  requests ``ttl_s`` more seconds (0 releases it; ``Engine.retain``). Ids the worker does not know
  (never finished here, forgotten, another client's), and TTLs that are negative or not finite,
  are ignored.
- ``GetLoad`` -> ``LoadReport``; ``Flush`` drops the prefix cache, then -> ``LoadReport``.
- Anything that does not decode -> ``ErrorReply(None, "bad_message")``; the worker keeps serving.

Grammars compile on their own threads (``engine.worker.grammar_jobs``): a request waits unscheduled
until its grammar is ready, while the loop goes on stepping and answering. Likewise the embeddings
of a request's images (``Generate.media``) are fetched on threads of their own
(``engine.worker.media_jobs``: the process cache, ``--embed-redis``, then the ``--encoder``
services); a key found nowhere, an embedding of the wrong shape or a fetch past
``--embed-timeout-s`` ends that request with ``invalid_request``. The sim backend validates media
spans and ignores them (it fetches nothing).

Request ids are scoped by client: two clients may both run a request "r1". A client that has sent
nothing (a heartbeat ``GetLoad`` included) for ``client_timeout_s`` counts as gone: its requests
are aborted (a ``Finished("abort")`` is still sent, in case it only stopped talking).

With ``--curve-keys DIR`` the ROUTER, PUB and replay sockets are CURVE servers that accept only
the clients authorized in DIR (``engine.worker.curve``); an unauthorized client's handshake fails
and it gets nothing. Without keys every endpoint must be loopback (or ``--insecure-no-curve``).

The PUB socket (``--events``) carries KV events under topic ``b"kv"`` once per engine step and a
``LoadReport`` under ``b"load"`` about every second (every 100 ms at most while stepping); see
``engine.worker.publisher``. With ``--backend sim`` each step's results are released after the cost
model's step time (``--cost``), so a sim worker paces like a real one (``--cost zero``: flat out).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import zmq

from engine.config import EngineConfig
from engine.cost import COST_PRESETS
from engine.engine import Engine
from engine.model_config import ModelConfig
from engine.protocol import (
    PROTOCOL_VERSION,
    Abort,
    ClientMsg,
    Flush,
    Generate,
    GetLoad,
    Hello,
    LoadReport,
    ProtocolError,
    Retain,
    Welcome,
    decode_client,
)
from engine.sequence import Sequence
from engine.worker.clients import ClientWatch
from engine.worker.config import COSTS, WorkerConfig
from engine.worker.curve import (
    ClientAuthenticator,
    CurveServerKeys,
    any_port,
    start_authenticator,
)
from engine.worker.grammar_jobs import GrammarJobs
from engine.worker.media_jobs import EmbeddingSource, MediaJobs
from engine.worker.publisher import KVEventBuffer, WorkerPublisher, load_report
from engine.worker.replies import ReplySender
from engine.worker.requests import RequestManager

__all__ = ["COSTS", "Worker", "WorkerConfig"]  # NOTE: the config lives in engine.worker.config

logger = logging.getLogger(__name__)

PENDING_POLL_MS = 5


@dataclass(frozen=True, slots=True)
class _HeldStep:
    """A sim step's results, released when its simulated duration has passed."""

    seqs: list[Sequence]
    ready_at: float


class Worker:
    """Serves one engine; ``serve()`` runs until ``stop()`` (safe from a signal handler)."""

    def __init__(self, cfg: WorkerConfig, engine_cfg: EngineConfig,
                 model_config: ModelConfig | None = None,
                 context: zmq.Context[Any] | None = None) -> None:
        self.cfg = cfg
        self.instance_id = uuid.uuid4().hex  # NOTE: new per process start (see Welcome)
        self._ctx = context or zmq.Context.instance()
        self._init_engine(engine_cfg, model_config)
        self._init_sockets()
        self._welcome = self._make_welcome()
        self._replies = ReplySender(self._router)
        self._requests = RequestManager(cfg, self.engine, self._grammars, self._replies,
                                        self._media)
        self._clients = ClientWatch(cfg.client_timeout_s)
        self._held: _HeldStep | None = None
        self._stopping = False
        self._last_load = 0.0
        self._stepped = False

    @property
    def endpoints(self) -> tuple[str, str]:
        """The bound (listen, events) addresses (port 0 resolved)."""
        return self.listen_endpoint, self._pub.endpoint

    def serve(self) -> None:
        while not self._stopping:
            if self._router.poll(self._poll_timeout_ms()):
                self._drain_messages()
            self._requests.admit_ready()
            self._advance()
            self.engine.tick()
            self._drop_silent_clients()
            self._publish()
            self._pub.poll_replay()

    def stop(self) -> None:
        self._stopping = True

    def close(self) -> None:
        self._grammars.close()
        if self._media is not None:
            self._media.close()
        self.engine.close()
        self._router.close(linger=0)
        self._pub.close()
        if self._auth is not None:
            self._auth.stop()  # NOTE: after the sockets: they must never be open without it

    @property
    def num_compiling_grammars(self) -> int:
        """Grammar compiles queued or running (late ones, whose requests failed, included)."""
        return self._grammars.num_jobs

    # ------------------------------------------------------------------ setup

    def _init_engine(self, engine_cfg: EngineConfig, model_config: ModelConfig | None) -> None:
        model_config = model_config or _model_config(engine_cfg)
        cost = COST_PRESETS[self.cfg.cost] if engine_cfg.backend == "sim" else None
        self._kv_events = KVEventBuffer(engine_cfg.page_size, model_config.sliding_window)
        self.engine = Engine(engine_cfg, model_config, on_cache_event=self._kv_events.add,
                             cost=cost, grammar_cache_bytes=self.cfg.grammar_cache_bytes)
        self._grammars = GrammarJobs(self.engine.grammars, self.cfg.grammar_threads,
                                     self.cfg.grammar_timeout_s)
        self._media = _make_media_jobs(self.cfg, self.engine)
        runner: Any = self.engine.runner
        # NOTE: simulated seconds so far; a step's delay is how far it moved this clock
        self._sim_clock_s = (lambda: runner.clock_s) if cost is not None else (lambda: 0.0)

    def _init_sockets(self) -> None:
        self._auth: ClientAuthenticator | None = None
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        try:
            curve = self._start_auth()
            if curve is not None:
                curve.apply(self._router)
            self._router.bind(any_port(self.cfg.listen))
            self.listen_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._pub = WorkerPublisher(self.cfg.events, replay_endpoint=self.cfg.replay,
                                        context=self._ctx, curve=curve)
        except Exception:
            self._router.close(linger=0)
            self._grammars.close()
            if self._media is not None:
                self._media.close()
            if self._auth is not None:
                self._auth.stop()
            raise

    def _start_auth(self) -> CurveServerKeys | None:
        """With ``curve_keys``: the server keys, once the ZAP handler that checks the clients
        runs (``engine.worker.curve.start_authenticator``)."""
        self._auth, curve = start_authenticator(self._ctx, self.cfg.curve_keys,
                                                self.cfg.endpoints)
        return curve

    def _make_welcome(self) -> Welcome:
        e = self.engine
        path = e.cfg.model_path
        return Welcome(
            version=PROTOCOL_VERSION, worker_id=self.cfg.worker_id, instance_id=self.instance_id,
            model=Path(path).name if path else "demo", page_size=e.cfg.page_size,
            sliding_window=e.model_config.sliding_window if e.kv.has_swa else None,
            max_context=e.model_config.max_position_embeddings,
            # NOTE: the sim paces with its preset; a native worker announces the same preset as
            # its estimate (``--cost``), which only the router's predictions use
            cost=COST_PRESETS[self.cfg.cost], max_batched_tokens=e.cfg.max_num_batched_tokens,
            events_endpoint=self._pub.endpoint, replay_endpoint=self._pub.replay_endpoint,
            swa_page_events=True,  # NOTE: engine.worker.publisher.KVEventBuffer sends them
        )

    # ------------------------------------------------------------------ messages

    def _poll_timeout_ms(self) -> int:
        idle_ms = int(self.cfg.idle_poll_s * 1000)
        if self._held is not None:  # NOTE: capped, so that stop() is seen within idle_poll_s
            # NOTE: rounded up: a truncated wait polls with timeout 0 through the held step's
            # last millisecond, a busy loop (~1 ms of CPU a step)
            wait_ms = math.ceil((self._held.ready_at - time.monotonic()) * 1000)
            return min(idle_ms, max(0, wait_ms))
        if not self.engine.has_work:
            # NOTE: a pending request (grammar, embeddings) is admitted within PENDING_POLL_MS
            # of its job's end, not a whole idle poll later
            return min(idle_ms, PENDING_POLL_MS) if self._requests.num_pending else idle_ms
        return 1 if self.engine.only_fetching else 0  # NOTE: no spin while L3 loads

    def _drain_messages(self) -> None:
        for _ in range(self.cfg.max_messages_per_poll):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(frames)

    def _handle(self, frames: list[bytes]) -> None:
        identity = frames[0]
        self._clients.seen(identity, time.monotonic())
        if len(frames) != 2:
            text = f"expected one frame per message, got {len(frames) - 1}"
            self._replies.error(identity, None, "bad_message", text)
            return
        try:
            msg = decode_client(frames[1])
        except ProtocolError as e:
            self._replies.error(identity, None, "bad_message", str(e))
            return
        try:
            self._dispatch(identity, msg)
        except Exception as e:  # NOTE: a bug in one message must not take the worker down
            logger.exception("failed to handle a %s message", type(msg).__name__)
            request_id = getattr(msg, "request_id", None)
            if request_id is not None:
                self._requests.drop(identity, request_id)
            self._replies.error(identity, request_id, "internal",
                                f"{type(e).__name__} in the worker")

    def _dispatch(self, identity: bytes, msg: ClientMsg) -> None:
        match msg:
            case Hello():
                self._on_hello(identity, msg)
            case Generate():
                self._requests.generate(identity, msg)
            case Abort():
                self._requests.abort(identity, msg)
            case Retain():
                self._requests.retain(identity, msg)
            case GetLoad():
                self._replies.send(identity, self._load_report())
            case Flush():
                self.engine.flush_cache()
                self._replies.send(identity, self._load_report())

    def _on_hello(self, identity: bytes, msg: Hello) -> None:
        if msg.version != PROTOCOL_VERSION:
            text = f"worker speaks protocol version {PROTOCOL_VERSION}, client {msg.version}"
            self._replies.error(identity, None, "version_mismatch", text)
            return
        self._replies.send(identity, self._welcome)

    def _drop_silent_clients(self) -> None:
        """Abort every request of a client that has been silent for ``client_timeout_s``."""
        gone = set(self._clients.silent(time.monotonic()))
        if gone:
            self._requests.drop_clients(gone)

    # ------------------------------------------------------------------ engine steps

    def _advance(self) -> None:
        """Release a held sim step when its time has come, then run the next step."""
        if self._held is not None:
            if time.monotonic() < self._held.ready_at:
                return
            held, self._held = self._held, None
            self._requests.emit(held.seqs)
        if not self.engine.has_work:
            return
        start, sim_start = time.monotonic(), self._sim_clock_s()
        try:
            seqs = self.engine.step()
        except Exception:
            logger.exception("engine step failed; failing %d requests",
                             self._requests.num_running)
            self._held = None
            self._requests.fail_all()
            return
        self._stepped = True
        delay_s = self._sim_clock_s() - sim_start
        if delay_s > 0:
            self._held = _HeldStep(seqs, start + delay_s)
        else:
            self._requests.emit(seqs)

    # ------------------------------------------------------------------ load and events

    def _load_report(self) -> LoadReport:
        stats = self.engine.stats()
        # NOTE: a request whose grammar compiles (or whose embeddings are on their way) is
        # waiting, as far as routing is concerned
        stats = replace(stats, num_waiting=stats.num_waiting + self._requests.num_pending)
        return load_report(self.cfg.worker_id, stats, self.instance_id)

    def _publish(self) -> None:
        events = self._kv_events.drain()
        if events:
            self._pub.publish(events)
        now = time.monotonic()
        interval = self.cfg.busy_load_interval_s if self._stepped else self.cfg.load_interval_s
        if now - self._last_load >= interval:
            self._pub.publish_load(self._load_report())
            self._last_load, self._stepped = now, False


# ---------------------------------------------------------------------- helpers


def _model_config(cfg: EngineConfig) -> ModelConfig:
    if cfg.model_path is not None:
        return ModelConfig.from_dir(cfg.model_path)
    from engine.models.checkpoint import DEMO_CONFIG

    return ModelConfig.from_dict(DEMO_CONFIG)


def _make_media_jobs(cfg: WorkerConfig, engine: Engine) -> MediaJobs | None:
    """The media embedding fetcher of a native worker with an embedding source; None for the
    sim (it needs no embeddings) or without a source (media requests are refused)."""
    if not engine.needs_media_embeds or not cfg.has_embedding_source:
        return None
    from encoders.embed_cache import EmbeddingCache
    from encoders.service import EncoderClient

    cache = EmbeddingCache(cfg.embed_cache_bytes, redis_url=cfg.embed_redis)
    encoder = (EncoderClient(cfg.encoders, timeout_s=cfg.embed_timeout_s)
               if cfg.encoders else None)
    param = next(engine.model.parameters())
    return MediaJobs(EmbeddingSource(cache, encoder), engine.model_config.hidden_size,
                     param.dtype, param.device, num_threads=cfg.media_threads,
                     timeout_s=cfg.embed_timeout_s)



