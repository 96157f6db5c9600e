"""Images end to end: the real ``openai`` package against a live ``agentgate serve`` of the demo
model (native worker, the encoder process ``serve`` starts for the demo's vision tower), with
images made here by Pillow. The same image again hits the prefix cache through its span, a
changed image misses from its span on, the usage counts image tokens, bad media are 400s naming
the part, session turns carry their images, and the encoder process is supervised like the
workers (restarted when killed, gone when ``serve`` is)."""

from __future__ import annotations

import base64
import io
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from tests.encoders.clips import make_clip
from tests.gateway.live import LiveGateway, live_gateway
from tests.gateway.serve_proc import post_json, proc_state, serve_proc, wait_until

TPI = 16  # the demo tower: 64x64 images, 8x8 patches, 2x2 merge
PAGE = 16
CLIP_FRAMES = 8  # frames the encoder samples from a clip (encoders.encode)


def _jpeg(seed: int, size: tuple[int, int] = (80, 60)) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _image_part(data: bytes, mime: str = "image/jpeg") -> dict[str, Any]:
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


def _messages(image: bytes, question: str = "What is in this picture?") -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You describe pictures."},
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, _image_part(image),
                                         {"type": "text", "text": question}]}]


@pytest.fixture(scope="module")
def gateway(demo_model_dir: Path) -> Iterator[LiveGateway]:
    # NOTE: AGENTGATE_ENCODER="" undoes the suite's "off": serve starts its encoder
    with live_gateway(demo_model_dir, "--served-model-name", "demo", backend="native",
                      env={"AGENTGATE_ENCODER": ""}) as live:
        yield live


@pytest.fixture(scope="module")
def client(gateway: LiveGateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.api_url, api_key="sk-media", max_retries=0,
                       timeout=60) as c:
        yield c


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(model="demo", messages=messages, max_tokens=4,
                                          temperature=0, **kwargs)


def test_an_image_round_trip_counts_its_tokens(client: openai.OpenAI) -> None:
    answer = _chat(client, _messages(_jpeg(1)))
    usage = answer.usage
    assert answer.choices[0].finish_reason in ("length", "stop"), answer
    details = usage.prompt_tokens_details.model_dump()
    assert details["image_tokens"] == TPI, details
    text_only = _chat(client, [{"role": "user", "content": "Look: What is in this picture?"}])
    assert usage.prompt_tokens > text_only.usage.prompt_tokens + TPI - 8


def test_the_same_image_hits_and_a_changed_one_misses_from_its_span(
    client: openai.OpenAI,
) -> None:
    first = _chat(client, _messages(_jpeg(2)))
    again = _chat(client, _messages(_jpeg(2)))
    prompt = again.usage.prompt_tokens
    # NOTE: everything but the last partial page (the worker recomputes at least one token)
    assert again.usage.prompt_tokens_details.cached_tokens >= (prompt - 1) // PAGE * PAGE, again
    assert _tokens(again) == _tokens(first), "cached and uncached runs must agree"
    changed = _chat(client, _messages(_jpeg(3)))
    # NOTE: the system message and "Look:" come before the image: at most those pages hit
    image_start = prompt - TPI - len("What is in this picture?") - 20
    assert changed.usage.prompt_tokens_details.cached_tokens <= image_start, changed.usage


def _tokens(answer: Any) -> str:
    return answer.choices[0].message.content or ""


def test_streamed_answers_agree_with_whole_ones(client: openai.OpenAI) -> None:
    messages = _messages(_jpeg(4))
    whole = _chat(client, messages)
    chunks = list(_chat(client, messages, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _tokens(whole)
    assert chunks[-1].usage.prompt_tokens_details.model_dump()["image_tokens"] == TPI


@pytest.mark.parametrize(("part", "words"), [
    (_image_part(b"\xff\xd8\xff\xe0 not a jpeg at all", "image/jpeg"), "corrupt"),
    (_image_part(b"%PDF-1.7 a document", "application/pdf"), "not a supported image format"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
     "--allow-media-urls"),
], ids=["corrupt", "unsupported", "url-off"])
def test_bad_media_are_400s_naming_the_part(client: openai.OpenAI, part: dict[str, Any],
                                            words: str) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "see"}, part]}]
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, messages)
    body = info.value.body
    assert isinstance(body, dict) and body.get("param") == "messages[0].content[1]", body
    assert words in body["message"], body
    # NOTE: nothing stalled: the next request is answered
    assert _chat(client, _messages(_jpeg(5))).usage.completion_tokens >= 1


def _video_part(data: bytes) -> dict[str, Any]:
    url = f"data:video/mp4;base64,{base64.b64encode(data).decode()}"
    return {"type": "video_url", "video_url": {"url": url}}


def test_a_clip_and_a_frame_list_count_their_frames(client: openai.OpenAI) -> None:
    clip = [{"role": "user", "content": [_video_part(make_clip(2.0)),
                                         {"type": "text", "text": "What happens?"}]}]
    answer = _chat(client, clip)
    assert answer.usage.prompt_tokens_details.model_dump()["image_tokens"] == CLIP_FRAMES * TPI
    frames = [_image_part(_jpeg(20 + i))["image_url"]["url"] for i in range(3)]
    listed = [{"role": "user", "content": [{"type": "video", "video": frames}]}]
    answer = _chat(client, listed)
    assert answer.usage.prompt_tokens_details.model_dump()["image_tokens"] == 3 * TPI


def test_a_clip_that_is_too_long_is_a_400_naming_the_part(client: openai.OpenAI) -> None:
    # NOTE: 61 s at 1 fps of 16x16: cheap to make, over the 60 s limit
    messages = [{"role": "user", "content": [{"type": "text", "text": "see"},
                                             _video_part(make_clip(61, fps=1, size=16))]}]
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, messages)
    body = info.value.body
    assert isinstance(body, dict) and body.get("param") == "messages[0].content[1]", body
    assert "longer than the limit" in body["message"], body


def test_session_turns_carry_their_images(gateway: LiveGateway) -> None:
    base = f"{gateway.base_url}/v1/sessions"
    session = post_json(base, {"system": "You describe pictures."})
    turn = {"messages": [{"role": "user", "content": [_image_part(_jpeg(6)),
                                                      {"type": "text", "text": "and?"}]}],
            "max_tokens": 3, "temperature": 0}
    first = post_json(f"{base}/{session['id']}/turns", turn)
    assert first["usage"]["prompt_tokens"] >= TPI + 5, first
    assert first["usage"]["prompt_tokens_details"]["image_tokens"] == TPI, first
    second = post_json(f"{base}/{session['id']}/turns", {
        "messages": [{"role": "user", "content": "Again, the same picture?"}], "max_tokens": 3,
        "temperature": 0})
    # NOTE: the first turn's prompt, image included, is in the cache (whole pages of it)
    covered = (first["usage"]["prompt_tokens"] - 1) // PAGE * PAGE
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= covered, second


def test_the_encoder_process_is_supervised(demo_model_dir: Path, tmp_path: Path) -> None:
    env = {"AGENTGATE_ENCODER": ""}
    with serve_proc(demo_model_dir, tmp_path, env=env) as serve:
        [encoder] = serve.encoder_pids()
        os.kill(encoder, signal.SIGKILL)
        # NOTE: one read per poll: the killed one may still be listed, then none for a moment
        [restarted] = wait_until(lambda: [p for p in serve.encoder_pids() if p != encoder], 60,
                                 "a killed encoder is restarted")
        body = {"model": "m", "messages": _messages(_jpeg(7)), "max_tokens": 2}
        url = f"{serve.base_url}/v1/chat/completions"
        answer = _retry(lambda: post_json(url, body))
        assert answer["usage"]["prompt_tokens_details"]["image_tokens"] == TPI
        assert serve.stop(signal.SIGTERM) == 0
        wait_until(lambda: proc_state(restarted) in (None, "Z"), 20,
                   "the encoder stops with serve")


def _retry(call: Any, timeout_s: float = 30.0) -> Any:
    """The restarted encoder binds its port again within a few seconds: until then a request
    with an image may be a 503."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_the_encoder_dies_with_a_killed_serve(demo_model_dir: Path, tmp_path: Path) -> None:
    with serve_proc(demo_model_dir, tmp_path, env={"AGENTGATE_ENCODER": ""}) as serve:
        [encoder] = serve.encoder_pids()
        serve.proc.kill()  # NOTE: SIGKILL: no handler runs; the encoder's --parent-pid does
        serve.proc.wait()
        wait_until(lambda: proc_state(encoder) in (None, "Z"), 20,
                   "the encoder of a SIGKILLed serve stops")


def test_media_metrics(gateway: LiveGateway, client: openai.OpenAI) -> None:
    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with urllib.request.urlopen(f"{gateway.base_url}/metrics", timeout=10) as r:
            text = r.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    before = scrape()
    _chat(client, _messages(_jpeg(30)))
    with pytest.raises(openai.BadRequestError):
        _chat(client, [{"role": "user", "content": [_image_part(b"%PDF-1.7 x", "image/png")]}])
    after = scrape()

    def grew(name: str, **labels: str) -> float:
        key = (f"agentgate_media_{name}_total", tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("items", kind="image") == 1  # NOTE: the refused one never reached the encoder
    assert grew("tokens") == TPI and grew("bytes") > 0
    assert grew("rejected", code="invalid_media") == 1
