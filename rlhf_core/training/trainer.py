"""The PPO loop: one controller drives the actor, critic and reward, step by step.

One iteration reads as the data flow of the design: generate -> reward -> old
log-probs -> reference log-probs -> values -> KL in reward -> advantages -> critic
update -> actor update -> metrics. Each phase is timed under its verl name
(``timing_s/gen``, ``timing_s/update_actor``, ...) and marked as a named range, so the
steps listed in ``trainer.profile_steps`` are recorded as torch.profiler traces that show the
rollout/training split (in ``trainer.profile_dir``; TensorBoard or Perfetto open them).

Around the steps, :meth:`PPOTrainer.fit` validates every ``test_freq`` steps and after the last, lets the
guards (:mod:`rlhf_core.training.guards`) judge each step, logs it, then checkpoints it every
``save_freq`` steps, at the end, after a rollback and when a validation sets a new best; one such
iteration is :meth:`PPOTrainer.fit_step`, which a caller's own loop can run on its own schedule.
A stop request (set by a signal handler) ends the run between steps, after a save.

With more than one worker (``trainer.n_gpus_per_node * trainer.nnodes > 1``) the actor and the
critic live on a Ray worker group sharded with FSDP2 (:mod:`rlhf_core.workers.group`); the
trainer drives them through the same calls, and a worker that fails stops the run with its
error and the step, leaving the latest checkpoint as it was.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from rlhf_core import algos, heap
from rlhf_core.batch import Batch
from rlhf_core.config import PPOConfig
from rlhf_core.data.dataset import PromptSampler, RLHFDataset
from rlhf_core.models import cpu_matmul
from rlhf_core.progress import progress_bar
from rlhf_core.rewards.manager import RewardManager
from rlhf_core.rollout import SamplingParams
from rlhf_core.rollout.hf import NonFiniteLogits
from rlhf_core.stats import validation_metrics
from rlhf_core.training import checkpoint, dynamic_sampling
from rlhf_core.training.guards import (
    Guard,
    GuardError,
    GuardEvent,
    KLTightening,
    OverOptimisationGuard,
    TrainingInterrupted,
    proxy_and_gold,
    tighten_kl_control,
)
from rlhf_core.workers.actor import ActorWorker, build_actor
from rlhf_core.workers.common import peak_memory_gb
from rlhf_core.workers.critic import CriticWorker, build_critic
from rlhf_core.workers.group import WorkerError

#: the key of the model each worker's weights are loaded from
MODEL_PATHS = {"actor": "actor_rollout_ref.model.path", "critic": "critic.model.path"}

#: Reward extras reported on their own terms, not as ``critic/<key>/mean`` of every response.
_OWN_METRICS = ("score", "acc")


def reported_extras(extras: dict, shaped: bool) -> list[str]:
    """The per-response numbers among the reward extras to report as they are: a reward model's
    ``rm_score`` and ``gold_reward`` (the rule's score), and the other numeric entries a reward
    function returns (``score`` and ``acc`` have metrics of their own, and so has ``overlong_reward`` where
    ``shaped``, ``reward_model.overlong_buffer.enable``, put DAPO's penalty there; else it is the reward
    function's own entry of that name, reported as any other)."""
    own = _OWN_METRICS + (("overlong_reward",) if shaped else ())
    return [key for key, value in extras.items() if isinstance(value, torch.Tensor) and key not in own]


@contextmanager
def timed(name: str, timings: dict[str, float]):
    """Time a phase into ``timings`` and mark it as a named range for torch.profiler traces."""
    start = time.perf_counter()
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        timings[f"timing_s/{name}"] = timings.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


@contextmanager
def profiled(step: int, steps: list[int] | None, directory: str):
    """Record a torch.profiler trace of ``step`` when it is one of ``steps``.

    The trace is written as ``<directory>/step_<N>.*.pt.trace.json``, which TensorBoard's profiler
    plugin and Perfetto (ui.perfetto.dev) open; each phase of the step is a named range.
    """
    if not steps or step not in steps:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    Path(directory).mkdir(parents=True, exist_ok=True)
    handler = torch.profiler.tensorboard_trace_handler(directory, worker_name=f"step_{step}")
    with torch.profiler.profile(activities=activities, on_trace_ready=handler, record_shapes=False):
        yield


def _mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float(algos.masked_mean(values, mask)) if mask.sum() > 0 else 0.0


def graded_rewards(sources: Sequence[str], score: Sequence[float], apart: dict[tuple[str, str], list[float]],
                   n: int) -> dict[str, float]:
    """``val-aux/<source>/graded_reward/mean@n`` and, with a reward model, ``graded_rm_score/mean@n``: the reward
    and the model's score of a source's graded responses alone (those with a gold reward), where only some of them
    are graded; the over-optimisation guard compares them with their gold."""
    metrics = {}
    for source in dict.fromkeys(sources):
        gold = apart.get(("gold_reward", source))
        if gold is None:
            continue
        scores = [value for value, of in zip(score, sources) if of == source]  # in the order gold was gathered
        for name, values in (("graded_reward", scores), ("graded_rm_score", apart.get(("rm_score", source), []))):
            graded = [value for value, truth in zip(values, gold, strict=bool(values)) if not math.isnan(truth)]
            if graded and len(graded) < len(values):
                metrics[f"val-aux/{source}/{name}/mean@{n}"] = float(np.mean(graded))
    return metrics


def _nanmean(values) -> float | None:
    """The mean of the entries that are not NaN (a reward function's key missing on some responses, a prompt
    without a ground truth), None where every entry is: nothing to report."""
    values = torch.as_tensor(values, dtype=torch.float64)
    return None if bool(values.isnan().all()) else float(torch.nanmean(values))


def _spread(name: str, values: torch.Tensor) -> dict[str, float]:
    """``<name>/mean``, ``/max`` and ``/min`` of ``values`` (0 when there are none)."""
    if values.numel() == 0:
        return {f"{name}/mean": 0.0, f"{name}/max": 0.0, f"{name}/min": 0.0}
    values = values.float()
    return {f"{name}/mean": float(values.mean()), f"{name}/max": float(values.max()), f"{name}/min": float(values.min())}


def data_metrics(batch: Batch, max_response_length: int, max_prompt_length: int) -> dict[str, float]:
    """verl's per-step data metrics: scores, rewards (of the responses not aborted), advantages, returns, values
    (mean, max, min; the last three over the loss tokens), response and prompt lengths (with the share at their
    limits), and newer verl's lengths of the responses that were not aborted (those with at least one token)
    beside the share that were (none of the HF rollout's; a vLLM request cut off before its first token)."""
    mask = batch["response_mask"].bool()  # the losses' mask (narrower than the responses after rejection)
    prompt_width = batch["prompts"].shape[1]
    response_length = batch["attention_mask"][:, prompt_width:].float().sum(-1)  # (bs,) as sampled
    prompt_length = batch["attention_mask"][:, :prompt_width].float().sum(-1)
    answered = response_length > 0  # verl's scores and rewards leave the aborted responses out (none scored)
    # with every response aborted there is no score to report (verl stops there): the keys are left out rather
    # than read as a score of 0 by the trackers, the monitoring exports and the run's final score
    scored = {**_spread("critic/score", batch["token_level_scores"].sum(-1)[answered]),
              **_spread("critic/rewards", batch["token_level_rewards"].sum(-1)[answered])} if answered.any() else {}
    metrics = {
        **scored,
        **_spread("critic/advantages", batch["advantages"][mask]),
        **_spread("critic/returns", batch["returns"][mask]),
        **_spread("response_length", response_length),
        "response_length/clip_ratio": float((response_length >= max_response_length).float().mean()),
        **_spread("response_length_non_aborted", kept := response_length[answered]),
        "response_length_non_aborted/clip_ratio": float((kept >= max_response_length).float().mean())
        if kept.numel() else 0.0,
        "response/aborted_ratio": float((response_length == 0).float().mean()),
        **_spread("prompt_length", prompt_length),
        "prompt_length/clip_ratio": float((prompt_length >= max_prompt_length).float().mean()),
    }
    if "values" in batch:
        metrics.update(_spread("critic/values", batch["values"][mask]))
        if mask.sum() >= 2:
            metrics["critic/vf_explained_var"] = algos.compute_explained_variance(
                batch["values"], batch["returns"], mask.float())
    return metrics


def scores_without_spread(scores: torch.Tensor, groups: Sequence | None = None,
                          baselines: torch.Tensor | None = None, top_only: bool = False) -> bool:
    """Whether the responses' scores (bs,) tell none of them apart where the advantage estimator compares them, so
    that the advantages carry no reward signal:

    - ``baselines`` (bs,), ReMax's (the score of each prompt's greedy response): every score equals its baseline,
      so every advantage (score minus baseline) is 0;
    - ``groups``, each response's group id, for the group estimators (GRPO, RLOO, ...): within each group of two
      or more; a group of one (``rollout.n=1``) has no other response to compare with, and these estimators take
      its score as it stands (REINFORCE++'s baseline variant whitens it over the batch), so the responses of such
      groups are compared over the batch;
    - ``groups`` with ``top_only`` (grpo_passk, whose advantage goes to a group's one best response, and to none
      where the best score is shared): every group's best score is shared;
    - neither (GAE, REINFORCE++): over the whole batch (with a critic the advantages then follow the values
      alone)."""
    if baselines is not None:
        return bool((scores == baselines).all())
    if groups is None:
        return bool(scores.numel() == 0 or (scores == scores[0]).all())
    members: dict = {}
    for group, score in zip(groups, scores.tolist()):
        members.setdefault(group, []).append(score)
    if top_only:
        return all(values.count(max(values)) > 1 for values in members.values())
    alone = {values[0] for values in members.values() if len(values) == 1}  # compared over the batch
    return len(alone) <= 1 and all(len(set(values)) == 1 for values in members.values())


#: steps between two warnings of the same kind about a run that cannot learn (:meth:`PPOTrainer._warn_if_stuck`)
STUCK_WARNING_EVERY = 20
#: the kinds of warning about a run that cannot learn (:meth:`PPOTrainer._warn_if_stuck`): most responses cut off
#: at data.max_response_length ("clip"), scores that tell no responses apart ("flat")
STUCK_WARNINGS = ("clip", "flat")
#: the share of responses cut at data.max_response_length from which the run is warned
CLIP_RATIO_WARNING = 0.9
#: responses cut off in a step whose scores tell none apart, from which its warning names the length beside the
#: reward (under CLIP_RATIO_WARNING the reward is the likelier cause; a few prompts a step move a share across it)
CLIP_RATIO_ALSO = 0.5


def pick_generations(texts: Sequence[tuple[str, str]], scores: Sequence[float], count: int) -> list[dict]:
    """``count`` validation samples as verl picks them: sorted by their input alone (a stable sort: the responses
    to one prompt stay in the order they were generated), shuffled by a generator seeded 42, the first ``count``
    taken, so that the same prompts are shown at every validation."""
    samples = sorted(((prompt, response, float(score)) for (prompt, response), score in zip(texts, scores)),
                     key=lambda sample: sample[0])
    np.random.RandomState(42).shuffle(samples)
    return [{"input": i, "output": o, "score": s} for i, o, s in samples[:count]]


def timing_per_token(timings: dict[str, float], response_tokens: float, tokens: float) -> dict[str, float]:
    """verl's ``timing_per_token_ms/<phase>``: generation per response token, the passes over whole sequences
    (reference, values, advantages, the updates) per token of the batch."""
    out = {}
    for name, count in [("gen", response_tokens), *((n, tokens) for n in
                                                    ("ref", "values", "adv", "update_critic", "update_actor"))]:
        if f"timing_s/{name}" in timings and count > 0:
            out[f"timing_per_token_ms/{name}"] = timings[f"timing_s/{name}"] * 1000 / count
    return out


#: the distributions whose versions a run records (:func:`run_record`): those that compute its numbers
RECORDED_PACKAGES = ("torch", "numpy", "transformers", "tokenizers", "peft", "vllm")


def run_record(config: PPOConfig) -> dict:
    """What a person needs, beside the checkpoint's ``config.yaml``, to run a run again: its seeds as it took them
    (``data.seed``'s null as ``trainer.seed``), Python's and the numerical libraries' versions, a SHA-256 over
    ``rlhf_core``'s code, and torch's intra-op threads (another count may round the CPU's float sums otherwise)."""
    import importlib.metadata
    import platform

    from rlhf_core.workers.group import code_fingerprint

    versions = {"python": platform.python_version()}
    for name in RECORDED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass  # not installed (vllm on CPU): not part of this run
    return {"seeds": {"trainer.seed": config.trainer.seed, "data.seed": config.value("data.seed")},
            "versions": versions, "rlhf_core_sha256": code_fingerprint()[1], "torch_threads": torch.get_num_threads(),
            "platform": platform.platform()}


def changed_since(saved: dict | None, now: dict) -> list[str]:
    """The entries of a checkpoint's :func:`run_record` a resume runs with otherwise, as ``name: saved -> now``
    (library versions, code, threads, platform); empty for a checkpoint saved before runs recorded them."""
    if not saved:
        return []
    pairs = [*((name, saved.get("versions", {}).get(name), version) for name, version in now["versions"].items()),
             *((key, saved.get(key), now[key]) for key in ("rlhf_core_sha256", "torch_threads", "platform"))]
    return [f"{name}: {before} -> {after}" for name, before, after in pairs if before is not None and before != after]


def weights_origin(step: int, resumed_from: Path | None, latest: Path | None, model: str | Sequence[str], rates: str,
                   section: str, rerun: str, lr_on_resume: bool) -> str:
    """Where the NaN or inf weights a run held after step ``step`` came from, and how to go on, as PPO's trainer and
    the reward model's both say it: the model the run loaded (``model``: its key and path, or a list of one a role
    where several hold NaN, as the actor's and the critic's) or the checkpoint it resumed from (``resumed_from``),
    where it has trained no step since; else an update of this run, and what the checkpoint a rerun resumes from
    (``latest``, ``rerun``: how) holds. A rerun with the same settings replays the same updates, so the way on is a
    lower learning rate (``rates``), on a resume where ``lr_on_resume`` (the keys may change on one), else in a new
    run (``section``: the run's resume keys)."""
    new_run = (f"start a new run with a lower learning rate ({rates}; {section}.resume_mode=disable, or another "
               f"{section}.default_local_dir)")
    if step == (checkpoint.step_of(resumed_from) if resumed_from is not None else 0):  # no update in this run
        if resumed_from is None:
            models = [model] if isinstance(model, str) else list(model)
            check = "that model" if len(models) == 1 else "each of them"
            return (f"the weights are those of {' and '.join(models)}, as the run loaded them: check {check} for NaN "
                    "or inf weights")
        holder, holds = f"the checkpoint the run resumed from, {resumed_from},", resumed_from
    elif latest is None:
        return f"no checkpoint was saved yet: rerun with a lower learning rate ({rates})"
    elif checkpoint.step_of(latest) < step:  # its weights were finite: the updates after it diverged
        go_on = (f"lower the learning rate ({rates} may change on a resume), then {rerun} to resume from it"
                 if lr_on_resume else new_run)
        return (f"the latest checkpoint {latest} is intact and from before the divergence, but a rerun with the same "
                f"settings replays the steps after it: {go_on}")
    else:
        holder, holds = f"the latest checkpoint {latest}", latest
    earlier = checkpoint.newest_intact(holds.parent, before=checkpoint.step_of(holds)) if lr_on_resume else None
    instead = (f"resume from {earlier} with a lower learning rate ({section}.resume_mode=resume_path "
               f"{section}.resume_from_path={earlier})" if earlier is not None else
               f"no earlier checkpoint is intact: {new_run}" if lr_on_resume else new_run)
    return f"{holder} holds these weights, so a resume from it fails again: {instead}"


class LoggingError(RuntimeError):
    """A logger could not record a step's metrics or its validation generations (a full disk, a file logger's path
    taken by a folder): the run stops, as where a worker fails, and the message names the checkpoint a rerun resumes
    from."""


@dataclass
class StepResult:
    step: int
    metrics: dict[str, float]
    event: GuardEvent | None = None  # a guard's event at this step (carried out: a rollback)


class PPOTrainer:
    """Runs PPO on prompt data with an actor (and, for GAE, a critic)."""

    def __init__(self, config: PPOConfig, tokenizer, train_dataset: RLHFDataset, val_dataset: RLHFDataset | None,
                 reward_manager: RewardManager, logger: Callable[[dict[str, float], int], None] | None = None,
                 device: str = "cpu", use_worker_group: bool | None = None,
                 stuck_warnings: Sequence[str] | None = None):
        stuck_warnings = STUCK_WARNINGS if stuck_warnings is None else stuck_warnings
        if unknown := sorted(set(stuck_warnings) - set(STUCK_WARNINGS)):
            raise ValueError(f"stuck_warnings: {', '.join(unknown)} is not a kind of warning the trainer gives "
                             f"(its kinds: {', '.join(STUCK_WARNINGS)})")
        self.config = config
        self.tokenizer = tokenizer
        self.train_dataset = train_dataset
        self.val_dataset = val_dataset
        self.reward_manager = reward_manager
        self.logger = logger
        arr, algo = config.actor_rollout_ref, config.algorithm
        self.use_critic = algo.adv_estimator in algos.ADV_ESTIMATORS_NEED_CRITIC
        self.use_ref = algo.use_kl_in_reward or arr.actor.use_kl_loss
        batch_key, batch = config.prompt_batch()  # dynamic sampling draws its generation rounds' prompts
        self.sampler = PromptSampler(len(train_dataset), batch, config.data.shuffle, config.value("data.seed"),
                                     key=batch_key, dropped=getattr(train_dataset, "dropped_overlong", 0),
                                     sampled=getattr(train_dataset, "sampled", None))
        # as in verl's loop: training ends after total_epochs passes over the data, or total_training_steps
        # steps if that comes first (DAPO's dynamic sampling may draw several batches a step)
        self.total_batches = self.sampler.batches_per_epoch * config.trainer.total_epochs
        self.total_steps = min(config.trainer.total_training_steps or self.total_batches, self.total_batches)
        # the learning-rate schedule runs over total_training_steps where it is set, as verl's does, even where the
        # data end training sooner
        schedule_steps = config.trainer.total_training_steps or self.total_batches
        seed = config.trainer.seed
        torch.manual_seed(seed)
        # Python's and NumPy's global streams too: a custom reward function drawing from them scores the same
        # from a fresh start (a resume restores all three from the checkpoint)
        random.seed(seed)
        np.random.seed(seed % 2**32)  # NumPy takes 32 bits; torch took the number as it is
        cpu_matmul.configure(config.trainer.cpu_matmul, config.trainer.cpu_matmul_dtype)
        heap.configure(config.trainer.keep_freed_memory)
        if config.trainer.cpu_matmul_dtype == "bfloat16" and device == "cpu" and not cpu_matmul.native_bf16():
            print("notice: trainer.cpu_matmul_dtype=bfloat16 on a CPU without AMX or AVX512-BF16: its bfloat16 "
                  "products are emulated, likely slower than float32's", file=sys.stderr, flush=True)
        self.worker_group = None
        if config.world_size > 1 if use_worker_group is None else use_worker_group:
            from rlhf_core.workers.group import build_worker_groups

            self.worker_group, self.actor, self.critic = build_worker_groups(
                config, schedule_steps, self.use_ref, self.use_critic)
        else:
            self.actor = build_actor(config, tokenizer, schedule_steps, self.use_ref, seed, device)
            self.critic = None
            if self.use_critic:
                self.critic = build_critic(config, schedule_steps, seed, device)
        if config.reward_model.enable:  # a learned reward model, on the worker group where there is one
            from rlhf_core.rewards.reward_model import RewardModelManager, RewardModelWorker
            from rlhf_core.workers.group import RewardModelGroup

            scorer = RewardModelGroup(self.worker_group) if self.worker_group is not None \
                else RewardModelWorker(config.reward_model, device=device, policy_path=arr.model.path)
            self.reward_manager = RewardModelManager(reward_manager, scorer, config.reward_model)
        kl = algo.kl_ctrl
        # runtime coefficients: they start from the config and are trainer state from then on (a guard
        # may change them; checkpoints save them); the config stays as the run was started
        self.kl_ctrl = algos.make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.kl_loss_coef = arr.actor.kl_loss_coef
        self.global_step = 0
        self.history: list[StepResult] = []
        self.val_before: dict[str, float] | None = None  # the validation before the first step, where fit ran one
        self.resumed = False  # by load_checkpoint
        self.val_generations: list[dict] = []  # the last validation's samples (trainer.log_val_generations)
        #: the last validation's (problem id, acc) of each response, as the reward graded it
        self.val_verdicts: list[tuple[str, float]] = []
        #: called with (samples, step) after each validation when trainer.log_val_generations > 0
        self.generations_logger: Callable[[list[dict], int], None] | None = None
        self._sampled_tokens = 0.0  # response tokens the step's rollouts sampled (perf/rollout_tokens_per_s)
        #: context-manager factories entered around every timed phase, the validation (``testing``) and each
        #: checkpoint save (``save_checkpoint``) included, called with its name (innermost last): a memory
        #: sampler's tag, a tracer's span, the console's display of the phase under way
        self.phase_hooks: list[Callable[[str], AbstractContextManager]] = []
        #: run the old log-prob pass even where the update is on-policy (:meth:`_on_policy_update`): the dry run's
        #: one mini-batch would otherwise skip the pass whose agreement with the update its KL check measures
        self.always_old_log_prob = False
        # the step whose batch is drawn and whose training is under way (None between two steps' training, and
        # still set where the training failed): a stop request lets it finish; its failures are that step's
        self.step_under_way: int | None = None
        self.config_yaml = config.to_yaml()  # as the run started: what a resume is checked against
        self.model_fingerprints = checkpoint.model_fingerprints(config)  # and the model folders it loaded
        self.data_fingerprints = checkpoint.data_fingerprints(train_dataset.paths)  # and the training files it read
        self.run_record = run_record(config)  # seeds, versions, code, threads: saved in every checkpoint
        self.checkpoint_dir = Path(os.path.expanduser(config.trainer.default_local_dir))
        self.guard = Guard(config.trainer.guard)
        self.overopt = OverOptimisationGuard(config.trainer.guard)  # acts only where proxy and gold are logged
        self._noted_idle_guards = False  # said once that a guard has nothing to watch (prompts alone)
        self.scores_flat = False  # whether the last train_step's scores told no responses apart (scores_without_spread)
        self._stuck_warned: dict[str, int] = {}  # the step each kind of warning of a run that cannot learn was given
        self.stuck_warnings = frozenset(stuck_warnings)  # the kinds of those warnings given (STUCK_WARNINGS)
        # the checkpoint the run last saved (save_checkpoint) or loaded (load_checkpoint, from checkpoint_dir or from
        # another folder); None where there is none. Its step: last_saved_step
        self.last_saved: Path | None = None
        self.resumed_from: Path | None = None  # the checkpoint load_checkpoint loaded
        # the folder of each checkpoint the guards may restore (a resume's earlier ones are beside the one it
        # loaded, which need not be under default_local_dir); the rest are this run's, in checkpoint_dir
        self.anchor_folders: dict[int, Path] = {}
        self.stop_requested: tuple[str, int] | None = None  # (signal name, number), set by a signal handler
        corr = algo.rollout_correction
        if (corr.rollout_is or corr.rollout_rs) and arr.rollout.name == "hf":
            print("NOTE algorithm.rollout_correction is a no-op with actor_rollout_ref.rollout.name=hf: the HF engine "
                  "samples with the trainer's own weights and returns no log-probs of its own to correct",
                  file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ sampling settings
    def _train_params(self) -> SamplingParams:
        r = self.config.actor_rollout_ref.rollout
        return SamplingParams(n=r.n, max_new_tokens=self.config.data.max_response_length, do_sample=r.do_sample,
                              temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, ignore_eos=r.ignore_eos)

    def _val_params(self) -> SamplingParams:
        v = self.config.actor_rollout_ref.rollout.val_kwargs
        return SamplingParams(n=v.n, max_new_tokens=self.config.data.max_response_length, do_sample=v.do_sample,
                              temperature=v.temperature, top_p=v.top_p, top_k=v.top_k)

    def _score(self, batch: Batch) -> dict:
        if hasattr(self.reward_manager, "score_batch"):  # a manager (a reward model reads whole sequences)
            scores, extras = self.reward_manager.score_batch(batch)
        else:  # a plain function of the responses, as RewardManager.__call__
            scores, extras = self.reward_manager(batch["responses"], batch["response_mask"],
                                                 batch.meta["data_source"], batch.meta["ground_truth"],
                                                 batch.meta["extra_info"])
        batch["token_level_scores"] = scores
        return extras

    # ------------------------------------------------------------------ rollout and its variants
    def _shape_overlong(self, batch: Batch, extras: dict) -> None:
        """DAPO's overlong reward shaping: the soft length penalty added to each score (``overlong_reward``)."""
        overlong = self.config.reward_model.overlong_buffer
        if not overlong.enable:
            return
        mask = batch["response_mask"]
        penalty = algos.compute_overlong_penalty(mask.sum(-1), self.config.data.max_response_length, overlong.len,
                                                 overlong.penalty_factor)  # (bs,)
        batch["token_level_scores"] = algos.add_at_last_token(batch["token_level_scores"], mask, penalty)
        extras["overlong_reward"] = penalty.float()

    def _rollout(self, prompts: Batch, timings: dict[str, float]) -> tuple[Batch, dict]:
        """One generation batch: responses and their scores, and for ``remax`` the score of each prompt's
        greedy response as ``reward_baselines`` (bs,)."""
        with self.phase("gen", timings):
            batch = self.actor.generate(prompts, self._train_params())
        # every token sampled in timing_s/gen, the batches dynamic sampling drops included
        self._sampled_tokens += float(batch["attention_mask"][:, batch["prompts"].shape[1]:].sum())
        with self.phase("reward", timings):
            extras = self._score(batch)
            self._shape_overlong(batch, extras)
        if self.config.algorithm.adv_estimator == "remax":
            with self.phase("gen_max", timings):  # its scores too, as verl times them (timing_s/reward: the samples')
                greedy = self.actor.generate(prompts, replace(self._train_params(), n=1, do_sample=False))
                self._score(greedy)
                self._shape_overlong(greedy, {})
            n = self.config.actor_rollout_ref.rollout.n
            batch["reward_baselines"] = greedy["token_level_scores"].sum(-1).repeat_interleave(n)  # (bs,)
        return batch, extras

    def _generate_and_score(self, prompts: Batch, timings: dict[str, float]) -> tuple[Batch, dict, dict]:
        """The step's scored rollouts: one generation batch, or DAPO's dynamic sampling over as many as it takes
        (see :mod:`rlhf_core.training.dynamic_sampling`)."""
        groups = self.config.algorithm.filter_groups
        if not groups.enable:
            return (*self._rollout(prompts, timings), {})

        def next_prompts() -> Batch | None:  # None: total_epochs passes drawn
            return None if self.data_exhausted else self.train_dataset.collate(self.sampler.next_batch()[1])

        multiple = 1
        if self.worker_group is not None:  # each update shares whole mini-batches among the workers
            actor_mini = self.config.actor_rollout_ref.actor.ppo_mini_batch_size
            multiple = math.lcm(actor_mini, self.config.value("critic.ppo_mini_batch_size")) \
                if self.use_critic else actor_mini
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return dynamic_sampling.collect_groups(
            prompts, next_prompts, lambda p: self._rollout(p, timings), metric=groups.metric,
            max_num_gen_batches=groups.max_num_gen_batches, pad_id=pad_id, group_multiple=multiple,
            target=self.config.data.train_batch_size)

    def _correct_rollout(self, batch: Batch, metrics: dict[str, float]) -> None:
        """Rollout correction between the engine's ``rollout_log_prob`` and ``old_log_prob``: truncated
        importance weights (``rollout_is_weights``) and rejection (a narrower ``response_mask``)."""
        corr = self.config.algorithm.rollout_correction
        if not (corr.rollout_is or corr.rollout_rs) or "rollout_log_prob" not in batch:
            return
        weights, mask, corr_metrics = algos.compute_rollout_correction(
            batch["old_log_prob"], batch["rollout_log_prob"], batch["response_mask"].float(), corr.rollout_is,
            corr.rollout_is_threshold, corr.rollout_rs, corr.rollout_rs_threshold)
        batch["response_mask"] = mask.to(batch["response_mask"].dtype)
        if weights is not None:
            batch["rollout_is_weights"] = weights
        metrics.update(corr_metrics)

    # ------------------------------------------------------------------ one iteration
    def _on_policy_update(self) -> bool:
        """Whether the actor update is one epoch over one mini-batch of this step's samples, so that the
        old log-probs are the update's own (detached) and need no separate pass: nothing uses them before
        the update (no KL in the reward, an HF rollout with no log-probs of its own to compare) and the
        actor updates this step (past ``critic_warmup``); never where :attr:`always_old_log_prob` asks for the pass."""
        cfg = self.config
        actor = cfg.actor_rollout_ref.actor
        return (not self.always_old_log_prob
                and actor.ppo_epochs == 1 and actor.ppo_mini_batch_size == cfg.data.train_batch_size
                and not cfg.algorithm.use_kl_in_reward and cfg.actor_rollout_ref.rollout.name == "hf"
                and self.global_step >= cfg.trainer.critic_warmup)

    @contextmanager
    def hooked(self, name: str):
        """Inside each of ``phase_hooks``, entered with ``name`` (the phase's ``timing_s/<name>``)."""
        with ExitStack() as hooks:
            for hook in self.phase_hooks:
                hooks.enter_context(hook(name))
            yield

    @contextmanager
    def phase(self, name: str, timings: dict[str, float]):
        """A phase of the step, timed into ``timings`` (:func:`timed`) inside each of ``phase_hooks``."""
        with self.hooked(name), timed(name, timings):
            yield

    def train_step(self, prompts: Batch) -> dict[str, float]:
        cfg, algo = self.config, self.config.algorithm
        n = cfg.actor_rollout_ref.rollout.n
        timings: dict[str, float] = {}
        self._sampled_tokens = 0.0
        with self.phase("step", timings):
            batch, extras, metrics = self._generate_and_score(prompts, timings)
            if not self._on_policy_update():
                with self.phase("old_log_prob", timings):
                    batch["old_log_prob"], entropy = self.actor.compute_log_prob(batch)
            else:  # the pass is skipped (the update's own first log-probs are the old ones): verl's key, 0 s
                timings["timing_s/old_log_prob"] = 0.0
            if self.use_ref:
                with self.phase("ref", timings):
                    batch["ref_log_prob"] = self.actor.compute_ref_log_prob(batch)
            if self.use_critic:
                with self.phase("values", timings):
                    batch["values"] = self.critic.compute_values(batch)
            if "old_log_prob" in batch:  # else the update measures the entropy
                actor_cfg = self.config.actor_rollout_ref.actor  # aggregated as the policy loss is, as verl does
                metrics["actor/entropy"] = float(algos.agg_loss(
                    entropy, batch["response_mask"].float(), actor_cfg.loss_agg_mode,
                    loss_scale_factor=self.config.value("actor_rollout_ref.actor.loss_scale_factor")))
            if "rollout_log_prob" in batch:  # the sampler's own log-probs (vLLM): how far they are from ours
                metrics["rollout/logprob_gap"] = _mean((batch["old_log_prob"] - batch["rollout_log_prob"]).abs(),
                                                       batch["response_mask"].float())
            with self.phase("adv", timings):
                sampled = batch["response_mask"]  # every token the engine sampled
                if algo.use_kl_in_reward:  # over every sampled token, before any is rejected (as verl orders it)
                    rewards, _, kl_metrics = algos.apply_kl_penalty(
                        batch["token_level_scores"], batch["old_log_prob"], batch["ref_log_prob"],
                        sampled, self.kl_ctrl, algo.kl_penalty)
                    metrics.update(kl_metrics)
                else:
                    rewards = batch["token_level_scores"]
                batch["token_level_rewards"] = rewards
                self._correct_rollout(batch, metrics)  # rejection narrows batch["response_mask"], the losses' mask
                # Credit is given over the responses as sampled: a rejected token still earned its reward and
                # still counts in its group's statistics; rejection only keeps it out of the losses.
                advantages, returns = algos.compute_advantage(
                    algo.adv_estimator, rewards, sampled.float(),
                    values=batch.tensors.get("values"), index=batch.meta["uid"], gamma=algo.gamma, lam=algo.lam,
                    norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
                    reward_baselines=batch.tensors.get("reward_baselines"))
                if batch["response_mask"] is not sampled:
                    kept = batch["response_mask"].to(advantages.dtype)
                    advantages, returns = advantages * kept, returns * kept
                batch["advantages"], batch["returns"] = advantages, returns
            if self.use_critic:
                with self.phase("update_critic", timings):
                    metrics.update(self.critic.update_critic(batch, n))
            if self.global_step >= cfg.trainer.critic_warmup:
                with self.phase("update_actor", timings):
                    metrics.update(self.actor.update_policy(batch, n, kl_loss_coef=self.kl_loss_coef))
        metrics.update(data_metrics(batch, cfg.data.max_response_length, cfg.data.max_prompt_length))
        grouped = algo.adv_estimator in algos.ADV_ESTIMATORS_NEED_GROUPS
        self.scores_flat = scores_without_spread(
            batch["token_level_scores"].sum(-1), batch.meta["uid"] if grouped else None,
            batch.tensors.get("reward_baselines") if algo.adv_estimator == "remax" else None,
            top_only=algo.adv_estimator == "grpo_passk")
        if (acc := _nanmean(extras["acc"])) is not None:  # NaN: a prompt without a ground truth
            metrics["critic/acc/mean"] = acc
        if cfg.reward_model.overlong_buffer.enable and cfg.reward_model.overlong_buffer.log:  # (DAPO's penalty)
            metrics["critic/overlong_reward/mean"] = float(extras["overlong_reward"].mean())
            metrics["critic/overlong/ratio"] = float((extras["overlong_reward"] < 0).float().mean())
        for key in reported_extras(extras, cfg.reward_model.overlong_buffer.enable):  # e.g. an RM's and the rule's
            if (mean := _nanmean(extras[key])) is not None:
                metrics[f"critic/{key}/mean"] = mean
        metrics.update(timings)
        tokens = int(batch["attention_mask"].sum())
        metrics.update(timing_per_token(timings, self._sampled_tokens, tokens))
        metrics["perf/rollout_tokens_per_s"] = self._sampled_tokens / max(timings["timing_s/gen"], 1e-9)
        metrics["perf/total_num_tokens"] = tokens
        metrics["perf/time_per_step"] = timings["timing_s/step"]
        metrics["perf/throughput"] = tokens / timings["timing_s/step"] / max(1, self.config.world_size)
        metrics["perf/max_memory_allocated_gb"] = peak_memory_gb() if self.worker_group is None \
            else max(peak_memory_gb(), self.actor.peak_memory_gb())
        metrics["training/skipped_steps"] = self.actor.skipped_steps + (self.critic.skipped_steps if self.critic else 0)
        return metrics

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Accuracy and reward on the validation set with val_kwargs, per data source: ``mean@n`` and,
        with ``n > 1``, ``best@n``, ``worst@n`` and ``maj@n``, with their standard errors, and ``std@n``
        (:func:`validation_metrics`)."""
        if self.val_dataset is None:
            return {}
        size = self.config.data.val_batch_size or len(self.val_dataset)
        params = self._val_params()
        sources, prompts, acc, score = [], [], [], []
        verdicts: list[tuple[str, float]] = []
        answers: list[str | None] | None = []  # what each response answers, if the reward function says
        apart: dict[tuple[str, str], list[float]] = {}  # (key, source) -> rule (gold) or model score
        texts: list[tuple[str, str]] = []  # (prompt, response) for trainer.log_val_generations
        # prompts done, batch by batch (data.val_batch_size sets the grain), beside the console's training bar
        with progress_bar(total=len(self.val_dataset), desc="validation", unit="prompt", leave=False,
                          disable="console" not in self.config.trainer.logger) as bar:
            for start in range(0, len(self.val_dataset), size):
                rows = list(range(start, min(start + size, len(self.val_dataset))))
                # each batch's samples from a stream of their own (its first row's index: the same draws at
                # every validation), so that validating does not move the training rollouts' generator
                batch = self.actor.generate(self.val_dataset.collate(rows), replace(params, seed=start))
                extras = self._score(batch)
                self._shape_overlong(batch, extras)  # DAPO's length penalty is part of the reward, in validation too
                if self.config.trainer.log_val_generations > 0:
                    texts += zip(self.tokenizer.batch_decode(batch["prompts"], skip_special_tokens=True),
                                 extras["responses"])
                # named by the data_source column, as verl's metrics are, where data.reward_fn_key routes the reward
                named = batch.meta.get("metric_source", batch.meta["data_source"])
                sources += named
                prompts += batch.meta["uid"]
                acc += [float(a) for a in extras["acc"]]
                verdicts += [(self.val_dataset.rows[row]["id"], float(a)) for row, a in zip(batch.meta["uid"],
                                                                                            extras["acc"])]
                shaped = torch.as_tensor(extras["score"]).float()
                if self.config.reward_model.overlong_buffer.enable:  # the penalty _shape_overlong put in the reward
                    shaped = shaped + extras["overlong_reward"]  # (not a reward function's own entry of that name)
                score += shaped.tolist()
                if answers is not None and "pred" in extras:
                    answers += extras["pred"]
                elif answers is not None and bool(torch.as_tensor(extras["acc"]).isnan().all()):
                    answers += [None] * len(extras["acc"])  # not graded (no ground truth): nothing to vote on
                else:
                    answers = None
                for key in reported_extras(extras, self.config.reward_model.overlong_buffer.enable):
                    for source, value in zip(named, extras[key]):
                        apart.setdefault((key, source), []).append(float(value))
                bar.update(len(rows))
        metrics = validation_metrics(sources, prompts, acc, score, answers)
        self.val_verdicts = verdicts
        if texts:
            self.val_generations = pick_generations(texts, score, self.config.trainer.log_val_generations)
        for (key, source), values in apart.items():  # e.g. the proxy (rm_score) and the gold side by side
            if (mean := _nanmean(values)) is not None:
                metrics[f"val-aux/{source}/{key}/mean@{params.n}"] = mean
        metrics.update(graded_rewards(sources, score, apart, params.n))
        return metrics

    def _note_idle_guards(self, metrics: dict[str, float]) -> None:
        """Say once when a configured validation guard has nothing to act on: prompts without a ground truth
        give no accuracy (``max_val_drop``) and no gold reward beside the model's (``overopt_patience``)."""
        guard = self.config.trainer.guard
        idle = [key for key, on, measured in (
            ("trainer.guard.max_val_drop", guard.max_val_drop is not None, self.val_accuracy(metrics) is not None),
            ("trainer.guard.overopt_patience", guard.overopt_patience is not None and self.config.reward_model.enable,
             proxy_and_gold(metrics)[1] is not None)) if on and not measured]
        if idle and metrics and not self._noted_idle_guards:
            self._noted_idle_guards = True
            print(f"NOTE {' and '.join(idle)} {'do' if len(idle) > 1 else 'does'} not act: the validation prompts "
                  "have no ground truth, so there is no accuracy or gold reward to watch", file=sys.stderr, flush=True)

    def val_accuracy(self, metrics: dict[str, float]) -> float | None:
        """The mean of the per-source validation accuracies in ``metrics``."""
        values = [v for k, v in metrics.items() if k.startswith("val-core/") and "/acc/mean@" in k]
        return float(np.mean(values)) if values else None

    # ------------------------------------------------------------------ state and checkpoints
    def workers(self) -> dict[str, ActorWorker | CriticWorker]:
        """The workers by checkpoint part name: ``actor``, and ``critic`` with GAE."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def state_dict(self) -> dict:
        """The loop's own state (JSON-able): step, data order, KL coefficients, guards, skip counters.
        The workers' weights, optimizers and generators are theirs (``worker.state_dict()``)."""
        return {
            "global_step": self.global_step,
            "total_steps": self.total_steps,
            "sampler": self.sampler.state_dict(),
            "train_files": self.data_fingerprints,  # the files whose rows the sampler counts, as the run read them
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "kl_loss_coef": self.kl_loss_coef,
            "guard": self.guard.state_dict(),
            "overopt": self.overopt.state_dict(),
            "skipped_steps": {name: int(worker.skipped_steps) for name, worker in self.workers().items()},
            "run": self.run_record,
        }

    def load_state_dict(self, state: dict) -> None:
        self.global_step = int(state["global_step"])
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl = algos.kl_controller_from_state(state["kl_ctrl"])
        self.kl_loss_coef = float(state["kl_loss_coef"])
        self.guard.load_state_dict(state["guard"])
        self.overopt.load_state_dict(state["overopt"])
        for name, worker in self.workers().items():
            worker.skipped_steps = int(state["skipped_steps"].get(name, 0))
        if changed := changed_since(state.get("run"), self.run_record):
            print(f"notice: the checkpoint was saved with other software or threads ({'; '.join(changed)}): the "
                  "resumed run may round otherwise than the saved run would have gone on", file=sys.stderr, flush=True)
        # (as many prompts as the sampler's: another number was refused above; a checkpoint saved before the files
        # were fingerprinted resumes without a word, as it did; a run that only validates trains on none of them)
        changed = checkpoint.changed_data_files(state.get("train_files"), self.data_fingerprints)
        if changed and not self.config.trainer.val_only:
            print(f"notice: data.train_files: {', '.join(changed)} {'has' if len(changed) == 1 else 'have'} changed "
                  "since the checkpoint was saved (other bytes, as many prompts): the resumed run takes its next "
                  "batches at the checkpoint's place in the data from the rows as they are now, which may be other "
                  "prompts than the saved run would have trained on next (rows edited, or in another order); it goes "
                  "on all the same (an edit may be meant; verl does not check)", file=sys.stderr, flush=True)

    @property
    def last_saved_step(self) -> int | None:
        """The step of :attr:`last_saved` (its global_step_N name; None where the run saved or loaded none)."""
        return checkpoint.step_of(self.last_saved) if self.last_saved is not None else None

    def protected_steps(self, saving: int | None = None) -> set[int]:
        """Checkpoints a guard may still roll back to (never pruned): the KL / val-drop guard's and the
        best-gold one of the over-optimisation guard. ``saving``: the step being saved now."""
        return self.guard.protected_steps(saving) | self.overopt.protected_steps()

    def save_checkpoint(self, before_latest: Callable[[], None] | None = None) -> Path:
        """Checkpoint the current step under ``trainer.default_local_dir`` (see :mod:`rlhf_core.training.checkpoint`);
        ``before_latest()`` runs before the checkpoint is marked latest (:func:`checkpoint.write_checkpoint`); never
        weights that hold NaN or inf (:meth:`_check_weights`). A phase of its own to ``phase_hooks``."""
        with self.hooked("save_checkpoint"):
            self._check_weights()
            try:
                path = checkpoint.save_checkpoint(self, self.checkpoint_dir, before_latest, self.rerun_advice)
            except WorkerError as exc:
                raise self._worker_failure(exc, "saving the checkpoint of", self.global_step) from exc
        self.last_saved = path
        self.guard.on_checkpoint(self.global_step)
        self.overopt.keep_restorable(self.guard.saved)
        self.anchor_folders[self.global_step] = self.checkpoint_dir.absolute()
        return path

    def _check_weights(self, loaded: bool = False) -> None:
        """Stop the run (:class:`GuardError`, as :meth:`_diverged` says it) where the actor's or the critic's weights
        hold NaN or inf: called before every save, which would otherwise write them, mark them latest and export them.
        An update can leave them so on a finite loss and gradient norm; the NaN-logits stop at the next rollout
        catches them only where there is one, never after the last step. ``loaded``: the weights as the run loaded
        them, checked before its first step (the critic's show nowhere before the first save, which took a model or
        checkpoint holding NaN for an update's divergence and a lower learning rate for the way on)."""
        try:
            bad = [name for name, worker in self.workers().items() if not worker.weights_finite()]
        except WorkerError as exc:
            raise self._worker_failure(exc, "checking the weights of", self.global_step) from exc
        if not bad:
            return
        rates = " and ".join(checkpoint.LEARNING_RATES[name] for name in bad)
        if loaded:
            found = FloatingPointError(f"the weights of the {' and the '.join(bad)} hold NaN or inf values, so the run "
                                       "trains nothing")
            raise self._diverged(found, "checking the weights before", self.global_step + 1, rates, bad)
        found = FloatingPointError(
            f"the weights of the {' and the '.join(bad)} hold NaN or inf values, so the run saves, marks latest "
            f"and exports nothing more. This usually means a diverged update (too high a learning rate, {rates}; "
            "look for a large grad_norm up to this step), which can leave them so even where its own loss and "
            "gradient were finite")
        raise self._diverged(found, "saving the checkpoint of", self.global_step, rates, bad)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Continue exactly where the checkpoint ``path`` (a ``global_step_N`` directory) left off.

        The guards may roll back to the checkpoints the run saved before it (their steps are in its state), where
        they are still whole beside ``path``: never to another run's that share the folder. A guard's best that is
        not among them gives way to the best validated one that is (:meth:`Guard.keep_restorable`)."""
        path = Path(os.path.expanduser(str(path)))
        checkpoint.load_checkpoint(self, path)
        self.resumed, self.resumed_from = True, path  # the validation before training is behind it
        self.last_saved = path
        earlier = [step for step in self.guard.saved if step < self.global_step
                   and checkpoint.holds_parts(checkpoint.step_dir(path.parent, step), self.workers())]
        self.guard.keep_restorable(earlier + [self.global_step])
        self.overopt.keep_restorable(self.guard.saved)
        self.anchor_folders = dict.fromkeys(self.guard.saved, path.parent.absolute())  # (as saves record theirs)

    def _skipped_total(self) -> int:
        return self.actor.skipped_steps + (self.critic.skipped_steps if self.critic else 0)

    def apply_guard_event(self, event: GuardEvent) -> None:
        """Carry out a guard's event: restore its checkpoint, then stop (GuardError) or adjust and go on."""
        restored = None
        if event.target_step is not None:
            folder = self.anchor_folders.get(event.target_step, self.checkpoint_dir.absolute())
            restored = checkpoint.step_dir(folder, event.target_step)
            checkpoint.restore_weights(self, restored)
            # no guard targets a step after it from now on; the checkpoint of this step, saved next, holds its weights
            self.guard.on_restore(event.target_step, at=self.global_step)
            self.overopt.on_restore(event.target_step, at=self.global_step)
        if event.action == "stop":
            if restored is not None and restored.parent == self.checkpoint_dir.absolute():
                checkpoint.mark_latest(self.checkpoint_dir, event.target_step)
                advice = checkpoint.rerun_advice(self.config.trainer.resume_mode)  # auto: to the one marked latest
                where = f"restored {restored} and marked it latest: fix the cause, then {advice} to resume from it"
            elif restored is not None:  # a checkpoint from before a resume out of another folder
                where = (f"restored {restored}: fix the cause, then rerun with trainer.resume_mode=resume_path "
                         f"trainer.resume_from_path={restored} to resume from it")
            else:
                where = "no checkpoint was saved before the problem began, so nothing was restored"
            raise GuardError(f"training stopped at step {self.global_step}: {event.message}; {where}")
        adjusted = ""
        if event.kind in ("kl_explosion", "over_optimisation"):
            adjusted = self._apply(tighten_kl_control(self.config, self.kl_ctrl, self.kl_loss_coef))
        count = self.overopt.rollbacks if event.kind == "over_optimisation" else self.guard.rollbacks
        print(f"WARNING guard: rollback {count}/{self.config.trainer.guard.max_rollbacks} at step "
              f"{self.global_step}: {event.message}; "
              + (f"restored {restored}" if restored else "no earlier checkpoint to restore")
              + (f"; {adjusted}" if adjusted else ""), file=sys.stderr, flush=True)

    def _apply(self, decision: KLTightening) -> str:
        """Carry out a guard's tightening of the KL control; returns what changed."""
        if decision.kl_ctrl is not None:
            self.kl_ctrl = decision.kl_ctrl
        if decision.kl_loss_coef is not None:
            self.kl_loss_coef = decision.kl_loss_coef
        if decision.lr_factor is not None:
            self.actor.scale_lr(decision.lr_factor)
        return decision.summary

    def _stop_if_requested(self) -> None:
        if self.stop_requested is None:
            return
        name, number = self.stop_requested
        saved = None
        if self.last_saved_step == self.global_step:  # (the checkpoint a resume loaded, in whichever folder)
            saved = self.last_saved
        elif self.config.trainer.save_on_interrupt and self.global_step > 0:
            saved = self.save_checkpoint()
        raise TrainingInterrupted(name, number, self.global_step, str(saved) if saved else None, self.rerun_advice)

    @property
    def rerun_advice(self) -> str:
        """How a rerun resumes (:meth:`rerun_point`'s advice)."""
        return self.rerun_point().advice

    def rerun_point(self) -> checkpoint.RerunPoint:
        """How a rerun resumes and the checkpoint it resumes from (:func:`checkpoint.rerun_point`): until a run
        resumed from ``trainer.resume_from_path`` saves, also before it has loaded it, that path."""
        return checkpoint.rerun_point(self.config.trainer, self.resumed_from, self.last_saved)

    def _nothing_to_train(self, exc: dynamic_sampling.NothingToTrain, step: int) -> dynamic_sampling.NothingToTrain:
        """Dynamic sampling's dead end said as the run's failure: the step, why, and the checkpoint a rerun resumes
        from, where a raised ``max_num_gen_batches`` (a key a resume may change) lets the run go on."""
        resume = self._resume_point(first="raise algorithm.filter_groups.max_num_gen_batches (it may change on a "
                                          "resume), then ")
        return dynamic_sampling.NothingToTrain(f"training step {step} failed: {exc}\n{resume}")

    def _worker_failure(self, exc: WorkerError, doing: str, step: int) -> WorkerError | GuardError:
        """The error to stop the run with: the worker's, the step, and the checkpoint a rerun resumes from (a
        worker's NaN logits as :meth:`_diverged` says them: Ray's error carries the worker's as its ``cause``)."""
        if isinstance(getattr(exc.__cause__, "cause", None), NonFiniteLogits):
            return self._diverged(exc, doing, step)
        return WorkerError(f"{doing} step {step} failed: {exc}\n{self._resume_point()}")

    def _diverged(self, exc: FloatingPointError | WorkerError, doing: str, step: int,
                  rates: str = "actor_rollout_ref.actor.optim.lr", roles: Sequence[str] = ("actor",)) -> GuardError:
        """The error to stop the run with where the policy's logits held NaN (or inf), or the weights did
        (:meth:`_check_weights`), as :meth:`_worker_failure` says a worker's: but a rerun with the same settings
        diverges again (the same seed, the same updates), so it says which checkpoint holds the weights that gave
        those logits (:func:`weights_origin`: at step 0 the model loaded) and which one to go on from instead
        (``rates``: the learning rates to lower; ``roles``: the workers whose weights they were)."""
        model = [f"{key} ({self.config.value(key)})" for key in dict.fromkeys(MODEL_PATHS[role] for role in roles)]
        rerun = self.rerun_point()
        kept = weights_origin(self.global_step, self.resumed_from, rerun.checkpoint, model, rates, "trainer",
                              rerun.advice, lr_on_resume=True)
        return GuardError(f"{doing} step {step} failed: {exc}\n{kept}")

    def close(self) -> None:
        """Stop the workers (with a worker group); the trainer cannot train afterwards."""
        if self.worker_group is not None:
            self.worker_group.shutdown()

    # ------------------------------------------------------------------ the loop
    def _log(self, metrics: dict[str, float], step: int, not_kept: str = "") -> None:
        """Hand the step's metrics to the logger; one that fails stops the run as :class:`LoggingError`, naming the
        checkpoint a rerun resumes from (``not_kept``: what its failure means for a checkpoint being saved)."""
        if self.logger is None:
            return
        try:
            self.logger(metrics, step)
        except Exception as exc:
            raise self._logging_failure(exc, f"the metrics of step {step}", not_kept) from exc

    def _log_generations(self, step: int) -> None:
        """Hand the validation generations of ``step`` to their logger; one that fails stops the run as
        :meth:`_log` says."""
        if self.generations_logger is not None and self.val_generations:
            try:
                self.generations_logger(self.val_generations, step)
            except Exception as exc:
                raise self._logging_failure(exc, f"the validation generations of step {step}") from exc

    def _logging_failure(self, exc: Exception, what: str, not_kept: str = "") -> LoggingError:
        return LoggingError(f"logging {what} failed ({type(exc).__name__}: {exc}){not_kept}; "
                            f"{self._resume_point(exc)}")

    def _resume_point(self, exc: BaseException | None = None, first: str = "") -> str:
        """:func:`checkpoint.resume_point` for this run: the checkpoint a rerun resumes from
        (:meth:`rerun_point`), and ``first``, what to do before (a failed write, ``exc``, adds its own)."""
        rerun = self.rerun_point()
        return checkpoint.resume_point(rerun.checkpoint, exc, self.checkpoint_dir, rerun.advice,
                                       "trainer.default_local_dir", first)

    def fit(self) -> list[StepResult]:
        if self.config.trainer.val_only:  # verl's: validate what is loaded (the model, or a resumed checkpoint)
            try:
                metrics = self.validate()
            except WorkerError as exc:
                raise self._worker_failure(exc, "validating the weights of", self.global_step) from exc
            except NonFiniteLogits as exc:
                raise self._diverged(exc, "validating the weights of", self.global_step) from exc
            self._log(metrics, self.global_step)
            self._log_generations(self.global_step)
            self.history.append(StepResult(self.global_step, metrics))
            return self.history
        if self.global_step < self.total_steps and not self.data_exhausted:
            self._check_weights(loaded=True)
        if self.config.trainer.val_before_train and self.val_dataset is not None and self.global_step == 0 \
                and not self.resumed:
            self.val_before = self.validate_before_train()
        if self.resumed and (self.global_step >= self.total_steps or self.data_exhausted):
            print(f"notice: {self.already_complete()}", file=sys.stderr, flush=True)
        else:
            self._warn_single_response_groups()
            self._warn_greedy_repeats()
        while self.global_step < self.total_steps and not self.data_exhausted:
            self._stop_if_requested()
            try:
                self.fit_step()
            except dynamic_sampling.DataExhausted as exc:
                self.step_under_way = None  # the step that drew from the data never trains
                if self.global_step == 0 and not self.resumed:
                    self._unsave_untrained()
                    print(f"notice: {exc}; no step was trained, so no checkpoint is saved (a resume would start "
                          "from the untrained model with the data used up)", file=sys.stderr, flush=True)
                    break
                print(f"notice: {exc}; training ends at step {self.global_step}", file=sys.stderr, flush=True)
                self._validate_last_step()
                break
        return self.history

    def _unsave_untrained(self) -> None:
        """Take back the step-0 checkpoint this run saved (the guards' first best, after the validation before
        training) where the data ran out before step 1: it holds the untrained model and a sampler at the end of
        the data, and marked latest a resume took it for the run's progress and trained nothing."""
        if self.last_saved_step != 0 or self.anchor_folders.get(0) != self.checkpoint_dir.absolute():
            return
        marker = self.checkpoint_dir / checkpoint.LATEST_FILE
        if marker.is_file() and marker.read_text().strip() == "0":
            marker.unlink()
        checkpoint._remove(checkpoint.step_dir(self.checkpoint_dir, 0), self.checkpoint_dir)
        self.last_saved = None
        del self.anchor_folders[0]

    def already_complete(self) -> str:
        """What to say where a resume finds the run already at its end: the step it is at, each limit that ends
        it there (``trainer.total_training_steps``, ``trainer.total_epochs`` passes over the data, or both) and
        each one to raise to go on (raising one alone where both end it would end the next run there again)."""
        cfg, step = self.config.trainer, self.global_step
        per_epoch = self.sampler.batches_per_epoch
        steps_end = bool(cfg.total_training_steps) and cfg.total_training_steps <= step
        limits, raise_ = [], []
        if steps_end:
            limits.append(f"trainer.total_training_steps={cfg.total_training_steps}")
            raise_.append(f"trainer.total_training_steps above {step}")
        if self.data_exhausted or not steps_end:
            limits.append(f"trainer.total_epochs={cfg.total_epochs} of {per_epoch} batches each")
            raise_.append(f"trainer.total_epochs to {self.sampler.batches_drawn // per_epoch + 1} or more")
        # (with dynamic sampling a step may draw several batches: the data can run out before total_steps)
        ends = f"this run ends at step {self.total_steps}" if self.total_steps <= step else \
            f"its data ran out at step {step} (dynamic sampling drew more than a batch for some steps)"
        return (f"the run is already complete: {self.resumed_from} is at step {step} and {ends} "
                f"({' and '.join(limits)}), so nothing is trained; to train on from it, raise "
                f"{' and '.join(raise_)} and run again")

    def _warn_if_stuck(self, step: int, metrics: dict[str, float]) -> None:
        """Warn where the step shows a run that cannot learn, each kind at most once every
        :data:`STUCK_WARNING_EVERY` steps: most responses cut off at ``data.max_response_length`` (a cut response
        seldom reaches its answer), or scores that tell no responses apart where the advantage estimator compares
        them (:func:`scores_without_spread`). Only the kinds in ``stuck_warnings`` (the constructor's) are given:
        a step both cut off and scored alike is warned of as cut off ("clip"), the cut explaining the alike scores.
        A group estimator with one response a prompt is a config fact, said once before the first step
        (:meth:`_warn_single_response_groups`); with greedy training rollouts, alike scores in every group are one
        too (:meth:`_warn_greedy_repeats`), and the step's warning names the setting, not the reward; a greedy step
        cut off as well names both the setting and the length, each of which alone scores a group alike."""
        cfg = self.config
        length = cfg.data.max_response_length
        clipped = metrics.get("response_length/clip_ratio", 0.0)
        cut = (f"{clipped:.0%} of the responses reached data.max_response_length={length} and were cut off "
               f"(response_length/clip_ratio {clipped:.2f})")
        algo, n = cfg.algorithm, cfg.actor_rollout_ref.rollout.n
        if algo.adv_estimator == "remax":
            alike = ("every response scored what its prompt's greedy response scored (algorithm.adv_estimator=remax's "
                     "baseline)")
        elif algo.adv_estimator == "grpo_passk":
            alike = ("each prompt's best score was shared by two or more of its responses (algorithm.adv_estimator="
                     "grpo_passk rewards a single best one)")
        elif algo.adv_estimator in algos.ADV_ESTIMATORS_NEED_GROUPS and n > 1:
            alike = "the responses to each prompt scored the same"
        else:  # (a group of one response is compared over the batch)
            alike = "every response of the batch scored the same"
        moved_by = [what for what, holds in (("the critic's values", self.use_critic),
                                             ("the KL penalty in the reward", algo.use_kl_in_reward)) if holds]
        verb = "moves" if moved_by == ["the KL penalty in the reward"] else "move"  # (one penalty, values plural)
        same = (f"{alike}, so the advantages carry no reward signal"
                + (f" (only {' and '.join(moved_by)} {verb} them)" if moved_by else "")
                + " and the policy learns nothing about the reward from this step")
        greedy_groups = self._greedy_repeats() if algo.adv_estimator in algos.ADV_ESTIMATORS_NEED_GROUPS else None
        if self.scores_flat and greedy_groups and clipped >= CLIP_RATIO_WARNING:  # two causes, either one enough
            kinds, text = ("clip", "flat"), (f"{cut} and {same}: {greedy_groups[0]}, and a cut response seldom "
                                             "reaches its answer, so it scores little; either alone scores a "
                                             f"prompt's responses alike: {greedy_groups[1]} and raise "
                                             "data.max_response_length")
        elif self.scores_flat and greedy_groups:  # alike because greedy: the setting is the advice
            kinds, text = ("flat",), f"{same}: {greedy_groups[0]}; {greedy_groups[1]}"
        elif clipped >= CLIP_RATIO_WARNING and self.scores_flat:
            kinds, text = ("clip", "flat"), (f"{cut} and {same}: a cut response seldom reaches its answer; raise "
                                             "data.max_response_length")
        elif clipped >= CLIP_RATIO_WARNING:
            kinds, text = ("clip",), (f"{cut}: a cut response seldom reaches its answer, so it scores little; raise "
                                      "data.max_response_length")
        elif self.scores_flat:
            kinds, text = ("flat",), (f"{same}; check the reward: the reward function (custom_reward_function) or "
                                      "reward model, and the data's ground truth (its reward_model.ground_truth "
                                      "field)")
            if clipped >= CLIP_RATIO_ALSO and "clip" in self.stuck_warnings:  # (both causes named; not where cut
                # responses are no warning's matter, as in the dry run at its own short response cap)
                text += (f"; and {cut}: a cut response seldom reaches its answer, so where the reward is right, "
                         "raise data.max_response_length")
        else:
            return
        if kinds[0] not in self.stuck_warnings:  # the kind whose advice it gives (cut and alike: the length's)
            return
        if all(kind in self._stuck_warned and step - self._stuck_warned[kind] < STUCK_WARNING_EVERY for kind in kinds):
            return
        self._stuck_warned.update(dict.fromkeys(kinds, step))
        print(f"WARNING step {step}: {text}", file=sys.stderr, flush=True)

    def _warn_single_response_groups(self) -> None:
        """Warn, once before the first step, where a group estimator (GRPO, RLOO, REINFORCE++ with its group
        baseline) gets one response a prompt: a group of one has no other response to compare with."""
        estimator, n = self.config.algorithm.adv_estimator, self.config.actor_rollout_ref.rollout.n
        if estimator not in algos.ADV_ESTIMATORS_NEED_GROUPS or n > 1:
            return
        print(f"WARNING: algorithm.adv_estimator={estimator} compares the responses to the same prompt, and "
              f"actor_rollout_ref.rollout.n={n} samples one: each response is a group of its own, whose advantage is "
              "its score as it stands (whitened over the batch for reinforce_plus_plus_baseline), without the "
              "baseline the other responses to its prompt would give; raise actor_rollout_ref.rollout.n to 2 or "
              "more", file=sys.stderr, flush=True)

    def _greedy_repeats(self) -> tuple[str, str] | None:
        """Where the training rollouts decode greedily with ``rollout.n > 1``, each prompt's n responses one response
        repeated: (the setting that makes them greedy and what it does, the change that samples); None otherwise."""
        rollout = self.config.actor_rollout_ref.rollout
        if rollout.n < 2 or not self._train_params().greedy:
            return None
        key = "actor_rollout_ref.rollout"
        setting, fix = ((f"{key}.do_sample=false", f"set {key}.do_sample=true") if not rollout.do_sample else
                        (f"{key}.temperature={rollout.temperature}", f"set {key}.temperature above 0"))
        return (f"{setting} decodes greedily, so each prompt's {key}.n={rollout.n} responses are one response "
                "repeated"), fix

    def _warn_greedy_repeats(self) -> None:
        """Warn, once before the first step, where greedy training rollouts repeat one response ``rollout.n`` times:
        a group estimator then compares identical responses (every advantage 0: nothing learnt about the reward),
        any other estimator pays n times the work for one response's signal."""
        if (repeats := self._greedy_repeats()) is None:
            return
        cause, fix = repeats
        estimator = self.config.algorithm.adv_estimator
        if estimator in algos.ADV_ESTIMATORS_NEED_GROUPS:
            print(f"WARNING: {cause}: algorithm.adv_estimator={estimator} compares each response with the others to "
                  f"its prompt, so every advantage is 0 and the policy learns nothing about the reward; {fix}",
                  file=sys.stderr, flush=True)
        else:
            print(f"notice: {cause}: each step generates and trains on the same response "
                  f"{self.config.actor_rollout_ref.rollout.n} times over; {fix}, or set "
                  "actor_rollout_ref.rollout.n=1", file=sys.stderr, flush=True)

    def _validate_step(self, step: int, metrics: dict[str, float],
                       event: GuardEvent | None) -> tuple[bool, GuardEvent | None]:
        """Validate after ``step`` into ``metrics`` and show the result to the val-drop and over-optimisation
        guards (unless ``event`` is already one of theirs): (a new best to checkpoint, the guards' event)."""
        started = time.perf_counter()
        try:
            with self.hooked("testing"):
                metrics.update(self.validate())
        except WorkerError as exc:
            raise self._worker_failure(exc, "validating after", step) from exc
        except NonFiniteLogits as exc:
            raise self._diverged(exc, "validating after", step) from exc
        metrics["timing_s/testing"] = time.perf_counter() - started
        self._log_generations(step)
        self._note_idle_guards(metrics)
        new_best = False
        if event is None:
            before = self.guard.state_dict()
            new_best, event = self.guard.observe_validation(step, self.val_accuracy(metrics))
            if event is None:
                better, event = self.overopt.observe(step, *proxy_and_gold(metrics))
                if event is not None and new_best:  # the weights it measured are being replaced: not a best
                    self.guard.load_state_dict(before)
                new_best = (new_best or better) and event is None
        return new_best, event

    def _validate_last_step(self) -> None:
        """The validation after the last step, where the loop ended before the step it expected to be last
        (the data ran out inside a step): merged into that step's metrics, shown to the guards as any
        validation is (a rollback or a stop carried out here), and the step's record logged again whole."""
        if (not self.history or self.val_dataset is None or self.config.trainer.test_freq <= 0
                or any(k.startswith("val-") for k in self.history[-1].metrics)):
            return  # (test_freq -1 or 0: no validation while training, as in verl)
        last = self.history[-1]
        new_best, event = self._validate_step(last.step, last.metrics, None)
        last.metrics["training/rollbacks"] = self.guard.rollbacks + self.overopt.rollbacks  # this one's too
        self._log(last.metrics, last.step)  # the step's whole record again: a reader keeps a step's last one
        if event is not None:
            last.event = event
            self.apply_guard_event(event)
        if new_best or event is not None:
            self.save_checkpoint()

    @property
    def data_exhausted(self) -> bool:
        """Whether ``trainer.total_epochs`` passes over the training data have been drawn."""
        return self.sampler.batches_drawn >= self.total_batches

    def validate_before_train(self) -> dict[str, float]:
        """The validation before the first step, as :meth:`fit` runs it: logged at step 0, and the first
        best of the val-drop and over-optimisation guards (checkpointed, their first rollback target)."""
        try:
            with self.hooked("testing"):
                val_metrics = self.validate()
        except WorkerError as exc:
            raise self._worker_failure(exc, "validating before", 1) from exc
        except NonFiniteLogits as exc:
            raise self._diverged(exc, "validating before", 1) from exc
        self._note_idle_guards(val_metrics)
        new_best, _ = self.guard.observe_validation(0, self.val_accuracy(val_metrics))
        new_best = self.overopt.observe(0, *proxy_and_gold(val_metrics))[0] or new_best
        self._log(val_metrics, 0)
        self._log_generations(0)
        if new_best:
            self.save_checkpoint()
        return val_metrics

    def fit_step(self, validate: Callable[[int, dict[str, float]], bool] | None = None) -> StepResult:
        """One iteration of :meth:`fit`: the next batch, a train step, the guards, a validation, logging
        and checkpoints. The validation runs every ``trainer.test_freq`` steps and after the last (none where
        it is -1 or 0, as in verl), or, with
        ``validate``, where ``validate(step, metrics)`` says (a caller's own schedule). A guard's
        rollback is carried out here and returned in the result; its stop raises :class:`GuardError`."""
        trainer_cfg = self.config.trainer
        self.step_under_way = self.global_step + 1
        _, rows = self.sampler.next_batch()
        skipped_before = self._skipped_total()
        try:
            with profiled(self.global_step + 1, trainer_cfg.profile_steps, trainer_cfg.profile_dir):
                metrics = self.train_step(self.train_dataset.collate(rows))
        except WorkerError as exc:
            raise self._worker_failure(exc, "training", self.global_step + 1) from exc
        except NonFiniteLogits as exc:
            raise self._diverged(exc, "training", self.global_step + 1) from exc
        except dynamic_sampling.NothingToTrain as exc:
            raise self._nothing_to_train(exc, self.global_step + 1) from exc
        epoch = self.sampler.epoch
        self.global_step += 1
        self.step_under_way = None
        step = self.global_step
        self._warn_if_stuck(step, metrics)
        last = step == self.total_steps or self.data_exhausted
        save = last or (trainer_cfg.save_freq > 0 and step % trainer_cfg.save_freq == 0)
        event = self.guard.observe_step(step, metrics, skipped=self._skipped_total() > skipped_before)
        due = (validate(step, metrics) if validate is not None
               else trainer_cfg.test_freq > 0 and (last or step % trainer_cfg.test_freq == 0))
        if self.val_dataset is not None and due:
            new_best, event = self._validate_step(step, metrics, event)
            save = save or new_best
        metrics["training/global_step"] = step
        # the epoch of the step's last batch, as verl's loop logs it: dynamic sampling may draw into the next one
        metrics["training/epoch"] = epoch
        metrics["training/rollbacks"] = self.guard.rollbacks + self.overopt.rollbacks
        result = StepResult(step, metrics, event)
        self.history.append(result)
        if save and event is None:  # timed into the step's record, as verl's timing_s/save_checkpoint
            started = time.perf_counter()
            logged = False

            def log_before_latest() -> None:
                # the record is written before the checkpoint is marked latest: a run killed after the marker
                # resumes after this step and would never log it. A logger that fails fails the save alike: a
                # checkpoint marked latest without its step's record would leave that record out for good, where
                # a rerun from the checkpoint before trains the step again, as it was, and logs it
                nonlocal logged
                metrics["timing_s/save_checkpoint"] = time.perf_counter() - started
                logged = True
                self._log(metrics, step, ", so its checkpoint is not kept (a rerun trains the step again and logs it)")

            try:
                self.save_checkpoint(before_latest=log_before_latest)
            except BaseException:
                if not logged:  # a save that failed before its files were written: the metrics stay
                    try:
                        self._log(metrics, step)
                    except LoggingError as failed:  # said, but the save's failure is the one the run stops with
                        print(f"error: {failed}", file=sys.stderr, flush=True)
                raise
            if not logged:
                self._log(metrics, step)
            return result
        self._log(metrics, step)
        if event is not None:
            self.apply_guard_event(event)
            save = True  # the next resume and the next rollback start from the restored state
        if save:
            self.save_checkpoint()
        return result
