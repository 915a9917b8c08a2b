"""What the actor and critic workers share: micro-batching, trimmed and packed forwards, optimizers, and
checkpoints loaded whatever the number of workers that saved them.

With several workers (FSDP2) every forward is a collective, so every rank must run the same
number of micro-batches: :func:`micro_batches` splits further where a rank has fewer; and the
losses are normalised by the token and sequence counts of the global mini-batch
(:func:`global_token_counts`), so one worker and N workers take the same optimizer step.
"""

from __future__ import annotations

import copy
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import DynamicCache

from rlhf_core.batch import Batch
from rlhf_core.config import OptimConfig
from rlhf_core.models import lora, packed_attention
from rlhf_core.models.loading import cache_argument, disable_dropout, dropout_rates, train_mode_differs
from rlhf_core.workers import distributed

SHARDS_DIR = "dcp"
RANK_STATE = "extra_state_rank_{}.pt"  # one per rank beside the shards; one worker writes its state whole instead
_RANK_STATE = re.compile(r"extra_state_rank_(\d+)\.pt")
#: the key of a rank's extra state that holds its process's torch generators (dropout in the updates draws from them)
PROCESS_RNG = "process_rng"


def micro_batch_rows(batch: Batch, micro_size: int | None, use_dynamic_bsz: bool, max_token_len: int,
                     by_prompt: bool = False) -> list[list[int]]:
    """The rows of each micro-batch of ``batch``: ``micro_size`` sequences each, or with ``use_dynamic_bsz``
    runs of sequences whose valid tokens (prompt + response) stay within ``max_token_len``.

    Rows are taken shortest first, so that sequences of similar length share a micro-batch: the
    columns that are padding in every row of a micro-batch are cut before the forward
    (:func:`trimmed_inputs`), so sorted micro-batches compute fewer pad tokens. ``by_prompt``
    (``use_shared_prefix``) sorts by prompt length first and keeps the rows of one prompt together,
    so that they share a micro-batch and its prompt is run once; ``max_token_len`` then counts a
    prompt once in each micro-batch it is in, as its forward does. The losses are normalised by the
    mini-batch's counts, so the grouping does not change the update.
    """
    lengths = batch["attention_mask"].sum(-1).tolist()
    key = lengths.__getitem__
    prompt_lengths, group = [0] * len(batch), list(range(len(batch)))  # rows whole: every row its own prompt
    if by_prompt:
        prompt_lengths = batch["attention_mask"][:, :batch["prompts"].shape[1]].sum(-1).tolist()
        group = prompt_groups(batch)[1].tolist()
        key = lambda row: (prompt_lengths[row], group[row], lengths[row])  # noqa: E731
    order = sorted(range(len(batch)), key=key)  # stable: equal keys keep their order
    if not use_dynamic_bsz:
        size = micro_size or len(batch)
        groups = [order[start:start + size] for start in range(0, len(order), size)]
    else:
        # what each prompt's rows cost together: the prompt once, then every response (rows whole: the row)
        group_cost: dict[int, int] = {}
        for row in order:
            group_cost[group[row]] = group_cost.get(group[row], prompt_lengths[row]) + lengths[row] - prompt_lengths[row]
        groups = [[]]
        tokens = 0
        for row in order:
            shares = bool(groups[-1]) and group[groups[-1][-1]] == group[row]
            # a prompt's rows go together into a micro-batch that has room for all of them; a row whose prompt
            # the micro-batch already has adds its response only
            cost = lengths[row] - prompt_lengths[row] if shares else lengths[row]
            needed = cost if shares else group_cost[group[row]]
            if groups[-1] and tokens + needed > max_token_len:
                groups.append([])
                tokens, cost = 0, lengths[row]
            groups[-1].append(row)
            tokens += cost
    return _same_count_on_all_ranks([g for g in groups if g], lengths)


def micro_batches(batch: Batch, micro_size: int | None, use_dynamic_bsz: bool, max_token_len: int,
                  by_prompt: bool = False) -> list[Batch]:
    """The micro-batches of :func:`micro_batch_rows`, in length order, not row order: for an update, whose
    loss sums over them; passes that score rows use :func:`map_micro_batches`."""
    return [batch.select(rows) for rows in micro_batch_rows(batch, micro_size, use_dynamic_bsz, max_token_len,
                                                            by_prompt)]


def map_micro_batches(batch: Batch, fn: Callable[[Batch], torch.Tensor | tuple[torch.Tensor | None, ...]],
                      micro_size: int | None, use_dynamic_bsz: bool, max_token_len: int, by_prompt: bool = False):
    """``fn`` on each micro-batch of :func:`micro_batch_rows`, its per-row results (a tensor, or a tuple of
    tensors and Nones) brought to the CPU and back to the batch's row order. For passes that score rows
    (log-probs, values, rewards); ``batch`` must have at least one row."""
    groups = micro_batch_rows(batch, micro_size, use_dynamic_bsz, max_token_len, by_prompt)
    outputs = [fn(batch.select(rows)) for rows in groups]
    if not isinstance(outputs[0], tuple):
        return in_row_order([out.cpu() for out in outputs], groups)
    return tuple(None if parts[0] is None else in_row_order([part.cpu() for part in parts], groups)
                 for parts in zip(*outputs))


def in_row_order(parts: list[torch.Tensor], groups: list[list[int]]) -> torch.Tensor:
    """Per-row results of the micro-batches ``groups`` (one tensor per group, in that order) as one
    tensor in the batch's own row order."""
    stacked = torch.cat(parts)
    result = torch.empty_like(stacked)
    result[torch.tensor([row for rows in groups for row in rows])] = stacked
    return result


def _same_count_on_all_ranks(groups: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Split the heaviest groups in two until this rank has as many as the rank with the most
    (a sharded forward is a collective: every rank must run the same number of them)."""
    target = distributed.all_reduce_max(len(groups))
    while len(groups) < target:
        splittable = [i for i, g in enumerate(groups) if len(g) > 1]
        if not splittable:
            raise RuntimeError(f"rank {distributed.rank()} has {len(groups)} sequences but must run {target} "
                               "micro-batches to stay in step with the other workers; raise the micro-batch "
                               "token budget or give each worker more sequences")
        heaviest = max(splittable, key=lambda i: sum(lengths[r] for r in groups[i]))
        rows = groups[heaviest]
        groups[heaviest:heaviest + 1] = [rows[:len(rows) // 2], rows[len(rows) // 2:]]
    return groups


def kept_columns(batch: Batch) -> tuple[int, int]:
    """(first prompt column that is a token in some row, number of response columns that are a token in
    some row): the columns outside are padding in every row of the micro-batch."""
    prompt_len = batch["prompts"].shape[1]
    prompt_valid = batch["attention_mask"][:, :prompt_len].any(dim=0)
    first = int(prompt_valid.nonzero()[0]) if prompt_valid.any() else prompt_len - 1
    response_valid = batch["response_mask"].any(dim=0)
    kept = int(response_valid.nonzero()[-1]) + 1 if response_valid.any() else 1
    return first, kept


def trimmed_inputs(batch: Batch) -> tuple[dict[str, torch.Tensor], int, int]:
    """The model inputs of a micro-batch without its all-padding columns.

    Prompts are left-padded and responses right-padded; columns that are padding in every
    row carry no information, so they are cut. Returns (inputs, response_start, kept_response_len)
    where response positions ``[0, kept_response_len)`` of the original layout follow ``response_start``.
    """
    prompt_len = batch["prompts"].shape[1]
    attention_mask = batch["attention_mask"]
    first, kept = kept_columns(batch)
    end = prompt_len + kept
    inputs = {
        "input_ids": batch["input_ids"][:, first:end],
        "attention_mask": attention_mask[:, first:end],
        "position_ids": batch["position_ids"][:, first:end],
    }
    return inputs, prompt_len - first, kept


def prompt_groups(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(one row of each distinct prompt, each row's prompt among them): rows whose prompt tokens and
    padding are identical (the ``rollout.n`` samples of a prompt) share one."""
    prompt_len = batch["prompts"].shape[1]
    keys = torch.cat([batch["prompts"], batch["attention_mask"][:, :prompt_len]], dim=1)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    first = torch.empty(int(inverse.max()) + 1, dtype=torch.long, device=inverse.device)
    first[inverse] = torch.arange(len(inverse), device=inverse.device)  # any row of a group will do
    return first, inverse


def shared_prompt_hidden(decoder: torch.nn.Module, batch: Batch,
                         through_last: bool = False) -> tuple[torch.Tensor, int]:
    """The decoder's last hidden states at the positions that predict the response tokens, (bs, kept, H),
    with each distinct prompt of the micro-batch run once (``use_shared_prefix``); ``through_last`` adds the
    position of the last kept response column, (bs, kept + 1, H), for a score read at a sequence's end.

    The prompts (one row per group, less the columns that are padding in all) go through the decoder
    with a KV cache; the cache is indexed out to every row, and the responses, less their all-padding
    columns and their last token, attend to it. Gradients reach the prompt's activations through the
    indexed cache, so value and gradient are those of the full forward: with ``rollout.n`` samples a
    prompt's tokens are computed once instead of n times. ``kept`` is the number of response columns
    that are a token in some row; the first of them is predicted by the prompt's last position.
    """
    cache_arg = cache_argument(type(decoder))
    prompt_len = batch["prompts"].shape[1]
    mask = batch["attention_mask"]
    start, kept = kept_columns(batch)
    first, inverse = prompt_groups(batch)
    cache = DynamicCache(config=decoder.config)
    prompt_out = decoder(input_ids=batch["prompts"][first, start:], attention_mask=mask[first, start:prompt_len],
                         position_ids=batch["position_ids"][first, start:prompt_len], use_cache=True,
                         **{cache_arg: cache})
    hidden = prompt_out.last_hidden_state[inverse, -1:]  # the prompt's last position predicts response token 0
    if kept > 1 or through_last:
        cache.reorder_cache(inverse)  # every row its prompt's keys and values (an index: gradients flow back)
        end = prompt_len + kept - (0 if through_last else 1)
        response_out = decoder(input_ids=batch["input_ids"][:, prompt_len:end], attention_mask=mask[:, start:end],
                               position_ids=batch["position_ids"][:, prompt_len:end], use_cache=True,
                               **{cache_arg: cache})
        hidden = torch.cat([hidden, response_out.last_hidden_state], dim=1)
    return hidden, kept


class SharedPrefix(NamedTuple):
    """Where ``use_shared_prefix`` runs: the passes without gradients (log-probs, values, scores) and the update."""

    scoring: bool
    update: bool


def resolve_shared_prefix(requested: bool, module: torch.nn.Module, key: str, *, sharded: bool, head_runs: bool,
                          remove_padding: bool = False, gradient_checkpointing: bool = False,
                          retokenized: bool = False) -> SharedPrefix:
    """``use_shared_prefix`` as it can run: in one process (the decoder is called without the sharded root
    module), on padded rows, on the policy's own prompt and response ids, with a head known to be a plain layer
    on the decoder's output; elsewhere a one-line notice and the usual path. Gradient checkpointing turns the KV
    cache off where gradients are taken, so with it the passes without gradients share the prompt and the
    update runs every row whole."""
    if not requested:
        return SharedPrefix(False, False)
    why = ("the model is sharded over a worker group" if sharded
           else "use_remove_padding packs the rows" if remove_padding
           else "each conversation is re-encoded with the reward model's chat template" if retokenized
           else None if head_runs
           else f"the {getattr(module.config, 'model_type', '?')} head is not known to be a plain layer")
    if why is None and gradient_checkpointing:
        if distributed.rank() == 0:
            print(f"notice: {key}=true runs in the passes without gradients only: gradient checkpointing is on "
                  "(it turns the KV cache off where gradients are taken), so the update runs every row's whole "
                  "prompt", file=sys.stderr, flush=True)
        return SharedPrefix(scoring=True, update=False)
    if why and distributed.rank() == 0:
        print(f"notice: {key}=true is not used: {why}, so every row runs its whole prompt", file=sys.stderr,
              flush=True)
    return SharedPrefix(why is None, why is None)


def dropout_off(model: torch.nn.Module, disable: bool, key: str) -> dict[str, float]:
    """Every dropout of a just-loaded ``model`` off where ``disable`` (``key``, a ``*.model.disable_dropout``);
    returns the base's rates, for its exports (:func:`~rlhf_core.models.loading.config_with`). Otherwise the
    updates (train mode) draw dropout that the rollout-time passes (eval mode) do not: a one-line notice names
    the model's non-zero rates and the key, and nothing is returned.

    Whether the model draws anything is tried (:func:`~rlhf_core.models.loading.train_mode_differs`, one forward
    of a few tokens in each mode): a config's rate the built model does not read (a head it lacks) gives no
    notice, and noise that no rate names and ``key`` cannot turn off (a router sampling its experts) gets one."""
    section = key.removesuffix(".disable_dropout")
    if disable:
        base = disable_dropout(model)
        if distributed.rank() == 0 and train_mode_differs(model):
            print(f"notice: {key}=true leaves {section}'s train-mode forward unlike its eval-mode one: something "
                  "besides dropout draws in train mode (a mixture-of-experts router that samples its experts, as "
                  "PhiMoE's), so its updates still differ from its rollout-time passes", file=sys.stderr, flush=True)
        return base
    if distributed.rank() != 0:
        return {}
    rates = {path: rate for path, rate in dropout_rates(model.config).items() if rate}
    differs = train_mode_differs(model)
    if differs is False or (differs is None and not rates):
        return {}
    if not rates and _differs_without_dropout(model):  # no rate says why, and the key would not change it
        print(f"notice: {section}'s train-mode forward differs from its eval-mode one though its config names no "
              "dropout: something besides dropout draws in train mode (a mixture-of-experts router that samples "
              f"its experts, as PhiMoE's), so its updates differ from its rollout-time passes; {key}=true cannot "
              "turn that off", file=sys.stderr, flush=True)
        return {}
    # the config's rates, some of which a head the model lacks may be all that reads (GPT-NeoX's classifier_dropout)
    listed = f"its config's rates: {', '.join(f'{path}={rate:g}' for path, rate in rates.items())}" if rates \
        else "none its config names"
    print(f"notice: {section} has dropout ({listed}): its updates run with it, its rollout-time passes "
          f"(generation, log-probs, values) without; {key}=true turns it off for the run", file=sys.stderr, flush=True)
    return {}


def _differs_without_dropout(model: torch.nn.Module) -> bool:
    """Whether ``model``'s train-mode forward still differs from its eval-mode one with every dropout and jitter
    off (tried on a copy, which the rare model whose config names no noise rate is worth)."""
    trial = copy.deepcopy(model)
    disable_dropout(trial)
    differs = train_mode_differs(trial)
    del trial
    return bool(differs)


def pad_response(values: torch.Tensor, response_len: int) -> torch.Tensor:
    """Right-pad (bs, kept) to (bs, response_len) with zeros."""
    if values.shape[1] == response_len:
        return values
    return torch.nn.functional.pad(values, (0, response_len - values.shape[1]))


def packed_inputs(batch: Batch) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The model inputs of a micro-batch without any padding: the valid tokens of every row
    concatenated into one row ``(1, T)``, with position ids that restart at 0 for each sequence
    (attention implementations with variable-length kernels keep the sequences apart by them).
    Returns (inputs, valid) where ``valid`` (bs, L) marks where the T tokens came from."""
    valid = batch["attention_mask"].bool()
    inputs = {"input_ids": batch["input_ids"][valid][None], "position_ids": batch["position_ids"][valid][None]}
    return inputs, valid


def unpack(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-token ``values`` (T,), in row order, back into the padded layout where ``valid`` (bs, L) holds, zeros
    elsewhere: a packed row's positions, or the response tokens' values into (bs, R)."""
    padded = values.new_zeros(valid.shape)
    padded[valid] = values
    return padded


def supports_packing(module: torch.nn.Module) -> bool:
    """Whether the model's attention keeps the sequences of a packed row apart without a (tokens x tokens) mask:
    flash attention's variable-length kernel, or :mod:`packed_attention`'s one sequence per row."""
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None) or ""
    return implementation.startswith("flash_attention") or implementation == packed_attention.NAME


def resolve_remove_padding(requested: bool, module: torch.nn.Module, key: str) -> bool:
    """``use_remove_padding`` as it can run: packing needs flash attention (CUDA) or :mod:`packed_attention`
    (CPU, or CUDA without flash-attn); with another attention a one-line notice and the padded path (which trims
    all-padding columns)."""
    if not requested or supports_packing(module):
        return requested
    implementation = getattr(module.config, "_attn_implementation", None)
    if distributed.rank() == 0:
        print(f"notice: {key}=true needs flash_attention_2 or {packed_attention.NAME} attention; attention here is "
              f"{implementation}, so sequences run padded", file=sys.stderr, flush=True)
    return False


def batch_token_counts(batch: Batch) -> tuple[int, int]:
    """(response tokens, sequences with at least one response token) of a (mini-)batch."""
    mask = batch["response_mask"]
    return int(mask.sum()), int((mask.sum(-1) > 0).sum())


def global_token_counts(batch: Batch) -> tuple[int, int]:
    """:func:`batch_token_counts` summed over all workers: the normalisers of the global mini-batch loss."""
    tokens, sequences = distributed.all_reduce_sum(list(batch_token_counts(batch)))
    return int(tokens), int(sequences)


FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def build_optimizer(params, optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel where every parameter lives on a device that has one.

    The fused step reads and writes each parameter and its two moments once; the per-parameter
    default makes a pass per operation (lerp, mul, addcmul, sqrt, addcdiv...), 3-4x the time on
    CPU for a 135M model. Same update rule, same state layout, so checkpoints load either way.
    """
    params = list(params)
    fused = bool(params) and all(p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                             fused=fused or None)


def build_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up from 0 (``step / warmup``, as verl and transformers ramp it), then constant or cosine
    decay to ``min_lr_ratio`` (stepped once per PPO iteration)."""
    warmup = optim.lr_warmup_steps if optim.lr_warmup_steps >= 0 else int(optim.lr_warmup_steps_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup
        if optim.lr_scheduler_type == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        cosine = 0.5 * (1.0 + math.cos(math.pi * 2.0 * optim.num_cycles * progress))
        return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * max(0.0, cosine)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_and_check(params, max_norm: float) -> tuple[float, bool]:
    """Clip the gradient norm; returns (norm before clipping, finite?).

    With FSDP2 the gradients are DTensor shards and ``clip_grad_norm_`` reduces their norms over
    the ranks: the norm is the total one, the same on every rank, and so is the decision to skip.
    """
    norm = torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
    value = distributed.grad_norm_value(norm)
    return value, math.isfinite(value)


def save_shards(worker, folder: Path) -> None:
    """A sharded worker's checkpoint: every rank writes its shards of the model (with LoRA only the
    trainable tensors) and optimizer state under ``folder/dcp`` (torch DCP), and its own scheduler
    and generator states as ``extra_state_rank_R.pt``, with the torch generators of its process: a worker of a group
    runs in a process of its own, whose generators the trainer's ``rng_state.pt`` does not hold."""
    folder.mkdir(parents=True, exist_ok=True)
    distributed.save_sharded(folder / SHARDS_DIR, worker.module, worker.optimizer, only_trainable=worker.lora)
    with open(folder / RANK_STATE.format(distributed.rank()), "xb") as f:
        torch.save({**worker.extra_state(), PROCESS_RNG: process_rng(worker.device)}, f)
        f.flush()
        os.fsync(f.fileno())


def saved_workers(names: Iterable[str]) -> int:
    """How many workers saved a checkpoint part, from the names of its files (relative to the part's folder,
    as a manifest lists them or the folder holds them): a worker group leaves one ``extra_state_rank_R.pt`` per
    rank beside its shards, one worker its state whole (``model_state.pt``, ``optim_state.pt``, ...)."""
    return len({match.group(1) for match in map(_RANK_STATE.fullmatch, names) if match}) or 1


def load_shards(worker, folder: Path, weights_only: bool = False) -> None:
    """:func:`load_saved` with the number of workers that saved ``folder`` counted from its files (each rank
    reads them itself: the trainer checked them against the manifest first)."""
    load_saved(worker, folder, saved_workers(path.name for path in folder.iterdir()), weights_only)


def load_saved(worker, folder: Path, saved: int, weights_only: bool = False) -> None:
    """The checkpoint part that ``saved`` workers wrote into ``folder``, into this worker or this rank, whatever
    their number now.

    Shards (torch DCP) re-split onto any number of ranks or gather whole into one process; one worker's whole
    tensors are cut into this rank's shards (:func:`shard_whole`). The rest is small: the scheduler's state
    (the same on every rank), the mini-batch shuffle generator (seeded and drawn alike on every rank of a group)
    and the generators each rank seeds by its rank (:meth:`CheckpointableWorker.rank_generators`), with the
    process's torch generators where a group saved them. A rank the saved run had takes its own; one it did not
    have takes rank 0's schedule and shuffle state, starts its rank-seeded generators from their seed, as a fresh
    run seeds them (a copy of rank 0's would draw the same numbers for other prompts), and keeps its process's
    generators as they are. ``weights_only`` (a guard's rollback) keeps the current learning rate, schedule
    position and generators and takes only the weights and optimizer moments.
    """
    lrs = [group["lr"] for group in worker.optimizer.param_groups]
    rest: dict = {}
    shards = (folder / SHARDS_DIR).is_dir()  # a group's layout, even of one rank
    if shards:
        with warnings.catch_warnings():  # read by one process: DCP warns that there is no process group
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            distributed.load_sharded(folder / SHARDS_DIR, worker.module, worker.optimizer, only_trainable=worker.lora)
    else:
        device = "cpu" if worker.sharded else worker.device  # cut on the CPU, then each shard goes to the device
        model = _read(folder / "model_state.pt", device)
        check_fits(worker, model, folder / "model_state.pt")
        rest = _read(folder / "optim_state.pt", device)
        optimizer = rest.pop("optimizer")
        if worker.sharded:
            shard_whole(worker, model, optimizer)
        else:
            worker.load_model_state_dict(model)
            worker.optimizer.load_state_dict(optimizer)
    if weights_only:
        for group, lr in zip(worker.optimizer.param_groups, lrs):
            group["lr"] = lr
        return
    rank = distributed.rank()
    if shards:
        extra = _read(folder / RANK_STATE.format(rank if rank < saved else 0))
        process = extra.pop(PROCESS_RNG, None)  # absent from checkpoints written before it was saved
        if process is not None and rank < saved:
            set_process_rng(process, worker.device)
    else:
        extra = {**rest, **_read(folder / "extra_state.pt")}  # the scheduler beside the optimizer, the generators
    if rank >= saved:
        for key, generator in worker.rank_generators().items():
            extra.pop(key, None)
            generator.manual_seed(generator.initial_seed())
    worker.load_extra_state(extra)
    for group, lr in zip(worker.optimizer.param_groups, worker.scheduler.get_last_lr()):
        group["lr"] = lr


def process_rng(device: torch.device | str) -> dict[str, torch.Tensor]:
    """This process's torch generators: the CPU one, and the current CUDA device's where the worker runs on one."""
    state = {"cpu": torch.get_rng_state()}
    if torch.device(device).type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_process_rng(state: dict[str, torch.Tensor], device: torch.device | str) -> None:
    torch.set_rng_state(state["cpu"].clone())  # a private copy: the loaded one may be a mapped file's
    if "cuda" in state and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].clone())


def _read(path: Path, device: torch.device | str = "cpu"):
    try:
        # mapped, not read: the ranks of a group that each cut one worker's whole state share its pages
        return torch.load(path, map_location=device, weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
        raise ValueError(f"checkpoint file {path} cannot be read: {exc}") from exc


def check_fits(worker, saved: dict[str, torch.Tensor], source: Path) -> None:
    """Raise ValueError naming the tensors when a whole saved model does not fit the worker's (sharded, the
    global shapes count): a checkpoint of another model or architecture."""
    expected = worker.model_state_dict()
    problems = [f"{k} missing" for k in expected if k not in saved]
    problems += [f"{k} unexpected" for k in saved if k not in expected]
    problems += [f"{k} has shape {tuple(saved[k].shape)} in the checkpoint, {tuple(v.shape)} in the model"
                 for k, v in expected.items() if k in saved and saved[k].shape != v.shape]
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise ValueError(f"{source} does not fit the model being trained ({shown}): was it saved from another "
                         "model or architecture?")


def shard_whole(worker, model: dict[str, torch.Tensor], optimizer: dict) -> None:
    """One worker's whole state dicts into this rank's FSDP2 shards. torch's loader finds the optimizer's state
    by parameter name; ``optimizer.state_dict()`` numbers the parameters in the order the optimizer holds them,
    which both runs build alike (the trainable parameters in module order)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = {id(p): name for name, p in worker.module.named_parameters()}
    current = [names[id(p)] for group in worker.optimizer.param_groups for p in group["params"]]
    saved = [i for group in optimizer["param_groups"] for i in group["params"]]
    if len(saved) != len(current):
        raise ValueError(f"its optimizer holds {len(saved)} tensors, the model being trained {len(current)}")
    name_of = dict(zip(saved, current))
    named = {"state": {name_of[i]: state for i, state in optimizer["state"].items()},
             "param_groups": [{**group, "params": [name_of[i] for i in group["params"]]}
                              for group in optimizer["param_groups"]]}
    set_state_dict(worker.module, worker.optimizer, model_state_dict=model, optim_state_dict=named,
                   options=StateDictOptions(full_state_dict=True, strict=not worker.lora))


#: The loss of one micro-batch (on the worker's device), given the global token and sequence counts of its
#: mini-batch (each at least 1): (loss with its graph, metrics summed over micro-batches and ranks,
#: metrics that are the same on every micro-batch and rank).
MicroBatchLoss = Callable[[Batch, int, int], tuple[torch.Tensor, dict[str, float], dict[str, float]]]


def ppo_update(worker, batch: Batch, *, prefix: str, epochs: int, mini_rows: int, shuffle: bool,
               micro_batches_of: Callable[[Batch], list[Batch]], loss_fn: MicroBatchLoss, grad_clip: float,
               fsdp_config) -> dict[str, float]:
    """The update loop the actor and the critic share, around ``loss_fn`` (one micro-batch's loss).

    ``epochs`` passes over ``batch`` (reshuffled each time with the worker's ``shuffle_generator`` when
    ``shuffle``), each in mini-batches of ``mini_rows`` rows; per mini-batch the gradients of its
    micro-batches accumulate, are clipped to ``grad_clip`` and make one optimizer step, which is skipped
    (and counted in ``worker.skipped_steps``) when a loss or the gradient is not finite on any rank.
    The LR schedule steps once per call, after it. Returns the metrics averaged over the mini-batches,
    with ``<prefix>/grad_norm`` and ``<prefix>/lr`` (the rate this update used, as verl logs it). With
    ``fsdp_config.optimizer_offload`` the optimizer moments come to the GPU for the update only.
    """
    offload = fsdp_config.optimizer_offload and not fsdp_config.param_offload and worker.device.type == "cuda"
    if offload:  # moments on the CPU between updates (param_offload: always)
        move_optimizer_state(worker.optimizer, worker.device)
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}

    def record(name: str, value: float) -> None:
        sums[name] = sums.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1

    lr = worker.optimizer.param_groups[0]["lr"]
    worker.module.train()
    for _ in range(epochs):
        order = torch.randperm(len(batch), generator=worker.shuffle_generator) if shuffle else torch.arange(len(batch))
        for start in range(0, len(batch), mini_rows):
            mini = batch.select(order[start:start + mini_rows])
            token_count, seq_count = (max(count, 1) for count in global_token_counts(mini))
            worker.optimizer.zero_grad(set_to_none=True)
            summed: dict[str, float] = {}  # this rank's share of each mini-batch metric; summed over ranks
            constant: dict[str, float] = {}
            loss_finite = True
            for mb in micro_batches_of(mini):
                loss, mb_summed, mb_constant = loss_fn(mb.to(worker.device), token_count, seq_count)
                loss_finite = loss_finite and bool(torch.isfinite(loss))
                loss.backward()
                for name, value in mb_summed.items():
                    summed[name] = summed.get(name, 0.0) + value
                constant.update(mb_constant)
            loss_finite = distributed.all_true(loss_finite)
            grad_norm, finite = clip_and_check(worker.module.parameters(), grad_clip)
            if finite and loss_finite:
                worker.optimizer.step()
            else:
                worker.skipped_steps += 1
                worker.optimizer.zero_grad(set_to_none=True)
            record(f"{prefix}/grad_norm", grad_norm)
            names = sorted(summed)
            for name, value in zip(names, distributed.all_reduce_sum([summed[n] for n in names])):
                record(name, value)
            for name, value in constant.items():
                record(name, value)
    worker.scheduler.step()
    worker.module.eval()
    if offload:
        move_optimizer_state(worker.optimizer, "cpu")
    metrics = {name: sums[name] / counts[name] for name in sums}
    metrics[f"{prefix}/lr"] = lr
    return metrics


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move the optimizer's moments (``fsdp_config.optimizer_offload``: to the CPU between updates and
    back to the GPU for them); FSDP2's DTensor moments move shard by shard."""
    for state in optimizer.state.values():
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != torch.device(device):
                state[name] = value.to(device, non_blocking=True)


class CheckpointableWorker:
    """The checkpoint surface shared by the actor and critic workers.

    Subclasses provide ``module``, ``lora`` (whether only adapters train), an ``optimizer``, a
    ``scheduler`` and a ``shuffle_generator``; they extend ``extra_state``/``load_extra_state`` with
    any state of their own."""

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """What ``model_state.pt`` holds: all weights, or with LoRA only the trained ones (adapters, and
        the critic's value head)."""
        return lora.trainable_state_dict(self.module) if self.lora else self.module.state_dict()

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.lora:
            lora.load_trainable_state_dict(self.module, state)
        else:
            self.module.load_state_dict(state)

    def extra_state(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "shuffle_generator": self.shuffle_generator.get_state()}

    def load_extra_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        # the rate of the step to come from this run's schedule (the rule is rebuilt from the config, the
        # position and base rates are loaded): the optimizer's saved rate is the old schedule's where a resume
        # changed its length (trainer.total_training_steps), and the same value where it did not
        self._follow_schedule()
        self.shuffle_generator.set_state(state["shuffle_generator"])

    def _follow_schedule(self) -> None:
        """Set the optimizer's rates to the schedule's at its position, after its base rates or its rule changed."""
        for group, base, rule in zip(self.optimizer.param_groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas):
            group["lr"] = base * rule(self.scheduler.last_epoch)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def scale_lr(self, factor: float) -> None:
        """Multiply the learning rate, its schedule included, by ``factor`` (a guard's last lever on KL; a resume
        with another ``optim.lr``). The base rates are saved with the schedule: a resume keeps the factor."""
        self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]
        self._follow_schedule()

    def rank_generators(self) -> dict[str, torch.Generator]:
        """The generators of ``extra_state`` that each rank seeds by its rank, by key: the HF rollout's sampling
        generator (seeded by its rank; vLLM keeps its sampler's state to itself). A rank that a resumed checkpoint's
        run did not have starts them from their seed (see :func:`load_saved`)."""
        generator = getattr(getattr(self, "rollout", None), "generator", None)
        return {"rollout_generator": generator} if isinstance(generator, torch.Generator) else {}

    def state_dict(self) -> dict:
        return {"model": self.model_state_dict(), "optimizer": self.optimizer.state_dict(), **self.extra_state()}

    def load_state_dict(self, state: dict) -> None:
        self.load_model_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_extra_state(state)

    @torch.no_grad()
    def weights_finite(self) -> bool:
        """Whether every parameter (this rank's shards, when sharded) holds finite values: one pass, no gather."""
        from torch.distributed.tensor import DTensor

        return all(bool(torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all())
                   for p in self.module.parameters())

    def save_shards(self, folder: str | os.PathLike) -> None:
        """Sharded: every rank writes its shards and its own generators into ``folder``."""
        save_shards(self, Path(folder))

    def load_shards(self, folder: str | os.PathLike, weights_only: bool = False) -> None:
        """A checkpoint part saved by any number of workers (shards or whole), into this rank or worker."""
        load_shards(self, Path(folder), weights_only)


def peak_memory_gb() -> float:
    """Peak CUDA memory allocated, or the process's peak resident set size on CPU, in GiB."""
    if torch.cuda.is_available() and torch.cuda.max_memory_allocated() > 0:
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
