"""rlhf-schedule: runs fire on the schedule, never overlap, and the crontab line is right."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

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


def test_the_first_message_says_when_the_first_run_starts(caplog):
    with caplog.at_level("INFO", logger=schedule.logger.name):
        schedule.serve(lambda: 0, every=3600, max_runs=1, run_now=True)
    assert "schedule every 3600 s: a run now, then the next at" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger=schedule.logger.name):
        schedule.serve(lambda: 0, every=0.2, max_runs=1)
    assert "schedule every 0.2 s: next run at" in caplog.text


def test_the_command_exits_1_when_a_run_it_made_failed(tmp_path, capsys, monkeypatch):
    config = tmp_path / "retrain.yaml"
    config.write_text("parameters: {}\n")
    outcomes = iter([RuntimeError("zenml exited with status 1"), 0])

    def run_pipeline(config, pipeline):
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(cli, "run_pipeline", run_pipeline)
    argv = ["--every", "0.01", "--run-now", "-c", str(config)]
    assert cli.schedule([*argv, "--max-runs", "2"]) == 1  # the first of the two failed
    assert "error: 1 of 2 scheduled runs failed" in capsys.readouterr().err
    outcomes = iter([0])
    assert cli.schedule([*argv, "--max-runs", "1"]) == 0


REPO = Path(__file__).resolve().parents[1]


def test_print_crontab(tmp_path, capsys, monkeypatch):
    config = tmp_path / "retrain.yaml"
    config.write_text(f"parameters: {{trainer_config: {REPO / 'configs' / 'ppo_demo_cpu.yaml'}}}\n")
    monkeypatch.chdir(tmp_path)
    assert cli.schedule(["--cron", "0 3 * * *", "-c", str(config), "--print-crontab"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"0 3 * * * cd {tmp_path.resolve()} && ")
    assert f"flock -n {tmp_path.resolve() / 'outputs' / '.retrain.lock'}" in line
    assert f"pipeline run pipelines.retrain.rlhf_retrain_pipeline -c {config}" in line
    assert line.endswith("retrain.log 2>&1")



def test_the_check_before_scheduling_reads_the_run_config_file_once(tmp_path, monkeypatch):
    """It read the file for its parameters, then again for its steps: section."""
    from rlhf_core.pipeline.run_config import RunConfigError, check_run_config_file

    config = tmp_path / "retrain.yaml"
    config.write_text("parameters: {}\nsteps:\n  evaluat:\n    parameters: {max_problems: 8}\n")
    reads, read_text = [], Path.read_text

    def counted(path, *args, **kwargs):
        reads.extend([path] if Path(path) == config else [])
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counted)
    with pytest.raises(RunConfigError, match="steps.evaluat is not a step of rlhf_retrain_pipeline; did you mean "
                                             "evaluate?"):
        check_run_config_file(config, "pipelines.retrain.rlhf_retrain_pipeline")
    assert len(reads) == 1

@pytest.mark.parametrize(("run_config", "told"), [
    ("parameters:\n  overrides: [trainer.total_trainig_steps=2]\n",
     "unknown config key trainer.total_trainig_steps; did you mean trainer.total_training_steps?"),
    ("parameters:\n  min_improvment: 0.01\n",
     "min_improvment is not a parameter of pipelines.retrain.rlhf_retrain_pipeline (its parameters: trainer_config, "),
    ("enable_cache: true\nparameters: {}\n", "enable_cache: true would replay earlier runs' steps"),
    ("parameters:\n  trainer_config: configs/no_such.yaml\n", "config file configs/no_such.yaml does not exist"),
    ("parameters: {}\nsteps:\n  evaluat:\n    parameters: {max_problems: 8}\n",
     "steps.evaluat is not a step of rlhf_retrain_pipeline; did you mean evaluate?"),
    ("parameters: {}\nsteps:\n  evaluate:\n    parameters: {max_problem: 8}\n",
     "steps.evaluate.parameters.max_problem is not a parameter of the step evaluate; did you mean max_problems?"),
])
def test_a_run_config_that_cannot_run_is_refused_before_anything_is_scheduled(tmp_path, capsys, monkeypatch,
                                                                             run_config, told):
    """A typo in the run config failed each scheduled run when it started (nightly, one failure a night); it is
    now told when the schedule is set up, and nothing runs or is printed for cron."""
    config = tmp_path / "retrain.yaml"
    config.write_text(run_config)
    started = []

    def run_pipeline(*args):
        started.append(args)
        raise RuntimeError("the run failed")

    monkeypatch.setattr(cli, "run_pipeline", run_pipeline)
    for argv in (["--every", "0.01", "--run-now", "--max-runs", "1"], ["--cron", "0 3 * * *", "--print-crontab"]):
        assert cli.schedule([*argv, "-c", str(config)]) == 2
        out, err = capsys.readouterr()
        assert told in err and out == ""
    assert started == []
    # the same file with the typo mended schedules (data files are not checked now: a run reads them later)
    config.write_text("parameters:\n  overrides: [trainer.total_training_steps=2]\n  train_files: later.parquet\n")
    assert cli.schedule(["--cron", "0 3 * * *", "--print-crontab", "-c", str(config)]) == 0


def test_the_schedule_check_reads_parameters_as_zenml_does(tmp_path, capsys, monkeypatch):
    """The run config's parameters are typed as ZenML types them (YAML reads 5e-2 as text, ZenML passes 0.05); with
    a remote orchestrator a trainer config only its pods hold is left to the step, as when the pipeline compiles;
    a --pipeline that does not import is said so."""
    from rlhf_core.pipeline import run_config

    config = tmp_path / "retrain.yaml"
    demo = REPO / "configs" / "ppo_demo_cpu.yaml"
    crontab = ["--cron", "0 3 * * *", "--print-crontab", "-c", str(config)]
    config.write_text(f"parameters: {{trainer_config: {demo}, alpha: 5e-2}}\n")
    assert cli.schedule(crontab) == 0
    config.write_text(f"parameters: {{trainer_config: {demo}, alpha: five percent}}\n")
    assert cli.schedule(crontab) == 2
    assert "parameter alpha='five percent' is not a <class 'float'>" in capsys.readouterr().err
    config.write_text("parameters: {trainer_config: /mnt/pod-volume/ppo.yaml}\n")
    assert cli.schedule(crontab) == 2  # the steps run here: the file must be here
    assert "config file /mnt/pod-volume/ppo.yaml does not exist" in capsys.readouterr().err
    monkeypatch.setattr(run_config, "steps_run_here", lambda: False)
    assert cli.schedule(crontab) == 0
    assert ("the trainer config /mnt/pod-volume/ppo.yaml is not on this machine: the load_ppo_config step resolves "
            "and checks it where it runs") in capsys.readouterr().err
    config.write_text(f"parameters: {{trainer_config: {demo}}}\n")
    assert cli.schedule([*crontab, "--pipeline", "pipelines.retrain.rlhf_retrain_pipline"]) == 2
    assert "error: pipeline pipelines.retrain.rlhf_retrain_pipline cannot be imported (" in capsys.readouterr().err


@pytest.mark.parametrize("cron", ["0 3 * *", "61 3 * * *", "every night"])
def test_a_bad_cron_expression_is_an_error(tmp_path, capsys, cron):
    config = tmp_path / "retrain.yaml"
    config.write_text("parameters: {}\n")
    assert cli.schedule(["--cron", cron, "-c", str(config), "--print-crontab"]) == 2
    assert "invalid cron expression" in capsys.readouterr().err


def _fire_days(cron: str, count: int) -> list[str]:
    """The next ``count`` fire times of ``cron`` from Sunday 1 June 2025, 00:00 UTC, as 'Sun 01 03:00'."""
    from datetime import datetime, timezone

    trigger = schedule.make_trigger(cron=cron, timezone=timezone.utc)
    previous, now, fires = None, datetime(2025, 6, 1, tzinfo=timezone.utc), []
    for _ in range(count):
        previous = now = trigger.get_next_fire_time(previous, now)
        fires.append(now.strftime("%a %d %H:%M"))
    return fires


# June 2025 starts on a Sunday: Sundays 1, 8, 15; Monday 2 ... Saturday 7
@pytest.mark.parametrize(("cron", "fires"), [
    ("0 3 * * 0", ["Sun 01 03:00", "Sun 08 03:00", "Sun 15 03:00"]),
    ("0 3 * * 7", ["Sun 01 03:00", "Sun 08 03:00", "Sun 15 03:00"]),
    ("0 3 * * sun", ["Sun 01 03:00", "Sun 08 03:00", "Sun 15 03:00"]),
    ("0 3 * * 1-5", ["Mon 02 03:00", "Tue 03 03:00", "Wed 04 03:00", "Thu 05 03:00", "Fri 06 03:00",
                     "Mon 09 03:00"]),
    ("0 3 * * mon-fri", ["Mon 02 03:00", "Tue 03 03:00", "Wed 04 03:00", "Thu 05 03:00", "Fri 06 03:00",
                         "Mon 09 03:00"]),
    ("0 3 * * 1-5/2", ["Mon 02 03:00", "Wed 04 03:00", "Fri 06 03:00", "Mon 09 03:00"]),
    ("0 3 * * */2", ["Sun 01 03:00", "Tue 03 03:00", "Thu 05 03:00", "Sat 07 03:00", "Sun 08 03:00"]),
    ("30 4 * * 6,0", ["Sun 01 04:30", "Sat 07 04:30", "Sun 08 04:30", "Sat 14 04:30"]),
    ("0 3 * * 5-7", ["Sun 01 03:00", "Fri 06 03:00", "Sat 07 03:00", "Sun 08 03:00", "Fri 13 03:00"]),
    ("0 3 * * fri-sun", ["Sun 01 03:00", "Fri 06 03:00", "Sat 07 03:00", "Sun 08 03:00", "Fri 13 03:00"]),
    ("0 3 * * 0-7", ["Sun 01 03:00", "Mon 02 03:00", "Tue 03 03:00"]),
    # a day of the month and a weekday: cron fires on either, so on the 10th (a Tuesday) and on every Sunday
    ("0 3 10 * 0", ["Sun 01 03:00", "Sun 08 03:00", "Tue 10 03:00", "Sun 15 03:00"]),
    # ... unless one of them starts with '*': then a day must match both (*/2 counts from the 1st: odd Sundays)
    ("0 3 */2 * 0", ["Sun 01 03:00", "Sun 15 03:00", "Sun 29 03:00"]),
])
def test_weekdays_are_read_as_crontab_reads_them(cron, fires):
    assert _fire_days(cron, len(fires)) == fires


@pytest.mark.parametrize(("cron", "fires"), [
    # a fixed time inside the hour the clocks go back (Paris, 25 October 2026: 03:00 CEST becomes 02:00 CET) comes
    # twice; cron runs such a job once
    ("30 2 * * *", ["2026-10-25T02:30:00+02:00", "2026-10-26T02:30:00+01:00", "2026-10-27T02:30:00+01:00"]),
    # several times in that hour: none runs again until the clock passes the latest one run (02:30), so neither 02:00
    # nor 02:30 comes a second time (after 02:30+02:00 the clock shows 02:00 again, earlier than 02:30)
    ("0,30 2 * * *", ["2026-10-25T02:00:00+02:00", "2026-10-25T02:30:00+02:00", "2026-10-26T02:00:00+01:00",
                      "2026-10-26T02:30:00+01:00"]),
    ("0 2-3 * * *", ["2026-10-25T02:00:00+02:00", "2026-10-25T03:00:00+01:00", "2026-10-26T02:00:00+01:00"]),
    # a wildcard hour runs in both copies of the hour, as cron's does
    ("30 * * * *", ["2026-10-25T01:30:00+02:00", "2026-10-25T02:30:00+02:00", "2026-10-25T02:30:00+01:00",
                    "2026-10-25T03:30:00+01:00"]),
])
def test_a_fixed_time_fires_once_when_the_clocks_go_back(cron, fires):
    from datetime import datetime
    from zoneinfo import ZoneInfo

    paris = ZoneInfo("Europe/Paris")
    trigger = schedule.make_trigger(cron=cron, timezone=paris)
    previous, now, got = None, datetime(2026, 10, 25, 1, 0, tzinfo=paris), []
    for _ in fires:
        previous = now = trigger.get_next_fire_time(previous, now)
        got.append(previous.isoformat())
    assert got == fires


@pytest.mark.parametrize(("field", "names"), [
    ("0", "sun"), ("7", "sun"), ("1-5", "mon,tue,wed,thu,fri"), ("1-5/2", "mon,wed,fri"),
    ("*/2", "sun,tue,thu,sat"), ("*/3", "sun,wed,sat"), ("6,0", "sun,sat"), ("SAT-sun", "sun,sat"), ("*", "*"),
    ("0-6", "*"), ("sun-sun", "sun"), ("0-sun", "sun"), ("sun-sat", "*"), ("sun-tue", "sun,mon,tue"),
])
def test_a_crontab_weekday_field_becomes_day_names(field, names):
    assert schedule.crontab_weekdays(field) == names


@pytest.mark.parametrize(("cron", "message"), [
    ("0 3 * * 8", "day of week '8' in '8': use 0-7"),
    ("0 3 * * 5-1", "range '5-1' in day of week '5-1' runs backwards"),
    ("0 3 * * */0", "step '0' in day of week '*/0'"),
    ("0 3 * * 1/2", "step after a single day '1/2'"),
    ("0 3 * * 6-0", "range '6-0' in day of week '6-0' runs backwards"),  # a digit 0 is not 7, as in cron
])
def test_a_bad_weekday_names_the_field(cron, message):
    with pytest.raises(ValueError, match=f"invalid cron expression '{re.escape(cron)}'.*{re.escape(message)}"):
        schedule.make_trigger(cron=cron)


def test_a_percent_sign_in_a_path_is_escaped_for_cron(monkeypatch):
    monkeypatch.setattr(schedule, "zenml_executable", lambda: "zenml")
    for key in schedule.STORE_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    line = schedule.crontab_line("0 3 * * 0", "configs/retrain%v2.yaml", repo="/srv/rlhf%2/jobs")
    assert line == (r"0 3 * * 0 cd /srv/rlhf\%2/jobs && mkdir -p /srv/rlhf\%2/jobs/outputs/logs && "
                    r"flock -n /srv/rlhf\%2/jobs/outputs/.retrain.lock zenml pipeline run "
                    r"pipelines.retrain.rlhf_retrain_pipeline -c configs/retrain\%v2.yaml "
                    r">> /srv/rlhf\%2/jobs/outputs/logs/retrain.log 2>&1")


def test_the_crontab_line_carries_the_zenml_store_this_shell_uses(monkeypatch, tmp_path):
    monkeypatch.setattr(schedule, "zenml_executable", lambda: "zenml")
    for key in schedule.STORE_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("ZENML_CONFIG_PATH", "/home/me/zen config")
    monkeypatch.setenv("ZENML_STORE_URL", "sqlite:////home/me/zen.db")
    line = schedule.crontab_line("0 3 * * *", "configs/retrain_demo.yaml", repo="/srv/jobs")
    assert ("&& env 'ZENML_CONFIG_PATH=/home/me/zen config' ZENML_STORE_URL=sqlite:////home/me/zen.db "
            "flock -n /srv/jobs/outputs/.retrain.lock zenml pipeline run") in line
    monkeypatch.chdir(tmp_path)  # a relative path is the one this shell meant, wherever cron starts
    monkeypatch.setenv("ZENML_CONFIG_PATH", "zen")
    line = schedule.crontab_line("0 3 * * *", "configs/retrain_demo.yaml", repo="/srv/jobs")
    assert f"&& env ZENML_CONFIG_PATH={tmp_path / 'zen'} ZENML_STORE_URL=" in line


@pytest.mark.parametrize("cron", ["0 3 31 2 *", "0 3 30 2 *", "0 0 31 4,6,9,11 *"])
def test_a_cron_expression_that_never_fires_is_refused(tmp_path, capsys, cron):
    """No February has a 30th or 31st, no April, June, September or November a 31st: cron takes such a line and
    never runs it, and the scheduler waited for ever ("next run at None")."""
    config = tmp_path / "retrain.yaml"
    config.write_text("parameters: {}\n")
    for argv in (["--print-crontab"], ["--run-now", "--max-runs", "1"]):
        assert cli.schedule(["--cron", cron, "-c", str(config), *argv]) == 2
        assert f"cron expression '{cron}' never fires" in capsys.readouterr().err


def test_a_leap_day_schedule_fires_on_the_next_29_february():
    from datetime import datetime, timezone

    trigger = schedule.make_trigger(cron="0 3 29 2 *", timezone=timezone.utc)
    assert trigger.get_next_fire_time(None, datetime(2025, 6, 1, tzinfo=timezone.utc)) == datetime(
        2028, 2, 29, 3, tzinfo=timezone.utc)


@pytest.mark.parametrize(("cron", "field"), [("0 3 last * *", "day of month 'last'"), ("0 last * * *", "hour 'last'")])
def test_a_field_cron_does_not_read_is_refused(cron, field):
    """APScheduler reads 'last' (the month's last day) where crontab takes only numbers: the schedule would fire
    where the crontab line cron refuses would not."""
    with pytest.raises(ValueError, match=f"invalid cron expression '{re.escape(cron)}'.*{field}: crontab takes num"):
        schedule.make_trigger(cron=cron, timezone="UTC")


def test_a_local_time_zone_that_cannot_be_read_is_an_error_not_a_traceback(tmp_path, capsys, monkeypatch):
    """A TZ that is not a zone name stopped rlhf-schedule with tzlocal's KeyError; the crontab line does not depend
    on it (cron reads its times in its own zone)."""
    import tzlocal.unix

    config = tmp_path / "retrain.yaml"
    config.write_text(f"parameters: {{trainer_config: {REPO / 'configs' / 'ppo_demo_cpu.yaml'}}}\n")
    monkeypatch.setenv("TZ", "Mars/Olympus_Mons")
    monkeypatch.setattr(tzlocal.unix, "_cache_tz", None)  # read again, as a fresh process reads it
    assert cli.schedule(["--cron", "0 3 * * *", "-c", str(config), "--max-runs", "1"]) == 2
    assert ("error: the local time zone (TZ='Mars/Olympus_Mons') cannot be read (" in capsys.readouterr().err)
    assert cli.schedule(["--every", "60", "-c", str(config), "--max-runs", "1"]) == 2
    assert "set TZ to a zone name, e.g. TZ=Europe/Paris or TZ=UTC" in capsys.readouterr().err
    assert cli.schedule(["--cron", "0 3 * * *", "-c", str(config), "--print-crontab"]) == 0
    assert capsys.readouterr().out.startswith("0 3 * * * cd ")


@pytest.mark.parametrize(("every", "told"), [
    ("nan", "the interval must be a positive number of seconds, got nan"),
    ("inf", "the interval must be a positive number of seconds, got inf"),
    ("0", "the interval must be a positive number of seconds, got 0.0"),  # (APScheduler would make it 1 s)
    ("-5", "the interval must be a positive number of seconds, got -5.0"),
    ("1e300", "the interval of 1e+300 s is longer than a date can reach"),
])
def test_an_interval_that_is_not_a_number_of_seconds_is_an_error(tmp_path, capsys, every, told):
    config = tmp_path / "retrain.yaml"
    config.write_text("parameters: {}\n")
    assert cli.schedule(["--every", every, "-c", str(config), "--max-runs", "1"]) == 2
    assert f"error: {told}" in capsys.readouterr().err


@pytest.mark.parametrize("max_runs", ["0", "-1"])
def test_max_runs_below_one_is_refused_before_any_run(tmp_path, capsys, monkeypatch, max_runs):
    """--max-runs 0 or -1 ran once: the count is checked after each run."""
    config = tmp_path / "retrain.yaml"
    config.write_text("parameters: {}\n")
    started = []
    monkeypatch.setattr(cli, "run_pipeline", lambda *args: started.append(args))
    with pytest.raises(SystemExit) as stopped:
        cli.schedule(["--every", "0.01", "--run-now", "--max-runs", max_runs, "-c", str(config)])
    assert stopped.value.code == 2 and f"--max-runs {max_runs} must be >= 1" in capsys.readouterr().err
    assert started == []


def test_a_run_config_with_a_schedule_block_is_refused(tmp_path, capsys, monkeypatch):
    """A schedule: block asks the orchestrator to schedule: each run started from here failed on the local
    orchestrator ("Stack default does not support scheduling"), and on one that schedules would register one
    more schedule every time."""
    config = tmp_path / "retrain.yaml"
    config.write_text(f"parameters: {{trainer_config: {REPO / 'configs' / 'ppo_demo_cpu.yaml'}}}\n"
                      "schedule: {name: nightly-retrain, cron_expression: '0 3 * * *'}\n")
    started = []
    monkeypatch.setattr(cli, "run_pipeline", lambda *args: started.append(args))
    for argv in (["--every", "0.01", "--run-now", "--max-runs", "1"], ["--cron", "0 3 * * *", "--print-crontab"]):
        assert cli.schedule([*argv, "-c", str(config)]) == 2
        out, err = capsys.readouterr()
        assert f"error: run config {config} has a schedule: block" in err and out == ""
        assert f"`zenml pipeline run pipelines.retrain.rlhf_retrain_pipeline -c {config}` once" in err
    assert started == []
    config.write_text(f"parameters: {{trainer_config: {REPO / 'configs' / 'ppo_demo_cpu.yaml'}}}\n")
    assert cli.schedule(["--every", "0.01", "--run-now", "--max-runs", "1", "-c", str(config)]) == 0
    assert len(started) == 1


def test_a_retraining_run_config_naming_an_existing_model_version_is_refused_before_scheduling(tmp_path, capsys):
    """model.version: production made every scheduled run reuse production's version, which a skipped run then
    deleted; the pipeline refuses it as it compiles, and the schedule before any run is made."""
    config = tmp_path / "retrain.yaml"
    for version in ("production", 3):
        config.write_text(f"parameters: {{trainer_config: {REPO / 'configs' / 'ppo_demo_cpu.yaml'}}}\n"
                          f"model: {{name: demo-ppo-policy, version: {version}}}\n")
        assert cli.schedule(["--cron", "0 3 * * *", "-c", str(config), "--print-crontab"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.strip() == (
            f"error: run config {config}: model.version '{version}' names an existing version of 'demo-ppo-policy' (a "
            "stage or a number); the retraining makes a new version each run: leave model.version out of the run "
            "config, or give a name no version has, e.g. a template such as 'nightly-{date}'")
    config.write_text(f"parameters: {{trainer_config: {REPO / 'configs' / 'ppo_demo_cpu.yaml'}}}\n"
                      "model: {name: demo-ppo-policy, version: 'nightly-{date}'}\n")
    assert cli.schedule(["--cron", "0 3 * * *", "-c", str(config), "--print-crontab"]) == 0


# --- SIGTERM: a service manager or `kill` stopping the scheduler ---------------------------------------------------
# The scheduler runs in a process of its own (without the command's handler a SIGTERM would end the test run); a
# stand-in for `zenml pipeline run` takes SIGTERM as the pipeline's training step does: it finishes what it is doing,
# then exits 143. It notes each signal it gets in a file, so a signal passed on twice (a stop without saving) shows.
SCHEDULER = """\
import sys

from rlhf_core import cli
from rlhf_core.pipeline import schedule

schedule.pipeline_command = lambda config, pipeline: [sys.executable, "-c", sys.argv[1]]
sys.exit(cli._run("schedule", sys.argv[2:], "rlhf-schedule"))
"""

RUN_UNDER_WAY = """\
import os
import signal
import sys
import time


def note(line):
    with open({marks!r}, "a") as marks:
        marks.write(line + "\\n")


def stop(signum, frame):
    note(signal.Signals(signum).name)
    time.sleep(0.5)  # the step under way is finished and saved
    sys.exit(143)


signal.signal(signal.SIGTERM, stop)
note(f"started {{os.getpid()}}")
time.sleep(120)
"""


def _scheduler(tmp_path, *argv):
    """The scheduler's process (every hour, the run config checked as for a real one), its stderr's lines and its
    log's (on stdout, where ZenML's handler writes it), read as they come; the file the run under way notes its
    start and signals in."""
    import os
    import subprocess
    import sys

    config = tmp_path / "retrain.yaml"
    config.write_text(f"parameters: {{trainer_config: {REPO / 'configs' / 'ppo_demo_cpu.yaml'}}}\n")
    runner, marks = tmp_path / "scheduler.py", tmp_path / "marks.txt"
    runner.write_text(SCHEDULER)
    # its log at INFO ("Scheduler started" is one: the test pipeline's module sets WARN for the whole test process),
    # unbuffered (it goes to a pipe here, where Python holds it in a block buffer until the buffer fills)
    env = {**os.environ, "PYTHONPATH": str(REPO), "ZENML_CONFIG_PATH": str(tmp_path / "zenml"),
           "ZENML_LOGGING_VERBOSITY": "INFO", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, str(runner), RUN_UNDER_WAY.format(marks=str(marks)), "--every", "3600",
                                "-c", str(config), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=tmp_path, env=env)
    lines: list[str] = []
    logged: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
    reader.start()
    threading.Thread(target=lambda: logged.extend(process.stdout), daemon=True).start()
    return process, lines, logged, reader, marks


def _wait_for(condition, process, lines, seconds=300.0):  # (a fresh ZenML store, on a busy machine, takes minutes)
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, f"the scheduler ended with {process.returncode}: {''.join(lines)[-2000:]}"
        assert time.monotonic() < deadline, "".join(lines)[-2000:]
        time.sleep(0.05)


def test_a_sigterm_stops_the_schedule_with_one_line_and_143(tmp_path):
    """Python's default ended the scheduler at once on a SIGTERM (a service manager's stop, `kill`), with no line
    and status -15 (a shell's 143 without a word), where the other commands say what they left."""
    import signal

    process, lines, logged, reader, _ = _scheduler(tmp_path)
    try:
        _wait_for(lambda: any("Scheduler started" in line for line in logged), process, lines)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 143, "".join(lines)[-2000:]
    finally:
        process.kill()
    reader.join(timeout=10)
    assert [line.rstrip("\n") for line in lines] == [
        "interrupted by SIGTERM: rlhf-schedule stopped after 0 scheduled run(s); no run was under way"]


def test_a_sigterm_is_passed_on_once_to_the_run_under_way_which_the_scheduler_waits_for(tmp_path):
    """The SIGTERM reached the scheduler alone: it died at once and the run it had started went on without it (and,
    with the scheduler's handler alone, the scheduler would have waited for that run's end, hours on). The run is
    passed the signal once (a second would stop its training without saving), ends as it takes it, and then the
    scheduler says so and exits 143."""
    import os
    import signal

    process, lines, _, reader, marks = _scheduler(tmp_path, "--run-now")
    try:
        _wait_for(lambda: marks.is_file() and marks.read_text().startswith("started "), process, lines)
        child = int(marks.read_text().split()[1])
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 143, "".join(lines)[-2000:]
    finally:
        process.kill()
        if marks.is_file() and "SIGTERM" not in marks.read_text():  # (the stand-in left running: ended here)
            os.kill(int(marks.read_text().split()[1]), signal.SIGKILL)
    reader.join(timeout=10)
    assert marks.read_text().splitlines() == [f"started {child}", "SIGTERM"]
    assert [line.rstrip("\n") for line in lines] == [
        "interrupted by SIGTERM: rlhf-schedule stopped after 0 scheduled run(s); the run under way was passed the "
        "SIGTERM and ended with status 143 (its output above says what it saved)"]
