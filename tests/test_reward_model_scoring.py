"""PPO against a learned reward model: the score read at the last token, placed on the last response
token, re-encoded with the reward model's chat template where tokenizers differ, combined with the rule,
and the checks made before any weights load."""

from __future__ import annotations

import json
import re
import shutil

import pandas as pd
import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from rlhf_core.batch import Batch
from rlhf_core.cli.train import ppo
from rlhf_core.config import ConfigError, load_config
from rlhf_core.data.dataset import left_pad
from rlhf_core.data.synthetic import build_dataset
from rlhf_core.models.loading import ModelError
from rlhf_core.models.toy import CHAT_TEMPLATE as TOY_TEMPLATE
from rlhf_core.models.toy import random_toy_model
from rlhf_core.rewards import reward_model
from rlhf_core.rewards.manager import RewardManager
from rlhf_core.rewards.reward_model import (
    RewardModelManager,
    RewardModelWorker,
    check_reward_model_dir,
    encode_response,
    place_on_last_token,
)

OTHER_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}### Q: {{ message['content'] }}\n"
    "{% else %}### A: {{ message['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def make_reward_model(folder, base, seed=0, num_labels=1, template=None, pad=True):
    """A random sequence-classification head on the toy architecture, saved with the character tokenizer."""
    config = AutoConfig.from_pretrained(base, num_labels=num_labels)
    tokenizer = AutoTokenizer.from_pretrained(base)
    config.pad_token_id = tokenizer.pad_token_id if pad else None
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():  # a head large enough that scores differ clearly between sequences
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    base = random_toy_model(root / "policy", n_layers=1, hidden_size=32, max_position_embeddings=512, seed=0)
    same = make_reward_model(root / "rm_same", base, seed=1)
    other = make_reward_model(root / "rm_other", base, seed=2, template=OTHER_TEMPLATE)
    return root, base, same, other


def _rollout_batch(tokenizer, prompts: list[str], responses: list[str], messages=None, ended=None) -> Batch:
    """A rollout-shaped batch: left-padded prompts, right-padded responses ending with EOS (where ``ended`` says
    so: a response cut at the length limit has none)."""
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    ended = [True] * len(responses) if ended is None else ended
    response_ids = [tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * e
                    for r, e in zip(responses, ended)]
    left = left_pad(prompt_ids, tokenizer.pad_token_id)
    width = max(len(r) for r in response_ids) + 2  # trailing all-padding columns, as a rollout leaves them
    responses_t = torch.full((len(prompts), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, ids in enumerate(response_ids):
        responses_t[i, :len(ids)] = torch.tensor(ids)
        mask[i, :len(ids)] = 1
    positions = left["position_ids"][:, -1:] + torch.arange(1, width + 1)
    meta = {"data_source": ["synthetic/arithmetic"] * len(prompts), "ground_truth": ["7"] * len(prompts),
            "extra_info": [{}] * len(prompts)}
    if messages is not None:
        meta["raw_prompt"] = messages
    return Batch({"prompts": left["input_ids"], "responses": responses_t, "response_mask": mask,
                  "input_ids": torch.cat([left["input_ids"], responses_t], 1),
                  "attention_mask": torch.cat([left["attention_mask"], mask], 1),
                  "position_ids": torch.cat([left["position_ids"], positions], 1)}, meta)


def _hf_score(folder, ids: list[int]) -> float:
    """The reference: the HF sequence-classification model on one unpadded sequence."""
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def _rm_config(path, input_tokenizer, micro=16, rm_coef=1.0, rule_coef=0.0, *extra):
    cfg = load_config([f"reward_model.model.path={path}", f"reward_model.model.input_tokenizer={input_tokenizer}",
                       f"reward_model.micro_batch_size_per_gpu={micro}", f"reward_model.rm_coef={rm_coef}",
                       f"reward_model.rule_coef={rule_coef}", "reward_model.enable=true", *extra], validate=False)
    return cfg.reward_model


PROMPTS = ["User: 3 + 4?\nAssistant: ", "User: What is 10 - 3? Think.\nAssistant: "]
RESPONSES = ["3 + 4 = 7\n#### 7", "#### 8"]
QUESTIONS = ["3 + 4?", "What is 10 - 3? Think."]  # PROMPTS' user turns, as the rollout's conversations hold them
MESSAGES = [[{"role": "user", "content": q}] for q in QUESTIONS]


def _in_other_template(tokenizer) -> list[list[int]]:
    """Each of PROMPTS' conversations and its response as OTHER_TEMPLATE lays them out, written by hand: its prompt
    (no generation prompt, so no "### A: "), the response, EOS."""
    return [tokenizer(f"### Q: {q}\n{r}</s>", add_special_tokens=False)["input_ids"]
            for q, r in zip(QUESTIONS, RESPONSES)]


def test_same_tokenizer_feeds_the_ids_and_reads_the_last_token(space):
    root, base, same, _ = space
    tokenizer = AutoTokenizer.from_pretrained(base)
    batch = _rollout_batch(tokenizer, PROMPTS, RESPONSES)
    worker = RewardModelWorker(_rm_config(same, base, micro=1))
    assert not worker.switch_template
    got = worker.compute_rm_score(batch)
    expected = [_hf_score(same, tokenizer(p + r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
                for p, r in zip(PROMPTS, RESPONSES)]
    assert got.shape == (2,)
    assert got.tolist() == pytest.approx(expected, abs=1e-4)
    assert abs(expected[0] - expected[1]) > 1e-2  # the two sequences really score differently
    # the micro-batch size changes nothing
    assert RewardModelWorker(_rm_config(same, base, micro=2)).compute_rm_score(batch).tolist() == \
        pytest.approx(expected, abs=1e-4)


def test_other_chat_template_decodes_and_re_encodes_the_conversation(space):
    root, base, _, other = space
    tokenizer = AutoTokenizer.from_pretrained(base)
    batch = _rollout_batch(tokenizer, PROMPTS, RESPONSES, messages=MESSAGES)
    worker = RewardModelWorker(_rm_config(other, base))
    assert worker.switch_template
    got = worker.compute_rm_score(batch)
    # the layout the reward model trains on: not the whole conversation in its template
    expected = [_hf_score(other, ids) for ids in _in_other_template(tokenizer)]
    assert got.tolist() == pytest.approx(expected, abs=1e-4)
    del batch.meta["raw_prompt"]
    with pytest.raises(ValueError, match="data.return_raw_chat=true"):
        worker.compute_rm_score(batch)


def test_with_pad_equal_to_eos_ppo_scores_where_training_and_the_export_do(space, tmp_path):
    from rlhf_core.training.reward_trainer import sequence_scores as training_scores

    _, base, same, _ = space
    tokenizer = AutoTokenizer.from_pretrained(base)
    folder = tmp_path / "rm_pad_eos"  # a tokenizer without a pad token of its own: padding is EOS
    model = AutoModelForSequenceClassification.from_pretrained(same)
    model.config.pad_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    eos_padded = AutoTokenizer.from_pretrained(base)
    eos_padded.pad_token = eos_padded.eos_token
    eos_padded.save_pretrained(folder)
    batch = _rollout_batch(tokenizer, PROMPTS, RESPONSES)  # each response closes with EOS
    rows = [tokenizer(p + r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            for p, r in zip(PROMPTS, RESPONSES)]
    # transformers' pooling, as training reads it and as the export does: the last token that is not the pad id
    # (so the one before the closing EOS); not the EOS itself
    exported = [_hf_score(folder, ids) for ids in rows]
    before_eos = [_hf_score(same, ids[:-1]) for ids in rows]  # the same head read one token earlier
    assert exported == pytest.approx(before_eos, abs=1e-4)
    assert not exported == pytest.approx([_hf_score(same, ids) for ids in rows], abs=1e-3)  # the EOS scores apart
    with torch.no_grad():
        trained = training_scores(model.eval(), torch.tensor([rows[0]]), torch.ones(1, len(rows[0]), dtype=torch.long))
    assert float(trained[0]) == pytest.approx(exported[0], abs=1e-4)
    for shared in (False, True):  # whole rows, and each prompt once
        cfg = _rm_config(folder, base)
        cfg.model.use_shared_prefix = shared
        worker = RewardModelWorker(cfg)
        assert worker.shared_prefix == shared
        assert worker.compute_rm_score(batch).tolist() == pytest.approx(exported, abs=1e-4), shared


def test_a_response_cut_at_the_length_limit_is_re_encoded_without_eos(space):
    root, base, _, other = space
    tokenizer = AutoTokenizer.from_pretrained(base)
    # the second response was cut at data.max_response_length: no EOS among its ids
    batch = _rollout_batch(tokenizer, PROMPTS, RESPONSES, messages=MESSAGES, ended=[True, False])
    worker = RewardModelWorker(_rm_config(other, base))
    assert worker.switch_template
    expected = [_hf_score(other, tokenizer(text, add_special_tokens=False)["input_ids"])
                for text in (f"### Q: {QUESTIONS[0]}\n{RESPONSES[0]}</s>", f"### Q: {QUESTIONS[1]}\n{RESPONSES[1]}")]
    with_eos = _hf_score(other, tokenizer(f"### Q: {QUESTIONS[1]}\n{RESPONSES[1]}</s>", add_special_tokens=False)["input_ids"])
    assert abs(with_eos - expected[1]) > 1e-3  # the EOS would change the score
    assert worker.compute_rm_score(batch).tolist() == pytest.approx(expected, abs=1e-4)


def test_a_re_encoded_sequence_longer_than_max_length_loses_its_first_tokens(space, capsys):
    """reward_model.max_length=12: each conversation, rendered in the reward model's template, keeps its last 12
    tokens (the character tokenizer: one a character, and EOS), so the score is read where it is uncut."""
    root, base, _, other = space
    tokenizer = AutoTokenizer.from_pretrained(base)
    batch = _rollout_batch(tokenizer, PROMPTS, RESPONSES, messages=MESSAGES)
    worker = RewardModelWorker(_rm_config(other, base, 16, 1.0, 0.0, "reward_model.max_length=12"))
    assert worker.switch_template
    whole = _in_other_template(tokenizer)
    assert [len(ids) for ids in whole] == [len(f"### Q: {q}\n{r}") + 1 for q, r in zip(QUESTIONS, RESPONSES)]
    expected = [_hf_score(other, ids[-12:]) for ids in whole]
    assert worker.compute_rm_score(batch).tolist() == pytest.approx(expected, abs=1e-4)
    assert abs(expected[0] - _hf_score(other, whole[0])) > 1e-3  # the cut changes the score: it did happen
    worker.compute_rm_score(batch)
    err = capsys.readouterr().err
    assert err.count("notice: 2 of 2 sequences re-encoded for the reward model were longer than its 12 tokens") == 1
    # by default the model's positions (512 here) bound it: nothing is cut, nothing said
    RewardModelWorker(_rm_config(other, base)).compute_rm_score(batch)
    assert "notice" not in capsys.readouterr().err


def test_max_length_null_cuts_re_encoded_sequences_to_the_reward_models_positions(tmp_path, capsys):
    """reward_model.max_length unset and a reward model of 20 positions: each conversation, rendered in its
    template, keeps its last 20 tokens (the character tokenizer: one a character, and EOS), as many as it has."""
    base = random_toy_model(tmp_path / "policy", n_layers=1, hidden_size=32, max_position_embeddings=20, seed=0)
    other = make_reward_model(tmp_path / "rm", base, seed=2, template=OTHER_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(base)
    batch = _rollout_batch(tokenizer, PROMPTS, RESPONSES, messages=MESSAGES)
    worker = RewardModelWorker(_rm_config(other, base))
    assert worker.switch_template
    whole = _in_other_template(tokenizer)
    assert [len(ids) for ids in whole] == [31, 37]  # both over the 20 positions
    expected = [_hf_score(other, ids[-20:]) for ids in whole]
    assert worker.compute_rm_score(batch).tolist() == pytest.approx(expected, abs=1e-4)
    assert abs(expected[0] - _hf_score(other, whole[0])) > 1e-3  # the cut changes the score: it did happen
    assert "2 of 2 sequences re-encoded for the reward model were longer than its 20 tokens" in capsys.readouterr().err


THINK_TEMPLATE = TOY_TEMPLATE.replace(
    "{% if add_generation_prompt %}Assistant: {% endif %}",
    "{% if add_generation_prompt %}Assistant: {% if enable_thinking is defined and not enable_thinking %}"
    "<nothink>{% endif %}{% endif %}")


def test_chat_template_kwargs_other_than_the_reward_models_re_encode(space, tmp_path):
    _, base, _, _ = space
    tokenizer = AutoTokenizer.from_pretrained(base)
    policy = tmp_path / "policy_tokenizer"  # the reward model's tokenizer and template: only the keywords differ
    think = AutoTokenizer.from_pretrained(base)
    think.chat_template = THINK_TEMPLATE
    think.save_pretrained(policy)
    folder = make_reward_model(tmp_path / "rm_nothink", base, seed=1, template=THINK_TEMPLATE)
    config = AutoConfig.from_pretrained(folder)
    config.chat_template_kwargs = {"enable_thinking": False}  # as rlhf-train-rm records them
    config.save_pretrained(folder)
    batch = _rollout_batch(tokenizer, PROMPTS[:1], RESPONSES[:1], messages=MESSAGES[:1])  # rendered without keywords
    plain = _rm_config(folder, policy)
    assert reward_model.needs_template_switch(plain)
    worker = RewardModelWorker(plain)
    assert worker.switch_template
    nothink = tokenizer("User: 3 + 4?\nAssistant: <nothink>" + RESPONSES[0] + "</s>", add_special_tokens=False)
    assert float(worker.compute_rm_score(batch)[0]) == pytest.approx(_hf_score(folder, nothink["input_ids"]), abs=1e-4)
    # the policy's prompts rendered with the keywords the reward model was trained with: its ids as they are
    matching = _rm_config(folder, policy, 16, 1.0, 0.0, "data.apply_chat_template_kwargs={enable_thinking: false}")
    assert matching.model.input_chat_template_kwargs == {"enable_thinking": False}
    assert not reward_model.needs_template_switch(matching)
    assert not RewardModelWorker(matching).switch_template


def test_input_tokenizer_follows_the_policys_tokenizer_path(space, tmp_path):
    from rlhf_core.main_ppo import _reward_model_problems

    _, base, same, _ = space
    weights = tmp_path / "weights"  # the policy's weights alone; its tokenizer lives elsewhere
    weights.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (weights / name).write_bytes((base / name).read_bytes())
    policy = [f"actor_rollout_ref.model.path={weights}", f"reward_model.model.path={same}", "reward_model.enable=true"]
    cfg = load_config([*policy, f"actor_rollout_ref.model.tokenizer_path={base}", "data.max_prompt_length=256",
                       "data.max_response_length=256"], validate=False)  # (within the 512 positions)
    assert cfg.reward_model.model.input_tokenizer == str(base)
    assert _reward_model_problems(cfg) == []
    assert not RewardModelWorker(cfg.reward_model).switch_template
    assert load_config(policy, validate=False).reward_model.model.input_tokenizer == str(weights)
    assert load_config([*policy, "reward_model.model.input_tokenizer=null"],
                       validate=False).reward_model.model.input_tokenizer is None


def test_input_tokenizer_null_feeds_the_ids_even_with_another_template(space):
    root, base, _, other = space
    tokenizer = AutoTokenizer.from_pretrained(base)
    batch = _rollout_batch(tokenizer, PROMPTS[:1], RESPONSES[:1])
    cfg = _rm_config(other, base)
    cfg.model.input_tokenizer = None
    worker = RewardModelWorker(cfg)
    assert not worker.switch_template
    ids = tokenizer(PROMPTS[0] + RESPONSES[0], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert float(worker.compute_rm_score(batch)[0]) == pytest.approx(_hf_score(other, ids), abs=1e-4)


def test_a_critic_started_from_a_reward_model_keeps_its_head_and_a_new_head_starts_at_zero(space):
    from rlhf_core.models.loading import load_critic

    _, base, same, _ = space
    trained = AutoModelForSequenceClassification.from_pretrained(same).score.weight  # drawn N(0, 1) above
    critic = load_critic(same)
    assert trained.abs().sum() > 1 and torch.equal(critic.score.weight, trained)  # as verl loads it
    ids = torch.tensor([[5, 17, 23, 40, 2]])
    with torch.no_grad():
        values = critic(input_ids=ids).logits.squeeze(-1)
    assert _hf_score(same, ids[0].tolist()) == pytest.approx(float(values[0, -1]), abs=1e-5)  # the RM's own score
    fresh = load_critic(base)  # the actor's checkpoint has no head: a new one, at zero
    assert not fresh.score.weight.any() and (fresh.score.bias is None or not fresh.score.bias.any())


def test_place_on_last_token_puts_each_score_on_its_last_valid_response_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    placed = place_on_last_token(torch.tensor([0.5, -2.0, 3.0]), mask)
    expected = torch.tensor([[0, 0, 0.5, 0], [-2.0, 0, 0, 0], [0, 0, 0, 3.0]])
    assert torch.equal(placed, expected)


def test_combined_reward_is_rm_coef_times_model_plus_rule_coef_times_rule(space):
    root, base, same, _ = space
    tokenizer = AutoTokenizer.from_pretrained(base)
    batch = _rollout_batch(tokenizer, PROMPTS, RESPONSES)  # ground truth 7: first right, second wrong
    cfg = _rm_config(same, base, rm_coef=2.0, rule_coef=0.5)
    manager = RewardModelManager(RewardManager(tokenizer), RewardModelWorker(cfg), cfg)
    token_level, extras = manager.score_batch(batch)
    rm = [_hf_score(same, tokenizer(p + r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
          for p, r in zip(PROMPTS, RESPONSES)]
    expected = [2.0 * rm[0] + 0.5 * 1.0, 2.0 * rm[1] + 0.5 * 0.0]
    last = [len(r) for r in RESPONSES]  # the EOS after the response text
    assert token_level[0, last[0]].item() == pytest.approx(expected[0], abs=1e-4)
    assert token_level[1, last[1]].item() == pytest.approx(expected[1], abs=1e-4)
    assert token_level.abs().sum().item() == pytest.approx(abs(expected[0]) + abs(expected[1]), abs=1e-4)
    assert extras["gold_reward"].tolist() == [1.0, 0.0]
    assert extras["acc"].tolist() == [1.0, 0.0]
    assert extras["rm_score"].tolist() == pytest.approx(rm, abs=1e-4)


def test_rows_without_a_ground_truth_are_scored_by_the_model_alone(space):
    """rule_coef=0 and a prompt without a ground truth: the built-in rule is not called on it (its gold reward,
    accuracy and answer are unknown: NaN, None), its score is the model's; the other row is graded as before."""
    root, base, same, _ = space
    tokenizer = AutoTokenizer.from_pretrained(base)
    batch = _rollout_batch(tokenizer, PROMPTS, RESPONSES)
    batch.meta["ground_truth"] = ["7", None]
    cfg = _rm_config(same, base, rm_coef=2.0, rule_coef=0.0)
    manager = RewardModelManager(RewardManager(tokenizer), RewardModelWorker(cfg), cfg)
    token_level, extras = manager.score_batch(batch)
    rm = [_hf_score(same, tokenizer(p + r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
          for p, r in zip(PROMPTS, RESPONSES)]
    assert extras["score"].tolist() == pytest.approx([2.0 * rm[0], 2.0 * rm[1]], abs=1e-4)
    assert token_level[1, len(RESPONSES[1])].item() == pytest.approx(2.0 * rm[1], abs=1e-4)
    assert extras["gold_reward"][0].item() == 1.0 and torch.isnan(extras["gold_reward"][1])
    assert extras["acc"][0].item() == 1.0 and torch.isnan(extras["acc"][1])
    assert extras["pred"] == ["7", None]
    assert extras["responses"] == RESPONSES  # both decoded, EOS left out
    batch.meta["ground_truth"] = [None, None]
    _, extras = manager.score_batch(batch)
    assert torch.isnan(extras["gold_reward"]).all() and torch.isnan(extras["acc"]).all() and "pred" not in extras
    assert extras["score"].tolist() == pytest.approx([2.0 * rm[0], 2.0 * rm[1]], abs=1e-4)


def test_the_graded_rows_are_decoded_once(space):
    """Rows with and without a ground truth: every row's text is logged and the graded rows' text is the rule's,
    from one decode of the batch (a long batch's decode is not free)."""
    _, base, same, _ = space
    tokenizer = AutoTokenizer.from_pretrained(base)
    decoded: list[list[int]] = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def batch_decode(self, sequences, **kwargs):
            decoded.extend(sequences)
            return tokenizer.batch_decode(sequences, **kwargs)

    class ResponseLength:
        def compute_rm_score(self, batch: Batch) -> torch.Tensor:
            return batch["response_mask"].sum(-1).float()

    batch = _rollout_batch(tokenizer, PROMPTS, RESPONSES)
    batch.meta["ground_truth"] = ["7", None]
    manager = RewardModelManager(RewardManager(Counting()), ResponseLength(), _rm_config(same, base, rule_coef=0.0))
    _, extras = manager.score_batch(batch)
    assert len(decoded) == len(RESPONSES)  # each row once
    assert extras["responses"] == RESPONSES and extras["pred"] == ["7", None]
    assert extras["acc"][0].item() == 1.0 and torch.isnan(extras["acc"][1])


def test_which_configs_need_a_ground_truth_on_every_row(space):
    _, base, same, _ = space
    needs = [load_config(extra, validate=False).needs_ground_truth() for extra in (
        [],  # the built-in rule is the reward
        ["reward_model.enable=true", f"reward_model.model.path={same}", "reward_model.rule_coef=0.5"],  # a part
        ["reward_model.enable=true", f"reward_model.model.path={same}", "reward_model.rule_coef=0"],  # gold only
        ["custom_reward_function.path=reward.py"],  # the user's function decides what it reads
    )]
    assert needs == [True, True, False, False]


def test_dynamic_sampling_on_accuracy_refuses_responses_without_one():
    from rlhf_core.training.dynamic_sampling import group_metric

    extras = {"acc": torch.tensor([1.0, float("nan")]), "score": torch.tensor([0.5, 0.25])}
    with pytest.raises(ValueError, match="filter_groups.metric=acc is not known for every response"):
        group_metric(Batch({}, {}), extras, "acc")
    assert group_metric(Batch({}, {}), extras, "score").tolist() == [0.5, 0.25]


# ----------------------------------------------------------------------------- checks before weights load


def test_reward_model_dir_checks_name_what_is_wrong(space, tmp_path):
    root, base, same, _ = space
    assert check_reward_model_dir(same) == same
    with pytest.raises(ModelError, match="is not set"):
        check_reward_model_dir(None)
    with pytest.raises(ModelError, match="is not a directory"):
        check_reward_model_dir(tmp_path / "missing")
    with pytest.raises(ModelError, match="num_labels=2"):
        check_reward_model_dir(make_reward_model(tmp_path / "two", base, num_labels=2))
    with pytest.raises(ModelError, match="not a sequence-classification"):
        check_reward_model_dir(base)  # a causal LM
    no_pad = make_reward_model(tmp_path / "nopad", base, pad=False)
    with pytest.raises(ModelError, match="no pad_token_id"):
        check_reward_model_dir(no_pad)
    bare = tmp_path / "bare"
    AutoModelForSequenceClassification.from_pretrained(same).save_pretrained(bare)  # weights, no tokenizer
    with pytest.raises(ModelError, match="no tokenizer"):
        check_reward_model_dir(bare)
    training = tmp_path / "rm_run"  # rlhf-train-rm's folder: checkpoints, and the model under huggingface/
    shutil.copytree(same, training / "huggingface")
    with pytest.raises(ModelError, match=f"is a reward model's training folder; the model is its export, "
                                         f"reward_model.model.path={training / 'huggingface'}"):
        check_reward_model_dir(training)


def _headless(base, folder):
    """``base``'s causal-LM weights under a one-label sequence-classification config: no score head stored."""
    shutil.copytree(base, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["LlamaForSequenceClassification"], num_labels=1,
                  id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_language_model_without_a_score_head_is_refused(space, tmp_path):
    """transformers loads such a copy with a random head and only prints 'newly initialized': PPO would train
    against noise. The safetensors header names the weights without loading them, so the directory check refuses
    it; a checkpoint whose names cannot be read so (pytorch_model.bin) is refused when the worker loads it."""
    root, base, same, _ = space
    headless = _headless(base, tmp_path / "headless")
    message = (f"reward_model.model.path: {headless} has no trained score head (its weights lack score.weight): "
               "it holds a language model's weights under a sequence-classification config")
    with pytest.raises(ModelError, match=re.escape(message)):
        check_reward_model_dir(headless)
    with pytest.raises(ModelError, match="no trained score head"):
        RewardModelWorker(_rm_config(headless, base))
    from safetensors.torch import load_file

    pickled = _headless(base, tmp_path / "pickled")
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    assert check_reward_model_dir(pickled) == pickled  # unread here
    with pytest.raises(ModelError, match=f"{pickled} has no trained score head"):
        RewardModelWorker(_rm_config(pickled, base))
    RewardModelWorker(_rm_config(same, base))  # a trained head passes both


def test_enable_without_a_path_is_a_config_error():
    with pytest.raises(ConfigError, match="reward_model.enable=true needs reward_model.model.path"):
        load_config(["reward_model.enable=true"])


@pytest.fixture(scope="module")
def data(space):
    root = space[0]
    build_dataset(root / "data", n_train=16, n_test=4, seed=0, max_ops=1)
    return root / "data"


def _cli(root, base, data, out, *extra):
    return [f"actor_rollout_ref.model.path={base}", f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}", "data.train_batch_size=4", "data.max_prompt_length=320",
            "data.max_response_length=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",
            "critic.model.enable_gradient_checkpointing=false", "trainer.n_gpus_per_node=1", "trainer.device=cpu",
            f"trainer.default_local_dir={out}", "trainer.logger=[file]", "trainer.test_freq=1", "reward_model.enable=true", *extra]


@pytest.mark.parametrize("make, needle", [
    (lambda root, base, tmp: tmp / "nowhere", "is not a directory"),
    (lambda root, base, tmp: make_reward_model(tmp / "two", base, num_labels=2), "num_labels=2"),
    (lambda root, base, tmp: root / "policy", "not a sequence-classification"),
    (lambda root, base, tmp: root / "rm_other", "data.return_raw_chat=true"),
])
def test_cli_rejects_a_bad_reward_model_before_loading_weights(space, data, tmp_path, capsys, monkeypatch, make,
                                                               needle):
    root, base, _, _ = space
    import rlhf_core.main_ppo as main_ppo

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the reward model was checked")

    monkeypatch.setattr(main_ppo, "build_trainer", no_weights)
    out = tmp_path / "out"
    code = ppo(_cli(root, base, data, out, f"reward_model.model.path={make(root, base, tmp_path)}",
                     "trainer.total_training_steps=1"))
    assert code == 2
    assert needle in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_cli_trains_against_a_reward_model_and_logs_proxy_and_gold(space, data, tmp_path):
    root, base, same, _ = space
    out = tmp_path / "out"
    code = ppo(_cli(root, base, data, out, f"reward_model.model.path={same}", "trainer.total_training_steps=1",
                     "trainer.val_before_train=false", "actor_rollout_ref.rollout.n=1"))
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    final = records[-1]
    final = final.get("metrics", final)
    source = "synthetic/arithmetic"
    for name in (f"val-aux/{source}/reward/mean@1", f"val-aux/{source}/gold_reward/mean@1",
                 f"val-aux/{source}/rm_score/mean@1", "critic/rm_score/mean", "critic/gold_reward/mean"):
        assert name in final, name
    # rule_coef=0: the reward optimised is the model score alone
    assert final[f"val-aux/{source}/reward/mean@1"] == pytest.approx(final[f"val-aux/{source}/rm_score/mean@1"])
    assert final["critic/score/mean"] == pytest.approx(final["critic/rm_score/mean"], abs=1e-5)


def _prompts_alone(data, folder):
    """The synthetic train and test files without their reward_model column: prompts alone."""
    import pandas as pd

    folder.mkdir()
    for split in ("train", "test"):
        pd.read_parquet(data / f"{split}.parquet").drop(columns=["reward_model"]).to_parquet(folder / f"{split}.parquet")
    return folder


def test_cli_trains_on_prompts_alone_against_a_reward_model(space, data, tmp_path, capsys):
    """Prompts without any ground truth (no reward_model column): PPO with rule_coef=0 trains and validates on
    the model's score, the reward is the core validation metric, and no accuracy or gold is logged; with a rule
    share in the reward the same data are refused before training, naming the row."""
    root, base, same, _ = space
    prompts = _prompts_alone(data, tmp_path / "prompts")
    out = tmp_path / "out"
    code = ppo(_cli(root, base, prompts, out, f"reward_model.model.path={same}", "trainer.total_training_steps=1",
                    "actor_rollout_ref.rollout.n=1", "trainer.logger=[console,file]"))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    # the guards on by default have nothing to watch, and say so once; the console shows the validation reward
    assert captured.err.count("NOTE trainer.guard.max_val_drop and trainer.guard.overopt_patience do not act") == 1
    assert "step 1/1 | score " in captured.out and " | val_reward " in captured.out and " acc " not in captured.out
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    final = records[-1].get("metrics", records[-1])
    source = "synthetic/arithmetic"
    assert f"val-core/{source}/reward/mean@1" in final and f"val-aux/{source}/rm_score/mean@1" in final
    assert final[f"val-core/{source}/reward/mean@1"] == pytest.approx(final[f"val-aux/{source}/rm_score/mean@1"])
    assert "critic/rm_score/mean" in final
    assert not [k for k in final if "gold_reward" in k or "/acc/" in k], final
    code = ppo(_cli(root, base, prompts, tmp_path / "refused", f"reward_model.model.path={same}",
                    "reward_model.rule_coef=0.5", "trainer.total_training_steps=1"))
    assert code == 2  # before any weights load
    assert "data.train_files: 16 rows have no reward_model.ground_truth" in capsys.readouterr().err


def test_a_validation_batch_without_ground_truths_keeps_the_others_majority_vote(space, data, tmp_path):
    """Validation in batches of 2: the first holds the two prompts without a ground truth (nothing graded, no
    answers), the second two graded ones, whose maj@2 is still reported, over those two prompts alone."""
    import pandas as pd

    root, base, same, _ = space
    val = pd.read_parquet(data / "test.parquet")
    val["reward_model"] = [None, None, *val["reward_model"][2:]]
    val.to_parquet(tmp_path / "val.parquet")
    out = tmp_path / "out"
    code = ppo([*_cli(root, base, data, out, f"reward_model.model.path={same}", "trainer.total_training_steps=1",
                      "actor_rollout_ref.rollout.n=1", "trainer.val_before_train=false",
                      "actor_rollout_ref.rollout.val_kwargs.n=2", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                      "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "data.val_batch_size=2"), f"data.val_files={tmp_path / 'val.parquet'}"])
    assert code == 0
    final = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    final = final.get("metrics", final)
    source = "synthetic/arithmetic"
    for name in ("acc/mean@2", "acc/best@2/mean", "acc/maj@2/mean"):
        assert f"val-core/{source}/{name}" in final, name


def test_the_dry_run_takes_prompts_alone_as_training_does(space, data, tmp_path):
    """The dry run loads its first prompts as the trainer would: without a ground truth where the reward model
    alone scores, and refused (naming the column) where a rule share needs one."""
    from rlhf_core.data.dataset import DataError
    from rlhf_core.pipeline.smoke import run_smoke_test

    root, base, same, _ = space
    prompts = _prompts_alone(data, tmp_path / "prompts")
    args = [*_cli(root, base, prompts, tmp_path / "out"), f"reward_model.model.path={same}"]
    report = run_smoke_test(load_config(args), tmp_path / "smoke", n_prompts=4, response_length=4)
    assert report.n_prompts == 4 and len(report.metrics) == 2
    assert report.passed and len(report.checks) == 5, report.checks
    with pytest.raises(DataError, match=r"column\(s\) \['reward_model'\] missing"):
        run_smoke_test(load_config([*args, "reward_model.rule_coef=0.5"]), tmp_path / "smoke2", n_prompts=4)


def test_cli_scores_with_each_prompt_once_as_with_whole_rows(space, data, tmp_path, monkeypatch):
    """``reward_model.model.use_shared_prefix`` in a run: the same seed, the same rollouts, the same scores."""
    root, base, same, _ = space
    finals, calls = {}, {"false": 0, "true": 0}
    shared_scores = reward_model.shared_prefix_scores

    def counted(*args, **kwargs):  # which path scored: equal scores alone would not tell
        calls[shared] += 1
        return shared_scores(*args, **kwargs)

    monkeypatch.setattr(reward_model, "shared_prefix_scores", counted)
    for shared in ("false", "true"):
        out = tmp_path / shared
        code = ppo(_cli(root, base, data, out, f"reward_model.model.path={same}", "trainer.total_training_steps=1",
                        "trainer.val_before_train=false", "actor_rollout_ref.rollout.n=2",
                        f"reward_model.model.use_shared_prefix={shared}"))
        assert code == 0
        final = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
        finals[shared] = final.get("metrics", final)
    # rule_coef=0: critic/score/* are the reward model's scores of the training batch
    for name in ("critic/rm_score/mean", "critic/score/max", "critic/score/min",
                 "val-aux/synthetic/arithmetic/rm_score/mean@1"):
        assert finals["true"][name] == pytest.approx(finals["false"][name], abs=1e-4), name
    assert finals["true"]["critic/score/max"] - finals["true"]["critic/score/min"] > 1e-2  # the scores differ
    assert calls["false"] == 0 and calls["true"] > 0


def test_the_stop_ids_are_the_policys_generation_configs(space, tmp_path):
    """The rollout stops on the policy model's generation-config EOS ids; a tokenizer-only directory (the policy's
    tokenizer_path, the input tokenizer's default) has none, so the policy's directory names them."""
    from transformers import GenerationConfig

    _, base, _, other = space
    tokens_only = tmp_path / "tokenizer_only"
    AutoTokenizer.from_pretrained(base).save_pretrained(tokens_only)
    policy = tmp_path / "policy"
    policy.mkdir()
    eos = AutoTokenizer.from_pretrained(base).eos_token_id
    GenerationConfig(eos_token_id=[eos, 7]).save_pretrained(policy)  # 7: a second stop token of the model
    assert RewardModelWorker(_rm_config(other, tokens_only)).input_stop_ids == {eos}
    assert RewardModelWorker(_rm_config(other, tokens_only), policy_path=str(policy)).input_stop_ids == {eos, 7}


def test_a_text_cut_to_max_length_raises_no_warning_of_indexing_errors(space):
    """transformers warns once per tokenizer that a text longer than its model_max_length will fail in the model
    (and marks the tokenizer as having warned); the pairs and conversations encoded here are cut to max_length
    right after, so the warning only misleads."""
    _, _, same, _ = space
    messages, response = [{"role": "user", "content": "7 + 8 = ?" * 40}], "15 " * 40
    warned = "sequence-length-is-longer-than-the-specified-maximum"

    def fresh():
        tokenizer = AutoTokenizer.from_pretrained(same)
        tokenizer.model_max_length = 16
        return tokenizer

    tokenizer = fresh()
    ids, _, _ = encode_response(tokenizer, messages, response, max_length=16)
    assert len(ids) == 16 and not tokenizer.deprecation_warnings.get(warned)
    tokenizer = fresh()
    tokenizer(response)  # called plainly it warns: the check above can see a warning
    assert tokenizer.deprecation_warnings.get(warned)


def test_a_tokenizer_without_a_chat_template_lays_prompts_out_as_the_ppo_dataset_does(tmp_path):
    """Without a chat template the PPO dataset joins the contents by newlines without the encoder's special tokens;
    the reward model's layout (training, scoring, rlhf validate's pair lengths) added a BOS and a closing newline,
    so the same conversation was read as another sequence in each."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from rlhf_core.config import DataConfig
    from rlhf_core.data.dataset import RLHFDataset
    from rlhf_core.rewards.reward_model import conversation_ids

    vocab = {"[UNK]": 0, "[PAD]": 1, "<s>": 2, "</s>": 3}
    for code in list(range(32, 127)) + [10]:
        vocab.setdefault(chr(code), len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                        bos_token="<s>", eos_token="</s>")
    assert tokenizer.chat_template is None and tokenizer("a")["input_ids"] == [2, vocab["a"]]  # an encoder BOS
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    expected = [vocab[c] for c in "Be brief.\n2+2?"]  # one id a character: no <s>, no closing newline
    prompt_ids, responses = conversation_ids(tokenizer, messages, ["4", "5"])
    assert prompt_ids == expected
    assert responses == [[vocab["4"], 3], [vocab["5"], 3]]
    assert encode_response(tokenizer, messages, "4")[0] == expected + [vocab["4"], 3]
    # the PPO dataset's prompt of the same row: the same ids
    frame = pd.DataFrame([{"prompt": messages, "data_source": "synthetic/arithmetic",
                           "reward_model": {"style": "rule", "ground_truth": "4"}}])
    frame.to_parquet(tmp_path / "one.parquet")
    dataset = RLHFDataset(str(tmp_path / "one.parquet"), tokenizer, DataConfig(max_prompt_length=64))
    assert list(dataset.prompt_ids[0]) == expected
