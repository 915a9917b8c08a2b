"""Publishing directories and files atomically (rlhf_core.atomic)."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys

import pytest

from rlhf_core import atomic
from rlhf_core.atomic import staged_directory, write_text_atomic


def _entries(folder):
    return sorted(p.name for p in folder.iterdir())


def _contents(folder):
    return {p.name: p.read_text() for p in folder.iterdir()}


@pytest.fixture
def old(tmp_path):
    """An existing target holding one file."""
    target = tmp_path / "model"
    target.mkdir()
    (target / "old.txt").write_text("old")
    return target


@pytest.fixture
def umask(request):
    """The umask set to the test's parameter: 0o027 keeps the group from writing, 0o002 (a folder shared by a
    group) lets it, which a mode built from 0o755 or 0o644 rather than 0o777 or 0o666 would take away."""
    before = os.umask(request.param)
    yield request.param
    os.umask(before)


def test_target_appears_only_on_a_clean_exit(tmp_path):
    target = tmp_path / "sub" / "model"  # the parent is created
    with staged_directory(target) as staging:
        assert staging.parent == target.parent and staging.name.startswith(".model.tmp-")
        (staging / "weights.bin").write_text("w")
        (staging / "nested").mkdir()
        (staging / "nested" / "a.txt").write_text("a")
        assert not target.exists()
    assert _entries(target) == ["nested", "weights.bin"]
    assert (target / "weights.bin").read_text() == "w" and (target / "nested" / "a.txt").read_text() == "a"
    assert _entries(target.parent) == ["model"]


def test_an_exception_inside_leaves_no_target_and_no_staging(tmp_path):
    target = tmp_path / "model"
    with pytest.raises(RuntimeError, match="build failed"):
        with staged_directory(target) as staging:
            (staging / "half.bin").write_text("half")
            raise RuntimeError("build failed")
    assert _entries(tmp_path) == []


def test_an_exception_inside_leaves_an_existing_target_untouched(old):
    with pytest.raises(KeyboardInterrupt):
        with staged_directory(old, replace=True) as staging:
            (staging / "new.txt").write_text("new")
            raise KeyboardInterrupt
    assert _contents(old) == {"old.txt": "old"}
    assert _entries(old.parent) == ["model"]


def test_replace_swaps_in_the_new_content_and_removes_the_old(old):
    with staged_directory(old, replace=True) as staging:
        (staging / "new.txt").write_text("new")
    assert _contents(old) == {"new.txt": "new"}
    assert _entries(old.parent) == ["model"]  # the old one set aside is gone too


def test_without_replace_an_existing_target_is_an_error_and_stays(old):
    with pytest.raises(FileExistsError, match="model already exists"):
        with staged_directory(old) as staging:
            (staging / "new.txt").write_text("new")
    assert _contents(old) == {"old.txt": "old"}
    assert _entries(old.parent) == ["model"]


@pytest.mark.parametrize("replace", [False, True])
def test_keep_existing_keeps_an_accepted_target_and_discards_the_staged_one(old, replace):
    with staged_directory(old, replace=replace, keep_existing=lambda folder: (folder / "old.txt").exists()) as s:
        (s / "new.txt").write_text("new")
    assert _contents(old) == {"old.txt": "old"}
    assert _entries(old.parent) == ["model"]


def test_keep_existing_refusing_the_target_lets_replace_go_ahead(old):
    with staged_directory(old, replace=True, keep_existing=lambda folder: False) as staging:
        (staging / "new.txt").write_text("new")
    assert _contents(old) == {"new.txt": "new"}


def _failing_rename_into(target, monkeypatch, before_failing=None):
    """os.rename raises (EXDEV) when it is asked to move a staging folder onto ``target``."""
    real = os.rename

    def rename(src, dst):
        if os.fspath(dst) == os.fspath(target) and ".tmp-" in os.fspath(src):
            if before_failing is not None:
                before_failing()
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename)


def test_a_failed_move_puts_the_old_target_back(old, monkeypatch):
    _failing_rename_into(old, monkeypatch)
    with pytest.raises(OSError, match="cross-device"):
        with staged_directory(old, replace=True) as staging:
            (staging / "new.txt").write_text("new")
    assert _contents(old) == {"old.txt": "old"}
    assert _entries(old.parent) == ["model"]


def test_a_failed_move_without_a_target_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "model"
    _failing_rename_into(target, monkeypatch)
    with pytest.raises(OSError, match="cross-device"):
        with staged_directory(target) as staging:
            (staging / "new.txt").write_text("new")
    assert _entries(tmp_path) == []


def test_a_concurrent_writer_that_wins_the_race_is_kept_when_accepted(tmp_path, monkeypatch):
    target = tmp_path / "model"

    def theirs_lands_first():
        target.mkdir()
        (target / "done").write_text("theirs")

    _failing_rename_into(target, monkeypatch, theirs_lands_first)
    with staged_directory(target, keep_existing=lambda folder: (folder / "done").exists()) as staging:
        (staging / "done").write_text("mine")
    assert _contents(target) == {"done": "theirs"}
    assert _entries(tmp_path) == ["model"]


def test_a_concurrent_writer_that_wins_the_race_over_a_replaced_target_leaves_no_set_aside_copy(old, monkeypatch):
    """The old target (refused by keep_existing: unfinished) is set aside before the move; when another writer's
    accepted result lands first, the set-aside copy is removed rather than left beside it."""

    def theirs_lands_first():
        old.mkdir()
        (old / "done").write_text("theirs")

    _failing_rename_into(old, monkeypatch, theirs_lands_first)
    with staged_directory(old, replace=True, keep_existing=lambda folder: (folder / "done").exists()) as staging:
        (staging / "done").write_text("mine")
    assert _contents(old) == {"done": "theirs"}
    assert _entries(old.parent) == ["model"]  # no .model.old-<pid>-... left


def test_a_concurrent_writer_that_is_not_accepted_makes_the_move_fail(tmp_path, monkeypatch):
    target = tmp_path / "model"
    _failing_rename_into(target, monkeypatch, lambda: target.mkdir())
    with pytest.raises(OSError, match="cross-device"):
        with staged_directory(target, keep_existing=lambda folder: (folder / "done").exists()) as staging:
            (staging / "done").write_text("mine")
    assert _entries(tmp_path) == ["model"] and _entries(target) == []


def test_after_move_runs_with_the_new_target_in_place_and_a_failure_restores_the_old(old):
    seen = []

    def mark():
        seen.append(_contents(old))
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        with staged_directory(old, replace=True, after_move=mark) as staging:
            (staging / "new.txt").write_text("new")
    assert seen == [{"new.txt": "new"}]
    assert _contents(old) == {"old.txt": "old"}
    assert _entries(old.parent) == ["model"]


def test_after_move_failing_without_an_old_target_removes_the_new_one(tmp_path):
    target = tmp_path / "model"
    with pytest.raises(ValueError):
        with staged_directory(target, after_move=lambda: int("x")) as staging:
            (staging / "new.txt").write_text("new")
    assert _entries(tmp_path) == []


@pytest.mark.parametrize("umask, folder_mode, file_mode", [(0o027, 0o750, 0o640), (0o002, 0o775, 0o664)],
                         indirect=["umask"])
def test_published_folders_get_the_usual_modes(tmp_path, umask, folder_mode, file_mode):
    target = tmp_path / "model"
    with staged_directory(target) as staging:
        (staging / "nested").mkdir()
        for path in (staging / "a.txt", staging / "nested" / "b.txt"):
            path.write_text("x")
            os.chmod(path, 0o600)  # as some writers leave them
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in [target, target / "a.txt", target / "nested", target / "nested" / "b.txt"]}
    assert modes == {"model": folder_mode, "model/a.txt": file_mode, "model/nested": folder_mode,
                     "model/nested/b.txt": file_mode}


@pytest.mark.parametrize("umask", [0o027], indirect=True)
def test_usual_modes_off_keeps_the_staging_folder_private(tmp_path, umask):
    target = tmp_path / "model"
    with staged_directory(target, usual_modes=False) as staging:
        (staging / "a.txt").write_text("x")
    assert stat.S_IMODE(target.stat().st_mode) == 0o700
    assert stat.S_IMODE((target / "a.txt").stat().st_mode) == 0o640  # as open() made it


@pytest.mark.parametrize("umask, mode", [(0o027, 0o640), (0o002, 0o664)], indirect=["umask"])
def test_write_text_atomic_writes_replaces_and_leaves_no_temp_file(tmp_path, umask, mode):
    path = tmp_path / "latest.txt"
    write_text_atomic(path, "1\n")
    write_text_atomic(path, "2\n")
    assert path.read_text() == "2\n"
    assert _entries(tmp_path) == ["latest.txt"]
    assert stat.S_IMODE(path.stat().st_mode) == mode  # not mkstemp's 0o600


def _recorded_fsyncs(monkeypatch):
    """The paths os.fsync is called on, in order (read from the descriptor, as it is named at that moment)."""
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    return synced


def test_a_published_folder_is_synced_whole_before_the_move_and_its_parent_after_it(tmp_path, monkeypatch):
    """A crash after the rename must find every file's data on disk (other libraries' save functions do not sync
    them), and the rename itself needs the parent synced."""
    synced = _recorded_fsyncs(monkeypatch)
    with staged_directory(tmp_path / "model") as staging:
        (staging / "nested").mkdir()
        (staging / "weights.bin").write_text("w")
        (staging / "nested" / "a.txt").write_text("a")
    parent = str(tmp_path.resolve())
    staged = os.path.join(parent, staging.name)  # (synced under the staging name: before the move)
    assert sorted(synced[:-1]) == sorted([staged, f"{staged}/weights.bin", f"{staged}/nested",
                                          f"{staged}/nested/a.txt"]), synced
    assert synced[-1] == parent, synced


def test_write_text_atomic_syncs_the_file_then_its_folder(tmp_path, monkeypatch):
    synced = _recorded_fsyncs(monkeypatch)
    write_text_atomic(tmp_path / "latest.txt", "1\n")
    parent = tmp_path.resolve()
    assert len(synced) == 2, synced
    assert os.path.dirname(synced[0]) == str(parent), synced
    assert atomic.staging_owner(os.path.basename(synced[0])) == os.getpid(), synced  # the staged file
    assert synced[1] == str(parent), synced


def test_write_text_atomic_failing_keeps_the_old_text_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "latest.txt"
    path.write_text("1\n")

    def replace(src, dst):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(OSError, match="I/O error"):
        write_text_atomic(path, "2\n")
    assert path.read_text() == "1\n"
    assert _entries(tmp_path) == ["latest.txt"]


def test_staging_names_record_the_process_that_made_them(tmp_path):
    """So that a sweep of leftovers can spare those of a process still running (another run in the same folder)."""
    pid = os.getpid()
    with staged_directory(tmp_path / "model") as staging:
        assert atomic.staging_owner(staging.name) == pid
    assert atomic.staging_owner(atomic._aside_name(tmp_path / "model").name) == pid
    names = []
    with atomic.staged_file(tmp_path / "latest.txt") as tmp:
        names.append(tmp.name)
        tmp.write_text("1\n")
    assert names[0].startswith(".latest.txt.") and names[0].endswith(".tmp")
    assert atomic.staging_owner(names[0]) == pid
    # older names recorded no pid, and other names are none of this module's
    for name in (".model.tmp-k2j3x9_a", ".latest.txt.a1b2c3d4.tmp", "model", ".model", "latest.txt"):
        assert atomic.staging_owner(name) is None, name


def test_process_alive():
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    assert atomic.process_alive(os.getpid())
    assert not atomic.process_alive(ended.pid)
    assert not atomic.process_alive(0) and not atomic.process_alive(-1)  # never a signal to a process group
    # a leftover is in use only where its pid is another process that runs: this one's are a failed attempt's
    assert atomic.running_elsewhere(os.getppid())
    assert not atomic.running_elsewhere(os.getpid())
    assert not atomic.running_elsewhere(ended.pid) and not atomic.running_elsewhere(None)


def test_another_users_process_is_alive(monkeypatch):
    """Signal 0 to another user's process is refused (EPERM): it exists, so its leftovers are in use."""

    def kill(pid, number):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(atomic.os, "kill", kill)
    other = os.getpid() + 1
    assert atomic.process_alive(other)
    assert atomic.running_elsewhere(other)


def test_stale_staging_of_a_target_is_removed_but_a_running_writers_and_a_set_aside_target_are_kept(tmp_path):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    dead, alive = ended.pid, os.getppid()  # a process that has ended, and one that runs (pytest's parent)
    names = {f".model.tmp-{dead}-k2j3x9_a": "removed", f".model.tmp-{alive}-p0q1r2": "kept: its writer runs",
             f".model.old-{dead}-123456": "kept: it may hold the only copy", f".other.tmp-{dead}-x1y2z3": "kept: "
             "another target's", ".model.tmp-k2j3x9_a": "kept: no pid to tell"}
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "weights.bin").write_bytes(b"0" * 64)
    (tmp_path / "model").mkdir()
    assert atomic.remove_stale_staging(tmp_path / "model") == [tmp_path / f".model.tmp-{dead}-k2j3x9_a"]
    assert _entries(tmp_path) == sorted({*names, "model"} - {f".model.tmp-{dead}-k2j3x9_a"})
    assert atomic.remove_stale_staging(tmp_path / "missing" / "model") == []


def test_written_data_and_exported_models_are_readable_as_plainly_written_files_are(tmp_path):
    """mkstemp's temporary file and safetensors' weights file are private to their owner (0600): the parquet files
    and the model export get the modes a plain open() gives (0666 less the umask), as their other files have."""
    import pandas as pd
    from transformers import AutoModelForCausalLM

    from rlhf_core.atomic import current_umask
    from rlhf_core.data.schema import write_parquets_atomic
    from rlhf_core.models.loading import save_hf_model
    from rlhf_core.models.toy import random_toy_model

    usual = 0o666 & ~current_umask()
    [data] = write_parquets_atomic({tmp_path / "train.parquet": pd.DataFrame({"a": [1]})})
    assert data.stat().st_mode & 0o777 == usual
    model = AutoModelForCausalLM.from_pretrained(random_toy_model(tmp_path / "toy", n_layers=1, hidden_size=32, seed=0))
    save_hf_model(model, model.state_dict(), tmp_path / "export")
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "export").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {usual}, modes


def _old_pair(tmp_path):
    import pandas as pd

    from rlhf_core.data.schema import write_parquets_atomic

    files = {tmp_path / "train.parquet": pd.DataFrame({"a": ["old train"]}),
             tmp_path / "test.parquet": pd.DataFrame({"a": ["old test"]})}
    write_parquets_atomic(files)
    new = {path: pd.DataFrame({"a": [f"new {path.stem}"]}) for path in files}
    return new, lambda: {path.stem: pd.read_parquet(path)["a"].tolist() for path in files}


def test_a_pair_interrupted_while_its_second_file_is_synced_keeps_both_old_files(tmp_path, monkeypatch):
    """Each file was renamed into place as soon as it was synced: a Ctrl-C during train.parquet's fsync (slow for a
    big file) came after test.parquet was replaced, and left a new test split beside the old training split."""
    from rlhf_core.data.schema import write_parquets_atomic

    new, read = _old_pair(tmp_path)
    real_fsync = os.fsync

    def interrupted(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".train.parquet."):
            raise KeyboardInterrupt
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_parquets_atomic(new, overwrite=True)
    assert read() == {"train": ["old train"], "test": ["old test"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.parquet", "train.parquet"]  # no staged file left


def test_a_ctrl_c_while_the_pair_is_renamed_comes_once_both_are_in_place(tmp_path, monkeypatch):
    """SIGINT arriving between the two renames is held back until the second is done."""
    import signal

    from rlhf_core.data.schema import write_parquets_atomic

    new, read = _old_pair(tmp_path)
    real_replace, renamed = os.replace, []
    # Python's own handler, as a terminal starts it (a run in the background has SIGINT ignored, and keeps it so)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def replace(source, target):
        if not renamed:
            os.kill(os.getpid(), signal.SIGINT)  # delivered at once unless held back
        real_replace(source, target)
        renamed.append(os.path.basename(target))

    monkeypatch.setattr(os, "replace", replace)
    try:
        with pytest.raises(KeyboardInterrupt):
            write_parquets_atomic(new, overwrite=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sorted(renamed) == ["test.parquet", "train.parquet"]
    assert read() == {"train": ["new train"], "test": ["new test"]}


def test_the_umask_is_read_without_setting_it(monkeypatch):
    """Reading it by setting it (and setting it back) left a moment in which a file another thread made got the
    placeholder's mask: 077 became 022 for it. Linux tells it in /proc/self/status."""
    from rlhf_core.atomic import current_umask

    before = os.umask(0o077)
    try:
        monkeypatch.setattr(os, "umask", lambda mask: pytest.fail("the umask was set to read it"))
        assert current_umask() == 0o077
    finally:
        monkeypatch.undo()
        os.umask(before)
