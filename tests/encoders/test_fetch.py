"""``encoders.fetch``: data: URIs, the URL policy (off by default, allowlist), the public-address
check, and real fetches from a tiny HTTP server on 127.0.0.1 (``allow_private=True``): bodies,
size and time limits, redirects and HTTP errors. Every network call stays on 127.0.0.1 and every
wait is bounded."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest
from PIL import Image

from encoders.fetch import (
    URLS_OFF,
    FetchPolicy,
    fetch_media,
    host_allowed,
    is_public_address,
    parse_data_uri,
)
from encoders.media import MediaError

TEST_TIMEOUT_S = 15.0
MAX_BYTES = 4096
LOCAL = FetchPolicy(allow_urls=True, allow_private=True, max_bytes=MAX_BYTES, timeout_s=5.0)


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 30, 90)).save(buf, "PNG")
    return buf.getvalue()


PNG = _png()


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, TEST_TIMEOUT_S))


def _fetch(url: str, policy: FetchPolicy = LOCAL) -> bytes:
    return _run(fetch_media(url, policy))  # type: ignore[no-any-return]


def _assert_refused(url: str, policy: FetchPolicy, *words: str) -> MediaError:
    with pytest.raises(MediaError) as info:
        _fetch(url, policy)
    for word in words:
        assert word in info.value.reason, f"{url}: {info.value.reason!r} lacks {word!r}"
    return info.value


# ---------------------------------------------------------------------- data: URIs


@pytest.mark.parametrize("uri,mime,data", [
    ("data:image/png;base64," + base64.b64encode(PNG).decode(), "image/png", PNG),
    ("data:IMAGE/PNG;charset=x;BASE64," + base64.b64encode(PNG).decode(), "image/png", PNG),
    ("data:image/png;base64," + base64.b64encode(PNG).decode().rstrip("="), "image/png", PNG),
    ("data:image/png;base64," + base64.urlsafe_b64encode(PNG).decode(), "image/png", PNG),
    ("data:image/jpeg;base64,/9j/\n4AAQ SkZJ\tRgAB", "image/jpeg",
     base64.b64decode("/9j/4AAQSkZJRgAB")),
    ("data:,hello%20world%21", "text/plain", b"hello world!"),
    ("data:image/png," + urllib.parse.quote_from_bytes(PNG), "image/png", PNG),
    ("data:image/gif;base64,", "image/gif", b""),
])
def test_data_uris_decode(uri: str, mime: str, data: bytes) -> None:
    got = parse_data_uri(uri)
    assert (got.mime, got.data) == (mime, data), got


@pytest.mark.parametrize("uri,words", [
    ("data:image/png;base64,iVBOR*w0K", "not valid base64"),
    ("data:image/png;base64,A", "not valid base64"),
    ("data:image/png;base64", "no ','"),
    ("data:image png;base64,AAAA", "media type"),
    ("http://example.com/a.png", "not a data: URI"),
])
def test_malformed_data_uris_are_media_errors(uri: str, words: str) -> None:
    with pytest.raises(MediaError, match=words):
        parse_data_uri(uri)


def test_a_data_uri_is_fetched_even_with_urls_off() -> None:
    uri = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert _fetch(uri, FetchPolicy()) == PNG


@pytest.mark.parametrize("num_bytes", [MAX_BYTES + 1, 10 * MAX_BYTES])
def test_a_data_uri_over_max_bytes_is_refused(num_bytes: int) -> None:
    policy = FetchPolicy(max_bytes=MAX_BYTES)
    uri = "data:image/png;base64," + base64.b64encode(b"\0" * num_bytes).decode()
    _assert_refused(uri, policy, "more than the limit")
    assert len(_fetch("data:image/png;base64," + base64.b64encode(b"\0" * MAX_BYTES).decode(),
                      policy)) == MAX_BYTES
    _assert_refused("data:," + "a" * num_bytes, policy, "more than the limit")


# ---------------------------------------------------------------------- URL policy


def test_urls_are_refused_when_off_and_say_how_to_enable() -> None:
    err = _assert_refused("https://example.com/cat.png", FetchPolicy(), "--allow-media-urls")
    assert err.reason == URLS_OFF


@pytest.mark.parametrize("url,words", [
    ("ftp://example.com/a.png", "unsupported URL scheme"),
    ("file:///etc/passwd", "unsupported URL scheme"),
    ("http://user:pw@example.com/a.png", "credentials"),
    ("http:///a.png", "no host"),
    ("http://example.com:99999/", "malformed URL"),
])
def test_bad_urls_are_refused_before_any_connection(url: str, words: str) -> None:
    _assert_refused(url, FetchPolicy(allow_urls=True), words)


@pytest.mark.parametrize("host,allowed", [
    ("images.example.com", True), ("IMAGES.EXAMPLE.COM.", True), ("cdn.example.org", True),
    ("a.cdn.example.org", True), ("example.org", False), ("xexample.org", False),
    ("other.example.com", False), ("images.example.com.evil.com", False), ("evil.com", False),
])
def test_the_allowlist_matches_hosts_and_subdomains(host: str, allowed: bool) -> None:
    assert host_allowed(host, ("images.example.com", "*.example.org")) is allowed, host


def test_a_host_outside_the_allowlist_is_refused_unresolved() -> None:
    policy = FetchPolicy(allow_urls=True, allowlist=("*.example.com",))
    _assert_refused("http://evil.test/cat.png", policy, "evil.test", "not in", "allowlist")


# ---------------------------------------------------------------------- public addresses


@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.8.9.10", "::1",  # loopback
    "10.1.2.3", "172.16.0.1", "192.168.1.1", "fd00::1",  # private
    "169.254.169.254", "fe80::1", "fe80::1%eth0",  # link-local (cloud metadata)
    "100.64.0.1",  # shared (CGNAT)
    "0.0.0.0", "::",  # unspecified
    "224.0.0.1", "ff02::1", "240.0.0.1", "255.255.255.255",  # multicast, reserved, broadcast
    "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254",  # IPv4-mapped
    "2002:7f00:1::", "2002:a00:1::1", "2002:a9fe:a9fe::",  # 6to4 of 127/8, 10/8, 169.254/16
    "64:ff9b::7f00:1", "64:ff9b::a00:1", "64:ff9b::a9fe:a9fe",  # NAT64 of the same
    "192.0.2.1", "2001:db8::1",  # documentation
])
def test_non_public_addresses(address: str) -> None:
    assert not is_public_address(address), address


@pytest.mark.parametrize("address", [
    "8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "2a00:1450:4001:81b::200e",
    "::ffff:8.8.8.8", "2002:808:808::1", "64:ff9b::808:808",
])
def test_public_addresses(address: str) -> None:
    assert is_public_address(address), address


# ---------------------------------------------------------------------- a real HTTP server


Route = Callable[[asyncio.StreamWriter], Awaitable[None]]


class _Server:
    """HTTP/1.1 on 127.0.0.1 with canned routes; records each request's path and headers."""

    def __init__(self) -> None:
        self.port = 0
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.routes: dict[str, Route] = {
            "/cat.png": lambda w: _respond(w, 200, PNG),
            "/big": self._big,
            "/big-declared": lambda w: _respond(w, 200, b"x" * 10,
                                                {"Content-Length": str(MAX_BYTES + 1)}),
            "/slow": self._slow,
            "/hang": lambda w: asyncio.sleep(TEST_TIMEOUT_S),
            "/moved": lambda w: _respond(w, 302, b"", {
                "Location": "http://169.254.169.254/latest/meta-data/"}),
            "/missing": lambda w: _respond(w, 404, b"not found"),
        }
        self._tasks: set[asyncio.Task[None]] = set()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            line, *fields = head.decode("latin-1").split("\r\n")
            path = line.split(" ")[1]
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (f.partition(":") for f in fields if f)}
            self.requests.append((path, headers))
            route = self.routes.get(path.split("?")[0], lambda w: _respond(w, 404, b""))
            await route(writer)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass  # NOTE: the client gave up (as the limits make it): nothing to answer
        finally:
            writer.close()
            self._tasks.discard(task)  # type: ignore[arg-type]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _big(self, writer: asyncio.StreamWriter) -> None:
        """No Content-Length, read until close: the limit must apply while reading."""
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nConnection: close\r\n\r\n")
        for _ in range(64):  # NOTE: 64 KiB at most, 16x the limit
            writer.write(b"x" * 1024)
            await writer.drain()

    async def _slow(self, writer: asyncio.StreamWriter) -> None:
        """One byte each 50 ms: every read is quick, the whole body is not."""
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(1000):
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.05)


async def _respond(writer: asyncio.StreamWriter, status: int, body: bytes,
                   headers: dict[str, str] | None = None) -> None:
    fields = {"Content-Length": str(len(body)), "Connection": "close", **(headers or {})}
    head = f"HTTP/1.1 {status} X\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items())
    writer.write(head.encode() + b"\r\n" + body)
    await writer.drain()


@contextlib.asynccontextmanager
async def _serving() -> AsyncIterator[_Server]:
    server = _Server()
    tcp = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    server.port = tcp.sockets[0].getsockname()[1]
    try:
        yield server
    finally:
        tcp.close()
        await server.close()
        await tcp.wait_closed()


async def _fetch_from(path: str, policy: FetchPolicy = LOCAL, host: str = "127.0.0.1"
                      ) -> tuple[bytes | MediaError, float, _Server]:
    """(the body or the MediaError, seconds taken, the server) of one fetch."""
    async with _serving() as server:
        start = time.monotonic()
        try:
            result: bytes | MediaError = await fetch_media(server.url(path, host), policy)
        except MediaError as exc:
            result = exc
        return result, time.monotonic() - start, server


def test_an_image_is_fetched_byte_for_byte() -> None:
    body, _, server = _run(_fetch_from("/cat.png?size=small"))
    assert body == PNG, body
    ((path, headers),) = server.requests
    assert path == "/cat.png?size=small", path
    assert headers["host"] == f"127.0.0.1:{server.port}", headers
    assert headers["accept-encoding"] == "identity", headers


def test_an_allowlisted_host_is_fetched() -> None:
    policy = FetchPolicy(allow_urls=True, allow_private=True, allowlist=("127.0.0.1",))
    body, _, _ = _run(_fetch_from("/cat.png", policy))
    assert body == PNG, body


def test_a_body_over_max_bytes_is_refused_while_reading() -> None:
    err, _, server = _run(_fetch_from("/big"))
    assert isinstance(err, MediaError) and "more than the limit" in err.reason, err
    assert [p for p, _ in server.requests] == ["/big"], server.requests


def test_a_declared_length_over_max_bytes_is_refused_before_reading() -> None:
    err, _, _ = _run(_fetch_from("/big-declared"))
    assert isinstance(err, MediaError) and "more than the limit" in err.reason, err


@pytest.mark.parametrize("path", ["/slow", "/hang"])
def test_one_deadline_bounds_the_whole_fetch(path: str) -> None:
    policy = FetchPolicy(allow_urls=True, allow_private=True, timeout_s=0.5)
    err, took_s, _ = _run(_fetch_from(path, policy))
    assert isinstance(err, MediaError) and "more than 0.5 s" in err.reason, err
    assert 0.4 <= took_s < 2.0, f"{path}: refused after {took_s:.2f} s, the deadline is 0.5 s"


def test_a_redirect_is_refused_and_names_its_location() -> None:
    err, _, server = _run(_fetch_from("/moved"))
    assert isinstance(err, MediaError), err
    assert "302" in err.reason and "http://169.254.169.254/latest/meta-data/" in err.reason, err
    assert [p for p, _ in server.requests] == ["/moved"], "the redirect was followed"


def test_an_http_error_is_refused() -> None:
    err, _, _ = _run(_fetch_from("/missing"))
    assert isinstance(err, MediaError) and "HTTP 404" in err.reason, err


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "2130706433", "0x7f.1"])
def test_a_local_address_is_refused_without_allow_private(host: str) -> None:
    policy = FetchPolicy(allow_urls=True)
    err, _, server = _run(_fetch_from("/cat.png", policy, host=host))
    assert isinstance(err, MediaError), err
    if host not in ("2130706433", "0x7f.1"):  # NOTE: inet_aton forms: 127.0.0.1, or no name
        assert "not a public address" in err.reason, err
    assert "not a public address" in err.reason or "cannot resolve" in err.reason, err
    assert server.requests == [], f"{host}: the server was reached"


def test_a_name_is_resolved_once_and_only_its_checked_address_is_connected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DNS rebinding: a name that resolves to a checked address first and elsewhere later is
    connected to the first answer; the URL keeps the name (Host header)."""
    asked: list[str] = []

    async def scenario() -> tuple[bytes, _Server]:
        loop = asyncio.get_running_loop()
        real = loop.getaddrinfo

        async def rebinding(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
            if host != "media.test":
                return await real(host, port, *args, **kwargs)
            asked.append(host)
            address = "127.0.0.1" if len(asked) == 1 else "10.9.9.9"  # NOTE: never reached
            return await real(address, port, *args, **kwargs)

        monkeypatch.setattr(loop, "getaddrinfo", rebinding)
        async with _serving() as server:
            return await fetch_media(server.url("/cat.png", "media.test"), LOCAL), server

    body, server = _run(scenario())
    assert body == PNG and asked == ["media.test"], asked
    ((_, headers),) = server.requests
    assert headers["host"] == f"media.test:{server.port}", headers


def test_a_name_with_any_non_public_address_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> MediaError:
        loop = asyncio.get_running_loop()

        async def mixed(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
            assert host == "mixed.test", host
            return [(2, 1, 6, "", ("93.184.216.34", port)), (2, 1, 6, "", ("10.0.0.7", port))]

        monkeypatch.setattr(loop, "getaddrinfo", mixed)
        with pytest.raises(MediaError) as info:
            await fetch_media("http://mixed.test/cat.png", FetchPolicy(allow_urls=True))
        return info.value

    err = _run(scenario())
    assert "mixed.test resolves to 10.0.0.7" in err.reason, err
