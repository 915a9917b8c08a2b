"""Check verl prompt datasets with a Great Expectations (1.x) suite before training.

The parquet files are read with pyarrow, flattened with pandas into helper columns, and the
result is validated on an ephemeral GX context with a pandas data source:

* ``has_rows``: the table has at least one row;
* ``column_exists`` for every column of :data:`~rlhf_core.data.schema.REQUIRED_COLUMNS`; when one
  is missing it is reported and the expectations that need it are skipped (listed in
  :attr:`ValidationReport.skipped`);
* ``not_null`` for every required column and for ``ground_truth``;
* ``prompt_is_non_empty_message_list`` (helper ``prompt_num_messages``: the number of messages,
  ``-1`` when ``prompt`` is not a list of ``{role, content}`` string messages);
  ``prompt_has_user_turn``; ``prompt_user_content_non_empty`` (helper ``prompt_user_content``:
  the content of the last ``user`` turn, which must hold a non-blank character);
* ``ground_truth_numeric``: ``reward_model.ground_truth`` must be a plain decimal number, the
  regex :data:`GROUND_TRUTH_REGEX`: an optional minus sign, digits that may carry thousands
  commas, an optional fractional part, surrounding whitespace allowed. Fractions, units,
  currency signs and exponents are rejected: the rule-based rewards compare numbers, and
  ``extract_final_answer`` already strips commas, so every GSM8K answer passes;
* ``data_source_known``: ``data_source`` is one of ``rlhf_core.rewards.known_data_sources()``;
* ``no_train_val_leakage`` (validation file only): no validation prompt has the same
  ``prompt_user_content`` (exact string match) as a training prompt. The overlap is computed
  with pandas and handed to ``ExpectColumnValuesToNotBeInSet`` as the forbidden set, so the
  failing rows are the validation rows that leak;
* ``prompt_length_within_limit`` (when a tokenizer and ``max_prompt_length`` are given): helper
  ``prompt_tokens`` counts the prompt's tokens (the tokenizer's chat template with a generation
  prompt when it has one, else the message contents joined by newlines); the share of rows over
  the limit is reported as ``share_over`` and may be at most ``overlong_tolerance`` (GX
  ``mostly``).

Usage::

    python -m rlhf_core.data.validation TRAIN.parquet [--val VAL.parquet]
        [--tokenizer PATH --max-prompt-length N [--overlong-tolerance F]]
        [--html OUT.html] [--json]

Exit status: 0 when every expectation holds, 1 when any fails, 2 when an input cannot be read
(a one-line reason on stderr) or the command line is wrong.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import logging
import math
import os
import sys
import threading
import uuid
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlhf_core.data.schema import REQUIRED_COLUMNS

GROUND_TRUTH_REGEX = r"^\s*-?[0-9][0-9,]*(?:\.[0-9]+)?\s*$"
NON_BLANK_REGEX = r"\S"
MAX_EXAMPLES = 3
_EXCERPT_CHARS = 80
_CHUNK = 1 << 20

# GX reports anonymous usage analytics unless told not to; there is no network here anyway.
os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")


class DataReadError(Exception):
    """An input file that cannot be read as a parquet table (or a tokenizer that cannot be loaded)."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = _one_line(reason)
        super().__init__(f"cannot read {self.path}: {self.reason}")


@dataclass
class ExpectationOutcome:
    """The result of one expectation on one dataset."""

    name: str
    column: str | None
    success: bool
    dataset: str = "train"
    expectation_type: str = ""
    description: str = ""
    statistics: dict[str, Any] = field(default_factory=dict)
    examples: list[tuple[int, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "column": self.column,
            "success": bool(self.success),
            "dataset": self.dataset,
            "expectation_type": self.expectation_type,
            "description": self.description,
            "statistics": _jsonable(self.statistics),
            "examples": [[int(index), _jsonable(value)] for index, value in self.examples],
        }

    @property
    def label(self) -> str:
        where = f"{self.dataset}.{self.column}" if self.column else self.dataset
        return f"{self.name} [{where}]"


@dataclass
class DatasetInfo:
    """Where one validated table came from."""

    name: str
    path: str | None
    rows: int
    columns: list[str]


@dataclass
class ValidationReport:
    """Every expectation's outcome over the training (and validation) data."""

    success: bool
    results: list[ExpectationOutcome]
    datasets: list[DatasetInfo] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    fingerprint: str | None = None
    max_prompt_length: int | None = None

    @property
    def failures(self) -> list[ExpectationOutcome]:
        return [outcome for outcome in self.results if not outcome.success]

    def find(
        self, name: str, column: str | None = None, dataset: str | None = None
    ) -> list[ExpectationOutcome]:
        """The outcomes called ``name`` (optionally on ``column`` / ``dataset``)."""
        return [
            outcome
            for outcome in self.results
            if outcome.name == name
            and (column is None or outcome.column == column)
            and (dataset is None or outcome.dataset == dataset)
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "success": bool(self.success),
            "fingerprint": self.fingerprint,
            "max_prompt_length": self.max_prompt_length,
            "datasets": [
                {"name": d.name, "path": d.path, "rows": int(d.rows), "columns": list(d.columns)}
                for d in self.datasets
            ],
            "statistics": {
                "evaluated_expectations": len(self.results),
                "successful_expectations": len(self.results) - len(self.failures),
                "unsuccessful_expectations": len(self.failures),
            },
            "results": [outcome.to_dict() for outcome in self.results],
            "skipped": list(self.skipped),
        }

    def summary(self) -> str:
        total, failed = len(self.results), len(self.failures)
        if self.success:
            head = f"Dataset validation PASSED: all {total} expectations hold"
        else:
            head = f"Dataset validation FAILED: {failed} of {total} expectations failed"
        lines = [head]
        for d in self.datasets:
            lines.append(f"  {d.name}: {d.path or '<in memory>'} ({d.rows} rows)")
        if self.fingerprint:
            lines.append(f"  fingerprint: {self.fingerprint}")
        for outcome in self.failures:
            lines.append(f"FAILED {outcome.label} ({outcome.expectation_type}): {_describe_failure(outcome)}")
            for index, value in outcome.examples:
                lines.append(f"    row {index}: {_excerpt(value)}")
        for outcome in self.find("prompt_length_within_limit"):
            if outcome.success:
                stats = outcome.statistics
                lines.append(
                    f"  {outcome.dataset}: {_percent(stats.get('share_over', 0.0))} of prompts over "
                    f"{stats.get('max_prompt_length')} tokens (longest {stats.get('max_tokens')})"
                )
        for item in self.skipped:
            lines.append(f"  skipped: {item}")
        return "\n".join(lines)

    def to_html(self, title: str = "Dataset validation") -> str:
        return _render_html(self, title)


# ---------------------------------------------------------------------------------------------
# Reading and fingerprinting


def read_parquet(path: str | os.PathLike) -> pd.DataFrame:
    """Read one parquet file; any failure becomes a :class:`DataReadError` with a one-line reason."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.exists():
        raise DataReadError(path, "no such file")
    if path.is_dir():
        raise DataReadError(path, "is a directory, expected a parquet file")
    try:
        table = pq.read_table(path)
        return table.to_pandas()
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise DataReadError(
            path, f"not a readable parquet file ({_one_line(str(exc)) or type(exc).__name__})"
        ) from exc


def fingerprint(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> str:
    """SHA-256 over the bytes of ``paths``, independent of the order they are given in.

    The files are hashed in order of their file name (ties broken by the full path), each one
    preceded by its byte length so that moving bytes from one file into another changes the
    digest. Moving a dataset to another folder keeps its fingerprint.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = sorted((Path(p) for p in paths), key=lambda p: (p.name, str(p)))
    if not files:
        raise ValueError("fingerprint needs at least one file")
    digest = hashlib.sha256()
    for path in files:
        try:
            size = path.stat().st_size
            digest.update(size.to_bytes(8, "big"))
            with open(path, "rb") as handle:
                for chunk in iter(lambda handle=handle: handle.read(_CHUNK), b""):
                    digest.update(chunk)
        except OSError as exc:
            raise DataReadError(path, exc.strerror or str(exc)) from exc
    return digest.hexdigest()


def load_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` itself, or the tokenizer saved at that path (loaded offline)."""
    if tokenizer is None or not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    path = Path(tokenizer)
    if not path.exists():
        raise DataReadError(path, "no such tokenizer directory")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for a broken folder
        raise DataReadError(
            path, f"cannot load tokenizer ({_one_line(str(exc)) or type(exc).__name__})"
        ) from exc


# ---------------------------------------------------------------------------------------------
# Flattening


def _as_list(value: Any) -> list | None:
    if isinstance(value, np.ndarray):
        return list(value)
    if isinstance(value, (list, tuple)):
        return list(value)
    return None


def _is_missing(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    return value is pd.NA or value is pd.NaT


def _messages(value: Any) -> list[dict[str, str]] | None:
    """The prompt as ``[{role, content}]`` with string fields, or None when malformed."""
    items = _as_list(value)
    if items is None:
        return None
    messages = []
    for item in items:
        if not isinstance(item, Mapping):
            return None
        role, content = item.get("role"), item.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            return None
        messages.append({"role": role, "content": content})
    return messages


def _ground_truth(value: Any) -> str | None:
    if not isinstance(value, Mapping):
        return None
    truth = value.get("ground_truth")
    if _is_missing(truth):
        return None
    if isinstance(truth, (bytes, bytearray)):
        return truth.decode("utf-8", errors="replace")
    return str(truth)


def flatten(frame: pd.DataFrame, tokenizer: Any = None) -> pd.DataFrame:
    """``frame`` plus the helper columns the expectations run on.

    ``prompt_num_messages`` (float; -1 for a malformed prompt, NaN for a null one),
    ``prompt_has_user_turn`` (None unless the prompt has messages), ``prompt_user_content``,
    ``ground_truth`` and, with a tokenizer, ``prompt_tokens``.
    """
    out = frame.copy()
    if "prompt" in frame.columns:
        counts, has_user, user_content, parsed = [], [], [], []
        for value in frame["prompt"].tolist():
            messages = None if _is_missing(value) else _messages(value)
            parsed.append(messages)
            if _is_missing(value):
                counts.append(np.nan)
            else:
                counts.append(float(len(messages)) if messages is not None else -1.0)
            if not messages:
                has_user.append(None)
                user_content.append(None)
                continue
            users = [m["content"] for m in messages if m["role"] == "user"]
            has_user.append(bool(users))
            user_content.append(users[-1] if users else None)
        out["prompt_num_messages"] = pd.Series(counts, index=frame.index, dtype="float64")
        out["prompt_has_user_turn"] = pd.Series(has_user, index=frame.index, dtype="object")
        out["prompt_user_content"] = pd.Series(user_content, index=frame.index, dtype="object")
        if tokenizer is not None:
            out["prompt_tokens"] = pd.Series(
                _count_tokens(tokenizer, parsed), index=frame.index, dtype="float64"
            )
    if "reward_model" in frame.columns:
        truths = [_ground_truth(value) for value in frame["reward_model"].tolist()]
        out["ground_truth"] = pd.Series(truths, index=frame.index, dtype="object")
    return out


def _count_tokens(tokenizer: Any, prompts: Sequence[list[dict[str, str]] | None]) -> list[float]:
    """Token count per prompt (NaN where the prompt is empty, malformed or cannot be templated)."""
    use_template = bool(getattr(tokenizer, "chat_template", None))
    texts: list[str] = []
    positions: list[int] = []
    for position, messages in enumerate(prompts):
        if not messages:
            continue
        if use_template:
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception:  # a template may reject a conversation (e.g. no user turn)
                continue
        else:
            text = "\n".join(m["content"] for m in messages)
        texts.append(text)
        positions.append(position)
    counts = [math.nan] * len(prompts)
    if texts:
        # A chat template already writes the special tokens it wants.
        encoded = tokenizer(texts, add_special_tokens=not use_template)["input_ids"]
        for position, ids in zip(positions, encoded):
            counts[position] = float(len(ids))
    return counts


# ---------------------------------------------------------------------------------------------
# The suite


@dataclass
class _Check:
    name: str
    column: str | None
    description: str
    expectation: Any


def _build_checks(
    frame: pd.DataFrame,
    *,
    known_sources: Sequence[str],
    leaked: Sequence[str] | None,
    is_val: bool,
    max_prompt_length: int | None,
    overlong_tolerance: float,
    skipped: list[str],
    dataset: str,
) -> list[_Check]:
    gxe = _gx().expectations
    present = set(frame.columns)
    checks = [
        _Check(
            "has_rows",
            None,
            "the table has at least one row",
            gxe.ExpectTableRowCountToBeBetween(min_value=1),
        )
    ]
    for column in REQUIRED_COLUMNS:
        checks.append(
            _Check(
                "column_exists",
                column,
                f"column '{column}' is present",
                gxe.ExpectColumnToExist(column=column),
            )
        )

    def needs(column: str, *names: str) -> bool:
        if column in present:
            return True
        skipped.extend(f"{dataset}: {name} (column '{column}' missing)" for name in names)
        return False

    for column in REQUIRED_COLUMNS:
        if column in present:
            checks.append(
                _Check(
                    "not_null",
                    column,
                    f"'{column}' is never null",
                    gxe.ExpectColumnValuesToNotBeNull(column=column),
                )
            )
    if needs("data_source", "data_source_known"):
        checks.append(
            _Check(
                "data_source_known",
                "data_source",
                "data_source has a registered reward function",
                gxe.ExpectColumnValuesToBeInSet(column="data_source", value_set=sorted(known_sources)),
            )
        )
    prompt_checks = [
        "prompt_is_non_empty_message_list",
        "prompt_has_user_turn",
        "prompt_user_content_non_empty",
    ]
    if is_val:
        prompt_checks.append("no_train_val_leakage")
    if max_prompt_length is not None:
        prompt_checks.append("prompt_length_within_limit")
    if needs("prompt", *prompt_checks):
        checks += [
            _Check(
                "prompt_is_non_empty_message_list",
                "prompt_num_messages",
                "prompt is a non-empty list of {role, content} messages (-1: malformed)",
                gxe.ExpectColumnValuesToBeBetween(column="prompt_num_messages", min_value=1),
            ),
            _Check(
                "prompt_has_user_turn",
                "prompt_has_user_turn",
                "prompt has a 'user' turn",
                gxe.ExpectColumnValuesToBeInSet(column="prompt_has_user_turn", value_set=[True]),
            ),
            _Check(
                "prompt_user_content_non_empty",
                "prompt_user_content",
                "the user turn's content is not blank",
                gxe.ExpectColumnValuesToMatchRegex(column="prompt_user_content", regex=NON_BLANK_REGEX),
            ),
        ]
        if leaked is not None:
            checks.append(
                _Check(
                    "no_train_val_leakage",
                    "prompt_user_content",
                    "no validation prompt also appears in the training data",
                    gxe.ExpectColumnValuesToNotBeInSet(column="prompt_user_content", value_set=list(leaked)),
                )
            )
        if max_prompt_length is not None:
            checks.append(
                _Check(
                    "prompt_length_within_limit",
                    "prompt_tokens",
                    f"prompt is at most {max_prompt_length} tokens",
                    gxe.ExpectColumnValuesToBeBetween(
                        column="prompt_tokens", max_value=max_prompt_length, mostly=1.0 - overlong_tolerance
                    ),
                )
            )
    if needs("reward_model", "not_null(ground_truth)", "ground_truth_numeric"):
        checks += [
            _Check(
                "not_null",
                "ground_truth",
                "reward_model.ground_truth is never null",
                gxe.ExpectColumnValuesToNotBeNull(column="ground_truth"),
            ),
            _Check(
                "ground_truth_numeric",
                "ground_truth",
                "reward_model.ground_truth is a number (optional minus, thousands commas, decimals)",
                gxe.ExpectColumnValuesToMatchRegex(column="ground_truth", regex=GROUND_TRUTH_REGEX),
            ),
        ]
    return checks


# ---------------------------------------------------------------------------------------------
# The GX context (one per process, created on first use)

_gx_module = None
_context_state: dict[str, Any] = {}
_context_lock = threading.Lock()


def _gx():
    global _gx_module
    if _gx_module is None:
        import great_expectations

        _gx_module = great_expectations
    return _gx_module


def _batch_definition():
    """The shared ephemeral context's whole-dataframe batch definition."""
    if "batch_definition" not in _context_state:
        gx = _gx()
        from great_expectations.data_context.types.base import ProgressBarsConfig

        context = gx.get_context(mode="ephemeral")
        context.variables.progress_bars = ProgressBarsConfig(globally=False)
        source = context.data_sources.add_pandas(name="rlhf_prompt_data")
        asset = source.add_dataframe_asset(name="prompt_table")
        _context_state["context"] = context
        _context_state["batch_definition"] = asset.add_batch_definition_whole_dataframe("whole_table")
    return _context_state["context"], _context_state["batch_definition"]


def _run_suite(frame: pd.DataFrame, checks: list[_Check], dataset: str) -> list[ExpectationOutcome]:
    gx = _gx()
    with _context_lock:
        context, batch_definition = _batch_definition()
        suite = gx.ExpectationSuite(name=f"prompt_data_{dataset}_{uuid.uuid4().hex}")
        for order, check in enumerate(checks):
            check.expectation.meta = {"check": check.name, "order": order}
            suite.add_expectation(check.expectation)
        suite = context.suites.add(suite)
        definition = context.validation_definitions.add(
            gx.ValidationDefinition(name=f"validate_{suite.name}", data=batch_definition, suite=suite)
        )
        try:
            result = definition.run(
                batch_parameters={"dataframe": frame},
                result_format={"result_format": "SUMMARY", "partial_unexpected_count": MAX_EXAMPLES},
            )
        finally:
            context.validation_definitions.delete(definition.name)
            context.suites.delete(suite.name)
    by_order: dict[int, Any] = {}
    for item in result.results:
        by_order[int(item.expectation_config.meta["order"])] = item
    return [_outcome(check, by_order.get(order), dataset) for order, check in enumerate(checks)]


def _outcome(check: _Check, item: Any, dataset: str) -> ExpectationOutcome:
    expectation_type = type(check.expectation).__name__
    if item is None:
        return ExpectationOutcome(
            check.name,
            check.column,
            False,
            dataset,
            expectation_type,
            check.description,
            {"error": "no result"},
        )
    expectation_type = item.expectation_config.type
    raw = dict(item.result or {})
    stats: dict[str, Any] = {}
    for key in ("element_count", "unexpected_count", "unexpected_percent", "missing_count", "observed_value"):
        if key in raw:
            stats[key] = raw[key]
    info = item.exception_info or {}
    if info.get("raised_exception"):
        stats["error"] = _one_line(info.get("exception_message") or "exception")
    indices = raw.get("partial_unexpected_index_list") or []
    values = raw.get("partial_unexpected_list") or []
    examples = []
    for index, value in list(zip(indices, values))[:MAX_EXAMPLES]:
        if isinstance(index, Mapping):  # GX may report {column: value} when given index columns
            index = next(iter(index.values()))
        examples.append((int(index), _tidy_value(value)))
    if check.name == "column_exists" and not item.success:
        stats["missing"] = True
    return ExpectationOutcome(
        check.name,
        check.column,
        bool(item.success),
        dataset,
        expectation_type,
        check.description,
        stats,
        examples,
    )


def _add_length_statistics(outcome: ExpectationOutcome, frame: pd.DataFrame, max_prompt_length: int) -> None:
    tokens = frame["prompt_tokens"].dropna()
    over = int((tokens > max_prompt_length).sum())
    outcome.statistics["max_prompt_length"] = int(max_prompt_length)
    outcome.statistics["measured"] = int(len(tokens))
    outcome.statistics["over_count"] = over
    outcome.statistics["share_over"] = over / len(tokens) if len(tokens) else 0.0
    outcome.statistics["max_tokens"] = int(tokens.max()) if len(tokens) else 0
    outcome.statistics["mean_tokens"] = round(float(tokens.mean()), 2) if len(tokens) else 0.0


# ---------------------------------------------------------------------------------------------
# Entry points


def validate_frames(
    train: pd.DataFrame,
    val: pd.DataFrame | None = None,
    tokenizer: Any = None,
    max_prompt_length: int | None = None,
    *,
    known_sources: Iterable[str] | None = None,
    overlong_tolerance: float = 0.0,
    names: tuple[str, str] = ("train", "val"),
    paths: tuple[str | None, str | None] = (None, None),
) -> ValidationReport:
    """Validate in-memory frames; see the module docstring for the expectations."""
    if (tokenizer is None) != (max_prompt_length is None):
        raise ValueError("the prompt length check needs both a tokenizer and max_prompt_length")
    if max_prompt_length is not None and int(max_prompt_length) < 1:
        raise ValueError("max_prompt_length must be a positive integer")
    if not 0.0 <= overlong_tolerance <= 1.0:
        raise ValueError("overlong_tolerance must lie in [0, 1]")
    tokenizer = load_tokenizer(tokenizer)
    if known_sources is None:
        from rlhf_core.rewards import known_data_sources

        known_sources = known_data_sources()
    known = sorted({str(source) for source in known_sources})

    tables = [(names[0], paths[0], train)]
    if val is not None:
        tables.append((names[1], paths[1], val))
    flat = [(name, path, flatten(frame, tokenizer)) for name, path, frame in tables]

    leaked: list[str] | None = None
    if val is not None:
        train_flat, val_flat = flat[0][2], flat[1][2]
        if "prompt_user_content" in train_flat.columns and "prompt_user_content" in val_flat.columns:
            train_prompts = set(train_flat["prompt_user_content"].dropna())
            val_prompts = val_flat["prompt_user_content"].dropna()
            leaked = sorted(set(val_prompts[val_prompts.isin(train_prompts)]))

    results: list[ExpectationOutcome] = []
    skipped: list[str] = []
    datasets: list[DatasetInfo] = []
    for position, (name, path, frame) in enumerate(flat):
        checks = _build_checks(
            frame,
            known_sources=known,
            leaked=leaked if position == 1 else None,
            is_val=position == 1,
            max_prompt_length=max_prompt_length,
            overlong_tolerance=overlong_tolerance,
            skipped=skipped,
            dataset=name,
        )
        if position == 1 and leaked is None and "prompt" in frame.columns:
            skipped.append(f"{name}: no_train_val_leakage (column 'prompt' missing in {names[0]})")
        outcomes = _run_suite(frame, checks, name)
        for outcome in outcomes:
            if outcome.name == "prompt_length_within_limit":
                _add_length_statistics(outcome, frame, int(max_prompt_length))
        results += outcomes
        datasets.append(DatasetInfo(name, path, len(frame), [str(c) for c in tables[position][2].columns]))
    return ValidationReport(
        success=all(outcome.success for outcome in results),
        results=results,
        datasets=datasets,
        skipped=skipped,
        max_prompt_length=None if max_prompt_length is None else int(max_prompt_length),
    )


def validate_dataset(
    train_path: str | os.PathLike,
    val_path: str | os.PathLike | None = None,
    tokenizer: Any = None,
    max_prompt_length: int | None = None,
    *,
    known_sources: Iterable[str] | None = None,
    overlong_tolerance: float = 0.0,
) -> ValidationReport:
    """Read the parquet file(s) and validate them.

    ``tokenizer`` is a tokenizer object or the path of a saved one; the length check runs when
    both it and ``max_prompt_length`` are given. Raises :class:`DataReadError` for an unreadable
    file or tokenizer.
    """
    train = read_parquet(train_path)
    val = read_parquet(val_path) if val_path is not None else None
    tokenizer = load_tokenizer(tokenizer)
    report = validate_frames(
        train,
        val,
        tokenizer,
        max_prompt_length,
        known_sources=known_sources,
        overlong_tolerance=overlong_tolerance,
        paths=(str(train_path), None if val_path is None else str(val_path)),
    )
    report.fingerprint = fingerprint([p for p in (train_path, val_path) if p is not None])
    return report


# ---------------------------------------------------------------------------------------------
# Rendering helpers


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _tidy_value(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return _jsonable(value)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, np.generic):
        return _jsonable(value.item())
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", errors="replace")
    if _is_missing(value):
        return None
    return str(value)


def _excerpt(value: Any) -> str:
    if value is None or isinstance(value, (str, bool, int, float)):
        text = repr(value)
    else:
        text = json.dumps(_jsonable(value), ensure_ascii=False)
    return text if len(text) <= _EXCERPT_CHARS else text[: _EXCERPT_CHARS - 3] + "..."


def _percent(share: float) -> str:
    return f"{100.0 * float(share):.1f}%"


def _describe_failure(outcome: ExpectationOutcome) -> str:
    stats = outcome.statistics
    if "error" in stats:
        return f"error: {stats['error']}"
    if outcome.name == "column_exists":
        return f"column '{outcome.column}' is missing"
    if outcome.name == "has_rows":
        return f"{stats.get('observed_value', 0)} rows"
    if outcome.name == "prompt_length_within_limit":
        return (
            f"{stats.get('over_count')} of {stats.get('measured')} prompts "
            f"({_percent(stats.get('share_over', 0.0))}) over {stats.get('max_prompt_length')} tokens"
        )
    if "unexpected_count" in stats:
        checked = int(stats.get("element_count") or 0) - int(stats.get("missing_count") or 0)
        share = stats["unexpected_count"] / checked if checked else 0.0
        noun = "non-null values" if stats.get("missing_count") else "rows"
        return f"{stats['unexpected_count']} of {checked} {noun} unexpected ({_percent(share)})"
    return outcome.description


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:1.5em;color:#1f2328}
h1{font-size:1.3em;margin:0 0 .4em}
.badge{display:inline-block;padding:.15em .6em;border-radius:.8em;color:#fff;font-weight:600}
.ok{background:#1a7f37}.bad{background:#cf222e}
table{border-collapse:collapse;margin:.8em 0;font-size:.9em;width:100%}
th,td{border:1px solid #d0d7de;padding:.3em .5em;text-align:left;vertical-align:top}
th{background:#f6f8fa}
tr.pass td.status{background:#dafbe1;color:#1a7f37;font-weight:600}
tr.fail td.status{background:#ffebe9;color:#cf222e;font-weight:600}
tr.fail{background:#fff8f7}
code{font-size:.85em;word-break:break-all}
.muted{color:#656d76;font-size:.85em}
ul{margin:0;padding-left:1.1em}
"""


def _render_html(report: ValidationReport, title: str) -> str:
    esc = html.escape
    failed = len(report.failures)
    badge = (
        '<span class="badge ok">PASSED</span>' if report.success else '<span class="badge bad">FAILED</span>'
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{esc(title)} {badge}</h1>",
        f'<p class="muted">{len(report.results)} expectations, {failed} failed'
        + (f"; fingerprint <code>{esc(report.fingerprint)}</code>" if report.fingerprint else "")
        + "</p>",
        "<table><tr><th>dataset</th><th>file</th><th>rows</th><th>columns</th></tr>",
    ]
    for d in report.datasets:
        parts.append(
            f"<tr><td>{esc(d.name)}</td><td><code>{esc(d.path or 'in memory')}</code></td>"
            f"<td>{d.rows}</td><td>{esc(', '.join(d.columns))}</td></tr>"
        )
    parts.append("</table>")
    parts.append(
        "<table><tr><th>status</th><th>expectation</th><th>dataset</th><th>column</th>"
        "<th>statistics</th><th>failing examples (row: value)</th></tr>"
    )
    for outcome in report.results:
        css = "pass" if outcome.success else "fail"
        stats = "".join(
            f"<li>{esc(str(key))}: {esc(_format_stat(value))}</li>"
            for key, value in outcome.statistics.items()
        )
        examples = "".join(
            f"<li>{index}: <code>{esc(_excerpt(value))}</code></li>" for index, value in outcome.examples
        )
        parts.append(
            f'<tr class="{css}"><td class="status">{"pass" if outcome.success else "FAIL"}</td>'
            f'<td><b>{esc(outcome.name)}</b><br><span class="muted">{esc(outcome.expectation_type)}: '
            f"{esc(outcome.description)}</span></td>"
            f"<td>{esc(outcome.dataset)}</td><td>{esc(outcome.column or '')}</td>"
            f"<td><ul>{stats}</ul></td><td><ul>{examples}</ul></td></tr>"
        )
    parts.append("</table>")
    if report.skipped:
        parts.append("<p><b>Skipped</b></p><ul>")
        parts += [f"<li>{esc(item)}</li>" for item in report.skipped]
        parts.append("</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _format_stat(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(_jsonable(value))


# ---------------------------------------------------------------------------------------------
# Command line


def _quiet() -> None:
    """Keep GX's logs and progress bars out of the command's output (warnings: see ``main``)."""
    logging.getLogger("great_expectations").setLevel(logging.CRITICAL)
    logging.getLogger("great_expectations").propagate = False
    os.environ.setdefault("TQDM_DISABLE", "1")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_core.data.validation",
        description="Validate verl prompt parquet files with a Great Expectations suite.",
    )
    parser.add_argument("train", help="training parquet file")
    parser.add_argument("--val", help="validation parquet file (also checked for train/val leakage)")
    parser.add_argument("--tokenizer", help="saved tokenizer directory for the prompt length check")
    parser.add_argument("--max-prompt-length", type=int, help="largest allowed prompt length in tokens")
    parser.add_argument(
        "--overlong-tolerance",
        type=float,
        default=0.0,
        help="share of prompts allowed over the limit (default 0)",
    )
    parser.add_argument("--html", help="also write an HTML report to this file")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of the summary")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if (args.tokenizer is None) != (args.max_prompt_length is None):
        parser.error("--tokenizer and --max-prompt-length go together")
    if args.max_prompt_length is not None and args.max_prompt_length < 1:
        parser.error("--max-prompt-length must be positive")
    if not 0.0 <= args.overlong_tolerance <= 1.0:
        parser.error("--overlong-tolerance must lie in [0, 1]")
    _quiet()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = validate_dataset(
                args.train,
                args.val,
                tokenizer=args.tokenizer,
                max_prompt_length=args.max_prompt_length,
                overlong_tolerance=args.overlong_tolerance,
            )
    except DataReadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.html:
        try:
            Path(args.html).write_text(report.to_html(), encoding="utf-8")
        except OSError as exc:
            print(f"error: cannot write {args.html}: {_one_line(exc.strerror or str(exc))}", file=sys.stderr)
            return 2
    text = json.dumps(report.to_dict(), indent=2, ensure_ascii=False) if args.json else report.summary()
    try:
        print(text, flush=True)
    except BrokenPipeError:  # e.g. piped into `head`; the exit status still tells the outcome
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if report.success else 1


if __name__ == "__main__":
    sys.exit(main())
