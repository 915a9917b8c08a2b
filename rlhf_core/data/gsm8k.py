"""Turn the GSM8K release into verl-style prompt parquet files.

Usage::

    python -m rlhf_core.data.gsm8k --input IN --output OUT [--overwrite] [--skip-invalid]

(verl's examples/data_preprocess/gsm8k.py spells them ``--local_dataset_path IN --local_save_dir OUT``, which are
taken too.)

``IN`` may hold either layout of the dataset:

* ``jsonl``: the original release, ``IN/train.jsonl`` and ``IN/test.jsonl``;
* ``parquet``: the hub copy, ``IN/main/train-*.parquet`` and ``IN/main/test-*.parquet``, or the
  same shards directly in ``IN`` (``IN/train-*.parquet``).

Both carry ``question`` and ``answer``. When a folder holds both layouts the jsonl files are used
(``--layout`` picks one explicitly). The output is ``OUT/train.parquet`` and ``OUT/test.parquet``,
one row per problem, built by :func:`rlhf_core.data.schema.make_record`; ``extra_info.index`` is
the problem's row number (0-based) in its source split, so it stays traceable when invalid rows
are skipped.

Exit status: 0 on success, 1 for a problem with the input data, 2 when the output already exists
(and ``--overwrite`` was not given) or the command line is wrong.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":  # run as `rlhf gsm8k` is (rlhf_core.cli), before the imports below (pandas), so
    # that a Ctrl-C in the command's first seconds ends it with one line and exit 130, not a traceback
    from rlhf_core.cli import _run

    sys.exit(_run("gsm8k", None, "python -m rlhf_core.data.gsm8k"))

import pandas as pd

from rlhf_core.data.options import GSM8K_LAYOUTS
from rlhf_core.data.schema import extract_final_answer, make_record, read_rows, write_parquets_atomic
from rlhf_core.rewards.gsm8k import unanswerable

DATA_SOURCE = "openai/gsm8k"
SPLITS = ("train", "test")
LAYOUTS = GSM8K_LAYOUTS
SOURCE_COLUMNS = ("question", "answer")
_EXCERPT_CHARS = 80
MAX_REPORTED = 10


class GSM8KDataError(ValueError):
    """The input folder or one of its files cannot be turned into a dataset."""


@dataclass
class _Problem:
    """Where one invalid row sits and what is wrong with it."""

    file: Path
    row: int
    line: int | None
    reason: str
    excerpt: str

    def describe(self) -> str:
        where = f"{self.file}, row {self.row}"
        if self.line is not None:
            where += f" (line {self.line})"
        return f"{where}: {self.reason}: {self.excerpt!r}"


@dataclass
class _Split:
    name: str
    files: list[Path]
    records: list[dict] = field(default_factory=list)
    problems: list[_Problem] = field(default_factory=list)


def _excerpt(text: object) -> str:
    text = str(text)
    return text if len(text) <= _EXCERPT_CHARS else text[: _EXCERPT_CHARS - 3] + "..."


def _parquet_shards(folder: Path, split: str) -> list[Path]:
    return sorted(folder.glob(f"{split}-*.parquet"))


def detect_layout(input_dir: str | Path, layout: str = "auto") -> tuple[str, dict[str, list[Path]]]:
    """Find the GSM8K files in ``input_dir``: returns the layout name and each split's files.

    Raises :class:`GSM8KDataError` naming every place looked at when nothing usable is found.
    """
    root = Path(input_dir)
    if layout not in LAYOUTS:
        raise GSM8KDataError(f"unknown layout {layout!r}; use one of {list(LAYOUTS)}")
    if not root.is_dir():
        raise GSM8KDataError(
            f"input folder {root} does not exist or is not a folder; pass the GSM8K folder with --input"
        )

    jsonl = {split: root / f"{split}.jsonl" for split in SPLITS}
    jsonl_found = {split: [path] for split, path in jsonl.items() if path.is_file()}
    parquet_dirs = [root / "main", root]
    parquet_found: dict[str, list[Path]] = {}
    for folder in parquet_dirs:
        shards = {split: _parquet_shards(folder, split) for split in SPLITS}
        if any(shards.values()):
            parquet_found = {split: files for split, files in shards.items() if files}
            break

    candidates = []
    if layout in ("auto", "jsonl"):
        candidates.append(("jsonl", jsonl_found))
    if layout in ("auto", "parquet"):
        candidates.append(("parquet", parquet_found))
    for name, found in candidates:
        if found:
            missing = [split for split in SPLITS if split not in found]
            if missing:
                raise GSM8KDataError(
                    f"{root} holds the {name} layout but lacks the {' and '.join(missing)} split "
                    f"(found only {', '.join(str(p) for files in found.values() for p in files)}); "
                    "both train and test are needed"
                )
            return name, found

    looked_for = []
    if layout in ("auto", "jsonl"):
        looked_for += [str(jsonl[split]) for split in SPLITS]
    if layout in ("auto", "parquet"):
        looked_for += [str(folder / f"{split}-*.parquet") for folder in parquet_dirs for split in SPLITS]
    raise GSM8KDataError(
        f"no GSM8K data found in {root}; looked for: {', '.join(looked_for)}. "
        "Point --input at the folder holding train.jsonl/test.jsonl or the train-*/test-*.parquet shards."
    )


def _read_jsonl(path: Path) -> list[tuple[int, int | None, dict]]:
    """(row, line, object) for every non-blank line of ``path``."""
    rows = []
    # bytes that are not UTF-8 become lone surrogates, so that the line they are on can be named; a byte-order mark
    # a Windows editor may put first goes, as the data check that sends such a file here reads past it
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as handle:
        for line_no, line in enumerate(handle, start=1):
            try:
                line.encode("utf-8")
            except UnicodeEncodeError as exc:
                byte = ord(line[exc.start]) - 0xDC00  # surrogateescape keeps byte b as U+DC00 + b
                raise GSM8KDataError(
                    f"{path}, line {line_no}: not UTF-8 text (byte 0x{byte:02x} at column {exc.start + 1}); "
                    "the GSM8K release is UTF-8: save the file as UTF-8"
                ) from exc
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise GSM8KDataError(
                    f"{path}, line {line_no}: not valid JSON ({exc.msg} at column {exc.colno}); "
                    "each line must be one JSON object with keys 'question' and 'answer'"
                ) from exc
            if not isinstance(obj, dict):
                raise GSM8KDataError(
                    f"{path}, line {line_no}: expected a JSON object with keys 'question' and 'answer', "
                    f"got {type(obj).__name__}"
                )
            missing = [key for key in SOURCE_COLUMNS if key not in obj]
            if missing:
                raise GSM8KDataError(
                    f"{path}, line {line_no} (row {len(rows)}): missing key(s) {missing}; "
                    f"found keys {sorted(obj)}. Each row needs 'question' and 'answer'."
                )
            rows.append((len(rows), line_no, obj))
    return rows


def _read_parquet(path: Path, first_row: int) -> list[tuple[int, int | None, dict]]:
    try:
        frame = read_rows(path)  # an integer answer beside a null is named as stored, not as 72.0
    except Exception as exc:
        raise GSM8KDataError(f"{path}: cannot be read as parquet ({exc})") from exc
    missing = [col for col in SOURCE_COLUMNS if col not in frame.columns]
    if missing:
        raise GSM8KDataError(
            f"{path}: missing column(s) {missing}; found columns {list(frame.columns)}. "
            "GSM8K shards need 'question' and 'answer'."
        )
    questions = frame["question"].tolist()
    answers = frame["answer"].tolist()
    return [
        (first_row + i, None, {"question": q, "answer": a})
        for i, (q, a) in enumerate(zip(questions, answers))
    ]


def _load_split(name: str, files: list[Path], layout: str) -> _Split:
    split = _Split(name=name, files=files)
    next_row = 0
    for path in files:
        rows = _read_jsonl(path) if layout == "jsonl" else _read_parquet(path, next_row)
        next_row += len(rows)
        for row, line, obj in rows:
            question, answer = obj["question"], obj["answer"]
            if not isinstance(question, str) or not question.strip():
                split.problems.append(
                    _Problem(path, row, line, "question is empty or not text", _excerpt(question))
                )
                continue
            if not isinstance(answer, str):
                split.problems.append(_Problem(path, row, line, "answer is not text", _excerpt(answer)))
                continue
            ground_truth = extract_final_answer(answer)
            if ground_truth is None:
                split.problems.append(
                    _Problem(path, row, line, "answer has no '#### <final answer>' marker", _excerpt(answer))
                )
                continue
            if (why := unanswerable(ground_truth)) is not None:  # e.g. '#### 18 dollars': the rule would miss it
                split.problems.append(_Problem(path, row, line, f"the final answer {why}", _excerpt(answer)))
                continue
            split.records.append(make_record(question, answer, ground_truth, name, row, DATA_SOURCE))
    return split


def preprocess_gsm8k(
    input_dir: str | Path,
    output_dir: str | Path,
    overwrite: bool = False,
    skip_invalid: bool = False,
    layout: str = "auto",
    max_rows: int | None = None,
) -> dict:
    """Write ``output_dir/{train,test}.parquet`` from the GSM8K files in ``input_dir``.

    ``max_rows`` keeps the first rows of each split only (a small training or evaluation set).

    Returns ``{"layout": ..., "train": {"rows", "skipped", "skipped_rows", "output", "sources"},
    "test": {...}}`` where ``skipped_rows`` describes each left-out row (file, row, excerpt).
    Raises :class:`FileExistsError` if an output exists and ``overwrite`` is false (nothing is
    written), and :class:`GSM8KDataError` for unusable input, including rows whose answer lacks
    ``####`` unless ``skip_invalid``. Every split is read and checked before anything is written.
    """
    # '~' is the home folder, as the trainer reads data.train_files (~/data/gsm8k/train.parquet by default) and as
    # verl's script writes --local_save_dir, also where no shell expanded it (--output=~/data/gsm8k, a quoted path)
    input_dir, output_dir = Path(input_dir).expanduser(), Path(output_dir).expanduser()
    outputs = {name: output_dir / f"{name}.parquet" for name in SPLITS}
    existing = [str(path) for path in outputs.values() if path.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"output already exists: {', '.join(existing)}; pass --overwrite to replace it")

    found_layout, files = detect_layout(input_dir, layout)
    splits = [_load_split(name, files[name], found_layout) for name in SPLITS]

    problems = [p for split in splits for p in split.problems]
    if problems and not skip_invalid:
        shown = "\n".join("  " + p.describe() for p in problems[:MAX_REPORTED])
        more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
        raise GSM8KDataError(
            f"{len(problems)} invalid row(s) in {input_dir}:\n{shown}{more}\n"
            "Fix these rows, or rerun with --skip-invalid to leave them out."
        )
    for split in splits:
        if not split.records:
            raise GSM8KDataError(
                f"the {split.name} split ({', '.join(map(str, split.files))}) has no valid rows; nothing to write"
            )

    summary: dict = {"layout": found_layout}
    kept = {split.name: split.records[:max_rows] if max_rows is not None else split.records for split in splits}
    # both files or neither: a run stopped after train.parquet left it beside no (or an older) test.parquet
    write_parquets_atomic({outputs[name]: pd.DataFrame(records) for name, records in kept.items()}, overwrite)
    for split in splits:
        records = kept[split.name]
        summary[split.name] = {
            "rows": len(records),
            "skipped": len(split.problems),
            "skipped_rows": [p.describe() for p in split.problems],
            "output": str(outputs[split.name]),
            "sources": [str(p) for p in split.files],
        }
    return summary
