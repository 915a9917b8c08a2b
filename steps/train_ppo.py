"""PPO training: the trainer's final checkpoint becomes a versioned model artifact."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Annotated

from PIL import Image
from zenml import ArtifactConfig, get_step_context, log_metadata, step
from zenml.client import Client
from zenml.enums import ArtifactType
from zenml.logger import get_logger

from rlhf_core.config import PPOConfig
from rlhf_core.data.dataset import as_file_list
from rlhf_core.data.validation import check_unchanged
from rlhf_core.main_ppo import run
from rlhf_core.pipeline.evaluate import check_reward_unchanged, resolve_policy_dir, training_curves_png
from rlhf_core.pipeline.lineage import artifact_label
from rlhf_core.pipeline.promotion import config_fingerprint
from rlhf_core.pipeline.training import add_resume_advice, resume_own_checkpoint, stable_copy, whole_history

logger = get_logger(__name__)

#: the one file of a skipped run's ppo_checkpoint artifact
SKIPPED_NOTE = "SKIPPED.txt"


def score_with(cfg: PPOConfig, reward_model: Path) -> None:
    """``cfg`` with its rollouts scored by ``reward_model`` (the artifact of train_reward_model)."""
    cfg.reward_model.enable = True
    cfg.reward_model.model.path = str(reward_model)


def start_from(cfg: PPOConfig, policy: Path) -> None:
    """``cfg`` with the actor (and the critic's backbone, and the reference) starting from ``policy`` (a warm
    start's HF folder); the tokenizer stays the configured one."""
    model = cfg.actor_rollout_ref.model
    model.tokenizer_path = cfg.value("actor_rollout_ref.model.tokenizer_path")
    model.path = str(policy)


def input_artifact_label(name: str) -> str | None:
    """Input ``name`` of this step as a person finds it again after the run, ``artifact reward_model v3 id
    <uuid>`` (:func:`~rlhf_core.pipeline.lineage.artifact_label`, as the lineage report names them); None where
    the step was given none. The folder ZenML unpacked it into is a temporary one, gone after the step."""
    inputs = get_step_context().inputs.get(name) or []
    if not inputs:
        return None
    artifact = inputs[0]
    return artifact_label(artifact.artifact.name, artifact.version, artifact.id)


def stable_input(name: str, model: Path, root: Path, kind: str) -> Path:
    """The model of input ``name`` at ``<root>/<kind>/<artifact id>`` (:func:`stable_copy`)."""
    inputs = get_step_context().inputs.get(name) or []
    return stable_copy(model, root, f"{kind}/{inputs[0].id}") if inputs else model


def warm_start(artifact_id: str) -> tuple[Path, str]:
    """(the policy folder, the artifact version id) of the warm start's checkpoint artifact ``artifact_id``: the
    one the smoke test ran from. Fetched by id inside the step, ZenML records it as one of this step's inputs
    (loaded by hand: under its artifact name, ``ppo_checkpoint``)."""
    artifact = Client().get_artifact_version(artifact_id)
    return resolve_policy_dir(artifact.load()), str(artifact.id)


@step(enable_cache=False)
def train_ppo(
    ppo_config: dict,
    smoke_report: dict,
    skip_reason: str = "",
    reward_model: Path | None = None,
    reward_spec: dict | None = None,
) -> tuple[
    Annotated[Path, ArtifactConfig(name="ppo_checkpoint", artifact_type=ArtifactType.MODEL)],
    Annotated[dict, "training_summary"],
    Annotated[Image.Image, "training_curves"],
]:
    """Train; ``reward_model`` (the artifact of train_reward_model) scores the rollouts: ``reward_model.enable=true
    reward_model.model.path=<artifact>``.

    A warm start is the checkpoint the smoke test ran from (``smoke_report["init_from_artifact_id"]``): training
    starts from the checkpoint that was dry-run, not from production looked up again (another run may promote a
    version between the two steps). The step records on the model version the version of this model that the
    checkpoint is linked to (``warm_started_from``: the smoke test's ``init_from_version``, production's where it
    links it), before training, and in its own metadata the artifact (``warm_start_artifact``). ``reward_spec``
    (the artifact of define_reward): a reward changed since it was pinned stops the step before training."""
    if skip_reason:
        # nothing trained: a folder that says so, not the warm-start checkpoint stored again as a new artifact (a
        # full copy of production's weights at every skipped scheduled run); this version is never promoted. It is
        # written where a trained run's checkpoints would be (not in the system's temp folder, which keeps one
        # more folder for every skipped scheduled run)
        logger.info("training skipped: %s; no checkpoint is stored for this version", skip_reason)
        local_dir = PPOConfig.from_dict(ppo_config).trainer.default_local_dir
        folder = Path(os.path.expanduser(local_dir)) / get_step_context().pipeline_run.name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / SKIPPED_NOTE).write_text(f"training skipped: {skip_reason}\n")
        log_metadata({"skipped": skip_reason, "steps": 0})
        return folder, {"skipped": skip_reason, "steps": 0, "history": []}, Image.new("RGB", (8, 8), "white")
    cfg = PPOConfig.from_dict(ppo_config)
    if reward_spec is not None:  # the reward define_reward checked and the smoke test ran, not one edited since
        check_reward_unchanged(cfg, reward_spec, "train_ppo")
    root = Path(os.path.expanduser(cfg.trainer.default_local_dir))  # what the trainer saves under (it expands ~)
    validated = smoke_report.get("dataset_fingerprint")
    check_unchanged(as_file_list(cfg.data.train_files), as_file_list(cfg.data.val_files), validated, "train_ppo")
    warm_started_from, tested = smoke_report.get("init_from_version"), smoke_report.get("init_from_artifact_id")
    if tested is not None:
        policy, artifact_id = warm_start(tested)
        start_from(cfg, stable_copy(policy, root, f"warm_start/{artifact_id}"))
        log_metadata({"warm_start_artifact": artifact_id})
        if warm_started_from is not None:  # what the retraining gate compares a later run's production with
            log_metadata({"warm_started_from": warm_started_from}, infer_model=True)
        logger.info("warm start: the actor (and critic backbone) start from %s (version %s, the checkpoint the smoke "
                    "test ran from)", cfg.actor_rollout_ref.model.path, warm_started_from)
    scored_by = None
    if reward_model is not None:
        score_with(cfg, stable_input("reward_model", reward_model, root, "reward_model"))
        scored_by = input_artifact_label("reward_model") or cfg.reward_model.model.path
        logger.info("rollouts are scored by the reward model %s (loaded from %s)", scored_by,
                    cfg.reward_model.model.path)
    # one checkpoint folder per run, so that no run resumes from or overwrites another's
    cfg.trainer.default_local_dir = str(root / get_step_context().pipeline_run.name)
    if cfg.trainer.val_only and cfg.trainer.resume_mode != "resume_path":  # before any model loads
        raise ValueError("trainer.val_only=true trains nothing, and this run's checkpoint folder is new, so there is "
                         "no policy to hand on: drop trainer.val_only, or validate a checkpoint with "
                         "trainer.resume_mode=resume_path and trainer.resume_from_path")
    # the earlier run's checkpoint this run was set to resume from: a retry resumes from this run's own instead
    configured_path = cfg.trainer.resume_from_path if cfg.trainer.resume_mode == "resume_path" else None
    resume_own_checkpoint(cfg.trainer)
    try:
        result = run(cfg)  # tracking, signals (in the main thread), resume, the final checkpoint, closing the workers
    except Exception as exc:
        # its "rerun" would be a new run, in a new folder (resuming from configured_path again, where there is one)
        add_resume_advice(exc, cfg.trainer.default_local_dir, configured_path)
        raise

    records = whole_history(result, configured_path, first_step=0)
    # step 0 is the validation before training: drawn in the curves, the history being the steps trained
    before = records.pop(0) if records and records[0]["step"] == 0 else None
    if result.checkpoint is None:  # (val_only refused above; a run that trained no step saves nothing)
        why = (" (its data ran out before step 1: dynamic sampling, algorithm.filter_groups, kept no batch; its "
               "notice above says why)" if result.steps == 0 else "")
        raise ValueError(f"train_ppo: the run saved no checkpoint{why}, so there is no policy to hand on")
    checkpoint = Path(result.checkpoint)
    # the artifact is the policy's HF export: what evaluation, promotion and a warm start read. The full
    # checkpoint (critic, optimizer moments: about 6x the export) stays in local_dir for a resume.
    policy = resolve_policy_dir(checkpoint)
    summary = {
        "steps": result.steps,
        "wall_s": round(result.wall_s, 2),
        "final_val_acc": result.final_val_acc,
        "final_score": result.final_score,
        "checkpoint": checkpoint.name,
        "checkpoint_dir": str(checkpoint),
        "local_dir": result.local_dir,
        "resumed_from": result.resumed_from,
        "warm_started": tested is not None,
        "warm_started_from": warm_started_from,
        "reward_model": scored_by,
        "smoke_test_passed": smoke_report.get("passed"),
        "dataset_fingerprint": validated,
        "final_metrics": records[-1] if records else {},
        "history": records,
        "val_before_train": before,
    }
    log_metadata({key: value for key, value in summary.items() if key != "history" and value is not None})
    # on the version, what the retraining gate compares a later run's config with (it trained with this one)
    log_metadata({"config_fingerprint": config_fingerprint(ppo_config)}, infer_model=True)
    curves = Image.open(io.BytesIO(training_curves_png(([before] if before else []) + records)))
    return policy, summary, curves
