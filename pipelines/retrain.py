"""Retraining: the training pipeline, warm-started from the production version's checkpoint.

    zenml pipeline run pipelines.retrain.rlhf_retrain_pipeline -c configs/retrain_demo.yaml
    rlhf-schedule --cron "0 3 * * *" -c configs/retrain_demo.yaml      # every night at 03:00

When the data's fingerprint, the trainer config's and the reward's equal those production was trained with, or a
version already trained on this data from the current production version with the same trainer config, reward
and evaluation settings was refused on a gain and p-value that fail this run's gate too, ``check_new_data`` says
so and the smoke
test, training and evaluation are skipped; nothing is promoted, and the model version ZenML made as the run started is
deleted at the end (``discard_skipped_version``): the run, tagged ``skipped``, records why. ``force: true`` (a
pipeline parameter) trains anyway.
"""

from __future__ import annotations

import uuid

from zenml import Model, get_pipeline_context, pipeline
from zenml.enums import ExecutionMode, ModelStages

from pipelines.rlhf_ppo import DEFAULT_MODEL
from rlhf_core.pipeline.checked import checked_parameters, run_by_zenml
from rlhf_core.pipeline.failure import mark_failed_version
from rlhf_core.pipeline.run_config import RunConfigError, check_run_config
from steps.check_new_data import check_new_data, check_production_exists, reused_version
from steps.define_reward import define_reward
from steps.discard_skipped_version import discard_skipped_version
from steps.evaluate import evaluate
from steps.load_ppo_config import load_ppo_config
from steps.promote import promote
from steps.smoke_test import smoke_test
from steps.train_ppo import train_ppo
from steps.validate_data import validate_data


@checked_parameters  # a parameter it does not take, or of a wrong type: refused by name
@pipeline(model=DEFAULT_MODEL, enable_cache=False, execution_mode=ExecutionMode.FAIL_FAST,
          on_failure=mark_failed_version)
def rlhf_retrain_pipeline(
    trainer_config: str = "configs/ppo_demo_cpu.yaml",
    overrides: list[str] | None = None,
    train_files: str | list[str] | None = None,
    val_files: str | list[str] | None = None,
    min_improvement: float = 0.0,
    alpha: float = 0.05,
    force: bool = False,
) -> None:
    """Train a new version from the production checkpoint on new data; skip when the data is unchanged or this
    training was already done and refused, unless ``force``."""
    # while the pipeline compiles: before the run, its model version or any step
    check_run_config(trainer_config, overrides, train_files, val_files, min_improvement, alpha)
    model = get_pipeline_context().model
    model_name = model.name
    if problem := reused_version(model_name, model.version):  # a skipped run would delete the version it reused
        raise RunConfigError(problem)
    check_production_exists(model_name)  # the warm start: refused now, not after two steps and a failed version
    production = Model(name=model_name, version=ModelStages.PRODUCTION)
    ppo_config = load_ppo_config(trainer_config, overrides, train_files, val_files, run_nonce=uuid.uuid4().hex)
    _, _, dataset_fingerprint = validate_data(ppo_config)
    reward_spec = define_reward(ppo_config, dataset_fingerprint)
    skip_reason = check_new_data(dataset_fingerprint, ppo_config, reward_spec, min_improvement=min_improvement,
                                 alpha=alpha, force=force)
    # production's checkpoint, resolved once, when the smoke test starts: its report names the artifact and
    # train_ppo starts from that one, so that a version promoted between the two steps cannot make training start
    # from a checkpoint that was not dry-run
    warm_start = production.get_model_artifact("ppo_checkpoint")
    smoke_report = smoke_test(ppo_config, reward_spec, skip_reason=skip_reason, init_from=warm_start)
    checkpoint, training_summary, _ = train_ppo(ppo_config, smoke_report, skip_reason=skip_reason,
                                                reward_spec=reward_spec)
    evaluation, _, _ = evaluate(ppo_config, checkpoint, training_summary, reward_spec, skip_reason=skip_reason)
    decision = promote(evaluation, dataset_fingerprint, reward_spec, smoke_report, min_improvement=min_improvement,
                       alpha=alpha, skip_reason=skip_reason)
    discard_skipped_version(decision)  # a run that trained nothing leaves no empty model version


if __name__ == "__main__":  # (importing the module defines the pipeline; ZenML's command runs it)
    run_by_zenml(__spec__.name, "rlhf_retrain_pipeline", " (or on a schedule: rlhf-schedule)")
