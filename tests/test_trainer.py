"""The PPO trainer on CPU: learning on a fixed batch, lr=0 changes nothing, micro-batch independence,
the verl metrics, and the command line's checks before compute."""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import threading
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_core import main_ppo
from rlhf_core.batch import Batch
from rlhf_core.cli.train import ppo
from rlhf_core.config import load_config
from rlhf_core.data.synthetic import build_dataset
from rlhf_core.main_ppo import build_trainer
from rlhf_core.models.toy import random_toy_model
from rlhf_core.rollout import SamplingParams
from rlhf_core.training.checkpoint import CheckpointError
from rlhf_core.training.guards import GuardError
from rlhf_core.training.trainer import PPOTrainer, data_metrics, pick_generations, timing_per_token

REQUIRED_METRICS = [
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/kl_loss", "actor/grad_norm",
    "actor/lr", "critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/score/mean",
    "critic/rewards/mean", "critic/advantages/mean", "critic/returns/mean", "critic/values/mean",
    "critic/vf_explained_var", "response_length/mean", "response_length/clip_ratio", "prompt_length/mean",
    "critic/score/max", "critic/rewards/min", "critic/advantages/max", "critic/returns/min", "critic/values/max",
    "prompt_length/max", "prompt_length/clip_ratio", "timing_per_token_ms/gen", "timing_per_token_ms/update_actor",
    "perf/time_per_step", "timing_s/gen", "timing_s/reward", "timing_s/old_log_prob", "timing_s/ref", "timing_s/values", "timing_s/adv",
    "timing_s/update_critic", "timing_s/update_actor", "timing_s/step", "perf/throughput",
    "perf/max_memory_allocated_gb", "training/global_step", "training/epoch",
]


def test_data_metrics_by_hand():
    # two rows: prompts of 2 and 3 tokens (width 3, left-padded), responses of 2 and 4 tokens (width 4)
    attention = torch.tensor([[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    loss_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])  # the second row's last token rejected
    batch = Batch({
        "prompts": torch.zeros(2, 3, dtype=torch.long), "attention_mask": attention, "response_mask": loss_mask,
        "token_level_scores": torch.tensor([[0.0, 1.0, 0, 0], [0, 0, 0, 0.5]]),
        "token_level_rewards": torch.tensor([[-0.1, 1.0, 0, 0], [0, 0, -0.2, 0.5]]),
        "advantages": torch.tensor([[1.0, 2.0, 9.0, 9.0], [-1.0, 0.0, 3.0, 9.0]]),
        "returns": torch.tensor([[0.5, 1.5, 9.0, 9.0], [0.0, 0.0, 0.5, 9.0]]),
        "values": torch.tensor([[0.5, 1.0, 9.0, 9.0], [0.0, -0.5, 0.5, 9.0]]),
    }, {})
    m = data_metrics(batch, max_response_length=4, max_prompt_length=3)
    assert (m["critic/score/mean"], m["critic/score/max"], m["critic/score/min"]) == (0.75, 1.0, 0.5)
    assert (m["critic/rewards/mean"], m["critic/rewards/max"], m["critic/rewards/min"]) == \
        pytest.approx((0.6, 0.9, 0.3))
    # over the 5 loss tokens: advantages 1, 2, -1, 0, 3; returns .5, 1.5, 0, 0, .5; values .5, 1, 0, -.5, .5
    assert (m["critic/advantages/mean"], m["critic/advantages/max"], m["critic/advantages/min"]) == (1.0, 3.0, -1.0)
    assert (m["critic/returns/mean"], m["critic/returns/max"], m["critic/returns/min"]) == (0.5, 1.5, 0.0)
    assert (m["critic/values/mean"], m["critic/values/max"], m["critic/values/min"]) == pytest.approx((0.3, 1.0, -0.5))
    # R - V over them: 0, .5, 0, .5, 0 (unbiased variance .30 / 4 = .075); R's: 1.5 / 4 = .375; a rejected token's
    # return (zeroed) and value (kept) would be a pair the critic never trained on
    assert m["critic/vf_explained_var"] == pytest.approx(1 - 0.075 / (0.375 + 1e-5))
    # responses as sampled (2 and 4 tokens, the second at the limit); prompts 2 and 3 (the second at its limit)
    assert (m["response_length/mean"], m["response_length/max"], m["response_length/min"]) == (3.0, 4.0, 2.0)
    assert m["response_length/clip_ratio"] == 0.5
    assert (m["prompt_length/mean"], m["prompt_length/max"], m["prompt_length/min"]) == (2.5, 3.0, 2.0)
    assert m["prompt_length/clip_ratio"] == 0.5
    # nothing aborted: newer verl's non-aborted lengths are the lengths
    assert (m["response_length_non_aborted/mean"], m["response_length_non_aborted/max"],
            m["response_length_non_aborted/min"], m["response_length_non_aborted/clip_ratio"]) == (3.0, 4.0, 2.0, 0.5)
    assert m["response/aborted_ratio"] == 0.0
    # a third row aborted before its first token: left out of the non-aborted lengths, counted in the ratio
    aborted = Batch({key: torch.cat([value, value[:1] * 0]) for key, value in batch.tensors.items()}, {})
    aborted["attention_mask"][2, :3] = 1  # its prompt; no response token
    m = data_metrics(aborted, max_response_length=4, max_prompt_length=3)
    assert (m["response_length/mean"], m["response_length/min"]) == (2.0, 0.0)
    assert (m["response_length_non_aborted/mean"], m["response_length_non_aborted/min"],
            m["response_length_non_aborted/clip_ratio"]) == (3.0, 2.0, 0.5)
    assert m["response/aborted_ratio"] == pytest.approx(1 / 3)
    # and out of the scores and rewards, as verl leaves them (its score, 0, is no grade of a response)
    assert (m["critic/score/mean"], m["critic/score/max"], m["critic/score/min"]) == (0.75, 1.0, 0.5)
    assert (m["critic/rewards/mean"], m["critic/rewards/min"]) == pytest.approx((0.6, 0.3))
    # every row aborted: no score or reward to report (not a score of 0), the lengths and ratio still there
    none = Batch({key: value[2:] for key, value in aborted.tensors.items()}, {})
    m = data_metrics(none, max_response_length=4, max_prompt_length=3)
    assert not [key for key in m if key.startswith(("critic/score", "critic/rewards"))]
    assert (m["response/aborted_ratio"], m["response_length/mean"], m["response_length_non_aborted/mean"]) == (1.0, 0, 0)
    # generation per response token, the other passes per token of the batch; phases that did not run are left out
    per_token = timing_per_token({"timing_s/gen": 0.6, "timing_s/update_actor": 1.1, "timing_s/step": 3.0},
                                 response_tokens=6, tokens=11)
    assert per_token == pytest.approx({"timing_per_token_ms/gen": 100.0, "timing_per_token_ms/update_actor": 100.0})


def _step_with_its_batch(trainer, monkeypatch, steps: int = 1) -> tuple[dict[str, float], Batch]:
    """The metrics of ``steps`` training steps on the first 8 prompts, and the last step's batch as its metrics saw it."""
    import rlhf_core.training.trainer as trainer_module

    seen = {}
    real = trainer_module.data_metrics

    def spy(batch, *args, **kwargs):
        seen["batch"] = batch
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "data_metrics", spy)
    for _ in range(steps):
        metrics = trainer.train_step(trainer.train_dataset.collate(list(range(8))))
    return metrics, seen["batch"]


def _digit_first_scores(trainer, batch: Batch) -> np.ndarray:
    """The reward fixture's score of each response of ``batch``, from its decoded text: 1 where it starts with a digit."""
    texts = [trainer.tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
             for ids, mask in zip(batch["responses"], batch["response_mask"])]
    return np.array([1.0 if text[:1].isdigit() else 0.0 for text in texts])


def test_a_ppo_steps_verl_metrics_recomputed_from_its_batch(workspace, monkeypatch):
    """The second of two GAE steps with a KL penalty in the reward (actor and reference apart by then): verl's
    data, timing and throughput metrics, each worked out again from the step's batch."""
    root, model, reward = workspace
    beta = 0.5
    trainer = build_trainer(load_config(_overrides(
        root, model, f"custom_reward_function.path={reward}", "algorithm.use_kl_in_reward=true",
        f"algorithm.kl_ctrl.kl_coef={beta}", "actor_rollout_ref.actor.optim.lr=1e-2", "critic.optim.lr=1e-2")))
    m, batch = _step_with_its_batch(trainer, monkeypatch, steps=2)
    mask = batch["response_mask"].double().numpy()
    # critic/score: the reward function's score of each response (before the KL penalty), over the responses
    score = _digit_first_scores(trainer, batch)
    assert 0 < score.mean() < 1
    assert m["critic/score/mean"] == pytest.approx(score.mean())
    assert (m["critic/score/max"], m["critic/score/min"]) == (score.max(), score.min())
    # critic/rewards: the score less beta times the KL (old_log_prob - ref_log_prob) summed over the response
    kl = ((batch["old_log_prob"] - batch["ref_log_prob"]).double().numpy() * mask).sum(-1)
    assert np.abs(beta * kl).mean() > 1e-3  # the penalty moves the reward away from the score
    assert m["critic/rewards/mean"] == pytest.approx((score - beta * kl).mean(), abs=1e-5)
    # critic/returns: with gamma = lam = 1 the return of a token is the reward still to come, averaged over tokens
    rewards = batch["token_level_rewards"].double().numpy()
    to_come = np.flip(np.cumsum(np.flip(rewards, -1), -1), -1)
    assert m["critic/returns/mean"] == pytest.approx((to_come * mask).sum() / mask.sum(), abs=1e-5)
    # critic/vf_explained_var: 1 - var(returns - values) / (var(returns) + 1e-5), unbiased variances over tokens
    values = batch["values"].double().numpy()[mask.astype(bool)]
    returns = to_come[mask.astype(bool)]
    assert values.std() > 0  # the critic has moved off its zero start
    explained = 1 - np.var(returns - values, ddof=1) / (np.var(returns, ddof=1) + 1e-5)
    assert m["critic/vf_explained_var"] == pytest.approx(explained, abs=1e-4)
    # response_length/clip_ratio: the share of responses with all data.max_response_length = 8 tokens
    lengths = mask.sum(-1)
    assert m["response_length/clip_ratio"] == pytest.approx(float((lengths == 8).mean()))
    # perf/total_num_tokens: every prompt and response token of the batch; perf/throughput per second per GPU
    prompt_tokens = float(batch["attention_mask"][:, :batch["prompts"].shape[1]].sum())
    tokens = prompt_tokens + lengths.sum()
    assert m["perf/total_num_tokens"] == tokens
    assert m["perf/throughput"] == pytest.approx(tokens / m["timing_s/step"])
    assert m["perf/time_per_step"] == m["timing_s/step"]
    # timing_per_token_ms: generation per response token, the other passes per token of the batch
    assert m["timing_per_token_ms/gen"] == pytest.approx(m["timing_s/gen"] * 1000 / lengths.sum())
    for phase in ("ref", "values", "adv", "update_critic", "update_actor"):
        assert m[f"timing_per_token_ms/{phase}"] == pytest.approx(m[f"timing_s/{phase}"] * 1000 / tokens), phase


def test_a_grpo_steps_advantages_recomputed_from_its_batch(workspace, monkeypatch):
    """GRPO without a critic: each response's advantage is its score less its prompt's mean over that prompt's
    (unbiased) standard deviation plus 1e-6, on every token, and there are no critic value metrics."""
    root, model, reward = workspace
    trainer = build_trainer(load_config(_overrides(
        root, model, f"custom_reward_function.path={reward}", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")))
    m, batch = _step_with_its_batch(trainer, monkeypatch)
    score = _digit_first_scores(trainer, batch).reshape(8, 4)  # (prompts, n): a prompt's responses side by side
    assert batch.meta["uid"][:4] == [batch.meta["uid"][0]] * 4
    spread = score.std(-1, ddof=1, keepdims=True)
    assert (spread > 0).any()
    advantage = ((score - score.mean(-1, keepdims=True)) / (spread + 1e-6)).reshape(-1)  # (bs,)
    mask = batch["response_mask"].bool().numpy()
    per_token = np.broadcast_to(advantage[:, None], mask.shape)[mask]
    assert m["critic/advantages/mean"] == pytest.approx(per_token.mean(), abs=1e-5)
    assert (m["critic/advantages/max"], m["critic/advantages/min"]) == pytest.approx(
        (per_token.max(), per_token.min()), abs=1e-5)
    assert m["critic/score/mean"] == pytest.approx(score.mean())
    assert m["critic/rewards/mean"] == m["critic/score/mean"]  # no KL in the reward
    assert not [key for key in m if key.startswith(("critic/values", "critic/vf_", "timing_s/values"))]


#: Schulman 2020's estimators of KL(pi || pi_ref) from d = log pi - log pi_ref of the sampled token
KL_ESTIMATES = {
    "kl": lambda d: d,
    "abs": lambda d: d.abs(),
    "mse": lambda d: 0.5 * d ** 2,
    "low_var_kl": lambda d: torch.exp(-d) - 1 + d,  # k3 = r - 1 - log r with r = pi_ref / pi = exp(-d)
}


@pytest.mark.parametrize("penalty", list(KL_ESTIMATES))
def test_the_reward_is_docked_by_the_kl_estimator_algorithm_kl_penalty_names(workspace, monkeypatch, penalty):
    """A whole step with the KL in the reward: each token's reward is the score (at the response's last token) less
    beta times algorithm.kl_penalty's estimate at d = old_log_prob - ref_log_prob, and actor/reward_kl_penalty is
    that estimate's mean over each response's tokens, averaged over the responses."""
    root, model, reward = workspace
    beta = 0.5
    trainer = build_trainer(load_config(_overrides(
        root, model, f"custom_reward_function.path={reward}", "algorithm.use_kl_in_reward=true",
        f"algorithm.kl_penalty={penalty}", f"algorithm.kl_ctrl.kl_coef={beta}")))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the policy away from the reference, else every estimate is 0
        for p in trainer.actor.module.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    m, batch = _step_with_its_batch(trainer, monkeypatch)
    mask = batch["response_mask"].double()
    d = (batch["old_log_prob"] - batch["ref_log_prob"]).double() * mask
    estimates = {name: estimate(d) * mask for name, estimate in KL_ESTIMATES.items()}
    for other in set(KL_ESTIMATES) - {penalty}:  # each other estimator docks these rewards by far more than 1e-6
        assert float((beta * (estimates[other] - estimates[penalty])).abs().max()) > 1e-3, other
    lengths = mask.sum(-1).long()
    scores = torch.zeros_like(mask)
    scores[torch.arange(len(batch)), lengths - 1] = torch.from_numpy(_digit_first_scores(trainer, batch))
    torch.testing.assert_close(batch["token_level_rewards"].double(), scores - beta * estimates[penalty],
                               rtol=0, atol=1e-6)
    seq_mean = estimates[penalty].sum(-1) / lengths
    assert m["actor/reward_kl_penalty"] == pytest.approx(float(seq_mean.mean()), rel=1e-5, abs=1e-7)


def test_a_fixed_kl_controller_keeps_its_coefficient_step_after_step(workspace):
    """algorithm.kl_ctrl.type=fixed: every step's rewards are docked by beta = kl_coef, and so are the next
    step's. An adaptive controller (Ziegler et al.) would have moved it after step 1, to 0.5 x (1 - 0.2 x 16 /
    10000) = 0.49984 at a KL below its target: only equality tells that apart."""
    root, model, reward = workspace
    trainer = build_trainer(load_config(_overrides(
        root, model, f"custom_reward_function.path={reward}", "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=fixed", "algorithm.kl_ctrl.kl_coef=0.5")))
    used = [trainer.train_step(trainer.train_dataset.collate(list(range(8 * step, 8 * step + 8))))[
        "actor/reward_kl_penalty_coeff"] for step in range(2)]
    assert used == [0.5, 0.5]
    assert trainer.kl_ctrl.value == 0.5


def test_validation_samples_are_picked_as_verl_picks_them():
    texts = [(f"prompt {i}", f"answer {i}") for i in range(6)]
    scores = [i / 10 for i in range(6)]
    picked = pick_generations(texts, scores, 3)
    # verl's rule written out here: sort the (input, output, score) triples by input, shuffle with RandomState(42)
    triples = sorted(((p, r, s) for (p, r), s in zip(texts, scores)), key=lambda t: t[0])
    order = np.random.RandomState(42).permutation(len(triples))  # what RandomState(42).shuffle does to a list
    assert [(d["input"], d["output"], d["score"]) for d in picked] == [triples[i] for i in order[:3]]
    assert len(pick_generations(texts, scores, 10)) == 6
    # several responses to a prompt (val_kwargs.n > 1) stay in the order they were generated: the sort is by input
    # alone (by the whole triple, 'aa' came before 'zz'); RandomState(42) puts positions 1 and 3 first of 4
    assert list(np.random.RandomState(42).permutation(4)[:2]) == [1, 3]
    picked = pick_generations([("p1", "zz"), ("p1", "aa"), ("p2", "yy"), ("p2", "bb")], [1.0, 0.0, 1.0, 0.0], 2)
    assert [(d["input"], d["output"], d["score"]) for d in picked] == [("p1", "aa", 0.0), ("p2", "bb", 0.0)]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    model = random_toy_model(root / "model", n_layers=1, hidden_size=32, max_position_embeddings=512, seed=0)
    build_dataset(root / "data", n_train=32, n_test=8, seed=0, max_ops=1)
    reward = root / "reward_digit_first.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0 if solution_str[:1].isdigit() else 0.0\n"
    )
    return root, model, reward


def _overrides(root, model, *extra):
    return [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={root / 'data' / 'train.parquet'}",
        f"data.val_files={root / 'data' / 'test.parquet'}",
        "data.train_batch_size=8", "data.max_prompt_length=320", "data.max_response_length=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "critic.model.enable_gradient_checkpointing=false",
        "trainer.n_gpus_per_node=1", "trainer.device=cpu", "trainer.val_before_train=false",
        f"trainer.default_local_dir={root / 'out'}", "trainer.logger=[file]",
        *extra,
    ]


def _first_token_prob(trainer, prompts, token_ids):
    """Exact expected reward: the probability that the first response token is one of ``token_ids``."""
    with torch.no_grad():
        logits = trainer.actor.module(input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"],
                                      position_ids=prompts["position_ids"]).logits[:, -1]
    return float(logits.softmax(-1)[:, token_ids].sum(-1).mean())


def test_ppo_steps_raise_the_reward_of_a_fixed_batch(workspace):
    root, model, reward = workspace
    cfg = load_config(_overrides(root, model, f"custom_reward_function.path={reward}",
                                 "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=8",
                                 "actor_rollout_ref.actor.optim.lr=2e-2", "data.max_response_length=2",
                                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"))
    trainer = build_trainer(cfg)
    prompts = trainer.train_dataset.collate(list(range(8)))
    digits = trainer.tokenizer.convert_tokens_to_ids(list("0123456789"))
    before = _first_token_prob(trainer, prompts, digits)
    for _ in range(4):
        trainer.train_step(prompts)
    after = _first_token_prob(trainer, prompts, digits)
    # a random 100-token model starts near 10/100; four GRPO steps on this exact reward must move it clearly
    assert 0.05 < before < 0.15
    assert after > before + 0.1, (before, after)


def test_zero_learning_rate_changes_nothing_and_kl_stays_zero(workspace):
    root, model, _ = workspace
    # users get an error for lr=0 (config validation); the trainer itself must still be inert with it
    cfg = load_config(_overrides(root, model, "actor_rollout_ref.actor.optim.lr=0", "critic.optim.lr=0",
                                 "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true",
                                 "actor_rollout_ref.actor.ppo_epochs=2"), validate=False)
    trainer = build_trainer(cfg)
    actor_before = {k: v.clone() for k, v in trainer.actor.module.state_dict().items()}
    critic_before = {k: v.clone() for k, v in trainer.critic.module.state_dict().items()}
    for step in range(2):
        metrics = trainer.train_step(trainer.train_dataset.collate(list(range(8 * step, 8 * step + 8))))
        assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-7)
        assert metrics["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)
        assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-7)
        assert metrics["actor/pg_clipfrac"] == 0.0
    for name, value in trainer.actor.module.state_dict().items():
        assert torch.equal(value, actor_before[name]), name
    for name, value in trainer.critic.module.state_dict().items():
        assert torch.equal(value, critic_before[name]), name


def test_other_numbers_a_reward_function_returns_are_logged_in_training_and_validation(workspace, tmp_path):
    root, model, _ = workspace
    reward, log = tmp_path / "with_length.py", tmp_path / "scored.jsonl"
    reward.write_text(  # digit_first, plus each response's length when the length is even, written down in order
        "import json\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    with open({str(log)!r}, 'a') as out:\n"
        "        out.write(json.dumps([data_source, solution_str]) + '\\n')\n"
        "    result = {'score': 1.0 if solution_str[:1].isdigit() else 0.0}\n"
        "    if len(solution_str) % 2 == 0:\n"
        "        result['length'] = len(solution_str)\n"
        "    return result\n")
    trainer = build_trainer(load_config(_overrides(root, model, f"custom_reward_function.path={reward}",
                                                   "algorithm.adv_estimator=grpo")))

    def even_lengths():
        scored = [json.loads(line) for line in log.read_text().splitlines()]
        log.unlink()
        return scored, [len(text) for _, text in scored if len(text) % 2 == 0]

    metrics = trainer.train_step(trainer.train_dataset.collate(list(range(8))))
    scored, lengths = even_lengths()
    assert len(scored) == 16 and 0 < len(lengths) < 16  # some responses report a length, some do not
    assert metrics["critic/length/mean"] == pytest.approx(sum(lengths) / len(lengths))
    metrics = trainer.validate()
    scored, lengths = even_lengths()
    [source] = {source for source, _ in scored}
    assert metrics[f"val-aux/{source}/length/mean@1"] == pytest.approx(sum(lengths) / len(lengths))
    assert not [key for key in metrics if "maj@" in key]  # n = 1, and no answers reported to vote on


def test_trainer_seed_seeds_python_and_numpy_streams_a_reward_function_draws_from(workspace, tmp_path):
    """A reward function drawing from ``random`` or ``np.random`` scores the same from a fresh start under the same
    ``trainer.seed`` (the trainer seeds both global streams as it seeds torch's), and otherwise under another."""
    root, model, _ = workspace
    reward, log = tmp_path / "drawing.py", tmp_path / "draws.jsonl"
    reward.write_text(
        "import json, random\n"
        "import numpy as np\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    with open({str(log)!r}, 'a') as out:\n"
        "        out.write(json.dumps([random.random(), float(np.random.random())]) + '\\n')\n"
        "    return 0.0\n")

    def draws(seed: int) -> list:
        trainer = build_trainer(load_config(_overrides(root, model, f"custom_reward_function.path={reward}",
                                                       "algorithm.adv_estimator=grpo", f"trainer.seed={seed}")))
        trainer.train_step(trainer.train_dataset.collate(list(range(8))))
        drawn = [json.loads(line) for line in log.read_text().splitlines()]
        log.unlink()
        return drawn

    first = draws(5)
    assert len(first) == 16
    assert draws(5) == first  # the process's streams moved on between the two runs: the seed set them back
    assert draws(6) != first


def test_validation_shows_the_prompts_done_batch_by_batch_where_the_console_logs(workspace, monkeypatch, capsys):
    from rlhf_core.training import trainer as trainer_module

    root, model, reward = workspace
    bars = []
    made = trainer_module.progress_bar

    def recording(*args, **kwargs):
        bar, updates = made(*args, **kwargs), []
        bars.append((kwargs, updates))
        update = bar.update
        bar.update = lambda n=1: (updates.append(n), update(n))[1]
        return bar

    monkeypatch.setattr(trainer_module, "progress_bar", recording)
    for logger, hidden in (("[console]", False), ("[file]", True)):
        trainer = build_trainer(load_config(_overrides(root, model, f"custom_reward_function.path={reward}",
                                                       "data.val_batch_size=3", f"trainer.logger={logger}")))
        trainer.validate()
        [(kwargs, updates)] = bars
        bars.clear()
        assert (kwargs["desc"], kwargs["total"], kwargs["disable"], updates) == ("validation", 8, hidden, [3, 3, 2])
        assert ("validation:" in capsys.readouterr().err) is not hidden


def test_validation_under_the_training_bar_writes_plain_lines_where_stderr_is_not_a_terminal(workspace, capsys):
    """In a log (``> log 2>&1``, CI, a ZenML step) the validation bar under the training bar wrote a frame per
    batch, each with a newline and a cursor move up (ESC[A) that a file keeps as garbage, and the training bar
    a "\r" frame at every step: now each bar writes whole lines, at its start and at its end (well under the
    30 s between two lines here), and no "\r" or escape sequence."""
    from rlhf_core.training.tracking import Tracking

    root, model, reward = workspace
    trainer = build_trainer(load_config(_overrides(root, model, f"custom_reward_function.path={reward}",
                                                   "data.val_batch_size=3", "trainer.logger=[console]")))
    capsys.readouterr()  # (transformers' own bars of the models loaded)
    with Tracking(["console"], "p", "e", root / "logs", total_steps=4) as tracker:
        tracker.log({}, step=0)
        trainer.validate()  # 8 prompts in batches of 3, 3 and 2
        tracker.log({}, step=1)
    out, err = capsys.readouterr()
    assert out.splitlines() == ["step 0/4", "step 1/4"]
    assert "\r" not in err and "\x1b" not in err, repr(err)
    assert [line.split(" [")[0] for line in err.splitlines()] == [
        "training:   0% 0/4", "validation:   0% 0/8", "validation: 100% 8/8", "training:  25% 1/4"]


def test_the_lr_schedule_warms_up_from_zero_then_decays_along_a_cosine():
    from rlhf_core.config import OptimConfig
    from rlhf_core.workers.common import build_scheduler

    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=2.0)
    scheduler = build_scheduler(optimizer, OptimConfig(lr=2.0, lr_warmup_steps=4, lr_scheduler_type="cosine",
                                                       min_lr_ratio=0.1, num_cycles=0.5), total_steps=10)
    rates = []
    for _ in range(11):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    # warm-up 0, 1/4, 2/4, 3/4 of lr; then 0.1 + 0.9 * (1 + cos(pi * (step - 4) / 6)) / 2 of it
    by_hand = [0.0, 0.25, 0.5, 0.75] + [0.1 + 0.45 * (1 + math.cos(math.pi * k / 6)) for k in range(7)]
    assert rates == pytest.approx([2.0 * share for share in by_hand])
    assert rates[4] == pytest.approx(2.0) and rates[7] == pytest.approx(2.0 * 0.55) and rates[10] == pytest.approx(0.2)


def test_the_lr_schedule_runs_over_total_training_steps_where_the_data_end_sooner(workspace):
    """As verl: total_training_steps=10 on data for 4 steps (32 prompts, 8 a step, one epoch) trains 4 steps, with
    the cosine schedule laid over 10: after step 1 the actor's rate is lr * (1 + cos(pi / 10)) / 2."""
    root, model, _ = workspace
    trainer = build_trainer(load_config(_overrides(root, model, "trainer.total_training_steps=10",
                                                   "trainer.total_epochs=1", "actor_rollout_ref.actor.optim.lr=1e-2",
                                                   "critic.optim.lr=1e-2",
                                                   "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
                                                   "critic.optim.lr_scheduler_type=cosine")))
    assert trainer.total_steps == 4
    for worker in (trainer.actor, trainer.critic):
        worker.optimizer.step()
        worker.scheduler.step()
        assert worker.scheduler.get_last_lr()[0] == pytest.approx(1e-2 * (1 + math.cos(math.pi / 10)) / 2)
    shorter = build_trainer(load_config(_overrides(root, model, "trainer.total_training_steps=3",
                                                   "trainer.total_epochs=1", "actor_rollout_ref.actor.optim.lr=1e-2",
                                                   "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine")))
    assert shorter.total_steps == 3
    shorter.actor.optimizer.step()
    shorter.actor.scheduler.step()
    assert shorter.actor.scheduler.get_last_lr()[0] == pytest.approx(1e-2 * (1 + math.cos(math.pi / 3)) / 2)


def _record_critic_batch(trainer) -> dict:
    """``seen["batch"]``: the batch of the critic's last update (the step's values, returns and rewards)."""
    seen = {}
    update_critic = trainer.critic.update_critic

    def recording(batch, *args):
        seen["batch"] = batch
        return update_critic(batch, *args)

    trainer.critic.update_critic = recording
    return seen


def test_the_logged_lr_is_the_one_the_update_used_and_vpred_mean_the_critics_values(workspace):
    root, model, _ = workspace
    trainer = build_trainer(load_config(_overrides(root, model, "actor_rollout_ref.actor.optim.lr=1e-3",
                                                   "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
                                                   "critic.optim.lr=1e-3", "critic.optim.lr_warmup_steps=2")))
    seen = _record_critic_batch(trainer)
    actor_before = {k: v.clone() for k, v in trainer.actor.module.state_dict().items()}
    logged = []
    for step in range(3):
        metrics = trainer.train_step(trainer.train_dataset.collate(list(range(8 * step, 8 * step + 8))))
        logged += [metrics["actor/lr"], metrics["critic/lr"]]
        if step == 0:
            # the first update ran at lr 0: the actor is unchanged, and the critic's predictions during its update
            # are the values it gave at rollout: two mini-batches of 8 rows (4 prompts x 2), token means averaged
            for name, value in trainer.actor.module.state_dict().items():
                assert torch.equal(value, actor_before[name]), name
            values, mask = seen["batch"]["values"].double(), seen["batch"]["response_mask"].double()
            halves = [(values[rows] * mask[rows]).sum() / mask[rows].sum() for rows in (slice(0, 8), slice(8, 16))]
            assert metrics["critic/vpred_mean"] == pytest.approx(float(sum(halves) / 2), rel=1e-5)
    assert logged == pytest.approx([0.0, 0.0, 5e-4, 5e-4, 1e-3, 1e-3])  # actor, critic at steps 0, 1, 2


FIRST_CHARACTER_REWARD = (  # a score that differs between responses, so advantages and value targets are not 0
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return (ord(solution_str[0]) % 5) / 4 if solution_str else 0.0\n"
)


def _one_update(root, model, micro, dynamic=False, *extra):
    reward = root / "reward_first_character.py"
    reward.write_text(FIRST_CHARACTER_REWARD)
    cfg = load_config(_overrides(root, model, *extra, f"custom_reward_function.path={reward}",
                                 f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
                                 f"critic.ppo_micro_batch_size_per_gpu={micro}", "actor_rollout_ref.actor.optim.lr=1e-2",
                                 "critic.optim.lr=1e-2", f"actor_rollout_ref.actor.use_dynamic_bsz={dynamic}",
                                 "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=600",
                                 "critic.ppo_max_token_len_per_gpu=600", "trainer.seed=3"))
    trainer = build_trainer(cfg)
    # a fifth of the vocabulary ends a response, so that the random model's responses stop at unequal lengths
    # and micro-batches of other rows hold other numbers of tokens: where each holds as many, a mean of their
    # means equals the token mean, and a wrong normalisation would go unseen
    trainer.actor.rollout.eos_ids = torch.arange(4, 24)
    before = [{k: v.clone() for k, v in m.module.state_dict().items()} for m in (trainer.actor, trainer.critic)]
    trainer.micro_batches = {"actor": [], "critic": []}  # the token count of each micro-batch the updates ran

    def counted(seen):
        def hook(module, args, kwargs):
            if torch.is_grad_enabled():  # (packed rows, use_remove_padding, carry no mask: every token is one)
                mask = kwargs.get("attention_mask")
                seen.append(int(mask.sum()) if mask is not None else kwargs["input_ids"].numel())
        return hook

    for role, worker in (("actor", trainer.actor), ("critic", trainer.critic)):
        worker.module.register_forward_pre_hook(counted(trainer.micro_batches[role]), with_kwargs=True)
    metrics = trainer.train_step(trainer.train_dataset.collate(list(range(8))))
    return trainer, before, metrics


def test_update_does_not_depend_on_the_micro_batch_size(workspace):
    root, model, _ = workspace
    reference, initial, expected = _one_update(root, model, micro=8)
    for module, before in zip((reference.actor.module, reference.critic.module), initial):
        # the update happened: Adam's first step moves every trained weight by about lr (1e-2)
        moved = [name for name, value in module.state_dict().items() if (value - before[name]).abs().max() > 1e-3]
        assert moved == list(before), sorted(set(before) - set(moved))
    assert expected["response_length/min"] < expected["response_length/max"]
    assert [len(reference.micro_batches[role]) for role in ("actor", "critic")] == [2, 2]  # one a mini-batch
    for other, _, metrics in (_one_update(root, model, micro=2), _one_update(root, model, micro=1, dynamic=True)):
        for role in ("actor", "critic"):  # more than one micro-batch a mini-batch, holding unequal token counts
            assert len(other.micro_batches[role]) > 2 and len(set(other.micro_batches[role])) > 1, role
        # the same gradient: its norm (before clipping) and the losses, which a wrong normalisation changes.
        # Micro-batches of other rows have other padded widths, so the sums round differently: pg_loss is a
        # mean of per-token terms of order 1 that nearly cancel (~5e-3), hence an absolute floor of 1e-6
        for key in ("actor/grad_norm", "critic/grad_norm", "actor/pg_loss", "critic/vf_loss"):
            assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
        # the same step: within 1% of one Adam step (lr 1e-2). Adam's first step is lr * g / (|g| + eps), about
        # lr * sign(g); where |g| is within 10x Adam's eps (1e-8) the step is lr * g / eps itself, so the rounding
        # of the accumulation, which differs between layouts and CPUs, moves it by a few per cent of lr (1.2e-4
        # seen on an AMD EPYC): those elements (and the embedding rows of tokens not in the batch, g = 0) are held
        # to 10% of lr
        for (module_a, before), module_b in zip(((reference.actor.module, initial[0]),
                                                 (reference.critic.module, initial[1])),
                                                (other.actor.module, other.critic.module)):
            for (name, a), b in zip(module_a.state_dict().items(), module_b.state_dict().values()):
                near_eps = (a - before[name]).abs() < 0.9 * 1e-2  # (sizes as the weight's)
                torch.testing.assert_close(a[~near_eps], b[~near_eps], rtol=0, atol=1e-4, msg=name)
                torch.testing.assert_close(a[near_eps], b[near_eps], rtol=0, atol=1e-3, msg=name)


def test_cli_runs_end_to_end_and_writes_finite_verl_metrics(workspace, capsys):
    root, model, _ = workspace
    out = root / "cli_run"
    code = ppo(_overrides(root, model, "algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.use_kl_loss=true",
                           "trainer.total_training_steps=2", f"trainer.default_local_dir={out}",
                           "trainer.logger=[console,file]", "trainer.test_freq=1", "trainer.val_before_train=true",
                           "trainer.log_val_generations=3"))
    assert code == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # three validation samples after each of the three validations (before training, after steps 1 and 2), the
    # same prompts each time; each score the reward fixture's on its response
    samples = [json.loads(line) for line in (out / "val_generations.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert len({s["input"] for s in samples}) == 3 and [s["input"] for s in samples[:3]] == [s["input"] for s in samples[3:6]]
    assert all("Assistant" in s["input"] and s["score"] == float(s["output"][:1].isdigit()) for s in samples)
    steps = [line for line in lines if "actor/pg_loss" in line]
    assert [line["step"] for line in steps] == [1, 2]
    for line in steps:
        missing = [name for name in REQUIRED_METRICS if name not in line]
        assert not missing, missing
        # the file logger writes a NaN or an infinity as null: every metric must come back a finite number
        numbers = {k: v for k, v in line.items() if not isinstance(v, str)}
        bad = {k: v for k, v in numbers.items() if not isinstance(v, (int, float)) or not math.isfinite(v)}
        assert not bad, bad
        assert set(REQUIRED_METRICS) <= set(numbers)
        assert "val-core/synthetic/arithmetic/acc/mean@1" in line and line["timing_s/testing"] > 0
    printed = capsys.readouterr().out
    assert "done: 2 steps" in printed and printed.count("validation samples at step") == 3


def test_a_default_local_dir_under_home_holds_the_lock_records_and_checkpoints_alike(workspace, tmp_path,
                                                                                    monkeypatch):
    """``trainer.default_local_dir='~/runs'`` is a folder of the home folder for everything the run writes: the run's
    lock and records went to a folder named ``~`` in the working directory, its checkpoints to the home folder."""
    root, model, _ = workspace
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    code = ppo(_overrides(root, model, "trainer.total_training_steps=1", "trainer.save_freq=1",
                           "trainer.default_local_dir='~/runs'", "trainer.logger=[file]"))
    assert code == 0
    out = home / "runs"
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "global_step_1", "latest_checkpointed_iteration.txt", "metrics.jsonl"]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert list(cwd.iterdir()) == []  # no folder named ~ beside the command


def test_a_run_that_validates_a_checkpoint_of_another_folder_hands_on_that_checkpoint(workspace, tmp_path):
    """trainer.val_only with resume_path saves nothing in its own folder: the checkpoint the run hands on (to the
    pipeline's evaluation) is the one it loaded, not a global_step_N of its own folder that was never written."""
    root, model, _ = workspace
    ours = tmp_path / "ours"
    assert ppo(_overrides(root, model, "trainer.total_training_steps=1", f"trainer.default_local_dir={ours}")) == 0
    loaded = ours / "global_step_1"
    result = main_ppo.run(load_config(_overrides(
        root, model, "trainer.val_only=true", "trainer.resume_mode=resume_path", f"trainer.resume_from_path={loaded}",
        f"trainer.default_local_dir={tmp_path / 'validation'}")))
    assert result.checkpoint == str(loaded) and not (tmp_path / "validation" / "global_step_1").exists()


def test_val_only_validates_and_stops_without_training_or_saving(workspace, capsys):
    root, model, _ = workspace
    out = root / "val_only"
    code = ppo(_overrides(root, model, "trainer.val_only=true", f"trainer.default_local_dir={out}",
                           "trainer.logger=[console,file]", "trainer.log_val_generations=2"))
    assert code == 0
    assert "training" not in capsys.readouterr().err  # no training progress bar for a run that trains nothing
    [record] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 0 and "val-core/synthetic/arithmetic/acc/mean@1" in record
    assert not any(key.startswith("actor/") for key in record)
    assert not list(out.glob("global_step_*"))  # nothing trained, nothing saved
    assert len((out / "val_generations.jsonl").read_text().splitlines()) == 2
    # after a run that saved step 1, the same command with val_only validates that checkpoint and saves nothing
    trained = root / "val_only_after"
    assert ppo(_overrides(root, model, "trainer.total_training_steps=1", f"trainer.default_local_dir={trained}",
                          "trainer.logger=[file]")) == 0
    assert ppo(_overrides(root, model, "trainer.total_training_steps=1", f"trainer.default_local_dir={trained}",
                          "trainer.logger=[file]", "trainer.val_only=true")) == 0
    last = json.loads((trained / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 1 and "val-core/synthetic/arithmetic/acc/mean@1" in last and "actor/pg_loss" not in last
    assert sorted(p.name for p in trained.glob("global_step_*")) == ["global_step_1"]


def test_run_closes_the_trainer_when_training_fails(workspace, monkeypatch):
    root, model, _ = workspace
    closed = []

    class FailingTrainer:
        total_steps, global_step, last_saved_step, stop_requested, logger = 2, 0, None, None, None
        phase_hooks: list = []  # (the run shows each phase of a step: trainer.phase_hooks)

        def fit(self):
            raise GuardError("training stopped at step 1: test")

        def close(self):
            closed.append(True)

    monkeypatch.setattr(main_ppo, "build_trainer", lambda cfg, **kwargs: FailingTrainer())
    with pytest.raises(GuardError, match="test"):
        main_ppo.run(load_config(_overrides(root, model, "trainer.resume_mode=disable")))
    assert closed == [True]


def test_signal_handlers_only_in_the_main_thread_and_restored_after():
    trainer = SimpleNamespace(stop_requested=None, global_step=0)
    before = signal.getsignal(signal.SIGTERM)
    seen, errors = [], []

    def in_a_thread():  # e.g. a pipeline step run by a threaded orchestrator: nothing installed, no error
        try:
            with main_ppo.stop_on_signals(trainer):
                seen.append(signal.getsignal(signal.SIGTERM))
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion below
            errors.append(exc)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert errors == [] and seen == [before]
    with main_ppo.stop_on_signals(trainer):
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("actor_rollout_ref.model.path={root}/no_model", "is not a directory"),
        ("data.train_files={root}/missing.parquet", "missing.parquet does not exist"),
        ("data.max_response_length=400", "exceeds the model's max_position_embeddings (512)"),
    ],
)
def test_cli_rejects_bad_input_before_loading_a_model(workspace, capsys, override, needle):
    root, model, _ = workspace
    assert ppo(_overrides(root, model, override.format(root=root))) == 2
    assert needle in capsys.readouterr().err


def test_cli_rejects_a_data_source_without_reward(workspace, capsys, tmp_path):
    import pandas as pd

    root, model, _ = workspace
    frame = pd.read_parquet(root / "data" / "train.parquet")
    frame["data_source"] = "my/unknown_source"
    frame.to_parquet(tmp_path / "train.parquet")
    assert ppo(_overrides(root, model, f"data.train_files={tmp_path / 'train.parquet'}")) == 2
    err = capsys.readouterr().err
    assert "no reward function for data_source my/unknown_source" in err
    assert "custom_reward_function.path" in err


def test_critic_has_no_dropout_so_update_time_values_match_rollout_time(workspace):
    from rlhf_core.models.loading import load_critic

    _, model, _ = workspace
    critic = load_critic(model).train()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    first = critic(input_ids=ids).logits
    critic.score.weight.data.normal_()  # a value head that is not zero, so dropout would show
    first, second = critic(input_ids=ids).logits, critic(input_ids=ids).logits
    assert torch.equal(first, second)


def test_profile_steps_record_a_trace_with_each_phase_as_a_named_range(workspace):
    root, model, _ = workspace
    out = root / "profiled"
    code = ppo(_overrides(root, model, "trainer.total_training_steps=2", "trainer.profile_steps=[2]",
                           f"trainer.default_local_dir={out}", "trainer.logger=[]"))
    assert code == 0
    traces = sorted((out / "profile").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["step_2"]  # step 1 is not profiled
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    phases = {"step", "gen", "reward", "old_log_prob", "values", "adv", "update_critic", "update_actor"}
    assert phases <= names, phases - names
    step = next(e for e in events if e.get("name") == "step" and e.get("ph") == "X")
    gen = next(e for e in events if e.get("name") == "gen" and e.get("ph") == "X")
    assert step["ts"] <= gen["ts"] and gen["ts"] + gen["dur"] <= step["ts"] + step["dur"]  # nested in the step


def test_phase_hooks_enter_around_each_timed_phase_in_order(workspace):
    root, model, _ = workspace
    trainer = build_trainer(load_config(_overrides(root, model)))  # GAE: a critic; no KL: no reference
    seen = []

    @contextmanager
    def hook(name):
        seen.append(f"+{name}")
        yield
        seen.append(f"-{name}")

    trainer.phase_hooks.append(hook)
    metrics = trainer.train_step(trainer.train_dataset.collate(list(range(8))))
    trainer.close()
    inner = ["gen", "reward", "old_log_prob", "values", "adv", "update_critic", "update_actor"]
    assert seen == ["+step", *(f"{sign}{name}" for name in inner for sign in "+-"), "-step"]
    assert {f"timing_s/{name}" for name in ["step", *inner]} <= set(metrics)  # still timed


def test_a_run_shows_each_phase_of_its_steps_validation_and_save_under_its_timing_name(workspace, tmp_path,
                                                                                       monkeypatch):
    """The console's bar shows the phase under way (:meth:`Tracking.phase`): a run hands it each phase of each step,
    the validation and the checkpoint save included (each of which can take minutes with a real model), with the
    step it belongs to, named as its ``timing_s/<name>`` metric, so the log and the metrics use the same words."""
    from rlhf_core.training.tracking import Tracking

    root, model, _ = workspace
    seen = []
    real = Tracking.phase

    def recording(self, name, step):
        seen.append((name, step))
        return real(self, name, step)

    monkeypatch.setattr(Tracking, "phase", recording)
    result = main_ppo.run(load_config(_overrides(root, model, "trainer.total_training_steps=2", "trainer.test_freq=2",
                                                 "trainer.logger=[console]", f"trainer.default_local_dir={tmp_path}")))
    inner = ["gen", "reward", "old_log_prob", "values", "adv", "update_critic", "update_actor"]
    assert seen == [(name, 1) for name in ["step", *inner]] + \
        [(name, 2) for name in ["step", *inner, "testing", "save_checkpoint"]]
    assert {f"timing_s/{name}" for name, _ in seen} <= set(result.history[-1].metrics)


@pytest.mark.parametrize(("method", "expected"), [
    ("_train_params", SamplingParams(n=4, max_new_tokens=32, do_sample=True, temperature=0.7, top_p=0.9, top_k=20)),
    ("_val_params", SamplingParams(n=1, max_new_tokens=32, do_sample=True, temperature=0.6, top_p=0.8, top_k=5)),
])
def test_the_rollout_settings_reach_the_sampling_of_training_and_of_validation(method, expected):
    """Training samples with actor_rollout_ref.rollout's n, do_sample, temperature, top_p and top_k, validation with
    rollout.val_kwargs' (verl's two sets), each up to data.max_response_length tokens. The sets differ in all but
    do_sample, and top_p / top_k are off their defaults, so a setting left behind or taken from the other set shows."""
    val_kwargs = SimpleNamespace(n=1, do_sample=True, temperature=0.6, top_p=0.8, top_k=5)
    rollout = SimpleNamespace(n=4, do_sample=True, temperature=0.7, top_p=0.9, top_k=20, ignore_eos=False,
                              val_kwargs=val_kwargs)
    trainer = SimpleNamespace(config=SimpleNamespace(data=SimpleNamespace(max_response_length=32),
                                                     actor_rollout_ref=SimpleNamespace(rollout=rollout)))
    assert getattr(PPOTrainer, method)(trainer) == expected


def test_ignore_eos_gives_full_length_training_responses_and_leaves_validation_alone(workspace):
    root, model, _ = workspace
    trainer = build_trainer(load_config(_overrides(root, model, "actor_rollout_ref.rollout.ignore_eos=true")))
    assert trainer._train_params().ignore_eos and not trainer._val_params().ignore_eos
    metrics = trainer.train_step(trainer.train_dataset.collate(list(range(8))))
    trainer.close()
    # data.max_response_length=8: every one of the 16 responses is 8 tokens long
    assert metrics["response_length/mean"] == 8.0 and metrics["response_length/min"] == 8.0


def test_sampled_validation_draws_the_same_each_time_and_leaves_the_training_rollouts_alone(workspace):
    """Validation with sampling draws from streams of its own: two validations of the same weights agree
    sample for sample, and the training rollouts' generator is where it was, so how often validation runs does
    not change what training samples (nor what a resumed run samples)."""
    root, model, _ = workspace
    trainer = build_trainer(load_config(_overrides(
        root, model, "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "actor_rollout_ref.rollout.val_kwargs.n=3",
        "data.val_batch_size=3", "trainer.log_val_generations=8")))
    before = trainer.actor.rollout.generator.get_state()
    first = trainer.validate()
    first_samples = trainer.val_generations
    second = trainer.validate()
    after = trainer.actor.rollout.generator.get_state()
    trainer.close()
    assert torch.equal(before, after)
    assert first == second
    assert len(first_samples) == 8 and first_samples == trainer.val_generations


def test_prompts_the_filter_drops_leave_the_step_count_and_validation_follows_test_freq_and_the_last_step(
        workspace, tmp_path):
    """data.filter_overlong_prompts drops 8 of 32 prompts: 24 remain, 3 batches of 8 an epoch, so 2 epochs are 6
    steps (not the 8 the file's rows would give). trainer.test_freq=4 validates after step 4 and after the last,
    6 (verl: s % test_freq == 0, or the last step), once each, besides the validation before training."""
    import pandas as pd

    root, model, _ = workspace
    frame = pd.read_parquet(root / "data" / "train.parquet")
    for row in range(8):  # 400 characters more: over data.max_prompt_length=320 with the character tokenizer
        messages = [dict(message) for message in frame.at[row, "prompt"]]
        messages[-1]["content"] = "x" * 400 + messages[-1]["content"]
        frame.at[row, "prompt"] = messages
    frame.to_parquet(tmp_path / "long.parquet")
    trainer = build_trainer(load_config(_overrides(
        root, model, f"data.train_files={tmp_path / 'long.parquet'}", "data.filter_overlong_prompts=true",
        "trainer.total_epochs=2", "trainer.test_freq=4", "trainer.val_before_train=true",
        f"trainer.default_local_dir={tmp_path / 'out'}")))
    assert (len(trainer.train_dataset), trainer.total_steps) == (24, 6)
    history = trainer.fit()
    trainer.close()
    assert [result.step for result in history] == [1, 2, 3, 4, 5, 6]
    validated = [result.step for result in history if "val-core/synthetic/arithmetic/acc/mean@1" in result.metrics]
    assert validated == [4, 6]
    assert "val-core/synthetic/arithmetic/acc/mean@1" in trainer.val_before


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_entropy_metric_is_aggregated_as_the_loss(workspace, monkeypatch, mode):
    """``actor/entropy`` under each ``loss_agg_mode``, as verl logs it: from the old-log-prob pass's entropies,
    aggregated by hand here, and the same from the on-policy update's micro-batches."""
    root, model, _ = workspace
    overrides = _overrides(root, model, "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                           f"actor_rollout_ref.actor.loss_agg_mode={mode}", "algorithm.adv_estimator=grpo",
                           # near-even draws over the vocabulary, so that some responses hit EOS early
                           "data.max_response_length=96", "actor_rollout_ref.rollout.temperature=1.5",
                           "trainer.seed=3")
    prompts = list(range(8))

    def sharpened(trainer):  # the random model's next-token distributions are near-even (entropy ~log V at
        with torch.no_grad():  # every token, which hides how the tokens are weighted): a larger head varies it
            trainer.actor.module.get_output_embeddings().weight.mul_(8.0)
        return trainer

    train_params = PPOTrainer._train_params  # rollouts stop at 48 tokens, under the 96 of the budget, so that
    monkeypatch.setattr(PPOTrainer, "_train_params",  # Dr. GRPO's divisor (the budget) is not the batch's width
                        lambda self: dataclasses.replace(train_params(self), max_new_tokens=48))
    shortcut = sharpened(build_trainer(load_config(overrides)))
    fast = shortcut.train_step(shortcut.train_dataset.collate(prompts))
    monkeypatch.setattr(PPOTrainer, "_on_policy_update", lambda self: False)
    separate = sharpened(build_trainer(load_config(overrides)))
    seen = []
    compute_log_prob = separate.actor.compute_log_prob

    def recorded(batch):
        log_prob, entropy = compute_log_prob(batch)
        seen.append((entropy.tolist(), batch["response_mask"].tolist()))
        return log_prob, entropy

    monkeypatch.setattr(separate.actor, "compute_log_prob", recorded)
    slow = separate.train_step(separate.train_dataset.collate(prompts))
    [(entropy, mask)] = seen
    rows = [[e for e, m in zip(es, ms) if m] for es, ms in zip(entropy, mask)]
    rows = [row for row in rows if row]
    assert len({len(row) for row in rows}) > 1  # responses of several lengths: the modes differ
    means = [sum(row) / len(row) for row in rows]
    assert max(means) - min(means) > 0.05  # and of different mean entropies, so that the weighting shows
    expected = {
        "token-mean": sum(map(sum, rows)) / sum(map(len, rows)),
        "seq-mean-token-sum": sum(map(sum, rows)) / len(rows),
        "seq-mean-token-mean": sum(sum(row) / len(row) for row in rows) / len(rows),
        "seq-mean-token-sum-norm": sum(map(sum, rows)) / len(rows) / 96,  # / data.max_response_length
    }[mode]
    assert len(mask[0]) == 48
    assert slow["actor/entropy"] == pytest.approx(expected, rel=1e-5)
    assert fast["actor/entropy"] == pytest.approx(expected, rel=1e-5)


def test_profile_steps_must_be_step_numbers(workspace, capsys):
    root, model, _ = workspace
    assert ppo(_overrides(root, model, "trainer.profile_steps=[0,2]")) == 2
    assert "trainer.profile_steps=[0, 2] must be a list of step numbers >= 1" in capsys.readouterr().err


def test_on_policy_update_skips_the_old_log_prob_pass_and_updates_the_same(workspace, monkeypatch):
    """One epoch over one mini-batch: the update's own detached log-probs replace the separate pass."""
    root, model, _ = workspace
    overrides = _overrides(root, model, "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.optim.lr=1e-2",
                           "algorithm.adv_estimator=grpo", "trainer.seed=3")
    prompts = list(range(8))
    shortcut = build_trainer(load_config(overrides))
    assert shortcut._on_policy_update()
    fast = shortcut.train_step(shortcut.train_dataset.collate(prompts))
    monkeypatch.setattr(PPOTrainer, "_on_policy_update", lambda self: False)
    separate = build_trainer(load_config(overrides))
    slow = separate.train_step(separate.train_dataset.collate(prompts))
    assert fast["timing_s/old_log_prob"] == 0.0 and slow["timing_s/old_log_prob"] > 0  # verl's key, the pass skipped
    assert fast["actor/entropy"] == pytest.approx(slow["actor/entropy"], rel=1e-5)
    assert fast["actor/pg_loss"] == pytest.approx(slow["actor/pg_loss"], rel=1e-4, abs=1e-7)
    assert fast["actor/ppo_kl"] == 0.0 and fast["actor/pg_clipfrac"] == 0.0
    for (name, a), b in zip(shortcut.actor.module.state_dict().items(), separate.actor.module.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
    initial = AutoModelForCausalLM.from_pretrained(str(model)).state_dict()
    changed = any(not torch.equal(a, initial[name]) for name, a in shortcut.actor.module.state_dict().items())
    assert changed  # the update did something, so the equality above means something


def test_a_step_that_saves_times_the_save_into_its_record_as_verl_does(workspace, tmp_path):
    root, model, _ = workspace
    trainer = build_trainer(load_config(_overrides(root, model, "trainer.total_training_steps=3", "trainer.save_freq=2",
                                                   "trainer.test_freq=-1", f"trainer.default_local_dir={tmp_path}")))
    logged = []
    trainer.logger = lambda metrics, step: logged.append((step, dict(metrics)))
    history = trainer.fit()
    assert ["timing_s/save_checkpoint" in h.metrics for h in history] == [False, True, True]  # save_freq; the last
    assert all(h.metrics["timing_s/save_checkpoint"] > 0 for h in history[1:])
    assert [step for step, _ in logged] == [1, 2, 3] and "timing_s/save_checkpoint" in logged[1][1]  # in the record

    # a save that fails still leaves the step's metrics logged (without a save time), and the error goes up
    failing = build_trainer(load_config(_overrides(root, model, "trainer.total_training_steps=1", "trainer.test_freq=-1",
                                                   f"trainer.default_local_dir={tmp_path / 'failing'}")))
    logged.clear()
    failing.logger = lambda metrics, step: logged.append((step, dict(metrics)))

    def refuse(before_latest=None):
        raise CheckpointError("disk full")

    failing.save_checkpoint = refuse
    with pytest.raises(CheckpointError, match="disk full"):
        failing.fit()
    assert [step for step, _ in logged] == [1] and "actor/pg_loss" in logged[0][1]
    assert "timing_s/save_checkpoint" not in logged[0][1]


def test_a_saving_step_is_logged_before_its_checkpoint_is_marked_latest(workspace, tmp_path, monkeypatch):
    """A run killed right after the latest marker is written resumes after that step: its record must be in the
    log by then, or no run ever writes it (the record keeps its save time)."""
    from rlhf_core.training import checkpoint

    root, model, _ = workspace
    trainer = build_trainer(load_config(_overrides(root, model, "trainer.total_training_steps=2", "trainer.save_freq=1",
                                                   "trainer.test_freq=-1", f"trainer.default_local_dir={tmp_path}")))
    logged: list[int] = []
    trainer.logger = lambda metrics, step: logged.append(step) if "timing_s/save_checkpoint" in metrics else None
    at_marker: list[tuple[str, list[int]]] = []
    write = checkpoint.write_text_atomic

    def watched(path, text, *args, **kwargs):
        if path.name == checkpoint.LATEST_FILE:
            at_marker.append((text.strip(), list(logged)))
        return write(path, text, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "write_text_atomic", watched)
    trainer.fit()
    assert at_marker == [("1", [1]), ("2", [1, 2])]


def test_on_policy_shortcut_is_off_where_old_log_probs_are_needed_before_the_update(workspace):
    root, model, _ = workspace
    for extra in (["actor_rollout_ref.actor.ppo_mini_batch_size=4"], ["actor_rollout_ref.actor.ppo_epochs=2"],
                  ["algorithm.use_kl_in_reward=true"], ["trainer.critic_warmup=1"]):
        trainer = build_trainer(load_config(_overrides(root, model, "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                                                       *extra)))
        assert not trainer._on_policy_update(), extra


@pytest.mark.parametrize("lora", [False, True])
def test_shared_prefix_gives_the_same_update(workspace, capsys, lora):
    """use_shared_prefix on the actor (old and reference log-probs, the update) and the critic (values, update);
    with LoRA the reference is the policy with its adapters off, and the critic's head a trained copy."""
    root, model, _ = workspace
    extra = ("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.ppo_epochs=2",  # off-policy, KL
             *(("actor_rollout_ref.model.lora_rank=4", "critic.model.lora_rank=4") if lora else ()))
    reference, _, expected = _one_update(root, model, 4, False, *extra)
    shared, _, metrics = _one_update(root, model, 4, False, *extra, "actor_rollout_ref.model.use_shared_prefix=true",
                                     "critic.model.use_shared_prefix=true")
    assert shared.actor.shared_prefix == shared.critic.shared_prefix == (True, True)
    assert reference.actor.shared_prefix == (False, False)
    assert "use_shared_prefix" not in capsys.readouterr().err  # no notice: it runs
    for key in ("actor/grad_norm", "critic/grad_norm", "actor/pg_loss", "actor/kl_loss", "actor/ppo_kl",
                "critic/vf_loss"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    assert expected["actor/kl_loss"] > 0  # the second epoch is off the reference: the KL path ran
    for worker in ("actor", "critic"):
        for (name, a), b in zip(getattr(reference, worker).module.state_dict().items(),
                                getattr(shared, worker).module.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=name)


@pytest.mark.parametrize("lora", [False, True])
def test_remove_padding_gives_the_same_update(workspace, capsys, lora):
    """use_remove_padding on the CPU: the actor (old and reference log-probs, the update) and the critic (values,
    update) run packed rows through packed_attention, and the step is the padded one to fp32 rounding."""
    root, model, _ = workspace
    extra = ("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.ppo_epochs=2",
             *(("actor_rollout_ref.model.lora_rank=4", "critic.model.lora_rank=4") if lora else ()))
    reference, _, expected = _one_update(root, model, 4, False, *extra)
    packed, _, metrics = _one_update(root, model, 4, False, *extra, "actor_rollout_ref.model.use_remove_padding=true",
                                     "critic.model.use_remove_padding=true")
    assert packed.actor.remove_padding and packed.critic.remove_padding and not reference.actor.remove_padding
    assert "use_remove_padding" not in capsys.readouterr().err  # no notice: it runs
    for key in ("actor/grad_norm", "critic/grad_norm", "actor/pg_loss", "actor/kl_loss", "actor/ppo_kl",
                "critic/vf_loss"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    assert expected["actor/kl_loss"] > 0
    for worker in ("actor", "critic"):
        for (name, a), b in zip(getattr(reference, worker).module.state_dict().items(),
                                getattr(packed, worker).module.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=name)


def test_torch_compile_gives_the_same_update(workspace):
    """use_torch_compile: the policy's and reference's MLPs and norms run compiled (inductor) in the rollout, the
    log-prob passes and the update, and the step is the eager one to fp32 rounding."""
    from torch._dynamo.utils import counters

    root, model, _ = workspace
    extra = ("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.ppo_epochs=2")
    reference, _, expected = _one_update(root, model, 4, False, *extra)
    graphs_before = counters["stats"]["unique_graphs"]
    compiled, _, metrics = _one_update(root, model, 4, False, *extra, "actor_rollout_ref.actor.use_torch_compile=true")
    for module in (compiled.actor.module, compiled.actor.ref_module):
        blocks = [m for m in module.modules() if type(m).__name__ in ("LlamaMLP", "LlamaRMSNorm")]
        assert len(blocks) == 4 and all(block._compiled_call_impl is not None for block in blocks)
    assert all(block._compiled_call_impl is None for block in reference.actor.module.modules())
    assert counters["stats"]["unique_graphs"] > graphs_before  # dynamo traced them: the compiled code ran
    for key in ("actor/grad_norm", "actor/pg_loss", "actor/kl_loss", "actor/ppo_kl", "actor/entropy",
                "critic/values/mean"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    assert expected["actor/kl_loss"] > 0
    for (name, a), b in zip(reference.actor.module.state_dict().items(), compiled.actor.module.state_dict().values()):
        # two Adam steps of lr 1e-2: within 5% of one step. Inductor sums in another order, and where a gradient
        # element is near Adam's eps that rounding moves its step by up to ~2e-4 (one element in 4096 here)
        torch.testing.assert_close(a, b, rtol=0, atol=5e-4, msg=name)  # same keys: compiled in place


def test_fused_head_gives_the_same_update(workspace, capsys):
    """use_fused_kernels: old and reference log-probs and the update through the chunked LM head."""
    root, model, _ = workspace
    extra = ("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.ppo_epochs=2")  # off-policy, KL
    reference, _, expected = _one_update(root, model, 2, False, *extra)
    fused, _, metrics = _one_update(root, model, 2, False, *extra, "actor_rollout_ref.model.use_fused_kernels=true")
    assert fused.actor.fused_head and not reference.actor.fused_head
    assert "use_fused_kernels" not in capsys.readouterr().err  # no notice: it runs
    for key in ("actor/grad_norm", "actor/pg_loss", "actor/kl_loss", "actor/ppo_kl", "critic/vf_loss"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    assert expected["actor/kl_loss"] > 0  # the second epoch is off the reference: the KL path ran
    for (name, a), b in zip(reference.actor.module.state_dict().items(), fused.actor.module.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=name)


def test_bfloat16_products_on_cpu_train_the_blocks_in_bfloat16(workspace, monkeypatch):
    """trainer.cpu_matmul_dtype=bfloat16: the blocks' linear layers of the actor, reference and critic multiply
    in bfloat16 (rollout, log-prob passes, updates), the weights stay float32 and the step trains them."""
    from rlhf_core.models import cpu_matmul

    root, model, _ = workspace
    calls = {"forward": 0, "backward": 0}
    for name in calls:
        real = getattr(cpu_matmul._LowPrecisionLinear, name)

        def counting(ctx, *args, _real=real, _name=name):
            calls[_name] += 1
            return _real(ctx, *args)

        monkeypatch.setattr(cpu_matmul._LowPrecisionLinear, name, staticmethod(counting))
    packed_dtypes = set()
    real_decode_weight = cpu_matmul.decode_weight

    def recording(weight, rows, in_block, persistent=False):  # the rollout's copies for its decode steps
        copy = real_decode_weight(weight, rows, in_block, persistent)
        packed_dtypes.add(copy.dtype)
        return copy

    monkeypatch.setattr(cpu_matmul, "decode_weight", recording)
    try:
        trainer, before, metrics = _one_update(root, model, 4, False, "actor_rollout_ref.actor.use_kl_loss=true",
                                               "trainer.cpu_matmul_dtype=bfloat16")
        assert cpu_matmul.product_dtype() == torch.bfloat16
    finally:
        cpu_matmul.configure("auto")
    assert packed_dtypes == {torch.bfloat16, torch.float32}  # the decode: blocks in bfloat16, the head not
    blocks_linears = sum(1 for m in trainer.actor.module.modules() if getattr(m, "in_block", False))
    assert blocks_linears > 0 and calls["backward"] >= 2 * blocks_linears  # actor and critic updates
    assert calls["forward"] > calls["backward"]  # and the passes without gradients
    for module, initial in zip((trainer.actor.module, trainer.critic.module), before):
        assert all(v.dtype == torch.float32 for v in module.state_dict().values())
        moved = [n for n, v in module.state_dict().items() if (v - initial[n]).abs().max() > 1e-3]
        assert moved == list(initial)
    for key in ("actor/grad_norm", "critic/grad_norm", "actor/pg_loss", "actor/kl_loss", "critic/vf_loss"):
        assert math.isfinite(metrics[key]), key


# ---------------------------------------------------------------------------------------------------
# The actor's loss: KL loss and entropy bonus, on log-probs and entropies the test supplies
# ---------------------------------------------------------------------------------------------------


def _actor_with_given_log_probs(workspace, monkeypatch, log_prob, entropy, *extra):
    """An actor on the tiny model whose ``policy_loss`` reads ``log_prob`` and ``entropy`` (leaf tensors of the
    test) instead of the model's: the loss's dependence on them is then the loss's alone."""
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.workers import actor as actor_module

    root, model, _ = workspace
    cfg = load_config(_overrides(root, model, *extra)).resolved().actor_rollout_ref
    worker = actor_module.ActorWorker(cfg, load_tokenizer(model), total_steps=1, need_ref=False)
    monkeypatch.setattr(actor_module, "response_log_prob",
                        lambda *args, **kwargs: (log_prob, entropy if args[3] else None))
    return worker


# two responses of unequal length: row 0 two tokens, row 1 one (the other places are padding)
LOSS_MASK = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
LOSS_LOG_PROB = [[-1.0, -2.0, -7.0], [-0.5, -7.0, -7.0]]
LOSS_REF_LOG_PROB = [[-1.5, -1.0, -1.0], [-1.0, -1.0, -1.0]]  # ref - lp on the tokens: -0.5, 1, -0.5


@pytest.mark.parametrize(("kl_type", "dkl"), [
    ("low_var_kl", [1 - math.exp(-0.5), 1 - math.exp(1.0), 1 - math.exp(-0.5)]),  # d/dlp = 1 - exp(ref - lp)
    ("k1", [1.0, 1.0, 1.0]),  # d/dlp (lp - ref) = 1
    ("mse", [0.5, -1.0, 0.5]),  # d/dlp (lp - ref)^2 / 2 = lp - ref
    ("k3+", [0.5, -1.0, 0.5]),  # verl's straight-through: low_var_kl's value, k2's gradient lp - ref
])
@pytest.mark.parametrize(("mode", "weights"), [
    ("token-mean", [1 / 3, 1 / 3, 1 / 3]),  # / the 3 tokens of the mini-batch
    ("seq-mean-token-mean", [1 / 4, 1 / 4, 1 / 2]),  # / (2 sequences x the row's token count: 2, 2, 1)
    ("seq-mean-token-sum", [1 / 2, 1 / 2, 1 / 2]),  # each row's sum / the 2 sequences
])
def test_kl_loss_gradient_reaches_the_log_probs_by_hand(workspace, monkeypatch, kl_type, dkl, mode, weights):
    """With zero advantages the policy loss is 0 and has no gradient; what is left is kl_loss_coef x the KL
    loss, whose gradient with respect to each token's log-prob is coef x dKL/dlp x the token's weight in
    loss_agg_mode."""
    mask = torch.tensor(LOSS_MASK)
    log_prob = torch.tensor(LOSS_LOG_PROB, requires_grad=True)
    actor = _actor_with_given_log_probs(workspace, monkeypatch, log_prob, None,
                                        "actor_rollout_ref.actor.use_kl_loss=true",
                                        f"actor_rollout_ref.actor.kl_loss_type={kl_type}",
                                        f"actor_rollout_ref.actor.loss_agg_mode={mode}")
    mb = Batch({"response_mask": mask, "advantages": torch.zeros(2, 3), "old_log_prob": log_prob.detach().clone(),
                "ref_log_prob": torch.tensor(LOSS_REF_LOG_PROB)}, {})
    coef = 0.25
    loss, summed, constant = actor.policy_loss(mb, token_count=3, seq_count=2, kl_loss_coef=coef)
    loss.backward()
    expected = [[coef * dkl[0] * weights[0], coef * dkl[1] * weights[1], 0.0], [coef * dkl[2] * weights[2], 0.0, 0.0]]
    assert log_prob.grad.tolist() == [pytest.approx(row, abs=1e-6) for row in expected]
    # the KL values themselves, aggregated the same way: k1 = lp - ref = 0.5, -1, 0.5; k2 = 0.125, 0.5, 0.125;
    # k3 = exp(ref - lp) - (ref - lp) - 1
    k3 = [math.exp(-0.5) - 0.5, math.exp(1.0) - 2, math.exp(-0.5) - 0.5]
    kl = {"low_var_kl": k3, "k3+": k3, "k1": [0.5, -1.0, 0.5], "mse": [0.125, 0.5, 0.125]}[kl_type]
    kl_loss = sum(k * w for k, w in zip(kl, weights))
    assert summed["actor/kl_loss"] == pytest.approx(kl_loss, rel=1e-6)
    assert summed["actor/pg_loss"] == 0.0
    assert loss.item() == pytest.approx(coef * kl_loss, rel=1e-6)
    assert constant["actor/kl_coef"] == coef


def test_entropy_bonus_is_subtracted_so_descending_the_loss_raises_entropy(workspace, monkeypatch):
    """verl's ``loss = pg_loss - entropy_coeff * entropy``: with entropy_coeff > 0 the loss falls as the
    entropy rises, so its gradient with respect to each token's entropy is negative."""
    mask = torch.tensor(LOSS_MASK)
    log_prob = torch.tensor(LOSS_LOG_PROB, requires_grad=True)
    entropy = torch.tensor([[1.2, 0.8, 9.0], [2.0, 9.0, 9.0]], requires_grad=True)
    actor = _actor_with_given_log_probs(workspace, monkeypatch, log_prob, entropy,
                                        "actor_rollout_ref.actor.entropy_coeff=0.1",
                                        "actor_rollout_ref.actor.loss_agg_mode=token-mean")
    # ratio 1 (old = current log-probs): the clipped surrogate is -A per token, -(1 - 1 + 0.5) / 3 = -1/6
    mb = Batch({"response_mask": mask, "advantages": torch.tensor([[1.0, -1.0, 0.0], [0.5, 0.0, 0.0]]),
                "old_log_prob": log_prob.detach().clone()}, {})
    loss, summed, _ = actor.policy_loss(mb, token_count=3, seq_count=2, kl_loss_coef=0.0)
    assert summed["actor/pg_loss"] == pytest.approx(-1 / 6)
    # entropy token-mean (1.2 + 0.8 + 2.0) / 3 = 4/3: loss = -1/6 - 0.1 * 4/3 = -0.3
    assert loss.item() == pytest.approx(-0.3)
    loss.backward()
    # d loss / d entropy = -0.1 / 3 on each of the 3 tokens, 0 on padding
    assert entropy.grad.tolist() == [pytest.approx([-0.1 / 3, -0.1 / 3, 0.0]), pytest.approx([-0.1 / 3, 0.0, 0.0])]
    # and d loss / d lp = -A / 3 (ratio 1): -1/3, 1/3, -1/6
    assert log_prob.grad.tolist() == [pytest.approx([-1 / 3, 1 / 3, 0.0]), pytest.approx([-1 / 6, 0.0, 0.0])]


def _gae_by_hand(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """GAE over one response's tokens, backwards: delta_t = r_t + gamma V_{t+1} - V_t (V after the last token
    0), A_t = delta_t + gamma lam A_{t+1}."""
    advantages, next_value, running = [], 0.0, 0.0
    for r, v in zip(reversed(rewards), reversed(values)):
        running = r + gamma * next_value - v + gamma * lam * running
        advantages.append(running)
        next_value = v
    return advantages[::-1]


def test_a_training_step_uses_the_configured_gamma_and_lambda(workspace):
    """algorithm.gamma=0.9 and algorithm.lam=0.8 reach the step's GAE: its returns and advantages are the ones
    worked out here from the step's own token rewards and critic values (with gamma and lam swapped, or left at
    1, they differ: the values are not 0, so gamma also weighs V_{t+1} apart from the product gamma x lam)."""
    root, model, _ = workspace
    reward = root / "reward_first_character.py"
    reward.write_text(FIRST_CHARACTER_REWARD)
    trainer = build_trainer(load_config(_overrides(root, model, f"custom_reward_function.path={reward}",
                                                   "algorithm.gamma=0.9", "algorithm.lam=0.8")))
    with torch.no_grad():  # the value head starts at 0: values that differ between tokens instead
        trainer.critic.forward_module.score.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(7))
    seen = _record_critic_batch(trainer)
    trainer.train_step(trainer.train_dataset.collate(list(range(8))))
    batch = seen["batch"]
    mask = batch["response_mask"].bool().tolist()
    rewards, values = batch["token_level_rewards"].tolist(), batch["values"].tolist()
    raw, expected_returns = [], []
    for row_mask, row_rewards, row_values in zip(mask, rewards, values):
        n = sum(row_mask)  # the response's tokens come first, then padding
        assert row_mask == [True] * n + [False] * (len(row_mask) - n)
        advantages = _gae_by_hand(row_rewards[:n], row_values[:n], gamma=0.9, lam=0.8)
        raw.append(advantages)
        expected_returns.append([a + v for a, v in zip(advantages, row_values[:n])] + [0.0] * (len(row_mask) - n))
    assert sum(1 for row in rewards if any(row)) > 0 and len({round(v, 6) for row in values for v in row}) > 10
    torch.testing.assert_close(batch["returns"].double(), torch.tensor(expected_returns, dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)
    # the advantages are the GAE whitened over every response token of the batch (unbiased variance)
    flat = [a for row in raw for a in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((a - mean) ** 2 for a in flat) / (len(flat) - 1) + 1e-8)
    whitened = [[(a - mean) / std for a in row] + [0.0] * (len(mask[0]) - len(row)) for row in raw]
    torch.testing.assert_close(batch["advantages"].double(), torch.tensor(whitened, dtype=torch.float64),
                               rtol=1e-4, atol=1e-4)


def test_scores_without_spread_by_hand():
    from rlhf_core.training.trainer import scores_without_spread

    scores = torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert scores_without_spread(scores, ["a", "a", "b", "b"])  # each prompt's two responses alike
    assert not scores_without_spread(scores)  # but the batch has 1s and 0s: GAE's critic still sees a signal
    assert not scores_without_spread(torch.tensor([1.0, 0.0, 1.0, 1.0]), ["a", "a", "b", "b"])  # prompt a tells apart
    assert not scores_without_spread(scores, ["a", "b", "a", "b"])  # groups in any order
    assert scores_without_spread(torch.full((6,), 0.5))
    # rollout.n=1: GRPO and RLOO take a group of one's score as its advantage (by hand: [3, 1]), so the responses
    # are compared over the batch
    assert not scores_without_spread(torch.tensor([3.0, 1.0]), ["a", "b"])
    assert scores_without_spread(torch.tensor([2.0, 2.0]), ["a", "b"])
    # a group of two and groups of one: GRPO's advantages by hand [0, 0, 0] (a alike, b's own score 0), then
    # [0, 0, 0, 2] (c's own score 2)
    assert scores_without_spread(torch.tensor([1.0, 1.0, 0.0]), ["a", "a", "b"])
    assert not scores_without_spread(torch.tensor([1.0, 1.0, 0.0, 2.0]), ["a", "a", "b", "c"])


def test_scores_without_spread_judges_remax_by_the_greedy_baseline():
    """ReMax's advantage is the score minus the score of its prompt's greedy response: 2 prompts, rollout.n=2,
    prompt A's greedy answer right (1), prompt B's wrong (0)."""
    from rlhf_core.training.trainer import scores_without_spread

    baselines = torch.tensor([1.0, 1.0, 0.0, 0.0])
    # every sample wrong: flat scores, but A's samples fall short of its greedy answer: advantages -1, -1, 0, 0
    assert not scores_without_spread(torch.tensor([0.0, 0.0, 0.0, 0.0]), baselines=baselines)
    # every sample scores as its prompt's greedy answer: scores 1, 1, 0, 0 differ, yet every advantage is 0
    assert scores_without_spread(torch.tensor([1.0, 1.0, 0.0, 0.0]), baselines=baselines)
    assert not scores_without_spread(torch.tensor([1.0, 0.0, 0.0, 0.0]), baselines=baselines)


def test_the_already_complete_notice_of_a_run_whose_data_ran_out_before_its_last_step():
    """Dynamic sampling drew 8 batches (two epochs of 4) in 5 steps: the run ended at step 5 for lack of data, not
    at total_steps 8, and the notice said it ended at step 8 while at step 5."""
    from types import SimpleNamespace

    from rlhf_core.training.trainer import PPOTrainer

    run = SimpleNamespace(config=SimpleNamespace(trainer=SimpleNamespace(total_training_steps=None, total_epochs=2)),
                          sampler=SimpleNamespace(batches_per_epoch=4, batches_drawn=8), global_step=5,
                          total_steps=8, data_exhausted=True, resumed_from="ckpt/global_step_5")
    assert PPOTrainer.already_complete(run) == (
        "the run is already complete: ckpt/global_step_5 is at step 5 and its data ran out at step 5 (dynamic "
        "sampling drew more than a batch for some steps) (trainer.total_epochs=2 of 4 batches each), so nothing is "
        "trained; to train on from it, raise trainer.total_epochs to 3 or more and run again")


def test_scores_without_spread_judges_grpo_passk_by_a_groups_one_best():
    """grpo_passk gives its advantage to a group's single best response: a best score two responses share gives
    none (by hand: scores [1, 1, 0 | 0, 1, 1] have advantages all 0, though both groups tell responses apart)."""
    from rlhf_core import algos
    from rlhf_core.training.trainer import scores_without_spread

    groups = ["a", "a", "a", "b", "b", "b"]
    tied, single = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0]), torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    assert scores_without_spread(tied, groups, top_only=True)
    assert not scores_without_spread(tied, groups)  # (GRPO's advantages there are not 0)
    assert not scores_without_spread(single, groups, top_only=True)  # a's best is its own
    mask = torch.ones(6, 1)
    for scores, flat in ((tied, True), (single, False)):  # the estimator agrees
        advantages, _ = algos.compute_advantage("grpo_passk", token_level_rewards=scores[:, None],
                                                response_mask=mask, index=groups)
        assert bool((advantages == 0).all()) is flat


def test_the_stuck_warnings_say_what_moves_the_advantages(capsys):
    """A step whose scores tell no responses apart: the warning says which estimator's comparison they fail and
    what still moves the advantages (a critic's values, the KL penalty in the reward)."""
    from types import SimpleNamespace as NS

    from rlhf_core.training.trainer import PPOTrainer

    def warning(estimator: str, n: int, kl: bool = False) -> str:
        cfg = NS(data=NS(max_response_length=256), actor_rollout_ref=NS(rollout=NS(n=n)),
                 algorithm=NS(adv_estimator=estimator, use_kl_in_reward=kl))
        trainer = NS(config=cfg, scores_flat=True, _stuck_warned={}, use_critic=estimator == "gae",
                     stuck_warnings={"clip", "flat"}, _greedy_repeats=lambda: None)  # (sampled rollouts)
        PPOTrainer._warn_if_stuck(trainer, 1, {"response_length/clip_ratio": 0.1})
        return capsys.readouterr().err

    no_signal = "so the advantages carry no reward signal"
    assert (f"every response scored what its prompt's greedy response scored (algorithm.adv_estimator=remax's "
            f"baseline), {no_signal} and the policy learns nothing about the reward") in warning("remax", 2)
    assert f"the responses to each prompt scored the same, {no_signal} and" in warning("grpo", 4)
    assert (f"each prompt's best score was shared by two or more of its responses (algorithm.adv_estimator="
            f"grpo_passk rewards a single best one), {no_signal} and") in warning("grpo_passk", 4)
    assert f"every response of the batch scored the same, {no_signal} and" in warning("grpo", 1)
    assert f"{no_signal} (only the critic's values move them) and" in warning("gae", 1)
    assert f"{no_signal} (only the critic's values and the KL penalty in the reward move them)" in warning(
        "gae", 1, kl=True)
    # (one penalty: "moves", where it said "move")
    assert f"{no_signal} (only the KL penalty in the reward moves them) and" in warning("rloo", 4, kl=True)


def test_a_greedy_step_also_cut_off_names_both_causes_and_both_fixes(capsys):
    """GRPO on greedy rollouts (rollout.n=2) whose responses all reach the length limit: each cause alone scores a
    prompt's responses alike (one response repeated; cut responses that never reach an answer), so the warning names
    both and both fixes, where it gave the greedy setting's alone and a run that followed it stayed stuck at the
    limit. Where one cause holds, the warning reads as before."""
    from types import SimpleNamespace as NS

    from rlhf_core.training.trainer import PPOTrainer

    def warning(clip_ratio: float, flat: bool = True, **rollout) -> str:  # (sampled unless rollout says)
        sampling = {"n": 2, "do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": False}
        cfg = NS(data=NS(max_response_length=256), actor_rollout_ref=NS(rollout=NS(**{**sampling, **rollout})),
                 algorithm=NS(adv_estimator="grpo", use_kl_in_reward=False))
        trainer = NS(config=cfg, scores_flat=flat, _stuck_warned={}, use_critic=False, stuck_warnings={"clip", "flat"})
        trainer._train_params = lambda: PPOTrainer._train_params(trainer)  # (the trainer's own greedy test)
        trainer._greedy_repeats = lambda: PPOTrainer._greedy_repeats(trainer)
        PPOTrainer._warn_if_stuck(trainer, 1, {"response_length/clip_ratio": clip_ratio})
        return capsys.readouterr().err

    key = "actor_rollout_ref.rollout"
    cut = ("100% of the responses reached data.max_response_length=256 and were cut off (response_length/clip_ratio "
           "1.00)")
    alike = ("the responses to each prompt scored the same, so the advantages carry no reward signal and the policy "
             "learns nothing about the reward from this step")
    repeated = f"each prompt's {key}.n=2 responses are one response repeated"
    assert warning(1.0, do_sample=False) == (
        f"WARNING step 1: {cut} and {alike}: {key}.do_sample=false decodes greedily, so {repeated}, and a cut "
        "response seldom reaches its answer, so it scores little; either alone scores a prompt's responses alike: "
        f"set {key}.do_sample=true and raise data.max_response_length\n")
    assert warning(1.0, temperature=0) == (
        f"WARNING step 1: {cut} and {alike}: {key}.temperature=0 decodes greedily, so {repeated}, and a cut "
        "response seldom reaches its answer, so it scores little; either alone scores a prompt's responses alike: "
        f"set {key}.temperature above 0 and raise data.max_response_length\n")
    # one cause: greedy and not cut off, the setting alone; cut off and sampled, the length alone
    assert warning(0.2, do_sample=False) == (f"WARNING step 1: {alike}: {key}.do_sample=false decodes greedily, so "
                                             f"{repeated}; set {key}.do_sample=true\n")
    assert warning(1.0) == (f"WARNING step 1: {cut} and {alike}: a cut response seldom reaches its answer; raise "
                            "data.max_response_length\n")
    assert warning(1.0, flat=False) == (f"WARNING step 1: {cut}: a cut response seldom reaches its answer, so it "
                                        "scores little; raise data.max_response_length\n")


LENGTH_REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return len(solution_str) / 100\n")
CONSTANT_REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                   "    return 0.5\n")


def _advice_run(workspace, capsys, out, reward, *extra) -> tuple[list[dict], list[str]]:
    """A 3-step run from the CLI scored by ``reward``, responses up to 150 tokens (the random model ends about
    two in three of them before): its records and the warnings it printed."""
    root, model, _ = workspace
    (root / f"{out}.py").write_text(reward)
    assert ppo(_overrides(root, model, "data.max_response_length=150", f"custom_reward_function.path={root / out}.py",
                          "trainer.total_training_steps=3", "trainer.test_freq=-1", f"trainer.default_local_dir={root / out}",
                          *extra)) == 0
    records = [json.loads(line) for line in (root / out / "metrics.jsonl").read_text().splitlines()]
    return records, [line for line in capsys.readouterr().err.splitlines() if "WARNING" in line]


def test_a_run_that_can_learn_gets_no_warning(workspace, capsys):
    records, warnings = _advice_run(workspace, capsys, "advice_normal", LENGTH_REWARD)
    # what makes the run a normal one, read from its records: responses mostly end before the limit, and their
    # scores (their lengths) differ
    assert all(r["response_length/clip_ratio"] < 0.9 and r["critic/score/max"] > r["critic/score/min"] for r in records)
    assert warnings == []


def test_responses_cut_at_the_length_limit_are_warned_once_naming_the_fix(workspace, capsys):
    # ignore_eos: every response runs to data.max_response_length (clip_ratio 1)
    records, warnings = _advice_run(workspace, capsys, "advice_cut", LENGTH_REWARD,
                                    "actor_rollout_ref.rollout.ignore_eos=true")
    assert [r["response_length/clip_ratio"] for r in records] == [1.0, 1.0, 1.0]
    assert all(r["critic/score/max"] > r["critic/score/min"] for r in records)  # (the EOS tokens decode to nothing)
    assert warnings == ["WARNING step 1: 100% of the responses reached data.max_response_length=150 and were cut off "
                        "(response_length/clip_ratio 1.00): a cut response seldom reaches its answer, so it scores "
                        "little; raise data.max_response_length"]  # at step 1, not again at steps 2 and 3
    # cut off and scored alike (the quickstart's max_response_length too short for any answer): one warning
    _, warnings = _advice_run(workspace, capsys, "advice_cut_flat", CONSTANT_REWARD,
                              "actor_rollout_ref.rollout.ignore_eos=true")
    assert len(warnings) == 1
    assert warnings[0].startswith("WARNING step 1: 100% of the responses reached data.max_response_length=150 and "
                                  "were cut off (response_length/clip_ratio 1.00) and every response of the batch "
                                  "scored the same")
    assert warnings[0].endswith("raise data.max_response_length") and "check the reward" not in warnings[0]


def test_a_reward_that_tells_no_response_apart_is_warned_every_n_steps(workspace, capsys, monkeypatch):
    from rlhf_core.training import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "STUCK_WARNING_EVERY", 2)
    records, warnings = _advice_run(workspace, capsys, "advice_flat", CONSTANT_REWARD)
    assert all(r["critic/score/max"] == r["critic/score/min"] == 0.5 for r in records)
    assert all(r["response_length/clip_ratio"] < 0.9 for r in records)
    assert [w.split(":")[0] for w in warnings] == ["WARNING step 1", "WARNING step 3"]
    assert "every response of the batch scored the same" in warnings[0] and "check the reward" in warnings[0]


ONE_RESPONSE_A_PROMPT = (
    "WARNING: algorithm.adv_estimator=grpo compares the responses to the same prompt, and "
    "actor_rollout_ref.rollout.n=1 samples one: each response is a group of its own, whose advantage is its score "
    "as it stands (whitened over the batch for reinforce_plus_plus_baseline), without the baseline the other "
    "responses to its prompt would give; raise actor_rollout_ref.rollout.n to 2 or more")


def test_a_group_estimator_with_one_response_a_prompt_is_warned_before_the_first_step(workspace, capsys):
    """GRPO with rollout.n=1 is a config fact: said once before step 1, whatever the steps show (scores that differ,
    responses cut off and scored alike), and not taken for scores that tell no responses apart."""
    grpo = ("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1")
    _, warnings = _advice_run(workspace, capsys, "advice_grpo", LENGTH_REWARD, *grpo)
    assert warnings == [ONE_RESPONSE_A_PROMPT]  # scores that differ over the batch: GRPO's advantages follow them
    _, warnings = _advice_run(workspace, capsys, "advice_grpo_cut", CONSTANT_REWARD, *grpo,
                              "actor_rollout_ref.rollout.ignore_eos=true")
    assert len(warnings) == 2 and warnings[0] == ONE_RESPONSE_A_PROMPT
    assert warnings[1].startswith("WARNING step 1: 100% of the responses reached data.max_response_length=150 and "
                                  "were cut off (response_length/clip_ratio 1.00) and every response of the batch "
                                  "scored the same")
    _, warnings = _advice_run(workspace, capsys, "advice_grpo_n2", LENGTH_REWARD, "algorithm.adv_estimator=grpo",
                              "actor_rollout_ref.rollout.n=2")
    assert ONE_RESPONSE_A_PROMPT not in warnings


TRUTH_REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                "    return float(ground_truth)\n")
GREEDY_GROUPS = ("WARNING: actor_rollout_ref.rollout.do_sample=false decodes greedily, so each prompt's "
                 "actor_rollout_ref.rollout.n=2 responses are one response repeated: algorithm.adv_estimator=grpo "
                 "compares each response with the others to its prompt, so every advantage is 0 and the policy learns "
                 "nothing about the reward; set actor_rollout_ref.rollout.do_sample=true")


def test_greedy_training_rollouts_in_groups_are_warned_before_the_first_step_naming_the_setting(workspace, capsys):
    """GRPO on greedy training rollouts (do_sample=false, n=2) compares a response with its own copy: every advantage
    is 0. Said before step 1, and the step's alike-scores warning names the setting, not the reward (whose scores,
    the prompts' ground truths, differ between prompts) nor the length limit."""
    records, warnings = _advice_run(workspace, capsys, "advice_greedy", TRUTH_REWARD, "algorithm.adv_estimator=grpo",
                                    "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.do_sample=false")
    assert all(r["critic/advantages/max"] == r["critic/advantages/min"] == 0.0 for r in records)
    assert records[0]["critic/score/max"] > records[0]["critic/score/min"]  # the reward tells prompts apart
    assert warnings[0] == GREEDY_GROUPS
    # the random model's greedy responses all run to the limit: the step is cut off and scored alike, and the
    # advice is the setting and the length (a longer limit would not tell a response from its copy, and sampled
    # responses all cut off would seldom reach an answer)
    assert [r["response_length/clip_ratio"] for r in records] == [1.0, 1.0, 1.0]
    assert warnings[1] == ("WARNING step 1: 100% of the responses reached data.max_response_length=150 and were cut "
                           "off (response_length/clip_ratio 1.00) and the responses to each prompt scored the same, "
                           "so the advantages carry no "
                           "reward signal and the policy learns nothing about the reward from this step: "
                           "actor_rollout_ref.rollout.do_sample=false decodes greedily, so each prompt's "
                           "actor_rollout_ref.rollout.n=2 responses are one response repeated, and a cut response "
                           "seldom reaches its answer, so it scores little; either alone scores a prompt's responses "
                           "alike: set actor_rollout_ref.rollout.do_sample=true and raise data.max_response_length")
    # a temperature of 0 decodes greedily too, and the warning names it
    _, warnings = _advice_run(workspace, capsys, "advice_greedy_t0", LENGTH_REWARD, "algorithm.adv_estimator=rloo",
                              "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.temperature=0")
    assert warnings[0].startswith("WARNING: actor_rollout_ref.rollout.temperature=0.0 decodes greedily, so each "
                                  "prompt's actor_rollout_ref.rollout.n=2 responses are one response repeated: "
                                  "algorithm.adv_estimator=rloo compares")
    assert warnings[0].endswith("; set actor_rollout_ref.rollout.temperature above 0")
    _, warnings = _advice_run(workspace, capsys, "advice_sampled", LENGTH_REWARD, "algorithm.adv_estimator=grpo",
                              "actor_rollout_ref.rollout.n=2")
    assert not any("decodes greedily" in w for w in warnings)


def test_greedy_training_rollouts_without_groups_get_a_notice_of_the_repeated_work(workspace, capsys):
    root, model, _ = workspace
    (root / "greedy_gae.py").write_text(LENGTH_REWARD)
    assert ppo(_overrides(root, model, f"custom_reward_function.path={root / 'greedy_gae.py'}",
                          "trainer.total_training_steps=1", "trainer.test_freq=-1",
                          f"trainer.default_local_dir={root / 'greedy_gae'}", "actor_rollout_ref.rollout.n=3",
                          "actor_rollout_ref.rollout.do_sample=false")) == 0
    err = capsys.readouterr().err
    assert ("notice: actor_rollout_ref.rollout.do_sample=false decodes greedily, so each prompt's "
            "actor_rollout_ref.rollout.n=3 responses are one response repeated: each step generates and trains on the "
            "same response 3 times over; set actor_rollout_ref.rollout.do_sample=true, or set "
            "actor_rollout_ref.rollout.n=1") in err
    assert "WARNING: actor_rollout_ref.rollout.do_sample=false" not in err


def test_dynamic_sampling_that_keeps_nothing_stops_with_the_step_and_a_resume_may_raise_its_limit(workspace, tmp_path,
                                                                                              capsys):
    """A reward that tells the two responses of each prompt apart for its first 16 calls (step 1's one generation
    batch of 8 prompts x 2), then scores every response 0: step 2 keeps no group in its max_num_gen_batches=1 batch.
    The run stopped with a traceback, and the advice to raise max_num_gen_batches could not be followed, a resume
    with another value being refused as a change of the training math."""
    root, model, _ = workspace
    out = tmp_path / "out"
    counter = tmp_path / "calls.txt"  # the calls over both runs, whatever module state a resume starts from
    reward = tmp_path / "fading.py"
    reward.write_text("from pathlib import Path\n"
                      f"COUNTER = Path({str(counter)!r})\n"
                      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    calls = int(COUNTER.read_text()) if COUNTER.exists() else 0\n"
                      "    COUNTER.write_text(str(calls + 1))\n"
                      "    return float(calls % 2) if calls < 16 else 0.0\n")
    common = ["algorithm.adv_estimator=grpo", "algorithm.filter_groups.enable=true", "trainer.save_freq=1",
              "trainer.total_training_steps=3", "trainer.test_freq=-1", f"custom_reward_function.path={reward}",
              f"trainer.default_local_dir={out}"]
    assert ppo(_overrides(root, model, *common, "algorithm.filter_groups.max_num_gen_batches=1")) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert ("error: training step 2 failed: dynamic sampling: in 1 generation batches "
            "(algorithm.filter_groups.max_num_gen_batches=1) every one of the 8 prompt groups scored the same") in err
    assert (f"\nthe latest checkpoint {out / 'global_step_1'} is intact: raise "
            "algorithm.filter_groups.max_num_gen_batches (it may change on a resume), then rerun the same command to "
            "resume from it") in err
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    # the resume with a raised limit is taken: its step 2 draws 3 batches (48 more calls, all scored 0)
    assert ppo(_overrides(root, model, *common, "algorithm.filter_groups.max_num_gen_batches=3")) == 1
    err = capsys.readouterr().err
    assert f"resumed from {out / 'global_step_1'} (step 1 of 3)" in err
    assert ("error: training step 2 failed: dynamic sampling: in 3 generation batches "
            "(algorithm.filter_groups.max_num_gen_batches=3) every one of the 24 prompt groups") in err
    assert counter.read_text() == str(16 + 16 + 48)


@pytest.mark.parametrize("val_before_train", [False, True])
def test_a_run_whose_data_runs_out_before_step_1_saves_no_checkpoint(workspace, capsys, val_before_train):
    """Dynamic sampling with a constant reward keeps no group; the data (one pass of 2 batches of 8 prompts) runs out before
    step 1 trains. The run saved global_step_0 of the untrained model (at its end, or as the guards' first best
    after the validation before training) and marked it latest: a resume with a reward that works then took it as
    the run's progress, found the data used up and trained nothing."""
    root, model, _ = workspace
    out = root / f"exhausted_{val_before_train}"
    (root / "constant.py").write_text(CONSTANT_REWARD)
    (root / "length.py").write_text(LENGTH_REWARD)
    common = ["algorithm.adv_estimator=grpo", "algorithm.filter_groups.enable=true",
              "algorithm.filter_groups.max_num_gen_batches=3", "data.train_max_samples=16",
              "trainer.total_epochs=1", "trainer.total_training_steps=1", f"trainer.val_before_train={str(val_before_train).lower()}",
              f"trainer.default_local_dir={out}"]
    assert ppo(_overrides(root, model, *common, f"custom_reward_function.path={root / 'constant.py'}")) == 0
    err = capsys.readouterr().err
    assert ("dynamic sampling: the training data ran out: trainer.total_epochs passes drawn before a prompt group "
            "scored differently (16 groups dropped in 2 generation batches); no step was trained, so no checkpoint "
            "is saved") in err
    assert sorted(path.name for path in out.glob("global_step_*")) == []
    assert not (out / "latest_checkpointed_iteration.txt").exists()
    # the same folder with a reward that tells responses apart: a new run, which trains its step
    assert ppo(_overrides(root, model, *common, f"custom_reward_function.path={root / 'length.py'}")) == 0
    assert "already complete" not in capsys.readouterr().err
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
