"""Shared pieces of the benchmarks that run whole training jobs as subprocesses.

- :func:`run_monitored` starts a command, samples the memory of its whole process tree and stamps every
  new line of its JSON-lines log with the seconds since launch; a ``stop_when`` predicate on a log
  record ends the run early (time-to-accuracy).
- Memory: every ``interval_s`` the resident set sizes (RSS) of the process and all its descendants
  are summed (psutil); the peak of that sum is the run's ``peak_rss_bytes``. For mmrl the tree is the
  driver, the Ray processes it starts (GCS, raylet, ...) and the Ray workers (FSDP worker, reward
  worker), so the number is what the job costs the machine. Shared pages (libraries, Ray's object store
  in /dev/shm) count once per process that maps them, so the sum is an upper bound; a peak shorter than
  the interval can be missed. ``by_process`` splits CPU seconds and the RSS at the peak by process
  (driver, ``ray::_WorkerHost``, ``ray::RewardScorer``, raylet, ...).
- ``other_load_cores``: busy CPU time of the machine outside the tree per second of the run, i.e. what
  other jobs took from a shared machine; a run with a high value was slowed by them.
- :func:`mmrl_command` / :func:`trl_command`: one job of each trainer with the same settings
  (:class:`JobSettings`); ``bench/trl_grpo.py`` lists how each setting maps onto both.
- :func:`mmrl_step_records` / :func:`trl_step_records` turn both trainers' logs into one step-record
  layout, :func:`summarize_steps` takes medians after a warm-up, :func:`markdown_table` prints.

Runs started here are ended by their own pids (SIGTERM, then SIGKILL of what is left of their tree).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
KIND = "qwen2_5_vl"
GiB = 1024**3


# ---- memory of a process tree -------------------------------------------------------------------


@dataclass
class TreeSample:
    """One look at a process tree: each live process's RSS, CPU seconds so far and psutil handle."""

    rss_bytes: dict[int, int] = field(default_factory=dict)
    cpu_s: dict[int, float] = field(default_factory=dict)
    processes: dict[int, Any] = field(default_factory=dict)  # psutil handles

    @property
    def total_rss_bytes(self) -> int:
        return sum(self.rss_bytes.values())


def process_label(process: Any) -> str:
    """A short name: Ray's processes by their title (``ray::_WorkerHost``, ``ray::RewardScorer``,
    ``ray::IDLE``), Python ones by module or script, others by executable."""
    command = process.cmdline()
    if command and command[0].startswith("ray::"):
        return command[0].split(".")[0].split(" ")[0]  # "ray::_WorkerHost.execute" -> "ray::_WorkerHost"
    name = process.name()
    if not name.startswith("python"):
        return name
    module = next((command[i + 1] for i, arg in enumerate(command[:-1]) if arg == "-m"), None)
    script = next((Path(arg).name for arg in command[1:] if arg.endswith(".py")), None)
    return module or script or name


def tree_usage(pid: int) -> TreeSample:
    """RSS and CPU seconds (user + system) of ``pid`` and all its descendants (processes that vanish
    while being read are skipped)."""
    import psutil

    sample = TreeSample()
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return sample
    for process in processes:
        try:
            rss = process.memory_info().rss
            times = process.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        sample.rss_bytes[process.pid] = rss
        sample.cpu_s[process.pid] = times.user + times.system
        sample.processes[process.pid] = process
    return sample


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent not idle since boot (all cores)."""
    import psutil

    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


class TreeMemorySampler:
    """Background thread sampling a process tree every ``interval_s``: the peak of its summed RSS (and
    each process's share at that moment), and the CPU each process used. ``other_load_cores`` is the
    machine's busy CPU time that the tree did not use, per second of the run: load from other jobs on
    a shared machine (0 on a quiet one; the sampler's own polling is part of it)."""

    def __init__(self, pid: int, interval_s: float = 0.25):
        self.pid = pid
        self.interval_s = interval_s
        self.peak = TreeSample()
        self.cpu_s: dict[int, float] = {}
        self.processes: dict[int, Any] = {}  # every process of the tree seen, as psutil handles
        self.labels: dict[int, str] = {}  # the last title seen while the process lived
        self.other_load_cores = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total_rss_bytes

    def by_process(self) -> dict[str, dict[str, float]]:
        """Per process label: CPU seconds over the run and RSS (GiB) at the tree's peak."""
        summary: dict[str, dict[str, float]] = {}
        for pid in self.processes:
            entry = summary.setdefault(self.labels.get(pid, str(pid)), {"cpu_s": 0.0, "rss_at_peak_gib": 0.0})
            entry["cpu_s"] += self.cpu_s.get(pid, 0.0)
            entry["rss_at_peak_gib"] += self.peak.rss_bytes.get(pid, 0) / GiB
        return dict(sorted(summary.items(), key=lambda item: -item[1]["cpu_s"]))

    def __enter__(self) -> TreeMemorySampler:
        self._start_s, self._start_busy_s = time.perf_counter(), busy_cpu_seconds()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        wall_s = max(time.perf_counter() - self._start_s, 1e-9)
        foreign_s = busy_cpu_seconds() - self._start_busy_s - sum(self.cpu_s.values())
        self.other_load_cores = max(foreign_s, 0.0) / wall_s

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            sample = tree_usage(self.pid)
            if sample.total_rss_bytes > self.peak.total_rss_bytes:
                self.peak = sample
            self.cpu_s.update(sample.cpu_s)
            self.processes.update(sample.processes)
            for pid, process in sample.processes.items():  # Ray retitles its workers once they start
                with contextlib.suppress(psutil.Error):  # gone meanwhile: keeps its last label
                    self.labels[pid] = process_label(process)
            self._stop.wait(self.interval_s)


# ---- running a job ------------------------------------------------------------------------------


@dataclass
class RunResult:
    returncode: int | None  # None when stopped early by ``stop_when``
    wall_s: float  # launch to exit
    peak_rss_bytes: int
    other_load_cores: float  # CPU load of other jobs during the run (see TreeMemorySampler)
    by_process: dict[str, dict[str, float]] = field(default_factory=dict)  # CPU s, RSS at peak
    process_counts: dict[str, int] = field(default_factory=dict)  # processes seen, per label
    records: list[dict[str, Any]] = field(default_factory=list)  # log lines, each with "_time_s"
    stopped_early: bool = False
    output_file: str = ""


class _LogFollower:
    """Reads the complete lines appended to a JSON-lines file since the last call."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = ""

    def new_records(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        with open(self.path, encoding="utf-8") as handle:
            handle.seek(self._offset)
            text = handle.read()
            self._offset = handle.tell()
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()  # an unfinished last line waits for the next call
        return [json.loads(line) for line in lines if line.strip()]


def _end_tree(process: subprocess.Popen, tree: dict[int, Any], grace_s: float = 5.0) -> None:
    """SIGTERM to the run, then SIGKILL to it and to every process of its tree seen while it ran
    (Ray's processes outlive a killed driver; psutil refuses a pid that was reused meanwhile). Not
    SIGINT: a shell's background job ignores it, and so do the job's children."""
    import psutil

    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for pid, member in tree.items():
        if pid != process.pid:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.kill()


def run_monitored(
    command: Sequence[str],
    log_file: Path,
    output_file: Path,
    timeout_s: float,
    stop_when: Callable[[dict[str, Any]], bool] | None = None,
    env: dict[str, str] | None = None,
    interval_s: float = 0.25,
    cwd: Path = REPO,
) -> RunResult:
    """Run ``command`` (stdout and stderr to ``output_file``) while sampling its tree's memory and
    following ``log_file``, in ``cwd`` (another checkout runs its own mmrl). Ends it when a log record satisfies ``stop_when`` or after ``timeout_s``;
    raises ``RuntimeError`` (with the output's tail) when it fails on its own. The tree is ended
    however this returns or raises."""
    log_file.unlink(missing_ok=True)
    follower = _LogFollower(log_file)
    records: list[dict[str, Any]] = []
    full_env = {**os.environ, **(env or {})}
    start = time.perf_counter()
    stopped = timed_out = False
    with open(output_file, "w") as output:
        process = subprocess.Popen(
            list(command), stdout=output, stderr=subprocess.STDOUT, env=full_env, cwd=cwd
        )
        sampler = TreeMemorySampler(process.pid, interval_s)
        try:
            with sampler:
                while process.poll() is None and not (stopped or timed_out):
                    time.sleep(interval_s)
                    for record in follower.new_records():
                        record["_time_s"] = time.perf_counter() - start
                        records.append(record)
                        stopped = stopped or (stop_when is not None and stop_when(record))
                    timed_out = time.perf_counter() - start > timeout_s
                wall_s = time.perf_counter() - start
        finally:
            _end_tree(process, sampler.processes)
    for record in follower.new_records():
        record["_time_s"] = wall_s
        records.append(record)
    if not stopped and (timed_out or process.returncode != 0):
        tail = Path(output_file).read_text(errors="replace")[-3000:]
        reason = f"timed out after {timeout_s:.0f} s" if timed_out else f"exit code {process.returncode}"
        raise RuntimeError(f"{' '.join(command[:4])} ... {reason}; output {output_file}:\n{tail}")
    return RunResult(
        returncode=None if stopped else process.returncode,
        wall_s=wall_s,
        peak_rss_bytes=sampler.peak_bytes,
        other_load_cores=sampler.other_load_cores,
        by_process=sampler.by_process(),
        process_counts=dict(collections.Counter(sampler.labels.values())),
        records=records,
        stopped_early=stopped,
        output_file=str(output_file),
    )


# ---- the same job for both trainers ------------------------------------------------------------


@dataclass(frozen=True)
class JobSettings:
    """One GRPO job on the synthetic colour task, as both trainers run it."""

    model: str
    data_dir: str
    prompts: int  # prompts per rollout (step)
    n: int  # responses per prompt
    response_length: int  # max new tokens
    force_length: bool  # every response exactly response_length tokens (no EOS)
    micro_batch: int  # responses per forward/backward
    lr: float
    steps: int  # rollouts (mmrl steps)
    updates_per_rollout: int = 1  # optimizer steps per rollout
    val_every: int = 0  # validate every k steps (and before training); 0 = never
    kl_coef: float = 0.0  # weight of a k3 KL loss to the starting model; 0 = no KL, no reference model
    seed: int = 1


def mmrl_command(job: JobSettings, backend: str, out_dir: Path) -> tuple[list[str], Path]:
    """``python -m mmrl.trainer.main key=value ...`` for ``job`` with one training process, and the
    jsonl log it writes. ``backend``: ``hf`` or ``vllm`` (eager)."""
    from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS

    data = Path(job.data_dir)
    overrides = {
        "data.train_files": data / "train.jsonl",
        "data.max_prompt_length": 128,
        "data.max_response_length": job.response_length,
        "data.rollout_batch_size": job.prompts,
        "data.min_pixels": MIN_PIXELS,
        "data.max_pixels": MAX_PIXELS,
        "data.seed": job.seed,
        "algorithm.disable_kl": str(job.kl_coef == 0).lower(),
        "algorithm.use_kl_loss": "true",
        "algorithm.kl_penalty": "low_var_kl",
        "algorithm.kl_coef": job.kl_coef,
        "worker.actor.global_batch_size": job.prompts // job.updates_per_rollout,
        "worker.actor.micro_batch_size_per_device_for_update": job.micro_batch,
        "worker.actor.micro_batch_size_per_device_for_experience": job.micro_batch,
        "worker.actor.model.model_path": job.model,
        "worker.actor.model.enable_gradient_checkpointing": "false",
        # one rank holds whole parameters anyway: keep them gathered from forward to backward
        "worker.actor.fsdp.enable_full_shard": "false",
        "worker.actor.optim.lr": job.lr,
        "worker.actor.optim.weight_decay": 0.0,
        "worker.rollout.name": backend,
        "worker.rollout.n": job.n,
        "worker.rollout.ignore_eos": str(job.force_length).lower(),
        "worker.rollout.enforce_eager": "true",
        "worker.rollout.val_override_config.temperature": 0,
        "worker.rollout.val_override_config.n": 1,
        "worker.reward.reward_function": f"{REPO / 'reward_functions' / 'shapes.py'}:compute_score",
        "trainer.max_steps": job.steps,
        "trainer.total_epochs": 1000,
        "trainer.logger": "[jsonl]",
        "trainer.n_gpus_per_node": 1,
        "trainer.device": "cpu",
        "trainer.seed": job.seed,
        "trainer.val_freq": job.val_every if job.val_every > 0 else -1,
        "trainer.val_before_train": str(job.val_every > 0).lower(),
        "trainer.save_freq": -1,
        "trainer.save_checkpoint_path": out_dir,
        "trainer.find_last_checkpoint": "false",
    }
    if job.val_every > 0:
        overrides["data.val_files"] = data / "val.jsonl"
    command = [sys.executable, "-m", "mmrl.trainer.main", *(f"{k}={v}" for k, v in overrides.items())]
    return command, out_dir / "logs" / "metrics.jsonl"


def trl_command(job: JobSettings, log_file: Path, threads: int) -> list[str]:
    """``python bench/trl_grpo.py ...`` for ``job`` (TRL's transformers generation)."""
    command = [
        sys.executable,
        str(BENCH_DIR / "trl_grpo.py"),
        f"--model={job.model}",
        f"--data_dir={job.data_dir}",
        f"--log={log_file}",
        f"--prompts={job.prompts}",
        f"--n={job.n}",
        f"--response_length={job.response_length}",
        f"--micro_batch={job.micro_batch}",
        f"--updates_per_rollout={job.updates_per_rollout}",
        f"--lr={job.lr}",
        f"--steps={job.steps}",
        f"--threads={threads}",
        f"--seed={job.seed}",
        f"--val_every={job.val_every}",
        f"--beta={job.kl_coef}",
    ]
    return command + (["--force_length"] if job.force_length else [])


# ---- one step-record layout for both trainers ---------------------------------------------------


def mmrl_step_records(records: list[dict[str, Any]], responses_per_step: int) -> list[dict[str, Any]]:
    """mmrl's ``metrics.jsonl`` lines → ``{step, step_s, gen_s, prompt_tokens, response_tokens}`` for
    the lines of training steps (validation-only lines, e.g. step 0, have no ``timing_s/step``)."""
    steps = []
    for record in records:
        if record.get("timing_s/step") is None:
            continue
        steps.append(
            {
                "step": record["step"],
                "step_s": record["timing_s/step"],
                "gen_s": record["timing_s/gen"],
                "prompt_tokens": record["prompt_length/mean"] * responses_per_step,
                "response_tokens": record["response_length/mean"] * responses_per_step,
            }
        )
    return steps


def trl_step_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``bench/trl_grpo.py`` log lines → the same layout (its step lines already have it)."""
    return [record for record in records if "step_s" in record]


def validation_records(records: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """``{step, accuracy, time_s}`` of every log line holding the validation metric ``key``."""
    return [
        {"step": record["step"], "accuracy": record[key], "time_s": record["_time_s"]}
        for record in records
        if record.get(key) is not None
    ]


def summarize_steps(steps: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Medians over the steps after the first ``warmup`` ones.

    ``rollout_tokens_per_s`` = response tokens / generation seconds; ``train_tokens_per_s`` = prompt +
    response tokens / (step − generation) seconds, i.e. everything of the step that is not sampling
    (log-prob passes, reward, update, weight sync); ``tokens_per_s`` = the same tokens / step seconds.
    """
    timed = steps[warmup:]
    if not timed:
        raise ValueError(f"no step after the {warmup} warm-up step(s): got {len(steps)} steps")

    def median(values: list[float]) -> float:
        return float(statistics.median(values))

    return {
        "timed_steps": len(timed),
        "s_per_step": median([s["step_s"] for s in timed]),
        "s_per_step_runs": [s["step_s"] for s in timed],
        "gen_s": median([s["gen_s"] for s in timed]),
        "rollout_tokens_per_s": median([s["response_tokens"] / s["gen_s"] for s in timed]),
        "train_tokens_per_s": median(
            [(s["prompt_tokens"] + s["response_tokens"]) / (s["step_s"] - s["gen_s"]) for s in timed]
        ),
        "tokens_per_s": median([(s["prompt_tokens"] + s["response_tokens"]) / s["step_s"] for s in timed]),
        "prompt_tokens_per_step": median([s["prompt_tokens"] for s in timed]),
        "response_tokens_per_step": median([s["response_tokens"] for s in timed]),
    }


def first_reaching(validations: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first validation whose accuracy is at least ``target`` (None if none is)."""
    return next((v for v in validations if v["accuracy"] >= target - 1e-9), None)


def training_seconds_until(steps: list[dict[str, Any]], step: int) -> float:
    """Summed step seconds of steps 1..``step`` (startup and validation excluded)."""
    return float(sum(s["step_s"] for s in steps if s["step"] <= step))


# ---- assets and printing ------------------------------------------------------------------------


def build_models_and_data(sizes: Sequence[str], n_train: int = 512, n_val: int = 64) -> dict[str, Any]:
    """Tiny Qwen2.5-VL models of ``sizes`` and the synthetic colour task under ``bench/results``
    (each returns at once when already built)."""
    from mmrl.demo.synthetic import generate_shapes_dataset
    from mmrl.demo.tiny import build_tiny_model, count_parameters, tiny_model_path

    data_dir = generate_shapes_dataset(
        "color", RESULTS / "data" / "shapes-color", n_train=n_train, n_val=n_val
    )
    models = {
        size: str(build_tiny_model(KIND, tiny_model_path(KIND, size, RESULTS / "models"), size))
        for size in sizes
    }
    params = {size: count_parameters(KIND, size) for size in sizes}
    return {"data_dir": str(data_dir), "models": models, "params": params}


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats are printed as given (format them first)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(name: str, payload: dict[str, Any], out: Path | None = None) -> Path:
    """``payload`` as JSON in ``bench/results/name``, or in ``out`` (a bench's ``--out``)."""
    out = RESULTS / name if out is None else out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    return out
