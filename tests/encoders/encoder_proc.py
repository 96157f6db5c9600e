"""The start line of an encoder service subprocess (``python -m encoders`` / ``encoders.cli``)."""

import queue
import re
import subprocess
import threading
import time


def wait_for_start_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The endpoint of the start line; stderr is read on a thread, so a silent child cannot
    hang the test."""
    assert proc.stderr is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr or []],
                     daemon=True).start()
    deadline, seen = time.monotonic() + timeout_s, []
    while (left := deadline - time.monotonic()) > 0:
        try:
            seen.append(lines.get(timeout=left))
        except queue.Empty:
            break
        if match := re.search(r"encoder listening on (tcp://\S+)", seen[-1]):
            return match.group(1)
    raise AssertionError(f"no start line (rc={proc.poll()}):\n{''.join(seen)}")
