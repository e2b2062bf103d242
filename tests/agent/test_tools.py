"""Tools as drop-in files: schemas from type hints, every media kind a tool returns, and the calls that
go wrong (raising, hanging, returning something unusable, malformed JSON) answered and counted."""

from __future__ import annotations

import threading
import time
from typing import Literal

import numpy as np
import pytest
from PIL import Image

from mmrl.agent.parsing import parse_hermes_tool_calls
from mmrl.agent.tools import (
    ERROR_BAD_CALL,
    ERROR_BAD_RETURN,
    ERROR_KINDS,
    ERROR_RAISED,
    ERROR_TIMEOUT,
    TIMED_OUT,
    Audio,
    BoundedRunner,
    ToolCall,
    ToolFileError,
    ToolRunner,
    VideoFrames,
    load_tools,
    tool_schema,
)

TOOL_FILE = '''
from PIL import Image
import numpy as np
from mmrl.agent.tools import Audio, VideoFrames
from os.path import join  # imported: not a tool


def zoom(x: int, y: int, size: int = 16, row: dict = None) -> Image.Image:
    """Crop a region of the prompt image at full resolution.

    Args:
        x: left edge in pixels
        y: top edge in pixels
        size: side of the square region
    """
    return row["images"][0].crop((x, y, x + size, y + size))


def clip(seconds: float) -> list:
    """Frames and sound of the scene, with a caption."""
    frames = VideoFrames(np.zeros((4, 28, 28, 3), np.uint8), fps=2.0)
    return ["the scene", frames, Audio(np.zeros(int(16000 * seconds)), 16000)]


def _helper():
    pass
'''


def test_schemas_from_type_hints_and_docstrings():
    def search(query: str, limit: int | None = None, mode: Literal["fast", "exact"] = "fast",
               tags: list[str] = (), scale: float = 1.0, exact: bool = False, row: dict = None) -> str:  # fmt: skip
        """Search the catalogue.

        Args:
            query: what to look for,
                in plain words
            limit: most results
        Returns:
            the matches
        """

    assert tool_schema(search) == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the catalogue.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "what to look for, in plain words"},
                    "limit": {"type": "integer", "description": "most results"},
                    "mode": {"type": "string", "enum": ["fast", "exact"]},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "scale": {"type": "number"},
                    "exact": {"type": "boolean"},
                },
                "required": ["query"],
            },
        },
    }

    def untyped(x) -> str:
        """No hint."""

    with pytest.raises(ToolFileError, match="parameter 'x' needs a type hint"):
        tool_schema(untyped)


@pytest.fixture
def tool_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOL_FILE)
    return str(path)


def test_a_file_s_public_functions_become_tools_and_return_each_media_kind(tool_file):
    tools = load_tools([tool_file])
    assert list(tools) == ["zoom", "clip"]
    assert (
        tools["zoom"].takes_row and "row" not in tools["zoom"].schema["function"]["parameters"]["properties"]
    )
    image = Image.fromarray(np.arange(64 * 48 * 3, dtype=np.uint8).reshape(48, 64, 3))
    runner = ToolRunner(tools, timeout_s=5)
    zoomed, clipped = runner.run(
        [
            (ToolCall("zoom", {"x": 8, "y": 4, "size": 10}), {"images": [image]}),
            (ToolCall("clip", {"seconds": 0.5}), {}),
        ]
    )
    assert zoomed.error is None and zoomed.images[0].size == (10, 10) and zoomed.text == ""
    assert np.array_equal(np.asarray(zoomed.images[0]), np.asarray(image)[4:14, 8:18])
    assert clipped.text == "the scene" and clipped.order == ("video", "audio")
    assert (
        clipped.videos[0].array().shape == (4, 28, 28, 3) and clipped.audios[0].waveform.dtype == np.float32
    )
    assert clipped.describe_media() == ("video 4 frames", "audio 0.50s")


def _tools(*functions):
    from mmrl.agent.tools import tool_from_function

    return {function.__name__: tool_from_function(function) for function in functions}


def test_failures_answer_the_model_and_never_end_the_run():
    release = threading.Event()

    def fails(x: int) -> str:
        """Always raises."""
        raise RuntimeError("disk on fire")

    def hangs(x: int) -> str:
        """Never returns in time."""
        release.wait(10)
        return "late"

    def malformed(x: int) -> object:
        """Returns an unusable value."""
        return {"not": "text"}

    def fine(x: int) -> str:
        """Echoes."""
        return f"got {x}"

    # 2 s: plenty for the quick tools on a loaded machine, far less than hangs' 10
    runner = ToolRunner(_tools(fails, hangs, malformed, fine), timeout_s=2.0, max_concurrency=2)
    calls = [ToolCall("fails", {"x": 1}), ToolCall("hangs", {"x": 1}), ToolCall("malformed", {"x": 1}),
             ToolCall("fine", {"x": 2}), ToolCall("nope", {}), ToolCall("fine", {"y": 1}),
             *parse_hermes_tool_calls('<tool_call>{"name": "fine", "arguments": {"x": 1,}}</tool_call>')]  # fmt: skip
    start = time.perf_counter()
    outputs = runner.run([(call, {}) for call in calls])
    release.set()
    assert time.perf_counter() - start < 8  # the hung call was abandoned at its timeout
    kinds = [output.error for output in outputs]
    assert kinds == [
        ERROR_RAISED,
        ERROR_TIMEOUT,
        ERROR_BAD_RETURN,
        None,
        ERROR_BAD_CALL,
        ERROR_BAD_CALL,
        ERROR_BAD_CALL,
    ]
    assert set(kinds) - {None} <= set(ERROR_KINDS)
    assert outputs[0].text == "Error (raised): RuntimeError: disk on fire"
    assert "longer than 2s" in outputs[1].text and outputs[3].text == "got 2"
    assert "no tool named 'nope'" in outputs[4].text and "missing ['x']" in outputs[5].text
    assert "not valid JSON" in outputs[6].text


def test_calls_run_concurrently_up_to_the_bound():
    active, most = [0], [0]
    lock = threading.Lock()
    barrier = threading.Barrier(3, timeout=5)

    def wait(x: int) -> str:
        """Waits for two others."""
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        barrier.wait()  # passes only when three run at once
        with lock:
            active[0] -= 1
        return "ok"

    outputs = ToolRunner(_tools(wait), timeout_s=5, max_concurrency=3).run(
        [(ToolCall("wait", {"x": i}), {}) for i in range(6)]
    )
    assert [output.text for output in outputs] == ["ok"] * 6 and most[0] == 3


def test_a_bounded_runner_takes_jobs_while_others_run_and_hands_out_each_as_it_ends():
    """Jobs submitted at any time start in order within the bound; ``collect`` waits for the first to
    end (or time out) and takes in all that ended; ``block=False`` waits for none; an error is raised."""
    gates = [threading.Event() for _ in range(3)]
    started = []

    def job(index: int):
        def run() -> str:
            started.append(index)
            gates[index].wait(10)
            return f"job {index}"

        return run

    runner = BoundedRunner(timeout_s=5, max_concurrency=2)
    first, second = runner.submit(job(0)), runner.submit(job(1))
    third = runner.submit(job(2))  # queued: two run already
    runner.collect(block=False)
    assert not any(runner.finished(ticket) for ticket in (first, second, third)) and 2 not in started
    gates[1].set()
    runner.collect()  # waits for job 1; job 2 takes its slot
    assert runner.finished(second) and not runner.finished(first)
    assert runner.result(second)[0] == "job 1"
    gates[2].set()
    runner.collect()
    assert runner.finished(third) and not runner.finished(first)
    late = runner.submit(lambda: time.sleep(10))  # submitted while job 0 still runs
    gates[0].set()
    runner.collect()
    assert runner.result(first)[0] == "job 0" and not runner.finished(late)

    quick = BoundedRunner(timeout_s=0.2, max_concurrency=1)
    hung = quick.submit(lambda: time.sleep(10))
    quick.collect()  # the hung job's timeout ends the wait
    result, seconds = quick.result(hung)
    assert result is TIMED_OUT and 0.2 <= seconds < 5

    def fails() -> None:
        raise ValueError("the job's own")

    broken = BoundedRunner(timeout_s=5, max_concurrency=1)
    broken.submit(fails)
    with pytest.raises(ValueError, match="the job's own"):
        broken.collect()


def test_bad_media_returns_are_errors():
    def empty_video(x: int) -> VideoFrames:
        """An empty clip."""
        return VideoFrames(np.zeros((0, 8, 8, 3), np.uint8))

    def stereo(x: int) -> Audio:
        """Two channels."""
        return Audio(np.zeros((2, 100)), 16000)

    outputs = ToolRunner(_tools(empty_video, stereo)).run(
        [(ToolCall("empty_video", {"x": 1}), {}), (ToolCall("stereo", {"x": 1}), {})]
    )
    assert [output.error for output in outputs] == [ERROR_BAD_RETURN] * 2


def test_hermes_parsing():
    text = 'Let me look.\n<tool_call>\n{"name": "zoom", "arguments": {"x": 1, "y": 2}}\n</tool_call>\n' \
           '<tool_call>{"name": "clip", "arguments": "{\\"seconds\\": 1}"}</tool_call><tool_call>[1]</tool_call>'  # fmt: skip
    calls = parse_hermes_tool_calls(text)
    assert calls[:2] == [ToolCall("zoom", {"x": 1, "y": 2}), ToolCall("clip", {"seconds": 1})]
    assert calls[2].error and parse_hermes_tool_calls("The answer is 4.") == []
    assert parse_hermes_tool_calls('<tool_call>{"name": "a", "arguments": {}}')[0] == ToolCall("a", {})


def test_the_shipped_example_tool_file():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "tools" / "zoom.py"
    tools = load_tools([str(path)])
    assert tools["zoom"].schema["function"]["parameters"]["required"] == ["x", "y"]
    image = Image.new("RGB", (200, 100))
    [output] = ToolRunner(tools).run([(ToolCall("zoom", {"x": 0.5, "y": 0.0}), {"images": [image]})])
    assert (
        output.error is None
        and output.images[0].size == (25, 25)
        and output.text == "region (100, 0, 125, 25)"
    )
