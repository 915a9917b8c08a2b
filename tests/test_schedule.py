"""rlhf-schedule: runs fire on the schedule, never overlap, and the crontab line is right."""

from __future__ import annotations

import threading
import time

import pytest

from rlhf_core.cli import pipeline as cli
from rlhf_core.pipeline import schedule


def test_runs_fire_on_an_interval_and_never_overlap():
    active, overlaps = [], []
    guard = threading.Lock()

    def slow_runner():  # longer than the interval: the next fire time must be skipped, not stacked
        with guard:
            overlaps.append(len(active))
            active.append(1)
        time.sleep(0.8)
        with guard:
            active.pop()
        return "ok"

    started = time.monotonic()
    runs = schedule.serve(slow_runner, every=0.5, max_runs=2)
    elapsed = time.monotonic() - started

    assert [run["result"] for run in runs] == ["ok", "ok"]
    assert overlaps == [0, 0]
    assert runs[1]["started"] >= runs[0]["ended"]
    assert elapsed < 15


def test_a_failing_run_is_recorded_and_the_schedule_goes_on():
    calls = []

    def flaky_runner():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("pipeline failed")
        return 0

    runs = schedule.serve(flaky_runner, every=0.2, max_runs=2)
    assert runs[0]["error"] == "RuntimeError: pipeline failed"
    assert runs[1]["result"] == 0


def test_a_pipeline_run_that_exits_non_zero_is_recorded_as_failed(monkeypatch, caplog):
    import sys

    statuses = iter([3, 0])  # a failed run, then a good one
    monkeypatch.setattr(schedule, "pipeline_command",
                        lambda config, pipeline: [sys.executable, "-c", f"raise SystemExit({next(statuses)})"])
    with caplog.at_level("INFO", logger=schedule.logger.name):
        runs = schedule.serve(lambda: schedule.run_pipeline("retrain.yaml"), every=0.2, max_runs=2)
    assert runs[0]["error"].startswith("RuntimeError: ") and runs[0]["error"].endswith(
        "exited with status 3; its output says why")
    assert "result" not in runs[0] and runs[1]["result"] == 0
    assert "scheduled run 1 failed" in caplog.text and "scheduled run 2 finished" in caplog.text


def test_print_crontab(tmp_path, capsys, monkeypatch):
    config = tmp_path / "retrain.yaml"
    config.write_text("parameters: {}\n")
    monkeypatch.chdir(tmp_path)
    assert cli.schedule(["--cron", "0 3 * * *", "-c", str(config), "--print-crontab"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"0 3 * * * cd {tmp_path.resolve()} && ")
    assert f"flock -n {tmp_path.resolve() / 'outputs' / '.retrain.lock'}" in line
    assert f"pipeline run pipelines.retrain.rlhf_retrain_pipeline -c {config}" in line
    assert line.endswith("retrain.log 2>&1")


@pytest.mark.parametrize("cron", ["0 3 * *", "61 3 * * *", "every night"])
def test_a_bad_cron_expression_is_an_error(tmp_path, capsys, cron):
    config = tmp_path / "retrain.yaml"
    config.write_text("parameters: {}\n")
    assert cli.schedule(["--cron", cron, "-c", str(config), "--print-crontab"]) == 2
    assert "invalid cron expression" in capsys.readouterr().err
