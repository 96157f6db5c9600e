"""Routers by name: the one place the gateway (``--router``) and ``agentgate replay`` turn a policy
name into a ``Router``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.routing.baselines import (
    LeastLoadedRouter,
    LMetricRouter,
    RoundRobinRouter,
    SessionHashRouter,
)
from gateway.routing.baselines_kv import DynamoRouter, LlmDRouter
from gateway.routing.baselines_sglang import SGLangCacheAwareRouter
from gateway.routing.index import KVIndex
from gateway.routing.types import Router

ROUTER_NAMES = ("agentgate", "round-robin", "least-loaded", "session-hash",
                "sglang-cache-aware", "dynamo", "llm-d", "lmetric")
NEEDS_INDEX = frozenset({"agentgate", "dynamo", "llm-d", "lmetric"})


def make_router(name: str, index: KVIndex | None, **options: Any) -> Router:
    """A new router named ``name``, configured by ``options`` (its constructor's keywords).

    Args:
        name: one of ``ROUTER_NAMES``.
        index: the KV index its events feed; None for routers that need none (round-robin,
            least-loaded, session-hash; sglang-cache-aware keeps its own tree and takes only
            the page size from the index, else from the first worker announced).

    Raises:
        ValueError: an unknown name, or a router that reads the index given none.
        TypeError: an option the router does not take.
    """
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown router {name!r}; known: {', '.join(ROUTER_NAMES)}")
    if name in NEEDS_INDEX and index is None:
        raise ValueError(f"router {name!r} reads the KV index: pass one")
    return factory(index, **options)


def _agentgate(index: KVIndex | None, **options: Any) -> Router:
    # NOTE: imported here so the baselines never depend on the policy module at import time
    from gateway.routing.policy import AgentgateRouter

    assert index is not None
    return AgentgateRouter(index, **options)


def _no_index(cls: Callable[..., Router]) -> Callable[..., Router]:
    return lambda index, **options: cls(**options)


def _with_index(cls: Callable[..., Router]) -> Callable[..., Router]:
    return lambda index, **options: cls(index, **options)


_FACTORIES: dict[str, Callable[..., Router]] = {
    "agentgate": _agentgate,
    "round-robin": _no_index(RoundRobinRouter),
    "least-loaded": _no_index(LeastLoadedRouter),
    "session-hash": _no_index(SessionHashRouter),
    "sglang-cache-aware": _with_index(SGLangCacheAwareRouter),
    "dynamo": _with_index(DynamoRouter),
    "llm-d": _with_index(LlmDRouter),
    "lmetric": _with_index(LMetricRouter),
}
assert tuple(_FACTORIES) == ROUTER_NAMES
