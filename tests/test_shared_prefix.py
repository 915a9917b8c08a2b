"""``use_shared_prefix``: each distinct prompt of a micro-batch runs once and its responses attend to its KV
cache. Checked against the plain forward of every whole row (log-softmax of the full logits, the value
head on every position, a reward model's score of each sequence), values and gradients, and for running
each prompt once."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf_core.batch import Batch
from rlhf_core.config import load_config
from rlhf_core.models.loading import load_critic, load_tokenizer
from rlhf_core.models.toy import random_toy_model
from rlhf_core.rewards.reward_model import RewardModelWorker
from rlhf_core.workers.actor import ActorWorker, response_log_prob
from rlhf_core.workers.common import SharedPrefix, micro_batch_rows, prompt_groups
from rlhf_core.workers.critic import CriticWorker, response_values


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_toy_model(tmp_path_factory.mktemp("shared") / "model", n_layers=2, hidden_size=32,
                            max_position_embeddings=512, seed=0)


def grouped_batch(n_prompts: int = 3, n: int = 4, prompt_len: int = 9, response_len: int = 6, seed: int = 0) -> Batch:
    """``n`` responses of varied lengths to each of ``n_prompts`` left-padded prompts of varied lengths,
    rows shuffled, laid out as the rollout lays them out."""
    g = torch.Generator().manual_seed(seed)
    rows = n_prompts * n
    prompt_valid = torch.tensor([prompt_len, 2, 5][:n_prompts]).repeat_interleave(n)
    prompt_mask = (torch.arange(prompt_len) >= prompt_len - prompt_valid[:, None]).long()
    prompts = torch.randint(4, 90, (n_prompts, prompt_len), generator=g).repeat_interleave(n, 0) * prompt_mask
    response_valid = torch.randint(1, response_len, (rows,), generator=g)
    response_valid[0] = response_len - 1  # the longest leaves the last column empty in every row: it is cut
    response_mask = (torch.arange(response_len) < response_valid[:, None]).long()
    responses = torch.randint(4, 90, (rows, response_len), generator=g) * response_mask
    order = torch.randperm(rows, generator=g)
    prompts, prompt_mask, responses, response_mask = (t[order] for t in (prompts, prompt_mask, responses,
                                                                        response_mask))
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return Batch({"prompts": prompts, "responses": responses, "response_mask": response_mask,
                  "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
                  "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0)})


def whole_row_outputs(model, batch: Batch) -> torch.Tensor:
    """The model's output (logits or values) at the positions before each response token, from one
    forward of every whole row: the reference the shared path must reproduce."""
    prompt_len, response_len = batch["prompts"].shape[1], batch["responses"].shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], use_cache=False).logits
    return out[:, prompt_len - 1:prompt_len - 1 + response_len]


def assert_same_gradients(model, expected: dict[str, torch.Tensor]) -> None:
    """Each parameter's gradient equals the expected one up to fp32 rounding, relative to its own size
    (sums of up to thousands of terms differ in their last bits when added in another order)."""
    for name, p in model.named_parameters():
        error = float((p.grad - expected[name]).norm() / expected[name].norm())
        assert error < 1e-5, (name, error)


def test_prompt_groups_find_the_rows_of_each_prompt():
    batch = grouped_batch()
    first, inverse = prompt_groups(batch)
    assert len(first) == 3
    assert torch.equal(batch["prompts"][first][inverse], batch["prompts"])
    assert torch.bincount(inverse).tolist() == [4, 4, 4]


@pytest.mark.parametrize("fused_head", [False, True])
def test_log_probs_entropies_and_gradients_match_the_whole_rows(model_dir, fused_head):
    batch = grouped_batch()
    mask = batch["response_mask"]
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))

    logits = whole_row_outputs(model, batch) / 0.7
    log_softmax = torch.log_softmax(logits, -1)
    expected_lp = log_softmax.gather(-1, batch["responses"][..., None])[..., 0] * mask
    expected_entropy = -(log_softmax.exp() * log_softmax).sum(-1) * mask
    ((expected_lp + 0.1 * expected_entropy) * weights).sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    log_prob, entropy = response_log_prob(model, batch, temperature=0.7, with_entropy=True, fused_head=fused_head,
                                          shared_prefix=True)
    ((log_prob + 0.1 * entropy) * weights).sum().backward()
    torch.testing.assert_close(log_prob, expected_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy.detach(), rtol=1e-5, atol=1e-5)
    assert (log_prob[mask == 0] == 0).all()
    assert_same_gradients(model, expected_grads)
    assert expected_grads["model.embed_tokens.weight"].abs().sum() > 0


def test_values_and_their_gradients_match_the_whole_rows(model_dir):
    batch = grouped_batch(seed=2)
    mask = batch["response_mask"]
    critic = load_critic(model_dir).train()
    with torch.no_grad():
        torch.nn.init.normal_(critic.score.weight, std=0.5)  # a value head that is not all zeros
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3))
    expected = whole_row_outputs(critic, batch)[..., 0] * mask
    (expected * weights).sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in critic.named_parameters()}
    critic.zero_grad()

    values = response_values(critic, batch, shared_prefix=True)
    (values * weights).sum().backward()
    torch.testing.assert_close(values, expected.detach(), rtol=1e-5, atol=1e-5)
    assert values[mask.bool()].abs().min() > 0
    assert_same_gradients(critic, expected_grads)


def test_each_prompt_runs_once(model_dir):
    batch = grouped_batch()
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    shapes = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape)))
    with torch.no_grad():
        response_log_prob(model, batch, temperature=1.0, with_entropy=False, shared_prefix=True)
    # 3 distinct prompts of up to 9 tokens, then 12 rows of the 5 response columns that predict (6 less the
    # last, which no row fills, less the one the prompt's last position predicts)
    assert shapes == [(3, 9), (12, 4)]


@pytest.mark.parametrize("path", [{"shared_prefix": True, "fused_head": True}, {"shared_prefix": True},
                                  {"fused_head": True}, {"remove_padding": True, "fused_head": True},
                                  {"remove_padding": True}])
def test_the_lm_head_runs_on_the_response_tokens_only(model_dir, monkeypatch, path):
    """Not on the prompts, nor on the padding after a shorter response (the padded path without a plain head
    excepted: it asks the model for whole columns of logits)."""
    from rlhf_core.workers import actor as actor_module

    batch = grouped_batch()
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = []
    chunked = actor_module.chunked_head_log_prob
    monkeypatch.setattr(actor_module, "chunked_head_log_prob",
                        lambda hidden, *args, **kwargs: rows.append(hidden.shape[:2]) or chunked(hidden, *args, **kwargs))
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: rows.append(args[0].shape[:2]))
    with torch.no_grad():
        response_log_prob(model, batch, temperature=1.0, with_entropy=True, **path)
    assert rows == [(1, int(batch["response_mask"].sum()))]


def test_micro_batches_keep_the_rows_of_a_prompt_together():
    batch = grouped_batch()
    groups = micro_batch_rows(batch, 4, False, 0, by_prompt=True)
    inverse = prompt_groups(batch)[1]
    assert sorted(row for rows in groups for row in rows) == list(range(12))
    assert [len({int(inverse[row]) for row in rows}) for rows in groups] == [1, 1, 1]
    prompt_lengths = [int(batch["attention_mask"][rows[0], :9].sum()) for rows in groups]
    assert prompt_lengths == [2, 5, 9]  # shortest prompts first


def test_dynamic_micro_batches_count_a_shared_prompt_once():
    batch = grouped_batch()  # prompts of 2, 5 and 9 tokens, 4 responses of 1-5 tokens each
    prompt_lengths = batch["attention_mask"][:, :9].sum(-1)
    response_lengths = batch["response_mask"].sum(-1)
    inverse = prompt_groups(batch)[1]
    # what each prompt's forward computes when it shares: the prompt once, then its responses
    shared = {int(g): int(prompt_lengths[inverse == g][0] + response_lengths[inverse == g].sum()) for g in range(3)}
    budget = max(shared.values())
    whole = {int(g): int((prompt_lengths + response_lengths)[inverse == g].sum()) for g in range(3)}
    assert max(whole.values()) > budget  # counted row by row, the largest prompt's rows would not fit
    groups = micro_batch_rows(batch, None, True, budget, by_prompt=True)
    in_batches = [sum(any(int(inverse[r]) == g for r in rows) for rows in groups) for g in range(3)]
    assert in_batches == [1, 1, 1]  # every prompt in one micro-batch
    for rows in groups:  # and each micro-batch's forward within the budget
        computed = sum(shared[g] for g in {int(inverse[r]) for r in rows})
        assert computed <= budget


def test_with_gradient_checkpointing_only_the_passes_without_gradients_share(model_dir, capsys):
    """Gradient checkpointing turns the KV cache off where gradients are taken: the log-prob and value passes
    still run each prompt once (and give the whole rows' values), the updates run every row whole."""
    overrides = [f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.enable_gradient_checkpointing=true",
                 "critic.model.enable_gradient_checkpointing=true", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
                 "critic.ppo_micro_batch_size_per_gpu=16"]
    on = ["actor_rollout_ref.model.use_shared_prefix=true", "critic.model.use_shared_prefix=true"]
    batch = grouped_batch(seed=6)
    workers = {}
    for shared in (False, True):
        cfg = load_config(overrides + (on if shared else []))
        critic = CriticWorker(cfg.resolved().critic, "float32", total_steps=1)
        with torch.no_grad():  # the same value head in both, not all zeros (as it starts)
            critic.forward_module.score.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(7))
        workers[shared] = (ActorWorker(cfg.resolved().actor_rollout_ref, load_tokenizer(model_dir), total_steps=1,
                                       need_ref=False),
                           critic)
    actor, critic = workers[True]
    assert actor.shared_prefix == critic.shared_prefix == SharedPrefix(scoring=True, update=False)
    err = capsys.readouterr().err
    for key in ("actor_rollout_ref", "critic"):
        assert (f"{key}.model.use_shared_prefix=true runs in the passes without gradients only: gradient "
                "checkpointing is on") in err
    assert actor.module.is_activation_checkpointing  # (the passes without gradients checkpoint nothing: cache kept)

    shapes = []
    for module in (actor.forward_module, critic.forward_module):
        module.get_input_embeddings().register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    log_prob, entropy = actor.compute_log_prob(batch)
    values = critic.compute_values(batch)
    assert shapes == [(3, 9), (12, 4), (3, 9), (12, 4)]  # each prompt once, then the responses
    expected_log_prob, expected_entropy = workers[False][0].compute_log_prob(batch)
    torch.testing.assert_close(log_prob, expected_log_prob, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, workers[False][1].compute_values(batch), rtol=1e-5, atol=1e-5)
    assert values[batch["response_mask"].bool()].abs().min() > 0

    shapes.clear()  # the update's forward (in training mode, gradients on, checkpointed): every row whole
    actor.module.train()
    critic.module.train()
    mask = batch["response_mask"]
    mb = Batch({**batch.tensors, "advantages": torch.randn(mask.shape), "old_log_prob": log_prob,
                "returns": torch.randn(mask.shape), "values": values})
    loss, _, _ = actor.policy_loss(mb, int(mask.sum()), len(mb), 0.0)
    vf_loss, _, _ = critic.value_loss(mb, int(mask.sum()), len(mb))
    (loss + vf_loss).backward()
    # all 12 rows with their 9 prompt columns; the actor feeds the 4 response columns that predict a later token,
    # the critic all 5 (the trimmed whole-row layout of each)
    assert shapes == [(12, 13), (12, 14)]
    assert all(p.grad is not None for p in actor.module.parameters() if p.requires_grad)


@pytest.fixture(scope="module")
def reward_model_dir(model_dir, tmp_path_factory):
    """A random one-label sequence-classification model on the toy architecture, pad id 0 (grouped_batch's
    padding; its tokens are 4-89), with the toy tokenizer, so that the policy's ids are fed as they are."""
    folder = tmp_path_factory.mktemp("shared") / "rm"
    config = AutoConfig.from_pretrained(model_dir, num_labels=1)
    config.pad_token_id = 0
    torch.manual_seed(5)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)  # scores that differ clearly between sequences
    model.save_pretrained(folder)
    load_tokenizer(model_dir).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("micro", [4, 16])
def test_reward_model_scores_match_each_whole_sequence(reward_model_dir, micro):
    batch = grouped_batch(seed=4)
    empty = 5  # a row whose response is empty is scored at its prompt's last token
    batch["response_mask"][empty] = 0
    batch["attention_mask"][empty, 9:] = 0
    # the reference: transformers' own sequence-classification forward of each unpadded sequence alone
    reference = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    expected = []
    with torch.no_grad():
        for row in range(len(batch)):
            ids = batch["input_ids"][row][batch["attention_mask"][row].bool()]
            expected.append(float(reference(input_ids=ids[None]).logits[0, 0]))
    cfg = load_config([f"reward_model.model.path={reward_model_dir}", f"reward_model.model.input_tokenizer={reward_model_dir}",
                       "reward_model.enable=true", "reward_model.model.use_shared_prefix=true",
                       f"reward_model.micro_batch_size_per_gpu={micro}"], validate=False).reward_model
    worker = RewardModelWorker(cfg)
    assert worker.shared_prefix is True
    shapes = []
    worker.module.get_input_embeddings().register_forward_hook(
        lambda module, args, out: shapes.append(tuple(args[0].shape)))
    got = worker.compute_rm_score(batch)
    assert got.tolist() == pytest.approx(expected, abs=1e-4)
    assert len({round(v, 3) for v in expected}) == len(expected)  # every sequence scores differently
    if micro == 16:  # 3 distinct prompts once, then all 12 rows through their 5 non-empty response columns
        assert shapes == [(3, 9), (12, 5)]
    else:  # a micro-batch per prompt, shortest prompt first
        assert [shape[0] for shape in shapes] == [1, 4, 1, 4, 1, 4]


def test_reward_model_re_encoding_conversations_gives_a_notice_and_the_usual_path(model_dir, reward_model_dir, capsys,
                                                                                 tmp_path):
    other = tmp_path / "other_tokenizer"
    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(other)
    cfg = load_config([f"reward_model.model.path={reward_model_dir}", f"reward_model.model.input_tokenizer={other}",
                       "reward_model.enable=true", "reward_model.model.use_shared_prefix=true"],
                      validate=False).reward_model
    worker = RewardModelWorker(cfg)
    assert worker.switch_template and not worker.shared_prefix
    assert ("reward_model.model.use_shared_prefix=true is not used: each conversation is re-encoded with the reward "
            "model's chat template" in capsys.readouterr().err)


@pytest.mark.gpu
def test_on_cuda_in_bf16_the_shared_prefix_matches_the_whole_rows(model_dir):
    """The same comparison on the GPU's attention kernels and in bf16, gradients included."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    batch = grouped_batch().to("cuda")
    mask = batch["response_mask"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().train()
    expected = torch.log_softmax(whole_row_outputs(model, batch).float(), -1)
    expected = expected.gather(-1, batch["responses"][..., None])[..., 0] * mask
    (expected.sum()).backward()
    expected_grads = {name: p.grad.float().clone() for name, p in model.named_parameters()}
    model.zero_grad()
    log_prob, _ = response_log_prob(model, batch, temperature=1.0, with_entropy=False, shared_prefix=True)
    log_prob.sum().backward()
    torch.testing.assert_close(log_prob, expected.detach(), rtol=0, atol=5e-2)  # bf16
    for name, p in model.named_parameters():
        error = float((p.grad.float() - expected_grads[name]).norm() / expected_grads[name].norm())
        assert error < 2e-2, (name, error)
