"""The pipelines' failure hook: a run that fails leaves its model version marked, not blank.

Every pipeline run makes a model version as it starts. Without a mark, the version of a run that failed looks,
in the Model Control Plane, like one still in progress or one whose promotion was never decided. ZenML calls
this hook once a step has failed for good (not on an attempt that a step retry then repeats), so the version
gets the tag ``failed`` and metadata naming the step and the error.
"""

from __future__ import annotations

from zenml import get_step_context, log_metadata
from zenml.client import Client
from zenml.logger import get_logger

logger = get_logger(__name__)

FAILED_TAG = "failed"
MAX_ERROR_CHARS = 1500  # room for a failed training's way on, which names its checkpoint twice (and, in a run set
# to resume from an earlier run's, that one twice too)


def _clipped(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def failure_record(step_name: str, exception: BaseException, run_name: str, run_id: str) -> dict[str, str]:
    """What the model version records of a failed run: the step, the error's first line(s), and the run; and
    ``advice``, how to go on, where the error says it apart from its message: its ``resume_advice`` (how a failed
    training in a pipeline goes on from its checkpoint, also in its message, where "rerun the same command" was)
    and the notes on it."""
    record = {"failed_step": step_name, "failure": _clipped(f"{type(exception).__name__}: {exception}".strip()),
              "pipeline_run": run_name, "pipeline_run_id": run_id}
    advice = getattr(exception, "resume_advice", None)
    ways = ([advice] if isinstance(advice, str) else []) + [str(note) for note in getattr(exception, "__notes__", ())]
    if ways:
        record["advice"] = _clipped(" ".join(ways))
    return record


def mark_failed_version(exception: BaseException) -> None:
    """ZenML failure hook (``on_failure`` of the pipelines): tag the run's model version ``failed`` and record
    the step and the error on it. It never raises: the step's own error is the one the user must see."""
    try:
        context = get_step_context()
        model = context.model
        record = failure_record(context.step_run.name, exception, context.pipeline_run.name,
                                str(context.pipeline_run.id))
        log_metadata(record, infer_model=True)
        Client().update_model_version(model.model_id, model.id, add_tags=[FAILED_TAG])
        logger.info("model %s version %s marked %r: step %s failed", model.name, model.version, FAILED_TAG,
                    record["failed_step"])
    except Exception as hook_error:  # noqa: BLE001 - a broken mark must not hide the failure itself
        logger.warning("could not mark the model version as failed: %s", hook_error)
