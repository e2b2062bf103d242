"""Tiny models reload through the Hugging Face Auto classes and run image / audio / text forwards.

Hand-derived numbers used below: a 56x56 image stays 56x56 (a multiple of 28 inside the pixel
bounds), so its patch grid is (t, h, w) = (1, 56/14, 56/14) = (1, 4, 4): 16 patches of
3 * 2 * 14 * 14 = 1176 values, merged 2x2 into 4 placeholder tokens. One second of 16 kHz audio is
16000 / 160 = 100 mel frames -> (100 - 1) // 2 + 1 = 50 after the stride-2 conv -> (50 - 2) // 2 + 1 = 25
audio tokens after pooling.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mmrl.demo import tiny
from mmrl.demo.synthetic import COLORS, draw_color_image

QUESTION = "What colour is the shape? Answer with one word."
ONE_SECOND_AUDIO = np.sin(2 * np.pi * 440 * np.arange(16000) / 16000).astype(np.float32)


def _image():
    return draw_color_image("red", np.random.default_rng(0))


def _image_messages(text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def _generate_exactly(model, inputs, num_tokens: int) -> torch.Tensor:
    return model.generate(**inputs, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False)


# ---------------------------------------------------------------------------------------------- VL


@pytest.fixture(scope="module")
def vl(tiny_vl_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_path).eval()
    return model, AutoProcessor.from_pretrained(tiny_vl_path)


def test_vl_reloads_with_auto_classes(vl):
    model, processor = vl
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert processor.image_processor.size["shortest_edge"] == tiny.MIN_PIXELS
    assert processor.image_processor.size["longest_edge"] == tiny.MAX_PIXELS
    assert model.config.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert model.config.text_config.vocab_size == len(processor.tokenizer)


def test_vl_chat_template_renders_qwen_format(vl):
    _, processor = vl
    text = processor.apply_chat_template(_image_messages(), tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{QUESTION}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_vl_processor_expands_image_into_grid_tokens(vl):
    _, processor = vl
    text = processor.apply_chat_template(_image_messages(), tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[_image()], return_tensors="pt")

    assert set(inputs) == {
        "input_ids",
        "attention_mask",
        "mm_token_type_ids",
        "pixel_values",
        "image_grid_thw",
    }
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert tuple(inputs["pixel_values"].shape) == (16, 1176)
    is_image = inputs["input_ids"] == processor.image_token_id
    assert is_image.sum().item() == inputs["image_grid_thw"].prod().item() // 2**2 == 4
    # mm_token_type_ids mark image tokens with 1; v5's M-RoPE needs them.
    assert torch.equal(inputs["mm_token_type_ids"], is_image.long())


def test_vl_forward_uses_3d_positions_and_generates(vl):
    model, processor = vl
    text = processor.apply_chat_template(_image_messages(), tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[_image()], return_tensors="pt")
    length = inputs["input_ids"].shape[1]

    positions, rope_deltas = model.model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"],
        attention_mask=inputs["attention_mask"],
    )
    start = (inputs["input_ids"][0] == processor.image_token_id).nonzero()[0].item()
    # (t, h, w) of the 2x2 merged image tokens, then text resumes one past the largest position.
    assert positions[:, 0, start : start + 4].tolist() == [
        [start] * 4,
        [start, start, start + 1, start + 1],
        [start, start + 1, start, start + 1],
    ]
    assert positions[:, 0, start + 4].tolist() == [start + 2] * 3
    assert rope_deltas.item() == -2

    with torch.no_grad():
        logits = model(**inputs).logits
        logits_3d = model(**inputs, position_ids=positions).logits
        positions_1d = torch.arange(length).expand(3, 1, length)
        logits_1d = model(**inputs, position_ids=positions_1d).logits
    assert logits.shape == (1, length, len(processor.tokenizer))
    torch.testing.assert_close(logits, logits_3d, rtol=0, atol=0)
    assert not torch.allclose(logits, logits_1d)

    generated = _generate_exactly(model, inputs, 3)
    assert generated.shape == (1, length + 3)
    assert torch.equal(generated[:, :length], inputs["input_ids"])


# -------------------------------------------------------------------------------------------- Omni


@pytest.fixture(scope="module")
def omni(tiny_omni_path):
    from transformers import AutoProcessor, Qwen2_5OmniThinkerForConditionalGeneration

    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(tiny_omni_path).eval()
    return model, AutoProcessor.from_pretrained(tiny_omni_path)


def test_omni_folder_is_a_full_checkpoint_holding_only_the_thinker(tiny_omni_path, omni):
    model, processor = omni
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tiny_omni_path).model_type == "qwen2_5_omni"
    saved = load_file(tiny_omni_path / "model.safetensors")
    assert all(name.startswith("thinker.") for name in saved)
    loaded = model.state_dict()
    assert {f"thinker.{name}" for name in loaded} == set(saved)
    assert all(torch.equal(loaded[name], saved[f"thinker.{name}"]) for name in loaded)
    assert type(processor).__name__ == "Qwen2_5OmniProcessor"
    assert type(processor.feature_extractor).__name__ == "WhisperFeatureExtractor"
    assert processor.feature_extractor.feature_size == model.config.audio_config.num_mel_bins == 32


def test_omni_chat_template_renders_audio_and_image(omni):
    _, processor = omni
    messages = [
        {"role": "user", "content": [{"type": "audio"}, {"type": "image"}, {"type": "text", "text": "Hi"}]}
    ]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|><|vision_bos|><|IMAGE|><|vision_eos|>Hi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_omni_forward_with_audio_and_image_and_generate(omni):
    model, processor = omni
    messages = [
        {"role": "user", "content": [{"type": "audio"}, {"type": "image"}, {"type": "text", "text": "Hi"}]}
    ]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[_image()], audio=[ONE_SECOND_AUDIO], return_tensors="pt")

    assert set(inputs) == {
        "input_ids", "attention_mask", "pixel_values", "image_grid_thw", "input_features", "feature_attention_mask",
    }  # fmt: skip
    assert tuple(inputs["input_features"].shape) == (1, 32, 1000)  # padded to the 10 s chunk
    assert inputs["feature_attention_mask"].sum().item() == 100
    input_ids = inputs["input_ids"][0]
    assert (input_ids == model.config.audio_token_id).sum().item() == 25
    assert (input_ids == model.config.image_token_id).sum().item() == 4

    length = inputs["input_ids"].shape[1]
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, length, len(processor.tokenizer))
    assert torch.isfinite(logits).all()
    assert model.rope_deltas.item() == -2  # the 2x2 image spans 2 positions per axis; audio is 1-D

    generated = _generate_exactly(model, inputs, 3)
    assert generated.shape == (1, length + 3)
    assert torch.equal(generated[:, :length], inputs["input_ids"])


def test_omni_folder_also_loads_as_the_full_model(tiny_omni_path):
    from transformers import AutoModelForMultimodalLM

    model = AutoModelForMultimodalLM.from_pretrained(tiny_omni_path)
    assert type(model.thinker).__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"
    assert not model.has_talker


# -------------------------------------------------------------------------------------------- text


def test_text_model_reloads_forwards_and_generates(tiny_text_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_text_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_text_path)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    messages = [{"role": "user", "content": "How many circles are there?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    length = inputs["input_ids"].shape[1]
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, length, len(tokenizer))
    generated = _generate_exactly(model, inputs, 4)
    assert generated.shape == (1, length + 4)


# ------------------------------------------------------------------------------- sizes and tokens


PARAMETER_RANGES = {
    ("qwen2_5_vl", "tiny"): (300_000, 800_000),
    ("qwen2_5_omni", "tiny"): (300_000, 800_000),
    ("qwen2", "tiny"): (100_000, 300_000),  # no vision tower
    ("glm4v", "tiny"): (300_000, 800_000),
    ("qwen3_5", "tiny"): (300_000, 800_000),
    ("qwen3_5_moe", "tiny"): (300_000, 800_000),
    ("qwen3_omni_moe", "tiny"): (300_000, 800_000),
    ("qwen2_5_vl", "small"): (12_000_000, 18_000_000),
    ("qwen2_5_omni", "small"): (12_000_000, 18_000_000),
    ("qwen2", "small"): (5_000_000, 10_000_000),
    # 311M tied embedding + 2 x 77M decoder layers + 2 x 20M vision blocks + 37M merger
    ("qwen2_5_vl", "3b-width"): (530_000_000, 560_000_000),
}


@pytest.mark.parametrize(("kind", "size"), sorted(PARAMETER_RANGES))
def test_parameter_counts_within_ranges(kind, size):
    low, high = PARAMETER_RANGES[(kind, size)]
    assert low <= tiny.count_parameters(kind, size) <= high


def test_built_folder_records_its_parameter_count(tiny_vl_path):
    import json

    marker = json.loads((tiny_vl_path / tiny.BUILD_MARKER).read_text())
    assert marker["num_parameters"] == tiny.count_parameters("qwen2_5_vl", "tiny")


@pytest.mark.parametrize(
    ("kind", "size"), [(kind, size) for size in sorted(tiny.SIZES) for kind in tiny.SIZES[size].kinds]
)
def test_heads_are_at_least_32_wide_and_mrope_covers_them(kind, size):
    spec = tiny.SIZES[size]
    config = tiny.build_config(kind, spec, tiny.train_tokenizer(tiny.TINY_CORPUS, spec.vocab_size, kind))
    omni = kind in ("qwen2_5_omni", "qwen3_omni_moe")
    if omni:
        config = config.thinker_config
    text_config = config.get_text_config()
    # Qwen3's heads may be wider than hidden_size / heads (Qwen3-VL-30B-A3B: 32 heads of 128 over 2,048)
    head_dim = (
        getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    )
    assert head_dim >= 32
    if kind == "qwen2":
        return
    # the rotary pairs of each head (GLM-4.1V turns half of it)
    rotary_dim = head_dim * text_config.rope_parameters.get("partial_rotary_factor", 1.0)
    assert 2 * sum(text_config.rope_parameters["mrope_section"]) == rotary_dim
    assert config.vision_config.hidden_size // config.vision_config.num_heads >= 32
    assert config.vision_config.out_hidden_size == text_config.hidden_size
    if omni:
        assert config.audio_config.d_model // config.audio_config.encoder_attention_heads >= 32


@pytest.mark.parametrize(
    "path_fixture",
    [
        "tiny_vl_path",
        "tiny_omni_path",
        "tiny_text_path",
        "tiny_glm4v_path",
        # built in the pytest-xdist worker of the other tests of that costly model
        pytest.param("real_width_vl_path", marks=pytest.mark.shares("real_width")),
    ],
)
def test_reloaded_tokenizer_keeps_answers_single_tokens(path_fixture, request):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(request.getfixturevalue(path_fixture))
    for color in COLORS:
        assert len(tokenizer.encode(color, add_special_tokens=False)) == 1
        assert len(tokenizer.encode(" " + color, add_special_tokens=False)) == 1
    for digit in "1234":
        assert len(tokenizer.encode(digit, add_special_tokens=False)) == 1
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    tagged = tokenizer.encode("<answer>red</answer>", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(tagged) == ["<answer>", "red", "</answer>"]


def test_reloaded_tokenizer_encodes_like_the_trained_one(tiny_vl_path):
    from transformers import AutoTokenizer

    # Qwen2Tokenizer rebuilds its pre-tokenizer from code on load; the trained one must agree with it.
    trained = tiny.train_tokenizer(tiny.TINY_CORPUS, tiny.SIZES["tiny"].vocab_size, "qwen2_5_vl")
    reloaded = AutoTokenizer.from_pretrained(tiny_vl_path)
    text = "<|im_start|>user\nHow many circles?  3.14, naïve\n\t<think>x</think> yellow<|im_end|>"
    assert reloaded.encode(text) == trained.encode(text)
    assert reloaded.decode(reloaded.encode(text)) == text


def test_generation_config_stops_at_im_end_and_pads_with_endoftext(tiny_vl_path):
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_vl_path)
    generation_config = GenerationConfig.from_pretrained(tiny_vl_path)
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert generation_config.eos_token_id == [im_end, endoftext]
    assert generation_config.pad_token_id == endoftext


# ------------------------------------------------------------------------------ builds and the CLI


def test_same_seed_gives_identical_weights(tiny_vl_path, tmp_path):
    reference = load_file(tiny_vl_path / "model.safetensors")
    same = load_file(tiny.build_tiny_model("qwen2_5_vl", tmp_path / "same", seed=0) / "model.safetensors")
    other = load_file(tiny.build_tiny_model("qwen2_5_vl", tmp_path / "other", seed=1) / "model.safetensors")
    assert set(same) == set(reference)
    assert all(torch.equal(same[name], reference[name]) for name in reference)
    assert any(not torch.equal(other[name], reference[name]) for name in reference)


def test_complete_folder_is_not_rebuilt_and_foreign_folder_is_refused(tmp_path):
    out_dir = tiny.build_tiny_model("qwen2", tmp_path / "model")
    stamp = (out_dir / "model.safetensors").stat().st_mtime_ns
    assert tiny.build_tiny_model("qwen2", out_dir) == out_dir
    assert (out_dir / "model.safetensors").stat().st_mtime_ns == stamp

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="force"):
        tiny.build_tiny_model("qwen2", foreign)
    tiny.build_tiny_model("qwen2", foreign, force=True)
    assert not (foreign / "notes.txt").exists() and (foreign / tiny.BUILD_MARKER).is_file()


def test_cli_builds_then_reports_up_to_date(tmp_path, capsys):
    out_dir = tmp_path / "cli-model"
    tiny.main(["--kind", "qwen2", "--size", "tiny", "--out", str(out_dir)])
    first = capsys.readouterr().out
    tiny.main(["--kind", "qwen2", "--size", "tiny", "--out", str(out_dir)])
    second = capsys.readouterr().out
    assert "built: qwen2 (tiny)" in first and f"{tiny.count_parameters('qwen2'):,} parameters" in first
    assert "up to date" in second and str(out_dir) in second


def test_tiny_model_path_names():
    assert str(tiny.tiny_model_path("qwen2_5_vl")) == "assets/models/tiny-qwen2.5-vl"
    assert str(tiny.tiny_model_path("qwen2_5_omni", "small", "/x")) == "/x/small-qwen2.5-omni"
    with pytest.raises(ValueError, match="qwen3"):
        tiny.tiny_model_path("qwen3")


# ---------------------------------------------------------------------------------------- real width

REAL_WIDTH_TEXT = {
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 151_936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 128_000,
}
REAL_WIDTH_VISION = {
    "hidden_size": 1280,
    "num_heads": 16,
    "intermediate_size": 3420,
    "out_hidden_size": 2048,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "depth": 2,
    "fullatt_block_indexes": [1],  # the last block attends over the whole image, as the 3B's every 8th
}


def test_real_width_model_has_the_3b_widths_and_vocabulary(real_width_vl_path):
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(real_width_vl_path)
    text, vision = config.get_text_config(), config.vision_config
    assert {key: getattr(text, key) for key in REAL_WIDTH_TEXT} == REAL_WIDTH_TEXT
    assert {key: getattr(vision, key) for key in REAL_WIDTH_VISION} == REAL_WIDTH_VISION
    # head_dim 2048 / 16 = 128: 64 rotary pairs in Qwen's (temporal, height, width) = 16 : 24 : 24
    assert text.rope_parameters["mrope_section"] == [16, 24, 24]
    assert text.rope_parameters["rope_theta"] == 1_000_000.0
    with safe_open(str(real_width_vl_path / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        assert weights.get_slice("model.embed_tokens.weight").get_shape() == [151_936, 2048]
    assert "lm_head.weight" not in names  # tied: the embedding matrix is the head


def test_real_width_tokenizer_fills_the_vocabulary_and_round_trips(real_width_vl_path):
    from transformers import AutoProcessor

    tokenizer = AutoProcessor.from_pretrained(real_width_vl_path).tokenizer
    assert len(tokenizer) == 151_936
    # Qwen2.5's 151,665 entries, then the reserved ones up to the model's rows
    assert tokenizer.convert_tokens_to_ids("<|reserved_0|>") == 151_665
    text = "The red circle, 3.14 = x + y!\n\n  <think>ünïcödé 漢字</think> <answer>4</answer> <|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges apply: not one token per byte
    # every id a random model can sample decodes to text
    tokens = tokenizer.convert_ids_to_tokens(list(range(151_936)))
    assert all(isinstance(token, str) for token in tokens)
    sampled = torch.randint(0, 151_936, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    assert isinstance(tokenizer.decode(sampled), str)


def test_real_width_processor_expands_a_448_image_into_256_placeholders(real_width_vl_path):
    """448 = 32 patches of 14 per side (a multiple of 28 within the 3B's pixel bounds, so not resized):
    a (1, 32, 32) grid of 1024 patches, merged 2x2 into 256 ``<|image_pad|>`` tokens."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(real_width_vl_path)
    prompt = processor.apply_chat_template(_image_messages(), add_generation_prompt=True, tokenize=False)
    assert (
        prompt.startswith("<|im_start|>system\n") and "<|vision_start|><|image_pad|><|vision_end|>" in prompt
    )
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (448, 448, 3), dtype=np.uint8))
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 32, 32]]
    assert inputs["pixel_values"].shape == (1024, 3 * 2 * 14 * 14)
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((inputs["input_ids"] == image_token).sum()) == 256


def test_qwen3_omni_reloads_and_expands_audio_and_images_by_hand(tiny_qwen3_omni_path):
    """The tiny Qwen3-Omni folder is the full model without talker; its thinker loads from the thinker
    config, and its processor expands a 64x64 image to (64/16)^2 / 4 = 4 tokens and one second of
    audio (100 mel frames, one 100-frame chunk through three stride-2 convolutions) to 13 tokens."""
    from transformers import AutoConfig, AutoProcessor, Qwen3OmniMoeThinkerForConditionalGeneration

    config = AutoConfig.from_pretrained(tiny_qwen3_omni_path)
    assert config.model_type == "qwen3_omni_moe" and not config.enable_audio_output
    processor = AutoProcessor.from_pretrained(tiny_qwen3_omni_path)
    assert type(processor).__name__ == "Qwen3OmniMoeProcessor"
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": QUESTION}],
        }
    ]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    image = draw_color_image("red", np.random.default_rng(0)).resize((64, 64))
    inputs = processor(text=[text], images=[image], audio=[ONE_SECOND_AUDIO], return_tensors="pt")
    thinker = config.thinker_config
    ids = inputs["input_ids"][0]
    assert (ids == thinker.image_token_id).sum() == 4 and (ids == thinker.audio_token_id).sum() == 13
    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(tiny_qwen3_omni_path, config=thinker)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, len(ids), thinker.text_config.vocab_size) and torch.isfinite(logits).all()
