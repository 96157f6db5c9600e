"""Cache-aware routing: the KV index the workers' events build (``index``) and the subscriber
that feeds it (``subscriber``). Importing it never imports torch."""

from gateway.routing.index import KVIndex, MatchResult
from gateway.routing.subscriber import KVEventSubscriber

__all__ = ["KVEventSubscriber", "KVIndex", "MatchResult"]
