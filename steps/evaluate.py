"""Greedy accuracy of the trained policy and of the base model on the validation data."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import torch
from zenml import log_metadata, step
from zenml.logger import get_logger
from zenml.types import HTMLString

from rlhf_core.config import PPOConfig
from rlhf_core.pipeline.evaluate import evaluate_policy, evaluation_html, training_curves_png
from rlhf_core.rewards import load_custom_reward_fn

logger = get_logger(__name__)


@step(enable_cache=False)
def evaluate(
    ppo_config: dict,
    ppo_checkpoint: Path,
    training_summary: dict,
    skip_reason: str = "",
    batch_size: int = 64,
) -> tuple[Annotated[dict, "evaluation"], Annotated[HTMLString, "evaluation_report"]]:
    """The policy's and the base model's accuracy, with an HTML report of figures and examples."""
    if skip_reason:
        logger.info("evaluation skipped: %s", skip_reason)
        return {"skipped": skip_reason}, HTMLString(f"<p>Evaluation skipped: {skip_reason}</p>")
    cfg = PPOConfig.from_dict(ppo_config)
    model = cfg.actor_rollout_ref.model
    custom = cfg.custom_reward_function
    kwargs = {
        "data_config": cfg.data,
        "batch_size": batch_size,
        "reward_fn": load_custom_reward_fn(custom.path, custom.name) if custom.path else None,
        "device": "cuda" if cfg.trainer.device == "cuda" and torch.cuda.is_available() else "cpu",
        "dtype": model.dtype,
    }
    base_model = model.path
    results = {
        "base model": evaluate_policy(base_model, cfg.data.val_files, tokenizer_path=model.tokenizer_path, **kwargs),
        "trained policy": evaluate_policy(ppo_checkpoint, cfg.data.val_files, **kwargs),
    }
    policy, base = results["trained policy"], results["base model"]
    logger.info("greedy accuracy on %d prompts: trained %.2f%% vs base %.2f%%", policy.n,
                100 * policy.accuracy, 100 * base.accuracy)
    evaluation = {"accuracy": policy.accuracy, "base_accuracy": base.accuracy, "n": policy.n,
                  "base_model": base_model, "policy": policy.to_dict(), "base": base.to_dict()}
    log_metadata({"accuracy": policy.accuracy, "base_accuracy": base.accuracy, "n": policy.n,
                  "per_source": policy.per_source})
    curves = training_curves_png(training_summary.get("history", []))
    return evaluation, HTMLString(evaluation_html(results, curves))
