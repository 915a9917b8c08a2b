"""Train the reward model on the preference pairs: a versioned MODEL artifact, gated on held-out accuracy."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from zenml import ArtifactConfig, get_step_context, log_metadata, step
from zenml.enums import ArtifactType
from zenml.logger import get_logger

from rlhf_core.config import PPOConfig
from rlhf_core.data.dataset import as_file_list
from rlhf_core.data.validation import check_unchanged
from rlhf_core.pipeline.training import add_resume_advice, resume_own_checkpoint
from rlhf_core.training.reward_trainer import NothingTrainedError, pair_accuracy_gate
from rlhf_core.training.reward_trainer import train_reward_model as train

logger = get_logger(__name__)


class RewardModelGateError(RuntimeError):
    """The reward model ranks too few held-out pairs correctly to train a policy against."""


@step(enable_cache=False)
def train_reward_model(
    ppo_config: dict,
    preference_fingerprint: str,
    min_pair_accuracy: float | None = None,
) -> tuple[
    Annotated[Path, ArtifactConfig(name="reward_model", artifact_type=ArtifactType.MODEL)],
    Annotated[dict, "reward_model_summary"],
]:
    """The HF directory of the trained reward model; stops the run (before PPO) below ``min_pair_accuracy``
    (default ``reward_model.train.min_pair_accuracy``)."""
    cfg = PPOConfig.from_dict(ppo_config)
    rm = cfg.reward_model.train
    # the pairs validate_preferences checked and recorded, not files replaced since (as train_ppo holds its data)
    check_unchanged(as_file_list(rm.train_files), as_file_list(rm.val_files) if rm.val_files is not None else None,
                    preference_fingerprint, "train_reward_model")
    rm.default_local_dir = str(Path(rm.default_local_dir) / get_step_context().pipeline_run.name)
    threshold = rm.min_pair_accuracy if min_pair_accuracy is None else min_pair_accuracy
    # the earlier run's checkpoint this run was set to resume from: a retry resumes from this run's own instead
    configured_path = rm.resume_from_path if rm.resume_mode == "resume_path" else None
    resume_own_checkpoint(rm, "reward_model.train")
    try:
        export, val = train(cfg)
    except Exception as exc:
        # its "rerun" would be a new run, in a new folder (resuming from configured_path again, where there is one);
        # checkpoints whose steps took no update are no way on: the message says to start anew, as a new run does
        if not isinstance(exc, NothingTrainedError):
            add_resume_advice(exc, rm.default_local_dir, configured_path, "reward_model.train")
        raise
    passed, reason = pair_accuracy_gate(val, threshold, "reward_model.train.min_pair_accuracy"
                                        if min_pair_accuracy is None else "the pipeline's min_pair_accuracy")
    summary = {"held_out_pair_accuracy": val.get("val/pair_accuracy"), "held_out_loss": val.get("val/loss"),
               "held_out_margin_mean": val.get("val/margin_mean"),
               # the scale PPO's rewards will have: the loss fixes neither offset nor spread of the scores
               "held_out_score_min": val.get("val/score_min"), "held_out_score_max": val.get("val/score_max"),
               # pairs with a side over max_length: cut to one prompt window, or left out (reward_model.train.overlong)
               "pairs_over_max_length": val.get("train/pairs_over_max_length"),
               "held_out_pairs_over_max_length": val.get("val/pairs_over_max_length"), "overlong": rm.overlong,
               "min_pair_accuracy": threshold,
               "passed": passed, "reason": reason, "preference_fingerprint": preference_fingerprint,
               "base_model": rm.model.path, "local_dir": rm.default_local_dir}
    log_metadata({k: v for k, v in summary.items() if v is not None})
    if not passed:
        logger.error(reason)
        raise RewardModelGateError(reason)
    logger.info(reason)
    return export, summary
