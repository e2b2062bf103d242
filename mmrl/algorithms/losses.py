"""The policy losses whose maths lives in :mod:`mmrl.core_algos.policy_losses`: their default clip
ranges, the checks of their clip ratios and how the printed config describes them.

Checks and descriptions get the actor's loss section (``PolicyLossConfig``, ``worker.actor``).
"""

from __future__ import annotations

from typing import Any

from mmrl.algorithms.spec import PolicyLossSpec, register

MATHS = "mmrl.core_algos.policy_losses"
KEY = "worker.actor"


def _check_low_in_open_unit(loss: str):
    """The ratio is clipped below at 1 - clip_ratio_low, which must stay positive."""

    def check(options: Any) -> list[str]:
        low = options.clip_ratio_low
        if low is None or 0 < low < 1:
            return []
        return [
            f"{KEY}.clip_ratio_low={low} must lie in (0, 1) for loss_type={loss}: the ratio is clipped below "
            "at 1 - clip_ratio_low, which must stay positive (null: the loss's default)"
        ]

    return check


def _check_no_clip(loss: str, what: str):
    """A loss without ratio clip takes no clip ratios."""

    def check(options: Any) -> list[str]:
        if options.clip_ratio_low is None and options.clip_ratio_high is None:
            return []
        return [f"{KEY}.clip_ratio_low/clip_ratio_high: loss_type={loss} has {what}; set them to null"]

    return check


def _check_cispo(options: Any) -> list[str]:
    low = options.clip_ratio_low
    if low is None or 0 <= low <= 1:
        return []
    return [
        f"{KEY}.clip_ratio_low={low}: cispo bounds its weight below by 1 - clip_ratio_low, so it must lie "
        "in [0, 1] (0: weight >= 1; 1: no lower bound)"
    ]


def _describe_sapo(options: Any) -> str:
    return f"no clip (soft gate, tau_positive={options.tau_positive}, tau_negative={options.tau_negative})"


def _describe_kl_cov(options: Any) -> str:
    return (
        f"no ratio clip (|log-ratio| x {options.kl_cov_coef:g} on the {options.kl_cov_ratio:g} of the tokens "
        "with the highest covariance)"
    )


# PPO's 0.2 below, DAPO's clip-higher 0.28-0.3 above (EasyR1's defaults)
register(
    PolicyLossSpec(
        "ppo", f"{MATHS}:compute_ppo_policy_loss", _check_low_in_open_unit("ppo"), clip_defaults=(0.2, 0.3)
    )
)
# GSPO paper, sec. 5.1: a sequence ratio is a geometric mean of token ratios and sits within ~1e-3 of 1,
# so the token-level 0.2 would never clip; the paper clips at 3e-4 / 4e-4
for _name in ("gspo", "gspo_token"):
    register(
        PolicyLossSpec(
            _name,
            f"{MATHS}:compute_{_name}_policy_loss",
            _check_low_in_open_unit(_name),
            clip_defaults=(3e-4, 4e-4),
        )
    )
# MiniMax-M1: no lower bound on the IS weight (1 - 1.0 = 0, below every ratio), upper 1 + 4 = 5 as
# EasyR1's CISPO recipe. clip_ratio_low=0 gives EasyR1's weight >= 1 instead.
register(
    PolicyLossSpec("cispo", f"{MATHS}:compute_cispo_policy_loss", _check_cispo, clip_defaults=(1.0, 4.0))
)
# a soft gate instead of a clip
register(
    PolicyLossSpec(
        "sapo",
        f"{MATHS}:compute_sapo_policy_loss",
        _check_no_clip("sapo", "no clip (a soft gate, tuned by tau_positive/tau_negative)"),
        describe=_describe_sapo,
    )
)
# PPO's clip, plus the covariance clip (Cui et al. 2025)
register(
    PolicyLossSpec(
        "clip_cov",
        f"{MATHS}:compute_clip_cov_policy_loss",
        _check_low_in_open_unit("clip_cov"),
        clip_defaults=(0.2, 0.3),
    )
)
# no ratio clip: a KL penalty on the high-covariance tokens instead (Cui et al. 2025)
register(
    PolicyLossSpec(
        "kl_cov",
        f"{MATHS}:compute_kl_cov_policy_loss",
        _check_no_clip(
            "kl_cov",
            "no ratio clip (a KL penalty on the high-covariance tokens, tuned by kl_cov_ratio/kl_cov_coef)",
        ),
        describe=_describe_kl_cov,
    )
)
