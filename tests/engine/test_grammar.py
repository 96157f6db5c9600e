"""Grammar-constrained decoding (``engine.grammar``) on the real engine with a tiny random model and
the demo byte-level tokenizer: outputs always match their JSON schema (greedy and sampled, native
and sim, through preemption), unconstrained neighbours in a batch are untouched, a bad grammar
fails only its own request, and masked logprobs."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.grammar import GrammarCompiler, GrammarError, check_grammar
from engine.kv.layout import KVLayout
from engine.model_config import ModelConfig
from engine.models.checkpoint import DEMO_CONFIG, mimo_config, write_random_checkpoint
from engine.protocol import (
    ErrorReply,
    Finished,
    Generate,
    SamplingSpec,
    TokenDelta,
    decode_worker_items,
    encode,
)
from engine.sampling_params import StructuredSpec
from gateway.tokenizer import write_demo_tokenizer
from tests.engine.worker_harness import worker_thread

EOS = (258, 256)  # <|im_end|>, <|endoftext|> in the demo tokenizer
VOCAB = 320
PAGE = 4
PROMPT = [72, 105, 33, 10, 259, 1]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["a", "bc", "def"]},
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
               "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tag", "xs"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("grammar-model")
    config = mimo_config(layers="FSSF", sliding_window=4, eos_token_id=list(EOS))
    write_random_checkpoint(out, config)
    write_demo_tokenizer(out)  # tokenizer.json + generation_config.json (EOS 258, 256)
    return out


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE)


def _json_spec(schema: dict[str, Any]) -> StructuredSpec:
    return StructuredSpec(json_schema=json.dumps(schema))


def _params(schema: dict[str, Any] | None, *, seed: int | None = None, temperature: float = 1.0,
            max_new_tokens: int = 120, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                          structured=None if schema is None else _json_spec(schema), **kwargs)


def _text(token_ids: tuple[int, ...] | list[int]) -> str:
    """The demo tokenizer's bytes: ids < 256 are bytes; the EOS at the end is dropped."""
    ids = list(token_ids)
    if ids and ids[-1] in EOS:
        ids.pop()
    assert all(t < 256 for t in ids), f"a special token inside JSON output: {ids}"
    return bytes(ids).decode("utf-8")


def _validate(value: Any, schema: dict[str, Any], path: str = "$") -> None:
    """The subset of JSON Schema these tests use; the failure names the path."""
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
        return
    kind = schema.get("type")
    checks = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), f"{path}: {value!r}"
        assert schema.get("minimum", -math.inf) <= value <= schema.get("maximum", math.inf), path
    elif kind in checks:
        assert isinstance(value, checks[kind]), f"{path}: {value!r} is not a {kind}"
    if kind == "string":
        assert len(value) <= schema.get("maxLength", math.inf), f"{path}: {value!r} too long"
    if kind == "array":
        assert len(value) <= schema.get("maxItems", math.inf), f"{path}: {value!r} too long"
        for i, item in enumerate(value):
            _validate(item, schema.get("items", {}), f"{path}[{i}]")
    if kind == "object":
        props = schema.get("properties", {})
        missing = set(schema.get("required", ())) - value.keys()
        assert not missing, f"{path}: missing {missing} in {value!r}"
        if schema.get("additionalProperties") is False:
            assert value.keys() <= props.keys(), f"{path}: extra keys in {value!r}"
        for key, item in value.items():
            _validate(item, props.get(key, {}), f"{path}.{key}")


def _assert_valid(token_ids: tuple[int, ...], finish_reason: str, schema: dict[str, Any]) -> None:
    assert finish_reason == "stop", f"finish_reason={finish_reason!r}: {token_ids}"
    assert token_ids[-1] in EOS, f"a complete grammar forces EOS: {token_ids}"
    text = _text(token_ids)
    _validate(json.loads(text), schema)
    # NOTE: json.dumps's layout (engine.grammar.JSON_FORMAT), as the chat template writes JSON;
    # the integer -0 is valid JSON that json.dumps spells 0
    assert re.sub(r"-0(?=[,}\]])", "0", text) == json.dumps(json.loads(text), ensure_ascii=False)


# -- validity ----------------------------------------------------------------------------------


def test_greedy_and_sampled_outputs_match_the_schema(llm: LLM) -> None:
    params = [_params(PERSON, temperature=0.0)] + [_params(PERSON, seed=s) for s in range(6)]
    for out in llm.generate([PROMPT] * len(params), params):
        _assert_valid(out.token_ids, out.finish_reason, PERSON)


def test_any_json_object_and_ignore_eos_still_stop_when_the_grammar_ends(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"],
              "additionalProperties": False}
    outs = llm.generate([PROMPT] * 2, [_params(schema, seed=1, ignore_eos=True),
                                       _params(schema, temperature=0.0, ignore_eos=True)])
    for out in outs:
        _assert_valid(out.token_ids, out.finish_reason, schema)


def test_lark_grammar_with_special_tokens(llm: LLM) -> None:
    lark = 'start: <tool_call> "\\n" ("yes" | "no") "\\n" </tool_call>'
    params = SamplingParams(max_new_tokens=20, seed=3, structured=StructuredSpec(lark=lark))
    [out] = llm.generate([PROMPT], params)
    assert out.finish_reason == "stop", out
    body = list(out.token_ids[1:-2])
    assert out.token_ids[0] == 259 and out.token_ids[-2] == 260, out.token_ids
    assert bytes(body) in (b"\nyes\n", b"\nno\n"), body


def _small_schemas() -> st.SearchStrategy[dict[str, Any]]:
    leaf = st.one_of(
        st.builds(lambda lo, n: {"type": "integer", "minimum": lo, "maximum": lo + n},
                  st.integers(-50, 50), st.integers(0, 200)),
        st.just({"type": "boolean"}),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 4)),
        st.lists(st.text("abc", min_size=1, max_size=3), min_size=1, max_size=3, unique=True)
        .map(lambda xs: {"enum": xs}),
    )
    return st.dictionaries(st.text("xyz", min_size=1, max_size=2), leaf, min_size=1,
                           max_size=3).map(lambda props: {
                               "type": "object", "properties": props,
                               "required": sorted(props), "additionalProperties": False})


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_small_schemas(), seed=st.integers(0, 2**31))
def test_random_small_schemas_always_validate(llm: LLM, schema: dict[str, Any], seed: int) -> None:
    outs = llm.generate([PROMPT] * 2, [_params(schema, seed=seed), _params(schema, temperature=0)])
    for out in outs:
        _assert_valid(out.token_ids, out.finish_reason, schema)


def test_sim_backend_follows_the_grammar(model_dir: Path) -> None:
    engine = Engine(EngineConfig(model_path=str(model_dir), backend="sim", page_size=PAGE))
    seqs = [engine.make_sequence(f"sim-{i}", PROMPT, _params(PERSON, max_new_tokens=200))
            for i in range(4)]
    for seq in seqs:
        engine.add(seq)
    _run(engine)
    for seq in seqs:
        _assert_valid(tuple(seq.output_ids), seq.finish_reason or "", PERSON)


# -- batches, preemption, logprobs -------------------------------------------------------------


def test_unconstrained_rows_are_identical_with_constrained_neighbours(llm: LLM) -> None:
    free = [_params(None, seed=11, max_new_tokens=30, logprobs=2),
            _params(None, temperature=0.0, max_new_tokens=30, logprobs=2)]
    prompts = [PROMPT, PROMPT[:3]]
    alone = llm.generate(prompts, free)
    mixed = llm.generate([PROMPT, *prompts, PROMPT],
                         [_params(PERSON, seed=5), *free, _params(PERSON, temperature=0.0)])
    for ref, out in zip(alone, mixed[1:3]):
        assert out.token_ids == ref.token_ids, "a grammar in the batch changed another row"
        # NOTE: the forward itself may differ in the last bits with the batch's shape
        assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-5), "masking leaked"
        assert out.top_logprobs is not None and ref.top_logprobs is not None
        for top, ref_top in zip(out.top_logprobs, ref.top_logprobs):
            assert [t for t, _ in top] == [t for t, _ in ref_top]
            assert [v for _, v in top] == pytest.approx([v for _, v in ref_top], abs=1e-5)
    for out in (mixed[0], mixed[3]):
        _assert_valid(out.token_ids, out.finish_reason, PERSON)


def test_logprobs_are_those_of_the_masked_distribution(llm: LLM) -> None:
    [out] = llm.generate([PROMPT], _params({"type": "object"}, seed=2, logprobs=5))
    # the first token can only be "{": probability 1 under the mask, and no other alternative
    assert out.token_ids[0] == ord("{") and out.logprobs is not None and out.top_logprobs
    assert out.logprobs[0] == 0.0, out.logprobs[0]
    assert out.top_logprobs[0] == ((ord("{"), 0.0),), out.top_logprobs[0]
    assert all(math.isfinite(v) for top in out.top_logprobs for _, v in top)


def test_preempted_constrained_requests_resume_in_step(model_dir: Path) -> None:
    # NOTE: 20 chunks hold the longest PERSON (~93 tokens) after the longest prompt alone, so
    # none fails for memory (finish_reason "error"), yet four at once force preemptions
    layout = KVLayout.from_model(ModelConfig.from_dir(model_dir), PAGE, 4)
    llm = LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE,
              kv_budget_bytes=layout.chunk_bytes * 20, max_num_batched_tokens=16)
    params = [_params(PERSON, seed=s, max_new_tokens=150) for s in range(4)]
    outs = llm.generate([PROMPT + [i] * 5 * i for i in range(4)], params)
    assert llm.engine.scheduler.num_preemptions > 0, "the budget never forced a preemption"
    for out in outs:
        _assert_valid(out.token_ids, out.finish_reason, PERSON)


# -- errors and caching ------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [
    StructuredSpec(json_schema='{"type": "object", "if": {}}'),  # unimplemented keyword
    StructuredSpec(json_schema='{"type": "wat"}'),
    StructuredSpec(json_schema="not json"),
    StructuredSpec(lark="start: undefined_rule"),
    StructuredSpec(lark="start: <no_such_special>"),  # only the engine's tokenizer knows
])
def test_bad_grammar_raises_grammar_error_and_others_still_run(
    llm: LLM, spec: StructuredSpec
) -> None:
    with pytest.raises(GrammarError):
        llm.engine.make_sequence("bad", PROMPT, SamplingParams(structured=spec))
    [out] = llm.generate([PROMPT], _params(PERSON, seed=1))
    _assert_valid(out.token_ids, out.finish_reason, PERSON)


def test_check_grammar_without_tokenizer() -> None:
    check_grammar(_json_spec(PERSON))
    with pytest.raises(GrammarError, match="if"):
        check_grammar(StructuredSpec(json_schema='{"type": "object", "if": {}}'))
    with pytest.raises(GrammarError, match="not usable"):  # an int llguidance cannot hold
        check_grammar(StructuredSpec(json_schema='{"maximum": 99999999999999999999999}'))
    with pytest.raises(GrammarError, match="not valid"):
        check_grammar(StructuredSpec(json_schema="{"))


@pytest.mark.parametrize("spec", [
    StructuredSpec(), StructuredSpec(json_schema="{}", lark="start: x"), StructuredSpec(lark=""),
])
def test_structured_spec_needs_exactly_one_grammar(spec: StructuredSpec) -> None:
    with pytest.raises(ValueError, match="structured"):
        SamplingParams(structured=spec)


def test_compiled_grammars_are_cached_lru_and_matchers_are_independent(model_dir: Path) -> None:
    compiler = GrammarCompiler(str(model_dir), VOCAB, EOS, max_cached=2)
    specs = [_json_spec({"type": "integer", "minimum": 0, "maximum": n}) for n in (1, 2, 3)]
    first, second = compiler.matcher(specs[0]), compiler.matcher(specs[0])
    first.accept(ord("1"))
    assert second.allowed(VOCAB)[ord("1")], "a copy shares state with another request's matcher"
    assert compiler.num_cached == 1
    for spec in specs:
        compiler.matcher(spec)
    assert compiler.num_cached == 2


def test_no_tokenizer_is_a_grammar_error() -> None:
    # the sim backend on the demo geometry, without a model directory (so without a tokenizer)
    engine = Engine(EngineConfig(backend="sim"), ModelConfig.from_dict(DEMO_CONFIG))
    with pytest.raises(GrammarError, match="tokenizer.json"):
        engine.make_sequence("r", PROMPT, _params(PERSON))


def test_worker_answers_invalid_grammar_to_that_request_only(model_dir: Path) -> None:
    with worker_thread(EngineConfig(model_path=str(model_dir), backend="sim")) as worker:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(worker.endpoints[0])
        try:
            good = SamplingSpec(max_new_tokens=200, structured=_json_spec(PERSON))
            bad = SamplingSpec(structured=StructuredSpec(lark="start: nope"))
            sock.send(encode(Generate(request_id="good", input_ids=PROMPT, sampling=good)))
            sock.send(encode(Generate(request_id="bad", input_ids=PROMPT, sampling=bad)))
            replies = _replies(sock, {"good", "bad"})
        finally:
            sock.close(linger=0)
    last = {rid: msgs[-1] for rid, msgs in replies.items()}
    assert isinstance(last["bad"], ErrorReply) and last["bad"].code == "invalid_grammar", last
    assert len(replies["bad"]) == 1, replies["bad"]
    assert isinstance(last["good"], Finished) and last["good"].finish_reason == "stop", last
    ids = [t for m in replies["good"] if isinstance(m, TokenDelta) for t in m.token_ids]
    _assert_valid(tuple(ids), "stop", PERSON)


# -- helpers -----------------------------------------------------------------------------------


def _run(engine: Engine, max_steps: int = 5000) -> None:
    for _ in range(max_steps):
        if not engine.has_work:
            return
        engine.step()
    pytest.fail(f"not done after {max_steps} steps")


def _replies(sock: zmq.Socket[bytes], pending: set[str]) -> dict[str, list[Any]]:
    replies: dict[str, list[Any]] = {rid: [] for rid in pending}
    pending = set(pending)
    while pending:
        assert sock.poll(10_000), f"no reply for {pending} within 10 s"
        for msg in decode_worker_items(sock.recv()):
            rid = getattr(msg, "request_id", None)
            if rid in replies:
                replies[rid].append(msg)
                if isinstance(msg, Finished | ErrorReply):
                    pending.discard(rid)
    return replies
