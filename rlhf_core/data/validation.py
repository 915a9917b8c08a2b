"""Check prompt and preference parquet files with a Great Expectations (1.x) suite before training.

pandas adds helper columns (the user turn, the ground truth, a pair's key, lengths), then one GX
suite runs over each table on an ephemeral context. GX's ``ExpectationSuiteValidationResult`` is the
record: its JSON is :meth:`ValidationReport.to_dict`, its Data Docs page :meth:`~ValidationReport.to_html`.
Each expectation carries its check name (``meta.check``) and says what it checks (``description``):
see :func:`_suite`. Rows are named by their position in the table, from 0.

The kind follows the columns (:func:`detect_kind`): ``chosen``/``rejected`` make preference data
(:data:`~rlhf_core.data.schema.PREFERENCE_COLUMNS`), ``reward_model`` prompt data (verl's schema,
:data:`~rlhf_core.data.schema.REQUIRED_COLUMNS`; ``ability``, which nothing in training reads, and ``extra_info``,
whose ``index`` the trainer replaces by the row's number in its file, only where they are there,
:data:`~rlhf_core.data.schema.OPTIONAL_COLUMNS`); a table with neither is reported with every column
either kind needs that it lacks, and where it has the prompt column with a note (:attr:`ValidationReport.notes`)
that prompts trained without a ground truth need no ``reward_model`` (``ground_truth_required=False``). Prompt
data trained without a ground truth (``ground_truth_required=False``, ``--no-ground-truth``: a reward model at
``reward_model.rule_coef=0``, or a custom reward function, which ``--custom-reward`` implies) needs no
``reward_model`` column, and its ground-truth checks cover only the rows that have one; a split that needs one
for a reason beyond the trainer's says so (``ground_truth_reason``). Both kinds check the rows, columns, nulls
and the prompt messages, and the validation file for rows that repeat training data (prompt data: the same
question, the system and user turns each compared by :func:`question_key`, :func:`asked`; preference data: the
same prompt, as the reward model's trainer refuses it); prompt data's validation file also for a question asked
twice (``question_unique``: evaluation would count it as two problems).
Prompt data's prompt and data source are read from the trainer's columns (``prompt_key``, ``reward_fn_key``),
its problem ids built as the trainer numbers rows. Length limits: prompt data in tokens (a tokenizer and
``max_prompt_length``: counted as the trainer counts them); preference data the prompt with the longer
response, in tokens (a tokenizer and ``max_length``, laid out as the reward model's trainer encodes it: the
prompt with its generation prompt, the response, EOS) or characters (``max_chars``, the contents joined by
newlines). At most ``overlong_tolerance`` of the rows may be over (GX ``mostly``); a conversation the chat
template refuses fails on its own (``prompt_renders``, ``pair_renders``).

Usage::

    python -m rlhf_core.data.validation TRAIN.parquet... [--val VAL.parquet...] [--html OUT.html] [--json]
        [--tokenizer DIR --max-prompt-length N]            # prompt data
        [--tokenizer DIR --max-length N | --max-chars N]   # preference data
        [--overlong-tolerance F] [--custom-reward] [--no-ground-truth]

Exit status: 0 when every expectation holds, 1 when any fails, 2 when an input cannot be read or the
command line is wrong (a one-line reason on stderr).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import html
import json
import logging
import math
import numbers
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as `rlhf validate` is (rlhf_core.cli), before the imports below (pandas), so
    # that a Ctrl-C in the command's first seconds ends it with one line and exit 130, not a traceback
    from rlhf_core.cli import _run

    sys.exit(_run("validate", None, "python -m rlhf_core.data.validation"))

import numpy as np
import pandas as pd

from rlhf_core.data.schema import (
    CHAT_ROLES,
    OPTIONAL_COLUMNS,
    PREFERENCE_COLUMNS,
    PROMPT_COLUMNS,
    REQUIRED_COLUMNS,
    extra_info_problem,
    folder_listing,
    ground_truth,
    is_missing,
    json_message_list,
    other_format,
    plain_value,
    problem_id,
    problem_index,
    prompt_problem,
    read_rows,
    reward_model_problem,
    single_precision_truth,
    unknown_roles,
    widened,
)
from rlhf_core.rewards import gsm8k

NON_BLANK_REGEX = r"\S"
MAX_EXAMPLES = 3
#: question_unique's report: the questions asked more than once it names, and the rows it names for each
MAX_COPIES = 10
_EXCERPT_CHARS = 80
_STATS = ("element_count", "missing_count", "unexpected_count", "unexpected_percent", "observed_value")
_LIMITS = {"prompt": ("max_prompt_length",), "preference": ("max_length", "max_chars"), None: ()}
#: the parameters :func:`validate_frames`' errors and notes name; a caller may name them its own way (``option_names``)
_OPTIONS = ("tokenizer", "max_prompt_length", "max_length", "max_chars", "overlong_tolerance", "ground_truth_required")
_LENGTH_CHECKS = ("prompt_length_within_limit", "pair_length_within_limit")
#: the checks whose outcome keeps every failing row: the message lists every file, and each copy is named
_EVERY_ROW = ("column_in_every_file", "question_unique")
Paths = str | os.PathLike | Sequence[str | os.PathLike]

os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")  # no usage reports (there is no network anyway)
# Before GX is first imported (here only): as it imports, GX logs some 220 INFO lines about its own docs registry
# and google.api_core, which it imports, warns of this Python's end of support; a step's log at INFO (ZenML's)
# showed them all before the validation's own lines. GX's errors still show.
logging.getLogger("great_expectations").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message="You are using a Python version", category=FutureWarning,
                        module=r"google\.api_core")


class DataReadError(Exception):
    """An input file that cannot be read as a parquet table (or a tokenizer that cannot be loaded)."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = one_line(reason)
        super().__init__(f"cannot read {self.path}: {self.reason}")


def detect_kind(columns: Iterable[str], ground_truth_required: bool = True) -> str | None:
    """``"preference"`` (a ``chosen`` or ``rejected`` column), ``"prompt"`` (``reward_model``) or None.

    Without ``ground_truth_required`` every other table is prompt data: prompts alone carry no
    ``reward_model`` column to tell them by, and the missing columns are then reported as prompt data's.
    """
    columns = set(columns)
    if columns & {"chosen", "rejected"}:
        return "preference"
    return "prompt" if "reward_model" in columns or not ground_truth_required else None


# ---------------------------------------------------------------------------------------------
# The report: GX's results, and what the summary reads off them


@dataclass(frozen=True)
class Outcome:
    """One expectation's result on one dataset."""

    name: str
    column: str | None
    dataset: str
    success: bool
    expectation_type: str
    description: str
    statistics: dict[str, Any]
    examples: list[tuple[int, Any]]  # (row, value) of the first failing rows; every row for _EVERY_ROW's checks

    @classmethod
    def of(cls, item: Any, dataset: str) -> Outcome:
        config, raw = item.expectation_config, item.result or {}
        column = config.kwargs.get("column") or ",".join(config.kwargs.get("column_list") or []) or None
        stats = {key: raw[key] for key in _STATS if key in raw}
        error = _raised(item.exception_info)
        if error is not None:
            stats["error"] = error
        if "max_value" in config.kwargs and raw.get("unexpected_percent") is not None:  # a length limit
            stats["share_over"] = raw["unexpected_percent"] / 100.0  # GX gives None where no row was measured
        rows = list(zip(raw.get("unexpected_index_list") or [], raw.get("unexpected_list") or []))
        name = config.meta["check"]
        if name == "column_in_every_file":  # the files, each by its first row (all its rows lack the column)
            first: dict[Any, int] = {}
            for row, value in rows:
                first.setdefault(value, row)
            rows = [(row, value) for value, row in first.items()]
        shown = None if name in _EVERY_ROW else MAX_EXAMPLES
        examples = [(int(row), _tidy(value)) for row, value in rows[:shown]]
        description = (config.description or "").removeprefix(f"{name}: ")
        return cls(name, column, dataset, bool(item.success), config.type, description, stats, examples)

    @property
    def label(self) -> str:
        return f"{self.name} [{self.dataset}.{self.column}]" if self.column else f"{self.name} [{self.dataset}]"


def _raised(exception_info: Any) -> str | None:
    """The message of an exception GX caught while it evaluated an expectation, or None.

    GX 1.x keeps it at the top level or, when a metric raised, under that metric's id
    (``{"MetricConfigurationID(...)": {"raised_exception": True, ...}}``); a result read back from
    JSON holds the flag as the string "True".
    """
    info = exception_info if isinstance(exception_info, Mapping) else {}
    for entry in (info, *info.values()):
        if isinstance(entry, Mapping) and str(entry.get("raised_exception")).lower() == "true":
            return one_line(entry.get("exception_message") or "") or "an exception without a message"
    return None


@dataclass
class DatasetInfo:
    """Where one validated table came from."""

    name: str
    path: str | None
    rows: int
    columns: list[str]


@dataclass
class ValidationReport:
    """GX's result for each dataset (train, then val), and the checks that could not run."""

    kind: str | None
    gx_results: dict[str, Any]
    datasets: list[DatasetInfo]
    skipped: list[str] = field(default_factory=list)
    fingerprint: str | None = None
    #: what the summary adds to the findings: how data of neither kind may still be valid
    notes: list[str] = field(default_factory=list)
    #: dataset -> (file, rows) of each file joined into it, in order, where it was read from several files
    file_spans: dict[str, list[tuple[str, int]]] = field(default_factory=dict)

    def where(self, dataset: str, row: int) -> str:
        """A row of a dataset's joined table as the user finds it: ``row N`` of its one file, or ``<path> row N``
        in the file it came from (the trainer's and the reward's numbering)."""
        for path, rows in self.file_spans.get(dataset, []):
            if row < rows:
                return f"{path} row {row}"  # the path as given: files of one name in two folders stay apart
            row -= rows
        return f"row {row}"

    @property
    def results(self) -> list[Outcome]:
        order = lambda item: item.expectation_config.meta["order"]  # noqa: E731
        return [Outcome.of(item, name) for name, result in self.gx_results.items()
                for item in sorted(result.results, key=order)]

    @property
    def success(self) -> bool:
        return all(result.success for result in self.gx_results.values())

    @property
    def failures(self) -> list[Outcome]:
        return [outcome for outcome in self.results if not outcome.success]

    def find(self, name: str, column: str | None = None, dataset: str | None = None) -> list[Outcome]:
        return [o for o in self.results
                if o.name == name and column in (None, o.column) and dataset in (None, o.dataset)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; GX's validation result of each dataset is under ``datasets[i]["result"]``."""
        keys = ("evaluated_expectations", "successful_expectations", "unsuccessful_expectations")
        totals = {key: sum(int(r.statistics[key]) for r in self.gx_results.values()) for key in keys}
        datasets = [{**vars(d), "result": self.gx_results[d.name].to_json_dict()} for d in self.datasets]
        return {"success": self.success, "kind": self.kind, "fingerprint": self.fingerprint,
                "statistics": totals, "datasets": datasets, "skipped": list(self.skipped),
                "notes": list(self.notes)}

    def summary(self) -> str:
        results, failures = self.results, self.failures
        what = f"{self.kind} data" if self.kind else "neither prompt nor preference data"
        lines = [f"Dataset validation PASSED: all {len(results)} expectations hold ({what})" if self.success
                 else f"Dataset validation FAILED: {len(failures)} of {len(results)} expectations failed ({what})"]
        lines += [f"  {d.name}: {d.path or '<in memory>'} ({d.rows} rows)" for d in self.datasets]
        if self.fingerprint:
            lines.append(f"  fingerprint: {self.fingerprint}")
        if self.kind is None:
            lines.append(f"  prompt data needs the columns {', '.join(REQUIRED_COLUMNS)}; "
                         f"preference data needs {', '.join(PREFERENCE_COLUMNS)}")
        lines += [f"  {note}" for note in self.notes]
        for o in failures:
            lines.append(f"FAILED {o.label} ({o.expectation_type}): {_describe_failure(o)}")
            lines += [f"    {example}" for example in self._shown_rows(o)]
        lines += [_describe_limit(o) for o in results if o.success and o.name in _LENGTH_CHECKS]
        return "\n".join(lines + [f"  skipped: {item}" for item in self.skipped])

    def _shown_rows(self, outcome: Outcome) -> list[str]:
        """A failed check's first failing rows, ``<where>: <value>`` (none for ``column_in_every_file``, whose
        description names the files; ``question_unique``'s by question, :meth:`_copies`)."""
        if outcome.name == "column_in_every_file":
            return []
        if outcome.name == "question_unique":
            return self._copies(outcome)
        return [f"{self.where(outcome.dataset, row)}: {_excerpt(value)}" for row, value in outcome.examples]

    def _copies(self, outcome: Outcome) -> list[str]:
        """``question_unique``'s rows by question, in the order each is first asked: ``rows 1, 7, 9 ask '...'``,
        every copy of up to :data:`MAX_COPIES` questions, each with up to that many rows named and the number of
        its others, then the number of the other questions asked more than once and of their rows."""
        by_question: dict[Any, list[int]] = {}
        for row, question in outcome.examples:
            by_question.setdefault(question, []).append(row)
        one_file = outcome.dataset not in self.file_spans
        lines = []
        for question, rows in list(by_question.items())[:MAX_COPIES]:
            named = rows[:MAX_COPIES]
            where = f"rows {', '.join(map(str, named))}" if one_file else \
                ", ".join(self.where(outcome.dataset, row) for row in named)
            others = f" and {len(rows) - len(named)} more" if len(rows) > len(named) else ""
            lines.append(f"{where}{others} ask {_excerpt(question)}")
        rest = list(by_question.values())[MAX_COPIES:]
        if rest:
            lines.append(f"and {len(rest)} more questions asked more than once, in "
                         f"{sum(map(len, rest))} more rows")
        return lines

    def failed_examples(self) -> dict[str, dict[str, Any]]:
        """Each failed check by its label: what failed (as the summary says it) and its first failing rows (each
        copy of a question, :meth:`_copies`), for a record that outlives the log (the validate_data step's
        metadata)."""
        return {o.label: {"failure": _describe_failure(o), "rows": self._shown_rows(o)} for o in self.failures}

    def to_html(self) -> str:
        """GX's Data Docs page of the validation results, one overview per dataset.

        The page takes its styles and scripts from CDNs; offline it shows unstyled, with every table.
        """
        from great_expectations.render.renderer import ValidationResultsPageRenderer
        from great_expectations.render.view import DefaultJinjaPageView

        pages = []
        for d in self.datasets:
            # GX 1.x writes these table cells unescaped; data text (GSM8K's "<<6*2=12>>") must stay text
            result = copy.deepcopy(self.gx_results[d.name])
            # GX's tables index a split's rows from 0 across its files: each file's span maps an index to its row
            spans, first = [], 0
            for path, rows in self.file_spans.get(d.name, []):
                spans.append(f"{path}: rows {first}-{first + rows - 1}" if rows else f"{path}: no rows")
                first += rows
            where = f"{'; '.join(spans)}, indexed on from one file to the next" if spans else d.path or "in memory"
            result.meta["run_id"] = {"run_name": _escape(f"{d.name}: {where} ({d.rows} rows)")}
            for item in result.results:
                for key in ("unexpected_list", "partial_unexpected_list", "partial_unexpected_counts"):
                    if key in item.result:
                        item.result[key] = _escape(item.result[key])
            pages.append(ValidationResultsPageRenderer().render(result))
        pages[0].sections = [section for page in pages for section in page.sections]
        return DefaultJinjaPageView().render(pages[0])


# ---------------------------------------------------------------------------------------------
# Reading and fingerprinting


def read_parquet(path: str | os.PathLike) -> pd.DataFrame:
    """Read one parquet file; any failure becomes a :class:`DataReadError` with a one-line reason."""
    import pyarrow as pa

    path = Path(path)
    if not path.exists():
        raise DataReadError(path, "no such file")
    if path.is_dir() and (held := other_format(path)) is not None:
        raise DataReadError(path, f"is a directory, expected a parquet file: {held}")
    if path.is_dir():  # a folder of shards: the files are named one by one, as data.train_files lists them
        found = sorted(p.name for p in path.glob("*.parquet"))
        if not found:
            raise DataReadError(path, f"is a directory with no .parquet file ({folder_listing(path)}), expected a "
                                      "parquet file: name parquet files")
        held = f" (it holds {', '.join(found[:4])}{', ...' if len(found) > 4 else ''})"
        raise DataReadError(path, f"is a directory, expected a parquet file: name its files{held}")
    try:
        return read_rows(path)  # as the trainer reads it
    except (OSError, pa.ArrowException, ValueError) as exc:
        reason = other_format(path) or one_line(str(exc)) or type(exc).__name__
        raise DataReadError(path, f"not a readable parquet file ({reason})") from exc


def _files(paths: Paths) -> list[Path]:
    return [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]


def fingerprint(paths: Paths) -> str:
    """SHA-256 over the bytes of ``paths``, independent of the order they are given in.

    The files are hashed in order of their file name (ties broken by the absolute path, so that a file
    named relative to the working directory sorts as its absolute name does), each one preceded by its
    byte length so that moving bytes from one file into another changes the digest. Moving a dataset to
    another folder keeps its fingerprint.
    """
    files = sorted(_files(paths), key=lambda p: (p.name, os.path.abspath(os.path.expanduser(p))))
    if not files:
        raise ValueError("fingerprint needs at least one file")
    digest = hashlib.sha256()
    for path in files:
        try:
            digest.update(path.stat().st_size.to_bytes(8, "big"))
            with open(path, "rb") as handle:
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
        except OSError as exc:
            raise DataReadError(path, exc.strerror or str(exc)) from exc
    return digest.hexdigest()


def splits_fingerprint(train: Paths, val: Paths | None = None) -> str:
    """SHA-256 over the :func:`fingerprint` of each split, each under its role: the same files shared out
    otherwise between training and validation (a re-split) give another digest."""
    digest = hashlib.sha256()
    for role, paths in (("train", train), ("val", val)):
        files = _files(paths) if paths is not None else []
        digest.update(f"{role}:{fingerprint(files) if files else '-'};".encode())
    return digest.hexdigest()


def load_tokenizer(tokenizer: Any, trust_remote_code: bool = False) -> Any:
    """``tokenizer`` itself, or the tokenizer saved at that path (loaded offline; ``trust_remote_code`` runs the
    tokenizer or model code the folder holds, as ``actor_rollout_ref.model.trust_remote_code`` lets training)."""
    if tokenizer is None or not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    if not Path(tokenizer).exists():
        raise DataReadError(tokenizer, "no such tokenizer directory")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises many kinds for a broken folder
        reason = one_line(str(exc)) or type(exc).__name__
        raise DataReadError(tokenizer, f"cannot load tokenizer ({reason})") from exc


# ---------------------------------------------------------------------------------------------
# Helper columns


def question_key(text: str) -> str:
    """The question a turn asks, as train and val are compared and val's questions told apart: runs of
    whitespace (spaces, tabs, newlines) made one space, the ends stripped, the case folded."""
    return " ".join(text.split()).casefold()


#: the turns that pose a prompt's problem: the instructions and the user's words, not an assistant's or a tool's
ASKING_ROLES = ("system", "developer", "user")


def asked(messages: Sequence[Mapping[str, str]], same: Callable[[str], str] = str) -> str | None:
    """What a conversation asks, as one string: its system, developer and user turns (:data:`ASKING_ROLES`), each
    as ``same`` writes it (:func:`question_key`: as questions are compared), in order; a blank one is left out.

    A lone user turn is its text, as a one-turn prompt always was; any other (and a lone text that starts with
    ``[``) is the JSON list ``[[role, text], ...]``, so no two conversations give one string. Distinct problems
    followed by the same last turn ("Now give only the final answer.") stay apart. None without a user turn."""
    turns = [[m["role"], same(m["content"])] for m in messages
             if m["role"] in ASKING_ROLES and m["content"].strip()]
    if not any(role == "user" for role, _ in turns):
        return None
    if len(turns) == 1 and not turns[0][1].startswith("["):
        return turns[0][1]
    return json.dumps(turns, ensure_ascii=False)


def _messages(value: Any) -> list[dict[str, str]] | None:
    """The prompt as ``[{role, content}]`` with string fields (an empty list as it is: a check of its own counts
    the messages), or None when malformed by the trainer's rule (:func:`~rlhf_core.data.schema.prompt_problem`)."""
    if isinstance(value, (list, tuple, np.ndarray)) and len(value) == 0:
        return []
    if prompt_problem(value) is not None:
        return None
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _measure(conversations: Sequence[Any], count: Callable[[Any], int]) -> tuple[list[float], list[str | None]]:
    """``count`` of each conversation (NaN where there is none), and the error where counting raised.

    A chat template may refuse a conversation (``raise_exception('System role not supported')``); the
    trainer would stop on that row, so the error is kept for the report instead of a length GX skips.
    """
    counts: list[float] = []
    errors: list[str | None] = []
    for messages in conversations:
        length, error = math.nan, None
        if messages:
            try:
                length = float(count(messages))
            except Exception as exc:  # templates raise anything: TemplateError, KeyError, ValueError, ...
                message = one_line(str(exc))
                error = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
        counts.append(length)
        errors.append(error)
    return counts, errors


def _joined(messages: list[dict]) -> str:
    return "\n".join(m["content"] for m in messages)


def _prompt_counter(tokenizer: Any, template_kwargs: dict | None) -> Callable[[list[dict]], int]:
    """Prompt length as the trainer counts it (:func:`rlhf_core.data.dataset.prompt_token_ids`), else in
    characters."""
    if tokenizer is None:
        return lambda messages: len(_joined(messages))
    from rlhf_core.data.dataset import prompt_token_ids  # imports torch: only when prompts are measured

    return lambda messages: len(prompt_token_ids(tokenizer, messages, template_kwargs))


def _pair_counter(tokenizer: Any, template_kwargs: dict | None) -> Callable[[tuple[list[dict], str]], int]:
    """Length of (prompt, response) as the reward model's trainer lays it out
    (:func:`rlhf_core.rewards.reward_model.encode_response`: the prompt with its generation prompt, the response,
    EOS) in tokens; else the prompt's and the response's characters, a newline between them."""
    if tokenizer is None:
        return lambda pair: len(_joined(pair[0] + [{"content": pair[1]}]))
    from rlhf_core.rewards.reward_model import encode_response  # imports torch: only when pairs are measured

    return lambda pair: len(encode_response(tokenizer, pair[0], pair[1], chat_template_kwargs=template_kwargs)[0])


def _canonical_prompt(messages: list[dict]) -> str | None:
    """The prompt as :func:`rlhf_core.data.preference.check_preference_frames` compares train with val;
    None for a message field JSON cannot write (the trainer's check could not compare it either)."""
    from rlhf_core.data.preference import canonical_prompt

    try:
        return canonical_prompt(messages)
    except (TypeError, ValueError):
        return None


def _conflicting_truths(conversations: Sequence[list[dict] | None], truths: Iterable[str | None],
                        sources: Iterable[Any]) -> list[str | None]:
    """For each row whose prompt (all its messages) other rows of its data source repeat with another ground truth,
    those ground truths (as stored, sorted, ``" | "`` between them), else None: one of them rewards the right answer
    as wrong. Truths the rule reads as one answer (``1,000`` and ``1000``, ``$5`` and ``5``:
    :func:`~rlhf_core.rewards.gsm8k.expected_answer`) agree."""
    from rlhf_core.data.preference import present_fields

    keys = [json.dumps([str(source), [present_fields(message) for message in m]], sort_keys=True, ensure_ascii=False,
                       default=str) if m else None for m, source in zip(conversations, sources)]
    seen: dict[str, dict[str, set[str]]] = {}  # by prompt: the truths as stored, by the answer the rule reads
    for key, truth in zip(keys, truths):
        if key is not None and truth is not None:
            seen.setdefault(key, {}).setdefault(gsm8k.expected_answer(truth), set()).add(truth)
    return [" | ".join(sorted(set().union(*seen[key].values()))) if key in seen and len(seen[key]) > 1 else None
            for key in keys]


def _not_text(value: Any) -> Any:
    """``value`` when it is there but is not a string (a number, a list of messages), else None."""
    return None if isinstance(value, str) or is_missing(value) else value


def flatten(frame: pd.DataFrame, tokenizer: Any = None, kind: str | None = "prompt",
            measure: bool | None = None, template_kwargs: dict | None = None, *, prompt_key: str = "prompt",
            reward_fn_key: str = "data_source", source_rows: Sequence[int] | None = None) -> pd.DataFrame:
    """``frame`` plus the helper columns the expectations run on.

    ``prompt_problem`` (what is wrong with the prompt as chat messages, :func:`prompt_problem`; null where nothing
    is, or the prompt is null), ``prompt_has_user_turn``, ``prompt_user_content``, ``prompt_unknown_roles`` (the roles
    outside :data:`~rlhf_core.data.schema.CHAT_ROLES`, else null);
    prompt data: ``prompt_asked`` (the system and user turns as written, :func:`asked`), ``prompt_question``
    (the same, each turn's :func:`question_key`), ``reward_model_non_mapping`` (a
    ``reward_model`` cell that is there but is no mapping, else null), ``extra_info_non_mapping`` (what is wrong
    with an ``extra_info`` cell that is there but is no mapping, :func:`~rlhf_core.data.schema.extra_info_problem`,
    else null),
    ``ground_truth``, ``prompt_conflicting_truths`` (:func:`_conflicting_truths`), ``problem_id``
    (``data_source/extra_info.index``; without an index the row's number in its file, ``source_rows``, as the
    trainer numbers rows) and, if ``measure`` (default:
    with a tokenizer), ``prompt_tokens`` with ``prompt_template_error`` (the chat template's error, else null);
    preference data: ``pair`` (the JSON of prompt, chosen, rejected), ``prompt_json`` (the prompt as the
    reward model's trainer keys it), ``chosen_non_text``/``rejected_non_text`` (a value that is not a string)
    and, if ``measure``, ``pair_length`` (tokens with a tokenizer, else characters) with
    ``pair_template_error``. ``prompt_key``, ``reward_fn_key``: prompt data's columns (``data.prompt_key``,
    ``data.reward_fn_key``).
    """
    out, index = frame.copy(), frame.index
    measure = tokenizer is not None if measure is None else measure
    prompt_key = prompt_key if kind != "preference" else "prompt"  # the reward model's trainer reads 'prompt'

    def column(values: Iterable[Any], dtype: str = "object") -> pd.Series:
        return pd.Series(list(values), index=index, dtype=dtype)

    raw = list(frame[prompt_key]) if prompt_key in frame else None
    if raw is not None and kind == "prompt":  # the RL dataset takes a plain string as one user turn (not JSON text)
        raw = [[{"role": "user", "content": v}] if isinstance(v, str) and not json_message_list(v) else v
               for v in raw]
    parsed = [None if is_missing(v) else _messages(v) for v in raw] if raw is not None else None
    if parsed is not None:
        users = [[m["content"] for m in messages if m["role"] == "user"] if messages else None
                 for messages in parsed]
        out["prompt_problem"] = column(None if is_missing(v) else prompt_problem(v) for v in raw)
        out["prompt_has_user_turn"] = column(bool(u) if u is not None else None for u in users)
        out["prompt_user_content"] = column(u[-1] if u else None for u in users)
        if kind != "preference":
            out["prompt_asked"] = column(asked(m) if m else None for m in parsed)
            out["prompt_question"] = column(asked(m, question_key) if m else None for m in parsed)
        out["prompt_unknown_roles"] = column(", ".join(unknown_roles(messages)) or None if messages else None
                                             for messages in parsed)
        # the messages as the trainers hand them to the chat template: every key of each message
        conversations = [[plain_value(dict(m)) for m in v] if m else None for v, m in zip(raw, parsed)]
    if kind == "prompt" and "reward_model" in frame:
        # a cell that is not a mapping (JSON text, a bare answer) has no ground truth to read: told apart from a null
        out["reward_model_non_mapping"] = column(None if reward_model_problem(v) is None else v
                                                 for v in frame["reward_model"])
        truths = map(ground_truth, frame["reward_model"])  # as the trainer reads it: a NaN is a missing one
        # a number as the rule writes it (4.0 as "4", a float32 0.1 as "0.1"); text as it is stored
        out["ground_truth"] = column(None if t is None else t.decode() if isinstance(t, bytes) else
                                     gsm8k.expected_answer(t) if isinstance(t, numbers.Real) and not
                                     isinstance(t, (bool, np.bool_)) else str(t) for t in truths)
    if kind == "prompt" and parsed is not None and "ground_truth" in out:
        sources = frame[reward_fn_key] if reward_fn_key in frame else [None] * len(frame)
        out["prompt_conflicting_truths"] = column(_conflicting_truths(conversations, out["ground_truth"], sources))
    if kind == "prompt" and measure and parsed is not None:  # prompts alone are measured too
        counts, errors = _measure(conversations, _prompt_counter(tokenizer, template_kwargs))
        out["prompt_tokens"] = column(counts, "float64")
        out["prompt_template_error"] = column(errors)
    if kind == "prompt" and "extra_info" in frame:  # a null reads as an empty mapping, as the trainer takes it
        out["extra_info_non_mapping"] = column(map(extra_info_problem, frame["extra_info"]))
    if kind == "prompt" and reward_fn_key in frame:
        rows = range(len(frame)) if source_rows is None else source_rows
        extras = frame["extra_info"] if "extra_info" in frame else [None] * len(frame)
        out["problem_id"] = column(problem_id(source, problem_index(extra, int(row)))
                                   for source, extra, row in zip(frame[reward_fn_key], extras, rows))
    if kind == "preference" and parsed is not None and {"chosen", "rejected"} <= set(frame.columns):
        pairs = list(zip(parsed, frame["chosen"], frame["rejected"]))
        out["pair"] = column(json.dumps([m, c, r], ensure_ascii=False)
                             if m and isinstance(c, str) and isinstance(r, str) else None for m, c, r in pairs)
        out["prompt_json"] = column(_canonical_prompt(m) if m else None for m in conversations)
        for name in ("chosen", "rejected"):
            out[f"{name}_non_text"] = column(map(_not_text, frame[name]))
        if measure:  # each response after the prompt, as the reward model trains on it; the longer one counts
            turns = [(m, text) if m and isinstance(text, str) else None
                     for m, (_, chosen, rejected) in zip(conversations, pairs) for text in (chosen, rejected)]
            counts, errors = _measure(turns, _pair_counter(tokenizer, template_kwargs))
            lengths = np.asarray(counts, dtype="float64").reshape(-1, 2)
            out["pair_length"] = column(np.fmax(lengths[:, 0], lengths[:, 1]), "float64")
            out["pair_template_error"] = column(chosen or rejected
                                                for chosen, rejected in zip(errors[::2], errors[1::2]))
    return out


# ---------------------------------------------------------------------------------------------
# The suite


def _sources(prompt: str, source: str) -> dict[str, str]:
    """Where each helper column comes from, for the note on a check that could not run."""
    pair = "'prompt', 'chosen' and 'rejected'"
    return {**dict.fromkeys(("prompt_problem", "prompt_has_user_turn", "prompt_unknown_roles", "prompt_user_content",
                             "prompt_tokens", "prompt_template_error", "prompt_json", "prompt_question",
                             "prompt_asked"), repr(prompt)),
            "ground_truth": "'reward_model'", "reward_model_non_mapping": "'reward_model'", "problem_id": repr(source),
            "prompt_within_limit": repr(prompt), "prompt_conflicting_truths": f"{prompt!r} and 'reward_model'",
            **dict.fromkeys(("pair", "pair_length", "pair_template_error"), pair),
            **{f"{c}_non_text": repr(c) for c in ("chosen", "rejected")}}


def _suite(kind: str | None, frame: pd.DataFrame, dataset: str, *, leaked: list[str] | None, is_val: bool,
           limit: float | None, unit: str, mostly: float, known_sources: Sequence[str] | None,
           skipped: list[str], prompt_key: str = "prompt", reward_fn_key: str = "data_source",
           ground_truth_required: bool = True, ground_truth_reason: str | None = None,
           min_kept: int | None = None) -> list[Any]:
    """The expectations for one table; a check whose column the table lacks is listed in ``skipped``.

    ``leaked``: the training questions (prompt data: ``prompt_asked``, as val writes them) or prompts (preference
    data) that a validation table must not hold. ``known_sources`` None: a custom reward function scores every source, so neither the
    source nor the answer's form is the built-in rules' business. ``prompt_key``, ``reward_fn_key``: the
    columns prompt data keeps its prompt and its data source in. Without ``ground_truth_required`` the
    built-in rules grade only the rows with a ground truth (a reward model scores the rest), so their
    checks cover those rows, and ``reward_model`` is not a required column. ``ground_truth_reason``: why the
    table needs a ground truth on every row where the trainer's reason is not the whole story, said in the
    descriptions of the checks that require it (``reward_model`` present, its ground truth not null). An optional
    column of prompt data (:data:`~rlhf_core.data.schema.OPTIONAL_COLUMNS`: ``ability``, ``extra_info``) is checked
    where it is there: a file of the table without it is no finding (its rows' problem ids are their rows in that
    file, which ``problem_id_unique`` checks); ``ability`` for nulls, ``extra_info`` for cells that are not mappings
    (``extra_info_is_mapping``): a null one reads as an empty mapping, as in a file without the column. A
    required column that only some of the files joined into the table have (``{column}_missing_from``) fails
    ``column_in_every_file``, which names the files without it; its nulls are checked in the files that have it.
    ``min_kept``: the prompts within the limit the table needs where the over-long ones are dropped
    (``data.filter_overlong_prompts``); None where they are kept.
    """
    import great_expectations.expectations as gxe
    from great_expectations.expectations.row_conditions import Column

    # row conditions are GX's condition objects: GX 1.9 deprecated the strings pandas parses, GX 2.0 removes them
    def in_files_with(column: str) -> dict[str, Any]:
        """Only the rows of the joined files that have ``column``."""
        return {"row_condition": Column(f"{column}_missing_from").is_null()}

    # the trainer reads the prompt and the source from the configured columns; preference data has fixed ones
    renamed = {"prompt": prompt_key, "data_source": reward_fn_key}
    prompt_columns = tuple(renamed.get(c, c) for c in PROMPT_COLUMNS
                           if ground_truth_required or c != "reward_model")
    because = f" ({ground_truth_reason})" if ground_truth_required and ground_truth_reason else ""
    columns = dict.fromkeys(prompt_columns + PREFERENCE_COLUMNS) if kind is None else (
        PREFERENCE_COLUMNS if kind == "preference" else prompt_columns)
    # a column the trainer is told to read is not optional, nor is a column preference data needs
    optional = set(OPTIONAL_COLUMNS) - {prompt_key, reward_fn_key} - set(PREFERENCE_COLUMNS if kind != "prompt" else ())
    # the trainer reads a null extra_info of prompt data as an empty one, as it does a file without the column
    nullable = {"extra_info"} - {prompt_key, reward_fn_key} if kind == "prompt" else set()
    required = [c for c in columns if c not in optional]
    sources = _sources("prompt" if kind == "preference" else prompt_key, reward_fn_key)
    key = "prompt_json" if kind == "preference" else "prompt_asked"
    # (check, GX expectation, column or columns, what it checks, the expectation's arguments)
    specs: list[tuple[str, type, Any, str, dict[str, Any]]] = [
        ("has_rows", gxe.ExpectTableRowCountToBeBetween, None, "the table has at least one row", {"min_value": 1}),
        *[("column_exists", gxe.ExpectColumnToExist, c,
           f"column '{c}' is present{because if c == 'reward_model' else ''}", {}) for c in required],
        # a split of several files: each file has each required column (a file without it is named, not its rows)
        *[("column_in_every_file", gxe.ExpectColumnValuesToBeNull, f"{c}_missing_from",
           f"every file joined into the table has column '{c}' (shown: the files without it)", {})
          for c in required if f"{c}_missing_from" in frame],
        *[("not_null", gxe.ExpectColumnValuesToNotBeNull, c, f"'{c}' is never null", {}) for c in columns
          if c in frame and f"{c}_missing_from" not in frame and c not in nullable],
        # an optional column some of the joined files lack: its nulls count in the files that have it
        *[("not_null", gxe.ExpectColumnValuesToNotBeNull, c, f"'{c}' is never null in the files that have it",
           in_files_with(c)) for c in columns if c in frame and f"{c}_missing_from" in frame and c not in nullable],
        ("prompt_is_non_empty_message_list", gxe.ExpectColumnValuesToBeNull, "prompt_problem",
         "prompt is a non-empty list of {role, content} string messages (shown: what is wrong)", {}),
        ("prompt_has_user_turn", gxe.ExpectColumnValuesToBeInSet, "prompt_has_user_turn",
         "prompt has a 'user' turn", {"value_set": [True]}),
        ("prompt_roles_known", gxe.ExpectColumnValuesToBeNull, "prompt_unknown_roles",
         f"every message's role is one of {', '.join(CHAT_ROLES)} (shown: the others; a chat template writes an "
         "unknown role as text, or drops the message): rename them, e.g. human -> user, gpt -> assistant", {}),
        ("prompt_user_content_non_empty", gxe.ExpectColumnValuesToMatchRegex, "prompt_user_content",
         "the last user turn is not blank", {"regex": NON_BLANK_REGEX}),
    ]
    if is_val and kind is not None and leaked is None:
        skipped.append(f"{dataset}: no_train_val_leakage (needs {sources[key]} in both files)")
    elif is_val and kind is not None:
        # preference data by prompt, as the reward model's trainer refuses it: a question's pairs stay on one side
        what = "prompt" if kind == "preference" else \
            "question (its system and user turns, whitespace runs and case aside; shown as written)"
        specs.append(("no_train_val_leakage", gxe.ExpectColumnValuesToNotBeInSet, key,
                      f"no validation row repeats a training {what}", {"value_set": leaked}))
    if is_val and kind == "prompt":
        # evaluation scores each row as a problem: a question asked twice counts twice in the promotion's test.
        # The training split may repeat one (it is sampled more often, nothing is counted)
        specs.append(("question_unique", gxe.ExpectColumnValuesToBeUnique, "prompt_question",
                      "no two validation rows ask the same question (the system and user turns, whitespace runs and "
                      "case aside; shown: the question): evaluation would count it as two problems; drop the copies",
                      {}))
    if kind == "prompt" and "reward_model_non_mapping" in frame:  # a missing column is column_exists' finding
        specs.append(("reward_model_is_mapping", gxe.ExpectColumnValuesToBeNull, "reward_model_non_mapping",
                      "reward_model is a {style, ground_truth} mapping (a parquet struct), not text or a number: "
                      "parse JSON text (json.loads) before writing the parquet", {}))
    if kind == "prompt" and "extra_info_non_mapping" in frame:
        specs.append(("extra_info_is_mapping", gxe.ExpectColumnValuesToBeNull, "extra_info_non_mapping",
                      "extra_info is a mapping (a parquet struct) or null, which the trainer reads as an empty one "
                      "(shown: what is wrong)", {}))
    if kind == "prompt":
        if ground_truth_required and "reward_model_missing_from" in frame:  # column_in_every_file names the others
            specs.append(("not_null", gxe.ExpectColumnValuesToNotBeNull, "ground_truth",
                          f"reward_model.ground_truth is never null in the files that have 'reward_model'{because}",
                          in_files_with("reward_model")))
        elif ground_truth_required:
            specs.append(("not_null", gxe.ExpectColumnValuesToNotBeNull, "ground_truth",
                          f"reward_model.ground_truth is never null{because}", {}))
        else:
            skipped.append(f"{dataset}: not_null [ground_truth] (rows may go without a ground truth: a reward "
                           "model at reward_model.rule_coef=0 or a custom reward function scores them)")
        if "ground_truth" in frame:  # no reward_model column (prompts alone): no ground truth to disagree
            specs.append(("prompt_has_one_ground_truth", gxe.ExpectColumnValuesToBeNull, "prompt_conflicting_truths",
                          "rows that repeat a prompt (all its messages) agree on reward_model.ground_truth (the "
                          "shown truths: all but one reward a right answer as wrong); fix or drop the wrong rows", {}))
        specs.append(("problem_id_unique", gxe.ExpectColumnValuesToBeUnique, "problem_id",
                      f"no two rows share {reward_fn_key} and extra_info.index (without an index: the row's number "
                      "in its file, as the trainer numbers it); evaluation pairs problems by them", {}))
        # a row without a ground truth is the reward model's alone: only a graded row needs a built-in rule
        graded = {} if ground_truth_required else {"row_condition": Column("ground_truth").is_not_null()}
        only = "" if ground_truth_required else " (rows with a ground truth)"
        if known_sources is None:
            skipped.append(f"{dataset}: data_source_known, ground_truth_numeric (a custom reward function "
                           "scores every source)")
        elif not ground_truth_required and "ground_truth" not in frame:
            skipped.append(f"{dataset}: data_source_known, ground_truth_numeric (no 'reward_model' column: no row "
                           "has a ground truth for a built-in rule to grade)")
        else:
            specs += [
                ("data_source_known", gxe.ExpectColumnValuesToBeInSet, reward_fn_key,
                 f"{reward_fn_key} has a registered reward function{only}",
                 {"value_set": list(known_sources), **graded}),
                ("ground_truth_numeric", gxe.ExpectColumnValuesToMatchRegex, "ground_truth",
                 f"reward_model.ground_truth is a number (optional dollar sign and minus, thousands commas, "
                 f"decimals; an integer without '.0', which the rule's string match would miss){only}",
                 {"regex": gsm8k.ANSWERABLE_TEXT, **graded}),
            ]
        renders = ("prompt_renders", "prompt_template_error",
                   "the chat template renders the prompt (the trainer stops on a prompt it refuses)")
        length = ("prompt_length_within_limit", "prompt_tokens", f"prompt is at most {limit} tokens")
    if kind == "preference":
        specs += [  # a number passes a regex (GX matches its text), so a response is first checked to be text
            *[(f"{c}_is_text", gxe.ExpectColumnValuesToBeNull, f"{c}_non_text", f"'{c}' is a string", {})
              for c in ("chosen", "rejected")],
            *[(f"{c}_non_empty", gxe.ExpectColumnValuesToMatchRegex, c, f"'{c}' holds a non-blank character",
               {"regex": NON_BLANK_REGEX}) for c in ("chosen", "rejected")],
            ("chosen_differs_from_rejected", gxe.ExpectSelectColumnValuesToBeUniqueWithinRecord,
             ("chosen", "rejected"), "chosen and rejected are different texts", {}),
            ("no_duplicate_pairs", gxe.ExpectColumnValuesToBeUnique, "pair",
             "each prompt, chosen, rejected triple appears once", {}),
        ]
        renders = ("pair_renders", "pair_template_error",
                   "the chat template renders the prompt with each response")
        length = ("pair_length_within_limit", "pair_length",
                  f"prompt and the longer response are at most {limit} {unit}")
    if kind is not None and limit is not None:
        # a conversation the template refuses has no length, which GX would skip: it fails here instead
        specs += [(renders[0], gxe.ExpectColumnValuesToBeNull, renders[1], renders[2], {}),
                  (length[0], gxe.ExpectColumnValuesToBeBetween, length[1], length[2],
                   {"max_value": limit, "mostly": mostly})]
    if kind == "prompt" and limit is not None and min_kept is not None:
        # the trainer drops the others: too few left fails there, after the steps before it spent their compute
        specs.append(("prompts_left_after_filter", gxe.ExpectColumnSumToBeBetween, "prompt_within_limit",
                      f"at least {min_kept} prompt(s) of at most {limit} {unit}, the ones data.filter_overlong_prompts "
                      "keeps (a batch of them)", {"min_value": min_kept}))
    expectations = []
    for name, expectation, columns, description, kwargs in specs:
        names = (columns,) if isinstance(columns, str) else columns or ()
        missing = [c for c in names if c not in frame]
        if missing and name != "column_exists":
            skipped.append(f"{dataset}: {name} (needs column {sources.get(missing[0], repr(missing[0]))})")
            continue
        where = {"column_list": list(names)} if len(names) > 1 else {"column": columns} if names else {}
        expectations.append(expectation(**where, **kwargs, description=f"{name}: {description}",
                                        meta={"check": name, "order": len(expectations)}))
    return expectations


_gx_lock = threading.Lock()


@functools.cache
def _batch_definition() -> Any:
    """A whole-dataframe batch definition on one ephemeral GX context for the process."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    # (this one sets INFO for itself as it imports: "Created temporary directory ... for ephemeral docs site")
    logging.getLogger("great_expectations.data_context.types.base").setLevel(logging.ERROR)
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    source = context.data_sources.add_pandas(name="rlhf_data")
    return source.add_dataframe_asset(name="table").add_batch_definition_whole_dataframe("whole_table")


def _run(frame: pd.DataFrame, expectations: list[Any], name: str) -> Any:
    import great_expectations as gx

    with _gx_lock, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = _batch_definition().get_batch(batch_parameters={"dataframe": frame})
        return batch.validate(gx.ExpectationSuite(name=name, expectations=expectations),
                              result_format={"result_format": "COMPLETE"})


# ---------------------------------------------------------------------------------------------
# Entry points


def validate_frames(train: pd.DataFrame, val: pd.DataFrame | None = None, tokenizer: Any = None,
                    max_prompt_length: int | None = None, *, kind: str | None = "prompt",
                    max_length: int | None = None, max_chars: int | None = None,
                    known_sources: Iterable[str] | None = None, custom_reward: bool = False,
                    overlong_tolerance: float = 0.0, template_kwargs: dict | None = None,
                    prompt_key: str = "prompt", reward_fn_key: str = "data_source",
                    names: tuple[str, str] = ("train", "val"),
                    paths: tuple[str | None, str | None] = (None, None),
                    file_rows: tuple[Sequence[int] | None, Sequence[int] | None] = (None, None),
                    ground_truth_required: bool | tuple[bool, bool] = True,
                    ground_truth_reason: tuple[str | None, str | None] = (None, None),
                    option_names: Mapping[str, str] | None = None,
                    min_kept: tuple[int | None, int | None] = (None, None),
                    missing_in_file: tuple[Mapping[str, Sequence[str | None]] | None, ...] = (None, None),
                    trust_remote_code: bool = False) -> ValidationReport:
    """Validate in-memory frames of one ``kind``: "prompt", "preference", "auto" (told by ``train``'s columns).

    A limit in tokens (``max_prompt_length`` for prompt data, ``max_length`` for preference data)
    needs the tokenizer; ``max_chars`` (preference data) counts characters. A limit given for the
    other kind, or a tokenizer without a limit, is a ValueError. ``custom_reward``: a custom reward function
    scores the data (``custom_reward_function.path``), so the checks of the built-in rules (a known data
    source, a numeric ground truth) do not apply. ``template_kwargs``: the chat template's keywords when
    lengths are measured (``data.apply_chat_template_kwargs``; for preference data
    ``reward_model.train.apply_chat_template_kwargs``). ``prompt_key``, ``reward_fn_key``: the columns
    of prompt data's prompt and data source (``data.prompt_key``, ``data.reward_fn_key``). ``file_rows``: each
    row's number within its file (default: its position in the frame), which numbers a row without
    ``extra_info.index`` as the trainer does. ``ground_truth_required=False``: prompt data trained without a
    ground truth (:meth:`~rlhf_core.config.PPOConfig.needs_ground_truth` False: a reward model at
    ``reward_model.rule_coef=0`` or a custom reward function), which the trainer takes without the
    ``reward_model`` column or with rows whose ground truth is null; a pair (train, val) sets each split's, as the
    pipelines do where their evaluation grades the validation set with the built-in rule (a reward model at
    ``rule_coef=0``), and ``ground_truth_reason`` then says for each split why it needs one (None: the trainer's
    rule reward), in the checks that require it. Preference data has none, and ignores both.
    ``option_names``: what the errors call the tokenizer, the limits and the tolerance, and what the note on prompts
    without a ``reward_model`` column calls ``ground_truth_required`` (:data:`_OPTIONS`), for a caller whose user
    set them otherwise (the command line's ``--max-chars``, ``--no-ground-truth``); by default these parameters'
    names (``ground_truth_required=False``).
    ``min_kept``: for prompt data whose over-long prompts the trainer drops (``data.filter_overlong_prompts``), the
    prompts within ``max_prompt_length`` that train and val each need (the trainer's batch of prompts; 1), else None.
    ``missing_in_file``: for train and val, a column that only some of the files joined into the table have -> for
    each row, the file it came from where that file lacks the column, else None: the other files' rows are not the
    column's nulls; a required column fails ``column_in_every_file`` naming those files, an optional one
    (``ability``) is not required of them.
    ``trust_remote_code``: a tokenizer given by its path loads with the code its folder holds
    (``actor_rollout_ref.model.trust_remote_code``).
    """
    truth_required = (ground_truth_required,) * 2 if isinstance(ground_truth_required, bool) else \
        tuple(ground_truth_required)
    kind = detect_kind(train.columns, truth_required[0]) if kind == "auto" else kind
    if kind is None:  # the missing columns are the finding; no limit applies
        tokenizer = max_prompt_length = max_length = max_chars = None
    name = {**dict(zip(_OPTIONS, _OPTIONS)), "ground_truth_required": "ground_truth_required=False",
            **(option_names or {})}
    notes = []
    if kind is None and truth_required[0] and prompt_key in train.columns:  # prompts, told by no column
        notes.append(f"'{prompt_key}' without 'reward_model', 'chosen' or 'rejected' is prompt data without a ground "
                     "truth, which trains with a custom reward function or a reward model at "
                     f"reward_model.rule_coef=0 and needs no 'reward_model' column: validate it so with "
                     f"{name['ground_truth_required']}")
    if kind is None and prompt_key not in train.columns and {"question", "answer"} <= set(train.columns):
        notes.append("'question' and 'answer' are GSM8K as released: rlhf gsm8k --input <its folder> --output "
                     "<folder> writes them as prompt data (verl's columns), the files to validate and train on")
    given = {"max_prompt_length": max_prompt_length, "max_length": max_length, "max_chars": max_chars}
    wrong = [name[key] for key, value in given.items() if value is not None and key not in _LIMITS[kind]]
    if wrong:
        raise ValueError(f"{', '.join(wrong)} does not apply to {kind or 'this'} data; limits by kind: prompt data "
                         f"{name['max_prompt_length']} (tokens), preference data {name['max_length']} (tokens) or "
                         f"{name['max_chars']} (characters)")
    token_limit, token_name = (max_prompt_length, name["max_prompt_length"]) if kind == "prompt" else \
        (max_length, name["max_length"])
    if token_limit is not None and max_chars is not None:
        raise ValueError(f"give a token limit ({token_name}) or a character limit ({name['max_chars']}), not both")
    if (tokenizer is None) != (token_limit is None):
        chars = f" ({name['max_chars']} counts characters, without a tokenizer)" if max_chars is not None else ""
        raise ValueError(f"a length limit in tokens needs both a tokenizer and the limit: {name['tokenizer']} and "
                         f"{token_name}{chars}")
    limit = token_limit if token_limit is not None else max_chars
    if limit is not None and limit < 1:
        limit_name = token_name if token_limit is not None else name["max_chars"]
        raise ValueError(f"{limit_name} must be a positive integer (the length limit), not {limit}")
    if not 0.0 <= overlong_tolerance <= 1.0:
        raise ValueError(f"{name['overlong_tolerance']} must lie in [0, 1], not {overlong_tolerance}")
    if kind == "prompt" and known_sources is None and not custom_reward:
        from rlhf_core.rewards import known_data_sources

        known_sources = known_data_sources()
    tokenizer = load_tokenizer(tokenizer, trust_remote_code)
    tables = [(names[0], paths[0], train)] + ([(names[1], paths[1], val)] if val is not None else [])
    keys = {"prompt_key": prompt_key, "reward_fn_key": reward_fn_key}
    flat = [flatten(frame, tokenizer, kind, limit is not None, template_kwargs, source_rows=rows, **keys)
            for (_, _, frame), rows in zip(tables, file_rows)]
    compared, shown = ("prompt_json",) * 2 if kind == "preference" else ("prompt_question", "prompt_asked")
    leaked = None
    if len(flat) == 2 and compared in flat[0] and compared in flat[1]:
        # a question is its system and user turns whatever their spacing or case; a preference prompt as the reward
        # model's trainer compares it (its canonical JSON). The set holds val's questions as written (prompt_asked,
        # from which prompt_question follows), so the report shows them so
        seen = set(flat[0][compared].dropna())
        leaked = sorted({text for question, text in zip(flat[1][compared], flat[1][shown]) if question in seen})
    skipped: list[str] = []
    if kind is not None and limit is None:  # a PASSED must not read as "the prompts fit"
        needs = f"{name['tokenizer']} and {name['max_prompt_length']}" if kind == "prompt" else \
            f"{name['tokenizer']} and {name['max_length']}, or {name['max_chars']}"
        check = "prompt_length_within_limit" if kind == "prompt" else "pair_length_within_limit"
        skipped.append(f"{', '.join(t[0] for t in tables)}: {check} (no length limit given: needs {needs})")
    results = {}
    for position, ((name, _, _), frame) in enumerate(zip(tables, flat)):
        for column, lacking in (missing_in_file[position] or {}).items():
            frame[f"{column}_missing_from"] = pd.Series(list(lacking), index=frame.index, dtype="object")
        if kind == "prompt" and "prompt_tokens" in frame and min_kept[position] is not None:
            frame["prompt_within_limit"] = (frame["prompt_tokens"] <= limit).astype("float64")  # NaN: not kept
        suite = _suite(kind, frame, name, leaked=leaked if position else None, is_val=position == 1, limit=limit,
                       unit="tokens" if tokenizer is not None else "characters", mostly=_kept_share(overlong_tolerance),
                       known_sources=None if custom_reward else sorted(map(str, known_sources or [])),
                       skipped=skipped, ground_truth_required=truth_required[position],
                       ground_truth_reason=ground_truth_reason[position], **keys,
                       min_kept=min_kept[position] if limit is not None else None)
        results[name] = _run(frame, suite, f"{name}.{kind or 'unknown'}_data")
    datasets = [DatasetInfo(name, path, len(frame), [str(c) for c in frame.columns])
                for name, path, frame in tables]
    return ValidationReport(kind, results, datasets, skipped, notes=notes)


class DataChangedError(ValueError):
    """The data files are no longer the bytes that were validated."""


def check_unchanged(train: Paths, val: Paths | None, validated: str | None, where: str) -> None:
    """Raise :class:`DataChangedError` when the training and validation files no longer have the fingerprint
    ``validated`` (:func:`splits_fingerprint`; None: nothing to hold them to), so that a run never trains or
    evaluates on data other than the data it validated and records."""
    if validated is None:
        return
    now = splits_fingerprint(train, val)
    if now != validated:
        files = _files(train) + (_files(val) if val is not None else [])
        raise DataChangedError(
            f"{where}: the data files changed since they were validated (fingerprint {validated[:12]} then, "
            f"{now[:12]} now: {', '.join(map(str, files))}); run the pipeline again on data that "
            "stays put while it runs")


def _kept_share(overlong_tolerance: float) -> float:
    """GX's ``mostly`` for at most ``overlong_tolerance`` of the rows over: ``1 - t`` without the float rounding
    that put it above the share a run exactly at the tolerance keeps (1 - 0.7 is 0.30000000000000004, above 3 of
    10 rows)."""
    return round(1.0 - overlong_tolerance, 12)


def validate_dataset(train: Paths, val: Paths | None = None, tokenizer: Any = None,
                     max_prompt_length: int | None = None, *, kind: str | None = "auto",
                     **options: Any) -> ValidationReport:
    """Read the parquet file(s) and validate them (see :func:`validate_frames` for ``options``).

    Several files of one split are joined, their rows numbered on; the report carries the splits'
    :func:`splits_fingerprint`, taken before they are read: files replaced while the suite runs raise
    :class:`DataChangedError` rather than give the fingerprint of bytes never validated. Raises
    :class:`DataReadError` for an unreadable file or tokenizer.
    """
    train_files, val_files = _files(train), _files(val) if val is not None else []
    try:
        fingerprint = splits_fingerprint(train_files, val_files)
    except (DataReadError, ValueError):  # (the read below names the file and what is wrong with it)
        fingerprint = None
    tables = [[_mark_widened(read_parquet(p), p) for p in files] for files in (train_files, val_files)]
    frames = [pd.concat(table, ignore_index=True) if table else None for table in tables]
    # the trainer numbers a row without extra_info.index by its row in its own file, not in the joined table
    rows = [np.concatenate([np.arange(len(f)) for f in table]) if table else None for table in tables]
    # a column of some files only: the joined table holds nulls for the others' rows, which are not the finding;
    # each row -> its file where that file lacks the column (the suite names the files a required column is not in)
    partial = [{c: np.concatenate([np.full(len(f), None if c in f else str(path), dtype=object)
                                   for path, f in zip(files, table)])
                for c in dict.fromkeys(c for f in table for c in f.columns) if sum(c in f for f in table) < len(table)}
               for files, table in zip((train_files, val_files), tables)]
    report = validate_frames(frames[0], frames[1], tokenizer, max_prompt_length, kind=kind, **options,
                             paths=(",".join(map(str, train_files)), ",".join(map(str, val_files)) or None),
                             file_rows=(rows[0], rows[1]), missing_in_file=(partial[0], partial[1]))
    check_unchanged(train_files, val_files or None, fingerprint, "data validation")
    report.fingerprint = fingerprint
    for info, files, table in zip(report.datasets, (train_files, val_files), tables):
        if len(files) > 1:
            report.file_spans[info.name] = [(str(path), len(frame)) for path, frame in zip(files, table)]
    return report


def _mark_widened(frame: pd.DataFrame, path: Path) -> pd.DataFrame:
    """``frame`` (read from ``path``) with each ground truth its file stores as float32 or float16 that reads back
    with digits of its own (0.1 as 0.10000000149011612, which no answer matches, as the trainer reads it) replaced
    by that value and why, text the ground-truth check refuses and the report shows."""
    import pyarrow.parquet as pq

    narrow = single_precision_truth(pq.read_schema(path)) if "reward_model" in frame else None
    if narrow is None:
        return frame

    def mark(cell):
        truth = cell.get("ground_truth") if isinstance(cell, Mapping) else None
        if isinstance(truth, float) and widened(truth, narrow):
            return {**cell, "ground_truth": f"{truth!r} (a {narrow} field read back as a double)"}
        return cell

    return frame.assign(reward_model=frame["reward_model"].map(mark))


def validate_preference_files(train: Paths, val: Paths | None = None, tokenizer: Any = None,
                              max_length: int | None = None, *, max_chars: int | None = None,
                              overlong_tolerance: float = 0.0, template_kwargs: dict | None = None) -> ValidationReport:
    """Validate preference parquet file(s): a token (tokenizer + max_length, the chat template rendered with
    ``template_kwargs``, ``reward_model.train.apply_chat_template_kwargs``) or character limit."""
    return validate_dataset(train, val, tokenizer, kind="preference", max_length=max_length,
                            max_chars=max_chars, overlong_tolerance=overlong_tolerance, template_kwargs=template_kwargs)


# ---------------------------------------------------------------------------------------------
# Text helpers


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def _tidy(value: Any) -> Any:
    value = value.item() if isinstance(value, np.generic) else value
    if isinstance(value, float):
        return None if math.isnan(value) else int(value) if value.is_integer() else value
    return value


def _excerpt(value: Any) -> str:
    plain = value is None or isinstance(value, (str, bool, int, float))
    text = repr(value) if plain else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= _EXCERPT_CHARS else text[: _EXCERPT_CHARS - 3] + "..."


def _escape(value: Any) -> Any:
    if isinstance(value, str):
        return html.escape(value)
    if isinstance(value, Mapping):
        return {key: _escape(item) for key, item in value.items()}
    return type(value)(map(_escape, value)) if isinstance(value, (list, tuple)) else value


def _percent(share: float) -> str:
    return f"{100.0 * float(share):.1f}%"


def _describe_limit(outcome: Outcome) -> str:
    """A passed length check's line: the share of rows over the limit, or why no row was measured (GX passes
    a check with nothing to check)."""
    if "share_over" in outcome.statistics:
        return f"  {outcome.dataset}: {_percent(outcome.statistics['share_over'])} of rows over the limit " \
               f"({outcome.description})"
    why = "every row is null, malformed or refused by the chat template (see the failures above)" \
        if outcome.statistics.get("element_count") else "the table has no rows"
    return f"  {outcome.dataset}: no row could be measured against the limit ({outcome.description}): {why}"


def _describe_failure(outcome: Outcome) -> str:
    stats = outcome.statistics
    if "error" in stats:  # GX could not evaluate it: no row count would mean anything
        return f"error: {stats['error']} (the check could not run: {outcome.description})"
    if outcome.name == "column_exists":  # with the reason its description gives, if any
        return f"column '{outcome.column}' is missing{outcome.description.partition(' is present')[2]}"
    if outcome.name == "column_in_every_file":
        files = [str(value) for _, value in outcome.examples]
        one = len(files) == 1
        return (f"{'file' if one else 'files'} {', '.join(files)} {'lacks' if one else 'lack'} column "
                f"'{outcome.column.removesuffix('_missing_from')}', which the split's other files have "
                f"({stats.get('unexpected_count')} rows without it): add the column to {'it' if one else 'them'}")
    if outcome.name == "has_rows":
        return f"{stats.get('observed_value', 0)} rows"
    if outcome.name == "prompts_left_after_filter":
        return (f"{_tidy(stats.get('observed_value')) or 0} left ({outcome.description}): raise the length limit, "
                "lower the batch size or add shorter prompts")
    checked = int(stats.get("element_count") or 0) - int(stats.get("missing_count") or 0)
    share = stats.get("unexpected_count", 0) / checked if checked else 0.0
    return f"{stats.get('unexpected_count')} of {checked} rows fail ({_percent(share)}): {outcome.description}"
