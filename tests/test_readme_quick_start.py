"""README.md's "One GPU, your model, data and reward" as a new user copies it: its my_task.py and my_grpo.yaml, with
the model swapped for the tiny local one (no network) and a two-row data/sums.jsonl in the format it states. The
config validates, the plugin's dataset gives prompts, and its reward scores a right and a wrong completion. Then every
`oumi-megatron validate` / `plan` line of the README runs as written, offline (HF_HUB_OFFLINE=1): the README's own
model names resolve to the shapes shipped in configs/model_shapes/, said in one note."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def _blocks(language: str) -> list[str]:
    text = (REPO / "README.md").read_text()
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_the_readme_quick_start_validates_loads_its_data_and_scores(tmp_path: Path, tiny_model_dir: Path, monkeypatch,  # noqa: ANN001
                                                                      capsys) -> None:  # noqa: ANN001
    from oumi.core.configs import TrainingConfig

    from oumi_megatron.data import load_prompts
    from oumi_megatron.grpo.rewards import RewardComputer
    from oumi_megatron.validation import validate_config

    task = next(b for b in _blocks("python") if "my_task.py" in b)
    config = yaml.safe_load(next(b for b in _blocks("yaml") if "my_grpo.yaml" in b))
    (tmp_path / "my_task.py").write_text(task)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sums.jsonl").write_text('{"question": "What is 17 + 25?", "answer": "42"}\n'
                                                 '{"question": "What is 3 + 4?", "answer": "7"}\n')
    config["model"]["model_name"] = str(tiny_model_dir)
    config["training"]["output_dir"] = str(tmp_path / "output")
    (tmp_path / "my_grpo.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)  # the README's `export PYTHONPATH=$PWD`
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = TrainingConfig.from_yaml_and_arg_list(str(tmp_path / "my_grpo.yaml"), [])
    report = validate_config(cfg, world_size=1, check_bridge=False)
    assert report.ok, report.format_problems()
    assert report.require_layout().describe().startswith("TP 1 x PP 1 x CP 1 x DP 1 = world size 1")
    prompts = load_prompts(cfg)
    assert len(prompts) == 2
    row = prompts[0]
    assert "17 + 25" in str(row["prompt"]) and row["answer"] == "42", row
    scored = RewardComputer(cfg.grpo.reward_functions, "raise")(["What is 17 + 25?"] * 2, ["It is 42", "It is 41"],
                                                                [row, row])
    assert scored.total.tolist() == [1.0, 0.0]

    # the README's validate / plan lines as written (my_grpo.yaml verbatim: its Hub model, offline)
    from oumi_megatron.cli import main

    (tmp_path / "my_grpo.yaml").write_text(next(b for b in _blocks("yaml") if "my_grpo.yaml" in b))
    lines = [line.split("  #")[0].strip() for line in (REPO / "README.md").read_text().splitlines()
             if re.match(r"oumi-megatron (validate|plan) ", line.strip())]
    assert len(lines) == 3, lines  # the quick start's validate and plan, the 70B plan
    for line in lines:
        monkeypatch.chdir(tmp_path if "my_grpo.yaml" in line else REPO)
        code = main(shlex.split(line)[1:])
        out, err = capsys.readouterr()
        assert code == 0, (line, out, err)
        assert "config.json read from the shipped configs/model_shapes/" in err and "Traceback" not in err, (line, err)
        if " validate " in line:
            assert "data: data.train.datasets[0] (my-org/sums): the first 2 of 2 rows give prompts" in out, out
    sys.modules.pop("my_task", None)
