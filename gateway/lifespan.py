"""One lifespan per resource the app holds on ``app.state``: the model (tokenizer, prompt cache,
context length), the dispatcher over the workers (its router, KV index and admission gate) and
the session store (which also keeps the affinity keys' workers for the dispatcher). Each is
opened at startup and closed at shutdown; nothing lives in module globals."""

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from litestar import Litestar
from litestar.datastructures import State

from engine.worker.curve import CurveClientKeys, is_loopback_endpoint
from gateway.affinity import SharedAffinity
from gateway.dispatch import Dispatcher, WorkerClient
from gateway.prompt_cache import PromptCache
from gateway.tokenizer import Tokenizer
from sessions import SessionManager, SessionPrompter, StoreUnavailable, create_session_store

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONTEXT = 8192
SHUTDOWN_TIMEOUT_S = 5.0
STARTUP_GRACE_S = 1.0  # NOTE: the most the start waits for the workers (see dispatcher_lifespan)


@dataclass(frozen=True, slots=True)
class ModelState:
    """What the handlers need to know about the served model."""

    name: str
    tokenizer: Tokenizer
    prompt_cache: PromptCache
    max_context: int  # prompt + completion tokens, from config.json max_position_embeddings
    vocab_size: int | None = None  # the model's (config.json), None when the config lacks it


def load_model(model_dir: Path, name: str | None = None) -> ModelState:
    tokenizer = Tokenizer.from_dir(model_dir)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    max_context = int(config.get("max_position_embeddings", DEFAULT_MAX_CONTEXT))
    vocab_size = config.get("vocab_size")
    return ModelState(
        name or model_dir.name, tokenizer, PromptCache(tokenizer), max_context,
        int(vocab_size) if vocab_size is not None else None,
    )


@asynccontextmanager
async def model_lifespan(app: Litestar) -> AsyncIterator[None]:
    cfg = app.state.cfg
    name = (cfg.served_model_names or (cfg.model_name,))[0]  # NOTE: the name in responses
    app.state.model = await asyncio.to_thread(load_model, cfg.model_dir, name)
    try:
        yield
    finally:
        del app.state.model


@asynccontextmanager
async def media_lifespan(app: Litestar) -> AsyncIterator[None]:
    """``app.state.media``: the images and video of requests (``gateway.media``), over the
    encoder services of ``cfg.encoders`` (none: media parts are a 400)."""
    from encoders.fetch import FetchPolicy
    from encoders.media import MediaLimits
    from encoders.service import EncoderClient
    from gateway.media import MediaPipeline

    cfg = app.state.cfg
    limits = MediaLimits(max_images_per_request=cfg.max_images_per_request)
    policy = FetchPolicy(allow_urls=cfg.allow_media_urls, allowlist=cfg.media_url_allowlist,
                         timeout_s=limits.fetch_timeout_s)
    client = EncoderClient(cfg.encoders) if cfg.encoders else None
    app.state.media = MediaPipeline.for_tokenizer(client, app.state.model.tokenizer,
                                                  limits=limits, policy=policy)
    try:
        yield
    finally:
        await app.state.media.aclose()
        del app.state.media


@asynccontextmanager
async def dispatcher_lifespan(app: Litestar) -> AsyncIterator[None]:
    """A ``WorkerClient`` per endpoint, each connecting (and reconnecting) in the background.

    NOTE: the start waits at most ``STARTUP_GRACE_S`` for the workers' Welcomes, so that a
    gateway over live workers is ready when it starts listening; one that is down does not hold
    the start (``/ready`` says 503 until one is up) and is used as soon as it comes up.
    """
    cfg = app.state.cfg
    curve = cfg.curve_keys
    _warn_unauthenticated(cfg.workers, curve)
    clients = [
        WorkerClient(
            endpoint, heartbeat_s=cfg.heartbeat_s, dead_after_s=cfg.dead_after_s,
            first_token_timeout_s=cfg.first_token_timeout_s, idle_timeout_s=cfg.idle_timeout_s,
            curve=curve,
        )
        for endpoint in cfg.workers
    ]
    # NOTE: made before the clients start, so that the router hears of every Welcome
    dispatcher = Dispatcher(
        clients, router=cfg.router, index_max_pages=cfg.index_max_pages,
        admission=_admission_gate(cfg), migration_limit=cfg.migration_limit,
    )
    # NOTE: tool-pause retention (gateway.tool_pauses), its TTL default from --retain-ttl
    dispatcher.retention = _retention(cfg, dispatcher)  # type: ignore[attr-defined]
    if (gate := getattr(app, "auth_gate", None)) is not None:
        dispatcher.on_tokens = gate.limiter.charge  # NOTE: the keyed tenants' token budgets
    for client in clients:
        client.start()
    await _await_welcomes(clients, STARTUP_GRACE_S)
    app.state.dispatcher = dispatcher
    try:
        yield
    finally:
        for client in clients:
            client.close()
        await dispatcher.close()  # NOTE: joins the KV event subscribers' threads
        del app.state.dispatcher


def _warn_unauthenticated(endpoints: tuple[str, ...], curve: CurveClientKeys | None) -> None:
    """Log the workers reached over a network in the clear (no ``--curve-keys``)."""
    remote = [ep for ep in endpoints if not is_loopback_endpoint(ep)]
    if remote and curve is None:
        logger.warning("talking to worker(s) %s without CURVE: requests and KV events cross the "
                       "network unauthenticated and in the clear (--curve-keys DIR)",
                       ", ".join(remote))


def _admission_gate(cfg: Any) -> Any:
    """The admission gate of ``cfg`` (None when ``cfg.admission`` is off)."""
    if not cfg.admission:
        return None
    from gateway.admission_gate import AdmissionGate
    from gateway.routing.admission import Admission

    return AdmissionGate(Admission(cfg.admission_config))


def _retention(cfg: Any, dispatcher: Dispatcher) -> Any:
    from gateway.routing.retention import PauseLearner, ToolPauseRetention

    learner = PauseLearner(default_ttl_s=cfg.retain_ttl_s)
    return ToolPauseRetention(learner, send_retain=dispatcher.retain)


async def _await_welcomes(clients: list[WorkerClient], timeout_s: float) -> None:
    """Wait until every client is alive or ``timeout_s`` passed; log who is not (yet)."""
    waits = [asyncio.ensure_future(c.wait_welcome()) for c in clients]
    done, pending = await asyncio.wait(waits, timeout=timeout_s)
    for task in pending:
        task.cancel()
    for client, task in zip(clients, waits, strict=True):
        if task in done and task.exception() is None:
            logger.info("connected to worker %s at %s", client.name, client.endpoint)
        elif task in done:
            logger.error("worker at %s: %s", client.endpoint, task.exception())
        else:
            logger.warning("worker at %s is not up yet: connecting in the background",
                           client.endpoint)


@dataclass(frozen=True, slots=True)
class SessionsState:
    """The session API's resources. ``background``: turn records still being written for
    requests that are gone (see ``gateway.turns.Turn.close``); awaited at shutdown."""

    manager: SessionManager
    prompter: SessionPrompter
    retain_ttl_s: float | None
    max_token_chars: int = 256  # the longest token's characters (``max_token_chars``)
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    leases: set[asyncio.Task[Any]] = field(default_factory=set)  # running turns' lease renewals


@asynccontextmanager
async def sessions_lifespan(app: Litestar) -> AsyncIterator[None]:
    """The session store ``cfg.redis_url`` names (Redis, checked with a PING), else memory.

    Raises:
        StoreUnavailable: Redis does not answer; the app does not start.
    """
    cfg = app.state.cfg
    try:
        store = await create_session_store(
            cfg.redis_url, max_sessions=cfg.max_sessions, idle_ttl_s=cfg.session_ttl_s
        )
    except StoreUnavailable as exc:
        logger.error("session store: %s", exc)
        raise
    logger.info("session store: %s", "redis" if cfg.redis_url else "memory")
    tokenizer = app.state.model.tokenizer
    prompter = SessionPrompter.for_tokenizer(tokenizer)
    app.state.sessions = state = SessionsState(
        SessionManager(store), prompter, cfg.retain_ttl_s, max_token_chars(tokenizer)
    )
    dispatcher = app.state.dispatcher
    if hasattr(store, "get_affinity"):  # NOTE: a store without it: each replica on its own
        dispatcher.affinity = SharedAffinity(store)
    try:
        yield
    finally:
        if state.background:
            await asyncio.wait(state.background, timeout=SHUTDOWN_TIMEOUT_S)
        for task in state.leases:
            task.cancel()
        if dispatcher.affinity is not None:
            await dispatcher.affinity.settle()
            dispatcher.affinity = None
        await store.close()
        del app.state.sessions


def max_token_chars(tokenizer: Tokenizer) -> int:
    """An upper bound of the characters one token covers: its longest vocabulary entry (a
    byte-level or SentencePiece token string is at least as long as the text it stands for)."""
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    return max(1, max((len(token) for token in vocab), default=1))


def provide_sessions(state: State) -> SessionsState:
    return state.sessions


def provide_model(state: State) -> ModelState:
    return state.model


def provide_dispatcher(state: State) -> Dispatcher:
    return state.dispatcher
