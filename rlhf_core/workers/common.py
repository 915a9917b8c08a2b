"""What the actor and critic workers share: micro-batching, trimmed forwards, optimizers."""

from __future__ import annotations

import math

import torch

from rlhf_core.batch import Batch
from rlhf_core.config import OptimConfig


def micro_batches(batch: Batch, micro_size: int | None, use_dynamic_bsz: bool, max_token_len: int) -> list[Batch]:
    """Split ``batch`` into micro-batches: ``micro_size`` sequences each, or with ``use_dynamic_bsz``
    consecutive runs of sequences whose valid tokens (prompt + response) stay within ``max_token_len``."""
    if not use_dynamic_bsz:
        return batch.split(micro_size or len(batch))
    lengths = batch["attention_mask"].sum(-1).tolist()
    groups: list[list[int]] = [[]]
    tokens = 0
    for row, length in enumerate(lengths):
        if groups[-1] and tokens + length > max_token_len:
            groups.append([])
            tokens = 0
        groups[-1].append(row)
        tokens += length
    return [batch.select(rows) for rows in groups]


def trimmed_inputs(batch: Batch) -> tuple[dict[str, torch.Tensor], int, int]:
    """The model inputs of a micro-batch without its all-padding columns.

    Prompts are left-padded and responses right-padded; columns that are padding in every
    row carry no information, so they are cut. Returns (inputs, response_start, kept_response_len)
    where response positions ``[0, kept_response_len)`` of the original layout follow ``response_start``.
    """
    prompt_len = batch["prompts"].shape[1]
    attention_mask = batch["attention_mask"]
    prompt_valid = attention_mask[:, :prompt_len].any(dim=0)
    first = int(prompt_valid.nonzero()[0]) if prompt_valid.any() else prompt_len - 1
    response_valid = batch["response_mask"].any(dim=0)
    kept = int(response_valid.nonzero()[-1]) + 1 if response_valid.any() else 1
    end = prompt_len + kept
    inputs = {
        "input_ids": batch["input_ids"][:, first:end],
        "attention_mask": attention_mask[:, first:end],
        "position_ids": batch["position_ids"][:, first:end],
    }
    return inputs, prompt_len - first, kept


def pad_response(values: torch.Tensor, response_len: int) -> torch.Tensor:
    """Right-pad (bs, kept) to (bs, response_len) with zeros."""
    if values.shape[1] == response_len:
        return values
    return torch.nn.functional.pad(values, (0, response_len - values.shape[1]))


def batch_token_counts(batch: Batch) -> tuple[int, int]:
    """(response tokens, sequences with at least one response token) of a (mini-)batch."""
    mask = batch["response_mask"]
    return int(mask.sum()), int((mask.sum(-1) > 0).sum())


def build_optimizer(params, optim: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then constant or cosine decay to ``min_lr_ratio`` (stepped once per PPO iteration)."""
    warmup = optim.lr_warmup_steps if optim.lr_warmup_steps >= 0 else int(optim.lr_warmup_steps_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if optim.lr_scheduler_type == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        cosine = 0.5 * (1.0 + math.cos(math.pi * 2.0 * optim.num_cycles * progress))
        return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * max(0.0, cosine)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_and_check(params, max_norm: float) -> tuple[float, bool]:
    """Clip the gradient norm; returns (norm before clipping, finite?)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    value = float(norm)
    return value, math.isfinite(value)
