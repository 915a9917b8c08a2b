"""Check the reward model's preference files before it trains: the Great Expectations preference suite (nulls,
empty or identical texts, duplicate and shared pairs), then that no question has pairs on both sides and that
held-out files hold pairs (the checks rlhf-train-rm's preflight makes too), and that no pair is on a question of
the evaluation prompts (``data.val_files``): the pipeline evaluates the policy on them, and a reward model fitted
on their pairs would carry them into the PPO reward."""

from __future__ import annotations

from typing import Annotated

from zenml import log_metadata, step
from zenml.logger import get_logger

from rlhf_core.config import PPOConfig
from rlhf_core.data.dataset import as_file_list
from rlhf_core.data.preference import (
    PreferenceDataError,
    check_apart_from_prompts,
    check_preference_files,
    counts_line,
)
from rlhf_core.data.validation import validate_preference_files

logger = get_logger(__name__)


@step(enable_cache=False)
def validate_preferences(ppo_config: dict) -> Annotated[str, "preference_fingerprint"]:
    """The SHA-256 of the preference files; stops the run on any problem (named by file and row)."""
    cfg = PPOConfig.from_dict(ppo_config)
    rm = cfg.reward_model.train
    train = as_file_list(rm.train_files)
    val = as_file_list(rm.val_files) if rm.val_files is not None else []
    report = validate_preference_files(train, val or None)
    if not report.success:
        logger.error(report.summary())
        raise PreferenceDataError(report.summary())
    summary = check_preference_files(train, val)
    # validate_data refuses missing evaluation files in the pipelines; a step run on its own names what it skips
    evaluation_files = as_file_list(cfg.data.val_files or [])
    evaluation = [p for p in evaluation_files if p.exists()]
    skipped = [str(p) for p in evaluation_files if not p.exists()]
    if skipped:
        logger.warning("preference pairs not checked against data.val_files %s: not found", ", ".join(skipped))
    if evaluation:
        check_apart_from_prompts(train + val, evaluation, "the evaluation prompts (data.val_files)",
                                 prompt_key=cfg.data.prompt_key)
    log_metadata({"preference_fingerprint": report.fingerprint, **summary})
    logger.info("%s\n  %s", report.summary(), counts_line(summary))
    return report.fingerprint
