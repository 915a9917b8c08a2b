"""rlhf_core.algos against plain numpy (float64) formulas written from the papers and verl's definitions.

One small random batch of ragged responses (padding at the end, one empty row, one tool token masked
inside a response) and groups of 3, 2 and 1 responses. Every expected value below is computed here
token by token or group by group, without calling the module under test; the policy and value losses
are checked on their gradient too, written as the papers' case analysis of the clipped objectives.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlhf_core import algos

T = 6
LENGTHS = [6, 3, 0, 5, 1, 4, 2, 6]
TOOL_TOKEN = (0, 2)  # masked inside row 0's response (tool output)
INDEX = ["a", "a", "a", "b", "b", "c", "d", "d"]  # the empty row 2 belongs to group a; c is alone
PASSK_INDEX = ["a", "a", "a", "b", "b", "b", "d", "d"]


def _mask() -> np.ndarray:
    mask = np.zeros((len(LENGTHS), T))
    for row, length in enumerate(LENGTHS):
        mask[row, :length] = 1.0
    mask[TOOL_TOKEN] = 0.0
    return mask


MASK = _mask()
RNG = np.random.default_rng(20260)
# a reward on every response token (process rewards) plus a larger outcome reward on the last one;
# 0 wherever the mask is 0, as the rollout writes them
REWARDS = MASK * RNG.normal(0.0, 0.3, MASK.shape)
for _row, _length in enumerate(LENGTHS):
    if _length:
        REWARDS[_row, _length - 1] += RNG.choice([0.0, 1.0])
VALUES = RNG.normal(0.0, 0.5, MASK.shape)
OLD_LOG_PROB = -RNG.uniform(0.1, 3.0, MASK.shape)
LOG_RATIO = RNG.normal(0.0, 0.4, MASK.shape)
LOG_RATIO[1, 0], LOG_RATIO[3, 1], LOG_RATIO[6, 1] = 1.5, 1.3, -0.9  # ratios 4.5, 3.7 (beyond the dual clip), 0.41
TOKEN_ADVANTAGES = RNG.normal(0.0, 1.0, MASK.shape)
TOKEN_ADVANTAGES[1, 0], TOKEN_ADVANTAGES[3, 1], TOKEN_ADVANTAGES[6, 1] = -1.0, -0.5, 0.8


def tensor(x) -> torch.Tensor:
    return torch.tensor(np.asarray(x), dtype=torch.float64)


def valid_positions(row: int) -> list[int]:
    return [col for col in range(T) if MASK[row, col]]


def seq_rows() -> list[int]:
    return [row for row in range(len(LENGTHS)) if MASK[row].sum() > 0]


def whiten(x: np.ndarray) -> np.ndarray:
    """(x - mean) / sqrt(var + 1e-8) over the valid tokens with the unbiased variance; 0 elsewhere."""
    values = x[MASK == 1]
    out = (x - values.mean()) / np.sqrt(values.var(ddof=1) + 1e-8)
    return np.where(MASK == 1, out, 0.0)


def on_tokens(per_seq: list[float]) -> np.ndarray:
    return np.asarray(per_seq)[:, None] * MASK


def groups(index: list[str]) -> dict[str, list[int]]:
    members: dict[str, list[int]] = {}
    for row, uid in enumerate(index):
        members.setdefault(uid, []).append(row)
    return members


SCORES = REWARDS.sum(axis=1)


def agg_weights(mode: str) -> np.ndarray:
    """The weight of each token in the aggregated loss: the loss is sum(weight * loss_mat)."""
    rows = seq_rows()
    weights = np.zeros_like(MASK)
    for row in rows:
        length = MASK[row].sum()
        per_token = {
            "token-mean": 1.0 / MASK.sum(),
            "seq-mean-token-sum": 1.0 / len(rows),
            "seq-mean-token-mean": 1.0 / (len(rows) * length),
            "seq-mean-token-sum-norm": 1.0 / (len(rows) * T),  # Dr. GRPO: 1/G and the constant 1/T
        }[mode]
        weights[row] = per_token * MASK[row]
    return weights


# ---------------------------------------------------------------------------------------------------
# Advantage estimators
# ---------------------------------------------------------------------------------------------------


def test_gae_follows_the_papers_sum_over_the_unmasked_future():
    gamma, lam = 0.95, 0.8
    raw = np.zeros_like(MASK)
    for row in range(len(LENGTHS)):
        cols = valid_positions(row)
        for k, col in enumerate(cols):
            # A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t, over response tokens only
            total = 0.0
            for step, j in enumerate(cols[k:]):
                following = cols[k + step + 1] if k + step + 1 < len(cols) else None
                next_value = VALUES[row, following] if following is not None else 0.0
                total += (gamma * lam) ** step * (REWARDS[row, j] + gamma * next_value - VALUES[row, j])
            raw[row, col] = total
    advantages, returns = algos.compute_gae_advantage_return(tensor(REWARDS), tensor(VALUES), tensor(MASK),
                                                             gamma, lam)
    np.testing.assert_allclose(returns.numpy(), (raw + VALUES) * MASK, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(advantages.numpy(), whiten(raw), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_standardises_each_score_within_its_group(norm_by_std):
    expected = []
    for row, uid in enumerate(INDEX):
        members = SCORES[groups(INDEX)[uid]]
        if len(members) == 1:  # verl: mean 0 and std 1 for a group of one
            mean, std = 0.0, 1.0
        else:
            mean, std = members.mean(), members.std(ddof=1)
        expected.append((SCORES[row] - mean) / (std + 1e-6) if norm_by_std else SCORES[row] - mean)
    advantages, returns = algos.compute_advantage("grpo", tensor(REWARDS), tensor(MASK), index=INDEX,
                                                  norm_adv_by_std_in_grpo=norm_by_std)
    np.testing.assert_allclose(advantages.numpy(), on_tokens(expected), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(returns.numpy(), on_tokens(expected), rtol=1e-12, atol=1e-12)


def test_rloo_leaves_each_response_out_of_its_baseline():
    expected = []
    for row, uid in enumerate(INDEX):
        others = [SCORES[j] for j in groups(INDEX)[uid] if j != row]
        expected.append(SCORES[row] - np.mean(others) if others else SCORES[row])
    advantages, _ = algos.compute_advantage("rloo", tensor(REWARDS), tensor(MASK), index=INDEX)
    np.testing.assert_allclose(advantages.numpy(), on_tokens(expected), rtol=1e-12, atol=1e-12)


def test_reinforce_plus_plus_whitens_the_discounted_return():
    gamma = 0.9
    returns = np.zeros_like(MASK)
    for row in range(len(LENGTHS)):
        cols = valid_positions(row)
        for k, col in enumerate(cols):  # the masked tool token is skipped, not discounted (README)
            returns[row, col] = sum(gamma ** step * REWARDS[row, j] for step, j in enumerate(cols[k:]))
    advantages, got_returns = algos.compute_advantage("reinforce_plus_plus", tensor(REWARDS), tensor(MASK),
                                                      gamma=gamma)
    np.testing.assert_allclose(got_returns.numpy(), returns, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(advantages.numpy(), whiten(returns), rtol=1e-10, atol=1e-12)


def test_reinforce_plus_plus_baseline_centres_in_the_group_then_whitens_over_the_batch():
    centred = []
    for row, uid in enumerate(INDEX):
        members = SCORES[groups(INDEX)[uid]]
        centred.append(SCORES[row] - (members.mean() if len(members) > 1 else 0.0))
    advantages, _ = algos.compute_advantage("reinforce_plus_plus_baseline", tensor(REWARDS), tensor(MASK),
                                            index=INDEX)
    np.testing.assert_allclose(advantages.numpy(), whiten(on_tokens(centred)), rtol=1e-10, atol=1e-12)


def test_remax_is_the_reward_to_go_minus_the_greedy_score():
    baselines = np.random.default_rng(1).normal(0.0, 1.0, len(LENGTHS))
    expected = np.zeros_like(MASK)
    for row in range(len(LENGTHS)):
        cols = valid_positions(row)
        for k, col in enumerate(cols):
            expected[row, col] = sum(REWARDS[row, j] for j in cols[k:]) - baselines[row]
    advantages, _ = algos.compute_advantage("remax", tensor(REWARDS), tensor(MASK),
                                            reward_baselines=tensor(baselines))
    np.testing.assert_allclose(advantages.numpy(), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_passk_credits_the_best_response_with_its_lead(norm_by_std):
    expected = np.zeros(len(LENGTHS))
    for rows in groups(PASSK_INDEX).values():
        members = SCORES[rows]
        best, second = np.sort(members)[::-1][:2]
        lead = best - second
        expected[rows[int(np.argmax(members))]] = lead / (members.std(ddof=1) + 1e-6) if norm_by_std else lead
    advantages, _ = algos.compute_advantage("grpo_passk", tensor(REWARDS), tensor(MASK), index=PASSK_INDEX,
                                            norm_adv_by_std_in_grpo=norm_by_std)
    np.testing.assert_allclose(advantages.numpy(), on_tokens(list(expected)), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# Losses: value and gradient
# ---------------------------------------------------------------------------------------------------

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _loss_and_grad(fn, *args, **kwargs):
    log_prob = tensor(OLD_LOG_PROB + LOG_RATIO).requires_grad_(True)
    loss, metrics = fn(tensor(OLD_LOG_PROB), log_prob, *args, **kwargs)
    loss.backward()
    return loss.item(), log_prob.grad.numpy(), metrics


@pytest.mark.parametrize("mode", MODES)
def test_vanilla_ppo_with_dual_clip(mode):
    low, high, c = 0.2, 0.28, 3.0
    ratio, adv = np.exp(LOG_RATIO), TOKEN_ADVANTAGES
    # PPO (Schulman et al. 2017): min(r A, clip(r) A); dual clip (Ye et al. 2020) for A < 0: max(that, c A)
    objective = np.minimum(ratio * adv, np.clip(ratio, 1 - low, 1 + high) * adv)
    objective = np.where(adv < 0, np.maximum(objective, c * adv), objective)
    # d objective / d log_prob = r A where the unclipped term is the one taken, else 0
    live = np.where(adv > 0, ratio < 1 + high, (ratio > 1 - low) & (ratio < c))
    weights = agg_weights(mode)
    loss, grad, metrics = _loss_and_grad(algos.compute_policy_loss, tensor(adv), tensor(MASK), clip_ratio=0.2,
                                         clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c,
                                         loss_agg_mode=mode)
    assert loss == pytest.approx(-(weights * objective).sum(), rel=1e-12)
    np.testing.assert_allclose(grad, -weights * np.where(live, ratio * adv, 0.0), rtol=1e-12, atol=1e-15)
    valid = MASK == 1
    clipped = (adv > 0) & (ratio > 1 + high) | (adv < 0) & (ratio < 1 - low)
    dual = (adv < 0) & (ratio > c)
    assert dual[valid].sum() == 2  # the batch does exercise the dual clip
    assert metrics["actor/pg_clipfrac"] == pytest.approx(clipped[valid].mean())
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(dual[valid].mean())
    assert metrics["actor/ppo_kl"] == pytest.approx(-LOG_RATIO[valid].mean())


def test_gspo_clips_the_length_normalised_sequence_ratio():
    low, high = 0.1, 0.15
    seq_adv = np.random.default_rng(2).normal(0.0, 1.0, len(LENGTHS))
    rows = seq_rows()
    expected_loss, expected_grad = 0.0, np.zeros_like(MASK)
    clipped_tokens = 0
    for row in rows:
        cols = valid_positions(row)
        s = np.exp(np.mean(LOG_RATIO[row, cols]))  # s_i = (pi / pi_old)^(1 / |y_i|)
        a = seq_adv[row]
        expected_loss -= min(s * a, np.clip(s, 1 - low, 1 + high) * a) / len(rows)
        live = s < 1 + high if a > 0 else s > 1 - low
        clipped_tokens += 0 if live else len(cols)
        # d s_i / d log pi_t = s_i / |y_i| (the paper's eq. 10 gradient)
        expected_grad[row, cols] = -a * s / len(cols) / len(rows) if live else 0.0
    loss, grad, metrics = _loss_and_grad(algos.compute_policy_loss_gspo, tensor(on_tokens(list(seq_adv))),
                                         tensor(MASK), clip_ratio_low=low, clip_ratio_high=high)
    assert 0 < clipped_tokens < MASK.sum()  # some sequences clipped, some not
    assert loss == pytest.approx(expected_loss, rel=1e-12)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-12, atol=1e-15)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(clipped_tokens / MASK.sum())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_cispo_weighs_log_prob_by_the_truncated_ratio(mode):
    low, high = 0.2, 0.5
    weight = np.clip(np.exp(LOG_RATIO), 1 - low, 1 + high)  # stop-gradient: a constant of the loss
    log_prob = OLD_LOG_PROB + LOG_RATIO
    weights = agg_weights(mode)
    loss, grad, _ = _loss_and_grad(algos.compute_policy_loss_cispo, tensor(TOKEN_ADVANTAGES), tensor(MASK),
                                   clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode=mode)
    assert loss == pytest.approx(-(weights * weight * TOKEN_ADVANTAGES * log_prob).sum(), rel=1e-12)
    np.testing.assert_allclose(grad, -weights * weight * TOKEN_ADVANTAGES, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("mode", MODES)
def test_clipped_value_loss(mode):
    clip = 0.2
    rng = np.random.default_rng(3)
    returns = rng.normal(0.0, 1.0, MASK.shape)
    vpreds_np = VALUES + rng.normal(0.0, 0.3, MASK.shape)
    clipped = np.clip(vpreds_np, VALUES - clip, VALUES + clip)
    unclipped_err, clipped_err = (vpreds_np - returns) ** 2, (clipped - returns) ** 2
    weights = agg_weights(mode)
    vpreds = tensor(vpreds_np).requires_grad_(True)
    loss, clipfrac = algos.compute_value_loss(vpreds, tensor(returns), tensor(VALUES), tensor(MASK), clip, mode)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * (weights * np.maximum(unclipped_err, clipped_err)).sum(), rel=1e-12)
    # the clipped term is flat in vpreds once vpreds is outside the range
    live = unclipped_err >= clipped_err
    np.testing.assert_allclose(vpreds.grad.numpy(), weights * np.where(live, vpreds_np - returns, 0.0),
                               rtol=1e-12, atol=1e-15)
    assert clipfrac == pytest.approx((clipped_err > unclipped_err)[MASK == 1].mean())


# ---------------------------------------------------------------------------------------------------
# KL in the reward and its controller
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kl_type", ["kl", "abs", "mse", "low_var_kl"])
def test_kl_penalty_in_the_reward_and_the_adaptive_coefficient(kl_type):
    ref = OLD_LOG_PROB - np.random.default_rng(4).normal(0.0, 0.5, MASK.shape)
    d = OLD_LOG_PROB - ref  # log pi - log pi_ref
    per_token = {"kl": d, "abs": np.abs(d), "mse": 0.5 * d ** 2,
                 "low_var_kl": np.clip(np.exp(-d) + d - 1, -10, 10)}[kl_type] * MASK
    beta, target, horizon = 0.05, 0.02, 50.0
    ctrl = algos.AdaptiveKLController(beta, target, horizon)
    rewards, batch_kl, _ = algos.apply_kl_penalty(tensor(REWARDS), tensor(OLD_LOG_PROB), tensor(ref),
                                                  tensor(MASK), ctrl, kl_type)
    np.testing.assert_allclose(rewards.numpy(), REWARDS - beta * per_token, rtol=1e-12, atol=1e-15)
    # the mean over every row (an empty one counts as 0, as verl's) of each row's token mean
    counts = MASK.sum(axis=1)
    row_means = np.where(counts > 0, per_token.sum(axis=1) / np.maximum(counts, 1), 0.0)
    assert batch_kl == pytest.approx(row_means.mean(), rel=1e-12)
    # Ziegler et al. 2019: e = clip(KL / target - 1, -0.2, 0.2), beta *= 1 + e * n_steps / horizon
    error = np.clip(row_means.mean() / target - 1, -0.2, 0.2)
    assert ctrl.value == pytest.approx(beta * (1 + error * len(LENGTHS) / horizon), rel=1e-12)
