"""A tiny vision-language judge for the colour task: it sees the image and a response and answers whether
the response names the shape's colour (``yes`` / ``no``). ``examples/tiny_cpu_judge.yaml`` serves it with
vLLM's OpenAI-compatible server and trains the policy on its answers alone.

The judge is a tiny Qwen2.5-VL trained supervised from random weights. Its prompt is the run's judge
template (``format_prompts/judge_colour.jinja``) rendered with the row's question and a response, and no
ground truth: the judge has to look at the image. It answers with the colour it sees, then its verdict
(``red yes``, ``red no``; the run's ``yes_no`` parser reads the first yes or no), which splits the task
into naming the colour (what the image path learns) and comparing two words of the text (what a 2-layer
model can learn); asked for the verdict alone, at one token, 300 steps left it near chance. Each step
trains three terms:

- judge rows: per training image, the true colour, each other colour and a few words that are no colour
  as the response (:func:`judge_rows`), as many verdicts ``yes`` as ``no``;
- comparison rows: the same prompt without the image, the colour named given (``blue`` teacher-forced)
  and only the verdict trained, ``compare_batch`` of them: half ``yes``, a quarter the other colours and
  words, a quarter junk (:func:`junk_responses`: what a policy that hunts the judge's blind spots writes).
  Cheap rows without an image, they are what teaches the comparison: without them the verdict stayed at
  chance for the 475 steps measured; with
  them it is learnt between steps 250 and 450 (the loss drops from about 0.3 to 0.05);
- the plain colour question with its true answer, as in the spatial warm-up (:mod:`mmrl.demo.warmup`),
  which opens the tiny model's image path.

The learning rate warms up over 10 steps and then decays on a cosine to a tenth (:func:`lr_factor`).
Held-out accuracy (``val`` images, every colour as the response) is measured in-process: the judge's
answer is the likeliest of every colour with every verdict. ``bench/judge_demo.py`` measures it again
through the served judge, greedy, and compares the verdicts pair by pair.

CLI: ``python -m mmrl.demo.judge --model assets/models/tiny-qwen2.5-vl --data_dir
assets/data/shapes-color --out assets/models/tiny-judge-colour [--steps 800]`` (``make assets-judge``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import tempfile
from pathlib import Path

import numpy as np
import torch

from mmrl.data.config import DataConfig
from mmrl.data.dataset import PromptDataset
from mmrl.data.processing import load_tokenizer_and_processor
from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS
from mmrl.demo.warmup import MARKER, answer_loss, answer_token_losses, save_trained
from mmrl.models.loading import load_model

TEMPLATE = Path(__file__).resolve().parents[2] / "format_prompts" / "judge_colour.jinja"
NOT_COLOURS = ("shape", "circle", "square", "no", "white")  # responses that name no colour: "no"
LABELS = ("yes", "no")


def render_prompt(template: str, question: str, response: str) -> str:
    """The judge's prompt text, rendered as :class:`mmrl.rewards.judge.JudgeSource` renders it."""
    import jinja2

    environment = jinja2.Environment(undefined=jinja2.StrictUndefined)
    return environment.from_string(template).render(question=question, response=response, ground_truth="")


def judge_answer(colour: str, verdict: str) -> str:
    """The judge's answer: the colour it sees, then its verdict (``red no``)."""
    return f"{colour} {verdict}"


def judge_rows(
    data_file: Path, template: str, colours: list[str], not_colours: tuple[str, ...] = ()
) -> list[dict]:
    """Judge rows for every image of ``data_file``: each of ``colours`` and of ``not_colours`` as the
    response, ``answer`` the true colour then yes for the true colour and no otherwise (``red yes``,
    ``red no``); ``images`` keep their paths."""
    rows = [json.loads(line) for line in data_file.read_text().splitlines() if line.strip()]
    out = []
    for row in rows:
        for response in [*colours, *not_colours]:
            verdict = "yes" if response == row["answer"] else "no"
            out.append(
                {
                    "problem": render_prompt(template, row["problem"], response),
                    "answer": judge_answer(row["answer"], verdict),
                    "images": row["images"],
                }
            )
    return out


def junk_responses(tokenizer, rng: np.random.Generator, count: int, colours: list[str]) -> list[str]:
    """``count`` responses that name no colour: none to three random tokens of the vocabulary (no special
    token), decoded, as a policy that has found a judge's blind spot writes them (`` by``, ``\\x04``)."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    out = []
    while len(out) < count:
        text = tokenizer.decode(rng.choice(ids, int(rng.integers(0, 4))).tolist())
        if text.strip().lower() not in colours:
            out.append(text)
    return out


def comparison_rows(
    template: str, question: str, colours: list[str], not_colours, tokenizer, rng: np.random.Generator
) -> tuple[list[dict], list[list[int]]]:
    """Text-only rows that teach the comparison: the judge prompt without an image for every colour seen
    with every colour and word as the response, and 2,000 junk responses (:func:`junk_responses`) with a
    random colour seen; the answer is the colour seen, then its verdict. Also the row indices of the
    three groups a step draws from: the true colour, the other words, the junk."""
    words = [(seen, response) for seen in colours for response in [*colours, *not_colours]]
    junk = [(str(rng.choice(colours)), text) for text in junk_responses(tokenizer, rng, 2000, colours)]
    rows = [
        {
            "problem": render_prompt(template, question, response),
            "answer": judge_answer(seen, "yes" if response == seen else "no"),
        }
        for seen, response in words + junk
    ]
    groups = [
        [i for i, (seen, response) in enumerate(words) if response == seen],
        [i for i, (seen, response) in enumerate(words) if response != seen],
        list(range(len(words), len(rows))),
    ]
    return rows, groups


def junk_rows(
    template: str, images: list[dict], colours: list[str], tokenizer, rng: np.random.Generator
) -> tuple[list[dict], list[str]]:
    """Held-out judge rows with two junk responses per image (verdict no), and the junk texts in order."""
    texts = junk_responses(tokenizer, rng, 2 * len(images), colours)
    rows = [
        {
            **row,
            "problem": render_prompt(template, row["problem"], text),
            "answer": judge_answer(row["answer"], "no"),
        }
        for row, text in zip([row for row in images for _ in range(2)], texts)
    ]
    return rows, texts


def _dataset(
    rows: list[dict], folder: Path, name: str, media_dir: Path, tokenizer, processor
) -> PromptDataset:
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    pixels = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}
    config = DataConfig(media_dir=str(media_dir), filter_overlong_prompts=False, **pixels)
    return PromptDataset(str(path), tokenizer, processor, config)


@torch.no_grad()
def judge_accuracy(
    model, dataset: PromptDataset, tokenizer, colours: list[str], width: int, batch_size: int = 16
) -> dict:
    """Accuracy of the judge's verdict over ``dataset``, whose rows' answers are :func:`judge_answer`'s:
    the judge's answer is the likeliest of every colour with every verdict (then EOS). Returns the
    accuracy over all rows, on the rows whose verdict is yes, on those whose verdict is no, and how often
    the colour it names is the true one; ``verdicts`` lists its verdicts in the rows' order."""
    model.eval()
    candidates = [judge_answer(colour, label) for colour in colours for label in LABELS]
    correct: dict[str, list[bool]] = {"yes": [], "no": []}
    named, verdicts = [], []
    for start in range(0, len(dataset), batch_size):
        items = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        token_loss, _ = answer_token_losses(
            model, dataset, items, candidates * len(items), len(candidates), tokenizer, width
        )
        loss = token_loss.sum(-1).view(len(items), len(candidates))  # minus each answer's log-likelihood
        for item, best in zip(items, loss.argmin(-1).tolist()):
            colour, truth = str(item["ground_truth"]).split()
            said_colour, said = candidates[best].split()
            correct[truth].append(said == truth)
            verdicts.append(said)
            named.append(said_colour == colour)
    model.train()
    every = correct["yes"] + correct["no"]
    yes_accuracy = float(np.mean(correct["yes"])) if correct["yes"] else None
    no_accuracy = float(np.mean(correct["no"])) if correct["no"] else None
    return {
        "accuracy": float(np.mean(every)),
        "yes_accuracy": yes_accuracy,
        "no_accuracy": no_accuracy,
        "balanced_accuracy": (yes_accuracy + no_accuracy) / 2 if correct["yes"] and correct["no"] else None,
        "colour_accuracy": float(np.mean(named)),
        "rows": len(every),
        "verdicts": verdicts,
    }


def held_out_evaluation(
    model, held_out: PromptDataset, junk: PromptDataset, junk_texts: list[str], tokenizer, colours, width
) -> dict:
    """:func:`judge_accuracy` on the held-out rows, with its ``no`` on the held-out junk rows
    (``junk_no_accuracy``, ``junk_rows``) and the junk texts (two per image, in order: the bench reads
    them); printed in one line."""
    evaluation = judge_accuracy(model, held_out, tokenizer, colours, width)
    junk_evaluation = judge_accuracy(model, junk, tokenizer, colours, width)
    evaluation.update(
        junk_no_accuracy=junk_evaluation["no_accuracy"],
        junk_rows=junk_evaluation["rows"],
        junk_responses=junk_texts,
    )
    print(
        f"[mmrl.demo.judge] held-out accuracy {evaluation['accuracy']:.3f} over {evaluation['rows']} rows "
        f"(true colour: {evaluation['yes_accuracy']:.3f}, other colours: {evaluation['no_accuracy']:.3f}); "
        f"no to {evaluation['junk_no_accuracy']:.3f} of {evaluation['junk_rows']} junk responses"
    )
    return evaluation


def lr_factor(step: int, steps: int, warmup: int = 10, floor: float = 0.1) -> float:
    """The learning rate's multiplier at ``step``: a linear warm-up over ``warmup`` steps, then a cosine
    down to ``floor`` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _settings(model_dir: Path, data_dir: Path, template: str, **options) -> dict:
    digest = hashlib.sha256(template.encode())
    for path in sorted(model_dir.glob("*.safetensors")) + sorted(data_dir.glob("*.jsonl")):
        digest.update(path.read_bytes())
    return {
        "model_dir": str(model_dir),
        "data_dir": str(data_dir),
        "inputs": digest.hexdigest()[:16],
        **options,
    }


def train_judge(
    model_dir: str,
    data_dir: str,
    out_dir: str,
    steps: int = 800,
    batch_size: int = 16,
    lr: float = 2e-3,
    seed: int = 0,
    template_file: str | Path = TEMPLATE,
    max_train_images: int | None = None,
    max_val_images: int | None = None,
    not_colours: tuple[str, ...] = NOT_COLOURS,
    compare_batch: int = 32,
) -> dict:
    """Trains the judge (module docstring) and writes a Hugging Face folder to ``out_dir``; returns its
    held-out accuracy (also in ``out_dir/judge_eval.json``). Up to date when the inputs did not change."""
    out, data, template = Path(out_dir), Path(data_dir), Path(template_file).read_text()
    settings = _settings(
        Path(model_dir), data, template, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
        max_train_images=max_train_images, max_val_images=max_val_images, not_colours=list(not_colours),
        compare_batch=compare_batch, recipe="colour then verdict; comparison rows with junk of 0-3 tokens",
    )  # fmt: skip
    if (out / MARKER).exists() and json.loads((out / MARKER).read_text()) == settings:
        print(f"[mmrl.demo.judge] {out} is up to date")
        return json.loads((out / "judge_eval.json").read_text())
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    tokenizer, processor = load_tokenizer_and_processor(model_dir)
    model = load_model(model_dir)
    all_train_lines = [line for line in (data / "train.jsonl").read_text().splitlines() if line.strip()]
    colours = sorted({json.loads(line)["answer"] for line in all_train_lines})
    answers = [judge_answer(colour, label) for colour in colours for label in LABELS]
    width = max(len(tokenizer.encode(answer, add_special_tokens=False)) for answer in answers) + 1
    colour_width = max(len(tokenizer.encode(colour, add_special_tokens=False)) for colour in colours) + 1
    train_lines = all_train_lines[:max_train_images]
    with tempfile.TemporaryDirectory(prefix="mmrl-judge-") as folder:
        (Path(folder) / "train_images.jsonl").write_text("\n".join(train_lines) + "\n")
        rows = judge_rows(Path(folder) / "train_images.jsonl", template, colours, not_colours)
        by_label = {
            label: [i for i, row in enumerate(rows) if row["answer"].endswith(label)] for label in LABELS
        }
        train = _dataset(rows, Path(folder), "train", data, tokenizer, processor)
        val_lines = (data / "val.jsonl").read_text().splitlines()[:max_val_images]
        (Path(folder) / "val_images.jsonl").write_text("\n".join(val_lines) + "\n")
        val_rows = judge_rows(Path(folder) / "val_images.jsonl", template, colours)
        held_out = _dataset(val_rows, Path(folder), "val", data, tokenizer, processor)
        question = json.loads(train_lines[0])["problem"].replace("<image>", "")
        pairs, compare_groups = comparison_rows(template, question, colours, not_colours, tokenizer, rng)
        compare = _dataset(pairs, Path(folder), "compare", data, tokenizer, processor)
        val_junk, junk_texts = junk_rows(
            template, [json.loads(line) for line in val_lines], colours, tokenizer, rng
        )
        held_out_junk = _dataset(val_junk, Path(folder), "val_junk", data, tokenizer, processor)
        colour_rows = [json.loads(line) for line in train_lines]
        colour_data = _dataset(colour_rows, Path(folder), "colour", data, tokenizer, processor)
        half = max(1, batch_size // 2)
        # comparison rows drawn half yes, a quarter other words, a quarter junk
        sizes = (
            compare_batch // 2,
            compare_batch // 4,
            compare_batch - compare_batch // 2 - compare_batch // 4,
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps))
        model.train()
        for step in range(steps):
            picked = [int(i) for label in LABELS for i in rng.choice(by_label[label], half, replace=False)]
            items = [train[i] for i in picked]
            loss = answer_loss(
                model, train, items, [str(it["ground_truth"]) for it in items], 1, tokenizer, width
            )
            if compare_batch:  # the verdict alone, given the colour named, on text rows (no image)
                picked = [
                    int(i) for group, size in zip(compare_groups, sizes) for i in rng.choice(group, size)
                ]
                items = [compare[i] for i in picked]
                token_loss, mask = answer_token_losses(
                    model, compare, items, [str(it["ground_truth"]) for it in items], 1, tokenizer, width
                )
                loss = loss + token_loss[:, 1:].sum() / mask[:, 1:].sum()  # the colour token is given
            colour_items = [colour_data[int(i)] for i in rng.choice(len(colour_data), half, replace=False)]
            colour_answers = [str(item["ground_truth"]) for item in colour_items]
            loss = loss + answer_loss(
                model, colour_data, colour_items, colour_answers, 1, tokenizer, colour_width
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if step % 25 == 0 or step == steps - 1:
                print(f"[mmrl.demo.judge] step {step + 1}/{steps} loss {loss.item():.4f}", flush=True)
        evaluation = held_out_evaluation(
            model, held_out, held_out_junk, junk_texts, tokenizer, colours, width
        )
    save_trained(
        out, model, model_dir, tokenizer, processor, settings, {"judge_eval.json": json.dumps(evaluation)}
    )
    print(f"[mmrl.demo.judge] wrote {out}")
    return evaluation


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="tiny model folder to start from")
    parser.add_argument("--data_dir", required=True, help="the colour task's folder (train.jsonl, val.jsonl)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compare_batch", type=int, default=32, help="text rows a step that train the verdict alone"
    )
    parser.add_argument("--template", default=str(TEMPLATE), help="the judge prompt's Jinja file")
    parser.add_argument(
        "--not_colours", nargs="*", default=list(NOT_COLOURS), help="responses that are no colour"
    )
    args = parser.parse_args(argv)
    train_judge(
        args.model,
        args.data_dir,
        args.out,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        template_file=args.template,
        not_colours=tuple(args.not_colours),
        compare_batch=args.compare_batch,
    )


if __name__ == "__main__":
    main()
