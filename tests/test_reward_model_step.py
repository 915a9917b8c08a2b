"""The reward-model steps in ZenML: a MODEL artifact with its held-out accuracy, and the gate before PPO."""

from __future__ import annotations

import functools
import math

import pytest
from test_pipeline import tiny_setup, zenml_client

from rlhf_core.data.preference import synthetic_pairs, write_splits
from rlhf_core.data.synthetic import DATA_SOURCE

#: reward_model.train.max_length: below the longest side of 10 of the 16 training pairs and 3 of the 16 held-out
#: ones (201 to 271 tokens with the toy's character tokenizer), so that the counts of pairs over it are not 0
MAX_LENGTH = 224


@functools.cache
def rm_overrides() -> tuple[str, ...]:
    setup = tiny_setup()
    pairs = setup.root / "preferences"
    if not (pairs / "train.parquet").exists():
        train, val = synthetic_pairs(16, 16, seed=0)
        write_splits(pairs, train, val, DATA_SOURCE)
    return (f"reward_model.train.model.path={setup.root / 'model'}",
            f"reward_model.train.train_files={pairs / 'train.parquet'}",
            f"reward_model.train.val_files={pairs / 'val.parquet'}",
            "reward_model.train.train_batch_size=8", "reward_model.train.micro_batch_size_per_gpu=8",
            f"reward_model.train.max_length={MAX_LENGTH}",
            f"reward_model.train.default_local_dir={setup.root / 'reward_models'}")


def _reward_model_only():
    from zenml import pipeline

    from steps.load_ppo_config import load_ppo_config
    from steps.train_reward_model import train_reward_model
    from steps.validate_preferences import validate_preferences

    @pipeline(enable_cache=False)
    def reward_model_only(trainer_config: str, overrides: list[str]) -> None:
        ppo_config = load_ppo_config(trainer_config, overrides)
        fingerprint = validate_preferences(ppo_config)
        train_reward_model(ppo_config, fingerprint, min_pair_accuracy=0.0)

    return reward_model_only


@pytest.fixture(scope="module")
def passing_run():
    zenml_client()
    return _reward_model_only()(trainer_config=str(tiny_setup().trainer_config), overrides=list(rm_overrides()))


def test_reward_model_is_a_model_artifact_with_its_held_out_accuracy(passing_run):
    from transformers import AutoModelForSequenceClassification
    from zenml.enums import ArtifactType

    run = zenml_client().get_pipeline_run(passing_run.id)
    assert str(run.status) == "completed"
    step = run.steps["train_reward_model"]
    artifact = step.outputs["reward_model"][0]
    assert artifact.type == ArtifactType.MODEL
    model = AutoModelForSequenceClassification.from_pretrained(artifact.load())
    assert model.config.num_labels == 1
    summary = step.outputs["reward_model_summary"][0].load()
    accuracy = step.run_metadata["held_out_pair_accuracy"]
    assert accuracy == summary["held_out_pair_accuracy"]
    assert step.run_metadata["passed"] is True
    # the held-out scores' range, worked out here in float64 from the exported model, each sequence alone and cut
    # from the left to max_length (overlong=truncate)
    import pandas as pd
    import torch

    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.rewards.reward_model import encode_response

    tokenizer, scorer = load_tokenizer(artifact.load()), model.double().eval()
    frame = pd.read_parquet(tiny_setup().root / "preferences" / "val.parquet")
    with torch.no_grad():
        scores = [float(scorer(input_ids=torch.tensor([encode_response(tokenizer, [dict(m) for m in prompt], text,
                                                                       MAX_LENGTH)[0]])).logits[0, 0])
                  for prompt, *sides in zip(frame["prompt"], frame["chosen"], frame["rejected"]) for text in sides]
    assert len(scores) == 32
    # the held-out accuracy and loss, from the same scores: a pair is right where its chosen side scores above the
    # rejected (a tie is wrong); a margin within 1e-4 of 0 may fall either way in float32
    margins = [chosen - rejected for chosen, rejected in zip(scores[::2], scores[1::2])]
    assert sum(m > 1e-4 for m in margins) / 16 <= accuracy <= sum(m > -1e-4 for m in margins) / 16
    assert summary["held_out_loss"] == pytest.approx(sum(math.log1p(math.exp(-m)) for m in margins) / 16, abs=1e-5)
    for name, value in (("held_out_score_min", min(scores)), ("held_out_score_max", max(scores))):
        assert step.run_metadata[name] == summary[name] == pytest.approx(value, abs=1e-5), name
    fingerprint = run.steps["validate_preferences"].outputs["preference_fingerprint"][0].load()
    assert step.run_metadata["preference_fingerprint"] == fingerprint
    # the pairs over max_length, counted from each side's whole length
    for key, split, expected in (("pairs_over_max_length", "train", 10), ("held_out_pairs_over_max_length", "val", 3)):
        frame = pd.read_parquet(tiny_setup().root / "preferences" / f"{split}.parquet")
        over = sum(max(len(encode_response(tokenizer, [dict(m) for m in prompt], text)[0]) for text in sides)
                   > MAX_LENGTH for prompt, *sides in zip(frame["prompt"], frame["chosen"], frame["rejected"]))
        assert step.run_metadata[key] == summary[key] == over == expected, key
    assert step.run_metadata["overlong"] == summary["overlong"] == "truncate"


def test_low_pair_accuracy_stops_the_run_before_ppo(passing_run):
    from zenml import Model

    from pipelines.rlhf_rm import rlhf_rm_pipeline

    setup = tiny_setup()
    accuracy = zenml_client().get_pipeline_run(passing_run.id).steps["train_reward_model"] \
        .run_metadata["held_out_pair_accuracy"]
    with pytest.raises(RuntimeError):  # the same training (seeded) falls just short of the bar
        rlhf_rm_pipeline.with_options(model=Model(name="tiny-rm-gated"))(
            trainer_config=str(setup.trainer_config), train_files=str(setup.train_file),
            val_files=str(setup.val_file), overrides=list(rm_overrides()), min_pair_accuracy=accuracy + 0.01)
    run = zenml_client().list_pipeline_runs(sort_by="desc:created", size=1)[0]
    assert str(run.status) == "failed"
    assert str(run.steps["train_reward_model"].status) == "failed"
    assert "below the pipeline's min_pair_accuracy (" in str(run.steps["train_reward_model"].run_metadata["reason"])
    assert not {"define_reward", "smoke_test", "train_ppo", "evaluate", "promote"} & set(run.steps)


def test_a_base_with_another_chat_template_stops_the_run_before_it_starts(tmp_path):
    """The reward model keeps its base's chat template, so PPO against it re-encodes each conversation and needs
    the raw chat messages: the run trained the reward model, then its smoke test refused, naming the artifact's
    temporary folder. Now the pipeline refuses as it compiles, before the run starts, naming the base and the fix."""
    import shutil

    from zenml import Model

    from pipelines.rlhf_rm import rlhf_rm_pipeline

    setup = tiny_setup()
    base = tmp_path / "base"
    shutil.copytree(setup.root / "model", base)
    (base / "chat_template.jinja").write_text("{% for message in messages %}Q: {{ message['content'] }}\n"
                                              "{% endfor %}{% if add_generation_prompt %}A: {% endif %}")
    before = zenml_client().list_pipeline_runs(size=1).total
    with pytest.raises(ValueError, match=rf"reward_model.train.model.path: the tokenizer or chat template of "
                                         rf"{base} .* set data.return_raw_chat=true"):
        rlhf_rm_pipeline.with_options(model=Model(name="tiny-rm-template"))(
            trainer_config=str(setup.trainer_config), train_files=str(setup.train_file),
            val_files=str(setup.val_file), overrides=[*rm_overrides(), f"reward_model.train.model.path={base}"],
            min_pair_accuracy=0.0)
    assert zenml_client().list_pipeline_runs(size=1).total == before


def test_an_accuracy_gate_that_cannot_be_applied_or_missing_pairs_stop_the_run_before_it_starts():
    """A pair accuracy outside [0, 1], or one above 0 with no held-out pairs to measure it on, failed the run at
    train_reward_model, after the reward model had trained, and a missing preference file at its third step; now
    the pipeline refuses them as it compiles."""
    from zenml import Model

    from pipelines.rlhf_rm import rlhf_rm_pipeline

    setup, client = tiny_setup(), zenml_client()
    before = client.list_pipeline_runs(size=1).total
    no_held_out = [*(o for o in rm_overrides() if not o.startswith("reward_model.train.val_files=")),
                   "reward_model.train.val_files=null"]
    for overrides, min_pair_accuracy, refusal in (
            (list(rm_overrides()), 1.5,
             r"min_pair_accuracy \(a pipeline parameter\)=1.5 must be a share of held-out pairs in \[0, 1\]"),
            (no_held_out, 0.6, r"min_pair_accuracy \(a pipeline parameter\)=0.6 is measured on held-out pairs: "
                               r"set reward_model.train.val_files"),
            ([*no_held_out, "reward_model.train.min_pair_accuracy=0.6"], None,
             r"reward_model.train.min_pair_accuracy=0.6 is measured on held-out pairs"),
            ([*rm_overrides(), "reward_model.train.train_files=/nonexistent/pairs.parquet"], 0.0,
             r"reward_model.train.train_files: /nonexistent/pairs.parquet does not exist")):
        with pytest.raises(ValueError, match=refusal):
            rlhf_rm_pipeline.with_options(model=Model(name="tiny-rm-gate-refused"))(
                trainer_config=str(setup.trainer_config), train_files=str(setup.train_file),
                val_files=str(setup.val_file), overrides=overrides, min_pair_accuracy=min_pair_accuracy)
    assert client.list_pipeline_runs(size=1).total == before
    with pytest.raises(KeyError):
        client.get_model("tiny-rm-gate-refused")


def test_one_checkpoint_folder_for_the_reward_model_and_ppo_stops_the_run_before_it_starts():
    """Each step trains into <its default_local_dir>/<run name>: with one folder for both, train_ppo met the reward
    model's checkpoints in its run's folder and refused them, after the reward model had trained; now the pipeline
    refuses the config as it compiles, the folder however it is written (here with a closing slash)."""
    from zenml import Model

    from pipelines.rlhf_rm import rlhf_rm_pipeline

    setup, client = tiny_setup(), zenml_client()
    before = client.list_pipeline_runs(size=1).total
    folder = setup.root / "reward_models"  # rm_overrides()' reward_model.train.default_local_dir
    with pytest.raises(ValueError, match=rf"reward_model.train.default_local_dir and trainer.default_local_dir are "
                                         rf"one folder \({folder}\)"):
        rlhf_rm_pipeline.with_options(model=Model(name="tiny-rm-one-folder"))(
            trainer_config=str(setup.trainer_config), train_files=str(setup.train_file),
            val_files=str(setup.val_file), overrides=[*rm_overrides(), f"trainer.default_local_dir={folder}/"],
            min_pair_accuracy=0.0)
    assert client.list_pipeline_runs(size=1).total == before


def test_the_whole_pipeline_dry_runs_and_trains_against_the_reward_model_it_trained(passing_run, tmp_path):
    """rlhf_rm_pipeline end to end on the tiny setup: the smoke test's rollouts and training's are both scored by
    the reward model the run trained (its metrics carry the model's score beside the rule's gold reward), and the
    candidate gets a promotion decision. The rule reward fails once after step 1's checkpoint: the step's retry
    resumes it, the reward model's path the same over the attempts (each unpacks the artifact afresh)."""
    import yaml
    from test_pipeline import failing_once_after_step_1
    from zenml import Model

    from pipelines.rlhf_rm import rlhf_rm_pipeline

    setup, runs = tiny_setup(), tmp_path / "runs"
    flaky = failing_once_after_step_1(tmp_path, runs)
    run = rlhf_rm_pipeline.with_options(
        model=Model(name="tiny-rm-whole"), steps={"train_ppo": {"retry": {"max_retries": 1, "delay": 0}}})(
        trainer_config=str(setup.trainer_config), train_files=str(setup.train_file), val_files=str(setup.val_file),
        overrides=[*rm_overrides(), "trainer.save_freq=1", f"custom_reward_function.path={flaky}",
                   f"trainer.default_local_dir={runs}"], min_pair_accuracy=0.0)
    run = zenml_client().get_pipeline_run(run.id)
    assert str(run.status) == "completed" and (tmp_path / "failed_once").exists()
    summary = run.steps["train_ppo"].outputs["training_summary"][0].load()
    assert summary["resumed_from"] == str(runs / run.name / "global_step_1")
    saved = yaml.safe_load((runs / run.name / "global_step_3" / "config.yaml").read_text())
    given = run.steps["train_ppo"].inputs["reward_model"]
    artifact = (given if isinstance(given, list) else [given])[0]
    assert saved["reward_model"]["model"]["path"] == str(runs / "reward_model" / str(artifact.id))
    trained = run.steps["train_reward_model"].outputs["reward_model"][0]
    for name in ("smoke_test", "train_ppo"):  # both take the artifact the run trained (each loads its own copy)
        given = run.steps[name].inputs["reward_model"]
        assert [a.id for a in (given if isinstance(given, list) else [given])] == [trained.id], name
    smoke = run.steps["smoke_test"].outputs["smoke_report"][0].load()
    assert smoke["passed"] is True
    # both steps name the reward model by its artifact, as the lineage report does, not by the temporary folder
    # ZenML unpacked it into for the step (gone after it)
    named = f"artifact reward_model v{trained.version} id {trained.id}"
    assert smoke["reward_model"] == run.steps["smoke_test"].run_metadata["reward_model"] == named
    assert summary["reward_model"] == run.steps["train_ppo"].run_metadata["reward_model"] == named
    assert all("critic/rm_score/mean" in step and "critic/gold_reward/mean" in step for step in smoke["metrics"])
    history = run.steps["train_ppo"].outputs["training_summary"][0].load()["history"]
    assert history and all("critic/rm_score/mean" in step for step in history)
    # no production version of this model yet: the candidate against the base model, on the evaluate step's
    # per-problem results, by the gate's rule (min_improvement 0, alpha 0.05): any gain, with McNemar's exact
    # p (two-sided binomial over the problems one got right and the other wrong) under 0.05
    decision = run.steps["promote"].outputs["promotion_decision"][0].load()
    evaluation = run.steps["evaluate"].outputs["evaluation"][0].load()
    problems, base = evaluation["problems"], evaluation["base_problems"]
    fixed = sum(problems[pid] and not base[pid] for pid in problems)
    broken = sum(base[pid] and not problems[pid] for pid in problems)
    p_value = min(1.0, 2 * sum(math.comb(fixed + broken, i) for i in range(min(fixed, broken) + 1))
                  / 2 ** (fixed + broken))
    assert decision["baseline"] == "base_model"
    assert decision["promoted"] is (fixed > broken and p_value < 0.05), decision["decision_reason"]
    assert decision["p_value"] == pytest.approx(p_value)


def test_preference_files_replaced_after_their_validation_stop_the_training_step():
    """The step trains on the pairs validate_preferences checked and recorded: files whose content changed since
    (the fingerprint it was handed differs) stop it, as train_ppo stops on changed prompt data."""
    from rlhf_core.config import load_config
    from rlhf_core.data.validation import DataChangedError, splits_fingerprint
    from steps.train_reward_model import train_reward_model

    config = load_config([f"actor_rollout_ref.model.path={tiny_setup().root / 'model'}", *rm_overrides()])
    rm = config.reward_model.train
    validated = splits_fingerprint([rm.train_files], [rm.val_files])
    changed = splits_fingerprint([rm.val_files], [rm.val_files])  # what another train file would give
    with pytest.raises(DataChangedError, match=r"train_reward_model: the data files changed since they were validated"):
        train_reward_model.entrypoint(config.to_dict(), changed, min_pair_accuracy=0.0)
    assert validated != changed


def _skipping_step_run(tmp_path, monkeypatch, *extra, updated_steps: int = 0):
    """The training step outside a pipeline (its run named ``run-1``) whose loss is not finite after its first
    ``updated_steps`` steps (the chosen scores NaN in training, as scores past float16's range are): each step after
    them is skipped, step 1 is saved, and the second skip in a row stops the run."""
    import math
    from types import SimpleNamespace

    import steps.train_reward_model as module
    from rlhf_core.config import load_config
    from rlhf_core.data.validation import splits_fingerprint
    from rlhf_core.training.reward_trainer import RewardModelWorker

    train_step, rewards, calls = RewardModelWorker.train_step, RewardModelWorker._rewards, []

    def counted(worker, *args):
        calls.append(None)
        return train_step(worker, *args)

    def overflow(worker, micro):
        chosen, rejected = rewards(worker, micro)
        return (chosen * math.nan if worker.module.training and len(calls) > updated_steps else chosen), rejected

    monkeypatch.setattr(RewardModelWorker, "train_step", counted)
    monkeypatch.setattr(RewardModelWorker, "_rewards", overflow)
    monkeypatch.setattr(module, "get_step_context", lambda: SimpleNamespace(pipeline_run=SimpleNamespace(name="run-1")))
    config = load_config([f"actor_rollout_ref.model.path={tiny_setup().root / 'model'}", *rm_overrides(),
                          f"reward_model.train.default_local_dir={tmp_path}", "reward_model.train.save_freq=1",
                          "reward_model.train.max_consecutive_skips=2", "trainer.device=cpu",
                          "trainer.n_gpus_per_node=1", *extra])
    rm = config.reward_model.train
    return lambda: module.train_reward_model.entrypoint(
        config.to_dict(), splits_fingerprint([rm.train_files], [rm.val_files]), min_pair_accuracy=0.0)


def test_a_failed_training_step_says_how_a_new_pipeline_run_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """A pipeline run again trains the reward model in a folder of its own, from the start: the failed step's
    message names the overrides that resume from its checkpoint, not "rerun the same command". (Step 1 takes an
    update, steps 2 and 3 are skipped: the checkpoint of step 2 holds trained weights to go on from.)"""
    from rlhf_core.training.guards import GuardError

    train = _skipping_step_run(tmp_path, monkeypatch, "reward_model.train.total_epochs=2", updated_steps=1)
    with pytest.raises(GuardError, match="stopped at step 3") as failure:
        train()
    latest = tmp_path / "run-1" / "global_step_2"
    assert (f"add reward_model.train.resume_mode=resume_path and reward_model.train.resume_from_path={latest} to the "
            "run config's overrides, then run the pipeline again, to resume from it") in str(failure.value)
    assert "rerun the same command" not in str(failure.value)
    assert failure.value.resume_advice.startswith("add reward_model.train.resume_mode=resume_path")


def test_a_training_step_none_of_whose_steps_took_an_update_is_not_told_to_resume(tmp_path, monkeypatch):
    """Every step skipped, the run's checkpoint holds the weights it started from, and a run resumed from it meets the
    same pairs on them alike: the step's failure names a new run, with no note to resume from that checkpoint."""
    from rlhf_core.training.reward_trainer import NothingTrainedError

    train = _skipping_step_run(tmp_path, monkeypatch)
    with pytest.raises(NothingTrainedError) as failure:
        train()
    assert (tmp_path / "run-1" / "global_step_1").is_dir()
    assert str(failure.value).endswith("its checkpoints hold the weights it started from (reward_model.train.model."
                                       "path), which no step updated, and a resume meets the same pairs on them "
                                       "alike: start the new run with reward_model.train.resume_mode=disable or "
                                       "another reward_model.train.default_local_dir")
    assert not getattr(failure.value, "__notes__", None)
    assert not hasattr(failure.value, "resume_advice")


def test_a_retried_training_step_resumes_its_own_checkpoint(tmp_path, monkeypatch, capsys):
    """A retry of the step in the same pipeline run (its folder holds the first attempt's checkpoint) resumes from
    that checkpoint, not afresh as resume_mode=disable would have it."""
    from rlhf_core.training.guards import GuardError

    train = _skipping_step_run(tmp_path, monkeypatch, "reward_model.train.resume_mode=disable")
    with pytest.raises(GuardError, match="stopped at step 2"):
        train()
    capsys.readouterr()
    with pytest.raises(GuardError, match="stopped at step 2"):  # one more skip after step 1's: the same stop
        train()
    err = capsys.readouterr().err
    assert f"resumed the reward model from {tmp_path / 'run-1' / 'global_step_1'}" in err
    assert "not afresh as reward_model.train.resume_mode=disable says" in err
