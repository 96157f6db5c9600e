"""The sglang worker behind a real ``agentgate serve`` (attached with ``--worker``), driven by the
OpenAI SDK: chat works, SGLang's KV events reach the router's index re-hashed, and a second turn
that resends the history reports cached prompt tokens and is routed by prefix.

SGLang needs a GPU, so the worker runs on the stand-in of its engine surface
(``tests/engine/sglang_standin.py``); ``tests/engine/test_sglang_gpu.py`` is the same path on a
real SGLang where one is.
"""

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine.sglang_backend.worker import ModelInfo, SGLangWorker
from tests.engine.sglang_standin import StandInSGLang, ipc_endpoint, serving
from tests.gateway.live import LiveGateway, live_gateway
from tests.gateway.router_live import AUTH, SERVE_ARGS, metrics, text

VOCAB = 320  # the demo tokenizer's


@pytest.fixture(scope="module")
def sglang_worker() -> Iterator[SGLangWorker]:
    engine = StandInSGLang(ipc_endpoint(), vocab=VOCAB)
    with serving(engine, model=ModelInfo("demo", None, VOCAB)) as worker:
        yield worker


@pytest.fixture(scope="module")
def gateway(sim_model_dir: Path, sglang_worker: SGLangWorker) -> Iterator[LiveGateway]:
    with live_gateway(sim_model_dir, "--workers", "0", "--worker", sglang_worker.endpoints[0],
                      *SERVE_ARGS) as gw:
        yield gw


def test_a_conversation_through_the_gateway_hits_sglangs_cache(gateway: LiveGateway) -> None:
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=AUTH["Authorization"][7:],
                           max_retries=0, timeout=30)
    messages = [{"role": "system", "content": text(3, 120)},
                {"role": "user", "content": text(300, 20)}]
    first = client.chat.completions.create(model="demo", messages=messages, max_tokens=8)
    assert first.usage is not None and first.usage.completion_tokens == 8
    with httpx.Client(base_url=gateway.base_url, headers=AUTH, timeout=10) as http:
        deadline = time.monotonic() + 10
        while not metrics(http).get("agentgate_routing_index_pages", {}).get((), 0):
            assert time.monotonic() < deadline, "SGLang's KV events never reached the router"
            time.sleep(0.1)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or "ok"},
                 {"role": "user", "content": text(301, 20)}]
    second = client.chat.completions.create(model="demo", messages=messages, max_tokens=4)
    details = second.usage.prompt_tokens_details if second.usage else None
    assert details is not None and (details.cached_tokens or 0) >= 16 * 5, second.usage
    with httpx.Client(base_url=gateway.base_url, headers=AUTH, timeout=10) as http:
        decisions = metrics(http)["agentgate_routing_decisions_total"]
    assert any(dict(k).get("reason") == "prefix" and v >= 1 for k, v in decisions.items()), (
        decisions)
