"""bench/grad_reduction.py: the actor's update on 2 gloo ranks, its gradients reduced in every
micro-batch and once per optimizer step (``worker.actor.reduce_grads_once``), its parameters gathered in
every unit's forward and backward or once per step, on the same numbers."""

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
    assert "| gradients reduced | update s | all-gathers | reduce-scatters | loss | grad norm |" in stdout
    ranks = json.loads(out.read_text())["ranks"]
    assert len(ranks) == 2
    for figures in ranks:
        every, once = figures["per micro-batch"], figures["once per step"]
        gathered_once = figures["once per step, parameters gathered once"]
        # 2 micro-batches of one row per rank: each unit the update runs reduces twice, or once (the
        # smoke layout: 2 decoder layers and the root; the vision tower, called by no text row, never)
        assert every["reductions"] == 6 and once["reductions"] == gathered_once["reductions"] == 3
        # per micro-batch, each decoder layer gathers in its forward and its backward, the root once
        # (kept for its backward): 2 x (2 x 2 + 1); kept from forward to backward and across
        # micro-batches, each unit once per step
        assert every["gathers"] == once["gathers"] == 10 and gathered_once["gathers"] == 3
        for figures_of in (once, gathered_once):
            assert figures_of["loss"] == pytest.approx(every["loss"], rel=1e-6)
            assert figures_of["grad_norm"] == pytest.approx(every["grad_norm"], rel=1e-5)
            assert figures_of["update_s"] > 0
