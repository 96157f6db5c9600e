"""Media bytes from a request's URL: ``data:`` URIs always, http(s) only when the gateway allows it.

An http(s) fetch is the gateway reaching out on a user's behalf (SSRF), so ``fetch_media``:

1. refuses unless ``FetchPolicy.allow_urls``, and a host outside a non-empty allowlist;
2. resolves the name once (``loop.getaddrinfo``) and refuses if ANY address is not public
   (loopback, private, link-local, multicast, reserved, unspecified, shared; IPv4-mapped, 6to4
   and NAT64 IPv6 checked as the IPv4 inside);
3. connects only to those checked addresses: httpx's transport layer (httpcore) gets a network
   backend (``_PinnedBackend``) whose ``connect_tcp`` maps the URL's host to the checked IPs and
   refuses any other host, so nothing resolves the name again (no DNS rebinding), while the URL
   keeps the name: the Host header, TLS SNI and certificate check use the name;
4. follows no redirect (a 3xx is refused with its Location: the target was never checked), sends
   ``Accept-Encoding: identity`` (no compression bombs), stops reading past ``max_bytes``, and
   bounds everything (DNS, connect, TLS, body) by one ``timeout_s`` deadline.

Every failure is a ``MediaError`` (``encoders.media``) whose reason the user can act on.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import ipaddress
import re
import socket
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import NamedTuple

import httpcore

from encoders.media import MediaError, MiB

URLS_OFF = ("fetching URLs is off; send the image as a data: URI or start the gateway with "
            "--allow-media-urls")
USER_AGENT = b"agentgate-media-fetch/1"
_MIME = re.compile(r"[a-z0-9!#$&^_.+-]+/[a-z0-9!#$&^_.+-]+")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_URLSAFE = str.maketrans("-_", "+/")


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    """What ``fetch_media`` may fetch.

    Attributes:
        allow_urls: fetch http(s) URLs at all (data: URIs are always accepted).
        allowlist: host patterns, "example.com" (that host) or "*.example.com" (its subdomains);
            empty means any public host.
        max_bytes: the most bytes one medium may have (a data: URI's decoded bytes too).
        timeout_s: one deadline for DNS, connect, TLS and the whole body.
        allow_private: skip the public-address check (tests against 127.0.0.1 only).
    """

    allow_urls: bool = False
    allowlist: tuple[str, ...] = ()
    max_bytes: int = 20 * MiB
    timeout_s: float = 10.0
    allow_private: bool = False

    def __post_init__(self) -> None:
        assert self.max_bytes > 0 and self.timeout_s > 0, self
        for pattern in self.allowlist:
            host = pattern.removeprefix("*.")
            assert host and "*" not in host and "/" not in host and ":" not in host, (
                f"allowlist pattern {pattern!r}: want 'example.com' or '*.example.com'")


class DataURI(NamedTuple):
    mime: str  # lower case, without parameters; "text/plain" when the URI names none
    data: bytes


def parse_data_uri(url: str) -> DataURI:
    """``data:[<mime>][;param...][;base64],<data>``: base64 (standard or URL-safe alphabet,
    whitespace and missing padding tolerated) or percent-encoded.

    Raises:
        MediaError: not a data: URI, no ',', a malformed media type or base64.
    """
    if url[:5].lower() != "data:":
        raise MediaError("not a data: URI")
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise MediaError("malformed data: URI: no ',' before the data")
    params = [p.strip().lower() for p in header.split(";")]
    is_base64 = len(params) > 1 and params[-1] == "base64"
    mime = params[0] or "text/plain"
    if not _MIME.fullmatch(mime):
        raise MediaError(f"malformed data: URI: media type {params[0][:40]!r}")
    if not is_base64:
        return DataURI(mime, urllib.parse.unquote_to_bytes(payload))
    text = "".join(urllib.parse.unquote(payload).split()).translate(_URLSAFE)
    try:
        return DataURI(mime, base64.b64decode(text + "=" * (-len(text) % 4), validate=True))
    except (binascii.Error, ValueError):
        raise MediaError("malformed data: URI: the data is not valid base64") from None


def host_allowed(host: str, allowlist: tuple[str, ...]) -> bool:
    """Whether ``host`` matches a pattern ("a.com" exactly, "*.a.com" any subdomain of a.com)."""
    host = host.rstrip(".").lower()
    for pattern in (p.rstrip(".").lower() for p in allowlist):
        if pattern.startswith("*."):
            if host.endswith(pattern[1:]) and len(host) > len(pattern) - 1:
                return True
        elif host == pattern:
            return True
    return False


def is_public_address(address: str) -> bool:
    """False for loopback, private, link-local, multicast, reserved, unspecified and shared
    (CGNAT) addresses; an IPv6 address that carries an IPv4 one is judged by that one."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # NOTE: drop an IPv6 scope ("%eth0")
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NAT64:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        else:
            ip = ip.ipv4_mapped or ip.sixtofour or ip
    return ip.is_global and not (ip.is_loopback or ip.is_link_local or ip.is_private
                                 or ip.is_multicast or ip.is_reserved or ip.is_unspecified)


async def fetch_media(url: str, policy: FetchPolicy) -> bytes:
    """The bytes at ``url`` under ``policy`` (see the module docstring for the checks).

    Raises:
        MediaError: URLs off, a bad or disallowed URL, a non-public address, a redirect, an HTTP
            error, more than ``policy.max_bytes``, past ``policy.timeout_s``, a network error.
    """
    if url[:5].lower() == "data:":
        if len(url) > policy.max_bytes * 4 // 3 + 1024:  # NOTE: base64 is 4/3 of the bytes
            raise MediaError(_too_big(policy.max_bytes))
        data = parse_data_uri(url).data
        if len(data) > policy.max_bytes:
            raise MediaError(_too_big(policy.max_bytes))
        return data
    target = _parse_url(url)
    if not policy.allow_urls:
        raise MediaError(URLS_OFF)
    if policy.allowlist and not host_allowed(target.host, policy.allowlist):
        raise MediaError(f"host {target.host} is not in the gateway's media URL allowlist")
    try:
        async with asyncio.timeout(policy.timeout_s):
            addresses = await _resolve(target, policy)
            return await _get(target, addresses, policy)
    except TimeoutError:
        raise MediaError(f"fetching from {target.host} took more than "
                         f"{policy.timeout_s:g} s") from None


class _Target(NamedTuple):
    scheme: str
    host: str  # ASCII (IDNA), lower case, no brackets
    port: int
    path: str  # path and query, percent-encoded

    def host_header(self) -> bytes:
        host = f"[{self.host}]" if ":" in self.host else self.host
        is_default = self.port == (443 if self.scheme == "https" else 80)
        return (host if is_default else f"{host}:{self.port}").encode()



def _parse_url(url: str) -> _Target:
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise MediaError(f"malformed URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise MediaError(f"unsupported URL scheme {scheme[:20]!r}: send an http(s) URL or a "
                         "data: URI")
    if not parts.hostname:
        raise MediaError("malformed URL: no host")
    if parts.username is not None or parts.password is not None:
        raise MediaError("URLs with credentials (user:password@) are not fetched")
    try:
        host = parts.hostname.encode("idna").decode("ascii")
    except UnicodeError:
        raise MediaError(f"malformed URL: host {parts.hostname[:80]!r}") from None
    path = urllib.parse.quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
    query = urllib.parse.quote(parts.query, safe="/%:@!$&'()*+,;=-._~?")
    return _Target(scheme, host, port or (443 if scheme == "https" else 80),
                   path + (f"?{query}" if query else ""))


async def _resolve(target: _Target, policy: FetchPolicy) -> list[str]:
    """The name's addresses, each checked; resolved once, here, and never again."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except OSError:
        raise MediaError(f"cannot resolve host {target.host}") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise MediaError(f"cannot resolve host {target.host}")
    if not policy.allow_private:
        for address in addresses:
            if not is_public_address(address):
                raise MediaError(f"host {target.host} resolves to {address}, which is not a "
                                 "public address; media is fetched only from public hosts")
    return addresses


async def _get(target: _Target, addresses: list[str], policy: FetchPolicy) -> bytes:
    timeouts = {"connect": policy.timeout_s, "read": policy.timeout_s,
                "write": policy.timeout_s, "pool": policy.timeout_s}
    url = httpcore.URL(scheme=target.scheme.encode(), host=target.host.encode(),
                       port=target.port, target=target.path.encode())
    headers = [(b"Host", target.host_header()), (b"User-Agent", USER_AGENT),
               (b"Accept", b"*/*"), (b"Accept-Encoding", b"identity")]
    pool = httpcore.AsyncConnectionPool(ssl_context=_ssl_context(), retries=0,
                                        network_backend=_PinnedBackend(target.host, addresses))
    try:
        async with pool, pool.stream(b"GET", url, headers=headers,
                                     extensions={"timeout": timeouts}) as response:
            _check_response(target, response, policy)
            body = bytearray()
            async for chunk in response.aiter_stream():
                body += chunk
                if len(body) > policy.max_bytes:
                    raise MediaError(_too_big(policy.max_bytes))
            return bytes(body)
    except httpcore.TimeoutException:
        raise TimeoutError from None  # NOTE: fetch_media words it, as the overall deadline
    except httpcore.ConnectError as exc:
        raise MediaError(f"cannot connect to {target.host}: {exc or 'refused'}") from None
    except httpcore.NetworkError as exc:
        raise MediaError(f"network error fetching from {target.host}: {exc}") from None
    except httpcore.ProtocolError as exc:
        raise MediaError(f"{target.host} sent a malformed HTTP response: {exc}") from None


def _check_response(target: _Target, response: httpcore.Response, policy: FetchPolicy) -> None:
    headers = {k.lower(): v for k, v in response.headers}
    if 300 <= response.status < 400:
        location = headers.get(b"location", b"?").decode("latin-1")[:200]
        raise MediaError(f"{target.host} redirects ({response.status}) to {location}; redirects "
                         "are not followed: send the final URL")
    if response.status != 200:
        raise MediaError(f"{target.host} answered HTTP {response.status}")
    length = headers.get(b"content-length", b"").strip()
    if length.isdigit() and int(length) > policy.max_bytes:
        raise MediaError(_too_big(policy.max_bytes))


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    return ssl.create_default_context()  # NOTE: loads the system CAs once (~10 ms each time)


def _too_big(max_bytes: int) -> str:
    return f"the media is more than the limit of {max_bytes / MiB:g} MiB"


class _PinnedBackend(httpcore.AsyncNetworkBackend):
    """Connects ``host`` to the checked addresses (in order, first that answers), nothing else."""

    def __init__(self, host: str, addresses: list[str]) -> None:
        self._host = host
        self._addresses = addresses
        self._backend = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: object = None) -> httpcore.AsyncNetworkStream:
        if host != self._host:
            raise httpcore.ConnectError(f"{host} is not the pinned host {self._host}")
        error: Exception = httpcore.ConnectError("no address")
        for address in self._addresses:
            try:
                return await self._backend.connect_tcp(address, port, timeout, local_address,
                                                       socket_options)  # type: ignore[arg-type]
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        raise error

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: object = None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are never fetched")

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)
