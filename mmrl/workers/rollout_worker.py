"""A rollout worker of its own (``worker.rollout.placement=separate``): one process holding a rollout
engine on a GPU (on CPUs: cores) that no training rank uses, so that generation can run while the
training ranks train (``trainer.async_mode=one_step_off``, docs/async.md).

It holds no trainable model: after every update the training ranks push the new weights over the push
group (:mod:`mmrl.workers.weight_push`; the driver calls :meth:`RolloutWorker.receive_weights` beside
``HybridWorker.push_rollout_weights``), and the engine takes their policy version, which it stamps on
the tokens it samples. Generation is the colocated one (:mod:`mmrl.workers.rollout.engine`): the same
sampling seeds per step and rank (of the rollout workers), media attached here from the batch's
compact refs, ``position_ids`` numbered by the architecture's ``get_rope_index`` (the transformers
engine's model; with vLLM, the architecture on the meta device: no weights). A vLLM engine here never
sleeps (no training phase needs its device) and takes each push as the colocated one does
(``VLLMRollout.update_weights``: the family's layout, the CPU kernels' repacking, its caches reset). Multi-turn
trajectories (``worker.rollout.multi_turn``) run here through the agent loop, as on a training rank.

Streaming (``trainer.async_mode=stream``): the driver submits prompts (:meth:`RolloutWorker.stream_submit`)
and a thread of this process decodes them a chunk of ``worker.rollout.stream_chunk_tokens`` tokens at a
time (:class:`mmrl.workers.rollout.streaming.StreamingEngine`); the driver fetches each prompt's n
responses once they have all ended (:meth:`RolloutWorker.stream_take`). A weight push (or validation,
greedy baselines) waits for the chunk in progress to end and holds the engine while it runs; the
generations in flight then continue with the new weights.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mmrl.config import PPOConfig
from mmrl.data.collate import concat_batches
from mmrl.data.processing import MediaCache, attach_media, without_model_media
from mmrl.dispatch import rows_per_rank
from mmrl.models.loading import resolve_model_path
from mmrl.protocol import DataProto
from mmrl.versions import check_versions, packages_of_run
from mmrl.workers.forward import add_position_ids
from mmrl.workers.fsdp_workers import build_media_processor, processes_on_node, setup_distributed
from mmrl.workers.rollout import GenerationMode
from mmrl.workers.rollout.engine import (
    build_agent,
    build_rollout_engine,
    generate_with,
    position_model,
    sampling_params,
)
from mmrl.workers.rollout.streaming import StreamingEngine
from mmrl.workers.weight_push import Manifest, WeightPushGroup

# meta_info["metrics"] keys of a generation's wall-clock window (time.time()), read by the driver
GENERATION_STARTED, GENERATION_FINISHED = "generation_started_at", "generation_finished_at"


class RolloutWorker:
    """One rollout engine (``worker.rollout.name``) in a process of its own; ranks of the rollout
    workers' own process group (vLLM's SPMD engines need one), rank r of the push group being r + 1."""

    def __init__(self, config: PPOConfig, cpu_threads: int | None = None):
        self.config = config
        check_versions(packages_of_run(config.worker.rollout.name))
        self.device = setup_distributed(cpu_threads, processes_on_node(config))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        model_cfg = config.worker.actor.model
        self.model_path = resolve_model_path(model_cfg.model_path, "worker.actor.model.model_path")
        self.media, self.media_cache = build_media_processor(config), MediaCache()
        self.engine, model_type = build_rollout_engine(config, self.model_path, self.device)
        self.position_model = position_model(self.engine, config, self.model_path)
        # multi-turn trajectories run here, tools and environments too: their media stay in this process
        self.agent = build_agent(config, self.media, self.engine.eos_token_ids, model_type)
        self.version = 0  # policy version (actor updates) of the weights the engine holds
        self.weight_push: WeightPushGroup | None = None
        self.manifest: Manifest = []
        # trainer.async_mode=stream: generations decoded by a thread, a chunk at a time (worker.rollout.
        # stream_chunk_tokens); everything else that uses the engine holds it between two chunks
        self.streaming = StreamingEngine(self.engine, config.worker.rollout.stream_chunk_tokens)

    def join_weight_push(self, host: str, port: int, world_size: int, manifest: Manifest) -> None:
        """Join the push group training rank 0 opens at ``host:port``; ``manifest``: what each push
        sends, in order."""
        timeout_s = self.config.worker.rollout.push_timeout_s
        self.weight_push = WeightPushGroup(host, port, self.rank + 1, world_size, self.device, timeout_s)
        self.manifest = manifest

    @torch.no_grad()
    def receive_weights(self, version: int) -> None:
        """Load the weights the training ranks push now (``HybridWorker.push_rollout_weights``), of
        policy version ``version``."""
        if self.weight_push is None:
            raise RuntimeError(
                "receive_weights before join_weight_push: the driver connects the push group first"
            )
        with self.streaming.hold():
            self.engine.update_weights(self.weight_push.receive(self.manifest))
            self.version = version
            self.streaming.reload(version)  # partial rollouts: the rest of each is the new weights'

    @rows_per_rank
    def generate(
        self, prompts: DataProto, *, mode: GenerationMode, global_step: int, round_index: int = 0
    ) -> DataProto:
        """``len(prompts) * n`` responses, as ``HybridWorker.generate`` samples them, with the window
        (wall-clock start and end) of the generation in ``meta_info["metrics"]``."""
        started = time.time()
        prompts = attach_media(prompts, self.media, self.media_cache, rollout_media=True)
        sampling = sampling_params(self.config, mode, global_step, self.rank, self.world_size, round_index)
        with self.streaming.hold():
            version = self.version if self.config.trainer.records_policy_versions else None
            output = generate_with(
                self.engine, self.agent, prompts, sampling, mode, self.position_model, version
            )
        output.meta_info["metrics"] = {GENERATION_STARTED: started, GENERATION_FINISHED: time.time()}
        return output

    def stream_submit(self, prompts: DataProto, submission: int) -> None:
        """Start generating ``prompts`` (training sampling; the seed of the driver's ``submission``-th
        submission) in the streaming thread, after the generations submitted before."""
        prompts = attach_media(prompts, self.media, self.media_cache, rollout_media=True)
        sampling = sampling_params(self.config, GenerationMode.TRAIN, submission, self.rank, self.world_size)
        self.streaming.submit(prompts, sampling, self.version, self.agent)

    def stream_take(self, timeout_s: float) -> DataProto | None:
        """The groups finished since the last call (rows of a prompt together, ``position_ids`` and each
        token's ``policy_version`` included), waiting up to ``timeout_s`` for one; None when none."""
        parts = self.streaming.take(timeout_s)
        if not parts:
            return None
        joined = concat_batches(parts, self.engine.pad_token_id)  # submissions padded to their own widths
        return without_model_media(add_position_ids(self.position_model, joined))

    def shutdown(self) -> None:
        self.streaming.stop()
        if hasattr(self.engine, "shutdown"):
            self.engine.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
