"""Scheduled retraining in the foreground, for stacks whose orchestrator does not schedule.

    rlhf-schedule --cron "0 3 * * *" -c configs/retrain_demo.yaml      # every night at 03:00, until Ctrl-C
    rlhf-schedule --cron "0 3 * * *" -c configs/retrain_demo.yaml --print-crontab   # the crontab line instead

Each run is ``zenml pipeline run <pipeline> -c <config>`` in a child process, started by an
APScheduler ``BlockingScheduler``. A job never overlaps itself (``max_instances=1``): a fire time
that arrives while the previous run is still going is skipped and logged, and missed fire times
are coalesced into one. On orchestrators that schedule (Kubernetes, Kubeflow) put a ``schedule:``
block in the run config instead; see ``configs/retrain_demo.yaml``.

A Ctrl-C reaches the run under way from the terminal (it is in the scheduler's process group) and stops the
schedule. A SIGTERM (``kill``, a service manager stopping it) is sent to the scheduler alone: it starts no run
after it, passes it on to the run under way (whose training step then saves its step and stops) and waits for
that run to end, then raises :class:`ScheduleTerminated`. Under systemd, ``KillMode=mixed`` sends it to the
scheduler alone; a second SIGTERM is passed on too, which stops the run at once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from rlhf_core.interrupts import Terminated

if __name__ == "__main__":  # run as `rlhf schedule` is (rlhf_core.cli), where its command's module imports
    # ZenML, so that a Ctrl-C in the command's first seconds ends it with one line and exit 130, not a
    # traceback
    from rlhf_core.cli import _run

    sys.exit(_run("schedule", None, "python -m rlhf_core.pipeline.schedule"))

RETRAIN_PIPELINE = "pipelines.retrain.rlhf_retrain_pipeline"

logger = logging.getLogger("rlhf_core.pipeline.schedule")


def zenml_executable() -> str:
    """The ``zenml`` command of this environment (next to the running python), else the one on PATH."""
    beside = Path(sys.executable).with_name("zenml")
    return str(beside) if beside.is_file() else (shutil.which("zenml") or "zenml")


def pipeline_command(config: str | Path, pipeline: str = RETRAIN_PIPELINE) -> list[str]:
    return [zenml_executable(), "pipeline", "run", pipeline, "-c", str(config)]


# the runs :func:`run_pipeline` has under way, which a SIGTERM to the scheduler is passed on to, and whether one
# came (no run starts after it)
_children: set[subprocess.Popen] = set()
_children_lock = threading.Lock()
_stopping = False


def _pass_on(signum: int) -> list[subprocess.Popen]:
    """Send ``signum`` to each run under way and let no other start; the runs it was sent to."""
    global _stopping
    with _children_lock:
        _stopping = True
        children = list(_children)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)
    return children


class ScheduleTerminated(Terminated):
    """A SIGTERM stopped the schedule (:func:`serve`): ``finished`` runs had ended before it (their records),
    and ``stopped`` holds the exit status of each run that was under way, passed the signal, and has ended."""

    def __init__(self, finished: list[dict[str, Any]], stopped: list[int | None]):
        super().__init__("SIGTERM")
        self.finished, self.stopped = finished, stopped


def run_pipeline(config: str | Path, pipeline: str = RETRAIN_PIPELINE, cwd: str | Path | None = None) -> int:
    """One run of ``pipeline`` with run config ``config`` in a child process; its exit status, 0.

    Raises RuntimeError when the run fails (a non-zero exit status), so that a schedule records a failure."""
    command = pipeline_command(config, pipeline)
    with _children_lock:
        if _stopping:  # a SIGTERM came as this run was about to start: it would not be passed on
            raise RuntimeError(f"{shlex.join(command)} not started: the schedule is stopping (SIGTERM)")
        logger.info("starting: %s", shlex.join(command))
        child = subprocess.Popen(command, cwd=cwd)
        _children.add(child)
    try:
        status = child.wait()
    finally:
        with _children_lock:
            _children.discard(child)
    if status != 0:
        raise RuntimeError(f"{shlex.join(command)} exited with status {status}; its output says why")
    return status


#: what crontab reads in its minute, hour and day-of-month fields: numbers, ``*``, ranges, steps, lists
CRON_NUMBERS = re.compile(r"(\*|\d+(-\d+)?)(/\d+)?(,(\*|\d+(-\d+)?)(/\d+)?)*")

# crontab's day-of-week names by number; 7 is Sunday again
CRON_WEEKDAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")


def _weekday_number(token: str, field: str) -> int:
    """Crontab day ``token`` (0-7 or a name) as 0-7."""
    name = token.lower()
    if name in CRON_WEEKDAYS:
        return CRON_WEEKDAYS.index(name)
    if token.isdigit() and int(token) <= 7:
        return int(token)
    raise ValueError(f"day of week {token!r} in {field!r}: use 0-7 (0 and 7 are Sunday) or sun, mon, ... sat")


def crontab_weekdays(field: str) -> str:
    """The crontab day-of-week ``field`` written as day names, which APScheduler 3 reads as crontab does.

    APScheduler 3 numbers the days from Monday = 0 where crontab has Sunday = 0 (and 7), and its day
    names take no step and no range through Sunday; so every item is expanded to its days here:
    ``0`` -> ``sun``, ``1-5/2`` -> ``mon,wed,fri``, ``*/2`` -> ``sun,tue,thu,sat``; all seven -> ``*``.
    """
    days: set[int] = set()
    for item in field.split(","):
        span, slash, step_text = item.partition("/")
        if slash and not (step_text.isdigit() and int(step_text) > 0):
            raise ValueError(f"step {step_text!r} in day of week {field!r}: use a positive whole number, e.g. */2")
        if span == "*":
            first, last = 0, 6
        elif "-" in span:
            start, _, end = span.partition("-")
            first, last = _weekday_number(start, field), _weekday_number(end, field)
            if end.lower() == "sun" and first > 0:  # sun closing a range that starts later: fri-sun is 5-7
                last = 7  # (a digit 0 does not: cron refuses 6-0 as a range that runs backwards)
            if first > last:
                raise ValueError(f"range {span!r} in day of week {field!r} runs backwards: write it as a list, "
                                 "e.g. 5-6,0 for Friday to Sunday")
        elif slash:  # cron refuses a step after a single day, so a line that runs here would fail in crontab
            raise ValueError(f"step after a single day {item!r} in day of week {field!r}: give a range, e.g. 1-5/2")
        else:
            first = last = _weekday_number(span, field)
        days.update(day % 7 for day in range(first, last + 1, int(step_text or 1)))
    if len(days) == 7:
        return "*"
    return ",".join(CRON_WEEKDAYS[day] for day in sorted(days))


def _cron_trigger(cron: str, timezone: Any = None):
    from apscheduler.triggers.combining import OrTrigger
    from apscheduler.triggers.cron import CronTrigger

    fields = cron.split()
    if len(fields) != 5:
        raise ValueError(f"{len(fields)} field(s), crontab has 5")
    minute, hour, day, month, weekday = fields
    day_of_week = crontab_weekdays(weekday)

    def trigger(day: str, day_of_week: str) -> CronTrigger:
        return CronTrigger(minute=minute, hour=hour, day=day, month=month, day_of_week=day_of_week, timezone=timezone)

    for name, value in (("minute", minute), ("hour", hour), ("day of month", day)):
        if not CRON_NUMBERS.fullmatch(value):  # APScheduler reads more ("last", "L"), which cron refuses
            raise ValueError(f"{name} {value!r}: crontab takes numbers, *, ranges (1-5), steps (*/2) and lists (1,15)")
    if day.startswith("*") or weekday.startswith("*"):
        made = trigger(day, day_of_week)
    else:  # both restricted: crontab fires on either ("0 3 1 * mon": the 1st and every Monday), APScheduler on both
        made = OrTrigger([trigger(day, "*"), trigger("*", day_of_week)])
    # a job at fixed times (neither minute nor hour a wildcard) runs once where the clocks go back and its time comes
    # twice, as cron runs it; a wildcard one (hourly, */15) runs in both copies of the hour, as cron's does
    return made if minute.startswith("*") or hour.startswith("*") else _once_at_repeated_time_class()(made)


@functools.cache
def _once_at_repeated_time_class():
    """The trigger class below, made once APScheduler is imported (this module imports it only when it schedules)."""
    from apscheduler.triggers.base import BaseTrigger

    class OnceAtRepeatedTime(BaseTrigger):
        """``trigger``, whose next fire time is skipped where its clock time is not past the previous one's (the hour
        the clocks go back: 02:30+02:00, then 02:30+01:00; with 0,30 2, 02:00+01:00 after 02:30+02:00 too), as cron
        holds a fixed-time job back until the clock passes the latest time it ran."""

        def __init__(self, trigger):
            self.trigger = trigger

        def get_next_fire_time(self, previous_fire_time, now):
            fire = self.trigger.get_next_fire_time(previous_fire_time, now)
            while fire is not None and previous_fire_time is not None \
                    and fire.replace(tzinfo=None) <= previous_fire_time.replace(tzinfo=None):
                fire = self.trigger.get_next_fire_time(fire, fire)
            return fire

        def __str__(self):
            return str(self.trigger)

    return OnceAtRepeatedTime


def local_timezone():
    """The time zone the schedule's times are read in: ``TZ``, else the system's. Raises ValueError where it
    cannot be read (``TZ`` not a zone name), as APScheduler would raise a KeyError at the first trigger."""
    from tzlocal import get_localzone

    try:
        return get_localzone()
    except (LookupError, ValueError) as exc:  # (zoneinfo's ZoneInfoNotFoundError is a KeyError)
        where = f"TZ={os.environ['TZ']!r}" if os.environ.get("TZ") else "the system's /etc/localtime"
        detail = " ".join(str(exc.args[0] if exc.args else exc).split())
        raise ValueError(f"the local time zone ({where}) cannot be read ({detail}); set TZ to a zone name, e.g. "
                         "TZ=Europe/Paris or TZ=UTC") from None


def make_trigger(cron: str | None = None, every: float | None = None, timezone: Any = None):
    """An APScheduler trigger from a 5-field crontab expression (firing when cron would) or an interval in
    seconds; ``timezone`` defaults to the local one."""
    from apscheduler.triggers.interval import IntervalTrigger

    if (cron is None) == (every is None):
        raise ValueError("give exactly one of a cron expression or an interval in seconds")
    timezone = timezone or local_timezone()
    if every is not None:
        if not (math.isfinite(every) and every > 0):
            raise ValueError(f"the interval must be a positive number of seconds, got {every}")
        try:
            return IntervalTrigger(seconds=every, timezone=timezone)
        except OverflowError:
            raise ValueError(f"the interval of {every:g} s is longer than a date can reach") from None
    try:
        trigger = _cron_trigger(cron, timezone)
    except ValueError as exc:
        raise ValueError(f"invalid cron expression {cron!r} (minute hour day month weekday, e.g. "
                         f"'0 3 * * *'): {exc}") from exc
    if trigger.get_next_fire_time(None, datetime.now().astimezone()) is None:  # crontab takes it, and runs nothing
        raise ValueError(f"cron expression {cron!r} never fires: no date has that day of that month")
    return trigger


#: The environment that decides which ZenML store and repository a run uses (not its credentials, which do not
#: belong in a crontab: a store that needs them is logged into for the user cron runs as)
STORE_VARIABLES = ("ZENML_CONFIG_PATH", "ZENML_REPOSITORY_PATH", "ZENML_STORE_URL")


def crontab_line(cron: str, config: str | Path, pipeline: str = RETRAIN_PIPELINE, repo: str | Path | None = None,
                 log_file: str | Path | None = None) -> str:
    """A crontab entry running the pipeline from ``repo``; ``flock -n`` keeps two runs from overlapping."""
    make_trigger(cron=cron, timezone="UTC")  # reject a bad expression here rather than in cron's mail (cron reads
    # the times in its own time zone, not this shell's)
    repo = Path(repo or Path.cwd()).resolve()
    log_file = Path(log_file) if log_file else repo / "outputs" / "logs" / "retrain.log"
    lock = repo / "outputs" / ".retrain.lock"
    # cron starts jobs with an almost empty environment: the ZenML store this shell uses goes with the line
    # (paths made absolute: the line runs from the repository)
    store = [f"{key}={os.path.abspath(value) if key.endswith('_PATH') else value}"
             for key in STORE_VARIABLES if (value := os.environ.get(key))]
    command = shlex.join([*(["env", *store] if store else []), "flock", "-n", str(lock),
                          *pipeline_command(config, pipeline)])
    command = f"cd {shlex.quote(str(repo))} && mkdir -p {shlex.quote(str(log_file.parent))} && {command} " \
              f">> {shlex.quote(str(log_file))} 2>&1"
    # cron cuts the command at an unescaped % (the rest becomes its stdin) and drops the backslash of \%
    escaped = command.replace("%", r"\%")
    return f"{cron} {escaped}"


def serve(runner: Callable[[], Any], cron: str | None = None, every: float | None = None,
          max_runs: int | None = None, run_now: bool = False) -> list[dict[str, Any]]:
    """Call ``runner`` on the schedule, in the foreground, until Ctrl-C (or ``max_runs`` runs).

    Returns one record per run: start and end times and the runner's result (or error). A SIGTERM (under
    :func:`rlhf_core.cli.sigterm_as_interrupt`) starts no run after it, is passed on to the run under way
    (:func:`run_pipeline`'s child), which is waited for, and raises :class:`ScheduleTerminated`.
    """
    from apscheduler.events import EVENT_JOB_MAX_INSTANCES
    from apscheduler.schedulers import SchedulerNotRunningError
    from apscheduler.schedulers.blocking import BlockingScheduler

    global _stopping

    trigger = make_trigger(cron, every)
    scheduler = BlockingScheduler()
    runs: list[dict[str, Any]] = []
    lock = threading.Lock()
    idle = threading.Event()  # set while no run is under way
    idle.set()
    _stopping = False

    def job() -> None:
        idle.clear()
        try:
            run_job()
        finally:
            idle.set()

    def run_job() -> None:
        record: dict[str, Any] = {"started": time.time()}
        logger.info("scheduled run %d starting", len(runs) + 1)
        try:
            record["result"] = runner()
        except Exception as exc:  # noqa: BLE001 - a failed run is logged; the schedule goes on
            record["error"] = f"{type(exc).__name__}: {exc}"
            logger.error("scheduled run failed: %s", record["error"])
        record["ended"] = time.time()
        with lock:
            runs.append(record)
            done = max_runs is not None and len(runs) >= max_runs
        logger.info("scheduled run %d %s in %.1f s", len(runs), "failed" if "error" in record else "finished",
                    record["ended"] - record["started"])
        if done:
            scheduler.shutdown(wait=False)

    def skipped(event) -> None:
        logger.warning("fire time %s skipped: the previous run is still going", event.scheduled_run_times)

    scheduler.add_listener(skipped, EVENT_JOB_MAX_INSTANCES)
    # an explicit next_run_time=None would add the job paused, so it is only passed to run at once
    first = {"next_run_time": datetime.now().astimezone()} if run_now else {}
    scheduler.add_job(job, trigger, id="retrain", max_instances=1, coalesce=True, misfire_grace_time=None, **first)
    logger.info("schedule %s: %s %s (Ctrl-C stops)", cron or f"every {every} s",
                "a run now, then the next at" if run_now else "next run at",
                trigger.get_next_fire_time(None, datetime.now().astimezone()))
    try:
        scheduler.start()
    except Terminated:
        with lock:
            finished = list(runs)
        with contextlib.suppress(SchedulerNotRunningError):  # (a last run of max_runs may have stopped it)
            scheduler.shutdown(wait=False)  # no fire time starts a run after this
        children = _pass_on(signal.SIGTERM)
        while True:  # the run under way ends as its own SIGTERM handling says (a training step saves, then stops)
            try:
                idle.wait()
                break
            except KeyboardInterrupt as again:  # a second SIGTERM is passed on too (the run stops at once); a
                if isinstance(again, Terminated):  # Ctrl-C reached it from the terminal already
                    _pass_on(signal.SIGTERM)
        raise ScheduleTerminated(finished, [child.poll() for child in children]) from None
    except (KeyboardInterrupt, SystemExit):
        logger.info("stopped after %d run(s)", len(runs))
    return runs
