#!/usr/bin/env bash
# GRPO on Geometry3k with Qwen2.5-VL-7B-Instruct, one node of 8 GPUs (vLLM rollout, TP 2).
# Data: a local copy of hiyouga/geometry3k (parquet, or a `datasets.save_to_disk` folder), or the hub id
# where the hub is reachable.
set -euo pipefail
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-VL-7B-Instruct}

python -m mmrl.trainer.main config=examples/config.yaml \
    data.train_files=${TRAIN_FILES:-hiyouga/geometry3k@train} \
    data.val_files=${VAL_FILES:-hiyouga/geometry3k@test} \
    data.format_prompt=./format_prompts/math.jinja \
    worker.actor.model.model_path="${MODEL_PATH}" \
    worker.reward.reward_function=./reward_functions/math.py:compute_score \
    worker.actor.model.compile_layers=true \
    worker.rollout.name=vllm \
    worker.rollout.tensor_parallel_size=2 \
    trainer.experiment_name=qwen2_5_vl_7b_geo3k_grpo \
    trainer.n_gpus_per_node=8 \
    trainer.logger="[console,jsonl,wandb]" "$@"
