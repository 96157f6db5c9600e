"""``GET /openapi.json``: the OpenAPI 3.1 document, with the request and response bodies spelled
out. Litestar documents the routes (``/schema`` serves its UI), but the handlers read raw bodies
(so that every decoding error names its parameter, ``gateway/schemas/decode.py``), which leaves
their bodies blank in its schema; this fills them in from the msgspec Structs, the same types the
handlers decode and encode, so the document cannot drift from the code.
"""

from typing import Any

import msgspec
from litestar import Request, get

from gateway.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorBody,
)
from gateway.schemas.sessions import (
    DeletedSession,
    SessionCreateRequest,
    SessionObject,
    TurnEnd,
    TurnRequest,
)

_FRAMES = "frame (turn_start, delta, tool_call, turn_end or error; see WS /v1/sessions/{id}/ws)"
# (path, method) -> (request body, JSON response, SSE event: a type or a description)
_BODIES: dict[tuple[str, str], tuple[Any, Any, Any]] = {
    ("/v1/chat/completions", "post"): (ChatCompletionRequest, ChatCompletion, ChatCompletionChunk),
    ("/v1/completions", "post"): (CompletionRequest, Completion, Completion),
    ("/v1/sessions", "post"): (SessionCreateRequest, SessionObject, None),
    ("/v1/sessions/{session_id}", "get"): (None, SessionObject, None),
    ("/v1/sessions/{session_id}", "delete"): (None, DeletedSession, None),
    ("/v1/sessions/{session_id}/turns", "post"): (TurnRequest, TurnEnd, _FRAMES),
}
_REF = "#/components/schemas/{name}"


@get("/openapi.json", include_in_schema=False, sync_to_thread=False, media_type="application/json")
def openapi_json(request: Request[Any, Any, Any]) -> dict[str, Any]:
    state = request.app.state
    if "openapi_document" not in state:
        state.openapi_document = build_document(request.app.openapi_schema.to_schema())
    return state.openapi_document


def build_document(base: dict[str, Any]) -> dict[str, Any]:
    """``base`` (litestar's document) with the bodies of ``_BODIES`` and the error body."""
    types = {t for bodies in _BODIES.values() for t in bodies if isinstance(t, type)}
    types.add(ErrorBody)
    _, components = msgspec.json.schema_components(sorted(types, key=repr), ref_template=_REF)
    doc = dict(base)
    doc.setdefault("components", {}).setdefault("schemas", {}).update(components)
    for (path, method), (req, resp, event) in _BODIES.items():
        op = doc.get("paths", {}).get(path, {}).get(method)
        if op is None:
            continue
        if req is not None:
            op["requestBody"] = {"required": True, "content": _content(req)}
        ok = _content(resp) if resp is not None else {}
        if event is not None:
            ok["text/event-stream"] = {
                "schema": {"type": "string", "description":
                           f"SSE: `data: <{getattr(event, '__name__', event)} JSON>` events"}
            }
        op["responses"] = {
            "200": {"description": "OK", "content": ok},
            "4XX": {"description": "invalid request", "content": _content(ErrorBody)},
            "5XX": {"description": "worker or gateway failure", "content": _content(ErrorBody)},
        }
    return doc


def _content(t: Any) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _REF.format(name=t.__name__)}}}
