"""Resolve the trainer config (a verl-style YAML plus overrides) once, as a versioned artifact."""

from __future__ import annotations

from typing import Annotated

from zenml import get_step_context, log_metadata, step
from zenml.logger import get_logger

from rlhf_core.pipeline.lineage import recorded_paths
from rlhf_core.pipeline.run_config import resolve_trainer_config

logger = get_logger(__name__)


@step(enable_cache=False)
def load_ppo_config(
    trainer_config: str,
    overrides: list[str] | None = None,
    train_files: str | list[str] | None = None,
    val_files: str | list[str] | None = None,
    run_nonce: str | None = None,
    trains_reward_model: bool = False,
) -> Annotated[dict, "ppo_config"]:
    """The validated trainer config (:func:`~rlhf_core.pipeline.run_config.resolve_trainer_config`, which the
    pipelines call while they compile too); ``train_files``/``val_files`` override the file's data paths.

    ``trains_reward_model``: the pipeline trains a reward model from ``reward_model.train`` and scores PPO's
    rollouts with it; what would stop it there (a tokenizer or chat template other than the policy's without
    ``data.return_raw_chat``, too few positions) is refused here, before it trains.

    ``run_nonce``, a value the pipeline draws anew each time it compiles, keeps this step out of ZenML's cache,
    and with it every step after it (their inputs are then new artifacts): a cached step would replay an earlier
    run's checks, training or decision. A run config that asks for caching step by step is refused here, as the
    pipeline refuses it whole (:func:`~rlhf_core.pipeline.promotion.check_not_cached`)."""
    snapshot = get_step_context().pipeline_run.snapshot
    cached = sorted(name for name, step_ in snapshot.step_configurations.items() if step_.config.enable_cache)
    if cached:
        raise ValueError(f"enable_cache is set on step(s) {', '.join(cached)}: a cached step replays an earlier "
                         "run's data checks, training, evaluation or promotion decision under this run. These "
                         "pipelines run every step afresh: remove enable_cache from the run config's steps")
    extra = list(overrides or [])
    cfg = resolve_trainer_config(trainer_config, extra, train_files, val_files, trains_reward_model,
                                 notice=logger.warning)
    logger.info("trainer config %s with %d override(s):\n%s", trainer_config, len(extra), cfg.to_yaml())
    # the data paths made absolute: relative ones would name other files (or none) to rlhf-lineage run elsewhere
    log_metadata({"trainer_config": trainer_config, "overrides": extra,
                  "model_path": cfg.actor_rollout_ref.model.path,
                  "train_files": recorded_paths(cfg.data.train_files), "val_files": recorded_paths(cfg.data.val_files)})
    return cfg.to_dict()
