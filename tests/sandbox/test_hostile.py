"""Hostile programs, each contained: it scores 0, the reason says which layer stopped it, nothing it
started outlives its run, and the grader (this process) carries on.

Every program is a model "response" graded by the real path (fenced-block extraction, the sandbox,
the stdout comparison) against a test whose expected output it can only print if its attack worked
("pwned", or the secret it tried to read). All of them run in one batch, concurrently, through one
:class:`CodeGrader` (its concurrency bound), under tight limits; the tests read that batch's results.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from _sandboxed import foreign_processes

from mmrl.rewards.code import CodeGrader, CodeTests
from mmrl.sandbox import Sandbox, SandboxLimits
from mmrl.single_controller.ray_auth import default_token_path

pytestmark = pytest.mark.shares("sandbox")  # tests count the sandboxed processes on the machine

LIMITS = SandboxLimits(
    cpu_time_s=1.0,
    wall_time_s=4.0,  # 2 s was once too short for memory_bomb beside 9 spinning programs on 2 busy cores
    memory_bytes=256 << 20,
    file_size_bytes=8 << 20,
    disk_bytes=24 << 20,
    max_processes=8,
    max_open_files=32,
    max_output_bytes=256 << 10,
)
CONCURRENCY = 10
SECRET_ENV = "MMRL_TEST_SANDBOX_SECRET"

# name -> (program, expected stdout: what only a successful attack prints). {placeholders} are
# filled from the fixture: the host folder, the secret file, the listener's addresses, the test's pid.
HOSTILE = {
    "fork_bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "pwned",
    ),
    "process_count": (
        "import os, time\ncount = 0\ntry:\n    for _ in range(100):\n        if os.fork() == 0:\n"
        "            time.sleep(30)\n            os._exit(0)\n        count += 1\n"
        "except OSError as err:\n    print('stopped at', count, err)\nelse:\n    print('pwned')\n",
        "pwned",
    ),
    "memory_bomb": ("hoard = []\nwhile True:\n    hoard.append(bytearray(32 << 20))\n", "pwned"),
    "infinite_loop": ("while True:\n    pass\n", "pwned"),
    "threads_spin": (
        "import threading\ndef spin():\n    while True:\n        pass\n"
        "for _ in range(4):\n    threading.Thread(target=spin).start()\n",
        "pwned",
    ),
    "sleep_past_wall_time": ("import time\ntime.sleep(60)\nprint('pwned')\n", "pwned"),
    "ignore_signals_idle": (
        "import signal, time\nfor sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):\n"
        "    signal.signal(sig, signal.SIG_IGN)\nwhile True:\n    time.sleep(1)\n",
        "pwned",
    ),
    "ignore_signals_spin": (
        "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n",
        "pwned",
    ),
    "write_outside": (
        "import os, sys\nerrors = []\nfor path in ('/usr/written', sys.prefix + '/written', '/written',\n"
        "             {folder!r} + '/written'):\n    try:\n        open(path, 'w').write('x')\n        print('pwned')\n"
        "    except OSError as err:\n        errors.append(f'{{path}}: {{err.strerror}}')\nprint(errors)\n",
        "pwned",
    ),
    "read_outside": (
        "import glob\nfound = []\nfor path in ({secret_file!r}, {ray_token_file!r}, '/etc/passwd', '/etc/shadow',\n"
        "             '/root/.bash_history'):\n"
        "    try:\n        found.append(open(path).read())\n    except OSError as err:\n"
        "        found.append(err.strerror)\nprint(found, glob.glob('/work/*'), glob.glob('/home/*'))\n",
        "{secret}",
    ),
    "connect_loopback": (
        "import socket\nerrors = []\nfor address in {addresses!r}:\n    try:\n"
        "        socket.create_connection(address, timeout=1)\n        print('pwned')\n"
        "    except OSError as err:\n        errors.append(str(err))\nprint(errors)\n",
        "pwned",
    ),
    "kill_parent": (
        "import os, signal\nerrors = []\nfor pid in (os.getppid(), 1, {test_pid}, -1):\n    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n    except OSError as err:\n        errors.append(f'{{pid}}: {{err}}')\n"
        "os.kill(1, 0)\nprint('parent', os.getppid(), 'alive', errors)\n",
        "pwned",
    ),
    "flood_stdout": ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", "pwned"),
    "daemon": (
        "import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(1.5)\n"
        "        print('pwned', flush=True)\n        time.sleep(60)\n    os._exit(0)\n",
        "pwned",
    ),
    "exhaust_fds": ("handles = []\nwhile True:\n    handles.append(open('/dev/null'))\n", "pwned"),
    "huge_file": (
        "chunk = b'x' * (1 << 20)\nwith open('big', 'wb') as big:\n    for _ in range(1024):\n"
        "        big.write(chunk)\nprint('pwned')\n",
        "pwned",
    ),
    "fill_disk": (
        "chunk = b'x' * (4 << 20)\nfor index in range(100):\n    with open(f'part{{index}}', 'wb') as part:\n"
        "        part.write(chunk)\nprint('pwned')\n",
        "pwned",
    ),
    "tamper_with_test_files": (
        "import os\nerrors = []\nfor path in ({victim_file!r}, {test_file!r}):\n    try:\n        os.remove(path)\n"
        "        print('pwned')\n    except OSError as err:\n        errors.append(err.strerror)\n"
        "    try:\n        open(path, 'a').write('tampered')\n        print('pwned')\n"
        "    except OSError as err:\n        errors.append(err.strerror)\nprint(errors)\n",
        "pwned",
    ),
    "environment_secrets": (
        "import os\nfound = [os.environ.get({secret_env!r}, 'absent')]\nfor path in ('/proc/self/environ', "
        "'/proc/1/environ', '/proc/{test_pid}/environ'):\n    try:\n        found.append(open(path, 'rb').read().decode())\n"
        "    except OSError as err:\n        found.append(err.strerror)\nprint(found)\n",
        "{secret}",
    ),
    "privilege_escalation": (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nresults = []\n"
        "for name, call in (('unshare', lambda: libc.unshare(0x10000000 | 0x00020000)),\n"
        "                   ('remount /usr rw', lambda: libc.mount(None, b'/usr', None, 32 | 4096, None)),\n"
        "                   ('mount tmpfs', lambda: libc.mount(b'x', b'/usr', b'tmpfs', 0, None))):\n"
        "    if call() == 0:\n        print('pwned')\n    results.append(f'{{name}}: {{os.strerror(ctypes.get_errno())}}')\n"
        "try:\n    os.chroot('/tmp')\n    print('pwned')\nexcept OSError as err:\n    results.append(f'chroot: {{err.strerror}}')\n"
        "print(results)\n",
        "pwned",
    ),
}
# what each program's failure must say (a substring of its reason), and its case status
EXPECTED = {
    "fork_bomb": (("CPU time limit", "wall time limit"), ("cpu_time", "wall_time")),
    "process_count": (("Resource temporarily unavailable",), ("wrong_answer",)),
    "memory_bomb": (("MemoryError",), ("memory",)),
    "infinite_loop": (("CPU time limit", "wall time limit"), ("cpu_time", "wall_time")),
    "threads_spin": (("CPU time limit", "wall time limit"), ("cpu_time", "wall_time")),
    "sleep_past_wall_time": (("wall time limit (4 s) exceeded",), ("wall_time",)),
    "ignore_signals_idle": (("wall time limit (4 s) exceeded",), ("wall_time",)),
    "ignore_signals_spin": (("CPU time limit", "wall time limit"), ("cpu_time", "wall_time")),
    "write_outside": (("Read-only file system",), ("wrong_answer",)),
    "read_outside": (("No such file or directory",), ("wrong_answer",)),
    "connect_loopback": (("Network is unreachable",), ("wrong_answer",)),
    "kill_parent": (("alive",), ("wrong_answer",)),
    "flood_stdout": (("output limit",), ("output_limit",)),
    "daemon": (("got ''",), ("wrong_answer",)),
    "exhaust_fds": (("Too many open files",), ("runtime_error",)),
    "huge_file": (("File too large", "file size limit"), ("file_size",)),
    "fill_disk": (("No space left on device",), ("runtime_error",)),
    "tamper_with_test_files": (("No such file or directory",), ("wrong_answer",)),
    "environment_secrets": (("absent",), ("wrong_answer",)),
    "privilege_escalation": (("Operation not permitted",), ("wrong_answer",)),
}


# Only this machine is ever addressed (tests touch loopback only): two IPv4 loopback addresses, as a
# sandbox that let some of 127.0.0.0/8 through would be as open, and IPv6's where the machine has it.
LOOPBACK_HOSTS = ("127.0.0.1", "127.0.0.2", "::1")


class Listener:
    """TCP servers on the loopback addresses this machine has, counting the connections they accept;
    ``addresses`` are their ``(host, port)`` pairs."""

    def __init__(self):
        self.servers = []
        for host in LOOPBACK_HOSTS:
            try:
                server = socket.create_server(
                    (host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET
                )
            except OSError:  # IPv6 off on this machine
                continue
            server.settimeout(0.2)
            self.servers.append(server)
        self.addresses = [server.getsockname()[:2] for server in self.servers]
        self.accepted = 0
        self.stopped = threading.Event()
        self.threads = [
            threading.Thread(target=self._serve, args=(server,), daemon=True) for server in self.servers
        ]
        for thread in self.threads:
            thread.start()

    def _serve(self, server):
        while not self.stopped.is_set():
            try:
                connection, _ = server.accept()
            except OSError:
                continue
            self.accepted += 1
            connection.close()

    def reachable_from_here(self, timeout_s: float = 5.0) -> int:
        """Connect once to every address from this (unsandboxed) process; how many were accepted."""
        before = self.accepted
        for address in self.addresses:
            socket.create_connection(address, timeout=1).close()
        deadline = time.monotonic() + timeout_s
        while self.accepted - before < len(self.addresses) and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.accepted - before

    def close(self):
        self.stopped.set()
        for thread, server in zip(self.threads, self.servers):
            thread.join()
            server.close()


@pytest.fixture(scope="module")
def hostile_batch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("host")
    secret = secrets.token_hex(16)
    secret_file, victim_file = folder / "secret.txt", folder / "victim.txt"
    secret_file.write_text(secret)
    victim_file.write_text("original")
    listener = Listener()
    os.environ[SECRET_ENV] = secret
    values = {
        "folder": str(folder),
        "secret_file": str(secret_file),
        "victim_file": str(victim_file),
        "test_file": os.path.abspath(__file__),
        "addresses": listener.addresses,
        "test_pid": os.getpid(),
        "secret_env": SECRET_ENV,
        "secret": secret,
        # the host's Ray token (run code on the cluster with it), where Ray and mmrl keep it
        "ray_token_file": str(default_token_path()),
    }
    names = list(HOSTILE)
    responses = [f"Here you go:\n```python\n{HOSTILE[name][0].format(**values)}```" for name in names]
    suites = [CodeTests("stdio", inputs=[""], outputs=[HOSTILE[name][1].format(**values)]) for name in names]
    before = foreign_processes()
    grader = CodeGrader(Sandbox(LIMITS, max_concurrency=CONCURRENCY))
    try:
        started = time.monotonic()
        grades = grader.grade(responses, suites)
        elapsed = time.monotonic() - started
        outlived = foreign_processes() - before
        after = grader.grade(["```python\nprint(input()[::-1])\n```"], [CodeTests("stdio", ["abc"], ["cba"])])
        accepted = listener.accepted
        reachable = listener.reachable_from_here()
    finally:
        os.environ.pop(SECRET_ENV)
        listener.close()
    return {
        "grades": dict(zip(names, grades)),
        "elapsed_s": elapsed,
        "outlived": outlived,
        "accepted": accepted,
        "reachable": reachable,
        "after": after[0],
        "files": values,
        "folder_entries": sorted(p.name for p in folder.iterdir()),
        "victim": victim_file.read_text(),
    }


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_program_is_contained(hostile_batch, name):
    grade = hostile_batch["grades"][name]
    reasons, statuses = EXPECTED[name]
    assert grade.pass_rate == 0.0
    assert grade.scores("pass_rate")["overall"] == 0.0
    assert grade.cases[0].status in statuses, grade.reason
    assert any(text in grade.reason for text in reasons), grade.reason
    assert grade.leftover_processes == 0  # the launcher found nothing of it after the run
    assert not hostile_batch["outlived"]  # nor does this process: no sandboxed process is left
    printed = grade.reason.partition(", got ")[2]  # the reason repeats the expected output first
    assert hostile_batch["files"]["secret"] not in printed
    token_file = Path(hostile_batch["files"]["ray_token_file"])
    if token_file.is_file():  # written by any Ray run on this machine
        assert token_file.read_text().strip() not in printed


def test_the_grader_carries_on_and_the_host_is_untouched(hostile_batch):
    assert hostile_batch["after"].pass_rate == 1.0  # the same grader, right after the batch
    assert hostile_batch["accepted"] == 0  # no connection reached the listeners on loopback
    # ... which this process reaches: at least the two IPv4 loopback addresses were there to attack
    assert hostile_batch["reachable"] == len(hostile_batch["files"]["addresses"]) >= 2
    assert hostile_batch["victim"] == "original"
    assert hostile_batch["folder_entries"] == ["secret.txt", "victim.txt"]  # nothing written beside
    assert not os.path.exists("/usr/written") and not os.path.exists(sys.prefix + "/written")
    assert os.path.isfile(hostile_batch["files"]["test_file"])
    # 20 programs, 10 at a time, 2 s wall time each: the batch ends in a few rounds of that
    assert hostile_batch["elapsed_s"] < 30.0, hostile_batch["elapsed_s"]
