"""What a verl user brings over: the environment and command-line settings of verl's own runs, taken or named."""

from __future__ import annotations

import json

import pytest

from rlhf_core.training.tracking import Tracking


@pytest.mark.parametrize("variable", ["VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT"])
def test_verls_file_logger_variables_are_named_with_where_the_records_go(tmp_path, monkeypatch, capsys, variable):
    # verl's file logger writes to $VERL_FILE_LOGGER_PATH (else $VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl);
    # here the records stay in <default_local_dir>/metrics.jsonl, and a verl user looking there is told so
    elsewhere = tmp_path / "verl_logs" / ("metrics.jsonl" if variable.endswith("PATH") else "")
    monkeypatch.setenv(variable, str(elsewhere))
    local_dir = tmp_path / "run"
    with Tracking(["file"], "verl_examples", "gsm8k", local_dir) as tracking:
        tracking.log({"actor/pg_loss": 0.5}, step=1)
    err = capsys.readouterr().err
    assert f"notice: {variable}={elsewhere} (verl's file logger) is not read here" in err
    assert f"writes {local_dir / 'metrics.jsonl'}" in err
    assert [json.loads(line) for line in (local_dir / "metrics.jsonl").read_text().splitlines()] == \
        [{"step": 1, "actor/pg_loss": 0.5}]
    assert not (tmp_path / "verl_logs").exists()


def test_no_notice_without_verls_variables(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.delenv("VERL_FILE_LOGGER_ROOT", raising=False)
    with Tracking(["file"], "verl_examples", "gsm8k", tmp_path) as tracking:
        tracking.log({"actor/pg_loss": 0.5}, step=1)
    assert "VERL_FILE_LOGGER" not in capsys.readouterr().err


def test_a_verl_command_with_hydras_run_folder_trains_and_writes_verls_names(workspace, tmp_path, monkeypatch, capsys):
    # a verl command as verl users write it: Hydra's run folder on the command line, verl's file-logger variable,
    # verl's logger list in Hydra's quoting and +key for a key verl's older tree lacks
    from rlhf_core.cli.train import ppo

    out = tmp_path / "ckpt"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "verl_metrics.jsonl"))
    status = ppo(workspace.overrides(out, f"hydra.run.dir={tmp_path / 'hydra'}", "+trainer.val_before_train=False",
                                     "trainer.logger=['console','file']", "trainer.total_training_steps=1",
                                     "trainer.save_freq=1", "trainer.test_freq=1"))
    err = capsys.readouterr().err
    assert status == 0, err
    assert f"notice: hydra.run.dir={tmp_path / 'hydra'} is Hydra's own setting" in err
    assert "notice: VERL_FILE_LOGGER_PATH=" in err
    record = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert record["step"] == 1
    assert {"actor/pg_loss", "critic/vf_loss", "response_length/mean", "timing_s/gen"} <= set(record)
    assert any(key.startswith("val-core/") for key in record)
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (out / "global_step_1" / "actor").is_dir() and (out / "global_step_1" / "critic").is_dir()
    assert not (tmp_path / "hydra").exists() and not (tmp_path / "verl_metrics.jsonl").exists()


@pytest.mark.parametrize(("given", "taken"), [
    ("trainer.logger=['console','tracking']", ["console", "wandb"]),
    ("trainer.logger=tracking", ["wandb"]),
    ("trainer.logger=[tracking,wandb]", ["wandb"]),  # (wandb once, not two runs of it)
])
def test_verls_deprecated_tracking_logger_is_taken_as_wandb(given, taken):
    # verl's older examples log with 'tracking', the name its Tracking class gave wandb before the rename
    from rlhf_core.config import load_config

    said = []
    assert list(load_config([given], notice=said.append).trainer.logger) == taken
    assert said == ["notice: trainer.logger: 'tracking' is verl's deprecated name of 'wandb', taken as wandb"]


@pytest.mark.parametrize(("overrides", "written", "taken"), [
    (["trainer.logger=${oc.env:RUN_LOGGER}"], None, ["wandb"]),
    (["trainer.logger=[console,'${oc.env:RUN_LOGGER}']"], None, ["console", "wandb"]),
    ([], "trainer:\n  logger: ${oc.env:RUN_LOGGER}\n", ["wandb"]),
    # a key beside it (the list item's ${..key} is trainer's), whose value is the word
    ([], "trainer:\n  project_name: tracking\n  logger: ${..project_name}\n", ["wandb"]),
    (["trainer.logger=[wandb,'${oc.env:RUN_LOGGER}']"], None, ["wandb"]),  # (wandb once)
    # the word written beside the same word through ${...}: taken as wandb, and said once (it was said twice)
    (["trainer.logger=[tracking,'${oc.env:RUN_LOGGER}']"], None, ["wandb"]),
    ([], "trainer:\n  logger: [console, tracking, '${oc.env:RUN_LOGGER}']\n", ["console", "wandb"]),
])
def test_verls_tracking_logger_an_interpolation_resolves_to_is_taken_as_wandb(overrides, written, taken, tmp_path,
                                                                              monkeypatch):
    # the written word was taken as wandb, the same word given through ${...} refused as no logger
    from rlhf_core.config import load_config

    monkeypatch.setenv("RUN_LOGGER", "tracking")
    path = None
    if written is not None:
        path = tmp_path / "run.yaml"
        path.write_text(written)
    said = []
    assert list(load_config(overrides, config_file=path, notice=said.append).trainer.logger) == taken
    assert said == ["notice: trainer.logger: 'tracking' is verl's deprecated name of 'wandb', taken as wandb"]


def test_verls_deprecated_tracking_logger_in_a_config_file_is_taken_as_wandb(tmp_path):
    from rlhf_core.config import load_config

    (tmp_path / "run.yaml").write_text("trainer:\n  logger: ['console', 'tracking']\n")
    said = []
    assert list(load_config(config_file=tmp_path / "run.yaml", notice=said.append).trainer.logger) == \
        ["console", "wandb"]
    assert said == ["notice: trainer.logger: 'tracking' is verl's deprecated name of 'wandb', taken as wandb"]
