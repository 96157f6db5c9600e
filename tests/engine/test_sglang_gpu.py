"""End to end on a GPU with SGLang installed (issue 16): ``agentgate serve --backend sglang`` on
the demo checkpoint, checked against ``agentgate serve --backend native`` on the same GPU.

Skipped with a reason where SGLang or CUDA is missing (``gpu`` marker: tests/conftest.py). Run
it with ``pip install 'agentgate[sglang]'`` on a CUDA machine:
``pytest tests/engine/test_sglang_gpu.py -q``. The README says where it last ran.

- The first 32 greedy tokens of both backends agree in bf16: where they first differ, the two
  candidates must be a near tie in the native engine's own top logprobs (bf16 rounding picks
  either), and everything before that point must be identical.
- SGLang's KV events reach the router (its index holds pages of this worker), and a second turn
  that extends the first reports cached prompt tokens.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                       reason="SGLang is not installed (pip install 'agentgate[sglang]')"),
]

ROOT = Path(__file__).resolve().parents[2]
BF16_TIE = 0.05  # NOTE: nats between the two candidates' logprobs that bf16 rounding can flip
START_S = 900.0
PROMPT = "Explain, step by step, how a sliding window attention layer limits its KV cache."


@contextmanager
def serve(model: Path, backend: str, port: int) -> Iterator[str]:
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--backend", backend,
           "--model", str(model), "--port", str(port), "--dtype", "bfloat16"]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, f"agentgate serve --backend {backend} exited"
            assert time.monotonic() < deadline, f"{backend}: not ready in {START_S} s"
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)


def _chat(url: str, messages: list[dict[str, str]]) -> dict:
    import httpx

    body = {"model": "demo-model", "messages": messages, "max_tokens": 32, "temperature": 0,
            "logprobs": True, "top_logprobs": 5}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _tokens(reply: dict) -> list[dict]:
    return reply["choices"][0]["logprobs"]["content"]


def _metric(url: str, name: str) -> float:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = [float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(values)


def test_sglang_serves_the_demo_model_like_the_native_engine(tmp_path: Path) -> None:
    from gateway.cli import init_demo_model
    from tests.engine.worker_harness import free_port

    model = init_demo_model(tmp_path / "demo")
    messages = [{"role": "user", "content": PROMPT}]
    with serve(model, "native", free_port()) as native_url:
        native = _tokens(_chat(native_url, messages))
    with serve(model, "sglang", free_port()) as url:
        first = _chat(url, messages)
        ours = _tokens(first)
        assert len(ours) == len(native) == 32, (len(ours), len(native))
        for i, (a, b) in enumerate(zip(native, ours, strict=True)):
            if a["token"] == b["token"]:
                continue
            top = {t["token"]: t["logprob"] for t in a["top_logprobs"]}
            assert b["token"] in top, f"token {i}: sglang's {b['token']!r} not in native's top 5"
            assert abs(top[b["token"]] - a["logprob"]) <= BF16_TIE, (i, a, b)
            break  # NOTE: after a tie flips, the two continuations may differ
        deadline = time.monotonic() + 30
        while _metric(url, "agentgate_routing_index_pages") == 0:
            assert time.monotonic() < deadline, "no KV event of the worker reached the router"
            time.sleep(0.5)
        answer = first["choices"][0]["message"]["content"]
        turn2 = [*messages, {"role": "assistant", "content": answer},
                 {"role": "user", "content": "And with a window of 128 tokens?"}]
        second = _chat(url, turn2)
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0, second["usage"]
