"""The gateway's Litestar app: ``create_app(cfg)`` assembles controllers, lifespans, dependencies
and error handlers; nothing runs at import time. Every response carries an ``x-request-id``
(``gateway.request_id``); with ``cors_origins``, CORS headers for those origins."""

from dataclasses import dataclass
from pathlib import Path

from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig

from engine.worker.curve import CurveClientKeys
from gateway.api_keys import ApiKeys
from gateway.attempts import DEFAULT_MIGRATION_LIMIT
from gateway.auth_gate import AuthGate
from gateway.controllers.health import HealthController
from gateway.controllers.metrics import MetricsPlugin
from gateway.controllers.openai import (
    ChatCompletionsController,
    CompletionsController,
    ModelsController,
)
from gateway.controllers.sessions import SessionsController, session_ws
from gateway.errors import ERROR_HANDLERS
from gateway.lane import GatewayApp
from gateway.lifespan import (
    dispatcher_lifespan,
    media_lifespan,
    model_lifespan,
    provide_dispatcher,
    provide_model,
    provide_sessions,
    sessions_lifespan,
)
from gateway.openapi import openapi_json
from gateway.request_id import HEADER as REQUEST_ID_HEADER
from gateway.request_id import (
    add_request_id_header,
    install_log_filter,
    remove_log_filter,
    request_id_middleware,
)
from gateway.routing.admission import AdmissionConfig
from gateway.routing.index import DEFAULT_MAX_PAGES
from gateway.routing.registry import ROUTER_NAMES

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_ROUTER = "agentgate"


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Attributes:
    model_dir: tokenizer files + config.json (its ``max_position_embeddings`` is the context).
    workers: the workers' ROUTER endpoints (``tcp://host:port``); at least one.
    model_name: the id in ``/v1/models`` and responses (default: ``model_dir``'s name).
    served_model_names: every name the model answers to (``--served-model-name``, repeatable);
        the first is the one in responses. Empty: ``(model_name or model_dir.name,)``.
    cors_origins: origins allowed by CORS (``--cors-origin``); empty: no CORS headers.
    tenant_secret: the per-deployment key of the tenant-id hash (``gateway.tenancy``), so that
        weak API keys cannot be guessed offline from store keys; None: a fixed domain key.
    max_body_bytes: larger request bodies get 413.
    redis_url: the Redis session store (``redis://host:port/db``); None keeps sessions in memory.
    max_sessions: the memory store's bound (least recently used evicted first).
    session_ttl_s: a session idle this long expires (memory and Redis alike).
    retain_ttl_s: after a turn that ended in tool calls, how long its worker keeps the resume
        point until a pause has been learned (``gateway.routing.retention``); 0 turns it off.
    heartbeat_s, dead_after_s: a worker silent for ``dead_after_s`` (heartbeats every
        ``heartbeat_s``) is marked dead; its requests fail over or end with an error.
    first_token_timeout_s, idle_timeout_s: a request aborts (504) when its first token, or its
        next one, takes longer.
    router: the routing policy (``gateway.routing.registry.ROUTER_NAMES``; ``--router``).
    index_max_pages: the bound of the router's KV index (page entries over all workers).
    admission: queue requests per worker by uncached length and cache hits, and pass the
        priority to the engine (``--no-admission`` turns it off).
    admission_config: its buckets, shares, tenant weights and queue bounds
        (``gateway.routing.admission.AdmissionConfig``; ``--admission-*``, ``--tenant-weight``).
    api_keys: the keys and their tenants' limits (``gateway.api_keys``; ``--api-keys``): every
        request but the probes needs one. None: open, each bearer key its own tenant.
    migration_limit: how many times a stream whose worker is lost after its first token may
        go on on another worker (``gateway.attempts``; ``--migration-limit``); 0: it ends with
        an error.
    curve_keys: the gateway's CURVE keys (``engine.worker.curve``; ``--curve-keys``): its DEALER,
        SUB and replay sockets connect to the workers as CURVE clients. None: plain.
    encoders: the encoder services' ROUTER endpoints (``--encoder``; ``serve`` starts one for a
        model with a vision tower); empty: image and video parts are a 400.
    allow_media_urls: fetch http(s) media URLs (``--allow-media-urls``); off, only ``data:``
        URIs are taken. Fetches never reach loopback, private or link-local addresses.
    media_url_allowlist: hosts media URLs may name (``example.com``, ``*.example.com``); empty:
        any public host.
    max_images_per_request: images and video frames in one request (more is a 400).
    """

    model_dir: Path
    workers: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    served_model_names: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    tenant_secret: bytes | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    redis_url: str | None = None
    max_sessions: int = 10_000
    session_ttl_s: float = 3600.0
    retain_ttl_s: float = 60.0
    heartbeat_s: float = 1.0
    dead_after_s: float = 3.0
    first_token_timeout_s: float = 60.0
    idle_timeout_s: float = 30.0
    router: str = DEFAULT_ROUTER
    index_max_pages: int = DEFAULT_MAX_PAGES
    admission: bool = True
    admission_config: AdmissionConfig = AdmissionConfig()
    api_keys: ApiKeys | None = None
    migration_limit: int = DEFAULT_MIGRATION_LIMIT
    curve_keys: CurveClientKeys | None = None
    encoders: tuple[str, ...] = ()
    allow_media_urls: bool = False
    media_url_allowlist: tuple[str, ...] = ()
    max_images_per_request: int = 16

    def __post_init__(self) -> None:
        assert self.workers, "GatewayConfig needs at least one worker endpoint"
        assert self.max_body_bytes > 0, f"{self.max_body_bytes=}"
        assert self.max_sessions > 0 and self.session_ttl_s > 0, f"{self}: session bounds > 0"
        assert self.retain_ttl_s >= 0, f"{self.retain_ttl_s=}"
        assert 0 < self.heartbeat_s < self.dead_after_s, f"{self}: 0 < heartbeat_s < dead_after_s"
        assert min(self.first_token_timeout_s, self.idle_timeout_s) > 0, f"{self}: timeouts > 0"
        assert self.router in ROUTER_NAMES, f"router={self.router!r}: one of {ROUTER_NAMES}"
        assert self.index_max_pages > 0, f"{self.index_max_pages=}"
        assert self.migration_limit >= 0, f"{self.migration_limit=}"
        assert self.max_images_per_request > 0, f"{self.max_images_per_request=}"


def create_app(cfg: GatewayConfig) -> GatewayApp:
    app = GatewayApp(
        route_handlers=[
            HealthController, ModelsController, ChatCompletionsController, CompletionsController,
            openapi_json, SessionsController, session_ws,
        ],
        dependencies={
            "model": Provide(provide_model, sync_to_thread=False),
            "dispatcher": Provide(provide_dispatcher, sync_to_thread=False),
            "sessions": Provide(provide_sessions, sync_to_thread=False),
        },
        lifespan=[model_lifespan, media_lifespan, dispatcher_lifespan, sessions_lifespan],
        exception_handlers=ERROR_HANDLERS,
        state=State({"cfg": cfg}),
        request_max_body_size=cfg.max_body_bytes,
        openapi_config=OpenAPIConfig(title="agentgate", version=_version()),
        plugins=[MetricsPlugin()],  # NOTE: GET /metrics; its lifespan runs after the ones above
        middleware=[request_id_middleware],
        before_send=[add_request_id_header],
        on_startup=[install_log_filter],
        on_shutdown=[remove_log_filter],
        cors_config=_cors(cfg.cors_origins),
    )
    if cfg.api_keys is not None:
        app.auth_gate = AuthGate(cfg.api_keys)
    return app


def _cors(origins: tuple[str, ...]) -> CORSConfig | None:
    """Browsers at ``origins`` may call the API (with a bearer key) and read the request id."""
    if not origins:
        return None
    return CORSConfig(
        allow_origins=list(origins), allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
        allow_headers=["Authorization", "Content-Type", REQUEST_ID_HEADER],
        expose_headers=[REQUEST_ID_HEADER, "Retry-After"], max_age=600,
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentgate")
    except PackageNotFoundError:
        return "0.0.0"
