"""One TRL ``GRPOTrainer`` job on the synthetic colour task: the side-by-side reference of the mmrl benches.

    python bench/trl_grpo.py --model DIR --data_dir DIR --log FILE.jsonl [--prompts 8] [--n 8]
        [--response_length 64] [--force_length] [--micro_batch 16] [--updates_per_rollout 1]
        [--lr 1e-4] [--steps 6] [--threads 2] [--val_every 0] [--val_target 0.8]

Started by ``bench/vs_trl.py`` and ``bench/time_to_accuracy.py`` (one process per job); the settings
mirror an mmrl config key by key:

| here | TRL ``GRPOConfig`` | mmrl |
|---|---|---|
| ``--prompts P``, ``--n`` | ``generation_batch_size = P*n``, ``num_generations = n`` | ``data.rollout_batch_size``, ``worker.rollout.n`` |
| ``--micro_batch`` | ``per_device_train_batch_size`` (completions) | ``micro_batch_size_per_device_for_update`` |
| ``--updates_per_rollout u`` | ``steps_per_generation = u``, ``gradient_accumulation_steps = P*n/(u*micro)`` | ``worker.actor.global_batch_size = P/u`` |
| ``--response_length L`` | ``max_completion_length`` | ``data.max_response_length`` |
| ``--force_length`` | ``generation_kwargs.min_new_tokens = L`` | ``worker.rollout.ignore_eos=true`` |
| ``--beta`` (0: KL off) | ``beta`` (k3 KL to the starting model, in the loss) | ``algorithm.kl_coef`` with ``use_kl_loss=true``, ``kl_penalty=low_var_kl`` (``disable_kl=true`` at 0) |
| clip 0.2 / 0.3 | ``epsilon``, ``epsilon_high`` | ``clip_ratio_low``, ``clip_ratio_high`` |
| token-mean loss | ``loss_type="dapo"`` | ``loss_avg_mode=token_mean`` |
| AdamW, constant lr, no weight decay, clip 1.0 | ``optim="adamw_torch"`` (mmrl's non-fused AdamW on CPU) | ``worker.actor.optim`` |

TRL runs without FSDP in one process; mmrl's one FSDP2 rank keeps its (whole) parameters gathered
from forward to backward (``worker.actor.fsdp.enable_full_shard=false``). Both suppress the same
multimodal placeholder tokens while sampling (a sampled image token breaks the
re-scoring forward), train in fp32 without gradient checkpointing, and score with
``reward_functions/shapes.py``. With ``updates_per_rollout=1`` neither runs an old-log-prob pass
(both take the ratio against the detached current log-probs; mmrl's
``worker.actor.skip_old_log_prob_on_policy``).

Log lines (``--log``), counted in rollouts like mmrl's steps: one per rollout ``{"step", "step_s",
"gen_s", "prompt_tokens", "response_tokens"}``, ``step_s`` summed from the trainer's ``on_step_begin``
to ``on_step_end`` over the rollout's optimizer steps (``gen_s``: the ``generate`` call inside), and
with ``--val_every k`` a validation line ``{"step", "val_accuracy", "val_s"}`` before training and
every k rollouts: greedy decoding of the whole validation split (``max_new_tokens = L``, stopping at
EOS), scored by the same reward file. Reaching ``--val_target`` stops training.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPES_REWARD = REPO / "reward_functions" / "shapes.py"


def load_reward_module(path: Path = SHAPES_REWARD):
    spec = importlib.util.spec_from_file_location("bench_shapes_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_split(data_dir: Path, split: str) -> list[dict]:
    """Rows of ``{split}.jsonl``: the question without its ``<image>`` marker (TRL puts the image first,
    as mmrl does for a leading marker), the answer and the opened image."""
    from PIL import Image

    rows = []
    for line in (data_dir / f"{split}.jsonl").read_text().splitlines():
        row = json.loads(line)
        if not row["problem"].startswith("<image>"):
            raise ValueError(
                f"{data_dir / split}.jsonl: expected a leading <image> marker, got {row['problem']!r}"
            )
        images = [Image.open(data_dir / path).convert("RGB") for path in row["images"]]
        question = row["problem"].removeprefix("<image>")
        rows.append({"question": question, "answer": row["answer"], "images": images})
    return rows


def make_reward_function(reward_module):
    def shapes_reward(completions, answer, **kwargs) -> list[float]:
        texts = [completion[-1]["content"] for completion in completions]
        inputs = [{"response": text, "ground_truth": truth} for text, truth in zip(texts, answer)]
        return [score["overall"] for score in reward_module.compute_score(inputs)]

    return shapes_reward


class JsonlWriter:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed at exit

    def write(self, record: dict) -> None:
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()


def greedy_accuracy(
    model, processor, rows: list[dict], max_new_tokens: int, suppress, reward_module
) -> float:
    """Greedy answers to every row (one batch, left-padded) scored by the reward file; mean ``overall``."""
    import torch

    messages = [
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": row["question"]}]}]
        for row in rows
    ]
    texts = [processor.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
    inputs = processor(
        text=texts,
        images=[row["images"] for row in rows],
        padding=True,
        padding_side="left",
        return_tensors="pt",
    )
    was_training = model.training
    model.eval()
    with torch.no_grad():
        output = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            suppress_tokens=suppress,
            pad_token_id=processor.tokenizer.pad_token_id,
        )
    model.train(was_training)
    responses = processor.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    scores = reward_module.compute_score(
        [{"response": text, "ground_truth": row["answer"]} for text, row in zip(responses, rows)]
    )
    return sum(score["overall"] for score in scores) / len(scores)


def build_trainer(args, train_rows: list[dict]):
    from datasets import Dataset
    from transformers import AutoConfig, AutoProcessor
    from trl import GRPOConfig, GRPOTrainer

    from mmrl.models.families import family_for

    completions = args.prompts * args.n
    if completions % (args.updates_per_rollout * args.micro_batch):
        raise SystemExit(
            f"--prompts*--n={completions} must divide into --updates_per_rollout={args.updates_per_rollout} "
            f"optimizer steps of --micro_batch={args.micro_batch} completions"
        )
    processor = AutoProcessor.from_pretrained(args.model, padding_side="left")
    suppress = family_for(AutoConfig.from_pretrained(args.model)).placeholder_token_ids(processor.tokenizer)
    generation_kwargs = {"suppress_tokens": suppress}
    if args.force_length:
        generation_kwargs["min_new_tokens"] = args.response_length
    config = GRPOConfig(
        output_dir=str(args.output_dir),
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        seed=args.seed,
        max_steps=args.steps * args.updates_per_rollout,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=completions // (args.updates_per_rollout * args.micro_batch),
        steps_per_generation=args.updates_per_rollout,
        num_generations=args.n,
        max_completion_length=args.response_length,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        generation_kwargs=generation_kwargs,
        beta=args.beta,
        num_iterations=1,
        epsilon=0.2,
        epsilon_high=0.3,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    dataset = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": row["question"]}],
                "images": row["images"],
                "answer": row["answer"],
            }
            for row in train_rows
        ]
    )
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=make_reward_function(load_reward_module()),
        args=config,
        train_dataset=dataset,
        processing_class=processor,
    )
    return trainer, processor, suppress


def instrument(trainer, args, log: JsonlWriter, val_rows: list[dict], suppress) -> None:
    """Time each optimizer step and its generate call; validate every ``--val_every`` steps."""
    from transformers import TrainerCallback

    reward_module = load_reward_module()
    counters = {"gen_s": 0.0, "prompt_tokens": 0, "response_tokens": 0}
    generate = trainer._generate_single_turn  # TRL 1.16: (prompt_ids, images, fields, n, ...) -> (ids, logps)

    def timed_generate(prompt_ids, *rest, **kwargs):
        start = time.perf_counter()
        completion_ids, logprobs = generate(prompt_ids, *rest, **kwargs)
        counters["gen_s"] += time.perf_counter() - start
        counters["prompt_tokens"] += sum(len(ids) for ids in prompt_ids)
        counters["response_tokens"] += sum(len(ids) for ids in completion_ids)
        return completion_ids, logprobs

    trainer._generate_single_turn = timed_generate

    def validate(step: int, control) -> None:
        start = time.perf_counter()
        accuracy = greedy_accuracy(
            trainer.model, trainer.processing_class, val_rows, args.response_length, suppress, reward_module
        )
        log.write({"step": step, "val_accuracy": accuracy, "val_s": time.perf_counter() - start})
        if control is not None and accuracy >= args.val_target - 1e-9:
            control.should_training_stop = True

    class StepTimer(TrainerCallback):
        """Sums ``on_step_begin`` → ``on_step_end`` over the optimizer steps of one rollout."""

        def on_train_begin(self, train_args, state, control, **kwargs):
            self.rollout_s = 0.0
            if args.val_every > 0:
                validate(0, None)

        def on_step_begin(self, train_args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, train_args, state, control, **kwargs):
            self.rollout_s += time.perf_counter() - self.start
            if state.global_step % args.updates_per_rollout:
                return  # the rollout's batch still has optimizer steps to run
            rollout = state.global_step // args.updates_per_rollout
            log.write({"step": rollout, "step_s": self.rollout_s, **counters})
            self.rollout_s = 0.0
            counters.update(gen_s=0.0, prompt_tokens=0, response_tokens=0)
            if args.val_every > 0 and rollout % args.val_every == 0:
                validate(rollout, control)

    trainer.add_callback(StepTimer())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data_dir", required=True, type=Path, help="folder with train.jsonl / val.jsonl")
    parser.add_argument("--log", required=True, type=Path)
    parser.add_argument("--output_dir", type=Path, default=None, help="TRL's output_dir (nothing is saved)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--response_length", type=int, default=64, help="max new tokens")
    parser.add_argument("--force_length", action="store_true", help="every response exactly L tokens")
    parser.add_argument("--micro_batch", type=int, default=16, help="completions per forward/backward")
    parser.add_argument("--updates_per_rollout", type=int, default=1, help="optimizer steps per rollout")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient; 0 = no reference model")
    parser.add_argument(
        "--steps", type=int, default=6, help="rollouts (each --updates_per_rollout optimizer steps)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--val_every", type=int, default=0, help="validate every k rollouts; 0 = never")
    parser.add_argument("--val_target", type=float, default=0.8, help="stop once validation reaches it")
    args = parser.parse_args()
    args.output_dir = args.output_dir or args.log.with_suffix(".trl_out")

    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO))
    train_rows = load_split(args.data_dir, "train")
    val_rows = load_split(args.data_dir, "val") if args.val_every > 0 else []
    trainer, _, suppress = build_trainer(args, train_rows)
    torch.set_num_threads(args.threads)  # in case a library changed it while building
    log = JsonlWriter(args.log)
    instrument(trainer, args, log, val_rows, suppress)
    trainer.train()


if __name__ == "__main__":
    main()
