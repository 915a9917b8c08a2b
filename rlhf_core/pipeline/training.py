"""What the training step adds to a run, with no orchestrator in it: the warm-start policy at a path that stays
the same over retries and reruns, the run's whole history across resumes, and the way on after a failure."""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import sys
from pathlib import Path

from rlhf_core.atomic import staged_directory
from rlhf_core.main_ppo import RunResult
from rlhf_core.training.checkpoint import CheckpointError, latest_or_none, step_of
from rlhf_core.training.tracking import FileLogger, read_metrics


def _numbers(metrics: dict) -> dict[str, float | None]:
    """The numbers of ``metrics`` as floats, one that is not finite (NaN, inf) as None, as the file logger writes it
    (``null``) and the ``metrics.jsonl`` read back holds it: kept, so that the curves mark the step where a metric
    went NaN rather than draw a line straight across it (and the summary stays JSON)."""
    return {k: (float(v) if math.isfinite(v) else None) if isinstance(v, (int, float)) else None
            for k, v in metrics.items() if v is None or isinstance(v, (int, float))}


def whole_history(result: RunResult, first_resumed: str | Path | None = None, first_step: int = 1) -> list[dict]:
    """Every step's record up to the run's last, in order: after a resume (a retry of the step, or a resume from
    another run's checkpoint) the run's own history holds only the steps it trained, so the earlier ones come
    from the metrics files (``trainer.logger`` with ``file``) of its folder and of the folder resumed from, a
    step's last record in each (a step logged again after a rollback or a resume replaces the first).
    ``first_resumed``: the checkpoint of another run that the step's first attempt resumed from (the configured
    ``trainer.resume_from_path``), where a retry then resumed from this run's own (:func:`resume_own_checkpoint`):
    its folder holds the steps up to it. ``first_step=0``: with the validation before the first step (step 0's
    record, of this run or of the run it resumed from), where one ran."""
    by_step: dict[int, dict] = {}
    sources = []
    resumed_from = [Path(os.path.expanduser(str(path))) for path in (first_resumed, result.resumed_from) if path]
    for resumed in dict.fromkeys(resumed_from):  # (the first attempt's, then the retry's)
        with contextlib.suppress(CheckpointError):  # (no global_step_N: nothing to read up to)
            sources.append((resumed.parent / FileLogger.FILENAME, step_of(resumed)))
    sources.append((Path(result.local_dir) / FileLogger.FILENAME, result.steps))
    for path, last in sources:
        for record in read_metrics(path):
            if first_step <= record["step"] <= last:
                by_step[record["step"]] = {**_numbers(record), "step": record["step"]}
    if first_step == 0 and result.val_before_train:
        by_step[0] = {"step": 0, **_numbers(result.val_before_train)}
    for done in result.history:  # the run's own records, as it holds them
        by_step[done.step] = {"step": done.step, **_numbers(done.metrics)}
    return [by_step[number] for number in sorted(by_step)]


def stable_copy(model: Path, root: Path, key: str) -> Path:
    """``model`` (a HF model folder unpacked from an artifact) copied once to ``<root>/<key>``, the same path for
    every attempt and run that takes the artifact (``key``: ``warm_start/<artifact id>``, or ``reward_model/...``):
    the artifact store unpacks an artifact into a new temporary folder each time (a resume knows the model by its
    content, wherever it is, but one copy on disk beats one per attempt)."""
    target = root / key
    if not (target / "config.json").is_file():
        with staged_directory(target, keep_existing=lambda existing: (existing / "config.json").is_file()) as staging:
            shutil.copytree(model, staging, dirs_exist_ok=True)
    return target


def resume_own_checkpoint(trainer, section: str = "trainer") -> None:
    """A retry of the training step in the same pipeline run: where ``trainer.default_local_dir`` (the run's own
    folder) already holds a checkpoint, an earlier attempt of this run saved it, and this attempt resumes from
    the latest one there (``resume_mode`` becomes ``auto``, with a notice), not from ``trainer.resume_from_path``
    (the earlier run's checkpoint the first attempt resumed from, whose steps it would train again) nor afresh
    (``disable``). ``trainer``: the config's trainer section (or ``reward_model.train``, named by ``section``),
    changed in place."""
    folder = Path(os.path.expanduser(str(trainer.default_local_dir)))
    latest = latest_or_none(folder)
    if latest is None or trainer.resume_mode == "auto":  # (auto resumes from it by itself)
        return
    instead = (f"not from {section}.resume_from_path={trainer.resume_from_path}"
               if trainer.resume_mode == "resume_path" else f"not afresh as {section}.resume_mode=disable says")
    print(f"notice: this run's checkpoint folder {folder} holds {latest.name}, saved by an earlier attempt of this "
          f"step: this retry resumes from its latest checkpoint there, {instead}", file=sys.stderr, flush=True)
    trainer.resume_mode = "auto"


#: what a failed run's message says to do to resume from its latest checkpoint (checkpoint.rerun_advice, then "to
#: resume" or "to resume from it"): advice for a command run again, which in a pipeline starts afresh
RERUN_CLAUSE = re.compile(r"(?:rerun the same command|rerun with (?:trainer|reward_model\.train)\.resume_mode=auto) "
                          r"to resume(?: from it)?")


def pipeline_resume_advice(latest: str | Path, configured_path: str | None = None, section: str = "trainer") -> str:
    """How to go on from ``latest`` (a failed run's checkpoint) when the run was a pipeline step;
    ``configured_path``: the ``trainer.resume_from_path`` of a run configured with ``resume_mode=resume_path``,
    which the pipeline run again as it is resumes from again; ``section``: where those keys are (``trainer``, or
    ``reward_model.train``)."""
    if configured_path is None:
        return (f"add {section}.resume_mode=resume_path and {section}.resume_from_path={latest} to the run config's "
                "overrides, then run the pipeline again, to resume from it (run again as it is, the pipeline starts "
                "afresh in a folder of its own; a retry of this step in this run resumes there by itself)")
    return (f"put {section}.resume_from_path={latest} in the run config's overrides, in place of {configured_path}, "
            "then run the pipeline again, to resume from it (run again as it is, the pipeline resumes from "
            f"{configured_path} again, in a folder of its own; a retry of this step in this run resumes from this "
            "run's latest checkpoint by itself)")


def add_resume_advice(exc: BaseException, local_dir: str | Path, configured_path: str | None = None,
                      section: str = "trainer") -> None:
    """Make ``exc`` (a failed training run inside a pipeline step) say how to go on from the run's latest
    checkpoint, where it has one: a new pipeline run trains in a new folder, so the message's "rerun the same
    command to resume from it" would start afresh (or, with ``configured_path``, the ``trainer.resume_from_path``
    of a run configured with ``resume_mode=resume_path``, resume from that path again). That clause is replaced
    with the pipeline's way (what the version records as its ``failure``), which is also kept as
    ``exc.resume_advice`` (the version's ``advice``); an error that names no way on gets it as a note instead.
    ``section``: the config section whose ``resume_mode`` and ``resume_from_path`` the run reads (``trainer``, or
    ``reward_model.train`` for a reward model's)."""
    latest = latest_or_none(Path(os.path.expanduser(str(local_dir))))
    if latest is None:
        return
    advice = pipeline_resume_advice(latest, configured_path, section)
    args = getattr(exc, "args", ())
    message = str(exc)
    if args and args[0] == message and str(latest) in message and RERUN_CLAUSE.search(message):
        exc.args = (RERUN_CLAUSE.sub(lambda _: advice, message), *args[1:])
        exc.resume_advice = advice
        return
    note = f"The run's latest checkpoint is {latest}: {advice}."
    if hasattr(exc, "add_note"):  # shown under the error's message
        exc.add_note(note)
    else:  # Python 3.10
        print(note, file=sys.stderr, flush=True)
