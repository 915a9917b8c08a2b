"""Reward-model training: the Bradley-Terry loss, last-token scores, the CLI, resume, LoRA, bad input."""

from __future__ import annotations

import json
import math
import shutil
import signal
import socket
import time

import pandas as pd
import pytest
import torch
import yaml
from test_reward_model_float64 import expected_pair_metrics
from transformers import AutoModelForSequenceClassification

from rlhf_core.cli.train import train_rm
from rlhf_core.config import ConfigError, load_config
from rlhf_core.data.preference import synthetic_pairs, write_splits
from rlhf_core.data.synthetic import DATA_SOURCE
from rlhf_core.models.loading import config_with, disable_dropout, load_tokenizer
from rlhf_core.models.toy import CHAT_TEMPLATE as TOY_TEMPLATE
from rlhf_core.models.toy import random_toy_model
from rlhf_core.rewards.reward_model import encode_response
from rlhf_core.training import checkpoint as ckpt
from rlhf_core.training.reward_trainer import (
    RewardModelTrainer,
    RewardModelWorker,
    bradley_terry_loss,
    collate,
    load_reward_backbone,
    pair_metrics,
    sequence_scores,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return random_toy_model(tmp_path_factory.mktemp("rm") / "model", n_layers=1, hidden_size=32,
                            max_position_embeddings=512, seed=0)


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory):
    train, val = synthetic_pairs(24, 8, seed=0)
    out = tmp_path_factory.mktemp("pairs")
    write_splits(out, train, val, DATA_SOURCE)
    return out


def _overrides(model, pairs_dir, out, *extra):
    return ["trainer.device=cpu", "trainer.n_gpus_per_node=1", f"reward_model.train.model.path={model}",
            f"reward_model.train.train_files={pairs_dir / 'train.parquet'}",
            f"reward_model.train.val_files={pairs_dir / 'val.parquet'}", "reward_model.train.train_batch_size=8",
            "reward_model.train.micro_batch_size_per_gpu=4", "reward_model.train.optim.lr=1e-3",
            f"reward_model.train.default_local_dir={out}", *extra]


# ----------------------------------------------------------------------------- the math


def test_bradley_terry_loss_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    # -log sigmoid(x) = log(1 + exp(-x)): log(1 + e^-2) = 0.126928, log 2 = 0.693147
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx((0.126928 + 0.693147) / 2, abs=1e-6)
    # margin 1: log(1 + e^-1) = 0.313262, log(1 + e) = 1.313262
    assert bradley_terry_loss(chosen, rejected, margin=1.0).item() == pytest.approx(0.813262, abs=1e-6)
    # weights and a global normaliser: only the first pair counts, divided by 4 pairs
    weighted = bradley_terry_loss(chosen, rejected, weight=torch.tensor([1.0, 0.0]), normaliser=4)
    assert weighted.item() == pytest.approx(0.126928 / 4, abs=1e-6)


def test_score_is_the_head_at_the_last_non_pad_token(tiny):
    tokenizer = load_tokenizer(tiny)
    model = load_reward_backbone(tiny, tokenizer.pad_token_id, seed=0).eval()
    messages = [{"role": "user", "content": "Tom has 3 apples. How many?"}]
    short, _, _ = encode_response(tokenizer, messages, "3", 512)
    long, _, _ = encode_response(tokenizer, messages, "He has 3 apples.\n#### 3", 512)
    assert short[-1] == long[-1] == tokenizer.eos_token_id and len(short) < len(long)
    batch = collate([(long, short)], tokenizer.pad_token_id)  # rows: long, then short right-padded
    assert batch["input_ids"][1, len(short):].eq(tokenizer.pad_token_id).all()
    with torch.no_grad():
        scores = sequence_scores(model, batch["input_ids"], batch["attention_mask"])
        expected = []
        for ids in (long, short):  # each sequence alone, no padding: hidden state of its last token
            hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
            expected.append(float(hidden @ model.score.weight[0]))
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)


def test_encode_keeps_the_response_end_when_truncating(tiny):
    tokenizer = load_tokenizer(tiny)
    full, *cut = encode_response(tokenizer, [{"role": "user", "content": "a long question " * 5}], "#### 7", 512)
    short, *cut_short = encode_response(tokenizer, [{"role": "user", "content": "a long question " * 5}], "#### 7", 20)
    # "User: " + 80 characters + "\n" + "Assistant: " = 98 prompt tokens, "#### 7" + EOS = 7: 105 cut to 20
    assert cut == [0, 0] and cut_short == [85, 0] and len(short) == 20 and short == full[-20:]


def test_encode_counts_prompt_and_response_tokens_cut(tiny):
    tokenizer = load_tokenizer(tiny)
    messages = [{"role": "user", "content": "Q?"}]  # "User: Q?\nAssistant: ": 20 characters, one token each
    ids, prompt_cut, response_cut = encode_response(tokenizer, messages, "abc", 22)  # 20 + 3 + EOS = 24
    assert (prompt_cut, response_cut) == (2, 0)
    assert tokenizer.decode(ids[:-1]) == "er: Q?\nAssistant: abc" and ids[-1] == tokenizer.eos_token_id
    ids, prompt_cut, response_cut = encode_response(tokenizer, messages, "abc", 3)
    assert (prompt_cut, response_cut) == (20, 1) and tokenizer.decode(ids[:-1]) == "bc"
    ids, prompt_cut, response_cut = encode_response(tokenizer, messages, "abc", 3, eos=False)
    assert (prompt_cut, response_cut) == (20, 0) and tokenizer.decode(ids) == "abc"


def _preference_file(path, rows):
    """A preference parquet of (question, chosen, rejected) rows, the question as the whole user turn."""
    pd.DataFrame({"prompt": [[{"role": "user", "content": q}] for q, _, _ in rows],
                  "chosen": [c for _, c, _ in rows], "rejected": [r for _, _, r in rows],
                  "data_source": ["s"] * len(rows), "extra_info": [{"split": "train"}] * len(rows)}).to_parquet(path)
    return path


def test_pairs_that_truncation_makes_identical_are_left_out_with_a_notice(tiny, tmp_path, capsys):
    from rlhf_core.training.reward_trainer import RewardTrainingError, preflight

    # prompt "User: Q?\nAssistant: " = 20 tokens. Row 0: "Yes! total 7" / "No!! total 7" (12 + EOS each) differ in
    # their first 3 characters; cut to 10 tokens (23 from the left) both are "! total 7" + EOS. Row 1: "#### 7" /
    # "#### 8" (6 + EOS) lose 17 prompt tokens only, keeping "t: ", and still differ in their last character
    train = _preference_file(tmp_path / "train.parquet", [("Q?", "Yes! total 7", "No!! total 7"),
                                                            ("Q?", "#### 7", "#### 8")])
    base = ["trainer.device=cpu", "trainer.n_gpus_per_node=1", f"reward_model.train.model.path={tiny}",
            f"reward_model.train.train_files={train}", "reward_model.train.val_files=null",
            "reward_model.train.train_batch_size=1", "reward_model.train.micro_batch_size_per_gpu=1",
            f"reward_model.train.default_local_dir={tmp_path / 'out'}"]
    prepared = preflight(load_config([*base, "reward_model.train.max_length=10"]))
    tokenizer = prepared.tokenizer
    assert [(tokenizer.decode(c), tokenizer.decode(r)) for c, r in prepared.train] == [
        ("t: #### 7</s>", "t: #### 8</s>")]
    err = capsys.readouterr().err
    assert "notice: 2 of 2 training pairs are over reward_model.train.max_length=10 on a side (reward_model.train." \
           "overlong=truncate): cut to one prompt window (the same prompt tokens on both sides); of their sequences, " \
           "2 lost prompt tokens from the left; 2 lost their whole prompt and the start of their response" in err
    assert "1 pair(s) of reward_model.train.train_files are left out" in err and f"row 0 of {train}" in err
    # 30 tokens cut 3 prompt tokens from row 0's sequences alone: both pairs kept
    assert len(preflight(load_config([*base, "reward_model.train.max_length=30"])).train) == 2
    err = capsys.readouterr().err
    assert "notice: 1 of 2 training pairs are over reward_model.train.max_length=30 on a side (reward_model.train." \
           "overlong=truncate): cut to one prompt window (the same prompt tokens on both sides); of their sequences, " \
           "2 lost prompt tokens from the left (the response's end" in err and "left out" not in err
    only_same = _preference_file(tmp_path / "same.parquet", [("Q?", "Yes! total 7", "No!! total 7")])
    with pytest.raises(RewardTrainingError, match=r"train_files: in every pair chosen and rejected have the same "
                                                  r"token ids; 1 with the same ids once cut to "
                                                  r"reward_model.train.max_length \(10\) .*raise max_length"):
        preflight(load_config([*base, f"reward_model.train.train_files={only_same}",
                               "reward_model.train.max_length=10"]))
    # texts that differ in characters the tokenizer does not know (both its unknown token) are the same ids
    # uncut: raising max_length cannot help, and the message says what can
    unknown = _preference_file(tmp_path / "unknown.parquet", [("Q?", "answer \u00e9", "answer \u0436")])
    assert tokenizer("answer \u00e9")["input_ids"] == tokenizer("answer \u0436")["input_ids"]
    with pytest.raises(RewardTrainingError, match=r"1 with the same ids uncut: the tokenizer reads their differences "
                                                  r"as the same tokens .*make the texts differ"):
        preflight(load_config([*base, f"reward_model.train.train_files={unknown}"]))


def _long_pairs(tmp_path):
    """Preference files whose sides' lengths in the toy tokenizer (a token per character) are known: the prompt
    "User: Q?\nAssistant: " is 20 tokens ("User: " 6 + "Q?" 2 + "\nAssistant: " 12), a response its characters +
    EOS. Against max_length=30, the longer side of each pair is (train) 27, 42, 48, 30, 45, 43 and (val) 27, 52."""
    train = _preference_file(tmp_path / "train.parquet", [
        ("Q?", "#### 7", "#### 8"),  # 27 and 27: within
        ("Q?", "a long answer: #### 7", "#### 8"),  # chosen 20 + 21 + 1 = 42: over
        ("Q?", "#### 7", "the rejected is long #### 8"),  # rejected 20 + 27 + 1 = 48: over
        ("Q?", "ok #### 7", "no #### 8"),  # 20 + 9 + 1 = 30 each: exactly max_length, within
        ("Q?", "both are too long #### 1", "both are too long #### 2"),  # 20 + 24 + 1 = 45 each: over
        ("A longer question?", "#### 1", "#### 2"),  # the prompt alone 6 + 18 + 12 = 36: over
    ])
    val = _preference_file(tmp_path / "val.parquet", [
        ("V?", "#### 1", "#### 2"),  # 27: within
        ("V?", "#### 1", "this one is far too long #### 2"),  # 20 + 31 + 1 = 52: over
    ])
    return train, val


def _long_pairs_overrides(tiny, train, val, out, *extra):
    return ["trainer.device=cpu", "trainer.n_gpus_per_node=1", f"reward_model.train.model.path={tiny}",
            f"reward_model.train.train_files={train}", f"reward_model.train.val_files={val}",
            "reward_model.train.train_batch_size=2", "reward_model.train.micro_batch_size_per_gpu=1",
            "reward_model.train.max_length=30", f"reward_model.train.default_local_dir={out}", *extra]


def test_overlong_drop_leaves_out_the_pairs_with_a_side_over_max_length(tiny, tmp_path, capsys):
    from rlhf_core.training.reward_trainer import preflight

    train, val = _long_pairs(tmp_path)
    base = _long_pairs_overrides(tiny, train, val, tmp_path / "out")
    prepared = preflight(load_config([*base, "reward_model.train.overlong=drop"]))
    decode = prepared.tokenizer.decode
    # rows 0 and 3 of train and row 0 of val are kept, whole
    assert [(decode(c), decode(r)) for c, r in prepared.train] == [
        ("User: Q?\nAssistant: #### 7</s>", "User: Q?\nAssistant: #### 8</s>"),
        ("User: Q?\nAssistant: ok #### 7</s>", "User: Q?\nAssistant: no #### 8</s>")]
    assert [(decode(c), decode(r)) for c, r in prepared.val] == [
        ("User: V?\nAssistant: #### 1</s>", "User: V?\nAssistant: #### 2</s>")]
    assert prepared.over_length == {"train": 4, "val": 1}
    err = capsys.readouterr().err
    assert "notice: 4 of 6 training pairs and 1 of 2 held-out pairs are over reward_model.train.max_length=30 on a " \
           "side (reward_model.train.overlong=drop): left out of training and validation" in err
    assert err.count("max_length") == 1  # one line says it

    # truncate (the default) keeps every pair, the same ones counted, each side at most 30 tokens
    prepared = preflight(load_config(base))
    assert len(prepared.train) == 6 and len(prepared.val) == 2
    assert max(len(ids) for pair in prepared.train + prepared.val for ids in pair) == 30
    assert prepared.over_length == {"train": 4, "val": 1}
    # train rows 1, 2, 4, 5 lose prompt tokens only on both sides (8 sequences), and val row 1's sides lose the
    # whole prompt (52 - 30 = 22 > 20), its long side 2 response tokens too: 9 prompt-only, 1 into the response
    err = capsys.readouterr().err
    assert "notice: 4 of 6 training pairs and 1 of 2 held-out pairs are over reward_model.train.max_length=30 on a " \
           "side (reward_model.train.overlong=truncate): cut to one prompt window (the same prompt tokens on both " \
           "sides); of their sequences, 9 lost prompt tokens from the left; 1 lost their whole prompt and the " \
           "start of their response" in err
    assert err.count("max_length") == 1


def test_overlong_counts_reach_the_metrics_and_the_summary(tiny, tmp_path):
    from rlhf_core.training.reward_trainer import train_reward_model

    train, val = _long_pairs(tmp_path)
    logged = []
    export, summary = train_reward_model(load_config(_long_pairs_overrides(
        tiny, train, val, tmp_path / "out", "reward_model.train.overlong=drop")),
        lambda metrics, step: logged.append((step, metrics)))
    assert (export / "config.json").is_file()
    assert summary["train/pairs_over_max_length"] == 4 and summary["val/pairs_over_max_length"] == 1
    # 2 pairs kept at 2 a step: one step, which logs the counts, then the held-out metrics over the 1 pair kept
    (step, first), *rest = logged
    assert step == 1 and first["train/pairs_over_max_length"] == 4 and first["val/pairs_over_max_length"] == 1
    assert all("train/pairs_over_max_length" not in metrics for _, metrics in rest)
    # validated over that one pair: its two sides scored here by the exported model, each alone in float64; its
    # two scores are the extremes, and the loss is that of its margin alone
    import torch
    from transformers import AutoModelForSequenceClassification

    from rlhf_core.training.reward_trainer import preflight

    (chosen_ids, rejected_ids), = preflight(load_config(_long_pairs_overrides(
        tiny, train, val, tmp_path / "again", "reward_model.train.overlong=drop"))).val
    scorer = AutoModelForSequenceClassification.from_pretrained(export).double().eval()
    with torch.no_grad():
        chosen, rejected = (float(scorer(input_ids=torch.tensor([list(ids)])).logits[0, 0])
                            for ids in (chosen_ids, rejected_ids))
    assert summary["val/chosen_score_mean"] == pytest.approx(chosen, abs=1e-5)
    assert summary["val/rejected_score_mean"] == pytest.approx(rejected, abs=1e-5)
    assert [summary["val/score_min"], summary["val/score_max"]] == pytest.approx(sorted([chosen, rejected]), abs=1e-5)
    assert summary["val/loss"] == pytest.approx(math.log1p(math.exp(rejected - chosen)), abs=1e-5)


def test_overlong_drop_of_every_pair_fails_before_training(tiny, tmp_path):
    from rlhf_core.training.reward_trainer import RewardTrainingError, preflight

    train = _preference_file(tmp_path / "train.parquet", [("Q?", "a long answer: #### 7", "#### 8"),  # 42
                                                            ("A longer question?", "#### 1", "#### 2")])  # 36 + 7 = 43
    base = _long_pairs_overrides(tiny, train, "null", tmp_path / "out", "reward_model.train.train_batch_size=1")
    with pytest.raises(RewardTrainingError) as info:
        preflight(load_config([*base, "reward_model.train.overlong=drop"]))
    assert ("reward_model.train.train_files: every pair is left out: 2 of 2 are over reward_model.train.max_length=30 "
            "on a side, which reward_model.train.overlong=drop leaves out (their longer sides run from 42 to 43 "
            "tokens): raise max_length to at least 42") in str(info.value)
    assert "reward_model.train.overlong=truncate" in str(info.value)
    assert len(preflight(load_config(base)).train) == 2  # cut, both kept
    with pytest.raises(ConfigError, match=r"reward_model.train.overlong='cut' is not one of truncate, drop"):
        load_config([*base, "reward_model.train.overlong=cut"])


def test_preflight_refuses_shared_prompts_and_an_empty_validation_file(tiny, tmp_path, capsys):
    train = _preference_file(tmp_path / "train.parquet", [("Q1", "a", "b"), ("Q2", "c", "d")])
    shared = _preference_file(tmp_path / "shared.parquet", [("Q2", "e", "f")])
    empty = _preference_file(tmp_path / "empty.parquet", [("Q3", "g", "h")])
    pd.read_parquet(empty).iloc[:0].to_parquet(empty)
    base = ["trainer.device=cpu", "trainer.n_gpus_per_node=1", f"reward_model.train.model.path={tiny}",
            f"reward_model.train.train_files={train}", "reward_model.train.train_batch_size=2",
            "reward_model.train.micro_batch_size_per_gpu=1", f"reward_model.train.default_local_dir={tmp_path / 'out'}"]
    assert train_rm([*base, f"reward_model.train.val_files={shared}"]) == 2  # bad input, as PPO's data
    assert "1 prompt(s) have pairs in both the training and the validation files" in capsys.readouterr().err
    assert train_rm([*base, f"reward_model.train.val_files={empty}"]) == 2  # bad input, as PPO's data
    assert f"the validation file(s) {empty} hold no pair" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_preflight_names_training_files_without_a_pair(tiny, tmp_path, capsys):
    """Training files without a row are at fault, not the batch size, which no pair fits: the refusal names them (as
    PPO's names prompt files without rows), where it said to lower the batch size below 1."""
    empty = [_preference_file(tmp_path / f"empty{i}.parquet", [("Q3", "g", "h")]) for i in range(2)]
    for path in empty:
        pd.read_parquet(path).iloc[:0].to_parquet(path)
    base = ["trainer.device=cpu", "trainer.n_gpus_per_node=1", f"reward_model.train.model.path={tiny}",
            "reward_model.train.val_files=null", "reward_model.train.train_batch_size=2",
            "reward_model.train.micro_batch_size_per_gpu=1", f"reward_model.train.default_local_dir={tmp_path / 'out'}"]
    assert train_rm([*base, f"reward_model.train.train_files={empty[0]}"]) == 2  # bad input, as PPO's data
    err = capsys.readouterr().err
    assert f"reward_model.train.train_files: {empty[0]} has no rows; give files with preference pairs" in err
    assert "lower the batch size" not in err
    assert train_rm([*base, f"reward_model.train.train_files=[{empty[0]},{empty[1]}]"]) == 2
    assert f"reward_model.train.train_files: {empty[0]}, {empty[1]} have no rows" in capsys.readouterr().err
    assert train_rm([*base, "reward_model.train.train_files=[]"]) == 2
    assert ("reward_model.train.train_files names no file: give the preference parquet file(s) to train on"
            in capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_preflight_names_the_key_of_a_file_whose_pair_has_the_same_text_twice(tiny, tmp_path, capsys):
    """As every other error about a preference file, it starts with the key that named the file."""
    train = _preference_file(tmp_path / "train.parquet", [("Q1", "a", "b"), ("Q2", "c", "c")])
    val = _preference_file(tmp_path / "val.parquet", [("Q3", "e", "f")])
    assert train_rm(["trainer.device=cpu", "trainer.n_gpus_per_node=1", f"reward_model.train.model.path={tiny}",
                     f"reward_model.train.train_files={train}", f"reward_model.train.val_files={val}",
                     "reward_model.train.train_batch_size=2", "reward_model.train.micro_batch_size_per_gpu=1",
                     f"reward_model.train.default_local_dir={tmp_path / 'out'}"]) == 2  # bad input, as PPO's data
    assert (f"reward_model.train.train_files: {train}: chosen and rejected are the same text in row(s) 1; "
            "such a pair teaches nothing, drop it") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_preflight_refuses_prompt_roles_outside_the_chat_format(tiny, tmp_path):
    """ShareGPT's human/gpt turns were encoded as the chat template writes an unknown role (as text, or not at all):
    the reward model trained on prompts the PPO policy never shows it."""
    from rlhf_core.data.preference import PreferenceDataError
    from rlhf_core.training.reward_trainer import preflight

    train = _preference_file(tmp_path / "train.parquet", [("Q1", "a", "b"), ("Q2", "c", "d"), ("Q3", "e", "f")])
    frame = pd.read_parquet(train)
    frame.at[2, "prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "human", "content": "Q3"}]
    frame.to_parquet(train)
    base = ["trainer.device=cpu", "trainer.n_gpus_per_node=1", f"reward_model.train.model.path={tiny}",
            f"reward_model.train.train_files={train}", "reward_model.train.val_files=null",
            "reward_model.train.train_batch_size=1", "reward_model.train.micro_batch_size_per_gpu=1",
            f"reward_model.train.default_local_dir={tmp_path / 'out'}"]
    with pytest.raises(PreferenceDataError) as error:
        preflight(load_config(base))
    assert str(error.value) == (
        f"reward_model.train.train_files: {train}: 1 prompt(s) have message roles outside the chat format (human), "
        "which a chat template writes as text or drops: row 2 (human); rename human -> user (the chat format's "
        "roles: system, developer, user, assistant, tool, function, ipython)")
    frame.at[2, "prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q3"}]
    frame.to_parquet(train)
    assert len(preflight(load_config(base)).train) == 3


THINK_TEMPLATE = TOY_TEMPLATE.replace(
    "{% if add_generation_prompt %}Assistant: {% endif %}",
    "{% if add_generation_prompt %}Assistant: {% if enable_thinking is defined and not enable_thinking %}"
    "<nothink>{% endif %}{% endif %}")


def test_pairs_are_encoded_with_the_chat_template_kwargs_and_the_export_records_them(tiny, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from rlhf_core.training.reward_trainer import preflight

    model = tmp_path / "think"  # the tiny model, its template switching on enable_thinking
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model / name).write_bytes((tiny / name).read_bytes())
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    tokenizer.chat_template = THINK_TEMPLATE
    tokenizer.save_pretrained(model)
    train = _preference_file(tmp_path / "train.parquet", [("Q?", "#### 7", "#### 8")])
    base = ["trainer.device=cpu", "trainer.n_gpus_per_node=1", f"reward_model.train.model.path={model}",
            f"reward_model.train.train_files={train}", "reward_model.train.val_files=null",
            "reward_model.train.train_batch_size=1", "reward_model.train.micro_batch_size_per_gpu=1",
            "reward_model.train.total_training_steps=1", f"reward_model.train.default_local_dir={tmp_path / 'out'}"]
    # the policy's keywords unless set
    cfg = load_config([*base, "data.apply_chat_template_kwargs={enable_thinking: false}"])
    assert cfg.reward_model.train.apply_chat_template_kwargs == {"enable_thinking": False}
    chosen, rejected = preflight(cfg).train[0]
    assert tokenizer.decode(chosen) == "User: Q?\nAssistant: <nothink>#### 7</s>"
    own = load_config([*base, "data.apply_chat_template_kwargs={enable_thinking: false}",
                       "reward_model.train.apply_chat_template_kwargs={}"])
    assert tokenizer.decode(preflight(own).train[0][0]) == "User: Q?\nAssistant: #### 7</s>"
    with pytest.raises(ConfigError, match="set it whole"):  # an entry would land in data.apply_chat_template_kwargs
        load_config([*base, "+reward_model.train.apply_chat_template_kwargs.enable_thinking=false"])
    assert train_rm([*base, "data.apply_chat_template_kwargs={enable_thinking: false}"]) == 0
    exported = AutoConfig.from_pretrained(tmp_path / "out" / "huggingface")
    assert exported.chat_template_kwargs == {"enable_thinking": False}
    # a resume with other keywords would train on other ids: refused, the entry added being compared
    with pytest.raises(ValueError, match="apply_chat_template_kwargs"):
        RewardModelTrainer(load_config([*base, "reward_model.train.total_training_steps=2"])).resume()


# ----------------------------------------------------------------------------- the command


def test_cli_trains_exports_and_logs(tiny, pairs_dir, tmp_path):
    out = tmp_path / "rm"
    assert train_rm(_overrides(tiny, pairs_dir, out, "reward_model.train.total_epochs=2",
                           "reward_model.train.test_freq=2")) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if "train/loss" in r]
    assert train_steps == [1, 2, 3, 4, 5, 6]  # 24 pairs / 8 per step * 2 epochs
    assert {"train/pair_accuracy", "train/margin_mean", "train/chosen_score_mean", "train/rejected_score_mean",
            "train/score_mean", "train/score_std", "train/score_min", "train/score_max", "train/grad_norm",
            "train/lr"} <= set(records[0])
    val = [r for r in records if "val/pair_accuracy" in r]
    assert [r["step"] for r in val] == [2, 4, 6]
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "6"

    export = out / "huggingface"
    loaded = AutoModelForSequenceClassification.from_pretrained(export).eval()
    tokenizer = load_tokenizer(export)
    assert loaded.config.num_labels == 1 and loaded.config.pad_token_id == tokenizer.pad_token_id
    # the exported model reproduces the last validation: recompute loss and accuracy over the val pairs
    frame = pd.read_parquet(pairs_dir / "val.parquet")
    deltas, scores = [], []
    with torch.no_grad():
        for prompt, chosen, rejected in zip(frame["prompt"], frame["chosen"], frame["rejected"]):
            messages = [dict(m) for m in prompt]
            ids = [encode_response(tokenizer, messages, text, 1024)[0] for text in (chosen, rejected)]
            r = [float(loaded(input_ids=torch.tensor([i])).logits[0, 0]) for i in ids]
            deltas.append(r[0] - r[1])
            scores += r
    loss = sum(math.log1p(math.exp(-d)) for d in deltas) / len(deltas)
    assert val[-1]["val/loss"] == pytest.approx(loss, abs=1e-5)
    assert val[-1]["val/pair_accuracy"] == pytest.approx(sum(d > 0 for d in deltas) / len(deltas))
    assert val[-1]["val/margin_mean"] == pytest.approx(sum(deltas) / len(deltas), abs=1e-5)
    # the scores' scale over both val micro-batches (4 + 4 pairs), in float64 here
    mean = sum(scores) / len(scores)
    expected = {"val/chosen_score_mean": sum(scores[::2]) / len(deltas),
                "val/rejected_score_mean": sum(scores[1::2]) / len(deltas), "val/score_mean": mean,
                "val/score_std": math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores)),
                "val/score_min": min(scores), "val/score_max": max(scores)}
    assert {name: val[-1][name] for name in expected} == pytest.approx(expected, abs=1e-5)


def test_ctrl_c_while_the_run_resumes_stops_it_at_its_checkpoint(tiny, pairs_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C while the checkpoint is verified and loaded: the run stops before its next step, exit 130 naming the
    checkpoint it resumed (it raised KeyboardInterrupt through a traceback once the resume moved ahead of the
    signal handlers)."""
    out, args = tmp_path / "rm", _overrides(tiny, pairs_dir, tmp_path / "rm")
    assert train_rm([*args, "reward_model.train.total_training_steps=1"]) == 0
    resume = RewardModelTrainer.resume

    def resume_under_a_signal(self):
        signal.raise_signal(signal.SIGINT)
        return resume(self)

    monkeypatch.setattr(RewardModelTrainer, "resume", resume_under_a_signal)
    assert train_rm(args) == 130
    err = capsys.readouterr().err
    assert "received SIGINT" in err
    assert f"interrupted by SIGINT after step 1: checkpoint saved at {out / 'global_step_1'}" in err
    assert ckpt.latest_checkpoint(out) == out / "global_step_1"


def test_ctrl_c_as_a_resume_path_run_loads_names_the_checkpoint_it_goes_back_to(tiny, pairs_dir, tmp_path,
                                                                                 monkeypatch, capsys):
    """A run sent back to step 1 of a folder at step 2, stopped at once (save_on_interrupt=false) as it loads
    the checkpoint: a rerun of the same command loads step 1 again (auto would take step 2, which it set out to
    leave)."""
    out, args = tmp_path / "rm", _overrides(tiny, pairs_dir, tmp_path / "rm", "reward_model.train.save_freq=1")
    assert train_rm([*args, "reward_model.train.total_training_steps=2"]) == 0
    assert ckpt.latest_checkpoint(out) == out / "global_step_2"

    def resume_under_a_signal(self):  # Python's handler's KeyboardInterrupt (raised as such: a run in the
        raise KeyboardInterrupt          # background has SIGINT ignored)

    monkeypatch.setattr(RewardModelTrainer, "resume", resume_under_a_signal)
    capsys.readouterr()
    back = [*args, "reward_model.train.resume_mode=resume_path", f"reward_model.train.resume_from_path={out}/global_step_1",
            "trainer.save_on_interrupt=false"]
    assert train_rm(back) == 130
    assert (f"the latest checkpoint {out / 'global_step_1'} is as it was: rerun the same command to resume from "
            "it") in capsys.readouterr().err


def test_ctrl_c_saves_the_step_and_the_same_command_resumes(tiny, pairs_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C during step 3 of 6: the step is finished and saved, the command exits 130 naming the checkpoint,
    and the same command again resumes there and trains steps 4 to 6 (the weights those of a run never
    stopped). A second signal stops at once without saving, naming the checkpoint left."""
    out, args = tmp_path / "rm", _overrides(tiny, pairs_dir, tmp_path / "rm", "reward_model.train.total_epochs=2")
    straight = _trained_weights(load_config(_overrides(tiny, pairs_dir, tmp_path / "straight",
                                                       "reward_model.train.total_epochs=2")))
    train_step = RewardModelTrainer.train_step

    def signalled(in_step: int, *signals: signal.Signals) -> None:
        """Train with ``signals`` raised as step ``in_step``'s training starts (Ctrl-C, kill); plain with none."""
        def step(self):
            if self.global_step == in_step - 1:
                for sig in signals:
                    signal.raise_signal(sig)
            return train_step(self)

        monkeypatch.setattr(RewardModelTrainer, "train_step", step if signals else train_step)

    signalled(3, signal.SIGINT)
    assert train_rm(args) == 130
    err = capsys.readouterr().err
    assert "received SIGINT: finishing step 3" in err
    assert f"interrupted by SIGINT after step 3: checkpoint saved at {out / 'global_step_3'}; rerun the same " \
        "command to resume" in err
    assert ckpt.latest_checkpoint(out) == out / "global_step_3" and not (out / "huggingface").exists()

    signalled(0)
    assert train_rm(args) == 0
    assert f"resumed the reward model from {out / 'global_step_3'} (step 3" in capsys.readouterr().err
    exported = AutoModelForSequenceClassification.from_pretrained(out / "huggingface").state_dict()
    assert exported.keys() == straight.keys()
    assert all(torch.equal(exported[k], v) for k, v in straight.items())

    signalled(7, signal.SIGTERM, signal.SIGTERM)  # the run extended to 9 steps
    assert train_rm([*args, "reward_model.train.total_epochs=3"]) == 143
    assert (f"second SIGTERM: stopped now without saving; the latest checkpoint {out / 'global_step_6'} is as it "
            "was") in capsys.readouterr().err
    assert ckpt.latest_checkpoint(out) == out / "global_step_6"

    # a new run in the folder (resume_mode=disable), stopped before its first save: a rerun must not resume the
    # earlier run's step 6 as if it were this one's, so the marker went as it started
    signalled(1, signal.SIGINT, signal.SIGINT)
    assert train_rm([*args, "reward_model.train.resume_mode=disable"]) == 130
    assert "notice: reward_model.train.resume_mode=disable starts a new run in" in capsys.readouterr().err
    signalled(0)
    assert train_rm(args) == 2
    assert "holds checkpoints (global_step_3, global_step_6) but no latest_checkpointed_iteration.txt" \
        in capsys.readouterr().err
    # stopped in step 2 of a new run (disable): the same command would start afresh again, so the message says
    # how to resume; a signal in the last step lets the run finish (validated, exported)
    signalled(2, signal.SIGINT)
    assert train_rm([*args, "reward_model.train.resume_mode=disable"]) == 130
    assert (f"checkpoint saved at {out / 'global_step_2'}; rerun with reward_model.train.resume_mode=auto to "
            "resume") in capsys.readouterr().err
    shutil.rmtree(out / "huggingface")  # (the first run's export)
    signalled(6, signal.SIGTERM)
    assert train_rm(args) == 0
    assert f"resumed the reward model from {out / 'global_step_2'}" in capsys.readouterr().err
    assert ckpt.latest_checkpoint(out) == out / "global_step_6" and (out / "huggingface" / "config.json").is_file()


def test_a_resumed_reward_model_run_holds_each_step_once_in_its_metrics(tiny, pairs_dir, tmp_path, monkeypatch,
                                                                        capsys):
    """Saved at step 2, step 3 logged, then stopped at once as step 4 starts (a second SIGTERM: no save): the
    resume from step 2 logs step 3 again. metrics.jsonl holds steps 1 to 6 once each; the stopped run's step 3
    is beside it."""
    out = tmp_path / "rm"
    args = _overrides(tiny, pairs_dir, out, "reward_model.train.total_epochs=2", "reward_model.train.save_freq=2",
                      "reward_model.train.test_freq=-1")
    train_step = RewardModelTrainer.train_step

    def killed_in_step_4(self):
        if self.global_step == 3:
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)
        return train_step(self)

    monkeypatch.setattr(RewardModelTrainer, "train_step", killed_in_step_4)
    assert train_rm(args) == 143
    assert ckpt.latest_checkpoint(out) == out / "global_step_2"
    stopped = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in stopped] == [1, 2, 3]
    capsys.readouterr()

    monkeypatch.setattr(RewardModelTrainer, "train_step", train_step)
    assert train_rm(args) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3, 4, 5, 6]  # 24 pairs, 8 a step
    assert (out / "metrics.jsonl").read_text().splitlines()[:2] == stopped[:2]
    assert (out / "metrics.jsonl.before_resume_from_step_2").read_text() == stopped[2] + "\n"
    assert (f"notice: resumed from step 2: {out / 'metrics.jsonl'} held 1 line(s) logged after that checkpoint by "
            "the run that stopped (step 3); moved to metrics.jsonl.before_resume_from_step_2 beside it") \
        in capsys.readouterr().err


def test_a_checkpoint_older_than_a_key_compares_as_the_key_then_was(tiny, pairs_dir, tmp_path):
    """A checkpoint written before reward_model.train.disable_dropout (and overlong) existed trained with its
    dropout on (and cut long pairs): for a model with dropout, resumed under the default disable_dropout=true it is
    refused, saying what the run ran as and the override that resumes it; with the key false (and long pairs cut)
    it resumes. For a model without dropout (the toy's rates are all 0) the key changes nothing: it resumes."""
    dropping = tmp_path / "dropping"
    shutil.copytree(tiny, dropping)
    config = json.loads((dropping / "config.json").read_text())
    (dropping / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    old = tmp_path / "global_step_2"
    old.mkdir()
    trainer = RewardModelTrainer(load_config(_overrides(dropping, pairs_dir, tmp_path)))
    tree = yaml.safe_load(trainer.cfg.to_yaml())  # as a checkpoint saves it
    del tree["reward_model"]["train"]["disable_dropout"], tree["reward_model"]["train"]["overlong"]
    (old / ckpt.CONFIG_FILE).write_text(yaml.safe_dump(tree))
    with pytest.raises(ckpt.CheckpointError) as refused:
        trainer._check_config(old)
    assert ("(reward_model.train.disable_dropout: True now (not in the checkpoint, which predates the key: it ran "
            "as False; reward_model.train.disable_dropout=false resumes it));") in str(refused.value)
    as_then = _overrides(dropping, pairs_dir, tmp_path, "reward_model.train.disable_dropout=false")
    RewardModelTrainer(load_config(as_then))._check_config(old)
    with pytest.raises(ckpt.CheckpointError) as refused:
        RewardModelTrainer(load_config([*as_then, "reward_model.train.overlong=drop"]))._check_config(old)
    assert ("(reward_model.train.overlong: 'drop' now (not in the checkpoint, which predates the key: it ran as "
            "'truncate'; reward_model.train.overlong=truncate resumes it));") in str(refused.value)
    # the same checkpoint of the toy without dropout resumes under the default
    tree["reward_model"]["train"]["model"]["path"] = str(tiny)
    (old / ckpt.CONFIG_FILE).write_text(yaml.safe_dump(tree))
    RewardModelTrainer(load_config(_overrides(tiny, pairs_dir, tmp_path)))._check_config(old)


def _trained_weights(cfg) -> dict[str, torch.Tensor]:
    trainer = RewardModelTrainer(cfg)
    trainer.fit()
    return {k: v.clone() for k, v in trainer.worker.module.state_dict().items()}


def test_resume_is_exact(tiny, pairs_dir, tmp_path):
    straight = _trained_weights(load_config(_overrides(tiny, pairs_dir, tmp_path / "a",
                                                       "reward_model.train.total_epochs=2")))
    half = load_config(_overrides(tiny, pairs_dir, tmp_path / "b", "reward_model.train.total_epochs=2",
                                  "reward_model.train.total_training_steps=4"))
    at_four = _trained_weights(half)  # stops after 4 of 6 steps, saved
    resumed = RewardModelTrainer(load_config(_overrides(tiny, pairs_dir, tmp_path / "b",
                                                        "reward_model.train.total_epochs=2")))
    # training from scratch again would end on the same weights (it is deterministic), so check that the
    # interrupted run's state came back and that only the two missing steps ran
    resumed.resume()
    assert resumed.global_step == 4
    assert all(torch.equal(v, at_four[k]) for k, v in resumed.worker.module.state_dict().items())
    trained = []
    resumed.fit(lambda metrics, step: trained.append(step) if "train/loss" in metrics else None)
    assert trained == [5, 6]
    assert resumed.global_step == 6
    weights = resumed.worker.module.state_dict()
    assert weights.keys() == straight.keys()
    assert all(torch.equal(weights[k], straight[k]) for k in straight)
    # an interrupted run with another learning rate must not resume silently
    with pytest.raises(ValueError, match="optim.lr"):
        RewardModelTrainer(load_config(_overrides(tiny, pairs_dir, tmp_path / "b",
                                                  "reward_model.train.optim.lr=5e-4"))).resume()
    # nor with long pairs now left out (or cut) where the checkpoint's run cut them (or left them out)
    with pytest.raises(ValueError, match="reward_model.train.overlong: 'truncate' in the checkpoint, 'drop' now"):
        RewardModelTrainer(load_config(_overrides(tiny, pairs_dir, tmp_path / "b",
                                                  "reward_model.train.overlong=drop"))).resume()
    # a checkpoint file damaged in place (its size kept) is refused before it loads, naming the file
    latest = ckpt.latest_checkpoint(tmp_path / "b")
    weights = next(p for p in (latest / "reward_model").rglob("*.pt") if p.stat().st_size > 64)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=f"checkpoint {latest} is corrupt: .*{weights.name}") as info:
        RewardModelTrainer(load_config(_overrides(tiny, pairs_dir, tmp_path / "b",
                                                  "reward_model.train.total_epochs=2"))).resume()
    # ... and the refusal names the intact one before it, with the reward model's own resume keys
    assert str(info.value).endswith(
        f"The newest earlier checkpoint that is intact is {tmp_path / 'b' / 'global_step_4'}: to resume from it, run "
        f"with reward_model.train.resume_mode=resume_path reward_model.train.resume_from_path="
        f"{tmp_path / 'b' / 'global_step_4'}")
    # one run at a time trains into a folder
    with ckpt.run_lock(tmp_path / "b"), pytest.raises(ckpt.CheckpointError, match="is in use by another run"):
        RewardModelTrainer(load_config(_overrides(tiny, pairs_dir, tmp_path / "b",
                                                  "reward_model.train.total_epochs=2"))).fit()
    # checkpoints without the marker naming the latest: auto refuses to start a new run over them
    (tmp_path / "b" / ckpt.LATEST_FILE).unlink()
    with pytest.raises(ckpt.CheckpointError) as info:
        RewardModelTrainer(load_config(_overrides(tiny, pairs_dir, tmp_path / "b",
                                                  "reward_model.train.total_epochs=2"))).resume()
    assert f"{tmp_path / 'b'} holds checkpoints (" in str(info.value)
    assert (f"reward_model.train.resume_mode=resume_path reward_model.train.resume_from_path="
            f"{tmp_path / 'b' / 'global_step_4'}") in str(info.value)
    assert "reward_model.train.resume_mode=disable" in str(info.value)


def test_a_resume_on_another_number_of_pairs_is_refused_and_on_other_pairs_as_many_is_told(tiny, tmp_path, capsys):
    """Each step's pairs follow from the step over the training pairs in their order. One pair fewer since the
    checkpoint: the saved place in the epoch is no place of the saved run's, so the resume is refused before anything
    loads (exit 2, bad input), naming both counts. As many pairs with one text edited, or reordered: one notice, and
    the resume goes on (as PPO's resume treats its prompts); the same pairs written again resume without a word. A
    checkpoint saved before it recorded the pairs is not checked."""
    import hashlib

    train, val = synthetic_pairs(24, 8, seed=0)
    data, out = tmp_path / "pairs", tmp_path / "out"
    write_splits(data, train, val, DATA_SOURCE)
    RewardModelTrainer(load_config(_overrides(tiny, data, out, "reward_model.train.total_training_steps=2"))).fit()
    saved = out / "global_step_2"
    state = json.loads((saved / ckpt.TRAINER_STATE).read_text())
    assert state["train_pairs"] == len(train) == 24
    write_splits(data, train[1:], val, DATA_SOURCE, overwrite=True)
    assert train_rm(_overrides(tiny, data, out)) == 2
    err = capsys.readouterr().err
    assert (f"cannot resume from {saved}: its run trained on 24 pairs, reward_model.train.train_files hold 23 now"
            in err)
    assert "start afresh with reward_model.train.resume_mode=disable" in err
    edited = [dict(pair) for pair in train]
    edited[0]["chosen"] += " indeed"
    for pairs in (edited, train[::-1]):
        write_splits(data, pairs, val, DATA_SOURCE, overwrite=True)
        told = RewardModelTrainer(load_config(_overrides(tiny, data, out)))
        told.resume()
        assert told.global_step == 2
        err = capsys.readouterr().err
        assert err.count("notice: resuming from") == 1
        assert (f"notice: resuming from {saved} on other training pairs than its run's (24 pairs both times, their "
                "token ids not the same: reward_model.train.train_files changed since") in err
    assert ckpt.latest_checkpoint(out) == saved and not (out / "global_step_3").exists()
    write_splits(data, train, val, DATA_SOURCE, overwrite=True)
    resumed = RewardModelTrainer(load_config(_overrides(tiny, data, out)))
    resumed.resume()
    assert resumed.global_step == 2
    assert "notice: resuming from" not in capsys.readouterr().err
    # trainer_state.json as a checkpoint saved without the record holds it (its manifest to match): not checked
    del state["train_pairs"], state["train_pairs_sha256"]
    (saved / ckpt.TRAINER_STATE).write_text(json.dumps(state, indent=1))
    manifest = json.loads((saved / "manifest.json").read_text())
    manifest["files"][ckpt.TRAINER_STATE] = len((saved / ckpt.TRAINER_STATE).read_bytes())
    manifest["sha256"][ckpt.TRAINER_STATE] = hashlib.sha256((saved / ckpt.TRAINER_STATE).read_bytes()).hexdigest()
    (saved / "manifest.json").write_text(json.dumps(manifest, indent=1))
    write_splits(data, edited, val, DATA_SOURCE, overwrite=True)
    older = RewardModelTrainer(load_config(_overrides(tiny, data, out)))
    older.resume()
    assert older.global_step == 2
    assert "notice: resuming from" not in capsys.readouterr().err


def test_learns_the_demo_preference(tiny, pairs_dir, tmp_path):
    """24 pairs in one batch, 48 steps: the tiny random model learns to rank its training pairs (above chance).

    In batches of 8 this model's trajectory is chaotic: at lr 1e-3 over 16 epochs, runs that differ only in
    the first warm-up step's rate or in the model's seed ended anywhere from 0.68 to 0.99 of the starting loss.
    With the whole set in each step, at lr 3e-3, three model seeds ended at 0.21-0.49 of it with 20-23 of 24
    pairs ranked right."""
    cfg = load_config(_overrides(tiny, pairs_dir, tmp_path / "learn", "reward_model.train.total_epochs=48",
                                 "reward_model.train.train_batch_size=24", "reward_model.train.micro_batch_size_per_gpu=12",
                                 "reward_model.train.optim.lr=3e-3", "reward_model.train.val_files=null"))
    trainer = RewardModelTrainer(cfg)
    before = trainer.worker.evaluate(trainer.train_pairs, [1.0] * 24)
    trainer.fit()
    after = trainer.worker.evaluate(trainer.train_pairs, [1.0] * 24)
    assert after["loss"] < before["loss"] * 0.8
    assert after["correct"] / after["pairs"] >= 0.75


def test_lora_trains_adapters_and_head_and_exports_merged(tiny, pairs_dir, tmp_path):
    out = tmp_path / "lora"
    cfg = load_config(_overrides(tiny, pairs_dir, out, "reward_model.train.model.lora_rank=4",
                                 "reward_model.train.model.lora_alpha=8", "reward_model.train.optim.lr=1e-2"))
    trainer = RewardModelTrainer(cfg)
    trainable = {n for n, p in trainer.worker.module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "score" in n for n in trainable)
    assert any("score" in n for n in trainable)
    trainer.fit()
    loaded = AutoModelForSequenceClassification.from_pretrained(out / "huggingface").eval()
    ids = collate(trainer.val_pairs[:4], trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        mine = sequence_scores(trainer.worker.forward_module, ids["input_ids"], ids["attention_mask"])
        theirs = sequence_scores(loaded, ids["input_ids"], ids["attention_mask"])
    assert torch.allclose(mine, theirs, atol=1e-5)
    # the adapters moved away from B = 0, so the merge is not the base model
    assert any(p.abs().sum() > 0 for n, p in trainer.worker.module.named_parameters() if "lora_B" in n)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_reward_model_with_gradient_checkpointing_starts_without_a_deprecation_warning(tiny, lora_rank):
    # transformers 5 warns (FutureWarning) at each call of its deprecated gradient_checkpointing_enable: every
    # reward-model run with checkpointing on started with a warning about the library's call, not the run
    import warnings

    cfg = load_config(["trainer.device=cpu", f"reward_model.train.model.path={tiny}",
                       "reward_model.train.model.enable_gradient_checkpointing=true",
                       f"reward_model.train.model.lora_rank={lora_rank}"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker = RewardModelWorker(cfg.reward_model.train, load_tokenizer(tiny).pad_token_id, total_steps=1)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)
            and "is deprecated" in str(w.message)] == []
    # and the layers do recompute their activations: every decoder layer has checkpointing on
    layers = worker.forward_module.model.layers
    assert len(layers) == 1 and all(layer.gradient_checkpointing for layer in layers)


# ----------------------------------------------------------------------------- dropout

#: the base configs' dropout rates: the toy Llama's attention dropout (a float its attention passes to sdpa),
#: GPT-2's dropout modules (embeddings, attention weights, residuals)
DROPOUT_RATES = {"llama": {"attention_dropout": 0.5},
                 "gpt2": {"resid_pdrop": 0.5, "embd_pdrop": 0.5, "attn_pdrop": 0.5}}


@pytest.fixture(scope="module")
def dropout_models(tiny, tmp_path_factory):
    """The tiny toy Llama and a tiny GPT-2 with its tokenizer, each with dropout 0.5."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("dropout")
    llama = root / "llama"
    shutil.copytree(tiny, llama)
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, **DROPOUT_RATES["llama"]}))
    gpt2 = root / "gpt2"
    shutil.copytree(tiny, gpt2)  # for its tokenizer files
    for weights in gpt2.glob("*.safetensors"):
        weights.unlink()
    tokenizer = load_tokenizer(tiny)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=128, n_embd=32, n_layer=1, n_head=2,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                               **DROPOUT_RATES["gpt2"])).save_pretrained(gpt2)
    return {"llama": llama, "gpt2": gpt2}


def _dropout_worker(model, disable_dropout: bool) -> RewardModelWorker:
    cfg = load_config(["trainer.device=cpu", f"reward_model.train.model.path={model}",
                       f"reward_model.train.disable_dropout={str(disable_dropout).lower()}"])
    return RewardModelWorker(cfg.reward_model.train, load_tokenizer(model).pad_token_id, total_steps=1)


def _dropout_pairs(model) -> list[tuple[list[int], list[int]]]:
    tokenizer = load_tokenizer(model)
    texts = [("User: 2+3?\nAssistant: 5", "User: 2+3?\nAssistant: 6 apples"),
             ("User: 4*2?\nAssistant: It is 8", "User: 4*2?\nAssistant: 9"),
             ("User: 9-1?\nAssistant: 8", "User: 9-1?\nAssistant: 7")]
    return [tuple(tokenizer.encode(text) + [tokenizer.eos_token_id] for text in pair) for pair in texts]


def test_disable_dropout_zeroes_every_rate_and_returns_the_base_ones():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.2,
                        classifier_dropout=0.4, num_labels=1)
    model = BertForSequenceClassification(config)
    assert model.classifier is not None and model.dropout.p == 0.4  # the head's own dropout module
    base = disable_dropout(model)
    assert base == {"hidden_dropout_prob": 0.3, "attention_probs_dropout_prob": 0.2, "classifier_dropout": 0.4}
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(dropouts) >= 4 and all(m.p == 0.0 for m in dropouts)
    assert (model.config.hidden_dropout_prob, model.config.attention_probs_dropout_prob,
            model.config.classifier_dropout) == (0.0, 0.0, 0.0)
    model.train()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    restored = config_with(model.config, base)
    assert (restored.hidden_dropout_prob, restored.classifier_dropout) == (0.3, 0.4)
    assert model.config.hidden_dropout_prob == 0.0  # a copy: the model's own stays off


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_reward_training_runs_without_dropout(dropout_models, arch, tmp_path):
    model = dropout_models[arch]
    pairs = _dropout_pairs(model)
    # the scores by hand: each sequence alone (no padding) through the base in eval mode, head seeded as the
    # worker's (reward_model.train.seed), the last token's score
    reference = load_reward_backbone(model, load_tokenizer(model).pad_token_id, seed=1).eval()
    with torch.no_grad():
        by_hand = [[float(reference(input_ids=torch.tensor([ids])).logits[0, 0]) for ids in pair] for pair in pairs]
    loss_by_hand = sum(math.log1p(math.exp(-(chosen - rejected))) for chosen, rejected in by_hand) / len(pairs)

    worker = _dropout_worker(model, disable_dropout=True)
    worker.module.train()
    with torch.no_grad():
        first, second = (torch.cat(worker._rewards(pairs)) for _ in range(2))
    assert torch.equal(first, second)
    assert first.tolist() == pytest.approx([c for c, _ in by_hand] + [r for _, r in by_hand], abs=1e-5)
    stats = worker.train_step(pairs, [1.0] * len(pairs), len(pairs))
    assert stats["loss"] / stats["pairs"] == pytest.approx(loss_by_hand, abs=1e-6)
    # the export keeps the base's dropout rates (a model fine-tuned from it later gets them)
    worker.save_hf(tmp_path / "export")
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert {name: exported[name] for name in DROPOUT_RATES[arch]} == DROPOUT_RATES[arch]

    # with the key false, training draws dropout: two passes of the same pairs differ, and so does the loss
    worker = _dropout_worker(model, disable_dropout=False)
    worker.module.train()
    with torch.no_grad():
        first, second = (torch.cat(worker._rewards(pairs)) for _ in range(2))
    assert not torch.equal(first, second)
    stats = worker.train_step(pairs, [1.0] * len(pairs), len(pairs))
    assert stats["loss"] / stats["pairs"] != pytest.approx(loss_by_hand, abs=1e-6)


# ----------------------------------------------------------------------------- non-finite losses


def _records(out) -> dict[int, dict]:
    return {record["step"]: record for record in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.usefixtures("one_thread")
def test_a_model_whose_weights_are_nan_stops_at_its_first_step_and_exports_nothing(tiny, pairs_dir, tmp_path,
                                                                                   capsys):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "nan_model"
    shutil.copytree(tiny, broken)
    weights = load_file(broken / "model.safetensors")
    save_file({name: torch.full_like(value, math.nan) if value.is_floating_point() else value
               for name, value in weights.items()}, broken / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    assert train_rm(_overrides(broken, pairs_dir, out, "reward_model.train.save_freq=1")) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: training the reward model stopped at step 1: its loss is nan (train/loss): the weights the step "
        "started from hold NaN or inf values, so its update was skipped and the run saves and exports nothing more; "
        f"the weights are those of reward_model.train.model.path ({broken}), as the run loaded them: check that "
        "model for NaN or inf weights")
    assert sorted(path.name for path in out.iterdir() if not path.name.startswith(".")) == [
        "metrics.jsonl"]  # no checkpoint, no huggingface/
    assert list(_records(out)) == [1] and _records(out)[1]["train/loss"] is None  # (the file logger's NaN)


def _nan_after_update(at_step: int):
    """RewardModelWorker.train_step whose update at ``at_step`` (1-based) leaves every weight NaN, its loss finite."""
    train_step = RewardModelWorker.train_step

    def update_to_nan(worker, *args):
        result = train_step(worker, *args)
        if worker.scheduler.last_epoch == at_step:
            with torch.no_grad():
                for parameter in worker.module.parameters():
                    parameter.fill_(math.nan)
        return result
    return update_to_nan


NO_CHECKPOINT = "no checkpoint was saved yet: rerun with a lower learning rate (reward_model.train.optim.lr)"
NEW_RUN = ("start a new run with a lower learning rate (reward_model.train.optim.lr; reward_model.train.resume_mode="
           "disable, or another reward_model.train.default_local_dir)")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("save_freq", [1, 2])
def test_an_update_that_wrecks_the_weights_stops_the_run_at_its_save_or_the_next_step(
        tiny, pairs_dir, tmp_path, capsys, monkeypatch, save_freq):
    out = tmp_path / "out"
    monkeypatch.setattr(RewardModelWorker, "train_step", _nan_after_update(1))  # step 1's own loss is finite
    assert train_rm(_overrides(tiny, pairs_dir, out, f"reward_model.train.save_freq={save_freq}",
                               "reward_model.train.test_freq=-1")) == 1
    stopped = ("step 1: the weights hold NaN or inf values, so the run saves and exports nothing more"
               if save_freq == 1 else  # its save refuses them
               "step 2: its loss is nan (train/loss): the weights the step started from hold NaN or inf values, so "
               "its update was skipped and the run saves and exports nothing more")
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: training the reward model stopped at {stopped}; {NO_CHECKPOINT}")
    assert sorted(path.name for path in out.iterdir() if not path.name.startswith(".")) == [
        "metrics.jsonl"]  # no checkpoint, no huggingface/
    records = _records(out)
    assert math.isfinite(records[1]["train/loss"])
    assert list(records) == ([1] if save_freq == 1 else [1, 2])
    if save_freq == 2:
        assert records[2]["train/loss"] is None


@pytest.mark.usefixtures("one_thread")
def test_weights_the_last_update_left_nan_are_neither_saved_nor_exported(tiny, pairs_dir, tmp_path, capsys,
                                                                         monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(RewardModelWorker, "train_step", _nan_after_update(2))  # the last step's loss is finite
    assert train_rm(_overrides(tiny, pairs_dir, out, "reward_model.train.total_training_steps=2",
                               "reward_model.train.save_freq=1", "reward_model.train.test_freq=-1")) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: training the reward model stopped at step 2: the weights hold NaN or inf values, so the run saves "
        f"and exports nothing more; the latest checkpoint {out / 'global_step_1'} is intact and from before the "
        f"divergence, but a rerun with the same settings replays the steps after it: {NEW_RUN}")
    assert sorted(path.name for path in out.iterdir() if not path.name.startswith(".")) == [
        "global_step_1", "latest_checkpointed_iteration.txt", "metrics.jsonl"]  # no global_step_2, no huggingface/
    assert list(_records(out)) == [1, 2]  # no closing validation record: the weights were refused before it


def _overflow_in(monkeypatch, steps: set[int]) -> None:
    """RewardModelWorker's chosen scores NaN in the training steps ``steps`` (1-based, counted by the worker's
    train_step calls; a validation after such a step is NaN too), as a step in bfloat16 or float16 can overflow."""
    train_step, rewards = RewardModelWorker.train_step, RewardModelWorker._rewards
    calls = []

    def counted(worker, *args):
        calls.append(None)
        return train_step(worker, *args)

    def overflow(worker, micro):
        chosen, rejected = rewards(worker, micro)
        return (chosen * math.nan if len(calls) in steps else chosen), rejected

    monkeypatch.setattr(RewardModelWorker, "train_step", counted)
    monkeypatch.setattr(RewardModelWorker, "_rewards", overflow)


@pytest.mark.usefixtures("one_thread")
def test_a_lone_non_finite_loss_on_finite_weights_skips_its_update_and_training_goes_on(
        tiny, pairs_dir, tmp_path, capsys, monkeypatch):
    """As a step in bfloat16 or float16 can overflow once: its scores NaN, the weights finite. Its update is skipped
    (as verl's and TRL's trainers skip such a step) rather than the run stopped as though the weights were bad."""
    _overflow_in(monkeypatch, {1})
    out = tmp_path / "out"
    assert train_rm(_overrides(tiny, pairs_dir, out, "reward_model.train.total_training_steps=2",
                               "reward_model.train.save_freq=1", "reward_model.train.test_freq=-1")) == 0
    assert ("warning: the loss of step 1 is nan (train/loss) while the weights are finite, as one step in reduced "
            "precision can overflow: its update was skipped (train/skipped_step) and training goes on"
            ) in capsys.readouterr().err.splitlines()
    steps = [record for record in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if "train/loss" in record]  # (the closing validation's record is another line of step 2)
    assert [(record["step"], record["train/skipped_step"]) for record in steps] == [(1, 1), (2, 0)]
    assert steps[0]["train/loss"] is None and math.isfinite(steps[1]["train/loss"])
    # two steps, one update: AdamW counted a single step for every weight it trained
    optim = torch.load(out / "global_step_2" / "reward_model" / "optim_state.pt", weights_only=False)["optimizer"]
    assert {float(state["step"]) for state in optim["state"].values()} == {1.0}
    assert (out / "huggingface" / "config.json").is_file()


@pytest.mark.usefixtures("one_thread")
def test_a_skipped_step_leaves_the_learning_rate_schedule_where_it_was(tiny, pairs_dir, tmp_path, monkeypatch):
    """The schedule counts updates taken: a skipped first step neither moves the warm-up on nor steps the scheduler
    before the optimizer (torch's warning that the schedule's first value is lost)."""
    import warnings

    _overflow_in(monkeypatch, {1})
    out = tmp_path / "out"
    cfg = load_config(_overrides(tiny, pairs_dir, out, "reward_model.train.val_files=null",
                                 "reward_model.train.total_training_steps=3", "reward_model.train.optim.lr=1e-3",
                                 "reward_model.train.optim.lr_warmup_steps=2"))
    records = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RewardModelTrainer(cfg).fit(lambda metrics, step: records.append(metrics))
    assert not [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]
    # warm-up over 2 updates from 0: the skipped step would have used 0, the first update takes 0 and the second
    # 1e-3 * 1/2
    assert [(m["train/skipped_step"], m["train/lr"]) for m in records] == [(1.0, 0.0), (0.0, 0.0), (0.0, 5e-4)]


SKIP_ADVICE = ("so the run saves and exports nothing more: check the preference data, and reward_model.train.model."
               "dtype (float16 and bfloat16 scores can overflow) and reward_model.train.optim.lr, which a new run may "
               "change")
#: where a step of the run took an update: a resume meets the streak's pairs on the same weights, stopping alike
RAISE_LIMIT = ("a resume meets the same pairs on the same weights at these steps, so to train past them raise "
               "reward_model.train.max_consecutive_skips")
#: where none did: the checkpoints hold the weights the run started from, and a resume meets the same pairs on them
UNTRAINED = ("its checkpoints hold the weights it started from (reward_model.train.model.path), which no step "
             "updated, and a resume meets the same pairs on them alike: start the new run with reward_model.train."
             "resume_mode=disable or another reward_model.train.default_local_dir")


@pytest.mark.usefixtures("one_thread")
def test_max_consecutive_skips_stops_the_run_naming_the_checkpoint_to_go_on_from(
        tiny, pairs_dir, tmp_path, capsys, monkeypatch):
    """As PPO's trainer.guard.max_consecutive_skips: skipped steps in a row past the limit need a person."""
    with pytest.raises(ConfigError, match=r"reward_model.train.max_consecutive_skips=0 must be > 0"):
        load_config(_overrides(tiny, pairs_dir, tmp_path, "reward_model.train.max_consecutive_skips=0"))
    _overflow_in(monkeypatch, {2, 3})
    out = tmp_path / "out"
    args = _overrides(tiny, pairs_dir, out, "reward_model.train.val_files=null", "reward_model.train.save_freq=1",
                      "reward_model.train.total_training_steps=4")
    assert train_rm([*args, "reward_model.train.max_consecutive_skips=2"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: training the reward model stopped at step 3: 2 consecutive steps (up to step 3) had a non-finite loss "
        "or gradient on finite weights and took no update (train/skipped_step; reward_model.train.max_consecutive_"
        f"skips=2), {SKIP_ADVICE}; {RAISE_LIMIT} above 2 or set it to null (a resume may change it); the latest "
        f"checkpoint {out / 'global_step_2'} is intact: rerun the same command to resume from it")
    assert sorted(path.name for path in out.iterdir() if not path.name.startswith(".")) == [
        "global_step_1", "global_step_2", "latest_checkpointed_iteration.txt", "metrics.jsonl"]  # no huggingface/
    assert [(step, record["train/skipped_step"]) for step, record in _records(out).items()] == [
        (1, 0), (2, 1), (3, 1)]
    # the limit may change on a resume (its steps from here on are not skipped: the 4th and 5th calls)
    assert train_rm([*args, "reward_model.train.max_consecutive_skips=3"]) == 0
    assert (out / "huggingface" / "config.json").is_file()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("limit", ["null", "3"])  # off, and above the run's two steps
def test_a_run_whose_every_step_was_skipped_saves_and_exports_nothing_as_trained(
        tiny, pairs_dir, tmp_path, capsys, monkeypatch, limit):
    _overflow_in(monkeypatch, {1, 2})
    out = tmp_path / "out"
    assert train_rm(_overrides(tiny, pairs_dir, out, "reward_model.train.val_files=null",
                               "reward_model.train.save_freq=1", "reward_model.train.total_training_steps=2",
                               f"reward_model.train.max_consecutive_skips={limit}")) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: training the reward model stopped at step 2: no step of this run (steps 1 to 2) took an update: each "
        "had a non-finite loss or gradient on finite weights (train/skipped_step), "
        f"{SKIP_ADVICE}; {UNTRAINED}")
    assert sorted(path.name for path in out.iterdir() if not path.name.startswith(".")) == [
        "global_step_1", "latest_checkpointed_iteration.txt", "metrics.jsonl"]  # no global_step_2, no huggingface/


def _overflow_on_the_pairs_of(monkeypatch, steps: set[int]) -> None:
    """RewardModelWorker's chosen scores NaN in training on the pairs of steps ``steps`` (1-based), as pairs that drive
    the scores past float16's range do in every run that meets them: a resume meets them again (unlike
    :func:`_overflow_in`, which counts the calls). ``steps`` is read as each step starts: clear it to end them."""
    step_pairs, rewards = RewardModelTrainer._step_pairs, RewardModelWorker._rewards
    training = []

    def pairs_of(trainer, step):
        training[:] = [step + 1]
        return step_pairs(trainer, step)

    def overflow(worker, micro):
        chosen, rejected = rewards(worker, micro)
        return (chosen * math.nan if worker.module.training and training[0] in steps else chosen), rejected

    monkeypatch.setattr(RewardModelTrainer, "_step_pairs", pairs_of)
    monkeypatch.setattr(RewardModelWorker, "_rewards", overflow)


@pytest.mark.usefixtures("one_thread")
def test_a_skip_streak_after_an_update_asks_for_the_limit_raised_as_the_same_command_stops_alike(
        tiny, pairs_dir, tmp_path, capsys, monkeypatch):
    """Steps 2 and 3 of 4 overflow on their pairs: max_consecutive_skips=2 stops the run at step 3. The same command
    resumes from step 2 and meets step 3's pairs on step 2's weights again: the same stop. Raised on the resume (a
    key a resume may change), the limit lets the run train past them to its end."""
    _overflow_on_the_pairs_of(monkeypatch, {2, 3})
    out = tmp_path / "out"
    args = _overrides(tiny, pairs_dir, out, "reward_model.train.val_files=null", "reward_model.train.save_freq=1",
                      "reward_model.train.total_training_steps=4", "reward_model.train.total_epochs=2",
                      "reward_model.train.max_consecutive_skips=2")
    assert train_rm(args) == 1
    said = capsys.readouterr().err.splitlines()[-1]
    assert said.endswith(f"{SKIP_ADVICE}; {RAISE_LIMIT} above 2 or set it to null (a resume may change it); the "
                         f"latest checkpoint {out / 'global_step_2'} is intact: rerun the same command to resume "
                         "from it")
    assert train_rm(args) == 1  # the same command, the same stop
    assert capsys.readouterr().err.splitlines()[-1] == said
    assert train_rm([*args, "reward_model.train.max_consecutive_skips=3"]) == 0
    assert [(step, record["train/skipped_step"]) for step, record in _records(out).items()] == [
        (1, 0), (2, 1), (3, 1), (4, 0)]
    assert (out / "huggingface" / "config.json").is_file()


@pytest.mark.usefixtures("one_thread")
def test_a_run_none_of_whose_steps_took_an_update_names_a_new_run_not_its_checkpoint(
        tiny, pairs_dir, tmp_path, capsys, monkeypatch):
    """Both steps overflow on their pairs: the run's checkpoint holds the weights it started from, and the same command
    resumes from it to the same stop, so the message names a new run; one with the cause gone trains to its end."""
    overflowing = {1, 2}
    _overflow_on_the_pairs_of(monkeypatch, overflowing)
    out = tmp_path / "out"
    args = _overrides(tiny, pairs_dir, out, "reward_model.train.val_files=null", "reward_model.train.save_freq=1",
                      "reward_model.train.total_training_steps=2", "reward_model.train.max_consecutive_skips=null")
    assert train_rm(args) == 1
    said = capsys.readouterr().err.splitlines()[-1]
    assert said.endswith(f"(train/skipped_step), {SKIP_ADVICE}; {UNTRAINED}")
    assert train_rm(args) == 1  # resumed from global_step_1: the same stop
    assert capsys.readouterr().err.splitlines()[-1] == said
    overflowing.clear()  # (a new run with, say, another model.dtype)
    assert train_rm([*args, "reward_model.train.resume_mode=disable"]) == 0
    assert (out / "huggingface" / "config.json").is_file()


class _Killed(BaseException):
    """The process ended at once, as kill -9 ends it."""


def _break_off_after(monkeypatch, how: str, step: int, out, run) -> None:
    """Run ``run`` (a reward-model command with save_freq=1) broken off once step ``step`` is saved, then leave the
    trainer as it was: ``ctrl_c`` raises SIGINT as that step's training starts (the step is finished and saved, exit
    130); ``killed`` ends the run right after the step's save, saying nothing, as kill -9 would."""
    train_step, save = RewardModelTrainer.train_step, RewardModelTrainer.save

    def signalled(self):
        if self.global_step == step - 1:
            signal.raise_signal(signal.SIGINT)
        return train_step(self)

    def save_then_die(self):
        path = save(self)
        if self.global_step == step:
            raise _Killed
        return path

    if how == "ctrl_c":
        monkeypatch.setattr(RewardModelTrainer, "train_step", signalled)
        assert run() == 130
    else:
        monkeypatch.setattr(RewardModelTrainer, "save", save_then_die)
        with pytest.raises(_Killed):
            run()
    monkeypatch.setattr(RewardModelTrainer, "train_step", train_step)
    monkeypatch.setattr(RewardModelTrainer, "save", save)
    assert ckpt.latest_checkpoint(out) == out / f"global_step_{step}"


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("broken_off", ["no", "ctrl_c", "killed"])
def test_a_skip_streak_broken_off_by_a_resume_stops_the_run_at_the_step_an_unbroken_run_stops_at(
        tiny, pairs_dir, tmp_path, capsys, monkeypatch, broken_off):
    """Steps 2, 3 and 4 of 6 overflow under max_consecutive_skips=3: step 1 takes an update and step 4 is the third
    skip in a row, so the run stops there. Broken off after step 3 (two skips in a row) and resumed, the count goes
    on from the checkpoint's: the run stops at step 4 all the same (counted afresh, it ran on to step 6)."""
    _overflow_in(monkeypatch, {2, 3, 4})  # (its count of steps goes on over both commands: step N is call N)
    out = tmp_path / "out"
    args = _overrides(tiny, pairs_dir, out, "reward_model.train.val_files=null", "reward_model.train.save_freq=1",
                      "reward_model.train.total_epochs=2", "reward_model.train.max_consecutive_skips=3")
    if broken_off != "no":
        _break_off_after(monkeypatch, broken_off, 3, out, lambda: train_rm(args))
        capsys.readouterr()
    assert train_rm(args) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: training the reward model stopped at step 4: 3 consecutive steps (up to step 4) had a non-finite loss "
        "or gradient on finite weights and took no update (train/skipped_step; reward_model.train.max_consecutive_"
        f"skips=3), {SKIP_ADVICE}; {RAISE_LIMIT} above 3 or set it to null (a resume may change it); the latest "
        f"checkpoint {out / 'global_step_3'} is intact: rerun the same command to resume from it")
    assert sorted(path.name for path in out.glob("global_step_*")) == ["global_step_1", "global_step_2",
                                                                       "global_step_3"]
    assert not (out / "huggingface").exists()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("broken_off", ["no", "ctrl_c", "killed"])
@pytest.mark.parametrize("overflowing", [(2, 3, 4), (1, 2, 3, 4)])
def test_whether_any_step_took_an_update_is_kept_across_a_resume(
        tiny, pairs_dir, tmp_path, capsys, monkeypatch, broken_off, overflowing):
    """With max_consecutive_skips off, a run of 4 steps stops at its end where none of them took an update. Steps 2
    to 4 overflowing, step 1's update counts and the run ends well, broken off after step 2 and resumed too (though
    the resumed steps 3 and 4 took none); steps 1 to 4 overflowing, it stops at step 4 naming all four."""
    _overflow_in(monkeypatch, set(overflowing))
    out = tmp_path / "out"
    args = _overrides(tiny, pairs_dir, out, "reward_model.train.val_files=null", "reward_model.train.save_freq=1",
                      "reward_model.train.total_training_steps=4", "reward_model.train.total_epochs=2",
                      "reward_model.train.max_consecutive_skips=null")
    if broken_off != "no":
        _break_off_after(monkeypatch, broken_off, 2, out, lambda: train_rm(args))
        capsys.readouterr()
    if overflowing[0] == 2:
        assert train_rm(args) == 0
        assert (out / "huggingface" / "config.json").is_file()
        return
    assert train_rm(args) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: training the reward model stopped at step 4: no step of this run (steps 1 to 4) took an update: each "
        "had a non-finite loss or gradient on finite weights (train/skipped_step), "
        f"{SKIP_ADVICE}; {UNTRAINED}")
    assert not (out / "huggingface").exists()


@pytest.mark.usefixtures("one_thread")
def test_a_checkpoint_saved_without_the_skip_counts_resumes_counting_from_its_step(
        tiny, pairs_dir, tmp_path, capsys, monkeypatch):
    """trainer_state.json records the skips in a row and the step since which no step took an update (None once one
    did); a checkpoint saved before it held them resumes, the counts starting at its step."""
    import hashlib

    _overflow_in(monkeypatch, {2, 3, 4})
    out = tmp_path / "out"
    args = _overrides(tiny, pairs_dir, out, "reward_model.train.val_files=null", "reward_model.train.save_freq=1",
                      "reward_model.train.total_epochs=2", "reward_model.train.max_consecutive_skips=3")
    _break_off_after(monkeypatch, "ctrl_c", 3, out, lambda: train_rm(args))
    saved = out / "global_step_3"
    state = json.loads((saved / ckpt.TRAINER_STATE).read_text())
    assert (state.pop("consecutive_skips"), state.pop("no_update_since")) == (2, None)  # steps 2, 3; step 1 updated
    (saved / ckpt.TRAINER_STATE).write_text(json.dumps(state, indent=1))
    manifest = json.loads((saved / "manifest.json").read_text())
    data = (saved / ckpt.TRAINER_STATE).read_bytes()
    manifest["files"][ckpt.TRAINER_STATE] = len(data)
    manifest["sha256"][ckpt.TRAINER_STATE] = hashlib.sha256(data).hexdigest()
    (saved / "manifest.json").write_text(json.dumps(manifest, indent=1))

    # step 4 the first skip counted, steps 5 and 6 updates: the run ends well
    assert train_rm(args) == 0
    assert (out / "huggingface" / "config.json").is_file()
    state = json.loads((out / "global_step_4" / ckpt.TRAINER_STATE).read_text())
    assert (state["consecutive_skips"], state["no_update_since"]) == (1, 3)
    state = json.loads((out / "global_step_5" / ckpt.TRAINER_STATE).read_text())
    assert (state["consecutive_skips"], state["no_update_since"]) == (0, None)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("test_freq", [1, -1])  # a validation between the steps, and the closing one
def test_a_validation_whose_loss_is_not_finite_stops_the_run_before_it_saves_or_exports(
        tiny, pairs_dir, tmp_path, capsys, monkeypatch, test_freq):
    out = tmp_path / "out"
    monkeypatch.setattr(RewardModelTrainer, "validate", lambda self: {"val/loss": math.nan,
                                                                      "val/pair_accuracy": 0.5})
    steps = 2 if test_freq == 1 else 1
    assert train_rm(_overrides(tiny, pairs_dir, out, f"reward_model.train.total_training_steps={steps}",
                               "reward_model.train.save_freq=1", f"reward_model.train.test_freq={test_freq}")) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: training the reward model stopped at step 1: its validation loss is nan (val/loss): the weights "
        f"give NaN or inf scores on the held-out pairs, so the run saves and exports nothing more; {NO_CHECKPOINT}")
    assert sorted(path.name for path in out.iterdir() if not path.name.startswith(".")) == ["metrics.jsonl"]
    records = _records(out)
    assert list(records) == [1] and records[1]["val/loss"] is None and records[1]["val/pair_accuracy"] == 0.5


@pytest.mark.usefixtures("one_thread")
def test_nan_weights_resumed_from_another_folder_are_named_as_the_checkpoint_they_came_from(
        tiny, pairs_dir, tmp_path, capsys, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    with monkeypatch.context() as patched:  # a checkpoint of NaN weights, as a run saved them before it checked
        patched.setattr(RewardModelWorker, "train_step", _nan_after_update(1))
        patched.setattr(RewardModelWorker, "weights_finite", lambda self: True)
        patched.setattr(RewardModelTrainer, "validate", lambda self: {})
        assert train_rm(_overrides(tiny, pairs_dir, first, "reward_model.train.total_training_steps=1")) == 0
    capsys.readouterr()
    assert train_rm(_overrides(tiny, pairs_dir, second, "reward_model.train.total_training_steps=2",
                               "reward_model.train.resume_mode=resume_path",
                               f"reward_model.train.resume_from_path={first / 'global_step_1'}")) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: training the reward model stopped at step 2: its loss is nan (train/loss): the weights the step "
        "started from hold NaN or inf values, so its update was skipped and the run saves and exports nothing more; "
        f"the checkpoint the run resumed from, {first / 'global_step_1'}, holds these weights, so a resume from it "
        f"fails again: {NEW_RUN}")
    assert not list(second.glob("global_step_*")) and not (second / "huggingface").exists()


@pytest.mark.usefixtures("one_thread")
def test_a_logger_that_cannot_write_stops_the_run_with_one_line_and_exit_1(tiny, pairs_dir, tmp_path, capsys):
    out = tmp_path / "out"
    (out / "metrics.jsonl").mkdir(parents=True)  # the file logger's file is a folder
    assert train_rm(_overrides(tiny, pairs_dir, out, "reward_model.train.total_training_steps=2")) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (f"error: logging the metrics of step 1 failed (IsADirectoryError: [Errno 21] Is "
                                    f"a directory: '{out / 'metrics.jsonl'}'); no checkpoint was saved yet")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("error", "said", "then"), [
    (OSError("a broken pipe"), "OSError: a broken pipe", ""),
    (OSError(28, "No space left on device"), "OSError: [Errno 28] No space left on device",
     "free space on that disk, then ")])  # (a full disk: the space the rerun needs)
def test_a_logger_failure_names_the_checkpoint_a_rerun_resumes_from(tiny, pairs_dir, tmp_path, error, said, then):
    from rlhf_core.training.trainer import LoggingError

    out = tmp_path / "out"

    def log(metrics, step):
        if step == 2:
            raise error

    trainer = RewardModelTrainer(load_config(_overrides(tiny, pairs_dir, out, "reward_model.train.save_freq=1",
                                                        "reward_model.train.total_training_steps=3")))
    with pytest.raises(LoggingError) as raised:
        trainer.fit(log)
    assert str(raised.value) == (
        f"logging the metrics of step 2 failed ({said}); the latest checkpoint "
        f"{out / 'global_step_1'} is intact: {then}rerun the same command to resume from it")
    assert sorted(path.name for path in out.glob("global_step_*")) == ["global_step_1"]


@pytest.mark.usefixtures("one_thread")
def test_a_resume_from_a_checkpoint_renamed_from_global_step_n_is_refused_before_it_trains(
        tiny, pairs_dir, tmp_path, capsys):
    """resume_from_path is a global_step_N directory: the step in its name is the one the stop messages compare and
    name. A copy renamed to best/ was resumed and trained, and its first failure (a logger that could not write, a
    Ctrl-C) stopped with "best is not a checkpoint directory" in place of the message that names the checkpoint."""
    first, second = tmp_path / "first", tmp_path / "second"
    assert train_rm(_overrides(tiny, pairs_dir, first, "reward_model.train.total_training_steps=1")) == 0
    shutil.copytree(first / "global_step_1", tmp_path / "best")
    capsys.readouterr()
    assert train_rm(_overrides(tiny, pairs_dir, second, "reward_model.train.total_training_steps=2",
                               "reward_model.train.resume_mode=resume_path",
                               f"reward_model.train.resume_from_path={tmp_path / 'best'}")) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"  - reward_model.train.resume_from_path: {tmp_path / 'best'} is not a checkpoint directory: its name must "
        "be global_step_N")
    assert not second.exists()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("earlier_run", [False, True])  # the new folder empty, or holding an earlier run's
def test_a_failure_after_a_resume_from_another_folder_names_the_checkpoint_it_resumed_from(
        tiny, pairs_dir, tmp_path, capsys, earlier_run):
    """Until it saves, a run resumed from reward_model.train.resume_from_path has its weights in that checkpoint
    alone: the same command resumes from it again, where resume_mode=auto would take the new folder's latest (none:
    a fresh start; or an earlier run's)."""
    from rlhf_core.training.trainer import LoggingError

    first, second = tmp_path / "first", tmp_path / "second"
    assert train_rm(_overrides(tiny, pairs_dir, first, "reward_model.train.total_training_steps=1")) == 0
    if earlier_run:
        assert train_rm(_overrides(tiny, pairs_dir, second, "reward_model.train.total_training_steps=1",
                                   "reward_model.train.seed=7")) == 0

    def log(metrics, step):
        if step == 2:
            raise OSError("No space left on device")

    trainer = RewardModelTrainer(load_config(_overrides(
        tiny, pairs_dir, second, "reward_model.train.total_training_steps=2", "reward_model.train.resume_mode=resume_path",
        f"reward_model.train.resume_from_path={first / 'global_step_1'}")))
    with pytest.raises(LoggingError) as raised:
        trainer.fit(log)
    assert str(raised.value) == (
        f"logging the metrics of step 2 failed (OSError: No space left on device); the latest checkpoint "
        f"{first / 'global_step_1'} is intact: rerun the same command to resume from it")

    # stopped in step 2 without saving: by a second SIGTERM, and by a Ctrl-C with trainer.save_on_interrupt=false
    args = _overrides(tiny, pairs_dir, second, "reward_model.train.total_training_steps=2",
                      "reward_model.train.resume_mode=resume_path",
                      f"reward_model.train.resume_from_path={first / 'global_step_1'}")
    kept = f"the latest checkpoint {first / 'global_step_1'} is as it was: rerun the same command to resume from it"
    train_step = RewardModelTrainer.train_step

    def stopped_in_step_2(self):
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
        return train_step(self)

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(RewardModelTrainer, "train_step", stopped_in_step_2)
        assert train_rm(args) == 143
    assert f"second SIGTERM: stopped now without saving; {kept}" in capsys.readouterr().err.splitlines()

    def ctrl_c_in_step_2(self):
        raise KeyboardInterrupt  # (Python's own handler: the run's is not installed without saving on interrupt)

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(RewardModelTrainer, "train_step", ctrl_c_in_step_2)
        assert train_rm([*args, "trainer.save_on_interrupt=false"]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"interrupted by SIGINT: stopped at once without saving (trainer.save_on_interrupt=false); {kept}")


@pytest.mark.usefixtures("one_thread")
def test_a_run_resumed_from_another_folder_saves_its_last_step_over_an_earlier_runs_checkpoint_there(
        tiny, pairs_dir, tmp_path):
    """The folder an earlier run left at step 2 gets this run's step 2 (its weights, its latest marker): the run
    saved no step 2 itself, so its last save is not skipped as though that checkpoint were its own."""
    first, second = tmp_path / "first", tmp_path / "second"
    assert train_rm(_overrides(tiny, pairs_dir, first, "reward_model.train.total_training_steps=1")) == 0
    assert train_rm(_overrides(tiny, pairs_dir, second, "reward_model.train.total_training_steps=2",
                               "reward_model.train.seed=7")) == 0
    saved = second / "global_step_2" / "reward_model" / "model_state.pt"
    earlier = torch.load(saved, weights_only=False)
    trainer = RewardModelTrainer(load_config(_overrides(
        tiny, pairs_dir, second, "reward_model.train.total_training_steps=2", "reward_model.train.resume_mode=resume_path",
        f"reward_model.train.resume_from_path={first / 'global_step_1'}")))
    trainer.fit()
    trained = trainer.worker.module.state_dict()
    assert not all(torch.equal(earlier[k], trained[k]) for k in trained)  # (the two runs' weights differ)
    checkpoint = torch.load(saved, weights_only=False)
    assert checkpoint.keys() == trained.keys() and all(torch.equal(checkpoint[k], trained[k]) for k in trained)
    assert ckpt.latest_checkpoint(second) == second / "global_step_2"


# ----------------------------------------------------------------------------- bad input


def test_preference_file_without_chosen_rejected(tiny, tmp_path, capsys):
    bad = tmp_path / "prompts.parquet"
    pd.DataFrame({"prompt": [[{"role": "user", "content": "q"}]], "data_source": ["x"],
                  "extra_info": [{"split": "train"}]}).to_parquet(bad)
    out = tmp_path / "never"
    code = train_rm(["trainer.device=cpu", "trainer.n_gpus_per_node=1", f"reward_model.train.model.path={tiny}",
                 f"reward_model.train.train_files={bad}", "reward_model.train.val_files=null",
                 f"reward_model.train.default_local_dir={out}"])
    assert code == 2  # bad input, as PPO's data
    assert "chosen, rejected" in capsys.readouterr().err
    assert not out.exists()


def test_model_path_that_is_not_a_model_or_has_no_tokenizer(tiny, pairs_dir, tmp_path, capsys):
    out = tmp_path / "never"
    assert train_rm(_overrides(tmp_path / "nowhere", pairs_dir, out)) == 2
    assert "reward_model.train.model.path" in capsys.readouterr().err
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tok / name).write_bytes((tiny / name).read_bytes())
    assert train_rm(_overrides(no_tok, pairs_dir, out)) == 2
    assert "holds no tokenizer files" in capsys.readouterr().err
    assert not out.exists()


def test_max_length_is_the_models_positions_unless_set_and_never_past_them(tiny, pairs_dir, tmp_path, capsys):
    """The tiny model has 512 positions: a longer max_length is refused before anything is written (PPO's
    scoring would cut what it trained on); left null it is 512, recorded in the checkpoints' config."""
    out = tmp_path / "rm"
    assert train_rm(_overrides(tiny, pairs_dir, out, "reward_model.train.max_length=1024")) == 2
    assert "reward_model.train.max_length=1024 exceeds the max_position_embeddings of" in capsys.readouterr().err
    assert not out.exists()
    cfg = load_config(_overrides(tiny, pairs_dir, out, "reward_model.train.total_training_steps=1"))
    assert cfg.reward_model.train.max_length is None
    RewardModelTrainer(cfg).fit()
    saved = yaml.safe_load((out / "global_step_1" / ckpt.CONFIG_FILE).read_text())
    assert saved["reward_model"]["train"]["max_length"] == 512


def test_a_ray_address_where_nothing_answers_is_refused_before_the_pairs_are_encoded(tiny, pairs_dir, tmp_path,
                                                                                      capsys):
    """rlhf-train-rm on 2 workers with trainer.ray_address where nothing answers: ray.init retried for many minutes
    (still trying after 200 s) before it failed with Ray's words (exit 1); now refused at once as bad input, as PPO's preflight refuses it (exit 2)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens there once it is closed
    out = tmp_path / "rm"
    started = time.monotonic()
    assert train_rm(_overrides(tiny, pairs_dir, out, "trainer.n_gpus_per_node=2",
                               "reward_model.train.micro_batch_size_per_gpu=2",
                               f"trainer.ray_address=127.0.0.1:{port}")) == 2
    assert time.monotonic() - started < 5
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"  - trainer.ray_address (or RAY_ADDRESS) '127.0.0.1:{port}': nothing answers at 127.0.0.1:{port} within "
        f"5 s (Connection refused); start the cluster there (ray start --head --port {port}) or fix the address")
    assert not out.exists()


def test_the_command_asks_the_ray_address_once(tiny, pairs_dir, tmp_path, monkeypatch, capsys):
    """rlhf-train-rm on 2 workers asked trainer.ray_address twice: in its preflight, then again as the worker group
    joined it (each ask up to 5 s where the address is slow). Now the preflight's answer serves the join; a join
    with no preflight before it (a library call) still asks."""
    import ray

    from rlhf_core.workers import group

    asked = []
    monkeypatch.setattr(group, "_what_answers", lambda *args: asked.append(args))  # Ray answers (None), counted

    def refuse(**_):  # the join itself, past the check, fails at once (nothing of Ray starts)
        raise ConnectionError("refused here")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    address = "127.0.0.1:6379"
    assert train_rm(_overrides(tiny, pairs_dir, tmp_path / "rm", "trainer.n_gpus_per_node=2",
                               "reward_model.train.micro_batch_size_per_gpu=2", f"trainer.ray_address={address}")) == 1
    assert f"cannot connect to the Ray cluster at trainer.ray_address='{address}' (or RAY_ADDRESS): refused here" \
        in capsys.readouterr().err
    assert asked == [("127.0.0.1", 6379, False)]
    with pytest.raises(group.WorkerError, match="refused here"):
        group.ensure_ray(address, 2, "cpu")
    assert len(asked) == 2


def test_batch_that_workers_cannot_share(tiny, pairs_dir, tmp_path, capsys):
    assert train_rm(_overrides(tiny, pairs_dir, tmp_path / "never", "reward_model.train.micro_batch_size_per_gpu=3")) == 2
    assert "must be divisible by reward_model.train.micro_batch_size_per_gpu" in capsys.readouterr().err
    # a PPO config never trains a reward model: 3 workers, whom the reward training's default 64 / 8 pairs
    # do not divide, load; rlhf-train-rm is where that batch is checked
    cfg = load_config(["trainer.n_gpus_per_node=3", "data.train_batch_size=12", "actor_rollout_ref.actor.ppo_mini_batch_size=12",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4"])
    assert cfg.world_size == 3


@pytest.mark.slow
def test_two_workers_match_one(tiny, pairs_dir, tmp_path):
    """FSDP2 over 2 Ray workers takes the steps one process takes (same validation to float precision), with the
    same gradient norm at every step: AdamW's update barely changes with the gradient's scale, so a gradient off
    by the number of workers moves the validation loss by far less than its tolerance, and only the norm shows it."""
    def grad_norms(into: dict):
        def log(metrics, step):
            if "train/grad_norm" in metrics:
                into[step] = metrics["train/grad_norm"]
        return log

    one_norms, two_norms = {}, {}
    single = RewardModelTrainer(load_config(_overrides(tiny, pairs_dir, tmp_path / "one")))
    one = single.fit(grad_norms(one_norms))
    two = RewardModelTrainer(load_config(_overrides(tiny, pairs_dir, tmp_path / "two", "trainer.n_gpus_per_node=2",
                                                    "reward_model.train.micro_batch_size_per_gpu=2")))
    try:
        two_val = two.fit(grad_norms(two_norms))
    finally:
        two.shutdown()
    assert list(one_norms) == [1, 2, 3] and all(norm > 0 for norm in one_norms.values())
    assert two_norms == pytest.approx(one_norms, rel=1e-4)
    assert two_val["val/loss"] == pytest.approx(one["val/loss"], abs=1e-5)
    assert two_val["val/pair_accuracy"] == one["val/pair_accuracy"]
    assert (tmp_path / "two" / "global_step_3" / "reward_model" / "extra_state_rank_1.pt").is_file()
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "two" / "huggingface")
    assert loaded.config.num_labels == 1


@pytest.mark.slow
def test_a_workers_failure_names_the_step_and_the_checkpoint_a_rerun_resumes_from(tiny, pairs_dir, tmp_path):
    """On 2 Ray workers, step 2's pairs hold a token id past the vocabulary, so the workers raise in it: the run
    stopped with the worker's error alone, where PPO's trainer names the step and the checkpoint to resume from."""
    from rlhf_core.workers.group import WorkerError

    out = tmp_path / "two"
    trainer = RewardModelTrainer(load_config(_overrides(tiny, pairs_dir, out, "trainer.n_gpus_per_node=2",
                                                        "reward_model.train.micro_batch_size_per_gpu=2",
                                                        "reward_model.train.save_freq=1")))

    def log(metrics, step):
        if step == 1:  # saved; the next step's pairs are poisoned
            trainer.train_pairs = [(chosen[:-1] + [10_000], rejected) for chosen, rejected in trainer.train_pairs]

    try:
        with pytest.raises(WorkerError) as info:
            trainer.fit(log)
    finally:
        trainer.shutdown()
    message = str(info.value)
    assert message.startswith("training the reward model failed at step 2: worker rank ")
    # the worker's own traceback: its frames, down to the embedding's error
    assert "raised in train_share:" in message and 'File "' in message, message
    assert "IndexError: index out of range in self" in message, message
    assert message.splitlines()[-1] == (f"the latest checkpoint {out / 'global_step_1'} is intact: rerun the same "
                                        "command to resume from it")


@pytest.mark.slow
def test_two_workers_report_the_scores_of_every_pair(tiny, pairs_dir, tmp_path):
    """On 2 Ray workers (gloo), a validation's and a step's pair metrics are over the pairs of both ranks: 5 pairs
    shared 3 + 3 (the second rank's last a weight-0 repeat), each share in micro-batches of 2 + 1, against the float64
    scores of the model as it stood before the step, each sequence alone. The step's gradient norm is that of the
    mean loss over the 5 pairs: each rank divides its share's loss by 5 and FSDP sums the ranks' gradients."""
    trainer = RewardModelTrainer(load_config(_overrides(tiny, pairs_dir, tmp_path / "two", "trainer.n_gpus_per_node=2",
                                                        "reward_model.train.micro_batch_size_per_gpu=2")))
    try:
        trainer.export(tmp_path / "before")
        trainer.val_pairs = trainer.val_pairs[:5]
        val = trainer.validate()
        sums = trainer.worker.train_step(trainer.train_pairs[:5], [1.0] * 5, 5)
    finally:
        trainer.shutdown()
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "before").double().eval()

    def scores(pairs):
        return [tuple(model(input_ids=torch.tensor([ids])).logits[0, 0] for ids in pair) for pair in pairs]

    with torch.no_grad():
        held_out = [(float(chosen), float(rejected)) for chosen, rejected in scores(trainer.val_pairs)]
    trained = scores(trainer.train_pairs[:5])
    margin = trainer.rm.margin
    # -log sigmoid(x) = log(1 + e^-x), averaged over the 5 pairs and differentiated in float64
    loss = sum(torch.log1p(torch.exp(margin - chosen + rejected)) for chosen, rejected in trained) / len(trained)
    loss.backward()
    grad_norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None))
    trained = [(chosen.item(), rejected.item()) for chosen, rejected in trained]
    assert val == pytest.approx(expected_pair_metrics("val", held_out, margin), abs=1e-5)
    assert pair_metrics(sums, "train") == pytest.approx(expected_pair_metrics("train", trained, margin), abs=1e-5)
    assert grad_norm > 0 and sums["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)


def _flat_state(worker) -> dict:
    """A worker's model, optimizer and schedule as one level of (name, value), for exact comparison."""
    state = worker.state_dict()
    flat = {f"model.{k}": v for k, v in state.pop("model").items()}
    optimizer = state.pop("optimizer")
    flat.update({f"optimizer.{i}.{k}": v for i, moments in optimizer["state"].items() for k, v in moments.items()})
    for j, group in enumerate(optimizer["param_groups"]):  # betas come back from DCP as a list
        flat.update({f"optimizer.group_{j}.{k}": list(v) if isinstance(v, tuple) else v for k, v in group.items()})
    return {**flat, **state}


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.slow
def test_resume_with_another_number_of_workers(tiny, pairs_dir, tmp_path, capsys):
    """One worker's checkpoint resumes on two, and theirs on one: the state re-split over two workers and gathered
    back is the same tensors, and the run ends where an uninterrupted one does (to float precision)."""
    out = tmp_path / "moved"
    one = _overrides(tiny, pairs_dir, out, "reward_model.train.total_epochs=2")
    two = [*one, "trainer.n_gpus_per_node=2", "reward_model.train.micro_batch_size_per_gpu=2"]
    straight = RewardModelTrainer(load_config(_overrides(tiny, pairs_dir, tmp_path / "straight",
                                                         "reward_model.train.total_epochs=2"))).fit()
    first = RewardModelTrainer(load_config([*one, "reward_model.train.total_training_steps=2"]))
    first.fit()
    at_two = _flat_state(first.worker)
    pair = RewardModelTrainer(load_config([*two, "reward_model.train.total_training_steps=4"]))
    try:
        pair.resume()  # one worker's whole tensors cut into two ranks' shards, saved again as theirs
        assert pair.global_step == 2
        assert "(step 2; saved by 1 worker(s), re-split over 2)" in capsys.readouterr().err
        pair.save()
        pair.fit()  # resumes its own shards (as many workers: no notice) and trains steps 3 and 4
        assert pair.global_step == 4 and "re-split" not in capsys.readouterr().err
    finally:
        pair.shutdown()
    assert (out / "global_step_2" / "reward_model" / "extra_state_rank_1.pt").is_file()
    gathered = RewardModelTrainer(load_config([*one, "reward_model.train.resume_mode=resume_path",
                                               f"reward_model.train.resume_from_path={out / 'global_step_2'}"]))
    gathered.resume()
    assert "(step 2; saved by 2 worker(s), re-split over 1)" in capsys.readouterr().err
    back = _flat_state(gathered.worker)
    assert back.keys() == at_two.keys() and any(k.endswith(".exp_avg_sq") for k in back)
    assert [k for k in at_two if not _same(back[k], at_two[k])] == []
    last = RewardModelTrainer(load_config(one))  # the latest checkpoint: two workers' at step 4
    trained = []
    val = last.fit(lambda metrics, step: trained.append(step) if "train/loss" in metrics else None)
    assert trained == [5, 6]
    assert val["val/loss"] == pytest.approx(straight["val/loss"], abs=1e-5)
    assert val["val/pair_accuracy"] == straight["val/pair_accuracy"]


def test_demo_run_config_resolves(repo_root):
    import yaml

    run = yaml.safe_load((repo_root / "configs" / "demo_rm_cpu.yaml").read_text())
    params = run["parameters"]
    cfg = load_config(params["overrides"], config_file=repo_root / params["trainer_config"])
    rm = cfg.reward_model.train
    assert rm.model.path == "outputs/toy-demo" and rm.train_batch_size == 32 and rm.optim.lr == 2e-3
    assert 0 < params["min_pair_accuracy"] <= 1


def test_preflight_refuses_lora_targets_the_backbone_lacks_before_loading_weights(tiny, pairs_dir, tmp_path):
    from rlhf_core.training.reward_trainer import RewardTrainingError, preflight

    base = _overrides(tiny, pairs_dir, tmp_path / "lora", "reward_model.train.model.lora_rank=4")
    with pytest.raises(RewardTrainingError, match=r"reward_model.train.model.target_modules: nope names no module of "
                                                  r".*; set model.target_modules to some of its linear layers, "
                                                  r"\[q_proj,"):
        preflight(load_config([*base, "reward_model.train.model.target_modules=[nope]"]))
    with pytest.raises(RewardTrainingError, match=r"target_modules=q_proj: a string is a regular expression over "
                                                  r"whole module names .* write the list \[q_proj\]"):
        preflight(load_config([*base, "reward_model.train.model.target_modules=q_proj"]))
    assert preflight(load_config([*base, "reward_model.train.model.target_modules=[q_proj]"])).train


def test_a_resumed_reward_model_run_goes_on_in_its_tracking_runs(tiny, pairs_dir, tmp_path, monkeypatch):
    """rlhf-train-rm hands the step it resumes from to its loggers (a new wandb and MLflow run each time, else)."""
    from rlhf_core.cli import train as cli_train
    from rlhf_core.training import tracking

    seen = []

    class Recording(tracking.Tracking):
        def __init__(self, *args, resume_step=None, **kwargs):
            seen.append(resume_step)
            super().__init__(*args, resume_step=resume_step, **kwargs)

    monkeypatch.setattr(tracking, "Tracking", Recording)
    args = _overrides(tiny, pairs_dir, tmp_path / "rm", "trainer.logger=[console,tensorboard]")
    assert cli_train.train_rm([*args, "reward_model.train.total_epochs=1"]) == 0
    done = ckpt.step_of(ckpt.latest_checkpoint(tmp_path / "rm"))
    assert cli_train.train_rm([*args, "reward_model.train.total_epochs=2"]) == 0
    assert seen == [None, done] and done > 0


def test_an_mlflow_file_store_is_refused_before_the_reward_model_loads(tiny, pairs_dir, tmp_path, monkeypatch):
    from rlhf_core.training.reward_trainer import RewardTrainingError, preflight

    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "mlruns"))
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(RewardTrainingError, match=f"MLFLOW_TRACKING_URI={tmp_path / 'mlruns'} is a file store"):
        preflight(load_config(_overrides(tiny, pairs_dir, tmp_path / "rm", "trainer.logger=[console,mlflow]")))


def test_a_new_run_in_the_folder_moves_the_earlier_runs_metrics_aside(tiny, pairs_dir, tmp_path, capsys):
    out = tmp_path / "rm"

    def steps(name: str) -> list[int]:
        return [r["step"] for r in map(json.loads, (out / name).read_text().splitlines()) if "train/loss" in r]

    assert train_rm(_overrides(tiny, pairs_dir, out)) == 0
    assert steps("metrics.jsonl") == [1, 2, 3]  # 24 pairs, 8 a step
    assert train_rm(_overrides(tiny, pairs_dir, out, "reward_model.train.resume_mode=disable",
                               "reward_model.train.total_training_steps=2")) == 0
    assert steps("metrics.jsonl") == [1, 2] and steps("metrics.jsonl.prev") == [1, 2, 3]
    assert "its records are moved aside (metrics.jsonl to metrics.jsonl.prev)" in capsys.readouterr().err


def test_a_fresh_auto_run_moves_the_records_of_a_run_that_never_saved_aside(tiny, pairs_dir, tmp_path, capsys):
    out = tmp_path / "rm"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "train/loss": 0.7}\n')  # a run killed before its first save
    assert train_rm(_overrides(tiny, pairs_dir, out)) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3]  # 24 pairs, 8 a step
    assert (out / "metrics.jsonl.prev").read_text() == '{"step": 1, "train/loss": 0.7}\n'
    assert (f"notice: reward_model.train.default_local_dir {out} holds records of an earlier run that saved no "
            "checkpoint: moved aside (metrics.jsonl to metrics.jsonl.prev)") in capsys.readouterr().err


def test_ppo_and_the_reward_model_refuse_each_others_checkpoints_by_what_they_hold(
        tiny, pairs_dir, workspace, tmp_path, capsys):
    """PPO pointed at a reward model's folder (or the reverse) listed every config key the two runs set apart and
    said to restore them, which no config could do; now the checkpoint's parts say what it is, before a model
    loads. A new run there (resume_mode=disable) would replace the other run's checkpoints: refused too."""
    from rlhf_core.cli.train import ppo

    rm_dir, ppo_dir = tmp_path / "rm", tmp_path / "ppo"
    assert train_rm(_overrides(tiny, pairs_dir, rm_dir)) == 0  # saves global_step_3 (24 pairs, 8 a step)
    assert ppo(workspace.overrides(ppo_dir, "trainer.total_training_steps=1")) == 0  # saves global_step_1
    capsys.readouterr()
    rm_step, ppo_step = rm_dir / "global_step_3", ppo_dir / "global_step_1"

    def refusal(code: int) -> str:
        assert code == 2
        err = capsys.readouterr().err
        assert "differs" not in err and "Restore" not in err
        return err

    # PPO: the folder's latest checkpoint, then a path named, then a new run there
    hint = f"; to score PPO's rollouts with that reward model, set reward_model.enable=true " \
           f"reward_model.model.path={rm_dir / 'huggingface'}"
    assert (f"{rm_step} is a reward-model checkpoint (rlhf-train-rm's: it holds reward_model/), not a PPO one, so "
            f"this run cannot resume from it: use another trainer.default_local_dir{hint}"
            ) in refusal(ppo(workspace.overrides(rm_dir)))
    assert f"not a PPO one, so this run cannot resume from it: use another trainer.resume_from_path{hint}" in refusal(
        ppo(workspace.overrides(tmp_path / "elsewhere", "trainer.resume_mode=resume_path",
                                f"trainer.resume_from_path={rm_step}")))
    assert (f"{rm_dir} holds reward-model checkpoints (global_step_3; rlhf-train-rm's), and this PPO run's saves "
            "would replace them: use another trainer.default_local_dir"
            ) in refusal(ppo(workspace.overrides(rm_dir, "trainer.resume_mode=disable")))
    assert ckpt.latest_checkpoint(rm_dir) == rm_step and not (rm_dir / "metrics.jsonl.prev").exists()

    # the reward model's command at PPO's checkpoints, the same three ways
    assert (f"{ppo_step} is a PPO checkpoint (rlhf-ppo's: it holds actor/), not a reward-model one, so this "
            "run cannot resume from it: use another reward_model.train.default_local_dir"
            ) in refusal(train_rm(_overrides(tiny, pairs_dir, ppo_dir)))
    assert "not a reward-model one, so this run cannot resume from it: use another reward_model.train." \
           "resume_from_path" in refusal(train_rm(_overrides(tiny, pairs_dir, tmp_path / "elsewhere_rm",
                                                             "reward_model.train.resume_mode=resume_path",
                                                             f"reward_model.train.resume_from_path={ppo_step}")))
    assert (f"{ppo_dir} holds PPO checkpoints (global_step_1; rlhf-ppo's), and this reward-model run's saves would "
            "replace them: use another reward_model.train.default_local_dir"
            ) in refusal(train_rm(_overrides(tiny, pairs_dir, ppo_dir, "reward_model.train.resume_mode=disable")))
    assert ckpt.latest_checkpoint(ppo_dir) == ppo_step and not list(ppo_dir.glob("global_step_[23]"))


def test_a_resume_already_at_the_end_says_the_reward_models_run_is_complete(tiny, pairs_dir, tmp_path, capsys):
    """The notice names the limit that ends the run (both where they end it at the same step) and every limit at or
    below the step reached: following it trains on. 24 pairs, 8 a step: 3 steps an epoch."""
    out = tmp_path / "rm"
    assert train_rm(_overrides(tiny, pairs_dir, out)) == 0  # 3 steps, one epoch
    assert "already complete" not in capsys.readouterr().err
    head = f"notice: the reward model's run is already complete: {out / 'global_step_3'} is at step 3 and this run "
    tail = ", so nothing is trained (the model is validated and exported again); to train on from it, raise "
    # 2 steps: ends at step 2; the epoch (3 steps) ends at the step reached too, so both are to be raised
    assert train_rm(_overrides(tiny, pairs_dir, out, "reward_model.train.total_training_steps=2")) == 0
    assert (f"{head}ends at step 2 (reward_model.train.total_training_steps=2){tail}"
            "reward_model.train.total_training_steps above 3 and reward_model.train.total_epochs to 2 or more and "
            "run again") in capsys.readouterr().err
    # 3 steps and one epoch of 3 steps: both end the run at step 3
    assert train_rm(_overrides(tiny, pairs_dir, out, "reward_model.train.total_training_steps=3")) == 0
    assert (f"{head}ends at step 3 (reward_model.train.total_training_steps=3 and reward_model.train.total_epochs=1 "
            f"of 3 steps each){tail}reward_model.train.total_training_steps above 3 and "
            "reward_model.train.total_epochs to 2 or more and run again") in capsys.readouterr().err
    # the epochs alone (no step limit), or a step limit past the epochs: raise the epochs only
    for extra in ([], ["reward_model.train.total_training_steps=5"]):
        assert train_rm(_overrides(tiny, pairs_dir, out, *extra)) == 0
        assert (f"{head}ends at step 3 (reward_model.train.total_epochs=1 of 3 steps each){tail}"
                "reward_model.train.total_epochs to 2 or more and run again") in capsys.readouterr().err
    assert ckpt.latest_checkpoint(out) == out / "global_step_3"
    # following the advice trains on: to step 4, where the step limit now ends it (two epochs end at step 6)
    assert train_rm(_overrides(tiny, pairs_dir, out, "reward_model.train.total_training_steps=4",
                               "reward_model.train.total_epochs=2")) == 0
    assert "already complete" not in capsys.readouterr().err
    assert ckpt.latest_checkpoint(out) == out / "global_step_4"


def test_a_refused_reward_model_run_leaves_the_folders_tracking_runs_as_they_were(
        tiny, pairs_dir, workspace, tmp_path, capsys, monkeypatch):
    """Each refusal of rlhf-train-rm in PPO's folder (the checkpoint's kind, under auto, disable and resume_path)
    comes before its loggers start: PPO's wandb run id, its wandb runs and its TensorBoard events stay as PPO left
    them, so that PPO's next resume goes on in its own wandb run."""
    from rlhf_core.cli.train import ppo

    monkeypatch.setenv("WANDB_MODE", "offline")
    ppo_dir = tmp_path / "ppo"
    assert ppo(workspace.overrides(ppo_dir, "trainer.total_training_steps=1", "trainer.test_freq=-1",
                                   "trainer.logger=[file,wandb,tensorboard]")) == 0

    def folder() -> dict[str, object]:
        return {"ids": (ppo_dir / "tracking_runs.json").read_text(),
                "tensorboard": sorted(p.name for p in (ppo_dir / "tensorboard").iterdir()),
                "wandb": sorted(p.name for p in (ppo_dir / "wandb").iterdir()),
                "files": sorted(p.name for p in ppo_dir.iterdir())}

    before = folder()
    assert json.loads(before["ids"]).keys() == {"wandb"} and len(before["tensorboard"]) == 1
    capsys.readouterr()
    loggers = "trainer.logger=[console,wandb,tensorboard]"
    for extra in ([], ["reward_model.train.resume_mode=disable"],
                  ["reward_model.train.resume_mode=resume_path",
                   f"reward_model.train.resume_from_path={ppo_dir / 'global_step_1'}"]):
        assert train_rm(_overrides(tiny, pairs_dir, ppo_dir, loggers, *extra)) == 2
        assert "PPO" in capsys.readouterr().err
        assert folder() == before


def test_a_resume_path_that_names_no_checkpoint_is_told_the_one_it_likely_means(tiny, pairs_dir, tmp_path):
    """reward_model.train.resume_from_path set to the folder of checkpoints rather than one of them was refused as a
    checkpoint whose save did not finish (it holds no manifest.json): its name is what is wrong, and the folder's
    latest checkpoint, or the one a path lies in, is named."""
    from rlhf_core.training import checkpoint
    from rlhf_core.training.reward_trainer import RewardTrainingError, preflight

    saved = tmp_path / "saved"
    checkpoint.write_checkpoint(saved, 3, lambda files: files.text("reward_model/model_state.pt", "x")
                                or ["reward_model"])
    step = saved / "global_step_3"
    for wrong, meant in ((saved, f"it is a folder of checkpoints, whose latest is {step}"),
                         (step / "reward_model", f"it lies inside the checkpoint {step}")):
        with pytest.raises(RewardTrainingError) as info:
            preflight(load_config(_overrides(tiny, pairs_dir, tmp_path / "out", "reward_model.train.resume_mode="
                                             "resume_path", f"reward_model.train.resume_from_path={wrong}")))
        assert info.value.errors == [
            f"reward_model.train.resume_from_path: {wrong} is not a checkpoint directory: its name must be "
            f"global_step_N; {meant}: reward_model.train.resume_from_path={step} resumes from it"]


@pytest.mark.usefixtures("one_thread")
def test_a_full_disk_as_the_export_is_written_says_so_and_a_rerun_exports_from_the_last_checkpoint(
        tiny, pairs_dir, tmp_path, capsys, monkeypatch):
    """The export follows the last save: a full disk there (safetensors says it in an error of its own) ended the run
    in that error's traceback, without "disk full", the checkpoint that holds the trained model or the way on."""
    from safetensors import SafetensorError
    from transformers import modeling_utils

    out = tmp_path / "out"
    args = _overrides(tiny, pairs_dir, out, "reward_model.train.total_training_steps=2")

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    with monkeypatch.context() as patched:
        patched.setattr(modeling_utils, "safe_save_file", full_disk)
        assert train_rm(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (
        f"disk full while writing the reward model's HF export {out / 'huggingface'} (No space left on device); the "
        f"latest checkpoint {out / 'global_step_2'} is intact: free space on that disk, then rerun the same command "
        "to resume from it (at the run's end: the rerun writes the export)")
    assert not (out / "huggingface").exists() and not [p for p in out.iterdir() if p.name.startswith(".huggingface")]
    assert train_rm(args) == 0  # the rerun resumes at the run's end and exports
    assert AutoModelForSequenceClassification.from_pretrained(out / "huggingface").config.num_labels == 1


@pytest.mark.usefixtures("one_thread")
def test_a_logger_or_the_export_refused_by_the_folder_says_how_to_keep_the_run_with_the_reward_models_key(
        tiny, pairs_dir, tmp_path, monkeypatch):
    """A logger or the HF export that the reward model's folder refused (its permissions) told only to rerun, which
    meets the same refusal; a save refused there says to make the folder writable or move it whole and set
    reward_model.train.default_local_dir, and so do they."""
    import errno

    from transformers import modeling_utils

    from rlhf_core.training.trainer import LoggingError

    out = tmp_path / "out"
    args = _overrides(tiny, pairs_dir, out, "reward_model.train.save_freq=1", "reward_model.train.total_training_steps=3")

    def keep(latest):
        return (f"the latest checkpoint {latest} is intact: make {out} writable again (its permissions, or remount a "
                "read-only filesystem), then rerun the same command to resume from it; or move "
                f"{out} with its checkpoints and latest_checkpointed_iteration.txt to a writable place and set "
                "reward_model.train.default_local_dir to that place for the rerun (in a folder without them a rerun "
                "starts afresh)")

    def log(metrics, step):
        if step == 2:
            raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(LoggingError) as logged:
        RewardModelTrainer(load_config(args)).fit(log)
    assert str(logged.value) == ("logging the metrics of step 2 failed (PermissionError: [Errno 13] Permission "
                                 f"denied); {keep(out / 'global_step_1')}")

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(modeling_utils, "safe_save_file", refused)
    with pytest.raises(ckpt.CheckpointError) as exported:
        RewardModelTrainer(load_config(args)).fit()  # resumes from step 1, saves step 3, then exports
    assert str(exported.value) == (
        f"could not write the reward model's HF export {out / 'huggingface'}: [Errno 13] Permission denied; "
        f"{keep(out / 'global_step_3')} (at the run's end: the rerun writes the export)")


@pytest.mark.usefixtures("one_thread")
def test_a_folder_that_refuses_the_reward_models_saves_is_told_with_its_own_keys_and_a_moved_folder_resumes(
        tiny, pairs_dir, tmp_path, capsys, monkeypatch):
    """The reward model's checkpoints go to reward_model.train.default_local_dir, but a save its folder refused (or
    a full disk at its first save) told to "set trainer.default_local_dir", PPO's key, which moves nothing here. A
    refusal after a checkpoint is kept says how to resume from it, here or in the folder moved whole; a rerun
    pointed at the moved folder resumes there."""
    import errno

    out, moved = tmp_path / "out", tmp_path / "elsewhere" / "out"
    args = ["reward_model.train.total_training_steps=2", "reward_model.train.save_freq=1"]
    real_write = ckpt.CheckpointFiles.write
    failing = {}

    def fail(file):
        raise failing["error"]

    def write(files, rel, fill):
        real_write(files, rel, fail if files.folder.name.startswith(f".global_step_{failing['step']}.") else fill)

    monkeypatch.setattr(ckpt.CheckpointFiles, "write", write)
    key = "reward_model.train.default_local_dir"
    for step, error, said in (
            (1, OSError(errno.ENOSPC, "No space left on device"),
             f"disk full while writing reward_model/model_state.pt of checkpoint {out / 'global_step_1'}; free space "
             f"or set {key} to a larger disk (No space left on device)"),
            (1, PermissionError(errno.EACCES, "Permission denied"),
             f"checkpoint directory {out} is not writable (Permission denied); fix its permissions or set {key}"),
            (2, PermissionError(errno.EACCES, "Permission denied"),
             f"checkpoint directory {out} is not writable (Permission denied) while writing reward_model/"
             f"model_state.pt of checkpoint {out / 'global_step_2'}; the previous checkpoint {out / 'global_step_1'} "
             f"is intact: make {out} writable again (its permissions, or remount a read-only filesystem), then rerun "
             f"the same command to resume from it; or move {out} with its checkpoints and "
             f"latest_checkpointed_iteration.txt to a writable place and set {key} to that place for the rerun (in a "
             "folder without them a rerun starts afresh)")):
        failing.update(step=step, error=error)
        assert train_rm(_overrides(tiny, pairs_dir, out, *args)) == 2
        assert capsys.readouterr().err.splitlines()[-1] == said
    monkeypatch.undo()

    moved.parent.mkdir()
    shutil.move(out, moved)
    assert train_rm(_overrides(tiny, pairs_dir, moved, *args)) == 0
    assert f"resumed the reward model from {moved / 'global_step_1'} (step 1)" in capsys.readouterr().err
    assert ckpt.latest_checkpoint(moved, verify=True) == moved / "global_step_2"


def test_the_preflight_on_a_folder_of_checkpoints_that_refuses_writes_names_the_reward_models_key(
        tiny, pairs_dir, tmp_path, monkeypatch):
    """A rerun into the reward model's folder of checkpoints that still refuses writes is told how to resume from its
    latest, with the reward model's keys; the preflight said it could not be created (it exists), or nothing where
    the permission check passes (root) and the run failed at its first save."""
    import errno

    from rlhf_core.training.reward_trainer import RewardTrainingError, preflight

    out = tmp_path / "out"
    ckpt.write_checkpoint(out, 1, lambda files: files.text("reward_model/model_state.pt", "x") or ["reward_model"])

    def refused(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(ckpt.tempfile, "mkstemp", refused)
    with pytest.raises(RewardTrainingError) as info:
        preflight(load_config(_overrides(tiny, pairs_dir, out)))
    key = "reward_model.train.default_local_dir"
    assert info.value.errors == [
        f"{key}: checkpoint directory {out} is not writable (Read-only file system); its latest checkpoint "
        f"{out / 'global_step_1'} is intact: make {out} writable again (its permissions, or remount a read-only "
        f"filesystem), then rerun the same command to resume from it; or move {out} with its checkpoints and "
        f"latest_checkpointed_iteration.txt to a writable place and set {key} to that place for the rerun (in a "
        "folder without them a rerun starts afresh)"]
