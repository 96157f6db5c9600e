"""The keys file (``gateway.api_keys``): what it accepts, what it refuses and how it says so
(never echoing a key), and the tenants' limiter: its buckets and slots under any schedule
(hypothesis, on a clock the test moves)."""

import hashlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api_keys import (
    ApiKeysError,
    Tenant,
    TenantLimiter,
    load_api_keys,
    parse_api_keys,
)

KEY_A, KEY_B = "sk-acme-0123456789abcdef", "sk-beta-fedcba9876543210"


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return path


def test_a_file_maps_keys_and_digests_to_tenants(tmp_path: Path) -> None:
    digest_b = hashlib.sha256(KEY_B.encode()).hexdigest()
    keys = load_api_keys(_file(tmp_path, f"""
[tenants.acme]
keys = ["{KEY_A}"]
weight = 2
requests_per_minute = 60
tokens_per_minute = 1000
max_concurrent = 4

[tenants.beta]
keys = ["sha256:{digest_b}"]
"""))
    assert keys.tenant_of_key(KEY_A) == Tenant("acme", 2.0, 60.0, 1000.0, 4)
    assert keys.tenant_of_key(KEY_B) == Tenant("beta")  # NOTE: by its digest alone
    assert keys.tenant_of_key(KEY_A + "x") is None
    assert keys.tenant_of_key(KEY_A[:-1]) is None
    assert keys.tenant_of_key("") is None
    assert KEY_A not in repr(keys)  # NOTE: nor its digest: the repr hides the map


@pytest.mark.parametrize(("table", "says"), [
    ({}, "at least one tenant"),
    ({"tenants": {"acme": {"keys": [KEY_A]}}, "extra": 1}, "nothing else"),
    ({"tenants": {"anonymous": {"keys": [KEY_A]}}}, "tenant name"),
    ({"tenants": {"a b": {"keys": [KEY_A]}}}, "tenant name"),
    ({"tenants": {"acme": {"keys": []}}}, "non-empty list"),
    ({"tenants": {"acme": {"keys": [KEY_A], "rpm": 3}}}, "unknown fields ['rpm']"),
    ({"tenants": {"acme": {"keys": ["short-key"]}}}, "at least 16 characters"),
    ({"tenants": {"acme": {"keys": [KEY_A + " "]}}}, "no whitespace"),
    ({"tenants": {"acme": {"keys": ["sha256:abc"]}}}, "64 hex digits"),
    ({"tenants": {"acme": {"keys": [KEY_A], "weight": 0}}}, "weight must be a number > 0"),
    ({"tenants": {"acme": {"keys": [KEY_A], "max_concurrent": 1.5}}}, "integer >= 1"),
    ({"tenants": {"acme": {"keys": [KEY_A], "tokens_per_minute": True}}}, "> 0"),
    ({"tenants": {"acme": {"keys": [KEY_A]}, "beta": {"keys": [KEY_A]}}},
     "also a key of tenant 'acme'"),
])
def test_a_bad_file_says_where_and_never_echoes_a_key(table: dict[str, Any], says: str) -> None:
    with pytest.raises(ApiKeysError) as caught:
        parse_api_keys(table, "keys.toml")
    message = str(caught.value)
    assert says in message and "keys.toml" in message, message
    assert KEY_A not in message and "short-key" not in message, message


def test_an_unreadable_or_broken_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ApiKeysError, match="cannot read it"):
        load_api_keys(tmp_path / "missing.toml")
    with pytest.raises(ApiKeysError, match="not TOML"):
        load_api_keys(_file(tmp_path, f'[tenants.acme]\nkeys = ["{KEY_A}"'))


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


_STEP = st.one_of(
    st.tuples(st.just("acquire"), st.floats(0, 5)),
    st.tuples(st.just("release"), st.floats(0, 5)),
    st.tuples(st.just("charge"), st.integers(0, 3000)),
)


@settings(max_examples=200, deadline=None)
@given(rpm=st.integers(1, 120), tpm=st.integers(100, 5000), slots=st.integers(1, 4),
       steps=st.lists(_STEP, max_size=80))
def test_the_limiter_never_grants_more_than_the_limits(rpm: int, tpm: int, slots: int,
                                                       steps: list[tuple[str, float]]) -> None:
    clock = _Clock()
    limiter = TenantLimiter([Tenant("t", 1.0, rpm, tpm, slots)], clock)
    held = granted = 0
    for op, arg in steps:
        if op == "acquire":
            clock.now += arg
            refusal = limiter.acquire("t")
            if refusal is None:
                held += 1
                granted += 1
            else:
                # NOTE: a refusal names a limit that really is reached, and a wait that ends
                assert refusal.retry_after_s >= 0
                assert refusal.limit != "max_concurrent" or held == slots
        elif op == "release" and held:
            clock.now += arg
            limiter.release("t")
            held -= 1
        elif op == "charge":
            limiter.charge("t", int(arg))
        assert 0 <= limiter.in_flight["t"] == held <= slots
        # NOTE: a minute's allowance up front, then the refill rate: never more requests
        assert granted <= rpm + clock.now * rpm / 60 + 1e-9


def test_a_refused_request_takes_nothing_and_the_wait_is_exact() -> None:
    clock = _Clock()
    limiter = TenantLimiter([Tenant("t", requests_per_minute=2)], clock)
    assert limiter.acquire("t") is None and limiter.acquire("t") is None
    refusal = limiter.acquire("t")
    assert refusal is not None and refusal.limit == "requests_per_minute"
    assert refusal.retry_after_s == pytest.approx(30.0)  # NOTE: 2 a minute: one every 30 s
    clock.now = 29.0
    assert limiter.acquire("t") is not None
    clock.now = 30.0
    assert limiter.acquire("t") is None
    assert limiter.refused == {("t", "requests_per_minute"): 2}


def test_tokens_overdraw_once_then_wait_for_the_debt() -> None:
    clock = _Clock()
    limiter = TenantLimiter([Tenant("t", tokens_per_minute=600)], clock)  # NOTE: 10 a second
    assert limiter.acquire("t") is None
    limiter.charge("t", 900)  # NOTE: 300 over: allowed once
    limiter.release("t")
    refusal = limiter.acquire("t")
    assert refusal is not None and refusal.limit == "tokens_per_minute"
    assert refusal.retry_after_s == pytest.approx(30.1)  # NOTE: 300 owed + 1, at 10 a second
    clock.now = 30.2
    assert limiter.acquire("t") is None
    limiter.charge("t", 10**9)  # NOTE: the debt stops at one minute's allowance
    limiter.release("t")
    refusal = limiter.acquire("t")
    assert refusal is not None and refusal.retry_after_s <= 60.2
    limiter.charge(None, 50)  # NOTE: not a keyed tenant: ignored
    limiter.charge("other", 50)
