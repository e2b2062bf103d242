"""The sandbox runner: what a program sees, each limit's enforcement, the concurrency bound, cleanup,
the fallback isolation, and the messages for settings that cannot work. Real sandboxed subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from _sandboxed import foreign_processes

from mmrl.runtime.debris import clean_stale_debris
from mmrl.sandbox import Sandbox, SandboxError, SandboxLimits
from mmrl.sandbox.runner import PROGRAM_ENV

pytestmark = pytest.mark.shares("sandbox")  # tests count the sandboxed processes on the machine

FAST = SandboxLimits(cpu_time_s=1.0, wall_time_s=8.0, memory_bytes=256 << 20)

WHAT_IT_SEES = r"""
import json, os, socket, sys
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
print(json.dumps({
    "stdin": sys.stdin.read(), "helper": open("helper.txt").read(), "cwd": os.getcwd(),
    "env": dict(os.environ), "uid": os.getuid(), "pid": os.getpid(), "hostname": socket.gethostname(),
    "cap_eff": status["CapEff"].strip(), "no_new_privs": status["NoNewPrivs"].strip(),
    "root": sorted(os.listdir("/")), "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
}))
"""


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(FAST, max_concurrency=4)


def test_a_program_sees_its_stdin_files_and_nothing_of_the_host(sandbox):
    result = sandbox.run(sandbox.python_program(WHAT_IT_SEES, stdin="line 1\n", files={"helper.txt": "help"}))
    assert result.ok and result.reason is None, result.stderr
    seen = json.loads(result.stdout)
    assert (seen["stdin"], seen["helper"], seen["cwd"]) == ("line 1\n", "help", "/sandbox")
    assert seen["env"] == PROGRAM_ENV  # nothing of the parent's environment
    assert seen["uid"] == 0 and seen["cap_eff"] == "0000000000000000" and seen["no_new_privs"] == "1"
    assert seen["hostname"] == "sandbox"
    assert seen["pid"] == 2 and seen["pids"] == [1, 2]  # its own pid namespace: init and itself
    assert {"sandbox", "tmp", "usr", "proc", "dev"} <= set(seen["root"]) and "home" not in seen["root"]
    assert result.leftover_processes == 0 and result.cpu_s > 0 and result.max_rss_bytes > 0


def test_cpu_time_limit_stops_a_spin_even_when_it_ignores_sigxcpu(sandbox):
    spin = "while True:\n    pass\n"
    stubborn = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n" + spin
    patient = SandboxLimits(cpu_time_s=1.0, wall_time_s=30.0)  # CPU, not wall time, must end them
    programs = [sandbox.python_program(spin), sandbox.python_program(stubborn)]
    plain, ignoring = sandbox.run_many(programs, patient)
    assert (plain.outcome, plain.signal) == ("signaled", signal.SIGXCPU)  # soft limit, 1 s
    assert (ignoring.outcome, ignoring.signal) == ("signaled", signal.SIGKILL)  # hard limit, 2 s
    for result in (plain, ignoring):
        assert result.reason == "CPU time limit (1 s) exceeded"


def test_at_most_max_concurrency_runs_at_once():
    sandbox = Sandbox(FAST, max_concurrency=2)
    program = "import time\nstart = time.time()\ntime.sleep(0.8)\nprint(start, time.time())\n"
    results = sandbox.run_many([sandbox.python_program(program)] * 4)
    spans = [tuple(map(float, result.stdout.split())) for result in results]
    at_most = max(sum(start <= moment < end for start, end in spans) for moment, _ in spans)
    assert at_most == 2, spans


def test_temporary_folders_are_removed(sandbox, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sandbox.run(sandbox.python_program("open('scratch', 'w').write('x' * 1000)"))
    sandbox.run(sandbox.python_program("import time\ntime.sleep(60)"), SandboxLimits(wall_time_s=0.5))
    assert list(tmp_path.iterdir()) == []


WORKER = """
from mmrl.sandbox import Sandbox, SandboxLimits
sandbox = Sandbox(SandboxLimits(wall_time_s=60, cpu_time_s=60))
print("started", flush=True)
sandbox.run(sandbox.python_program("import os, time\\nif os.fork() == 0:\\n    os.setsid()\\ntime.sleep(60)"))
"""


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_run_dies_with_the_process_that_started_it_and_a_later_start_up_removes_its_folder(
    tmp_path, monkeypatch
):
    before = foreign_processes()
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert worker.stdout.readline() == "started\n"
        # init, the program and its setsid child: all in the run's namespaces
        assert _wait_for(lambda: len(foreign_processes() - before) >= 3, 20.0)
    finally:
        worker.kill()
        worker.wait()
        worker.stdout.close()
    assert _wait_for(lambda: not foreign_processes() - before, 5.0), foreign_processes() - before
    # the killed process never removed its run's folder; it is named after it, and the next start-up's
    # cleaning (the trainer's, a vLLM engine's) removes it
    assert [path.name.startswith(f"mmrl-sandbox-{worker.pid}-") for path in tmp_path.iterdir()] == [True]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    clean_stale_debris()
    assert list(tmp_path.iterdir()) == [tmp_path / "mmrl-debris.lock"]


UNPRIVILEGED = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from mmrl.sandbox import Sandbox, SandboxLimits
sandbox = Sandbox(SandboxLimits(cpu_time_s=1.0, wall_time_s=5.0), max_concurrency=2)
programs = ["import os\\nprint(os.getuid(), os.getpid())", "open('/usr/written', 'w')",
            "import socket\\nsocket.create_connection(('127.0.0.1', 9))"]
results = sandbox.run_many([sandbox.python_program(p) for p in programs])
print(json.dumps([os.getuid()] + [(r.stdout, r.reason) for r in results]))
"""


def test_an_unprivileged_caller_gets_the_same_isolation():
    """Run by a user without privileges (here: `nobody` when the tests run as root), the sandbox maps
    that user to uid 0 of its namespace and isolates the same way."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    command = [sys.executable, "-I", "-c", UNPRIVILEGED, repo]
    if os.geteuid() == 0:  # the venv's interpreter may live under /root, which nobody cannot enter
        command = [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            _process_python(),
            *command[1:],
        ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd="/", env={})
    assert done.returncode == 0, done.stderr[-2000:]
    caller, sees, write, connect = json.loads(done.stdout)
    assert caller != 0 and sees == ["0 2\n", None]
    assert "Read-only file system" in write[1] and "Network is unreachable" in connect[1]


def _process_python() -> str:
    """As root, an interpreter `nobody` can run (so the fallback drops to nobody), else this one."""
    if os.geteuid() == 0 and os.access("/usr/bin/python3", os.X_OK):
        return "/usr/bin/python3"
    return sys.executable


PROCESS_HOSTILE = {
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
    "fork": "import os\nos.fork()",
    "subprocess": "import subprocess\nsubprocess.run(['/bin/true'])",
    "read_outside": "open('/etc/hostname').read()",
    "write_outside": "open('/tmp/mmrl-sandbox-escape', 'w')",
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    "ctypes": "import ctypes\nctypes.CDLL(None).getpid()",
}


def test_process_isolation_refuses_what_the_audit_hook_guards():
    sandbox = Sandbox(FAST, isolation="process", python=_process_python(), max_concurrency=4)
    programs = [sandbox.python_program(source) for source in PROCESS_HOSTILE.values()]
    own = "open('mine', 'w').write('x'); print(open('mine').read(), sorted(__import__('os').environ))"
    programs += [sandbox.python_program(own), sandbox.python_program("import time\ntime.sleep(60)")]
    results = sandbox.run_many(programs, SandboxLimits(wall_time_s=1.0, cpu_time_s=1.0))
    for name, result in zip(PROCESS_HOSTILE, results):
        assert result.exit_code == 1 and "PermissionError: sandbox:" in result.reason, (name, result.reason)
    assert results[-2].ok and results[-2].stdout.startswith("x ") and "MMRL" not in results[-2].stdout
    assert results[-1].reason == "wall time limit (1 s) exceeded" and results[-1].leftover_processes == 0
    assert not os.path.exists("/tmp/mmrl-sandbox-escape")
    assert sandbox.runs_as_nobody == (_process_python() != sys.executable)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"isolation": "docker"}, "isolation 'docker' is not one of ['namespaces', 'process']"),
        ({"max_concurrency": 0}, "max_concurrency must be at least 1"),
        ({"python": "/no/python"}, "python '/no/python' is not a file"),
        ({"read_only_paths": ["/no/such/data"]}, "read_only_paths: '/no/such/data' does not exist"),
        ({"read_only_paths": ["/proc"]}, "would hide the sandbox's own /proc"),
        ({"python": "/bin/false"}, "cannot run a trivial program here: exit code 1. The kernel must allow"),
    ],
)
def test_settings_that_cannot_work_are_named(kwargs, message):
    with pytest.raises(SandboxError) as err:
        Sandbox(FAST, **kwargs)
    assert message in str(err.value)
