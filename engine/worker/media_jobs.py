"""Media embeddings fetched off the worker's step loop (issue 13): a request whose prompt has
images waits, unscheduled, while a thread looks up each image's embedding by its key.

    submit(request, spans) ─► pool thread: EmbeddingSource.lookup(keys) ─► future
    poll(now) ─► Fetched(request, media) | FetchFailed(request, code, message)

Lookup order (``EmbeddingSource``): the process LRU, then the shared Redis (one MGET for what the
LRU missed; both are one ``encoders.embed_cache.EmbeddingCache``), then the encoder services'
caches (``EncoderClient.lookup``: never an encode, the gateway encodes before it dispatches).
What only an encoder service had is put into the cache, so the same image next turn is a local
hit. Each embedding must be ``[length, hidden_size]``; it is cast to the model's dtype and moved
to its device on the fetch thread.

NOTE (budget): as for grammars, a lookup cannot be interrupted: once a job is older than
``timeout_s`` its request fails and the thread's result is dropped when it ends. Each call also
has its own timeout (Redis: ``EmbeddingCache.timeout_s``; the encoder client: ``timeout_s``), so
a thread is never held much longer than that.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from encoders.embed_cache import EmbeddingCache
from encoders.protocol import EmbeddingKey
from encoders.service import EncoderClient, EncoderError
from engine.protocol import MediaSpan
from engine.sequence import Media

logger = logging.getLogger(__name__)


class Fetched(NamedTuple):
    """A request's embeddings, one ``Media`` per span, on the model's device and dtype."""

    request_id: str
    media: tuple[Media, ...]


class FetchFailed(NamedTuple):
    """A request's embeddings could not be had: a key found nowhere, a shape that does not fit,
    the fetch past its time budget or an encoder failure (``invalid_request``), a bug
    (``internal``)."""

    request_id: str
    code: Literal["invalid_request", "internal"]
    message: str


class MediaError(Exception):
    """Why one request's media could not be fetched (its message goes to the client)."""


class EmbeddingSource:
    """Embeddings by key: ``cache`` (process LRU, then Redis), then the encoder services.

    Thread-safe (both parts are). ``lookup`` raises ``EncoderError`` when an encoder call fails.
    """

    def __init__(self, cache: EmbeddingCache, encoder: EncoderClient | None = None) -> None:
        self.cache = cache
        self.encoder = encoder

    def lookup(self, keys: Sequence[EmbeddingKey]) -> list[torch.Tensor | None]:
        found = self.cache.get_many(keys)
        todo = [i for i, t in enumerate(found) if t is None]
        if not todo or self.encoder is None:
            return found
        got = self.encoder.lookup([keys[i] for i in todo])
        for i, tensor in zip(todo, got):
            found[i] = tensor
        # NOTE: a tensor that is not cacheable (e.g. > 8 dims) is refused by the shape check
        with contextlib.suppress(ValueError):
            self.cache.put_many([(keys[i], t) for i, t in zip(todo, got) if t is not None])
        return found

    def close(self) -> None:
        self.cache.close()
        if self.encoder is not None:
            self.encoder.close()


@dataclass(eq=False, slots=True)
class _Job:
    future: Future[tuple[Media, ...]]
    submitted_s: float


class MediaJobs:
    """Fetches requests' media embeddings on a pool of daemon threads.

    Args:
        source: where embeddings are looked up.
        hidden_size: the model's; each embedding must be [span length, hidden_size].
        dtype, device: what embeddings are cast to and moved to (the model's).
        num_threads: fetches running at once (more wait in the pool's queue).
        timeout_s: how long a request may wait for its embeddings (queueing included).
    """

    def __init__(self, source: EmbeddingSource, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str, num_threads: int = 2,
                 timeout_s: float = 5.0) -> None:
        assert num_threads >= 1, f"num_threads={num_threads}: must be >= 1"
        assert timeout_s > 0, f"timeout_s={timeout_s}: must be > 0"
        self.source = source
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="media")
        self._jobs: dict[str, _Job] = {}

    def submit(self, request_id: str, spans: Sequence[MediaSpan]) -> None:
        """Fetch the embeddings of ``spans`` for ``request_id`` (a later ``poll`` reports it)."""
        future = self._pool.submit(self._fetch, list(spans))
        self._jobs[request_id] = _Job(future, time.monotonic())

    def cancel(self, request_id: str) -> None:
        """Forget a request (aborted); a fetch already running ends on its own."""
        job = self._jobs.pop(request_id, None)
        if job is not None:
            job.future.cancel()

    def poll(self, now_s: float | None = None) -> list[Fetched | FetchFailed]:
        """Finished fetches and requests past their budget, each request reported once."""
        now_s = time.monotonic() if now_s is None else now_s
        out: list[Fetched | FetchFailed] = []
        for request_id, job in list(self._jobs.items()):
            if job.future.done():
                del self._jobs[request_id]
                out.append(_result(request_id, job.future))
            elif now_s - job.submitted_s > self.timeout_s:
                self.cancel(request_id)
                out.append(FetchFailed(request_id, "invalid_request", (
                    f"media: the embeddings did not arrive within {self.timeout_s:g} s (the "
                    "worker's --embed-timeout-s); retry the request")))
        return out

    @property
    def num_waiting(self) -> int:
        """Requests whose embeddings are being fetched."""
        return len(self._jobs)

    def close(self) -> None:
        """Start nothing more; wait for running fetches (each bounded by its call timeouts),
        then close the source."""
        self._jobs.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.source.close()

    def _fetch(self, spans: list[MediaSpan]) -> tuple[Media, ...]:
        """On a pool thread: every span's embedding, checked and placed."""
        keys = list(dict.fromkeys(span.key for span in spans))
        try:
            found = dict(zip(keys, self.source.lookup(keys)))
        except EncoderError as e:
            raise MediaError(f"media: the encoder service failed: {e}") from None
        out = []
        for i, span in enumerate(spans):
            tensor = found[span.key]
            if tensor is None:
                raise MediaError(
                    f"media[{i}]: no embedding for key {_describe(span.key)} in the embedding "
                    "cache or the encoder service (evicted? the gateway encodes before "
                    "dispatch; retry the request)")
            if tuple(tensor.shape) != (span.length, self.hidden_size):
                raise MediaError(
                    f"media[{i}]: the embedding for key {_describe(span.key)} has shape "
                    f"{list(tensor.shape)}; want [length, hidden_size] = "
                    f"[{span.length}, {self.hidden_size}]")
            out.append(Media(span.offset, span.length, tensor.to(self.device, self.dtype)))
        return tuple(out)


def _result(request_id: str, future: Future[tuple[Media, ...]]) -> Fetched | FetchFailed:
    error = future.exception()
    if error is None:
        return Fetched(request_id, future.result())
    if isinstance(error, MediaError):
        return FetchFailed(request_id, "invalid_request", str(error))
    logger.error("media fetch of request %r failed", request_id, exc_info=error)
    return FetchFailed(request_id, "internal",
                       f"{type(error).__name__} while fetching the media embeddings")


def _describe(key: EmbeddingKey) -> str:
    """A key as an error names it (never the tenant's salt)."""
    return f"{key.content_hash[:16]}.. ({key.preprocess_id}, {key.tower_fingerprint})"
