"""The ``SessionStore`` contract, against both stores: create / get / put (compare-and-set on
version) / delete keyed by (tenant, id), tenant isolation, and a hypothesis state machine that
checks every sequence of operations against a dict model."""

import asyncio

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sessions import (
    Session,
    SessionNotFound,
    SessionStore,
    TurnRecord,
    TurnUsage,
    VersionConflict,
    new_session,
)
from tests.sessions.conftest import MakeStore

TENANTS = ("anonymous", "t-aaa", "t-bbb")
IDS = ("sess_1", "sess_2", "sess_3")


def _make_session(tenant: str = "t-aaa", session_id: str = "sess_1", **fields: object) -> Session:
    return msgspec.structs.replace(new_session(tenant, "demo", session_id=session_id), **fields)


def test_round_trip_keeps_every_field(make_store: MakeStore) -> None:
    async def body() -> None:
        store = await make_store()
        record = TurnRecord(
            index=0, request_id="r", first_message=0, num_messages=1, finish_reason="stop",
            usage=TurnUsage(prompt_tokens=9, completion_tokens=2, cached_tokens=4),
            first_token_s=0.5,
        )
        session = _make_session(
            system="sys", tools=[{"type": "function", "function": {"name": "f"}}],
            metadata={"k": "v"}, messages=[{"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": "yo"}],
            turns=[record], prompt_ids=[1, 2, 3], prompt_num_messages=3,
        )
        created = await store.create(session)
        got = await store.get("t-aaa", "sess_1")
        assert created.version == 1 and got == created, (created, got)
        await store.close()

    asyncio.run(body())


def test_put_is_compare_and_set(make_store: MakeStore) -> None:
    async def body() -> None:
        store = await make_store()
        v1 = await store.create(_make_session())
        v2 = await store.put(msgspec.structs.replace(v1, metadata={"n": "2"}))
        assert v2.version == 2 and (await store.get("t-aaa", "sess_1")) == v2
        with pytest.raises(VersionConflict):
            await store.put(msgspec.structs.replace(v1, metadata={"n": "stale"}))
        assert (await store.get("t-aaa", "sess_1")).metadata == {"n": "2"}
        with pytest.raises(VersionConflict):
            await store.create(_make_session())
        assert await store.delete("t-aaa", "sess_1")
        with pytest.raises(SessionNotFound):
            await store.put(v2)
        assert not await store.delete("t-aaa", "sess_1")
        await store.close()

    asyncio.run(body())


def test_tenants_never_see_each_other(make_store: MakeStore) -> None:
    async def body() -> None:
        store = await make_store()
        await store.create(_make_session("t-aaa", metadata={"owner": "a"}))
        assert await store.get("t-bbb", "sess_1") is None
        assert not await store.delete("t-bbb", "sess_1")
        with pytest.raises(SessionNotFound):
            await store.put(_make_session("t-bbb", version=1))
        other = await store.create(_make_session("t-bbb", metadata={"owner": "b"}))
        assert other.version == 1
        assert (await store.get("t-aaa", "sess_1")).metadata == {"owner": "a"}
        await store.close()

    asyncio.run(body())


def test_idle_sessions_expire(make_store: MakeStore) -> None:
    async def body() -> None:
        store = await make_store(idle_ttl_s=0.3)
        await store.create(_make_session(session_id="idle"))
        await store.create(_make_session(session_id="busy"))
        for _ in range(4):
            await asyncio.sleep(0.1)
            assert await store.get("t-aaa", "busy") is not None  # NOTE: a read is a use
        assert await store.get("t-aaa", "idle") is None
        await store.close()

    asyncio.run(body())


class StoreMachine(RuleBasedStateMachine):
    """Random create / get / put (fresh or stale) / delete over 3 tenants x 3 ids."""

    make_store: MakeStore

    def __init__(self) -> None:
        super().__init__()
        self.runner = asyncio.Runner()
        self.model: dict[tuple[str, str], Session] = {}

    @initialize()
    def open_store(self) -> None:
        self.store: SessionStore = self.runner.run(self.make_store())

    def teardown(self) -> None:
        if hasattr(self, "store"):
            self.runner.run(self.store.close())
        self.runner.close()

    @rule(tenant=st.sampled_from(TENANTS), sid=st.sampled_from(IDS), n=st.integers(0, 9))
    def create(self, tenant: str, sid: str, n: int) -> None:
        session = _make_session(tenant, sid, metadata={"n": str(n)})
        if (tenant, sid) in self.model:
            with pytest.raises(VersionConflict):
                self.runner.run(self.store.create(session))
            return
        self.model[(tenant, sid)] = self.runner.run(self.store.create(session))

    @rule(tenant=st.sampled_from(TENANTS), sid=st.sampled_from(IDS), n=st.integers(0, 9),
          stale_by=st.integers(0, 2))
    def put(self, tenant: str, sid: str, n: int, stale_by: int) -> None:
        current = self.model.get((tenant, sid))
        version = (current.version if current else 1) - stale_by
        session = _make_session(tenant, sid, metadata={"n": str(n)}, version=version)
        if current is None:
            with pytest.raises(SessionNotFound):
                self.runner.run(self.store.put(session))
        elif stale_by:
            with pytest.raises(VersionConflict):
                self.runner.run(self.store.put(session))
        else:
            stored = self.runner.run(self.store.put(session))
            assert stored.version == current.version + 1, (stored, current)
            self.model[(tenant, sid)] = stored

    @rule(tenant=st.sampled_from(TENANTS), sid=st.sampled_from(IDS))
    def delete(self, tenant: str, sid: str) -> None:
        removed = self.runner.run(self.store.delete(tenant, sid))
        assert removed == ((tenant, sid) in self.model), (tenant, sid, removed)
        self.model.pop((tenant, sid), None)

    @invariant()
    def matches_model(self) -> None:
        if not hasattr(self, "store"):
            return
        for tenant in TENANTS:
            for sid in IDS:
                got = self.runner.run(self.store.get(tenant, sid))
                assert got == self.model.get((tenant, sid)), (tenant, sid, got)


def test_store_state_machine(make_store: MakeStore) -> None:
    machine = type("Machine", (StoreMachine,), {"make_store": staticmethod(make_store)})
    settings_ = settings(
        max_examples=25, stateful_step_count=20, deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    machine.TestCase.settings = settings_
    machine.TestCase().runTest()
