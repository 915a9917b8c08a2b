"""Which of the trainer's warnings about a run that cannot learn the dry run gives: a reward that scores every
response the same is said, as in the run; responses cut off at the dry run's own response cap are not."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from rlhf_core.config import load_config
from rlhf_core.data.synthetic import build_dataset
from rlhf_core.models.toy import random_toy_model
from rlhf_core.pipeline.smoke import run_smoke_test
from rlhf_core.training.trainer import PPOTrainer

CUT = "raise data.max_response_length"
ALIKE = "every response of the batch scored the same"
CHECK_REWARD = "check the reward"


def _warned(capsys, stuck_warnings, clip_ratio: float, flat: bool) -> str:
    """What ``_warn_if_stuck`` prints at step 1 for a GAE run (one response a prompt) whose step cut off
    ``clip_ratio`` of its responses and scored them alike or not."""
    cfg = NS(data=NS(max_response_length=16), actor_rollout_ref=NS(rollout=NS(n=1)),
             algorithm=NS(adv_estimator="gae", use_kl_in_reward=False))
    trainer = NS(config=cfg, scores_flat=flat, _stuck_warned={}, use_critic=True,
                 stuck_warnings=frozenset(stuck_warnings))
    PPOTrainer._warn_if_stuck(trainer, 1, {"response_length/clip_ratio": clip_ratio})
    return capsys.readouterr().err


def test_the_stuck_warnings_given_are_a_trainer_option(capsys):
    every = ("clip", "flat")
    # every kind (the trainer's default): a cut step is told to raise the length, scored alike or not
    assert CUT in _warned(capsys, every, 1.0, flat=False)
    both = _warned(capsys, every, 1.0, flat=True)
    assert CUT in both and ALIKE in both and CHECK_REWARD not in both
    assert CHECK_REWARD in _warned(capsys, every, 0.5, flat=True)
    # the alike scores alone: a step scored alike is still said; a cut one is not, alike or not (the cut is
    # what the trainer puts alike scores down to there, and its advice is the length's)
    alone = _warned(capsys, ("flat",), 0.5, flat=True)
    assert alone.startswith(f"WARNING step 1: {ALIKE}") and CHECK_REWARD in alone and "max_response_length" not in alone
    assert _warned(capsys, ("flat",), 1.0, flat=False) == ""
    assert _warned(capsys, ("flat",), 1.0, flat=True) == ""
    assert _warned(capsys, (), 0.5, flat=True) == ""
    assert _warned(capsys, every, 0.5, flat=False) == ""  # (a step that can learn)


def test_scores_alike_with_many_responses_cut_name_the_length_beside_the_reward(capsys):
    """Scores that tell no response apart were put down to the reward alone under 90% of the responses cut: at 75%
    the warning said to check the reward, and a step later, at 100%, to raise the length, for one cause. From half
    the responses cut the reward's warning names the length too; under half, or where cut responses are not
    warned of (the dry run), it does not."""
    every = ("clip", "flat")
    assert _warned(capsys, every, 0.75, flat=True) == (
        "WARNING step 1: every response of the batch scored the same, so the advantages carry no reward signal (only "
        "the critic's values move them) and the policy learns nothing about the reward from this step; check the "
        "reward: the reward function (custom_reward_function) or reward model, and the data's ground truth (its "
        "reward_model.ground_truth field); and 75% of the responses reached data.max_response_length=16 and were cut "
        "off (response_length/clip_ratio 0.75): a cut response seldom reaches its answer, so where the reward is "
        "right, raise data.max_response_length\n")
    below = _warned(capsys, every, 0.4, flat=True)
    assert below.startswith(f"WARNING step 1: {ALIKE}") and "max_response_length" not in below
    dry_run = _warned(capsys, ("flat",), 0.75, flat=True)
    assert CHECK_REWARD in dry_run and "max_response_length" not in dry_run


def test_a_stuck_warning_the_trainer_does_not_give_is_refused_by_name():
    with pytest.raises(ValueError, match=r"stuck_warnings: clipped is not a kind of warning the trainer gives "
                                         r"\(its kinds: clip, flat\)"):
        PPOTrainer(None, None, None, None, None, stuck_warnings=("clipped", "flat"))


CONSTANT_REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                   "    return 0.5\n")


@pytest.fixture(scope="module")
def constant_reward_run(tmp_path_factory):
    """A run config of a random 1-layer model (small enough that the dry run takes it as it is) scored by a
    reward that gives every response 0.5, its responses up to 150 tokens (the model ends most of them before)."""
    root = tmp_path_factory.mktemp("constant")
    model = random_toy_model(root / "model", n_layers=1, hidden_size=32, max_position_embeddings=512, seed=0)
    data = build_dataset(root / "data", n_train=8, n_test=4, seed=0, max_ops=1)
    (root / "constant.py").write_text(CONSTANT_REWARD)
    return root, load_config([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data['train']}", f"data.val_files={data['test']}",
        "data.train_batch_size=4", "data.max_prompt_length=320", "data.max_response_length=150",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "critic.model.enable_gradient_checkpointing=false", f"custom_reward_function.path={root / 'constant.py'}",
        "trainer.n_gpus_per_node=1", "trainer.device=cpu", "trainer.logger=[]",
        f"trainer.default_local_dir={root / 'unused'}",
    ])


def test_the_dry_run_says_a_reward_that_scores_every_response_the_same(constant_reward_run, capsys):
    """The dry run switched every such warning off: a reward that cannot teach went unsaid until the run."""
    root, cfg = constant_reward_run
    report = run_smoke_test(cfg, root / "long", n_prompts=4, response_length=150)
    assert report.passed, report.summary()
    assert not report.cloned
    first = report.metrics[0]
    assert first["critic/score/min"] == first["critic/score/max"] == 0.5
    assert first["response_length/clip_ratio"] < 0.9  # (most responses ended before the cap: none is cut short)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("WARNING step")]
    assert warnings and warnings[0].startswith(f"WARNING step 1: {ALIKE}, so the advantages carry no reward signal")
    assert CHECK_REWARD in warnings[0]
    assert not any("max_response_length" in line for line in warnings)


def test_the_dry_run_says_nothing_of_responses_its_own_cap_cut(constant_reward_run, capsys):
    """Responses cut at the dry run's cap (4 tokens; the run config says 150) and, with them, scored alike: what
    the trainer says there is to raise data.max_response_length, a limit the user never set. (The project's demo
    config, dry-run at its 16 tokens, was so warned "check the reward", its answers all cut before their end.)"""
    root, cfg = constant_reward_run
    report = run_smoke_test(cfg, root / "short", n_prompts=4, response_length=4)
    assert report.passed, report.summary()
    assert [m["response_length/clip_ratio"] for m in report.metrics] == [1.0, 1.0]
    assert report.metrics[0]["critic/score/min"] == report.metrics[0]["critic/score/max"]
    assert "WARNING step" not in capsys.readouterr().err


def test_the_dry_run_says_responses_cut_at_the_run_configs_own_length(constant_reward_run, capsys):
    """Where the run config's data.max_response_length (4) is no longer than the dry run's cap (16), the cap is the
    run's own: every response cut there is cut in the run too, whose first step says so. The dry run said
    nothing (the demo config at data.max_response_length=16, its answers all cut, passed without a word)."""
    import copy

    root, cfg = constant_reward_run
    short = copy.deepcopy(cfg)
    short.data.max_response_length = 4
    report = run_smoke_test(short, root / "own", n_prompts=4, response_length=16)
    assert report.passed and not report.cloned, report.summary()
    assert [m["response_length/clip_ratio"] for m in report.metrics] == [1.0, 1.0]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("WARNING step")]
    assert len(warnings) == 1 and warnings[0].startswith(
        "WARNING step 1: 100% of the responses reached data.max_response_length=4 and were cut off"), warnings
    assert warnings[0].endswith("raise data.max_response_length")
