"""The per-deployment secret that keys tenant ids (``GatewayConfig.tenant_secret``), so that weak
API keys cannot be guessed offline from the tenant ids in store keys.

It comes from ``AGENTGATE_TENANT_SECRET`` when set, else from a file that is created on first
start (mode 0600, ``SECRET_BYTES`` random bytes). Gateway replicas that share a Redis store must
share the secret too (same file contents or the same variable), or they see different tenants.
"""

import logging
import os
import secrets
import stat
from pathlib import Path

logger = logging.getLogger(__name__)

SECRET_BYTES = 32
MIN_SECRET_BYTES = 16


class TenantSecretError(ValueError):
    """The secret given is too short, or its file cannot be read or created."""


def default_secret_path(config_home: str | None) -> Path:
    """``$XDG_CONFIG_HOME/agentgate/tenant-secret`` (``~/.config`` when ``config_home`` is
    None or empty)."""
    base = Path(config_home) if config_home else Path.home() / ".config"
    return base / "agentgate" / "tenant-secret"


def load_tenant_secret(path: Path, env_value: str | None = None) -> bytes:
    """``env_value`` (UTF-8) when given, else the contents of ``path``, created when missing.

    Raises:
        TenantSecretError: a secret under ``MIN_SECRET_BYTES``, or the file cannot be used.
    """
    if env_value:
        secret = env_value.encode()
        _check_length(secret, "AGENTGATE_TENANT_SECRET")
        return secret
    try:
        if not path.exists():
            _create(path)
        mode = stat.S_IMODE(path.stat().st_mode)
        secret = path.read_bytes()
    except OSError as e:
        raise TenantSecretError(f"--tenant-secret-file {path}: {e}") from None
    if mode & 0o077:
        logger.warning("%s is readable by others (mode %o): chmod 600 it", path, mode)
    _check_length(secret, f"--tenant-secret-file {path}")
    return secret


def _create(path: Path) -> None:
    """Write a new secret to ``path`` atomically (never a partial file, never over another
    gateway's secret written meanwhile: the loser of that race reads the winner's)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(SECRET_BYTES))
        try:
            os.link(tmp, path)  # NOTE: fails if it exists: no overwrite
            logger.info("created the tenant secret %s", path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


def _check_length(secret: bytes, source: str) -> None:
    if len(secret) < MIN_SECRET_BYTES:
        raise TenantSecretError(f"{source}: the tenant secret must be at least "
                                f"{MIN_SECRET_BYTES} bytes (got {len(secret)})")
