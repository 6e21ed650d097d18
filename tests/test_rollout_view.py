"""``oumi-megatron rollouts``: dumps written by the trainer's own writer (trainer/rollout_dump.py ``RolloutDump``, the
tiny model's tokenizer) read back as text, JSON lines and an HTML page; the selection flags; a clear error and exit 1
for every path or line it cannot read. (A real multi-turn run's dump is read in tests/test_environments.py.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from oumi_megatron.cli import main
from oumi_megatron.rollout.sample import Sample, SampleStatus
from oumi_megatron.trainer.rollout_dump import RolloutDump


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _ids(tokenizer, text: str) -> list[int]:  # noqa: ANN001
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer) -> Path:  # noqa: ANN001
    """A run's output_dir with dumps of steps 2 and 4 (grpo.rollout_dump_steps: 2), DP ranks 0 and 1: a single-turn
    sample and a multi-turn episode (a turn, an observation, a turn) each, the episode of step 4 without a reward."""
    out = tmp_path_factory.mktemp("run")
    prompt = _ids(tokenizer, "<|im_start|>user\nWhat is 17 + 25? <b>bold</b><|im_end|>\n<|im_start|>assistant\n")
    turn1, obs, turn2 = _ids(tokenizer, "calc(17+25)"), _ids(tokenizer, "\n<tool>42</tool>\n"), _ids(tokenizer, "42<|im_end|>")
    episode = turn1 + obs + turn2
    for step in (1, 3):  # RolloutDump counts steps from 0
        for rank in (0, 1):
            dump = RolloutDump(out / "rollouts", every=2, writes=True)
            single = Sample(prompt, _ids(tokenizer, "It is 42"), 0, SampleStatus.TRUNCATED,
                            logprobs=[-0.1 * (i + 1) for i in range(8)], turns=1, reward=0.25 + rank)
            multi = Sample(prompt, episode, 0, SampleStatus.FINISHED, logprobs=[-0.5] * len(episode),
                           loss_mask=[1] * len(turn1) + [0] * len(obs) + [1] * len(turn2), turns=2,
                           reward=None if step == 3 else 1.0)
            dump.add(step, tokenizer, [single, multi])
            assert dump.write(step, rank) == out / "rollouts" / f"step_{step + 1:06d}_rank_{rank:05d}.jsonl"
    return out


def _cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    code = main(["rollouts", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_latest_step_as_text_with_its_turns_and_observations(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _cli(capsys, str(run_dir))
    assert code == 0
    assert out.startswith("4 sample(s) of step(s) 4, mean reward 0.750 (dumped steps: 2, 4; --step N or --step all for others)")
    assert "step 4, DP rank 1, sample 0: reward 1.25, 1 turn(s), cut at max_completion_length, 8 completion tokens" in out
    assert "step 4, DP rank 0, sample 1: no reward (skipped or the episode failed), 2 turn(s), finished" in out
    assert "  │ <|im_start|>user\n  │ What is 17 + 25? <b>bold</b><|im_end|>" in out  # the prompt as the model saw it
    assert "policy turn 1 (tokens 0-10, trained)\n  │ calc(17+25)\nobservation 1 (tokens 11-27, not trained)" in out
    assert "  │ <tool>42</tool>" in out and "policy turn 2 (tokens 28-30, trained)\n  │ 42<|im_end|>" in out
    assert "policy turn 1 (tokens 0-7, trained)\n  │ It is 42" in out  # single-turn: one run


def test_selection_and_logprobs(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _cli(capsys, str(run_dir), "--step", "2", "--rank", "1", "--sample", "0", "--logprobs")
    assert code == 0 and out.startswith("1 sample(s) of step(s) 2, mean reward 1.250")
    assert "step 2, DP rank 1, sample 0" in out and "sample 1" not in out
    assert f"      2  ' '                       logprob   -0.3000  p {math.exp(-0.3):.3f}" in out  # token 2 of "It is 42"
    code, out, _ = _cli(capsys, str(run_dir / "rollouts" / "step_000002_rank_00000.jsonl"))
    assert code == 0 and out.startswith("2 sample(s) of step(s) 2") and "DP rank 1" not in out
    code, out, _ = _cli(capsys, str(run_dir), "--step", "all")
    assert code == 0 and out.startswith("8 sample(s) of step(s) 2, 4")


def test_json_lines_carry_the_dump_and_the_runs(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _cli(capsys, str(run_dir), "--rank", "0", "--json")
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    dumped = [json.loads(line) for line in (run_dir / "rollouts" / "step_000004_rank_00000.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in line.items() if k in dumped[0]} for line in lines] == dumped
    assert [(line["step"], line["rank"], line["sample"]) for line in lines] == [(4, 0, 0), (4, 0, 1)]
    assert [(r["role"], r["turn"], r["start"], r["end"], r["text"]) for r in lines[1]["runs"]] == [
        ("policy", 1, 0, 11, "calc(17+25)"), ("observation", 1, 11, 28, "\n<tool>42</tool>\n"), ("policy", 2, 28, 31, "42<|im_end|>")]


def test_the_html_page_colors_tokens_by_mask_and_logprob(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    page = tmp_path / "view.html"
    code, out, err = _cli(capsys, str(run_dir), "--step", "4", "--rank", "0", "--html", str(page))
    assert code == 0 and out == "" and f"wrote {page} (2 sample(s))" in err
    text = page.read_text()
    assert text.startswith("<!doctype html>") and "<script" not in text and "http" not in text  # self-contained
    assert "What is 17 + 25? &lt;b&gt;bold&lt;/b&gt;" in text  # the prompt escaped
    hue = round(120 * math.exp(-0.1))
    assert f'<span class="t" style="background: hsl({hue}, 75%, 82%)" title="token 0, id ' in text  # p of token 0
    assert text.count('class="t obs"') == 17 and "&lt;" in text  # the observation's tokens, grey, escaped
    assert "[policy turn 2 (tokens 28-30, trained)]" in text


def test_a_dump_without_per_token_text_needs_the_tokenizer(run_dir: Path, tmp_path: Path, tiny_model_dir: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    old = tmp_path / "step_000004_rank_00000.jsonl"
    lines = [json.loads(line) for line in (run_dir / "rollouts" / old.name).read_text().splitlines()]
    old.write_text("".join(json.dumps({k: v for k, v in line.items() if k != "completion_tokens"}) + "\n" for line in lines))
    code, out, _ = _cli(capsys, str(old))
    assert code == 0 and "(17 tokens: this dump has no per-token text)" in out and "pass --tokenizer MODEL_DIR" in out
    assert "policy turn 1 (tokens 0-7, trained)\n  │ It is 42" in out  # one run: the dump's text
    code, out, _ = _cli(capsys, str(old), "--tokenizer", str(tiny_model_dir))
    assert code == 0 and "  │ calc(17+25)" in out and "no per-token text" not in out


@pytest.mark.parametrize(("make", "args", "message"), [
    (lambda d: d / "nowhere", [], "nowhere does not exist. Give a run's output_dir, its rollouts/ folder or one"),
    (lambda d: d, [], "holds no rollout dumps (step_XXXXXX_rank_XXXXX.jsonl). A run writes them every grpo.rollout_dump_steps"),
    (lambda d: _file(d, '{"prompt_ids": [1], "completion_ids": [2]}\n{"prompt_ids": [1], "completion_ids": [2, 3'), [],
     "step_000002_rank_00000.jsonl line 2 is not a JSON line"),
    (lambda d: _file(d, '{"prompt_ids": [1], "completion_ids": [2, 3], "loss_mask": [1]}\n'), [],
     "line 1: 'loss_mask' has 1 entries for 2 completion tokens."),
    (lambda d: _file(d, '{"prompt_ids": [1], "text": "x"}\n'), [], "line 1: 'completion_ids' is missing or not a list"),
    (lambda d: _file(d, '{"prompt_ids": [1], "completion_ids": [2]}\n'), ["--step", "7"], "has no dump of step 7; dumped steps: 2."),
    (lambda d: _file(d, '{"prompt_ids": [1], "completion_ids": [2]}\n'), ["--sample", "3"], "has 1 samples (--sample 0 to 0), not 3."),
    (lambda d: _file(d, '{"prompt_ids": [1], "completion_ids": [2]}\n'), ["--rank", "2"], "no dump of data-parallel rank 2"),
])
def test_bad_paths_and_lines_are_one_clear_error_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture, make, args: list[str],  # noqa: ANN001
                                                            message: str) -> None:
    code, out, err = _cli(capsys, str(make(tmp_path)), *args)
    assert code == 1 and out == "", out
    assert err.startswith("error: ") and message in " ".join(err.split()), err
    assert "Traceback" not in err


def _file(folder: Path, text: str) -> Path:
    (folder / "rollouts").mkdir()
    (folder / "rollouts" / "step_000002_rank_00000.jsonl").write_text(text)
    return folder
