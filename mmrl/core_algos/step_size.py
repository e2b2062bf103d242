"""The update's step size in policy space: the learning rate scaled down while updates move the policy
too far (``worker.actor.kl_step_control``).

Adam takes steps of about the learning rate per parameter whatever the size of the signal. While a task
is being learnt those steps move the policy a little; once the policy is sharp (most groups solved,
dynamic sampling filling the step with the few groups it still gets wrong) the same steps can move it
far, and at a constant learning rate a policy that had solved the task is knocked off it again. A cosine
decay hides this by shrinking every late step; this controller shrinks the steps only while they move
the policy too far, measured in the quantity that matters: the KL divergence between the policy that
generated the step's rollouts and the one being trained (the classic adaptive step of PPO
implementations, e.g. rl_games' "adaptive" learning-rate schedule).
"""

from __future__ import annotations

from typing import Any


class KLStepControl:
    """The learning-rate scale of each step, from how far the previous step's updates moved the policy.

    A step makes several optimizer steps (mini-batches, epochs); from the second on, the update's forward
    sees how far the earlier ones moved the policy. ``kl`` is the step's ``actor/ppo_kl_k3``: the token
    mean over its mini-batches of the k3 estimate of ``KL(old || current)``. With target ``k*``, factor
    ``f`` and floor ``m``, after each step::

        scale <- max(scale / f, m)   if kl > 2 k*
        scale <- min(scale * f, 1)   if kl < k* / 2
        scale unchanged               otherwise

    :attr:`scale` (starting at 1) multiplies the scheduled learning rate of the next step's optimizer
    steps: the controller never raises the rate above the schedule. ``enabled=False``: the scale stays 1
    and the update is exactly the one without it.
    """

    def __init__(
        self, *, enabled: bool = False, target_kl: float = 0.01, factor: float = 1.5, min_scale: float = 0.1
    ):
        if enabled and (target_kl <= 0 or factor <= 1 or not 0 < min_scale <= 1):
            raise ValueError(
                f"KL step control needs target_kl > 0, factor > 1 and 0 < min_scale <= 1; got "
                f"target_kl={target_kl}, factor={factor}, min_scale={min_scale}"
            )
        self.enabled, self.target_kl, self.factor, self.min_scale = enabled, target_kl, factor, min_scale
        self.scale = 1.0

    def update(self, kl: float) -> None:
        """Steer after a step whose updates moved the policy by ``kl`` (nothing when not enabled, or when
        the step measured nothing: a NaN)."""
        if not self.enabled or kl != kl:
            return
        if kl > 2 * self.target_kl:
            self.scale = max(self.scale / self.factor, self.min_scale)
        elif kl < self.target_kl / 2:
            self.scale = min(self.scale * self.factor, 1.0)

    def metrics(self) -> dict[str, float]:
        """``actor/lr_scale``, the scale the step trained with (when enabled)."""
        return {"actor/lr_scale": self.scale} if self.enabled else {}

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
