"""LoRA on the actor and the critic: the reference is the base model (adapters off, no copy), only the
adapters (and the value head) learn, checkpoints hold the adapters, the export is merged and plain."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_core.config import load_config
from rlhf_core.data.synthetic import build_dataset
from rlhf_core.main_ppo import build_trainer
from rlhf_core.models.lora import base_model, merged_state_dict
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


def test_reference_is_the_base_model_without_a_copy(trained, workspace, tmp_path):
    """With the adapters off every adapted layer computes its base layer alone: the reference log-probs are the
    base model's to the bit, those of a plain load of it and those of a run without LoRA (lora_rank=0: no
    adapters, and its reference a frozen copy of the model) alike."""
    from rlhf_core.models.lora import is_lora

    trainer, base, _, batch = trained
    root, model = workspace
    actor = trainer.actor
    assert actor.ref_module is None  # the reference is the policy with its adapters switched off
    with torch.no_grad():
        expected, _ = response_log_prob(base, batch, actor.config.rollout.temperature, False)
    mask = batch["response_mask"].bool()
    reference = actor.compute_ref_log_prob(batch)
    torch.testing.assert_close(reference[mask], expected[mask], rtol=0, atol=0)
    plain = _trainer(root, model, tmp_path / "plain", "actor_rollout_ref.model.lora_rank=0", "critic.model.lora_rank=0")
    assert not is_lora(plain.actor.module) and not is_lora(plain.critic.module) and plain.actor.ref_module is not None
    assert all(param.requires_grad for param in plain.actor.module.parameters())  # lora_rank=0 trains every weight
    torch.testing.assert_close(reference[mask], plain.actor.compute_ref_log_prob(batch)[mask], rtol=0, atol=0)
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
    # the critic's adapters and its value head, trained in full, come back: the same values to the bit
    values = trainer.critic.compute_values(batch)
    assert values[batch["response_mask"].bool()].abs().min() > 0  # the head has left its zeros
    torch.testing.assert_close(fresh.critic.compute_values(batch), values, rtol=0, atol=0)


def test_checkpoint_holds_the_adapter_as_peft_saves_it_over_the_actors_model_path(trained, workspace, tmp_path):
    """verl's lora_adapter folder beside the actor's checkpoint files: peft's own from_pretrained over a plain load
    of the base model named in it is the policy the actor scores with after its update."""
    import json

    from peft import LoraConfig, PeftModel, get_peft_model

    trainer, base, _, batch = trained
    _, model = workspace
    trainer.checkpoint_dir = tmp_path / "ckpt"
    path = trainer.save_checkpoint()
    folder = path / "actor" / "lora_adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(model), LoraConfig(r=4, lora_alpha=8)).save_pretrained(
        tmp_path / "peft")  # the files peft writes for an adapter
    written = sorted(file.name for file in folder.iterdir())
    assert written == sorted(file.name for file in (tmp_path / "peft").iterdir())
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(written)
    listed = checkpoint.read_manifest(path, verify=True)["files"]
    assert all(f"actor/lora_adapter/{name}" in listed for name in written)  # in the manifest: saved atomically

    adapter_config = json.loads((folder / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(model)
    assert (adapter_config["peft_type"], adapter_config["r"], adapter_config["lora_alpha"]) == ("LORA", 4, 8)
    plain = AutoModelForCausalLM.from_pretrained(adapter_config["base_model_name_or_path"])
    adapted = PeftModel.from_pretrained(plain, folder).eval()
    mask = batch["response_mask"].bool()
    policy, _ = trainer.actor.compute_log_prob(batch)
    torch.testing.assert_close(_base_log_prob(adapted, batch)[mask], policy[mask], rtol=1e-5, atol=1e-5)
    assert (policy - _base_log_prob(base, batch))[mask].abs().max() > 1e-3  # the trained adapter, not a fresh one


def test_the_adapters_base_model_is_named_by_an_absolute_path_where_model_path_is_relative(workspace, tmp_path,
                                                                                           monkeypatch):
    """A relative actor_rollout_ref.model.path names its folder from the run's working directory only: the adapter
    names the same folder from anywhere."""
    import json

    root, model = workspace
    monkeypatch.chdir(model.parent)
    trainer = _trainer(root, model.name, tmp_path / "out", "critic.model.lora_rank=0")
    saved = json.loads((trainer.save_checkpoint() / "actor" / "lora_adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(model)


def test_merge_is_w_plus_scaled_b_a():
    weight, lora_a, lora_b = torch.randn(3, 4), torch.randn(2, 4), torch.randn(3, 2)
    state = {"base_model.model.proj.base_layer.weight": weight, "base_model.model.proj.lora_A.default.weight": lora_a,
             "base_model.model.proj.lora_B.default.weight": lora_b, "base_model.model.norm.weight": torch.ones(4)}
    merged = merged_state_dict(state, scaling=0.5)
    assert sorted(merged) == ["norm.weight", "proj.weight"]
    torch.testing.assert_close(merged["proj.weight"], weight + 0.5 * lora_b @ lora_a)



def test_a_bfloat16_models_merge_keeps_its_dtype_rounded_once_from_the_float32_sum():
    """PEFT keeps the adapters of a bfloat16 model in float32: the merged weight is the model's bfloat16 (an
    export as large as the model, in the dtype its config names), W + s B A summed in float32 and rounded once."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 4, generator=generator).to(torch.bfloat16)
    lora_a, lora_b = torch.randn(2, 4, generator=generator), torch.randn(3, 2, generator=generator)
    state = {"base_model.model.proj.base_layer.weight": weight, "base_model.model.proj.lora_A.default.weight": lora_a,
             "base_model.model.proj.lora_B.default.weight": lora_b}
    merged = merged_state_dict(state, scaling=0.5)["proj.weight"]
    assert merged.dtype == torch.bfloat16
    expected = (weight.double() + 0.5 * lora_b.double() @ lora_a.double()).to(torch.bfloat16)
    assert torch.equal(merged, expected)
    assert not torch.equal(merged, weight)  # (the update is not lost to bfloat16's rounding)

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


def test_a_lora_state_missing_or_adding_tensors_is_refused_and_a_whole_one_loads():
    """A LoRA state must hold each adapter tensor of the model and nothing else: a missing lora_B would leave that
    adapter as initialised (B = 0: silently the base layer), and an extra tensor would be dropped unread."""
    from rlhf_core.models.lora import apply_lora, load_trainable_state_dict, trainable_state_dict

    model = apply_lora(_llama(tied=False), rank=2, alpha=4, target_modules=["q_proj"])
    state = {name: torch.full_like(tensor, 0.25) for name, tensor in trainable_state_dict(model).items()}
    lora_b = next(name for name in state if ".lora_B." in name)
    with pytest.raises(RuntimeError, match=r"missing .*lora_B"):
        load_trainable_state_dict(model, {name: tensor for name, tensor in state.items() if name != lora_b})
    with pytest.raises(RuntimeError, match=r"unexpected \['base_model.model.extra.weight'\]"):
        load_trainable_state_dict(model, {**state, "base_model.model.extra.weight": torch.zeros(2)})
    assert all(not bool(param.eq(0.25).all()) for param in trainable_state_dict(model).values())  # nothing loaded
    load_trainable_state_dict(model, state)
    assert all(bool(param.eq(0.25).all()) for param in trainable_state_dict(model).values())


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


# ---------------------------------------------------------------- several steps, checked against plain transformers
STEPS = 3  # the 8 prompts in batches of 4: the third step starts a second epoch


def _base_log_prob(model: torch.nn.Module, batch) -> torch.Tensor:
    """log p(response token | everything before it) under ``model``, written out here: (bs, R)."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits.float()  # (bs, P + R, V), temperature 1
    prompt_len, response_len = batch["prompts"].shape[1], batch["responses"].shape[1]
    predicting = torch.log_softmax(logits[:, prompt_len - 1:prompt_len - 1 + response_len], dim=-1)  # (bs, R, V)
    return predicting.gather(-1, batch["responses"][..., None]).squeeze(-1)


def _record_fit(trainer) -> dict[int, dict]:
    metrics: dict[int, dict] = {}
    trainer.logger = lambda m, step: metrics.__setitem__(step, dict(m))
    trainer.fit()
    return metrics


@pytest.fixture(scope="module")
def fitted(workspace):
    """A LoRA run of STEPS steps (KL in the reward and as a loss, a checkpoint each step): the trainer, its
    metrics, each step's batch with the reference log-probs it was given, and the weights it started from."""
    root, model = workspace
    out = root / "fitted"
    trainer = _trainer(root, model, out, f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1",
                       "algorithm.use_kl_in_reward=true")
    initial = {part: {name: p.detach().clone() for name, p in worker.module.named_parameters()}
               for part, worker in (("actor", trainer.actor), ("critic", trainer.critic))}
    references = []
    compute_ref_log_prob = trainer.actor.compute_ref_log_prob

    def recording(batch):
        references.append((batch, compute_ref_log_prob(batch).clone()))
        return references[-1][1]

    trainer.actor.compute_ref_log_prob = recording
    metrics = _record_fit(trainer)
    assert sorted(metrics) == list(range(1, STEPS + 1)) and len(references) == STEPS
    return trainer, metrics, references, initial, out


def _independent_peft(model_dir, adapter: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The base model from its folder with peft's own LoRA (r=4, alpha=8, all-linear) and ``adapter`` loaded."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                                LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    expected = {name for name in peft_model.state_dict() if ".lora_" in name}
    assert set(adapter) == expected  # every adapter tensor, nothing else
    peft_model.load_state_dict(adapter, strict=False)
    return peft_model.eval()


def test_the_reference_is_the_base_model_at_every_step_after_updates(fitted, workspace):
    _, model = workspace
    trainer, _, references, _, _ = fitted
    base = AutoModelForCausalLM.from_pretrained(model).eval()  # plain transformers, no adapter code
    for step, (batch, ref_log_prob) in enumerate(references, start=1):
        mask = batch["response_mask"].bool()
        torch.testing.assert_close(ref_log_prob[mask], _base_log_prob(base, batch)[mask], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, step=step: f"step {step}: {m}")
    batch, _ = references[-1]
    mask = batch["response_mask"].bool()
    policy, _ = trainer.actor.compute_log_prob(batch)
    assert (policy - _base_log_prob(base, batch))[mask].abs().max() > 1e-2  # the adapters moved the policy


def test_the_kl_to_the_base_is_exactly_zero_until_the_adapters_move(fitted):
    """lora_B starts at zero, so the adapted policy that samples the first batch is the base to the bit: step 1's KL
    in the reward (the old and the reference log-probs, scored in the same micro-batches) is 0.0, not a rounding
    away from it. Its KL loss (one mini-batch, one epoch: taken before the adapters move) is scored in the update's
    micro-batches of 4 rows against the reference's one of 8, so it may differ by the rounding of other matmul
    shapes alone; once the adapters have moved both are far from 0."""
    _, metrics, _, _, _ = fitted
    assert metrics[1]["actor/reward_kl_penalty"] == 0.0
    assert 0.0 <= metrics[1]["actor/kl_loss"] < 1e-12  # low_var_kl of log-probs a few ulps apart: ~1e-14
    assert abs(metrics[STEPS]["actor/reward_kl_penalty"]) > 1e-6 and metrics[STEPS]["actor/kl_loss"] > 1e-6


def test_after_steps_the_base_weights_of_actor_and_critic_are_bit_identical(fitted):
    trainer, _, _, initial, _ = fitted
    for part, worker in (("actor", trainer.actor), ("critic", trainer.critic)):
        params = dict(worker.module.named_parameters())
        frozen = [name for name, p in params.items() if not p.requires_grad]
        assert frozen and all(torch.equal(params[name], initial[part][name]) for name in frozen), part
        trained = [name for name, p in params.items() if p.requires_grad]
        assert all(".lora_" in name or ".modules_to_save." in name for name in trained), part
        moved = [name for name in trained if not torch.equal(params[name], initial[part][name])]
        assert any(".lora_B." in name for name in moved), part


def test_a_resume_with_lora_continues_as_the_unbroken_run(fitted, workspace):
    from test_resume import assert_same_metrics

    root, model = workspace
    _, metrics, _, _, out = fitted
    resumed = _trainer(root, model, root / "resumed", f"trainer.total_training_steps={STEPS}",
                       "trainer.save_freq=1", "algorithm.use_kl_in_reward=true")
    resumed.load_checkpoint(out / f"global_step_{STEPS - 1}")
    again = _record_fit(resumed)
    assert sorted(again) == [STEPS]
    assert again[STEPS]["actor/kl_loss"] > 0
    assert_same_metrics(again[STEPS], metrics[STEPS], STEPS)
    # the last update lands on the same adapters, value head and Adam moments as the unbroken run's
    unbroken, resumed_run = out / f"global_step_{STEPS}", root / "resumed" / f"global_step_{STEPS}"
    for part in ("actor", "critic"):
        expected, state = (checkpoint.load_model_state(run, part) for run in (unbroken, resumed_run))
        assert sorted(state) == sorted(expected) and all(torch.equal(state[n], expected[n]) for n in expected), part
        before = checkpoint.load_model_state(out / f"global_step_{STEPS - 1}", part)
        assert any(not torch.equal(before[n], expected[n]) for n in expected), part  # the last step moved them
        expected, state = (torch.load(run / part / "optim_state.pt", weights_only=False)["optimizer"]["state"]
                           for run in (unbroken, resumed_run))
        assert sorted(state) == sorted(expected) and all(
            torch.equal(state[i][key], expected[i][key]) for i in expected for key in expected[i]), part


def test_after_updates_log_probs_rollout_and_weight_sync_are_the_saved_adapters(fitted, workspace, monkeypatch):
    """The saved adapter, loaded into peft's own LoRA on a plain load of the base, is the policy the actor
    scores with, the one its HF rollout samples from (the prompts' pass and each decode step), and the one its
    merged weights for vLLM hold."""
    from rlhf_core.rollout import hf

    _, model = workspace
    trainer, _, references, _, out = fitted
    adapted = _independent_peft(model, checkpoint.load_model_state(out / f"global_step_{STEPS}", "actor"))
    base = AutoModelForCausalLM.from_pretrained(model).eval()
    batch, _ = references[-1]
    mask = batch["response_mask"].bool()
    policy, _ = trainer.actor.compute_log_prob(batch)
    torch.testing.assert_close(policy[mask], _base_log_prob(adapted, batch)[mask], rtol=1e-5, atol=1e-5)

    draw = hf.sample_next_token
    for fused in (True, False):  # the decode steps in the fused step (llama) or in the model's adapted layers
        drawn_from = []  # the logits the rollout draws each response token from, (bs, V) a step
        monkeypatch.setattr(hf, "FUSED_DECODE", fused)
        monkeypatch.setattr(hf, "sample_next_token",
                            lambda logits, *args, seen=drawn_from: draw(seen.append(logits.float().clone()) or logits,
                                                                        *args))
        rollout = trainer.actor.generate(trainer.train_dataset.collate(list(range(4))), trainer._train_params())
        responses, rollout_mask = rollout["responses"], rollout["response_mask"].bool()
        rollout_log_prob = torch.log_softmax(torch.stack(drawn_from, dim=1), dim=-1)  # (bs, R, V), temperature 1
        rollout_log_prob = rollout_log_prob.gather(-1, responses[..., None]).squeeze(-1)  # (bs, R)
        torch.testing.assert_close(rollout_log_prob[rollout_mask], _base_log_prob(adapted, rollout)[rollout_mask],
                                   rtol=1e-4, atol=1e-4, msg=lambda m, fused=fused: f"fused decode {fused}: {m}")
        assert (rollout_log_prob - _base_log_prob(base, rollout))[rollout_mask].abs().max() > 1e-2

    synced = AutoModelForCausalLM.from_pretrained(model)
    weights = dict(trainer.actor.rollout_weights())
    assert sorted(weights) == sorted(synced.state_dict())  # the base model's own names, no adapter's
    synced.load_state_dict(weights)
    torch.testing.assert_close(_base_log_prob(synced.eval(), batch)[mask], _base_log_prob(adapted, batch)[mask],
                               rtol=1e-5, atol=1e-5)


def test_the_checkpoints_merged_export_is_the_saved_adapters_policy(fitted, workspace):
    _, model = workspace
    _, _, references, _, out = fitted
    saved = out / f"global_step_{STEPS}"
    adapted = _independent_peft(model, checkpoint.load_model_state(saved, "actor"))
    exported = AutoModelForCausalLM.from_pretrained(saved / "actor" / "huggingface").eval()  # plain transformers
    batch, _ = references[-1]
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(_base_log_prob(exported, batch)[mask], _base_log_prob(adapted, batch)[mask],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("older", [False, True], ids=["checkpoint", "checkpoint_without_adapter_folder"])
def test_the_export_of_a_lora_checkpoint_holds_the_adapter_peft_loads_as_the_merged_policy(fitted, workspace,
                                                                                           tmp_path, older):
    """A fresh trainer loads the last checkpoint and exports it: lora_adapter/ inside the export, loaded by peft's
    own from_pretrained over a plain load of the base, scores as the merged model beside it and holds the
    checkpoint's adapter tensors; a checkpoint saved before the adapter folder existed exports one as well."""
    import shutil

    from peft import PeftModel

    root, model = workspace
    _, _, references, _, out = fitted
    saved = out / f"global_step_{STEPS}"
    if older:  # as checkpoints were written before they held actor/lora_adapter/
        saved = shutil.copytree(saved, tmp_path / "older" / saved.name)
        shutil.rmtree(saved / "actor" / "lora_adapter")
        manifest = json.loads((saved / "manifest.json").read_text())
        for listing in (manifest["files"], manifest["sha256"]):
            for rel in [rel for rel in listing if rel.startswith("actor/lora_adapter/")]:
                del listing[rel]
        (saved / "manifest.json").write_text(json.dumps(manifest))
    fresh = _trainer(root, model, tmp_path / "fresh", f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1",
                     "algorithm.use_kl_in_reward=true")  # the run's config: a checkpoint loads into its own
    fresh.load_checkpoint(saved)
    exported = checkpoint.export_hf(fresh, tmp_path / "export")

    merged = AutoModelForCausalLM.from_pretrained(exported).eval()  # plain transformers
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), exported / "lora_adapter").eval()
    adapter = {name: tensor for name, tensor in adapted.state_dict().items() if ".lora_" in name}
    expected = checkpoint.load_model_state(saved, "actor")
    assert sorted(adapter) == sorted(expected) and all(torch.equal(adapter[n], expected[n]) for n in expected)
    batch, _ = references[-1]
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(_base_log_prob(adapted, batch)[mask], _base_log_prob(merged, batch)[mask],
                               rtol=1e-5, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(model).eval()
    assert (_base_log_prob(merged, batch) - _base_log_prob(base, batch))[mask].abs().max() > 1e-2  # trained


def test_the_adapters_scale_by_alpha_over_rank(fitted, workspace):
    """peft's LoRA: a layer computes x W^T + (lora_alpha / r) x A^T B^T; the actor has r=4, alpha=8 (2), the
    critic r=4 and the default alpha 16 (4)."""
    from transformers import AutoModelForTokenClassification

    _, model = workspace
    trainer = fitted[0]
    plain = {"actor": AutoModelForCausalLM.from_pretrained(model),
             "critic": AutoModelForTokenClassification.from_pretrained(model, num_labels=1)}
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(0))
    for part, worker, scale in (("actor", trainer.actor, 8 / 4), ("critic", trainer.critic, 16 / 4)):
        layer = dict(worker.module.named_modules())["base_model.model.model.layers.0.self_attn.q_proj"]
        weight = plain[part].model.layers[0].self_attn.q_proj.weight
        lora_a, lora_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        assert lora_b.abs().max() > 0, part  # trained: B has left zero
        with torch.no_grad():
            torch.testing.assert_close(layer(x), x @ weight.T + scale * (x @ lora_a.T @ lora_b.T),
                                       rtol=1e-5, atol=1e-6, msg=lambda m, part=part: f"{part}: {m}")


@pytest.mark.parametrize("targets", ["all-linear", "[q_proj,v_proj]"])
def test_target_modules_adapt_the_linear_layers_verl_names(workspace, tmp_path, targets):
    """verl's default, all-linear, adapts every linear layer but the output head; a list adapts those named."""
    root, model = workspace
    trainer = _trainer(root, model, tmp_path / "out", f"actor_rollout_ref.model.target_modules={targets}")
    linear = {name for name, layer in AutoModelForCausalLM.from_pretrained(model).named_modules()
              if isinstance(layer, torch.nn.Linear)}
    expected = linear - {"lm_head"} if targets == "all-linear" else {
        name for name in linear if name.endswith((".q_proj", ".v_proj"))}
    adapted = {name.removeprefix("base_model.model.") for name, layer in trainer.actor.module.named_modules()
               if hasattr(layer, "lora_A")}
    assert adapted == expected and "lm_head" in linear


def _check_lora_run_on(device: str, workspace, tmp_path) -> None:
    """Two LoRA PPO steps on ``device``, checkpointed: the base weights are those of the model's folder, and the
    adapter folder of the last checkpoint, loaded by peft over a plain CPU load of the base, scores the rollout's
    responses as the actor on ``device`` does (and not as the base model does)."""
    from peft import PeftModel

    root, model = workspace
    trainer = _trainer(root, model, tmp_path / "out", f"trainer.device={device}", "trainer.total_training_steps=2",
                       "trainer.save_freq=1")
    _record_fit(trainer)
    plain = AutoModelForCausalLM.from_pretrained(model).eval()
    adapted = dict(trainer.actor.module.named_parameters())
    for name, weight in plain.named_parameters():
        kept = adapted[f"base_model.model.{name}".replace(".weight", ".base_layer.weight")
                       if f"base_model.model.{name}" not in adapted else f"base_model.model.{name}"]
        assert torch.equal(kept.detach().cpu(), weight.detach()), name
    batch = trainer.actor.generate(trainer.train_dataset.collate(list(range(4))), trainer._train_params())
    policy, _ = trainer.actor.compute_log_prob(batch)
    cpu_batch = batch.to("cpu")
    mask = cpu_batch["response_mask"].bool()
    base = _base_log_prob(plain, cpu_batch)[mask]  # before peft wraps ``plain`` in place
    peft_model = PeftModel.from_pretrained(plain, tmp_path / "out" / "global_step_2" / "actor" / "lora_adapter")
    ours, theirs = policy.cpu()[mask], _base_log_prob(peft_model.eval(), cpu_batch)[mask]
    torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-3)
    assert (theirs - base).abs().max() > 2e-2  # the trained adapter counts


def test_two_lora_steps_keep_the_base_and_save_the_adapter_the_actor_scores_with(workspace, tmp_path):
    _check_lora_run_on("cpu", workspace, tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_two_lora_steps_keep_the_base_and_save_the_adapter_the_actor_scores_with(workspace, tmp_path):
    _check_lora_run_on("cuda", workspace, tmp_path)


def test_the_adapters_card_names_the_base_by_its_absolute_path(workspace, tmp_path, monkeypatch):
    """A policy loaded by a relative path: the adapter's README.md (peft's card) names the base by the absolute
    path, as its adapter_config.json does, so that the card read from elsewhere still points at the base."""
    root, model = workspace
    monkeypatch.chdir(model.parent)
    trainer = _trainer(root, model.name, tmp_path / "out", "critic.model.lora_rank=0")
    folder = trainer.save_checkpoint() / "actor" / "lora_adapter"
    absolute = str(model.resolve())
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == absolute
    front_matter = (folder / "README.md").read_text().split("---")[1]
    assert f"base_model: {absolute}\n" in front_matter, front_matter
    assert base_model(trainer.actor.module).config._name_or_path == model.name  # the model's own config is left as loaded


def test_two_workers_lora_checkpoint_holds_the_trainable_tensors_alone_as_one_workers_does(
        workspace, trained, ray_cluster, tmp_path):
    """The toy model ties its output matrix to its embedding (``lm_head.weight`` is ``embed_tokens.weight``),
    frozen under LoRA: two workers' shards hold the adapters (and the value head) alone, as one worker's
    ``model_state.pt`` does, not the whole tied matrix; a checkpoint that holds it (an older version's) loads."""
    import shutil

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    from rlhf_core.workers import common

    root, model = workspace
    single = trained[0]
    tied = base_model(single.actor.module)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    one = checkpoint.save_checkpoint(single, tmp_path / "one")
    two = _trainer(root, model, tmp_path / "two", "trainer.n_gpus_per_node=2")
    try:
        two.fit_step(validate=lambda step, metrics: False)
        saved = checkpoint.save_checkpoint(two, tmp_path / "two")
    finally:
        two.close()

    def gathered(folder):  # by torch's own converter
        dcp_to_torch_save(folder / "dcp", tmp_path / "gathered.pt")
        return torch.load(tmp_path / "gathered.pt", weights_only=False)

    for part in ("actor", "critic"):
        keys = set(gathered(saved / part)["model"])
        assert keys == set(torch.load(one / part / "model_state.pt", weights_only=True)), part
        assert not [key for key in keys if "lm_head" in key or "embed_tokens" in key], part
        assert all("lora_" in key for key in keys if ".layers." in key), part

    older = tmp_path / "older" / "actor"  # the actor's shards with the tied matrix, as an older version saved them
    shutil.copytree(saved / "actor", older)
    shutil.rmtree(older / "dcp")
    state = gathered(saved / "actor")
    embedding = tied.model.embed_tokens.weight.detach().clone()
    # another matrix than the fresh trainer's own, so that a load that read it would show
    state["model"]["base_model.model.lm_head.weight"] = embedding + 1
    torch.save(state, tmp_path / "older.pt")
    torch_save_to_dcp(tmp_path / "older.pt", older / "dcp")
    fresh = _trainer(root, model, tmp_path / "fresh")
    common.load_saved(fresh.actor, older, saved=2)
    loaded = {name: p for name, p in fresh.actor.module.named_parameters() if p.requires_grad}
    assert loaded.keys() == {key for key in state["model"] if "lora_" in key}
    for name, param in loaded.items():
        assert torch.equal(param.detach(), state["model"][name]), name
    fresh_tied = base_model(fresh.actor.module)
    assert torch.equal(fresh_tied.lm_head.weight, embedding)  # the frozen matrix the model path holds, not + 1
    assert torch.equal(fresh_tied.model.embed_tokens.weight, embedding)


@pytest.mark.parametrize("critic", [False, True])
def test_applying_lora_gives_no_warning_of_peft_reading_a_deprecated_attribute(critic):
    # peft reads model.is_gradient_checkpointing, which transformers deprecates with a FutureWarning: every LoRA
    # run started with that warning about peft's code, a verl user's LoRA example with it on stderr at each start
    import warnings

    from transformers import LlamaForTokenClassification

    from rlhf_core.models.lora import apply_lora

    model = _llama(tied=False)
    if critic:
        model = LlamaForTokenClassification(model.config)
    model.activation_checkpointing_enable({"use_reentrant": False})  # as the trainer loads its models
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_lora(model, rank=2, alpha=4, target_modules="all-linear", critic=critic)
    assert [str(w.message) for w in caught if "is_gradient_checkpointing" in str(w.message)] == []
