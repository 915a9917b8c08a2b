"""``use_remove_padding``: sequences packed into one row without pad tokens give the padded path's
log-probs, entropies, values and gradients.

On CPU the workers load their models with :mod:`rlhf_core.models.packed_attention`, which runs attention one
sequence per row and every other operation on the real tokens only; transformers' own sdpa keeps packed
sequences apart with a (tokens x tokens) block-diagonal mask built from the position ids, and both are checked
here against each row run whole; with flash attention (``gpu``) the variable-length kernels run the same rows.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from test_shared_prefix import assert_same_gradients, whole_row_outputs
from transformers import AutoModelForCausalLM

from rlhf_core.config import load_config
from rlhf_core.models import packed_attention
from rlhf_core.models.loading import load_critic, load_tokenizer
from rlhf_core.models.toy import random_toy_model
from rlhf_core.workers.actor import ActorWorker, response_log_prob
from rlhf_core.workers.common import packed_inputs, resolve_remove_padding
from rlhf_core.workers.critic import CriticWorker, response_values


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


@pytest.mark.parametrize("fused_head", [False, True])
@pytest.mark.parametrize("attention", ["sdpa", packed_attention.NAME])
def test_packed_log_probs_entropies_and_gradients_match_each_row_whole(model_dir, attention, fused_head):
    batch = padded_batch(n_rows=7, prompt_len=9, response_len=6, seed=4)
    mask = batch["response_mask"]
    whole = AutoModelForCausalLM.from_pretrained(model_dir).train()  # the reference: transformers' sdpa, rows padded
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(5))
    log_softmax = torch.log_softmax(whole_row_outputs(whole, batch) / 0.7, -1)
    expected_lp = log_softmax.gather(-1, batch["responses"][..., None])[..., 0] * mask
    expected_entropy = -(log_softmax.exp() * log_softmax).sum(-1) * mask
    ((expected_lp + 0.1 * expected_entropy) * weights).sum().backward()
    expected_grads = {name: p.grad for name, p in whole.named_parameters()}

    packed = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attention).train()
    log_prob, entropy = response_log_prob(packed, batch, temperature=0.7, with_entropy=True, remove_padding=True,
                                          fused_head=fused_head)
    ((log_prob + 0.1 * entropy) * weights).sum().backward()
    torch.testing.assert_close(log_prob, expected_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy.detach(), rtol=1e-5, atol=1e-5)
    assert (log_prob[mask == 0] == 0).all() and (entropy[mask == 0] == 0).all()
    assert_same_gradients(packed, expected_grads)


def test_packed_values_and_their_gradients_match_each_row_whole(model_dir):
    batch = padded_batch(n_rows=7, prompt_len=9, response_len=6, seed=6)
    mask = batch["response_mask"]
    whole = load_critic(model_dir).train()
    with torch.no_grad():
        torch.nn.init.normal_(whole.score.weight, std=0.5)  # a value head that is not all zeros
    packed = load_critic(model_dir, attn_implementation=packed_attention.NAME).train()
    packed.load_state_dict(whole.state_dict())
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(7))
    expected = whole_row_outputs(whole, batch)[..., 0] * mask
    (expected * weights).sum().backward()
    values = response_values(packed, batch, remove_padding=True)
    (values * weights).sum().backward()
    torch.testing.assert_close(values, expected.detach(), rtol=1e-5, atol=1e-5)
    assert values[mask.bool()].abs().min() > 0
    assert_same_gradients(packed, {name: p.grad for name, p in whole.named_parameters()})


def test_packed_attention_runs_each_sequence_causally_in_its_own_row_without_a_mask(model_dir, monkeypatch):
    batch = padded_batch()
    lengths = batch["attention_mask"].sum(-1)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        calls.append((tuple(query.shape), tuple(key.shape), attn_mask, kwargs.get("is_causal")))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(packed_attention.F, "scaled_dot_product_attention", spy)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=packed_attention.NAME).eval()
    config = model.config
    given = []  # the mask the model hands its layers: none (transformers built the packed row's T x T one)
    model.model.layers[0].register_forward_pre_hook(
        lambda layer, args, kwargs: given.append(kwargs.get("attention_mask")), with_kwargs=True)
    with torch.no_grad():
        model(**packed_inputs(batch)[0], use_cache=False)
    rows = (len(batch), config.num_attention_heads, int(lengths.max()), config.hidden_size // config.num_attention_heads)
    assert len(calls) == config.num_hidden_layers
    assert all(q == rows and k[2] == rows[2] and mask is None and causal for q, k, mask, causal in calls)
    assert given == [None]


def test_unpacked_calls_go_through_transformers_sdpa_unchanged(model_dir):
    """The rollout decodes left-padded prompts against a KV cache with the same model: same logits, same tokens."""
    sdpa = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    packed = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=packed_attention.NAME).eval()
    batch = padded_batch()
    prompt_len = batch["prompts"].shape[1]
    inputs = {"input_ids": batch["prompts"], "attention_mask": batch["attention_mask"][:, :prompt_len]}
    with torch.no_grad():
        torch.testing.assert_close(packed(**inputs).logits, sdpa(**inputs).logits, rtol=0, atol=0)
        expected = sdpa.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)
        got = packed.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)


def test_a_sliding_window_shorter_than_a_sequence_is_refused(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    attention = model.model.layers[0].self_attn
    query = key = value = torch.randn(1, 2, 12, 8)
    positions = torch.cat([torch.arange(7), torch.arange(5)])[None]
    out, _ = packed_attention.packed_sdpa_forward(attention, query, key, value, None, position_ids=positions,
                                                  sliding_window=7)
    assert out.shape == (1, 12, 2, 8)
    with pytest.raises(NotImplementedError, match=r"sliding attention window \(6 positions\) shorter than a "
                                                  r"sequence \(7\): set use_remove_padding=false"):
        packed_attention.packed_sdpa_forward(attention, query, key, value, None, position_ids=positions,
                                             sliding_window=6)


def _two_sequences(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Query, key and value (1, 2 heads, 12 tokens, dim 8) of a packed row of sequences of 7 and 5 tokens, and
    its position ids."""
    g = torch.Generator().manual_seed(seed)
    query, key, value = (torch.randn(1, 2, 12, 8, generator=g) for _ in range(3))
    return query, key, value, torch.cat([torch.arange(7), torch.arange(5)])[None]


def _causal_attention_by_hand(query, key, value, lengths: list[int], scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v in float64 over each sequence alone, a token seeing itself and those before it;
    (1, tokens, heads, dim) as attention functions return it."""
    outputs, start = [], 0
    for n in lengths:
        q, k, v = (t[0, :, start:start + n].double() for t in (query, key, value))  # (heads, n, dim)
        scores = (q @ k.transpose(1, 2)) * scale  # (heads, n, n)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outputs.append((scores.softmax(-1) @ v).transpose(0, 1))  # (n, heads, dim)
        start += n
    return torch.cat(outputs)[None]


def test_packed_attention_scales_the_scores_by_the_models_scaling(model_dir):
    """Every toy model uses head_dim^-0.5, sdpa's own default: another scaling must reach the product."""
    attention = AutoModelForCausalLM.from_pretrained(model_dir).model.layers[0].self_attn.eval()
    query, key, value, positions = _two_sequences()
    out, _ = packed_attention.packed_sdpa_forward(attention, query, key, value, None, scaling=0.25,
                                                  position_ids=positions)
    torch.testing.assert_close(out.double(), _causal_attention_by_hand(query, key, value, [7, 5], 0.25),
                               rtol=1e-5, atol=1e-5)


def test_packed_attention_drops_out_in_train_mode_only(model_dir):
    attention = AutoModelForCausalLM.from_pretrained(model_dir).model.layers[0].self_attn
    query, key, value, positions = _two_sequences(seed=1)
    without_dropout = _causal_attention_by_hand(query, key, value, [7, 5], 8 ** -0.5)
    torch.manual_seed(0)  # the draw of the dropout mask
    for training in (True, False):
        out, _ = packed_attention.packed_sdpa_forward(attention.train(training), query, key, value, None,
                                                      dropout=0.5, scaling=8 ** -0.5, position_ids=positions)
        if training:  # half the attention weights zeroed, the rest doubled
            assert (out.double() - without_dropout).abs().max() > 0.1
        else:
            torch.testing.assert_close(out.double(), without_dropout, rtol=1e-5, atol=1e-5)


def test_the_workers_pack_on_the_cpu_without_a_notice(model_dir, capsys):
    cfg = load_config([f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.use_remove_padding=true",
                       "actor_rollout_ref.model.use_fused_kernels=true", "critic.model.use_remove_padding=true",
                       "trainer.device=cpu", "trainer.n_gpus_per_node=1"])
    actor = ActorWorker(cfg.resolved().actor_rollout_ref, load_tokenizer(model_dir), total_steps=1, need_ref=True)
    critic = CriticWorker(cfg.resolved().critic, "float32", total_steps=1)
    assert "notice:" not in capsys.readouterr().err
    assert actor.remove_padding and critic.remove_padding and actor.fused_head  # packing keeps the chunked head
    for model in (actor.forward_module, actor.ref_module, critic.forward_module):
        assert model.config._attn_implementation == packed_attention.NAME


def test_an_attention_that_cannot_pack_gives_a_notice_and_the_padded_path(model_dir, capsys):
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # transformers' sdpa, as a model loaded by hand has it
    assert resolve_remove_padding(True, model, "actor_rollout_ref.model.use_remove_padding") is False
    err = capsys.readouterr().err
    assert ("notice: actor_rollout_ref.model.use_remove_padding=true needs flash_attention_2 or sdpa_packed "
            "attention") in err
    assert "attention here is sdpa, so sequences run padded" in err


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


def test_attention_for_packs_with_flash_attention_where_installed_and_packed_sdpa_elsewhere(monkeypatch):
    from rlhf_core.models import loading

    installed = {"flash_attn": True}
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: object() if installed.get(name) else None)
    assert loading.attention_for(True, "cuda") == "flash_attention_2"
    assert loading.attention_for(True, "cpu") == packed_attention.NAME
    assert loading.attention_for(False, "cuda") is None
    installed["flash_attn"] = False
    assert loading.attention_for(True, "cuda") == packed_attention.NAME  # the padded path was all CUDA had here
    assert loading.attention_for(True, "meta") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_packed_sdpa_rows_match_whole_rows(model_dir, dtype):
    """Without flash-attn, CUDA packs with packed_attention: log-probs and gradients are each row's run whole."""
    batch = padded_batch().to("cuda")
    mask = batch["response_mask"].bool()
    packed_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                        attn_implementation=packed_attention.NAME).cuda().eval()
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    packed, _ = response_log_prob(packed_model, batch, 1.0, False, remove_padding=True)
    whole = torch.zeros(packed.shape, device="cuda")
    for row in range(len(batch)):  # each sequence alone: no padding, no mask
        one = batch.select([row])
        valid = one["attention_mask"][0].bool()
        prompt_len = int(one["prompts"].shape[1])
        ids = one["input_ids"][:, valid]
        logits = plain(input_ids=ids).logits.float()
        n_prompt = int(valid[:prompt_len].sum())
        n_response = int(one["response_mask"][0].sum())
        predicted = torch.log_softmax(logits[0, n_prompt - 1:n_prompt - 1 + n_response], -1)
        taken = predicted.gather(-1, ids[0, n_prompt:n_prompt + n_response, None]).squeeze(-1)
        taken.sum().backward()  # the reference gradient: the sum of every row's log-probs, row by row
        whole[row, :n_response] = taken.detach()
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(packed.float()[mask], whole[mask], rtol=0, atol=tolerance)
    packed[mask].sum().backward()
    # each parameter's gradient against the reference's, relative to its size (bfloat16 rounds each product)
    for (name, got), expected in zip(packed_model.named_parameters(), plain.parameters()):
        error = float((got.grad.float() - expected.grad.float()).norm() / expected.grad.float().norm())
        assert error < (1e-4 if dtype == torch.float32 else 5e-2), (name, error)


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


@pytest.mark.parametrize("remove_padding", [False, True])
def test_the_entropy_bonus_puts_the_gradient_of_the_entropy_into_the_policy_loss(model_dir, remove_padding):
    """With advantages of 0 the clipped surrogate has no gradient, so the policy loss's gradient is the entropy
    bonus's alone: that of -entropy_coeff x the token mean of the entropy of softmax(logits / temperature) at the
    positions that predict response tokens, worked out here in float64 from the rows run whole."""
    cfg = load_config([f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cpu", "trainer.n_gpus_per_node=1",
                       "actor_rollout_ref.model.enable_gradient_checkpointing=false",
                       f"actor_rollout_ref.model.use_remove_padding={str(remove_padding).lower()}",
                       "actor_rollout_ref.actor.entropy_coeff=0.1", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
                       "actor_rollout_ref.rollout.temperature=0.7"])
    actor = ActorWorker(cfg.resolved().actor_rollout_ref, load_tokenizer(model_dir), total_steps=1, need_ref=False)
    assert actor.remove_padding == remove_padding
    batch = padded_batch(n_rows=4, seed=3)
    mask = batch["response_mask"].double()
    tokens = int(mask.sum())
    reference = copy.deepcopy(actor.module).double()
    log_softmax = torch.log_softmax(whole_row_outputs(reference, batch) / 0.7, -1)  # (bs, R, V)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)  # (bs, R)
    (-0.1 * (entropy * mask).sum() / tokens).backward()
    expected = {name: p.grad.float() for name, p in reference.named_parameters()}

    batch["advantages"] = torch.zeros(mask.shape)
    batch["old_log_prob"] = (log_softmax.gather(-1, batch["responses"][..., None])[..., 0] * mask).detach().float()
    loss, _, _ = actor.policy_loss(batch, tokens, len(batch), kl_loss_coef=0.0)
    loss.backward()
    assert min(float(g.norm()) for g in expected.values()) > 1e-6  # every weight feels the entropy
    for name, p in actor.module.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-4 * float(expected[name].abs().max()),
                                   msg=name)
