"""CURVE authentication of the worker's ZeroMQ sockets: key files, socket setup, the ZAP handler.

A key directory (``agentgate keys DIR``) holds ZeroMQ certificate files (pyzmq's
``zmq.auth`` format)::

    server.key           the workers' public key      (gateway hosts need it)
    server.key_secret    the workers' secret key      (worker hosts only; mode 0600)
    client.key           the gateways' public key     (worker hosts: an authorized client)
    client.key_secret    the gateways' secret key     (gateway hosts only; mode 0600)

A worker started with ``--curve-keys DIR`` binds its three sockets (requests ROUTER, KV event
PUB, replay ROUTER) as CURVE servers with the server secret key and accepts only the clients
whose public key is in one of DIR's ``*.key`` files other than ``server.key``: to authorize
another gateway, copy its public ``client.key`` into the worker's DIR under any ``NAME.key``.
A gateway (``agentgate serve --curve-keys DIR``) connects its DEALER, SUB and replay sockets as
CURVE clients with ``client.key_secret`` and ``server.key``.

NOTE: a CURVE server with no ZAP handler in its context accepts *any* client key (it only
encrypts), so ``ClientAuthenticator`` must run before the sockets bind and until they close.

Nothing here imports the engine (torch): the gateway imports this module too.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import stat
import tempfile
import threading
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

SERVER = "server"
CLIENT = "client"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
KEY_FILES = tuple(f"{name}{suffix}" for name in (SERVER, CLIENT)
                  for suffix in (PUBLIC_SUFFIX, SECRET_SUFFIX))
Z85_KEY_CHARS = 40  # NOTE: a 32-byte CURVE key, Z85-encoded
MAX_LOGGED_REFUSALS = 1024  # NOTE: distinct refused keys logged; more are refused silently
LOOPBACK_HOSTS = frozenset({"localhost"})
LOCAL_TRANSPORTS = frozenset({"ipc", "inproc"})  # NOTE: not reachable over a network

logger = logging.getLogger(__name__)


class CurveKeyError(ValueError):
    """A key directory or key file that is missing, incomplete or unreadable."""


@dataclass(frozen=True, slots=True)
class CurveServerKeys:
    """A worker's CURVE identity and the clients it accepts (Z85-encoded keys).

    Attributes:
        public, secret: the server key pair (``server.key_secret``).
        clients: the public keys of the authorized clients.
    """

    public: bytes
    secret: bytes = field(repr=False)
    clients: frozenset[bytes]

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE server; call before ``bind``."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True


@dataclass(frozen=True, slots=True)
class CurveClientKeys:
    """A gateway's CURVE identity and the workers' public key (Z85-encoded keys)."""

    public: bytes
    secret: bytes = field(repr=False)  # NOTE: never in a log line or an assert message
    server_public: bytes

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE client of the workers; call before ``connect``."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server_public


def write_keys(key_dir: Path, *, force: bool = False) -> list[Path]:
    """Generate a server and a client key pair into ``key_dir`` (created 0700 if missing); the
    secret files are 0600. Returns the files written.

    NOTE: the pairs are written in a private temporary directory inside ``key_dir`` and then
    renamed into place, so a secret file is never readable by others, even for a moment.

    Raises:
        CurveKeyError: a key file exists already and ``force`` is not set.
    """
    taken = [key_dir / name for name in KEY_FILES if (key_dir / name).exists()]
    if taken and not force:
        raise CurveKeyError(f"{', '.join(map(str, taken))} exist(s); keep them, or pass --force "
                            "to replace them (every worker and gateway then needs the new ones)")
    key_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".agentgate-keys-", dir=key_dir))
    try:
        for name in (SERVER, CLIENT):
            public, secret = map(Path, zmq.auth.create_certificates(tmp, name))
            public.chmod(0o644)
            secret.chmod(0o600)
        written = []
        for name in KEY_FILES:
            os.replace(tmp / name, key_dir / name)
            written.append(key_dir / name)
        return written
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_server_keys(key_dir: Path) -> CurveServerKeys:
    """The worker side of ``key_dir``: its key pair and the authorized client keys (every
    ``*.key`` file but ``server.key``).

    Raises:
        CurveKeyError: no server secret key, or no client public key.
    """
    public, secret = _load_pair(key_dir, SERVER)
    clients = frozenset(
        _load_public(path) for path in sorted(key_dir.glob(f"*{PUBLIC_SUFFIX}"))
        if path.name != f"{SERVER}{PUBLIC_SUFFIX}"
    )
    if not clients:
        raise CurveKeyError(f"{key_dir}: no client public key (*.key besides server.key): no "
                            "gateway could connect")
    return CurveServerKeys(public=public, secret=secret, clients=clients)


def load_client_keys(key_dir: Path) -> CurveClientKeys:
    """The gateway side of ``key_dir``: its key pair and the workers' public key.

    Raises:
        CurveKeyError: no client secret key, or no ``server.key``.
    """
    public, secret = _load_pair(key_dir, CLIENT)
    server_public = _load_public(key_dir / f"{SERVER}{PUBLIC_SUFFIX}")
    return CurveClientKeys(public=public, secret=secret, server_public=server_public)


class ClientAuthenticator:
    """The ZAP handler of a worker's context: accepts the CURVE clients in ``clients`` only.

    ``start()`` before the CURVE sockets bind, ``stop()`` after they are closed (it joins the
    handler's thread). One per context: ZeroMQ has a single ZAP endpoint per context.
    """

    def __init__(self, context: zmq.Context[Any], clients: frozenset[bytes]) -> None:
        self._clients = clients
        self._auth = ThreadAuthenticator(context, log=logging.getLogger("zmq.auth"))
        self._lock = threading.Lock()
        self._refused: set[bytes] = set()  # NOTE: keys logged once each, up to a bound

    @property
    def is_alive(self) -> bool:
        return self._auth.is_alive()

    def start(self) -> None:
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)

    def stop(self) -> None:
        self._auth.stop()

    def callback(self, domain: str, client_key: bytes) -> bool:
        """``ThreadAuthenticator``'s question (on its thread): is ``client_key`` (Z85) allowed?"""
        if client_key in self._clients:
            return True
        with self._lock:
            first = client_key not in self._refused and len(self._refused) < MAX_LOGGED_REFUSALS
            if first:
                self._refused.add(client_key)
        if first:
            logger.warning("refused a CURVE client with an unknown public key %s",
                           client_key.decode("ascii", "replace"))
        return False


def start_authenticator(context: zmq.Context[Any], curve_keys: str | None,
                        endpoints: dict[str, str]
                        ) -> tuple[ClientAuthenticator | None, CurveServerKeys | None]:
    """A worker's ZAP handler and server keys, started before any of its sockets binds (CURVE
    without a running handler accepts any client key); ``(None, None)`` without ``curve_keys``,
    after a warning for each endpoint that is not loopback (``--insecure-no-curve``)."""
    if curve_keys is None:
        exposed = [ep for ep in endpoints.values() if not is_loopback_endpoint(ep)]
        if exposed:  # NOTE: only with insecure_no_curve (WorkerConfig refuses otherwise)
            logger.warning("--insecure-no-curve: %s served without authentication; anyone "
                           "who reaches them can run work here", ", ".join(exposed))
        return None, None
    curve = load_server_keys(Path(curve_keys))
    auth = ClientAuthenticator(context, curve.clients)
    auth.start()
    logger.info("CURVE on: %d authorized client key(s) from %s", len(curve.clients), curve_keys)
    return auth, curve


def any_port(endpoint: str) -> str:
    """``tcp://host:0`` -> ``tcp://host:*`` (ZeroMQ's "pick a free port")."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-2] + ":*"
    return endpoint


def is_loopback_endpoint(endpoint: str) -> bool:
    """Whether a bind endpoint is reachable from this machine only: ``ipc://``, ``inproc://``, or
    ``tcp://`` on 127.0.0.0/8, ``::1`` or ``localhost``. Wildcards (``*``, ``0.0.0.0``) and
    interface names are not."""
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme in LOCAL_TRANSPORTS:
        return True
    if parts.scheme != "tcp":
        return False
    host = parts.netloc.rsplit(":", 1)[0].strip("[]")
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_error(endpoints: dict[str, str]) -> str | None:
    """The refusal of a worker without keys that binds ``endpoints`` (flag -> endpoint) where
    others may reach them; None when all of them are loopback."""
    exposed = [f"{flag} {ep}" for flag, ep in endpoints.items() if not is_loopback_endpoint(ep)]
    if not exposed:
        return None
    return (f"{', '.join(exposed)}: not a loopback address, and anyone who reaches it could run "
            "work on this worker. Generate keys with `agentgate keys DIR`, then start the worker "
            "with --curve-keys DIR and the gateway with `agentgate serve --curve-keys DIR`; or "
            "pass --insecure-no-curve to serve without authentication")


# ---------------------------------------------------------------------- helpers


def _load_pair(key_dir: Path, name: str) -> tuple[bytes, bytes]:
    path = key_dir / f"{name}{SECRET_SUFFIX}"
    public, secret = _load(path)
    if secret is None:
        raise CurveKeyError(f"{path}: no secret key in it")
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("%s is readable by others (mode %o): chmod 600 it", path, mode & 0o777)
    return public, secret


def _load_public(path: Path) -> bytes:
    return _load(path)[0]


def _load(path: Path) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise CurveKeyError(f"{path}: no such key file (write keys with `agentgate keys DIR`)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"{path}: {exc}") from None
    if any(key is not None and len(key) != Z85_KEY_CHARS for key in (public, secret)):
        raise CurveKeyError(f"{path}: a key is not {Z85_KEY_CHARS} Z85 characters")
    return public, secret
