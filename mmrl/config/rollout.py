"""The ``worker.rollout`` section: the generation engine, sampling, multi-turn agentic rollouts; each
section's ``check`` beside its fields."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmrl.config.schema import PPOConfig


SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "seed")


@dataclass(frozen=True)
class MultiTurnConfig:
    """Multi-turn agentic rollouts (mmrl.agent): the model calls tools or acts in an environment."""

    enable: bool = False  # off: one prompt, one response (the single-turn path, unchanged)
    tools: list[str] = field(default_factory=list)  # tool files: each public function is a tool
    environment: str | None = None  # path.py:ClassName of an environment (reset/step); instead of tools
    max_turns: int = 4  # model turns per trajectory
    tool_timeout: float = (
        30.0  # seconds one tool call (environment step) may run before it is answered as an error
    )
    max_concurrency: int = 8  # tool calls (environment steps) running at once on a worker
    max_observation_tokens: int = (
        1024  # tokens of one tool/environment turn; longer text is cut with a marker
    )
    # lockstep: a batch's next model turns are sampled together, after the turn's last tool call
    # (environment step) returned; as_ready: a trajectory's next turn is sampled as soon as its own calls
    # returned, beside the others ready then (tools of uneven latency stall no one; the batches then
    # depend on timing, so a run is not reproduced bit for bit)
    turn_schedule: str = "lockstep"

    def check(self) -> list[str]:
        errors: list[str] = []
        if not self.enable:
            return errors
        key = "worker.rollout.multi_turn"
        if bool(self.tools) == bool(self.environment):
            errors.append(
                f"{key}.enable=true needs either {key}.tools (tool files) or {key}.environment (path.py:Class)"
            )
        for path in self.tools:
            if not os.path.isfile(path):
                errors.append(f"{key}.tools: '{path}' is not a file")
        if self.environment and ":" not in self.environment:
            errors.append(f"{key}.environment='{self.environment}' must be path.py:ClassName")
        if self.max_turns < 1:
            errors.append(f"{key}.max_turns={self.max_turns} must be >= 1")
        if self.tool_timeout <= 0 or self.max_concurrency < 1 or self.max_observation_tokens < 32:
            errors.append(
                f"{key}: tool_timeout must be > 0, max_concurrency >= 1, max_observation_tokens >= 32"
            )
        return errors


@dataclass(frozen=True)
class RolloutConfig:
    name: str = "vllm"  # generation backend: vllm | hf (transformers generate)
    n: int = 5  # responses sampled per prompt
    temperature: float = 1.0  # sampling temperature; 0 = greedy
    top_p: float = 1.0  # nucleus sampling mass
    top_k: int = -1  # top-k sampling; -1 = off
    seed: int = 1  # sampling seed (the same on every rank of a tensor-parallel group)
    dtype: str = "auto"  # engine dtype: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    tensor_parallel_size: int = 1  # vLLM tensor parallelism; 1 = one engine per training process
    # vLLM: share of the GPU's *total* memory the engine takes while awake (weights, activations, the KV
    # cache in the rest); it must be free when the engine starts (trainer memory is not subtracted)
    gpu_memory_utilization: float = 0.6
    cpu_kv_cache_gib: float = 1.0  # vLLM on CPU: KV cache size in GiB (its default takes 90% of RAM)
    max_model_len: int | None = None  # vLLM context; null = max_prompt_length + max_response_length
    max_num_batched_tokens: int = 8192  # vLLM scheduler token budget per step
    enforce_eager: bool = False  # vLLM: no torch.compile, no CUDA graphs (starts faster, decodes slower)
    enable_chunked_prefill: bool = False  # vLLM chunked prefill
    enable_sleep_mode: bool = True  # vLLM: free KV cache + weights while training (GPU only)
    limit_images: int = 0  # vLLM: max images per prompt; 0 = no limit
    # vLLM with a frozen vision tower (worker.actor.model.freeze_vision_tower), single-turn, Qwen2-VL and
    # Qwen2.5-VL: a training rollout's engine gets the actor's encodings of the prompts' images and videos
    # (made once per step, reused by the step's scoring and update passes) instead of encoding them
    # itself (vLLM's enable_mm_embeds); videos only at 1 s per temporal patch (vLLM's input has no field
    # for another interval), others stay media the engine encodes
    reuse_encodings: bool = False
    disable_tqdm: bool = True  # hide the engine's progress bars
    prepack_cpu_linears: bool = True  # transformers rollout on a CPU: oneDNN-prepacked large linear layers
    val_override_config: dict[str, Any] = field(
        default_factory=dict
    )  # sampling keys for validation, e.g. {temperature: 0, n: 1}
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    # where the engines run (docs/async.md): colocated (in the training processes, taking turns with
    # training) | separate (rollout workers of their own: Ray actors on GPUs, or CPU cores, of their own;
    # weights pushed from the training ranks after every update over a collective group)
    placement: str = "colocated"
    num_workers: int = 1  # placement=separate: rollout worker processes (one GPU each on GPUs)
    # placement=separate: seconds a weight push (and the push group's set-up) waits for a member that
    # does not take part (hung) before failing; a member that dies fails the push at once
    push_timeout_s: float = 600.0
    # trainer.async_mode=stream: tokens a rollout worker samples per row (of a model turn, multi-turn)
    # between two chances for a weight push to land (the generation in flight then continues with the
    # new weights); smaller = fresher tokens, more interruptions (with vLLM also more engine calls, each
    # re-reading the cached prefix: there a chunk of the whole response ran fastest, docs/async.md)
    stream_chunk_tokens: int = 8

    @property
    def separate(self) -> bool:
        return self.placement == "separate"

    def sampling_for_validation(self) -> dict[str, Any]:
        """Sampling parameters for validation: the training ones with val_override_config applied."""
        params = {key: getattr(self, key) for key in SAMPLING_KEYS}
        params.update(self.val_override_config)
        return params

    def check(self, config: PPOConfig) -> list[str]:
        """Sampling, the engine's context and memory, multi-turn, reused encodings."""
        errors = [
            f"worker.rollout.{key}={getattr(self, key)} must be > 0"
            for key in ("n", "tensor_parallel_size")
            if getattr(self, key) <= 0
        ]
        _check_rollout(errors, config)
        _check_reused_encodings(errors, config)
        errors += self._check_placement()
        return errors

    def _check_placement(self) -> list[str]:
        """What rollout workers of their own (``placement=separate``) do not do yet."""
        if self.num_workers < 1:
            return [f"worker.rollout.num_workers={self.num_workers} must be >= 1"]
        if self.push_timeout_s <= 0:
            return [f"worker.rollout.push_timeout_s={self.push_timeout_s} must be > 0 (seconds)"]
        if self.stream_chunk_tokens < 1:
            return [f"worker.rollout.stream_chunk_tokens={self.stream_chunk_tokens} must be >= 1 (tokens)"]
        if not self.separate:
            return []
        refused = {
            "worker.rollout.reuse_encodings=true (the encodings come from the actor's tower)": self.reuse_encodings,
            f"worker.rollout.tensor_parallel_size={self.tensor_parallel_size}": self.tensor_parallel_size > 1,
        }
        return [
            f"worker.rollout.placement=separate does not support {what} yet: use worker.rollout.placement="
            "colocated, or change that key"
            for what, refused_here in refused.items()
            if refused_here
        ]


def _check_rollout(errors: list[str], cfg: PPOConfig) -> None:
    rollout = cfg.worker.rollout
    if rollout.temperature < 0:
        errors.append(f"worker.rollout.temperature={rollout.temperature} must be >= 0 (0 = greedy)")
    if not 0 < rollout.top_p <= 1:
        errors.append(f"worker.rollout.top_p={rollout.top_p} must be in (0, 1]")
    if rollout.top_k == 0 or rollout.top_k < -1:
        errors.append(f"worker.rollout.top_k={rollout.top_k} must be -1 (off) or >= 1")
    for key in rollout.val_override_config:
        if key not in SAMPLING_KEYS:
            errors.append(
                f"worker.rollout.val_override_config.{key} is not a sampling key; valid: {', '.join(SAMPLING_KEYS)}"
            )
    context = cfg.data.max_prompt_length + cfg.data.max_response_length
    if rollout.max_model_len is not None and rollout.max_model_len < context:
        errors.append(
            f"worker.rollout.max_model_len={rollout.max_model_len} is shorter than data.max_prompt_length + "
            f"data.max_response_length = {context}"
        )
    engine_context = rollout.max_model_len or context
    if (
        rollout.name == "vllm"
        and not rollout.enable_chunked_prefill
        and rollout.max_num_batched_tokens < engine_context
    ):
        # vLLM refuses it at engine start: a prompt must fit one scheduler step (a long video does not)
        errors.append(
            f"worker.rollout.max_num_batched_tokens={rollout.max_num_batched_tokens} is below the vLLM context "
            f"({engine_context} tokens: worker.rollout.max_model_len, or data.max_prompt_length + "
            f"data.max_response_length), which vLLM refuses without chunked prefill: raise "
            f"worker.rollout.max_num_batched_tokens to {engine_context} or set "
            "worker.rollout.enable_chunked_prefill=true"
        )
    if not 0 < rollout.gpu_memory_utilization <= 1:
        errors.append(
            f"worker.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization} must be in (0, 1]"
        )
    errors += rollout.multi_turn.check()
    if rollout.multi_turn.enable and rollout.name == "vllm" and rollout.tensor_parallel_size > 1:
        errors.append(
            "worker.rollout.multi_turn needs worker.rollout.tensor_parallel_size=1 with the vllm rollout "
            "(the ranks of one engine would have to agree on every turn of every trajectory)"
        )


def _check_reused_encodings(errors: list[str], cfg: PPOConfig) -> None:
    """The rollout takes the actor's encodings only from a frozen tower, into vLLM, one turn a prompt."""
    rollout, key = cfg.worker.rollout, "worker.rollout.reuse_encodings"
    if not rollout.reuse_encodings:
        return
    model = cfg.worker.actor.model
    if rollout.name != "vllm":
        errors.append(f"{key}=true needs worker.rollout.name=vllm (got {rollout.name!r}); unset it")
    if not model.freeze_vision_tower or model.lora.rank > 0 or not model.share_encodings:
        errors.append(
            f"{key}=true needs a frozen tower without an adapter, its encodings shared: set "
            "worker.actor.model.freeze_vision_tower=true, lora.rank=0 and share_encodings=true, or unset it"
        )
    if rollout.multi_turn.enable:
        errors.append(f"{key}=true is for single-turn rollouts (worker.rollout.multi_turn is on); unset it")
