"""The retraining gate: is there new data since the production version was trained?"""

from __future__ import annotations

from typing import Annotated

from zenml import get_step_context, log_metadata, step
from zenml.client import Client
from zenml.enums import ModelStages
from zenml.logger import get_logger

logger = get_logger(__name__)


class NoProductionModelError(LookupError):
    """Retraining warm-starts from production; there is none yet."""


@step(enable_cache=False)
def check_new_data(dataset_fingerprint: str) -> Annotated[str, "skip_reason"]:
    """An empty string when the data changed since production was trained, else why training is skipped."""
    model_name = get_step_context().model.name
    try:
        production = Client().get_model_version(model_name, ModelStages.PRODUCTION)
    except KeyError:
        raise NoProductionModelError(
            f"model {model_name!r} has no production version to warm-start from; run the training pipeline "
            "first: zenml pipeline run pipelines.rlhf_ppo.rlhf_ppo_pipeline -c configs/demo_cpu.yaml") from None
    trained_on = production.run_metadata.get("dataset_fingerprint")
    if trained_on == dataset_fingerprint:
        reason = (f"the data is unchanged since production version {production.name} was trained "
                  f"(dataset fingerprint {dataset_fingerprint[:16]}...)")
        logger.warning("retraining skipped: %s", reason)
    else:
        reason = ""
        logger.info("new data (fingerprint %s..., production version %s was trained on %s...): retraining from "
                    "its checkpoint", dataset_fingerprint[:16], production.name, str(trained_on)[:16])
    log_metadata({"production_version": production.name, "production_fingerprint": str(trained_on),
                  "dataset_fingerprint": dataset_fingerprint, "skipped": bool(reason), "reason": reason or "new data"})
    return reason
