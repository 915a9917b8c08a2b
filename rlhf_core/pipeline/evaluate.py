"""How good is a policy, and is the reward that says so the one we think it is.

* :func:`evaluate_policy`: greedy accuracy of a local HF model directory on a validation set (or a
  stratified sample of it, ``max_problems``), with its interval, every problem's result and, with
  ``val_kwargs.n > 1``, the sampled ``mean@n`` / ``best@n`` / ``maj@n`` (``std@n`` and ``worst@n``
  beside them in ``val-aux/``); generated with the project's HF rollout engine and scored by the
  :class:`RewardManager`, as training scores it.
* :func:`per_problem_table` and :func:`changed_problems`: the models side by side, problem by
  problem, and the problems the new version fixed and broke.
* :func:`reward_spec` and :func:`check_reference_solutions`: the identity of the reward (which
  function, its parameters, a SHA-256 of its source) and the self-check that every reference
  solution in the validation data earns full marks against its own ground truth.
* :func:`ground_truth_needs`: which splits a pipeline run needs a ground truth on every row of, and why.
* :func:`training_curves_png` and :func:`evaluation_html`: the figures and the HTML report.

    python -m rlhf_core.pipeline.evaluate MODEL_DIR VAL.parquet [--max-response-length 64] [--max-problems 500]
                                          [--trust-remote-code] [--html out.html]
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import html
import io
import json
import math
import re
import sys
import textwrap
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as `rlhf evaluate` is (rlhf_core.cli), before the imports below (pandas and
    # torch), so that a Ctrl-C in the command's first seconds ends it with one line and exit 130, not a
    # traceback
    from rlhf_core.cli import _run

    sys.exit(_run("evaluate", None, "python -m rlhf_core.pipeline.evaluate"))

import numpy as np
import pandas as pd
import torch

from rlhf_core import stats
from rlhf_core.config import DataConfig, PPOConfig, ValKwargsConfig
from rlhf_core.data.dataset import DataError, as_file_list, plain_value
from rlhf_core.data.schema import is_missing, read_rows
from rlhf_core.pipeline.lineage import SOURCE_KEY, kept_source
from rlhf_core.pipeline.reward_code import (
    called_functions,
    installed_versions,
    keyword_defaults,
    reward_identity,
    source_closure,
    user_code,
)
from rlhf_core.progress import progress_bar
from rlhf_core.rewards import (
    BatchRewardFn,
    RewardFn,
    UnknownDataSourceError,
    custom_reward_fn,
    get_reward_fn,
    spec_module_name,
)
from rlhf_core.rewards.manager import RewardError
from rlhf_core.rewards.result import RewardResultError, awaited, read_reward_result
from rlhf_core.training.guards import KL_LOSS_TOKEN_MEAN

EXAMPLES_PER_KIND = 3
CHANGED_SHOWN = 5  # fixed and broken problems shown in the report and the lineage, of each kind
#: the report's ground-truth cell of a problem without one (a custom reward's prompts): never an answer's text
NO_GROUND_TRUTH_HTML = "<td class='no-truth'><em>(no ground truth)</em></td>"


# ----------------------------------------------------------------------------- where the policy is


def resolve_policy_dir(path: str | Path) -> Path:
    """The HF model directory inside ``path``.

    ``path`` may be a HF model directory itself, a ``global_step_N`` checkpoint, or a checkpoint
    root holding ``latest_checkpointed_iteration.txt`` (the actor's ``huggingface/`` export of the
    latest step is used). A ModelError where the directory holds a reward or other classification model
    (:func:`~rlhf_core.models.loading.not_a_policy`), a FileNotFoundError where there is none.
    """
    from rlhf_core.models.loading import ModelError, missing_model_dir, not_a_policy

    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        problem = not_a_policy(folder)
        if problem is not None:
            raise ModelError(problem)
        return folder
    if not folder.exists():
        raise FileNotFoundError(missing_model_dir(path))
    if (folder / "latest_checkpointed_iteration.txt").is_file():
        from rlhf_core.training.checkpoint import latest_checkpoint

        latest = latest_checkpoint(folder)
        # (a reward model's training root keeps its export beside its steps, which hold none: the loop below)
        if latest is not None and ((latest / "actor" / "huggingface").is_dir() or
                                   not (folder / "huggingface").is_dir()):
            return resolve_policy_dir(latest)
    for candidate in (folder / "actor" / "huggingface", folder / "huggingface"):
        if (candidate / "config.json").is_file():
            return resolve_policy_dir(candidate)
    raise FileNotFoundError(
        f"{folder} holds no HF model: expected config.json there, in actor/huggingface/ (a global_step_N "
        "checkpoint) or under the step named by latest_checkpointed_iteration.txt (a checkpoint root)")


#: the ``data`` keys that decide what an evaluation generates: which column holds the prompt, how it is rendered and
#: cut, and how long a response may grow; with the type each must have to be taken from a saved config
RUN_DATA_KEYS = {"prompt_key": str, "max_prompt_length": int, "max_response_length": int,
                 "apply_chat_template_kwargs": dict, "truncation": str}


def run_data_settings(policy_dir: str | Path) -> tuple[Path | None, dict[str, Any]]:
    """The ``global_step_N`` checkpoint whose actor export ``policy_dir`` is (as :func:`resolve_policy_dir` finds
    it), and the :data:`RUN_DATA_KEYS` of the ``data`` section its run saved in its ``config.yaml``: those present
    with a usable value (a length below 1 or an unknown truncation is left out). ``(None, {})`` for a plain HF folder;
    a :class:`~rlhf_core.training.checkpoint.CheckpointError` where the config cannot be read."""
    from rlhf_core.data.dataset import TRUNCATION_CUTS
    from rlhf_core.training.checkpoint import CONFIG_FILE, HF_DIR, saved_config

    folder = Path(policy_dir)
    checkpoint = folder.parent.parent
    if not (folder.name == HF_DIR and folder.parent.name == "actor" and (checkpoint / CONFIG_FILE).is_file()):
        return None, {}
    data = saved_config(checkpoint).get("data")
    settings = {}
    for key, kind in RUN_DATA_KEYS.items():
        value = data.get(key) if isinstance(data, dict) else None
        if not isinstance(value, kind) or isinstance(value, bool):
            continue
        if (kind is int and value < 1) or (key == "truncation" and value not in (*TRUNCATION_CUTS, "error")):
            continue
        settings[key] = value
    return checkpoint, settings


# ----------------------------------------------------------------------------- policy accuracy


class NotRightOrWrong(RewardError, ValueError):
    """The reward's ``acc`` on a greedy response is neither 0 nor 1 (NaN: no verdict; 0.2: partial credit), where
    the evaluation counts each problem right or wrong: the reward function's result, not the run, is at fault.
    The pipeline's dry run checks its validation responses alike (:func:`check_right_or_wrong`), before training."""


def check_right_or_wrong(verdicts: Sequence[tuple[str, float]], reward: str = "the reward") -> None:
    """A :class:`NotRightOrWrong` unless the acc of every (problem id, acc) in ``verdicts`` is 0 or 1 (False or
    True), said of ``reward`` (the evaluation's "the reward"; the dry run names the function). A problem with
    several responses counts once, with its first such acc."""
    ungraded = list(dict.fromkeys(problem for problem, acc in verdicts if math.isnan(acc)))
    if ungraded:  # counted wrong, it would lower the accuracy and thin out the gain promotion measures
        raise NotRightOrWrong(f"{reward} gave no verdict (acc NaN) on {len(ungraded)} problem(s), e.g. "
                              f"{', '.join(map(str, ungraded[:3]))}: the evaluation needs each problem graded right "
                              "or wrong to pair it with another model's result; return an acc of 0 or 1 there")
    partial: dict[str, float] = {}
    for problem, acc in verdicts:
        if acc not in (0.0, 1.0):
            partial.setdefault(problem, acc)
    if partial:  # counted right, an acc of 0.2 would be a problem solved: 100% where training's validation says 20%
        raise NotRightOrWrong(f"{reward} gave an acc other than 0 or 1 on {len(partial)} problem(s), e.g. "
                              f"{', '.join(f'{problem} (acc {acc:g})' for problem, acc in list(partial.items())[:3])}"
                              ": the evaluation counts each problem right or wrong to pair it with another model's "
                              "result, and a partial acc is neither; return an acc of 0 or 1 (False or True), and "
                              "any partial credit as the score")


@dataclass
class EvalResult:
    """Greedy accuracy of one model on one validation set (the problems ``val_fingerprint`` names)."""

    model: str
    accuracy: float
    n: int
    mean_score: float
    per_source: dict[str, float]
    mean_response_length: float
    examples: list[dict[str, Any]] = field(default_factory=list)
    interval: tuple[float, float] | None = None  # 95% Wilson interval of the accuracy
    val_fingerprint: str | None = None
    total_problems: int | None = None  # in the validation set, before max_problems
    sampled: dict[str, float] = field(default_factory=dict)  # val-core/val-aux metrics with val_kwargs
    problems: list[dict[str, Any]] = field(default_factory=list)  # one row per problem, in order

    def to_dict(self, with_problems: bool = True) -> dict[str, Any]:
        record = asdict(self)
        if not with_problems:
            record.pop("problems")
        return record

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvalResult:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def _pick_examples(rows: list[dict[str, Any]], per_kind: int) -> list[dict[str, Any]]:
    right = [row for row in rows if row["correct"]][:per_kind]
    wrong = [row for row in rows if not row["correct"]][:per_kind]
    # without extra_info (test cases, rubrics: anything a reward reads), which the report does not show
    return [{k: v for k, v in row.items() if k != "extra_info"} for row in right + wrong]


#: the rule :func:`val_fingerprint` follows, kept in each evaluation record: 1 (records without the key) hashed id,
#: messages and the ground truth's text; 2 adds extra_info and hashes a missing ground truth as a null
VAL_FINGERPRINT_VERSION = 2


def _plain_json(value: Any) -> Any:
    """A value ``json`` cannot write, as one it can: a NumPy scalar or array as its Python value, else its text."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def val_fingerprint(problems: Sequence[Mapping[str, Any]]) -> str:
    """SHA-256 over the evaluated problems: equal only for the same problems, asked the same way and graded against
    the same data (a system message, an earlier turn or an ``extra_info`` entry changed is another problem).

    Each problem is the JSON list ``[id, messages, ground_truth, extra_info]`` (keys sorted, NumPy values as their
    Python ones, a missing ground truth and extra_info as null); the digest is over these lines, sorted, joined by
    newlines. Version :data:`VAL_FINGERPRINT_VERSION`."""
    lines = sorted(json.dumps([str(p["id"]), p.get("messages", p["prompt"]), p["ground_truth"], p.get("extra_info")],
                              sort_keys=True, default=_plain_json) for p in problems)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _sampled_metrics(engine, dataset, selected: Sequence[int], manager, val_kwargs: ValKwargsConfig,
                     max_new_tokens: int, batch_size: int, label: str | None = None
                     ) -> tuple[dict[str, float], list[float]]:
    """``val_kwargs.n`` sampled responses per problem: the verl metrics and each problem's mean@n."""
    from rlhf_core.rollout import SamplingParams

    params = SamplingParams(n=val_kwargs.n, max_new_tokens=max_new_tokens, do_sample=val_kwargs.do_sample,
                            temperature=val_kwargs.temperature, top_p=val_kwargs.top_p, top_k=val_kwargs.top_k)
    sources, prompts, acc, reward = [], [], [], []
    answers: list[str | None] | None = []  # what each response answers, if the reward function says
    with progress_bar(total=len(selected), desc=f"sampled evaluation ({f'{label}, ' if label else ''}n={val_kwargs.n})",
                      unit="problem") as bar:
        for start in range(0, len(selected), batch_size):
            batch = engine.generate(dataset.collate(selected[start:start + batch_size]), params)
            _, extras = manager(batch["responses"], batch["response_mask"], batch.meta["data_source"],
                                batch.meta["ground_truth"], batch.meta["extra_info"])
            sources += batch.meta.get("metric_source", batch.meta["data_source"])  # verl's names, as in training
            prompts += batch.meta["uid"]
            acc += [float(a) for a in extras["acc"]]
            reward += [float(s) for s in extras["score"]]
            answers = answers + extras["pred"] if answers is not None and "pred" in extras else None
            bar.update(len(selected[start:start + batch_size]))  # (problems, each sampled val_kwargs.n times)
    per_problem: dict[int, list[float]] = {}
    for prompt, a in zip(prompts, acc):
        per_problem.setdefault(prompt, []).append(a)
    return stats.validation_metrics(sources, prompts, acc, reward, answers), \
        [float(np.mean(per_problem[i])) for i in selected]


@contextlib.contextmanager
def _trusted_code(folder: str | Path, trust_remote_code: bool):
    """transformers' refusal of a folder's model code, untrusted, or of a model type it does not know, as a
    ModelError saying which switch loads it."""
    from rlhf_core.models.loading import ModelError

    try:
        yield
    except ValueError as exc:
        if "does not recognize this architecture" in str(exc):
            raise ModelError(f"{folder}: transformers does not know its model type; a module that registers it is "
                             "imported with actor_rollout_ref.model.external_lib (the evaluate command's "
                             "--external-lib MODULE)") from exc
        if trust_remote_code or "trust_remote_code" not in str(exc):
            raise
        raise ModelError(f"{folder} holds model code of its own (config.json's auto_map), which runs only when "
                         "trusted: set actor_rollout_ref.model.trust_remote_code=true (the evaluate command's "
                         "--trust-remote-code) if you trust it") from exc


class NoticesOnce:
    """Several evaluations of the same data (the base model, the policy, production's checkpoint) each read it, and
    each said its notices (a truncation, an assistant turn): under ``with said():`` of one instance a ``notice:``
    line of stderr already said is left out; every other line, a progress bar's frames included, passes as it
    comes (a line is held back only while it could still be a notice)."""

    PREFIX = "notice: "

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.out: Any = None
        self.held = ""

    def write(self, text: str) -> int:
        # (cut after each newline alone: a progress bar's frame, "\r" and the bar, passes in one write, where
        # ZenML's step log puts the step's name after each "\r" of a write and before every other write)
        for piece in filter(None, re.split(r"(?<=\n)", text)):
            line, self.held = self.held + piece, ""
            if not line.endswith("\n") and (line.startswith(self.PREFIX) or self.PREFIX.startswith(line)):
                self.held = line  # the rest of the line decides
            elif not line.startswith(self.PREFIX):
                self.out.write(line)
            elif line not in self.seen:
                self.seen.add(line)
                self.out.write(line)
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def __getattr__(self, name: str):  # encoding, isatty, fileno ...: the stream's own (a progress bar reads them)
        out = self.__dict__.get("out")
        if out is None:
            raise AttributeError(name)
        return getattr(out, name)

    @contextlib.contextmanager
    def said(self):
        self.out = sys.stderr
        try:
            with contextlib.redirect_stderr(self):
                yield
        finally:
            if self.held:
                self.out.write(self.held)
                self.held = ""


def reworded(text: str, names: Mapping[str, str]) -> str:
    """``text`` with each key of ``names`` (training's, such as ``data.max_prompt_length``) put as its value (what
    a caller, a command, calls it: its own option). A key inside a word or a path is left as it is: the file named
    (a folder data.max_prompt_length=512/, as a sweep names its runs, or my_data.val_files.parquet) is the one on
    disk."""
    for key, name in names.items():
        # not after a letter, dot, dash or slash; not before a letter or slash, nor a dot that goes on (.parquet)
        text = re.sub(rf"(?<![\w./\\-]){re.escape(key)}(?![\w/\\]|\.\w)",
                      functools.partial(_name_unless_in_path, name), text)
    return text


def _name_unless_in_path(name: str, match: re.Match) -> str:
    """``name``, unless the text around ``match`` up to the spaces either side holds a slash (a path's part)."""
    text = match.string
    start = max(text.rfind(space, 0, match.start()) for space in " \t\n") + 1
    end = min((found for space in " \t\n" if (found := text.find(space, match.end())) >= 0), default=len(text))
    around = text[start:match.start()] + text[match.end():end]
    return match.group(0) if "/" in around or "\\" in around else name


@contextlib.contextmanager
def _said_as(names: Mapping[str, str] | None):
    """The notices (stderr) and DataErrors of the block :func:`reworded` by ``names``."""
    if not names:
        yield
        return
    notices = io.StringIO()
    try:
        with contextlib.redirect_stderr(notices):
            yield
    except DataError as exc:
        raise type(exc)(reworded(str(exc), names)) from None
    finally:
        sys.stderr.write(reworded(notices.getvalue(), names))


@torch.no_grad()
def evaluate_policy(
    model_dir: str | Path,
    val_files: str | Sequence[str],
    data_config: DataConfig | None = None,
    max_new_tokens: int | None = None,
    batch_size: int = 64,
    reward_fn: RewardFn | None = None,
    tokenizer_path: str | Path | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    examples_per_kind: int = EXAMPLES_PER_KIND,
    max_problems: int | None = None,
    sample_seed: int = 0,
    val_kwargs: ValKwargsConfig | None = None,
    seed: int = 0,
    override_config: dict | None = None,
    trust_remote_code: bool = False,
    names: Mapping[str, str] | None = None,
    label: str | None = None,
) -> EvalResult:
    """Greedy (one response per prompt) accuracy of the model in ``model_dir`` on ``val_files``.

    ``data_config`` gives the prompt settings (key, length limit, truncation) and, when
    ``max_new_tokens`` is None, the response length; ``reward_fn`` replaces the built-in reward
    by data source, as ``custom_reward_function`` does in training (a :class:`BatchRewardFn`, as
    :func:`~rlhf_core.rewards.custom_reward_fn` gives it under ``reward_model.reward_manager=batch``, is called once
    a batch of prompts), and then grades rows without a
    ``reward_model.ground_truth`` (it gets None), which the built-in rules cannot. ``max_problems`` caps the
    problems at a sample stratified by data source (``sample_seed`` draws it: the same data, cap
    and seed give the same problems). With ``val_kwargs`` asking for sampling (``n > 1`` or
    ``do_sample``) each problem is also sampled ``n`` times (generator seed ``seed``) for the
    verl ``mean@n`` / ``best@n`` / ``maj@n`` metrics (and ``std@n`` / ``worst@n``) in ``sampled``; greedy stays the
    headline.
    ``override_config`` sets model config attributes before loading, as training loads the actor
    (``actor_rollout_ref.model.override_config``; a trained policy's export already holds them).
    ``trust_remote_code`` runs the model code a model or tokenizer folder holds (its ``auto_map``), as
    ``actor_rollout_ref.model.trust_remote_code`` lets training; without it such a folder is a :class:`ModelError`.
    ``names`` maps training's data keys (``data.val_files``, ``data.max_prompt_length``, ...) to what the caller
    calls them (a command's options): the notices and DataErrors about the validation data name those instead.
    ``label`` says which model this is (``trained policy``, ``base model``) in its load's and its evaluation's
    progress lines, where a pipeline's log holds several evaluations, one from a temporary folder.
    A tokenizer folder (``tokenizer_path``, else the model's) without tokenizer files is a :class:`ModelError`; a
    reward whose ``acc`` on a greedy response is neither 0 nor 1 (NaN, or a partial credit such as 0.2, which the
    trainer's validation averages as it is) a :class:`NotRightOrWrong`, since each problem counts right or wrong.
    """
    from rlhf_core.data.dataset import RLHFDataset
    from rlhf_core.models.loading import ModelError, check_tokenizer_dir, load_actor, load_tokenizer
    from rlhf_core.rewards.manager import RewardManager
    from rlhf_core.rollout import SamplingParams, make_rollout_engine

    data_config = data_config or DataConfig()
    model_dir = resolve_policy_dir(model_dir)
    try:  # (transformers' own refusal is a traceback about slow tokenizers and sentencepiece)
        check_tokenizer_dir(tokenizer_path or model_dir, "tokenizer_path" if tokenizer_path else "model")
    except ModelError as exc:
        raise ModelError(f"{exc}: the prompts are encoded and the responses decoded with the policy's tokenizer; "
                         "copy the tokenizer files of the model it was trained from into it") from None
    with _trusted_code(tokenizer_path or model_dir, trust_remote_code):
        tokenizer = load_tokenizer(tokenizer_path or model_dir, trust_remote_code)
    with _said_as(names):
        named = Counter(path.resolve() for path in as_file_list(val_files))
        twice = [(path, count) for path, count in named.items() if count > 1]
        if twice:  # (its problem ids would be said to be shared, and the user sent to renumber its rows)
            raise DataError(f"data.val_files: {twice[0][0]} is named {twice[0][1]} times; its rows would be "
                            "evaluated as many times over: name each file once")
        dataset = RLHFDataset(val_files, tokenizer, data_config, key="data.val_files",
                              require_ground_truth=reward_fn is None)
        ids = Counter(row["id"] for row in dataset.rows)
        repeated = sorted(problem for problem, count in ids.items() if count > 1)
        if repeated:
            raise DataError(f"data.val_files: {len(repeated)} problem ids (data_source/extra_info.index, else the "
                             f"row in its file) are shared by several rows, e.g. {', '.join(repeated[:3])}; the "
                             "evaluation pairs each problem with its result elsewhere by this id: give every row "
                             "its own extra_info.index")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be >= 1 (prompts generated at once)")
    # stratified by the data_source column, which names the groups (as in training's val-core metrics), not by
    # the column that routes the reward (data.reward_fn_key), which may send every row to one function
    selected = stats.stratified_sample([row["metric_source"] for row in dataset.rows], max_problems, sample_seed)
    for source in sorted({dataset.rows[index]["data_source"] for index in selected} if reward_fn is None else ()):
        try:  # a source without a built-in rule, said before the model loads and generates its first batch
            get_reward_fn(source)
        except UnknownDataSourceError as exc:
            raise UnknownDataSourceError(reworded(f"data.val_files: {exc.args[0]}", names or {})) from None
    with _trusted_code(model_dir, trust_remote_code):
        module = load_actor(model_dir, dtype=dtype, device=device, override_config=override_config,
                            trust_remote_code=trust_remote_code, about=f"{label}: {model_dir}" if label else None)
    engine = make_rollout_engine("hf", module, tokenizer, seed=seed)
    response_length = max_new_tokens or data_config.max_response_length
    params = SamplingParams(n=1, max_new_tokens=response_length, do_sample=False)
    manager = RewardManager(tokenizer, reward_fn)

    rows: list[dict[str, Any]] = []
    scores: list[float] = []
    lengths: list[float] = []
    with progress_bar(total=len(selected), desc=f"evaluation ({label})" if label else "evaluation",
                      unit="problem") as bar:
        for start in range(0, len(selected), batch_size):
            indices = selected[start:start + batch_size]
            batch = engine.generate(dataset.collate(indices), params)
            _, extras = manager(batch["responses"], batch["response_mask"], batch.meta["data_source"],
                                batch.meta["ground_truth"], batch.meta["extra_info"])
            lengths += batch["response_mask"].sum(-1).float().tolist()
            verdicts = [(dataset.rows[index]["id"], float(extras["acc"][row])) for row, index in enumerate(indices)]
            check_right_or_wrong(verdicts)
            for row, index in enumerate(indices):
                scores.append(float(extras["score"][row]))
                rows.append({
                    "id": dataset.rows[index]["id"],
                    "index": dataset.rows[index]["index"],
                    "data_source": batch.meta["data_source"][row],
                    "metric_source": dataset.rows[index]["metric_source"],  # the data_source column's
                    "prompt": dataset.rows[index]["messages"][-1]["content"],
                    "messages": dataset.rows[index]["messages"],  # the whole prompt, for the fingerprint
                    "response": extras["responses"][row],
                    "ground_truth": batch.meta["ground_truth"][row],
                    "extra_info": dataset.rows[index]["extra_info"],  # what the reward grades against, for the fingerprint
                    "score": float(extras["score"][row]),
                    "correct": bool(extras["acc"][row] > 0),
                })
            bar.update(len(indices))
    sampled: dict[str, float] = {}
    if val_kwargs is not None and (val_kwargs.n > 1 or val_kwargs.do_sample):
        sampled, sampled_acc = _sampled_metrics(engine, dataset, selected, manager, val_kwargs, response_length,
                                                batch_size, label)
        for row, value in zip(rows, sampled_acc):
            row[f"mean@{val_kwargs.n}"] = value
    per_source: dict[str, list[bool]] = {}
    for row in rows:
        per_source.setdefault(row["metric_source"], []).append(row["correct"])
    right = sum(row["correct"] for row in rows)
    return EvalResult(
        model=str(model_dir),
        accuracy=right / len(rows),
        n=len(rows),
        mean_score=float(np.mean(scores)),
        per_source={source: float(np.mean(values)) for source, values in sorted(per_source.items())},
        mean_response_length=float(np.mean(lengths)),
        examples=_pick_examples(rows, examples_per_kind),
        interval=stats.wilson_interval(right, len(rows)),
        val_fingerprint=val_fingerprint(rows),
        total_problems=len(dataset),
        sampled=sampled,
        problems=rows,
    )


# ----------------------------------------------------------------------------- problem by problem


@dataclass
class ProductionPairing:
    """Production's results on the candidate's problems (None: not compared, ``refusal`` says why), its summary
    for the report, and why its checkpoint was evaluated in this run (None: its stored results paired)."""

    results: dict[str, bool] | None = None
    refusal: str | None = None
    result: EvalResult | None = None
    reevaluated: str | None = None


def pair_with_production(candidate: Mapping[str, Any], version: str, record: Callable[[], Mapping[str, Any]] | None,
                         checkpoint: Callable[[], Any] | None,
                         evaluate: Callable[[Any], EvalResult]) -> ProductionPairing:
    """Production's stored evaluation record (``record()`` gives it) where it pairs with the ``candidate``
    record (:func:`~rlhf_core.pipeline.promotion.match_production`), else its checkpoint (``checkpoint()``)
    run through ``evaluate`` on the candidate's problems. A record that cannot be read counts as none; without
    a checkpoint, or where it cannot be evaluated, the refusal stands and says so."""
    from rlhf_core.pipeline.promotion import match_production

    try:
        stored = record() if record is not None else {}
    except Exception as exc:  # noqa: BLE001 - an unreadable record is one that cannot pair
        stored, unread = {}, f" (its evaluation record could not be read: {type(exc).__name__}: {exc})"
    else:
        unread = ""
    results, refusal = match_production(candidate, stored, version)
    if results is not None:
        return ProductionPairing(results, None, EvalResult.from_dict({**stored["policy"], "problems": []}))
    refusal += unread
    if checkpoint is None:
        return ProductionPairing(refusal=f"{refusal}; it has no checkpoint to evaluate here")
    try:
        result = evaluate(checkpoint())
    except Exception as exc:  # noqa: BLE001 - whatever it was, the candidate is then refused, not the run failed
        return ProductionPairing(refusal=f"{refusal}; its checkpoint could not be evaluated here either "
                                         f"({type(exc).__name__}: {exc})")
    results = {p["id"]: p["correct"] for p in result.problems}
    missing = [pid for pid in candidate["problems"] if pid not in results]
    if missing:  # its own tokenizer or template dropped prompts the candidate's run kept (filter_overlong_prompts)
        return ProductionPairing(refusal=(
            f"{refusal}; its checkpoint, evaluated here, kept no result for {len(missing)} of the candidate's "
            f"{len(candidate['problems'])} problems ({', '.join(map(str, missing[:5]))}{', ...' if len(missing) > 5 else ''}): "
            "with its own tokenizer or chat template, prompts can exceed data.max_prompt_length and "
            "data.filter_overlong_prompts drops them (a max_problems sample is then drawn from other rows); raise "
            "the limit or turn the filter off to compare"), result=result)
    return ProductionPairing({pid: results[pid] for pid in candidate["problems"]}, None, result, reevaluated=refusal)


def per_problem_table(candidate: EvalResult, base: EvalResult,
                      production: Mapping[str, bool] | None = None) -> pd.DataFrame:
    """One row per problem: id, data source, base / candidate / production correctness, the responses.

    ``production`` maps problem id to the production version's correctness (absent: no column
    values, ``None``). Base and candidate must have been evaluated on the same problems. ``ground_truth`` is the
    stored one as text, null for a problem without one (a custom reward's prompts): an empty CSV cell, never the
    text "None", which a ground truth may be.
    """
    if base.val_fingerprint != candidate.val_fingerprint:
        raise ValueError(f"base model and candidate were evaluated on different problems (fingerprints "
                         f"{base.val_fingerprint} and {candidate.val_fingerprint})")
    base_rows = {row["id"]: row for row in base.problems}
    records = []
    for row in candidate.problems:
        records.append({
            "problem_id": row["id"],
            "data_source": row["data_source"],
            "index": row["index"],
            "base_correct": bool(base_rows[row["id"]]["correct"]),
            "candidate_correct": bool(row["correct"]),
            "production_correct": None if production is None else production.get(row["id"]),
            "ground_truth": None if is_missing(row["ground_truth"]) else str(row["ground_truth"]),
            "prompt": row["prompt"],
            "candidate_response": row["response"],
            "base_response": base_rows[row["id"]]["response"],
        })
    return pd.DataFrame.from_records(records, columns=[
        "problem_id", "data_source", "index", "base_correct", "candidate_correct", "production_correct",
        "ground_truth", "prompt", "candidate_response", "base_response"])


def changed_problems(table: pd.DataFrame, baseline: str = "base", limit: int = CHANGED_SHOWN) -> dict[str, Any]:
    """The problems the candidate fixed (``baseline`` wrong, candidate right) and broke, ``limit`` of each."""
    column = f"{baseline}_correct"
    known = table[table[column].notna()]
    before = known[column].astype(bool)
    after = known["candidate_correct"].astype(bool)

    def listed(rows: pd.DataFrame) -> list[dict[str, Any]]:
        # a missing ground truth is pandas' NaN in the table: None in the step's metadata (JSON null)
        return [{"problem_id": r["problem_id"], "data_source": r["data_source"],
                 "ground_truth": None if is_missing(r["ground_truth"]) else r["ground_truth"],
                 "candidate_response": r["candidate_response"]} for _, r in rows.head(limit).iterrows()]

    fixed, broken = known[~before & after], known[before & ~after]
    return {"baseline": baseline, "n_fixed": len(fixed), "n_broken": len(broken),
            "fixed": listed(fixed), "broken": listed(broken)}


# ----------------------------------------------------------------------------- the reward under test


#: why a pipeline run needs a ground truth on every validation row where its trainer does not (a reward model at
#: ``reward_model.rule_coef=0``): the pipeline's own steps grade the validation set with the built-in rule
RULE_GRADES_EVALUATION = (
    "the pipeline's evaluate step grades every validation problem with the built-in rule against its "
    "reward_model.ground_truth (and define_reward's self-check scores the reference solutions against it): a "
    "reward model at reward_model.rule_coef=0 trains without one, the evaluation does not; give every validation "
    "row its ground truth, or grade with a custom reward function (custom_reward_function.path)")


def ground_truth_needs(cfg: PPOConfig) -> dict[str, tuple]:
    """:func:`~rlhf_core.data.validation.validate_dataset`'s ``ground_truth_required`` and ``ground_truth_reason``
    for a pipeline run of ``cfg``, each a pair (train, val).

    Training needs a ground truth where :meth:`PPOConfig.needs_ground_truth` says so. Evaluation, and the reward's
    self-check, grade the validation set with the reward the run defines (:func:`_reward_callables`): a custom
    reward function grades rows without one, the built-in rule does not, even where a reward model at
    ``rule_coef=0`` trains without it; the reason (:data:`RULE_GRADES_EVALUATION`) is then the pipeline's own."""
    trains = cfg.needs_ground_truth()
    rule_grades = not cfg.custom_reward_function.path
    return {"ground_truth_required": (trains, trains or rule_grades),
            "ground_truth_reason": (None, RULE_GRADES_EVALUATION if rule_grades and not trains else None)}


def _reward_callables(cfg: PPOConfig, data_sources: Sequence[str]) -> dict[str, RewardFn]:
    fn = custom_reward_fn(cfg)
    if fn is not None:
        return {source: fn for source in data_sources}
    return {source: get_reward_fn(source) for source in data_sources}


def read_data_sources(files: str | Sequence[str], column: str = "data_source") -> list[str]:
    sources: set[str] = set()
    for path in as_file_list(files):
        sources.update(read_rows(path, columns=[column])[column].astype(str))
    return sorted(sources)


def reward_spec(cfg: PPOConfig, data_sources: Sequence[str] | None = None, full_score: float = 1.0,
                keep_source: bool = False) -> dict[str, Any]:
    """Which reward scores these data: one entry per data source, and one hash over all of them.

    Each entry names the function (``module.qualname``, or ``/abs/file.py:name`` for a custom
    one), its keyword defaults and the SHA-256 of its source (with the modules and functions its
    body calls into); ``sha256`` over the whole spec changes whenever any of that does.
    ``keep_source``: a custom reward's files, as the hash read them, are kept under
    :data:`~rlhf_core.pipeline.lineage.SOURCE_KEY` (outside the hash), for ``rlhf-lineage --reward-source``.
    """
    if data_sources is None:
        data_sources = read_data_sources(cfg.data.val_files, cfg.data.reward_fn_key)
    custom = cfg.custom_reward_function
    callables = _reward_callables(cfg, data_sources)
    cwd = Path.cwd()
    code, imported, files = user_code(Path(custom.path), cwd) if custom.path else (None, set(), {})
    functions = {}
    for source, fn in callables.items():
        bound = fn.fn if isinstance(fn, BatchRewardFn) else fn  # reward_manager=batch: the file's function
        body = bound.func if isinstance(bound, functools.partial) else bound  # reward_kwargs bound to it
        functions[source] = {
            "function": reward_identity(body, custom.path, custom.name),
            "parameters": keyword_defaults(bound),  # with reward_kwargs, their values in place of the defaults
            "calls": {f"{spec_module_name(f.__module__)}.{f.__qualname__}": keyword_defaults(f)
                      for f in called_functions(body)},
            "source_sha256": hashlib.sha256((code if custom.path else source_closure(body)).encode()).hexdigest(),
        }
    spec = {
        "kind": "custom" if custom.path else "builtin",
        "custom_path": str(Path(custom.path).expanduser().resolve()) if custom.path else None,
        "custom_name": custom.name if custom.path else None,
        "full_score": float(full_score),
        "functions": functions,
    }
    if custom.path and custom.reward_kwargs:  # (only then, so that a spec without them hashes as before)
        spec["reward_kwargs"] = dict(custom.reward_kwargs)
    if packages := installed_versions(imported):  # (only then, so that a spec importing none hashes as before)
        spec["packages"] = packages
    if cfg.reward_model.reward_manager == "batch":
        spec["reward_manager"] = "batch"
    spec["sha256"] = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
    if keep_source and custom.path:
        spec[SOURCE_KEY] = kept_source(files, cwd)
    return spec


def spec_lines(spec: Mapping[str, Any]) -> list[str]:
    """:func:`reward_spec` as a log says it: its hash and kind, then for each data source the function (a custom
    one by its file), its settings and the functions its body calls with theirs (a dict's repr was one long line)."""
    def called(name: str, settings: Mapping[str, Any]) -> str:
        return f"{name}({', '.join(f'{key}={value!r}' for key, value in settings.items())})"

    lines = [f"reward {spec['sha256'][:12]} ({spec['kind']}), full score {spec['full_score']:g}:"]
    for source, entry in spec["functions"].items():
        calls = ", ".join(called(name, settings) for name, settings in entry["calls"].items())
        lines.append(f"  {source}: {called(entry['function'], entry['parameters'])}"
                     + (f" calling {calls}" if calls else ""))
    return lines


class RewardChangedError(ValueError):
    """The reward (its function, source or settings) is no longer the one the run pinned down."""


def check_reward_unchanged(cfg: PPOConfig, pinned: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The reward spec of ``cfg`` now; raises :class:`RewardChangedError` when it differs from ``pinned``
    (``define_reward``'s spec): a reward file edited while the run went would grade with code nobody checked."""
    now = reward_spec(cfg, data_sources=list(pinned.get("functions", {})) or None)
    if now["sha256"] != pinned["sha256"]:
        changed = sorted(source for source, entry in now["functions"].items()
                         if pinned.get("functions", {}).get(source) != entry)
        raise RewardChangedError(
            f"{where}: the reward changed since define_reward pinned it (sha256 {pinned['sha256'][:12]} -> "
            f"{now['sha256'][:12]}; data sources {changed or 'none'} differ, else its settings or packages): "
            "rerun the pipeline")
    return now


@dataclass
class ReferenceCheck:
    """The reward's self-check against the reference solutions of a dataset."""

    checked: int
    mismatches: list[dict[str, Any]]

    @property
    def success(self) -> bool:
        return not self.mismatches

    def summary(self, limit: int = 10) -> str:
        if self.checked == 0:
            return "warning: no reference solutions (extra_info.answer) to check the reward against"
        if not self.mismatches:
            return f"reward self-check passed: all {self.checked} reference solutions earn full marks"
        lines = [f"reward self-check FAILED: {len(self.mismatches)} of {self.checked} reference solutions "
                 "do not earn full marks against their own ground truth:"]
        for item in self.mismatches[:limit]:
            lines.append(f"  {item['file']} row {item['row']} (data_source={item['data_source']}): ground truth "
                         f"{item['ground_truth']!r}, reward {item['result']}"
                         + (f" (training refuses it: {item['refused']})" if "refused" in item else "")
                         + f", solution ends {item['solution_end']!r}")
        if len(self.mismatches) > limit:
            lines.append(f"  ... and {len(self.mismatches) - limit} more")
        return "\n".join(lines)


def check_reference_solutions(cfg: PPOConfig, files: str | Sequence[str] | None = None,
                              full_score: float = 1.0) -> ReferenceCheck:
    """Score every ``extra_info.answer`` against its ``reward_model.ground_truth``; all must be full marks."""
    files = cfg.data.val_files if files is None else files
    key = cfg.data.reward_fn_key
    checked, mismatches = 0, []
    fns: dict[str, RewardFn] = {}
    for path in as_file_list(files):
        frame = read_rows(path)  # as training reads them: an integer ground truth beside a null is no float
        for row, record in enumerate(frame.to_dict("records")):
            record = plain_value(record)  # the cells as training hands them to the reward function
            extra = record.get("extra_info")
            solution = extra.get("answer") if isinstance(extra, Mapping) else None
            if not isinstance(solution, str):
                continue
            source = str(record[key])
            reward_model = record.get("reward_model")
            ground_truth = reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
            if source not in fns:
                fns.update(_reward_callables(cfg, [source]))
            refused = None
            try:
                result = awaited(fns[source](data_source=source, solution_str=solution, ground_truth=ground_truth,
                                             extra_info=extra))
                full_marks = read_reward_result(result, full_score).full_marks  # as training reads it
            except RewardResultError as exc:  # a result training refuses: no marks, and the reason said
                full_marks, refused = False, str(exc)
            except Exception as exc:  # noqa: BLE001 - a crashing reward is a mismatch, reported with its row
                result, full_marks = f"{type(exc).__name__}: {exc}", False
            checked += 1
            if not full_marks:
                mismatches.append({"file": str(path), "row": row, "index": extra.get("index", row),
                                   "data_source": source, "ground_truth": ground_truth,
                                   "result": result if isinstance(result, (int, float, str)) else repr(result),
                                   "solution_end": solution[-60:], **({"refused": refused} if refused else {})})
    return ReferenceCheck(checked, mismatches)


# ----------------------------------------------------------------------------- figures and report


def _png(figure) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return buffer.getvalue()


def _series(history: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float], list[int]]:
    """The steps that logged ``key``, its values there (NaN where it was not finite: a gap in the line), and those
    steps of them where it was not finite (NaN or inf, or None: the file logger's and the history's null)."""
    steps, values, not_finite = [], [], []
    for record in history:
        if key not in record:
            continue
        value = record[key]
        step = int(record.get("step", record.get("training/global_step", len(steps) + 1)))
        if isinstance(value, (int, float)) and math.isfinite(value):
            steps.append(step)
            values.append(float(value))
        elif value is None or isinstance(value, (int, float)):
            steps.append(step)
            values.append(math.nan)
            not_finite.append(step)
    return steps, values, not_finite


def _steps_note(steps: Sequence[int], shown: int = 5) -> str:
    """``step 3`` or ``steps 3, 4, 7`` (the first ``shown``, then how many more)."""
    more = f" and {len(steps) - shown} more" if len(steps) > shown else ""
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps[:shown]))}{more}"


def curve_panels(history: Sequence[Mapping[str, Any]]) -> list[tuple[str, list[str]]]:
    """The panels of :func:`training_curves_png`: each title with the metrics drawn in it."""
    keys = sorted({k for record in history for k in record})
    # the KL per token, as the KL guard reads it: actor/kl_loss is summed as loss_agg_mode says (per response with
    # seq-mean-token-sum), its per-token mean logged beside it
    kl_loss = KL_LOSS_TOKEN_MEAN if KL_LOSS_TOKEN_MEAN in keys else "actor/kl_loss"
    accuracy = [k for k in keys if k.startswith("val-core/") and "/acc/" in k]
    # validation rows without a ground truth (scored by a reward model or a custom function alone) have no accuracy:
    # their headline metric is the reward (stats.validation_metrics), drawn under its own name
    reward = [k for k in keys if k.startswith("val-core/") and "/reward/" in k]
    return [
        ("reward", ["critic/score/mean", "critic/rewards/mean"]),
        ("KL", [k for k in ("actor/ppo_kl", kl_loss, "actor/reward_kl_penalty") if k in keys]),
        ("validation accuracy", accuracy) if accuracy or not reward else ("validation reward", reward),
    ]


def training_curves_png(history: Sequence[Mapping[str, Any]]) -> bytes:
    """:func:`training_curves_figure` as PNG bytes."""
    return _png(training_curves_figure(history))


def training_curves_figure(history: Sequence[Mapping[str, Any]]):
    """Reward, KL and validation accuracy (a run without ground truths: its validation reward) against the training
    step, one panel each (a matplotlib Figure); the steps are whole numbers on the axis (a short run's ticks read
    0.5, 1.5, ... of a step; a panel of one step 0.945, 0.96, ...), and the panels share it, so that one step is at
    one place in each (the validation's step 0 and its points every ``test_freq`` steps stand under the training
    steps they follow)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(12, 3.4))
    first = None
    for column, (title, names) in enumerate(curve_panels(history)):
        axes = figure.add_subplot(1, 3, column + 1, sharex=first)
        first = first or axes
        for name in names:
            steps, values, not_finite = _series(history, name)
            if not steps:
                continue
            # a step whose value was NaN or inf is a gap in the line, marked with an x at the panel's foot and named
            # in the legend: a line drawn straight across it would hide the step where the run went wrong
            label = f"{name} (not finite at {_steps_note(not_finite)})" if not_finite else name
            (line,) = axes.plot(steps, values, marker="o" if len(values) < 30 else None, markersize=3, label=label)
            if not_finite:
                axes.plot(not_finite, [0.03] * len(not_finite), transform=axes.get_xaxis_transform(), marker="x",
                          markersize=7, linestyle="none", color=line.get_color(), clip_on=False, label="_not_finite")
        axes.set_title(title)
        axes.set_xlabel("training step")
        # (a whole step even where the view holds only one: MaxNLocator asks for two, else ticks fractions)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        axes.grid(alpha=0.3)
        if axes.lines:
            axes.legend(fontsize=7)
        else:
            axes.text(0.5, 0.5, "not logged", ha="center", va="center", transform=axes.transAxes)
    figure.tight_layout()
    return figure


def accuracy_figure(results: Mapping[str, EvalResult]):
    """Accuracy per model with its 95% interval and, where the problems come from several data sources, a second
    panel with each model's accuracy per source (a matplotlib Figure)."""
    from matplotlib.figure import Figure

    sources = sorted({source for result in results.values() for source in result.per_source})
    by_source = len(sources) > 1
    # the overall panel as wide beside the sources' as alone: a narrower one ran the models' names into one another
    per_width = 1.5 + 1.2 * len(sources)
    figure = Figure(figsize=(5 + per_width if by_source else 5, 3.2))
    grid = figure.add_gridspec(1, 2, width_ratios=(5, per_width)) if by_source else figure.add_gridspec(1, 1)
    axes = figure.add_subplot(grid[0])
    names = list(results)
    colors = ["#9aa5b1", "#f2994a", "#2f80ed"]
    values = [results[name].accuracy for name in names]
    errors = np.array([[value - (results[name].interval or (value, value))[0] for name, value in zip(names, values)],
                       [(results[name].interval or (value, value))[1] - value for name, value in zip(names, values)]])
    errors = errors.clip(min=0.0)  # an interval end a rounding error inside the value must not refuse the plot
    bars = axes.bar(range(len(names)), values, yerr=errors, capsize=6, color=colors[: len(names)])
    # each name on lines of its own words, level: names turned aslant ran into one another in the narrower panel
    # one n in the title where every model was evaluated on as many problems, else each model's under its name
    # (production's checkpoint evaluated here that kept fewer of the problems is shown, but on its own n)
    counts = sorted({results[name].n for name in names})
    axes.set_xticks(range(len(names)), [textwrap.fill(name, 12, break_long_words=False)
                                        + (f"\n(n={results[name].n})" if len(counts) > 1 else "") for name in names])
    for bar, value, above in zip(bars, values, errors[1]):
        axes.text(bar.get_x() + bar.get_width() / 2, value + above + 0.01, f"{value:.1%}", ha="center", fontsize=9)
    axes.set_ylim(0, max(1.0, max(values, default=0) + 0.1))
    axes.set_ylabel("greedy accuracy (95% interval)")
    axes.set_title(f"validation accuracy (n={counts[0] if counts else 0})" if len(counts) <= 1
                   else "validation accuracy (n under each model)")
    if by_source:
        per = figure.add_subplot(grid[1])
        width = 0.8 / len(names)
        for offset, (name, color) in enumerate(zip(names, colors)):
            # a source a model was not evaluated on has no bar (not a bar at 0)
            shown = [(x, results[name].per_source[source]) for x, source in enumerate(sources)
                     if source in results[name].per_source]
            per.bar([x + (offset - (len(names) - 1) / 2) * width for x, _ in shown], [v for _, v in shown],
                    width=width, color=color, label=name)
        per.set_xticks(range(len(sources)), sources, rotation=20)
        per.set_ylim(0, 1.0)
        per.set_ylabel("greedy accuracy")
        per.set_title("by data source")
        per.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, never on one
    figure.tight_layout()
    return figure


def accuracy_bar_png(results: Mapping[str, EvalResult]) -> bytes:
    """:func:`accuracy_figure` as PNG bytes."""
    return _png(accuracy_figure(results))


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}"/>'


def _interval(result: EvalResult) -> str:
    if not result.interval:
        return "n/a"
    low, high = result.interval
    return f"[{low:.1%}, {high:.1%}]"


def _truth_html(truth: Any) -> str:
    """A ground truth's table cell: its text, or :data:`NO_GROUND_TRUTH_HTML` (never "None", an answer's text)."""
    return NO_GROUND_TRUTH_HTML if is_missing(truth) else f"<td>{html.escape(str(truth))}</td>"


def _changed_html(changed: Mapping[str, Any], baseline_name: str) -> str:
    parts = [f"<h2>Problems the new version fixed and broke (against the {html.escape(baseline_name)})</h2>",
             f"<p id='changed-counts'>fixed {changed['n_fixed']}, broke {changed['n_broken']}; "
             f"the first {CHANGED_SHOWN} of each:</p>",
             "<table id='changed'><tr><th></th><th>problem</th><th>data source</th><th>ground truth</th>"
             "<th>new response</th></tr>"]
    for kind, css in (("fixed", "right"), ("broken", "wrong")):
        for item in changed[kind]:
            parts.append(f"<tr class='{css}'><td>{kind}</td><td>{html.escape(str(item['problem_id']))}</td>"
                         f"<td>{html.escape(str(item['data_source']))}</td>"
                         f"{_truth_html(item['ground_truth'])}"
                         f"<td><pre>{html.escape(str(item['candidate_response']))}</pre></td></tr>")
    parts.append("</table>")
    return "".join(parts)


def evaluation_html(results: Mapping[str, EvalResult], curves_png: bytes | None = None,
                    title: str = "Policy evaluation", changed: Mapping[str, Any] | None = None,
                    baseline_name: str = "base model", notes: Sequence[str] = ()) -> str:
    """A self-contained HTML page: accuracy with its 95% interval per model, the problems the new
    version fixed and broke (``changed``, from :func:`changed_problems`), the sampled metrics,
    the training curves, and right and wrong examples."""
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{r.accuracy:.2%}</td><td>{_interval(r)}</td><td>{r.n}</td>"
        f"<td>{r.mean_score:.3f}</td><td>{r.mean_response_length:.1f}</td>"
        f"<td><code>{html.escape(r.model)}</code></td></tr>"
        for name, r in results.items())
    parts = [
        f"<html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;margin:1.5em} table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top} pre{white-space:pre-wrap;margin:0}"
        ".right{background:#eefbea}.wrong{background:#fdecea}.no-truth{color:#777}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        "<table id='accuracy'><tr><th>model</th><th>accuracy</th><th>95% interval</th><th>prompts</th>"
        f"<th>mean reward</th><th>mean response tokens</th><th>path</th></tr>{rows}</table>",
        "".join(f"<p>{html.escape(note)}</p>" for note in notes),
        _img(accuracy_bar_png(results), "accuracy"),
    ]
    if changed is not None:
        parts.append(_changed_html(changed, baseline_name))
    sampled = {name: r.sampled for name, r in results.items() if r.sampled}
    if sampled:
        keys = sorted({key for values in sampled.values() for key in values})
        parts.append("<h2>Sampled metrics (val_kwargs)</h2><table><tr><th>metric</th>" +
                     "".join(f"<th>{html.escape(name)}</th>" for name in sampled) + "</tr>")
        for key in keys:
            cells = "".join(f"<td>{values[key]:.4f}</td>" if key in values else "<td></td>"
                            for values in sampled.values())
            parts.append(f"<tr><td><code>{html.escape(key)}</code></td>{cells}</tr>")
        parts.append("</table>")
    if curves_png:
        parts += ["<h2>Training curves</h2>", _img(curves_png, "training curves")]
    for name, result in results.items():
        parts.append(f"<h2>Examples: {html.escape(name)}</h2><table><tr><th></th><th>prompt</th>"
                     "<th>response</th><th>ground truth</th></tr>")
        for example in result.examples:
            kind = "right" if example["correct"] else "wrong"
            parts.append(f"<tr class='{kind}'><td>{kind}</td><td><pre>{html.escape(example['prompt'])}</pre></td>"
                         f"<td><pre>{html.escape(example['response'])}</pre></td>"
                         f"{_truth_html(example['ground_truth'])}</tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    return "".join(parts)
