"""Fixtures shared by the gateway tests: the demo model, a zero-cost sim worker, and a live
``agentgate serve``. Session-scoped, so the suite starts each once; a test that kills or
reconfigures a worker starts its own."""

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from engine.models.checkpoint import DEMO_CONFIG
from gateway.cli import init_demo_model
from gateway.lifespan import ModelState, load_model
from gateway.serve import WorkerProcess
from gateway.tokenizer import write_demo_tokenizer
from tests.gateway.dispatch_live import app_client
from tests.gateway.live import LiveGateway, live_gateway, start_sim_worker

CONTEXT = 8192
DEMO_VOCAB_SIZE = 320  # engine.models.checkpoint.DEMO_CONFIG (the sim worker's geometry)


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo checkpoint + tokenizer (what ``./scripts/run`` serves)."""
    return init_demo_model(tmp_path_factory.mktemp("demo-model") / "demo")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo tokenizer and a config.json with only the context length and the vocabulary
    size: enough for the gateway (which never loads weights) in front of a sim worker."""
    out = tmp_path_factory.mktemp("demo-tokenizer") / "demo"  # NOTE: served as model "demo"
    out.mkdir()
    write_demo_tokenizer(out)
    config = {"max_position_embeddings": CONTEXT, "vocab_size": DEMO_VOCAB_SIZE}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def sim_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo tokenizer and the whole demo config (no weights): what the sim workers and the
    gateway of an ``agentgate serve --backend sim`` both read."""
    out = tmp_path_factory.mktemp("sim-model")
    write_demo_tokenizer(out)
    (out / "config.json").write_text(json.dumps(DEMO_CONFIG))
    return out


@pytest.fixture(scope="session")
def demo_model(tokenizer_dir: Path) -> ModelState:
    """``tokenizer_dir`` loaded as the gateway loads a model (tokenizer, chat template)."""
    return load_model(tokenizer_dir, "demo")


@pytest.fixture(scope="module", params=["memory", "redis"])
def store_client(
    request: pytest.FixtureRequest, sim_worker: WorkerProcess, tokenizer_dir: Path
) -> Iterator[TestClient[Litestar]]:
    """``app_client`` on the shared sim worker, once on each session store."""
    redis_url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    with app_client(sim_worker, tokenizer_dir, redis_url=redis_url) as test_client:
        yield test_client


@pytest.fixture(scope="session")
def sim_worker() -> Iterator[WorkerProcess]:
    """A sim worker whose model costs nothing (``--cost zero``), on the demo geometry."""
    proc = start_sim_worker("gateway-tests")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def victim() -> Iterator[WorkerProcess]:
    """A paced sim worker of its own (``--cost cpu``, a few ms a step, so a long request is
    surely still running when the test kills it)."""
    worker = start_sim_worker("victim", "cpu")
    try:
        yield worker
    finally:
        worker.stop(signal.SIGKILL)


@pytest.fixture(scope="session")
def native_gateway(demo_model_dir: Path) -> Iterator[LiveGateway]:
    """``agentgate serve`` over one native worker on the demo model, shared by the client,
    agent-framework and live-session tests."""
    with live_gateway(demo_model_dir, backend="native") as live:
        yield live
