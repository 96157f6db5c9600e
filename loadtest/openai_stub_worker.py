"""A minimal OpenAI-shaped HTTP worker for router benchmarks: no model, no framework, little CPU.

Raw HTTP/1.1 keep-alive over stdlib asyncio. It answers what SGLang's router (``sglang-router``
0.3.x) probes before it accepts a worker and routes to it: ``GET /health``,
``/health_generate``, ``/get_server_info`` (``/server_info``), ``/get_model_info``
(``/model_info``), ``/v1/models``; and the inference routes:

* ``POST /v1/chat/completions``: ``max_tokens`` (or ``max_completion_tokens``) tokens of content
  ``"tok "``. With ``"stream": true``: chunked SSE, one ``chat.completion.chunk`` event per token
  (each written on its own, one a step of ``--step-ms``, all streams on one step clock as an
  engine batch steps them), then a chunk with ``finish_reason: "length"``,
  a usage chunk (``"choices": []``) when ``stream_options.include_usage``, then ``[DONE]``.
  Otherwise one ``chat.completion`` with the whole text and usage.
* ``POST /generate`` (SGLang native): the same tokens as ``{"text", "meta_info"}``, streamed or not.

    python loadtest/openai_stub_worker.py --port P [--step-ms 0] [--log-requests]
"""

import argparse
import asyncio
import contextlib
import itertools
import json
import time

MODEL = "stub"
TOKEN = "tok "
_ids = itertools.count()
# NOTE: no model_path / tokenizer_path: the router would load that tokenizer (from the Hub)
_SERVER_INFO = {"served_model_name": MODEL, "model_id": MODEL, "dp_size": 1, "version": "stub",
                "max_total_num_tokens": 1 << 20}
_MODEL_INFO = {"is_generation": True, "model_type": "stub", "architectures": ["Stub"]}
_MODELS = {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                       "owned_by": "stub", "root": MODEL}]}
_GET = {b"/health": b"", b"/health_generate": b"", b"/get_server_info": _SERVER_INFO,
        b"/server_info": _SERVER_INFO, b"/get_model_info": _MODEL_INFO,
        b"/model_info": _MODEL_INFO, b"/v1/models": _MODELS}


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class StubWorker:
    def __init__(self, step_s: float, log_requests: bool) -> None:
        self.step_s, self.log_requests = step_s, log_requests

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: requests one after another until the peer closes (keep-alive)."""
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                    return
                method, path, headers = _parse_head(head)
                if method == b"PRI":  # NOTE: the router's gRPC (HTTP/2) probe: not served
                    return
                body = await _read_body(reader, headers)
                if self.log_requests:
                    print(f"{method.decode()} {path.decode()} {len(body)}B", flush=True)
                await self.handle(method, path.split(b"?", 1)[0], body, writer)
                if headers.get(b"connection", b"").lower() == b"close":
                    return
        except (ConnectionError, ValueError, asyncio.IncompleteReadError):  # NOTE: bad peer
            return
        finally:
            writer.close()

    async def _next_step(self) -> None:
        """Until the next step boundary: every stream's next event goes out at the same step,
        as an engine's batch does (one decode step for all running requests), not on a clock
        of its own. Unpaced (0): sleep(0), which still yields, so that streams interleave."""
        step_s = self.step_s
        if step_s <= 0:
            await asyncio.sleep(0)
            return
        now = time.monotonic()
        await asyncio.sleep(step_s - now % step_s)

    async def handle(self, method: bytes, path: bytes, body: bytes,
                     writer: asyncio.StreamWriter) -> None:
        if method == b"GET" and path in _GET:
            reply = _GET[path]
            _respond(writer, 200, reply if isinstance(reply, bytes) else _dumps(reply))
        elif method == b"POST" and path in (b"/v1/chat/completions", b"/generate"):
            try:
                req = json.loads(body)
            except ValueError:
                _respond(writer, 400, _dumps({"error": {"message": "invalid JSON body"}}))
                return
            chat = path == b"/v1/chat/completions"
            if chat:
                n = int(req.get("max_completion_tokens") or req.get("max_tokens") or 16)
            else:
                n = int((req.get("sampling_params") or {}).get("max_new_tokens") or 16)
            if req.get("stream"):
                usage = bool((req.get("stream_options") or {}).get("include_usage"))
                await self.stream(writer, n, chat, usage)
            else:
                _respond(writer, 200, _dumps(_whole(n, chat)))
        else:
            _respond(writer, 404, _dumps({"error": {"message": f"no route {path.decode()}"}}))
        await writer.drain()

    async def stream(self, writer: asyncio.StreamWriter, n: int, chat: bool,
                     usage: bool) -> None:
        """SSE over chunked transfer encoding; the per-token event is built once per request."""
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
        rid, created = f"chatcmpl-{next(_ids)}", int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": MODEL}
        if chat:
            event = _event({**base, "choices": [{"index": 0, "delta": {"content": TOKEN},
                                                 "finish_reason": None}]})
        for i in range(n):
            if not chat:  # NOTE: /generate streams the cumulative text, so no shared event
                event = _event({"text": TOKEN * (i + 1), "meta_info": _meta(rid, i + 1, None)})
            writer.write(event)
            await writer.drain()
            await self._next_step()
        if chat:
            writer.write(_event({**base, "choices": [{"index": 0, "delta": {},
                                                      "finish_reason": "length"}]}))
            if usage:
                writer.write(_event({**base, "choices": [], "usage": _usage(n)}))
        writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")


def _event(obj: object) -> bytes:
    """One SSE event as one HTTP chunk."""
    data = b"data: %s\n\n" % _dumps(obj)
    return b"%x\r\n%s\r\n" % (len(data), data)


def _usage(n: int) -> dict[str, int]:
    return {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}


def _meta(rid: str, n: int, finish: str | None) -> dict[str, object]:
    return {"id": rid, "prompt_tokens": 1, "completion_tokens": n,
            "finish_reason": {"type": finish, "length": n} if finish else None}


def _whole(n: int, chat: bool) -> dict[str, object]:
    rid = f"chatcmpl-{next(_ids)}"
    if not chat:
        return {"text": TOKEN * n, "meta_info": _meta(rid, n, "length")}
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": TOKEN * n},
                         "finish_reason": "length"}], "usage": _usage(n)}


def _parse_head(head: bytes) -> tuple[bytes, bytes, dict[bytes, bytes]]:
    lines = head[:-4].split(b"\r\n")
    method, path, _ = (lines[0].split(b" ", 2) + [b"", b""])[:3]
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return method, path, headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[bytes, bytes]) -> bytes:
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        body = bytearray()
        for _ in range(1 << 20):  # NOTE: bounded; a request body is never a million chunks
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if not size:
                await reader.readuntil(b"\r\n")  # NOTE: no trailers are expected
                break
            body += (await reader.readexactly(size + 2))[:-2]
        return bytes(body)
    return await reader.readexactly(int(headers.get(b"content-length", b"0")))


def _respond(writer: asyncio.StreamWriter, status: int, body: bytes) -> None:
    kind = b"application/json" if body else b"text/plain"
    writer.write(b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                 % (status, b"OK" if status == 200 else b"Error", kind, len(body), body))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--step-ms", type=float, default=0.0, help="pause between tokens")
    parser.add_argument("--log-requests", action="store_true", help="print each request line")
    args = parser.parse_args()
    worker = StubWorker(args.step_ms / 1e3, args.log_requests)
    # NOTE: a large limit: 20 KB prompts arrive in one head+body, and the head alone stays small
    server = await asyncio.start_server(worker.serve, args.host, args.port, limit=1 << 20,
                                        backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
