"""Ray token authentication stays on: mmrl turns it on and provides a token readable by its owner only,
and no make target, test, bench or example turns it off."""

from __future__ import annotations

import logging
import re
import stat
from pathlib import Path

import pytest

from mmrl.single_controller.ray_auth import RayAuthError, enable_token_auth

REPO_ROOT = Path(__file__).resolve().parents[2]
# RAY_AUTH_MODE=disabled in a shell line, or "RAY_AUTH_MODE": "disabled" / setenv("RAY_AUTH_MODE", "disabled")
TURNS_AUTH_OFF = re.compile(r"""RAY_AUTH_MODE["']?\s*[=:,]\s*["']?disabled""")


def test_no_target_test_bench_or_example_turns_authentication_off():
    """What runs jobs (make targets, tests, benches, example configs, scripts) never sets it off."""
    files = [REPO_ROOT / "Makefile"]
    for folder in ("bench", "tests", "examples", "scripts"):
        files += [p for p in (REPO_ROOT / folder).rglob("*") if p.suffix in {".py", ".yaml", ".sh", ".mk"}]
    offenders = [
        f"{path.relative_to(REPO_ROOT)}:{number}"
        for path in files
        if path.is_file() and path != Path(__file__)
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if TURNS_AUTH_OFF.search(line)
    ]
    assert offenders == []


@pytest.fixture
def bare_home(monkeypatch, tmp_path):
    """A machine where Ray never ran: no token anywhere, no mode set."""
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    yield tmp_path
    monkeypatch.undo()
    enable_token_auth(joining=False)  # Ray reads the restored settings again (the real home's token)


def test_a_local_cluster_gets_a_token_readable_by_its_owner_only(bare_home):
    import os

    assert enable_token_auth(joining=False) == str(bare_home / ".ray" / "auth_token")
    token = bare_home / ".ray" / "auth_token"
    assert os.environ["RAY_AUTH_MODE"] == "token"
    assert re.fullmatch(r"[0-9a-f]{64}", token.read_text())
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    first = token.read_text()
    enable_token_auth(joining=False)  # a second run on this machine: the same token, never replaced
    assert token.read_text() == first and list(token.parent.iterdir()) == [token]


def test_joining_a_cluster_without_a_token_names_the_fix(bare_home):
    with pytest.raises(RayAuthError, match=r"ray get-auth-token.*RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH"):
        enable_token_auth(joining=True)
    assert not (bare_home / ".ray").exists()


def test_a_token_in_the_environment_is_used_as_is(bare_home, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "f" * 64)
    assert enable_token_auth(joining=True) == "$RAY_AUTH_TOKEN"
    assert not (bare_home / ".ray").exists()


def test_a_token_file_others_can_read_is_warned_about(bare_home, caplog):
    token = bare_home / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("a" * 64)
    token.chmod(0o644)  # what Ray itself writes under a usual umask
    with caplog.at_level(logging.WARNING, logger="mmrl.single_controller.ray_auth"):
        enable_token_auth(joining=True)
    assert f"chmod 600 {token}" in caplog.text


def test_turning_authentication_off_is_warned_about(bare_home, monkeypatch, caplog):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with caplog.at_level(logging.WARNING, logger="mmrl.single_controller.ray_auth"):
        assert enable_token_auth(joining=False) == "disabled"
    assert "anyone who can reach this cluster's ports can run code" in caplog.text
    assert not (bare_home / ".ray").exists()
