"""The reward model on a Ray worker group of two CPU workers, sharded with FSDP2 like the critic: the same
scores as one process, and a PPO step against it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from rlhf_core.config import load_config
from rlhf_core.data.synthetic import build_dataset
from rlhf_core.main_ppo import build_trainer
from rlhf_core.models.toy import random_toy_model
from rlhf_core.rewards.reward_model import RewardModelWorker
from rlhf_core.rollout import SamplingParams

pytestmark = pytest.mark.slow  # starts a Ray cluster and two workers: minutes on a loaded 2-core machine


def make_reward_model(folder, base, seed=0):
    """A random one-label sequence-classification head on the toy architecture, with the character tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(base, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(base)
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_two_workers_score_like_one_process_and_train(ray_cluster, tmp_path):
    base = random_toy_model(tmp_path / "policy", n_layers=1, hidden_size=32, max_position_embeddings=512, seed=0)
    rm = make_reward_model(tmp_path / "rm", base, seed=3)
    build_dataset(tmp_path / "data", n_train=8, n_test=3, seed=0, max_ops=1)
    cfg = load_config([
        f"actor_rollout_ref.model.path={base}", f"data.train_files={tmp_path / 'data' / 'train.parquet'}",
        f"data.val_files={tmp_path / 'data' / 'test.parquet'}", "data.train_batch_size=4",
        "data.max_prompt_length=320", "data.max_response_length=6", "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false", "reward_model.enable=true",
        f"reward_model.model.path={rm}", "reward_model.micro_batch_size_per_gpu=1", "trainer.n_gpus_per_node=2",
        "trainer.device=cpu", "trainer.val_before_train=false", "trainer.total_training_steps=1", "trainer.test_freq=1",
        "trainer.logger=[]", f"trainer.default_local_dir={tmp_path / 'out'}",
    ])
    trainer = build_trainer(cfg)
    try:
        assert trainer.worker_group is not None and trainer.worker_group.world_size == 2
        prompts = trainer.train_dataset.collate([0, 1, 2])  # 3 rows over 2 workers: one padding row, dropped
        batch = trainer.actor.generate(prompts, SamplingParams(n=1, max_new_tokens=6, do_sample=False))
        sharded = trainer.reward_manager.scorer.compute_rm_score(batch)
        alone = RewardModelWorker(cfg.reward_model).compute_rm_score(batch)
        assert sharded.shape == (3,)
        assert sharded.tolist() == pytest.approx(alone.tolist(), abs=1e-5)
        # and the reference: the HF model on the first row's exact ids
        from transformers import AutoModelForSequenceClassification

        tokenizer = AutoTokenizer.from_pretrained(base)
        valid = batch["attention_mask"][0].bool()
        ids = batch["input_ids"][0][valid]
        assert tokenizer.pad_token_id not in ids.tolist()
        with torch.no_grad():
            reference = AutoModelForSequenceClassification.from_pretrained(rm)(input_ids=ids[None]).logits[0, 0]
        assert float(sharded[0]) == pytest.approx(float(reference), abs=1e-4)

        history = trainer.fit()
        last = history[-1].metrics
        assert last["critic/score/mean"] == pytest.approx(last["critic/rm_score/mean"], abs=1e-6)
        assert "val-aux/synthetic/arithmetic/gold_reward/mean@1" in last
    finally:
        trainer.close()
