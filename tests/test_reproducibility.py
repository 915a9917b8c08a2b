"""Reproducible runs: two fresh runs with one config and seed, in processes of their own (each with its own
string hashing, PYTHONHASHSEED), log the same metrics and save the same files; another trainer.seed samples
otherwise; the checkpoint records the seeds and the software a run needs to be run again."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.config import ConfigError, load_config
from rlhf_core.data.synthetic import build_dataset
from rlhf_core.models.toy import random_toy_model
from rlhf_core.training.trainer import changed_since

#: metrics that measure the machine rather than the run
MACHINE_METRICS = ("timing_s/", "timing_per_token_ms/", "perf/")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("repro")
    model = random_toy_model(root / "model", n_layers=1, hidden_size=32, max_position_embeddings=512, seed=0)
    build_dataset(root / "data", n_train=16, n_test=4, seed=0, max_ops=1)
    (root / "reward.py").write_text(  # responses told apart: advantages that move the policy
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(sum(map(ord, solution_str or ' ')) % 3 == 0)\n")
    return root, model


def _run(workspace, folder, hash_seed: str, *extra: str) -> None:
    """A fresh two-step run in a process of its own, in ``folder`` (its checkpoints in ``folder/out``, a path the
    saved config.yaml holds as written): GRPO over 2 samples a prompt, LoRA on all linear layers (peft holds their
    names in a set), sampled validation after each step."""
    root, model = workspace
    command = [
        sys.executable, "-m", "rlhf_core.main_ppo", f"actor_rollout_ref.model.path={model}",
        f"data.train_files={root / 'data' / 'train.parquet'}", f"data.val_files={root / 'data' / 'test.parquet'}",
        "data.train_batch_size=4", "data.val_batch_size=4", "data.max_prompt_length=320",
        "data.max_response_length=6", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.actor.optim.lr=5e-2", "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        "trainer.test_freq=1", "trainer.val_before_train=false", "trainer.total_training_steps=2",
        "trainer.n_gpus_per_node=1", "trainer.device=cpu", "trainer.logger=[file]",
        "trainer.default_local_dir=out", f"custom_reward_function.path={root / 'reward.py'}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED=hash_seed)
    folder.mkdir()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=folder, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def _metrics(out) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(MACHINE_METRICS)}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def _files(checkpoint) -> dict[str, bytes]:
    return {path.relative_to(checkpoint).as_posix(): path.read_bytes()
            for path in sorted(checkpoint.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def runs(workspace, tmp_path_factory):
    """Two runs with trainer.seed=1 under other string hashes, one with trainer.seed=2."""
    base = tmp_path_factory.mktemp("runs")
    for name, hash_seed, extra in (("first", "1", ()), ("again", "2", ()), ("other_seed", "1", ("trainer.seed=2",))):
        _run(workspace, base / name, hash_seed, *extra)
    return base


def test_two_fresh_runs_with_one_seed_log_the_same_metrics_and_save_the_same_files(runs):
    first, again = runs / "first" / "out", runs / "again" / "out"
    assert len(_metrics(first)) == 2
    assert _metrics(first) == _metrics(again)
    saved, resaved = _files(first / "global_step_2"), _files(again / "global_step_2")
    assert sorted(saved) == sorted(resaved)
    assert "actor/lora_adapter/adapter_config.json" in saved
    # the manifest holds trainer_state.json's hash, and that file the time of the save: all else byte for byte
    differ = sorted(name for name in saved if saved[name] != resaved[name])
    assert differ == ["manifest.json", "trainer_state.json"]
    state, restate = (json.loads(files["trainer_state.json"]) for files in (saved, resaved))
    del state["saved_at"], restate["saved_at"]
    assert state == restate


def test_another_trainer_seed_samples_otherwise(runs):
    first, other = runs / "first" / "out", runs / "other_seed" / "out"
    assert [m["actor/entropy"] for m in _metrics(first)] != [m["actor/entropy"] for m in _metrics(other)]
    adapter, other_adapter = (load_file(run / "global_step_2" / "actor" / "lora_adapter" / "adapter_model.safetensors")
                              for run in (first, other))
    assert adapter.keys() == other_adapter.keys()
    assert any(not torch.equal(adapter[name], other_adapter[name]) for name in adapter)


def test_the_checkpoint_records_the_seeds_and_the_software_of_the_run(runs):
    record = json.loads((runs / "other_seed" / "out" / "global_step_2" / "trainer_state.json").read_text())["run"]
    # data.seed was left at its default (1): trainer.seed=2 does not move it
    assert record["seeds"] == {"trainer.seed": 2, "data.seed": 1}
    assert record["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert record["versions"]["torch"] == torch.__version__
    assert record["versions"]["peft"] == __import__("peft").__version__
    assert record["torch_threads"] == 1  # OMP_NUM_THREADS=1
    assert record["platform"] == platform.platform()
    assert len(record["rlhf_core_sha256"]) == 64


def test_a_null_data_seed_is_recorded_as_the_trainer_seed_it_takes(workspace, tmp_path):
    from rlhf_core.main_ppo import build_trainer

    root, model = workspace
    cfg = load_config([f"actor_rollout_ref.model.path={model}", f"data.train_files={root / 'data' / 'train.parquet'}",
                       "data.train_batch_size=4", "data.max_prompt_length=320", "data.max_response_length=4",
                       "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.n_gpus_per_node=1",
                       "trainer.device=cpu", "trainer.logger=[]", "data.seed=null", "trainer.seed=7", "data.val_files=[]",
                       f"trainer.default_local_dir={tmp_path}"], notice=lambda _: None)
    assert build_trainer(cfg).state_dict()["run"]["seeds"] == {"trainer.seed": 7, "data.seed": 7}


def test_a_resume_names_what_differs_from_the_run_it_goes_on():
    saved = {"versions": {"python": "3.11.7", "torch": "2.6.0"}, "rlhf_core_sha256": "a" * 64, "torch_threads": 1,
             "platform": "Linux"}
    now = {"versions": {"python": "3.11.7", "torch": "2.7.0", "numpy": "2.0.0"}, "rlhf_core_sha256": "a" * 64,
           "torch_threads": 4, "platform": "Linux"}
    # numpy was not recorded by the saved run: nothing to compare it with
    assert changed_since(saved, now) == ["torch: 2.6.0 -> 2.7.0", "torch_threads: 1 -> 4"]
    assert changed_since(saved, saved) == []
    assert changed_since(None, now) == []  # a checkpoint saved before runs recorded themselves


def test_adapter_config_lists_all_linear_target_modules_in_sorted_order(tmp_path):
    """peft keeps all-linear's module names in a set and writes it as list(set): in the order of the process's
    string hashing, so that two runs' adapter_config.json differed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_core.models.lora import apply_lora, save_adapter

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    projections = ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj",
                   "self_attn.q_proj", "self_attn.v_proj"]
    expected = [f"model.layers.{layer}.{name}" for layer in (0, 1) for name in projections]
    wrapped = apply_lora(model, rank=2, alpha=4, target_modules="all-linear")
    state = {name: tensor for name, tensor in wrapped.state_dict().items() if "lora_" in name}
    save_adapter(wrapped, state, tmp_path / "adapter", tmp_path / "base")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["target_modules"] == expected
    assert isinstance(wrapped.peft_config["default"].target_modules, set)  # the module's config is left as it was


@pytest.mark.parametrize("key", ["trainer.seed", "data.seed"])
def test_a_negative_seed_is_refused_before_the_run_starts(key):
    """NumPy seeds no negative number: a negative trainer.seed failed the run at its first sampled validation,
    after it had trained, and a negative data.seed at the data's max_samples draw."""
    with pytest.raises(ConfigError) as info:
        load_config([f"{key}=-1"], notice=lambda _: None)
    assert info.value.errors == [f"{key}=-1 must be >= 0"]



def test_a_reward_model_run_seeds_pythons_and_numpys_global_streams(workspace, tmp_path):
    """Their states go into every reward-model checkpoint (rng_state.pt): two runs with one seed saved other ones,
    a fresh process's, where they were left unseeded."""
    import random

    import numpy as np

    from rlhf_core.data.preference import synthetic_pairs, write_splits
    from rlhf_core.data.synthetic import DATA_SOURCE
    from rlhf_core.training.reward_trainer import RewardModelTrainer

    _, model = workspace
    train, val = synthetic_pairs(8, 4, seed=0)
    write_splits(tmp_path / "pairs", train, val, DATA_SOURCE)
    random.seed(12345)
    np.random.seed(12345)
    RewardModelTrainer(load_config([
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", f"reward_model.train.model.path={model}",
        f"reward_model.train.train_files={tmp_path / 'pairs' / 'train.parquet'}",
        f"reward_model.train.val_files={tmp_path / 'pairs' / 'val.parquet'}", "reward_model.train.train_batch_size=4",
        "reward_model.train.micro_batch_size_per_gpu=4", "reward_model.train.seed=3",
        f"reward_model.train.default_local_dir={tmp_path / 'out'}"], notice=lambda _: None))
    drawn = random.random(), float(np.random.random())
    random.seed(3)
    np.random.seed(3)
    assert drawn == (random.random(), float(np.random.random()))
