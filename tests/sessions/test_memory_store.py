"""``MemorySessionStore`` bounds: at most ``max_sessions`` (least recently used evicted first),
none idle past ``idle_ttl_s``; checked by example and by a state machine with a fake clock
against an ordered-dict model."""

import asyncio
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from sessions import MemorySessionStore, new_session

MAX_SESSIONS = 3
TTL_S = 10.0
T = TypeVar("T")
KEYS = [(t, s) for t in ("t-a", "t-b") for s in ("s1", "s2", "s3")]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def test_least_recently_used_is_evicted_first() -> None:
    store = MemorySessionStore(max_sessions=2, idle_ttl_s=TTL_S, clock=_Clock())
    for sid in ("a", "b"):
        _run(store.create(new_session("t", "m", session_id=sid)))
    assert _run(store.get("t", "a")) is not None  # NOTE: "a" is now the most recently used
    _run(store.create(new_session("t", "m", session_id="c")))
    assert _run(store.get("t", "b")) is None, "b was least recently used"
    assert _run(store.get("t", "a")) is not None and _run(store.get("t", "c")) is not None
    assert len(store) == 2 and store.num_evicted == 1


def test_idle_ttl_expires_without_any_access() -> None:
    clock = _Clock()
    store = MemorySessionStore(max_sessions=10, idle_ttl_s=TTL_S, clock=clock)
    _run(store.create(new_session("t", "m", session_id="a")))
    clock.now = TTL_S - 0.1
    assert len(store) == 1
    clock.now = TTL_S + 0.1
    assert len(store) == 0 and store.num_expired == 1


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(AssertionError, match="max_sessions"):
        MemorySessionStore(max_sessions=0)


class BoundsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = _Clock()
        self.store = MemorySessionStore(MAX_SESSIONS, TTL_S, clock=self.clock)
        self.model: OrderedDict[tuple[str, str], float] = OrderedDict()  # key -> last use

    def _expire_model(self) -> None:
        for key, last_used in list(self.model.items()):
            if last_used <= self.clock.now - TTL_S:
                del self.model[key]

    def _use(self, key: tuple[str, str]) -> None:
        self.model[key] = self.clock.now
        self.model.move_to_end(key)

    @rule(dt=st.floats(0, TTL_S * 0.7))
    def tick(self, dt: float) -> None:
        self.clock.now += dt

    @rule(key=st.sampled_from(KEYS))
    def create(self, key: tuple[str, str]) -> None:
        self._expire_model()
        if key in self.model:
            return
        _run(self.store.create(new_session(key[0], "m", session_id=key[1])))
        self._use(key)
        while len(self.model) > MAX_SESSIONS:
            self.model.popitem(last=False)

    @rule(key=st.sampled_from(KEYS))
    def get(self, key: tuple[str, str]) -> None:
        self._expire_model()
        got = _run(self.store.get(*key))
        assert (got is not None) == (key in self.model), (key, got, self.model)
        if got is not None:
            assert (got.tenant, got.id) == key
            self._use(key)

    @rule(key=st.sampled_from(KEYS))
    def put(self, key: tuple[str, str]) -> None:
        self._expire_model()
        if key in self.model:
            current = _run(self.store.get(*key))
            _run(self.store.put(current))
            self._use(key)

    @invariant()
    def bounded(self) -> None:
        self._expire_model()
        assert len(self.store) == len(self.model) <= MAX_SESSIONS, (len(self.store), self.model)


TestBounds = BoundsMachine.TestCase
TestBounds.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
