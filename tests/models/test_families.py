"""Model families (mmrl.models.families): the registry, each shipped spec, and explicit preparation."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, Qwen2VLConfig

from mmrl.models.attention import PACKED_ATTENTION
from mmrl.models.families import (
    ModelFamily,
    UnknownModelFamilyError,
    family_for,
    family_of,
    known_model_types,
    register_family,
)
from mmrl.models.families.qwen3_vl import shard_deepstack_inputs
from mmrl.models.inputs import build_packed_forward_inputs, build_shared_prefix_inputs, response_token_outputs
from mmrl.models.loading import load_model, tower_modules
from mmrl.models.prepare import prepare_for_training
from mmrl.parallel.sequence import SequenceParallelGroups

SHIPPED = {
    "qwen2": "qwen2",
    "qwen3": "qwen2",
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_vl",
    "qwen2_5_omni": "qwen2_5_omni",
    "qwen2_5_omni_thinker": "qwen2_5_omni",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl_moe",
    "glm4v": "glm4v",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_omni_moe": "qwen3_omni_moe",
    "qwen3_omni_moe_thinker": "qwen3_omni_moe",
}


@pytest.fixture(scope="module")
def tiny_paths(
    tiny_text_path,
    tiny_vl_path,
    tiny_omni_path,
    tiny_qwen3_vl_path,
    tiny_qwen3_vl_moe_path,
    tiny_glm4v_path,
    tiny_qwen3_5_path,
    tiny_qwen3_5_moe_path,
    tiny_qwen3_omni_path,
) -> dict[str, object]:
    return {"qwen2": tiny_text_path, "qwen2_vl": tiny_vl_path, "qwen2_5_omni": tiny_omni_path,
            "qwen3_vl": tiny_qwen3_vl_path, "qwen3_vl_moe": tiny_qwen3_vl_moe_path,
            "glm4v": tiny_glm4v_path, "qwen3_5": tiny_qwen3_5_path,
            "qwen3_5_moe": tiny_qwen3_5_moe_path, "qwen3_omni_moe": tiny_qwen3_omni_path}  # fmt: skip


# ---------------------------------------------------------------- the registry


def test_every_shipped_model_type_has_its_family():
    assert set(SHIPPED) <= set(known_model_types())
    for model_type, name in SHIPPED.items():
        config = type("Config", (), {"model_type": model_type})()
        assert family_for(config).name == name, model_type
    assert family_for(Qwen2VLConfig()).name == "qwen2_vl"


def test_tiny_folders_and_loaded_models_find_their_family(tiny_paths):
    for name, path in tiny_paths.items():
        assert family_for(AutoConfig.from_pretrained(path)).name == name
        model = load_model(str(path))
        family = family_of(model)  # the Omni thinker's own model type maps to the same family
        assert family.name == name
        assert [tower for tower, _ in tower_modules(model)] == list(family.towers)
        tokenizer = AutoTokenizer.from_pretrained(path)
        blocked = family.placeholder_token_ids(tokenizer)
        assert len(blocked) == len(family.placeholder_tokens)  # the tiny tokenizers know them all
        assert tokenizer.eos_token_id not in blocked and tokenizer.pad_token_id not in blocked


def test_qwen3_text_is_a_text_family_member_packed_equal_to_padded(tmp_path):
    """A random 2-layer Qwen3 text model loads through its family and scores packed as padded."""
    from _batches import policy_actor
    from _models import training_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mmrl.protocol import DataProto

    config = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    model = training_model(tmp_path)
    assert family_of(model).name == "qwen2"
    prompts = torch.tensor([[0, 0, 5, 6, 7], [0, 8, 9, 10, 11]])  # left-padded with 0
    responses = torch.tensor([[12, 13, 0], [14, 15, 16]])  # right-padded
    prompt_mask = (prompts != 0).long()
    response_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    batch = DataProto.from_dict(
        tensors={
            "input_ids": torch.cat([prompts, responses], -1),
            "attention_mask": torch.cat([prompt_mask, response_mask], -1),
            "responses": responses,
        }
    )
    packed, _ = policy_actor(model, padding_free=True).compute_log_probs(batch, 2, 1.0)
    padded, _ = policy_actor(model, padding_free=False).compute_log_probs(batch, 2, 1.0)
    mask = response_mask.bool()
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)
    assert (packed[mask] < 0).all()


def test_unknown_model_type_names_itself_and_the_known_ones():
    with pytest.raises(
        UnknownModelFamilyError, match=r"model_type 'llama' \(LlamaConfig\).*qwen2_5_vl.*qwen3_vl"
    ):
        family_for(LlamaConfig())


def test_a_model_type_belongs_to_one_family():
    other = ModelFamily("other", ("qwen3_vl",), "AutoModelForCausalLM", position_ids=lambda *args: None)
    with pytest.raises(ValueError, match="'qwen3_vl' belongs to family 'qwen3_vl' already"):
        register_family(other)


def test_weight_names_for_vllm(tiny_omni_path, tiny_vl_path):
    omni = family_for(AutoConfig.from_pretrained(tiny_omni_path))
    assert omni.weight_prefix_for_vllm(AutoConfig.from_pretrained(tiny_omni_path)) == "thinker."
    vl_config = AutoConfig.from_pretrained(tiny_vl_path)
    assert family_for(vl_config).weight_prefix_for_vllm(vl_config) == ""


def test_position_only_keys_stay_out_of_the_forward():
    omni = family_for(type("Config", (), {"model_type": "qwen2_5_omni"})())
    media = {
        "input_features": 1,
        "feature_attention_mask": 2,
        "video_second_per_grid": 3,
        "use_audio_in_video": True,
    }
    assert omni.forward_media(media) == {"input_features": 1, "feature_attention_mask": 2}
    assert omni.position_media(media) == {"feature_attention_mask": 2, "video_second_per_grid": 3,
                                          "use_audio_in_video": True}  # fmt: skip


def test_deepstack_inputs_follow_the_tokens_a_sequence_parallel_rank_holds():
    visual_mask = torch.tensor([[False, True, True, False, True, False]])  # visual tokens at 1, 2, 4
    features = torch.arange(3.0).unsqueeze(-1).expand(3, 2)  # [V=3, D=2]: row v holds v
    for local_index, expected_mask, expected_rows in (
        ([1, 2, 5], [True, True, False], [0.0, 1.0]),
        ([4, 0, 3], [True, False, False], [2.0]),  # a zigzag ring rank holds non-adjacent chunks
        ([0, 3], [False, False], []),
    ):
        kwargs = {"visual_pos_masks": visual_mask, "deepstack_visual_embeds": [features, 10 * features]}
        shard_deepstack_inputs(kwargs, torch.tensor(local_index))
        assert kwargs["visual_pos_masks"].tolist() == [expected_mask]
        assert kwargs["deepstack_visual_embeds"][0][:, 0].tolist() == expected_rows
        assert kwargs["deepstack_visual_embeds"][1][:, 0].tolist() == [10 * row for row in expected_rows]
    kwargs = {"visual_pos_masks": None}  # a text-only row: nothing to shard
    shard_deepstack_inputs(kwargs, torch.tensor([0]))
    assert kwargs == {"visual_pos_masks": None}


# ---------------------------------------------------------------- preparing a model, explicitly


def _text_rows(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    input_ids = torch.randint(50, min(300, vocab_size), (2, 9), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0  # a left-padded prompt
    return input_ids, attention_mask, 3


def test_an_unprepared_model_fails_packed_passes_with_the_fix(tiny_qwen3_vl_path):
    model = load_model(str(tiny_qwen3_vl_path))
    input_ids, attention_mask, response_length = _text_rows(model.config.text_config.vocab_size)
    with pytest.raises(RuntimeError, match="not prepared for this pass.*prepare_for_training"):
        build_packed_forward_inputs(model, input_ids, attention_mask, None)
    with pytest.raises(RuntimeError, match="prepare_for_training"):
        build_shared_prefix_inputs(model, input_ids, attention_mask, response_length)
    with pytest.raises(RuntimeError, match="prepare_for_training"):
        response_token_outputs(model, input_ids, attention_mask, response_length, padding_free=True)
    with pytest.raises(RuntimeError, match="prepare_for_training"):  # unpadded rows run dense, checked alike
        response_token_outputs(
            model, input_ids, torch.ones_like(attention_mask), response_length, padding_free=True
        )
    # the padded pass needs nothing
    outputs, _ = response_token_outputs(model, input_ids, attention_mask, response_length, padding_free=False)
    assert torch.isfinite(outputs).all()

    prepare_for_training(model, packing=True)  # packed, but not split over ranks
    groups = SequenceParallelGroups(1, 2, 1, 0, 0, 0, None, None, None, None, (0, 1))
    with pytest.raises(RuntimeError, match="sequence-parallel input sharding not enabled"):
        response_token_outputs(
            model, input_ids, attention_mask, response_length, padding_free=True, sequence_parallel=groups
        )
    with pytest.raises(ValueError, match="sequence parallelism runs on packed rows"):
        prepare_for_training(model, packing=False, sequence_parallel=True)


def test_a_prepared_model_is_the_module_that_runs(tiny_qwen3_vl_path):
    model = load_model(str(tiny_qwen3_vl_path))
    assert prepare_for_training(model, packing=True, sequence_parallel=True) is model
    decoder = model.get_decoder()
    assert decoder.config._attn_implementation == PACKED_ATTENTION
    assert model.model.visual.config._attn_implementation == "sdpa"  # the tower keeps its attention
    hooks = dict(decoder._forward_pre_hooks)
    assert len(hooks) == 1
    prepare_for_training(model, packing=True, sequence_parallel=True)  # idempotent
    input_ids, attention_mask, response_length = _text_rows(model.config.text_config.vocab_size)
    with torch.no_grad():
        packed, _ = response_token_outputs(
            model, input_ids, attention_mask, response_length, padding_free=True
        )
        padded, _ = response_token_outputs(model, input_ids, attention_mask, response_length)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    # the passes changed nothing on the model
    assert dict(decoder._forward_pre_hooks) == hooks
    assert decoder.config._attn_implementation == PACKED_ATTENTION


def test_prepare_applies_the_family_fix_to_a_model_built_elsewhere(tiny_vl_path):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_path)
    assert not hasattr(model.model.get_rope_index, "mmrl_resumes_after_vision_max")
    prepare_for_training(model, packing=False)
    assert model.model.get_rope_index.mmrl_resumes_after_vision_max


def test_glm4v_tells_video_frames_from_images_and_fills_each_with_its_features(tiny_glm4v_path):
    """GLM-4.1V's video frames are image-id tokens: the token types derived from the video tokens equal
    the processor's, and a prompt with an image and a video runs only with the family's fix (transformers'
    own mask gives the image features every image-id slot)."""
    from _batches import encode_prompt
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmrl.models.alignment import MediaAlignmentError, check_media_alignment
    from mmrl.models.families.glm4v import separate_image_and_video_slots, token_types_from_ids

    processor = AutoProcessor.from_pretrained(tiny_glm4v_path)
    encoded = encode_prompt(processor, 0, image=(84, 56), video_frames=4, video_fps=2.0)
    model = AutoModelForImageTextToText.from_pretrained(tiny_glm4v_path).eval()
    token_types = token_types_from_ids(model.config, encoded["input_ids"])
    assert torch.equal(token_types, encoded["mm_token_type_ids"])
    assert token_types.eq(1).sum() == 6 and token_types.eq(2).sum() == 8  # 2x3 image, 2 frames of 2x2
    # the media check counts the frames' image-id tokens as video slots
    grids = {key: encoded[key] for key in ("image_grid_thw", "video_grid_thw")}
    check_media_alignment(model.config, encoded["input_ids"], [grids])
    with pytest.raises(MediaAlignmentError, match="6 image placeholder tokens but features for 0"):
        check_media_alignment(
            model.config, encoded["input_ids"], [{"video_grid_thw": grids["video_grid_thw"]}]
        )
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        model(**encoded)
    assert separate_image_and_video_slots(model)
    assert not separate_image_and_video_slots(model)  # idempotent
    with torch.no_grad():
        both = model(**encoded).logits
        # the image's features reach its own slots: another image changes the logits from there on
        other = dict(encoded, pixel_values=encoded["pixel_values"].flip(0))
        changed = model(**other).logits
    first_image = int(token_types[0].eq(1).nonzero()[0])
    assert torch.equal(both[:, :first_image], changed[:, :first_image])
    assert (both[:, first_image:] - changed[:, first_image:]).abs().max() > 1e-4


@pytest.mark.parametrize("fixture", ["tiny_qwen3_5_path", "tiny_qwen3_5_moe_path"])
def test_qwen3_5_linear_attention_runs_each_packed_sequence_alone(request, fixture):
    """Without the family's fix, transformers' gated delta nets (the dense and the MoE model's own
    classes) carry their state from one sequence of a packed row into the next; with it, packed
    log-probs equal padded ones, and shared prompts, which the fix cannot follow, are not used: asked
    for, the actor packs each response after its own prompt."""
    from _batches import build_batch, policy_actor
    from _models import training_model
    from transformers import AutoProcessor

    path = request.getfixturevalue(fixture)
    batch = build_batch(AutoProcessor.from_pretrained(path), ({}, {"image": (56, 56)}, {}), (4, 3, 5))
    model = training_model(path)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a random tiny model predicts nearly uniformly: spread it
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    mask = batch.batch["response_mask"].bool()
    padded, _ = policy_actor(model, padding_free=False).compute_log_probs(batch, 3, 1.0)
    packed, _ = policy_actor(model, padding_free=True, share_prompts=False).compute_log_probs(batch, 3, 1.0)
    # fp32 rounding: the experts' matmuls run over other token counts packed (1.05e-5 of -8.6 seen)
    torch.testing.assert_close(packed[mask], padded[mask], atol=2e-5, rtol=0)
    asked, _ = policy_actor(model, padding_free=True, share_prompts=True).compute_log_probs(batch, 3, 1.0)
    torch.testing.assert_close(asked[mask], padded[mask], atol=2e-5, rtol=0)
    fixed = [module for module in model.modules() if hasattr(module.forward, "mmrl_per_sequence")]
    assert len(fixed) == 1  # the tiny model's one linear-attention layer
    for module in fixed:
        del module.forward  # the class's own forward again
    leaked, _ = policy_actor(model, padding_free=True, share_prompts=False).compute_log_probs(batch, 3, 1.0)
    first = mask[0]
    torch.testing.assert_close(leaked[0, first], padded[0, first], atol=2e-5, rtol=0)  # nothing before it
    assert (leaked - padded)[mask].abs().max() > 1e-2
