"""``agentgate replay --live``: replay a short slice through REAL processes, and check that the
in-process replay (``replay.harness.replay``) agrees with it.

Live, the slice goes to a real ``agentgate serve --backend sim`` (the real gateway, its router
and dispatcher, sim worker subprocesses over ZeroMQ, each pacing its steps in wall time with the
cost preset) over HTTP, as a client would send it:

    POST /v1/completions   prompt = token ids (built as the harness builds them: replay.tokens)
                           max_tokens = output_length, stream, include_usage
                           X-Session-ID: session_id (the affinity hint agents send)
    TTFT        = first streamed text - send time (wall clock)
    cached      = usage.prompt_tokens_details.cached_tokens (the worker's prefix-cache hit)

NOTE: two choices keep the live run comparable to the harness.
- The sim draws output tokens from the request id, which the gateway assigns, so a client cannot
  know what a turn generated (the gateway returns text). ``logit_bias`` {"a": 100} with
  temperature 0 makes the sim emit "a" every time (its greedy pick among equal logits plus the
  bias), so the next turn's prompt = prompt + ["a"] * output + new blocks, the ids the worker
  really cached. The harness draws its own ids; only the shape of sharing matters to caching.
- Tenants are not sent as API keys: the harness does not salt page hashes per tenant, so the
  live run stays in one cache namespace as well.

The worker geometry is the harness's (``replay.sim_worker.replay_model_config``), written with
the demo tokenizer into a temporary model directory; engine fields without a flag go through
``AGENTGATE_*`` variables (``EngineConfig.from_env``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec

from engine.cost import COST_PRESETS
from replay.harness import ReplayConfig, ReplayResult
from replay.harness import replay as harness_replay
from replay.metrics import ERROR, OK, RequestRecord, Summary, summarize
from replay.sim_worker import TOKEN_BYTES
from replay.tokens import Prompt, PromptBuilder
from replay.workloads import TraceRequest, first_by_arrival

__all__ = ["Agreement", "LiveComparison", "LiveResult", "agreement", "compare_live",
           "live_model_dir", "live_slice", "replay_live"]

MODEL_NAME = "replay-sim"
OUTPUT_TEXT = "a"  # NOTE: one token in the demo tokenizer; see the module docstring
# NOTE: the demo tokenizer's vocabulary, not the harness's 152k: the sim's biased sampling builds
# a logits row per token, and only the pattern of shared blocks matters to caching
LIVE_VOCAB_SIZE = 320
WARM_UP_TOKENS = 8
ROUND_TRIP_PROBES = 3
READY_TIMEOUT_S = 120.0
MAX_HIT_RATE_POINTS = 2.0  # the agreement bounds
MAX_TTFT_P50_REL = 0.15


@dataclass(slots=True)
class LiveResult:
    """A live replay: one ``RequestRecord`` per request (wall seconds since the start)."""

    router: str | None
    records: list[RequestRecord]
    summary: Summary
    wall_s: float
    # TTFT of a tiny request on the idle system minus its step time: what HTTP, the gateway
    # and ZeroMQ add to every live TTFT (the in-process replay has no such term)
    round_trip_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Agreement:
    """Live vs in-process on the same slice: hit rate in points, TTFT p50 relative."""

    live_hit_rate: float
    sim_hit_rate: float
    live_ttft_p50_s: float
    sim_ttft_p50_s: float
    round_trip_s: float = 0.0

    @property
    def hit_rate_points(self) -> float:
        return abs(self.live_hit_rate - self.sim_hit_rate) * 100

    @property
    def ttft_p50_rel(self) -> float:
        return abs(self.live_ttft_p50_s - self.sim_ttft_p50_s) / max(self.sim_ttft_p50_s, 1e-9)

    def ok(self, max_points: float = MAX_HIT_RATE_POINTS,
           max_rel: float = MAX_TTFT_P50_REL) -> bool:
        return self.hit_rate_points <= max_points and self.ttft_p50_rel <= max_rel

    def line(self) -> str:
        return (f"hit rate live {self.live_hit_rate:.1%} vs in-process {self.sim_hit_rate:.1%} "
                f"({self.hit_rate_points:.2f} points); TTFT p50 live "
                f"{self.live_ttft_p50_s * 1e3:.0f} ms vs in-process "
                f"{self.sim_ttft_p50_s * 1e3:.0f} ms ({self.ttft_p50_rel:.1%}; idle round trip "
                f"{self.round_trip_s * 1e3:.0f} ms)")


def agreement(live: Summary, sim: Summary, round_trip_s: float = 0.0) -> Agreement:
    return Agreement(live.hit_rate, sim.hit_rate, live.ttft_p50_s, sim.ttft_p50_s,
                     round_trip_s)


@dataclass(slots=True)
class LiveComparison:
    """``compare_live``'s answer: the slice both runs replayed, and the two results."""

    requests: list[TraceRequest]
    live: LiveResult
    sim: ReplayResult
    agreement: Agreement

    def to_dict(self) -> dict[str, object]:
        a = self.agreement
        return {"requests": len(self.requests), "router": self.live.router,
                "policy": self.sim.policy, "live": self.live.summary.to_dict(),
                "in_process": self.sim.summary.to_dict(), "live_wall_s": self.live.wall_s,
                "hit_rate_points": a.hit_rate_points, "ttft_p50_rel": a.ttft_p50_rel,
                "round_trip_s": a.round_trip_s,
                "agrees": a.ok()}


def compare_live(requests: Sequence[TraceRequest], cfg: ReplayConfig, limit: int,
                 router: str = "agentgate", max_think_s: float | None = 1.0,
                 max_output_tokens: int | None = None,
                 progress: Callable[[int, int], None] | None = None) -> LiveComparison:
    """``live_slice`` of ``requests``, replayed live (``replay_live`` with ``--router router``)
    and in process (``replay.harness.replay`` with the same policy), with retention off in
    both: the OpenAI completions path retains nothing.
    """
    part = live_slice(requests, limit, max_think_s, max_output_tokens)
    cfg = replace(cfg, retention=False)
    sim = harness_replay(part, router, cfg)
    live = replay_live(part, cfg, router, progress)
    return LiveComparison(part, live, sim,
                          agreement(live.summary, sim.summary, live.round_trip_s))


def live_slice(requests: Sequence[TraceRequest], limit: int,
               max_think_s: float | None = None,
               max_output_tokens: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests in (estimated) arrival order whose parents are in, so a slice
    is a window of time, not a few whole sessions. ``max_think_s`` and ``max_output_tokens`` cap
    pauses and answers so that a slice replays in wall time in seconds; the in-process run must
    get the same slice.

    ``replay.workloads.first_by_arrival`` picks the window (after capping the pauses).
    """
    paused = [_capped(r, max_think_s, None) for r in requests]
    keep = {r.request_id for r in first_by_arrival(paused, limit)}
    orig = {r.request_id: r for r in requests}
    out: dict[str, TraceRequest] = {}
    for r in requests:
        if r.request_id not in keep:
            continue
        capped = _capped(r, max_think_s, max_output_tokens)
        if r.prefix_from_parent:
            # NOTE: a capped answer shortens every continuing child's prompt by as much
            p, cp = orig[r.parent], out[r.parent]  # type: ignore[index]
            new = r.input_length - p.input_length - p.output_length
            capped = replace(capped, input_length=cp.input_length + cp.output_length + new)
        out[r.request_id] = capped
    return list(out.values())


def live_model_dir(out: Path, vocab_size: int = LIVE_VOCAB_SIZE) -> Path:
    """The harness's sim geometry and the demo tokenizer in ``out`` (what the live gateway and
    its sim workers read); returns ``out``."""
    from gateway.tokenizer import write_demo_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    write_demo_tokenizer(out)
    (out / "config.json").write_text(json.dumps(replay_model_dict(vocab_size)))
    return out


def replay_model_dict(vocab_size: int = LIVE_VOCAB_SIZE) -> dict:
    """``replay.sim_worker.replay_model_config()`` as a config.json dict, but for the
    vocabulary (tests check that the two agree)."""
    from engine.models.checkpoint import mimo_config
    from replay.sim_worker import FULL_EVERY, HEAD_DIM, KV_HEADS, LAYERS, WINDOW

    layers = "".join("F" if i % FULL_EVERY == 0 else "S" for i in range(LAYERS))
    return mimo_config(
        layers=layers, sliding_window=WINDOW, vocab_size=vocab_size,
        hidden_size=1024, num_attention_heads=16, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, max_position_embeddings=1 << 22,
        swa_num_key_value_heads=KV_HEADS,
    )


def replay_live(requests: Sequence[TraceRequest], cfg: ReplayConfig, router: str | None = None,
                progress: Callable[[int, int], None] | None = None,
                timeout_s: float = 600.0) -> LiveResult:
    """Replay ``requests`` through ``agentgate serve --backend sim`` with ``cfg.num_workers``
    workers sized as the harness's (``router``: ``--router NAME``; None: the gateway's default).
    Every process is stopped when this returns or raises.

    Raises:
        RuntimeError: the gateway did not start, or the replay ran past ``timeout_s``.
    """
    with tempfile.TemporaryDirectory(prefix="agentgate-live-") as tmp:
        model_dir = live_model_dir(Path(tmp) / MODEL_NAME)
        with _serve(model_dir, cfg, router) as base_url:
            t0 = time.perf_counter()
            driver = _Driver(base_url, requests, cfg, progress, output_token_id(model_dir))
            records = asyncio.run(asyncio.wait_for(driver.run(), timeout_s))
            wall_s = time.perf_counter() - t0
    ids = [f"w{i}" for i in range(cfg.num_workers)]
    return LiveResult(router, records, summarize(router or "default", records, ids, 0), wall_s,
                      driver.round_trip_s)


def output_token_id(model_dir: Path) -> int:
    """The id of ``OUTPUT_TEXT`` in ``model_dir``'s tokenizer (one token, not a stop token)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(OUTPUT_TEXT).ids
    assert len(ids) == 1, f"{OUTPUT_TEXT!r} is {len(ids)} tokens in {model_dir}"
    return ids[0]


# --------------------------------------------------------------------------- the client


class _Driver:
    """Sends each request at its arrival (open loop) or ``think_s`` after its parent's answer
    ended (closed loop), and records what came back."""

    def __init__(self, base_url: str, requests: Sequence[TraceRequest], cfg: ReplayConfig,
                 progress: Callable[[int, int], None] | None, token_id: int) -> None:
        self.url, self.cfg, self.progress = f"{base_url}/v1/completions", cfg, progress
        self.requests = list(requests)
        self.by_id = {r.request_id: r for r in self.requests}
        self.children: dict[str, list[TraceRequest]] = {}
        for r in self.requests:
            if r.parent is not None:
                self.children.setdefault(r.parent, []).append(r)
        self.builder = PromptBuilder(cfg.page_tokens, cfg.block_size, LIVE_VOCAB_SIZE)
        self.prompts: dict[str, Prompt] = {}
        self.outputs: dict[str, int] = {}
        self.records: dict[str, RequestRecord] = {}
        self.token_id = token_id
        self.round_trip_s = 0.0
        self.tasks: set[asyncio.Task] = set()
        self.done = 0

    async def run(self) -> list[RequestRecord]:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
            self.client = client
            await self._warm_up()
            self.t0 = time.perf_counter()
            for r in self.requests:
                if r.parent is None:
                    self._later(r, r.arrival_s / self.cfg.rate_scale)  # type: ignore[operator]
            while self.tasks:
                await asyncio.wait(set(self.tasks))
        return [self.records[r.request_id] for r in self.requests if r.request_id in self.records]

    async def _warm_up(self) -> None:
        """Two tiny requests per worker at once before the clock starts, so that no measured
        request pays a process's first-request costs. NOTE: shorter than a page, they leave
        nothing in any prefix cache."""
        n = min(WARM_UP_TOKENS, self.cfg.page_tokens - 1)
        self.t0 = time.perf_counter()
        reqs = [TraceRequest(f"warm-up-{i}", f"warm-up-{i}", "default", 0.0, None, 0.0, False,
                             (2**50 + i,), n, 2) for i in range(2 * self.cfg.num_workers)]
        records = [RequestRecord(r.request_id, 0.0, n) for r in reqs]
        bodies = [self._body(r, self.builder.fresh(r.hash_ids, n)) for r in reqs]
        await asyncio.gather(*(self._stream(r, b, rec)
                               for r, b, rec in zip(reqs, bodies, records)))
        ttfts = []
        for r, body in zip(reqs[:ROUND_TRIP_PROBES], bodies):  # NOTE: one at a time: idle
            rec = RequestRecord(r.request_id, self._now(), n)
            await self._stream(r, body, rec)
            ttfts.append(rec.first_token_s - rec.arrival_s)  # type: ignore[operator]
        step_s = COST_PRESETS[self.cfg.cost].step_time(n, 0, n * n)
        self.round_trip_s = max(0.0, sorted(ttfts)[len(ttfts) // 2] - step_s)

    def _later(self, req: TraceRequest, at_s: float) -> None:
        task = asyncio.create_task(self._send_at(req, at_s))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _send_at(self, req: TraceRequest, at_s: float) -> None:
        await asyncio.sleep(max(0.0, at_s - self._now()))
        prompt = self._prompt(req)
        body = self._body(req, prompt)
        # NOTE: arrival = the moment the request leaves (building and encoding it is the
        # client's work, not the system's); the harness's arrival is its arrival at the router
        rec = RequestRecord(req.request_id, self._now(), prompt.num_tokens)
        self.records[req.request_id] = rec
        try:
            await self._stream(req, body, rec)
        except Exception as e:  # NOTE: one failed request must not end the replay
            rec.status, rec.reason = ERROR, f"{type(e).__name__}: {e}"
        rec.finish_s = self._now()
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, len(self.requests))
        self.outputs[req.request_id] = rec.output_tokens
        for child in self.children.get(req.request_id, ()):
            self._later(child, rec.finish_s + child.think_s / self.cfg.rate_scale)

    def _body(self, req: TraceRequest, prompt: Prompt) -> bytes:
        return msgspec.json.encode({
            "model": MODEL_NAME, "prompt": prompt.ids.tolist(), "max_tokens": req.output_length,
            "temperature": 0, "logit_bias": {str(self.token_id): 100}, "stream": True,
            "stream_options": {"include_usage": True}})

    async def _stream(self, req: TraceRequest, body: bytes, rec: RequestRecord) -> None:
        headers = {"content-type": "application/json"}
        if req.session_id:
            headers["x-session-id"] = req.session_id
        async with self.client.stream("POST", self.url, content=body, headers=headers) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    self._event(json.loads(line[6:]), rec)
        if rec.first_token_s is None:
            raise RuntimeError("the stream ended without a token")

    def _event(self, event: dict, rec: RequestRecord) -> None:
        if "error" in event:
            raise RuntimeError(f"error event: {event['error']}")
        if rec.first_token_s is None and any(c.get("text") for c in event.get("choices", ())):
            rec.first_token_s = self._now()
        usage = event.get("usage")
        if usage:
            rec.output_tokens = usage["completion_tokens"]
            details = usage.get("prompt_tokens_details") or {}
            rec.cached_tokens = min(details.get("cached_tokens", 0), rec.prompt_tokens)
            rec.status = OK

    def _prompt(self, req: TraceRequest) -> Prompt:
        if req.parent is None or not req.prefix_from_parent:
            prompt = self.builder.fresh(req.hash_ids, req.input_length)
        else:
            parent = self.by_id[req.parent]
            new = req.input_length - parent.input_length - parent.output_length
            output = [self.token_id] * self.outputs.get(req.parent, 0)
            prompt = self.builder.continued(self.prompts[req.parent], output, req.hash_ids, new)
        if req.request_id in self.children:
            self.prompts[req.request_id] = prompt
        return prompt

    def _now(self) -> float:
        return time.perf_counter() - self.t0


# --------------------------------------------------------------------------- the server


@contextlib.contextmanager
def _serve(model_dir: Path, cfg: ReplayConfig, router: str | None) -> Iterator[str]:
    """``agentgate serve --backend sim`` sized as ``cfg``; yields its base URL."""
    port = _free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--model", str(model_dir),
           "--backend", "sim", "--workers", str(cfg.num_workers), "--host", "127.0.0.1",
           "--port", str(port), "--cost", cfg.cost, "--page-size", str(cfg.page_tokens),
           "--max-batched-tokens", str(cfg.max_batched_tokens),
           "--first-token-timeout", "3600", "--idle-timeout", "3600",
           "--gcache", "off",  # NOTE: the in-process replay has no L3 (nor pages of past runs)
           *_routing_flags(cfg, router)]
    env = {**os.environ, **_engine_env(cfg),
           "AGENTGATE_TENANT_SECRET": secrets.token_hex(16)}  # NOTE: never touch ~/.config
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            base_url = f"http://127.0.0.1:{port}"
            _wait_ready(proc, base_url, log)
            yield base_url
        finally:
            _stop(proc)


def _routing_flags(cfg: ReplayConfig, router: str | None) -> list[str]:
    """``--router NAME`` and, when the harness runs without admission, ``--no-admission``, as
    far as this ``agentgate serve`` has them (the gateway's routing flags are recent)."""
    help_text = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--help"], capture_output=True,
        text=True, timeout=120).stdout
    flags = []
    if router is not None:
        if "--router" not in help_text:
            raise RuntimeError("this agentgate serve has no --router flag")
        flags += ["--router", router]
    if not cfg.admission and "--no-admission" in help_text:
        flags.append("--no-admission")
    return flags


def _engine_env(cfg: ReplayConfig) -> dict[str, str]:
    """Engine fields ``agentgate serve`` has no flag for, as ``replay.sim_worker.WorkerSpec``
    sets them."""
    env = {"AGENTGATE_KV_BUDGET_BYTES": str(int(cfg.kv_budget_tokens * TOKEN_BYTES)),
           "AGENTGATE_MAX_RUNNING_REQUESTS": str(cfg.max_running_requests),
           "AGENTGATE_MAX_WAITING_REQUESTS": str(1 << 30),
           "AGENTGATE_KEEP_PAGE_TOKENS": "false"}
    if cfg.checkpoint_interval_tokens is not None:
        env["AGENTGATE_CHECKPOINT_INTERVAL_TOKENS"] = str(cfg.checkpoint_interval_tokens)
    return env


def _wait_ready(proc: subprocess.Popen, base_url: str, log: object) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            log.seek(0)  # type: ignore[attr-defined]
            out = log.read().decode(errors="replace")[-4000:]  # type: ignore[attr-defined]
            state = f"exited {proc.returncode}" if proc.returncode is not None else "not ready"
            raise RuntimeError(f"agentgate serve {state}:\n{out}")
        try:
            with urllib.request.urlopen(f"{base_url}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)


def _stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGINT (the gateway drains and stops its workers); SIGKILL to the group if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _capped(r: TraceRequest, max_think_s: float | None,
            max_output_tokens: int | None) -> TraceRequest:
    think = r.think_s if max_think_s is None else min(r.think_s, max_think_s)
    output = r.output_length if max_output_tokens is None else min(
        r.output_length, max_output_tokens)
    return replace(r, think_s=think, output_length=output)
