"""Fuzzing the whole HTTP API from its own OpenAPI document (schemathesis, hypothesis-driven):
whatever the body, path or parameters, the gateway answers a 2xx or a 4xx (an OpenAI-style error),
never a 5xx. The requests go through a live ``agentgate serve`` over a zero-cost sim worker, so
the answers come from the real app, dispatcher and worker, with the memory and the Redis session
store."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.gateway.live import LiveGateway, live_gateway  # noqa: E402

# NOTE: derandomized, so CI runs the same cases every time; set AGENTGATE_FUZZ_EXAMPLES (and
# AGENTGATE_FUZZ_RANDOM=1) for a deeper, randomized hunt. Found so far (each a 500, now a 400):
# a prompt token id over 2**64 (msgpack overflow); a json_schema holding an int beyond 64 bits
# (llguidance); the same in a session's tool schema with the Redis store.
MAX_EXAMPLES = int(os.environ.get("AGENTGATE_FUZZ_EXAMPLES", "200"))
DERANDOMIZE = os.environ.get("AGENTGATE_FUZZ_RANDOM") != "1"


@pytest.fixture(scope="module", params=["memory", "redis"])
def fuzz_gateway(
    request: pytest.FixtureRequest, tokenizer_dir: Path, sim_worker  # type: ignore[no-untyped-def]
) -> Iterator[LiveGateway]:
    store = ["--redis", request.getfixturevalue("redis_url")] if request.param == "redis" else []
    args = ["--worker", sim_worker.listen, "--workers", "0", *store]
    with live_gateway(tokenizer_dir, *args) as live:
        yield live


@pytest.fixture(scope="module")
def operations(fuzz_gateway: LiveGateway) -> list:  # type: ignore[type-arg]
    schema = schemathesis.openapi.from_url(f"{fuzz_gateway.base_url}/openapi.json")
    ops = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/chat/completions", "/v1/sessions/{session_id}/turns"}
    return ops


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=DERANDOMIZE,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_no_input_is_a_server_error(operations: list, data: st.DataObject) -> None:  # type: ignore[type-arg]
    op = data.draw(st.sampled_from(operations), label="operation")
    case = data.draw(op.as_strategy(), label="case")
    # NOTE: a bounded answer: a fuzzed max_tokens in the millions would only be slow, not wrong
    if isinstance(case.body, dict):
        for field in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(field), int) and case.body[field] > 64:
                case.body[field] = 64
    response = case.call(timeout=30)
    assert response.status_code < 500, (
        f"{case.method} {case.formatted_path} {case.body!r} -> {response.status_code}: "
        f"{response.text[:500]}"
    )
