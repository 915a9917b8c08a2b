"""DAPO's dynamic sampling (Yu et al. 2025, section 3.2): train only on prompt groups that carry a signal.

A group whose responses all score the same (every one right, or every one wrong) has a zero
group-relative advantage, so it adds no gradient and only dilutes the batch. With
``algorithm.filter_groups.enable`` the trainer drops such groups and generates further batches of
``data.gen_batch_size`` prompts (default ``data.train_batch_size``) until ``train_batch_size`` groups are
kept (the surplus of the last batch is discarded) or ``max_num_gen_batches`` batches were generated. At
the limit it trains on the groups it has, with a warning, and stops with an error if it has none.

:func:`collect_groups` runs that loop over two callables (next prompts, rollout of prompts), so the
trainer supplies its actor and reward and a test supplies a fixed reward table.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch

from rlhf_core import algos
from rlhf_core.batch import Batch


def group_metric(batch: Batch, extras: dict, metric: str) -> torch.Tensor:
    """One value per response for ``algorithm.filter_groups.metric``: ``seq_reward`` (the sum of the token
    scores, shaping included; ``seq_final_reward``, verl's name for it after the KL penalty, is the same where no
    KL penalty is in the reward, the only case the config takes), ``score``, ``acc`` or another number the
    reward function reports (as it reported them). -> (bs,)."""
    if metric in ("seq_reward", "seq_final_reward"):
        return batch["token_level_scores"].sum(-1)
    if metric not in extras or not isinstance(extras[metric], torch.Tensor):
        reported = sorted(k for k, v in extras.items() if isinstance(v, torch.Tensor))
        raise ValueError(f"algorithm.filter_groups.metric={metric!r} is not a number the reward reports (it "
                         f"reports {', '.join(reported)}); use one of them or "
                         f"{', '.join(algos.FILTER_GROUPS_METRICS)}")
    values = torch.as_tensor(extras[metric], dtype=torch.float64)
    if bool(values.isnan().any()):
        raise ValueError(f"algorithm.filter_groups.metric={metric} is not known for every response (prompts "
                         "without a ground truth have no accuracy, a reward's key missing from some results); use "
                         "seq_reward or score")
    return values


def select_extras(extras: dict, rows: list[int]) -> dict:
    """The reward extras (tensors or lists with one entry per response) of ``rows``."""
    picked = {}
    for name, values in extras.items():
        if isinstance(values, torch.Tensor):
            picked[name] = values[torch.tensor(rows, dtype=torch.long)]
        else:
            picked[name] = [values[i] for i in rows]
    return picked


def concat_extras(parts: list[dict]) -> dict:
    """The reward extras of several generation batches, row after row. A key some batches lack (a reward function
    reports a metric, or a ``pred``, only where it has one) covers their rows too: NaN in a tensor, None in a list,
    as the reward manager fills a response that did not report it."""
    def missing(part: dict, like: torch.Tensor | list) -> torch.Tensor | list:
        rows = len(next(iter(part.values())))
        if isinstance(like, torch.Tensor):
            return torch.full((rows,), math.nan, dtype=like.dtype, device=like.device)
        return [None] * rows

    merged = {}
    for name in dict.fromkeys(name for part in parts for name in part):
        like = next(part[name] for part in parts if name in part)
        pieces = [part[name] if name in part else missing(part, like) for part in parts]
        merged[name] = torch.cat(pieces) if isinstance(like, torch.Tensor) else [v for piece in pieces for v in piece]
    return merged


def _pad(tensor: torch.Tensor, left: int, right: int, value: float) -> torch.Tensor:
    return torch.nn.functional.pad(tensor, (left, right), value=value)


def concat_rollouts(batches: list[Batch], pad_id: int) -> Batch:
    """Rollout batches of different prompt (P) and response (R) widths as one batch: prompts left-padded,
    responses right-padded to the widest. ``input_ids``/``attention_mask``/``position_ids`` (P + R) are
    split at each batch's prompt width and padded on each side; every other (bs, R) tensor is right-padded
    with 0 and (bs,) tensors are kept."""
    width_p = max(b["prompts"].shape[1] for b in batches)
    width_r = max(b["responses"].shape[1] for b in batches)
    padded = []
    for b in batches:
        p, r = b["prompts"].shape[1], b["responses"].shape[1]
        grow_p, grow_r = width_p - p, width_r - r
        tensors = {}
        for name, value in b.tensors.items():
            if value.dim() == 1:
                tensors[name] = value
            elif name == "prompts":
                tensors[name] = _pad(value, grow_p, 0, pad_id)
            elif name in ("input_ids", "attention_mask", "position_ids"):
                fill = pad_id if name == "input_ids" else 0
                prompt_part = _pad(value[:, :p], grow_p, 0, fill)
                response_part = value[:, p:]
                if name == "position_ids" and grow_r:
                    steps = torch.arange(1, grow_r + 1, dtype=value.dtype, device=value.device)
                    extension = value[:, -1:] + steps
                    response_part = torch.cat([response_part, extension], dim=1)
                else:
                    response_part = _pad(response_part, 0, grow_r, fill)
                tensors[name] = torch.cat([prompt_part, response_part], dim=1)
            elif value.shape[1] == r:
                tensors[name] = _pad(value, 0, grow_r, pad_id if name == "responses" else 0)
            else:
                raise ValueError(f"cannot pad rollout tensor {name!r} of shape {tuple(value.shape)} (prompt width "
                                 f"{p}, response width {r})")
        padded.append(Batch(tensors, dict(b.meta)))
    return Batch.concat(padded)


def _groups_in_order(uids: list) -> list:
    seen: dict = {}
    for uid in uids:
        seen.setdefault(uid, None)
    return list(seen)


class DataExhausted(RuntimeError):
    """The training data ran out before a step collected a group it could train on."""


class NothingToTrain(RuntimeError):
    """``max_num_gen_batches`` generation batches kept no group to train on (or fewer than a mini-batch every
    worker can share): the run cannot go on as configured. The trainer says it with the step and the checkpoint
    a resume goes on from."""


def collect_groups(
    first_prompts: Batch,
    next_prompts: Callable[[], Batch | None],
    rollout: Callable[[Batch], tuple[Batch, dict]],
    *,
    metric: str,
    max_num_gen_batches: int,
    pad_id: int,
    group_multiple: int = 1,
    target: int | None = None,
) -> tuple[Batch, dict, dict[str, float]]:
    """Generate, score and filter batches until ``target`` prompt groups with differing scores are kept
    (see the module docstring).

    Args:
        first_prompts: the step's first generation batch of prompts.
        next_prompts: the next batch of prompts from the training data; None where it has run out (the
            step then trains on the groups it has, as at ``max_num_gen_batches``).
        rollout: prompts -> (scored rollout batch, reward extras), each prompt's responses adjacent and
            sharing the meta ``uid``.
        metric: ``algorithm.filter_groups.metric``.
        max_num_gen_batches: generation batches allowed; <= 0 means no limit.
        pad_id: pad token for the widths of batches generated separately.
        group_multiple: a partial batch is cut to a multiple of this many groups (whole mini-batches for
            a worker group).
        target: the groups to collect (``data.train_batch_size``); None: as many as ``first_prompts`` holds.

    Returns:
        the batch of kept groups (uids made unique per generation batch), their extras, and the metrics
        ``train/num_gen_batches``, ``train/filter_groups/{kept,dropped,trained}`` (groups) and
        ``train/filter_groups/dropped_metric_mean`` (when any was dropped: the common metric value of the
        dropped groups, near the maximum when the prompts are too easy, near the minimum when too hard).

    Raises:
        NothingToTrain: the limit was reached without a single group whose responses score differently (or
            with fewer than ``group_multiple``).
        DataExhausted: the data ran out before there was a group to train on.
    """
    target = len(first_prompts) if target is None else target
    kept_batches, kept_extras = [], []
    kept_groups = dropped_groups = num_gen_batches = 0
    dropped_values: list[float] = []
    prompts: Batch | None = first_prompts
    limit = f"algorithm.filter_groups.max_num_gen_batches={max_num_gen_batches}"
    while True:
        batch, extras = rollout(prompts)
        batch.meta["uid"] = [(num_gen_batches, uid) for uid in batch.meta["uid"]]
        num_gen_batches += 1
        values = group_metric(batch, extras, metric)  # (bs,)
        keep = algos.filter_groups_keep(values, batch.meta["uid"])  # (bs,)
        uids = batch.meta["uid"]
        for uid in _groups_in_order(uids):
            rows = [i for i, u in enumerate(uids) if u == uid]
            if bool(keep[rows[0]]):
                kept_groups += 1
            else:
                dropped_groups += 1
                dropped_values.append(float(values[rows[0]]))
        kept_rows = torch.nonzero(keep).squeeze(-1).tolist()
        if kept_rows:
            kept_batches.append(batch.select(kept_rows))
            kept_extras.append(select_extras(extras, kept_rows))
        if kept_groups >= target:
            break
        if 0 < max_num_gen_batches <= num_gen_batches:
            if kept_groups == 0:
                raise NothingToTrain(
                    f"dynamic sampling: in {num_gen_batches} generation batches "
                    f"(algorithm.filter_groups.max_num_gen_batches={max_num_gen_batches}) every one of the "
                    f"{dropped_groups} prompt groups scored the same on algorithm.filter_groups.metric={metric}, "
                    "so there is nothing to train on: the prompts are all too easy or all too hard for the policy, "
                    "or the reward is constant. Check the reward, raise max_num_gen_batches (<= 0: no limit), or "
                    "set algorithm.filter_groups.enable=false")
            break
        prompts = next_prompts()
        if prompts is None:
            limit = "the training data ran out: trainer.total_epochs passes drawn"
            if kept_groups == 0:
                raise DataExhausted(f"dynamic sampling: {limit} before a prompt group scored differently "
                                    f"({dropped_groups} groups dropped in {num_gen_batches} generation batches)")
            break

    batch = concat_rollouts(kept_batches, pad_id)
    extras = concat_extras(kept_extras)
    groups = _groups_in_order(batch.meta["uid"])
    trained = min(kept_groups, target)
    if kept_groups < target:
        trained = kept_groups // group_multiple * group_multiple
        if trained == 0:
            raise (NothingToTrain if prompts is not None else DataExhausted)(
                f"dynamic sampling: {kept_groups} prompt group(s) kept in {num_gen_batches} generation batches, fewer "
                f"than one mini-batch of {group_multiple} prompts that every worker can share; raise "
                "algorithm.filter_groups.max_num_gen_batches or set algorithm.filter_groups.enable=false")
        print(f"WARNING dynamic sampling: only {kept_groups} of {target} prompt groups had responses that scored "
              f"differently after {num_gen_batches} generation batches ({limit}); training this step on {trained} "
              "groups", file=sys.stderr, flush=True)
    if trained < len(groups):
        wanted = set(groups[:trained])
        rows = [i for i, uid in enumerate(batch.meta["uid"]) if uid in wanted]
        batch, extras = batch.select(rows), select_extras(extras, rows)
    metrics = {
        "train/num_gen_batches": float(num_gen_batches),
        "train/filter_groups/kept": float(kept_groups),
        "train/filter_groups/dropped": float(dropped_groups),
        "train/filter_groups/trained": float(trained),
    }
    if dropped_values:
        metrics["train/filter_groups/dropped_metric_mean"] = sum(dropped_values) / len(dropped_values)
    return batch, extras, metrics
