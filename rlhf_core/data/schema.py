"""The verl prompt-dataset schema shared by every data source, and the preference schema beside it.

A prompt row is ``data_source``, ``prompt`` (chat messages), ``ability``,
``reward_model {style, ground_truth}`` and ``extra_info {split, index, answer, question}``; ``ability`` and
``extra_info`` are optional (:data:`OPTIONAL_COLUMNS`): the data commands write them, as verl's do, but neither
the trainer nor a reward function reads ``ability``, and a row without ``extra_info`` is numbered by its row in
its own file (:func:`problem_index`), as verl's RLHFDataset takes it (two such files give
repeated ids, which validation's ``problem_id_unique`` and the evaluation refuse).
A preference row (for reward models) is ``prompt`` (chat messages, as above), ``chosen`` and
``rejected`` (assistant texts, the preferred one first), ``data_source`` and ``extra_info`` (a dict).
Chat messages are a non-empty list of ``{role, content}`` mappings with string values (:func:`prompt_problem`),
each role one of :data:`CHAT_ROLES` (:func:`unknown_roles`, :func:`roles_problem`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from rlhf_core.atomic import staged_files

INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'
PROMPT_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")  # as the data commands write them
OPTIONAL_COLUMNS = ("ability", "extra_info")  # a prompt table may go without them (preference data needs extra_info)
REQUIRED_COLUMNS = tuple(c for c in PROMPT_COLUMNS if c not in OPTIONAL_COLUMNS)
PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected", "data_source", "extra_info")
#: message roles of the chat format (HF's and OpenAI's); ShareGPT's "human"/"gpt" or "User" are not among them
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
#: roles of other formats (ShareGPT's) and their chat-format names; a role in other letter case is its lower case
ROLE_RENAMES = {"human": "user", "gpt": "assistant"}
_FINAL_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def extract_final_answer(solution: str) -> str | None:
    """The text after the last ``####`` of a reference solution, commas removed; None if absent."""
    if "####" not in solution:
        return None
    tail = solution.rsplit("####", 1)[1].strip()
    match = _FINAL_ANSWER.search("####" + tail)
    answer = match.group(1).replace(",", "").strip() if match else ""
    return answer or None


def make_record(question: str, solution: str, ground_truth: str, split: str, index: int, data_source: str) -> dict:
    """One dataset row in verl's schema."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": question + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": int(index), "answer": solution, "question": question},
    }


def write_parquets_atomic(frames: Mapping[Path, pd.DataFrame], overwrite: bool = False) -> list[Path]:
    """Write each frame to its path, all or none: every file is written to a temporary name beside its path first
    (:func:`~rlhf_core.atomic.staged_files`) and renamed into place only once all are written and fsynced, so that
    a run failed or interrupted (Ctrl-C) midway leaves the previous files as they were, never a new train.parquet
    beside an old test.parquet; the folders it made (the output folder, its missing parents) are removed again,
    since an empty output folder would pass for output. An existing file is kept unless ``overwrite``
    (FileExistsError, before anything is written)."""
    paths = [Path(path) for path in frames]
    existing = [str(path) for path in paths if path.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{', '.join(existing)} exist(s); pass --overwrite to replace")
    made: list[Path] = []  # the folders this call makes, each before its parent: removed in this order if it fails
    for folder in dict.fromkeys(path.parent for path in paths):
        missing = folder
        while not missing.exists() and missing not in made:
            made.append(missing)
            missing = missing.parent
        folder.mkdir(parents=True, exist_ok=True)
    try:
        with staged_files(paths) as temps:
            for tmp, frame in zip(temps, frames.values()):
                frame.to_parquet(tmp, index=False)
    except BaseException:
        for folder in made:  # (left where it holds anything else: another process's files)
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return paths


def read_rows(path, columns: list[str] | None = None) -> pd.DataFrame:
    """A parquet file's rows (only ``columns``, where given), as every reader of the project takes them: a struct's
    integer field stays integers where a row has it null, or the whole cell (pandas' own reading makes the field
    floats then: ``extra_info.index`` 10 as 10.0, a problem id ``source/10.0``, a ground truth 72 as 72.0), and so
    does an integer column with a null, as ``datasets`` hands rows to verl."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=columns)
    frame = table.to_pandas(integer_object_nulls=True)
    # a map column (Spark's MapType) reads back as lists of (key, value) pairs, an empty map as an empty list:
    # its cells say that they were a map, which their values alone cannot (extra_info_problem)
    for field in table.schema:
        if pa.types.is_map(field.type):
            frame[field.name] = pd.Series([cell if cell is None else ParquetMap(cell) for cell in frame[field.name]],
                                          index=frame.index, dtype=object)
    return frame


def folder_listing(folder: Path, shown: int = 6) -> str:
    """What ``folder`` holds, for a message: its first ``shown`` names (a folder's with a trailing /), or that it is
    empty."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    if not names:
        return "it is empty"
    return f"it holds {', '.join(names[:shown])}{', ...' if len(names) > shown else ''}"


def gsm8k_json_lines(path: Path) -> bool:
    """Whether ``path`` is JSON Lines whose first object has ``question`` and ``answer``: GSM8K as released."""
    try:
        with open(path, "rb") as handle:
            first = handle.readline(1 << 20)
        row = json.loads(first.decode("utf-8-sig"))
    except (OSError, ValueError):
        return False
    return isinstance(row, dict) and {"question", "answer"} <= row.keys()


def gsm8k_advice(what: str, folder: str | os.PathLike) -> str:
    """``what`` (a file or folder of GSM8K as released) is taken by ``rlhf gsm8k`` from ``folder``, not as it is."""
    return (f"{what} GSM8K as released (question, answer), not verl's prompt data: write verl's columns (prompt, "
            f"data_source, reward_model.ground_truth from the answer's '####' line) with rlhf gsm8k --input {folder} "
            "--output <folder>, and name the train.parquet and test.parquet it writes")


def gsm8k_release_folder(path: Path) -> str | None:
    """What to do with ``path``, a folder ``rlhf gsm8k`` reads as GSM8K as released (train.jsonl and test.jsonl,
    or the hub's train-*.parquet and test-*.parquet, there or under main/), else None: the converter's advice, or
    where a split is missing (the converter needs both) what it says of that."""
    import pyarrow.parquet

    from rlhf_core.data.gsm8k import GSM8KDataError, detect_layout

    def released(file: Path) -> bool:  # (the first object of JSON Lines, or the columns of a shard)
        if file.suffix == ".jsonl":
            return gsm8k_json_lines(file)
        try:
            return {"question", "answer"} <= set(pyarrow.parquet.read_schema(file).names)
        except Exception:  # noqa: BLE001 - an unreadable shard is no release
            return False

    try:
        _, files = detect_layout(path)
    except GSM8KDataError as exc:  # found nothing, or a split alone
        found = [*path.glob("*.jsonl"), *path.glob("*.parquet"), *(path / "main").glob("*.parquet")]
        if "both train and test are needed" in str(exc) and any(released(file) for file in found):
            return f"it holds GSM8K as released, which rlhf gsm8k writes as prompt data, but {exc}"
        return None
    return gsm8k_advice("it holds", path) if released(files["train"][0]) else None


def other_format(path: str | os.PathLike) -> str | None:
    """What a data path that is no parquet file holds, where another tool writes it so, and how to write it as
    parquet (the trainer and the checks read parquet, as verl's RLHFDataset does): a ``datasets`` save_to_disk
    folder (Arrow files; a DatasetDict's holds one folder a split), GSM8K's release (a folder of train.jsonl and
    test.jsonl, or one of them: ``rlhf gsm8k`` writes it), or JSON / JSON Lines text. None otherwise."""
    path = Path(path)
    if path.is_dir():
        if (release := gsm8k_release_folder(path)) is not None:
            return release
        if (path / "dataset_dict.json").is_file():
            try:
                splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
            except (OSError, ValueError, KeyError, TypeError):
                splits = ["train"]
            return (f"it is a datasets save_to_disk folder of splits ({', '.join(map(str, splits))}), Arrow files, "
                    f"not parquet: write each split as a parquet file, e.g. datasets.load_from_disk('{path}')"
                    f"['{splits[0]}'].to_parquet('{splits[0]}.parquet'), and name those files")
        if (path / "state.json").is_file() and any(path.glob("*.arrow")):
            return ("it is a datasets save_to_disk folder, Arrow files, not parquet: write it as a parquet file, "
                    f"e.g. datasets.load_from_disk('{path}').to_parquet('{path.name}.parquet'), and name that file")
        return None
    try:
        with open(path, "rb") as handle:
            start = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    except OSError:
        return None
    if start not in (b"{", b"["):
        return None
    if start == b"{" and gsm8k_json_lines(path):  # (rlhf gsm8k reads a folder's train.jsonl and test.jsonl)
        folder = gsm8k_release_folder(path.parent) if path.name in ("train.jsonl", "test.jsonl") else None
        if folder is not None:  # its folder's advice (or what the converter lacks there), said of this file
            return folder.replace("it holds", "it is JSON Lines of", 1)
        return gsm8k_advice("it is JSON Lines of", "<a folder of train.jsonl and test.jsonl>")
    lines = "" if start == b"[" else ", lines=True"  # a JSON array, or one object a line
    return (f"it is JSON{'' if lines == '' else ' Lines'} text, not parquet: write it as a parquet file, e.g. "
            f"pandas.read_json('{path}'{lines}).to_parquet('{path.stem}.parquet') (chat messages as lists of "
            "{role, content} objects, reward_model as an object), and name that file")


class ParquetMap(list):
    """A cell of a parquet map column as :func:`read_rows` gives it: its (key, value) pairs, as pandas reads them."""


def is_missing(value) -> bool:
    """None, pandas' markers (NA, NaT) or a NaN of any float width: a float column's NaN is its null."""
    if value is None or value is pd.NA or value is pd.NaT:
        return True
    return isinstance(value, (float, np.floating)) and math.isnan(value)


def json_message_list(value) -> bool:
    """Whether a string cell is the JSON text of a message list (``json.dumps(messages)``, what a CSV round trip
    or some exports leave): taken as one user turn it would train on the JSON itself."""
    if not isinstance(value, str) or not value.lstrip().startswith("["):
        return False
    try:
        parsed = json.loads(value)
    except ValueError:
        return False
    return isinstance(parsed, list) and bool(parsed) and all(isinstance(m, dict) and "role" in m for m in parsed)


def prompt_problem(prompt) -> str | None:
    """What is wrong with a ``prompt`` cell as chat messages, or None when it is a non-empty list of messages,
    each a mapping with a string ``role`` and a string ``content`` (other keys are free). The RL dataset takes a
    plain string as one user turn before it asks; preference data does not."""
    if is_missing(prompt):
        return "prompt is null"
    if isinstance(prompt, (bytes, bytearray)):
        return "prompt is binary (bytes), not a list of {role, content} messages"
    if isinstance(prompt, str):
        if json_message_list(prompt):  # the trainer refuses it as such, not as a plain string
            return "prompt is the JSON text of a message list: store the list itself (json.loads before writing)"
        return "prompt is a plain string, not a list of {role, content} messages"
    if not isinstance(prompt, (list, tuple, np.ndarray)):
        return f"prompt is a {type(prompt).__name__}, not a list of {{role, content}} messages"
    if len(prompt) == 0:
        return "prompt is an empty list of messages"
    for number, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            return f"prompt message {number} is a {type(message).__name__}, not a {{role, content}} mapping"
        for key in ("role", "content"):
            if key not in message:
                return f"prompt message {number} has no '{key}'"
            value = message[key]
            if is_missing(value):
                return f"prompt message {number} has a null '{key}'"
            if not isinstance(value, str):
                return f"prompt message {number}'s '{key}' is a {type(value).__name__}, not text"
    return None


def unknown_roles(messages) -> list[str]:
    """The roles of chat ``messages`` (:func:`prompt_problem` None) outside :data:`CHAT_ROLES`, each once, in order:
    a chat template writes such a turn as text, or drops it."""
    return list(dict.fromkeys(m["role"] for m in messages if m["role"] not in CHAT_ROLES))


def roles_problem(found, shown: int = 5) -> str | None:
    """What is wrong with the prompts ``found`` as ``(where, roles)`` (where: the file and row; roles: its
    :func:`unknown_roles`), with the renames that fix them, or None when there are none."""
    found = [(where, roles) for where, roles in found if roles]
    if not found:
        return None
    roles = list(dict.fromkeys(role for _, row_roles in found for role in row_roles))
    renames = {role: ROLE_RENAMES.get(role.lower(), role.lower()) for role in roles}
    fixes = [f"{role} -> {name}" for role, name in renames.items() if name in CHAT_ROLES]
    others = [role for role, name in renames.items() if name not in CHAT_ROLES]
    todo = ([f"rename {', '.join(fixes)}"] if fixes else []) + \
        ([f"give {', '.join(others)} a role of the chat format"] if others else [])
    rows = "; ".join(f"{where} ({', '.join(row_roles)})" for where, row_roles in found[:shown])
    return (f"{len(found)} prompt(s) have message roles outside the chat format ({', '.join(roles)}), which a chat "
            f"template writes as text or drops: {rows}{'; ...' if len(found) > shown else ''}; {' and '.join(todo)} "
            f"(the chat format's roles: {', '.join(CHAT_ROLES)})")


def reward_model_problem(reward_model) -> str | None:
    """What is wrong with a ``reward_model`` cell that is there but is not a ``{style, ground_truth}`` mapping (a
    parquet struct), or None (a mapping, or a missing cell: the ground-truth checks tell of those). Its ground truth
    would read as missing: the JSON text of a mapping (a CSV round trip) or a bare answer must be told apart."""
    if is_missing(reward_model) or isinstance(reward_model, Mapping):
        return None
    kind = type(reward_model).__name__
    if isinstance(reward_model, str) and reward_model.lstrip().startswith("{"):
        return ("reward_model is the JSON text of a mapping, not a {style, ground_truth} mapping: parse it "
                "before writing the parquet (frame['reward_model'] = frame['reward_model'].map(json.loads))")
    return (f"reward_model is a {kind}, not a {{style, ground_truth}} mapping: store e.g. "
            "{'style': 'rule', 'ground_truth': '72'} (a parquet struct)")


def extra_info_problem(extra_info) -> str | None:
    """What is wrong with an ``extra_info`` cell that is there but is not a mapping (a parquet struct), or None (a
    mapping, or a missing cell, which reads as an empty mapping as a file without the column does: pandas and
    pyarrow give a null for a row written without it beside rows that have it)."""
    if is_missing(extra_info) or isinstance(extra_info, Mapping):
        return None
    if isinstance(extra_info, str) and extra_info.lstrip().startswith("{"):
        return ("extra_info is the JSON text of a mapping, not a mapping: parse it before writing the parquet "
                "(frame['extra_info'] = frame['extra_info'].map(json.loads))")
    # a parquet map (Spark's MapType) reads back as its (key, value) pairs: the column's type says so where the
    # file was read by read_rows (an empty map too); elsewhere non-empty pairs, which nothing else reads back as
    if isinstance(extra_info, ParquetMap) or isinstance(extra_info, list | np.ndarray) and len(extra_info) and \
            all(isinstance(pair, tuple) and len(pair) == 2 for pair in extra_info):
        return ("extra_info is a parquet map, which verl's reader cannot read: write a struct (e.g. a dict "
                "{'index': 0, 'split': 'train'} per row from pandas, or a StructType column from Spark)")
    return (f"extra_info is a {type(extra_info).__name__}, not a mapping: store e.g. {{'index': 0, 'split': "
            "'train'} (a parquet struct), or leave the cell null")


def plain_value(value):
    """A parquet cell as Python objects (lists, dicts, str, int, float), as ``datasets`` gives them to verl:
    pandas reads a list as a NumPy array and a number as a NumPy scalar."""
    if isinstance(value, np.ndarray):
        return [plain_value(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    if isinstance(value, dict):
        return {k: plain_value(v) for k, v in value.items()}
    return value.item() if isinstance(value, np.generic) else value


def ground_truth(reward_model):
    """A row's ``reward_model.ground_truth`` as stored, or None where it has none (no mapping, or a missing
    value, :func:`is_missing`): what the trainer, preflight and validation read alike."""
    truth = reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
    return None if is_missing(truth) else truth


def problem_index(extra_info, source_row: int):
    """A prompt row's index in its problem id: ``extra_info.index`` as stored, else the row's number within its
    own file."""
    index = extra_info.get("index") if isinstance(extra_info, dict) else None
    return int(source_row) if index is None else index


def problem_id(data_source: str, index) -> str:
    """A prompt row's id in training, validation and evaluation: ``data_source/index`` (:func:`problem_index`)."""
    return f"{data_source}/{index}"


def widened(value: float, stored: str) -> bool:
    """Whether ``value``, read from a ``stored`` (float32, float16) field as a double, has digits its stored
    precision does not (0.1 as 0.10000000149011612; 2.5 and whole numbers read back as written)."""
    narrow = np.dtype(stored).type(value)
    return np.format_float_positional(narrow, unique=True) != np.format_float_positional(value, unique=True)


def single_precision_truth(schema) -> str | None:
    """``float32``/``float16`` where a parquet ``schema`` stores ``reward_model.ground_truth`` so, else None."""
    import pyarrow

    try:
        kind = schema.field("reward_model").type.field("ground_truth").type
    except (KeyError, AttributeError, TypeError):  # no such column or field, or not a struct
        return None
    return {pyarrow.float32(): "float32", pyarrow.float16(): "float16"}.get(kind)
