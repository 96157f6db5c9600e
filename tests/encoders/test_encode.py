"""``encoders.encode.MediaEncoder`` on a tiny random tower saved into a model dir: images and clips
to [tokens, hidden] embeddings, determinism, per-item failures, batching, its ``Description``, and
``python -m encoders --model DIR`` serving it over ZeroMQ."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import av
import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from encoders.cli import main as cli_main
from encoders.embed_cache import from_embedding
from encoders.encode import MediaEncoder, load_media_encoder, make_encode_fn
from encoders.media import (
    MediaError,
    MediaLimits,
    content_hash,
    decode_image,
    preprocess_id,
)
from encoders.protocol import Description, EmbeddingKey, EncodeItem
from encoders.service import EncoderClient
from encoders.video import decode_clip
from encoders.vision import init_tower, save_tower, tower_fingerprint
from encoders.vision_config import demo_vision_config
from tests.encoders.encoder_proc import wait_for_start_line

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = 48
TPI = 16  # demo_vision_config: 64 / 8 patches per side, 2x2 merge -> 4 x 4 tokens
NUM_FRAMES = 4
ATOL = 1e-5
START_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    cfg = demo_vision_config(out_hidden_size=HIDDEN)
    save_tower(init_tower(cfg, seed=1), out, config=cfg)
    return out


@pytest.fixture(scope="module")
def encoder(model_dir: Path) -> MediaEncoder:
    enc = load_media_encoder(model_dir, num_frames=NUM_FRAMES)
    assert enc is not None
    return enc


def _make_photo(width: int, height: int, seed: int) -> np.ndarray:
    """A smooth gradient plus noise: different seeds give visibly different images."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    base = (base + rng.uniform(0, 255, 3)) % 256
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


def _image(seed: int = 0, fmt: str = "JPEG", size: tuple[int, int] = (96, 72)) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(_make_photo(*size, seed=seed)).save(buf, fmt)
    return buf.getvalue()


def _clip(seconds: float = 1.0, fps: int = 10, size: int = 64) -> bytes:
    """Frame i is a gradient shifted by 20 * i: every frame differs."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(round(seconds * fps)):
            pixels = ((_make_photo(size, size, seed=0).astype(np.int16) + 20 * i) % 256)
            frame = av.VideoFrame.from_ndarray(pixels.astype(np.uint8), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buf.getvalue()


def _assert_embedding(out: object, tokens: int, what: str) -> torch.Tensor:
    assert isinstance(out, torch.Tensor), f"{what}: {out!r}"
    assert out.shape == (tokens, HIDDEN), f"{what}: shape {tuple(out.shape)}"
    assert out.dtype == torch.float32 and out.device.type == "cpu", (what, out.dtype, out.device)
    assert torch.isfinite(out).all(), what
    return out


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = ATOL) -> None:
    diff = (got - want).abs().max().item()
    assert diff <= atol, f"{what}: max |diff| {diff} > {atol}"


# ---------------------------------------------------------------------- images and clips


def test_description_names_the_tower_and_preprocessing(encoder: MediaEncoder,
                                                      model_dir: Path) -> None:
    cfg = demo_vision_config(out_hidden_size=HIDDEN)
    assert (encoder.tokens_per_image, encoder.hidden_size, encoder.num_frames) == (
        TPI, HIDDEN, NUM_FRAMES)
    assert encoder.tower_fingerprint == tower_fingerprint(cfg, init_tower(cfg, seed=1))
    image_id = preprocess_id(cfg.image_size, cfg.image_mean, cfg.image_std)
    assert encoder.preprocess_id.startswith(image_id + "-"), encoder.preprocess_id
    assert ":" not in encoder.preprocess_id
    assert encoder.description == Description(
        tokens_per_image=TPI, num_frames=NUM_FRAMES, preprocess_id=encoder.preprocess_id,
        tower_fingerprint=encoder.tower_fingerprint, hidden_size=HIDDEN)
    assert [encoder.tokens_for(k) for k in ("image", "frame", "video")] == [
        TPI, TPI, NUM_FRAMES * TPI]


def test_the_frame_count_is_part_of_the_preprocess_id(model_dir: Path,
                                                      encoder: MediaEncoder) -> None:
    other = load_media_encoder(model_dir, num_frames=NUM_FRAMES + 1)
    assert other is not None
    assert other.preprocess_id != encoder.preprocess_id
    assert other.tower_fingerprint == encoder.tower_fingerprint


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF", "BMP"])
def test_images_encode_to_tokens_by_hidden(encoder: MediaEncoder, fmt: str) -> None:
    (out,) = encoder([_image(fmt=fmt)])
    _assert_embedding(out, TPI, fmt)


def test_the_same_image_gives_identical_embeddings(encoder: MediaEncoder) -> None:
    data = _image(seed=3)
    first, again_a, again_b = encoder([data]) + encoder([data, data])
    for name, out in (("again in a batch", again_a), ("twice in one batch", again_b)):
        assert isinstance(first, torch.Tensor) and isinstance(out, torch.Tensor)
        _assert_close(out, first, name)
    (repeat,) = encoder([data])
    assert isinstance(repeat, torch.Tensor) and torch.equal(repeat, first), "not deterministic"


def test_different_images_give_different_embeddings(encoder: MediaEncoder) -> None:
    outs = encoder([_image(seed=s) for s in range(3)])
    for i in range(3):
        for j in range(i + 1, 3):
            a, b = outs[i], outs[j]
            assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            diff = (a - b).abs().max().item()
            assert diff > 1e-3, f"images {i} and {j}: embeddings differ by only {diff}"


def test_a_bad_item_fails_alone(encoder: MediaEncoder) -> None:
    good = [_image(seed=5), _image(seed=6, fmt="PNG")]
    jpeg = _image(seed=7)
    bad = {1: (b"not an image", "not a supported image"), 2: (jpeg[:len(jpeg) // 2], "corrupt"),
           4: (b"", "not a supported"), 5: (_clip()[:200], "corrupt video")}
    datas = [good[0], bad[1][0], bad[2][0], good[1], bad[4][0], bad[5][0]]
    outs = encoder(datas)
    singles = [encoder([g])[0] for g in good]
    for i, (_, words) in bad.items():
        assert isinstance(outs[i], MediaError), f"item {i}: {outs[i]!r}"
        assert words in str(outs[i]), f"item {i}: {outs[i]} does not say {words!r}"
    for got, want, i in ((outs[0], singles[0], 0), (outs[3], singles[1], 3)):
        assert isinstance(want, torch.Tensor)
        _assert_close(_assert_embedding(got, TPI, f"item {i}"), want, f"item {i}")


def test_an_image_over_the_limits_is_a_media_error(model_dir: Path) -> None:
    enc = load_media_encoder(model_dir, limits=MediaLimits(max_pixels=64 * 64))
    assert enc is not None
    small, big = enc([_image(size=(64, 64)), _image(size=(65, 64))])
    _assert_embedding(small, TPI, "64x64")
    assert isinstance(big, MediaError) and "limit" in big.reason, big


def test_a_clip_gives_num_frames_times_tokens_per_image(encoder: MediaEncoder) -> None:
    data = _clip()
    (out,) = encoder([data])
    emb = _assert_embedding(out, NUM_FRAMES * TPI, "clip")
    # NOTE: frame i's rows are the embedding of that frame as an image (PNG: same pixels)
    frames = decode_clip(data, encoder.limits, NUM_FRAMES)
    pngs = []
    for frame in frames:
        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, "PNG")
        pngs.append(buf.getvalue())
    for i, single in enumerate(encoder(pngs)):
        assert isinstance(single, torch.Tensor)
        _assert_close(emb[i * TPI:(i + 1) * TPI], single, f"frame {i}")
    blocks = emb.view(NUM_FRAMES, TPI, HIDDEN)
    assert (blocks[0] - blocks[-1]).abs().max() > 1e-3, "the first and last frame encode alike"


def test_a_batch_equals_its_items_one_by_one(encoder: MediaEncoder, model_dir: Path) -> None:
    datas = [_image(seed=10), _clip(), _image(seed=11, fmt="PNG"), _image(seed=12),
             _image(seed=13, size=(640, 480))]
    singles = [encoder([d])[0] for d in datas]
    # NOTE: a small max_tower_batch splits the batch's 8 frames over several tower calls
    chunked = MediaEncoder(encoder.config, dict(encoder.tower.state_dict()),
                           num_frames=NUM_FRAMES, max_tower_batch=3, num_threads=1)
    for name, outs in (("batch", encoder(datas)), ("chunked batch", chunked(datas))):
        for i, (got, want) in enumerate(zip(outs, singles, strict=True)):
            assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor), (i, got)
            _assert_close(got, want, f"{name}, item {i}")


def test_frames_of_each_kind(encoder: MediaEncoder) -> None:
    assert [f.shape for f in encoder.frames(_image(size=(40, 30)))] == [(30, 40, 3)]
    assert [f.shape for f in encoder.frames(_clip())] == [(64, 64, 3)] * NUM_FRAMES
    with pytest.raises(MediaError, match="not a supported image"):
        encoder.frames(b"GIF90a...")


@pytest.mark.parametrize("kwargs,words", [
    (dict(num_frames=0), "num_frames=0"),
    (dict(num_frames=33), "max_frames=32"),
    (dict(max_tower_batch=0), "max_tower_batch=0"),
])
def test_arguments_out_of_range_are_refused(model_dir: Path, kwargs: dict[str, int],
                                            words: str) -> None:
    with pytest.raises(ValueError, match=words):
        load_media_encoder(model_dir, **kwargs)  # type: ignore[arg-type]


def test_a_model_without_a_tower_has_no_encoder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mimo_v2"}))
    assert load_media_encoder(tmp_path) is None


def test_the_batched_decode_path_isolates_bad_items(model_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The nvJPEG path's bookkeeping, on CPU: a fake ``decode_images_gpu`` that fails the whole
    batch at its first bad item, as the real one does."""
    calls: list[int] = []

    def fake_decode(datas: list[bytes], device: object, limits: MediaLimits) -> list[torch.Tensor]:
        calls.append(len(datas))
        images = []
        for i, data in enumerate(datas):
            try:
                images.append(torch.from_numpy(decode_image(data, limits)))
            except MediaError as exc:
                raise MediaError(f"image {i}: {exc.reason}") from None
        return images

    monkeypatch.setattr("encoders.encode.decode_images_gpu", fake_decode)
    enc = load_media_encoder(model_dir, num_frames=NUM_FRAMES)
    assert enc is not None
    cpu = enc([_image(seed=40), _clip(), _image(seed=41, fmt="PNG")])
    enc.is_gpu_decode = True
    datas = [_image(seed=40), b"BM-broken", _clip(), _image(seed=41, fmt="PNG"), b"junk"]
    outs = enc(datas)
    assert calls == [3, 1, 1, 1], f"one batch of the 3 images, then each alone: {calls}"
    assert isinstance(outs[1], MediaError) and not outs[1].reason.startswith("image "), outs[1]
    assert isinstance(outs[4], MediaError) and "not a supported" in outs[4].reason, outs[4]
    for got, want, i in ((outs[0], cpu[0], 0), (outs[2], cpu[1], 2), (outs[3], cpu[2], 3)):
        assert isinstance(want, torch.Tensor)
        _assert_close(_assert_embedding(got, want.shape[0], f"item {i}"), want, f"item {i}")


@pytest.mark.gpu
def test_cuda_encoder_matches_cpu(encoder: MediaEncoder, model_dir: Path) -> None:
    gpu = load_media_encoder(model_dir, device="cuda", num_frames=NUM_FRAMES)
    assert gpu is not None and gpu.tower_fingerprint == encoder.tower_fingerprint
    datas = [_image(seed=20), _image(seed=21, fmt="PNG"), _clip(), b"junk"]
    for i, (got, want) in enumerate(zip(gpu(datas), encoder(datas), strict=True)):
        if isinstance(want, MediaError):
            assert isinstance(got, MediaError), (i, got)
            continue
        assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor), (i, got)
        # NOTE: nvJPEG and libjpeg-turbo differ by a few levels on some pixels
        _assert_close(got, want, f"item {i}", atol=0.05)


# ---------------------------------------------------------------------- command line


def _args(**overrides: object) -> argparse.Namespace:
    return argparse.Namespace(**{"model": None, "device": "cpu", "num_frames": NUM_FRAMES,
                                 **overrides})


@pytest.mark.parametrize("model,words", [
    (None, "--model DIR is required"),
    ("missing", "no config.json"),
    ("no-tower", "has no vision tower"),
])
def test_make_encode_fn_refuses_a_model_without_a_tower(tmp_path: Path, model: str | None,
                                                       words: str) -> None:
    (tmp_path / "no-tower").mkdir()
    (tmp_path / "no-tower" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=words):
        make_encode_fn(_args(model=None if model is None else str(tmp_path / model)))


def test_the_command_line_refuses_a_model_without_a_tower(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "config.json").write_text("{}")
    argv = ["--model", str(tmp_path), "--listen", "tcp://127.0.0.1:0"]
    assert cli_main(argv, make_encode_fn, prog="agentgate encoder") == 2
    err = capsys.readouterr().err
    assert "agentgate encoder: error:" in err and "has no vision tower" in err, err


def test_the_command_line_serves_the_model_over_zeromq(encoder: MediaEncoder,
                                                      model_dir: Path) -> None:
    cmd = [sys.executable, "-m", "encoders", "--model", str(model_dir), "--listen",
           "tcp://127.0.0.1:0", "--device", "cpu", "--num-frames", str(NUM_FRAMES)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        endpoint = wait_for_start_line(proc, START_TIMEOUT_S)
        datas = [_image(seed=30), _clip()]
        desc, reply = asyncio.run(asyncio.wait_for(_describe_and_encode(endpoint, datas), 30))
        assert msgspec.structs.replace(desc, request_id="") == encoder.description, desc
        for i, (emb, want) in enumerate(zip(reply.results, encoder(datas), strict=True)):
            assert emb is not None and isinstance(want, torch.Tensor), (i, reply.errors)
            _assert_close(from_embedding(emb), want, f"served item {i}")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, f"rc={proc.returncode}"
    finally:
        proc.kill()
        proc.wait()


async def _describe_and_encode(endpoint: str, datas: list[bytes]) -> tuple[Description, object]:
    client = EncoderClient([endpoint], timeout_s=20)
    try:
        desc = await client.describe()
        items = [EncodeItem(key=EmbeddingKey(content_hash=content_hash(d),
                                             preprocess_id=desc.preprocess_id,
                                             tower_fingerprint=desc.tower_fingerprint),
                            kind=kind, data=d) for d, kind in zip(datas, ("image", "video"))]
        return desc, await client.encode(items)
    finally:
        await client.aclose()


@pytest.mark.parametrize("device,words", [("mps", "want cpu or cuda"), ("tpu", "device .tpu.")])
def test_make_encode_fn_refuses_an_unknown_device(model_dir: Path, device: str,
                                                  words: str) -> None:
    with pytest.raises(ValueError, match=words):
        make_encode_fn(_args(model=str(model_dir), device=device))


def test_make_encode_fn_on_auto_picks_cuda_only_when_there(model_dir: Path) -> None:
    enc = make_encode_fn(_args(model=str(model_dir), device="auto"))
    assert enc.device.type == ("cuda" if torch.cuda.is_available() else "cpu"), enc.device
    assert enc.num_frames == NUM_FRAMES
