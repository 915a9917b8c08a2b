"""Check prompt and preference parquet files with Great Expectations (1.x) before training.

Each table gets helper columns (pandas), then one GX suite runs over it on an ephemeral context.
GX's own result (:class:`ExpectationSuiteValidationResult`) is the record: its JSON is the report's
``to_dict``, its Data Docs page the report's ``to_html``; :class:`Outcome` only reads off the name,
rows and counts the summary prints. Row numbers are the table's positions, counted from 0.

Both kinds, the kind told by the columns (``chosen``/``rejected``: preference data,
``reward_model``: prompt data, neither: every column either kind needs is reported missing):

* ``has_rows``; ``column_exists`` for each column of the kind (a check needing a missing column
  is listed in :attr:`ValidationReport.skipped`); ``not_null`` for each of them;
* ``prompt_is_non_empty_message_list`` (helper ``prompt_num_messages``, ``-1`` when ``prompt`` is
  not a list of ``{role, content}`` strings), ``prompt_has_user_turn``,
  ``prompt_user_content_non_empty`` (the last user turn holds a non-blank character);
* ``no_train_val_leakage`` (validation file): no validation row repeats a training prompt (prompt
  data: the user turn, exact match) or pair (preference data: prompt, chosen and rejected).

Prompt data (verl's schema): ``not_null`` on ``reward_model.ground_truth``; ``ground_truth_numeric``
(:data:`GROUND_TRUTH_REGEX`: optional minus, digits with optional thousands commas and decimals);
``data_source_known`` (a registered reward function); ``prompt_length_within_limit`` (with a
tokenizer and ``max_prompt_length``: the chat template with a generation prompt, else the contents
joined by newlines; at most ``overlong_tolerance`` of the rows may be over, GX ``mostly``).

Preference data (``prompt``, ``chosen``, ``rejected``, ``data_source``, ``extra_info``):
``chosen_non_empty`` / ``rejected_non_empty``; ``chosen_differs_from_rejected``;
``no_duplicate_pairs`` (every row of a repeated prompt+chosen+rejected is named);
``pair_length_within_limit``: the prompt with the longer response, in tokens (``max_length`` with a
tokenizer: the chat template with the response as assistant turn) or in characters (``max_chars``:
the contents joined by newlines).

Usage::

    python -m rlhf_core.data.validation TRAIN.parquet [--val VAL.parquet] [--html OUT.html] [--json]
        [--tokenizer DIR --max-prompt-length N]                  # prompt data
        [--tokenizer DIR --max-length N | --max-chars N]         # preference data
        [--overlong-tolerance F]

Exit status: 0 when every expectation holds, 1 when any fails, 2 when an input cannot be read or
the command line is wrong (a one-line reason on stderr).
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import html
import json
import logging
import math
import os
import sys
import threading
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlhf_core.data.schema import PREFERENCE_COLUMNS, REQUIRED_COLUMNS

GROUND_TRUTH_REGEX = r"^\s*-?[0-9][0-9,]*(?:\.[0-9]+)?\s*$"
NON_BLANK_REGEX = r"\S"
MAX_EXAMPLES = 3
_EXCERPT_CHARS = 80
_STATS = ("element_count", "missing_count", "unexpected_count", "unexpected_percent", "observed_value")

os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")  # no usage reports (there is no network anyway)


class DataReadError(Exception):
    """An input file that cannot be read as a parquet table (or a tokenizer that cannot be loaded)."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = _one_line(reason)
        super().__init__(f"cannot read {self.path}: {self.reason}")


def detect_kind(columns: Iterable[str]) -> str | None:
    """``"preference"`` (a ``chosen`` or ``rejected`` column), ``"prompt"`` (``reward_model``) or None."""
    columns = set(columns)
    if columns & {"chosen", "rejected"}:
        return "preference"
    return "prompt" if "reward_model" in columns else None


def _required(kind: str | None) -> tuple[str, ...]:
    if kind is None:  # name what each kind lacks
        return tuple(dict.fromkeys(REQUIRED_COLUMNS + PREFERENCE_COLUMNS))
    return PREFERENCE_COLUMNS if kind == "preference" else REQUIRED_COLUMNS


# ---------------------------------------------------------------------------------------------
# The report: GX's results plus what the summary reads off them


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
    examples: list[tuple[int, Any]]  # (row, value) of the first failing rows

    @classmethod
    def of(cls, item: Any, dataset: str) -> Outcome:
        config, raw = item.expectation_config, item.result or {}
        column = config.kwargs.get("column") or ",".join(config.kwargs.get("column_list") or []) or None
        stats = {key: raw[key] for key in _STATS if key in raw}
        if (item.exception_info or {}).get("raised_exception"):
            stats["error"] = _one_line(item.exception_info.get("exception_message") or "exception")
        if "max_value" in config.kwargs and "unexpected_percent" in raw:
            stats["share_over"] = raw["unexpected_percent"] / 100.0
        rows = zip(raw.get("unexpected_index_list") or [], raw.get("unexpected_list") or [])
        examples = [(int(row), _tidy(value)) for row, value in list(rows)[:MAX_EXAMPLES]]
        return cls(config.meta["check"], column, dataset, bool(item.success), config.type,
                   config.description or "", stats, examples)

    @property
    def label(self) -> str:
        return f"{self.name} [{self.dataset}.{self.column}]" if self.column else f"{self.name} [{self.dataset}]"


@dataclass
class DatasetInfo:
    """Where one validated table came from."""

    name: str
    path: str | None
    rows: int
    columns: list[str]


@dataclass
class ValidationReport:
    """GX's result for each dataset (train, then val), with the checks that could not run."""

    kind: str | None
    gx_results: dict[str, Any]
    datasets: list[DatasetInfo]
    skipped: list[str] = field(default_factory=list)
    fingerprint: str | None = None

    @property
    def results(self) -> list[Outcome]:
        return [Outcome.of(item, name) for name, result in self.gx_results.items()
                for item in sorted(result.results, key=lambda item: item.expectation_config.meta["order"])]

    @property
    def success(self) -> bool:
        return all(result.success for result in self.gx_results.values())

    @property
    def failures(self) -> list[Outcome]:
        return [outcome for outcome in self.results if not outcome.success]

    def find(self, name: str, column: str | None = None, dataset: str | None = None) -> list[Outcome]:
        return [o for o in self.results if o.name == name and column in (None, o.column)
                and dataset in (None, o.dataset)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: GX's validation result of each dataset under ``datasets[i].result``."""
        totals: dict[str, int] = {}
        for result in self.gx_results.values():
            for key in ("evaluated_expectations", "successful_expectations", "unsuccessful_expectations"):
                totals[key] = totals.get(key, 0) + int(result.statistics[key])
        datasets = [{"name": d.name, "path": d.path, "rows": d.rows, "columns": d.columns,
                     "result": self.gx_results[d.name].to_json_dict()} for d in self.datasets]
        return {"success": self.success, "kind": self.kind, "fingerprint": self.fingerprint,
                "statistics": totals, "datasets": datasets, "skipped": list(self.skipped)}

    def summary(self) -> str:
        results, failures = self.results, self.failures
        what = f"{self.kind} data" if self.kind else "neither prompt nor preference data"
        head = (f"Dataset validation PASSED: all {len(results)} expectations hold ({what})" if self.success
                else f"Dataset validation FAILED: {len(failures)} of {len(results)} expectations failed ({what})")
        lines = [head] + [f"  {d.name}: {d.path or '<in memory>'} ({d.rows} rows)" for d in self.datasets]
        if self.fingerprint:
            lines.append(f"  fingerprint: {self.fingerprint}")
        if self.kind is None:
            lines.append("  prompt data needs the columns " + ", ".join(REQUIRED_COLUMNS)
                         + "; preference data needs " + ", ".join(PREFERENCE_COLUMNS))
        for o in failures:
            lines.append(f"FAILED {o.label} ({o.expectation_type}): {_describe_failure(o)}")
            lines += [f"    row {row}: {_excerpt(value)}" for row, value in o.examples]
        for o in results:
            if o.success and "share_over" in o.statistics:
                lines.append(f"  {o.dataset}: {_percent(o.statistics['share_over'])} of rows over the limit"
                             f" ({o.description})")
        return "\n".join(lines + [f"  skipped: {item}" for item in self.skipped])

    def to_html(self) -> str:
        """GX's Data Docs page of the validation results, one overview per dataset."""
        from great_expectations.render.renderer import ValidationResultsPageRenderer
        from great_expectations.render.view import DefaultJinjaPageView

        pages = []
        for d in self.datasets:
            # GX 1.x writes table cells unescaped; the data's text (GSM8K's "<<6*2=12>>") must show as text
            result = copy.deepcopy(self.gx_results[d.name])
            result.meta["run_id"] = {"run_name": _escape(f"{d.name}: {d.path or 'in memory'} ({d.rows} rows)")}
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
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.exists():
        raise DataReadError(path, "no such file")
    if path.is_dir():
        raise DataReadError(path, "is a directory, expected a parquet file")
    try:
        return pq.read_table(path).to_pandas()
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise DataReadError(path, f"not a readable parquet file ({_one_line(str(exc)) or type(exc).__name__})") from exc


def fingerprint(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> str:
    """SHA-256 over the bytes of ``paths``, independent of the order they are given in.

    The files are hashed in order of their file name (ties broken by the full path), each one
    preceded by its byte length so that moving bytes from one file into another changes the
    digest. Moving a dataset to another folder keeps its fingerprint.
    """
    files = sorted((Path(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)),
                   key=lambda p: (p.name, str(p)))
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


def load_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` itself, or the tokenizer saved at that path (loaded offline)."""
    if tokenizer is None or not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    if not Path(tokenizer).exists():
        raise DataReadError(tokenizer, "no such tokenizer directory")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for a broken folder
        raise DataReadError(tokenizer, f"cannot load tokenizer ({_one_line(str(exc)) or type(exc).__name__})") from exc


# ---------------------------------------------------------------------------------------------
# Helper columns


def _is_missing(value: Any) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def _messages(value: Any) -> list[dict[str, str]] | None:
    """The prompt as ``[{role, content}]`` with string fields, or None when malformed."""
    if not isinstance(value, (list, tuple, np.ndarray)):
        return None
    messages = [{"role": m.get("role"), "content": m.get("content")} if isinstance(m, Mapping) else None
                for m in value]
    ok = all(m and isinstance(m["role"], str) and isinstance(m["content"], str) for m in messages)
    return messages if ok else None


def _lengths(tokenizer: Any, conversations: Sequence[list[dict[str, str]] | None], generation: bool) -> list[float]:
    """Tokens per conversation (characters without a tokenizer); NaN where there is none."""
    template = bool(getattr(tokenizer, "chat_template", None))
    texts: dict[int, str] = {}
    for position, messages in enumerate(conversations):
        if not messages:
            continue
        if template:
            try:
                texts[position] = tokenizer.apply_chat_template(messages, tokenize=False,
                                                                add_generation_prompt=generation)
            except Exception:  # a template may reject a conversation (e.g. no user turn)
                continue
        else:
            texts[position] = "\n".join(m["content"] for m in messages)
    counts = [math.nan] * len(conversations)
    if tokenizer is None:
        return [float(len(texts[p])) if p in texts else math.nan for p in range(len(conversations))]
    if texts:  # a chat template already writes the special tokens it wants
        encoded = tokenizer(list(texts.values()), add_special_tokens=not template)["input_ids"]
        for position, ids in zip(texts, encoded):
            counts[position] = float(len(ids))
    return counts


def flatten(frame: pd.DataFrame, tokenizer: Any = None, kind: str | None = "prompt", measure: bool | None = None) -> pd.DataFrame:
    """``frame`` plus the helper columns the expectations run on.

    ``prompt_num_messages`` (-1 malformed, NaN null), ``prompt_has_user_turn``, ``prompt_user_content``;
    prompt data: ``ground_truth`` and (``measure``, default: with a tokenizer) ``prompt_tokens``;
    preference data: ``pair`` (the JSON of prompt, chosen, rejected) and with ``measure``
    ``pair_length`` (tokens with a tokenizer, else characters).
    """
    out = frame.copy()
    measure = tokenizer is not None if measure is None else measure
    index = frame.index
    parsed = [None if _is_missing(v) else _messages(v) for v in frame["prompt"]] if "prompt" in frame else None
    if parsed is not None:
        users = [[m["content"] for m in messages if m["role"] == "user"] if messages else None for messages in parsed]
        out["prompt_num_messages"] = pd.Series(
            [math.nan if _is_missing(v) else -1.0 if m is None else float(len(m))
             for v, m in zip(frame["prompt"], parsed)], index=index, dtype="float64")
        out["prompt_has_user_turn"] = pd.Series([bool(u) if u is not None else None for u in users], index=index, dtype="object")
        out["prompt_user_content"] = pd.Series([u[-1] if u else None for u in users], index=index, dtype="object")
    if kind == "prompt" and "reward_model" in frame:
        truths = [v.get("ground_truth") if isinstance(v, Mapping) else None for v in frame["reward_model"]]
        out["ground_truth"] = pd.Series([None if _is_missing(t) else t.decode() if isinstance(t, bytes) else str(t)
                                         for t in truths], index=index, dtype="object")
        if measure and parsed is not None:
            out["prompt_tokens"] = pd.Series(_lengths(tokenizer, parsed, True), index=index, dtype="float64")
    if kind == "preference" and parsed is not None and {"chosen", "rejected"} <= set(frame.columns):
        pairs = list(zip(parsed, frame["chosen"], frame["rejected"]))
        out["pair"] = pd.Series([json.dumps([m, c, r], ensure_ascii=False) if m and isinstance(c, str)
                                 and isinstance(r, str) else None for m, c, r in pairs], index=index, dtype="object")
        if measure:  # each response after the prompt as the assistant turn; the longer one counts
            turns = [m + [{"role": "assistant", "content": text}] if m and isinstance(text, str) else None
                     for m, chosen, rejected in pairs for text in (chosen, rejected)]
            lengths = np.asarray(_lengths(tokenizer, turns, False), dtype="float64").reshape(-1, 2)
            out["pair_length"] = pd.Series(np.fmax(lengths[:, 0], lengths[:, 1]), index=index)
    return out


# ---------------------------------------------------------------------------------------------
# The suite


def _suite(kind: str | None, frame: pd.DataFrame, dataset: str, *, leaked: list[str] | None, limit: float | None,
           unit: str, mostly: float, known_sources: Sequence[str], skipped: list[str]) -> list[Any]:
    import great_expectations.expectations as gxe

    def check(name: str, expectation: type, description: str, **kwargs: Any) -> Any:
        return expectation(**kwargs, description=f"{name}: {description}", meta={"check": name})

    def needs(column: str, *names: str) -> bool:
        skipped.extend(f"{dataset}: {name} (column '{column}' missing)" for name in names if column not in frame)
        return column in frame

    required = _required(kind)
    checks = [check("has_rows", gxe.ExpectTableRowCountToBeBetween, "the table has at least one row", min_value=1)]
    checks += [check("column_exists", gxe.ExpectColumnToExist, f"column '{c}' is present", column=c) for c in required]
    checks += [check("not_null", gxe.ExpectColumnValuesToNotBeNull, f"'{c}' is never null", column=c)
               for c in required if c in frame]
    prompt_checks = ["prompt_is_non_empty_message_list", "prompt_has_user_turn", "prompt_user_content_non_empty"]
    if needs("prompt", *prompt_checks):
        checks += [
            check(prompt_checks[0], gxe.ExpectColumnValuesToBeBetween, "prompt is a non-empty list of "
                  "{role, content} string messages (-1: malformed)", column="prompt_num_messages", min_value=1),
            check(prompt_checks[1], gxe.ExpectColumnValuesToBeInSet, "prompt has a 'user' turn",
                  column="prompt_has_user_turn", value_set=[True]),
            check(prompt_checks[2], gxe.ExpectColumnValuesToMatchRegex, "the last user turn is not blank",
                  column="prompt_user_content", regex=NON_BLANK_REGEX),
        ]
    key = "pair" if kind == "preference" else "prompt_user_content"
    if leaked is not None and key in frame:
        checks.append(check("no_train_val_leakage", gxe.ExpectColumnValuesToNotBeInSet,
                            f"no validation row repeats a training {'pair' if key == 'pair' else 'prompt'}",
                            column=key, value_set=leaked))
    elif dataset != "train" and kind is not None:
        skipped.append(f"{dataset}: no_train_val_leakage (prompt or pair columns missing)")
    if kind == "prompt" and needs("data_source", "data_source_known"):
        checks.append(check("data_source_known", gxe.ExpectColumnValuesToBeInSet, "data_source has a registered "
                            "reward function", column="data_source", value_set=list(known_sources)))
    if kind == "prompt" and needs("reward_model", "not_null(ground_truth)", "ground_truth_numeric"):
        checks += [
            check("not_null", gxe.ExpectColumnValuesToNotBeNull, "reward_model.ground_truth is never null",
                  column="ground_truth"),
            check("ground_truth_numeric", gxe.ExpectColumnValuesToMatchRegex, "reward_model.ground_truth is a "
                  "number (optional minus, thousands commas, decimals)", column="ground_truth", regex=GROUND_TRUTH_REGEX),
        ]
    if kind == "prompt" and limit is not None and "prompt_tokens" in frame:
        checks.append(check("prompt_length_within_limit", gxe.ExpectColumnValuesToBeBetween,
                            f"prompt is at most {limit:g} tokens", column="prompt_tokens", max_value=limit, mostly=mostly))
    if kind == "preference":
        for column in ("chosen", "rejected"):
            if needs(column, f"{column}_non_empty"):
                checks.append(check(f"{column}_non_empty", gxe.ExpectColumnValuesToMatchRegex,
                                    f"'{column}' holds a non-blank character", column=column, regex=NON_BLANK_REGEX))
        if {"chosen", "rejected"} <= set(frame.columns):
            checks.append(check("chosen_differs_from_rejected", gxe.ExpectSelectColumnValuesToBeUniqueWithinRecord,
                                "chosen and rejected are different texts", column_list=["chosen", "rejected"]))
        if "pair" in frame:
            checks.append(check("no_duplicate_pairs", gxe.ExpectColumnValuesToBeUnique,
                                "each prompt, chosen, rejected triple appears once", column="pair"))
        else:
            skipped.append(f"{dataset}: no_duplicate_pairs (prompt, chosen or rejected missing)")
        if limit is not None and "pair_length" in frame:
            checks.append(check("pair_length_within_limit", gxe.ExpectColumnValuesToBeBetween,
                                f"prompt and the longer response are at most {limit:g} {unit}",
                                column="pair_length", max_value=limit, mostly=mostly))
    for order, expectation in enumerate(checks):
        expectation.meta["order"] = order
    return checks


_gx_lock = threading.Lock()


@functools.cache
def _batch_definition() -> Any:
    """A whole-dataframe batch definition on one ephemeral GX context for the process."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    source = context.data_sources.add_pandas(name="rlhf_data")
    return source.add_dataframe_asset(name="table").add_batch_definition_whole_dataframe("whole_table")


def _run(frame: pd.DataFrame, expectations: list[Any], name: str) -> Any:
    import great_expectations as gx

    with _gx_lock:
        suite = gx.ExpectationSuite(name=name, expectations=expectations)
        batch = _batch_definition().get_batch(batch_parameters={"dataframe": frame})
        return batch.validate(suite, result_format={"result_format": "COMPLETE"})


# ---------------------------------------------------------------------------------------------
# Entry points


def _validate(kind: str | None, train: pd.DataFrame, val: pd.DataFrame | None, tokenizer: Any,
              limit: float | None, *, unit: str, measure: bool, overlong_tolerance: float,
              known_sources: Iterable[str] | None = None, names: tuple[str, str] = ("train", "val"),
              paths: tuple[str | None, str | None] = (None, None)) -> ValidationReport:
    if limit is not None and limit < 1:
        raise ValueError("the length limit must be a positive integer")
    if not 0.0 <= overlong_tolerance <= 1.0:
        raise ValueError("overlong_tolerance must lie in [0, 1]")
    if kind == "prompt" and known_sources is None:
        from rlhf_core.rewards import known_data_sources

        known_sources = known_data_sources()
    tokenizer = load_tokenizer(tokenizer)
    tables = [(names[0], paths[0], train)] + ([(names[1], paths[1], val)] if val is not None else [])
    flat = [flatten(frame, tokenizer, kind, measure) for _, _, frame in tables]
    key = "pair" if kind == "preference" else "prompt_user_content"
    leaked = None
    if len(flat) == 2 and key in flat[0] and key in flat[1]:
        seen = set(flat[0][key].dropna())
        leaked = sorted({value for value in flat[1][key].dropna() if value in seen})
    skipped: list[str] = []
    results = {}
    for position, ((name, _, _), frame) in enumerate(zip(tables, flat)):
        suite = _suite(kind, frame, name, leaked=leaked if position else None, limit=limit, unit=unit,
                       mostly=1.0 - overlong_tolerance, known_sources=sorted(map(str, known_sources or [])),
                       skipped=skipped)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results[name] = _run(frame, suite, f"{name}.{kind or 'unknown'}_data")
    datasets = [DatasetInfo(name, path, len(frame), [str(c) for c in frame.columns]) for name, path, frame in tables]
    return ValidationReport(kind, results, datasets, skipped)


def validate_frames(train: pd.DataFrame, val: pd.DataFrame | None = None, tokenizer: Any = None,
                    max_prompt_length: int | None = None, *, known_sources: Iterable[str] | None = None,
                    overlong_tolerance: float = 0.0, names: tuple[str, str] = ("train", "val"),
                    paths: tuple[str | None, str | None] = (None, None)) -> ValidationReport:
    """Validate in-memory prompt frames; the length check needs both tokenizer and max_prompt_length."""
    if (tokenizer is None) != (max_prompt_length is None):
        raise ValueError("the prompt length check needs both a tokenizer and max_prompt_length")
    return _validate("prompt", train, val, tokenizer, max_prompt_length, unit="tokens",
                     measure=tokenizer is not None, overlong_tolerance=overlong_tolerance,
                     known_sources=known_sources, names=names, paths=paths)


def validate_preference_frames(train: pd.DataFrame, val: pd.DataFrame | None = None, tokenizer: Any = None,
                               max_length: int | None = None, *, max_chars: int | None = None,
                               overlong_tolerance: float = 0.0,
                               paths: tuple[str | None, str | None] = (None, None)) -> ValidationReport:
    """Validate in-memory preference frames; a token budget (tokenizer + max_length) or a character one."""
    if (tokenizer is None) != (max_length is None):
        raise ValueError("the token budget needs both a tokenizer and max_length")
    if max_length is not None and max_chars is not None:
        raise ValueError("give a token budget (max_length) or a character budget (max_chars), not both")
    limit = max_length if max_length is not None else max_chars
    return _validate("preference", train, val, tokenizer, limit, unit="tokens" if tokenizer is not None else "characters",
                     measure=limit is not None, overlong_tolerance=overlong_tolerance, paths=paths)


def _read_all(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> tuple[pd.DataFrame, list[Path]]:
    files = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    return pd.concat([read_parquet(path) for path in files], ignore_index=True), files


def validate_preference_files(train: str | os.PathLike | Sequence[str | os.PathLike],
                              val: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
                              tokenizer: Any = None, max_length: int | None = None, *,
                              max_chars: int | None = None, overlong_tolerance: float = 0.0) -> ValidationReport:
    """Read preference parquet file(s) (several files of one split are joined, rows renumbered) and validate."""
    train_frame, train_files = _read_all(train)
    val_frame, val_files = _read_all(val) if val is not None else (None, [])
    report = validate_preference_frames(
        train_frame, val_frame, tokenizer, max_length, max_chars=max_chars, overlong_tolerance=overlong_tolerance,
        paths=(",".join(map(str, train_files)), ",".join(map(str, val_files)) or None))
    report.fingerprint = fingerprint(train_files + val_files)
    return report


def validate_dataset(train_path: str | os.PathLike, val_path: str | os.PathLike | None = None, tokenizer: Any = None,
                     max_prompt_length: int | None = None, *, max_length: int | None = None,
                     max_chars: int | None = None, known_sources: Iterable[str] | None = None,
                     overlong_tolerance: float = 0.0) -> ValidationReport:
    """Read the parquet file(s), tell their kind by the training file's columns, and validate.

    ``max_prompt_length`` applies to prompt data, ``max_length``/``max_chars`` to preference data;
    one given for the other kind is a ValueError. Raises :class:`DataReadError` for an unreadable
    file or tokenizer.
    """
    train = read_parquet(train_path)
    val = read_parquet(val_path) if val_path is not None else None
    kind = detect_kind(train.columns)
    paths = (str(train_path), None if val_path is None else str(val_path))
    if kind == "preference":
        if max_prompt_length is not None:
            raise ValueError(f"{train_path} is preference data: use max_length (tokens) or max_chars, "
                             "not max_prompt_length")
        report = validate_preference_frames(train, val, tokenizer, max_length, max_chars=max_chars,
                                            overlong_tolerance=overlong_tolerance, paths=paths)
    elif max_length is not None or max_chars is not None:
        raise ValueError(f"{train_path} is not preference data (no 'chosen'/'rejected' column): "
                         "max_length and max_chars apply to preference files")
    elif kind == "prompt":
        report = validate_frames(train, val, tokenizer, max_prompt_length, known_sources=known_sources,
                                 overlong_tolerance=overlong_tolerance, paths=paths)
    else:  # neither kind: the columns each kind lacks are reported
        report = _validate(None, train, val, None, None, unit="", measure=False, overlong_tolerance=0.0,
                           paths=paths)
    report.fingerprint = fingerprint([p for p in (train_path, val_path) if p is not None])
    return report


# ---------------------------------------------------------------------------------------------
# Text helpers


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _tidy(value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return None if math.isnan(value) else int(value) if value.is_integer() else value
    return value


def _excerpt(value: Any) -> str:
    text = repr(value) if value is None or isinstance(value, (str, bool, int, float)) else json.dumps(
        value, ensure_ascii=False, default=str)
    return text if len(text) <= _EXCERPT_CHARS else text[: _EXCERPT_CHARS - 3] + "..."


def _escape(value: Any) -> Any:
    if isinstance(value, str):
        return html.escape(value)
    if isinstance(value, Mapping):
        return {key: _escape(item) for key, item in value.items()}
    return type(value)(map(_escape, value)) if isinstance(value, (list, tuple)) else value


def _percent(share: float) -> str:
    return f"{100.0 * float(share):.1f}%"


def _describe_failure(outcome: Outcome) -> str:
    stats = outcome.statistics
    if "error" in stats:
        return f"error: {stats['error']}"
    if outcome.name == "column_exists":
        return f"column '{outcome.column}' is missing"
    if outcome.name == "has_rows":
        return f"{stats.get('observed_value', 0)} rows"
    checked = int(stats.get("element_count") or 0) - int(stats.get("missing_count") or 0)
    share = stats.get("unexpected_count", 0) / checked if checked else 0.0
    return f"{stats.get('unexpected_count')} of {checked} rows fail ({_percent(share)}): {outcome.description}"


# ---------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rlhf_core.data.validation",
                                     description="Validate verl prompt or preference parquet files with Great "
                                                 "Expectations (the kind is told by the columns).")
    parser.add_argument("train", help="training parquet file")
    parser.add_argument("--val", help="validation parquet file (also checked for train/val leakage)")
    parser.add_argument("--tokenizer", help="saved tokenizer directory for a length check in tokens")
    parser.add_argument("--max-prompt-length", type=int, help="prompt data: largest prompt in tokens")
    parser.add_argument("--max-length", type=int, help="preference data: largest prompt + response in tokens")
    parser.add_argument("--max-chars", type=int, help="preference data: largest prompt + response in characters")
    parser.add_argument("--overlong-tolerance", type=float, default=0.0,
                        help="share of rows allowed over the length limit (default 0)")
    parser.add_argument("--html", help="also write GX's HTML report (Data Docs page) to this file")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of the summary")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    token_limits = [v for v in (args.max_prompt_length, args.max_length) if v is not None]
    if (args.tokenizer is None) != (not token_limits):
        parser.error("--tokenizer goes with --max-prompt-length (prompt data) or --max-length (preference data)")
    if any(v < 1 for v in token_limits + [args.max_chars or 1]):
        parser.error("--max-prompt-length, --max-length and --max-chars must be positive")
    if args.max_chars is not None and args.max_length is not None:
        parser.error("--max-length and --max-chars exclude each other")
    if not 0.0 <= args.overlong_tolerance <= 1.0:
        parser.error("--overlong-tolerance must lie in [0, 1]")
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        report = validate_dataset(args.train, args.val, tokenizer=args.tokenizer,
                                  max_prompt_length=args.max_prompt_length, max_length=args.max_length,
                                  max_chars=args.max_chars, overlong_tolerance=args.overlong_tolerance)
    except DataReadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # an option for the other kind of data
        print(f"error: {_one_line(str(exc))}", file=sys.stderr)
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
