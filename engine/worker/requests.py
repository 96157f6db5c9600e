"""The worker's requests, scoped by client: ``Generate`` admission (with grammar compiles),
``Abort``, ``Retain``, the reply streams of running requests, and how each request ends."""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

from engine.engine import Engine
from engine.grammar import GrammarMatcher
from engine.protocol import Abort, ErrorReply, Finished, Generate, Retain
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, Status
from engine.worker.admission import add_to_engine, check_generate
from engine.worker.config import WorkerConfig
from engine.worker.grammar_jobs import Failed, GrammarJobs
from engine.worker.publisher import RequestStream
from engine.worker.replies import ReplySender

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Compiling:
    """A Generate whose grammar is compiling (not in the engine yet)."""

    identity: bytes
    msg: Generate
    params: SamplingParams


class RequestManager:
    """Every request of the worker's clients, from its ``Generate`` to its one last message.

    A request is either compiling (waiting for its grammar, not in the engine yet) or running (in
    the engine, with a ``RequestStream``); its client's id maps to the engine's id, which is
    unique across clients. Replies go through ``replies``.

    A client may have at most ``cfg.max_queued_per_client`` requests waiting (compiling, or in
    the engine and not running); its next ``Generate`` is refused ``overloaded``.
    """

    def __init__(self, cfg: WorkerConfig, engine: Engine, grammars: GrammarJobs,
                 replies: ReplySender) -> None:
        self.cfg = cfg
        self.engine = engine
        self._grammars = grammars
        self._replies = replies
        self._requests: dict[str, RequestStream] = {}  # by engine request id
        self._compiling: dict[str, _Compiling] = {}  # by engine request id
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
    def num_compiling(self) -> int:
        """Requests waiting for their grammars (their compiles may be shared)."""
        return len(self._compiling)

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
        grammar = None if spec is None else self.engine.grammars.cached(spec)
        if spec is not None and grammar is None:
            self._compile(identity, msg, params, engine_id)
            return
        self._admit(identity, msg, params, engine_id, grammar)

    def admit_compiled(self) -> None:
        """Admit the requests whose grammars compiled since the last call (or fail them)."""
        for result in self._grammars.poll():
            pending = self._compiling.pop(result.request_id, None)
            if pending is None:
                continue  # NOTE: aborted or dropped meanwhile
            self._by_client.pop((pending.identity, pending.msg.request_id), None)
            self._unqueue(pending.identity, result.request_id)  # NOTE: _admit queues it again
            if isinstance(result, Failed):
                self._replies.error(pending.identity, pending.msg.request_id, result.code,
                                    result.message)
            else:
                self._admit(pending.identity, pending.msg, pending.params, result.request_id,
                            result.grammar)

    def abort(self, identity: bytes, msg: Abort) -> None:
        engine_id = self._by_client.get((identity, msg.request_id))
        if engine_id is None:
            return  # NOTE: finished already, never sent, or another client's: nothing to do
        if engine_id in self._compiling:
            self._abort_compiling(engine_id)
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
            if engine_id in self._compiling:
                self._abort_compiling(engine_id)
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
        return engine_id in self._compiling or (
            req is not None and req.seq.status is Status.WAITING)

    def _unqueue(self, identity: bytes, engine_id: str) -> None:
        queued = self._queued.get(identity)
        if queued is not None:
            queued.discard(engine_id)
            if not queued:
                del self._queued[identity]  # NOTE: bounded by the clients with requests

    def _compile(self, identity: bytes, msg: Generate, params: SamplingParams,
                 engine_id: str) -> None:
        """Queue the request's grammar; ``admit_compiled`` admits it once compiled."""
        if len(self._compiling) >= self.cfg.max_compiling_requests:
            text = f"{len(self._compiling)} requests are waiting for their grammars to compile"
            self._replies.error(identity, msg.request_id, "overloaded", text)
            return
        assert params.structured is not None
        self._grammars.submit(engine_id, params.structured)
        self._compiling[engine_id] = _Compiling(identity, msg, params)
        self._by_client[(identity, msg.request_id)] = engine_id
        self._queued.setdefault(identity, set()).add(engine_id)

    def _admit(self, identity: bytes, msg: Generate, params: SamplingParams, engine_id: str,
               grammar: GrammarMatcher | None) -> None:
        """Build the request (its grammar, if any, already compiled) and hand it to the engine."""
        rid = msg.request_id
        seq = add_to_engine(self.engine, msg, params, engine_id, grammar)
        if isinstance(seq, ErrorReply):
            self._replies.send(identity, seq)
            return
        self._requests[engine_id] = RequestStream(
            identity, rid, seq, stream_interval_s=msg.stream_interval_s,
            last_sent_s=time.monotonic(),
        )
        self._by_client[(identity, rid)] = engine_id
        self._queued.setdefault(identity, set()).add(engine_id)

    def _abort_compiling(self, engine_id: str) -> None:
        """End a request still waiting for its grammar (its compile goes on if shared)."""
        pending = self._compiling[engine_id]
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
            if self._compiling.pop(engine_id, None) is not None:
                self._grammars.cancel(engine_id)
