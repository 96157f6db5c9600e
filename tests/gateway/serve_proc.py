"""A real ``agentgate serve`` subprocess for the supervision tests (signals, worker restarts,
slow clients): its output goes to a file (never a pipe nobody reads, which would block it), and
its workers are found and watched through ``/proc``."""

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.gateway.live import free_port, spawn_serve, wait_ready


@dataclass(frozen=True, slots=True)
class ServeProc:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def worker_pids(self) -> list[int]:
        """The live (not zombie) ``engine.worker`` children of the gateway."""
        return self._children(b"engine.worker")

    def encoder_pids(self) -> list[int]:
        """The live (not zombie) encoder service children (``python -m encoders``)."""
        return self._children(b"-m\0encoders\0")

    def _children(self, marker: bytes) -> list[int]:
        return [pid for pid in children(self.proc.pid)
                if marker in _cmdline(pid) and proc_state(pid) not in (None, "Z")]

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> int:
        """Signal the gateway and wait; SIGKILL after ``timeout_s``. Returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"agentgate serve ignored signal {sig}:\n{self.output()}") from None

    def chat(self, max_tokens: int = 3, timeout_s: float = 30.0) -> dict[str, Any]:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": max_tokens}
        return post_json(f"{self.base_url}/v1/chat/completions", body, timeout_s)


@contextlib.contextmanager
def serve_proc(model_dir: Path, tmp_path: Path, *args: str,
               env: dict[str, str] | None = None, backend: str = "sim") -> Iterator[ServeProc]:
    """``agentgate serve --backend sim --model model_dir ARGS`` on a free port, ready; killed
    with its workers at the end whatever the test did. ``env`` adds to its environment."""
    port = free_port()
    log_path = tmp_path / f"serve-{port}.log"
    with log_path.open("wb") as log:
        proc = spawn_serve(model_dir, port, "--served-model-name", "m", *args, stdout=log,
                           env=env or {}, backend=backend)
    serve = ServeProc(proc, port, log_path)
    pids: set[int] = set()
    try:
        wait_ready(proc, serve.base_url, serve.output)
        pids.update(serve.worker_pids(), serve.encoder_pids())
        yield serve
    finally:
        pids.update(serve.worker_pids(), serve.encoder_pids())
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in pids:  # NOTE: only our own workers, by pid
            with contextlib.suppress(ProcessLookupError):
                if b"engine.worker" in _cmdline(pid) or b"-m\0encoders\0" in _cmdline(pid):
                    os.kill(pid, signal.SIGKILL)


def post_json(url: str, body: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def wait_until(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll ``check`` every 0.1 s until it returns something truthy (returned)."""
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.1)
    return result


def children(ppid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _stat_field(int(entry.name), 3) == str(ppid):
            out.append(int(entry.name))
    return out


def proc_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (R, S, Z, ...), None when it is gone."""
    return _stat_field(pid, 2)


def alive(pids: list[int]) -> list[int]:
    """The pids among ``pids`` still running (zombies count as gone)."""
    return [pid for pid in pids if proc_state(pid) not in (None, "Z")]


def _stat_field(pid: int, index: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # NOTE: the command name (field 1) may hold spaces: split after its closing parenthesis
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[index - 2]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
