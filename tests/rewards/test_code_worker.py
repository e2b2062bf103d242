"""The code source where a run uses it: in a Ray reward worker, composed with the rule file by weights,
scoring hostile programs beside good ones; the worker carries on and nothing outlives the runs. The
worker is handed decoded responses: its process imports neither torch nor transformers."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mmrl.config.loading import load_config
from mmrl.protocol import DataProto

sys.path.insert(0, str(Path(__file__).parents[1] / "sandbox"))
from _sandboxed import foreign_processes  # noqa: E402

pytestmark = pytest.mark.shares("sandbox")  # tests count the sandboxed processes on the machine

REPO = Path(__file__).parents[2]
TESTS = '{"inputs": ["1 2\\n", "20 22\\n"], "outputs": ["3", "42"]}'
GOOD = "<think>add them</think>```python\nprint(sum(map(int, input().split())))\n```"
HALF = "```python\nprint(3)\n```"
FORK_BOMB = (
    "```python\nimport os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n```"
)
KILL_ALL = (
    "```python\nimport os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(-1, signal.SIGKILL)\n```"
)
DAEMON = "```python\nimport os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n```"


def _batch(tokenizer, responses: list[str]) -> DataProto:
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in responses]
    width = max(map(len, ids))
    padded = torch.tensor([row + [0] * (width - len(row)) for row in ids])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
    return DataProto.from_dict(
        tensors={"responses": padded, "response_mask": mask},
        non_tensors={"ground_truth": np.array([TESTS] * len(responses), dtype=object)},
    )


@pytest.mark.distributed
def test_a_ray_reward_worker_scores_code_beside_the_rule_file_and_survives_hostile_programs(
    tiny_vl_path, tmp_path
):
    import ray
    from transformers import AutoTokenizer

    from mmrl.single_controller.resource_pool import init_ray
    from mmrl.workers.reward_worker import RewardWorkers

    config = load_config(
        [
            f"config={REPO / 'examples' / 'tiny_cpu.yaml'}",
            f"worker.actor.model.model_path={tiny_vl_path}",
            f"worker.reward.reward_function={REPO / 'reward_functions' / 'code_format.py'}:compute_score",
            "worker.reward.rule.weight=0.1",
            "worker.reward.code.enable=true",
            "worker.reward.code.weight=0.9",
            "worker.reward.code.sandbox.cpu_time_s=1",
            "worker.reward.code.sandbox.wall_time_s=4",  # GOOD passes within it beside a fork bomb, loaded
            "worker.reward.code.sandbox.max_processes=8",
            "worker.reward.num_workers=1",
            "worker.reward.timeout_s=120",
            f"trainer.save_checkpoint_path={tmp_path}",
        ],
        check_paths=False,
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl_path)
    started_here = not ray.is_initialized()
    init_ray(num_cpus=2, object_store_memory_bytes=150_000_000)
    before = foreign_processes()
    try:
        workers = RewardWorkers(config, tokenizer)
        hostile = workers.collect(
            workers.launch(_batch(tokenizer, [GOOD, FORK_BOMB, KILL_ALL, DAEMON, HALF]))
        )
        after = workers.collect(workers.launch(_batch(tokenizer, [GOOD, HALF])))  # the same worker
        # the driver decoded the responses: the worker process has not imported torch or transformers
        imported = ray.get(
            workers.actors[0].__ray_call__.remote(
                lambda scorer: [name for name in ("torch", "transformers") if name in sys.modules]
            )
        )
        ray.kill(workers.actors[0])
    finally:
        if started_here:
            ray.shutdown()
    scores = list(hostile.non_tensor_batch["reward_scores"])
    assert [round(s["overall"], 6) for s in scores] == [
        1.0,
        0.1,
        0.1,
        0.1,
        0.55,
    ]  # 0.1 format + 0.9 pass rate
    assert [s["code/pass_rate"] for s in scores] == [1.0, 0.0, 0.0, 0.0, 0.5]
    assert scores[1]["code/cpu_time"] + scores[1]["code/wall_time"] == 1.0
    assert scores[3]["code/wrong_answer"] == 1.0 and scores[0]["rule/format"] == 1.0
    assert all(s["code/failed"] == 0.0 and s["code/leftover_processes"] == 0.0 for s in scores)
    assert [s["overall"] for s in after.non_tensor_batch["reward_scores"]] == pytest.approx([1.0, 0.55])
    assert list(after.non_tensor_batch["response_text"]) == [GOOD, HALF]
    assert imported == []
    assert hostile.batch["token_level_scores"].sum(-1).tolist() == pytest.approx([1.0, 0.1, 0.1, 0.1, 0.55])
    # the killed programs are gone once reaped (seconds, on a machine busy with other tests)
    deadline = time.monotonic() + 10
    while (left := foreign_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"sandboxed processes outlived their runs: {left}"
    assert os.getpid() > 0  # this process (the driver's stand-in) was not killed either
