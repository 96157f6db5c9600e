"""Pure mappings between agentgate's worker protocol and SGLang's in-process engine API.

``generate_kwargs`` turns a ``Generate`` into the keyword arguments of SGLang's
``Engine.async_generate`` (refusing, with ``Refused``, what this backend cannot serve faithfully);
``OutputMapper`` turns the dicts that call streams back into ``TokenDelta`` / ``Finished`` /
``ErrorReply``; ``parse_sglang_args`` reads the worker's ``--sglang-arg KEY=VALUE`` flags.

Written against sglang 0.5.23 and pinned there by tests/engine/test_sglang_mapping.py; nothing
here imports sglang or torch, so the mapping is tested on any machine. Where SGLang's semantics
differ from agentgate's engine, the difference is either refused here or named below:

- ``repetition_penalty``: SGLang penalizes tokens of the output only
  (sampling/penaltylib/repetition_penalty.py), agentgate's engine prompt and output; SGLang
  also caps it at 2 (``SamplingParams.verify``), so larger values are refused here.
- ``seed``: SGLang honours ``sampling_seed`` only when the server runs with
  ``enable_deterministic_inference`` (sampling/sampling_batch_info.py); otherwise it is ignored.
- ``structured.lark`` goes to SGLang's ``ebnf`` key, which is Lark only with the llguidance
  grammar backend (constrained/llguidance_backend.py ``dispatch_ebnf``: ``grammar_from("ebnf")``).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from engine.protocol import (
    MEDIA_ID_BASE,
    ErrorCode,
    ErrorReply,
    Finished,
    FinishReason,
    Generate,
    TokenDelta,
)
from engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams, check_logit_bias_ids
from engine.sequence import check_prompt_ids

# NOTE: sglang 0.5.23 sampling/sampling_params.py SamplingParams.verify: (0, 2]
SGLANG_MAX_REPETITION_PENALTY = 2.0
# NOTE: io_struct.py GenerateReqInput: "-1 means it will only return logprobs for output tokens";
# scheduler.py turns it into len(origin_input_ids) when return_logprob is set
NO_PROMPT_LOGPROBS = -1

# Defaults of SGLang's SamplingParams (sampling_params.py); a key equal to its default is omitted
_SGLANG_DEFAULTS: dict[str, object] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "ignore_eos": False,
}

# What SGLang says when a prompt does not fit: managers/utils.py validate_input_length (an abort,
# 400) and tokenizer_manager.py _validate_one_request (ValueError)
_CONTEXT_TOO_LONG = (
    "exceeds the maximum allowed length",
    "is longer than the model's context length",
    "exceeds the model's maximum context length",
)
# constrained/grammar_manager.py: a grammar that does not compile, or no grammar backend
_GRAMMAR_FAILED = (
    "Failed to compile ",
    "Grammar compilation failed",
    "Grammar preprocessing timed out",
    "Grammar-based generation",
)
_OVERLOADED_STATUS = (429, 503)
_QUEUE_FULL = "queue is full"  # scheduler.py _abort_on_queued_limit: "The request queue is full."
# schedule_batch.py FINISH_*.to_json "type"; a kind SGLang may add later reads as "stop"
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}

Reply = TokenDelta | Finished | ErrorReply


class Refused(Exception):
    """A ``Generate`` this backend will not run; the worker answers ``ErrorReply(code, message)``.

    Attributes:
        code: the ``engine.protocol.ErrorCode`` to answer with.
        message: what the client has to change.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message


class CacheHit(NamedTuple):
    """A prompt-cache hit split by the tier its KV came from; the tiers sum to ``total``."""

    total: int
    device: int
    host: int
    storage: int


def generate_kwargs(msg: Generate, *, rid: str, supports_cache_salt: bool,
                    vocab_size: int | None) -> dict[str, Any]:
    """The keyword arguments of ``sglang.Engine.async_generate`` that run ``msg``.

    Args:
        rid: SGLang's request id (unique in the engine; SGLang aborts by rid *prefix*).
        supports_cache_salt: the installed SGLang has ``GenerateReqInput.cache_salt``.
        vocab_size: the model's vocabulary size; None skips the upper bound of the id checks.

    Raises:
        Refused: ``invalid_request`` for anything the request itself gets wrong or this backend
            cannot serve without changing its meaning (the message names the field).
    """
    params = _validated(msg, supports_cache_salt=supports_cache_salt, vocab_size=vocab_size)
    kwargs: dict[str, Any] = {
        "input_ids": list(msg.input_ids),
        "sampling_params": sampling_params(params),
        "stream": True,
        "rid": rid,
        "priority": msg.priority,  # NOTE: SGLang, like agentgate, runs larger values first
    }
    if params.logprobs is not None:
        kwargs["return_logprob"] = True
        kwargs["logprob_start_len"] = NO_PROMPT_LOGPROBS
        if params.logprobs > 0:
            kwargs["top_logprobs_num"] = params.logprobs
    if msg.cache_salt:  # NOTE: "" is no salt, in agentgate (engine.hashing) as in SGLang
        kwargs["cache_salt"] = msg.cache_salt
    return kwargs


def sampling_params(params: SamplingParams) -> dict[str, Any]:
    """SGLang's ``sampling_params`` dict for ``params``: ``max_new_tokens`` (SGLang's default is
    128, agentgate's 16) and only the keys whose value differs from SGLang's default."""
    # NOTE: SGLang is greedy below 1e-6, agentgate below GREEDY_TEMPERATURE (1e-5): send 0 for
    # everything agentgate calls greedy, so that 5e-6 is not divided by on SGLang's side
    greedy = params.temperature < GREEDY_TEMPERATURE
    structured = params.structured
    candidates: dict[str, Any] = {
        "temperature": 0.0 if greedy else float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": params.top_k,
        "min_p": float(params.min_p),
        "repetition_penalty": float(params.repetition_penalty),
        "stop_token_ids": list(params.stop_token_ids) or None,
        "ignore_eos": params.ignore_eos,
        # NOTE: a token listed twice: the last bias wins, as in engine.sampler.apply_logit_bias
        "logit_bias": {str(t): float(b) for t, b in params.logit_bias} or None,
        "sampling_seed": params.seed,
        "json_schema": structured.json_schema if structured else None,
        "ebnf": structured.lark if structured else None,
    }
    chosen = {k: v for k, v in candidates.items()
              if v is not None and v != _SGLANG_DEFAULTS.get(k)}
    return {"max_new_tokens": params.max_new_tokens, **chosen}


def unsupported_hints(msg: Generate) -> list[str]:
    """The scheduling hints of ``msg`` this backend accepts but ignores (the worker counts them).

    ``session_id`` is not one: it only groups turns, and SGLang's own ``session_id`` means its
    session feature, so it is never passed. ``stream_interval_s`` is the worker's job.
    """
    return ["retain_ttl_s"] if msg.retain_ttl_s is not None else []


class OutputMapper:
    """Maps one request's stream of SGLang output dicts to agentgate replies.

    SGLang (tokenizer_manager.py ``_handle_batch_output``, token-id mode) yields
    ``{"output_ids": [...], "meta_info": {...}}``. With ``incremental_streaming_output`` the ids
    and the ``output_*logprobs`` lists are the new part only (several queued chunks may come
    concatenated); without it both are cumulative and may be the very lists SGLang appends to
    later, so they are sliced (copied) at once. Either way no token is sent twice and none past
    ``meta_info["completion_tokens"]`` (the abort echo of an incremental stream repeats the last
    id: tokenizer_manager.py ``_handle_abort_req``).

    ``feed`` returns at most one last message (``Finished`` or ``ErrorReply``) and nothing after.
    """

    def __init__(self, request_id: str, *, prompt_tokens: int, logprobs: int | None,
                 incremental: bool) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.logprobs = logprobs
        self.incremental = incremental
        self.abort_requested = False
        self._num_sent = 0
        self._cache_hit = CacheHit(0, 0, 0, 0)
        self._done = False

    @property
    def num_sent(self) -> int:
        """Output tokens sent so far (in ``TokenDelta``s)."""
        return self._num_sent

    @property
    def is_done(self) -> bool:
        """The last message has been returned; ``feed`` returns nothing more."""
        return self._done

    def mark_aborted(self) -> None:
        """The worker asked SGLang to abort: an abort then ends as ``Finished("abort")``."""
        self.abort_requested = True

    def feed(self, out: dict[str, Any]) -> list[Reply]:
        """The replies for one streamed SGLang output dict, in order (maybe none)."""
        if self._done:
            return []
        meta: dict[str, Any] = out.get("meta_info") or {}
        finish: dict[str, Any] | None = meta.get("finish_reason")
        if finish is not None and finish.get("type") == "abort" and not self.abort_requested:
            return [self._end(self._engine_abort(finish))]
        if "cached_tokens" in meta:  # NOTE: the abort echo has none; keep what came before
            self._cache_hit = cache_hit(meta)
        try:
            delta = self._delta(out, meta)
        except ValueError as exc:
            return [self._end(ErrorReply(request_id=self.request_id, code="internal",
                                         message=str(exc)))]
        replies: list[Reply] = [] if delta is None else [delta]
        if finish is not None:
            replies.append(self._end(self._finished(finish, meta)))
        return replies

    def error(self, exc: BaseException) -> ErrorReply:
        """The last message for an exception raised by ``async_generate`` (or its stream).

        SGLang raises ``ValueError`` for what the request got wrong, e.g. a prompt longer than
        the context (tokenizer_manager.py ``_validate_one_request``).
        """
        if isinstance(exc, ValueError):
            text = str(exc)
            code: ErrorCode = "invalid_request"
            if _says(text, _CONTEXT_TOO_LONG):
                code = "context_too_long"
            reply = ErrorReply(request_id=self.request_id, code=code, message=text)
        else:
            reply = ErrorReply(request_id=self.request_id, code="internal",
                               message=f"SGLang failed: {type(exc).__name__}: {exc}")
        return self._end(reply)

    def _delta(self, out: dict[str, Any], meta: dict[str, Any]) -> TokenDelta | None:
        start = 0 if self.incremental else self._num_sent
        ids = out.get("output_ids") or []
        new_ids = [int(t) for t in ids[start:]]
        total = meta.get("completion_tokens")
        if isinstance(total, int):
            new_ids = new_ids[: max(0, total - self._num_sent)]
        if not new_ids:
            return None
        logprobs, top = self._logprobs(meta, start, len(new_ids))
        delta = TokenDelta(request_id=self.request_id, token_ids=new_ids, logprobs=logprobs,
                           top_logprobs=top,
                           cached_tokens=self._cache_hit.total if self._num_sent == 0 else 0)
        self._num_sent += len(new_ids)
        return delta

    def _logprobs(self, meta: dict[str, Any], start: int, n: int
                  ) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
        """The logprobs of output tokens ``[start, start + n)`` of ``meta``'s lists.

        Raises:
            ValueError: SGLang sent fewer logprobs than tokens (the delta would break the
                protocol's one-per-token promise).
        """
        if self.logprobs is None:
            return None, None
        # NOTE: entries are (logprob, token_id, text=None): tokenizer_manager.py
        # detokenize_logprob_tokens; a top-k row is a list of those, or None when empty
        entries = (meta.get("output_token_logprobs") or [])[start:start + n]
        if len(entries) != n:
            raise ValueError(f"SGLang sent {len(entries)} logprobs for {n} new tokens")
        logprobs = [float(e[0]) for e in entries]
        if self.logprobs == 0:
            return logprobs, None
        rows = (meta.get("output_top_logprobs") or [])[start:start + n]
        if len(rows) != n:
            raise ValueError(f"SGLang sent {len(rows)} top-logprob rows for {n} new tokens")
        return logprobs, [_top_pairs(row, self.logprobs) for row in rows]

    def _finished(self, finish: dict[str, Any], meta: dict[str, Any]) -> Finished:
        reason = _FINISH_REASONS.get(str(finish.get("type")), "stop")
        # NOTE: an abort may come with SGLang's prompt replaced by one token (schedule_batch.py
        # Req.set_finish_with_abort), so only a normal finish reports SGLang's count
        prompt_tokens = self.prompt_tokens
        if reason != "abort" and isinstance(meta.get("prompt_tokens"), int):
            prompt_tokens = meta["prompt_tokens"]
        hit = self._cache_hit
        return Finished(request_id=self.request_id, finish_reason=reason,
                        prompt_tokens=prompt_tokens, completion_tokens=self._num_sent,
                        cached_tokens=hit.total, cached_tokens_device=hit.device,
                        cached_tokens_host=hit.host, cached_tokens_storage=hit.storage)

    def _engine_abort(self, finish: dict[str, Any]) -> ErrorReply:
        message = str(finish.get("message") or "aborted")
        status = finish.get("status_code")
        code = abort_code(message, status)
        suffix = f" (status {int(status)})" if isinstance(status, int) else ""
        return ErrorReply(request_id=self.request_id, code=code,
                          message=f"SGLang aborted the request{suffix}: {message}")

    def _end(self, reply: Finished | ErrorReply) -> Finished | ErrorReply:
        self._done = True
        return reply


def abort_code(message: str, status_code: int | None) -> ErrorCode:
    """The error code for an abort SGLang decided on (``finish_reason`` type ``"abort"``).

    SGLang's status is an HTTP status (``HTTPStatus``, an int) or None; 400 is also the default
    of ``Req.set_finish_with_abort``, so the message decides between the 400s.
    """
    if _says(message, _CONTEXT_TOO_LONG):
        return "context_too_long"
    if _says(message, _GRAMMAR_FAILED):
        return "invalid_grammar"
    if status_code in _OVERLOADED_STATUS or _QUEUE_FULL in message:
        return "overloaded"
    if status_code == 400:
        return "invalid_request"
    return "internal"


def cache_hit(meta: dict[str, Any]) -> CacheHit:
    """The prompt-cache hit in SGLang's ``meta_info``, split by tier.

    ``cached_tokens_details`` is ``{"device", "host"[, "storage", "storage_backend"]}`` or absent
    (scheduler_components/output_streamer.py ``get_cached_tokens_details``); absent means all on
    the device. SGLang splits once, at the first prefill chunk, while ``cached_tokens`` grows per
    chunk (schedule_batch.py), so the two may disagree: host and storage are kept (capped) and
    the device gets the rest, so that the tiers sum to the total as ``Finished`` promises.
    """
    total = int(meta.get("cached_tokens") or 0)
    details = meta.get("cached_tokens_details") or {}
    host = min(total, int(details.get("host") or 0))
    storage = min(total - host, int(details.get("storage") or 0))
    return CacheHit(total=total, device=total - host - storage, host=host, storage=storage)


def parse_sglang_args(pairs: list[str]) -> dict[str, Any]:
    """SGLang ``ServerArgs`` keyword arguments from repeated ``--sglang-arg KEY=VALUE`` flags.

    The key's dashes become underscores (leading ones dropped: ``--tp-size=2`` is ``tp_size``);
    the value is JSON when it parses as JSON (``true``, ``0.8``, ``{"a": 1}``, ``null``), else the
    text as is: quote a string that looks like a number (``revision="1234"``). A key given twice
    keeps the last value, as on a command line.

    Raises:
        ValueError: a pair without ``=`` or with an empty key, naming it.
    """
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--sglang-arg {pair!r}: expected KEY=VALUE "
                             "(e.g. mem_fraction_static=0.8)")
        kwargs[key] = _json_or_text(raw)
    return kwargs


def _validated(msg: Generate, *, supports_cache_salt: bool, vocab_size: int | None
               ) -> SamplingParams:
    if msg.media:
        raise Refused("invalid_request", "images are not supported by the sglang backend yet; "
                      "send the request to a worker with the native backend, or without images")
    try:
        params = msg.sampling.to_params()
    except ValueError as exc:
        raise Refused("invalid_request", str(exc)) from None
    if not msg.input_ids:
        raise Refused("invalid_request", "input_ids: the prompt is empty; give at least one id")
    # NOTE: the native engine's checks; without a vocabulary size, ids stay below the media
    # placeholders (every vocabulary does: engine.protocol.MEDIA_ID_BASE)
    try:
        check_prompt_ids(list(msg.input_ids), [], vocab_size or MEDIA_ID_BASE)
    except ValueError as exc:
        raise Refused("invalid_request", f"input_ids: {exc}") from None
    try:
        check_logit_bias_ids(params, vocab_size or MEDIA_ID_BASE)
    except ValueError as exc:
        raise Refused("invalid_request", f"sampling: {exc}") from None
    if params.repetition_penalty > SGLANG_MAX_REPETITION_PENALTY:
        raise Refused("invalid_request", f"sampling.repetition_penalty="
                      f"{params.repetition_penalty}: the sglang backend accepts (0, "
                      f"{SGLANG_MAX_REPETITION_PENALTY:g}] (SGLang's limit)")
    if msg.cache_salt and not supports_cache_salt:
        raise Refused("invalid_request", "cache_salt: the installed SGLang has no per-request "
                      "cache isolation key, so salted (multi-tenant) requests are refused rather "
                      "than silently shared; upgrade SGLang to >= 0.5.23 or serve tenants from "
                      "separate workers")
    if params.structured is not None and params.resumed_tokens > 0:
        raise Refused("invalid_request", "sampling.resumed_tokens: a grammar's state cannot be "
                      "resumed on the sglang backend; restart the structured request from its "
                      "original prompt")
    return params


def _top_pairs(row: list[Any] | None, k: int) -> list[tuple[int, float]]:
    pairs = [(int(e[1]), float(e[0])) for e in row or []]
    pairs.sort(key=lambda p: p[1], reverse=True)  # NOTE: stable: ties keep SGLang's order
    return pairs[:k]


def _says(message: str, phrases: tuple[str, ...]) -> bool:
    return any(p in message for p in phrases)


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw
