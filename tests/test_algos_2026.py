"""The 2026 recipes: GSPO, CISPO, DAPO (clip-higher, dynamic sampling, overlong shaping), Dr. GRPO,
REINFORCE++ with baseline, ReMax, pass@k and rollout correction.

Every expected value is worked out by hand in the comments or by a separate plain-python formula here,
never taken from the code under test. The last part runs one short training step per new mode on a
random tiny model to show the pieces are wired into the trainer and report their metrics.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import numpy as np
import pytest
import torch

from rlhf_core import algos
from rlhf_core.batch import Batch
from rlhf_core.config import ConfigError, load_config
from rlhf_core.training import dynamic_sampling


def t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# Dr. GRPO: the aggregation and its length-unbiasedness
# ---------------------------------------------------------------------------------------------------

LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
LOSS_MASK = [[1, 1, 0], [0, 0, 0], [1, 1, 1]]


def test_seq_mean_token_sum_norm_by_hand():
    loss, mask = t(LOSS), t(LOSS_MASK)
    # per-sequence sums 3 and 24 (the empty row is no sequence), mean 13.5, divided by T = 3
    assert algos.agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(4.5)
    assert algos.agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=10).item() == pytest.approx(1.35)
    # with a global count of 4 sequences (gradient accumulation): 27 / 4 / 3
    assert algos.agg_loss(loss, mask, "seq-mean-token-sum-norm", global_seq_count=4).item() == pytest.approx(2.25)
    assert algos.agg_loss(t(LOSS), torch.zeros(3, 3), "seq-mean-token-sum-norm").item() == 0.0


def _token_gradients(loss_agg_mode: str, advantages: torch.Tensor, mask: torch.Tensor, **kwargs) -> torch.Tensor:
    log_prob = torch.full(mask.shape, -1.0, dtype=torch.float64, requires_grad=True)
    loss, _ = algos.compute_policy_loss(log_prob.detach(), log_prob, advantages, mask,
                                        loss_agg_mode=loss_agg_mode, **kwargs)
    loss.backward()
    return log_prob.grad


def test_dr_grpo_weighs_every_token_the_same_whatever_the_response_length():
    # two responses to one prompt, of 2 and 6 tokens, both with advantage +1 (on-policy: ratio 1)
    mask = t([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    advantages = mask.clone()
    # Dr. GRPO: loss = -(sum of all token terms) / (2 sequences * T = 6): every token's gradient is -1/12
    grads = _token_gradients("seq-mean-token-sum-norm", advantages, mask)
    np.testing.assert_allclose(grads[mask.bool()].numpy(), np.full(8, -1 / 12))
    # GRPO's seq-mean-token-mean gives a token of the short response three times the weight of the long one's:
    # -1 / (2 * 2) against -1 / (2 * 6), the length bias Dr. GRPO removes
    biased = _token_gradients("seq-mean-token-mean", advantages, mask)
    np.testing.assert_allclose(biased[0, :2].numpy(), [-1 / 4, -1 / 4])
    np.testing.assert_allclose(biased[1].numpy(), np.full(6, -1 / 12))
    # and with a negative advantage the short wrong answer is no longer punished harder per token either
    grads_neg = _token_gradients("seq-mean-token-sum-norm", -advantages, mask)
    np.testing.assert_allclose(grads_neg[mask.bool()].numpy(), np.full(8, 1 / 12))
    assert torch.all(grads[~mask.bool()] == 0)


def test_dr_grpo_recipe_advantage_is_the_centred_score():
    rewards = t([[0, 0, 1.0], [0, 0, 0], [0, 3.0, 0], [0, 0, 0]])
    mask = t([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    adv, _ = algos.compute_advantage("grpo", rewards, mask, index=[0, 0, 1, 1], norm_adv_by_std_in_grpo=False)
    # group 0 scores (1, 0): mean 0.5; group 1 scores (3, 0): mean 1.5; no division by the std
    expected = t([[0.5, 0.5, 0.5], [-0.5, -0.5, -0.5], [1.5, 1.5, 0], [-1.5, 0, 0]])
    torch.testing.assert_close(adv, expected)


# ---------------------------------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------------------------------


def test_vanilla_clip_ratio_low_high_is_dapo_clip_higher():
    # DAPO's clip-higher: the upper bound (binding for A > 0) widened to 0.28, the lower one kept at 0.2
    old = t([[0.0, 0.0, 0.0]])
    log_prob = torch.log(t([[1.25, 1.30, 0.75]])).requires_grad_(True)
    advantages = t([[1.0, 1.0, -1.0]])
    loss, metrics = algos.compute_policy_loss(old, log_prob, advantages, torch.ones(1, 3, dtype=torch.float64),
                                              clip_ratio_low=0.2, clip_ratio_high=0.28)
    # token 1: ratio 1.25 inside 1 + 0.28, loss -1.25; token 2: 1.30 clipped to 1.28; token 3: A < 0 and
    # ratio 0.75 below 1 - 0.2: max(0.75, 0.8) = 0.8
    assert loss.item() == pytest.approx((-1.25 - 1.28 + 0.8) / 3)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 3)
    loss.backward()
    # a clipped token has no gradient; the unclipped one has d(-r)/d log_prob = -r / 3
    np.testing.assert_allclose(log_prob.grad.numpy(), [[-1.25 / 3, 0.0, 0.0]])
    # the symmetric 0.2 of plain PPO would clip the first token too
    symmetric, _ = algos.compute_policy_loss(old, log_prob.detach(), advantages, torch.ones(1, 3, dtype=torch.float64))
    assert symmetric.item() == pytest.approx((-1.2 - 1.2 + 0.8) / 3)


def test_gspo_uses_the_length_normalised_sequence_ratio_by_hand():
    old = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    # row 0 log-ratios (0.3, -0.1, 0.1): mean 0.1; row 1 (0.2, 0.0) over 2 tokens: mean 0.1; row 2 empty
    log_prob = (old + t([[0.3, -0.1, 0.1], [0.2, 0.0, 5.0], [9.0, 9.0, 9.0]])).requires_grad_(True)
    mask = t([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    advantages = t([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0], [4.0, 4.0, 4.0]])
    loss, metrics = algos.compute_policy_loss_gspo(old, log_prob, advantages, mask, clip_ratio_low=0.5,
                                                   clip_ratio_high=0.5)
    s = math.exp(0.1)  # both sequences' ratio, inside [0.5, 1.5]
    # mean over the two sequences of the per-sequence token mean of -A * s
    assert loss.item() == pytest.approx(((-1.0 * s) + (2.0 * s)) / 2)
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/ppo_kl"] == pytest.approx(-(0.3 - 0.1 + 0.1 + 0.2 + 0.0) / 5)
    loss.backward()
    # d loss / d log_prob_t = -A_i * s_i / |y_i| / (number of sequences)
    expected = [[-s / 3 / 2] * 3, [2 * s / 2 / 2, 2 * s / 2 / 2, 0.0], [0.0, 0.0, 0.0]]
    np.testing.assert_allclose(log_prob.grad.numpy(), expected, rtol=1e-12)
    # the objective is a mean of per-sequence token means whatever loss_agg_mode says, as verl: token-mean
    # would give (-3s + 4s) / 5 and seq-mean-token-sum-norm (-3s + 4s) / 2 / 3 here
    for mode in algos.LOSS_AGG_MODES:
        any_mode, _ = algos.compute_policy_loss_gspo(old, log_prob.detach(), advantages, mask, clip_ratio_low=0.5,
                                                     clip_ratio_high=0.5, loss_agg_mode=mode)
        assert any_mode.item() == pytest.approx(s / 2), mode


def test_gspo_ppo_kl_is_a_mean_over_tokens():
    # rows of 3 and 1 tokens with log-ratios (0.3, -0.1, 0.1) and (0.4): ppo_kl is the mean of -log-ratio over
    # the 4 tokens, -0.7 / 4, not the mean over sequences of their mean log-ratios, -(0.1 + 0.4) / 2
    old = t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    log_prob = t([[0.3, -0.1, 0.1], [0.4, 0.0, 0.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    loss, metrics = algos.compute_policy_loss_gspo(old, log_prob, torch.ones(2, 3, dtype=torch.float64), mask,
                                                   clip_ratio_low=0.5, clip_ratio_high=0.5)
    assert metrics["actor/ppo_kl"] == pytest.approx(-0.7 / 4)
    # both sequence ratios, e^0.1 and e^0.4, lie inside [0.5, 1.5]: nothing clipped
    assert loss.item() == pytest.approx(-(math.exp(0.1) + math.exp(0.4)) / 2)
    assert metrics["actor/pg_clipfrac"] == 0.0


def test_gspo_clips_the_whole_sequence():
    old = t([[0.0, 0.0], [0.0, 0.0]])
    # row 0: mean log-ratio 0.5, s = e^0.5 = 1.65 > 1 + 0.2 with A > 0: clipped; row 1: s = 1 inside
    log_prob = t([[0.4, 0.6], [0.1, -0.1]]).requires_grad_(True)
    advantages = t([[1.0, 1.0], [1.0, 1.0]])
    loss, metrics = algos.compute_policy_loss_gspo(old, log_prob, advantages, torch.ones(2, 2, dtype=torch.float64),
                                                   clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert loss.item() == pytest.approx((-1.2 - 1.0) / 2)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)  # both tokens of row 0 out of 4
    loss.backward()
    np.testing.assert_allclose(log_prob.grad.numpy(), [[0.0, 0.0], [-1 / 2 / 2, -1 / 2 / 2]])
    # clip_ratio_low and clip_ratio_high unset are clip_ratio: row 0's ratio is clipped at 1 + clip_ratio
    for clip_ratio in (0.2, 0.3):
        default, _ = algos.compute_policy_loss_gspo(old, log_prob.detach(), advantages,
                                                    torch.ones(2, 2, dtype=torch.float64), clip_ratio=clip_ratio)
        assert default.item() == pytest.approx((-(1.0 + clip_ratio) - 1.0) / 2), clip_ratio


def test_cispo_truncates_and_detaches_the_weight_but_keeps_every_gradient():
    old = t([[0.0, 0.0, 0.0, 0.0]])
    ratios = [2.0, 1.1, 0.1, 1.0]
    log_prob = torch.log(t([ratios])).requires_grad_(True)
    advantages = t([[1.0, 1.0, -1.0, 1.0]])
    mask = t([[1, 1, 1, 0]])
    # the paper's weight: no lower bound (clip_ratio_low=1.0)
    loss, metrics = algos.compute_policy_loss_cispo(old, log_prob, advantages, mask, clip_ratio_low=1.0,
                                                    clip_ratio_high=0.5)
    weights = [1.5, 1.1, 0.1]  # 2.0 truncated at 1 + 0.5
    lp = [math.log(r) for r in ratios[:3]]
    expected = sum(-w * a * p for w, a, p in zip(weights, [1.0, 1.0, -1.0], lp)) / 3
    assert loss.item() == pytest.approx(expected)
    assert (metrics["actor/pg_clipfrac"], metrics["actor/pg_clipfrac_lower"]) == (pytest.approx(1 / 3), 0.0)
    # ppo_kl is the mean of old - new log-prob over the unmasked tokens: -(ln 2 + ln 1.1 + ln 0.1) / 3 > 0
    assert metrics["actor/ppo_kl"] == pytest.approx(-(math.log(2.0) + math.log(1.1) + math.log(0.1)) / 3)
    loss.backward()
    # the gradient of -sg(w) * A * log_prob is -w * A / 3 on every token, the truncated one included
    np.testing.assert_allclose(log_prob.grad.numpy(), [[-1.5 / 3, -1.1 / 3, 0.1 / 3, 0.0]])
    # clip_ratio_low unset is clip_ratio (0.2 by default), as verl: the third weight is raised to 0.8
    for low in ({}, {"clip_ratio_low": 0.2}):
        lowered, metrics = algos.compute_policy_loss_cispo(old, log_prob.detach(), advantages, mask,
                                                           clip_ratio_high=0.5, **low)
        assert lowered.item() == pytest.approx(sum(-w * a * p for w, a, p in zip([1.5, 1.1, 0.8], [1, 1, -1], lp)) / 3)
        assert (metrics["actor/pg_clipfrac"], metrics["actor/pg_clipfrac_lower"]) == (pytest.approx(2 / 3),
                                                                                      pytest.approx(1 / 3))
    # clip_ratio_high unset is clip_ratio too: the weight 2.0 is truncated at 1 + 0.2
    higher, _ = algos.compute_policy_loss_cispo(old, log_prob.detach(), advantages, mask, clip_ratio=0.2,
                                                clip_ratio_low=1.0)
    assert higher.item() == pytest.approx(-(1.2 * math.log(2.0) + 1.1 * math.log(1.1) - 0.1 * math.log(0.1)) / 3)


def test_rollout_is_weights_multiply_every_policy_loss():
    old = t([[-1.0, -1.0], [-1.0, -1.0]])
    log_prob = t([[-0.9, -1.1], [-1.0, -1.2]])
    advantages = t([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2, dtype=torch.float64)
    weights = [[0.5, 2.0], [1.0, 0.0]]
    ratio = [[math.exp(0.1), math.exp(-0.1)], [1.0, math.exp(-0.2)]]  # all inside [0.5, 1.5]: no clipping
    seq = [math.exp(0.0), math.exp(-0.1)]  # GSPO's per-sequence ratios (mean log-ratios 0 and -0.1)
    adv = [[1.0, 1.0], [-1.0, -1.0]]
    lp = [[-0.9, -1.1], [-1.0, -1.2]]
    cells = [(i, j) for i in range(2) for j in range(2)]
    expected = {
        "vanilla": sum(weights[i][j] * -adv[i][j] * ratio[i][j] for i, j in cells) / 4,
        "cispo": sum(weights[i][j] * -ratio[i][j] * adv[i][j] * lp[i][j] for i, j in cells) / 4,
        "gspo": sum(sum(weights[i][j] * -adv[i][j] * seq[i] for j in range(2)) / 2 for i in range(2)) / 2,
    }
    for name, value in expected.items():
        loss, _ = algos.get_policy_loss_fn(name)(old, log_prob, advantages, mask, clip_ratio_low=0.5,
                                                 clip_ratio_high=0.5, rollout_is_weights=t(weights))
        assert loss.item() == pytest.approx(value), name


def test_unknown_loss_mode_lists_the_valid_ones():
    assert set(algos.POLICY_LOSS_MODES) == {"vanilla", "gspo", "cispo"}
    assert algos.get_policy_loss_fn("vanilla") is algos.compute_policy_loss
    with pytest.raises(ValueError, match="unknown policy loss_mode 'gpso'.*vanilla, gspo, cispo"):
        algos.get_policy_loss_fn("gpso")


# ---------------------------------------------------------------------------------------------------
# Advantage estimators
# ---------------------------------------------------------------------------------------------------


def _whiten_reference(values: list[float]) -> list[float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def test_reinforce_plus_plus_baseline_by_hand_with_a_group_of_one_and_an_empty_row():
    # scores: group a (1, 0, 2) -> mean 1; group b (5) alone -> baseline 0; group c (3, 3) -> 0 (all equal)
    rewards = t([[0, 1.0], [0, 0], [2.0, 0], [0, 5.0], [0, 3.0], [0, 3.0], [7.0, 7.0]])
    mask = t([[1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [1, 1], [0, 0]])
    index = ["a", "a", "a", "b", "c", "c", "d"]
    adv, returns = algos.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index)
    centred = {0: 0.0, 1: -1.0, 2: 1.0, 3: 5.0, 4: 0.0, 5: 0.0}
    tokens = [(row, col) for row in range(7) for col in range(2) if mask[row, col]]
    whitened = _whiten_reference([centred[row] for row, _ in tokens])
    expected = torch.zeros(7, 2, dtype=torch.float64)
    for (row, col), value in zip(tokens, whitened):
        expected[row, col] = value
    torch.testing.assert_close(adv, expected)
    assert torch.equal(adv, returns)
    assert torch.all(adv[6] == 0)


def test_reinforce_plus_plus_baseline_with_all_equal_rewards_is_zero():
    rewards = t([[0, 1.0], [0, 1.0], [0, 1.0], [0, 1.0]])
    adv, _ = algos.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, torch.ones(4, 2), [0, 0, 1, 1])
    assert torch.all(adv == 0)


def test_remax_subtracts_the_greedy_score_from_the_reward_to_go():
    rewards = t([[0.5, 0.0, 1.0], [0.0, 2.0, 0.0], [1.0, 1.0, 1.0]])
    mask = t([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    baselines = t([0.5, 1.0, 3.0])
    adv, returns = algos.compute_remax_outcome_advantage(rewards, mask, baselines)
    # reward-to-go row 0: (1.5, 1.0, 1.0); row 1: (2, 2, -) ; row 2: nothing
    torch.testing.assert_close(returns, t([[1.5, 1.0, 1.0], [2.0, 2.0, 0.0], [0, 0, 0]]))
    torch.testing.assert_close(adv, t([[1.0, 0.5, 0.5], [1.0, 1.0, 0.0], [0, 0, 0]]))
    dispatched = algos.compute_advantage("remax", rewards, mask, reward_baselines=baselines)
    assert torch.equal(dispatched[0], adv)
    with pytest.raises(ValueError, match="reward_baselines"):
        algos.compute_advantage("remax", rewards, mask)


def test_grpo_passk_credits_only_the_best_response():
    scores = [1.0, 0.0, 0.5, 2.0, 2.0, 0.0, 3.0, 3.0]
    rewards = t([[0.0, s] for s in scores])
    mask = torch.ones(8, 2, dtype=torch.float64)
    index = [0, 0, 0, 1, 1, 1, 2, 2]
    adv, _ = algos.compute_grpo_passk_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    # group 0: best 1.0 over second 0.5 -> 0.5 on row 0; group 1: a tie at the top -> 0; group 2 equal -> 0
    np.testing.assert_allclose(adv[:, 0].numpy(), [0.5, 0, 0, 0, 0, 0, 0, 0])
    adv_std, _ = algos.compute_grpo_passk_outcome_advantage(rewards, mask, index)
    std0 = float(np.std([1.0, 0.0, 0.5], ddof=1))
    assert adv_std[0, 0].item() == pytest.approx(0.5 / (std0 + 1e-6))
    with pytest.raises(ValueError, match="at least 2 responses per prompt.*rollout.n"):
        algos.compute_grpo_passk_outcome_advantage(rewards[:3], mask[:3], [0, 0, 1])


# ---------------------------------------------------------------------------------------------------
# DAPO: group filter and overlong shaping
# ---------------------------------------------------------------------------------------------------


def test_filter_groups_drops_all_equal_groups_and_keeps_groups_of_one():
    metric = t([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.7, 0.5, 0.5, 0.5])
    index = ["a", "a", "b", "b", "c", "c", "d", "e", "e", "e"]
    keep = algos.filter_groups_keep(metric, index)
    # a: all 1 -> drop; b: mixed -> keep; c: all 0 -> drop; d: alone -> keep; e: all 0.5 -> drop
    assert keep.tolist() == [False, False, True, True, False, False, True, False, False, False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_filter_groups_runs_on_cuda_tensors():
    metric = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.7], device="cuda")
    keep = algos.filter_groups_keep(metric, ["a", "a", "b", "b", "c"])
    # a: all 1 -> drop; b: mixed -> keep; c: alone -> keep
    assert keep.device.type == "cuda"
    assert keep.tolist() == [False, False, True, True, True]


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([0, 6, 7, 9, 10])
    # limit 10, buffer 4: free up to 6 tokens, then -(len - 6) / 4 * factor
    penalty = algos.compute_overlong_penalty(lengths, max_response_length=10, overlong_buffer_len=4,
                                             penalty_factor=0.5)
    np.testing.assert_allclose(penalty.numpy(), [0.0, 0.0, -0.125, -0.375, -0.5])
    # a buffer as long as the limit (verl takes it): every token costs 1 / 10 of the factor
    np.testing.assert_allclose(algos.compute_overlong_penalty(lengths, 10, 10, 1.0).numpy(), [0.0, -0.6, -0.7, -0.9, -1.0])
    for buffer in (0, 11):
        with pytest.raises(ValueError, match="overlong_buffer_len"):
            algos.compute_overlong_penalty(lengths, 10, buffer, 1.0)


def test_add_at_last_token_handles_inner_masks_and_empty_rows():
    scores = t([[0, 0, 1.0, 0], [0, 2.0, 0, 0], [0, 0, 0, 0]])
    mask = t([[1, 0, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    shaped = algos.add_at_last_token(scores, mask, t([-0.5, -1.0, -3.0]))
    torch.testing.assert_close(shaped, t([[0, 0, 0.5, 0], [0, 1.0, 0, 0], [0, 0, 0, 0]]))


# ---------------------------------------------------------------------------------------------------
# Dynamic sampling on a fixed reward table
# ---------------------------------------------------------------------------------------------------

# the scores of the 2 responses of each prompt; prompts come in generation batches of 4
TABLE = {
    0: (1.0, 1.0), 1: (0.0, 1.0), 2: (0.0, 0.0), 3: (1.0, 1.0),  # batch 1: keeps 1 (prompt 1)
    4: (1.0, 0.0), 5: (0.0, 0.0), 6: (0.0, 1.0), 7: (1.0, 1.0),  # batch 2: keeps 2 (4, 6)
    8: (1.0, 1.0), 9: (1.0, 0.0), 10: (0.0, 1.0), 11: (0.0, 0.0),  # batch 3: keeps 2 (9, 10)
}


def _prompts(uids: list[int], width: int) -> Batch:
    ids = torch.ones(len(uids), width, dtype=torch.long)
    return Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                  "position_ids": torch.arange(width).repeat(len(uids), 1)}, {"uid": list(uids)})


def _fake_rollout(prompts: Batch) -> tuple[Batch, dict]:
    """Two responses per prompt whose width (3 + batch parity) differs between batches; the score sits on
    the last token, and the response token ids encode the prompt (uid * 10 + sample)."""
    uids = prompts.meta["uid"]
    width = 3 + uids[0] // 4 % 2
    rows = [(uid, k) for uid in uids for k in range(2)]
    responses = torch.tensor([[uid * 10 + k] * width for uid, k in rows])
    scores = torch.zeros(len(rows), width)
    scores[:, -1] = torch.tensor([TABLE[uid][k] for uid, k in rows])
    p = prompts["input_ids"].shape[1]
    mask = torch.ones(len(rows), width, dtype=torch.long)
    batch = Batch({
        "prompts": prompts["input_ids"].repeat_interleave(2, 0), "responses": responses, "response_mask": mask,
        "input_ids": torch.cat([prompts["input_ids"].repeat_interleave(2, 0), responses], 1),
        "attention_mask": torch.ones(len(rows), p + width, dtype=torch.long),
        "position_ids": torch.arange(p + width).repeat(len(rows), 1), "token_level_scores": scores,
    }, {"uid": [uid for uid, _ in rows]})
    extras = {"score": scores.sum(-1), "acc": scores.sum(-1), "responses": [f"r{uid}-{k}" for uid, k in rows]}
    return batch, extras


def _collect(max_num_gen_batches=10, group_multiple=1, metric="seq_reward", rollout=_fake_rollout, pad_id=0):
    batches = iter([[4, 5, 6, 7], [8, 9, 10, 11]])
    calls = []

    def next_prompts():
        uids = next(batches)
        calls.append(uids)
        return _prompts(uids, width=2 + len(calls))  # the prompt width differs too

    result = dynamic_sampling.collect_groups(_prompts([0, 1, 2, 3], 2), next_prompts, rollout, metric=metric,
                                             max_num_gen_batches=max_num_gen_batches, pad_id=pad_id,
                                             group_multiple=group_multiple)
    return result, calls


def test_dynamic_sampling_fills_the_batch_from_the_reward_table():
    (batch, extras, metrics), calls = _collect()
    assert calls == [[4, 5, 6, 7], [8, 9, 10, 11]]
    # 4 groups wanted: prompt 1, then 4 and 6, then 9 (10 is the surplus of the last batch)
    prompt_of_row = [int(r[0]) // 10 for r in batch["responses"]]
    assert prompt_of_row == [1, 1, 4, 4, 6, 6, 9, 9]
    assert metrics == {"train/num_gen_batches": 3.0, "train/filter_groups/kept": 5.0,
                       "train/filter_groups/dropped": 7.0, "train/filter_groups/trained": 4.0,
                       # dropped: prompts 0, 3, 7, 8 (both 1) and 2, 5, 11 (both 0): the common value averages 4 / 7
                       "train/filter_groups/dropped_metric_mean": pytest.approx(4 / 7)}
    assert extras["responses"] == ["r1-0", "r1-1", "r4-0", "r4-1", "r6-0", "r6-1", "r9-0", "r9-1"]
    torch.testing.assert_close(extras["score"], torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]))
    # uids are unique per generation batch, so a prompt drawn twice never merges two groups
    assert batch.meta["uid"][::2] == [(0, 1), (1, 4), (1, 6), (2, 9)]


def test_dynamic_sampling_keeps_an_extra_that_only_some_generation_batches_report():
    """A reward function may report a metric (or a pred) only where it has one, so a generation batch's extras can
    lack a key another's has: the first batch's keys were taken for all (a KeyError, or the key lost)."""
    def rollout(prompts):
        batch, extras = _fake_rollout(prompts)
        if prompts.meta["uid"][0] == 4:  # only the second generation batch reports them
            rows = [(uid, k) for uid in prompts.meta["uid"] for k in range(2)]
            extras["fmt"] = torch.tensor([uid * 10.0 + k for uid, k in rows])
            extras["pred"] = [f"p{uid}-{k}" for uid, k in rows]
        return batch, extras

    (_, extras, _), _ = _collect(rollout=rollout)  # rows of prompts 1 (batch 1), 4 and 6 (batch 2), 9 (batch 3)
    nan = float("nan")
    torch.testing.assert_close(extras["fmt"], torch.tensor([nan, nan, 40.0, 41.0, 60.0, 61.0, nan, nan]),
                               equal_nan=True)
    assert extras["pred"] == [None, None, "p4-0", "p4-1", "p6-0", "p6-1", None, None]
    assert extras["responses"] == ["r1-0", "r1-1", "r4-0", "r4-1", "r6-0", "r6-1", "r9-0", "r9-1"]


def test_dynamic_sampling_pads_batches_of_different_widths():
    (batch, _, _), _ = _collect()
    # batch 1 (prompt width 2, responses 3), batch 2 (width 3, responses 4), batch 3 (width 4, responses 3)
    assert batch["prompts"].shape == (8, 4) and batch["responses"].shape == (8, 4)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (8, 8)
    # prompt 1 (batch 1): prompt left-padded by 2, response right-padded by 1
    assert batch["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1, 0]
    assert batch["response_mask"][0].tolist() == [1, 1, 1, 0]
    assert batch["responses"][0].tolist() == [10, 10, 10, 0]
    assert batch["token_level_scores"][1].tolist() == [0.0, 0.0, 1.0, 0.0]
    # prompt 4 (batch 2): prompt left-padded by 1, response full width
    assert batch["attention_mask"][2].tolist() == [0, 1, 1, 1, 1, 1, 1, 1]
    assert batch["input_ids"][2].tolist() == [0, 1, 1, 1, 40, 40, 40, 40]
    assert batch["position_ids"][0].tolist() == [0, 0, 0, 1, 2, 3, 4, 5]


def test_dynamic_sampling_pads_token_ids_with_the_pad_id_and_masks_with_zero():
    """With a pad id of 0 a token pad and a mask pad look alike; 7 tells them apart."""
    (batch, _, _), _ = _collect(pad_id=7)
    # prompt 1 (batch 1): its prompt [1, 1] left-padded by 2 to width 4, its response [10, 10, 10] right-padded
    # by 1 to width 4, so the token ids carry the pad id on both sides and the masks carry 0 there
    assert batch["prompts"][0].tolist() == [7, 7, 1, 1]
    assert batch["responses"][0].tolist() == [10, 10, 10, 7]
    assert batch["input_ids"][0].tolist() == [7, 7, 1, 1, 10, 10, 10, 7]
    assert batch["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1, 0]
    assert batch["response_mask"][0].tolist() == [1, 1, 1, 0]
    # prompt 9 (batch 3): prompt of width 4, no padding; response of width 3, right-padded by 1
    assert batch["input_ids"][6].tolist() == [1, 1, 1, 1, 90, 90, 90, 7]
    assert batch["attention_mask"][6].tolist() == [1, 1, 1, 1, 1, 1, 1, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("metric", ["seq_reward", "score"])
def test_dynamic_sampling_runs_on_cuda_rollouts(metric):
    def cuda_rollout(prompts):
        batch, extras = _fake_rollout(prompts)
        return batch.to("cuda"), {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in extras.items()}

    (batch, extras, _), _ = _collect(metric=metric, rollout=cuda_rollout)
    assert batch["responses"].device.type == extras["score"].device.type == "cuda"
    # the same groups as on the CPU: prompt 1, then 4 and 6, then 9
    assert [int(r[0]) // 10 for r in batch["responses"]] == [1, 1, 4, 4, 6, 6, 9, 9]
    # prompt 1's positions: the prompt left-padded by 2, the response extended by 1 past its last position
    assert batch["position_ids"][0].tolist() == [0, 0, 0, 1, 2, 3, 4, 5]


def test_dynamic_sampling_at_the_limit_trains_on_what_it_has_with_a_warning(capsys):
    (batch, _, metrics), _ = _collect(max_num_gen_batches=2)
    assert metrics["train/num_gen_batches"] == 2 and metrics["train/filter_groups/trained"] == 3
    assert [int(r[0]) // 10 for r in batch["responses"][::2]] == [1, 4, 6]
    err = capsys.readouterr().err
    assert "WARNING dynamic sampling: only 3 of 4 prompt groups" in err
    assert "algorithm.filter_groups.max_num_gen_batches=2" in err
    # with a worker group the partial batch is cut to whole mini-batches of 2 prompts
    (batch, _, metrics), _ = _collect(max_num_gen_batches=2, group_multiple=2)
    assert metrics["train/filter_groups/trained"] == 2 and len(batch) == 4


def test_dynamic_sampling_when_the_data_runs_out_trains_on_what_it_has(capsys):
    batches = iter([_prompts([4, 5, 6, 7], 2), None])
    batch, _, metrics = dynamic_sampling.collect_groups(
        _prompts([0, 1, 2, 3], 2), lambda: next(batches), _fake_rollout, metric="seq_reward", max_num_gen_batches=0,
        pad_id=0)
    # prompt 1 of the first batch, then 4 and 6 (the reward table), and no third batch to draw
    assert [int(r[0]) // 10 for r in batch["responses"][::2]] == [1, 4, 6]
    assert metrics["train/num_gen_batches"] == 2 and metrics["train/filter_groups/trained"] == 3
    assert "only 3 of 4 prompt groups" in capsys.readouterr().err
    # nothing kept when the data runs out: the trainer's loop ends (DataExhausted), it is not a failure
    with pytest.raises(dynamic_sampling.DataExhausted, match="training data ran out"):
        dynamic_sampling.collect_groups(_prompts([0, 2, 3, 5], 2), lambda: None, _fake_rollout, metric="seq_reward",
                                        max_num_gen_batches=0, pad_id=0)


def test_dynamic_sampling_short_of_a_mini_batch_raises_by_what_ended_the_step():
    """One group kept (prompt 1 of the first batch) and mini-batches of 2: the limit reached is a run that cannot
    go on as configured (NothingToTrain), the data run out is the end of training (DataExhausted)."""
    short = r"1 prompt group\(s\) kept in 1 generation batches, fewer than one mini-batch of 2 prompts"
    with pytest.raises(dynamic_sampling.NothingToTrain, match=short):
        dynamic_sampling.collect_groups(_prompts([0, 1, 2, 3], 2), lambda: _prompts([4, 5, 6, 7], 2), _fake_rollout,
                                        metric="seq_reward", max_num_gen_batches=1, pad_id=0, group_multiple=2)
    with pytest.raises(dynamic_sampling.DataExhausted, match=short):
        dynamic_sampling.collect_groups(_prompts([0, 1, 2, 3], 2), lambda: None, _fake_rollout, metric="seq_reward",
                                        max_num_gen_batches=0, pad_id=0, group_multiple=2)


def test_training_ends_after_total_epochs_whatever_the_step_count(tiny):
    """As verl's loop: total_training_steps past the epochs' batches stops at them; with dynamic sampling,
    whose steps draw several batches, the loop stops once total_epochs passes are drawn."""
    trainer = _trainer(tiny, "trainer.total_epochs=1", "trainer.total_training_steps=500")
    assert trainer.total_steps == 4  # 32 prompts in batches of 8
    assert _trainer(tiny, "trainer.total_epochs=2", "trainer.total_training_steps=3").total_steps == 3
    trainer = _trainer(tiny, "trainer.total_epochs=1", "trainer.total_training_steps=500",
                       "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                       "algorithm.filter_groups.max_num_gen_batches=0")
    history = trainer.fit()
    assert trainer.sampler.batches_drawn == 4 and trainer.sampler.epoch == 0
    assert 1 <= len(history) <= 4 and all(r.metrics["training/epoch"] == 0 for r in history)
    assert sum(r.metrics["train/num_gen_batches"] for r in history) <= 4


def test_dynamic_sampling_groups_on_verls_other_metrics():
    """verl's seq_final_reward (the summed reward after the KL penalty: without one, the summed scores) and any
    number a custom reward reports were refused as metrics ("is not one of seq_reward, score, acc")."""
    batch = Batch({"token_level_scores": torch.tensor([[0.0, 1.0], [0.5, 0.0]])})
    extras = {"score": torch.tensor([1.0, 0.5]), "fmt": torch.tensor([0.0, 1.0]), "responses": ["a", "b"]}
    assert dynamic_sampling.group_metric(batch, extras, "seq_final_reward").tolist() == [1.0, 0.5]
    assert dynamic_sampling.group_metric(batch, extras, "fmt").tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match=r"metric='style' is not a number the reward reports \(it reports fmt, "
                                         r"score\)"):
        dynamic_sampling.group_metric(batch, extras, "style")

    def errors(*extra):
        try:
            load_config(["algorithm.filter_groups.enable=true", "actor_rollout_ref.rollout.n=2", *extra],
                        notice=lambda _: None)
        except ConfigError as exc:
            return exc.errors
        return []

    assert errors("algorithm.filter_groups.metric=seq_final_reward") == []
    assert errors("algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=true") == [
        "algorithm.filter_groups.metric=seq_final_reward is the reward after the KL penalty, which comes here after "
        "dynamic sampling has picked the groups (algorithm.use_kl_in_reward=true): use seq_reward, the reward before "
        "it"]
    assert errors("algorithm.filter_groups.metric=fmt", "custom_reward_function.path=reward.py") == []
    assert errors("algorithm.filter_groups.metric=fmt") == [
        "algorithm.filter_groups.metric='fmt' is not one of seq_reward, seq_final_reward, score, acc"]


def test_dynamic_sampling_without_any_varied_group_is_an_error():
    with pytest.raises(RuntimeError, match="every one of the 4 prompt groups scored the same.*"
                                           "algorithm.filter_groups.metric=seq_reward.*max_num_gen_batches"):
        dynamic_sampling.collect_groups(_prompts([0, 2, 3, 5], 2), lambda: None, _fake_rollout,
                                        metric="seq_reward", max_num_gen_batches=1, pad_id=0)


# ---------------------------------------------------------------------------------------------------
# Rollout correction
# ---------------------------------------------------------------------------------------------------


def test_token_truncated_importance_weights_by_hand():
    rollout = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0], [-1.0, -1.0, -1.0]])
    old = rollout + torch.log(t([[3.0, 0.4, 1.0], [1.5, 1.0, 9.0], [4.0, 4.0, 4.0]]))
    mask = t([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    weights, new_mask, metrics = algos.compute_rollout_correction(old, rollout, mask, rollout_is="token",
                                                                  rollout_is_threshold=2.0)
    torch.testing.assert_close(weights, t([[2.0, 0.4, 1.0], [1.5, 1.0, 0.0], [0, 0, 0]]))
    assert torch.equal(new_mask, mask)
    # as verl's, the metrics describe the weights before truncation (the 3.0 counts as 3.0)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx((3.0 + 0.4 + 1.0 + 1.5 + 1.0) / 5)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(3.0)
    assert metrics["rollout_corr/rollout_is_min"] == pytest.approx(0.4)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)  # the 3.0
    assert metrics["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 5)  # the 0.4
    # std and ESS see the weights held within [1/2, 2]: 2, 0.5, 1, 1.5, 1 (mean 1.2)
    held = [2.0, 0.5, 1.0, 1.5, 1.0]
    mean = sum(held) / 5
    assert metrics["rollout_corr/rollout_is_std"] == pytest.approx(math.sqrt(sum(w * w for w in held) / 5 - mean ** 2))
    assert metrics["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(
        1 / (sum((w / mean) ** 2 for w in held) / 5))
    assert metrics["rollout_corr/rollout_is_seq_mean"] == pytest.approx((4.4 / 3 + 2.5 / 2) / 2)
    # off-policy diagnostics: k1 of KL(rollout || train) is the mean of log(rollout / train) over 5 tokens
    logs = [math.log(r) for r in (3.0, 0.4, 1.0, 1.5, 1.0)]
    assert metrics["rollout_corr/kl"] == pytest.approx(-sum(logs) / 5)
    assert metrics["rollout_corr/chi2_token"] == pytest.approx(sum(r * r for r in (3.0, 0.4, 1.0, 1.5, 1.0)) / 5 - 1)
    assert metrics["rollout_corr/chi2_seq"] == pytest.approx(((3 * 0.4) ** 2 + 1.5 ** 2) / 2 - 1)


def test_sequence_importance_weight_is_the_truncated_product():
    rollout = torch.zeros(2, 3, dtype=torch.float64)
    old = torch.log(t([[1.2, 1.5, 1.0], [0.5, 0.8, 7.0]]))
    mask = t([[1, 1, 1], [1, 1, 0]])
    weights, _, _ = algos.compute_rollout_correction(old, rollout, mask, rollout_is="sequence",
                                                     rollout_is_threshold=1.5)
    # row 0: 1.2 * 1.5 = 1.8, truncated to 1.5; row 1: 0.5 * 0.8 = 0.4 (the masked 7.0 does not count)
    torch.testing.assert_close(weights, t([[1.5, 1.5, 1.5], [0.4, 0.4, 0.0]]))


def test_sequence_importance_metrics_are_over_sequences_before_truncation():
    # verl's sequence-level figures: max / min / fractions from each response's summed log ratio, not from
    # the truncated weights on its tokens. Row 0: 4 tokens of +0.5 (weight e^2 = 7.39, over the threshold 2);
    # row 1: one token of -0.1 (e^-0.1); row 2: 2 tokens of -0.5 (e^-1 = 0.37, under 1/2); row 3: no token.
    log_ratio = t([[0.5, 0.5, 0.5, 0.5], [-0.1, 3.0, 3.0, 3.0], [-0.5, -0.5, 3.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    mask = t([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    weights, metrics = algos.compute_rollout_is_weights(log_ratio, mask, "sequence", 2.0)
    e = math.exp
    torch.testing.assert_close(weights, t([[2.0] * 4, [e(-0.1), 0, 0, 0], [e(-1), e(-1), 0, 0], [0] * 4]))
    assert metrics["rollout_is_max"] == pytest.approx(e(2))  # not the truncated 2
    assert metrics["rollout_is_min"] == pytest.approx(e(-1))
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)  # a share of sequences: row 0
    assert metrics["rollout_is_ratio_fraction_low"] == pytest.approx(1 / 3)  # row 2 (of tokens it would be 2/7)
    assert metrics["rollout_is_mean"] == pytest.approx((4 * e(2) + e(-0.1) + 2 * e(-1)) / 7)  # over the 7 tokens
    held = [2.0] * 4 + [e(-0.1)] + [0.5] * 2  # the tokens' weights held within [1/2, 2]
    held_mean = sum(held) / 7
    held_square = sum(w * w for w in held) / 7
    assert metrics["rollout_is_std"] == pytest.approx(math.sqrt(held_square - held_mean ** 2))
    assert metrics["rollout_is_eff_sample_size"] == pytest.approx(held_mean ** 2 / held_square)
    seq = [e(2), e(-0.1), e(-1)]  # the empty row 3 is no sequence
    assert metrics["rollout_is_seq_mean"] == pytest.approx(sum(seq) / 3)
    assert metrics["rollout_is_seq_std"] == pytest.approx(float(np.std(seq, ddof=1)))
    assert metrics["rollout_is_seq_max"] == pytest.approx(e(2))
    assert metrics["rollout_is_seq_min"] == pytest.approx(e(-1))
    assert metrics["rollout_is_seq_max_deviation"] == pytest.approx(e(2) - 1)
    assert metrics["rollout_is_seq_fraction_high"] == pytest.approx(1 / 3)
    assert metrics["rollout_is_seq_fraction_low"] == pytest.approx(1 / 3)


def test_sequence_importance_extremes_keep_verls_bounds():
    # a sum of 30 reports exp(20) (the safety bound), a sum of -25 reports exp(-25) (no bound below, as verl)
    log_ratio = t([[15.0, 15.0], [-25.0, 0.0]])
    mask = t([[1, 1], [1, 0]])
    _, metrics = algos.compute_rollout_is_weights(log_ratio, mask, "sequence", 2.0)
    assert metrics["rollout_is_max"] == pytest.approx(math.exp(20))
    assert metrics["rollout_is_min"] == pytest.approx(math.exp(-25))
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(0.5)
    assert metrics["rollout_is_ratio_fraction_low"] == pytest.approx(0.5)


def test_rejection_masks_tokens_or_whole_responses():
    rollout = torch.zeros(3, 3, dtype=torch.float64)
    ratios = t([[1.0, 3.0, 1.2], [0.9, 1.1, 1.0], [0.2, 1.0, 1.0]])
    old = torch.log(ratios)
    mask = t([[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    # token_k1 with threshold 2: a ratio outside [1/2, 2] is rejected (3.0 and 0.2)
    _, token_mask, metrics = algos.compute_rollout_correction(old, rollout, mask, rollout_rs="token_k1",
                                                              rollout_rs_threshold=2.0)
    torch.testing.assert_close(token_mask, t([[1, 0, 1], [1, 1, 1], [0, 1, 0]]))
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 8)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 3)
    # seq_mean_k3: per-token r - 1 - log r, averaged per response, must stay <= 0.1
    k3 = (ratios - 1 - torch.log(ratios)) * mask
    seq_mean = k3.sum(-1) / mask.sum(-1)  # (0.2347, 0.0035, 0.4047)
    _, seq_mask, metrics = algos.compute_rollout_correction(old, rollout, mask, rollout_rs="seq_mean_k3",
                                                            rollout_rs_threshold=0.1)
    assert seq_mean[0] > 0.1 > seq_mean[1] and seq_mean[2] > 0.1
    torch.testing.assert_close(seq_mask, t([[0, 0, 0], [1, 1, 1], [0, 0, 0]]))
    assert metrics["rollout_corr/rollout_rs_seq_mean_k3_mean"] == pytest.approx(
        float((seq_mean.unsqueeze(-1) * mask).sum() / mask.sum()))


# log(pi_train / pi_rollout) per token, on responses of 3, 2 and 3 tokens (the 9.0 is padding: never counted)
RC_LOG_RATIO = [[0.5, -0.5, 0.0], [1.0, 0.2, 9.0], [-0.3, -0.3, -0.3]]
RC_MASK = [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
RC_ROLLOUT = [[-1.0, -2.0, -0.5], [-0.5, -1.5, -3.0], [-2.0, -1.0, -1.0]]


def _rc_tokens(rows):
    """The unmasked entries of ``rows`` (3 x 3), row by row."""
    return [[x for x, keep in zip(row, mask) if keep] for row, mask in zip(rows, RC_MASK)]


# verl's estimators of the log-ratio x: k1 = -x, k2 = x^2 / 2, k3 = exp(x) - 1 - x
RC_ESTIMATORS = {"k1": lambda x: -x, "k2": lambda x: x * x / 2, "k3": lambda x: math.exp(x) - 1 - x}


@pytest.mark.parametrize(("mode", "threshold", "expected_mask"), [
    # token_k2 <= 0.12: k2 = .125 .125 0 | .5 .02 | .045 x3
    ("token_k2", 0.12, [[0, 0, 1], [0, 1, 0], [1, 1, 1]]),
    # token_k3 <= 0.12: k3 = .1487 .1065 0 | .7183 .0214 | .0408 x3 (k2 would reject row 0's second token)
    ("token_k3", 0.12, [[0, 1, 1], [0, 1, 0], [1, 1, 1]]),
    # seq_sum_k1 in [-log 2, log 2] = [-.693, .693]: sums of -x = 0 | -1.2 | .9
    ("seq_sum_k1", 2.0, [[1, 1, 1], [0, 0, 0], [0, 0, 0]]),
    # seq_sum_k2 <= 0.3: sums .25 | .52 | .135
    ("seq_sum_k2", 0.3, [[1, 1, 1], [0, 0, 0], [1, 1, 1]]),
    # seq_sum_k3 <= 0.252: sums .2553 | .7397 | .1225 (seq_sum_k2 would keep row 0, .25)
    ("seq_sum_k3", 0.252, [[0, 0, 0], [0, 0, 0], [1, 1, 1]]),
    # seq_mean_k1 in [-log 1.5, log 1.5] = [-.405, .405]: means of -x = 0 | -.6 | .3 (the sums would drop row 2)
    ("seq_mean_k1", 1.5, [[1, 1, 1], [0, 0, 0], [1, 1, 1]]),
    # seq_mean_k2 <= 0.1: means .0833 | .26 | .045 (the sums .25 and .135 would drop rows 0 and 2)
    ("seq_mean_k2", 0.1, [[1, 1, 1], [0, 0, 0], [1, 1, 1]]),
    # seq_max_k2 <= 0.1: maxima .125 | .5 | .045 (the mean would keep row 0)
    ("seq_max_k2", 0.1, [[0, 0, 0], [0, 0, 0], [1, 1, 1]]),
    # seq_max_k3 <= 0.13: maxima .1487 | .7183 | .0408 (k2's maximum .125 would keep row 0)
    ("seq_max_k3", 0.13, [[0, 0, 0], [0, 0, 0], [1, 1, 1]]),
])
def test_every_rejection_mode_by_hand(mode, threshold, expected_mask):
    assert set(algos.ROLLOUT_RS_MODES) - {"token_k1", "seq_mean_k3"} == {  # (those two: the test above)
        "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1", "seq_mean_k2",
        "seq_max_k2", "seq_max_k3"}
    rollout = t(RC_ROLLOUT)
    old = rollout + t(RC_LOG_RATIO)
    mask = t(RC_MASK)
    _, new_mask, metrics = algos.compute_rollout_correction(old, rollout, mask, rollout_rs=mode,
                                                            rollout_rs_threshold=threshold)
    torch.testing.assert_close(new_mask, t(expected_mask))
    # the statistic on each response token (a sequence's own on each of its tokens), in plain python
    level, estimator = mode.rsplit("_", 1)
    per_token = [[RC_ESTIMATORS[estimator](x) for x in row] for row in _rc_tokens(RC_LOG_RATIO)]
    reduce = {"token": None, "seq_sum": sum, "seq_mean": lambda v: sum(v) / len(v), "seq_max": max}[level]
    statistic = per_token if reduce is None else [[reduce(row)] * len(row) for row in per_token]
    flat = [v for row in statistic for v in row]
    assert metrics[f"rollout_corr/rollout_rs_{mode}_mean"] == pytest.approx(sum(flat) / 8)
    assert metrics[f"rollout_corr/rollout_rs_{mode}_max"] == pytest.approx(max(flat))
    assert metrics[f"rollout_corr/rollout_rs_{mode}_min"] == pytest.approx(min(flat))
    rejected = [[1 - kept for kept, m in zip(row, mask_row) if m] for row, mask_row in zip(expected_mask, RC_MASK)]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(sum(map(sum, rejected)) / 8)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(sum(map(any, rejected)) / 3)


def test_off_policy_diagnostics_and_sequence_weight_extremes_by_hand():
    rollout = t(RC_ROLLOUT)
    old = rollout + t(RC_LOG_RATIO)
    mask = t(RC_MASK)
    _, _, metrics = algos.compute_rollout_correction(old, rollout, mask, rollout_is="token", rollout_is_threshold=1.5)
    x = _rc_tokens(RC_LOG_RATIO)
    train = _rc_tokens(old.tolist())
    sampled = _rc_tokens(RC_ROLLOUT)
    flat = [v for row in x for v in row]
    # k3 of KL(rollout || train) per token: exp(x) - 1 - x, averaged over the 8 tokens
    assert metrics["rollout_corr/k3_kl"] == pytest.approx(sum(math.exp(v) - 1 - v for v in flat) / 8)
    # perplexities per sequence, exp(-mean log-prob), averaged over the 3 sequences: train rows' means are
    # (-0.5 - 2.5 - 0.5) / 3, (0.5 - 1.3) / 2, (-2.3 - 1.3 - 1.3) / 3; rollout rows' -3.5/3, -1, -4/3
    mean = [sum(row) / len(row) for row in train]
    assert mean == pytest.approx([-3.5 / 3, -0.4, -4.9 / 3])
    assert metrics["rollout_corr/training_ppl"] == pytest.approx(sum(math.exp(-m) for m in mean) / 3)
    assert metrics["rollout_corr/rollout_ppl"] == pytest.approx(
        (math.exp(3.5 / 3) + math.exp(1.0) + math.exp(4 / 3)) / 3)
    # mean over sequences of (mean rollout log-prob - mean train log-prob) = -mean_t x: -(0, 0.6, -0.3) -> -0.1
    assert [sum(r) / len(r) - sum(tr) / len(tr) for r, tr in zip(sampled, train)] == pytest.approx([0.0, -0.6, 0.3])
    assert metrics["rollout_corr/log_ppl_diff"] == pytest.approx(-0.1)
    # token weights exp(x) before truncation: 1.6487 .6065 1 | 2.7183 1.2214 | .7408 x3; per-sequence means
    # 1.0851 | 1.9698 | .7408
    seq_means = [(math.exp(0.5) + math.exp(-0.5) + 1.0) / 3, (math.e + math.exp(0.2)) / 2, math.exp(-0.3)]
    assert metrics["rollout_corr/rollout_is_seq_max"] == pytest.approx(seq_means[1])
    assert metrics["rollout_corr/rollout_is_seq_min"] == pytest.approx(seq_means[2])
    assert metrics["rollout_corr/rollout_is_seq_mean"] == pytest.approx(sum(seq_means) / 3)
    # sequence-level weights before truncation: exp of the row sums 0 | 1.2 | -0.9: 1 | 3.3201 | .4066
    _, _, metrics = algos.compute_rollout_correction(old, rollout, mask, rollout_is="sequence",
                                                     rollout_is_threshold=1.5)
    assert metrics["rollout_corr/rollout_is_seq_max"] == pytest.approx(math.exp(1.2))
    assert metrics["rollout_corr/rollout_is_seq_min"] == pytest.approx(math.exp(-0.9))


def test_rollout_correction_needs_tokens():
    with pytest.raises(ValueError, match="at least one response token"):
        algos.compute_rollout_correction(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), rollout_is="token")


# ---------------------------------------------------------------------------------------------------
# Config: defaults, did-you-mean, preflight errors that name the keys
# ---------------------------------------------------------------------------------------------------


def _errors(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(list(overrides))
    return str(info.value)


def test_defaults_leave_todays_behaviour():
    cfg = load_config([])
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"
    assert cfg.algorithm.filter_groups.enable is False
    assert cfg.algorithm.rollout_correction.rollout_is is None and cfg.algorithm.rollout_correction.rollout_rs is None
    assert cfg.reward_model.overlong_buffer.enable is False


def test_unknown_names_get_a_suggestion():
    assert "did you mean gspo?" in _errors("actor_rollout_ref.actor.policy_loss.loss_mode=gpso")
    assert "did you mean reinforce_plus_plus_baseline?" in _errors(
        "algorithm.adv_estimator=reinforce_plus_plus_baselin")
    assert "did you mean seq_mean_k3?" in _errors("algorithm.rollout_correction.rollout_rs=seq_mean_k4",
                                                  "algorithm.rollout_correction.rollout_rs_threshold=2")
    assert "did you mean acc?" in _errors("algorithm.filter_groups.metric=accc")


def test_filter_groups_with_one_response_per_prompt_is_a_preflight_error():
    message = _errors("algorithm.filter_groups.enable=true", "actor_rollout_ref.rollout.n=1")
    assert "algorithm.filter_groups.enable=true needs actor_rollout_ref.rollout.n >= 2 (got 1)" in message


def test_loss_modes_name_the_keys_they_need():
    message = _errors("actor_rollout_ref.actor.policy_loss.loss_mode=gspo")
    assert "needs actor_rollout_ref.actor.clip_ratio_low and actor_rollout_ref.actor.clip_ratio_high set" in message
    message = _errors("actor_rollout_ref.actor.policy_loss.loss_mode=cispo")
    assert "needs actor_rollout_ref.actor.clip_ratio_high set" in message
    load_config(["actor_rollout_ref.actor.policy_loss.loss_mode=cispo", "actor_rollout_ref.actor.clip_ratio_high=5"])
    assert "use seq-mean-token-mean" in _errors(
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.clip_ratio_low=3e-4",
        "actor_rollout_ref.actor.clip_ratio_high=4e-4", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum")


def test_other_preflight_errors():
    assert "grpo_passk needs actor_rollout_ref.rollout.n >= 2" in _errors("algorithm.adv_estimator=grpo_passk")
    assert "reward_model.overlong_buffer.len=513 must be in (0, data.max_response_length = 512]" in _errors(
        "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=513")
    load_config(["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=512"])  # as verl
    assert "needs algorithm.rollout_correction.rollout_rs_threshold set" in _errors(
        "algorithm.rollout_correction.rollout_rs=token_k2")
    assert "must be > 1 with rollout_rs=token_k1" in _errors(
        "algorithm.rollout_correction.rollout_rs=token_k1", "algorithm.rollout_correction.rollout_rs_threshold=0.5")


# ---------------------------------------------------------------------------------------------------
# One short training step per new mode on a random tiny model
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rlhf_core.data.synthetic import build_dataset
    from rlhf_core.models.toy import random_toy_model

    root = tmp_path_factory.mktemp("algos2026")
    model = random_toy_model(root / "model", n_layers=1, hidden_size=32, max_position_embeddings=512, seed=0)
    build_dataset(root / "data", n_train=32, n_test=8, seed=0, max_ops=1)
    reward = root / "reward_digit_first.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1.0 if solution_str[:1].isdigit() else 0.0\n")
    return root, model, reward


def _trainer(tiny, *extra):
    from rlhf_core.main_ppo import build_trainer

    root, model, reward = tiny
    overrides = [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={root / 'data' / 'train.parquet'}",
        f"data.val_files={root / 'data' / 'test.parquet'}", f"custom_reward_function.path={reward}",
        "data.train_batch_size=8", "data.max_prompt_length=320", "data.max_response_length=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false", "trainer.n_gpus_per_node=1",
        "trainer.device=cpu", "trainer.val_before_train=false", f"trainer.default_local_dir={root / 'out'}",
        "trainer.logger=[]", "algorithm.adv_estimator=grpo", *extra,
    ]
    return build_trainer(load_config(overrides))


def _step(trainer) -> dict[str, float]:
    metrics = trainer.train_step(trainer.train_dataset.collate(list(range(8))))
    for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "critic/score/mean"):
        assert math.isfinite(metrics[name]), name
    return metrics


def _named_arguments(fn, args: tuple, kwargs: dict) -> dict:
    """The arguments of a call to ``fn`` by parameter name, its ``**kwargs`` spread out among them."""
    signature = inspect.signature(fn)
    named = dict(signature.bind(*args, **kwargs).arguments)
    for param in signature.parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(param.name, {}))
    return named


def _record_calls(monkeypatch, registry: dict) -> list[tuple[str, dict, object]]:
    """Wrap every function of ``registry`` (looked up by name at each call) to record (name, arguments,
    result) of each call, so a test sees which one the trainer picked and what it was given."""
    calls = []
    for name, fn in list(registry.items()):
        def recorded(*args, _name=name, _fn=fn, **kwargs):
            result = _fn(*args, **kwargs)
            calls.append((_name, _named_arguments(_fn, args, kwargs), result))
            return result

        monkeypatch.setitem(registry, name, recorded)
    return calls


def _assert_groups_of_4(index: list) -> None:
    # each of the 8 prompts' 4 responses sit together under one id of their own
    assert len(index) == 32 and len(set(index)) == 8
    assert list(index) == [uid for uid in index[::4] for _ in range(4)]


@pytest.mark.parametrize("extra, loss, loss_args, estimator, estimator_args", [
    (["actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.clip_ratio_low=3e-4",
      "actor_rollout_ref.actor.clip_ratio_high=4e-4"],
     "gspo", {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}, "grpo", {"norm_adv_by_std_in_grpo": True}),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=cispo", "actor_rollout_ref.actor.clip_ratio_high=5.0"],
     "cispo", {"clip_ratio_low": None, "clip_ratio_high": 5.0}, "grpo", {"norm_adv_by_std_in_grpo": True}),
    (["algorithm.norm_adv_by_std_in_grpo=false", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
      "actor_rollout_ref.actor.loss_scale_factor=8"],
     "vanilla", {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 8},
     "grpo", {"norm_adv_by_std_in_grpo": False}),
    # without a divisor of its own Dr. GRPO divides by data.max_response_length (8), not each batch's width
    (["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"],
     "vanilla", {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 8},
     "grpo", {"norm_adv_by_std_in_grpo": True}),
    (["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
     "vanilla", {"loss_agg_mode": "token-mean"}, "reinforce_plus_plus_baseline", {}),
    (["algorithm.adv_estimator=grpo_passk"],
     "vanilla", {"loss_agg_mode": "token-mean"}, "grpo_passk", {"norm_adv_by_std_in_grpo": True}),
], ids=["gspo", "cispo", "dr_grpo", "dr_grpo_default_divisor", "reinforce_plus_plus_baseline", "grpo_passk"])
def test_a_training_step_runs_in_each_new_mode(tiny, monkeypatch, extra, loss, loss_args, estimator, estimator_args):
    losses = _record_calls(monkeypatch, algos.POLICY_LOSSES)
    estimators = _record_calls(monkeypatch, algos.ADV_ESTIMATORS)
    trainer = _trainer(tiny, *extra)
    before = {k: v.clone() for k, v in trainer.actor.module.state_dict().items()}
    _step(trainer)
    changed = any(not torch.equal(v, before[k]) for k, v in trainer.actor.module.state_dict().items())
    assert changed
    # one estimate for the batch, by the configured estimator with the configured options, over groups of 4
    [(name, args, (advantages, _))] = estimators
    assert name == estimator
    assert {key: args[key] for key in estimator_args} == estimator_args
    _assert_groups_of_4(args["index"])
    # every micro-batch (32 responses, 4 at a time) went through the configured loss and no other one
    assert [name for name, _, _ in losses] == [loss] * 8
    for _, args, _ in losses:
        assert {key: args[key] for key in loss_args} == loss_args
    # fed the estimator's advantages: every row once (the micro-batches go in length order, not row order)
    fed = torch.cat([args["advantages"] for _, args, _ in losses])
    assert sorted(map(tuple, fed.float().tolist())) == sorted(map(tuple, advantages.float().tolist()))


def test_a_gae_step_whose_batch_holds_one_response_token_trains(tiny):
    # one prompt, one response of one token: no variance to whiten the advantage by; the step must still run
    trainer = _trainer(tiny, "algorithm.adv_estimator=gae", "data.train_batch_size=1", "data.max_response_length=1",
                       "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                       "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                       "critic.ppo_micro_batch_size_per_gpu=1")
    metrics = trainer.train_step(trainer.train_dataset.collate([0]))
    # the lone token's whitened advantage is 0 (its own mean); its return is its reward (one step, no value after)
    assert (metrics["critic/advantages/max"], metrics["critic/advantages/min"]) == (0.0, 0.0)
    assert metrics["critic/returns/mean"] == pytest.approx(metrics["critic/score/mean"], abs=1e-6)
    assert math.isfinite(metrics["critic/vf_loss"]) and math.isfinite(metrics["actor/pg_loss"])


def test_remax_step_subtracts_the_greedy_responses_score(tiny, tmp_path, monkeypatch):
    # the random model's greedy responses are all spaces and score 0 on the digit reward, which would
    # hide a missing baseline; this reward also scores them, and differently per prompt through its answer
    reward = tmp_path / "reward_spaces.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return solution_str.count(' ') / 8 + int(ground_truth) % 4\n")
    trainer = _trainer(tiny, "algorithm.adv_estimator=remax", f"custom_reward_function.path={reward}")
    generated = []
    generate = trainer.actor.generate

    def recording_generate(prompts, params):
        batch = generate(prompts, params)
        generated.append((params, batch))
        return batch

    monkeypatch.setattr(trainer.actor, "generate", recording_generate)
    # the phase each scoring runs in: the greedy baseline's is timed with its generation (timing_s/gen_max), as
    # verl times it, and timing_s/reward is the samples' alone
    phases, scored_in = [], []

    @contextlib.contextmanager
    def phase(name):
        phases.append(name)
        yield
        phases.pop()

    trainer.phase_hooks.append(phase)
    score = trainer._score
    monkeypatch.setattr(trainer, "_score", lambda batch: (scored_in.append(phases[-1]), score(batch))[1])
    estimators = _record_calls(monkeypatch, algos.ADV_ESTIMATORS)
    metrics = _step(trainer)
    assert metrics["timing_s/gen_max"] > 0
    assert scored_in == ["reward", "gen_max"]
    # two generations: the 4 samples per prompt, then one greedy response per prompt
    (sampled_params, sampled), (greedy_params, greedy) = generated
    assert (sampled_params.n, greedy_params.n, greedy_params.do_sample) == (4, 1, False)

    def scores(batch: Batch) -> list[float]:  # the reward above, from the decoded responses and the answers
        ids = [row[mask.bool()].tolist() for row, mask in zip(batch["responses"], batch["response_mask"])]
        texts = trainer.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return [text.count(" ") / 8 + int(answer) % 4 for text, answer in zip(texts, batch.meta["ground_truth"])]

    greedy_scores = scores(greedy)
    assert len(set(greedy_scores)) > 1  # so a baseline for the wrong prompt would show
    baselines = [score for score in greedy_scores for _ in range(4)]  # each prompt's, for its 4 samples
    [(name, args, (advantages, returns))] = estimators
    assert name == "remax"
    np.testing.assert_allclose(args["reward_baselines"].tolist(), baselines, rtol=1e-6)
    # the rewards are the sampled responses' scores on their last token; the return is the reward-to-go
    # G_t over the response tokens and the advantage G_t - b, both 0 off the response
    expected_returns, expected_advantages = [], []
    for rewards, mask, score, baseline in zip(args["token_level_rewards"].tolist(),
                                              args["response_mask"].tolist(), scores(sampled), baselines):
        assert sum(rewards) == pytest.approx(score, rel=1e-6)
        to_go = [sum(rewards[t:]) if mask[t] else 0.0 for t in range(len(rewards))]
        expected_returns.append(to_go)
        expected_advantages.append([g - baseline if mask[t] else 0.0 for t, g in enumerate(to_go)])
    np.testing.assert_allclose(returns.tolist(), expected_returns, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(advantages.tolist(), expected_advantages, rtol=1e-6, atol=1e-6)


def test_remax_baseline_carries_the_overlong_penalty_as_the_samples_do(tiny, tmp_path):
    """As verl's ReMax under DAPO's reward manager, the greedy baseline is the greedy response's score plus the
    same length penalty the samples get, so the advantage compares like with like."""
    reward = tmp_path / "reward_one.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1.0\n")
    trainer = _trainer(tiny, "algorithm.adv_estimator=remax", f"custom_reward_function.path={reward}",
                       "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4",
                       "reward_model.overlong_buffer.penalty_factor=0.5")
    # the random model's greedy responses all run to the 8-token limit; ending them after 8, 7, ..., 1 tokens
    # (as an EOS would) gives each prompt a penalty of its own, so a baseline shaped by the wrong length shows
    ends = torch.tensor([8, 7, 6, 5, 4, 3, 2, 1])
    pad = trainer.tokenizer.pad_token_id
    greedy = []
    generate = trainer.actor.generate

    def generate_ending_greedy_early(prompts, params):
        batch = generate(prompts, params)
        if not params.do_sample:
            width = batch["responses"].shape[1]
            after_end = torch.arange(width) >= ends[:, None]  # (8, width)
            batch["responses"] = batch["responses"].masked_fill(after_end, pad)
            batch["input_ids"][:, -width:] = batch["responses"]
            batch["response_mask"] = batch["response_mask"].masked_fill(after_end, 0)
            batch["attention_mask"][:, -width:] = batch["response_mask"]
            greedy.append(batch)
        return batch

    trainer.actor.generate = generate_ending_greedy_early
    batch, _ = trainer._rollout(trainer.train_dataset.collate(list(range(8))), {})
    [greedy_batch] = greedy
    lengths = greedy_batch["response_mask"].sum(-1).tolist()
    assert lengths == ends.tolist()
    # DAPO (Yu et al. 2025, eq. 13): free up to L_max - L_buffer = 8 - 4 tokens, then -(L - 4) / 4, times 0.5
    baselines = [1.0 - max(0, n - (8 - 4)) / 4 * 0.5 for n in lengths]  # 0.5, 0.625, 0.75, 0.875, 1.0, ...
    np.testing.assert_allclose(batch["reward_baselines"].tolist(), [b for b in baselines for _ in range(4)],
                               rtol=1e-6)


def test_validation_reward_carries_the_overlong_penalty_as_training_does(tiny):
    """As verl's DAPO reward manager, validation's reward is the score plus the length penalty; the accuracy is
    the score's. Worked out from the responses the validation generated (greedy, 8 tokens at most)."""
    trainer = _trainer(tiny, "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4",
                       "reward_model.overlong_buffer.penalty_factor=0.5", "actor_rollout_ref.rollout.val_kwargs.n=1")
    seen = []
    generate = trainer.actor.generate

    def recording(prompts, params):
        batch = generate(prompts, params)
        seen.append(batch)
        return batch

    trainer.actor.generate = recording
    metrics = trainer.validate()
    [batch] = seen
    lengths = batch["response_mask"].sum(-1).tolist()
    texts = trainer.tokenizer.batch_decode([r[m.bool()] for r, m in zip(batch["responses"], batch["response_mask"])],
                                           skip_special_tokens=True)
    raw = [1.0 if text[:1].isdigit() else 0.0 for text in texts]
    penalty = [-max(0, n - 4) / 4 * 0.5 for n in lengths]
    assert any(penalty)  # responses past the free 4 tokens: the penalty shows in the reward
    source = "synthetic/arithmetic"
    assert metrics[f"val-aux/{source}/reward/mean@1"] == pytest.approx(sum(r + p for r, p in zip(raw, penalty)) / 8)
    assert metrics[f"val-core/{source}/acc/mean@1"] == pytest.approx(sum(raw) / 8)


def test_dapo_step_filters_groups_and_shapes_overlong_rewards(tiny, monkeypatch):
    trainer = _trainer(tiny, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                       "algorithm.filter_groups.max_num_gen_batches=4", "actor_rollout_ref.actor.clip_ratio_low=0.2",
                       "actor_rollout_ref.actor.clip_ratio_high=0.28", "reward_model.overlong_buffer.enable=true",
                       "reward_model.overlong_buffer.len=4", "reward_model.overlong_buffer.penalty_factor=0.5",
                       "reward_model.overlong_buffer.log=true")
    generated = []
    rollout = trainer._rollout

    def recording_rollout(prompts, timings):  # each generation batch as scored and shaped, before filtering
        batch, extras = rollout(prompts, timings)
        generated.append({"uid": list(batch.meta["uid"]), "mask": batch["response_mask"].tolist(),
                          "scores": batch["token_level_scores"].tolist(), "texts": list(extras["responses"]),
                          "acc": extras["acc"].tolist()})
        return batch, extras

    monkeypatch.setattr(trainer, "_rollout", recording_rollout)
    estimators = _record_calls(monkeypatch, algos.ADV_ESTIMATORS)
    metrics = _step(trainer)

    kept_groups, dropped_values = [], []  # kept: the shaped score and penalty of each response of the group
    for gen in generated:
        # another batch is generated only while fewer than the 8 groups of data.train_batch_size are kept
        assert len(kept_groups) < 8
        shaped, penalties = [], []
        for text, acc, mask, row in zip(gen["texts"], gen["acc"], gen["mask"], gen["scores"]):
            raw = 1.0 if text[:1].isdigit() else 0.0  # the fixture's reward; a number >= 1.0 counts as acc
            assert acc == raw
            # max_response_length 8, buffer 4: free up to 4 tokens, then -(len - 4) / 4 * 0.5
            penalty = -max(0, sum(mask) - 4) / 4 * 0.5
            # the score plus the penalty on the last response token, nothing elsewhere
            last = max(t for t, m in enumerate(mask) if m)
            assert row == pytest.approx([raw + penalty if t == last else 0.0 for t in range(len(row))])
            shaped.append(raw + penalty)
            penalties.append(penalty)
        # a group is kept when its 4 responses' acc values are not all equal (a group of one would be kept too)
        for uid in dict.fromkeys(gen["uid"]):
            rows = [i for i, u in enumerate(gen["uid"]) if u == uid]
            assert len(rows) == 4
            if len({gen["acc"][i] for i in rows}) > 1:
                kept_groups.append([(shaped[i], penalties[i]) for i in rows])
            else:
                dropped_values.append(gen["acc"][rows[0]])
    # and it stops at 8 kept groups or after max_num_gen_batches = 4 batches
    assert len(kept_groups) >= 8 or len(generated) == 4
    # the seeded run needs more than one batch and drops groups on the way, so the loop and filter are exercised
    assert len(generated) > 1 and dropped_values
    assert metrics["train/num_gen_batches"] == len(generated)
    assert metrics["train/filter_groups/kept"] == len(kept_groups)
    assert metrics["train/filter_groups/dropped"] == len(dropped_values)
    assert metrics["train/filter_groups/trained"] == min(len(kept_groups), 8)
    assert metrics["train/filter_groups/dropped_metric_mean"] == pytest.approx(sum(dropped_values) / len(dropped_values))

    # the step trains on the first 8 kept groups, in order; the overlong metrics are over their responses
    trained = [response for group in kept_groups[:8] for response in group]
    penalties = [penalty for _, penalty in trained]
    assert len(set(penalties)) > 1  # responses of several lengths, so the penalty is no constant
    assert metrics["critic/overlong_reward/mean"] == pytest.approx(sum(penalties) / len(penalties))
    assert metrics["critic/overlong/ratio"] == pytest.approx(sum(p < 0 for p in penalties) / len(penalties))
    [(name, args, _)] = estimators
    assert name == "grpo"
    np.testing.assert_allclose(args["token_level_rewards"].sum(-1).tolist(), [s for s, _ in trained], atol=1e-6)
    assert len(set(args["index"])) == min(len(kept_groups), 8)
    # the rollout rate counts every sampled token over the generation time, the dropped batches' included
    sampled = sum(sum(map(sum, gen["mask"])) for gen in generated)
    assert metrics["perf/rollout_tokens_per_s"] * metrics["timing_s/gen"] == pytest.approx(sampled)
    assert metrics["timing_per_token_ms/gen"] * sampled == pytest.approx(metrics["timing_s/gen"] * 1000)


def test_rollout_correction_is_said_once_to_be_a_no_op_with_hf(tiny, capsys):
    trainer = _trainer(tiny, "algorithm.rollout_correction.rollout_is=token")
    metrics = _step(trainer)
    _step(trainer)
    assert capsys.readouterr().err.count("rollout_correction is a no-op") == 1
    assert not any(name.startswith("rollout_corr/") for name in metrics)


def test_rollout_correction_weights_an_engine_with_its_own_log_probs(tiny):
    trainer = _trainer(tiny, "algorithm.rollout_correction.rollout_is=token",
                       "algorithm.rollout_correction.rollout_is_threshold=1.5")
    generate = trainer.actor.generate

    def engine_with_log_probs(prompts, params):  # an engine whose log-probs are 0.5 below the trainer's
        batch = generate(prompts, params)
        batch["rollout_log_prob"] = trainer.actor.compute_log_prob(batch)[0] - 0.5
        return batch

    trainer.actor.generate = engine_with_log_probs
    metrics = _step(trainer)
    # every token's ratio is e^0.5 = 1.65 (truncated to 1.5 in the loss; the metrics see it before)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(math.exp(0.5), rel=1e-5)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1.0)
    assert metrics["rollout_corr/kl"] == pytest.approx(-0.5, abs=1e-5)


def test_rollout_rejection_leaves_the_kl_penalty_and_the_credit_to_the_responses_as_sampled(tiny):
    """Rejection takes tokens out of the losses only. The KL penalty and its batch KL are over every sampled
    token, each response's GRPO score is the sum of all its rewards (a rejected last token carries the
    outcome), and a rejected response still counts in its group's mean and std: it just gets no gradient."""
    coef = 0.5
    trainer = _trainer(tiny, "algorithm.rollout_correction.rollout_rs=token_k1",
                       "algorithm.rollout_correction.rollout_rs_threshold=2.0", "algorithm.use_kl_in_reward=true",
                       "algorithm.kl_penalty=kl", f"algorithm.kl_ctrl.kl_coef={coef}")
    generate, log_prob = trainer.actor.generate, trainer.actor.compute_log_prob
    # a reference 0.1 nat below the actor on every token: the k1 KL is 0.1 per sampled token
    trainer.actor.compute_ref_log_prob = lambda batch: log_prob(batch)[0] - 0.1
    chosen = {}

    def engine_with_log_probs(prompts, params):  # agrees with the trainer except on the tokens to reject
        batch = generate(prompts, params)
        own = log_prob(batch)[0]
        lengths = batch["response_mask"].sum(-1)
        # row 0 is off by a ratio of e^3 on every token; a response of >= 2 tokens in another group on its last
        whole, last = 0, next(r for r in range(4, len(lengths)) if lengths[r] >= 2)
        offset = torch.zeros_like(own)
        offset[whole] = 3.0
        offset[last, int(lengths[last]) - 1] = 3.0
        chosen.update(whole=whole, last=last, lengths=lengths.tolist(), sampled=batch["response_mask"].clone())
        batch["rollout_log_prob"] = own - offset
        return batch

    trainer.actor.generate = engine_with_log_probs
    updated = {}
    update_policy = trainer.actor.update_policy

    def recording_update(batch, *args, **kwargs):
        updated["batch"] = batch
        return update_policy(batch, *args, **kwargs)

    trainer.actor.update_policy = recording_update
    metrics = _step(trainer)
    batch, sampled = updated["batch"], chosen["sampled"].double()
    whole, last, lengths = chosen["whole"], chosen["last"], chosen["lengths"]

    # the batch KL is 0.1 over every sampled token (a fully rejected row must not count 0)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.1, abs=1e-5)
    rewards = batch["token_level_scores"].double() - coef * 0.1 * sampled
    torch.testing.assert_close(batch["token_level_rewards"].double(), rewards, atol=1e-5, rtol=0)
    # the losses' mask: row `whole` empty, row `last` without its last token, every other row as sampled
    kept = sampled.clone()
    kept[whole] = 0
    kept[last, lengths[last] - 1] = 0
    torch.testing.assert_close(batch["response_mask"].double(), kept)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx((lengths[whole] + 1) / sum(lengths))

    # GRPO by hand over groups of 4 consecutive rows, each score summed over all its sampled tokens (from the
    # rewards as the step made them, checked above: their float32 KL differs from 0.1 in the last bits, which
    # a group of equal scores divides by its near-0 std)
    scores = (batch["token_level_rewards"].double() * sampled).sum(-1).numpy()
    expected = np.zeros_like(scores)
    for start in range(0, len(scores), 4):
        group = scores[start:start + 4]
        expected[start:start + 4] = (group - group.mean()) / (group.std(ddof=1) + 1e-6)
    assert len(set(batch.meta["uid"][start] for start in range(0, len(scores), 4))) == len(scores) // 4
    torch.testing.assert_close(batch["advantages"].double(), torch.from_numpy(expected)[:, None] * kept,
                               atol=1e-4, rtol=0)
    # lengths are the responses' as sampled
    assert metrics["response_length/mean"] == pytest.approx(sum(lengths) / len(lengths))


@pytest.mark.parametrize("extra, agg, shuffle", [
    (["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm", "actor_rollout_ref.actor.shuffle=true"],
     "seq-mean-token-sum-norm", True),
    (["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm", "critic.loss_agg_mode=token-mean",
      "critic.shuffle=false", "actor_rollout_ref.actor.shuffle=true"], "token-mean", False),
], ids=["the_actors", "its_own"])
def test_the_critic_takes_the_actors_loss_settings_unless_given_its_own(tiny, monkeypatch, extra, agg, shuffle):
    """As verl's config interpolates them: the critic's loss aggregation and shuffling are the actor's unless set,
    and its Dr. GRPO divisor is data.max_response_length (8), as the actor's."""
    from rlhf_core.workers import critic

    calls = []
    value_loss, update = algos.compute_value_loss, critic.ppo_update

    def recorded(*args, **kwargs):
        calls.append(_named_arguments(value_loss, args, kwargs))
        return value_loss(*args, **kwargs)

    updates = []

    def recorded_update(*args, **kwargs):
        updates.append(kwargs)
        return update(*args, **kwargs)

    monkeypatch.setattr(algos, "compute_value_loss", recorded)
    monkeypatch.setattr(critic, "ppo_update", recorded_update)
    _step(_trainer(tiny, "algorithm.adv_estimator=gae", *extra))
    assert calls and all(call["loss_agg_mode"] == agg for call in calls)
    assert all(call["loss_scale_factor"] == 8 for call in calls)
    [critic_update] = updates
    assert critic_update["prefix"] == "critic" and critic_update["shuffle"] is shuffle


@pytest.mark.parametrize("agg", ["seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean"])
def test_the_kl_guard_reads_the_kl_loss_per_token_whatever_loss_agg_mode(tiny, agg):
    """A reference 0.1 nat below the policy on every token: the k1 KL is 0.1 per token. verl's actor/kl_loss is
    aggregated as the loss is (seq-mean-token-sum: 0.1 x each response's length, averaged over responses), while
    the KL guard, the console and the KL gauge compare a KL per token with trainer.guard.max_kl: 0.1."""
    from rlhf_core.training.guards import measured_kl

    # one mini-batch, one epoch: the update's log-probs are the rollout's, so the KL is 0.1 on every token
    trainer = _trainer(tiny, "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=kl",
                       f"actor_rollout_ref.actor.loss_agg_mode={agg}", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")
    log_prob = trainer.actor.compute_log_prob
    lengths = {}

    def reference(batch):
        lengths["tokens"] = batch["response_mask"].sum(-1).double()
        return log_prob(batch)[0] - 0.1

    trainer.actor.compute_ref_log_prob = reference
    metrics = _step(trainer)
    tokens = lengths["tokens"]
    verl_kl_loss = {"seq-mean-token-sum": 0.1 * float(tokens[tokens > 0].mean()),
                    "seq-mean-token-sum-norm": 0.1 * float(tokens[tokens > 0].mean()) / 8,  # / max_response_length
                    "token-mean": 0.1}[agg]
    assert metrics["actor/kl_loss"] == pytest.approx(verl_kl_loss, abs=1e-5)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    assert measured_kl(metrics) == pytest.approx(0.1, abs=1e-5)
    assert metrics["actor/kl_loss_token_mean"] == pytest.approx(0.1, abs=1e-5)


def test_a_batch_reward_scores_each_generation_batch_in_one_call(tiny, tmp_path):
    """reward_model.reward_manager=batch: the custom function gets the whole rollout as lists, once per
    generation batch, and its scores are the step's (the fixture's digit-first rule, written for lists)."""
    reward = tmp_path / "batch_reward.py"
    log = tmp_path / "calls.txt"
    reward.write_text(
        "def compute_score(data_sources, solution_strs, ground_truths, extra_infos, log=None):\n"
        "    with open(log, 'a') as f:\n"
        "        f.write(f'{len(solution_strs)}\\n')\n"
        "    return [1.0 if s[:1].isdigit() else 0.0 for s in solution_strs]\n")
    trainer = _trainer(tiny, f"custom_reward_function.path={reward}", "reward_model.reward_manager=batch",
                       f"+custom_reward_function.reward_kwargs.log={log}")
    generated = []
    rollout = trainer._rollout

    def recording_rollout(prompts, timings):
        batch, extras = rollout(prompts, timings)
        generated.append(list(extras["responses"]))
        return batch, extras

    trainer._rollout = recording_rollout
    metrics = _step(trainer)
    [responses] = generated
    assert log.read_text().split() == ["32"]  # one call with the 8 prompts' 4 samples each
    assert metrics["critic/score/mean"] == pytest.approx(sum(r[:1].isdigit() for r in responses) / 32)


def test_override_config_reaches_the_loaded_models(tiny):
    trainer = _trainer(tiny, "algorithm.adv_estimator=gae", "+actor_rollout_ref.model.override_config.attention_dropout=0.25",
                       "+critic.model.override_config.attention_dropout=0.125")
    assert trainer.actor.module.config.attention_dropout == 0.25
    assert trainer.critic.module.config.attention_dropout == 0.125
    assert _trainer(tiny).actor.module.config.attention_dropout == 0.0  # the checkpoint's own value otherwise


def test_override_config_counts_in_the_position_check(tiny):
    from rlhf_core.main_ppo import PreflightError, preflight

    root, model, reward = tiny
    cfg = load_config([f"actor_rollout_ref.model.path={model}", f"data.train_files={root / 'data' / 'train.parquet'}",
                       f"data.val_files={root / 'data' / 'test.parquet'}", f"custom_reward_function.path={reward}",
                       "data.max_prompt_length=320", "data.max_response_length=8", "trainer.n_gpus_per_node=1",
                       "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                       "+actor_rollout_ref.model.override_config.max_position_embeddings=256"])
    with pytest.raises(PreflightError, match=r"= 328 exceeds the model's max_position_embeddings \(256\)"):
        preflight(cfg)


def test_log_prob_passes_take_the_actors_token_batching_unless_given_their_own(tiny, monkeypatch):
    from rlhf_core.workers import actor

    calls = []
    map_micro = actor.map_micro_batches

    def recorded(batch, fn, micro, dynamic, max_tok, **kwargs):
        calls.append((dynamic, max_tok))
        return map_micro(batch, fn, micro, dynamic, max_tok, **kwargs)

    monkeypatch.setattr(actor, "map_micro_batches", recorded)
    # mini-batches of 4 prompts in a batch of 8: the old log-probs get a pass of their own; the KL loss a reference
    common = ("actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048",
              "actor_rollout_ref.actor.use_kl_loss=true")
    _step(_trainer(tiny, *common))
    assert calls == [(True, 2048), (True, 2048)]  # old log-prob, then reference: the actor's settings
    calls.clear()
    _step(_trainer(tiny, *common, "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
                   "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=1024"))
    assert calls == [(False, 2048), (True, 1024)]


def test_dynamic_sampling_generates_gen_batch_size_prompts_a_round(tiny, monkeypatch):
    trainer = _trainer(tiny, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                       "algorithm.filter_groups.max_num_gen_batches=0", "data.gen_batch_size=4", "trainer.total_epochs=1")
    sizes = []
    rollout = trainer._rollout

    def recording_rollout(prompts, timings):
        sizes.append(len(prompts))
        return rollout(prompts, timings)

    monkeypatch.setattr(trainer, "_rollout", recording_rollout)
    metrics = trainer.fit_step().metrics
    # rounds of 4 prompts (not data.train_batch_size's 8) until 8 groups are kept or the data runs out
    assert sizes and set(sizes) == {4} and len(sizes) >= 2
    assert metrics["train/num_gen_batches"] == len(sizes)
    assert metrics["train/filter_groups/trained"] == min(8, metrics["train/filter_groups/kept"])
    assert trainer.sampler.batch_size == 4 and trainer.total_steps == 8  # 32 prompts: 8 rounds an epoch


def test_a_step_whose_dynamic_sampling_draws_into_the_next_epoch_logs_that_epoch(tiny, tmp_path):
    """The reward scores every response 0 for the first 128 calls (the 4 generation batches of 8 prompts x 4 of
    epoch 0: no group kept), then 0/1 alternately: step 1 keeps its 8 groups in the first batch of epoch 1. verl's
    loop logs the epoch it is in when the step ends (1); the step logged the epoch of its first batch (0)."""
    reward = tmp_path / "late.py"
    reward.write_text("import itertools\n_calls = itertools.count()\n"
                      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    i = next(_calls)\n"
                      "    return float(i % 2) if i >= 128 else 0.0\n")
    trainer = _trainer(tiny, f"custom_reward_function.path={reward}", "algorithm.filter_groups.enable=true",
                       "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=0",
                       "trainer.total_epochs=2", "trainer.test_freq=-1")
    metrics = trainer.fit_step().metrics
    assert metrics["train/num_gen_batches"] == 5 and metrics["train/filter_groups/dropped"] == 32
    assert trainer.sampler.state_dict()["epoch"] == 1 and trainer.sampler.state_dict()["batch_in_epoch"] == 1
    assert metrics["training/epoch"] == 1


def _fading_trainer(tiny, tmp_path, test_freq: int):
    """Dynamic sampling on a reward that scores 0/1 alternately for the first 64 responses, then all 0."""
    reward = tmp_path / "fading.py"
    reward.write_text("import itertools\n_calls = itertools.count()\n"
                      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    i = next(_calls)\n"
                      "    return float(i % 2) if i < 64 else 0.0\n")
    return _trainer(tiny, f"custom_reward_function.path={reward}", "algorithm.filter_groups.enable=true",
                    "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=0",
                    "trainer.total_epochs=1", f"trainer.test_freq={test_freq}")


def test_when_the_data_runs_out_inside_a_step_the_last_step_is_validated(tiny, tmp_path):
    """Responses score 0/1 alternately for the first 64 (two generation rounds of 8 prompts x 4), then all 0:
    the third round keeps no group and the data (4 rounds) runs out inside the step, which ends the loop at
    step 2 before the step it expected to be last; step 2 is then validated, as the last step always is (with a
    test_freq above 0)."""
    trainer = _fading_trainer(tiny, tmp_path, test_freq=5)
    logged = []
    trainer.logger = lambda metrics, step: logged.append((step, dict(metrics)))
    observe = trainer.guard.observe_validation

    def observe_and_count(step, accuracy):  # as if this validation had made the guard roll back once
        trainer.guard.rollbacks += 1
        return observe(step, accuracy)

    trainer.guard.observe_validation = observe_and_count
    history = trainer.fit()
    assert [r.step for r in history] == [1, 2] and trainer.sampler.batches_drawn == 4
    # the step's record logged again counts its validation's rollback
    assert [metrics["training/rollbacks"] for _, metrics in logged] == [0, 0, 1]
    assert trainer.val_accuracy(history[-1].metrics) is not None
    # logged: steps 1 and 2, then step 2 again whole, its validation added
    assert [step for step, _ in logged] == [1, 2, 2]
    assert "actor/pg_loss" in logged[-1][1] and trainer.val_accuracy(logged[-1][1]) is not None
    # the guards saw it as any validation: the first one is the val-drop guard's best, checkpointed
    assert trainer.guard.best_step == 2 and trainer.last_saved_step == 2


def test_when_the_data_runs_out_with_test_freq_off_nothing_is_validated(tiny, tmp_path):
    """The same run with test_freq=-1 (no validation while training, as in verl): the data running out inside
    step 3 validates nothing, and step 3, which never trained, is not left as the step under way."""
    trainer = _fading_trainer(tiny, tmp_path, test_freq=-1)
    validated = []
    validate = trainer.validate
    trainer.validate = lambda: validated.append(trainer.global_step) or validate()
    history = trainer.fit()
    assert [r.step for r in history] == [1, 2] and validated == [] and trainer.step_under_way is None


def test_the_dry_run_of_a_dynamic_sampling_config_runs_its_steps(tiny, tmp_path):
    """The smoke test of a DAPO config: a step may take several generation rounds, so the dry run keeps data for
    them. The reward makes the first group of each round of 4 prompts x 4 score alike (dropped), so a step of 4
    groups takes 2 rounds; with data for only 2 rounds the dry run would end after 1 of its 2 steps."""
    from rlhf_core.pipeline.smoke import run_smoke_test

    root, model, _ = tiny
    reward = tmp_path / "three_of_four.py"
    reward.write_text("import itertools\n_calls = itertools.count()\n"
                      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    i = next(_calls)\n"
                      "    return 0.0 if (i // 4) % 4 == 0 else float(i % 2)\n")
    cfg = load_config([f"actor_rollout_ref.model.path={model}", f"data.train_files={root / 'data' / 'train.parquet'}",
                       f"data.val_files={root / 'data' / 'test.parquet'}", f"custom_reward_function.path={reward}",
                       "data.train_batch_size=8", "data.gen_batch_size=16", "data.max_prompt_length=320",
                       "data.max_response_length=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                       "actor_rollout_ref.rollout.n=4", "trainer.n_gpus_per_node=1", "trainer.device=cpu",
                       "algorithm.adv_estimator=grpo", "algorithm.filter_groups.enable=true",
                       "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=0",
                       "actor_rollout_ref.model.enable_gradient_checkpointing=false"])
    report = run_smoke_test(cfg, tmp_path / "smoke", n_prompts=4, response_length=8)
    assert report.passed and len(report.metrics) == 2
    assert [m["train/num_gen_batches"] for m in report.metrics] == [2.0, 2.0]
