"""Layer-wise KV loading (issue 12): a forward whose prefix pages are copied in from host memory,
layer by layer or all first, gives the same hidden states and pool as one whose pages never left;
attention never touches a layer before its copies finished; no copier outlives ``run``.

Each test prefills a prompt into the runner's pool, keeps that pool, copies the prefix pages out to
host tensors and zeroes them on the device, then runs the next chunk with ``loads=`` those copies.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from engine.kv import KVLayout, KVPool, PageAllocator, PageKind, SeqPages
from engine.kv.layerwise import LayerwiseLoad, PageCopy
from engine.kv.layout import num_pages
from engine.model_runner import ModelRunner
from engine.models.loader import load_model
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduled
from engine.sequence import Sequence

FULL, SWA = PageKind.FULL, PageKind.SWA
LAYERS, WINDOW, PAGE = "FSSFS", 8, 4
PREFIX_LEN, CHUNK = 24, 8  # the loaded prefix, then the step that runs over it
THREAD_NAME = "kv-layerwise-load"


class CopyFailed(RuntimeError):
    pass


class ForwardFailed(RuntimeError):
    pass


@dataclass
class _Setup:
    runner: ModelRunner
    seq: Sequence
    pages: SeqPages
    prefilled: torch.Tensor  # the pool's arena right after the prefix prefill
    loads: list[PageCopy]  # the prefix pages, as host copies of ``prefilled``


@pytest.fixture
def setup(make_checkpoint) -> _Setup:
    return _make_setup(make_checkpoint, "cpu")


@pytest.fixture
def no_copier_left() -> Iterator[None]:
    yield
    alive = [t.name for t in threading.enumerate() if t.name == THREAD_NAME]
    assert not alive, f"copier threads still alive after the test: {alive}"


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "load-then-compute"])
def test_loaded_forward_matches_never_evicted(
    setup: _Setup, layerwise: bool, no_copier_left
) -> None:
    want_hidden, want_arena = _run_chunk(setup, loads=False, layerwise=False)
    got_hidden, got_arena = _run_chunk(setup, loads=True, layerwise=layerwise)
    _assert_equal(got_hidden, want_hidden, "hidden states")
    _assert_equal(got_arena, want_arena, "pool after the step")


def test_zeroed_pages_without_loads_differ(setup: _Setup) -> None:
    """The check above is not vacuous: zeroed prefix pages change the result."""
    want_hidden, _ = _run_chunk(setup, loads=False, layerwise=False)
    _restore(setup, zero_loaded=True)
    got_hidden = _forward(setup, [], layerwise=True)
    assert not torch.equal(got_hidden, want_hidden), "zeroed prefix pages left hidden unchanged"


def test_attend_waits_for_its_layer_copies(
    setup: _Setup, monkeypatch: pytest.MonkeyPatch, no_copier_left
) -> None:
    log = _log_pool_access(monkeypatch)
    _slow_copier(monkeypatch, log, delay_s=0.02, overlap=True)
    _restore(setup, zero_loaded=True)
    _forward(setup, setup.loads, layerwise=True)
    copied = {layer: i for i, (what, layer) in enumerate(log) if what == "copied"}
    assert sorted(copied) == list(range(len(LAYERS))), f"layers copied: {sorted(copied)}"
    early = [(i, e) for i, e in enumerate(log) if e[0] != "copied" and i < copied[e[1]]]
    assert not early, f"pool accesses before their layer's copies finished: {early}\nlog: {log}"
    first_access = next(i for i, e in enumerate(log) if e[0] != "copied")
    assert first_access < copied[1], f"no overlap: the forward waited for all: {log}"


def test_copier_error_propagates(
    setup: _Setup, monkeypatch: pytest.MonkeyPatch, no_copier_left
) -> None:
    def fail_at_layer_2(self: LayerwiseLoad, layer_id: int) -> None:
        if layer_id == 2:
            raise CopyFailed(f"layer {layer_id}")
        original(self, layer_id)

    original = LayerwiseLoad.copy_layer
    monkeypatch.setattr(LayerwiseLoad, "copy_layer", fail_at_layer_2)
    _restore(setup, zero_loaded=True)
    with pytest.raises(CopyFailed, match="layer 2"):
        _forward(setup, setup.loads, layerwise=True)


def test_forward_error_still_finishes_every_copy(
    setup: _Setup, monkeypatch: pytest.MonkeyPatch, no_copier_left
) -> None:
    def fail(*args: object) -> torch.Tensor:
        raise ForwardFailed("mlp of layer 1")

    _slow_copier(monkeypatch, [], delay_s=0.02)  # still copying when the forward fails
    monkeypatch.setattr(setup.runner.model.model.layers[1].mlp, "forward", fail)
    _restore(setup, zero_loaded=True)
    with pytest.raises(ForwardFailed):
        _forward(setup, setup.loads, layerwise=True)
    pool = setup.runner.pool
    unfinished = [(c.kind.name, c.dst_page) for c in setup.loads
                  if not torch.equal(pool.page(c.kind, c.dst_page), c.src)]
    assert not unfinished, f"pages not fully loaded when run raised: {unfinished}"


def test_no_loads_starts_no_copier(setup: _Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a LayerwiseLoad was built for a step without loads")

    monkeypatch.setattr(LayerwiseLoad, "__init__", refuse)
    _restore(setup, zero_loaded=False)
    _forward(setup, [], layerwise=True)


@pytest.mark.parametrize("kinds", [(FULL,), (SWA,), (FULL, SWA)], ids=["full", "swa", "both"])
def test_load_without_model(kinds: tuple[PageKind, ...], no_copier_left) -> None:
    layout = _make_layout(full_layer_ids=(0, 3), swa_layer_ids=(1, 2, 4))
    pool, alloc = KVPool(layout, 6, torch.float32), PageAllocator(layout, 6 * layout.chunk_bytes)
    gen = torch.Generator().manual_seed(0)
    copies = [PageCopy(k, torch.randn(pool.page(k, 0).shape, generator=gen), page)
              for k in kinds for page in alloc.allocate(k, 3)]
    load = LayerwiseLoad(pool, layout, copies, "cpu")
    load.start()
    for layer_id in range(5):
        load.wait_layer(layer_id)
        kind, index = layout.layer_index(layer_id)
        for c in (c for c in copies if c.kind == kind):
            _assert_equal(pool.page(kind, c.dst_page)[index], c.src[index], f"layer {layer_id}")
    load.wait_all()


def test_wait_layer_raises_copier_error(monkeypatch: pytest.MonkeyPatch, no_copier_left) -> None:
    layout = _make_layout(full_layer_ids=(0,), swa_layer_ids=(1,))
    pool = KVPool(layout, 2, torch.float32)
    copies = [PageCopy(SWA, torch.ones(pool.page(SWA, 0).shape), 1)]
    monkeypatch.setattr(LayerwiseLoad, "copy_layer", _raise_copy_failed)
    load = LayerwiseLoad(pool, layout, copies, "cpu")
    load.start()
    load.wait_layer(0)  # a full layer: no full page is loaded, nothing to wait for
    with pytest.raises(CopyFailed):
        load.wait_layer(1)
    with pytest.raises(CopyFailed):
        load.wait_all()


@pytest.mark.gpu
@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "load-then-compute"])
def test_cuda_loaded_forward_matches_never_evicted(make_checkpoint, layerwise: bool) -> None:
    setup = _make_setup(make_checkpoint, "cuda")
    want_hidden, want_arena = _run_chunk(setup, loads=False, layerwise=False)
    got_hidden, got_arena = _run_chunk(setup, loads=True, layerwise=layerwise)
    _assert_equal(got_hidden, want_hidden, "hidden states (cuda)")
    _assert_equal(got_arena, want_arena, "pool after the step (cuda)")


# ---------------------------------------------------------------- builders and helpers


def _make_setup(make_checkpoint, device: str) -> _Setup:
    model_dir = make_checkpoint(seed=3, layers=LAYERS, sliding_window=WINDOW)
    model = load_model(model_dir, dtype="float32", device=device)
    layout = KVLayout.from_model(model.config, PAGE, 4)
    num_chunks = 2 * num_pages(PREFIX_LEN + CHUNK, PAGE) + 2
    runner = ModelRunner(model, layout, num_chunks)
    alloc = PageAllocator(layout, num_chunks * layout.chunk_bytes)
    n = num_pages(PREFIX_LEN + CHUNK, PAGE)
    full, swa = alloc.allocate(FULL, n + 1)[1:], alloc.allocate(SWA, n + 1)[1:]  # not from 0
    prompt = tuple(int(t) for t in torch.randint(1, 300, (PREFIX_LEN + CHUNK,),
                                                 generator=torch.Generator().manual_seed(1)))
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    seq = Sequence(request_id="r", prompt_ids=prompt, params=params)
    runner.run([Scheduled(seq, PREFIX_LEN)], [SeqPages(full, swa, 0, PREFIX_LEN)])
    seq.num_computed = PREFIX_LEN
    prefix = num_pages(PREFIX_LEN, PAGE)
    pin = device == "cuda"
    loads = [PageCopy(k, _host_copy(runner.pool.page(k, p), pin), p)
             for k, ids in ((FULL, full), (SWA, swa)) for p in ids[:prefix]]
    pages = SeqPages(full, list(swa), PREFIX_LEN, CHUNK)
    return _Setup(runner, seq, pages, runner.pool.arena.clone(), loads)


def _make_layout(full_layer_ids: tuple[int, ...], swa_layer_ids: tuple[int, ...]) -> KVLayout:
    return KVLayout(page_size=PAGE, dtype_bytes=4, full_layer_ids=full_layer_ids,
                    swa_layer_ids=swa_layer_ids, full_head_dims=(1, 8, 4),
                    swa_head_dims=(2, 4, 4), window=WINDOW)


def _host_copy(page: torch.Tensor, pin: bool) -> torch.Tensor:
    return page.to("cpu").pin_memory() if pin else page.clone()


def _run_chunk(setup: _Setup, loads: bool, layerwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states, arena) after the chunk step, its prefix loaded or never evicted."""
    _restore(setup, zero_loaded=loads)
    hidden = _forward(setup, setup.loads if loads else [], layerwise)
    return hidden, setup.runner.pool.arena.clone()


def _forward(setup: _Setup, loads: list[PageCopy], layerwise: bool) -> torch.Tensor:
    """Runs the chunk step; returns the model's hidden states (spied on)."""
    model, seen = setup.runner.model, []
    forward = model.forward

    def spy(*args: object) -> torch.Tensor:
        seen.append(forward(*args))
        return seen[-1]

    model.forward = spy  # type: ignore[method-assign]
    try:
        setup.runner.run([Scheduled(setup.seq, CHUNK)], [setup.pages], loads, layerwise)
    finally:
        del model.forward
    return seen[0]


def _restore(setup: _Setup, zero_loaded: bool) -> None:
    pool = setup.runner.pool
    pool.arena.copy_(setup.prefilled)
    if zero_loaded:
        for c in setup.loads:
            pool.page(c.kind, c.dst_page).zero_()


def _slow_copier(
    monkeypatch: pytest.MonkeyPatch, log: list, delay_s: float, overlap: bool = False
) -> None:
    """Each layer's copy sleeps ``delay_s`` first; with ``overlap``, layers past 0 also wait
    until the forward has touched the pool (a load that waits for every copy then hangs and
    fails here, instead of passing by timing luck)."""
    original = LayerwiseLoad.copy_layer

    def slow(self: LayerwiseLoad, layer_id: int) -> None:
        time.sleep(delay_s)
        if overlap and layer_id > 0:
            _wait_until(lambda: any(what != "copied" for what, _ in log), "a pool access")
        original(self, layer_id)
        log.append(("copied", layer_id))

    monkeypatch.setattr(LayerwiseLoad, "copy_layer", slow)


def _log_pool_access(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every ``write_at``/``read_slots`` of the pool (attention's only KV accesses), by layer."""
    log: list[tuple[str, int]] = []
    for name in ("write_at", "read_slots"):
        monkeypatch.setattr(KVPool, name, _logged(getattr(KVPool, name), name, log))
    return log


def _logged(method: Callable, name: str, log: list) -> Callable:
    def wrapper(self: KVPool, layer_id: int, *args: object) -> object:
        log.append((name, layer_id))
        return method(self, layer_id, *args)

    return wrapper


def _wait_until(done: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for {what}")
        time.sleep(0.001)


def _raise_copy_failed(self: LayerwiseLoad, layer_id: int) -> None:
    raise CopyFailed(f"layer {layer_id}")


def _assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(got, want):
        diff = (got.float() - want.float()).abs()
        pytest.fail(f"{what}: differ in {int((diff > 0).sum())} of {diff.numel()} entries, "
                    f"max |diff| = {diff.max().item()}")
