"""The worker's requests, scoped by client: ``Generate`` admission (with grammar compiles and
media embedding fetches), ``Abort``, ``Retain``, the reply streams of running requests, and how
each request ends."""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

from engine.engine import Engine
from engine.grammar import GrammarMatcher
from engine.protocol import Abort, ErrorCode, ErrorReply, Finished, Generate, Retain
from engine.sampling_params import SamplingParams
from engine.sequence import Media, Sequence, Status
from engine.worker.admission import add_to_engine, check_generate
from engine.worker.config import WorkerConfig
from engine.worker.grammar_jobs import Failed, GrammarJobs
from engine.worker.media_jobs import FetchFailed, MediaJobs
from engine.worker.publisher import RequestStream
from engine.worker.replies import ReplySender

logger = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class _Pending:
    """A Generate not in the engine yet: its grammar compiles and/or its media embeddings are
    fetched (both at once); it is admitted when neither is left."""

    identity: bytes
    msg: Generate
    params: SamplingParams
    grammar: GrammarMatcher | None = None
    media: tuple[Media, ...] | None = None  # None: still fetching
    compiling: bool = False

    @property
    def is_ready(self) -> bool:
        return not self.compiling and self.media is not None


class RequestManager:
    """Every request of the worker's clients, from its ``Generate`` to its one last message.

    A request is either pending (waiting for its grammar or its media embeddings, not in the
    engine yet) or running (in the engine, with a ``RequestStream``); its client's id maps to
    the engine's id, which is unique across clients. Replies go through ``replies``.

    A client may have at most ``cfg.max_queued_per_client`` requests waiting (pending, or in
    the engine and not running); its next ``Generate`` is refused ``overloaded``.

    ``media`` fetches embeddings for the native backend; None on the sim (which takes media
    spans without embeddings) and on a worker with no embedding source (which refuses them).
    """

    def __init__(self, cfg: WorkerConfig, engine: Engine, grammars: GrammarJobs,
                 replies: ReplySender, media: MediaJobs | None = None) -> None:
        self.cfg = cfg
        self.engine = engine
        self._grammars = grammars
        self._media = media
        self._replies = replies
        self._requests: dict[str, RequestStream] = {}  # by engine request id
        self._pending: dict[str, _Pending] = {}  # by engine request id
        # NOTE: (identity, request_id) -> engine id, for requests in either dict above
        self._by_client: dict[tuple[bytes, str], str] = {}
        # NOTE: the same for finished requests, as many as the engine remembers ends (Retain)
        self._finished: OrderedDict[tuple[bytes, str], str] = OrderedDict()
        # NOTE: identity -> engine ids that may still wait: a superset of its waiting requests
        # (the engine starts them unseen), pruned only when the client reaches its cap
        self._queued: dict[bytes, set[str]] = {}
        self._ids = itertools.count()

    @property
    def num_running(self) -> int:
        return len(self._requests)

    @property
    def num_pending(self) -> int:
        """Requests waiting for their grammars (their compiles may be shared) or embeddings."""
        return len(self._pending)

    def generate(self, identity: bytes, msg: Generate) -> None:
        rid = msg.request_id
        if (identity, rid) in self._by_client:
            self._replies.error(identity, rid, "duplicate_request",
                                f"request {rid!r} is still running")
            return
        if not self._can_queue(identity):
            text = (f"this client has {self.cfg.max_queued_per_client} requests waiting on this "
                    "worker (--max-queued-per-client)")
            self._replies.error(identity, rid, "overloaded", text)
            return
        params = check_generate(msg, self.engine, self.cfg.max_grammar_bytes)
        if isinstance(params, ErrorReply):
            self._replies.send(identity, params)
            return
        engine_id = f"{next(self._ids)}:{rid}"
        spec = params.structured
        pending = _Pending(identity, msg, params, self._grammar_now(params), self._media_now(msg))
        pending.compiling = spec is not None and pending.grammar is None
        if pending.is_ready:
            self._admit(pending, engine_id)
            return
        refusal = self._refusal(pending)
        if refusal is not None:
            self._replies.error(identity, rid, *refusal)
            return
        if pending.compiling:
            assert spec is not None
            self._grammars.submit(engine_id, spec)
        if pending.media is None:
            assert self._media is not None
            self._media.submit(engine_id, msg.media)
        self._pending[engine_id] = pending
        self._by_client[(identity, rid)] = engine_id
        self._queued.setdefault(identity, set()).add(engine_id)

    def admit_ready(self) -> None:
        """Admit the requests whose grammars compiled and whose embeddings arrived since the
        last call (or fail them)."""
        for result in self._grammars.poll():
            pending = self._pending.get(result.request_id)
            if pending is None:
                continue  # NOTE: aborted or dropped meanwhile
            if isinstance(result, Failed):
                self._fail_pending(result.request_id, result.code, result.message)
                continue
            pending.grammar, pending.compiling = result.grammar, False
            self._admit_if_ready(result.request_id)
        for fetched in self._media.poll() if self._media is not None else ():
            pending = self._pending.get(fetched.request_id)
            if pending is None:
                continue
            if isinstance(fetched, FetchFailed):
                self._fail_pending(fetched.request_id, fetched.code, fetched.message)
                continue
            pending.media = fetched.media
            self._admit_if_ready(fetched.request_id)

    def abort(self, identity: bytes, msg: Abort) -> None:
        engine_id = self._by_client.get((identity, msg.request_id))
        if engine_id is None:
            return  # NOTE: finished already, never sent, or another client's: nothing to do
        if engine_id in self._pending:
            self._abort_pending(engine_id)
            return
        self.engine.abort(engine_id)
        self.finish(self._requests[engine_id])

    def retain(self, identity: bytes, msg: Retain) -> None:
        """Keep (or release) the end checkpoint of one of this client's finished requests."""
        engine_id = self._finished.get((identity, msg.request_id))
        if engine_id is None:
            return  # NOTE: never finished here, forgotten, or another client's: ignored
        if not 0.0 <= msg.ttl_s < math.inf:  # NOTE: False for NaN
            logger.warning("ignored a Retain of %r with ttl_s=%r", msg.request_id, msg.ttl_s)
            return
        self.engine.retain(engine_id, msg.ttl_s)

    def drop_clients(self, gone: set[bytes]) -> None:
        """Abort every request of the clients in ``gone`` (silent for ``client_timeout_s``)."""
        dropped = [e for (identity, _), e in self._by_client.items() if identity in gone]
        for engine_id in dropped:
            if engine_id in self._pending:
                self._abort_pending(engine_id)
            else:
                self.engine.abort(engine_id)
                self.finish(self._requests[engine_id])
        if dropped:
            logger.warning("aborted %d request(s) of %d client(s) silent for %g s",
                           len(dropped), len(gone), self.cfg.client_timeout_s)

    def emit(self, seqs: list[Sequence]) -> None:
        """Send a step's deltas and ends: one message per client (``Replies`` when several)."""
        now_s = time.monotonic()
        with self._replies.batch():
            for seq in seqs:
                req = self._requests.get(seq.request_id)
                if req is None:
                    continue  # aborted while its step was held
                if seq.is_finished:
                    self.finish(req)
                elif req.is_due(now_s):
                    self._replies.send_delta(req)

    def finish(self, req: RequestStream) -> None:
        """Send what is left of the stream, then its one last message."""
        self._replies.send_delta(req)  # NOTE: tokens of a held sim step when the request is aborted
        engine_id = self._by_client.get((req.identity, req.request_id))
        self._forget(req.identity, req.request_id)
        if engine_id is not None:
            self._remember_finished((req.identity, req.request_id), engine_id)
        self._replies.send(req.identity, req.last_message())

    def fail_all(self) -> None:
        """After an engine failure: abort every request (best effort) and tell its client."""
        for req in list(self._requests.values()):
            self.drop(req.identity, req.request_id)
            self._replies.error(req.identity, req.request_id, "internal",
                                "the engine failed while running this request")

    def drop(self, identity: bytes, request_id: str) -> None:
        """Forget a request after a failure, aborting it in the engine if it is still there."""
        engine_id = self._by_client.get((identity, request_id))
        if engine_id is None:
            return
        self._forget(identity, request_id)
        try:
            self.engine.abort(engine_id)
        except Exception:
            logger.exception("abort of request %r after a failure failed", request_id)

    # ------------------------------------------------------------------ helpers

    def _can_queue(self, identity: bytes) -> bool:
        """Whether ``identity`` is below its cap of waiting requests (pruning its set first
        when the set alone says no: the cheap check is right on almost every call)."""
        queued = self._queued.get(identity)
        cap = self.cfg.max_queued_per_client
        if queued is None or len(queued) < cap:
            return True
        queued.difference_update([e for e in queued if not self._is_waiting(e)])
        return len(queued) < cap

    def _is_waiting(self, engine_id: str) -> bool:
        req = self._requests.get(engine_id)
        return engine_id in self._pending or (
            req is not None and req.seq.status is Status.WAITING)

    def _unqueue(self, identity: bytes, engine_id: str) -> None:
        queued = self._queued.get(identity)
        if queued is not None:
            queued.discard(engine_id)
            if not queued:
                del self._queued[identity]  # NOTE: bounded by the clients with requests

    def _grammar_now(self, params: SamplingParams) -> GrammarMatcher | None:
        spec = params.structured
        return None if spec is None else self.engine.grammars.cached(spec)

    def _media_now(self, msg: Generate) -> tuple[Media, ...] | None:
        """The request's media if no fetch is needed (none, or the sim's spans); else None."""
        if not msg.media:
            return ()
        if not self.engine.needs_media_embeds:
            return tuple(Media(span.offset, span.length) for span in msg.media)
        return None

    def _refusal(self, pending: _Pending) -> tuple[ErrorCode, str] | None:
        """Why a request that must wait cannot (no embedding source, queues full), if so."""
        if pending.media is None and self._media is None:
            return "invalid_request", ("media: this worker has no embedding source (start it "
                                       "with --encoder or --embed-redis) to fetch image "
                                       "embeddings from")
        waiting = self._pending.values()
        if pending.compiling and sum(p.compiling for p in waiting) >= (
                self.cfg.max_compiling_requests):
            return "overloaded", (f"{self.cfg.max_compiling_requests} requests are waiting for "
                                  "their grammars to compile")
        if pending.media is None and sum(p.media is None for p in waiting) >= (
                self.cfg.max_fetching_requests):
            return "overloaded", (f"{self.cfg.max_fetching_requests} requests are waiting for "
                                  "their media embeddings")
        return None

    def _admit_if_ready(self, engine_id: str) -> None:
        pending = self._pending[engine_id]
        if not pending.is_ready:
            return
        del self._pending[engine_id]
        self._by_client.pop((pending.identity, pending.msg.request_id), None)
        self._unqueue(pending.identity, engine_id)  # NOTE: _admit queues it again
        self._admit(pending, engine_id)

    def _fail_pending(self, engine_id: str, code: ErrorCode, message: str) -> None:
        """End a pending request with an error (its other job, if any, is cancelled)."""
        pending = self._pending[engine_id]
        self._forget(pending.identity, pending.msg.request_id)
        self._replies.error(pending.identity, pending.msg.request_id, code, message)

    def _admit(self, pending: _Pending, engine_id: str) -> None:
        """Build the request (its grammar compiled, its media fetched) and hand it to the
        engine."""
        identity, msg = pending.identity, pending.msg
        seq = add_to_engine(self.engine, msg, pending.params, engine_id, pending.grammar,
                            pending.media or ())
        if isinstance(seq, ErrorReply):
            self._replies.send(identity, seq)
            return
        self._requests[engine_id] = RequestStream(
            identity, msg.request_id, seq, stream_interval_s=msg.stream_interval_s,
            last_sent_s=time.monotonic(),
        )
        self._by_client[(identity, msg.request_id)] = engine_id
        self._queued.setdefault(identity, set()).add(engine_id)

    def _abort_pending(self, engine_id: str) -> None:
        """End a request still waiting for its grammar or embeddings (a shared compile goes
        on)."""
        pending = self._pending[engine_id]
        self._forget(pending.identity, pending.msg.request_id)
        self._replies.send(pending.identity, Finished(
            request_id=pending.msg.request_id, finish_reason="abort",
            prompt_tokens=len(pending.msg.input_ids), completion_tokens=0,
        ))

    def _remember_finished(self, key: tuple[bytes, str], engine_id: str) -> None:
        self._finished[key] = engine_id
        self._finished.move_to_end(key)
        while len(self._finished) > self.engine.kv.max_finished_ends:
            self._finished.popitem(last=False)

    def _forget(self, identity: bytes, request_id: str) -> None:
        engine_id = self._by_client.pop((identity, request_id), None)
        if engine_id is not None:
            self._unqueue(identity, engine_id)
            self._requests.pop(engine_id, None)
            pending = self._pending.pop(engine_id, None)
            if pending is not None and pending.compiling:
                self._grammars.cancel(engine_id)
            if pending is not None and pending.media is None and self._media is not None:
                self._media.cancel(engine_id)
