"""Issue 8 items 16 and 17 against a live ``agentgate serve`` over a zero-cost sim worker, through
the ``openai`` SDK where it has the call: only served model names are answered (404
``model_not_found`` otherwise, ``GET /v1/models/{id}``), and the parameters real clients send are
accepted when null or default, honoured where cheap, and a 400 ``unsupported_value`` naming the
field only where they would change the output and are not implemented."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from litestar import Litestar
from litestar.testing import TestClient

from gateway.app import GatewayConfig, create_app
from gateway.serve import WorkerProcess
from tests.gateway.live import LiveGateway, live_gateway

MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def gateway(sim_worker: WorkerProcess, tokenizer_dir: Path) -> Iterator[LiveGateway]:
    with live_gateway(tokenizer_dir, "--worker", sim_worker.listen, "--workers", "0") as live:
        yield live


@pytest.fixture(scope="module")
def client(gateway: LiveGateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.api_url, api_key="sk-test", max_retries=0,
                       timeout=60) as c:
        yield c


def _create(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        **({"model": "demo", "messages": MESSAGES, "max_tokens": 4} | kwargs)
    )


# --- item 16: model names ----------------------------------------------------------------------


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["demo"]
    model = client.models.retrieve("demo")
    assert (model.id, model.object) == ("demo", "model")
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.code == "model_not_found", info.value.body


def test_unknown_model_is_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        _create(client, model="gpt-4o")
    error = info.value.body
    assert isinstance(error, dict), error
    assert (error["code"], error["param"], error["type"]) == (
        "model_not_found", "model", "invalid_request_error"), error
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)


def test_every_served_name_answers_and_the_first_is_reported(
    sim_worker: WorkerProcess, tokenizer_dir: Path
) -> None:
    cfg = GatewayConfig(model_dir=tokenizer_dir, workers=(sim_worker.listen,),
                        served_model_names=("alpha", "beta"))
    with TestClient[Litestar](create_app(cfg), raise_server_exceptions=False) as tc:
        ids = [m["id"] for m in tc.get("/v1/models").json()["data"]]
        assert ids == ["alpha", "beta"], ids
        assert tc.get("/v1/models/beta").json()["id"] == "beta"
        assert tc.get("/v1/models/demo").status_code == 404
        body = {"model": "beta", "messages": MESSAGES, "max_tokens": 2}
        resp = tc.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200 and resp.json()["model"] == "alpha", resp.text
        assert tc.post("/v1/chat/completions", json=body | {"model": "demo"}).status_code == 404


# --- item 17: parameters clients send ------------------------------------------------------------

_ACCEPTED_CHAT: list[dict[str, Any]] = [
    {"logit_bias": None}, {"logit_bias": {}}, {"logit_bias": {"5": 1.5, "7": -100}},
    {"functions": None}, {"functions": []}, {"function_call": None}, {"function_call": "none"},
    {"function_call": "auto"},
    {"reasoning_effort": None}, {"reasoning_effort": "low"},
    {"audio": None}, {"modalities": None}, {"modalities": ["text"]},
    {"prediction": None}, {"prediction": {"type": "content", "content": "Hello"}},
    {"prompt_cache_key": None}, {"prompt_cache_key": "agent-7"},
    {"safety_identifier": None}, {"safety_identifier": "u-1"},
    {"verbosity": None}, {"verbosity": "medium"},
    {"user": None}, {"user": "u-1"}, {"metadata": None}, {"metadata": {"k": "v"}},
    {"store": None}, {"store": False}, {"service_tier": None}, {"service_tier": "auto"},
    {"top_k": None}, {"top_k": -1}, {"top_k": 0}, {"top_k": 20},
    {"min_p": None}, {"min_p": 0.0}, {"min_p": 0.05},
    {"repetition_penalty": None}, {"repetition_penalty": 1.0}, {"repetition_penalty": 1.1},
    {"stream_options": {"include_usage": True, "continuous_usage_stats": False}},
]


@pytest.mark.parametrize("extra", _ACCEPTED_CHAT, ids=lambda e: json.dumps(e)[:40])
def test_parameters_clients_send_are_accepted(client: openai.OpenAI, extra: dict) -> None:
    if "stream_options" in extra:
        chunks = list(_create(client, stream=True, **extra))
        assert chunks and chunks[-1].usage is not None, chunks
    else:
        out = _create(client, extra_body=extra)
        assert out.choices[0].finish_reason in ("length", "stop"), out


_REFUSED_CHAT: list[tuple[dict[str, Any], str]] = [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"320": 1}}, "logit_bias"),  # NOTE: the demo vocabulary is [0, 320)
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"top_k": -2}, "top_k"),
    ({"stream_options": {"include_usage": True, "bogus": 1}, "stream": True},
     "stream_options.bogus"),
]


@pytest.mark.parametrize(("extra", "param"), _REFUSED_CHAT, ids=lambda e: json.dumps(e)[:40])
def test_parameters_that_would_change_output_are_refused(
    client: openai.OpenAI, extra: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _create(client, extra_body=extra)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == param, info.value.body


def test_continuous_usage_stats_puts_usage_on_every_chunk(client: openai.OpenAI) -> None:
    stream = _create(client, max_tokens=6, stream=True,
                     stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices), chunks
    completion_tokens = [c.usage.completion_tokens for c in with_choices]
    assert completion_tokens == sorted(completion_tokens), completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6, chunks[-1]


def test_completions_accept_their_openai_and_vllm_fields(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="demo", prompt="Once upon", max_tokens=3, user="u", logit_bias={"5": 2},
        best_of=1, suffix=None,
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2},
    )
    assert out.choices[0].finish_reason == "length", out
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo", prompt="x", max_tokens=2, best_of=3)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "best_of"
