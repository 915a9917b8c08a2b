"""Progress bars that suit where the output goes.

On a terminal a bar is tqdm's, redrawn in place. Anywhere else (a file from ``nohup ... > log``, a CI log, a
ZenML step log, a pipe) a redrawn bar is a ``\\r`` frame each tenth of a second, and a bar under another one adds
cursor moves (``ESC[A``): a long run's log fills with frames nobody reads. There the bar is a :class:`LineBar`
instead: whole lines, one when the phase starts, then at most one every :data:`LOG_INTERVAL_S` seconds, and the
last count when it closes, each with the count, the rate and the time left.

Where one count takes minutes (a PPO step of a real model on a CPU), :meth:`TerminalBar.phase` and
:meth:`LineBar.phase` tell what the item under way is doing between two counts: on a terminal in the bar's postfix,
elsewhere as a line of its own where a phase starts :data:`LOG_INTERVAL_S` seconds or more into its item and after
the bar's last line, so that a slow item is told from a hung one and quick items add no line.

While a bar is drawn on a terminal, a line printed to stdout or stderr by other code (a notice, a warning) would
land after the bar's text on its line; :class:`TerminalBar` routes such lines around the bars instead.

transformers draws bars of its own ("Loading weights" at each model load, "Writing model shards" at each save):
:func:`route_transformers_bars` makes them follow the same rule, tqdm's bar on a terminal and lines elsewhere, and
:func:`routed_tqdm` does the same for a module of it that calls tqdm itself (its GGUF reader).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import ModuleType
from typing import Any

from tqdm import tqdm

#: seconds between two lines of a bar whose stream is not a terminal
LOG_INTERVAL_S = 30.0

#: a line of a bar with a known total (no bar drawing: its blocks say nothing a log reader needs)
_LINE_FORMAT = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
#: which model transformers' bars inside :func:`bars_about` are for (its folder, and its role where the load says it)
_ABOUT: ContextVar[str | None] = ContextVar("rlhf_transformers_bars_about", default=None)


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (False for one without ``isatty`` or closed)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # (no isatty, or a closed stream)
        return False


#: the variables that turn off the colour codes a library puts in its console lines, and their value for off
PLAIN_COLOURS = {"RAY_COLOR_PREFIX": "0", "ZENML_LOGGING_COLORS_DISABLED": "true"}


def plain_colours() -> None:
    """Where this process's output is not a terminal (``> log 2>&1``, CI, a pipeline's log), Ray and ZenML are
    told to print without colour: each wraps its prefixes in ANSI escapes whatever the stream (Ray's
    ``(HybridWorker pid=...)`` before every worker line, ZenML's step names and its every log line), and a log read
    as text held ``ESC[36m`` and ``ESC[37m`` on most of its lines. A value the user set is kept. Ray reads its
    variable as it prints; ZenML reads its own as it is first imported, so this comes before that."""
    if not (is_terminal(sys.stdout) and is_terminal(sys.stderr)):
        for name, value in PLAIN_COLOURS.items():
            os.environ.setdefault(name, value)


class LineBar(tqdm):
    """A tqdm bar written as whole lines, for a stream that is not a terminal: nothing is redrawn or cleared, no
    cursor moves; a line when the bar starts, then one at most every ``mininterval`` seconds where the count moved,
    and one of the final count at close (``leave=False`` too: a log keeps what was done)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._shown: tuple[float, float] | None = None  # (count, time) of the last line of the count written
        self._last_line = float("-inf")  # the time of the last line written, of the count or of a phase
        self._item: str | None = None  # the item whose phases _done times
        self._item_started = float("-inf")  # the time its first phase started
        self._done: dict[str, float] = {}  # seconds of each of its phases that ended, in the order they ended
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg == "":  # a clear (at close): nothing written can be taken back (False: nor a "\r" after it)
            return False
        now = self._time()
        if self._shown is not None and (self.n == self._shown[0] or now - self._shown[1] < self.mininterval):
            return True  # nothing new, or too soon (tqdm.write redraws the bar after each message)
        self._write_line(msg)
        return True

    def _write_line(self, msg: str | None = None) -> None:
        self._shown = (self.n, self._time())
        self._put(self.__str__() if msg is None else msg)

    def _put(self, line: str) -> None:
        self._last_line = self._time()
        self.fp.write(line + "\n")
        self.fp.flush()

    @contextmanager
    def phase(self, name: str, item: str) -> Iterator[None]:
        """While ``item`` (the one under way, e.g. ``step 3/10``) is in its phase ``name``: a line
        ``<item>: <name> (<phase> <s> s, ... done)`` as the phase starts, naming the seconds each of the item's
        earlier phases took, where both the item has run and the bar has written no line (of the count or of a
        phase) for ``mininterval`` seconds, none otherwise: quick items add none, however long the run, and the
        count's own lines keep their rule (a phase line never holds one back)."""
        if self.disable:
            yield
            return
        started = self._time()
        if item != self._item:
            self._item, self._done, self._item_started = item, {}, started
        if started - max(self._last_line, self._item_started) >= self.mininterval:
            done = ", ".join(f"{phase} {seconds:.0f} s" for phase, seconds in self._done.items())
            self._put(f"{item}: {name}" + (f" ({done} done)" if done else ""))
        try:
            yield
        finally:
            self._done[name] = self._done.get(name, 0.0) + self._time() - started

    def clear(self, nolock: bool = False) -> None:
        """Nothing to clear: every line stays."""

    def moveto(self, n: int) -> None:
        """No cursor moves: a bar under another one writes its lines below the other's."""

    def close(self) -> None:
        # the final line's rate is the whole run's average, as tqdm's own close gives it (not the smoothed rate as
        # it stood at the line before, which leaves out what the last interval counted)
        self._ema_dt = lambda: None
        if not self.disable and self._shown is not None and self.n != self._shown[0]:
            self._write_line()  # the final count, however soon after the last line
        self.leave = False  # (tqdm's close would otherwise draw the bar once more, and end it with "\n")
        super().close()


class _AroundBars:
    """Stands for ``sys.stdout`` / ``sys.stderr`` while a bar is on the terminal: each whole line written is put
    above the bars (they are cleared, the line written, the bars drawn again), as ``tqdm.write`` does; a line
    without its newline yet waits for it."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.held = ""

    def write(self, text: str) -> int:
        written, text = len(text), self.held + text
        if TerminalBar._open == 0:  # (the last bar closed while other code held this stream)
            self.held = ""
            self.stream.write(text)
            return written
        cut = text.rfind("\n") + 1
        self.held = text[cut:]
        if cut:
            with tqdm.get_lock():
                bars = [bar for bar in list(tqdm._instances) if not bar.disable]
                for bar in bars:
                    bar.clear(nolock=True)
                self.stream.write(text[:cut])
                self.stream.flush()
                for bar in bars:
                    bar.refresh(nolock=True)
        return written

    def flush(self) -> None:
        self.stream.flush()

    def release(self) -> None:
        """Write what waits for its newline (the bars are gone)."""
        if self.held:
            self.stream.write(self.held)
            self.held = ""
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, fileno ...: the stream's own
        return getattr(self.stream, name)


class TerminalBar(tqdm):
    """tqdm's bar on a terminal; while one is open, lines printed to stdout and stderr pass around the bars."""

    _open = 0  # bars open now, of this kind
    _streams: tuple[Any, Any] | None = None  # (stdout, stderr) as they were before the first one opened

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.disable:
            return
        with self.get_lock():
            if TerminalBar._open == 0:
                TerminalBar._streams = (sys.stdout, sys.stderr)
                sys.stdout, sys.stderr = _AroundBars(sys.stdout), _AroundBars(sys.stderr)
            TerminalBar._open += 1

    @contextmanager
    def phase(self, name: str, item: str) -> Iterator[None]:
        """While ``item`` (the one under way, e.g. ``step 3/10``) is in its phase ``name``, the bar's postfix says
        ``<item>: <name>``, drawn as the phase starts (one frame a phase); as it ends the postfix is what it was
        before, drawn with the bar's next frame."""
        if self.disable:
            yield
            return
        before = self.postfix or ""  # (an enclosing phase's, or none)
        self.set_postfix_str(f"{item}: {name}")
        try:
            yield
        finally:
            self.set_postfix_str(before, refresh=False)

    def close(self) -> None:
        counted = not self.disable
        super().close()
        if not counted:
            return
        with self.get_lock():
            TerminalBar._open -= 1
            if TerminalBar._open == 0 and TerminalBar._streams is not None:
                for name, before in zip(("stdout", "stderr"), TerminalBar._streams):
                    now = getattr(sys, name)
                    if isinstance(now, _AroundBars):
                        now.release()
                    if now is not before and isinstance(now, _AroundBars):  # (not where other code replaced it)
                        setattr(sys, name, before)
                TerminalBar._streams = None


def progress_bar(iterable: Any = None, *, total: float | None = None, desc: str, unit: str = "it",
                 file: Any = None, initial: float = 0, leave: bool = True, disable: bool = False,
                 interval: float = LOG_INTERVAL_S) -> TerminalBar | LineBar:
    """A progress bar on ``file`` (stderr by default): tqdm's own on a terminal, a :class:`LineBar` (a line every
    ``interval`` seconds) on any other stream. ``TQDM_DISABLE=1`` in the environment turns both off."""
    file = _bar_stream(file)
    settings = {"disable": True} if disable else {}  # (else tqdm's default, which TQDM_DISABLE sets)
    kwargs = dict(total=total, desc=desc, unit=unit, initial=initial, leave=leave, **settings)
    if is_terminal(file):
        return TerminalBar(iterable, file=file, dynamic_ncols=True, **kwargs)
    return _line_bar((iterable,), kwargs, file, interval)


def _bar_stream(file: Any) -> Any:
    """The stream a bar bound for ``file`` (None: stderr) draws on: a bar's own frames go straight to the terminal,
    past the wrapper that keeps other output off the bar (:class:`_AroundBars`)."""
    file = sys.stderr if file is None else file
    return file.stream if isinstance(file, _AroundBars) else file


def _line_bar(args: tuple, kwargs: dict, file: Any, interval: float = LOG_INTERVAL_S) -> LineBar:
    """The :class:`LineBar` for a stream that is not a terminal, with tqdm's ``args`` and ``kwargs``: a line every
    ``interval`` seconds, its count out of the total where one is known (given, or the iterable's length)."""
    total = kwargs.get("total")
    if total is None and args and hasattr(args[0], "__len__"):
        total = len(args[0])
    return LineBar(*args, **{**kwargs, "file": file, "mininterval": interval,
                             "bar_format": _LINE_FORMAT if total else None})


def _transformers_bar(factory: Any, args: tuple, kwargs: dict) -> Any:
    """A bar transformers asked for, made by the rule of :func:`progress_bar`: ``factory``'s own (tqdm's, or its
    stand-in that draws nothing where transformers' bars are off) on a terminal, a :class:`LineBar` elsewhere."""
    stream = _bar_stream(kwargs.get("file"))
    if (about := _ABOUT.get()) is not None and kwargs.get("desc"):
        kwargs = {**kwargs, "desc": f"{kwargs['desc']} ({about})"}
    if not (isinstance(factory, type) and issubclass(factory, tqdm)) or is_terminal(stream):
        return factory(*args, **kwargs)
    return _line_bar(args, kwargs, stream)


def route_transformers_bars() -> None:
    """Have transformers' own bars drawn as this module draws its bars: on a stream that is not a terminal (a log
    file, a pipe, a ZenML step's log, a Ray worker's output) the "Loading weights" bar of each model load was a run of
    ``\\r`` frames; it is now a line when the load starts and one of its last count (and one every
    :data:`LOG_INTERVAL_S` seconds of a long load between them).

    It sets transformers' tqdm hook (``transformers.utils.logging.set_tqdm_hook``) once for the process rather than
    turning the bars off around each load or save of ours: those happen in many places (and in Ray's worker
    processes), and a switch around each is one more to forget with every new call. What it changes of the process is
    kept to the bars bound for a stream that is not a terminal: on a terminal the hook gives back transformers' own
    bar, unchanged; where transformers' bars are off (``disable_progress_bar``, ``HF_HUB_DISABLE_PROGRESS_BARS=1``)
    they stay off; and a hook that other code set before is left in place. (A load of the caller's own in the same
    process, bound for a log, writes lines too: what a log needs whoever loads.) Calling it again does nothing."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.set_tqdm_hook(_transformers_bar)
    if before is not None and before is not _transformers_bar:  # (someone else's: theirs decides)
        hf_logging.set_tqdm_hook(before)


@contextmanager
def bars_about(about: str) -> Iterator[None]:
    """transformers' bars drawn inside the block (:func:`route_transformers_bars`) say ``about`` after their own
    words: "Loading weights" alone, twice for each of the actor's, the critic's and the reward model's loads, left
    a log's reader to guess which model each was."""
    token = _ABOUT.set(about)
    try:
        yield
    finally:
        _ABOUT.reset(token)


@contextmanager
def routed_tqdm(module: ModuleType) -> Iterator[None]:
    """For the block, the bars ``module`` makes through its own ``tqdm`` name follow the rule of
    :func:`route_transformers_bars`: for a module of transformers that calls tqdm itself, which its hook does not
    reach (``transformers.modeling_gguf_pytorch_utils``, whose "Converting and de-quantizing GGUF tensors" bar
    wrote a ``\\r`` frame per tensor into a log). The name is put back after the block, so only the calls made
    inside it (ours) are changed; a module without the name is left as it is."""
    made = getattr(module, "tqdm", None)
    if made is None:
        yield
        return
    module.tqdm = lambda *args, **kwargs: _transformers_bar(made, args, kwargs)
    try:
        yield
    finally:
        module.tqdm = made


@contextmanager
def transformers_bars(shown: bool) -> Iterator[None]:
    """transformers' own bars shown (``shown``) or hidden for the block, and as they were after it: hidden where a
    load or save of ours runs under a bar of ours (a "Writing model shards" bar at every save inside the training
    bar, on a terminal too)."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if shown else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()
