"""The typed configuration tree of a run: ``PPOConfig(data, algorithm, worker, trainer)``.

Every knob lives here with its meaning and unit. Key names follow EasyR1's where the meaning is the
same, so its users' YAML files carry over (differences are listed in the README). Loading
(:mod:`mmrl.trainer.config_loader`) merges dataclass defaults ← YAML ← ``key=value`` arguments,
resolves relative paths, and validates once; the dataclasses are frozen afterwards, so the config
printed at start is the config that runs. Derived values are properties, never written back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

# the data section lives with the data layer; its spec helpers are re-exported for config_loader
from mmrl.data.config import (  # noqa: F401
    DATA_FILE_SUFFIXES,
    DATA_FORMATS,
    DataConfig,
    split_dataset_spec,
    unsupported_data_file,
)


def split_function_spec(spec: str, default_name: str = "main") -> tuple[str, str]:
    """``"reward.py:compute_score"`` → ``("reward.py", "compute_score")``; no ``:`` → EasyR1's ``main``."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or os.sep in name:
        return spec, default_name
    return path, name


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Rollout/training mismatch correction of the policy loss (``core_algos.rollout_correction_weights``).

    The rollout engine's log-probs of the sampled tokens (``rollout_log_probs``) and the trainer's
    (``old_log_probs``) differ (vLLM's bf16 kernels are not the trainer's), so the samples come from
    pi_rollout, not from pi_old. Each token's policy loss is multiplied by a weight built from
    rho = pi_old / pi_rollout: a truncated importance weight, a 0/1 rejection, or both. Rejected tokens
    keep counting in the loss's normalisers (as in TRL and OpenRLHF).
    """

    # importance weight min(rho, rollout_is_threshold) on the loss: null (off) | token (rho_t) |
    # sequence (the product of the response's rho_t, on each of its tokens)
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0  # truncation of the importance weight (> 0; typically 1.5-5)
    # rejection: loss weight 0 where the ratio lies outside [lower, threshold]: null (off) | token (rho_t) |
    # sequence (product over the response) | geometric (geometric mean over the response: length-fair)
    rollout_rs: str | None = None
    rollout_rs_threshold: float = 2.0  # upper acceptance bound of the ratio (geometric: e.g. 1.001)
    rollout_rs_threshold_lower: float | None = None  # lower acceptance bound; null = 1 / rollout_rs_threshold

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # grpo | grpo_passk | rloo | reinforce_plus_plus | remax | gae
    norm_adv_by_std: bool = True  # grpo, grpo_passk: divide by the group's std; false = Dr. GRPO
    gamma: float = 1.0  # discount of future token rewards (gae, reinforce_plus_plus)
    lam: float = 1.0  # GAE lambda
    disable_kl: bool = False  # no KL term at all (and no reference model)
    use_kl_loss: bool = False  # true: KL as a loss term of the actor; false: KL as a reward penalty
    kl_penalty: str = "low_var_kl"  # KL estimator: k1 (kl) | k2 (mse) | k3 (low_var_kl) | abs
    kl_coef: float = 1e-3  # weight of the KL term (initial value when adaptive)
    kl_type: str = "fixed"  # coefficient controller: fixed | adaptive (reward penalty only)
    kl_target: float = 0.1  # adaptive controller: KL (nats per token) the coefficient steers towards
    kl_horizon: float = 10000.0  # adaptive controller: responses over which the error is corrected
    # DAPO dynamic sampling: drop prompt groups whose `filter_key` scores are all equal or whose mean is
    # outside [filter_low, filter_high], and generate more (data.mini_rollout_batch_size prompts a round,
    # at most trainer.max_try_make_batch rounds) until data.rollout_batch_size groups are kept
    online_filtering: bool = False
    filter_key: str = "overall"  # reward score key the filter reads (`overall` = the reward)
    filter_low: float = 0.01  # keep a group only when its mean score is >= this ...
    filter_high: float = 0.99  # ... and <= this
    # when trainer.max_try_make_batch rounds cannot fill a step: stop (the run ends with a message) |
    # train (the step trains on the groups kept, topped up with groups it dropped: a policy that has
    # settled on one answer keeps training, and an entropy bonus can bring it back; the dropped groups
    # that failed, mean < filter_low, come first and train, the others only fill the batch and are left
    # out of the loss)
    unfilled_step: str = "stop"
    # correction of the mismatch between the rollout engine's and the trainer's probabilities
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    @property
    def use_reference(self) -> bool:
        return not self.disable_kl


@dataclass(frozen=True)
class ModelConfig:
    """A trained model; the actor's section adds what the whole run shares (:class:`ActorModelConfig`)."""

    model_path: str | None = (
        None  # Hugging Face folder, or hub id (from the HF cache; downloaded unless HF_HUB_OFFLINE)
    )
    override_config: dict[str, Any] = field(default_factory=dict)  # entries set on the HF config at load
    enable_gradient_checkpointing: bool = True  # recompute activations in backward (less memory)
    freeze_vision_tower: bool = False  # keep the vision (and audio) encoder weights fixed


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 0  # LoRA rank of the actor's adapter; 0 = full fine-tuning
    alpha: int = 64  # LoRA scaling numerator: the update is (alpha / rank) * B @ A
    target_modules: str = "all-linear"  # all-linear, or comma-separated module names (q_proj,v_proj,...)
    exclude_modules: str | None = None  # regex of module names left without adapter, e.g. `.*visual.*`


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

    @property
    def tokenizer_or_model_path(self) -> str | None:
        return self.tokenizer_path or self.model_path

    @property
    def tokenizer_key(self) -> str:
        """The key naming the run's tokenizer (in messages about it)."""
        return f"worker.actor.model.{'tokenizer_path' if self.tokenizer_path else 'model_path'}"


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


@dataclass(frozen=True)
class PolicyLossConfig:
    """The policy loss and its knobs: keys of ``worker.actor`` (:class:`ActorConfig` derives from this).
    The losses of :mod:`mmrl.core_algos.policy_losses` receive this section whole and read what they
    need, so a new knob is a field here and a line in its loss."""

    loss_type: str = "ppo"  # policy loss: ppo | gspo | gspo_token | cispo | sapo | clip_cov | kl_cov
    # ratio clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]; null = the loss's own default (ppo and
    # clip_cov 0.2 / 0.3 (DAPO clip-higher), gspo(_token) 3e-4 / 4e-4, cispo 1 / 4 (no lower bound; 0:
    # weight >= 1), sapo and kl_cov none)
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_dual: float = 3.0  # ppo: dual-clip constant c (> 1): loss bounded by c·|A| for A < 0
    tau_positive: float = 1.0  # sapo: gate temperature for tokens with advantage >= 0
    tau_negative: float = 1.05  # sapo: gate temperature for tokens with advantage < 0
    # clip_cov and kl_cov (Cui et al. 2025): act on the few tokens whose covariance between log-prob and
    # advantage, (A - mean A)(log p - mean log p) over a micro-batch's valid tokens, is highest
    clip_cov_ratio: float = 2e-4  # clip_cov: fraction of the valid tokens whose gradient is cut (>= 1 token)
    clip_cov_lb: float = 1.0  # clip_cov: tokens are drawn among those with covariance above this ...
    clip_cov_ub: float = 5.0  # ... and below this
    kl_cov_ratio: float = 2e-3  # kl_cov: fraction of the valid tokens (highest covariance) penalised (>= 1)
    kl_cov_coef: float = 1.0  # kl_cov: weight of |log p - old log p| added to those tokens' loss

    @property
    def clip_range(self) -> tuple[float, float] | None:
        """``(clip_ratio_low, clip_ratio_high)`` the loss runs with: null keys take ``loss_type``'s default
        (``core_algos.POLICY_LOSS_CLIP_DEFAULTS``); None for a loss without clip (sapo, kl_cov)."""
        from mmrl.core_algos import policy_clip_range  # imports torch: only when asked

        return policy_clip_range(self.loss_type, self.clip_ratio_low, self.clip_ratio_high)


@dataclass(frozen=True)
class AdaptiveEntropyConfig:
    """Skywork-OR1's entropy control (Zhou et al. 2025, sec. 4): after each step the coefficient rises by
    ``delta_ent_coef`` while the step's entropy is below ``target_entropy`` and falls by it at or above,
    within ``[min_ent_coef, max_ent_coef]``, starting at ``worker.actor.entropy_coeff``; the bonus applies
    only while the entropy is below the target. The entropy is the one the actor measures
    (``entropy_top_k``), as a token mean over the step's responses."""

    enabled: bool = False  # steer the entropy coefficient (worker.actor.entropy_coeff is its start)
    target_entropy: float = 0.2  # nats per response token the control keeps the policy's entropy above
    delta_ent_coef: float = 1e-4  # change of the coefficient per step
    min_ent_coef: float = 0.0  # the coefficient's lower bound
    max_ent_coef: float = 5e-3  # the coefficient's upper bound


@dataclass(frozen=True)
class ActorConfig(PolicyLossConfig):
    global_batch_size: int = 128  # prompts per optimizer step (each brings rollout.n responses)
    micro_batch_size_per_device_for_update: int = 4  # responses per forward/backward in the update
    micro_batch_size_per_device_for_experience: int = 16  # responses per forward in log-prob passes
    max_grad_norm: float = 1.0  # gradient clipping norm; a non-finite norm skips the step
    # DAPO overlong filtering: responses cut at max_response_length (no EOS) are left out of the loss
    mask_truncated_responses: bool = False
    loss_avg_mode: str = (
        "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm
    )
    ppo_epochs: int = 1  # passes over each rollout batch
    # one optimizer step per rollout (global_batch_size = rollout_batch_size, ppo_epochs 1, no KL reward
    # penalty): take the old log-probs from the update's own forward instead of a separate pass
    skip_old_log_prob_on_policy: bool = True
    entropy_coeff: float = 0.0  # weight of the entropy bonus (0 = logged only); adaptive: its start value
    # entropy over the entropy_top_k most probable tokens, renormalised (bonus, metrics, adaptive control):
    # on a small model a whole-vocabulary bonus spreads probability over non-words; 0 = whole vocabulary
    entropy_top_k: int = 0
    adaptive_entropy: AdaptiveEntropyConfig = field(default_factory=AdaptiveEntropyConfig)
    padding_free: bool = True  # train on packed sequences without padding tokens
    share_prompts: bool = True  # packed: each distinct prompt of a micro-batch once, before its responses
    max_tokens_per_micro_batch: int | None = None  # packed tokens per forward (actor, ref); null = by count
    # response tokens per chunk of the log-prob/entropy head (actor, ref): [chunk, vocab] logits at a
    # time, in forward and backward; 0 = the whole [tokens, vocab] logits at once
    log_prob_chunk_tokens: int = 1024
    ulysses_size: int = 1  # sequence parallel: attention heads split over this many ranks (actor and ref)
    ring_size: int = 1  # sequence parallel: each sequence split over this many Ulysses groups in a ring
    model: ActorModelConfig = field(default_factory=ActorModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks that share one data-parallel share of the rows (ring x Ulysses)."""
        return self.ulysses_size * self.ring_size


@dataclass(frozen=True)
class RefConfig:
    micro_batch_size_per_device_for_experience: int | None = None  # null = the actor's
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    offload: RefOffloadConfig = field(default_factory=RefOffloadConfig)  # frozen: no optimizer to offload


@dataclass(frozen=True)
class CriticConfig:
    global_batch_size: int = 128  # prompts per optimizer step, as for the actor
    micro_batch_size_per_device_for_update: int = 4  # responses per forward/backward
    micro_batch_size_per_device_for_experience: int = 16  # responses per forward in the value pass
    max_grad_norm: float = 1.0  # gradient clipping norm
    cliprange_value: float = 0.5  # values clipped to old value ± this in the value loss
    loss_avg_mode: str = "token_mean"  # aggregation of the value loss; the actor's modes
    ppo_epochs: int = 1  # passes over each rollout batch
    padding_free: bool = True  # train on packed sequences
    share_prompts: bool = True  # packed: each distinct prompt of a micro-batch once, before its responses
    max_tokens_per_micro_batch: int | None = None  # packed tokens per forward; null = by response count
    ulysses_size: int = 1  # sequence parallel: attention heads split over this many ranks
    ring_size: int = 1  # sequence parallel: each sequence split over this many Ulysses groups in a ring
    # model_path null = the actor's folder; the other model keys are the critic's own
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks that share one data-parallel share of the rows (ring x Ulysses)."""
        return self.ulysses_size * self.ring_size


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
    enforce_eager: bool = False  # vLLM: no CUDA graphs
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

    def sampling_for_validation(self) -> dict[str, Any]:
        """Sampling parameters for validation: the training ones with val_override_config applied."""
        params = {key: getattr(self, key) for key in SAMPLING_KEYS}
        params.update(self.val_override_config)
        return params


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


@dataclass(frozen=True)
class WorkerConfig:
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None  # existing cluster (`auto` after `ray start`); null = start a local one
    num_cpus: int | None = None  # CPUs of a local cluster; null = all
    include_dashboard: bool = False  # the dashboard costs ~0.7 GB of memory
    object_store_memory_bytes: int | None = 2_000_000_000  # local object store size


LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow", "swanlab")


@dataclass(frozen=True)
class StageConfig:
    """One stage of a multi-stage schedule (``trainer.stages``): the run's config with ``overrides``,
    for ``steps`` steps, continuing from the previous stage's last checkpoint."""

    name: str = ""  # shown on the progress line and in the logs; empty = its number
    steps: int = 0  # training steps of this stage (> 0)
    # key=value overrides of this stage, written as on the command line, e.g.
    # [data.max_response_length=16384, worker.rollout.n=16, worker.actor.optim.lr=5.0e-7]
    overrides: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TrainerConfig:
    total_epochs: int = 15  # passes over the training prompts
    max_steps: int | None = None  # stop after this many steps (overrides total_epochs when smaller)
    project_name: str = "mmrl"  # logger project
    experiment_name: str = "demo"  # logger run name
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # any of LOGGERS
    nnodes: int = 1  # machines
    n_gpus_per_node: int = 8  # training processes per machine (GPUs; CPU processes on a CPU machine)
    device: str = "auto"  # auto (GPUs when the Ray cluster has any) | cuda | cpu
    # CPUs Ray reserves per training process, also its torch threads (media decoding and processing);
    # null = on GPU nodes the node's CPUs (less the reward workers') shared by its processes, 0.5 on CPUs
    cpus_per_worker: float | None = None
    seed: int = 1  # seed of model init, dropout and sampling RNGs
    critic_warmup: int = 0  # steps that update the critic only
    val_freq: int = -1  # validate every this many steps; -1 = never during training
    val_before_train: bool = True  # validate once before the first step
    val_only: bool = False  # validate and exit
    val_generations_to_log: int = 0  # sample generations written to the loggers per validation
    save_freq: int = -1  # checkpoint every this many steps and at the end; -1 = only at the end; 0 = never
    save_limit: int = -1  # keep at most this many checkpoints; -1 = all
    save_checkpoint_path: str | None = None  # null = checkpoints/<project_name>/<experiment_name>
    load_checkpoint_path: str | None = None  # a global_step_N folder to resume from
    find_last_checkpoint: bool = True  # resume from the latest checkpoint under save_checkpoint_path
    # online_filtering: generation rounds a step may take to fill its batch; -1 = no limit
    max_try_make_batch: int = 20
    # multi-stage training (Skywork-OR1: 8k, then 16k, then 32k response tokens): the stages run one after
    # the other in one command, each resuming from the last one's checkpoint; their steps replace
    # max_steps; empty = one stage, this config
    stages: list[StageConfig] = field(default_factory=list)
    ray: RayConfig = field(default_factory=RayConfig)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.n_gpus_per_node

    @property
    def checkpoint_dir(self) -> str:
        if self.save_checkpoint_path:
            return self.save_checkpoint_path
        return os.path.abspath(os.path.join("checkpoints", self.project_name, self.experiment_name))


@dataclass(frozen=True)
class PPOConfig:
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def use_critic(self) -> bool:
        return self.algorithm.adv_estimator == "gae"

    @property
    def responses_per_step(self) -> int:
        return self.data.rollout_batch_size * self.worker.rollout.n

    @property
    def responses_per_update(self) -> int:
        """Responses in one actor optimizer step (EasyR1 multiplied the config value in place)."""
        return self.worker.actor.global_batch_size * self.worker.rollout.n


# ---------------------------------------------------------------------------------------------
# Choices: every key whose value is one of a fixed set of names, declared here once. The loader
# validates against these; the registries that implement the names (core_algos, fsdp_engine,
# logging) are checked against them by tests/trainer/test_config_contract.py, which also fails when a
# name is exercised by no test. Keyed by (section class, field): a class used by several sections
# (FSDPConfig for actor, ref and critic) is validated in each of them.
# ---------------------------------------------------------------------------------------------

DTYPES = ("auto", "fp32", "bf16")  # auto = bf16 on GPU, fp32 on CPU (fp32 storage for torch_dtype)
STORAGE_DTYPES = ("fp32", "bf16")
LOSS_AVG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")

CHOICES: dict[tuple[type, str], tuple[str, ...]] = {
    (AlgorithmConfig, "adv_estimator"): ("grpo", "grpo_passk", "rloo", "reinforce_plus_plus", "remax", "gae"),
    (AlgorithmConfig, "kl_penalty"): ("kl", "k1", "mse", "k2", "low_var_kl", "k3", "abs"),
    (AlgorithmConfig, "kl_type"): ("fixed", "adaptive"),
    (AlgorithmConfig, "unfilled_step"): ("stop", "train"),
    (RolloutCorrectionConfig, "rollout_is"): ("token", "sequence"),  # or null: off
    (RolloutCorrectionConfig, "rollout_rs"): ("token", "sequence", "geometric"),  # or null: off
    (ActorConfig, "loss_type"): ("ppo", "gspo", "gspo_token", "cispo", "sapo", "clip_cov", "kl_cov"),
    (ActorConfig, "loss_avg_mode"): LOSS_AVG_MODES,
    (CriticConfig, "loss_avg_mode"): LOSS_AVG_MODES,
    (OptimConfig, "strategy"): ("adamw", "adamw_bf16"),
    (OptimConfig, "lr_scheduler_type"): ("constant", "cosine"),
    (FSDPConfig, "torch_dtype"): DTYPES,
    (FSDPConfig, "mp_param_dtype"): DTYPES,
    (FSDPConfig, "mp_reduce_dtype"): STORAGE_DTYPES,
    (FSDPConfig, "mp_buffer_dtype"): STORAGE_DTYPES,
    (RolloutConfig, "name"): ("vllm", "hf"),
    (RolloutConfig, "dtype"): DTYPES,
    (RewardConfig, "reward_type"): ("batch", "sequential"),  # or null: the reward file's REWARD_TYPE
    (CodeConfig, "score"): ("pass_rate", "all_passed"),
    (SandboxConfig, "isolation"): ("namespaces", "process"),
    (RewardConfig, "combine"): ("weighted_sum", "rule_function"),
    (JudgeConfig, "parser"): ("yes_no", "number", "rubric"),
    (RewardModelConfig, "head"): ("classification", "yes_token"),
    (RewardModelConfig, "normalize"): ("none", "sigmoid", "batch_zscore"),
    (RewardModelConfig, "device"): ("auto", "cuda", "cpu"),
    (TrainerConfig, "logger"): LOGGERS,  # a list: each entry one of these
    (TrainerConfig, "device"): ("auto", "cuda", "cpu"),
}
