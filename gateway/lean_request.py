"""What the OpenAI handlers read from an HTTP request, as a protocol both a litestar ``Request``
and the lane's ``LeanRequest`` (``gateway.lane``) satisfy: the app (for its ``state``), the
headers, the body, ``receive`` (for the disconnect watch) and the URL's path.

``LeanRequest`` is built straight from the ASGI scope: a dict of the headers (lower-case names,
latin-1 values, the first of a repeated name wins, as litestar's ``Headers.get``), and a body read
once with the app's limit (litestar's ``RequestEntityTooLarge``, a 413, when the announced or the
received length is over it; ``ClientDisconnected``, a 499, when the client leaves mid-body).
"""

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.types import Receive, Scope

from gateway.disconnect import ClientDisconnected


class _Url(NamedTuple):
    path: str


class HttpRequest(Protocol):
    @property
    def app(self) -> Any: ...  # NOTE: the Litestar app; handlers read ``app.state``

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def receive(self) -> Receive: ...

    @property
    def url(self) -> Any: ...  # NOTE: only ``.path`` is read

    async def body(self) -> bytes: ...


class LeanRequest:
    __slots__ = ("app", "headers", "receive", "url", "_max_body_bytes", "_body")

    def __init__(self, app: Any, scope: Scope, receive: Receive, max_body_bytes: int) -> None:
        self.app = app
        self.receive = receive
        self.url = _Url(scope["path"])
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            key = name.decode("latin-1").lower()
            if key not in headers:
                headers[key] = value.decode("latin-1")
        self.headers = headers
        self._max_body_bytes = max_body_bytes
        self._body: bytes | None = None

    async def body(self) -> bytes:
        if self._body is not None:
            return self._body
        announced = self.headers.get("content-length", "")
        if announced.isdigit() and int(announced) > self._max_body_bytes:
            raise RequestEntityTooLarge
        parts: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] != "http.request":  # NOTE: the client left mid-body
                raise ClientDisconnected(detail="client closed request")
            if chunk := message.get("body", b""):
                size += len(chunk)
                if size > self._max_body_bytes:
                    raise RequestEntityTooLarge
                parts.append(chunk)
            if not message.get("more_body", False):
                break
        self._body = parts[0] if len(parts) == 1 else b"".join(parts)
        return self._body
