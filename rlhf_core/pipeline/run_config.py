"""The trainer config a pipeline trains with, resolved from its parameters."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rlhf_core.config import PPOConfig, load_config, validate_config
from rlhf_core.main_ppo import PreflightError, trained_reward_model_problems


def resolve_trainer_config(config_file: str, overrides: Sequence[str] | None = None,
                           train_files: str | list[str] | None = None, val_files: str | list[str] | None = None,
                           trains_reward_model: bool = False,
                           notice: Callable[[str], None] = lambda _: None) -> PPOConfig:
    """The validated trainer config a pipeline trains with: ``config_file``, then ``overrides``; ``train_files`` /
    ``val_files``, where given, replace the data paths. Raises ConfigError or ValueError (no validation data: the
    pipelines evaluate and promote on it), or PreflightError where ``trains_reward_model`` and the reward model
    trained from ``reward_model.train`` could not score the policy's rollouts."""
    cfg = load_config(list(overrides or []), config_file=config_file, notice=notice, validate=False)
    # paths are assigned, not written into an override, so that no character of a path needs quoting
    cfg.data.train_files = train_files or cfg.data.train_files
    cfg.data.val_files = val_files or cfg.data.val_files
    if not cfg.data.val_files:  # the trainer runs without one; the pipeline's evaluation and promotion cannot
        raise ValueError("no validation data: the pipeline evaluates the trained policy on data.val_files and "
                         "decides its promotion on them; give val_files (a pipeline parameter) or data.val_files")
    validate_config(cfg)
    if trains_reward_model and (problems := trained_reward_model_problems(cfg)):
        raise PreflightError(problems)
    return cfg
