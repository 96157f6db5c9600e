"""The floor under the paced streaming cells of ``bench_gateway.py``: what a process that does
nothing but wait for one small message per engine step spends in CPU per message, on this
machine, measured side by side in one run.

A gateway in front of an engine that steps every ~24 ms (``--cost h200``) sleeps between steps,
and every step's reply wakes it. On a virtual machine a wake from idle is not free: the CPU time
charged to the woken threads can be far above the work they do. This measures that charge for
the receivers a gateway could use, each fed one 60-byte message per ``period`` by another
process, with no work done per message:

* ``zmq blocking``: a thread blocked in ``recv`` on a pyzmq ROUTER (libzmq's IO thread first
  receives the bytes, then wakes it);
* ``zmq uvloop``: the same socket's FD on a uvloop event loop (how ``WorkerClient`` reads);
* ``tcp uvloop``: a plain TCP connection on a uvloop event loop (no IO thread).

Per receiver and period: messages a second, the CPU of the receiving process's threads per
message (``schedstat``), and what that alone would be per streamed chunk at ``--chunks-per-step``
chunks a step (the ``h200`` cell at 16 streams writes ~7: ~2.2 tokens a chunk). A receiver woken
every millisecond is shown beside it: the same work, on a core that has not gone idle.

    python loadtest/bench_wakeups.py [--seconds S] [--periods-ms 24,1] [--chunks-per-step 7]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import uvloop
import zmq

MESSAGE = b"x" * 60
RECEIVERS = ("zmq blocking", "zmq uvloop", "tcp uvloop")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="per receiver and period")
    parser.add_argument("--periods-ms", default="24,1",
                        type=lambda s: [float(x) for x in s.split(",") if x])
    parser.add_argument("--chunks-per-step", type=float, default=7.0)
    parser.add_argument("--feed", nargs=3, help=argparse.SUPPRESS)  # NOTE: kind, port, period
    args = parser.parse_args()
    if args.feed:
        _feed(args.feed[0], int(args.feed[1]), float(args.feed[2]))
        return
    print(f"{'receiver':>13} {'period':>7} | {'msg/s':>6} | {'CPU/msg':>8} | "
          f"{'per chunk at ' + str(args.chunks_per_step) + ' chunks/step':>28}")
    for period_ms in args.periods_ms:
        for receiver in RECEIVERS:
            rate, cpu_us = measure(receiver, period_ms / 1e3, args.seconds)
            print(f"{receiver:>13} {period_ms:5.0f}ms | {rate:6.0f} | {cpu_us:6.0f}us | "
                  f"{cpu_us / args.chunks_per_step:26.1f}us", flush=True)


def measure(receiver: str, period_s: float, seconds: float) -> tuple[float, float]:
    """(messages a second, this process's CPU microseconds a message) for ``receiver``."""
    kind = receiver.split()[0]
    if kind == "zmq":
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
    else:
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]
    feeder = subprocess.Popen([sys.executable, __file__, "--feed", kind, str(port),
                               str(period_s)], start_new_session=True)
    try:
        if kind == "zmq":
            recv = _zmq_blocking(sock) if receiver == "zmq blocking" else _zmq_loop(sock)
        else:
            conn, _ = server.accept()
            recv = _tcp_loop(conn)
        recv(1.0)  # NOTE: warm-up: the connection is up and messages flow
        cpu0, start = _cpu_ns(), time.perf_counter()
        count = recv(seconds)
        elapsed = time.perf_counter() - start
        return count / elapsed, (_cpu_ns() - cpu0) / 1e3 / max(count, 1)
    finally:
        feeder.kill()
        feeder.wait()
        if kind == "zmq":
            sock.close(linger=0)
            ctx.term()
        else:
            server.close()


def _zmq_blocking(sock: zmq.Socket) -> Callable[[float], int]:  # type: ignore[type-arg]
    def recv(seconds: float) -> int:
        count, deadline = 0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            if sock.poll(100):
                sock.recv_multipart()
                count += 1
        return count
    return recv


def _zmq_loop(sock: zmq.Socket) -> Callable[[float], int]:  # type: ignore[type-arg]
    def recv(seconds: float) -> int:
        count = [0]

        async def run() -> None:
            loop = asyncio.get_running_loop()
            fd = sock.getsockopt(zmq.FD)

            def drain() -> None:  # NOTE: as WorkerClient._drain: until EAGAIN, then EVENTS
                while True:
                    try:
                        sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                            return
                        continue
                    count[0] += 1

            loop.add_reader(fd, drain)
            drain()
            await asyncio.sleep(seconds)
            loop.remove_reader(fd)

        uvloop.run(run())
        return count[0]
    return recv


def _tcp_loop(conn: socket.socket) -> Callable[[float], int]:
    conn.setblocking(False)

    def recv(seconds: float) -> int:
        count = [0]

        async def run() -> None:
            loop = asyncio.get_running_loop()

            def drain() -> None:
                try:
                    data = conn.recv(65536)
                except BlockingIOError:
                    return
                count[0] += len(data) // len(MESSAGE)

            loop.add_reader(conn.fileno(), drain)
            await asyncio.sleep(seconds)
            loop.remove_reader(conn.fileno())

        uvloop.run(run())
        return count[0]
    return recv


def _cpu_ns() -> int:
    """This process's CPU so far: its threads' ``schedstat`` run times (libzmq's IO thread
    included)."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError):
            continue  # NOTE: a thread that exited meanwhile
    return total


def _feed(kind: str, port: int, period_s: float) -> None:
    """The feeder: one message every ``period_s`` until killed (by ``measure``)."""
    if kind == "zmq":
        sock = zmq.Context().socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{port}")
        send = sock.send
    else:
        conn = socket.create_connection(("127.0.0.1", port))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send = conn.sendall  # type: ignore[assignment]
    next_s = time.monotonic()
    while True:
        send(MESSAGE)
        next_s += period_s
        time.sleep(max(0.0, next_s - time.monotonic()))


if __name__ == "__main__":
    main()
