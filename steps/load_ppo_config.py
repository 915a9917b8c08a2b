"""Resolve the trainer config (a verl-style YAML plus overrides) once, as a versioned artifact."""

from __future__ import annotations

from typing import Annotated

from zenml import log_metadata, step
from zenml.logger import get_logger

from rlhf_core.config import load_config, validate_config

logger = get_logger(__name__)


@step(enable_cache=False)
def load_ppo_config(
    trainer_config: str,
    overrides: list[str] | None = None,
    train_files: str | list[str] | None = None,
    val_files: str | list[str] | None = None,
) -> Annotated[dict, "ppo_config"]:
    """The validated trainer config; ``train_files``/``val_files`` override the file's data paths."""
    extra = list(overrides or [])
    cfg = load_config(extra, config_file=trainer_config, notice=logger.warning, validate=False)
    # paths are assigned, not written into an override, so that no character of a path needs quoting
    cfg.data.train_files = train_files or cfg.data.train_files
    cfg.data.val_files = val_files or cfg.data.val_files
    validate_config(cfg)
    logger.info("trainer config %s with %d override(s):\n%s", trainer_config, len(extra), cfg.to_yaml())
    log_metadata({"trainer_config": trainer_config, "overrides": extra,
                  "model_path": cfg.actor_rollout_ref.model.path,
                  "train_files": cfg.data.train_files, "val_files": cfg.data.val_files})
    return cfg.to_dict()
