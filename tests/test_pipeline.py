"""The ZenML pipelines end to end on a tiny setup, in-process, on a throwaway local store.

One model is trained once per session (:func:`trained_model`) and shared with test_lineage.py and
test_dashboard.py: version 1 from ``rlhf_ppo_pipeline``, version 2 from ``rlhf_retrain_pipeline``
on new data, warm-started from version 1 and judged against it.

The tiny setup: a random 1-layer character model, 32 synthetic problems, and a reward that a few
PPO steps can learn for sure (full marks when the response starts with a digit; the reference
solutions are the bare answers, so the reward's self-check passes).
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-ppo-policy"
STEPS = ["load_ppo_config", "validate_data", "define_reward", "smoke_test", "train_ppo", "evaluate", "promote"]

# ZenML reads where its store lives when it first starts, so this comes before any zenml import. The
# repository path holds no .zen/: a repository made with `zenml init` in the checkout is never touched.
ZENML_HOME = Path(tempfile.mkdtemp(prefix="rlhf-zenml-tests-"))
atexit.register(shutil.rmtree, ZENML_HOME, ignore_errors=True)
os.environ.update({
    "ZENML_CONFIG_PATH": str(ZENML_HOME / "config"),
    "ZENML_REPOSITORY_PATH": str(ZENML_HOME),
    "ZENML_ANALYTICS_OPT_IN": "false",
    "ZENML_LOGGING_VERBOSITY": os.environ.get("ZENML_LOGGING_VERBOSITY", "WARN"),
    "ZENML_ENABLE_RICH_TRACEBACK": "false",
    "ZENML_AUTO_OPEN_DASHBOARD": "false",
})


@functools.cache
def zenml_client():
    """The client of the throwaway store, with step sources resolved against the checkout."""
    from zenml.client import Client
    from zenml.config.global_config import GlobalConfiguration
    from zenml.utils import source_utils

    GlobalConfiguration._reset_instance()  # in case anything read the configuration before the env was set
    Client._reset_instance()
    source_utils.set_custom_source_root(str(REPO_ROOT))
    return Client()


@dataclass(frozen=True)
class TinySetup:
    root: Path
    trainer_config: Path
    train_file: Path
    val_file: Path
    new_train_file: Path  # the same problems and 16 more: "new data" for retraining


def _bare_answers(path: Path) -> None:
    frame = pd.read_parquet(path)
    frame["extra_info"] = [{**extra, "answer": reward["ground_truth"]}
                           for extra, reward in zip(frame["extra_info"], frame["reward_model"])]
    frame.to_parquet(path, index=False)


@functools.cache
def tiny_setup() -> TinySetup:
    from rlhf_core.data.synthetic import build_dataset
    from rlhf_core.models.toy import random_toy_model

    root = ZENML_HOME / "tiny"
    model = random_toy_model(root / "model", n_layers=1, hidden_size=32, max_position_embeddings=512, seed=0)
    first = build_dataset(root / "data", n_train=32, n_test=8, seed=0, max_ops=1)
    more = build_dataset(root / "new_data", n_train=48, n_test=8, seed=0, max_ops=1)
    for path in (first["train"], first["test"], more["train"]):
        _bare_answers(path)
    reward = root / "digit_first.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1.0 if solution_str[:1].isdigit() else 0.0\n")
    # 8 samples per prompt: with 4, whether three steps find the digit-first answers depended on the random
    # stream (3 of 6 runs over seeds 0-2 and two samplers missed); with 8, 10 of 10 (seeds 0-4) reached it
    trainer_config = root / "ppo_tiny.yaml"
    trainer_config.write_text(f"""\
data: {{train_batch_size: 8, max_prompt_length: 320, max_response_length: 4}}
actor_rollout_ref:
  model: {{path: {model}, enable_gradient_checkpointing: false}}
  actor: {{ppo_mini_batch_size: 8, ppo_micro_batch_size_per_gpu: 32, optim: {{lr: 2.0e-2}}}}
  rollout: {{n: 8, log_prob_micro_batch_size_per_gpu: 32}}
  ref: {{log_prob_micro_batch_size_per_gpu: 32}}
algorithm: {{adv_estimator: grpo}}
custom_reward_function: {{path: {reward}, name: compute_score}}
trainer: {{total_training_steps: 3, test_freq: -1, val_before_train: false, n_gpus_per_node: 1, device: cpu,
          logger: [file], default_local_dir: {root / 'checkpoints'}}}
""")
    return TinySetup(root, trainer_config, first["train"], first["test"], more["train"])


def run_pipeline(model_name: str, retrain: bool = False, train_file: Path | None = None,
                 val_file: Path | None = None, **parameters):
    """One in-process run of the training (or retraining) pipeline on the tiny setup."""
    zenml_client()
    from zenml import Model

    from pipelines.retrain import rlhf_retrain_pipeline
    from pipelines.rlhf_ppo import rlhf_ppo_pipeline

    setup = tiny_setup()
    pipeline = (rlhf_retrain_pipeline if retrain else rlhf_ppo_pipeline).with_options(model=Model(name=model_name))
    return pipeline(trainer_config=str(setup.trainer_config), train_files=str(train_file or setup.train_file),
                    val_files=str(val_file or setup.val_file), **parameters)


@functools.cache
def trained_model() -> tuple[str, tuple]:
    """(model name, run ids): version 1 trained, version 2 retrained on new data and judged against 1."""
    first = run_pipeline(MODEL)
    second = run_pipeline(MODEL, retrain=True, train_file=tiny_setup().new_train_file)
    return MODEL, (first.id, second.id)


@pytest.fixture(scope="module")
def trained():
    return trained_model()


def _version(number_or_stage):
    return zenml_client().get_model_version(MODEL, number_or_stage)


def test_first_run_trains_and_promotes_version_1(trained):
    _, (first_run_id, _) = trained
    run = zenml_client().get_pipeline_run(first_run_id)
    assert str(run.status) == "completed"
    assert sorted(run.steps) == sorted(STEPS)
    version = _version(1)
    meta = version.run_metadata
    assert meta["promoted"] is True, meta["decision_reason"]
    assert meta["promotion"] == "done"  # recorded pending before the stage was set, then marked done
    assert meta["baseline"] == "base_model"
    assert "warm_started_from" not in meta  # trained from the config's base model
    assert meta["config_fingerprint"] == _version(2).run_metadata["config_fingerprint"]  # the same trainer config
    assert meta["accuracy"] > meta["base_accuracy"]
    # the digit-first reward is easy: three steps reach its ceiling on every validation prompt
    assert meta["accuracy"] == 1.0
    assert meta["checkpoint_artifact_id"] == str(run.steps["train_ppo"].outputs["ppo_checkpoint"][0].id)
    assert meta["dataset_fingerprint"] == run.steps["validate_data"].outputs["dataset_fingerprint"][0].load()
    assert meta["reward_sha256"] == run.steps["define_reward"].outputs["reward_spec"][0].load()["sha256"]
    assert meta["smoke_test_passed"] is True
    summary = run.steps["train_ppo"].outputs["training_summary"][0].load()
    assert [record["step"] for record in summary["history"]] == [1, 2, 3]
    assert summary["val_before_train"] is None  # trainer.val_before_train=false: the evaluate step measures the base


def test_second_run_creates_version_2_and_decides_against_the_first(trained):
    _, (_, second_run_id) = trained
    run = zenml_client().get_pipeline_run(second_run_id)
    assert str(run.status) == "completed"
    assert "check_new_data" in run.steps
    first, second = _version(1), _version(2)
    meta = second.run_metadata
    assert meta["baseline"] == "production"
    assert meta["previous_production_version"] == "1"
    assert meta["baseline_accuracy"] == first.run_metadata["accuracy"]
    assert meta["dataset_fingerprint"] != first.run_metadata["dataset_fingerprint"]
    # warm start: the dry run started from version 1's checkpoint artifact, not from the base model of the config,
    # and training from the one the dry run names (loaded by id: ZenML lists it among train_ppo's inputs)
    init_from = run.steps["smoke_test"].regular_inputs["init_from"][0]
    assert str(init_from.id) == first.run_metadata["checkpoint_artifact_id"]
    assert [str(a.id) for a in run.steps["train_ppo"].inputs["ppo_checkpoint"]] == [str(init_from.id)]
    assert run.steps["train_ppo"].run_metadata["warm_start_artifact"] == str(init_from.id)
    smoke = run.steps["smoke_test"].outputs["smoke_report"][0].load()
    assert smoke["init_from_artifact_id"] == str(init_from.id)
    assert smoke["passed"] is True and smoke["target_model"] != str(tiny_setup().root / "model")
    # version 1 already has the ceiling accuracy (1.0), so version 2 can at best tie it, and a tie is
    # no gain: version 2 is not promoted and production stays at version 1
    assert meta["accuracy"] <= meta["baseline_accuracy"] == 1.0
    assert meta["promoted"] is False and "promotion" not in meta  # a refusal changes no stage: one record
    assert meta["decision_reason"].startswith("not promoted: no improvement"), meta["decision_reason"]
    assert _version("production").number == 1
    assert meta["warm_started_from"] == "1"
    assert run.steps["train_ppo"].run_metadata["warm_started_from"] == "1"


def test_artifacts_carry_visualizations_and_a_loadable_hf_checkpoint(trained):
    from transformers import AutoModelForCausalLM

    from rlhf_core.pipeline.evaluate import resolve_policy_dir

    _, (first_run_id, _) = trained
    steps = zenml_client().get_pipeline_run(first_run_id).steps
    kinds = {name: {str(v.type) for v in steps[step].outputs[name][0].visualizations}
             for step, name in (("validate_data", "validation_report"), ("evaluate", "evaluation_report"),
                                ("train_ppo", "training_curves"))}
    assert kinds == {"validation_report": {"html"}, "evaluation_report": {"html"}, "training_curves": {"image"}}
    report = steps["evaluate"].outputs["evaluation_report"][0].load()
    assert "right" in report and "<img" in report
    checkpoint = steps["train_ppo"].outputs["ppo_checkpoint"][0].load()
    model = AutoModelForCausalLM.from_pretrained(resolve_policy_dir(checkpoint))
    assert model.config.num_hidden_layers == 1


def _versions(model_name: str) -> list[int]:
    from zenml.utils.pagination_utils import depaginate

    return sorted(v.number for v in depaginate(zenml_client().list_model_versions, model=model_name))


def test_retraining_on_unchanged_data_is_skipped_and_leaves_no_model_version(trained):
    production = _version("production")
    assert production.number == 1  # version 2 was not promoted (above): production was trained on train_file
    before = _versions(MODEL)
    run = run_pipeline(MODEL, retrain=True, train_file=tiny_setup().train_file)
    assert str(run.status) == "completed"
    # the version ZenML made as the run started is gone: a nightly run with nothing new adds none to the model
    assert _versions(MODEL) == before
    run = zenml_client().get_pipeline_run(run.id)
    assert run.model_version is None
    # the run says why it trained nothing
    assert "skipped" in [tag.name for tag in run.tags]
    assert run.run_metadata["skipped"].startswith("the data, trainer config and reward are unchanged since "
                                                  "production version 1 was trained")
    assert run.run_metadata["production_version"] == "1" and run.run_metadata["model"] == MODEL
    gate = run.steps["check_new_data"].run_metadata
    assert gate["skipped"] is True and gate["reason"] == run.run_metadata["skipped"]
    promotion = run.steps["promote"].run_metadata
    assert promotion["promoted"] is False
    assert promotion["decision_reason"].startswith("not promoted: training was skipped")
    assert _version("production").number == production.number
    summary = run.steps["train_ppo"].outputs["training_summary"][0].load()
    assert summary["steps"] == 0
    # no copy of production's weights for a run that trained nothing: the artifact is a note
    folder = run.steps["train_ppo"].outputs["ppo_checkpoint"][0].load()
    assert [p.name for p in folder.iterdir()] == ["SKIPPED.txt"]
    assert (folder / "SKIPPED.txt").read_text().startswith("training skipped: the data, trainer config and reward are "
                                                          "unchanged since production")
    # written where this run's checkpoints would have been, not left in the system's temp folder
    local_dir = run.steps["load_ppo_config"].outputs["ppo_config"][0].load()["trainer"]["default_local_dir"]
    assert (Path(local_dir) / run.name / "SKIPPED.txt").read_text() == (folder / "SKIPPED.txt").read_text()


def test_a_retraining_into_an_existing_model_version_is_refused_before_the_run(trained):
    """A run config's model.version that named production (or any existing version) made ZenML reuse it: on
    unchanged data the gate recorded this run's fingerprints on it, promote tagged it skipped and the last step
    deleted it, so that the model had no production version left (and no later retraining could warm-start)."""
    from zenml import Model
    from zenml.utils.pagination_utils import depaginate

    from pipelines.retrain import rlhf_retrain_pipeline
    from rlhf_core.pipeline.run_config import RunConfigError

    client = zenml_client()
    client.create_model_version(MODEL, name="nightly")
    before = [(v.name, v.stage) for v in depaginate(client.list_model_versions, model=MODEL)]
    for version, told in (("production", "names an existing version of 'tiny-ppo-policy' (a stage or a number)"),
                          ("1", "names an existing version of 'tiny-ppo-policy' (a stage or a number)"),
                          ("nightly", "is an existing version of 'tiny-ppo-policy'")):
        pipeline = rlhf_retrain_pipeline.with_options(model=Model(name=MODEL, version=version))
        with pytest.raises(RunConfigError, match=re.escape(f"model.version {version!r} {told}; the retraining makes "
                                                           "a new version each run")):
            pipeline(trainer_config=str(tiny_setup().trainer_config), train_files=str(tiny_setup().train_file),
                     val_files=str(tiny_setup().val_file))
    assert [(v.name, v.stage) for v in depaginate(client.list_model_versions, model=MODEL)] == before
    client.delete_model_version(client.get_model_version(MODEL, "nightly").id)


def test_the_skipped_runs_discard_keeps_a_version_it_did_not_make(trained):
    """The discard step's last look before deleting: production's version, or one another run made, is kept."""
    from steps.discard_skipped_version import not_this_runs_own

    client = zenml_client()
    _, (first_run_id, second_run_id) = trained
    production, second = _version("production"), _version(2)  # version 2: the retraining's, refused
    assert production.number == 1 and second.stage is None
    assert not_this_runs_own(client, production.id, first_run_id) == "it is the production version"
    first_run = client.get_pipeline_run(first_run_id).name
    assert not_this_runs_own(client, second.id, first_run_id) == (
        f"runs before this one made it: {client.get_pipeline_run(second_run_id).name}")
    assert not_this_runs_own(client, second.id, second_run_id) is None  # its own: the one a skipped run deletes
    assert first_run != client.get_pipeline_run(second_run_id).name


def test_retraining_on_data_a_refused_version_was_trained_on_is_skipped(trained):
    """Version 2 was trained on the new data from version 1 and refused (above): the same run again, from the
    same production with the same config and reward, would repeat it."""
    second = _version(2).run_metadata
    assert second["promoted"] is False and second["warm_started_from"] == "1"
    assert _version("production").number == 1
    before = _versions(MODEL)
    run = run_pipeline(MODEL, retrain=True, train_file=tiny_setup().new_train_file)
    assert str(run.status) == "completed"
    assert _versions(MODEL) == before  # no empty version 3
    run = zenml_client().get_pipeline_run(run.id)
    gate = run.steps["check_new_data"].run_metadata
    assert gate["production_version"] == "1" and gate["refused_version"] == "2"
    assert gate["config_fingerprint"] == second["config_fingerprint"]
    assert second["evaluation_settings"] == GATE_EVALUATION  # read off the run
    assert run.run_metadata["skipped"] == gate["reason"]
    assert gate["reason"].startswith("version 2 was already trained on this data"), gate["reason"]
    assert "force=true" in gate["reason"]
    assert "warm_started_from" not in run.steps["train_ppo"].run_metadata  # it trained nothing, so started from nothing
    assert run.steps["train_ppo"].outputs["training_summary"][0].load()["steps"] == 0


def failing_once_after_step_1(tmp_path: Path, runs: Path) -> Path:
    """The digit-first reward, raising once when a run under ``runs`` has saved step 1 (``tmp_path/failed_once``
    marks that it did)."""
    reward = tmp_path / "flaky.py"
    reward.write_text(
        "import pathlib\n"
        f"RUNS, FLAG = pathlib.Path({str(runs)!r}), pathlib.Path({str(tmp_path / 'failed_once')!r})\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if not FLAG.exists() and any(RUNS.glob('*/global_step_1')):\n"
        "        FLAG.write_text('x')\n"
        "        raise RuntimeError('planted failure after the first checkpoint')\n"
        "    return 1.0 if solution_str[:1].isdigit() else 0.0\n")
    return reward


def test_a_retried_retraining_step_resumes_its_checkpoint_and_keeps_the_whole_history(trained, tmp_path):
    """The reward fails once, after step 1's checkpoint: ZenML's retry of train_ppo resumes from it. The warm-start
    policy keeps one path over the attempts (the artifact store unpacks it afresh each time, and a resume refuses
    a changed model path), and the summary's history holds step 1 from before the retry."""
    from zenml import Model

    from pipelines.retrain import rlhf_retrain_pipeline

    setup, runs = tiny_setup(), tmp_path / "runs"
    flaky = failing_once_after_step_1(tmp_path, runs)
    pipeline = rlhf_retrain_pipeline.with_options(
        model=Model(name=MODEL), steps={"train_ppo": {"retry": {"max_retries": 1, "delay": 0}}})
    run = pipeline(trainer_config=str(setup.trainer_config), train_files=str(setup.new_train_file),
                   val_files=str(setup.val_file), force=True,
                   overrides=["trainer.save_freq=1", f"custom_reward_function.path={flaky}",
                              f"trainer.default_local_dir={runs}"])
    assert str(run.status) == "completed" and (tmp_path / "failed_once").exists()
    version = zenml_client().get_model_version(MODEL, run.model_version.id)
    assert "failed" not in [tag.name for tag in version.tags]  # the hook waits for the last attempt
    assert "failed_step" not in version.run_metadata
    summary = run.steps["train_ppo"].outputs["training_summary"][0].load()
    folder = runs / run.name
    assert summary["resumed_from"] == str(folder / "global_step_1")
    assert [record["step"] for record in summary["history"]] == [1, 2, 3]
    init_from = run.steps["smoke_test"].regular_inputs["init_from"][0]
    saved = yaml.safe_load((folder / "global_step_3" / "config.yaml").read_text())
    assert saved["actor_rollout_ref"]["model"]["path"] == str(runs / "warm_start" / str(init_from.id))


def test_a_training_that_fails_in_a_pipeline_says_and_records_how_to_go_on_from_its_checkpoint(tmp_path):
    """The reward fails after step 1's checkpoint, with no retry: the run fails, and its error (what the version
    records as its failure) says to resume from that checkpoint with the resume_path overrides, not to rerun the
    same command, which in a pipeline starts afresh in a new folder."""
    runs = tmp_path / "runs"
    flaky = failing_once_after_step_1(tmp_path, runs)
    with pytest.raises(Exception, match="planted failure after the first checkpoint"):
        run_pipeline("tiny-failed-training", overrides=["trainer.save_freq=1", f"custom_reward_function.path={flaky}",
                                                        f"trainer.default_local_dir={runs}"])
    client = zenml_client()
    run = client.list_pipeline_runs(sort_by="desc:created", size=1)[0]
    assert str(run.status) == "failed" and str(run.steps["train_ppo"].status) == "failed"
    meta = client.get_model_version("tiny-failed-training", "latest").run_metadata
    checkpoint = runs / run.name / "global_step_1"
    way = (f"add trainer.resume_mode=resume_path and trainer.resume_from_path={checkpoint} to the run config's "
           "overrides, then run the pipeline again, to resume from it (run again as it is, the pipeline starts "
           "afresh in a folder of its own; a retry of this step in this run resumes there by itself)")
    assert meta["failed_step"] == "train_ppo"
    assert meta["failure"].endswith(f"the latest checkpoint {checkpoint} is intact: fix the reward function"
                                    " (an edit of its code also needs trainer.allow_reward_code_change=true), then "
                                    f"{way}")
    assert "rerun the same command" not in meta["failure"]
    assert meta["advice"] == way


def failing_once_after_each(tmp_path: Path, runs: Path, steps: tuple[int, ...]) -> Path:
    """The digit-first reward, raising once for each of ``steps`` when a run under ``runs`` has saved that step
    (``tmp_path/failed_after_N`` marks that it did)."""
    reward = tmp_path / "flaky_each.py"
    reward.write_text(
        "import pathlib\n"
        f"RUNS, FLAGS, STEPS = pathlib.Path({str(runs)!r}), pathlib.Path({str(tmp_path)!r}), {steps!r}\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    for step in STEPS:\n"
        "        flag = FLAGS / f'failed_after_{step}'\n"
        "        if not flag.exists() and any(RUNS.glob(f'*/global_step_{step}')):\n"
        "            flag.write_text('x')\n"
        "            raise RuntimeError(f'planted failure after checkpoint {step}')\n"
        "    return 1.0 if solution_str[:1].isdigit() else 0.0\n")
    return reward


def test_a_retry_of_a_run_set_to_resume_from_an_earlier_run_resumes_from_its_own_checkpoint(tmp_path):
    """Run 1 fails after its step 1; run 2 follows the advice (resume_path to run 1's step 1), trains step 2 in
    its own folder, saves it, and fails at step 3: ZenML's retry resumes from run 2's step 2, not from run 1's
    step 1 (whose steps it would train again), and the history holds run 1's step 1 and run 2's steps."""
    from zenml import Model

    from pipelines.rlhf_ppo import rlhf_ppo_pipeline

    setup, runs = tiny_setup(), tmp_path / "runs"
    flaky = failing_once_after_each(tmp_path, runs, (1, 2))
    overrides = ["trainer.save_freq=1", f"custom_reward_function.path={flaky}", f"trainer.default_local_dir={runs}"]
    with pytest.raises(Exception, match="planted failure after checkpoint 1"):
        run_pipeline("tiny-resumed-retry", overrides=overrides)
    client = zenml_client()
    first = client.list_pipeline_runs(sort_by="desc:created", size=1)[0]
    earlier = runs / first.name / "global_step_1"
    assert client.get_model_version("tiny-resumed-retry", "latest").run_metadata["advice"].startswith(
        f"add trainer.resume_mode=resume_path and trainer.resume_from_path={earlier} to the run config's overrides")
    pipeline = rlhf_ppo_pipeline.with_options(
        model=Model(name="tiny-resumed-retry"), steps={"train_ppo": {"retry": {"max_retries": 1, "delay": 0}}})
    run = pipeline(trainer_config=str(setup.trainer_config), train_files=str(setup.train_file),
                   val_files=str(setup.val_file),
                   overrides=[*overrides, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={earlier}"])
    assert str(run.status) == "completed" and (tmp_path / "failed_after_2").exists()
    summary = run.steps["train_ppo"].outputs["training_summary"][0].load()
    assert summary["resumed_from"] == str(runs / run.name / "global_step_2")
    assert [record["step"] for record in summary["history"]] == [1, 2, 3]


def test_a_checkpoint_folder_written_with_a_tilde_is_the_home_folders(tmp_path, monkeypatch):
    """trainer.default_local_dir=~/runs: the run trains in <home>/runs/<run>, where the trainer saves (no folder
    named ~ in the working directory), and its failure's way on names the checkpoint there."""
    home, runs = tmp_path / "home", tmp_path / "home" / "runs"
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    flaky = failing_once_after_step_1(tmp_path, runs)
    with pytest.raises(Exception, match="planted failure after the first checkpoint"):
        run_pipeline("tiny-tilde-training", overrides=["trainer.save_freq=1", f"custom_reward_function.path={flaky}",
                                                       "trainer.default_local_dir='~/runs'"])
    client = zenml_client()
    run = client.list_pipeline_runs(sort_by="desc:created", size=1)[0]
    meta = client.get_model_version("tiny-tilde-training", "latest").run_metadata
    checkpoint = runs / run.name / "global_step_1"
    assert meta["advice"] == (
        f"add trainer.resume_mode=resume_path and trainer.resume_from_path={checkpoint} to the run config's "
        "overrides, then run the pipeline again, to resume from it (run again as it is, the pipeline starts "
        "afresh in a folder of its own; a retry of this step in this run resumes there by itself)")
    assert "rerun the same command" not in meta["failure"]
    assert (runs / run.name / "metrics.jsonl").is_file()
    assert not (work / "~").exists()


def _retrain_with_version_2_promoted_after(module, name: str, monkeypatch):
    """A forced retraining (version 2 was trained on this data from version 1 and refused) during which another
    run promotes version 2 right after ``module.name`` returns; production is put back to version 1 afterwards,
    as the other tests of this model expect. Returns the run, read again."""
    from zenml.enums import ModelStages

    client = zenml_client()
    first, second = _version(1), _version(2)
    assert _version("production").number == 1
    original = getattr(module, name)

    def then_another_promotion(*args, **kwargs):
        result = original(*args, **kwargs)
        client.update_model_version(MODEL, second.id, stage=ModelStages.PRODUCTION, force=True)
        return result

    monkeypatch.setattr(module, name, then_another_promotion)
    try:
        run = run_pipeline(MODEL, retrain=True, train_file=tiny_setup().new_train_file, force=True)
    finally:
        client.update_model_version(MODEL, first.id, stage=ModelStages.PRODUCTION, force=True)
    return client.get_pipeline_run(run.id)


def test_the_version_records_the_checkpoint_training_warm_started_from(trained, monkeypatch):
    """Another run promotes a version after the retraining gate looked at production and before train_ppo took
    its warm start: the version names the checkpoint training started from, not the production the gate saw."""
    import steps.check_new_data

    client, second = zenml_client(), _version(2)
    run = _retrain_with_version_2_promoted_after(steps.check_new_data, "gate", monkeypatch)
    assert str(run.status) == "completed"
    assert run.steps["check_new_data"].run_metadata["production_version"] == "1"  # what the gate decided on
    init_from = run.steps["train_ppo"].run_metadata["warm_start_artifact"]
    assert init_from == second.run_metadata["checkpoint_artifact_id"]  # what training started from
    meta = client.get_model_version(MODEL, run.model_version.id).run_metadata
    assert meta["warm_started_from"] == "2"
    assert meta["previous_production_version"] == "2"  # judged against the version it started from
    assert run.steps["train_ppo"].run_metadata["warm_started_from"] == "2"


def test_training_starts_from_the_checkpoint_the_smoke_test_ran_from(trained, monkeypatch):
    """Another run promotes a version after the smoke test dry-ran production's checkpoint and before train_ppo
    starts: training starts from the checkpoint that was dry-run, not from the new production."""
    import steps.smoke_test

    client, first = zenml_client(), _version(1)
    run = _retrain_with_version_2_promoted_after(steps.smoke_test, "run_smoke_test", monkeypatch)
    assert str(run.status) == "completed"
    assert client.get_model_version(MODEL, run.model_version.id).run_metadata["warm_started_from"] == "1"
    tested = run.steps["smoke_test"].outputs["smoke_report"][0].load()["init_from_artifact_id"]
    assert tested == first.run_metadata["checkpoint_artifact_id"]  # production when the smoke test started
    assert run.steps["train_ppo"].run_metadata["warm_start_artifact"] == tested
    assert [str(a.id) for a in run.steps["train_ppo"].inputs["ppo_checkpoint"]] == [tested]


def test_a_checkpoint_saved_outside_the_model_s_runs_names_the_version_it_is_linked_to(trained):
    """Production's checkpoint was saved outside any run (an import) and linked to the version by hand: training
    records that version as the one it warm-started from, and the gate then knows the refused candidate."""
    from zenml import save_artifact
    from zenml.enums import ArtifactType, ModelStages
    from zenml.model.utils import link_artifact_version_to_model_version

    client, model = zenml_client(), "tiny-imported"
    policy = _version(1).get_artifact("ppo_checkpoint").load()  # version 1 of MODEL: accuracy 1.0, the ceiling
    imported = save_artifact(policy, name="ppo_checkpoint", artifact_type=ArtifactType.MODEL)
    assert imported.producer_pipeline_run_id is None
    client.create_model(model)
    version = client.create_model_version(model, name="imported")
    link_artifact_version_to_model_version(imported, version)
    client.update_model_version(model, version.id, stage=ModelStages.PRODUCTION, force=True)

    run = client.get_pipeline_run(run_pipeline(model, retrain=True, train_file=tiny_setup().new_train_file).id)
    assert str(run.status) == "completed"
    meta = client.get_model_version(model, run.model_version.id).run_metadata
    assert meta.get("warm_started_from") == "imported"
    assert run.steps["train_ppo"].run_metadata["warm_started_from"] == "imported"
    smoke = run.steps["smoke_test"].outputs["smoke_report"][0].load()
    assert smoke["init_from_artifact_id"] == str(imported.id) and smoke["init_from_version"] == "imported"
    # the candidate can at best tie the imported ceiling: refused against the version it started from
    assert meta["promoted"] is False and meta["previous_production_version"] == "imported", meta["decision_reason"]
    assert client.get_model_version(model, ModelStages.PRODUCTION).name == "imported"

    again = client.get_pipeline_run(run_pipeline(model, retrain=True, train_file=tiny_setup().new_train_file).id)
    skipped = again.run_metadata["skipped"]  # (the run's: a run that skips keeps no model version)
    assert skipped.startswith(f"version {run.model_version.name} was already trained on this data"), skipped


def test_bad_data_stops_at_validate_data_and_nothing_is_promoted(tmp_path):
    """Through the command line users run: `zenml pipeline run ... -c run_config.yaml`."""
    setup = tiny_setup()
    bad = pd.read_parquet(setup.train_file)
    bad.at[3, "prompt"] = [{"role": "user", "content": " "}]  # (the custom reward needs no ground truth)
    bad.to_parquet(tmp_path / "train.parquet", index=False)
    run_config = tmp_path / "bad_data.yaml"
    run_config.write_text(f"""\
model: {{name: tiny-bad-data}}
parameters:
  trainer_config: {setup.trainer_config}
  train_files: {tmp_path / 'train.parquet'}
  val_files: {setup.val_file}
""")
    zenml_client()  # the store exists before a second process opens it
    zenml = Path(sys.executable).with_name("zenml")
    result = subprocess.run([str(zenml), "pipeline", "run", "pipelines.rlhf_ppo.rlhf_ppo_pipeline", "-c",
                             str(run_config)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Dataset validation FAILED" in output
    assert "prompt_user_content_non_empty [train.prompt_user_content]" in output
    assert "row 3" in output

    client = zenml_client()
    run = client.list_pipeline_runs(sort_by="desc:created", size=1)[0]
    assert str(run.status) == "failed"
    assert str(run.steps["validate_data"].status) == "failed"
    assert not {"define_reward", "smoke_test", "train_ppo", "evaluate", "promote"} & set(run.steps)
    with pytest.raises(KeyError):
        client.get_model_version("tiny-bad-data", "production")
    # the failure hook marked the version the run made, naming the step and the error
    version = client.get_model_version("tiny-bad-data", "latest")
    assert [tag.name for tag in version.tags] == ["failed"]
    assert version.run_metadata["failed_step"] == "validate_data"
    assert version.run_metadata["failure"].startswith("DataValidationError: Dataset validation FAILED")
    assert version.run_metadata["pipeline_run_id"] == str(run.id)


def test_refused_data_leaves_its_report_and_failing_rows_on_the_validate_data_step(tmp_path):
    """validate_data raised before it returned its outputs: the HTML report and the result were lost, and the step
    kept only the failed checks' labels, so the rows at fault were in the log alone."""
    from steps.validate_data import DataValidationError

    val = pd.read_parquet(tiny_setup().val_file)
    val = pd.concat([val, val.iloc[[2]]], ignore_index=True)
    val.at[8, "extra_info"] = {**val.at[2, "extra_info"], "index": 1000}  # another id
    val.at[2, "prompt"] = [{"role": "user", "content": "What is 2 plus 2?"}]
    val.at[8, "prompt"] = [{"role": "user", "content": "WHAT is 2  plus 2?\n"}]  # the same question
    val.to_parquet(tmp_path / "val.parquet", index=False)
    with pytest.raises(DataValidationError, match="question_unique"):
        run_pipeline("tiny-refused-data", val_file=tmp_path / "val.parquet")

    run = zenml_client().list_pipeline_runs(sort_by="desc:created", size=1)[0]
    step = run.steps["validate_data"]
    assert str(step.status) == "failed"
    assert step.run_metadata["failed_expectations"] == ["question_unique [val.prompt_question]"]
    failure = step.run_metadata["failed_examples"]["question_unique [val.prompt_question]"]
    assert failure["rows"] == ["rows 2, 8 ask 'what is 2 plus 2?'"]
    assert failure["failure"].startswith("2 of 9 rows fail (22.2%)")
    page = step.outputs["validation_report"][0].load()
    assert "question_unique" in page and "what is 2 plus 2?" in page
    result = step.outputs["validation_result"][0].load()
    assert result["success"] is False and result["statistics"]["unsuccessful_expectations"] == 1


def test_a_reward_whose_acc_the_evaluation_refuses_stops_the_run_at_the_dry_run_before_training(tmp_path):
    """A reward giving {"score": 0.2, "acc": 0.2} to a wrong answer (partial credit) passed define_reward (the
    reference solutions get acc 1) and the dry run, and the run trained in full before its evaluation refused the
    reward; the dry run now checks its validation responses as the evaluation will, and the run stops there."""
    reward = tmp_path / "fifth.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    if solution_str.strip() == ground_truth:  # the bare answer, as the reference solutions\n"
                      "        return {'score': 1.0, 'acc': 1}\n"
                      "    return {'score': 0.2, 'acc': 0.2}\n")
    # the dry run's 4 validation prompts are the file's first 4 (indices 0-3), none answered by the random model
    said = (f"the reward function 'compute_score' of {reward} gave an acc other than 0 or 1 on 4 problem(s), e.g. "
            "synthetic/arithmetic/0 (acc 0.2), synthetic/arithmetic/1 (acc 0.2), synthetic/arithmetic/2 (acc 0.2): "
            "the evaluation counts each problem right or wrong to pair it with another model's result, and a partial "
            "acc is neither; return an acc of 0 or 1 (False or True), and any partial credit as the score")
    with pytest.raises(Exception, match=re.escape(f"smoke test failed at 'right or wrong': {said}")):
        run_pipeline("tiny-partial-acc", overrides=[f"custom_reward_function.path={reward}"])
    client = zenml_client()
    run = client.list_pipeline_runs(sort_by="desc:created", size=1)[0]
    assert str(run.status) == "failed" and str(run.steps["smoke_test"].status) == "failed"
    assert not {"train_ppo", "evaluate", "promote"} & set(run.steps)
    assert str(run.steps["define_reward"].status) == "completed"  # its reference check passed the reward
    meta = client.get_model_version("tiny-partial-acc", "latest").run_metadata
    assert meta["failed_step"] == "smoke_test" and said in meta["failure"]


def test_a_custom_reward_s_run_goes_through_on_prompts_without_a_ground_truth(tmp_path):
    """The custom reward grades training, its self-check and the evaluation without a ground truth (it gets None),
    as the trainer alone takes such prompts: validate_data refused them, and had it not, evaluate did."""
    setup = tiny_setup()
    files = {}
    for split, path in (("train", setup.train_file), ("val", setup.val_file)):
        files[split] = tmp_path / f"{split}.parquet"
        pd.read_parquet(path).drop(columns=["reward_model"]).to_parquet(files[split], index=False)
    run = run_pipeline("tiny-no-ground-truth", train_file=files["train"], val_file=files["val"],
                       overrides=["trainer.val_before_train=true"])
    run = zenml_client().get_pipeline_run(run.id)
    assert str(run.status) == "completed"
    assert sorted(run.steps) == sorted(STEPS)
    validation = run.steps["validate_data"].outputs["validation_result"][0].load()
    assert validation["success"] is True
    assert {f"{split}: not_null [ground_truth] (rows may go without a ground truth: a reward model at "
            "reward_model.rule_coef=0 or a custom reward function scores them)" for split in ("train", "val")} \
        <= set(validation["skipped"])
    spec = run.steps["define_reward"].outputs["reward_spec"][0].load()
    assert spec["self_check"]["checked"] == 8 and spec["self_check"]["passed"] is True  # the bare answers
    evaluation = run.steps["evaluate"].outputs["evaluation"][0].load()
    assert evaluation["n"] == 8 and len(evaluation["problems"]) == 8  # every validation problem graded
    meta = zenml_client().get_model_version("tiny-no-ground-truth", 1).run_metadata
    # the digit-first reward is easy: three steps reach its ceiling on every validation prompt, as with them
    assert meta["accuracy"] == 1.0 and meta["promoted"] is True, meta["decision_reason"]
    # the validation before training (graded by the custom reward too) opens the curves as step 0, beside the
    # steps trained
    summary = run.steps["train_ppo"].outputs["training_summary"][0].load()
    assert [record["step"] for record in summary["history"]] == [1, 2, 3]
    before = summary["val_before_train"]
    assert before["step"] == 0 and [key for key in before if key.startswith("val-core/") and "/acc/" in key], before


def _mcnemar_by_hand(fixed: int, broken: int) -> float:
    """2 * P(X <= min(fixed, broken)) for X ~ Bin(fixed + broken, 1/2), capped at 1."""
    import math

    d = fixed + broken
    return 1.0 if d == 0 else min(1.0, 2 * sum(math.comb(d, k) for k in range(min(fixed, broken) + 1)) / 2 ** d)


def test_every_problem_is_kept_and_the_gate_states_gain_interval_and_p(trained):
    _, (first_run_id, second_run_id) = trained
    client = zenml_client()
    first = client.get_pipeline_run(first_run_id)
    table = first.steps["evaluate"].outputs["per_problem"][0].load()
    assert list(table.columns[:6]) == ["problem_id", "data_source", "index", "base_correct", "candidate_correct",
                                       "production_correct"]
    assert len(table) == 8 and table["problem_id"].is_unique
    assert table["production_correct"].isna().all()  # no production version before the first
    assert table["candidate_response"].map(type).eq(str).all()
    meta = _version(1).run_metadata
    assert meta["accuracy"] == table["candidate_correct"].mean()
    fixed = int((~table["base_correct"] & table["candidate_correct"]).sum())
    broken = int((table["base_correct"] & ~table["candidate_correct"]).sum())
    assert meta["p_value"] == _mcnemar_by_hand(fixed, broken) < meta["alpha"] == 0.05
    assert meta["gain"] == (fixed - broken) / 8
    assert f"McNemar exact p = {meta['p_value']:.4g} ({fixed} fixed, {broken} broken)" in meta["decision_reason"]
    assert "95% CI [" in meta["decision_reason"]
    report = first.steps["evaluate"].outputs["evaluation_report"][0].load()
    assert "95% interval" in report and f"fixed {fixed}, broke {broken}" in report

    # the retrained version is judged against version 1's results on the very same problems
    second = client.get_pipeline_run(second_run_id)
    paired = second.steps["evaluate"].outputs["per_problem"][0].load()
    by_id = dict(zip(table["problem_id"], table["candidate_correct"]))
    assert [bool(v) for v in paired["production_correct"]] == [by_id[pid] for pid in paired["problem_id"]]
    meta = _version(2).run_metadata
    fixed = int((~paired["production_correct"].astype(bool) & paired["candidate_correct"]).sum())
    broken = int((paired["production_correct"].astype(bool) & ~paired["candidate_correct"]).sum())
    assert meta["p_value"] == _mcnemar_by_hand(fixed, broken)
    assert "of production version 1 on the same 8 problems" in meta["decision_reason"]
    # the evaluate step counts what was fixed and broken against production, as the gate does, not the base model
    evaluated = second.steps["evaluate"].run_metadata
    assert evaluated["compared_with"] == "production"
    assert (evaluated["n_fixed"], evaluated["n_broken"]) == (fixed, broken)


def test_production_evaluated_on_other_problems_is_evaluated_again_on_these(trained, tmp_path):
    """Production's stored results are for other validation problems: its checkpoint is evaluated on this run's
    problems. This run trains version 1's recipe again (same data, seed and base model), so the candidate is
    version 1's policy: the two agree on every problem, and a tie is not promoted."""
    from rlhf_core.data.synthetic import build_dataset

    other = build_dataset(tmp_path / "other", n_train=8, n_test=8, seed=7, max_ops=1)["test"]
    _bare_answers(other)
    production = _version("production")
    assert production.number == 1
    zenml_client()
    from zenml import Model

    from pipelines.rlhf_ppo import rlhf_ppo_pipeline

    setup = tiny_setup()
    # the training pipeline on the same training data but other validation problems
    run = rlhf_ppo_pipeline.with_options(model=Model(name=MODEL))(
        trainer_config=str(setup.trainer_config), train_files=str(setup.train_file), val_files=str(other))
    assert str(run.status) == "completed"
    latest = zenml_client().get_model_version(MODEL, "latest")
    evaluation = latest.get_artifact("evaluation").load()
    assert "was evaluated on other validation problems" in evaluation["production_reevaluated"]
    assert evaluation["production_refusal"] is None
    assert sorted(evaluation["production_results"]) == sorted(evaluation["problems"]) and \
        len(evaluation["problems"]) == 8
    assert evaluation["production_results"] == evaluation["problems"]  # the same policy, problem by problem
    assert evaluation["scoring"]["batch_size"] == 64  # the step's default: a record read later compares it
    meta = latest.run_metadata
    assert meta["promoted"] is False and meta["baseline"] == "production"
    assert meta["decision_reason"].startswith("not promoted: no improvement")
    assert "(0 fixed, 0 broken)" in meta["decision_reason"]
    assert _version("production").number == production.number


def test_production_graded_against_other_extra_info_is_evaluated_again(trained, tmp_path):
    """The validation rows keep their ids, prompts and ground truths but not their extra_info, which a custom reward
    grades against (a rubric, test cases): production's stored results, graded against the old extra_info, must
    not pair with the candidate's; its checkpoint is evaluated on these rows instead."""
    setup = tiny_setup()
    frame = pd.read_parquet(setup.val_file)
    frame["extra_info"] = [{**extra, "rubric": "relaxed"} for extra in frame["extra_info"]]
    relaxed = tmp_path / "relaxed.parquet"
    frame.to_parquet(relaxed, index=False)
    production = _version("production")
    stored = production.get_artifact("evaluation").load()
    run = run_pipeline(MODEL, val_file=relaxed)
    assert str(run.status) == "completed"
    evaluation = zenml_client().get_model_version(MODEL, "latest").get_artifact("evaluation").load()
    assert sorted(evaluation["problems"]) == sorted(stored["problems"])  # the same problem ids
    assert evaluation["val_fingerprint"] != stored["val_fingerprint"]
    assert evaluation["production_reevaluated"].startswith(
        f"production version {production.number} was evaluated on other validation problems")
    assert evaluation["production_refusal"] is None
    assert evaluation["production_results"] == evaluation["problems"]  # version 1's recipe again: the same policy
    assert _version("production").number == production.number


def test_a_gate_that_cannot_be_applied_fails_before_any_step(trained):
    client = zenml_client()
    before = client.list_pipeline_runs(size=1).total
    with pytest.raises(ValueError, match=r"alpha=1.5 must be a significance level strictly between 0 and 1"):
        run_pipeline(MODEL, alpha=1.5)
    with pytest.raises(ValueError, match=r"min_improvement=-0.01 must be a finite number >= 0"):
        run_pipeline(MODEL, retrain=True, min_improvement=-0.01)
    assert client.list_pipeline_runs(size=1).total == before


def test_caching_and_bad_step_parameters_fail_before_any_step(trained, tmp_path):
    """A run config's enable_cache: true would replay an earlier run's checks and decision; an evaluation cap of
    0 would fail after training. Both stop the run as it compiles; caching asked for step by step stops it at its
    first step."""
    from zenml import Model

    from pipelines.retrain import rlhf_retrain_pipeline
    from pipelines.rlhf_ppo import rlhf_ppo_pipeline

    client = zenml_client()
    before = client.list_pipeline_runs(size=1).total
    setup = tiny_setup()
    parameters = {"trainer_config": str(setup.trainer_config), "train_files": str(setup.train_file),
                  "val_files": str(setup.val_file)}
    cached = tmp_path / "cached.yaml"
    cached.write_text("enable_cache: true\n")
    for pipeline in (rlhf_ppo_pipeline, rlhf_retrain_pipeline):
        with pytest.raises(ValueError, match=r"enable_cache: true would replay earlier runs' steps"):
            pipeline.with_options(model=Model(name=MODEL), config_path=str(cached))(**parameters)
    capped = tmp_path / "capped.yaml"
    capped.write_text("steps:\n  evaluate:\n    parameters:\n      max_problems: 0\n")
    with pytest.raises(RuntimeError, match=r"Input validation failed for input .max_problems."):
        rlhf_ppo_pipeline.with_options(model=Model(name=MODEL), config_path=str(capped))(**parameters)
    # no validation data: the run trained fully, then failed in evaluate; now it is refused as the pipeline compiles
    with pytest.raises(ValueError, match=r"no validation data: the pipeline evaluates the trained policy"):
        rlhf_ppo_pipeline.with_options(model=Model(name=MODEL))(**{**parameters, "val_files": None},
                                                                overrides=["data.val_files=[]"])
    assert client.list_pipeline_runs(size=1).total == before
    # caching asked for step by step: the first step refuses it, and no other step runs
    stepwise = tmp_path / "stepwise.yaml"
    stepwise.write_text("steps:\n  validate_data:\n    enable_cache: true\n  train_ppo:\n    enable_cache: true\n")
    with pytest.raises(ValueError, match=r"enable_cache is set on step\(s\) train_ppo, validate_data: "):
        rlhf_ppo_pipeline.with_options(model=Model(name=MODEL), config_path=str(stepwise))(**parameters)
    run = client.list_pipeline_runs(sort_by="desc:created", size=1)[0]
    assert str(run.status) == "failed" and list(run.steps) == ["load_ppo_config"]


TYPO = r"unknown config key trainer\.total_trainig_steps; did you mean trainer\.total_training_steps\?"


def test_a_mistyped_override_or_a_missing_file_stops_each_pipeline_before_its_run_and_model_version(tmp_path):
    """The trainer config, its overrides, the reward and the data files are resolved as the pipeline compiles: a
    mistake in one stopped the run at its first step, after ZenML had made the run and a model version (marked
    failed). Now neither exists."""
    from zenml import Model

    from pipelines.retrain import rlhf_retrain_pipeline
    from pipelines.rlhf_ppo import rlhf_ppo_pipeline
    from pipelines.rlhf_rm import rlhf_rm_pipeline

    client, setup, model = zenml_client(), tiny_setup(), "tiny-refused-parameters"
    before = client.list_pipeline_runs(size=1).total
    parameters = {"trainer_config": str(setup.trainer_config), "train_files": str(setup.train_file),
                  "val_files": str(setup.val_file)}
    for pipeline in (rlhf_ppo_pipeline, rlhf_retrain_pipeline, rlhf_rm_pipeline):
        with pytest.raises(ValueError, match=TYPO):
            pipeline.with_options(model=Model(name=model))(
                **parameters, overrides=["trainer.total_trainig_steps=2", "trainer.test_freq=10"])
    reward = tmp_path / "reward.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    missing = tmp_path / "missing.parquet"
    for changed, refusal in (
            ({"trainer_config": str(tmp_path / "ppo.yaml")}, rf"config file {re.escape(str(tmp_path))}/ppo.yaml does "
             r"not exist"),
            ({"overrides": [f"custom_reward_function.path={reward}"]},
             rf"custom_reward_function: custom reward file '{re.escape(str(reward))}' has no function 'compute_score'; "
             r"functions it defines: score"),
            ({"train_files": str(missing)}, rf"data.train_files: {re.escape(str(missing))} does not exist"),
            ({"val_files": [str(setup.val_file), str(missing)]},
             rf"data.val_files: {re.escape(str(missing))} does not exist")):
        with pytest.raises(ValueError, match=refusal):
            rlhf_ppo_pipeline.with_options(model=Model(name=model))(**{**parameters, **changed})
    assert client.list_pipeline_runs(size=1).total == before
    with pytest.raises(KeyError):  # no version, nor the model it would have been made under
        client.get_model(model)


def test_with_a_remote_orchestrator_the_files_are_left_to_the_steps(monkeypatch, tmp_path):
    """A remote orchestrator's steps read the data from their own volumes (configs/kubeflow_example.yaml), which
    the machine the pipeline compiles on may not have: there the trainer config is still checked, the files not."""
    from zenml import Model

    import rlhf_core.pipeline.run_config
    from pipelines.rlhf_ppo import rlhf_ppo_pipeline
    from rlhf_core.data.validation import DataReadError

    monkeypatch.setattr(rlhf_core.pipeline.run_config, "steps_run_here", lambda: False)
    client, setup, missing = zenml_client(), tiny_setup(), tmp_path / "train.parquet"
    pipeline = rlhf_ppo_pipeline.with_options(model=Model(name="tiny-remote-files"))
    parameters = {"trainer_config": str(setup.trainer_config), "train_files": str(missing),
                  "val_files": str(setup.val_file)}
    before = client.list_pipeline_runs(size=1).total
    with pytest.raises(ValueError, match=TYPO):
        pipeline(**parameters, overrides=["trainer.total_trainig_steps=2"])
    assert client.list_pipeline_runs(size=1).total == before
    with pytest.raises(DataReadError, match=rf"cannot read {re.escape(str(missing))}: no such file"):
        pipeline(**parameters)  # validate_data's refusal
    run = client.list_pipeline_runs(sort_by="desc:created", size=1)[0]
    assert str(run.status) == "failed" and str(run.steps["validate_data"].status) == "failed"


def test_the_command_line_prints_a_refused_override_alone_and_starts_nothing(tmp_path):
    """`zenml pipeline run -c run_config.yaml` with a mistyped override: exit status 1 and the problem, without
    the traceback (over 300 lines) it came in."""
    setup = tiny_setup()
    run_config = tmp_path / "typo.yaml"
    run_config.write_text(f"""\
model: {{name: tiny-cli-typo}}
parameters:
  trainer_config: {setup.trainer_config}
  train_files: {setup.train_file}
  val_files: {setup.val_file}
  overrides: [trainer.total_trainig_steps=2]
""")
    client = zenml_client()  # the store exists before a second process opens it
    before = client.list_pipeline_runs(size=1).total
    zenml = Path(sys.executable).with_name("zenml")
    result = subprocess.run([str(zenml), "pipeline", "run", "pipelines.rlhf_ppo.rlhf_ppo_pipeline", "-c",
                             str(run_config)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    lines = output.splitlines()
    assert "  - unknown config key trainer.total_trainig_steps; did you mean trainer.total_training_steps?" in lines
    assert "Traceback" not in output and len(lines) < 12, output
    assert client.list_pipeline_runs(size=1).total == before
    with pytest.raises(KeyError):
        client.get_model("tiny-cli-typo")


# The retraining gate on versions built directly in the store: the gate reads only their metadata, so no
# training is needed. A refused version carries what promote records (promoted, decision_reason,
# dataset_fingerprint, reward_sha256) and what train_ppo and the gate record (warm_started_from, config_fingerprint).

def _sha(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


GATE_CONFIG = {"data": {"train_files": "a/train.parquet", "val_files": "a/test.parquet", "train_batch_size": 8},
               "trainer": {"seed": 1, "total_training_steps": 3}}
GATE_REWARD = _sha("reward")
GATE_EVALUATION = {"batch_size": 64, "max_problems": None, "sample_seed": 0}  # the evaluate step's defaults


def _add_version(model_name: str, production: bool = False, **metadata):
    """A new version of ``model_name`` (created if need be) with ``metadata``, made production if asked."""
    from zenml import log_metadata
    from zenml.enums import ModelStages

    client = zenml_client()
    try:
        client.get_model(model_name)
    except KeyError:
        client.create_model(model_name)
    version = client.create_model_version(model_name)
    if metadata:
        log_metadata(metadata, model_version_id=version.id)
    if production:
        client.update_model_version(model_name, version.id, stage=ModelStages.PRODUCTION, force=True)
    return client.get_model_version(model_name, version.number)


def _refused(model_name: str, fingerprint: str, warm_started_from: str, config: dict | None = None,
             gain: float | None = 0.0, p_value: float | None = 1.0, **extra):
    """A version refused as promote records it: compared with production ``warm_started_from`` (``gain``,
    ``p_value``, ``gain_ci``, the gate it faced) unless ``gain``/``p_value`` are None (no comparison was made)."""
    from steps.check_new_data import config_fingerprint

    compared = gain is not None and p_value is not None
    metadata = {"promoted": False, "decision_reason": "not promoted: no improvement over production",
                "baseline": "production", "previous_production_version": warm_started_from,
                "min_improvement": 0.0, "alpha": 0.05, "gain": gain, "p_value": p_value,
                "gain_ci": [gain - 0.1, gain + 0.1] if compared else None,
                "dataset_fingerprint": fingerprint, "reward_sha256": GATE_REWARD,
                "warm_started_from": warm_started_from, "config_fingerprint": config_fingerprint(config or GATE_CONFIG),
                "evaluation_settings": GATE_EVALUATION, **extra}
    return _add_version(model_name, **{k: v for k, v in metadata.items() if v is not None})


def _gate(model_name: str, fingerprint: str, config: dict | None = None, reward: str = GATE_REWARD,
          evaluation: dict | None = None, **promotion_gate):
    """The gate for this data, config, reward and evaluation settings; ``promotion_gate``: this run's
    min_improvement and alpha."""
    from steps.check_new_data import config_fingerprint, gate

    reason, production, refused = gate(zenml_client(), model_name, fingerprint, config_fingerprint(config or GATE_CONFIG),
                                       reward, evaluation=GATE_EVALUATION if evaluation is None else evaluation,
                                       **promotion_gate)
    return reason, production.name, refused.name if refused is not None else None


def test_gate_skips_training_that_a_refused_version_already_did(caplog):
    model, (a, b, c) = "gate-refused", (_sha("A"), _sha("B"), _sha("C"))
    _add_version(model, production=True, promoted=True, dataset_fingerprint=a)  # version 1
    _refused(model, b, warm_started_from="1")  # version 2: B from version 1, refused
    caplog.clear()
    reason, production, refused = _gate(model, b)
    assert "deprecated" not in caplog.text  # the gate runs on every retraining: no warning in each run's log
    assert (production, refused) == ("1", "2")
    assert reason.startswith("version 2 was already trained on this data") and "production version 1" in reason
    assert "not promoted: no improvement over production" in reason and "force=true" in reason
    # the data paths are not part of the config: the same data from another folder is the same training
    moved = {**GATE_CONFIG, "data": {**GATE_CONFIG["data"], "train_files": "b/train.parquet"}}
    assert _gate(model, b, moved)[2] == "2"
    assert _gate(model, c) == ("", "1", None)  # other data: train
    assert _gate(model, a)[0].startswith("the data is unchanged since production version 1")  # (no fingerprints)


def test_gate_retrains_when_production_config_or_reward_changed():
    from zenml.enums import ModelStages

    model, (a, b, d) = "gate-changed", (_sha("A"), _sha("B"), _sha("D"))
    _add_version(model, production=True, promoted=True, dataset_fingerprint=a)  # version 1
    _refused(model, b, warm_started_from="1")  # version 2
    assert _gate(model, b)[2] == "2"
    reseeded = {**GATE_CONFIG, "trainer": {**GATE_CONFIG["trainer"], "seed": 2}}
    assert _gate(model, b, reseeded) == ("", "1", None)
    assert _gate(model, b, reward=_sha("another reward")) == ("", "1", None)
    # refused on a sample of 100 problems: a run judged on all of them, or on another sample, may decide otherwise
    assert _gate(model, b, evaluation={**GATE_EVALUATION, "max_problems": 100}) == ("", "1", None)
    _refused(model, b, warm_started_from="1", evaluation_settings={**GATE_EVALUATION, "max_problems": 100})
    assert _gate(model, b, evaluation={**GATE_EVALUATION, "max_problems": 100})[2] == "3"
    assert _gate(model, b, evaluation={**GATE_EVALUATION, "max_problems": 100, "sample_seed": 1}) == ("", "1", None)
    assert _gate(model, b)[2] == "2"
    _add_version(model, production=True, promoted=True, dataset_fingerprint=d)  # version 4, promoted later
    assert zenml_client().get_model_version(model, "production").number == 4
    assert _gate(model, b) == ("", "4", None)  # versions 2 and 3 started from version 1, not from this production
    # version 5: started from version 1 while it was production, refused against version 4, production by then;
    # production rolled back to version 1, nothing compared that training with it: train
    e = _sha("E")
    _refused(model, e, warm_started_from="1", previous_production_version="4")
    assert _gate(model, e) == ("", "4", None)
    zenml_client().update_model_version(model, zenml_client().get_model_version(model, 1).id,
                                        stage=ModelStages.PRODUCTION, force=True)
    assert _gate(model, e) == ("", "1", None)
    assert _gate(model, b)[2] == "2"  # (version 2 was compared with version 1: it still counts)


def test_gate_retrains_on_unchanged_data_when_the_config_or_reward_changed_since_production():
    """A fixed reward or a changed trainer config on the data production was trained on is new training (it was
    skipped until the data changed); the same again after such a version was refused is not."""
    from steps.check_new_data import config_fingerprint

    model, a = "gate-same-data", _sha("A")
    _add_version(model, production=True, promoted=True, dataset_fingerprint=a, reward_sha256=GATE_REWARD,
                 config_fingerprint=config_fingerprint(GATE_CONFIG))  # version 1
    assert _gate(model, a)[0].startswith("the data, trainer config and reward are unchanged since production version 1")
    reseeded = {**GATE_CONFIG, "trainer": {**GATE_CONFIG["trainer"], "seed": 5}}
    assert _gate(model, a, reseeded) == ("", "1", None)
    assert _gate(model, a, reward=_sha("the fixed reward")) == ("", "1", None)
    _refused(model, a, warm_started_from="1", config=reseeded)  # version 2: that training, refused
    assert _gate(model, a, reseeded)[2] == "2"
    # a production version that recorded no config fingerprint (made before versions kept it): the data decides
    _add_version("gate-same-data-older", production=True, promoted=True, dataset_fingerprint=a)
    older = _gate("gate-same-data-older", a, reseeded)[0]
    assert older.startswith("the data is unchanged since production version 1 was trained (dataset fingerprint")
    assert "; it recorded no trainer config or reward fingerprint to compare with)" in older


def test_gate_takes_a_production_fingerprint_recorded_before_the_splits_were_told_apart(tmp_path):
    """Production recorded its data's fingerprint over all the files taken whole: the same files now are unchanged
    data; the same files split otherwise, recorded since, are not."""
    from zenml import Model

    from rlhf_core.data.validation import fingerprint, splits_fingerprint
    from steps.check_new_data import config_fingerprint, gate

    train, val = tmp_path / "train.parquet", tmp_path / "test.parquet"
    train.write_bytes(b"training rows")
    val.write_bytes(b"validation rows")
    model = "gate-whole-fingerprint"
    _add_version(model, production=True, promoted=True, dataset_fingerprint=fingerprint([train, val]))  # version 1

    def reason(dataset_fingerprint):
        return gate(zenml_client(), model, dataset_fingerprint, config_fingerprint(GATE_CONFIG), GATE_REWARD,
                    evaluation=GATE_EVALUATION, whole_fingerprint=lambda: fingerprint([train, val]))[0]

    assert reason(splits_fingerprint(train, val)).startswith("the data is unchanged since production version 1")
    # the step reads the files its config names
    config = {**GATE_CONFIG, "data": {**GATE_CONFIG["data"], "train_files": str(train), "val_files": [str(val)]}}
    run = _gate_pipeline().with_options(model=Model(name=model))(
        dataset_fingerprint=splits_fingerprint(train, val), ppo_config=config, reward_spec={"sha256": GATE_REWARD})
    skipped = zenml_client().get_pipeline_run(run.id).steps["check_new_data"].outputs["skip_reason"][0].load()
    assert skipped.startswith("the data is unchanged since production version 1"), skipped
    _add_version(model, production=True, promoted=True, dataset_fingerprint=splits_fingerprint(train, val))  # v3
    assert reason(splits_fingerprint(train, val)).startswith("the data is unchanged since production version 3")
    assert reason(splits_fingerprint(val, train)) == ""  # swapped: other training data


def test_gate_does_not_count_failed_skipped_or_unrecorded_versions():
    from steps.check_new_data import config_fingerprint

    model, (a, b) = "gate-not-refused", (_sha("A"), _sha("B"))
    _add_version(model, production=True, promoted=True, dataset_fingerprint=a)  # version 1
    # version 2: its run failed before promote, so it has the gate's record and no decision
    _add_version(model, warm_started_from="1", config_fingerprint=config_fingerprint(GATE_CONFIG))
    _refused(model, b, warm_started_from="1", skipped="the data is unchanged")  # version 3: trained nothing
    # version 4: compared with version 1 but no warm_started_from recorded
    _refused(model, b, warm_started_from=None, config=None, previous_production_version="1")
    assert _gate(model, b) == ("", "1", None)
    _refused(model, b, warm_started_from="1")  # version 5: a real refusal
    assert _gate(model, b)[2] == "5"


def test_gate_without_a_production_version_says_how_to_get_one_for_this_model():
    """Retraining a model that was trained but never promoted: the way on names that model, not the demo's
    run config (whose model is another one)."""
    from steps.check_new_data import NoProductionModelError

    model = "gate-never promoted"
    _add_version(model, promoted=False, dataset_fingerprint=_sha("A"))  # version 1, refused
    with pytest.raises(NoProductionModelError) as raised:
        _gate(model, _sha("A"))
    message = str(raised.value)
    assert "configs/demo_cpu.yaml" not in message
    assert "a run config whose model.name is 'gate-never promoted'" in message
    assert "zenml model version update 'gate-never promoted' VERSION --stage production" in message


def test_retraining_a_model_without_a_production_version_is_refused_before_its_run(monkeypatch, tmp_path):
    """validate_data and define_reward ran, then check_new_data failed (two tracebacks) and left a version marked
    failed, at every scheduled run; now the pipeline refuses as it compiles, with the gate's one line. A store that
    cannot be read leaves the question to the step."""
    from zenml import Model
    from zenml.client import Client
    from zenml.config.schedule import Schedule
    from zenml.pipelines.pipeline_definition import Pipeline

    from pipelines.retrain import rlhf_retrain_pipeline
    from rlhf_core.pipeline.checked import COMPILING_SCHEDULE
    from rlhf_core.pipeline.run_config import RunConfigError
    from steps.check_new_data import check_production_exists

    client, setup, model = zenml_client(), tiny_setup(), "retrain never promoted"
    _add_version(model, promoted=False, dataset_fingerprint=_sha("A"))  # version 1, trained and refused
    before = client.list_pipeline_runs(size=1).total
    with pytest.raises(RunConfigError) as raised:
        rlhf_retrain_pipeline.with_options(model=Model(name=model))(
            trainer_config=str(setup.trainer_config), train_files=str(setup.train_file),
            val_files=str(setup.val_file))
    assert str(raised.value) == (
        "model 'retrain never promoted' has no production version to warm-start from: run the training pipeline "
        "(zenml pipeline run pipelines.rlhf_ppo.rlhf_ppo_pipeline -c RUN_CONFIG, a run config whose model.name is "
        "'retrain never promoted') until its gate promotes a version, or make a trained version production: zenml "
        "model version update 'retrain never promoted' VERSION --stage production")
    assert client.list_pipeline_runs(size=1).total == before
    assert [version.number for version in client.list_model_versions(model=model)] == [1]

    def unreachable(*args, **kwargs):
        raise ConnectionError("the ZenML server does not answer")

    # a name ZenML's filters would read as an operator is the name: another model's production does not count
    _add_version("retrain promoted", production=True, promoted=True, dataset_fingerprint=_sha("A"))
    with pytest.raises(RunConfigError, match="model 'startswith:retrain' has no production version"):
        check_production_exists("startswith:retrain")
    check_production_exists("retrain promoted")  # (one that has one passes)
    # to be registered with a schedule: production may be promoted before the first run comes. Called as a user
    # calls it (the body runs in ZenML's prepare, before the run compiles), the run itself left out
    runs = []
    monkeypatch.setattr(Pipeline, "_run", lambda self: runs.append(self._run_args.get("schedule")))
    scheduled, plain = tmp_path / "scheduled.yaml", tmp_path / "plain.yaml"
    scheduled.write_text("schedule:\n  cron_expression: '0 3 * * *'\n")
    plain.write_text("enable_cache: false\n")
    arguments = {"trainer_config": str(setup.trainer_config), "train_files": str(setup.train_file),
                 "val_files": str(setup.val_file)}
    nightly = Schedule(cron_expression="0 3 * * *")
    rlhf_retrain_pipeline.with_options(model=Model(name=model), schedule=nightly)(**arguments)
    rlhf_retrain_pipeline.with_options(model=Model(name=model), config_path=str(scheduled))(**arguments)
    assert runs == [nightly, None]  # (the file's schedule: is ZenML's to read as the run compiles)
    with pytest.raises(RunConfigError, match="has no production version"):
        rlhf_retrain_pipeline.with_options(model=Model(name=model), config_path=str(plain))(**arguments)
    assert len(runs) == 2 and COMPILING_SCHEDULE.get() is False

    monkeypatch.setattr(Client, "list_model_versions", unreachable)
    assert check_production_exists(model) is None  # left to check_new_data, where the run reads the store



def test_a_run_config_file_is_read_once_for_its_schedule_and_its_steps(monkeypatch, tmp_path):
    """The pipeline read its run config file as it prepared (a schedule: block: the run is to be scheduled, so
    a model without a production version is not refused yet) and again as it compiled (its steps: must be the
    pipeline's); one reading now serves both, and each check still acts on what it reads."""
    from zenml import Model

    from pipelines.retrain import rlhf_retrain_pipeline
    from rlhf_core.pipeline.run_config import RunConfigError

    zenml_client()
    setup = tiny_setup()
    run_config = tmp_path / "scheduled.yaml"
    run_config.write_text("schedule:\n  cron_expression: '0 3 * * *'\nsteps:\n  evaluat:\n    parameters: "
                          "{max_problems: 4}\n")
    reads, read_text = [], Path.read_text

    def counted(path, *args, **kwargs):
        reads.extend([path] if Path(path) == run_config else [])
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counted)
    with pytest.raises(RunConfigError) as raised:  # ("read once never promoted" has no production version)
        rlhf_retrain_pipeline.with_options(model=Model(name="read once never promoted"), config_path=str(run_config))(
            trainer_config=str(setup.trainer_config), train_files=str(setup.train_file),
            val_files=str(setup.val_file))
    assert str(raised.value).splitlines()[1].startswith(
        "  - steps.evaluat is not a step of rlhf_retrain_pipeline; did you mean evaluate?")
    assert len(reads) == 1

def test_gate_does_not_count_refusals_without_a_comparison():
    """Production evaluated on other problems, or scored otherwise: promote refused without judging the
    candidate, and fixing the evaluation's settings must not leave the data blocked."""
    model, (a, b) = "gate-not-compared", (_sha("A"), _sha("B"))
    _add_version(model, production=True, promoted=True, dataset_fingerprint=a)  # version 1
    cannot = ("not promoted: cannot compare with production: production version 1 was evaluated on other "
              "validation problems (fingerprint 0123456789ab vs ba9876543210 here)")
    _refused(model, b, warm_started_from="1", gain=None, p_value=None, decision_reason=cannot)  # version 2
    assert "gain" not in zenml_client().get_model_version(model, 2).run_metadata
    assert _gate(model, b) == ("", "1", None)
    _refused(model, b, warm_started_from="1")  # version 3: compared and refused
    _refused(model, b, warm_started_from="1", gain=None, p_value=None, decision_reason=cannot)  # version 4
    assert _gate(model, b)[2] == "3"  # the newer refusal without a comparison hides nothing


def test_gate_retrains_a_refused_candidate_whose_figures_pass_a_lowered_min_improvement():
    model, (a, b) = "gate-min-improvement", (_sha("A"), _sha("B"))
    _add_version(model, production=True, promoted=True, dataset_fingerprint=a)  # version 1
    _refused(model, b, warm_started_from="1", gain=0.03, p_value=0.01, min_improvement=0.05,  # version 2
             decision_reason="not promoted: improvement too small (gain +0.0300, required gain >= 0.0500)")
    reason, production, refused = _gate(model, b, min_improvement=0.05)
    assert refused == "2" and "min_improvement=0.05" in reason, reason  # the same gate: the same refusal
    assert _gate(model, b, min_improvement=0.04)[2] == "2"  # lowered, still above the gain
    assert _gate(model, b, min_improvement=0.03) == ("", "1", None)  # lowered to the gain: it would pass now
    assert _gate(model, b) == ("", "1", None)
    assert _gate(model, b, min_improvement=0.03, alpha=0.01)[2] == "2"  # p = 0.01 is not below 0.01


def test_gate_retrains_a_refused_candidate_whose_figures_pass_a_raised_alpha():
    model, (a, b) = "gate-alpha", (_sha("A"), _sha("B"))
    _add_version(model, production=True, promoted=True, dataset_fingerprint=a)  # version 1
    _refused(model, b, warm_started_from="1", gain=0.05, p_value=0.08,  # version 2
             decision_reason="not promoted: the gain is not significant, within the noise of 100 problems")
    assert _gate(model, b)[2] == "2"
    assert _gate(model, b, alpha=0.08)[2] == "2"  # p must be below alpha
    assert _gate(model, b, alpha=0.1) == ("", "1", None)  # raised: it would pass now
    assert _gate(model, b, alpha=0.1, min_improvement=0.06)[2] == "2"  # but not with a larger margin too
    # a candidate that gained nothing fails every gate, however lax
    _refused(model, b, warm_started_from="1", gain=-0.01, p_value=0.5)  # version 3
    assert _gate(model, b, alpha=0.9)[2] == "3"


@functools.cache
def _gate_pipeline():
    """The gate alone, as the retraining pipeline runs it: one version per run, the gate's metadata on it."""
    zenml_client()
    from zenml import pipeline

    from steps.check_new_data import check_new_data

    @pipeline(enable_cache=False)
    def retraining_gate(dataset_fingerprint: str, ppo_config: dict, reward_spec: dict, min_improvement: float = 0.0,
                        alpha: float = 0.05, force: bool = False) -> None:
        check_new_data(dataset_fingerprint, ppo_config, reward_spec, min_improvement=min_improvement, alpha=alpha,
                       force=force)

    return retraining_gate


def test_gate_step_records_what_a_later_gate_compares_and_force_overrides_it():
    from zenml import Model, log_metadata

    from steps.check_new_data import config_fingerprint

    model, (a, b) = "gate-step", (_sha("A"), _sha("B"))
    _add_version(model, production=True, promoted=True, dataset_fingerprint=a)  # version 1
    gate = _gate_pipeline().with_options(model=Model(name=model))

    def skip_reason(**parameters):
        run = gate(dataset_fingerprint=b, ppo_config=GATE_CONFIG, reward_spec={"sha256": GATE_REWARD}, **parameters)
        step = zenml_client().get_pipeline_run(run.id).steps["check_new_data"]
        return step.outputs["skip_reason"][0].load(), step.run_metadata

    assert skip_reason()[0] == ""  # version 2 trains on B from version 1 ...
    second = zenml_client().get_model_version(model, 2)
    assert second.run_metadata["config_fingerprint"] == config_fingerprint(GATE_CONFIG)
    assert "warm_started_from" not in second.run_metadata  # train_ppo's, from the checkpoint it starts from
    # ... (train_ppo records that it started from version 1) and promote refuses it: a gain too small for
    # min_improvement=0.05
    log_metadata({"warm_started_from": "1", "promoted": False, "decision_reason": "not promoted: improvement too small",
                  "baseline": "production", "previous_production_version": "1", "min_improvement": 0.05, "alpha": 0.05, "gain": 0.03,
                  "p_value": 0.01, "gain_ci": [0.01, 0.05], "dataset_fingerprint": b, "reward_sha256": GATE_REWARD},
                  model_version_id=second.id)
    reason, meta = skip_reason(min_improvement=0.05)  # version 3 would do the same again
    assert reason.startswith("version 2 was already trained on this data"), reason
    assert meta["skipped"] is True and meta["refused_version"] == "2"
    reason, meta = skip_reason(min_improvement=0.05, force=True)  # version 4 trains anyway
    assert reason == "" and meta["forced"] is True and meta["reason"].startswith("forced: version 2 was already")
    reason, meta = skip_reason()  # version 5: under min_improvement=0 the same candidate would be promoted
    assert reason == "" and meta["skipped"] is False and "refused_version" not in meta


def test_a_run_that_skipped_training_keeps_no_model_version_and_records_why_on_the_run():
    """The retraining's last step, after promote's decision: a skipped run's version (made as the run started) is
    deleted and the run carries the reason; a run that trained keeps its version."""
    zenml_client()
    from zenml import Model, pipeline

    from steps.discard_skipped_version import discard_skipped_version

    @pipeline(enable_cache=False)
    def retraining_end(decision: dict) -> None:
        discard_skipped_version(decision)

    model = "discard-skipped"
    _add_version(model, production=True, promoted=True)  # version 1
    end = retraining_end.with_options(model=Model(name=model))
    trained = end(decision={"promoted": False, "previous_production_version": "1"})  # version 2 stays
    reason = "the data, trainer config and reward are unchanged since production version 1 was trained"
    skipped = end(decision={"promoted": False, "previous_production_version": "1", "skipped": reason})
    assert _versions(model) == [1, 2]  # version 3, made as the skipped run started, is gone
    skipped = zenml_client().get_pipeline_run(skipped.id)
    assert str(skipped.status) == "completed" and skipped.model_version is None
    assert [tag.name for tag in skipped.tags] == ["skipped"]
    assert {key: skipped.run_metadata[key] for key in ("skipped", "model", "production_version")} == \
        {"skipped": reason, "model": model, "production_version": "1"}
    trained = zenml_client().get_pipeline_run(trained.id)
    assert trained.model_version.number == 2 and "skipped" not in [tag.name for tag in trained.tags]
    assert "skipped" not in trained.run_metadata
    assert zenml_client().get_model_version(model, 2).run_metadata == {}


def test_the_gate_step_records_a_changed_config_as_the_reason_to_train_not_new_data():
    """On the data production was trained on, a changed trainer config is why the run trains, and the step's record
    (which rlhf-lineage shows) says so; with new data too, it names both."""
    from zenml import Model

    from steps.check_new_data import config_fingerprint

    model, (a, b) = "gate-step-why", (_sha("A"), _sha("B"))
    reseeded = {**GATE_CONFIG, "trainer": {**GATE_CONFIG["trainer"], "seed": 7}}
    _add_version(model, production=True, promoted=True, dataset_fingerprint=a, reward_sha256=GATE_REWARD,
                 config_fingerprint=config_fingerprint(GATE_CONFIG))  # version 1
    gate = _gate_pipeline().with_options(model=Model(name=model))

    def recorded(fingerprint: str, config: dict) -> dict:
        run = gate(dataset_fingerprint=fingerprint, ppo_config=config, reward_spec={"sha256": GATE_REWARD})
        return zenml_client().get_pipeline_run(run.id).steps["check_new_data"].run_metadata

    same_data = recorded(a, reseeded)
    assert same_data["skipped"] is False
    assert same_data["reason"] == "the trainer config changed since production version 1 was trained"
    both = recorded(b, reseeded)
    assert both["reason"] == "new data, and the trainer config changed since production version 1 was trained"
    assert recorded(b, GATE_CONFIG)["reason"] == "new data"


def test_the_warm_start_version_is_read_from_the_versions_that_link_the_checkpoint():
    """Production where it links the checkpoint, else the version whose run produced it where that one links it,
    else the newest version that links it; a version of another model never counts."""
    from zenml import Model, save_artifact
    from zenml.model.utils import link_artifact_version_to_model_version

    from steps.smoke_test import linked_version

    client, model = zenml_client(), "warm-links"
    first = _add_version(model, production=True)  # version 1
    second, third, foreign = _add_version(model), _add_version(model), _add_version("warm-links-other")

    def saved(*versions) -> str:  # saved outside any run: it has no producer
        artifact = save_artifact({"weights": [1.0]}, name="warm-links-checkpoint")
        for version in versions:
            link_artifact_version_to_model_version(artifact, version)
        return str(artifact.id)

    assert linked_version(client, model, saved(second, first, third)) == "1"
    assert linked_version(client, model, saved(third, second)) == "3"
    assert linked_version(client, model, saved(foreign)) is None
    assert linked_version(client, model, saved(foreign, second)) == "2"
    assert linked_version(client, model, saved()) is None
    # produced by the run of version 4, then linked by hand to version 5 too: the producer's version, until
    # production links it
    gate = _gate_pipeline().with_options(model=Model(name=model))
    run = gate(dataset_fingerprint=_sha("A"), ppo_config=GATE_CONFIG, reward_spec={"sha256": GATE_REWARD})
    output = zenml_client().get_pipeline_run(run.id).steps["check_new_data"].outputs["skip_reason"][0]
    assert zenml_client().get_pipeline_run(run.id).model_version.number == 4
    link_artifact_version_to_model_version(output, _add_version(model))  # version 5
    assert linked_version(client, model, str(output.id)) == "4"
    link_artifact_version_to_model_version(output, first)
    assert linked_version(client, model, str(output.id)) == "1"


# A promotion is recorded pending, the stage set, then the record marked done: promote alone, on an evaluation that
# promotes (20 problems the candidate gets right and the base model wrong), with a failure planted between writes.

PROMOTING_EVALUATION = {"problems": {f"p{i}": True for i in range(20)},
                        "base_problems": {f"p{i}": False for i in range(20)}, "production_version": None,
                        "accuracy": 1.0, "base_accuracy": 0.0}
PROMOTED_REASON = ("promoted: accuracy 1.0000 vs 0.0000 of the base model (no production version yet) on the same "
                   "20 problems: gain +1.0000")


@functools.cache
def _promote_pipeline():
    zenml_client()
    from zenml import pipeline

    from rlhf_core.pipeline.failure import mark_failed_version
    from steps.promote import promote

    @pipeline(enable_cache=False, on_failure=mark_failed_version)
    def promotion_only(evaluation: dict, dataset_fingerprint: str) -> None:
        promote(evaluation, dataset_fingerprint, {"sha256": GATE_REWARD}, {"passed": True})

    return promotion_only


def _promote_stopped(model_name: str, monkeypatch, after_stage: bool):
    """promote on :data:`PROMOTING_EVALUATION`, failing right before setting the stage or right after."""
    from zenml import Model

    set_stage = Model.set_stage

    def stop(self, *args, **kwargs):
        if after_stage:
            set_stage(self, *args, **kwargs)
        raise RuntimeError("planted failure")

    monkeypatch.setattr(Model, "set_stage", stop)
    with pytest.raises(RuntimeError, match="failure in step"):  # (the hook records the planted error)
        _promote_pipeline().with_options(model=Model(name=model_name))(evaluation=PROMOTING_EVALUATION,
                                                                       dataset_fingerprint=_sha("A"))
    monkeypatch.undo()
    return zenml_client().get_model_version(model_name, 1)


def _promote_retried(model_name: str, monkeypatch, set_stage):
    """promote on :data:`PROMOTING_EVALUATION` with one retry, ``set_stage`` in place of ``Model.set_stage``;
    the run, read again once it is over."""
    from zenml import Model

    monkeypatch.setattr(Model, "set_stage", set_stage)
    run = _promote_pipeline().with_options(model=Model(name=model_name),
                                           steps={"promote": {"retry": {"max_retries": 1, "delay": 0}}})(
        evaluation=PROMOTING_EVALUATION, dataset_fingerprint=_sha("A"))
    monkeypatch.undo()
    return zenml_client().get_pipeline_run(run.id)


def test_a_promotion_carried_out_is_recorded_done_and_readers_see_no_disagreement(capsys):
    from zenml import Model

    from rlhf_core.cli import pipeline as cli
    from rlhf_core.pipeline.lineage import lineage

    model = "promote-done"
    _promote_pipeline().with_options(model=Model(name=model))(evaluation=PROMOTING_EVALUATION,
                                                              dataset_fingerprint=_sha("A"))
    version = zenml_client().get_model_version(model, 1)
    assert str(version.stage) == "production"
    meta = version.run_metadata
    assert (meta["promoted"], meta["promotion"]) == (True, "done")
    assert meta["decision_reason"].startswith(PROMOTED_REASON)
    assert meta["p_value"] == pytest.approx(2 * 0.5 ** 20)  # McNemar exact, 20 fixed and none broken
    assert lineage(model, client=zenml_client())["stage_vs_record"] is None
    assert cli.demo_summary(["--model", model], client=zenml_client()) == 0
    assert "stage:  " not in capsys.readouterr().out


def test_a_promotion_stopped_before_the_stage_is_recorded_pending_and_readers_say_it_was_not_carried_out(
        monkeypatch, capsys):
    from rlhf_core.cli import pipeline as cli
    from rlhf_core.pipeline.lineage import format_lineage, lineage

    model = "promote-stopped-before-stage"
    version = _promote_stopped(model, monkeypatch, after_stage=False)
    assert version.stage is None
    meta = version.run_metadata
    assert meta["promotion"] == "pending" and "promoted" not in meta  # no record of a promotion that did not happen
    assert meta["decision_reason"].startswith(PROMOTED_REASON) and meta["failed_step"] == "promote"
    not_carried_out = ("promotion decided but not carried out: the run stopped before the stage was set (or just "
                       "after, and another version was promoted since); it is not production")
    record = lineage(model, "1", client=zenml_client())
    assert record["stage_vs_record"] == not_carried_out
    assert format_lineage(record).splitlines()[2] == f"  stage and record disagree: {not_carried_out}"
    assert cli.demo_summary(["--model", model], client=zenml_client()) == 0
    out = capsys.readouterr().out
    assert f"decision:   {PROMOTED_REASON}" in out
    assert "failed:     the run failed at step promote: RuntimeError: planted failure" in out
    assert f"stage:      {not_carried_out}" in out
    assert "production: none yet" in out


def test_a_promotion_stopped_after_the_stage_is_production_with_its_reason_and_readers_say_it_was_not_marked_done(
        monkeypatch, capsys):
    from zenml import Model

    from rlhf_core.cli import pipeline as cli
    from rlhf_core.pipeline.lineage import format_lineage, lineage

    model = "promote-stopped-after-stage"
    version = _promote_stopped(model, monkeypatch, after_stage=True)
    assert str(version.stage) == "production"
    meta = version.run_metadata
    assert meta["promotion"] == "pending" and "promoted" not in meta
    assert meta["decision_reason"].startswith(PROMOTED_REASON)  # production keeps the reason it was promoted for
    assert meta["dataset_fingerprint"] == _sha("A") and meta["reward_sha256"] == GATE_REWARD
    not_done = ("in production, but its promotion was not marked done: the run stopped after setting the stage; "
                "its decision and figures were recorded before the stage was set")
    record = lineage(model, client=zenml_client())  # the production version
    assert (record["version"], record["stage_vs_record"]) == ("1", not_done)
    assert format_lineage(record).splitlines()[2] == f"  stage and record disagree: {not_done}"
    assert cli.demo_summary(["--model", model], client=zenml_client()) == 0
    out = capsys.readouterr().out
    assert f"decision:   {PROMOTED_REASON}" in out and f"stage:      {not_done}" in out
    assert "production: version 1" in out
    # the retraining gate goes by the figures recorded before the stage was set, and says what it found
    assert _gate(model, _sha("A"))[0].startswith("the data and reward are unchanged since production version 1")
    gate = _gate_pipeline().with_options(model=Model(name=model))
    run = gate(dataset_fingerprint=_sha("B"), ppo_config=GATE_CONFIG, reward_spec={"sha256": GATE_REWARD})
    step = zenml_client().get_pipeline_run(run.id).steps["check_new_data"]
    assert step.outputs["skip_reason"][0].load() == ""
    assert step.run_metadata["production_record"] == not_done


@pytest.mark.parametrize("stopped", ["after the stage", "after the record"])
def test_a_retry_after_the_stage_was_set_marks_the_promotion_done_rather_than_deciding_again(monkeypatch, capsys,
                                                                                            stopped):
    """The first attempt of promote sets the stage and stops before marking its record done, or after (logging the
    step's own metadata); ZenML's retry finds the version in production: it finishes that promotion, not refuses it
    as paired with a production since replaced (which, after the record, wrote a refusal over production's)."""
    from zenml import Model

    import steps.promote
    from rlhf_core.cli import pipeline as cli
    from rlhf_core.pipeline.lineage import lineage

    model, set_stage, attempts = f"promote-retried-{stopped.replace(' ', '-')}", Model.set_stage, []
    log_metadata, logged = steps.promote.log_metadata, []

    def set_then_stop_once(self, *args, **kwargs):
        set_stage(self, *args, **kwargs)
        attempts.append(1)
        if len(attempts) == 1 and stopped == "after the stage":
            raise RuntimeError("planted failure")

    def stop_once_after_the_record(metadata, **kwargs):
        if not kwargs and not logged:  # the step's own metadata, after the version's record was marked done
            logged.append(metadata)
            raise RuntimeError("planted failure")
        log_metadata(metadata, **kwargs)

    if stopped == "after the record":
        monkeypatch.setattr(steps.promote, "log_metadata", stop_once_after_the_record)
    run = _promote_retried(model, monkeypatch, set_then_stop_once)
    assert str(run.status) == "completed" and attempts == [1]  # the retry did not set the stage again
    assert len(logged) == (stopped == "after the record")
    version = zenml_client().get_model_version(model, 1)
    assert str(version.stage) == "production"
    meta = version.run_metadata
    assert (meta["promoted"], meta["promotion"]) == (True, "done")
    assert meta["decision_reason"].startswith(PROMOTED_REASON) and "previous_production_version" not in meta
    decision = run.steps["promote"].outputs["promotion_decision"][0].load()
    assert decision["promote"] is True and decision["reason"].startswith(PROMOTED_REASON)
    assert run.steps["promote"].run_metadata["promoted"] is True
    assert lineage(model, client=zenml_client())["stage_vs_record"] is None
    assert cli.demo_summary(["--model", model], client=zenml_client()) == 0
    assert "stage:  " not in capsys.readouterr().out


def test_the_gate_says_when_production_has_no_promotion_recorded():
    from zenml import Model

    model = "gate-production-set-by-hand"
    _add_version(model, production=True, dataset_fingerprint=_sha("A"))  # the stage set outside promote
    run = _gate_pipeline().with_options(model=Model(name=model))(
        dataset_fingerprint=_sha("B"), ppo_config=GATE_CONFIG, reward_spec={"sha256": GATE_REWARD})
    meta = zenml_client().get_pipeline_run(run.id).steps["check_new_data"].run_metadata
    assert meta["production_version"] == "1" and meta["skipped"] is False
    assert meta["production_record"] == ("in production, but no promotion is recorded on it: the stage was set "
                                         "outside the promote step, or by a run that stopped before recording its "
                                         "decision")


def test_a_production_without_a_data_fingerprint_is_not_taken_as_trained_on_files_that_cannot_be_read_whole():
    """The files' whole fingerprint is None where one of them is gone; production's missing one is None too."""
    from steps.check_new_data import config_fingerprint, gate

    model = "gate-nothing-to-compare"
    _add_version(model, production=True, promoted=True, promotion="done",
                 config_fingerprint=config_fingerprint(GATE_CONFIG), reward_sha256=GATE_REWARD)
    reason, production, _ = gate(zenml_client(), model, _sha("B"), config_fingerprint(GATE_CONFIG), GATE_REWARD,
                                 evaluation=GATE_EVALUATION, whole_fingerprint=lambda: None)
    assert (reason, production.name) == ("", "1")


def test_the_gate_says_plainly_when_production_recorded_no_data_fingerprint(monkeypatch):
    from zenml import Model

    import steps.check_new_data

    said = []
    monkeypatch.setattr(steps.check_new_data.logger, "info", lambda message, *args: said.append(message % args))
    model = "gate-production-without-fingerprint"
    _add_version(model, production=True, promoted=True, promotion="done")  # e.g. a base model registered by hand
    run = _gate_pipeline().with_options(model=Model(name=model))(
        dataset_fingerprint=_sha("B"), ppo_config=GATE_CONFIG, reward_spec={"sha256": GATE_REWARD})
    meta = zenml_client().get_pipeline_run(run.id).steps["check_new_data"].run_metadata
    assert meta["production_version"] == "1" and meta["skipped"] is False
    assert "production_fingerprint" not in meta  # absent, not the text "None"
    assert f"new data (fingerprint {_sha('B')[:16]}...; production version 1 recorded no data fingerprint): " \
           "retraining from its checkpoint" in said, said


def test_a_retry_that_refuses_after_an_attempt_stopped_before_the_stage_leaves_no_pending_record(monkeypatch):
    """The first attempt records the promotion pending and stops before the stage is set; another run promotes
    meanwhile, so the retry refuses (production changed during the run). The run completes with a refusal: its
    record must not still say a promotion was decided and the run stopped before carrying it out."""
    from rlhf_core.pipeline.lineage import lineage

    model, attempts = "promote-retried-refused", []

    def another_promotion_then_stop(self, *args, **kwargs):
        attempts.append(1)
        _add_version(model, production=True, promoted=True, promotion="done")  # version 2, by another run
        raise RuntimeError("planted failure")

    run = _promote_retried(model, monkeypatch, another_promotion_then_stop)
    assert str(run.status) == "completed" and attempts == [1]
    meta = zenml_client().get_model_version(model, 1).run_metadata
    assert meta["promoted"] is False and "production changed during this run" in meta["decision_reason"]
    assert meta["promotion"] == "refused"  # not "pending": the run did not stop before carrying it out
    assert lineage(model, "1", client=zenml_client())["stage_vs_record"] is None
    # the pending attempt's comparison (against the base model: gain 1, p = 2 * 0.5^20) is not left standing
    # beside a refusal that made none
    for key in ("gain", "gain_ci", "p_value", "baseline_accuracy"):
        assert meta[key] == "none (refused without a comparison)", (key, meta[key])


def test_a_candidate_promoted_over_production_takes_its_stage_and_the_old_version_is_archived():
    """Version 2 right on the 20 problems production version 1 got wrong: promoted against version 1 (McNemar
    exact p = 2 * 0.5^20), it becomes production and version 1 is archived, not left in production beside it."""
    from zenml import Model
    from zenml.enums import ModelStages

    model = "promote-over-production"
    _add_version(model, production=True, promoted=True, promotion="done")
    evaluation = {**PROMOTING_EVALUATION, "production_version": "1",
                  "production_results": {f"p{i}": False for i in range(20)}}
    _promote_pipeline().with_options(model=Model(name=model))(evaluation=evaluation, dataset_fingerprint=_sha("A"))
    first, second = (zenml_client().get_model_version(model, number) for number in (1, 2))
    assert (str(second.stage), str(first.stage)) == (ModelStages.PRODUCTION.value, ModelStages.ARCHIVED.value)
    meta = second.run_metadata
    assert (meta["promoted"], meta["promotion"], meta["baseline"]) == (True, "done", "production")
    assert meta["previous_production_version"] == "1" and meta["p_value"] == pytest.approx(2 * 0.5 ** 20)
    assert meta["decision_reason"].startswith("promoted: accuracy 1.0000 vs 0.0000 of production version 1 on the "
                                              "same 20 problems: gain +1.0000")


def test_an_evaluation_that_fails_promotes_nothing_and_leaves_production_as_it_was(monkeypatch):
    """A run whose evaluate step raises stops there: promote never runs, the production version stays production,
    and the run's own version is marked failed at evaluate with no decision recorded on it."""
    import steps.evaluate

    model = "tiny-evaluation-fails"
    production = _add_version(model, production=True, promoted=True, promotion="done")

    def broken(*args, **kwargs):
        raise RuntimeError("the evaluation broke")

    monkeypatch.setattr(steps.evaluate, "evaluate_policy", broken)
    with pytest.raises(RuntimeError):
        run_pipeline(model)
    client = zenml_client()
    run = client.list_pipeline_runs(sort_by="desc:created", size=1)[0]
    assert (str(run.status), str(run.steps["evaluate"].status)) == ("failed", "failed")
    assert "promote" not in run.steps
    assert client.get_model_version(model, "production").id == production.id
    failed = client.get_model_version(model, "latest")
    assert failed.number == 2 and failed.stage is None
    assert [tag.name for tag in failed.tags] == ["failed"]
    meta = failed.run_metadata
    assert (meta["failed_step"], meta["failure"]) == ("evaluate", "RuntimeError: the evaluation broke")
    assert not {"promoted", "promotion", "decision_reason"} & set(meta)
    # its lineage names the failure and the chain up to the checkpoint it trained, which nothing promoted
    from rlhf_core.pipeline.lineage import format_lineage, lineage

    record = lineage(model, "2", client=client)
    assert (record["stage"], record["run_id"]) == (None, str(run.id))
    assert [(link["stage"], link["status"]) for link in record["chain"]] == [
        ("data", "completed"), ("validation", "completed"), ("reward", "completed"), ("smoke test", "completed"),
        ("checkpoint", "completed"), ("evaluation", "failed")]
    text = format_lineage(record)
    assert "  failed at step evaluate: RuntimeError: the evaluation broke" in text
