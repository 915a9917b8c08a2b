"""Dry-run the exact run config on a tiny model and a handful of prompts before the real training."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

from pydantic import PositiveInt
from zenml import get_step_context, log_metadata, step
from zenml.logger import get_logger

from rlhf_core.config import PPOConfig
from rlhf_core.pipeline.evaluate import resolve_policy_dir
from rlhf_core.pipeline.smoke import run_smoke_test
from steps.train_ppo import score_with, start_from

logger = get_logger(__name__)


def input_artifact_id(name: str) -> str | None:
    """The id of the artifact version this step was given as input ``name``; None where it was given none."""
    inputs = get_step_context().inputs.get(name) or []
    return str(inputs[0].id) if inputs else None


@step(enable_cache=False)
def smoke_test(ppo_config: dict, reward_spec: dict, skip_reason: str = "", n_prompts: PositiveInt = 4,
               response_length: PositiveInt = 16, reward_model: Path | None = None,
               init_from: Path | None = None) -> Annotated[dict, "smoke_report"]:
    """Two PPO iterations on a tiny clone: finite losses, on-policy first step, checkpoint round trip; with
    ``reward_model`` (the artifact train_ppo is given) its rollouts are scored by it, and with ``init_from``
    (a warm start's checkpoint artifact) the policy starts from it, as training's will.

    The report names the warm start's artifact (``init_from_artifact_id``), skipped or not: train_ppo starts from
    that one rather than resolving production's checkpoint again, which another run may have replaced since."""
    tested = {"init_from_artifact_id": input_artifact_id("init_from")} if init_from is not None else {}
    if skip_reason:
        logger.info("smoke test skipped: %s", skip_reason)
        log_metadata({"skipped": skip_reason, **tested})  # (the lineage: the warm-start input went unused)
        return {"passed": None, "skipped": skip_reason, **tested}
    cfg = PPOConfig.from_dict(ppo_config)
    if reward_model is not None:
        score_with(cfg, reward_model)
    if init_from is not None:
        start_from(cfg, resolve_policy_dir(init_from))
    with tempfile.TemporaryDirectory(prefix="rlhf-smoke-") as work_dir:
        report = run_smoke_test(cfg, work_dir, n_prompts=n_prompts, response_length=response_length)
    logger.info(report.summary())
    result = report.to_dict()
    result["reward_sha256"] = reward_spec.get("sha256")
    result["dataset_fingerprint"] = reward_spec.get("self_check", {}).get("dataset_fingerprint")  # held to later
    result.update(tested)
    log_metadata({"passed": report.passed, "wall_s": round(report.wall_s, 2), "cloned": report.cloned,
                  **({"reward_model": report.reward_model} if report.reward_model else {}),
                  "parameters": report.parameters, "target_parameters": report.target_parameters,
                  "checks": {check["name"]: check["detail"] for check in report.checks}, **tested})
    return result
