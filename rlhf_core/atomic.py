"""Publishing files and directories atomically: build beside the target, fsync, rename into place.

A reader (another process, or this one after a crash) sees either the old target or the complete
new one, never a half-written one::

    with staged_directory(out, replace=True) as staging:
        model.save_pretrained(staging)          # out appears only if this block finishes

    write_text_atomic(root / "latest_checkpointed_iteration.txt", "12\\n")

The staging folder lies in the target's own directory, so the final move is a rename on one
filesystem. Its name starts with ``.<target name>.tmp-<pid>-`` and a replaced target is set aside as
``.<target name>.old-<pid>-...`` (a staged file is ``.<name>.<pid>-XXXX.tmp``): a process killed midway
leaves only such dot-names, which the owner of the directory may sweep up (checkpoints do, and the GGUF
import its own staging folders: :func:`remove_stale_staging`), skipping
those whose process still runs (:func:`staging_owner`, :func:`running_elsewhere`): another run writing into
the same directory. This module imports nothing of the project.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path


def current_umask() -> int:
    """The process's umask: read from /proc/self/status where Linux gives it, else by setting it and setting it
    back at once (a file another thread makes in between would get the placeholder's mask)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def give_usual_modes(folder: str | os.PathLike) -> None:
    """Give ``folder``, the folders and the files under it the modes a plain ``mkdir`` / ``open`` would
    (0o777 / 0o666 less the umask): ``mkdtemp`` and some writers make them private to their owner."""
    mask = current_umask()
    for parent, _, files in os.walk(folder):
        os.chmod(parent, 0o777 & ~mask)
        for name in files:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory, so that the names created or renamed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file and directory under ``path`` (files written by other libraries' save functions)."""
    for folder, _, files in os.walk(path):
        for name in files:
            file = os.path.join(folder, name)
            if os.path.islink(file):
                continue
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(folder)


def _aside_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.old-{os.getpid()}-{time.monotonic_ns()}")


# the names this module gives its staging folders, set-aside targets and staged files, with the pid of their process
_OWNED = re.compile(r"\..+\.(?:tmp-(\d+)-\w+|old-(\d+)-\d+|(\d+)-\w+\.tmp)")


def staging_owner(name: str) -> int | None:
    """The pid of the process that made a staging folder, set-aside target or staged file of this module
    named ``name``; None for any other name (also those of older versions, which recorded no pid)."""
    match = _OWNED.fullmatch(name)
    if not match:
        return None
    return int(next(group for group in match.groups() if group is not None))


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (another host's, on a shared filesystem, cannot be told:
    a sweep then takes its leftovers as stale, as it would without the pid)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except PermissionError:  # it does, as another user's
        return True
    except (OSError, OverflowError):
        return False
    return True


def running_elsewhere(owner: int | None) -> bool:
    """Whether ``owner``, the pid a leftover's name carries, is another process still running on this machine: its
    leftovers are in use. This process's own are an earlier attempt's that failed (a pipeline step retried in the
    same process, or a pid reused by a restarted container); a name without a pid answers False."""
    return owner is not None and owner != os.getpid() and process_alive(owner)


def remove_stale_staging(target: str | os.PathLike) -> list[Path]:
    """Remove the staging folders (``.<target name>.tmp-<pid>-...``) that a killed process left beside ``target``
    (a SIGKILLed model import leaves hundreds of MB there); those of a process still running on this machine are
    kept (another writer of the same target), and so are set-aside targets, one of which may hold the only copy of a
    target whose replacement was cut short. Returns the folders removed."""
    target = Path(target)
    if not target.parent.is_dir():
        return []
    removed = []
    for child in target.parent.iterdir():
        if not child.name.startswith(f".{target.name}.tmp-") or not child.is_dir():
            continue
        owner = staging_owner(child.name)
        if owner is None or running_elsewhere(owner):
            continue
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child)
    return removed


@contextlib.contextmanager
def staged_directory(
    target: str | os.PathLike,
    replace: bool = False,
    *,
    keep_existing: Callable[[Path], bool] | None = None,
    after_move: Callable[[], None] | None = None,
    usual_modes: bool = True,
) -> Iterator[Path]:
    """Yield an empty staging folder beside ``target``; on a clean exit publish it as ``target``.

    Publishing gives the usual modes (``usual_modes``; False keeps the staging folder's
    owner-only 0o700), fsyncs the whole tree, renames it to ``target`` and fsyncs the parent.
    On an exception inside the block the staging folder is removed, ``target`` is left as it
    was, and the exception propagates. The parent directory is created if missing.

    Where ``target`` already exists when the block ends:

    * ``keep_existing(target)`` true: it is kept and the staged folder discarded (another process
      published an equivalent result first). Also asked when the rename fails because such a
      result appeared at that moment;
    * otherwise, without ``replace``: :class:`FileExistsError`, and nothing changes;
    * with ``replace``: the old target is renamed aside, the new one renamed into place, and the
      old one removed only then. If the rename fails the old one is put back.

    ``after_move()`` runs once the new folder is in place and before an old one is removed (e.g.
    marking it the latest checkpoint); if it raises, the new folder is removed, the old one put
    back, and its exception propagates.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    try:
        yield staging
        if usual_modes:
            give_usual_modes(staging)
        fsync_tree(staging)
        _publish(staging, target, replace, keep_existing, after_move)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, target: Path, replace: bool, keep_existing: Callable[[Path], bool] | None,
             after_move: Callable[[], None] | None) -> None:
    aside: Path | None = None
    if target.exists():
        if keep_existing is not None and keep_existing(target):
            return
        if not replace:
            raise FileExistsError(f"{target} already exists; remove it or publish with replace=True")
        aside = _aside_name(target)
        os.rename(target, aside)
    try:
        os.rename(staging, target)
    except OSError:
        if aside is not None and not target.exists():
            os.rename(aside, target)
            raise
        if target.exists() and keep_existing is not None and keep_existing(target):
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)
            return
        raise
    try:
        fsync_dir(target.parent)
        if after_move is not None:
            after_move()
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        if aside is not None and not target.exists():
            os.rename(aside, target)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def staged_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on a clean exit it replaces ``path`` atomically.

    The block writes the file at the yielded path (by name: ``to_parquet(tmp)``, ``open(tmp, "w")``).
    On exit it gets the usual mode (0o666 less the umask), is fsynced, renamed over ``path`` with
    ``os.replace``, and the directory fsynced. On an exception the temporary file is removed.
    """
    with staged_files([path]) as (tmp,):
        yield tmp


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold a SIGINT or SIGTERM that arrives inside the block back until it ends, then raise it (its handler
    runs then: a Ctrl-C's KeyboardInterrupt). Python runs signal handlers in the main thread whichever thread the
    signal reaches, so only the main thread's block is held (other threads are not interrupted by them), and
    only a handler Python set can be swapped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    previous = {number: handler for number, handler in previous.items() if handler is not None}
    for number in previous:
        signal.signal(number, lambda received, frame: caught.append(received))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if caught:
        signal.raise_signal(caught[0])


@contextlib.contextmanager
def staged_files(paths: Iterable[str | os.PathLike]) -> Iterator[list[Path]]:
    """:func:`staged_file` for several files that are to change together: a temporary path beside each of
    ``paths``; on a clean exit every one is given its mode and fsynced, and only then are they renamed into
    place, one after the other with SIGINT and SIGTERM held back (:func:`signals_held`: a Ctrl-C arrives once all
    are in place and their folders synced), so that a failure or an interruption before that leaves every path
    as it was. On an exception the temporary files are removed."""
    paths = [Path(path) for path in paths]
    temps: list[Path] = []
    try:
        for path in paths:
            fd, name = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}-", suffix=".tmp", dir=path.parent)
            os.close(fd)
            temps.append(Path(name))
        yield temps
        mode = 0o666 & ~current_umask()
        for tmp in temps:
            os.chmod(tmp, mode)
            with open(tmp, "rb") as handle:
                os.fsync(handle.fileno())
        with signals_held():
            for tmp, path in zip(temps, paths):
                os.replace(tmp, path)
            for folder in dict.fromkeys(path.parent for path in paths):
                fsync_dir(folder)
    finally:
        for tmp in temps:
            tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically: readers see the old text or the new, whole."""
    with staged_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
