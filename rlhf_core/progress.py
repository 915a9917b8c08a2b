"""Progress bars that suit where the output goes.

On a terminal a bar is tqdm's, redrawn in place. Anywhere else (a file from ``nohup ... > log``, a CI log, a
ZenML step log, a pipe) a redrawn bar is a ``\\r`` frame each tenth of a second, and a bar under another one adds
cursor moves (``ESC[A``): a long run's log fills with frames nobody reads. There the bar is a :class:`LineBar`
instead: whole lines, one when the phase starts, then at most one every :data:`LOG_INTERVAL_S` seconds, and the
last count when it closes, each with the count, the rate and the time left.

While a bar is drawn on a terminal, a line printed to stdout or stderr by other code (a notice, a warning) would
land after the bar's text on its line; :class:`TerminalBar` routes such lines around the bars instead.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm

#: seconds between two lines of a bar whose stream is not a terminal
LOG_INTERVAL_S = 30.0

#: a line of a bar with a known total (no bar drawing: its blocks say nothing a log reader needs)
_LINE_FORMAT = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # (no isatty, or a closed stream)
        return False


class LineBar(tqdm):
    """A tqdm bar written as whole lines, for a stream that is not a terminal: nothing is redrawn or cleared, no
    cursor moves; a line when the bar starts, then one at most every ``mininterval`` seconds where the count moved,
    and one of the final count at close (``leave=False`` too: a log keeps what was done)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._shown: tuple[float, float] | None = None  # (count, time) of the last line written
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
        self.fp.write((self.__str__() if msg is None else msg) + "\n")
        self.fp.flush()

    def clear(self, nolock: bool = False) -> None:
        """Nothing to clear: every line stays."""

    def moveto(self, n: int) -> None:
        """No cursor moves: a bar under another one writes its lines below the other's."""

    def close(self) -> None:
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
                 interval: float = LOG_INTERVAL_S) -> tqdm:
    """A progress bar on ``file`` (stderr by default): tqdm's own on a terminal, a :class:`LineBar` (a line every
    ``interval`` seconds) on any other stream. ``TQDM_DISABLE=1`` in the environment turns both off."""
    file = sys.stderr if file is None else file
    if isinstance(file, _AroundBars):  # a bar's own frames go straight to the terminal
        file = file.stream
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    settings = {"disable": True} if disable else {}  # (else tqdm's default, which TQDM_DISABLE sets)
    if _is_terminal(file):
        return TerminalBar(iterable, total=total, desc=desc, unit=unit, file=file, initial=initial, leave=leave,
                           dynamic_ncols=True, **settings)
    return LineBar(iterable, total=total, desc=desc, unit=unit, file=file, initial=initial, leave=leave,
                   mininterval=interval, bar_format=_LINE_FORMAT if total else None, **settings)
