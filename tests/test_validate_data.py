"""``oumi-megatron validate`` checks the data before any GPU is touched (validation.check_data): each dataset registered
with Oumi and its path present, its first rows loaded and transformed into prompts, the reward functions' keyword
arguments found in those rows, the environment's needs met; each failure names the field and the fix. Training checks
the rewards' arguments against its loaded rows before the model is converted."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from conftest import REPO, base_config_dict, run_cli, write_yaml
from oumi_megatron.validation import ValidationReport, check_data, validate_config

PLUGIN = "validate_data_plugin"  # registers a dataset and rewards under names no other test uses


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("plugin")
    (folder / f"{PLUGIN}.py").write_text(textwrap.dedent('''
        import oumi.datasets  # noqa: F401
        from oumi.core.datasets import BaseExperimentalGrpoDataset
        from oumi.core.registry import RegistryType, register, register_dataset

        @register_dataset("validate-data/sums")
        class Sums(BaseExperimentalGrpoDataset):
            default_dataset = "validate-data/sums"
            def transform(self, sample):
                return {"prompt": [{"role": "user", "content": sample["question"]}], "answer": str(sample["answer"])}

        @register("validate_data_needs_solution", RegistryType.REWARD_FUNCTION)
        def needs_solution(completions, solution, **kwargs):
            return [0.0 for _ in completions]

        @register("validate_data_no_kwargs", RegistryType.REWARD_FUNCTION)
        def no_kwargs(completions, prompts, answer):
            return [0.0 for _ in completions]

        @register("validate_data_exact", RegistryType.REWARD_FUNCTION)
        def exact(completions, answer, **kwargs):
            return [float(c.strip() == a) for c, a in zip(completions, answer)]
    '''))
    (folder / "sums.jsonl").write_text('{"question": "What is 17 + 25?", "answer": 42}\n'
                                       '{"question": "What is 3 + 4?", "answer": 7}\n')
    return folder


@pytest.fixture
def sums_config(make_config, plugin_dir: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN001, ANN201
    monkeypatch.syspath_prepend(str(plugin_dir))

    def _make(dataset: dict | None = None, reward: str = "validate_data_exact", **grpo):  # noqa: ANN202
        d = {"dataset_name": "validate-data/sums", "dataset_path": str(plugin_dir / "sums.jsonl"), **(dataset or {})}
        return make_config(data={"train": {"datasets": [d]}},
                           grpo={"plugins": [PLUGIN], "reward_functions": [{"name": reward}], **grpo})

    return _make


def _checked(cfg) -> ValidationReport:  # noqa: ANN001
    report = validate_config(cfg, world_size=1, check_bridge=False)
    assert report.ok, report.format_problems()
    check_data(cfg, report)
    return report


def test_a_valid_config_reads_the_first_rows_and_says_so(sums_config) -> None:  # noqa: ANN001
    report = _checked(sums_config())
    assert report.ok, report.format_problems()
    assert report.checked == ["data.train.datasets[0] (validate-data/sums): the first 2 of 2 rows give prompts; columns "
                              "after its transform: answer, prompt"]


def test_a_missing_dataset_path_names_the_field(sums_config, tmp_path: Path) -> None:  # noqa: ANN001
    report = _checked(sums_config({"dataset_path": str(tmp_path / "nowhere.jsonl")}))
    assert report.fields() == ["data.train.datasets[0].dataset_path"]
    assert f"{tmp_path / 'nowhere.jsonl'} does not exist" in report.format_problems()


def test_an_unknown_dataset_name_names_the_field_and_the_closest_names(sums_config) -> None:  # noqa: ANN001
    report = _checked(sums_config({"dataset_name": "validate-data/sum"}))
    assert report.fields() == ["data.train.datasets[0].dataset_name"]
    text = report.format_problems()
    assert "'validate-data/sum' is not a registered Oumi dataset. Did you mean 'validate-data/sums'?" in text
    assert "@register_dataset in a module named in grpo.plugins" in text


def test_a_reward_whose_arguments_are_not_in_the_rows_names_the_field_and_the_column(sums_config) -> None:  # noqa: ANN001
    report = _checked(sums_config(reward="validate_data_needs_solution"))
    assert report.fields() == ["grpo.reward_functions[0]"]
    text = report.format_problems()
    assert "'validate_data_needs_solution' needs the keyword argument(s) 'solution'" in text
    assert "their columns after the dataset's transform: answer besides 'prompt'" in text
    assert "Return 'solution' from the dataset's transform, or set it in grpo.reward_functions[0].kwargs." in text
    # given in the reward's kwargs instead, it is found
    cfg = sums_config(reward="validate_data_needs_solution")
    cfg.grpo.reward_functions[0].kwargs = {"solution": "42"}
    assert _checked(cfg).ok


def test_a_reward_without_kwargs_must_accept_every_column(sums_config) -> None:  # noqa: ANN001
    report = _checked(sums_config(reward="validate_data_no_kwargs"))
    assert report.ok, report.format_problems()  # completions, prompts, answer: exactly what it takes
    report = _checked(sums_config({"dataset_name": "oumi-megatron/char-class", "dataset_path": str(REPO / "data/char_class_train.jsonl")},
                                  reward="validate_data_no_kwargs", plugins=["oumi_megatron.examples.demo_task", PLUGIN]))
    text = report.format_problems()
    assert report.fields() == ["grpo.reward_functions[0]", "grpo.reward_functions[0]"], text
    assert "needs the keyword argument(s) 'answer'" in text
    assert "takes no **kwargs, and every call passes 'target' (from the rows of data.train.datasets[0]" in text


def test_rows_that_give_no_prompt_name_the_file_and_line(sums_config, tmp_path: Path) -> None:  # noqa: ANN001
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "What is 1 + 1?", "answer": 2}\n{"answer": 3}\n')
    report = _checked(sums_config({"dataset_path": str(bad)}))
    assert report.fields() == ["data.train.datasets[0].dataset_path"]
    assert f"{bad} line 2 has no prompt text (its 'prompt' is missing or not text)" in report.format_problems()  # pandas: NaN
    bad.write_text('{"question": "What is 1 + 1?", "answer": 2}\nnot json\n')
    assert f"{bad} line 2 is not valid JSON" in _checked(sums_config({"dataset_path": str(bad)})).format_problems()


def test_a_hub_dataset_offline_is_a_warning_not_a_problem(make_config, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(Path("/nonexistent_cache_for_validate_test")))
    report = _checked(make_config(data={"train": {"datasets": [{"dataset_name": "openai/gsm8k", "split": "train"}]}},
                                  grpo={"plugins": [], "reward_functions": [{"name": "gsm8k"}]}))
    assert report.ok, report.format_problems()
    assert any("data.train.datasets[0] (openai/gsm8k): its rows were not checked: the Hugging Face Hub cannot be reached"
               in w for w in report.warnings), report.warnings


def test_the_environment_starts_from_the_rows_and_its_observations_render(make_config) -> None:  # noqa: ANN001
    cfg = make_config(grpo={"plugins": ["oumi_megatron.examples.demo_task", "oumi_megatron.examples.guess_number_environment"],
                            "environment": "guess_number", "max_turns": 2})
    report = _checked(cfg)
    assert report.ok and not report.warnings, (report.format_problems(), report.warnings)  # the tiny model's template renders 'user'

    from oumi_megatron.environments.registry import ENVIRONMENTS

    class NeedsSecret:
        def start(self, row: dict) -> dict:
            return {"secret": row["secret"]}

        def step(self, state, turn_text, turn_ids):  # noqa: ANN001, ANN201
            raise AssertionError("not reached")

    if "validate_data_needs_secret" not in ENVIRONMENTS:
        ENVIRONMENTS.add("validate_data_needs_secret", NeedsSecret)
    cfg = make_config(grpo={"plugins": ["oumi_megatron.examples.demo_task"], "environment": "validate_data_needs_secret"})
    report = _checked(cfg)
    assert report.fields() == ["grpo.environment"], report.format_problems()
    assert ("'validate_data_needs_secret' cannot start an episode from row 0 of data.train.datasets[0] "
            "(oumi-megatron/char-class): KeyError: 'secret' (the rows have no 'secret' column") in report.format_problems()


def test_a_plugin_that_does_not_import_leaves_the_data_unchecked_with_a_warning(make_config) -> None:  # noqa: ANN001
    cfg = make_config(grpo={"plugins": ["no_such_plugin_module"]})
    report = validate_config(cfg, world_size=1, check_bridge=False)
    check_data(cfg, report)
    assert report.fields() == ["grpo.plugins"] and "the data was not checked: it needs grpo.plugins" in report.warnings[-1]


def test_training_checks_the_rewards_arguments_before_converting(sums_config, tmp_path: Path) -> None:  # noqa: ANN001
    from oumi_megatron.train import train_megatron_grpo
    from oumi_megatron.validation import MegatronConfigError

    cfg = sums_config(reward="validate_data_needs_solution")
    cfg.training.output_dir = str(tmp_path / "run")
    with pytest.raises(MegatronConfigError, match=r"grpo.reward_functions\[0\]: 'validate_data_needs_solution' needs"):
        train_megatron_grpo(cfg)
    assert not (tmp_path / "run").exists()  # nothing converted, nothing written


def test_validate_rejects_a_missing_path_an_unknown_name_and_a_reward_s_arguments(
        tmp_path: Path, tiny_model_dir: Path, plugin_dir: Path) -> None:
    """The command as a user runs it: exit 1, one line per problem naming its field, well under 30 s on CPU."""
    cfg = base_config_dict(tiny_model_dir)
    cfg["data"]["train"]["datasets"] = [
        {"dataset_name": "validate-data/sums", "dataset_path": "data/sums_missing.jsonl"},  # relative to the launch folder
        {"dataset_name": "validate-data/sumz", "dataset_path": str(plugin_dir / "sums.jsonl")},
        {"dataset_name": "validate-data/sums", "dataset_path": str(plugin_dir / "sums.jsonl")}]
    cfg["grpo"].update(plugins=[PLUGIN], reward_functions=[{"name": "validate_data_needs_solution"}])
    cfg["training"]["output_dir"] = str(tmp_path / "out")
    path = write_yaml(tmp_path / "cfg.yaml", cfg)
    # its time (10.7 s on the 2-core machine, 19-34 s beside other tests) is a measurement, not an assertion
    out = run_cli(["oumi-megatron", "validate", "-c", str(path)], env={"PYTHONPATH": str(plugin_dir)}, cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = [line.strip() for line in out.stderr.splitlines() if line.strip().startswith("- ")]
    assert [line.split(":")[0] for line in lines] == ["- data.train.datasets[0].dataset_path", "- data.train.datasets[1].dataset_name",
                                                      "- grpo.reward_functions[0]"], out.stderr
    assert f"data/sums_missing.jsonl does not exist (relative paths start at the folder you launch from, here {tmp_path})" in lines[0]
    assert "Did you mean 'validate-data/sums'?" in lines[1] and "needs the keyword argument(s) 'solution'" in lines[2]
