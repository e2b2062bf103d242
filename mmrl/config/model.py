"""The model, optimizer, FSDP and offload sections the training roles share (``worker.actor.model``,
``worker.*.optim``, ``worker.*.fsdp``, ``worker.*.offload``); each section's ``check`` beside its fields."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmrl.config.schema import PPOConfig


PACKED_ATTENTION_KERNELS = ("sdpa", "torch_varlen")  # worker.*.model.packed_attention


@dataclass(frozen=True)
class ModelConfig:
    """A trained model; the actor's section adds what the whole run shares (:class:`ActorModelConfig`)."""

    model_path: str | None = (
        None  # Hugging Face folder, or hub id (from the HF cache; downloaded unless HF_HUB_OFFLINE)
    )
    override_config: dict[str, Any] = field(default_factory=dict)  # entries set on the HF config at load
    enable_gradient_checkpointing: bool = True  # recompute activations in backward (less memory)
    # with enable_gradient_checkpointing: how many decoder layers recompute theirs, the first N (the
    # others keep their activations: spare device memory spent on speed, docs/throughput.md); null = all
    gradient_checkpointing_layers: int | None = None
    # torch.compile each decoder layer (its elementwise work fused: docs/throughput.md); the first steps
    # compile
    compile_layers: bool = False
    freeze_vision_tower: bool = False  # keep the vision (and audio) encoder weights fixed
    # padding-free attention without flash-attn: sdpa on each packed sequence (cuDNN/flash kernels per
    # sequence: measured faster on H100/H200 with torch 2.11, docs/throughput.md) or torch's own
    # variable-length kernel (one call per layer; CUDA bf16/fp16). flash-attn, when installed, serves both
    packed_attention: str = "sdpa"

    def check_checkpointing(self, key: str) -> list[str]:
        """``gradient_checkpointing_layers`` (``key`` names the section: worker.actor.model, ...)."""
        layers = self.gradient_checkpointing_layers
        if layers is None:
            return []
        if layers < 0:
            return [f"{key}.gradient_checkpointing_layers={layers} must be >= 0 (null: every decoder layer)"]
        if not self.enable_gradient_checkpointing:
            return [
                f"{key}.gradient_checkpointing_layers={layers} is set with {key}.enable_gradient_checkpointing="
                "false: no layer recomputes; set enable_gradient_checkpointing=true or unset the count"
            ]
        return []


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 0  # LoRA rank of the actor's adapter; 0 = full fine-tuning
    alpha: int = 64  # LoRA scaling numerator: the update is (alpha / rank) * B @ A
    target_modules: str = "all-linear"  # all-linear, or comma-separated module names (q_proj,v_proj,...)
    exclude_modules: str | None = None  # regex of module names left without adapter, e.g. `.*visual.*`

    def check(self) -> list[str]:
        """LoRA settings that are wrong whatever the model; target names are checked against the model's
        modules where it is built (mmrl.models.lora.lora_target_names)."""
        import importlib.util

        from mmrl.models.lora import PEFT_HINT

        errors: list[str] = []
        key = "worker.actor.model.lora"
        if self.rank < 0:
            errors.append(f"{key}.rank={self.rank} must be >= 0 (0 = full fine-tuning)")
        if self.alpha <= 0:
            errors.append(
                f"{key}.alpha={self.alpha} must be > 0: the adapter's update is (alpha / rank) * B @ A"
            )
        if not self.target_modules.strip(" ,"):
            errors.append(f"{key}.target_modules is empty: all-linear, or module names such as q_proj,v_proj")
        if self.exclude_modules is not None:
            try:
                re.compile(self.exclude_modules)
            except re.error as error:
                errors.append(f"{key}.exclude_modules={self.exclude_modules!r} is not a valid regex: {error}")
        if self.rank > 0 and importlib.util.find_spec("peft") is None:
            errors.append(PEFT_HINT)
        return errors


@dataclass(frozen=True)
class ActorModelConfig(ModelConfig):
    # the run's one tokenizer: data, rollout and reward decoding (a critic needs none)
    tokenizer_path: str | None = None  # null = model_path
    # allow the model folder's own Python code: every model, config, tokenizer and processor load of the
    # run (actor, reference, rollout, reward workers, critic)
    trust_remote_code: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)  # PEFT LoRA adapter (rank 0 = none)
    # folder of frozen-tower embeddings kept across epochs (the reference's tower, and the actor's with
    # freeze_vision_tower), shared by every rank and node; keyed by media bytes, media settings and the
    # tower's weights. null = none
    encoding_cache_dir: str | None = None
    encoding_cache_max_gb: float = 50.0  # size bound of encoding_cache_dir (least recently used go first)
    # frozen towers (freeze_vision_tower, the reference's): each distinct image/video is encoded once per
    # step and its embeddings kept for the step's passes; false = every pass encodes (less memory)
    share_encodings: bool = True
    # torch.compile the log-prob head's per-chunk math (actor and reference; docs/throughput.md)
    compile_head: bool = False

    @property
    def tokenizer_or_model_path(self) -> str | None:
        return self.tokenizer_path or self.model_path

    @property
    def tokenizer_key(self) -> str:
        """The key naming the run's tokenizer (in messages about it)."""
        return f"worker.actor.model.{'tokenizer_path' if self.tokenizer_path else 'model_path'}"

    def check(self, config: PPOConfig) -> list[str]:
        """The adapter, and the disk cache of frozen towers' encodings."""
        errors = self.lora.check() + self.check_checkpointing("worker.actor.model")
        _check_encoding_cache(errors, config)
        return errors


def _check_encoding_cache(errors: list[str], cfg: PPOConfig) -> None:
    """The disk cache holds frozen towers' encodings: some tower must be frozen and free of adapters."""
    model, key = cfg.worker.actor.model, "worker.actor.model"
    if model.encoding_cache_max_gb <= 0:
        errors.append(f"{key}.encoding_cache_max_gb={model.encoding_cache_max_gb} must be > 0")
    if model.encoding_cache_dir is None:
        return
    if not model.share_encodings:
        errors.append(
            f"{key}.encoding_cache_dir is set with {key}.share_encodings=false: the disk keeps shared "
            "encodings only; unset one of them"
        )
    elif model.lora.rank > 0:
        errors.append(
            f"{key}.encoding_cache_dir is set with {key}.lora.rank={model.lora.rank}: an adapter may reach "
            "into the vision tower, so no encoding is cached; unset encoding_cache_dir"
        )
    elif not model.freeze_vision_tower and not cfg.algorithm.use_reference:
        errors.append(
            f"{key}.encoding_cache_dir is set but no tower is frozen: set {key}.freeze_vision_tower=true "
            "(or use a reference model, algorithm.disable_kl=false), or unset encoding_cache_dir"
        )


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6  # peak learning rate
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    weight_decay: float = 1e-2  # AdamW decoupled weight decay
    strategy: str = "adamw"  # optimizer, by name in fsdp_engine.OPTIMIZERS: adamw | adamw_bf16 (bf16 states)
    lr_warmup_ratio: float = 0.0  # fraction of the training steps spent warming up linearly
    lr_warmup_steps: int | None = None  # warm-up in steps; overrides lr_warmup_ratio when set
    lr_scheduler_type: str = "constant"  # after warm-up: constant | cosine
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr


@dataclass(frozen=True)
class FSDPConfig:
    enable_full_shard: bool = (
        True  # free gathered parameters after forward (ZeRO-3); false = keep them for backward (ZeRO-2)
    )
    enable_cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: parameters live on CPU
    # dtype of the stored weights: auto (fp32 for a trained model; a frozen reference: bf16 on GPU,
    # fp32 on CPU) | fp32 | bf16
    torch_dtype: str = "auto"
    mp_param_dtype: str = "auto"  # compute dtype: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    mp_reduce_dtype: str = "fp32"  # gradient reduction dtype
    mp_buffer_dtype: str = "fp32"  # buffer dtype


@dataclass(frozen=True)
class OffloadConfig:
    offload_params: bool = False  # move parameters to CPU between phases
    offload_optimizer: bool = False  # move optimizer states to CPU between phases


@dataclass(frozen=True)
class RefOffloadConfig:
    offload_params: bool = False  # frozen reference weights on CPU except during its log-prob pass
