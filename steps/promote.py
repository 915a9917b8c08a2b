"""Promote the new model version to production when it beats the current one significantly; record why.

A promotion is recorded on the version as pending (``promotion: pending``, the decision and its figures), then the
stage is set, then the record is marked done (``promoted: true``, ``promotion: done``); a refusal is recorded
once (``promoted: false``). A retry of the step after an attempt that set the stage but stopped before marking the
record done finishes that promotion (:func:`pending_promotion`) rather than deciding again.
"""

from __future__ import annotations

from typing import Annotated

from zenml import get_step_context, log_metadata, step
from zenml.client import Client
from zenml.enums import ModelStages
from zenml.logger import get_logger

from rlhf_core.pipeline.promotion import PROMOTION, decide_from_evaluation

logger = get_logger(__name__)

SKIPPED_TAG = "skipped"  # on a version whose run skipped training (retraining with nothing new)
#: a comparison's figures on the version's record, and what a refusal without a comparison writes over those an
#: earlier attempt recorded
COMPARISON_FIGURES = ("gain", "gain_ci", "p_value", "baseline_accuracy")
NO_COMPARISON = "none (refused without a comparison)"


def _production(client: Client, model_name: str):
    try:
        return client.get_model_version(model_name, ModelStages.PRODUCTION)
    except KeyError:  # no version has been promoted yet
        return None


def decide_against_production(client: Client, model_name: str, evaluation: dict, min_improvement: float,
                              alpha: float, skip_reason: str = ""):
    """(the decision, the production version it was made against). A promotion is decided again when production
    changed after the first look (another run promoted meanwhile): the evaluation was paired with another
    version, so that decision is a refusal."""
    production = _production(client, model_name)
    decision = decide_from_evaluation(evaluation, production.name if production else None,
                                      min_improvement=min_improvement, alpha=alpha, skipped_reason=skip_reason or None)
    if decision.promote:  # look again right before the stage changes (another version promoted, or this one archived)
        now = _production(client, model_name)
        if (now.id if now else None) != (production.id if production else None):
            return decide_from_evaluation(evaluation, now.name if now else None, min_improvement=min_improvement,
                                          alpha=alpha), now
    return decision, production


def pending_promotion(client: Client, model, evaluation: dict, min_improvement: float, alpha: float):
    """The promotion an earlier attempt of this step carried out, decided again against the production version its
    record names; None where there is none (this version is not production, or production with no record of its
    own promotion, pending or done).

    A retry after the stage was set finds this version in production, its record pending, or done where the attempt
    failed after marking it (logging the step's metadata, storing its output): decided against production now
    (itself), the evaluation, paired with the version it replaced, reads as "production changed during this run" and
    a refusal would be written over a production version. The evaluation and the gate are the first attempt's, so
    the decision against the version it recorded is that attempt's decision."""
    production = _production(client, model.name)
    if (production is None or production.id != model.id
            or production.run_metadata.get(PROMOTION) not in ("pending", "done")):
        return None
    replaced = production.run_metadata.get("previous_production_version")
    decision = decide_from_evaluation(evaluation, replaced, min_improvement=min_improvement, alpha=alpha)
    if not decision.promote:  # not this run's evaluation and gate: the record stays pending, for readers to see
        raise RuntimeError(f"model {model.name} version {production.name} is production with a pending promotion, "
                           f"but this evaluation against {replaced or 'the base model'} does not promote it: "
                           f"{decision.reason}")
    return decision


def _run_artifacts(client: Client, run_id) -> dict[str, str]:
    """``artifact name -> artifact version id`` for every output of this run so far."""
    run = client.get_pipeline_run(run_id)
    return {artifact.artifact.name: str(artifact.id)
            for step_run in run.steps.values() for outputs in step_run.outputs.values() for artifact in outputs}


@step(enable_cache=False)
def promote(
    evaluation: dict,
    dataset_fingerprint: str,
    reward_spec: dict,
    smoke_report: dict,
    min_improvement: float = 0.0,
    alpha: float = 0.05,
    skip_reason: str = "",
) -> Annotated[dict, "promotion_decision"]:
    """Compare with production (or, for the first version, the base model) on the same problems and
    set the stage when the gain is large enough and significant at ``alpha``."""
    context = get_step_context()
    model, client = context.model, Client()
    # a retry after an earlier attempt set the stage finishes that promotion rather than deciding again
    confirmed = None if skip_reason else pending_promotion(client, model, evaluation, min_improvement, alpha)
    if confirmed is not None:
        decision, replaced = confirmed, confirmed.production_version
    else:
        decision, production = decide_against_production(client, model.name, evaluation, min_improvement, alpha,
                                                         skip_reason)
        replaced = production.name if production else None
    artifacts = _run_artifacts(client, context.pipeline_run.id)
    record = {
        "promoted": decision.promote,
        "decision_reason": decision.reason,
        "baseline": decision.baseline,
        "baseline_accuracy": decision.baseline_accuracy,
        "previous_production_version": replaced,
        "min_improvement": min_improvement,
        "alpha": alpha,
        "p_value": decision.comparison.p_value if decision.comparison else None,
        "gain": decision.comparison.gain if decision.comparison else None,
        "gain_ci": [decision.comparison.ci_low, decision.comparison.ci_high] if decision.comparison else None,
        "val_fingerprint": evaluation.get("val_fingerprint"),
        "accuracy": evaluation.get("accuracy"),
        "base_accuracy": evaluation.get("base_accuracy"),
        "dataset_fingerprint": dataset_fingerprint,
        "reward_sha256": reward_spec.get("sha256"),
        "smoke_test_passed": smoke_report.get("passed"),
        "checkpoint_artifact_id": artifacts.get("ppo_checkpoint"),
        "pipeline_run": context.pipeline_run.name,
        "pipeline_run_id": str(context.pipeline_run.id),
        "artifact_ids": artifacts,
    }
    if skip_reason:
        record["skipped"] = skip_reason
        # its ppo_checkpoint is a note, not a model: the tag marks the version until the retraining's last step
        # (discard_skipped_version) deletes it, and keeps it marked where that step does not get to run
        client.update_model_version(model.model_id, model.id, add_tags=[SKIPPED_TAG])
    record = {key: value for key, value in record.items() if value is not None}
    if confirmed is not None:
        # the decision and figures were recorded pending by the attempt that set the stage
        logger.info("model %s version %s: production since an earlier attempt of this step set the stage; its "
                    "promotion is marked done", model.name, model.version)
        log_metadata({"promoted": True, PROMOTION: "done"}, infer_model=True)
    elif decision.promote:
        # the decision first, as pending, then the stage, then the record marked done: a run that stops anywhere
        # between leaves "pending", which readers compare with the stage (stage_disagreement), and never a
        # production version without its reason or a record of a promotion that did not happen
        log_metadata({**{key: value for key, value in record.items() if key != "promoted"}, PROMOTION: "pending"},
                     infer_model=True)
        # force archives the version compared against; without one, a newcomer makes this fail
        model.set_stage(ModelStages.PRODUCTION, force=replaced is not None)
        log_metadata({"promoted": True, PROMOTION: "done"}, infer_model=True)
    else:
        earlier = client.get_model_version(model.name, model.id).run_metadata
        if earlier.get(PROMOTION) == "pending":
            # an earlier attempt of this step decided a promotion and stopped before the stage was set; this one
            # refuses (production changed since): the record says so, not that a promotion is still pending, and
            # the figures of that attempt's comparison, which this refusal has none of, are written over (the
            # metadata store keeps the last value a key was given, and takes no null)
            record[PROMOTION] = "refused"
            record.update({key: NO_COMPARISON for key in COMPARISON_FIGURES if key in earlier and key not in record})
        log_metadata(record, infer_model=True)
    log_metadata({"promoted": decision.promote, "decision_reason": decision.reason})
    logger.info("model %s version %s: %s", model.name, model.version, decision.reason)
    return {**record, "model": model.name, "version": str(model.version), **decision.to_dict()}
