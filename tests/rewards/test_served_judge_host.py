"""A judge mmrl serves listens on loopback unless the config says otherwise: its vLLM API has no key."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmrl.config.loading import ConfigError, load_config
from mmrl.rewards.judge_server import VllmServer, listen_address

REPO_ROOT = Path(__file__).resolve().parents[2]
# two nodes; micro batches that fit the smaller data-parallel shares, so only the host is in question
TWO_NODE_JUDGE_RUN = [
    f"config={REPO_ROOT / 'examples' / 'tiny_cpu_judge.yaml'}",
    "trainer.nnodes=2",
    "worker.actor.micro_batch_size_per_device_for_update=8",
]


def test_a_served_judge_listens_on_loopback_by_default():
    config = load_config([f"config={REPO_ROOT / 'examples' / 'tiny_cpu_judge.yaml'}"], check_paths=False)
    assert config.worker.reward.judge.serve.host == "127.0.0.1" == VllmServer("m", "judge", [], {}).host
    assert listen_address("127.0.0.1") == "127.0.0.1"
    assert listen_address("10.1.2.3") == "10.1.2.3"


def test_a_multi_node_run_must_say_the_judge_listens_on_its_node():
    with pytest.raises(
        ConfigError, match=r"worker.reward.judge.serve.host=127.0.0.1 with trainer.nnodes=2"
    ) as err:
        load_config(TWO_NODE_JUDGE_RUN, check_paths=False)
    assert "set worker.reward.judge.serve.host=node" in str(err.value)
    config = load_config([*TWO_NODE_JUDGE_RUN, "worker.reward.judge.serve.host=node"], check_paths=False)
    assert config.worker.reward.judge.serve.host == "node"
