"""What the training step adds to a run, with no orchestrator in it: the warm-start policy at a path that stays
the same over retries and reruns, the run's whole history across resumes, and the way on after a failure."""

from __future__ import annotations

import math
import re
import shutil
import sys
from pathlib import Path

from rlhf_core.atomic import staged_directory
from rlhf_core.main_ppo import RunResult
from rlhf_core.training.checkpoint import latest_or_none, step_of
from rlhf_core.training.tracking import FileLogger, read_metrics


def _finite(metrics: dict) -> dict[str, float]:
    """The numbers of ``metrics`` that are finite, as floats (what the summary and the curves keep)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def whole_history(result: RunResult) -> list[dict]:
    """Every step's record up to the run's last, in order: after a resume (a retry of the step, or a resume from
    another run's checkpoint) the run's own history holds only the steps it trained, so the earlier ones come
    from the metrics files (``trainer.logger`` with ``file``) of its folder and of the folder resumed from, a
    step's last record in each (a step logged again after a rollback or a resume replaces the first)."""
    by_step: dict[int, dict] = {}
    sources = []
    if result.resumed_from:
        resumed = Path(result.resumed_from)
        sources.append((resumed.parent / FileLogger.FILENAME, step_of(resumed)))
    sources.append((Path(result.local_dir) / FileLogger.FILENAME, result.steps))
    for path, last in sources:
        for record in read_metrics(path):
            if 1 <= record["step"] <= last:
                by_step[record["step"]] = {**_finite(record), "step": record["step"]}
    for done in result.history:  # the run's own records, as it holds them
        by_step[done.step] = {"step": done.step, **_finite(done.metrics)}
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


#: what a failed run's message says to do to resume from its latest checkpoint (checkpoint.rerun_advice, then "to
#: resume" or "to resume from it"): advice for a command run again, which in a pipeline starts afresh
RERUN_CLAUSE = re.compile(r"(?:rerun the same command|rerun with trainer\.resume_mode=auto) to resume(?: from it)?")


def pipeline_resume_advice(latest: str | Path) -> str:
    """How to go on from ``latest`` (a failed run's checkpoint) when the run was a pipeline step."""
    return (f"add trainer.resume_mode=resume_path and trainer.resume_from_path={latest} to the run config's "
            "overrides, then run the pipeline again, to resume from it (run again as it is, the pipeline starts "
            "afresh in a folder of its own; a retry of this step in this run resumes there by itself)")


def add_resume_advice(exc: BaseException, local_dir: str | Path) -> None:
    """Make ``exc`` (a failed training run inside a pipeline step) say how to go on from the run's latest
    checkpoint, where it has one: a new pipeline run trains in a new folder, so the message's "rerun the same
    command to resume from it" would start afresh. That clause is replaced with the pipeline's way (what the
    version records as its ``failure``), which is also kept as ``exc.resume_advice`` (the version's ``advice``);
    an error that names no way on gets it as a note instead."""
    latest = latest_or_none(local_dir)
    if latest is None:
        return
    advice = pipeline_resume_advice(latest)
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
