"""``agentgate serve --gateway-procs N``: N gateway processes on one port, over the same workers.

A Python gateway is one core. The ``agentgate serve`` process runs gateway 0 itself and spawns
gateways 1..N-1 as ``python -m gateway.procs`` children; each binds the port with
``SO_REUSEPORT``, so the kernel spreads new connections over them (a connection, and so a
keep-alive client, stays on one process). What each process keeps:

    | state                          | where                                              |
    |--------------------------------|----------------------------------------------------|
    | sessions, their affinity       | the session store: Redis, required when N > 1      |
    | the router's KV index          | each process, built from the same worker events    |
    | prompt cache, in-flight counts | each process (a keep-alive client stays on one)    |
    | /metrics                       | the process that accepted the scrape's connection; |
    |                                | ``agentgate_gateway_process{index}`` names it      |

The children are the parent's: they get their config on stdin (pickled ``GatewayConfig`` and
``HttpLimits``), stop when the parent dies (``PR_SET_PDEATHSIG``, and a ppid poll), run in their
own session (a terminal's Ctrl-C reaches the parent, which stops them: SIGTERM, so they drain),
and are restarted by a ``Supervisor`` when one exits.
"""

import argparse
import logging
import os
import pickle
import re
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from gateway.worker_process import START_TIMEOUT_S, WorkerProcess, spawn_child

logger = logging.getLogger("gateway.procs")
START_LINE = re.compile(r"gateway process (\d+) serving on (\S+)")


def spawn_gateway_proc(index: int, cfg: Any, limits: Any, num_processes: int,
                       cancel: threading.Event | None = None) -> WorkerProcess:
    """Start gateway process ``index`` (>= 1 of ``num_processes``) with ``cfg`` (a
    ``GatewayConfig``) and ``limits`` and wait for it to serve. Spawn it from a thread that
    outlives it (see ``engine.worker.cli._die_with_parent``).

    Raises:
        ServeError: it exited or did not start in time (its stderr in the message).
    """
    cmd = [sys.executable, "-m", "gateway.procs", "--index", str(index),
           "--parent-pid", str(os.getpid())]
    proc, m, lines = spawn_child(cmd, START_LINE, START_TIMEOUT_S, cancel, new_session=True,
                                 stdin=pickle.dumps((cfg, limits, num_processes)),
                                 what=f"gateway process {index}")
    return WorkerProcess(proc, f"gateway-{index}", m[2], "", lines)


class ProcessInfo:
    """``agentgate_gateway_process{index, processes}`` 1: which process answered a scrape."""

    def __init__(self, index: int, num_processes: int) -> None:
        self.index, self.num_processes = index, num_processes

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "agentgate_gateway_process", "The gateway process that answered this scrape "
            "(agentgate serve --gateway-procs)", labels=["index", "processes"])
        family.add_metric([str(self.index), str(self.num_processes)], 1)
        yield family


def main(argv: list[str] | None = None) -> int:
    from engine.logs import configure_logging
    from engine.worker.cli import _die_with_parent, watch_parent
    from gateway.serve import run_gateway

    parser = argparse.ArgumentParser(prog="python -m gateway.procs", description=__doc__)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    configure_logging(f"gateway {args.index}")
    _die_with_parent()
    if os.getppid() != args.parent_pid:  # NOTE: the parent died before prctl took effect
        return 0
    watch_parent(args.parent_pid, lambda: os.kill(os.getpid(), signal.SIGTERM))
    cfg, limits, num_processes = pickle.load(sys.stdin.buffer)
    return run_gateway(cfg, limits, reuse_port=True, process_index=args.index,
                       num_processes=num_processes,
                       on_started=lambda app: logger.info(
                           "gateway process %d serving on http://%s:%d", args.index, cfg.host,
                           cfg.port))


if __name__ == "__main__":
    sys.exit(main())
