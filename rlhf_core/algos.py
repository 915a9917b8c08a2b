"""PPO math for language models: masked statistics, advantages, KL penalties and losses.

Every function here is a small, pure function over tensors and masks. The only stateful objects are the
KL controllers. Shapes use ``bs`` for the number of sequences and ``T`` for the response length; a
``response_mask`` is 1 (or True) on tokens that belong to the response and 0 elsewhere (padding, or tool
output inside a multi-turn response).

Losses and KL penalties return ``(value, metrics)`` with metric names as verl logs them.

References:
    - Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (PPO clip).
    - Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation".
    - Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL" (dual-clip PPO).
    - Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences" (adaptive KL).
    - Schulman 2020, "Approximating KL Divergence" (k1, k2, k3 estimators).
    - Shao et al. 2024, "DeepSeekMath" (GRPO).
    - Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization" (RLOO).
    - Hu 2025, "REINFORCE++".
    - Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for LLMs".
    - Chen et al. 2025, "Pass@k Training for Adaptively Balancing Exploration and Exploitation" (grpo_passk).
    - Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale".
    - Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO).
    - Zheng et al. 2025, "Group Sequence Policy Optimization" (GSPO).
    - MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention" (CISPO).
    - Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (TIS).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "ADV_ESTIMATORS",
    "ADV_ESTIMATORS_NEED_CRITIC",
    "ADV_ESTIMATORS_NEED_GROUPS",
    "FILTER_GROUPS_METRICS",
    "KL_CTRL_TYPES",
    "KL_TYPES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "POLICY_LOSS_MODES",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_RS_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "add_at_last_token",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_explained_variance",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_offpolicy_metrics",
    "compute_overlong_penalty",
    "compute_policy_loss",
    "compute_policy_loss_cispo",
    "compute_policy_loss_gspo",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rollout_correction",
    "compute_rollout_is_weights",
    "compute_rollout_rejection_mask",
    "compute_value_loss",
    "entropy_from_logits",
    "filter_groups_keep",
    "get_adv_estimator",
    "get_policy_loss_fn",
    "kl_penalty",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]

WHITEN_EPS = 1e-8
MASKED_MEAN_EPS = 1e-8
EXPLAINED_VAR_EPS = 1e-5


# --------------------------------------------------------------------------------------------------
# Masked statistics
# --------------------------------------------------------------------------------------------------


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x * mask``; values under the mask never leak in (even NaN or inf).

    Shapes: ``x`` and ``mask`` (bs, T); result is a scalar, or reduced over ``dim``.
    """
    weighted = torch.where(mask != 0, x * mask, torch.zeros_like(x))  # (bs, T)
    return weighted.sum() if dim is None else weighted.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over unmasked positions: ``sum(x * mask) / sum(mask)``.

    Shapes: ``x`` and ``mask`` (bs, T); result is a scalar, or reduced over ``dim``. A fully masked
    input (or row, with ``dim``) gives 0: the count is floored at a tiny epsilon instead of 0.
    """
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=MASKED_MEAN_EPS)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance of ``x`` over unmasked positions (Bessel factor ``n / (n - 1)``).

    Shapes: ``x`` and ``mask`` (bs, T); result is a scalar tensor.

    Raises:
        ValueError: when the mask holds fewer than 2 tokens (the unbiased variance is undefined).
    """
    n = float(mask.sum())
    if n < 2:
        raise ValueError(f"masked_var needs at least 2 unmasked tokens, got a mask sum of {n:g}")
    mean = masked_mean(x, mask)
    biased_var = masked_mean((x - mean) ** 2, mask)
    return biased_var * (n / (n - 1))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten ``x`` with the statistics of its unmasked positions: ``(x - mean) * rsqrt(var + 1e-8)``.

    With ``shift_mean=False`` the mean is added back, so only the scale changes. The statistics are taken
    in float64: where every value is the same (a batch of equal returns) the float32 mean's rounding error,
    divided by ``sqrt(1e-8)``, would come out as advantages of 1e-3 instead of 0.
    With fewer than 2 unmasked tokens there is no variance to divide by: the values are centred only, so a
    lone token comes out as exactly 0 (its own mean), and an empty mask leaves ``x`` as it is.
    Shapes: ``x`` and ``mask`` (bs, T) -> (bs, T), ``x``'s dtype. Values at masked positions are not meaningful.
    """
    wide = x.double()
    mean = masked_mean(wide, mask)
    if float(mask.sum()) < 2:
        return (wide if not shift_mean else wide - mean).to(x.dtype)
    var = masked_var(wide, mask)
    whitened = (wide - mean) * torch.rsqrt(var + WHITEN_EPS)  # (bs, T)
    if not shift_mean:
        whitened = whitened + mean
    return whitened.to(x.dtype)


def _zero_where_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with every masked position set to exactly 0. Shapes: (bs, T) -> (bs, T)."""
    return torch.where(mask != 0, x, torch.zeros_like(x))


# --------------------------------------------------------------------------------------------------
# Generalised advantage estimation (critic-based)
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16), run backwards over tokens.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``, where
    ``V_{t+1}`` and ``A_{t+1}`` belong to the next *unmasked* token: at a masked position both carry over
    unchanged, so masked tokens inside a response (tool output) are skipped by the recursion.

    Args:
        token_level_rewards: (bs, T) reward per response token.
        values: (bs, T) critic values ``V_t`` of the old policy's states.
        response_mask: (bs, T) 1 on response tokens the policy produced, 0 elsewhere.
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        advantages: (bs, T) whitened GAE advantages, 0 at masked positions.
        returns: (bs, T) ``A_t + V_t`` (un-whitened), the critic's regression target, 0 at masked positions.
    """
    valid = response_mask != 0  # (bs, T)
    response_length = token_level_rewards.shape[-1]
    next_value = torch.zeros_like(values[:, 0])  # (bs,)
    gae = torch.zeros_like(values[:, 0])  # (bs,)
    gae_reversed = []
    for t in reversed(range(response_length)):
        r_t, v_t, valid_t = token_level_rewards[:, t], values[:, t], valid[:, t]
        delta = r_t + gamma * next_value - v_t
        gae = torch.where(valid_t, delta + gamma * lam * gae, gae)
        next_value = torch.where(valid_t, v_t, next_value)
        gae_reversed.append(gae)
    raw_advantages = torch.stack(gae_reversed[::-1], dim=1)  # (bs, T)
    returns = _zero_where_masked(raw_advantages + values, response_mask)
    advantages = _zero_where_masked(masked_whiten(raw_advantages, response_mask), response_mask)
    return advantages, returns


# --------------------------------------------------------------------------------------------------
# KL penalty estimators
# --------------------------------------------------------------------------------------------------


def _kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k1 estimator of KL(pi || ref): ``log_prob - ref_log_prob``. (bs, T) -> (bs, T)."""
    return log_prob - ref_log_prob


def _kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Absolute log-ratio ``|log_prob - ref_log_prob|``. (bs, T) -> (bs, T)."""
    return (log_prob - ref_log_prob).abs()


def _kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k2 estimator (Schulman 2020): ``0.5 * (log_prob - ref_log_prob) ** 2``. (bs, T) -> (bs, T)."""
    return 0.5 * (log_prob - ref_log_prob).square()


def _kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k3 estimator (Schulman 2020), unbiased and non-negative: ``exp(k) - k - 1`` with ``k = ref - lp``.

    The log-ratio is clamped to [-20, 20] and the result to [-10, 10] for numerical stability;
    ``exp(k) - 1`` is evaluated as ``expm1(k)`` so that tiny log-ratios do not round below zero.
    (bs, T) -> (bs, T).
    """
    log_ratio = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)  # (bs, T)
    kld = torch.expm1(log_ratio) - log_ratio
    return torch.clamp(kld, min=-10.0, max=10.0)


_KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "kl": _kl_k1,
    "k1": _kl_k1,
    "abs": _kl_abs,
    "mse": _kl_k2,
    "k2": _kl_k2,
    "low_var_kl": _kl_k3,
    "k3": _kl_k3,
}
# each name with "+": its value, k2's gradient (verl's straight-through estimators, e.g. ``k3+``)
KL_TYPES: tuple[str, ...] = (*_KL_ESTIMATORS, *(f"{name}+" for name in _KL_ESTIMATORS))


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman 2020).

    ``kl_type`` is one of ``KL_TYPES``: ``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3``, or one
    of them with ``+``: that estimator's value with k2's gradient, ``(lp - ref) * d lp`` (the k1 and k3
    estimates are unbiased in value but not in gradient; k2's gradient is the KL's in expectation).
    Shapes: (bs, T), (bs, T) -> (bs, T). Keeps the autograd graph (used as the actor's KL loss too).
    """
    try:
        estimator = _KL_ESTIMATORS[kl_type.removesuffix("+")]
    except KeyError:
        raise ValueError(f"unknown kl_type {kl_type!r}; valid kl types are {', '.join(KL_TYPES)}") from None
    value = estimator(log_prob, ref_log_prob)
    if not kl_type.endswith("+"):
        return value
    k2 = _kl_k2(log_prob, ref_log_prob)
    return k2 - k2.detach() + value.detach()


# --------------------------------------------------------------------------------------------------
# Loss aggregation
# --------------------------------------------------------------------------------------------------

Count = int | float | torch.Tensor | None


def _agg_token_mean(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, global_token_count: Count, global_seq_count: Count
) -> torch.Tensor:
    """Masked mean over all tokens; divides by ``global_token_count`` when one is given."""
    if global_token_count is None:
        return masked_mean(loss_mat, loss_mask)
    return masked_sum(loss_mat, loss_mask) / global_token_count


def _seq_has_tokens(loss_mask: torch.Tensor) -> torch.Tensor:
    """Which sequences hold at least one unmasked token. (bs, T) -> (bs,) bool."""
    return loss_mask.sum(dim=-1) > 0


def _mean_over_seqs(
    seq_losses: torch.Tensor, loss_mask: torch.Tensor, global_seq_count: Count
) -> torch.Tensor:
    """Mean of per-sequence losses over sequences with tokens, or ``sum / global_seq_count``. (bs,) -> ()."""
    has_tokens = _seq_has_tokens(loss_mask)  # (bs,)
    total = torch.where(has_tokens, seq_losses, torch.zeros_like(seq_losses)).sum()
    if global_seq_count is None:
        return total / has_tokens.sum().clamp(min=1)
    return total / global_seq_count


def _agg_seq_mean_token_sum(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, global_token_count: Count, global_seq_count: Count
) -> torch.Tensor:
    """Per-sequence masked sum, then the mean over sequences that hold tokens."""
    seq_losses = masked_sum(loss_mat, loss_mask, dim=-1)  # (bs,)
    return _mean_over_seqs(seq_losses, loss_mask, global_seq_count)


def _agg_seq_mean_token_sum_norm(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, global_token_count: Count, global_seq_count: Count,
    loss_scale_factor: Count = None,
) -> torch.Tensor:
    """Dr. GRPO: per-sequence masked sum, mean over sequences, divided by a constant ``loss_scale_factor``
    (default: the padded response width ``T``), so a token weighs the same in a short and a long response."""
    scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return _agg_seq_mean_token_sum(loss_mat, loss_mask, global_token_count, global_seq_count) / scale


def _agg_seq_mean_token_mean(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, global_token_count: Count, global_seq_count: Count
) -> torch.Tensor:
    """Per-sequence masked mean, then the mean over sequences that hold tokens."""
    seq_token_counts = loss_mask.sum(dim=-1)  # (bs,)
    safe_counts = torch.where(seq_token_counts > 0, seq_token_counts, torch.ones_like(seq_token_counts))
    seq_losses = masked_sum(loss_mat, loss_mask, dim=-1) / safe_counts  # (bs,)
    return _mean_over_seqs(seq_losses, loss_mask, global_seq_count)


_LOSS_AGGREGATORS: dict[str, Callable[..., torch.Tensor]] = {
    "token-mean": _agg_token_mean,
    "seq-mean-token-sum": _agg_seq_mean_token_sum,
    "seq-mean-token-mean": _agg_seq_mean_token_mean,
    "seq-mean-token-sum-norm": _agg_seq_mean_token_sum_norm,
}
LOSS_AGG_MODES: tuple[str, ...] = tuple(_LOSS_AGGREGATORS)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    global_token_count: Count = None,
    global_seq_count: Count = None,
    loss_scale_factor: Count = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix (bs, T) to a scalar.

    Modes (``LOSS_AGG_MODES``):
        - ``token-mean``: masked mean over every token of the batch.
        - ``seq-mean-token-sum``: masked sum per sequence, then the mean over sequences with >= 1 token.
        - ``seq-mean-token-mean``: masked mean per sequence, then the mean over sequences with >= 1 token.
        - ``seq-mean-token-sum-norm`` (Dr. GRPO, Liu et al. 2025): ``seq-mean-token-sum`` divided by the
          constant ``loss_scale_factor`` (default ``T``, the padded response width), so that every token
          of every response has the same weight whatever the response's length.

    With gradient accumulation, pass the token count (``token-mean``) or the count of sequences with
    tokens (``seq-*`` modes) of the whole mini-batch (over all workers) as ``global_token_count`` /
    ``global_seq_count``: the local sum is then divided by that count, so summing the micro-batch losses
    gives the mini-batch loss whatever the micro-batch size. A count a mode does not use is ignored.
    """
    try:
        aggregate = _LOSS_AGGREGATORS[loss_agg_mode]
    except KeyError:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes are {', '.join(LOSS_AGG_MODES)}"
        ) from None
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return aggregate(loss_mat, loss_mask, global_token_count, global_seq_count, loss_scale_factor)
    return aggregate(loss_mat, loss_mask, global_token_count, global_seq_count)


# --------------------------------------------------------------------------------------------------
# Actor and critic losses
# --------------------------------------------------------------------------------------------------


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO surrogate (Schulman et al. 2017, eq. 7) with dual clip (Ye et al. 2020): loss mode ``vanilla``.

    The ratio is clipped to ``[1 - clip_ratio_low, 1 + clip_ratio_high]`` (both default to ``clip_ratio``).
    For negative advantages the loss is further bounded by ``-A * clip_ratio_c``. A ``clip_ratio_high``
    above ``clip_ratio_low`` is DAPO's clip-higher (Yu et al. 2025: 0.2 / 0.28): it only widens the
    upper bound, which binds for positive advantages, so unlikely tokens can gain probability faster.

    Args:
        old_log_prob: (bs, T) log-probs of the sampled tokens under the rollout policy.
        log_prob: (bs, T) log-probs under the current policy (carries gradient).
        advantages: (bs, T).
        response_mask: (bs, T).
        clip_ratio, clip_ratio_low, clip_ratio_high: PPO clip range.
        clip_ratio_c: dual-clip bound, must be > 1.
        loss_agg_mode: see ``agg_loss``; ``agg_kwargs`` (global counts) are passed to it.
        rollout_is_weights: (bs, T) optional truncated importance weights from rollout correction,
            multiplied into the per-token loss (no gradient).

    Returns:
        loss: scalar tensor with its autograd graph.
        metrics: ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` (python floats).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be greater than 1.0 for dual-clip PPO, got {clip_ratio_c}")
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high

    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)  # (bs, T)
    ratio = torch.exp(negative_approx_kl)  # (bs, T)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)  # the usual pessimistic PPO bound
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)  # dual clip, only for A < 0
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)  # (bs, T)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()

    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)

    with torch.no_grad():
        pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
        ppo_kl = masked_mean(-negative_approx_kl, response_mask)
        lower_clipped = torch.gt(clip_pg_losses1, pg_losses3) & (advantages < 0)  # (bs, T)
        pg_clipfrac_lower = masked_mean(lower_clipped.float(), response_mask)
    metrics = {
        "actor/pg_clipfrac": pg_clipfrac.item(),
        "actor/ppo_kl": ppo_kl.item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.item(),
    }
    return loss, metrics


def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, eq. 5-7): loss mode ``gspo``.

    The ratio is the sequence's length-normalised likelihood ratio
    ``s_i = exp(mean_t(log_prob - old_log_prob))``, clipped to ``[1 - clip_ratio_low, 1 + clip_ratio_high]``
    and paired with the sequence's advantage: ``loss_i = max(-A_i * s_i, -A_i * clip(s_i))``. Per token it
    is written ``s_i,t = sg(s_i) * pi_t / sg(pi_t)`` (same value as ``s_i``; its gradient is
    ``s_i * grad log pi_t``), so the token mean of ``loss_i,t`` over the response has the paper's gradient.
    The objective is a mean over sequences of per-sequence token means, so the loss is always aggregated
    ``seq-mean-token-mean`` (``loss_agg_mode`` is accepted for a uniform signature and not used); no dual clip.
    The paper's clip ranges are tiny (3e-4 / 4e-4): a sequence-level ratio moves much less than a token's.

    Shapes: all (bs, T). Returns the loss and ``actor/pg_clipfrac`` (share of tokens in clipped
    sequences), ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` (always 0: no dual clip).
    """
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    log_ratio = log_prob - old_log_prob  # (bs, T)
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)  # (bs,) log s_i; 0 for an empty row
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)  # (bs, T)
    seq_ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))  # (bs, T): value s_i on every token

    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1.0 - low, 1.0 + high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)  # (bs, T)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", **agg_kwargs)

    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask).item(),
            "actor/ppo_kl": masked_mean(-log_ratio, response_mask).item(),
            "actor/pg_clipfrac_lower": 0.0,
        }
    return loss, metrics


def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped IS-weight Policy Optimization (MiniMax 2025, "MiniMax-M1", eq. 4): loss mode ``cispo``.

    ``loss_t = -sg(clip(ratio_t, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A_t * log_prob_t``: the
    importance weight is truncated and detached instead of the token being dropped from the gradient, so
    every token keeps a REINFORCE gradient. ``clip_ratio_low`` (``clip_ratio`` when unset, as verl) bounds it
    below; the paper's weight, with no lower bound, is ``clip_ratio_low=1.0``. ``clip_ratio_high`` is the
    truncation bound (large, e.g. 5; ``clip_ratio`` when unset).

    Shapes: all (bs, T). Returns the loss and ``actor/pg_clipfrac`` (share of tokens whose weight was
    truncated, either way), ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` (share raised to the lower bound).
    """
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)  # (bs, T)
    ratio = torch.exp(log_ratio)  # (bs, T)
    lower = 1.0 - (clip_ratio if clip_ratio_low is None else clip_ratio_low)
    truncated = torch.clamp(ratio, min=lower, max=1.0 + high).detach()  # (bs, T)
    pg_losses = -truncated * advantages * log_prob  # (bs, T)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)

    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": masked_mean(torch.ne(ratio, truncated).float(), response_mask).item(),
            "actor/ppo_kl": masked_mean(-log_ratio, response_mask).item(),
            "actor/pg_clipfrac_lower": masked_mean(torch.lt(ratio, lower).float(), response_mask).item(),
        }
    return loss, metrics


POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {
    "vanilla": compute_policy_loss,
    "gspo": compute_policy_loss_gspo,
    "cispo": compute_policy_loss_cispo,
}
POLICY_LOSS_MODES: tuple[str, ...] = tuple(POLICY_LOSSES)


def get_policy_loss_fn(loss_mode: str) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """The policy loss registered under ``loss_mode`` (``POLICY_LOSS_MODES``); all share the signature of
    :func:`compute_policy_loss`."""
    try:
        return POLICY_LOSSES[loss_mode]
    except KeyError:
        raise ValueError(
            f"unknown policy loss_mode {loss_mode!r}; valid modes are {', '.join(POLICY_LOSS_MODES)}"
        ) from None


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, float]:
    """Clipped value loss (Schulman et al. 2017; as in the OpenAI baselines PPO2 critic).

    ``vpredclipped = clamp(vpreds, values - cliprange_value, values + cliprange_value)`` and
    ``loss = 0.5 * agg(max((vpreds - R)^2, (vpredclipped - R)^2))``. Where ``vpreds`` stays within the
    clip range, ``vpredclipped`` is ``vpreds`` bit for bit, so such a token never counts as clipped.

    Args:
        vpreds: (bs, T) current critic predictions (carry gradient).
        returns: (bs, T) regression targets ``R``.
        values: (bs, T) critic predictions at rollout time.
        response_mask: (bs, T).
        cliprange_value: how far ``vpreds`` may move from ``values`` before the clipped loss takes over.
        loss_agg_mode: see ``agg_loss``; ``agg_kwargs`` (global counts) are passed to it.

    Returns:
        loss: scalar tensor with its autograd graph.
        clipfrac: fraction of unmasked tokens where the clipped loss is the larger one (python float).
    """
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)  # (bs, T)
    vf_losses1 = (vpreds - returns).square()
    vf_losses2 = (vpredclipped - returns).square()
    clipped_vf_losses = torch.maximum(vf_losses1, vf_losses2)  # (bs, T)
    loss = 0.5 * agg_loss(clipped_vf_losses, response_mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return loss, clipfrac.item()


# --------------------------------------------------------------------------------------------------
# Logits helpers
# --------------------------------------------------------------------------------------------------


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution given by ``logits``: ``logsumexp(z) - sum(softmax(z) * z)``.

    Shapes: (bs, T, V) -> (bs, T).
    """
    probs = torch.softmax(logits, dim=-1)  # (bs, T, V)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-softmax of ``logits`` gathered at ``labels``. Shapes: (bs, T, V), (bs, T) -> (bs, T).

    To keep peak memory low the normaliser is computed one sequence at a time rather than materialising
    a full (bs, T, V) log-softmax. In float32/float64 this is ``logit[label] - logsumexp(logits)``; in
    lower precision (bf16/fp16) that difference of two large numbers loses accuracy, so each sequence
    gets its own log-softmax instead.
    """
    labels = labels.long()
    if logits.dtype in (torch.float32, torch.float64):
        label_logits = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)  # (bs, T)
        log_normalizer = torch.stack(
            [torch.logsumexp(seq_logits, dim=-1) for seq_logits in logits]
        )  # (bs, T)
        return label_logits - log_normalizer
    per_seq = [
        seq_logits.log_softmax(dim=-1).gather(-1, seq_labels.unsqueeze(-1)).squeeze(-1)  # (T,)
        for seq_logits, seq_labels in zip(logits, labels)
    ]
    return torch.stack(per_seq)


# --------------------------------------------------------------------------------------------------
# Outcome (critic-free) advantage estimators
# --------------------------------------------------------------------------------------------------


def _sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome score of each response: the masked sum of its token rewards. (bs, T) -> (bs,)."""
    return masked_sum(token_level_rewards, response_mask, dim=-1)


def _group_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome scores in float64, for statistics within groups. (bs, T) -> (bs,) float64.

    A group whose responses all score the same must come out with deviations of exactly 0: a float32 sum of
    ``n`` equal scores rounds, and the division by the group's std (itself near 0) turns that rounding into
    advantages of up to ~0.5 (16 scores of 0.98: 0.19). In float64 ``n`` copies of a float32 score sum
    exactly, so their mean is the score itself."""
    return _sequence_scores(token_level_rewards.double(), response_mask)


def _over_tokens(seq_values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """One value per sequence repeated over its tokens, in ``like``'s dtype. (bs,) -> ``like``'s (bs, T)."""
    return seq_values.to(like.dtype).unsqueeze(-1).expand_as(like)


def _group_ids(index: Sequence[Hashable], batch_size: int, device: torch.device) -> torch.Tensor:
    """Map each row's group id (any hashable) to a dense integer id. -> (bs,) long."""
    if isinstance(index, torch.Tensor):  # (its elements hash by identity: equal ids would never meet)
        index = index.tolist()
    if len(index) != batch_size:
        raise ValueError(f"index has {len(index)} group ids but the batch has {batch_size} rows")
    dense: dict[Hashable, int] = {}
    ids = [dense.setdefault(uid, len(dense)) for uid in index]
    return torch.tensor(ids, dtype=torch.long, device=device)


def _group_sum(x: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over each row's group, broadcast back to the rows. (bs,), (bs,) -> (bs,)."""
    num_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    per_group = torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, group_ids, x)
    return per_group[group_ids]


@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantage (Shao et al. 2024): each response's score standardised within its prompt's group.

    ``A = (s - mean_group(s)) / (std_group(s) + epsilon)`` with the unbiased group std; without the
    division when ``norm_adv_by_std_in_grpo`` is False (Dr. GRPO). A group of one response uses mean 0 and
    std 1, as verl does.

    Args:
        token_level_rewards: (bs, T); the score ``s`` is their masked sum over the response.
        response_mask: (bs, T).
        index: bs hashable group ids (list or numpy array); rows with the same id answer the same prompt.

    Returns:
        (advantages, returns), both (bs, T): the per-sequence advantage on every unmasked token, 0 elsewhere.
    """
    scores = _group_scores(token_level_rewards, response_mask)  # (bs,) float64
    group_ids = _group_ids(index, scores.shape[0], scores.device)  # (bs,)
    group_size = _group_sum(torch.ones_like(scores), group_ids)  # (bs,)
    group_mean = _group_sum(scores, group_ids) / group_size  # (bs,)
    sum_sq_dev = _group_sum((scores - group_mean).square(), group_ids)  # (bs,)
    singleton = group_size < 2
    group_std = torch.sqrt(sum_sq_dev / torch.where(singleton, torch.ones_like(group_size), group_size - 1))
    group_mean = torch.where(singleton, torch.zeros_like(group_mean), group_mean)
    group_std = torch.where(singleton, torch.ones_like(group_std), group_std)

    seq_advantages = scores - group_mean  # (bs,)
    if norm_adv_by_std_in_grpo:
        seq_advantages = seq_advantages / (group_std + epsilon)
    advantages = _zero_where_masked(_over_tokens(seq_advantages, token_level_rewards), response_mask)
    return advantages, advantages


@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out advantage (Ahmadian et al. 2024): ``A_i = s_i - mean_{j != i} s_j``.

    Equivalently ``(n * s_i - sum_j s_j) / (n - 1)`` within a group of ``n`` responses. A group of one has
    no other responses to form a baseline from; as in verl its advantage is its raw score.
    ``epsilon`` is accepted for a uniform estimator signature and unused.

    Shapes: ``token_level_rewards`` and ``response_mask`` (bs, T); ``index`` bs hashable group ids.
    Returns (advantages, returns), both (bs, T), the per-sequence advantage broadcast over the mask.
    """
    scores = _group_scores(token_level_rewards, response_mask)  # (bs,) float64
    group_ids = _group_ids(index, scores.shape[0], scores.device)  # (bs,)
    group_size = _group_sum(torch.ones_like(scores), group_ids)  # (bs,)
    others_sum = _group_sum(scores, group_ids) - scores  # (bs,)
    singleton = group_size < 2
    others_mean = others_sum / torch.where(singleton, torch.ones_like(group_size), group_size - 1)
    seq_advantages = torch.where(singleton, scores, scores - others_mean)  # (bs,)
    advantages = _zero_where_masked(_over_tokens(seq_advantages, token_level_rewards), response_mask)
    return advantages, advantages


@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantage (Hu 2025): discounted reward-to-go per token, whitened over the batch.

    ``G_t = r_t + gamma * G_{t+1}`` run backwards, where ``G_{t+1}`` is the return of the next *unmasked*
    token: at a masked position the running return carries over unchanged (not discounted), so masked
    tokens inside a response are skipped.

    Shapes: (bs, T), (bs, T) -> advantages (bs, T) whitened ``G`` and returns (bs, T) the raw ``G`` (as
    in verl), both 0 at masked positions.
    """
    valid = response_mask != 0  # (bs, T)
    running_return = torch.zeros_like(token_level_rewards[:, 0])  # (bs,)
    returns_reversed = []
    for t in reversed(range(token_level_rewards.shape[-1])):
        running_return = torch.where(
            valid[:, t], token_level_rewards[:, t] + gamma * running_return, running_return
        )
        returns_reversed.append(running_return)
    returns = _zero_where_masked(torch.stack(returns_reversed[::-1], dim=1), response_mask)  # (bs, T)
    advantages = _zero_where_masked(masked_whiten(returns, response_mask), response_mask)
    return advantages, returns


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline (Hu 2025, section 3.2): ``s - mean_group(s)``, then whitened.

    Each response's score minus the mean score of its prompt's group (0 for a group of one, as in verl)
    is broadcast over its response tokens and whitened over every token of the batch.

    Shapes: ``token_level_rewards`` and ``response_mask`` (bs, T); ``index`` bs hashable group ids.
    Returns (advantages, returns), both (bs, T) and equal, 0 at masked positions.
    """
    scores = _group_scores(token_level_rewards, response_mask)  # (bs,) float64
    group_ids = _group_ids(index, scores.shape[0], scores.device)  # (bs,)
    group_size = _group_sum(torch.ones_like(scores), group_ids)  # (bs,)
    group_mean = torch.where(group_size < 2, torch.zeros_like(scores), _group_sum(scores, group_ids) / group_size)
    centred = _over_tokens(scores - group_mean, token_level_rewards)  # (bs, T)
    advantages = _zero_where_masked(masked_whiten(centred, response_mask), response_mask)
    return advantages, advantages


@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    reward_baselines: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): reward-to-go minus the score of the prompt's greedy response.

    ``G_t = sum_{t' >= t} r_t'`` over the response, and ``A_t = G_t - b`` where ``b`` is the score of a
    greedy (argmax) response to the same prompt, which needs no critic and no group.

    Shapes: ``token_level_rewards`` and ``response_mask`` (bs, T); ``reward_baselines`` (bs,).
    Returns advantages (bs, T) and returns ``G`` (bs, T), both 0 at masked positions.
    """
    masked_rewards = _zero_where_masked(token_level_rewards, response_mask)  # (bs, T)
    returns = masked_rewards.flip(-1).cumsum(-1).flip(-1)  # (bs, T) reward-to-go
    returns = _zero_where_masked(returns, response_mask)
    advantages = _zero_where_masked(returns - reward_baselines.unsqueeze(-1), response_mask)
    return advantages, returns


@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training (Chen et al. 2025, arXiv:2503.19595): only each group's best response is credited.

    In every group the response with the highest score gets ``s_max - s_second`` (divided by the group's
    unbiased std + ``epsilon`` when ``norm_adv_by_std_in_grpo``); every other response gets 0. A tie at
    the top gives 0. Ties for the best go to the first such row.

    Shapes: ``token_level_rewards`` and ``response_mask`` (bs, T); ``index`` bs hashable group ids.
    Returns (advantages, returns), both (bs, T).

    Raises:
        ValueError: when a group holds a single response (there is no second best).
    """
    scores = _sequence_scores(token_level_rewards, response_mask)  # (bs,)
    group_ids = _group_ids(index, scores.shape[0], scores.device)  # (bs,)
    seq_advantages = torch.zeros_like(scores)
    for group in range(int(group_ids.max()) + 1 if group_ids.numel() else 0):
        rows = torch.nonzero(group_ids == group).squeeze(-1)  # (k,)
        if rows.numel() < 2:
            raise ValueError(f"grpo_passk needs at least 2 responses per prompt; group {index[int(rows[0])]!r} "
                             "has 1: set actor_rollout_ref.rollout.n >= 2")
        group_scores = scores[rows]
        top2 = torch.topk(group_scores, 2)
        gap = top2.values[0] - top2.values[1]
        if norm_adv_by_std_in_grpo:
            gap = gap / (group_scores.std() + epsilon)
        seq_advantages[rows[int(torch.argmax(group_scores))]] = gap
    advantages = _zero_where_masked(_over_tokens(seq_advantages, token_level_rewards), response_mask)
    return advantages, advantages


# --------------------------------------------------------------------------------------------------
# Advantage estimator registry
# --------------------------------------------------------------------------------------------------

ADV_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "gae": compute_gae_advantage_return,
    "grpo": compute_grpo_outcome_advantage,
    "rloo": compute_rloo_outcome_advantage,
    "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage,
    "remax": compute_remax_outcome_advantage,
    "grpo_passk": compute_grpo_passk_outcome_advantage,
}
ADV_ESTIMATORS_NEED_CRITIC = frozenset({"gae"})
ADV_ESTIMATORS_NEED_GROUPS = frozenset({"grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_passk"})

# The arguments of ``compute_advantage`` each estimator takes besides ``token_level_rewards`` and
# ``response_mask``.
_ADV_ESTIMATOR_ARGS: dict[str, tuple[str, ...]] = {
    "gae": ("values", "gamma", "lam"),
    "grpo": ("index", "norm_adv_by_std_in_grpo"),
    "rloo": ("index",),
    "reinforce_plus_plus": ("gamma",),
    "reinforce_plus_plus_baseline": ("index",),
    "remax": ("reward_baselines",),
    "grpo_passk": ("index", "norm_adv_by_std_in_grpo"),
}


def get_adv_estimator(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The advantage estimator registered under ``name`` (a key of ``ADV_ESTIMATORS``)."""
    try:
        return ADV_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown adv_estimator {name!r}; valid estimators are {', '.join(ADV_ESTIMATORS)}"
        ) from None


def compute_advantage(
    adv_estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    index: Sequence[Hashable] | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    reward_baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator named ``adv_estimator`` with the arguments it takes.

    ``gae`` needs ``values`` (bs, T); the group estimators (``ADV_ESTIMATORS_NEED_GROUPS``) need ``index``
    (bs group ids); ``remax`` needs ``reward_baselines`` (bs,). Arguments an estimator does not take are
    ignored. Returns ``(advantages, returns)``, both (bs, T).
    """
    estimator = get_adv_estimator(adv_estimator)
    available = {
        "values": values,
        "index": index,
        "reward_baselines": reward_baselines,
        "gamma": gamma,
        "lam": lam,
        "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo,
    }
    kwargs = {name: available[name] for name in _ADV_ESTIMATOR_ARGS[adv_estimator]}
    missing = [name for name, value in kwargs.items() if value is None]
    if missing:
        raise ValueError(f"adv_estimator {adv_estimator!r} needs {', '.join(missing)}")
    return estimator(token_level_rewards=token_level_rewards, response_mask=response_mask, **kwargs)


# --------------------------------------------------------------------------------------------------
# KL controllers and the in-reward KL penalty
# --------------------------------------------------------------------------------------------------


class FixedKLController:
    """A KL coefficient that never changes."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, Any]:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.value = float(state_dict["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, eq. 2).

    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)`` and ``beta <- beta * (1 + e * n_steps / horizon)``:
    the coefficient grows while the policy drifts further than ``target_kl`` from the reference and
    shrinks while it stays closer.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0:
            raise ValueError(f"target_kl must be positive, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be positive, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"type": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.value = float(state_dict["value"])
        self.target = float(state_dict.get("target", self.target))
        self.horizon = float(state_dict.get("horizon", self.horizon))


def _make_fixed(kl_coef: float, target_kl: float | None, horizon: float | None) -> FixedKLController:
    return FixedKLController(kl_coef)


def _make_adaptive(kl_coef: float, target_kl: float | None, horizon: float | None) -> AdaptiveKLController:
    if target_kl is None or horizon is None:
        raise ValueError("an adaptive KL controller needs target_kl and horizon")
    return AdaptiveKLController(kl_coef, target_kl, horizon)


_KL_CONTROLLERS: dict[str, Callable[..., FixedKLController | AdaptiveKLController]] = {
    "fixed": _make_fixed,
    "adaptive": _make_adaptive,
}
KL_CTRL_TYPES: tuple[str, ...] = tuple(_KL_CONTROLLERS)


def make_kl_controller(
    type: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build the KL controller named ``type`` (``'fixed'`` or ``'adaptive'``)."""
    try:
        factory = _KL_CONTROLLERS[type]
    except KeyError:
        raise ValueError(
            f"unknown KL controller type {type!r}; valid types are {', '.join(_KL_CONTROLLERS)}"
        ) from None
    return factory(kl_coef, target_kl, horizon)


def kl_controller_from_state(state: Mapping[str, Any]) -> FixedKLController | AdaptiveKLController:
    """The controller a ``state_dict()`` describes (its type included: a guard may have swapped it)."""
    ctrl = make_kl_controller(state["type"], state["value"], state.get("target"), state.get("horizon"))
    ctrl.load_state_dict(state)
    return ctrl


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kl_type: str,
) -> tuple[torch.Tensor, float, dict[str, float]]:
    """Subtract a per-token KL penalty from the rewards (Ziegler et al. 2019): ``r = score - beta * KL``.

    Then feeds the batch KL to the controller: ``kl_ctrl.update(batch_kl, n_steps=bs)``.

    Args:
        token_level_scores: (bs, T) task rewards per token (usually one non-zero at the last token).
        old_log_prob: (bs, T) rollout-policy log-probs.
        ref_log_prob: (bs, T) reference-policy log-probs.
        response_mask: (bs, T).
        kl_ctrl: supplies ``beta = kl_ctrl.value`` and is updated in place.
        kl_type: a name of ``KL_TYPES``.

    Returns:
        token_level_rewards: (bs, T).
        batch_kl: mean over sequences of each sequence's masked-mean KL (python float).
        metrics: ``actor/reward_kl_penalty`` (batch_kl) and ``actor/reward_kl_penalty_coeff`` (beta used).
    """
    kld = _zero_where_masked(kl_penalty(old_log_prob, ref_log_prob, kl_type), response_mask)  # (bs, T)
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    seq_kl = masked_mean(kld, response_mask, dim=-1)  # (bs,)
    batch_kl = seq_kl.mean().item()
    kl_ctrl.update(batch_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": batch_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, batch_kl, metrics


# --------------------------------------------------------------------------------------------------
# DAPO (Yu et al. 2025): dynamic sampling and overlong reward shaping
# --------------------------------------------------------------------------------------------------

#: What must differ within a prompt group for dynamic sampling to keep it (``algorithm.filter_groups.metric``):
#: the summed token scores (``seq_final_reward``: verl's name, the same where the reward holds no KL penalty), or
#: the ``score`` / ``acc`` the reward function reported (with a custom function, any number it reports).
FILTER_GROUPS_METRICS: tuple[str, ...] = ("seq_reward", "seq_final_reward", "score", "acc")


@torch.no_grad()
def filter_groups_keep(metric: torch.Tensor, index: Sequence[Hashable]) -> torch.Tensor:
    """DAPO's dynamic-sampling filter: which rows belong to a group whose responses do not all score the same.

    A group where every response has the same ``metric`` (all right, all wrong) gives every response a
    zero group-relative advantage and so no gradient; it is dropped. A group of one is kept (there is
    nothing to compare it with), as in verl.

    Shapes: ``metric`` (bs,) one value per response; ``index`` bs hashable group ids -> (bs,) bool.
    """
    group_ids = _group_ids(index, metric.shape[0], metric.device)  # (bs,)
    num_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    values = metric.double()
    group_max = torch.full((num_groups,), -torch.inf, dtype=values.dtype, device=values.device).scatter_reduce(
        0, group_ids, values, reduce="amax")
    group_min = torch.full((num_groups,), torch.inf, dtype=values.dtype, device=values.device).scatter_reduce(
        0, group_ids, values, reduce="amin")
    group_size = _group_sum(torch.ones_like(values), group_ids)  # (bs,)
    return (group_max[group_ids] > group_min[group_ids]) | (group_size < 2)


@torch.no_grad()
def compute_overlong_penalty(
    response_length: torch.Tensor, max_response_length: int, overlong_buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to each response's reward.

    0 up to ``L_max - L_buffer`` tokens, then falling linearly to ``-penalty_factor`` at ``L_max``:
    ``min(0, -(len - (L_max - L_buffer)) / L_buffer * penalty_factor)``.

    Shapes: ``response_length`` (bs,) tokens per response -> (bs,) penalty (<= 0).
    """
    if not 0 < overlong_buffer_len <= max_response_length:  # the whole length: every token is penalised
        raise ValueError(f"overlong_buffer_len ({overlong_buffer_len}) must be in (0, max_response_length = "
                         f"{max_response_length}]")
    expected_length = max_response_length - overlong_buffer_len
    exceed = response_length.double() - expected_length  # (bs,)
    return torch.clamp(-exceed / overlong_buffer_len * penalty_factor, max=0.0)


def add_at_last_token(token_level_scores: torch.Tensor, response_mask: torch.Tensor,
                      seq_values: torch.Tensor) -> torch.Tensor:
    """``token_level_scores`` with ``seq_values`` added at each row's last unmasked token (where the outcome
    reward sits). Rows without a response token are unchanged. Shapes: (bs, T), (bs, T), (bs,) -> (bs, T)."""
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device)  # (T,)
    last = torch.where(response_mask != 0, positions, -1).max(dim=-1).values  # (bs,)
    has_token = last >= 0
    rows = torch.nonzero(has_token).squeeze(-1)
    shaped = token_level_scores.clone()
    shaped[rows, last[rows]] += seq_values[rows].to(shaped.dtype)
    return shaped


# --------------------------------------------------------------------------------------------------
# Rollout correction: importance weights between the rollout engine's and the trainer's log-probs
# --------------------------------------------------------------------------------------------------

ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_MODES = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
_SAFETY_BOUND = 20.0  # |log ratio| bound before exponentiating


def _seq_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of ``values`` over each row's unmasked tokens, 0 for an empty row. (bs, T) -> (bs,)."""
    filled = torch.where(mask != 0, values, torch.full_like(values, -torch.inf))
    row_max = filled.max(dim=-1).values
    return torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)


@torch.no_grad()
def compute_rollout_is_weights(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_is: str, rollout_is_threshold: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling (TIS) weights ``min(pi_train / pi_rollout, threshold)``.

    ``log_ratio = old_log_prob - rollout_log_prob`` (bs, T). ``rollout_is='token'`` gives one weight per
    token, ``'sequence'`` the product over the response (``exp`` of the masked sum) on every token of it.
    Returns weights (bs, T), 0 at masked positions, and verl's ``rollout_is_*`` metrics (unprefixed), which
    describe the weights before truncation (see :func:`_rollout_is_metrics`).
    """
    seq_log_ratio = None
    if rollout_is == "token":
        log_weights = torch.clamp(log_ratio, -_SAFETY_BOUND, _SAFETY_BOUND)  # (bs, T)
    elif rollout_is == "sequence":
        seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1)  # (bs,) log of the product
        log_weights = torch.clamp(seq_log_ratio, -_SAFETY_BOUND, _SAFETY_BOUND).unsqueeze(-1).expand_as(log_ratio)
    else:
        raise ValueError(f"unknown rollout_is {rollout_is!r}; valid levels are {', '.join(ROLLOUT_IS_LEVELS)}")
    raw = _zero_where_masked(torch.exp(log_weights), response_mask)  # (bs, T) before truncation
    weights = raw.clamp(max=rollout_is_threshold)  # (bs, T)
    return weights, _rollout_is_metrics(raw, response_mask, seq_log_ratio, rollout_is_threshold)


def _rollout_is_metrics(raw: torch.Tensor, response_mask: torch.Tensor, seq_log_ratio: torch.Tensor | None,
                        threshold: float) -> dict[str, float]:
    """verl's ``rollout_is_*`` metrics (``compute_is_metrics``) of the importance weights before truncation.

    ``raw`` (bs, T): the weights bounded only by ``exp(+-20)``, 0 at masked positions; ``seq_log_ratio`` (bs,):
    each response's summed log ratio at sequence level, None at token level. With ``lower = 1 / threshold``:

    - ``mean``: over tokens. ``max``, ``min`` and ``ratio_fraction_high`` / ``_low`` (share above
      ``threshold`` / below ``lower``): over tokens at token level; over sequences at sequence level, from the
      summed log ratio itself (``max`` is ``exp`` of the largest, bounded at ``exp(20)``; ``min`` unbounded).
    - ``std`` and ``eff_sample_size`` (``1 / mean((w / mean(w))^2)``): over tokens, of the weights held within
      ``[lower, threshold]``; ``std`` is 0 for a single token.
    - ``seq_*``: over sequences, of each one's mean weight ``s``: mean, std (unbiased, 0 for one sequence),
      max, min, ``max_deviation`` (largest ``|s - 1|``), ``fraction_high`` / ``_low``.

    Sequences count only with response tokens (verl's count an empty row too; see README).
    """
    valid = response_mask != 0  # (bs, T)
    has_tokens = _seq_has_tokens(response_mask)  # (bs,)
    lower = 1.0 / threshold
    if seq_log_ratio is None:
        largest, smallest = raw[valid].max(), raw[valid].min()
        fraction_high = masked_mean((raw > threshold).float(), response_mask)
        fraction_low = masked_mean((raw < lower).float(), response_mask)
    else:
        seq_log = seq_log_ratio[has_tokens]  # (n_seq,)
        largest, smallest = torch.exp(seq_log.max().clamp(max=_SAFETY_BOUND)), torch.exp(seq_log.min())
        fraction_high = (seq_log > math.log(threshold)).float().mean()
        fraction_low = (seq_log < math.log(lower)).float().mean()
    held = raw.clamp(min=lower, max=threshold)  # (bs, T)
    held_mean = masked_mean(held, response_mask)
    held_var = masked_mean(held.square(), response_mask) - held_mean.square()
    seq_weights = masked_mean(raw, response_mask, dim=-1)[has_tokens]  # (n_seq,)
    return {
        "rollout_is_mean": masked_mean(raw, response_mask).item(),
        "rollout_is_max": largest.item(),
        "rollout_is_min": smallest.item(),
        "rollout_is_ratio_fraction_high": fraction_high.item(),
        "rollout_is_ratio_fraction_low": fraction_low.item(),
        "rollout_is_std": held_var.clamp(min=0.0).sqrt().item() if valid.sum() > 1 else 0.0,
        "rollout_is_eff_sample_size": 1.0 / masked_mean((held / (held_mean + 1e-8)).square(), response_mask).item(),
        "rollout_is_seq_mean": seq_weights.mean().item(),
        "rollout_is_seq_std": seq_weights.std().item() if seq_weights.numel() > 1 else 0.0,
        "rollout_is_seq_max": seq_weights.max().item(),
        "rollout_is_seq_min": seq_weights.min().item(),
        "rollout_is_seq_max_deviation": (seq_weights - 1.0).abs().max().item(),
        "rollout_is_seq_fraction_high": (seq_weights > threshold).float().mean().item(),
        "rollout_is_seq_fraction_low": (seq_weights < lower).float().mean().item(),
    }


@torch.no_grad()
def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_rs: str, rollout_rs_threshold: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rejection sampling: mask tokens (``token_*``) or whole responses (``seq_*``) whose divergence between
    the trainer's and the rollout engine's policy is out of bounds.

    The divergence is a KL estimator of ``log_ratio = old_log_prob - rollout_log_prob`` per token:
    ``k1 = -log_ratio``, ``k2 = log_ratio^2 / 2``, ``k3 = exp(log_ratio) - 1 - log_ratio``; ``seq_sum``,
    ``seq_mean`` and ``seq_max`` reduce it over the response. ``k1`` statistics must lie in
    ``[-log(threshold), log(threshold)]`` (a ratio bound of ``[1/threshold, threshold]``); ``k2``/``k3``
    statistics must be ``<= threshold``.

    Shapes: (bs, T), (bs, T) -> the new response mask (bs, T) and verl's ``rollout_rs_*`` metrics.
    """
    if rollout_rs not in ROLLOUT_RS_MODES:
        raise ValueError(f"unknown rollout_rs {rollout_rs!r}; valid modes are {', '.join(ROLLOUT_RS_MODES)}")
    level, estimator = rollout_rs.rsplit("_", 1)
    safe = torch.clamp(log_ratio, -_SAFETY_BOUND, _SAFETY_BOUND)  # (bs, T)
    per_token = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.expm1(safe) - safe}[estimator]
    if level == "token":
        statistic = per_token  # (bs, T)
    else:
        reduce = {"seq_sum": lambda v: masked_sum(v, response_mask, dim=-1),
                  "seq_mean": lambda v: masked_mean(v, response_mask, dim=-1),
                  "seq_max": lambda v: _seq_max(v, response_mask)}[level]
        statistic = reduce(per_token).unsqueeze(-1).expand_as(log_ratio)  # (bs, T)
    if estimator == "k1":
        bound = math.log(rollout_rs_threshold)
        keep = (statistic >= -bound) & (statistic <= bound)
    else:
        keep = statistic <= rollout_rs_threshold
    new_mask = response_mask * keep.to(response_mask.dtype)  # (bs, T)
    valid = response_mask != 0
    rejected = valid & ~keep
    seq_has_tokens = _seq_has_tokens(response_mask)
    seq_rejected = rejected.any(dim=-1)[seq_has_tokens].float()
    metrics = {
        f"rollout_rs_{rollout_rs}_mean": masked_mean(statistic, response_mask).item(),
        f"rollout_rs_{rollout_rs}_max": statistic[valid].max().item(),
        f"rollout_rs_{rollout_rs}_min": statistic[valid].min().item(),
        "rollout_rs_masked_fraction": masked_mean(rejected.float(), response_mask).item(),
        "rollout_rs_seq_masked_fraction": seq_rejected.mean().item() if seq_rejected.numel() else 0.0,
    }
    return new_mask, metrics


@torch.no_grad()
def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far the rollout engine's policy is from the trainer's, as verl reports it (unprefixed names).

    ``kl`` = mean(rollout - old) (k1 of KL(rollout || train)), ``k3_kl``, the per-sequence perplexities of
    both (``training_ppl``, ``rollout_ppl``) and their log difference, and the chi-square divergences
    ``chi2_token = E[rho^2] - 1`` and ``chi2_seq = E[(prod rho)^2] - 1`` with ``rho = pi_train / pi_rollout``.
    Shapes: (bs, T) each; only rows with response tokens count for the per-sequence figures.
    """
    has_tokens = _seq_has_tokens(response_mask)
    log_ratio = old_log_prob - rollout_log_prob  # (bs, T)
    seq_train = masked_mean(old_log_prob, response_mask, dim=-1)[has_tokens]  # (n_seq,)
    seq_rollout = masked_mean(rollout_log_prob, response_mask, dim=-1)[has_tokens]
    safe = torch.clamp(log_ratio, -_SAFETY_BOUND, _SAFETY_BOUND)
    seq_log_ratio = torch.clamp(masked_sum(log_ratio, response_mask, dim=-1)[has_tokens], -_SAFETY_BOUND,
                                _SAFETY_BOUND)
    return {
        "kl": masked_mean(-log_ratio, response_mask).item(),
        "k3_kl": masked_mean(torch.expm1(safe) - safe, response_mask).item(),
        "training_ppl": torch.exp(-seq_train).mean().item(),
        "rollout_ppl": torch.exp(-seq_rollout).mean().item(),
        "log_ppl_diff": (seq_rollout - seq_train).mean().item(),
        "chi2_token": (masked_mean(torch.exp(2 * safe), response_mask) - 1.0).item(),
        "chi2_seq": (torch.exp(2 * seq_log_ratio).mean() - 1.0).item(),
    }


@torch.no_grad()
def compute_rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """Rollout correction (verl's decoupled mode): weights and rejections between the rollout engine's
    log-probs (``rollout_log_prob``, e.g. vLLM bf16) and the trainer's (``old_log_prob``).

    Importance weights are computed on the response mask as given; rejection then narrows the mask.
    Returns ``(rollout_is_weights or None, response_mask after rejection, metrics)``, with every metric
    under ``rollout_corr/`` as verl names them. Shapes: (bs, T) each.
    """
    if response_mask.sum() == 0:
        raise ValueError("rollout correction needs at least one response token in the batch")
    log_ratio = old_log_prob - rollout_log_prob  # (bs, T)
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        weights, is_metrics = compute_rollout_is_weights(log_ratio, response_mask, rollout_is, rollout_is_threshold)
        metrics.update(is_metrics)
    new_mask = response_mask
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError("rollout_rs needs rollout_rs_threshold")
        new_mask, rs_metrics = compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs,
                                                              rollout_rs_threshold)
        metrics.update(rs_metrics)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, new_mask, {f"rollout_corr/{name}": value for name, value in metrics.items()}


# --------------------------------------------------------------------------------------------------
# Diagnostics
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def compute_explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of the return variance the critic explains: ``1 - var(R - V) / (var(R) + 1e-5)`` (verl's
    epsilon: with constant returns, as when every score is 0, it keeps the metric near -var(V) * 1e5).

    Variances are masked and unbiased. Shapes: (bs, T) each -> python float (``critic/vf_explained_var``).
    1 is a perfect critic; 0 is no better than a constant; negative is worse than a constant.
    Raises ValueError when the mask holds fewer than 2 tokens.
    """
    residual_var = masked_var(returns - values, mask)
    return_var = masked_var(returns, mask)
    return (1.0 - residual_var / (return_var + EXPLAINED_VAR_EPS)).item()
