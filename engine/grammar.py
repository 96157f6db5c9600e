"""Grammar-constrained decoding with llguidance: compile a ``StructuredSpec`` against the model's
tokenizer, then per request compute which tokens may come next and advance with each sampled one.

    GrammarCompiler (one per engine)           GrammarMatcher (one per request)
      tokenizer.json -> LLTokenizer, once        allowed(vocab) -> bool [V] for the next token
      LRU: spec -> compiled matcher, bounded     accept(token) after each sampled token
      in estimated bytes                         is_terminated: an EOS the grammar accepted

``GrammarCompiler.compile`` is safe from any thread (llguidance releases the GIL while it
compiles, so the worker compiles on ``engine.worker.grammar_jobs`` threads); the cache methods
(``cached``, ``add``, ``matcher``) belong to one thread, the engine's.

NOTE (state): a matcher has consumed exactly its request's ``output_ids``. Preemption keeps the
output ids and recomputes only their KV, so a resumed request's matcher just continues; nothing
is rolled back or replayed.

llguidance is imported only when a grammar is compiled, so ``import engine`` stays light, and this
module imports no torch (the gateway checks grammars with ``check_grammar``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from engine.sampling_params import StructuredSpec

if TYPE_CHECKING:
    import llguidance

logger = logging.getLogger(__name__)

# JSON as `json.dumps` and the chat template's `tojson` write it, so a constrained tool call reads
# exactly like one the template renders (and a small model cannot loop on whitespace).
JSON_FORMAT: dict[str, Any] = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
}
MAX_CACHED_GRAMMARS = 128
MAX_GRAMMAR_CACHE_BYTES = 128 * 2**20
# NOTE: measured with the demo tokenizer, a compiled grammar took 100-300 bytes of RSS per byte of
# llguidance grammar text (flat JSON schemas of 60-120 kB); the estimate takes the high end.
COMPILED_BYTES_PER_GRAMMAR_BYTE = 256
COMPILED_BASE_BYTES = 64 * 2**10
_MAX_ERROR_CHARS = 400


class GrammarError(ValueError):
    """A grammar that does not compile, or no tokenizer to compile it with (the worker's
    ``invalid_grammar``)."""


def grammar_text(spec: StructuredSpec) -> str:
    """llguidance's grammar for a spec (no tokenizer needed; not yet checked).

    Raises:
        GrammarError: ``json_schema`` is not JSON text of an object.
    """
    from llguidance import LLMatcher

    try:
        if spec.lark is not None:
            return LLMatcher.grammar_from_lark(spec.lark)
        schema = json.loads(spec.json_schema or "")
    except ValueError as e:
        raise GrammarError(f"the grammar is not valid: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError(f"json_schema must be a JSON object, got {type(schema).__name__}")
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT)  # type: ignore[arg-type]
    except (ValueError, TypeError, OverflowError) as e:
        # NOTE: a value llguidance cannot serialize back (an int beyond 64 bits, ...)
        raise GrammarError(f"json_schema is not usable: {e}") from None


def check_grammar(spec: StructuredSpec) -> None:
    """Compile without a tokenizer (special-token names are checked only by the engine).

    Raises:
        GrammarError: naming what llguidance rejects (an unsupported schema keyword, a Lark
            syntax error, ...).
    """
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar_text(spec))
    if error:
        raise GrammarError(_short(error))


class CompiledGrammar(NamedTuple):
    """A compiled grammar (at the start of its input) and an estimate of the memory it holds."""

    matcher: llguidance.LLMatcher
    num_bytes: int


def spec_bytes(spec: StructuredSpec) -> int:
    """The size of a spec's grammar text (the schema or the Lark source) in UTF-8 bytes."""
    return len((spec.json_schema or spec.lark or "").encode())


class GrammarMatcher:
    """One request's position in its grammar.

    Args:
        matcher: a fresh ``llguidance.LLMatcher`` (a copy of the compiler's cached one).
        eos_token_ids: the ids the grammar ends with (the compiler's tokenizer's EOS tokens).
    """

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: tuple[int, ...]) -> None:
        self._matcher = matcher
        self._eos = frozenset(eos_token_ids)
        self.is_terminated = False  # consumed an EOS the grammar allowed: the request is done

    def allowed(self, vocab_size: int) -> np.ndarray:
        """bool [vocab_size]: the tokens that may come next (only EOS once the grammar is
        complete, or if the matcher failed; ids past the tokenizer are never allowed)."""
        if self._matcher.is_error():
            return self._eos_only(vocab_size)
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool)
        if allowed.shape[0] < vocab_size:
            allowed = np.pad(allowed, (0, vocab_size - allowed.shape[0]))
        return allowed if allowed.any() else self._eos_only(vocab_size)

    def accept(self, token_id: int) -> None:
        """Advance by one sampled token (which ``allowed`` allowed)."""
        if self._matcher.is_error():
            return
        if not self._matcher.consume_token(token_id):
            # NOTE: cannot happen for a token drawn under `allowed`; if it does (a bug, a parser
            # limit), the next mask allows only EOS, so the request still ends.
            logger.warning("grammar rejected token %d: %s", token_id, self._matcher.get_error())
            return
        if token_id in self._eos and self._matcher.is_stopped():
            self.is_terminated = True

    def _eos_only(self, vocab_size: int) -> np.ndarray:
        allowed = np.zeros(vocab_size, dtype=bool)
        allowed[[t for t in self._eos if t < vocab_size]] = True
        return allowed


class GrammarCompiler:
    """Builds matchers for one model: the llguidance tokenizer (from ``tokenizer.json``, once, on
    the first grammar) and an LRU of compiled grammars keyed by their spec, bounded in count and
    in estimated bytes (``CompiledGrammar.num_bytes``; a grammar larger than the whole byte
    budget is used but not kept).

    Args:
        model_path: the model directory (its ``tokenizer.json``); None: grammars are refused.
        vocab_size: the model's vocabulary (logit columns); ids the tokenizer lacks are never
            allowed.
        eos_token_ids: the engine's EOS ids; a complete grammar allows exactly these.
        max_cached: grammars kept at most.
        max_cache_bytes: estimated bytes kept at most.
    """

    def __init__(self, model_path: str | None, vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_cached: int = MAX_CACHED_GRAMMARS,
                 max_cache_bytes: int = MAX_GRAMMAR_CACHE_BYTES) -> None:
        assert max_cached >= 0 and max_cache_bytes >= 0, "cache bounds must be >= 0"
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_cached = max_cached
        self.max_cache_bytes = max_cache_bytes
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[StructuredSpec, CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0

    def matcher(self, spec: StructuredSpec) -> GrammarMatcher:
        """A fresh matcher for ``spec`` at the start of its grammar (compiled here on a miss).

        Raises:
            GrammarError: the grammar does not compile against this model's tokenizer, or the
                model directory has no ``tokenizer.json``.
        """
        return self.cached(spec) or self.add(spec, self.compile(spec))

    def cached(self, spec: StructuredSpec) -> GrammarMatcher | None:
        """A fresh matcher from the cache (marked recently used), or None on a miss."""
        compiled = self._cache.get(spec)
        if compiled is None:
            return None
        self._cache.move_to_end(spec)
        return self.new_matcher(compiled)

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """Compile without touching the cache; safe from any thread.

        Raises:
            GrammarError: as for ``matcher``.
        """
        from llguidance import LLMatcher

        text = grammar_text(spec)
        matcher = LLMatcher(self._get_tokenizer(), text, log_level=0)
        if matcher.is_error():
            raise GrammarError(_short(matcher.get_error()))
        num_bytes = COMPILED_BASE_BYTES + COMPILED_BYTES_PER_GRAMMAR_BYTE * len(text)
        return CompiledGrammar(matcher, num_bytes)

    def add(self, spec: StructuredSpec, compiled: CompiledGrammar) -> GrammarMatcher:
        """Keep ``compiled`` (evicting the least recently used beyond the bounds), and return a
        fresh matcher of it."""
        old = self._cache.pop(spec, None)
        if old is not None:
            self._cache_bytes -= old.num_bytes
        if compiled.num_bytes <= self.max_cache_bytes and self.max_cached > 0:
            self._cache[spec] = compiled
            self._cache_bytes += compiled.num_bytes
        while len(self._cache) > self.max_cached or self._cache_bytes > self.max_cache_bytes:
            _, evicted = self._cache.popitem(last=False)
            self._cache_bytes -= evicted.num_bytes
        return self.new_matcher(compiled)

    def new_matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher of a compiled grammar (its own parser state)."""
        return GrammarMatcher(compiled.matcher.deep_copy(), self.eos_token_ids)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    @property
    def cache_bytes(self) -> int:
        """The estimated bytes of the compiled grammars kept."""
        return self._cache_bytes

    def _get_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:  # NOTE: compile threads may race to load it first
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer()
            return self._tokenizer

    def _load_tokenizer(self) -> llguidance.LLTokenizer:
        path = Path(self.model_path) / "tokenizer.json" if self.model_path else None
        if path is None or not path.is_file():
            raise GrammarError(
                "structured output needs the model's tokenizer.json, and this worker has none"
            )
        from llguidance import LLTokenizer

        try:
            return LLTokenizer(path.read_text(encoding="utf-8"), n_vocab=self.vocab_size,
                               eos_token=list(self.eos_token_ids) or None)
        except Exception as e:  # NOTE: llguidance raises plain exceptions for a bad file
            raise GrammarError(f"{path}: not usable for structured output: {e}") from None


def _short(error: str) -> str:
    """llguidance errors can list every special token; keep the head."""
    error = error.strip()
    return error if len(error) <= _MAX_ERROR_CHARS else error[:_MAX_ERROR_CHARS] + " ..."
