"""Who a request belongs to. With API keys configured (``--api-keys``, ``gateway.api_keys``), the
tenant is the one the key file gives the request's key. Otherwise it is derived from the API key
(``Authorization: Bearer``); requests without one share the ``anonymous`` tenant. The key
itself is never stored or logged: only a keyed hash of it, ``t-`` + 24 hex digits, so a tenant
id in a log or a store says nothing about the key. The hash key is the deployment's
``GatewayConfig.tenant_secret`` when set (so weak API keys cannot be guessed offline from store
keys: each guess needs the secret), else a fixed domain key. Changing the secret changes every
tenant id (their sessions become unreachable).

Tenants are isolated twice: sessions are looked up under their tenant (another tenant's session
id is a 404, as if it did not exist), and each tenant's prompts carry its own ``cache_salt``, so
the workers' prefix caches never let one tenant hit (or time) another's cached KV.
"""

import hashlib

from litestar.connection import ASGIConnection

ANONYMOUS = "anonymous"
_DOMAIN = b"agentgate-tenant-v1"
_MAX_KEY_BYTES = 64  # NOTE: blake2b's key limit; a longer secret is hashed down to it


def tenant_of(connection: ASGIConnection) -> str:
    """The tenant id of an HTTP request or WebSocket: with API keys configured, its key's tenant
    (``gateway.auth_gate``, which let only known keys through); else a keyed hash of its bearer
    key."""
    auth = connection.headers.get("authorization", "")
    if (gate := getattr(connection.app, "auth_gate", None)) is not None:
        return gate.tenant_of(auth) or ANONYMOUS
    scheme, _, key = auth.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return ANONYMOUS
    cfg = connection.app.state.get("cfg")
    return tenant_id(key.strip(), getattr(cfg, "tenant_secret", None))


def tenant_id(api_key: str, secret: bytes | None = None) -> str:
    """``t-`` + a 12-byte blake2b of ``api_key``, keyed by ``secret`` (None: the domain key)."""
    return "t-" + hashlib.blake2b(
        api_key.encode(), key=_hash_key(secret), digest_size=12
    ).hexdigest()


def cache_salt(tenant: str) -> str | None:
    """The prefix-cache namespace of a tenant (None: the shared anonymous namespace)."""
    return None if tenant == ANONYMOUS else tenant


def _hash_key(secret: bytes | None) -> bytes:
    if not secret:
        return _DOMAIN
    if len(secret) <= _MAX_KEY_BYTES:
        return secret
    return hashlib.blake2b(secret, key=_DOMAIN, digest_size=_MAX_KEY_BYTES).digest()
