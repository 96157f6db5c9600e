"""``/health`` (the process is up) and ``/ready`` (at least one worker is alive and the session
store answers). A ``/ready`` 503 names the part that failed: the workers ("no live worker"), or
the session store (``param`` "sessions")."""

from litestar import Controller, Response, get
from litestar.di import NamedDependency

from gateway.dispatch import Dispatcher
from gateway.lifespan import SessionsState
from gateway.schemas import ErrorBody, error_body
from sessions import StoreUnavailable


class HealthController(Controller):
    path = "/"

    @get("/health", sync_to_thread=False)
    def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @get("/ready")
    async def ready(
        self, dispatcher: NamedDependency[Dispatcher], sessions: NamedDependency[SessionsState]
    ) -> Response[dict[str, object] | ErrorBody]:
        alive = sum(c.is_alive for c in dispatcher.clients)
        if not alive:
            body = error_body(f"no live worker among {len(dispatcher.clients)}",
                              type="service_unavailable")
            return Response(body, status_code=503)
        try:
            await sessions.manager.store.ping()
        except StoreUnavailable as exc:
            body = error_body(f"sessions: {exc.message}", type="service_unavailable",
                              param="sessions", code="service_unavailable")
            return Response(body, status_code=503)
        return Response({"status": "ready", "workers_alive": alive, "sessions": "ok"})
