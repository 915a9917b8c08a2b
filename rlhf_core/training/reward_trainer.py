"""Reward-model training on preference pairs: ``rlhf-train-rm key=value ...``.

The model is a causal checkpoint with a one-label scalar head
(``AutoModelForSequenceClassification``, ``num_labels=1``). A sequence's score is the head's output
at its last non-pad token: the prompt in its chat template, the response and the end-of-sequence
token, right-padded, with ``config.pad_token_id`` set so that transformers' own pooling finds that
token. Training minimises the Bradley-Terry loss (Bradley & Terry 1952; Ouyang et al. 2022)

    loss = -log sigmoid(r_chosen - r_rejected - margin)

averaged over the pairs of an optimizer step, with AdamW, linear warm-up, gradient clipping and
micro-batches, every dropout of the backbone and head off (``reward_model.train.disable_dropout``: the scores
compared are those PPO reads); ``reward_model.train.model.lora_rank > 0`` trains LoRA adapters and the head only.
With ``trainer.n_gpus_per_node * trainer.nnodes > 1`` the model is sharded with FSDP2 over a Ray
worker group (each rank takes an equal share of every step's pairs; losses are divided by the
step's global pair count and gradients summed, so N workers take the step one would).

Checkpoints (``reward_model.train.default_local_dir``) follow the PPO layout: ``global_step_N/``
with ``reward_model/`` (model, optimizer and scheduler state, or FSDP2 shards), ``trainer_state.json``
(step, epoch, position in the epoch, the counts of skipped steps the stops below read, so that a resumed
run stops at the step it would have stopped at unbroken, and the training pairs' count and SHA-256 of their token
ids, since each step's pairs follow from the step over them: a resume on another number of pairs is refused, one on
as many whose ids differ says so and goes on), ``rng_state.pt``, ``config.yaml`` and ``manifest.json``
written last, then ``latest_checkpointed_iteration.txt``; a run started again resumes exactly
(``reward_model.train.resume_mode``), with as many workers or another number: the weights and
optimizer moments are re-split exactly, and the steps then differ from the saved run's by float
rounding alone. The end of the run writes ``huggingface/``: the model (LoRA merged) and its
tokenizer, which ``AutoModelForSequenceClassification.from_pretrained`` loads; its config.json
records the chat-template keyword arguments the pairs were encoded with
(``reward_model.train.apply_chat_template_kwargs``), which PPO compares with its own. Metrics go to
``metrics.jsonl`` there (and any other ``trainer.logger``): ``train/loss``, ``train/pair_accuracy`` (the share
of pairs whose chosen side scores strictly above the rejected: a tie counts as wrong, as TRL's and OpenRLHF's
reward trainers count it, so a model that scores every text alike ranks none right), ``train/margin_mean``, the
scores' scale (free under the loss, which sees differences only):
``train/chosen_score_mean``, ``train/rejected_score_mean`` and over both sides ``train/score_mean``,
``train/score_std``, ``train/score_min``, ``train/score_max``, all over every pair of the step; then
``train/grad_norm``, ``train/lr``, ``train/skipped_step``, and at each validation the same pair metrics under
``val/`` over every held-out pair. The run's first step also logs ``train/pairs_over_max_length`` and
``val/pairs_over_max_length``: the pairs with a side over ``reward_model.train.max_length``, cut to one prompt
window (``reward_model.train.overlong=truncate``) or left out of training and validation (``drop``, as TRL's
RewardTrainer).

A step whose loss or gradient is not finite takes no update (``train/skipped_step``) and training goes on, as
verl's workers skip a step whose gradient norm is not finite (one step in bfloat16 or float16 can overflow); the
learning-rate schedule counts the updates taken, so it does not move on for a skipped step either. After
``reward_model.train.max_consecutive_skips`` skipped steps in a row (as PPO's ``trainer.guard``), and at the end of a
run none of whose steps took an update, the run stops (exit 1), saving and exporting nothing more. A resume meets
the same pairs on the same weights at those steps, so the message names the checkpoint to resume from with
``max_consecutive_skips`` raised (a resume may change it), or, where no step took an update, a new run. Where
the loss is not finite because the weights hold NaN or inf the run stops (exit 1), since they would meet every later
step alike: nothing more is saved and nothing is exported. So does a save or the export that would write weights
holding NaN or inf (an update, the last one too, can leave them so on a finite loss), and a validation whose loss
is not finite. A logger that cannot record a step stops the run (exit 1), naming the checkpoint a rerun resumes
from.

Exit codes (as PPO's): 0 done; 1 a worker failed, the weights or a validation's loss were not finite, steps
were skipped as above, or a logger failed; 2 bad input: config, preference data (the message names the file, columns or rows), model
directory or checkpoint; 130 or 143 after Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import hashlib
import json
import logging
import math
import operator
import os
import random
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as `rlhf train-rm` is (rlhf_core.cli), before the imports below (torch), so
    # that a Ctrl-C in the command's first seconds ends it with one line and exit 130, not a traceback; the
    # command runs this module as imported, not __main__, so Ray ships the worker classes by reference
    from rlhf_core.cli import _run

    sys.exit(_run("train-rm", None, "python -m rlhf_core.training.reward_trainer"))

import numpy as np
import torch
import torch.nn.functional as F

from rlhf_core import heap
from rlhf_core.atomic import staged_directory
from rlhf_core.config import PPOConfig, RewardTrainConfig, reward_training_batch_problems
from rlhf_core.data.dataset import as_file_list
from rlhf_core.data.preference import PreferenceDataError, check_preference_frames, read_preferences
from rlhf_core.models import cpu_matmul, lora
from rlhf_core.models.loading import (
    DTYPES,
    ModelError,
    check_model_dir,
    check_tokenizer_dir,
    config_with,
    disable_dropout,
    enable_checkpointing,
    load_tokenizer,
    max_positions,
    resolve,
    save_hf_model,
)
from rlhf_core.progress import transformers_bars
from rlhf_core.rewards.reward_model import TEMPLATE_KWARGS, conversation_ids, cut_from_the_left
from rlhf_core.training import checkpoint as ckpt
from rlhf_core.training.guards import GuardError, TrainingInterrupted
from rlhf_core.training.tracking import store_problems
from rlhf_core.training.trainer import LoggingError, weights_origin
from rlhf_core.workers import distributed
from rlhf_core.workers.common import (
    CheckpointableWorker,
    build_optimizer,
    build_scheduler,
    clip_and_check,
    load_saved,
)
from rlhf_core.workers.group import (
    DistributedWorker,
    WorkerError,
    WorkerGroup,
    absolute,
    address_problem,
    for_workers,
)

PART = "reward_model"
HF_DIR = "huggingface"
KEY = "reward_model.train"
#: reward_model.train keys that may change between a checkpoint and the run resuming it.
RESUME_SAFE = ("val_files", "total_epochs", "total_training_steps", "test_freq", "save_freq", "default_local_dir",
               "resume_mode", "resume_from_path", "min_pair_accuracy", "micro_batch_size_per_gpu",
               "max_consecutive_skips", "model.enable_gradient_checkpointing", "fsdp_config.*")


class NothingTrainedError(GuardError):
    """A run stopped on skipped steps where no step of it took an update: its checkpoints hold the weights it started
    from, which a resume meets the same pairs on alike, so its message names a new run, not a checkpoint to resume."""


class RewardTrainingError(ValueError):
    """Input that stops reward-model training before any weights load; ``errors`` holds one message each."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("cannot train the reward model:\n" + "\n".join(f"  - {e}" for e in errors))

    def __reduce__(self):  # rebuilt from its errors when pickled (a worker's error on its way to the driver),
        return type(self), (self.errors,), self.__dict__  # its notes and other attributes too


# ----------------------------------------------------------------------------- the math


def bradley_terry_loss(chosen_reward: torch.Tensor, rejected_reward: torch.Tensor, margin: float = 0.0,
                       weight: torch.Tensor | None = None, normaliser: float | None = None) -> torch.Tensor:
    """``sum_i w_i * -log sigmoid(r_c,i - r_r,i - margin) / normaliser`` over pairs i.

    ``chosen_reward``, ``rejected_reward``, ``weight``: (n_pairs,). ``normaliser`` defaults to the
    weight sum (the mean over the pairs); a rank of a worker group passes the global pair count.
    """
    per_pair = -F.logsigmoid(chosen_reward - rejected_reward - margin)  # (n_pairs,)
    weight = torch.ones_like(per_pair) if weight is None else weight.to(per_pair)
    total = float(weight.sum()) if normaliser is None else normaliser
    return (per_pair * weight).sum() / max(total, 1e-12)


#: the entries of :func:`pair_statistics` that combine by max and min rather than by sum
EXTREMES = {"score_max": max, "score_min": min}


def pair_statistics(chosen_reward: torch.Tensor, rejected_reward: torch.Tensor, margin: float = 0.0) -> dict:
    """Over pairs, in forms that micro-batches and ranks combine exactly (:func:`merge_statistics`): the sums of
    the loss, correct orderings, margin, pairs, each side's scores and the squared scores; the largest and
    smallest score (-inf and inf where there is no pair)."""
    chosen, rejected = chosen_reward.double(), rejected_reward.double()  # (n_pairs,)
    delta = chosen - rejected
    scores = torch.cat([chosen, rejected])  # (2 * n_pairs,)
    return {"loss": float(-F.logsigmoid(delta - margin).sum()), "correct": float((delta > 0).sum()),
            "margin": float(delta.sum()), "pairs": float(len(delta)), "chosen_score": float(chosen.sum()),
            "rejected_score": float(rejected.sum()), "score_square": float((scores * scores).sum()),
            "score_max": float(scores.max()) if len(scores) else -math.inf,
            "score_min": float(scores.min()) if len(scores) else math.inf}


def merge_statistics(total: dict | None, part: dict) -> dict:
    """Two micro-batches' :func:`pair_statistics` as one: sums added, the extremes of both."""
    if total is None:
        return dict(part)
    return {name: EXTREMES.get(name, operator.add)(total[name], value) for name, value in part.items()}


def reduce_statistics(stats: dict) -> dict:
    """A rank's :func:`pair_statistics` combined over the ranks: sums in one all-reduce, extremes in another."""
    summed = [name for name in stats if name not in EXTREMES]
    total = dict(zip(summed, distributed.all_reduce_sum([stats[name] for name in summed])))
    top, negated_bottom = distributed.all_reduce_max_floats([stats["score_max"], -stats["score_min"]])
    return {**total, "score_max": top, "score_min": -negated_bottom}


def pair_metrics(stats: dict, split: str) -> dict[str, float]:
    """``<split>/loss``, ``/pair_accuracy``, ``/margin_mean`` from the :func:`pair_statistics` of all the pairs
    seen, and the scores' scale, which the Bradley-Terry loss leaves free (it sees differences only, so the scores
    may drift in offset and spread): ``/chosen_score_mean``, ``/rejected_score_mean``, and over both sides
    ``/score_mean``, ``/score_std`` (population), ``/score_min``, ``/score_max``."""
    pairs = stats["pairs"]
    mean = (stats["chosen_score"] + stats["rejected_score"]) / (2 * pairs)
    # E[r^2] - E[r]^2 from float64 sums: the std good to about 1e-4 of itself while |mean| < 1e6 std
    variance = max(stats["score_square"] / (2 * pairs) - mean * mean, 0.0)
    # a NaN score reaches the sums, but not always the extremes (max and min, in Python and in an all-reduce, may
    # pass over it): the range is NaN too then, not the finite scores' range
    nan = math.isnan(stats["score_square"])
    values = {"loss": stats["loss"] / pairs, "pair_accuracy": stats["correct"] / pairs,
              "margin_mean": stats["margin"] / pairs, "chosen_score_mean": stats["chosen_score"] / pairs,
              "rejected_score_mean": stats["rejected_score"] / pairs, "score_mean": mean,
              "score_std": math.nan if nan else math.sqrt(variance),
              "score_min": math.nan if nan else stats["score_min"],
              "score_max": math.nan if nan else stats["score_max"]}
    return {f"{split}/{name}": value for name, value in values.items()}


# ----------------------------------------------------------------------------- tokens


@dataclasses.dataclass
class EncodedPairs:
    """The pairs of preference rows as token ids, and what ``max_length`` cost them."""

    pairs: list[tuple[list[int], list[int]]] = dataclasses.field(default_factory=list)
    prompt_cut: int = 0  # sequences that lost prompt tokens only
    response_cut: int = 0  # sequences that lost their whole prompt and response tokens too
    identical: list[tuple[str, int, bool]] = dataclasses.field(default_factory=list)  # (file, row, cut) left out
    rows: int = 0  # the preference rows read
    over_length: list[int] = dataclasses.field(default_factory=list)  # the longer side's tokens of each pair over
    dropped: bool = False  # whether those pairs were left out (overlong=drop) rather than cut


def encode_pairs(files: list[tuple[str, object]], tokenizer, max_length: int | None,
                 chat_template_kwargs: dict | None = None, overlong: str = "truncate") -> EncodedPairs:
    """(chosen ids, rejected ids) of each row of the preference frames in ``files`` ((path, frame) each). A pair
    with either side over ``max_length`` is cut with one prompt window for both sides (``overlong="truncate"``:
    :func:`cut_from_the_left`, the Bradley-Terry comparison is of two responses to the same context) or left out
    (``"drop"``: every text scored is whole). Rows whose chosen and rejected have the same ids (once cut) are left
    out too: they teach nothing."""
    encoded = EncodedPairs(dropped=overlong == "drop")
    for path, frame in files:
        for row, (prompt, chosen, rejected) in enumerate(zip(frame["prompt"], frame["chosen"], frame["rejected"])):
            encoded.rows += 1
            messages = [dict(m) for m in prompt]
            prompt_ids, response_ids = conversation_ids(tokenizer, messages, [chosen, rejected], chat_template_kwargs)
            longer = len(prompt_ids) + max(map(len, response_ids))  # the pair's longer side, uncut
            if max_length is not None and longer > max_length:
                encoded.over_length.append(longer)
                if encoded.dropped:
                    continue
            pair, cut = [], False
            for ids, prompt_cut, response_cut in cut_from_the_left(prompt_ids, response_ids, max_length):
                encoded.response_cut += response_cut > 0
                encoded.prompt_cut += prompt_cut > 0 and not response_cut
                cut = cut or response_cut > 0
                pair.append(ids)
            if pair[0] == pair[1]:
                encoded.identical.append((path, row, cut))
            else:
                encoded.pairs.append((pair[0], pair[1]))
    return encoded


def pairs_fingerprint(pairs: list[tuple[list[int], list[int]]]) -> str:
    """SHA-256 of encoded pairs in their order: each side's length, then its ids as little-endian int64. A checkpoint
    records it for the training pairs, over which each step's pairs are a function of the step alone."""
    digest = hashlib.sha256()
    for pair in pairs:
        for ids in pair:
            digest.update(len(ids).to_bytes(8, "little"))
            digest.update(np.asarray(ids, dtype="<i8").tobytes())
    return digest.hexdigest()


def collate(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` / ``attention_mask`` (2 * n_pairs, L): the chosen rows, then the rejected."""
    rows = [c for c, _ in pairs] + [r for _, r in pairs]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = torch.tensor(row)
        attention_mask[i, :len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def sequence_scores(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The scalar head at each row's last non-pad token (transformers' pooling, as PPO's scoring reads it:
    :func:`rlhf_core.rewards.reward_model.sequence_scores`). (bs,)."""
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, 0].float()


# ----------------------------------------------------------------------------- loading


def load_reward_backbone(path: str | os.PathLike, pad_token_id: int, dtype: str = "float32",
                         trust_remote_code: bool = False, seed: int = 0, device: torch.device | str = "cpu"):
    """A one-label sequence classifier on the checkpoint at ``path`` (a fresh head unless it has one)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    quiet = [logging.getLogger("transformers.modeling_utils"),  # "newly initialised score weights" is expected
             logging.getLogger("transformers.distributed.tensor_parallel")]  # and so is "score was not sharded"
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    with transformers_bars(False):
        try:
            torch.manual_seed(seed)
            config = AutoConfig.from_pretrained(str(resolve(path)), num_labels=1,
                                                trust_remote_code=trust_remote_code)
            config.pad_token_id = pad_token_id  # where the pooling stops: the last token that is not padding
            model = AutoModelForSequenceClassification.from_pretrained(
                str(resolve(path)), config=config, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
        finally:
            for logger, level in zip(quiet, levels):
                logger.setLevel(level)
    model = model.to(torch.device(device))
    cpu_matmul.route(model)
    return model


class RewardModelWorker(CheckpointableWorker):
    """The reward model, its optimizer and its step; alone, or one FSDP2-sharded rank of a worker group."""

    def __init__(self, config: RewardTrainConfig, pad_token_id: int, total_steps: int, device: str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        model_cfg = config.model
        module = load_reward_backbone(model_cfg.path, pad_token_id, model_cfg.dtype, model_cfg.trust_remote_code,
                                      config.seed, self.device)
        # saved with the export, so that PPO can tell whether its prompts are rendered as these pairs were
        setattr(module.config, TEMPLATE_KWARGS, dict(config.apply_chat_template_kwargs))
        # the Bradley-Terry loss of two scores each drawn with its own dropout masks is not the loss of the scores
        # PPO reads (eval mode): off in training too; the base's rates, which the export records, by config path
        self.base_dropout = disable_dropout(module) if config.disable_dropout else {}
        if model_cfg.enable_gradient_checkpointing:
            enable_checkpointing(module)
        self.lora = model_cfg.lora_rank > 0
        if self.lora:  # the head stays out of the adapters and is trained in full
            module = lora.apply_lora(module, model_cfg.lora_rank, model_cfg.lora_alpha, model_cfg.target_modules,
                                     critic=True)
        self.sharded = distributed.in_worker_group()
        if self.sharded:
            distributed.fsdp_wrap(lora.base_model(module), self.device, config.fsdp_config)
        self.module = module
        self.forward_module = lora.base_model(module)
        self.optimizer = build_optimizer([p for p in module.parameters() if p.requires_grad], config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.optim, total_steps)
        self.shuffle_generator = torch.Generator()  # unused: the controller orders the pairs

    def _micro_batches(self, pairs: list, weights: list[float]) -> list[tuple[list, list[float]]]:
        size = self.config.micro_batch_size_per_gpu
        return [(pairs[i:i + size], weights[i:i + size]) for i in range(0, len(pairs), size)]

    def _rewards(self, pairs: list) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = collate(pairs, self.forward_module.config.pad_token_id)
        scores = sequence_scores(self.forward_module, inputs["input_ids"].to(self.device),
                                 inputs["attention_mask"].to(self.device))  # (2 * n,)
        return scores[:len(pairs)], scores[len(pairs):]

    def train_step(self, pairs: list, weights: list[float], global_pairs: int) -> dict[str, float]:
        """One optimizer step on this rank's share of the step's pairs (``weights`` 0 for padding rows)."""
        cfg = self.config
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        stats = None
        finite = True
        for micro, micro_weights in self._micro_batches(pairs, weights):
            chosen, rejected = self._rewards(micro)
            weight = torch.tensor(micro_weights, device=chosen.device)
            loss = bradley_terry_loss(chosen, rejected, cfg.margin, weight, normaliser=global_pairs)
            finite = finite and bool(torch.isfinite(loss))
            loss.backward()
            keep = weight > 0
            stats = merge_statistics(stats, pair_statistics(chosen.detach()[keep], rejected.detach()[keep],
                                                            cfg.margin))
        finite = distributed.all_true(finite)
        grad_norm, grad_finite = clip_and_check(self.module.parameters(), cfg.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        if finite and grad_finite:
            self.optimizer.step()
            # the schedule counts the updates taken (as transformers' Trainer, whose skipped fp16 steps leave it): a
            # skipped step, which takes none, leaves the warm-up where it was for the next step to start it
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.module.eval()
        return {**reduce_statistics(stats), "grad_norm": grad_norm, "lr": lr,
                "skipped": float(not (finite and grad_finite))}

    @torch.no_grad()
    def evaluate(self, pairs: list, weights: list[float]) -> dict[str, float]:
        """The :func:`pair_statistics` of this rank's share of the held-out pairs, reduced over the ranks."""
        self.module.eval()
        stats = None
        for micro, micro_weights in self._micro_batches(pairs, weights):
            chosen, rejected = self._rewards(micro)
            keep = torch.tensor(micro_weights, device=chosen.device) > 0
            stats = merge_statistics(stats, pair_statistics(chosen[keep], rejected[keep], self.config.margin))
        return reduce_statistics(stats)

    def extra_state(self) -> dict:
        return {"scheduler": self.scheduler.state_dict()}

    def load_extra_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])

    def load_checkpoint(self, folder: str | Path, saved_workers: int) -> None:
        """The ``reward_model/`` state that ``saved_workers`` workers wrote, into this worker or this rank
        (:func:`~rlhf_core.workers.common.load_saved`: re-split exactly; the schedule, the only other state, is
        the same on every rank)."""
        load_saved(self, Path(folder), saved_workers)

    def save_hf(self, target: str | Path) -> None:
        """The model as a plain transformers directory (LoRA merged); sharded, every rank calls this."""
        state = distributed.full_state_dict(self.module)  # {} on ranks other than 0 when sharded
        if distributed.rank() == 0:
            if self.lora:
                state = lora.merged_state_dict(state, lora.lora_scaling(self.module))
            with transformers_bars(False):
                save_hf_model(self.forward_module, state, target,
                              config_with(self.forward_module.config, self.base_dropout))


class RewardModelRayWorker(DistributedWorker):
    """The remote side: one rank of a worker group holding a :class:`RewardModelWorker`."""

    def setup(self, config: RewardTrainConfig, pad_token_id: int, total_steps: int, cpu_matmul_kind: str,
              keep_freed_memory: bool) -> None:
        cpu_matmul.configure(cpu_matmul_kind)
        heap.configure(keep_freed_memory)
        self.worker = RewardModelWorker(config, pad_token_id, total_steps, self.device)

    def train_share(self, share: tuple[list, list[float]], global_pairs: int) -> dict[str, float]:
        return self.worker.train_step(*share, global_pairs)

    def evaluate_share(self, share: tuple[list, list[float]]) -> dict[str, float]:
        return self.worker.evaluate(*share)

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)


class _GroupWorker:
    """What the trainer sees of the worker group: the :class:`RewardModelWorker` methods, each rank on an
    equal share of the pairs (padded with weight-0 repeats, so every rank runs as many forwards)."""

    sharded = True

    def __init__(self, group):
        self.group = group

    def _shares(self, pairs: list, weights: list[float]) -> list[tuple[list, list[float]]]:
        world = self.group.world_size
        pad = -len(pairs) % world
        pairs, weights = pairs + [pairs[-1]] * pad, weights + [0.0] * pad
        size = len(pairs) // world
        return [(pairs[r * size:(r + 1) * size], weights[r * size:(r + 1) * size]) for r in range(world)]

    def train_step(self, pairs, weights, global_pairs):
        return self.group.dispatch("train_share", self._shares(pairs, weights), global_pairs)[0]

    def evaluate(self, pairs, weights):
        return self.group.dispatch("evaluate_share", self._shares(pairs, weights))[0]

    def save_shards(self, folder) -> None:
        self.group.execute_all("call", "save_shards", absolute(folder))

    def weights_finite(self) -> bool:
        return all(self.group.execute_all("call", "weights_finite"))

    def load_checkpoint(self, folder, saved_workers: int) -> None:
        self.group.execute_all("call", "load_checkpoint", absolute(folder), saved_workers)

    def save_hf(self, target) -> None:
        self.group.execute_all("call", "save_hf", absolute(target))


# ----------------------------------------------------------------------------- preflight


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@dataclasses.dataclass
class Preferences:
    """What :func:`preflight` hands the trainer: the tokenizer, the encoded training and held-out pairs, and how
    many pairs of each split were over ``max_length`` (cut or left out, as ``overlong`` says)."""

    tokenizer: object
    train: list[tuple[list[int], list[int]]]
    val: list[tuple[list[int], list[int]]]
    over_length: dict[str, int] = dataclasses.field(default_factory=dict)  # split: pairs over max_length


#: ``reward_model.train.max_length`` where it is null and the model's config names no max_position_embeddings
DEFAULT_MAX_LENGTH = 1024


def preflight(cfg: PPOConfig) -> Preferences:
    """Check config, model, output and data, and encode the pairs, without loading weights or writing anything.
    A null ``reward_model.train.max_length`` becomes the model's positions here, in ``cfg``.

    Raises PreferenceDataError for unusable preference files, RewardTrainingError for the rest.
    """
    rm, errors = cfg.reward_model.train, reward_training_batch_problems(cfg)
    model_path = rm.model.path
    try:
        check_model_dir(model_path, f"{KEY}.model.path")
        check_tokenizer_dir(rm.model.tokenizer_path or model_path,
                            f"{KEY}.model.tokenizer_path" if rm.model.tokenizer_path else f"{KEY}.model.path")
        limit = max_positions(model_path, rm.model.trust_remote_code)
        if rm.max_length is None:  # the model's positions, written into the config its checkpoints record
            rm.max_length = limit or DEFAULT_MAX_LENGTH
        elif limit is not None and rm.max_length > limit:  # past them: sequences its scoring in PPO would cut
            errors.append(f"{KEY}.max_length={rm.max_length} exceeds the max_position_embeddings of {model_path} "
                          f"({limit}): set {KEY}.max_length to at most {limit} (longer pairs lose tokens from the "
                          "left, the response's end kept)")
        if rm.model.lora_rank > 0:  # as apply_lora takes them, before the weights load (the head trains in full)
            errors += lora.target_problems(f"{KEY}.model", resolve(model_path), rm.model.target_modules,
                                           rm.model.trust_remote_code, scorer=True)
    except ModelError as exc:
        errors.append(str(exc))
    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        errors.append("trainer.device=cuda but no CUDA device is visible; set trainer.device=cpu")
    address = cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS")
    if cfg.world_size > 1 and address and (problem := address_problem(address, remember=True)) is not None:
        errors.append(problem)  # before the pairs are read and encoded, as PPO's preflight says it
    errors += store_problems(cfg.trainer.logger)
    out = resolve(rm.default_local_dir)
    existing = _nearest_existing(out.absolute())
    if out.is_dir():  # (a rerun after a save it refused: its checkpoints are there)
        try:
            ckpt.check_writable(out, ckpt.rerun_advice(rm.resume_mode, KEY), f"{KEY}.default_local_dir")
        except ckpt.CheckpointError as exc:
            errors.append(f"{KEY}.default_local_dir: {exc}")
    elif not existing.is_dir() or not os.access(existing, os.W_OK):
        errors.append(f"{KEY}.default_local_dir: {out} cannot be created ({existing} is not a writable directory)")
    try:  # checkpoints verl wrote: none is resumed nor saved over (the message names the key)
        ckpt.refuse_verl(out, rm.resume_mode, rm.resume_from_path and str(resolve(rm.resume_from_path)), KEY,
                         "reward-model")
    except ckpt.CheckpointError as exc:
        errors.append(str(exc))
    else:
        if rm.resume_mode == "resume_path":
            path = resolve(rm.resume_from_path)
            try:
                ckpt.step_of(path)
                ckpt.read_manifest(path)
            except ckpt.CheckpointError as exc:
                errors.append(f"{KEY}.resume_from_path: {exc}{ckpt.checkpoint_meant(path, KEY)}")
    frames = {"train": [], "val": []}
    for split, files in (("train", rm.train_files), ("val", rm.val_files)):
        if files is None:
            continue
        try:
            frames[split] = [(str(path), read_preferences(path)) for path in as_file_list(files)]
        except PreferenceDataError as exc:
            raise PreferenceDataError(f"{KEY}.{split}_files: {exc}") from exc
    check_preference_frames(frames["train"], frames["val"], {split: f"{KEY}.{split}_files" for split in frames})
    train_files = [path for path, _ in frames["train"]]
    n_train = sum(len(frame) for _, frame in frames["train"])
    if not train_files:
        errors.append(f"{KEY}.train_files names no file: give the preference parquet file(s) to train on")
    elif n_train == 0:  # (no batch size fits: the files are the fault, as PPO says of prompt files without rows)
        errors.append(f"{KEY}.train_files: {', '.join(train_files)} {'has' if len(train_files) == 1 else 'have'} "
                      "no rows; give files with preference pairs")
    elif n_train < rm.train_batch_size:
        errors.append(f"{KEY}.train_files hold {n_train} pairs, fewer than {KEY}.train_batch_size "
                      f"({rm.train_batch_size}): lower the batch size or add pairs")
    if errors:
        raise RewardTrainingError(errors)
    tokenizer = load_tokenizer(rm.model.tokenizer_path or model_path, rm.model.trust_remote_code)
    encoded = {split: encode_pairs(items, tokenizer, rm.max_length, rm.apply_chat_template_kwargs, rm.overlong)
               for split, items in frames.items()}
    _notify_over_length(encoded, rm.max_length)
    for split, pairs in encoded.items():
        errors += _check_left_out(split, pairs, rm.max_length)
    kept = len(encoded["train"].pairs)
    if encoded["train"].pairs and kept < rm.train_batch_size:
        which = (f"within {KEY}.max_length ({rm.max_length}) whose chosen and rejected differ ({KEY}.overlong=drop "
                 f"left out {len(encoded['train'].over_length)})" if encoded["train"].dropped else
                 f"whose chosen and rejected differ once cut to {KEY}.max_length ({rm.max_length})")
        errors.append(f"{KEY}.train_files hold {kept} pairs {which}, fewer than {KEY}.train_batch_size "
                      f"({rm.train_batch_size}): raise max_length, lower the batch size or add pairs")
    if errors:
        raise RewardTrainingError(errors)
    return Preferences(tokenizer, encoded["train"].pairs, encoded["val"].pairs,
                       {split: len(pairs.over_length) for split, pairs in encoded.items() if pairs.rows})


def _notify_over_length(encoded: dict[str, EncodedPairs], max_length: int) -> None:
    """One line: how many pairs of each split are over ``max_length``, and what ``overlong`` did with them."""
    train, val = encoded["train"], encoded["val"]
    if not train.over_length and not val.over_length:
        return
    counts = f"{len(train.over_length):,} of {train.rows:,} training pairs"
    if val.rows:
        counts += f" and {len(val.over_length):,} of {val.rows:,} held-out pairs"
    if train.dropped:
        done = f"left out of training{' and validation' if val.rows else ''}, every text scored whole"
    else:
        sequences = [f"{n} lost prompt tokens from the left" for n in [train.prompt_cut + val.prompt_cut] if n]
        sequences += [f"{n} lost their whole prompt and the start of their response"
                      for n in [train.response_cut + val.response_cut] if n]
        done = (f"cut to one prompt window (the same prompt tokens on both sides); of their sequences, "
                f"{'; '.join(sequences)} (the response's end, where the score is read, is kept)")
    print(f"notice: {counts} are over {KEY}.max_length={max_length} on a side ({KEY}.overlong="
          f"{'drop' if train.dropped else 'truncate'}): {done}", file=sys.stderr)


def _check_left_out(split: str, encoded: EncodedPairs, max_length: int) -> list[str]:
    """The error of a split left without a pair by those over ``max_length`` (``overlong=drop``) and those whose
    chosen and rejected are the same ids (once cut); a notice where only some have the same ids."""
    if encoded.dropped and encoded.over_length and not encoded.pairs:
        shortest, longest = min(encoded.over_length), max(encoded.over_length)
        same = f"; the other {len(encoded.identical)} have the same token ids on both sides" \
            if encoded.identical else ""
        return [f"{KEY}.{split}_files: every pair is left out: {len(encoded.over_length)} of {encoded.rows} are over "
                f"{KEY}.max_length={max_length} on a side, which {KEY}.overlong=drop leaves out (their longer "
                f"sides run from {shortest} to {longest} tokens){same}: raise max_length to at least {shortest} "
                f"(within the model's positions), or set {KEY}.overlong=truncate to cut them"]
    if not encoded.identical:
        return []
    causes = []
    for was_cut in (True, False):
        rows = [(path, row) for path, row, cut in encoded.identical if cut == was_cut]
        if rows:
            why, fix = ((f"once cut to {KEY}.max_length ({max_length})", "raise max_length so that their differences fit")
                        if was_cut else ("uncut: the tokenizer reads their differences as the same tokens",
                                         "make the texts differ in what the tokenizer reads"))
            causes.append(f"{len(rows)} with the same ids {why} (the first: row {rows[0][1]} of {rows[0][0]}): {fix}")
    if not encoded.pairs:
        return [f"{KEY}.{split}_files: in every pair chosen and rejected have the same token ids; {'; '.join(causes)}"]
    print(f"notice: {len(encoded.identical)} pair(s) of {KEY}.{split}_files are left out, their chosen and rejected "
          f"having the same token ids; {'; '.join(causes)}", file=sys.stderr)
    return []


# ----------------------------------------------------------------------------- the trainer


class RewardModelTrainer:
    """The single controller: orders the pairs, drives the worker(s), validates, checkpoints, exports."""

    def __init__(self, cfg: PPOConfig, preferences: Preferences | None = None):
        self.cfg, self.rm = cfg, cfg.reward_model.train
        # Python's and NumPy's global streams seeded as PPO's trainer seeds them: their states go into every
        # checkpoint (rng_state.pt), which otherwise held a fresh process's random ones, other in each run
        random.seed(self.rm.seed)
        np.random.seed(self.rm.seed % 2**32)
        cpu_matmul.configure(cfg.trainer.cpu_matmul)
        heap.configure(cfg.trainer.keep_freed_memory)
        preferences = preflight(cfg) if preferences is None else preferences
        self.local_dir = resolve(self.rm.default_local_dir)
        self.checkpoint_dir = self.local_dir  # (the name the signal handling looks for, as on PPO's trainer)
        #: (signal name, number) once Ctrl-C or SIGTERM asked the run to stop (main_ppo.stop_on_signals): it
        #: saves and stops before the next step; the step whose training is under way, if any
        self.stop_requested: tuple[str, int] | None = None
        self.step_under_way: int | None = None
        self.tokenizer = preferences.tokenizer
        self.train_pairs, self.val_pairs = preferences.train, preferences.val
        #: pairs over max_length, cut or left out as reward_model.train.overlong says: logged with this run's first
        #: step, and returned with the validation metrics by train_reward_model
        self.length_metrics = {f"{split}/pairs_over_max_length": count
                               for split, count in preferences.over_length.items()}
        self.steps_per_epoch = len(self.train_pairs) // self.rm.train_batch_size  # the last partial batch waits
        self.total_steps = self.steps_per_epoch * self.rm.total_epochs
        if self.rm.total_training_steps is not None:
            self.total_steps = min(self.total_steps, self.rm.total_training_steps)
        self.global_step = 0
        self.resumed_from: Path | None = None  # the checkpoint resume() loaded
        self.last_saved: Path | None = None  # the checkpoint the weights were last saved in: by save(), or resume()'s
        #: what the stops on skipped steps read, kept in every checkpoint (as PPO's trainer.guard keeps its streak):
        #: the skipped steps in a row up to the step reached, and the step from which none took an update (the
        #: run's start, 0; None once one did)
        self.consecutive_skips, self.no_update_since = 0, 0
        self.group = None
        pad_id = self.tokenizer.pad_token_id
        if cfg.world_size > 1:
            self.group = WorkerGroup(RewardModelRayWorker, cfg.world_size, device=cfg.trainer.device,
                                     ray_address=cfg.trainer.ray_address,
                                     collective_timeout_s=cfg.actor_rollout_ref.nccl_timeout,
                                     runtime_env=cfg.trainer.ray_runtime_env)
            try:
                rm = for_workers(self.rm, ("model.path", "model.tokenizer_path", "default_local_dir"),
                                 folders=("default_local_dir",))  # the workers read paths as the driver does
                self.group.execute_all("setup", rm, pad_id, self.total_steps, cfg.trainer.cpu_matmul,
                                       cfg.trainer.keep_freed_memory)
            except BaseException:
                self.group.shutdown()
                raise
            self.worker = _GroupWorker(self.group)
        else:
            self.worker = RewardModelWorker(self.rm, pad_id, self.total_steps, cfg.trainer.device)

    # ------------------------------------------------------------------ order of the pairs
    def _epoch_order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.rm.seed * 100_003 + epoch)
        return torch.randperm(len(self.train_pairs), generator=generator).tolist()

    def _step_pairs(self, step: int) -> list:
        """The pairs of optimizer step ``step`` (0-based): a function of the step alone, so a resume is exact."""
        epoch, position = divmod(step, self.steps_per_epoch)
        order = self._epoch_order(epoch)
        size = self.rm.train_batch_size
        return [self.train_pairs[i] for i in order[position * size:(position + 1) * size]]

    @functools.cached_property
    def train_fingerprint(self) -> str:
        """:func:`pairs_fingerprint` of the training pairs, which every checkpoint records and a resume compares
        (hashed once, at the run's first save or its resume)."""
        return pairs_fingerprint(self.train_pairs)

    # ------------------------------------------------------------------ phases
    def validate(self) -> dict[str, float]:
        if not self.val_pairs:
            return {}
        return pair_metrics(self.worker.evaluate(self.val_pairs, [1.0] * len(self.val_pairs)), "val")

    def train_step(self) -> dict[str, float]:
        pairs = self._step_pairs(self.global_step)
        started = time.perf_counter()
        sums = self.worker.train_step(pairs, [1.0] * len(pairs), len(pairs))
        self.global_step += 1
        return {**pair_metrics(sums, "train"), "train/grad_norm": sums["grad_norm"],
                "train/lr": sums["lr"], "train/skipped_step": sums["skipped"],
                "timing_s/step": time.perf_counter() - started}

    def fit(self, log=None) -> dict[str, float]:
        """Train to ``total_steps`` (resuming first), validating and saving as configured; returns the last
        validation metrics (``val/pair_accuracy``, ...) and writes the HF export."""
        with self.started():
            return self.train(log)

    @contextlib.contextmanager
    def started(self):
        """Hold the folder's run lock (one run at a time saves into it, as PPO's) and start the run as
        ``resume_mode`` says: afresh (an earlier run's records moved aside) or from the checkpoint it resumes,
        loaded. Every refusal (a checkpoint of another kind, one that does not verify, a config that differs) is
        raised here, so that a caller sets up its tracking inside and a refused run leaves the folder's wandb,
        MLflow and TensorBoard runs as they were."""
        with ckpt.run_lock(self.local_dir, f"{KEY}.default_local_dir"):
            if self.rm.resume_mode == "disable":
                # an earlier run's checkpoints there: never resumed by a rerun (and never a PPO run's, replaced)
                ckpt.start_afresh(self.local_dir, KEY, "reward-model")
            self.resume()
            if self.resumed_from is None and self.rm.resume_mode != "disable":
                ckpt.set_aside_unsaved_records(self.local_dir, KEY)  # a run killed before its first save left records
            if self.resumed_from is not None and self.global_step >= self.total_steps:
                print(f"notice: {self.already_complete()}", file=sys.stderr, flush=True)
            yield self

    def train(self, log=None) -> dict[str, float]:
        """The steps from where :meth:`started` left the run to ``total_steps``, a validation after the last, the
        last save and the HF export; call it inside :meth:`started`. A worker's failure is said with the step it
        stopped and the checkpoint a rerun resumes from, as PPO's trainer says it."""
        try:
            return self._train(log)
        except WorkerError as exc:
            step = self.step_under_way or self.global_step
            raise WorkerError(f"training the reward model failed at step {step}: {exc}\n"
                              f"{self._resume_point()}") from exc

    def _train(self, log) -> dict[str, float]:
        from tqdm import tqdm

        from rlhf_core.progress import progress_bar

        log = self._logging(log or (lambda metrics, step: None))
        rm, last_val, first = self.rm, {}, True
        bar = progress_bar(total=self.total_steps, initial=self.global_step, desc="reward model", unit="step")
        try:
            while self.global_step < self.total_steps:
                self._stop_if_requested()
                self.step_under_way = self.global_step + 1
                metrics = self.train_step()
                if first:
                    metrics.update(self.length_metrics)
                    first = False
                step = self.global_step
                if not math.isfinite(metrics["train/loss"]):
                    if not self.worker.weights_finite():  # (its update skipped: those the step started from)
                        log(metrics, step)  # the step's record, with its loss, before the run stops on it
                        raise self._not_finite(step, metrics["train/loss"])
                    tqdm.write(f"warning: the loss of step {step} is {metrics['train/loss']} (train/loss) while the "
                               "weights are finite, as one step in reduced precision can overflow: its update was "
                               "skipped (train/skipped_step) and training goes on", file=sys.stderr)
                if metrics["train/skipped_step"]:
                    self.consecutive_skips += 1
                else:
                    self.consecutive_skips, self.no_update_since = 0, None
                skips = self.consecutive_skips
                if rm.max_consecutive_skips is not None and skips >= rm.max_consecutive_skips:
                    log(metrics, step)  # the step's record before the run stops on it
                    raise self._all_skipped(step, f"{skips} consecutive steps (up to step {step}) had a non-finite "
                                                  "loss or gradient on finite weights and took no update "
                                                  f"(train/skipped_step; {KEY}.max_consecutive_skips="
                                                  f"{rm.max_consecutive_skips})", streak=True)
                if rm.test_freq > 0 and step % rm.test_freq == 0 and step < self.total_steps:
                    last_val = self.validate()
                    metrics.update(last_val)
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", acc=f"{metrics['train/pair_accuracy']:.2f}")
                log(metrics, step)
                self._check_validation(metrics)  # (val/loss there only where the step validated)
                if rm.save_freq > 0 and step % rm.save_freq == 0 and step < self.total_steps:
                    self.save()
                self.step_under_way = None
        finally:
            bar.close()
        untrained = self.no_update_since  # the weights those the run started from: not saved as trained
        if untrained is not None and self.global_step > untrained:
            steps = (f"steps {untrained + 1} to {self.global_step}" if self.global_step > untrained + 1
                     else f"step {self.global_step}")
            raise self._all_skipped(self.global_step, f"no step of this run ({steps}) took an update: each had a "
                                                      "non-finite loss or gradient on finite weights "
                                                      "(train/skipped_step)")
        self._check_weights()  # before the validation: weights holding NaN give NaN scores
        last_val = self.validate()
        if last_val:
            log(last_val, self.global_step)
            self._check_validation(last_val)
        if not self._holds_step_here():
            self.save()
        self.export(self.local_dir / HF_DIR)
        return last_val

    def _not_finite(self, step: int, loss: float) -> GuardError:
        """The error to stop the run with where step ``step``'s loss was not finite and the weights hold NaN or inf.
        Its update was skipped (the workers take none on a non-finite loss), so those weights, the ones it started
        from, would meet every later step alike and be exported: nothing more is saved or exported, and the message
        says where those weights came from and how to go on (``optim.lr`` cannot change on a resume: a new run).
        On finite weights the step is skipped alone (one that overflowed in reduced precision) and training goes on."""
        said = (f"training the reward model stopped at step {step}: its loss is {loss} (train/loss): the weights "
                "the step started from hold NaN or inf values, so its update was skipped and the run saves and "
                "exports nothing more; ")
        return GuardError(said + self._weights_from(step - 1))

    def _all_skipped(self, step: int, said: str, streak: bool = False) -> GuardError:
        """The error to stop the run with at step ``step`` where its steps (``said`` says which) were skipped, each
        on a non-finite loss or gradient on finite weights: the scores overflow, or the pairs drive them there, step
        after step, and the weights are those the steps started from, so nothing more is saved or exported (not as
        trained). ``model.dtype`` and ``optim.lr`` cannot change on a resume: a new run. A resume meets the same
        pairs (a function of the step) on the same weights, so the same command stops alike: where no step of the
        run took an update its checkpoints hold the weights it started from, and the way on is a new run; after a
        ``streak`` (``max_consecutive_skips``, which a resume may change), a resume with the limit raised."""
        said = (f"training the reward model stopped at step {step}: {said}, so the run saves and exports nothing "
                f"more: check the preference data, and {KEY}.model.dtype (float16 and bfloat16 scores can overflow) "
                f"and {KEY}.optim.lr, which a new run may change; ")
        rerun = self.rerun_point()
        latest = rerun.checkpoint
        if latest is not None and self.no_update_since == 0:
            return NothingTrainedError(said + f"its checkpoints hold the weights it started from ({KEY}.model.path), "
                                              "which no step updated, and a resume meets the same pairs on them "
                                              f"alike: start the new run with {KEY}.resume_mode=disable or another "
                                              f"{KEY}.default_local_dir")
        if latest is not None and streak:
            return GuardError(said + "a resume meets the same pairs on the same weights at these steps, so to "
                                     f"train past them raise {KEY}.max_consecutive_skips above "
                                     f"{self.consecutive_skips} or set it to null (a resume may change it); "
                                     + self._resume_point(rerun=rerun))
        return GuardError(said + self._resume_point(rerun=rerun))

    def _resume_point(self, exc: BaseException | None = None, rerun: ckpt.RerunPoint | None = None) -> str:
        """:func:`checkpoint.resume_point` for this run, from ``rerun`` (by default :meth:`rerun_point`), ``exc``
        the failed write that stopped it, if one did."""
        rerun = rerun or self.rerun_point()
        return ckpt.resume_point(rerun.checkpoint, exc, self.local_dir, rerun.advice, f"{KEY}.default_local_dir")

    def _weights_from(self, step: int) -> str:
        """Where the weights the run held after step ``step`` came from, and how to go on (:func:`weights_origin`,
        as PPO's trainer says it; ``optim.lr`` cannot change on a resume: a new run)."""
        rerun = self.rerun_point()
        return weights_origin(step, self.resumed_from, rerun.checkpoint,
                              f"{KEY}.model.path ({self.rm.model.path})", f"{KEY}.optim.lr", KEY, rerun.advice,
                              lr_on_resume=False)

    def _check_weights(self) -> None:
        """Stop the run (:class:`GuardError`) where the weights hold NaN or inf: called before every save and the
        export, which would otherwise write them (an update on a finite loss, the last one too, can leave them so)."""
        if not self.worker.weights_finite():
            raise GuardError(f"training the reward model stopped at step {self.global_step}: the weights hold NaN "
                             f"or inf values, so the run saves and exports nothing more; "
                             f"{self._weights_from(self.global_step)}")

    def _check_validation(self, val: dict[str, float]) -> None:
        """Stop the run (:class:`GuardError`) where a validation's loss is not finite: the weights give NaN or inf
        scores on the held-out pairs, and nothing more is saved or exported."""
        loss = val.get("val/loss", 0.0)
        if not math.isfinite(loss):
            raise GuardError(f"training the reward model stopped at step {self.global_step}: its validation loss is "
                             f"{loss} (val/loss): the weights give NaN or inf scores on the held-out pairs, so the "
                             f"run saves and exports nothing more; {self._weights_from(self.global_step)}")

    def _logging(self, log):
        """``log`` that stops the run with :class:`LoggingError` where it cannot record a step, naming the checkpoint
        a rerun resumes from (as PPO's trainer does) and, where the disk is full or the folder refuses writes, what
        to do first (:meth:`_resume_point`)."""
        def logged(metrics: dict[str, float], step: int) -> None:
            try:
                log(metrics, step)
            except Exception as exc:
                raise LoggingError(f"logging the metrics of step {step} failed ({type(exc).__name__}: {exc}); "
                                   f"{self._resume_point(exc)}") from exc
        return logged

    def already_complete(self) -> str:
        """What to say where a resume finds the run already at its end: the limit that ends it (both where
        total_training_steps and the last epoch end at the same step) and every limit to raise to train on."""
        rm, step = self.rm, self.global_step
        steps_key, epochs_key = f"{KEY}.total_training_steps", f"{KEY}.total_epochs"
        epochs_end = self.steps_per_epoch * rm.total_epochs
        limits = [f"{steps_key}={rm.total_training_steps}"] if rm.total_training_steps == self.total_steps else []
        if epochs_end == self.total_steps:
            limits.append(f"{epochs_key}={rm.total_epochs} of {self.steps_per_epoch} steps each")
        raise_ = []  # every limit at or below the step reached: raising one alone would end the next run there too
        if rm.total_training_steps is not None and rm.total_training_steps <= step:
            raise_.append(f"{steps_key} above {step}")
        if epochs_end <= step:
            raise_.append(f"{epochs_key} to {step // max(self.steps_per_epoch, 1) + 1} or more")
        return (f"the reward model's run is already complete: {self.resumed_from} is at step {step} and this run "
                f"ends at step {self.total_steps} ({' and '.join(limits)}), so nothing is trained (the model is "
                f"validated and exported again); to train on from it, raise {' and '.join(raise_)} and run again")

    def _stop_if_requested(self) -> None:
        """Where a signal asked the run to stop: save this step (unless it is saved, or none has run) and raise
        :class:`TrainingInterrupted` naming the checkpoint a rerun resumes from."""
        if self.stop_requested is None:
            return
        name, number = self.stop_requested
        saved = None
        if self._saved_step == self.global_step:
            saved = self.rerun_point().checkpoint
        elif self.global_step > 0:
            saved = self.save()
        raise TrainingInterrupted(name, number, self.global_step, str(saved) if saved else None, self.rerun_advice)

    @property
    def rerun_advice(self) -> str:
        """How a rerun resumes (:meth:`rerun_point`'s advice)."""
        return self.rerun_point().advice

    def rerun_point(self) -> ckpt.RerunPoint:
        """How a rerun resumes and the checkpoint it resumes from (:func:`checkpoint.rerun_point`, as PPO's trainer
        says it): until a run resumed from ``resume_from_path`` saves, also before it has loaded it, that path."""
        return ckpt.rerun_point(self.rm, self.resumed_from, self.last_saved, KEY)

    # ------------------------------------------------------------------ checkpoints
    @property
    def _saved_step(self) -> int | None:
        """The step whose weights :attr:`last_saved` holds (its global_step_N name; None where none is saved)."""
        return ckpt.step_of(self.last_saved) if self.last_saved is not None else None

    def _holds_step_here(self) -> bool:
        """Whether ``default_local_dir``'s checkpoint of the step reached holds the run's weights: one this run saved,
        or the one it resumed from there (untrained since). Not one of an earlier run at that step, which a run
        resumed from ``resume_from_path`` in another folder meets there."""
        return (self._saved_step == self.global_step
                and self.last_saved.parent.resolve() == self.local_dir.resolve())

    def _fill(self, files: ckpt.CheckpointFiles) -> list[str]:
        if getattr(self.worker, "sharded", False):
            files.tree(PART, self.worker.save_shards)
        else:
            state = self.worker.state_dict()
            files.torch(f"{PART}/model_state.pt", state.pop("model"))
            files.torch(f"{PART}/optim_state.pt", {"optimizer": state.pop("optimizer")})
            files.torch(f"{PART}/extra_state.pt", state)
        epoch, position = divmod(self.global_step, max(self.steps_per_epoch, 1))
        files.text(ckpt.TRAINER_STATE, json.dumps({"format": ckpt.FORMAT_VERSION, "global_step": self.global_step,
                                                   "epoch": epoch, "step_in_epoch": position,
                                                   "total_steps": self.total_steps,
                                                   "consecutive_skips": self.consecutive_skips,
                                                   "no_update_since": self.no_update_since,
                                                   "train_pairs": len(self.train_pairs),
                                                   "train_pairs_sha256": self.train_fingerprint}, indent=1))
        files.torch(ckpt.RNG_STATE, ckpt.rng_state())
        files.text(ckpt.CONFIG_FILE, self.cfg.to_yaml())
        return [PART]

    def save(self) -> Path:
        """``global_step_N`` written into a temp directory, renamed into place, then marked latest; never weights
        that hold NaN or inf (:meth:`_check_weights`)."""
        self._check_weights()
        path = ckpt.write_checkpoint(self.local_dir, self.global_step, self._fill, rerun=self.rerun_advice,
                                     key=f"{KEY}.default_local_dir")
        self.last_saved = path
        return path

    def resume_path(self) -> Path | None:
        """The checkpoint :meth:`fit` resumes from (None: it starts afresh); CheckpointError where auto finds
        checkpoints without a latest marker."""
        rm = self.rm
        if rm.resume_mode == "disable":
            return None
        if rm.resume_mode == "resume_path":
            return resolve(rm.resume_from_path)
        latest = ckpt.latest_checkpoint(self.local_dir)
        if latest is None and ckpt.list_checkpoints(self.local_dir):  # a new run would overwrite them: say so
            raise ckpt.CheckpointError(ckpt.unmarked_refusal(self.local_dir, KEY))
        return latest

    def _check_config(self, path: Path) -> None:
        saved = ckpt.saved_config(path)
        # flattened under their full names, so that the chat-template keywords compare as one value
        saved_flat = ckpt.flatten_config(saved.get("reward_model", {}).get("train", {}), f"{KEY}.")
        old = ckpt.with_former_values(saved_flat)
        new = ckpt.flatten_config(dataclasses.asdict(self.rm), f"{KEY}.")
        differing = [k for k in new if k in old and old[k] != new[k]
                     and not any(fnmatch.fnmatchcase(k[len(KEY) + 1:], pattern) for pattern in RESUME_SAFE)
                     and not (k in ckpt.DROPOUT_KEYS and not ckpt.draws_noise(new, k))]  # a model without dropout
        if differing:
            listed = "; ".join(ckpt.difference_text(k, saved_flat, old, new) for k in differing)
            raise ckpt.CheckpointError(f"cannot resume from {path}: the config differs ({listed}); restore those "
                                       f"values or start afresh with {KEY}.resume_mode=disable or another "
                                       f"{KEY}.default_local_dir")

    def _check_pairs(self, path: Path, state: dict) -> None:
        """Compare the training pairs with those the run of the checkpoint at ``path`` trained on (its
        ``trainer_state.json`` holds their count and :func:`pairs_fingerprint`), as PPO's resume compares its
        prompts: each step takes its pairs by its position in the epoch's order over them (:meth:`_step_pairs`).
        Another number of pairs is refused (CheckpointError): that place in an epoch over another count is no place
        of the saved run's. As many pairs whose token ids differ (texts edited, rows in another order, another
        tokenizer) get one notice and the resume goes on: an edit may be meant. A checkpoint saved before it recorded
        them is not checked."""
        saved = state.get("train_pairs_sha256")
        if saved is None or saved == self.train_fingerprint:
            return
        then, now = state.get("train_pairs"), len(self.train_pairs)
        if then != now:
            raise ckpt.CheckpointError(
                f"cannot resume from {path}: its run trained on {then} pairs, {KEY}.train_files hold {now} now: a "
                "resumed step takes its pairs by its position in the epoch over them, which is no place of the saved "
                f"run's in an epoch over another number; restore the files, or start afresh with "
                f"{KEY}.resume_mode=disable or another {KEY}.default_local_dir")
        print(f"notice: resuming from {path} on other training pairs than its run's ({now} pairs both times, their "
              f"token ids not the same: {KEY}.train_files changed since, or the tokenizer encodes them otherwise): "
              "the resumed steps take their pairs at the checkpoint's place in the epoch from the pairs as they are "
              "now, which may be others than the saved run would have trained on next; it goes on all the same (an "
              "edit may be meant)", file=sys.stderr, flush=True)

    def resume(self) -> None:
        path = self.resume_path()
        if path is None:
            return
        try:
            manifest = ckpt.verify_checkpoint(path)  # sizes and hashes, before any load
        except ckpt.CheckpointError as exc:
            raise ckpt.CheckpointError(f"{exc}{ckpt.intact_instead(path, KEY)}") from exc
        where = "resume_from_path" if self.rm.resume_mode == "resume_path" else "default_local_dir"
        ckpt.refuse_other_kind(path, manifest, "reward-model", f"{KEY}.{where}")  # a PPO run's: no config fits it
        saved = ckpt.saved_workers(manifest, PART)
        self._check_config(path)
        state = ckpt.read_trainer_state(path)
        self._check_pairs(path, state)
        try:
            self.worker.load_checkpoint(path / PART, saved)
        except ckpt.CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - the workers' errors come wrapped; say which checkpoint
            raise ckpt.CheckpointError(f"checkpoint {path / PART} cannot be loaded into the reward model being "
                                       f"trained: {exc}") from exc
        self.global_step, self.resumed_from = int(state["global_step"]), path
        self.last_saved = path
        # the stop rules' count goes on from the checkpoint's; one saved without it counts from its step
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self.no_update_since = state.get("no_update_since", self.global_step)
        ckpt.set_rng_state(ckpt.load_file(path / ckpt.RNG_STATE))
        world = self.cfg.world_size
        moved = f"; saved by {saved} worker(s), re-split over {world}" if saved != world else ""
        print(f"resumed the reward model from {path} (step {self.global_step}{moved})", file=sys.stderr)

    def export(self, target: Path) -> Path:
        """The model and tokenizer as a HF directory, written beside ``target`` and renamed into place. A write that
        fails (a full disk) is a :class:`~rlhf_core.training.checkpoint.CheckpointError` naming the export and the
        checkpoint a rerun writes it from (the run's end: it resumes there and exports)."""
        try:
            with staged_directory(target, replace=True, usual_modes=False) as tmp:  # (save_hf shows no bar)
                self.worker.save_hf(tmp)
                self.tokenizer.save_pretrained(tmp)
        except Exception as exc:
            if (error := ckpt.os_error_of(exc)) is None:
                raise
            what = (f"disk full while writing the reward model's HF export {target} ({error.strerror or error})"
                    if ckpt.disk_full(error) else f"could not write the reward model's HF export {target}: {error}")
            rerun = self.rerun_point()
            at_end = " (at the run's end: the rerun writes the export)" if rerun.checkpoint is not None else ""
            raise ckpt.CheckpointError(f"{what}; {self._resume_point(error, rerun)}{at_end}") from exc
        return target

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()


def train_reward_model(cfg: PPOConfig, log=None) -> tuple[Path, dict[str, float]]:
    """Preflight, train (resuming), export; returns (HF directory, last validation metrics and each split's
    ``<split>/pairs_over_max_length``)."""
    trainer = RewardModelTrainer(cfg)
    try:
        val = trainer.fit(log)
    finally:
        trainer.shutdown()
    return trainer.local_dir / HF_DIR, {**trainer.length_metrics, **val}


def pair_accuracy_gate(val: dict[str, float], min_pair_accuracy: float,
                       setting: str = f"{KEY}.min_pair_accuracy") -> tuple[bool, str]:
    """(passed, reason): whether the held-out pair accuracy reaches ``min_pair_accuracy``, which ``setting`` set
    (the config key, or a pipeline's parameter in its place)."""
    accuracy = val.get("val/pair_accuracy")
    if accuracy is None:
        if min_pair_accuracy > 0:
            return False, (f"{setting}={min_pair_accuracy} needs held-out pairs: set {KEY}.val_files")
        return True, "no held-out pairs and no accuracy required"
    if accuracy < min_pair_accuracy:
        return False, (f"the reward model ranks {accuracy:.1%} of the held-out pairs right, below "
                       f"{setting} ({min_pair_accuracy:.1%}): PPO against it would chase noise; "
                       "train longer, add pairs or start from a stronger model")
    return True, f"held-out pair accuracy {accuracy:.1%} >= {min_pair_accuracy:.1%}"
