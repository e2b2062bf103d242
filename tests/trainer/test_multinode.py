"""``trainer.nnodes=2`` end to end on a real two-node Ray cluster started on this machine.

``ray.cluster_utils.Cluster`` starts two raylets (two Ray nodes, distinct node ids, each with a custom
resource naming it) on one machine; the trainer joins it through ``trainer.ray.address``. The run checks
what single-node tests cannot: the node groups land on distinct nodes, torch.distributed's gloo
rendezvous spans them (the run trains), and a checkpoint committed from the ranks' reports resumes to
the same validation numbers. Both nodes share this machine's disk, the shared filesystem checkpoints need.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

import _warm_start as warm
import pytest
from _ray_clients import assert_refuses_other_tokens
from _trainer_run import REPO_ROOT, small_run_overrides

from mmrl.single_controller.ray_auth import enable_token_auth


@pytest.fixture
def two_node_cluster():
    """(address, (head node id, second node id)) of a Ray cluster of two nodes on this machine, 2 CPUs
    each, with token authentication as a multi-node user sets it up (README: one token
    file that every node and the driver read); torn down with the processes it started (never a
    machine-wide `ray stop`)."""
    from ray.cluster_utils import Cluster

    # Short (Unix socket paths must stay under 108 bytes) and ours: Cluster writes the cluster's address
    # under RAY_TMPDIR, where a bare ray.init() of another test or run on this machine would find and join it.
    ray_tmp = Path(tempfile.mkdtemp(prefix="mmrl_nodes_", dir="/tmp"))
    (ray_tmp / "ray").mkdir()
    token = ray_tmp / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
        monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the ranks inherit the raylets' environment
        enable_token_auth(joining=False)  # this process imported ray before: Ray reads the settings again
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 2,
                "resources": {"mmrl_node_a": 1},
                "include_dashboard": False,
                "temp_dir": str(ray_tmp / "ray"),
            },
        )
        try:
            second = cluster.add_node(num_cpus=2, resources={"mmrl_node_b": 1})
            yield cluster.address, (cluster.head_node.node_id, second.node_id)
        finally:
            cluster.shutdown()
            shutil.rmtree(ray_tmp, ignore_errors=True)


def _run(overrides: list[str], save_dir: Path) -> tuple[str, list[dict]]:
    """The trainer's output and metrics.jsonl rows (it must exit 0)."""
    run = warm.run(
        [sys.executable, "-m", "mmrl.trainer.main", *overrides],
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-6000:]
    rows = [json.loads(line) for line in (save_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    return output, rows


@pytest.mark.slow(seconds=95)
@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_two_nodes_place_rendezvous_save_and_resume(
    two_node_cluster, tiny_vl_path, shapes_data_dir, tmp_path
):
    address, node_ids = two_node_cluster
    assert_refuses_other_tokens(address)  # token authentication is on: another token is refused
    save_dir = tmp_path / "run"
    overrides = small_run_overrides(tiny_vl_path, shapes_data_dir, save_dir) + [
        f"trainer.ray.address={address}",
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=1",
        "worker.rollout.name=hf",
    ]
    output, rows = _run([*overrides, "trainer.val_before_train=false"], save_dir)

    # one rank per node, as the ranks themselves reported their node ids
    placed = re.search(r"2 training ranks on 2 Ray node\(s\) \(rank 0: (\w+), rank 1: (\w+)\)", output)
    assert placed and {placed[1], placed[2]} == {node_id[:12] for node_id in node_ids}
    # the gloo group spans both nodes: every update all-reduced its gradients across them
    trained = [row for row in rows if "actor/grad_norm" in row]
    assert [row["step"] for row in trained] == [1, 2] and all(row["actor/grad_norm"] > 0 for row in trained)
    step_2 = save_dir / "global_step_2"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} == {
        path.name for path in (step_2 / "actor" / "model").iterdir()
    }
    assert not (step_2 / ".save_id").exists()  # the save's id is the driver's, removed at the commit

    resumed_output, resumed_rows = _run([*overrides, "trainer.max_steps=3"], save_dir)
    assert f"resuming from {step_2}" in resumed_output
    new_rows = resumed_rows[len(rows) :]
    assert [row["step"] for row in new_rows] == [2, 3]  # validation at the resumed step, then step 3
    # greedy validation of the weights loaded on the two nodes equals that of the weights that were saved
    val_keys = [key for key in rows[-1] if key.startswith("val/")]
    assert val_keys and {key: new_rows[0][key] for key in val_keys} == {
        key: rows[-1][key] for key in val_keys
    }
    assert (save_dir / "global_step_3" / "actor" / "extra_state_rank1.pt").is_file()
