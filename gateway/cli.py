"""The ``agentgate`` command line.

    agentgate model init DIR          write the built-in demo MiMo-V2 checkpoint (deterministic)
    agentgate generate [--model DIR] TEXT
                                      print a completion (the demo model by default)
    agentgate worker --listen tcp://HOST:PORT --events tcp://HOST:PORT [--model DIR] ...
                                      serve one engine over ZeroMQ (``agentgate worker -h``)
    agentgate replay TRACE.jsonl | --synthetic agent [--policies ...] [--json OUT] [--plots DIR]
                                      replay a trace through the routing policies on in-process
                                      sim workers, virtual time (``agentgate replay -h``)
    agentgate encoder --listen tcp://HOST:PORT [--model DIR] [--redis URL] ...
                                      serve the image/video encoder over ZeroMQ, with the shared
                                      embedding cache (``agentgate encoder -h``)
    agentgate keys DIR [--force]      write CURVE key pairs for the workers' ZeroMQ sockets (the
                                      workers' and the gateways'; ``--curve-keys DIR``)
    agentgate serve [--model DIR] [--workers N] [--worker tcp://...] [--host H] [--port P]
                    [--redis URL] [--gateway-procs N] [--router NAME] [...]   (agentgate serve -h)
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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

DEMO_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "vision_tower.safetensors")


class CliError(Exception):
    """A user-facing error: printed as ``agentgate: error: ...`` with exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    # NOTE: `worker` forwards its flags to engine.worker.cli (defined there, parsed there), so they
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
    except KeyboardInterrupt as e:
        from gateway.serve import Terminated

        return 0 if isinstance(e, Terminated) else 130


def default_model_dir() -> Path:
    """Where the demo model lives unless ``--model`` says otherwise."""
    return Path.home() / ".cache" / "agentgate" / "demo-model"


def init_demo_model(model_dir: Path, *, force: bool = False) -> Path:
    """Write the demo checkpoint + tokenizer to ``model_dir`` (atomically: temp dir, then rename).

    Raises:
        CliError: ``model_dir`` exists, is not empty and ``force`` is not set.
    """
    from encoders.vision import init_tower, save_tower
    from encoders.vision_config import demo_vision_config
    from engine.models.checkpoint import DEMO_CONFIG, DEMO_SEED, write_random_checkpoint
    from engine.models.mtp_distill import distill_mtp
    from gateway.tokenizer import write_demo_tokenizer

    if model_dir.exists() and any(model_dir.iterdir()):
        if not force:
            raise CliError(f"{model_dir} exists and is not empty (use --force to overwrite)")
        shutil.rmtree(model_dir)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".agentgate-init-", dir=model_dir.parent))
    try:
        write_random_checkpoint(tmp, DEMO_CONFIG, seed=DEMO_SEED, dtype="float32")
        # NOTE: MTP layers that predict the base model, so drafts get accepted (issue 14)
        _distilled(tmp, lambda: distill_mtp(tmp, seed=DEMO_SEED))
        write_demo_tokenizer(tmp)
        # NOTE: a small random vision tower (16 tokens per 64x64 image), so the embedded
        # default takes images (issue 13)
        vision = demo_vision_config(out_hidden_size=DEMO_CONFIG["hidden_size"])
        save_tower(init_tower(vision, seed=DEMO_SEED), tmp, config=vision)
        os.replace(tmp, model_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


# NOTE: bump when the distillation or the demo checkpoint changes (the cache key's salt)
_DISTILL_VERSION = "mtp-distill-2"


def _distilled(model_dir: Path, distill: Callable[[], object]) -> None:
    """Run ``distill`` on ``model_dir``'s safetensors, or copy its earlier result.

    Distillation is deterministic (seeded, one thread) and takes ~20 s, so its output files are
    kept under ``~/.cache/agentgate/mtp-distill/<digest of the input files>`` (or
    ``$AGENTGATE_MTP_CACHE/<digest>``); a cache that cannot be written is skipped.
    """
    import hashlib

    files = sorted(model_dir.glob("*.safetensors"))
    digest = hashlib.sha256(_DISTILL_VERSION.encode())
    for f in files:
        digest.update(f.name.encode() + f.read_bytes())
    root = os.environ.get("AGENTGATE_MTP_CACHE") or Path.home() / ".cache" / "agentgate" / (
        "mtp-distill")
    cached = Path(root) / digest.hexdigest()[:32]
    if all((cached / f.name).is_file() for f in files):
        for f in files:
            shutil.copyfile(cached / f.name, f)
        return
    distill()
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cached.parent))
    except OSError:
        return
    try:
        for f in files:
            shutil.copyfile(f, tmp / f.name)
        os.replace(tmp, cached)  # NOTE: atomic; fails if another process got there first
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
    from engine.worker.cli import main as worker_main

    return worker_main(args.extra, prog="agentgate worker")


def _cmd_encoder(args: argparse.Namespace) -> int:
    from encoders.__main__ import main as encoder_main

    return encoder_main(args.extra, prog="agentgate encoder")


def _cmd_keys(args: argparse.Namespace) -> int:
    from engine.worker.curve import write_keys

    key_dir = Path(args.dir)
    for path in write_keys(key_dir, force=args.force):
        print(f"wrote {path}")  # NOTE: paths only, never a key
    print(f"workers: agentgate worker --curve-keys {key_dir} ... (needs server.key_secret and "
          f"the gateways' *.key); gateways: agentgate serve --curve-keys {key_dir} (needs "
          "client.key_secret and server.key). Keep the *.key_secret files private.")
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from replay.cli import main as replay_main

    return replay_main(args.extra)


def _cmd_serve(args: argparse.Namespace) -> int:
    from gateway.serve import ServeError, serve

    try:
        return serve(**serve_kwargs(args))
    except ServeError as e:
        raise CliError(str(e)) from None


def serve_kwargs(args: argparse.Namespace, env: Mapping[str, str] | None = None
                 ) -> dict[str, Any]:
    """``gateway.serve.serve``'s arguments from ``agentgate serve``'s flags and ``env`` (the
    process environment by default: the one place the gateway's variables are read)."""
    from engine.worker.cli import default_gcache_dir, engine_argv
    from engine.worker.curve import load_client_keys
    from gateway.api_keys import load_api_keys
    from gateway.http_server import HttpLimits
    from gateway.tenant_secret import default_secret_path, load_tenant_secret

    env = os.environ if env is None else env
    model_dir = Path(args.model) if args.model else ensure_demo_model(default_model_dir())
    num_workers = args.workers if args.workers is not None else (0 if args.worker else 1)
    if num_workers < 0 or not (num_workers or args.worker):
        raise CliError("need --workers >= 1 or at least one --worker endpoint")
    secret_path = (Path(args.tenant_secret_file) if args.tenant_secret_file
                   else default_secret_path(env.get("XDG_CONFIG_HOME")))
    keys_path = args.api_keys or env.get("AGENTGATE_API_KEYS")
    api_keys = load_api_keys(Path(keys_path)) if keys_path else None
    # NOTE: the gateway's CURVE keys are loaded (and checked) here; the spawned workers get the
    # directory, absolute, and load their own side of it
    curve_dir = Path(args.curve_keys).resolve() if args.curve_keys else None
    curve_options = {"curve_keys": load_client_keys(curve_dir)} if curve_dir else {}
    worker_curve = ["--curve-keys", str(curve_dir)] if curve_dir else []
    encoders, encoder_args = _encoders(args, model_dir, env)
    return {
        "encoder_args": encoder_args,
        "model_dir": model_dir, "num_workers": num_workers, "attach": args.worker,
        "host": args.host, "port": args.port, "backend": args.backend, "redis_url": args.redis,
        "gateway_procs": args.gateway_procs,
        "worker_args": [*engine_argv(args), *worker_curve, *(
            # NOTE: the embedded default (DESIGN.md): the workers serve spawns share a file
            # GCache unless a flag or AGENTGATE_GCACHE (which they inherit) says otherwise
            ["--gcache", f"file:{default_gcache_dir()}"]
            if args.gcache is None and not env.get("AGENTGATE_GCACHE") else []),
            *(arg for endpoint in encoders for arg in ("--encoder", endpoint)),
            *(["--embed-redis", args.embed_redis] if args.embed_redis and (
                encoders or encoder_args is not None) else [])],
        "limits": HttpLimits(
            header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
            max_connections=args.max_connections, drain_timeout_s=args.drain_timeout,
            keep_alive_timeout_s=args.keep_alive_timeout),
        "gateway_options": {
            "first_token_timeout_s": args.first_token_timeout,
            "idle_timeout_s": args.idle_timeout,
            "migration_limit": args.migration_limit,
            "served_model_names": tuple(args.served_model_name),
            "cors_origins": tuple(args.cors_origin),
            "tenant_secret": load_tenant_secret(secret_path, env.get("AGENTGATE_TENANT_SECRET")),
            "router": args.router,
            "index_max_pages": args.index_max_pages,
            "admission": args.admission,
            "admission_config": _admission_config(args, api_keys),
            "api_keys": api_keys,
            "retain_ttl_s": args.retain_ttl,
            "encoders": encoders,
            "allow_media_urls": args.allow_media_urls,
            "media_url_allowlist": tuple(args.media_url_allow),
            "max_images_per_request": args.max_images_per_request,
            **curve_options,
        },
    }


def _encoders(args: argparse.Namespace, model_dir: Path, env: Mapping[str, str]
              ) -> tuple[tuple[str, ...], list[str] | None]:
    """(the encoder endpoints the gateway attaches to, the flags of the encoder ``serve``
    starts or None). The embedded default: a model with a vision tower gets one encoder
    process; ``--encoder tcp://...`` attaches to ones started elsewhere (``agentgate encoder``)
    and starts none; ``--encoder off`` or ``AGENTGATE_ENCODER=off``: no media."""
    from encoders.vision_config import read_vision_config

    specs = list(args.encoder) or [env.get("AGENTGATE_ENCODER", "")]
    if any(spec.lower() in ("off", "none") for spec in specs):
        return (), None
    attach = tuple(spec for spec in specs if spec)
    if attach:
        return attach, None
    try:
        has_tower = read_vision_config(model_dir) is not None
    except (FileNotFoundError, ValueError):
        has_tower = False
    if not has_tower:
        return (), None
    extra = ["--cache-mb", str(args.encoder_cache_mb)]
    if args.embed_redis:
        extra += ["--redis", args.embed_redis]
    return (), extra


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

    encoder = sub.add_parser("encoder", add_help=False, help="serve the image and video "
                             "encoder over ZeroMQ (flags: agentgate encoder -h)")
    encoder.set_defaults(func=_cmd_encoder, forward_args=True)

    replay = sub.add_parser("replay", add_help=False, help="replay a trace through the routing "
                            "policies on in-process sim workers (flags: agentgate replay -h)")
    replay.set_defaults(func=_cmd_replay, forward_args=True)

    keys = sub.add_parser("keys", help="write CURVE key pairs that authenticate the gateways to "
                                       "the workers (--curve-keys DIR)")
    keys.add_argument("dir", help="key directory (created 0700): server.key, server.key_secret "
                                  "(the workers'), client.key, client.key_secret (the gateways')")
    keys.add_argument("--force", action="store_true", help="replace existing keys")
    keys.set_defaults(func=_cmd_keys)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible gateway and its workers",
                           formatter_class=_DefaultsFormatter)
    _add_serve_arguments(serve)
    serve.set_defaults(func=_cmd_serve)
    return parser


def _add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    from engine.worker.cli import BACKENDS, add_engine_arguments

    add = serve.add_argument
    add("--model", help="model directory (default: the demo model)")
    add("--workers", type=int, default=None,
        help="worker subprocesses to start (default 1, 0 with --worker)")
    add("--worker", action="append", default=[], metavar="tcp://HOST:PORT",
        help="attach to a worker started elsewhere (repeatable)")
    add("--host", default="127.0.0.1", help="address to listen on")
    add("--port", type=int, default=8000, help="port to listen on")
    add("--backend", choices=BACKENDS, default="native",
        help="backend of the spawned workers (sglang: SGLang on a GPU, --model required; "
             "README \"Serving with SGLang\")")
    add("--redis", metavar="URL", default=None,
        help="keep sessions in Redis (redis://host:port/db; default: in memory)")
    add("--gateway-procs", type=int, default=1, metavar="N",
        help="gateway processes on the port (SO_REUSEPORT), one core each; more than 1 needs "
             "--redis (default 1)")
    add("--served-model-name", action="append", default=[], metavar="NAME",
        help="a model name clients may ask for (repeatable; the first is the one answered; "
             "default: the model directory's name)")
    add("--cors-origin", action="append", default=[], metavar="ORIGIN",
        help="allow browser requests from ORIGIN (repeatable; default: no CORS)")
    add("--tenant-secret-file", metavar="PATH", default=None,
        help="the per-deployment key of tenant ids, created (0600, random) when missing; "
             "AGENTGATE_TENANT_SECRET overrides it (default: "
             "$XDG_CONFIG_HOME/agentgate/tenant-secret or ~/.config/agentgate/tenant-secret)")
    add("--api-keys", metavar="FILE", default=None,
        help="require an API key on every request: a TOML file mapping keys to tenants, with "
             "each tenant's weight and limits (README: API keys); AGENTGATE_API_KEYS names the "
             "file too (default: open, each bearer key its own tenant)")
    add("--first-token-timeout", type=_positive, default=60.0, metavar="S",
        help="a request whose first token takes longer ends with 504")
    add("--idle-timeout", type=_positive, default=30.0, metavar="S",
        help="a request whose next token takes longer ends with 504")
    add("--curve-keys", metavar="DIR", default=None,
        help="authenticate to the workers with CURVE (`agentgate keys DIR`): the gateway uses "
             "client.key_secret and server.key, and the spawned workers get --curve-keys DIR "
             "(server.key_secret; they accept the *.key files but server.key); workers attached "
             "with --worker must have been started with the same keys (default: none; needed "
             "for workers on a non-loopback address)")
    add("--migration-limit", type=_non_negative_int, default=2, metavar="N",
        help="a stream whose worker is lost after its first token goes on on another worker, "
             "at most N times (0: it ends with an error)")
    _add_routing_arguments(serve.add_argument_group("routing"))
    _add_media_arguments(serve.add_argument_group("images and video"))
    http = serve.add_argument_group("HTTP server")
    http.add_argument("--header-timeout", type=_positive, default=10.0, metavar="S",
                      help="a request head (request line + headers) must arrive within this "
                           "(408, connection closed)")
    http.add_argument("--body-timeout", type=_positive, default=30.0, metavar="S",
                      help="a request body may stall this long between two pieces (408)")
    http.add_argument("--max-connections", type=_positive_int, default=2048, metavar="N",
                      help="connections served at once; requests on more get 503")
    http.add_argument("--keep-alive-timeout", type=_positive, default=5.0, metavar="S",
                      help="an idle keep-alive connection is closed after this long; behind a "
                           "load balancer, set it above the balancer's idle timeout")
    http.add_argument("--drain-timeout", type=_non_negative, default=30.0, metavar="S",
                      help="on SIGINT/SIGTERM, requests in flight may finish for this long; "
                           "then they end with an error")
    add_engine_arguments(serve.add_argument_group(
        "spawned workers", "engine settings passed to every worker that serve starts"))


def _add_media_arguments(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--encoder", action="append", default=[], metavar="tcp://HOST:PORT",
        help="attach to an encoder service started elsewhere (`agentgate encoder`; repeatable; "
             "the gateway spreads work over them) instead of starting one; `off` (or "
             "AGENTGATE_ENCODER=off): take no images (default: one encoder process for a model "
             "with a vision tower)")
    add("--encoder-cache-mb", type=_non_negative_int, default=256, metavar="MIB",
        help="the started encoder's process embedding cache")
    add("--embed-redis", metavar="URL", default=None,
        help="share image embeddings through this Redis (the started encoder and every "
             "spawned worker; default: the encoder's process cache only)")
    add("--allow-media-urls", action="store_true",
        help="fetch http(s) image and video URLs (never loopback, private or link-local "
             "addresses; default: data: URIs only)")
    add("--media-url-allow", action="append", default=[], metavar="HOST",
        help="with --allow-media-urls, only these hosts (example.com, *.example.com; "
             "repeatable; default: any public host)")
    add("--max-images-per-request", type=_positive_int, default=16, metavar="N",
        help="images and video frames in one request; more is a 400")


def _add_routing_arguments(group: argparse._ArgumentGroup) -> None:
    from gateway.routing.index import DEFAULT_MAX_PAGES
    from gateway.routing.registry import ROUTER_NAMES

    group.add_argument("--router", choices=ROUTER_NAMES, default="agentgate",
                       help="the routing policy")
    group.add_argument("--index-max-pages", type=_positive_int, default=DEFAULT_MAX_PAGES,
                       metavar="N", help="bound of the router's KV index, in page entries over "
                                         "all workers (about 170 bytes each)")
    group.add_argument("--no-admission", dest="admission", action="store_false",
                       help="send requests as soon as they are routed (no length buckets, no "
                            "cache-first priority, no admission queue; default: admission on)")
    group.add_argument("--admission-buckets", type=_int_list, default=(2048, 16384, 65536),
                       metavar="T1,T2,..", help="upper bounds of the uncached-prompt-length "
                                                "buckets, in tokens (one more bucket: longer)")
    group.add_argument("--admission-shares", type=_float_list, default=(0.3, 0.3, 0.2, 0.2),
                       metavar="S1,S2,..", help="each bucket's reserved share of a worker's "
                                                "prefill capacity (one per bucket, sum <= 1)")
    group.add_argument("--admission-max-queued", type=_positive_int, default=4096, metavar="N",
                       help="requests waiting for admission, all tenants; past it: 429")
    group.add_argument("--admission-max-queued-per-tenant", type=_positive_int, default=1024,
                       metavar="N", help="requests waiting for admission, per tenant")
    group.add_argument("--tenant-weight", action="append", default=[], type=_tenant_weight,
                       metavar="TENANT=W", help="weighted fair share of a tenant (its id, "
                                                "t-...; repeatable; others weigh 1)")
    group.add_argument("--retain-ttl", type=_non_negative, default=60.0, metavar="S",
                       help="after a turn that ended in tool calls, keep its KV this long "
                            "until the tool pauses are learned; 0: no tool-pause retention")


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` after a flag's help, unless the default is None or empty (then
    the help says what happens) or the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, [], False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _admission_config(args: argparse.Namespace, api_keys: Any = None) -> Any:
    """The admission settings; the tenants of ``api_keys`` (a ``gateway.api_keys.ApiKeys``)
    weigh what its file says unless ``--tenant-weight`` names them too."""
    from gateway.routing.admission import AdmissionConfig

    named = dict(args.tenant_weight)
    weights = [*args.tenant_weight, *((t.name, t.weight) for t in (
        api_keys.tenants if api_keys is not None else ()) if t.name not in named)]
    try:
        return AdmissionConfig(
            bucket_bounds_tokens=args.admission_buckets, bucket_shares=args.admission_shares,
            max_queued=args.admission_max_queued,
            max_queued_per_tenant=args.admission_max_queued_per_tenant,
            tenant_weights=tuple(weights))
    except AssertionError as exc:
        raise CliError(f"--admission-buckets/--admission-shares: {exc}") from None


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers") from None


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated numbers") from None


def _tenant_weight(text: str) -> tuple[str, float]:
    tenant, sep, weight = text.rpartition("=")
    try:
        value = float(weight)
    except ValueError:
        value = -1.0
    if not sep or not tenant or not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: TENANT=WEIGHT with a weight > 0")
    return tenant, value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentgate")
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
