"""Starting SGLang in-process for ``agentgate worker --backend sglang`` (issue 16).

SGLang is an optional dependency (``pip install 'agentgate[sglang]'``): nothing here imports it
before ``start_engine`` runs, so ``agentgate`` works, and its tests pass, without it. Written
against SGLang 0.5.23 (``sglang/srt/entrypoints/engine.py``, ``sglang/srt/arg_groups/fields``).

``server_kwargs`` is the only place that decides SGLang's server arguments: token-id mode
(``skip_tokenizer_init``: the gateway tokenizes), incremental streaming (each streamed output
carries only its new ids, so a long answer costs O(tokens), not O(tokens^2)), priority
scheduling (``Generate.priority``, larger first, as the native engine), the llguidance grammar
backend (it reads the Lark grammars agentgate sends), KV events on a ZMQ PUB socket the worker
subscribes to, and the page size the gateway's router hashes with. ``--sglang-arg KEY=VALUE``
overrides any of them; overriding the four the adapter depends on (token-id mode aside) is
refused, since the worker would then misread SGLang's outputs or events.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

TESTED_VERSION = "0.5.23"
INSTALL_HINT = ("the sglang backend needs SGLang (>= 0.5.23, a CUDA GPU): pip install "
                "'agentgate[sglang]', or pip install sglang into this environment")
# NOTE: the adapter reads outputs and events in exactly these modes; a user's --sglang-arg may
# not change them (skip_tokenizer_init may: false gives SGLang a tokenizer, which its grammar
# backend needs for structured output)
FIXED_ARGS = ("incremental_streaming_output", "kv_events_config", "enable_priority_scheduling",
              "schedule_low_priority_values_first")


class SGLangUnavailable(RuntimeError):
    """SGLang is not installed (or does not import); the message says how to install it."""


def events_endpoint(tag: str) -> str:
    """The ipc endpoint SGLang's KV event publisher binds (ipc: SGLang binds rather than connects;
    a per-process path, so two workers on one host never share it)."""
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'agentgate-sglang-{tag}-kv')}"


def server_kwargs(model: str, *, page_size: int, events: str, tp_size: int = 1,
                  dtype: str | None = None, user_args: Mapping[str, Any] | None = None
                  ) -> dict[str, Any]:
    """SGLang's server arguments (``sglang.Engine(**kwargs)``) for one agentgate worker.

    Raises:
        ValueError: ``user_args`` sets one of ``FIXED_ARGS``, or ``page_size`` is not positive.
    """
    if page_size < 1:
        raise ValueError(f"--page-size {page_size}: must be >= 1")
    user_args = dict(user_args or {})
    fixed = sorted(set(user_args) & set(FIXED_ARGS))
    if fixed:
        raise ValueError(f"--sglang-arg {', '.join(fixed)}: set by the worker (its outputs and "
                         "KV events are read in that mode); leave it out")
    kwargs: dict[str, Any] = {
        "model_path": model,
        "tp_size": tp_size,
        "page_size": page_size,
        "skip_tokenizer_init": True,
        "incremental_streaming_output": True,
        "enable_priority_scheduling": True,
        "grammar_backend": "llguidance",
        "kv_events_config": json.dumps({"publisher": "zmq", "endpoint": events, "topic": ""},
                                       separators=(",", ":")),
        "log_level": "warning",
    }
    if dtype is not None:
        kwargs["dtype"] = dtype
    kwargs.update(user_args)
    return kwargs


@dataclass
class SGLangHandle:
    """What the worker uses of a running ``sglang.Engine`` (``engine.sglang_backend.worker``
    talks to this surface only, so its tests can run a stand-in without a GPU).

    Attributes:
        page_size: SGLang's KV page size, as it resolved it (the block size of its events).
        max_context: the longest prompt + output one request may have.
        max_batched_tokens: SGLang's chunked-prefill size (0 when unknown).
        supports_cache_salt: ``async_generate`` takes ``cache_salt`` (SGLang's per-request
            prefix-cache namespace; 0.5.23 has it).
        has_grammar: SGLang has a grammar backend (it has none in token-id mode: its grammar
            compiler needs the tokenizer).
        incremental: streamed outputs carry only their new ids.
        events: SGLang's KV event endpoint (the worker's SUB connects there).
    """

    engine: Any
    page_size: int
    max_context: int
    max_batched_tokens: int
    supports_cache_salt: bool
    has_grammar: bool
    incremental: bool
    events: str

    async def generate(self, kwargs: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """SGLang's streamed output dicts for one request (``Engine.async_generate``)."""
        stream = await self.engine.async_generate(**kwargs)
        async for out in stream:
            yield out

    def abort(self, rid: str) -> None:
        self.engine.tokenizer_manager.abort_request(rid)

    async def flush(self) -> None:
        await self.engine.tokenizer_manager.flush_cache()

    async def load(self) -> dict[str, Any]:
        """SGLang's load snapshot of its (one) scheduler: ``LoadSnapshot`` fields by name."""
        snapshots = await self.engine.tokenizer_manager.get_loads()
        if not snapshots:
            return {}
        snap = snapshots[0]
        return {name: getattr(snap, name) for name in (
            "num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens")}

    def shutdown(self) -> None:
        self.engine.shutdown()


def start_engine(kwargs: dict[str, Any]) -> SGLangHandle:
    """Start ``sglang.Engine(**kwargs)`` (loads the model; minutes on a large one).

    Raises:
        SGLangUnavailable: SGLang is not installed or fails to import.
    """
    try:
        import sglang
    except Exception as e:  # NOTE: ImportError, or a CUDA library it fails to load
        raise SGLangUnavailable(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from None
    version = getattr(sglang, "__version__", "?")
    if version != TESTED_VERSION:
        logger.warning("SGLang %s: the adapter was written against %s", version, TESTED_VERSION)
    engine = sglang.Engine(**kwargs)
    info = engine.get_server_info()
    params = inspect.signature(engine.async_generate).parameters
    manager = engine.tokenizer_manager
    return SGLangHandle(
        engine=engine, page_size=int(info.get("page_size") or kwargs["page_size"]),
        max_context=int(getattr(manager, "context_len", 0) or info.get("context_length") or 0),
        max_batched_tokens=int(info.get("chunked_prefill_size") or 0),
        supports_cache_salt="cache_salt" in params,
        has_grammar=not info.get("skip_tokenizer_init", True),
        incremental=bool(info.get("incremental_streaming_output", False)), events=json.loads(
            kwargs["kv_events_config"])["endpoint"])
