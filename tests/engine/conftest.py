"""Tiny random MiMo-V2 checkpoints, written once per session and shared by the engine tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.models.checkpoint import mimo_config, write_random_checkpoint

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
