"""The gateway's Litestar app: ``create_app(cfg)`` assembles controllers, lifespans, dependencies
and error handlers; nothing runs at import time."""

from dataclasses import dataclass
from pathlib import Path

from litestar import Litestar
from litestar.datastructures import State
from litestar.di import Provide

from gateway.controllers.health import HealthController
from gateway.controllers.openai import (
    ChatCompletionsController,
    CompletionsController,
    ModelsController,
)
from gateway.errors import ERROR_HANDLERS
from gateway.lifespan import (
    dispatcher_lifespan,
    model_lifespan,
    provide_dispatcher,
    provide_model,
)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Attributes:
    model_dir: tokenizer files + config.json (its ``max_position_embeddings`` is the context).
    workers: the workers' ROUTER endpoints (``tcp://host:port``); at least one.
    model_name: the id in ``/v1/models`` and responses (default: ``model_dir``'s name).
    max_body_bytes: larger request bodies get 413.
    """

    model_dir: Path
    workers: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        assert self.workers, "GatewayConfig needs at least one worker endpoint"
        assert self.max_body_bytes > 0, f"{self.max_body_bytes=}"


def create_app(cfg: GatewayConfig) -> Litestar:
    return Litestar(
        route_handlers=[
            HealthController, ModelsController, ChatCompletionsController, CompletionsController
        ],
        dependencies={
            "model": Provide(provide_model, sync_to_thread=False),
            "dispatcher": Provide(provide_dispatcher, sync_to_thread=False),
        },
        lifespan=[model_lifespan, dispatcher_lifespan],
        exception_handlers=ERROR_HANDLERS,
        state=State({"cfg": cfg}),
        request_max_body_size=cfg.max_body_bytes,
    )
