"""Data as a verl user brings it: the rows verl's GSM8K preprocessing writes, and parquet files in verl's layout
(written here with pyarrow alone, as ``datasets`` writes them) through the dataset, the validation and a training
run."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_core.cli.train import ppo
from rlhf_core.config import DataConfig
from rlhf_core.data.dataset import DataError, RLHFDataset
from rlhf_core.data.gsm8k import preprocess_gsm8k
from rlhf_core.data.validation import validate_dataset
from rlhf_core.models.toy import build_char_tokenizer

#: the sentence verl's examples/data_preprocess/gsm8k.py appends to each question, after one space
VERL_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def _verl_row(split: str, index: int, question: str, answer: str, ground_truth: str) -> dict:
    """A row as verl's GSM8K script writes it, field by field."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question + " " + VERL_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


# the release's rows, copied from train.jsonl (lines 1 and 346) and test.jsonl (line 1)
NATALIA_Q = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
             "clips did Natalia sell altogether in April and May?")
NATALIA_A = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in "
             "April and May.\n#### 72")
ADAM_Q = ("Adam earns $40 daily in his job. 10% of his money is deducted as taxes. How much money will Adam have earned "
          "after taxes after 30 days of work?")
ADAM_A = ("The amount of money deducted from Adam's daily pay is $40 / 10 = $<<40/10=4>>4.\nSo after deducting 10%, "
          "Adam\u2019s daily pay is $40 \u2013 $4 = $<<40-4=36>>36.\nThis means that in 30 days he earns $36 * 30 = "
          "$<<36*30=1080>>1080.\n#### 1,080")
JANET_Q = ("Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
           "friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck "
           "egg. How much in dollars does she make every day at the farmers' market?")
JANET_A = ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every day at "
           "the farmer\u2019s market.\n#### 18")


@pytest.mark.parametrize(("split", "index", "expected"), [
    ("train", 0, _verl_row("train", 0, NATALIA_Q, NATALIA_A, "72")),
    ("train", 345, _verl_row("train", 345, ADAM_Q, ADAM_A, "1080")),  # verl drops the thousands comma
    ("test", 0, _verl_row("test", 0, JANET_Q, JANET_A, "18")),
])
def test_rlhf_gsm8k_writes_the_rows_verls_gsm8k_script_writes(gsm8k_dir, tmp_path_factory, split, index, expected):
    out = tmp_path_factory.getbasetemp() / "verl_gsm8k"
    if not (out / "test.parquet").exists():
        preprocess_gsm8k(gsm8k_dir, out)
    table = pq.read_table(out / f"{split}.parquet")
    assert table.column_names == list(expected)  # verl's columns, in its order, and no other
    assert table.slice(index, 1).to_pylist() == [expected]
    assert pa.types.is_int64(table.schema.field("extra_info").type.field("index").type)  # datasets' with_indices


def _verl_rows(n: int, split: str = "train") -> list[dict]:
    return [_verl_row(split, i, f"What is {i} + 2?", f"{i} + 2 = {i + 2}\n#### {i + 2}", str(i + 2))
            for i in range(n)]


def _write(path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _with_agent_columns(rows: list[dict]) -> list[dict]:
    """verl's tool-calling GSM8K rows: tools_kwargs and interaction_kwargs in extra_info, and an agent_name."""
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        row["extra_info"]["need_tools_kwargs"] = True
        row["extra_info"]["tools_kwargs"] = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}}
        row["extra_info"]["interaction_kwargs"] = {"name": "gsm8k", "query": row["extra_info"]["question"]}
        row["agent_name"] = "tool_agent"
    return rows


def test_verls_layout_with_its_agent_columns_loads_with_extra_info_as_written(tmp_path):
    path = _write(tmp_path / "train.parquet", _with_agent_columns(_verl_rows(3)))
    dataset = RLHFDataset(path, build_char_tokenizer(), DataConfig(max_prompt_length=200))
    batch = dataset.collate([1])
    assert batch.meta["ground_truth"] == ["3"] and batch.meta["data_source"] == ["openai/gsm8k"]
    assert batch.meta["index"] == [1]
    assert batch.meta["extra_info"] == [{
        "split": "train", "index": 1, "answer": "1 + 2 = 3\n#### 3", "question": "What is 1 + 2?",
        "need_tools_kwargs": True, "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "3"}}},
        "interaction_kwargs": {"name": "gsm8k", "query": "What is 1 + 2?"}}]
    report = validate_dataset([path], prompt_key="prompt")
    assert report.success, [outcome.label for outcome in report.failures]


def test_a_plain_string_prompt_and_a_numeric_ground_truth_load_and_validate(tmp_path):
    rows = _verl_rows(3)
    for row in rows:
        row["prompt"] = row["prompt"][0]["content"]
        row["reward_model"]["ground_truth"] = int(row["reward_model"]["ground_truth"])
    path = _write(tmp_path / "train.parquet", rows)
    assert pa.types.is_string(pq.read_schema(path).field("prompt").type)
    dataset = RLHFDataset(path, build_char_tokenizer(), DataConfig(max_prompt_length=200, return_raw_chat=True))
    batch = dataset.collate([0, 2])
    assert batch.meta["ground_truth"] == [2, 4]  # as stored: a number, not its text
    assert batch.meta["raw_prompt"][1] == [{"role": "user", "content": "What is 2 + 2? " + VERL_INSTRUCTION}]
    report = validate_dataset([path])
    assert report.success, [outcome.label for outcome in report.failures]


def test_a_file_without_data_source_is_refused_naming_the_column(tmp_path):
    rows = _verl_rows(3)
    for row in rows:
        del row["data_source"]
    path = _write(tmp_path / "train.parquet", rows)
    with pytest.raises(DataError, match=r"column\(s\) \['data_source'\] missing"):
        RLHFDataset(path, build_char_tokenizer(), DataConfig(max_prompt_length=200))
    report = validate_dataset([path])
    assert [outcome.label for outcome in report.failures] == ["column_exists [train.data_source]"]


def test_prompt_key_and_reward_fn_key_name_the_columns_read(tmp_path):
    rows = _verl_rows(3)
    for row in rows:
        row["messages"], row["source"] = row.pop("prompt"), row.pop("data_source")
    path = _write(tmp_path / "train.parquet", rows)
    config = DataConfig(max_prompt_length=200, prompt_key="messages", reward_fn_key="source")
    batch = RLHFDataset(path, build_char_tokenizer(), config).collate([2])
    assert batch.meta["data_source"] == ["openai/gsm8k"] and batch.meta["ground_truth"] == ["4"]
    assert validate_dataset([path], prompt_key="messages", reward_fn_key="source").success
    assert {outcome.label for outcome in validate_dataset([path]).failures} == {
        "column_exists [train.prompt]", "column_exists [train.data_source]"}


def test_a_ppo_run_trains_and_validates_on_verls_layout(workspace, tmp_path):
    """Training rows with verl's agent columns and integer ground truths, validation rows with string prompts: the
    built-in GSM8K rule grades both (no custom reward)."""
    train = _verl_rows(8)
    for row in _with_agent_columns(train):
        row["reward_model"]["ground_truth"] = int(row["reward_model"]["ground_truth"])
    val = _verl_rows(4, "test")
    for row in val:
        row["prompt"] = row["prompt"][0]["content"]
    out = tmp_path / "run"
    overrides = [o for o in workspace.overrides(out) if not o.startswith("custom_reward_function.")]
    code = ppo([*overrides, f"data.train_files={_write(tmp_path / 'train.parquet', train)}",
                f"data.val_files={_write(tmp_path / 'test.parquet', val)}", "trainer.total_training_steps=1",
                "trainer.test_freq=1"])
    assert code == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in metrics if "actor/pg_loss" in line] == [1]
    assert "val-core/openai/gsm8k/acc/mean@1" in metrics[-1]


def test_validation_metrics_are_keyed_by_data_source_where_reward_fn_key_routes_the_reward(workspace, tmp_path):
    """verl routes each row's reward by data.reward_fn_key's column but names its validation metrics by the row's
    data_source ('unknown' in a file without one); they were named by the reward_fn_key column's value."""
    rows = _verl_rows(8)
    for row in rows:
        row["reward_fn"] = "openai/gsm8k"  # the built-in GSM8K rule grades every row
    for row in rows[4:]:
        row["data_source"] = "my/gsm8k_copy"
    val = _write(tmp_path / "test.parquet", rows[:6])
    bare = [{key: value for key, value in row.items() if key != "data_source"} for row in rows[6:]]
    out = tmp_path / "run"
    overrides = [o for o in workspace.overrides(out) if not o.startswith("custom_reward_function.")]
    code = ppo([*overrides, f"data.train_files={_write(tmp_path / 'train.parquet', rows)}",
                f"data.val_files=[{val},{_write(tmp_path / 'bare.parquet', bare)}]", "data.reward_fn_key=reward_fn",
                "trainer.val_only=true", "trainer.val_before_train=true"])
    assert code == 0
    (metrics,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {key for key in metrics if key.startswith("val-core/") and "/acc/mean@" in key} == {
        "val-core/openai/gsm8k/acc/mean@1", "val-core/my/gsm8k_copy/acc/mean@1", "val-core/unknown/acc/mean@1"}


def test_the_data_step_passes_verls_layout_and_keeps_an_overlong_prompt_filter_overlong_prompts_drops(
        workspace, tmp_path, monkeypatch):
    import steps.validate_data as step
    from rlhf_core.config import load_config

    train = _with_agent_columns(_verl_rows(9))
    for row in train:
        row["reward_model"]["ground_truth"] = int(row["reward_model"]["ground_truth"])
    train[8]["prompt"][0]["content"] = "x" * 400  # over data.max_prompt_length (320): dropped, 8 prompts remain
    val = _verl_rows(12, "test")[9:]  # questions of its own
    for row in val:
        row["prompt"] = row["prompt"][0]["content"]
    files = [f"data.train_files={_write(tmp_path / 'train.parquet', train)}",
             f"data.val_files={_write(tmp_path / 'test.parquet', val)}", f"data.tokenizer={workspace.model}"]
    overrides = [o for o in workspace.overrides(tmp_path / "run") if not o.startswith("custom_reward_function.")]
    monkeypatch.setattr(step, "log_metadata", lambda metadata: None)  # no step context outside a pipeline run
    result, _html, _fingerprint = step.validate_data.entrypoint(
        load_config([*overrides, *files, "data.filter_overlong_prompts=true"]).to_dict())
    assert result["success"] is True
    # without the filter, the trainer refuses the over-long prompt (data.truncation=error), and so does the step
    with pytest.raises(step.DataValidationError, match="prompt_length_within_limit"):
        step.validate_data.entrypoint(load_config([*overrides, *files]).to_dict())
