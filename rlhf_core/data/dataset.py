"""The RL prompt dataset: verl-schema parquet files -> left-padded prompt batches.

Prompts are tokenized once, up front (so an over-long prompt is reported before any
training), with the tokenizer's chat template when it has one. A
:class:`PromptSampler` walks the rows in a seeded order, epoch by epoch, and its
state (epoch, next batch) is saved in checkpoints so a resumed run continues with
the next unseen batch.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow
import pyarrow.parquet
import torch

from rlhf_core.batch import Batch
from rlhf_core.config import DataConfig
from rlhf_core.data.schema import (
    extra_info_problem,
    folder_listing,
    ground_truth,
    gsm8k_advice,
    is_missing,
    json_message_list,
    other_format,
    plain_value,
    problem_id,
    problem_index,
    prompt_problem,
    read_rows,
    reward_model_problem,
    roles_problem,
    unknown_roles,
)


class DataError(ValueError):
    """Bad or missing data, named by file and row."""


#: why a ground truth is needed, and where it is not
TRUTH_HINT = (" (the built-in rule rewards grade against reward_model.ground_truth, in training and in the "
               "pipelines' evaluation; prompts without one train and evaluate with a custom reward function, and "
               "train alone with a reward model and reward_model.rule_coef=0)")


def as_file_list(files: str | Sequence[str]) -> list[Path]:
    names = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    return [Path(os.path.expanduser(str(name))) for name in names]


def check_files(files: str | Sequence[str], key: str) -> list[Path]:
    """Every file exists; raises DataError naming the config key otherwise."""
    paths = as_file_list(files)
    if not paths:
        raise DataError(f"{key} is empty: give at least one parquet file")
    for path in paths:
        if path.is_dir() and (held := other_format(path)) is not None:
            raise DataError(f"{key}: {path} is a folder; {held}")
        if path.is_dir():
            found = sorted(p.name for p in path.glob("*.parquet"))[:4]
            if not found:  # (naming "its parquet files" would send the user looking for what is not there)
                raise DataError(f"{key}: {path} is a folder with no parquet file ({folder_listing(path)}); name "
                                f"parquet files of prompts (a list: {key}=[a.parquet,b.parquet])")
            raise DataError(f"{key}: {path} is a folder; name its parquet files (a list: {key}=[a.parquet,"
                            f"b.parquet]); it holds {', '.join(found)}")
        if not path.is_file():
            pattern = any(char in str(path) for char in "*?[")
            raise DataError(f"{key}: {path} does not exist" + (
                " (a pattern is not expanded: list the files)" if pattern else
                " (preprocess your data first, e.g. python -m rlhf_core.data.gsm8k or python -m "
                "rlhf_core.data.synthetic)"))
    return paths


def read_frames(paths: Sequence[Path]) -> pd.DataFrame:
    frames = []
    for path in paths:
        try:
            frame = read_rows(path)
        except (pyarrow.ArrowException, OSError, ValueError) as exc:
            held = other_format(path)
            raise DataError(f"{path} is not a readable parquet file: {held or exc}") from exc
        frame["_source_file"] = str(path)
        frame["_source_row"] = np.arange(len(frame))
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def needed_columns(config: DataConfig, require_ground_truth: bool = True) -> tuple[str, ...]:
    """The columns every prompt file needs: the prompt (``data.prompt_key``), the data source the reward is routed
    by (``data.reward_fn_key``) and, where rows need a ground truth, ``reward_model``. ``extra_info`` is optional, as
    in verl: a row without it is numbered by its row in its own file (:func:`~rlhf_core.data.schema.problem_index`)."""
    if require_ground_truth:
        return config.prompt_key, "reward_model", config.reward_fn_key
    return config.prompt_key, config.reward_fn_key


def parquet_schema(path: Path) -> pyarrow.Schema:
    """A parquet file's schema (its columns and their types), read without its rows; a DataError naming the file
    where it cannot be read."""
    try:
        return pyarrow.parquet.read_schema(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
        raise DataError(f"{path} is not a readable parquet file: {other_format(path) or exc}") from exc


def columns_not_in_every_file(paths: Sequence[Path], columns: Sequence[str]) -> str | None:
    """What is wrong where some files of a split lack a column of ``columns`` that others have, else None.

    Joined, such a file's rows read as missing values in the column, and each would be reported as a row without
    its prompt or its ground truth, not as the file without the column. A column no file has is the caller's to
    report. Reads the files' schemas only."""
    if len(paths) < 2:
        return None
    names = {path: parquet_schema(path).names for path in paths}
    problems = []
    for column in columns:
        having = [path for path in paths if column in names[path]]
        lacking = [str(path) for path in paths if column not in names[path]]
        if having and lacking:
            one = len(lacking) == 1
            problems.append(f"{', '.join(lacking)} {'lacks' if one else 'lack'} column {column!r}, which "
                            f"{having[0]} has: add it to {'that file' if one else 'those files'}"
                            f"{TRUTH_HINT if column == 'reward_model' else ''}")
    return "; ".join(problems) or None


#: names of the columns likeliest to hold the prompts of a file without data.prompt_key's column, likeliest first
PROMPT_LIKE = ("messages", "conversations", "conversation", "chat", "prompt", "question", "query", "problem",
               "instruction", "input")


def _is_message_list(kind: pyarrow.DataType) -> bool:
    """A parquet type of chat messages: a list of structs with a role and a content."""
    return (pyarrow.types.is_list(kind) or pyarrow.types.is_large_list(kind)) and \
        pyarrow.types.is_struct(kind.value_type) and \
        {"role", "content"} <= {kind.value_type.field(i).name for i in range(kind.value_type.num_fields)}


def prompt_column_guess(schema: pyarrow.Schema) -> str | None:
    """The column of ``schema`` that likely holds the prompts, for a file without data.prompt_key's: a column of
    chat messages, else a text column named like a prompt (:data:`PROMPT_LIKE`, or holding one of those names, as
    ``question_text`` does); by the order of :data:`PROMPT_LIKE`. None where no column looks so."""
    def rank(name: str) -> int:
        lowered = name.lower()
        exact = [i for i, like in enumerate(PROMPT_LIKE) if lowered == like]
        within = [len(PROMPT_LIKE) + i for i, like in enumerate(PROMPT_LIKE) if like in lowered]
        return (exact or within or [2 * len(PROMPT_LIKE)])[0]

    chats = [field.name for field in schema if _is_message_list(field.type)]
    texts = [field.name for field in schema if (pyarrow.types.is_string(field.type) or
                                                pyarrow.types.is_large_string(field.type))
             and rank(field.name) < 2 * len(PROMPT_LIKE)]
    for names in (chats, texts):
        if names:
            return min(names, key=rank)
    return None


#: what a file of preference pairs is, said where it is given as prompt data
PREFERENCE_DATA = ("this is preference data (a prompt with chosen and rejected responses), which trains a reward "
                   "model (rlhf train-rm, or reward_model.train in the pipelines); PPO training and evaluation read "
                   "prompt files (prompt, data_source, reward_model.ground_truth)")


def is_preference_data(schema: pyarrow.Schema) -> bool:
    """Whether a file of this schema holds preference pairs: chosen and rejected responses."""
    return {"chosen", "rejected"} <= set(schema.names)


def ends_with_an_answer(messages: Sequence[Mapping] | None) -> bool:
    """Whether a conversation ends with an assistant turn, as SFT data's do (the answer inside the prompt)."""
    return bool(messages) and (messages[-1] or {}).get("role") == "assistant"


def _ends_with_an_answer(path: Path, column: str, rows: int = 100) -> bool:
    """Whether one of the first ``rows`` conversations in the chat-message column ``column`` of ``path`` ends with
    an assistant turn (:func:`ends_with_an_answer`). Reads that column of the file's first rows only."""
    first = next(pyarrow.parquet.ParquetFile(path).iter_batches(batch_size=rows, columns=[column]), None)
    conversations = first.column(0).to_pylist() if first is not None else []
    return any(ends_with_an_answer(conversation) for conversation in conversations)


def gsm8k_release(paths: Sequence[Path], schemas: Sequence[pyarrow.Schema]) -> str | None:
    """What to do with files of GSM8K as released (``question`` and ``answer``, no ``reward_model``: the hub's
    parquet layout, or its JSON Lines read into parquet), else None: they hold neither verl's prompt nor its ground
    truth, which ``rlhf gsm8k`` writes; a guessed prompt column (``question``) would leave both missing."""
    path = next((p for p, schema in zip(paths, schemas)
                 if {"question", "answer"} <= set(schema.names) and "reward_model" not in schema.names), None)
    if path is None:
        return None
    # the converter reads a folder of the release's shards (train-*.parquet, test-*.parquet) or its JSON Lines
    shard = path.name.startswith(("train-", "test-")) and path.suffix == ".parquet"
    folder = path.parent if shard else "<a folder of train.jsonl and test.jsonl, or of train-*.parquet and " \
        "test-*.parquet>"
    return gsm8k_advice(f"{path} holds", folder)


def missing_columns_problem(paths: Sequence[Path], columns: Sequence[str], key: str, prompt_key: str = "prompt",
                            prompt_option: str = "data.prompt_key=") -> str | None:
    """What to say where no file of ``paths`` has a column of ``columns``, else None: the columns missing and
    those found, and what to do: a file of preference pairs is named as such (they train a reward model), a
    likely prompt column (:func:`prompt_column_guess`) is suggested as ``{prompt_option}<column>`` (but a column of
    conversations that end with an assistant turn, SFT data, is named as such: its answers would sit inside the
    prompts), and a missing ``reward_model`` gets :data:`TRUTH_HINT`. Reads the files' schemas, and the first rows
    of a guessed column of chat messages."""
    schemas = [parquet_schema(path) for path in paths]
    found = [name for name in dict.fromkeys(n for schema in schemas for n in schema.names)
             if not name.startswith("__")]  # (pandas' saved index)
    absent = [column for column in columns if column not in found]
    if not absent:
        return None
    text = f"{key}: column(s) {absent} missing; found {found}"
    if any(is_preference_data(schema) for schema in schemas):
        return f"{text}: {PREFERENCE_DATA}"
    if prompt_key in absent and (release := gsm8k_release(paths, schemas)) is not None:
        return f"{text}; {release}"
    if prompt_key in absent:
        guess, where, schema = next(((g, path, schema) for path, schema in zip(paths, schemas)
                                     if (g := prompt_column_guess(schema)) is not None), (None, None, None))
        if guess is not None and _is_message_list(schema.field(guess).type) and _ends_with_an_answer(where, guess):
            text += (f"; {guess!r} holds conversations that end with an assistant turn (SFT data): read as prompts, "
                     "the answer would sit inside every prompt; write a prompt column of each conversation without "
                     f"its last assistant turn and set {prompt_option}<that column>")
        elif guess is not None:
            text += f"; the prompts look to be in {guess!r}: set {prompt_option}{guess}"
    return text + (TRUTH_HINT if "reward_model" in absent else "")


def prompt_messages(value, where: str, key: str = "prompt") -> list[dict]:
    """A prompt cell as chat messages: a plain string is one user turn, as verl takes it; anything but a
    non-empty list of ``{role, content}`` string messages (:func:`~rlhf_core.data.schema.prompt_problem`) is a
    DataError naming ``where`` (file and row) and column ``key`` (``data.prompt_key``). The roles are not checked
    here: :class:`RLHFDataset` names every row whose roles are outside the chat format
    (:func:`~rlhf_core.data.schema.roles_problem`) at once."""
    if isinstance(value, str) and json_message_list(value):
        raise DataError(f"{where}: the prompt ({key!r}) is the JSON text of a message list; it would train as one "
                        "user turn holding the JSON: store the list itself (e.g. frame[prompt_key] = "
                        "frame[prompt_key].map(json.loads) before writing the parquet)")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    problem = prompt_problem(value)
    if problem is not None:
        column = f" (column '{key}', data.prompt_key)" if key != "prompt" else ""
        raise DataError(f"{where}: {problem}{column}; a prompt is a list of {{'role': ..., 'content': ...}} "
                        "messages with text values, or one string (a user turn)")
    # a list inside a message (an assistant turn's tool_calls) comes from pandas as a NumPy array, which a chat
    # template cannot iterate as verl's plain lists
    return [plain_value(dict(m)) for m in value]


def prompt_token_ids(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """The prompt's token ids. With a chat template they are exactly what
    ``apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)`` gives: rendering to
    text and encoding that again can differ on BPE vocabularies (merges across the template's boundaries,
    a BOS the template writes and the encoder adds again). Without one, the contents joined by newlines, without
    the encoder's special tokens (no BOS). The reward model lays its prompts out by this same rule
    (:func:`~rlhf_core.rewards.reward_model.conversation_ids`). A prompt longer than the tokenizer's
    model_max_length raises no warning: the callers cut or refuse it themselves."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                            tokenizer_kwargs={"verbose": False}, **(template_kwargs or {}))
        return [int(i) for i in ids]
    return tokenizer("\n".join(m["content"] for m in messages), add_special_tokens=False, verbose=False)["input_ids"]


#: what each ``data.truncation`` takes from an over-long prompt, said at start-up beside the count
TRUNCATION_CUTS = {
    "left": "keeping their ends: their starts are gone (a system turn where there is one, the start of the question)",
    "right": "keeping their starts: the end of the question and a chat template's generation prompt are gone, so the "
             "policy continues the user's text rather than answering it",
    "middle": "keeping both ends: the middle of each is gone",
}


def truncate(ids: list[int], limit: int, side: str) -> list[int]:
    """``ids`` cut to ``limit`` tokens: the last ones (``left``), the first (``right``) or both ends
    (``middle``: the first half of the budget from the start, the rest from the end)."""
    if side == "left":
        return ids[-limit:]
    if side == "right":
        return ids[:limit]
    head = limit // 2
    return ids[:head] + ids[len(ids) - (limit - head):]


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-pad token lists to the longest: input_ids, attention_mask, position_ids, each (bs, L)."""
    length = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, ids in enumerate(sequences):
        if ids:
            input_ids[row, length - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, length - len(ids):] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def sample_rows(total: int, max_samples: int, shuffle: bool, seed: int | None) -> list[int]:
    """The positions of the rows verl's ``data.train_max_samples`` / ``data.val_max_samples`` keep of ``total``:
    all where ``max_samples`` is -1 (any size <= 0) or at least ``total``; else, with ``shuffle`` (data.shuffle),
    ``max_samples`` positions drawn without replacement by NumPy's ``default_rng(seed).choice``, in the order drawn
    (verl's draw, so a verl run with the same seed keeps the same rows), and without it the first ``max_samples``."""
    if max_samples <= 0 or max_samples >= total:
        return list(range(total))
    if not shuffle:
        return list(range(max_samples))
    return [int(i) for i in np.random.default_rng(seed).choice(total, size=max_samples, replace=False)]


def too_few_prompts(key: str, batch_size: int, n: int, dropped: int = 0,
                    sampled: tuple[int, int] | None = None) -> str:
    """The refusal of a batch of ``batch_size`` prompts (``key``) over the ``n`` the training files give: what
    left that few (``sampled``: data.train_max_samples kept that many of that many rows; ``dropped``: the rows
    data.filter_overlong_prompts left out of those) and the keys that give more."""
    causes, levers = [], [f"lower {key}"]
    if sampled is not None:
        causes.append(f"data.train_max_samples keeps {sampled[0]} of {sampled[1]}")
        levers.append("raise data.train_max_samples")
    if dropped:
        causes.append(f"data.filter_overlong_prompts dropped {dropped} longer than data.max_prompt_length")
        levers.append("raise data.max_prompt_length")
    if sampled is None:  # (with it, the files hold more prompts than are kept: none need adding)
        levers.append("add prompts")
    why = f", after {' and '.join(causes)}" if causes else ""
    return f"{key} ({batch_size}) is larger than the dataset ({n} prompts{why}): {', '.join(levers[:-1])} or {levers[-1]}"


#: the columns verl's multimodal rows carry their media in (its data.image_key and data.video_key defaults), each
#: with the kind of its placeholder in the prompt text and what a reader calls them
MEDIA_COLUMNS = {"images": ("image", "pictures"), "videos": ("video", "clips")}


def holds_media(value) -> bool:
    """Whether a cell of a media column holds something: not a null, nor an empty list."""
    if is_missing(value):
        return False
    if isinstance(value, (list, tuple, np.ndarray)):
        return len(value) > 0
    return bool(value)


class RLHFDataset:
    """Tokenized prompts with their ground truth, data source and row index."""

    def __init__(self, files: str | Sequence[str], tokenizer, config: DataConfig, key: str = "data.train_files",
                 require_ground_truth: bool = True, frame: pd.DataFrame | None = None, max_samples: int = -1,
                 seed: int | None = None):
        """``require_ground_truth=False`` (:meth:`PPOConfig.needs_ground_truth`) takes rows without a
        ``reward_model.ground_truth``, or files without the column, as prompts alone: their ground truth is None.

        ``max_samples`` (``data.train_max_samples`` or ``data.val_max_samples``) keeps that many rows of the files,
        chosen by :func:`sample_rows` with ``config.shuffle`` and ``seed`` (``data.seed``, or the ``trainer.seed`` it
        follows; None: ``config.seed``), before any is checked, tokenized or filtered, as verl does; -1 keeps all.

        ``frame`` is the rows of ``files`` as :func:`read_frames` returns them, for a caller that reads them
        anyway (the dry run keeps the first rows kept): the files are then not read a second time. It is only
        read here, never changed."""
        self.tokenizer = tokenizer
        self.config = config
        self.paths = check_files(files, key)
        if frame is None:
            frame = read_frames(self.paths)
        if frame.empty:
            raise DataError(f"{key}: {', '.join(map(str, self.paths))} "
                            f"{'has' if len(self.paths) == 1 else 'have'} no rows; give files with prompts")
        needed = needed_columns(config, require_ground_truth)
        missing = [c for c in needed if c not in frame.columns]
        if missing:
            raise DataError(missing_columns_problem(self.paths, needed, key, config.prompt_key) or
                            f"{key}: column(s) {missing} missing")
        partial = columns_not_in_every_file(self.paths, needed)
        if partial is not None:  # joined, its rows would each read as a row without its prompt or ground truth
            raise DataError(f"{key}: {partial}")
        self.prompt_ids: list[list[int]] = []
        self.rows: list[dict] = []
        self.positions: list[int] = []  # each kept row's position in the files' rows, joined in order
        limit = config.max_prompt_length
        self.dropped_overlong = 0  # rows data.filter_overlong_prompts left out
        self.sampled: tuple[int, int] | None = None  # (rows kept, rows in the files) where max_samples kept fewer
        truncated: list[str] = []  # where each prompt data.truncation cut was
        seed = config.seed if seed is None else seed
        chosen = sample_rows(len(frame), max_samples, config.shuffle, seed)  # positions in the files' rows
        if len(chosen) < len(frame):
            how = f"drawn with data.seed {seed}" if config.shuffle else "the first ones (data.shuffle=false)"
            print(f"notice: {key}: {key.removesuffix('_files')}_max_samples keeps {len(chosen)} of {len(frame)} "
                  f"prompts, {how}", file=sys.stderr)
            self.sampled = (len(chosen), len(frame))
            frame = frame.iloc[chosen]
        records = frame.to_dict("records")
        wheres = [f"{record['_source_file']} row {record['_source_row']}" for record in records]
        conversations = [prompt_messages(record[config.prompt_key], where, config.prompt_key)
                         for record, where in zip(records, wheres)]
        # every row at once, before any is tokenized: a chat template would write these turns as text or drop them
        roles = roles_problem((where, unknown_roles(messages)) for where, messages in zip(wheres, conversations))
        if roles is not None:
            raise DataError(f"{key}: {roles}")
        # a question emptied on the way (a null written as "" or spaces): the policy would be asked nothing, and graded
        blank = [where for where, messages in zip(wheres, conversations)
                 if (users := [m["content"] for m in messages if m["role"] == "user"]) and not users[-1].strip()]
        if blank:
            raise DataError(f"{key}: {len(blank)} prompt(s) have a blank last user turn (the question), which would "
                            f"train as a question of nothing: {'; '.join(blank[:5])}{'; ...' if len(blank) > 5 else ''}"
                            "; fill in the question or drop the row")
        answered = [where for where, messages in zip(wheres, conversations) if ends_with_an_answer(messages)]
        if answered:  # SFT conversations: the answer to learn is inside the prompt the policy continues
            print(f"notice: {key}: {len(answered)} of {len(conversations)} prompts end with an assistant turn "
                  f"(first: {answered[0]}), so the policy is asked to go on after that answer; conversations of SFT "
                  f"data hold the answer there: give prompts that end with the user's turn", file=sys.stderr)
        for column, (kind, what) in MEDIA_COLUMNS.items():  # verl's multimodal rows: their media are not read here
            holding = [where for where, record in zip(wheres, records) if holds_media(record.get(column))]
            if holding:
                print(f"notice: {key}: {len(holding)} of {len(records)} prompts come with {column} (column "
                      f"{column!r}, verl's data.{kind}_key), which are not read (first: {holding[0]}): prompts are "
                      f"text here, so the policy is asked about {what} it never sees, and any <{kind}> placeholder "
                      "stays in the question as text; train a multimodal task with verl, or give prompts that hold "
                      "all they ask about", file=sys.stderr)
        for position, (record, where, messages) in enumerate(zip(records, wheres, conversations)):
            extra = record.get("extra_info")
            malformed = extra_info_problem(extra)  # refused whether or not the row is kept, as validation does
            if malformed is not None:  # verl reads extra_info.get("index"): text or a number has no index to give
                raise DataError(f"{where}: {malformed}")
            if is_missing(record[config.reward_fn_key]):  # str() would route it to a reward for data_source 'nan'
                raise DataError(f"{where}: {config.reward_fn_key!r} (data.reward_fn_key, which routes the row to its "
                                "reward function) is null; give every row its data source")
            try:
                ids = prompt_token_ids(tokenizer, messages, config.apply_chat_template_kwargs)
            except Exception as exc:  # templates raise anything: TemplateError, KeyError, ValueError, ...
                reason = " ".join(str(exc).split())
                raise DataError(f"{where}: the tokenizer's chat template refuses the prompt ({type(exc).__name__}"
                                f"{': ' + reason if reason else ''}); fix the row or the template") from exc
            if len(ids) > limit:
                if config.filter_overlong_prompts:
                    self.dropped_overlong += 1
                    continue
                if config.truncation == "error":
                    raise DataError(
                        f"{where}: prompt has {len(ids)} tokens > data.max_prompt_length ({limit}); raise "
                        "max_prompt_length, set data.filter_overlong_prompts=true, or data.truncation=left|right|middle"
                    )
                ids = truncate(ids, limit, config.truncation)
                truncated.append(where)
            malformed = reward_model_problem(record.get("reward_model"))
            if malformed is not None:  # its ground truth would read as missing, which is not what is wrong
                raise DataError(f"{where}: {malformed}")
            truth = ground_truth(record.get("reward_model"))
            if truth is None and require_ground_truth:
                raise DataError(f"{where}: reward_model.ground_truth is missing{TRUTH_HINT}")
            # a null cell, or a file without the column (pandas fills it with NaN), is an empty extra_info
            extra = {} if is_missing(extra) else plain_value(extra)
            source, index = str(record[config.reward_fn_key]), problem_index(extra, record["_source_row"])
            # verl names validation metrics by the data_source column whatever column routes the reward ('unknown'
            # where there is none)
            named = record.get("data_source")
            self.prompt_ids.append(list(ids))
            self.positions.append(chosen[position])
            self.rows.append({
                "ground_truth": None if truth is None else plain_value(truth),  # as stored: str, number, list, dict
                "data_source": source,
                "metric_source": "unknown" if is_missing(named) else str(named),
                "index": index,
                "id": problem_id(source, index),
                "extra_info": extra,
                "messages": messages,
            })
        if not self.rows:  # only data.filter_overlong_prompts drops rows
            raise DataError(f"{key}: no prompts left: all {len(frame)} are longer than data.max_prompt_length "
                            f"({limit}) and data.filter_overlong_prompts drops them; raise max_prompt_length")
        if self.dropped_overlong:
            print(f"notice: {key}: data.filter_overlong_prompts dropped {self.dropped_overlong} of {len(frame)} "
                  f"prompts longer than data.max_prompt_length ({limit} tokens); {len(self.rows)} remain",
                  file=sys.stderr)
        if truncated:
            print(f"notice: {key}: data.truncation={config.truncation} cut {len(truncated)} of {len(frame)} prompts "
                  f"longer than data.max_prompt_length ({limit} tokens) to that length (first: {truncated[0]}), "
                  f"{TRUNCATION_CUTS[config.truncation]}", file=sys.stderr)
        self.data_sources = sorted({row["data_source"] for row in self.rows})

    def __len__(self) -> int:
        return len(self.rows)

    def collate(self, indices: Sequence[int]) -> Batch:
        """Rows ``indices`` as a left-padded batch with their metadata. The batch holds copies of the rows'
        ``extra_info`` and messages: a reward function that changes what it is handed changes that batch only (the
        dataset is read once, not once a batch)."""
        tensors = left_pad([self.prompt_ids[i] for i in indices], self.tokenizer.pad_token_id)
        meta = {
            "ground_truth": [self.rows[i]["ground_truth"] for i in indices],
            "data_source": [self.rows[i]["data_source"] for i in indices],
            "index": [self.rows[i]["index"] for i in indices],
            "extra_info": [copy.deepcopy(self.rows[i]["extra_info"]) for i in indices],
            "uid": [int(i) for i in indices],
        }
        if self.config.reward_fn_key != "data_source":  # (else the same as data_source)
            meta["metric_source"] = [self.rows[i]["metric_source"] for i in indices]
        if self.config.return_raw_chat:
            meta["raw_prompt"] = [copy.deepcopy(self.rows[i]["messages"]) for i in indices]
        return Batch(tensors, meta)


class PromptSampler:
    """Seeded epoch-by-epoch order over ``n`` rows, in whole batches (the remainder is dropped).

    With ``shuffle`` the order is verl's for the same seed: verl's ``RandomSampler`` draws every epoch from one
    generator seeded once with ``seed``, two ``torch.randperm(n)`` a pass (the epoch's order, then the empty
    tail ``[:num_samples % n]``, drawn all the same once the pass runs to its end), so epoch ``e`` is the
    ``2e``-th permutation counted from 0, and a run here and a verl run with the same ``data.seed`` train on
    the same prompts at every step. The state is (epoch, batch index within the epoch); restoring it resumes
    with the next unseen batch, and the order of every epoch depends only on (seed, epoch).
    """

    #: the order rule a state_dict names: verl's one generator over all epochs, or (before it) a generator
    #: seeded by the seed and the epoch, which a state without the marker was saved under
    ORDER_ONE_GENERATOR, ORDER_SEED_AND_EPOCH = "one_generator", "seed_and_epoch"

    def __init__(self, n: int, batch_size: int, shuffle: bool = True, seed: int = 0,
                 key: str = "data.train_batch_size", dropped: int = 0, sampled: tuple[int, int] | None = None):
        """``dropped`` and ``sampled``: the prompts data.filter_overlong_prompts left out and what
        data.train_max_samples kept (:attr:`RLHFDataset.sampled`), for the error where too few remain."""
        if batch_size > n:
            raise DataError(too_few_prompts(key, batch_size, n, dropped, sampled))
        if n % batch_size and not shuffle:  # shuffled, each epoch leaves other prompts out; in order, always these
            print(f"notice: {key} ({batch_size}) leaves {n % batch_size} of the {n} prompts out of every epoch: "
                  f"with data.shuffle=false always the last {n % batch_size}, which never train; set "
                  f"data.shuffle=true, or a batch size that divides {n}", file=sys.stderr)
        self.n, self.batch_size, self.shuffle, self.seed = n, batch_size, shuffle, seed
        self.epoch, self.batch_in_epoch = 0, 0
        self.order_rule = self.ORDER_ONE_GENERATOR
        # the generator after its first ``_drawn`` epochs, and the last order drawn: a run draws each epoch's
        # permutation once, not every epoch's before it at each batch
        self._generator: torch.Generator | None = None
        self._drawn = 0
        self._cached: tuple[int, list[int]] | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.n // self.batch_size

    @property
    def batches_drawn(self) -> int:
        """Batches handed out so far, over all epochs."""
        return self.epoch * self.batches_per_epoch + self.batch_in_epoch

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        if self.order_rule == self.ORDER_SEED_AND_EPOCH:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            order = torch.randperm(self.n, generator=generator).tolist()
        else:
            if self._generator is None or self._drawn > epoch:  # (an earlier epoch: draw again from the seed)
                self._generator, self._drawn = torch.Generator().manual_seed(self.seed), 0
            while self._drawn <= epoch:
                order = torch.randperm(self.n, generator=self._generator).tolist()
                torch.randperm(self.n, generator=self._generator)  # the pass's empty tail, drawn as verl's
                self._drawn += 1
        self._cached = (epoch, order)
        return order

    def next_batch(self) -> tuple[int, list[int]]:
        """(epoch, row indices) of the next batch; advances the state."""
        if self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        start = self.batch_in_epoch * self.batch_size
        rows = self._order(self.epoch)[start:start + self.batch_size]
        epoch = self.epoch
        self.batch_in_epoch += 1
        return epoch, rows

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "seed": self.seed, "n": self.n,
                "order": self.order_rule}

    def load_state_dict(self, state: dict) -> None:
        """A state saved without ``order`` (before verl's order) keeps its own rule for the rest of the run,
        so that a run resumed mid-epoch neither repeats nor skips prompts."""
        if state.get("n", self.n) != self.n:
            raise DataError(f"the checkpoint's sampler covered {state['n']} prompts; this dataset has {self.n}")
        rule = state.get("order", self.ORDER_SEED_AND_EPOCH)
        if rule not in (self.ORDER_ONE_GENERATOR, self.ORDER_SEED_AND_EPOCH):
            raise DataError(f"the checkpoint's sampler has an unknown order {rule!r} (known: "
                            f"{self.ORDER_ONE_GENERATOR!r}, {self.ORDER_SEED_AND_EPOCH!r})")
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        self.order_rule, self._generator, self._drawn, self._cached = rule, None, 0, None
