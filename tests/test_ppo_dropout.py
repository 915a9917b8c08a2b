"""PPO's actor and critic on a backbone with dropout: ``actor_rollout_ref.model.disable_dropout`` and
``critic.model.disable_dropout``.

The rollout and the old-log-prob, reference and values passes run in eval mode (no dropout); the updates in
train mode. Where dropout is off, the first mini-batch of an update is on-policy with the same weights and the
same forward as those passes (the same rows, micro-batches and padding): its log-probs are the old ones bit for
bit, so the ratio is exactly 1 (``actor/ppo_kl`` = mean(old - new) = 0, nothing clipped, a KL loss of 0 to the
reference, which is the same weights), and the critic's first predictions are the values exactly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PhimoeConfig,
    PhimoeForCausalLM,
)

from rlhf_core.config import load_config
from rlhf_core.main_ppo import build_trainer
from rlhf_core.models.loading import config_with, disable_dropout
from rlhf_core.workers import critic as critic_module
from rlhf_core.workers.common import dropout_off

#: the toy Llama's attention dropout (a float its attention passes to sdpa in train mode)
RATE = 0.5
FIRST_CHARACTER_REWARD = (  # scores that differ between responses, so advantages and value targets are not 0
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return (ord(solution_str[0]) % 5) / 4 if solution_str else 0.0\n"
)


@pytest.fixture(scope="module")
def dropout_model(workspace):
    """The tiny toy model with attention dropout 0.5 in its config."""
    model = workspace.root / "dropout_model"
    if not model.exists():
        shutil.copytree(workspace.model, model)
        config = json.loads((model / "config.json").read_text())
        assert config["attention_dropout"] == 0.0
        (model / "config.json").write_text(json.dumps({**config, "attention_dropout": RATE}))
    return model


def _trainer(workspace, model, tmp_path, disable: bool, *extra):
    reward = tmp_path / "reward_first_character.py"
    reward.write_text(FIRST_CHARACTER_REWARD)
    # 8 prompts x 2 samples in two mini-batches of 8 rows, one micro-batch each, as the log-prob and values passes
    # take them: the first mini-batch's forward is theirs, row for row
    flag = str(disable).lower()
    return build_trainer(load_config(workspace.overrides(
        tmp_path / "out", f"custom_reward_function.path={reward}", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=true", "trainer.seed=3",
        # the random model's next-token distributions are near uniform, so dropout moves its log-probs by about
        # 1e-3: a clip range below that lets the clip show the noise
        "actor_rollout_ref.actor.clip_ratio=1e-4",
        f"actor_rollout_ref.model.disable_dropout={flag}", f"critic.model.disable_dropout={flag}", *extra,
        model=model)))


def _first_mini_batches(trainer, monkeypatch) -> dict:
    """Records the actor's first mini-batch metrics (``seen["actor"]``) and the critic's first predictions with
    the rollout-time values of their rows (``seen["critic"]``)."""
    seen = {}
    policy_loss = trainer.actor.policy_loss

    def recording_loss(mb, *args):
        loss, summed, constant = policy_loss(mb, *args)
        seen.setdefault("actor", summed)  # one micro-batch a mini-batch: the mini-batch's metrics
        return loss, summed, constant

    trainer.actor.policy_loss = recording_loss
    response_values = critic_module.response_values

    def recording_values(model, batch, *args):
        values = response_values(model, batch, *args)
        if torch.is_grad_enabled():  # the update's forward, not the values pass
            seen.setdefault("critic", (values.detach().clone(), batch["values"].clone()))
        return values

    monkeypatch.setattr(critic_module, "response_values", recording_values)
    return seen


def _one_step(trainer, monkeypatch) -> dict:
    with torch.no_grad():  # a value head that is not zero (a new one starts at 0), so dropout would show
        trainer.critic.forward_module.score.weight.normal_(generator=torch.Generator().manual_seed(0))
    seen = _first_mini_batches(trainer, monkeypatch)
    trainer.train_step(trainer.train_dataset.collate(list(range(8))))
    return seen


def test_without_dropout_the_first_mini_batch_is_exactly_on_policy(workspace, dropout_model, tmp_path, monkeypatch):
    trainer = _trainer(workspace, dropout_model, tmp_path, disable=True)
    seen = _one_step(trainer, monkeypatch)
    first = seen["actor"]
    assert first["actor/ppo_kl"] == 0.0 and first["actor/pg_clipfrac"] == 0.0 and first["actor/kl_loss"] == 0.0
    predicted, values = seen["critic"]
    assert values.abs().sum() > 0  # the head is not zero, so the equality below means something
    assert torch.equal(predicted, values)
    # the export keeps the base's dropout rate; the run's model keeps its own off
    trainer.actor.save_hf(tmp_path / "export")
    assert json.loads((tmp_path / "export" / "config.json").read_text())["attention_dropout"] == RATE
    for model in (trainer.actor.forward_module, trainer.actor.ref_module, trainer.critic.forward_module):
        assert model.config.attention_dropout == 0.0


def test_with_dropout_the_first_mini_batch_is_not(workspace, dropout_model, tmp_path, monkeypatch, capsys):
    trainer = _trainer(workspace, dropout_model, tmp_path, disable=False)
    err = capsys.readouterr().err
    for key in ("actor_rollout_ref.model", "critic.model"):
        assert err.count(f"notice: {key} has dropout (its config's rates: attention_dropout=0.5)") == 1, err
        assert f"{key}.disable_dropout=true turns it off" in err
    seen = _one_step(trainer, monkeypatch)
    first = seen["actor"]
    assert first["actor/ppo_kl"] != 0 and first["actor/pg_clipfrac"] > 0 and first["actor/kl_loss"] > 0
    predicted, values = seen["critic"]
    assert (predicted - values).abs().max() > 1e-3
    # the export is the model as loaded
    trainer.actor.save_hf(tmp_path / "export")
    assert json.loads((tmp_path / "export" / "config.json").read_text())["attention_dropout"] == RATE


def test_no_notice_where_dropout_is_off_or_the_model_has_none(workspace, dropout_model, tmp_path, capsys):
    _trainer(workspace, dropout_model, tmp_path, disable=True)
    _trainer(workspace, workspace.model, tmp_path, disable=False)
    assert "has dropout" not in capsys.readouterr().err


#: a tiny mixture-of-experts decoder (Mixtral's and PhiMoE's configs take the same keys)
MOE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
           vocab_size=100, num_local_experts=4, num_experts_per_tok=2, attention_dropout=0.0)


def _logits(model, ids: torch.Tensor, train: bool) -> torch.Tensor:
    model.train(train)
    with torch.no_grad():
        return model(ids).logits


def test_disable_dropout_turns_a_routers_jitter_off():
    """Mixtral's router_jitter_noise multiplies each MoE block's input by uniform noise in train mode: off with
    the dropout, returned with the rates (the export gets it back), and train mode then gives eval mode's
    logits exactly."""
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**MOE, router_jitter_noise=0.01))
    ids = torch.randint(0, 100, (2, 12))
    plain = _logits(model, ids, train=False)
    assert not torch.equal(_logits(model, ids, train=True), plain)  # the jitter draws in train mode
    rates = disable_dropout(model)
    assert rates == {"attention_dropout": 0.0, "router_jitter_noise": 0.01}
    assert model.config.router_jitter_noise == 0.0
    assert torch.equal(_logits(model, ids, train=True), plain)
    assert config_with(model.config, rates).router_jitter_noise == 0.01


def test_disable_dropout_keeps_phimoes_expert_mask_threshold():
    """PhiMoE's input_jitter_noise is train-mode noise (off); its router_jitter_noise is the threshold of the
    routers' expert mask, read in eval mode too: kept, so the model's eval-mode logits do not change."""
    torch.manual_seed(0)
    model = PhimoeForCausalLM(PhimoeConfig(**MOE, router_jitter_noise=0.5, input_jitter_noise=0.01))
    ids = torch.randint(0, 100, (2, 12))
    plain = _logits(model, ids, train=False)
    assert disable_dropout(model) == {"attention_dropout": 0.0, "input_jitter_noise": 0.01}
    assert model.config.router_jitter_noise == 0.5 and model.config.input_jitter_noise == 0.0
    assert {router.router_jitter_noise for router in model.modules() if hasattr(router, "router_jitter_noise")} \
        == {0.5}
    assert torch.equal(_logits(model, ids, train=False), plain)


KEY = "actor_rollout_ref.model.disable_dropout"


def _neox(attention_dropout: float) -> torch.nn.Module:
    """A Pythia-style causal LM: classifier_dropout 0.1 (GPT-NeoX's default, read by its classification heads)."""
    return GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=64, vocab_size=100, hidden_dropout=0.0,
                                            attention_dropout=attention_dropout, classifier_dropout=0.1)).eval()


def _gpt2(attn_pdrop: float) -> torch.nn.Module:
    """A GPT-2 causal LM: summary_first_dropout 0.1 (GPT-2's default, read by its double-heads model's summary)."""
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=attn_pdrop, summary_first_dropout=0.1,
                                      bos_token_id=0, eos_token_id=0)).eval()


@pytest.mark.parametrize("build", [_neox, _gpt2])
def test_the_notice_names_dropout_the_model_runs_not_a_heads_rate(build, capsys):
    """A rate only a head the causal LM lacks reads draws nothing in its updates: no notice; the same model
    with attention dropout gets one. The run's generators are not drawn from by the trial forward."""
    torch.manual_seed(0)
    without, with_dropout = build(0.0), build(0.5)
    state = torch.get_rng_state()
    assert dropout_off(without, False, KEY) == {}
    assert "notice" not in capsys.readouterr().err
    assert dropout_off(with_dropout, False, KEY) == {}
    err = capsys.readouterr().err
    assert err.count("notice: actor_rollout_ref.model has dropout (") == 1, err
    assert f"{KEY}=true turns it off" in err
    if build is _neox:  # the config's rates, as the config has them: the head's is named as the config's
        assert err == ("notice: actor_rollout_ref.model has dropout (its config's rates: attention_dropout=0.5, "
                       "classifier_dropout=0.1): its updates run with it, its rollout-time passes (generation, "
                       f"log-probs, values) without; {KEY}=true turns it off for the run\n")
    assert torch.equal(torch.get_rng_state(), state)


def test_noise_the_key_cannot_turn_off_is_said(capsys):
    """PhiMoE's routers sample their experts in train mode, which no rate sets: with the key true its train-mode
    forward still differs from eval mode (where two experts' scores are within the mask's threshold, 0.5 here,
    of each other), and the notice says so; Mixtral's jitter, which the key turns off, leaves none."""
    torch.manual_seed(0)
    dropout_off(PhimoeForCausalLM(PhimoeConfig(**MOE, router_jitter_noise=0.5)).eval(), True, KEY)
    assert f"notice: {KEY}=true leaves actor_rollout_ref.model's train-mode forward unlike its eval-mode one" \
        in capsys.readouterr().err
    dropout_off(MixtralForCausalLM(MixtralConfig(**MOE, router_jitter_noise=0.01)).eval(), True, KEY)
    assert "notice" not in capsys.readouterr().err


def test_an_output_without_hidden_states_has_its_logits_compared():
    """Remote code may ignore output_hidden_states and return logits alone: the logits are compared (attention
    dropout 0.5 draws in train mode, none does not); an output with neither gives None (the config decides)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from rlhf_core.models.loading import train_mode_differs

    torch.manual_seed(0)
    for attention_dropout, expected in ((0.0, False), (0.5, True)):
        model = _neox(attention_dropout)
        full = model.forward
        model.forward = lambda output_hidden_states=False, _full=full, **kw: CausalLMOutputWithPast(
            logits=_full(**kw).logits)
        assert train_mode_differs(model) is expected
    model.forward = lambda **kw: CausalLMOutputWithPast()
    assert train_mode_differs(model) is None


def test_weights_that_give_nan_are_not_said_to_draw_noise_in_train_mode(capsys):
    """NaN never equals itself: a model whose weights give NaN was said to differ between its modes, and the notice
    sent its user after dropout or a router before the run's own message about NaN weights."""
    from rlhf_core.models.loading import train_mode_differs

    torch.manual_seed(0)
    model = _neox(0.0)
    model.config.classifier_dropout = 0.0  # no rate in its config: nothing to say of dropout
    assert train_mode_differs(model) is False
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    assert train_mode_differs(model) is None
    assert dropout_off(model, False, KEY) == {}
    assert capsys.readouterr().err == ""


def test_noise_no_rate_names_is_not_promised_off_by_the_key(capsys):
    """PhiMoE without dropout or input jitter, the key false: its routers still sample in train mode, which the
    key cannot turn off, and the notice says so rather than promising that the key turns it off."""
    torch.manual_seed(0)
    model = PhimoeForCausalLM(PhimoeConfig(**MOE, router_jitter_noise=0.5, input_jitter_noise=0.0)).eval()
    assert dropout_off(model, False, KEY) == {}
    err = capsys.readouterr().err
    assert err == ("notice: actor_rollout_ref.model's train-mode forward differs from its eval-mode one though its "
                   "config names no dropout: something besides dropout draws in train mode (a mixture-of-experts "
                   "router that samples its experts, as PhiMoE's), so its updates differ from its rollout-time "
                   f"passes; {KEY}=true cannot turn that off\n")
    assert model.config.router_jitter_noise == 0.5 and not model.training  # the model itself is left as it was


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_train_mode_differs_on_cuda(dtype):
    """The notice's check runs on the device the model loads to: on CUDA, in fp32 and bf16, a model without
    dropout gives the same forward in both modes (False) and one with attention dropout 0.5 does not (True)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_core.models.loading import train_mode_differs

    torch.manual_seed(0)
    for attention_dropout, expected in ((0.0, False), (0.5, True)):
        config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                             vocab_size=100, attention_dropout=attention_dropout)
        model = LlamaForCausalLM(config).to("cuda", dtype).eval()
        state = torch.cuda.get_rng_state()
        assert train_mode_differs(model) is expected, (dtype, attention_dropout)
        assert torch.equal(torch.cuda.get_rng_state(), state)  # the run's CUDA generator is not drawn from
        assert not model.training
