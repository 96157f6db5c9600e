"""``/health`` (the process is up) and ``/ready`` (at least one worker is alive)."""

from litestar import Controller, Response, get
from litestar.di import NamedDependency

from gateway.dispatch import Dispatcher
from gateway.schemas import ErrorBody, error_body


class HealthController(Controller):
    path = "/"

    @get("/health", sync_to_thread=False)
    def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @get("/ready", sync_to_thread=False)
    def ready(
        self, dispatcher: NamedDependency[Dispatcher]
    ) -> Response[dict[str, object] | ErrorBody]:
        alive = sum(c.is_alive for c in dispatcher.clients)
        if alive:
            return Response({"status": "ready", "workers_alive": alive})
        body = error_body(f"no live worker among {len(dispatcher.clients)}",
                          type="service_unavailable")
        return Response(body, status_code=503)
