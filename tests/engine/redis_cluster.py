"""``redis_cluster``: a real 3-master Redis Cluster on free 127.0.0.1 ports (no replicas, no
persistence) for one test module, always torn down. Every wait is bounded."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

NUM_NODES = 3
START_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class RedisClusterInfo:
    ports: tuple[int, ...]
    procs: tuple[subprocess.Popen[bytes], ...] = field(repr=False, compare=False)

    def kill_node(self, index: int) -> None:
        """SIGKILL one node (its slots are then unserved: there are no replicas)."""
        self.procs[index].kill()
        self.procs[index].wait(timeout=10)

    @property
    def spec(self) -> str:
        """The ``open_store`` spec naming every node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)


@contextlib.contextmanager
def running_cluster(work: Path) -> Iterator[RedisClusterInfo]:
    """Start the nodes, join them into a cluster, wait for ``cluster_state:ok``; kill them all
    when the block ends, however it ends."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        pytest.fail("redis-server / redis-cli are not installed: apt-get install -y redis-server")
    ports = _free_ports(NUM_NODES)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for port in ports:
            procs.append(subprocess.Popen(
                [server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", str(work / f"nodes-{port}.conf"), "--save", "",
                 "--appendonly", "no", "--dir", str(work),
                 "--logfile", str(work / f"redis-{port}.log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            ))
        for port, proc in zip(ports, procs):
            _wait_for(lambda p=port: _ask(cli, p, "PING") == "PONG", proc, f"node {port} PING")
        create = subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=START_TIMEOUT_S,
        )
        out = create.stdout + create.stderr
        assert create.returncode == 0, f"redis-cli --cluster create failed:\n{out}"
        for port, proc in zip(ports, procs):
            _wait_for(lambda p=port: "cluster_state:ok" in _ask(cli, p, "CLUSTER", "INFO"),
                      proc, f"node {port} cluster_state:ok")
        yield RedisClusterInfo(tuple(ports), tuple(procs))
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterInfo]:
    with running_cluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


def _ask(cli: str, port: int, *command: str) -> str:
    try:
        done = subprocess.run([cli, "-p", str(port), *command], capture_output=True, text=True,
                              timeout=2)
    except subprocess.TimeoutExpired:
        return ""
    return done.stdout.strip()


def _wait_for(ready: Callable[[], bool], proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            return
        time.sleep(0.05)
    pytest.fail(f"redis cluster: no {what} within {START_TIMEOUT_S} s (rc={proc.poll()})")


def _free_ports(n: int) -> list[int]:
    # NOTE: a cluster node also listens on port + 10000 (the bus), which must be free too
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 < 65536 and port not in ports and _is_free(port + 10000):
            ports.append(port)
    return ports


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
