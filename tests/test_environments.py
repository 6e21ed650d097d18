"""Environments for multi-turn episodes (issue 46, the seam): the calculator's safe evaluator, the tool-call format,
observations rendered through the chat template, and the registry's errors. Pure Python: no model."""

from __future__ import annotations

import copy

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

        self.calls.append(([len(p) for p in prompts], params.max_new_tokens, n))
        out = []
        for p in prompts:
            group = []
            for _ in range(n):
                ids = self.turns[min(len(self.calls) - 1, len(self.turns) - 1)][:params.max_new_tokens]
                finished = self.EOS in ids
                ids = ids[:ids.index(self.EOS) + 1] if finished else ids
                group.append(Rollout(p, ids, finished, [-0.5] * len(ids)))
            out.append(group)
        return out


def _call(expression: str) -> list[int]:
    tok = build_byte_tokenizer()
    text = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'
    return tok(text, add_special_tokens=False)["input_ids"] + [_ScriptedPolicy.EOS]


def test_episodes_keep_the_policy_s_tokens_and_mask_the_observations() -> None:
    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.rollout.sampling import SamplingParams

    tok = build_byte_tokenizer()
    answer = tok("The answer is 84.", add_special_tokens=False)["input_ids"] + [_ScriptedPolicy.EOS]
    policy = _ScriptedPolicy([_call("12*7"), answer])
    groups, stats = run_episodes(policy, tok, build_environment("calculator"), [[1, 2, 3]], [{}],
                                 SamplingParams(max_new_tokens=400, eos_token_id=258), n=1, max_turns=4)
    (episode,) = groups[0]
    obs, _ = observation_ids(tok, Observation("84"))
    assert episode.completion_ids == _call("12*7") + obs + answer  # exactly the sampled ids, the observation between
    assert episode.loss_mask == [1] * len(_call("12*7")) + [0] * len(obs) + [1] * len(answer)
    assert episode.logprobs == [-0.5] * len(_call("12*7")) + [0.0] * len(obs) + [-0.5] * len(answer)
    assert episode.finished and stats.turns == [2] and stats.tool_calls == 1 and stats.tool_errors == 0
    assert stats.observation_tokens == len(obs) and [list(s) for s in stats.sample] == [["turn"], ["observation"], ["turn"]]
    # the second turn's prompt is the whole history, and its budget what is left
    assert policy.calls[1] == ([3 + len(_call("12*7")) + len(obs)], 400 - len(_call("12*7")) - len(obs), 1)


def test_episodes_end_at_max_turns_at_the_budget_and_on_environment_errors() -> None:
    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.rollout.sampling import SamplingParams

    tok = build_byte_tokenizer()
    calls = _call("1+1")
    always = _ScriptedPolicy([calls])  # calls the tool every turn
    groups, stats = run_episodes(always, tok, build_environment("calculator"), [[1], [2]], [{}, {}],
                                 SamplingParams(max_new_tokens=10_000), n=2, max_turns=3)
    assert stats.turns == [3] * 4 and all(not r.finished for g in groups for r in g)  # a call left unanswered
    assert stats.tool_calls == 4 * 3 and len(always.calls) == 3
    assert [[r.prompt_ids for r in g] for g in groups] == [[[1], [1]], [[2], [2]]]  # n per prompt, in the prompts' order
    budget = 2 * len(calls) + 20
    groups, stats = run_episodes(_ScriptedPolicy([calls]), tok, build_environment("calculator"), [[1]], [{}],
                                 SamplingParams(max_new_tokens=budget), n=1, max_turns=10)
    (cut,) = groups[0]
    assert len(cut.completion_ids) <= budget and not cut.finished and len(cut.loss_mask) == len(cut.completion_ids)

    class Broken:
        def start(self, row: dict) -> None:
            return None

        def step(self, state: None, turn_text: str, turn_ids: list[int]) -> Observation:
            raise RuntimeError("sandbox died")

    groups, stats = run_episodes(_ScriptedPolicy([calls]), tok, Broken(), [[1]], [{}], SamplingParams(max_new_tokens=500),
                                 n=2, max_turns=3)
    assert stats.failed == ["episode 0: RuntimeError: sandbox died", "episode 1: RuntimeError: sandbox died"]
    assert all(not r.finished for r in groups[0]) and stats.turns == [1, 1]
