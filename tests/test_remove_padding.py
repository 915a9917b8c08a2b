"""``use_remove_padding``: sequences packed into one row without pad tokens give the padded path's
log-probs, entropies and values; without flash attention a notice and the padded path.

On CPU transformers keeps packed sequences apart with a block-diagonal mask built from the
position ids (correct, though no cheaper than padding), so the packing code is checked here;
with flash attention (``gpu``) the variable-length kernels run the same packed rows.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_core.config import load_config
from rlhf_core.models.loading import load_critic, load_tokenizer
from rlhf_core.models.toy import random_toy_model
from rlhf_core.workers.actor import ActorWorker, response_log_prob
from rlhf_core.workers.common import packed_inputs
from rlhf_core.workers.critic import response_values


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_toy_model(tmp_path_factory.mktemp("packing") / "model", n_layers=2, hidden_size=32,
                            max_position_embeddings=512, seed=0)


def padded_batch(n_rows: int = 6, prompt_len: int = 7, response_len: int = 5, seed: int = 0) -> dict:
    """Left-padded prompts and right-padded responses of varied lengths, as the rollout makes them."""
    g = torch.Generator().manual_seed(seed)
    prompt_valid = torch.randint(1, prompt_len + 1, (n_rows,), generator=g)
    response_valid = torch.randint(1, response_len + 1, (n_rows,), generator=g)
    prompt_mask = (torch.arange(prompt_len) >= prompt_len - prompt_valid[:, None]).long()
    response_mask = (torch.arange(response_len) < response_valid[:, None]).long()
    prompts = torch.randint(4, 90, (n_rows, prompt_len), generator=g) * prompt_mask  # pad id 0
    responses = torch.randint(4, 90, (n_rows, response_len), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    from rlhf_core.batch import Batch

    return Batch({"prompts": prompts, "responses": responses, "response_mask": response_mask,
                  "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
                  "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0)})


def test_packing_keeps_only_valid_tokens_with_positions_restarting_per_sequence():
    batch = padded_batch()
    inputs, valid = packed_inputs(batch)
    lengths = batch["attention_mask"].sum(-1).tolist()
    assert inputs["input_ids"].shape == (1, sum(lengths))
    starts = (inputs["position_ids"][0] == 0).nonzero().flatten().tolist()
    assert starts == [sum(lengths[:i]) for i in range(len(lengths))]  # one sequence begins at each 0
    assert torch.equal(inputs["input_ids"][0], batch["input_ids"][valid])


def test_packed_and_padded_paths_give_the_same_log_probs_entropies_and_values(model_dir):
    batch = padded_batch()
    mask = batch["response_mask"].bool()
    actor = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    critic = load_critic(model_dir)
    with torch.no_grad():
        torch.nn.init.normal_(critic.score.weight, std=0.5)  # a value head that is not all zeros
        padded = response_log_prob(actor, batch, temperature=0.7, with_entropy=True)
        packed = response_log_prob(actor, batch, temperature=0.7, with_entropy=True, remove_padding=True)
        values = response_values(critic, batch), response_values(critic, batch, remove_padding=True)
    for a, b in zip(padded, packed):
        torch.testing.assert_close(b[mask], a[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values[1], values[0], rtol=1e-5, atol=1e-5)
    assert values[0][mask].abs().min() > 0


def test_without_flash_attention_a_notice_and_the_padded_path(model_dir, capsys):
    cfg = load_config([f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.use_remove_padding=true",
                       "actor_rollout_ref.model.enable_gradient_checkpointing=false", "trainer.device=cpu",
                       "trainer.n_gpus_per_node=1"])
    actor = ActorWorker(cfg.actor_rollout_ref, load_tokenizer(model_dir), total_steps=1, need_ref=False)
    err = capsys.readouterr().err
    assert "notice: actor_rollout_ref.model.use_remove_padding=true needs flash_attention_2" in err
    assert "sequences run padded" in err and len([line for line in err.splitlines() if "notice:" in line]) == 1
    assert actor.remove_padding is False


@pytest.mark.gpu
def test_flash_attention_packed_rows_match_padded(model_dir):
    if not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None:
        pytest.skip("needs CUDA and flash-attn (pip install flash-attn)")
    batch = padded_batch().to("cuda")
    mask = batch["response_mask"].bool()
    flash = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2").cuda().eval()
    with torch.no_grad():
        packed, _ = response_log_prob(flash, batch, 1.0, False, remove_padding=True)
        padded, _ = response_log_prob(flash, batch, 1.0, False)
    torch.testing.assert_close(packed[mask], padded[mask], rtol=0, atol=5e-2)  # bf16


@pytest.mark.parametrize("remove_padding", [False, True])
def test_entropy_without_grad_is_a_metric_outside_the_graph(model_dir, remove_padding):
    """With no entropy bonus the update measures entropy without a backward pass through it."""
    batch = padded_batch()
    mask = batch["response_mask"].bool()
    actor = AutoModelForCausalLM.from_pretrained(model_dir)
    log_prob, with_grad = response_log_prob(actor, batch, 1.0, True, remove_padding)
    _, metric = response_log_prob(actor, batch, 1.0, True, remove_padding, entropy_grad=False)
    assert log_prob.requires_grad and with_grad.requires_grad and not metric.requires_grad
    torch.testing.assert_close(metric[mask], with_grad.detach()[mask])
    assert metric[mask].min() > 0  # a random model's next-token distributions are far from one-hot
