"""CURVE on the worker's sockets (``--curve-keys``, ``engine.worker.curve``), over real ZeroMQ on
127.0.0.1: an authorized client is served while a plain client and one with an unknown key pair
get nothing (and the worker goes on serving); the KV event PUB and the replay ROUTER refuse them
too; a worker on a non-loopback address without keys refuses to start unless
``--insecure-no-curve``; the ZAP handler's thread ends with the worker."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zmq

from engine.config import EngineConfig
from engine.protocol import PROTOCOL_VERSION, Hello, Welcome
from engine.worker.curve import (
    CurveClientKeys,
    CurveKeyError,
    is_loopback_endpoint,
    load_client_keys,
    load_server_keys,
    write_keys,
)
from engine.worker.events import request_replay
from engine.worker.server import Worker, WorkerConfig
from gateway.serve import WorkerProcess, spawn_worker
from tests.engine.worker_harness import (
    ANY_PORT,
    ROOT,
    START_TIMEOUT_S,
    Client,
    Subscription,
    assert_finished,
    make_prompt,
    running,
)

REFUSED_WAIT_S = 1.0  # NOTE: a refused client gets nothing at all: how long we watch it
RUN_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def keys(curve_key_dir: Path) -> CurveClientKeys:
    return load_client_keys(curve_key_dir)


@pytest.fixture
def stranger(keys: CurveClientKeys) -> CurveClientKeys:
    """A valid CURVE key pair that nobody authorized (it knows the server's public key)."""
    public, secret = zmq.curve_keypair()
    return CurveClientKeys(public=public, secret=secret, server_public=keys.server_public)


def test_only_the_authorized_client_is_served(
    curve_worker: WorkerProcess, keys: CurveClientKeys, stranger: CurveClientKeys
) -> None:
    good, plain, unknown = (Client(curve_worker.listen, curve) for curve in (keys, None, stranger))
    try:
        for client in (plain, unknown, good):
            client.send(_hello())
        assert isinstance(good.recv(), Welcome)
        plain.assert_silent(REFUSED_WAIT_S)
        unknown.assert_silent(REFUSED_WAIT_S)
        good.generate("r1", make_prompt(20), max_new_tokens=3)
        assert_finished(good.collect("r1")[1], "length", 3)
    finally:
        for client in (good, plain, unknown):
            client.close()
    refusals = [line for line in curve_worker.stderr if "refused a CURVE client" in line]
    assert any(stranger.public.decode() in line for line in refusals), refusals


def test_kv_events_reach_only_the_authorized_subscriber(
    curve_worker: WorkerProcess, keys: CurveClientKeys, stranger: CurveClientKeys
) -> None:
    refused = [_raw_sub(curve_worker.events, curve) for curve in (None, stranger)]
    good = Subscription(curve_worker.events, keys)  # NOTE: waits for a load report
    client = Client(curve_worker.listen, keys)
    try:
        client.generate("kv", make_prompt(40), max_new_tokens=2)
        assert_finished(client.collect("kv")[1], "length", 2)
        good.wait_for(lambda: bool(good.kv), "a KV event")
        good.loads.clear()
        good.wait_for(lambda: bool(good.loads), "a later load report")
        for sock in refused:
            assert not sock.poll(int(REFUSED_WAIT_S * 1000)), "an unauthorized SUB got events"
    finally:
        client.close()
        good.close()
        for sock in refused:
            sock.close(linger=0)


def test_replay_answers_only_the_authorized_client(
    curve_worker: WorkerProcess, keys: CurveClientKeys, stranger: CurveClientKeys
) -> None:
    client = Client(curve_worker.listen, keys)
    try:
        client.send(_hello())
        welcome = client.recv()
        client.generate("replayed", make_prompt(40), max_new_tokens=2)
        assert_finished(client.collect("replayed")[1], "length", 2)
    finally:
        client.close()
    assert isinstance(welcome, Welcome) and welcome.replay_endpoint is not None
    ctx = zmq.Context.instance()
    assert request_replay(ctx, welcome.replay_endpoint, 0, RUN_TIMEOUT_S, curve=keys)
    for curve in (None, stranger):
        with pytest.raises(TimeoutError):
            request_replay(ctx, welcome.replay_endpoint, 0, REFUSED_WAIT_S, curve=curve)


def test_non_loopback_worker_without_keys_refuses_to_start() -> None:
    cmd = [sys.executable, "-m", "engine.worker", "--backend", "sim",
           "--listen", "tcp://0.0.0.0:0", "--events", ANY_PORT]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 2, done.stderr
    for hint in ("--listen tcp://0.0.0.0:0", "agentgate keys DIR", "--curve-keys DIR",
                 "--insecure-no-curve"):
        assert hint in done.stderr, f"{hint!r} not in:\n{done.stderr}"


@pytest.mark.parametrize("field", ["listen", "events", "replay"])
def test_config_refuses_any_exposed_endpoint_without_keys(field: str) -> None:
    endpoints = {"listen": ANY_PORT, "events": ANY_PORT, "replay": ANY_PORT}
    endpoints[field] = "tcp://*:0"
    with pytest.raises(ValueError, match=f"--{field} tcp://\\*:0"):
        WorkerConfig(**endpoints)
    WorkerConfig(**endpoints, insecure_no_curve=True)
    WorkerConfig(**endpoints, curve_keys="/some/dir")


def test_insecure_no_curve_starts_with_a_warning() -> None:
    worker = spawn_worker(model_dir=None, backend="sim", listen="tcp://0.0.0.0:0",
                          extra_args=["--insecure-no-curve", "--cost", "zero"],
                          timeout_s=START_TIMEOUT_S)
    with running(worker):
        port = worker.listen.rsplit(":", 1)[1]
        client = Client(f"tcp://127.0.0.1:{port}")
        try:
            client.send(_hello())
            assert isinstance(client.recv(), Welcome)
        finally:
            client.close()
        log = "".join(worker.stderr)
        assert "WARNING" in log and "--insecure-no-curve" in log, log


def test_worker_with_missing_keys_refuses_to_start(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "engine.worker", "--backend", "sim", "--listen", ANY_PORT,
           "--events", ANY_PORT, "--curve-keys", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 2 and "server.key_secret" in done.stderr, done.stderr


def test_zap_thread_ends_with_the_worker(curve_key_dir: Path, keys: CurveClientKeys) -> None:
    context = zmq.Context()  # NOTE: one ZAP handler per context: not the shared instance
    before = set(threading.enumerate())
    cfg = WorkerConfig(listen=ANY_PORT, events=ANY_PORT, cost="zero", curve_keys=str(curve_key_dir))
    worker = Worker(cfg, EngineConfig(backend="sim"), context=context)
    thread = threading.Thread(target=worker.serve, daemon=True)
    thread.start()
    client = Client(worker.listen_endpoint, keys)
    try:
        client.send(_hello())
        assert isinstance(client.recv(), Welcome)
    finally:
        client.close()
        worker.stop()
        thread.join(timeout=5)
        worker.close()
        context.term()
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not left, f"threads left after close(): {left}"


def test_keys_load_as_each_side_needs_them(tmp_path: Path) -> None:
    write_keys(tmp_path)
    server, client = load_server_keys(tmp_path), load_client_keys(tmp_path)
    assert server.clients == {client.public}, "server.key must not authorize itself"
    assert client.server_public == server.public
    assert server.secret.decode() not in repr(server) and client.secret.decode() not in repr(client)
    (tmp_path / "client.key").unlink()
    with pytest.raises(CurveKeyError, match="no client public key"):
        load_server_keys(tmp_path)


@pytest.mark.parametrize(("endpoint", "loopback"), [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.3.2.1:0", True), ("tcp://[::1]:5555", True),
    ("tcp://localhost:5555", True), ("ipc:///tmp/w.sock", True), ("inproc://w", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://[::]:5555", False),
    ("tcp://10.0.0.7:5555", False), ("tcp://eth0:5555", False), ("tcp://example.com:1", False),
])
def test_loopback_endpoints(endpoint: str, loopback: bool) -> None:
    assert is_loopback_endpoint(endpoint) is loopback, endpoint


def _hello() -> Hello:
    return Hello(version=PROTOCOL_VERSION, client_id="curve-test")


def _raw_sub(endpoint: str, curve: CurveClientKeys | None) -> zmq.Socket[bytes]:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    if curve is not None:
        curve.apply(sock)
    sock.connect(endpoint)
    return sock

