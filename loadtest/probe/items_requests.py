"""Items 1-3 and 13: abusive requests (a huge grammar, huge bodies, a 1M-character stop
string) and full worker queues with clients that disconnect."""

from __future__ import annotations

import json
import random
import threading
import time

from probe.client import HealthWatch, chat, in_thread, post, read_load, stream
from probe.procs import MODEL, Ctx, rss_mb, tree_rss_mb


def item1_grammar(ctx: Ctx) -> str:
    """20 unrelated streams on a 2-worker gateway while one request has a 7,000-property
    response_format schema."""
    gw = ctx.gateway(workers=2)
    props = {f"p{i:04d}": {"type": "integer"} for i in range(7000)}
    schema = {"type": "object", "properties": props}
    huge = chat(16, response_format={"type": "json_schema", "json_schema": {
        "name": "big", "schema": schema}})
    ctx.rec(schema_kb=round(len(json.dumps(schema)) / 1024))
    url, started = gw.url + "/v1/chat/completions", threading.Event()
    body = chat(1500, stream=True)
    joins = [in_thread(lambda: stream(url, body, 100, started)) for _ in range(20)]
    started.wait(30)
    time.sleep(1.0)
    with HealthWatch(gw) as health:
        huge_reply = post(url, huge, 100)
        results = [j(110) for j in joins]
    failed = sum(1 for s in results if s is None or s.failed)
    ctx.rec(unrelated_failed=failed, huge=huge_reply.short(), health_max_s=health.max_s)
    return (f"unrelated streams failed {failed}/20; huge-schema request ({ctx.figures['schema_kb']}"
            f" kB) {huge_reply.short()}; max /health {health.max_s:.2f} s")


def item2_huge_bodies(ctx: Ctx) -> str:
    """A ~15 MiB chat body, 400k empty messages, 10k tools: status, time, /health, RSS."""
    gw = ctx.gateway(workers=1)
    url, pid = gw.url + "/v1/chat/completions", gw.proc.pid
    rss_before = tree_rss_mb(pid)
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9)))
             for _ in range(5000)]
    text = " ".join(rng.choices(words, k=2_600_000))[: 15 * 2**20 - 1000]
    big = json.dumps(chat(8, text)).encode()
    del text
    parts = [f"before {rss_before:.0f} MB"]
    with HealthWatch(gw) as health:
        reply = post(url, big, 150)
    del big
    hwm = rss_mb(pid, "VmHWM") or 0.0
    time.sleep(3.0)
    rss_after = tree_rss_mb(pid)
    ctx.rec(body15_mib=reply.short(), body15_health_max_s=health.max_s, rss_before_mb=rss_before,
            rss_peak_mb=max(hwm, health.rss_peak_mb), rss_after_3s_mb=rss_after)
    parts.append(f"peak {max(hwm, health.rss_peak_mb):.0f} MB, after {rss_after:.0f} MB")
    lines = [f"15 MiB body {reply.short()}, max /health {health.max_s:.1f} s"]
    empty = json.dumps({"model": MODEL, "max_tokens": 8,
                        "messages": [{"role": "user", "content": ""}] * 400_000}).encode()
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Tool number {i}.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
        for i in range(10_000)]
    for name, body in (("400k empty messages", empty),
                       ("10k tools", json.dumps(chat(8, tools=tools)).encode())):
        with HealthWatch(gw) as health:
            reply = post(url, body, 150)
        key = name.split()[0]
        ctx.rec(**{f"{key}": reply.short(), f"{key}_health_max_s": health.max_s})
        lines.append(f"{name} {reply.short()}, max /health {health.max_s:.1f} s")
    ctx.rec(rss_after_all_mb=tree_rss_mb(pid))
    return "; ".join(lines) + f"; gateway RSS {', '.join(parts)}"


def item3_stop_strings(ctx: Ctx) -> str:
    """A stop string of 1M characters on a 1,000-token answer."""
    gw = ctx.gateway(workers=1)
    stop = ("never-matches-" * 80_000)[:1_000_000]
    with HealthWatch(gw) as health:
        reply = post(gw.url + "/v1/chat/completions", chat(1000, stop=[stop]), 120)
    ctx.rec(stop_1m=reply.short(), health_max_s=health.max_s)
    return f"1M-char stop string: {reply.short()}, max /health {health.max_s:.1f} s"


def item13_backpressure(ctx: Ctx) -> str:
    """A full worker queue: 429 vs 503 and Retry-After; then 50 clients that disconnect."""
    tiny = ctx.worker(cost="cpu", name="worker-tiny", env={
        "AGENTGATE_MAX_RUNNING_REQUESTS": "1", "AGENTGATE_MAX_WAITING_REQUESTS": "1"})
    gw = ctx.gateway("--worker", tiny.endpoint, workers=None, name="gateway-tiny")
    url = gw.url + "/v1/chat/completions"
    joins = [in_thread(lambda: post(url, chat(300), 60)) for _ in range(20)]
    replies = [j(70) for j in joins]
    counts: dict[str, int] = {}
    for r in replies:
        key = "hung" if r is None else str(r.status) + (f" {r.code()}" if r.code() else "")
        counts[key] = counts.get(key, 0) + 1
    retry_after = sum(1 for r in replies if r is not None and "retry-after" in r.headers)
    rejected = sum(1 for r in replies if r is not None and r.status in (429, 503))
    ctx.rec(flood_statuses=counts, retry_after=f"{retry_after}/{rejected}")
    worker = ctx.worker(cost="cpu", name="worker-default")
    gw2 = ctx.gateway("--worker", worker.endpoint, workers=None, name="gateway-default")
    url2 = gw2.url + "/v1/chat/completions"
    quitters = [in_thread(lambda: post(url2, chat(3000), 2.0)) for _ in range(50)]
    during = read_load(worker.events_port, 1.5)
    for join in quitters:
        join(30)
    time.sleep(3.0)
    load = read_load(worker.events_port, 3.0)
    ctx.rec(during_load=during, after_disconnect_load=load)
    return (f"20 requests on a 1-running/1-waiting worker: {counts}, Retry-After on "
            f"{retry_after} of {rejected} 429/503; 50 clients that disconnect after 2 s: worker "
            f"load while they wait {during}, 3 s after they left {load}")

