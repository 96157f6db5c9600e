"""Gateway <-> worker messages: round trips, the wire shape, and typed errors for bad input."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.protocol import (
    PROTOCOL_VERSION,
    Abort,
    ClientMsg,
    ErrorReply,
    Finished,
    Flush,
    Generate,
    GetLoad,
    Hello,
    LoadReport,
    ProtocolError,
    Replies,
    SamplingSpec,
    TokenDelta,
    Welcome,
    WorkerMsg,
    decode_client,
    decode_worker,
    decode_worker_items,
    encode,
)
from engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
_fast = settings(max_examples=60, deadline=None)


def _make_generate(**overrides: object) -> Generate:
    fields: dict[str, object] = {
        "request_id": "req-1",
        "input_ids": [1, 2, 3],
        "sampling": SamplingSpec(max_new_tokens=8, temperature=0.0, stop_token_ids=[7]),
        "session_id": "sess-1",
        "cache_salt": "tenant-a",
        "priority": 2,
        "retain_ttl_s": 30.0,
    }
    return Generate(**{**fields, **overrides})  # type: ignore[arg-type]


def _make_client_msgs() -> list[ClientMsg]:
    return [
        Hello(version=PROTOCOL_VERSION, client_id="gw-0"),
        _make_generate(),
        Generate(request_id="r", input_ids=[5], sampling=SamplingSpec()),
        Abort(request_id="req-1"),
        GetLoad(),
        Flush(),
    ]


def _make_worker_msgs() -> list[WorkerMsg]:
    return [
        Welcome(
            version=PROTOCOL_VERSION,
            worker_id="w-0",
            instance_id="9f1c",
            model="mimo",
            page_size=16,
            sliding_window=128,
            max_context=32768,
        ),
        Welcome(
            version=1, worker_id="w", instance_id="i", model="m", page_size=4,
            sliding_window=None, max_context=8,
        ),
        TokenDelta(request_id="req-1", token_ids=[9, 10], cached_tokens=16),
        TokenDelta(
            request_id="req-1",
            token_ids=[11],
            logprobs=[-0.25],
            top_logprobs=[[(11, -0.25), (12, -1.5)]],
        ),
        Finished(
            request_id="req-1",
            finish_reason="length",
            prompt_tokens=3,
            completion_tokens=8,
            cached_tokens=16,
            cached_tokens_device=8,
            cached_tokens_host=4,
            cached_tokens_storage=4,
        ),
        ErrorReply(request_id=None, code="bad_message", message="undecodable"),
        ErrorReply(request_id="req-2", code="context_too_long", message="40000 > 32768"),
        LoadReport(
            worker_id="w-0",
            num_running=3,
            num_waiting=1,
            free_full_pages=100,
            free_swa_pages=800,
            used_bytes=1 << 30,
            total_bytes=1 << 34,
            cached_pages=42,
        ),
        Replies(items=[
            TokenDelta(request_id="a", token_ids=[1]),
            Finished(request_id="b", finish_reason="stop", prompt_tokens=2, completion_tokens=1,
                     cached_tokens=0),
            ErrorReply(request_id="c", code="invalid_request", message="bad"),
        ]),
    ]


def _assert_protocol_error(data: bytes, *fragments: str, worker: bool = False) -> None:
    decode = decode_worker if worker else decode_client
    with pytest.raises(ProtocolError) as info:
        decode(data)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


@pytest.mark.parametrize("msg", _make_client_msgs(), ids=lambda m: type(m).__name__)
def test_client_messages_round_trip(msg: ClientMsg) -> None:
    assert decode_client(encode(msg)) == msg


@pytest.mark.parametrize("msg", _make_worker_msgs(), ids=lambda m: type(m).__name__)
def test_worker_messages_round_trip(msg: WorkerMsg) -> None:
    assert decode_worker(encode(msg)) == msg


_sampling_specs = st.builds(
    SamplingSpec,
    max_new_tokens=st.integers(min_value=1, max_value=2**20),
    temperature=st.floats(min_value=0, max_value=4),
    top_p=st.floats(min_value=0, max_value=1),
    top_k=st.none() | st.integers(min_value=1, max_value=1000),
    min_p=st.floats(min_value=0, max_value=1),
    seed=st.none() | st.integers(min_value=0, max_value=2**63 - 1),
    stop_token_ids=st.lists(st.integers(min_value=0, max_value=2**31)),
    ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(min_value=0, max_value=20),
)


@_fast
@given(
    st.builds(
        Generate,
        request_id=st.text(),
        input_ids=st.lists(st.integers(min_value=0, max_value=2**31), max_size=64),
        sampling=_sampling_specs,
        session_id=st.none() | st.text(),
        cache_salt=st.none() | st.text(),
        priority=st.integers(min_value=-(2**31), max_value=2**31),
        retain_ttl_s=st.none() | st.floats(min_value=0, max_value=1e6),
    )
)
def test_generate_round_trips(msg: Generate) -> None:
    assert decode_client(encode(msg)) == msg


def test_messages_are_maps_tagged_under_type() -> None:
    raw = msgspec.msgpack.decode(encode(Abort(request_id="r")))
    assert raw == {"type": "abort", "request_id": "r"}
    tags = {msgspec.msgpack.decode(encode(m))["type"] for m in _make_client_msgs()}
    assert tags == {"hello", "generate", "abort", "get_load", "flush"}


def test_each_direction_rejects_the_other_directions_messages() -> None:
    for msg in _make_worker_msgs():
        _assert_protocol_error(encode(msg), "invalid client message", "$.type")
    for msg in _make_client_msgs():
        _assert_protocol_error(encode(msg), "invalid worker message", "$.type", worker=True)


def test_unknown_tag_is_a_protocol_error_naming_it() -> None:
    _assert_protocol_error(msgspec.msgpack.encode({"type": "launch", "x": 1}), "'launch'")


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x92\x01", b"not msgpack at all"], ids=repr)
def test_garbage_bytes_are_a_protocol_error(data: bytes) -> None:
    _assert_protocol_error(data)
    _assert_protocol_error(data, worker=True)


@_fast
@given(st.binary(max_size=64))
def test_decoding_raises_nothing_but_protocol_error(data: bytes) -> None:
    for decode in (decode_client, decode_worker):
        with contextlib.suppress(ProtocolError):
            decode(data)


def test_missing_field_is_a_protocol_error_naming_the_field() -> None:
    generate = msgspec.msgpack.decode(encode(_make_generate()))
    del generate["input_ids"]
    _assert_protocol_error(msgspec.msgpack.encode(generate), "input_ids")


def test_mistyped_field_is_a_protocol_error_naming_its_path() -> None:
    generate = msgspec.msgpack.decode(encode(_make_generate()))
    generate["sampling"]["top_k"] = "ten"
    _assert_protocol_error(msgspec.msgpack.encode(generate), "$.sampling.top_k")


def test_unknown_error_code_and_finish_reason_are_protocol_errors() -> None:
    error = {"type": "error", "request_id": None, "code": "oops", "message": ""}
    _assert_protocol_error(msgspec.msgpack.encode(error), "$.code", worker=True)
    finished = msgspec.msgpack.decode(encode(_make_worker_msgs()[4]))
    finished["finish_reason"] = "timeout"
    _assert_protocol_error(msgspec.msgpack.encode(finished), "$.finish_reason", worker=True)


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    raw = {"type": "abort", "request_id": "r", "added_in_v2": [1, 2]}
    assert decode_client(msgspec.msgpack.encode(raw)) == Abort(request_id="r")


def test_protocol_error_is_a_value_error() -> None:
    assert issubclass(ProtocolError, ValueError)


def test_sampling_spec_defaults_mirror_sampling_params() -> None:
    spec_defaults = {f: getattr(SamplingSpec(), f) for f in SamplingSpec.__struct_fields__}
    params = SamplingParams()
    param_defaults = {f.name: getattr(params, f.name) for f in dataclasses.fields(SamplingParams)}
    assert spec_defaults.keys() == param_defaults.keys()
    assert SamplingSpec().to_params() == params


def test_to_params_carries_every_field() -> None:
    spec = SamplingSpec(
        max_new_tokens=5,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=123,
        stop_token_ids=[2, 3],
        ignore_eos=True,
        logprobs=4,
    )
    expected = SamplingParams(
        max_new_tokens=5,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=123,
        stop_token_ids=(2, 3),
        ignore_eos=True,
        logprobs=4,
    )
    assert spec.to_params() == expected


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 0),
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", 0),
        ("min_p", 1.5),
        ("seed", -1),
        ("stop_token_ids", [-3]),
        ("logprobs", 21),
    ],
)
def test_to_params_validation_errors_propagate(field: str, value: object) -> None:
    spec = SamplingSpec(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        spec.to_params()


def test_wire_modules_do_not_import_torch() -> None:
    code = (
        "import sys, engine.protocol, engine.worker.events, engine.hashing; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_replies_unpack_in_order_and_other_messages_come_alone() -> None:
    items = [TokenDelta(request_id="a", token_ids=[1]), TokenDelta(request_id="b", token_ids=[2]),
             Finished(request_id="a", finish_reason="length", prompt_tokens=1,
                      completion_tokens=1, cached_tokens=0)]
    assert decode_worker_items(encode(Replies(items=items))) == items
    assert decode_worker_items(encode(items[0])) == [items[0]]
    with pytest.raises(ProtocolError, match="items"):
        decode_worker(encode(Replies(items=[])).replace(b"items", b"itemz"))
