"""Experiment tracking: one ``Tracking`` object fans each step's metrics out to several backends.

Usage::

    with Tracking(["console", "file"], "verl_examples", "gsm8k", "checkpoints/run1",
                  config=cfg_dict, total_steps=40, warn_thresholds={"kl": 0.02}) as tracker:
        for step in range(1, 41):
            tracker.log(metrics, step=step)

Backends (``VALID_LOGGERS``):

``console``
    One compact line per step on stdout, built from ``CONSOLE_KEYS`` (see there), plus a progress bar
    with ETA on stderr when ``total_steps`` is known (:func:`rlhf_core.progress.progress_bar`: a line every
    30 s where stderr is not a terminal), which shows the phase of the step under way (:meth:`Tracking.phase`).
    Lines go through ``tqdm.write`` so they do not break the bar. ``warn_thresholds`` (``WARN_THRESHOLD_KEYS``)
    append advice to the line (a NaN grad norm is warned as well).
``file``
    JSON lines at ``<local_dir>/metrics.jsonl``: one object per step, ``{"step": 12, "<metric>": ...}``
    (verl's ``VERL_FILE_LOGGER_PATH`` and ``VERL_FILE_LOGGER_ROOT`` are not read: a notice says so).
    Non-finite values (NaN, +-inf) are written as ``null`` so every line is valid JSON. Each line is
    flushed as soon as it is written, so a killed run keeps every finished step. An existing file is
    appended to: a resumed run continues it, and as it logs its first step past the checkpoint it resumed
    (``resume_step``), the records of later steps, which the run that stopped logged after that checkpoint,
    move to ``metrics.jsonl.before_resume_from_step_<k>`` with a notice (:func:`set_aside_steps_after`; the
    validation samples of ``val_generations.jsonl`` alike), so that the file holds each step of the run
    once. Within a run a step may still be logged twice (after a guard's rollback, or its record again
    whole): readers keep the last record of a step. A run started afresh in the folder
    (``resume_mode=disable``) first moves the earlier run's aside (:func:`set_aside_run_files`). The file
    is opened at the first record.
``tensorboard``
    ``torch.utils.tensorboard.SummaryWriter(<local_dir>/tensorboard)``, one scalar per metric name; in
    ``$TENSORBOARD_DIR`` where that is set, as verl writes it. A run started afresh moves the earlier run's
    ``<local_dir>/tensorboard`` aside, as the file's records; ``$TENSORBOARD_DIR``, the user's folder, is
    left as it is, with a notice where it already holds events (TensorBoard would draw both runs as one). A
    resumed run hides the points the run that stopped logged after its checkpoint as it logs its first step
    past it (not before: a run that only validates its checkpoint leaves them). Each writer's event file
    sorts after the folder's earlier ones, as TensorBoard reads them in name order (a writer opened in the
    second of an earlier file waits for the next). Needs the ``tensorboard`` package.
``wandb``
    ``wandb.init(..., dir=local_dir, mode=$WANDB_MODE or "offline")``: offline unless the user sets
    ``WANDB_MODE`` (sync later with ``wandb sync <local_dir>/wandb/offline-run-*``). Needs ``wandb``.
``mlflow``
    Tracking URI ``$MLFLOW_TRACKING_URI`` if set, else a local SQLite store at
    ``<local_dir>/mlruns/mlflow.db`` with artifacts under ``<local_dir>/mlruns/artifacts`` (MLflow 3
    refuses its old ``./mlruns`` file store unless ``MLFLOW_ALLOW_FILE_STORE=true``). Experiment =
    project name, run name = experiment name; the flattened config is logged as params. Metric and
    param names are sanitised to MLflow's alphabet (``@`` becomes ``_at_``). MLflow's usage telemetry
    is switched off unless ``MLFLOW_DISABLE_TELEMETRY`` is already set. Needs ``mlflow-skinny`` (or
    ``mlflow``) and SQLAlchemy + Alembic for the local store.

The optional packages are imported only when their backend is asked for; all are in the ``dev`` extra.

A backend that cannot write a record (a full disk, a folder it may not write) raises, the TensorBoard logger and
the validation samples' file included, as verl's tracker lets any backend's error through: the trainer stops the
run there, saying which step and the checkpoint a rerun resumes from (``LoggingError``), rather than train on for
hours with curves that stop at that step. The error names where the backend writes (:meth:`Backend.location`)
where the OS error names no file, and closing a backend whose record failed says nothing more; a backend that
cannot be closed while the run fails of another error is told in a notice, never in place of that error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import math
import os
import re
import sys
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, ClassVar

from tqdm import tqdm

from rlhf_core.atomic import fsync_dir, write_text_atomic
from rlhf_core.progress import LineBar, TerminalBar, progress_bar
from rlhf_core.training.guards import measured_kl

__all__ = [
    "BACKENDS",
    "Backend",
    "CONSOLE_KEYS",
    "VALID_LOGGERS",
    "LOGGER_PACKAGES",
    "WARN_THRESHOLD_KEYS",
    "ConsoleLogger",
    "FileLogger",
    "MlflowLogger",
    "RunInfo",
    "TensorBoardLogger",
    "Tracking",
    "WandbLogger",
    "flatten_dict",
    "mlflow_tracking_uri",
    "sanitize_mlflow_name",
    "to_float",
]

#: Console line fields, in order: (label, candidate metric keys). The first candidate present in a
#: step's metrics is shown; a field with no candidate present is left out. A candidate containing
#: ``*`` is a glob (``fnmatch``): every matching key is shown, labelled ``label[<match>]`` when there
#: is more than one. A callable candidate computes the value from the metrics (``kl``: the step's KL,
#: as the KL guard measures it). ``timing_s/step`` is appended last as ``<seconds>s``.
CONSOLE_KEYS: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("score", ("critic/score/mean",)),
    ("acc", ("val-core/*/acc/mean@*",)),
    ("val_reward", ("val-core/*/reward/mean@*",)),  # core where there is no accuracy (prompts alone)
    ("kl", (measured_kl,)),
    ("pg_loss", ("actor/pg_loss",)),
    ("vf_loss", ("critic/vf_loss",)),
    ("entropy", ("actor/entropy",)),
    ("resp_len", ("response_length/mean",)),
)
STEP_TIME_KEY = "timing_s/step"

#: Keys ``warn_thresholds`` accepts: ``kl`` checks the step's KL (:func:`~rlhf_core.training.guards.measured_kl`);
#: ``grad_norm`` checks ``actor/grad_norm`` and ``critic/grad_norm``.
WARN_THRESHOLD_KEYS = ("kl", "grad_norm")
_GRAD_NORM_KEYS = {
    "actor/grad_norm": ("actor", "actor_rollout_ref.actor"),
    "critic/grad_norm": ("critic", "critic"),
}


# ----------------------------------------------------------------------------------------------- helpers


def flatten_dict(d: Mapping[str, Any], sep: str = ".") -> dict[str, Any]:
    """Flatten nested mappings into one level with ``sep``-joined keys.

    ``{"a": {"b": 1, "c": [1, 2]}, "d": {}}`` becomes ``{"a.b": 1, "a.c": [1, 2], "d": {}}``: lists and
    other values are leaves; an empty mapping is kept as a leaf so its key is not lost.
    """
    out: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{sep}{key}" if prefix else str(key)
            if isinstance(value, Mapping) and value:
                walk(value, name)
            else:
                out[name] = value

    walk(d, "")
    return out


def to_float(value: Any) -> float | None:
    """A metric value as a Python float, or None when it is not a single number.

    Accepts bools, ints, floats, numpy scalars / one-element arrays and one-element torch tensors
    (anything with ``.item()``). Strings are not numbers here.
    """
    if isinstance(value, (str, bytes)):
        return None
    if isinstance(value, (bool, int, float)):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            value = item()
        except (ValueError, RuntimeError, TypeError):  # more than one element
            return None
        if isinstance(value, (str, bytes)):
            return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _fmt(value: float) -> str:
    return f"{value:.4g}"


GENERATIONS_KEY = "val/generations"
#: where verl's file logger writes (a file; else <root>/<project>/<experiment>.jsonl): not read here, said so
VERL_FILE_LOGGER_VARIABLES = ("VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT")
GENERATIONS_FILENAME = "val_generations.jsonl"
RUN_IDS_FILENAME = "tracking_runs.json"  # the wandb and MLflow run ids, for a resumed run to go on in them
CLIP_CHARS = 200


def _clip(text: str) -> str:
    """The start and end of a long text (the console's samples); the file and the trackers keep it whole."""
    return text if len(text) <= CLIP_CHARS else f"{text[:CLIP_CHARS // 2]} ... {text[-CLIP_CHARS // 2:]}"


def _generations_markdown(samples: list[dict[str, Any]]) -> str:
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", "<br>")

    rows = [f"| {cell(s['input'])} | {cell(s['output'])} | {_fmt(s['score'])} |" for s in samples]
    return "\n".join(["| input | output | score |", "|---|---|---|", *rows])


def _config_dict(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if isinstance(config, Mapping):
        return dict(config)
    raise TypeError(f"config must be a dict (or a dataclass instance), got {type(config).__name__}")


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What every backend is built from."""

    project_name: str
    experiment_name: str
    local_dir: Path
    config: dict[str, Any]
    total_steps: int | None = None
    warn_thresholds: dict[str, float] = dataclasses.field(default_factory=dict)
    #: the step of the checkpoint a resumed run continues from (None: a new run); a resumed run goes on in the
    #: wandb and MLflow runs it started (:data:`RUN_IDS_FILENAME`) and hides TensorBoard's points past this step
    resume_step: int | None = None

    def saved_run_id(self, backend: str) -> str | None:
        """The id of the run ``backend`` logged this run into before a resume; None for a new run."""
        path = self.local_dir / RUN_IDS_FILENAME
        if self.resume_step is None or not path.is_file():
            return None
        with contextlib.suppress(ValueError, OSError):
            return json.loads(path.read_text()).get(backend)
        return None

    def save_run_id(self, backend: str, run_id: str) -> None:
        path = self.local_dir / RUN_IDS_FILENAME
        ids = {}
        with contextlib.suppress(ValueError, OSError):
            ids = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps({**ids, backend: run_id}, indent=1) + "\n")


def _missing(package: str, backend: str, pip_name: str, error: ImportError) -> ImportError:
    return ImportError(
        f"the '{backend}' logger needs the {package} package, which could not be imported ({error}). "
        f"Install it with `pip install {pip_name}` (it is in this project's dev extra: "
        f"`pip install -e '.[dev]'`), or drop '{backend}' from trainer.logger."
    )


# ----------------------------------------------------------------------------------------------- backends


class Backend:
    """A tracking backend: built from a ``RunInfo``, then ``log`` per step and ``finish`` once."""

    name: ClassVar[str] = ""

    def __init__(self, run: RunInfo) -> None:
        self.run = run

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        """Validation samples (``input``, ``output``, ``score``) of ``step``; backends without a place for
        text leave them out."""

    def finish(self, failed: bool = False) -> None:
        """Flush and close; ``failed`` marks a run that ended with an exception (where supported)."""

    def location(self, generations: bool = False) -> str | None:
        """Where the backend writes (the metrics, or with ``generations`` the validation samples): named in the
        error of a write that failed without saying where (a full disk, at a flush)."""
        return None

    def phase(self, name: str, step: int) -> contextlib.AbstractContextManager:
        """A context for the phase ``name`` of ``step`` (see :meth:`Tracking.phase`); backends that show nothing
        of it give an empty one."""
        return contextlib.nullcontext()


def _located(error: OSError, where: str | None) -> OSError:
    """``error`` with the path ``where`` where it names none: a write or flush that fails on a full disk says
    "[Errno 28] No space left on device" and not which file."""
    if where is None or error.filename is not None or error.errno is None:
        return error
    located = OSError(error.errno, error.strerror, where)  # (the subclass of the errno: PermissionError, ...)
    return located.with_traceback(error.__traceback__)


class ConsoleLogger(Backend):
    """One compact line per step on stdout; a progress bar with ETA on stderr when the total is known."""

    name = "console"

    def __init__(self, run: RunInfo) -> None:
        super().__init__(run)
        self._bar: TerminalBar | LineBar | None = None

    def _open_bar(self, done: int) -> TerminalBar | LineBar:
        """The training bar, opened at ``done`` steps where it is not open yet: at the first step logged or the
        first phase of a step, whichever comes first. Its rate (hence the ETA) is measured from there, so
        neither startup nor a resume's skipped steps skew it."""
        if self._bar is None:
            total = self.run.total_steps
            self._bar = progress_bar(total=total, initial=min(max(done, 0), total), desc="training", unit="step")
        return self._bar

    def phase(self, name: str, step: int) -> contextlib.AbstractContextManager:
        """The training bar shows the phase ``name`` of ``step`` while it runs (``step 3/10: update_actor``); off a
        terminal as a line where the step has run and the bar wrote none for 30 s, naming the seconds of the step's phases done. The
        step as a whole (``step``) is no phase here, and nothing is shown before the first step (the validation
        before training has a bar of its own) or without a total (no bar)."""
        total = self.run.total_steps
        if name == "step" or step < 1 or not total:
            return contextlib.nullcontext()
        return self._open_bar(step - 1).phase(name, f"step {step}/{total}")

    def format_line(self, metrics: Mapping[str, float], step: int) -> str:
        total = self.run.total_steps
        parts = [f"step {step}/{total}" if total else f"step {step}"]
        for label, candidates in CONSOLE_KEYS:
            for candidate in candidates:
                if callable(candidate):
                    value = candidate(metrics)
                    if value is not None:
                        parts.append(f"{label} {_fmt(value)}")
                        break
                    continue
                if "*" in candidate:
                    matches = sorted(k for k in metrics if fnmatch.fnmatchcase(k, candidate))
                    if not matches:
                        continue
                    if len(matches) == 1:
                        parts.append(f"{label} {_fmt(metrics[matches[0]])}")
                    else:
                        head, _, tail = candidate.partition("*")
                        fixed = tail.partition("*")[0]  # the tail's text before its own wildcard ("/acc/mean@")
                        for key in matches:
                            source = key[len(head) : key.rindex(fixed)]  # (mean@16: the tail matches 3 characters)
                            parts.append(f"{label}[{source}] {_fmt(metrics[key])}")
                    break
                if candidate in metrics:
                    parts.append(f"{label} {_fmt(metrics[candidate])}")
                    break
        if STEP_TIME_KEY in metrics:
            parts.append(f"{metrics[STEP_TIME_KEY]:.3g}s")
        parts.extend(f"WARNING {w}" for w in self.warnings(metrics))
        return " | ".join(parts)

    def _kl_term(self) -> str:
        """The rest of the KL warning's advice: raise the coefficient of the KL term the run has (the controller's
        only where the KL is in the reward, else it has no effect), or add one; both keys where the config is not
        known."""
        algorithm = self.run.config.get("algorithm") or {}
        actor = (self.run.config.get("actor_rollout_ref") or {}).get("actor") or {}
        if "use_kl_in_reward" not in algorithm or "use_kl_loss" not in actor:
            return " or raise the KL coefficient (algorithm.kl_ctrl.kl_coef / actor_rollout_ref.actor.kl_loss_coef)"
        coefficients = ["algorithm.kl_ctrl.kl_coef"] if algorithm["use_kl_in_reward"] else []
        coefficients += ["actor_rollout_ref.actor.kl_loss_coef"] if actor["use_kl_loss"] else []
        if not coefficients:
            return (" or add a KL term (algorithm.use_kl_in_reward=true, or actor_rollout_ref.actor.use_kl_loss=true): "
                    "the run has none")
        return f" or raise the KL coefficient ({' / '.join(coefficients)})"

    def warnings(self, metrics: Mapping[str, float]) -> list[str]:
        """Advice for every threshold in ``warn_thresholds`` the step's metrics exceed."""
        limits = self.run.warn_thresholds
        out = []
        kl_limit = limits.get("kl")
        if kl_limit is not None:
            kl = measured_kl(metrics)
            if kl is not None and kl > kl_limit:
                out.append(f"KL {_fmt(kl)} > {_fmt(kl_limit)}: lower actor_rollout_ref.actor.optim.lr{self._kl_term()}")
        gn_limit = limits.get("grad_norm")
        if gn_limit is not None:
            for key, (who, prefix) in _GRAD_NORM_KEYS.items():
                value = metrics.get(key)
                if value is not None and not math.isfinite(value):  # (NaN is never above the limit; no clip helps)
                    out.append(
                        f"{who} grad_norm {_fmt(value)}: a gradient was not finite and that mini-batch's update was "
                        f"skipped (training/skipped_steps); lower the learning rate ({prefix}.optim.lr)"
                    )
                elif value is not None and value > gn_limit:
                    out.append(f"{who} grad_norm {_fmt(value)} > {_fmt(gn_limit)}: {self._grad_norm_advice(prefix, value)}")
        return out

    def _grad_norm_advice(self, prefix: str, grad_norm: float) -> str:
        """What to do about a grad norm above ``trainer.warn_grad_norm``. The norm is measured before clipping (as
        verl logs it), so neither a lower learning rate nor a lower grad_clip changes the next step's figure: where
        the run's grad_clip already cut this update, the warning says so, and what each knob does."""
        section: Any = self.run.config
        for name in prefix.split("."):
            section = section.get(name) if isinstance(section, Mapping) else None
        grad_clip = to_float(section.get("grad_clip")) if isinstance(section, Mapping) else None
        if grad_clip is None or not 0 < grad_clip < grad_norm:
            return f"lower the learning rate ({prefix}.optim.lr) or grad_clip ({prefix}.grad_clip)"
        return (f"measured before clipping, and {prefix}.grad_clip={_fmt(grad_clip)} scaled this update down to that "
                f"norm; if it keeps rising over the steps, lower the learning rate ({prefix}.optim.lr); where it is "
                "this model's usual size, raise trainer.warn_grad_norm")

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run.total_steps:
            self._open_bar(step)  # (a step logged counts as done)
        if self._bar is not None and step > self._bar.n:
            self._bar.update(min(step, self._bar.total) - self._bar.n)
        tqdm.write(self.format_line(metrics, step), file=sys.stdout)  # clears and redraws the bar
        sys.stdout.flush()

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        lines = [f"validation samples at step {step}:"]
        for sample in samples:
            lines.append(f"  [score {_fmt(sample['score'])}] {_clip(sample['input'])!r} -> {_clip(sample['output'])!r}")
        tqdm.write("\n".join(lines), file=sys.stdout)
        sys.stdout.flush()

    def finish(self, failed: bool = False) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (:class:`FileLogger`) in order; none where it does not exist. A partial
    line (a run killed mid-write) and lines without a step are skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def _next_free(path: Path) -> Path:
    """``path``, or ``<path>.2``, ``<path>.3`` ... where that is taken."""
    target, number = path, 1
    while target.exists():
        number += 1
        target = path.with_name(f"{path.name}.{number}")
    return target


def set_aside_run_files(local_dir: str | os.PathLike) -> list[tuple[Path, Path]]:
    """Move an earlier run's records in ``local_dir`` aside, each to ``<name>.prev``, or ``<name>.prev.2``,
    ``.prev.3`` ... where that is taken, so that a new run's records start afresh; returns (old, new) of each one
    moved. The records: ``metrics.jsonl`` and ``val_generations.jsonl`` (else the new run's steps follow the
    earlier run's), the ``tensorboard`` folder (else TensorBoard draws both runs' steps as one line) and
    ``tracking_runs.json`` (else a resume of the new run, with a logger the new run did not use, goes on in the
    earlier run's wandb or MLflow run)."""
    moved = []
    for name in (FileLogger.FILENAME, GENERATIONS_FILENAME, TensorBoardLogger.SUBDIR, RUN_IDS_FILENAME):
        path = Path(local_dir) / name
        if not (path.is_file() or (path.is_dir() and any(path.iterdir()))):
            continue
        target = _next_free(path.with_name(f"{name}.prev"))
        path.rename(target)
        moved.append((path, target))
    return moved


def set_aside_steps_after(path: str | os.PathLike, step: int) -> tuple[Path, int, list[int]] | None:
    """Move the lines of the JSON-lines file ``path`` (``metrics.jsonl``, ``val_generations.jsonl``) that are not
    records of a step up to ``step`` (the later steps' records, and a line cut short by a killed run) to
    ``<name>.before_resume_from_step_<step>`` (``.2``, ``.3`` ... where taken), in their order, leaving the others
    in ``path`` in theirs. Returns (that file, the number of lines moved, the steps of the records among them), or
    None where nothing is moved. The file of moved lines is complete before ``path`` is replaced (atomically): a
    crash between the two leaves lines twice, never none."""
    path = Path(path)
    if not path.is_file():
        return None
    kept, moved, steps = [], [], []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        number = record.get("step") if isinstance(record, dict) else None
        if isinstance(number, int) and number <= step:
            kept.append(line)
        elif line.strip():
            moved.append(line if line.endswith("\n") else line + "\n")
            if isinstance(number, int):
                steps.append(number)
    if not moved:
        return None
    target = _next_free(path.with_name(f"{path.name}.before_resume_from_step_{step}"))
    with open(target, "x", encoding="utf-8") as file:
        file.writelines(moved)
        file.flush()
        os.fsync(file.fileno())
    fsync_dir(path.parent)
    write_text_atomic(path, "".join(kept))
    return target, len(moved), steps


def _steps_text(steps: list[int]) -> str:
    """``steps 5-7`` for the steps 5, 6, 7 (in any order, repeated or not), ``step 5``, or ``no whole record``."""
    if not steps:
        return "no whole record"
    return f"steps {min(steps)}-{max(steps)}" if min(steps) < max(steps) else f"step {steps[0]}"


class FileLogger(Backend):
    """JSON lines at ``<local_dir>/metrics.jsonl``; non-finite values become null; appends; flushes; a resumed
    run's first step past its checkpoint moves the later steps the stopped run logged aside."""

    name = "file"
    FILENAME = "metrics.jsonl"

    def __init__(self, run: RunInfo) -> None:
        super().__init__(run)
        self.path = run.local_dir / self.FILENAME
        # verl's file logger writes where these say; here the file stays beside the checkpoints, where a resume and
        # a fresh run in the folder look after it: said, so that a verl user does not look for it there
        for variable in VERL_FILE_LOGGER_VARIABLES:
            if os.environ.get(variable):
                print(f"notice: {variable}={os.environ[variable]} (verl's file logger) is not read here: the 'file' "
                      f"logger writes {self.path} (one flat record a step: {{\"step\": N, \"<metric>\": ...}})",
                      file=sys.stderr, flush=True)
        # opened at the first record, not here: a file opened early would follow the earlier run's to where a
        # caller that sets tracking up first moves it aside
        self._file: IO[str] | None = None
        # a resumed run: the step of its checkpoint, until its first step past it has moved the stopped run's
        # records of those steps aside
        self._resumed_at = run.resume_step

    def _past_checkpoint(self, step: int) -> None:
        """At a resumed run's first step past its checkpoint ``k``: the records of steps after ``k`` in this
        folder's files were logged by the run that stopped, and this run logs those steps again; they move to
        a side file (:func:`set_aside_steps_after`) with a notice. A run that logs no step past ``k`` (one that
        only validates its checkpoint) leaves them."""
        if self._resumed_at is None or step <= self._resumed_at:
            return
        resumed_at, self._resumed_at = self._resumed_at, None
        if self._file is not None:  # (the file is replaced: reopened at the next record)
            self._file.close()
            self._file = None
        for name in (self.FILENAME, GENERATIONS_FILENAME):
            aside = set_aside_steps_after(self.run.local_dir / name, resumed_at)
            if aside is not None:
                target, lines, steps = aside
                print(f"notice: resumed from step {resumed_at}: {self.run.local_dir / name} held {lines} line(s) "
                      f"logged after that checkpoint by the run that stopped ({_steps_text(steps)}); moved to "
                      f"{target.name} beside it, so that this run's records of those steps are the only ones",
                      file=sys.stderr, flush=True)

    def _open(self) -> IO[str]:
        # A run killed mid-write may have left a partial last line: start ours on a fresh line.
        needs_newline = False
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                needs_newline = f.read(1) != b"\n"
        file = open(self.path, "a", encoding="utf-8")  # closed in finish()
        if needs_newline:
            file.write("\n")
        return file

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._past_checkpoint(step)
        if self._file is None:
            self._file = self._open()
        record: dict[str, Any] = {"step": step}
        for key, value in metrics.items():
            if key != "step":
                record[key] = value if math.isfinite(value) else None
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        self._past_checkpoint(step)
        with open(self.run.local_dir / GENERATIONS_FILENAME, "a", encoding="utf-8") as f:
            for sample in samples:
                record = {key: None if isinstance(value, float) and not math.isfinite(value) else value
                          for key, value in {"step": step, **sample}.items()}  # NaN is not JSON
                f.write(json.dumps(record, allow_nan=False) + "\n")

    def finish(self, failed: bool = False) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()

    def location(self, generations: bool = False) -> str:
        return str(self.run.local_dir / GENERATIONS_FILENAME if generations else self.path)


def _quiet_event_writer_threads() -> None:
    """Leave out the traceback Python prints where TensorBoard's event-writing thread fails (a full disk): the thread
    keeps its error and the writer raises it at its next write or flush, which :class:`TensorBoardLogger` calls at
    every record, so the run stops with that error, named (:meth:`Tracking.log`); the thread's traceback would only
    bury that one line. Other threads' errors are printed as before."""
    previous = threading.excepthook
    if getattr(previous, "quiets_event_writers", False):
        return

    def hook(args: Any) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, Exception):
            return
        previous(args)

    hook.quiets_event_writers = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class TensorBoardLogger(Backend):
    """Scalars by metric name in ``<local_dir>/tensorboard``, or ``$TENSORBOARD_DIR`` (verl's variable)."""

    name = "tensorboard"
    SUBDIR = "tensorboard"

    def __init__(self, run: RunInfo) -> None:
        super().__init__(run)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise _missing("tensorboard", self.name, "tensorboard", e) from e
        self._summary_writer = SummaryWriter
        _quiet_event_writer_threads()
        self.log_dir = Path(os.environ.get("TENSORBOARD_DIR") or run.local_dir / self.SUBDIR).expanduser()
        if os.environ.get("TENSORBOARD_DIR") and run.resume_step is None:
            self._notice_earlier_events()
        self._writer: Any = None
        # a resumed run: the step of its checkpoint, until it logs a step past it (see _writer_for)
        self._resumed_at = run.resume_step

    def _notice_earlier_events(self) -> None:
        """A new run writing to ``$TENSORBOARD_DIR``: events already there are an earlier run's, and TensorBoard
        draws one folder's events as one run, so the two runs' steps would mix. The folder is the user's (verl
        writes there as it is), so its files stay where they are; a notice names them and the way out."""
        earlier = sorted(self.log_dir.glob("events.out.tfevents.*"), key=lambda path: path.stat().st_mtime)
        if earlier:
            print(f"notice: TENSORBOARD_DIR={self.log_dir} already holds {len(earlier)} TensorBoard event file(s) of "
                  f"an earlier run (the newest {earlier[-1].name}): TensorBoard draws the events of one folder as one "
                  "run, so this new run's steps would be drawn mixed with that run's; point TENSORBOARD_DIR at a "
                  "new folder (one per run) or move those files away", file=sys.stderr, flush=True)

    def _writer_for(self, step: int) -> Any:
        """The writer to log ``step`` with. A resumed run logs again the steps after its checkpoint ``k``: at its first
        step past ``k`` a writer with ``purge_step=k+1`` hides the first attempt's points from there. Not before: a
        run that logs no step past ``k`` (one that validates its checkpoint only, or fails before its first step)
        leaves the first attempt's curves whole, as the file logger leaves its records."""
        if self._resumed_at is not None and step > self._resumed_at:
            purge, self._resumed_at = self._resumed_at + 1, None
            if self._writer is not None:
                self._writer.close()
            self._writer = self._open_writer(purge_step=purge)
        elif self._writer is None:
            self._writer = self._open_writer()
        return self._writer

    def _open_writer(self, purge_step: int | None = None) -> Any:
        """A writer whose event file TensorBoard reads after the folder's earlier ones. TensorBoard reads a folder's
        files in name order, events.out.tfevents.<second>.<host>.<pid>.<n> with n counting the writers the process
        opened: two opened in one second sort by host, process and n as text (.10 before .9), so a resume's purge
        and points could be read before the run they replace. A writer opened in the second of a file already
        there (a retry in the same process, a test) waits for the next second, which its name then starts with."""
        seconds = [int(part) for path in self.log_dir.glob("events.out.tfevents.*")
                   if len(parts := path.name.split(".")) > 3 and (part := parts[3]).isdigit()]
        if seconds:
            # a file stamped further ahead (another machine's clock) is not waited for
            while 0 < (wait := max(seconds) + 1 - time.time()) <= 2:
                time.sleep(wait)
        return self._summary_writer(log_dir=str(self.log_dir), purge_step=purge_step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        writer = self._writer_for(step)
        for key, value in metrics.items():
            writer.add_scalar(key, value, global_step=step)
        writer.flush()

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        writer = self._writer_for(step)
        writer.add_text(GENERATIONS_KEY, _generations_markdown(samples), global_step=step)
        writer.flush()

    def finish(self, failed: bool = False) -> None:
        if self._writer is not None:
            self._writer.close()

    def location(self, generations: bool = False) -> str:
        return str(self.log_dir)


class WandbLogger(Backend):
    """Weights & Biases, offline unless ``WANDB_MODE`` says otherwise; files under ``<local_dir>/wandb``."""

    name = "wandb"

    def __init__(self, run: RunInfo) -> None:
        super().__init__(run)
        try:
            import wandb
        except ImportError as e:
            raise _missing("wandb", self.name, "wandb", e) from e
        self.mode = os.environ.get("WANDB_MODE", "offline")
        previous = run.saved_run_id(self.name)  # a resumed run goes on in its wandb run
        self.wandb_run = wandb.init(
            project=run.project_name,
            name=run.experiment_name,
            config=run.config,
            dir=str(run.local_dir),
            mode=self.mode,
            **({"id": previous, "resume": "allow"} if previous else {}),
        )
        run.save_run_id(self.name, self.wandb_run.id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.wandb_run.log(metrics, step=step)

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        import wandb

        table = wandb.Table(columns=["step", "input", "output", "score"],
                            data=[[step, s["input"], s["output"], s["score"]] for s in samples])
        self.wandb_run.log({GENERATIONS_KEY: table}, step=step)

    def finish(self, failed: bool = False) -> None:
        self.wandb_run.finish(exit_code=1 if failed else 0)

    def location(self, generations: bool = False) -> str:
        return str(self.run.local_dir / "wandb")


_MLFLOW_BAD_CHARS = re.compile(r"[^A-Za-z0-9_\-./ ]")


def sanitize_mlflow_name(name: str) -> str:
    """A metric/param name MLflow accepts on every platform.

    MLflow allows letters, digits, ``_ - . / space`` (and ``:`` except on Windows), and rejects names
    that are not already normalised paths (leading/trailing or doubled ``/``, ``.``/``..`` parts).
    ``@`` becomes ``_at_`` (``acc/mean@1`` -> ``acc/mean_at_1``), every other character outside the
    set becomes ``_``, and path parts are cleaned up. Names are cut to MLflow's 250 characters.
    """
    name = _MLFLOW_BAD_CHARS.sub("_", str(name).replace("@", "_at_"))
    parts = [p for p in name.split("/") if p]
    parts = ["_" * len(p) if p in (".", "..") else p for p in parts]
    return "/".join(parts)[:250].rstrip("/") or "_"


def store_problems(loggers: Iterable[str]) -> list[str]:
    """What stops ``loggers`` once the models have loaded, said before: an ``MLFLOW_TRACKING_URI`` naming a folder
    (a file store), which MLflow 3 refuses unless ``MLFLOW_ALLOW_FILE_STORE`` is true. No package is imported."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if "mlflow" not in loggers or uri in ("", "databricks", "databricks-uc") \
            or urllib.parse.urlparse(uri).scheme not in ("", "file"):
        return []
    if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1"):
        return []
    return [f"MLFLOW_TRACKING_URI={uri} is a file store, which MLflow refuses unless MLFLOW_ALLOW_FILE_STORE=true: "
            "set that, or use a database store (sqlite:///PATH/mlflow.db), or unset MLFLOW_TRACKING_URI for the "
            "run's own SQLite store"]


def mlflow_tracking_uri(local_dir: str | Path) -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else the SQLite store ``<local_dir>/mlruns/mlflow.db``."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return "sqlite:///" + (Path(local_dir).resolve() / "mlruns" / "mlflow.db").as_posix()


class MlflowLogger(Backend):
    """MLflow: experiment = project name, run = experiment name, params = flattened config."""

    name = "mlflow"
    MAX_PARAM_VALUE = 6000  # MLflow's limit on a param value
    PARAMS_PER_BATCH = 100
    METRICS_PER_BATCH = 1000

    def __init__(self, run: RunInfo) -> None:
        super().__init__(run)
        # MLflow sends usage telemetry from a background thread; an offline trainer opts out unless the
        # user decided otherwise. Must be set before mlflow is first imported.
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise _missing("mlflow", self.name, "mlflow-skinny", e) from e
        self._Metric, self._Param = Metric, Param
        self._names: dict[str, str] = {}  # metric name -> sanitised, unique name
        self._taken: set[str] = set()
        self._logged_params: dict[str, str] = {}  # a resumed run's params, logged when it started

        self.tracking_uri = mlflow_tracking_uri(run.local_dir)
        local = not os.environ.get("MLFLOW_TRACKING_URI")
        if local:
            (run.local_dir / "mlruns").mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = self.client.get_experiment_by_name(run.project_name)
        if experiment is None:
            artifacts = (run.local_dir.resolve() / "mlruns" / "artifacts").as_uri() if local else None
            experiment_id = self.client.create_experiment(run.project_name, artifact_location=artifacts)
        else:
            experiment_id = experiment.experiment_id
            if experiment.lifecycle_stage == "deleted":
                self.client.restore_experiment(experiment_id)
        self.run_id = self._resumed(run.saved_run_id(self.name), experiment_id)
        if self.run_id is None:
            self.run_id = self.client.create_run(experiment_id, run_name=run.experiment_name).info.run_id
        run.save_run_id(self.name, self.run_id)
        self._log_params(flatten_dict(run.config))

    def _resumed(self, run_id: str | None, experiment_id: str) -> str | None:
        """``run_id`` (the run a resumed run logged into) set running again, where the store still holds it."""
        if run_id is None:
            return None
        try:
            found = self.client.get_run(run_id)
        except Exception:  # noqa: BLE001 - a run the store no longer has (deleted, another store): a new run
            return None
        if found.info.experiment_id != experiment_id or found.info.lifecycle_stage == "deleted":
            return None
        self.client.update_run(run_id, status="RUNNING")
        self._logged_params = dict(found.data.params)
        return run_id

    def _unique(self, name: str, taken: set[str]) -> str:
        clean = sanitize_mlflow_name(name)
        candidate, n = clean, 2
        while candidate in taken:
            candidate, n = f"{clean[:240]}_{n}", n + 1
        taken.add(candidate)
        return candidate

    def _log_params(self, params: Mapping[str, Any]) -> None:
        """The config as params; on a resumed run only those it lacks (MLflow refuses to change a param's value, so a
        key a resume may change, such as the run's length, keeps its first value there)."""
        taken: set[str] = set()
        entries = [
            self._Param(name, str(value)[: self.MAX_PARAM_VALUE])
            for key, value in params.items() if (name := self._unique(key, taken)) not in self._logged_params
        ]
        for i in range(0, len(entries), self.PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=entries[i : i + self.PARAMS_PER_BATCH])

    def _metric_name(self, name: str) -> str:
        if name not in self._names:
            self._names[name] = self._unique(name, self._taken)
        return self._names[name]

    def log(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        entries = [self._Metric(self._metric_name(k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(entries), self.METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=entries[i : i + self.METRICS_PER_BATCH])

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        self.client.log_text(self.run_id, json.dumps(samples, indent=1), f"val_generations/step_{step}.json")

    def finish(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")

    def location(self, generations: bool = False) -> str:
        return self.tracking_uri


#: Logger name -> backend class. ``Tracking`` builds one instance per requested name.
BACKENDS: dict[str, type[Backend]] = {
    cls.name: cls for cls in (ConsoleLogger, FileLogger, TensorBoardLogger, WandbLogger, MlflowLogger)
}
VALID_LOGGERS: tuple[str, ...] = tuple(BACKENDS)
#: the package each logger that needs one imports (preflight checks it is installed before any weights load)
LOGGER_PACKAGES: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


# ----------------------------------------------------------------------------------------------- tracking


class Tracking:
    """Sends each step's metrics to every requested backend (see the module docstring).

    ``log`` converts values to floats first (tensors, numpy scalars); a value that is not a single
    number is skipped with a warning (once per key). Use as a context manager, or call ``finish``.
    """

    def __init__(
        self,
        loggers: Iterable[str] | str,
        project_name: str,
        experiment_name: str,
        local_dir: str | Path,
        config: dict | None = None,
        total_steps: int | None = None,
        warn_thresholds: dict | None = None,
        resume_step: int | None = None,
    ) -> None:
        names = [loggers] if isinstance(loggers, str) else list(loggers)
        unknown = [n for n in names if n not in BACKENDS]
        if unknown:
            raise ValueError(
                f"unknown logger(s) {', '.join(map(repr, unknown))}; valid loggers are: "
                f"{', '.join(VALID_LOGGERS)}"
            )
        thresholds = dict(warn_thresholds or {})
        bad = [k for k in thresholds if k not in WARN_THRESHOLD_KEYS]
        if bad:
            raise ValueError(
                f"unknown warn_thresholds key(s) {', '.join(map(repr, bad))}; valid keys are: "
                f"{', '.join(WARN_THRESHOLD_KEYS)}"
            )
        for key, value in thresholds.items():
            number = to_float(value)
            if number is None or not number > 0:
                raise ValueError(f"warn_thresholds[{key!r}] must be a positive number, got {value!r}")
            thresholds[key] = number
        if total_steps is not None and (int(total_steps) != total_steps or total_steps < 1):
            raise ValueError(f"total_steps must be a positive integer or None, got {total_steps!r}")

        local = Path(local_dir)
        local.mkdir(parents=True, exist_ok=True)
        self.run = RunInfo(
            project_name=project_name,
            experiment_name=experiment_name,
            local_dir=local,
            config=_config_dict(config),
            total_steps=int(total_steps) if total_steps is not None else None,
            warn_thresholds=thresholds,
            resume_step=resume_step,
        )
        self.backends: dict[str, Backend] = {}
        self._skipped: set[str] = set()
        self._failed: set[str] = set()  # the backends a record failed in (their failure is the one told)
        self._finished = False
        try:
            for name in dict.fromkeys(names):  # de-duplicated, order kept
                self.backends[name] = BACKENDS[name](self.run)
        except BaseException:
            with contextlib.suppress(Exception):  # the construction error is the one to report
                self.finish(failed=True)
            raise

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record one step's metrics (name -> number) in every backend."""
        if self._finished:
            raise RuntimeError("Tracking.log called after finish()")
        step = int(step)
        clean: dict[str, float] = {}
        for key, value in metrics.items():
            number = to_float(value)
            if number is None:
                if key not in self._skipped:
                    self._skipped.add(key)
                    warnings.warn(
                        f"metric {key!r} is not a single number ({type(value).__name__}); not logged",
                        stacklevel=2,
                    )
                continue
            clean[str(key)] = number
        for name, backend in self.backends.items():
            self._write(name, backend, lambda backend: backend.log(clean, step))

    @contextlib.contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        """A context for the phase ``name`` of ``step``, named as its ``timing_s/<name>`` metric (``gen``,
        ``update_actor``, ``testing``, ``save_checkpoint``, ...), while it runs: the console's training bar
        shows it (:meth:`ConsoleLogger.phase`), so a step that takes minutes is told from a hung one. A
        trainer's ``phase_hooks`` entry."""
        with contextlib.ExitStack() as stack:
            for backend in self.backends.values():
                stack.enter_context(backend.phase(name, step))
            yield

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        """Validation samples (``input``, ``output``, ``score``; ``trainer.log_val_generations`` of them) in
        every backend that keeps text: printed on the console, ``val_generations.jsonl`` beside the metrics
        file, a text in TensorBoard, a table in wandb, a JSON artifact in MLflow."""
        for name, backend in self.backends.items():
            self._write(name, backend, lambda backend: backend.log_generations(samples, int(step)), generations=True)

    def _write(self, name: str, backend: Backend, write: Callable[[Backend], None], generations: bool = False) -> None:
        """``write(backend)``; an OSError names where the backend writes (:meth:`Backend.location`), and the
        backend is marked failed: closing it then says nothing more (TensorBoard's writer raises the error of its
        thread again as it closes, which would stand in for the step's)."""
        try:
            write(backend)
        except OSError as exc:
            self._failed.add(name)
            raise _located(exc, backend.location(generations)) from None
        except Exception:
            self._failed.add(name)
            raise

    def finish(self, failed: bool = False) -> None:
        """Close every backend (idempotent). ``failed`` marks the run as failed where supported."""
        if self._finished:
            return
        self._finished = True
        errors = []
        for name, backend in self.backends.items():
            try:
                backend.finish(failed=failed)
            except OSError as e:  # close the others before reporting
                if name not in self._failed:  # (one whose record failed: that failure is told already)
                    errors.append(_located(e, backend.location()))
            except Exception as e:
                if name not in self._failed:
                    errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.finish()
            return
        try:
            self.finish(failed=True)
        except Exception as closing:  # the run's own error is the one to report; this one is said beside it
            print(f"notice: a logger could not be closed either ({type(closing).__name__}: {closing})",
                  file=sys.stderr, flush=True)
