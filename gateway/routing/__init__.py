"""Cache-aware routing: the KV index the workers' events build (``index``), the subscriber that
feeds it (``subscriber``), the router interface (``types``), our policy (``policy``), the
baseline routers (``baselines*``) and ``make_router`` (``registry``). Importing it never imports
torch."""

from gateway.routing.baselines import (
    LeastLoadedRouter,
    LMetricRouter,
    RoundRobinRouter,
    SessionHashRouter,
)
from gateway.routing.baselines_kv import DynamoRouter, LlmDRouter
from gateway.routing.baselines_sglang import SGLangCacheAwareRouter
from gateway.routing.index import KVIndex, MatchResult
from gateway.routing.policy import AgentgateRouter
from gateway.routing.registry import ROUTER_NAMES, make_router
from gateway.routing.subscriber import KVEventSubscriber
from gateway.routing.types import Decision, LoadTracker, Router, RouteRequest, WorkerInfo

__all__ = [
    "ROUTER_NAMES",
    "AgentgateRouter",
    "Decision",
    "DynamoRouter",
    "KVEventSubscriber",
    "KVIndex",
    "LMetricRouter",
    "LeastLoadedRouter",
    "LlmDRouter",
    "LoadTracker",
    "MatchResult",
    "RoundRobinRouter",
    "RouteRequest",
    "Router",
    "SGLangCacheAwareRouter",
    "SessionHashRouter",
    "WorkerInfo",
    "make_router",
]
