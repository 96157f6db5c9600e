"""The command line of ``agentgate worker --backend sglang`` (flags: ``engine.worker.cli``).

Same process rules as the native worker: SIGINT/SIGTERM stop it, ``--parent-pid`` ties its life
to ``agentgate serve``'s, and SGLang's own scheduler processes (which SGLang spawns and kills
with its engine) go when it does: ``SGLangHandle.shutdown`` on the way out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
from pathlib import Path

from engine.config import EngineConfig
from engine.model_config import ConfigError, ModelConfig
from engine.sglang_backend.launch import events_endpoint, server_kwargs, start_engine
from engine.sglang_backend.mapping import parse_sglang_args
from engine.sglang_backend.worker import ModelInfo, SGLangWorker, run_until_stopped

logger = logging.getLogger(__name__)

# NOTE: the engine flags this backend reads; `agentgate serve` forwards every engine flag the user
# set (and sets --gcache itself), so the others are ignored with a warning, not refused
SGLANG_ENGINE_FLAGS = ("page_size", "dtype", "tp", "sglang_args", "client_timeout_s",
                       "max_queued_per_client")


def model_info(model_dir: Path) -> ModelInfo:
    """Name, SWA window and vocabulary of the checkpoint in ``model_dir``.

    A MiMo-V2 config is read by ``ModelConfig`` (W only when some layer slides); any other
    architecture SGLang serves by its raw ``config.json``, where a ``sliding_window`` key counts
    as SWA: claiming a window the model lacks only makes the router credit fewer hits.
    """
    try:
        cfg = ModelConfig.from_dir(model_dir)
    except ConfigError:
        raw = json.loads((model_dir / "config.json").read_text())
        window = raw.get("sliding_window")
        return ModelInfo(model_dir.name, int(window) if window else None, raw.get("vocab_size"))
    slides = any(kind != "full_attention" for kind in cfg.layer_types)
    return ModelInfo(model_dir.name, cfg.sliding_window if slides else None, cfg.vocab_size)


def run(args: argparse.Namespace) -> int:
    """Start SGLang and serve until SIGINT/SIGTERM (or the parent's death)."""
    from engine.worker.cli import changed_engine_flags, watch_parent
    from engine.worker.config import WorkerConfig

    if not args.model:
        raise ValueError("--model is required with the sglang backend")
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"--model {model_dir}: no config.json there")
    ignored = [action.option_strings[0] for action, _ in changed_engine_flags(args)
               if action.dest not in SGLANG_ENGINE_FLAGS]
    if ignored:
        logger.warning("ignored by the sglang backend: %s", ", ".join(ignored))
    # NOTE: the native engine's default, so a mixed fleet hashes alike
    page_size = args.page_size or EngineConfig().page_size
    kwargs = server_kwargs(str(model_dir), page_size=page_size,
                           events=events_endpoint(f"{os.getpid()}"), tp_size=args.tp,
                           dtype=args.dtype, user_args=parse_sglang_args(args.sglang_args))
    extra = {"worker_id": args.worker_id} if args.worker_id else {}
    cfg = WorkerConfig(listen=args.listen, events=args.events, replay=args.replay,
                       client_timeout_s=args.client_timeout_s,
                       max_queued_per_client=args.max_queued_per_client,
                       curve_keys=args.curve_keys, insecure_no_curve=args.insecure_no_curve,
                       **extra)
    handle = start_engine(kwargs)
    try:
        worker = SGLangWorker(cfg, handle, model_info(model_dir), page_size=page_size)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: worker.stop())
        if args.parent_pid is not None:
            watch_parent(args.parent_pid, worker.stop)
        listen, events = worker.endpoints

        def started() -> None:
            logger.info("worker %s listening on %s, events on %s", cfg.worker_id, listen, events)

        try:
            run_until_stopped(worker, handle.engine.loop, on_started=started)
        finally:
            worker.close()
    finally:
        handle.shutdown()
    return 0
