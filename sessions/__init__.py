"""Agent sessions: the session model, session stores (memory, Redis), tool-call tracking and
KV retention hints. Imports only `engine.protocol` below it; never litestar or the gateway."""

__all__: list[str] = []
