"""The gateway: the litestar app, HTTP/WebSocket API with OpenAI compatibility, tokenizer and chat
templates, admission queue, router, dispatch client and the `agentgate` CLI. The only package
that imports litestar; importing it never imports torch."""

__all__: list[str] = []
