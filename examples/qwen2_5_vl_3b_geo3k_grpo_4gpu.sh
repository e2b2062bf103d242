#!/usr/bin/env bash
# Dr. GRPO (no std normalisation, seq-mean-token-sum-norm aggregation) with Qwen2.5-VL-3B on 4 GPUs,
# KL as a loss term, transformers rollout as a fallback where vLLM is not installed.
set -euo pipefail
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-VL-3B-Instruct}

python -m mmrl.trainer.main config=examples/config.yaml \
    data.train_files=${TRAIN_FILES:-hiyouga/geometry3k@train} \
    data.val_files=${VAL_FILES:-hiyouga/geometry3k@test} \
    data.format_prompt=./format_prompts/math.jinja \
    data.rollout_batch_size=128 \
    algorithm.norm_adv_by_std=false \
    worker.actor.loss_avg_mode=seq_mean_token_sum_norm \
    worker.actor.global_batch_size=64 \
    worker.actor.model.model_path="${MODEL_PATH}" \
    worker.actor.model.compile_layers=true \
    worker.reward.reward_function=./reward_functions/math.py:compute_score \
    worker.rollout.name=${ROLLOUT:-vllm} \
    worker.rollout.tensor_parallel_size=1 \
    trainer.experiment_name=qwen2_5_vl_3b_geo3k_drgrpo \
    trainer.n_gpus_per_node=4 "$@"
