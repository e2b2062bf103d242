"""The trajectory layout (mmrl.columns): a multi-turn rollout is a response with holes in its mask.

- masks, turn numbers and the reward's token worked out by hand for a trajectory with two tool calls;
- the batch's response is exactly the ids generated plus the ids appended (nothing re-tokenized);
- on the tiny Qwen2.5-VL, trajectories whose observations returned images and a video: position ids
  equal the model's own ``get_rope_index`` over each whole row, and log-probs and gradients are the
  same padded, packed, and packed with shared prompts (the loss counts the model's tokens only).
Sequence parallelism on a trajectory: tests/parallel/test_sequence_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from _batches import TEMPERATURE, build_trajectory_batch, policy_actor
from _models import training_model

from mmrl.agent.trajectory import STOP_BUDGET, Trajectory, Turn, assemble_trajectory_batch
from mmrl.columns import TrajectoryInputs, check_batch, prompt_inputs
from mmrl.core_algos import compute_grpo_advantages
from mmrl.models.inputs import (
    compute_position_ids,
    concat_multi_modal_inputs,
    model_layout,
    sequence_position_ids,
)
from mmrl.protocol import DataProto
from mmrl.workers.forward import forward_arguments
from mmrl.workers.reward_worker import response_lengths, scores_to_token_level

EOS, PAD = 2, 0


def _two_call_trajectory() -> Trajectory:
    """model [21 22 EOS] -> tool [31 32] -> model [23 EOS] -> tool [33] -> model [24 25 EOS]."""
    return Trajectory(
        turns=[
            Turn(1, [21, 22, EOS], True, [-0.1, -0.2, -0.3]),
            Turn(2, [31, 32], False, token_types=[0, 1]),
            Turn(3, [23, EOS], True, [-0.4, -0.5]),
            Turn(4, [33], False, token_types=[0]),
            Turn(5, [24, 25, EOS], True, [-0.6, -0.7, -0.8]),
        ]
    )


def _prompts(rows: int = 1) -> DataProto:
    return DataProto.from_dict(
        tensors={
            "input_ids": torch.tensor([[PAD, 11, 12]] * rows),
            "attention_mask": torch.tensor([[0, 1, 1]] * rows),
            "mm_token_type_ids": torch.zeros(rows, 3, dtype=torch.long),
        },
        non_tensors={"uid": ["a"] * rows},
    )


def test_two_tool_calls_by_hand():
    trajectory = _two_call_trajectory()
    batch = assemble_trajectory_batch(_prompts(), [trajectory], width=12, pad_token_id=PAD)
    tensors = batch.batch
    assert tensors["responses"][0].tolist() == [21, 22, 2, 31, 32, 23, 2, 33, 24, 25, 2, PAD]
    assert tensors["response_mask"][0].tolist() == [1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 0]
    assert tensors["response_turns"][0].tolist() == [1, 1, 1, 2, 2, 3, 3, 4, 5, 5, 5, -1]
    # the attention mask covers the tool tokens: the row stays one contiguous sequence
    assert tensors["attention_mask"][0].tolist() == [0, 1, 1] + [1] * 11 + [0]
    assert tensors["input_ids"][0].tolist() == [PAD, 11, 12, 21, 22, 2, 31, 32, 23, 2, 33, 24, 25, 2, PAD]
    assert tensors["mm_token_type_ids"][0].tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    expected_log_probs = [-0.1, -0.2, -0.3, 0, 0, -0.4, -0.5, 0, -0.6, -0.7, -0.8, 0]
    torch.testing.assert_close(tensors["rollout_log_probs"][0], torch.tensor(expected_log_probs))
    assert tensors["truncated"].tolist() == [0]
    # turn boundaries: where the turn number changes
    turns = tensors["response_turns"][0]
    assert (torch.nonzero(turns[1:] != turns[:-1]).flatten() + 1).tolist() == [3, 5, 7, 8, 11]
    # nothing re-tokenized: the response is what was generated plus what was appended
    valid = tensors["attention_mask"][0, 3:].bool()
    assert tensors["responses"][0][valid].tolist() == trajectory.token_ids()
    assert (
        batch.non_tensor_batch["turn_rewards"][0] == []
        and batch.non_tensor_batch["trajectory_media"][0] is None
    )
    assert check_batch(batch) == []


def test_reward_and_advantages_land_on_the_model_tokens():
    batch = assemble_trajectory_batch(_prompts(2), [_two_call_trajectory()] * 2, width=12, pad_token_id=PAD)
    mask = batch.batch["response_mask"]
    assert response_lengths(batch).tolist() == [11, 11]  # model and tool tokens count against the budget
    scores = scores_to_token_level([1.0, 0.0], mask)
    assert torch.nonzero(scores).tolist() == [[0, 10]]  # the last model token, not the last token
    advantages, _ = compute_grpo_advantages(scores, mask, index=["a", "a"])
    assert (advantages[mask == 0] == 0).all()
    assert advantages[0, 0] > 0 and advantages[1, 0] < 0
    # single-turn rows: the last valid token, as before
    assert torch.nonzero(scores_to_token_level([1.0], torch.tensor([[1, 1, 0]]))).tolist() == [[0, 1]]


def test_budget_cut_trajectories_are_marked_truncated():
    trajectory = _two_call_trajectory()
    trajectory.record.stop = STOP_BUDGET
    batch = assemble_trajectory_batch(_prompts(), [trajectory], width=11, pad_token_id=PAD)
    assert batch.batch["truncated"].tolist() == [1]
    with pytest.raises(ValueError, match="do not fit the response width 10"):
        assemble_trajectory_batch(_prompts(), [trajectory], width=10, pad_token_id=PAD)


# ---------------------------------------------------------------- a real model


TWO_IMAGE_CALLS = [("model", 3), ("observation", {"image": (56, 56)}), ("model", 2),
                   ("observation", {"image": (84, 56)}), ("model", 4)]  # fmt: skip
TRAJECTORY_ROWS = (
    ({"image": (56, 56)}, 0, TWO_IMAGE_CALLS),
    ({"image": (56, 56)}, 0, [("model", 2), ("observation", {}), ("model", 5)]),  # a text tool answer
    ({}, 1, [("model", 4), ("observation", {"video_frames": 4}), ("model", 3)]),
    ({}, 1, [("model", 6)]),  # answered at once
)


@pytest.fixture(scope="module")
def trajectory_batch(tiny_vl_path) -> DataProto:
    from transformers import AutoProcessor

    return build_trajectory_batch(AutoProcessor.from_pretrained(tiny_vl_path), TRAJECTORY_ROWS, seed=3)


def test_position_ids_are_the_models_own_over_each_whole_row(tiny_vl_path, trajectory_batch):
    model = training_model(tiny_vl_path)
    input_ids, attention_mask, width, media, token_types = forward_arguments(trajectory_batch)
    assert isinstance(media[0], TrajectoryInputs) and not isinstance(media[3], TrajectoryInputs)
    assert prompt_inputs(media[0]) is not media[0] and len(media[0]["image_grid_thw"]) == 3
    _assert_batch_positions_equal_each_rows_own(model, input_ids, attention_mask, width, media, token_types)


@pytest.mark.parametrize(
    ("padding_free", "share_prompts"), [(True, False), (True, True)], ids=["packed", "shared_prompts"]
)
def test_packed_log_probs_equal_padded_on_trajectories(
    tiny_vl_path, trajectory_batch, padding_free, share_prompts
):
    model = training_model(tiny_vl_path)
    padded, _ = policy_actor(model, padding_free=False).compute_log_probs(trajectory_batch, 4, TEMPERATURE)
    actor = policy_actor(model, padding_free=padding_free, share_prompts=share_prompts)
    packed, _ = actor.compute_log_probs(trajectory_batch, 4, TEMPERATURE)
    mask = trajectory_batch.batch["response_mask"].bool()
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)
    assert (padded[mask] < 0).all()


def test_media_alignment_check_names_the_sample_the_turn_and_both_counts(tiny_vl_path, trajectory_batch):
    from transformers import AutoConfig

    from mmrl.models.alignment import MediaAlignmentError, check_media_alignment

    config = AutoConfig.from_pretrained(tiny_vl_path)
    batch = trajectory_batch.batch
    media = list(trajectory_batch.non_tensor_batch["multi_modal_inputs"])
    turns = batch["response_turns"]
    check_media_alignment(config, batch["input_ids"], media, turns)  # the real batch is aligned
    check_media_alignment(config, batch["input_ids"], media)  # and each row whole, as a rollout sees it
    # the features of turn 4's image say twice as many tokens as the turn holds
    row = media[0]
    segments = list(row.segments)
    turn, outputs = segments[2]
    assert turn == 4
    grid = outputs["image_grid_thw"] * torch.tensor([1, 1, 2])
    segments[2] = (turn, dict(outputs, image_grid_thw=grid))
    wrong = TrajectoryInputs(dict(row), row.prompt, row.response, tuple(segments))
    expected = int(outputs["image_grid_thw"].prod()) // 4
    message = f"sample 7, turn 4: {expected} image placeholder tokens but features for {2 * expected}"
    with pytest.raises(MediaAlignmentError, match=message):
        check_media_alignment(
            config, batch["input_ids"], [wrong, *media[1:]], turns, ["sample 7", "b", "c", "d"]
        )
    # a prompt whose image lost a placeholder token
    ids = batch["input_ids"].clone()
    first = int(torch.nonzero(ids[0] == config.image_token_id)[0])
    ids[0, first] = PAD
    with pytest.raises(
        MediaAlignmentError, match="row 0, the prompt: .* image placeholder tokens but features"
    ):
        check_media_alignment(config, ids, media, turns)


# an environment's opening observation holds an image: turn 0, as the prompt (the prompt's image too)
OPENING_ROWS = (
    ({"image": (56, 56)}, 0, [("opening", {"image": (56, 56)}), ("model", 3),
                              ("observation", {"image": (84, 56)}), ("model", 2)]),
    ({"image": (56, 56)}, 0, [("opening", {"image": (84, 56)}), ("model", 4)]),
    ({}, 1, [("opening", {"video_frames": 4}), ("model", 3)]),
)  # fmt: skip


def test_an_opening_observation_with_media_is_aligned_positioned_and_scored_like_the_prompt(tiny_vl_path):
    """Turn 0 holds the prompt's and the opening observation's placeholders: the alignment check
    counts both turn-0 media together (it once took the prompt's features alone: "the prompt: 8 image
    placeholder tokens but features for 4"), position ids are the model's own over each row, and
    log-probs are the same padded, packed and with shared prompts."""
    from transformers import AutoConfig, AutoProcessor

    from mmrl.models.alignment import MediaAlignmentError, check_media_alignment

    batch = build_trajectory_batch(AutoProcessor.from_pretrained(tiny_vl_path), OPENING_ROWS, seed=5)
    config = AutoConfig.from_pretrained(tiny_vl_path)
    ids, turns = batch.batch["input_ids"], batch.batch["response_turns"]
    media = list(batch.non_tensor_batch["multi_modal_inputs"])
    assert [turn for turn, _ in media[0].segments] == [0, 0, 2] and (turns[0] == 0).any()
    check_media_alignment(config, ids, media, turns)
    check_media_alignment(config, ids, media)
    row = media[1]
    (_, prompt), (_, opening) = row.segments
    wrong = dict(opening, image_grid_thw=opening["image_grid_thw"] * torch.tensor([1, 1, 2]))
    wrong_row = TrajectoryInputs(dict(row), row.prompt, row.response, ((0, prompt), (0, wrong)))
    prompt_tokens, opening_tokens = (int(part["image_grid_thw"].prod()) // 4 for part in (prompt, opening))
    total = prompt_tokens + opening_tokens
    message = f"row 1, the prompt and the opening observation: {total} image placeholder tokens but "
    with pytest.raises(MediaAlignmentError, match=message + f"features for {total + opening_tokens}"):
        check_media_alignment(config, ids, [media[0], wrong_row, media[2]], turns)

    model = training_model(tiny_vl_path)
    input_ids, attention_mask, width, row_media, token_types = forward_arguments(batch)
    _assert_batch_positions_equal_each_rows_own(
        model, input_ids, attention_mask, width, row_media, token_types
    )
    padded, _ = policy_actor(model, padding_free=False).compute_log_probs(batch, 4, TEMPERATURE)
    mask = batch.batch["response_mask"].bool()
    for share_prompts in (False, True):
        actor = policy_actor(model, padding_free=True, share_prompts=share_prompts)
        packed, _ = actor.compute_log_probs(batch, 4, TEMPERATURE)
        torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)


def _assert_batch_positions_equal_each_rows_own(model, input_ids, attention_mask, width, media, token_types):
    """The batch's M-RoPE positions equal each row's computed alone (valid tokens)."""
    positions = model_layout(
        sequence_position_ids(model, input_ids, attention_mask, width, media, token_types)
    )
    for row in range(len(input_ids)):
        own = compute_position_ids(
            model,
            input_ids[row : row + 1],
            attention_mask[row : row + 1],
            concat_multi_modal_inputs([media[row]]),
            token_types[row : row + 1],
        )
        valid = attention_mask[row].bool()
        assert torch.equal(positions[:, row, valid], own[:, 0, valid]), row
