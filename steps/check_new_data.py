"""The retraining gate: is there new data since the production version was trained, and is this training new?"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import Annotated, Any
from uuid import UUID

from zenml import get_step_context, log_metadata, step
from zenml.client import Client
from zenml.enums import ModelStages
from zenml.logger import get_logger
from zenml.utils.pagination_utils import depaginate

from rlhf_core.data.dataset import as_file_list
from rlhf_core.data.validation import DataReadError, fingerprint
from rlhf_core.pipeline.promotion import (
    TRAINING_FINGERPRINTS,
    changed_since,
    check_gate,
    clears_gate,
    config_fingerprint,
    stage_disagreement,
    unrecorded,
)

__all__ = ["check_new_data", "check_production_exists", "config_fingerprint", "gate", "refused_before",
           "reused_version"]

logger = get_logger(__name__)

#: what a skip reason tells the user to do to train anyway
FORCE_HINT = "to train anyway, run with the pipeline parameter force=true (`parameters: {force: true}` in the run config)"


class NoProductionModelError(LookupError):
    """Retraining warm-starts from production; there is none yet."""


def no_production(model_name: str) -> str:
    """What to do where ``model_name`` has no production version for the retraining to warm-start from."""
    return (f"model {model_name!r} has no production version to warm-start from: run the training pipeline "
            f"(zenml pipeline run pipelines.rlhf_ppo.rlhf_ppo_pipeline -c RUN_CONFIG, a run config whose model.name "
            f"is {model_name!r}) until its gate promotes a version, or make a trained version production: "
            f"zenml model version update {shlex.quote(model_name)} VERSION --stage production")


def check_production_exists(model_name: str) -> None:
    """Refuse, while the retraining pipeline compiles, a model without a production version: the run would
    validate the data and define the reward, then stop at :func:`check_new_data` with a model version marked
    failed (under ``rlhf-schedule``, at every run). Raises
    :class:`~rlhf_core.pipeline.run_config.RunConfigError` (``zenml pipeline run`` prints it alone, exit status 1).

    Only a store that answers that there is none refuses: one that cannot be read (a server out of reach) leaves
    the question to the step. Nor is it asked while ``rlhf-schedule`` checks the run config before scheduling, or
    while the pipeline compiles to be registered with a schedule (an orchestrator's): production may be promoted
    before the first run (and the pipeline ``rlhf-schedule`` prepares is not yet given the run config's model)."""
    from rlhf_core.pipeline.checked import COMPILING_SCHEDULE
    from rlhf_core.pipeline.run_config import _SCHEDULING, RunConfigError

    if _SCHEDULING.get() or COMPILING_SCHEDULE.get():
        return
    try:  # (listed: inside a pipeline's function ZenML defers Client().get_model_version to the step's run)
        found = Client().list_model_versions(model=f"equals:{model_name}", stage=ModelStages.PRODUCTION,
                                             size=1).total
    except Exception:  # noqa: BLE001 - a store that cannot be read: the step asks it again where it runs
        logger.debug("production version of %s not looked up while compiling", model_name, exc_info=True)
        return
    if not found:
        raise RunConfigError(no_production(model_name))


def reused_version(model_name: str, version, ask_store: bool = True) -> str | None:
    """Why a retraining run may not go into the model version ``version`` (a run config's ``model.version``), or
    None where it makes a new one (no version given, or a name no version has yet: ZenML fills a template's
    ``{date}``/``{time}`` as the run starts). A stage or a number names an existing version, and so may a name:
    ZenML would reuse it, this run's gate would record its fingerprints on it, and a skipped run would tag it and
    delete it (:func:`~steps.discard_skipped_version.discard_skipped_version`), production's own version where
    ``version: production``. The store is asked only for a plain name, only where ``ask_store``, and not where it
    cannot be read."""
    if version is None:
        return None
    text = str(version)
    hint = ("the retraining makes a new version each run: leave model.version out of the run config, or give a "
            "name no version has, e.g. a template such as 'nightly-{date}'")
    if text.lower() in {stage.value for stage in ModelStages} or text.isdigit():
        return f"model.version {text!r} names an existing version of {model_name!r} (a stage or a number); {hint}"
    if not ask_store:
        return None
    try:
        taken = Client().list_model_versions(model=f"equals:{model_name}", name=f"equals:{text}", size=1).total
    except Exception:  # noqa: BLE001 - a store that cannot be read: the discard step checks again before deleting
        logger.debug("model version %s of %s not looked up", text, model_name, exc_info=True)
        return None
    return f"model.version {text!r} is an existing version of {model_name!r}; {hint}" if taken else None


#: the evaluate step's parameters that decide which problems a candidate is judged on, and how it is run on them
EVALUATION_KEYS = ("batch_size", "max_problems", "sample_seed")


def evaluation_settings(context) -> dict[str, Any]:
    """This run's evaluate step parameters (:data:`EVALUATION_KEYS`, defaults included), as the run's snapshot
    holds them ({} in a pipeline without the step): a refusal measured under other ones may not repeat."""
    step = context.pipeline_run.snapshot.step_configurations.get("evaluate")
    parameters = step.config.parameters if step is not None else {}
    return {key: parameters[key] for key in EVALUATION_KEYS if key in parameters}


def refused_again(meta, min_improvement: float, alpha: float) -> bool:
    """Whether the comparison promote recorded on a version (``gain``, ``p_value``) fails the gate
    ``min_improvement``/``alpha`` too: training the same candidate again would then end in the same refusal.

    False when there is no comparison to judge (a refusal that was not about the candidate: production could
    not be compared, training was skipped): nothing says the candidate itself falls short. The test is
    :func:`~rlhf_core.pipeline.promotion.decide`'s on the recorded figures, since the per-problem results it
    starts from are not recorded on the version (:func:`~rlhf_core.pipeline.promotion.clears_gate`)."""
    gain, p_value = meta.get("gain"), meta.get("p_value")
    if not isinstance(gain, (int, float)) or not isinstance(p_value, (int, float)):
        return False
    return not clears_gate(gain, p_value, min_improvement, alpha)  # judged as promote judges a new one


def refused_before(client: Client, model_name: str, production, dataset_fingerprint: str, config_sha256: str,
                   reward_sha256: str | None, min_improvement: float = 0.0, alpha: float = 0.05,
                   exclude: UUID | None = None, evaluation: dict[str, Any] | None = None):
    """The newest version other than production (and ``exclude``, this run's own) that trained what this run
    would train -- this data, warm-started from this production version, with this trainer config and reward --
    and was compared with this production version, evaluated as this run will evaluate (``evaluation``:
    :func:`evaluation_settings`), and refused on figures that fail the current gate too (:func:`refused_again`);
    None when there is none.

    Training it again gives the same candidate (same seed) against the same production: the same refusal. A
    version whose run failed before the promotion step, whose training was skipped, or that was refused without
    a comparison (production could not be compared) has no verdict on a trained candidate and does not count;
    nor does one refused under a stricter gate than this run's when its figures pass this one, nor one without
    ``warm_started_from``/``config_fingerprint``/``evaluation_settings`` (train_ppo's and the gate's record on each
    version the retraining trains; versions from before they kept them are retrained once)."""
    # the metadata filter narrows the search to versions trained on this data; each is then checked in full
    versions = depaginate(client.list_model_versions, model=model_name, sort_by="desc:number",
                          run_metadata=f"dataset_fingerprint:contains:{dataset_fingerprint}")
    for version in versions:
        if version.id in (production.id, exclude):
            continue
        meta = version.run_metadata
        if (meta.get("promoted") is False and not meta.get("skipped")
                and meta.get("dataset_fingerprint") == dataset_fingerprint
                and meta.get("warm_started_from") == production.name
                and meta.get("previous_production_version") == production.name
                and meta.get("config_fingerprint") == config_sha256 and meta.get("reward_sha256") == reward_sha256
                and meta.get("evaluation_settings") == (evaluation or {})
                and refused_again(meta, min_improvement, alpha)):
            return version
    return None


def gate(client: Client, model_name: str, dataset_fingerprint: str, config_sha256: str, reward_sha256: str | None,
         min_improvement: float = 0.0, alpha: float = 0.05, exclude: UUID | None = None,
         evaluation: dict[str, Any] | None = None,
         whole_fingerprint: Callable[[], str | None] | None = None) -> tuple[str, Any, Any]:
    """(why training is skipped, "" to train; the production version; the refused version that this run would
    repeat, if any). ``min_improvement`` and ``alpha`` are the promotion gate this run's candidate will face,
    ``evaluation`` the evaluate step's settings (:func:`evaluation_settings`). ``whole_fingerprint`` gives the
    same files' :func:`~rlhf_core.data.validation.fingerprint` taken whole, what production versions recorded
    before the splits were told apart: such a version trained on these files counts as trained on this data
    (asked only where production's fingerprint is not this one: it reads the files again)."""
    check_gate(min_improvement, alpha)
    try:
        production = client.get_model_version(model_name, ModelStages.PRODUCTION)
    except KeyError:
        raise NoProductionModelError(no_production(model_name)) from None
    trained_on = production.run_metadata.get("dataset_fingerprint")
    # a production version that recorded no fingerprint was not trained on this data as far as anyone knows (and
    # its None must not match the None of files that cannot be read whole)
    same_data = trained_on is not None and (
        trained_on == dataset_fingerprint or (whole_fingerprint is not None and trained_on == whole_fingerprint()))
    if same_data and not changed_since(production.run_metadata, config_sha256, reward_sha256):
        unknown = unrecorded(production.run_metadata)
        *others, last = ["data"] + [what for what, _ in TRAINING_FINGERPRINTS if what not in unknown]
        compared = f"the {', '.join(others)} and {last} are" if others else f"the {last} is"
        unseen = f"; it recorded no {' or '.join(unknown)} fingerprint to compare with" if unknown else ""
        return (f"{compared} unchanged since production version {production.name} was trained (dataset fingerprint "
                f"{dataset_fingerprint[:16]}...{unseen}); {FORCE_HINT}"), production, None
    refused = refused_before(client, model_name, production, dataset_fingerprint, config_sha256, reward_sha256,
                             min_improvement, alpha, exclude, evaluation)
    if refused is not None:
        reason = (f"version {refused.name} was already trained on this data (dataset fingerprint "
                  f"{dataset_fingerprint[:16]}...) from production version {production.name} with the same trainer "
                  f"config, reward and evaluation settings, and was refused "
                  f"({refused.run_metadata.get('decision_reason')}); its gain "
                  f"and p-value fail this run's promotion gate too (min_improvement={min_improvement:g}, "
                  f"alpha={alpha:g}): training again would repeat that work and its result; {FORCE_HINT}, or "
                  "change the trainer config (e.g. trainer.seed) or the promotion gate (min_improvement, alpha)")
        return reason, production, refused
    return "", production, None


@step(enable_cache=False)
def check_new_data(dataset_fingerprint: str, ppo_config: dict, reward_spec: dict, min_improvement: float = 0.0,
                   alpha: float = 0.05, force: bool = False) -> Annotated[str, "skip_reason"]:
    """An empty string when there is training to do, else why training is skipped: the data, trainer config
    (:func:`config_fingerprint`) and reward are the ones production was trained with, or a version already
    trained on this data from this production version with the same trainer config and reward was refused on
    figures that fail this run's promotion gate (``min_improvement``, ``alpha``: promote's) too. ``force=True``
    trains anyway in both cases; in the second, a changed config (e.g. ``trainer.seed``), reward or a laxer gate
    is new training too.

    Records on this run's model version ``config_fingerprint`` and ``evaluation_settings``: with
    ``warm_started_from`` (recorded by train_ppo: the version that the checkpoint it starts from is linked to;
    production may change before that checkpoint is resolved), what a later run's gate compares with. Where
    production's stage and promotion record disagree (:func:`~rlhf_core.pipeline.promotion.stage_disagreement`),
    the step's record and log say so
    (``production_record``)."""
    context = get_step_context()
    model_name, client = context.model.name, Client()
    config_sha256, evaluation = config_fingerprint(ppo_config), evaluation_settings(context)
    data = ppo_config.get("data", {})

    def whole() -> str | None:
        try:  # (validate_data read these files; one gone since leaves only the fingerprint it recorded to go by)
            return fingerprint(as_file_list(data.get("train_files")) + as_file_list(data.get("val_files") or []))
        except DataReadError:
            return None
    reason, production, refused = gate(client, model_name, dataset_fingerprint, config_sha256,
                                       reward_spec.get("sha256"), min_improvement, alpha,
                                       exclude=context.model_version.id, evaluation=evaluation,
                                       whole_fingerprint=whole)
    trained_on = production.run_metadata.get("dataset_fingerprint")
    disagreement = stage_disagreement(True, production.run_metadata)
    if disagreement:
        logger.warning("production version %s: %s", production.name, disagreement)
    overridden = reason if force else ""
    why = "new data"  # what the record says this run trains for
    if overridden:
        logger.warning("force=true: training although %s", overridden)
        reason = ""
    elif reason:
        logger.warning("retraining skipped: %s", reason)
    elif (changed := changed_since(production.run_metadata, config_sha256, reward_spec.get("sha256"))):
        new_data = trained_on is None or (trained_on != dataset_fingerprint and trained_on != whole())
        why = (f"{'new data, and ' if new_data else ''}the {' and '.join(changed)} changed since production "
               f"version {production.name} was trained")
        logger.info("%s: retraining from its checkpoint", why)
    elif trained_on is None:  # e.g. a version made production by hand: nothing to compare the data with
        logger.info("new data (fingerprint %s...; production version %s recorded no data fingerprint): retraining "
                    "from its checkpoint", dataset_fingerprint[:16], production.name)
    else:
        logger.info("new data (fingerprint %s..., production version %s was trained on %s...): retraining from "
                    "its checkpoint", dataset_fingerprint[:16], production.name, str(trained_on)[:16])
    log_metadata({"config_fingerprint": config_sha256, "evaluation_settings": evaluation}, infer_model=True)
    record = {"production_version": production.name, "dataset_fingerprint": dataset_fingerprint,
              "config_fingerprint": config_sha256, "forced": bool(overridden), "skipped": bool(reason),
              "reason": reason or (f"forced: {overridden}" if overridden else why)}
    if trained_on is not None:  # absent, not the text "None", where production recorded none
        record["production_fingerprint"] = str(trained_on)
    if refused is not None:
        record["refused_version"] = refused.name
    if disagreement:
        record["production_record"] = disagreement
    log_metadata(record)
    return reason
