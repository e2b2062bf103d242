"""Answer-format warm-up of a random tiny model, so that RL starts from chance rather than from noise.

A random model samples a valid one-word answer about 1 % of the time, and RL from there takes far
longer than a demo should. This supervised pass teaches the answer *format* but not the task: every
training prompt is paired with every answer of the task's answer set once, so the target is the
uniform distribution over answers whatever the image (or video, or sound). The warmed model answers
with a valid word and stops, at chance accuracy (1/4 for four colours), and with maximal entropy over
the answers, which is what RL needs to explore. (Random labels instead would let the model memorise a
skewed answer per image, which RL must first unlearn.) What RL then gains is the use of the image.

With ``aux_data_file`` (another task's jsonl), each step also trains on that task's true labels. The
tiny model's image path starts almost closed: on the spatial task the spread of the left/right logit
gap over images is ~0.001 nats, and 60 supervised steps of true left/right labels left it at chance.
After a warm-up with the colour task as auxiliary (``--steps 200``), 20 supervised steps reach 0.94 and
RL learns the spatial task; the spatial answers are still trained uniform, so RL starts near chance.

With ``tool_file`` (the multi-turn demo) the prompts show the file's tools and the warm-up teaches the
call *format*, not when calling pays: each sample's first turn is, with probability ``call_rate``, a
call of the file's first tool without arguments (``<tool_call>{"name": ...}</tool_call>``), else
an answer; the turn after the tool's answer (rendered by the agent loop the trainer runs, the returned
image in it) is an answer. Answers are uniform as above, wherever they come, so the warmed model calls
about ``call_rate`` of the time and its answers do not depend on the image it was shown. With
``aux_data_file`` too (the agent demo: the colour task), the tiny model learns to see colours on another
task's prompts; after the zoom tool's view of the small mark it then names the mark's colour more often
than chance (the likeliest answer was right for 23 of 32 validation images, 0.72), where from the
prompt's 56-px image alone it stays at chance (0.28).

CLI: ``python -m mmrl.demo.warmup --model assets/models/tiny-qwen2.5-vl --data
assets/data/shapes-color/train.jsonl --out assets/models/tiny-qwen2.5-vl-warm [--aux_data
assets/data/shapes-color/train.jsonl --steps 200] [--tool_file examples/tools/zoom_center.py
--call_rate 0.5]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import torch

from mmrl.data.collate import collate_prompts
from mmrl.data.config import DataConfig
from mmrl.data.dataset import PromptDataset
from mmrl.data.processing import attach_media, load_tokenizer_and_processor
from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS
from mmrl.models.inputs import response_head_outputs
from mmrl.models.loading import as_source_class, load_model
from mmrl.workers.rollout import response_mask_until_eos

MARKER = "mmrl_warmup.json"


def answer_batch(answers: list[str], tokenizer, width: int) -> torch.Tensor:
    """Answers as response tokens ``[B, width]``: the answer, EOS, then padding."""
    rows = [
        tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id] for answer in answers
    ]
    out = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    for index, row in enumerate(rows):
        out[index, : len(row)] = torch.tensor(row[:width])
    return out


def _base_fingerprint(model_dir: Path) -> str:
    """Hash of the base model's config and weights files, so a rebuilt base triggers a new warm-up."""
    digest = hashlib.sha256()
    for name in sorted(p.name for p in model_dir.iterdir() if p.suffix in (".json", ".safetensors")):
        digest.update(name.encode())
        digest.update((model_dir / name).read_bytes())
    return digest.hexdigest()[:16]


def _data_marker(data_dir: Path) -> str | None:
    """The synthetic dataset's build marker, if any: regenerated data invalidates the warmed copy."""
    marker = data_dir / "mmrl_dataset.json"
    return marker.read_text() if marker.is_file() else None


def _dataset(data_file: str, tokenizer, processor) -> PromptDataset:
    pixels = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}
    config = DataConfig(**pixels, **{f"video_{key}": value for key, value in pixels.items()})
    return PromptDataset(data_file, tokenizer, processor, config)


def answer_token_losses(
    model, dataset: PromptDataset, items: list[dict], answers: list[str], repeat: int, tokenizer, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy ``[B, width]`` of each token of ``answers`` (then EOS) after the prompts ``items``,
    each repeated ``repeat`` times in a row (``answers`` has one entry per repeated prompt), and the
    mask ``[B, width]`` of the tokens that count (up to and including EOS)."""
    prompts = collate_prompts(items, tokenizer.pad_token_id).repeat(repeat, interleave=True)
    prompts = attach_media(prompts, dataset.media)  # multi_modal_inputs, as a worker makes them
    responses = answer_batch(answers, tokenizer, width)
    mask = response_mask_until_eos(responses, [tokenizer.eos_token_id])
    batch = prompts.batch
    input_ids = torch.cat([batch["input_ids"], responses], dim=-1)  # [B, P + R]
    attention_mask = torch.cat([batch["attention_mask"], mask], dim=-1)
    mm_types = None  # Qwen-VL only; the Omni thinker tells media tokens apart by their ids
    if "mm_token_type_ids" in batch.keys():
        mm_types = torch.cat([batch["mm_token_type_ids"], torch.zeros_like(responses)], dim=-1)
    logits = response_head_outputs(
        model,
        input_ids,
        attention_mask,
        width,
        list(prompts.non_tensor_batch["multi_modal_inputs"]),
        mm_types,
    )
    token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), responses, reduction="none")
    return token_loss * mask, mask


def answer_loss(
    model, dataset: PromptDataset, items: list[dict], answers: list[str], repeat: int, tokenizer, width: int
) -> torch.Tensor:
    """Mean cross-entropy of ``answers`` (then EOS) over their tokens (see :func:`answer_token_losses`)."""
    token_loss, mask = answer_token_losses(model, dataset, items, answers, repeat, tokenizer, width)
    return token_loss.sum() / mask.sum()


def aux_task_loss(
    model, aux: PromptDataset, rng: np.random.Generator, count: int, tokenizer, width: int
) -> torch.Tensor:
    """:func:`answer_loss` of ``count`` prompts of the auxiliary task drawn with ``rng``, on their true
    answers (what opens the tiny model's image path)."""
    items = [aux[int(i)] for i in rng.choice(len(aux), count, replace=False)]
    return answer_loss(model, aux, items, [str(item["ground_truth"]) for item in items], 1, tokenizer, width)


def warm_up(
    model_dir: str,
    data_file: str,
    out_dir: str,
    steps: int = 100,
    batch_size: int = 8,
    lr: float = 2e-3,
    seed: int = 0,
    aux_data_file: str | None = None,
) -> Path:
    """Supervised answer-format pass (see module docstring); writes a Hugging Face folder to ``out_dir``."""
    out = Path(out_dir)
    settings = {
        "model_dir": str(model_dir),
        "data_file": str(data_file),
        "steps": steps,
        "lr": lr,
        "seed": seed,
        # a rebuilt base model (e.g. a new tiny-model version) must invalidate the warmed copy
        "base_model": _base_fingerprint(Path(model_dir)),
        "data_build": _data_marker(Path(data_file).parent),
        "aux_data_file": str(aux_data_file) if aux_data_file else None,
        "aux_data_build": _data_marker(Path(aux_data_file).parent) if aux_data_file else None,
        "layout": "source",  # saved in the base folder's layout (older copies: the trained class's)
    }
    if (out / MARKER).exists() and json.loads((out / MARKER).read_text()) == settings:
        print(f"[mmrl.demo.warmup] {out} is up to date")
        return out
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    tokenizer, processor = load_tokenizer_and_processor(model_dir)
    model = load_model(model_dir)
    dataset = _dataset(data_file, tokenizer, processor)
    answer_set = sorted({str(dataset[i]["ground_truth"]) for i in range(min(len(dataset), 256))})
    aux = _dataset(aux_data_file, tokenizer, processor) if aux_data_file else None
    aux_answers = [str(aux[i]["ground_truth"]) for i in range(min(len(aux), 256))] if aux else []
    width = max(len(tokenizer.encode(a, add_special_tokens=False)) for a in answer_set + aux_answers) + 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):
        items = [dataset[int(i)] for i in rng.choice(len(dataset), batch_size, replace=False)]
        # every answer for every prompt: the target is uniform over the answers, whatever the image
        loss = answer_loss(model, dataset, items, answer_set * batch_size, len(answer_set), tokenizer, width)
        if aux is not None:  # true labels of the auxiliary task: the vision path learns to see
            loss = loss + aux_task_loss(model, aux, rng, batch_size, tokenizer, width)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 20 == 0 or step == steps - 1:
            print(f"[mmrl.demo.warmup] step {step + 1}/{steps} loss {loss.item():.4f}")
    save_trained(out, model, model_dir, tokenizer, processor, settings)
    print(f"[mmrl.demo.warmup] wrote {out} (answers: {', '.join(answer_set)})")
    return out


def tool_call_text(name: str) -> str:
    """A call of tool ``name`` without arguments in the hermes format Qwen's chat templates use, in its
    shortest form (no ``arguments``: the parser reads it as ``{}``): 34 tokens of the tiny vocabulary."""
    return f"<tool_call>{json.dumps({'name': name})}</tool_call>"


def trajectory_batch(loop, prompts, first_turns: list[str], answers: list[str], tokenizer, budget: int):
    """The training batch of scripted trajectories through the agent ``loop``: row ``i``'s first model
    turn is ``first_turns[i]``, any later one ``answers[i]`` (each followed by EOS); ``prompts`` carry
    ``multi_modal_inputs`` and ``multi_modal_data`` (:func:`attach_media` with ``rollout_media``)."""
    from mmrl.agent.loop import sample_rows
    from mmrl.agent.trajectory import assemble_trajectory_batch

    def generate(requests):
        turns = []
        for request in requests:
            text = answers[request.row] if request.trajectory.turns else first_turns[request.row]
            ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
            turns.append((ids, [0.0] * len(ids)))
        return turns

    trajectories = loop.run(sample_rows(prompts, loop.renderer.media), budget, generate)
    return assemble_trajectory_batch(prompts, trajectories, budget, tokenizer.pad_token_id)


def model_turn_loss(model, batch) -> torch.Tensor:
    """Mean cross-entropy of the model's tokens (``response_mask``) of a trajectory batch."""
    responses, mask = batch.batch["responses"], batch.batch["response_mask"]
    types = batch.batch["mm_token_type_ids"] if "mm_token_type_ids" in batch.batch.keys() else None
    logits = response_head_outputs(
        model,
        batch.batch["input_ids"],
        batch.batch["attention_mask"],
        responses.shape[-1],
        list(batch.non_tensor_batch["multi_modal_inputs"]),
        types,
    )
    token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), responses, reduction="none")
    return (token_loss * mask).sum() / mask.sum()


def warm_up_tool_calls(
    model_dir: str,
    data_file: str,
    out_dir: str,
    tool_file: str,
    steps: int = 100,
    batch_size: int = 4,
    lr: float = 2e-3,
    seed: int = 0,
    call_rate: float = 0.5,
    max_response_length: int = 96,
    max_pixels: int = MIN_PIXELS,
    aux_data_file: str | None = None,
) -> Path:
    """The call-format warm-up (see the module docstring); writes a Hugging Face folder to ``out_dir``.
    Images and video frames at most ``max_pixels`` (the demo's budget, 56x56 by default), trajectories
    within ``max_response_length`` tokens, as in the RL job. ``aux_data_file``: another task trained on
    its true labels too, as in :func:`warm_up`."""
    from mmrl.agent.loop import build_agent_loop, tool_schemas
    from mmrl.config import MultiTurnConfig

    out = Path(out_dir)
    settings = {
        "model_dir": str(model_dir),
        "data_file": str(data_file),
        "tool_file": str(tool_file),
        "tool_file_text": Path(tool_file).read_text(),
        "steps": steps,
        "lr": lr,
        "seed": seed,
        "call_rate": call_rate,
        "max_pixels": max_pixels,
        "max_response_length": max_response_length,
        "base_model": _base_fingerprint(Path(model_dir)),
        "data_build": _data_marker(Path(data_file).parent),
        "aux_data_file": str(aux_data_file) if aux_data_file else None,
        "aux_data_build": _data_marker(Path(aux_data_file).parent) if aux_data_file else None,
        "layout": "source",
    }
    if (out / MARKER).exists() and json.loads((out / MARKER).read_text()) == settings:
        print(f"[mmrl.demo.warmup] {out} is up to date")
        return out
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    tokenizer, processor = load_tokenizer_and_processor(model_dir)
    model = load_model(model_dir)
    multi_turn = MultiTurnConfig(enable=True, tools=[str(tool_file)], max_turns=2)
    schemas = tool_schemas(multi_turn)
    pixels = {"min_pixels": min(MIN_PIXELS, max_pixels), "max_pixels": max_pixels}
    # video frames a tool returns are sized like images (the video-tool demo: 56x56 frames stay as drawn)
    config = DataConfig(**pixels, **{f"video_{key}": value for key, value in pixels.items()})
    dataset = PromptDataset(data_file, tokenizer, processor, config, tools=schemas)
    loop = build_agent_loop(multi_turn, dataset.media, [tokenizer.eos_token_id], model.config.model_type)
    call = tool_call_text(schemas[0]["function"]["name"])
    answer_set = sorted({str(dataset[i]["ground_truth"]) for i in range(min(len(dataset), 256))})
    aux = _dataset(aux_data_file, tokenizer, processor) if aux_data_file else None
    aux_set = {str(aux[i]["ground_truth"]) for i in range(min(len(aux), 256))} if aux else set()
    aux_width = max((len(tokenizer.encode(a, add_special_tokens=False)) for a in aux_set), default=0) + 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):
        items = [dataset[int(i)] for i in rng.choice(len(dataset), batch_size, replace=False)]
        prompts = collate_prompts(items, tokenizer.pad_token_id).repeat(len(answer_set), interleave=True)
        prompts = attach_media(prompts, dataset.media, rollout_media=True)
        answers = answer_set * batch_size  # every answer for every prompt, after a call or without one
        first = [call if rng.random() < call_rate else answer for answer in answers]
        batch = trajectory_batch(loop, prompts, first, answers, tokenizer, max_response_length)
        loss = model_turn_loss(model, batch)
        if aux is not None:  # another task's true labels: the vision path learns to see (not this task)
            loss = loss + aux_task_loss(model, aux, rng, 2 * batch_size, tokenizer, aux_width)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 20 == 0 or step == steps - 1:
            print(f"[mmrl.demo.warmup] step {step + 1}/{steps} loss {loss.item():.4f}")
    save_trained(out, model, model_dir, tokenizer, processor, settings)
    print(
        f"[mmrl.demo.warmup] wrote {out} (calls {call} at rate {call_rate}; answers: {', '.join(answer_set)})"
    )
    return out


def save_trained(
    out: Path,
    model: torch.nn.Module,
    model_dir: str | Path,
    tokenizer,
    processor,
    settings: dict,
    extra_files: dict[str, str] | None = None,
) -> None:
    """Write the trained model with its tokenizer, processor, ``extra_files`` (name -> text) and the
    ``settings`` marker to ``out``, through a temporary folder renamed at the end (a killed run leaves
    no half folder that looks complete). In the base folder's layout: an Omni thinker is saved inside
    its full model, as vLLM loads it."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    as_source_class(model.eval(), model_dir).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if processor is not None:
        processor.save_pretrained(tmp)
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    (tmp / MARKER).write_text(json.dumps(settings))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="tiny model folder to start from")
    parser.add_argument("--data", required=True, help="training jsonl of the task")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--aux_data", default=None, help="jsonl of a task trained on its true labels too")
    parser.add_argument("--tool_file", default=None, help="teach calls of this file's first tool instead")
    parser.add_argument(
        "--call_rate", type=float, default=0.5, help="with --tool_file: first turns that call"
    )
    parser.add_argument(
        "--max_response_length", type=int, default=96, help="with --tool_file: the trajectories' token budget"
    )
    args = parser.parse_args(argv)
    if args.tool_file:
        warm_up_tool_calls(
            args.model, args.data, args.out, args.tool_file, steps=args.steps, lr=args.lr, seed=args.seed,
            call_rate=args.call_rate, max_response_length=args.max_response_length,
            aux_data_file=args.aux_data,
        )  # fmt: skip
        return
    warm_up(
        args.model,
        args.data,
        args.out,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        aux_data_file=args.aux_data,
    )


if __name__ == "__main__":
    main()
