"""A matched ``stop`` string ends the worker request (issue 8, item 15), against a live
``agentgate serve`` over a paced sim worker (``--cost cpu``: about 4.5 ms per token).

The sim writes random bytes of the demo tokenizer, so U+FFFD (a byte that is not UTF-8 on its own)
shows up within the first few tokens: a stop string that always matches early. Without the abort,
the gateway read all ``max_tokens`` (about 13 s) and billed them; with it, the answer is short,
``usage.completion_tokens`` counts only the tokens up to the one that completed the stop, and the
worker has nothing running soon after.
"""

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.live import LiveGateway, live_gateway, start_sim_worker

STOP = "\ufffd"
MAX_TOKENS = 3000
FULL_RUN_S = MAX_TOKENS * 4.5e-3  # NOTE: the cpu cost model's decode step on one request
EARLY_TOKENS = 64  # NOTE: P(no U+FFFD in 64 random demo tokens) is below 1e-12
IDLE_WITHIN_S = 6.0


@pytest.fixture(scope="module")
def gateway(tokenizer_dir: Path) -> Iterator[LiveGateway]:
    worker = start_sim_worker("stop-sim", cost="cpu")
    try:
        with live_gateway(tokenizer_dir, "--workers", "0", "--worker", worker.listen) as live:
            yield live
    finally:
        worker.stop()


def _chat(stream: bool) -> dict[str, Any]:
    return {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stop": [STOP],
            "max_tokens": MAX_TOKENS, "stream": stream, "logprobs": True}


def _completion(stream: bool) -> dict[str, Any]:
    return {"model": "demo", "prompt": "hi", "stop": STOP, "max_tokens": MAX_TOKENS,
            "stream": stream, "logprobs": 1}


def _num_logprobs(choices: list[dict[str, Any]]) -> int:
    """Tokens with a logprob in chat (``content``) or completions (``tokens``) choices."""
    lps = [c.get("logprobs") or {} for c in choices]
    return sum(len(lp.get("content") or lp.get("tokens") or []) for lp in lps)


def _sse(resp: httpx.Response) -> list[dict[str, Any]]:
    lines = [ln[len("data: "):] for ln in resp.iter_lines() if ln.startswith("data: ")]
    return [json.loads(ln) for ln in lines if ln != "[DONE]"]


def _openai(
    http: httpx.Client, path: str, body: dict[str, Any]
) -> tuple[str, str, dict, int]:
    """(text, finish_reason, usage, tokens with logprobs) of a chat or completions answer,
    streamed or not."""
    if body["stream"]:
        body = body | {"stream_options": {"include_usage": True}}
        with http.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200, resp.read()
            events = _sse(resp)
        choices = [c for e in events for c in e["choices"]]
        text = "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                       for c in choices)
        [reason] = [c["finish_reason"] for c in choices if c.get("finish_reason")]
        [usage] = [e["usage"] for e in events if e.get("usage")]
        return text, reason, usage, _num_logprobs(choices)
    resp = http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    [choice] = answer["choices"]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text or "", choice["finish_reason"], answer["usage"], _num_logprobs([choice])


def _turn(http: httpx.Client, stream: bool) -> tuple[str, str, dict]:
    created = http.post("/v1/sessions", json={"system": "terse"})
    assert created.status_code in (200, 201), created.text
    body = {"messages": [{"role": "user", "content": "hi"}], "stop": [STOP],
            "max_tokens": MAX_TOKENS, "stream": stream}
    path = f"/v1/sessions/{created.json()['id']}/turns"
    if not stream:
        resp = http.post(path, json=body)
        assert resp.status_code == 200, resp.text
        end = resp.json()
    else:
        with http.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200, resp.read()
            frames = _sse(resp)
        [end] = [f for f in frames if f["type"] == "turn_end"]
    return end["message"]["content"] or "", end["finish_reason"], end["usage"]


def _running_requests(http: httpx.Client) -> int | None:
    """The worker's running requests by its last LoadReport (None: no report yet)."""
    lines = [ln for ln in http.get("/metrics").text.splitlines()
             if ln.startswith("agentgate_worker_running_requests")]
    return sum(int(float(ln.rsplit(" ", 1)[1])) for ln in lines) if lines else None


def _assert_idle_soon(http: httpx.Client) -> None:
    deadline = time.monotonic() + IDLE_WITHIN_S
    while (running := _running_requests(http)) != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running == 0, f"the worker runs {running} request(s) {IDLE_WITHIN_S} s after"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", ["chat", "completions", "session_turn"])
def test_stop_string_ends_the_worker_request(
    gateway: LiveGateway, api: str, stream: bool
) -> None:
    with httpx.Client(base_url=gateway.base_url, timeout=120) as http:
        t0 = time.monotonic()
        num_logprobs = None
        if api == "chat":
            text, reason, usage, num_logprobs = _openai(
                http, "/v1/chat/completions", _chat(stream))
        elif api == "completions":
            text, reason, usage, num_logprobs = _openai(
                http, "/v1/completions", _completion(stream))
        else:
            text, reason, usage = _turn(http, stream)
        elapsed_s = time.monotonic() - t0
        assert STOP not in text, text
        assert reason == "stop", (reason, usage)
        assert 1 <= usage["completion_tokens"] <= EARLY_TOKENS, usage
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["prompt_tokens"] > 0, usage
        if num_logprobs is not None:  # NOTE: one per billed token, none past the stop
            assert num_logprobs == usage["completion_tokens"], (num_logprobs, usage)
        # NOTE: generous: a stopped answer takes about 1 s here; the whole run, over 13 s
        assert elapsed_s < FULL_RUN_S / 2, f"{elapsed_s:.1f} s for {usage}"
        _assert_idle_soon(http)
