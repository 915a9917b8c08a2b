"""Where a model version came from: data -> validation -> reward -> smoke test -> checkpoint ->
evaluation -> promotion, with the artifact version ids, the run and the metadata of each link.

    rlhf-lineage                       # the production version of the (only / last promoted) model
    rlhf-lineage --model gsm8k-ppo-policy --version 3 --json

The chain is read from the pipeline store through a ZenML ``Client``; this module imports ZenML
only inside :func:`default_client`, so the rest of ``rlhf_core`` (and this module's formatting)
works without it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
import tokenize
from collections.abc import Mapping
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as `rlhf lineage` is (rlhf_core.cli), where its command's module imports
    # ZenML, so that a Ctrl-C in the command's first seconds ends it with one line and exit 130, not a
    # traceback
    from rlhf_core.cli import _run

    sys.exit(_run("lineage", None, "python -m rlhf_core.pipeline.lineage"))

from rlhf_core.pipeline.promotion import stage_disagreement
from rlhf_core.pipeline.reward_code import user_code

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


def _not_unique(client, model_name: str, stage: str, version_option: bool) -> LineageError | None:
    """Which versions of ``model_name`` are in ``stage``, and to pick one by its number: a stage other than
    production may hold many (each promotion archives the production version before it), and ZenML then refuses
    to pick one. None where the stage holds fewer than two (the store's error was about something else)."""
    newest = client.list_model_versions(model=model_name, stage=stage, sort_by="desc:number", size=VERSIONS_SHOWN)
    if newest.total < 2:
        return None
    numbers = [str(v.number) for v in reversed(newest.items)]  # (shown oldest first, the latest last)
    shown = ("..., " if newest.total > len(numbers) else "") + ", ".join(numbers)
    hint = " (pass --version one of their numbers)" if version_option else ""
    return LineageError(f"model {model_name!r} has {newest.total} versions in stage {stage!r}: {shown}{hint}")


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
    except RuntimeError as exc:  # ZenML's answer where the stage asked for holds more than one version
        error = _not_unique(client, model_name, wanted, version_option) if isinstance(wanted, str) else None
        if error is None:
            raise
        raise error from exc


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


#: what a check of recorded files against what their paths hold now says
UNCHANGED, CHANGED, MISSING, UNREADABLE = "unchanged", "changed since", "missing", "unreadable"

#: the reward spec's key that keeps the text of a custom reward's files (:func:`custom_reward_source`)
SOURCE_KEY = "custom_source"


def _paths(files: Any) -> list[Path]:
    """``data.train_files`` / ``val_files`` as recorded (one path, a list of them, or None) as paths, as the
    trainer reads them (:func:`~rlhf_core.data.dataset.as_file_list`: ``~`` expanded); not imported from there,
    whose module brings torch, which reading a version's lineage has no use for."""
    names = [] if files is None else [files] if isinstance(files, (str, os.PathLike)) else list(files)
    return [Path(os.path.expanduser(str(name))) for name in names]


def recorded_paths(files: Any) -> Any:
    """Data paths as a version records them (one path, a list of them, or None, as given): each made absolute
    against the current directory, ``~`` expanded and links kept as named (``/home/me/data`` rather than what a
    link points to), so that they name the same files to a check made later from another directory."""
    if files is None:
        return None
    absolute = [os.path.abspath(path) for path in _paths(files)]
    return absolute[0] if isinstance(files, (str, os.PathLike)) else absolute


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def _unreadable(path: Path) -> str | None:
    """Why the file ``path`` cannot be read (its permissions, say), or None where it can."""
    try:
        with open(path, "rb") as handle:
            handle.read(1)
    except OSError as exc:
        return _reason(exc)
    return None


def check_data_files(train_files: Any, val_files: Any, recorded: str | None) -> dict[str, Any]:
    """Whether the data files a version recorded by path still hold the bytes it validated: the fingerprint
    validate_data recorded (``recorded``) against the same function over what the paths hold now. A retraining
    run may write new data to the same path, so a path alone does not say which data a version trained on.

    A file there that cannot be read is ``unreadable`` with its reason; a relative path (recorded before versions
    recorded absolute ones) is resolved against the current directory, which ``resolved_against`` names."""
    from rlhf_core.data.validation import DataReadError, splits_fingerprint

    train = [Path(os.path.abspath(path)) for path in _paths(train_files)]
    val = [Path(os.path.abspath(path)) for path in _paths(val_files)]
    check: dict[str, Any] = {"files": [str(path) for path in train + val], "recorded": recorded}
    if not all(path.is_absolute() for path in _paths(train_files) + _paths(val_files)):
        check["resolved_against"] = os.getcwd()
    missing = [str(path) for path in train + val if not path.is_file()]
    unreadable = {str(path): reason for path in train + val if path.is_file() and (reason := _unreadable(path))}
    if missing or unreadable:
        return {**check, "status": MISSING if missing else UNREADABLE, **({"missing": missing} if missing else {}),
                **({"unreadable": unreadable} if unreadable else {})}
    try:
        now = splits_fingerprint(train, val or None)
    except DataReadError as exc:  # (readable a moment ago)
        return {**check, "status": UNREADABLE, "unreadable": {exc.path: exc.reason}}
    return {**check, "status": UNCHANGED if now == recorded else CHANGED, "now": now}


def _text(data: bytes) -> str:
    """A Python file's bytes as text, in the encoding Python reads it in (UTF-8 unless it declares another)."""
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding)


def custom_reward_source(path: str | os.PathLike) -> dict[str, Any]:
    """What the reward spec keeps of a custom reward (under :data:`SOURCE_KEY`): each file its code hash reads
    (the reward file, then the modules it imports from beside it or from the current directory, as
    :func:`~rlhf_core.pipeline.reward_code.user_code` finds them) with its path, the SHA-256 of its bytes and its
    text; and that current directory. A version's reward can then be read back, and checked, after its files
    have changed."""
    cwd = Path.cwd()
    _, _, files = user_code(Path(path), cwd)
    return kept_source(files, cwd)


def kept_source(files: Mapping[Path, bytes], cwd: Path) -> dict[str, Any]:
    """:func:`custom_reward_source` of the files :func:`~rlhf_core.pipeline.reward_code.user_code` read (their
    bytes, by path) from ``cwd``: what the code hash was made of is what is kept."""
    return {"cwd": str(cwd), "files": [{"path": str(file), "sha256": hashlib.sha256(data).hexdigest(),
                                        "text": _text(data)} for file, data in files.items()]}


def kept_files(kept: Mapping[str, Any] | None) -> list[dict[str, str]]:
    """The files (``path``, ``sha256``, ``text``, the reward file first) a reward spec's :data:`SOURCE_KEY` keeps;
    none where it keeps nothing. A spec from before the modules the reward imports were kept keeps its file
    alone, at the top level."""
    if not kept:
        return []
    if "files" in kept:
        return list(kept["files"])
    return [{"path": kept["path"], "sha256": kept["sha256"], "text": kept["text"]}]


def _file_check(path: str, recorded: str) -> dict[str, Any]:
    """A kept file's SHA-256 then (``recorded``) against that of the bytes its path holds now."""
    check = {"path": path, "recorded": recorded}
    if not Path(path).is_file():
        return {**check, "status": MISSING}
    try:
        now = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as exc:
        return {**check, "status": UNREADABLE, "now": f"{UNREADABLE} ({_reason(exc)})"}
    return {**check, "status": UNCHANGED if now == recorded else CHANGED, "now": now}


def _code_check(path: str, recorded: str | None, cwd: str | None) -> tuple[dict[str, Any], list[str]]:
    """The reward's code hash then (``source_sha256``) against the same hash of its code now, with the modules it
    imports found from the directory it was recorded in (``cwd``; None: this one); and the files read for it."""
    check = {"recorded": recorded}
    if not Path(path).is_file():
        return {**check, "status": MISSING}, []
    try:
        code, _, files = user_code(Path(path), Path(cwd) if cwd else None)
    except OSError as exc:
        return {**check, "status": UNREADABLE, "now": f"{UNREADABLE} ({_reason(exc)})"}, []
    except (SyntaxError, ValueError) as exc:  # not code any more: not what was recorded
        return {**check, "status": CHANGED, "now": f"not Python ({type(exc).__name__})"}, []
    now = hashlib.sha256(code.encode()).hexdigest()
    return {**check, "status": UNCHANGED if now == recorded else CHANGED, "now": now}, [str(f) for f in files]


def check_reward_file(spec: Mapping[str, Any]) -> dict[str, Any] | None:
    """Whether a version's custom reward (None for a built-in reward) still reads as it did: the SHA-256 of the
    bytes of each file the spec keeps (the reward file and the modules it imports from beside it), and the code
    hash define_reward recorded (``source_sha256``: the code without comments, of these files and of what they
    import from this project) against the same hash of the code now. ``added``: files the code reads now that
    it did not then (a module that now shadows an installed one, say)."""
    path = spec.get("custom_path")
    if spec.get("kind") != "custom" or not path:
        return None
    kept = spec.get(SOURCE_KEY)
    files = kept_files(kept)
    hashes = {entry.get("source_sha256") for entry in spec.get("functions", {}).values()} - {None}
    checks = [_file_check(entry["path"], entry["sha256"]) for entry in files]
    code, added = None, []
    if hashes or not files:
        code, read = _code_check(path, next(iter(hashes), None), (kept or {}).get("cwd"))
        added = [file for file in read if file not in {entry["path"] for entry in files}] if files else []
    statuses = {check["status"] for check in checks} | ({code["status"]} if code else set())
    status = next((s for s in (CHANGED, MISSING, UNREADABLE) if s in statuses), UNCHANGED)
    return {"path": path, "status": status, "source_kept": bool(files), "code": code, "files": checks,
            "added": added}


def _reward_spec(step) -> tuple[dict[str, Any] | None, Any]:
    """(the spec, its artifact) of a define_reward step; (None, None) where it has none or it cannot be read."""
    artifacts = step.outputs.get("reward_spec") or []
    if not artifacts:
        return None, None
    try:
        return artifacts[0].load(), artifacts[0]
    except Exception:  # noqa: BLE001 - an artifact store out of reach leaves the rest of the chain to show
        return None, artifacts[0]


def _version_run(client, model: str | None, version: str | None) -> tuple[str, Any, Any]:
    """(the model's name, the model version, the pipeline run that made it) of ``model`` ``version``."""
    model_name = model or _pick_model(client)
    model_version = get_version(client, model_name, version)
    run_id = version_run_id(model_version)
    if run_id is None:
        raise LineageError(f"model {model_name!r} version {model_version.name} is linked to no pipeline run")
    return model_name, model_version, client.get_pipeline_run(run_id)


def lineage(model: str | None = None, version: str | None = None, client=None) -> dict[str, Any]:
    """The chain behind one model version (default: the production version) as a JSON-able dict."""
    client = client or default_client()
    model_name, model_version, run = _version_run(client, model, version)
    metadata = dict(model_version.run_metadata)
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
    data_check = reward_check = None
    if "load_ppo_config" in steps:
        recorded = dict(steps["load_ppo_config"].run_metadata)
        validated = steps["validate_data"].run_metadata.get("dataset_fingerprint") if "validate_data" in steps \
            else metadata.get("dataset_fingerprint")
        if "train_files" in recorded and validated:
            data_check = check_data_files(recorded["train_files"], recorded.get("val_files"), validated)
    if "define_reward" in steps:
        spec, artifact = _reward_spec(steps["define_reward"])
        reward_check = check_reward_file(spec) if spec is not None else None
        if reward_check is not None and reward_check["source_kept"]:
            reward_check["source_in"] = {"artifact": "reward_spec", "id": str(artifact.id),
                                         "version": str(artifact.version), "key": SOURCE_KEY}
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
        # whether the data files and the custom reward file, named by path, still hold what this version recorded
        "data_check": data_check,
        "reward_check": reward_check,
    }


def reward_source(model: str | None = None, version: str | None = None, client=None) -> str:
    """The text of each file of a model version's custom reward that its reward spec kept (:data:`SOURCE_KEY`),
    each headed by its path, the reward file first; the data files are not read."""
    client = client or default_client()
    model_name, model_version, run = _version_run(client, model, version)
    where = f"model {model_name} version {model_version.name}"
    step = run.steps.get("define_reward")
    spec, _ = _reward_spec(step) if step is not None else (None, None)
    if spec is None or spec.get("kind") != "custom" or not spec.get("custom_path"):
        raise LineageError(f"{where} has no custom reward file (a built-in reward, or no readable reward spec)")
    files = kept_files(spec.get(SOURCE_KEY))
    if not files:
        raise LineageError(f"{where}'s reward spec keeps only the sha256 of {spec['custom_path']}'s code, not its "
                           "text (it was recorded before reward specs kept it)")
    texts = [f"# ==> {entry['path']} <==\n{entry['text']}" + ("" if entry["text"].endswith("\n") else "\n")
             for entry in files]
    return "\n".join(texts)


def artifact_label(name: str, version: Any, artifact_id: Any) -> str:
    """An artifact version as a person finds it again after the run: ``artifact reward_model v3 id <uuid>``."""
    return f"artifact {name} v{version} id {artifact_id}"


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
    # skipped: a retraining that trains nothing skips its smoke test too, which then holds no result but why
    "smoke test": ("skipped", "passed", "wall_s", "cloned", "parameters", "reward_model"),
    "checkpoint": ("skipped", "steps", "checkpoint", "final_val_acc", "final_score", "wall_s", "warm_started",
                   "warm_started_from", "warm_start_artifact", "reward_model", "resumed_from"),
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


def _digest(value: str | None) -> str:
    """A SHA-256 hex digest cut to its first 12 digits; anything else (``unreadable (...)``) as it is."""
    if value is None:
        return ""
    return value[:12] if re.fullmatch("[0-9a-f]{64}", value) else value


def _data_check_lines(check: Mapping[str, Any]) -> list[str]:
    recorded = _digest(check["recorded"])
    found = []
    if check.get("missing"):
        found.append(f"{MISSING}: {', '.join(check['missing'])}")
    if check.get("unreadable"):
        found.append(", ".join(f"{path} {UNREADABLE} ({why})" for path, why in check["unreadable"].items()))
    if found:
        line = f"{'; '.join(found)} (fingerprint {recorded} then)"
    elif check["status"] == CHANGED:
        line = (f"{CHANGED} this version: the paths hold other bytes than it validated and trained on (fingerprint "
                f"{recorded} then, {_digest(check['now'])} now)")
    else:
        line = f"{UNCHANGED} (fingerprint {recorded})"
    lines = [f"      data files now: {line}"]
    if "resolved_against" in check:
        lines.append(f"      data paths: recorded relative, resolved against the current directory "
                     f"{check['resolved_against']} (run rlhf-lineage from the directory the pipeline ran in to "
                     "check the files it read)")
    return lines


def _hashes(check: Mapping[str, Any], hash_name: str) -> str:
    """``<hash> 1f2e...`` (unchanged), ``<hash> 1f2e... then, 3a4b... now`` (changed, or no code any more: ``not
    Python (SyntaxError)`` now), ``<hash> 1f2e... then`` (missing, unreadable)."""
    recorded = _digest(check["recorded"]) or "none"
    if check["status"] == UNCHANGED:
        return f"{hash_name} {recorded}"
    if check["status"] == CHANGED:
        return f"{hash_name} {recorded} then, {_digest(check['now'])} now"
    return f"{hash_name} {recorded} then"


def _state(check: Mapping[str, Any]) -> str:
    """A check's status; an unreadable file's with its reason (``unreadable (Permission denied)``)."""
    return check["now"] if check["status"] == UNREADABLE else check["status"]


def _reward_check_lines(record: Mapping[str, Any], check: Mapping[str, Any]) -> list[str]:
    code = check["code"]
    verdict = f"{CHANGED} this version" if check["status"] == CHANGED else \
        _state(code) if code and code["status"] == check["status"] else check["status"]
    lines = [f"      custom reward now: {verdict}: {check['path']} with what it imports"
             + (f" ({_hashes(code, 'code sha256')})" if code else "")]
    lines += [f"        {file['path']}: {_state(file)} ({_hashes(file, 'file sha256')})" for file in check["files"]]
    lines += [f"        {path}: read now, not then (a module it imports is found there now)" for path in check["added"]]
    if check["files"] and code and code["status"] == CHANGED and not check["added"] \
            and all(file["status"] == UNCHANGED for file in check["files"]):
        lines.append("        (its files are unchanged: the code differs in what they import from this project)")
    if check["source_kept"]:
        where = check["source_in"]
        kept = (f"the text of its files ({len(check['files'])}) is kept in artifact {where['artifact']} "
                f"v{where['version']} id {where['id']} under {where['key']!r}: rlhf-lineage --model "
                f"{record['model']} --version {record['version']} --reward-source prints them")
    else:
        kept = "its text was not kept (recorded before reward specs kept it), only its code sha256"
    return [*lines, f"      reward source: {kept}"]


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
            lines.append(f"      {artifact_label(artifact['name'], artifact['version'], artifact['id'])}")
        for name, ids in link["inputs"].items():
            if name in ("init_from",):
                how = "warm-start artifact (unused: nothing trained)" if link["metadata"].get("skipped") \
                    else "warm-started from artifact"
                lines.append(f"      {how} {', '.join(ids)}")
        for key in _HIGHLIGHTS.get(link["stage"], ()):
            if key in link["metadata"]:
                lines.append(f"      {key}: {_short(link['metadata'][key])}")
        if link["stage"] == "data" and record.get("data_check"):
            lines += _data_check_lines(record["data_check"])
        if link["stage"] == "reward" and record.get("reward_check"):
            lines += _reward_check_lines(record, record["reward_check"])
        if link["stage"] == "evaluation":
            lines += _changed_lines(link["metadata"])
    for key in ("dataset_fingerprint", "reward_sha256", "checkpoint_artifact_id", "accuracy", "baseline",
                "baseline_accuracy", "previous_production_version", "gain", "gain_ci", "p_value", "alpha"):
        if key in meta:
            lines.append(f"   model version {key}: {_short(meta[key])}")
    return "\n".join(lines)
