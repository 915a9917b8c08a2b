"""What the training step adds to a run, with no orchestrator in it: the warm-start policy at a path that stays
the same over retries and reruns, the run's whole history across resumes, and the way on after a failure."""

from __future__ import annotations

import math
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


def add_resume_advice(exc: BaseException, local_dir: str | Path) -> None:
    """Note on ``exc`` (a failed training run inside a pipeline step) how to go on from the run's latest
    checkpoint, where it has one: its message says to rerun, but a new pipeline run trains in a new folder."""
    latest = latest_or_none(local_dir)
    if latest is None:
        return
    advice = (f"In a pipeline each run trains in a folder of its own, so running the pipeline again starts afresh: "
              f"to go on from {latest}, add trainer.resume_mode=resume_path and trainer.resume_from_path={latest} to "
              "the run config's overrides (a retry of this step in this run resumes there by itself).")
    if hasattr(exc, "add_note"):  # shown under the error's message
        exc.add_note(advice)
    else:  # Python 3.10
        print(advice, file=sys.stderr, flush=True)
