"""Layer-wise KV loading (issue 12): host pages reach the device pool one model layer at a time
while the forward computes the layers before, instead of all of them before the forward.

    time       ------------------------------------------------------------------->
    copier     copy layer 0 | copy layer 1 | copy layer 2 | ...
    forward                 attend 0 | mlp 0 | attend 1 | mlp 1 | attend 2 | ...
                            ^ waits for layer 0's copies, attend 1 for layer 1's, ...

A page holds every layer of its kind ([layers, page_size, kv_heads, head_dim + v_head_dim]);
model layer i is index j of kind k (``KVLayout.layer_index``), so layer i's copies are
``dst[j] <- src[j]`` for every page of kind k. Layers go in model order, the forward's order.

    device   copier                                   wait_layer(i)               wait_all()
    CPU      a thread (copy_ releases the GIL)        blocks until layer i done   joins it
    CUDA     every copy queued on a side stream at    the compute stream waits    syncs the
             start(), an event recorded per layer     on layer i's event (no      side stream
                                                      host sync)

NOTE: each copy is one layer of one page (page_size * kv_heads * dims elements): on CPU that stays
below torch's intra-op grain size, so the copier thread never opens an OpenMP team of its own and
the forward keeps its threads. On CUDA the host pages must be pinned (``HostPagePool`` pins them
when the device is CUDA) or queuing them blocks ``start`` until they are all done.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType
from typing import NamedTuple

import torch

from engine.kv.layout import KVLayout, PageKind
from engine.kv.pool import KVPool


class PageCopy(NamedTuple):
    """One host page to load into device page ``dst_page`` of ``kind`` of the runner's pool."""

    kind: PageKind
    src: torch.Tensor  # shaped like KVPool.page(kind, dst_page): [layers_of_kind, page_size, ...]
    dst_page: int


def load_pages(pool: KVPool, copies: Sequence[PageCopy]) -> None:
    """Load-then-compute: copy every page whole, on the current stream (in order before the
    forward that follows on it)."""
    for c in copies:
        pool.page(c.kind, c.dst_page).copy_(c.src, non_blocking=c.src.is_pinned())


class LayerwiseLoad:
    """Copies ``copies`` into ``pool`` layer by layer, in model layer order.

    Use as ``with LayerwiseLoad(...) as load:`` (``start`` on entry; on exit every copy has
    finished, and a copier error is raised unless the body is already raising), or call
    ``start``, ``wait_layer`` and ``wait_all`` directly.

    Args:
        pool: the device pool the copies write (``dst_page`` ids of each kind).
        layout: the pool's layout; it maps a model layer to its kind and index.
        copies: the pages to load; no two may share a destination page.
        device: where ``pool`` lives: CUDA copies on a side stream, anything else on a thread.
    """

    def __init__(
        self,
        pool: KVPool,
        layout: KVLayout,
        copies: Sequence[PageCopy],
        device: torch.device | str,
    ) -> None:
        self.pool, self.layout, self.device = pool, layout, torch.device(device)
        self._pages = {kind: _page_slots(pool, layout, copies, kind) for kind in PageKind}
        self._layer_ids = sorted(layout.full_layer_ids + layout.swa_layer_ids)
        self._order = {layer_id: n for n, layer_id in enumerate(self._layer_ids)}
        self._is_cuda = self.device.type == "cuda"
        self._started = self._finished = False
        # CPU: layers [0, _num_done) of the model order are copied; _error ends the copier early
        self._cond = threading.Condition()
        self._num_done = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        # CUDA
        self._stream: torch.cuda.Stream | None = None
        self._events: dict[int, torch.cuda.Event] = {}

    def __enter__(self) -> LayerwiseLoad:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._finish()
        if exc_type is None:
            self._raise_error()

    def copy_layer(self, layer_id: int) -> None:
        """Copy model layer ``layer_id`` of every page, on the calling thread (and stream)."""
        kind, index = self.layout.layer_index(layer_id)
        view = self.pool.view(kind)
        for src, chunk, slot in self._pages[kind]:
            view[chunk, slot, index].copy_(src[index], non_blocking=self._is_cuda)

    def start(self) -> None:
        """Begin copying; returns at once (on CUDA once every copy is queued)."""
        assert not self._started, "a LayerwiseLoad starts once"
        self._started = True
        if self._is_cuda:
            self._start_stream()
            return
        self._thread = threading.Thread(target=self._copy_all, name="kv-layerwise-load")
        self._thread.start()

    def wait_layer(self, layer_id: int) -> None:
        """Return once layer ``layer_id``'s pages may be read and written (on CUDA: once the
        current stream waits for them).

        Raises:
            BaseException: the copier's error, if it failed at or before this layer.
        """
        assert self._started, "wait_layer before start"
        if not self._pages[self.layout.layer_index(layer_id)[0]]:
            return  # NOTE: no page of this layer's kind is loaded
        if self._is_cuda:
            torch.cuda.current_stream(self.device).wait_event(self._events[layer_id])
            return
        n = self._order[layer_id]
        if self._num_done > n:  # NOTE: the common case once the copier is ahead: no lock
            return
        with self._cond:
            self._cond.wait_for(lambda: self._num_done > n or self._error is not None)
        if self._num_done <= n:
            self._raise_error()

    def wait_all(self) -> None:
        """Return once every copy has finished (the host pages may then be reused).

        Raises:
            BaseException: the copier's error, if it failed.
        """
        self._finish()
        self._raise_error()

    # ---------------------------------------------------------------- internals

    def _copy_all(self) -> None:
        """The CPU copier thread: every layer in model order, reporting progress."""
        try:
            # NOTE: inference mode so that a pool created under it accepts in-place copies
            with torch.inference_mode():
                for n, layer_id in enumerate(self._layer_ids):
                    self.copy_layer(layer_id)
                    with self._cond:
                        self._num_done = n + 1
                        self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _start_stream(self) -> None:
        compute = torch.cuda.current_stream(self.device)
        self._stream = torch.cuda.Stream(self.device)
        # NOTE: the destination pages may still be read by work queued before this step
        self._stream.wait_stream(compute)
        try:
            with torch.cuda.stream(self._stream):
                for layer_id in self._layer_ids:
                    self.copy_layer(layer_id)
                    self._events[layer_id] = event = torch.cuda.Event()
                    event.record(self._stream)
        except BaseException:
            self._stream.synchronize()  # NOTE: the copies already queued still finish
            raise

    def _finish(self) -> None:
        if self._finished or not self._started:
            return
        self._finished = True
        if self._thread is not None:
            self._thread.join()
        if self._stream is not None:
            self._stream.synchronize()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error


def _page_slots(
    pool: KVPool, layout: KVLayout, copies: Sequence[PageCopy], kind: PageKind
) -> list[tuple[torch.Tensor, int, int]]:
    """(src, chunk, slot) of each copy of ``kind``, checked against the pool's page shape."""
    mine = [c for c in copies if c.kind == kind]
    if not mine:
        return []
    shape = pool.view(kind).shape[2:]
    slots = layout.slots_per_chunk(kind)
    for c in mine:
        assert c.src.shape == shape, f"{kind.name} page {c.dst_page}: src {c.src.shape}, {shape}"
        assert 0 <= c.dst_page < pool.num_chunks * slots, f"no {kind.name} page {c.dst_page}"
    dst = [c.dst_page for c in mine]
    assert len(set(dst)) == len(dst), f"{kind.name} pages loaded twice: {sorted(dst)}"
    return [(c.src, *divmod(c.dst_page, slots)) for c in mine]
