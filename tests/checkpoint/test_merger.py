"""Merger round trip: FSDP2-trained tiny Qwen2.5-VL -> DCP checkpoint -> Hugging Face folder.

Two gloo ranks train one optimizer step on an image prompt and save; the merged folder must reload
with ``from_pretrained`` to the trained weights (same log-probs on the image prompt, fp32) in the
original on-disk key names, with tokenizer and processor. The Omni thinker merges back into its full
model class; a critic's value head is refused with a clear error.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from mmrl.checkpoint import save_train_state
from mmrl.checkpoint.merger import MergeNotSupportedError, load_full_state_dict, merge_checkpoint

WORLD_SIZE = 2
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "model_merger.py"


def _image_prompt(processor) -> dict[str, torch.Tensor]:
    """One chat prompt with a 56x56 image (4 image tokens) and an answer, as processor tensors."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(image).ellipse((12, 12, 44, 44), fill="red")
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True) + "red<|im_end|>"
    return dict(processor(text=[text], images=[image], return_tensors="pt"))


def _token_log_probs(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """log p(token_t | tokens_<t) for t >= 1: [B, L - 1]."""
    with torch.no_grad():
        logits = model(**inputs).logits  # [B, L, V]
    return (
        torch.log_softmax(logits[:, :-1].float(), dim=-1)
        .gather(-1, inputs["input_ids"][:, 1:, None])
        .squeeze(-1)
    )


def _train_rank(rank: int, world_size: int, model_path: str, actor_dir: str, out_file: str) -> None:
    """One rank (of mmrl.demo.ranks.run_on_ranks): a sharded update, saved, then log-probs."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32)
    for layer in model.model.language_model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs = _image_prompt(AutoProcessor.from_pretrained(model_path))
    model(**inputs, labels=inputs["input_ids"]).loss.backward()
    optimizer.step()

    save_train_state(actor_dir, model, optimizer, hf_source_dir=model_path)
    model.eval()
    log_probs = _token_log_probs(model, inputs)
    if rank == 0:
        torch.save({"inputs": inputs, "log_probs": log_probs}, out_file)


@pytest.mark.distributed
def test_fsdp2_checkpoint_merges_to_hugging_face(tiny_vl_path, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmrl.demo.ranks import run_on_ranks

    actor_dir, out_file = tmp_path / "global_step_1" / "actor", tmp_path / "trained.pt"
    run_on_ranks(_train_rank, WORLD_SIZE, str(tiny_vl_path), str(actor_dir), str(out_file), timeout_s=300)
    trained = torch.load(out_file, weights_only=False)

    merged_dir = merge_checkpoint(actor_dir)
    assert merged_dir == actor_dir / "huggingface"
    merged = AutoModelForImageTextToText.from_pretrained(merged_dir, dtype=torch.float32).eval()
    torch.testing.assert_close(
        _token_log_probs(merged, trained["inputs"]), trained["log_probs"], rtol=0, atol=1e-6
    )

    # Reloaded weights are the checkpoint's, all of them (vision tower included), and they moved.
    checkpoint = load_full_state_dict(actor_dir / "model")
    reloaded = merged.state_dict()
    assert reloaded.keys() == checkpoint.keys()
    for key, value in checkpoint.items():
        torch.testing.assert_close(reloaded[key], value, rtol=0, atol=0, msg=key)
    original = AutoModelForImageTextToText.from_pretrained(tiny_vl_path, dtype=torch.float32).state_dict()
    assert not torch.equal(
        reloaded["model.visual.patch_embed.proj.weight"], original["model.visual.patch_embed.proj.weight"]
    )

    # On disk: the original Qwen2.5-VL names that vLLM reads, the tied lm_head stored once.
    with safe_open(merged_dir / "model.safetensors", "pt") as file:
        disk_keys = set(file.keys())
    assert {
        "model.embed_tokens.weight",
        "visual.patch_embed.proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    } <= disk_keys
    assert not any(key.startswith(("model.language_model.", "model.visual.")) for key in disk_keys)
    assert "lm_head.weight" not in disk_keys
    with safe_open(tiny_vl_path / "model.safetensors", "pt") as file:
        assert disk_keys == set(file.keys())  # exactly the names of the folder the training started from
    assert merged.lm_head.weight is merged.model.language_model.embed_tokens.weight

    # Tokenizer and processor load from the merged folder and encode as the source's do.
    processor = AutoProcessor.from_pretrained(merged_dir)
    source_processor = AutoProcessor.from_pretrained(tiny_vl_path)
    torch.testing.assert_close(_image_prompt(processor)["input_ids"], trained["inputs"]["input_ids"])
    assert processor.tokenizer.chat_template == source_processor.tokenizer.chat_template
    assert merged.generation_config.eos_token_id == source_processor.tokenizer.convert_tokens_to_ids(
        ["<|im_end|>", "<|endoftext|>"]
    )


def test_script_merges_into_target_dir(tiny_text_path, tmp_path, monkeypatch, capsys):
    """scripts/model_merger.py on a single-process checkpoint of the tied Qwen2 text model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_text_path, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(2.0)  # a "trained" change the merge must carry
    save_train_state(tmp_path / "actor", model, hf_source_dir=tiny_text_path)
    target_dir = tmp_path / "merged"
    arguments = [
        "--local_dir",
        str(tmp_path / "actor"),
        "--target_dir",
        str(target_dir),
        "--dtype",
        "bfloat16",
    ]
    # In this process (a subprocess would import torch and transformers again), argv as the shell gives it.
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *arguments])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    assert json.loads(capsys.readouterr().out)["target_dir"] == str(target_dir)

    merged = AutoModelForCausalLM.from_pretrained(target_dir)
    assert merged.dtype == torch.bfloat16
    expected = model.state_dict()
    for key, value in merged.state_dict().items():
        torch.testing.assert_close(value, expected[key].to(torch.bfloat16), rtol=0, atol=0, msg=key)
    assert merged.lm_head.weight is merged.model.embed_tokens.weight
    assert AutoTokenizer.from_pretrained(target_dir).encode("red") == AutoTokenizer.from_pretrained(
        tiny_text_path
    ).encode("red")
    assert not (tmp_path / "actor" / "huggingface" / "model.safetensors").exists()  # source folder untouched


def test_omni_thinker_merges_back_into_the_full_model(tiny_omni_path, tmp_path):
    from transformers import AutoConfig, Qwen2_5OmniThinkerForConditionalGeneration

    thinker = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(tiny_omni_path, dtype=torch.float32)
    with torch.no_grad():
        thinker.lm_head.weight.add_(0.5)
    save_train_state(tmp_path / "actor", thinker, hf_source_dir=tiny_omni_path)
    merged_dir = merge_checkpoint(tmp_path / "actor", tmp_path / "merged")

    # The layout of the source: Qwen2_5OmniConfig and thinker.* weights (what vLLM serves).
    assert AutoConfig.from_pretrained(merged_dir).architectures == ["Qwen2_5OmniForConditionalGeneration"]
    with safe_open(merged_dir / "model.safetensors", "pt") as file:
        assert all(key.startswith("thinker.") for key in file.keys())
    reloaded = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(merged_dir, dtype=torch.float32)
    expected = thinker.state_dict()
    assert reloaded.state_dict().keys() == expected.keys()
    for key, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)


def test_critic_value_head_is_refused(tiny_text_path, tmp_path):
    from transformers import AutoModelForCausalLM

    # mmrl's critic: the actor class with lm_head replaced by a [1, hidden] value head with a bias.
    critic = AutoModelForCausalLM.from_pretrained(tiny_text_path, dtype=torch.float32)
    critic.config.tie_word_embeddings = False
    critic.lm_head = nn.Linear(critic.config.hidden_size, 1, bias=True)
    save_train_state(tmp_path / "critic", critic, hf_source_dir=tiny_text_path)
    with pytest.raises(MergeNotSupportedError, match=r"lm_head\.bias not in the class.*value head"):
        merge_checkpoint(tmp_path / "critic")
