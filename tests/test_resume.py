"""Exact resume: a run killed at any moment and started again with the same command continues from
its latest checkpoint with the metrics an uninterrupted run has, seeing every batch of the epoch
once. SIGKILL and SIGTERM are sent to real ``python -m rlhf_core.main_ppo`` processes."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from rlhf_core.config import load_config
from rlhf_core.main_ppo import build_trainer, run
from rlhf_core.training import checkpoint
from rlhf_core.training.guards import TrainingInterrupted
from rlhf_core.training.trainer import LoggingError

STEPS = 4  # one epoch: 32 prompts in batches of 8
REL_TOL = 1e-6
pytestmark = pytest.mark.usefixtures("one_thread")


def overrides(workspace, out, *extra):
    return workspace.overrides(
        out, "actor_rollout_ref.actor.shuffle=true", "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive", "actor_rollout_ref.actor.use_kl_loss=true",
        f"trainer.total_training_steps={STEPS}", *extra)


def _fit(trainer) -> tuple[dict[int, dict], dict[int, list[int]]]:
    """Run ``trainer.fit``, returning each step's metrics (as the file logger stores them) and prompt rows."""
    metrics: dict[int, dict] = {}
    rows: dict[int, list[int]] = {}
    collate = trainer.train_dataset.collate

    def recording_collate(indices):
        rows[trainer.global_step + 1] = list(indices)
        return collate(indices)

    trainer.train_dataset.collate = recording_collate
    trainer.logger = lambda m, step: metrics.__setitem__(step, json.loads(json.dumps(m)))
    trainer.fit()
    return metrics, rows


@pytest.fixture(scope="module")
def reference(workspace):
    """The uninterrupted run, checkpointing every step."""
    out = workspace.root / "reference"
    trainer = build_trainer(load_config(overrides(workspace, out, "trainer.save_freq=1")))
    metrics, rows = _fit(trainer)
    return out, metrics, rows


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items()
            if k != "step" and not k.startswith(("timing_s/", "timing_per_token_ms/", "perf/"))}


def assert_same_metrics(got: dict, expected: dict, step: int) -> None:
    got, expected = _comparable(got), _comparable(expected)
    assert got.keys() == expected.keys(), (step, got.keys() ^ expected.keys())
    for key, value in expected.items():
        other = got[key]
        if value is None or other is None:
            assert value is other, (step, key, other, value)
        else:
            assert math.isclose(other, value, rel_tol=REL_TOL, abs_tol=1e-9), (step, key, other, value)


def read_metrics(path) -> dict[int, dict]:
    """The last record of each step (a step may be logged twice around a kill); a torn last line is skipped."""
    records: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        records[record["step"]] = record
    return records


def saved_tensors(folder, parts=("actor", "critic")) -> dict[str, torch.Tensor]:
    """Every tensor of the weights and the optimizer moments that the checkpoint ``folder`` holds for ``parts``."""
    tensors = {}
    for part in parts:
        model = torch.load(folder / part / "model_state.pt", weights_only=True)
        tensors.update({f"{part}/{name}": value for name, value in model.items()})
        optimizer = torch.load(folder / part / "optim_state.pt", weights_only=True)["optimizer"]["state"]
        tensors.update({f"{part}/optim/{index}/{name}": value for index, state in optimizer.items()
                        for name, value in state.items() if torch.is_tensor(value)})
    return tensors


def assert_same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    differ = [name for name in expected if not torch.equal(got[name], expected[name])]
    assert not differ, differ


def test_the_adaptive_kl_coefficient_follows_each_steps_kl_and_a_checkpoint_holds_the_next_steps(workspace,
                                                                                                   reference):
    """Ziegler et al. (2019) as verl updates it: after each step beta *= 1 + clip(KL / target_kl - 1, -0.2, 0.2)
    * n / horizon, with KL the step's actor/reward_kl_penalty (the mean over responses of each one's token mean) and
    n the step's responses (train_batch_size * rollout.n); each step logs the beta it used, and a checkpoint holds
    the beta the next step uses. The first step's KL is exactly 0: the policy that sampled is the reference."""
    out, expected, _ = reference
    cfg = load_config(overrides(workspace, out))
    kl_ctrl = cfg.algorithm.kl_ctrl
    responses = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n  # 8 prompts x 2
    assert expected[1]["actor/reward_kl_penalty"] == 0.0
    beta = kl_ctrl.kl_coef
    for step in range(1, STEPS + 1):
        assert expected[step]["actor/reward_kl_penalty_coeff"] == pytest.approx(beta, rel=1e-12), step
        error = min(max(expected[step]["actor/reward_kl_penalty"] / kl_ctrl.target_kl - 1, -0.2), 0.2)
        beta *= 1 + error * responses / kl_ctrl.horizon
        if step == 2:  # the checkpoint a resume goes on from (the later ones are saved over by the resumed run)
            saved = checkpoint.read_trainer_state(out / "global_step_2")["kl_ctrl"]
            assert saved["type"] == "adaptive" and saved["value"] == pytest.approx(beta, rel=1e-12)
    assert beta < kl_ctrl.kl_coef  # the KL stayed under target_kl: the coefficient shrank


def test_resume_in_process_sees_each_batch_once_and_matches(workspace, reference):
    out, expected, expected_rows = reference
    assert sorted(expected) == list(range(1, STEPS + 1))
    epoch = [row for step in sorted(expected_rows) for row in expected_rows[step]]
    assert sorted(epoch) == list(range(32))  # the uninterrupted run sees each prompt once per epoch
    uninterrupted = saved_tensors(out / f"global_step_{STEPS}")  # (the resumed run saves over it)

    trainer = build_trainer(load_config(overrides(workspace, out, "trainer.save_freq=1")))
    trainer.load_checkpoint(out / "global_step_2")
    metrics, rows = _fit(trainer)
    assert sorted(metrics) == [3, 4]
    assert rows == {3: expected_rows[3], 4: expected_rows[4]}
    for step in (3, 4):
        assert_same_metrics(metrics[step], expected[step], step)
    assert metrics[4]["actor/kl_loss"] > 0 and metrics[4]["actor/reward_kl_penalty_coeff"] != 0.001
    # the actor's and the critic's weights and Adam moments after the last step: bit for bit the uninterrupted run's
    assert_same_tensors(saved_tensors(out / f"global_step_{STEPS}"), uninterrupted)


def test_a_grpo_run_resumed_from_another_folder_ends_with_the_uninterrupted_runs_weights(workspace, tmp_path):
    """GRPO (no critic; the advantages from each prompt's group of responses) with a KL loss, shuffled mini-batches
    over two epochs: a run resumed by resume_path from the uninterrupted run's step 1, into a folder of its own,
    trains steps 2 and 3 on the same prompts, logs the same metrics and saves the same weights and Adam moments."""
    grpo = ("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.shuffle=true", "actor_rollout_ref.actor.ppo_epochs=2",
            "trainer.total_training_steps=3", "trainer.save_freq=1")
    first, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    run(load_config(workspace.overrides(first, *grpo)), handle_signals=False)
    result = run(load_config(workspace.overrides(resumed, *grpo, "trainer.resume_mode=resume_path",
                                                 f"trainer.resume_from_path={first / 'global_step_1'}")),
                 handle_signals=False)
    assert result.resumed_from == str(first / "global_step_1") and [r.step for r in result.history] == [2, 3]
    assert sorted(path.name for path in resumed.glob("global_step_*")) == ["global_step_2", "global_step_3"]
    assert not (resumed / "global_step_3" / "critic").exists()
    expected, got = read_metrics(first / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert sorted(got) == [2, 3]
    for step in (2, 3):
        assert_same_metrics(got[step], expected[step], step)
    states = [json.loads((folder / "global_step_3" / "trainer_state.json").read_text()) for folder in (first, resumed)]
    assert states[0]["sampler"] == states[1]["sampler"] and states[1]["sampler"]["batch_in_epoch"] == 3
    assert_same_tensors(saved_tensors(resumed / "global_step_3", ["actor"]),
                        saved_tensors(first / "global_step_3", ["actor"]))


GRADED_REWARD = (  # the share of digits in a response: a prompt's responses score apart, so every step has a signal
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)\n"
)
ACTOR, OPTIM = "actor_rollout_ref.actor", "actor_rollout_ref.actor.optim"
GRPO = "algorithm.adv_estimator=grpo"
LR = 1e-2  # the tiny run's rate, actor and critic


# each case: its overrides, and what shows, in the uninterrupted run, that its feature acted in the resumed steps
RESUMED_FEATURES = [
    pytest.param(("algorithm.adv_estimator=rloo",), None, id="rloo"),
    pytest.param(("algorithm.adv_estimator=reinforce_plus_plus",), None, id="reinforce_plus_plus"),
    pytest.param(("algorithm.adv_estimator=reinforce_plus_plus_baseline",), None, id="reinforce_plus_plus_baseline"),
    pytest.param(("algorithm.adv_estimator=remax",), None, id="remax"),
    # the digit-first reward scores many groups alike, so each step draws several batches of 4 prompts: the 8
    # batches of an epoch are spent by step 2, whose checkpoint is inside the second epoch
    pytest.param((GRPO, "algorithm.filter_groups.enable=true", "data.train_batch_size=4", "data.gen_batch_size=4",
                  f"{ACTOR}.ppo_mini_batch_size=2", "trainer.total_epochs=10"),
                 lambda expected, _: all(expected[s]["train/num_gen_batches"] > 1 for s in (3, 4))
                 and expected[2]["training/epoch"] == 1, id="dapo_dynamic_sampling"),
    pytest.param((GRPO, f"{ACTOR}.policy_loss.loss_mode=gspo", f"{ACTOR}.clip_ratio_low=3e-4",
                  f"{ACTOR}.clip_ratio_high=4e-4", f"{ACTOR}.loss_agg_mode=seq-mean-token-mean"),
                 lambda expected, _: all(expected[s]["actor/pg_clipfrac"] > 0 for s in (3, 4)), id="gspo"),
    pytest.param((GRPO, f"{ACTOR}.policy_loss.loss_mode=cispo", f"{ACTOR}.clip_ratio_high=5.0"), None, id="cispo"),
    pytest.param((GRPO, "algorithm.norm_adv_by_std_in_grpo=false", f"{ACTOR}.loss_agg_mode=seq-mean-token-sum-norm"),
                 None, id="dr_grpo"),
    pytest.param((GRPO, f"{ACTOR}.use_kl_loss=true", f"{ACTOR}.kl_loss_type=low_var_kl"),
                 lambda expected, _: all(expected[s]["actor/kl_loss"] > 0 for s in (3, 4)), id="kl_loss_low_var_kl"),
    pytest.param(("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive"),
                 lambda expected, _: expected[3]["actor/reward_kl_penalty_coeff"] != 0.001, id="adaptive_kl_in_reward"),
    # the actor warms up over 2 steps, then cosine over the other 2: lr at step 3, lr / 2 at step 4; the critic
    # over 3 (a ratio of 0.75 of 4 steps), the resume inside it: 2/3 lr at step 3, lr at step 4
    pytest.param((f"{OPTIM}.lr_warmup_steps=2", f"{OPTIM}.lr_scheduler_type=cosine",
                  "critic.optim.lr_warmup_steps_ratio=0.75", "critic.optim.lr_scheduler_type=cosine"),
                 lambda expected, _: [expected[s][f"{part}/lr"] for part in ("actor", "critic") for s in (3, 4)]
                 == pytest.approx([LR, LR / 2, 2 * LR / 3, LR], rel=1e-12), id="lr_warmup_cosine"),
    pytest.param(("trainer.critic_warmup=1",), lambda expected, _: "actor/pg_loss" not in expected[1],
                 id="critic_warmup_gae"),
    pytest.param(("actor_rollout_ref.model.lora_rank=4",),
                 lambda _, tensors: any("lora_A" in name for name in tensors), id="lora"),
    pytest.param(("actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                  "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "actor_rollout_ref.rollout.val_kwargs.n=2",
                  "trainer.test_freq=1"),
                 lambda expected, _: all("val-core/synthetic/arithmetic/acc/best@2/mean" in expected[s]
                                         for s in (2, 3, 4)), id="sampled_validation_every_step"),
    pytest.param((f"{ACTOR}.entropy_coeff=0.01",), None, id="entropy_bonus"),
    # micro-batches of at most 700 valid tokens (three of the tiny run's sequences of about 190, not four),
    # shuffled over two epochs
    pytest.param((f"{ACTOR}.use_dynamic_bsz=true", f"{ACTOR}.ppo_max_token_len_per_gpu=700", f"{ACTOR}.shuffle=true",
                  f"{ACTOR}.ppo_epochs=2"), None, id="dynamic_bsz"),
]


@pytest.mark.parametrize(("extra", "acted"), RESUMED_FEATURES)
def test_each_algorithm_and_feature_resumed_after_step_2_ends_as_the_uninterrupted_run(workspace, tmp_path, extra,
                                                                                        acted):
    """A 4-step run resumed (resume_path, into a folder of its own) from its step 2 checkpoint logs steps 3 and 4 as
    the uninterrupted run does, timings aside, and ends with its weights and Adam moments bit for bit: every piece of
    state the feature keeps (generators, sampler position across dynamic sampling's draws, KL controller, schedulers,
    LoRA adapters) is saved and restored. DAPO keeps the digit-first reward (its groups must often score alike);
    the others score the share of digits, so that each prompt's responses differ and every step trains on a
    signal."""
    (tmp_path / "graded.py").write_text(GRADED_REWARD)
    dapo = "algorithm.filter_groups.enable=true" in extra
    reward = () if dapo else (f"custom_reward_function.path={tmp_path / 'graded.py'}",)
    settings = (*reward, *extra, "trainer.total_training_steps=4", "trainer.save_freq=1")
    first, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    run(load_config(workspace.overrides(first, *settings)), handle_signals=False)
    result = run(load_config(workspace.overrides(resumed, *settings, "trainer.resume_mode=resume_path",
                                                 f"trainer.resume_from_path={first / 'global_step_2'}")),
                 handle_signals=False)
    assert [r.step for r in result.history] == [3, 4]
    expected, got = read_metrics(first / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert sorted(expected) == [1, 2, 3, 4] and sorted(got) == [3, 4]
    for step in (3, 4):
        assert expected[step]["actor/pg_loss"] != 0, step  # the policy learnt from a signal in the resumed steps
        assert _comparable(got[step]) == _comparable(expected[step]), step
    parts = [part for part in ("actor", "critic") if (first / "global_step_4" / part).is_dir()]
    uninterrupted = saved_tensors(first / "global_step_4", parts)
    assert_same_tensors(saved_tensors(resumed / "global_step_4", parts), uninterrupted)
    assert acted is None or acted(expected, uninterrupted)


def test_a_logger_failing_as_a_step_saves_keeps_the_checkpoint_before_and_a_rerun_logs_that_step(
        workspace, reference, tmp_path):
    _, expected, _ = reference
    out = tmp_path / "logger"
    trainer = build_trainer(load_config(overrides(workspace, out, "trainer.save_freq=1")))
    written: dict[int, dict] = {}

    def disk_full_at_step_2(metrics, step):
        if step == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        written[step] = json.loads(json.dumps(metrics))

    trainer.logger = disk_full_at_step_2
    with pytest.raises(LoggingError) as raised:
        trainer.fit()
    assert str(raised.value) == (
        "logging the metrics of step 2 failed (OSError: [Errno 28] No space left on device), so its checkpoint is not "
        f"kept (a rerun trains the step again and logs it); the latest checkpoint {out / 'global_step_1'} is intact: "
        "free space on that disk, then rerun the same command to resume from it")
    assert _latest(out) == 1 and sorted(path.name for path in out.iterdir()) == [
        "global_step_1", "latest_checkpointed_iteration.txt"]

    resumed = build_trainer(load_config(overrides(workspace, out, "trainer.save_freq=1")))
    resumed.load_checkpoint(out / "global_step_1")  # as trainer.resume_mode=auto finds it
    metrics, _ = _fit(resumed)
    assert sorted(written) == [1] and sorted(metrics) == [2, 3, 4]  # every step logged once, step 2 by the rerun
    for step in (2, 3, 4):
        assert_same_metrics(metrics[step], expected[step], step)


_FREE_SPACE = "free space on that disk, then rerun the same command to resume from it"
_WRITABLE_OR_MOVED = (
    "make {out} writable again (its permissions, or remount a read-only filesystem), then rerun the same command to "
    "resume from it; or move {out} with its checkpoints and latest_checkpointed_iteration.txt to a writable place "
    "and set trainer.default_local_dir to that place for the rerun (in a folder without them a rerun starts afresh)")


@pytest.mark.parametrize("error, said, advice", [
    (OSError(errno.ENOSPC, "No space left on device"), "OSError: [Errno 28] No space left on device", _FREE_SPACE),
    (PermissionError(errno.EACCES, "Permission denied"), "PermissionError: [Errno 13] Permission denied",
     _WRITABLE_OR_MOVED),
], ids=["disk_full", "refused"])
def test_a_logger_failing_on_a_step_that_does_not_save_stops_naming_the_checkpoint_a_rerun_resumes_from(
        workspace, tmp_path, error, said, advice):
    """The error names the checkpoint a rerun resumes from and what to do first: space on a full disk; where the
    folder refuses the logger's file, the advice a refused save gets (a plain rerun would meet the same refusal,
    and a rerun in another folder would start afresh unless the checkpoints move)."""
    out = tmp_path / "logger_failing"
    trainer = build_trainer(load_config(overrides(workspace, out, "trainer.save_freq=2")))

    def failing_at_step_3(metrics, step):
        if step == 3:
            raise error

    trainer.logger = failing_at_step_3
    with pytest.raises(LoggingError) as raised:
        trainer.fit()
    assert str(raised.value) == (f"logging the metrics of step 3 failed ({said}); the latest checkpoint "
                                 f"{out / 'global_step_2'} is intact: " + advice.format(out=out))
    assert _latest(out) == 2 and trainer.global_step == 3


def _cli(workspace, out, *extra) -> list[str]:
    return [sys.executable, "-m", "rlhf_core.main_ppo", *overrides(workspace, out, *extra)]


def _start(command, log_dir, name):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # as in this process (one_thread)
    stdout = open(log_dir / f"{name}.out", "w")  # closed by _finish
    stderr = open(log_dir / f"{name}.err", "w")
    process = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env, cwd=log_dir)
    process.logs = (stdout, stderr)
    return process


def _finish(process, timeout=180) -> tuple[int, str]:
    code = process.wait(timeout=timeout)
    for f in process.logs:
        f.close()
    return code, open(process.logs[1].name).read()


def _wait_for(condition, process, timeout=180.0, what=""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if process.poll() is not None:
            raise AssertionError(f"the run ended (rc {process.returncode}) before {what}: "
                                 + open(process.logs[1].name).read()[-2000:])
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"timed out waiting for {what}")


def _latest(out) -> int | None:
    try:
        text = (out / "latest_checkpointed_iteration.txt").read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def test_sigkill_after_a_checkpoint_then_the_same_command_continues_exactly(workspace, reference, tmp_path):
    _, expected, _ = reference
    out = tmp_path / "run"
    command = _cli(workspace, out, "trainer.save_freq=1")

    first = _start(command, tmp_path, "killed")
    _wait_for(lambda: (_latest(out) or 0) >= 2, first, what="the checkpoint of step 2")
    first.send_signal(signal.SIGKILL)
    code, _ = _finish(first)
    assert code == -signal.SIGKILL
    killed_at = _latest(out)
    assert killed_at is not None and killed_at < STEPS

    second = _start(command, tmp_path, "resumed")
    code, err = _finish(second)
    assert code == 0, err[-3000:]
    assert f"resumed from {out / f'global_step_{killed_at}'} (step {killed_at} of {STEPS})" in err

    got = read_metrics(out / "metrics.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert_same_metrics(got[step], expected[step], step)
    state = json.loads((out / f"global_step_{STEPS}" / "trainer_state.json").read_text())
    assert state["sampler"] == {"epoch": 0, "batch_in_epoch": STEPS, "seed": 1, "n": 32, "order": "one_generator"}


def test_sigterm_finishes_the_step_saves_and_exits_nonzero(workspace, reference, tmp_path):
    _, expected, _ = reference
    out = tmp_path / "run"
    process = _start(_cli(workspace, out, "trainer.save_freq=-1"), tmp_path, "terminated")
    _wait_for(lambda: (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip(), process,
              what="the first logged step")
    process.send_signal(signal.SIGTERM)
    code, err = _finish(process)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    step = _latest(out)
    assert step is not None and 1 <= step < STEPS, err[-3000:]
    assert "received SIGTERM: finishing step" in err
    assert f"interrupted by SIGTERM after step {step}: checkpoint saved at {out / f'global_step_{step}'}" in err
    state = json.loads((out / f"global_step_{step}" / "trainer_state.json").read_text())
    assert state["global_step"] == step and state["sampler"]["batch_in_epoch"] == step
    got = read_metrics(out / "metrics.jsonl")
    assert sorted(got) == list(range(1, step + 1))
    for s in got:
        assert_same_metrics(got[s], expected[s], s)


def test_a_resume_from_the_checkpoint_after_the_first_validation_does_not_validate_again(workspace):
    """The validation before training saves global_step_0 (the guards' first best). A run stopped before its
    next checkpoint resumes from there: it must not validate (and log step 0) again; its later steps are the
    uninterrupted run's."""
    out = workspace.root / "resume_at_0"
    extra = ("trainer.val_before_train=true", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
             "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "actor_rollout_ref.rollout.val_kwargs.n=2",
             "trainer.total_training_steps=2", "trainer.test_freq=-1")
    expected, _ = _fit(build_trainer(load_config(workspace.overrides(out, *extra))))
    assert sorted(expected) == [0, 1, 2] and (out / "global_step_0").is_dir()

    trainer = build_trainer(load_config(workspace.overrides(out, *extra)))
    trainer.load_checkpoint(out / "global_step_0")
    metrics, _ = _fit(trainer)
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        assert_same_metrics(metrics[step], expected[step], step)


def test_a_resume_that_lengthens_the_run_follows_the_new_schedule_from_its_first_step(workspace, reference):
    """total_training_steps may change on a resume; the cosine schedule is then laid over the new length, from
    the step resumed on (the optimizer's saved rate is the old schedule's: after step 2 of 4, lr * (1 + cos(pi
    / 2)) / 2 = lr / 2)."""
    out, _, _ = reference
    longer = build_trainer(load_config(overrides(workspace, workspace.root / "longer",
                                                 f"trainer.total_training_steps={STEPS + 4}")))
    longer.load_checkpoint(out / "global_step_2")
    lr = longer.config.actor_rollout_ref.actor.optim.lr  # no warm-up: after step 2 of 8, lr * (1 + cos(pi / 4)) / 2
    assert longer.actor.optimizer.param_groups[0]["lr"] == pytest.approx(lr * (1 + math.cos(math.pi / 4)) / 2)
    assert longer.actor.scheduler.get_last_lr()[0] == pytest.approx(lr * (1 + math.cos(math.pi / 4)) / 2)


def test_a_resume_may_lower_the_learning_rate_and_the_schedule_goes_on_at_it(workspace, reference, capsys):
    """A guard's stop says to lower the learning rate and resume: the run resumed with half the rates trains its
    next step at half the schedule's rate at that step (cosine over 4 steps, after step 2: lr / 2)."""
    out, _, _ = reference
    lr = load_config(overrides(workspace, out)).actor_rollout_ref.actor.optim.lr
    critic_lr = load_config(overrides(workspace, out)).critic.optim.lr
    lower = build_trainer(load_config(overrides(workspace, workspace.root / "lower",
                                                f"actor_rollout_ref.actor.optim.lr={lr / 2}",
                                                f"critic.optim.lr={critic_lr / 2}")))
    lower.load_checkpoint(out / "global_step_2")
    assert lower.actor.optimizer.param_groups[0]["lr"] == pytest.approx(lr / 2 * (1 + math.cos(math.pi / 2)) / 2)
    assert lower.actor.scheduler.base_lrs == [pytest.approx(lr / 2)]
    assert lower.critic.scheduler.base_lrs == [pytest.approx(critic_lr / 2)]
    err = capsys.readouterr().err
    assert f"notice: actor_rollout_ref.actor.optim.lr is {lr / 2} now, {lr} in {out / 'global_step_2'}" in err
    # the checkpoint saved next holds the new base rates: a resume from it keeps them without a notice
    lower.global_step = 3
    lower.save_checkpoint()
    again = build_trainer(load_config(overrides(workspace, workspace.root / "lower",
                                                f"actor_rollout_ref.actor.optim.lr={lr / 2}",
                                                f"critic.optim.lr={critic_lr / 2}")))
    again.load_checkpoint(workspace.root / "lower" / "global_step_3")
    assert again.actor.scheduler.base_lrs == [pytest.approx(lr / 2)]
    assert "optim.lr is" not in capsys.readouterr().err


def test_a_run_resumed_from_another_folder_names_the_checkpoint_it_loaded_until_it_saves(workspace, reference,
                                                                                          tmp_path):
    """Until a run resumed by resume_path into a folder of its own saves, its weights are those of the checkpoint it
    loaded, in the other folder: a stop before its first step, and a run already at its end (the checkpoint the
    pipeline exports), name that one, not the folder's own global_step_N of the same step, which is not there or is
    an earlier run's."""
    out, _, _ = reference
    loaded, other = out / "global_step_2", tmp_path / "other"
    resume = ("trainer.resume_mode=resume_path", f"trainer.resume_from_path={loaded}")
    trainer = build_trainer(load_config(overrides(workspace, other, *resume)))
    trainer.load_checkpoint(loaded)
    trainer.stop_requested = ("SIGTERM", 15)  # (a signal before the first step resumed)
    with pytest.raises(TrainingInterrupted) as stopped:
        trainer.fit()
    assert stopped.value.checkpoint == str(loaded)
    assert str(stopped.value) == (f"interrupted by SIGTERM after step 2: checkpoint saved at {loaded}; rerun the "
                                  "same command to resume")

    complete = out / f"global_step_{STEPS}"
    (other / f"global_step_{STEPS}").mkdir(parents=True)  # an earlier run's checkpoint of that step in the folder
    result = run(load_config(overrides(workspace, other, "trainer.resume_mode=resume_path",
                                       f"trainer.resume_from_path={complete}")), handle_signals=False)
    assert (result.steps, result.history) == (STEPS, [])  # already at its end: nothing trained, nothing saved
    assert result.checkpoint == str(complete)


def test_a_resume_on_a_training_file_edited_in_place_names_it_once_and_goes_on(workspace, tmp_path, capsys):
    """The checkpoint's place in the data counts the training files' rows: a file rewritten with as many rows,
    other prompts or the same in another order, would feed the resumed run other batches than the saved run's
    without a word. It is not refused (verl does not check, and an edit may be meant): one notice names it. A
    checkpoint saved before the files were fingerprinted resumes without a word, as it did."""
    import hashlib

    import pyarrow.parquet as pq

    from rlhf_core.training import checkpoint as ckpt

    train = tmp_path / "train.parquet"
    train.write_bytes((workspace.root / "data" / "train.parquet").read_bytes())
    out = tmp_path / "edited"
    extra = (f"data.train_files={train}", "trainer.total_training_steps=1", "trainer.save_freq=1")
    build_trainer(load_config(workspace.overrides(out, *extra))).fit()
    saved = out / "global_step_1"
    state = json.loads((saved / ckpt.TRAINER_STATE).read_text())
    assert state["train_files"] == [{"path": str(train.resolve()),
                                     "sha256": hashlib.sha256(train.read_bytes()).hexdigest()}]

    def resumed_notices(*more: str) -> list[str]:
        capsys.readouterr()
        build_trainer(load_config(workspace.overrides(out, *extra, *more))).load_checkpoint(saved)
        return [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice: data.train_files")]

    assert resumed_notices() == []  # the same file: no notice
    rows = pq.read_table(train)
    pq.write_table(rows.take(list(reversed(range(rows.num_rows)))), train)  # the same 32 prompts, reversed, in place
    assert resumed_notices() == [
        f"notice: data.train_files: {train.resolve()} has changed since the checkpoint was saved (other bytes, as many "
        "prompts): the resumed run takes its next batches at the checkpoint's place in the data from the rows as "
        "they are now, which may be other prompts than the saved run would have trained on next (rows edited, or in "
        "another order); it goes on all the same (an edit may be meant; verl does not check)"]
    assert resumed_notices("trainer.val_only=true") == []  # (validating alone, it trains on none of them)

    # a checkpoint from before the fingerprints (no train_files in its state; its manifest's hash of the state file
    # written to match): the edited file resumes silently
    del state["train_files"]
    (saved / ckpt.TRAINER_STATE).write_text(json.dumps(state, indent=1))
    manifest = json.loads((saved / ckpt.MANIFEST).read_text())
    data = (saved / ckpt.TRAINER_STATE).read_bytes()
    manifest["files"][ckpt.TRAINER_STATE] = len(data)
    manifest["sha256"][ckpt.TRAINER_STATE] = hashlib.sha256(data).hexdigest()
    (saved / ckpt.MANIFEST).write_text(json.dumps(manifest, indent=1))
    assert resumed_notices() == []


def test_a_resume_with_reward_code_the_run_allows_to_change_says_so_once(workspace, tmp_path, capsys):
    """A run resumed under edited reward code (trainer.allow_reward_code_change=true) said its notice twice: the
    command checks the checkpoint's config before it loads any model, and the load checks it again."""
    reward = tmp_path / "reward.py"
    reward.write_text((workspace.root / "reward.py").read_text())
    out = tmp_path / "out"
    extra = (f"custom_reward_function.path={reward}", "trainer.save_freq=1")
    run(load_config(workspace.overrides(out, *extra, "trainer.total_training_steps=1")), handle_signals=False)
    reward.write_text(reward.read_text() + "\n\ndef unused_helper():\n    return 0\n")  # the code edited
    capsys.readouterr()
    result = run(load_config(workspace.overrides(out, *extra, "trainer.total_training_steps=2",
                                                 "trainer.allow_reward_code_change=true")), handle_signals=False)
    notices = [line for line in capsys.readouterr().err.splitlines() if "resuming with other reward code" in line]
    assert notices == [
        "notice: custom_reward_function.path: resuming with other reward code than the checkpoint was trained with "
        "(the reward file differs), as trainer.allow_reward_code_change=true allows: the steps before were scored by "
        "the old code"]
    assert [step.step for step in result.history] == [2]  # resumed after step 1


def test_a_read_only_folder_as_a_step_saves_says_how_to_keep_the_run_and_a_move_of_the_folder_resumes_it(
        workspace, reference, tmp_path, monkeypatch):
    """A save refused by the folder (a read-only filesystem, its permissions) said "fix its permissions or set
    trainer.default_local_dir": a rerun in another folder finds no checkpoint and starts afresh, losing the steps
    saved. The message says how to resume from the checkpoint kept, here or in a folder the run's is moved to; and
    a rerun pointed at the moved folder goes on from it exactly."""
    _, expected, _ = reference
    out, moved = tmp_path / "readonly", tmp_path / "elsewhere" / "run"
    real_write = checkpoint.CheckpointFiles.write

    def read_only(file):
        raise OSError(errno.EROFS, "Read-only file system")

    def read_only_at_step_3(files, rel, write):
        real_write(files, rel, read_only if files.folder.name.startswith(".global_step_3.") else write)

    monkeypatch.setattr(checkpoint.CheckpointFiles, "write", read_only_at_step_3)
    with pytest.raises(checkpoint.CheckpointError) as refused:
        run(load_config(overrides(workspace, out, "trainer.save_freq=1")), handle_signals=False)
    assert str(refused.value) == (
        f"checkpoint directory {out} is not writable (Read-only file system) while writing actor/model_state.pt of "
        f"checkpoint {out / 'global_step_3'}; the previous checkpoint {out / 'global_step_2'} is intact: make {out} "
        "writable again (its permissions, or remount a read-only filesystem), then rerun the same command to resume "
        f"from it; or move {out} with its checkpoints and latest_checkpointed_iteration.txt to a writable place and "
        "set trainer.default_local_dir to that place for the rerun (in a folder without them a rerun starts afresh)")
    monkeypatch.undo()

    moved.parent.mkdir()
    shutil.move(out, moved)
    result = run(load_config(overrides(workspace, moved, "trainer.save_freq=1")), handle_signals=False)
    assert result.resumed_from == str(moved / "global_step_2") and [r.step for r in result.history] == [3, 4]
    got = read_metrics(moved / "metrics.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert_same_metrics(got[step], expected[step], step)


def test_a_rollout_stream_saved_on_another_kind_of_device_gives_way_to_a_fresh_one_with_a_notice(workspace, tmp_path,
                                                                                                capsys):
    """trainer.device may change on a resume, but a CUDA generator's state (16 bytes) does not fit a CPU one
    (5,056) nor the other way: the load of the checkpoint failed as "cannot be loaded into the actor"."""
    trainer = build_trainer(load_config(overrides(workspace, tmp_path / "run")))
    generator = trainer.actor.rollout.generator
    fresh = generator.get_state()
    state = trainer.actor.extra_state()
    assert state["rollout_generator"].numel() == 5056  # a CPU generator's
    state["rollout_generator"] = torch.zeros(16, dtype=torch.uint8)  # the size of a CUDA generator's state
    trainer.actor.load_extra_state(state)
    assert torch.equal(generator.get_state(), fresh)
    assert ("notice: the rollout's random stream was saved on another kind of device than this run's (cpu)"
            in capsys.readouterr().err)
