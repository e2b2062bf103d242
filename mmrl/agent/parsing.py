"""Tool calls in a model turn, in the format of the model family's chat template.

Qwen2.5-VL and Qwen3-VL (and Qwen2.5-Omni) write each call as ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` (their chat templates' "hermes" format). A call whose JSON cannot be read becomes
a :class:`~mmrl.agent.tools.ToolCall` with its ``error`` set: the model is told, the trajectory goes on.
"""

from __future__ import annotations

import contextlib
import json
import re

from mmrl.agent.tools import ToolCall

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes_tool_calls(text: str) -> list[ToolCall]:
    """The ``<tool_call>`` blocks of ``text``, in order (an unclosed last block is read to the end)."""
    calls = []
    for match in _HERMES.finditer(text):
        body = match.group(1).strip()
        try:
            value = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(ToolCall("", None, f"the tool call is not valid JSON ({err.msg} at char {err.pos})"))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            calls.append(ToolCall("", None, 'a tool call is {"name": <tool>, "arguments": {...}}'))
            continue
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        calls.append(ToolCall(value["name"], arguments))
    return calls


# model_type -> the parser of its chat template's tool-call format
TOOL_CALL_PARSERS = {
    "qwen2_vl": parse_hermes_tool_calls,
    "qwen2_5_vl": parse_hermes_tool_calls,
    "qwen3_vl": parse_hermes_tool_calls,
    "qwen3_vl_moe": parse_hermes_tool_calls,
    "qwen2_5_omni": parse_hermes_tool_calls,
    "qwen2": parse_hermes_tool_calls,
    "qwen3": parse_hermes_tool_calls,
}


def tool_call_parser(model_type: str):
    """The tool-call parser of a model family (hermes, the Qwen format, for families not listed)."""
    return TOOL_CALL_PARSERS.get(model_type, parse_hermes_tool_calls)
