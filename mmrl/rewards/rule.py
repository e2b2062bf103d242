"""Reward-function plug-ins: load a user's Python file, call it, check what it returns.

A reward function is named by ``worker.reward.reward_function=path/to/file.py:function_name`` (the
function name defaults to ``main`` when the ``:function_name`` part is left out, as in EasyR1), with
extra keyword arguments from ``worker.reward.reward_function_kwargs``. EasyR1 reward files work
unchanged:

- module attribute ``REWARD_TYPE`` is ``"batch"`` (the default) or ``"sequential"``;
  ``REWARD_NAME`` is an optional display name;
- a batch function takes ``list[dict]`` and returns ``list[dict[str, float]]`` of the same length;
  a sequential function takes one ``dict`` and returns one ``dict[str, float]``;
- each input dict holds ``response`` (decoded text), ``response_length`` (tokens) and
  ``ground_truth``, plus the sample's other dataset columns (``data_source``, ``problem``, ...);
- each score dict holds ``overall`` (the reward used for training) and any number of sub-scores
  (``format``, ``accuracy``, ...); every key is logged as ``reward/<key>``.

This module has no Ray dependency: the Ray actor that runs reward functions in worker processes
wraps these functions. Load the function inside the process that calls it; a ``RewardFunction``
pickles as its file path, function name and kwargs and loads the file again when unpickled.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmrl.errors import UserInputError

REWARD_TYPES = ("batch", "sequential")
DEFAULT_FUNCTION_NAME = "main"  # EasyR1's default when the spec has no ``:function_name``
# Keys every reward input carries; dataset columns with these names are overridden by the rollout.
RESERVED_INPUT_KEYS = ("response", "response_length", "ground_truth")

_MAX_RESPONSE_CHARS = 200  # in error messages: head and tail of the response, where answers usually are
_MAX_VALUE_CHARS = 80


class RewardFunctionError(UserInputError, RuntimeError):
    """A reward file could not be loaded, raised an exception, or returned malformed scores.

    Takes only the message, so it pickles unchanged across process boundaries (Ray).
    """


@dataclass
class RewardFunction:
    """A loaded reward function; call it with a list of reward inputs to get one score dict per input.

    Attributes:
        path: absolute path of the reward file.
        name: name of the function inside the file.
        reward_type: ``"batch"`` (``fn(list[dict], **kwargs) -> list[dict]``) or ``"sequential"``
            (``fn(dict, **kwargs) -> dict``, called once per sample).
        fn: the user's function.
        kwargs: extra keyword arguments passed on every call (``reward_function_kwargs``).
        reward_name: the file's ``REWARD_NAME``, or the file name without ``.py``.
    """

    path: str
    name: str
    reward_type: str
    fn: Callable[..., Any] = field(repr=False)
    kwargs: dict[str, Any] = field(default_factory=dict)
    reward_name: str = ""
    # what the running call is scoring, for the message when it outlasts worker.reward.timeout_s
    in_progress: str = field(default="", repr=False, compare=False)

    def __call__(self, inputs: list[dict[str, Any]]) -> list[dict[str, float]]:
        """Scores ``inputs`` and returns one validated ``{key: float}`` dict (with ``overall``) per input."""
        if len(inputs) == 0:
            return []
        if self.reward_type == "batch":
            self.in_progress = (
                f"a batch of {len(inputs)} samples, the first {describe_reward_input(inputs[0])}"
            )
            raw_scores = self._call_batch(inputs)
        else:
            raw_scores = [self._call_one(sample, index, len(inputs)) for index, sample in enumerate(inputs)]
        return [self._validate_score(score, index) for index, score in enumerate(raw_scores)]

    def __reduce__(self):
        # The function lives in a module created at load time, which another process cannot import
        # by name; re-load the file there instead.
        return (_reload_reward_function, (self.path, self.name, dict(self.kwargs)))

    def __str__(self) -> str:
        return f"`{self.name}` from {self.path} (reward '{self.reward_name}', {self.reward_type})"

    def _call_batch(self, inputs: list[dict[str, Any]]) -> list[Any]:
        try:
            scores = self.fn(inputs, **self.kwargs)
        except Exception as err:
            raise RewardFunctionError(
                f"Reward function {self} raised {type(err).__name__} on a batch of {len(inputs)} samples: "
                f"{err}. First sample of the batch: {describe_reward_input(inputs[0])}. The chained "
                "traceback shows the failing line of the reward file."
            ) from err
        if not isinstance(scores, (list, tuple)):
            raise RewardFunctionError(
                f"Reward function {self} returned {type(scores).__name__}; a batch reward function must "
                f"return a list of {len(inputs)} score dicts, one per input, in order. If it scores one "
                'sample at a time, set REWARD_TYPE = "sequential" in the file.'
            )
        if len(scores) != len(inputs):
            raise RewardFunctionError(
                f"Reward function {self} returned {len(scores)} scores for a batch of {len(inputs)} "
                f"samples; expected exactly {len(inputs)}, one per input, in order."
            )
        return list(scores)

    def _call_one(self, sample: dict[str, Any], index: int, num_samples: int) -> Any:
        self.in_progress = f"sample {index} of {num_samples}: {describe_reward_input(sample)}"
        try:
            return self.fn(sample, **self.kwargs)
        except Exception as err:
            raise RewardFunctionError(
                f"Reward function {self} raised {type(err).__name__} on sample {index} of {num_samples}: "
                f"{err}. Input: {describe_reward_input(sample)}. The chained traceback shows the failing "
                "line of the reward file."
            ) from err

    def _validate_score(self, score: Any, index: int) -> dict[str, float]:
        if not isinstance(score, dict):
            hint = ""
            if isinstance(score, (list, tuple)) and self.reward_type == "sequential":
                hint = ' It returned a list: if it scores the whole batch, set REWARD_TYPE = "batch".'
            raise RewardFunctionError(
                f"Reward function {self} returned {type(score).__name__} for sample {index}; expected a "
                f"dict of scores with an 'overall' key, e.g. {{'overall': 1.0, 'accuracy': 1.0}}.{hint}"
            )
        if "overall" not in score:
            raise RewardFunctionError(
                f"Reward function {self} returned a score without 'overall' for sample {index}: found "
                f"keys {sorted(map(str, score))}. Every score dict needs 'overall', the reward trained on."
            )
        checked: dict[str, float] = {}
        for key, value in score.items():
            if not isinstance(key, str):
                raise RewardFunctionError(
                    f"Reward function {self} returned a score key {key!r} ({type(key).__name__}) for "
                    f"sample {index}; score keys must be strings (they become metric names)."
                )
            number = _as_real_number(value)
            if number is None:
                raise RewardFunctionError(
                    f"Reward function {self} returned a non-numeric score for sample {index}: "
                    f"{key!r} = {_short_repr(value, _MAX_VALUE_CHARS)} ({type(value).__name__}). Scores "
                    "must be real numbers (bool, int, float, numpy scalar or 0-d tensor)."
                )
            if not math.isfinite(number):
                raise RewardFunctionError(
                    f"Reward function {self} returned a non-finite score for sample {index}: "
                    f"{key!r} = {number}. Scores must be finite; check for division by zero or log(0)."
                )
            checked[key] = number
        return checked


def load_reward_function(spec: str, kwargs: dict[str, Any] | None = None) -> RewardFunction:
    """Imports the reward file named by ``spec`` (``path.py:function_name``) and returns its function.

    Relative paths are resolved against the current working directory. The file is imported as a
    fresh module under a name unique to its directory, so two files that share a base name do not
    collide. ``sys.path`` is left untouched (a folder holding ``math.py`` on it would shadow the
    standard library); instead the file is placed in a synthetic package over its own folder, so
    sibling helper modules are imported relatively: ``from .helpers import grade``.
    """
    if not spec or not spec.strip():
        raise RewardFunctionError(
            "No reward function configured: set worker.reward.reward_function=path/to/file.py:function_name."
        )
    path_text, separator, function_name = spec.strip().rpartition(":")
    if not separator:
        path_text, function_name = spec.strip(), DEFAULT_FUNCTION_NAME
    if not function_name.isidentifier():
        raise RewardFunctionError(
            f"Reward function spec {spec!r}: {function_name!r} is not a Python function name; "
            "expected path/to/file.py:function_name."
        )
    path = os.path.abspath(os.path.expanduser(path_text))
    if not os.path.isfile(path):
        raise RewardFunctionError(
            f"Reward function file {path_text!r} not found (looked for {path}, relative to the current "
            f"directory {os.getcwd()}). Give a path relative to the directory you launch from, or an "
            "absolute path."
        )
    module = _import_file_as_module(path)
    fn = getattr(module, function_name, None)
    if fn is None or not callable(fn):
        callables = sorted(
            name
            for name, value in vars(module).items()
            if callable(value)
            and not name.startswith("_")
            and getattr(value, "__module__", None) == module.__name__
        )
        found = "is not callable" if fn is not None else "is not defined"
        raise RewardFunctionError(
            f"Reward function `{function_name}` {found} in {path}. Functions defined there: "
            f"{callables or 'none'}. Set worker.reward.reward_function={path_text}:<one of them>."
        )
    reward_type = getattr(module, "REWARD_TYPE", "batch")
    if reward_type not in REWARD_TYPES:
        raise RewardFunctionError(
            f"Reward file {path} sets REWARD_TYPE = {reward_type!r}; expected one of {list(REWARD_TYPES)} "
            '("batch": the function takes the list of all inputs; "sequential": one input at a time).'
        )
    kwargs = dict(kwargs or {})
    _check_takes_inputs(fn, function_name, path, reward_type, kwargs)
    _check_kwargs_accepted(fn, function_name, path, kwargs)
    reward_name = str(getattr(module, "REWARD_NAME", os.path.splitext(os.path.basename(path))[0]))
    return RewardFunction(
        path=path, name=function_name, reward_type=reward_type, fn=fn, kwargs=kwargs, reward_name=reward_name
    )


def build_reward_inputs(
    responses: list[str],
    response_lengths: list[int],
    ground_truths: Sequence[Any],
    extra_columns: dict[str, Sequence[Any]] | None = None,
) -> list[dict[str, Any]]:
    """Builds one reward-input dict per response.

    Each dict holds ``response``, ``response_length`` (int) and ``ground_truth``, then the sample's
    value of every column in ``extra_columns`` (e.g. ``data_source``, ``problem``, ``images``).
    Columns named like the three fixed keys are skipped: the fixed keys come from the rollout.
    Numpy scalars and arrays (object-array columns) are turned into Python values.
    """
    num_samples = len(responses)
    columns: dict[str, Sequence[Any]] = {"response_length": response_lengths, "ground_truth": ground_truths}
    for name, values in (extra_columns or {}).items():
        if name not in RESERVED_INPUT_KEYS:
            columns[name] = values
    for name, values in columns.items():
        if len(values) != num_samples:
            raise ValueError(
                f"Reward input column {name!r} has {len(values)} values for {num_samples} responses; every "
                "column must hold one value per response (repeat prompt columns n times for n samples)."
            )
    inputs = []
    for index, response in enumerate(responses):
        sample: dict[str, Any] = {"response": str(response), "response_length": int(response_lengths[index])}
        sample["ground_truth"] = _to_python(ground_truths[index])
        for name, values in columns.items():
            if name not in sample:
                sample[name] = _to_python(values[index])
        inputs.append(sample)
    return inputs


def reduce_reward_metrics(scores: list[dict[str, float]]) -> dict[str, float]:
    """Mean of every score key over the samples that return it, logged as ``reward/<key>``."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for score in scores:
        for key, value in score.items():
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    return {f"reward/{key}": sums[key] / counts[key] for key in sums}


def describe_reward_input(sample: Any) -> str:
    """A short, one-line repr of a reward input for error messages (long values are cut)."""
    if not isinstance(sample, dict):
        return _short_repr(sample, _MAX_RESPONSE_CHARS)
    parts = []
    for key, value in sample.items():
        limit = _MAX_RESPONSE_CHARS if key == "response" else _MAX_VALUE_CHARS
        parts.append(f"{key!r}: {_short_repr(value, limit)}")
    return "{" + ", ".join(parts) + "}"


def _reload_reward_function(path: str, name: str, kwargs: dict[str, Any]) -> RewardFunction:
    return load_reward_function(f"{path}:{name}", kwargs)


# packages that reward files written for other frameworks import, and the mmrl extra that installs them
EXTRA_PACKAGES = {"mathruler": "mmrl[easyr1]", "pylatexenc": "mmrl[easyr1]"}  # EasyR1's example rewards


def _import_file_as_module(path: str) -> types.ModuleType:
    """Executes ``path`` as module ``<package>.<stem>``, the package being a synthetic one over its folder."""
    folder = os.path.dirname(path)
    package_name = "_mmrl_reward_" + hashlib.sha1(folder.encode()).hexdigest()[:12]
    if package_name not in sys.modules:
        package = types.ModuleType(package_name, f"Reward files in {folder}")
        package.__path__ = [folder]  # lets `from .helpers import x` find sibling files
        package.__spec__ = importlib.machinery.ModuleSpec(package_name, None, is_package=True)
        package.__spec__.submodule_search_locations = [folder]
        sys.modules[package_name] = package
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    module_name = f"{package_name}.{stem}"
    loader = importlib.machinery.SourceFileLoader(module_name, path)  # explicit: any file suffix loads
    module_spec = importlib.util.spec_from_file_location(module_name, path, loader=loader)
    module = importlib.util.module_from_spec(module_spec)
    # Registered before running so dataclasses, pickle and relative imports inside the file work.
    sys.modules[module_name] = module
    try:
        loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(module_name, None)
        hint = ""
        if isinstance(err, ModuleNotFoundError) and err.name:
            sibling = os.path.join(folder, err.name.split(".")[0] + ".py")
            if os.path.isfile(sibling):
                hint = f" {sibling} sits next to it: import it relatively, `from .{err.name} import ...`."
            elif err.name.split(".")[0] in EXTRA_PACKAGES:
                hint = f" Install it with `pip install '{EXTRA_PACKAGES[err.name.split('.')[0]]}'`."
            else:
                hint = f" Install `{err.name}` where the reward workers run, or drop that import."
        raise RewardFunctionError(
            f"Importing reward file {path} failed with {type(err).__name__}: {err}.{hint}"
        ) from err
    return module


def _check_takes_inputs(
    fn: Callable[..., Any], function_name: str, path: str, reward_type: str, kwargs: dict[str, Any]
) -> None:
    """Fails at load, not at the first reward, when ``fn`` cannot be called with the reward inputs as
    its first argument and ``kwargs`` (``reward_function_kwargs``) as keywords."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and some C callables have no signature: let the call decide
        return
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind in (*positional, inspect.Parameter.VAR_POSITIONAL) for p in parameters):
        required = [
            p.name
            for p in parameters[1:]
            if p.kind in positional and p.default is p.empty and p.name not in kwargs
        ]
        if not required:
            return
        problem = f"requires more than one positional argument ({', '.join(required)} after the inputs)"
    else:
        problem = "takes no positional argument"
    takes = "the list of reward inputs" if reward_type == "batch" else "one reward input dict"
    raise RewardFunctionError(
        f"Reward function `{function_name}` in {path} {problem}; a {reward_type} reward function takes "
        f"{takes} as its first argument, e.g. `def {function_name}(reward_inputs, **kwargs)`."
    )


def _check_kwargs_accepted(fn: Callable[..., Any], function_name: str, path: str, kwargs: dict) -> None:
    """Fails at load, not at the first reward, when ``kwargs`` name parameters ``fn`` does not take."""
    if not kwargs:
        return
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins and some C callables have no signature: let the call decide
        return
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return
    parameters = list(parameters)
    if parameters and parameters[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        parameters = parameters[1:]  # the first parameter receives the reward inputs
    accepted = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise RewardFunctionError(
            f"worker.reward.reward_function_kwargs has {unknown}, which `{function_name}` in {path} does "
            f"not take; its keyword parameters are {accepted}."
        )


def _as_real_number(value: Any) -> float | None:
    """``value`` as a float if it is a real number (numpy scalars and 0-d tensors included), else None."""
    if isinstance(value, numbers.Real):  # bool, int, float, Fraction, numpy int/float scalars
        return float(value)
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):  # 0-d array/tensor
        item = value.item()
        if isinstance(item, numbers.Real):
            return float(item)
    return None


def _to_python(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _short_repr(value: Any, limit: int) -> str:
    text = repr(value)
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} ...[{len(text) - 2 * half} chars]... {text[-half:]}"
