"""Two gateway replicas (real ``agentgate serve`` processes) over the same two sim workers and one
real redis-server: a session's turns, sent to the replicas in turn, all land on one worker (the
session store keeps the session's worker for both); a stateless client's follow-ups, sent to the
replicas in turn, land on the worker that has their history (both replicas build their index from
the same KV events).

The session test runs ``--router least-loaded`` with the replicas' round robins out of step:
without the shared affinity the second replica, which never saw the session, would put its turns
wherever its own round robin points (the test fails so).
"""

import contextlib
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx

from tests.gateway.live import LiveGateway, live_gateway
from tests.gateway.router_live import (
    AUTH,
    SERVE_ARGS,
    cached_tokens,
    chat,
    landed,
    one_home,
    replay_workers,
    session_turn,
    text,
    worker_requests,
)

TIMEOUT_S = 60.0
NUM_SESSIONS = 3
NUM_TURNS = 4


@contextlib.contextmanager
def replicas(model_dir: Path, redis_url: str, router: str) -> Iterator[list[httpx.Client]]:
    """Two gateways attached to the same two workers, sharing ``redis_url``."""
    with replay_workers(f"{router}-a", f"{router}-b") as (a, b), contextlib.ExitStack() as stack:
        clients = []
        for _ in range(2):
            gw: LiveGateway = stack.enter_context(live_gateway(
                model_dir, "--workers", "0", "--worker", a.listen, "--worker", b.listen,
                "--redis", redis_url, "--router", router, *SERVE_ARGS))
            clients.append(stack.enter_context(
                httpx.Client(base_url=gw.base_url, headers=AUTH, timeout=TIMEOUT_S)))
        yield clients


def test_a_sessions_turns_on_alternating_replicas_land_on_one_worker(
    sim_model_dir: Path, redis_url: str
) -> None:
    with replicas(sim_model_dir, redis_url, "least-loaded") as gateways:
        for s in range(NUM_SESSIONS):
            # NOTE: moves only the second replica's round robin on: left to itself, it would
            # now send a session it never saw elsewhere than the first replica did
            chat(gateways[1], [{"role": "user", "content": text(90 + s, 5)}], max_tokens=1)
            created = gateways[0].post("/v1/sessions", json={"system": text(10 + s, 60)})
            assert created.status_code in (200, 201), created.text
            sid = created.json()["id"]
            homes = []
            for turn in range(NUM_TURNS):
                http = gateways[turn % 2]
                home, _ = one_home(http, partial(session_turn, http, sid, text(50 + turn, 20), 3))
                homes.append(home)
            assert len(set(homes)) == 1, f"session {s}: turns went to {homes}"


def test_stateless_follow_ups_on_alternating_replicas_land_where_their_history_is(
    sim_model_dir: Path, redis_url: str
) -> None:
    with replicas(sim_model_dir, redis_url, "agentgate") as gateways:
        for s in range(NUM_SESSIONS):
            messages = [{"role": "system", "content": text(20 + s, 100)},
                        {"role": "user", "content": text(60 + s, 20)}]
            homes = []
            for turn in range(NUM_TURNS):
                http = gateways[turn % 2]
                before = worker_requests(http)
                answer = chat(http, messages)
                moved = landed(before, worker_requests(http))
                assert len(moved) == 1, moved
                homes.append(next(iter(moved)))
                if turn:
                    assert cached_tokens(answer) > 0, (s, turn, answer["usage"])
                content = answer["choices"][0]["message"]["content"] or "ok"
                messages += [{"role": "assistant", "content": content},
                             {"role": "user", "content": text(70 + turn, 20)}]
            assert len(set(homes)) == 1, f"conversation {s}: turns went to {homes}"
