"""Greedy accuracy of the trained policy, the base model and production, problem by problem."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import pandas as pd
import torch
from pydantic import NonNegativeInt, PositiveInt
from zenml import get_step_context, log_metadata, step
from zenml.client import Client
from zenml.enums import ModelStages
from zenml.logger import get_logger
from zenml.types import HTMLString

from rlhf_core import stats
from rlhf_core.config import PPOConfig
from rlhf_core.data.dataset import as_file_list
from rlhf_core.data.validation import check_unchanged
from rlhf_core.models.loading import import_external_lib
from rlhf_core.pipeline.evaluate import (
    VAL_FINGERPRINT_VERSION,
    EvalResult,
    NoticesOnce,
    ProductionPairing,
    changed_problems,
    check_reward_unchanged,
    evaluate_policy,
    evaluation_html,
    pair_with_production,
    per_problem_table,
    training_curves_png,
)
from rlhf_core.pipeline.evaluate import reward_spec as reward_spec_of
from rlhf_core.pipeline.promotion import scoring_settings
from rlhf_core.rewards import custom_reward_fn

logger = get_logger(__name__)


def _production_version(model_name: str):
    """The model's production version, None if it has none."""
    try:
        return Client().get_model_version(model_name, ModelStages.PRODUCTION)
    except KeyError:
        return None


@step(enable_cache=False)
def evaluate(
    ppo_config: dict,
    ppo_checkpoint: Path,
    training_summary: dict,
    reward_spec: dict | None = None,
    skip_reason: str = "",
    batch_size: PositiveInt = 64,  # typed so that ZenML refuses a bad value as the run compiles, not after training
    max_problems: PositiveInt | None = None,
    sample_seed: NonNegativeInt = 0,
) -> tuple[
    Annotated[dict, "evaluation"],
    Annotated[HTMLString, "evaluation_report"],
    Annotated[pd.DataFrame, "per_problem"],
]:
    """Base model and trained policy on the same (capped, stratified) problems, paired with production's
    results when it was evaluated on them and scored alike, else with its checkpoint evaluated here; an HTML
    report and the per-problem table. ``reward_spec`` (the artifact of define_reward) is the reward the run
    pinned down: a reward changed since stops the step."""
    if skip_reason:
        logger.info("evaluation skipped: %s", skip_reason)
        return ({"skipped": skip_reason}, HTMLString(f"<p>Evaluation skipped: {skip_reason}</p>"),
                pd.DataFrame({"skipped": [skip_reason]}))
    cfg = PPOConfig.from_dict(ppo_config)
    check_unchanged(as_file_list(cfg.data.train_files), as_file_list(cfg.data.val_files),
                    training_summary.get("dataset_fingerprint"), "evaluate")
    spec = check_reward_unchanged(cfg, reward_spec, "evaluate") if reward_spec is not None else reward_spec_of(cfg)
    model = cfg.actor_rollout_ref.model
    import_external_lib(model.external_lib)  # registers a custom architecture, as the trainer's workers import it
    kwargs = {
        "data_config": cfg.data,
        "batch_size": batch_size,
        "reward_fn": custom_reward_fn(cfg),
        "device": "cuda" if cfg.trainer.device == "cuda" and torch.cuda.is_available() else "cpu",
        "dtype": model.dtype,
        "max_problems": max_problems,
        "sample_seed": sample_seed,
        "val_kwargs": cfg.actor_rollout_ref.rollout.val_kwargs,
        "seed": cfg.trainer.seed,
        "override_config": dict(model.override_config),  # the base model as training loaded it
        "trust_remote_code": model.trust_remote_code,  # a policy whose architecture is code in its folder
    }
    once = NoticesOnce()  # each model's evaluation reads the data: its notices said by the first alone

    def evaluate(path: str, **extra) -> EvalResult:
        with once.said():
            return evaluate_policy(path, cfg.data.val_files, **kwargs, **extra)

    base_model = model.path
    base = evaluate(base_model, tokenizer_path=model.tokenizer_path, label="base model")
    policy = evaluate(ppo_checkpoint, label="trained policy")
    budget = (f"{policy.n} of {policy.total_problems} validation problems"
              f"{' (max_problems, stratified by data source)' if policy.n < policy.total_problems else ''}: "
              f"an accuracy near 50% is known to +-{stats.half_width(policy.n):.1%} (95%)")
    logger.info("evaluating on %s", budget)

    candidate = {"val_fingerprint": policy.val_fingerprint, "val_fingerprint_version": VAL_FINGERPRINT_VERSION,
                 "problems": {p["id"]: p["correct"] for p in policy.problems},
                 "scoring": scoring_settings(spec["sha256"], cfg.data, dtype=kwargs["dtype"], device=kwargs["device"],
                                             override_config=kwargs["override_config"], batch_size=batch_size)}
    production_version = _production_version(get_step_context().model.name)
    version = production_version.name if production_version is not None else None
    pairing = ProductionPairing()
    if production_version is not None:
        record, checkpoint = (production_version.get_artifact(name) for name in ("evaluation", "ppo_checkpoint"))
        pairing = pair_with_production(candidate, version, record.load if record is not None else None,
                                       checkpoint.load if checkpoint is not None else None,
                                       lambda path: evaluate(path, label=f"production version {version}"))
        if pairing.reevaluated:
            logger.info("production version %s: %s; its checkpoint was evaluated on these problems", version,
                        pairing.reevaluated)
        elif pairing.refusal:
            logger.warning("production version %s cannot be compared: %s", version, pairing.refusal)
    production_results, refusal, reevaluated = pairing.results, pairing.refusal, pairing.reevaluated
    table = per_problem_table(policy, base, production_results)
    results = {"base model": base}
    if pairing.result is not None:
        results[f"production (version {version})"] = pairing.result
    results["trained policy"] = policy
    baseline = "production" if production_results is not None else "base"
    changed = changed_problems(table, baseline)
    logger.info("greedy accuracy on %d prompts: trained %.2f%% vs base %.2f%%; fixed %d, broke %d against the %s",
                policy.n, 100 * policy.accuracy, 100 * base.accuracy, changed["n_fixed"], changed["n_broken"], baseline)
    evaluation = {
        "accuracy": policy.accuracy, "accuracy_ci": list(policy.interval), "base_accuracy": base.accuracy,
        "base_accuracy_ci": list(base.interval), "n": policy.n, "total_problems": policy.total_problems,
        "base_model": base_model, "policy": policy.to_dict(with_problems=False), "base": base.to_dict(False),
        **candidate, "base_problems": {p["id"]: p["correct"] for p in base.problems},
        "production_version": version, "production_results": production_results, "production_refusal": refusal,
        "production_reevaluated": reevaluated, "changed": changed,
    }
    log_metadata({"accuracy": policy.accuracy, "accuracy_ci": list(policy.interval), "base_accuracy": base.accuracy,
                  "n": policy.n, "per_source": policy.per_source, "val_fingerprint": policy.val_fingerprint,
                  "budget": budget, "fixed": changed["fixed"], "broken": changed["broken"],
                  "n_fixed": changed["n_fixed"], "n_broken": changed["n_broken"], "compared_with": baseline,
                  **policy.sampled})
    notes = [f"Evaluated on {budget}."]
    if refusal:
        notes.append(f"Production cannot be compared: {refusal}")
    if reevaluated:
        notes.append(f"Production's checkpoint was evaluated in this run: its stored results did not pair with "
                     f"these ({reevaluated}).")
    before = training_summary.get("val_before_train")  # step 0: the accuracy the validation curve starts from
    curves = training_curves_png(([before] if before else []) + training_summary.get("history", []))
    report = evaluation_html(results, curves, changed=changed,
                             baseline_name=f"production version {version}" if baseline == "production" else "base model",
                             notes=notes)
    return evaluation, HTMLString(report), table
