"""Check the training and validation parquet with the Great Expectations suite before any model loads."""

from __future__ import annotations

from typing import Annotated

from zenml import log_metadata, save_artifact, step
from zenml.logger import get_logger
from zenml.types import HTMLString

from rlhf_core.config import PPOConfig
from rlhf_core.data.dataset import as_file_list
from rlhf_core.data.validation import validate_dataset
from rlhf_core.pipeline.evaluate import ground_truth_needs

logger = get_logger(__name__)


class DataValidationError(ValueError):
    """At least one expectation failed; the message lists them with example rows."""


@step(enable_cache=False)
def validate_data(ppo_config: dict) -> tuple[
    Annotated[dict, "validation_result"],
    Annotated[HTMLString, "validation_report"],
    Annotated[str, "dataset_fingerprint"],
]:
    """The suite's result, its HTML report and the SHA-256 of the data files; fails on any failed expectation."""
    cfg = PPOConfig.from_dict(ppo_config)
    data = cfg.data
    train_paths, val_paths = as_file_list(data.train_files), as_file_list(data.val_files)
    # over-long prompts only break a run whose trainer rejects them
    rejects_overlong = data.truncation == "error" and not data.filter_overlong_prompts
    # where they are dropped, the prompts left must fill the trainer's batch (each generation round's)
    batch = cfg.prompt_batch()[1]
    report = validate_dataset(
        train_paths, val_paths, cfg.value("data.tokenizer"), data.max_prompt_length,
        kind="prompt", overlong_tolerance=0.0 if rejects_overlong else 1.0,
        custom_reward=bool(cfg.custom_reward_function.path), template_kwargs=dict(data.apply_chat_template_kwargs),
        prompt_key=data.prompt_key, reward_fn_key=data.reward_fn_key,  # the columns the trainer reads
        min_kept=(batch, 1) if data.filter_overlong_prompts else (None, None),
        **ground_truth_needs(cfg),  # what training, evaluation and the reward's self-check grade against
        trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code,  # the tokenizer as the trainer loads it
    )
    result, html = report.to_dict(), HTMLString(report.to_html())
    log_metadata({"success": report.success, "dataset_fingerprint": report.fingerprint,
                  "failed_expectations": [outcome.label for outcome in report.failures],
                  "failed_examples": report.failed_examples(), **result["statistics"]})
    if not report.success:
        # a failed step returns nothing: the result and its report are saved under the outputs' names, linked to
        # this step's run, so that the failure can be browsed as a passing run's report is
        save_artifact(result, name="validation_result")
        save_artifact(html, name="validation_report")
        logger.error(report.summary())
        raise DataValidationError(report.summary())
    logger.info(report.summary())
    return result, html, report.fingerprint
