"""Model paths (mmrl.models.loading): hub ids resolved through the Hugging Face cache, clear errors
for paths that name nothing, and the attention heads sequence parallelism splits."""

from __future__ import annotations

import pytest
from _models import build_hub_cache
from transformers import AutoConfig

from mmrl.models.loading import ModelPathError, attention_heads, load_model, resolve_model_path

KEY = "worker.actor.model.model_path"


@pytest.fixture
def offline_hub_cache(tmp_path, monkeypatch):
    """An empty hub cache that huggingface_hub reads (``HF_HUB_CACHE`` as read at its import) with
    downloads off (``HF_HUB_OFFLINE=1``)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_hub_id_resolves_to_its_snapshot_in_the_cache(tiny_vl_path, offline_hub_cache):
    snapshot = build_hub_cache(tiny_vl_path, offline_hub_cache, "tiny-org/tiny-vl")
    assert resolve_model_path("tiny-org/tiny-vl", KEY) == str(snapshot)
    assert resolve_model_path("tiny-org/tiny-vl", KEY, without_weights=True) == str(snapshot)
    assert resolve_model_path(str(tiny_vl_path), KEY) == str(tiny_vl_path)  # a folder is itself
    from_id = load_model(resolve_model_path("tiny-org/tiny-vl", KEY))
    from_folder = load_model(str(tiny_vl_path))
    assert from_id.state_dict().keys() == from_folder.state_dict().keys()
    assert all(from_id.state_dict()[k].equal(v) for k, v in from_folder.state_dict().items())


def test_paths_that_name_no_model_are_errors_naming_the_key_and_the_fix(tmp_path, offline_hub_cache):
    with pytest.raises(ModelPathError) as missing_id:
        resolve_model_path("tiny-org/not-downloaded", KEY)
    message = str(missing_id.value)
    assert message.startswith(f"{KEY}: 'tiny-org/not-downloaded' is neither a local folder nor a model id")
    assert str(offline_hub_cache) in message and "hf download tiny-org/not-downloaded" in message

    with pytest.raises(ModelPathError, match=f"{KEY}: '{tmp_path}/no/model' does not exist"):
        resolve_model_path(f"{tmp_path}/no/model", KEY)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ModelPathError, match="is a file; give a Hugging Face model folder"):
        resolve_model_path(str(weights), KEY)


def test_attention_heads_are_the_trained_text_decoders(tiny_vl_path, tiny_omni_path, tmp_path):
    for path in (tiny_vl_path, tiny_omni_path):
        text = AutoConfig.from_pretrained(path).get_text_config()
        assert attention_heads(str(path)) == (text.num_attention_heads, text.num_key_value_heads)
    # Qwen2.5-VL-7B's decoder: 28 query heads, 4 key/value heads (its vision tower has 16: not split)
    AutoConfig.for_model(
        "qwen2_5_vl",
        text_config={"num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584},
        vision_config={"num_heads": 16},
    ).save_pretrained(tmp_path)
    assert attention_heads(str(tmp_path)) == (28, 4)
