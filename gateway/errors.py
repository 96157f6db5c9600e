"""Every error the gateway answers with, mapped to HTTP once: an OpenAI error JSON
(``{"error": {"message", "type", "param", "code"}}``) with a 4xx for what the client must fix and
a 5xx only for the gateway's or the workers' trouble. Passed to ``Litestar(exception_handlers=)``.

    | error                                   | status            | type / code           |
    |-----------------------------------------|-------------------|-----------------------|
    | RequestError                            | .status (400, 404, 413) | invalid_request_error |
    | WorkerError invalid_request,            | 400               | invalid_request_error |
    |   invalid_grammar                       |                   |   / the worker's code |
    | WorkerError context_too_long            | 400               | invalid_request_error |
    |   (param "prompt" on completions,       |                   |   / context_length_   |
    |   "messages" elsewhere)                 |                   |     exceeded          |
    | WorkersBusy, WorkerError overloaded     | 429 + Retry-After | rate_limit_error      |
    |                                         |                   |   / overloaded        |
    | NoWorkerAvailable                       | 503 + Retry-After | service_unavailable   |
    | DispatchTimeout                         | 504               | timeout               |
    | other DispatchError (dead worker, ...)  | 502               | server_error          |
    | litestar HTTPException (404, 405, 413)  | its own           | invalid_request_error |
    | anything else                           | 500               | server_error          |

Log lines name the request (``gateway.request_id``).
"""

import logging
import math

from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.types import ExceptionHandlersMap

from gateway.dispatch import (
    DispatchError,
    DispatchTimeout,
    NoWorkerAvailable,
    WorkerError,
    WorkersBusy,
)
from gateway.schemas import ErrorBody, RequestError, error_body

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


def _json(
    body: ErrorBody, status: int, headers: dict[str, str] | None = None
) -> Response[ErrorBody]:
    return Response(body, status_code=status, headers=headers, media_type="application/json")


def request_error(_: Request, exc: RequestError) -> Response[ErrorBody]:
    return _json(exc.to_body(), exc.status)


def dispatch_error(request: Request | None, exc: DispatchError) -> Response[ErrorBody]:
    """The table above, for every ``DispatchError`` (``request`` None: a session turn)."""
    if isinstance(exc, WorkerError) and exc.code == "context_too_long":
        body = error_body(exc.message, param=_prompt_param(request),
                          code="context_length_exceeded")
        return _json(body, 400)
    if isinstance(exc, WorkerError) and exc.code in ("invalid_request", "invalid_grammar"):
        return _json(error_body(exc.message, code=exc.code), 400)
    retry_after = {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(exc, WorkersBusy) or (isinstance(exc, WorkerError) and exc.code == "overloaded"):
        body = error_body(str(exc), type="rate_limit_error", code="overloaded")
        if getattr(exc, "retry_after_s", None) is not None:  # NOTE: admission's drain estimate
            retry_after = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
        return _json(body, 429, retry_after)
    if isinstance(exc, NoWorkerAvailable):
        return _json(error_body(str(exc), type="service_unavailable"), 503, retry_after)
    if isinstance(exc, DispatchTimeout):
        return _json(error_body(str(exc), type="timeout"), 504)
    logger.warning("dispatch failed: %s", exc)
    return _json(error_body(str(exc), type="server_error"), 502)


def http_error(_: Request, exc: HTTPException) -> Response[ErrorBody]:
    """Litestar's own (unknown route 404, wrong method 405, body over the limit 413)."""
    param = None
    if exc.status_code == 413:
        param = "body"
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return _json(error_body(exc.detail, type=type_, param=param), exc.status_code, exc.headers)


def internal_error(_: Request, exc: Exception) -> Response[ErrorBody]:
    logger.exception("unhandled error", exc_info=exc)
    return _json(error_body("internal server error", type="server_error"), 500)


def _prompt_param(request: Request | None) -> str:
    """The field that holds the prompt: ``prompt`` on completions, else ``messages``."""
    if request is not None and request.url.path.rstrip("/").endswith("/completions") and (
        not request.url.path.rstrip("/").endswith("/chat/completions")
    ):
        return "prompt"
    return "messages"


ERROR_HANDLERS: ExceptionHandlersMap = {
    RequestError: request_error,
    DispatchError: dispatch_error,
    HTTPException: http_error,
    Exception: internal_error,
}
