"""RLHF from preferences: validate data and preferences -> train reward model -> smoke test -> PPO against
the reward model -> evaluate -> promote.

    zenml pipeline run pipelines.rlhf_rm.rlhf_rm_pipeline -c configs/demo_rm_cpu.yaml

The reward model is trained from ``reward_model.train.*`` of the trainer config (its preference files,
base model, batch sizes) and handed to PPO as a MODEL artifact; the run stops before PPO when its
held-out pair accuracy is below ``min_pair_accuracy`` (``reward_model.train.min_pair_accuracy`` when
not given); the pairs must be on none of the evaluation prompts' questions (``data.val_files``: the reward
model would carry them into the PPO reward). The rule reward is still defined and self-checked: evaluation
measures the policy with it (the gold reward), while PPO optimises the learned one (the proxy).
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
from steps.train_reward_model import train_reward_model
from steps.validate_data import validate_data
from steps.validate_preferences import validate_preferences

DEFAULT_MODEL = Model(name="rlhf-rm-policy", description="policy trained with PPO against a learned reward model")


@checked_parameters  # a parameter it does not take, or of a wrong type: refused by name
@pipeline(model=DEFAULT_MODEL, enable_cache=False, execution_mode=ExecutionMode.FAIL_FAST,
          on_failure=mark_failed_version)
def rlhf_rm_pipeline(
    trainer_config: str = "configs/ppo_demo_cpu.yaml",
    overrides: list[str] | None = None,
    train_files: str | list[str] | None = None,
    val_files: str | list[str] | None = None,
    min_pair_accuracy: float | None = None,
    min_improvement: float = 0.0,
    alpha: float = 0.05,
) -> None:
    """Train a reward model, then a new version of the run config's model against it; promote on gold gains."""
    # while the pipeline compiles: before the run, its model version or any step
    check_run_config(trainer_config, overrides, train_files, val_files, min_improvement, alpha,
                     trains_reward_model=True, min_pair_accuracy=min_pair_accuracy)
    ppo_config = load_ppo_config(trainer_config, overrides, train_files, val_files, run_nonce=uuid.uuid4().hex,
                                 trains_reward_model=True)
    _, _, dataset_fingerprint = validate_data(ppo_config)
    preference_fingerprint = validate_preferences(ppo_config)
    reward_model, _ = train_reward_model(ppo_config, preference_fingerprint, min_pair_accuracy=min_pair_accuracy)
    reward_spec = define_reward(ppo_config, dataset_fingerprint, after="train_reward_model")
    smoke_report = smoke_test(ppo_config, reward_spec, reward_model=reward_model)
    checkpoint, training_summary, _ = train_ppo(ppo_config, smoke_report, reward_model=reward_model,
                                                reward_spec=reward_spec)
    evaluation, _, _ = evaluate(ppo_config, checkpoint, training_summary, reward_spec)
    promote(evaluation, dataset_fingerprint, reward_spec, smoke_report, min_improvement=min_improvement, alpha=alpha)


if __name__ == "__main__":  # (importing the module defines the pipeline; ZenML's command runs it)
    run_by_zenml(__spec__.name, "rlhf_rm_pipeline")
