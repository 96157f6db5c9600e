"""Engine configuration: one frozen object per engine process, read from flags or the environment.

``from_env`` is the only place that reads environment variables (prefix ``AGENTGATE_``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How one engine runs its model.

    Attributes:
        model_path: a model directory (config.json + safetensors); required by "native".
        backend: "native" (this project's torch engine) or "sim" (same scheduler, pools and cache,
            forward replaced by a cost model).
        page_size: tokens per KV page (a power of two).
        kv_budget_bytes: the ONE byte budget that full and SWA pages are drawn from.
        host_kv_budget_bytes: the host-memory tier (L2) below the prefix cache: evicted pages
            that a future hit needs are copied there instead of dropped. 0: no L2.
        max_num_batched_tokens: token budget per step (prefill chunks + decodes).
        max_running_requests: cap on requests decoding at once.
        max_waiting_requests: bounded queue; more is rejected as overloaded.
        enable_prefix_cache: keep KV of finished work for later requests.
        keep_page_tokens: store cached pages' token ids (hash-collision check, token_ids in
            BlockStored events); trace replays turn it off to hold 10^7 pages.
        checkpoint_interval_tokens: keep an extra SWA checkpoint every this many tokens along
            each new prompt (in one LRU with the resume-point checkpoints); 0 disables. A
            multiple of page_size. The default 8192 was chosen by ``loadtest/bench_engine.py
            hit-rate`` (issue 9): it meets the targets on both Mooncake traces, where 2048 and
            4096 cost the conversation trace at 1M tokens (README, Benchmarks).
        gcache: the L3 KV store shared by workers (``engine.kv.gcache.open_store``):
            ``file:DIR``, ``redis://...``, ``redis+cluster://...``; None (or "off"): no L3. Finished
            requests are written through to it, L2 evictions written back, and a queued request
            prefetches what its prompt lacks locally into L2. Needs an L2: without
            ``host_kv_budget_bytes`` one as large as ``kv_budget_bytes`` is made.
        gcache_wait_s: how long a queued request waits for its L3 prefetch at most (then it
            runs with what has landed; the others run meanwhile).
        hibernate_after_s: write a finished request's session to L3 and drop it from this
            worker (L1 and L2) once it has been idle this long and is not retained; 0: never.
            Needs ``gcache``.
        layerwise_load: "on": pages loaded from L2 are copied layer by layer during the
            forward that needs them (``engine.kv.layerwise``); "off": all before it; "auto"
            (default): on with CUDA (copies on a side stream), off on CPU, where
            ``loadtest/bench_layerwise.py`` measured no gain (the copier needs a free core).
        model_id: names the model in L3 keys (with the KV geometry); None: derived from the
            checkpoint (config.json and a sample of the weight files).
        dtype, device: for "native"; device None = CUDA when available.
        qkv_tp_size: the tensor-parallel chunking of an official checkpoint's fused ``qkv_proj``
            (``engine.models.official``); None: worked out from the tensor shapes.
        speculative_tokens: K, the tokens the checkpoint's MTP layers draft per decode step (one
            MTP layer each, so at most ``num_nextn_predict_layers``); 0: no speculation. Native
            backend only (``engine.spec``).
        mtp_prefill: "window" (default): a prompt's MTP layers compute only the rows the first
            drafts need (the last ~K * W positions, SWA-aware); "full": every position (the
            naive baseline that ``loadtest/bench_mtp.py`` measures against). Same drafts.
    """

    model_path: str | None = None
    backend: str = "native"
    page_size: int = 16
    kv_budget_bytes: int = 256 * 2**20
    host_kv_budget_bytes: int = 0
    max_num_batched_tokens: int = 512
    max_running_requests: int = 64
    max_waiting_requests: int = 1024
    enable_prefix_cache: bool = True
    keep_page_tokens: bool = True
    checkpoint_interval_tokens: int = 8192
    gcache: str | None = field(default=None, repr=False)  # NOTE: may hold a password
    gcache_wait_s: float = 0.5
    hibernate_after_s: float = 0.0
    layerwise_load: str = "auto"
    model_id: str | None = None
    dtype: str = "auto"
    device: str | None = None
    qkv_tp_size: int | None = None
    speculative_tokens: int = 0
    mtp_prefill: str = "window"

    def __post_init__(self) -> None:
        p = self.page_size
        assert p > 0 and p & (p - 1) == 0, f"page_size={p}: must be a power of 2"
        assert self.backend in ("native", "sim"), f"backend={self.backend!r}: native or sim"
        assert self.qkv_tp_size is None or self.qkv_tp_size >= 1, f"{self.qkv_tp_size=}: >= 1"
        if self.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens={self.speculative_tokens}: must be >= 0")
        assert self.mtp_prefill in ("window", "full"), f"{self.mtp_prefill=}: window or full"
        ci = self.checkpoint_interval_tokens
        assert ci >= 0 and ci % p == 0, f"checkpoint_interval_tokens={ci}: a multiple of {p}"
        assert self.kv_budget_bytes > 0, f"kv_budget_bytes={self.kv_budget_bytes}: must be > 0"
        assert self.host_kv_budget_bytes >= 0, (
            f"host_kv_budget_bytes={self.host_kv_budget_bytes}: must be >= 0"
        )
        assert self.max_num_batched_tokens >= p, (
            f"max_num_batched_tokens={self.max_num_batched_tokens}: must be >= page_size={p}"
        )
        assert self.max_running_requests >= 1, "max_running_requests must be >= 1"
        assert self.max_waiting_requests >= 1, "max_waiting_requests must be >= 1"
        assert self.gcache_wait_s >= 0, f"gcache_wait_s={self.gcache_wait_s}: must be >= 0"
        assert self.hibernate_after_s >= 0, (
            f"hibernate_after_s={self.hibernate_after_s}: must be >= 0"
        )
        assert self.layerwise_load in ("auto", "on", "off"), (
            f"layerwise_load={self.layerwise_load!r}: auto, on or off"
        )
        if self.gcache is not None and self.gcache.strip().lower() in ("", "off", "none"):
            object.__setattr__(self, "gcache", None)  # NOTE: "off" turns serve's default off
        if self.hibernate_after_s and not self.gcache:
            raise ValueError("hibernate_after_s needs gcache: sessions hibernate to L3")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> EngineConfig:
        """Fields from ``AGENTGATE_<FIELD>`` variables (upper case), then ``overrides``."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"AGENTGATE_{f.name.upper()}")
            if raw is not None:
                values[f.name] = _parse(raw, f.type, f.name)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _parse(raw: str, annotation: object, name: str) -> Any:
    kind = str(annotation)
    try:
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
        if kind.startswith("bool"):
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
    except ValueError as e:
        raise ValueError(f"AGENTGATE_{name.upper()}={raw!r}: not a valid {kind}") from e
    return raw
