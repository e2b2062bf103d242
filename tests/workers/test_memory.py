"""Per-phase peak memory: a phase that allocates more shows a higher peak, and a later small phase is
not charged with an earlier big one (the high-water mark is reset per phase)."""

from __future__ import annotations

import torch

from mmrl.workers.memory import GiB, PhasePeaks, resident_peak_bytes


def test_each_phase_reports_its_own_peak():
    peaks = PhasePeaks(torch.device("cpu"))
    with peaks.phase("big"):
        block = torch.ones(512 * 1024 * 1024 // 4)  # 512 MiB, touched
        del block
    with peaks.phase("small"):
        torch.ones(1024).sum()
    taken = peaks.take()
    assert set(taken) == {"memory/big_peak_gib", "memory/small_peak_gib"}
    # the big phase held 0.5 GiB more than it had at its start; the small one did not
    assert taken["memory/big_peak_gib"] - taken["memory/small_peak_gib"] > 0.4
    assert taken["memory/small_peak_gib"] <= resident_peak_bytes() / GiB + 0.01
    assert peaks.take() == {}  # taken once


def test_ranks_combine_to_the_largest_peak_and_the_least_free_memory():
    """Every figure a GPU phase reports (tensors, reserved, device free; see mmrl.workers.memory) over
    the ranks: a peak is the largest of any rank, free memory the smallest."""
    from mmrl.workers.memory import combine_rank_peaks

    rank0 = {
        "memory/gen_peak_gib": 10.0,
        "memory/gen_reserved_peak_gib": 12.0,
        "memory/gen_device_free_gib": 30.0,
    }
    rank1 = {
        "memory/gen_peak_gib": 11.0,
        "memory/gen_reserved_peak_gib": 11.5,
        "memory/gen_device_free_gib": 21.0,
    }
    rank2 = {"memory/sync_peak_gib": 3.0}  # a phase only some ranks ran
    assert combine_rank_peaks([rank0, rank1, rank2]) == {
        "memory/gen_peak_gib": 11.0,
        "memory/gen_reserved_peak_gib": 12.0,
        "memory/gen_device_free_gib": 21.0,
        "memory/sync_peak_gib": 3.0,
    }
