"""What a process holding a rollout engine does, wherever it runs: the training process (colocated) or
a rollout worker of its own (:mod:`mmrl.workers.rollout_worker`): build the engine, the agent loop, the
sampling settings of a generation, and the rollout batch's last columns."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mmrl.config import SAMPLING_KEYS, PPOConfig
from mmrl.data.processing import MediaProcessor, without_model_media
from mmrl.models.loading import load_model
from mmrl.models.prepare import prepare_for_training
from mmrl.protocol import DataProto
from mmrl.workers.forward import add_position_ids
from mmrl.workers.fsdp_engine import resolve_dtype
from mmrl.workers.rollout import GenerationMode, SamplingParams

# seed offset between generation rounds of one step: past any step's own offsets of a realistic run
ROUND_SEED_STRIDE = 1_000_003


def sampling_params(
    config: PPOConfig,
    mode: GenerationMode,
    global_step: int,
    rank: int,
    world_size: int,
    round_index: int = 0,
) -> SamplingParams:
    """The sampling settings of ``mode``, with a distinct, reproducible seed per step, rank (of
    ``world_size`` generating processes) and validation: a resume needs no RNG state for sampling; greedy
    draws no random numbers. ``round_index``: the extra rounds of a step under online filtering
    (``trainer.max_try_make_batch``) draw new numbers."""
    rollout_cfg = config.worker.rollout
    if mode is GenerationMode.VALIDATE:
        params = rollout_cfg.sampling_for_validation()
    else:
        params = {key: getattr(rollout_cfg, key) for key in SAMPLING_KEYS}
    if mode is GenerationMode.GREEDY:
        params.update(n=1, temperature=0.0)
    validate = mode is GenerationMode.VALIDATE
    params["seed"] = params["seed"] + (global_step * world_size + rank) * 2 + int(validate)
    params["seed"] += round_index * ROUND_SEED_STRIDE
    return SamplingParams(
        **params, max_tokens=config.data.max_response_length, ignore_eos=rollout_cfg.ignore_eos
    )


def build_rollout_engine(config: PPOConfig, model_path: str, device: torch.device) -> tuple[Any, str]:
    """The rollout backend of ``worker.rollout.name`` on ``device``, and the model type it runs."""
    from transformers import AutoTokenizer

    from mmrl.models.loading import resolve_model_path

    rollout_cfg = config.worker.rollout
    model_cfg = config.worker.actor.model
    tokenizer = AutoTokenizer.from_pretrained(
        resolve_model_path(model_cfg.tokenizer_or_model_path, model_cfg.tokenizer_key, without_weights=True),
        trust_remote_code=model_cfg.trust_remote_code,
    )
    if rollout_cfg.name == "vllm":
        from mmrl.workers.rollout.vllm_spmd import VLLMRollout

        data = config.data
        rollout = VLLMRollout(
            model_path,
            tokenizer,
            # an engine on a device of its own (placement=separate) has no training phase to give its
            # memory to: it never sleeps, and vLLM need not map its memory through its sleep allocator
            dataclasses.replace(rollout_cfg, enable_sleep_mode=False)
            if rollout_cfg.separate
            else rollout_cfg,
            context_length=data.max_prompt_length + data.max_response_length,
            # weights are pushed after every update anyway: nothing is gained by keeping a host copy
            sleep_level=2,
            trust_remote_code=model_cfg.trust_remote_code,
            override_config=dict(model_cfg.override_config),
        )
        return rollout, rollout.llm.llm_engine.model_config.hf_config.model_type
    from mmrl.workers.rollout.hf import HFRollout

    model = load_model(
        model_path,
        torch_dtype=resolve_dtype(rollout_cfg.dtype, device),
        trust_remote_code=model_cfg.trust_remote_code,
        override_config=dict(model_cfg.override_config),
    ).to(device)
    prepare_for_training(model, packing=False)  # padded passes only: prefill and decoding
    model.requires_grad_(False)
    rollout = HFRollout(
        model,
        tokenizer,
        return_log_probs=True,
        prepack=rollout_cfg.prepack_cpu_linears,
        record_routing=config.worker.actor.moe.routing_replay,
    )
    return rollout, model.config.model_type


def position_model(engine: Any, config: PPOConfig, model_path: str) -> torch.nn.Module:
    """The model whose ``get_rope_index`` numbers a rollout's ``position_ids`` in a process without the
    actor (a rollout worker of its own): the transformers engine's model, or for vLLM the architecture
    on the meta device (the numbering reads the config and the token ids, never a weight)."""
    if hasattr(engine, "model"):
        return engine.model
    model_cfg = config.worker.actor.model
    return load_model(
        model_path,
        trust_remote_code=model_cfg.trust_remote_code,
        override_config=dict(model_cfg.override_config),
        empty=True,
    )


def build_agent(config: PPOConfig, media: MediaProcessor, eos: list[int], model_type: str):
    """The agent loop of ``worker.rollout.multi_turn`` (None when it is off), for either backend."""
    if not config.worker.rollout.multi_turn.enable:
        return None
    from mmrl.agent.loop import build_agent_loop

    return build_agent_loop(config.worker.rollout.multi_turn, media, eos, model_type)


def generate_with(
    engine: Any,
    agent: Any,
    prompts: DataProto,
    sampling: SamplingParams,
    mode: GenerationMode,
    position_model: torch.nn.Module,
    version: int | None,
) -> DataProto:
    """``prompts`` (media attached) generated by ``engine`` (through ``agent`` for trajectories); a
    training rollout also gets its ``position_ids`` (numbered by ``position_model``, the policy's
    architecture) and, with ``version`` given, every response token's ``policy_version``. The media
    tensors are dropped: the driver gets the compact refs back."""
    output = (
        agent.generate(engine, prompts, sampling) if agent is not None else engine.generate(prompts, sampling)
    )
    if mode is GenerationMode.TRAIN:
        output = add_position_ids(position_model, output)
        if version is not None:  # every token: the weights that sampled it
            versions = torch.full_like(output.batch["responses"], version)
            output = output.union(DataProto.from_dict(tensors={"policy_version": versions}))
    return without_model_media(output)
