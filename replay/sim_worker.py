"""One in-process sim worker: a real ``Engine`` (sim backend) on a virtual clock.

It does what ``engine.worker.server`` does around its engine, minus the sockets: the prefix
cache's events go through the worker's own ``KVEventBuffer`` and reach the router's ``KVIndex``
as one ``KVEventBatch`` per step, with consecutive sequence numbers, when the step's simulated
time has passed (a live sim worker also releases a step's results only then).

    start_step(now)   engine.step() runs now; returns the virtual time it completes
    finish_step()     the step's outputs, and its KV events applied to the index
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from engine.config import EngineConfig
from engine.cost import CostModel
from engine.engine import Engine, EngineStats
from engine.kv.paged import SeqPages
from engine.model_config import ModelConfig
from engine.protocol import LoadReport
from engine.sampler import SampleOutput
from engine.scheduler import Scheduled
from engine.sequence import Sequence
from engine.sim import SimRunner
from engine.worker.events import KVEventBatch
from engine.worker.publisher import KVEventBuffer, load_report

# MiMo-V2.5-Pro-like geometry (as loadtest/bench_engine.py): 70 layers, every 7th full
# attention, the rest SWA with W = 128; 8 KV heads of 128, bf16.
LAYERS, FULL_EVERY, WINDOW, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 70, 7, 128, 8, 128, 2
VOCAB_SIZE = 152_576
# NOTE: KV budgets are given in "full-attention token equivalents": the bytes of one token's KV
# if all 70 layers were full attention (so a budget of T tokens holds 7 T tokens of full-layer KV
# without SWA, fewer with it).
TOKEN_BYTES = LAYERS * KV_HEADS * 2 * HEAD_DIM * DTYPE_BYTES


def replay_model_config() -> ModelConfig:
    """The sim model every replay worker runs (geometry only: the sim has no weights)."""
    from engine.models.checkpoint import mimo_config

    layers = "".join("F" if i % FULL_EVERY == 0 else "S" for i in range(LAYERS))
    return ModelConfig.from_dict(mimo_config(
        layers=layers, sliding_window=WINDOW, vocab_size=VOCAB_SIZE, hidden_size=1024,
        num_attention_heads=16, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM, max_position_embeddings=1 << 22, swa_num_key_value_heads=KV_HEADS,
    ))


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One sim worker's size and speed.

    Attributes:
        kv_budget_tokens: KV memory in full-attention token equivalents (``TOKEN_BYTES`` each).
        cost: the step cost model the sim paces with (and announces to the router).
        max_batched_tokens: token budget per step.
        max_running_requests: cap on requests running at once.
        checkpoint_interval_tokens: periodic SWA checkpoints; None = the engine's default.
    """

    page_size: int
    kv_budget_tokens: int
    cost: CostModel
    max_batched_tokens: int = 8192
    max_running_requests: int = 64
    checkpoint_interval_tokens: int | None = None
    speculative_tokens: int = 0  # MTP drafts per decode step (the cost model's acceptance)

    def engine_config(self) -> EngineConfig:
        extra = {}
        if self.checkpoint_interval_tokens is not None:
            extra["checkpoint_interval_tokens"] = self.checkpoint_interval_tokens
        return EngineConfig(
            backend="sim", page_size=self.page_size,
            kv_budget_bytes=int(self.kv_budget_tokens * TOKEN_BYTES),
            max_num_batched_tokens=self.max_batched_tokens,
            max_running_requests=self.max_running_requests, max_waiting_requests=1 << 30,
            keep_page_tokens=False, speculative_tokens=self.speculative_tokens, **extra,
        )


class SimWorker:
    """A sim ``Engine`` whose steps take virtual time; see the module docstring.

    Args:
        worker_id: the id the router knows it by.
        spec: size and speed.
        model_config: ``replay_model_config()`` (shared by all workers of a replay).
        index: the router's KV index, fed this worker's events (None: events are dropped).
    """

    def __init__(self, worker_id: str, spec: WorkerSpec, model_config: ModelConfig,
                 index: object | None) -> None:
        self.worker_id, self.spec, self.index = worker_id, spec, index
        self.now_s = 0.0
        self.busy = False
        self._events = KVEventBuffer(spec.page_size, model_config.sliding_window)
        self.engine = _make_engine(spec, model_config, self._events.add, lambda: self.now_s)
        self._kv_seq = 0
        self._outputs: list[Sequence] = []
        self.num_steps = 0

    @property
    def has_work(self) -> bool:
        return self.engine.has_work

    def add(self, seq: Sequence) -> None:
        self.engine.add(seq)

    def start_step(self, now_s: float) -> float | None:
        """Run one engine step starting at ``now_s``; returns when it completes (None: nothing
        ran, the worker is idle)."""
        assert not self.busy, f"{self.worker_id}: a step is already in flight"
        self.now_s = now_s
        runner = self.engine.runner
        before = runner.clock_s  # type: ignore[attr-defined]
        self._outputs = self.engine.step()
        step_s = runner.clock_s - before  # type: ignore[attr-defined]
        if step_s <= 0.0 and not self._outputs:
            self.busy = False
            return None
        self.busy = True
        self.num_steps += 1
        return now_s + step_s

    def finish_step(self, now_s: float) -> list[Sequence]:
        """The step is over: publish its KV events; returns the requests it advanced."""
        self.now_s = now_s
        self.busy = False
        self.publish(now_s)
        out, self._outputs = self._outputs, []
        return out

    def publish(self, now_s: float) -> None:
        """Send the cache events collected so far to the index, as one batch."""
        events = self._events.drain()
        if events and self.index is not None:
            self.index.apply(self.worker_id, self._kv_seq, KVEventBatch(now_s, events))  # type: ignore[attr-defined]
            self._kv_seq += 1

    def retain(self, request_id: str, ttl_s: float, now_s: float) -> bool:
        """``Engine.retain`` (False when the engine has none yet)."""
        self.now_s = max(self.now_s, now_s)
        retain = getattr(self.engine, "retain", None)
        if retain is None:
            return False
        kept = bool(retain(request_id, ttl_s))
        if not self.busy:
            self.publish(now_s)  # NOTE: mid-step, the events go out with the step's batch
        return kept

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def load_report(self) -> LoadReport:
        return load_report(self.worker_id, self.engine.stats())


class ReplayRunner(SimRunner):
    """``SimRunner``'s step cost and clock, without its per-token overheads (profiled: torch
    tensors, a blake2b per token, a page list per request per step, ~25 % of a replay).

    Tokens are ``crc32(request id) + position * golden`` mod vocab: deterministic across runs
    and processes, never a stop token (replays set ``ignore_eos``). No grammars, no logprobs.
    NOTE: the step is priced by ``SimRunner.advance_clock``; a sim engine already hands it rows
    without page lists (``Engine._step_pages``).
    """

    def __init__(self, vocab_size: int, cost: CostModel) -> None:
        super().__init__(vocab_size, cost)
        self._bases: dict[str, int] = {}

    def run(self, batch: Seq[Scheduled], pages: Seq[SeqPages]) -> SampleOutput | None:
        self.advance_clock(batch, pages)
        sampling = [s.seq for s in batch if s.samples]
        if not sampling:
            return None
        tokens = np.fromiter((self._next_token(q) for q in sampling), np.int64, len(sampling))
        return SampleOutput(tokens, None, [None] * len(sampling))  # type: ignore[arg-type]

    def _next_token(self, seq: Sequence) -> int:
        base = self._bases.get(seq.request_id)
        if base is None:
            base = self._bases[seq.request_id] = zlib.crc32(seq.request_id.encode())
        return (base + seq.num_tokens * 0x9E3779B1) % self.vocab_size


def _make_engine(spec: WorkerSpec, model_config: ModelConfig, on_event, clock) -> Engine:  # noqa: ANN001
    # NOTE: the engine's retention TTLs and the cache's LRU run on the virtual clock
    engine = Engine(spec.engine_config(), model_config, on_cache_event=on_event, cost=spec.cost,
                    clock=clock)
    engine.runner = ReplayRunner(model_config.vocab_size, spec.cost)
    return engine
