"""Engine: scheduler + KV manager + a runner (native model or sim cost model), stepped in a loop.

Used by the offline ``LLM`` and by the worker process. ``step()`` runs one batch and returns the
requests that got a token or finished in it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from engine.config import EngineConfig
from engine.grammar import MAX_GRAMMAR_CACHE_BYTES, GrammarCompiler, GrammarMatcher
from engine.hashing import page_hashes
from engine.kv.allocator import PageAllocator
from engine.kv.host_pool import HostPagePool
from engine.kv.layout import KVLayout, PageKind
from engine.kv.manager import KVManager
from engine.kv.paged import SeqPages
from engine.kv.prefix_cache import CacheEvent, PrefixCache
from engine.kv.tier import HostTier

if TYPE_CHECKING:
    from engine.kv.gcache.tier import GCacheTier
    from engine.kv.layerwise import PageCopy
from engine.model_config import ModelConfig
from engine.sampler import SampleOutput
from engine.sampling_params import SamplingParams, check_logit_bias_ids
from engine.scheduler import Scheduled, Scheduler
from engine.sequence import Media, Sequence, check_prompt_ids


class ContextTooLong(ValueError):
    """Prompt + max_new_tokens exceed the model's context (the worker's ``context_too_long``)."""


class Runner(Protocol):
    def run(self, batch: list[Scheduled], pages: list[SeqPages],
            loads: list[PageCopy] = ...) -> SampleOutput | None: ...


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    free_full_pages: int
    free_swa_pages: int
    used_bytes: int
    total_bytes: int
    cached_pages: int
    num_preemptions: int
    retained_pages: int = 0  # protected by live retentions (estimate: PrefixCache.retained_pages)
    retains_expired: int = 0  # retentions whose TTL ran out before any request reached them
    # the host tier (L2), all 0 without one
    host_pages: int = 0  # pages (full + SWA) held in host memory
    host_used_bytes: int = 0
    host_total_bytes: int = 0
    host_demoted_pages: int = 0  # copied device -> host (since start)
    host_loaded_pages: int = 0  # copied host -> device
    host_evicted_pages: int = 0  # dropped from host memory (LRU)
    host_hit_tokens: int = 0  # prompt tokens L2 added to requests' usable prefixes
    # L3 (GCache), all 0 without one
    storage_written_pages: int = 0  # confirmed in the store
    storage_write_failed_pages: int = 0  # the store failed them (outage); retried later
    storage_write_dropped: int = 0  # write jobs dropped: the writer's queue was full
    storage_fetched_pages: int = 0  # landed in L2 from the store
    storage_hit_tokens: int = 0  # prompt tokens whose full KV came from the store
    storage_wait_timeouts: int = 0  # requests admitted before their prefetch finished
    storage_errors: int = 0  # failed store calls (timeouts included)
    storage_corrupt: int = 0  # values that failed their checksum (read as misses)
    hibernated_sessions: int = 0
    # MTP (engine.spec), all 0 without it
    mtp_verify_steps: int = 0
    mtp_draft_tokens: int = 0
    mtp_accepted_tokens: int = 0


@dataclass(slots=True)
class SpecStats:
    """MTP verification so far (``engine.spec``): acceptance length = emitted / verify_steps."""

    verify_steps: int = 0  # request-steps that verified drafts
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of which accepted
    emitted: int = 0  # tokens those steps emitted (accepted + one drawn by the base)

    def record(self, counts: list[int], emitted: list[int]) -> None:
        for c, e in zip(counts, emitted):
            if c > 1:
                self.verify_steps += 1
                self.drafted += c - 1
                self.accepted += e - 1
                self.emitted += e

    @property
    def acceptance_length(self) -> float:
        """Tokens per verify step (1 + accepted drafts on average); 0 before any."""
        return self.emitted / self.verify_steps if self.verify_steps else 0.0


class Engine:
    """One model, one KV budget, one scheduler.

    Args:
        cfg: the engine config (backend, page size, KV budget, batching limits).
        model_config: geometry for the "sim" backend when ``cfg.model_path`` is not given.
        on_cache_event: receives the prefix cache's events (the worker publishes them).
        cost: the sim backend's ``CostModel`` (default: calibrated CPU figures).
        grammar_cache_bytes: the bound of the compiled-grammar cache (estimated bytes).
        clock: seconds for retention TTLs (default ``time.monotonic``; a replay passes its
            virtual clock).
    """

    def __init__(
        self,
        cfg: EngineConfig,
        model_config: ModelConfig | None = None,
        on_cache_event: Callable[[CacheEvent], None] | None = None,
        cost: object | None = None,
        grammar_cache_bytes: int = MAX_GRAMMAR_CACHE_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.model_config = model_config or ModelConfig.from_dir(_require_path(cfg))
        spec = cfg.speculative_tokens
        model = self.model = self._load_model()
        dtype_bytes = 2 if model is None else next(model.parameters()).dtype.itemsize
        # NOTE: MTP layers keep their KV in the SWA pages, after the base model's SWA layers
        kv_config = self.model_config
        if spec:
            from engine.models.mtp import mtp_model_config

            kv_config = mtp_model_config(self.model_config, spec)
        self.layout = KVLayout.from_model(kv_config, cfg.page_size, dtype_bytes)
        self.allocator = PageAllocator(self.layout, cfg.kv_budget_bytes)
        self.runner = self._make_runner(model, cost)
        self.drafter = None
        if spec and model is None:
            self.runner.speculative_tokens = spec  # type: ignore[attr-defined]
        elif spec:
            from engine.spec import Drafter

            self.drafter = Drafter(model, self.runner.pool, self.layout,  # type: ignore[attr-defined]
                                   full_prefill=cfg.mtp_prefill == "full")
        self.spec_stats = SpecStats()
        self.clock = clock
        self.host = self._make_host_tier(on_cache_event)
        self.cache = PrefixCache(self.allocator, enabled=cfg.enable_prefix_cache,
                                 keep_tokens=cfg.keep_page_tokens, on_event=on_cache_event,
                                 clock=clock, lower=self.host)
        self.storage = self._make_storage(on_cache_event)
        self.kv = KVManager(self.allocator, self.cache, cfg.checkpoint_interval_tokens,
                            lower=self.host, storage=self.storage)
        self._next_hibernate = 0.0
        # NOTE: the sim reads only each row's seq_len; page lists would cost O(pages) per step
        self._step_pages = self.kv.seq_pages if model is not None else _lengths_only
        self.scheduler = Scheduler(
            self.kv, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_running_requests=cfg.max_running_requests,
            max_waiting_requests=cfg.max_waiting_requests,
            ready=self._fetch_ready if self.storage is not None else None,
            lookahead=spec,
        )
        self.eos_token_ids = _eos_ids(cfg.model_path, self.model_config)
        self.grammars = GrammarCompiler(cfg.model_path, self.model_config.vocab_size,
                                        self.eos_token_ids, max_cache_bytes=grammar_cache_bytes)

    # ------------------------------------------------------------------ requests

    @property
    def needs_media_embeds(self) -> bool:
        """Whether requests with media need their embeddings (the sim has no hidden states)."""
        return self.model is not None

    def check_request(self, prompt_ids: list[int], params: SamplingParams,
                      media: list[tuple[int, int]] | None = None) -> None:
        """The checks of ``make_sequence`` that need no grammar and no embeddings.

        Args:
            media: the prompt's media spans, (offset, length) each.

        Raises:
            ValueError: empty prompt, token id outside the vocabulary (or a ``logit_bias`` id),
                a media span out of order, overlapping, outside the prompt or over ids that are
                not placeholders (a placeholder outside every span is outside the vocabulary),
                or prompt + max_new_tokens beyond the model's context (``ContextTooLong``).
        """
        _validate_prompt(prompt_ids, params.max_new_tokens, self.model_config, media)
        check_logit_bias_ids(params, self.model_config.vocab_size)

    def make_sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      grammar: GrammarMatcher | None = None, media: tuple[Media, ...] = (),
                      **kwargs: object) -> Sequence:
        """Validate and build a request (``kwargs``: priority, cache_salt, session_id, ...).

        Args:
            grammar: ``params.structured`` compiled already (``GrammarCompiler``); None with a
                grammar in ``params``: compiled here (cached).
            media: the prompt's images by offset, each with its embeddings [length, hidden]
                (moved to the model's device and dtype here); the sim keeps the spans only.

        Raises:
            ValueError: as ``check_request``, or embeddings missing or not [length, hidden].
            GrammarError: ``params.structured`` does not compile (a ValueError too).
        """
        self.check_request(prompt_ids, params, [(m.offset, m.length) for m in media])
        media = self.prepare_media(media)
        if params.resumed_tokens >= len(prompt_ids):
            raise ValueError(f"SamplingParams.resumed_tokens={params.resumed_tokens}: must be "
                             f"below the prompt's {len(prompt_ids)} tokens")
        eos = () if params.ignore_eos else self.eos_token_ids
        stop = set(params.stop_token_ids) | set(eos)
        if grammar is None and params.structured is not None:
            grammar = self.grammars.matcher(params.structured)
        if grammar is not None and params.resumed_tokens:
            for token in prompt_ids[len(prompt_ids) - params.resumed_tokens:]:
                grammar.accept(int(token))  # NOTE: the earlier run's output, consumed as it was
        return Sequence(request_id, tuple(map(int, prompt_ids)), params,
                        generator=self._generator(params.seed), stop_ids=frozenset(stop),
                        grammar=grammar, media=media, **kwargs)  # type: ignore[arg-type]

    def prepare_media(self, media: tuple[Media, ...]) -> tuple[Media, ...]:
        """``media`` with their embeddings checked and on the model's device, in its dtype
        (the sim: without embeddings).

        Raises:
            ValueError: embeddings missing, or not [length, hidden_size].
        """
        if not self.needs_media_embeds:
            return tuple(Media(m.offset, m.length) for m in media)
        hidden = self.model_config.hidden_size
        param = next(self.model.parameters())  # NOTE: the embedding table: the model's dtype
        out = []
        for i, m in enumerate(media):
            if m.embeds is None:
                raise ValueError(f"media[{i}]: no embeddings (the native backend needs them)")
            if tuple(m.embeds.shape) != (m.length, hidden):
                raise ValueError(f"media[{i}]: embeddings of shape {list(m.embeds.shape)}; want "
                                 f"[length, hidden_size] = [{m.length}, {hidden}]")
            out.append(m._replace(embeds=m.embeds.to(param.device, param.dtype)))
        return tuple(out)

    def add(self, seq: Sequence, bounded: bool = True) -> None:
        """Queue a request (and start its L3 prefetch); ``bounded=False`` skips the queue bound
        (offline generation).

        Raises:
            Overloaded: the waiting queue is full.
        """
        self.scheduler.add(seq, bounded)
        if self.storage is not None:
            p = self.layout.page_size
            if len(seq.page_hashes) < seq.num_tokens // p:
                seq.page_hashes = page_hashes(seq.token_ids, p, seq.cache_salt)
            tokens = seq.token_ids if self.cfg.keep_page_tokens else None
            seq.fetch = self.storage.start_fetch(
                self.storage.missing(seq.page_hashes, tokens, seq.num_tokens, self.cache))

    @property
    def only_fetching(self) -> bool:
        """Work waits only for L3 prefetches: a step would do nothing (a worker polls slower)."""
        return self.storage is not None and self.scheduler.only_fetching

    def tick(self) -> None:
        """Housekeeping between steps (the worker calls it every loop): take in L3 write
        confirmations (their KV events), hibernate idle sessions (once a second at most)."""
        if self.storage is None:
            return
        self.storage.poll()
        now = self.clock()
        if self.cfg.hibernate_after_s and now >= self._next_hibernate:
            self._next_hibernate = now + min(1.0, self.cfg.hibernate_after_s)
            self.kv.hibernate(self.cfg.hibernate_after_s, now)

    def close(self) -> None:
        """Stop the L3 threads after writing what is queued (a few seconds at most)."""
        if self.storage is not None:
            self.storage.close()

    def abort(self, request_id: str) -> Sequence | None:
        return self.scheduler.abort(request_id)

    def retain(self, request_id: str, ttl_s: float) -> bool:
        """Keep the end checkpoint of a lately finished request ``ttl_s`` more seconds (a session
        paused in a tool call resumes there); ``ttl_s=0`` releases it. Returns False when the
        request is unknown here (not finished with a checkpoint, or forgotten: the engine
        remembers ``KVManager.max_finished_ends``) or its pages are gone.

        Retention is a hint: when nothing else is left to evict, retained pages go too.
        """
        return self.kv.retain(request_id, ttl_s)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[Sequence]:
        """Run one batch; returns requests that got a token, finished or failed in it."""
        batch, failed = self.scheduler.schedule()
        if not batch:
            return failed
        return failed + self.run_scheduled(batch)

    def run_scheduled(self, batch: list[Scheduled]) -> list[Sequence]:
        """Forward an already scheduled batch, commit its KV and append sampled tokens."""
        if self.cfg.speculative_tokens:
            return self._run_speculative(batch)
        pages = [self._step_pages(s.seq, s.query_len) for s in batch]
        if self.host is not None and self.host.defer_loads:
            try:  # NOTE: the pages admitted from L2 in this step's schedule, copied in the forward
                sampled = self.runner.run(batch, pages, loads=self.host.take_loads())
            finally:
                self.host.loads_done()
        else:
            sampled = self.runner.run(batch, pages)
        sampling = [s.seq for s in batch if s.samples]
        for s in batch:
            self.kv.commit(s.seq, s.query_len)
        if sampled is not None:
            self._append(sampling, sampled)
        return sampling

    def _run_speculative(self, batch: list[Scheduled]) -> list[Sequence]:
        """``run_scheduled`` with MTP (``engine.spec``): forward (verify rows included), draw
        and accept, draft the next tokens, then commit what was accepted and finish. The sim
        accepts drafts with the cost model's rate instead (``engine.sim``)."""
        sampling = [i for i, s in enumerate(batch) if s.samples]
        counts = [1 + batch[i].num_drafts for i in sampling]  # verify rows: the last ones
        tokens_before = [s.seq.num_tokens for s in batch]
        pages = [self._step_pages(s.seq, s.query_len) for s in batch]
        for s, p in zip(batch, pages):
            p.rows = s.num_drafts > 0  # NOTE: a verify step's rows attend as decodes do
        offsets = [0]
        for s in batch:
            offsets.append(offsets[-1] + s.query_len)
        if self.drafter is None:
            hidden = None
            emitted, finishes = self._verify_sim(batch, pages, sampling, counts)
        else:
            hidden, emitted, finishes = self._verify(batch, pages, sampling, counts, offsets)
        self.spec_stats.record(counts, emitted)
        committed = [s.query_len for s in batch]
        for r, i in enumerate(sampling):
            if counts[r] > 1:  # NOTE: a verify step commits what it emitted, the rest rolls back
                committed[i] = emitted[r]
        done = {id(q) for q, _ in finishes}
        drafting = {i for i in sampling if id(batch[i].seq) not in done}
        for s in batch:
            s.seq.draft_ids = []
        if hidden is not None:
            from engine.spec import DraftJob

            jobs = [DraftJob(s.seq, pages[i], hidden[offsets[i] : offsets[i + 1]],
                             s.seq.num_computed, s.seq.num_computed + committed[i],
                             draft=i in drafting, num_tokens=tokens_before[i])
                    for i, s in enumerate(batch) if id(s.seq) not in done]
            if jobs:
                self.drafter.run(jobs)  # type: ignore[union-attr]
                for job in jobs:
                    job.seq.draft_ids = job.drafts
        else:
            for i in drafting:  # NOTE: the sim drafts placeholders: only their number counts
                batch[i].seq.draft_ids = [0] * self.cfg.speculative_tokens
        for s, n in zip(batch, committed):
            self.kv.commit(s.seq, n)
        for q, reason in finishes:
            self.scheduler.finish(q, reason)
        return [batch[i].seq for i in sampling]

    def _verify(self, batch: list[Scheduled], pages: list[SeqPages], sampling: list[int],
                counts: list[int], offsets: list[int]):  # noqa: ANN202 (hidden, emitted, finishes)
        """The base forward, then rounds j = 0 .. K: each live request draws its row j exactly
        as a step without MTP would, and stays live while the draw equals its draft j."""
        from engine.model_runner import _text_only
        from engine.sampler import grammar_mask, penalty_history, position_seed

        runner = self.runner
        if self.host is not None and self.host.defer_loads:
            try:
                hidden, _ = runner.forward(batch, pages, loads=self.host.take_loads())  # type: ignore[attr-defined]
            finally:
                self.host.loads_done()
        else:
            hidden, _ = runner.forward(batch, pages)  # type: ignore[attr-defined]
        rows = [offsets[i + 1] - c + j for i, c in zip(sampling, counts) for j in range(c)]
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        logits = self.model.compute_logits(hidden[rows]) if rows else None  # type: ignore[union-attr]
        emitted = [0] * len(sampling)
        finishes: list[tuple[Sequence, str]] = []
        alive = list(range(len(sampling)))
        vocab = self.model_config.vocab_size
        for j in range(max(counts, default=0)):
            live = [r for r in alive if j < counts[r]]
            if not live:
                break
            assert logits is not None
            seqs = [batch[sampling[r]].seq for r in live]
            for q in seqs:
                if q.generator is not None:
                    q.generator.manual_seed(position_seed(q.params.seed, q.num_tokens))
            step_logits = logits[[starts[r] + j for r in live]]
            allowed = grammar_mask([q.grammar for q in seqs], step_logits.shape[-1],
                                   step_logits.device)
            out = runner.sampler.sample(  # type: ignore[attr-defined]
                step_logits, [q.params for q in seqs], [q.generator for q in seqs], allowed,
                history=_text_only(penalty_history(seqs), vocab))
            tokens = out.token_ids.tolist()
            alive = []
            for idx, (r, q) in enumerate(zip(live, seqs)):
                token = tokens[idx]
                emitted[r] += 1
                reason = self._emit(q, token, out, idx)
                if reason is not None:
                    finishes.append((q, reason))
                elif j + 1 < counts[r] and token == q.draft_ids[j]:
                    alive.append(r)
        return hidden, emitted, finishes

    def _verify_sim(self, batch: list[Scheduled], pages: list[SeqPages], sampling: list[int],
                    counts: list[int]) -> tuple[list[int], list[tuple[Sequence, str]]]:
        """The sim's verify: the usual draw, then each further draft accepted with the cost
        model's rate (``SimRunner.accepts``), the tokens drawn as without MTP."""
        runner = self.runner
        sampled = runner.run(batch, pages)
        emitted = [0] * len(sampling)
        finishes: list[tuple[Sequence, str]] = []
        for r, i in enumerate(sampling):
            seq, out, row = batch[i].seq, sampled, r
            for j in range(counts[r]):
                if j:
                    if not runner.accepts(seq):  # type: ignore[attr-defined]
                        break
                    out, row = runner.sample([seq]), 0  # type: ignore[attr-defined]
                assert out is not None
                emitted[r] += 1
                reason = self._emit(seq, int(out.token_ids[row]), out, row)
                if reason is not None:
                    finishes.append((seq, reason))
                    break
        return emitted, finishes

    def _emit(self, seq: Sequence, token: int, sampled: SampleOutput, row: int) -> str | None:
        """Append one drawn token (logprobs, grammar); returns the finish reason it causes."""
        seq.output_ids.append(token)
        if seq.params.logprobs is not None and sampled.logprobs is not None:
            seq.logprobs.append(float(sampled.logprobs[row]))
            top = sampled.top_logprobs[row]
            if seq.params.logprobs and top is not None:
                seq.top_logprobs.append(tuple(top))
        if seq.grammar is not None:
            seq.grammar.accept(token)
        # NOTE: a complete grammar allows only EOS; with ignore_eos that EOS is not a stop id,
        # but the grammar has ended all the same
        if token in seq.stop_ids or (seq.grammar is not None and seq.grammar.is_terminated):
            return "stop"
        if len(seq.output_ids) >= seq.params.max_new_tokens:
            return "length"
        return None

    def flush_cache(self) -> int:
        """Forget every cached page that no request holds, in every tier; returns the number
        of L1 pages removed."""
        removed = self.cache.flush()
        if self.host is not None:
            self.host.host.clear()
        return removed  # NOTE: L3 is shared with other workers: never flushed from here

    def stats(self) -> EngineStats:
        a = self.allocator
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            free_full_pages=a.num_free_pages(PageKind.FULL),
            free_swa_pages=a.num_free_pages(PageKind.SWA), used_bytes=a.used_bytes,
            total_bytes=a.total_bytes, cached_pages=self.cache.num_nodes,
            num_preemptions=self.scheduler.num_preemptions,
            retained_pages=self.cache.retained_pages(),
            retains_expired=self.cache.retains_expired,
            **self._host_stats(), **self._storage_stats(),
            mtp_verify_steps=self.spec_stats.verify_steps,
            mtp_draft_tokens=self.spec_stats.drafted,
            mtp_accepted_tokens=self.spec_stats.accepted,
        )

    # ------------------------------------------------------------------ internals

    def _make_host_tier(self, on_event: Callable[[CacheEvent], None] | None) -> HostTier | None:
        """L2 below the prefix cache, when the config gives it a budget (or has an L3, which
        lands its pages there) and the cache is on."""
        budget = self.cfg.host_kv_budget_bytes or (self.cfg.kv_budget_bytes if self.cfg.gcache
                                                   else 0)
        if not budget or not self.cfg.enable_prefix_cache:
            return None
        pool = getattr(self.runner, "pool", None)  # None: the sim backend (bookkeeping only)
        dtype = None if pool is None else pool.arena.dtype
        pin = pool is not None and pool.device.type == "cuda"
        host = HostPagePool(self.layout, budget, dtype, pin_memory=pin)
        tier = HostTier(host, pool, on_event)
        layerwise = self.cfg.layerwise_load
        tier.defer_loads = pool is not None and (
            layerwise == "on" or (layerwise == "auto" and pool.device.type == "cuda"))
        return tier

    def _make_storage(self, on_event: Callable[[CacheEvent], None] | None) -> GCacheTier | None:
        """L3 below L2 (``cfg.gcache``)."""
        if not self.cfg.gcache or self.host is None:
            return None
        from engine.kv.gcache import model_fingerprint, open_store
        from engine.kv.gcache.tier import GCacheTier

        pool = getattr(self.runner, "pool", None)
        kv_dtype = None if pool is None else str(pool.arena.dtype).removeprefix("torch.")
        model_id = self.cfg.model_id or _model_id(self.cfg, self.model_config)
        fingerprint = model_fingerprint(self.layout, model_id, kv_dtype)
        return GCacheTier(open_store(self.cfg.gcache), fingerprint, self.host, self.layout, pool,
                          wait_s=self.cfg.gcache_wait_s, on_event=on_event, clock=self.clock)

    def _fetch_ready(self, seq: Sequence) -> bool:
        if seq.fetch is None or self.storage is None:
            return True
        if not self.storage.ready(seq.fetch):
            return False
        seq.fetch = None
        return True

    def _storage_stats(self) -> dict[str, int]:
        if self.storage is None:
            return {}
        st, store = self.storage.stats, self.storage.store.stats
        return {"storage_written_pages": st.written_pages,
                "storage_write_failed_pages": st.write_failed_pages,
                "storage_write_dropped": st.write_dropped + self.storage.writer.dropped,
                "storage_fetched_pages": st.fetched_pages, "storage_hit_tokens": st.hit_tokens,
                "storage_wait_timeouts": st.wait_timeouts, "storage_errors": store.errors,
                "storage_corrupt": store.corrupt, "hibernated_sessions": st.hibernated}

    def _host_stats(self) -> dict[str, int]:
        if self.host is None:
            return {}
        h, st = self.host.host, self.host.stats
        return {"host_pages": h.num_pages, "host_used_bytes": h.used_bytes,
                "host_total_bytes": h.total_bytes, "host_demoted_pages": st.demoted_pages,
                "host_loaded_pages": st.loaded_pages, "host_evicted_pages": st.evicted_pages,
                "host_hit_tokens": st.hit_tokens}

    def _append(self, seqs: list[Sequence], sampled: SampleOutput) -> None:
        tokens = sampled.token_ids.tolist()
        for i, seq in enumerate(seqs):
            reason = self._emit(seq, tokens[i], sampled, i)
            if reason is not None:
                self.scheduler.finish(seq, reason)

    def _load_model(self):  # noqa: ANN202 (MiMoV2ForCausalLM | None; torch stays lazy)
        if self.cfg.backend == "sim":
            return None
        from engine.models.loader import load_model

        return load_model(_require_path(self.cfg), dtype=self.cfg.dtype, device=_device(self.cfg),
                          qkv_tp_size=self.cfg.qkv_tp_size,
                          mtp_layers=self.cfg.speculative_tokens)

    def _make_runner(self, model: object, cost: object | None) -> Runner:
        if model is None:
            from engine.sim import CostModel, SimRunner

            assert cost is None or isinstance(cost, CostModel), f"cost={cost!r}: a CostModel"
            return SimRunner(self.model_config.vocab_size, cost)
        from engine.model_runner import ModelRunner

        return ModelRunner(model, self.layout, self.allocator.num_chunks)  # type: ignore[arg-type]

    def _generator(self, seed: int | None):  # noqa: ANN202 (torch.Generator | None)
        from engine.sampler import make_generator

        device = getattr(self.runner, "device", "cpu")
        return make_generator(seed, device)


def _lengths_only(seq: Sequence, query_len: int) -> SeqPages:
    """A step row without page lists (the sim backend's cost model needs only the lengths)."""
    return SeqPages(full_pages=[], swa_pages=[], num_cached=seq.num_computed, query_len=query_len)


def _model_id(cfg: EngineConfig, model_config: ModelConfig) -> str:
    """What names the model in L3 keys: config.json and a sample of every weight file (size,
    first and last 64 KiB), so two checkpoints of one architecture never share KV; the sim's
    geometry alone (its pages carry no bytes)."""
    import hashlib

    h = hashlib.sha256()
    if cfg.backend == "sim" or cfg.model_path is None:
        h.update(f"sim|{model_config!r}".encode())
        return "sim-" + h.hexdigest()[:16]
    root = Path(cfg.model_path)
    h.update((root / "config.json").read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        with path.open("rb") as f:
            h.update(f"{path.name}|{size}|".encode() + f.read(1 << 16))
            f.seek(max(0, size - (1 << 16)))
            h.update(f.read(1 << 16))
    return "native-" + h.hexdigest()[:16]


def _require_path(cfg: EngineConfig) -> str:
    if cfg.model_path is None:
        raise ValueError("model_path is required (a directory with config.json + safetensors)")
    return cfg.model_path


def _device(cfg: EngineConfig) -> str:
    if cfg.device is not None:
        return cfg.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _eos_ids(model_path: str | None, cfg: ModelConfig) -> tuple[int, ...]:
    ids = list(cfg.eos_token_ids)
    gen_cfg = Path(model_path) / "generation_config.json" if model_path else None
    if gen_cfg is not None and gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return tuple(dict.fromkeys(ids))


def _validate_prompt(prompt: list[int], max_new_tokens: int, cfg: ModelConfig,
                     media: list[tuple[int, int]] | None = None) -> None:
    if len(prompt) == 0:
        raise ValueError("prompt is empty: give at least one token id")
    check_prompt_ids(prompt, media or [], cfg.vocab_size)
    limit = cfg.max_position_embeddings
    if len(prompt) + max_new_tokens > limit:
        raise ContextTooLong(
            f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} exceeds the "
            f"model's context of {limit} tokens"
        )
