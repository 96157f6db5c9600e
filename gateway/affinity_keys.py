"""The affinity key of an OpenAI-API request: what ties it to earlier requests, so the router can
keep them on the worker that holds their KV. The first that is present wins:

    | source                     | example                        | key                      |
    |----------------------------|--------------------------------|--------------------------|
    | header ``X-Session-ID``    | agent harnesses, LiteLLM       | ``hdr:<value>``          |
    | header ``X-Dynamo-Session-ID`` | Dynamo's agent sessions    | ``hdr:<value>``          |
    | header ``X-SMG-Routing-Key``   | SGLang model gateway       | ``hdr:<value>``          |
    | body ``prompt_cache_key``  | OpenAI prompt caching          | ``pck:<value>``          |
    | body ``user``              | OpenAI end-user id             | ``user:<value>``         |

The three headers name the same thing (a session), so a client may send any of them. The router
prefixes the key with the tenant (``gateway.generation.route_request``), so two tenants never
share one. A value longer than ``MAX_KEY_CHARS`` is replaced by a hash of it, which bounds what
the router and the session store keep per key. The Sessions API needs none of this: a session's
id is its key.
"""

import hashlib
from collections.abc import Mapping

SESSION_HEADERS = ("x-session-id", "x-dynamo-session-id", "x-smg-routing-key")
MAX_KEY_CHARS = 128


def affinity_key(
    headers: Mapping[str, str], prompt_cache_key: str | None, user: str | None
) -> str | None:
    """The request's affinity key (see the module docstring); None when it gives none."""
    for name in SESSION_HEADERS:
        if value := headers.get(name, "").strip():
            return _bounded("hdr", value)
    if prompt_cache_key:
        return _bounded("pck", prompt_cache_key)
    if user:
        return _bounded("user", user)
    return None


def _bounded(kind: str, value: str) -> str:
    if len(value) > MAX_KEY_CHARS:
        value = "#" + hashlib.blake2b(value.encode(), digest_size=16).hexdigest()
    return f"{kind}:{value}"
