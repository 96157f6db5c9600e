"""``gateway.media`` against a real encoder service over ZeroMQ on 127.0.0.1 (a fake tower: a
seeded projection of the bytes' sha256) and real images made here by Pillow: media found in
prompt order, keyed per tenant, widened into placeholder spans, and every bad input a 400 that
names its content part (or a 503 when no encoder answers), never a hang."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from encoders.embed_cache import EmbeddingCache
from encoders.fetch import FetchPolicy
from encoders.media import MediaLimits
from encoders.protocol import Description, EmbeddingKey
from encoders.service import EncoderClient, EncoderService
from engine.protocol import MEDIA_ID_BASE, MEDIA_ID_LIMIT
from gateway.media import MediaPipeline, media_refs, placeholder_ids
from gateway.schemas import RequestError, decode_chat_request
from gateway.tokenizer import Tokenizer

TPI = 4  # tokens per image of the fake tower
HIDDEN = 8
DESCRIPTION = Description(tokens_per_image=TPI, num_frames=3, preprocess_id="p1",
                          tower_fingerprint="t1", hidden_size=HIDDEN)
_PROJECTION = torch.randn(32, HIDDEN, generator=torch.Generator().manual_seed(0))
WAIT_S = 10.0


def _encode_fn(datas: list[bytes]) -> list[torch.Tensor | Exception]:
    out: list[torch.Tensor | Exception] = []
    for data in datas:
        if data.startswith(b"\x89PNG") and b"IEND" not in data:
            out.append(ValueError("corrupt PNG data: truncated"))
            continue
        digest = torch.tensor(list(hashlib.sha256(data).digest()), dtype=torch.float32)
        out.append((digest @ _PROJECTION).repeat(TPI, 1))
    return out


def _png(seed: int, size: int = 32) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _png_claiming(width: int, height: int) -> bytes:
    """A real small PNG whose header says width x height: a decompression bomb's header."""
    data = bytearray(_png(0))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _chat(*contents: list[dict[str, object]] | str) -> list:  # type: ignore[type-arg]
    body = {"model": "m", "messages": [{"role": "user", "content": c} for c in contents]}
    import json

    return decode_chat_request(json.dumps(body).encode()).messages


def _image(url: str) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def encoder() -> Iterator[EncoderService]:
    service = EncoderService(_encode_fn, EmbeddingCache(max_bytes=1 << 20),
                             description=DESCRIPTION)
    service.serve("tcp://127.0.0.1:0")
    try:
        yield service
    finally:
        service.close()


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


def _run(encoder: EncoderService | None, tokenizer: Tokenizer, coro_fn, **kwargs):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        client = None if encoder is None else EncoderClient(
            [kwargs.pop("endpoint", None) or encoder.endpoint], timeout_s=kwargs.pop(
                "timeout_s", WAIT_S))
        pipeline = MediaPipeline.for_tokenizer(client, tokenizer, **kwargs)
        try:
            return await asyncio.wait_for(coro_fn(pipeline), WAIT_S * 2)
        finally:
            await pipeline.aclose()

    return asyncio.run(main())


def test_media_are_found_in_prompt_order_and_bounded() -> None:
    frames = {"type": "video", "video": [_uri(_png(1)), _uri(_png(2))]}
    messages = _chat([_image("data:,a"), {"type": "text", "text": "x"}, frames],
                     [_image("data:,b")])
    refs = media_refs(messages, MediaLimits())
    assert [(r.param, r.kind, r.group) for r in refs] == [
        ("messages[0].content[0]", "image", 0), ("messages[0].content[2].video[0]", "frame", 1),
        ("messages[0].content[2].video[1]", "frame", 1), ("messages[1].content[0]", "image", 2)]
    with pytest.raises(RequestError) as info:
        media_refs(messages, MediaLimits(max_images_per_request=3))
    assert info.value.param == "messages[1].content[0]" and "more than 3" in info.value.message
    # NOTE: a session's history was checked when it was sent: only the new messages count
    assert len(media_refs(messages, MediaLimits(max_images_per_request=1), count_from=1)) == 4
    with pytest.raises(RequestError, match="1 to 2 frames"):
        media_refs(_chat([{"type": "video", "video": ["data:,a"] * 3}]), MediaLimits(max_frames=2))


def test_placeholder_ids_name_the_content_outside_every_vocabulary() -> None:
    key = EmbeddingKey(cache_salt="a", content_hash="ab" * 32, preprocess_id="p",
                       tower_fingerprint="t")
    ids = placeholder_ids(key, 10)
    assert len(ids) == 10 and all(MEDIA_ID_BASE <= i < MEDIA_ID_LIMIT for i in ids)
    # NOTE: the tenant is not in them (page hashes are salted); the content, preprocessing and
    # tower are
    assert placeholder_ids(EmbeddingKey(cache_salt="b", content_hash="ab" * 32,
                                        preprocess_id="p", tower_fingerprint="t"), 10) == ids
    for other in ({"content_hash": "cd" * 32}, {"preprocess_id": "q"}, {"tower_fingerprint": "u"}):
        fields = {"content_hash": "ab" * 32, "preprocess_id": "p", "tower_fingerprint": "t",
                  **other}
        assert set(placeholder_ids(EmbeddingKey(**fields), 10)).isdisjoint(ids), other


def test_pads_widen_into_spans_and_the_encode_runs(
    encoder: EncoderService, tokenizer: Tokenizer
) -> None:
    a, b = _png(1), _png(2)
    messages = _chat([{"type": "text", "text": "look"}, _image(_uri(a))], [_image(_uri(b))])

    async def go(pipeline: MediaPipeline):  # type: ignore[no-untyped-def]
        media = await pipeline.start(messages, "tenant-1")
        assert media is not None
        ids = tokenizer.encode_chat([{"role": "user", "content": [
            {"type": "text", "text": "look"}, {"type": "image_url"}]},
            {"role": "user", "content": [{"type": "image_url"}]}], add_generation_prompt=True)
        expanded, spans = media.expand(ids)
        await media.encoded()
        return ids, expanded, spans, media

    ids, expanded, spans, media = _run(encoder, tokenizer, go)
    pad = tokenizer.token_to_id("<|image_pad|>")
    assert ids.count(pad) == 2 and pad not in expanded
    assert len(expanded) == len(ids) - 2 + 2 * TPI == len(ids) + media.num_tokens - 2
    assert [s.length for s in spans] == [TPI, TPI]
    for span, data in zip(spans, (a, b), strict=True):
        assert span.key.content_hash == hashlib.sha256(data).hexdigest()
        assert span.key.cache_salt == "tenant-1" and span.key.tower_fingerprint == "t1"
        assert expanded[span.offset:span.offset + span.length] == placeholder_ids(span.key, TPI)
    # NOTE: the service has them now, keyed per tenant: a Lookup finds them, another tenant's
    # key does not
    assert all(t is not None for t in encoder.cache.get_many([s.key for s in spans]))
    other = EmbeddingKey(cache_salt="tenant-2", content_hash=spans[0].key.content_hash,
                         preprocess_id="p1", tower_fingerprint="t1")
    assert encoder.cache.get(other) is None


def _bad(encoder: EncoderService | None, tokenizer: Tokenizer, content: list, **kwargs  # type: ignore[type-arg]
         ) -> RequestError:
    messages = _chat([{"type": "text", "text": "hi"}, *content])

    async def go(pipeline: MediaPipeline) -> None:
        media = await pipeline.start(messages, None)
        assert media is not None
        await media.encoded()

    start = time.monotonic()
    with pytest.raises(RequestError) as info:
        _run(encoder, tokenizer, go, **kwargs)
    assert time.monotonic() - start < WAIT_S, "a bad input must fail fast"
    return info.value


@pytest.mark.parametrize(("data", "words"), [
    (b"GIF89a-not-really", "corrupt"),
    (b"%PDF-1.4 hello", "not a supported image format"),
    (_png_claiming(30000, 30000), "900 MP"),
], ids=["corrupt", "unsupported", "bomb"])
def test_bad_images_are_400s_naming_the_part(encoder: EncoderService, tokenizer: Tokenizer,
                                             data: bytes, words: str) -> None:
    err = _bad(encoder, tokenizer, [_image(_uri(_png(9))), _image(_uri(data))])
    assert err.status == 400 and err.param == "messages[0].content[2]", (err.param, err.message)
    assert words in err.message, err.message


def test_an_image_that_fails_in_the_encoder_is_a_400_naming_its_part(
    encoder: EncoderService, tokenizer: Tokenizer
) -> None:
    truncated = _png(3)[:-12]  # NOTE: its header is fine; the fake tower refuses it
    err = _bad(encoder, tokenizer, [_image(_uri(_png(4))), _image(_uri(truncated))])
    assert err.status == 400 and err.param == "messages[0].content[2]", err.message
    assert "truncated" in err.message


def test_urls_are_refused_unless_allowed_and_never_reach_private_addresses(
    encoder: EncoderService, tokenizer: Tokenizer
) -> None:
    err = _bad(encoder, tokenizer, [_image("http://example.com/cat.png")])
    assert err.param == "messages[0].content[1]" and "--allow-media-urls" in err.message
    policy = FetchPolicy(allow_urls=True, timeout_s=2.0)
    for url in ("http://127.0.0.1:9/cat.png", "http://localhost:9/x.png", "http://10.0.0.1/x"):
        err = _bad(encoder, tokenizer, [_image(url)], policy=policy)
        assert err.param == "messages[0].content[1]" and "public" in err.message, err.message


def test_too_many_images_is_a_400(encoder: EncoderService, tokenizer: Tokenizer) -> None:
    err = _bad(encoder, tokenizer, [_image(_uri(_png(i))) for i in range(3)],
               limits=MediaLimits(max_images_per_request=2))
    assert err.param == "messages[0].content[3]" and err.code == "too_many_images"


def test_no_encoder_is_a_400_and_a_dead_one_a_503(tokenizer: Tokenizer,
                                                  encoder: EncoderService) -> None:
    err = _bad(None, tokenizer, [_image(_uri(_png(1)))])
    assert err.status == 400 and "takes no images" in err.message
    err = _bad(encoder, tokenizer, [_image(_uri(_png(1)))], endpoint="tcp://127.0.0.1:9",
               timeout_s=0.5)
    assert err.status == 503 and err.code == "encoder_unavailable", err.message


def test_a_template_that_drops_images_is_a_400(encoder: EncoderService,
                                               tokenizer: Tokenizer) -> None:
    messages = _chat([_image(_uri(_png(1)))])

    async def go(pipeline: MediaPipeline) -> None:
        media = await pipeline.start(messages, None)
        assert media is not None
        media.cancel()
        media.expand(tokenizer.encode("no pads here"))

    with pytest.raises(RequestError, match="placed 0 media markers for 1"):
        _run(encoder, tokenizer, go)
