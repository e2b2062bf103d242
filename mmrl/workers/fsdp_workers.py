"""Worker roles: one process per device, holding models and running the phases the driver asks for.

``HybridWorker`` holds the actor (FSDP2, trained; with ``worker.actor.model.lora.rank`` > 0 only its
LoRA adapter trains), the reference policy (FSDP2, frozen; with LoRA the actor's own model with the
adapter switched off, no second copy), the rollout engine (unless the engines run in rollout workers of
their own, ``worker.rollout.placement=separate``) and, for GAE, the value model (:class:`CriticRole`) in one process per device: the
roles share the device, its CUDA context and one torch.distributed world (as in verl and EasyR1), so
a critic needs no devices of its own; each role's ``offload`` settings move it off the device between
its phases. It is a plain class: the single controller instantiates it inside Ray actors after
setting the torch.distributed environment. It is a builder: it hands each component its config
section, and model paths (hub ids included) are resolved to folders here, once
(:func:`~mmrl.models.loading.resolve_model_path`).

Batches carry each prompt's media in compact form (``prompt_media``: a Ray ref to its encoded files);
each phase first attaches the processed media (``multi_modal_inputs``, and for the rollout
``multi_modal_data``) with :func:`~mmrl.data.processing.attach_media`, which keeps them for the
rank's next phase, so a prompt's media are decoded and processed once per rank and step.

Each phase is a method whose mode is an explicit argument (the driver's
:class:`~mmrl.trainer.step_plan.StepPlan` decides it), and whose batch layout over the ranks is
declared once on the method (:mod:`mmrl.dispatch`). The columns each phase adds are listed in
:mod:`mmrl.columns`.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mmrl.checkpoint.state import adapter_info, load_train_state, save_train_state
from mmrl.checkpoint.tracker import read_save_id
from mmrl.config import (
    ActorConfig,
    ActorModelConfig,
    CriticConfig,
    FSDPConfig,
    LoraConfig,
    ModelConfig,
    PPOConfig,
)
from mmrl.data.media import MEDIA_SETTINGS
from mmrl.data.processing import (
    EMBEDS_COLUMN,
    MediaCache,
    MediaProcessor,
    attach_media,
    load_tokenizer_and_processor,
)
from mmrl.dispatch import rows_per_data_parallel_share, rows_per_rank
from mmrl.models.compiled import compile_head, compile_layers
from mmrl.models.encoding_cache import (
    EncodingCache,
    enable_encoding_cache,
    label_weights,
    prompt_encodings,
    weights_digest,
)
from mmrl.models.encoding_store import EncodingStore
from mmrl.models.loading import freeze_vision_tower, load_model, resolve_model_path, vision_modules
from mmrl.models.lora import adapter_layers, adapters_disabled, apply_lora
from mmrl.models.prepare import prepare_for_training
from mmrl.parallel.sequence import SequenceParallelGroups, init_sequence_parallel
from mmrl.protocol import DataProto
from mmrl.versions import check_versions, packages_of_run
from mmrl.workers.actor import PolicyActor
from mmrl.workers.critic import ValueCritic
from mmrl.workers.fsdp_engine import (
    PhaseOffload,
    apply_fsdp2,
    broadcast_from_rank0,
    build_lr_scheduler,
    build_optimizer,
    enable_gradient_checkpointing,
    resolve_dtype,
    root_gathered,
    storage_dtype,
)
from mmrl.workers.memory import PhasePeaks, measured
from mmrl.workers.rollout import GenerationMode
from mmrl.workers.rollout.engine import build_agent, build_rollout_engine, generate_with, sampling_params
from mmrl.workers.weight_push import WeightPushGroup, push_from_rank
from mmrl.workers.weight_sync import full_state_manifest, iter_full_state_dict

logger = logging.getLogger(__name__)


def worker_threads(cpu_threads: int | None, on_gpu: bool, processes_on_node: int | None = None) -> int | None:
    """torch threads of a training (or rollout) process: ``cpu_threads`` (the CPUs Ray reserved for it,
    from the driver's placement) when given; otherwise on a CPU machine the cores shared by the
    ``processes_on_node`` (default: this group's ranks on it; more threads per rank only contend), on a
    GPU torch's own choice (None)."""
    if cpu_threads is not None:
        return max(1, cpu_threads)
    if on_gpu:
        return None
    processes = processes_on_node or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, (os.cpu_count() or 1) // processes)


def processes_on_node(config: PPOConfig) -> int | None:
    """Processes sharing a CPU node's cores: with ``worker.rollout.placement=separate`` the training
    ranks and the rollout workers; None (colocated): the group's own ranks (``LOCAL_WORLD_SIZE``)."""
    rollout = config.worker.rollout
    return rollout.num_workers + config.trainer.n_gpus_per_node if rollout.separate else None


def setup_distributed(cpu_threads: int | None = None, processes_on_node: int | None = None) -> torch.device:
    """Join the process group described by the torchrun variables; NCCL on GPU, gloo on CPU. The
    process runs ``worker_threads(cpu_threads, ...)`` torch threads (and as many OpenMP threads in the
    libraries it loads later), on GPU too: media decoding and processing run here. ``processes_on_node``:
    those sharing the node's cores (:func:`processes_on_node`; None: this group's ranks alone)."""
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    threads = worker_threads(cpu_threads, use_cuda, processes_on_node)
    if threads is not None:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo", device_id=device if use_cuda else None
        )
    return device


def build_fsdp_model(
    model_path: str,
    model_config: ModelConfig,
    fsdp: FSDPConfig,
    role: str,
    device: torch.device,
    trainable: bool,
    *,
    trust_remote_code: bool,
    padding_free: bool,
    sequence_parallel: bool,
    lora: LoraConfig | None = None,
    rank0_init: bool = True,
    label_towers: bool = False,
) -> torch.nn.Module:
    """Load the Hugging Face model at ``model_path``, prepare it for the passes it runs (packed with
    ``padding_free``, rows split over ranks with ``sequence_parallel``), give it a LoRA adapter when
    ``lora.rank`` > 0 (only the adapter trains) and shard it with FSDP2.

    ``rank0_init`` (with several ranks): only rank 0 reads the weights; the others build the model on
    the meta device and receive their shards from it
    (:func:`~mmrl.workers.fsdp_engine.broadcast_from_rank0`), so host memory holds one whole copy, not
    one per rank (8 x 33 GB for a 7B-VL on one node). ``False`` makes every rank read its own copy
    (what ``bench/scale_load.py`` compares against). ``label_towers`` (for frozen towers): key their
    encodings by their weights (:func:`label_frozen_towers`)."""
    from_rank0 = rank0_init and dist.get_world_size() > 1
    module = load_model(
        model_path,
        role=role,
        torch_dtype=storage_dtype(fsdp.torch_dtype, device, trainable),
        trust_remote_code=trust_remote_code,
        override_config=dict(model_config.override_config),
        empty=from_rank0 and dist.get_rank() != 0,
    )
    prepare_for_training(
        module,
        packing=padding_free,
        sequence_parallel=sequence_parallel,
        score_tokens=role == "actor",
        packed_attention=model_config.packed_attention,
    )
    if trainable and lora is not None and lora.rank > 0:
        add_adapter(module, lora, fsdp, device)
    if not trainable:
        module.requires_grad_(False)
    elif model_config.freeze_vision_tower:
        freeze_vision_tower(module)
    if trainable and model_config.enable_gradient_checkpointing:
        enable_gradient_checkpointing(module, model_config.gradient_checkpointing_layers)
    if model_config.compile_layers:
        compile_layers(module)
    if isinstance(model_config, ActorModelConfig) and model_config.compile_head:
        compile_head(module)
    buffer_dtype = resolve_dtype(fsdp.mp_buffer_dtype, device)  # FSDP2's policy leaves buffers alone
    for buffer_owner in module.modules():
        for name, buffer in buffer_owner.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point():
                setattr(buffer_owner, name, buffer.to(buffer_dtype))
    if label_towers:
        label_frozen_towers(module, resolve_dtype(fsdp.mp_param_dtype, device), from_rank0)
    mesh = dist.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    shard = functools.partial(
        apply_fsdp2,
        mesh=mesh,
        param_dtype=resolve_dtype(fsdp.mp_param_dtype, device),
        reduce_dtype=resolve_dtype(fsdp.mp_reduce_dtype, device),
        cpu_offload=fsdp.enable_cpu_offload,
        reshard_after_forward=fsdp.enable_full_shard,
    )
    if not from_rank0:
        return shard(module)
    # the receiving ranks shard their meta model first; rank 0 sends its tensors whole, then shards
    if dist.get_rank() != 0:
        module = shard(module)
    broadcast_from_rank0(module, device, cpu_offload=fsdp.enable_cpu_offload)
    return module if dist.get_rank() != 0 else shard(module)


def add_adapter(module: torch.nn.Module, lora: LoraConfig, fsdp: FSDPConfig, device: torch.device) -> None:
    """Inject the LoRA adapter (before sharding, so each layer's adapter is sharded with it). The
    frozen base is then stored as a frozen model would be (``storage_dtype``: bf16 on CUDA with
    ``auto``) when the passes gather it in that dtype anyway; the adapter keeps fp32 master weights."""
    names = apply_lora(module, lora.rank, lora.alpha, lora.target_modules, lora.exclude_modules)
    frozen_dtype = storage_dtype(fsdp.torch_dtype, device, trainable=False)
    if frozen_dtype == resolve_dtype(fsdp.mp_param_dtype, device):
        for parameter in module.parameters():
            if not parameter.requires_grad and parameter.is_floating_point():
                parameter.data = parameter.data.to(frozen_dtype)
    trainable = sum(parameter.numel() for parameter in module.parameters() if parameter.requires_grad)
    logger.info("LoRA rank %d on %d modules: %d trainable parameters", lora.rank, len(names), trainable)


def label_frozen_towers(module: torch.nn.Module, compute_dtype: torch.dtype, from_rank0: bool) -> None:
    """Label each vision tower of the whole (unsharded) ``module`` with the digest of its weights, so
    that equal frozen towers (the actor's and the reference's) share encodings and the disk cache
    never serves another model's. With ``from_rank0`` only rank 0 holds weights: it sends the digests."""
    towers = [tower for tower in vision_modules(module) if hasattr(tower, "spatial_merge_size")]
    digests: list[str | None] = [None] * len(towers)
    if not from_rank0 or dist.get_rank() == 0:
        digests = [weights_digest(tower, compute_dtype) for tower in towers]
    if from_rank0:
        dist.broadcast_object_list(digests, src=0)
    for tower, digest in zip(towers, digests):
        label_weights(tower, digest)


def build_encoding_store(config: PPOConfig, processor: Any, device: torch.device) -> EncodingStore | None:
    """The disk cache of frozen-tower encodings (``worker.actor.model.encoding_cache_dir``), its
    entries keyed by the media settings, the processor and the device kind too; None when unset."""
    model_cfg = config.worker.actor.model
    if model_cfg.encoding_cache_dir is None:
        return None
    settings = {key: getattr(config.data, key) for key in MEDIA_SETTINGS}
    settings["processor"] = type(processor).__name__ if processor is not None else None
    settings["device"] = device.type  # kernels differ between device kinds
    max_bytes = int(model_cfg.encoding_cache_max_gb * (1 << 30))
    return EncodingStore(model_cfg.encoding_cache_dir, max_bytes, repr(sorted(settings.items())))


def build_encoding_cache(
    module: torch.nn.Module, model_config: ActorModelConfig, store: EncodingStore | None = None
) -> EncodingCache | None:
    """With ``freeze_vision_tower`` and ``share_encodings`` (and no LoRA adapter, which could reach into
    the tower and is switched off for the reference), the actor's passes of a step share one encoding of each distinct
    image or video (:mod:`mmrl.models.encoding_cache`), read from and written to ``store`` when given
    and the towers carry their weights' digest; None otherwise."""
    if not model_config.share_encodings or not model_config.freeze_vision_tower or model_config.lora.rank > 0:
        return None
    cache = EncodingCache(store=store)
    return cache if enable_encoding_cache(vision_modules(module), cache) else None


def build_optimization(module: torch.nn.Module, actor: ActorConfig | CriticConfig, total_steps: int):
    optim = actor.optim
    optimizer = build_optimizer(
        module.parameters(), optim.lr, optim.betas, optim.weight_decay, optim.strategy
    )
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


def build_media_processor(config: PPOConfig) -> MediaProcessor:
    """The dataset's media processing (same processor, same ``data`` settings), for this worker's
    ``multi_modal_inputs``: the batches carry only the prompts' compact media."""
    model_cfg = config.worker.actor.model
    tokenizer, processor = load_tokenizer_and_processor(
        model_cfg.tokenizer_or_model_path,
        model_cfg.trust_remote_code,
        chat_template_file=config.data.override_chat_template,
    )
    return MediaProcessor(tokenizer, processor, config.data)


def per_rank(count: int, world_size: int, what: str) -> int:
    if count % world_size:
        raise ValueError(f"{what}={count} does not divide over {world_size} ranks")
    return count // world_size


class CriticRole:
    """The value model of GAE, built inside a :class:`HybridWorker` on its device and process group;
    ``sequence_parallel``: the critic's groups (the actor's when the sizes are equal); ``model_path``:
    the resolved folder it loads from and copies into checkpoints."""

    def __init__(
        self,
        config: PPOConfig,
        total_training_steps: int,
        device: torch.device,
        sequence_parallel: SequenceParallelGroups | None,
        model_path: str,
    ):
        self.config = config
        critic_cfg = config.worker.critic
        self.sequence_parallel = sequence_parallel
        self.dp_size = dist.get_world_size() // critic_cfg.sequence_parallel_size
        self.model_path = model_path
        if config.worker.actor.model.lora.rank > 0 and dist.get_rank() == 0:
            logger.warning("worker.actor.model.lora adapts the actor only: the critic trains all its weights")
        module = build_fsdp_model(
            model_path,
            critic_cfg.model,
            critic_cfg.fsdp,
            "critic",
            device,
            trainable=True,
            trust_remote_code=config.worker.actor.model.trust_remote_code,
            padding_free=critic_cfg.padding_free,
            sequence_parallel=self.sequence_parallel is not None,
        )
        optimizer, scheduler = build_optimization(module, critic_cfg, total_training_steps)
        self.critic = ValueCritic(
            module,
            critic_cfg,
            optimizer,
            scheduler,
            max_response_length=config.data.max_response_length,
            device=device,
            **sequence_parallel_args(self.sequence_parallel),
        )
        self.offload = PhaseOffload(
            module,
            device,
            params=critic_cfg.offload.offload_params,
            optimizer=optimizer,
            optimizer_state=critic_cfg.offload.offload_optimizer,
        )
        self.offload.offload()

    def compute_values(self, data: DataProto) -> DataProto:
        micro = self.config.worker.critic.micro_batch_size_per_device_for_experience
        with self.offload.loaded():
            values = self.critic.compute_values(data, micro)
        return DataProto.from_dict(tensors={"values": values})

    def update_critic(self, data: DataProto) -> DataProto:
        critic_cfg = self.config.worker.critic
        responses = critic_cfg.global_batch_size * self.config.worker.rollout.n
        with self.offload.loaded():
            metrics = self.critic.update_critic(
                data,
                mini_batch_size=per_rank(responses, self.dp_size, "critic responses per update"),
                micro_batch_size=critic_cfg.micro_batch_size_per_device_for_update,
                ppo_epochs=critic_cfg.ppo_epochs,
            )
        return DataProto(meta_info={"metrics": {f"critic/{key}": value for key, value in metrics.items()}})

    def save_checkpoint(self, directory: str) -> dict[str, Any]:
        """This rank's report of the critic folder it wrote (``save_train_state``)."""
        with self.offload.loaded():
            return save_train_state(
                Path(directory) / "critic",
                self.critic.module,
                self.critic.optimizer,
                self.critic.lr_scheduler,
                hf_source_dir=self.model_path,
            )

    def load_checkpoint(self, directory: str) -> None:
        with self.offload.loaded():
            load_train_state(
                Path(directory) / "critic",
                self.critic.module,
                self.critic.optimizer,
                self.critic.lr_scheduler,
            )


class HybridWorker:
    """Actor + reference + rollout (+ the GAE critic) in one process per device. With
    ``worker.rollout.placement=separate`` it holds no engine: rank 0 sends the weights to the rollout
    workers (:meth:`push_rollout_weights`, :mod:`mmrl.workers.rollout_worker`)."""

    def __init__(self, config: PPOConfig, total_training_steps: int, cpu_threads: int | None = None):
        """``cpu_threads``: torch threads of this process (the driver's placement: the CPUs Ray reserved
        for it); None = :func:`worker_threads`' default."""
        self.config = config
        # this node's packages (they may differ from the driver's): too old stops here, naming them
        check_versions(packages_of_run(config.worker.rollout.name))
        self.device = setup_distributed(cpu_threads, processes_on_node(config))
        self.peaks = PhasePeaks(self.device)  # set first: the constructor's weight push is measured
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(config.trainer.seed)
        actor_cfg = config.worker.actor
        # the ref shares the actor's sequence-parallel layout (both score the same dispatched rows)
        self.sequence_parallel = build_sequence_parallel(actor_cfg.ulysses_size, actor_cfg.ring_size)
        self.dp_size = self.world_size // actor_cfg.sequence_parallel_size
        sp_args = sequence_parallel_args(self.sequence_parallel)
        model_cfg = actor_cfg.model
        self.model_path = resolve_model_path(model_cfg.model_path, "worker.actor.model.model_path")
        # the ref shares the actor's passes: packed or not, split over the same SP groups
        passes = {
            "trust_remote_code": model_cfg.trust_remote_code,
            "padding_free": actor_cfg.padding_free,
            "sequence_parallel": self.sequence_parallel is not None,
        }
        module = build_fsdp_model(
            self.model_path,
            model_cfg,
            actor_cfg.fsdp,
            "actor",
            self.device,
            trainable=True,
            lora=model_cfg.lora,
            label_towers=model_cfg.freeze_vision_tower and model_cfg.lora.rank == 0,
            **passes,
        )
        optimizer, scheduler = build_optimization(module, actor_cfg, total_training_steps)
        self.media, self.media_cache = build_media_processor(config), MediaCache()
        self.encoding_store = build_encoding_store(config, self.media.processor, self.device)
        # cleared as each step begins; the reference's tower joins it (_build_ref)
        self.encoding_cache = build_encoding_cache(module, model_cfg, self.encoding_store)
        self.rollout_encoded_items = 0  # media items given to the engine as encodings since the update
        self.actor = PolicyActor(
            module,
            actor_cfg,
            config.algorithm,
            optimizer,
            scheduler,
            max_response_length=config.data.max_response_length,
            device=self.device,
            replay_routing=actor_cfg.moe.routing_replay,  # the actor's passes only, not the reference's
            **sp_args,
        )
        self.ref = self._build_ref(module, passes, sp_args) if config.algorithm.use_reference else None
        actor_offload = actor_cfg.offload
        self.actor_offload = PhaseOffload(
            module,
            self.device,
            params=actor_offload.offload_params,
            optimizer=optimizer,
            optimizer_state=actor_offload.offload_optimizer,
        )
        self.pushes_before_generate = 0  # pushes a generation needed since the last report (see _generate)
        self.rollout_version = 0  # the policy version (actor updates) of the weights the engine holds
        self.weight_push: WeightPushGroup | None = (
            None  # placement=separate: joined by rank 0 (driver's call)
        )
        self.push_manifest: list = []  # what rank 0 sends, in order (weight_manifest)
        self.rollout: Any = None  # placement=separate: the engines are the rollout workers'
        self.agent = None
        if not config.worker.rollout.separate:
            self.rollout, model_type = build_rollout_engine(config, self.model_path, self.device)
            # multi-turn trajectories: the agent loop drives the backend's turn generation (mmrl.agent)
            self.agent = build_agent(config, self.media, self.rollout.eos_token_ids, model_type)
            self.sync_rollout_weights()  # the vLLM engine starts with random weights; offloads after
        # after the engine: vLLM refuses to start unless gpu_memory_utilization x the device's memory is
        # free then; once built it sleeps (mmrl.workers.rollout.vllm_spmd), leaving that memory to the critic
        self.critic = self._build_critic(total_training_steps) if config.use_critic else None

    # ---- builders -----------------------------------------------------------------------------

    def _build_ref(self, actor_module: torch.nn.Module, passes: dict, sp_args: dict) -> PolicyActor:
        """The reference policy. With LoRA it is the actor's own model with its adapter disabled
        (:meth:`compute_ref_log_probs`): the base weights, with no second copy of them."""
        actor_cfg, ref_cfg = self.config.worker.actor, self.config.worker.ref
        if actor_cfg.model.lora.rank > 0:
            ref_module = actor_module
            offload_params = actor_cfg.offload.offload_params  # the actor's weights, moved as the actor's
        else:
            ref_module = build_fsdp_model(
                self.model_path,
                actor_cfg.model,
                ref_cfg.fsdp,
                "actor",
                self.device,
                trainable=False,
                label_towers=True,
                **passes,
            )
            # frozen: its encodings are shared with the actor's frozen tower where the weights are equal
            cache = self.encoding_cache or EncodingCache(store=self.encoding_store)
            if actor_cfg.model.share_encodings and enable_encoding_cache(vision_modules(ref_module), cache):
                self.encoding_cache = cache
            offload_params = ref_cfg.offload.offload_params
        # frozen: only its weights can move, and they are needed for its log-prob pass alone
        self.ref_offload = PhaseOffload(ref_module, self.device, params=offload_params)
        self.ref_offload.offload()
        # the reference scores with the actor's packing settings; it has no loss
        return PolicyActor(ref_module, actor_cfg, device=self.device, **sp_args)

    def _build_critic(self, total_training_steps: int) -> CriticRole:
        critic_cfg, actor_cfg = self.config.worker.critic, self.config.worker.actor
        layout = (critic_cfg.ulysses_size, critic_cfg.ring_size)
        if layout == (actor_cfg.ulysses_size, actor_cfg.ring_size):
            groups = self.sequence_parallel  # one set of groups serves both roles
        else:
            groups = build_sequence_parallel(*layout)  # collective: every rank builds the critic here
        critic_path = critic_cfg.model.model_path  # null: the actor's folder
        folder = (
            resolve_model_path(critic_path, "worker.critic.model.model_path")
            if critic_path
            else self.model_path
        )
        return CriticRole(self.config, total_training_steps, self.device, groups, folder)

    # ---- phases -------------------------------------------------------------------------------

    @rows_per_rank
    def generate(
        self, prompts: DataProto, *, mode: GenerationMode, global_step: int, round_index: int = 0
    ) -> DataProto:
        """``len(prompts) * n`` responses sampled as ``mode`` says; training rollouts also get their
        ``position_ids`` and, with ``trainer.records_policy_versions``, ``policy_version`` (validation and
        greedy baselines are only scored). ``round_index``: the generation round within the step (online
        filtering), for a sampling stream of its own."""
        if self.encoding_cache is not None:
            self.encoding_cache.clear()  # a step begins: the last one's media are not asked again
        with self.peaks.phase("gen" if mode is GenerationMode.TRAIN else f"gen_{mode.value}"):
            return self._generate(prompts, mode, global_step, round_index)

    def _generate(
        self, prompts: DataProto, mode: GenerationMode, global_step: int, round_index: int = 0
    ) -> DataProto:
        if getattr(self.rollout, "weights_discarded", False):
            # a phase since the last push freed the engine's weights (level-2 sleep) and no update pushed
            # new ones: a checkpoint save or load, a critic warm-up step. Consecutive generations and
            # those right after an update's push find the weights in place.
            self.sync_rollout_weights()
            self.pushes_before_generate += 1
        prompts = attach_media(prompts, self.media, self.media_cache, rollout_media=True)
        reuse = self.config.worker.rollout.reuse_encodings and self.encoding_cache is not None
        if reuse and mode is GenerationMode.TRAIN:  # the prompts the step's passes score next
            prompts = self._with_prompt_encodings(prompts)
        sampling = sampling_params(self.config, mode, global_step, self.rank, self.world_size, round_index)
        version = self.rollout_version if self.config.trainer.records_policy_versions else None
        return generate_with(self.rollout, self.agent, prompts, sampling, mode, self.actor.module, version)

    def _with_prompt_encodings(self, prompts: DataProto) -> DataProto:
        """``prompts`` with the actor's frozen-tower encodings of their images and videos for the
        engine (``worker.rollout.reuse_encodings``), kept in the step's encoding cache for the training
        passes. Every rank gathers the root unit, with media or not (a collective)."""
        rows = prompts.non_tensor_batch.get("multi_modal_inputs")
        rows = list(rows) if rows is not None else [None] * len(prompts)
        with self.actor_offload.loaded(), root_gathered(self.actor.module), torch.no_grad():
            encodings = prompt_encodings(vision_modules(self.actor.module), rows, self.device)
        distinct = {id(row): row for row in encodings if row}.values()
        self.rollout_encoded_items += sum(
            len(item[f"{modality}_grid_thw"]) for row in distinct for modality, item in row.items()
        )
        return prompts.union(DataProto.from_dict(non_tensors={EMBEDS_COLUMN: encodings}))

    @rows_per_data_parallel_share
    @measured("old_log_prob")
    def compute_log_probs(self, data: DataProto, *, temperature: float) -> DataProto:
        self._release_rollout()
        data = attach_media(data, self.media, self.media_cache)
        with self.actor_offload.loaded():
            log_probs, entropies = self.actor.compute_log_probs(
                data,
                self.config.worker.actor.micro_batch_size_per_device_for_experience,
                temperature,
                with_entropy=True,
            )
        return DataProto.from_dict(tensors={"old_log_probs": log_probs, "entropies": entropies})

    @rows_per_data_parallel_share
    @measured("ref_log_prob")
    def compute_ref_log_probs(self, data: DataProto, *, temperature: float) -> DataProto:
        self._release_rollout()
        data = attach_media(data, self.media, self.media_cache)
        micro = self.config.worker.ref.micro_batch_size_per_device_for_experience
        micro = micro or self.config.worker.actor.micro_batch_size_per_device_for_experience
        # with LoRA the reference is the actor's model: its base weights, the adapter switched off
        with self.ref_offload.loaded(), adapters_disabled(self.ref.module):
            log_probs, _ = self.ref.compute_log_probs(data, micro, temperature)
        if self.encoding_cache is not None and not self.config.worker.actor.model.freeze_vision_tower:
            # the reference's encodings alone (the actor's tower trains): no later pass asks for them
            self.encoding_cache.clear()
        return DataProto.from_dict(tensors={"ref_log_probs": log_probs})

    @rows_per_data_parallel_share
    @measured("update_actor")
    def update_actor(
        self,
        data: DataProto,
        *,
        temperature: float,
        on_policy: bool,
        entropy_coeff: float = 0.0,
        spread_coeff: float = 0.0,
        lr_scale: float = 1.0,
    ) -> DataProto:
        """One training step of the actor. ``on_policy``: the batch has no ``old_log_probs``; the update
        returns the ones its own forward computed (with their entropies) for the step's metrics.
        ``entropy_coeff``: the step's entropy bonus weight (the driver's controller); ``spread_coeff``:
        the collapse-recovery term's (the driver's gate); ``lr_scale``: the step's factor on the scheduled
        learning rate (the driver's step-size control). The rollout still holds the old weights until
        :meth:`sync_rollout_weights`."""
        self._release_rollout()
        data = attach_media(data, self.media, self.media_cache)
        actor_cfg = self.config.worker.actor
        with self.actor_offload.loaded():
            update = self.actor.update_policy(
                data,
                mini_batch_size=per_rank(
                    self.config.responses_per_update, self.dp_size, "responses per update"
                ),
                micro_batch_size=actor_cfg.micro_batch_size_per_device_for_update,
                ppo_epochs=actor_cfg.ppo_epochs,
                temperature=temperature,
                on_policy=on_policy,
                entropy_coeff=entropy_coeff,
                spread_coeff=spread_coeff,
                lr_scale=lr_scale,
            )
        metrics = {"metrics": {f"actor/{key}": value for key, value in update.metrics.items()}}
        if self.encoding_cache is not None:  # the step's media items: its last pass that encodes ends here
            counts = self.encoding_cache.take_counts()
            metrics["metrics"].update({f"encoders/{key}": value for key, value in counts.items()})
            if self.config.worker.rollout.reuse_encodings:  # items the engine got as encodings
                metrics["metrics"]["encoders/rollout_items"] = self.rollout_encoded_items
                self.rollout_encoded_items = 0
        if not on_policy:
            return DataProto(meta_info=metrics)
        tensors = {"old_log_probs": update.log_probs, "entropies": update.entropies}
        return DataProto.from_dict(tensors=tensors, meta_info=metrics)

    @rows_per_data_parallel_share(role="critic")
    @measured("values")
    def compute_values(self, data: DataProto) -> DataProto:
        self._release_rollout()
        return self.critic.compute_values(attach_media(data, self.media, self.media_cache))

    @rows_per_data_parallel_share(role="critic")
    @measured("update_critic")
    def update_critic(self, data: DataProto) -> DataProto:
        self._release_rollout()
        return self.critic.update_critic(attach_media(data, self.media, self.media_cache))

    @measured("sync")
    def sync_rollout_weights(self) -> None:
        """Push the actor's weights into the rollout engine, one full tensor at a time, under the names
        it reads (:attr:`_engine_reads_file_names`), each shard cast to the engine's dtype before it is
        gathered. The engine then holds the actor's policy version (``rollout_version``), which it
        stamps on the tokens it samples."""
        rollout_dtype = resolve_dtype(self.config.worker.rollout.dtype, self.device)
        with self.actor_offload.loaded():
            self.rollout.update_weights(
                iter_full_state_dict(
                    self.actor.module,
                    device=self.device,
                    dtype=rollout_dtype,
                    checkpoint_format=self._engine_reads_file_names,
                )
            )
        self.rollout_version = self.actor.version

    @property
    def _engine_reads_file_names(self) -> bool:
        """Whether pushed weights go under the names of the model's files (vLLM's loaders read those)
        rather than the in-memory ones the transformers rollout holds: the only names it can take for a
        family whose files split a tensor (Qwen3.5 MoE: one file tensor per expert, fused in memory)."""
        return self.config.worker.rollout.name == "vllm"

    def weight_push_address(self) -> tuple[str, int]:
        """Where the push group meets (``worker.rollout.placement=separate``): this rank's node address
        (its group's ``MASTER_ADDR``, rank 0's) and a port free there now."""
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return os.environ.get("MASTER_ADDR", "127.0.0.1"), port

    def weight_manifest(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """``(name, shape, dtype)`` of every tensor a push sends, in order (what receivers allocate)."""
        rollout_dtype = resolve_dtype(self.config.worker.rollout.dtype, self.device)
        return full_state_manifest(
            self.actor.module, dtype=rollout_dtype, checkpoint_format=self._engine_reads_file_names
        )

    def join_weight_push(self, host: str, port: int, world_size: int) -> None:
        """Rank 0 opens the push group at ``host:port`` as its rank 0 (the rollout workers join it at
        once, :mod:`mmrl.workers.weight_push`); the other ranks only gather in :meth:`push_rollout_weights`."""
        if self.rank == 0:
            timeout_s = self.config.worker.rollout.push_timeout_s
            self.weight_push = WeightPushGroup(host, port, 0, world_size, self.device, timeout_s)
            self.push_manifest = self.weight_manifest()

    @measured("sync")
    def push_rollout_weights(self) -> int:
        """Send the actor's weights to the rollout workers (collective over the training ranks: each
        shard cast to the rollout's dtype, gathered, then broadcast by rank 0 over the push group);
        returns the bytes each rollout worker received (0 on the other ranks)."""
        rollout_dtype = resolve_dtype(self.config.worker.rollout.dtype, self.device)
        with self.actor_offload.loaded():
            tensors = iter_full_state_dict(
                self.actor.module,
                device=self.device,
                dtype=rollout_dtype,
                checkpoint_format=self._engine_reads_file_names,
            )
            return push_from_rank(tensors, self.weight_push, self.push_manifest)

    def _release_rollout(self) -> None:
        """A training phase begins: the rollout engine frees what it holds on the device (vLLM's sleep;
        the transformers copy's weights). The next update's push brings weights back, so generations
        between two updates share one push."""
        if hasattr(self.rollout, "sleep"):
            self.rollout.sleep()

    def take_memory_peaks(self) -> dict[str, float]:
        """This rank's peak memory per phase since the last call (``memory/<phase>_peak_gib``)."""
        return self.peaks.take()

    def take_rollout_counters(self) -> dict[str, float]:
        """Weight pushes that generations needed since the last call
        (``rollout/weight_pushes_before_generate``: 0 unless a save, a load or a critic warm-up step freed
        the engine's weights since the last update)."""
        pushes, self.pushes_before_generate = self.pushes_before_generate, 0
        return {"rollout/weight_pushes_before_generate": float(pushes)}

    # ---- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, directory: str) -> dict[str, dict[str, Any]]:
        """Writes the actor's (and critic's) folder under ``directory``; returns this rank's report of
        each, with the save id it read there, for the driver's completeness check
        (``CheckpointLayout.commit``): on several machines the driver cannot list the others' files."""
        lora = self.config.worker.actor.model.lora
        adapter = None
        if lora.rank > 0:  # the adapter and its optimizer state; the base stays in model_path
            modules = [name for name, _ in adapter_layers(self.actor.module)]
            adapter = adapter_info(lora.rank, lora.alpha, modules, self.model_path)
        self._release_rollout()
        with self.actor_offload.loaded():
            reports = {
                "actor": save_train_state(
                    Path(directory) / "actor",
                    self.actor.module,
                    self.actor.optimizer,
                    self.actor.lr_scheduler,
                    hf_source_dir=self.model_path,
                    adapter=adapter,
                )
            }
        if self.critic is not None:
            reports["critic"] = self.critic.save_checkpoint(directory)
        save_id = read_save_id(directory)  # None: this machine does not see the driver's folder
        return {role: {**report, "save_id": save_id} for role, report in reports.items()}

    def load_checkpoint(self, directory: str) -> None:
        self._release_rollout()
        with self.actor_offload.loaded():  # the driver pushes the loaded weights into the rollout next
            load_train_state(
                Path(directory) / "actor", self.actor.module, self.actor.optimizer, self.actor.lr_scheduler
            )
        if self.critic is not None:
            self.critic.load_checkpoint(directory)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.barrier()
        if hasattr(self.rollout, "shutdown"):
            self.rollout.shutdown()  # vLLM's teardown destroys the process group itself
        if dist.is_initialized():
            dist.destroy_process_group()
