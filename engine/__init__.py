"""agentgate engine: the MiMo-V2 model, KV memory, sampling and the offline ``LLM`` API.

Importing ``engine`` (or ``engine.protocol``, later) does not import torch; the names below load
their modules on first use, so the gateway process can import the wire types and stay light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.llm import LLM, RequestOutput
    from engine.model_config import ConfigError, ModelConfig
    from engine.models.loader import CheckpointError
    from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CheckpointError",
    "ConfigError",
    "Engine",
    "EngineConfig",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
]

_LAZY = {
    "LLM": "engine.llm",
    "Engine": "engine.engine",
    "EngineConfig": "engine.config",
    "RequestOutput": "engine.llm",
    "SamplingParams": "engine.sampling_params",
    "ModelConfig": "engine.model_config",
    "ConfigError": "engine.model_config",
    "CheckpointError": "engine.models.loader",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
