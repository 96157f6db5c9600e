"""The gate in front of every request when API keys are configured (``gateway.api_keys``): a
missing or unknown key is a 401, a tenant over one of its limits a 429 with ``Retry-After``;
otherwise the request runs, holding one of its tenant's concurrent slots until its response (a
stream's last event; a WebSocket's close) is done.

Open without a key: the probes (``/health``, ``/ready``, ``/metrics``: orchestrators and
Prometheus scrape them without credentials; keep ``/metrics`` inside your network) and CORS
preflights (browsers send them without credentials). A refused WebSocket gets the same JSON
error as an HTTP request where the server offers ASGI's denial response (uvicorn's default
``websockets`` protocol does), else the handshake is refused (403).

The errors are OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with code
``invalid_api_key`` (401, and ``WWW-Authenticate: Bearer``) or ``rate_limit_exceeded`` (429).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.api_keys import ApiKeys, Limited, TenantLimiter
from gateway.metrics import PREFIX
from gateway.request_id import HEADER as REQUEST_ID_HEADER
from gateway.request_id import request_id_of

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
App = Callable[[Any, Any, Any], Awaitable[None]]
_JSON = msgspec.json.Encoder()


class AuthGate:
    """Checks each request's key and its tenant's limits, then runs the app.

    Attributes:
        limiter: the tenants' buckets and requests in flight.
        unauthorized: requests refused for a missing or unknown key.
    """

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys
        self.limiter = TenantLimiter(keys.tenants)
        self.unauthorized = 0

    def tenant_of(self, authorization: str) -> str | None:
        """The tenant of an ``Authorization`` header's bearer key (None: none, or unknown)."""
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not (key := key.strip()):
            return None
        tenant = self.keys.tenant_of_key(key)
        return None if tenant is None else tenant.name

    async def __call__(self, scope: Any, receive: Any, send: Any, app: App) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope["path"] in OPEN_PATHS or (
                kind == "http" and scope["method"] == "OPTIONS"):
            await app(scope, receive, send)
            return
        authorization = next((v.decode("latin-1") for k, v in scope["headers"]
                              if k.lower() == b"authorization"), "")
        tenant = self.tenant_of(authorization)
        if tenant is None:
            self.unauthorized += 1
            message = ("Missing API key: send it as 'Authorization: Bearer KEY'."
                       if not authorization else "Invalid API key.")
            await _refuse(scope, send, 401, message, "invalid_api_key",
                          [(b"www-authenticate", b"Bearer")])
            return
        if (limited := self.limiter.acquire(tenant)) is not None:
            await _refuse(scope, send, 429, _limit_message(tenant, limited),
                          "rate_limit_exceeded",
                          [(b"retry-after", str(max(1, math.ceil(limited.retry_after_s)))
                            .encode())])
            return
        try:
            await app(scope, receive, send)
        finally:
            self.limiter.release(tenant)

    def collect(self) -> Iterator[Metric]:
        """The gate's metrics (``GatewayMetrics`` registers it)."""
        yield CounterMetricFamily(PREFIX + "auth_unauthorized",
                                  "Requests refused for a missing or unknown API key",
                                  value=self.unauthorized)
        refused = CounterMetricFamily(PREFIX + "tenant_limited",
                                      "Requests refused by a tenant's limit",
                                      labels=["tenant", "limit"])
        for (tenant, limit), n in sorted(self.limiter.refused.items()):
            refused.add_metric([tenant, limit], n)
        yield refused
        in_flight = GaugeMetricFamily(PREFIX + "tenant_in_flight_requests",
                                      "Requests of each keyed tenant in flight",
                                      labels=["tenant"])
        for tenant, n in sorted(self.limiter.in_flight.items()):
            in_flight.add_metric([tenant], n)
        yield in_flight


def _limit_message(tenant: str, limited: Limited) -> str:
    what = {"max_concurrent": "requests in flight at once",
            "requests_per_minute": "requests per minute",
            "tokens_per_minute": "tokens per minute"}[limited.limit]
    return (f"Rate limit reached for tenant {tenant!r}: {what} ({limited.limit}). Retry after "
            f"{max(1, math.ceil(limited.retry_after_s))} s.")


async def _refuse(scope: Any, send: Any, status: int, message: str, code: str,
                  headers: list[tuple[bytes, bytes]]) -> None:
    kind = "invalid_request_error" if status == 401 else "rate_limit_error"
    body = _JSON.encode({"error": {"message": message, "type": kind, "param": None,
                                   "code": code}})
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()),
               (REQUEST_ID_HEADER.encode(), request_id_of(scope).encode()), *headers]
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    elif "websocket.http.response" in scope.get("extensions", {}):
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008})
