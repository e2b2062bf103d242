"""The answer-format warm-up: valid, image-blind, near-uniform answers; idempotent; reloadable."""

from __future__ import annotations

import json

import pytest
import torch

from mmrl.data.collate import collate_prompts
from mmrl.data.config import DataConfig
from mmrl.data.dataset import PromptDataset
from mmrl.data.processing import attach_media, load_tokenizer_and_processor
from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS
from mmrl.demo.warmup import MARKER, warm_up
from mmrl.models.inputs import response_head_outputs
from mmrl.models.loading import load_model


def first_token_probs(model_dir, data_file) -> tuple[torch.Tensor, list[int]]:
    tokenizer, processor = load_tokenizer_and_processor(str(model_dir))
    model = load_model(str(model_dir)).eval()
    dataset = PromptDataset(
        str(data_file), tokenizer, processor, DataConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    )
    batch = collate_prompts([dataset[i] for i in range(len(dataset))], tokenizer.pad_token_id)
    batch = attach_media(batch, dataset.media)
    # one dummy response token: the head output at the last prompt position predicts the first token
    tensors = batch.batch
    dummy = tensors["input_ids"][:, :1]
    with torch.no_grad():
        logits = response_head_outputs(
            model,
            torch.cat([tensors["input_ids"], dummy], -1),
            torch.cat([tensors["attention_mask"], torch.ones_like(dummy)], -1),
            1,
            list(batch.non_tensor_batch["multi_modal_inputs"]),
            torch.cat([tensors["mm_token_type_ids"], torch.zeros_like(dummy)], -1),
        )
    answers = [
        tokenizer.encode(word, add_special_tokens=False)[0] for word in ("blue", "green", "red", "yellow")
    ]
    return logits[:, 0].softmax(-1), answers


@pytest.mark.slow
def test_warm_up_teaches_the_answer_format_but_not_the_task(tiny_vl_path, shapes_data_dir, tmp_path, capsys):
    out = warm_up(str(tiny_vl_path), str(shapes_data_dir / "train.jsonl"), str(tmp_path / "warm"), steps=40)
    probs, answers = first_token_probs(out, shapes_data_dir / "val.jsonl")
    before, _ = first_token_probs(tiny_vl_path, shapes_data_dir / "val.jsonl")
    assert before[:, answers].sum(-1).max() < 0.05  # the random model rarely starts with an answer word
    answer_probs = probs[:, answers]  # [prompts, 4]
    assert answer_probs.sum(-1).min() > 0.7  # it now answers with a colour word...
    assert answer_probs.min() > 0.12 and answer_probs.max() < 0.38  # ...at chance, whatever the image
    capsys.readouterr()
    warm_up(str(tiny_vl_path), str(shapes_data_dir / "train.jsonl"), str(tmp_path / "warm"), steps=40)
    assert "is up to date" in capsys.readouterr().out


def test_aux_data_adds_its_true_labels_to_each_step_and_to_the_settings(
    tiny_vl_path, shapes_data_dir, tmp_path, capsys
):
    data = str(shapes_data_dir / "train.jsonl")
    capsys.readouterr()
    plain = warm_up(str(tiny_vl_path), data, str(tmp_path / "plain"), steps=1)
    plain_loss = float(capsys.readouterr().out.split("loss ")[1].split()[0])
    aux = warm_up(str(tiny_vl_path), data, str(tmp_path / "aux"), steps=1, aux_data_file=data)
    aux_loss = float(capsys.readouterr().out.split("loss ")[1].split()[0])
    settings = json.loads((aux / MARKER).read_text())
    assert settings["aux_data_file"] == data and settings["aux_data_build"] is not None
    assert json.loads((plain / MARKER).read_text())["aux_data_file"] is None
    # same first batch of uniform targets, plus the auxiliary batch's cross-entropy: the random model
    # gives the true colour word (then EOS) ~1/485 per token, so that term is about ln(485) = 6.2
    assert 4.0 < aux_loss - plain_loss < 8.0


def test_the_call_format_warm_up_adds_an_aux_task_s_true_labels_and_keys_its_copy_by_its_settings(
    tiny_vl_path, shapes_data_dir, tmp_path, capsys
):
    """One step of the multi-turn warm-up (scripted trajectories through the agent loop and its tool),
    without and with the colour task's true labels on the side; each setting is in the copy's marker."""
    from pathlib import Path

    from mmrl.demo.warmup import warm_up_tool_calls

    data = str(shapes_data_dir / "train.jsonl")
    tool = str(Path(__file__).resolve().parents[2] / "examples" / "tools" / "zoom_center.py")
    capsys.readouterr()
    plain = warm_up_tool_calls(str(tiny_vl_path), data, str(tmp_path / "plain"), tool, steps=1, call_rate=1.0)
    plain_loss = float(capsys.readouterr().out.split("loss ")[1].split()[0])
    aux = warm_up_tool_calls(
        str(tiny_vl_path), data, str(tmp_path / "aux"), tool, steps=1, call_rate=1.0, aux_data_file=data
    )
    aux_loss = float(capsys.readouterr().out.split("loss ")[1].split()[0])
    settings = json.loads((aux / MARKER).read_text())
    assert settings["aux_data_file"] == data and settings["aux_data_build"] is not None
    assert settings["max_response_length"] == 96 and settings["call_rate"] == 1.0
    assert json.loads((plain / MARKER).read_text())["aux_data_file"] is None
    # the same scripted trajectories, plus the colour answers' cross-entropy (about ln(485) = 6.2 a token)
    assert 4.0 < aux_loss - plain_loss < 8.0
    warm_up_tool_calls(str(tiny_vl_path), data, str(tmp_path / "plain"), tool, steps=1, call_rate=1.0)
    assert "is up to date" in capsys.readouterr().out
