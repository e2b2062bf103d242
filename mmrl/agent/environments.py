"""Environments: tasks that are not function calls (a game, a GUI simulator, a simulated user).

An environment is a class in a drop-in file (``worker.rollout.multi_turn.environment=path.py:Class``)
with the :class:`~mmrl.agent.loop.Environment` interface: ``reset(row)`` gives the opening observation
and ``step(action_text)`` gives ``(observation, reward, done)``; observations may carry media. One
object is made per trajectory (the class is called without arguments). Each turn's reward lands in the
batch column ``turn_rewards``, which the reward function receives.

:class:`GuessTheNumber` is the built-in example: the row's ``ground_truth`` is a number, the model
guesses, and the environment answers "higher" or "lower" with a picture of the guess on a number line.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable
from typing import Any

from mmrl.agent.tools import ToolFileError


def load_environment(spec: str) -> Callable[[], Any]:
    """The environment class named by ``path.py:ClassName`` (or ``module:ClassName``)."""
    path, sep, name = spec.rpartition(":")
    if not sep:
        raise ToolFileError(f"worker.rollout.multi_turn.environment='{spec}' must be path.py:ClassName")
    if os.path.isfile(path):
        module_name = "mmrl_env_" + os.path.splitext(os.path.basename(path))[0]
        loader = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(path)
        except ImportError:
            raise ToolFileError(
                f"worker.rollout.multi_turn.environment: '{path}' is neither a file nor a module"
            ) from None
    environment = getattr(module, name, None)
    if environment is None or not all(hasattr(environment, method) for method in ("reset", "step")):
        raise ToolFileError(f"{spec}: no class '{name}' with reset(row) and step(action_text) methods")
    return environment


class GuessTheNumber:
    """Guess an integer between 0 and 100 (the row's ``ground_truth``) in few turns: each wrong guess is
    answered "higher" or "lower", with an image of a number line marking the guess (reward 0); the
    right one ends the episode (reward 1). A turn without a number is told how to answer (reward 0)."""

    def reset(self, row: dict[str, Any]) -> str:
        self.target = int(str(row["ground_truth"]).strip())
        return "Guess my number between 0 and 100. Answer with one number."

    def step(self, action_text: str) -> tuple[Any, float, bool]:
        numbers = re.findall(r"-?\d+", action_text)
        if not numbers:
            return "Answer with one number.", 0.0, False
        guess = int(numbers[-1])
        if guess == self.target:
            return "Correct.", 1.0, True
        return (
            [f"{guess} is wrong: go {'higher' if guess < self.target else 'lower'}.", _number_line(guess)],
            0.0,
            False,
        )


def _number_line(guess: int) -> Any:
    """A 112x28 picture of the line 0..100 with the guess marked."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (112, 28), "white")
    draw = ImageDraw.Draw(image)
    draw.line((6, 14, 106, 14), fill="black")
    x = 6 + max(0, min(100, guess))
    draw.rectangle((x - 2, 6, x + 2, 22), fill="red")
    return image
