"""Training batches built by hand as the rollout hands them over, for tests across the package.

Left-padded prompts through the real processor of a tiny model (images, videos, audio), right-padded
random responses of uneven lengths, and the columns an update reads.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from _models import training_model
from PIL import Image

from mmrl.config import ActorConfig, AlgorithmConfig, CriticConfig
from mmrl.protocol import DataProto
from mmrl.workers.actor import PolicyActor
from mmrl.workers.critic import ValueCritic

TEMPERATURE = 0.7
# Every term of the policy loss is active.
ACTOR_SETTINGS = {
    "loss_type": "ppo",
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.3,
    "clip_ratio_dual": 3.0,
    "entropy_coeff": 0.01,
    "use_kl_loss": True,
    "kl_penalty": "low_var_kl",
    "kl_coef": 0.1,
    "max_grad_norm": 0.5,
    "max_response_length": 7,
}

# AlgorithmConfig fields an actor reads: the KL loss, the rollout correction, the off-policy objective
KL_LOSS_KEYS = {"use_kl_loss", "kl_penalty", "kl_coef", "rollout_correction", "off_policy", "decoupled"}


def _split_settings(section: type, settings: dict) -> tuple[dict, dict, dict]:
    """Flat test settings -> (config section fields, KL-loss algorithm fields, component keywords)."""
    fields = {field.name for field in dataclasses.fields(section)}
    own = {key: value for key, value in settings.items() if key in fields}
    kl = {key: value for key, value in settings.items() if key in KL_LOSS_KEYS}
    rest = {key: value for key, value in settings.items() if key not in fields and key not in KL_LOSS_KEYS}
    return own, kl, rest


def policy_actor(module, optimizer=None, **settings) -> PolicyActor:
    """A :class:`PolicyActor` from flat settings: ``ActorConfig`` fields, the KL loss keys of
    ``AlgorithmConfig`` and the actor's own keywords (``max_response_length``, ``sequence_parallel``...)."""
    own, kl, rest = _split_settings(ActorConfig, settings)
    return PolicyActor(module, ActorConfig(**own), AlgorithmConfig(**kl), optimizer, **rest)


def value_critic(module, optimizer=None, **settings) -> ValueCritic:
    """A :class:`ValueCritic` from flat settings: ``CriticConfig`` fields and the critic's keywords."""
    own, _, rest = _split_settings(CriticConfig, settings)
    return ValueCritic(module, CriticConfig(**own), optimizer, **rest)


TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")
OMNI_VIDEO_KWARGS = {
    "fps": 2.0,
    "do_sample_frames": False,
    "size": {"shortest_edge": 3136, "longest_edge": 3136},
}


def encode_prompt(
    processor,
    seed: int,
    image: tuple[int, int] | None = None,
    video_frames: int | None = None,
    audio_s: float | None = None,
    audio_in_video: bool = False,
    video_fps: float | None = None,
) -> dict:
    """One prompt through the processor: media markers first, then a question. With
    ``audio_in_video`` the clip is the video's sound track (Qwen2.5-Omni interleaves their tokens).
    With ``video_fps`` the frames are passed as already sampled at that rate, with their metadata
    (Qwen3-VL writes each frame's timestamp into the prompt)."""
    rng = np.random.default_rng(seed)
    content, media = [], {}
    if image is not None:
        content.append({"type": "image"})
        pixels = rng.integers(0, 256, (image[1], image[0], 3), dtype=np.uint8)
        media["images"] = [Image.fromarray(pixels)]
    if video_frames is not None:
        content.append({"type": "video"})
        media["videos"] = [rng.integers(0, 256, (video_frames, 56, 56, 3), dtype=np.uint8)]
        if hasattr(processor, "feature_extractor"):  # Omni: its video defaults would upscale the frames
            media["videos_kwargs"] = {**OMNI_VIDEO_KWARGS, "use_audio_in_video": audio_in_video}
        elif video_fps is not None:
            metadata = {
                "fps": video_fps,
                "total_num_frames": video_frames,
                "frames_indices": list(range(video_frames)),
            }
            media["videos_kwargs"] = {"do_sample_frames": False, "video_metadata": [metadata]}
    if audio_s is not None:
        if not audio_in_video:
            content.append({"type": "audio"})
        media["audio"] = [rng.standard_normal(int(16000 * audio_s)).astype(np.float32)]
        media["audio_kwargs"] = {"sampling_rate": 16000}
    content.append({"type": "text", "text": "What is it?"})
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    encoded = dict(processor(text=[prompt], return_tensors="pt", **media))
    if audio_in_video:
        encoded["use_audio_in_video"] = True  # as mmrl.data.dataset marks such rows
    return encoded


def build_batch(processor, rows, response_lengths, seed: int = 0) -> DataProto:
    """Left-padded prompts + right-padded random responses, as the rollout would hand them over."""
    assert len(rows) == len(response_lengths)
    generator = torch.Generator().manual_seed(seed)
    encoded = [encode_prompt(processor, seed + index, **row) for index, row in enumerate(rows)]
    prompt_width, response_width = max(item["input_ids"].shape[1] for item in encoded), max(response_lengths)
    pad_id = processor.tokenizer.pad_token_id
    num_rows = len(rows)
    prompts = torch.full((num_rows, prompt_width), pad_id)
    prompt_mask = torch.zeros(num_rows, prompt_width, dtype=torch.long)
    prompt_types = torch.zeros(num_rows, prompt_width, dtype=torch.long)
    for row, item in enumerate(encoded):
        length = item["input_ids"].shape[1]
        prompts[row, prompt_width - length :] = item["input_ids"][0]
        prompt_mask[row, prompt_width - length :] = 1
        if "mm_token_type_ids" in item:
            prompt_types[row, prompt_width - length :] = item["mm_token_type_ids"][0]
    response_mask = (torch.arange(response_width) < torch.tensor(response_lengths)[:, None]).long()
    responses = torch.randint(50, 300, (num_rows, response_width), generator=generator)  # plain BPE tokens
    responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad_id))
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        "response_mask": response_mask,
    }
    if "mm_token_type_ids" in encoded[0]:  # Qwen-VL
        tensors["mm_token_type_ids"] = torch.cat([prompt_types, torch.zeros_like(responses)], dim=1)
    media = [{key: value for key, value in item.items() if key not in TOKEN_KEYS} for item in encoded]
    uids = [f"p{row // 2}" for row in range(num_rows)]
    return DataProto.from_dict(tensors=tensors, non_tensors={"multi_modal_inputs": media, "uid": uids})


def add_training_columns(batch: DataProto, model_path, seed: int = 1) -> DataProto:
    """``old_log_probs`` near the model's own (some ratios clip), ``ref_log_probs``, ``advantages``,
    critic ``values`` and ``returns``."""
    generator = torch.Generator().manual_seed(seed)
    log_probs, _ = policy_actor(training_model(model_path)).compute_log_probs(batch, len(batch), TEMPERATURE)
    mask = batch.batch["response_mask"].float()
    shape = log_probs.shape
    columns = {
        "old_log_probs": log_probs + 0.3 * torch.randn(shape, generator=generator),
        "ref_log_probs": log_probs + 0.5 * torch.randn(shape, generator=generator),
        "advantages": torch.randn(shape[0], 1, generator=generator) * mask,
        "values": 0.1 * torch.randn(shape, generator=generator),
        "returns": torch.randn(shape[0], 1, generator=generator) * mask,
    }
    return batch.union(DataProto.from_dict(tensors=columns))


# ---------------------------------------------------------------- multi-turn trajectories

# what the chat template appends after a model turn's <|im_end|>: the tool's answer as a user turn
OBSERVATION_OPEN = "\n<|im_start|>user\n<tool_response>\n"
OBSERVATION_CLOSE = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def encode_observation(processor, seed: int, image: tuple[int, int] | None = None, video_frames=None) -> dict:
    """An observation turn through the processor as the agent loop renders one: text, and an image
    or a video (Qwen2.5-VL placeholders), expanded by the processor."""
    rng = np.random.default_rng(seed)
    text, media = "seen", {}
    if image is not None:
        text = "<|vision_start|><|image_pad|><|vision_end|>" + text
        media["images"] = [Image.fromarray(rng.integers(0, 256, (image[1], image[0], 3), dtype=np.uint8))]
    if video_frames is not None:
        text = "<|vision_start|><|video_pad|><|vision_end|>" + text
        media["videos"] = [rng.integers(0, 256, (video_frames, 56, 56, 3), dtype=np.uint8)]
    return dict(processor(text=[OBSERVATION_OPEN + text + OBSERVATION_CLOSE], return_tensors="pt", **media))


def build_trajectory_batch(processor, rows, seed: int = 0) -> DataProto:
    """Trajectories as the agent loop hands them over. ``rows``: ``(prompt spec, prompt seed, turns)``
    with the prompt spec as :func:`encode_prompt` takes it (rows with the same seed share a prompt)
    and turns ``("model", n)`` (n random text tokens, then EOS), ``("observation", spec)`` (spec as
    :func:`encode_observation` takes it) or, first, ``("opening", spec)``: an environment's opening
    observation (turn 0, like the prompt)."""
    from mmrl.agent.trajectory import Trajectory, Turn, assemble_trajectory_batch

    generator = torch.Generator().manual_seed(seed)
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = processor.tokenizer.pad_token_id
    prompts, trajectories = [], []
    for row, (spec, prompt_seed, turns) in enumerate(rows):
        prompts.append(encode_prompt(processor, prompt_seed, **spec))
        trajectory = Trajectory()
        for kind, turn_spec in turns:
            if kind == "model":
                tokens = torch.randint(50, 300, (turn_spec,), generator=generator).tolist() + [eos]
                log_probs = (-torch.rand(len(tokens), generator=generator)).tolist()
                trajectory.turns.append(Turn(trajectory.next_turn, tokens, True, log_probs))
                continue
            encoded = encode_observation(
                processor, seed * 100 + row * 10 + len(trajectory.turns), **turn_spec
            )
            inputs = {key: value for key, value in encoded.items() if key not in TOKEN_KEYS}
            types = encoded["mm_token_type_ids"][0].tolist() if "mm_token_type_ids" in encoded else None
            trajectory.turns.append(
                Turn(
                    0 if kind == "opening" else trajectory.next_turn,
                    encoded["input_ids"][0].tolist(),
                    False,
                    token_types=types,
                    inputs=inputs,
                )
            )
        trajectories.append(trajectory)
    prompt_width = max(item["input_ids"].shape[1] for item in prompts)
    tensors = {
        key: torch.full((len(rows), prompt_width), pad_id if key == "input_ids" else 0) for key in TOKEN_KEYS
    }
    for row, item in enumerate(prompts):
        length = item["input_ids"].shape[1]
        for key in TOKEN_KEYS:
            tensors[key][row, prompt_width - length :] = item[key][0] if key in item else 0
    media = [{key: value for key, value in item.items() if key not in TOKEN_KEYS} for item in prompts]
    uids = [f"p{prompt_seed}" for _, prompt_seed, _ in rows]
    prompt_batch = DataProto.from_dict(
        tensors=tensors, non_tensors={"multi_modal_inputs": media, "uid": uids}
    )
    width = max(trajectory.length for trajectory in trajectories) + 2
    return assemble_trajectory_batch(prompt_batch, trajectories, width, pad_id)
