"""``GET /metrics`` (Prometheus text format) and its wiring, one ``MetricsPlugin()`` per app: the
controller, an HTTP middleware counting every routed response by endpoint and status and timing
it to the last body byte, a ``before_send`` hook counting the responses no route matched (404,
405) under ``endpoint="unmatched"``, and a lifespan that puts a ``GatewayMetrics`` on
``app.state.metrics`` once the model and the dispatcher are up (so it is listed after them)."""

import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from litestar import Controller, Litestar, Response, get
from litestar.config.app import AppConfig
from litestar.datastructures import State
from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.plugins import InitPlugin
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.metrics import GatewayMetrics, HttpStats

UNMATCHED = "unmatched"
# NOTE: what generate_latest writes; litestar appends the charset itself
MEDIA_TYPE = "text/plain; version=0.0.4"


class MetricsController(Controller):
    path = "/metrics"
    include_in_schema = False

    @get(sync_to_thread=False)
    def scrape(self, state: State) -> Response[bytes]:
        return Response(state.metrics.render(), media_type=MEDIA_TYPE)


class MetricsPlugin(InitPlugin):
    """Adds ``/metrics`` and what feeds it to the app being built (see the module docstring)."""

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        http = HttpStats()
        app_config.route_handlers.append(MetricsController)
        app_config.middleware.append(MetricsMiddleware(http))
        app_config.before_send.append(_count_unmatched(http))
        app_config.lifespan.append(_metrics_lifespan(http))
        return app_config


class MetricsMiddleware(ASGIMiddleware):
    scopes = (ScopeType.HTTP,)

    def __init__(self, http: HttpStats) -> None:
        self.http = http

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        start_s = time.perf_counter()
        status = 500  # NOTE: kept when the app fails before it starts a response

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await next_app(scope, receive, send_status)
        finally:
            endpoint = scope.get("path_template", UNMATCHED)
            self.http.observe(endpoint, status, time.perf_counter() - start_s)


def _count_unmatched(http: HttpStats) -> Callable[[Message, Scope], Coroutine[Any, Any, None]]:
    async def count(message: Message, scope: Scope) -> None:
        if message["type"] == "http.response.start" and "route_handler" not in scope:
            http.count(UNMATCHED, message["status"])

    return count


def _metrics_lifespan(
    http: HttpStats,
) -> Callable[[Litestar], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def metrics_lifespan(app: Litestar) -> AsyncIterator[None]:
        state = app.state
        sessions = state.sessions.manager.stats if "sessions" in state else None
        state.metrics = GatewayMetrics(http, state.dispatcher, state.model.prompt_cache, sessions)
        if (gate := getattr(app, "auth_gate", None)) is not None:
            state.metrics.registry.register(gate)
        if (media := state.get("media")) is not None:
            state.metrics.registry.register(media)  # NOTE: agentgate_media_* (gateway.media)
        try:
            yield
        finally:
            del state.metrics

    return metrics_lifespan
