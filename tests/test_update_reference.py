"""One PPO step of the real trainer against the same step worked out here, in float64, from verl's definitions.

The trainer samples a seeded rollout, cut to responses of 1 to 8 tokens; the test takes its tokens as given,
scores them with its own reward function and then, on float64 copies of the actor, reference and critic made
before the step, computes with plain autograd and written-out formulas (none of rlhf_core's): the log-probs,
the values, the rewards at each response's last token less the KL penalty, GAE and its whitening, the
critic's clipped value loss and the actor's clipped surrogate with the low_var_kl loss, each aggregated over
the whole mini-batch as ``loss_agg_mode`` says, the gradient clipped to ``grad_clip`` and AdamW steps (torch's
plain AdamW on the copies). The trainer runs the same in micro-batches with gradient accumulation, in float32.

What is compared: the weights after the step, AdamW's two moments (they hold each mini-batch's clipped
gradient itself, scale included, where the step of a sign-like first Adam update would hide a wrong scale),
the grad-norm metrics, the policy's clip fraction and KL to the rollout policy, the returns and advantages,
and the adaptive KL coefficient after the step.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_trainer import _overrides, workspace  # noqa: F401  (the fixture and its config)

from rlhf_core.config import load_config
from rlhf_core.main_ppo import build_trainer

ACTOR_LR, CRITIC_LR = 1e-2, 5e-3
BETAS, WEIGHT_DECAY, ADAM_EPS = (0.9, 0.999), 0.01, 1e-8
KL_COEF, TARGET_KL, HORIZON = 0.05, 0.01, 100
KL_LOSS_COEF = 0.1
CLIP_RATIO, CLIP_RATIO_C, CLIPRANGE_VALUE = 0.2, 3.0, 0.05
GAMMA, LAM = 0.95, 0.9
ROWS, N = 8, 2  # 4 prompts x 2 responses; mini-batches of 2 prompts (4 rows): two optimizer steps per update
MAX_RESPONSE = 8


def _score(response: str) -> float:
    """The test's reward: a number that differs between responses (their length and first character)."""
    return len(response) / 4.0 - 1.0 + (0.5 if response[:1].isdigit() else 0.0)


def _agg(loss: torch.Tensor, mask: torch.Tensor, mode: str, scale: float) -> torch.Tensor:
    """verl's loss_agg_mode over a whole mini-batch (bs, T) -> ()."""
    seq_sum = (loss * mask).sum(-1)  # (bs,)
    tokens = mask.sum(-1)  # (bs,)
    if mode == "token-mean":
        return seq_sum.sum() / tokens.sum()
    if mode == "seq-mean-token-sum":
        return seq_sum.mean()
    if mode == "seq-mean-token-mean":
        return (seq_sum / tokens).mean()
    assert mode == "seq-mean-token-sum-norm"
    return seq_sum.mean() / scale


def _forward(model, batch):
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 position_ids=batch["position_ids"]).logits


def _log_prob(model, batch, prompt_len: int) -> torch.Tensor:
    """log pi(response token t | everything before it), (bs, R), read at the position before each token."""
    logits = _forward(model, batch)[:, prompt_len - 1:-1]  # (bs, R, V)
    return logits.log_softmax(-1).gather(-1, batch["responses"][..., None])[..., 0] * batch["response_mask"]


def _values(model, batch, prompt_len: int) -> torch.Tensor:
    """V(s_t), read at the position before response token t, (bs, R)."""
    return _forward(model, batch)[:, prompt_len - 1:-1, 0] * batch["response_mask"]


def _gae(rewards, values, mask):
    """Schulman et al. 2016: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}; V and A
    after a response's last token are 0 (responses are right-padded, so a row's tokens come first)."""
    advantages = torch.zeros_like(rewards)
    for row in range(rewards.shape[0]):
        running, next_value = 0.0, 0.0
        for t in reversed(range(int(mask[row].sum()))):
            delta = rewards[row, t] + GAMMA * next_value - values[row, t]
            running = delta + GAMMA * LAM * running
            advantages[row, t] = running
            next_value = values[row, t]
    returns = (advantages + values) * mask
    tokens = advantages[mask.bool()]
    whitened = (advantages - tokens.mean()) / torch.sqrt(tokens.var(unbiased=True) + 1e-8)
    return whitened * mask, returns


def _clip_and_step(model, optimizer, max_norm: float) -> float:
    """torch/verl gradient clipping written out: scale by max_norm / (norm + 1e-6) when that is below 1."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = float(torch.sqrt(sum((g * g).sum() for g in grads)))
    factor = max_norm / (norm + 1e-6)
    if factor < 1:
        for g in grads:
            g.mul_(factor)
    optimizer.step()
    return norm


def _adamw(model, lr):
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY, eps=ADAM_EPS,
                             foreach=False, fused=False)


def _reference_step(actor, ref, critic, batch, tokenizer, mode: str, grad_clip: float):
    """The step of the module docstring on float64 copies; returns what the test compares."""
    prompt_len = batch["prompts"].shape[1]
    mask = batch["response_mask"].double()
    rows = mask.shape[0]
    with torch.no_grad():
        old_log_prob = _log_prob(actor, batch, prompt_len)
        ref_log_prob = _log_prob(ref, batch, prompt_len)
        values = _values(critic, batch, prompt_len)
    # the reward at each response's last token, less beta x k1 on every token (algorithm.kl_penalty=kl)
    scores = torch.zeros_like(mask)
    for row in range(rows):
        length = int(mask[row].sum())
        text = tokenizer.decode(batch["responses"][row, :length].tolist(), skip_special_tokens=True)
        scores[row, length - 1] = _score(text)
    kl = (old_log_prob - ref_log_prob) * mask
    rewards = scores - KL_COEF * kl
    batch_kl = float(((kl.sum(-1) / mask.sum(-1))).mean())
    error = min(max(batch_kl / TARGET_KL - 1.0, -0.2), 0.2)
    next_kl_coef = KL_COEF * (1.0 + error * rows / HORIZON)  # Ziegler et al. 2019, eq. 2, n_steps = batch rows
    advantages, returns = _gae(rewards, values, mask)

    mini = rows // 2
    critic_optimizer, critic_norms = _adamw(critic, CRITIC_LR), []
    for start in range(0, rows, mini):
        part = {key: value[start:start + mini] for key, value in batch.items()}
        m = mask[start:start + mini]
        critic_optimizer.zero_grad()
        vpreds = _values(critic, part, prompt_len)
        old = values[start:start + mini]
        clipped = torch.clamp(vpreds, old - CLIPRANGE_VALUE, old + CLIPRANGE_VALUE)
        target = returns[start:start + mini]
        loss = 0.5 * _agg(torch.maximum((vpreds - target) ** 2, (clipped - target) ** 2), m, mode, MAX_RESPONSE)
        loss.backward()
        critic_norms.append(_clip_and_step(critic, critic_optimizer, grad_clip))

    actor_optimizer, actor_norms, policy_tokens = _adamw(actor, ACTOR_LR), [], []
    for start in range(0, rows, mini):
        part = {key: value[start:start + mini] for key, value in batch.items()}
        m = mask[start:start + mini]
        actor_optimizer.zero_grad()
        log_prob = _log_prob(actor, part, prompt_len)
        adv = advantages[start:start + mini]
        ratio = torch.exp(log_prob - old_log_prob[start:start + mini])
        surrogate = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP_RATIO, 1 + CLIP_RATIO))
        surrogate = torch.where(adv < 0, torch.minimum(surrogate, -adv * CLIP_RATIO_C), surrogate)  # dual clip
        log_ref_ratio = ref_log_prob[start:start + mini] - log_prob
        k3 = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # Schulman 2020's low-variance estimator
        with torch.no_grad():  # per token: whether the clipped surrogate is the larger one, and old - new log-prob
            clipped = -adv * torch.clamp(ratio, 1 - CLIP_RATIO, 1 + CLIP_RATIO) > -adv * ratio
            policy_tokens.append((clipped.double(), old_log_prob[start:start + mini] - log_prob, m))
        loss = _agg(surrogate, m, mode, MAX_RESPONSE) + KL_LOSS_COEF * _agg(k3, m, mode, MAX_RESPONSE)
        loss.backward()
        actor_norms.append(_clip_and_step(actor, actor_optimizer, grad_clip))
    return {"advantages": advantages, "returns": returns, "kl_coef": next_kl_coef, "batch_kl": batch_kl,
            "actor_optimizer": actor_optimizer, "critic_optimizer": critic_optimizer,
            "actor/grad_norm": sum(actor_norms) / len(actor_norms),
            "critic/grad_norm": sum(critic_norms) / len(critic_norms), "clipped": (actor_norms, critic_norms),
            "policy_tokens": policy_tokens}


def _trainer(workspace, mode: str, micro: int, grad_clip: float):  # noqa: F811
    root, model, reward = workspace
    cfg = load_config(_overrides(
        root, model, f"custom_reward_function.path={reward}", f"data.max_response_length={MAX_RESPONSE}",
        f"actor_rollout_ref.rollout.n={N}", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "critic.ppo_mini_batch_size=2", f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"critic.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.actor.loss_agg_mode={mode}", f"critic.loss_agg_mode={mode}",
        f"actor_rollout_ref.actor.optim.lr={ACTOR_LR}", f"critic.optim.lr={CRITIC_LR}",
        f"actor_rollout_ref.actor.grad_clip={grad_clip}", f"critic.grad_clip={grad_clip}",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        f"actor_rollout_ref.actor.kl_loss_coef={KL_LOSS_COEF}", "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=kl", "algorithm.kl_ctrl.type=adaptive", f"algorithm.kl_ctrl.kl_coef={KL_COEF}",
        f"algorithm.kl_ctrl.target_kl={TARGET_KL}", f"algorithm.kl_ctrl.horizon={HORIZON}",
        f"critic.cliprange_value={CLIPRANGE_VALUE}", f"algorithm.gamma={GAMMA}", f"algorithm.lam={LAM}",
        "trainer.seed=5"))
    trainer = build_trainer(cfg)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        # the policy a little away from the reference (else every KL term is 0), the value head not all 0
        for p in trainer.actor.module.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
        trainer.critic.forward_module.score.weight.normal_(0.0, 0.5, generator=generator)
    trainer.reward_manager.reward_fn = lambda data_source, solution_str, ground_truth, extra_info=None: \
        _score(solution_str)
    return trainer


#: each row's response length: the sampled responses, cut (as an EOS would) to lengths of 1 to 8 tokens
LENGTHS = [8, 3, 5, 1, 6, 2, 8, 4]


def _cut(batch, pad_id: int) -> None:
    """Each sampled response (all run to the full width here) cut to its row's ``LENGTHS``, in place."""
    prompt_len = batch["prompts"].shape[1]
    assert batch["response_mask"].all()
    for row, length in enumerate(LENGTHS):
        batch["responses"][row, length:] = pad_id
        batch["input_ids"][row, prompt_len + length:] = pad_id
        batch["attention_mask"][row, prompt_len + length:] = 0
        batch["response_mask"][row, length:] = 0


def _run(workspace, mode: str, micro: int, grad_clip: float):  # noqa: F811
    trainer = _trainer(workspace, mode, micro, grad_clip)
    copies = [copy.deepcopy(m).double() for m in (trainer.actor.module, trainer.actor.ref_module,
                                                   trainer.critic.module)]
    seen = {}
    generate = trainer.actor.generate

    def recording(prompts, params):
        seen["batch"] = batch = generate(prompts, params)
        _cut(batch, trainer.tokenizer.pad_token_id)
        seen["tokens"] = {k: batch[k].clone() for k in ("prompts", "responses", "input_ids", "attention_mask",
                                                        "position_ids", "response_mask")}
        return batch

    trainer.actor.generate = recording
    metrics = trainer.train_step(trainer.train_dataset.collate(list(range(ROWS // N))))
    expected = _reference_step(*copies, seen["tokens"], trainer.tokenizer, mode, grad_clip)
    return trainer, copies, seen["batch"], metrics, expected


def _assert_same_update(module, optimizer, reference, reference_optimizer, lr):
    """The trainer's float32 step against the float64 one. AdamW's moments hold the clipped gradients: each within
    1e-3 of its tensor's largest element (the same formulas run in float32 land up to 2.5e-4 from float64 here:
    the second mini-batch's ratios follow the first step, whose size for a gradient near 0 is sensitive; a wrong
    weighting of tokens, sequences or micro-batches moves them by several percent). The weights within a tenth
    of one Adam step (about lr each, whatever the gradient's scale)."""
    reference_params = dict(reference.named_parameters())
    for name, p in module.named_parameters():
        ref_p = reference_params[name]
        torch.testing.assert_close(p.detach().double(), ref_p.detach(), rtol=0, atol=lr * 0.1, msg=name)
        state, ref_state = optimizer.state[p], reference_optimizer.state[ref_p]
        for key in ("exp_avg", "exp_avg_sq"):
            scale = float(ref_state[key].abs().max())
            torch.testing.assert_close(state[key].double(), ref_state[key], rtol=1e-3, atol=1e-3 * scale,
                                       msg=f"{name} {key}")


def _check(workspace, mode: str, micro: int, grad_clip: float):  # noqa: F811
    trainer, (actor, _, critic), batch, metrics, expected = _run(workspace, mode, micro, grad_clip)
    mask = batch["response_mask"].bool()
    assert mask.sum(-1).min() >= 1 and mask.sum(-1).max() > mask.sum(-1).min()  # responses of several lengths
    torch.testing.assert_close(batch["returns"].double(), expected["returns"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch["advantages"].double(), expected["advantages"], rtol=1e-4, atol=1e-4)
    assert expected["batch_kl"] > 1e-3  # the KL penalty is not 0
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(expected["batch_kl"], rel=1e-4)
    assert trainer.kl_ctrl.value == pytest.approx(expected["kl_coef"], rel=1e-6)
    for key in ("actor/grad_norm", "critic/grad_norm"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-4), key
    _assert_same_update(trainer.actor.module, trainer.actor.optimizer, actor, expected["actor_optimizer"], ACTOR_LR)
    _assert_same_update(trainer.critic.module, trainer.critic.optimizer, critic, expected["critic_optimizer"],
                        CRITIC_LR)
    return expected, metrics


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("micro", [1, 4])
def test_one_step_equals_the_update_worked_out_from_verls_definitions(workspace, mode, micro):  # noqa: F811
    """Micro-batches of 1 row and of the whole mini-batch (4 rows) give the mini-batch's update, in every mode."""
    expected, _ = _check(workspace, mode, micro, grad_clip=1e6)
    assert max(expected["clipped"][0] + expected["clipped"][1]) < 1e6  # no clipping here


def test_a_tiny_grad_clip_scales_each_mini_batch_gradient_to_it(workspace):  # noqa: F811
    expected, _ = _check(workspace, "token-mean", 2, grad_clip=1e-3)
    assert min(expected["clipped"][0] + expected["clipped"][1]) > 1e-2  # every gradient clipped, by 10x or more


def test_an_infinite_grad_clip_leaves_every_gradient_as_it_is(workspace):  # noqa: F811
    """grad_clip=inf (its help: no clipping) loads and gives the update of gradients never scaled, though they are
    above the default grad_clip of 1.0, which would have scaled them."""
    expected, metrics = _check(workspace, "token-mean", 2, grad_clip=math.inf)
    assert max(expected["clipped"][0] + expected["clipped"][1]) > 1.0
    assert all(math.isfinite(metrics[key]) for key in ("actor/grad_norm", "critic/grad_norm"))


def test_the_value_loss_is_clipped_around_the_rollout_values(workspace):  # noqa: F811
    """With cliprange_value 0.05 some tokens' clipped loss is the larger one: the comparison above then covers
    the clipped branch (its gradient is 0 where the clamp binds)."""
    _, metrics = _check(workspace, "token-mean", 1, grad_clip=1e6)
    assert 0 < metrics["critic/vf_clipfrac"] < 1
    assert 0 < metrics["actor/pg_clipfrac"] < 1  # and the policy's clipped surrogate, in the second mini-batch


def test_policy_metrics_are_token_means_over_each_mini_batch_whatever_its_micro_batches(workspace):  # noqa: F811
    """actor/pg_clipfrac and actor/ppo_kl under token-mean: each mini-batch's mean over its tokens, averaged over
    the mini-batches, from micro-batches of one response each (1 to 8 tokens): the mean of the micro-batches' own
    means, which weighs a 1-token response as an 8-token one, is another figure here."""
    expected, metrics = _check(workspace, "token-mean", 1, grad_clip=1e6)
    for name, column in (("actor/pg_clipfrac", 0), ("actor/ppo_kl", 1)):
        by_token, by_response = [], []
        for tokens in expected["policy_tokens"]:
            value, mask = tokens[column], tokens[2]
            by_token.append(float((value * mask).sum() / mask.sum()))
            by_response.append(float(((value * mask).sum(-1) / mask.sum(-1)).mean()))
        want, other = sum(by_token) / len(by_token), sum(by_response) / len(by_response)
        assert abs(want - other) > 0.1 * abs(want) > 0, name  # the weighting shows
        assert metrics[name] == pytest.approx(want, rel=1e-3), name
