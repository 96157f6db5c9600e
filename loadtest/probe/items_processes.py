"""Items 7-10: SIGTERM / SIGKILL of ``serve``, a killed worker, a worker restarted on the
same port, a worker that starts after the gateway."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time

import httpx

from probe.client import chat, gateway_worker_events, in_thread, post, read_load, stream
from probe.procs import (
    LOCAL,
    Ctx,
    free_port,
    is_alive,
    kill_quietly,
    parent_pid,
    proc_state,
    wait_http,
)


def item7_sigterm(ctx: Ctx) -> str:
    """Workers alive 5 s after SIGTERM (idle, and with 2 streams in flight) and after SIGKILL
    of `serve --workers 2`; requests still running on the workers then."""
    parts = [_signal_gateway(ctx, signal.SIGTERM, busy=False),
             _signal_gateway(ctx, signal.SIGTERM, busy=True),
             _signal_gateway(ctx, signal.SIGKILL, busy=True)]
    return "; ".join(parts)


def _signal_gateway(ctx: Ctx, sig: int, busy: bool) -> str:
    name = f"{signal.Signals(sig).name}-{'busy' if busy else 'idle'}"
    gw = ctx.gateway(workers=2, name=f"gateway-{name}")
    pids = gw.workers()
    ctx.procs.adopt(pids)
    url, body = gw.url + "/v1/chat/completions", chat(3000, stream=True)
    joins = [in_thread(lambda: stream(url, body, 40)) for _ in range(2 if busy else 0)]
    time.sleep(2.0)
    signalled = time.monotonic()
    gw.proc.send_signal(sig)
    exited_at = in_thread(lambda: _wait_exit(gw.proc, 45))
    time.sleep(5.0)
    alive = [p for p in pids if is_alive(p)]
    orphaned = sum(1 for p in alive if parent_pid(p) != gw.proc.pid)
    running = [load["num_running"] for port in gateway_worker_events(ctx.procs.log(gw.name))
               if (load := read_load(port, 2.0)) is not None]
    gw_exit = gw.proc.poll()
    ctx.rec(**{f"{name}_workers": len(pids), f"{name}_alive_5s": len(alive),
               f"{name}_reparented": orphaned, f"{name}_gateway_rc_5s": gw_exit,
               f"{name}_requests_still_running": sum(running)})
    line = (f"{name}: {len(alive)}/{len(pids)} workers alive after 5 s ({orphaned} re-parented),"
            f" gateway rc at 5 s={gw_exit}")
    if busy:
        line += f", requests still running on workers={sum(running)}"
        ends = [j(45) for j in joins]
        streams = ", ".join("hung" if e is None else e.short() for e in ends)
        line += f", in-flight streams: [{streams}]"
        if (at := exited_at(50)) is None:
            exited = "still running 45 s after the signal"
        else:
            time.sleep(max(0.0, at + 5 - time.monotonic()))
            left = sum(1 for p in pids if is_alive(p))
            exited = (f"exited {at - signalled:.1f} s after the signal (rc={gw.proc.returncode}),"
                      f" workers alive 5 s after that: {left}/{len(pids)}")
        ctx.rec(**{f"{name}_streams": streams, f"{name}_gateway": exited})
        line += f", gateway {exited}"
    for pid in pids:
        kill_quietly(pid)
    gw.proc.kill()
    return line


def _wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> float | None:
    """When ``proc`` exited (monotonic), or None if it is still running after ``timeout_s``."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout_s)
        return time.monotonic()
    return None


def item8_worker_kill(ctx: Ctx) -> str:
    """kill -9 the one spawned worker: zombie? restarted within 15 s? /ready over time?"""
    gw = ctx.gateway(workers=1)
    [pid] = gw.workers()
    ctx.procs.adopt([pid])
    before = httpx.get(gw.url + "/ready", timeout=5).status_code
    kill_quietly(pid)
    start, ready_log, new_pid, zombie = time.monotonic(), [f"0s:{before}"], None, None
    last = before
    while time.monotonic() - start < 15:
        t = time.monotonic() - start
        if zombie is None and t >= 3:
            zombie = proc_state(pid)
        if new_pid is None and (fresh := [p for p in gw.workers() if p != pid and is_alive(p)]):
            new_pid = (fresh[0], round(t, 1))
            ctx.procs.adopt(fresh)
        with contextlib.suppress(httpx.HTTPError):
            status = httpx.get(gw.url + "/ready", timeout=5).status_code
            if status != last:
                ready_log.append(f"{t:.1f}s:{status}")
                last = status
        time.sleep(0.3)
    state = {None: "gone (reaped)", "Z": "zombie"}.get(zombie, f"state {zombie}")
    ok = post(gw.url + "/v1/chat/completions", chat(4), 20)
    ctx.rec(state_after_3s=state, restarted=new_pid, ready=ready_log, request_after=ok.short())
    restarted = f"yes ({new_pid[1]} s)" if new_pid else "no"
    return (f"killed worker after 3 s: {state}; new worker within 15 s: {restarted}; "
            f"/ready {' -> '.join(ready_log)}; a request at 15 s: {ok.short()}")


def item9_same_port_restart(ctx: Ctx) -> str:
    """A worker restarted on the same port within ~1 s under a streamed + a non-streamed
    request (the replacement is pre-imported, so only its bind and engine setup remain)."""
    port, events = free_port(), free_port()
    worker = ctx.worker(port=port, events_port=events, name="worker-a")
    trigger = ctx.procs.root / "start-worker-b"
    standby = ctx.worker(port=port, events_port=events, name="worker-b", trigger=trigger)
    gw = ctx.gateway("--worker", worker.endpoint, workers=None)
    url, started = gw.url + "/v1/chat/completions", threading.Event()
    s_join = in_thread(lambda: stream(url, chat(3000, stream=True), 75, started))
    n_join = in_thread(lambda: post(url, chat(3000), 75))
    started.wait(30)
    time.sleep(2.0)  # NOTE: standby imports finish meanwhile; the non-streamed one is running
    worker.proc.kill()
    worker.proc.wait(10)
    killed_at = time.monotonic()
    trigger.touch()
    ctx.wait_worker("worker-b", standby.proc)
    back_s = time.monotonic() - killed_at
    ctx.rec(restart_s=back_s)
    streamed, plain = s_join(80), n_join(80)
    s_txt = "no result" if streamed is None else streamed.short()
    n_txt = "no result" if plain is None else plain.short()
    ctx.rec(streamed=s_txt, non_streamed=n_txt)
    return (f"worker back on the same port {back_s:.1f} s after kill -9; streamed (running for "
            f"~2 s at the kill): {s_txt}; non-streamed: {n_txt} (times from their start; "
            f"max_tokens 3000 at cost cpu; client cap 75 s)")


def item10_late_worker(ctx: Ctx) -> str:
    """`serve --worker tcp://...` with nothing there: time to listen; then the worker starts."""
    port = free_port()
    start = time.monotonic()
    gw = ctx.gateway("--worker", f"tcp://{LOCAL}:{port}", workers=None, wait="")
    try:
        listen_s = wait_http(gw, "/health", 60, ctx.procs)
    except RuntimeError as e:
        ctx.rec(listen="never", error=str(e)[:300])
        return f"gateway never listened within 60 s ({str(e).splitlines()[0]})"
    ctx.rec(listen_s=time.monotonic() - start)
    ctx.worker(port=port, cost="zero")
    up = time.monotonic()
    result = "no"
    while time.monotonic() - up < 15:
        reply = post(gw.url + "/v1/chat/completions", chat(4), 5)
        if reply.status == 200:
            result = f"yes, {time.monotonic() - up:.1f} s after the worker started"
            break
        time.sleep(0.5)
    ctx.rec(request_within_15s=result, last_reply=reply.short())
    return (f"gateway listening {listen_s:.1f} s after start (worker absent); request after "
            f"the worker came up succeeded within 15 s: {result} (last: {reply.short()})")

