"""Fixtures shared by the engine tests: tiny random MiMo-V2 checkpoints (written once per
session), and a paced sim worker subprocess with its clients for the worker tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.models.checkpoint import mimo_config, write_random_checkpoint
from gateway.serve import WorkerProcess, spawn_worker
from tests.engine.worker_harness import START_TIMEOUT_S, Client, Subscription

MakeCheckpoint = Callable[..., Path]


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> MakeCheckpoint:
    """``make_checkpoint(seed=0, dtype="float32", **mimo_config_kwargs) -> model_dir`` (cached)."""
    cache: dict[str, Path] = {}

    def make(*, seed: int = 0, dtype: str = "float32", **kwargs: Any) -> Path:
        key = repr((seed, dtype, sorted(kwargs.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp("ckpt")
            cache[key] = write_random_checkpoint(out, mimo_config(**kwargs), seed=seed, dtype=dtype)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(make_checkpoint: MakeCheckpoint) -> Path:
    """A small hybrid model (full first and last, W = 4) for API-level tests."""
    return make_checkpoint(layers="FSSF", sliding_window=4, eos_token_id=[7])


@pytest.fixture(scope="session")
def sim_worker() -> Iterator[WorkerProcess]:
    """A sim worker paced by the CPU cost model (``--cost cpu``), so a long request is reliably
    still running when it is aborted; on the demo geometry, worker id ``sim-test``."""
    worker = spawn_worker(model_dir=None, backend="sim", worker_id="sim-test",
                          timeout_s=START_TIMEOUT_S)
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture
def connect() -> Iterator[Callable[[str], Client]]:
    """``connect(endpoint) -> Client``; every client made is closed after the test."""
    clients: list[Client] = []

    def make(endpoint: str) -> Client:
        clients.append(Client(endpoint))
        return clients[-1]

    yield make
    for c in clients:
        c.close()


@pytest.fixture
def client(sim_worker: WorkerProcess, connect: Callable[[str], Client]) -> Client:
    return connect(sim_worker.listen)


@pytest.fixture
def subscription(sim_worker: WorkerProcess) -> Iterator[Subscription]:
    sub = Subscription(sim_worker.events)
    yield sub
    sub.close()
