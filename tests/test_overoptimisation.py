"""Reward-model over-optimisation: the guard's rule on hand-written validation sequences, and a PPO run
against a planted reward model that pays for length, with the GSM8K rule as gold, rolled back (or stopped)
at the best-gold checkpoint."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.batch import Batch
from rlhf_core.config import GuardConfig, load_config
from rlhf_core.data.synthetic import build_dataset
from rlhf_core.main_ppo import build_trainer
from rlhf_core.models.toy import random_toy_model
from rlhf_core.rewards.manager import RewardManager
from rlhf_core.rewards.reward_model import RewardModelManager
from rlhf_core.training import checkpoint
from rlhf_core.training.guards import GuardError, OverOptimisationGuard, proxy_and_gold

# ----------------------------------------------------------------------------- the rule


def _guard(**kw) -> OverOptimisationGuard:
    return OverOptimisationGuard(GuardConfig(**{"overopt_patience": 2, "max_rollbacks": 3, **kw}))


def test_proxy_up_gold_down_for_patience_validations_rolls_back_to_the_best_gold():
    guard = _guard()
    assert guard.observe(0, 0.1, 0.5) == (True, None)  # first validation: the best gold so far
    assert guard.observe(10, 0.2, 0.6) == (True, None)  # both rise: a new best gold, no divergence
    assert guard.observe(20, 0.3, 0.55) == (False, None)  # proxy up, gold down: 1 of 2
    new_best, event = guard.observe(30, 0.4, 0.5)  # 2 of 2
    assert not new_best
    assert (event.kind, event.action, event.target_step) == ("over_optimisation", "rollback", 10)
    assert "proxy (reward model) reward rose while the gold (rule) reward fell for 2 validations" in event.message
    assert guard.rollbacks == 1
    # the restored policy is compared with what the best-gold one scored (0.2, 0.6): one more divergence is 1 of 2
    assert guard.observe(40, 0.5, 0.4) == (False, None)
    assert guard.streak == 1
    assert guard.protected_steps() == {10}


def test_a_validation_that_rolls_back_is_no_accuracy_best():
    """Validation at step 30 is the best accuracy so far and the over-optimisation guard's second divergence:
    the weights it measured are replaced by step 10's, so the val-drop guard keeps step 10 as its best."""
    import contextlib
    import types

    from rlhf_core.training.guards import Guard
    from rlhf_core.training.trainer import PPOTrainer

    config = GuardConfig(overopt_patience=2, max_rollbacks=3, max_val_drop=0.1)
    trainer = types.SimpleNamespace(guard=Guard(config), overopt=OverOptimisationGuard(config),
                                    _log_generations=lambda step: None, _note_idle_guards=lambda metrics: None,
                                    hooked=lambda name: contextlib.nullcontext())
    trainer.val_accuracy = lambda metrics: metrics["val-core/a/acc/mean@1"]
    validations = {0: (0.30, 0.1, 0.5), 10: (0.40, 0.2, 0.6), 20: (0.35, 0.3, 0.55), 30: (0.45, 0.4, 0.5)}
    for step, (acc, proxy, gold) in validations.items():
        trainer.validate = lambda acc=acc, proxy=proxy, gold=gold: {
            "val-core/a/acc/mean@1": acc, "val-aux/a/reward/mean@1": proxy, "val-aux/a/gold_reward/mean@1": gold}
        new_best, event = PPOTrainer._validate_step(trainer, step, {}, None)
    assert (event.kind, event.target_step, new_best) == ("over_optimisation", 10, False)
    assert (trainer.guard.best_step, trainer.guard.best_val) == (10, 0.40)  # not step 30's 0.45


def test_after_another_guards_rollback_the_restored_weights_are_compared_with_their_own_scores():
    """A KL rollback to step 10 abandons the weights validated at 20 (the best gold) and 30 (one divergence):
    the next validations compare with step 10's scores, the streak starts again, and the best gold is step 10's."""
    guard, saved = _guard(), []
    for step, proxy, gold in [(0, 0.1, 0.5), (10, 0.2, 0.6), (20, 0.3, 0.7), (30, 0.4, 0.65)]:
        guard.observe(step, proxy, gold)
        saved.append(step)  # each validation checkpointed
        guard.keep_restorable(saved)
    assert (guard.streak, guard.best_step) == (1, 20)
    guard.on_restore(10)
    assert (guard.streak, guard.previous, guard.best_gold, guard.best_step) == (0, (0.2, 0.6), 0.6, 10)
    assert guard.protected_steps() == {10}
    # proxy 0.5 > 0.4 and gold 0.6 < 0.65 was a second divergence from the abandoned weights; from step 10's
    # (0.2, 0.6) the gold did not fall, and it ties the best: no streak, no new best
    assert guard.observe(40, 0.5, 0.6) == (False, None)
    assert guard.observe(50, 0.6, 0.5) == (False, None)  # 1 of 2
    _, event = guard.observe(60, 0.7, 0.4)  # 2 of 2: back to step 10, not to the abandoned step 20
    assert (event.action, event.target_step) == ("rollback", 10)


def test_a_rollback_to_a_step_never_validated_clears_the_over_optimisation_guards_best():
    guard = _guard()
    for step, proxy, gold in [(10, 0.2, 0.6), (20, 0.3, 0.7)]:
        guard.observe(step, proxy, gold)
    guard.on_restore(15)  # a checkpoint between validations (a KL streak's anchor)
    assert (guard.streak, guard.previous, guard.best_gold, guard.best_step) == (0, None, None, None)
    assert guard.protected_steps() == set()
    assert guard.observe(30, 0.4, 0.3) == (True, None)  # the restored policy's first validation: the new best
    assert guard.observe(40, 0.5, 0.2) == (False, None)  # 1 of 2, from step 30's scores
    guard.on_restore(30)  # a rollback to the best itself keeps it
    assert (guard.streak, guard.previous, guard.best_gold, guard.best_step) == (0, (0.4, 0.3), 0.3, 30)


def test_the_checkpoint_saved_after_a_rollback_keeps_the_restored_steps_scores_for_a_later_rollback_to_it():
    """Step 30's rollback restores step 10 (proxy 0.2, gold 0.6) and saves its weights as step 30, which then scores
    what step 10 did, in the state a resume loads. A KL rollback at step 50 to step 30 abandons step 40's best gold
    0.8: step 30 becomes the best with gold 0.6, and steps 60 and 70 diverge from its (0.2, 0.6) and restore it."""
    guard = _guard()
    assert guard.observe(10, 0.2, 0.6) == (True, None)
    guard.keep_restorable([10])
    assert guard.observe(20, 0.3, 0.5) == (False, None)
    guard.keep_restorable([10, 20])
    _, event = guard.observe(30, 0.4, 0.4)
    assert (event.action, event.target_step) == ("rollback", 10)
    guard.on_restore(10, at=30)
    guard.keep_restorable([10, 30])  # step 20 abandoned, step 30 saved after the rollback
    assert guard.state_dict()["validated"] == [[10, 0.2, 0.6], [30, 0.2, 0.6]]
    resumed = _guard()
    resumed.load_state_dict(guard.state_dict())
    resumed.keep_restorable([10, 30])
    assert resumed.observe(40, 0.3, 0.8) == (True, None)
    resumed.keep_restorable([10, 30, 40])
    resumed.on_restore(30, at=50)
    assert (resumed.previous, resumed.best_proxy, resumed.best_gold, resumed.best_step) == ((0.2, 0.6), 0.2, 0.6, 30)
    assert resumed.observe(60, 0.5, 0.5) == (False, None)  # 1 of 2
    _, event = resumed.observe(70, 0.6, 0.4)
    assert (event.action, event.target_step) == ("rollback", 30)


def test_only_the_scores_and_the_best_of_restorable_steps_are_kept():
    """A validation whose step has no checkpoint cannot be restored: its scores are dropped at the next save; at a
    resume, a best whose checkpoint is not among those the run can restore gives way to the best of those it can."""
    guard = _guard()
    for step, proxy, gold in [(10, 0.2, 0.6), (11, 0.3, 0.5), (12, 0.35, 0.55)]:
        guard.observe(step, proxy, gold)
    guard.keep_restorable([10, 12])
    assert guard.state_dict()["validated"] == [[10, 0.2, 0.6], [12, 0.35, 0.55]]
    guard.on_restore(12)
    assert (guard.previous, guard.best_gold, guard.best_step) == ((0.35, 0.55), 0.6, 10)
    guard.keep_restorable([12])
    assert (guard.previous, guard.best_gold, guard.best_step) == ((0.35, 0.55), 0.55, 12)
    assert guard.state_dict()["validated"] == [[12, 0.35, 0.55]]
    guard.keep_restorable([])
    assert (guard.best_gold, guard.best_step) == (None, None)


def test_a_resume_without_the_best_rolls_back_to_the_best_it_can_restore_never_to_the_step_judged():
    """Steps 10 and 20 score gold 0.6; a resume from step 20 alone (step 10 not beside it) lost the best. Step 30's
    divergence (proxy up, gold 0.5) then rolled back to step 30 itself, which had no checkpoint, naming its gold
    0.5 the best: the best is now step 20's 0.6, restorable."""
    guard = _guard(overopt_patience=1)
    guard.observe(10, 0.2, 0.6)
    guard.keep_restorable([10])
    guard.observe(20, 0.2, 0.6)
    guard.keep_restorable([10, 20])
    guard.keep_restorable([20])  # resumed from step 20 alone
    assert (guard.best_step, guard.best_gold) == (20, 0.6)
    new_best, event = guard.observe(30, 0.3, 0.5)
    assert (new_best, event.action, event.target_step) == (False, "rollback", 20)
    assert "best gold 0.6 at step 20" in event.message
    # with nothing restorable at all, the step judged is the best: no rollback to it, which is saved first
    guard = _guard(overopt_patience=1)
    guard.observe(10, 0.2, 0.6)
    guard.keep_restorable([])
    assert guard.observe(20, 0.3, 0.5) == (True, None)
    _, event = guard.observe(30, 0.4, 0.4)
    assert (event.action, event.target_step) == ("rollback", 20)


def test_no_event_unless_the_divergence_is_unbroken():
    guard = _guard()
    for step, proxy, gold in [(0, 0.1, 0.5), (1, 0.2, 0.4), (2, 0.1, 0.3), (3, 0.3, 0.2), (4, 0.4, 0.3),
                              (5, 0.5, 0.2), (6, 0.5, 0.1)]:  # a falling proxy, a rising gold, a flat proxy
        assert guard.observe(step, proxy, gold)[1] is None


def test_stop_action_and_spent_rollbacks_stop_at_the_best_gold():
    guard = _guard(overopt_action="stop", overopt_patience=1)
    guard.observe(0, 0.1, 0.5)
    _, event = guard.observe(1, 0.2, 0.4)
    assert (event.action, event.target_step) == ("stop", 0)
    guard = _guard(overopt_patience=1, max_rollbacks=0)
    guard.observe(5, 0.1, 0.5)
    _, event = guard.observe(6, 0.2, 0.4)
    assert (event.action, event.target_step) == ("stop", 5)
    assert "max_rollbacks=0" in event.message


def test_off_without_patience_or_without_both_rewards():
    guard = _guard(overopt_patience=None)
    for step, proxy, gold in [(0, 0.1, 0.5), (1, 0.2, 0.4), (2, 0.3, 0.3)]:
        assert guard.observe(step, proxy, gold) == (False, None)
    guard = _guard()
    assert guard.observe(0, None, None) == (False, None)


def test_state_round_trips():
    guard = _guard()
    for step, proxy, gold in [(0, 0.1, 0.5), (1, 0.2, 0.4)]:
        guard.observe(step, proxy, gold)
    again = _guard()
    again.load_state_dict(guard.state_dict())
    assert again.state_dict() == guard.state_dict() == {
        "streak": 1, "previous": [0.2, 0.4], "best_gold": 0.5, "best_proxy": 0.1, "best_step": 0, "rollbacks": 0,
        "validated": [[0, 0.1, 0.5], [1, 0.2, 0.4]]}
    older = {key: value for key, value in guard.state_dict().items() if key != "validated"}
    again.load_state_dict(older)  # a checkpoint from before the validations were kept: the best's are known
    assert again.state_dict()["validated"] == [[0, 0.1, 0.5]]


def test_proxy_and_gold_are_the_means_over_sources():
    metrics = {"val-aux/a/reward/mean@1": 2.0, "val-aux/b/reward/mean@1": 4.0, "val-aux/a/gold_reward/mean@1": 0.5,
               "val-aux/b/gold_reward/mean@1": 0.25, "val-core/a/acc/mean@1": 0.5}
    assert proxy_and_gold(metrics) == (3.0, 0.375)  # no model score (a custom function's own gold): the reward
    assert proxy_and_gold({"val-aux/a/reward/mean@1": 2.0}) == (None, None)  # no gold: the guard is off


def test_with_the_rule_mixed_in_the_proxy_is_the_reward_models_score():
    """reward = rm_score + rule_coef * gold (here 1 and 1): a model score rising as fast as the gold falls leaves the
    reward flat, which the guard read as no over-optimisation. Gao et al.'s proxy is the model's score."""
    validations = [(1.0, 0.8), (1.2, 0.6), (1.4, 0.4)]  # (rm_score, gold)
    guard, events = _guard(), []
    for step, (rm_score, gold) in enumerate(validations):
        metrics = {"val-aux/a/reward/mean@1": rm_score + gold, "val-aux/a/rm_score/mean@1": rm_score,
                   "val-aux/a/gold_reward/mean@1": gold}
        assert proxy_and_gold(metrics) == (rm_score, gold)
        events.append(guard.observe(step, *proxy_and_gold(metrics))[1])
    assert events[:2] == [None, None]
    assert (events[2].action, events[2].target_step) == ("rollback", 0)


def test_proxy_and_gold_compare_the_same_responses():
    """A partly graded source gives the proxy of its graded responses; a source with none graded is left out."""
    metrics = {"val-aux/a/reward/mean@4": 2.0, "val-aux/a/gold_reward/mean@4": 0.5,
               "val-aux/b/c/reward/mean@4": 4.0, "val-aux/b/c/graded_reward/mean@4": 6.0,
               "val-aux/b/c/gold_reward/mean@4": 0.25,
               "val-core/d/reward/mean@4": 10.0, "val-aux/d/rm_score/mean@4": 10.0}  # d: no ground truth at all
    assert proxy_and_gold(metrics) == (4.0, 0.375)


# ----------------------------------------------------------------------------- a planted reward model in PPO


class LengthRewardModel(torch.nn.Module):
    """A planted reward model that pays for length: its score is the number of response tokens."""

    def compute_rm_score(self, batch: Batch) -> torch.Tensor:
        return batch["response_mask"].sum(-1).float()


# What the validations see: answers grow longer while their final answers go wrong. (suffix, right?)
SCHEDULE = [("", True), (" The answer is", True), (" Let me write a longer answer", None),
            (" Let me write an even much longer answer", False), (" short", True), (" short", True)]


def _scripted(prompts: Batch, tokenizer, text_for) -> Batch:
    """``prompts`` with the responses ``text_for(row)``, laid out as a rollout (EOS kept, right padding)."""
    ids = [tokenizer(text_for(i), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
           for i in range(len(prompts))]
    width = max(len(r) for r in ids)
    responses = torch.full((len(ids), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, r in enumerate(ids):
        responses[row, :len(r)], mask[row, :len(r)] = torch.tensor(r), 1
    pos = prompts["position_ids"][:, -1:] + torch.arange(1, width + 1)
    return Batch({"prompts": prompts["input_ids"], "responses": responses, "response_mask": mask,
                  "input_ids": torch.cat([prompts["input_ids"], responses], 1),
                  "attention_mask": torch.cat([prompts["attention_mask"], mask], 1),
                  "position_ids": torch.cat([prompts["position_ids"], pos], 1)}, dict(prompts.meta))


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    root = tmp_path_factory.mktemp("overopt")
    model = random_toy_model(root / "model", n_layers=1, hidden_size=32, max_position_embeddings=512, seed=0)
    build_dataset(root / "data", n_train=16, n_test=4, seed=0, max_ops=1)
    return root, model


def _trainer(root, model, out, *extra):
    cfg = load_config([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={root / 'data' / 'train.parquet'}",
        f"data.val_files={root / 'data' / 'test.parquet'}", "data.train_batch_size=4", "data.max_prompt_length=320",
        "data.max_response_length=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "critic.model.enable_gradient_checkpointing=false", "trainer.n_gpus_per_node=1", "trainer.device=cpu",
        f"trainer.default_local_dir={out}", "trainer.logger=[]", "trainer.total_training_steps=5",
        "trainer.test_freq=1", "trainer.val_before_train=true", "trainer.guard.overopt_patience=2",
        "trainer.guard.max_val_drop=null", "trainer.save_freq=1", *extra])
    trainer = build_trainer(cfg)
    tokenizer = trainer.tokenizer
    trainer.reward_manager = RewardModelManager(RewardManager(tokenizer), LengthRewardModel(), cfg.reward_model)
    real_generate, seen = trainer.actor.generate, []

    def generate(prompts, params):
        if params.do_sample:  # training rollouts: the policy's own samples, paid for their length
            return real_generate(prompts, params)
        suffix, right = SCHEDULE[len(seen)]
        seen.append(suffix)
        truths = prompts.meta["ground_truth"]

        def text_for(i):
            ok = right if right is not None else i % 2 == 0  # None: half of them right
            return _text(suffix, truths[i], ok)

        return _scripted(prompts, tokenizer, text_for)

    trainer.actor.generate = generate
    logged = {}
    trainer.logger = lambda metrics, step: logged.setdefault(step, dict(metrics))
    return trainer, tokenizer, logged


def _text(suffix: str, truth: str, right: bool) -> str:
    return f"{suffix} #### {truth if right else truth + '0'}".strip()  # a trailing 0 makes it wrong


def _expected_proxy_and_gold(truths: list[str], validation: int) -> tuple[float, float]:
    """By hand: the mean response length (one token per character plus EOS) and the share of right answers."""
    suffix, right = SCHEDULE[validation]
    oks = [right if right is not None else i % 2 == 0 for i in range(len(truths))]
    lengths = [len(_text(suffix, t, ok)) + 1 for t, ok in zip(truths, oks)]
    return sum(lengths) / len(lengths), sum(oks) / len(oks)


def test_a_length_paying_reward_model_is_caught_and_rolled_back_to_the_best_gold(space, tmp_path):
    root, model = space
    kl_loss = ("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.001")
    trainer, tokenizer, logged = _trainer(root, model, tmp_path / "out", *kl_loss)
    try:
        trainer.fit()
        source = "synthetic/arithmetic"
        truths = [row["ground_truth"] for row in trainer.val_dataset.rows]
        for validation, step in enumerate(range(0, 4)):
            proxy, gold = _expected_proxy_and_gold(truths, validation)
            metrics = logged[step]
            assert metrics[f"val-aux/{source}/gold_reward/mean@1"] == pytest.approx(gold)
            assert metrics[f"val-aux/{source}/reward/mean@1"] == pytest.approx(proxy)
            assert metrics[f"val-aux/{source}/rm_score/mean@1"] == pytest.approx(proxy)
        # validations 2 and 3 (steps 2, 3): proxy up, gold down -> rollback at step 3 to the best gold (step 0)
        assert logged[2]["training/rollbacks"] == 0
        assert logged[3]["training/rollbacks"] == 1
        assert trainer.overopt.best_step == 0
        best = checkpoint.load_model_state(checkpoint.step_dir(tmp_path / "out", 0))
        # after the rollback at step 3 the actor trained steps 4 and 5; the step-3 checkpoint is the restored one
        restored = checkpoint.load_model_state(checkpoint.step_dir(tmp_path / "out", 3))
        assert restored.keys() == best.keys()
        assert all(torch.equal(restored[k], best[k]) for k in best)
        trained = checkpoint.load_model_state(checkpoint.step_dir(tmp_path / "out", 2))
        assert any(not torch.equal(trained[k], best[k]) for k in best)  # PPO did move the weights before
        # the rollback tightened the KL term as after a KL explosion: kl_loss_coef doubled, the config left as started
        assert trainer.kl_loss_coef == pytest.approx(0.002)
        assert trainer.config.actor_rollout_ref.actor.kl_loss_coef == pytest.approx(0.001)
        # steps 4 and 5 validate short right answers: gold ties the best (1.0), so no new best and no streak
        proxy0, _ = _expected_proxy_and_gold(truths, 0)
        proxy4, _ = _expected_proxy_and_gold(truths, 4)
        proxy5, _ = _expected_proxy_and_gold(truths, 5)
        # the validations kept: step 0's (the restored weights), step 0's again for step 3 (its checkpoint, saved
        # after the rollback, holds them) and those after the rollback (steps 1 to 3's were of the weights it
        # abandoned)
        validated = [[0, pytest.approx(proxy0), 1.0], [3, pytest.approx(proxy0), 1.0],
                     [4, pytest.approx(proxy4), 1.0], [5, pytest.approx(proxy5), 1.0]]
        expected = {"streak": 0, "previous": [pytest.approx(proxy5), 1.0], "best_gold": 1.0,
                    "best_proxy": pytest.approx(proxy0), "best_step": 0, "rollbacks": 1, "validated": validated}
        assert trainer.state_dict()["overopt"] == expected
    finally:
        trainer.close()
    # the guard's state and the tightened coefficient are trainer state: a resume from step 5 carries them on
    fresh, _, _ = _trainer(root, model, tmp_path / "out", *kl_loss)
    try:
        assert fresh.overopt.rollbacks == 0 and fresh.kl_loss_coef == pytest.approx(0.001)
        fresh.load_checkpoint(checkpoint.step_dir(tmp_path / "out", 5))
        assert fresh.overopt.state_dict() == expected
        assert fresh.kl_loss_coef == pytest.approx(0.002)
        assert 0 in fresh.protected_steps()  # the best-gold checkpoint is never pruned
    finally:
        fresh.close()


def test_a_reward_model_mixed_with_the_rule_is_caught_as_it_rises_while_the_gold_falls(space, tmp_path):
    """reward_model.rule_coef=40: the falling gold pulls the reward PPO maximises down at validations 2 and 3 while
    the length-paying model's score rises. The guard compares the model's score with the gold and rolls back."""
    root, model = space
    trainer, _, logged = _trainer(root, model, tmp_path / "out", "reward_model.rule_coef=40")
    try:
        trainer.fit()
    finally:
        trainer.close()
    source = "synthetic/arithmetic"
    reward = [logged[step][f"val-aux/{source}/reward/mean@1"] for step in range(4)]
    assert reward[3] < reward[2] < reward[1]  # the mixed reward falls: it showed no over-optimisation
    truths = [row["ground_truth"] for row in trainer.val_dataset.rows]
    for validation in range(4):
        proxy, gold = _expected_proxy_and_gold(truths, validation)
        assert logged[validation][f"val-aux/{source}/rm_score/mean@1"] == pytest.approx(proxy)
        assert reward[validation] == pytest.approx(proxy + 40 * gold)
    assert logged[2]["training/rollbacks"] == 0
    assert logged[3]["training/rollbacks"] == 1
    assert trainer.overopt.best_step == 0


def test_overopt_action_stop_restores_the_best_gold_and_stops(space, tmp_path):
    root, model = space
    trainer, _, logged = _trainer(root, model, tmp_path / "out", "trainer.guard.overopt_action=stop")
    try:
        with pytest.raises(GuardError, match="reward over-optimisation"):
            trainer.fit()
        assert checkpoint.latest_checkpoint(tmp_path / "out") == checkpoint.step_dir(tmp_path / "out", 0)
        assert max(logged) == 3
    finally:
        trainer.close()


MIXED, GRADED, PROMPTS = "synthetic/arithmetic", "openai/gsm8k", "hh/prompts"  # the last has no rule


def test_validation_logs_the_graded_responses_reward_where_a_source_is_partly_graded(space, tmp_path):
    """Validation prompts of three kinds: a source with one of its two prompts graded, a graded source and a source
    of prompts alone. The proxy beside the gold is the reward of the responses the gold grades (the planted model
    pays one per token), worked out here from the scripted texts."""
    root, model = space
    trainer, tokenizer, _ = _trainer(root, model, tmp_path / "out")
    try:
        rows = trainer.val_dataset.rows
        truths = [row["ground_truth"] for row in rows]
        for row, (source, graded) in zip(rows, [(MIXED, True), (MIXED, False), (GRADED, True),
                                               (PROMPTS, False)]):
            row["data_source"], row["ground_truth"] = source, row["ground_truth"] if graded else None
        texts = [_text(" The answer is", truths[0], True), "no ground truth here, so a much longer answer",
                 _text("", truths[2], False), "ungraded"]
        trainer.actor.generate = lambda prompts, params: _scripted(prompts, tokenizer, lambda i: texts[i])
        metrics = trainer.validate()
    finally:
        trainer.close()
    length = [len(text) + 1 for text in texts]  # one token a character, and EOS
    assert metrics[f"val-aux/{MIXED}/reward/mean@1"] == pytest.approx((length[0] + length[1]) / 2)
    assert metrics[f"val-aux/{MIXED}/graded_reward/mean@1"] == pytest.approx(length[0])
    assert metrics[f"val-aux/{MIXED}/graded_rm_score/mean@1"] == pytest.approx(length[0])  # (the model alone)
    assert metrics[f"val-aux/{MIXED}/gold_reward/mean@1"] == 1.0
    assert metrics[f"val-aux/{GRADED}/gold_reward/mean@1"] == 0.0
    assert metrics[f"val-core/{PROMPTS}/reward/mean@1"] == pytest.approx(length[3])
    assert not [key for key in metrics if "graded_" in key and f"/{MIXED}/" not in key]  # only where partly graded
    assert proxy_and_gold(metrics) == (pytest.approx((length[0] + length[2]) / 2), 0.5)
