"""Gateway <-> worker messages: two tagged unions of msgspec Structs, msgpack on the wire.

The gateway sends ``ClientMsg``; the worker answers with ``WorkerMsg``. A connection opens with
``Hello`` -> ``Welcome`` (the worker refuses a different ``PROTOCOL_VERSION`` with
``ErrorReply(code="version_mismatch")``). A ``Generate`` streams ``TokenDelta``s and ends with one
``Finished`` or one ``ErrorReply`` carrying its ``request_id``. Requests carry token ids (the
gateway tokenizes); replies carry token ids (the gateway detokenizes).

Each direction has one decoder. Anything that does not decode (garbage bytes, an unknown tag, a
missing or mistyped field) raises ``ProtocolError``, which the worker answers with
``ErrorReply(code="bad_message")`` and keeps serving. This module must not import torch: the
gateway imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import msgspec

from encoders.protocol import EmbeddingKey
from engine.cost import CostModel
from engine.sampling_params import StructuredSpec

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams

# NOTE: 2 added SamplingSpec.structured: a version-1 worker would silently ignore the grammar
# (msgspec skips unknown fields), so the handshake must refuse the pair. 3 added
# SamplingSpec.repetition_penalty / logit_bias (same reason) and the worker's instance_id. 4 added
# Retain (a version-3 worker would answer it "bad_message") and Welcome's cost model, step token
# budget and event endpoints, which the router needs. 5 added Replies (a version-4 gateway would
# drop them as undecodable). Generate.media needed no new version: an older worker refuses the
# placeholder ids (outside its vocabulary) as "invalid_request", it never serves them as text.
PROTOCOL_VERSION = 5

# NOTE: the token ids of media placeholders (issue 13): the gateway derives them from the media's
# content hash, so the same image gives the same ids (and prefix-cache page hashes) and another
# image other ids; every vocabulary lies below MEDIA_ID_BASE
MEDIA_ID_BASE = 1 << 30
MEDIA_ID_LIMIT = 1 << 31

FinishReason = Literal["stop", "length", "abort", "error"]
ErrorCode = Literal[
    "bad_message",  # the bytes did not decode as a message of this protocol
    "version_mismatch",  # Hello.version != PROTOCOL_VERSION
    "invalid_request",  # decoded, but a value is out of range (sampling, empty prompt, ...)
    "context_too_long",  # prompt + max_new_tokens exceeds Welcome.max_context
    "invalid_grammar",  # sampling.structured does not compile (or the worker has no tokenizer)
    "overloaded",  # the worker cannot queue more requests now; retry elsewhere or later
    "duplicate_request",  # a request with this request_id is still running
    "internal",  # a bug or an engine failure; the request is gone
]


class ProtocolError(ValueError):
    """Bytes that are not a valid message of this protocol (the worker replies "bad_message")."""


class SamplingSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Wire form of ``engine.sampling_params.SamplingParams`` (same fields, same defaults).

    Only types are checked when decoding; ranges are checked by ``to_params()``; a grammar in
    ``structured`` is compiled by the engine (``engine.grammar``), after ``to_params()``.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    structured: StructuredSpec | None = None
    repetition_penalty: float = 1.0
    logit_bias: list[tuple[int, float]] = []
    resumed_tokens: int = 0

    def to_params(self) -> SamplingParams:
        """The validated engine-side parameters.

        Raises:
            ValueError: naming the field and its allowed range (from ``SamplingParams``).
        """
        # NOTE: imported here so that `import engine.protocol` stays light; sampling_params itself
        # does not import torch either, but the gateway has no use for it.
        from engine.sampling_params import SamplingParams

        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            structured=self.structured,
            repetition_penalty=self.repetition_penalty,
            logit_bias=tuple((int(t), float(b)) for t, b in self.logit_bias),
            resumed_tokens=self.resumed_tokens,
        )


# --- gateway -> worker -----------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello", frozen=True, kw_only=True):
    """First message on a connection; the worker answers ``Welcome`` or a version error."""

    version: int
    client_id: str


class MediaSpan(msgspec.Struct, frozen=True, kw_only=True):
    """One image (or video frame set) in a prompt: ``input_ids[offset : offset + length]`` are
    its placeholder ids (each in ``[MEDIA_ID_BASE, MEDIA_ID_LIMIT)``), whose rows the worker
    replaces by the embedding stored under ``key`` (shape ``[length, hidden_size]``, fetched
    from the embedding cache or the encoder service: the gateway encodes before it sends)."""

    offset: int
    length: int
    key: EmbeddingKey


class Generate(msgspec.Struct, tag="generate", frozen=True, kw_only=True):
    """Start one request.

    Attributes:
        request_id: unique among the client's running requests; every reply carries it.
        input_ids: the prompt's token ids (non-empty); text ids below the vocabulary size, media
            placeholder ids inside the spans of ``media``.
        sampling: how to pick tokens.
        session_id: the agent session this turn belongs to (scheduling and retention hints).
        cache_salt: tenant namespace of the prefix cache; requests with different salts never
            share cached KV (see ``engine.hashing``).
        priority: larger runs first; equal priorities are first come, first served.
        retain_ttl_s: keep this request's tail SWA checkpoint at least this long after it
            finishes (a session paused in a tool call); None uses the cache's own policy.
        stream_interval_s: send new tokens at most this often (0: after every step). A client
            that only wants the whole answer sets it (e.g. 1 s): a short answer then comes as
            one ``TokenDelta`` right before ``Finished``, a long one still shows progress.
        media: the prompt's images, sorted by ``offset``, not overlapping (``MediaSpan``); a
            request waits (unscheduled) while the worker fetches their embeddings, and one
            that is not found ends the request with ``invalid_request``.
    """

    request_id: str
    input_ids: list[int]
    sampling: SamplingSpec
    session_id: str | None = None
    cache_salt: str | None = None
    priority: int = 0
    retain_ttl_s: float | None = None
    stream_interval_s: float = 0.0
    media: list[MediaSpan] = []


class Abort(msgspec.Struct, tag="abort", frozen=True, kw_only=True):
    """Stop a request; it ends with ``Finished(finish_reason="abort")`` unless already done."""

    request_id: str


class Retain(msgspec.Struct, tag="retain", frozen=True, kw_only=True):
    """Keep the SWA checkpoint at the end of a finished request for ``ttl_s`` more seconds (a
    session paused in a tool call resumes from it); ``ttl_s=0`` releases it. No reply.

    The worker remembers the ends of its recently finished requests (a bounded map); a
    ``request_id`` it no longer knows, or whose pages are gone, is ignored. Retention is a hint:
    when nothing else is left to evict, retained pages go too.
    """

    request_id: str
    ttl_s: float


class GetLoad(msgspec.Struct, tag="get_load", frozen=True, kw_only=True):
    """Ask for one ``LoadReport``."""


class Flush(msgspec.Struct, tag="flush", frozen=True, kw_only=True):
    """Drop the prefix cache (running requests keep their KV); answered by a ``LoadReport``."""


ClientMsg = Hello | Generate | Abort | Retain | GetLoad | Flush


# --- worker -> gateway -----------------------------------------------------------------------


class Welcome(msgspec.Struct, tag="welcome", frozen=True, kw_only=True):
    """The worker's answer to ``Hello``: what it serves and the geometry the router hashes with.

    Attributes:
        sliding_window: W of the SWA layers; None for a model without SWA layers.
        max_context: the most tokens (prompt + output) one request may hold.
        instance_id: new each time the worker process starts; a client that sees another one on
            the same endpoint (a restart it did not notice) fails or retries its old requests.
        cost: the worker's step cost model (``engine.cost``), which the router predicts time to
            first token with; None when the worker does not know its own.
        max_batched_tokens: the worker's token budget per step (prefill chunks + decodes).
        events_endpoint: the PUB endpoint of its KV events and load reports, as bound (a
            wildcard host such as ``0.0.0.0`` means "the host you connected to").
        replay_endpoint: the ROUTER endpoint that replays missed KV event batches; None if none.
        swa_page_events: its KV events announce SWA per page (``SwaBlocksStored`` /
            ``SwaBlocksDropped``), not only checkpoints: a router may then count a page it
            predicts (one a request sent there is computing) as having its SWA.
    """

    version: int
    worker_id: str
    instance_id: str
    model: str
    page_size: int
    sliding_window: int | None
    max_context: int
    cost: CostModel | None = None
    max_batched_tokens: int = 0
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    swa_page_events: bool = False


class TokenDelta(msgspec.Struct, tag="token_delta", frozen=True, kw_only=True):
    """New output tokens of a request, in order.

    Attributes:
        logprobs: one per token in ``token_ids`` when the request asked for logprobs.
        top_logprobs: one list of ``(token_id, logprob)``, highest first, per token, when the
            request asked for ``logprobs >= 1``.
        cached_tokens: prompt tokens served from the prefix cache; set on the first delta only.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    cached_tokens: int = 0


class Finished(msgspec.Struct, tag="finished", frozen=True, kw_only=True):
    """A request's last message.

    ``cached_tokens`` is the total prompt-cache hit; the ``cached_tokens_*`` fields split it by
    the tier the KV came from (device L1, host L2, storage L3) and sum to it.
    """

    request_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    cached_tokens_device: int = 0
    cached_tokens_host: int = 0
    cached_tokens_storage: int = 0


class ErrorReply(msgspec.Struct, tag="error", frozen=True, kw_only=True):
    """A typed error. With a ``request_id`` it ends that request; without one it concerns the
    connection or a message that could not be decoded far enough to find its request."""

    request_id: str | None
    code: ErrorCode
    message: str


class LoadReport(msgspec.Struct, tag="load_report", frozen=True, kw_only=True):
    """A snapshot of the worker's load, for routing and admission.

    Attributes:
        free_full_pages: pages free for full-attention layers, counted in full-layer pages.
        free_swa_pages: pages free for SWA layers, counted in SWA-layer pages. Both come from one
            byte budget, so allocating one kind shrinks the other.
        used_bytes, total_bytes: the KV byte budget and what of it is in use (cache included).
        cached_pages: pages held by the prefix cache and not locked by a running request.
        instance_id: as in ``Welcome`` (heartbeats answer with a ``LoadReport``).
        retained_pages: pages (full + SWA) held only because a ``Retain`` or ``retain_ttl_s``
            protects them.
        retains_expired: retained checkpoints whose TTL ran out before a request used them
            (a count since the worker started).
        host_pages, host_used_bytes, host_total_bytes: the host-memory tier (L2) below the
            prefix cache: pages held and its byte budget (all 0 without one).
        storage_*: the L3 GCache's counters since the worker started (all 0 without one):
            prompt tokens served from it, pages confirmed written, write jobs dropped (queue
            full), failed store calls (an outage: read as misses), corrupt values (misses),
            and ``hibernated_sessions``, sessions written out and dropped.
        mtp_*: MTP speculation since start (issue 14; 0 without ``--mtp``): request-steps
            that verified drafts, the draft tokens verified, and those accepted.
        unsupported_hints: hints the worker's backend accepted and ignored since start
            (``Retain`` and ``retain_ttl_s`` on the sglang backend; always 0 on the native one).
    """

    worker_id: str
    instance_id: str = ""
    num_running: int
    num_waiting: int
    free_full_pages: int
    free_swa_pages: int
    used_bytes: int
    total_bytes: int
    cached_pages: int
    retained_pages: int = 0
    retains_expired: int = 0
    host_pages: int = 0
    host_used_bytes: int = 0
    host_total_bytes: int = 0
    storage_hit_tokens: int = 0
    storage_written_pages: int = 0
    storage_write_dropped: int = 0
    storage_errors: int = 0
    storage_corrupt: int = 0
    hibernated_sessions: int = 0
    mtp_verify_steps: int = 0
    mtp_draft_tokens: int = 0
    mtp_accepted_tokens: int = 0
    unsupported_hints: int = 0


class Replies(msgspec.Struct, tag="replies", frozen=True, kw_only=True):
    """Several request replies for one client in one message, in the order they were made: what
    one engine step produced for that client's requests (the worker sends a reply alone when it
    is the only one). Receivers handle ``items`` as if each had come on its own."""

    items: list[TokenDelta | Finished | ErrorReply]


WorkerMsg = Welcome | TokenDelta | Finished | ErrorReply | LoadReport | Replies

_ENCODER = msgspec.msgpack.Encoder()
_CLIENT_DECODER = msgspec.msgpack.Decoder(ClientMsg)
_WORKER_DECODER = msgspec.msgpack.Decoder(WorkerMsg)


def encode(msg: ClientMsg | WorkerMsg) -> bytes:
    """msgpack bytes of one message (a map with its tag under ``"type"``)."""
    return _ENCODER.encode(msg)


def merge_deltas(deltas: list[TokenDelta]) -> TokenDelta:
    """Consecutive deltas of one request (same optional fields) as one, in order (a gateway
    coalescing what a slow reader has not taken yet, a worker holding back a stream)."""
    first = deltas[0]
    ids = [t for d in deltas for t in d.token_ids]
    logprobs = None if first.logprobs is None else [x for d in deltas for x in d.logprobs or ()]
    top = None if first.top_logprobs is None else \
        [x for d in deltas for x in d.top_logprobs or ()]
    return TokenDelta(request_id=first.request_id, token_ids=ids, logprobs=logprobs,
                      top_logprobs=top, cached_tokens=sum(d.cached_tokens for d in deltas))


def decode_client(data: bytes) -> ClientMsg:
    """Decode a gateway -> worker message.

    Raises:
        ProtocolError: ``data`` is not a ``ClientMsg``; the message names the offending field.
    """
    return _decode(_CLIENT_DECODER, data, "client")


def decode_worker(data: bytes) -> WorkerMsg:
    """Decode a worker -> gateway message.

    Raises:
        ProtocolError: ``data`` is not a ``WorkerMsg``; the message names the offending field.
    """
    return _decode(_WORKER_DECODER, data, "worker")


def replies_in(msg: WorkerMsg) -> list[WorkerMsg]:
    """The replies ``msg`` carries, in order: a ``Replies`` unpacked, anything else alone."""
    return list(msg.items) if type(msg) is Replies else [msg]


def decode_worker_items(data: bytes) -> list[WorkerMsg]:
    """Decode a worker -> gateway message into the replies it carries (``replies_in``).
    Raises ``ProtocolError`` as ``decode_worker``."""
    return replies_in(decode_worker(data))


def _decode(decoder: msgspec.msgpack.Decoder[Any], data: bytes, direction: str) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid {direction} message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable {direction} message ({len(data)} bytes): {exc}") from None
