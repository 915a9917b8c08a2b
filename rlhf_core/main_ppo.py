"""The verl-style command line: ``python -m rlhf_core.main_ppo key=value ...`` (also ``rlhf-ppo``).

A verl command works after changing the module name. The config and the data are
checked before any model is loaded; then the trainer resumes from the latest
checkpoint (``trainer.resume_mode``), runs, and a summary says where the metrics and
checkpoints are. The same command run again after a crash or a kill continues the run.

Code trains through the same function, :func:`run` (the pipeline's training step does); code that
drives the trainer step by step (benchmarks, the smoke test) opens it with :func:`trainer_session`,
which closes it, and its Ray workers, however the block ends.

Exit codes: 0 done; 1 a guard stopped the run or a worker failed; 2 bad input (config, data, model,
checkpoint), a reward function that failed (raised, or returned NaN, inf or no number) or a checkpoint that
could not be written; 128 + signal number after Ctrl-C (130) or SIGTERM (143), once the checkpoint of
``trainer.save_on_interrupt`` is saved, or at once, without saving, after a second one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if __name__ == "__main__":  # python -m rlhf_core.main_ppo: run as rlhf-ppo is, before this module imports torch
    # below, so that a Ctrl-C in the command's first seconds ends it with one line and 130, not a traceback
    from rlhf_core.cli import _run

    sys.exit(_run("ppo", None, "python -m rlhf_core.main_ppo"))

import torch

from rlhf_core.config import PPOConfig
from rlhf_core.data.dataset import (
    PREFERENCE_DATA,
    TRUTH_HINT,
    DataError,
    RLHFDataset,
    check_files,
    columns_not_in_every_file,
    is_preference_data,
    missing_columns_problem,
    needed_columns,
    parquet_schema,
)
from rlhf_core.data.schema import (
    ground_truth,
    is_missing,
    prompt_problem,
    read_rows,
    reward_model_problem,
    roles_problem,
    single_precision_truth,
    unknown_roles,
    widened,
)
from rlhf_core.models.loading import (
    ModelError,
    check_model_dir,
    check_policy_dir,
    check_tokenizer_dir,
    import_external_lib,
    load_tokenizer,
    max_positions,
    resolve,
    tokenizer_problems,
)
from rlhf_core.models.lora import target_problems
from rlhf_core.rewards import RewardFn, custom_reward_fn, gsm8k, known_data_sources
from rlhf_core.rewards.manager import RewardError, RewardManager
from rlhf_core.training.checkpoint import (
    CheckpointError,
    RerunPoint,
    check_config,
    check_writable,
    find_resume_checkpoint,
    latest_or_none,
    rerun_advice,
    run_lock,
    set_aside_unsaved_records,
    start_afresh,
)
from rlhf_core.training.guards import TrainingInterrupted
from rlhf_core.training.monitoring import PrometheusExporter

if TYPE_CHECKING:  # the trainer (and the models) load only once a run starts
    from rlhf_core.training.trainer import StepResult


class PreflightError(ValueError):
    """Problems found before any model is loaded; ``errors`` holds one message each."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("cannot start training:\n" + "\n".join(f"  - {e}" for e in errors))


@dataclass
class _SourceScan:
    """What preflight reads of a data key's files: the data sources of the rows with a ground truth and of all
    rows, the rows without a ground truth, and (``file row N: reason``, a few) rows without a data source and
    rows whose ground truth a right answer, written as numbers are, cannot match under the built-in
    rule (:func:`gsm8k.unanswerable`), rows whose ``reward_model`` is no mapping (:func:`reward_model_problem`,
    counted), and (``file row N``, roles) the rows whose prompt messages have roles outside the chat format
    (:func:`unknown_roles`)."""

    graded: set[str] = field(default_factory=set)
    every: set[str] = field(default_factory=set)
    without: int = 0
    no_source: list[str] = field(default_factory=list)
    unanswerable: dict[str, list[str]] = field(default_factory=dict)  # by data source
    malformed: list[str] = field(default_factory=list)
    malformed_rows: int = 0
    unknown_roles: list[tuple[str, list[str]]] = field(default_factory=list)


def _data_sources(paths: list[Path], column: str, prompt_key: str = "prompt", examples: int = 3) -> _SourceScan:
    scan = _SourceScan()
    for path in paths:
        schema = parquet_schema(path)
        names = schema.names
        single = single_precision_truth(schema)
        if column not in names:
            raise DataError(f"{path}: no column {column!r} (data.reward_fn_key) to route the reward by; the file "
                            f"has {', '.join(repr(n) for n in names if not n.startswith('__'))}")
        frame = read_rows(path, columns=[column] + [c for c in ("reward_model", prompt_key)
                                                    if c in names and c != column])
        truths = frame["reward_model"] if "reward_model" in frame else [None] * len(frame)
        if prompt_key in frame:  # a malformed prompt (or a missing column) is the dataset's to name
            scan.unknown_roles += [(f"{path} row {row}", roles) for row, prompt in enumerate(frame[prompt_key])
                                   if prompt_problem(prompt) is None and (roles := unknown_roles(prompt))]
        for row, (source, cell) in enumerate(zip(frame[column], truths)):
            if is_missing(source):
                if len(scan.no_source) < examples:
                    scan.no_source.append(f"{path} row {row}")
                continue
            source, truth = str(source), ground_truth(cell)
            scan.every.add(source)
            problem = reward_model_problem(cell)
            if problem:  # told as such, not as a row without a ground truth (whose advice is to train without one)
                scan.malformed_rows += 1
                if len(scan.malformed) < examples:
                    scan.malformed.append(f"{path} row {row}: {problem}")
                continue
            if truth is None:
                scan.without += 1
                continue
            scan.graded.add(source)
            reason = gsm8k.unanswerable(truth)
            if reason is None and single and isinstance(truth, float) and widened(truth, single):
                reason = (f"{truth!r} is a {single} field's value read back as a double, which no answer matches; "
                          "store the ground truths as text (or float64)")
            found = scan.unanswerable.setdefault(source, []) if reason else []
            if reason and len(found) < examples:
                found.append(f"{path} row {row}: {reason}")
    return scan


def _tokenizer_errors(cfg: PPOConfig, tokenizer_key: str, tokenizer_dir: Path, model_dir: Path) -> list[str]:
    """The actor's tokenizer has a chat template; the data's and the critic's tokenizers (where set)
    share its vocabulary, and the data's its chat template; the actor's and the critic's embeddings cover it.
    Reads files, no weights."""
    tokenizers, models = [], [("actor_rollout_ref.model.path", model_dir)]
    if cfg.data.tokenizer:
        tokenizers.append(("data.tokenizer", cfg.data.tokenizer))
    critic = cfg.critic.model
    if cfg.algorithm.adv_estimator == "gae":
        if critic.tokenizer_path:
            tokenizers.append(("critic.model.tokenizer_path", critic.tokenizer_path))
        elif critic.path:
            tokenizers.append(("critic.model.path", critic.path))
        if critic.path and Path(os.path.expanduser(critic.path), "config.json").is_file():
            models.append(("critic.model.path", critic.path))
    return tokenizer_problems((tokenizer_key, tokenizer_dir), tokenizers, models,
                              cfg.actor_rollout_ref.model.trust_remote_code, renders_prompts=("data.tokenizer",))


def preflight(cfg: PPOConfig) -> RewardFn | None:
    """Check models, data, rewards and length budgets without loading weights; raise PreflightError. Returns the
    custom reward function it loaded (None without one), for :func:`build_trainer` to score with: its file runs
    once a run (top-level code that cannot run twice in a process, a metric registered or a judge model loaded,
    passed here and failed as the trainer loaded it again)."""
    errors: list[str] = []
    reward_fn = None
    arr, trainer = cfg.actor_rollout_ref, cfg.trainer
    actor: tuple[Path, int | None] | None = None  # the actor's model directory and position limit, once read
    if trainer.device == "cuda" and not torch.cuda.is_available():
        errors.append("trainer.device=cuda but no CUDA device is visible; set trainer.device=cpu")
    try:
        check_writable(trainer.default_local_dir, rerun_advice(trainer.resume_mode))
    except CheckpointError as exc:
        errors.append(f"trainer.default_local_dir: {exc}")
    if cfg.world_size > 1:
        ray_address = trainer.ray_address or os.environ.get("RAY_ADDRESS")
        if trainer.nnodes > 1 and not ray_address:
            errors.append(f"trainer.nnodes={trainer.nnodes} needs an existing Ray cluster: set trainer.ray_address "
                          "(or RAY_ADDRESS) to it")
        elif not ray_address and trainer.device == "cuda" and torch.cuda.device_count() < trainer.n_gpus_per_node:
            errors.append(f"trainer.n_gpus_per_node={trainer.n_gpus_per_node} but this machine has "
                          f"{torch.cuda.device_count()} GPUs; lower it or set trainer.ray_address to a larger cluster")
        if ray_address:
            from rlhf_core.workers.group import address_problem

            if (problem := address_problem(ray_address, remember=True)) is not None:
                errors.append(problem)
    try:  # first: it registers the architectures the model configs below may name (verl imports it in each worker)
        import_external_lib(arr.model.external_lib)
    except ModelError as exc:
        errors.append(str(exc))
    try:
        model_dir = check_policy_dir(arr.model.path, "actor_rollout_ref.model.path")
        tokenizer_key = "actor_rollout_ref.model.tokenizer_path" if arr.model.tokenizer_path else \
            "actor_rollout_ref.model.path"
        tokenizer_dir = check_tokenizer_dir(arr.model.tokenizer_path or model_dir, tokenizer_key)
        errors += _tokenizer_errors(cfg, tokenizer_key, tokenizer_dir, model_dir)
        limit = max_positions(model_dir, arr.model.trust_remote_code, arr.model.override_config)
        actor = model_dir, limit
        budget = cfg.data.max_prompt_length + cfg.data.max_response_length
        if limit is not None and budget > limit:
            errors.append(
                f"data.max_prompt_length + data.max_response_length = {budget} exceeds the model's "
                f"max_position_embeddings ({limit}); lower data.max_response_length or data.max_prompt_length")
    except ModelError as exc:
        errors.append(str(exc))
    except (OSError, ValueError) as exc:  # transformers' own: an architecture it does not know, a broken file
        errors.append(f"actor_rollout_ref.model.path: {arr.model.path} cannot be read as a HF model: "
                      f"{str(exc).splitlines()[0]}")
    if actor is not None:
        errors.extend(_lora_problems(cfg, actor[0]))
    errors.extend(_runtime_problems(cfg))
    if cfg.algorithm.adv_estimator == "gae":
        errors.extend(_critic_problems(cfg, actor))
    if cfg.reward_model.enable:
        errors.extend(_reward_model_problems(cfg))
    custom = cfg.custom_reward_function
    if custom.path:
        try:
            reward_fn = custom_reward_fn(cfg)
        except (OSError, ImportError, AttributeError, TypeError) as exc:
            errors.append(f"custom_reward_function: {exc}")
    pairs: dict[Path, list[str]] = {}  # files of preference pairs given as prompts: the keys naming each
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        if key == "data.val_files" and not files:  # no validation: the trainer runs without one
            continue
        try:
            paths = check_files(files, key)
            # told once per file, with the keys naming it, rather than as columns missing from each key's files
            if preference := [path for path in paths if _preference_not_prompts(path, cfg)]:
                for path in preference:
                    pairs.setdefault(path, []).append(key)
                continue
            # the prompts' column, here with the other problems (the dataset would name it alone, after the
            # models load); the ground truths' and the data sources' are counted and named by the scan below
            no_prompts = missing_columns_problem(paths, [cfg.data.prompt_key], key, cfg.data.prompt_key)
            if no_prompts is not None:
                errors.append(no_prompts)
                continue
            partial = columns_not_in_every_file(paths, needed_columns(cfg.data, cfg.needs_ground_truth()))
            if partial is not None:  # the scan would count that file's rows as rows without a ground truth
                errors.append(f"{key}: {partial}")
                continue
            scan = _data_sources(paths, cfg.data.reward_fn_key, cfg.data.prompt_key)
            graded, without = scan.graded, scan.without
            roles = roles_problem(scan.unknown_roles)
            if roles is not None:
                errors.append(f"{key}: {roles}")
            if scan.no_source:
                errors.append(f"{key}: rows without a {cfg.data.reward_fn_key} (the reward is routed by it): "
                              f"{'; '.join(scan.no_source)}")
            if scan.malformed:
                more = "; ..." if scan.malformed_rows > len(scan.malformed) else ""
                errors.append(f"{key}: {scan.malformed_rows} rows' reward_model is no mapping: "
                              f"{'; '.join(scan.malformed)}{more}")
            if without and cfg.needs_ground_truth():
                errors.append(f"{key}: {without} rows have no reward_model.ground_truth{TRUTH_HINT}")
            # the rule grades the rows with a ground truth; the others only where it counts in the reward
            known = set(known_data_sources())
            unknown = sorted((scan.every if cfg.needs_ground_truth() else graded) - known)
            if unknown and not custom.path:
                errors.append(
                    f"{key}: no reward function for data_source {', '.join(unknown)} (known: "
                    f"{', '.join(known_data_sources())}); set custom_reward_function.path and .name")
            rule_rows = [row for source, rows in sorted(scan.unanswerable.items()) if source in known for row in rows]
            if rule_rows and not custom.path:
                errors.append(f"{key}: ground truths a right answer cannot match under the built-in rule reward: "
                              f"{'; '.join(rule_rows[:3])}")
            groups = cfg.algorithm.filter_groups
            if key == "data.train_files" and without and groups.enable and groups.metric == "acc" \
                    and not custom.path:  # dynamic sampling groups training prompts only
                errors.append(f"{key}: {without} rows have no reward_model.ground_truth, so no accuracy: "
                              "algorithm.filter_groups.metric=acc cannot group them; use seq_reward or score")
        except DataError as exc:
            errors.append(str(exc))
    errors += [f"{', '.join(keys)}: {path} has columns {_columns(path)}: {PREFERENCE_DATA}"
               for path, keys in pairs.items()]
    if errors:
        raise PreflightError(errors)
    return reward_fn


def _columns(path: Path) -> str:
    return ", ".join(name for name in parquet_schema(path).names if not name.startswith("__"))  # (pandas' index)


def _preference_not_prompts(path: Path, cfg: PPOConfig) -> bool:
    """Whether ``path`` is a file of preference pairs (:func:`is_preference_data`) without the columns the trainer
    reads prompts and routes rewards by (``data.prompt_key``, ``data.reward_fn_key``)."""
    schema = parquet_schema(path)
    return is_preference_data(schema) and not {cfg.data.prompt_key, cfg.data.reward_fn_key} <= set(schema.names)


def _lora_problems(cfg: PPOConfig, actor_dir: Path) -> list[str]:
    """LoRA target modules that name no module of the model they adapt, or name layers whose adapters the
    rollout's and the export's weights cannot hold (peft and the merge fail on them, or lose them, after the
    weights load). The actor's model, and the critic's where it has LoRA too (its own model, or the actor's)."""
    arr, critic = cfg.actor_rollout_ref.model, cfg.critic.model
    adapted = [("actor_rollout_ref.model", arr.lora_rank, arr.target_modules, actor_dir, arr.trust_remote_code,
                arr.override_config, False)]
    if cfg.algorithm.adv_estimator == "gae":
        adapted.append(("critic.model", critic.lora_rank, critic.target_modules, resolve(critic.path or actor_dir),
                        cfg.value("critic.model.trust_remote_code"), critic.override_config, True))
    return [problem for key, rank, targets, folder, trust, override, is_critic in adapted
            if rank > 0 and Path(folder, "config.json").is_file()
            for problem in target_problems(key, folder, targets, trust, dict(override), critic=is_critic)]


def _runtime_problems(cfg: PPOConfig) -> list[str]:
    """What the run needs besides models and data and meets only after the weights load: the rollout engine's
    package, the loggers' packages, a free Prometheus port."""
    problems = []
    if cfg.actor_rollout_ref.rollout.name == "vllm" and importlib.util.find_spec("vllm") is None:
        problems.append("actor_rollout_ref.rollout.name=vllm but vllm is not installed (pip install -e '.[gpu]' on "
                        "a CUDA machine), or use actor_rollout_ref.rollout.name=hf")
    from rlhf_core.training.tracking import LOGGER_PACKAGES, store_problems

    for logger in cfg.trainer.logger:
        package = LOGGER_PACKAGES.get(logger)
        if package is not None and importlib.util.find_spec(package) is None:
            problems.append(f"trainer.logger includes {logger} but the {package} package is not installed: install "
                            f"it or leave {logger} out")
    problems += store_problems(cfg.trainer.logger)
    port = cfg.trainer.prometheus_port
    if port:  # (0: any free port)
        with socket.socket() as probe:
            # as the exporter's server binds (SO_REUSEADDR): the connections of a run scraped a moment ago, left in
            # TIME_WAIT for a minute, do not hold the port, while a server listening on it still does
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError as exc:
                problems.append(f"trainer.prometheus_port={port}: 127.0.0.1:{port} cannot be served ({exc.strerror}); "
                                "choose another port or null to switch the exporter off")
    return problems


def _critic_problems(cfg: PPOConfig, actor: tuple[Path, int | None] | None) -> list[str]:
    """The critic's directory (a null path is the actor's, checked with it) and its positions: it values every
    prompt + response the actor reads, so a shorter limit fails or misreads positions mid-training. The actor's
    own model at the actor's limit was reported with the actor; a critic.model.override_config that changes the
    limit is reported on its own. ``actor``: the actor's (directory, limit), None where it could not be read."""
    critic = cfg.critic.model
    try:
        folder = check_model_dir(critic.path, "critic.model.path") if critic.path else None
    except ModelError as exc:
        return [str(exc)]
    if folder is None and actor is None:  # the actor's directory is unusable, and reported so
        return []
    folder = folder or actor[0]
    limit = max_positions(folder, cfg.value("critic.model.trust_remote_code"), critic.override_config)
    budget = cfg.data.max_prompt_length + cfg.data.max_response_length
    if limit is None or budget <= limit or (actor is not None and folder.resolve() == actor[0].resolve()
                                            and limit == actor[1]):
        return []
    key = "critic.model.path with critic.model.override_config" if critic.override_config else "critic.model.path"
    remedy = f"use a critic with at least {budget} positions"
    if not critic.override_config and cfg.actor_rollout_ref.model.override_config and actor is not None \
            and folder.resolve() == actor[0].resolve() and actor[1] is not None and actor[1] >= budget > limit:
        # the actor's reach came from its override
        remedy = ("the actor reaches further through actor_rollout_ref.model.override_config, which the critic does "
                  "not take: give it the same in critic.model.override_config")
    return [f"{key}: {folder} has max_position_embeddings {limit} but the critic reads prompt + response sequences "
            f"of up to data.max_prompt_length + data.max_response_length = {budget} tokens; {remedy}, or lower "
            "data.max_response_length or data.max_prompt_length"]


def _reward_model_problems(cfg: PPOConfig) -> list[str]:
    """What is wrong with the reward model of ``reward_model.enable=true`` (config and tokenizers only)."""
    from rlhf_core.rewards.reward_model import KEY, check_reward_model_dir, needs_template_switch

    rm = cfg.reward_model
    try:
        folder = check_reward_model_dir(rm.model.path, rm.model.trust_remote_code)
        switch = needs_template_switch(rm, folder=folder)  # (the directory, its head and its weights' names once)
        limit = max_positions(folder, rm.model.trust_remote_code)
    except ModelError as exc:
        return [str(exc)]
    return _scoring_problems(cfg, switch, limit, f"{KEY}: the tokenizer or chat template of {rm.model.path}",
                             KEY, str(folder))


def trained_reward_model_problems(cfg: PPOConfig) -> list[str]:
    """:func:`_reward_model_problems` of the reward model a pipeline will train from ``reward_model.train`` and
    score PPO's rollouts with, known before it trains: its export keeps the base's tokenizer
    (``reward_model.train.model.tokenizer_path``, else its path) and positions, and records the chat-template
    keywords it was trained with (``reward_model.train.apply_chat_template_kwargs``). The messages name the base."""
    from rlhf_core.rewards.reward_model import load_rm_tokenizer, reads_otherwise

    base, key = cfg.reward_model.train.model, "reward_model.train.model.path"
    tokenizer_key = "reward_model.train.model.tokenizer_path" if base.tokenizer_path else key
    try:
        folder = check_model_dir(base.path, key)
        tokenizer = load_rm_tokenizer(check_tokenizer_dir(base.tokenizer_path or folder, tokenizer_key),
                                      base.trust_remote_code, tokenizer_key)
        switch = reads_otherwise(cfg.reward_model, tokenizer, dict(cfg.reward_model.train.apply_chat_template_kwargs))
        limit = max_positions(folder, base.trust_remote_code)
    except ModelError as exc:
        return [str(exc)]
    return _scoring_problems(cfg, switch, limit, f"{tokenizer_key}: the tokenizer or chat template of "
                             f"{base.tokenizer_path or base.path} (which the reward model trained from it keeps)",
                             key, f"the reward model trained from {folder}")


def _scoring_problems(cfg: PPOConfig, switch: bool, limit: int | None, template_subject: str, key: str,
                      named: str) -> list[str]:
    """A reward model's tokenizer and positions against what it scores. ``switch``: it re-encodes responses (its
    tokenizer or chat template differs from the policy's); ``limit``: its max_position_embeddings; the messages
    open with ``template_subject`` (the key and tokenizer at fault) and ``key`` and name the model ``named``.

    The length: the reward model scores the policy's prompt + response ids as they are (at most
    data.max_prompt_length + data.max_response_length), which nothing cuts; or where it re-encodes, the raw chat
    messages (whole, whatever data.truncation did to the policy's prompt) rendered with its own template, then
    the decoded response re-tokenized and EOS: about the policy's budget where the two tokenizers split text alike,
    cut from the left at ``reward_model.max_length`` (by default the limit itself). Past the limit without that
    key set is refused, as a budget the reward model would mostly see cut; with it, the user has chosen the cut."""
    rm = cfg.reward_model
    problems = []
    if switch and not cfg.data.return_raw_chat:
        problems.append(f"{template_subject} differs from reward_model.model.input_tokenizer "
                        f"({rm.model.input_tokenizer}), so responses are re-encoded from the chat messages: set "
                        "data.return_raw_chat=true (or input_tokenizer=null to feed the policy's ids as they are)")
    budget = cfg.data.max_prompt_length + cfg.data.max_response_length
    if rm.max_length is not None and limit is not None and rm.max_length > limit:
        return problems + [f"reward_model.max_length={rm.max_length} exceeds the max_position_embeddings of {named} "
                           f"({limit})"]
    if not switch and rm.max_length is not None and rm.max_length < budget:
        return problems + [
            f"reward_model.max_length={rm.max_length} cuts only sequences the reward model re-encodes, and {named} "
            "scores the policy's ids as they are (same tokenizer and chat template), up to data.max_prompt_length + "
            f"data.max_response_length = {budget} tokens, uncut; remove the key, or lower data.max_response_length "
            "or data.max_prompt_length"]
    if limit is None or budget <= limit or (switch and rm.max_length is not None):
        return problems
    scored = ("re-encodes each conversation with its own chat template: the whole prompt (data.truncation does not "
              "shorten it) plus the response re-tokenized and EOS, about data.max_prompt_length + "
              f"data.max_response_length = {budget} tokens, more where its tokenizer splits text finer"
              if switch else "scores the policy's prompt + response ids as they are, uncut: up to "
              f"data.max_prompt_length + data.max_response_length = {budget} tokens")
    cut = f", or set reward_model.max_length (at most {limit}) to cut longer ones from the left" if switch else ""
    return problems + [
        f"{key}: {named} has max_position_embeddings {limit} but the reward model {scored}; use a reward model with "
        f"at least {budget} positions{cut}, or lower data.max_response_length or data.max_prompt_length"]


#: build_trainer's default: load the custom reward function itself (a caller that ran :func:`preflight` passes
#: the one it loaded)
LOAD = object()


def build_trainer(cfg: PPOConfig, logger=None, use_worker_group: bool | None = None,
                  stuck_warnings: Sequence[str] | None = None, reward_fn: RewardFn | None | object = LOAD):
    """Tokenizer, datasets, reward manager and trainer for a checked config (on a Ray worker group when
    the world size is above 1, or when ``use_worker_group`` says so; ``stuck_warnings``: the trainer's, None for all).
    ``reward_fn``: the custom reward function :func:`preflight` loaded (None: the built-in rules), else loaded here.
    :func:`trainer_session` closes it."""
    from rlhf_core.training.trainer import PPOTrainer

    import_external_lib(cfg.actor_rollout_ref.model.external_lib)  # as each worker of a group imports it
    tokenizer = load_tokenizer(cfg.value("actor_rollout_ref.model.tokenizer_path"),
                               cfg.actor_rollout_ref.model.trust_remote_code)
    truth = cfg.needs_ground_truth()
    seed = cfg.value("data.seed")  # (null: trainer.seed) the draw of data.train_max_samples and val_max_samples
    train = RLHFDataset(cfg.data.train_files, tokenizer, cfg.data, key="data.train_files", require_ground_truth=truth,
                        max_samples=cfg.data.train_max_samples, seed=seed)
    val = RLHFDataset(cfg.data.val_files, tokenizer, cfg.data, key="data.val_files", require_ground_truth=truth,
                      max_samples=cfg.data.val_max_samples, seed=seed) if cfg.data.val_files else None
    if reward_fn is LOAD:
        reward_fn = custom_reward_fn(cfg)
    return PPOTrainer(cfg, tokenizer, train, val, RewardManager(tokenizer, reward_fn), logger=logger,
                      device=cfg.trainer.device, use_worker_group=use_worker_group, stuck_warnings=stuck_warnings)


class StoppedWithoutSaving(TrainingInterrupted):
    """A second Ctrl-C or SIGTERM stopped the run at once, without saving: ``checkpoint`` is the latest one
    (None where none was saved yet), as it was before; ``step`` the last step finished."""

    def __init__(self, signal_name: str, signal_number: int, step: int, checkpoint: str | None,
                 rerun: str = "rerun the same command"):
        super().__init__(signal_name, signal_number, step, checkpoint)
        kept = (f"the latest checkpoint {checkpoint} is as it was: {rerun} to resume from it"
                if checkpoint else "no checkpoint was saved yet")
        self.args = (f"second {signal_name}: stopped now without saving; {kept}",)


class _StopNow(KeyboardInterrupt):
    """Raised by the signal handler at a second signal. A KeyboardInterrupt (not an Exception), so that no
    ``except Exception`` on the way (a reward function's, the checkpoint writer's) takes it for its own error
    and carries on; :func:`stop_on_signals` turns whatever reaches it then into :class:`StoppedWithoutSaving`."""


def _rerun_point(trainer) -> RerunPoint:
    """How a rerun resumes and the checkpoint it resumes from (None where there is none, or its marker is
    unreadable): the trainer's :meth:`~PPOTrainer.rerun_point`, or for a stand-in trainer, the same command and its
    folder's latest."""
    if hasattr(trainer, "rerun_point"):
        return trainer.rerun_point()
    folder = getattr(trainer, "checkpoint_dir", None)  # (None: a stand-in trainer that saves nowhere)
    return RerunPoint("rerun the same command", None if folder is None else latest_or_none(folder))


@contextlib.contextmanager
def stop_on_signals(trainer, enabled: bool = True):
    """While inside, Ctrl-C and SIGTERM ask ``trainer`` to stop (and save) at the loop's next check, between
    steps (:meth:`PPOTrainer.fit`); a second signal stops at once, without saving, and leaves the block as
    :class:`StoppedWithoutSaving`. Only in the main thread (where Python delivers signals).

    The first signal's message says which step the run stops after: a step whose training is under way
    (``trainer.step_under_way``) is finished, validated and saved first; otherwise the last step done is the
    last, once what is left of it (its validation, logging, checkpoint) is done."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    stop_now: list[tuple[str, int]] = []

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if trainer.stop_requested is not None:
            stop_now.append((name, signum))
            raise _StopNow(f"second {name}: stopping now without saving")
        trainer.stop_requested = (name, signum)
        if (step := getattr(trainer, "step_under_way", None)) is not None:
            plan = f"finishing step {step} (with its validation, if due, and checkpoint), then stopping"
        elif trainer.global_step == 0:
            plan = "stopping before step 1, once the validation under way (if any) is done"
        else:
            plan = (f"stopping after step {trainer.global_step}, once what is left of it (validation, logging, "
                    f"checkpoint) is done; step {trainer.global_step + 1} will not start")
        print(f"received {name}: {plan} (send {name} again to stop now without saving)", file=sys.stderr,
              flush=True)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except BaseException:
        if not stop_now:
            raise
        # what reaches here may be _StopNow or what code on the way made of it (torch's checkpoint writer turns
        # it into a RuntimeError): either way the second signal ended the run, and anything it interrupted (a
        # save's temporary directory) is cleaned up by now, so the latest checkpoint is the one to name
        name, number = stop_now[0]
        rerun, latest = _rerun_point(trainer)
        raise StoppedWithoutSaving(name, number, trainer.global_step, str(latest) if latest else None,
                                   rerun) from None
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


#: how a failed reward function's run goes on: a resume checks the reward's code against the checkpoint's
REWARD_FIX = "fix the reward function (an edit of its code also needs trainer.allow_reward_code_change=true)"


def _reward_failure(trainer, exc: RewardError) -> RewardError:
    """``exc`` said as the run's failure: what the run was doing at which step, the reward function's error,
    and the checkpoint a rerun resumes from, untouched (the step's scores never reached an update or a save)."""
    if exc.step is not None:
        doing = f"training step {exc.step}"
    elif trainer.config.trainer.val_only:
        doing = f"validating (trainer.val_only) at step {trainer.global_step}"
    elif trainer.global_step == 0:
        doing = "validating before step 1"
    else:
        doing = f"validating after step {trainer.global_step}"
    rerun, latest = _rerun_point(trainer)
    resume = (f"the latest checkpoint {latest} is intact: {REWARD_FIX}, then {rerun} to resume from it"
              if latest is not None else "no checkpoint was saved yet")
    return exc.reworded(f"{doing} failed: {exc}\n{resume}")


def _warn_thresholds(trainer_cfg) -> dict[str, float]:
    pairs = (("kl", trainer_cfg.warn_kl), ("grad_norm", trainer_cfg.warn_grad_norm))
    return {key: value for key, value in pairs if value is not None}


@contextlib.contextmanager
def trainer_session(cfg: PPOConfig, logger=None, use_worker_group: bool | None = None,
                    stuck_warnings: Sequence[str] | None = None, reward_fn: RewardFn | None | object = LOAD):
    """:func:`build_trainer`, closed on the way out whatever happens (with a worker group its Ray actors stop
    there instead of outliving the caller). What the benchmarks and the smoke test drive step by step."""
    trainer = build_trainer(cfg, logger=logger, use_worker_group=use_worker_group, stuck_warnings=stuck_warnings,
                            reward_fn=reward_fn)
    try:
        yield trainer
    finally:
        trainer.close()


@dataclass
class RunResult:
    """What :func:`run` produced: the steps done, the final metrics and where everything was written."""

    steps: int
    wall_s: float
    local_dir: str
    checkpoint: str | None  # the checkpoint of the last step (saved if the loop had not)
    history: list[StepResult] = field(default_factory=list)  # the steps run by this call (not those resumed past)
    final_metrics: dict[str, float] = field(default_factory=dict)
    final_val_acc: float | None = None
    final_score: float | None = None
    metrics_file: str | None = None
    resumed_from: str | None = None
    val_before_train: dict[str, float] | None = None  # this call's validation at step 0 (none where it resumed)


def run(cfg: PPOConfig, handle_signals: bool = True) -> RunResult:
    """Train with a validated config: check it, resume per ``trainer.resume_mode``, track (loggers,
    Prometheus), stop cleanly on Ctrl-C/SIGTERM, make sure the last step is checkpointed, close the workers.

    The one way a whole run is made: the command line, the pipeline's training step and anything else
    that trains call this. Signal handlers are installed only when ``handle_signals`` and
    ``trainer.save_on_interrupt`` are on and this is the main thread (Python delivers signals there
    only); elsewhere, e.g. a step run in a worker thread, the caller's own handling applies.
    Raises the errors :func:`rlhf_core.cli.train.ppo` turns into exit codes. A Ctrl-C or SIGTERM that leaves as
    KeyboardInterrupt (outside the training steps, or with ``trainer.save_on_interrupt=false``) carries ``rerun``
    once the trainer is built: its :meth:`~PPOTrainer.rerun_point`, which only it knows (whether a resume_path
    run has saved since).
    """
    from rlhf_core.training.tracking import Tracking

    reward_fn = preflight(cfg)
    trainer_cfg = cfg.trainer
    start = time.time()
    local_dir = Path(os.path.expanduser(trainer_cfg.default_local_dir))  # ~: the home folder, as checkpoints take it
    resume_from = find_resume_checkpoint(cfg)  # before loading models: a bad checkpoint fails fast
    if resume_from is not None:
        check_config(resume_from, cfg, notices=False)  # (the load checks again, and gives the notices)
    ready = None  # the trainer, once built

    def tell_rerun(exc_type, exc, traceback) -> None:
        if isinstance(exc, KeyboardInterrupt) and ready is not None:
            exc.rerun = ready.rerun_point()

    with contextlib.ExitStack() as stack:
        stack.push(tell_rerun)  # first in, so last out: an interrupt while the trainer or the lock closes is told too
        stack.enter_context(run_lock(local_dir))  # before any model loads: one run per checkpoint folder
        if trainer_cfg.resume_mode == "disable" and not trainer_cfg.val_only:
            start_afresh(local_dir)  # an earlier run's checkpoints there: a rerun must not resume that run
        elif resume_from is None and not trainer_cfg.val_only:
            set_aside_unsaved_records(local_dir)  # a run killed before its first save left its steps' records
        trainer = ready = stack.enter_context(trainer_session(cfg, reward_fn=reward_fn))
        if resume_from is not None:
            trainer.load_checkpoint(resume_from)
            print(f"resumed from {resume_from} (step {trainer.global_step} of {trainer.total_steps})",
                  file=sys.stderr)
        tracking = stack.enter_context(Tracking(
            trainer_cfg.logger, trainer_cfg.project_name, trainer_cfg.experiment_name, local_dir,
            config=cfg.to_dict(), total_steps=None if trainer_cfg.val_only else trainer.total_steps,  # (no bar)
            warn_thresholds=_warn_thresholds(trainer_cfg),
            resume_step=trainer.global_step if resume_from is not None else None))
        sinks = [tracking.log]
        if trainer_cfg.prometheus_port is not None:
            exporter = stack.enter_context(PrometheusExporter(
                trainer_cfg.prometheus_port, trainer_cfg.project_name, trainer_cfg.experiment_name))
            print(f"prometheus metrics at {exporter.url}", file=sys.stderr)
            sinks.append(exporter.log)

        def log(metrics: dict, step: int) -> None:
            for sink in sinks:
                sink(metrics, step)

        trainer.logger = log
        trainer.generations_logger = tracking.log_generations
        # the phase under way, of the step in training (or, between two, of the step whose validation or save runs)
        trainer.phase_hooks.append(
            lambda name: tracking.phase(name, trainer.step_under_way or trainer.global_step))
        stack.enter_context(stop_on_signals(trainer, handle_signals and trainer_cfg.save_on_interrupt))
        try:
            history = trainer.fit()
        except RewardError as exc:
            if exc.step is None:  # a training step's scores (a validation scores between steps)
                exc.step = getattr(trainer, "step_under_way", None)
            raise _reward_failure(trainer, exc) from exc
        # (a run that trained no step, its data used up by dynamic sampling before step 1, saves nothing)
        if trainer.last_saved_step != trainer.global_step and trainer.global_step > 0 and not trainer_cfg.val_only:
            trainer.save_checkpoint()
    final = history[-1].metrics if history else {}
    # the checkpoint of the last step: the run's own save, or (nothing trained: val_only, a run already at its
    # end) the checkpoint it loaded, which under resume_path is in another folder than default_local_dir
    saved = trainer.last_saved
    return RunResult(
        steps=trainer.global_step,
        wall_s=time.time() - start,
        local_dir=str(local_dir),
        checkpoint=None if saved is None else str(saved),
        history=history,
        final_metrics=final,
        final_val_acc=trainer.val_accuracy(final),
        final_score=final.get("critic/score/mean"),
        # (none written where nothing was logged: a run resumed by resume_path into a new folder, already complete)
        metrics_file=str(metrics) if "file" in trainer_cfg.logger and (metrics := local_dir / "metrics.jsonl").is_file()
        else None,
        resumed_from=str(resume_from) if resume_from is not None else None,
        val_before_train=trainer.val_before,
    )

