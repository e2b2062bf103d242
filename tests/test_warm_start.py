"""The suite's warm start (tests/_warm_start.py) gives a command what a fresh ``python`` would: its
arguments, path, working folder, environment, session, output, exit status, and signals' ends."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time

import _warm_start as warm
import pytest

PROBE = """
import json, os, sys
if sys.argv[1] == "raise":
    raise ValueError("from the probe")
if sys.argv[1] == "hang":
    print("ready", flush=True)
    import time
    time.sleep(60)
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "main": __name__,
    "mark": os.environ.get("MMRL_PROBE"), "leader": os.getsid(0) == os.getpid(),
}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A folder with the probe script; servers of this test's own (the worker's others stay as they are),
    preloading one small module: what a server imported does not change what its commands get, and its
    real imports (~8 CPU-s a server) run under every trainer command of the suite."""
    (tmp_path / "probe.py").write_text(PROBE)
    monkeypatch.setattr(warm, "PRELOAD", ("json",))
    servers = {}
    monkeypatch.setattr(warm, "_servers", servers)
    monkeypatch.setattr(warm, "_seen", collections.Counter())
    yield tmp_path
    for server in servers.values():
        server.close()


def both(args: list[str], **kwargs) -> tuple:
    """The command's result cold (a plain subprocess) and warm (forked by a server: the second command
    of an environment starts it)."""
    cold = subprocess.run(args, capture_output=True, text=True, timeout=120, **kwargs)
    started = warm.run(args, capture_output=True, text=True, timeout=120, **kwargs)  # cold, counted
    assert started.returncode == cold.returncode
    result = warm.run(args, capture_output=True, text=True, timeout=120, **kwargs)
    return cold, result


def test_a_warm_command_gets_what_a_fresh_interpreter_would(probe):
    env = {**os.environ, "MMRL_PROBE": "one"}
    for args in (
        [sys.executable, "-m", "probe", "show", "3"],
        [sys.executable, str(probe / "probe.py"), "show", "3"],
    ):
        cold, result = both(args, cwd=probe, env=env)
        assert len(warm._servers) == 1, "the second command of an environment is forked by its server"
        assert result.returncode == cold.returncode == 3
        assert json.loads(result.stdout) == json.loads(cold.stdout)
        assert result.stderr == cold.stderr == "to stderr\n"
    # MMRL_* variables may differ from the server's: mmrl reads them, the server never imports mmrl
    other = warm.run(
        [sys.executable, "-m", "probe", "show", "0"],
        cwd=probe,
        capture_output=True,
        text=True,
        env={**env, "MMRL_PROBE": "two"},
        timeout=120,
    )
    assert json.loads(other.stdout)["mark"] == "two"


def test_a_new_session_an_exception_and_a_kill_end_as_they_would(probe, tmp_path):
    raised_cold, raised = both([sys.executable, "-m", "probe", "raise"], cwd=probe)
    assert raised.returncode == raised_cold.returncode == 1
    assert "ValueError: from the probe" in raised.stderr and "Traceback" in raised.stderr
    log = tmp_path / "log"
    with open(log, "wb") as out:
        hanging = warm.start(
            [sys.executable, "-m", "probe", "hang"],
            cwd=probe,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    assert isinstance(hanging, warm.WarmProcess)
    deadline = time.monotonic() + 60
    while "ready" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.getsid(hanging.pid) == hanging.pid  # its own session, its pid the session's id
    assert hanging.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        hanging.wait(timeout=0.2)
    os.killpg(hanging.pid, signal.SIGKILL)
    assert hanging.wait(timeout=30) == -signal.SIGKILL
