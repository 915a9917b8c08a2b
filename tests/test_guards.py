"""Guards: their decisions worked out by hand, and each one provoked in a real run (NaN rewards, an
absurd learning rate, a validation collapse) with the rollback checked against the checkpoint's weights."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from rlhf_core.algos import AdaptiveKLController, FixedKLController
from rlhf_core.config import ConfigError, GuardConfig, load_config
from rlhf_core.main_ppo import build_trainer
from rlhf_core.training import checkpoint
from rlhf_core.training.guards import (
    Guard,
    GuardError,
    GuardEvent,
    best_validated,
    measured_kl,
    tighten_kl_control,
)
from rlhf_core.workers.group import WorkerError

# ----------------------------------------------------------------------------- decisions


def test_consecutive_skips_stop_at_the_limit_and_target_the_checkpoint_before_the_weights_that_failed():
    guard = Guard(GuardConfig(max_consecutive_skips=3))
    guard.on_checkpoint(1)
    guard.on_checkpoint(2)
    assert guard.protected_steps() == {1}  # the anchor of a streak from step 3, kept from pruning
    # step 3 ran on step 2's weights and their gradient was not finite: step 2's update may have wrecked them
    assert guard.observe_step(3, {}, skipped=True) is None
    guard.on_checkpoint(3)  # saved during the streak: not a good state
    assert guard.observe_step(4, {}, skipped=True) is None
    assert guard.protected_steps() == {1, 2}
    event = guard.observe_step(5, {}, skipped=True)
    assert (event.kind, event.action, event.target_step) == ("non_finite", "stop", 1)
    assert "3 consecutive steps (up to step 5)" in event.message
    # with checkpoints every 5 steps, a streak from step 8 restores step 5's (the weights step 6 started from)
    guard = Guard(GuardConfig(max_consecutive_skips=1))
    guard.on_checkpoint(5)
    assert guard.observe_step(8, {}, skipped=True).target_step == 5
    # a streak from step 2 has no checkpoint before it
    guard = Guard(GuardConfig(max_consecutive_skips=1))
    guard.on_checkpoint(1)
    assert guard.observe_step(2, {}, skipped=True).target_step is None
    # with the non-finite and KL guards off, only the best checkpoint is kept from pruning
    guard = Guard(GuardConfig(max_consecutive_skips=None, max_kl=None))
    guard.on_checkpoint(1)
    guard.on_checkpoint(2)
    assert guard.protected_steps() == set()


def test_a_kl_streak_skips_the_checkpoint_whose_weights_were_already_far_from_the_reference():
    guard = Guard(GuardConfig(max_kl=0.5, patience=1))
    for step in (1, 2, 3):
        guard.on_checkpoint(step)
    # step 4's own update moved too far (ppo_kl), from step 3's weights, which were close to the reference
    assert guard.observe_step(4, {"actor/ppo_kl": 0.9, "actor/reward_kl_penalty": 0.1}, False).target_step == 3
    # step 4 started from weights already over the limit (the KL in its reward measures step 3's weights)
    assert guard.observe_step(4, {"actor/ppo_kl": 0.1, "actor/kl_loss": 0.7}, False).target_step == 2

    guard = Guard(GuardConfig(max_consecutive_skips=2))
    guard.observe_step(1, {}, skipped=True)
    guard.observe_step(2, {}, skipped=False)  # a healthy step ends the streak
    assert guard.observe_step(3, {}, skipped=True) is None
    assert Guard(GuardConfig(max_consecutive_skips=None)).observe_step(1, {}, skipped=True) is None


def test_measured_kl_is_the_largest_kl_metric_and_non_finite_counts_as_infinite():
    assert measured_kl({"actor/ppo_kl": 0.1, "actor/reward_kl_penalty": 0.3, "actor/pg_loss": 9.0}) == 0.3
    assert measured_kl({"actor/kl_loss": float("nan")}) == math.inf
    assert measured_kl({"critic/vf_loss": 1.0}) is None


def test_kl_above_the_limit_for_patience_steps_rolls_back_until_max_rollbacks():
    guard = Guard(GuardConfig(max_kl=0.5, patience=2, max_rollbacks=1))
    guard.on_checkpoint(1)
    assert guard.observe_step(2, {"actor/ppo_kl": 0.6}, skipped=False) is None
    assert guard.observe_step(3, {"actor/ppo_kl": 0.4}, skipped=False) is None  # the streak resets
    guard.on_checkpoint(3)
    assert guard.observe_step(4, {"actor/ppo_kl": 0.6}, skipped=False) is None
    guard.on_checkpoint(4)
    event = guard.observe_step(5, {"actor/reward_kl_penalty": float("nan")}, skipped=False)
    assert (event.kind, event.action, event.target_step, guard.rollbacks) == ("kl_explosion", "rollback", 3, 1)
    guard.observe_step(6, {"actor/ppo_kl": 2.0}, skipped=False)
    event = guard.observe_step(7, {"actor/ppo_kl": 2.0}, skipped=False)
    assert event.action == "stop" and "already rolled back 1 time(s)" in event.message
    assert Guard(GuardConfig(max_kl=None, patience=1)).observe_step(1, {"actor/ppo_kl": 1e9}, False) is None


def test_validation_drop_rolls_back_to_the_best_and_the_state_round_trips():
    guard = Guard(GuardConfig(max_val_drop=0.2, max_rollbacks=3))
    assert guard.observe_validation(0, 0.5) == (True, None)
    assert guard.observe_validation(2, 0.6) == (True, None)
    assert guard.observe_validation(4, 0.45) == (False, None)  # 0.15 below the best: within the limit
    new_best, event = guard.observe_validation(6, 0.35)
    assert not new_best and (event.kind, event.action, event.target_step) == ("val_drop", "rollback", 2)
    assert "fell from the best 0.6 (step 2) to 0.35 at step 6: a drop of 0.25 > trainer.guard.max_val_drop=" in event.message
    assert guard.protected_steps() == {2}
    copy = Guard(GuardConfig())
    copy.load_state_dict(guard.state_dict())
    assert copy.state_dict() == guard.state_dict() == {
        "consecutive_skips": 0, "skip_anchor": None, "kl_streak": 0, "kl_anchor": None, "best_val": 0.6,
        "best_step": 2, "rollbacks": 1, "saved": [], "validated": [[0, 0.5], [2, 0.6], [4, 0.45], [6, 0.35]],
        "went_on_from": []}
    guard.on_checkpoint(2)
    copy.load_state_dict(guard.state_dict())
    assert copy.saved == [2]
    assert Guard(GuardConfig(max_val_drop=None)).observe_validation(1, 0.9) == (False, None)


def test_a_drop_of_exactly_max_val_drop_is_not_more_than_it_whatever_its_rounding():
    # accuracies of 10 prompts: each of these drops is 2/10, the limit itself, however the subtraction rounds
    for best, accuracy in ((0.8, 0.6), (0.7, 0.5), (0.9, 0.7), (0.5, 0.3)):
        guard = Guard(GuardConfig(max_val_drop=0.2))
        guard.observe_validation(0, best)
        assert guard.observe_validation(1, accuracy) == (False, None), (best, accuracy)
        assert guard.observe_validation(2, accuracy - 0.01)[1].kind == "val_drop"


def test_a_validation_that_ties_the_best_is_no_new_best():
    # the earlier checkpoint already holds weights that scored as well: no new save, and the best stays at step 1
    guard = Guard(GuardConfig(max_val_drop=0.2))
    assert guard.observe_validation(1, 0.5) == (True, None)
    assert guard.observe_validation(2, 0.5) == (False, None)
    assert (guard.best_val, guard.best_step) == (0.5, 1)


def test_a_rollback_ends_the_streaks_under_way_so_none_restores_the_weights_it_abandoned():
    guard = Guard(GuardConfig(max_kl=0.5, patience=2, max_consecutive_skips=2, max_val_drop=0.2))
    for step in (1, 2, 3, 4):
        guard.on_checkpoint(step)
    assert guard.observe_validation(2, 0.6) == (True, None)
    assert guard.observe_step(5, {"actor/ppo_kl": 0.9}, skipped=True) is None  # both streaks start, anchors 4, 3
    assert (guard.kl_anchor, guard.skip_anchor) == (4, 3)
    event = guard.observe_validation(5, 0.3)[1]
    assert (event.kind, event.target_step) == ("val_drop", 2)
    guard.on_restore(2, at=5)  # the trainer restores step 2, then saves the restored weights as step 5
    guard.on_checkpoint(5)
    # step 6 runs on the restored weights: its KL (its own update's) starts a streak anchored on them, its skip
    # one anchored before them (step 2's weights are the ones whose gradient was not finite)
    assert guard.observe_step(6, {"actor/ppo_kl": 0.9}, skipped=True) is None
    assert (guard.kl_streak, guard.kl_anchor, guard.consecutive_skips, guard.skip_anchor) == (1, 5, 1, 1)
    assert 3 not in guard.protected_steps() and 4 not in guard.protected_steps()


def test_a_streak_right_after_a_rollback_restores_a_checkpoint_before_the_restored_weights():
    """A drop at step 4 restores step 2 and saves its weights as step 4; step 5 runs on them. Its KL to the
    reference over the limit (or its gradient not finite) says those weights are bad: restoring step 2 again would
    bring them back, so the guard goes to step 1, in a resumed run too."""
    guard = Guard(GuardConfig(max_kl=0.5, patience=1, max_consecutive_skips=1, max_val_drop=0.2))
    for step in (1, 2, 3):
        guard.on_checkpoint(step)
    guard.observe_validation(2, 0.6)
    assert guard.observe_validation(4, 0.3)[1].target_step == 2
    guard.on_restore(2, at=4)
    guard.on_checkpoint(4)
    assert guard.weights_of(4) == 2 and guard.protected_steps() == {1, 2}
    resumed = Guard(guard.config)
    resumed.load_state_dict(guard.state_dict())
    resumed.keep_restorable([1, 2, 4])
    event = guard.observe_step(5, {"actor/reward_kl_penalty": 0.9}, skipped=False)
    assert (event.kind, event.target_step) == ("kl_explosion", 1)
    event = resumed.observe_step(5, {}, skipped=True)
    assert (event.kind, event.target_step) == ("non_finite", 1)
    # only its own update's KL (ppo_kl): the weights it ran on are not in question, step 4's checkpoint holds them
    fresh = Guard(guard.config)
    fresh.load_state_dict(resumed.state_dict())
    assert fresh.observe_step(5, {"actor/ppo_kl": 0.9}, skipped=False).target_step == 4


def test_after_a_rollback_to_an_earlier_step_the_best_is_that_steps_validation():
    """An over-optimisation rollback to step 3 abandons step 4, the best accuracy (0.8): the val-drop guard's best
    becomes step 3's own 0.6, so a drop is measured from the weights the run went on with, and restores them (not
    step 2's better 0.7: a later best may have let its checkpoint be pruned)."""
    guard = Guard(GuardConfig(max_val_drop=0.2))
    for step, accuracy in [(1, 0.5), (2, 0.7), (3, 0.6), (4, 0.8), (5, 0.75)]:
        guard.observe_validation(step, accuracy)
        guard.on_checkpoint(step)
    assert (guard.best_val, guard.best_step) == (0.8, 4)
    guard.on_restore(3, at=6)
    guard.on_checkpoint(6)  # the restored weights, saved at the rollback's step
    assert (guard.best_val, guard.best_step) == (0.6, 3)
    # the best, and the anchor of a streak from step 7, which runs on step 3's weights: step 2 (not step 4)
    assert guard.protected_steps() == {2, 3}
    assert guard.observe_validation(7, 0.45) == (False, None)  # 0.15 below 0.6 (0.35 below the abandoned 0.8)
    event = guard.observe_validation(8, 0.35)[1]
    assert (event.kind, event.target_step) == ("val_drop", 3)
    assert "fell from the best 0.6 (step 3)" in event.message


def test_the_checkpoint_saved_after_a_rollback_keeps_the_restored_steps_validation_for_a_later_rollback_to_it():
    """A drop at step 3 restores step 2 (0.6); the checkpoint saved at step 3 then holds step 2's weights, so it
    scores 0.6 too, in the state a resume loads. After step 4's best (0.7), a KL rollback to step 3 makes the best
    0.6 at step 3 (not none, which would make step 6's 0.35 a new best rather than 0.25 below it)."""
    guard = Guard(GuardConfig(max_val_drop=0.2))
    for step, accuracy in [(1, 0.5), (2, 0.6)]:
        guard.observe_validation(step, accuracy)
        guard.on_checkpoint(step)
    assert guard.observe_validation(3, 0.3)[1].target_step == 2
    guard.on_restore(2, at=3)
    assert guard.state_dict()["validated"] == [[1, 0.5], [2, 0.6], [3, 0.6]]  # what the checkpoint of 3 holds
    guard.on_checkpoint(3)
    resumed = Guard(guard.config)
    resumed.load_state_dict(guard.state_dict())
    resumed.keep_restorable([1, 2, 3])
    assert resumed.observe_validation(4, 0.7) == (True, None)
    resumed.on_checkpoint(4)
    resumed.on_restore(3, at=5)  # a KL streak's anchor at step 5: the checkpoint saved after the first rollback
    assert (resumed.best_val, resumed.best_step) == (0.6, 3)
    event = resumed.observe_validation(6, 0.35)[1]
    assert (event.kind, event.target_step) == ("val_drop", 3)


def test_a_rollback_to_a_step_never_validated_clears_the_best_and_the_next_validation_sets_it():
    guard = Guard(GuardConfig(max_val_drop=0.2, max_kl=0.5))
    for step in (1, 2, 3, 4):
        guard.on_checkpoint(step)
    guard.observe_validation(4, 0.8)
    guard.on_restore(2)  # a KL streak's anchor: saved, never validated
    assert (guard.best_val, guard.best_step) == (None, None)
    assert guard.observe_validation(5, 0.3) == (True, None)  # no drop from the abandoned 0.8: a new best
    assert (guard.best_val, guard.best_step) == (0.3, 5)
    guard.on_restore(5)  # a rollback to the best keeps it
    assert (guard.best_val, guard.best_step) == (0.3, 5)


def test_the_validations_kept_are_those_of_saved_steps_and_old_states_load():
    guard = Guard(GuardConfig(max_val_drop=0.2))
    for step, accuracy, saved in [(1, 0.5, True), (2, 0.45, False), (3, 0.55, True)]:
        guard.observe_validation(step, accuracy)
        if saved:
            guard.on_checkpoint(step)
    assert guard.state_dict()["validated"] == [[1, 0.5], [3, 0.55]]  # step 2 has no checkpoint to restore
    copy = Guard(GuardConfig(max_val_drop=0.2))
    copy.load_state_dict(guard.state_dict())
    copy.on_restore(1)
    assert (copy.best_val, copy.best_step) == (0.5, 1)
    older = {k: v for k, v in guard.state_dict().items() if k != "validated"}  # saved before validations were kept
    copy.load_state_dict(older)
    assert (copy.best_val, copy.best_step, copy.saved) == (0.55, 3, [1, 3])
    copy.on_restore(1)
    assert (copy.best_val, copy.best_step) == (None, None)
    copy.load_state_dict(older)
    copy.keep_restorable([1])  # a resume that finds step 3 (the best) gone, without validations: nothing to go to
    assert (copy.saved, copy.best_val, copy.best_step) == ([1], None, None)
    copy.load_state_dict(guard.state_dict())
    copy.keep_restorable([1])  # with them: step 1's 0.5 is the best a rollback can restore
    assert (copy.saved, copy.best_val, copy.best_step) == ([1], 0.5, 1)
    event = copy.observe_validation(4, 0.25)[1]  # 0.25 below it, over max_val_drop (0.2)
    assert (event.kind, event.target_step) == ("val_drop", 1)


def test_an_old_state_keeps_its_best_validation_for_a_rollback_back_to_it():
    """A state saved before validations were kept still names its best: that is step 3's validation, so a rollback
    from a later best to step 3 finds 0.55 there, and a drop below it rolls back to step 3 again."""
    guard = Guard(GuardConfig(max_val_drop=0.2))
    guard.load_state_dict({"best_val": 0.55, "best_step": 3, "saved": [1, 3], "rollbacks": 0})
    assert guard.validated == {3: 0.55}
    assert guard.observe_validation(4, 0.6) == (True, None)
    guard.on_checkpoint(4)
    guard.on_restore(3, at=5)  # another guard's rollback abandons step 4's weights
    assert (guard.best_val, guard.best_step) == (0.55, 3)
    new_best, event = guard.observe_validation(6, 0.3)  # 0.25 below 0.55, over max_val_drop (0.2)
    assert not new_best and (event.kind, event.action, event.target_step) == ("val_drop", "rollback", 3)


def test_a_resume_that_cannot_restore_a_streaks_anchor_anchors_it_on_the_newest_checkpoint_before_it():
    guard = Guard(GuardConfig(max_kl=0.5, patience=3, max_consecutive_skips=3))
    for step in (1, 2, 3, 4):
        guard.on_checkpoint(step)
    assert guard.observe_step(5, {"actor/ppo_kl": 0.9, "actor/kl_loss": 0.9}, skipped=True) is None
    assert (guard.skip_anchor, guard.kl_anchor) == (3, 3)  # step 4's weights are the suspect ones
    copy = Guard(guard.config)
    copy.load_state_dict(guard.state_dict())
    copy.keep_restorable([1, 2, 4])  # resumed from step 4 in another folder: step 3 did not come along
    assert (copy.skip_anchor, copy.kl_anchor, copy.kl_streak, copy.consecutive_skips) == (2, 2, 1, 1)
    assert copy.observe_step(6, {"actor/ppo_kl": 0.9}, skipped=True) is None
    event = copy.observe_step(7, {"actor/ppo_kl": 0.9}, skipped=True)
    assert (event.kind, event.target_step) == ("non_finite", 2)
    copy.load_state_dict(guard.state_dict())
    copy.keep_restorable([4])  # nothing restorable before the suspect weights: no anchor
    assert (copy.skip_anchor, copy.kl_anchor) == (None, None)


def _config(use_kl_in_reward: bool, use_kl_loss: bool):
    return load_config([f"algorithm.use_kl_in_reward={use_kl_in_reward}",
                        f"actor_rollout_ref.actor.use_kl_loss={use_kl_loss}"])


def test_tightening_the_kl_control_after_a_kl_rollback_is_a_decision_not_a_change():
    config = _config(True, False)
    ctrl = FixedKLController(0.0)
    decision = tighten_kl_control(config, ctrl, 0.001)
    assert "fixed -> adaptive" in decision.summary
    assert isinstance(decision.kl_ctrl, AdaptiveKLController)
    assert (decision.kl_ctrl.value, decision.kl_ctrl.target, decision.kl_ctrl.horizon) == (1e-3, 0.01, 10000)
    assert (decision.kl_loss_coef, decision.lr_factor) == (None, None)
    assert ctrl.value == 0.0 and config.to_dict() == _config(True, False).to_dict()  # nothing was changed

    ctrl = AdaptiveKLController(0.2, 0.1, 500)
    decision = tighten_kl_control(_config(True, False), ctrl, 0.001)
    assert (decision.kl_ctrl.value, decision.kl_ctrl.target, decision.kl_ctrl.horizon) == (0.2, 0.01, 500)
    assert ctrl.target == 0.1
    # a controller whose target is already below target_kl (0.01) keeps its own: the lower of the two
    decision = tighten_kl_control(_config(True, False), AdaptiveKLController(0.2, 0.005, 500), 0.001)
    assert (decision.kl_ctrl.value, decision.kl_ctrl.target, decision.kl_ctrl.horizon) == (0.2, 0.005, 500)
    # a coefficient of 0 (a config may start there) is raised to 1e-3: an adaptive controller multiplies it, and
    # twice 0 is 0, so either would stay at 0 and the rollback restore what failed
    decision = tighten_kl_control(_config(True, False), AdaptiveKLController(0.0, 0.1, 500), 0.001)
    assert (decision.kl_ctrl.value, decision.kl_ctrl.target) == (1e-3, 0.01)
    decision = tighten_kl_control(_config(False, True), FixedKLController(0.001), 0.0)
    assert decision.kl_loss_coef == 0.002 and "kl_loss_coef -> 0.002" in decision.summary

    config = _config(False, True)
    decision = tighten_kl_control(config, FixedKLController(0.001), 0.003)
    assert "kl_loss_coef -> 0.006" in decision.summary
    assert (decision.kl_ctrl, decision.kl_loss_coef, decision.lr_factor) == (None, 0.006, None)
    assert config.actor_rollout_ref.actor.kl_loss_coef == 0.001  # the config keeps the value the run started with

    # both KL terms on: both are tightened, the fixed controller made adaptive (target_kl 0.01, from its 0.001 with
    # algorithm.kl_ctrl.horizon 10000) and the KL loss coefficient doubled (0.003 -> 0.006)
    decision = tighten_kl_control(_config(True, True), FixedKLController(0.001), 0.003)
    assert isinstance(decision.kl_ctrl, AdaptiveKLController)
    assert (decision.kl_ctrl.value, decision.kl_ctrl.target, decision.kl_ctrl.horizon) == (0.001, 0.01, 10000)
    assert (decision.kl_loss_coef, decision.lr_factor) == (0.006, None)

    decision = tighten_kl_control(_config(False, False), FixedKLController(0.001), 0.001)
    assert "learning rate x0.5" in decision.summary
    assert (decision.kl_ctrl, decision.kl_loss_coef, decision.lr_factor) == (None, None, 0.5)


def test_guard_keys_are_validated():
    with pytest.raises(ConfigError) as info:
        load_config(["trainer.guard.patience=0", "trainer.guard.max_kl=-1", "trainer.guard.max_rollbacks=-1",
                     "trainer.prometheus_port=70000", "trainer.warn_kl=0"])
    text = str(info.value)
    for needle in ("trainer.guard.patience=0 must be > 0", "trainer.guard.max_kl=-1.0 must be > 0",
                   "trainer.guard.max_rollbacks=-1 must be >= 0", "trainer.prometheus_port=70000 must be a TCP port",
                   "trainer.warn_kl=0.0 must be > 0"):
        assert needle in text


# ----------------------------------------------------------------------------- provoked in real runs


TINY_TRAIN_PROMPTS = 48  # the conftest workspace: six steps without a second epoch


def make_trainer(workspace, out, *extra):
    return build_trainer(load_config(workspace.overrides(out, *extra)))


def run_recording(trainer):
    """fit(), keeping each step's metrics and the weights right after each train step."""
    metrics, weights = {}, {}
    train_step = trainer.train_step

    def recording_step(prompts):
        result = train_step(prompts)
        weights[trainer.global_step + 1] = {k: v.clone() for k, v in trainer.actor.module.state_dict().items()}
        return result

    trainer.train_step = recording_step
    trainer.logger = lambda m, step: metrics.__setitem__(step, dict(m))
    error = None
    try:
        trainer.fit()
    except GuardError as exc:
        error = exc
    return metrics, weights, error


def assert_weights(module: torch.nn.Module, expected: dict[str, torch.Tensor], equal: bool = True) -> None:
    same = all(torch.equal(value, expected[name]) for name, value in module.state_dict().items())
    assert same == equal


@pytest.mark.usefixtures("one_thread")
def test_nan_rewards_are_skipped_then_the_run_stops_restoring_the_last_good_checkpoint(workspace, tmp_path):
    out = tmp_path / "run"
    trainer = make_trainer(workspace, out, "trainer.total_training_steps=6", "trainer.save_freq=2",
                           "trainer.guard.max_consecutive_skips=2")
    real_reward = trainer.reward_manager

    def nan_from_step_4(*args):
        scores, extras = real_reward(*args)
        return (scores * math.nan if trainer.global_step >= 3 else scores), extras

    trainer.reward_manager = nan_from_step_4
    metrics, weights, error = run_recording(trainer)

    assert error is not None and sorted(metrics) == [1, 2, 3, 4, 5]
    assert "training stopped at step 5: 2 consecutive steps (up to step 5) had a non-finite loss or gradient" \
        in str(error)
    assert f"restored {out / 'global_step_2'} and marked it latest" in str(error)
    assert metrics[3]["training/skipped_steps"] == 0 and metrics[5]["training/skipped_steps"] == 8
    assert torch.equal(weights[5]["model.norm.weight"], weights[3]["model.norm.weight"])  # 4, 5: no update
    saved = checkpoint.load_model_state(out / "global_step_2")
    assert_weights(trainer.actor.module, weights[3], equal=False)  # step 3 had moved the policy on ...
    assert_weights(trainer.actor.module, saved)  # ... and the rollback took it back to step 2
    assert_weights(trainer.critic.module, checkpoint.load_model_state(out / "global_step_2", "critic"))
    assert checkpoint.latest_checkpoint(out) == out / "global_step_2"


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_a_non_finite_loss_skips_the_step_even_where_its_gradient_is_finite(workspace, tmp_path, role):
    """A loss whose value is NaN while its gradient is the real loss's (finite): the clipped gradient alone would
    pass, but the step must be skipped on the loss too, the weights left as they were and each skip counted."""
    trainer = make_trainer(workspace, tmp_path / "run")
    worker = getattr(trainer, role)
    name = "policy_loss" if role == "actor" else "value_loss"
    real_loss = getattr(worker, name)

    def nan_valued(mb, *args):
        loss, summed, constant = real_loss(mb, *args)
        return loss + math.nan, summed, constant  # adding a constant leaves the gradient as it was

    setattr(worker, name, nan_valued)
    before = {k: v.clone() for k, v in worker.module.state_dict().items()}
    metrics = trainer.train_step(trainer.train_dataset.collate(list(range(8))))

    assert math.isfinite(metrics[f"{role}/grad_norm"]) and metrics[f"{role}/grad_norm"] > 0
    assert_weights(worker.module, before)
    assert worker.skipped_steps == 2  # 16 responses in mini-batches of 4 prompts x 2: two optimizer steps
    assert metrics["training/skipped_steps"] == 2


@pytest.mark.usefixtures("one_thread")
def test_kl_explosion_from_an_absurd_learning_rate_rolls_back_and_makes_the_kl_control_adaptive(
        workspace, tmp_path, capsys):
    out = tmp_path / "run"
    trainer = make_trainer(workspace, out, "trainer.total_training_steps=4", "trainer.save_freq=1",
                           "algorithm.use_kl_in_reward=true", "trainer.guard.max_kl=0.5", "trainer.guard.patience=2")
    train_step = trainer.train_step

    def absurd_lr_from_step_3(prompts):
        if trainer.global_step == 2:
            trainer.actor.scheduler.base_lrs = [10.0]
            trainer.actor.optimizer.param_groups[0]["lr"] = 10.0
        return train_step(prompts)

    trainer.train_step = absurd_lr_from_step_3
    metrics, weights, error = run_recording(trainer)

    assert error is None
    assert [measured_kl(metrics[s]) > 0.5 for s in (1, 2, 3, 4)] == [False, False, True, True]
    assert [metrics[s]["training/rollbacks"] for s in (1, 2, 3, 4)] == [0, 0, 0, 1]
    assert "WARNING guard: rollback 1/3 at step 4: KL" in capsys.readouterr().err
    before = checkpoint.load_model_state(out / "global_step_2")
    assert_weights(trainer.actor.module, weights[4], equal=False)
    assert_weights(trainer.actor.module, before)
    assert_weights(trainer.critic.module, checkpoint.load_model_state(out / "global_step_2", "critic"))
    assert isinstance(trainer.kl_ctrl, AdaptiveKLController) and trainer.kl_ctrl.target == 0.01
    state = checkpoint.read_trainer_state(out / "global_step_4")  # saved after the rollback
    assert state["kl_ctrl"]["type"] == "adaptive" and state["guard"]["rollbacks"] == 1
    assert_weights(trainer.actor.module, checkpoint.load_model_state(out / "global_step_4"))


def _response_log_prob(model: torch.nn.Module, batch) -> torch.Tensor:
    """log pi(response token t | the tokens before it) from each row run whole, 0 past the response, (bs, R)."""
    prompt_len, response_len = batch["prompts"].shape[1], batch["responses"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, prompt_len - 1:prompt_len - 1 + response_len]
    return logits.log_softmax(-1).gather(-1, batch["responses"][..., None])[..., 0] * batch["response_mask"]


@pytest.mark.usefixtures("one_thread")
def test_the_kl_loss_coefficient_a_tightening_leaves_is_the_one_the_next_update_uses(workspace, tmp_path):
    """A KL rollback doubles the trainer's kl_loss_coef and leaves the config's as the run began: the actor's loss
    must weigh the KL loss by the trainer's. The first mini-batch's loss, worked out here in float64 from the
    weights before the update: the dual-clip PPO surrogate plus 0.5 x the token mean of k3 = r - 1 - log r,
    r = pi_ref / pi (with the config's 0.25 it would be another loss)."""
    trainer = make_trainer(workspace, tmp_path / "run", "actor_rollout_ref.actor.use_kl_loss=true",
                           "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
                           "actor_rollout_ref.actor.kl_loss_coef=0.25",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")  # a mini-batch in one go
    trainer._apply(tighten_kl_control(trainer.config, trainer.kl_ctrl, trainer.kl_loss_coef))
    assert trainer.kl_loss_coef == 0.5 and trainer.config.actor_rollout_ref.actor.kl_loss_coef == 0.25
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the policy away from the reference, else the KL loss is 0 whatever its coefficient
        for p in trainer.actor.module.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    policy, reference = (copy.deepcopy(m).double() for m in (trainer.actor.module, trainer.actor.ref_module))
    losses = []
    policy_loss = trainer.actor.policy_loss

    def recording(mb, token_count, seq_count, kl_loss_coef):
        loss, summed, constant = policy_loss(mb, token_count, seq_count, kl_loss_coef)
        losses.append((mb, loss.item()))
        return loss, summed, constant

    trainer.actor.policy_loss = recording
    metrics = trainer.train_step(trainer.train_dataset.collate(list(range(8))))

    mb, loss = losses[0]
    mask = mb["response_mask"].double()
    with torch.no_grad():
        log_prob, ref_log_prob = (_response_log_prob(model, mb) for model in (policy, reference))
    advantages = mb["advantages"].double()
    ratio = torch.exp(log_prob - mb["old_log_prob"].double())  # (bs, R)
    surrogate = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 0.8, 1.2))
    surrogate = torch.where(advantages < 0, torch.minimum(surrogate, -advantages * 3.0), surrogate)
    r = torch.exp(ref_log_prob - log_prob)
    kl_loss = float(((r - 1 - torch.log(r)) * mask).sum() / mask.sum())
    pg_loss = float((surrogate * mask).sum() / mask.sum())
    assert (0.5 - 0.25) * kl_loss > 1e-4  # the config's coefficient is far outside the tolerance
    assert loss == pytest.approx(pg_loss + 0.5 * kl_loss, abs=1e-6)
    assert metrics["actor/kl_coef"] == 0.5


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("save_freq, says", [
    (1, "the latest checkpoint {out}/global_step_3 holds these weights, so a resume from it "
        "fails again: resume from {out}/global_step_2 with a lower learning rate (trainer.resume_mode=resume_path "
        "trainer.resume_from_path={out}/global_step_2)"),
    (2, "the latest checkpoint {out}/global_step_2 is intact and from before the divergence, but a rerun with the "
        "same settings replays the steps after it: lower the learning rate (actor_rollout_ref.actor.optim.lr may "
        "change on a resume), then rerun the same command to resume from it"),
])
def test_weights_that_generate_nan_stop_the_run_naming_the_checkpoint_to_go_on_from(workspace, tmp_path, save_freq,
                                                                                      says):
    out = tmp_path / "run"
    trainer = make_trainer(workspace, out, "trainer.total_training_steps=4", f"trainer.save_freq={save_freq}")
    train_step = trainer.train_step

    def absurd_lr_at_step_3(prompts):
        if trainer.global_step == 2:  # step 3's update takes every weight to about 1e30: step 4 samples from NaN
            trainer.actor.scheduler.base_lrs = [1e30]
            trainer.actor.optimizer.param_groups[0]["lr"] = 1e30
        return train_step(prompts)

    trainer.train_step = absurd_lr_at_step_3
    metrics, _, error = run_recording(trainer)

    assert isinstance(error, GuardError) and sorted(metrics) == [1, 2, 3]
    first, second = str(error).split("\n")
    assert first.startswith("training step 4 failed: the policy's logits held NaN (or inf) at response token")
    assert second == says.format(out=out)
    # step 3's update made the weights NaN: one update of it was skipped, fewer than trainer.guard's limit of 3
    # steps in a row, and step 4 fails at its rollout before any loss: the advice must not promise a rollback
    assert metrics[3]["training/skipped_steps"] == 1 and metrics[3]["training/rollbacks"] == 0
    assert ("weights an update made NaN show first here, at the next rollout, even where that update's own loss and "
            "gradient were finite, so trainer.guard's non-finite check (trainer.guard.max_consecutive_skips steps "
            "in a row with a non-finite loss or gradient) does not reach them and the run stops here without a "
            "rollback") in first


@pytest.mark.usefixtures("one_thread")
def test_val_only_on_weights_that_give_nan_logits_stops_with_the_message_of_a_validation_in_training(workspace,
                                                                                                   tmp_path):
    out = tmp_path / "val_only"
    trainer = make_trainer(workspace, out, "trainer.val_only=true")
    with torch.no_grad():
        for parameter in trainer.actor.module.parameters():
            parameter.fill_(math.nan)
    metrics, _, error = run_recording(trainer)

    assert isinstance(error, GuardError) and metrics == {}
    first, second = str(error).split("\n")
    assert first.startswith("validating the weights of step 0 failed: the policy's logits held NaN (or inf) at "
                            "response token 0")
    assert second == (f"the weights are those of actor_rollout_ref.model.path ({workspace.model}), as the run loaded "
                      "them: check that model for NaN or inf weights")

    def worker_fails():  # as a worker group's validation fails
        raise WorkerError("worker rank 1 failed: CUDA error: an illegal memory access was encountered")

    trainer.validate = worker_fails
    with pytest.raises(WorkerError) as raised:
        trainer.fit()
    assert str(raised.value) == ("validating the weights of step 0 failed: worker rank 1 failed: CUDA error: an "
                                 "illegal memory access was encountered\nno checkpoint was saved yet")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("broken_role", ["actor", "critic", "actor and the critic"])
def test_a_model_folder_that_holds_nan_weights_is_named_before_step_1_not_an_update(workspace, tmp_path, capsys,
                                                                                    broken_role):
    """Nothing was trained when the run finds NaN weights: they are the model folder's, so the message names that
    folder (as the reward model's trainer does), not a diverged update and a learning rate. The critic's were met
    only at the first save, as an update's divergence: "rerun with a lower learning rate (critic.optim.lr)"."""
    import shutil

    from safetensors.torch import load_file, save_file

    from rlhf_core.cli.train import ppo

    broken = tmp_path / "nan_model"
    shutil.copytree(workspace.model, broken)
    weights = load_file(broken / "model.safetensors")
    save_file({name: torch.full_like(value, math.nan) if value.is_floating_point() else value
               for name, value in weights.items()}, broken / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "run"
    if broken_role == "actor and the critic":  # two folders, both NaN: each named, and each to be checked
        other = tmp_path / "nan_critic"
        shutil.copytree(broken, other)
        assert ppo(workspace.overrides(out, "trainer.total_training_steps=1", "trainer.save_freq=1",
                                       f"actor_rollout_ref.model.path={broken}", f"critic.model.path={other}")) == 1
        named = (f"actor_rollout_ref.model.path ({broken}) and critic.model.path ({other}), as the run loaded them: "
                 "check each of them for NaN or inf weights")
    else:
        key = {"actor": "actor_rollout_ref.model.path", "critic": "critic.model.path"}[broken_role]
        sound = "critic" if broken_role == "actor" else "actor_rollout_ref"
        assert ppo(workspace.overrides(out, "trainer.total_training_steps=1", "trainer.save_freq=1",
                                       f"{key}={broken}", f"{sound}.model.path={workspace.model}")) == 1
        named = f"{key} ({broken}), as the run loaded them: check that model for NaN or inf weights"
    err = capsys.readouterr().err.splitlines()
    assert err[-2:] == [
        f"error: checking the weights before step 1 failed: the weights of the {broken_role} hold NaN or inf values, "
        "so the run trains nothing",
        f"the weights are those of {named}"]
    assert not list(out.glob("global_step_*"))


@pytest.mark.usefixtures("one_thread")
def test_a_resumed_checkpoint_whose_critic_holds_nan_is_named_not_an_update(workspace, tmp_path, capsys):
    """A checkpoint whose critic weights hold NaN (written by other software, or damaged and its manifest with it)
    was taken for the step after it diverging: "the latest checkpoint ... is intact ... resume from it", which
    loads the same NaN again."""
    import hashlib
    import json

    from rlhf_core.cli.train import ppo

    out = tmp_path / "run"
    assert ppo(workspace.overrides(out, "trainer.total_training_steps=2", "trainer.save_freq=1")) == 0
    part = out / "global_step_2" / "critic" / "model_state.pt"
    state = torch.load(part, weights_only=False)
    torch.save({name: torch.full_like(value, math.nan) if torch.is_tensor(value) and value.is_floating_point()
                else value for name, value in state.items()}, part)
    manifest = json.loads((out / "global_step_2" / "manifest.json").read_text())
    manifest["files"]["critic/model_state.pt"] = part.stat().st_size
    manifest["sha256"]["critic/model_state.pt"] = hashlib.sha256(part.read_bytes()).hexdigest()
    (out / "global_step_2" / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()

    assert ppo(workspace.overrides(out, "trainer.total_training_steps=3", "trainer.save_freq=1")) == 1
    assert capsys.readouterr().err.splitlines()[-2:] == [
        "error: checking the weights before step 3 failed: the weights of the critic hold NaN or inf values, so the "
        "run trains nothing",
        f"the checkpoint the run resumed from, {out / 'global_step_2'}, holds these weights, so a resume from it "
        f"fails again: resume from {out / 'global_step_1'} with a lower learning rate (trainer.resume_mode="
        f"resume_path trainer.resume_from_path={out / 'global_step_1'})"]
    assert sorted(path.name for path in out.glob("global_step_*")) == ["global_step_1", "global_step_2"]


def _non_finite_after_update(trainer, role: str, value: float, at_step: int, then=None) -> None:
    """The ``role``'s update of step ``at_step`` puts ``value`` into one weight after it, its loss and gradient
    norm as they were (finite): as a diverged update can leave the weights (``then()`` runs after it)."""
    worker = getattr(trainer, role)
    name = "update_policy" if role == "actor" else "update_critic"
    update = getattr(worker, name)

    def update_then_non_finite(*args, **kwargs):
        metrics = update(*args, **kwargs)
        if trainer.global_step + 1 == at_step:
            with torch.no_grad():
                list(worker.module.parameters())[-1].view(-1)[0] = value  # one value of the last tensor
            if then is not None:
                then()
        return metrics

    setattr(worker, name, update_then_non_finite)


def _said_non_finite(step: int, role: str, rate: str) -> str:
    return (f"saving the checkpoint of step {step} failed: the weights of the {role} hold NaN or inf values, so the "
            "run saves, marks latest and exports nothing more. This usually means a diverged update (too high a "
            f"learning rate, {rate}; look for a large grad_norm up to this step), which can leave them so even where "
            "its own loss and gradient were finite")


RATES = {"actor": "actor_rollout_ref.actor.optim.lr", "critic": "critic.optim.lr"}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("role, value", [("actor", math.nan), ("critic", math.inf)])
def test_weights_the_last_update_left_non_finite_are_never_saved_and_the_run_names_the_checkpoint_before(
        workspace, tmp_path, role, value):
    """No rollout follows the last step, so its NaN logits can never show the weights its update broke: the save
    itself must refuse them, where they would be the run's result (marked latest, exported)."""
    out = tmp_path / "run"
    trainer = make_trainer(workspace, out, "trainer.total_training_steps=2", "trainer.save_freq=1")
    _non_finite_after_update(trainer, role, value, at_step=2)
    metrics, _, error = run_recording(trainer)

    assert isinstance(error, GuardError) and sorted(metrics) == [1, 2]  # the step's record is kept
    loss = "actor/pg_loss" if role == "actor" else "critic/vf_loss"
    assert math.isfinite(metrics[2][loss]) and math.isfinite(metrics[2][f"{role}/grad_norm"])
    assert metrics[2]["training/skipped_steps"] == 0  # nothing the non-finite guard could see
    first, second = str(error).split("\n")
    assert first == _said_non_finite(2, role, RATES[role])
    assert second == (f"the latest checkpoint {out / 'global_step_1'} is intact and from before the divergence, but "
                      f"a rerun with the same settings replays the steps after it: lower the learning rate "
                      f"({RATES[role]} may change on a resume), then rerun the same command to resume from it")
    assert sorted(path.name for path in out.glob("global_step_*")) == ["global_step_1"]
    assert checkpoint.latest_checkpoint(out) == out / "global_step_1"


@pytest.mark.usefixtures("one_thread")
def test_a_stop_on_sigterm_saves_no_non_finite_weights(workspace, tmp_path):
    out = tmp_path / "run"
    trainer = make_trainer(workspace, out, "trainer.total_training_steps=3", "trainer.save_on_interrupt=true")

    def sigterm():
        trainer.stop_requested = ("SIGTERM", 15)

    _non_finite_after_update(trainer, "critic", math.nan, at_step=1, then=sigterm)
    metrics, _, error = run_recording(trainer)

    assert isinstance(error, GuardError) and sorted(metrics) == [1]
    assert str(error) == _said_non_finite(1, "critic", "critic.optim.lr") + (
        "\nno checkpoint was saved yet: rerun with a lower learning rate (critic.optim.lr)")
    assert list(out.glob("global_step_*")) == [] and checkpoint.latest_or_none(out) is None


@pytest.mark.usefixtures("one_thread")
def test_rlhf_ppo_exits_1_without_a_checkpoint_or_export_where_its_only_update_left_nan_weights(
        workspace, tmp_path, monkeypatch, capsys):
    from rlhf_core.cli.train import ppo
    from rlhf_core.workers.actor import ActorWorker

    update = ActorWorker.update_policy

    def update_then_nan(self, *args, **kwargs):
        metrics = update(self, *args, **kwargs)
        with torch.no_grad():
            self.module.get_input_embeddings().weight[0, 0] = math.nan
        return metrics

    monkeypatch.setattr(ActorWorker, "update_policy", update_then_nan)
    out = tmp_path / "run"
    assert ppo(workspace.overrides(out, "trainer.total_training_steps=1")) == 1
    err = capsys.readouterr().err
    assert (f"error: {_said_non_finite(1, 'actor', RATES['actor'])}\nno checkpoint was saved yet: rerun with a lower "
            f"learning rate ({RATES['actor']})") in err
    assert list(out.glob("global_step_*")) == [] and checkpoint.latest_or_none(out) is None
    assert list(out.rglob("*.safetensors")) == []  # no Hugging Face export either


@pytest.mark.usefixtures("one_thread")
def test_validation_drop_restores_the_best_checkpoint_then_stops_after_max_rollbacks(workspace, tmp_path, capsys):
    out = tmp_path / "run"
    trainer = make_trainer(workspace, out, "trainer.total_training_steps=6", "trainer.test_freq=1",
                           "trainer.guard.max_rollbacks=1", "trainer.max_actor_ckpt_to_keep=1",
                           "trainer.max_critic_ckpt_to_keep=1")
    accuracy = {1: 0.5, 2: 0.6, 3: 0.3, 4: 0.35}
    trainer.validate = lambda: {"val-core/synthetic/acc/mean@1": accuracy[trainer.global_step]}
    metrics, weights, error = run_recording(trainer)

    assert sorted(metrics) == [1, 2, 3, 4]
    assert [metrics[s]["training/rollbacks"] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]
    assert ("rollback 1/1 at step 3: validation accuracy fell from the best 0.6 (step 2) to 0.3 at step 3: a drop "
            "of 0.3") in capsys.readouterr().err
    best = checkpoint.load_model_state(out / "global_step_2")
    assert not all(torch.equal(v, best[k]) for k, v in weights[3].items())
    saved_after_rollback = checkpoint.load_model_state(out / "global_step_3")
    assert all(torch.equal(v, best[k]) for k, v in saved_after_rollback.items())
    assert error is not None and "already rolled back 1 time(s) (trainer.guard.max_rollbacks=1)" in str(error)
    assert_weights(trainer.actor.module, best)
    # the best checkpoint outlived max_*_ckpt_to_keep=1, and so did step 1's: step 4 ran on step 2's weights
    # (saved again as step 3), so a streak from it would have restored step 1
    assert [step for step, _ in checkpoint.list_checkpoints(out)] == [1, 2, 3]
    assert checkpoint.latest_checkpoint(out) == out / "global_step_2"


@pytest.mark.usefixtures("one_thread")
def test_a_kl_streak_that_a_validation_drop_interrupts_does_not_restore_the_abandoned_weights(workspace, tmp_path):
    out = tmp_path / "run"
    trainer = make_trainer(workspace, out, "trainer.total_training_steps=6", "trainer.test_freq=1",
                           "trainer.save_freq=1", "trainer.guard.max_kl=0.5", "trainer.guard.patience=2")
    accuracy = {1: 0.5, 2: 0.6, 3: 0.55, 4: 0.5, 5: 0.3, 6: 0.5}
    trainer.validate = lambda: {"val-core/synthetic/acc/mean@1": accuracy[trainer.global_step]}
    train_step = trainer.train_step

    def kl_over_the_limit_at_steps_5_and_6(prompts):
        metrics = train_step(prompts)
        if trainer.global_step + 1 in (5, 6):
            metrics["actor/ppo_kl"] = 0.9  # the step's own update moved too far
        return metrics

    trainer.train_step = kl_over_the_limit_at_steps_5_and_6
    metrics, weights, error = run_recording(trainer)

    assert error is None
    assert [metrics[s]["training/rollbacks"] for s in (4, 5, 6)] == [0, 1, 1]  # step 6 began a new streak
    best = checkpoint.load_model_state(out / "global_step_2")
    assert_weights(trainer.actor.module, checkpoint.load_model_state(out / "global_step_4"), equal=False)
    assert all(torch.equal(v, best[k]) for k, v in checkpoint.load_model_state(out / "global_step_5").items())


def _kl_loss_over_the_limit_at(trainer, steps):
    """Make the train steps ``steps`` report a KL of their rollout to the reference over the limit (0.5), so that a
    KL streak from step k anchors on the checkpoint of step k-2 or earlier."""
    train_step = trainer.train_step

    def with_kl(prompts):
        metrics = train_step(prompts)
        if trainer.global_step + 1 in steps:
            metrics["actor/kl_loss"] = 0.9
        return metrics

    trainer.train_step = with_kl


@pytest.mark.usefixtures("one_thread")
def test_after_a_kl_rollback_to_before_the_best_accuracy_drops_are_measured_from_the_restored_step(workspace,
                                                                                                 tmp_path):
    """Step 4's KL rollback restores step 2 (accuracy 0.6), abandoning step 3's best 0.7: step 5's 0.45 is within
    max_val_drop of the weights the run went on with, step 6's 0.35 is not and restores step 2 again."""
    out = tmp_path / "run"
    trainer = make_trainer(workspace, out, "trainer.total_training_steps=6", "trainer.test_freq=1",
                           "trainer.save_freq=1", "trainer.guard.max_kl=0.5", "trainer.guard.patience=1")
    accuracy = {1: 0.5, 2: 0.6, 3: 0.7, 4: 0.9, 5: 0.45, 6: 0.35}  # step 4's: the guards do not see it
    trainer.validate = lambda: {"val-core/synthetic/acc/mean@1": accuracy[trainer.global_step]}
    _kl_loss_over_the_limit_at(trainer, {4})
    metrics, weights, error = run_recording(trainer)

    assert error is None
    assert [metrics[s]["training/rollbacks"] for s in range(1, 7)] == [0, 0, 0, 1, 1, 2]
    best = checkpoint.load_model_state(out / "global_step_2")
    for step in (4, 6):  # saved right after each rollback
        assert all(torch.equal(v, best[k]) for k, v in checkpoint.load_model_state(out / f"global_step_{step}").items())
    assert_weights(trainer.actor.module, weights[6], equal=False)
    assert_weights(trainer.actor.module, best)
    assert (trainer.guard.best_val, trainer.guard.best_step) == (0.6, 2)


@pytest.mark.usefixtures("one_thread")
def test_a_rollback_to_the_checkpoint_saved_after_an_earlier_rollback_keeps_the_best_it_holds(workspace, tmp_path):
    """Step 3's drop restores step 2 (0.6) and saves its weights as step 3; step 5's KL rollback (its rollout far
    from the reference: the anchor is step 3) abandons step 4's best 0.7 and restores step 3, whose weights scored
    0.6: step 6's 0.35 is 0.25 below it and restores step 3 again (a third rollback), in the run and in one
    resumed from step 3 into another folder."""
    accuracy = {1: 0.5, 2: 0.6, 3: 0.3, 4: 0.7, 5: 0.9, 6: 0.35}  # step 5's: the guards do not see it
    first, second = tmp_path / "first", tmp_path / "second"
    watched = ("trainer.total_training_steps=6", "trainer.test_freq=1", "trainer.save_freq=1",
               "trainer.guard.max_kl=0.5", "trainer.guard.patience=1")

    def run_to_step_6(run):  # from step 0, or resumed from step 3
        run.validate = lambda: {"val-core/synthetic/acc/mean@1": accuracy[run.global_step]}
        _kl_loss_over_the_limit_at(run, {5})
        metrics, weights, error = run_recording(run)
        assert error is None
        assert [metrics[s]["training/rollbacks"] for s in (4, 5, 6)] == [1, 2, 3]
        assert (run.guard.best_val, run.guard.best_step) == (0.6, 3)
        assert_weights(run.actor.module, weights[6], equal=False)
        assert_weights(run.actor.module, checkpoint.load_model_state(first / "global_step_2"))

    run_to_step_6(make_trainer(workspace, first, *watched))
    best = checkpoint.load_model_state(first / "global_step_2")
    assert all(torch.equal(v, best[k]) for k, v in checkpoint.load_model_state(first / "global_step_3").items())
    resumed = make_trainer(workspace, second, *watched, "trainer.resume_mode=resume_path",
                           f"trainer.resume_from_path={first / 'global_step_3'}")
    resumed.load_checkpoint(first / "global_step_3")
    assert (resumed.guard.best_val, resumed.guard.best_step, resumed.guard.saved) == (0.6, 2, [1, 2, 3])
    run_to_step_6(resumed)


WATCHED = ("trainer.test_freq=1", "trainer.save_freq=1", "trainer.guard.max_kl=0.5", "trainer.guard.patience=1",
           "trainer.guard.overopt_patience=2", "trainer.guard.max_val_drop=null")
#: (proxy, gold) validated after each step; step 4's is not shown to the guards (its KL rollback comes first)
SCORES = {1: (0.1, 0.5), 2: (0.2, 0.6), 3: (0.3, 0.7), 4: (0.9, 0.1), 5: (0.45, 0.55), 6: (0.5, 0.5)}


def _scored(trainer):
    """Validate with the proxy and gold of :data:`SCORES`, by step."""
    def validate():
        proxy, gold = SCORES[trainer.global_step]
        return {"val-aux/synthetic/reward/mean@1": proxy, "val-aux/synthetic/gold_reward/mean@1": gold}

    trainer.validate = validate
    return trainer


def _rolled_back_run_resumed_elsewhere(workspace, first, second, keep_abandoned_best=False):
    """Four steps in ``first``, step 4's KL rollback restoring step 2 (its rollout already far from the reference);
    then a trainer in ``second`` resumed from ``first``'s step 4, to run steps 5 and 6. ``keep_abandoned_best``:
    the over-optimisation guard is not told of the rollback, as before it was (its checkpoints still load)."""
    trainer = _scored(make_trainer(workspace, first, "trainer.total_training_steps=4", *WATCHED))
    _kl_loss_over_the_limit_at(trainer, {4})
    if keep_abandoned_best:
        trainer.overopt.on_restore = lambda step, at=None: None
    metrics, _, error = run_recording(trainer)
    assert error is None and metrics[4]["training/rollbacks"] == 1
    resumed = make_trainer(workspace, second, "trainer.total_training_steps=6", *WATCHED,
                           "trainer.resume_mode=resume_path", f"trainer.resume_from_path={first / 'global_step_4'}")
    resumed.load_checkpoint(first / "global_step_4")
    return _scored(resumed)


@pytest.mark.usefixtures("one_thread")
def test_after_a_kl_rollback_the_over_optimisation_guard_compares_with_the_restored_step_even_resumed_elsewhere(
        workspace, tmp_path):
    """A run in ``first`` rolls back at step 4 (KL) to step 2, abandoning step 3, the best gold; it is resumed into
    ``second`` from step 4. Steps 5 and 6 raise the proxy and lower the gold from step 2's scores: the
    over-optimisation guard restores step 2, from ``first`` (not the abandoned step 3, which ``second`` lacks)."""
    first, second = tmp_path / "first", tmp_path / "second"
    resumed = _rolled_back_run_resumed_elsewhere(workspace, first, second)
    state = checkpoint.read_trainer_state(first / "global_step_4")["overopt"]
    assert (state["streak"], state["previous"], state["best_gold"], state["best_step"]) == (0, [0.2, 0.6], 0.6, 2)
    metrics, weights, error = run_recording(resumed)
    assert error is None
    assert [metrics[s]["training/rollbacks"] for s in (5, 6)] == [1, 2]  # the KL rollback's, then this one
    assert resumed.overopt.rollbacks == 1
    best = checkpoint.load_model_state(first / "global_step_2")
    assert_weights(resumed.actor.module, weights[6], equal=False)
    assert_weights(resumed.actor.module, best)
    assert all(torch.equal(v, best[k]) for k, v in checkpoint.load_model_state(second / "global_step_6").items())


@pytest.mark.usefixtures("one_thread")
def test_a_resume_replaces_a_best_gold_that_a_rollback_abandoned_before_the_rule(workspace, tmp_path):
    """A checkpoint written while the over-optimisation guard kept its best through other guards' rollbacks names
    step 3, abandoned by step 4's rollback to step 2 and not among the checkpoints the run can restore: resumed in
    another folder, the guard takes the best of those it can restore, step 2 (gold 0.6; it looked for step 3 in
    ``second``, and failed), and step 6's rollback restores it from ``first``, over step 5's lower gold 0.55."""
    first, second = tmp_path / "first", tmp_path / "second"
    resumed = _rolled_back_run_resumed_elsewhere(workspace, first, second, keep_abandoned_best=True)
    state = checkpoint.read_trainer_state(first / "global_step_4")
    assert (state["overopt"]["best_step"], state["guard"]["saved"]) == (3, [1, 2])  # (step 4 is the one loaded)
    assert (resumed.overopt.best_step, resumed.overopt.best_gold) == (2, 0.6) and resumed.guard.saved == [1, 2, 4]
    metrics, weights, error = run_recording(resumed)
    assert error is None
    assert resumed.overopt.rollbacks == 1 and metrics[6]["training/rollbacks"] == 2
    best = checkpoint.load_model_state(first / "global_step_2")
    assert_weights(resumed.actor.module, weights[6], equal=False)
    assert_weights(resumed.actor.module, best)


@pytest.mark.parametrize(("test_freq", "validated"), [(-1, []), (0, []), (2, [2, 4, 5]), (5, [5]), (9, [5])])
@pytest.mark.usefixtures("one_thread")
def test_validation_schedule_is_verls(workspace, tmp_path, test_freq, validated):
    """verl validates at every test_freq-th step and after the last where test_freq > 0, and never while
    training where it is -1 or 0 (the validation before training has its own switch, off here)."""
    trainer = make_trainer(workspace, tmp_path / "run", "trainer.total_training_steps=5", f"trainer.test_freq={test_freq}")
    seen = []
    trainer.validate = lambda: seen.append(trainer.global_step) or {"val-core/synthetic/acc/mean@1": 0.5}
    trainer.fit()
    assert seen == validated


@pytest.mark.usefixtures("one_thread")
def test_fit_step_on_a_callers_schedule_keeps_the_validation_guard(workspace, tmp_path):
    """A caller's loop of fit_step (as bench/learning.py runs one against a time budget) validates where
    its schedule says and still gets the val-drop guard's rollback, returned with the step."""
    out = tmp_path / "run"
    trainer = make_trainer(workspace, out, "trainer.total_training_steps=6")  # test_freq -1: no validation
    accuracy = {2: 0.6, 3: 0.3}
    trainer.validate = lambda: {"val-core/synthetic/acc/mean@1": accuracy[trainer.global_step]}
    asked = []

    def schedule(step, metrics):
        asked.append((step, "timing_s/step" in metrics))
        return step in accuracy

    results = [trainer.fit_step(validate=schedule) for _ in range(3)]

    assert asked == [(1, True), (2, True), (3, True)]  # asked after each train step, with its metrics
    assert [r.step for r in results] == [1, 2, 3]
    assert "val-core/synthetic/acc/mean@1" not in results[0].metrics
    assert results[1].metrics["val-core/synthetic/acc/mean@1"] == 0.6 and results[1].event is None
    event = results[2].event
    assert (event.kind, event.action, event.target_step) == ("val_drop", "rollback", 2)
    assert results[2].metrics["training/rollbacks"] == 1
    assert_weights(trainer.actor.module, checkpoint.load_model_state(out / "global_step_2"))


@pytest.mark.usefixtures("one_thread")
def test_a_halved_learning_rate_survives_a_later_rollback_and_a_resume(workspace, tmp_path):
    out = tmp_path / "run"
    trainer = make_trainer(workspace, out, "trainer.total_training_steps=4")  # lr 1e-2, constant
    saved = checkpoint.save_checkpoint(trainer, out)  # saved before the guard's lever
    trainer.actor.scale_lr(0.5)  # the guard's last lever on KL: half the rate from now on

    def rates(worker):  # the optimizer's, the schedule's current and its base
        return worker.optimizer.param_groups[0]["lr"], worker.scheduler.get_last_lr()[0], worker.scheduler.base_lrs[0]

    assert rates(trainer.actor) == pytest.approx((5e-3, 5e-3, 5e-3))
    checkpoint.restore_weights(trainer, saved)  # a later rollback re-applies the schedule's current rate
    assert rates(trainer.actor) == pytest.approx((5e-3, 5e-3, 5e-3))
    metrics = trainer.train_step(trainer.train_dataset.collate(list(range(8))))
    assert metrics["actor/lr"] == pytest.approx(5e-3) and metrics["critic/lr"] == pytest.approx(1e-2)
    trainer.global_step = 1
    resumed = make_trainer(workspace, out)
    checkpoint.load_checkpoint(resumed, checkpoint.save_checkpoint(trainer, out))
    assert rates(resumed.actor) == pytest.approx((5e-3, 5e-3, 5e-3))


def test_after_a_rollback_the_abandoned_checkpoints_are_no_anchor():
    """A rollback to step 2 abandons the weights saved at 3 and 4: a non-finite streak right after must not take
    them for its anchor (nor keep them from pruning); the next save follows step 2."""
    guard = Guard(GuardConfig(max_consecutive_skips=1))
    for step in (1, 2, 3, 4, 5):
        guard.on_checkpoint(step)
    guard.on_restore(2, at=5)  # a val-drop rollback at step 5 to the best, step 2
    assert guard.protected_steps() == {1}
    # step 6 ran on step 2's weights and its gradient was not finite: back to step 1, not to those weights again
    assert guard.observe_step(6, {}, skipped=True).target_step == 1
    guard.on_checkpoint(6)  # the step after the rollback, saved
    assert guard.saved == [1, 2, 6]


@pytest.mark.usefixtures("one_thread")
def test_a_resume_takes_only_whole_checkpoints_for_the_guards_anchors(workspace, tmp_path):
    """Pruning takes the actor's part from older checkpoints: a resumed run's guards must not count on those."""
    out = tmp_path / "run"
    pruned = ("trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=1",
              "trainer.guard.max_consecutive_skips=null", "trainer.guard.max_kl=null")
    make_trainer(workspace, out, *pruned).fit()
    assert [(out / f"global_step_{s}" / "actor").is_dir() for s in (1, 2, 3)] == [False, False, True]
    resumed = make_trainer(workspace, out, "trainer.total_training_steps=4")
    resumed.load_checkpoint(out / "global_step_3")
    assert resumed.guard.saved == [3]


@pytest.mark.usefixtures("one_thread")
def test_pruning_keeps_the_checkpoint_before_the_one_being_saved_for_a_kl_streaks_anchor(workspace, tmp_path):
    """A KL streak whose rollout had already drifted anchors two steps back: with one checkpoint kept, the one
    before the latest must outlive each save (it was pruned as the new one was written, and the rollback then
    failed on the missing part)."""
    out = tmp_path / "run"
    trainer = make_trainer(workspace, out, "trainer.total_training_steps=4", "trainer.max_actor_ckpt_to_keep=1",
                           "trainer.max_critic_ckpt_to_keep=1", "trainer.guard.max_kl=0.5",
                           "trainer.guard.patience=1")
    for step in (1, 2):
        trainer.global_step = step
        trainer.save_checkpoint()
    parts = trainer.workers()
    assert [checkpoint.holds_parts(out / f"global_step_{s}", parts) for s in (1, 2)] == [True, True]
    event = trainer.guard.observe_step(3, {"actor/ppo_kl": 1.0, "actor/kl_loss": 1.0}, skipped=False)
    assert event.target_step == 1  # the rollout of step 3 was already far from the reference
    trainer.global_step = 3
    trainer.apply_guard_event(event)  # restores global_step_1 (it failed here)
    assert_weights(trainer.actor.module, checkpoint.load_model_state(out / "global_step_1"))
    trainer.save_checkpoint()  # the next save after the rollback: now step 1 is the one before it
    trainer.global_step = 4
    trainer.save_checkpoint()
    assert [s for s, p in checkpoint.list_checkpoints(out) if checkpoint.holds_parts(p, parts)] == [3, 4]


@pytest.mark.usefixtures("one_thread")
def test_a_resume_anchors_only_on_the_checkpoints_its_own_run_saved(workspace, tmp_path):
    """A run started afresh in a folder holding another run's checkpoints, then resumed: the other run's
    global_step_1 is no anchor for the resumed run's guards (a rollback loaded it before)."""
    out = tmp_path / "run"
    make_trainer(workspace, out, "trainer.total_training_steps=2", "trainer.save_freq=1").fit()  # run A: 1, 2
    make_trainer(workspace, out, "trainer.total_training_steps=2", "trainer.save_freq=-1",
                 "trainer.resume_mode=disable").fit()  # run B saves step 2 alone, over A's
    resumed = make_trainer(workspace, out, "trainer.total_training_steps=4")
    resumed.load_checkpoint(out / "global_step_2")
    assert resumed.guard.saved == [2]
    assert resumed.guard.anchor(1) is None


@pytest.mark.usefixtures("one_thread")
def test_a_resume_from_another_folder_rolls_back_to_the_checkpoints_beside_the_one_it_loaded(workspace, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    make_trainer(workspace, first, "trainer.total_training_steps=2", "trainer.save_freq=1").fit()
    resumed = make_trainer(workspace, second, "trainer.total_training_steps=4", "trainer.resume_mode=resume_path",
                           f"trainer.resume_from_path={first / 'global_step_2'}")
    resumed.load_checkpoint(first / "global_step_2")
    assert resumed.guard.saved == [1, 2]
    resumed.global_step = 3
    resumed.apply_guard_event(GuardEvent("kl_explosion", "rollback", 1, "KL too high"))  # failed: second/global_step_1
    assert_weights(resumed.actor.module, checkpoint.load_model_state(first / "global_step_1"))
    with pytest.raises(GuardError) as stopped:
        resumed.apply_guard_event(GuardEvent("kl_explosion", "stop", 1, "KL too high"))
    assert (f"restored {first / 'global_step_1'}: fix the cause, then rerun with trainer.resume_mode=resume_path "
            f"trainer.resume_from_path={first / 'global_step_1'}") in str(stopped.value)
    assert checkpoint.latest_or_none(second) is None and checkpoint.latest_checkpoint(first) == first / "global_step_2"


@pytest.mark.usefixtures("one_thread")
def test_a_run_resumed_from_a_path_says_to_resume_that_path_until_it_saves(workspace, tmp_path):
    """Resumed from step 2 of a folder whose latest is step 4 (the run it sets out to leave): until it saves, a
    rerun must load step 2 again (the same command), not the folder's latest (which auto would take)."""
    out = tmp_path / "run"
    make_trainer(workspace, out, "trainer.total_training_steps=4", "trainer.save_freq=2").fit()
    resumed = make_trainer(workspace, out, "trainer.total_training_steps=4", "trainer.save_freq=2",
                           "trainer.resume_mode=resume_path", f"trainer.resume_from_path={out / 'global_step_2'}")
    resumed.load_checkpoint(out / "global_step_2")
    assert resumed.rerun_advice == "rerun the same command"
    assert resumed.rerun_point().checkpoint == out / "global_step_2"  # (the folder's latest is still step 4)
    resumed.global_step = 3
    resumed.save_checkpoint()
    assert resumed.rerun_advice == "rerun with trainer.resume_mode=auto"
    assert resumed.rerun_point().checkpoint == out / "global_step_3"


@pytest.mark.usefixtures("one_thread")
def test_a_rollback_refuses_a_checkpoint_saved_with_another_training_config(workspace, tmp_path):
    out = tmp_path / "run"
    make_trainer(workspace, out, "trainer.total_training_steps=1", "algorithm.lam=0.9").fit()
    other = make_trainer(workspace, out, "trainer.total_training_steps=2", "algorithm.lam=0.5")
    with pytest.raises(checkpoint.CheckpointError, match="algorithm.lam"):
        checkpoint.restore_weights(other, out / "global_step_1")


@pytest.mark.usefixtures("one_thread")
def test_a_relative_checkpoint_folder_resumed_by_its_absolute_path_is_one_folder(workspace, tmp_path, monkeypatch):
    """default_local_dir=run (relative) resumed with resume_from_path=<absolute>/run/global_step_2: a stop at step 3
    restores global_step_1 of that one folder and marks it latest (it was taken for another folder)."""
    monkeypatch.chdir(tmp_path)
    make_trainer(workspace, Path("run"), "trainer.total_training_steps=2", "trainer.save_freq=1").fit()
    resumed = make_trainer(workspace, Path("run"), "trainer.total_training_steps=4", "trainer.save_freq=1",
                           "trainer.resume_mode=resume_path",
                           f"trainer.resume_from_path={tmp_path / 'run' / 'global_step_2'}")
    resumed.load_checkpoint(tmp_path / "run" / "global_step_2")
    resumed.global_step = 3
    resumed.save_checkpoint()
    with pytest.raises(GuardError, match="and marked it latest"):
        resumed.apply_guard_event(GuardEvent("kl_explosion", "stop", 1, "KL too high"))
    assert checkpoint.latest_checkpoint(tmp_path / "run") == tmp_path / "run" / "global_step_1"


@pytest.mark.usefixtures("one_thread")
def test_a_stop_right_after_a_resume_from_a_path_says_to_resume_the_checkpoint_it_marked(workspace, tmp_path):
    """Resumed from step 2 by its path and stopped by a guard before saving: the rollback to step 1 is marked
    latest, so the way on is auto (the same command would load step 2, the weights the guard left, again)."""
    out = tmp_path / "run"
    make_trainer(workspace, out, "trainer.total_training_steps=2", "trainer.save_freq=1").fit()
    resumed = make_trainer(workspace, out, "trainer.total_training_steps=4", "trainer.resume_mode=resume_path",
                           f"trainer.resume_from_path={out / 'global_step_2'}")
    resumed.load_checkpoint(out / "global_step_2")
    resumed.global_step = 3
    with pytest.raises(GuardError, match=f"restored {out / 'global_step_1'} and marked it latest: fix the cause, "
                                         "then rerun with trainer.resume_mode=auto to resume from it"):
        resumed.apply_guard_event(GuardEvent("kl_explosion", "stop", 1, "KL too high"))


def test_the_best_validation_is_the_highest_score_and_the_earliest_among_equals():
    """What a resume falls back on (both guards): a run that saw 0.5 at step 2 and again at step 4 kept step 2."""
    assert best_validated({4: 0.5, 2: 0.5, 3: 0.4}, lambda accuracy: accuracy) == (2, 0.5)
    assert best_validated({5: (0.9, 0.3), 6: (0.2, 0.6)}, lambda scores: scores[1]) == (6, (0.2, 0.6))
    assert best_validated({}, lambda accuracy: accuracy) is None
