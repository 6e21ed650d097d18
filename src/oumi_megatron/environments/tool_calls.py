"""The one tool-call format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the assistant's text.

It is the syntax the Hermes / Qwen2.5 / Qwen3 chat templates render tool calls in, and a plain tag elsewhere (the
task prompt teaches it: environments/calculator.py ``TOOL_PROMPT``). Only the first call of a turn is run (one tool
call per turn, as NeMo-RL's and verl's single-tool examples do); text after it is the model's and stays in the episode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALL_CHARS = 16_384
"""The longest tool call (its JSON) parsed: a longer one is refused before ``json.loads`` sees it."""


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


class ToolCallParseError(ValueError):
    """The turn opened a tool call that does not parse; the message is what the model is told."""


def parse_tool_call(text: str) -> ToolCall | None:
    """The turn's first tool call; None when it has none. ``ToolCallParseError`` when it opens one that is unclosed,
    too long, not JSON (nested too deep, a number too long included), or not ``{"name": str, "arguments": object}``.
    Linear in ``text``: the model writes it, so its cost must not grow faster than its length."""
    start = text.find(OPEN)
    if start < 0:
        return None
    end = text.find(CLOSE, start + len(OPEN))
    if end < 0:
        raise ToolCallParseError(f"the tool call is not closed with {CLOSE}")
    body = text[start + len(OPEN):end]
    if len(body) > MAX_CALL_CHARS:
        raise ToolCallParseError(f"the tool call is longer than {MAX_CALL_CHARS} characters")
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolCallParseError(f"the tool call is not valid JSON ({e.msg} at character {e.pos})") from e
    except (ValueError, RecursionError) as e:  # a number past Python's digit limit; nesting past the recursion limit
        raise ToolCallParseError(f"the tool call's JSON cannot be read ({type(e).__name__})") from e
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(call.get("arguments", {}), dict):
        raise ToolCallParseError('a tool call is {"name": "<tool>", "arguments": {...}}')
    return ToolCall(call["name"], call.get("arguments", {}))
