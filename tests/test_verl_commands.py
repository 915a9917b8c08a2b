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
