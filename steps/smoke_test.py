"""Dry-run the exact run config on a tiny model and a handful of prompts before the real training."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

from pydantic import PositiveInt
from zenml import get_step_context, log_metadata, step
from zenml.client import Client
from zenml.enums import ModelStages
from zenml.logger import get_logger
from zenml.utils.pagination_utils import depaginate

from rlhf_core.config import PPOConfig
from rlhf_core.pipeline.evaluate import check_reward_unchanged, resolve_policy_dir
from rlhf_core.pipeline.smoke import run_smoke_test
from steps.train_ppo import input_artifact_label, score_with, start_from

logger = get_logger(__name__)


def input_artifact_id(name: str) -> str | None:
    """The id of the artifact version this step was given as input ``name``; None where it was given none."""
    inputs = get_step_context().inputs.get(name) or []
    return str(inputs[0].id) if inputs else None


def linked_version(client: Client, model_name: str, artifact_id: str) -> str | None:
    """The name of the version of ``model_name`` that artifact ``artifact_id`` is linked to: production where it
    links it (the warm start is production's checkpoint, looked up when this step started), else the version of
    the run that produced it where that one links it, else the newest version that links it; None where no
    version of ``model_name`` links it.

    Read from the model's links, not from the run that produced the artifact: a checkpoint saved outside a run of
    this model (``save_artifact``, an import, another model's run) and linked to a version by hand has no such
    run, or one of another version."""
    links = depaginate(client.list_model_version_artifact_links, artifact_version_id=artifact_id)
    linked = [client.get_model_version(model_version_name_or_number_or_id=link.model_version) for link in links]
    linked = {version.id: version for version in linked if version.model.name == model_name}
    try:
        production = client.get_model_version(model_name, ModelStages.PRODUCTION)
    except KeyError:
        production = None
    run_id = client.get_artifact_version(artifact_id).producer_pipeline_run_id
    producer = client.get_pipeline_run(run_id).model_version if run_id is not None else None
    for preferred in (production, producer):
        if preferred is not None and preferred.id in linked:
            return linked[preferred.id].name
    return max(linked.values(), key=lambda version: version.number).name if linked else None


@step(enable_cache=False)
def smoke_test(ppo_config: dict, reward_spec: dict, skip_reason: str = "", n_prompts: PositiveInt = 4,
               response_length: PositiveInt = 16, reward_model: Path | None = None,
               init_from: Path | None = None) -> Annotated[dict, "smoke_report"]:
    """Two PPO iterations on a tiny clone: finite losses, on-policy first step, the reward's acc on the validation
    responses 0 or 1 (as the evaluate step counts each problem right or wrong), checkpoint round trip; with
    ``reward_model`` (the artifact train_ppo is given) its rollouts are scored by it, and with ``init_from``
    (a warm start's checkpoint artifact) the policy starts from it, as training's will. A reward changed since
    ``reward_spec`` pinned it stops the step before the dry run.

    The report names the warm start's artifact (``init_from_artifact_id``) and the version of this model it is
    linked to (``init_from_version``: :func:`linked_version`, None where none is), skipped or not: train_ppo
    starts from that artifact rather than resolving production's checkpoint again, which another run may have
    replaced since, and records that version as the one it warm-started from."""
    tested = {}
    if init_from is not None:
        artifact_id = input_artifact_id("init_from")
        version = linked_version(Client(), get_step_context().model.name, artifact_id) if artifact_id else None
        tested = {"init_from_artifact_id": artifact_id, "init_from_version": version}
    recorded = {key: value for key, value in tested.items() if value is not None}  # (ZenML's metadata takes no None)
    if skip_reason:
        logger.info("smoke test skipped: %s", skip_reason)
        log_metadata({"skipped": skip_reason, **recorded})  # (the lineage: the warm-start input went unused)
        return {"passed": None, "skipped": skip_reason, **tested}
    cfg = PPOConfig.from_dict(ppo_config)
    check_reward_unchanged(cfg, reward_spec, "smoke_test")  # the reward define_reward checked, not one edited since
    if reward_model is not None:
        score_with(cfg, reward_model)
    if init_from is not None:
        start_from(cfg, resolve_policy_dir(init_from))
    with tempfile.TemporaryDirectory(prefix="rlhf-smoke-") as work_dir:
        # evaluated: the evaluate step counts each problem right or wrong, and a reward whose acc it refuses is
        # refused here, before the training
        report = run_smoke_test(cfg, work_dir, n_prompts=n_prompts, response_length=response_length, evaluated=True)
    if report.reward_model is not None:  # the artifact, not the temporary folder ZenML unpacked it into
        report.reward_model = input_artifact_label("reward_model") or report.reward_model
    logger.info(report.summary())
    result = report.to_dict()
    result["reward_sha256"] = reward_spec.get("sha256")
    result["dataset_fingerprint"] = reward_spec.get("self_check", {}).get("dataset_fingerprint")  # held to later
    result.update(tested)
    log_metadata({"passed": report.passed, "wall_s": round(report.wall_s, 2), "cloned": report.cloned,
                  **({"reward_model": report.reward_model} if report.reward_model else {}),
                  "parameters": report.parameters, "target_parameters": report.target_parameters,
                  "checks": {check["name"]: check["detail"] for check in report.checks}, **recorded})
    return result
