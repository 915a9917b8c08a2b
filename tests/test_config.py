"""The config tree: defaults, YAML mirror, overrides, aliases and every validation error."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from rlhf_core.config import ConfigError, all_keys, defaults_yaml, load_config, parse_override


def _errors(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(list(overrides), notice=lambda _: None)
    return "\n".join(info.value.errors)


def test_defaults_are_valid_and_match_verl():
    cfg = load_config([])
    assert cfg.data.train_batch_size == 1024
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 256
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4
    assert cfg.actor_rollout_ref.actor.clip_ratio == 0.2
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert cfg.critic.optim.lr == 1e-5
    assert cfg.actor_rollout_ref.rollout.name == "hf"
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.001
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"


def test_yaml_file_mirrors_the_dataclasses(repo_root):
    text = (repo_root / "configs" / "ppo_trainer.yaml").read_text()
    assert text == defaults_yaml(), "regenerate with: python -m rlhf_core.config --defaults > configs/ppo_trainer.yaml"
    tree = yaml.safe_load(text)
    # every key in the YAML has a comment, and the YAML holds exactly the dataclass keys
    body = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert all("  # " in line for line in body)
    flat = []

    def walk(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat.append(f"{prefix}{key}")

    walk(tree)
    assert sorted(flat) == sorted(all_keys())
    loaded = load_config(config_file=repo_root / "configs" / "ppo_trainer.yaml")
    assert loaded == load_config([])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a.b=3", 3),
        ("a.b=0.5", 0.5),
        ("a.b=true", True),
        ("a.b=False", False),
        ("a.b=null", None),
        ("a.b=[x,y]", ["x", "y"]),
        ("a.b=[0.9, 0.95]", [0.9, 0.95]),
        ("a.b=hello", "hello"),
        ("+a.b=1", 1),
    ],
)
def test_parse_override_values(text, expected):
    key, value = parse_override(text)
    assert key == "a.b"
    assert value == expected


def test_overrides_are_typed():
    cfg = load_config(
        [
            "actor_rollout_ref.actor.optim.lr=1e-5",  # YAML 1.1 reads this as a string
            "actor_rollout_ref.actor.optim.betas=[0.9,0.95]",
            "data.train_batch_size=512",
            "critic.optim.weight_decay=0",
            "trainer.logger=[console,file]",
            "data.train_files=[a.parquet,b.parquet]",
            "trainer.total_training_steps=null",
            "trainer.experiment_name=run7",
        ]
    )
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-5)
    assert isinstance(cfg.actor_rollout_ref.actor.optim.lr, float)
    assert cfg.actor_rollout_ref.actor.optim.betas == [0.9, 0.95]
    assert cfg.data.train_batch_size == 512
    assert cfg.critic.optim.weight_decay == 0.0 and isinstance(cfg.critic.optim.weight_decay, float)
    assert cfg.trainer.logger == ["console", "file"]
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/run7"


def test_config_file_then_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train_batch_size: 64\n  max_prompt_length: 128\ntrainer:\n  seed: 7\n")
    cfg = load_config(["data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=16", "trainer.n_gpus_per_node=1"],
                      config_file=path)
    assert cfg.data.train_batch_size == 32  # the command line wins
    assert cfg.data.max_prompt_length == 128
    assert cfg.trainer.seed == 7


def test_aliases_map_to_canonical_keys_with_a_notice():
    notices = []
    cfg = load_config(
        [
            "actor_rollout_ref.actor.optim.max_grad_norm=0.5",
            "critic.optim.max_grad_norm=0.3",
            "trainer.checkpoint.every_n_steps=25",
            "algorithm.kl_ctrl_target=0.02",
        ],
        notice=notices.append,
    )
    assert cfg.actor_rollout_ref.actor.grad_clip == 0.5
    assert cfg.critic.grad_clip == 0.3
    assert cfg.trainer.save_freq == 25
    assert cfg.algorithm.kl_ctrl.target_kl == 0.02
    assert cfg.algorithm.kl_ctrl.type == "adaptive"
    assert len(notices) == 4
    assert "actor_rollout_ref.actor.grad_clip" in notices[0]
    assert "trainer.save_freq" in notices[2]


def test_alias_inside_a_yaml_file(tmp_path):
    path = tmp_path / "guide.yaml"
    path.write_text("trainer:\n  checkpoint:\n    every_n_steps: 10\n")
    assert load_config(config_file=path, notice=lambda _: None).trainer.save_freq == 10


def test_unknown_key_suggests_the_closest():
    message = _errors("actor_rollout_ref.actor.clip_ratoi=0.1")
    assert "unknown config key actor_rollout_ref.actor.clip_ratoi" in message
    assert "did you mean actor_rollout_ref.actor.clip_ratio?" in message
    message = _errors("trainer.sav_freq=3")
    assert "did you mean trainer.save_freq?" in message


def test_train_batch_not_divisible_by_mini_batch_names_both_keys():
    message = _errors("data.train_batch_size=1000", "actor_rollout_ref.actor.ppo_mini_batch_size=64")
    assert "data.train_batch_size (1000)" in message
    assert "actor_rollout_ref.actor.ppo_mini_batch_size (64)" in message
    assert "critic.ppo_mini_batch_size" not in message  # the critic inherits; one error, not two


def test_mini_batch_times_n_not_divisible_by_micro_times_world():
    message = _errors(
        "data.train_batch_size=12",
        "actor_rollout_ref.actor.ppo_mini_batch_size=6",
        "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.n_gpus_per_node=1",
    )
    assert "6 * 1 = 6 sequences" in message and "(4 * 1)" in message
    # world size counts: 8 * 1 sequences over 2 workers of micro-batch 4 is not whole
    message = _errors(
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "critic.ppo_micro_batch_size_per_gpu=1",
        "trainer.n_gpus_per_node=2",
    )
    assert "(8 * 2)" in message
    load_config(["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.n_gpus_per_node=2"])


def test_micro_batch_required_without_dynamic_bsz():
    message = _errors("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null")
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu is required" in message
    cfg = load_config(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
                       "actor_rollout_ref.actor.use_dynamic_bsz=true"])
    assert cfg.actor_rollout_ref.actor.use_dynamic_bsz


def test_dynamic_bsz_token_budget_must_hold_one_sequence():
    message = _errors(
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=600",
    )
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu (600)" in message
    assert "(1024)" in message


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("actor_rollout_ref.actor.clip_ratio=0", "actor_rollout_ref.actor.clip_ratio=0.0 must be > 0"),
        ("actor_rollout_ref.actor.clip_ratio_low=-0.1", "clip_ratio_low=-0.1 must be > 0"),
        ("actor_rollout_ref.actor.clip_ratio_high=0", "clip_ratio_high=0.0 must be > 0"),
        ("actor_rollout_ref.actor.clip_ratio_c=1.0", "clip_ratio_c=1.0 must be > 1"),
        ("algorithm.lam=1.5", "algorithm.lam=1.5 must be in [0, 1]"),
        ("algorithm.gamma=0", "algorithm.gamma=0.0 must be in (0, 1]"),
        ("algorithm.gamma=1.01", "algorithm.gamma=1.01 must be in (0, 1]"),
        ("actor_rollout_ref.actor.optim.lr=0", "actor_rollout_ref.actor.optim.lr=0.0 must be > 0"),
        ("critic.optim.lr=-1e-5", "critic.optim.lr=-1e-05 must be > 0"),
        ("actor_rollout_ref.actor.kl_loss_type=low_var", "kl_loss_type='low_var' is not one of"),
        ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator='ppo' is not one of"),
        ("actor_rollout_ref.actor.loss_agg_mode=mean", "loss_agg_mode='mean' is not one of"),
        ("actor_rollout_ref.rollout.name=sglang", "rollout.name='sglang' is not one of hf, vllm"),
        ("trainer.logger=[console,neptune]", "trainer.logger='neptune' is not one of"),
        ("data.train_batch_size=abc", "data.train_batch_size='abc' must be an integer"),
        ("trainer.resume_mode=resume_path", "needs trainer.resume_from_path"),
    ],
)
def test_each_invalid_value_is_named(override, needle):
    assert needle in _errors(override)


def test_unknown_name_suggests_a_close_valid_one():
    assert "did you mean low_var_kl?" in _errors("actor_rollout_ref.actor.kl_loss_type=low_var_kll")


def test_all_errors_are_reported_together():
    message = _errors("algorithm.lam=2", "algorithm.gamma=0", "actor_rollout_ref.actor.clip_ratio_c=0.5")
    assert "algorithm.lam" in message and "algorithm.gamma" in message and "clip_ratio_c" in message


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf_core.config", *args], capture_output=True, text=True)


def test_cli_rejects_inconsistent_batches_with_exit_2():
    result = _cli("data.train_batch_size=1000", "actor_rollout_ref.actor.ppo_mini_batch_size=64")
    assert result.returncode == 2
    assert "data.train_batch_size" in result.stderr and "ppo_mini_batch_size" in result.stderr
    assert result.stdout == ""


def test_cli_alias_prints_grad_clip_and_a_notice():
    result = _cli("actor_rollout_ref.actor.optim.max_grad_norm=0.5")
    assert result.returncode == 0, result.stderr
    tree = yaml.safe_load(result.stdout)
    assert tree["actor_rollout_ref"]["actor"]["grad_clip"] == 0.5
    assert tree["critic"]["grad_clip"] == 1.0
    assert "alias" in result.stderr and "actor_rollout_ref.actor.grad_clip" in result.stderr
