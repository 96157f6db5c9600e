"""``agentgate serve``: bind the gateway's port, start worker subprocesses
(``python -m engine.worker``) on free ports and keep them running (``gateway.supervisor``), and
run the gateway app on the HTTP server of ``gateway.http_server`` until SIGINT or SIGTERM; then
drain, stop the workers and return. With ``gateway_procs`` > 1, more gateway processes serve the
same port (``gateway.procs``).

The workers die with this process even when it is SIGKILLed (``--parent-pid``). The gateway
process never imports torch: the engine only runs in the worker subprocesses.
"""

import errno
import ipaddress
import logging
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.logs import configure_logging
from gateway.http_server import END_GRACE_S, HttpLimits
from gateway.supervisor import Supervisor, stop_workers
from gateway.worker_process import (
    ANY_PORT,
    START_LINE,
    START_TIMEOUT_S,
    ServeError,
    WorkerProcess,
    echo_worker_logs,
    spawn_child,
    spawn_worker,
)

# NOTE: SGLang loads weights, captures CUDA graphs and profiles memory before it serves
SGLANG_START_TIMEOUT_S = 900.0
ENCODER_START_LINE = re.compile(r"encoder listening on (\S+)")

__all__ = ["ANY_PORT", "START_LINE", "START_TIMEOUT_S", "ServeError", "WorkerProcess", "serve",
           "spawn_worker"]

logger = logging.getLogger("gateway.serve")


def serve(
    *,
    model_dir: Path,
    num_workers: int,
    attach: Sequence[str],
    host: str,
    port: int,
    backend: str,
    redis_url: str | None = None,
    worker_args: Sequence[str] = (),
    limits: HttpLimits | None = None,
    gateway_options: Mapping[str, Any] | None = None,
    gateway_procs: int = 1,
    encoder_args: Sequence[str] | None = None,
) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit status.

    Args:
        num_workers: workers to spawn (may be 0 when ``attach`` names workers started elsewhere).
        redis_url: the session store (checked first: an unreachable Redis is a ``ServeError``);
            None keeps sessions in memory.
        worker_args: extra flags for every spawned worker (``engine.worker.cli.engine_argv``).
        limits: the HTTP server's timeouts, connection cap and drain timeout.
        gateway_options: more ``GatewayConfig`` fields (timeouts, model names, CORS, secret).
        gateway_procs: gateway processes on the port (``gateway.procs``); more than one needs
            ``redis_url``.
        encoder_args: start an encoder service (``python -m encoders``, supervised like the
            workers) with these extra flags; the gateway and every worker get its endpoint
            (``encoders`` and ``--encoder``). None: no encoder is started.

    Raises:
        ServeError: no ASGI server, Redis unreachable or missing for several processes, the
            port taken, a worker or a gateway process did not start.
    """
    from gateway.app import GatewayConfig

    if gateway_procs < 1:
        raise ServeError(f"--gateway-procs {gateway_procs}: must be >= 1")
    if gateway_procs > 1 and redis_url is None:
        raise ServeError(f"--gateway-procs {gateway_procs} needs --redis: with several gateway "
                         "processes, sessions must live in a store every process reads")
    configure_logging("gateway")
    if not (gateway_options or {}).get("api_keys") and not is_loopback(host):
        logger.warning("listening on %s without API keys: anyone who reaches this port can use "
                       "the workers and every tenant's sessions (--api-keys FILE)", host)
    if redis_url is not None:
        _check_redis(redis_url)
    limits = limits or HttpLimits()
    sock = bind_socket(host, port, reuse_port=gateway_procs > 1)
    # NOTE: while workers start; both explicitly, as uvicorn does once serving: Python leaves
    # SIGINT ignored when it started ignored (a shell's background job, nohup)
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    echo_worker_logs()
    workers: list[WorkerProcess] = []
    supervisor: Supervisor | None = None
    gateways: Supervisor | None = None
    encoder: Supervisor | None = None
    try:
        if encoder_args is not None:
            encoder = _start_encoder(model_dir, encoder_args)
            endpoint = encoder.workers[0].listen
            worker_args = [*worker_args, "--encoder", endpoint]
            gateway_options = {**(gateway_options or {}), "encoders": (
                *(gateway_options or {}).get("encoders", ()), endpoint)}
        spawn = _spawner(model_dir, backend, worker_args)
        for i in range(num_workers):
            workers.append(spawn(f"w{i}", ANY_PORT, ANY_PORT, threading.Event()))
        supervisor = Supervisor(workers, spawn)
        supervisor.start()
        endpoints = (*attach, *(w.listen for w in workers))
        cfg = GatewayConfig(model_dir=model_dir, workers=endpoints, host=host, port=port,
                            redis_url=redis_url, **(gateway_options or {}))
        if gateway_procs > 1:
            gateways = _start_gateway_procs(cfg, limits, gateway_procs)
        url = f"http://{host}:{port}/v1"
        run_gateway(cfg, limits, sock=sock, num_processes=gateway_procs,
                    on_started=lambda app: _on_started(app, supervisor, url, len(endpoints),
                                                       gateway_procs),
                    on_exit=None if gateways is None else gateways.halt)
    finally:
        if gateways is not None:
            gateways.stop(limits.drain_timeout_s + END_GRACE_S + 2.0)
        if supervisor is not None:
            supervisor.stop()
        stop_workers(workers)
        if encoder is not None:
            encoder.stop()
            stop_workers(encoder.workers)
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def run_gateway(
    cfg: Any,
    limits: HttpLimits,
    *,
    sock: socket.socket | None = None,
    reuse_port: bool = False,
    process_index: int = 0,
    num_processes: int = 1,
    on_started: Callable[[Any], None] = lambda app: None,
    on_exit: Callable[[], None] | None = None,
) -> int:
    """Run the gateway app for ``cfg`` (a ``GatewayConfig``) on ``sock`` (bound here when None,
    with ``SO_REUSEPORT`` when ``reuse_port``) until SIGINT/SIGTERM; ``on_started(app)`` once it
    serves, ``on_exit()`` when the signal comes (before the drain)."""
    try:
        from gateway.http_server import make_server
    except ImportError:
        raise ServeError("no ASGI server installed: pip install uvicorn httptools") from None
    from gateway.app import create_app
    from gateway.procs import ProcessInfo

    own = sock is None
    sock = bind_socket(cfg.host, cfg.port, reuse_port=reuse_port) if sock is None else sock
    try:
        app = create_app(cfg)
        _adopt_library_loggers()  # NOTE: after create_app, which installs Litestar's logging

        def started() -> None:
            if (metrics := app.state.get("metrics")) is not None:
                metrics.registry.register(ProcessInfo(process_index, num_processes))
            on_started(app)

        server = make_server(app, host=cfg.host, limits=limits, on_started=started,
                             on_drain_timeout=lambda: _end_in_flight(app),
                             on_exit=on_exit or (lambda: None))
        server.run(sockets=[sock])
    finally:
        if own:
            sock.close()
    return 0


def _start_gateway_procs(cfg: Any, limits: HttpLimits, num: int) -> Supervisor:
    """Gateway processes 1..num-1 (``gateway.procs``), supervised; stopped if one fails."""
    from gateway.procs import spawn_gateway_proc

    def spawn(worker_id: str, listen: str, events: str, cancel: threading.Event
              ) -> WorkerProcess:
        return spawn_gateway_proc(int(worker_id.rsplit("-", 1)[1]), cfg, limits, num, cancel)

    procs: list[WorkerProcess] = []
    try:
        for i in range(1, num):
            procs.append(spawn(f"gateway-{i}", "", "", threading.Event()))
    except BaseException:
        stop_workers(procs)
        raise
    gateways = Supervisor(procs, spawn, kind="gateway process")
    gateways.start()
    return gateways


def _start_encoder(model_dir: Path, extra_args: Sequence[str]) -> Supervisor:
    """One encoder service on a free loopback port, restarted on the same port if it dies; it
    stops when this process dies (``--parent-pid``). NOTE: a process of its own rather than
    threads in the gateway: the gateway process never imports torch, and a tower's forward
    would hold the GIL the event loop needs."""

    def spawn(worker_id: str, listen: str, events: str, cancel: threading.Event
              ) -> WorkerProcess:
        cmd = [sys.executable, "-m", "encoders", "--model", str(model_dir), "--listen", listen,
               "--parent-pid", str(os.getpid()), *extra_args]
        proc, m, lines = spawn_child(cmd, ENCODER_START_LINE, START_TIMEOUT_S, cancel,
                                     new_session=True, what="encoder")
        return WorkerProcess(proc, worker_id, m[1], "", lines)

    first = spawn("encoder", ANY_PORT, "", threading.Event())
    encoder = Supervisor([first], spawn, kind="encoder")
    encoder.start()
    return encoder


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The gateway's listening socket, bound (not yet listening) before any worker starts, so a
    taken port fails fast and nobody takes it meanwhile. ``reuse_port``: ``SO_REUSEPORT``, so
    the other gateway processes bind the same port (the kernel spreads connections over them).

    Raises:
        ServeError: the address is in use or cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hint = " (another server listens there; pick another --port)" if (
            e.errno == errno.EADDRINUSE) else ""
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    return sock


def _spawner(model_dir: Path, backend: str, worker_args: Sequence[str]) -> Any:
    def spawn(worker_id: str, listen: str, events: str, cancel: threading.Event
              ) -> WorkerProcess:
        # NOTE: a replay socket lets the router's index fill a gap in the KV events; a
        # restarted worker binds a new free port and announces it in its Welcome
        return spawn_worker(model_dir=model_dir, backend=backend, worker_id=worker_id,
                            extra_args=worker_args, listen=listen, events=events,
                            die_with_parent=True, cancel=cancel, replay=ANY_PORT,
                            timeout_s=SGLANG_START_TIMEOUT_S if backend == "sglang" else (
                                START_TIMEOUT_S))

    return spawn


def _on_started(app: Any, supervisor: Supervisor, url: str, num_workers: int,
                num_procs: int) -> None:
    metrics = app.state.get("metrics")
    if metrics is not None:
        metrics.registry.register(supervisor)
    logger.info("gateway on %s over %d worker(s)%s", url, num_workers,
                f", {num_procs} gateway processes" if num_procs > 1 else "")


def _end_in_flight(app: Any) -> None:
    """The drain timeout passed: fail every request still waiting on a worker, so each ends with
    the usual error (an SSE error event, a 5xx JSON) instead of a cut connection."""
    dispatcher = app.state.get("dispatcher")
    if dispatcher is None:
        return
    logger.warning("drain timeout: ending the requests still in flight")
    for client in dispatcher.clients:
        client.close()


def _adopt_library_loggers() -> None:
    """Make Litestar's logger write through the root handler (``engine.logs``' format)."""
    for name in ("litestar",):
        lib_logger = logging.getLogger(name)
        lib_logger.handlers.clear()
        lib_logger.propagate = True
    configure_logging("gateway")


class Terminated(KeyboardInterrupt):
    """SIGTERM while ``serve`` starts its workers: everything is stopped as for Ctrl-C, and the
    exit status is 0, as it is for a SIGTERM once serving (a supervisor's normal stop)."""


def _interrupt(signum: int, frame: Any) -> None:
    if signum == signal.SIGTERM:
        raise Terminated(f"signal {signum}")
    raise KeyboardInterrupt(f"signal {signum}")


def _check_redis(url: str) -> None:
    import asyncio

    from sessions import StoreUnavailable
    from sessions.redis import connect_redis

    async def ping() -> None:
        store = await connect_redis(url)
        await store.close()

    try:
        asyncio.run(ping())
    except StoreUnavailable as e:
        raise ServeError(f"--redis: {e}") from None
