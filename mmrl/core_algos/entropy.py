"""The entropy bonus's coefficient: fixed, or steered towards a target entropy (Skywork-OR1)."""

from __future__ import annotations

from typing import Any


class EntropyController:
    """The entropy coefficient of each step (Skywork-OR1, Zhou et al. 2025, "adaptive entropy control").

    ``value`` starts at ``initial_coeff``. After a step whose entropy (nats per response token) was
    ``H``, with target ``H*``, step ``delta`` and bounds ``[low, high]``::

        value <- clip(value + delta, low, high)   if H < H*
        value <- clip(value - delta, low, high)   otherwise
        active <- H < H*

    :attr:`coefficient`, the weight the next update gives the entropy bonus, is ``value`` while
    ``active`` and 0 otherwise: the bonus only lifts an entropy that has fallen below the target and
    never pushes one above it, and the coefficient grows only as long as the entropy stays low. Before
    the first update ``active`` is True (``initial_coeff`` applies). ``enabled=False`` keeps
    ``initial_coeff`` for good (a fixed bonus).
    """

    def __init__(
        self,
        initial_coeff: float,
        *,
        enabled: bool = False,
        target_entropy: float = 0.2,
        delta: float = 1e-4,
        low: float = 0.0,
        high: float = 5e-3,
    ):
        if enabled and (delta <= 0 or low < 0 or low > high or target_entropy <= 0):
            raise ValueError(
                f"adaptive entropy control needs delta > 0, 0 <= low <= high and target_entropy > 0; got "
                f"delta={delta}, low={low}, high={high}, target_entropy={target_entropy}"
            )
        self.value = float(initial_coeff)
        self.active = True
        self.enabled = enabled
        self.target_entropy, self.delta, self.low, self.high = target_entropy, delta, low, high

    @property
    def coefficient(self) -> float:
        """The entropy bonus's weight for the next update."""
        return self.value if self.active else 0.0

    def update(self, entropy: float) -> None:
        """Steer after a step whose mean token entropy was ``entropy`` (nothing when not enabled)."""
        if not self.enabled:
            return
        below = entropy < self.target_entropy
        step = self.delta if below else -self.delta
        self.value = min(max(self.value + step, self.low), self.high)
        self.active = below

    def metrics(self) -> dict[str, float]:
        """``actor/entropy_coeff`` (the applied weight) and, when adaptive, its controller's state."""
        if not self.enabled:
            return {"actor/entropy_coeff": self.coefficient}
        return {
            "actor/entropy_coeff": self.coefficient,
            "actor/entropy_coeff_value": self.value,
            "actor/entropy_target": self.target_entropy,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "active": self.active}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value, self.active = float(state["value"]), bool(state["active"])
