"""Training data is loaded and every row checked before any heavy work, with errors naming file, line and fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oumi_megatron.data import DataError, load_prompts, steps_for_epochs

GOOD = {"prompt": "Only digits, please.", "target": "digits"}


def _config(make_config, path: Path, name: str = "oumi-megatron/char-class", **dataset):  # noqa: ANN001, ANN003, ANN202
    return make_config(data={"train": {"datasets": [{"dataset_name": name, "dataset_path": str(path), **dataset}]}})


def _jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_good_data_loads_every_row(make_config, tmp_path: Path) -> None:  # noqa: ANN001
    data = _jsonl(tmp_path / "d.jsonl", [json.dumps(GOOD)] * 3 + [""] + [json.dumps(GOOD)])
    prompts = load_prompts(_config(make_config, data))
    assert len(prompts) == 4 and prompts[3]["prompt"][0]["content"] == GOOD["prompt"]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([], r"d\.jsonl has no rows"),
        (["", "  "], r"d\.jsonl has no rows"),
        ([json.dumps(GOOD), '{"prompt": "x", "target": ', json.dumps(GOOD)], r"d\.jsonl line 2 is not valid JSON"),
        ([json.dumps(GOOD), "[1, 2]"], r"d\.jsonl line 2 is a JSON list, not an object"),
        # hostile rows: nesting past the recursion limit, an integer past the digit limit (were a raw RecursionError
        # and ValueError)
        ([json.dumps(GOOD), '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"],
         r"d\.jsonl line 2 cannot be read as JSON \(nested too deep\)"),
        ([json.dumps(GOOD), '{"prompt": "x", "n": ' + "7" * 5000 + "}"], r"d\.jsonl line 2 cannot be read as JSON \(Exceeds"),
        # a row without the prompt column, among rows with it (it would have crashed the step that drew it)
        ([json.dumps(GOOD), "", json.dumps({"question": "q", "target": "digits"})],
         r"d\.jsonl row 1 \(line 3\) has no prompt text"),
        # no row has the column: the dataset class cannot transform any (was a bare KeyError: 'prompt')
        ([json.dumps({"question": "q", "target": "digits"})],
         r"d\.jsonl row 0 \(line 1\) cannot be read by CharClassGrpoDataset: KeyError: 'prompt'"),
        ([json.dumps({"prompt": "  ", "target": "digits"})], r"d\.jsonl row 0 \(line 1\) has an empty 'prompt'"),
    ],
)
def test_bad_jsonl_names_the_file_and_line(make_config, tmp_path: Path, lines: list[str], message: str) -> None:  # noqa: ANN001
    data = _jsonl(tmp_path / "d.jsonl", lines)
    with pytest.raises(DataError, match=r"data\.train\.datasets\[0\] \(oumi-megatron/char-class\): .*" + message):
        load_prompts(_config(make_config, data))


def test_invalid_utf8_names_the_file_and_line(make_config, tmp_path: Path) -> None:  # noqa: ANN001
    data = tmp_path / "d.jsonl"
    data.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"prompt": "caf\xe9", "target": "digits"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl line 2 is not valid UTF-8 .*Save the file as UTF-8"):
        load_prompts(_config(make_config, data))


def test_missing_file_and_unknown_dataset(make_config, tmp_path: Path) -> None:  # noqa: ANN001
    with pytest.raises(DataError, match=r"nope\.jsonl does not exist\. Fix dataset_path"):
        load_prompts(_config(make_config, tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match=r"'no/such' is not a registered Oumi dataset"):
        load_prompts(_config(make_config, tmp_path / "x.jsonl", name="no/such"))


def test_gsm8k_rows_without_a_final_answer_are_named(make_config, tmp_path: Path) -> None:  # noqa: ANN001
    """Oumi's openai/gsm8k class asserts on an answer without "#### N": reported with the row, not mid-run."""
    good = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}
    data = _jsonl(tmp_path / "gsm.jsonl", [json.dumps(good), json.dumps({"question": "q", "answer": "no final"})])
    with pytest.raises(DataError, match=r"gsm\.jsonl row 1 \(line 2\) cannot be read by Gsm8kGrpoDataset"):
        load_prompts(_config(make_config, data, name="openai/gsm8k", subset="main"))
    prompts = load_prompts(_config(make_config, _jsonl(tmp_path / "ok.jsonl", [json.dumps(good)]),
                                   name="openai/gsm8k", subset="main"))
    assert prompts[0]["reward_model"]["ground_truth"] == "5"


def test_epochs_become_steps() -> None:
    assert steps_for_epochs(1, 8, 4) == 2
    assert steps_for_epochs(15, 7473, 256) == 438  # the VERL example: 15 epochs of gsm8k's train split
    assert steps_for_epochs(0.5, 10, 4) == 2  # the last partial step counts


def test_sample_count_takes_the_first_rows_as_oumi_does(make_config, tmp_path: Path) -> None:  # noqa: ANN001
    from oumi_megatron.data import sampled_rows

    rows = [json.dumps({"prompt": f"Only digits, please. Row {i}.", "target": "digits"}) for i in range(5)]
    data = _jsonl(tmp_path / "d.jsonl", rows)
    prompts = load_prompts(_config(make_config, data, sample_count=3))
    assert len(prompts) == 3 and prompts[2]["prompt"][0]["content"].endswith("Row 2.")
    assert sampled_rows(5, 12) == [0, 1, 2, 3, 4] * 2 + [0, 1]  # more than the file: whole copies, then the first rows
    assert sampled_rows(4, None) == [0, 1, 2, 3]
    with pytest.raises(DataError, match=r"sample_count with shuffle: true .* shuffle: false"):
        load_prompts(_config(make_config, data, sample_count=3, shuffle=True))


def test_eval_sets_group_validation_datasets_by_prefix(make_config, tmp_path: Path) -> None:  # noqa: ANN001
    from oumi_megatron.data import load_eval_sets

    a = _jsonl(tmp_path / "a.jsonl", [json.dumps(GOOD)] * 2)
    b = _jsonl(tmp_path / "b.jsonl", [json.dumps(GOOD)] * 3)
    datasets = [{"dataset_name": "oumi-megatron/char-class", "dataset_path": str(p)} for p in (a, b, a)]
    cfg = make_config(data={"validation": {"datasets": datasets}})
    assert {k: len(v) for k, v in load_eval_sets(cfg).items()} == {"eval": 7}  # no prefixes: one set
    cfg.grpo.eval_metric_prefixes = ["eval", "eval_unseen", "eval"]
    assert {k: len(v) for k, v in load_eval_sets(cfg).items()} == {"eval": 4, "eval_unseen": 3}
