"""The one base class of every user error: a mistake in what the user gave mmrl (config, data, media,
templates, reward file, model folder, paths), as opposed to a bug or a failure during training.

Each layer raises its own subclass (``ConfigError``, ``DataError``, ``MediaError``, ``ModelPathError``,
``RewardFunctionError`` at load, ...) with a message naming the file, row or key and what to do; the
command line (:mod:`mmrl.trainer.main`) prints that message alone and exits with code 2. The classes
take only the message, so they pickle unchanged across Ray's process boundaries.
"""

from __future__ import annotations


class UserInputError(Exception):
    """A mistake in the user's input; the message names the file, row or key and the fix."""
