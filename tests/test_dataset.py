"""The RL prompt dataset and its sampler: padding, templates, truncation, seeded order, resume."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlhf_core.batch import Batch
from rlhf_core.config import DataConfig
from rlhf_core.data.dataset import DataError, PromptSampler, RLHFDataset, ground_truth, left_pad
from rlhf_core.data.schema import INSTRUCTION, make_record
from rlhf_core.models.toy import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _write(path, questions, source="synthetic/arithmetic"):
    rows = [make_record(q, f"{q} #### {i}", str(i), "train", i, source) for i, q in enumerate(questions)]
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def test_left_pad_by_hand():
    out = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert out["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]


def test_prompts_use_the_chat_template(tmp_path, tokenizer):
    path = _write(tmp_path / "a.parquet", ["What is 3+4?", "Tom has 2 cats."])
    dataset = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=200))
    batch = dataset.collate([0, 1])
    first = batch["input_ids"][0][batch["attention_mask"][0].bool()]
    assert tokenizer.decode(first) == f"User: What is 3+4?{INSTRUCTION}\nAssistant: "
    assert batch.meta["ground_truth"] == ["0", "1"]
    assert batch.meta["data_source"] == ["synthetic/arithmetic"] * 2
    assert batch.meta["index"] == [0, 1]
    # left padding: the shorter prompt starts with pads and its positions count from its first token
    short = batch["attention_mask"][0]
    assert short[0] == 0 and short[-1] == 1
    assert batch["position_ids"][0][short.bool()].tolist() == list(range(int(short.sum())))


def test_plain_text_without_a_template(tmp_path, tokenizer):
    plain = build_char_tokenizer()
    plain.chat_template = None
    path = _write(tmp_path / "a.parquet", ["Hi"])
    dataset = RLHFDataset(path, plain, DataConfig(max_prompt_length=200))
    assert plain.decode(dataset.prompt_ids[0]) == "Hi" + INSTRUCTION


def test_ground_truth_and_extra_info_reach_the_reward_as_stored(tmp_path, tokenizer):
    """As verl hands them over: a list, dict or number stays one (not its printed form), and an index may be a
    string id."""
    def meta_of(name, ground_truth="3", extra_info=None):
        row = make_record("q", "s", "0", "train", 0, "custom/source")
        row["reward_model"] = {"style": "rule", "ground_truth": ground_truth}
        if extra_info is not None:
            row["extra_info"] = extra_info
        pd.DataFrame([row]).to_parquet(tmp_path / name)
        return RLHFDataset(str(tmp_path / name), tokenizer, DataConfig(max_prompt_length=200)).collate([0]).meta

    listed = meta_of("list.parquet", ["12", "7"])["ground_truth"][0]
    assert listed == ["12", "7"] and type(listed) is list
    assert meta_of("dict.parquet", {"target": ["a", "b"], "n": 2})["ground_truth"] == [{"target": ["a", "b"], "n": 2}]
    number = meta_of("int.parquet", 72)["ground_truth"][0]
    assert number == 72 and type(number) is int
    string_id = meta_of("id.parquet", extra_info={"split": "train", "index": "q-17"})
    assert string_id["index"] == ["q-17"] and string_id["extra_info"] == [{"split": "train", "index": "q-17"}]


def test_a_reward_function_that_changes_its_extra_info_changes_that_batch_only(tmp_path, tokenizer):
    row = make_record("q", "s", "0", "train", 0, "custom/source")
    row["extra_info"] = {"index": 0, "tags": ["a"]}
    pd.DataFrame([row]).to_parquet(tmp_path / "one.parquet")
    dataset = RLHFDataset(str(tmp_path / "one.parquet"), tokenizer, DataConfig(max_prompt_length=200,
                                                                              return_raw_chat=True))
    first = dataset.collate([0]).meta
    first["extra_info"][0]["seen"] = True  # what a reward function may do with what it is handed
    first["extra_info"][0]["tags"].append("b")
    first["raw_prompt"][0][0]["content"] = "changed"
    again = dataset.collate([0]).meta
    assert again["extra_info"] == [{"index": 0, "tags": ["a"]}]
    assert again["raw_prompt"][0][0]["content"] == row["prompt"][0]["content"]


def test_prompts_without_a_ground_truth_only_where_the_reward_does_not_need_one(tmp_path, tokenizer):
    rows = [make_record(q, "s", str(i), "train", i, "synthetic/arithmetic") for i, q in enumerate(["1+1", "2+2"])]
    rows[1]["reward_model"] = {"style": "model", "ground_truth": None}
    pd.DataFrame(rows).to_parquet(tmp_path / "mixed.parquet")
    prompts_only = pd.DataFrame(rows).drop(columns=["reward_model"])
    prompts_only.to_parquet(tmp_path / "prompts.parquet")
    config = DataConfig(max_prompt_length=200)
    with pytest.raises(DataError, match="row 1: reward_model.ground_truth is missing .*rule_coef=0"):
        RLHFDataset(str(tmp_path / "mixed.parquet"), tokenizer, config)
    with pytest.raises(DataError, match=r"column\(s\) \['reward_model'\] missing"):
        RLHFDataset(str(tmp_path / "prompts.parquet"), tokenizer, config)
    mixed = RLHFDataset(str(tmp_path / "mixed.parquet"), tokenizer, config, require_ground_truth=False)
    assert mixed.collate([0, 1]).meta["ground_truth"] == ["0", None]
    alone = RLHFDataset(str(tmp_path / "prompts.parquet"), tokenizer, config, require_ground_truth=False)
    assert alone.collate([0, 1]).meta["ground_truth"] == [None, None]
    assert alone.prompt_ids == mixed.prompt_ids
    # a NaN of any float width is pandas' missing value, not a ground truth
    assert [ground_truth(v) for v in ({"ground_truth": float("nan")}, {"ground_truth": np.float32("nan")},
                                      {"ground_truth": 0.0}, {"style": "model"}, None)] == [None, None, 0.0, None, None]


def test_a_file_without_extra_info_beside_one_with_it(tmp_path, tokenizer):
    with_info = _write(tmp_path / "a.parquet", ["one"])
    rows = [make_record("two", "s", "2", "train", 0, "synthetic/arithmetic")]
    del rows[0]["extra_info"]
    pd.DataFrame(rows).to_parquet(tmp_path / "b.parquet")
    meta = RLHFDataset([with_info, str(tmp_path / "b.parquet")], tokenizer,
                       DataConfig(max_prompt_length=200)).collate([0, 1]).meta
    # the second file's row gets an empty extra_info (pandas fills the missing column with NaN), its row as index
    assert meta["extra_info"][1] == {} and meta["index"] == [0, 0]


def test_a_null_extra_info_reads_as_an_empty_one_as_a_missing_column_does(tmp_path, tokenizer):
    """pandas and pyarrow write a row without extra_info beside rows with it as a null cell: the row is numbered by
    its row in its file and its reward gets {}, as a file without the column gives."""
    rows = [make_record(q, "s", str(i), "train", i, "synthetic/arithmetic") for i, q in enumerate(["a", "b", "c"])]
    rows[0]["extra_info"]["index"] = 40
    rows[2]["extra_info"]["index"] = 42
    rows[1]["extra_info"] = None
    pd.DataFrame(rows).to_parquet(tmp_path / "holes.parquet")
    meta = RLHFDataset(str(tmp_path / "holes.parquet"), tokenizer,
                       DataConfig(max_prompt_length=200)).collate([0, 1, 2]).meta
    assert meta["index"] == [40, 1, 42]
    assert meta["extra_info"][1] == {}
    assert meta["extra_info"][2] == {"split": "train", "index": 42, "answer": "s", "question": "c"}
    # the other rows' integers stay integers (pandas reads a struct field with a null slot as floats: 40.0)
    assert [type(index) for index in meta["index"]] == [int, int, int]
    assert type(meta["extra_info"][0]["index"]) is int


@pytest.mark.parametrize("cells, row, reason", [
    (['{"index": 0}', '{"index": 1}'], 0, "extra_info is the JSON text of a mapping, not a mapping: parse it"),
    ([None, "hard"], 1, "extra_info is a str, not a mapping: store e.g. {'index': 0"),
    ([3, 4], 0, "extra_info is a int, not a mapping"),
])
def test_an_extra_info_that_is_not_a_mapping_is_refused_with_its_row(tmp_path, tokenizer, cells, row, reason):
    """verl reads extra_info.get("index"): text or a number there has no index nor anything a reward can look up,
    and was handed on as it was (a parquet column holds one type: all text, all numbers, or nulls beside them)."""
    rows = [make_record(q, "s", str(i), "train", i, "synthetic/arithmetic") for i, q in enumerate(["a", "b"])]
    frame = pd.DataFrame(rows).assign(extra_info=cells)
    frame.to_parquet(tmp_path / "text.parquet")
    with pytest.raises(DataError) as raised:
        RLHFDataset(str(tmp_path / "text.parquet"), tokenizer, DataConfig(max_prompt_length=200))
    assert str(raised.value).startswith(f"{tmp_path / 'text.parquet'} row {row}: {reason}")


@pytest.mark.parametrize("first", [[("index", 0), ("split", 0)], []], ids=["pairs", "empty"])
def test_an_extra_info_written_as_a_parquet_map_is_refused_as_one(tmp_path, tokenizer, first):
    """A parquet map (Spark's MapType) reads back as a list of (key, value) pairs, an empty one as [] (no pairs to
    tell it by: the column's Arrow type says it is a map), and verl's reader (HF datasets) cannot read the column at
    all: refused, saying it is a map and to write a struct (not that it is a list)."""
    rows = [make_record(q, "s", str(i), "train", i, "synthetic/arithmetic") for i, q in enumerate(["a", "b"])]
    table = pa.Table.from_pandas(pd.DataFrame(rows).drop(columns=["extra_info"]), preserve_index=False)
    pairs = pa.array([first, [("index", 1), ("split", 0)]], pa.map_(pa.string(), pa.int64()))
    pq.write_table(table.append_column("extra_info", pairs), tmp_path / "map.parquet")
    with pytest.raises(DataError) as raised:
        RLHFDataset(str(tmp_path / "map.parquet"), tokenizer, DataConfig(max_prompt_length=200))
    assert str(raised.value).startswith(f"{tmp_path / 'map.parquet'} row 0: extra_info is a parquet map, which "
                                        "verl's reader cannot read: write a struct (e.g. a dict")


def test_a_file_of_a_split_without_a_column_the_others_have_is_named(tmp_path, tokenizer):
    """Joined with files that have it, a file without 'reward_model' or the prompt column read as rows without a
    ground truth ("row 0: reward_model.ground_truth is missing") or a null prompt: the file and column went unnamed."""
    first = _write(tmp_path / "a.parquet", ["one", "two"])
    no_truth = str(tmp_path / "b.parquet")
    pd.read_parquet(first).drop(columns=["reward_model"]).to_parquet(no_truth)
    no_prompt = str(tmp_path / "c.parquet")
    pd.read_parquet(first).drop(columns=["prompt"]).to_parquet(no_prompt)
    config = DataConfig(max_prompt_length=200)
    with pytest.raises(DataError) as error:
        RLHFDataset([first, no_truth], tokenizer, config)
    assert str(error.value).startswith(f"data.train_files: {no_truth} lacks column 'reward_model', which {first} "
                                       "has: add it to that file (the built-in rule rewards")
    with pytest.raises(DataError) as error:
        RLHFDataset([no_prompt, first, no_truth], tokenizer, config, key="data.val_files")
    assert str(error.value).startswith(f"data.val_files: {no_prompt} lacks column 'prompt', which {first} has: add "
                                       f"it to that file; {no_truth} lacks column 'reward_model', which {no_prompt} has")
    # data.prompt_key's column, two files without it
    renamed = str(tmp_path / "q.parquet")
    pd.read_parquet(first).rename(columns={"prompt": "question"}).to_parquet(renamed)
    with pytest.raises(DataError, match=f"^data.train_files: {no_prompt}, {first} lack column 'question', which "
                                        f"{renamed} has: add it to those files$"):
        RLHFDataset([renamed, no_prompt, first], tokenizer, DataConfig(max_prompt_length=200, prompt_key="question"))
    # the data source's column: its rows were routed to a reward function for data_source 'nan'
    no_source = str(tmp_path / "d.parquet")
    pd.read_parquet(first).drop(columns=["data_source"]).to_parquet(no_source)
    with pytest.raises(DataError, match=f"^data.train_files: {no_source} lacks column 'data_source', which {first} "
                                        "has: add it to that file$"):
        RLHFDataset([first, no_source], tokenizer, config, require_ground_truth=False)
    # trained without a ground truth, a file of prompts alone joins one with ground truths
    joined = RLHFDataset([first, no_truth], tokenizer, config, require_ground_truth=False)
    assert joined.collate([0, 1, 2, 3]).meta["ground_truth"] == ["0", "1", None, None]
    # no file has the column: said as before
    with pytest.raises(DataError, match=r"column\(s\) \['reward_model'\] missing"):
        RLHFDataset([no_truth, no_truth], tokenizer, config)


def test_a_row_without_a_data_source_is_a_data_error_naming_its_row(tmp_path, tokenizer):
    """A null in data.reward_fn_key's column was read as the text 'nan': the row went to a reward for data_source
    'nan' ("sample 1: no reward function for data_source 'nan'" in rlhf evaluate, once the model had loaded), and
    a custom reward function graded it under that name."""
    path = _write(tmp_path / "a.parquet", ["one", "two", "three"])
    frame = pd.read_parquet(path)
    frame.loc[1, "data_source"] = None
    frame.to_parquet(path)
    with pytest.raises(DataError, match=f"^{path} row 1: 'data_source' \\(data.reward_fn_key, which routes the row "
                                        "to its reward function\\) is null; give every row its data source$"):
        RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=200), require_ground_truth=False)
    renamed = str(tmp_path / "b.parquet")
    frame.rename(columns={"data_source": "source"}).to_parquet(renamed)
    with pytest.raises(DataError, match=f"^{renamed} row 1: 'source' \\(data.reward_fn_key"):
        RLHFDataset(renamed, tokenizer, DataConfig(max_prompt_length=200, reward_fn_key="source"))


def _save_to_disk_layout(folder: Path, rows: pd.DataFrame) -> None:
    """The folder ``datasets.Dataset.save_to_disk`` writes (``datasets`` is no dependency here): the rows as an Arrow
    stream file, and ``state.json`` and ``dataset_info.json`` beside it."""
    folder.mkdir(parents=True)
    table = pa.Table.from_pandas(rows)
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as out:
        out.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                                   "_fingerprint": "0", "_split": None}))
    (folder / "dataset_info.json").write_text("{}")


def test_a_datasets_folder_is_named_as_such_with_its_conversion(tmp_path, tokenizer):
    """A datasets save_to_disk folder was "a folder; name its parquet files" (it holds none)."""
    rows = pd.read_parquet(_write(tmp_path / "a.parquet", ["one", "two"]))
    saved = tmp_path / "saved"
    _save_to_disk_layout(saved, rows)
    with pytest.raises(DataError) as error:
        RLHFDataset(str(saved), tokenizer, DataConfig(max_prompt_length=200))
    assert str(error.value) == (f"data.train_files: {saved} is a folder; it is a datasets save_to_disk folder, Arrow "
                                f"files, not parquet: write it as a parquet file, e.g. datasets.load_from_disk("
                                f"'{saved}').to_parquet('saved.parquet'), and name that file")
    splits = tmp_path / "splits"  # a DatasetDict's: a folder a split, and the splits' names
    _save_to_disk_layout(splits / "train", rows)
    (splits / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    with pytest.raises(DataError, match=r"save_to_disk folder of splits \(train\), Arrow files, not parquet: write "
                                        r"each split as a parquet file, e.g. datasets.load_from_disk\("):
        RLHFDataset(str(splits), tokenizer, DataConfig(max_prompt_length=200), key="data.val_files")


def test_a_json_file_is_named_as_such_with_its_conversion(tmp_path, tokenizer):
    """A JSON Lines file was "Parquet magic bytes not found in footer. Either the file is corrupted or this is not a
    parquet file"."""
    rows = pd.read_parquet(_write(tmp_path / "a.parquet", ["one", "two"]))
    lines = tmp_path / "a.jsonl"
    rows.to_json(lines, orient="records", lines=True)
    with pytest.raises(DataError) as error:
        RLHFDataset(str(lines), tokenizer, DataConfig(max_prompt_length=200))
    assert str(error.value).startswith(f"{lines} is not a readable parquet file: it is JSON Lines text, not parquet: "
                                       f"write it as a parquet file, e.g. pandas.read_json('{lines}', lines=True)"
                                       ".to_parquet('a.parquet')")
    # the conversion the message gives trains on the same prompts and ground truths
    pd.read_json(lines, lines=True).to_parquet(tmp_path / "converted.parquet")
    converted = RLHFDataset(str(tmp_path / "converted.parquet"), tokenizer, DataConfig(max_prompt_length=200))
    assert converted.collate([0, 1]).meta["ground_truth"] == ["0", "1"]
    array = tmp_path / "a.json"
    rows.to_json(array, orient="records")
    with pytest.raises(DataError, match=r"it is JSON text, not parquet: write it as a parquet file, e.g. pandas."
                                        rf"read_json\('{array}'\).to_parquet"):
        RLHFDataset(str(array), tokenizer, DataConfig(max_prompt_length=200))


def test_a_blank_question_is_a_data_error_naming_its_rows(tmp_path, tokenizer):
    """A question emptied on the way ("" or spaces where a null was) trained as "User: \\nAssistant: ", graded
    against its row's answer; rlhf validate failed prompt_user_content_non_empty but rlhf ppo took it."""
    path = _write(tmp_path / "a.parquet", ["one", "two", "three", "four"])
    frame = pd.read_parquet(path)
    frame["prompt"] = [[{"role": "user", "content": text}] for text in ("one", "", "three", " \n\t")]
    frame.to_parquet(path)
    with pytest.raises(DataError) as error:
        RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=200), key="data.val_files")
    assert str(error.value) == (f"data.val_files: 2 prompt(s) have a blank last user turn (the question), which would "
                                f"train as a question of nothing: {path} row 1; {path} row 3; fill in the question or "
                                "drop the row")
    # a blank system turn, or an earlier blank user turn, leaves a question
    frame["prompt"] = [[{"role": "system", "content": ""}, {"role": "user", "content": "q"}],
                       [{"role": "user", "content": " "}, {"role": "user", "content": "q"}]] * 2
    frame.to_parquet(path)
    assert len(RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=200))) == 4


def test_many_files_are_concatenated(tmp_path, tokenizer):
    a = _write(tmp_path / "a.parquet", ["one"])
    b = _write(tmp_path / "b.parquet", ["two", "three"])
    dataset = RLHFDataset([a, b], tokenizer, DataConfig(max_prompt_length=200))
    assert len(dataset) == 3


def test_overlong_prompt_error_names_the_row_and_length(tmp_path, tokenizer):
    path = _write(tmp_path / "a.parquet", ["short", "x" * 300])
    with pytest.raises(DataError) as info:
        RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=100, truncation="error"))
    message = str(info.value)
    expected_len = len(f"User: {'x' * 300}{INSTRUCTION}\nAssistant: ")
    assert "row 1" in message and f"{expected_len} tokens" in message and "max_prompt_length (100)" in message


def test_a_prompt_of_exactly_max_prompt_length_tokens_is_kept_whole(tmp_path, tokenizer, capsys):
    """verl keeps a prompt of len <= data.max_prompt_length: one of exactly that many tokens is over no limit, so
    no data.truncation mode refuses or cuts it and data.filter_overlong_prompts does not drop it."""
    question = "x" * 50
    text = f"User: {question}{INSTRUCTION}\nAssistant: "  # the chat template's text, one token a character
    path = _write(tmp_path / "a.parquet", [question])
    for data in (DataConfig(max_prompt_length=len(text), truncation="error"),
                 DataConfig(max_prompt_length=len(text), truncation="left"),
                 DataConfig(max_prompt_length=len(text), filter_overlong_prompts=True)):
        dataset = RLHFDataset(path, tokenizer, data)
        assert len(dataset) == 1 and dataset.dropped_overlong == 0
        assert tokenizer.decode(dataset.prompt_ids[0]) == text
    assert capsys.readouterr().err == ""  # no notice of a cut or a drop
    # one token less of room and the same prompt is over it
    with pytest.raises(DataError, match=rf"prompt has {len(text)} tokens > data.max_prompt_length \({len(text) - 1}\)"):
        RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=len(text) - 1, truncation="error"))


def test_left_and_right_truncation_and_filtering(tmp_path, tokenizer, capsys):
    path = _write(tmp_path / "a.parquet", ["short", "y" * 300])
    left = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=100, truncation="left"))
    right = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=100, truncation="right"))
    assert len(left.prompt_ids[1]) == len(right.prompt_ids[1]) == 100
    assert tokenizer.decode(left.prompt_ids[1]).endswith("Assistant: ")
    assert tokenizer.decode(right.prompt_ids[1]).startswith("User: yyy")
    # each cut is said at start-up, with what it took: a right cut loses the template's "Assistant: "
    assert capsys.readouterr().err.splitlines() == [
        f"notice: data.train_files: data.truncation={side} cut 1 of 2 prompts longer than data.max_prompt_length "
        f"(100 tokens) to that length (first: {path} row 1), keeping their {kept}"
        for side, kept in (("left", "ends: their starts are gone (a system turn where there is one, the start of the "
                                    "question)"),
                           ("right", "starts: the end of the question and a chat template's generation prompt are "
                                     "gone, so the policy continues the user's text rather than answering it"))]
    kept = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=100, filter_overlong_prompts=True))
    assert len(kept) == 1 and kept.dropped_overlong == 1
    assert capsys.readouterr().err.splitlines()[-1] == ("notice: data.train_files: data.filter_overlong_prompts "
                                                        "dropped 1 of 2 prompts longer than data.max_prompt_length "
                                                        "(100 tokens); 1 remain")
    with pytest.raises(DataError, match=r"data.train_batch_size \(2\) is larger than the dataset \(1 prompts, after "
                                        r"data.filter_overlong_prompts dropped 1 longer than data.max_prompt_length\)"):
        PromptSampler(len(kept), 2, dropped=kept.dropped_overlong)
    # middle: the first 50 tokens and the last 50 (a character tokenizer: one character a token)
    middle = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=100, truncation="middle"))
    whole = tokenizer.decode(RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=400)).prompt_ids[1])
    assert tokenizer.decode(middle.prompt_ids[1]) == whole[:50] + whole[-50:]


def test_filter_overlong_prompts_drops_a_long_prompt_whatever_data_truncation_says(tmp_path, tokenizer):
    """verl filters the over-long prompts out as it builds the dataset, before any truncation: with
    data.filter_overlong_prompts a data.truncation mode cuts nothing, the long prompt is gone and the short one whole."""
    path = _write(tmp_path / "a.parquet", ["short", "y" * 300])
    for side in ("left", "right", "middle"):
        dataset = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=100, filter_overlong_prompts=True,
                                                          truncation=side))
        assert len(dataset) == 1 and dataset.dropped_overlong == 1, side
        assert tokenizer.decode(dataset.prompt_ids[0]) == f"User: short{INSTRUCTION}\nAssistant: ", side


def test_each_truncation_keeps_verls_tokens_of_an_odd_limit(tmp_path, tokenizer):
    """With data.max_prompt_length=101, as verl cuts: left keeps the last 101 tokens, right the first 101, and
    middle the first 101 // 2 = 50 and the last 101 - 50 = 51 (the end gets the odd token)."""
    path = _write(tmp_path / "a.parquet", ["0123456789" * 30])
    whole = tokenizer.decode(RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=400)).prompt_ids[0])
    assert len(whole) > 300  # (a character tokenizer: one character a token)
    kept = {side: tokenizer.decode(RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=101,
                                                                            truncation=side)).prompt_ids[0])
            for side in ("left", "right", "middle")}
    assert kept == {"left": whole[-101:], "right": whole[:101], "middle": whole[:50] + whole[-51:]}


def test_chat_template_kwargs_reach_the_template(tmp_path):
    thinking = build_char_tokenizer()
    thinking.chat_template = ("{% for m in messages %}User: {{ m['content'] }}\n{% endfor %}Assistant: "
                              "{% if enable_thinking is defined and not enable_thinking %}(no thinking) {% endif %}")
    path = _write(tmp_path / "a.parquet", ["Hi"])
    plain = RLHFDataset(path, thinking, DataConfig(max_prompt_length=200))
    off = RLHFDataset(path, thinking, DataConfig(max_prompt_length=200,
                                                 apply_chat_template_kwargs={"enable_thinking": False}))
    assert thinking.decode(plain.prompt_ids[0]) == f"User: Hi{INSTRUCTION}\nAssistant: "
    assert thinking.decode(off.prompt_ids[0]) == f"User: Hi{INSTRUCTION}\nAssistant: (no thinking) "


def test_a_tool_call_list_inside_a_message_reaches_the_template_as_a_list(tmp_path):
    # pandas reads a list inside a message as a NumPy array; the template must iterate the calls themselves
    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                         "{% for c in m.tool_calls or [] %}<call {{ c.name }}>{% endfor %}|{% endfor %}Assistant: ")
    row = make_record("q", "s", "1", "train", 0, "src")
    row["prompt"] = [{"role": "user", "content": "add", "tool_calls": None},
                     {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": "{}"}]},
                     {"role": "tool", "content": "3", "tool_calls": None},
                     {"role": "user", "content": "so?", "tool_calls": None}]
    path = tmp_path / "t.parquet"
    pd.DataFrame([row]).to_parquet(path)
    data = RLHFDataset(str(path), tok, DataConfig(max_prompt_length=400, return_raw_chat=True))
    assert tok.decode(data.prompt_ids[0]) == "user: add|assistant: <call add>|tool: 3|user: so?|Assistant: "
    raw = data.collate([0]).meta["raw_prompt"][0]
    assert raw[1]["tool_calls"] == [{"name": "add", "arguments": "{}"}]
    assert type(raw[1]["tool_calls"]) is list


def test_a_template_that_writes_the_bos_token_gives_one_bos_with_an_encoder_that_adds_one(tmp_path):
    """Llama-style: the chat template writes ``{{ bos_token }}`` and the encoder adds BOS to what it encodes. The
    template is applied once, with the generation prompt, and its text is not encoded again with special tokens
    (as verl encodes it, add_special_tokens=False): one BOS, where two would open every prompt."""
    from tokenizers.processors import TemplateProcessing

    llama = build_char_tokenizer()
    llama._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", llama.bos_token_id)])
    assert llama("x")["input_ids"][0] == llama.bos_token_id  # (the encoder adds BOS)
    llama.chat_template = ("{{ bos_token }}{% for m in messages %}User: {{ m['content'] }}\n{% endfor %}"
                           "{% if add_generation_prompt %}Assistant: {% endif %}")
    dataset = RLHFDataset(_write(tmp_path / "a.parquet", ["Hi"]), llama, DataConfig(max_prompt_length=200))
    ids = dataset.prompt_ids[0]
    assert ids.count(llama.bos_token_id) == 1 and ids[0] == llama.bos_token_id
    assert llama.decode(ids) == f"<s>User: Hi{INSTRUCTION}\nAssistant: "


def test_prompts_that_come_with_images_are_said_to_train_without_them(tmp_path, tokenizer, capsys):
    """verl's multimodal rows (geo3k's) carry their pictures in an ``images`` column (``videos`` for clips) and an
    ``<image>`` placeholder in the question. Prompts are text here: the pictures are not read, and a run trained and
    validated on questions about a picture it never saw without a word."""
    rows = [make_record(q, f"{q} #### {i}", str(i), "train", i, "hiyouga/geometry3k")
            for i, q in enumerate(["<image>Find x.", "<image>Find y.", "What is 2+2?"])]
    picture = {"bytes": b"\x89PNG", "path": None}
    frame = pd.DataFrame(rows).assign(images=[[picture], [picture], []])
    frame.to_parquet(tmp_path / "geo.parquet")
    dataset = RLHFDataset(str(tmp_path / "geo.parquet"), tokenizer, DataConfig(max_prompt_length=200))
    assert len(dataset) == 3
    assert capsys.readouterr().err.splitlines() == [
        f"notice: data.train_files: 2 of 3 prompts come with images (column 'images', verl's data.image_key), which "
        f"are not read (first: {tmp_path / 'geo.parquet'} row 0): prompts are text here, so the policy is asked "
        "about pictures it never sees, and any <image> placeholder stays in the question as text; train a "
        "multimodal task with verl, or give prompts that hold all they ask about"]
    # a column with no picture in it (nulls, empty lists), or none at all: nothing to say
    frame.assign(images=[None, [], None]).to_parquet(tmp_path / "none.parquet")
    RLHFDataset(str(tmp_path / "none.parquet"), tokenizer, DataConfig(max_prompt_length=200))
    RLHFDataset(_write(tmp_path / "text.parquet", ["Hi"]), tokenizer, DataConfig(max_prompt_length=200))
    assert capsys.readouterr().err == ""
    # a clip is said as such
    frame.drop(columns="images").assign(videos=[None, None, [{"bytes": b"", "path": "clip.mp4"}]]).to_parquet(
        tmp_path / "clip.parquet")
    RLHFDataset(str(tmp_path / "clip.parquet"), tokenizer, DataConfig(max_prompt_length=200), key="data.val_files")
    assert capsys.readouterr().err.startswith(
        "notice: data.val_files: 1 of 3 prompts come with videos (column 'videos', verl's data.video_key), which are "
        f"not read (first: {tmp_path / 'clip.parquet'} row 2)")


def test_missing_file_and_missing_column(tmp_path, tokenizer):
    with pytest.raises(DataError, match="does not exist"):
        RLHFDataset(str(tmp_path / "nope.parquet"), tokenizer, DataConfig())
    pd.DataFrame({"prompt": ["x"]}).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="reward_model"):
        RLHFDataset(str(tmp_path / "bad.parquet"), tokenizer, DataConfig())
    # a folder and a pattern were "does not exist" (of a folder that does)
    with pytest.raises(DataError, match=rf"data.train_files: {tmp_path} is a folder; name its parquet files .*; it "
                                        "holds bad.parquet"):
        RLHFDataset(str(tmp_path), tokenizer, DataConfig())
    with pytest.raises(DataError, match=r"does not exist \(a pattern is not expanded: list the files\)"):
        RLHFDataset(str(tmp_path / "*.parquet"), tokenizer, DataConfig())
    # a folder without a parquet file was "name its parquet files", of none: it says so, and what it holds
    folder = tmp_path / "texts"
    (folder / "more").mkdir(parents=True)
    for name in ("b.csv", "a.txt"):
        (folder / name).write_text("x")
    with pytest.raises(DataError) as error:
        RLHFDataset(str(folder), tokenizer, DataConfig())
    assert str(error.value) == (f"data.train_files: {folder} is a folder with no parquet file (it holds a.txt, b.csv, "
                                "more/); name parquet files of prompts (a list: data.train_files=[a.parquet,"
                                "b.parquet])")
    (folder / "more").rmdir()
    for name in ("b.csv", "a.txt"):
        (folder / name).unlink()
    with pytest.raises(DataError, match=r"is a folder with no parquet file \(it is empty\); name parquet files"):
        RLHFDataset(str(folder), tokenizer, DataConfig(), key="data.val_files")


def test_sampler_covers_each_epoch_once_in_seeded_order():
    sampler = PromptSampler(10, 3, shuffle=True, seed=5)
    assert sampler.batches_per_epoch == 3
    epoch0 = [sampler.next_batch() for _ in range(3)]
    rows0 = [r for _, rows in epoch0 for r in rows]
    assert {e for e, _ in epoch0} == {0}
    assert len(rows0) == len(set(rows0)) == 9  # one row dropped, none repeated
    epoch, rows = sampler.next_batch()
    assert epoch == 1
    again = PromptSampler(10, 3, shuffle=True, seed=5)
    assert [again.next_batch()[1] for _ in range(3)] == [rows for _, rows in epoch0]
    other = PromptSampler(10, 3, shuffle=True, seed=6)
    assert [other.next_batch()[1] for _ in range(3)] != [rows for _, rows in epoch0]


def _torch_batches(n: int, batch_size: int, seed: int, epochs: int) -> list[list[int]]:
    """verl's batches: a RandomSampler over one generator seeded once, in drop_last batches, epoch after epoch."""
    sampler = torch.utils.data.RandomSampler(range(n), generator=torch.Generator().manual_seed(seed))
    batches = torch.utils.data.BatchSampler(sampler, batch_size, drop_last=True)
    return [rows for _ in range(epochs) for rows in batches]


@pytest.mark.parametrize(("n", "batch_size", "seed"), [(10, 3, 5), (32, 8, 1), (7, 7, 0)])
def test_sampler_draws_the_batches_of_verls_random_sampler_for_the_same_seed(n, batch_size, seed):
    expected = _torch_batches(n, batch_size, seed, epochs=3)
    sampler = PromptSampler(n, batch_size, shuffle=True, seed=seed)
    drawn = [sampler.next_batch() for _ in range(len(expected))]
    assert [rows for _, rows in drawn] == expected
    assert [epoch for epoch, _ in drawn] == [e for e in range(3) for _ in range(n // batch_size)]


def test_sampler_draws_each_epochs_permutation_once(monkeypatch):
    """Two permutations a pass (verl's order and its empty tail), not every epoch's again at each batch."""
    calls = []
    randperm = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *args, **kwargs: calls.append(args) or randperm(*args, **kwargs))
    sampler = PromptSampler(10, 3, shuffle=True, seed=5)
    for _ in range(9):  # 3 epochs of 3 batches
        sampler.next_batch()
    assert len(calls) == 6


def test_sampler_in_order_without_shuffle():
    sampler = PromptSampler(7, 3, shuffle=False, seed=5)
    assert [sampler.next_batch() for _ in range(4)] == [(0, [0, 1, 2]), (0, [3, 4, 5]), (1, [0, 1, 2]),
                                                        (1, [3, 4, 5])]


def test_sampler_in_order_says_which_prompts_never_train(capsys):
    """In order, every epoch is the same whole batches: of 7 prompts in batches of 3, row 6 never trains, and
    nothing said so."""
    sampler = PromptSampler(7, 3, shuffle=False, seed=5)
    drawn = {row for _ in range(6) for row in sampler.next_batch()[1]}
    assert drawn == {0, 1, 2, 3, 4, 5}
    assert capsys.readouterr().err == (
        "notice: data.train_batch_size (3) leaves 1 of the 7 prompts out of every epoch: with data.shuffle=false "
        "always the last 1, which never train; set data.shuffle=true, or a batch size that divides 7\n")
    PromptSampler(7, 3, shuffle=True, seed=5)  # shuffled: each epoch leaves another one out
    PromptSampler(6, 3, shuffle=False, seed=5)  # nothing left out
    assert capsys.readouterr().err == ""


def test_sampler_resumes_with_the_next_unseen_batch():
    expected = _torch_batches(20, 4, 1, epochs=2)  # 5 batches an epoch: the save falls in the second
    first = PromptSampler(20, 4, seed=1)
    seen = [first.next_batch()[1] for _ in range(7)]
    state = first.state_dict()
    assert state == {"epoch": 1, "batch_in_epoch": 2, "seed": 1, "n": 20, "order": "one_generator"}
    resumed = PromptSampler(20, 4, seed=1)
    resumed.load_state_dict(state)
    seen += [resumed.next_batch()[1] for _ in range(3)]
    assert seen == expected


def _seed_and_epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order before verl's: each epoch a generator of its own, seeded by the seed and the epoch."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def test_a_state_saved_before_the_order_marker_resumes_with_its_own_order():
    """A checkpoint from before verl's order, saved at epoch 1's third batch: the rest of that epoch, and the
    epochs after, keep the order it was drawn in, so no prompt of the epoch is repeated or skipped."""
    old = {"epoch": 1, "batch_in_epoch": 2, "seed": 3, "n": 20}
    sampler = PromptSampler(20, 4, seed=3)
    sampler.load_state_dict(old)
    rest = [sampler.next_batch() for _ in range(4)]
    epoch1, epoch2 = _seed_and_epoch_order(20, 3, 1), _seed_and_epoch_order(20, 3, 2)
    assert rest == [(1, epoch1[8:12]), (1, epoch1[12:16]), (1, epoch1[16:20]), (2, epoch2[0:4])]
    # saved again, it says which rule it was drawn in, and resumes with it again
    state = sampler.state_dict()
    assert state == {"epoch": 2, "batch_in_epoch": 1, "seed": 3, "n": 20, "order": "seed_and_epoch"}
    again = PromptSampler(20, 4, seed=3)
    again.load_state_dict(state)
    assert again.next_batch() == (2, epoch2[4:8])


def test_sampler_refuses_a_state_with_an_unknown_order():
    sampler = PromptSampler(20, 4, seed=3)
    with pytest.raises(DataError, match="the checkpoint's sampler has an unknown order 'other'"):
        sampler.load_state_dict({"epoch": 0, "batch_in_epoch": 1, "seed": 3, "n": 20, "order": "other"})


def test_sampler_rejects_a_batch_larger_than_the_data():
    with pytest.raises(DataError, match=r"train_batch_size \(8\) is larger than the dataset \(5"):
        PromptSampler(5, 8)


def test_batch_select_split_repeat_concat():
    batch = Batch({"x": torch.arange(6).view(3, 2)}, {"m": ["a", "b", "c"]})
    assert batch.select([2, 0])["x"].tolist() == [[4, 5], [0, 1]]
    assert batch.select([2, 0]).meta["m"] == ["c", "a"]
    parts = batch.split(2)
    assert [len(p) for p in parts] == [2, 1]
    assert Batch.concat(parts)["x"].tolist() == batch["x"].tolist()
    rep = batch.repeat_interleave(2)
    assert rep.meta["m"] == ["a", "a", "b", "b", "c", "c"]
    assert rep["x"][:, 0].tolist() == [0, 0, 2, 2, 4, 4]
    with pytest.raises(ValueError, match="disagree"):
        Batch({"x": torch.zeros(2)}, {"m": ["a"]})


GOOD_PROMPT = [{"role": "user", "content": "What is 3+4?"}]


@pytest.mark.parametrize("prompts, row, problem", [
    ([GOOD_PROMPT, None], 1, "prompt is null"),
    ([GOOD_PROMPT, []], 1, "prompt is an empty list of messages"),
    ([GOOD_PROMPT, [{"role": "user", "content": None}]], 1, "prompt message 0 has a null 'content'"),
    ([GOOD_PROMPT, [{"role": "system", "content": "Be brief."}, {"role": None, "content": "Hi"}]], 1,
     "prompt message 1 has a null 'role'"),
    ([[{"content": "What is 3+4?"}], [{"content": "Hi"}]], 0, "prompt message 0 has no 'role'"),
    ([["What is 3+4?"], ["Hi"]], 0, "prompt message 0 is a str, not a {role, content} mapping"),
    ([b"What is 3+4?\xff", b"Hi"], 0, "prompt is binary (bytes), not a list of {role, content} messages"),
    # json.dumps(messages) (a CSV round trip, some exports): one user turn holding the JSON, were it taken
    ([json.dumps(GOOD_PROMPT)] * 2, 0, "the prompt ('prompt') is the JSON text of a message list"),
])
def test_a_malformed_prompt_is_a_data_error_naming_its_file_and_row(tmp_path, tokenizer, prompts, row, problem):
    """The second file's bad row is named by its row within that file, with what is wrong with it."""
    good = _write(tmp_path / "a.parquet", ["one", "two"])
    rows = [make_record(f"q{i}", f"s #### {i}", str(i), "train", i, "synthetic/arithmetic") for i in range(2)]
    for record, prompt in zip(rows, prompts):
        record["prompt"] = prompt
    bad = tmp_path / "b.parquet"
    pd.DataFrame(rows).to_parquet(bad)
    with pytest.raises(DataError) as info:
        RLHFDataset([good, str(bad)], tokenizer, DataConfig(max_prompt_length=200))
    assert str(info.value).startswith(f"{bad} row {row}: {problem}; ")


def test_a_prompt_in_another_column_names_the_config_key(tmp_path, tokenizer):
    rows = [make_record("q", "s #### 1", "1", "train", 0, "synthetic/arithmetic")]
    rows[0]["question_messages"] = []
    pd.DataFrame(rows).to_parquet(tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r"row 0: prompt is an empty list of messages \(column 'question_messages', "
                                        r"data.prompt_key\)"):
        RLHFDataset(str(tmp_path / "a.parquet"), tokenizer,
                    DataConfig(max_prompt_length=200, prompt_key="question_messages"))


def test_a_prompt_the_chat_template_refuses_is_a_data_error_naming_its_row(tmp_path):
    strict = build_char_tokenizer()
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                            "{{ raise_exception('System role not supported') }}{% endif %}"
                            "User: {{ m['content'] }}\n{% endfor %}Assistant: ")
    rows = [make_record(f"q{i}", f"s #### {i}", str(i), "train", i, "synthetic/arithmetic") for i in range(3)]
    rows[2]["prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q2"}]
    path = tmp_path / "a.parquet"
    pd.DataFrame(rows).to_parquet(path)
    with pytest.raises(DataError, match=rf"^{path} row 2: the tokenizer's chat template refuses the prompt "
                                        r"\(TemplateError: System role not supported\)"):
        RLHFDataset(str(path), strict, DataConfig(max_prompt_length=200))


def test_an_empty_file_says_it_has_no_rows(tmp_path, tokenizer):
    path = _write(tmp_path / "a.parquet", ["one"])
    pd.read_parquet(path).iloc[:0].to_parquet(path)
    with pytest.raises(DataError) as info:
        RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=200), key="data.val_files")
    assert str(info.value) == f"data.val_files: {path} has no rows; give files with prompts"


def test_every_prompt_filtered_out_says_so(tmp_path, tokenizer):
    path = _write(tmp_path / "a.parquet", ["x" * 300, "y" * 300])
    with pytest.raises(DataError, match=r"no prompts left: all 2 are longer than data.max_prompt_length \(100\) "
                                        "and data.filter_overlong_prompts drops them"):
        RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=100, filter_overlong_prompts=True))


def test_a_reward_model_of_text_is_named_as_such(tmp_path, tokenizer):
    """The JSON text of a reward_model mapping (a CSV round trip) and a bare answer were reported as a missing ground
    truth, with the hint to go without one: the cell's type is what is wrong."""
    rows = [make_record(q, "s", str(i), "train", i, "synthetic/arithmetic") for i, q in enumerate(["1+1", "2+2"])]
    frame = pd.DataFrame(rows)
    for cells, expected in (([json.dumps(row["reward_model"]) for row in rows], "reward_model is the JSON text of a "
                             "mapping, not a {style, ground_truth} mapping: parse it before writing the parquet"),
                            (["0", "1"], "reward_model is a str, not a {style, ground_truth} mapping")):
        path = tmp_path / "rows.parquet"
        frame.assign(reward_model=cells).to_parquet(path)  # a parquet column is all text or all structs
        for needed in (True, False):  # malformed either way: it is not a missing ground truth
            with pytest.raises(DataError) as error:
                RLHFDataset(str(path), tokenizer, DataConfig(max_prompt_length=200), require_ground_truth=needed)
            assert str(error.value).startswith(f"{path} row 0: {expected}")


def test_prompt_roles_outside_the_chat_format_are_refused_naming_every_row(tmp_path, tokenizer):
    """ShareGPT's human/gpt and a capitalised User trained as text (or were dropped) by the chat template: every such
    row is named, across the files, with its roles and their chat-format names, before any prompt is tokenized."""
    good = _write(tmp_path / "a.parquet", ["one", "two"])
    rows = [make_record(f"q{i}", f"s #### {i}", str(i), "train", i, "synthetic/arithmetic") for i in range(3)]
    rows[0]["prompt"] = [{"role": "human", "content": "Hi"}, {"role": "gpt", "content": "Hello"},
                         {"role": "human", "content": "What is 3+4?"}]
    rows[2]["prompt"] = [{"role": "User", "content": "What is 2+2?"}]
    bad = tmp_path / "b.parquet"
    pd.DataFrame(rows).to_parquet(bad)
    with pytest.raises(DataError) as info:
        RLHFDataset([good, str(bad)], tokenizer, DataConfig(max_prompt_length=200), key="data.val_files")
    assert str(info.value) == (
        f"data.val_files: 2 prompt(s) have message roles outside the chat format (human, gpt, User), which a chat "
        f"template writes as text or drops: {bad} row 0 (human, gpt); {bad} row 2 (User); rename human -> user, "
        "gpt -> assistant, User -> user (the chat format's roles: system, developer, user, assistant, tool, "
        "function, ipython)")
    rows[2]["prompt"] = [{"role": "bot", "content": "Hi"}, {"role": "user", "content": "What is 2+2?"}]
    del rows[0]
    pd.DataFrame(rows).to_parquet(bad)
    with pytest.raises(DataError, match=rf"\(bot\), which .*: {bad} row 1 \(bot\); give bot a role of the chat "
                                        r"format \(the chat format's roles: system, "):
        RLHFDataset([good, str(bad)], tokenizer, DataConfig(max_prompt_length=200))


def test_the_likely_prompt_column_is_named_where_data_prompt_key_is_missing(tmp_path, tokenizer):
    """A file without data.prompt_key's column: the dataset names the column that likely holds the prompts (chat
    messages first, then text named like a prompt) and the key that reads it; none where no column looks so."""
    from rlhf_core.data.dataset import prompt_column_guess

    messages = pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))
    schema = pa.schema([("data_source", pa.string()), ("ability", pa.string()), ("question", pa.string()),
                        ("conversation", messages), ("extra_info", pa.struct([("question", pa.string())]))])
    assert prompt_column_guess(schema) == "conversation"
    assert prompt_column_guess(pa.schema([("id", pa.int64()), ("question_text", pa.string()),
                                          ("data_source", pa.string())])) == "question_text"
    assert prompt_column_guess(pa.schema([("query", pa.string()), ("instruction", pa.string())])) == "query"
    assert prompt_column_guess(pa.schema([("data_source", pa.string()), ("answer", pa.string()),
                                          ("prompt_tokens", pa.int64())])) is None

    first = pd.read_parquet(_write(tmp_path / "a.parquet", ["one", "two"]))
    first.assign(query=["one", "two"]).drop(columns=["prompt"]).to_parquet(tmp_path / "q.parquet")
    with pytest.raises(DataError) as error:
        RLHFDataset(str(tmp_path / "q.parquet"), tokenizer, DataConfig(max_prompt_length=200))
    assert str(error.value) == ("data.train_files: column(s) ['prompt'] missing; found ['data_source', 'ability', "
                                "'reward_model', 'extra_info', 'query']; the prompts look to be in 'query': set "
                                "data.prompt_key=query")
    assert RLHFDataset(str(tmp_path / "q.parquet"), tokenizer, DataConfig(max_prompt_length=200,
                                                                           prompt_key="query")).rows
    first.drop(columns=["prompt"]).to_parquet(tmp_path / "none.parquet")
    with pytest.raises(DataError) as error:
        RLHFDataset(str(tmp_path / "none.parquet"), tokenizer, DataConfig(max_prompt_length=200))
    assert str(error.value) == ("data.train_files: column(s) ['prompt'] missing; found ['data_source', 'ability', "
                                "'reward_model', 'extra_info']")


def test_gsm8k_as_released_is_pointed_at_its_converter(tmp_path, tokenizer):
    """The hub's GSM8K shards (question, answer) were told "the prompts look to be in 'question': set
    data.prompt_key=question", after which data_source and reward_model were missing: the converter writes them."""
    from rlhf_core.data.gsm8k import preprocess_gsm8k
    from rlhf_core.data.validation import DataReadError, read_parquet

    release = tmp_path / "main"
    release.mkdir()
    answers = ["She has 3 + 4 = <<3+4=7>>7.\n#### 7", "So 2 * 5 = <<2*5=10>>10.\n#### 10"]
    for split in ("train", "test"):
        pd.DataFrame({"question": ["Tom has 3 apples and 4 more. How many?", "What is 2 times 5?"],
                      "answer": answers}).to_parquet(release / f"{split}-00000-of-00001.parquet")
    shard = release / "train-00000-of-00001.parquet"
    # the folder itself, given as the files: its shards are the release, not prompts to name one by one
    with pytest.raises(DataError) as error:
        RLHFDataset(str(release), tokenizer, DataConfig(max_prompt_length=200))
    advice = ("GSM8K as released (question, answer), not verl's prompt data: write verl's columns (prompt, "
              "data_source, reward_model.ground_truth from the answer's '####' line) with rlhf gsm8k --input {} "
              "--output <folder>, and name the train.parquet and test.parquet it writes")
    assert str(error.value) == f"data.train_files: {release} is a folder; it holds {advice.format(release)}"
    # the hub's repository folder (its shards under main/), which the converter reads too; rlhf validate alike
    with pytest.raises(DataError) as error:
        RLHFDataset(str(tmp_path), tokenizer, DataConfig(max_prompt_length=200))
    assert str(error.value) == f"data.train_files: {tmp_path} is a folder; it holds {advice.format(tmp_path)}"
    with pytest.raises(DataReadError) as error:
        read_parquet(release)
    assert str(error.value).endswith(f"is a directory, expected a parquet file: it holds {advice.format(release)}")
    with pytest.raises(DataError) as error:
        RLHFDataset(str(shard), tokenizer, DataConfig(max_prompt_length=200))
    assert str(error.value) == (f"data.train_files: column(s) ['prompt', 'reward_model', 'data_source'] missing; "
                                f"found ['question', 'answer']; {shard} holds {advice.format(release)}")
    # the advice holds: the converter reads that folder, and its output trains with the answers' final lines
    preprocess_gsm8k(release, tmp_path / "out")
    converted = RLHFDataset(str(tmp_path / "out" / "train.parquet"), tokenizer, DataConfig(max_prompt_length=200))
    assert converted.collate([0, 1]).meta["ground_truth"] == ["7", "10"]
    renamed = tmp_path / "gsm8k.parquet"  # not a shard's name: the converter would not find it in its folder
    pd.read_parquet(shard).to_parquet(renamed)
    with pytest.raises(DataError, match=r"with rlhf gsm8k --input <a folder of train.jsonl and test.jsonl, or of "
                                        r"train-\*.parquet and test-\*.parquet> --output <folder>"):
        RLHFDataset(str(renamed), tokenizer, DataConfig(max_prompt_length=200))
    # prompts of one's own in a 'question' column, beside their ground truths: the column is the advice
    own = tmp_path / "own.parquet"
    pd.read_parquet(tmp_path / "out" / "train.parquet").assign(question=["a", "b"], answer=["7", "10"]).drop(
        columns=["prompt"]).to_parquet(own)
    with pytest.raises(DataError, match="the prompts look to be in 'question': set data.prompt_key=question$"):
        RLHFDataset(str(own), tokenizer, DataConfig(max_prompt_length=200))


def test_a_column_of_sft_conversations_is_not_suggested_as_the_prompts(tmp_path, tokenizer):
    """SFT data: each conversation ends with the assistant's answer, which read as a prompt would sit inside it.
    The column is named for what it holds, not offered as data.prompt_key; one ending with a user turn is."""
    def conversation(i: int, answered: bool) -> list[dict]:
        turns = [{"role": "user", "content": f"what is {i}+1?"}]
        return turns + [{"role": "assistant", "content": f"{i + 1}"}] if answered else turns

    for answered in (True, False):
        rows = [{"messages": conversation(i, answered), "data_source": "openai/gsm8k",
                 "reward_model": {"ground_truth": str(i + 1), "style": "rule"}} for i in range(4)]
        path = tmp_path / f"answered_{answered}.parquet"
        pd.DataFrame(rows).to_parquet(path)
        with pytest.raises(DataError) as error:
            RLHFDataset(str(path), tokenizer, DataConfig(max_prompt_length=200))
        found = "data.train_files: column(s) ['prompt'] missing; found ['messages', 'data_source', 'reward_model']; "
        if answered:
            assert str(error.value) == (
                found + "'messages' holds conversations that end with an assistant turn (SFT data): read as prompts, "
                "the answer would sit inside every prompt; write a prompt column of each conversation without its "
                "last assistant turn and set data.prompt_key=<that column>")
        else:
            assert str(error.value) == found + "the prompts look to be in 'messages': set data.prompt_key=messages"


def test_prompts_that_end_with_an_assistant_turn_are_told(tmp_path, tokenizer, capsys):
    """data.prompt_key set to SFT conversations: the answer sits inside the prompt the policy goes on from. The
    rows are taken (verl's dataset takes them) with a notice counting them and naming the first."""
    turns = [[{"role": "user", "content": "what is 1+1?"}],
             [{"role": "user", "content": "what is 2+1?"}, {"role": "assistant", "content": "3"}],
             [{"role": "user", "content": "what is 3+1?"}, {"role": "assistant", "content": "4"}]]
    rows = [{"messages": t, "data_source": "openai/gsm8k", "reward_model": {"ground_truth": "x", "style": "rule"}}
            for t in turns]
    path = tmp_path / "sft.parquet"
    pd.DataFrame(rows).to_parquet(path)
    dataset = RLHFDataset(str(path), tokenizer, DataConfig(max_prompt_length=200, prompt_key="messages"))
    assert len(dataset.rows) == 3
    assert (f"notice: data.train_files: 2 of 3 prompts end with an assistant turn (first: {path} row 1), so the "
            "policy is asked to go on after that answer") in capsys.readouterr().err
    pd.DataFrame(rows[:1]).to_parquet(path)
    RLHFDataset(str(path), tokenizer, DataConfig(max_prompt_length=200, prompt_key="messages"))
    assert "assistant turn" not in capsys.readouterr().err


def _verl_draw(total: int, size: int, seed: int) -> list[int]:
    """verl's RLHFDataset keeps rows ``default_rng(seed).choice(total, size, replace=False)`` in that order."""
    return np.random.default_rng(seed).choice(total, size=size, replace=False).tolist()


def test_max_samples_keeps_verls_seeded_draw_of_rows_in_its_order(tmp_path, tokenizer, capsys):
    questions = [f"What is {i}+1?" for i in range(10)]
    path = _write(tmp_path / "a.parquet", questions)
    dataset = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=200, shuffle=True), max_samples=4, seed=7)
    drawn = _verl_draw(10, 4, 7)
    assert sorted(drawn) != drawn  # the draw's order, not the files' (else this test would not tell them apart)
    assert dataset.positions == drawn
    assert [row["ground_truth"] for row in dataset.rows] == [str(i) for i in drawn]
    assert [row["messages"][0]["content"].split(INSTRUCTION)[0] for row in dataset.rows] == [
        questions[i] for i in drawn]
    assert "notice: data.train_files: data.train_max_samples keeps 4 of 10 prompts, drawn with data.seed 7" \
        in capsys.readouterr().err
    # the seed defaults to the data config's, and another seed keeps other rows
    again = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=200, seed=7), max_samples=4)
    assert again.positions == drawn
    other = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=200, seed=8), max_samples=4)
    assert other.positions == _verl_draw(10, 4, 8) != drawn


def test_max_samples_without_shuffle_keeps_the_first_rows_and_minus_one_keeps_all(tmp_path, tokenizer, capsys):
    path = _write(tmp_path / "a.parquet", [f"q{i}" for i in range(6)])
    first = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=200, shuffle=False), key="data.val_files",
                        max_samples=2)
    assert first.positions == [0, 1]
    assert "data.val_max_samples keeps 2 of 6 prompts, the first ones" in capsys.readouterr().err
    for size in (-1, 0, 6, 9):  # -1 as verl's default; any size <= 0 or of all the rows keeps them all, unshuffled
        assert RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=200), max_samples=size).positions == [
            0, 1, 2, 3, 4, 5]
    assert "max_samples" not in capsys.readouterr().err


def test_max_samples_draws_before_overlong_prompts_are_filtered(tmp_path, tokenizer):
    # as verl: the draw is over every row, and the filter then drops the long ones among those drawn
    questions = [("long " * 40 if i % 2 else "") + f"q{i}" for i in range(8)]
    path = _write(tmp_path / "a.parquet", questions)
    drawn = _verl_draw(8, 5, 1)
    data = DataConfig(max_prompt_length=120, filter_overlong_prompts=True, seed=1)
    dataset = RLHFDataset(path, tokenizer, data, max_samples=5)
    assert dataset.positions == [i for i in drawn if i % 2 == 0]
    assert dataset.dropped_overlong == sum(i % 2 for i in drawn)


def test_the_trainer_keeps_train_and_val_max_samples_drawn_with_data_seed(workspace, one_thread):
    from rlhf_core.config import load_config
    from rlhf_core.main_ppo import build_trainer

    cfg = load_config(workspace.overrides(workspace.root / "max_samples", "data.train_max_samples=12",
                                          "data.val_max_samples=3", "trainer.seed=5"))
    trainer = build_trainer(cfg)
    try:
        # data.seed (1 by default) draws the rows, not trainer.seed
        assert trainer.train_dataset.positions == _verl_draw(32, 12, 1)
        assert trainer.val_dataset.positions == _verl_draw(8, 3, 1)
        assert trainer.sampler.n == 12
    finally:
        trainer.close()


def test_a_batch_over_the_prompts_left_names_each_key_that_left_them_and_each_that_gives_more():
    # 64 of 8192 rows kept, 9 of those too long: the files hold more, so no "add prompts"
    with pytest.raises(DataError, match=re.escape(
            "data.gen_batch_size (64) is larger than the dataset (55 prompts, after data.train_max_samples keeps 64 "
            "of 8192 and data.filter_overlong_prompts dropped 9 longer than data.max_prompt_length): lower "
            "data.gen_batch_size, raise data.train_max_samples or raise data.max_prompt_length")):
        PromptSampler(55, 64, key="data.gen_batch_size", dropped=9, sampled=(64, 8192))
    with pytest.raises(DataError, match=re.escape(
            "data.train_batch_size (8) is larger than the dataset (5 prompts): lower data.train_batch_size or add "
            "prompts")):
        PromptSampler(5, 8)
