"""The discriminative reward model: a sequence-classification head (text) and the yes-token head (a
vision-language model shown the sample's image), in batches equal to one at a time; normalisation."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmrl.config import RewardConfig, RewardModelConfig
from mmrl.data.processing import PromptMedia
from mmrl.rewards.compose import build_composite
from mmrl.rewards.reward_model import RewardModelSource, normalize_scores
from mmrl.rewards.rule import load_reward_function
from mmrl.rewards.source import RewardSourceError

SHAPES = Path(__file__).parents[2] / "reward_functions" / "shapes.py"
QUESTION = "<image>What colour is the shape? Answer with one word."


def _png(colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (56, 56), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _samples(with_media: bool = False) -> list[dict]:
    colours = [(220, 30, 30), (30, 70, 220), (30, 160, 60)]
    responses = ["red", "the shape is blue, I think", "green"]
    return [
        {
            "response": response,
            "ground_truth": "red",
            "problem": QUESTION,
            **({"media": PromptMedia(prompt="", images=(_png(colour),))} if with_media else {}),
        }
        for response, colour in zip(responses, colours)
    ]


@pytest.fixture(scope="module")
def classifier_path(tiny_text_path, tmp_path_factory) -> Path:
    """The tiny Qwen2 with a one-label score head (seed 0), as a reward model is saved."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_text_path, num_labels=1)
    out = tmp_path_factory.mktemp("reward-model")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_text_path).save_pretrained(out)
    return out


def test_normalisations_by_hand():
    assert normalize_scores([1.0, -2.0], "none") == [1.0, -2.0]
    assert normalize_scores([0.0, math.log(3.0)], "sigmoid") == pytest.approx([0.5, 0.75])
    assert normalize_scores([1.0, 2.0, 3.0], "batch_zscore") == pytest.approx([-(1.5**0.5), 0.0, 1.5**0.5])
    assert normalize_scores([2.0, 2.0], "batch_zscore") == [0.0, 0.0]


def test_classification_head_scores_batches_as_one_at_a_time(classifier_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    source = RewardModelSource(str(classifier_path), head="classification", batch_size=2)
    scores = [result["overall"] for result in source.score(_samples())]
    # reference: each conversation alone, no padding, the logit of its last token
    tokenizer = AutoTokenizer.from_pretrained(classifier_path)
    model = AutoModelForSequenceClassification.from_pretrained(classifier_path).eval()
    expected = []
    for sample in _samples():
        messages = [
            {"role": "user", "content": "What colour is the shape? Answer with one word."},
            {"role": "assistant", "content": sample["response"]},
        ]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            expected.append(model(input_ids=ids["input_ids"]).logits[0, 0].item())
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(scores)) == 3


def test_yes_token_head_shows_the_image_and_matches_a_single_forward(tiny_vl_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    source = RewardModelSource(str(tiny_vl_path), head="yes_token", batch_size=2)
    assert source.needs_media
    scores = [result["overall"] for result in source.score(_samples(with_media=True))]
    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_path).eval()
    yes, no = (processor.tokenizer.encode(word, add_special_tokens=False)[0] for word in ("yes", "no"))
    assert yes != no
    expected = []
    for sample in _samples(with_media=True):
        text = source._text(sample, 0)
        image = Image.open(io.BytesIO(sample["media"].images[0]))
        inputs = processor(text=[text], images=[image], return_tensors="pt", return_mm_token_type_ids=True)
        with torch.no_grad():
            logits = model(**inputs).logits[0, -1]
        expected.append((logits[yes] - logits[no]).item())
    assert scores == pytest.approx(expected, abs=1e-4)
    assert "The reference answer is: red" in source._text(_samples()[0], 0)  # the judge's prompt


def test_a_reward_model_composes_with_the_rule_and_normalises(classifier_path):
    config = RewardConfig(
        reward_function=f"{SHAPES}:compute_score",
        reward_model=RewardModelConfig(
            model_path=str(classifier_path), normalize="sigmoid", weight=0.5, head="classification"
        ),
    )
    reward = build_composite(config, load_reward_function(config.reward_function))
    assert reward.names == ["rule", "reward_model"] and not reward.needs_media
    scores = reward.score(_samples())
    raw = RewardModelSource(str(classifier_path)).score(_samples())
    for score, plain in zip(scores, raw):
        assert score["reward_model/overall"] == pytest.approx(1 / (1 + math.exp(-plain["overall"])))
        assert score["overall"] == pytest.approx(score["rule/overall"] + 0.5 * score["reward_model/overall"])
    zscored = RewardModelSource(str(classifier_path), normalize="batch_zscore").score(_samples())
    assert sum(s["overall"] for s in zscored) == pytest.approx(0.0, abs=1e-9)


def test_a_model_with_several_labels_is_refused(tiny_text_path, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    AutoModelForSequenceClassification.from_pretrained(tiny_text_path, num_labels=3).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_text_path).save_pretrained(tmp_path)
    with pytest.raises(RewardSourceError, match="has 3 labels; a reward model has one"):
        RewardModelSource(str(tmp_path), head="classification")
