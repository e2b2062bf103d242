"""Worker roles: one process per device, holding models and running the phases the driver asks for.

``HybridWorker`` holds the actor (FSDP2, trained), the reference policy (FSDP2, frozen) and the
rollout engine in one process; ``CriticWorker`` holds the value model. Both are plain classes: the
single controller instantiates them inside Ray actors after setting the torch.distributed
environment. They are builders: they read the config and hand plain arguments to the components.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

from mmrl.checkpoint.state import load_train_state, save_train_state
from mmrl.models.loading import freeze_vision_tower, load_model
from mmrl.models.prepare import prepare_for_training
from mmrl.parallel.sequence import SequenceParallelGroups, init_sequence_parallel
from mmrl.protocol import DataProto
from mmrl.trainer.config import ActorConfig, CriticConfig, FSDPConfig, ModelConfig, PPOConfig
from mmrl.workers.actor import PolicyActor, add_position_ids
from mmrl.workers.critic import ValueCritic
from mmrl.workers.fsdp_engine import (
    apply_fsdp2,
    build_lr_scheduler,
    build_optimizer,
    enable_gradient_checkpointing,
    load_fsdp_params,
    load_optimizer,
    offload_fsdp_params,
    offload_optimizer,
    resolve_dtype,
)
from mmrl.workers.rollout import SamplingParams
from mmrl.workers.weight_sync import iter_full_state_dict

logger = logging.getLogger(__name__)


def setup_distributed() -> torch.device:
    """Join the process group described by the torchrun variables; NCCL on GPU, gloo on CPU."""
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        # ranks share the machine's cores: more threads per rank only contend
        threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        torch.set_num_threads(threads)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo", device_id=device if use_cuda else None
        )
    return device


def build_fsdp_model(
    model_config: ModelConfig,
    fsdp: FSDPConfig,
    role: str,
    device: torch.device,
    trainable: bool,
    *,
    padding_free: bool,
    sequence_parallel: bool,
) -> torch.nn.Module:
    """Load a Hugging Face model, prepare it for the passes it runs (packed with ``padding_free``, rows
    split over ranks with ``sequence_parallel``) and shard it with FSDP2 over all ranks."""
    storage = fsdp.torch_dtype if fsdp.torch_dtype != "auto" else "fp32"  # fp32 master weights
    module = load_model(
        model_config.model_path,
        role=role,
        torch_dtype=resolve_dtype(storage, device),
        trust_remote_code=model_config.trust_remote_code,
        override_config=dict(model_config.override_config),
    )
    prepare_for_training(module, packing=padding_free, sequence_parallel=sequence_parallel)
    if not trainable:
        module.requires_grad_(False)
    elif model_config.freeze_vision_tower:
        freeze_vision_tower(module)
    if trainable and model_config.enable_gradient_checkpointing:
        enable_gradient_checkpointing(module)
    buffer_dtype = resolve_dtype(fsdp.mp_buffer_dtype, device)  # FSDP2's policy leaves buffers alone
    for buffer_owner in module.modules():
        for name, buffer in buffer_owner.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point():
                setattr(buffer_owner, name, buffer.to(buffer_dtype))
    mesh = dist.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    return apply_fsdp2(
        module,
        mesh,
        param_dtype=resolve_dtype(fsdp.mp_param_dtype, device),
        reduce_dtype=resolve_dtype(fsdp.mp_reduce_dtype, device),
        cpu_offload=fsdp.enable_cpu_offload,
        reshard_after_forward=fsdp.enable_full_shard,
    )


def build_optimization(module: torch.nn.Module, actor: ActorConfig | CriticConfig, total_steps: int):
    optim = actor.optim
    optimizer = build_optimizer(module.parameters(), optim.lr, optim.betas, optim.weight_decay)
    warmup = (
        optim.lr_warmup_steps
        if optim.lr_warmup_steps is not None
        else int(optim.lr_warmup_ratio * total_steps)
    )
    scheduler = build_lr_scheduler(
        optimizer, total_steps, warmup, optim.lr_scheduler_type, optim.min_lr_ratio
    )
    return optimizer, scheduler


def build_sequence_parallel(ulysses_size: int, ring_size: int) -> SequenceParallelGroups | None:
    """The ``(dp, ring, ulysses)`` groups when a role splits its rows over ranks (collective), else None."""
    return init_sequence_parallel(ulysses_size, ring_size) if ulysses_size * ring_size > 1 else None


def sequence_parallel_args(groups: SequenceParallelGroups | None) -> dict:
    """``dp_group``/``sequence_parallel`` keyword arguments of PolicyActor and ValueCritic."""
    return {} if groups is None else {"dp_group": groups.dp_group, "sequence_parallel": groups}


def per_rank(count: int, world_size: int, what: str) -> int:
    if count % world_size:
        raise ValueError(f"{what}={count} does not divide over {world_size} ranks")
    return count // world_size


class HybridWorker:
    """Actor + reference + rollout in one process per device."""

    def __init__(self, config: PPOConfig, total_training_steps: int):
        self.config = config
        self.device = setup_distributed()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(config.trainer.seed)
        actor_cfg = config.worker.actor
        # the ref shares the actor's sequence-parallel layout (both score the same dispatched rows)
        self.sequence_parallel = build_sequence_parallel(actor_cfg.ulysses_size, actor_cfg.ring_size)
        self.dp_size = self.world_size // actor_cfg.sequence_parallel_size
        sp_args = sequence_parallel_args(self.sequence_parallel)
        # the ref shares the actor's passes: packed or not, split over the same SP groups
        passes = {
            "padding_free": actor_cfg.padding_free,
            "sequence_parallel": self.sequence_parallel is not None,
        }
        module = build_fsdp_model(
            actor_cfg.model, actor_cfg.fsdp, "actor", self.device, trainable=True, **passes
        )
        optimizer, scheduler = build_optimization(module, actor_cfg, total_training_steps)
        self.actor = PolicyActor(
            module,
            optimizer,
            scheduler,
            device=self.device,
            loss_type=actor_cfg.loss_type,
            loss_avg_mode=actor_cfg.loss_avg_mode,
            clip_ratio_low=actor_cfg.clip_ratio_low,
            clip_ratio_high=actor_cfg.clip_ratio_high,
            clip_ratio_dual=actor_cfg.clip_ratio_dual,
            entropy_coeff=actor_cfg.entropy_coeff,
            use_kl_loss=config.algorithm.use_kl_loss and config.algorithm.use_reference,
            kl_penalty=config.algorithm.kl_penalty,
            kl_coef=config.algorithm.kl_coef,
            max_grad_norm=actor_cfg.max_grad_norm,
            max_response_length=config.data.max_response_length,
            padding_free=actor_cfg.padding_free,
            share_prompts=actor_cfg.share_prompts,
            max_tokens_per_micro_batch=actor_cfg.max_tokens_per_micro_batch,
            **sp_args,
        )
        self.ref = None
        if config.algorithm.use_reference:
            ref_cfg = config.worker.ref
            ref_module = build_fsdp_model(
                actor_cfg.model, ref_cfg.fsdp, "actor", self.device, trainable=False, **passes
            )
            self.ref = PolicyActor(
                ref_module,
                device=self.device,
                padding_free=actor_cfg.padding_free,
                share_prompts=actor_cfg.share_prompts,
                max_tokens_per_micro_batch=actor_cfg.max_tokens_per_micro_batch,
                **sp_args,
            )
        self.rollout = self._build_rollout()
        self.sync_rollout_weights()  # the vLLM engine starts with random weights
        self._offload()

    # ---- builders -----------------------------------------------------------------------------

    def _build_rollout(self):
        from transformers import AutoTokenizer

        rollout_cfg = self.config.worker.rollout
        model_cfg = self.config.worker.actor.model
        tokenizer = AutoTokenizer.from_pretrained(model_cfg.tokenizer_or_model_path)
        dtype = resolve_dtype(rollout_cfg.dtype, self.device)
        if rollout_cfg.name == "vllm":
            from mmrl.workers.rollout.vllm_spmd import VLLMRollout

            data = self.config.data
            return VLLMRollout(
                model_cfg.model_path,
                tokenizer,
                tensor_parallel_size=rollout_cfg.tensor_parallel_size,
                dtype=dtype,
                seed=rollout_cfg.seed,
                max_model_len=rollout_cfg.max_model_len or data.max_prompt_length + data.max_response_length,
                max_num_batched_tokens=rollout_cfg.max_num_batched_tokens,
                enforce_eager=rollout_cfg.enforce_eager,
                enable_chunked_prefill=rollout_cfg.enable_chunked_prefill,
                gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
                cpu_kv_cache_gib=rollout_cfg.cpu_kv_cache_gib,
                enable_sleep_mode=rollout_cfg.enable_sleep_mode,
                # weights are pushed after every update anyway: nothing is gained by keeping a host copy
                sleep_level=2,
                limit_images=rollout_cfg.limit_images,
                show_progress=not rollout_cfg.disable_tqdm,
                trust_remote_code=model_cfg.trust_remote_code,
                override_config=dict(model_cfg.override_config),
            )
        from mmrl.workers.rollout.hf import HFRollout

        model = load_model(
            model_cfg.model_path,
            torch_dtype=dtype,
            trust_remote_code=model_cfg.trust_remote_code,
            override_config=dict(model_cfg.override_config),
        ).to(self.device)
        prepare_for_training(model, packing=False)  # padded passes only: prefill and decoding
        model.requires_grad_(False)
        return HFRollout(model, tokenizer, return_log_probs=True, prepack=rollout_cfg.prepack_cpu_linears)

    def _sampling(self, validate: bool, global_step: int) -> SamplingParams:
        rollout_cfg = self.config.worker.rollout
        params = (
            rollout_cfg.sampling_for_validation()
            if validate
            else {key: getattr(rollout_cfg, key) for key in ("n", "temperature", "top_p", "top_k", "seed")}
        )
        # a distinct, reproducible stream per step and rank (resume needs no RNG state for sampling)
        params["seed"] = params["seed"] + (global_step * self.world_size + self.rank) * 2 + int(validate)
        return SamplingParams(
            **params, max_tokens=self.config.data.max_response_length, ignore_eos=rollout_cfg.ignore_eos
        )

    def _offload(self) -> None:
        offload = self.config.worker.actor.offload
        if offload.offload_params:
            offload_fsdp_params(self.actor.module)
        if offload.offload_optimizer:
            offload_optimizer(self.actor.optimizer)

    def _onload(self) -> None:
        offload = self.config.worker.actor.offload
        if offload.offload_params:
            load_fsdp_params(self.actor.module, self.device)
        if offload.offload_optimizer:
            load_optimizer(self.actor.optimizer, self.device)

    # ---- phases -------------------------------------------------------------------------------

    def generate(self, prompts: DataProto) -> DataProto:
        sampling = self._sampling(
            prompts.meta_info.get("validate", False), prompts.meta_info.get("global_step", 0)
        )
        if prompts.meta_info.get("sampling_override"):  # e.g. ReMax's greedy baseline
            sampling = sampling.override(**prompts.meta_info["sampling_override"])
        if getattr(self.rollout, "weights_discarded", False):  # vLLM slept at level 2 since the last push
            self.sync_rollout_weights()
        output = self.rollout.generate(prompts, sampling)
        output.meta_info["temperature"] = sampling.temperature if sampling.temperature > 0 else 1.0
        if prompts.meta_info.get("validate", False):
            return output  # scored only
        return add_position_ids(self.actor.module, output)

    def compute_log_probs(self, data: DataProto) -> DataProto:
        self._onload()
        log_probs, entropies = self.actor.compute_log_probs(
            data,
            self.config.worker.actor.micro_batch_size_per_device_for_experience,
            data.meta_info["temperature"],
            with_entropy=True,
        )
        self._offload()
        return DataProto.from_dict(tensors={"old_log_probs": log_probs, "entropies": entropies})

    def compute_ref_log_probs(self, data: DataProto) -> DataProto:
        micro = self.config.worker.ref.micro_batch_size_per_device_for_experience
        micro = micro or self.config.worker.actor.micro_batch_size_per_device_for_experience
        log_probs, _ = self.ref.compute_log_probs(data, micro, data.meta_info["temperature"])
        return DataProto.from_dict(tensors={"ref_log_probs": log_probs})

    def update_actor(self, data: DataProto) -> DataProto:
        actor_cfg = self.config.worker.actor
        self._onload()
        update = self.actor.update_policy(
            data,
            mini_batch_size=per_rank(self.config.responses_per_update, self.dp_size, "responses per update"),
            micro_batch_size=actor_cfg.micro_batch_size_per_device_for_update,
            ppo_epochs=actor_cfg.ppo_epochs,
            temperature=data.meta_info["temperature"],
        )
        self.sync_rollout_weights()
        self._offload()
        metrics = {"metrics": {f"actor/{key}": value for key, value in update.metrics.items()}}
        if update.log_probs is None:
            return DataProto(meta_info=metrics)
        # on-policy: the log-probs the separate pass would have computed, for the trainer's metrics
        tensors = {"old_log_probs": update.log_probs, "entropies": update.entropies}
        return DataProto.from_dict(tensors=tensors, meta_info=metrics)

    def sync_rollout_weights(self) -> None:
        """Push the actor's new weights into the rollout engine, one full tensor at a time, under the names
        of the model's files (what vLLM's loader reads; HFRollout takes either spelling)."""
        self.rollout.update_weights(
            iter_full_state_dict(self.actor.module, device=self.device, checkpoint_format=True)
        )

    # ---- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, directory: str) -> None:
        self._onload()
        save_train_state(
            Path(directory) / "actor",
            self.actor.module,
            self.actor.optimizer,
            self.actor.lr_scheduler,
            hf_source_dir=self.config.worker.actor.model.model_path,
        )
        self._offload()

    def load_checkpoint(self, directory: str) -> None:
        self._onload()
        load_train_state(
            Path(directory) / "actor", self.actor.module, self.actor.optimizer, self.actor.lr_scheduler
        )
        self.sync_rollout_weights()
        self._offload()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.barrier()
        if hasattr(self.rollout, "shutdown"):
            self.rollout.shutdown()  # vLLM's teardown destroys the process group itself
        if dist.is_initialized():
            dist.destroy_process_group()


class CriticWorker:
    """The value model of GAE, one process per device."""

    def __init__(self, config: PPOConfig, total_training_steps: int):
        self.config = config
        self.device = setup_distributed()
        self.world_size = dist.get_world_size()
        critic_cfg = config.worker.critic
        self.sequence_parallel = build_sequence_parallel(critic_cfg.ulysses_size, critic_cfg.ring_size)
        self.dp_size = self.world_size // critic_cfg.sequence_parallel_size
        model_cfg = critic_cfg.model if critic_cfg.model.model_path else config.worker.actor.model
        module = build_fsdp_model(
            model_cfg,
            critic_cfg.fsdp,
            "critic",
            self.device,
            trainable=True,
            padding_free=critic_cfg.padding_free,
            sequence_parallel=self.sequence_parallel is not None,
        )
        optimizer, scheduler = build_optimization(module, critic_cfg, total_training_steps)
        self.model_path = model_cfg.model_path
        self.critic = ValueCritic(
            module,
            optimizer,
            scheduler,
            device=self.device,
            max_grad_norm=critic_cfg.max_grad_norm,
            padding_free=critic_cfg.padding_free,
            share_prompts=critic_cfg.share_prompts,
            max_tokens_per_micro_batch=critic_cfg.max_tokens_per_micro_batch,
            **sequence_parallel_args(self.sequence_parallel),
        )

    def compute_values(self, data: DataProto) -> DataProto:
        micro = self.config.worker.critic.micro_batch_size_per_device_for_experience
        return DataProto.from_dict(tensors={"values": self.critic.compute_values(data, micro)})

    def update_critic(self, data: DataProto) -> DataProto:
        critic_cfg = self.config.worker.critic
        responses = critic_cfg.global_batch_size * self.config.worker.rollout.n
        metrics = self.critic.update_critic(
            data,
            mini_batch_size=per_rank(responses, self.dp_size, "critic responses per update"),
            micro_batch_size=critic_cfg.micro_batch_size_per_device_for_update,
            ppo_epochs=critic_cfg.ppo_epochs,
            cliprange_value=critic_cfg.cliprange_value,
            loss_avg_mode=critic_cfg.loss_avg_mode,
        )
        return DataProto(meta_info={"metrics": {f"critic/{key}": value for key, value in metrics.items()}})

    def save_checkpoint(self, directory: str) -> None:
        save_train_state(
            Path(directory) / "critic",
            self.critic.module,
            self.critic.optimizer,
            self.critic.lr_scheduler,
            hf_source_dir=self.model_path,
        )

    def load_checkpoint(self, directory: str) -> None:
        load_train_state(
            Path(directory) / "critic", self.critic.module, self.critic.optimizer, self.critic.lr_scheduler
        )

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
