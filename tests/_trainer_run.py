"""Run ``python -m mmrl.trainer.main`` for a few steps on the tiny VL model and read its metrics."""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import _warm_start as warm
import psutil

REPO_ROOT = Path(__file__).resolve().parents[1]
# dense (distinct characters of the response): GRPO advantages are non-zero from the first step
FINGERPRINT_REWARD = REPO_ROOT / "tests/trainer/assets/fingerprint_reward.py"
# the fingerprint reward's scores and reward/rows, which records the dataset rows a step trained
ROW_REWARD = REPO_ROOT / "tests/trainer/assets/row_reward.py"
# the agent demo's tool: one call without arguments, returning an image (the multi-turn runs)
ZOOM_CENTER_TOOL = REPO_ROOT / "examples/tools/zoom_center.py"
# the frame sizes of image_video_data_dir's videos (tests/conftest.py): 56x56 as written, 16 tokens
VIDEO_OVERRIDES = ["data.video_min_pixels=3136", "data.video_max_pixels=50176"]


def small_run_overrides(model_path, data_dir, save_dir) -> list[str]:
    """A 2-step, 2-worker run on the colour images with the fingerprint reward; append to change it."""
    return [
        f"data.train_files={Path(data_dir) / 'train.jsonl'}",
        f"data.val_files={Path(data_dir) / 'val.jsonl'}",
        "data.max_prompt_length=64",
        "data.max_response_length=4",
        "data.rollout_batch_size=4",
        "data.min_pixels=3136",
        "data.max_pixels=50176",
        f"worker.actor.model.model_path={model_path}",
        "worker.actor.model.enable_gradient_checkpointing=false",
        "worker.actor.global_batch_size=4",
        "worker.actor.optim.lr=0.02",
        "worker.rollout.n=4",
        # vLLM without torch.compile: each engine start compiles again on this CPU (vLLM 0.32 cannot load
        # its AOT cache there), ~20 s a run; test_vllm_rollout's trainer run keeps the compiled default
        "worker.rollout.enforce_eager=true",
        f"worker.reward.reward_function={FINGERPRINT_REWARD}:compute_score",
        "trainer.max_steps=2",
        "trainer.logger=[jsonl]",
        "trainer.n_gpus_per_node=2",
        "trainer.device=cpu",
        "trainer.save_freq=-1",
        f"trainer.save_checkpoint_path={save_dir}",
    ]


def with_longer_prompts(data_dir, out_dir, rows: slice = slice(0, None, 3)) -> Path:
    """A copy of ``data_dir`` whose training prompts ``rows`` (every third) are a few tokens longer: loader
    batches then pad their prompts to different widths, as real data's do (the colour task's prompts
    are all alike)."""
    import shutil

    out_dir = Path(shutil.copytree(data_dir, out_dir))
    lines = [json.loads(line) for line in (out_dir / "train.jsonl").read_text().splitlines()]
    for line in lines[rows]:
        line["problem"] += " Look closely first."
    (out_dir / "train.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return out_dir


def run_main(overrides: list[str], save_dir, timeout_s: float = 300, env: dict | None = None) -> list[dict]:
    """Run the trainer to completion (it must exit 0 and leave nothing behind: see
    :func:`assert_left_nothing`), with ``env`` added to this process's environment; returns its
    metrics.jsonl rows."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with warm.start(
        [sys.executable, "-m", "mmrl.trainer.main", *overrides],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as run:
        try:
            stdout, stderr = run.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            run.kill()
            raise
    assert run.returncode == 0, stdout[-4000:] + stderr[-4000:]
    assert_left_nothing(run.pid)
    return metrics_rows(save_dir)


def train_on_both_backends(
    overrides: list[str], save_dir, transformers: tuple = (), vllm: tuple = (), timeout_s: float = 600
) -> list[dict]:
    """A 4-step run of two stages (``trainer.stages``) in one command: steps 1-2 on the transformers
    rollout (``transformers``: more overrides for them), saved; steps 3-4 on vLLM (``vllm``: more
    overrides) by fresh workers, which load that checkpoint. The metrics rows of the 4 updates."""
    stages = {"hf": ["worker.rollout.name=hf", *transformers], "vllm": ["worker.rollout.name=vllm", *vllm]}
    schedule = ", ".join(
        f"{{name: {name}, steps: 2, overrides: [{', '.join(keys)}]}}" for name, keys in stages.items()
    )
    common = [*overrides, "trainer.save_freq=2", "trainer.max_steps=null", f"trainer.stages=[{schedule}]"]
    run_main(common, save_dir, 2 * timeout_s)
    return [row for row in metrics_rows(save_dir) if "actor/grad_norm" in row]


def metrics_rows(save_dir) -> list[dict]:
    """The rows of a run's metrics.jsonl (none when it wrote none)."""
    path = Path(save_dir) / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def assert_left_nothing(driver_pid: int, timeout_s: float = 15) -> None:
    """The exited driver ``driver_pid`` left no Ray session folder, no Ray process of its session (they
    may take a moment to exit) and no temp folder of its own."""
    from mmrl.runtime import debris

    session = os.path.join(debris.ray_temp_dir(), f"session_*_{driver_pid}")
    assert not glob.glob(session), f"the run left its Ray session folder {glob.glob(session)}"
    folders = glob.glob(os.path.join(tempfile.gettempdir(), f"mmrl-*-{driver_pid}-*"))
    assert not folders, f"the run left temp folders {folders}"
    deadline = time.monotonic() + timeout_s
    while (alive := _session_processes(session)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"processes of the run's Ray session still running: {alive}"


def _session_processes(session_glob: str) -> list[str]:
    from mmrl.runtime import debris

    return [
        f"{pid} {cmdline[:60]}"
        for pid, (cmdline, files) in debris.user_processes().items()
        if any(fnmatch.fnmatch(path, session_glob + "/*") for path in files)
    ]


def session_processes(session_id: int) -> list[psutil.Process]:
    """Live (not zombie) processes of the session ``session_id``."""
    found = []
    for process in psutil.process_iter(["status"]):
        try:
            if os.getsid(process.pid) == session_id and process.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (OSError, psutil.Error):
            continue  # exited meanwhile
    return found


def kill_session(process: subprocess.Popen) -> None:
    """Kills the trainer's process group and every process left in its session, by pid; never raises."""
    with contextlib.suppress(OSError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=30)
    for leftover in session_processes(process.pid):
        with contextlib.suppress(psutil.Error):
            leftover.kill()


def trained_rows(row: dict, n: int) -> list[int]:
    """The dataset rows a step trained (its metrics line ``row``, n responses per prompt), read from the
    ``reward/rows`` of ``ROW_REWARD``: the sum of 2**row over the step's prompts."""
    total = round(row["reward/rows"] * row["rollout/generated_responses"] / n)
    return [bit for bit in range(total.bit_length()) if total >> bit & 1]


def video_rows(data_dir) -> set[int]:
    """The rows of ``data_dir``'s ``train.jsonl`` whose prompt is a video."""
    lines = (Path(data_dir) / "train.jsonl").read_text().splitlines()
    return {index for index, line in enumerate(lines) if "videos" in json.loads(line)}


def loader_rows(prompts: int, batch_size: int, batches: int) -> list[list[int]]:
    """The dataset rows of the training loader's first ``batches`` batches (default shuffling seed)."""
    from mmrl.data.loader import PromptLoader

    loader = PromptLoader(list(range(prompts)), batch_size, collate_fn=list)
    return [rows for rows, _ in zip(loader, range(batches))]


class KilledRun(NamedTuple):
    output: str  # what the run wrote before its death
    pid: int  # the driver's: after a resume, ``assert_left_nothing(pid)`` checks that nothing of it remains


def run_killed(
    overrides: list[str], fault: str, log_path: Path, timeout_s: float = 300, orphans_exit_s: float = 0
) -> KilledRun:
    """Run the trainer until it SIGKILLs itself at ``fault`` (``<phase>:<step>``, see
    ``mmrl.trainer.ray_trainer.fault_point``), as a crashed machine stops it, then kill what is left of
    its session (Ray's processes, as the machine's end would); its output is written to ``log_path``
    (Ray's processes outlive the driver holding a pipe's end). With ``orphans_exit_s``, the driver's
    death alone must end every process of its session (Ray's, the training ranks, the rollout workers)
    within that many seconds: a kill -9 of the driver leaks no process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MMRL_FAULT_AT": fault}
    with open(log_path, "wb") as log:
        run = warm.start(
            [sys.executable, "-m", "mmrl.trainer.main", *overrides],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    orphans = []
    try:
        returncode = run.wait(timeout=timeout_s)
        died, deadline = time.monotonic(), time.monotonic() + orphans_exit_s
        while (orphans := session_processes(run.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        orphans = [_describe(process) for process in orphans]
        if orphans_exit_s:
            print(f"{fault}: the session ended {time.monotonic() - died:.1f} s after the driver's death")
    finally:
        kill_session(run)
    output = Path(log_path).read_text(errors="replace")
    assert returncode == -signal.SIGKILL, output[-4000:]
    assert not orphans_exit_s or not orphans, f"{orphans_exit_s:g} s after the driver's SIGKILL: {orphans}"
    return KilledRun(output, run.pid)


def _describe(process: psutil.Process) -> str:
    return f"{process.pid} {command_of(process)[:80] or '(exited)'}"


def name_of(process: psutil.Process) -> str:
    """The process's name (a Ray worker's ``ray::Class``), or "" once it has exited."""
    with contextlib.suppress(psutil.Error):
        return process.name()
    return ""


def command_of(process: psutil.Process) -> str:
    """The process's command line as one string, or "" once it has exited."""
    with contextlib.suppress(psutil.Error):
        return " ".join(process.cmdline())
    return ""


def merged_and_base(actor_dir, target_dir, base_path) -> tuple[dict, dict]:
    """``scripts/model_merger.py`` on a checkpoint's actor folder into ``target_dir`` (it must succeed);
    the merged model's and the base model's (``base_path``) fp32 state dicts, as transformers loads them."""
    import torch
    from transformers import AutoModelForImageTextToText

    merger = [sys.executable, "scripts/model_merger.py", "--local_dir", str(actor_dir)]
    merger += ["--target_dir", str(target_dir)]
    warm.run(merger, cwd=REPO_ROOT, check=True, capture_output=True, timeout=120)
    return tuple(
        AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).state_dict()
        for path in (target_dir, base_path)
    )
