"""The ``agentgate`` command line.

    agentgate model init DIR          write the built-in demo MiMo-V2 checkpoint (deterministic)
    agentgate generate [--model DIR] TEXT
                                      print a completion (the demo model by default)
    agentgate worker --listen tcp://HOST:PORT --events tcp://HOST:PORT [--model DIR] ...
                                      serve one engine over ZeroMQ (``agentgate worker -h``)
    agentgate serve [--model DIR] [--workers N] [--worker tcp://...] [--host H] [--port P]
                    [--redis URL]
                                      the OpenAI-compatible gateway over N worker subprocesses

Heavy modules (torch, the engine) are imported inside the commands, so ``agentgate --help`` and
the gateway process stay light.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

DEMO_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class CliError(Exception):
    """A user-facing error: printed as ``agentgate: error: ...`` with exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    # NOTE: `worker` forwards its flags to engine.worker_cli (defined there, parsed there), so they
    # are only known after the engine is imported: collect them as extras.
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "forward_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        return int(args.func(args) or 0)
    except (CliError, ValueError, FileNotFoundError) as e:
        print(f"agentgate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def default_model_dir() -> Path:
    """Where the demo model lives unless ``--model`` says otherwise."""
    return Path.home() / ".cache" / "agentgate" / "demo-model"


def init_demo_model(model_dir: Path, *, force: bool = False) -> Path:
    """Write the demo checkpoint + tokenizer to ``model_dir`` (atomically: temp dir, then rename).

    Raises:
        CliError: ``model_dir`` exists, is not empty and ``force`` is not set.
    """
    from engine.models.checkpoint import DEMO_CONFIG, DEMO_SEED, write_random_checkpoint
    from gateway.tokenizer import write_demo_tokenizer

    if model_dir.exists() and any(model_dir.iterdir()):
        if not force:
            raise CliError(f"{model_dir} exists and is not empty (use --force to overwrite)")
        shutil.rmtree(model_dir)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".agentgate-init-", dir=model_dir.parent))
    try:
        write_random_checkpoint(tmp, DEMO_CONFIG, seed=DEMO_SEED, dtype="float32")
        write_demo_tokenizer(tmp)
        os.replace(tmp, model_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


def ensure_demo_model(model_dir: Path) -> Path:
    if not all((model_dir / f).is_file() for f in DEMO_FILES):
        print(f"agentgate: writing the demo model to {model_dir}", file=sys.stderr)
        init_demo_model(model_dir, force=True)
    return model_dir


def _cmd_model_init(args: argparse.Namespace) -> int:
    out = init_demo_model(Path(args.dir), force=args.force)
    print(f"wrote the demo MiMo-V2 model to {out}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from gateway.tokenizer import Tokenizer

    model_dir = Path(args.model) if args.model else ensure_demo_model(default_model_dir())
    if not (model_dir / "config.json").is_file():
        raise CliError(f"{model_dir}: not a model directory (no config.json)")
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed,
    )
    tokenizer = Tokenizer.from_dir(model_dir)
    if args.chat:
        prompt = tokenizer.encode_chat([{"role": "user", "content": args.text}])
    else:
        prompt = tokenizer.encode(args.text)
    llm = LLM(model_dir, dtype=args.dtype, device=args.device)
    start = time.perf_counter()
    [out] = llm.generate([prompt], params)
    elapsed = time.perf_counter() - start
    print(tokenizer.decode(out.token_ids, skip_special_tokens=True))
    print(
        f"[{len(prompt)} prompt + {len(out.token_ids)} generated tokens in {elapsed:.2f} s, "
        f"finish_reason={out.finish_reason}, model={model_dir}]",
        file=sys.stderr,
    )
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    from engine.worker_cli import main as worker_main

    return worker_main(args.extra, prog="agentgate worker")


def _cmd_serve(args: argparse.Namespace) -> int:
    from gateway.serve import ServeError, serve

    model_dir = Path(args.model) if args.model else ensure_demo_model(default_model_dir())
    num_workers = args.workers if args.workers is not None else (0 if args.worker else 1)
    if num_workers < 0 or not (num_workers or args.worker):
        raise CliError("need --workers >= 1 or at least one --worker endpoint")
    try:
        return serve(model_dir=model_dir, num_workers=num_workers, attach=args.worker,
                     host=args.host, port=args.port, backend=args.backend,
                     redis_url=args.redis)
    except ServeError as e:
        raise CliError(str(e)) from None


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentgate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"agentgate {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="manage model checkpoints")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    init = model_sub.add_parser("init", help="write the built-in demo MiMo-V2 checkpoint")
    init.add_argument("dir", help="output directory")
    init.add_argument("--force", action="store_true", help="overwrite a non-empty directory")
    init.set_defaults(func=_cmd_model_init)

    gen = sub.add_parser("generate", help="print a completion of TEXT")
    gen.add_argument("text", help="prompt text")
    gen.add_argument("--model", help=f"model directory (default: the demo model in "
                                     f"{default_model_dir()}, written on first use)")
    gen.add_argument("--chat", action="store_true", help="wrap TEXT as a user chat message")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="auto", help="float32, bfloat16 or auto (config)")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    gen.set_defaults(func=_cmd_generate)

    worker = sub.add_parser("worker", add_help=False, help="serve one engine over ZeroMQ "
                            "(flags: agentgate worker -h)")
    worker.set_defaults(func=_cmd_worker, forward_args=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible gateway and its workers")
    serve.add_argument("--model", help="model directory (default: the demo model)")
    serve.add_argument("--workers", type=int, default=None,
                       help="worker subprocesses to start (default 1, 0 with --worker)")
    serve.add_argument("--worker", action="append", default=[], metavar="tcp://HOST:PORT",
                       help="attach to a worker started elsewhere (repeatable)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--backend", choices=("native", "sim"), default="native",
                       help="backend of the spawned workers")
    serve.add_argument("--redis", metavar="URL", default=None,
                       help="keep sessions in Redis (redis://host:port/db; default: in memory)")
    serve.set_defaults(func=_cmd_serve)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentgate")
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
