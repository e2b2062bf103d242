"""Tools as drop-in files: every public function of a ``.py`` file becomes a tool the model may call.

``worker.rollout.multi_turn.tools=[crop.py, ...]``: each public function defined in such a file (no
leading underscore, not imported from elsewhere) is a tool. Its type hints and docstring make an
OpenAI-style function schema (:func:`tool_schema`), which the chat template renders for the model
(``tools=``). A parameter named ``row`` is not shown to the model: it receives the sample's row (its
``images`` at the data's resolution, decoded when first read, its decoded ``videos`` and ``audios``,
``ground_truth`` and other columns).

A tool returns text, a PIL image, :class:`VideoFrames`, :class:`Audio`, or a list mixing them
(:func:`tool_output` reads the return value). A tool runs behind a boundary (:class:`ToolRunner`): one
that raises, runs past its timeout, or returns something else answers the model with a short error
text (one of :data:`ERROR_KINDS`, counted in the metrics) and the trajectory goes on. The calls of a
batch run concurrently on a bounded number of threads; a hung call's thread is abandoned (Python
cannot stop a thread) and its slot given to the next call.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import queue
import threading
import time
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmrl.errors import UserInputError

# what can go wrong in a tool call (ToolCallRecord.error); each answers the model with a short text
ERROR_BAD_CALL = "bad_call"  # the model's call could not be parsed, names no tool, or has bad arguments
ERROR_RAISED = "raised"  # the tool raised an exception
ERROR_TIMEOUT = "timeout"  # the tool ran past multi_turn.tool_timeout
ERROR_BAD_RETURN = "bad_return"  # the tool returned something that is not text or media
ERROR_OVERSIZED = "oversized"  # the observation exceeded multi_turn.max_observation_tokens (cut)
ERROR_KINDS = (ERROR_BAD_CALL, ERROR_RAISED, ERROR_TIMEOUT, ERROR_BAD_RETURN, ERROR_OVERSIZED)

ROW_PARAMETER = "row"  # a tool parameter of this name gets the sample's row, not a model argument


class ToolFileError(UserInputError, ValueError):
    """A tool file that cannot be used; the message names the file and the function."""


@dataclass(frozen=True)
class VideoFrames:
    """Video frames a tool returns: ``[T, H, W, 3]`` uint8 RGB (or T PIL images), sampled at ``fps``."""

    frames: Any
    fps: float = 2.0

    def array(self) -> np.ndarray:
        if isinstance(self.frames, np.ndarray):
            return self.frames
        return np.stack([np.asarray(frame.convert("RGB")) for frame in self.frames])


@dataclass(frozen=True)
class Audio:
    """An audio clip a tool returns: a mono waveform and its sampling rate in Hz."""

    waveform: Any  # [N] float
    sampling_rate: int


@dataclass
class ToolOutput:
    """What one call answers the model: text and media (in the order they appear)."""

    text: str = ""
    images: list[Any] = field(default_factory=list)  # PIL images
    videos: list[VideoFrames] = field(default_factory=list)
    audios: list[Audio] = field(default_factory=list)
    error: str | None = None  # None, or one of ERROR_KINDS
    seconds: float = 0.0

    @property
    def order(self) -> tuple[str, ...]:
        """Media kinds in the order the observation shows them (images, then videos, then audio)."""
        return ("image",) * len(self.images) + ("video",) * len(self.videos) + ("audio",) * len(self.audios)

    def describe_media(self) -> tuple[str, ...]:
        """E.g. ``("image 64x48", "video 4 frames")``: what the call returned, for the log."""
        shown = [f"image {image.width}x{image.height}" for image in self.images]
        shown += [f"video {len(video.array())} frames" for video in self.videos]
        shown += [f"audio {len(np.asarray(clip.waveform)) / clip.sampling_rate:.2f}s" for clip in self.audios]
        return tuple(shown)


def error_output(kind: str, message: str, seconds: float = 0.0) -> ToolOutput:
    """The short error text the model reads instead of a result."""
    return ToolOutput(text=f"Error ({kind}): {message}", error=kind, seconds=seconds)


def tool_output(value: Any) -> ToolOutput:
    """A tool's return value as a :class:`ToolOutput`; ``TypeError`` for anything unusable."""
    from PIL import Image

    output = ToolOutput()
    texts = []
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, Image.Image):
            output.images.append(item.convert("RGB") if item.mode != "RGB" else item)
        elif isinstance(item, VideoFrames):
            frames = item.array()
            if frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) == 0:
                raise TypeError(f"video frames must be [T, H, W, 3] with T > 0, found shape {frames.shape}")
            output.videos.append(VideoFrames(frames.astype(np.uint8), item.fps))
        elif isinstance(item, Audio):
            waveform = np.asarray(item.waveform, dtype=np.float32)
            if waveform.ndim != 1 or len(waveform) == 0:
                raise TypeError(f"audio must be a non-empty mono waveform, found shape {waveform.shape}")
            output.audios.append(Audio(waveform, int(item.sampling_rate)))
        else:
            raise TypeError(
                f"a tool returns str, PIL.Image, VideoFrames, Audio or a list of them, found {type(item).__name__}"
            )
    output.text = "\n".join(texts)
    return output


# ---- schemas from type hints ------------------------------------------------------------------

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


def _json_type(hint: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one parameter's type hint."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        options = [arg for arg in args if arg is not type(None)]
        if len(options) == 1:
            return _json_type(options[0], where)
        return {"anyOf": [_json_type(arg, where) for arg in options]}
    if origin is typing.Literal:
        return {"type": _JSON_TYPES[type(args[0])], "enum": list(args)}
    if origin in (list, tuple, Sequence):
        schema: dict[str, Any] = {"type": "array"}
        if args and args[-1] is not Ellipsis:
            schema["items"] = _json_type(args[0], where)
        return schema
    if origin is dict:
        return {"type": "object"}
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    raise ToolFileError(
        f"{where}: type {hint!r} has no JSON schema (use str, int, float, bool, list, dict, Literal)"
    )


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """The description (text before ``Args:``) and each argument's line of a Google-style docstring."""
    lines = inspect.cleandoc(doc).splitlines()
    description, arguments, current = [], {}, None
    in_args = False
    for line in lines:
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
            continue
        if in_args and stripped.endswith(":") and not line.startswith(" "):  # Returns:, Raises:, ...
            in_args = False
            continue
        if not in_args:
            if not arguments:
                description.append(line)
            continue
        name, sep, text = stripped.partition(":")
        name = name.split("(")[0].strip()
        if sep and line.startswith(("    ", "\t")) and not line.startswith(("        ", "\t\t")) and name:
            current = name
            arguments[current] = text.strip()
        elif current and stripped:
            arguments[current] += " " + stripped
    return " ".join(" ".join(description).split()), arguments


def tool_schema(function: Callable[..., Any], where: str = "") -> dict[str, Any]:
    """The OpenAI function schema of ``function``: name, the docstring's description, and a JSON
    schema of its parameters from their type hints (arguments described in a Google-style ``Args:``
    section); parameters without a default are required; ``row`` is left out."""
    where = where or function.__name__
    if not function.__doc__:
        raise ToolFileError(
            f"{where}: a tool needs a docstring (the model reads it to decide when to call it)"
        )
    description, argument_docs = _docstring_parts(function.__doc__)
    hints = typing.get_type_hints(function)
    properties, required = {}, []
    for name, parameter in inspect.signature(function).parameters.items():
        if name == ROW_PARAMETER:
            continue
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ToolFileError(
                f"{where}: *args/**kwargs cannot be described to the model; name each parameter"
            )
        if name not in hints:
            raise ToolFileError(f"{where}: parameter '{name}' needs a type hint")
        properties[name] = _json_type(hints[name], f"{where}, parameter '{name}'")
        if name in argument_docs:
            properties[name]["description"] = argument_docs[name]
        if parameter.default is parameter.empty:
            required.append(name)
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": function.__name__, "description": description,
                                             "parameters": parameters}}  # fmt: skip


@dataclass(frozen=True)
class Tool:
    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]
    takes_row: bool  # has a `row` parameter

    def call(self, arguments: dict[str, Any], row: dict[str, Any]) -> Any:
        return self.function(**arguments, **({ROW_PARAMETER: row} if self.takes_row else {}))


def tool_from_function(function: Callable[..., Any], where: str = "") -> Tool:
    parameters = inspect.signature(function).parameters
    return Tool(function.__name__, function, tool_schema(function, where), ROW_PARAMETER in parameters)


def load_tools(paths: Sequence[str]) -> dict[str, Tool]:
    """The tools of the files ``paths`` (``worker.rollout.multi_turn.tools``), by name."""
    tools: dict[str, Tool] = {}
    for path in paths:
        if not os.path.isfile(path):
            raise ToolFileError(f"worker.rollout.multi_turn.tools: '{path}' is not a file")
        name = "mmrl_tools_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        functions = [
            value
            for key, value in vars(module).items()
            if not key.startswith("_") and inspect.isfunction(value) and value.__module__ == name
        ]
        if not functions:
            raise ToolFileError(f"{path}: no public function defined here (each becomes a tool)")
        for function in functions:
            if function.__name__ in tools:
                raise ToolFileError(
                    f"{path}: tool '{function.__name__}' is also defined in another tool file"
                )
            tools[function.__name__] = tool_from_function(function, f"{path}:{function.__name__}")
    return tools


# ---- running calls ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: a tool name and its arguments, or the reason it is unusable."""

    name: str
    arguments: Any
    error: str = ""  # why the call is unusable (malformed JSON, ...); "" for a usable call


class ToolRunner:
    """Runs tool calls concurrently (at most ``max_concurrency`` at once), each with ``timeout_s``."""

    def __init__(self, tools: dict[str, Tool], timeout_s: float = 30.0, max_concurrency: int = 8):
        self.tools = tools
        self.timeout_s = timeout_s
        self.max_concurrency = max(1, max_concurrency)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema for tool in self.tools.values()]

    def _check(self, call: ToolCall) -> ToolOutput | None:
        """An error output for a call that cannot run, else None."""
        if call.error:
            return error_output(ERROR_BAD_CALL, call.error)
        if call.name not in self.tools:
            return error_output(
                ERROR_BAD_CALL, f"no tool named '{call.name}' (tools: {', '.join(self.tools)})"
            )
        if not isinstance(call.arguments, dict):
            return error_output(ERROR_BAD_CALL, "the arguments must be a JSON object")
        schema = self.tools[call.name].schema["function"]["parameters"]
        missing = [name for name in schema["required"] if name not in call.arguments]
        unknown = [name for name in call.arguments if name not in schema["properties"]]
        if missing or unknown:
            problems = [f"missing {missing}" if missing else "", f"unknown {unknown}" if unknown else ""]
            return error_output(
                ERROR_BAD_CALL, f"arguments of '{call.name}': {', '.join(p for p in problems if p)}"
            )
        return None

    def _run_one(self, call: ToolCall, row: dict[str, Any]) -> ToolOutput:
        start = time.perf_counter()
        try:
            value = self.tools[call.name].call(call.arguments, row)
        except Exception as err:  # a tool's failure is the model's observation, never the run's end
            return error_output(
                ERROR_RAISED, f"{type(err).__name__}: {err}"[:500], time.perf_counter() - start
            )
        try:
            output = tool_output(value)
        except TypeError as err:
            return error_output(
                ERROR_BAD_RETURN, f"tool '{call.name}' returned {err}"[:500], time.perf_counter() - start
            )
        output.seconds = time.perf_counter() - start
        return output

    def prepare(self, call: ToolCall, row: dict[str, Any]) -> ToolOutput | Callable[[], ToolOutput]:
        """The error output of a call that cannot run, else the job that runs it (on a runner's thread)."""
        checked = self._check(call)
        if checked is not None:
            return checked
        return lambda: self._run_one(call, row)

    def answer(self, call: ToolCall, result: ToolOutput | object, seconds: float) -> ToolOutput:
        """The output of a job of :meth:`prepare` as a :class:`BoundedRunner` gave it: a timed-out job's
        is the timeout's error."""
        if result is TIMED_OUT:
            return error_output(
                ERROR_TIMEOUT, f"tool '{call.name}' took longer than {self.timeout_s:g}s", seconds
            )
        return result

    def run(self, calls: Sequence[tuple[ToolCall, dict[str, Any]]]) -> list[ToolOutput]:
        """The outputs of ``(call, row)`` pairs, in order."""
        prepared = [self.prepare(call, row) for call, row in calls]
        runnable = [index for index, job in enumerate(prepared) if not isinstance(job, ToolOutput)]
        outcomes = run_bounded([prepared[index] for index in runnable], self.timeout_s, self.max_concurrency)
        for index, (result, seconds) in zip(runnable, outcomes):
            prepared[index] = self.answer(calls[index][0], result, seconds)
        return prepared


TIMED_OUT = object()  # a BoundedRunner's result of a job that ran past its timeout


class BoundedRunner:
    """Jobs run on at most ``max_concurrency`` threads at once, submitted at any time, started in the
    order they came; a job still running ``timeout_s`` after its start gives :data:`TIMED_OUT` and is
    abandoned: its thread (a daemon) may finish later, unheard, and its slot goes to the next job. A
    job's exception is raised by :meth:`collect`: jobs catch their own (see :meth:`ToolRunner._run_one`).

    :meth:`submit` hands out a ticket; :meth:`collect` waits for results, which :meth:`result` gives
    by ticket."""

    def __init__(self, timeout_s: float, max_concurrency: int):
        self.timeout_s, self.max_concurrency = timeout_s, max(1, max_concurrency)
        self.queued: dict[int, Callable[[], Any]] = {}  # ticket -> job, in submission order
        self.running: dict[int, float] = {}  # ticket -> start time
        self.results: dict[int, tuple[Any, float]] = {}  # ticket -> (result, seconds)
        self.done: queue.Queue = queue.Queue()
        self.tickets = 0

    def submit(self, job: Callable[[], Any]) -> int:
        ticket, self.tickets = self.tickets, self.tickets + 1
        self.queued[ticket] = job
        self._start()
        return ticket

    def finished(self, ticket: int) -> bool:
        return ticket in self.results

    def result(self, ticket: int) -> tuple[Any, float]:
        """``(result, seconds)`` of a finished job (given once)."""
        return self.results.pop(ticket)

    def collect(self, block: bool = True, wait_s: float | None = None) -> None:
        """Take in the jobs that ended (or timed out) since the last call; ``block``: first waiting until
        one does (at most ``wait_s`` when given), unless none is running."""
        ended, until = len(self.results), None if wait_s is None else time.perf_counter() + wait_s
        while self.running:
            try:
                if block and len(self.results) == ended:  # nothing ended yet: wait for the first
                    deadline = min(self.running.values()) + self.timeout_s
                    if until is not None and until < deadline:
                        deadline, block = until, False  # given up after this wait
                    item = self.done.get(timeout=max(0.0, deadline - time.perf_counter()))
                else:
                    item = self.done.get_nowait()
            except queue.Empty:
                item = None
            if item is not None and item[0] in self.running:  # not abandoned after its timeout
                ticket, value, error = item
                if error is not None:
                    raise error
                self.results[ticket] = (value, time.perf_counter() - self.running.pop(ticket))
            now = time.perf_counter()
            for late, start in list(self.running.items()):
                if now - start >= self.timeout_s:
                    del self.running[late]
                    self.results[late] = (TIMED_OUT, now - start)
            self._start()
            if item is None and (not block or len(self.results) > ended):
                return

    def _start(self) -> None:
        while self.queued and len(self.running) < self.max_concurrency:
            ticket = next(iter(self.queued))
            job = self.queued.pop(ticket)
            self.running[ticket] = time.perf_counter()
            threading.Thread(
                target=self._work, args=(ticket, job), daemon=True, name=f"mmrl-tool-{ticket}"
            ).start()

    def _work(self, ticket: int, job: Callable[[], Any]) -> None:
        try:
            self.done.put((ticket, job(), None))
        except BaseException as err:  # handed to the collecting thread
            self.done.put((ticket, None, err))


def run_bounded(
    jobs: Sequence[Callable[[], Any]], timeout_s: float, max_concurrency: int
) -> list[tuple[Any, float]]:
    """``(result, seconds)`` of each job, run by a :class:`BoundedRunner` (its bounds, timeout and
    errors), once all have ended."""
    runner = BoundedRunner(timeout_s, max_concurrency)
    tickets = [runner.submit(job) for job in jobs]
    while runner.running:
        runner.collect()
    return [runner.result(ticket) for ticket in tickets]
