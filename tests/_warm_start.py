"""``python -m <module> args`` for the suite, forked from a process that imported the libraries already.

Every trainer command a test runs (runs to the end, killed runs, CLI runs that stop at a bad input)
starts a Python that imports torch, transformers with its processors, Ray and OmegaConf before it
reads its config: ~8.5 CPU-s on a 2-core AVX2 machine, for each of the suite's ~60 commands. Here a
server process per pytest worker imports those libraries once and forks a child per command. The
child is the command: its own pid, process group and session (``start_new_session``), stdin, stdout
and stderr, working folder, ``sys.argv``, ``sys.path[0]`` and environment as ``python -m`` would give
it; it imports mmrl itself (mmrl is never imported by the server) and leaves through the interpreter's
normal exit (atexit handlers: Ray's shutdown). :func:`start` returns a :class:`WarmProcess`, which
answers as much of :class:`subprocess.Popen` as the tests use.

The libraries read some environment variables when they are imported (Ray's ``RAY_*``, the Hugging
Face cache paths, OpenMP's thread count), so a server serves only commands whose environment equals
its own, except for the ``MMRL_*`` variables (only mmrl reads them, and the server never imports it)
and pytest's ``PYTEST_CURRENT_TEST``; :func:`start` starts a server for an environment at its second command (a few in the whole suite), and
the first command of each environment, any other command and commands beyond ``MAX_SERVERS`` servers
start as plain subprocesses. Not multiprocessing's forkserver: it has one environment per process,
and its children leave by ``os._exit``, past Ray's atexit shutdown. ``MMRL_COLD_START=1`` turns the servers off; ``MMRL_WARM_START_LOG=file`` counts
warm and cold commands there.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

# what a driver imports from these libraries, found by listing the modules a forked driver still
# imported (its config's model family's modules it imports itself)
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint.state_dict",
    "concurrent.futures.process",
    "transformers",
    "transformers.image_utils",
    "transformers.models.auto.processing_auto",
    "transformers.models.qwen2_5_vl.configuration_qwen2_5_vl",
    "transformers.tokenization_mistral_common",  # a processor's load: pydantic, OpenCV, tiktoken
    "ray",
    "ray._private.services",  # ray.init: the dashboard's and metrics' modules (aiohttp, gRPC, OpenTelemetry)
    "ray.dashboard.optional_deps",
    "ray.autoscaler.v2.utils",
    "ray._common.pydantic_compat",  # ray.init's serializers (not Arrow's: pyarrow starts a thread)
    "starlette.datastructures",
    "pydantic.v1",
    "ray._private.thirdparty.pynvml",
    "ray._common.usage.usage_lib",
    "ray._private.runtime_env.uv_runtime_env_hook",
    "omegaconf",
    "tensordict",
    "jinja2",
    "PIL.Image",
    "safetensors.torch",
    "huggingface_hub",
)

# the server: imports PRELOAD, then forks a child per request on the socket it was given (a
# SOCK_SEQPACKET, its fd in argv[1]). A request is one JSON message with the command's stdin, stdout,
# stderr and its own status socket as ancillary fds; the server answers the child's pid on the status
# socket, then its exit status.
SERVER = r"""
import importlib, json, os, runpy, select, socket, struct, sys
for name in sys.argv[2:]:
    importlib.import_module(name)
if len(os.listdir("/proc/self/task")) > 1:  # a thread would be lost in every fork: serve nothing
    sys.exit("warm start: the preloaded modules started a thread")
control = socket.socket(fileno=int(sys.argv[1]))
children = {}

def child(header, fds):
    control.close()
    for status in children.values():
        status.close()
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    if header["new_session"]:
        os.setsid()
    os.chdir(header["cwd"])
    os.environ.clear()
    os.environ.update(header["env"])
    if header["module"]:  # python -m module: the working folder first on the path
        sys.argv = [header["module"], *header["args"]]
        sys.path[0] = os.getcwd()
        runpy.run_module(header["module"], run_name="__main__", alter_sys=True)
    else:  # python script.py: the script's folder first on the path
        sys.argv = list(header["args"])
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")

def serve():
    while True:
        ready, _, _ = select.select([control], [], [], 0.05)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                with_status = children.pop(pid)
                with_status.sendall(struct.pack("<qq", pid, status))
                with_status.close()
        if not ready:
            continue
        data, fds, _, _ = socket.recv_fds(control, 1 << 20, 4)
        if not data:  # the test process is gone
            return
        header = json.loads(data)
        pid = os.fork()
        if pid == 0:
            child(header, fds)
            sys.exit(0)  # the module returned without sys.exit: as python -m does
        status = socket.socket(fileno=fds[3])
        for fd in fds[:3]:
            os.close(fd)
        status.sendall(struct.pack("<qq", pid, -1))
        children[pid] = status

serve()
"""

COLD = os.environ.get("MMRL_COLD_START", "").strip() not in ("", "0")
MAX_SERVERS = 3  # per pytest worker, each ~0.5 GB: the least used one stops for a new one
_servers: dict[tuple, _Server] = {}
_seen: collections.Counter[tuple] = collections.Counter()
_lock = threading.Lock()
# read by no library as it is imported: mmrl's own (the server never imports mmrl), and the test that
# pytest names in every test's environment
UNREAD_AT_IMPORT = ("MMRL_", "PYTEST_CURRENT_TEST")


def _key(env: dict[str, str]) -> tuple:
    return tuple(
        sorted((name, value) for name, value in env.items() if not name.startswith(UNREAD_AT_IMPORT))
    )


class _Server:
    def __init__(self, env: dict[str, str]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(theirs.fileno()), *PRELOAD],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),),
            cwd="/",
        )
        theirs.close()
        self.control = ours
        self.lock = threading.Lock()
        self.broken = False

    def alive(self) -> bool:
        return not self.broken and self.process.poll() is None

    def fork(self, header: dict, stdio: list[int], status: socket.socket) -> None:
        with self.lock:
            socket.send_fds(self.control, [json.dumps(header).encode()], [*stdio, status.fileno()])

    def close(self) -> None:  # the server leaves at the end of its socket; its commands run on
        self.control.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)


def _server_for(env: dict[str, str]) -> _Server | None:
    """The server of ``env``'s commands; None for the first command of an environment (a server pays
    for itself from the second) and once its server died."""
    if COLD:
        return None
    key = _key(env)
    with _lock:
        _seen[key] += 1
        if key in _servers:
            server = _servers[key]
            return server if server.alive() else None  # a dead one is not replaced
        if _seen[key] < 2:
            return None
        if len(_servers) >= MAX_SERVERS:  # the least used one makes room (the trainer runs' own stays)
            _servers.pop(min(_servers, key=lambda known: _seen[known])).close()
        server = _servers[key] = _Server(env)
        _log(f"server {len(_servers)} started")
        return server


def _log(line: str) -> None:
    """A line in ``$MMRL_WARM_START_LOG`` when it names a file: how many commands start warm."""
    if path := os.environ.get("MMRL_WARM_START_LOG"):
        with open(path, "a") as log:
            log.write(f"{os.getpid()} {line}\n")


class WarmProcess:
    """A command forked by a server: pid, the ``subprocess.Popen`` calls the tests use, its pipes."""

    def __init__(self, pid: int, status: socket.socket, stdout, stderr):
        self.pid, self._status, self.stdout, self.stderr = pid, status, stdout, stderr
        self.returncode: int | None = None
        self.args, self._text = None, False

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._read_status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _read_status(self, timeout: float | None) -> bool:
        self._status.settimeout(timeout)
        try:
            data = self._status.recv(16, socket.MSG_WAITALL)
        except (TimeoutError, BlockingIOError):
            return False
        finally:
            self._status.settimeout(None)
        self._status.close()
        if len(data) < 16:  # the server died before the child: its status is lost
            self.returncode = -signal.SIGKILL
            return True
        _, status = struct.unpack("<qq", data)
        self.returncode = os.waitstatus_to_exitcode(status)
        return True

    def communicate(self, timeout: float | None = None) -> tuple:
        """Reads stdout and stderr (those given as PIPE) to their ends, then waits for the exit."""
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = {f: [] for f in (self.stdout, self.stderr) if f is not None}
        with selectors.DefaultSelector() as selector:
            for stream in streams:
                selector.register(stream, selectors.EVENT_READ)
            while selector.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for found, _ in selector.select(left):
                    chunk = os.read(found.fd, 65536)
                    if chunk:
                        streams[found.fileobj].append(chunk)
                    else:
                        selector.unregister(found.fileobj)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out = [
            self._decode(b"".join(streams[f])) if f in streams else None for f in (self.stdout, self.stderr)
        ]
        for stream in streams:
            stream.close()
        return out[0], out[1]

    def _decode(self, data: bytes):
        return data.decode(errors="replace") if self._text else data

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def _stdio_fd(spec, default: int, closers: list) -> tuple[int, object]:
    """The fd the child gets for ``spec`` (PIPE, DEVNULL, a file, or None: ``default``, this process's
    own), and our end of a PIPE; fds to close once the server has them go to ``closers``."""
    if spec is None:
        return default, None
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        closers.append(fd)
        return fd, None
    if spec == subprocess.PIPE:
        read, write = os.pipe()
        closers.append(write)
        return write, open(read, "rb", buffering=0)
    return spec.fileno(), None


def start(
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd=None,
    stdout=None,
    stderr=None,
    start_new_session: bool = False,
    text: bool = False,
):
    """``args`` (as for subprocess: ``[sys.executable, "-m", module, ...]`` or ``[sys.executable,
    "script.py", ...]``) forked by a warm server when one serves ``env``; a :class:`subprocess.Popen`
    otherwise (other commands too). Either way the command runs with one OpenMP thread unless ``env``
    sets ``OMP_NUM_THREADS`` (two pytest workers share the machine's cores; torch starts no thread at
    import then, which the fork needs)."""
    args = [str(arg) for arg in args]
    env = {"OMP_NUM_THREADS": "1", **(os.environ if env is None else env)}
    cwd = os.path.abspath(cwd or os.getcwd())
    module = args[2] if args[1:2] == ["-m"] else None
    if args[:1] == [sys.executable] and len(args) > 1 and (module or args[1].endswith(".py")):
        header = {"module": module, "args": args[3:] if module else args[1:], "env": env, "cwd": cwd}
        process = _forked(header | {"new_session": start_new_session}, stdout, stderr)
        _log(f"{'warm' if process else 'cold'} {' '.join(args[1:3])}")
        if process is not None:
            process.args, process._text = args, text
            return process
    return subprocess.Popen(
        args, env=env, cwd=cwd, stdout=stdout, stderr=stderr, start_new_session=start_new_session, text=text
    )


def _forked(header: dict, stdout, stderr) -> WarmProcess | None:
    """The command of ``header`` forked by its environment's server; None without one (or if it died:
    it is not started again)."""
    server = _server_for(header["env"])
    if server is None:
        return None
    closers: list[int] = []
    pipes, ours = [], None
    try:
        stdin_fd, _ = _stdio_fd(subprocess.DEVNULL, 0, closers)
        out_fd, out_pipe = _stdio_fd(stdout, 1, closers)
        err_fd, err_pipe = (out_fd, None) if stderr == subprocess.STDOUT else _stdio_fd(stderr, 2, closers)
        pipes = [pipe for pipe in (out_pipe, err_pipe) if pipe is not None]
        ours, theirs = socket.socketpair()
        with theirs:
            server.fork(header, [stdin_fd, out_fd, err_fd], theirs)
        answer = ours.recv(16, socket.MSG_WAITALL)
        if len(answer) < 16:
            raise ConnectionError("the server closed the command's socket")
    except OSError as err:  # the server is gone: every later command of its environment starts cold
        print(f"warm start: no server for this environment ({err}); plain subprocesses", file=sys.stderr)
        server.broken = True
        for pipe in [*pipes, ours]:
            if pipe is not None:
                pipe.close()
        return None
    finally:
        for fd in closers:
            os.close(fd)
    pid, _ = struct.unpack("<qq", answer)
    return WarmProcess(pid, ours, out_pipe, err_pipe)


def run(args: list[str], *, timeout: float | None = None, check: bool = False, **kwargs):
    """:func:`subprocess.run` through :func:`start` (``capture_output``, ``text`` and the rest)."""
    if kwargs.pop("capture_output", False):
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with start(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    result = subprocess.CompletedProcess(args, process.returncode, stdout, stderr)
    if check:
        result.check_returncode()
    return result
