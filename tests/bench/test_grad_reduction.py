"""bench/grad_reduction.py: the actor's update on 2 gloo ranks, its gradients reduced in every
micro-batch and once per optimizer step (``worker.actor.reduce_grads_once``), on the same numbers."""

from __future__ import annotations

import json

import pytest
from _bench_run import run_bench


@pytest.mark.distributed
def test_reducing_once_per_step_starts_fewer_reductions_for_the_same_update(tmp_path):
    out = tmp_path / "grad_reduction.json"
    stdout = run_bench(
        "grad_reduction.py", "--widths", "smoke", "--rows", "4", "--repeats", "1", "--out", str(out)
    )
    assert "| gradients reduced | update s | reduce-scatters | loss | grad norm |" in stdout
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
