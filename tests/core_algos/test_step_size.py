"""The step-size controller (``worker.actor.kl_step_control``) by hand: the learning rate's scale falls
while a step's updates move the policy further than twice the target, rises back while they move it less
than half of it, between its floor and 1; off, it stays 1."""

from __future__ import annotations

import math

import pytest

from mmrl.core_algos import KLStepControl


def test_the_scale_follows_the_measured_kl_by_hand():
    control = KLStepControl(enabled=True, target_kl=0.01, factor=2.0, min_scale=0.25)
    assert control.scale == 1.0 and control.metrics() == {"actor/lr_scale": 1.0}
    scales = []
    # too far, too far, too far (at the floor), in the band, near-still x3 (back up to 1), NaN: unmeasured
    for kl in (0.05, 0.021, 0.5, 0.015, 0.004, 0.0, 0.0049, math.nan):
        control.update(kl)
        scales.append(control.scale)
    assert scales == [0.5, 0.25, 0.25, 0.25, 0.5, 1.0, 1.0, 1.0]
    assert control.metrics() == {"actor/lr_scale": 1.0}


def test_the_band_edges_leave_the_scale_alone():
    control = KLStepControl(enabled=True, target_kl=0.01, factor=1.5, min_scale=0.1)
    control.update(0.05)
    assert control.scale == pytest.approx(1 / 1.5)
    for kl in (0.02, 0.005):  # exactly 2 k* and k* / 2: neither too far nor still
        control.update(kl)
        assert control.scale == pytest.approx(1 / 1.5)


def test_off_the_scale_stays_one_and_nothing_is_logged():
    control = KLStepControl(enabled=False, target_kl=0.01)
    for kl in (1.0, 10.0):
        control.update(kl)
    assert control.scale == 1.0 and control.metrics() == {}


def test_the_scale_resumes_from_a_checkpoint():
    control = KLStepControl(enabled=True, target_kl=0.01, factor=2.0)
    control.update(1.0)
    resumed = KLStepControl(enabled=True, target_kl=0.01, factor=2.0)
    resumed.load_state_dict(control.state_dict())
    assert resumed.scale == 0.5


@pytest.mark.parametrize(
    "settings", [{"target_kl": 0.0}, {"factor": 1.0}, {"min_scale": 0.0}, {"min_scale": 1.5}]
)
def test_bad_bounds_are_refused(settings):
    with pytest.raises(ValueError, match="KL step control needs"):
        KLStepControl(enabled=True, **settings)
