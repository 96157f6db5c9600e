"""Suite-wide hooks: tests marked `gpu` are skipped when CUDA is not available."""

import os

import pytest

# NOTE: the models under test are tiny; on a 2-core box shared with other work, torch's intra-op
# threads only add contention (each small op then waits on a busy core). One thread per process,
# set before anything imports torch; subprocesses (worker, CLI) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # NOTE: lazy, so a run without gpu tests never pays for importing torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)
