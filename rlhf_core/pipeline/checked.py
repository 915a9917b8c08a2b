"""The pipelines' own refusals of a run config, where ZenML checks it before the pipeline's body runs: a parameter
the pipeline function does not take or of a wrong type (ZenML raised pydantic's error through a traceback), the
settings of a step the pipeline does not have (ZenML warned and ignored them) and a step's parameter the step does
not take (a traceback). Each is a :class:`~rlhf_core.pipeline.run_config.RunConfigError`, which ``zenml pipeline
run`` prints alone (exit status 1). Put :func:`checked_parameters` above a pipeline's ``@pipeline``."""

from __future__ import annotations

import contextvars
import difflib
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pydantic
from zenml.pipelines.pipeline_definition import Pipeline

from rlhf_core.pipeline.run_config import REFUSED, RunConfigError

#: true while a pipeline compiles with a schedule attached (``with_options(schedule=...)``, or a run config's
#: ``schedule:``): what its body checks of the store's present state may be different when the runs come
COMPILING_SCHEDULE: contextvars.ContextVar[bool] = contextvars.ContextVar("compiling_schedule", default=False)


def parameter_problems(entrypoint: Callable, error: pydantic.ValidationError) -> list[str]:
    """What ZenML's check of a pipeline's parameters against its function ``entrypoint`` found (``error``), one
    line each, naming the parameter as the run config's ``parameters:`` writes it and what it takes."""
    parameters = inspect.signature(entrypoint).parameters
    name = entrypoint.__name__
    problems, mistyped = [], {}  # (the errors of a value, by its parameter)
    for item in error.errors():
        key = str(item["loc"][0]) if item["loc"] else "?"
        if item["type"] == "unexpected_keyword_argument":
            close = difflib.get_close_matches(key, parameters, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append(f"{key} is not a parameter of {name}{hint} (its parameters: {', '.join(parameters)})")
        elif item["type"] in ("missing_argument", "missing"):
            problems.append(f"{name} needs the parameter {key}")
        else:
            mistyped.setdefault(key, []).append(item)
    for key, items in mistyped.items():
        annotation = parameters[key].annotation if key in parameters else inspect.Parameter.empty
        takes = "" if annotation is inspect.Parameter.empty else f" ({key} takes {annotation})"
        # pydantic names a union's branch in the location (('train_files', 'str'), ('train_files', 'list[str]', 1)):
        # a location of list positions alone is the value's own; else the value fits none of the union's types
        if all(isinstance(part, int) for item in items for part in item["loc"][1:]):
            for item in items:
                where = key + "".join(f"[{part}]" for part in item["loc"][1:])
                problems.append(f"{where}={item['input']!r}: {item['msg']}{takes}")
        else:
            whole = next(item for item in items if len(item["loc"]) > 1 and isinstance(item["loc"][1], str))
            problems.append(f"{key}={whole['input']!r}: fits none of the types it may take{takes}")
    return problems


def step_config_problems(run_config: Mapping[str, Any], pipeline: Pipeline) -> list[str]:
    """What the ``steps:`` section of a run config file (``run_config``: its mapping, as read) names that
    ``pipeline`` (prepared: its step invocations made) does not have: a step (ZenML warns and ignores its
    settings) or a step's parameter (ZenML raises through a traceback)."""
    steps = run_config.get("steps") or {}
    if not isinstance(steps, dict):
        return []
    problems = []
    for name, section in steps.items():
        if name not in pipeline.invocations:
            close = difflib.get_close_matches(str(name), pipeline.invocations, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append(f"steps.{name} is not a step of {pipeline.name}{hint} (its steps: "
                            f"{', '.join(pipeline.invocations)})")
            continue
        given = (section or {}).get("parameters") if isinstance(section, dict) else None
        taken = inspect.signature(pipeline.invocations[name].step.entrypoint).parameters
        for key in given or {}:
            if key not in taken:
                close = difflib.get_close_matches(str(key), taken, n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                problems.append(f"steps.{name}.parameters.{key} is not a parameter of the step {name}{hint} (its "
                                f"parameters: {', '.join(taken)})")
    return problems


def _run_config_tree(run_config: str | Path) -> dict:
    """The run config file's mapping; {} where it cannot be read as one (ZenML's own reading says what is wrong)."""
    import yaml

    try:
        tree = yaml.safe_load(Path(run_config).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    return tree if isinstance(tree, dict) else {}


class CheckedPipeline(Pipeline):
    """A ZenML pipeline whose parameters, where ZenML's check against the pipeline function refuses them (a name
    the function does not take, a value of the wrong type), stop the run with :class:`RunConfigError`, which
    names each, instead of the pydantic error ZenML raises through a traceback; so do the run config's settings of
    a step the pipeline does not have, or a step's parameter it does not take (:func:`step_config_problems`).
    Made by :func:`checked_parameters`."""

    def _compile(self, config_path: str | None = None, **run_configuration_args):
        if config_path and (problems := step_config_problems(self._run_config(config_path), self)):
            raise RunConfigError("\n".join([REFUSED, *(f"  - {problem}" for problem in problems)]))
        return super()._compile(config_path=config_path, **run_configuration_args)

    def prepare(self, *args, **kwargs):
        """ZenML's ``prepare`` (which runs the pipeline's body, where its checks are), with
        :data:`COMPILING_SCHEDULE` set where the run is to be registered with a schedule. The run config file
        read for its ``schedule:`` is kept for :meth:`_compile`'s check of its ``steps:`` (a run prepares, then
        compiles): one reading of the file for both."""
        run_args = getattr(self, "_run_args", None) or {}
        config_path = run_args.get("config_path")
        self._prepared_run_config = None
        tree = _run_config_tree(config_path) if config_path else {}
        token = COMPILING_SCHEDULE.set(run_args.get("schedule") is not None or bool(tree.get("schedule")))
        try:
            prepared = super().prepare(*args, **kwargs)
        finally:
            COMPILING_SCHEDULE.reset(token)
        self._prepared_run_config = (config_path, tree) if config_path else None
        return prepared

    def _run_config(self, config_path: str) -> dict:
        """The mapping of the run config file ``config_path``: as :meth:`prepare` read it for this run (taken,
        so that a later compile reads the file again), else read now."""
        kept, self._prepared_run_config = getattr(self, "_prepared_run_config", None), None
        return kept[1] if kept is not None and kept[0] == config_path else _run_config_tree(config_path)

    def _validate_entrypoint_args(self, *args, **kwargs):
        try:
            return super()._validate_entrypoint_args(*args, **kwargs)
        except ValueError as exc:
            if not isinstance(exc.__cause__, pydantic.ValidationError):
                raise
            problems = parameter_problems(self.entrypoint, exc.__cause__)
            raise RunConfigError("\n".join([REFUSED, *(f"  - {problem}" for problem in problems)])) from exc


def checked_parameters(pipeline: Pipeline) -> Pipeline:
    """``pipeline`` (made by ZenML's ``@pipeline``) as a :class:`CheckedPipeline`: put above ``@pipeline``."""
    if type(pipeline) is not Pipeline:
        raise TypeError(f"checked_parameters takes a pipeline made by @pipeline, not a {type(pipeline).__name__}")
    pipeline.__class__ = CheckedPipeline
    return pipeline


def run_by_zenml(module: str, pipeline: str, also: str = "") -> None:
    """What a pipeline module run as a script (``python -m pipelines.x -c CONFIG``: its import defines the pipeline
    and runs nothing) says before exiting 2: the command that runs it (``also``: another one)."""
    print(f"{module} is run by ZenML's command: zenml pipeline run {module}.{pipeline} -c RUN_CONFIG.yaml{also}",
          file=sys.stderr)
    sys.exit(2)
