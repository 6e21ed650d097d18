"""The built-in calculators.

``calculator``: the model writes ``<tool_call>{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}
</tool_call>``, reads the result as a ``tool`` message, and goes on; a turn without a call ends the episode (its text
is the answer the rewards score).

``calculator_inline``: GSM8K's own calculator (Cobbe et al., 2021), for a model that has never seen a tool-call
format: a turn ends wherever the model writes ``=`` (``stop_strings``); if an arithmetic expression stands right
before it (``... has 964 + 494 =``), its value is written after it, inside the assistant's message, and the model
goes on from there (``... = 1458``); the value's tokens are context, not trained on. A turn that ends with the
end-of-turn token ends the episode. The model is told nothing: it writes such equations by itself.

The evaluator parses the expression with ``ast`` and computes it itself: numbers and ``+ - * / ( )`` only (unary signs
too), never ``eval``. Its cost is bounded by the input: at most ``MAX_CHARS`` characters and ``MAX_NODES`` syntax nodes,
no powers, and every intermediate value within ``MAX_ABS``, so no expression runs long or builds huge numbers.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from oumi_megatron.environments.base import EpisodeEnd, Observation
from oumi_megatron.environments.tool_calls import ToolCallParseError, parse_tool_call

MAX_CHARS = 200
MAX_NODES = 64
MAX_ABS = 1e15
TAIL_WINDOW = 4 * MAX_CHARS
"""How much of a turn's end ``trailing_expression`` reads: room for an expression of MAX_CHARS characters with its
thousands separators and dollar signs."""

TOOL_PROMPT = ('You can use a calculator. To compute something, write exactly <tool_call>{"name": "calculator", '
               '"arguments": {"expression": "EXPRESSION"}}</tool_call> with numbers and + - * / ( ) only, and wait for '
               'the result. For example: <tool_call>{"name": "calculator", "arguments": {"expression": "23*47"}}'
               '</tool_call> gets the result 1081. When you know the answer, reply without a tool call.')
"""What every prompt tells the model, as its system message (``CalculatorEnvironment.system_prompt``)."""


class CalculatorError(ValueError):
    """Why an expression was refused; the message is what the model is told."""


_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression``; ``CalculatorError`` for anything else (names, calls, powers,
    comparisons, too long, too large, division by zero)."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("the expression is empty")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"the expression does not parse ({e.msg})") from e
    for count, _ in enumerate(ast.walk(tree), 1):  # stops at the first node past the limit
        if count > MAX_NODES:
            raise CalculatorError(f"the expression has more than {MAX_NODES} parts")
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, complex or str
        return _bounded(node.value)  # type: ignore[arg-type]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp):
        a, b = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div):
            if b == 0:
                raise CalculatorError("division by zero")
            return _bounded(a // b if isinstance(a, int) and isinstance(b, int) and a % b == 0 else a / b)
        op = _BINARY.get(type(node.op))
        if op is not None:
            return _bounded(op(a, b))
    raise CalculatorError("only numbers and + - * / ( ) are allowed")


def _bounded(v: int | float) -> int | float:
    if abs(v) > MAX_ABS or v != v:  # v != v: NaN
        raise CalculatorError(f"a value passes {MAX_ABS:g}")
    return v


def format_value(v: int | float) -> str:
    """As the model should read it: integers whole, other values to 10 significant digits."""
    if isinstance(v, int) or float(v).is_integer():
        return str(int(v))
    return f"{v:.10g}"


class CalculatorEnvironment:
    """``calculator`` (environments/registry.py). One calculator call per turn; the episode ends at the first turn
    without a call (or at ``grpo.max_turns``)."""

    system_prompt = TOOL_PROMPT

    def start(self, row: dict[str, Any]) -> dict[str, int]:
        return {"tool_calls": 0, "tool_errors": 0}

    def step(self, state: dict[str, int], turn_text: str, turn_ids: list[int]) -> Observation | EpisodeEnd:
        try:
            call = parse_tool_call(turn_text)
        except ToolCallParseError as e:
            state["tool_calls"] += 1
            state["tool_errors"] += 1
            return Observation(f"error: {e}", error=True, parse_failure=True)
        if call is None:
            return EpisodeEnd(info=dict(state))
        state["tool_calls"] += 1
        if call.name != "calculator":
            state["tool_errors"] += 1
            return Observation(f"error: there is no tool {call.name!r}; the tool is 'calculator'", error=True)
        try:
            return Observation(format_value(evaluate(call.arguments.get("expression", ""))))
        except CalculatorError as e:
            state["tool_errors"] += 1
            return Observation(f"error: {e}", error=True)


_ARITHMETIC_TAIL = re.compile(r"[0-9.$\s()+\-*/\u00d7\u00f7]+$")
"""The longest run of digits, points, brackets and operators at a text's end (``\u00d7`` and ``\u00f7``: the signs
for times and divided by)."""
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def trailing_expression(text: str) -> str | None:
    """The arithmetic expression that ``text`` ends with, before its final ``=``, as ``evaluate`` takes it (thousands
    separators and ``$`` dropped, the signs for times and divided by as ``*`` and ``/``); None where there is none (no
    ``=`` at the end, a lone number, words). The longest tail that evaluates, so ``so 2 * (3 + 4) =`` is
    ``2 * (3 + 4)`` and ``(3 + 4) ... 5 * 2 =`` is ``5 * 2``."""
    body = text.rstrip()
    if not body.endswith("="):
        return None
    # only the text's end can hold an expression ``evaluate`` takes (MAX_CHARS, after separators and "$" go): the
    # search and the loop below then cost the same for any length of model text (the whole text made them quadratic)
    body = body[-TAIL_WINDOW:]
    match = _ARITHMETIC_TAIL.search(_THOUSANDS.sub("", body[:-1]))
    if match is None:
        return None
    tail = match.group(0).replace("$", "").replace("\u00d7", "*").replace("\u00f7", "/").rstrip()
    for start in range(len(tail)):
        # a start at a space gives the next start's candidate; one longer than MAX_CHARS cannot evaluate
        if tail[start].isspace() or len(tail) - start > MAX_CHARS:
            continue
        candidate = tail[start:]
        if not re.search(r"\d\s*[+\-*/]\s*[(\d.+\-]", candidate):  # needs an operation
            continue
        try:
            evaluate(candidate)
        except CalculatorError:
            continue
        return candidate
    return None


class InlineCalculatorEnvironment:
    """``calculator_inline`` (environments/registry.py): an expression before ``=`` gets its value; one per turn."""

    stop_strings = ("=",)
    observation_roles = ()  # its answers are text inside the assistant's message, never a message of a role

    def start(self, row: dict[str, Any]) -> dict[str, int]:
        return {"tool_calls": 0, "tool_errors": 0}

    def step(self, state: dict[str, int], turn_text: str, turn_ids: list[int]) -> Observation | EpisodeEnd:
        if not turn_text.rstrip().endswith("="):  # the turn ended with the end-of-turn token (or was cut)
            return EpisodeEnd(info=dict(state))
        expression = trailing_expression(turn_text)
        if expression is None:  # an "=" after words ("x = ..."): nothing to compute, the model goes on
            return Observation("", tool_call=False)
        state["tool_calls"] += 1
        value = format_value(evaluate(expression))  # trailing_expression returns only expressions that evaluate
        return Observation(f" {value}" if turn_text.rstrip().endswith(" =") else value)  # spaced as the "=" is
