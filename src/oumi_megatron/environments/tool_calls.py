"""The one tool-call format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the assistant's text.

It is the syntax the Hermes / Qwen2.5 / Qwen3 chat templates render tool calls in, and a plain tag elsewhere (the
task prompt teaches it: environments/calculator.py ``TOOL_PROMPT``). Only the first call of a turn is run (one tool
call per turn, as NeMo-RL's and verl's single-tool examples do); text after it is the model's and stays in the episode.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


class ToolCallParseError(ValueError):
    """The turn opened a tool call that does not parse; the message is what the model is told."""


def parse_tool_call(text: str) -> ToolCall | None:
    """The turn's first tool call; None when it has none. ``ToolCallParseError`` when it opens one that is unclosed,
    not JSON, or not ``{"name": str, "arguments": object}``."""
    match = _CALL.search(text)
    if match is None:
        if OPEN in text:
            raise ToolCallParseError(f"the tool call is not closed with {CLOSE}")
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError as e:
        raise ToolCallParseError(f"the tool call is not valid JSON ({e.msg} at character {e.pos})") from e
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(call.get("arguments", {}), dict):
        raise ToolCallParseError('a tool call is {"name": "<tool>", "arguments": {...}}')
    return ToolCall(call["name"], call.get("arguments", {}))
