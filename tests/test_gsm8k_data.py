"""GSM8K preprocessing: both real layouts, schema, determinism and the error paths."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_core.cli.data import gsm8k
from rlhf_core.config import load_config
from rlhf_core.data.gsm8k import GSM8KDataError, detect_layout, preprocess_gsm8k
from rlhf_core.data.schema import INSTRUCTION, PROMPT_COLUMNS, extract_final_answer

REPO_ROOT = Path(__file__).resolve().parent.parent


def _raw_rows(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


@pytest.fixture(scope="module")
def jsonl_out(gsm8k_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("jsonl_out")
    return out, preprocess_gsm8k(gsm8k_dir, out)


@pytest.fixture(scope="module")
def frames(jsonl_out) -> dict[str, pd.DataFrame]:
    out, _ = jsonl_out
    return {split: pd.read_parquet(out / f"{split}.parquet") for split in ("train", "test")}


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _small_release(folder: Path, train: list[dict] | None = None) -> Path:
    good = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(3)]
    _write_jsonl(folder / "train.jsonl", train if train is not None else good)
    _write_jsonl(folder / "test.jsonl", good[:2])
    return folder


def _gsm8k_advice(folder) -> str:
    return ("GSM8K as released (question, answer), not verl's prompt data: write verl's columns (prompt, data_source, "
            f"reward_model.ground_truth from the answer's '####' line) with rlhf gsm8k --input {folder} --output "
            "<folder>, and name the train.parquet and test.parquet it writes")


def test_the_release_given_as_training_data_is_sent_to_rlhf_gsm8k_whose_files_then_load(tmp_path):
    """Its train.jsonl had pandas' read_json(...).to_parquet advice, whose file the trainer then refused as GSM8K as
    released (a second round trip); its folder "name its parquet files", of none."""
    from rlhf_core.data.dataset import DataError, check_files, read_frames

    release = _small_release(tmp_path / "release")
    with pytest.raises(DataError) as error:
        read_frames(check_files(str(release / "train.jsonl"), "data.train_files"))
    assert str(error.value) == (f"{release / 'train.jsonl'} is not a readable parquet file: it is JSON Lines of "
                                + _gsm8k_advice(release))
    with pytest.raises(DataError) as error:
        check_files(str(release), "data.train_files")
    assert str(error.value) == f"data.train_files: {release} is a folder; it holds " + _gsm8k_advice(release)
    # the advice as given: rlhf gsm8k reads that folder, and its train.parquet has the release's 3 answers as truths
    assert gsm8k(["--input", str(release), "--output", str(tmp_path / "out")]) == 0
    rows = read_frames(check_files(str(tmp_path / "out" / "train.parquet"), "data.train_files"))
    assert [truth["ground_truth"] for truth in rows["reward_model"]] == ["1", "2", "3"]
    # a file of the release under another name: the command reads train.jsonl and test.jsonl of a folder
    renamed = release / "gsm8k_train.jsonl"
    renamed.write_bytes((release / "train.jsonl").read_bytes())
    with pytest.raises(DataError, match=re.escape("rlhf gsm8k --input <a folder of train.jsonl and test.jsonl> ")):
        read_frames(check_files(str(renamed), "data.train_files"))
    # one split of the release alone: the command needs both, and says so; the advice is what it would say
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "train.jsonl").write_bytes((release / "train.jsonl").read_bytes())
    lacks = (f"GSM8K as released, which rlhf gsm8k writes as prompt data, but {alone} holds the jsonl layout but "
             f"lacks the test split (found only {alone / 'train.jsonl'}); both train and test are needed")
    with pytest.raises(DataError) as error:
        check_files(str(alone), "data.train_files")
    assert str(error.value) == f"data.train_files: {alone} is a folder; it holds {lacks}"
    with pytest.raises(DataError) as error:
        read_frames(check_files(str(alone / "train.jsonl"), "data.train_files"))
    assert str(error.value) == f"{alone / 'train.jsonl'} is not a readable parquet file: it is JSON Lines of {lacks}"
    assert gsm8k(["--input", str(alone), "--output", str(tmp_path / "alone_out")]) != 0  # (as the advice says)
    # JSON Lines of other keys keeps the generic conversion
    other = _write_jsonl(tmp_path / "other" / "train.jsonl", [{"question": "q"}])
    with pytest.raises(DataError, match=re.escape(f"pandas.read_json('{other}', lines=True).to_parquet(")):
        read_frames(check_files(str(other), "data.train_files"))


def test_the_real_release_folder_and_its_train_file_are_sent_to_rlhf_gsm8k(gsm8k_dir):
    from rlhf_core.data.dataset import DataError, check_files, read_frames

    with pytest.raises(DataError, match=re.escape(_gsm8k_advice(gsm8k_dir))):
        check_files(str(gsm8k_dir), "data.train_files")
    with pytest.raises(DataError, match=re.escape(_gsm8k_advice(gsm8k_dir))):
        read_frames(check_files(str(gsm8k_dir / "train.jsonl"), "data.train_files"))


# --- real data ---------------------------------------------------------------------------------


def test_jsonl_layout_row_counts(jsonl_out, frames):
    _, summary = jsonl_out
    assert summary["layout"] == "jsonl"
    assert summary["train"]["rows"] == 7473 and summary["test"]["rows"] == 1319
    assert summary["train"]["skipped"] == summary["test"]["skipped"] == 0
    assert len(frames["train"]) == 7473 and len(frames["test"]) == 1319


@pytest.mark.parametrize("nested", [True, False], ids=["main-subfolder", "shards-folder"])
def test_parquet_layout_gives_identical_output(gsm8k_dir, jsonl_out, tmp_path, nested):
    # The real shards are linked, not copied, into a folder that holds only the parquet layout.
    shards = tmp_path / "in" / "main" if nested else tmp_path / "in"
    shards.mkdir(parents=True)
    for source in sorted((gsm8k_dir / "main").glob("*.parquet")):
        (shards / source.name).symlink_to(source)
    summary = preprocess_gsm8k(tmp_path / "in", tmp_path / "out")
    assert summary["layout"] == "parquet"
    assert (summary["train"]["rows"], summary["test"]["rows"]) == (7473, 1319)
    jsonl_dir, _ = jsonl_out
    for split in ("train", "test"):
        assert (tmp_path / "out" / f"{split}.parquet").read_bytes() == (
            jsonl_dir / f"{split}.parquet"
        ).read_bytes()


def test_schema_and_prompt_of_row_zero(gsm8k_dir, frames):
    raw = _raw_rows(gsm8k_dir / "train.jsonl")
    train = frames["train"]
    assert tuple(train.columns) == PROMPT_COLUMNS
    row = train.iloc[0]
    assert row["data_source"] == "openai/gsm8k"
    assert row["ability"] == "math"
    prompt = list(row["prompt"])
    assert len(prompt) == 1 and prompt[0]["role"] == "user"
    assert prompt[0]["content"] == raw[0]["question"] + INSTRUCTION
    assert prompt[0]["content"].startswith("Natalia sold clips to 48 of her friends in April")
    assert prompt[0]["content"].endswith('output the final answer after "####".')
    assert row["reward_model"] == {"style": "rule", "ground_truth": "72"}
    assert row["extra_info"] == {
        "split": "train",
        "index": 0,
        "answer": raw[0]["answer"],
        "question": raw[0]["question"],
    }
    for split, frame in frames.items():
        assert [info["index"] for info in frame["extra_info"]] == list(range(len(frame)))
        assert {info["split"] for info in frame["extra_info"]} == {split}
        assert set(frame["data_source"]) == {"openai/gsm8k"}


@pytest.mark.parametrize(
    ("split", "index", "expected"),
    [
        ("train", 0, "72"),  # "#### 72"
        ("train", 1, "10"),  # "#### 10"
        ("train", 345, "1080"),  # "#### 1,080": thousands separator dropped
        ("train", 367, "850000"),  # "#### 850,000"
        ("train", 5844, "-47"),  # "#### -47": negative answer
        ("test", 0, "18"),  # "#### 18"
        ("test", 4, "20"),  # "#### 20"
    ],
)
def test_ground_truth_by_hand(frames, split, index, expected):
    assert frames[split].iloc[index]["reward_model"]["ground_truth"] == expected


@pytest.mark.parametrize(
    ("solution", "expected"),
    [
        ("step #### note\n#### 5", "5"),  # an earlier '####' in the working is not the final answer
        ("He had #### 3 left.\n#### 1,234", "1234"),
    ],
)
def test_the_final_answer_is_after_the_last_marker(solution, expected):
    assert extract_final_answer(solution) == expected


def test_deterministic(gsm8k_dir, jsonl_out, tmp_path):
    preprocess_gsm8k(gsm8k_dir, tmp_path)
    jsonl_dir, _ = jsonl_out
    for split in ("train", "test"):
        assert (tmp_path / f"{split}.parquet").read_bytes() == (jsonl_dir / f"{split}.parquet").read_bytes()


# --- overwrite ----------------------------------------------------------------------------------


def test_refuses_to_overwrite(tmp_path, capsys):
    source = _small_release(tmp_path / "in")
    out = tmp_path / "out"
    assert gsm8k(["--input", str(source), "--output", str(out)]) == 0
    before = (out / "train.parquet").read_bytes()
    capsys.readouterr()

    with pytest.raises(FileExistsError, match="--overwrite"):
        preprocess_gsm8k(source, out)
    assert gsm8k(["--input", str(source), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err and "Traceback" not in err
    assert (out / "train.parquet").read_bytes() == before

    # a changed release, so that the output can only match it if --overwrite did write
    _write_jsonl(source / "train.jsonl", [{"question": "What is 5 + 5?", "answer": "5 + 5 = 10\n#### 10"}])
    assert gsm8k(["--input", str(source), "--output", str(out), "--overwrite"]) == 0
    train = pd.read_parquet(out / "train.parquet")
    assert [rm["ground_truth"] for rm in train["reward_model"]] == ["10"]
    assert "What is 5 + 5?" in train["prompt"][0][0]["content"]


def test_max_rows_keeps_the_first_rows_of_each_split(tmp_path, capsys):
    source = _small_release(tmp_path / "in")  # 3 train rows, 2 test rows
    assert gsm8k(["--input", str(source), "--output", str(tmp_path / "out"), "--max-rows", "2"]) == 0
    train, test = (pd.read_parquet(tmp_path / "out" / f"{name}.parquet") for name in ("train", "test"))
    assert [r["ground_truth"] for r in train["reward_model"]] == ["1", "2"]
    assert [r["ground_truth"] for r in test["reward_model"]] == ["1", "2"]
    assert "train: 2 rows" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gsm8k(["--input", str(source), "--output", str(tmp_path / "other"), "--max-rows", "0"])


def test_a_release_saved_with_a_byte_order_mark_converts(tmp_path):
    source = _small_release(tmp_path / "in")
    for name in ("train.jsonl", "test.jsonl"):  # as an editor saving "UTF-8 with BOM" writes them
        (source / name).write_bytes(b"\xef\xbb\xbf" + (source / name).read_bytes())
    assert gsm8k(["--input", str(source), "--output", str(tmp_path / "out")]) == 0
    train = pd.read_parquet(tmp_path / "out" / "train.parquet")
    assert [r["ground_truth"] for r in train["reward_model"]] == ["1", "2", "3"]
    assert train["prompt"][0][0]["content"].startswith("What is 0 + 1?")


def test_verls_gsm8k_command_line_runs_as_it_is(tmp_path, capsys):
    """verl's examples/data_preprocess/gsm8k.py takes the hub download as --local_dataset_path and the output folder as
    --local_save_dir (or --local_dir); they were refused as unknown, with --input and --output said to be missing."""
    hub = tmp_path / "gsm8k"  # openai/gsm8k as the hub stores it: a folder per config
    (hub / "main").mkdir(parents=True)
    for split, rows in (("train", 3), ("test", 2)):
        pd.DataFrame({"question": [f"What is {i} + 1?" for i in range(rows)],
                      "answer": [f"{i} + 1 = {i + 1}\n#### {i + 1}" for i in range(rows)]}).to_parquet(
            hub / "main" / f"{split}-00000-of-00001.parquet")
    for option in ("--local_save_dir", "--local_dir"):
        out = tmp_path / option.strip("-")
        assert gsm8k(["--local_dataset_path", str(hub), option, str(out)]) == 0
        assert [r["ground_truth"] for r in pd.read_parquet(out / "train.parquet")["reward_model"]] == ["1", "2", "3"]
        assert [r["ground_truth"] for r in pd.read_parquet(out / "test.parquet")["reward_model"]] == ["1", "2"]
    capsys.readouterr()
    with pytest.raises(SystemExit):  # verl's copy to HDFS is not made here: refused before anything is written
        gsm8k(["--local_dataset_path", str(hub), "--local_save_dir", str(tmp_path / "hdfs"), "--hdfs_dir", "hdfs://x"])
    assert "--hdfs_dir (verl's copy of the output to HDFS) is not done here" in capsys.readouterr().err
    assert not (tmp_path / "hdfs").exists()


def test_without_an_output_folder_the_files_go_where_verls_script_and_the_trainer_default_to(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert gsm8k(["--local_dataset_path", str(_small_release(tmp_path / "hub"))]) == 0
    written = tmp_path / "home" / "data" / "gsm8k"
    assert [r["ground_truth"] for r in pd.read_parquet(written / "train.parquet")["reward_model"]] == ["1", "2", "3"]
    assert load_config([]).data.train_files == "~/data/gsm8k/train.parquet"  # where a run looks without the key


def test_a_tilde_in_the_folders_is_the_home_folder_as_the_trainer_reads_it(tmp_path, monkeypatch, capsys):
    """--output=~/data/gsm8k (no shell expands '~' after '=') made a folder named '~' in the working directory, where
    the trainer, expanding data.train_files' ~/data/gsm8k/train.parquet, and verl's script look in the home folder."""
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    _small_release(home / "gsm8k_release")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert gsm8k(["--input=~/gsm8k_release", "--local_save_dir=~/data/gsm8k"]) == 0
    assert sorted(p.name for p in (home / "data" / "gsm8k").iterdir()) == ["test.parquet", "train.parquet"]
    assert list(work.iterdir()) == []
    assert f"train: 3 rows -> {home / 'data' / 'gsm8k' / 'train.parquet'}" in capsys.readouterr().out


def test_module_entry_point(tmp_path):
    source = _small_release(tmp_path / "in")
    command = [
        sys.executable,
        "-m",
        "rlhf_core.data.gsm8k",
        "--input",
        str(source),
        "--output",
        str(tmp_path / "out"),
    ]
    first = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("train: 3 rows") and lines[1].startswith("test: 2 rows")
    again = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    assert again.returncode == 2 and "Traceback" not in again.stderr and "--overwrite" in again.stderr


# --- invalid rows -------------------------------------------------------------------------------


def _with_bad_row() -> list[dict]:
    return [
        {"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"},
        {"question": "What is 2 + 2?", "answer": "2 + 2 = 4, no final marker here"},
        {"question": "What is 3 + 3?", "answer": "3 + 3 = 6\n#### 6"},
    ]


def test_invalid_row_is_reported_and_fails(tmp_path, capsys):
    source = _small_release(tmp_path / "in", train=_with_bad_row())
    assert gsm8k(["--input", str(source), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert str(source / "train.jsonl") in err
    assert "row 1 (line 2)" in err
    assert "2 + 2 = 4, no final marker here" in err
    assert "--skip-invalid" in err
    assert not (tmp_path / "out" / "train.parquet").exists()
    assert not (tmp_path / "out" / "test.parquet").exists()


def test_skip_invalid_counts_and_keeps_source_index(tmp_path, capsys):
    source = _small_release(tmp_path / "in", train=_with_bad_row())
    out = tmp_path / "out"
    assert gsm8k(["--input", str(source), "--output", str(out), "--skip-invalid"]) == 0
    captured = capsys.readouterr()
    assert "train: 2 rows" in captured.out and "skipped 1 invalid row" in captured.out
    assert "test: 2 rows" in captured.out and "skipped 0 invalid row" in captured.out
    assert "row 1 (line 2)" in captured.err
    train = pd.read_parquet(out / "train.parquet")
    assert [info["index"] for info in train["extra_info"]] == [0, 2]
    assert [rm["ground_truth"] for rm in train["reward_model"]] == ["2", "6"]


def test_row_numbers_count_rows_not_lines_nor_shards(tmp_path):
    """extra_info.index is the row's place in its split: a blank line of a jsonl file is no row, and the rows of a
    second parquet shard follow those of the first."""
    good = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(3)]
    release = _small_release(tmp_path / "jsonl")
    (release / "train.jsonl").write_text(json.dumps(good[0]) + "\n\n" + json.dumps(good[1]) + "\n", encoding="utf-8")
    preprocess_gsm8k(release, tmp_path / "jsonl_out")
    train = pd.read_parquet(tmp_path / "jsonl_out" / "train.parquet")
    assert [info["index"] for info in train["extra_info"]] == [0, 1]

    shards = tmp_path / "parquet"
    shards.mkdir()
    for name, rows in (("train-00000-of-00002", good[:2]), ("train-00001-of-00002", good[2:]),
                       ("test-00000-of-00001", good[:1])):
        pd.DataFrame(rows).to_parquet(shards / f"{name}.parquet")
    preprocess_gsm8k(shards, tmp_path / "parquet_out")
    train = pd.read_parquet(tmp_path / "parquet_out" / "train.parquet")
    assert [info["index"] for info in train["extra_info"]] == [0, 1, 2]
    assert [rm["ground_truth"] for rm in train["reward_model"]] == ["1", "2", "3"]


@pytest.mark.parametrize("question", ["", "   ", None], ids=["empty", "blank", "null"])
def test_a_question_without_text_is_an_invalid_row(tmp_path, question):
    rows = [{"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"},
            {"question": question, "answer": "2 + 2 = 4\n#### 4"}]
    source = _small_release(tmp_path / "in", train=rows)
    with pytest.raises(GSM8KDataError, match=re.escape("row 1 (line 2): question is empty or not text")):
        preprocess_gsm8k(source, tmp_path / "out")


def test_missing_key_in_jsonl(tmp_path):
    source = _small_release(tmp_path / "in", train=[{"question": "q", "solution": "#### 1"}])
    with pytest.raises(GSM8KDataError, match=r"train\.jsonl, line 1 .*missing key\(s\) \['answer'\]"):
        preprocess_gsm8k(source, tmp_path / "out")


def test_missing_column_in_parquet(tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    pd.DataFrame({"question": ["q"], "solution": ["#### 1"]}).to_parquet(
        folder / "train-00000-of-00001.parquet"
    )
    pd.DataFrame({"question": ["q"], "answer": ["#### 1"]}).to_parquet(folder / "test-00000-of-00001.parquet")
    assert gsm8k(["--input", str(folder), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "train-00000-of-00001.parquet" in err and "missing column(s) ['answer']" in err
    assert "found columns ['question', 'solution']" in err


def test_malformed_json_line(tmp_path):
    source = _small_release(tmp_path / "in")
    with open(source / "test.jsonl", "a", encoding="utf-8") as handle:
        handle.write('{"question": "oops"\n')
    with pytest.raises(GSM8KDataError, match=r"test\.jsonl, line 3: not valid JSON"):
        preprocess_gsm8k(source, tmp_path / "out")


# --- layout detection ---------------------------------------------------------------------------


def test_unknown_layout_lists_what_was_looked_for(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "notes.txt").write_text("nothing here")
    assert gsm8k(["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "no GSM8K data found" in err and "Traceback" not in err
    looked_for = ", ".join(str(tmp_path / "in" / name) for name in (
        "train.jsonl", "test.jsonl", "main/train-*.parquet", "main/test-*.parquet", "train-*.parquet", "test-*.parquet"))
    assert f"looked for: {looked_for}." in err  # both layouts, the shards in the folder itself as in its main/


def test_missing_input_folder(tmp_path):
    with pytest.raises(GSM8KDataError, match="does not exist"):
        preprocess_gsm8k(tmp_path / "absent", tmp_path / "out")


def test_missing_split_is_named(tmp_path):
    _write_jsonl(tmp_path / "in" / "train.jsonl", [{"question": "q", "answer": "#### 1"}])
    with pytest.raises(GSM8KDataError, match="lacks the test split"):
        preprocess_gsm8k(tmp_path / "in", tmp_path / "out")


def test_real_folder_holds_both_layouts(gsm8k_dir):
    assert detect_layout(gsm8k_dir)[0] == "jsonl"
    layout, files = detect_layout(gsm8k_dir, layout="parquet")
    assert layout == "parquet" and files["train"][0].parent.name == "main"


def test_a_line_that_is_not_utf8_is_named_like_a_bad_json_line(tmp_path, capsys):
    """Latin-1 'é' (byte 0xe9) on line 4 of train.jsonl, after three good lines: exit 1, one line naming the
    file, the line and the byte's column (18: after '{"question": "Caf')."""
    source = _small_release(tmp_path / "in")
    with open(source / "train.jsonl", "ab") as handle:
        handle.write(b'{"question": "Caf\xe9 costs 3. What is 3 + 1?", "answer": "3 + 1 = 4\\n#### 4"}\n')
    assert gsm8k(["--input", str(source), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {source / 'train.jsonl'}, line 4: not UTF-8 text (byte 0xe9 at column 18); "
                   "the GSM8K release is UTF-8: save the file as UTF-8"]
    assert not (tmp_path / "out").exists()


def test_a_final_answer_the_rule_cannot_match_is_an_invalid_row(tmp_path, capsys):
    """'#### 18 dollars' (and '#### 18.') gave the ground truths '18 dollars' and '18.', which no '#### 18'
    matches: written without a word, to fail at validation or preflight later."""
    rows = [{"question": "How much?", "answer": "9 + 9 = 18\n#### 18 dollars"},
            {"question": "How many?", "answer": "9 + 9 = 18\n#### 18."},
            {"question": "And now?", "answer": "3 + 3 = 6\n#### 6"}]
    source = _small_release(tmp_path / "in", train=rows)
    assert gsm8k(["--input", str(source), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "row 0 (line 1)" in err and "the final answer '18 dollars' is not a number as answers write them" in err
    assert "row 1 (line 2)" in err and "the final answer '18.' is an integer written with a fraction of zeros" in err
    assert gsm8k(["--input", str(source), "--output", str(tmp_path / "out"), "--skip-invalid"]) == 0
    train = pd.read_parquet(tmp_path / "out" / "train.parquet")
    assert [rm["ground_truth"] for rm in train["reward_model"]] == ["6"]


def test_a_parquet_shard_names_integer_answers_beside_a_null_as_stored(tmp_path):
    """An integer answer column with a null read as floats: the rows were named '72.0' and 'nan', not what the
    shard holds (72, and a null, which the JSON lines layout names 'None')."""
    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(pa.table({"question": ["How many?", "And now?", "Why?"], "answer": [72, None, 5]}),
                   folder / "train-00000-of-00001.parquet")  # an int64 column with a null, as the hub's are written
    pd.DataFrame({"question": ["q"], "answer": ["#### 1"]}).to_parquet(folder / "test-00000-of-00001.parquet")
    with pytest.raises(GSM8KDataError) as error:
        preprocess_gsm8k(folder, tmp_path / "out")
    shard = folder / "train-00000-of-00001.parquet"
    assert str(error.value).splitlines()[1:4] == [f"  {shard}, row 0: answer is not text: '72'",
                                                  f"  {shard}, row 1: answer is not text: 'None'",
                                                  f"  {shard}, row 2: answer is not text: '5'"]
