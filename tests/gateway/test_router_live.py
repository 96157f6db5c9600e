"""Routing through a real ``agentgate serve`` (sim workers, real ZeroMQ events), read back from
the gateway's ``/metrics``: a session's turns stay on one worker; a stateless client resending
its growing history lands on the worker that has it; a burst sharing a long new prefix lands on
one worker; ``--router least-loaded`` still spreads; a killed worker leaves the index and the
routing.
"""

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import pytest

from tests.gateway.live import LiveGateway, live_gateway
from tests.gateway.router_live import (
    AUTH,
    SERVE_ARGS,
    cached_tokens,
    chat,
    gauge,
    landed,
    metrics,
    one_home,
    replay_workers,
    session_turn,
    text,
    worker_requests,
)

TIMEOUT_S = 60.0
NUM_TURNS = 4
NUM_BURST = 8
EVENTS_WAIT_S = 10.0


@pytest.fixture(scope="module")
def agentgate3(sim_model_dir: Path) -> Iterator[LiveGateway]:
    with live_gateway(sim_model_dir, "--workers", "3", *SERVE_ARGS) as gw:
        yield gw


@pytest.fixture
def http(agentgate3: LiveGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=agentgate3.base_url, headers=AUTH, timeout=TIMEOUT_S) as client:
        yield client


def test_a_sessions_turns_stay_on_one_worker(http: httpx.Client) -> None:
    created = http.post("/v1/sessions", json={"system": text(1, 100)})
    assert created.status_code in (200, 201), created.text
    sid = created.json()["id"]
    homes = [one_home(http, partial(session_turn, http, sid, text(100 + turn, 40), 4))[0]
             for turn in range(NUM_TURNS)]
    assert len(set(homes)) == 1, f"turns went to {homes}"


def test_a_stateless_client_resending_its_history_lands_where_it_is(
    http: httpx.Client,
) -> None:
    messages = [{"role": "system", "content": text(2, 100)},
                {"role": "user", "content": text(200, 20)}]
    homes = []
    for turn in range(NUM_TURNS):
        home, answer = one_home(http, partial(chat, http, messages))
        homes.append(home)
        assert homes[-1] == homes[0], f"turn {turn} moved: {homes}"
        if turn:
            assert cached_tokens(answer) > 0, answer["usage"]
        messages += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]
                      or "ok"}, {"role": "user", "content": text(201 + turn, 20)}]
        _wait_for_index(http)
    assert len(set(homes)) == 1, f"turns went to {homes}"
    decisions = metrics(http)["agentgate_routing_decisions_total"]
    prefix = decisions.get((("reason", "prefix"), ("router", "agentgate")), 0)
    assert prefix >= NUM_TURNS - 1, decisions


def test_a_burst_sharing_a_long_new_prefix_lands_on_one_worker(http: httpx.Client) -> None:
    """Eight parallel requests, the same new prefix (about 1,250 tokens), each its own question:
    the first one's optimistic index entries draw the others before any KV event came (the sim
    worker announces SWA per page, so a predicted page has a window: it used to spread 5/2/1,
    with no checkpoint predicted at the siblings' branch point)."""
    shared = text(3, 150)
    before = worker_requests(http)

    def ask(i: int) -> dict:
        return chat(http, [{"role": "system", "content": shared},
                           {"role": "user", "content": text(300 + i, 10)}])

    with ThreadPoolExecutor(NUM_BURST) as pool:
        answers = list(pool.map(ask, range(NUM_BURST)))
    assert len(answers) == NUM_BURST
    moved = landed(before, worker_requests(http))
    assert sum(moved.values()) == NUM_BURST and len(moved) == 1, moved


def test_the_metrics_name_each_worker_and_the_index(http: httpx.Client) -> None:
    chat(http, [{"role": "user", "content": text(4, 50)}])
    samples = metrics(http)
    for name in ("agentgate_worker_requests_total", "agentgate_worker_prompt_tokens_total",
                 "agentgate_worker_cached_prompt_tokens_total",
                 "agentgate_worker_generated_tokens_total"):
        assert len(samples.get(name, {})) == 3, (name, samples.get(name))
    assert sum(samples["agentgate_worker_prompt_tokens_total"].values()) > 0
    assert sum(samples["agentgate_worker_generated_tokens_total"].values()) > 0
    _wait_for_index(http)
    assert gauge(http, "agentgate_routing_index_workers") == 3
    reasons = {dict(k)["reason"] for k in samples["agentgate_routing_decisions_total"]}
    assert {"affinity", "prefix", "load", "moved_for_load", "cold"} <= reasons, reasons


def test_least_loaded_still_spreads(sim_model_dir: Path) -> None:
    with live_gateway(sim_model_dir, "--workers", "3", *SERVE_ARGS,
                      "--router", "least-loaded") as gw, \
            httpx.Client(base_url=gw.base_url, headers=AUTH, timeout=TIMEOUT_S) as http:
        before = worker_requests(http)
        for i in range(6):  # NOTE: one at a time: every worker idle, round robin on ties
            chat(http, [{"role": "user", "content": text(400 + i, 20)}])
        moved = landed(before, worker_requests(http))
        assert len(moved) == 3, moved
        decisions = metrics(http)["agentgate_routing_decisions_total"]
        assert decisions.get((("reason", "load"), ("router", "least-loaded")), 0) >= 6
        # NOTE: the same hint, different prompts: least-loaded keeps a key on its worker
        for hint in ({"headers": {"X-Session-ID": "agent-1"}}, {"prompt_cache_key": "pck-1"},
                     {"user": "user-1"}):
            before = worker_requests(http)
            for i in range(3):
                _chat_with(http, [{"role": "user", "content": text(410 + i, 20)}], **hint)
            moved = landed(before, worker_requests(http))
            assert len(moved) == 1, (hint, moved)


def test_a_killed_worker_leaves_the_index_and_the_routing(sim_model_dir: Path) -> None:
    with replay_workers("kv-a", "kv-b") as (a, b), \
            live_gateway(sim_model_dir, "--workers", "0", "--worker", a.listen,
                         "--worker", b.listen, *SERVE_ARGS) as gw, \
            httpx.Client(base_url=gw.base_url, headers=AUTH, timeout=TIMEOUT_S) as http:
        prompts = [[{"role": "user", "content": text(500 + i, 60)}] for i in range(4)]
        for p in prompts:
            chat(http, p)
        _wait_for_index(http, workers=2)
        a.stop(signal.SIGKILL)
        _wait_for_index(http, workers=1)
        before = worker_requests(http)
        for p in prompts:  # NOTE: even those whose pages kv-a held
            chat(http, [*p, {"role": "assistant", "content": "ok"},
                        {"role": "user", "content": "more"}])
        moved = landed(before, worker_requests(http))
        assert set(moved) == {b.listen}, moved


def _chat_with(http: httpx.Client, messages: list[dict], headers: dict | None = None,
               **body: str) -> None:
    payload = {"model": "demo", "messages": messages, "max_tokens": 2, **body}
    resp = http.post("/v1/chat/completions", json=payload, headers=headers)
    assert resp.status_code == 200, resp.text


def _wait_for_index(http: httpx.Client, workers: int | None = None) -> None:
    """Until the index holds pages (and, with ``workers``, that many workers feed it)."""
    deadline = time.monotonic() + EVENTS_WAIT_S
    while time.monotonic() < deadline:
        pages = gauge(http, "agentgate_routing_index_pages")
        feeding = gauge(http, "agentgate_routing_index_workers")
        if pages > 0 and (workers is None or feeding == workers):
            return
        time.sleep(0.1)
    raise AssertionError(f"index: {pages} pages, {feeding} workers (wanted {workers})")
