"""The retraining's last step: a run that skipped training keeps no model version.

ZenML makes the run's model version as the run starts, before the gate (``check_new_data``) can say there is
nothing to train; a nightly retraining with nothing new would otherwise leave one empty version a night in the
Model Control Plane. Once promote has recorded its refusal, this step deletes that version. The run keeps why: it
is tagged ``skipped``, its metadata holds the reason (``skipped``) and the production version it was compared
with, and the gate's, training's and promotion's steps keep their own records and artifacts.
"""

from __future__ import annotations

from zenml import add_tags, get_step_context, log_metadata, step
from zenml.client import Client
from zenml.logger import get_logger

logger = get_logger(__name__)

SKIPPED_TAG = "skipped"  # on a retraining run that trained nothing


@step(enable_cache=False)
def discard_skipped_version(promotion_decision: dict) -> None:
    """Delete this run's model version where its training was skipped (``promotion_decision["skipped"]``) and
    record the reason on the run; a run that trained keeps its version untouched. The step has no output, so that
    nothing is linked to the version after it is gone."""
    reason = promotion_decision.get("skipped")
    if not reason:
        return
    context = get_step_context()
    model, run = context.model, context.pipeline_run
    record = {"skipped": reason, "model": model.name, "model_version": "none kept (training was skipped)",
              "production_version": promotion_decision.get("previous_production_version")}
    log_metadata({key: value for key, value in record.items() if value is not None}, run_id_name_or_prefix=run.id)
    add_tags(tags=[SKIPPED_TAG], run=run.id)
    Client().delete_model_version(model.id)
    logger.info("model %s: no version kept for run %s, which trained nothing: %s", model.name, run.name, reason)
