"""The worker's admission of a ``Generate``: the checks that refuse it with an ``ErrorReply``, and
the step that turns it into an engine request (``engine.worker.requests`` calls both)."""

from __future__ import annotations

from engine.engine import ContextTooLong, Engine
from engine.grammar import GrammarError, GrammarMatcher, spec_bytes
from engine.protocol import ErrorReply, Generate
from engine.sampling_params import SamplingParams
from engine.scheduler import Overloaded
from engine.sequence import Media, Sequence
from engine.worker.config import stream_interval_error


def check_generate(msg: Generate, engine: Engine, max_grammar_bytes: int
                   ) -> SamplingParams | ErrorReply:
    """The request's validated parameters, or the error that refuses it (cheap checks only:
    nothing here compiles a grammar)."""
    rid = msg.request_id
    try:
        params = msg.sampling.to_params()
    except ValueError as e:
        return ErrorReply(request_id=rid, code="invalid_request", message=str(e))
    if (text := stream_interval_error(msg.stream_interval_s)) is not None:
        return ErrorReply(request_id=rid, code="invalid_request", message=text)
    size = 0 if params.structured is None else spec_bytes(params.structured)
    if size > max_grammar_bytes:
        text = (f"the grammar is {size} bytes; this worker compiles grammars of at most "
                f"{max_grammar_bytes} bytes")
        return ErrorReply(request_id=rid, code="invalid_grammar", message=text)
    try:
        engine.check_request(msg.input_ids, params, [(m.offset, m.length) for m in msg.media])
    except ContextTooLong as e:
        return ErrorReply(request_id=rid, code="context_too_long", message=str(e))
    except ValueError as e:
        return ErrorReply(request_id=rid, code="invalid_request", message=str(e))
    return params


def add_to_engine(engine: Engine, msg: Generate, params: SamplingParams, engine_id: str,
                  grammar: GrammarMatcher | None, media: tuple[Media, ...] = ()
                  ) -> Sequence | ErrorReply:
    """Build the request (its grammar, if any, already compiled, its media's embeddings
    fetched) and hand it to the engine; returns it, or the error that refuses it (nothing was
    added then)."""
    rid = msg.request_id
    try:
        seq = engine.make_sequence(
            engine_id, msg.input_ids, params, grammar=grammar, media=media, priority=msg.priority,
            cache_salt=msg.cache_salt, session_id=msg.session_id, retain_ttl_s=msg.retain_ttl_s,
        )
        engine.add(seq)
    except ContextTooLong as e:
        return ErrorReply(request_id=rid, code="context_too_long", message=str(e))
    except GrammarError as e:
        return ErrorReply(request_id=rid, code="invalid_grammar", message=str(e))
    except Overloaded as e:
        return ErrorReply(request_id=rid, code="overloaded", message=str(e))
    except ValueError as e:
        return ErrorReply(request_id=rid, code="invalid_request", message=str(e))
    return seq
