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
from zenml.enums import ModelStages
from zenml.logger import get_logger
from zenml.utils.pagination_utils import depaginate

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
    if kept := not_this_runs_own(Client(), model.id, run.id):
        logger.warning("model %s: version %s kept (%s), though run %s trained nothing: %s", model.name, model.version,
                       kept, run.name, reason)
        return
    Client().delete_model_version(model.id)
    logger.info("model %s: no version kept for run %s, which trained nothing: %s", model.name, run.name, reason)


def not_this_runs_own(client: Client, version_id, run_id) -> str | None:
    """Why the model version ``version_id`` is not one the run ``run_id`` made and may delete, or None: it holds a
    stage, or another run is linked to it (a run config's ``model.version`` that named an existing version, which
    the retraining pipeline refuses as it compiles; this is the last look before a deletion)."""
    version = client.get_model_version(model_version_name_or_number_or_id=version_id)
    if version.stage not in (None, ModelStages.NONE.value):
        return f"it is the {version.stage} version"
    links = depaginate(client.list_model_version_pipeline_run_links, model_version_id=version_id)
    others = sorted({link.pipeline_run.name for link in links if link.pipeline_run.id != run_id})
    return f"runs before this one made it: {', '.join(others)}" if others else None
