"""PPO training: the trainer's final checkpoint becomes a versioned model artifact."""

from __future__ import annotations

import io
import math
import time
from pathlib import Path
from typing import Annotated

from PIL import Image
from zenml import ArtifactConfig, get_step_context, log_metadata, step
from zenml.enums import ArtifactType
from zenml.logger import get_logger

from rlhf_core.main_ppo import build_trainer, preflight
from rlhf_core.pipeline.evaluate import resolve_policy_dir, training_curves_png
from rlhf_core.training.checkpoint import latest_checkpoint, save_checkpoint
from rlhf_core.training.tracking import Tracking
from steps._config import config_from_dict

logger = get_logger(__name__)


def _finite(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


@step(enable_cache=False)
def train_ppo(
    ppo_config: dict,
    smoke_report: dict,
    init_from: Path | None = None,
    skip_reason: str = "",
    reward_model: Path | None = None,
) -> tuple[
    Annotated[Path, ArtifactConfig(name="ppo_checkpoint", artifact_type=ArtifactType.MODEL)],
    Annotated[dict, "training_summary"],
    Annotated[Image.Image, "training_curves"],
]:
    """Train; ``init_from`` (a checkpoint artifact) warm-starts the actor from its HF export; ``reward_model``
    (the artifact of train_reward_model) scores the rollouts: ``reward_model.enable=true
    reward_model.model.path=<artifact>``."""
    if skip_reason:
        if init_from is None:
            raise ValueError(f"training skipped ({skip_reason}) but there is no checkpoint to carry forward")
        logger.info("training skipped: %s; the warm-start checkpoint is carried forward unchanged", skip_reason)
        return init_from, {"skipped": skip_reason, "steps": 0, "history": []}, Image.new("RGB", (8, 8), "white")
    cfg = config_from_dict(ppo_config)
    model = cfg.actor_rollout_ref.model
    if init_from is not None:
        model.tokenizer_path = model.tokenizer_path or model.path
        model.path = str(resolve_policy_dir(init_from))
        logger.info("warm start: the actor (and critic backbone) start from %s", model.path)
    if reward_model is not None:
        cfg.reward_model.enable = True
        cfg.reward_model.model.path = str(reward_model)
        logger.info("rollouts are scored by the reward model %s", reward_model)
    # one checkpoint folder per run, so that no run resumes from or overwrites another's
    run_name = get_step_context().pipeline_run.name
    trainer_cfg = cfg.trainer
    trainer_cfg.default_local_dir = str(Path(trainer_cfg.default_local_dir) / run_name)
    local_dir = Path(trainer_cfg.default_local_dir)

    started = time.time()
    preflight(cfg)
    trainer = build_trainer(cfg)
    with Tracking(trainer_cfg.logger, trainer_cfg.project_name, trainer_cfg.experiment_name, local_dir,
                  config=cfg.to_dict(), total_steps=trainer.total_steps) as tracking:
        trainer.logger = tracking.log
        history = trainer.fit()
    checkpoint = latest_checkpoint(local_dir)
    if checkpoint is None or not checkpoint.name.endswith(f"_{trainer.global_step}"):
        checkpoint = save_checkpoint(trainer, local_dir)

    records = [{"step": result.step, **_finite(result.metrics)} for result in history]
    final = records[-1] if records else {}
    summary = {
        "steps": trainer.global_step,
        "wall_s": round(time.time() - started, 2),
        "final_val_acc": trainer.val_accuracy(final),
        "final_score": final.get("critic/score/mean"),
        "checkpoint": checkpoint.name,
        "local_dir": str(local_dir),
        "warm_started": init_from is not None,
        "smoke_test_passed": smoke_report.get("passed"),
        "final_metrics": final,
        "history": records,
    }
    log_metadata({key: value for key, value in summary.items() if key != "history" and value is not None})
    curves = Image.open(io.BytesIO(training_curves_png(records)))
    return checkpoint, summary, curves
