"""Ray token authentication, on for every cluster mmrl starts or joins.

Without it, anyone who reaches a Ray port can submit a job: code runs with the run's rights. Ray (2.52+)
checks a shared token on every RPC and HTTP call when ``RAY_AUTH_MODE=token``; every process of the
cluster (driver, GCS, raylets, workers) reads the token from ``RAY_AUTH_TOKEN``, else the file named by
``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``. Ray turns the mode on for a local ``ray.init()``
cluster only; mmrl turns it on for a joined one too, and writes a missing default token itself, readable
by its owner only (Ray writes it with the umask's rights, usually readable by every local user).
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from mmrl.errors import UserInputError

logger = logging.getLogger(__name__)

AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


def default_token_path() -> Path:
    """Where Ray looks for the token when neither variable is set."""
    return Path.home() / ".ray" / "auth_token"


class RayAuthError(UserInputError):
    """The cluster to join needs a token this process does not have."""


def _token_source() -> str | None:
    """Where this process's token comes from (a variable or a file), or None when there is none."""
    if os.environ.get(TOKEN_ENV):
        return f"${TOKEN_ENV}"
    if os.environ.get(TOKEN_PATH_ENV):
        return os.environ[TOKEN_PATH_ENV]  # Ray refuses an unreadable or empty one with its own message
    path = default_token_path()
    return str(path) if path.is_file() and path.stat().st_size > 0 else None


def _write_default_token(path: Path) -> None:
    """Creates ``path`` with a new random token, mode 0600; a process that got there first wins (several
    runs starting at once on a new machine must all use the token that the first one's cluster read)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    temporary = path.with_name(f".auth_token.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secrets.token_hex(32).encode())
    finally:
        os.close(fd)
    try:
        os.link(temporary, path)  # fails if the file exists: never replaces a token a cluster uses
        logger.info("wrote a new Ray authentication token to %s (readable by you only)", path)
    except FileExistsError:
        pass
    finally:
        temporary.unlink()


def enable_token_auth(joining: bool) -> str:
    """Turns token authentication on for this process and the Ray processes it starts, and makes sure
    there is a token: a new one for a local cluster (``joining=False``), the cluster's own when joining
    one (:class:`RayAuthError` naming the fix when there is none). Returns where the token comes from,
    or ``"disabled"`` when the user turned authentication off (``RAY_AUTH_MODE=disabled``: a warning)."""
    mode = os.environ.setdefault(AUTH_MODE_ENV, "token").lower()
    try:
        if mode == "disabled":
            return _disabled()
        if mode != "token":  # another of Ray's modes (e.g. k8s): Ray's own set-up applies
            return mode
        return _token_source_or_new(joining)
    finally:
        _reload_ray_settings()


def _reload_ray_settings() -> None:
    """Ray reads the mode and the token once per process (2.52 to 2.60: its C++ config and token loader,
    when ``ray`` is imported and first asked); a process that imported ray before they were set must have
    both read again, as ``ray.init`` does when it turns the mode on itself."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _disabled() -> str:
    logger.warning(
        "Ray token authentication is off (%s=disabled): anyone who can reach this cluster's ports can "
        "run code on it with this run's rights. Unset %s to turn it back on",
        AUTH_MODE_ENV,
        AUTH_MODE_ENV,
    )
    return "disabled"


def _token_source_or_new(joining: bool) -> str:
    source = _token_source()
    if source is None and joining:
        raise RayAuthError(
            f"trainer.ray.address joins a Ray cluster with token authentication, and this machine has no "
            f"token: copy the head's token (`ray get-auth-token` there) to {default_token_path()}, or set "
            f"{TOKEN_ENV} or {TOKEN_PATH_ENV}"
        )
    if source is None:
        _write_default_token(default_token_path())
        source = str(default_token_path())
    elif source == str(default_token_path()) and default_token_path().stat().st_mode & 0o077:
        logger.warning(
            "%s is readable by other users of this machine, who could run code on the cluster with it: "
            "chmod 600 %s",
            source,
            source,
        )
    return source
