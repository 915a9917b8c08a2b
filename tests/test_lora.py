"""LoRA on the actor and the critic: the reference is the base model (adapters off, no copy), only the
adapters (and the value head) learn, checkpoints hold the adapters, the export is merged and plain."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_core.config import load_config
from rlhf_core.data.synthetic import build_dataset
from rlhf_core.main_ppo import build_trainer
from rlhf_core.models.lora import merged_state_dict
from rlhf_core.models.toy import random_toy_model
from rlhf_core.training import checkpoint
from rlhf_core.workers.actor import response_log_prob


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = random_toy_model(root / "model", n_layers=1, hidden_size=32, max_position_embeddings=512, seed=0)
    build_dataset(root / "data", n_train=8, n_test=4, seed=0, max_ops=1)
    (root / "reward.py").write_text(  # about half the responses score: advantages that move the policy
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(ord((solution_str or ' ')[0]) % 2)\n")
    return root, model


def _trainer(root, model, out, *extra):
    cfg = load_config([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={root / 'data' / 'train.parquet'}",
        f"data.val_files={root / 'data' / 'test.parquet'}", "data.train_batch_size=4",
        "data.max_prompt_length=320", "data.max_response_length=6", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.lora_alpha=8", "critic.model.lora_rank=4", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.optim.lr=5e-2", "critic.optim.lr=5e-2",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "critic.model.enable_gradient_checkpointing=false", "trainer.n_gpus_per_node=1", "trainer.device=cpu",
        "trainer.val_before_train=false", "trainer.logger=[]", f"trainer.default_local_dir={out}",
        f"custom_reward_function.path={root / 'reward.py'}", *extra,
    ])
    return build_trainer(cfg)


@pytest.fixture(scope="module")
def trained(workspace):
    """A LoRA trainer after one PPO step, its rollout batch, and the base weights it started from."""
    root, model = workspace
    trainer = _trainer(root, model, root / "out")
    base = AutoModelForCausalLM.from_pretrained(model).eval()
    initial = {name: p.detach().clone() for name, p in trainer.actor.module.named_parameters()}
    prompts = trainer.train_dataset.collate(list(range(4)))
    trainer.train_step(prompts)
    batch = trainer.actor.generate(prompts, trainer._train_params())
    return trainer, base, initial, batch


def test_reference_is_the_base_model_without_a_copy(trained):
    trainer, base, _, batch = trained
    actor = trainer.actor
    assert actor.ref_module is None  # the reference is the policy with its adapters switched off
    with torch.no_grad():
        expected, _ = response_log_prob(base, batch, actor.config.rollout.temperature, False)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(actor.compute_ref_log_prob(batch)[mask], expected[mask], rtol=1e-5, atol=1e-5)
    policy, _ = actor.compute_log_prob(batch)
    assert (policy[mask] - expected[mask]).abs().max() > 1e-3  # the adapters did move the policy


def test_only_the_adapters_and_the_value_head_learn(trained):
    trainer, _, initial, _ = trained
    actor_params = dict(trainer.actor.module.named_parameters())
    trainable = {name for name, p in actor_params.items() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    for name, param in actor_params.items():
        if name not in trainable:  # the base weights: no gradient, not a bit changed
            assert param.grad is None and torch.equal(param, initial[name]), name
    assert all(not torch.equal(actor_params[n], initial[n]) for n in trainable if ".lora_B." in n)
    critic_trainable = [n for n, p in trainer.critic.module.named_parameters() if p.requires_grad]
    assert any("score" in n for n in critic_trainable)  # the value head is trained in full
    assert all("lora_" in n or "score" in n for n in critic_trainable)


def test_checkpoint_holds_adapters_and_the_export_is_merged_plain_transformers(trained, workspace, tmp_path):
    trainer, _, _, batch = trained
    root, model = workspace
    trainer.checkpoint_dir = tmp_path / "ckpt"
    path = trainer.save_checkpoint()
    actor_state = checkpoint.load_model_state(path, "actor")
    assert actor_state and all(".lora_" in name for name in actor_state)
    assert all(".lora_" in n or "score" in n for n in checkpoint.load_model_state(path, "critic"))

    exported = AutoModelForCausalLM.from_pretrained(path / "actor" / "huggingface").eval()  # plain transformers
    assert not any("lora" in name for name in exported.state_dict())
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        torch.testing.assert_close(exported(**inputs).logits, trainer.actor.module(**inputs).logits,
                                   rtol=1e-4, atol=1e-5)

    fresh = _trainer(root, model, tmp_path / "other")
    fresh.load_checkpoint(path)
    torch.testing.assert_close(fresh.actor.compute_log_prob(batch)[0], trainer.actor.compute_log_prob(batch)[0])


def test_merge_is_w_plus_scaled_b_a():
    weight, lora_a, lora_b = torch.randn(3, 4), torch.randn(2, 4), torch.randn(3, 2)
    state = {"base_model.model.proj.base_layer.weight": weight, "base_model.model.proj.lora_A.default.weight": lora_a,
             "base_model.model.proj.lora_B.default.weight": lora_b, "base_model.model.norm.weight": torch.ones(4)}
    merged = merged_state_dict(state, scaling=0.5)
    assert sorted(merged) == ["norm.weight", "proj.weight"]
    torch.testing.assert_close(merged["proj.weight"], weight + 0.5 * lora_b @ lora_a)


@pytest.mark.parametrize("targets, named", [("all-linear", r"\(Conv1D\)"), (["wte"], r"\(Embedding\)"),
                                             (["lm_head"], "lm_head, the output head tied to the input embedding")])
def test_adapters_the_merge_cannot_take_are_refused_when_applied(targets, named):
    """GPT-2's projections are Conv1D (weights stored transposed), an embedding's adapters are lora_embedding_A/B,
    and its lm_head is the embedding's weight: none merges as W + s B A into a tensor of its own, so the rollout's
    weights and the export would be wrong; they are refused, and GPT-2 has no other layer to adapt."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlhf_core.models.lora import apply_lora

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32))
    with pytest.raises(ValueError, match=rf"LoRA adapters on .*{named}.*the model has no linear layer LoRA can adapt "
                                         r"here: train it in full, lora_rank=0"):
        apply_lora(model, rank=2, alpha=4, target_modules=targets)


def _llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)).eval()


def test_an_adapted_output_head_tied_to_the_embedding_is_refused():
    """With tie_word_embeddings the head's weight is the embedding's: the export writes one tensor for both (the
    embedding) and vLLM loads only it, so the trained head would be lost and the base model scored instead."""
    from rlhf_core.models.lora import apply_lora

    with pytest.raises(ValueError, match=r"LoRA adapters on lm_head, the output head tied to the input embedding "
                                         r"\(tie_word_embeddings\).*leave lm_head out: set model.target_modules to "
                                         r"some of its linear layers, \[q_proj,k_proj,v_proj,o_proj,gate_proj,"
                                         r"up_proj,down_proj\], or all-linear"):
        apply_lora(_llama(tied=True), rank=2, alpha=4, target_modules=["lm_head"])


def test_an_adapted_output_head_of_its_own_is_exported_with_its_adapter(tmp_path):
    """An untied head is a linear layer like the others: its adapter is merged into the export's lm_head."""
    from rlhf_core.models.loading import save_hf_model
    from rlhf_core.models.lora import apply_lora, base_model, lora_scaling

    actor = apply_lora(_llama(tied=False), rank=2, alpha=4, target_modules=["lm_head", "q_proj"])
    with torch.no_grad():
        for name, param in actor.named_parameters():
            if ".lora_B." in name:
                param.normal_()  # adapters that change the model (B starts at 0)
    save_hf_model(base_model(actor), merged_state_dict(actor.state_dict(), lora_scaling(actor)), tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    input_ids = torch.tensor([[1, 5, 7, 9, 11]])
    with torch.no_grad():
        expected = torch.log_softmax(actor(input_ids=input_ids).logits, dim=-1)
        base = torch.log_softmax(_llama(tied=False)(input_ids=input_ids).logits, dim=-1)
        torch.testing.assert_close(torch.log_softmax(exported(input_ids=input_ids).logits, dim=-1), expected,
                                   rtol=1e-4, atol=1e-5)
    assert (expected - base).abs().max() > 1e-2  # the adapters did change the policy


def test_targets_are_checked_in_the_form_the_model_trains_in_and_a_form_it_lacks_is_left_to_the_load(tmp_path):
    """OLMo2 has a sequence-classification class (a reward model) but no token-classification one (a critic): the
    reward model's check must build the former (it built the latter and failed with transformers' ValueError)."""
    from transformers import Olmo2Config

    from rlhf_core.models.lora import check_targets, target_problems

    Olmo2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, eos_token_id=1, pad_token_id=0).save_pretrained(tmp_path)
    assert target_problems("reward_model.train.model", tmp_path, ["q_proj"], scorer=True) == []
    [problem] = target_problems("reward_model.train.model", tmp_path, ["qproj"], scorer=True)
    assert problem.startswith(f"reward_model.train.model.target_modules: qproj names no module of {tmp_path}")
    assert "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]" in problem  # the score head is not offered
    found = check_targets(tmp_path, ["q_proj"], critic=True)  # no token-classification OLMo2: nothing to say here
    assert (found.unmatched, found.refusals, found.linear) == ([], [], [])


def test_a_misspelled_string_target_is_not_told_to_become_a_list_of_itself(tmp_path):
    from rlhf_core.models.lora import target_problems

    model = random_toy_model(tmp_path / "m", n_layers=1, hidden_size=32, max_position_embeddings=64, seed=0)
    [plain] = target_problems("actor_rollout_ref.model", model, "q_proj")
    assert plain.endswith("for the layers named q_proj, write the list [q_proj]")
    [misspelled] = target_problems("actor_rollout_ref.model", model, "qproj")
    assert "write the list [qproj]" not in misspelled
    assert misspelled.endswith("set model.target_modules to some of its linear layers, "
                               "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj], or all-linear")
