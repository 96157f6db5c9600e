"""The routing policies a replay compares, by name.

Every name but ``global`` is ``gateway.routing.registry.make_router``'s: the code that serves,
not a copy. ``global`` is the single-pool upper bound; its one worker needs no routing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.routing.registry import ROUTER_NAMES, make_router
from gateway.routing.types import Decision, RouteRequest, WorkerInfo

GLOBAL = "global"


def policy_names() -> tuple[str, ...]:
    """The policies ``--policies`` accepts."""
    return (*ROUTER_NAMES, GLOBAL)


def make_policy(name: str, index: Any, **options: Any) -> Any:
    """A ``gateway.routing.types.Router`` for ``name``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name == GLOBAL:
        return SingleWorker()
    if name not in policy_names():
        raise ValueError(f"policy {name!r}: one of {', '.join(policy_names())}")
    return make_router(name, index, **options)


class SingleWorker:
    """``global``'s router: there is one worker."""

    name = GLOBAL

    def add_worker(self, info: WorkerInfo) -> None:
        pass

    def remove_worker(self, worker_id: str) -> None:
        pass

    def route(self, req: RouteRequest, candidates: Sequence[str]) -> Decision:
        return Decision(candidates[0], reason="cold")

    def dispatched(self, req: RouteRequest, worker_id: str, now_s: float) -> None:
        pass

    def first_token(self, request_id: str, now_s: float) -> None:
        pass

    def finished(self, request_id: str, now_s: float) -> None:
        pass

    def load_report(self, worker_id: str, report: object, now_s: float) -> None:
        pass

