"""The worker's command line, shared by ``python -m engine.worker`` and ``agentgate worker``.

    agentgate worker --listen tcp://127.0.0.1:5555 --events tcp://127.0.0.1:5556 \\
        [--model DIR] [--backend native|sim] [--replay tcp://...] [...]   (see --help)

``run`` serves until SIGINT/SIGTERM and logs one start line on stderr (``worker ID listening on
ENDPOINT, events on ENDPOINT``) that ``gateway.serve.spawn_worker`` waits for. With
``--parent-pid PID`` the worker also stops when that process dies (``agentgate serve`` passes its
own pid), even when it is SIGKILLed.

The flag definitions import no torch (the engine is imported in ``run``), so ``agentgate serve``
adds the same engine flags to its own parser (``add_engine_arguments``) and forwards what the user
set to the workers it spawns (``engine_argv``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import zmq

from engine.logs import configure_logging

if TYPE_CHECKING:
    from engine.config import EngineConfig

# NOTE: engine.worker.config.COSTS (engine.sim.COST_PRESETS), repeated so that the flags stay
# torch-free; tests/gateway/test_serve_cli.py checks that the two agree.
COSTS = ("cpu", "h200", "zero")
DEFAULT_MAX_QUEUED_PER_CLIENT = 512  # NOTE: engine.worker.config's, repeated for the same reason
BACKENDS = ("native", "sim", "sglang")
DEFAULT_EMBED_CACHE_MB = 64  # NOTE: engine.worker.config.DEFAULT_EMBED_CACHE_BYTES, likewise
PARENT_POLL_S = 0.5
# NOTE (issue 15): the young generation is collected every this many allocations, not 700: a
# step's short-lived objects die before a pass, and a sim worker's per-page cost stays in its
# own work (loadtest/bench_sim.py: ~6 us of collector time a prefill page with the defaults)
GC_GEN0_THRESHOLD = 50_000
_PR_SET_PDEATHSIG = 1  # linux/prctl.h

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's flags (shared by ``python -m engine.worker`` and ``agentgate worker``)."""
    add = parser.add_argument
    add("--model", help="model directory (config.json + safetensors); the sim backend "
                        "defaults to the built-in demo geometry")
    add("--listen", required=True, help="ROUTER endpoint for requests, e.g. tcp://127.0.0.1:5555")
    add("--events", required=True, help="PUB endpoint for KV events (topic kv) and load "
                                        "reports (topic load)")
    add("--replay", help="ROUTER endpoint for KV event replay (default: none)")
    add("--backend", choices=BACKENDS,
        help="default native (or AGENTGATE_BACKEND); sglang runs SGLang in-process on a GPU "
             "(pip install 'agentgate[sglang]')")
    add("--worker-id", help="name in Welcome and LoadReport (default host-pid)")
    add("--parent-pid", type=int, help="stop when this process dies (agentgate serve sets it)")
    add("--curve-keys", metavar="DIR",
        help="authenticate clients with CURVE: DIR holds the workers' key pair "
             "(server.key_secret, from `agentgate keys DIR`) and the public keys of the "
             "gateways allowed in (every *.key file but server.key; add a gateway by copying "
             "its client.key in as NAME.key); every socket (--listen, --events, --replay) "
             "refuses other clients. Required when an endpoint is not loopback")
    add("--insecure-no-curve", action="store_true",
        help="serve a non-loopback endpoint without --curve-keys: anyone who reaches it can "
             "run work (logged as a warning)")
    add_media_arguments(parser)
    add_engine_arguments(parser)


def add_media_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """Where the worker finds the embeddings of a request's images (issue 13). NOTE: not among
    the engine flags ``agentgate serve`` forwards: serve has its own ``--encoder`` (and passes
    the endpoints on itself)."""
    add = parser.add_argument
    add("--encoder", action="append", default=[], metavar="ENDPOINT", dest="encoders",
        help="an encoder service (`agentgate encoder`) whose cache the worker looks image "
             "embeddings up in, after its own cache and --embed-redis (repeatable)")
    add("--embed-redis", metavar="URL",
        help="the Redis the encoders share their embeddings in (redis://[[user]:password@]"
             "host:port/db); read before asking an encoder service")
    add("--embed-cache-mb", type=int, default=DEFAULT_EMBED_CACHE_MB, metavar="MIB",
        help="the worker's process cache of image embeddings (default: %(default)s)")
    add("--embed-timeout-s", type=float, default=5.0, metavar="S",
        help="a request whose image embeddings take longer fails with invalid_request "
             "(default: %(default)s)")


def default_gcache_dir() -> str:
    """Where ``--gcache`` without a spec keeps its file store (beside the demo model)."""
    return os.path.join(os.path.expanduser("~"), ".cache", "agentgate", "gcache")


def add_engine_arguments(parser: argparse.ArgumentParser | Any) -> list[argparse.Action]:
    """The flags that shape the engine, not the worker's endpoints; also offered (and forwarded)
    by ``agentgate serve``. ``parser`` may be an argument group. Returns the added actions."""
    add = parser.add_argument
    return [
        add("--page-size", type=int, help="tokens per KV page (a power of 2; default 16)"),
        add("--kv-budget-mb", type=int, help="KV byte budget in MiB (default 256)"),
        add("--host-kv-budget-mb", type=int,
            help="host-memory KV tier (L2) in MiB: evicted pages a later hit needs are kept "
                 "there (default 0: none)"),
        add("--gcache", metavar="SPEC", nargs="?", const=f"file:{default_gcache_dir()}",
            help="L3 KV store shared by workers: off, file:DIR[?max_bytes=N] (--gcache "
                 "alone: file:~/.cache/agentgate/gcache, 16 GiB at most), "
                 "redis://[[user]:password@]host:port/db[?ttl_s=S&timeout_s=S], rediss://..., "
                 "redis+cluster://host:port,host:port,...; finished requests are written "
                 "through, L2 evictions written back, queued requests prefetch from it "
                 "(default: off for `agentgate worker`, the file store for `agentgate "
                 "serve`; a password is better given as AGENTGATE_GCACHE than on a command "
                 "line)"),
        add("--gcache-wait-s", type=float,
            help="longest a queued request waits for its L3 prefetch (default 0.5)"),
        add("--hibernate-after-s", type=float,
            help="write a session idle this long (and not retained) to L3 and drop it from "
                 "the worker (needs --gcache; default 0: never)"),
        add("--layerwise-load", choices=("auto", "on", "off"),
            help="copy pages loaded from L2 layer by layer during the forward (on), or all "
                 "before it (off); auto (default): on with CUDA, off on CPU"),
        add("--max-batched-tokens", type=int, help="token budget per step (default 512)"),
        add("--no-prefix-cache", action="store_const", const=False, dest="prefix_cache",
            help="keep no KV of finished requests"),
        add("--checkpoint-interval-tokens", type=int,
            help="keep an SWA checkpoint every this many tokens along new prompts (a multiple "
                 "of the page size; 0: off; default 8192, chosen by loadtest/bench_engine.py "
                 "hit-rate)"),
        add("--cost", choices=COSTS, default="cpu", help="sim backend step-time preset"),
        add("--dtype", help="native backend: float32, bfloat16 or auto"),
        add("--device", help="native backend: cpu or cuda (default: cuda if available)"),
        add("--qkv-tp-size", type=int,
            help="native backend: the tensor-parallel chunks of an official checkpoint's fused "
                 "qkv_proj (default: worked out from the shapes; needed when they are "
                 "ambiguous)"),
        add("--mtp", type=int, dest="speculative_tokens", metavar="K",
            help="native backend: draft K tokens per decode step with the checkpoint's MTP "
                 "layers and verify them in one forward (lossless; 0: off, the default; at most "
                 "num_nextn_predict_layers)"),
        add("--mtp-prefill", choices=("window", "full"),
            help="MTP layers' prompt KV: only the window the first drafts need (window, the "
                 "default) or every position (full, a baseline)"),
        add("--grammar-timeout-s", type=float, default=10.0,
            help="a grammar compiling longer fails with invalid_grammar (default: %(default)s)"),
        add("--max-grammar-bytes", type=int, default=256 * 2**10,
            help="largest json_schema/lark text accepted, in bytes (default: %(default)s)"),
        add("--grammar-cache-mb", type=int, default=128,
            help="compiled-grammar cache bound, estimated MiB (default: %(default)s)"),
        add("--client-timeout-s", type=float, default=10.0,
            help="abort the requests of a client silent this long (default: %(default)s)"),
        add("--max-queued-per-client", type=int, default=DEFAULT_MAX_QUEUED_PER_CLIENT,
            metavar="N", help="requests one client (a gateway process) may have waiting in the "
                              "worker; more are refused as overloaded (default: %(default)s)"),
        add("--tp", type=int, default=1, metavar="N",
            help="sglang backend: tensor-parallel GPUs per worker (default: %(default)s)"),
        add("--sglang-arg", action="append", default=[], metavar="KEY=VALUE", dest="sglang_args",
            help="sglang backend: one of SGLang's server arguments (repeatable; VALUE is read "
                 "as JSON when it parses, e.g. mem_fraction_static=0.8, "
                 "swa_full_tokens_ratio=0.5, skip_tokenizer_init=false)"),
    ]


def changed_engine_flags(args: argparse.Namespace) -> list[tuple[argparse.Action, Any]]:
    """The engine flags set in ``args`` (parsed by a parser with ``add_engine_arguments``) to
    other values than their defaults, with those values."""
    return [(action, value) for action in add_engine_arguments(argparse.ArgumentParser(
        add_help=False)) if (value := getattr(args, action.dest, action.default)) != action.default]


def engine_argv(args: argparse.Namespace) -> list[str]:
    """``changed_engine_flags`` as a worker command line: ``["--cost", "h200", ...]``."""
    argv: list[str] = []
    for action, value in changed_engine_flags(args):
        flag = action.option_strings[0]
        if isinstance(value, list):  # NOTE: an append flag: once per value
            argv += [part for item in value for part in (flag, str(item))]
        else:
            argv += [flag] if action.nargs == 0 else [flag, str(value)]
    return argv


def engine_config(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> EngineConfig:
    """The ``EngineConfig`` of parsed worker flags (``AGENTGATE_*`` variables fill the rest)."""
    from engine.config import EngineConfig

    return EngineConfig.from_env(
        env, model_path=args.model, backend=args.backend, page_size=args.page_size,
        kv_budget_bytes=args.kv_budget_mb * 2**20 if args.kv_budget_mb else None,
        host_kv_budget_bytes=(
            args.host_kv_budget_mb * 2**20 if args.host_kv_budget_mb is not None else None
        ),
        max_num_batched_tokens=args.max_batched_tokens, enable_prefix_cache=args.prefix_cache,
        checkpoint_interval_tokens=args.checkpoint_interval_tokens,
        gcache=args.gcache, gcache_wait_s=args.gcache_wait_s,
        hibernate_after_s=args.hibernate_after_s, layerwise_load=args.layerwise_load,
        dtype=args.dtype, device=args.device, qkv_tp_size=args.qkv_tp_size,
        speculative_tokens=args.speculative_tokens, mtp_prefill=args.mtp_prefill,
    )


def watch_parent(parent_pid: int, on_gone: Callable[[], None]) -> None:
    """Call ``on_gone`` (from a thread) when ``parent_pid`` is no longer this process's parent.

    NOTE: two mechanisms. Linux's ``PR_SET_PDEATHSIG`` (set at the start of ``run``) delivers
    SIGTERM the moment the parent dies, even by SIGKILL; this thread polls ``os.getppid()`` every
    ``PARENT_POLL_S`` as the portable fallback (an orphan is re-parented, so its ppid changes).
    """
    def poll() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        logger.warning("parent process %d is gone: stopping", parent_pid)
        on_gone()

    threading.Thread(target=poll, name="parent-watch", daemon=True).start()


def run(args: argparse.Namespace) -> int:
    """Start a worker from parsed flags and serve until SIGINT/SIGTERM; returns the exit status."""
    configure_logging(f"worker {args.worker_id or os.getpid()}")
    if args.parent_pid is not None:
        _die_with_parent()
        if os.getppid() != args.parent_pid:  # NOTE: the parent died before prctl took effect
            logger.warning("parent process %d is gone before the start", args.parent_pid)
            return 0
    if (args.backend or os.environ.get("AGENTGATE_BACKEND")) == "sglang":
        from engine.sglang_backend.cli import run as run_sglang

        return run_sglang(args)
    from engine.worker.server import Worker, WorkerConfig

    engine_cfg = engine_config(args)
    if engine_cfg.backend == "native" and engine_cfg.model_path is None:
        raise ValueError("--model is required with the native backend")
    extra = {"worker_id": args.worker_id} if args.worker_id else {}
    cfg = WorkerConfig(listen=args.listen, events=args.events, replay=args.replay,
                       cost=args.cost, grammar_timeout_s=args.grammar_timeout_s,
                       max_grammar_bytes=args.max_grammar_bytes,
                       grammar_cache_bytes=args.grammar_cache_mb * 2**20,
                       client_timeout_s=args.client_timeout_s,
                       max_queued_per_client=args.max_queued_per_client,
                       curve_keys=args.curve_keys, insecure_no_curve=args.insecure_no_curve,
                       encoders=tuple(args.encoders), embed_redis=args.embed_redis,
                       embed_cache_bytes=args.embed_cache_mb * 2**20,
                       embed_timeout_s=args.embed_timeout_s, **extra)
    worker = Worker(cfg, engine_cfg)
    tune_gc()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: worker.stop())
    if args.parent_pid is not None:
        watch_parent(args.parent_pid, worker.stop)
    listen, events = worker.endpoints
    logger.info("worker %s listening on %s, events on %s", cfg.worker_id, listen, events)
    try:
        worker.serve()
    finally:
        worker.close()
    return 0


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    from engine.sglang_backend.launch import SGLangUnavailable  # NOTE: imports no SGLang
    from engine.worker import server

    description = (server.__doc__ or "").split("\n\n")[0]
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (AssertionError, ValueError, FileNotFoundError, zmq.ZMQError, SGLangUnavailable) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


def tune_gc() -> None:
    """Once start-up is done: freeze what it allocated (modules, the engine; never garbage) out
    of the collector's sight, and collect the young generation every ``GC_GEN0_THRESHOLD``
    allocations. NOTE: with the defaults, the collector's full passes walk the ~170k start-up
    objects each time the cache's nodes grow by a quarter; a worker's cycles are rare and small,
    so later collections lose nothing."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])


def _die_with_parent() -> bool:
    """Ask Linux for SIGTERM when the parent dies; False where prctl is not available.

    NOTE: the signal comes when the parent *thread* that forked us ends, so ``agentgate serve``
    spawns workers only from threads that outlive them (the main thread, the supervisor's).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
