"""Checkpoints: the layout, a full round trip, the HF export, atomicity under injected faults,
pruning, resume modes, and the errors for missing, incomplete or mismatched checkpoints."""

from __future__ import annotations

import copy
import errno
import json
import shutil

import pytest
import torch
import yaml

from rlhf_core.algos import AdaptiveKLController
from rlhf_core.config import PPOConfig, load_config
from rlhf_core.main_ppo import build_trainer
from rlhf_core.models.toy import random_toy_model
from rlhf_core.training import checkpoint
from rlhf_core.training.checkpoint import CheckpointError

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_overrides(workspace, out, *extra, model=None):
    """Two PPO steps of the tiny run (with an adaptive KL controller to save) take about a second."""
    return workspace.overrides(out, "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", *extra,
                               model=model)


@pytest.fixture(scope="module")
def trained(workspace):
    """A trainer after two steps with a checkpoint at each step."""
    out = workspace.root / "trained"
    cfg = load_config(tiny_overrides(workspace, out, "trainer.total_training_steps=2", "trainer.save_freq=1",
                                     "trainer.test_freq=1"))
    trainer = build_trainer(cfg)
    trainer.fit()
    return trainer, out


def _assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _optimizer_tensors(optimizer) -> dict:
    return {f"{pid}.{key}": value for pid, state in optimizer.state_dict()["state"].items()
            for key, value in state.items()}


def test_layout_and_exact_round_trip(workspace, trained):
    trainer, out = trained
    assert (out / checkpoint.LATEST_FILE).read_text().strip() == "2"
    ckpt = out / "global_step_2"
    for rel in ("actor/model_state.pt", "actor/optim_state.pt", "actor/extra_state.pt", "critic/model_state.pt",
                "critic/optim_state.pt", "critic/extra_state.pt", "actor/huggingface/config.json",
                "actor/huggingface/model.safetensors", "actor/huggingface/tokenizer.json", "trainer_state.json",
                "rng_state.pt", "config.yaml", "manifest.json"):
        assert (ckpt / rel).is_file(), rel
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert state["sampler"] == {"epoch": 0, "batch_in_epoch": 2, "seed": 1, "n": 32}
    assert state["kl_ctrl"]["type"] == "adaptive" and state["kl_ctrl"]["value"] == trainer.kl_ctrl.value
    assert yaml.safe_load((ckpt / "config.yaml").read_text())["data"]["train_batch_size"] == 8
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp directory left behind

    fresh = build_trainer(load_config(tiny_overrides(workspace, out, "trainer.total_training_steps=2")))
    torch.manual_seed(12345)  # the load must put the global generator back too
    fresh.load_checkpoint(ckpt)
    assert fresh.global_step == 2
    assert fresh.sampler.state_dict() == trainer.sampler.state_dict()
    assert fresh.kl_ctrl.value == trainer.kl_ctrl.value and fresh.kl_ctrl.target == trainer.kl_ctrl.target
    for mine, theirs in ((fresh.actor, trainer.actor), (fresh.critic, trainer.critic)):
        _assert_same_tensors(mine.module.state_dict(), theirs.module.state_dict())
        _assert_same_tensors(_optimizer_tensors(mine.optimizer), _optimizer_tensors(theirs.optimizer))
        assert mine.scheduler.state_dict() == theirs.scheduler.state_dict()
        assert torch.equal(mine.shuffle_generator.get_state(), theirs.shuffle_generator.get_state())
    assert torch.equal(fresh.actor.rollout.generator.get_state(), trainer.actor.rollout.generator.get_state())
    assert torch.equal(torch.get_rng_state(), torch.load(ckpt / "rng_state.pt")["torch"])
    assert fresh.guard.state_dict() == trainer.guard.state_dict()


def test_hf_directory_loads_with_plain_transformers_and_generates(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer, out = trained
    hf_dir = out / "global_step_2" / "actor" / "huggingface"
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    for name, value in trainer.actor.module.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    text = "User: 2 + 3?\nAssistant: "
    inputs = tokenizer([text], return_tensors="pt")
    assert inputs["input_ids"].tolist() == trainer.tokenizer([text], return_tensors="pt")["input_ids"].tolist()
    generated = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] > inputs["input_ids"].shape[1]
    # the exported model and tokenizer answer as the trained policy does
    trained_policy = trainer.actor.module.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert generated.tolist() == trained_policy.tolist()

    exported = checkpoint.export_hf(trainer, tmp_path / "export")  # the standalone export, same content
    assert (exported / "model.safetensors").read_bytes() == (hf_dir / "model.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match="already exists and is not empty"):
        checkpoint.export_hf(trainer, tmp_path / "export")


@pytest.fixture
def scratch(trained, tmp_path):
    """A copy of the two-step run's checkpoints that a test may damage."""
    trainer, out = trained
    copy = tmp_path / "ckpts"
    shutil.copytree(out, copy)
    trainer.checkpoint_dir = copy
    trainer.global_step = 3
    yield trainer, copy
    trainer.checkpoint_dir, trainer.global_step = out, 2


def _fail_on_call(monkeypatch, number: int, error: OSError):
    """Make writing the ``number``-th file of a save raise ``error``: the checkpoint's files in
    order, then the latest marker."""
    real_write, real_write_text = checkpoint.CheckpointFiles.write, checkpoint.write_text_atomic
    calls = []

    def fail(file):
        raise error

    def write(files, rel, fill):
        calls.append(rel)
        real_write(files, rel, fail if len(calls) == number else fill)

    def write_text(path, text):
        calls.append(path)
        if len(calls) == number:
            raise error
        real_write_text(path, text)

    monkeypatch.setattr(checkpoint.CheckpointFiles, "write", write)
    monkeypatch.setattr(checkpoint, "write_text_atomic", write_text)
    return calls


@pytest.mark.parametrize(("call", "what"), [(1, "actor/model_state.pt"), (4, "critic/model_state.pt"),
                                             (10, "manifest.json"), (11, checkpoint.LATEST_FILE)])
def test_disk_full_midway_keeps_the_previous_checkpoint(scratch, monkeypatch, call, what):
    trainer, root = scratch
    calls = _fail_on_call(monkeypatch, call, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(CheckpointError) as info:
        checkpoint.save_checkpoint(trainer, root)
    message = str(info.value)
    assert f"disk full while writing {what}" in message and "global_step_3" in message
    assert "previous checkpoint" in message and "global_step_2 is intact" in message
    assert len(calls) == call
    assert (root / checkpoint.LATEST_FILE).read_text().strip() == "2"
    assert not (root / "global_step_3").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    assert checkpoint.latest_checkpoint(root) == root / "global_step_2"
    checkpoint.read_manifest(root / "global_step_2")
    monkeypatch.undo()
    assert checkpoint.save_checkpoint(trainer, root) == root / "global_step_3"  # and the next save works
    assert (root / checkpoint.LATEST_FILE).read_text().strip() == "3"


def test_unwritable_directory_is_reported(scratch, monkeypatch, tmp_path):
    trainer, root = scratch
    _fail_on_call(monkeypatch, 2, PermissionError(errno.EACCES, "Permission denied"))
    with pytest.raises(CheckpointError, match=f"checkpoint directory {root} is not writable"):
        checkpoint.save_checkpoint(trainer, root)
    assert checkpoint.latest_checkpoint(root) == root / "global_step_2"
    monkeypatch.undo()
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match="is not a directory"):
        checkpoint.save_checkpoint(trainer, blocker / "sub")
    with pytest.raises(CheckpointError, match="is not a directory"):
        checkpoint.check_writable(blocker / "sub")


def test_a_save_killed_midway_leaves_nothing_that_loads(scratch):
    trainer, root = scratch
    (root / ".global_step_3.tmp-killed").mkdir()  # what a SIGKILL during a save leaves
    (root / ".global_step_3.tmp-killed" / "actor").mkdir()
    (root / "global_step_7").mkdir()  # a directory without a manifest is not a checkpoint
    assert [step for step, _ in checkpoint.list_checkpoints(root)] == [1, 2]
    with pytest.raises(CheckpointError, match="global_step_7 is incomplete: it has no manifest.json"):
        checkpoint.read_manifest(root / "global_step_7")
    checkpoint.save_checkpoint(trainer, root)
    assert not (root / ".global_step_3.tmp-killed").exists()
    assert [step for step, _ in checkpoint.list_checkpoints(root)] == [1, 2, 3]


def test_missing_incomplete_and_mismatched_checkpoints_are_clear_errors(workspace, scratch, tmp_path):
    trainer, root = scratch
    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path / 'nowhere' / 'global_step_5'} does not"):
        trainer.load_checkpoint(tmp_path / "nowhere" / "global_step_5")
    (root / "global_step_1" / "critic" / "optim_state.pt").unlink()
    with pytest.raises(CheckpointError, match="global_step_1 is incomplete: critic/optim_state.pt missing"):
        trainer.load_checkpoint(root / "global_step_1")
    (root / checkpoint.LATEST_FILE).write_text("9\n")
    with pytest.raises(CheckpointError, match="names step 9, but checkpoint .*global_step_9 does not exist"):
        checkpoint.latest_checkpoint(root)
    (root / checkpoint.LATEST_FILE).write_text("oops")
    with pytest.raises(CheckpointError, match="should hold a step number"):
        checkpoint.latest_checkpoint(root)

    # the same model directory now holds a model of another width: a shape mismatch, named
    other = tmp_path / "model"
    random_toy_model(other, n_layers=1, hidden_size=32, max_position_embeddings=512, seed=0)
    small = build_trainer(load_config(tiny_overrides(workspace, root, model=other)))
    checkpoint.save_checkpoint(small, tmp_path / "small")
    shutil.rmtree(other)
    random_toy_model(other, n_layers=1, hidden_size=48, max_position_embeddings=512, seed=0)
    wide = build_trainer(load_config(tiny_overrides(workspace, root, model=other)))
    with pytest.raises(CheckpointError, match=r"global_step_0/actor/model_state.pt does not fit the model being "
                                              r"trained \(.* has shape \(\d+, 32\) in the checkpoint, \(\d+, 48\)"):
        wide.load_checkpoint(tmp_path / "small" / "global_step_0")


def test_resume_modes(workspace, trained, tmp_path):
    _, out = trained
    auto = load_config(tiny_overrides(workspace, out))
    assert checkpoint.find_resume_checkpoint(auto) == out / "global_step_2"
    assert checkpoint.find_resume_checkpoint(load_config(tiny_overrides(workspace, tmp_path / "empty"))) is None
    disabled = load_config(tiny_overrides(workspace, out, "trainer.resume_mode=disable"))
    assert checkpoint.find_resume_checkpoint(disabled) is None
    chosen = load_config(tiny_overrides(workspace, tmp_path / "elsewhere", "trainer.resume_mode=resume_path",
                                        f"trainer.resume_from_path={out / 'global_step_1'}"))
    assert checkpoint.find_resume_checkpoint(chosen) == out / "global_step_1"
    for wrong, needle in ((out, "must be global_step_N"), (out / "global_step_8", "global_step_8 does not exist")):
        cfg = load_config(tiny_overrides(workspace, out, "trainer.resume_mode=resume_path",
                                         f"trainer.resume_from_path={wrong}"))
        with pytest.raises(CheckpointError, match=f"trainer.resume_from_path: .*{needle}"):
            checkpoint.find_resume_checkpoint(cfg)


DENIED = {
    "data.train_batch_size": "16", "actor_rollout_ref.rollout.n": "4", "data.max_response_length": "16",
    "algorithm.adv_estimator": "grpo", "trainer.seed": "7", "actor_rollout_ref.actor.ppo_mini_batch_size": "8",
    "actor_rollout_ref.model.path": "/elsewhere/model", "actor_rollout_ref.actor.optim.lr": "0.5",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "cispo", "algorithm.filter_groups.enable": "true",
}
ALLOWED = {
    "trainer.logger": "[console]", "trainer.test_freq": "5", "trainer.save_freq": "3",
    "trainer.total_training_steps": "50", "trainer.experiment_name": "renamed", "trainer.guard.max_kl": "0.5",
    "trainer.guard.max_val_drop": "null", "trainer.warn_kl": "0.5", "trainer.prometheus_port": "9400",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "2", "data.val_batch_size": "4",
    "reward_model.train.margin": "0.5", "reward_model.overlong_buffer.log": "true",
    "trainer.val_only": "true", "trainer.balance_batch": "false",
}


def test_resume_refuses_config_changes_that_matter_and_allows_harmless_ones(workspace, trained):
    _, out = trained
    ckpt = out / "global_step_2"
    base = tiny_overrides(workspace, out, "trainer.total_training_steps=2")
    checkpoint.check_config(ckpt, load_config(base))
    allowed = load_config(base + [f"{k}={v}" for k, v in ALLOWED.items()], validate=False)
    checkpoint.check_config(ckpt, allowed)
    for key, value in DENIED.items():
        with pytest.raises(CheckpointError) as info:
            checkpoint.check_config(ckpt, load_config(base + [f"{key}={value}"], validate=False))
        assert f"cannot resume from {ckpt}" in str(info.value)
        assert f"{key}: " in str(info.value) and "in the checkpoint" in str(info.value), key
    everything = load_config(base + [f"{k}={v}" for k, v in DENIED.items()], validate=False)
    assert sorted(checkpoint.config_differences(yaml.safe_load((ckpt / "config.yaml").read_text()),
                                                everything.to_dict())) == \
        sorted(DENIED)  # not the keys left null that stand for these (critic.model.path, data.tokenizer, ...)


def test_a_key_that_follows_the_actors_compares_resolved():
    """A checkpoint written when the critic's keys held their values (as before they defaulted to null = the
    actor's) resumes under the same command; one whose value the null now resolves otherwise does not."""
    current = PPOConfig().to_dict()
    saved = copy.deepcopy(current)
    saved["critic"].update(loss_agg_mode="token-mean", shuffle=False)
    saved["critic"]["model"]["trust_remote_code"] = False
    assert checkpoint.config_differences(saved, current) == []
    # paths that stand for the actor's, written out (through a chain: the data's tokenizer is the actor's
    # tokenizer, which is its model directory), resume; another directory does not
    policy = current["actor_rollout_ref"]["model"]["path"]
    written = copy.deepcopy(current)
    written["critic"]["model"].update(path=policy, tokenizer_path=policy)
    written["data"]["tokenizer"] = policy
    assert checkpoint.config_differences(saved, written) == []
    written["critic"]["model"]["path"] = "/elsewhere"
    assert checkpoint.config_differences(saved, written) == ["critic.model.path"]
    current["actor_rollout_ref"]["actor"]["loss_agg_mode"] = saved["actor_rollout_ref"]["actor"]["loss_agg_mode"] = \
        "seq-mean-token-mean"  # the critic followed token-mean then, the actor's seq-mean-token-mean now
    assert checkpoint.config_differences(saved, current) == ["critic.loss_agg_mode"]
    # without a critic (GRPO) its keys are read by no one; trust_remote_code is a permission, not math
    for tree in (saved, current):
        tree["algorithm"]["adv_estimator"] = "grpo"
    current["critic"]["model"]["trust_remote_code"] = current["actor_rollout_ref"]["model"]["trust_remote_code"] = True
    assert checkpoint.config_differences(saved, current) == []
    # the mappings the user fills are compared whole: an override_config entry added since is a change
    current["actor_rollout_ref"]["model"]["override_config"] = {"rope_theta": 1000.0}
    assert checkpoint.config_differences(saved, current) == ["actor_rollout_ref.model.override_config"]


def test_runtime_coefficients_are_saved_as_trainer_state_and_the_config_stays_as_started(workspace, scratch):
    trainer, root = scratch
    saved = trainer.kl_ctrl, trainer.kl_loss_coef
    trainer.kl_ctrl, trainer.kl_loss_coef = AdaptiveKLController(0.25, 0.01, 50), 0.004  # as a guard leaves them
    try:
        path = checkpoint.save_checkpoint(trainer, root)
    finally:
        trainer.kl_ctrl, trainer.kl_loss_coef = saved
    fresh = build_trainer(load_config(tiny_overrides(workspace, root)))
    fresh.load_checkpoint(path)
    assert fresh.kl_loss_coef == 0.004
    assert isinstance(fresh.kl_ctrl, AdaptiveKLController)
    assert (fresh.kl_ctrl.value, fresh.kl_ctrl.target, fresh.kl_ctrl.horizon) == (0.25, 0.01, 50)
    assert fresh.config.actor_rollout_ref.actor.kl_loss_coef == 0.001  # the config is what the run started with
    assert fresh.config.algorithm.kl_ctrl.target_kl == 0.1
    state = checkpoint.read_trainer_state(path)
    assert state["kl_loss_coef"] == 0.004 and state["format"] == checkpoint.FORMAT_VERSION


def _save_keeping(trainer, root, steps, max_actor, max_critic) -> dict[int, list[str]]:
    """Save at ``steps`` with these ``max_*_ckpt_to_keep``; the parts left in each checkpoint."""
    cfg = trainer.config.trainer
    cfg.max_actor_ckpt_to_keep, cfg.max_critic_ckpt_to_keep = max_actor, max_critic
    try:
        for step in steps:
            trainer.global_step = step
            checkpoint.save_checkpoint(trainer, root)
    finally:
        cfg.max_actor_ckpt_to_keep = cfg.max_critic_ckpt_to_keep = None
    return {step: sorted(p.name for p in path.iterdir() if p.is_dir()) for step, path in
            checkpoint.list_checkpoints(root)}


def test_pruning_keeps_the_latest_and_the_protected(scratch):
    trainer, root = scratch
    trainer.guard.best_step = 1  # the val-drop guard's rollback target
    try:
        layout = _save_keeping(trainer, root, range(3, 7), 2, 1)
    finally:
        trainer.guard.best_step = None
    assert layout == {1: ["actor", "critic"], 5: ["actor"], 6: ["actor", "critic"]}
    assert checkpoint.latest_checkpoint(root) == root / "global_step_6"
    with pytest.raises(CheckpointError, match="global_step_5 .*critic/model_state.pt"):
        trainer.load_checkpoint(root / "global_step_5")


def test_zero_checkpoints_to_keep_keeps_them_all_as_in_verl(scratch):
    trainer, root = scratch
    layout = _save_keeping(trainer, root, range(3, 6), 0, 1)
    assert {3, 4, 5} <= set(layout) and max(layout) == 5
    assert all(parts == (["actor", "critic"] if step == 5 else ["actor"]) for step, parts in layout.items())


def test_after_a_guard_moves_latest_back_newer_checkpoints_are_replaced_not_counted(scratch):
    trainer, root = scratch
    for step in (3, 4):
        trainer.global_step = step
        checkpoint.save_checkpoint(trainer, root)
    checkpoint.mark_latest(root, 2)  # what a guard's stop does
    assert checkpoint.latest_checkpoint(root) == root / "global_step_2"
    stale = (root / "global_step_3" / "manifest.json").stat().st_mtime_ns
    _save_keeping(trainer, root, [3], 1, 1)  # the rerun reaches step 3 again
    assert (root / "global_step_3" / "manifest.json").stat().st_mtime_ns != stale
    assert [step for step, _ in checkpoint.list_checkpoints(root)] == [3, 4]
    assert checkpoint.latest_checkpoint(root) == root / "global_step_3"
    assert not [p for p in root.iterdir() if p.name.startswith(".")]

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_checkpoint_round_trip_and_resume(workspace, tmp_path):
    out = tmp_path / "cuda"
    overrides = tiny_overrides(workspace, out, "trainer.device=cuda", "trainer.total_training_steps=2",
                               "trainer.save_freq=1")
    reference = build_trainer(load_config(overrides))
    metrics: dict[int, dict] = {}
    reference.logger = lambda m, step: metrics.__setitem__(step, dict(m))
    reference.fit()
    cuda_rng = torch.load(out / "global_step_1" / "rng_state.pt")["cuda"]
    assert cuda_rng is not None and len(cuda_rng) == torch.cuda.device_count()

    resumed = build_trainer(load_config(overrides))
    resumed.load_checkpoint(out / "global_step_1")
    assert all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), cuda_rng))
    assert next(resumed.actor.module.parameters()).is_cuda
    again: dict[int, dict] = {}
    resumed.logger = lambda m, step: again.__setitem__(step, dict(m))
    resumed.fit()
    for key in ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/ppo_kl", "critic/values/mean"):
        assert again[2][key] == pytest.approx(metrics[2][key], rel=1e-4, abs=1e-6), key
