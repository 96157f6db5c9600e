"""Keeps the workers ``agentgate serve`` spawned running: a worker that exits is reaped at once
(no zombie), its exit is logged, and it is restarted on the same ``--listen``/``--events``
addresses after a backoff (``restart_delay_s``), so the gateway's ZeroMQ sockets simply
reconnect and the dispatcher sees the new incarnation by its ``Welcome.instance_id``.

One thread watches every worker and spawns the replacements.
NOTE: it must outlive the workers it spawns: a worker's parent-death signal (``PR_SET_PDEATHSIG``)
fires when the *thread* that forked it ends. ``stop`` stops the workers first, then the thread.
"""

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, Metric

from gateway.worker_process import ServeError, WorkerProcess

logger = logging.getLogger(__name__)

RESTART_INITIAL_S = 0.5
RESTART_MAX_S = 30.0
HEALTHY_AFTER_S = 60.0  # NOTE: a worker up this long starts its next backoff from the beginning
POLL_S = 0.1
STOP_TIMEOUT_S = 10.0

# Starts a worker with this id on these endpoints; gives up (ServeError) when the event is set.
SpawnFn = Callable[[str, str, str, threading.Event], WorkerProcess]


def restart_delay_s(previous_s: float | None, uptime_s: float) -> float:
    """The wait before restarting a worker that ran ``uptime_s``: ``RESTART_INITIAL_S`` after its
    first exit or a healthy run (``HEALTHY_AFTER_S``), else twice the previous wait, at most
    ``RESTART_MAX_S``."""
    if previous_s is None or uptime_s >= HEALTHY_AFTER_S:
        return RESTART_INITIAL_S
    return min(previous_s * 2, RESTART_MAX_S)


@dataclass
class _Slot:
    """One supervised worker: the current process, or the time its restart is due."""

    worker: WorkerProcess
    started_at: float
    restarts: int = 0
    delay_s: float | None = None
    restart_at: float | None = None


class Supervisor:
    """Watches ``workers`` (already started) from a thread and restarts those that exit.

    Args:
        spawn: how to start a replacement (see ``SpawnFn``).
    """

    def __init__(self, workers: list[WorkerProcess], spawn: SpawnFn, kind: str = "worker") -> None:
        now = time.monotonic()
        self._slots = [_Slot(w, now) for w in workers]
        self._spawn = spawn
        self.kind = kind  # NOTE: what the log lines call them
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{kind}-supervisor".replace(
            " ", "-"), daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def workers(self) -> list[WorkerProcess]:
        """The current process of every worker (a dead one until its restart)."""
        return [slot.worker for slot in self._slots]

    def restarts(self) -> dict[str, int]:
        """Restarts so far by the worker's listen endpoint."""
        return {slot.worker.listen: slot.restarts for slot in self._slots}

    def halt(self) -> None:
        """Stop restarting and SIGTERM every process, without waiting (``stop`` waits)."""
        self._stopping.set()
        terminate(self.workers)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop restarting, SIGTERM every worker, SIGKILL those still up after ``timeout_s``."""
        self._stopping.set()
        stop_workers(self.workers, timeout_s)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        stop_workers(self.workers, timeout_s)  # NOTE: one the thread spawned meanwhile

    def collect(self) -> Iterator[Metric]:
        """``agentgate_worker_restarts_total{worker=<listen endpoint>}`` for a Prometheus
        registry (the label is the endpoint, as in the gateway's other worker metrics)."""
        family = CounterMetricFamily("agentgate_worker_restarts", "Worker processes restarted "
                                     "by agentgate serve after they exited", labels=["worker"])
        for endpoint, n in self.restarts().items():
            family.add_metric([endpoint], n)
        yield family

    def _run(self) -> None:
        while not self._stopping.wait(POLL_S):
            for slot in self._slots:
                self._check(slot)

    def _check(self, slot: _Slot) -> None:
        now = time.monotonic()
        if slot.restart_at is None:
            if (rc := slot.worker.proc.poll()) is None:  # NOTE: poll() reaps an exited child
                return
            slot.delay_s = restart_delay_s(slot.delay_s, now - slot.started_at)
            slot.restart_at = now + slot.delay_s
            logger.error("%s %s (pid %d) %s; restarting it in %.1f s on %s",
                         self.kind, slot.worker.worker_id, slot.worker.proc.pid, describe_exit(rc),
                         slot.delay_s, slot.worker.listen)
        elif now >= slot.restart_at:
            self._restart(slot)

    def _restart(self, slot: _Slot) -> None:
        old = slot.worker
        try:
            new = self._spawn(old.worker_id, old.listen, old.events, self._stopping)
        except ServeError as e:
            slot.delay_s = restart_delay_s(slot.delay_s, 0.0)
            slot.restart_at = time.monotonic() + slot.delay_s
            logger.error("%s %s did not restart (next try in %.1f s): %s",
                         self.kind, old.worker_id, slot.delay_s, e)
            return
        slot.worker, slot.started_at, slot.restart_at = new, time.monotonic(), None
        slot.restarts += 1
        logger.warning("%s %s restarted (pid %d, restart %d)", self.kind, new.worker_id,
                       new.proc.pid, slot.restarts)


def stop_workers(workers: list[WorkerProcess], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM all of ``workers`` at once, then wait for each (SIGKILL after ``timeout_s``)."""
    terminate(workers)
    for worker in workers:
        worker.stop(timeout_s=timeout_s)


def terminate(workers: list[WorkerProcess]) -> None:
    """SIGTERM each of ``workers`` still running; no waiting."""
    for worker in workers:
        if worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGTERM)


def describe_exit(returncode: int) -> str:
    """``exited with status 1`` or ``was killed by SIGKILL (-9)``."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name} ({returncode})"
