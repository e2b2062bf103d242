"""Text after a video resumes at the video's largest M-RoPE id + 1 (mmrl.models.families.qwen2_vl), by hand."""

from __future__ import annotations

import torch

from mmrl.models.families import family_of
from mmrl.models.families.qwen2_vl import renumber_text_after_vision, resume_text_after_vision_max
from mmrl.models.loading import load_model

VIDEO, IMAGE = 2, 1


def _sequence(config, before: int, grid: tuple[int, int, int], after: int, token_type: int):
    merge = config.vision_config.spatial_merge_size
    count = grid[0] * (grid[1] // merge) * (grid[2] // merge)
    token = config.video_token_id if token_type == VIDEO else config.image_token_id
    input_ids = torch.tensor([[0] * before + [token] * count + [0] * after])
    token_types = torch.tensor([[0] * before + [token_type] * count + [0] * after])
    return input_ids, token_types


def test_text_after_a_video_resumes_after_its_last_temporal_id(tiny_vl_path):
    model = load_model(str(tiny_vl_path))
    owner = model.model
    assert (
        owner.config.vision_config.tokens_per_second == 2
        and owner.config.vision_config.spatial_merge_size == 2
    )
    # 3 text tokens, a video of 4 temporal patches of 2x2 merged tokens, 2 text tokens; 1 s per patch
    input_ids, token_types = _sequence(owner.config, 3, (4, 4, 4), 2, VIDEO)
    positions, deltas = owner.get_rope_index(
        input_ids,
        mm_token_type_ids=token_types,
        video_grid_thw=torch.tensor([[4, 4, 4]]),
        second_per_grid_ts=torch.tensor([1.0]),
    )
    # by hand: the video starts at 3; temporal ids step by tokens_per_second * 1 s = 2
    temporal = [3 + 2 * t for t in range(4) for _ in range(4)]
    height = [3, 3, 4, 4] * 4
    width = [3, 4, 3, 4] * 4
    expected = torch.tensor(
        [
            [0, 1, 2, *temporal, 10, 11],
            [0, 1, 2, *height, 10, 11],
            [0, 1, 2, *width, 10, 11],
        ]
    )
    assert torch.equal(positions[:, 0], expected)
    assert deltas.tolist() == [[12 - 21]]  # decoding continues at 12 for the 22nd token


def test_left_padded_batch_and_images_keep_the_models_numbering(tiny_vl_path):
    model = load_model(str(tiny_vl_path))
    owner = model.model
    ids_a, types_a = _sequence(owner.config, 2, (1, 4, 4), 3, IMAGE)  # 9 tokens
    ids_b, types_b = _sequence(owner.config, 1, (2, 4, 4), 1, VIDEO)  # 10 tokens
    pad = torch.zeros(1, 1, dtype=torch.long)
    input_ids = torch.cat([torch.cat([pad, ids_a], 1), ids_b])
    token_types = torch.cat([torch.cat([pad, types_a], 1), types_b])
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, 0] = 0
    positions, deltas = owner.get_rope_index(
        input_ids,
        mm_token_type_ids=token_types,
        image_grid_thw=torch.tensor([[1, 4, 4]]),
        video_grid_thw=torch.tensor([[2, 4, 4]]),
        second_per_grid_ts=torch.tensor([2.0]),
        attention_mask=attention_mask,
    )
    # image: one temporal patch, text resumes at start + 2 (the 2x2 grid) = 4
    assert positions[:, 0, 1:].tolist() == [
        [0, 1, 2, 2, 2, 2, 4, 5, 6],
        [0, 1, 2, 2, 3, 3, 4, 5, 6],
        [0, 1, 2, 3, 2, 3, 4, 5, 6],
    ]
    # video: temporal ids 1 and 1 + 2 * 2 s = 5, text resumes at 6
    assert positions[:, 1].tolist() == [
        [0, 1, 1, 1, 1, 5, 5, 5, 5, 6],
        [0, 1, 1, 2, 2, 1, 1, 2, 2, 6],
        [0, 1, 2, 1, 2, 1, 2, 1, 2, 6],
    ]
    assert deltas.tolist() == [[7 - 9], [7 - 10]]


def test_renumbering_keeps_vision_layout_and_padding():
    # a model's numbering that resumed text too early after a 2-patch video (ids 2..4, text at 3)
    positions = torch.tensor([[0, 0, 1, 2, 2, 4, 4, 3, 4]]).expand(3, -1).clone()
    positions[1:, 3:7] = torch.tensor([2, 2, 2, 2])
    token_types = torch.tensor([0, 0, 0, 2, 2, 2, 2, 0, 0])
    valid = torch.tensor([False, True, True, True, True, True, True, True, True])
    fixed = renumber_text_after_vision(positions, token_types, valid)
    assert fixed[:, 0].tolist() == [0, 0, 0]  # padding untouched
    assert fixed[0].tolist() == [0, 0, 1, 2, 2, 4, 4, 5, 6]
    assert fixed[1].tolist() == [0, 0, 1, 2, 2, 2, 2, 5, 6]


def test_only_qwen2_vl_families_are_wrapped(tiny_vl_path, tiny_omni_path, tiny_text_path):
    assert getattr(load_model(str(tiny_vl_path)).model.get_rope_index, "mmrl_resumes_after_vision_max", False)
    for path in (tiny_omni_path, tiny_text_path):  # the fix belongs to the Qwen2-VL family's spec only
        model = load_model(str(path))
        assert family_of(model).fix_model is None
        owners = [module for module in model.modules() if hasattr(module, "get_rope_index")]
        assert not any(hasattr(owner.get_rope_index, "mmrl_resumes_after_vision_max") for owner in owners)
    # idempotent: a second call leaves the wrapped method alone
    assert not resume_text_after_vision_max(load_model(str(tiny_vl_path)))


def test_renumbering_creates_its_tensors_on_the_inputs_device():
    # On a GPU the inputs are on cuda and the default device is the CPU (a CPU-made range failed there,
    # found by `make gpu-check`); here the inputs stay on the CPU and the default device is `meta`.
    positions = torch.tensor([[0, 1, 2, 2, 3, 3, 9]]).expand(3, -1).clone()
    token_types = torch.tensor([0, 0, 1, 1, 1, 1, 0])
    valid = torch.ones(7, dtype=torch.bool)
    with torch.device("meta"):
        fixed = renumber_text_after_vision(positions, token_types, valid)
    assert fixed.device.type == "cpu"
    assert fixed[0].tolist() == [0, 1, 2, 2, 3, 3, 4]
