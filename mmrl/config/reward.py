"""The ``worker.reward`` section: the rule file, a judge, a reward model, sandboxed code, and how they
combine; each section's ``check`` beside its fields."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmrl.config.schema import PPOConfig


def split_function_spec(spec: str, default_name: str = "main") -> tuple[str, str]:
    """``"reward.py:compute_score"`` → ``("reward.py", "compute_score")``; no ``:`` → EasyR1's ``main``."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or os.sep in name:
        return spec, default_name
    return path, name


@dataclass(frozen=True)
class RewardSourceConfig:
    """What every reward source's section shares (``mmrl.rewards.source``): its part in the reward."""

    weight: float = 1.0  # weight of the source's `overall` in the reward (weighted sum); 0 = logged only
    failure_score: float = 0.0  # score of a sample the source could not score (counted as <source>/failed)
    # stop the run when more than this fraction of one batch's samples failed in this source; 1 = never
    max_failed_fraction: float = 1.0


@dataclass(frozen=True)
class SandboxConfig:
    """Where model-written code runs (``mmrl.sandbox``): isolation and the limits of one run."""

    # namespaces: user+mount+pid+net namespaces, read-only chroot, no capabilities (kernel-enforced);
    # process: rlimits + a Python audit hook, for kernels that refuse user namespaces (weaker)
    isolation: str = "namespaces"
    max_concurrency: int = 4  # runs at once per reward worker
    cpu_time_s: float = 5.0  # CPU seconds of one run (all its threads), rounded up to whole seconds
    wall_time_s: float = 10.0  # wall-clock seconds of one run, idle or not
    memory_bytes: int = 1 << 30  # address space of each of its processes (a run: max_processes x this)
    file_size_bytes: int = 16 << 20  # largest file it may write
    disk_bytes: int = 64 << 20  # size of its private /sandbox and /tmp (tmpfs, each; namespaces)
    max_processes: int = 8  # processes + threads at once (namespaces)
    max_open_files: int = 64  # file descriptors per process
    max_output_bytes: int = 1 << 20  # stdout + stderr; the run is stopped beyond it
    python: str | None = None  # interpreter the code runs with; null = the reward worker's
    read_only_paths: list[str] = field(default_factory=list)  # more host paths it may read (namespaces)


@dataclass(frozen=True)
class CodeConfig(RewardSourceConfig):
    """Code execution as a reward (source `code`): the response's program against the row's tests."""

    enable: bool = False  # run each response's last ```python block against its row's test cases
    test_cases_key: str = "ground_truth"  # reward-input key (dataset column) holding the test cases
    score: str = "pass_rate"  # the source's overall: pass_rate (fraction of cases) | all_passed (0/1)
    max_test_cases: int = 0  # run at most the first N cases of a row; 0 = all
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    def check(self, check_paths: bool) -> list[str]:
        """Limits that let a program run, and the sandbox's paths (when enabled)."""
        errors: list[str] = []
        if not self.enable:
            return errors
        sandbox, prefix = self.sandbox, "worker.reward.code.sandbox."
        for name in (
            "max_concurrency",
            "cpu_time_s",
            "wall_time_s",
            "memory_bytes",
            "file_size_bytes",
            "disk_bytes",
        ):
            if getattr(sandbox, name) <= 0:
                errors.append(f"{prefix}{name}={getattr(sandbox, name)} must be > 0")
        for name, least in (("max_processes", 1), ("max_open_files", 8), ("max_output_bytes", 1)):
            if getattr(sandbox, name) < least:
                errors.append(f"{prefix}{name}={getattr(sandbox, name)} must be >= {least}")
        if self.max_test_cases < 0:
            errors.append(
                f"worker.reward.code.max_test_cases={self.max_test_cases} must be >= 0 (0 = every case)"
            )
        if not self.test_cases_key:
            errors.append(
                "worker.reward.code.test_cases_key is empty: name the column holding the test cases"
            )
        if not check_paths:
            return errors
        if sandbox.python is not None and not os.path.isfile(sandbox.python):
            errors.append(f"{prefix}python: interpreter '{sandbox.python}' does not exist")
        for path in sandbox.read_only_paths:
            if not os.path.exists(path):
                errors.append(f"{prefix}read_only_paths: '{path}' does not exist")
        return errors


@dataclass(frozen=True)
class JudgeServeConfig:
    """A judge model mmrl serves itself: vLLM's OpenAI-compatible server in a Ray actor of the run."""

    model_path: str | None = None  # Hugging Face folder of the judge to serve; null = use judge.base_url
    num_gpus: float = 0.0  # GPUs of the server's Ray actor (its own devices); 0 on a CPU cluster
    num_cpus: float = 1.0  # CPUs reserved for the server's Ray actor
    gpu_memory_utilization: float = 0.3  # vLLM: fraction of the GPU for weights + KV cache
    cpu_kv_cache_gib: float = 1.0  # vLLM on CPU: KV cache in GiB
    max_model_len: int = 4096  # vLLM context of the judge (prompt with media + answer), tokens
    enforce_eager: bool = True  # vLLM: no graph capture/compilation (starts ~40 s faster on CPU)
    startup_timeout_s: float = 300.0  # seconds the server may take to answer its health check
    # address the server listens on: 127.0.0.1 = its machine only (the reward workers must share it);
    # `node` = the node's address, for reward workers on other machines (the API has no key)
    host: str = "127.0.0.1"


@dataclass(frozen=True)
class JudgeConfig(RewardSourceConfig):
    """A generative judge that sees the sample's media, reached over an OpenAI-compatible API."""

    enable: bool = False  # score responses with the judge (source `judge`)
    base_url: str = ""  # OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (unless serve.model_path)
    api_key_env: str = ""  # environment variable holding the API key (never printed); "" = no key
    model: str = ""  # model name in the requests; "" with serve.model_path = the served folder
    # Jinja file of the judge's prompt: `question`, `response`, `ground_truth` and the row's columns;
    # <image>/<video> markers place the sample's images / video frames; null = mmrl's yes/no prompt
    prompt_template: str | None = None
    parser: str = "yes_no"  # how the answer becomes a score: yes_no | number | rubric
    number_max: float = 10.0  # number parser: the answer's last number n scores n / number_max, in [0, 1]
    unparseable_score: float = 0.0  # score of an answer the parser cannot read (counted: judge/unparseable)
    max_tokens: int = 64  # tokens the judge may answer with
    temperature: float = 0.0  # judge sampling temperature
    video_frames: int = 4  # frames of each video shown to the judge, evenly spaced
    max_concurrency: int = 8  # requests in flight per reward worker
    timeout_s: float = 60.0  # seconds one request may take before it is retried
    max_retries: int = 4  # retries of a request after a timeout, a lost connection, HTTP 429 or 5xx
    backoff_s: float = 1.0  # wait before the first retry, doubled each time (HTTP Retry-After wins)
    cache: bool = True  # answers kept by request (re-scoring and resumed runs do not ask again)
    cache_path: str | None = None  # sqlite file of the cache; null = <checkpoint folder>/judge_cache.sqlite
    serve: JudgeServeConfig = field(default_factory=JudgeServeConfig)


@dataclass(frozen=True)
class RewardModelConfig(RewardSourceConfig):
    """A discriminative reward model scoring prompt + response in the reward workers (source `reward_model`)."""

    # Hugging Face folder: a sequence-classification model (one label), or with head=yes_token any
    # causal or vision-language LM (score = logit(yes) - logit(no) after the prompt); null = off
    model_path: str | None = None
    head: str = "classification"  # classification | yes_token
    # Jinja file of the text the model reads: `question`, `response`, `ground_truth` and the row's
    # columns; null = the question as the user turn and the response as the assistant turn
    prompt_template: str | None = None
    normalize: str = "none"  # none | sigmoid | batch_zscore (the batch's scores to mean 0, std 1)
    batch_size: int = 16  # responses per forward pass
    max_length: int = 2048  # tokens per input; longer inputs keep their end (the response)
    device: str = "auto"  # auto (the reward worker's GPU when it has one) | cuda | cpu
    offload: bool = True  # on a GPU: move the model to CPU memory between batches


@dataclass(frozen=True)
class RewardConfig:
    reward_function: str = ""  # `path/to/file.py:function` (function defaults to `main`)
    reward_function_kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments
    reward_type: str | None = None  # batch | sequential; null = the file's REWARD_TYPE (default batch)
    skip_special_tokens: bool = True  # decode responses without special tokens
    num_workers: int = 1  # reward worker processes (Ray actors)
    num_cpus: float = 1.0  # CPUs reserved per reward worker
    timeout_s: float = 600.0  # seconds a batch may take before the run stops with an error
    # DAPO soft overlong punishment, added to every reward: 0 up to max_response_length minus this many
    # tokens, then falling linearly to -overlong_penalty_factor at max_response_length; 0 = off
    overlong_buffer_length: int = 0
    overlong_penalty_factor: float = 1.0  # the punishment of a response that reaches max_response_length
    # the rule file's part among several sources (source `rule`); alone, its keys are logged unprefixed
    rule: RewardSourceConfig = field(default_factory=RewardSourceConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    code: CodeConfig = field(default_factory=CodeConfig)  # sandboxed code execution (source `code`)
    # several sources: weighted_sum (overall = sum of weight x each source's overall) | rule_function (the
    # rule file runs last, each input holding `source_scores` {source: scores}, and its overall is the reward)
    combine: str = "weighted_sum"
    num_gpus: float = 0.0  # GPUs per reward worker (for a reward model); 0 = CPU

    def check(self, config: PPOConfig, check_paths: bool) -> list[str]:
        """Workers, the overlong punishment, the sources and how they combine."""
        errors = [
            f"worker.reward.{key}={getattr(self, key)} must be > 0"
            for key in ("num_workers", "timeout_s")
            if getattr(self, key) <= 0
        ]
        _check_overlong(errors, config)
        errors += self.code.check(check_paths)
        _check_reward_sources(errors, config)
        return errors


def _check_overlong(errors: list[str], cfg: PPOConfig) -> None:
    reward, max_length = cfg.worker.reward, cfg.data.max_response_length
    if not 0 <= reward.overlong_buffer_length < max_length:
        errors.append(
            f"worker.reward.overlong_buffer_length={reward.overlong_buffer_length} must lie in [0, "
            f"data.max_response_length={max_length}): the punishment starts that many tokens before the "
            "maximum length (0 = off)"
        )
    if reward.overlong_penalty_factor < 0:
        errors.append(
            f"worker.reward.overlong_penalty_factor={reward.overlong_penalty_factor} must be >= 0 "
            "(the punishment of a response reaching data.max_response_length)"
        )


def _check_reward_sources(errors: list[str], cfg: PPOConfig) -> None:
    """The judge can be reached, the sources' numbers make sense, a combining rule file exists."""
    reward = cfg.worker.reward
    judge = reward.judge
    if judge.enable and not judge.base_url and not judge.serve.model_path:
        errors.append(
            "worker.reward.judge.enable=true needs an endpoint: worker.reward.judge.base_url (e.g. "
            "http://127.0.0.1:8000/v1), or worker.reward.judge.serve.model_path for mmrl to serve one"
        )
    if judge.enable and judge.serve.model_path and cfg.trainer.nnodes > 1 and judge.serve.host != "node":
        errors.append(
            f"worker.reward.judge.serve.host={judge.serve.host} with trainer.nnodes={cfg.trainer.nnodes}: reward "
            f"workers on the other machines cannot reach the served judge; set worker.reward.judge.serve.host="
            f"node (its node's address, reachable by anyone on the network: keep the cluster's network private)"
        )
    if judge.enable and judge.base_url and not judge.serve.model_path and not judge.model:
        errors.append(
            "worker.reward.judge.model is required with base_url: the model name the endpoint serves"
        )
    if reward.combine == "rule_function" and not reward.reward_function:
        errors.append(
            "worker.reward.combine=rule_function combines in the rule file: set worker.reward.reward_function"
        )
    sections = {"rule": reward.rule, "judge": judge, "reward_model": reward.reward_model, "code": reward.code}
    for name, section in sections.items():
        if not 0 <= section.max_failed_fraction <= 1:
            errors.append(
                f"worker.reward.{name}.max_failed_fraction={section.max_failed_fraction} must lie in [0, 1]"
            )
    positive = {
        "worker.reward.judge.number_max": judge.number_max,
        "worker.reward.judge.max_tokens": judge.max_tokens,
        "worker.reward.judge.video_frames": judge.video_frames,
        "worker.reward.judge.max_concurrency": judge.max_concurrency,
        "worker.reward.judge.timeout_s": judge.timeout_s,
        "worker.reward.judge.serve.startup_timeout_s": judge.serve.startup_timeout_s,
        "worker.reward.reward_model.batch_size": reward.reward_model.batch_size,
        "worker.reward.reward_model.max_length": reward.reward_model.max_length,
    }
    errors.extend(f"{key}={value} must be > 0" for key, value in positive.items() if value <= 0)
    for key, value in (("judge.max_retries", judge.max_retries), ("judge.backoff_s", judge.backoff_s)):
        if value < 0:
            errors.append(f"worker.reward.{key}={value} must be >= 0")
