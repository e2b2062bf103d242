"""Bytes moved through Ray per training step: media as processor tensors in every dispatch (before)
against media put once as their files and processed on the workers (after).

    python bench/scale_media.py [--prompts 64] [--n 4] [--image_size 448] [--world_size 2]
                                [--response_length 16] [--no_trainer]

The case: ``--prompts`` photo-like JPEGs of ``--image_size`` pixels (``write_photo_dataset``: a shape
over per-pixel noise, ~100 kB each at 448 px), ``--n`` responses per prompt, ``--world_size`` ranks,
the tiny Qwen2.5-VL, whose image processor is Qwen2.5-VL's (14-pixel patches, 2x2 merge), with
``max_pixels`` = the image's own size, so ``pixel_values`` have the size a real run gives them
(448 px: 1024 patches x 1176 float32 = 4.8 MB per image).

Every number comes from one counter, :class:`mmrl.single_controller.transfer.TransferCounter`: the
sizes of the objects put in and returned through Ray's object store, as Ray's object directory reports
them. Three measurements of one training step (GRPO with a KL loss and a separate old-log-prob pass:
generate, rewards, old and reference log-probs, actor update):

- ``before``: the dispatches of main's ``train_step`` replayed on a local Ray cluster, with the batch
  main's dataset built (each item carried ``multi_modal_inputs`` and ``multi_modal_data``, made here by
  the same processing) and worker results of the columns and shapes main's workers returned
  (generate returned its prompts' media columns with the responses); no model runs;
- ``after (replay)``: the same replay with this branch's batch: ``prompt_media`` refs, each prompt's
  files put once, generate returning no media;
- ``after (trainer)``: one real step of ``python -m mmrl.trainer.main`` on the same data and settings,
  its ``transfer/*`` metrics (skipped with ``--no_trainer``). It agreeing with the replay of the same
  code is what makes the ``before`` replay stand for main's trainer.

Tensor columns (token ids, masks, log-probs) travel alike before and after; their bytes grow with the
response length, the media's do not. Prints the tables; writes ``bench/results/scale_media.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parent.parent
KIND = "qwen2_5_vl"
MB = 1e6
PHASES = ("generate", "rewards", "old_log_probs", "ref_log_probs", "update_actor")


# ---- the batches ------------------------------------------------------------------------------


# Qwen2.5-VL's own image size range (its preprocessor_config.json); the tiny model's processor keeps
# images under 50176 pixels to keep tests fast
QWEN2_5_VL_IMAGE_SIZE = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384}


def _assets(prompts: int, image_size: int) -> tuple[str, Path]:
    """The tiny Qwen2.5-VL with Qwen2.5-VL's image size range, and the photo dataset."""
    import shutil

    from mmrl.demo.synthetic import write_photo_dataset
    from mmrl.demo.tiny import build_tiny_model, tiny_model_path

    tiny = build_tiny_model(KIND, tiny_model_path(KIND, "tiny", RESULTS / "models"), "tiny")
    model = RESULTS / "models" / "tiny-qwen2.5-vl-full-image-size"
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(tiny, model)
    config_file = model / "processor_config.json"
    config = json.loads(config_file.read_text())
    config["image_processor"]["size"] = QWEN2_5_VL_IMAGE_SIZE
    config_file.write_text(json.dumps(config, indent=2))
    data_dir = write_photo_dataset(RESULTS / "data" / f"photos-{image_size}", prompts, size=image_size)
    return str(model), data_dir


def _data_config(image_size: int):
    from mmrl.data.config import DataConfig

    return DataConfig(
        min_pixels=28 * 28,
        max_pixels=image_size * image_size,
        max_prompt_length=4096,
        filter_overlong_prompts=False,
    )


def _prompt_batches(model: str, data_dir: Path, prompts: int, image_size: int):
    """(main's prompt batch: processed media in every row; this branch's: PromptMedia), encoded bytes."""
    from mmrl.data.collate import collate_prompts
    from mmrl.data.dataset import PromptDataset
    from mmrl.data.processing import PROMPT_MEDIA, attach_media, load_tokenizer_and_processor

    tokenizer, processor = load_tokenizer_and_processor(model)
    dataset = PromptDataset(str(data_dir / "train.jsonl"), tokenizer, processor, _data_config(image_size))
    after = collate_prompts([dataset[i] for i in range(prompts)], tokenizer.pad_token_id)
    before = attach_media(after, dataset.media, rollout_media=True)  # what main's items carried
    before = before.select(non_tensor_keys=[key for key in before.non_tensor_batch if key != PROMPT_MEDIA])
    encoded = sum(media.encoded_bytes for media in after.non_tensor_batch[PROMPT_MEDIA])
    return before, after, encoded, tokenizer.pad_token_id


# ---- the replay of one step's dispatches --------------------------------------------------------


def _generated(chunk, n: int, response_length: int, pad_token_id: int, keep_media: bool):
    """What a rank's generate returns for ``chunk``: n responses per prompt and their position ids."""
    import torch

    from mmrl.data.processing import without_model_media
    from mmrl.workers.rollout import assemble_rollout_batch

    rows = len(chunk) * n
    responses = torch.randint(10, 100, (rows, response_length))
    output = assemble_rollout_batch(
        chunk.repeat(n, interleave=True),
        responses,
        [0],
        pad_token_id,
        rollout_log_probs=torch.zeros(rows, response_length),
    )
    length = output.batch["input_ids"].shape[-1]
    output.batch["position_ids"] = torch.zeros(rows, 3, length, dtype=torch.long)
    return output if keep_media else without_model_media(output)


def _scores(shard):
    import torch

    from mmrl.protocol import DataProto

    rows, width = shard.batch["responses"].shape
    return DataProto.from_dict(
        tensors={"token_level_scores": torch.zeros(rows, width)},
        non_tensors={"reward_scores": [{"overall": 1.0}] * rows, "response_text": ["blue"] * rows},
    )


def _log_probs(name: str, *extra: str):
    def make(chunk):
        import torch

        from mmrl.protocol import DataProto

        shape = chunk.batch["responses"].shape
        return DataProto.from_dict(tensors={key: torch.zeros(shape) for key in (name, *extra)})

    return make


def _update(chunk):
    from mmrl.protocol import DataProto

    return DataProto(meta_info={"metrics": {"actor/pg_loss": 0.0, "actor/grad_norm": 0.0}})


class _Replay:
    """One step's dispatches with a counter: rank chunks put, each rank's result put back."""

    def __init__(self, transfers, world_size: int, media_sizes: dict[str, int]):
        self.transfers, self.world_size = transfers, world_size
        self.phases: dict[str, int] = {}
        # what the ranks read of the media put once: each prompt's object once per rank that gets
        # one of its rows (a worker keeps the processed media for its next phase)
        self.media_sizes, self.read_by_rank = media_sizes, [set() for _ in range(world_size)]

    def media_read_bytes(self) -> int:
        return sum(self.media_sizes[key] for keys in self.read_by_rank for key in keys)

    def _note_reads(self, chunks) -> None:
        from mmrl.data.processing import PROMPT_MEDIA

        for rank, chunk in enumerate(chunks):
            column = chunk.non_tensor_batch.get(PROMPT_MEDIA, ())
            self.read_by_rank[rank] |= {ref.hex() for ref in column if hasattr(ref, "hex")}

    def dispatch(self, phase: str, batch, make_output, parts: int | None = None):
        from mmrl.protocol import DataProto
        from mmrl.single_controller.transfer import RECEIVED, SENT

        start = self.transfers.snapshot()
        parts = parts or self.world_size
        assert len(batch) % parts == 0, "the replay keeps every chunk whole: pick divisible sizes"
        chunks = batch.chunk(parts)
        if parts == self.world_size:
            self._note_reads(chunks)
        sent = [self.transfers.put(chunk, SENT) for chunk in chunks]
        outputs = [make_output(chunk) for chunk in chunks]
        received = [self.transfers.put(output, RECEIVED) for output in outputs]
        self.transfers.add_tensor_bytes([*chunks, *outputs])
        del sent, received  # freed from the object store before the next phase
        moved = self.transfers.since(start)
        self.phases[phase] = moved[SENT] + moved[RECEIVED]
        return DataProto.concat(outputs) if len(outputs[0]) else outputs[0]


def replay_step(prompts, n: int, world_size: int, response_length: int, pad_token_id: int, keep_media: bool):
    """Bytes per phase (and the counter) of one step of dispatches; ``prompts`` with ``prompt_media``
    are put once first, as the trainer does."""
    import ray

    from mmrl.data.processing import PROMPT_MEDIA
    from mmrl.parallel.packing import balance_batch
    from mmrl.single_controller.transfer import TransferCounter, put_media
    from mmrl.workers.reward_worker import MODEL_INPUT_COLUMNS

    transfers = TransferCounter()
    prompts = put_media(prompts, transfers)
    refs = [ref for ref in prompts.non_tensor_batch.get(PROMPT_MEDIA, ()) if ref is not None]
    sizes = {
        ref.hex(): info["object_size"] for ref, info in ray.experimental.get_object_locations(refs).items()
    }
    replay = _Replay(transfers, world_size, sizes)
    batch = replay.dispatch(
        "generate", prompts, lambda chunk: _generated(chunk, n, response_length, pad_token_id, keep_media)
    )
    scoring = [key for key in batch.non_tensor_batch if key not in MODEL_INPUT_COLUMNS]
    light = batch.select(batch_keys=["responses", "response_mask"], non_tensor_keys=scoring)
    replay.dispatch("rewards", light, _scores, parts=1)
    batch, _ = balance_batch(batch, world_size)
    batch = batch.union(replay.dispatch("old_log_probs", batch, _log_probs("old_log_probs", "entropies")))
    batch = batch.union(replay.dispatch("ref_log_probs", batch, _log_probs("ref_log_probs")))
    replay.dispatch("update_actor", batch, _update)
    return replay.phases, {**transfers.snapshot(), "media_read_by_workers": replay.media_read_bytes()}


# ---- a real trainer step ------------------------------------------------------------------------


def trainer_step(model: str, data_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    """The ``transfer/*`` metrics of one real training step on the same data and settings."""
    run_dir = RESULTS / "runs" / "scale_media"
    overrides = [
        f"data.train_files={data_dir / 'train.jsonl'}",
        "data.max_prompt_length=4096",
        f"data.max_response_length={args.response_length}",
        f"data.rollout_batch_size={args.prompts}",
        "data.min_pixels=784",
        f"data.max_pixels={args.image_size**2}",
        f"worker.actor.model.model_path={model}",
        "worker.actor.model.enable_gradient_checkpointing=false",
        f"worker.actor.global_batch_size={args.prompts}",
        "worker.actor.skip_old_log_prob_on_policy=false",
        "algorithm.use_kl_loss=true",
        f"worker.rollout.n={args.n}",
        "worker.rollout.name=hf",
        f"worker.reward.reward_function={REPO / 'reward_functions/shapes.py'}:compute_score",
        "trainer.max_steps=1",
        "trainer.logger=[jsonl]",
        f"trainer.n_gpus_per_node={args.world_size}",
        "trainer.device=cpu",
        "trainer.save_freq=-1",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        f"trainer.save_checkpoint_path={run_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-m", "mmrl.trainer.main", *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        raise RuntimeError(f"the trainer step failed:\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    step = next(record for record in records if "transfer/sent_bytes" in record)
    return {
        key.removeprefix("transfer/").removesuffix("_bytes"): value
        for key, value in step.items()
        if key.startswith("transfer/")
    }


# ---- results and tables -------------------------------------------------------------------------


def measure(
    prompts: int = 64, n: int = 4, image_size: int = 448, world_size: int = 2, response_length: int = 16,
    trainer: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Replays before and after (and a real trainer step unless ``trainer`` is false)."""
    import ray

    from mmrl.single_controller import init_ray

    args = argparse.Namespace(
        prompts=prompts, n=n, image_size=image_size, world_size=world_size, response_length=response_length
    )
    model, data_dir = _assets(prompts, image_size)
    before, after, encoded, pad_token_id = _prompt_batches(model, data_dir, prompts, image_size)
    init_ray(num_cpus=2, object_store_memory_bytes=6 * 1024**3)
    try:
        replays = {
            name: replay_step(
                batch, n, world_size, response_length, pad_token_id, keep_media=name == "before"
            )
            for name, batch in (("before", before), ("after", after))
        }
    finally:
        ray.shutdown()
    first_inputs = before.non_tensor_batch["multi_modal_inputs"][0]
    results: dict[str, Any] = {
        "settings": vars(args),
        "encoded_media_bytes": encoded,
        "pixel_values_bytes_per_image": int(first_inputs["pixel_values"].numel() * 4),
        "replay": {
            name: {"phases": phases, "counter": counter} for name, (phases, counter) in replays.items()
        },
    }
    if trainer:
        start = time.perf_counter()
        results["trainer"] = trainer_step(model, data_dir, args)
        results["trainer_wall_s"] = time.perf_counter() - start
    return results


def _moved(counter: dict[str, int]) -> int:
    return sum(counter.get(kind, 0) for kind in ("sent", "received", "media"))


def rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per phase and per total: bytes through Ray in one step, before and after (MB)."""
    replay, encoded = results["replay"], results["encoded_media_bytes"]
    before, after = replay["before"], replay["after"]
    table = [
        {"measure": f"dispatch: {phase}", "before_MB": before["phases"][phase] / MB,
         "after_MB": after["phases"][phase] / MB}
        for phase in PHASES
    ]  # fmt: skip
    table.append({"measure": "media put once (prompt_media)", "before_MB": 0.0,
                  "after_MB": after["counter"].get("media", 0) / MB})  # fmt: skip
    table.append({"measure": "media read by the ranks (object store -> worker, once per rank)",
                  "before_MB": 0.0, "after_MB": after["counter"]["media_read_by_workers"] / MB})  # fmt: skip
    table.append({"measure": "total per step", "before_MB": _moved(before["counter"]) / MB,
                  "after_MB": _moved(after["counter"]) / MB})  # fmt: skip
    tensors = {name: replay[name]["counter"].get("tensors", 0) for name in replay}
    table.append({"measure": "total beside the tensor columns",
                  "before_MB": (_moved(before["counter"]) - tensors["before"]) / MB,
                  "after_MB": (_moved(after["counter"]) - tensors["after"]) / MB})  # fmt: skip
    table.append(
        {"measure": "encoded media of the step (files)", "before_MB": encoded / MB, "after_MB": encoded / MB}
    )
    table.append({"measure": "(total beside tensors) / encoded media",
                  "before_MB": (_moved(before["counter"]) - tensors["before"]) / encoded,
                  "after_MB": (_moved(after["counter"]) - tensors["after"]) / encoded})  # fmt: skip
    if "trainer" in results:
        real = results["trainer"]
        table.append({"measure": "after, a real trainer step: total", "before_MB": None,
                      "after_MB": _moved(real) / MB})  # fmt: skip
        table.append({"measure": "after, a real trainer step: beside tensors / encoded", "before_MB": None,
                      "after_MB": (_moved(real) - real["tensors"]) / real["encoded_media"]})  # fmt: skip
    return table


def markdown(table: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        return "" if value is None else f"{value:.2f}"

    lines = ["| measure | before (main) | after |", "|---|---|---|"]
    lines += [f"| {row['measure']} | {cell(row['before_MB'])} | {cell(row['after_MB'])} |" for row in table]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--image_size", type=int, default=448)
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--response_length", type=int, default=16)
    parser.add_argument("--no_trainer", action="store_true", help="skip the real trainer step")
    args = parser.parse_args(argv)
    results = measure(
        args.prompts,
        args.n,
        args.image_size,
        args.world_size,
        args.response_length,
        trainer=not args.no_trainer,
    )
    settings = results["settings"]
    print(
        f"bytes through Ray in one step (MB; ratios where named): {settings['prompts']} prompts x n={settings['n']}, "
        f"{settings['image_size']} px JPEGs, {settings['world_size']} ranks, responses of {settings['response_length']} "
        f"tokens; pixel_values {results['pixel_values_bytes_per_image'] / MB:.2f} MB per image"
    )
    print(markdown(rows(results)))
    out = RESULTS / "scale_media.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
