"""Tracking: console line and warnings, JSON-lines file, and the real tensorboard / wandb / mlflow backends."""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import socket
import sqlite3
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlhf_core.training.tracking import (
    VALID_LOGGERS,
    Tracking,
    flatten_dict,
    mlflow_tracking_uri,
    sanitize_mlflow_name,
    to_float,
)

STEP_METRICS = {
    "critic/score/mean": 0.41,
    "val-core/openai/gsm8k/acc/mean@1": 0.41,
    "actor/ppo_kl": 0.0021,
    "actor/pg_loss": -0.013,
    "critic/vf_loss": 0.21,
    "actor/entropy": 0.5,
    "response_length/mean": 37.5,
    "timing_s/step": 3.2,
    "actor/grad_norm": 1.0,
    "critic/grad_norm": 2.0,
}
KL_ADVICE = (
    "KL 0.05 > 0.02: lower actor_rollout_ref.actor.optim.lr or raise the KL coefficient "
    "(algorithm.kl_ctrl.kl_coef / actor_rollout_ref.actor.kl_loss_coef)"
)


@pytest.fixture
def no_network(monkeypatch):
    """Refuse (and record) every DNS lookup or connection that would leave this machine."""
    attempts: list[str] = []
    real_connect, real_connect_ex, real_getaddrinfo = (
        socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo)

    def remote(host) -> bool:
        if host in (None, "", "localhost"):
            return False
        try:
            return not ipaddress.ip_address(str(host).split("%")[0]).is_loopback
        except ValueError:  # a host name other than localhost
            return True

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and remote(address[0]):
            attempts.append(f"connect {address}")
            raise OSError("network access blocked in tests")
        return real_connect(self, address)

    def connect_ex(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and remote(address[0]):
            attempts.append(f"connect_ex {address}")
            return 111
        return real_connect_ex(self, address)

    def getaddrinfo(host, *args, **kwargs):
        if remote(host):
            attempts.append(f"getaddrinfo {host}")
            raise socket.gaierror("network access blocked in tests")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return attempts


def test_network_guard_blocks_remote_hosts(no_network):
    with pytest.raises(OSError):
        socket.create_connection(("203.0.113.7", 443), timeout=0.5)  # TEST-NET-3, never routed
    with pytest.raises(socket.gaierror):
        socket.getaddrinfo("api.wandb.ai", 443)
    assert no_network == ["getaddrinfo 203.0.113.7", "getaddrinfo api.wandb.ai"]
    with socket.socket() as server:  # loopback stays allowed (wandb talks to its local service)
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        socket.create_connection(server.getsockname(), timeout=2).close()
    assert len(no_network) == 2
    with socket.socket() as client, pytest.raises(OSError):  # a direct connect is caught too
        client.connect(("203.0.113.7", 443))
    assert no_network[-1] == "connect ('203.0.113.7', 443)"


# ----------------------------------------------------------------------------------------------- helpers


def test_flatten_dict():
    cfg = {"a": {"b": 1, "c": {"d": "x"}}, "e": [1, 2], "f": {}}
    assert flatten_dict(cfg) == {"a.b": 1, "a.c.d": "x", "e": [1, 2], "f": {}}
    assert flatten_dict({"a": {"b": 1}}, sep="/") == {"a/b": 1}


def test_to_float_converts_tensors_and_numpy_scalars():
    np = pytest.importorskip("numpy")
    assert to_float(torch.tensor(0.5)) == 0.5
    assert to_float(torch.tensor([2.0])) == 2.0
    assert to_float(np.float32(0.25)) == 0.25
    assert to_float(np.int64(3)) == 3.0
    assert to_float(True) == 1.0
    assert math.isnan(to_float(float("nan")))
    assert to_float(torch.ones(3)) is None
    assert to_float(np.ones(3)) is None
    assert to_float("1.5") is None
    assert to_float([1.0]) is None


def test_unknown_logger_names_the_valid_ones(tmp_path):
    with pytest.raises(ValueError) as err:
        Tracking(["console", "neptune"], "p", "e", tmp_path)
    message = str(err.value)
    assert "'neptune'" in message
    for name in ("console", "file", "tensorboard", "wandb", "mlflow"):
        assert name in message
    assert VALID_LOGGERS == ("console", "file", "tensorboard", "wandb", "mlflow")


def test_bad_warn_thresholds_rejected(tmp_path):
    with pytest.raises(ValueError, match="valid keys are: kl, grad_norm"):
        Tracking(["console"], "p", "e", tmp_path, warn_thresholds={"kL": 0.1})
    with pytest.raises(ValueError, match="positive number"):
        Tracking(["console"], "p", "e", tmp_path, warn_thresholds={"kl": -1})


def test_sanitize_mlflow_name():
    assert sanitize_mlflow_name("val-core/openai/gsm8k/acc/mean@1") == "val-core/openai/gsm8k/acc/mean_at_1"
    assert sanitize_mlflow_name("timing_s/step") == "timing_s/step"
    assert sanitize_mlflow_name("/a//b/") == "a/b"
    assert sanitize_mlflow_name("a/../b") == "a/__/b"
    assert sanitize_mlflow_name("x[0]:y") == "x_0__y"
    assert len(sanitize_mlflow_name("k" * 400)) == 250


def test_mlflow_tracking_uri(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert mlflow_tracking_uri(tmp_path) == f"sqlite:///{(tmp_path / 'mlruns' / 'mlflow.db').as_posix()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    assert mlflow_tracking_uri(tmp_path) == "http://tracking.example:5000"


# ----------------------------------------------------------------------------------------------- console


def test_console_line_and_progress_bar(tmp_path, capsys):
    with Tracking(["console"], "p", "e", tmp_path, total_steps=40) as tracker:
        tracker.log(STEP_METRICS, step=12)  # e.g. a resumed run: the bar starts at 12/40
        tracker.log({"critic/score/mean": 0.5}, step=13)
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "step 12/40 | score 0.41 | acc 0.41 | kl 0.0021 | pg_loss -0.013 | vf_loss 0.21 | entropy 0.5 "
        "| resp_len 37.5 | 3.2s",
        "step 13/40 | score 0.5",
    ]
    # tqdm bar on stderr (stdout keeps only the lines): description, position/total, elapsed<ETA
    assert "training:" in err and "training:" not in out
    assert "12/40 [" in err
    assert re.search(r"13/40 \[\d+:\d+<\d+:\d+", err), err


def test_console_bar_writes_a_line_now_and_then_where_stderr_is_not_a_terminal(tmp_path, capsys):
    """``rlhf-ppo ... > log 2>&1``: tqdm rewrote its bar with a "\r" frame at every step (and cleared and redrew
    it around each step's line), a frame per step in the log. Off a terminal the bar is whole lines: the first
    step, then at most one every 30 s, and the last; 300 quick steps give those two lines."""
    with Tracking(["console"], "p", "e", tmp_path, total_steps=300) as tracker:
        for step in range(301):
            tracker.log({}, step=step)
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 301
    assert "\r" not in err and "\x1b" not in err
    lines = err.splitlines()
    assert [line.split(" [")[0] for line in lines] == ["training:   0% 0/300", "training: 100% 300/300"], err
    assert re.fullmatch(r"training: 100% 300/300 \[\d\d:\d\d<00:00, *[\d.]+step/s\]", lines[1]), lines[1]


def test_the_last_line_of_a_bar_off_a_terminal_gives_the_whole_runs_rate(monkeypatch):
    """The final line gave tqdm's smoothed rate as it stood at the line before, which left out what the last
    interval counted: 10 items of 10 s, then 90 of 0.1 s, ended on "10.00s/it". The run's average is
    (10 x 10 + 90 x 0.1) s / 100 items = 1.09 s an item."""
    import io

    import tqdm.std

    from rlhf_core.progress import progress_bar

    clock = [1000.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: clock[0])
    out = io.StringIO()
    bar = progress_bar(total=100, desc="t", file=out)
    for seconds in [10.0] * 10 + [0.1] * 90:
        clock[0] += seconds
        bar.update(1)
    bar.close()
    last = out.getvalue().splitlines()[-1]
    assert re.fullmatch(r"t: 100% 100/100 \[01:4\d<00:00, +1\.09s/it\]", last), out.getvalue()


def test_a_message_long_after_the_last_count_repeats_no_count_line_off_a_terminal(monkeypatch):
    """tqdm.write redraws the bars after its message: off a terminal that drew the count's line again wherever 30 s
    had passed since it, though the count had not moved."""
    import io

    from tqdm import tqdm

    from rlhf_core.progress import progress_bar

    clock = _Clock()
    monkeypatch.setattr("tqdm.std.time", clock)
    out = io.StringIO()
    bar = progress_bar(total=10, desc="t", file=out)
    clock.now += 31
    bar.update(1)
    clock.now += 31
    tqdm.write("note", file=out)
    bar.close()
    assert [line.split(" [")[0] for line in out.getvalue().splitlines()] == ["t:   0% 0/10", "t:  10% 1/10", "note"]


def test_a_bar_off_a_terminal_whose_last_count_had_its_line_ends_without_repeating_it(monkeypatch):
    """Items of 31 s each get a line each; the last one's line is the final count, and close adds none."""
    import io

    from rlhf_core.progress import progress_bar

    clock = _Clock()
    monkeypatch.setattr("tqdm.std.time", clock)
    out = io.StringIO()
    bar = progress_bar(total=2, desc="t", file=out)
    for _ in range(2):
        clock.now += 31
        bar.update(1)
    bar.close()
    assert [line.split(" [")[0] for line in out.getvalue().splitlines()] == ["t:   0% 0/2", "t:  50% 1/2",
                                                                              "t: 100% 2/2"]


class _Terminal:
    """What a terminal shows of what was written to it: "\r" goes back to the line's start, and what follows
    overwrites the line from there; "\n" goes to the start of the next line, and ESC[A (tqdm's move back from a
    bar drawn under another) up one line."""

    def __init__(self) -> None:
        self.lines, self.row, self.column = [""], 0, 0

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        for part in re.split(r"(\x1b\[A)", text):
            if part == "\x1b[A":
                self.row = max(self.row - 1, 0)
                continue
            for char in part:
                if char == "\r":
                    self.column = 0
                elif char == "\n":
                    self.row += 1
                    if self.row == len(self.lines):
                        self.lines.append("")
                    self.column = 0
                else:
                    line = self.lines[self.row].ljust(self.column)
                    self.lines[self.row] = line[:self.column] + char + line[self.column + 1:]
                    self.column += 1
        return len(text)

    def flush(self) -> None:
        pass

    def shown(self) -> list[str]:
        return [line.rstrip() for line in self.lines if line.strip()]


def test_a_line_printed_while_the_bar_is_on_the_terminal_gets_a_line_of_its_own(tmp_path, monkeypatch):
    """A notice printed to stderr during training (a resumed run's records moved aside, a warning) landed after
    the bar's text on the bar's line: "training:  60%|...| 3/5 [...]notice: ...". It is now written on a line of
    its own, and the bar drawn again below it."""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    with Tracking(["console"], "p", "e", tmp_path, total_steps=5) as tracker:
        tracker.log({}, step=3)
        print("notice: the records after step 2 were moved aside", file=sys.stderr, flush=True)
        tracker.log({}, step=4)
    shown = terminal.shown()
    assert "notice: the records after step 2 were moved aside" in shown, shown
    assert ["step 3/5", "step 4/5"] == [line for line in shown if line.startswith("step")]
    assert shown[-1].startswith("training:  80%|") and "4/5 [" in shown[-1], shown
    assert sys.stderr is terminal and sys.stdout is terminal  # the streams are handed back when the bar closes


def test_lines_written_together_while_the_bar_is_on_the_terminal_each_get_a_line_above_it(monkeypatch):
    """Two lines in one write ("one\ntwo\n", as a logging handler or a traceback writes them) both go above the bar,
    not the first alone with the second held back until the bar closes."""
    from rlhf_core.progress import progress_bar

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    bar = progress_bar(total=5, desc="t")
    try:
        sys.stderr.write("one\ntwo\n")
        shown = terminal.shown()
    finally:
        bar.close()
    assert shown[:2] == ["one", "two"] and len(shown) == 3, shown
    assert shown[2].startswith("t:   0%|") and "0/5 [" in shown[2], shown


def test_a_bar_opened_under_a_bar_on_the_terminal_is_drawn_below_it(monkeypatch):
    """The validation's bar opens while the training bar is on the terminal, where stderr stands for the terminal
    with lines routed around the bars: the inner bar draws on the terminal itself, on the line below."""
    from rlhf_core.progress import progress_bar

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    outer = progress_bar(total=5, desc="training")
    try:
        inner = progress_bar(total=3, desc="testing")
        try:
            inner.update(1)
            inner.refresh()
            shown = terminal.shown()
        finally:
            inner.close()
    finally:
        outer.close()
    assert len(shown) == 2, shown
    assert shown[0].startswith("training:   0%|") and "0/5 [" in shown[0], shown
    assert shown[1].startswith("testing:  33%|") and "1/3 [" in shown[1], shown


class _Clock:
    """tqdm's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _phases(tracker: Tracking, step: int, clock: _Clock, seconds: float) -> None:
    """A training step, each of its phases ``seconds`` long, as the trainer's phase hooks enter them."""
    with tracker.phase("step", step):
        for name in ("gen", "ref", "update_actor"):
            with tracker.phase(name, step):
                clock.now += seconds


def test_a_long_phase_of_a_step_gets_a_line_naming_it_where_stderr_is_not_a_terminal(tmp_path, capsys, monkeypatch):
    """A step of SmolLM2 on two cores takes minutes (generation, critic and actor updates of 30 to 60 s each), and
    a log showed nothing between two counts of the bar: a slow step looked like a hung one, and step 1 of a run
    without a validation before training had no bar at all. A phase that starts 30 s or more after the bar's last
    line now writes a line naming it, its step and the seconds of the step's phases done; quick phases none."""
    clock = _Clock()
    monkeypatch.setattr("tqdm.std.time", clock)
    with Tracking(["console"], "p", "e", tmp_path, total_steps=10) as tracker:
        _phases(tracker, 1, clock, 40)  # three phases of 40 s: the first opens the bar, the next two get a line
        tracker.log({}, step=1)  # 120 s after the bar's first line: the count's line, as before
        _phases(tracker, 2, clock, 1)  # three phases of 1 s: no line
        tracker.log({}, step=2)  # (3 s after the last count: none)
        during = capsys.readouterr().err.splitlines()
    after = capsys.readouterr().err.splitlines()
    assert [line.split(" [")[0] for line in during] == [
        "training:   0% 0/10",
        "step 1/10: ref (gen 40 s done)",
        "step 1/10: update_actor (gen 40 s, ref 40 s done)",
        "training:  10% 1/10",
    ], during
    assert "120.00s/step" in during[-1]  # the step's 120 s, from the start of its first phase
    assert [line.split(" [")[0] for line in after] == ["training:  20% 2/10"]  # the last count, at close


def test_phase_lines_keep_the_bars_interval_and_leave_its_count_lines_be(tmp_path, capsys, monkeypatch):
    """A phase line needs 30 s since the bar's last line of either kind and 30 s into its step; the count's own
    line keeps its own rule, so a phase line just before a step ends does not hold back that step's count."""
    clock = _Clock()
    monkeypatch.setattr("tqdm.std.time", clock)
    with Tracking(["console"], "p", "e", tmp_path, total_steps=10) as tracker:
        tracker.log({}, step=3)  # a resumed run: the bar at 3/10
        clock.now += 2
        with tracker.phase("gen", 4):  # 2 s after the bar's line: none
            clock.now += 30
        with tracker.phase("update_critic", 4):  # 32 s after it and 30 s into the step: a line
            clock.now += 20
        with tracker.phase("update_actor", 4):  # 20 s after that line: none
            clock.now += 10
        tracker.log({}, step=4)  # 62 s after the last count: its line, 30 s after the phase's
        clock.now += 31
        with tracker.phase("testing", 4):  # the validation of the step logged: 31 s after the count's line
            clock.now += 5
        lines = capsys.readouterr().err.splitlines()
    assert [line.split(" [")[0] for line in lines] == [
        "training:  30% 3/10",
        "step 4/10: update_critic (gen 30 s done)",
        "training:  40% 4/10",
        "step 4/10: testing (gen 30 s, update_critic 20 s, update_actor 10 s done)",
    ], lines


def test_a_long_run_of_quick_steps_gets_the_counts_lines_and_no_phase_line(tmp_path, capsys, monkeypatch):
    """Steps of 7 s (gen 3 s, ref 2 s, update_actor 2 s) for 10 minutes: the log gets the count's line every 30 s
    or so, as before the phases were shown, and no phase line, though phases keep starting 30 s or more after the
    bar's last line (step 5's ref at 31 s, 3 s into the step): no step runs for 30 s."""
    clock = _Clock()
    monkeypatch.setattr("tqdm.std.time", clock)
    with Tracking(["console"], "p", "e", tmp_path, total_steps=84) as tracker:
        for step in range(1, 85):
            with tracker.phase("step", step):
                for name, seconds in (("gen", 3), ("ref", 2), ("update_actor", 2)):
                    with tracker.phase(name, step):
                        clock.now += seconds
            tracker.log({}, step=step)
        lines = capsys.readouterr().err.splitlines()
    assert not [line for line in lines if line.startswith("step ")], lines
    # the bar opens at step 1's first phase (0 s); a count's line at the first step's end 30 s or more after the
    # last: steps 5 (35 s), 10 (70 s), ..., 80 (560 s)
    assert [line.split(" [")[0].split()[-1] for line in lines] == ["0/84"] + [f"{n}/84" for n in range(5, 81, 5)]


class _CountingTerminal(_Terminal):
    """A terminal that counts the frames drawn on it (a bar's frame starts with "\r")."""

    def __init__(self) -> None:
        super().__init__()
        self.frames = 0

    def write(self, text: str) -> int:
        self.frames += text.count("\r")
        return super().write(text)


def test_the_training_bar_on_a_terminal_shows_the_phase_under_way(tmp_path, monkeypatch):
    """On a terminal the bar stood still at the last step's count for minutes; its postfix now names the step and
    phase under way, drawn once as each phase starts (no redrawing in between), and the step's count once done."""
    terminal = _CountingTerminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    seen = []
    with Tracking(["console"], "p", "e", tmp_path, total_steps=5) as tracker:
        tracker.log({}, step=2)
        with tracker.phase("step", 3):
            for name in ("gen", "update_critic", "update_actor"):
                before = terminal.frames
                with tracker.phase(name, 3):
                    seen.append((terminal.shown()[-1], terminal.frames - before))
                    before = terminal.frames
                seen.append(terminal.frames - before)  # (a phase that ends draws nothing)
        tracker.log({}, step=3)
        done = terminal.shown()[-1]
    for (bar, frames), name in zip(seen[::2], ("gen", "update_critic", "update_actor")):
        assert bar.startswith("training:  40%|") and "2/5 [" in bar and bar.endswith(f", step 3/5: {name}]"), bar
        assert frames == 1
    assert seen[1::2] == [0, 0, 0]
    assert done.startswith("training:  60%|") and "3/5 [" in done and "step 3/5" not in done, done


def test_phases_show_nothing_before_the_first_step_or_without_a_total(tmp_path, capsys, monkeypatch):
    """The validation before training (step 0) has its own bar, and a run without a known total (validation only)
    has no training bar: neither opens one."""
    clock = _Clock()
    monkeypatch.setattr("tqdm.std.time", clock)
    with Tracking(["console"], "p", "e", tmp_path, total_steps=10) as tracker:
        with tracker.phase("testing", 0):
            clock.now += 40
    with Tracking(["console"], "p", "e", tmp_path) as tracker:
        with tracker.phase("testing", 3):
            clock.now += 40
    assert capsys.readouterr().err == ""


@pytest.fixture
def transformers_bars():
    """transformers' own bars on, as they are by default, whatever an earlier test left; the hook as it was, once
    the import of model loading has set ours (else a test importing it first would leave the next one none)."""
    from transformers.utils import logging as hf_logging

    import rlhf_core.models.loading  # noqa: F401 - sets the hook, as any process that loads models has it

    before = hf_logging.is_progress_bar_enabled()
    hook = hf_logging.set_tqdm_hook(None)
    hf_logging.set_tqdm_hook(hook)
    hf_logging.enable_progress_bar()
    yield hf_logging
    hf_logging.set_tqdm_hook(hook)
    if not before:
        hf_logging.disable_progress_bar()


def _tiny_model(folder: Path) -> tuple[Path, int]:
    """A random one-layer toy model saved in ``folder``, and the number of tensors its weights file holds (read
    from the file, as the count a load of it goes through)."""
    from safetensors import safe_open

    from rlhf_core.models.toy import random_toy_model

    random_toy_model(folder, n_layers=1, hidden_size=32, max_position_embeddings=64)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as weights:
        return folder, len(list(weights.keys()))


def test_a_model_load_writes_lines_not_frames_where_stderr_is_not_a_terminal(tmp_path, capsys, transformers_bars):
    """``rlhf-ppo ... > log 2>&1``: transformers' "Loading weights" bar wrote its "\r" frames into the log at every
    model load (the actor's and the critic's, the reward model's, in each Ray worker too), where the project's own
    bars write lines. It writes lines there as well now: one as the load starts, one of its last count."""
    from rlhf_core.models.loading import load_actor

    folder, tensors = _tiny_model(tmp_path / "model")
    capsys.readouterr()
    load_actor(folder)
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err, repr(err)
    lines = err.splitlines()
    assert [line.split(" [")[0] for line in lines] == [f"Loading weights ({folder}):   0% 0/{tensors}",
                                                       f"Loading weights ({folder}): 100% {tensors}/{tensors}"], err
    assert transformers_bars.is_progress_bar_enabled()  # (routed, not switched off for the rest of the process)


def test_a_load_bar_names_the_folder_and_the_role_of_the_model_it_loads(tmp_path, capsys, transformers_bars):
    """A log of a run holds a load of the policy, the critic and the reward model, often from the same folder:
    each load's line says the folder and, where the load makes something other than a causal LM of it, what."""
    from rlhf_core.models.loading import load_critic
    from rlhf_core.progress import bars_about

    folder, tensors = _tiny_model(tmp_path / "model")
    capsys.readouterr()
    load_critic(folder)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"Loading weights ({folder}, as a value model)"] * 2, lines
    with bars_about("outer"), bars_about("inner"):  # (the innermost block's words; none after the blocks)
        with transformers_bars.tqdm(range(2), desc="Writing") as bar:
            list(bar)
        with transformers_bars.tqdm(range(2), desc="Reading") as bar:
            list(bar)
    with transformers_bars.tqdm(range(2), desc="After") as bar:
        list(bar)
    assert [line.split(":")[0] for line in capsys.readouterr().err.splitlines()] == [
        "Writing (inner)", "Writing (inner)", "Reading (inner)", "Reading (inner)", "After", "After"]


def test_on_a_terminal_a_model_load_draws_transformers_own_bar(tmp_path, monkeypatch, transformers_bars):
    """Where a person watches, the load's bar stays transformers' own: tqdm's bar redrawn in place (in blocks, "#"
    on a terminal that names no encoding)."""
    from rlhf_core.models.loading import load_actor

    folder, tensors = _tiny_model(tmp_path / "model")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    load_actor(folder)
    shown = terminal.shown()
    named = re.escape(f"Loading weights ({folder})")
    assert len(shown) == 1 and re.match(rf"{named}: 100%\|(█+|#+)\| {tensors}/{tensors} \[", shown[0]), shown


def test_transformers_bars_switched_off_stay_off_and_a_hook_set_before_is_kept(tmp_path, capsys, transformers_bars):
    """The routing changes nothing else of the process: bars a program turned off write nothing, and a hook of its
    own making keeps deciding its bars."""
    from rlhf_core.models.loading import load_actor
    from rlhf_core.progress import route_transformers_bars

    folder, _ = _tiny_model(tmp_path / "model")
    transformers_bars.disable_progress_bar()
    capsys.readouterr()
    load_actor(folder)
    assert capsys.readouterr().err == ""
    transformers_bars.enable_progress_bar()
    asked = []

    def own_hook(factory, args, kwargs):
        asked.append(kwargs.get("desc"))
        return factory(*args, **{**kwargs, "disable": True})

    transformers_bars.set_tqdm_hook(own_hook)
    route_transformers_bars()
    load_actor(folder)
    assert asked == ["Loading weights"] and capsys.readouterr().err == ""


def test_console_without_total_has_no_bar_and_shows_every_val_source(tmp_path, capsys):
    metrics = {
        "val-core/openai/gsm8k/acc/mean@1": 0.5,
        "val-core/math/acc/mean@1": 0.25,
        "actor/reward_kl_penalty": 0.001,
        "unrelated/metric": 7.0,
    }
    with Tracking(["console"], "p", "e", tmp_path) as tracker:
        tracker.log(metrics, step=3)
        tracker.log({}, step=4)
    out, err = capsys.readouterr()
    assert out.splitlines() == ["step 3 | acc[math] 0.25 | acc[openai/gsm8k] 0.5 | kl 0.001", "step 4"]
    assert err == ""
    with Tracking(["console"], "p", "e", tmp_path) as tracker:  # val_kwargs.n=4: mean@4, not a std or best@4
        tracker.log({"val-core/math/acc/mean@4": 0.375, "val-aux/math/acc/mean@4/std": 0.1,
                     "val-core/math/acc/best@4/mean": 0.75}, step=5)
    assert capsys.readouterr().out.splitlines() == ["step 5 | acc 0.375"]


def test_console_names_each_source_whole_with_ten_or_more_responses(tmp_path, capsys):
    """``mean@16`` is one character longer than the pattern's ``mean@*``: the label is the source, no more."""
    with Tracking(["console"], "p", "e", tmp_path) as tracker:
        tracker.log({"val-core/openai/gsm8k/acc/mean@16": 0.5, "val-core/math/acc/mean@16": 0.25}, step=1)
        tracker.log({"val-core/a/reward/mean@100": 0.5, "val-core/b/reward/mean@100": 0.75}, step=2)
    assert capsys.readouterr().out.splitlines() == ["step 1 | acc[math] 0.25 | acc[openai/gsm8k] 0.5",
                                                    "step 2 | val_reward[a] 0.5 | val_reward[b] 0.75"]


def test_the_kl_warning_names_the_coefficient_of_the_kl_term_the_run_has(tmp_path, capsys):
    """algorithm.kl_ctrl.kl_coef is read only with the KL in the reward: a run with a KL loss alone told to raise it
    was then told by its config that the key has no effect; a run with no KL term has no coefficient to raise."""
    def advice(use_kl_in_reward, use_kl_loss):
        config = {"algorithm": {"use_kl_in_reward": use_kl_in_reward},
                  "actor_rollout_ref": {"actor": {"use_kl_loss": use_kl_loss}}}
        with Tracking(["console"], "p", "e", tmp_path, config=config, warn_thresholds={"kl": 0.02}) as tracker:
            tracker.log({"actor/kl_loss": 0.05}, step=1)
        return capsys.readouterr().out.strip().split(" | WARNING KL 0.05 > 0.02: lower actor_rollout_ref.actor."
                                                     "optim.lr or ")[1]

    assert advice(False, True) == "raise the KL coefficient (actor_rollout_ref.actor.kl_loss_coef)"
    assert advice(True, False) == "raise the KL coefficient (algorithm.kl_ctrl.kl_coef)"
    assert advice(True, True) == \
        "raise the KL coefficient (algorithm.kl_ctrl.kl_coef / actor_rollout_ref.actor.kl_loss_coef)"
    assert advice(False, False) == ("add a KL term (algorithm.use_kl_in_reward=true, or "
                                    "actor_rollout_ref.actor.use_kl_loss=true): the run has none")


def test_console_warnings_name_the_knob(tmp_path, capsys):
    thresholds = {"kl": 0.02, "grad_norm": 5.0}
    with Tracking(["console"], "p", "e", tmp_path, warn_thresholds=thresholds) as tracker:
        tracker.log(STEP_METRICS, step=1)  # all below the thresholds
        tracker.log({"actor/ppo_kl": 0.05}, step=2)
        tracker.log({"actor/reward_kl_penalty": 0.05}, step=3)
        tracker.log({"actor/grad_norm": 7.5, "critic/grad_norm": 12.0}, step=4)
    lines = capsys.readouterr().out.splitlines()
    assert "WARNING" not in lines[0]
    assert lines[1] == f"step 2 | kl 0.05 | WARNING {KL_ADVICE}"
    assert lines[2] == f"step 3 | kl 0.05 | WARNING {KL_ADVICE}"
    assert "actor grad_norm 7.5 > 5: lower the learning rate (actor_rollout_ref.actor.optim.lr) or grad_clip " \
           "(actor_rollout_ref.actor.grad_clip)" in lines[3]
    assert "critic grad_norm 12 > 5: lower the learning rate (critic.optim.lr) or grad_clip (critic.grad_clip)" \
           in lines[3]


def test_a_grad_norm_the_run_already_clipped_is_not_told_to_lower_grad_clip(tmp_path, capsys):
    """The grad norm is logged before clipping: with grad_clip below it the update was already cut to grad_clip,
    and neither knob changes the logged figure, so the advice says what happened instead of "lower grad_clip"."""
    config = {"actor_rollout_ref": {"actor": {"grad_clip": 1.0}}, "critic": {"grad_clip": 20.0}}
    with Tracking(["console"], "p", "e", tmp_path, config=config, warn_thresholds={"grad_norm": 5.0}) as tracker:
        tracker.log({"actor/grad_norm": 6.046, "critic/grad_norm": 12.0}, step=1)
    line = capsys.readouterr().out.strip()
    assert line == (
        "step 1 | WARNING actor grad_norm 6.046 > 5: measured before clipping, and actor_rollout_ref.actor.grad_clip=1 "
        "scaled this update down to that norm; if it keeps rising over the steps, lower the learning rate "
        "(actor_rollout_ref.actor.optim.lr); where it is this model's usual size, raise "
        "trainer.warn_grad_norm"
        # the critic's grad_clip (20) is above its norm: nothing was clipped, and a lower grad_clip would cut it
        " | WARNING critic grad_norm 12 > 5: lower the learning rate (critic.optim.lr) or grad_clip (critic.grad_clip)")


def test_a_nan_grad_norm_is_warned(tmp_path, capsys):
    """NaN is not above the threshold by comparison, yet it is the grad norm that most needs the warning."""
    with Tracking(["console"], "p", "e", tmp_path, warn_thresholds={"grad_norm": 5.0}) as tracker:
        tracker.log({"actor/grad_norm": float("nan"), "critic/grad_norm": 1.0}, step=1)
        tracker.log({"actor/grad_norm": 1.0, "critic/grad_norm": float("inf")}, step=2)  # skipped alike
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("step 1 | WARNING actor grad_norm nan: a gradient was not finite and that mini-batch's update "
                        "was skipped (training/skipped_steps); lower the learning rate "
                        "(actor_rollout_ref.actor.optim.lr)")
    assert lines[1] == ("step 2 | WARNING critic grad_norm inf: a gradient was not finite and that mini-batch's "
                        "update was skipped (training/skipped_steps); lower the learning rate (critic.optim.lr)")


# ----------------------------------------------------------------------------------------------- file


def test_file_logger_writes_valid_json_lines_and_appends(tmp_path):
    with Tracking(["file"], "p", "e", tmp_path) as tracker:
        tracker.log({"a": 1.5, "b": torch.tensor(2.0), "bad": float("nan"), "big": float("inf")}, step=1)
        tracker.log({"a": 2.5, "val-core/x/acc/mean@1": 0.75}, step=2)
    path = tmp_path / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [
        {"step": 1, "a": 1.5, "b": 2.0, "bad": None, "big": None},
        {"step": 2, "a": 2.5, "val-core/x/acc/mean@1": 0.75},
    ]
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()

    # a run killed mid-write leaves a partial line; the resumed run appends on a fresh line
    with open(path, "a") as f:
        f.write('{"step": 3, "a"')
    with Tracking(["file"], "p", "e", tmp_path) as tracker:
        tracker.log({"a": 3.5}, step=3)
    lines = path.read_text().splitlines()
    assert len(lines) == 4
    assert json.loads(lines[-1]) == {"step": 3, "a": 3.5}


def test_file_logger_flushes_every_step(tmp_path):
    tracker = Tracking(["file"], "p", "e", tmp_path)
    tracker.log({"a": 1.0}, step=1)
    # not finished yet: the line is already on disk for another reader
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "a": 1.0}
    tracker.finish()
    tracker.finish()  # idempotent
    with pytest.raises(RuntimeError, match="after finish"):
        tracker.log({"a": 2.0}, step=2)


def test_a_logger_that_cannot_be_closed_is_reported_and_never_hides_the_runs_own_error(tmp_path, monkeypatch, capsys):
    """A file that cannot be flushed as it closes (a full disk) loses the last records: a run that ended well ends
    with that error, naming the file, where the OS error names none. A run that failed of its own error reports that
    one, and the closing error in a notice beside it."""
    import errno

    from rlhf_core.training.tracking import FileLogger

    def full_disk(self, failed=False):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileLogger, "finish", full_disk)
    with pytest.raises(OSError) as err:
        with Tracking(["file"], "p", "e", tmp_path) as tracker:
            tracker.log({"a": 1.0}, step=1)
    assert (err.value.errno, err.value.filename) == (errno.ENOSPC, str(tmp_path / "metrics.jsonl"))
    with pytest.raises(RuntimeError, match="the step failed"):
        with Tracking(["file"], "p", "e", tmp_path) as tracker:
            tracker.log({"a": 2.0}, step=2)
            raise RuntimeError("the step failed")
    assert capsys.readouterr().err.splitlines() == [
        "notice: a logger could not be closed either (OSError: [Errno 28] No space left on device: "
        f"'{tmp_path / 'metrics.jsonl'}')"]


def test_non_numeric_metric_is_skipped_with_one_warning(tmp_path):
    with Tracking(["file"], "p", "e", tmp_path) as tracker:
        with pytest.warns(UserWarning, match="'hist' is not a single number"):
            tracker.log({"a": 1.0, "hist": torch.ones(4)}, step=1)
        tracker.log({"a": 2.0, "hist": torch.ones(4)}, step=2)  # warned once already
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}]


# ----------------------------------------------------------------------------------------------- optional backends


def test_missing_packages_say_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="pip install wandb"):
        Tracking(["wandb"], "p", "e", tmp_path)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        Tracking(["file", "tensorboard"], "p", "e", tmp_path)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ImportError, match="pip install mlflow-skinny"):
        Tracking(["mlflow"], "p", "e", tmp_path)


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracking(["tensorboard"], "p", "e", tmp_path) as tracker:
        tracker.log({"critic/score/mean": 0.25, "actor/pg_loss": -0.5}, step=1)
        tracker.log({"critic/score/mean": 0.75}, step=2)
        tracker.log_generations(SAMPLES, step=2)
    log_dir = tmp_path / "tensorboard"
    assert list(log_dir.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    assert {"critic/score/mean", "actor/pg_loss"} <= set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("critic/score/mean")] == [(1, 0.25), (2, 0.75)]
    [text] = acc.Tensors("val/generations/text_summary")
    assert text.step == 2
    table = text.tensor_proto.string_val[0].decode()
    assert "| input | output | score |" in table and "| Q: 2+2? | 4 \\| four<br>#### 4 | 1 |" in table


def test_tensorboard_writes_where_verls_variable_says(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb" / "exp"))
    with Tracking(["tensorboard"], "p", "e", tmp_path / "run") as tracker:
        tracker.log({"critic/score/mean": 0.25}, step=1)
    assert list((tmp_path / "tb" / "exp").glob("events.out.tfevents.*"))
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_a_new_run_is_told_that_verls_tensorboard_folder_holds_an_earlier_runs_events(tmp_path, monkeypatch, capsys):
    # (the notice is given as the logger is built: no writer is opened here, so that this test does not move the
    # process-wide counter in the event files' names that the resume tests' file order depends on)
    pytest.importorskip("tensorboard")
    shared = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_DIR", str(shared))
    with Tracking(["tensorboard"], "p", "e", tmp_path / "first"):  # no folder yet: nothing to say
        pass
    shared.mkdir()
    (shared / "notes.txt").write_text("not events\n")
    with Tracking(["tensorboard"], "p", "e", tmp_path / "first"):  # no events in it: nothing to say either
        pass
    assert "notice" not in capsys.readouterr().err
    older = shared / "events.out.tfevents.1700000000.host.11.0"
    newer = shared / "events.out.tfevents.1700000100.host.12.0"
    for path, when in ((newer, 1_700_000_100), (older, 1_700_000_000)):
        path.write_bytes(b"")
        os.utime(path, (when, when))
    # a new run in the folder would be drawn as one run with the earlier ones: said, naming the newest file,
    # which stays where it is (the folder is the user's)
    with Tracking(["tensorboard"], "p", "e", tmp_path / "second"):
        pass
    err = " ".join(capsys.readouterr().err.split())
    assert (f"notice: TENSORBOARD_DIR={shared} already holds 2 TensorBoard event file(s) of an earlier run (the "
            f"newest {newer.name})") in err
    assert "point TENSORBOARD_DIR at a new folder" in err
    assert older.is_file() and newer.is_file()
    # a resumed run goes on writing where it wrote: no notice
    with Tracking(["tensorboard"], "p", "e", tmp_path / "second", resume_step=1):
        pass
    assert "notice" not in capsys.readouterr().err


SAMPLES = [{"input": "Q: 2+2?", "output": "4 | four\n#### 4", "score": 1.0}, {"input": "Q: 3*3?", "output": "6", "score": 0.0}]


def test_validation_samples_in_the_console_and_a_file(tmp_path, capsys):
    long = {"input": "x" * 150 + "y" * 150, "output": "z", "score": 0.5}
    with Tracking(["console", "file"], "p", "e", tmp_path) as tracker:
        tracker.log_generations(SAMPLES, step=3)
        tracker.log_generations([long], step=4)
    lines = [json.loads(line) for line in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    assert lines == [{"step": 3, **SAMPLES[0]}, {"step": 3, **SAMPLES[1]}, {"step": 4, **long}]  # whole texts
    out = capsys.readouterr().out
    assert "validation samples at step 3:" in out and "[score 1] 'Q: 2+2?' -> '4 | four\\n#### 4'" in out
    assert f"'{'x' * 100} ... {'y' * 100}'" in out  # the console shows a long text's start and end


def test_a_sample_without_a_score_is_written_as_json_null(tmp_path):
    with Tracking(["file"], "p", "e", tmp_path) as tracker:
        tracker.log_generations([{"input": "Q", "output": "A", "score": float("nan")}], step=1)
    text = (tmp_path / "val_generations.jsonl").read_text()
    assert text == '{"step": 1, "input": "Q", "output": "A", "score": null}\n'  # not NaN, which is not JSON


def _wandb_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # keep wandb's own config/cache out of the home directory; a closed local port as the server
    for var, sub in (("WANDB_CONFIG_DIR", "cfg"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _wandb_offline_history(run_dir: Path) -> tuple[str, list[dict]]:
    """The run id and the logged rows of an offline wandb run, read back from its transaction log.

    ``run-<id>.wandb`` is a 7-byte file header, then leveldb-log records in 32 KiB blocks (7-byte record header:
    checksum, little-endian length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4), each a wandb ``Record``. The
    installed wandb has no reader for it, so this is one. Rows leave out the wall-clock ``_timestamp`` and
    ``_runtime``; a value logged under nested keys (a table's fields) comes back as a dict.
    """
    import wandb
    from wandb.proto import wandb_internal_pb2

    wandb.teardown()  # a finished run's log is written by wandb's service in the background: wait for it
    [path] = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} does not start like a wandb transaction log"
    block, pos, pending, run_id, rows = 32 * 1024, 7, b"", "", []
    while pos + 7 <= len(data):
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if block - pos % block < 7 or kind == 0:  # the rest of the block is zero padding
            pos += block - pos % block
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (2, 3):  # the record goes on in the next block
            continue
        record = wandb_internal_pb2.Record.FromString(pending)
        if record.WhichOneof("record_type") == "run":
            run_id = record.run.run_id
        elif record.WhichOneof("record_type") == "history":
            row: dict = {}
            for item in record.history.item:
                *parents, key = list(item.nested_key) or [item.key]
                if key not in ("_timestamp", "_runtime"):
                    target = row
                    for parent in parents:
                        target = target.setdefault(parent, {})
                    target[key] = json.loads(item.value_json)
            rows.append(row)
    return run_id, rows


def test_wandb_offline_run_directory_without_network(tmp_path, monkeypatch, no_network):
    pytest.importorskip("wandb")
    _wandb_offline(monkeypatch, tmp_path)

    local_dir = tmp_path / "run"
    with Tracking(["wandb"], "proj", "exp", local_dir, config={"a": {"b": 1}}) as tracker:
        backend = tracker.backends["wandb"]
        assert backend.mode == "offline"
        assert backend.wandb_run.settings.mode == "offline"
        tracker.log({"critic/score/mean": 0.5, "val-core/x/acc/mean@1": 0.25}, step=1)
        tracker.log({"critic/score/mean": 0.75}, step=2)
        tracker.log_generations(SAMPLES, step=2)
    [run_dir] = (local_dir / "wandb").glob("offline-run-*")
    run_id, rows = _wandb_offline_history(run_dir)
    assert run_id == backend.wandb_run.id
    tables = [row.pop("val/generations", None) for row in rows]
    assert rows == [{"critic/score/mean": 0.5, "val-core/x/acc/mean@1": 0.25, "_step": 1},
                    {"critic/score/mean": 0.75, "_step": 2}]
    # the samples go into step 2's row as a table, whose rows are in a file of the run
    assert tables[0] is None and isinstance(tables[1], dict)
    assert (tables[1]["_type"], tables[1]["nrows"], tables[1]["ncols"]) == ("table-file", 2, 4)
    assert json.loads((run_dir / "files" / tables[1]["path"]).read_text()) == {
        "columns": ["step", "input", "output", "score"],
        "data": [[2, "Q: 2+2?", "4 | four\n#### 4", 1.0], [2, "Q: 3*3?", "6", 0.0]]}
    assert no_network == []


def test_a_run_that_fails_is_finished_in_wandb_with_exit_code_1(tmp_path, monkeypatch):
    """wandb tells a failed run from a finished one by the exit code its run is finished with: 1 where the run
    ended with an exception, 0 where it ended well. (A stand-in wandb: only the finish is looked at.)"""
    import types

    exit_codes = []

    class Run:
        id = "stand-in"

        def log(self, metrics, step):
            pass

        def finish(self, exit_code=None):
            exit_codes.append(exit_code)

    stand_in = types.ModuleType("wandb")
    stand_in.init = lambda **kwargs: Run()
    monkeypatch.setitem(sys.modules, "wandb", stand_in)
    with pytest.raises(RuntimeError, match="the step failed"):
        with Tracking(["wandb"], "p", "e", tmp_path) as tracker:
            tracker.log({"a": 1.0}, step=1)
            raise RuntimeError("the step failed")
    with Tracking(["wandb"], "p", "e", tmp_path) as tracker:
        tracker.log({"a": 1.0}, step=1)
    assert exit_codes == [1, 0]


@pytest.fixture
def sqlite_without_fsync():
    """Test speed only: a fresh MLflow store runs dozens of schema migrations, each a synced SQLite
    commit (seconds on a slow disk). Durability is irrelevant to what the test checks."""
    sqlalchemy = pytest.importorskip("sqlalchemy")

    def no_sync(dbapi_connection, _record):
        if isinstance(dbapi_connection, sqlite3.Connection):
            dbapi_connection.execute("PRAGMA synchronous=OFF")

    sqlalchemy.event.listen(sqlalchemy.engine.Engine, "connect", no_sync)
    yield
    sqlalchemy.event.remove(sqlalchemy.engine.Engine, "connect", no_sync)


def test_mlflow_local_store_metrics_and_params(tmp_path, monkeypatch, no_network, local_mlflow):
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory either
    local_dir = tmp_path / "run"
    config = {"actor": {"optim": {"lr": 1e-6}}, "trainer": {"logger": ["mlflow"]}, "note": "x" * 7000}
    with Tracking(["mlflow"], "proj", "exp", local_dir, config=config) as tracker:
        tracker.log({"critic/score/mean": 0.5, "val-core/openai/gsm8k/acc/mean@1": 0.25}, step=1)
        tracker.log({"critic/score/mean": 0.75, "actor/ppo_kl": float("nan")}, step=2)
        tracker.log_generations(SAMPLES, step=2)
        run_id = tracker.backends["mlflow"].run_id

    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    client = local_mlflow(local_dir)
    run = client.get_run(run_id)
    assert run.info.run_name == "exp"
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    history = client.get_metric_history(run_id, "critic/score/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.75)]
    assert [m.value for m in client.get_metric_history(run_id, "val-core/openai/gsm8k/acc/mean_at_1")] == [0.25]
    assert math.isnan(client.get_metric_history(run_id, "actor/ppo_kl")[0].value)
    params = run.data.params
    assert params["actor.optim.lr"] == "1e-06"
    assert params["trainer.logger"] == "['mlflow']"
    assert params["note"] == "x" * 6000
    saved = client.download_artifacts(run_id, "val_generations/step_2.json", str(tmp_path / "run" / "dl"))
    assert json.loads(Path(saved).read_text()) == SAMPLES
    assert no_network == []


@pytest.fixture
def local_mlflow(monkeypatch, no_network, sqlite_without_fsync):
    """The MLflow store a run makes in its own folder (no ``MLFLOW_TRACKING_URI``): a client of the one in
    ``local_dir`` (where :func:`mlflow_tracking_uri` puts it)."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    yield lambda local_dir: MlflowClient(tracking_uri=mlflow_tracking_uri(local_dir))
    assert no_network == []


def test_a_run_that_fails_is_marked_failed_in_mlflow(tmp_path, local_mlflow):
    with pytest.raises(RuntimeError, match="the step failed"):
        with Tracking(["mlflow"], "proj", "exp", tmp_path) as tracker:
            tracker.log({"a": 1.0}, step=1)
            failed = tracker.backends["mlflow"].run_id
            raise RuntimeError("the step failed")
    with Tracking(["mlflow"], "proj", "exp", tmp_path) as tracker:
        tracker.log({"a": 1.0}, step=1)
        finished = tracker.backends["mlflow"].run_id
    client = local_mlflow(tmp_path)
    assert [client.get_run(run_id).info.status for run_id in (failed, finished)] == ["FAILED", "FINISHED"]


def test_metric_and_param_names_that_clean_up_alike_stay_apart_in_mlflow(tmp_path, local_mlflow):
    """``acc[gsm8k]`` cleans up to ``acc_gsm8k_`` (brackets are outside MLflow's alphabet), the name of another
    metric: the name met second gets ``_2``, and keeps it at every step, whichever order the step has them in.
    Params alike."""
    config = {"a[b]": 1, "a_b_": 2}
    with Tracking(["mlflow"], "proj", "exp", tmp_path, config=config) as tracker:
        tracker.log({"acc[gsm8k]": 0.5, "acc_gsm8k_": 0.25}, step=1)
        tracker.log({"acc_gsm8k_": 0.125, "acc[gsm8k]": 0.75}, step=2)
        run_id = tracker.backends["mlflow"].run_id
    client = local_mlflow(tmp_path)
    history = {name: [(m.step, m.value) for m in client.get_metric_history(run_id, name)]
               for name in ("acc_gsm8k_", "acc_gsm8k__2")}
    assert history == {"acc_gsm8k_": [(1, 0.5), (2, 0.75)], "acc_gsm8k__2": [(1, 0.25), (2, 0.125)]}
    assert client.get_run(run_id).data.params == {"a_b_": "1", "a_b__2": "2"}


def test_a_resume_whose_mlflow_run_was_deleted_starts_a_new_run(tmp_path, local_mlflow):
    """The run a resumed run logged into was deleted in MLflow meanwhile (the user's clean-up): a deleted run takes
    no records that MLflow shows, so the resume starts a new run in the experiment."""
    with Tracking(["mlflow"], "proj", "exp", tmp_path) as tracker:
        tracker.log({"a": 1.0}, step=1)
        first = tracker.backends["mlflow"].run_id
    client = local_mlflow(tmp_path)
    client.delete_run(first)
    with Tracking(["mlflow"], "proj", "exp", tmp_path, resume_step=1) as tracker:
        tracker.log({"a": 2.0}, step=2)
        second = tracker.backends["mlflow"].run_id
    run = client.get_run(second)
    assert second != first
    assert (run.info.lifecycle_stage, run.info.status) == ("active", "FINISHED")
    assert [(m.step, m.value) for m in client.get_metric_history(second, "a")] == [(2, 2.0)]
    assert client.get_run(first).info.lifecycle_stage == "deleted"


def test_a_run_whose_mlflow_experiment_was_deleted_restores_it(tmp_path, local_mlflow):
    """MLflow deletes an experiment with its runs and refuses new records in it, while its name stays taken. The next
    run of the project restores it, and with it its runs: a resume goes on in its run."""
    with Tracking(["mlflow"], "proj", "exp", tmp_path) as tracker:
        tracker.log({"a": 1.0}, step=1)
        first = tracker.backends["mlflow"].run_id
    client = local_mlflow(tmp_path)
    experiment_id = client.get_run(first).info.experiment_id
    client.delete_experiment(experiment_id)
    with Tracking(["mlflow"], "proj", "exp", tmp_path, resume_step=1) as tracker:
        tracker.log({"a": 2.0}, step=2)
        assert tracker.backends["mlflow"].run_id == first
    assert client.get_experiment(experiment_id).lifecycle_stage == "active"
    assert client.get_run(first).info.lifecycle_stage == "active"
    assert [(m.step, m.value) for m in client.get_metric_history(first, "a")] == [(1, 1.0), (2, 2.0)]


def test_a_resumed_run_goes_on_in_its_runs_and_tensorboard_drops_the_steps_it_logs_again(
        tmp_path, monkeypatch, local_mlflow):
    """A run killed during step 4 (steps 1-3 logged) resumes from its step-2 checkpoint and logs 3, 4, 5: one wandb
    run and one MLflow run hold it all, and TensorBoard shows step 3 once, as the resumed run logged it."""
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _wandb_offline(monkeypatch, tmp_path)
    local_dir, loggers = tmp_path / "run", ["tensorboard", "wandb", "mlflow"]
    first = Tracking(loggers, "proj", "exp", local_dir, config={"trainer": {"total_training_steps": 5}})
    for step in (1, 2, 3):
        first.log({"critic/score/mean": step / 10}, step=step)
    ids = (first.backends["wandb"].wandb_run.id, first.backends["mlflow"].run_id)
    first.finish(failed=True)
    with Tracking(loggers, "proj", "exp", local_dir, config={"trainer": {"total_training_steps": 6}},
                  resume_step=2) as resumed:
        assert (resumed.backends["wandb"].wandb_run.id, resumed.backends["mlflow"].run_id) == ids
        for step in (3, 4, 5):
            resumed.log({"critic/score/mean": step / 10 + 0.01}, step=step)
    # offline, each attempt is a folder of its own under the one run id; a sync puts them together in that run
    attempts = [_wandb_offline_history(d) for d in sorted((local_dir / "wandb").glob("offline-run-*"))]
    assert attempts == [(ids[0], [{"critic/score/mean": step / 10, "_step": step} for step in (1, 2, 3)]),
                        (ids[0], [{"critic/score/mean": step / 10 + 0.01, "_step": step} for step in (3, 4, 5)])]
    client = local_mlflow(local_dir)
    [run] = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.run_id == ids[1] and run.info.status == "FINISHED"
    assert run.data.params["trainer.total_training_steps"] == "5"  # MLflow keeps a param's first value
    assert [m.step for m in client.get_metric_history(ids[1], "critic/score/mean")] == [1, 2, 3, 3, 4, 5]
    acc = EventAccumulator(str(local_dir / "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("critic/score/mean")] == \
        [(1, 0.1), (2, 0.2), (3, 0.31), (4, 0.41), (5, 0.51)]
    # a new run in the same folder (not a resume) starts runs of its own
    with Tracking(["mlflow"], "proj", "exp", local_dir) as fresh:
        assert fresh.backends["mlflow"].run_id != ids[1]


def test_tensorboard_keeps_the_stopped_runs_later_steps_until_a_resume_logs_past_its_checkpoint(tmp_path):
    """A run logged steps 1-3; a run on its step-2 checkpoint that validates it only (trainer.val_only) logs step 2
    and no later one: TensorBoard still shows step 3. A resume that logs its checkpoint's step first, then step 3,
    hides the first attempt's step 3 from there."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def points(key):
        acc = EventAccumulator(str(tmp_path / "tensorboard"))
        acc.Reload()
        return [(e.step, round(e.value, 4)) for e in acc.Scalars(key)]

    with Tracking(["tensorboard"], "p", "e", tmp_path) as first:
        for step in (1, 2, 3):
            first.log({"critic/score/mean": step / 10}, step=step)
    with Tracking(["tensorboard"], "p", "e", tmp_path, resume_step=2) as validated:
        validated.log({"val-core/s/acc/mean@1": 0.5}, step=2)
    assert points("critic/score/mean") == [(1, 0.1), (2, 0.2), (3, 0.3)]
    with Tracking(["tensorboard"], "p", "e", tmp_path, resume_step=2) as resumed:
        resumed.log({"val-core/s/acc/mean@1": 0.6}, step=2)
        resumed.log({"critic/score/mean": 0.31}, step=3)
    assert points("critic/score/mean") == [(1, 0.1), (2, 0.2), (3, 0.31)]
    assert points("val-core/s/acc/mean@1") == [(2, 0.5), (2, 0.6)]


def test_a_resume_opened_in_the_second_of_the_earlier_writers_is_read_after_them(tmp_path):
    """TensorBoard reads a folder's event files in name order: events.out.tfevents.<second>.<host>.<pid>.<n>, n
    counting the writers the process opened. Opened in one second as n goes from 9 to 10, the earlier run's file
    (.9) sorted after the resumed run's (.10): the stopped run's step 3 was read last and stayed on the curve."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    def points(key):
        acc = EventAccumulator(str(tmp_path / "tensorboard"))
        acc.Reload()
        return [(e.step, round(e.value, 4)) for e in acc.Scalars(key)]

    def number(path):  # the writer's place among those the process opened
        return int(path.name.rsplit(".", 1)[1])

    # writers elsewhere until the next one the process opens is numbered 9 (or 99, ...): the earlier run's
    elsewhere = tmp_path / "elsewhere"
    while True:
        SummaryWriter(log_dir=str(elsewhere)).close()
        last = max(number(path) for path in elsewhere.iterdir())
        if re.fullmatch(r"10+", str(last + 2)):
            break
    time.sleep(1 - time.time() % 1)  # the start of a second: the run and its resume open their writers in it
    with Tracking(["tensorboard"], "p", "e", tmp_path) as first:
        for step in (1, 2, 3):
            first.log({"critic/score/mean": step / 10}, step=step)
    with Tracking(["tensorboard"], "p", "e", tmp_path, resume_step=2) as resumed:
        resumed.log({"critic/score/mean": 0.31}, step=3)
    assert sorted(number(path) for path in (tmp_path / "tensorboard").iterdir()) == [last + 1, last + 2]
    assert points("critic/score/mean") == [(1, 0.1), (2, 0.2), (3, 0.31)]


def test_an_earlier_runs_records_are_set_aside_under_the_next_free_name(tmp_path):
    from rlhf_core.training.tracking import set_aside_run_files

    assert set_aside_run_files(tmp_path) == []  # nothing there, nothing moved
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "val_generations.jsonl").write_text('{"step": 1, "input": "q"}\n')
    assert set_aside_run_files(tmp_path) == [
        (tmp_path / "metrics.jsonl", tmp_path / "metrics.jsonl.prev"),
        (tmp_path / "val_generations.jsonl", tmp_path / "val_generations.jsonl.prev")]
    (tmp_path / "metrics.jsonl").write_text('{"step": 2}\n')
    (tmp_path / "metrics.jsonl.prev.2").write_text('{"step": 3}\n')  # taken as well: the next free one is .3
    assert set_aside_run_files(tmp_path) == [(tmp_path / "metrics.jsonl", tmp_path / "metrics.jsonl.prev.3")]
    assert not (tmp_path / "metrics.jsonl").exists()
    assert [(tmp_path / name).read_text() for name in ("metrics.jsonl.prev", "metrics.jsonl.prev.2",
                                                        "metrics.jsonl.prev.3", "val_generations.jsonl.prev")] == [
        '{"step": 1}\n', '{"step": 3}\n', '{"step": 2}\n', '{"step": 1, "input": "q"}\n']


def test_an_earlier_runs_tensorboard_events_and_run_ids_are_set_aside(tmp_path):
    """TensorBoard's folder (else it draws the new run's step 1 after the earlier run's last) and the wandb and
    MLflow run ids (else a resume of the new run goes on in the earlier run's) move aside with the records."""
    from rlhf_core.training.tracking import set_aside_run_files

    (tmp_path / "tensorboard").mkdir()
    assert set_aside_run_files(tmp_path) == []  # an empty folder holds no run's events
    (tmp_path / "tensorboard" / "events.out.tfevents.1").write_bytes(b"1")
    (tmp_path / "tracking_runs.json").write_text('{"wandb": "old"}\n')
    assert set_aside_run_files(tmp_path) == [(tmp_path / "tensorboard", tmp_path / "tensorboard.prev"),
                                             (tmp_path / "tracking_runs.json", tmp_path / "tracking_runs.json.prev")]
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out.tfevents.2").write_bytes(b"2")
    assert set_aside_run_files(tmp_path) == [(tmp_path / "tensorboard", tmp_path / "tensorboard.prev.2")]
    assert (tmp_path / "tensorboard.prev" / "events.out.tfevents.1").read_bytes() == b"1"
    assert (tmp_path / "tensorboard.prev.2" / "events.out.tfevents.2").read_bytes() == b"2"
    assert (tmp_path / "tracking_runs.json.prev").read_text() == '{"wandb": "old"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tensorboard.prev", "tensorboard.prev.2",
                                                          "tracking_runs.json.prev"]


def test_the_file_logger_writes_where_the_file_is_at_its_first_record(tmp_path):
    """Set up before an earlier run's file is moved aside (as a caller of the reward model's fit() may), it writes
    a new file, not into the one moved."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "old": 1}\n')
    with Tracking(["file"], "p", "e", tmp_path) as tracker:
        (tmp_path / "metrics.jsonl").rename(tmp_path / "metrics.jsonl.prev")
        tracker.log({"a": 1.0}, step=1)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "a": 1.0}\n'
    assert (tmp_path / "metrics.jsonl.prev").read_text() == '{"step": 1, "old": 1}\n'


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resume_moves_the_steps_the_stopped_run_logged_past_its_checkpoint_aside(tmp_path, capsys):
    """The stopped run logged steps 1 to 4 and began a fifth line, but saved at step 2: resumed from there, the file
    would hold steps 3 and 4 twice. At the resumed run's first step past 2 they move to a side file, in order."""
    earlier = [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}, {"step": 3, "a": 3.0}, {"step": 4, "a": 4.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier) + '{"step": 5, "a')
    (tmp_path / "val_generations.jsonl").write_text('{"step": 2, "input": "q2"}\n{"step": 4, "input": "q4"}\n')
    with Tracking(["file"], "p", "e", tmp_path, resume_step=2) as tracker:
        tracker.log({"a": 30.0}, step=3)
        tracker.log_generations([{"input": "q", "output": "o", "score": 1.0}], step=4)
        tracker.log({"a": 40.0}, step=4)
    assert _records(tmp_path / "metrics.jsonl") == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0},
                                                    {"step": 3, "a": 30.0}, {"step": 4, "a": 40.0}]
    assert (tmp_path / "metrics.jsonl.before_resume_from_step_2").read_text() == (
        '{"step": 3, "a": 3.0}\n{"step": 4, "a": 4.0}\n{"step": 5, "a\n')  # the line cut short kept, ended
    assert _records(tmp_path / "val_generations.jsonl") == [
        {"step": 2, "input": "q2"}, {"step": 4, "input": "q", "output": "o", "score": 1.0}]
    assert (tmp_path / "val_generations.jsonl.before_resume_from_step_2").read_text() == \
        '{"step": 4, "input": "q4"}\n'
    err = capsys.readouterr().err
    assert (f"notice: resumed from step 2: {tmp_path / 'metrics.jsonl'} held 3 line(s) logged after that checkpoint "
            "by the run that stopped (steps 3-4); moved to metrics.jsonl.before_resume_from_step_2 beside it") in err
    assert (f"{tmp_path / 'val_generations.jsonl'} held 1 line(s) logged after that checkpoint by the run that "
            "stopped (step 4); moved to val_generations.jsonl.before_resume_from_step_2") in err


def test_a_resumes_first_validation_samples_logged_before_its_metrics_stay_in_the_file(tmp_path):
    """The trainer logs a step's validation samples before its metrics. At the resumed run's first step past its
    checkpoint (2) the samples are that step's first record: the stopped run's step 3 moves aside before they are
    written, so they stay in the file and the side file holds the stopped run's sample alone."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "old": 1}\n')
    (tmp_path / "val_generations.jsonl").write_text('{"step": 2, "input": "q2"}\n{"step": 3, "input": "old3"}\n')
    with Tracking(["file"], "p", "e", tmp_path, resume_step=2) as tracker:
        tracker.log_generations([{"input": "new3", "output": "o", "score": 1.0}], step=3)
        tracker.log({"a": 1.0}, step=3)
    assert _records(tmp_path / "val_generations.jsonl") == [
        {"step": 2, "input": "q2"}, {"step": 3, "input": "new3", "output": "o", "score": 1.0}]
    assert (tmp_path / "val_generations.jsonl.before_resume_from_step_2").read_text() == \
        '{"step": 3, "input": "old3"}\n'
    assert _records(tmp_path / "metrics.jsonl") == [{"step": 1}, {"step": 2}, {"step": 3, "a": 1.0}]
    assert (tmp_path / "metrics.jsonl.before_resume_from_step_2").read_text() == '{"step": 3, "old": 1}\n'


def test_a_resume_logging_its_checkpoints_step_first_moves_the_later_steps_when_it_passes_it(tmp_path, capsys):
    """A run that only validates its checkpoint (step 2) leaves the later steps where they are; one that logs step 2
    and then goes on moves them as it passes, and its file, open by then, takes the records that follow."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "old": 1}\n')
    with Tracking(["file"], "p", "e", tmp_path, resume_step=2) as tracker:
        tracker.log({"val": 1.0}, step=2)
    assert [r["step"] for r in _records(tmp_path / "metrics.jsonl")] == [1, 2, 3, 2]
    assert not list(tmp_path.glob("*.before_resume*")) and "notice" not in capsys.readouterr().err
    with Tracking(["file"], "p", "e", tmp_path, resume_step=2) as tracker:
        tracker.log({"val": 2.0}, step=2)
        tracker.log({"new": 1.0}, step=3)
        tracker.log({"new": 2.0}, step=4)
    assert _records(tmp_path / "metrics.jsonl") == [{"step": 1}, {"step": 2}, {"step": 2, "val": 1.0},
                                                    {"step": 2, "val": 2.0}, {"step": 3, "new": 1.0},
                                                    {"step": 4, "new": 2.0}]
    assert (tmp_path / "metrics.jsonl.before_resume_from_step_2").read_text() == '{"step": 3, "old": 1}\n'
    # stopped again after logging step 3, resumed from step 2 once more: the next free side file
    with Tracking(["file"], "p", "e", tmp_path, resume_step=2) as tracker:
        tracker.log({"again": 1.0}, step=3)
    assert [r["step"] for r in _records(tmp_path / "metrics.jsonl")] == [1, 2, 2, 2, 3]
    assert _records(tmp_path / "metrics.jsonl.before_resume_from_step_2.2") == [{"step": 3, "new": 1.0},
                                                                              {"step": 4, "new": 2.0}]
    # a new run (no resume) appends as before: nothing moves
    with Tracking(["file"], "p", "e", tmp_path) as tracker:
        tracker.log({"b": 1.0}, step=1)
    assert [r["step"] for r in _records(tmp_path / "metrics.jsonl")] == [1, 2, 2, 2, 3, 1]
    assert len(list(tmp_path.glob("*.before_resume*"))) == 2


def test_a_ppo_run_stopped_after_a_save_and_a_later_step_holds_each_step_once_when_resumed(workspace, tmp_path,
                                                                                         monkeypatch, capsys):
    """Saved at step 2, step 3 logged, then the run dies in step 4: the same command resumes from step 2 and logs
    step 3 again. metrics.jsonl holds steps 1 to 4 once each, the stopped run's step 3 beside it; the history the
    pipeline step reads from it (whole_history) is the resumed run's."""
    from rlhf_core import main_ppo
    from rlhf_core.config import load_config
    from rlhf_core.pipeline.training import whole_history
    from rlhf_core.training.trainer import PPOTrainer

    out = tmp_path / "run"
    args = workspace.overrides(out, "trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=-1",
                               "trainer.logger=[file]")
    fit_step = PPOTrainer.fit_step

    def dies_in_step_4(self, *a, **k):
        if self.global_step == 3:
            raise RuntimeError("the machine went away")
        return fit_step(self, *a, **k)

    monkeypatch.setattr(PPOTrainer, "fit_step", dies_in_step_4)
    with pytest.raises(RuntimeError, match="the machine went away"):
        main_ppo.run(load_config(args))
    stopped = _records(out / "metrics.jsonl")
    assert [r["step"] for r in stopped] == [1, 2, 3]
    assert sorted(p.name for p in out.glob("global_step_*")) == ["global_step_2"]

    monkeypatch.setattr(PPOTrainer, "fit_step", fit_step)
    result = main_ppo.run(load_config(args))
    assert f"resumed from {out / 'global_step_2'}" in capsys.readouterr().err
    records = _records(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[:2] == stopped[:2]
    assert _records(out / "metrics.jsonl.before_resume_from_step_2") == stopped[2:]
    assert records[2]["timing_s/step"] != stopped[2]["timing_s/step"]  # the resumed run's own record of step 3
    assert [r["step"] for r in whole_history(result)] == [1, 2, 3, 4]
    assert whole_history(result)[2]["timing_s/step"] == records[2]["timing_s/step"]


def test_the_actors_hf_save_writes_no_bar_and_leaves_transformers_bars_as_they_were(tmp_path, capsys,
                                                                                     transformers_bars):
    """The actor's HF export at every checkpoint runs under the training bar, in a Ray worker's process too (where
    the driver's switches do not reach): it writes no "Writing model shards" bar or line of its own, and the bars
    of later loads are on again after it."""
    from types import SimpleNamespace

    from rlhf_core.models.loading import load_actor
    from rlhf_core.workers.actor import ActorWorker

    folder, _ = _tiny_model(tmp_path / "model")
    worker = SimpleNamespace(lora=False, sharded=False, base_dropout=None, module=load_actor(folder))
    capsys.readouterr()
    ActorWorker.save_hf(worker, tmp_path / "export")
    assert capsys.readouterr().err == ""
    assert (tmp_path / "export" / "model.safetensors").is_file() and transformers_bars.is_progress_bar_enabled()


class _Stream:
    def __init__(self, terminal: bool):
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


@pytest.mark.parametrize("stdout, stderr, set_before, after", [
    (True, True, None, (None, None)),  # a terminal keeps the libraries' colours
    (True, False, None, ("0", "true")),  # stderr to a file
    (False, True, None, ("0", "true")),  # stdout to a file
    (False, False, "1", ("1", "true")),  # Ray's colours the user asked for stay
], ids=["terminal", "stderr_to_file", "stdout_to_file", "user_set"])
def test_ray_and_zenml_colour_their_lines_only_where_both_streams_are_terminals(monkeypatch, stdout, stderr,
                                                                                set_before, after):
    from rlhf_core.progress import plain_colours

    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    monkeypatch.delenv("ZENML_LOGGING_COLORS_DISABLED", raising=False)
    if set_before is not None:
        monkeypatch.setenv("RAY_COLOR_PREFIX", set_before)
    monkeypatch.setattr(sys, "stdout", _Stream(stdout))
    monkeypatch.setattr(sys, "stderr", _Stream(stderr))
    plain_colours()
    assert (os.environ.get("RAY_COLOR_PREFIX"), os.environ.get("ZENML_LOGGING_COLORS_DISABLED")) == after


def test_zenml_lines_in_a_log_carry_no_colour_codes(tmp_path):
    """``rlhf-schedule ... > log``: ZenML writes each log line (a step's start and end, what a step logs) in ANSI
    colour escapes whatever the stream. Our commands import the pipeline package before ZenML, which then prints
    them plain into a file."""
    script = ("import rlhf_core.pipeline.lineage\n"  # (what rlhf-schedule, rlhf-lineage and rlhf-demo-summary import)
              "from zenml.logger import get_logger\n"
              "get_logger('rlhf.step').info('a line a step logs')\n")
    env = {key: value for key, value in os.environ.items() if key not in ("ZENML_LOGGING_COLORS_DISABLED",)}
    env.update(ZENML_CONFIG_PATH=str(tmp_path / "zenml"), ZENML_ANALYTICS_OPT_IN="false",
               ZENML_LOGGING_VERBOSITY="INFO")  # (the pipeline tests' module sets WARN for the whole session)
    log = tmp_path / "log"
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT, env=env,
                              timeout=120)
    text = log.read_text()
    assert done.returncode == 0 and text.splitlines()[-1:] == ["a line a step logs"], repr(text)
    assert "\x1b" not in text, repr(text)
