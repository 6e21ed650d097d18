"""The built-in ``python`` and ``python_tests`` environments: the policy runs code and reads what it printed.

A turn runs code when it holds a ```` ```python ```` block (its last one) or a ``python`` tool call in the Hermes
format Qwen's chat templates know (``<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>``,
environments/tool_calls.py). The code runs in the sandbox (utils/sandbox.py, ``grpo.sandbox``: never in the trainer's
process) as a fresh program, like ``python main.py``: nothing of an earlier run is kept. The observation is its stdout,
its stderr (the traceback of an exception) and why it stopped if it did not end normally (a time limit, a signal);
fences in the program's output are broken up, so output cannot pass for the model's own code block. A turn with
neither ends the episode (the final answer). ``EpisodeEnd.info["code"]`` is the last program that defined the row's
``entry_point`` (else the last program): what the ``code_tests`` reward tests (grpo/code_tests.py).

``python_tests``: the same, and when the row has ``public_tests`` (statements such as ``assert_equal(add(2, 3), 5)``),
each program is loaded as a module (``__name__`` is ``solution``, so a ``__main__`` block does not run) and the
public tests run against it; the observation adds how many passed and the first failure. The episode ends when they
all pass, or at a turn without code. A row without ``public_tests`` is run as ``python`` runs it: HumanEval's tests,
say, are never shown to the model.
"""

from __future__ import annotations

import re
from typing import Any

from oumi_megatron.environments.base import EpisodeEnd, Observation
from oumi_megatron.environments.tool_calls import ToolCallParseError, parse_tool_call
from oumi_megatron.grpo.code_tests import CodeOutcome, run_tests
from oumi_megatron.utils.sandbox import Execution, Sandbox, SandboxError, shared

HEAD_CHARS = 2000
"""stdout is cut to its first this many characters, stderr to its last (a traceback ends with the error); the
rendering then cuts the observation to ``grpo.max_observation_tokens``."""

TOOL = ('{"type": "function", "function": {"name": "python", "description": "Run a Python program and see its stdout '
        'and stderr. Each run is a fresh program.", "parameters": {"type": "object", "properties": {"code": {"type": '
        '"string", "description": "The program"}}, "required": ["code"]}}}')
SYSTEM_PROMPT = (
    "You can run Python code. Write a program in a ```python code block and you will see what it prints (stdout, "
    "stderr, exceptions); each run is a fresh program, so define everything it uses. When you are done, give your "
    "final answer without running more code.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
    "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + TOOL
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
      "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
      "</tool_call>")
"""Qwen2.5's Hermes tool section (what its chat template writes for ``tools=[python]``), after the instructions."""

_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def turn_code(text: str) -> tuple[str | None, Observation | None]:
    """(the code a turn asks to run, the error observation when its tool call is refused): its ``python`` tool call,
    else its last closed ```python block; (None, None): neither."""
    try:
        call = parse_tool_call(text)
    except ToolCallParseError as e:
        return None, Observation(f"error: {e}", error=True, parse_failure=True)
    if call is not None:
        code = call.arguments.get("code")
        if call.name != "python":
            return None, Observation(f"error: there is no tool {call.name!r}; the tool is 'python'", error=True)
        if not isinstance(code, str) or not code.strip():
            return None, Observation('error: the python tool takes {"code": "<the program>"}', error=True)
        return code, None
    blocks = [b for b in _BLOCK.findall(text) if b.strip()]
    return (blocks[-1], None) if blocks else (None, None)


def _unfenced(text: str) -> str:
    return text.replace("```", "``\u200b`")


def execution_text(execution: Execution) -> str:
    """What the model reads of a run: stdout (its start), stderr (its end), and why it stopped."""
    parts = []
    out, err = execution.stdout, execution.stderr
    if out.strip():
        cut = f"\n... ({len(out) - HEAD_CHARS} more characters)" if len(out) > HEAD_CHARS else ""
        parts.append(out[:HEAD_CHARS].rstrip("\n") + cut)
    if err.strip():
        cut = f"... ({len(err) - HEAD_CHARS} characters before)\n" if len(err) > HEAD_CHARS else ""
        parts.append("stderr:\n" + cut + err[-HEAD_CHARS:].rstrip("\n"))
    if execution.stdout_truncated or execution.stderr_truncated:
        parts.append("(the output was cut at the sandbox's limit)")
    if execution.timed_out or execution.signal is not None:
        parts.append(f"error: {execution.problem}")
    elif execution.exit_code and not err.strip():
        parts.append(f"(exit status {execution.exit_code})")
    return _unfenced("\n".join(parts) if parts else "(no output)")


def tests_text(outcome: CodeOutcome) -> str:
    """What the model reads of a run against public tests."""
    parts = []
    if outcome.stdout.strip():
        parts.append(outcome.stdout[:HEAD_CHARS].rstrip("\n"))
    if outcome.failure in ("syntax_error", "no_code") or (outcome.failure == "exception" and not outcome.results):
        parts.append(f"error: {outcome.detail}")
    else:
        parts.append(f"tests: {outcome.passed} of {outcome.total} passed"
                     + (f"; the first failure ({outcome.failure.replace('_', ' ')}): {outcome.detail}"
                        if outcome.failure else ""))
    return _unfenced("\n".join(parts))


class PythonEnvironment:
    """``python`` (environments/registry.py)."""

    system_prompt = SYSTEM_PROMPT
    uses_sandbox = True

    def __init__(self, sandbox: Sandbox | None = None) -> None:
        self._sandbox = sandbox
        """None: the process's (utils/sandbox.py ``shared``, started by the run with ``grpo.sandbox``)."""

    @property
    def sandbox(self) -> Sandbox:
        return self._sandbox or shared()

    def start(self, row: dict[str, Any]) -> dict[str, Any]:
        return {"entry_point": row.get("entry_point"), "public_tests": list(row.get("public_tests") or []),
                "tool_calls": 0, "tool_errors": 0}

    def step(self, state: dict[str, Any], turn_text: str, turn_ids: list[int]) -> Observation | EpisodeEnd:
        code, refused = turn_code(turn_text)
        if refused is not None:
            state["tool_calls"] += 1
            state["tool_errors"] += 1
            return refused
        if code is None:
            return self._end(state)
        state["tool_calls"] += 1
        entry = state["entry_point"]
        if "code" not in state or not entry or re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
            state["code"] = code
        return self._run(state, code)

    def _run(self, state: dict[str, Any], code: str) -> Observation | EpisodeEnd:
        try:
            execution = self.sandbox.run(code)
        except SandboxError as e:  # the sandbox, not the program: the episode fails (runner.py), the run goes on
            raise RuntimeError(f"the sandbox failed: {e}") from e
        if not execution.ok:
            state["tool_errors"] += 1
        return Observation(execution_text(execution), error=not execution.ok)

    def _end(self, state: dict[str, Any], tool_call: bool = False) -> EpisodeEnd:
        info = {k: state[k] for k in ("tool_calls", "tool_errors")}
        if "code" in state:
            info["code"] = state["code"]
        return EpisodeEnd(info=info, tool_call=tool_call)


class PythonTestsEnvironment(PythonEnvironment):
    """``python_tests`` (environments/registry.py): ``python`` with the row's ``public_tests`` run on each program."""

    def _run(self, state: dict[str, Any], code: str) -> Observation | EpisodeEnd:
        tests = state["public_tests"]
        if not tests:
            return super()._run(state, code)
        try:
            (outcome,) = run_tests(self.sandbox, [code], [tests])
        except SandboxError as e:
            raise RuntimeError(f"the sandbox failed: {e}") from e
        if outcome.failure is None:
            state["code"] = code
            return self._end(state, tool_call=True)
        state["tool_errors"] += 1
        return Observation(tests_text(outcome), error=True)
