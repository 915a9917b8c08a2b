"""Micro-batches take rows shortest first (less padding computed) and results come back in row order."""

from __future__ import annotations

import torch
from test_remove_padding import model_dir, padded_batch  # noqa: F401  (the fixture and its batch)

from rlhf_core.batch import Batch
from rlhf_core.config import load_config
from rlhf_core.models.loading import load_tokenizer
from rlhf_core.workers.actor import ActorWorker, response_log_prob
from rlhf_core.workers.common import in_row_order, micro_batch_rows, micro_batches, trimmed_inputs


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
