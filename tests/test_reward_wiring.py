"""How a reward function's results reach the trainer's metrics: a tiny run on the toy model."""

from __future__ import annotations

import pytest

from rlhf_core.config import load_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rlhf_core.data.synthetic import build_dataset
    from rlhf_core.models.toy import random_toy_model

    root = tmp_path_factory.mktemp("reward_wiring")
    model = random_toy_model(root / "model", n_layers=1, hidden_size=32, max_position_embeddings=512, seed=0)
    build_dataset(root / "data", n_train=8, n_test=4, seed=0, max_ops=1)
    return root, model


def _trainer(tiny, reward_file, *extra):
    from rlhf_core.main_ppo import build_trainer

    root, model = tiny
    return build_trainer(load_config([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={root / 'data' / 'train.parquet'}",
        f"data.val_files={root / 'data' / 'test.parquet'}", f"custom_reward_function.path={reward_file}",
        "data.train_batch_size=4", "data.max_prompt_length=320", "data.max_response_length=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false", "trainer.n_gpus_per_node=1",
        "trainer.device=cpu", "trainer.val_before_train=false", f"trainer.default_local_dir={root / 'out'}",
        "trainer.logger=[]", "algorithm.adv_estimator=grpo", *extra]))


def test_a_reward_functions_own_overlong_reward_entry_is_not_added_to_the_validation_reward(tiny, tmp_path):
    """A reward that folds a length penalty of its own into its score and reports it as ``overlong_reward`` (the
    name verl's DAPO manager gives the penalty) scores 0.5 on every response: validation's reward added the entry
    a second time (0.0) though reward_model.overlong_buffer is off and training's score is 0.5."""
    reward = tmp_path / "own_penalty.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'score': 1.0 - 0.5, 'overlong_reward': -0.5}\n")
    trainer = _trainer(tiny, reward, "actor_rollout_ref.rollout.val_kwargs.n=1",
                       "reward_model.overlong_buffer.log=true")  # (logs DAPO's penalty, where one is applied)
    metrics = trainer.validate()
    assert metrics["val-aux/synthetic/arithmetic/reward/mean@1"] == pytest.approx(0.5)
    step = trainer.train_step(trainer.train_dataset.collate(list(range(4))))
    assert step["critic/score/mean"] == pytest.approx(0.5)
    # and the entry is reported as any other of the reward's numbers (it was dropped from every metric)
    assert metrics["val-aux/synthetic/arithmetic/overlong_reward/mean@1"] == pytest.approx(-0.5)
    assert step["critic/overlong_reward/mean"] == pytest.approx(-0.5)
    assert "critic/overlong/ratio" not in step  # no penalty applied: no share of penalised responses to report
