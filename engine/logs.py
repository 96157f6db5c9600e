"""The one log format of every agentgate process (gateway and workers), configured here only.

    2026-01-01 12:00:00,000 INFO [worker w0] engine.worker.cli: worker w0 listening on ...

The role in brackets tells whose line it is once ``agentgate serve`` has merged its workers'
stderr into its own. It lives in ``engine`` because the worker may not import ``gateway``.
"""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s"


def configure_logging(role: str, level: int = logging.INFO) -> None:
    """Send every record to stderr in ``LOG_FORMAT`` for ``role`` ("gateway", "worker w0"),
    replacing handlers installed before (a library's own format)."""
    fmt = LOG_FORMAT.format(role=role.replace("%", "%%"))
    logging.basicConfig(level=level, format=fmt, force=True)
