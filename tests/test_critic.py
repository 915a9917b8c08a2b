"""The critic and the PPO update loop around it, against values worked out here: the value loss and its metrics
as logged by an update, the positions values are read at, critic_warmup, the epochs and mini-batches of an update,
and the critic's own optimizer settings."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.config import ConfigError, load_config
from rlhf_core.main_ppo import build_trainer
from rlhf_core.workers import actor as actor_module
from rlhf_core.workers import common
from rlhf_core.workers import critic as critic_module

pytestmark = pytest.mark.usefixtures("one_thread")


def _trainer(workspace, tmp_path, *extra):
    return build_trainer(load_config(workspace.overrides(tmp_path / "out", *extra)))


def _random_value_head(trainer, seed: int = 0) -> None:
    """A value head drawn at random (a new one starts at zero, so every value would be 0)."""
    generator = torch.Generator().manual_seed(seed)
    trainer.critic.module.score.weight.data.normal_(generator=generator)


def _rollout(trainer, rows, lengths=None):
    """Responses of the training prompts ``rows`` (rollout.n=2 each); with ``lengths`` each response is cut to its
    length (the rest padding, as after an EOS), so that rows differ in prompt and response length."""
    batch = trainer.actor.generate(trainer.train_dataset.collate(rows), trainer._train_params())
    if lengths is not None:
        prompt_width, response_width = batch["prompts"].shape[1], batch["responses"].shape[1]
        kept = torch.arange(response_width)[None] < torch.tensor(lengths)[:, None]  # (bs, R)
        batch["response_mask"] = kept.to(batch["response_mask"].dtype)
        batch["attention_mask"][:, prompt_width:] = kept.to(batch["attention_mask"].dtype)
        batch["responses"] = torch.where(kept, batch["responses"], 0)
        batch["input_ids"][:, prompt_width:] = batch["responses"]
    return batch


LENGTHS = [3, 8, 1, 5, 2, 2, 7, 4, 6, 3, 1, 5]


@pytest.mark.parametrize("extra", [
    (), ("critic.model.use_remove_padding=true",), ("critic.model.use_shared_prefix=true",),
    ("critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=700"),
], ids=["padded", "remove_padding", "shared_prefix", "dynamic_bsz"])
def test_each_value_is_read_before_its_token_as_for_the_row_alone(workspace, tmp_path, extra):
    """Prompts left-padded to different lengths, responses of different lengths: the value of response token t is the
    critic's output at the position before it (the last prompt token for t=0), as a forward of the row alone, without
    any padding, gives it (verl's values[:, -response_len - 1:-1]); 0 after the response."""
    trainer = _trainer(workspace, tmp_path, *extra)
    _random_value_head(trainer)
    batch = _rollout(trainer, [0, 5, 9, 13, 20, 27], LENGTHS)
    prompt_width = batch["prompts"].shape[1]
    assert len(set(batch["attention_mask"][:, :prompt_width].sum(-1).tolist())) > 2  # prompts of several lengths
    values = trainer.critic.compute_values(batch)
    for row, length in enumerate(LENGTHS):
        tokens = batch["input_ids"][row][batch["attention_mask"][row].bool()][None]  # the row alone, unpadded
        prompt_length = int(batch["attention_mask"][row, :prompt_width].sum())
        with torch.no_grad():
            alone = trainer.critic.forward_module(input_ids=tokens).logits[0, :, 0]  # (prompt + response,)
        expected = alone[prompt_length - 1:prompt_length - 1 + length]
        torch.testing.assert_close(values[row, :length], expected, rtol=0, atol=1e-5)
        assert not values[row, length:].any()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_an_updates_value_loss_and_metrics_by_hand(workspace, tmp_path, mode):
    """Two epochs over two mini-batches of 8 sequences (4 prompts x rollout.n=2), micro-batches of 2, at a rate too
    small to move the weights: each mini-batch's loss is 0.5 * agg(max((V - R)^2, (clip(V, V_old +- 0.2) - R)^2)) over
    its own tokens (seq-mean-token-sum-norm: divided by max_response_length, 8), critic/vf_clipfrac the share of its
    tokens where the clipped error is the larger, critic/vpred_mean its tokens' mean prediction; each metric is the
    mean over the mini-batches."""
    trainer = _trainer(workspace, tmp_path, "critic.optim.lr=1e-30", "critic.ppo_micro_batch_size_per_gpu=2",
                       f"critic.loss_agg_mode={mode}", "critic.cliprange_value=0.2", "critic.ppo_epochs=2")
    _random_value_head(trainer)
    lengths = [8, 3, 5, 1, 8, 2, 7, 4, 6, 8, 1, 3, 2, 5, 8, 4]
    batch = _rollout(trainer, [0, 5, 9, 13, 20, 27, 1, 2], lengths)
    mask = batch["response_mask"].double()
    with torch.no_grad():
        vpreds = critic_module.response_values(trainer.critic.forward_module, batch).double()
    generator = torch.Generator().manual_seed(1)
    old_values = (vpreds + 0.4 * torch.randn(vpreds.shape, generator=generator, dtype=torch.float64)) * mask
    returns = torch.randn(vpreds.shape, generator=generator, dtype=torch.float64) * mask
    batch["values"], batch["returns"] = old_values.float(), returns.float()
    old_values, returns = batch["values"].double(), batch["returns"].double()

    metrics = trainer.critic.update_critic(batch, 2)

    losses, clipfracs, vpred_means = [], [], []
    for rows in (slice(0, 8), slice(8, 16)):
        v, v_old, ret, m = vpreds[rows], old_values[rows], returns[rows], mask[rows]
        clipped = torch.minimum(torch.maximum(v, v_old - 0.2), v_old + 0.2)
        unclipped_error, clipped_error = (v - ret) ** 2, (clipped - ret) ** 2
        per_token = torch.maximum(unclipped_error, clipped_error) * m
        per_sequence = per_token.sum(-1)
        agg = {"token-mean": per_token.sum() / m.sum(), "seq-mean-token-sum": per_sequence.mean(),
               "seq-mean-token-mean": (per_sequence / m.sum(-1)).mean(),
               "seq-mean-token-sum-norm": per_sequence.mean() / 8}[mode]
        losses.append(0.5 * float(agg))
        clipfracs.append(float(((clipped_error > unclipped_error).double() * m).sum() / m.sum()))
        vpred_means.append(float((v * m).sum() / m.sum()))
    assert 0 < sum(clipfracs) / 2 < 1  # some tokens clipped, some not
    assert metrics["critic/vf_loss"] == pytest.approx(sum(losses) / 2, rel=1e-5)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(sum(clipfracs) / 2, rel=1e-5)
    assert metrics["critic/vpred_mean"] == pytest.approx(sum(vpred_means) / 2, rel=1e-5)


def test_critic_warmup_holds_the_actor_for_its_steps(workspace, tmp_path):
    """trainer.critic_warmup=2: steps 1 and 2 train the critic alone (the actor's weights as loaded, no actor/ update
    metrics, checkpoints saved with those weights); step 3 is the actor's first update."""
    trainer = _trainer(workspace, tmp_path, "trainer.critic_warmup=2", "trainer.total_training_steps=3",
                       "trainer.save_freq=1", "trainer.test_freq=-1")
    initial_actor = {name: value.clone() for name, value in trainer.actor.module.state_dict().items()}
    critic_before = trainer.critic.module.score.weight.detach().clone()
    logged = {}

    def logger(metrics, step):
        actor_same = all(torch.equal(value, initial_actor[name])
                         for name, value in trainer.actor.module.state_dict().items())
        critic_weight = trainer.critic.module.score.weight.detach().clone()
        logged[step] = (set(metrics), actor_same, critic_weight)

    trainer.logger = logger
    trainer.fit()
    assert sorted(logged) == [1, 2, 3]
    critic_weights = [critic_before] + [logged[step][2] for step in (1, 2, 3)]
    for step in (1, 2, 3):
        keys, actor_same, _ = logged[step]
        assert actor_same is (step <= 2), step
        assert ("actor/pg_loss" in keys and "actor/lr" in keys and "actor/grad_norm" in keys) is (step == 3), step
        assert "critic/vf_loss" in keys and "actor/entropy" in keys
        assert not torch.equal(critic_weights[step], critic_weights[step - 1]), step  # the critic trains every step
    saved = torch.load(tmp_path / "out" / "global_step_2" / "actor" / "model_state.pt", weights_only=True)
    assert all(torch.equal(saved[name], initial_actor[name]) for name in initial_actor)


def test_epochs_visit_every_sequence_once_in_mini_batches_of_prompts_times_n(workspace, tmp_path, monkeypatch):
    """ppo_epochs=3 with shuffle: every epoch of each update goes over the 16 sequences once, in a new order; the
    actor in mini-batches of ppo_mini_batch_size (4 prompts) x rollout.n (2) = 8 sequences (2 optimizer steps an
    epoch), the critic in its own, 2 x 2 = 4 (4 steps an epoch); every mini-batch of every epoch sees the old
    log-probs computed before the first."""
    trainer = _trainer(workspace, tmp_path, "actor_rollout_ref.actor.ppo_epochs=3", "actor_rollout_ref.actor.shuffle=true",
                       "critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size_per_gpu=2")
    mini_batches = {"actor": [], "critic": []}  # the rows of each optimizer step, by role
    pending = {"actor": [], "critic": []}  # the rows of the micro-batches since the role's last step
    old_log_probs = []
    clip = common.clip_and_check

    def counted(params, max_norm):  # once per mini-batch, after its micro-batches: (the critic's update comes first)
        [role] = [role for role, rows in pending.items() if rows]
        mini_batches[role].append(sorted(pending[role]))
        pending[role].clear()
        return clip(params, max_norm)

    monkeypatch.setattr(common, "clip_and_check", counted)
    policy_loss, value_loss = trainer.actor.policy_loss, trainer.critic.value_loss

    def recording_policy_loss(mb, *args):
        pending["actor"].extend(mb["row"].tolist())
        old_log_probs.append((mb["row"].clone(), mb["old_log_prob"].clone()))
        return policy_loss(mb, *args)

    def recording_value_loss(mb, *args):
        pending["critic"].extend(mb["row"].tolist())
        return value_loss(mb, *args)

    trainer.actor.policy_loss, trainer.critic.value_loss = recording_policy_loss, recording_value_loss
    compute_log_prob, update_critic = trainer.actor.compute_log_prob, trainer.critic.update_critic
    before_update = {}

    def recording_log_prob(batch):
        log_prob, entropy = compute_log_prob(batch)
        before_update["old_log_prob"] = log_prob.clone()
        return log_prob, entropy

    def numbering_update(batch, n):
        batch["row"] = torch.arange(len(batch))  # (the actor's update comes after, on the same batch)
        return update_critic(batch, n)

    trainer.actor.compute_log_prob, trainer.critic.update_critic = recording_log_prob, numbering_update
    trainer.train_step(trainer.train_dataset.collate(list(range(8))))

    for role, size, per_epoch in (("actor", 8, 2), ("critic", 4, 4)):
        steps = mini_batches[role]
        assert len(steps) == 3 * per_epoch, role
        assert all(len(rows) == size for rows in steps), role
        epochs = [sorted(sum(steps[e * per_epoch:(e + 1) * per_epoch], [])) for e in range(3)]
        assert epochs == [list(range(16))] * 3, role
    actor_epochs = [tuple(map(tuple, mini_batches["actor"][e * 2:(e + 1) * 2])) for e in range(3)]
    assert len(set(actor_epochs)) == 3  # shuffled anew each epoch: other rows meet in a mini-batch
    assert len(old_log_probs) == 3 * 2 * 2  # 3 epochs x 2 mini-batches x 2 micro-batches of 4
    for rows, old in old_log_probs:
        assert torch.equal(old, before_update["old_log_prob"][rows])


def test_the_critic_optimizer_is_the_critics_own(workspace, tmp_path, monkeypatch):
    """critic.optim (rate, betas, weight decay, warm-up) and critic.grad_clip build the critic's optimizer and update;
    the actor's keys, set otherwise, build the actor's."""
    updates = {}

    def recorder(module, role):
        real = module.ppo_update

        def recording(worker, batch, **kwargs):
            updates[role] = kwargs["grad_clip"]
            return real(worker, batch, **kwargs)

        monkeypatch.setattr(module, "ppo_update", recording)

    recorder(actor_module, "actor")
    recorder(critic_module, "critic")
    trainer = _trainer(workspace, tmp_path, "actor_rollout_ref.actor.optim.lr=1e-2",
                       "actor_rollout_ref.actor.optim.lr_warmup_steps=0", "actor_rollout_ref.actor.grad_clip=1.0",
                       "critic.optim.lr=3e-3", "critic.optim.betas=[0.8,0.9]", "critic.optim.weight_decay=0.2",
                       "critic.optim.lr_warmup_steps=4", "critic.grad_clip=0.25")
    group = trainer.critic.optimizer.param_groups[0]
    assert (tuple(group["betas"]), group["weight_decay"]) == ((0.8, 0.9), 0.2)
    actor_group = trainer.actor.optimizer.param_groups[0]
    assert (tuple(actor_group["betas"]), actor_group["weight_decay"]) == ((0.9, 0.999), 0.01)
    rates = []
    for step in range(2):
        metrics = trainer.train_step(trainer.train_dataset.collate(list(range(8 * step, 8 * step + 8))))
        rates.append((metrics["actor/lr"], metrics["critic/lr"]))
    assert rates[0] == pytest.approx((1e-2, 0.0))  # the critic warms up over its own 4 steps, the actor not at all
    assert rates[1] == pytest.approx((1e-2, 3e-3 / 4))
    assert updates == {"actor": 1.0, "critic": 0.25}


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus"])
def test_critic_warmup_without_a_critic_is_refused(estimator):
    """A warm-up holds the actor back for a critic to train alone: with an estimator that trains none, those steps
    would train nothing (verl runs them so), so the config is refused before any model loads."""
    with pytest.raises(ConfigError, match=rf"trainer.critic_warmup=3 holds the actor back .* "
                                          rf"algorithm.adv_estimator={estimator} trains no critic.*"
                                          r"set trainer.critic_warmup=0"):
        load_config([f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=2", "trainer.critic_warmup=3"])
    assert load_config([f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=2",
                        "trainer.critic_warmup=0"]).trainer.critic_warmup == 0
    assert load_config(["algorithm.adv_estimator=gae", "trainer.critic_warmup=3"]).trainer.critic_warmup == 3
    with pytest.raises(ConfigError, match=r"trainer.critic_warmup=-1 must be >= 0"):
        load_config(["trainer.critic_warmup=-1"])
