"""engine.sglang_backend.mapping against SGLang's wire format (sglang 0.5.23), by golden vectors.

Each golden was derived by hand from the SGLang source named in the comment above its group,
not produced by the code under test; the request goldens are compared as the stdlib JSON
encoder writes the kwargs (sorted keys, no spaces), the output goldens are SGLang's streamed
dicts written as JSON (tuples as lists, as they are on SGLang's HTTP wire).
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

import pytest

from encoders.protocol import EmbeddingKey
from engine.protocol import (
    ErrorReply,
    Finished,
    Generate,
    MediaSpan,
    SamplingSpec,
    TokenDelta,
)
from engine.sampling_params import StructuredSpec
from engine.sglang_backend.mapping import (
    CacheHit,
    OutputMapper,
    Refused,
    cache_hit,
    generate_kwargs,
    parse_sglang_args,
    unsupported_hints,
)

VOCAB = 1000
REQ = "q1"


def _make_generate(sampling: dict[str, Any] | None = None, **fields: Any) -> Generate:
    fields.setdefault("input_ids", [1, 2, 3])
    return Generate(request_id=REQ, sampling=SamplingSpec(**(sampling or {})), **fields)


def _kwargs_json(msg: Generate, *, supports_cache_salt: bool = True,
                 vocab_size: int | None = VOCAB) -> str:
    kwargs = generate_kwargs(msg, rid="r1", supports_cache_salt=supports_cache_salt,
                             vocab_size=vocab_size)
    return json.dumps(kwargs, sort_keys=True, separators=(",", ":"))


def _make_mapper(*, logprobs: int | None = None, incremental: bool = True) -> OutputMapper:
    return OutputMapper(REQ, prompt_tokens=3, logprobs=logprobs, incremental=incremental)


def _assert_replies(got: list[Any], want: list[Any], step: str) -> None:
    assert got == want, f"{step}:\n got  {got}\n want {want}"


# --- generate_kwargs -------------------------------------------------------------------------
# sglang 0.5.23: entrypoints/engine.py Engine.async_generate (keyword names);
# sampling/sampling_params.py SamplingParams (sampling_params keys and defaults: max_new_tokens
# 128, temperature 1.0, top_p 1.0, top_k TOP_K_ALL, min_p 0.0, repetition_penalty 1.0,
# ignore_eos False; logit_bias {str(token_id): bias}; sampling_seed; json_schema; ebnf);
# managers/io_struct.py GenerateReqInput (logprob_start_len -1: output logprobs only).

_HEAD = '{"input_ids":[1,2,3],"priority":0,"rid":"r1","sampling_params":'

KWARGS_GOLDEN = [
    ("defaults",
     {}, {},
     _HEAD + '{"max_new_tokens":16},"stream":true}'),
    ("greedy",
     {"max_new_tokens": 8, "temperature": 0.0}, {},
     _HEAD + '{"max_new_tokens":8,"temperature":0.0},"stream":true}'),
    # NOTE: agentgate is greedy below 1e-5, SGLang below 1e-6: 5e-6 must reach SGLang as 0
    ("greedy below agentgate's threshold",
     {"temperature": 5e-6}, {},
     _HEAD + '{"max_new_tokens":16,"temperature":0.0},"stream":true}'),
    ("seeded sampling",
     {"temperature": 0.7, "top_p": 0.9, "seed": 1234}, {},
     _HEAD + '{"max_new_tokens":16,"sampling_seed":1234,"temperature":0.7,"top_p":0.9},'
     '"stream":true}'),
    ("top_k",
     {"top_k": 40}, {},
     _HEAD + '{"max_new_tokens":16,"top_k":40},"stream":true}'),
    ("min_p",
     {"min_p": 0.05}, {},
     _HEAD + '{"max_new_tokens":16,"min_p":0.05},"stream":true}'),
    ("repetition penalty",
     {"repetition_penalty": 1.3}, {},
     _HEAD + '{"max_new_tokens":16,"repetition_penalty":1.3},"stream":true}'),
    # NOTE: token 5 twice: the last bias wins (engine.sampler.apply_logit_bias does the same)
    ("logit_bias",
     {"logit_bias": [(5, -100.0), (7, 2.5), (5, 1.0)]}, {},
     _HEAD + '{"logit_bias":{"5":1.0,"7":2.5},"max_new_tokens":16},"stream":true}'),
    ("stop ids",
     {"stop_token_ids": [2, 9]}, {},
     _HEAD + '{"max_new_tokens":16,"stop_token_ids":[2,9]},"stream":true}'),
    ("ignore_eos",
     {"ignore_eos": True}, {},
     _HEAD + '{"ignore_eos":true,"max_new_tokens":16},"stream":true}'),
    ("logprobs 0",
     {"logprobs": 0}, {},
     '{"input_ids":[1,2,3],"logprob_start_len":-1,"priority":0,"return_logprob":true,"rid":"r1",'
     '"sampling_params":{"max_new_tokens":16},"stream":true}'),
    ("logprobs 3",
     {"logprobs": 3}, {},
     '{"input_ids":[1,2,3],"logprob_start_len":-1,"priority":0,"return_logprob":true,"rid":"r1",'
     '"sampling_params":{"max_new_tokens":16},"stream":true,"top_logprobs_num":3}'),
    ("json_schema",
     {"structured": StructuredSpec(json_schema='{"type": "object"}')}, {},
     _HEAD + r'{"json_schema":"{\"type\": \"object\"}","max_new_tokens":16},"stream":true}'),
    # NOTE: constrained/llguidance_backend.py dispatch_ebnf: grammar_from("ebnf", text) is Lark
    ("lark",
     {"structured": StructuredSpec(lark='start: "yes" | "no"')}, {},
     _HEAD + r'{"ebnf":"start: \"yes\" | \"no\"","max_new_tokens":16},"stream":true}'),
    ("priority",
     {}, {"priority": 5},
     '{"input_ids":[1,2,3],"priority":5,"rid":"r1","sampling_params":{"max_new_tokens":16},'
     '"stream":true}'),
    ("salt",
     {}, {"cache_salt": "tenant-a"},
     '{"cache_salt":"tenant-a","input_ids":[1,2,3],"priority":0,"rid":"r1",'
     '"sampling_params":{"max_new_tokens":16},"stream":true}'),
    # NOTE: SGLang's session_id is its own session feature; retention is the worker's to count
    ("hints not passed",
     {}, {"session_id": "s1", "retain_ttl_s": 30.0, "stream_interval_s": 0.5},
     _HEAD + '{"max_new_tokens":16},"stream":true}'),
]


@pytest.mark.parametrize(("sampling", "fields", "golden"),
                         [case[1:] for case in KWARGS_GOLDEN],
                         ids=[case[0] for case in KWARGS_GOLDEN])
def test_generate_kwargs_golden(sampling: dict[str, Any], fields: dict[str, Any],
                                golden: str) -> None:
    assert _kwargs_json(_make_generate(sampling, **fields)) == golden


def test_generate_kwargs_empty_salt_is_no_salt_even_when_unsupported() -> None:
    # NOTE: "" and None are one namespace in engine.hashing.salt_seed and in SGLang
    # (io_struct.py _normalize_single_inputs: cache_salt "" -> None)
    msg = _make_generate(cache_salt="")
    assert _kwargs_json(msg, supports_cache_salt=False) == \
        _HEAD + '{"max_new_tokens":16},"stream":true}'


def test_generate_kwargs_without_vocab_size_checks_only_the_lower_bound() -> None:
    msg = _make_generate(input_ids=[999_999])
    assert json.loads(_kwargs_json(msg, vocab_size=None))["input_ids"] == [999_999]
    with pytest.raises(Refused, match="input_ids"):
        _kwargs_json(_make_generate(input_ids=[-1]), vocab_size=None)


_MEDIA = [MediaSpan(offset=0, length=2, key=EmbeddingKey(
    content_hash="ab" * 32, preprocess_id="p", tower_fingerprint="t"))]

REFUSED = [
    ("salt unsupported", {}, {"cache_salt": "tenant-a"}, False,
     "no per-request cache isolation key"),
    ("media", {}, {"media": _MEDIA}, True, "images are not supported by the sglang backend"),
    ("empty prompt", {}, {"input_ids": []}, True, "input_ids"),
    ("id past the vocabulary", {}, {"input_ids": [1, VOCAB]}, True, "input_ids"),
    ("negative id", {}, {"input_ids": [-3]}, True, "input_ids"),
    ("top_p 0", {"top_p": 0.0}, {}, True, "top_p"),
    ("negative temperature", {"temperature": -1.0}, {}, True, "temperature"),
    ("max_new_tokens 0", {"max_new_tokens": 0}, {}, True, "max_new_tokens"),
    ("top_k 0", {"top_k": 0}, {}, True, "top_k"),
    ("logprobs 21", {"logprobs": 21}, {}, True, "logprobs"),
    ("seed negative", {"seed": -1}, {}, True, "seed"),
    # NOTE: sampling_params.py verify: repetition_penalty in (0, 2]; agentgate allows more
    ("repetition_penalty over SGLang's 2", {"repetition_penalty": 2.5}, {}, True,
     "repetition_penalty"),
    # NOTE: sampling_params.py verify: logit_bias keys in [0, vocab_size)
    ("logit_bias id past the vocabulary", {"logit_bias": [(VOCAB, 1.0)]}, {}, True,
     "logit_bias"),
    ("two grammars", {"structured": StructuredSpec(json_schema="{}", lark="start: x")}, {},
     True, "structured"),
    ("resumed grammar",
     {"structured": StructuredSpec(json_schema="{}"), "resumed_tokens": 2}, {}, True,
     "resumed_tokens"),
]


@pytest.mark.parametrize(("sampling", "fields", "salt_ok", "word"),
                         [case[1:] for case in REFUSED], ids=[case[0] for case in REFUSED])
def test_generate_kwargs_refuses(sampling: dict[str, Any], fields: dict[str, Any],
                                 salt_ok: bool, word: str) -> None:
    with pytest.raises(Refused) as info:
        _kwargs_json(_make_generate(sampling, **fields), supports_cache_salt=salt_ok)
    assert info.value.code == "invalid_request"
    assert word in info.value.message, info.value.message


def test_resumed_without_grammar_is_served() -> None:
    msg = _make_generate({"resumed_tokens": 2, "seed": 7})
    assert _kwargs_json(msg) == \
        _HEAD + '{"max_new_tokens":16,"sampling_seed":7},"stream":true}'


@pytest.mark.parametrize(("fields", "hints"), [
    ({}, []),
    ({"retain_ttl_s": 30.0}, ["retain_ttl_s"]),
    ({"retain_ttl_s": 0.0}, ["retain_ttl_s"]),
    ({"session_id": "s1", "stream_interval_s": 1.0}, []),
])
def test_unsupported_hints(fields: dict[str, Any], hints: list[str]) -> None:
    assert unsupported_hints(_make_generate(**fields)) == hints


# --- OutputMapper ----------------------------------------------------------------------------
# sglang 0.5.23 managers/tokenizer_manager.py _handle_batch_output (BatchTokenIDOutput branch):
# {"output_ids": [...], "meta_info": {"id", "finish_reason", "prompt_tokens", "weight_version",
# "num_retractions", "reasoning_tokens", "completion_tokens", "cached_tokens"
# [, "cached_tokens_details"]}}; with incremental_streaming_output the ids and the
# output_*logprobs lists are the new part (_slice_streaming_output_meta_info), else cumulative.
# finish_reason: managers/schedule_batch.py FINISH_*.to_json.


def _out(text: str) -> dict[str, Any]:
    """An SGLang output dict from its JSON text (the meta_info keys every chunk carries are
    filled in when absent, as tokenizer_manager.py writes them)."""
    out: dict[str, Any] = json.loads(text)
    meta = out["meta_info"]
    for key, value in (("id", "r1"), ("finish_reason", None), ("prompt_tokens", 3),
                       ("weight_version", "default"), ("num_retractions", 0),
                       ("reasoning_tokens", 0), ("cached_tokens", 0)):
        meta.setdefault(key, value)
    return out


def _delta(ids: list[int], **kw: Any) -> TokenDelta:
    return TokenDelta(request_id=REQ, token_ids=ids, **kw)


def _finished(reason: str, completion: int, **kw: Any) -> Finished:
    return Finished(request_id=REQ, finish_reason=reason, prompt_tokens=kw.pop("prompt", 3),
                    completion_tokens=completion, **kw)


def test_incremental_stream_to_stop() -> None:
    mapper = _make_mapper()
    steps = [
        ('{"output_ids":[11],"meta_info":{"completion_tokens":1,"cached_tokens":2}}',
         [_delta([11], cached_tokens=2)]),
        ('{"output_ids":[12,13],"meta_info":{"completion_tokens":3,"cached_tokens":2}}',
         [_delta([12, 13])]),
        ('{"output_ids":[],"meta_info":{"completion_tokens":3,"cached_tokens":2}}', []),
        ('{"output_ids":[2],"meta_info":{"finish_reason":{"type":"stop","matched":2},'
         '"completion_tokens":4,"cached_tokens":2}}',
         [_delta([2]), _finished("stop", 4, cached_tokens=2, cached_tokens_device=2)]),
        ('{"output_ids":[5],"meta_info":{"completion_tokens":5}}', []),
    ]
    for i, (text, want) in enumerate(steps):
        _assert_replies(mapper.feed(_out(text)), want, f"step {i}")
    assert mapper.is_done and mapper.num_sent == 4


def test_cumulative_stream_copies_the_list_sglang_keeps_appending_to() -> None:
    # NOTE: tokenizer_manager.py: a non-incremental intermediate chunk is
    # {"output_ids": state.output_ids, ...}: the same list object, extended in place later
    mapper = _make_mapper(incremental=False)
    ids = [11]
    meta = {"id": "r1", "finish_reason": None, "prompt_tokens": 3, "completion_tokens": 1,
            "cached_tokens": 1}
    first = mapper.feed({"output_ids": ids, "meta_info": meta})
    ids.extend([12, 13])
    _assert_replies(first, [_delta([11], cached_tokens=1)], "first chunk, after SGLang appended")
    second = mapper.feed({"output_ids": ids, "meta_info": {"completion_tokens": 3}})
    _assert_replies(second, [_delta([12, 13])], "same list again")
    _assert_replies(mapper.feed({"output_ids": ids, "meta_info": {"completion_tokens": 3}}), [],
                    "same list, nothing new")
    last = _out('{"output_ids":[11,12,13,14],"meta_info":{"finish_reason":'
                '{"type":"length","length":4},"completion_tokens":4,"cached_tokens":1}}')
    _assert_replies(mapper.feed(last), [
        _delta([14]), _finished("length", 4, cached_tokens=1, cached_tokens_device=1)],
        "finish")


def test_cumulative_stream_without_completion_tokens_still_copies() -> None:
    # NOTE: completion_tokens is always there in 0.5.23; without it the copy must still be made
    mapper = _make_mapper(incremental=False)
    ids = [11]
    first = mapper.feed({"output_ids": ids, "meta_info": {"finish_reason": None}})
    ids.append(12)
    _assert_replies(first, [_delta([11])], "first chunk, after SGLang appended")
    _assert_replies(mapper.feed({"output_ids": ids, "meta_info": {}}), [_delta([12])], "second")


def test_incremental_logprobs_with_top_k() -> None:
    # NOTE: tokenizer_manager.py detokenize_logprob_tokens: (logprob, token_id, None) per token;
    # output_top_logprobs: one list of those per token (sliced to the chunk, like the ids)
    mapper = _make_mapper(logprobs=2)
    first = _out(
        '{"output_ids":[11],"meta_info":{"completion_tokens":1,"input_token_logprobs":[],'
        '"output_token_logprobs":[[-0.1,11,null]],"output_token_logprobs_length":1,'
        '"input_top_logprobs":[],'
        '"output_top_logprobs":[[[-0.1,11,null],[-2.5,7,null]]]}}')
    second = _out(
        '{"output_ids":[12,2],"meta_info":{"finish_reason":{"type":"stop","matched":2},'
        '"completion_tokens":3,"input_token_logprobs":[],'
        '"output_token_logprobs":[[-0.5,12,null],[-0.25,2,null]],'
        '"output_token_logprobs_length":3,"input_top_logprobs":[],'
        '"output_top_logprobs":[[[-0.5,12,null],[-1.0,4,null]],[[-0.25,2,null],[-3.0,9,null]]]}}')
    _assert_replies(mapper.feed(first), [
        _delta([11], logprobs=[-0.1], top_logprobs=[[(11, -0.1), (7, -2.5)]])], "first")
    _assert_replies(mapper.feed(second), [
        _delta([12, 2], logprobs=[-0.5, -0.25],
               top_logprobs=[[(12, -0.5), (4, -1.0)], [(2, -0.25), (9, -3.0)]]),
        _finished("stop", 3)], "second")


def test_cumulative_logprobs_are_sliced_past_what_was_sent() -> None:
    mapper = _make_mapper(logprobs=0, incremental=False)
    first = _out('{"output_ids":[11],"meta_info":{"completion_tokens":1,'
                 '"output_token_logprobs":[[-0.1,11,null]]}}')
    second = _out('{"output_ids":[11,12,13],"meta_info":{"completion_tokens":3,'
                  '"output_token_logprobs":[[-0.1,11,null],[-0.2,12,null],[-0.3,13,null]]}}')
    _assert_replies(mapper.feed(first), [_delta([11], logprobs=[-0.1])], "first")
    _assert_replies(mapper.feed(second), [_delta([12, 13], logprobs=[-0.2, -0.3])], "second")


def test_top_logprobs_sorted_highest_first_and_none_row_empty() -> None:
    # NOTE: detokenize_top_logprobs_tokens yields None for a position without values
    mapper = _make_mapper(logprobs=1)
    out = _out('{"output_ids":[11,12],"meta_info":{"completion_tokens":2,'
               '"output_token_logprobs":[[-0.7,11,null],[-0.2,12,null]],'
               '"output_top_logprobs":[[[-2.0,5,null],[-0.7,11,null]],null]}}')
    _assert_replies(mapper.feed(out), [
        _delta([11, 12], logprobs=[-0.7, -0.2], top_logprobs=[[(11, -0.7)], []])], "chunk")


def test_missing_logprobs_end_the_request_as_internal() -> None:
    mapper = _make_mapper(logprobs=0)
    out = _out('{"output_ids":[11,12],"meta_info":{"completion_tokens":2,'
               '"output_token_logprobs":[[-0.7,11,null]]}}')
    [reply] = mapper.feed(out)
    assert isinstance(reply, ErrorReply) and reply.code == "internal", reply
    assert mapper.feed(_out('{"output_ids":[13],"meta_info":{}}')) == []


# NOTE: scheduler_components/output_streamer.py get_cached_tokens_details:
# {"device", "host"} or with L3 {"device", "host", "storage", "storage_backend"}, or None
CACHE_GOLDEN = [
    ('{"cached_tokens":0}', CacheHit(0, 0, 0, 0)),
    ('{"cached_tokens":16}', CacheHit(16, 16, 0, 0)),
    ('{"cached_tokens":8,"cached_tokens_details":{"device":3,"host":5}}', CacheHit(8, 3, 5, 0)),
    ('{"cached_tokens":28,"cached_tokens_details":{"device":4,"host":8,"storage":16,'
     '"storage_backend":"HiCacheFile"}}', CacheHit(28, 4, 8, 16)),
    # NOTE: schedule_batch.py splits once at the first prefill chunk while cached_tokens grows
    # per chunk: the device takes the difference, so the tiers still sum to the total
    ('{"cached_tokens":40,"cached_tokens_details":{"device":16,"host":8}}', CacheHit(40, 32, 8, 0)),
    ('{"cached_tokens":10,"cached_tokens_details":{"device":0,"host":8,"storage":6}}',
     CacheHit(10, 0, 8, 2)),
    ('{"cached_tokens":5,"cached_tokens_details":null}', CacheHit(5, 5, 0, 0)),
]


@pytest.mark.parametrize(("meta", "want"), CACHE_GOLDEN)
def test_cache_hit_split(meta: str, want: CacheHit) -> None:
    assert cache_hit(json.loads(meta)) == want


def test_finished_carries_the_tier_split() -> None:
    mapper = _make_mapper()
    out = _out('{"output_ids":[11,2],"meta_info":{"finish_reason":{"type":"stop","matched":2},'
               '"prompt_tokens":40,"completion_tokens":2,"cached_tokens":28,'
               '"cached_tokens_details":{"device":4,"host":8,"storage":16,'
               '"storage_backend":"HiCacheFile"}}}')
    _assert_replies(mapper.feed(out), [
        _delta([11, 2], cached_tokens=28),
        _finished("stop", 2, prompt=40, cached_tokens=28, cached_tokens_device=4,
                  cached_tokens_host=8, cached_tokens_storage=16)], "one chunk")


def test_requested_abort_finishes_without_repeating_the_echoed_token() -> None:
    # NOTE: tokenizer_manager.py _handle_abort_req: the echo has no prompt_tokens or
    # cached_tokens, and in incremental mode repeats the last id ([output_ids[-1]])
    mapper = _make_mapper()
    mapper.feed(_out('{"output_ids":[11],"meta_info":{"completion_tokens":1,"cached_tokens":2}}'))
    mapper.mark_aborted()
    echo = json.loads('{"text":"","output_ids":[11],"meta_info":{"id":"r1","finish_reason":'
                      '{"type":"abort","message":"Abort in waiting queue"},'
                      '"weight_version":"default","e2e_latency":0.5,"completion_tokens":1}}')
    _assert_replies(mapper.feed(echo), [
        _finished("abort", 1, cached_tokens=2, cached_tokens_device=2)], "echo")


def test_requested_abort_keeps_tokens_sglang_had_queued() -> None:
    # NOTE: tokenizer_manager.py _coalesce_streaming_chunks: a queued delta and the echo arrive
    # as one dict, ids concatenated, meta_info of the echo
    mapper = _make_mapper()
    mapper.mark_aborted()
    echo = json.loads('{"text":"","output_ids":[11,12,12],"meta_info":{"id":"r1",'
                      '"finish_reason":{"type":"abort","message":"Aborted","status_code":null,'
                      '"err_type":null},"completion_tokens":2}}')
    _assert_replies(mapper.feed(echo), [_delta([11, 12]), _finished("abort", 2)], "coalesced")


def test_requested_abort_reports_our_prompt_length() -> None:
    # NOTE: schedule_batch.py Req.set_finish_with_abort (a request aborted while its grammar
    # compiles) replaces SGLang's prompt by one token, so its prompt_tokens reads 1
    mapper = _make_mapper()
    mapper.mark_aborted()
    out = _out('{"output_ids":[],"meta_info":{"finish_reason":{"type":"abort","message":'
               '"Aborted","status_code":null,"err_type":null},"prompt_tokens":1,'
               '"completion_tokens":0}}')
    _assert_replies(mapper.feed(out), [_finished("abort", 0)], "abort")


ENGINE_ABORTS = [
    # managers/utils.py validate_input_length, via Req.set_finish_with_abort (400)
    ('{"type":"abort","message":"Input length (40000 tokens) exceeds the maximum allowed length '
     '(32768 tokens). Use a shorter input or enable --allow-auto-truncate.","status_code":400,'
     '"err_type":"BadRequestError"}', "context_too_long"),
    # constrained/grammar_manager.py
    ('{"type":"abort","message":"Failed to compile json grammar: invalid schema",'
     '"status_code":400,"err_type":"BadRequestError"}', "invalid_grammar"),
    # scheduler.py (logprob_start_len past the prompt)
    ('{"type":"abort","message":"req.logprob_start_len=5 is higher than the number of input '
     'tokens len(req.origin_input_ids)=3. Please use a smaller logprob_start_len.",'
     '"status_code":400,"err_type":"BadRequestError"}', "invalid_request"),
    # scheduler.py _abort_on_queued_limit
    ('{"type":"abort","status_code":503,"message":"The request queue is full."}', "overloaded"),
    ('{"type":"abort","status_code":429,"message":"Too many requests"}', "overloaded"),
    ('{"type":"abort","message":"The request queue is full.","status_code":null}', "overloaded"),
    ('{"type":"abort","message":"Internal error: CUDA error","status_code":500,'
     '"err_type":"InternalServerError"}', "internal"),
    ('{"type":"abort","message":"Abort in waiting queue"}', "internal"),
]


@pytest.mark.parametrize(("finish", "code"), ENGINE_ABORTS)
@pytest.mark.parametrize("incremental", [True, False])
def test_engine_abort_is_an_error(finish: str, code: str, incremental: bool) -> None:
    mapper = _make_mapper(incremental=incremental)
    mapper.feed(_out('{"output_ids":[11],"meta_info":{"completion_tokens":1}}'))
    reason = json.loads(finish)
    out = _out('{"output_ids":[11,12],"meta_info":{"completion_tokens":2}}')
    out["meta_info"]["finish_reason"] = reason
    [reply] = mapper.feed(out)
    assert isinstance(reply, ErrorReply), reply
    assert (reply.request_id, reply.code) == (REQ, code), reply
    assert reason["message"] in reply.message, reply.message
    assert mapper.feed(_out('{"output_ids":[13],"meta_info":{}}')) == []


def test_engine_abort_with_http_status_member() -> None:
    # NOTE: in-process the status is an HTTPStatus (schedule_batch.py set_finish_with_abort)
    mapper = _make_mapper()
    out = {"output_ids": [], "meta_info": {"finish_reason": {
        "type": "abort", "message": "bad", "status_code": HTTPStatus.BAD_REQUEST,
        "err_type": "BadRequestError"}}}
    [reply] = mapper.feed(out)
    assert isinstance(reply, ErrorReply) and reply.code == "invalid_request", reply
    assert "(status 400)" in reply.message, reply.message


ERRORS = [
    # tokenizer_manager.py _validate_one_request
    (ValueError("The input (40000 tokens) is longer than the model's context length "
                "(32768 tokens)."), "context_too_long", "40000 tokens"),
    (ValueError("Requested token count exceeds the model's maximum context length of 32768 "
                "tokens. You requested a total of 33000 tokens"), "context_too_long", "33000"),
    # sampling_params.py verify
    (ValueError("logit_bias must has keys in [0, 999], got 1000."), "invalid_request",
     "logit_bias"),
    (RuntimeError("boom"), "internal", "RuntimeError"),
    (KeyError("r1"), "internal", "KeyError"),
]


@pytest.mark.parametrize(("exc", "code", "word"), ERRORS)
def test_error_from_async_generate(exc: BaseException, code: str, word: str) -> None:
    mapper = _make_mapper()
    reply = mapper.error(exc)
    assert reply.request_id == REQ and reply.code == code, reply
    assert word in reply.message, reply.message
    assert mapper.feed(_out('{"output_ids":[11],"meta_info":{"completion_tokens":1}}')) == []


# --- parse_sglang_args -----------------------------------------------------------------------

ARGS = [
    ([], {}),
    (["tp-size=2"], {"tp_size": 2}),
    (["--tp-size=4"], {"tp_size": 4}),
    (["mem_fraction_static=0.85"], {"mem_fraction_static": 0.85}),
    (["enable-deterministic-inference=true"], {"enable_deterministic_inference": True}),
    (["grammar_backend=llguidance"], {"grammar_backend": "llguidance"}),
    (['json-model-override-args={"rope_scaling": null}'],
     {"json_model_override_args": {"rope_scaling": None}}),
    (["revision=1234"], {"revision": 1234}),
    (['revision="1234"'], {"revision": "1234"}),
    (["chat_template="], {"chat_template": ""}),
    (["model_path=/m/a=b"], {"model_path": "/m/a=b"}),
    (["tp_size=1", "tp_size=2"], {"tp_size": 2}),
    (["a=1", "b=[1, 2]"], {"a": 1, "b": [1, 2]}),
]


@pytest.mark.parametrize(("pairs", "want"), ARGS)
def test_parse_sglang_args(pairs: list[str], want: dict[str, Any]) -> None:
    assert parse_sglang_args(pairs) == want


@pytest.mark.parametrize("bad", ["tp_size", "=3", "--=3", " =x"])
def test_parse_sglang_args_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="KEY=VALUE") as info:
        parse_sglang_args(["ok=1", bad])
    assert repr(bad) in str(info.value)
