"""``agentgate serve --api-keys FILE`` as a user runs it (a real subprocess over a sim worker),
driven by the ``openai`` SDK, httpx and a WebSocket client: strangers get 401, tenants get their
own sessions whichever of their keys they use, each limit answers 429 with ``Retry-After``, the
probes stay open, and no key ever reaches the gateway's output."""

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.gateway.live import free_port, spawn_serve, wait_ready

KEYS = {
    "acme": ["sk-acme-1-0123456789abcdef", "sk-acme-2-0123456789abcdef"],
    "beta": ["sk-beta-0123456789abcdef"],
    "solo": ["sk-solo-0123456789abcdef"],
    "slow": ["sk-slow-0123456789abcdef"],
    "thrifty": ["sk-thrifty-0123456789abcdef"],
}
LIMITS = {"solo": "max_concurrent = 1", "slow": "requests_per_minute = 2",
          "thrifty": "tokens_per_minute = 100", "acme": "weight = 2"}
STRANGER = "sk-stranger-0123456789abcdef"
MESSAGES = [{"role": "user", "content": "Say hi."}]
WAIT_S = 10.0


class Gateway:
    def __init__(self, base_url: str, log: Path) -> None:
        self.base_url = base_url
        self.log = log

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0,
                             timeout=30)

    def http(self, key: str | None) -> httpx.Client:
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=30)


@pytest.fixture(scope="module")
def gateway(sim_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("api-keys")
    keys_file = tmp / "keys.toml"
    keys_file.write_text("\n".join(
        f"[tenants.{name}]\nkeys = {json.dumps(keys)}\n{LIMITS.get(name, '')}\n"
        for name, keys in KEYS.items()))
    port, log = free_port(), tmp / "serve.log"
    with log.open("w") as out:
        proc = spawn_serve(sim_model_dir, port, "--api-keys", str(keys_file),
                           "--served-model-name", "demo", stdout=out)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", log.read_text)
        yield Gateway(f"http://127.0.0.1:{port}", log)
    finally:
        proc.terminate()
        proc.wait(30)


def test_strangers_get_401_and_the_probes_stay_open(gateway: Gateway) -> None:
    with gateway.client(STRANGER) as client, pytest.raises(openai.AuthenticationError) as caught:
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=2)
    assert caught.value.status_code == 401 and "Invalid API key" in caught.value.message
    assert caught.value.code == "invalid_api_key"
    for key, says in ((None, "Missing API key"), (STRANGER, "Invalid API key")):
        with gateway.http(key) as http:
            reply = http.post("/v1/chat/completions", json={"model": "demo",
                                                             "messages": MESSAGES})
            assert reply.status_code == 401 and says in reply.json()["error"]["message"]
            assert reply.headers["www-authenticate"] == "Bearer"
            assert http.get("/v1/models").status_code == 401
            assert http.post("/v1/sessions", json={}).status_code == 401
    with gateway.http(None) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/ready").status_code == 200
        metrics = http.get("/metrics")
        assert metrics.status_code == 200
        assert "agentgate_auth_unauthorized_total" in metrics.text


def test_a_tenant_streams_and_keeps_its_sessions_across_its_keys(gateway: Gateway) -> None:
    first, second = KEYS["acme"]
    with gateway.client(first) as client:
        answer = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4)
        assert answer.usage is not None and answer.usage.completion_tokens == 4
        chunks = list(client.chat.completions.create(model="demo", messages=MESSAGES,
                                                     max_tokens=4, stream=True))
        assert chunks and chunks[-1].choices[0].finish_reason is not None
    with gateway.http(first) as http:
        sid = http.post("/v1/sessions", json={"system": "Be brief."}).json()["id"]
    with gateway.http(second) as http:
        assert http.get(f"/v1/sessions/{sid}").status_code == 200  # NOTE: same tenant
    with gateway.http(KEYS["beta"][0]) as http:
        assert http.get(f"/v1/sessions/{sid}").status_code == 404  # NOTE: another tenant's


def test_a_websocket_without_a_key_is_refused(gateway: Gateway) -> None:
    ws_url = gateway.base_url.replace("http://", "ws://") + "/v1/sessions/s-1/ws"
    with pytest.raises(InvalidStatus) as caught, connect(ws_url, open_timeout=WAIT_S):
        pass
    assert caught.value.response.status_code == 401
    assert b"invalid_api_key" in caught.value.response.body


def test_concurrency_limit_holds_while_a_websocket_is_open(gateway: Gateway) -> None:
    [key] = KEYS["solo"]
    with gateway.http(key) as http:
        sid = http.post("/v1/sessions", json={}).json()["id"]
        ws_url = gateway.base_url.replace("http://", "ws://") + f"/v1/sessions/{sid}/ws"
        with connect(ws_url, additional_headers={"Authorization": f"Bearer {key}"},
                     open_timeout=WAIT_S):
            refused = http.post("/v1/chat/completions", json={
                "model": "demo", "messages": MESSAGES, "max_tokens": 2})
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            assert "max_concurrent" in refused.json()["error"]["message"]
            assert int(refused.headers["retry-after"]) >= 1
        status = _until(lambda: http.post("/v1/chat/completions", json={
            "model": "demo", "messages": MESSAGES, "max_tokens": 2}).status_code, 200)
        assert status == 200


def test_requests_per_minute_answers_429_with_the_wait(gateway: Gateway) -> None:
    with gateway.client(KEYS["slow"][0]) as client:
        for _ in range(2):
            client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=1)
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=1)
    assert "requests_per_minute" in caught.value.message
    # NOTE: 2 a minute: the next one is due ~30 s after the last, less the time taken here
    assert 20 <= int(caught.value.response.headers["retry-after"]) <= 31
    with gateway.client(KEYS["acme"][0]) as client:  # NOTE: another tenant is not held back
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=1)


def test_tokens_per_minute_counts_prompt_and_completion(gateway: Gateway) -> None:
    with gateway.client(KEYS["thrifty"][0]) as client:
        answer = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=80)
        assert answer.usage is not None and answer.usage.total_tokens > 100
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=1)
    assert "tokens_per_minute" in caught.value.message
    with gateway.http(None) as http:
        metrics = http.get("/metrics").text
    assert 'agentgate_tenant_limited_total{limit="tokens_per_minute",tenant="thrifty"} 1.0' \
        in metrics


def test_no_key_reaches_the_output(gateway: Gateway) -> None:
    with gateway.client(STRANGER) as client, pytest.raises(openai.AuthenticationError):
        client.models.list()
    with gateway.client(KEYS["beta"][0]) as client:
        client.models.list()
    output = gateway.log.read_text()
    assert "gateway on http://127.0.0.1" in output  # NOTE: the log is this gateway's
    for secret in (STRANGER, *(k for keys in KEYS.values() for k in keys)):
        assert secret not in output


def test_a_bad_keys_file_stops_serve_before_any_worker(sim_model_dir: Path,
                                                       tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text('[tenants.acme]\nkeys = ["too-short"]\n')
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--model", str(sim_model_dir),
         "--backend", "sim", "--port", str(free_port())],
        env={"AGENTGATE_API_KEYS": str(keys_file), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "keys.toml: [tenants.acme]: keys[0]" in done.stderr and "too-short" not in done.stderr
    assert "worker" not in done.stderr.lower()


def test_a_public_address_without_keys_is_warned_about(sim_model_dir: Path) -> None:
    # NOTE: the port is taken on loopback, so serve warns, then fails to bind: nothing listens
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "serve", "--model", str(sim_model_dir),
             "--backend", "sim", "--host", "0.0.0.0", "--port", str(taken.getsockname()[1])],
            capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "listening on 0.0.0.0 without API keys" in done.stderr
    assert "cannot listen on 0.0.0.0" in done.stderr


def _until(probe: Any, want: Any) -> Any:
    deadline = time.monotonic() + WAIT_S
    while (got := probe()) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return got
