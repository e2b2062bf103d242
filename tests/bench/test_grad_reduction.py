"""bench/grad_reduction.py: the actor's update on 2 gloo ranks, its gradients reduced in every
micro-batch and once per optimizer step (``worker.actor.reduce_grads_once``), on the same numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "grad_reduction.py"


@pytest.mark.distributed
def test_reducing_once_per_step_starts_fewer_reductions_for_the_same_update(tmp_path):
    out = tmp_path / "grad_reduction.json"
    command = [sys.executable, str(BENCH), "--widths", "smoke", "--rows", "4", "--repeats", "1"]
    run = subprocess.run(
        [*command, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| gradients reduced | update s | reduce-scatters | loss | grad norm |" in run.stdout
    ranks = json.loads(out.read_text())["ranks"]
    assert len(ranks) == 2
    for figures in ranks:
        every, once = figures["per micro-batch"], figures["once per step"]
        # 2 micro-batches of one row per rank: each unit the update runs reduces twice, or once (the
        # smoke layout: 2 decoder layers and the root; the vision tower, called by no text row, never)
        assert every["reductions"] == 6 and once["reductions"] == 3
        assert once["loss"] == pytest.approx(every["loss"], rel=1e-6)
        assert once["grad_norm"] == pytest.approx(every["grad_norm"], rel=1e-5)
        assert every["update_s"] > 0 and once["update_s"] > 0
