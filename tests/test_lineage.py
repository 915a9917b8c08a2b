"""rlhf-lineage: the chain behind the production version, as text and as JSON."""

from __future__ import annotations

import json

import pytest
from test_pipeline import trained_model, zenml_client

from rlhf_core.cli import pipeline as cli
from rlhf_core.pipeline.lineage import lineage

CHAIN = ["data", "validation", "reward", "smoke test", "checkpoint", "evaluation", "promotion"]


@pytest.fixture(scope="module")
def trained():
    return trained_model()


def test_production_lineage_links_every_stage_to_its_artifacts(trained):
    model, _ = trained
    client = zenml_client()
    production = client.get_model_version(model, "production")
    record = lineage(model, client=client)
    assert record["version"] == production.name
    assert record["stage"] == "production"
    stages = [link["stage"] for link in record["chain"] if link["stage"] != "retraining gate"]
    assert stages == CHAIN
    run = client.get_pipeline_run(record["run_id"])
    links = {link["stage"]: link for link in record["chain"]}
    for link in record["chain"]:  # every artifact id is the one the run's step produced
        produced = {str(a.id) for outputs in run.steps[link["step"]].outputs.values() for a in outputs}
        assert {a["id"] for a in link["artifacts"]} == produced
    meta = record["model_version_metadata"]
    checkpoint_ids = [a["id"] for a in links["checkpoint"]["artifacts"] if a["name"] == "ppo_checkpoint"]
    assert checkpoint_ids == [meta["checkpoint_artifact_id"]]
    assert links["validation"]["metadata"]["dataset_fingerprint"] == meta["dataset_fingerprint"]
    assert links["reward"]["metadata"]["reward_sha256"] == meta["reward_sha256"]
    assert links["data"]["metadata"]["train_files"]
    assert links["smoke test"]["metadata"]["passed"] is True
    assert links["promotion"]["metadata"]["promoted"] is True


def test_cli_prints_the_chain_and_json(trained, capsys):
    model, _ = trained
    client = zenml_client()
    assert cli.lineage(["--model", model], client=client) == 0
    text = capsys.readouterr().out
    for stage in CHAIN[1:]:
        assert f"-> {stage}: step " in text
    assert "(stage: production)" in text
    assert "decision_reason: promoted" in text

    assert cli.lineage(["--model", model, "--version", "1", "--json"], client=client) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["number"] == 1
    assert record["chain"][-1]["stage"] == "promotion"


def test_a_trained_version_finds_its_data_and_reward_unchanged_and_keeps_the_reward_file(trained, capsys):
    from test_pipeline import tiny_setup

    model, _ = trained
    client = zenml_client()
    record = lineage(model, "1", client=client)
    assert record["data_check"]["status"] == "unchanged"
    assert record["data_check"]["files"] == [str(tiny_setup().train_file), str(tiny_setup().val_file)]
    reward = tiny_setup().root / "digit_first.py"
    assert (record["reward_check"]["path"], record["reward_check"]["status"]) == (str(reward), "unchanged")
    assert [file["path"] for file in record["reward_check"]["files"]] == [str(reward)]
    assert cli.lineage(["--model", model, "--version", "1", "--reward-source"], client=client) == 0
    assert capsys.readouterr().out == f"# ==> {reward} <==\n" + reward.read_text()


def test_cli_names_what_is_missing(trained, capsys):
    assert cli.lineage(["--model", "no-such-model"], client=zenml_client()) == 2
    assert "error:" in capsys.readouterr().err


def test_lineage_shows_the_problems_the_version_fixed_and_broke(trained, capsys):
    model, (first_run_id, _) = trained
    client = zenml_client()
    table = client.get_pipeline_run(first_run_id).steps["evaluate"].outputs["per_problem"][0].load()
    fixed = table[~table["base_correct"] & table["candidate_correct"]]
    broken = table[table["base_correct"] & ~table["candidate_correct"]]
    assert cli.lineage(["--model", model, "--version", "1"], client=client) == 0
    text = capsys.readouterr().out
    assert f"against the base: fixed {len(fixed)}, broke {len(broken)} problem(s)" in text
    shown = [line for line in text.splitlines() if line.strip().startswith(("fixed ", "broken "))]
    assert len(shown) == min(len(fixed), 5) + min(len(broken), 5)
    for problem_id, answer in list(zip(fixed["problem_id"], fixed["ground_truth"]))[:5]:
        assert f"fixed {problem_id} (answer {answer}): " in text
    assert "model version p_value: " in text and "model version gain_ci: " in text


def test_the_reward_model_stages_show_their_accuracy_and_fingerprint():
    from rlhf_core.pipeline.lineage import format_lineage

    def link(stage, step, about, metadata, artifacts=()):
        return {"stage": stage, "about": about, "step": step, "status": "completed", "run": "rm-run", "inputs": {},
                "artifacts": list(artifacts), "metadata": metadata}

    record = {
        "model": "rlhf-rm-policy", "version": "2", "stage": "production", "run": "rm-run",
        "pipeline": "rlhf_rm_pipeline", "run_status": "completed", "run_id": "42",
        "model_version_metadata": {"promoted": True, "promotion": "done"},  # as promote leaves a production version
        "chain": [
            link("preference data", "validate_preferences", "the pairs",
                 {"preference_fingerprint": "9f2c", "train_pairs": 48, "val_pairs": 16, "unrelated": 1}),
            link("reward model", "train_reward_model", "the learned reward model and its held-out pair accuracy",
                 {"held_out_pair_accuracy": 0.8125, "min_pair_accuracy": 0.6, "passed": True,
                  "reason": "held-out pair accuracy 81.2% >= 60.0%", "preference_fingerprint": "9f2c",
                  "local_dir": "/tmp/rm"},
                 [{"name": "reward_model", "version": "3", "id": "rm-1"}]),
        ],
    }
    assert format_lineage(record).splitlines() == [
        "model rlhf-rm-policy version 2 (stage: production)",
        "  produced by run rm-run of rlhf_rm_pipeline (completed, id 42)",
        "   preference data: step validate_preferences [completed] - the pairs",
        "      preference_fingerprint: 9f2c",
        "      train_pairs: 48",
        "      val_pairs: 16",
        "-> reward model: step train_reward_model [completed] - the learned reward model and its held-out pair "
        "accuracy",
        "      artifact reward_model v3 id rm-1",
        "      held_out_pair_accuracy: 0.8125",
        "      min_pair_accuracy: 0.6",
        "      passed: true",
        "      reason: held-out pair accuracy 81.2% >= 60.0%",
        "      preference_fingerprint: 9f2c",
    ]


def test_every_stage_of_the_chain_has_highlights():
    from rlhf_core.pipeline import lineage as module

    assert sorted(module._HIGHLIGHTS) == sorted(stage for stage, _, _ in module.CHAIN)


def _link(stage, step, metadata, inputs=None):
    return {"stage": stage, "about": "...", "step": step, "status": "completed", "run": "r", "inputs": inputs or {},
            "artifacts": [], "metadata": metadata}


def test_a_retraining_chain_shows_the_warm_start_under_the_smoke_test_and_what_training_started_from():
    """The retraining gives production's checkpoint to the smoke test (its init_from input); train_ppo loads the
    artifact the smoke test's report names, by hand (not one of its regular inputs), and records it and the
    version it is linked to in its metadata. A run that trains nothing skips both steps."""
    from rlhf_core.pipeline.lineage import format_lineage

    def record(smoke_metadata, training_metadata):
        smoke_inputs = {"ppo_config": ["c1"], "reward_spec": ["r1"], "skip_reason": ["s1"], "init_from": ["a1"]}
        training_inputs = {"ppo_config": ["c1"], "smoke_report": ["p1"], "skip_reason": ["s1"], "reward_spec": ["r1"]}
        return {"model": "m", "version": "4", "stage": None, "run": "r", "pipeline": "rlhf_retrain_pipeline",
                "run_status": "completed", "run_id": "1", "model_version_metadata": {},
                "chain": [_link("smoke test", "smoke_test", smoke_metadata, smoke_inputs),
                          _link("checkpoint", "train_ppo", training_metadata, training_inputs)]}

    # as the steps log it: the smoke test's result and the warm start it ran from; train_ppo's summary (None
    # values left out) after the artifact it started from, here a retry that resumed from its own checkpoint
    smoke = {"passed": True, "wall_s": 2.31, "cloned": True, "parameters": 1536, "target_parameters": 540672,
             "checks": {"finite_losses": "ok"}, "init_from_artifact_id": "a1", "init_from_version": "1"}
    training = {"warm_start_artifact": "a1", "steps": 3, "wall_s": 12.5, "final_val_acc": 0.75, "final_score": 0.7,
                "checkpoint": "global_step_3", "checkpoint_dir": "/runs/r/global_step_3", "local_dir": "/runs/r",
                "resumed_from": "/runs/r/global_step_2", "warm_started": True, "warm_started_from": "1",
                "smoke_test_passed": True, "dataset_fingerprint": "9f", "final_metrics": {"step": 3}}
    assert format_lineage(record(smoke, training)).splitlines()[2:] == [
        "   smoke test: step smoke_test [completed] - ...",
        "      warm-started from artifact a1",
        "      passed: true",
        "      wall_s: 2.31",
        "      cloned: true",
        "      parameters: 1536",
        "-> checkpoint: step train_ppo [completed] - ...",
        "      steps: 3",
        "      checkpoint: global_step_3",
        "      final_val_acc: 0.75",
        "      final_score: 0.7",
        "      wall_s: 12.5",
        "      warm_started: true",
        "      warm_started_from: 1",
        "      warm_start_artifact: a1",
        "      resumed_from: /runs/r/global_step_2",
    ]
    reason = "the data, trainer config and reward are unchanged since production version 1 was trained"
    skipped = record({"skipped": reason, "init_from_artifact_id": "a1", "init_from_version": "1"},
                     {"skipped": reason, "steps": 0})
    assert format_lineage(skipped).splitlines()[2:] == [
        "   smoke test: step smoke_test [completed] - ...",
        "      warm-start artifact (unused: nothing trained) a1",
        f"      skipped: {reason}",
        "-> checkpoint: step train_ppo [completed] - ...",
        f"      skipped: {reason}",
        "      steps: 0",
    ]


def _summary(capsys, version: str, meta: dict, run_id: str, run_name: str, status: str = "failed",
             pipeline_run_ids: dict | None = None) -> str:
    """What ``rlhf-demo-summary`` prints for a model whose latest version is ``version`` (its metadata ``meta``), with
    no production version, its run ``run_id`` named ``run_name`` and ended ``status``."""
    from types import SimpleNamespace

    latest = SimpleNamespace(name=version, run_metadata=meta, pipeline_run_ids=pipeline_run_ids or {})
    runs = {run_id: SimpleNamespace(name=run_name, status=status, id=run_id)}

    class Client:
        active_project = SimpleNamespace(name="default")

        def get_model_version(self, model, version):
            if version == "latest":
                return latest
            raise KeyError(version)

        def get_pipeline_run(self, run_id):
            return runs[run_id]

    assert cli.demo_summary(["--model", "m"], client=Client()) == 0
    return capsys.readouterr().out


def test_the_summary_shows_accuracies_to_four_places_as_the_decision_does(capsys):
    out = _summary(capsys, "3", {"accuracy": 0.8720703125, "base_accuracy": 0.41015625}, "run-3", "r-3", "completed",
                   pipeline_run_ids={"r-3": "run-3"})
    assert "model:      m version 3: accuracy 0.8721 (base model 0.4102)" in out


def test_the_summary_names_the_run_of_a_version_that_failed_before_promotion(capsys):
    out = _summary(capsys, "10", {}, "run-7", "rlhf_ppo_pipeline-7",
                   pipeline_run_ids={"rlhf_ppo_pipeline-7": "run-7"})
    assert "run:        rlhf_ppo_pipeline-7 (failed)" in out
    assert "projects/default/runs/run-7" in out
    # no production version: the lineage command it prints names this version (the default would find none)
    assert "  rlhf-lineage --model m --version 10   # data -> ... -> this run's version" in out


def test_a_version_whose_run_failed_says_at_which_step_and_why(capsys):
    """The pipelines' failure hook records the step and the error on the version; the chain and the summary
    lead with them."""
    from rlhf_core.pipeline.lineage import format_lineage

    meta = {"failed_step": "train_ppo", "failure": "RewardFunctionError: compute_score raised on row 3",
            "pipeline_run_id": "run-8"}
    record = {"model": "m", "version": "11", "stage": None, "run": "r-8", "pipeline": "rlhf_ppo_pipeline",
              "run_status": "failed", "run_id": "run-8", "model_version_metadata": meta,
              "chain": [_link("checkpoint", "train_ppo", {})]}
    assert format_lineage(record).splitlines()[2] == \
        "  failed at step train_ppo: RewardFunctionError: compute_score raised on row 3"

    out = _summary(capsys, "11", meta, "run-8", "r-8")  # the run is the metadata's
    assert "run:        r-8 (failed)" in out
    assert "decision:   none: the run failed at step train_ppo: RewardFunctionError: compute_score raised" in out


def test_the_failure_record_keeps_the_error_short():
    from rlhf_core.pipeline.failure import MAX_ERROR_CHARS, failure_record

    record = failure_record("evaluate", RuntimeError("x" * 5000), "r-9", "id-9")
    assert record["failure"] == "RuntimeError: " + "x" * (MAX_ERROR_CHARS - 3 - len("RuntimeError: ")) + "..."
    assert len(record["failure"]) == MAX_ERROR_CHARS
    assert record == {"failed_step": "evaluate", "failure": record["failure"], "pipeline_run": "r-9",
                      "pipeline_run_id": "id-9"}


@pytest.mark.parametrize("rerun", ["rerun the same command", "rerun with trainer.resume_mode=auto"])
def test_a_failed_training_in_a_pipeline_says_in_its_message_how_to_go_on_and_the_chain_shows_it(tmp_path, capsys,
                                                                                               rerun):
    """A training error says '<rerun> to resume from it', which in a pipeline starts afresh (a new run trains in
    a new folder): the step puts the resume_path overrides in its place, in the message the version records as
    its failure, and adds no note that says otherwise; the version's advice is that way on."""
    from types import SimpleNamespace

    from rlhf_core.main_ppo import _reward_failure
    from rlhf_core.pipeline.failure import failure_record
    from rlhf_core.pipeline.lineage import format_lineage
    from rlhf_core.pipeline.training import add_resume_advice
    from rlhf_core.rewards.manager import RewardFunctionFailed
    from rlhf_core.training.checkpoint import LATEST_FILE, RerunPoint, write_checkpoint

    write_checkpoint(tmp_path, 3, lambda files: files.text("x.txt", "state") or ["actor"])
    assert (tmp_path / LATEST_FILE).read_text().strip() == "3"
    latest = tmp_path / "global_step_3"
    trainer = SimpleNamespace(config=SimpleNamespace(trainer=SimpleNamespace(val_only=False)), global_step=3,
                              rerun_point=lambda: RerunPoint(rerun, latest))
    cause = RewardFunctionFailed("reward function 'score' failed on sample 5: ValueError: no answer", "score", 5)
    cause.step = 4
    error = _reward_failure(trainer, cause)
    assert f"{rerun} to resume from it" in str(error)  # what a rerun of the command does, outside a pipeline
    add_resume_advice(error, tmp_path)
    way = (f"add trainer.resume_mode=resume_path and trainer.resume_from_path={latest} to the run config's "
           "overrides, then run the pipeline again, to resume from it (run again as it is, the pipeline starts "
           "afresh in a folder of its own; a retry of this step in this run resumes there by itself)")
    assert str(error) == ("training step 4 failed: reward function 'score' failed on sample 5: ValueError: "
                          f"no answer\nthe latest checkpoint {latest} is intact: fix the reward function"
                          f" (an edit of its code also needs trainer.allow_reward_code_change=true), then {way}")
    assert not getattr(error, "__notes__", [])
    record = failure_record("train_ppo", error, "r-5", "id-5")
    assert record == {"failed_step": "train_ppo", "failure": f"RewardFunctionFailed: {error}", "advice": way,
                      "pipeline_run": "r-5", "pipeline_run_id": "id-5"}
    meta = {**record}
    chain = {"model": "m", "version": "12", "stage": None, "run": "r-5", "pipeline": "rlhf_ppo_pipeline",
             "run_status": "failed", "run_id": "id-5", "model_version_metadata": meta,
             "chain": [_link("checkpoint", "train_ppo", {})]}
    text = format_lineage(chain).splitlines()
    assert text[2].startswith("  failed at step train_ppo: RewardFunctionFailed: training step 4 failed: reward "
                              "function 'score' failed on sample 5: ValueError: no answer the latest checkpoint ")
    assert text[3] == f"  to go on: {way}"  # (the failure on one line, clipped)
    assert f"to go on:   {way}" in _summary(capsys, "12", meta, "id-5", "r-5")


def test_a_run_that_failed_after_promote_recorded_its_decision_still_says_how_to_go_on(capsys):
    meta = {"decision_reason": "promoted: +0.2 over production version 1", "promotion": "pending",
            "failed_step": "promote", "failure": "RuntimeError: store unreachable",
            "advice": "rerun the pipeline: promote decides again", "pipeline_run_id": "run-6"}
    out = _summary(capsys, "14", meta, "run-6", "r-6")
    assert "decision:   promoted: +0.2 over production version 1" in out
    assert "failed:     the run failed at step promote: RuntimeError: store unreachable" in out
    assert "to go on:   rerun the pipeline: promote decides again" in out


def test_the_summary_of_a_skipped_retraining_says_so_in_place_of_an_accuracy(capsys):
    reason = "the data, trainer config and reward are unchanged since production version 1 was trained"
    meta = {"skipped": reason, "promoted": False, "decision_reason": f"not promoted: training was skipped: {reason}",
            "pipeline_run_id": "run-9"}
    out = _summary(capsys, "13", meta, "run-9", "rlhf_retrain_pipeline-9", status="completed")
    assert f"model:      m version 13: training skipped: {reason}" in out
    assert "accuracy n/a" not in out


class _Store:
    """A pipeline store holding ``models`` ({name: version names, in order, numbered from 1}), the versions in a
    stage as ``stages`` says ({model: {version name: stage}}; none by default). It answers as ZenML 0.98's Client
    does: a page of at most ``size`` items, sorted by ``sort_by`` (``desc:`` first for descending), with the total
    count; a stage that holds more than one version is a RuntimeError; an argument it has not (the deprecated
    model_name_or_id) is a TypeError."""

    def __init__(self, models: dict[str, list[str]], stages: dict[str, dict[str, str]] | None = None):
        self.models = models
        self.stages = stages or {}

    def _versions(self, model: str, stage: str | None = None) -> list:
        from types import SimpleNamespace

        stages = self.stages.get(model, {})
        return [SimpleNamespace(name=name, number=number) for number, name in enumerate(self.models[model], 1)
                if stage is None or stages.get(name) == stage]

    @staticmethod
    def _page(items: list, sort_by: str, page: int, size: int):
        from types import SimpleNamespace

        assert 1 <= size <= 100 and page >= 1  # ZenML's own limits on a page
        ordered = items[::-1] if sort_by.startswith("desc:") else items
        return SimpleNamespace(items=ordered[(page - 1) * size:page * size], total=len(items), index=page,
                               total_pages=max(1, -(-len(items) // size)))

    def list_models(self, *, sort_by: str = "created", page: int = 1, size: int = 20):
        from types import SimpleNamespace

        assert sort_by.removeprefix("desc:").removeprefix("asc:") == "created"  # (created in dict order here)
        return self._page([SimpleNamespace(name=name) for name in self.models], sort_by, page, size)

    def list_model_versions(self, *, model: str, stage: str | None = None, sort_by: str = "number", page: int = 1,
                            size: int = 20):
        assert sort_by.removeprefix("desc:").removeprefix("asc:") == "number"  # (numbered in list order here)
        return self._page(self._versions(model, stage), sort_by, page, size)

    def get_model_version(self, model, version):
        names = self.models.get(model, [])
        if version == "latest" and names:
            return names[-1]
        in_stage = self._versions(model, version) if model in self.models else []
        if len(in_stage) > 1:
            raise RuntimeError(f"The model version identifier `{version}` is not unique for model `{model}`.")
        if in_stage:
            return in_stage[0]
        raise KeyError(f"no version {version} of {model}")


@pytest.mark.parametrize("models, argv, expected", [
    # the summary takes no --version: it was told to try one
    ({"demo-ppo-policy": ["1"], "gsm8k-ppo-policy": []}, ["summary", "--model", "nope"],
     "error: no model 'nope' in the store; its models: demo-ppo-policy, gsm8k-ppo-policy (pass --model one of them)"),
    ({"demo-ppo-policy": []}, ["summary", "--model", "demo-ppo-policy"],
     "error: model 'demo-ppo-policy' has no versions yet: run its training pipeline first"),
    # an empty store: the lineage suggested the --version latest it had been given
    ({}, ["lineage", "--model", "demo-ppo-policy", "--version", "latest"],
     "error: no model 'demo-ppo-policy': the store has no models yet; run the training pipeline first"),
    ({"m": ["1", "2"]}, ["lineage", "--model", "m"],
     "error: model 'm' has no production version (none was promoted); its versions: 1, 2 (pass --version latest "
     "or one of them)"),
    ({"m": [str(n) for n in range(1, 13)]}, ["lineage", "--model", "m", "--version", "13"],
     "error: model 'm' has no version '13'; its versions: ..., 3, 4, 5, 6, 7, 8, 9, 10, 11, 12 (pass --version "
     "latest or one of them)"),
    # past ZenML's page of 100: the latest ten are the store's, not the first page's last ten
    ({"m": [f"v{n}" for n in range(1, 106)]}, ["lineage", "--model", "m", "--version", "999"],
     "error: model 'm' has no version '999'; its versions: ..., v96, v97, v98, v99, v100, v101, v102, v103, v104, "
     "v105 (pass --version latest or one of them)"),
    # a store of more models than one page holds: the one asked for is found past the first page
    ({**{f"other-{n}": [] for n in range(120)}, "m": ["1"]}, ["lineage", "--model", "m", "--version", "2"],
     "error: model 'm' has no version '2'; its versions: 1 (pass --version latest or one of them)"),
])
def test_a_model_or_version_not_in_the_store_is_said_with_what_the_store_and_the_command_offer(models, argv, expected,
                                                                                               capsys):
    command, *args = argv
    store = _Store(models)
    code = cli.demo_summary(args, client=store) if command == "summary" else cli.lineage(args, client=store)
    assert code == 2
    assert capsys.readouterr().err.strip() == expected


@pytest.mark.parametrize("versions, expected", [
    # three promotions: each archived the production version before it
    ({"1": "archived", "2": "archived", "3": "production"},
     "error: model 'm' has 2 versions in stage 'archived': 1, 2 (pass --version one of their numbers)"),
    # many archived: the latest ten, as the versions of a model not found are shown
    ({**{str(n): "archived" for n in range(1, 13)}, "13": "production", "14": None},
     "error: model 'm' has 12 versions in stage 'archived': ..., 3, 4, 5, 6, 7, 8, 9, 10, 11, 12 (pass --version "
     "one of their numbers)"),
])
def test_a_stage_that_holds_more_than_one_version_names_them_and_asks_for_a_number(versions, expected, capsys):
    store = _Store({"m": list(versions)}, {"m": versions})
    assert cli.lineage(["--model", "m", "--version", "archived"], client=store) == 2
    assert capsys.readouterr().err.strip() == expected


def test_a_stage_that_holds_more_than_one_version_in_a_real_store_is_an_error_not_a_traceback(repo_root, tmp_path):
    """ZenML answers a stage that holds more than one version (archived, after three promotions) with a
    RuntimeError: the command came out as a traceback."""
    import os
    import subprocess
    import sys

    script = ("import sys\n"
              "from zenml.client import Client\n"
              "from rlhf_core.cli import pipeline as cli\n"
              "client = Client()\n"
              "client.create_model('m')\n"
              "for _ in range(3):\n"
              "    client.create_model_version('m').set_stage('production', force=True)\n"
              "sys.exit(cli.lineage(['--model', 'm', '--version', 'archived'], client=client))\n")
    env = {**os.environ, "PYTHONPATH": str(repo_root), "ZENML_CONFIG_PATH": str(tmp_path / "zenml"),
           "ZENML_REPOSITORY_PATH": str(tmp_path), "ZENML_ANALYTICS_OPT_IN": "false"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=120)
    assert (done.returncode, done.stderr.splitlines()[-1:]) == (
        2, ["error: model 'm' has 2 versions in stage 'archived': 1, 2 (pass --version one of their numbers)"]), \
        done.stderr[-2000:]


def test_the_data_files_of_a_version_are_checked_against_the_fingerprint_it_validated(tmp_path):
    """A retraining run may write new data to the path an older version trained on: the path alone would name
    other bytes than the version's, so the check says whether they are unchanged, changed since, or missing."""
    from rlhf_core.data.validation import splits_fingerprint
    from rlhf_core.pipeline.lineage import check_data_files

    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    train.write_bytes(b"the rows version 1 trained on")
    val.write_bytes(b"its validation rows")
    validated = splits_fingerprint([train], [val])  # what validate_data recorded for the version
    files = [str(train), str(val)]
    assert check_data_files(str(train), [str(val)], validated) == {
        "files": files, "recorded": validated, "status": "unchanged", "now": validated}
    train.write_bytes(b"the rows a retraining run wrote later")
    check = check_data_files(str(train), str(val), validated)
    assert check["status"] == "changed since" and check["now"] != validated
    train.write_bytes(b"the rows version 1 trained on")  # the same bytes again: the same data
    assert check_data_files([str(train)], str(val), validated)["status"] == "unchanged"
    val.unlink()
    assert check_data_files(str(train), str(val), validated) == {
        "files": files, "recorded": validated, "status": "missing", "missing": [str(val)]}



def test_the_data_check_reads_the_paths_as_the_trainer_does_without_importing_torch(tmp_path, monkeypatch):
    """Checking a version's data files imported torch (the trainer's dataset module, for its reading of one path
    or a list), a second and a half of the command for nothing it uses."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from rlhf_core.data.validation import splits_fingerprint
    from rlhf_core.pipeline.lineage import _paths

    monkeypatch.setenv("HOME", str(tmp_path))
    assert _paths("~/d/train.parquet") == [tmp_path / "d" / "train.parquet"]
    assert _paths(["a.parquet", Path("~/b.parquet")]) == [Path("a.parquet"), tmp_path / "b.parquet"]
    assert _paths(None) == []
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    train.write_bytes(b"the rows the version trained on")
    val.write_bytes(b"its validation rows")
    validated = splits_fingerprint([train], [val])
    probe = ("import sys\n"
             "from rlhf_core.pipeline.lineage import check_data_files, check_reward_file, recorded_paths\n"
             f"check = check_data_files('~/train.parquet', recorded_paths(['~/val.parquet']), {validated!r})\n"
             "print(check['status'], check_reward_file({'kind': 'builtin'}), 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.stdout.split() == ["unchanged", "None", "False"], done.stderr

def test_a_custom_reward_is_checked_without_importing_torch(tmp_path):
    """The code hash a custom reward's check makes again lived in the evaluation's module, which imports torch:
    every lineage of a custom reward's version imported it, for a walk of a few files."""
    import os
    import subprocess
    import sys

    (tmp_path / "helper.py").write_text("import math\n\ndef half(x):\n    return x / 2\n")
    (tmp_path / "my_reward.py").write_text("from helper import half\n\ndef score_it(*args, **kwargs):\n"
                                           "    return half(1.0)\n")
    probe = ("import hashlib, sys\n"
             "from rlhf_core.pipeline.lineage import SOURCE_KEY, check_reward_file, custom_reward_source\n"
             "from rlhf_core.pipeline.reward_code import user_code\n"
             "code, _, _ = user_code(__import__('pathlib').Path('my_reward.py'))\n"
             "spec = {'kind': 'custom', 'custom_path': 'my_reward.py', SOURCE_KEY: custom_reward_source('my_reward.py'),"
             " 'functions': {'any': {'source_sha256': hashlib.sha256(code.encode()).hexdigest()}}}\n"
             "check = check_reward_file(spec)\n"
             "print(check['status'], len(check['files']), 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.stdout.split() == ["unchanged", "2", "False"], done.stderr


def test_a_custom_reward_file_is_kept_and_checked_against_its_sha256(tmp_path, monkeypatch):
    import ast
    import hashlib

    from rlhf_core.pipeline.lineage import check_reward_file, custom_reward_source

    monkeypatch.chdir(tmp_path)
    reward = tmp_path / "reward.py"
    text = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    reward.write_text(text)
    kept = custom_reward_source(reward)
    assert kept == {"cwd": str(tmp_path), "files": [
        {"path": str(reward), "sha256": hashlib.sha256(text.encode()).hexdigest(), "text": text}]}
    code = hashlib.sha256(f"# reward.py\n{ast.unparse(ast.parse(text))}".encode()).hexdigest()
    spec = {"kind": "custom", "custom_path": str(reward), "custom_source": kept,
            "functions": {"a": {"source_sha256": code}}}
    check = check_reward_file(spec)
    assert (check["status"], check["source_kept"], check["added"]) == ("unchanged", True, [])
    assert check["files"] == [{"path": str(reward), "recorded": kept["files"][0]["sha256"], "status": "unchanged",
                               "now": kept["files"][0]["sha256"]}]
    assert check["code"] == {"recorded": code, "status": "unchanged", "now": code}
    reward.write_text(text.replace("1.0", "0.5"))
    check = check_reward_file(spec)
    assert (check["status"], check["files"][0]["status"], check["code"]["status"]) == ("changed since",) * 3
    assert check["files"][0]["now"] == hashlib.sha256(text.replace("1.0", "0.5").encode()).hexdigest()
    reward.unlink()
    assert check_reward_file(spec)["status"] == "missing"
    assert check_reward_file({"kind": "builtin", "custom_path": None, "functions": {}}) is None


def test_a_reward_spec_that_kept_the_reward_file_alone_is_still_checked_and_printed(tmp_path):
    """Reward specs first kept the reward file alone, at the top of its key: it is checked as the one file kept."""
    import hashlib

    from rlhf_core.pipeline.lineage import check_reward_file, kept_files

    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(*args):\n    return 1.0\n")
    digest = hashlib.sha256(reward.read_bytes()).hexdigest()
    old = {"path": str(reward), "sha256": digest, "text": reward.read_text()}
    assert kept_files(old) == [old]
    check = check_reward_file({"kind": "custom", "custom_path": str(reward), "custom_source": old, "functions": {}})
    assert (check["status"], check["files"][0]["status"], check["code"]) == ("unchanged", "unchanged", None)


def test_a_reward_spec_from_before_the_text_was_kept_is_checked_by_its_code_hash(tmp_path):
    """An older spec holds the SHA-256 of the reward's code (without comments): a comment added since is the same
    code, another return value is not."""
    import ast
    import hashlib

    from rlhf_core.pipeline.lineage import check_reward_file

    reward = tmp_path / "reward.py"
    code = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    reward.write_text(code)
    recorded = hashlib.sha256(f"# reward.py\n{ast.unparse(ast.parse(code))}".encode()).hexdigest()
    spec = {"kind": "custom", "custom_path": str(reward), "functions": {"a": {"source_sha256": recorded}}}
    check = check_reward_file(spec)
    assert (check["status"], check["source_kept"], check["files"]) == ("unchanged", False, [])
    assert check["code"] == {"recorded": recorded, "status": "unchanged", "now": recorded}
    reward.write_text("# graded by hand first\n" + code)
    assert check_reward_file(spec)["status"] == "unchanged"
    reward.write_text(code.replace("1.0", "0.0"))
    assert check_reward_file(spec)["status"] == "changed since"


def test_the_chain_says_whether_the_files_a_version_names_by_path_still_hold_its_data_and_reward():
    from rlhf_core.pipeline.lineage import format_lineage

    def record(data_check, reward_check):
        return {"model": "m", "version": "2", "stage": None, "run": "r-2", "pipeline": "rlhf_ppo_pipeline",
                "run_status": "completed", "run_id": "id-2", "model_version_metadata": {},
                "chain": [_link("data", "load_ppo_config", {"train_files": "/d/train.parquet"}),
                          _link("reward", "define_reward", {"reward_sha256": "5e"})],
                "data_check": data_check, "reward_check": reward_check}

    changed = {"files": ["/d/train.parquet"], "recorded": "a" * 64, "status": "changed since", "now": "b" * 64}
    source_in = {"artifact": "reward_spec", "id": "77", "version": "4", "key": "custom_source"}
    kept = {"path": "/r/reward.py", "status": "unchanged", "source_kept": True, "added": [],
            "code": {"recorded": "e" * 64, "status": "unchanged", "now": "e" * 64},
            "files": [{"path": "/r/reward.py", "recorded": "c" * 64, "status": "unchanged", "now": "c" * 64},
                      {"path": "/r/grading.py", "recorded": "f" * 64, "status": "unchanged", "now": "f" * 64}],
            "source_in": source_in}
    assert format_lineage(record(changed, kept)).splitlines()[2:] == [
        "   data: step load_ppo_config [completed] - ...",
        "      train_files: /d/train.parquet",
        "      data files now: changed since this version: the paths hold other bytes than it validated and trained "
        "on (fingerprint aaaaaaaaaaaa then, bbbbbbbbbbbb now)",
        "-> reward: step define_reward [completed] - ...",
        "      reward_sha256: 5e",
        "      custom reward now: unchanged: /r/reward.py with what it imports (code sha256 eeeeeeeeeeee)",
        "        /r/reward.py: unchanged (file sha256 cccccccccccc)",
        "        /r/grading.py: unchanged (file sha256 ffffffffffff)",
        "      reward source: the text of its files (2) is kept in artifact reward_spec v4 id 77 under "
        "'custom_source': rlhf-lineage --model m --version 2 --reward-source prints them",
    ]
    # the files unchanged and the code not: what differs is imported from this project
    other_code = {**kept, "status": "changed since", "code": {**kept["code"], "status": "changed since",
                                                              "now": "9" * 64}}
    assert format_lineage(record(changed, other_code)).splitlines()[7:11] == [
        "      custom reward now: changed since this version: /r/reward.py with what it imports (code sha256 "
        "eeeeeeeeeeee then, 999999999999 now)",
        "        /r/reward.py: unchanged (file sha256 cccccccccccc)",
        "        /r/grading.py: unchanged (file sha256 ffffffffffff)",
        "        (its files are unchanged: the code differs in what they import from this project)"]
    missing = {"files": ["/d/train.parquet"], "recorded": "a" * 64, "status": "missing",
               "missing": ["/d/train.parquet"]}
    old = {"path": "/r/reward.py", "status": "changed since", "source_kept": False, "files": [], "added": [],
           "code": {"recorded": "c" * 64, "status": "changed since", "now": "d" * 64}}
    lines = format_lineage(record(missing, old)).splitlines()
    assert lines[4] == "      data files now: missing: /d/train.parquet (fingerprint aaaaaaaaaaaa then)"
    assert lines[7:] == [
        "      custom reward now: changed since this version: /r/reward.py with what it imports (code sha256 "
        "cccccccccccc then, dddddddddddd now)",
        "      reward source: its text was not kept (recorded before reward specs kept it), only its code sha256"]
    assert format_lineage(record(None, None)).splitlines()[2:] == [  # (a built-in reward; nothing recorded)
        "   data: step load_ppo_config [completed] - ...", "      train_files: /d/train.parquet",
        "-> reward: step define_reward [completed] - ...", "      reward_sha256: 5e"]


def test_what_stops_a_file_being_read_or_parsed_is_shown_whole_and_relative_data_paths_say_where_they_were_found():
    """Only hex digests are cut to 12 digits: "not Python (SyntaxError)" and "unreadable (Permission denied)" are
    shown as they are. A data path recorded relative says against which directory it was checked."""
    from rlhf_core.pipeline.lineage import format_lineage

    data = {"files": ["/w/outputs/train.parquet", "/w/outputs/val.parquet"], "recorded": "a" * 64,
            "resolved_against": "/w", "status": "unreadable", "unreadable": {"/w/outputs/val.parquet":
                                                                             "Permission denied"}}
    reward = {"path": "/r/reward.py", "status": "changed since", "source_kept": True, "added": ["/r/new.py"],
              "code": {"recorded": "e" * 64, "status": "changed since", "now": "not Python (SyntaxError)"},
              "files": [{"path": "/r/reward.py", "recorded": "c" * 64, "status": "changed since", "now": "d" * 64},
                        {"path": "/r/grading.py", "recorded": "f" * 64, "status": "unreadable",
                         "now": "unreadable (Permission denied)"},
                        {"path": "/r/old.py", "recorded": "b" * 64, "status": "missing"}],
              "source_in": {"artifact": "reward_spec", "id": "77", "version": "4", "key": "custom_source"}}
    record = {"model": "m", "version": "2", "stage": None, "run": "r-2", "pipeline": "rlhf_ppo_pipeline",
              "run_status": "completed", "run_id": "id-2", "model_version_metadata": {},
              "chain": [_link("data", "load_ppo_config", {}), _link("reward", "define_reward", {})],
              "data_check": data, "reward_check": reward}
    assert format_lineage(record).splitlines()[2:] == [
        "   data: step load_ppo_config [completed] - ...",
        "      data files now: /w/outputs/val.parquet unreadable (Permission denied) (fingerprint aaaaaaaaaaaa then)",
        "      data paths: recorded relative, resolved against the current directory /w (run rlhf-lineage from the "
        "directory the pipeline ran in to check the files it read)",
        "-> reward: step define_reward [completed] - ...",
        "      custom reward now: changed since this version: /r/reward.py with what it imports (code sha256 "
        "eeeeeeeeeeee then, not Python (SyntaxError) now)",
        "        /r/reward.py: changed since (file sha256 cccccccccccc then, dddddddddddd now)",
        "        /r/grading.py: unreadable (Permission denied) (file sha256 ffffffffffff then)",
        "        /r/old.py: missing (file sha256 bbbbbbbbbbbb then)",
        "        /r/new.py: read now, not then (a module it imports is found there now)",
        "      reward source: the text of its files (3) is kept in artifact reward_spec v4 id 77 under "
        "'custom_source': rlhf-lineage --model m --version 2 --reward-source prints them",
    ]


class _OneRun:
    """A store holding one model version of model ``m``, made by one run of load_ppo_config, validate_data and
    define_reward, whose metadata and reward spec are given; artifacts load what they were given."""

    def __init__(self, train_files, fingerprint, spec):
        from types import SimpleNamespace as NS

        def artifact(name, id_, value):
            return NS(artifact=NS(name=name), id=id_, version="4", type="DataArtifact", uri=f"/store/{id_}",
                      load=lambda: value)

        self.artifacts = {"77": artifact("reward_spec", "77", spec)}

        def step(metadata, outputs=None):
            return NS(status="completed", regular_inputs={}, outputs=outputs or {}, run_metadata=metadata)

        self.run = NS(name="r-2", id="id-2", status="completed", pipeline=NS(name="rlhf_ppo_pipeline"), steps={
            "load_ppo_config": step({"train_files": train_files, "val_files": None}),
            "validate_data": step({"dataset_fingerprint": fingerprint}),
            "define_reward": step({"reward_sha256": spec["sha256"]}, {"reward_spec": [self.artifacts["77"]]}),
        })
        self.version = NS(name="2", number=2, stage=None, run_metadata={"pipeline_run_id": "id-2"},
                          pipeline_run_ids={})

    def get_model_version(self, model, version):
        assert (model, version) == ("m", 2)
        return self.version

    def get_pipeline_run(self, run_id):
        assert run_id == "id-2"
        return self.run

    def get_artifact_version(self, artifact_id):
        return self.artifacts[artifact_id]


def test_lineage_of_an_older_version_says_its_data_path_holds_other_bytes_now_and_prints_its_reward(tmp_path,
                                                                                                   capsys):
    """Version 2 trained on train.parquet, which a later run overwrote, with a reward file edited since: the
    chain says so, and --reward-source prints the reward file as version 2 had it."""
    import hashlib

    from rlhf_core.data.validation import splits_fingerprint
    from rlhf_core.pipeline.lineage import custom_reward_source

    train, reward = tmp_path / "train.parquet", tmp_path / "reward.py"
    train.write_bytes(b"version 2's rows")
    reward.write_text("def compute_score(*args):\n    return 1.0\n")
    spec = {"kind": "custom", "custom_path": str(reward), "functions": {}, "sha256": "5e",
            "custom_source": custom_reward_source(reward)}
    store = _OneRun(str(train), splits_fingerprint([train], []), spec)
    train.write_bytes(b"a later run's rows")
    reward.write_text("def compute_score(*args):\n    return 0.0\n")
    assert cli.lineage(["--model", "m", "--version", "2"], client=store) == 0
    text = capsys.readouterr().out
    assert "      data files now: changed since this version: the paths hold other bytes" in text
    then = hashlib.sha256(b"def compute_score(*args):\n    return 1.0\n").hexdigest()[:12]
    now = hashlib.sha256(b"def compute_score(*args):\n    return 0.0\n").hexdigest()[:12]
    assert f"      custom reward now: changed since this version: {reward} with what it imports\n" in text
    assert f"        {reward}: changed since (file sha256 {then} then, {now} now)\n" in text
    assert "under 'custom_source': rlhf-lineage --model m --version 2 --reward-source prints them" in text
    assert cli.lineage(["--model", "m", "--version", "2", "--json"], client=store) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["data_check"]["status"], record["reward_check"]["status"]) == ("changed since", "changed since")
    assert cli.lineage(["--model", "m", "--version", "2", "--reward-source"], client=store) == 0
    assert capsys.readouterr().out == f"# ==> {reward} <==\ndef compute_score(*args):\n    return 1.0\n"
    del spec["custom_source"]  # a spec from before the text was kept
    assert cli.lineage(["--model", "m", "--version", "2", "--reward-source"], client=store) == 2
    assert f"keeps only the sha256 of {reward}'s code, not its text" in capsys.readouterr().err


def test_after_a_later_run_overwrites_a_versions_data_path_its_lineage_says_the_data_changed(tmp_path, capsys):
    """Version 1 trains on train.parquet; then new data is written to the same path, as a retraining flow does:
    version 1's chain still names the path, and says that it holds other bytes now."""
    import shutil

    from test_pipeline import run_pipeline, tiny_setup

    train = tmp_path / "train.parquet"
    shutil.copy(tiny_setup().train_file, train)
    run_pipeline("tiny-overwritten-data", train_file=train)
    shutil.copy(tiny_setup().new_train_file, train)
    assert cli.lineage(["--model", "tiny-overwritten-data", "--version", "1"], client=zenml_client()) == 0
    text = capsys.readouterr().out
    assert f"      train_files: {train}" in text
    assert "      data files now: changed since this version: the paths hold other bytes" in text


def _deny_reading(monkeypatch, *paths):
    """Opening any of ``paths`` fails as a file of another user's does (chmod alone stops no root user)."""
    import builtins
    import errno
    import io

    denied, real_open = {str(path) for path in paths}, builtins.open

    def guarded_open(file, *args, **kwargs):
        if str(file) in denied:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(io, "open", guarded_open)  # (what Path.read_bytes opens with)


def test_a_data_or_reward_file_that_cannot_be_read_is_said_unreadable_and_the_reward_source_reads_no_data(
        tmp_path, monkeypatch, capsys):
    """A recorded file that is there but cannot be read (its permissions changed) is reported with the reason;
    --reward-source, which needs no data, neither reads nor fingerprints the data files."""
    from rlhf_core.data import validation
    from rlhf_core.data.validation import splits_fingerprint
    from rlhf_core.pipeline.lineage import check_data_files, check_reward_file, custom_reward_source

    train, val, reward = tmp_path / "train.parquet", tmp_path / "val.parquet", tmp_path / "reward.py"
    train.write_bytes(b"version 2's rows")
    val.write_bytes(b"its validation rows")
    reward.write_text("def compute_score(*args):\n    return 1.0\n")
    validated = splits_fingerprint([train], [val])
    spec = {"kind": "custom", "custom_path": str(reward), "functions": {}, "sha256": "5e",
            "custom_source": custom_reward_source(reward)}
    store = _OneRun(str(train), validated, spec)
    _deny_reading(monkeypatch, train)
    assert check_data_files(str(train), str(val), validated) == {
        "files": [str(train), str(val)], "recorded": validated, "status": "unreadable",
        "unreadable": {str(train): "Permission denied"}}
    assert cli.lineage(["--model", "m", "--version", "2"], client=store) == 0
    assert f"      data files now: {train} unreadable (Permission denied) (fingerprint {validated[:12]} then)\n" \
        in capsys.readouterr().out

    printed = f"# ==> {reward} <==\ndef compute_score(*args):\n    return 1.0\n"
    assert cli.lineage(["--model", "m", "--version", "2", "--reward-source"], client=store) == 0
    assert capsys.readouterr().out == printed

    def no_data(*args, **kwargs):
        raise AssertionError("the data files were fingerprinted")

    monkeypatch.undo()  # the data readable again: still not fingerprinted
    monkeypatch.setattr(validation, "splits_fingerprint", no_data)
    monkeypatch.setattr(validation, "fingerprint", no_data)
    assert cli.lineage(["--model", "m", "--version", "2", "--reward-source"], client=store) == 0
    assert capsys.readouterr().out == printed

    _deny_reading(monkeypatch, reward)
    check = check_reward_file(spec)
    assert (check["status"], check["files"][0]["status"], check["files"][0]["now"]) == (
        "unreadable", "unreadable", "unreadable (Permission denied)")


def test_a_change_to_a_module_the_reward_imports_reads_as_a_changed_reward_and_every_file_is_kept(tmp_path,
                                                                                                   monkeypatch, capsys):
    """The reward's code hash covers the modules it imports from beside it: their text is kept and checked too,
    a module it finds only now (one that shadows another) counts as a change, and --reward-source prints every
    file kept, each under its path."""
    import hashlib

    from rlhf_core.pipeline.lineage import check_reward_file, custom_reward_source
    from rlhf_core.pipeline.reward_code import user_code

    monkeypatch.chdir(tmp_path)
    grading, reward = tmp_path / "grading.py", tmp_path / "reward.py"
    grading_text = "def score(text):\n    return 1.0 if text.strip() else 0.0\n"
    reward_text = ("from grading import score\ntry:\n    import extras  # noqa\nexcept ImportError:\n    extras = None\n"
                   "\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                   "    return score(solution_str)\n")
    grading.write_text(grading_text)
    reward.write_text(reward_text)
    code = hashlib.sha256(user_code(reward)[0].encode()).hexdigest()  # (define_reward's source_sha256)
    spec = {"kind": "custom", "custom_path": str(reward), "custom_source": custom_reward_source(reward),
            "functions": {"compute_score": {"source_sha256": code}}, "sha256": "5e"}
    assert [(f["path"], f["sha256"], f["text"]) for f in spec["custom_source"]["files"]] == [
        (str(reward), hashlib.sha256(reward_text.encode()).hexdigest(), reward_text),
        (str(grading), hashlib.sha256(grading_text.encode()).hexdigest(), grading_text)]
    assert check_reward_file(spec)["status"] == "unchanged"

    grading.write_text("def score(text):\n    return 0.0\n")  # every answer scores 0 now
    check = check_reward_file(spec)
    assert check["status"] == "changed since"
    assert [(f["path"], f["status"]) for f in check["files"]] == [(str(reward), "unchanged"),
                                                                  (str(grading), "changed since")]
    assert check["code"]["status"] == "changed since"
    no_text = {key: value for key, value in spec.items() if key != "custom_source"}  # a spec keeping no text
    assert check_reward_file(no_text)["status"] == "changed since"

    grading.write_text(grading_text)
    (tmp_path / "extras.py").write_text("BONUS = 1\n")  # the reward's `import extras` finds this file now
    check = check_reward_file(spec)
    assert (check["status"], check["added"]) == ("changed since", [str(tmp_path / "extras.py")])
    assert [f["status"] for f in check["files"]] == ["unchanged", "unchanged"]
    (tmp_path / "extras.py").unlink()

    assert cli.lineage(["--model", "m", "--version", "2", "--reward-source"],
                       client=_OneRun(None, None, spec)) == 0
    assert capsys.readouterr().out == f"# ==> {reward} <==\n{reward_text}\n# ==> {grading} <==\n{grading_text}"


def test_a_module_found_in_the_directory_the_reward_was_recorded_from_is_found_there_from_anywhere(tmp_path,
                                                                                                  monkeypatch):
    """A module the reward imports may sit in the directory the pipeline ran in rather than beside the reward: a
    check made later from another directory still reads it there, and finds the reward unchanged."""
    import hashlib

    from rlhf_core.pipeline.lineage import check_reward_file, custom_reward_source
    from rlhf_core.pipeline.reward_code import user_code

    project, rewards, elsewhere = tmp_path / "project", tmp_path / "rewards", tmp_path / "elsewhere"
    for folder in (project, rewards, elsewhere):
        folder.mkdir()
    (project / "grading.py").write_text("def score(text):\n    return 1.0\n")
    reward = rewards / "reward.py"
    reward.write_text("from grading import score\n\ndef compute_score(*args):\n    return score(args[1])\n")
    monkeypatch.chdir(project)
    code = hashlib.sha256(user_code(reward)[0].encode()).hexdigest()
    spec = {"kind": "custom", "custom_path": str(reward), "custom_source": custom_reward_source(reward),
            "functions": {"compute_score": {"source_sha256": code}}}
    assert [f["path"] for f in spec["custom_source"]["files"]] == [str(reward), str(project / "grading.py")]
    monkeypatch.chdir(elsewhere)
    check = check_reward_file(spec)
    assert (check["status"], check["code"]["status"]) == ("unchanged", "unchanged")


def test_data_paths_are_recorded_absolute_and_a_relative_one_from_before_says_where_it_was_looked_for(tmp_path,
                                                                                                      monkeypatch):
    """The demo configs name their data relative to the project (outputs/data/...): recorded as given, a check
    from another directory would find them missing, or another checkout's files there changed."""
    from rlhf_core.data.validation import splits_fingerprint
    from rlhf_core.pipeline.lineage import check_data_files, recorded_paths

    project, home = tmp_path / "project", tmp_path / "home"
    (project / "outputs" / "data").mkdir(parents=True)
    home.mkdir()
    train = project / "outputs" / "data" / "train.parquet"
    train.write_bytes(b"rows")
    monkeypatch.chdir(project)
    monkeypatch.setenv("HOME", str(home))
    assert recorded_paths("outputs/data/train.parquet") == str(train)
    assert recorded_paths(["outputs/data/../data/train.parquet", "~/val.parquet"]) == [str(train),
                                                                                         str(home / "val.parquet")]
    assert recorded_paths(None) is None
    validated = splits_fingerprint([train], None)
    monkeypatch.chdir(home)  # rlhf-lineage run from the home folder
    assert check_data_files(str(train), None, validated)["status"] == "unchanged"
    assert check_data_files("outputs/data/train.parquet", None, validated) == {
        "files": [str(home / "outputs" / "data" / "train.parquet")], "recorded": validated,
        "resolved_against": str(home), "status": "missing",
        "missing": [str(home / "outputs" / "data" / "train.parquet")]}


def test_load_ppo_config_records_the_data_files_by_absolute_path(tmp_path, monkeypatch):
    import os
    from types import SimpleNamespace as NS

    from test_pipeline import tiny_setup

    from steps import load_ppo_config as module

    setup = tiny_setup()
    logged = {}
    monkeypatch.setattr(module, "get_step_context",
                        lambda: NS(pipeline_run=NS(snapshot=NS(step_configurations={}))))
    monkeypatch.setattr(module, "log_metadata", logged.update)
    monkeypatch.chdir(setup.root)
    train, val = os.path.relpath(setup.train_file, setup.root), os.path.relpath(setup.val_file, setup.root)
    assert not os.path.isabs(train)
    config = module.load_ppo_config.entrypoint(str(setup.trainer_config), [], train, [val])
    assert (logged["train_files"], logged["val_files"]) == (str(setup.train_file), [str(setup.val_file)])
    assert config["data"]["train_files"] == train  # (the trainer's config as given)
