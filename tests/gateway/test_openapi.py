"""``GET /openapi.json`` documents the bodies the handlers really take and return: every ``$ref``
resolves, and real request and response bodies validate against the documented schemas (and a
bad one does not), so the document cannot silently drift from the msgspec Structs."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from litestar import Litestar
from litestar.testing import TestClient

from gateway.app import GatewayConfig, create_app
from gateway.serve import WorkerProcess


@pytest.fixture(scope="module")
def client(sim_worker: WorkerProcess, tokenizer_dir: Path) -> Iterator[TestClient[Litestar]]:
    cfg = GatewayConfig(model_dir=tokenizer_dir, workers=(sim_worker.listen,), model_name="demo")
    with TestClient(create_app(cfg), raise_server_exceptions=False) as test_client:
        yield test_client


def _validator(doc: dict[str, Any], schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    root = {**schema, "components": doc["components"]}
    return jsonschema.Draft202012Validator(root)


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_document_bodies_resolve_and_match_real_traffic(client: TestClient[Litestar]) -> None:
    resp = client.get("/openapi.json")
    assert resp.status_code == 200, resp.text
    doc = resp.json()
    assert doc["openapi"].startswith("3.") and doc["info"]["title"] == "agentgate"
    schemas = doc["components"]["schemas"]
    for ref in _refs(doc):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref

    op = doc["paths"]["/v1/chat/completions"]["post"]
    request_schema = op["requestBody"]["content"]["application/json"]["schema"]
    response_schema = op["responses"]["200"]["content"]["application/json"]["schema"]
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    _validator(doc, request_schema).validate(body)
    assert not _validator(doc, request_schema).is_valid({"model": "demo"})  # no messages
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    _validator(doc, response_schema).validate(reply.json())

    error_schema = op["responses"]["4XX"]["content"]["application/json"]["schema"]
    bad = client.post("/v1/chat/completions", json={"model": "demo"})
    assert bad.status_code == 400
    _validator(doc, error_schema).validate(bad.json())


def test_session_bodies_match_real_traffic(client: TestClient[Litestar]) -> None:
    doc = client.get("/openapi.json").json()
    paths = doc["paths"]

    def schema(path: str, method: str, part: str) -> dict[str, Any]:
        op = paths[path][method]
        node = op["requestBody"] if part == "request" else op["responses"]["200"]
        return node["content"]["application/json"]["schema"]

    create = {"system": "Be brief.", "metadata": {"k": "v"}}
    _validator(doc, schema("/v1/sessions", "post", "request")).validate(create)
    session = client.post("/v1/sessions", json=create)
    assert session.status_code == 200, session.text
    _validator(doc, schema("/v1/sessions", "post", "response")).validate(session.json())
    sid = session.json()["id"]
    turn = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    _validator(doc, schema("/v1/sessions/{session_id}/turns", "post", "request")).validate(turn)
    answer = client.post(f"/v1/sessions/{sid}/turns", json=turn)
    assert answer.status_code == 200, answer.text
    turn_schema = schema("/v1/sessions/{session_id}/turns", "post", "response")
    _validator(doc, turn_schema).validate(answer.json())
    got = client.get(f"/v1/sessions/{sid}").json()
    _validator(doc, schema("/v1/sessions/{session_id}", "get", "response")).validate(got)
    deleted = client.delete(f"/v1/sessions/{sid}").json()
    _validator(doc, schema("/v1/sessions/{session_id}", "delete", "response")).validate(deleted)


def test_litestar_ui_is_served(client: TestClient[Litestar]) -> None:
    assert client.get("/schema").status_code == 200
