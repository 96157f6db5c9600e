"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard

import msgspec

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # NOTE: OpenAI's bound on one logit_bias value
MAX_LOGIT_BIAS_ENTRIES = 1024
SEED_LIMIT = 2**63
# NOTE: dividing logits by a temperature this small overflows float32 to inf (and softmax to NaN),
# so anything below it is greedy, as in vLLM (_SAMPLING_EPS = 1e-5).
GREEDY_TEMPERATURE = 1e-5


class StructuredSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A grammar the output must match (``engine.grammar``); exactly one field is set.

    Attributes:
        json_schema: a JSON schema as JSON text; the output is one JSON value matching it, written
            as ``json.dumps`` writes it (``", "`` and ``": "``, no other whitespace) unless the
            schema's ``x-guidance`` says otherwise.
        lark: an llguidance Lark grammar (``%json{...}`` embeds a schema; ``<tool_call>`` or
            ``<[259]>`` names a special token).

    Also the wire form (``engine.protocol.SamplingSpec.structured``): decoding checks types only,
    ``SamplingParams`` checks that exactly one field is a non-empty string.
    """

    json_schema: str | None = None
    lark: str | None = None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its next tokens.

    Attributes:
        max_new_tokens: generation budget, >= 1.
        temperature: >= 0 and finite; 0 (anything below ``GREEDY_TEMPERATURE``) means greedy.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens, >= 1; None disables it. 1 means greedy.
        min_p: drop tokens less likely than ``min_p`` times the top token, in [0, 1]; 0 disables it.
        seed: per-request seed in [0, 2**63); the same seed and the same logits give the same
            tokens whatever else is in the batch. None draws from the shared default RNG.
        stop_token_ids: extra token ids that end the request (a tuple; lists are rejected).
        ignore_eos: keep generating past the model's EOS token.
        logprobs: None for no logprobs; 0 for the sampled token's logprob only; N in [1, 20] for
            the top-N alternatives too.
        structured: a grammar the output must follow (None: unconstrained). Tokens the grammar
            does not allow next are masked (-inf) before sampling, greedy or not; once the
            grammar is complete only EOS is allowed, so the request ends with "stop".
        repetition_penalty: > 0 and finite; 1 disables it. A token already in the prompt or the
            output has its logit divided by it when positive, multiplied when negative (CTRL,
            as vLLM and transformers do).
        logit_bias: ``(token_id, bias)`` pairs added to the logits before sampling, bias in
            [-100, 100], at most ``MAX_LOGIT_BIAS_ENTRIES`` pairs (OpenAI's ``logit_bias``).
        resumed_tokens: the prompt's last ``resumed_tokens`` tokens are this request's own output
            from an earlier run that stopped (a stream the gateway moved off a lost worker):
            a grammar has consumed them, and seeded draws go on as that run's would have.
            ``max_new_tokens`` counts only what is left to generate.

    Raises:
        ValueError: naming the field and its allowed range when a value is out of range or of the
            wrong type.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    structured: StructuredSpec | None = None
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    resumed_tokens: int = 0

    def __post_init__(self) -> None:
        _require("max_new_tokens", self.max_new_tokens, "an int >= 1", _is_int_in(1, math.inf))
        _require("temperature", self.temperature, "a finite float >= 0", _is_finite_non_negative)
        _require("top_p", self.top_p, "a float in (0, 1]", lambda v: _is_real(v) and 0 < v <= 1)
        _require("top_k", self.top_k, "None or an int >= 1", _optional(_is_int_in(1, math.inf)))
        _require("min_p", self.min_p, "a float in [0, 1]", lambda v: _is_real(v) and 0 <= v <= 1)
        _require("seed", self.seed, "None or an int in [0, 2**63)", _optional(_is_seed))
        _require("stop_token_ids", self.stop_token_ids, "a tuple of ints >= 0", _is_token_id_tuple)
        _require("ignore_eos", self.ignore_eos, "a bool", lambda v: isinstance(v, bool))
        _require(
            "logprobs",
            self.logprobs,
            f"None or an int in [0, {MAX_LOGPROBS}]",
            _optional(_is_int_in(0, MAX_LOGPROBS)),
        )
        _require(
            "structured",
            self.structured,
            "None or a StructuredSpec with exactly one of json_schema, lark a non-empty str",
            _optional(_is_structured),
        )
        _require("repetition_penalty", self.repetition_penalty, "a finite float > 0",
                 lambda v: _is_real(v) and math.isfinite(v) and v > 0)
        _require("logit_bias", self.logit_bias,
                 f"a tuple of at most {MAX_LOGIT_BIAS_ENTRIES} (token_id >= 0, bias in "
                 f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]) pairs", _is_logit_bias)
        _require("resumed_tokens", self.resumed_tokens, "an int >= 0", _is_int_in(0, math.inf))

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (lowest index on ties); the seed goes unused."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


_Check = Callable[[object], bool]


def _require(field: str, value: object, allowed: str, is_valid: _Check) -> None:
    if not is_valid(value):
        raise ValueError(f"SamplingParams.{field}={value!r}: must be {allowed}")


def _is_int(value: object) -> TypeGuard[int]:
    # NOTE: bool is a subclass of int; `top_k=True` is a caller bug, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int_in(lo: float, hi: float) -> _Check:
    return lambda v: _is_int(v) and lo <= v <= hi


def _is_seed(value: object) -> bool:
    return _is_int(value) and 0 <= value < SEED_LIMIT


def _is_finite_non_negative(value: object) -> bool:
    return _is_real(value) and math.isfinite(value) and value >= 0


def _is_token_id_tuple(value: object) -> bool:
    return isinstance(value, tuple) and all(_is_int(t) and t >= 0 for t in value)


def _is_structured(value: object) -> bool:
    if not isinstance(value, StructuredSpec):
        return False
    fields = (value.json_schema, value.lark)
    return sum(isinstance(f, str) and f != "" for f in fields) == 1 and fields.count(None) == 1


def _is_logit_bias(value: object) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) <= MAX_LOGIT_BIAS_ENTRIES
        and all(
            isinstance(p, tuple) and len(p) == 2 and _is_int(p[0]) and p[0] >= 0
            and _is_real(p[1]) and abs(p[1]) <= MAX_LOGIT_BIAS
            for p in value
        )
    )


def _optional(check: _Check) -> _Check:
    return lambda v: v is None or check(v)


def check_logit_bias_ids(params: SamplingParams, vocab_size: int) -> None:
    """``SamplingParams`` checks logit-bias ids are >= 0; only the model knows the upper bound.

    Raises:
        ValueError: naming the ids outside ``[0, vocab_size)``.
    """
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise ValueError(
            f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )
