"""Code the model wrote, run against a row's tests in the sandbox (utils/sandbox.py): the ``code_tests`` reward, and
what the ``python_tests`` environment and HumanEval's scoring use.

A row's columns: ``tests`` (a list of Python statements, each one test, e.g. ``assert_equal(add(2, 3), 5)``;
HumanEval's are one statement each: its ``check`` function and ``check(entry_point)``), ``entry_point`` (the function
the tests call, optional: it picks the code block that defines it), ``code_prefix`` (put before the model's code,
e.g. the imports a HumanEval prompt starts with; optional). In a multi-turn episode the environment's last program
(``env_info["code"]``) is what is tested; otherwise the completion's code: its last fenced ``python`` block that defines
``entry_point`` (else its last fenced block; else the whole text if it looks like code).

One program per completion runs the tests in order, each on its own: a test that fails does not stop the next. The
program reports each test with a key it reads from stdin, on a copy of stdout taken before the model's code runs:
output the model's code prints cannot pass for a result, and an exit before the tests ended (``sys.exit``, ``os._exit``,
a crash) fails the tests that did not report. The model's code shares the interpreter with the tests, so a program that
searches the interpreter's frames for the key could forge results; ``assert_equal`` (what the generated tasks' tests
call) compares types exactly, so an object whose ``__eq__`` always says yes does not pass.

Failure kinds (the first test that did not pass decides; ``passed`` when all did): ``no_code``, ``syntax_error``,
``exception`` (at load, or a test raised something other than AssertionError, or the program exited early),
``timeout`` (the sandbox's wall or CPU limit), ``wrong_answer`` (an assertion failed), ``crashed`` (a signal: a
segfault, the memory or output limit).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from oumi_megatron.utils.sandbox import Execution, Sandbox, SandboxError

FAILURE_KINDS = ("no_code", "syntax_error", "exception", "timeout", "wrong_answer", "crashed")
REWARD_METRICS = ("passed", "tests_passed", *FAILURE_KINDS)
"""What ``code_tests`` reports per sample besides its reward: ``passed`` (every test), ``tests_passed`` (the fraction)
and one 0/1 column per failure kind (``reward/code_tests/<name>`` in the step's metrics: their means)."""

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_LOOKS_LIKE_CODE = re.compile(r"^(def |class |import |from \S+ import )", re.MULTILINE)

HARNESS = r'''
import json as _json, os as _os, sys as _sys


def _harness(code, prefix, tests):
    key = _sys.stdin.readline().strip()
    out = _os.dup(1)  # before the model's code runs: what it does to fd 1 and sys.stdout does not reach here

    def say(**kw):
        try:
            _os.write(out, ("\n" + key + _json.dumps(kw) + "\n").encode())
        except OSError:
            pass

    def why(e):  # an assertion's own message alone: assert_equal's "returned ..., expected ..."
        text = str(e) if isinstance(e, AssertionError) and str(e) else (f"{type(e).__name__}: {e}" if str(e)
                                                                          else type(e).__name__)
        return text[:300]

    _type, _isclose, _repr = type, __import__("math").isclose, repr

    def same(got, want):
        if _type(want) is float and _type(got) in (int, float):
            return _isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
        if _type(got) is not _type(want):
            return False
        if _type(want) in (list, tuple):
            return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))
        if _type(want) is dict:
            return got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
        return got == want

    def assert_equal(got, want):
        if not same(got, want):
            raise AssertionError(f"returned {_repr(got)[:200]}, expected {_repr(want)[:200]}")

    namespace = {"__name__": "solution"}
    try:
        compiled = compile(prefix + code, "solution.py", "exec")
    except (SyntaxError, ValueError) as e:
        say(stage="compile", kind="syntax_error", error=why(e))
        return
    try:
        exec(compiled, namespace)
    except BaseException as e:
        say(stage="load", kind="exception", error=why(e))
        return
    say(stage="load", kind="ok")
    namespace["assert_equal"] = assert_equal
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"test_{i}", "exec"), namespace)
            say(test=i, kind="pass")
        except AssertionError as e:
            say(test=i, kind="wrong_answer", error=why(e))
        except BaseException as e:
            say(test=i, kind="exception", error=why(e))
    say(done=True)


_harness(CODE, PREFIX, TESTS)
_sys.stdout.flush()
_os._exit(0)
'''
"""The program that tests one completion (``CODE``, ``PREFIX``, ``TESTS`` filled in as literals)."""


def extract_code(text: str, entry_point: str | None = None) -> str | None:
    """The code of a completion: its last fenced python block that defines ``entry_point`` (else its last fenced
    block; an unclosed last block counts), else the whole text if a line starts like code; None: none."""
    blocks = [b for b in _FENCE.findall(text) if b.strip()]
    if blocks:
        if entry_point:
            defining = [b for b in blocks if re.search(rf"^\s*(async\s+)?def\s+{re.escape(entry_point)}\s*\(", b, re.MULTILINE)]
            if defining:
                return defining[-1]
        return blocks[-1]
    return text if _LOOKS_LIKE_CODE.search(text) else None


def harness_program(code: str, tests: list[str], prefix: str = "") -> str:
    """The sandbox program that runs ``tests`` against ``prefix + code``."""
    prefix = prefix + "\n" if prefix and not prefix.endswith("\n") else prefix
    return HARNESS.replace("_harness(CODE, PREFIX, TESTS)", f"_harness({code!r}, {prefix!r}, {list(tests)!r})")


@dataclass
class CodeOutcome:
    """How one completion did on its tests."""

    total: int
    passed: int = 0
    failure: str | None = None
    """None when every test passed, else one of ``FAILURE_KINDS``."""
    detail: str = ""
    """Why, in one line (the failing test and its error)."""
    results: list[tuple[str, str]] = field(default_factory=list)
    """Per test that reported: (kind, error)."""
    stdout: str = ""
    """What the program printed (the results' lines removed)."""
    stderr: str = ""

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    def metrics(self) -> dict[str, float]:
        return {"passed": float(self.failure is None), "tests_passed": self.fraction,
                **{kind: float(self.failure == kind) for kind in FAILURE_KINDS}}


def outcome_of(execution: Execution, key: str, tests: list[str]) -> CodeOutcome:
    """The tests' outcome from the program's execution (``key``: what its result lines start with)."""
    reports, lines = [], []
    for line in execution.stdout.split("\n"):
        if line.startswith(key):
            try:
                reports.append(json.loads(line[len(key):]))
                continue
            except json.JSONDecodeError:
                pass
        lines.append(line)
    out = CodeOutcome(total=len(tests), stdout="\n".join(lines).strip("\n"), stderr=execution.stderr)
    stage = next((r for r in reports if "stage" in r), None)
    if stage is None or stage["kind"] != "ok":
        if stage is not None:
            out.failure, out.detail = stage["kind"], stage.get("error", "")
        else:
            out.failure, out.detail = _ended_early(execution, "before its code was loaded")
        return out
    by_test = {r["test"]: (r["kind"], r.get("error", "")) for r in reports if "test" in r}
    for i, test in enumerate(tests):
        kind, error = by_test.get(i) or (None, "")
        if kind is None:
            kind, error = _ended_early(execution, f"before test {i + 1} of {len(tests)} ended")
        out.results.append((kind, error))
        if kind == "pass":
            out.passed += 1
        elif out.failure is None:
            out.failure, out.detail = kind, f"{_short(test)}: {error}" if error else _short(test)
    return out


def _ended_early(execution: Execution, when: str) -> tuple[str, str]:
    if execution.timed_out:
        return "timeout", f"{execution.problem} {when}"
    if execution.signal is not None:
        return "crashed", f"{execution.problem} {when}"
    return "exception", f"the program exited (status {execution.exit_code}) {when}"


def _short(test: str) -> str:
    test = test.strip()
    return test if len(test) <= 160 and "\n" not in test else test.splitlines()[-1][:160]


def run_tests(sandbox: Sandbox, codes: list[str | None], tests: list[list[str]],
              prefixes: list[str] | None = None) -> list[CodeOutcome]:
    """Each of ``codes`` against its ``tests`` (``prefixes``: what goes before each), all at once on ``sandbox``'s
    servers. ``None`` code: ``no_code``. A program whose server failed runs once more; a second failure of the sandbox
    raises ``SandboxError``."""
    todo = [i for i, code in enumerate(codes) if code is not None and code.strip()]
    keys = [secrets.token_hex(16) for _ in todo]
    programs = [harness_program(codes[i] or "", tests[i], (prefixes or [""] * len(codes))[i] or "") for i in todo]
    executions = sandbox.run_many(programs, stdins=[k + "\n" for k in keys])
    out = [CodeOutcome(total=len(t), failure="no_code", detail="no code found in the completion") for t in tests]
    for i, key, program, execution in zip(todo, keys, programs, executions):
        if isinstance(execution, SandboxError):  # its server failed (it is replaced): once more, then the error stands
            execution = sandbox.run(program, stdin=key + "\n")
        out[i] = outcome_of(execution, key, tests[i])
    return out


def _text(completion: Any) -> str:
    """A completion as text (TRL's conversational form: its last message's content)."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def _as_list(value: Any, n: int) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value] * n


def code_tests(completions: list[Any], tests: list[list[str]], entry_point: list[str | None] | None = None,
               code_prefix: list[str | None] | None = None, env_info: list[dict[str, Any] | None] | None = None,
               score: str = "fraction", **kwargs: Any) -> Any:
    """The ``code_tests`` reward: each completion's code against its row's ``tests`` in the process's sandbox.
    ``score``: ``fraction`` (the fraction of tests passed, the default) or ``all`` (1 when every test passed, else 0).
    Returns the rewards and, per sample, ``REWARD_METRICS`` (grpo/reward_metrics.py ``RewardsAndMetrics``)."""
    from oumi_megatron.grpo.reward_metrics import RewardsAndMetrics
    from oumi_megatron.utils.sandbox import shared

    if score not in ("fraction", "all"):
        raise ValueError(f"code_tests: score must be 'fraction' or 'all', got {score!r}")
    n = len(completions)
    entries, prefixes, infos = _as_list(entry_point, n), _as_list(code_prefix, n), _as_list(env_info, n)
    codes = []
    for text, entry, info in zip(map(_text, completions), entries, infos):
        code = (info or {}).get("code") if isinstance(info, dict) else None
        codes.append(code if code is not None else extract_code(text, entry))
    for i, row_tests in enumerate(tests):
        if not isinstance(row_tests, (list, tuple)) or not row_tests or not all(isinstance(t, str) for t in row_tests):
            raise ValueError(f"code_tests: row {i}'s tests must be a non-empty list of Python statements, got "
                             f"{str(row_tests)[:80]!r}")
    outcomes = run_tests(shared(), codes, [list(t) for t in tests], prefixes)
    rewards = [o.fraction if score == "fraction" else float(o.failure is None) for o in outcomes]
    return RewardsAndMetrics(rewards, {m: [o.metrics()[m] for o in outcomes] for m in REWARD_METRICS})


code_tests.reward_metrics = REWARD_METRICS  # type: ignore[attr-defined]
code_tests.uses_sandbox = True  # type: ignore[attr-defined]

try:  # Oumi's registry, where Oumi is installed (RewardComputer finds it there by name; validation lists it)
    from oumi.core.registry import RegistryType, register

    register("code_tests", RegistryType.REWARD_FUNCTION)(code_tests)
except ImportError:  # pragma: no cover - engine-only machines: BUILTIN_REWARDS (grpo/rewards.py) has it
    pass
