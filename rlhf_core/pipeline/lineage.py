"""Where a model version came from: data -> validation -> reward -> smoke test -> checkpoint ->
evaluation -> promotion, with the artifact version ids, the run and the metadata of each link.

    rlhf-lineage                       # the production version of the (only / last promoted) model
    rlhf-lineage --model gsm8k-ppo-policy --version 3 --json

The chain is read from the pipeline store through a ZenML ``Client``; this module imports ZenML
only inside :func:`default_client`, so the rest of ``rlhf_core`` (and this module's formatting)
works without it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

from rlhf_core.pipeline.promotion import stage_disagreement

# (stage, step name, what the stage is about); the retraining gate appears only in retraining runs
CHAIN = [
    ("data", "load_ppo_config", "the trainer config and the data files"),
    ("validation", "validate_data", "Great Expectations suite over the data; its fingerprint"),
    ("preference data", "validate_preferences", "the reward model's preference pairs; their fingerprint"),
    ("reward model", "train_reward_model", "the learned reward model and its held-out pair accuracy"),
    ("reward", "define_reward", "reward function identity, source hash, self-check"),
    ("retraining gate", "check_new_data", "new data since production, not already trained and refused?"),
    ("smoke test", "smoke_test", "two PPO iterations on a tiny clone"),
    ("checkpoint", "train_ppo", "the trained policy"),
    ("evaluation", "evaluate", "greedy accuracy with its interval, problem by problem, against base and production"),
    ("promotion", "promote", "the decision and its reason"),
]


class LineageError(LookupError):
    """The model, version or run asked for is not in the store."""


def default_client():
    from zenml.client import Client

    return Client()


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _all_models(client) -> list:
    """Every model in the store, oldest first: ZenML answers a page (at most 100) at a time."""
    models, number = [], 1
    while True:
        page = client.list_models(sort_by="created", page=number, size=100)
        models += list(page.items)
        if page.index >= page.total_pages:
            return models
        number += 1


def _pick_model(client) -> str:
    models = _all_models(client)
    if not models:
        raise LineageError("no models in the store yet: run the training pipeline first")
    if len(models) == 1:
        return models[0].name
    promoted = []
    for model in models:
        try:
            version = client.get_model_version(model.name, "production")
        except KeyError:
            continue
        promoted.append((version.updated, model.name))
    if not promoted:
        raise LineageError(f"no model has a production version; pass --model (one of "
                           f"{', '.join(m.name for m in models)}) and --version")
    return max(promoted)[1]


#: the versions of a model a message lists, the latest ones
VERSIONS_SHOWN = 10


def _not_found(client, model_name: str, version: str | None, version_option: bool) -> LineageError:
    """Why ``model_name``'s ``version`` (None: its production version) is not in the store, and what to ask
    for instead: the store's models where it has no such model, the model's versions where it has no such
    version, and ``--version`` only for a command that takes one (``version_option``)."""
    models = [model.name for model in _all_models(client)]
    if model_name not in models:
        if not models:
            return LineageError(f"no model {model_name!r}: the store has no models yet; run the training pipeline "
                                "first")
        return LineageError(f"no model {model_name!r} in the store; its models: {', '.join(models)} (pass --model "
                            "one of them)")
    newest = client.list_model_versions(model=model_name, sort_by="desc:number", size=VERSIONS_SHOWN)
    versions = [v.name for v in reversed(newest.items)]  # (shown oldest first, the latest last)
    if not versions:
        return LineageError(f"model {model_name!r} has no versions yet: run its training pipeline first")
    what = "no production version (none was promoted)" if version is None else f"no version {version!r}"
    shown = ("..., " if newest.total > len(versions) else "") + ", ".join(versions)
    hint = " (pass --version latest or one of them)" if version_option else ""
    return LineageError(f"model {model_name!r} has {what}; its versions: {shown}{hint}")


def get_version(client, model_name: str, version: str | None, version_option: bool = True):
    """The model version ``version`` of ``model_name`` (a number, a name or a stage; None: production), or a
    LineageError saying what the store holds instead; ``version_option``: the command takes ``--version``."""
    wanted: Any = version or "production"
    if isinstance(wanted, str) and wanted.isdigit():
        wanted = int(wanted)
    try:
        return client.get_model_version(model_name, wanted)
    except KeyError as exc:
        raise _not_found(client, model_name, version, version_option) from exc


def version_run_id(model_version) -> str | None:
    """The pipeline run that made a model version: the one its promotion recorded, else the first run linked to
    it (a run that failed before it reached promotion); None where it has none."""
    run_id = model_version.run_metadata.get("pipeline_run_id")
    if run_id is None:
        run_ids = list(model_version.pipeline_run_ids.values())
        run_id = run_ids[0] if run_ids else None
    return run_id


def _artifact(artifact) -> dict[str, Any]:
    return {"name": artifact.artifact.name, "id": str(artifact.id), "version": str(artifact.version),
            "type": str(artifact.type), "uri": artifact.uri}


def lineage(model: str | None = None, version: str | None = None, client=None) -> dict[str, Any]:
    """The chain behind one model version (default: the production version) as a JSON-able dict."""
    client = client or default_client()
    model_name = model or _pick_model(client)
    model_version = get_version(client, model_name, version)
    metadata = dict(model_version.run_metadata)
    run_id = version_run_id(model_version)
    if run_id is None:
        raise LineageError(f"model {model_name!r} version {model_version.name} is linked to no pipeline run")
    run = client.get_pipeline_run(run_id)
    steps = run.steps
    chain = []
    for stage, step_name, about in CHAIN:
        step = steps.get(step_name)
        if step is None:
            continue
        chain.append({
            "stage": stage,
            "about": about,
            "step": step_name,
            "status": str(step.status),
            "run": run.name,
            "inputs": {name: [str(a.id) for a in artifacts] for name, artifacts in step.regular_inputs.items()},
            "artifacts": [_artifact(a) for outputs in step.outputs.values() for a in outputs],
            "metadata": _jsonable(dict(step.run_metadata)),
        })
    stage = str(model_version.stage) if model_version.stage else None
    return {
        "model": model_name,
        "version": model_version.name,
        "number": model_version.number,
        "stage": stage,
        # where the stage and the promotion record disagree (promote stopped between its writes), what that means
        "stage_vs_record": stage_disagreement(stage == "production", metadata),
        "pipeline": run.pipeline.name if run.pipeline else None,
        "run": run.name,
        "run_id": str(run.id),
        "run_status": str(run.status),
        "model_version_metadata": _jsonable(metadata),
        "chain": chain,
    }


_HIGHLIGHTS = {
    "data": ("trainer_config", "train_files", "val_files", "model_path", "overrides"),
    "validation": ("success", "dataset_fingerprint", "evaluated_expectations", "unsuccessful_expectations",
                   "failed_expectations"),
    "retraining gate": ("production_version", "skipped", "reason"),
    "preference data": ("preference_fingerprint", "train_pairs", "val_pairs", "train_prompts", "val_prompts"),
    # the fingerprint again here: it ties the reward model to the preference data it was trained on
    "reward model": ("held_out_pair_accuracy", "min_pair_accuracy", "passed", "reason", "held_out_loss",
                     "preference_fingerprint", "base_model"),
    "reward": ("reward_sha256", "kind", "functions", "references_checked", "reference_mismatches"),
    "smoke test": ("passed", "wall_s", "cloned", "parameters"),
    "checkpoint": ("skipped", "steps", "checkpoint", "final_val_acc", "final_score", "wall_s", "warm_started",
                   "warm_started_from", "warm_start_artifact", "resumed_from"),
    "evaluation": ("accuracy", "accuracy_ci", "base_accuracy", "n", "budget", "val_fingerprint"),
    "promotion": ("promoted", "decision_reason"),
}


def _short(value: Any, width: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 3] + "..."


def _changed_lines(metadata: Mapping[str, Any]) -> list[str]:
    """The problems the version fixed and broke against what it was compared with, a few of each."""
    if "n_fixed" not in metadata:
        return []
    lines = [f"      against the {metadata.get('compared_with', 'baseline')}: fixed {metadata['n_fixed']}, "
             f"broke {metadata['n_broken']} problem(s)"]
    for kind in ("fixed", "broken"):
        for item in metadata.get(kind) or []:
            truth = item["ground_truth"]  # None: a problem without one (a custom reward's), not the answer "None"
            answer = "no ground truth" if truth is None else f"answer {truth}"
            lines.append(f"        {kind} {item['problem_id']} ({answer}): {_short(item['candidate_response'], 80)!r}")
    return lines


def format_lineage(record: Mapping[str, Any]) -> str:
    """The chain as indented text, one block per stage."""
    lines = [f"model {record['model']} version {record['version']} (stage: {record['stage'] or 'none'})",
             f"  produced by run {record['run']} of {record['pipeline']} ({record['run_status']}, id {record['run_id']})"]
    meta = record["model_version_metadata"]
    disagreement = stage_disagreement(record["stage"] == "production", meta)
    if disagreement:
        lines.append(f"  stage and record disagree: {disagreement}")
    if "failed_step" in meta:  # recorded by the pipelines' failure hook
        failure = " ".join(str(meta.get("failure", "")).split("\n"))  # on one line: the way on follows it
        lines.append(f"  failed at step {meta['failed_step']}: {_short(failure)}")
        if "advice" in meta:
            lines.append(f"  to go on: {meta['advice']}")
    for index, link in enumerate(record["chain"]):
        arrow = "   " if index == 0 else "-> "
        lines.append(f"{arrow}{link['stage']}: step {link['step']} [{link['status']}] - {link['about']}")
        for artifact in link["artifacts"]:
            lines.append(f"      artifact {artifact['name']} v{artifact['version']} id {artifact['id']}")
        for name, ids in link["inputs"].items():
            if name in ("init_from",):
                how = "warm-start artifact (unused: nothing trained)" if link["metadata"].get("skipped") \
                    else "warm-started from artifact"
                lines.append(f"      {how} {', '.join(ids)}")
        for key in _HIGHLIGHTS.get(link["stage"], ()):
            if key in link["metadata"]:
                lines.append(f"      {key}: {_short(link['metadata'][key])}")
        if link["stage"] == "evaluation":
            lines += _changed_lines(link["metadata"])
    for key in ("dataset_fingerprint", "reward_sha256", "checkpoint_artifact_id", "accuracy", "baseline",
                "baseline_accuracy", "previous_production_version", "gain", "gain_ci", "p_value", "alpha"):
        if key in meta:
            lines.append(f"   model version {key}: {_short(meta[key])}")
    return "\n".join(lines)


if __name__ == "__main__":
    from rlhf_core.cli.pipeline import lineage
    sys.exit(lineage())
