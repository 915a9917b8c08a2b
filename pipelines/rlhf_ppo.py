"""The training pipeline: validate data -> define reward -> smoke test -> train -> evaluate -> promote.

    zenml pipeline run pipelines.rlhf_ppo.rlhf_ppo_pipeline -c configs/demo_cpu.yaml

The run config names the model (``model.name``), the trainer config and its overrides, and the
data (``parameters.train_files`` / ``val_files``), so the same pipeline trains on any data.
"""

from __future__ import annotations

import uuid

from zenml import Model, pipeline
from zenml.enums import ExecutionMode

from rlhf_core.pipeline.checked import checked_parameters, run_by_zenml
from rlhf_core.pipeline.failure import mark_failed_version
from rlhf_core.pipeline.run_config import check_run_config
from steps.define_reward import define_reward
from steps.evaluate import evaluate
from steps.load_ppo_config import load_ppo_config
from steps.promote import promote
from steps.smoke_test import smoke_test
from steps.train_ppo import train_ppo
from steps.validate_data import validate_data

DEFAULT_MODEL = Model(name="rlhf-ppo-policy", description="PPO-trained policy (rlhf_ppo_pipeline)")


@checked_parameters  # a parameter it does not take, or of a wrong type: refused by name
@pipeline(model=DEFAULT_MODEL, enable_cache=False, execution_mode=ExecutionMode.FAIL_FAST,
          on_failure=mark_failed_version)
def rlhf_ppo_pipeline(
    trainer_config: str = "configs/ppo_demo_cpu.yaml",
    overrides: list[str] | None = None,
    train_files: str | list[str] | None = None,
    val_files: str | list[str] | None = None,
    min_improvement: float = 0.0,
    alpha: float = 0.05,
) -> None:
    """Train a new version of the run config's model and promote it if it beats production."""
    # while the pipeline compiles: before the run, its model version or any step
    check_run_config(trainer_config, overrides, train_files, val_files, min_improvement, alpha)
    ppo_config = load_ppo_config(trainer_config, overrides, train_files, val_files, run_nonce=uuid.uuid4().hex)
    _, _, dataset_fingerprint = validate_data(ppo_config)
    reward_spec = define_reward(ppo_config, dataset_fingerprint)
    smoke_report = smoke_test(ppo_config, reward_spec)
    checkpoint, training_summary, _ = train_ppo(ppo_config, smoke_report, reward_spec=reward_spec)
    evaluation, _, _ = evaluate(ppo_config, checkpoint, training_summary, reward_spec)
    promote(evaluation, dataset_fingerprint, reward_spec, smoke_report, min_improvement=min_improvement, alpha=alpha)


if __name__ == "__main__":  # (importing the module defines the pipeline; ZenML's command runs it)
    run_by_zenml(__spec__.name, "rlhf_ppo_pipeline")
