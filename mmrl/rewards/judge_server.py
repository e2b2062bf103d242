"""A judge model that mmrl serves itself: vLLM's OpenAI-compatible server in a Ray actor of the run.

:func:`serve_judge` starts a Ray actor (its own CPUs and GPUs: ``worker.reward.judge.serve.num_cpus``,
``num_gpus``) that runs ``python -m vllm.entrypoints.openai.api_server`` on a free port of its node,
waits until the server answers ``/health``, and returns a :class:`ServedJudge` with the URL the reward
workers' judge client uses, the same client as for any other endpoint. The server listens on loopback
(``serve.host``: 127.0.0.1) unless told otherwise (``node``: the node's address, for reward workers on
other machines): vLLM's API has no key here, so nothing off the machine should reach it by default. The trainer stops it when the run
ends. The server runs in a session of its own with a parent-death signal (SIGTERM): when the actor dies
(killed, or the run's Ray cluster goes), the server shuts down with its engine processes, and ``stop``
ends its whole process group. Its ZMQ sockets and temporary files live in a folder of the actor's own,
removed at stop.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmrl.rewards.source import RewardSourceError

if TYPE_CHECKING:
    from mmrl.config import JudgeConfig

_LOG_TAIL_LINES = 30  # of the server's output, in the message when it fails to start
_PR_SET_PDEATHSIG = 1


@dataclass
class ServedJudge:
    """The driver's handle on the judge server actor."""

    actor: Any
    base_url: str
    model: str

    def stop(self) -> None:
        import ray

        with contextlib.suppress(Exception):  # the actor may be gone already; it is killed either way
            ray.get(self.actor.stop.remote(), timeout=60)
        ray.kill(self.actor)


def serve_judge(judge: JudgeConfig) -> ServedJudge | None:
    """Starts the judge server of ``judge.serve`` (None when ``serve.model_path`` is null)."""
    serve = judge.serve
    if not serve.model_path:
        return None
    import ray

    name = judge.model or serve.model_path
    args = ["--max-model-len", str(serve.max_model_len)]
    args += ["--enforce-eager"] if serve.enforce_eager else []
    if serve.num_gpus > 0:
        args += ["--gpu-memory-utilization", str(serve.gpu_memory_utilization)]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, round(serve.cpu_kv_cache_gib)))}
    remote_cls = ray.remote(num_cpus=serve.num_cpus, num_gpus=serve.num_gpus)(VllmServer)
    actor = remote_cls.options(name=f"mmrl-judge-{os.getpid()}").remote(
        serve.model_path, name, args, env, host=serve.host
    )
    try:
        base_url = ray.get(actor.start.remote(serve.startup_timeout_s))
    except ray.exceptions.RayTaskError as err:
        ray.kill(actor)
        raise RewardSourceError(str(err.cause)) from None
    print(f"mmrl: judge {name} served at {base_url}", flush=True)
    return ServedJudge(actor, base_url, name)


class VllmServer:
    """One vLLM OpenAI-compatible server process (in the Ray actor; tests use it directly)."""

    def __init__(
        self, model_path: str, served_name: str, args: list[str], env: dict[str, str], host: str = "127.0.0.1"
    ):
        """``host``: the address to listen on; ``node`` = this node's address (reachable from others)."""
        self.model_path = model_path
        self.host = host
        self.served_name = served_name
        self.args = args
        self.env = env
        self.process: subprocess.Popen | None = None
        self.socket_dir: str | None = None
        self.log: deque[str] = deque(maxlen=_LOG_TAIL_LINES)
        self.base_url = ""

    def start(self, timeout_s: float) -> str:
        """Launches the server and returns its base URL (``http://<host>:<port>/v1``) once it is
        healthy; raises :class:`RewardSourceError` with the end of its log if it exits or times out."""
        from mmrl.runtime.debris import make_temp_dir

        host = listen_address(self.host)
        port = _free_port(host)
        self.socket_dir = make_temp_dir("judge")
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path]
        command += ["--served-model-name", self.served_name, "--host", host, "--port", str(port), *self.args]
        env = {**os.environ, **self.env, **_own_temp_dir(self.socket_dir)}
        self.process = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: stop() ends vLLM's engine process too
            preexec_fn=_die_with_parent,
        )
        _drain(self.process, self.log)
        self.base_url = f"http://{host}:{port}/v1"
        self._wait_healthy(f"http://{host}:{port}/health", timeout_s)
        return self.base_url

    def _wait_healthy(self, url: str, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._fail(f"exited with code {self.process.returncode} while starting")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self._fail(f"did not answer {url} within worker.reward.judge.serve.startup_timeout_s={timeout_s:g}")

    def _fail(self, what: str) -> None:
        tail = "\n".join(self.log)
        self.stop()
        raise RewardSourceError(f"the judge server for {self.model_path} {what}; its last output:\n{tail}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def stop(self) -> None:
        """Ends the server's process group (SIGTERM, then SIGKILL after 10 s) and removes its sockets."""
        if self.process is not None and self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
        if self.process is not None:
            _signal_group(self.process.pid, signal.SIGKILL)  # whatever of the group outlived the server
            self.process.wait()
        if self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            self.socket_dir = None


def _own_temp_dir(folder: str) -> dict[str, str]:
    """The server's environment for ``folder``, removed at stop: its ZMQ sockets and every temporary
    file (``TMPDIR``: the file its engine's process group rendezvous through, which vLLM leaves in the
    system's temporary folder) go there, while torch's compile cache stays where it was (shared by runs
    and kept)."""
    import getpass
    import re
    import tempfile

    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not cache:  # torch's default, computed without importing torch here
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = f"uid_{os.getuid()}"
        cache = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    return {"VLLM_RPC_BASE_PATH": folder, "TMPDIR": folder, "TORCHINDUCTOR_CACHE_DIR": cache}


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _die_with_parent() -> None:
    """In the server process before exec: SIGTERM when the actor process dies (Linux). Not SIGKILL: vLLM's
    server shuts its engine processes down on SIGTERM, while a killed server leaves them orphaned."""
    import ctypes

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _drain(process: subprocess.Popen, log: deque[str]) -> None:
    """Keeps the last lines of the server's output (a thread reads it, so the pipe never fills)."""
    import threading

    def read() -> None:
        for line in process.stdout:
            log.append(line.rstrip())

    threading.Thread(target=read, name="judge-server-log", daemon=True).start()


def listen_address(host: str) -> str:
    """The address a served judge listens on for ``worker.reward.judge.serve.host``."""
    return _node_ip() if host == "node" else host


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
