"""Micro-batches take rows shortest first (less padding computed), keep a prompt's rows together with
``use_shared_prefix``, stay within the token budget in every pass, are as many on every rank, and results come
back in row order."""

from __future__ import annotations

import pytest
import torch
from test_remove_padding import model_dir, padded_batch  # noqa: F401  (the fixture and its batch)
from test_shared_prefix import grouped_batch

from rlhf_core.batch import Batch
from rlhf_core.config import load_config
from rlhf_core.models.loading import load_tokenizer
from rlhf_core.workers import actor as actor_module
from rlhf_core.workers import critic as critic_module
from rlhf_core.workers import distributed
from rlhf_core.workers.actor import ActorWorker, response_log_prob
from rlhf_core.workers.common import (
    in_row_order,
    micro_batch_rows,
    micro_batches,
    prompt_groups,
    trimmed_inputs,
)
from rlhf_core.workers.critic import CriticWorker


def _lengths_batch(lengths: list[int], width: int = 10) -> Batch:
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    return Batch({"attention_mask": mask, "input_ids": mask * 5})


def test_rows_are_grouped_shortest_first():
    batch = _lengths_batch([9, 2, 7, 3, 8, 1])
    # ascending lengths 1, 2, 3, 7, 8, 9 are rows 5, 1, 3, 2, 4, 0
    assert micro_batch_rows(batch, 2, False, 0) == [[5, 1], [3, 2], [4, 0]]
    # a budget of 10 tokens: 1+2+3 = 6 fits, 6+7 does not; 7+8 does not; 8+9 does not
    assert micro_batch_rows(batch, None, True, 10) == [[5, 1, 3], [2], [4], [0]]
    assert micro_batch_rows(batch, None, False, 0) == [[5, 1, 3, 2, 4, 0]]
    # equal lengths keep their order
    assert micro_batch_rows(_lengths_batch([4, 4, 1, 4]), 2, False, 0) == [[2, 0], [1, 3]]


def _prompt_batch(prompts: list[list[int]], response_lengths: list[int], width: int = 4) -> Batch:
    """One row per prompt (its tokens, left-padded to ``width``) with a response of the given length."""
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    prompt_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    response_mask = (torch.arange(width) < torch.tensor(response_lengths)[:, None]).long()
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return Batch({"prompts": prompt_ids, "responses": response_mask * 7, "response_mask": response_mask,
                  "input_ids": torch.cat([prompt_ids, response_mask * 7], 1), "attention_mask": attention_mask,
                  "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0)})


def test_a_prompt_split_over_micro_batches_counts_in_each_of_them():
    # one prompt of 4 tokens, five responses of 4: each micro-batch runs the prompt once, so a budget of 12
    # holds 4 + 2 * 4 tokens, two rows, in every micro-batch, not only the first
    batch = _prompt_batch([[5, 6, 7, 8]] * 5, [4] * 5)
    assert micro_batch_rows(batch, None, True, 12, by_prompt=True) == [[0, 1], [2, 3], [4]]


def test_prompts_of_the_same_length_do_not_interleave():
    # prompts A (rows 0, 2) and B (rows 1, 3) of 3 tokens each; by response length alone the rows would go A B A B
    batch = _prompt_batch([[5, 6, 7], [8, 9, 10], [5, 6, 7], [8, 9, 10]], [1, 2, 3, 4])
    groups = micro_batch_rows(batch, 2, False, 0, by_prompt=True)
    assert sorted(sorted(rows) for rows in groups) == [[0, 2], [1, 3]]


def test_a_rank_with_fewer_micro_batches_splits_its_heaviest_until_it_has_as_many(monkeypatch):
    monkeypatch.setattr(distributed, "all_reduce_max", lambda count: 3)  # another rank runs 3
    batch = _lengths_batch([4, 1, 4, 2, 3])
    # a budget of 8: rows 1, 3, 4 (1+2+3 = 6 tokens) and rows 0, 2 (4+4 = 8); the 8-token one is split in two
    assert micro_batch_rows(batch, None, True, 8) == [[1, 3, 4], [0], [2]]
    monkeypatch.setattr(distributed, "all_reduce_max", lambda count: 6)
    with pytest.raises(RuntimeError, match="has 2 sequences but must run 6 micro-batches"):
        micro_batch_rows(_lengths_batch([4, 1]), None, True, 8)


def test_sorted_micro_batches_compute_fewer_pad_tokens():
    batch = padded_batch(n_rows=8, prompt_len=9, response_len=9, seed=1)

    def computed(groups):  # rows x trimmed width, summed over the micro-batches
        total = 0
        for rows in groups:
            inputs, _, _ = trimmed_inputs(batch.select(rows))
            total += inputs["input_ids"].numel()
        return total

    in_order = [list(range(start, start + 2)) for start in range(0, 8, 2)]
    assert computed(micro_batch_rows(batch, 2, False, 0)) < computed(in_order)


def test_in_row_order_undoes_the_grouping():
    groups = [[5, 1], [3, 2], [4, 0]]
    parts = [torch.tensor([[float(r)] * 3 for r in rows]) for rows in groups]  # each row's own index
    assert in_row_order(parts, groups)[:, 0].tolist() == [0, 1, 2, 3, 4, 5]


def test_log_probs_in_micro_batches_equal_the_whole_batch(model_dir):  # noqa: F811
    cfg = load_config([f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cpu",
                       "actor_rollout_ref.model.enable_gradient_checkpointing=false", "trainer.n_gpus_per_node=1"])
    actor = ActorWorker(cfg.resolved().actor_rollout_ref, load_tokenizer(model_dir), total_steps=1, need_ref=False)
    batch = padded_batch(n_rows=6)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        whole, whole_entropy = response_log_prob(actor.forward_module, batch, 1.0, True)
    assert [len(mb) for mb in micro_batches(batch, 2, False, 0)] == [2, 2, 2]
    log_prob, entropy = actor._log_prob(batch, 2, False, 0, True)
    torch.testing.assert_close(log_prob[mask], whole[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[mask], whole_entropy[mask], rtol=1e-5, atol=1e-5)


def _workers(path, *overrides: str) -> tuple[ActorWorker, CriticWorker]:
    """An actor and a critic on the toy model for :func:`grouped_batch`'s rows: one mini-batch of 3 prompts x 4
    responses per update."""
    cfg = load_config([f"actor_rollout_ref.model.path={path}", "trainer.device=cpu", "trainer.n_gpus_per_node=1",
                       "actor_rollout_ref.model.enable_gradient_checkpointing=false",
                       "critic.model.enable_gradient_checkpointing=false", "data.train_batch_size=3",
                       "data.max_prompt_length=9", "data.max_response_length=6",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=3", "actor_rollout_ref.rollout.n=4",
                       *overrides]).resolved()
    return (ActorWorker(cfg.actor_rollout_ref, load_tokenizer(path), total_steps=1, need_ref=False),
            CriticWorker(cfg.critic, "float32", total_steps=1))


def _each_micro_batch(monkeypatch, measure) -> list:
    """``measure(micro_batch)`` of every micro-batch the actor's log-prob pass and update and the critic's value
    pass and update run, recorded as they run it."""
    seen = []
    for module, name in ((actor_module, "response_log_prob"), (critic_module, "response_values")):
        def recording(model, mb, *args, _real=getattr(module, name), **kwargs):
            seen.append(measure(mb))
            return _real(model, mb, *args, **kwargs)

        monkeypatch.setattr(module, name, recording)
    return seen


def _passes(actor: ActorWorker, critic: CriticWorker, batch: Batch):
    """(name, run) of each pass that micro-batches ``batch`` (3 prompts x 4 rows, with what the updates need)."""
    mask = batch["response_mask"].float()
    batch = Batch({**batch.tensors, "old_log_prob": torch.zeros_like(mask), "advantages": mask.clone(),
                   "values": torch.zeros_like(mask), "returns": mask.clone()})
    return [("log-probs", lambda: actor.compute_log_prob(batch)), ("values", lambda: critic.compute_values(batch)),
            ("actor update", lambda: actor.update_policy(batch, n_per_prompt=4)),
            ("critic update", lambda: critic.update_critic(batch, n_per_prompt=4))]


def test_with_shared_prefix_every_pass_gives_each_prompt_its_own_micro_batch(model_dir, monkeypatch):  # noqa: F811
    actor, critic = _workers(model_dir, "actor_rollout_ref.model.use_shared_prefix=true",
                             "critic.model.use_shared_prefix=true",
                             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                             "critic.ppo_micro_batch_size_per_gpu=4")
    assert actor.shared_prefix.update and critic.shared_prefix.update
    prompts = _each_micro_batch(monkeypatch, lambda mb: len(prompt_groups(mb)[0]))
    for name, run in _passes(actor, critic, grouped_batch()):
        prompts.clear()
        run()
        assert prompts == [1, 1, 1], name  # 4 rows a micro-batch: the 4 rows of one prompt


def test_every_pass_keeps_to_its_token_budget(model_dir, monkeypatch):  # noqa: F811
    actor, critic = _workers(model_dir, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=30", "critic.use_dynamic_bsz=true",
                             "critic.ppo_max_token_len_per_gpu=30")
    batch = grouped_batch()
    total = int(batch["attention_mask"].sum())
    assert total > 30  # more than one micro-batch's worth
    tokens = _each_micro_batch(monkeypatch, lambda mb: int(mb["attention_mask"].sum()))
    for name, run in _passes(actor, critic, batch):
        tokens.clear()
        run()
        assert max(tokens) <= 30 and sum(tokens) == total, (name, tokens)  # every row once, none over budget
