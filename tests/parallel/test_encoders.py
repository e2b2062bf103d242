"""The cut of a vision tower's work over SP ranks (mmrl.parallel.encoders), by hand; the sharded
towers' results and gradients against one rank are in test_sequence_parallel.py."""

from __future__ import annotations

import torch

from mmrl.parallel.encoders import _run_grid, _units, split_units


def test_units_are_temporal_patches_cut_into_contiguous_runs():
    grid = torch.tensor(
        [[1, 4, 6], [3, 2, 2], [1, 2, 4]]
    )  # an image, a video of 3 temporal patches, an image
    patches, owners = _units(grid)
    assert patches == [24, 4, 4, 4, 8]
    # 44 patches over 2 ranks: the image alone reaches half, the rest goes to rank 1
    assert split_units(patches, 2) == [(0, 1), (1, 5)]
    assert split_units([4] * 6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert split_units([4] * 6, 4) == [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert split_units([4, 4], 3) is None  # fewer units than ranks: every rank encodes the whole call
    assert split_units([100, 1, 1], 2) == [(0, 1), (1, 3)]
    assert _run_grid(owners, 1, 5, grid).tolist() == [[3, 2, 2], [1, 2, 4]]
    assert _run_grid(owners, 2, 4, grid).tolist() == [[2, 2, 2]]  # part of the video
