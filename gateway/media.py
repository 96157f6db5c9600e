"""Images and video in chat messages, from content parts to the worker's ``MediaSpan``s.

    parts -> media_refs (one ref per image, frame or clip, in prompt order; too many is a 400)
          -> MediaPipeline.start: bytes (data: URI, or an allowed URL), an image's header checked
             (format, pixel bound: no decompression bomb is decoded), keyed by content hash +
             the encoder's preprocessing + tower fingerprint + the tenant's salt; the encoder
             service starts encoding (``with_data=False``: the gateway needs the token count,
             the worker fetches the embedding by key), while the caller renders and tokenizes
          -> Media.expand: each pad token the chat template wrote (``<|image_pad|>``,
             ``<|video_pad|>``) becomes the media's span of hash-derived placeholder ids
          -> Media.encoded: the encode's outcome; an item that failed is a 400 naming its part.

Placeholder ids lie in [MEDIA_ID_BASE, MEDIA_ID_LIMIT), outside every vocabulary, and are derived
from the key without the tenant (page hashes are salted already): the same image in the same place
gives the same page hashes and hits the prefix cache, a different image never does. Every failure
is a ``RequestError`` (400 naming ``messages[i].content[j]``, 503 when no encoder answers).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import msgspec
from prometheus_client.core import CounterMetricFamily, Metric

from encoders.fetch import FetchPolicy, fetch_media
from encoders.media import MediaError, MediaLimits, content_hash, probe_image
from encoders.protocol import Description, EmbeddingKey, EncodeItem, ItemKind
from encoders.service import EncoderClient, EncoderError, EncoderRejected
from engine.protocol import MEDIA_ID_BASE, MEDIA_ID_LIMIT, MediaSpan
from gateway.schemas import ImageUrlPart, Message, RequestError, VideoFramesPart, VideoUrlPart
from gateway.tokenizer.demo import IMAGE_PAD_TOKEN, VIDEO_PAD_TOKEN

PadKind = Literal["image", "video"]
OFF_LOOP_BYTES = 1 << 20  # NOTE: a data: URI longer than this is decoded on a thread
_IDS_PER_SPAN = 4  # distinct placeholder ids cycled through one span


class MediaRef(NamedTuple):
    """One medium to encode: where it was sent (``param``), what it is, and its URL. ``group``
    numbers the content parts: a video sent as frames is one part (one pad token), many refs."""

    param: str
    kind: ItemKind
    url: str
    group: int
    pad: PadKind


def media_refs(messages: Sequence[Message | dict[str, Any]], limits: MediaLimits,
               count_from: int = 0) -> list[MediaRef]:
    """The media of ``messages`` (Structs, or the dicts a session stores) in the order the chat
    template renders them.

    Raises:
        RequestError: more than ``limits.max_images_per_request`` images and frames in
            ``messages[count_from:]`` (a session's history was checked when it was sent), or a
            video of more than ``limits.max_frames`` frames (or none).
    """
    refs: list[MediaRef] = []
    group = counted = 0
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else \
            getattr(message, "content", None)
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            param = f"messages[{i}].content[{j}]"
            if isinstance(part, dict):
                part = _PART_DECODER.get(part.get("type"), _ignore)(part)
            if isinstance(part, ImageUrlPart):
                new = [MediaRef(param, "image", part.image_url.url, group, "image")]
            elif isinstance(part, VideoUrlPart):
                new = [MediaRef(param, "video", part.video_url.url, group, "video")]
            elif isinstance(part, VideoFramesPart):
                if not 0 < len(part.video) <= limits.max_frames:
                    raise RequestError(f"a video sent as frames needs 1 to {limits.max_frames} "
                                       f"frames, not {len(part.video)}", param=param)
                new = [MediaRef(f"{param}.video[{k}]", "frame", url, group, "video")
                       for k, url in enumerate(part.video)]
            else:
                continue
            refs += new
            group += 1
            counted += len(new) if i >= count_from else 0
            if counted > limits.max_images_per_request:
                raise RequestError(
                    f"more than {limits.max_images_per_request} images and video frames in one "
                    "request; send fewer", param=param, code="too_many_images")
    return refs


def _ignore(part: dict[str, Any]) -> None:
    return None


_PART_DECODER = {tag: functools.partial(msgspec.convert, type=cls) for tag, cls in (
    ("image_url", ImageUrlPart), ("video_url", VideoUrlPart), ("video", VideoFramesPart))}


def placeholder_ids(key: EmbeddingKey, length: int) -> list[int]:
    """The ``length`` prompt ids that stand for ``key``'s embedding (see the module docstring)."""
    digest = hashlib.sha256(
        f"{key.content_hash}:{key.preprocess_id}:{key.tower_fingerprint}".encode()).digest()
    span = MEDIA_ID_LIMIT - MEDIA_ID_BASE
    ids = [MEDIA_ID_BASE + int.from_bytes(digest[4 * n:4 * n + 4], "little") % span
           for n in range(_IDS_PER_SPAN)]
    return [ids[n % _IDS_PER_SPAN] for n in range(length)]


@dataclass(slots=True)
class MediaStats:
    """Counters of one gateway's media (``MediaPipeline.collect`` exports them)."""

    items: dict[str, int] = field(default_factory=dict)  # by kind: image, frame, video
    bytes: int = 0
    tokens: int = 0  # placeholder tokens of the requests that got their media encoded
    rejected: dict[str, int] = field(default_factory=dict)  # by code: invalid_media, ...

    def reject(self, err: RequestError) -> RequestError:
        code = err.code or "invalid_value"
        self.rejected[code] = self.rejected.get(code, 0) + 1
        return err


@dataclass(slots=True)
class Media:
    """The media of one request, fetched and keyed, their encode running (``MediaPipeline``)."""

    refs: list[MediaRef]
    keys: list[EmbeddingKey]
    lengths: list[int]
    pad_ids: dict[PadKind, int | None]
    task: asyncio.Task[Any] | None = None
    stats: MediaStats = field(default_factory=MediaStats)
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_tokens = sum(self.lengths)

    def expand(self, token_ids: list[int]) -> tuple[list[int], list[MediaSpan]]:
        """``token_ids`` with each pad token widened into its media's placeholder span.

        Raises:
            RequestError: the chat template wrote a different number of pads than there are
                media parts (a template that drops images).
        """
        pads = {pid: kind for kind, pid in self.pad_ids.items() if pid is not None}
        groups: list[list[int]] = []
        for n, ref in enumerate(self.refs):
            if ref.group == len(groups):
                groups.append([])
            groups[ref.group].append(n)
        out: list[int] = []
        spans: list[MediaSpan] = []
        taken = 0
        for token_id in token_ids:
            kind = pads.get(token_id)
            if kind is None:
                out.append(token_id)
                continue
            if taken == len(groups) or self.refs[groups[taken][0]].pad != kind:
                break
            for n in groups[taken]:
                spans.append(MediaSpan(offset=len(out), length=self.lengths[n], key=self.keys[n]))
                out += placeholder_ids(self.keys[n], self.lengths[n])
            taken += 1
        else:
            if taken == len(groups):
                return out, spans
        raise RequestError(f"the chat template placed {sum(t in pads for t in token_ids)} "
                           f"media markers for {len(groups)} image and video parts; this "
                           "model's template cannot place them", param="messages")

    async def encoded(self) -> None:
        """Wait for the encode; an item that failed is a 400 naming its part.

        Raises:
            RequestError: a medium the encoder could not decode (400), or no encoder answered
                (503).
        """
        if self.task is None:
            return
        try:
            reply = await self.task
        except EncoderRejected as exc:
            raise self.stats.reject(_unavailable(f"the encoder refused the request: {exc}")
                                    ) from None
        except EncoderError as exc:
            raise self.stats.reject(_unavailable(str(exc))) from None
        for error in reply.errors:
            ref = self.refs[error.index]
            raise self.stats.reject(RequestError(
                f"the {_noun(ref)} could not be used: {error.reason}", param=ref.param,
                code="invalid_media"))
        self.stats.tokens += self.num_tokens

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()


class MediaPipeline:
    """Fetch, check, key and encode the media of requests (one per gateway app).

    Args:
        client: the encoder service's replicas; None: this gateway takes no media (a 400).
        pad_ids: the tokenizer's ids of ``<|image_pad|>`` and ``<|video_pad|>`` (None: absent).
    """

    def __init__(self, client: EncoderClient | None, pad_ids: dict[PadKind, int | None],
                 limits: MediaLimits | None = None, policy: FetchPolicy | None = None,
                 encode_timeout_s: float = 60.0) -> None:
        self.client, self.pad_ids = client, pad_ids
        self.limits = limits or MediaLimits()
        self.policy = policy or FetchPolicy()
        self.encode_timeout_s = encode_timeout_s
        self.stats = MediaStats()
        self._description: Description | None = None

    @classmethod
    def for_tokenizer(cls, client: EncoderClient | None, tokenizer: Any,
                      **kwargs: Any) -> MediaPipeline:
        pads: dict[PadKind, int | None] = {"image": tokenizer.token_to_id(IMAGE_PAD_TOKEN),
                                           "video": tokenizer.token_to_id(VIDEO_PAD_TOKEN)}
        return cls(client, pads, **kwargs)

    async def start(self, messages: Sequence[Message | dict[str, Any]], cache_salt: str | None,
                    count_from: int = 0) -> Media | None:
        """The request's media fetched, checked and keyed, their encode started; None when the
        messages hold no media. ``count_from``: the first message the per-request bound counts
        (a session turn's new messages).

        Raises:
            RequestError: see the module docstring.
        """
        try:
            return await self._start(messages, cache_salt, count_from)
        except RequestError as err:
            raise self.stats.reject(err) from None

    async def _start(self, messages: Sequence[Message | dict[str, Any]], cache_salt: str | None,
                     count_from: int) -> Media | None:
        refs = media_refs(messages, self.limits, count_from)
        if not refs:
            return None
        if self.client is None:
            raise RequestError("this model takes no images or video (the gateway has no "
                               "encoder: serve a model with a vision tower, or --encoder)",
                               param=refs[0].param, code="unsupported_value")
        for ref in refs:
            if self.pad_ids[ref.pad] is None:
                raise RequestError(f"this model's tokenizer has no {ref.pad} marker token",
                                   param=ref.param, code="unsupported_value")
        desc = await self.description()
        datas = await asyncio.gather(*(self._bytes(ref) for ref in refs))
        keys = [EmbeddingKey(cache_salt=cache_salt or "", content_hash=content_hash(data),
                             preprocess_id=desc.preprocess_id,
                             tower_fingerprint=desc.tower_fingerprint) for data in datas]
        items = [EncodeItem(key=key, kind=ref.kind, data=data)
                 for key, ref, data in zip(keys, refs, datas, strict=True)]
        media = Media(refs, keys, [desc.tokens_for(ref.kind) for ref in refs], self.pad_ids,
                      stats=self.stats)
        for ref, data in zip(refs, datas, strict=True):
            self.stats.items[ref.kind] = self.stats.items.get(ref.kind, 0) + 1
            self.stats.bytes += len(data)
        assert self.client is not None
        media.task = asyncio.ensure_future(
            self.client.encode(items, with_data=False, timeout_s=self.encode_timeout_s))
        return media

    async def description(self) -> Description:
        """What the encoder encodes with (asked once, then kept).

        Raises:
            RequestError: 503 when no encoder answers.
        """
        if self._description is None:
            assert self.client is not None
            try:
                self._description = await self.client.describe()
            except EncoderError as exc:
                raise _unavailable(str(exc)) from None
        return self._description

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    def collect(self) -> Iterator[Metric]:
        """``agentgate_media_*`` for a Prometheus registry (the metrics plugin registers it)."""
        stats = self.stats
        items = CounterMetricFamily("agentgate_media_items", "Images, video frames and clips "
                                    "fetched, checked and sent to the encoder", labels=["kind"])
        for kind in ("image", "frame", "video"):
            items.add_metric([kind], stats.items.get(kind, 0))
        yield items
        yield CounterMetricFamily("agentgate_media_bytes", "Bytes of media fetched",
                                  value=stats.bytes)
        yield CounterMetricFamily("agentgate_media_tokens", "Placeholder tokens of media "
                                  "encoded for requests", value=stats.tokens)
        rejected = CounterMetricFamily("agentgate_media_rejected", "Requests refused for their "
                                       "media, by error code (400s; encoder_unavailable: 503)",
                                       labels=["code"])
        for code, n in sorted(stats.rejected.items()):
            rejected.add_metric([code], n)
        yield rejected

    async def _bytes(self, ref: MediaRef) -> bytes:
        """The medium's bytes; an image's header is checked (format, size, pixels)."""
        limits = self.limits
        max_bytes = limits.max_video_bytes if ref.kind == "video" else limits.max_image_bytes
        policy = FetchPolicy(self.policy.allow_urls, self.policy.allowlist,
                             min(max_bytes, self.policy.max_bytes), self.policy.timeout_s,
                             self.policy.allow_private)
        try:
            if len(ref.url) > OFF_LOOP_BYTES:
                data = await asyncio.to_thread(_run_fetch, ref.url, policy)
            else:
                data = await fetch_media(ref.url, policy)
            if ref.kind != "video":
                probe_image(data, limits)
        except MediaError as exc:
            raise RequestError(f"the {_noun(ref)} could not be used: {exc.reason}",
                               param=ref.param, code="invalid_media") from None
        return data


def _run_fetch(url: str, policy: FetchPolicy) -> bytes:
    """``fetch_media`` of a data: URI on a thread (its base64 decoding is CPU work)."""
    return asyncio.run(fetch_media(url, policy))


def _noun(ref: MediaRef) -> str:
    return {"image": "image", "frame": "video frame", "video": "video"}[ref.kind]


def _unavailable(message: str) -> RequestError:
    return RequestError(f"the encoder service is unavailable: {message}; retry later",
                        code="encoder_unavailable", status=503)
