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
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "ADV_ESTIMATORS",
    "ADV_ESTIMATORS_NEED_CRITIC",
    "KL_CTRL_TYPES",
    "KL_TYPES",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_explained_variance",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator",
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

    With ``shift_mean=False`` the mean is added back, so only the scale changes.
    Shapes: ``x`` and ``mask`` (bs, T) -> (bs, T). Values at masked positions are not meaningful.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)  # (bs, T)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


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
KL_TYPES: tuple[str, ...] = tuple(_KL_ESTIMATORS)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman 2020).

    ``kl_type`` is one of ``KL_TYPES``: ``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3``.
    Shapes: (bs, T), (bs, T) -> (bs, T). Keeps the autograd graph (used as the actor's KL loss too).
    """
    try:
        estimator = _KL_ESTIMATORS[kl_type]
    except KeyError:
        raise ValueError(f"unknown kl_type {kl_type!r}; valid kl types are {', '.join(KL_TYPES)}") from None
    return estimator(log_prob, ref_log_prob)


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
}
LOSS_AGG_MODES: tuple[str, ...] = tuple(_LOSS_AGGREGATORS)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    global_token_count: Count = None,
    global_seq_count: Count = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix (bs, T) to a scalar.

    Modes (``LOSS_AGG_MODES``):
        - ``token-mean``: masked mean over every token of the batch.
        - ``seq-mean-token-sum``: masked sum per sequence, then the mean over sequences with >= 1 token.
        - ``seq-mean-token-mean``: masked mean per sequence, then the mean over sequences with >= 1 token.

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
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO surrogate (Schulman et al. 2017, eq. 7) with dual clip (Ye et al. 2020).

    The ratio is clipped to ``[1 - clip_ratio_low, 1 + clip_ratio_high]`` (both default to ``clip_ratio``).
    For negative advantages the loss is further bounded by ``-A * clip_ratio_c``.

    Args:
        old_log_prob: (bs, T) log-probs of the sampled tokens under the rollout policy.
        log_prob: (bs, T) log-probs under the current policy (carries gradient).
        advantages: (bs, T).
        response_mask: (bs, T).
        clip_ratio, clip_ratio_low, clip_ratio_high: PPO clip range.
        clip_ratio_c: dual-clip bound, must be > 1.
        loss_agg_mode: see ``agg_loss``; ``agg_kwargs`` (global counts) are passed to it.

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


def _group_ids(index: Sequence[Hashable], batch_size: int, device: torch.device) -> torch.Tensor:
    """Map each row's group id (any hashable) to a dense integer id. -> (bs,) long."""
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
    scores = _sequence_scores(token_level_rewards, response_mask)  # (bs,)
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
    advantages = _zero_where_masked(
        seq_advantages.unsqueeze(-1).expand_as(token_level_rewards), response_mask
    )
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
    scores = _sequence_scores(token_level_rewards, response_mask)  # (bs,)
    group_ids = _group_ids(index, scores.shape[0], scores.device)  # (bs,)
    group_size = _group_sum(torch.ones_like(scores), group_ids)  # (bs,)
    others_sum = _group_sum(scores, group_ids) - scores  # (bs,)
    singleton = group_size < 2
    others_mean = others_sum / torch.where(singleton, torch.ones_like(group_size), group_size - 1)
    seq_advantages = torch.where(singleton, scores, scores - others_mean)  # (bs,)
    advantages = _zero_where_masked(
        seq_advantages.unsqueeze(-1).expand_as(token_level_rewards), response_mask
    )
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


# --------------------------------------------------------------------------------------------------
# Advantage estimator registry
# --------------------------------------------------------------------------------------------------

ADV_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "gae": compute_gae_advantage_return,
    "grpo": compute_grpo_outcome_advantage,
    "rloo": compute_rloo_outcome_advantage,
    "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage,
}
ADV_ESTIMATORS_NEED_CRITIC = frozenset({"gae"})

# The arguments of ``compute_advantage`` each estimator takes besides ``token_level_rewards`` and
# ``response_mask``.
_ADV_ESTIMATOR_ARGS: dict[str, tuple[str, ...]] = {
    "gae": ("values", "gamma", "lam"),
    "grpo": ("index", "norm_adv_by_std_in_grpo"),
    "rloo": ("index",),
    "reinforce_plus_plus": ("gamma",),
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator named ``adv_estimator`` with the arguments it takes.

    ``gae`` needs ``values`` (bs, T); ``grpo`` and ``rloo`` need ``index`` (bs group ids). Arguments an
    estimator does not take are ignored. Returns ``(advantages, returns)``, both (bs, T).
    """
    estimator = get_adv_estimator(adv_estimator)
    available = {
        "values": values,
        "index": index,
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
# Diagnostics
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def compute_explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of the return variance the critic explains: ``1 - var(R - V) / (var(R) + 1e-8)``.

    Variances are masked and unbiased. Shapes: (bs, T) each -> python float (``critic/vf_explained_var``).
    1 is a perfect critic; 0 is no better than a constant; negative is worse than a constant.
    Raises ValueError when the mask holds fewer than 2 tokens.
    """
    residual_var = masked_var(returns - values, mask)
    return_var = masked_var(returns, mask)
    return (1.0 - residual_var / (return_var + WHITEN_EPS)).item()
