"""Tests for rlhf_core.algos: golden values by hand or by plain python reference loops, plus properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_core import algos
from rlhf_core.algos import (
    ADV_ESTIMATORS,
    ADV_ESTIMATORS_NEED_CRITIC,
    KL_TYPES,
    LOSS_AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    compute_advantage,
    compute_explained_variance,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_policy_loss,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_value_loss,
    entropy_from_logits,
    get_adv_estimator,
    kl_controller_from_state,
    kl_penalty,
    logprobs_from_logits,
    make_kl_controller,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

FAST = settings(max_examples=50, deadline=None)

# A small masked batch used throughout: row 0 has a masked token in the middle (tool output),
# row 1 is padded at the end, row 2 is fully unmasked.
MASK = [
    [1, 1, 0, 1],
    [1, 1, 1, 0],
    [1, 1, 1, 1],
]
REWARDS = [
    [0.0, 0.5, 0.0, 1.0],
    [0.0, 0.0, 2.0, 0.0],
    [0.1, -0.2, 0.0, -1.0],
]
VALUES = [
    [0.3, 0.1, 0.7, 0.5],
    [-0.4, 0.2, 0.6, 0.0],
    [0.0, 0.5, -0.5, 0.25],
]


def t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def poison_masked(x: torch.Tensor, mask: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    """``x`` with every masked position replaced by ``value``."""
    return torch.where(mask != 0, x, torch.full_like(x, value))


# ---------------------------------------------------------------------------------------------------
# Plain-python reference implementations (no calls into the module under test)
# ---------------------------------------------------------------------------------------------------


def ref_mean_var(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, var


def ref_whiten(rows: list[list[float]], mask: list[list[int]]) -> list[list[float]]:
    valid = [x for row, m in zip(rows, mask) for x, keep in zip(row, m) if keep]
    mean, var = ref_mean_var(valid)
    return [
        [(x - mean) / math.sqrt(var + 1e-8) if keep else 0.0 for x, keep in zip(row, m)]
        for row, m in zip(rows, mask)
    ]


def ref_gae_row(
    rewards: list[float], values: list[float], mask: list[int], gamma: float, lam: float
) -> list[float]:
    """GAE over the unmasked tokens only, written as the paper's forward sum over the future."""
    positions = [i for i, keep in enumerate(mask) if keep]
    r = [rewards[i] for i in positions]
    v = [values[i] for i in positions] + [0.0]
    deltas = [r[k] + gamma * v[k + 1] - v[k] for k in range(len(r))]
    adv = [sum((gamma * lam) ** (j - k) * deltas[j] for j in range(k, len(r))) for k in range(len(r))]
    out = [0.0] * len(rewards)
    for k, i in enumerate(positions):
        out[i] = adv[k]
    return out


def ref_reward_to_go_row(rewards: list[float], mask: list[int], gamma: float) -> list[float]:
    positions = [i for i, keep in enumerate(mask) if keep]
    r = [rewards[i] for i in positions]
    out = [0.0] * len(rewards)
    for k, i in enumerate(positions):
        out[i] = sum(gamma ** (j - k) * r[j] for j in range(k, len(r)))
    return out


# ---------------------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------------------


def test_masked_sum_mean_golden():
    x = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = t([[1, 0, 1], [0, 0, 1]])
    assert masked_sum(x, mask).item() == pytest.approx(10.0)
    assert masked_mean(x, mask).item() == pytest.approx(10.0 / 3)
    assert masked_sum(x, mask, dim=-1).tolist() == pytest.approx([4.0, 6.0])
    assert masked_mean(x, mask, dim=-1).tolist() == pytest.approx([2.0, 6.0])
    assert masked_mean(x, mask, dim=0).tolist() == pytest.approx([1.0, 0.0, 4.5])


def test_masked_var_golden_and_bool_mask():
    x = t([[1.0, 2.0, 100.0], [4.0, -7.0, 6.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # values 1, 2, 4: mean 7/3, unbiased var = ((4/3)^2 + (1/3)^2 + (5/3)^2) / 2 = 7/3
    assert masked_var(x, mask).item() == pytest.approx(7.0 / 3)


@pytest.mark.parametrize("mask", [[[0, 0], [0, 0]], [[0, 1], [0, 0]]])
def test_masked_var_needs_two_tokens(mask):
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(t([[1.0, 2.0], [3.0, 4.0]]), t(mask))


def test_masked_stats_ignore_values_under_mask():
    x = t(REWARDS)
    mask = t(MASK)
    poisoned = poison_masked(x, mask)
    assert masked_mean(poisoned, mask).item() == pytest.approx(masked_mean(x, mask).item())
    assert masked_var(poisoned, mask).item() == pytest.approx(masked_var(x, mask).item())
    valid = mask.bool()
    assert torch.allclose(masked_whiten(poisoned, mask)[valid], masked_whiten(x, mask)[valid])


def test_masked_whiten_golden():
    whitened = masked_whiten(t(REWARDS), t(MASK))
    expected = ref_whiten(REWARDS, MASK)
    valid = t(MASK).bool()
    assert torch.allclose(whitened[valid], t(expected)[valid])


def test_masked_whiten_without_shift_keeps_mean():
    x = t([[1.0, 3.0, 5.0]])
    mask = t([[1, 1, 1]])
    out = masked_whiten(x, mask, shift_mean=False)
    # mean 3, unbiased var 4 -> (x - 3) / 2 + 3
    assert out.tolist()[0] == pytest.approx([2.0, 3.0, 4.0])


def test_equal_returns_whiten_to_zero_advantages_not_to_float32_rounding():
    # every response scores 0.98 (not exact in binary) and gamma = lam = 1: every token's return is 0.98, so
    # the mean is 0.98 and every advantage 0 (in float32 the mean's rounding, divided by sqrt(1e-8), gave 1e-3)
    mask = torch.ones(16, 37)
    mask[3, 20:] = 0
    rewards = torch.zeros(16, 37)
    rewards[:, -1] = 0.98
    rewards[3, -1], rewards[3, 19] = 0.0, 0.98
    reinforce, returns = algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=1.0)
    gae, _ = compute_gae_advantage_return(rewards, torch.zeros(16, 37), mask, gamma=1.0, lam=1.0)
    assert torch.all(returns[mask.bool()] == torch.tensor(0.98))
    assert reinforce.dtype == gae.dtype == torch.float32
    assert reinforce.abs().max().item() < 1e-9 and gae.abs().max().item() < 1e-9


def test_masked_whiten_of_fewer_than_two_tokens_centres_only():
    x = t([[3.0, 7.0], [-2.0, 5.0]])
    # one token: its own mean, so 0 there (no variance to scale by); without the shift it is left as it is
    assert masked_whiten(x, t([[0, 1], [0, 0]]))[0, 1].item() == 0.0
    assert masked_whiten(x, t([[0, 1], [0, 0]]), shift_mean=False)[0, 1].item() == 7.0
    # no token: nothing to whiten and no error
    assert torch.isfinite(masked_whiten(x, torch.zeros(2, 2, dtype=torch.float64))).all()


@pytest.mark.parametrize("estimator", ["gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_whitened_estimators_on_a_batch_of_one_token_or_none(estimator):
    # one response token in the batch (row 0, col 0): reward 1.5, value 0.25, gamma 0.9, lam 0.8.
    # GAE: A = 1.5 + 0.9 * 0 - 0.25 = 1.25, return A + V = 1.5; REINFORCE++: G = 1.5; the baseline variant:
    # row 0 is alone in its group (baseline 0), 1.5. Whitened over one token, each advantage is 0.
    rewards = t([[1.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    values = t([[0.25, 0.5, 0.5], [0.5, 0.5, 0.5]])
    one = t([[1, 0, 0], [0, 0, 0]])
    advantages, returns = algos.compute_advantage(estimator, rewards, one, values=values, index=["a", "b"],
                                                  gamma=0.9, lam=0.8)
    assert advantages.tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    expected_return = 0.0 if estimator == "reinforce_plus_plus_baseline" else 1.5  # its returns are its advantages
    assert returns.tolist() == [[expected_return, 0.0, 0.0], [0.0, 0.0, 0.0]]
    # no token at all (every response aborted before its first token): zeros, no error
    advantages, returns = algos.compute_advantage(estimator, rewards * 0, one * 0, values=values, index=["a", "b"],
                                                  gamma=0.9, lam=0.8)
    assert advantages.tolist() == returns.tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


@st.composite
def masked_batches(draw, min_valid: int = 2):
    bs = draw(st.integers(1, 4))
    length = draw(st.integers(2, 6))
    values = draw(st.lists(st.floats(-10, 10), min_size=bs * length, max_size=bs * length))
    mask = draw(st.lists(st.booleans(), min_size=bs * length, max_size=bs * length))
    x = t(values).reshape(bs, length)
    m = torch.tensor(mask).reshape(bs, length)
    if int(m.sum()) < min_valid:
        m = torch.ones_like(m)
    return x, m


@FAST
@given(masked_batches())
def test_masked_whiten_has_zero_mean_unit_variance(batch):
    x, mask = batch
    if masked_var(x, mask).item() < 1e-3:  # a (near) constant input has nothing to rescale
        return
    whitened = masked_whiten(x, mask)
    assert masked_mean(whitened, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_var(whitened, mask).item() == pytest.approx(1.0, rel=1e-4)


# ---------------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------------


def test_gae_matches_reference_with_mid_response_mask():
    gamma, lam = 0.9, 0.8
    advantages, returns = compute_gae_advantage_return(t(REWARDS), t(VALUES), t(MASK), gamma, lam)
    raw = [ref_gae_row(r, v, m, gamma, lam) for r, v, m in zip(REWARDS, VALUES, MASK)]
    expected_returns = [
        [a + v if keep else 0.0 for a, v, keep in zip(ra, rv, rm)] for ra, rv, rm in zip(raw, VALUES, MASK)
    ]
    assert torch.allclose(returns, t(expected_returns))
    assert torch.allclose(advantages, t(ref_whiten(raw, MASK)))
    assert (advantages[t(MASK) == 0] == 0).all() and (returns[t(MASK) == 0] == 0).all()


def test_gae_one_row_by_hand():
    # rewards [0, 1], values [0.5, 0.2], gamma 0.5, lam 1:
    # delta_1 = 1 + 0 - 0.2 = 0.8, delta_0 = 0 + 0.5 * 0.2 - 0.5 = -0.4, A_0 = -0.4 + 0.5 * 0.8 = 0
    # the middle token is masked and skipped.
    rewards = t([[0.0, 9.0, 1.0], [0.0, 0.0, 0.0]])
    values = t([[0.5, 9.0, 0.2], [0.0, 0.0, 0.0]])
    mask = t([[1, 0, 1], [0, 0, 0]])
    _, returns = compute_gae_advantage_return(rewards, values, mask, gamma=0.5, lam=1.0)
    assert returns[0].tolist() == pytest.approx([0.5, 0.0, 1.0])


@pytest.mark.parametrize("gamma, raw", [
    # lam = 0: each advantage is its one-step TD error r_t + gamma * V(next response token) - V_t;
    # token 2 (tool output) and token 4 (padding) are masked: V_next of token 1 is token 3's 0.4, of token 3 is 0
    (0.5, [0.0 + 0.5 * 0.3 - 0.5, 0.0 + 0.5 * 0.4 - 0.3, 1.0 + 0.5 * 0.0 - 0.4]),  # -0.35, -0.1, 0.6
    (1.0, [0.0 + 0.3 - 0.5, 0.0 + 0.4 - 0.3, 1.0 - 0.4]),  # -0.2, 0.1, 0.6
])
def test_gae_with_lambda_zero_is_the_td_error_by_hand(gamma, raw):
    rewards = t([[0.0, 0.0, 9.0, 1.0, 4.0]])
    values = t([[0.5, 0.3, 7.0, 0.4, 3.0]])
    mask = t([[1, 1, 0, 1, 0]])
    advantages, returns = compute_gae_advantage_return(rewards, values, mask, gamma=gamma, lam=0.0)
    assert returns[0].tolist() == pytest.approx([raw[0] + 0.5, raw[1] + 0.3, 0.0, raw[2] + 0.4, 0.0])
    mean = sum(raw) / 3
    std = math.sqrt(sum((a - mean) ** 2 for a in raw) / 2 + 1e-8)
    whitened = [(a - mean) / std for a in raw]
    assert advantages[0].tolist() == pytest.approx([whitened[0], whitened[1], 0.0, whitened[2], 0.0])


def test_gae_ignores_masked_values_and_rewards():
    mask = t(MASK)
    clean = compute_gae_advantage_return(t(REWARDS), t(VALUES), mask, 0.95, 0.9)
    poisoned = compute_gae_advantage_return(
        poison_masked(t(REWARDS), mask, 1e6), poison_masked(t(VALUES), mask, -1e6), mask, 0.95, 0.9
    )
    for a, b in zip(clean, poisoned):
        assert torch.equal(a, b)


def test_gae_has_no_gradient():
    values = t(VALUES).requires_grad_()
    advantages, returns = compute_gae_advantage_return(t(REWARDS), values, t(MASK), 1.0, 1.0)
    assert not advantages.requires_grad and not returns.requires_grad


@FAST
@given(masked_batches(), st.booleans())
def test_gae_with_unit_gamma_lambda_returns_reward_to_go(batch, use_mask):
    rewards, drawn_mask = batch
    mask = drawn_mask.double() if use_mask else torch.ones_like(rewards)
    values = torch.linspace(-1, 1, rewards.numel(), dtype=rewards.dtype).reshape(rewards.shape)
    advantages, returns = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=1.0)
    reward_to_go = t([ref_reward_to_go_row(r, m, 1.0) for r, m in zip(rewards.tolist(), mask.int().tolist())])
    assert torch.allclose(returns, reward_to_go, atol=1e-9)
    # the advantages are the whitened raw GAE, i.e. whitened (reward-to-go - values)
    raw_gae = (reward_to_go - values) * mask
    assert torch.allclose(advantages, t(ref_whiten(raw_gae.tolist(), mask.int().tolist())), atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# KL penalty
# ---------------------------------------------------------------------------------------------------


def test_kl_penalty_golden():
    lp = t([[-1.0, -2.0]])
    ref = t([[-1.5, -1.0]])
    d = [0.5, -1.0]  # lp - ref
    for name in ("kl", "k1"):
        assert kl_penalty(lp, ref, name)[0].tolist() == pytest.approx(d)
    assert kl_penalty(lp, ref, "abs")[0].tolist() == pytest.approx([0.5, 1.0])
    for name in ("mse", "k2"):
        assert kl_penalty(lp, ref, name)[0].tolist() == pytest.approx([0.125, 0.5])
    k3 = [math.exp(-x) + x - 1 for x in d]  # k = ref - lp = -d
    for name in ("low_var_kl", "k3"):
        assert kl_penalty(lp, ref, name)[0].tolist() == pytest.approx(k3)


def test_low_var_kl_is_clamped():
    lp = t([[0.0, -50.0]])
    ref = t([[-50.0, 0.0]])
    out = kl_penalty(lp, ref, "low_var_kl")[0].tolist()
    # ref - lp = -50 -> clamp -20 -> exp(-20) + 19 ~ 19 -> clamp 10; ref - lp = 50 -> huge -> 10
    assert out == pytest.approx([10.0, 10.0])


def test_kl_types_listed_and_unknown_rejected():
    base = {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}
    assert set(KL_TYPES) == base | {f"{name}+" for name in base}
    with pytest.raises(ValueError, match="unknown kl_type 'bogus'.*low_var_kl"):
        kl_penalty(t([0.0]), t([0.0]), "bogus")


def test_kl_with_plus_has_its_estimators_value():
    # verl's straight-through estimators: the value of the one named (here k3 at ref - lp = -0.5 and 1:
    # exp(-0.5) + 0.5 - 1 and e - 2), the gradient of k2 (tested below)
    lp, ref = t([[-1.0, -2.0]]), t([[-1.5, -1.0]])
    assert kl_penalty(lp, ref, "k3+")[0].tolist() == pytest.approx([math.exp(-0.5) - 0.5, math.e - 2])
    assert kl_penalty(lp, ref, "kl+")[0].tolist() == pytest.approx([0.5, -1.0])


# d = lp - ref per token: 0.5, -1.0, then two where low_var_kl's clamps hold: ref - lp = 3 (exp(3) - 4 = 16.1,
# clamped to 10) and ref - lp = -50 (clamped to -20 before exp: exp(-20) + 19 ~ 19, clamped to 10)
KL_GRAD_LP = [[-1.0, -2.0, -3.0, 0.0]]
KL_GRAD_REF = [[-1.5, -1.0, 0.0, -50.0]]
KL_GRADIENTS = {
    # k1 = lp - ref: d/dlp = 1
    "kl": [1.0, 1.0, 1.0, 1.0],
    "k1": [1.0, 1.0, 1.0, 1.0],
    # |lp - ref|: d/dlp = sign(lp - ref)
    "abs": [1.0, -1.0, -1.0, 1.0],
    # k2 = (lp - ref)^2 / 2: d/dlp = lp - ref
    "mse": [0.5, -1.0, -3.0, 50.0],
    "k2": [0.5, -1.0, -3.0, 50.0],
    # k3 = exp(ref - lp) - (ref - lp) - 1: d/dlp = 1 - exp(ref - lp); 0 where a clamp holds (the last two)
    "low_var_kl": [1 - math.exp(-0.5), 1 - math.exp(1.0), 0.0, 0.0],
    "k3": [1 - math.exp(-0.5), 1 - math.exp(1.0), 0.0, 0.0],
}


def test_kl_gradients_cover_every_estimator():
    assert {name.removesuffix("+") for name in KL_TYPES} == set(KL_GRADIENTS)


@pytest.mark.parametrize("name", KL_TYPES)
def test_kl_penalty_gradient_by_hand(name):
    lp = t(KL_GRAD_LP).requires_grad_()
    kl_penalty(lp, t(KL_GRAD_REF), name).sum().backward()
    # a name with "+" (verl's straight-through estimators) has k2's gradient, lp - ref, whatever its value
    expected = KL_GRADIENTS["k2"] if name.endswith("+") else KL_GRADIENTS[name]
    assert lp.grad[0].tolist() == pytest.approx(expected)


log_probs = st.lists(st.floats(-8, 0), min_size=1, max_size=8)


@FAST
@given(log_probs, st.data())
def test_kl_estimators_zero_at_equality_and_k2_k3_non_negative(lp_list, data):
    lp = t(lp_list)
    ref = t(data.draw(st.lists(st.floats(-8, 0), min_size=len(lp_list), max_size=len(lp_list))))
    for name in KL_TYPES:
        assert torch.equal(kl_penalty(lp, lp, name), torch.zeros_like(lp))
    for name in ("k2", "mse", "k3", "low_var_kl", "abs"):
        assert (kl_penalty(lp, ref, name) >= 0).all()


# ---------------------------------------------------------------------------------------------------
# Loss aggregation
# ---------------------------------------------------------------------------------------------------

LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
LOSS_MASK = [[1, 1, 0], [0, 0, 0], [1, 1, 1]]


def test_agg_loss_golden():
    loss, mask = t(LOSS), t(LOSS_MASK)
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx((1 + 2 + 7 + 8 + 9) / 5)
    # the empty second row does not count as a sequence
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 24) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 8) / 2)


def test_agg_loss_ignores_values_under_mask():
    mask = t(LOSS_MASK)
    poisoned = poison_masked(t(LOSS), mask)
    for mode in LOSS_AGG_MODES:
        assert agg_loss(poisoned, mask, mode).item() == pytest.approx(agg_loss(t(LOSS), mask, mode).item())


def test_agg_loss_all_masked_is_zero():
    for mode in LOSS_AGG_MODES:
        assert agg_loss(t(LOSS), torch.zeros(3, 3), mode).item() == 0.0


def test_agg_loss_unknown_mode():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'seq-sum'.*token-mean"):
        agg_loss(t(LOSS), t(LOSS_MASK), "seq-sum")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("micro_batch_size", [1, 2, 3])
def test_micro_batch_losses_with_global_counts_sum_to_full_batch_loss(mode, micro_batch_size):
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=gen) > 0.4).double()
    mask[4] = 0  # one empty sequence
    full = agg_loss(loss, mask, mode)
    global_counts = {"global_token_count": mask.sum(), "global_seq_count": int((mask.sum(-1) > 0).sum())}
    accumulated = sum(
        agg_loss(loss[i : i + micro_batch_size], mask[i : i + micro_batch_size], mode, **global_counts)
        for i in range(0, 6, micro_batch_size)
    )
    assert accumulated.item() == pytest.approx(full.item(), rel=1e-12)


def test_policy_loss_micro_batches_with_global_count_match_full_batch():
    gen = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 6, generator=gen, dtype=torch.float64)
    new = old + 0.3 * torch.randn(4, 6, generator=gen, dtype=torch.float64)
    adv = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = (torch.rand(4, 6, generator=gen) > 0.3).double()
    full, _ = compute_policy_loss(old, new, adv, mask)
    count = mask.sum()
    parts = [
        compute_policy_loss(
            old[i : i + 1], new[i : i + 1], adv[i : i + 1], mask[i : i + 1], global_token_count=count
        )[0]
        for i in range(4)
    ]
    assert sum(parts).item() == pytest.approx(full.item(), rel=1e-12)


# ---------------------------------------------------------------------------------------------------
# Policy loss
# ---------------------------------------------------------------------------------------------------


def test_policy_loss_golden():
    # token 0: A=1, ratio=1.5 -> clipped at 1.2: max(-1.5, -1.2) = -1.2 (clipped)
    # token 1: A=-1, ratio=0.5 -> max(0.5, 0.8) = 0.8 (clipped); dual clip bound 3 not hit
    # token 2: A=2, ratio=1.1 -> -2.2 (inside the range)
    # token 3: masked
    ratios = [1.5, 0.5, 1.1, 7.0]
    old = t([[-1.0, -1.0, -1.0, -1.0]])
    new = old + t([[math.log(r) for r in ratios]])
    adv = t([[1.0, -1.0, 2.0, 5.0]])
    mask = t([[1, 1, 1, 0]])
    loss, metrics = compute_policy_loss(old, new, adv, mask, clip_ratio=0.2)
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.2) / 3)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 3)
    assert metrics["actor/ppo_kl"] == pytest.approx(-sum(math.log(r) for r in ratios[:3]) / 3)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    assert all(isinstance(v, float) for v in metrics.values())


def test_policy_loss_dual_clip_by_hand():
    # A = -1, ratio = 5: PPO gives max(5, 1.2) = 5, dual clip caps it at -A * c = 3.
    old = t([[0.0, 0.0]])
    new = t([[math.log(5.0), 0.0]])
    adv = t([[-1.0, 0.0]])
    mask = t([[1, 0]])
    loss, metrics = compute_policy_loss(old, new, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(3.0)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1.0)
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/ppo_kl"] == pytest.approx(-math.log(5.0))


def test_policy_loss_asymmetric_clip():
    # A = 1, ratio 1.25: inside [1 - 0.2, 1 + 0.28] so not clipped; ratio 0.75 with A=-1 is clipped at 0.8.
    old = t([[0.0, 0.0]])
    new = t([[math.log(1.25), math.log(0.75)]])
    adv = t([[1.0, -1.0]])
    loss, metrics = compute_policy_loss(old, new, adv, t([[1, 1]]), clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert loss.item() == pytest.approx((-1.25 + 0.8) / 2)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)


def test_policy_loss_keeps_graph_and_ignores_masked_tokens():
    old = t([[-1.0, -2.0, -0.5]])
    new = t([[-0.9, -2.1, -0.5]]).requires_grad_()
    adv = t([[0.5, -0.3, 1.0]])
    mask = t([[1, 1, 0]])
    loss, _ = compute_policy_loss(old, new, adv, mask)
    loss.backward()
    assert new.grad is not None and new.grad[0, 2] == 0
    poisoned_loss, _ = compute_policy_loss(
        poison_masked(old, mask, 50.0),
        poison_masked(new.detach(), mask, -50.0),
        poison_masked(adv, mask, 1e9),
        mask,
    )
    assert poisoned_loss.item() == pytest.approx(loss.item())


def test_policy_loss_gradient_stays_finite_with_float32_garbage_under_the_mask():
    # a masked float32 position whose log-ratio is 119.5 would overflow exp() to inf, and the zero gradient the
    # mask sends back times inf is NaN; the log-ratio is clamped to 20 first, so only the real token has a gradient
    old = t([[-1.0, -120.0]], dtype=torch.float32)
    new = t([[-0.9, -0.5]], dtype=torch.float32).requires_grad_()
    loss, _ = compute_policy_loss(old, new, t([[1.0, 0.0]], dtype=torch.float32), t([[1, 0]], dtype=torch.float32))
    loss.backward()
    # the one token: ratio e^0.1 inside the clip range, loss -ratio, d(-ratio)/d log_prob = -e^0.1
    np.testing.assert_allclose(new.grad.numpy(), [[-math.exp(0.1), 0.0]], rtol=1e-6)


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_policy_loss_rejects_small_dual_clip(c):
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1]]), clip_ratio_c=c)


@FAST
@given(
    st.lists(st.tuples(st.floats(-0.19, 0.19), st.floats(-5, 5)), min_size=1, max_size=8),
)
def test_policy_loss_is_plain_surrogate_inside_clip_range(pairs):
    # ratio - 1 in (-eps, eps): no clipping anywhere, the loss is mean(-A * ratio)
    ratio = t([[1.0 + d for d, _ in pairs]])
    adv = t([[a for _, a in pairs]])
    old = torch.zeros_like(ratio)
    loss, metrics = compute_policy_loss(old, torch.log(ratio), adv, torch.ones_like(ratio), clip_ratio=0.2)
    assert loss.item() == pytest.approx((-adv * ratio).mean().item(), rel=1e-9, abs=1e-12)
    assert metrics["actor/pg_clipfrac"] == 0.0 and metrics["actor/pg_clipfrac_lower"] == 0.0


# ---------------------------------------------------------------------------------------------------
# Value loss
# ---------------------------------------------------------------------------------------------------


def test_value_loss_golden():
    # token 0: vpred 1.0, old 0.0, R 2.0, clip 0.5 -> clipped pred 0.5: max(1, 2.25) = 2.25 (clipped wins)
    # token 1: vpred 1.0, old 0.8, R 0.0 -> clipped pred 1.0: max(1, 1) = 1 (no clip)
    # token 2: vpred -1, old 0.0, R -1 -> clipped pred -0.5: max(0, 0.25) = 0.25 (clipped wins)
    # token 3: masked
    vpreds = t([[1.0, 1.0, -1.0, 100.0]]).requires_grad_()
    returns = t([[2.0, 0.0, -1.0, 0.0]])
    values = t([[0.0, 0.8, 0.0, 0.0]])
    mask = t([[1, 1, 1, 0]])
    loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1.0 + 0.25) / 3)
    assert clipfrac == pytest.approx(2 / 3) and isinstance(clipfrac, float)
    loss.backward()
    # the clipped branch is flat in vpreds for tokens 0 and 2; token 1 has d/dv 0.5 * 2 * 1 / 3
    assert vpreds.grad.tolist()[0] == pytest.approx([0.0, 1 / 3, 0.0, 0.0])


def test_value_loss_counts_only_tokens_beyond_the_clip():
    # clip 0.2 around old values 0 (token 4 is masked and would count):
    # t0 vpred 0.1 (inside), R 1: 0.81 both ways -> not clipped
    # t1 vpred 0.3 -> 0.2, R 1: unclipped 0.49 < clipped 0.64 -> clipped
    # t2 vpred -0.5 -> -0.2, R 1: unclipped 2.25 > clipped 1.44 -> not clipped
    # t3 vpred 0.15 (inside), R -1: 1.3225 both ways -> not clipped
    vpreds = t([[0.1, 0.3, -0.5, 0.15, 5.0]])
    returns = t([[1.0, 1.0, 1.0, -1.0, 0.0]])
    mask = t([[1, 1, 1, 1, 0]])
    loss, clipfrac = compute_value_loss(vpreds, returns, torch.zeros_like(vpreds), mask, cliprange_value=0.2)
    assert clipfrac == 0.25
    assert loss.item() == pytest.approx(0.5 * (0.81 + 0.64 + 2.25 + 1.3225) / 4)


def test_value_loss_clipfrac_is_exactly_zero_when_no_value_moves_beyond_the_clip():
    generator = torch.Generator().manual_seed(0)
    centre = 0.05 * torch.randn(64, 32, generator=generator, dtype=torch.float64)
    moved = 0.19 * (2 * torch.rand(64, 32, generator=generator, dtype=torch.float64) - 1)
    values, vpreds = centre.float(), (centre + moved).float()  # float32, each within 0.2 of the other
    assert ((vpreds - values).abs() < 0.2).all()
    returns = torch.randn(64, 32, generator=generator)
    # a batch where values + (vpreds - values) rounds away from vpreds: the form that miscounted
    assert ((values + (vpreds - values)) != vpreds).any()
    _, clipfrac = compute_value_loss(vpreds, returns, values, torch.ones(64, 32), cliprange_value=0.2)
    assert clipfrac == 0.0


def test_value_loss_seq_mode():
    vpreds = t([[1.0, 2.0], [3.0, 0.0]])
    returns = torch.zeros(2, 2, dtype=torch.float64)
    loss, _ = compute_value_loss(vpreds, returns, vpreds, t([[1, 1], [1, 0]]), 0.2, "seq-mean-token-sum")
    assert loss.item() == pytest.approx(0.5 * ((1 + 4) + 9) / 2)


# ---------------------------------------------------------------------------------------------------
# Logits helpers
# ---------------------------------------------------------------------------------------------------


def test_entropy_from_logits_against_definition():
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    probs = logits.softmax(-1)
    expected = -(probs * probs.log()).sum(-1)
    assert entropy_from_logits(logits).shape == (2, 3)
    assert torch.allclose(entropy_from_logits(logits), expected)
    uniform = torch.zeros(1, 1, 4)
    assert entropy_from_logits(uniform).item() == pytest.approx(math.log(4), rel=1e-6)


def test_logprobs_from_logits_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)], [2.0, 2.0]]])
    labels = torch.tensor([[1, 0]])
    out = logprobs_from_logits(logits, labels)
    assert out.shape == (1, 2)
    assert out[0].tolist() == pytest.approx([math.log(0.75), math.log(0.5)], rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_logprobs_from_logits_matches_log_softmax(dtype):
    gen = torch.Generator().manual_seed(3)
    logits = (5 * torch.randn(3, 4, 11, generator=gen)).to(dtype)
    labels = torch.randint(0, 11, (3, 4), generator=gen)
    expected = logits.float().log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    tol = 1e-5 if dtype != torch.bfloat16 else 5e-2
    assert torch.allclose(logprobs_from_logits(logits, labels).float(), expected, atol=tol)


def test_logprobs_from_logits_gradient():
    logits = torch.randn(
        2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4)
    ).requires_grad_()
    labels = torch.tensor([[0, 1, 2], [3, 0, 1]])
    logprobs_from_logits(logits, labels).sum().backward()
    # d log p(label) / d z = onehot(label) - softmax(z)
    expected = torch.nn.functional.one_hot(labels, 4).double() - logits.detach().softmax(-1)
    assert torch.allclose(logits.grad, expected)


# ---------------------------------------------------------------------------------------------------
# Outcome advantage estimators
# ---------------------------------------------------------------------------------------------------

OUTCOME_MASK = [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]]
OUTCOME_REWARDS = [[0.0, 1.0, 5.0], [2.0, 9.0, 9.0], [0.0, 0.0, 0.5], [1.0, 2.0, 9.0], [4.0, 0.0, 0.0]]
# scores (masked sums): 1.0, 2.0, 0.5, 3.0, 4.0
OUTCOME_SCORES = [1.0, 2.0, 0.5, 3.0, 4.0]
OUTCOME_INDEX = ["a", "b", "a", "a", "solo"]


def broadcast(seq_values: list[float], mask: list[list[int]]) -> torch.Tensor:
    return t([[v * keep for keep in row] for v, row in zip(seq_values, mask)])


def test_grpo_against_numpy():
    scores = np.array(OUTCOME_SCORES)
    index = np.array(OUTCOME_INDEX, dtype=object)
    expected = []
    for i, uid in enumerate(index):
        group = scores[index == uid]
        if len(group) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = group.mean(), group.std(ddof=1)
        expected.append((scores[i] - mean) / (std + 1e-6))
    advantages, returns = compute_grpo_outcome_advantage(t(OUTCOME_REWARDS), t(OUTCOME_MASK), index)
    assert torch.allclose(advantages, broadcast(expected, OUTCOME_MASK))
    assert torch.equal(advantages, returns)


def test_grpo_by_hand_and_without_std():
    # group "a": scores 1, 0.5, 3 -> mean 1.5; group "b" has one response with score 2 (mean 0, std 1).
    adv, _ = compute_grpo_outcome_advantage(
        t(OUTCOME_REWARDS), t(OUTCOME_MASK), OUTCOME_INDEX, norm_adv_by_std_in_grpo=False
    )
    assert adv[:, 0].tolist() == pytest.approx([-0.5, 2.0, -1.0, 1.5, 4.0])
    # identical scores in a group: std 0 -> advantage 0
    same, _ = compute_grpo_outcome_advantage(t([[1.0], [1.0]]), t([[1], [1]]), [7, 7])
    assert same.tolist() == [[0.0], [0.0]]


def test_group_ids_in_a_tensor_group_as_in_a_list():
    # group 0 scores (1, 0): mean 0.5, unbiased std 0.7071, advantages +-0.5 / 0.7071; group 1 (1, 1): 0 each
    rewards, mask = torch.tensor([[1.0], [0.0], [1.0], [1.0]]), torch.ones(4, 1)
    for index in ([0, 0, 1, 1], torch.tensor([0, 0, 1, 1])):
        advantages, _ = compute_grpo_outcome_advantage(rewards, mask, index)
        assert advantages.flatten().tolist() == pytest.approx([0.5 / 0.5 ** 0.5, -0.5 / 0.5 ** 0.5, 0.0, 0.0],
                                                              abs=1e-5)
        keep = algos.filter_groups_keep(torch.tensor([1.0, 1.0, 0.0, 1.0]), index)
        assert keep.tolist() == [False, False, True, True]  # group 0 all alike, group 1 not


@pytest.mark.parametrize("n", [4, 5, 7, 8, 16, 32, 64])
def test_groups_that_all_score_the_same_get_no_advantage(n):
    # every response of a group scoring the same: no response is better than another, so 0 for each, exactly
    # (a rounded group mean divided by a std near 0 once gave 16 scores of 0.98 an advantage of 0.19 each)
    for k in range(0, 101, 7):
        rewards = torch.zeros(n, 3)
        rewards[:, 2] = k / 100  # the score on the last token, a float32 value such as 0.98
        mask = torch.ones(n, 3)
        for fn in (compute_grpo_outcome_advantage, compute_rloo_outcome_advantage):
            advantages, _ = fn(rewards, mask, [0] * n)
            assert torch.count_nonzero(advantages) == 0, (fn.__name__, n, k)


def test_grpo_rejects_index_of_wrong_length():
    with pytest.raises(ValueError, match="group ids"):
        compute_grpo_outcome_advantage(t(OUTCOME_REWARDS), t(OUTCOME_MASK), ["a", "b"])


def test_rloo_by_hand():
    # group "a" (1, 0.5, 3): 1 - 1.75 = -0.75, 0.5 - 2 = -1.5, 3 - 0.75 = 2.25; singletons keep their score.
    adv, returns = compute_rloo_outcome_advantage(
        t(OUTCOME_REWARDS), t(OUTCOME_MASK), np.array(OUTCOME_INDEX)
    )
    assert torch.allclose(adv, broadcast([-0.75, 2.0, -1.5, 2.25, 4.0], OUTCOME_MASK))
    assert torch.equal(adv, returns)


def test_outcome_estimators_ignore_masked_rewards():
    mask = t(OUTCOME_MASK)
    poisoned = poison_masked(t(OUTCOME_REWARDS), mask, 1e9)
    for fn in (compute_grpo_outcome_advantage, compute_rloo_outcome_advantage):
        assert torch.equal(
            fn(poisoned, mask, OUTCOME_INDEX)[0], fn(t(OUTCOME_REWARDS), mask, OUTCOME_INDEX)[0]
        )
    clean = compute_reinforce_plus_plus_outcome_advantage(t(OUTCOME_REWARDS), mask, 0.9)
    dirty = compute_reinforce_plus_plus_outcome_advantage(poisoned, mask, 0.9)
    assert all(torch.equal(a, b) for a, b in zip(clean, dirty))


def test_reinforce_plus_plus_against_reference():
    gamma = 0.9
    advantages, returns = compute_reinforce_plus_plus_outcome_advantage(t(REWARDS), t(MASK), gamma)
    to_go = [ref_reward_to_go_row(r, m, gamma) for r, m in zip(REWARDS, MASK)]
    assert torch.allclose(returns, t(to_go))
    assert torch.allclose(advantages, t(ref_whiten(to_go, MASK)))


def test_reinforce_plus_plus_skips_middle_mask_by_hand():
    # rewards [1, 5(masked), 2], gamma 0.5: G_2 = 2, G_0 = 1 + 0.5 * 2 = 2 (the masked token is not discounted)
    _, returns = compute_reinforce_plus_plus_outcome_advantage(t([[1.0, 5.0, 2.0]]), t([[1, 0, 1]]), 0.5)
    assert returns.tolist() == [[2.0, 0.0, 2.0]]


# ---------------------------------------------------------------------------------------------------
# Estimator registry
# ---------------------------------------------------------------------------------------------------


def test_registry_contents():
    assert set(ADV_ESTIMATORS) == {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                   "remax", "grpo_passk"}
    assert set(ADV_ESTIMATORS_NEED_CRITIC) == {"gae"}
    assert get_adv_estimator("grpo") is compute_grpo_outcome_advantage


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError, match="unknown adv_estimator 'ppo'.*gae.*grpo.*rloo.*reinforce_plus_plus"):
        get_adv_estimator("ppo")
    with pytest.raises(ValueError, match="unknown adv_estimator"):
        compute_advantage("ppo", t(REWARDS), t(MASK))


def test_compute_advantage_dispatch():
    rewards, mask, values = t(REWARDS), t(MASK), t(VALUES)
    index = ["p", "p", "q"]
    cases = {
        "gae": compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8),
        "grpo": compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False),
        "rloo": compute_rloo_outcome_advantage(rewards, mask, index),
        "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage(rewards, mask, 0.9),
    }
    for name, expected in cases.items():
        got = compute_advantage(
            name, rewards, mask, values=values, index=index, gamma=0.9, lam=0.8, norm_adv_by_std_in_grpo=False
        )
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), name


@pytest.mark.parametrize("name, missing", [("gae", "values"), ("grpo", "index"), ("rloo", "index")])
def test_compute_advantage_missing_inputs(name, missing):
    with pytest.raises(ValueError, match=missing):
        compute_advantage(name, t(REWARDS), t(MASK))


# ---------------------------------------------------------------------------------------------------
# KL controllers and the in-reward penalty
# ---------------------------------------------------------------------------------------------------


def test_adaptive_controller_by_hand():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=6.6, n_steps=100)  # error 0.1 -> x (1 + 0.1 * 100 / 10000) = x 1.001
    assert ctrl.value == pytest.approx(0.1001)
    ctrl.update(current_kl=60.0, n_steps=1000)  # error 9 clipped to 0.2 -> x 1.02
    assert ctrl.value == pytest.approx(0.1001 * 1.02)
    ctrl.update(current_kl=0.0, n_steps=500)  # error -1 clipped to -0.2 -> x 0.99
    assert ctrl.value == pytest.approx(0.1001 * 1.02 * 0.99)


def test_controllers_state_round_trip_and_factory():
    fixed = make_kl_controller("fixed", 0.05)
    assert isinstance(fixed, FixedKLController)
    fixed.update(100.0, 10)
    assert fixed.value == 0.05
    adaptive = make_kl_controller("adaptive", 0.2, target_kl=1.0, horizon=100)
    assert isinstance(adaptive, AdaptiveKLController)
    adaptive.update(2.0, 10)
    restored = make_kl_controller("adaptive", 0.2, target_kl=1.0, horizon=100)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.value == adaptive.value == pytest.approx(0.2 * 1.02)
    assert adaptive.state_dict() == {"type": "adaptive", "value": pytest.approx(0.204), "target": 1.0,
                                     "horizon": 100.0}
    fixed.load_state_dict({"value": 0.3})
    assert fixed.state_dict() == {"type": "fixed", "value": 0.3}
    swapped = kl_controller_from_state({"type": "adaptive", "value": 0.5, "target": 0.01, "horizon": 20.0})
    assert isinstance(swapped, AdaptiveKLController)
    assert (swapped.value, swapped.target, swapped.horizon) == (0.5, 0.01, 20.0)
    assert isinstance(kl_controller_from_state({"type": "fixed", "value": 0.3}), FixedKLController)
    with pytest.raises(ValueError, match="unknown KL controller type 'pid'.*fixed.*adaptive"):
        make_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", 0.1)


def test_apply_kl_penalty_by_hand():
    scores = t([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    old = t([[-1.0, -1.0, -3.0], [-2.0, -1.0, 0.0]])
    ref = t([[-1.5, -0.5, 0.0], [-1.0, -1.0, 7.0]])
    mask = t([[1, 1, 0], [1, 1, 0]])
    ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.1, horizon=20)
    rewards, batch_kl, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, "kl")
    # k1 = old - ref: row 0 [0.5, -0.5, (masked)], row 1 [-1, 0, (masked)]
    assert torch.allclose(rewards, t([[-0.25, 1.25, 0.0], [0.5, 0.0, 0.0]]))
    assert batch_kl == pytest.approx((0.0 + -0.5) / 2)
    assert metrics == {"actor/reward_kl_penalty": batch_kl, "actor/reward_kl_penalty_coeff": 0.5}
    # error clip(-0.25 / 0.1 - 1) = -0.2, n_steps = bs = 2 -> 0.5 * (1 - 0.2 * 2 / 20)
    assert ctrl.value == pytest.approx(0.5 * 0.98)


def test_apply_kl_penalty_batch_kl_is_the_mean_of_sequence_means():
    # rows of unequal length: row 0 one token (k1 = 0.5), row 1 three tokens (k1 = -1, 0, 0)
    scores = t([[1.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    old = t([[-1.0, -9.0, 5.0], [-2.0, -1.0, -0.5]])
    ref = t([[-1.5, 0.0, 0.0], [-1.0, -1.0, -0.5]])
    mask = t([[1, 0, 0], [1, 1, 1]])
    ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.1, horizon=20)
    rewards, batch_kl, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, "kl")
    # r = score - 0.5 * k1 on the valid tokens; masked tokens keep their score
    assert torch.allclose(rewards, t([[0.75, 0.0, 0.0], [0.5, 0.0, 2.0]]))
    # per-sequence means 0.5 and -1/3, then their mean: (0.5 - 1/3) / 2 = 1/12 (a per-token mean would give
    # (0.5 - 1) / 4 = -1/8)
    assert batch_kl == pytest.approx(1 / 12)
    assert metrics == {"actor/reward_kl_penalty": pytest.approx(1 / 12), "actor/reward_kl_penalty_coeff": 0.5}
    # error (1/12) / 0.1 - 1 = -1/6 (inside the +-0.2 clip; -1/8 would clip to -0.2), n_steps = bs = 2:
    # 0.5 * (1 - (1/6) * 2 / 20) = 0.5 * 59 / 60
    assert ctrl.value == pytest.approx(0.5 * 59 / 60)


# ---------------------------------------------------------------------------------------------------
# Explained variance
# ---------------------------------------------------------------------------------------------------


def test_explained_variance():
    returns = t([[1.0, 2.0, 3.0, 99.0]])
    mask = t([[1, 1, 1, 0]])
    assert compute_explained_variance(returns, returns, mask) == pytest.approx(1.0)
    # V = 0: residual = R, var 1 each -> 1 - 1 / (1 + 1e-5), verl's epsilon
    assert compute_explained_variance(torch.zeros_like(returns), returns, mask) == pytest.approx(
        1 - 1 / (1 + 1e-5), rel=1e-4
    )
    # residual [0.5, 0, -0.5]: var 0.25; var(returns) = 1 -> 1 - 0.25 / (1 + 1e-5)
    values = t([[0.5, 2.0, 3.5, 0.0]])
    assert compute_explained_variance(values, returns, mask) == pytest.approx(1 - 0.25 / (1 + 1e-5))
    assert isinstance(compute_explained_variance(values, returns, mask), float)
    # constant returns (every score 0): var(R) = 0, var(R - V) = var(V) = 1e-4 by hand; 1 - 1e-4 / 1e-5 = -9
    flat = t([[0.0, 0.0, 0.0, 5.0]])
    assert compute_explained_variance(t([[0.01, -0.01, 0.0, 0.0]]), flat, mask) == pytest.approx(-9.0, rel=1e-4)


def test_module_exports_exist():
    for name in algos.__all__:
        assert hasattr(algos, name), name
