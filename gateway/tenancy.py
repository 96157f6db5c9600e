"""Who a request belongs to. The tenant is derived from the API key (``Authorization: Bearer``);
requests without one share the ``anonymous`` tenant. The key itself is never stored or logged:
only a keyed hash of it, so a tenant id in a log or a store says nothing about the key.

Tenants are isolated twice: sessions are looked up under their tenant (another tenant's session
id is a 404, as if it did not exist), and each tenant's prompts carry its own ``cache_salt``, so
the workers' prefix caches never let one tenant hit (or time) another's cached KV.
"""

import hashlib

from litestar.connection import ASGIConnection

ANONYMOUS = "anonymous"
_DOMAIN = b"agentgate-tenant-v1"


def tenant_of(connection: ASGIConnection) -> str:
    """The tenant id of an HTTP request or WebSocket (a hash of its bearer key)."""
    auth = connection.headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return ANONYMOUS
    return tenant_id(key.strip())


def tenant_id(api_key: str) -> str:
    return "t-" + hashlib.blake2b(api_key.encode(), key=_DOMAIN, digest_size=12).hexdigest()


def cache_salt(tenant: str) -> str | None:
    """The prefix-cache namespace of a tenant (None: the shared anonymous namespace)."""
    return None if tenant == ANONYMOUS else tenant
