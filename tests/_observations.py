"""Observations of every kind, at turn 0 and at a later turn, for the agent loop on either backend.

:class:`ShowObservation` is an environment, and this file an environment file: the tests load it by
path, as ``worker.rollout.multi_turn.environment=path.py:Class`` does. A row's ``show`` column names
the kind of observation and ``show_at`` where it comes: 0, the opening observation (turn 0, right
after the prompt); 2, the answer to the model's first turn. The episode ends with the model's turn
that follows it, so every trajectory continues from a context holding the observation's media.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from mmrl.agent.tools import Audio, VideoFrames

VL_KINDS = ("text", "image", "video", "mixed")  # Qwen2.5-VL
AUDIO_KINDS = ("audio", "mixed_audio")  # Qwen2.5-Omni
AT = (0, 2)
# the processor outputs that say an observation's media reached the batch, per kind
MEDIA_KEYS = {
    "text": (),
    "image": ("image_grid_thw",),
    "video": ("video_grid_thw",),
    "mixed": ("image_grid_thw", "video_grid_thw"),
    "audio": ("input_features",),
    "mixed_audio": ("image_grid_thw", "input_features"),
}


def observation(kind: str):
    """What the environment shows: text, a PIL image, video frames, a sound, or a list mixing them."""
    rng = np.random.default_rng(len(kind))
    image = Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8))
    frames = VideoFrames(rng.integers(0, 256, (4, 56, 56, 3), dtype=np.uint8), fps=2.0)
    sound = Audio(np.sin(np.arange(8000) * 0.05).astype(np.float32), 16000)  # 0.5 s
    return {
        "text": "The door is locked.",
        "image": image,
        "video": frames,
        "mixed": ["What you see:", image, "and what moved:", frames],
        "audio": sound,
        "mixed_audio": ["What you see:", image, "and hear:", sound],
    }[kind]


class ShowObservation:
    """Shows the row's ``show`` observation at turn ``show_at`` (see the module docstring)."""

    def reset(self, row):
        self.kind, self.at, self.steps = str(row["show"]), int(row["show_at"]), 0
        return observation(self.kind) if self.at == 0 else "Begin."

    def step(self, action_text):
        self.steps += 1
        if self.at > 0 and self.steps == 1:
            return observation(self.kind), 0.0, False
        return "Done.", 1.0, True


def observation_prompts(prompts, kinds):
    """One row per kind and place (``AT``), the prompts' rows in turn, with ``show`` and ``show_at``."""
    from mmrl.protocol import DataProto

    cases = [(kind, at) for kind in kinds for at in AT]
    rows = prompts[[index % len(prompts) for index in range(len(cases))]]
    columns = {"show": [kind for kind, _ in cases], "show_at": [at for _, at in cases]}
    return rows.union(DataProto.from_dict(non_tensors=columns))


def observation_loop(media, ends, max_turns: int = 2):
    """The agent loop with :class:`ShowObservation`, loaded from this file, rendering observations with
    ``media``'s processor; ``ends``: end-of-turn ids."""
    from dataclasses import replace

    from mmrl.agent.environments import load_environment
    from mmrl.agent.loop import AgentLoop, LoopOptions, ObservationRenderer
    from mmrl.agent.parsing import parse_hermes_tool_calls
    from mmrl.data.processing import MediaProcessor
    from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS

    # frames sized like images, as the video-tool demo sizes them (the default range upscales them)
    config = replace(media.config, video_min_pixels=MIN_PIXELS, video_max_pixels=MAX_PIXELS)
    media = MediaProcessor(media.tokenizer, media.processor, config)
    environment = load_environment(f"{__file__}:ShowObservation")
    renderer = ObservationRenderer(media, "<|im_end|>")
    options = LoopOptions(max_turns=max_turns)
    return AgentLoop(renderer, parse_hermes_tool_calls, options, ends, environment=environment)


def check_observation_batch(batch) -> None:
    """Every trajectory showed its observation where its row says, with its media in the batch, and
    the model took a turn after it."""
    from mmrl.columns import check_batch

    assert check_batch(batch) == []
    turns, mask = batch.batch["response_turns"], batch.batch["response_mask"]
    columns = batch.non_tensor_batch
    for row in range(len(batch)):
        kind, at, record = columns["show"][row], int(columns["show_at"][row]), columns["trajectory"][row]
        case = f"row {row}: {kind} at turn {at}"
        assert record.stop == "answer", (case, record)
        assert list(columns["turn_rewards"][row]) == ([1.0] if at == 0 else [0.0, 1.0]), case
        assert ((turns[row] == at + 1) & (mask[row] == 1)).any(), case  # the model went on after it
        media = columns["trajectory_media"][row]
        if not MEDIA_KEYS[kind]:
            assert media is None, case
            continue
        assert media.turns == (at,), case
        observed = dict(columns["multi_modal_inputs"][row].segments[1:])[at]
        assert all(key in observed for key in MEDIA_KEYS[kind]), (case, sorted(observed))
