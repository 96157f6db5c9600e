"""Items 11-12: Redis frozen, restarted or killed while a session turn runs."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable

import httpx

from probe.client import in_thread, post, stream
from probe.procs import ITEM_BOX_S, LOCAL, Ctx


def item11_redis_outage(ctx: Ctx) -> str:
    """A session turn across an 8 s Redis freeze, and across a 3 s Redis kill + restart."""
    variants = {"freeze 8 s": _freeze_redis, "kill 3 s": _kill_redis}
    joins = {name: in_thread(lambda fn=fn, name=name: _session_outage(ctx, name, fn))
             for name, fn in variants.items()}
    lines = [f"{name}: {joins[name](ITEM_BOX_S[11] - 20) or 'hung'}" for name in variants]
    return "; ".join(lines)


def _freeze_redis(ctx: Ctx, redis: subprocess.Popen[bytes], port: int, name: str
                  ) -> subprocess.Popen[bytes]:
    redis.send_signal(signal.SIGSTOP)
    time.sleep(8)
    redis.send_signal(signal.SIGCONT)
    return redis


def _kill_redis(ctx: Ctx, redis: subprocess.Popen[bytes], port: int, name: str
                ) -> subprocess.Popen[bytes]:
    redis.kill()
    redis.wait(5)
    time.sleep(3)
    return ctx.redis(port, name=name)[0]


def _session_outage(ctx: Ctx, name: str, outage: Callable[..., subprocess.Popen[bytes]]) -> str:
    """Start a short streamed turn, begin the outage at its first frame (so the turn ends, and
    writes its answer, while Redis is away), then poll for a new turn."""
    key = name.split()[0]
    redis, port = ctx.redis(name=f"redis-{key}")
    gw = ctx.gateway("--redis", f"redis://{LOCAL}:{port}/0", workers=1, name=f"gateway-{key}")
    sid = json.loads(post(gw.url + "/v1/sessions", {"system": "Be brief."}, 20).body)["id"]
    turns, started = gw.url + f"/v1/sessions/{sid}/turns", threading.Event()
    turn = in_thread(lambda: stream(turns, {"max_tokens": 200, "stream": True, "messages": [
        {"role": "user", "content": "Tell me a story."}]}, 60, started))
    started.wait(30)
    outage(ctx, redis, port, f"redis-{key}")
    back = time.monotonic()
    first = turn(65)
    state = httpx.get(gw.url + f"/v1/sessions/{sid}", timeout=10)
    recorded = state.status_code == 200 and len(state.json().get("turns", [])) > 0
    after, last = None, None
    while time.monotonic() - back < 90:
        last = post(turns, {"max_tokens": 2, "messages": [
            {"role": "user", "content": "Again."}]}, 20)
        if last.status != 409:
            after = time.monotonic() - back
            break
        time.sleep(2)
    first_txt = "no reply" if first is None else first.short()
    accepted = f"{after:.1f} s ({last.short()})" if after is not None else "> 90 s (409)"
    ctx.rec(**{f"{key}_turn": first_txt, f"{key}_answer_recorded": recorded,
               f"{key}_new_turn_accepted_after": accepted})
    return (f"streamed turn {first_txt}, answer recorded: {'yes' if recorded else 'no'}, "
            f"new turn accepted {accepted} after Redis was back")


def item12_redis_dies_at_turn_end(ctx: Ctx) -> str:
    """Redis killed while an SSE turn and a WebSocket turn run: do both get an error frame?"""
    from websockets.sync.client import connect

    redis, port = ctx.redis()
    gw = ctx.gateway("--redis", f"redis://{LOCAL}:{port}/0", workers=1)
    sids = [json.loads(post(gw.url + "/v1/sessions", {}, 20).body)["id"] for _ in range(2)]
    turn = {"max_tokens": 1000, "messages": [{"role": "user", "content": "Tell me a story."}]}
    sse = in_thread(lambda: stream(gw.url + f"/v1/sessions/{sids[0]}/turns",
                                   {**turn, "stream": True}, 45))
    ws_url = gw.url.replace("http://", "ws://") + f"/v1/sessions/{sids[1]}/ws"
    frames: list[str] = []

    def ws_turn() -> str:
        try:
            with connect(ws_url, open_timeout=20) as ws:
                ws.send(json.dumps({"type": "turn", **turn}))
                deadline = time.monotonic() + 45
                while time.monotonic() < deadline:
                    frame = json.loads(ws.recv(timeout=deadline - time.monotonic()))
                    frames.append(frame["type"])
                    if frame["type"] in ("turn_end", "error"):
                        return frame["type"]
                return "no turn_end or error within 45 s"
        except TimeoutError:
            return "no turn_end or error within 45 s"
        except Exception as e:  # noqa: BLE001 - the probe reports whatever ended the socket
            return f"socket ended ({type(e).__name__}) without turn_end or error"

    ws_join = in_thread(ws_turn)
    time.sleep(2.0)
    redis.kill()
    sse_result, ws_result = sse(50), ws_join(50)
    sse_txt = "no result" if sse_result is None else (
        f"{sse_result.short()}, error frame: {'yes' if sse_result.has_error else 'no'}, "
        f"last frame type: {sse_result.last_type() or '-'}")
    ctx.rec(sse=sse_txt, websocket=ws_result or "hung", ws_frames=len(frames))
    return f"SSE turn: {sse_txt}; WebSocket turn: {ws_result or 'hung'} ({len(frames)} frames)"

