"""A pipeline's parameters, checked while the pipeline compiles: before ZenML creates the run or a model version,
and before any step runs.

The trainer config (its file, then the run config's ``overrides``, then ``train_files``/``val_files``) is
resolved by :func:`resolve_trainer_config`, here as in the ``load_ppo_config`` step, so that an unknown key or a
bad value stops the run before it starts rather than leaving a model version marked failed. The promotion gate
and the reward model's accuracy gate must be applicable. Where the steps run on this machine (ZenML's local
orchestrator), the files they would read are checked too: the custom reward function must load, the data and
preference files exist. A remote orchestrator's steps read the trainer config from their own volumes, with their
own environment: there it is resolved here only where its file is on this machine and every ``${oc.env:VAR}``
it reads without a default is set here; else the ``load_ppo_config`` step resolves it, and refuses it there. A
refusal is a :class:`RunConfigError`: a ValueError to a caller in Python, and to
``zenml pipeline run`` a message printed alone (exit status 1), without a traceback around it.

ZenML checks the run config's parameters against the pipeline function before its body runs: a parameter the
pipeline does not take, or a value of the wrong type, is refused there alike, as are the settings of a step the
pipeline does not have (:mod:`rlhf_core.pipeline.checked`)."""

from __future__ import annotations

import contextvars
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import click

from rlhf_core.config import ConfigError, PPOConfig, load_config, validate_config
from rlhf_core.data.dataset import DataError, check_files
from rlhf_core.main_ppo import PreflightError, trained_reward_model_problems
from rlhf_core.pipeline.promotion import CACHE_REFUSAL, check_gate, check_not_cached
from rlhf_core.rewards import custom_reward_fn


class RunConfigError(ValueError, click.ClickException):
    """A pipeline parameter that cannot run. A ClickException too: the ``zenml`` command prints the message and
    exits with status 1 instead of raising it through a traceback."""

    def __init__(self, message: str):
        click.ClickException.__init__(self, message)


REFUSED = "the pipeline's parameters cannot run; nothing was started:"


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


PAIR_ACCURACY_PARAMETER = "min_pair_accuracy (a pipeline parameter)"


def _pair_accuracy_range_problems(min_pair_accuracy: float | None) -> list[str]:
    """The pipeline parameter ``min_pair_accuracy`` where it is no share in [0, 1]."""
    threshold = min_pair_accuracy
    if threshold is None or (not isinstance(threshold, bool) and isinstance(threshold, (int, float))
                             and math.isfinite(threshold) and 0 <= threshold <= 1):
        return []
    return [f"{PAIR_ACCURACY_PARAMETER}={threshold!r} must be a share of held-out pairs in [0, 1]"]


def _pair_accuracy_problems(cfg: PPOConfig, min_pair_accuracy: float | None) -> list[str]:
    """What stops the reward model pipeline's accuracy gate (``min_pair_accuracy``, else the config's) after the
    reward model has trained: a value outside [0, 1], or one above 0 with no held-out pairs to measure it on."""
    rm = cfg.reward_model.train
    if min_pair_accuracy is None:
        threshold, setting = rm.min_pair_accuracy, "reward_model.train.min_pair_accuracy"
    else:
        threshold, setting = min_pair_accuracy, PAIR_ACCURACY_PARAMETER
        if problems := _pair_accuracy_range_problems(min_pair_accuracy):
            return problems
    if threshold > 0 and not rm.val_files:
        return [f"{setting}={threshold} is measured on held-out pairs: set reward_model.train.val_files"]
    return []


def _checkpoint_folder_problems(cfg: PPOConfig) -> list[str]:
    """The reward model's and PPO's checkpoint folders where they are one: each step trains into
    ``<its default_local_dir>/<run name>``, so the reward model's checkpoints would be where train_ppo resumes from,
    and it refuses them (another kind of run's) after the reward model has trained."""
    rm_dir, ppo_dir = (os.path.abspath(os.path.expanduser(str(path)))
                       for path in (cfg.reward_model.train.default_local_dir, cfg.trainer.default_local_dir))
    if rm_dir != ppo_dir:
        return []
    return [f"reward_model.train.default_local_dir and trainer.default_local_dir are one folder ({rm_dir}): each "
            "pipeline step trains into <its folder>/<run name>, so PPO would meet the reward model's checkpoints "
            "there and refuse them once the reward model has trained; set reward_model.train.default_local_dir to "
            "another folder, e.g. a reward_model/ folder inside PPO's"]


def steps_run_here() -> bool:
    """Whether the active stack's orchestrator runs the steps on this machine (ZenML's ``local`` one): only then
    are the files a run config names (data, reward, models) where the steps will read them. A remote orchestrator
    reads them from its own volumes (``configs/kubeflow_example.yaml``), which this machine may not have."""
    from zenml.client import Client
    from zenml.enums import StackComponentType

    orchestrators = Client().active_stack_model.components.get(StackComponentType.ORCHESTRATOR, [])
    return bool(orchestrators) and orchestrators[0].flavor_name == "local"


#: an interpolation of an environment variable without a default: ``${oc.env:VAR}`` (``${oc.env:VAR,x}`` has one)
ENV_WITHOUT_DEFAULT = re.compile(r"\$\{\s*oc\.env\s*:\s*['\"]?([A-Za-z_][A-Za-z0-9_]*)['\"]?\s*\}")


def unresolvable_here(config_file: str, overrides: Sequence[str] | None) -> str | None:
    """Why the trainer config cannot be resolved on this machine though the steps may resolve it where they run
    (a remote orchestrator's pods): its file is not here, or it (or an override) reads an environment variable
    without a default that is not set here. None where it can be."""
    path = Path(config_file)
    if not path.is_file():
        return f"the trainer config {config_file} is not on this machine"
    try:
        texts = [path.read_text(errors="replace"), *(str(o) for o in overrides or [])]
    except OSError:
        return None  # (resolving it here says what is wrong with it)
    unset = sorted({name for text in texts for name in ENV_WITHOUT_DEFAULT.findall(text)} - set(os.environ))
    if unset:
        return f"the trainer config reads environment variable(s) {', '.join(unset)}, not set on this machine"
    return None


def _file_problems(cfg: PPOConfig, trains_reward_model: bool) -> list[str]:
    """The files ``cfg`` names that the steps could not read: a custom reward function that does not load, data
    files that do not exist, and (``trains_reward_model``) preference files that do not exist."""
    problems: list[str] = []
    if cfg.custom_reward_function.path:
        try:
            custom_reward_fn(cfg)
        except (OSError, ImportError, AttributeError, TypeError) as exc:
            problems.append(f"custom_reward_function: {exc}")
    files = [("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)]
    if trains_reward_model:  # (no held-out pairs: _pair_accuracy_problems says where that matters)
        pairs = cfg.reward_model.train
        files += [("reward_model.train.train_files", pairs.train_files)]
        files += [("reward_model.train.val_files", pairs.val_files)] if pairs.val_files is not None else []
    for key, paths in files:
        try:
            check_files(paths, key)
        except DataError as exc:
            problems.append(str(exc))
    return problems


#: set while :func:`check_run_config_file` prepares a pipeline (its function run to list its steps): the pipeline's
#: own check of its parameters then checks them as that function does, no files (a scheduled run reads them later)
_SCHEDULING: contextvars.ContextVar[bool] = contextvars.ContextVar("scheduling", default=False)


def check_run_config(config_file: str, overrides: Sequence[str] | None, train_files: str | list[str] | None,
                     val_files: str | list[str] | None, min_improvement: float, alpha: float,
                     trains_reward_model: bool = False, min_pair_accuracy: float | None = None,
                     compiling: bool = True) -> None:
    """Refuse, while a pipeline compiles, what would stop its run later: a promotion gate that cannot be applied,
    caching, a trainer config that does not resolve (:func:`resolve_trainer_config`) and, with
    ``trains_reward_model``, an accuracy gate that cannot be applied; where the steps run on this machine
    (:func:`steps_run_here`), also the files the steps would fail to read (:func:`_file_problems`) and a reward
    model base that could not score the policy's rollouts. Raises :class:`RunConfigError`.

    With a remote orchestrator, a trainer config that cannot be resolved here (:func:`unresolvable_here`: its file
    or an environment variable it reads is only where the steps run) is left to the ``load_ppo_config`` step.

    ``compiling=False`` (:func:`check_run_config_file`, before runs are scheduled): no pipeline context to ask
    about caching, and no files checked, since a scheduled run reads them when it starts, not now; nor are they
    while that check prepares the pipeline to list its steps (:data:`_SCHEDULING`)."""
    if _SCHEDULING.get():
        compiling = False
    try:
        check_gate(min_improvement, alpha)
        if compiling:
            check_not_cached()
        remote = not steps_run_here()
        here = compiling and not remote  # (the files a run reads: where and when it runs)
        if remote and (reason := unresolvable_here(config_file, overrides)):
            print(f"notice: {reason}: the load_ppo_config step resolves and checks it where it runs",
                  file=sys.stderr)
            if trains_reward_model and (problems := _pair_accuracy_range_problems(min_pair_accuracy)):
                raise ConfigError(problems)  # (the parameter's range needs no trainer config)
            return
        cfg = resolve_trainer_config(config_file, overrides, train_files, val_files, trains_reward_model and here)
        problems = (_pair_accuracy_problems(cfg, min_pair_accuracy) + _checkpoint_folder_problems(cfg)
                    if trains_reward_model else [])
        if here:
            problems += _file_problems(cfg, trains_reward_model)
        if problems:
            raise ConfigError(problems)
    except ValueError as exc:
        raise RunConfigError(f"{REFUSED}\n{exc}") from exc


def check_run_config_file(run_config: str | Path, pipeline_source: str) -> None:
    """The check :func:`check_run_config` makes as the pipeline ``pipeline_source`` (``module.name``) compiles,
    made once on the run config file ``run_config`` before runs are scheduled with it (``rlhf-schedule``), so that a
    typo is told now rather than at each scheduled run: its parameters, the pipeline's defaults for those it leaves
    out, must be the pipeline's and resolve; ``enable_cache`` is refused; its ``steps:`` must name the pipeline's
    steps and their parameters; a ``schedule:`` block is refused (runs started here would each schedule the
    pipeline anew). Raises :class:`RunConfigError`."""
    import importlib
    import inspect
    import typing

    import pydantic
    import yaml

    try:
        tree = yaml.safe_load(Path(run_config).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise RunConfigError(f"run config {run_config} does not read: {exc}") from exc
    if not isinstance(tree, dict) or not isinstance(tree.get("parameters") or {}, dict):
        raise RunConfigError(f"run config {run_config}: ZenML's run config is a mapping, its parameters a mapping of "
                             "the pipeline's parameters to values")
    if tree.get("enable_cache"):
        raise RunConfigError(f"run config {run_config}: {CACHE_REFUSAL}")
    module, _, name = pipeline_source.rpartition(".")
    try:
        entrypoint = getattr(importlib.import_module(module), name).entrypoint
    except (ImportError, AttributeError, ValueError) as exc:
        raise RunConfigError(f"pipeline {pipeline_source} cannot be imported ({exc}); give it as module.name, e.g. "
                             "pipelines.retrain.rlhf_retrain_pipeline") from exc
    parameters = inspect.signature(entrypoint).parameters
    given = dict(tree.get("parameters") or {})
    if unknown := sorted(set(given) - set(parameters)):
        raise RunConfigError(f"run config {run_config}: {', '.join(unknown)} is not a parameter of {pipeline_source} "
                             f"(its parameters: {', '.join(parameters)})")
    hints = typing.get_type_hints(entrypoint)
    for key, value in given.items():  # as ZenML converts them (YAML reads 5e-2 as text; ZenML takes it as 0.05)
        try:
            given[key] = pydantic.TypeAdapter(hints[key]).validate_python(value) if key in hints else value
        except pydantic.ValidationError as exc:
            raise RunConfigError(f"run config {run_config}: parameter {key}={value!r} is not a {hints[key]}: "
                                 f"{exc.errors()[0]['msg']}") from exc
    values = {key: parameter.default for key, parameter in parameters.items()} | given
    check_run_config(values["trainer_config"], values.get("overrides"), values.get("train_files"),
                     values.get("val_files"), values["min_improvement"], values["alpha"],
                     trains_reward_model="min_pair_accuracy" in parameters,
                     min_pair_accuracy=values.get("min_pair_accuracy"), compiling=False)
    # its steps: section, as zenml pipeline run refuses it (a step the pipeline does not have, or a step's parameter
    # the step does not take); the pipeline's steps are known once its function has run (prepared), not before
    from rlhf_core.pipeline.checked import step_config_problems

    prepared = getattr(importlib.import_module(module), name).with_options()
    scheduling = _SCHEDULING.set(True)
    try:
        prepared.prepare(**given)
    finally:
        _SCHEDULING.reset(scheduling)
    if problems := step_config_problems(tree, prepared):  # (the file as read above)
        raise RunConfigError(f"run config {run_config}: {'; '.join(problems)}")
    model = tree.get("model") if isinstance(tree.get("model"), dict) else {}
    if "discard_skipped_version" in prepared.invocations and model.get("version") is not None:
        # a retraining into an existing version, which a skipped run would delete; refused as the pipeline
        # compiles too, where a version name is looked up in the store (not here: production may come later)
        from steps.check_new_data import reused_version

        name = model.get("name") or prepared.configuration.model.name
        if problem := reused_version(name, model["version"], ask_store=False):
            raise RunConfigError(f"run config {run_config}: {problem}")
    if "schedule" in tree:
        raise RunConfigError(
            f"run config {run_config} has a schedule: block, which asks the orchestrator to schedule the pipeline: "
            "every run started from here would register one more schedule (or fail, on ZenML's local orchestrator, "
            "which cannot schedule). Remove the block to schedule here, or keep it and run `zenml pipeline run "
            f"{pipeline_source} -c {run_config}` once on a stack whose orchestrator schedules")
