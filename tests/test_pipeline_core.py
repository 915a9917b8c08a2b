"""The rlhf_core pieces behind the pipeline steps: the smoke test's dry run (a tiny clone of a big
model, the run config shrunk) and the reward spec with its self-check on reference solutions."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from transformers import AutoConfig

from rlhf_core.config import PPOConfig, load_config
from rlhf_core.data.dataset import DataError
from rlhf_core.data.synthetic import build_dataset
from rlhf_core.models.loading import load_tokenizer
from rlhf_core.models.toy import random_toy_model
from rlhf_core.pipeline.evaluate import (
    RULE_GRADES_EVALUATION,
    RewardChangedError,
    check_reference_solutions,
    check_reward_unchanged,
    ground_truth_needs,
    reward_spec,
    spec_lines,
)
from rlhf_core.pipeline.smoke import (
    SmokeTestError,
    _check,
    count_parameters_from_config,
    first_prompts,
    run_smoke_test,
    scale_config,
)
from rlhf_core.rewards import custom_module_name


@pytest.fixture(scope="module")
def big_model_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("smoke")
    # 4 layers of width 384: ~7M parameters, over the 5M line, so the dry run clones it
    model = random_toy_model(root / "big", n_layers=4, hidden_size=384, n_heads=6, max_position_embeddings=512)
    data = build_dataset(root / "data", n_train=16, n_test=8, seed=0, max_ops=1)
    cfg = load_config([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data['train']}", f"data.val_files={data['test']}",
        "data.train_batch_size=16", "data.max_prompt_length=320", "data.max_response_length=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "critic.model.enable_gradient_checkpointing=false", "trainer.n_gpus_per_node=1", "trainer.device=cpu",
        f"trainer.default_local_dir={root / 'unused'}",
    ])
    return root, model, cfg


def test_a_big_model_is_dry_run_as_a_two_layer_clone(big_model_setup, tmp_path):
    _, model, cfg = big_model_setup
    assert count_parameters_from_config(model) > 5_000_000
    report = run_smoke_test(cfg, tmp_path, n_prompts=4, response_length=8)
    assert report.passed, report.summary()
    assert report.cloned
    assert report.parameters < 1_000_000
    clone = AutoConfig.from_pretrained(report.model)
    assert (clone.model_type, clone.num_hidden_layers, clone.vocab_size) == ("llama", 2, AutoConfig.from_pretrained(
        model).vocab_size)
    assert [c["name"] for c in report.checks] == ["iterations", "finite losses", "no skipped updates",
                                                  "on-policy first step", "checkpoint round trip"]
    assert len(report.metrics) == 2
    assert abs(report.metrics[0]["actor/ppo_kl"]) < 1e-3
    # one validation, after the last step, on the validation files (a reward that fails on them fails here)
    assert not any(k.startswith("val-") for k in report.metrics[0])
    assert "val-core/synthetic/arithmetic/acc/mean@1" in report.metrics[1]
    assert "smoke test PASSED" in report.summary()


@pytest.mark.parametrize("shift", [0.5, -0.5])
def test_the_dry_run_checks_the_runs_log_prob_pass_against_the_update(big_model_setup, tmp_path, monkeypatch, shift):
    """The dry run's one mini-batch made the update on-policy, so the trainer skipped the old log-prob pass and
    step 1's KL was 0 by construction: a pass that disagrees with the update (as the run makes it, with several
    mini-batches) passed. Here the pass is off by 0.5 a token, up or down: the KL is +0.5 or -0.5, as far from
    on-policy either way, and the dry run fails."""
    from rlhf_core.workers.actor import ActorWorker

    _, _, cfg = big_model_setup
    report = run_smoke_test(cfg, tmp_path / "sound", n_prompts=4, response_length=8)
    assert report.metrics[0]["timing_s/old_log_prob"] > 0  # the pass ran
    sound = ActorWorker.compute_log_prob
    monkeypatch.setattr(ActorWorker, "compute_log_prob",
                        lambda self, batch: (lambda out: (out[0] + shift, out[1]))(sound(self, batch)))
    with pytest.raises(SmokeTestError, match=r"smoke test failed at 'on-policy first step': actor/ppo_kl on step 1 "
                                             r"= (\S+) \(must be") as failed:
        run_smoke_test(cfg, tmp_path / "broken", n_prompts=4, response_length=8)
    kl = float(re.search(r"on step 1 = (\S+) ", str(failed.value)).group(1))
    # the mean of old - new log-probs over the response tokens: old is the shifted pass, new the update's own
    assert kl == pytest.approx(shift, abs=1e-5)


def _infinite_first_grad_norm(history):
    history[0].metrics["actor/grad_norm"] = float("inf")
    return history


def _second_step_skipped(history):
    history[1].metrics["training/skipped_steps"] = 1.0  # (a running count: step 1 skipped none)
    return history


def _first_step_only(history):
    return history[:1]


@pytest.mark.parametrize(("edit", "failure"), [
    (_first_step_only, "smoke test failed at 'iterations': 1 of 2 PPO iterations ran"),
    (_infinite_first_grad_norm, "smoke test failed at 'finite losses': step 1 actor/grad_norm=inf"),
    (_second_step_skipped, "smoke test failed at 'no skipped updates': 1 optimizer steps skipped for non-finite "
                           "gradients"),
], ids=["iterations", "inf", "skipped-on-step-2"])
def test_the_dry_run_fails_on_a_short_run_an_infinite_norm_or_a_later_skipped_step(big_model_setup, tmp_path,
                                                                                    monkeypatch, edit, failure):
    """A random clone trains soundly, so these checks are made to fail by editing what the real training returns:
    an infinite norm is as unusable as a NaN, and the skip count is the run's total, so a skip on the last step
    counts."""
    from rlhf_core.training.trainer import PPOTrainer

    _, _, cfg = big_model_setup
    fit = PPOTrainer.fit
    monkeypatch.setattr(PPOTrainer, "fit", lambda self: edit(fit(self)))
    with pytest.raises(SmokeTestError, match=re.escape(failure)):
        run_smoke_test(cfg, tmp_path, n_prompts=4, response_length=8)


def test_the_round_trip_fails_where_loading_restores_nothing(big_model_setup, tmp_path, monkeypatch):
    """A fresh trainer starts from training's own first weights, and a random clone's answers all score alike
    (GRPO's advantages 0: the actor never moves): a load that restored nothing passed the round trip."""
    from rlhf_core.training.trainer import PPOTrainer

    _, _, cfg = big_model_setup
    grpo = copy.deepcopy(cfg)
    grpo.algorithm.adv_estimator = "grpo"  # no critic: the actor alone is compared
    monkeypatch.setattr(PPOTrainer, "load_checkpoint", lambda self, path: None)
    with pytest.raises(SmokeTestError, match=r"failed at 'checkpoint round trip': saved global_step_2 and loaded it "
                                             r"into a fresh trainer: \d+ tensors differ"):
        run_smoke_test(grpo, tmp_path, n_prompts=4, response_length=8)


def test_the_round_trip_fails_where_loading_restores_the_actor_and_not_the_critic(big_model_setup, tmp_path,
                                                                                   monkeypatch):
    """With GAE the checkpoint holds the critic too: a load that left the fresh critic where it started fails,
    naming the critic's tensors (and none of the actor's, which it restored)."""
    from rlhf_core.training import checkpoint

    _, _, cfg = big_model_setup
    load_worker = checkpoint._load_worker

    def load_all_but_the_critic(path, name, worker, saved, weights_only=False):
        if name != "critic":
            load_worker(path, name, worker, saved, weights_only)

    monkeypatch.setattr(checkpoint, "_load_worker", load_all_but_the_critic)
    with pytest.raises(SmokeTestError, match=r"failed at 'checkpoint round trip': saved global_step_2 and loaded it "
                                             r"into a fresh trainer: \d+ tensors differ, e\.g\. \[") as failed:
        run_smoke_test(cfg, tmp_path, n_prompts=4, response_length=8)
    shown = re.findall(r"'([^']+)'", str(failed.value).split("e.g. ", 1)[1].split("]", 1)[0])
    # the actor's differences come first in the list: a first three all the critic's mean the actor had none
    assert len(shown) == 3 and all(name.startswith("critic.") for name in shown), shown


def test_the_dry_run_gives_no_advice_about_its_own_response_cap(big_model_setup, tmp_path, capsys):
    """The dry run cuts responses at its response_length (8 here; the run config says 64): its random clone's
    responses all reach that cap, and the trainer warned "100% of the responses reached
    data.max_response_length=8 ... raise data.max_response_length", a limit the user never set. A warning about
    the run config itself (a group estimator with one response a prompt) is still given."""
    _, _, cfg = big_model_setup
    report = run_smoke_test(cfg, tmp_path / "gae", n_prompts=4, response_length=8)
    assert report.passed, report.summary()
    assert report.metrics[0]["response_length/clip_ratio"] == 1.0  # every response was cut at the dry run's cap
    err = capsys.readouterr().err
    assert "data.max_response_length" not in err
    assert "WARNING step" not in err
    single = copy.deepcopy(cfg)
    single.algorithm.adv_estimator, single.actor_rollout_ref.rollout.n = "grpo", 1
    assert run_smoke_test(single, tmp_path / "grpo", n_prompts=4, response_length=8).passed
    err = capsys.readouterr().err
    assert "WARNING: algorithm.adv_estimator=grpo compares the responses to the same prompt" in err
    assert "WARNING step" not in err



def test_the_dry_run_says_nothing_of_a_random_clones_answers_scored_alike(big_model_setup, tmp_path, capsys):
    """A random clone's answers, ended before the cap, all fail the rule reward alike: that says nothing of the
    reward (the trainer's "check the reward" would be a false alarm), so the dry run of a clone gives no warning
    about scores alike."""
    _, _, cfg = big_model_setup
    report = run_smoke_test(cfg, tmp_path, n_prompts=4, response_length=64)
    assert report.passed and report.cloned, report.summary()
    first = report.metrics[0]
    assert first["response_length/clip_ratio"] < 0.9  # (not cut: the cut would explain the scores alike)
    assert first["critic/score/min"] == first["critic/score/max"] == 0.0
    assert "WARNING step" not in capsys.readouterr().err

@pytest.fixture(scope="module")
def overlong_setup(tmp_path_factory):
    """A tiny model and 8 training prompts, rows 0, 2 and 5 made far longer than data.max_prompt_length."""
    root = tmp_path_factory.mktemp("overlong")
    model = random_toy_model(root / "model", n_layers=1, hidden_size=32, max_position_embeddings=1024)
    data = build_dataset(root / "data", n_train=8, n_test=8, seed=0, max_ops=1)
    frame = pd.read_parquet(data["train"])
    for row in (0, 2, 5):
        messages = list(frame.at[row, "prompt"])
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + " padding" * 400}
        frame.at[row, "prompt"] = messages
    frame.to_parquet(data["train"], index=False)
    return root, model, data


def _overlong_config(setup, *overrides):
    return load_config(_overlong_overrides(setup, *overrides))


def _overlong_overrides(setup, *overrides):
    root, model, data = setup
    return [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data['train']}", f"data.val_files={data['test']}",
        "data.max_prompt_length=320", "data.max_response_length=4", "data.filter_overlong_prompts=true",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.n=2", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false", "trainer.n_gpus_per_node=1",
        "trainer.device=cpu", "trainer.logger=[]", f"trainer.default_local_dir={root / 'unused'}", *overrides,
    ]


def test_the_dry_run_takes_the_first_prompts_the_trainer_keeps(overlong_setup, tmp_path):
    root, model, data = overlong_setup
    raw = pd.read_parquet(data["train"])
    first, second = tmp_path / "a.parquet", tmp_path / "b.parquet"  # rows 0-2 and 3-7 of the file
    raw.iloc[:3].to_parquet(first, index=False)
    raw.iloc[3:].to_parquet(second, index=False)
    cfg = _overlong_config(overlong_setup)
    tokenizer = load_tokenizer(model)
    # rows 0, 2 and 5 are dropped: the first four kept are rows 1, 3, 4 and 6, across both files
    rows, kept = first_prompts([str(first), str(second)], tokenizer, cfg.data, 4, "data.train_files")
    assert len(kept) == 5
    pd.testing.assert_frame_equal(rows, raw.iloc[[1, 3, 4, 6]].reset_index(drop=True))
    rows, kept = first_prompts([str(first), str(second)], tokenizer, cfg.data, 8, "data.train_files")
    assert len(kept) == 5 and len(rows) == 5  # asked for more than are kept: all of them
    pd.testing.assert_frame_equal(rows, raw.iloc[[1, 3, 4, 6, 7]].reset_index(drop=True))


def test_the_dry_run_reads_each_prompt_file_once(overlong_setup, tmp_path, monkeypatch):
    # the kept rows are taken from the frame the trainer's dataset checked, not from a second read of the files
    _, _, data = overlong_setup
    import pyarrow.parquet as pq

    reads: dict[str, int] = {}
    read_table = pq.read_table

    def counting(source, *args, **kwargs):  # what pandas' reading and every read_rows call read a file with
        reads[str(source)] = reads.get(str(source), 0) + 1
        return read_table(source, *args, **kwargs)

    monkeypatch.setattr(pq, "read_table", counting)
    report = run_smoke_test(_overlong_config(overlong_setup, "data.train_batch_size=4"), tmp_path, n_prompts=4,
                            response_length=4)
    assert report.passed, report.summary()
    assert (reads[str(data["train"])], reads[str(data["test"])]) == (1, 1)


def test_an_overlong_first_prompt_does_not_shrink_the_dry_run(overlong_setup, tmp_path):
    report = run_smoke_test(_overlong_config(overlong_setup, "data.train_batch_size=4"), tmp_path, n_prompts=4,
                            response_length=4)
    assert report.passed, report.summary()
    assert report.n_prompts == 4
    assert len(pd.read_parquet(tmp_path / "data" / "train.parquet")) == 4
    # a config without validation files (training runs without validation) dry-runs without them too
    report = run_smoke_test(_overlong_config(overlong_setup, "data.train_batch_size=4", "data.val_files=[]"),
                            tmp_path / "no_val", n_prompts=4, response_length=4)
    assert report.passed, report.summary()
    assert not (tmp_path / "no_val" / "data" / "val.parquet").exists()


def test_the_dry_run_says_the_truncation_notice_once_with_the_runs_counts(overlong_setup, tmp_path, capsys):
    """Rows 0, 2 and 5 of the 8 are over data.max_prompt_length: the notice is said once, of the run's file (3 of 8);
    the trainer's loading of the dry run's copy said it again, of the copy's 4 rows, once per trainer built (2)."""
    _, _, data = overlong_setup
    report = run_smoke_test(_overlong_config(overlong_setup, "data.train_batch_size=4",
                                             "data.filter_overlong_prompts=false", "data.truncation=left"),
                            tmp_path, n_prompts=4, response_length=4)
    assert report.passed, report.summary()
    notices = [line for line in capsys.readouterr().err.splitlines() if "data.truncation=" in line]
    assert len(notices) == 1, notices
    assert notices[0].startswith("notice: data.train_files: data.truncation=left cut 3 of 8 prompts longer than "
                                 f"data.max_prompt_length (320 tokens) to that length (first: {data['train']} row 0)")


def test_the_dry_run_keeps_the_prompts_train_max_samples_keeps(overlong_setup, tmp_path):
    """A config whose data.train_max_samples (2) is its batch was refused by the dry run, which drew 4 prompts
    and so a batch of 4 over train_max_samples: "data.train_max_samples (2) keeps fewer prompts than
    data.train_batch_size (4)", a batch size the user never set."""
    _, _, data = overlong_setup
    cfg = _overlong_config(overlong_setup, "data.train_batch_size=2", "data.train_max_samples=2", "data.shuffle=false",
                           "data.filter_overlong_prompts=false", "data.truncation=left",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")
    report = run_smoke_test(cfg, tmp_path, n_prompts=4, response_length=4)
    assert report.passed, report.summary()
    assert report.n_prompts == 2
    # without data.shuffle, train_max_samples keeps the files' first rows
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "data" / "train.parquet"),
                                  pd.read_parquet(data["train"]).iloc[:2])


def test_too_few_kept_prompts_stop_the_dry_run_in_the_configs_terms(overlong_setup, tmp_path):
    # 8 rows, 3 over data.max_prompt_length: 5 kept, fewer than a batch of 6
    with pytest.raises(DataError, match=re.escape(
            "data.train_batch_size (6) is larger than the dataset (5 prompts, after data.filter_overlong_prompts "
            "dropped 3 longer than data.max_prompt_length): lower data.train_batch_size, raise "
            "data.max_prompt_length or add prompts")):
        run_smoke_test(_overlong_config(overlong_setup, "data.train_batch_size=6",
                                        "actor_rollout_ref.actor.ppo_mini_batch_size=6",
                                        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"), tmp_path)


def test_too_few_prompts_kept_by_train_max_samples_are_refused_input_in_the_dry_run_as_in_training(
        overlong_setup, tmp_path, capsys):
    # data.train_max_samples=6 in order keeps rows 0-5 of the 8; rows 0, 2 and 5 are too long: 3 left for a batch
    # of 4. The files hold more prompts: the key to raise is train_max_samples; both commands exit 2 (input refused)
    from rlhf_core.cli.train import ppo, smoke

    overrides = _overlong_overrides(overlong_setup, "data.train_batch_size=4", "data.train_max_samples=6",
                                    "data.shuffle=false", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")
    refusal = ("data.train_batch_size (4) is larger than the dataset (3 prompts, after data.train_max_samples keeps 6 "
               "of 8 and data.filter_overlong_prompts dropped 3 longer than data.max_prompt_length): lower "
               "data.train_batch_size, raise data.train_max_samples or raise data.max_prompt_length")
    assert smoke([*overrides, f"--work-dir={tmp_path / 'dry'}"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == refusal
    assert ppo([*overrides, f"trainer.default_local_dir={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == refusal


def test_a_dry_run_before_an_evaluation_refuses_a_reward_whose_acc_is_partial(overlong_setup, tmp_path):
    """A reward giving a wrong answer {"score": 0.2, "acc": 0.2} passed the pipeline's dry run, which never looked at
    acc, and the whole training ran before the evaluation refused it. A dry run of a run that is evaluated
    (``evaluated``: the pipeline's) checks its validation responses as the evaluation does and fails, in the
    evaluation's words, naming the function; acc False/True passes it, and the dry run of training alone (which
    averages the acc) takes the partial one."""
    partial, boolean = tmp_path / "partial.py", tmp_path / "boolean.py"
    partial.write_text("def fifth(data_source, solution_str, ground_truth, extra_info=None):\n"
                       "    if solution_str.strip() == ground_truth:\n"
                       "        return {'score': 1.0, 'acc': 1}\n"
                       "    return {'score': 0.2, 'acc': 0.2}\n")
    boolean.write_text("def even(data_source, solution_str, ground_truth, extra_info=None):\n"
                       "    return {'score': 0.5, 'acc': extra_info['index'] % 2 == 0}\n")

    def config(reward, name):
        return _overlong_config(overlong_setup, "data.train_batch_size=4", f"custom_reward_function.path={reward}",
                                f"custom_reward_function.name={name}")

    # the 4 validation prompts of the dry run are the file's first 4 (synthetic/arithmetic, indices 0-3), and a
    # random model's 4-token responses are none of them a bare two-digit answer
    with pytest.raises(SmokeTestError) as refused:
        run_smoke_test(config(partial, "fifth"), tmp_path / "partial", n_prompts=4, response_length=4, evaluated=True)
    assert str(refused.value).startswith(
        f"smoke test failed at 'right or wrong': the reward function 'fifth' of {partial} gave an acc other than 0 "
        "or 1 on 4 problem(s), e.g. synthetic/arithmetic/0 (acc 0.2), synthetic/arithmetic/1 (acc 0.2), "
        "synthetic/arithmetic/2 (acc 0.2): the evaluation counts each problem right or wrong to pair it with another "
        "model's result, and a partial acc is neither; return an acc of 0 or 1 (False or True), and any partial "
        "credit as the score (on the dry run's validation responses: the evaluation after training would refuse the "
        "reward there)\nsmoke test FAILED"), refused.value
    # before the checkpoint round trip, the one check left
    assert "checkpoint round trip" not in str(refused.value)
    report = run_smoke_test(config(boolean, "even"), tmp_path / "boolean", n_prompts=4, response_length=4,
                            evaluated=True)
    assert report.passed, report.summary()
    assert {"name": "right or wrong", "passed": True,
            "detail": "the reward's acc is 0 or 1 on all 4 validation responses, as the evaluation after training "
                      "counts each problem right or wrong"} in report.checks
    alone = run_smoke_test(config(partial, "fifth"), tmp_path / "alone", n_prompts=4, response_length=4)
    assert alone.passed, alone.summary()
    assert "right or wrong" not in [check["name"] for check in alone.checks]


def test_the_production_recipe_shrinks_to_a_valid_single_process_config(repo_root, tmp_path):
    cfg = load_config(config_file=repo_root / "configs" / "gsm8k_qwen2.5_0.5b_8gpu.yaml")
    cfg.trainer.critic_warmup = 3
    small = scale_config(cfg, tmp_path / "clone", tmp_path / "train.parquet", tmp_path / "val.parquet", tmp_path,
                         n_prompts=4, response_length=16, cloned=True)
    assert (small.world_size, small.data.train_batch_size, small.data.max_response_length) == (1, 4, 16)
    assert small.actor_rollout_ref.actor.ppo_mini_batch_size == 4
    assert small.trainer.total_training_steps == 2
    assert small.critic.model.path is None  # the clone initialises the critic too
    assert small.trainer.critic_warmup == 0  # the actor updates on step 1, where its KL is checked
    # kept as the recipe has them
    actor = small.actor_rollout_ref.actor
    assert (actor.ppo_epochs, actor.use_dynamic_bsz, actor.clip_ratio, actor.optim.lr) == (4, True, 0.2, 1e-6)
    assert small.algorithm.lam == 0.95


def test_a_failed_check_stops_with_its_name_and_the_report():
    from rlhf_core.pipeline.smoke import SmokeReport

    report = SmokeReport("target", "target", False, 10, 10, 4, 2)
    with pytest.raises(SmokeTestError, match="smoke test failed at 'finite losses': step 1 actor/pg_loss=nan"):
        _check(report, "finite losses", False, "step 1 actor/pg_loss=nan")


def test_reward_spec_names_the_function_and_hashes_its_source(tmp_path):
    builtin = reward_spec(PPOConfig(), data_sources=["openai/gsm8k"])
    entry = builtin["functions"]["openai/gsm8k"]
    assert entry["function"] == "rlhf_core.rewards.gsm8k_reward"
    assert entry["calls"] == {"rlhf_core.rewards.gsm8k.compute_score":
                              {"method": "strict", "format_score": 0.0, "score": 1.0}}
    custom = tmp_path / "my_reward.py"
    cfg = PPOConfig()
    cfg.custom_reward_function.path, cfg.custom_reward_function.name = str(custom), "score_it"
    hashes = []
    for body in ("return 1.0", "return 0.5"):
        custom.write_text(f"def score_it(data_source, solution_str, ground_truth, extra_info=None):\n    {body}\n")
        spec = reward_spec(cfg, data_sources=["anything"])
        assert spec["functions"]["anything"]["function"] == f"{custom.resolve()}:score_it"
        hashes.append((spec["functions"]["anything"]["source_sha256"], spec["sha256"]))
    assert hashes[0][0] != hashes[1][0] and hashes[0][1] != hashes[1][1]


def test_the_reward_spec_reads_as_lines_a_person_can_scan(tmp_path):
    """define_reward's log line was the spec's dict repr (quotes, braces, a 64-digit hash, some 330 characters for
    one data source); a person reads which function scores each data source, with what settings."""
    builtin = reward_spec(PPOConfig(), data_sources=["openai/gsm8k", "synthetic/arithmetic"])
    assert spec_lines(builtin) == [
        f"reward {builtin['sha256'][:12]} (builtin), full score 1:",
        "  openai/gsm8k: rlhf_core.rewards.gsm8k_reward() calling "
        "rlhf_core.rewards.gsm8k.compute_score(method='strict', format_score=0.0, score=1.0)",
        "  synthetic/arithmetic: rlhf_core.rewards.gsm8k_reward() calling "
        "rlhf_core.rewards.gsm8k.compute_score(method='strict', format_score=0.0, score=1.0)"]
    custom = tmp_path / "my_reward.py"
    custom.write_text("def score_it(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
                      "    return scale\n")
    cfg = PPOConfig()
    cfg.custom_reward_function.path, cfg.custom_reward_function.name = str(custom), "score_it"
    cfg.custom_reward_function.reward_kwargs = {"scale": 0.5}
    spec = reward_spec(cfg, data_sources=["anything"])
    assert spec_lines(spec) == [f"reward {spec['sha256'][:12]} (custom), full score 1:",
                                f"  anything: {custom.resolve()}:score_it(scale=0.5)"]


def test_a_reward_edited_after_it_was_pinned_stops_the_evaluation(tmp_path):
    custom = tmp_path / "my_reward.py"
    custom.write_text("def score_it(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    cfg = PPOConfig()
    cfg.custom_reward_function.path, cfg.custom_reward_function.name = str(custom), "score_it"
    pinned = reward_spec(cfg, data_sources=["anything"])
    assert check_reward_unchanged(cfg, pinned, "evaluate")["sha256"] == pinned["sha256"]
    custom.write_text("def score_it(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    with pytest.raises(RewardChangedError, match=r"evaluate: the reward changed since define_reward pinned it .*"
                                                 r"data sources \['anything'\] differ"):
        check_reward_unchanged(cfg, pinned, "evaluate")
    cfg.custom_reward_function.reward_kwargs = {"scale": 2}  # the settings alone differ, too
    custom.write_text("def score_it(data_source, solution_str, ground_truth, extra_info=None, scale=1):\n"
                      "    return 1.0\n")
    pinned = reward_spec(cfg, data_sources=["anything"])
    cfg.custom_reward_function.reward_kwargs = {"scale": 3}
    with pytest.raises(RewardChangedError):
        check_reward_unchanged(cfg, pinned, "evaluate")


def test_a_reward_edited_after_it_was_pinned_stops_the_smoke_test_and_the_training(tmp_path):
    """Each step loads the reward file again: edited after define_reward checked it, the dry run and the whole
    training ran the unchecked code, and an edit undone before the evaluation went unseen."""
    import steps.smoke_test
    import steps.train_ppo

    custom = tmp_path / "my_reward.py"
    custom.write_text("def score_it(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    cfg = load_config([f"custom_reward_function.path={custom}", "custom_reward_function.name=score_it"])
    pinned = reward_spec(cfg, data_sources=["anything"])
    custom.write_text("def score_it(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    with pytest.raises(RewardChangedError, match=r"^smoke_test: the reward changed since define_reward pinned it"):
        steps.smoke_test.smoke_test.entrypoint(cfg.to_dict(), pinned)
    with pytest.raises(RewardChangedError, match=r"^train_ppo: the reward changed since define_reward pinned it"):
        steps.train_ppo.train_ppo.entrypoint(cfg.to_dict(), {}, reward_spec=pinned)


def test_the_reward_spec_is_the_same_for_every_load_of_an_unchanged_reward(tmp_path):
    custom = tmp_path / "my_reward.py"
    custom.write_text("def _check(s):\n    return float(s == '1')\n\n"
                      "def score_it(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return _check(solution_str)\n")
    cfg = PPOConfig()
    cfg.custom_reward_function.path, cfg.custom_reward_function.name = str(custom), "score_it"
    first = reward_spec(cfg, data_sources=["anything"])
    assert list(first["functions"]["anything"]["calls"]) == [f"{custom_module_name(custom)}._check"]
    assert reward_spec(cfg, data_sources=["anything"])["sha256"] == first["sha256"]  # another load, the same spec
    custom.write_text(custom.read_text() + "# a comment outside the functions\n")
    assert reward_spec(cfg, data_sources=["anything"])["sha256"] == first["sha256"]


REWARD_WITH_HELPERS = """\
KEEP = {keep}

def _inner(text):
    return [c for c in text if c in KEEP][:LIMIT]

def _helper(text):
    return len(_inner(text))

LIMIT = {limit}

def score_it(data_source, solution_str, ground_truth, extra_info=None):
    return float(_helper(solution_str) > 1)
"""


def _custom_config(path: Path) -> PPOConfig:
    """The defaults with the reward ``score_it`` of the file at ``path``."""
    cfg = PPOConfig()
    cfg.custom_reward_function.path, cfg.custom_reward_function.name = str(path), "score_it"
    return cfg


def _spec_hash(path: Path) -> str:
    return reward_spec(_custom_config(path), data_sources=["anything"])["sha256"]


def test_the_reward_spec_keeps_the_files_its_hash_read_reading_each_once(tmp_path, monkeypatch):
    """define_reward hashed the reward's files, then read them all again to keep their text: two walks, and a file
    edited between them was kept with text other than what was hashed."""
    import hashlib

    from rlhf_core.pipeline.lineage import SOURCE_KEY

    helper, custom = tmp_path / "helper.py", tmp_path / "my_reward.py"
    helper.write_text("def half(x):\n    return x / 2\n")
    custom.write_text("from helper import half\n\ndef score_it(*args, **kwargs):\n    return half(1.0)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    reads = []
    read_bytes = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self.name) or read_bytes(self))
    spec = reward_spec(_custom_config(custom), data_sources=["anything"], keep_source=True)
    # each once by the hash's walk, and the reward file once more as it is run (its bytes compiled, not a .pyc)
    assert sorted(reads) == ["helper.py", "my_reward.py", "my_reward.py"]
    assert [(entry["path"], entry["sha256"], entry["text"]) for entry in spec[SOURCE_KEY]["files"]] == [
        (str(path), hashlib.sha256(path.read_bytes()).hexdigest(), path.read_text()) for path in (custom, helper)]
    assert spec[SOURCE_KEY]["cwd"] == str(tmp_path)
    assert spec["sha256"] == _spec_hash(custom)  # kept beside the hash, not in it


def test_the_reward_spec_follows_helpers_of_helpers_and_the_constants_they_read(tmp_path):
    custom = tmp_path / "my_reward.py"
    custom.write_text(REWARD_WITH_HELPERS.format(keep="{'1', '2', '3'}", limit=5))
    first = _spec_hash(custom)
    custom.write_text("# a comment\n\n\n" + REWARD_WITH_HELPERS.format(keep="{'1', '2', '3'}", limit=5)
                      .replace("return float(", "return  float(  ") + "# another\n")
    assert _spec_hash(custom) == first  # comments and layout are not code
    custom.write_text(REWARD_WITH_HELPERS.format(keep="{'1', '2', '3'}", limit=5) + "UNUSED = 3\n")
    assert _spec_hash(custom) != first  # code is code, reached or not
    custom.write_text(REWARD_WITH_HELPERS.format(keep="{'1', '2', '3'}", limit=2))  # read by a helper's helper
    assert _spec_hash(custom) != first
    custom.write_text(REWARD_WITH_HELPERS.format(keep="{'1', '2'}", limit=5))  # read inside a comprehension
    assert _spec_hash(custom) != first
    custom.write_text(REWARD_WITH_HELPERS.format(keep="{'1', '2', '3'}", limit=5).replace("if c in KEEP", "if c not in KEEP"))
    assert _spec_hash(custom) != first  # the helper's helper's body


REWARD_THROUGH_OBJECTS = """\
import functools
import logging

STEP = {step}


class Grader:
    @staticmethod
    def bound():
        return BOUND


BOUND = {bound}
GRADER = Grader()


@functools.lru_cache(maxsize=None)
def normalize(text):
    return text[::STEP]


def score_it(data_source, solution_str, ground_truth, extra_info=None):
    logging.getLogger(__name__).debug("scoring")
    return float(len(normalize(solution_str)) > GRADER.bound())
"""


def test_the_reward_spec_follows_decorated_helpers_and_objects_and_not_values_made_at_import(tmp_path):
    """A reward reading its module's __name__ (which differs at each load) hashes the same at every load; a
    constant read by a cached helper or by an object's method is in the hash."""
    custom = tmp_path / "my_reward.py"
    custom.write_text(REWARD_THROUGH_OBJECTS.format(step=1, bound=3))
    cfg = _custom_config(custom)
    pinned = reward_spec(cfg, data_sources=["anything"])
    assert check_reward_unchanged(cfg, pinned, "evaluate")["sha256"] == pinned["sha256"]  # another load
    custom.write_text(REWARD_THROUGH_OBJECTS.format(step=2, bound=3))  # read by the lru_cache'd helper
    assert _spec_hash(custom) != pinned["sha256"]
    custom.write_text(REWARD_THROUGH_OBJECTS.format(step=1, bound=4))  # read by a static method of an instance
    assert _spec_hash(custom) != pinned["sha256"]


@pytest.mark.parametrize("files, edit", [
    # a constant imported from another of the user's files, beside the reward
    ({"mylib.py": "LIMIT = 5\n",
      "my_reward.py": "from mylib import LIMIT\n\ndef score_it(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) > LIMIT)\n"}, ("mylib.py", "5", "50")),
    # a constant set in a top-level try
    ({"my_reward.py": "try:\n    import numpy\n    LIMIT = 5\nexcept ImportError:\n    LIMIT = 6\n\n"
                      "def score_it(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) > LIMIT)\n"}, ("my_reward.py", "LIMIT = 5", "LIMIT = 50")),
    # a reward made by a factory
    ({"my_reward.py": "def make(limit):\n    return lambda data_source, solution_str, ground_truth, extra_info=None: "
                      "float(len(solution_str) > limit)\n\nscore_it = make(5)\n"}, ("my_reward.py", "make(5)", "make(50)")),
    # a lambda over several lines
    ({"my_reward.py": "def _h(s):\n    return len(s) > 5\n\nscore_it = (lambda data_source, solution_str, ground_truth,\n"
                      "            extra_info=None: float(_h(solution_str)))\n"},
     ("my_reward.py", "float(_h(", "float(not _h(")),
    # a package's __init__.py, which import mypkg.rules runs before rules.py
    ({"mypkg/__init__.py": "LIMIT = 5\n",
      "mypkg/rules.py": "def over(s):\n    import mypkg\n    return len(s) > mypkg.LIMIT\n",
      "my_reward.py": "import mypkg.rules\n\ndef score_it(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(mypkg.rules.over(solution_str))\n"}, ("mypkg/__init__.py", "5", "50")),
    # the same, from mypkg.rules import over (rules.py reads it by a relative import)
    ({"mypkg/__init__.py": "LIMIT = 5\n",
      "mypkg/rules.py": "from . import LIMIT\n\ndef over(s):\n    return len(s) > LIMIT\n",
      "my_reward.py": "from mypkg.rules import over\n\n"
                      "def score_it(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(over(solution_str))\n"}, ("mypkg/__init__.py", "5", "50")),
])
def test_the_reward_spec_sees_a_change_wherever_the_reward_file_or_its_own_modules_hold_it(tmp_path, monkeypatch,
                                                                                        files, edit):
    monkeypatch.syspath_prepend(str(tmp_path))  # the reward's own modules are importable, as on PYTHONPATH
    for module in ("mylib", "mypkg", "mypkg.rules"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    first = _spec_hash(tmp_path / "my_reward.py")
    name, old, new = edit
    (tmp_path / name).write_text((tmp_path / name).read_text().replace(old, new))
    assert _spec_hash(tmp_path / "my_reward.py") != first


def test_a_reward_that_is_a_callable_object_has_the_same_spec_at_every_load(tmp_path):
    custom = tmp_path / "my_reward.py"
    custom.write_text("class Scorer:\n    def __call__(self, data_source, solution_str, ground_truth, extra_info=None):\n"
                      "        return 1.0\n\nscore_it = Scorer()\n")
    cfg = _custom_config(custom)
    pinned = reward_spec(cfg, data_sources=["anything"])
    assert pinned["functions"]["anything"]["function"] == f"{custom.resolve()}:score_it"  # no object address
    assert check_reward_unchanged(cfg, pinned, "evaluate")["sha256"] == pinned["sha256"]


def test_the_reward_spec_of_a_set_constant_is_the_same_in_every_process(tmp_path):
    """A set of strings iterates in an order salted per process (PYTHONHASHSEED): the spec sorts it."""
    custom = tmp_path / "my_reward.py"
    custom.write_text(REWARD_WITH_HELPERS.format(keep="{'alpha', 'beta', 'gamma', 'delta', 'epsilon'}", limit=5))
    script = (f"from pathlib import Path; import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
              f"from test_pipeline_core import _spec_hash; print(_spec_hash(Path({str(custom)!r})))")
    # the three processes run side by side: each spends its seconds importing, and none depends on another
    started = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONHASHSEED": seed}) for seed in ("1", "2", "3")]
    outputs = [process.communicate(timeout=300) for process in started]
    assert [process.returncode for process in started] == [0, 0, 0], [err[-2000:] for _, err in outputs]
    hashes = {out.strip() for out, _ in outputs}
    assert len(hashes) == 1 and _spec_hash(custom) in hashes


def test_reward_spec_holds_the_reward_kwargs(tmp_path):
    custom = tmp_path / "my_reward.py"
    custom.write_text("def score_it(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
                      "    return scale\n")
    cfg = PPOConfig()
    cfg.custom_reward_function.path, cfg.custom_reward_function.name = str(custom), "score_it"
    plain = reward_spec(cfg, data_sources=["anything"])
    cfg.custom_reward_function.reward_kwargs = {"scale": 0.5}
    bound = reward_spec(cfg, data_sources=["anything"])
    # the same file and function, scoring with another scale: the spec says so and hashes differently
    assert bound["functions"]["anything"]["function"] == plain["functions"]["anything"]["function"]
    assert bound["functions"]["anything"]["source_sha256"] == plain["functions"]["anything"]["source_sha256"]
    assert (plain["functions"]["anything"]["parameters"]["scale"], bound["functions"]["anything"]["parameters"]["scale"]) \
        == (1.0, 0.5)
    assert bound["reward_kwargs"] == {"scale": 0.5} and "reward_kwargs" not in plain
    assert bound["sha256"] != plain["sha256"]


REWARD_WITH_PACKAGES = {
    "mylib.py": "import math\n\ndef longest(text):\n    from numpy import argmax\n"
                "    return int(argmax([len(w) for w in text.split()] or [0]))\n",
    "my_reward.py": "import json\nimport yaml\nfrom rlhf_core.rewards import gsm8k\nfrom mylib import longest\n\n"
                    "def score_it(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    import surely_not_installed_anywhere\n"
                    "    return float(longest(solution_str) > 0)\n",
}


@pytest.mark.parametrize("where", ["checkout", "elsewhere"])
def test_the_reward_spec_holds_the_version_of_each_package_the_reward_imports(tmp_path, monkeypatch, repo_root,
                                                                              where):
    """Packages imported by the reward or its own modules (at the top or inside a function) are pinned by
    their distributions' versions; the standard library, the user's files and this project are not, nor what
    this project imports, run from its checkout (where its files lie in the current directory) or not."""
    from importlib import metadata

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mylib", raising=False)
    monkeypatch.chdir(repo_root if where == "checkout" else tmp_path)
    for name, text in REWARD_WITH_PACKAGES.items():
        (tmp_path / name).write_text(text)
    cfg = _custom_config(tmp_path / "my_reward.py")
    pinned = reward_spec(cfg, data_sources=["anything"])
    assert pinned["packages"] == {"numpy": {"numpy": metadata.version("numpy")},
                                  "yaml": {"PyYAML": metadata.version("PyYAML")},
                                  "surely_not_installed_anywhere": "not installed"}
    assert check_reward_unchanged(cfg, pinned, "evaluate")["sha256"] == pinned["sha256"]
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda dist: "0.0.1" if dist == "PyYAML" else real(dist))  # an upgrade
    upgraded = reward_spec(cfg, data_sources=["anything"])
    assert upgraded["packages"]["yaml"] == {"PyYAML": "0.0.1"}
    assert upgraded["functions"] == pinned["functions"] and upgraded["sha256"] != pinned["sha256"]
    with pytest.raises(RewardChangedError, match="else its settings or packages"):
        check_reward_unchanged(cfg, pinned, "evaluate")


def test_a_reward_that_imports_no_package_hashes_as_before(tmp_path, monkeypatch):
    """Its spec has no ``packages`` and the very hash of the spec that came before them, as production's
    stored spec has: its reward is not evaluated again for nothing."""
    import ast
    import hashlib
    import json

    files = {"my_reward.py": "import json\nfrom mylib import LIMIT\n\n"
                             "def score_it(data_source, solution_str, ground_truth, extra_info=None):\n"
                             "    import math\n    return float(math.isfinite(len(solution_str)) > LIMIT)\n",
             "mylib.py": "from collections import Counter\nLIMIT = 5\n"}
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mylib", raising=False)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    path = (tmp_path / "my_reward.py").resolve()
    spec = reward_spec(_custom_config(path), data_sources=["anything"])
    code = "\n".join(f"# {name}\n{ast.unparse(ast.parse(text))}" for name, text in files.items())
    before = {"kind": "custom", "custom_path": str(path), "custom_name": "score_it", "full_score": 1.0,
              "functions": {"anything": {"function": f"{path}:score_it", "parameters": {}, "calls": {},
                                         "source_sha256": hashlib.sha256(code.encode()).hexdigest()}}}
    assert "packages" not in spec
    assert spec["sha256"] == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()


REWARD_WITH_PROJECT_MODULE = """\
import re
from rlhf_core.rewards import gsm8k


def score_it(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info == "never":
        from rlhf_core.rewards import surely_no_such_name
    return gsm8k.compute_score(re.sub(r"\\s+", " ", solution_str), ground_truth)
"""


def test_what_a_reward_imports_of_this_project_is_hashed_by_its_source_wherever_it_runs(tmp_path, monkeypatch,
                                                                                      repo_root):
    """Run from the checkout, this project's files are in the current directory, but not the user's code and
    their imports not the reward's packages: the spec is the one made elsewhere, with no packages. The module
    the reward imports enters by its code (not its comments), so another release of it is another spec."""
    import importlib.util

    import rlhf_core.rewards
    from rlhf_core.rewards import gsm8k

    custom = tmp_path / "user" / "my_reward.py"
    custom.parent.mkdir()
    custom.write_text(REWARD_WITH_PROJECT_MODULE)
    specs = {}
    for where in (repo_root, tmp_path):
        monkeypatch.chdir(where)
        specs[where] = reward_spec(_custom_config(custom), data_sources=["anything"])
    assert specs[repo_root]["sha256"] == specs[tmp_path]["sha256"]
    assert "packages" not in specs[tmp_path]  # the name that is not found is recorded, not pinned nor fatal

    def shipped(text: str) -> str:
        """The spec's hash where ``rlhf_core.rewards.gsm8k`` holds ``text``, as the reward imports it."""
        copy = tmp_path / f"gsm8k_{len(list(tmp_path.glob('gsm8k_*.py')))}.py"
        copy.write_text(text)
        found = importlib.util.spec_from_file_location(gsm8k.__name__, copy)
        module = importlib.util.module_from_spec(found)
        found.loader.exec_module(module)
        monkeypatch.setattr(rlhf_core.rewards, "gsm8k", module)
        monkeypatch.setitem(sys.modules, gsm8k.__name__, module)
        return _spec_hash(custom)

    source = Path(gsm8k.__file__).read_text()
    assert "\nSOLUTION_CLIP_CHARS = 300\n" in source
    assert shipped("# a comment\n" + source) == specs[tmp_path]["sha256"]
    assert shipped(source.replace("\nSOLUTION_CLIP_CHARS = 300\n", "\nSOLUTION_CLIP_CHARS = 30\n")) \
        != specs[tmp_path]["sha256"]


def test_a_namespace_package_beside_the_reward_is_the_users_code_not_a_package_to_pin(tmp_path, monkeypatch):
    """A directory without ``__init__.py`` beside the reward is imported from there: its modules are hashed,
    and its name is not pinned as a package that is not installed."""
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("my_shared_rules", "my_shared_rules.limits"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    (tmp_path / "my_shared_rules").mkdir()
    (tmp_path / "my_shared_rules" / "limits.py").write_text("LIMIT = 5\n")
    custom = tmp_path / "my_reward.py"
    custom.write_text("from my_shared_rules.limits import LIMIT\n\n"
                      "def score_it(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) > LIMIT)\n")
    first = reward_spec(_custom_config(custom), data_sources=["anything"])
    assert "packages" not in first
    (tmp_path / "my_shared_rules" / "limits.py").write_text("LIMIT = 50\n")
    assert _spec_hash(custom) != first["sha256"]


def test_a_directory_named_as_an_installed_package_does_not_unpin_it(tmp_path, monkeypatch):
    """An empty ``yaml/`` beside the reward: Python imports the installed PyYAML before a namespace directory, so
    PyYAML is what runs and stays pinned."""
    from importlib import metadata

    monkeypatch.chdir(tmp_path)
    (tmp_path / "yaml").mkdir()
    custom = tmp_path / "my_reward.py"
    custom.write_text("import yaml\n\ndef score_it(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(bool(yaml.safe_load(solution_str or '0')))\n")
    spec = reward_spec(_custom_config(custom), data_sources=["anything"])
    assert spec["packages"] == {"yaml": {"PyYAML": metadata.version("PyYAML")}}


def test_a_namespace_package_pins_the_distribution_of_the_part_imported(tmp_path, monkeypatch):
    """``google`` is filled by several distributions here (protobuf, google-auth, ...: what ray and mlflow bring):
    a reward importing google.protobuf pins protobuf alone, and one importing google.auth google-auth alone, so an
    upgrade of another part does not ask for production to be evaluated again."""
    from importlib import metadata

    assert len(set(metadata.packages_distributions()["google"])) > 1
    monkeypatch.chdir(tmp_path)
    custom = tmp_path / "my_reward.py"
    custom.write_text("from google.protobuf import message\nimport google.auth.transport\n\n"
                      "def score_it(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1.0\n")
    spec = reward_spec(_custom_config(custom), data_sources=["anything"])
    assert spec["packages"] == {"google.auth": {"google-auth": metadata.version("google-auth")},
                                "google.protobuf": {"protobuf": metadata.version("protobuf")}}
    custom.write_text("from google import protobuf\n\n"
                      "def score_it(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1.0\n")
    assert reward_spec(_custom_config(custom), data_sources=["anything"])["packages"] == {
        "google.protobuf": {"protobuf": metadata.version("protobuf")}}
    # deeper: opentelemetry.exporter.otlp.proto is shared by two distributions (wandb brings both); its http part
    # is one of them alone
    otlp = "opentelemetry-exporter-otlp-proto-"
    assert {f"{otlp}common", f"{otlp}http"} <= set(metadata.packages_distributions()["opentelemetry"])
    custom.write_text("from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter\n\n"
                      "def score_it(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1.0\n")
    assert reward_spec(_custom_config(custom), data_sources=["anything"])["packages"] == {
        "opentelemetry.exporter.otlp.proto.http": {f"{otlp}http": metadata.version(f"{otlp}http")}}


def test_reference_check_names_the_rows_that_do_not_earn_full_marks(tmp_path):
    import pandas as pd

    paths = build_dataset(tmp_path / "data", n_train=4, n_test=6, seed=0, max_ops=1)
    cfg = PPOConfig()
    cfg.data.val_files = str(paths["test"])
    assert check_reference_solutions(cfg).success
    frame = pd.read_parquet(paths["test"])
    frame.at[2, "reward_model"] = {"style": "rule", "ground_truth": "99999"}
    frame.to_parquet(paths["test"], index=False)
    check = check_reference_solutions(cfg)
    assert (check.checked, [m["row"] for m in check.mismatches]) == (6, [2])
    assert f"{paths['test']} row 2" in check.summary() and "'99999'" in check.summary()


def _integer_truths(path: Path, truths: list, answers: list) -> None:
    """A prompt file whose ground truths are integers, one of them null, with the reference solutions ``answers``
    (None: the row has no extra_info, which pandas reads as a null index)."""
    pd.DataFrame([{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"q{row}"}],
                   "reward_model": {"style": "rule", "ground_truth": truth},
                   "extra_info": {"split": "test", "index": 10 + row, "answer": answer} if answer else None}
                  for row, (truth, answer) in enumerate(zip(truths, answers))]).to_parquet(path, index=False)


def test_the_reference_check_hands_integer_ground_truths_over_as_integers_beside_a_null(tmp_path):
    """The self-check reads the rows as training does: an integer ground truth stays an integer where another row's
    is null (pandas made them all floats, 72.0, which a reward comparing text grades wrong against '#### 72')."""
    custom = tmp_path / "my_reward.py"
    custom.write_text("def score_it(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(solution_str.rsplit('####', 1)[-1].strip() == str(ground_truth))\n")
    cfg = _custom_config(custom)
    cfg.data.val_files = str(tmp_path / "val.parquet")
    _integer_truths(tmp_path / "val.parquet", [72, 5, None], ["6 * 12 = 72\n#### 72", "2 + 3 = 5\n#### 5", None])
    check = check_reference_solutions(cfg)
    assert (check.checked, check.mismatches) == (2, []), check.summary()


def test_the_reference_check_grades_and_names_integer_ground_truths_as_they_are_stored(tmp_path):
    # 2**53 + 1 = 9007199254740993 has no double: as a float it is ...992, and its right answer was graded wrong
    cfg = PPOConfig()
    cfg.data.val_files = str(tmp_path / "val.parquet")
    _integer_truths(tmp_path / "val.parquet", [2**53 + 1, 99999, None],
                    ["#### 9007199254740993", "#### 5", None])
    check = check_reference_solutions(cfg)
    assert check.checked == 2
    assert [(m["row"], m["index"], m["ground_truth"]) for m in check.mismatches] == [(1, 11, 99999)]
    assert [type(m["index"]) for m in check.mismatches] == [int]
    assert [type(m["ground_truth"]) for m in check.mismatches] == [int]
    assert "row 1 (data_source=openai/gsm8k): ground truth 99999, reward {" in check.summary()


def test_the_pipeline_needs_a_ground_truth_where_training_or_its_evaluation_grades_with_the_rule(tmp_path):
    """validate_data held every run to a ground truth on every row: a custom reward's run on prompts without one
    was refused though training, the reward's self-check and the evaluation all grade with that function; a reward
    model at rule_coef=0 trains without one, while the evaluation grades the validation set with the rule."""
    from rlhf_core.data.validation import validate_dataset

    reward_model = ["reward_model.enable=true", "reward_model.model.path=rm"]
    custom = ["custom_reward_function.path=reward.py"]
    runs = {  # -> (train, val) needed, and the validation set's reason
        "built-in rule": ([], (True, True), None),
        "reward model and rule": ([*reward_model, "reward_model.rule_coef=0.5"], (True, True), None),
        "reward model alone": ([*reward_model, "reward_model.rule_coef=0"], (False, True), RULE_GRADES_EVALUATION),
        "custom reward": (custom, (False, False), None),
        "reward model, custom reward": ([*reward_model, "reward_model.rule_coef=0", *custom], (False, False), None),
    }
    for run, (overrides, required, reason) in runs.items():
        needs = ground_truth_needs(load_config(overrides, validate=False))
        assert needs == {"ground_truth_required": required, "ground_truth_reason": (None, reason)}, run
    assert "evaluate step grades every validation problem with the built-in rule" in RULE_GRADES_EVALUATION
    # as validate_data calls it: prompts alone to train on, a validation row without a ground truth
    paths = build_dataset(tmp_path / "data", n_train=4, n_test=3, seed=0, max_ops=1)
    pd.read_parquet(paths["train"]).drop(columns=["reward_model"]).to_parquet(paths["train"], index=False)
    val = pd.read_parquet(paths["test"])
    val.at[1, "reward_model"] = {"style": "rule", "ground_truth": None}
    val.to_parquet(paths["test"], index=False)
    alone = validate_dataset(paths["train"], paths["test"], kind="prompt",
                             **ground_truth_needs(load_config(runs["reward model alone"][0], validate=False)))
    assert [(o.name, o.column, o.dataset) for o in alone.failures] == [("not_null", "ground_truth", "val")]
    assert f"reward_model.ground_truth is never null ({RULE_GRADES_EVALUATION})" in alone.summary()
    graded = validate_dataset(paths["train"], paths["test"], kind="prompt", custom_reward=True,
                              **ground_truth_needs(load_config(custom, validate=False)))
    assert graded.success, graded.summary()


def test_rlhf_core_modules_behind_the_steps_import_no_orchestrator():
    import subprocess
    import sys

    code = ("import sys\nimport rlhf_core.pipeline.evaluate, rlhf_core.pipeline.lineage, rlhf_core.pipeline.promotion, rlhf_core.pipeline.schedule, "
            "rlhf_core.pipeline.run_config, rlhf_core.pipeline.smoke, rlhf_core.pipeline.training\nassert 'zenml' not in sys.modules, 'rlhf_core imported zenml'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_the_kubeflow_example_mounts_the_model_and_data_wherever_they_are_read(repo_root):
    """Each step that reads the trainer config's model or data paths runs in a pod with both volumes mounted (its
    own pod settings where it has them, else the pipeline's), and the paths the example gives lie on them."""
    import yaml
    from zenml.config.pipeline_run_configuration import PipelineRunConfiguration

    raw = yaml.safe_load((repo_root / "configs" / "kubeflow_example.yaml").read_text())
    PipelineRunConfiguration.model_validate(raw)  # keys ZenML knows
    pipeline_pod = raw["settings"]["orchestrator.kubeflow"]["pod_settings"]
    for step in ("validate_data", "define_reward", "smoke_test", "train_ppo", "evaluate"):
        own = raw["steps"].get(step, {}).get("settings", {}).get("orchestrator.kubeflow", {}).get("pod_settings")
        pod = own or pipeline_pod
        claims = {volume["name"] for volume in pod["volumes"]}
        mounted = {mount["mountPath"] for mount in pod["volume_mounts"] if mount["name"] in claims}
        assert {"/models", "/data"} <= mounted, step
    parameters = raw["parameters"]
    paths = [parameters["train_files"], parameters["val_files"]] + [o.split("=", 1)[1] for o in parameters["overrides"]]
    assert all(path.startswith(("/models/", "/data/")) for path in paths), paths


# --- the training step: history across a resume, the warm-start path, the way on after a failure ---------------


def _metrics_file(folder: Path, lines: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))


def test_the_whole_history_joins_the_run_resumed_from_and_keeps_each_steps_last_record(tmp_path):
    from rlhf_core.main_ppo import RunResult
    from rlhf_core.pipeline.training import whole_history
    from rlhf_core.training.trainer import StepResult

    other, own = tmp_path / "other", tmp_path / "own"
    # the earlier run: validation at 0, steps 1-4, checkpointed at 3 (its step 4 is not this run's)
    _metrics_file(other, ['{"step": 0, "val": 0.1}', '{"step": 1, "r": 10}', '{"step": 2, "r": 20, "kl": null}',
                          '{"step": 3, "r": 30}', '{"step": 4, "r": 41}'])
    # this run: an attempt that logged step 4 and died, the retry's step 4 again, a partial last line
    _metrics_file(own, ['{"step": 4, "r": 999}', '{"step": 4, "r": 40.5}', '{"step": 5, "r": 50.5}', '{"step": 6, "r'])
    result = RunResult(steps=5, wall_s=1.0, local_dir=str(own), checkpoint=str(own / "global_step_5"),
                       history=[StepResult(5, {"r": 50.5, "nan": float("nan")})],
                       resumed_from=str(other / "global_step_3"))
    # a value that was not finite (the file's null, the run's NaN) stays, as None: the curves mark its step
    assert whole_history(result) == [{"step": 1, "r": 10.0}, {"step": 2, "r": 20.0, "kl": None},
                                     {"step": 3, "r": 30.0}, {"step": 4, "r": 40.5},
                                     {"step": 5, "r": 50.5, "nan": None}]
    # resumed at the earlier run's last step with nothing left to train: its step 4 is still not this run's
    nothing = RunResult(steps=3, wall_s=1.0, local_dir=str(tmp_path / "none"), checkpoint=None,
                        resumed_from=str(other / "global_step_3"))
    assert [record["step"] for record in whole_history(nothing)] == [1, 2, 3]
    # without metrics files (no file logger): the run's own steps
    bare = RunResult(steps=5, wall_s=1.0, local_dir=str(tmp_path / "none"), checkpoint=None,
                     history=[StepResult(5, {"r": 50.5})])
    assert whole_history(bare) == [{"step": 5, "r": 50.5}]


def test_the_whole_history_from_step_0_holds_the_validation_before_training(tmp_path):
    """The pipeline's curves started at the first step trained: the validation accuracy before training (step 0,
    the point every later one is read against) was logged but not drawn."""
    from rlhf_core.main_ppo import RunResult
    from rlhf_core.pipeline.training import whole_history
    from rlhf_core.training.trainer import StepResult

    other, own = tmp_path / "other", tmp_path / "own"
    _metrics_file(other, ['{"step": 0, "val": 0.1}', '{"step": 1, "r": 10}', '{"step": 2, "r": 20}'])
    resumed = RunResult(steps=3, wall_s=1.0, local_dir=str(own), checkpoint=None,
                        history=[StepResult(3, {"r": 30.0})], resumed_from=str(other / "global_step_2"))
    assert whole_history(resumed, first_step=0) == [{"step": 0, "val": 0.1}, {"step": 1, "r": 10.0},
                                                    {"step": 2, "r": 20.0}, {"step": 3, "r": 30.0}]
    assert [record["step"] for record in whole_history(resumed)] == [1, 2, 3]  # the steps trained alone
    # without a metrics file: this run's own validation before its first step
    bare = RunResult(steps=1, wall_s=1.0, local_dir=str(tmp_path / "none"), checkpoint=None,
                     history=[StepResult(1, {"r": 5.0})], val_before_train={"val": 0.25, "nan": float("nan")})
    assert whole_history(bare, first_step=0) == [{"step": 0, "val": 0.25, "nan": None}, {"step": 1, "r": 5.0}]


def test_the_whole_history_of_a_retry_begins_with_the_earlier_run_the_first_attempt_resumed_from(tmp_path):
    """Set to resume from an earlier run's step 2, the first attempt trained steps 3-4 in its own folder (saving
    step 3); its retry resumed from that step 3: steps 1-2 come from the earlier run's folder."""
    from rlhf_core.main_ppo import RunResult
    from rlhf_core.pipeline.training import whole_history
    from rlhf_core.training.trainer import StepResult

    earlier, own = tmp_path / "run-1", tmp_path / "run-2"
    _metrics_file(earlier, ['{"step": 1, "r": 1}', '{"step": 2, "r": 2}', '{"step": 3, "r": 333}'])
    _metrics_file(own, ['{"step": 3, "r": 3}', '{"step": 4, "r": 444}', '{"step": 4, "r": 4}'])
    result = RunResult(steps=4, wall_s=1.0, local_dir=str(own), checkpoint=str(own / "global_step_4"),
                       history=[StepResult(4, {"r": 4.0})], resumed_from=str(own / "global_step_3"))
    expected = [{"step": 1, "r": 1.0}, {"step": 2, "r": 2.0}, {"step": 3, "r": 3.0}, {"step": 4, "r": 4.0}]
    assert whole_history(result, str(earlier / "global_step_2")) == expected
    # the first attempt itself (resumed from the configured path): no step twice
    first = RunResult(steps=4, wall_s=1.0, local_dir=str(own), checkpoint=str(own / "global_step_4"),
                      history=[StepResult(3, {"r": 3.0}), StepResult(4, {"r": 4.0})],
                      resumed_from=str(earlier / "global_step_2"))
    assert whole_history(first, str(earlier / "global_step_2")) == expected


def _ppo_checkpoint(folder: Path, step: int) -> Path:
    from rlhf_core.training.checkpoint import write_checkpoint

    write_checkpoint(folder, step, lambda files: files.text("actor/x.txt", "x") or ["actor"])
    return folder / f"global_step_{step}"


def test_a_retry_of_the_training_step_resumes_from_the_runs_own_latest_checkpoint(tmp_path, capsys):
    """A run set to resume from an earlier run's step 7 (resume_path), whose first attempt saved step 9 in its own
    folder: its retry resumes from that step 9 and says so; before any save of its own, from step 7. A run set to
    start afresh (disable) resumes its own checkpoint on a retry too; auto does so by itself."""
    from types import SimpleNamespace

    from rlhf_core.pipeline.training import resume_own_checkpoint
    from rlhf_core.training.checkpoint import find_resume_checkpoint

    earlier, own = tmp_path / "run-1", tmp_path / "run-2"
    configured = str(_ppo_checkpoint(earlier, 7))
    trainer = SimpleNamespace(resume_mode="resume_path", resume_from_path=configured, default_local_dir=str(own),
                              val_only=False)
    resume_own_checkpoint(trainer)  # the first attempt: nothing of its own yet
    assert find_resume_checkpoint(SimpleNamespace(trainer=trainer)) == earlier / "global_step_7"
    assert capsys.readouterr().err == ""
    _ppo_checkpoint(own, 9)
    resume_own_checkpoint(trainer)
    assert find_resume_checkpoint(SimpleNamespace(trainer=trainer)) == own / "global_step_9"
    assert capsys.readouterr().err == (
        f"notice: this run's checkpoint folder {own} holds global_step_9, saved by an earlier attempt of this step: "
        f"this retry resumes from its latest checkpoint there, not from trainer.resume_from_path={configured}\n")
    afresh = SimpleNamespace(resume_mode="disable", resume_from_path=None, default_local_dir=str(own), val_only=False)
    resume_own_checkpoint(afresh)
    assert find_resume_checkpoint(SimpleNamespace(trainer=afresh)) == own / "global_step_9"
    assert "not afresh as trainer.resume_mode=disable says" in capsys.readouterr().err
    auto = SimpleNamespace(resume_mode="auto", resume_from_path=None, default_local_dir=str(own), val_only=False)
    resume_own_checkpoint(auto)
    assert auto.resume_mode == "auto" and capsys.readouterr().err == ""


def test_the_warm_start_policy_is_copied_once_to_a_path_named_by_the_artifact(tmp_path):
    from rlhf_core.pipeline.training import stable_copy

    first, second = tmp_path / "unpacked_1", tmp_path / "unpacked_2"
    for folder, text in ((first, "a"), (second, "b")):
        folder.mkdir()
        (folder / "config.json").write_text(text)
    target = stable_copy(first, tmp_path / "runs", "warm_start/4f2a")
    assert target == tmp_path / "runs" / "warm_start" / "4f2a" and (target / "config.json").read_text() == "a"
    assert stable_copy(second, tmp_path / "runs", "warm_start/4f2a") == target  # a retry: the same path, not copied
    assert (target / "config.json").read_text() == "a"


def test_a_failed_training_run_in_a_pipeline_says_how_to_go_on_from_its_checkpoint(tmp_path):
    from rlhf_core.pipeline.training import add_resume_advice
    from rlhf_core.training.checkpoint import write_checkpoint

    error = RuntimeError("training step 3 failed: ... rerun to resume from it")
    add_resume_advice(error, tmp_path)
    assert not getattr(error, "__notes__", [])  # nothing saved: nothing to go on from
    write_checkpoint(tmp_path, 2, lambda files: [])
    add_resume_advice(error, tmp_path)
    [note] = error.__notes__  # (a message with no "rerun the same command" in it to put the way on in place of)
    assert f"trainer.resume_mode=resume_path and trainer.resume_from_path={tmp_path / 'global_step_2'}" in note
    assert str(error) == "training step 3 failed: ... rerun to resume from it"


def test_an_interrupted_training_in_a_pipeline_says_how_to_go_on_where_it_said_rerun(tmp_path):
    """A run stopped by SIGTERM names its checkpoint and 'rerun the same command to resume': in a pipeline that
    clause gives way to the resume_path overrides; a checkpoint of another folder is left as it is said."""
    from rlhf_core.pipeline.training import add_resume_advice
    from rlhf_core.training.checkpoint import write_checkpoint
    from rlhf_core.training.guards import TrainingInterrupted

    write_checkpoint(tmp_path, 2, lambda files: [])
    latest = tmp_path / "global_step_2"
    error = TrainingInterrupted("SIGTERM", 15, 2, str(latest))
    add_resume_advice(error, tmp_path)
    assert str(error) == (f"interrupted by SIGTERM after step 2: checkpoint saved at {latest}; add "
                          f"trainer.resume_mode=resume_path and trainer.resume_from_path={latest} to the run config's "
                          "overrides, then run the pipeline again, to resume from it (run again as it is, the pipeline "
                          "starts afresh in a folder of its own; a retry of this step in this run resumes there by "
                          "itself)")
    assert not getattr(error, "__notes__", [])
    elsewhere = TrainingInterrupted("SIGTERM", 15, 5, "/runs/a/global_step_5")  # resumed from there, nothing saved
    add_resume_advice(elsewhere, tmp_path)
    assert str(elsewhere) == ("interrupted by SIGTERM after step 5: checkpoint saved at /runs/a/global_step_5; rerun "
                              "the same command to resume")


def test_a_failed_training_of_a_run_set_to_resume_from_a_path_says_to_change_that_path(tmp_path):
    """Run again as it is, a run set to resume from an earlier run's step 7 resumes from that step 7 again: the way
    on from its own step 9 puts step 9 in place of step 7, and says what running again as it is does."""
    from rlhf_core.pipeline.training import add_resume_advice
    from rlhf_core.training.guards import TrainingInterrupted

    configured = "/runs/run-1/global_step_7"
    latest = _ppo_checkpoint(tmp_path, 9)
    error = TrainingInterrupted("SIGTERM", 15, 9, str(latest), "rerun with trainer.resume_mode=auto")
    add_resume_advice(error, tmp_path, configured)
    way = (f"put trainer.resume_from_path={latest} in the run config's overrides, in place of "
           "/runs/run-1/global_step_7, then run the pipeline again, to resume from it (run again as it is, the "
           "pipeline resumes from /runs/run-1/global_step_7 again, in a folder of its own; a retry of this step in "
           "this run resumes from this run's latest checkpoint by itself)")
    assert str(error) == f"interrupted by SIGTERM after step 9: checkpoint saved at {latest}; {way}"
    assert error.resume_advice == way


def test_the_failure_recorded_keeps_the_whole_way_on_of_a_run_set_to_resume_from_a_path(tmp_path):
    """A reward that fails in a run set to resume from an earlier run's checkpoint: the way on names this run's
    checkpoint twice and the earlier one twice; with folders named as pipeline runs are, the version's recorded
    failure keeps it whole."""
    from rlhf_core.pipeline.failure import failure_record
    from rlhf_core.pipeline.training import add_resume_advice

    own = tmp_path / "checkpoints" / "rlhf_ppo_pipeline-2026_12_06-02_06_54_020361"
    configured = str(tmp_path / "checkpoints" / "rlhf_ppo_pipeline-2026_12_05-23_41_07_551902" / "global_step_120")
    latest = _ppo_checkpoint(own, 180)
    error = RuntimeError(f"training step 181 failed: reward function 'compute_score' failed on sample 3 (data_source="
                         "'openai/gsm8k', extra_info.index=5120): ConnectionError: the grading server refused the "
                         f"connection\nthe latest checkpoint {latest} is intact: fix the reward function"
                         " (an edit of its code also needs trainer.allow_reward_code_change=true), then rerun "
                         "with trainer.resume_mode=auto to resume from it")
    add_resume_advice(error, own, configured)
    record = failure_record("train_ppo", error, "r-1", "id-1")
    assert record["failure"].endswith(f"resumes from {configured} again, in a folder of its own; a retry of this step "
                                      "in this run resumes from this run's latest checkpoint by itself)")


def test_the_way_on_finds_the_checkpoint_of_a_folder_written_with_a_tilde(tmp_path, monkeypatch):
    """trainer.default_local_dir=~/ckpt: the trainer saves under the home folder, where the way on looks too."""
    from rlhf_core.pipeline.training import add_resume_advice
    from rlhf_core.training.guards import TrainingInterrupted

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    latest = _ppo_checkpoint(tmp_path / "home" / "ckpt" / "run-1", 2)
    error = TrainingInterrupted("SIGTERM", 15, 2, str(latest))
    add_resume_advice(error, "~/ckpt/run-1")
    assert str(error) == (f"interrupted by SIGTERM after step 2: checkpoint saved at {latest}; add "
                          f"trainer.resume_mode=resume_path and trainer.resume_from_path={latest} to the run config's "
                          "overrides, then run the pipeline again, to resume from it (run again as it is, the pipeline "
                          "starts afresh in a folder of its own; a retry of this step in this run resumes there by "
                          "itself)")


def test_without_exception_notes_the_advice_goes_to_stderr(tmp_path, capsys):
    """Python 3.10's exceptions take no notes (add_note is 3.11's): the advice is printed instead."""
    from types import SimpleNamespace

    from rlhf_core.pipeline.training import add_resume_advice
    from rlhf_core.training.checkpoint import write_checkpoint

    write_checkpoint(tmp_path, 2, lambda files: [])
    add_resume_advice(SimpleNamespace(), tmp_path)  # an error as Python 3.10 makes it, for what is read of it
    assert f"trainer.resume_from_path={tmp_path / 'global_step_2'}" in capsys.readouterr().err


def test_a_remote_orchestrators_trainer_config_is_left_to_its_step_where_it_resolves_only_there(monkeypatch,
                                                                                                tmp_path, capsys):
    """A remote orchestrator's pods read the trainer config from their own volume, with their own environment:
    a file only there, or a ${oc.env:VAR} set only there, is left to the load_ppo_config step; the local
    orchestrator's run (the steps read what this machine has) refuses both, and the gates are refused either way."""
    from rlhf_core.pipeline import run_config
    from rlhf_core.pipeline.run_config import RunConfigError, check_run_config

    monkeypatch.setattr(run_config, "check_not_cached", lambda: None)  # (asks a pipeline being compiled)
    monkeypatch.delenv("PODS_CKPT_ROOT", raising=False)
    env = tmp_path / "env.yaml"
    env.write_text("trainer:\n  default_local_dir: ${oc.env:PODS_CKPT_ROOT}/ppo\n")
    on_pods = tmp_path / "pods" / "ppo.yaml"
    data = ("/data/train.parquet", "/data/test.parquet")

    monkeypatch.setattr(run_config, "steps_run_here", lambda: True)
    with pytest.raises(RunConfigError, match="Environment variable 'PODS_CKPT_ROOT' not found"):
        check_run_config(str(env), [], *data, 0.0, 0.05)
    with pytest.raises(RunConfigError, match=f"config file {re.escape(str(on_pods))} does not exist"):
        check_run_config(str(on_pods), [], *data, 0.0, 0.05)

    monkeypatch.setattr(run_config, "steps_run_here", lambda: False)
    capsys.readouterr()
    check_run_config(str(env), [], *data, 0.0, 0.05)
    check_run_config(str(on_pods), [], *data, 0.0, 0.05)
    check_run_config(str(on_pods), [], *data, 0.0, 0.05, trains_reward_model=True, min_pair_accuracy=0.6)
    demo = str(Path(__file__).parents[1] / "configs" / "ppo_demo_cpu.yaml")
    check_run_config(demo, ["trainer.default_local_dir=${oc.env:PODS_CKPT_ROOT}"], *data, 0.0, 0.05)
    err = capsys.readouterr().err
    assert ("notice: the trainer config reads environment variable(s) PODS_CKPT_ROOT, not set on this machine: the "
            "load_ppo_config step resolves and checks it where it runs") in err
    assert f"notice: the trainer config {on_pods} is not on this machine: the load_ppo_config step resolves" in err
    # what resolves here is still checked; the gates need no trainer config
    with pytest.raises(RunConfigError, match="unknown config key trainer.total_trainig_steps"):
        check_run_config(demo, ["trainer.total_trainig_steps=2"], *data, 0.0, 0.05)
    with pytest.raises(RunConfigError, match=r"min_improvement=1\.5 is a gain in accuracy"):
        check_run_config(str(on_pods), [], *data, 1.5, 0.05)
    with pytest.raises(RunConfigError, match=r"min_pair_accuracy \(a pipeline parameter\)=1\.5 must be a share"):
        check_run_config(str(on_pods), [], *data, 0.0, 0.05, trains_reward_model=True, min_pair_accuracy=1.5)
    monkeypatch.setenv("PODS_CKPT_ROOT", str(tmp_path))  # set here too: resolved here, and a typo refused
    with pytest.raises(RunConfigError, match="unknown config key trainer.total_trainig_steps"):
        check_run_config(str(env), ["trainer.total_trainig_steps=2"], *data, 0.0, 0.05)


def test_the_dry_run_leaves_out_its_copies_data_notices_and_passes_the_rest_as_it_comes():
    # what the dry run's trainers write while they are built: its copies' data notices are left out; every other
    # line (a progress bar's frames, without a newline, among them) reaches stderr at once and in the order written
    import io

    from rlhf_core.pipeline.smoke import DATA_NOTICES, WithoutNotices

    out = io.StringIO()
    stream = WithoutNotices(out, DATA_NOTICES)
    stream.write("loading: 0%")
    assert out.getvalue() == "loading: 0%"  # not held for a newline
    stream.write("\rloading: 100%\n")
    stream.write("notice: data.train_")  # a notice written in pieces: held while it could be one ...
    assert out.getvalue() == "loading: 0%\rloading: 100%\n"
    stream.write("files: data.truncation=left cut 4 of 4 prompts\nwarning: kept\n")  # ... and left out
    stream.write("notice: data.val_files: 2 prompts end with an answer\nnotice: data.seed follows trainer.seed\n")
    stream.write("notice: d")  # held: it could still be one ...
    stream.write("ata.x\n")  # ... and is not
    stream.write("notice: ")
    stream.close_line()  # a start that could have been one, the last written: written as it was
    assert out.getvalue() == ("loading: 0%\rloading: 100%\nwarning: kept\nnotice: data.seed follows trainer.seed\n"
                              "notice: data.x\nnotice: ")
    assert stream.encoding == out.encoding  # the stream's own attributes, for a progress bar's checks


def test_the_evaluate_step_passes_a_progress_bar_frame_in_one_write():
    """NoticesOnce (the evaluate step's) cut each frame of a progress bar (``\\r`` then the bar, no newline:
    transformers' "Loading weights" at each model load) at its ``\\r``, in two writes: ZenML's step log, which
    puts the step's name after each ``\\r`` of a write and at the start of every other, showed it twice a frame
    (``[evaluate] [evaluate] Loading weights``) with its console step names on."""
    import contextlib

    from rlhf_core.pipeline.evaluate import NoticesOnce

    class Writes:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    out = Writes()
    frames = ["\rLoading weights:   0%|          | 0/20", "\rLoading weights: 100%|##########| 20/20", "\n"]
    with contextlib.redirect_stderr(out):
        once = NoticesOnce()
        for _ in range(2):
            with once.said():
                for frame in frames:
                    sys.stderr.write(frame)
                sys.stderr.write("notice: data cut 3 of 4 prompts\nnext\r50%")
    assert out.writes == [*frames, "notice: data cut 3 of 4 prompts\n", "next\r50%", *frames, "next\r50%"]


def test_the_evaluate_steps_stderr_is_the_streams_own_to_a_progress_bar():
    """Under NoticesOnce stderr had no encoding (nor isatty, fileno): tqdm, which draws its bar in blocks where the
    stream's encoding is UTF-8, drew transformers' "Loading weights" in ``#`` at each model the step loaded."""
    import contextlib
    import io

    from tqdm import tqdm

    from rlhf_core.pipeline.evaluate import NoticesOnce

    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="utf-8", write_through=True)
    with contextlib.redirect_stderr(out):
        with NoticesOnce().said():
            assert (sys.stderr.encoding, sys.stderr.isatty(), sys.stderr.fileno) == ("utf-8", False, out.fileno)
            with tqdm(total=2, file=sys.stderr, ncols=30) as bar:
                bar.update(2)
    assert "\u2588" in raw.getvalue().decode("utf-8")  # a full block: the bar drawn in the stream's encoding
