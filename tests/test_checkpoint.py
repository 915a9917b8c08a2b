"""Checkpoints: the layout, a full round trip, the HF export, atomicity under injected faults,
pruning, resume modes, and the errors for missing, incomplete or mismatched checkpoints."""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

from rlhf_core.algos import AdaptiveKLController
from rlhf_core.config import PPOConfig, load_config
from rlhf_core.main_ppo import build_trainer
from rlhf_core.models.toy import random_toy_model
from rlhf_core.training import checkpoint
from rlhf_core.training.checkpoint import CheckpointError

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_overrides(workspace, out, *extra, model=None):
    """Two PPO steps of the tiny run (with an adaptive KL controller to save) take about a second."""
    return workspace.overrides(out, "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", *extra,
                               model=model)


@pytest.fixture(scope="module")
def trained(workspace):
    """A trainer after two steps with a checkpoint at each step."""
    out = workspace.root / "trained"
    cfg = load_config(tiny_overrides(workspace, out, "trainer.total_training_steps=2", "trainer.save_freq=1",
                                     "trainer.test_freq=1"))
    trainer = build_trainer(cfg)
    trainer.fit()
    return trainer, out


def _assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _optimizer_tensors(optimizer) -> dict:
    return {f"{pid}.{key}": value for pid, state in optimizer.state_dict()["state"].items()
            for key, value in state.items()}


def test_layout_and_exact_round_trip(workspace, trained):
    trainer, out = trained
    assert (out / checkpoint.LATEST_FILE).read_text().strip() == "2"
    ckpt = out / "global_step_2"
    for rel in ("actor/model_state.pt", "actor/optim_state.pt", "actor/extra_state.pt", "critic/model_state.pt",
                "critic/optim_state.pt", "critic/extra_state.pt", "actor/huggingface/config.json",
                "actor/huggingface/model.safetensors", "actor/huggingface/tokenizer.json", "trainer_state.json",
                "rng_state.pt", "config.yaml", "manifest.json"):
        assert (ckpt / rel).is_file(), rel
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert state["sampler"] == {"epoch": 0, "batch_in_epoch": 2, "seed": 1, "n": 32, "order": "one_generator"}
    assert state["kl_ctrl"]["type"] == "adaptive" and state["kl_ctrl"]["value"] == trainer.kl_ctrl.value
    assert yaml.safe_load((ckpt / "config.yaml").read_text())["data"]["train_batch_size"] == 8
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp directory left behind

    fresh = build_trainer(load_config(tiny_overrides(workspace, out, "trainer.total_training_steps=2")))
    torch.manual_seed(12345)  # the load must put the global generator back too
    fresh.load_checkpoint(ckpt)
    assert fresh.global_step == 2
    assert fresh.sampler.state_dict() == trainer.sampler.state_dict()
    assert fresh.kl_ctrl.value == trainer.kl_ctrl.value and fresh.kl_ctrl.target == trainer.kl_ctrl.target
    for mine, theirs in ((fresh.actor, trainer.actor), (fresh.critic, trainer.critic)):
        _assert_same_tensors(mine.module.state_dict(), theirs.module.state_dict())
        _assert_same_tensors(_optimizer_tensors(mine.optimizer), _optimizer_tensors(theirs.optimizer))
        assert mine.scheduler.state_dict() == theirs.scheduler.state_dict()
        assert torch.equal(mine.shuffle_generator.get_state(), theirs.shuffle_generator.get_state())
    assert torch.equal(fresh.actor.rollout.generator.get_state(), trainer.actor.rollout.generator.get_state())
    assert torch.equal(torch.get_rng_state(), torch.load(ckpt / "rng_state.pt")["torch"])
    assert fresh.guard.state_dict() == trainer.guard.state_dict()


def test_hf_directory_loads_with_plain_transformers_and_generates(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer, out = trained
    hf_dir = out / "global_step_2" / "actor" / "huggingface"
    assert not (hf_dir.parent / "lora_adapter").exists()  # no LoRA: no peft adapter folder
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    for name, value in trainer.actor.module.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    text = "User: 2 + 3?\nAssistant: "
    inputs = tokenizer([text], return_tensors="pt")
    assert inputs["input_ids"].tolist() == trainer.tokenizer([text], return_tensors="pt")["input_ids"].tolist()
    generated = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] > inputs["input_ids"].shape[1]
    # the exported model and tokenizer answer as the trained policy does
    trained_policy = trainer.actor.module.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert generated.tolist() == trained_policy.tolist()

    exported = checkpoint.export_hf(trainer, tmp_path / "export")  # the standalone export, same content
    assert (exported / "model.safetensors").read_bytes() == (hf_dir / "model.safetensors").read_bytes()
    assert sorted(file.name for file in exported.iterdir()) == sorted(file.name for file in hf_dir.iterdir())
    assert not (exported / "lora_adapter").exists()  # no LoRA: no peft adapter folder in the export either
    with pytest.raises(CheckpointError, match="already exists and is not empty"):
        checkpoint.export_hf(trainer, tmp_path / "export")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_a_failed_export_names_the_export_folder_not_a_runs_key(trained, tmp_path, monkeypatch, code):
    """The standalone export writes to a folder of the caller's: a full disk or a folder it may not write said
    "set trainer.default_local_dir", a key no export reads; it says to free space or export elsewhere."""
    trainer, _ = trained

    def refused(trainer, folder):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(checkpoint, "_write_hf", refused)
    target = tmp_path / "out" / "export"
    target.parent.mkdir()
    with pytest.raises(CheckpointError) as caught:
        checkpoint.export_hf(trainer, target)
    expected = (f"disk full while exporting to {target}; free space or export to a folder on another disk "
                f"({os.strerror(code)})" if code == errno.ENOSPC else
                f"{target.parent} is not writable ({os.strerror(code)}); export to a folder you may write")
    assert str(caught.value) == expected
    assert not target.exists()  # nothing half-written left


@pytest.fixture
def scratch(trained, tmp_path):
    """A copy of the two-step run's checkpoints that a test may damage."""
    trainer, out = trained
    copy = tmp_path / "ckpts"
    shutil.copytree(out, copy)
    trainer.checkpoint_dir = copy
    trainer.global_step = 3
    # the tests save through checkpoint.save_checkpoint, which does not tell the guards: they start knowing none
    # (else the one before the run's latest would be kept as a guard's next anchor), and no best validation (else
    # the run's best step would be kept: what a test sees would hang on whether an earlier test had cleared it)
    saved, trainer.guard.saved = trainer.guard.saved, []
    best, trainer.guard.best_step = trainer.guard.best_step, None
    yield trainer, copy
    trainer.checkpoint_dir, trainer.global_step, trainer.guard.saved = out, 2, saved
    trainer.guard.best_step = best


def _fail_on_call(monkeypatch, number: int, error: OSError):
    """Make writing the ``number``-th file of a save raise ``error``: the checkpoint's files in
    order, then the latest marker."""
    real_write, real_write_text = checkpoint.CheckpointFiles.write, checkpoint.write_text_atomic
    calls = []

    def fail(file):
        raise error

    def write(files, rel, fill):
        calls.append(rel)
        real_write(files, rel, fail if len(calls) == number else fill)

    def write_text(path, text):
        calls.append(path)
        if len(calls) == number:
            raise error
        real_write_text(path, text)

    monkeypatch.setattr(checkpoint.CheckpointFiles, "write", write)
    monkeypatch.setattr(checkpoint, "write_text_atomic", write_text)
    return calls


@pytest.mark.parametrize(("call", "what"), [(1, "actor/model_state.pt"), (4, "critic/model_state.pt"),
                                             (11, "manifest.json"), (12, checkpoint.LATEST_FILE)])
def test_disk_full_midway_keeps_the_previous_checkpoint(scratch, monkeypatch, call, what):
    trainer, root = scratch
    calls = _fail_on_call(monkeypatch, call, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(CheckpointError) as info:
        checkpoint.save_checkpoint(trainer, root)
    message = str(info.value)
    assert f"disk full while writing {what}" in message and "global_step_3" in message
    assert "previous checkpoint" in message and "global_step_2 is intact" in message
    assert len(calls) == call
    assert (root / checkpoint.LATEST_FILE).read_text().strip() == "2"
    assert not (root / "global_step_3").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    assert checkpoint.latest_checkpoint(root) == root / "global_step_2"
    checkpoint.read_manifest(root / "global_step_2")
    monkeypatch.undo()
    assert checkpoint.save_checkpoint(trainer, root) == root / "global_step_3"  # and the next save works
    assert (root / checkpoint.LATEST_FILE).read_text().strip() == "3"


class _FullDisk:
    """A file that takes ``room`` bytes and then fails as a full disk does."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)


def test_disk_full_inside_torch_save_is_reported_as_disk_full(scratch, monkeypatch):
    """torch.save's zip writer turns a write that fails midway into a RuntimeError ("unexpected pos"): the
    save still says disk full, and the previous checkpoint stays the latest."""
    trainer, root = scratch
    real_open = open

    def full_disk_open(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        return _FullDisk(file, 1000) if Path(path).name == "optim_state.pt" and "x" in mode else file

    monkeypatch.setattr(checkpoint, "open", full_disk_open, raising=False)
    with pytest.raises(CheckpointError) as info:
        checkpoint.save_checkpoint(trainer, root)
    message = str(info.value)
    assert "disk full while writing actor/optim_state.pt of checkpoint" in message, message
    assert f"the previous checkpoint {root / 'global_step_2'} is intact" in message
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert (root / checkpoint.LATEST_FILE).read_text().strip() == "2"
    assert not (root / "global_step_3").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    checkpoint.verify_checkpoint(root / "global_step_2")


def test_a_file_size_limit_hit_inside_torch_save_is_a_clear_error(tmp_path):
    """The real thing: a file-size limit (EFBIG) reached in the middle of torch.save, in a process of its own."""
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from rlhf_core.training import checkpoint

        def fill(numbers):
            return lambda files: files.torch("actor/model_state.pt", torch.zeros(numbers)) or ["actor"]

        checkpoint.write_checkpoint({str(tmp_path)!r}, 1, fill(10))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so that writing past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            checkpoint.write_checkpoint({str(tmp_path)!r}, 2, fill(1 << 16))
        except checkpoint.CheckpointError as exc:
            print("refused:", exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(checkpoint.__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused: could not write actor/model_state.pt of checkpoint" in done.stdout, done.stdout
    assert "File too large" in done.stdout and f"{tmp_path / 'global_step_1'} is intact" in done.stdout
    assert checkpoint.latest_checkpoint(tmp_path, verify=True) == tmp_path / "global_step_1"
    assert not (tmp_path / "global_step_2").exists()


def test_unwritable_directory_is_reported(scratch, monkeypatch, tmp_path):
    trainer, root = scratch
    _fail_on_call(monkeypatch, 2, PermissionError(errno.EACCES, "Permission denied"))
    with pytest.raises(CheckpointError, match=f"checkpoint directory {root} is not writable"):
        checkpoint.save_checkpoint(trainer, root)
    assert checkpoint.latest_checkpoint(root) == root / "global_step_2"
    monkeypatch.undo()
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match="is not a directory"):
        checkpoint.save_checkpoint(trainer, blocker / "sub")
    with pytest.raises(CheckpointError, match="is not a directory"):
        checkpoint.check_writable(blocker / "sub")


def test_a_rerun_into_a_folder_that_still_refuses_writes_says_how_to_resume_from_its_checkpoints(
        scratch, monkeypatch, tmp_path):
    """The preflight's check of trainer.default_local_dir, on a rerun after a save the folder refused, said "fix its
    permissions or set trainer.default_local_dir": a run in another folder finds no checkpoint and starts afresh.
    Where the folder holds the run's checkpoints the check says how to resume from its latest; an empty one has
    nothing to keep."""
    _, root = scratch

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(checkpoint.tempfile, "mkstemp", refused)
    with pytest.raises(CheckpointError) as info:
        checkpoint.check_writable(root, "rerun with trainer.resume_mode=auto")
    assert str(info.value) == (
        f"checkpoint directory {root} is not writable (Permission denied); its latest checkpoint "
        f"{root / 'global_step_2'} is intact: make {root} writable again (its permissions, or remount a read-only "
        "filesystem), then rerun with trainer.resume_mode=auto to resume from it; or move "
        f"{root} with its checkpoints and latest_checkpointed_iteration.txt to a writable place and set "
        "trainer.default_local_dir to that place for the rerun (in a folder without them a rerun starts afresh)")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError) as info:
        checkpoint.check_writable(empty)
    assert str(info.value) == (f"checkpoint directory {empty} is not writable (Permission denied); fix its "
                               "permissions or set trainer.default_local_dir")


def test_a_save_killed_midway_leaves_nothing_that_loads(scratch):
    trainer, root = scratch
    (root / ".global_step_3.tmp-killed").mkdir()  # what a SIGKILL during a save leaves
    (root / ".global_step_3.tmp-killed" / "actor").mkdir()
    (root / "global_step_7").mkdir()  # a directory without a manifest is not a checkpoint
    assert [step for step, _ in checkpoint.list_checkpoints(root)] == [1, 2]
    with pytest.raises(CheckpointError, match="global_step_7 is incomplete: it has no manifest.json"):
        checkpoint.read_manifest(root / "global_step_7")
    checkpoint.save_checkpoint(trainer, root)
    assert not (root / ".global_step_3.tmp-killed").exists()
    assert [step for step, _ in checkpoint.list_checkpoints(root)] == [1, 2, 3]


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_temp_files_are_swept_but_not_those_of_a_running_process(tmp_path):
    """A save sweeps what killed saves left, the latest marker's temp file too, but not the temp directories
    and files of another process still running (another run saving into the same directory); its own process's
    are an earlier failed save's (a retried pipeline step) and go."""
    dead, live, own = _dead_pid(), os.getppid(), os.getpid()
    marker = checkpoint.LATEST_FILE
    stale = [f".global_step_3.tmp-{dead}-k2j3x9_a", ".global_step_3.tmp-killed", f".global_step_2.old-{dead}-17",
             f".trash-global_step_1-{dead}-42", f".{marker}.{dead}-a1b2c3d4.tmp", f".{marker}.a1b2c3d4.tmp",
             f".global_step_4.tmp-{own}-k2j3x9_a", f".{marker}.{own}-a1b2c3d4.tmp"]
    running = [f".global_step_5.tmp-{live}-k2j3x9_a", f".global_step_2.old-{live}-17", f".trash-actor-{live}-42",
               f".{marker}.{live}-a1b2c3d4.tmp"]
    for name in stale + running:
        if name.endswith(".tmp"):
            (tmp_path / name).write_text("1\n")
        else:
            (tmp_path / name).mkdir()
            (tmp_path / name / "model_state.pt").write_bytes(b"x")
    checkpoint.write_checkpoint(tmp_path, 1, lambda files: files.text("a.txt", "a") or [])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == sorted(running)
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "global_step_1"


def _two_parts(files):
    for part in ("actor", "critic"):
        files.tree(part, lambda target: (target.mkdir(), (target / "model_state.pt").write_bytes(b"weights")))
    return ["actor", "critic"]


class _Killed(BaseException):
    """What a SIGKILL is to the code it stops: nothing after it runs."""


def _killed_while_replacing(root: Path, step: int, monkeypatch) -> None:
    """Save ``step`` again over its checkpoint, killed after the old one is set aside and before the new one is in
    place; then make the set-aside folder's pid a dead process's, as a new process finds it."""
    from rlhf_core import atomic

    rename = os.rename

    def killed_before_the_move(src, dst):
        if ".tmp-" in os.fspath(src):  # the new copy's move into place
            raise _Killed()
        rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", killed_before_the_move)
    with pytest.raises(_Killed):
        checkpoint.write_checkpoint(root, step, lambda files: files.text("a.txt", "new") or [])
    monkeypatch.setattr(atomic.os, "rename", rename)
    aside, = (child for child in root.iterdir() if ".old-" in child.name)
    rename(aside, aside.with_name(aside.name.replace(f"-{os.getpid()}-", f"-{_dead_pid()}-")))
    assert not (root / f"global_step_{step}").exists()


@pytest.mark.parametrize("next_act", ["resume", "save"])
def test_a_save_killed_while_replacing_a_checkpoint_leaves_the_old_one_to_resume_from(tmp_path, monkeypatch,
                                                                                   next_act):
    """Replacing a checkpoint (a rollback's or the last validation's save of a step saved before) sets the old one
    aside, then moves the new one in: killed between the two, the set-aside folder was the only copy, the latest
    marker named a checkpoint that was not there (the resume refused), and the next save swept it away."""
    checkpoint.write_checkpoint(tmp_path, 1, lambda files: files.text("a.txt", "old") or [])
    _killed_while_replacing(tmp_path, 1, monkeypatch)
    if next_act == "resume":
        assert checkpoint.latest_checkpoint(tmp_path, verify=True) == tmp_path / "global_step_1"
    else:
        checkpoint.write_checkpoint(tmp_path, 2, lambda files: files.text("a.txt", "two") or [])
        assert [step for step, _ in checkpoint.list_checkpoints(tmp_path)] == [1, 2]
    assert (tmp_path / "global_step_1" / "a.txt").read_text() == "old"
    checkpoint.verify_checkpoint(tmp_path / "global_step_1")
    assert not [child for child in tmp_path.iterdir() if ".old-" in child.name]


def test_a_prune_killed_while_deleting_leaves_nothing_the_next_save_does_not_sweep(tmp_path, monkeypatch):
    """Pruning renames a part out of view, then deletes it; a process killed in between left the renamed part
    inside a checkpoint that keeps its critic, where no later save looked. Trash an older version left there
    goes too."""
    for step in (1, 2):
        checkpoint.write_checkpoint(tmp_path, step, _two_parts)
    dead = _dead_pid()
    older = tmp_path / "global_step_2" / f".trash-actor-{dead}-42"  # an older version's leftover
    older.mkdir()
    (older / "model_state.pt").write_bytes(b"weights")

    def killed_while_deleting(path, *args, **kwargs):
        raise _Killed(path)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_while_deleting)
    with pytest.raises(_Killed):
        checkpoint.prune_checkpoints(tmp_path, max_actor=1, max_critic=None)
    monkeypatch.undo()
    assert not (tmp_path / "global_step_1" / "actor").exists()
    checkpoint.write_checkpoint(tmp_path, 3, _two_parts)  # the run goes on (or is rerun) and saves again
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob(".trash-*")] == []
    assert sorted(p.name for p in (tmp_path / "global_step_1").iterdir()) == ["critic", "manifest.json"]
    assert sorted(p.name for p in (tmp_path / "global_step_2").iterdir()) == ["actor", "critic", "manifest.json"]


def test_a_part_whose_save_wrote_nothing_fails_the_save_and_leaves_the_marker(tmp_path):
    """Workers that wrote their shards into another folder left an empty part that the manifest still listed."""
    checkpoint.write_checkpoint(tmp_path, 1, lambda files: files.text("a.txt", "a") or [])

    def fill(files):
        files.text("a.txt", "a")
        files.tree("actor", lambda target: target.mkdir(parents=True))  # a save that wrote elsewhere
        return ["actor"]

    with pytest.raises(checkpoint.CheckpointError, match=r"actor: its save wrote no files into .*absolute path"):
        checkpoint.write_checkpoint(tmp_path, 2, fill)
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "global_step_1"
    assert not (tmp_path / "global_step_2").exists()


def _damage(path: Path) -> None:
    """Overwrite bytes in the middle of ``path``: the same size, other content."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(255 - b for b in data[middle:middle + 8])
    path.write_bytes(bytes(data))


def _strip_hashes(path: Path) -> None:
    """Make the checkpoint ``path`` look saved before manifests held hashes."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.pop("sha256", None)
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))


def test_a_file_damaged_in_place_is_refused_naming_an_intact_checkpoint(workspace, scratch):
    trainer, root = scratch
    manifest = checkpoint.read_manifest(root / "global_step_1")
    assert set(manifest["sha256"]) == set(manifest["files"]) and any("huggingface/" in f for f in manifest["files"])
    for rel, digest in manifest["sha256"].items():
        assert hashlib.sha256((root / "global_step_1" / rel).read_bytes()).hexdigest() == digest, rel

    _damage(root / "global_step_2" / "actor" / "model_state.pt")
    checkpoint.read_manifest(root / "global_step_2")  # the sizes still match: only the hashes tell
    with pytest.raises(CheckpointError, match=r"global_step_2 is corrupt: actor/model_state.pt changed"):
        checkpoint.verify_checkpoint(root / "global_step_2")
    resume = f"trainer.resume_mode=resume_path trainer.resume_from_path={root / 'global_step_1'}"
    auto = load_config(tiny_overrides(workspace, root))
    with pytest.raises(CheckpointError) as info:
        checkpoint.find_resume_checkpoint(auto)
    message = str(info.value)
    assert "names step 2, but checkpoint" in message and "actor/model_state.pt changed since it was saved" in message
    assert f"newest earlier checkpoint that is intact is {root / 'global_step_1'}" in message and resume in message
    with pytest.raises(CheckpointError, match="actor/model_state.pt changed since it was saved") as info:
        trainer.load_checkpoint(root / "global_step_2")
    assert resume in str(info.value)
    chosen = load_config(tiny_overrides(workspace, root, "trainer.resume_mode=resume_path",
                                        f"trainer.resume_from_path={root / 'global_step_2'}"))
    with pytest.raises(CheckpointError, match="trainer.resume_from_path: .*corrupt") as info:
        checkpoint.find_resume_checkpoint(chosen)
    assert resume in str(info.value)

    # saved before manifests held hashes: loads, its sizes checked as before
    _strip_hashes(root / "global_step_1")
    checkpoint.verify_checkpoint(root / "global_step_1")
    fresh = build_trainer(load_config(tiny_overrides(workspace, root)))
    fresh.load_checkpoint(root / "global_step_1")
    assert fresh.global_step == 1
    (root / "global_step_1" / "rng_state.pt").write_bytes(b"short")
    with pytest.raises(CheckpointError, match="global_step_1 is incomplete: rng_state.pt missing or truncated"):
        fresh.load_checkpoint(root / "global_step_1")


def test_an_unreadable_trainer_state_is_a_checkpoint_error_before_the_workers_load(workspace, scratch, monkeypatch):
    trainer, root = scratch
    state = root / "global_step_2" / "trainer_state.json"
    state.write_bytes(b"\0" * state.stat().st_size)  # as a crash of the filesystem may leave it
    auto = load_config(tiny_overrides(workspace, root))
    with pytest.raises(CheckpointError, match="global_step_2 is corrupt: trainer_state.json changed"):
        checkpoint.find_resume_checkpoint(auto)
    _strip_hashes(root / "global_step_2")  # a checkpoint without hashes: the file is parsed
    monkeypatch.setattr(checkpoint, "_load_worker", lambda *args, **kwargs: pytest.fail("a worker was loaded"))
    for check in (lambda: checkpoint.find_resume_checkpoint(auto),
                  lambda: trainer.load_checkpoint(root / "global_step_2"),
                  lambda: checkpoint.read_trainer_state(root / "global_step_2")):
        with pytest.raises(CheckpointError, match=f"{state} is unreadable"):
            check()
    with pytest.raises(CheckpointError, match=f"trainer.resume_from_path={root / 'global_step_1'}"):
        checkpoint.find_resume_checkpoint(auto)


def _no_manifest(root):
    (root / "global_step_2" / "manifest.json").unlink()


@pytest.mark.parametrize(("damage", "says", "intact"), [
    (lambda root: (root / "global_step_2" / "actor" / "model_state.pt").write_bytes(b"cut"),
     "global_step_2 is incomplete: actor/model_state.pt missing or truncated", 1),
    (lambda root: (root / "global_step_2" / "rng_state.pt").unlink(),
     "global_step_2 is incomplete: rng_state.pt missing or truncated", 1),
    (_no_manifest, "global_step_2 is incomplete: it has no manifest.json", 1),
    (lambda root: (root / checkpoint.LATEST_FILE).write_text("9\n"),
     "names step 9, but checkpoint .*global_step_9 does not exist", 2),
])
def test_a_refused_latest_checkpoint_names_the_newest_intact_one_before_it(workspace, scratch, damage, says, intact):
    trainer, root = scratch
    damage(root)
    auto = load_config(tiny_overrides(workspace, root))
    with pytest.raises(CheckpointError, match=says) as info:
        checkpoint.find_resume_checkpoint(auto)
    older = root / f"global_step_{intact}"
    assert (f"The newest earlier checkpoint that is intact is {older}: to resume from it, run with "
            f"trainer.resume_mode=resume_path trainer.resume_from_path={older}") in str(info.value)
    for step in range(1, intact + 1):  # those too: none left to name
        _damage(root / f"global_step_{step}" / "critic" / "optim_state.pt")
    with pytest.raises(CheckpointError, match=f"No earlier checkpoint under {root} is intact either"):
        checkpoint.find_resume_checkpoint(auto)


def test_a_run_started_afresh_over_checkpoints_takes_their_marker_so_a_rerun_never_resumes_them(
        workspace, scratch, monkeypatch, capsys):
    """resume_mode=disable in a folder of an earlier run: killed before its first save, its rerun (auto) resumed
    the earlier run. Now the marker goes as the run starts (the checkpoints stay), and that rerun is refused."""
    from rlhf_core import main_ppo

    _, root = scratch
    monkeypatch.setattr(main_ppo, "trainer_session", lambda *args, **kwargs: pytest.fail("killed before loading"))
    with pytest.raises(pytest.fail.Exception, match="killed before loading"):
        main_ppo.run(load_config(tiny_overrides(workspace, root, "trainer.resume_mode=disable")))
    assert not (root / checkpoint.LATEST_FILE).exists()
    assert [path.name for _, path in checkpoint.list_checkpoints(root)] == ["global_step_1", "global_step_2"]
    assert (f"notice: trainer.resume_mode=disable starts a new run in {root}, which holds an earlier run's "
            "checkpoints (global_step_1, global_step_2)") in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="holds checkpoints .* but no latest_checkpointed_iteration.txt"):
        checkpoint.find_resume_checkpoint(load_config(tiny_overrides(workspace, root)))
    # validating only (val_only) writes nothing, the marker included
    checkpoint.write_text_atomic(root / checkpoint.LATEST_FILE, "2")
    with pytest.raises(pytest.fail.Exception):
        main_ppo.run(load_config(tiny_overrides(workspace, root, "trainer.resume_mode=disable", "trainer.val_only=true")))
    assert checkpoint.latest_checkpoint(root) == root / "global_step_2"


def test_auto_refuses_checkpoints_without_the_latest_marker_before_loading_a_model(workspace, scratch, monkeypatch):
    """Without the marker, starting afresh would write a new run's global_step_1.. over the old run's."""
    from rlhf_core import main_ppo

    trainer, root = scratch
    (root / checkpoint.LATEST_FILE).unlink()
    monkeypatch.setattr(main_ppo, "trainer_session", lambda *args, **kwargs: pytest.fail("a model was loaded"))
    with pytest.raises(CheckpointError) as info:
        main_ppo.run(load_config(tiny_overrides(workspace, root)))
    message = str(info.value)
    assert f"{root} holds checkpoints (global_step_1, global_step_2) but no {checkpoint.LATEST_FILE}" in message
    assert f"trainer.resume_mode=resume_path trainer.resume_from_path={root / 'global_step_2'}" in message
    assert "another trainer.default_local_dir" in message and "trainer.resume_mode=disable" in message
    _damage(root / "global_step_2" / "rng_state.pt")  # the newest that is intact is named
    with pytest.raises(CheckpointError, match=f"the newest intact one is {root / 'global_step_1'}"):
        checkpoint.find_resume_checkpoint(load_config(tiny_overrides(workspace, root)))
    assert checkpoint.find_resume_checkpoint(
        load_config(tiny_overrides(workspace, root, "trainer.resume_mode=disable"))) is None
    assert not (root / checkpoint.LATEST_FILE).exists()


def test_missing_incomplete_and_mismatched_checkpoints_are_clear_errors(workspace, scratch, tmp_path):
    trainer, root = scratch
    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path / 'nowhere' / 'global_step_5'} does not"):
        trainer.load_checkpoint(tmp_path / "nowhere" / "global_step_5")
    (root / "global_step_1" / "critic" / "optim_state.pt").unlink()
    with pytest.raises(CheckpointError, match="global_step_1 is incomplete: critic/optim_state.pt missing"):
        trainer.load_checkpoint(root / "global_step_1")
    (root / checkpoint.LATEST_FILE).write_text("9\n")
    with pytest.raises(CheckpointError, match="names step 9, but checkpoint .*global_step_9 does not exist"):
        checkpoint.latest_checkpoint(root)
    (root / checkpoint.LATEST_FILE).write_text("oops")
    with pytest.raises(CheckpointError, match="should hold a step number"):
        checkpoint.latest_checkpoint(root)

    # the same model directory now holds a model of another width: a shape mismatch, named
    other = tmp_path / "model"
    random_toy_model(other, n_layers=1, hidden_size=32, max_position_embeddings=512, seed=0)
    small = build_trainer(load_config(tiny_overrides(workspace, root, model=other)))
    checkpoint.save_checkpoint(small, tmp_path / "small")
    shutil.rmtree(other)
    random_toy_model(other, n_layers=1, hidden_size=48, max_position_embeddings=512, seed=0)
    wide = build_trainer(load_config(tiny_overrides(workspace, root, model=other)))
    with pytest.raises(CheckpointError, match=f"actor_rollout_ref.model.path, actor_rollout_ref.model.tokenizer_path, "
                                              f"critic.model.path, critic.model.tokenizer_path: {other} holds another "
                                              r"model than when the checkpoint was trained from it \(config.json, "
                                              r"model.safetensors differ\)"):
        wide.load_checkpoint(tmp_path / "small" / "global_step_0")
    # a checkpoint of an older version has no fingerprints of its models: their shapes are compared as they load
    saved = tmp_path / "small" / "global_step_0"
    manifest = json.loads((saved / checkpoint.MANIFEST).read_text())
    for table in ("files", "sha256"):
        del manifest[table][checkpoint.MODELS_FILE]
    (saved / checkpoint.MODELS_FILE).unlink()
    (saved / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"global_step_0/actor/model_state.pt does not fit the model being "
                                              r"trained \(.* has shape \(\d+, 32\) in the checkpoint, \(\d+, 48\)"):
        wide.load_checkpoint(saved)


def _verl_checkpoint(root: Path, hf_weights: bool) -> Path:
    """A folder laid out as verl's FSDP trainer saves one step of one worker (names from its checkpoint docs)."""
    step = root / "global_step_2"
    for name in ("model", "optim", "extra_state"):
        (step / "actor").mkdir(parents=True, exist_ok=True)
        torch.save({}, step / "actor" / f"{name}_world_size_1_rank_0.pt")
    torch.save({}, step / "data.pt")
    (step / "actor" / "huggingface").mkdir()
    (step / "actor" / "huggingface" / "config.json").write_text("{}")
    if hf_weights:
        (step / "actor" / "huggingface" / "model.safetensors").write_bytes(b"")
    (root / checkpoint.LATEST_FILE).write_text("2")
    return step


@pytest.mark.parametrize("hf_weights", [True, False], ids=["huggingface-weights", "huggingface-config-only"])
def test_a_verl_checkpoint_is_named_for_what_it_is_with_the_way_to_start_from_it(workspace, tmp_path, hf_weights):
    """A folder verl wrote has no manifest, but its save finished: it is refused as verl's, never as a save cut
    short, and the message says how to start a new run from its actor."""
    step = _verl_checkpoint(tmp_path, hf_weights)
    hf = step / "actor" / "huggingface"
    auto = load_config(tiny_overrides(workspace, tmp_path))
    chosen = load_config(tiny_overrides(workspace, tmp_path / "new", "trainer.resume_mode=resume_path",
                                        f"trainer.resume_from_path={step}"))
    for config in (auto, chosen):
        with pytest.raises(CheckpointError) as info:
            checkpoint.find_resume_checkpoint(config)
        message = str(info.value)
        assert f"checkpoint {step} was written by verl (it holds actor/model_world_size_1_rank_0.pt)" in message
        assert "cannot resume" in message and "did not finish" not in message and "incomplete" not in message
        if hf_weights:
            assert f"a new run can start: actor_rollout_ref.model.path={hf}; and " in message
        else:
            assert f"its {hf} holds no weights" in message and "model merger" in message
    (step / "actor" / "model_world_size_1_rank_0.pt").rename(step / "actor" / "model.pt")  # data.pt alone says so
    for name in ("optim", "extra_state"):
        (step / "actor" / f"{name}_world_size_1_rank_0.pt").unlink()
    with pytest.raises(CheckpointError, match=f"checkpoint {step} was written by verl \\(it holds data.pt\\)"):
        checkpoint.read_manifest(step)
    (step / "data.pt").unlink()  # none of verl's files: a save cut short, as before
    with pytest.raises(CheckpointError, match="global_step_2 is incomplete: it has no manifest.json"):
        checkpoint.read_manifest(step)


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by its path there, with its bytes."""
    return {file.relative_to(root).as_posix(): file.read_bytes() for file in sorted(root.rglob("*")) if file.is_file()}


def test_a_folder_verl_wrote_is_neither_resumed_nor_saved_over_by_a_ppo_run_in_any_resume_mode(
        workspace, tmp_path, capsys):
    """This trainer's default_local_dir is verl's: a verl user's first run lands in verl's folder. Each resume mode
    is refused before anything there changes, and each refusal says all a new run needs: the model to start from,
    another default_local_dir where the run would save into verl's folder (its global_step_N would replace verl's,
    the one it starts from among them), and, under resume_path, to leave resume_path out."""
    from rlhf_core.cli.train import ppo

    root = tmp_path / "checkpoints" / "verl_examples" / "gsm8k"
    step = _verl_checkpoint(root, hf_weights=True)
    hf = step / "actor" / "huggingface"
    before = _files(root)
    start = f"a new run can start: actor_rollout_ref.model.path={hf}"
    another = f"set another trainer.default_local_dir than {root}: a new run there, with any resume_mode, would save"
    leave_out = "leave out trainer.resume_mode=resume_path and trainer.resume_from_path"

    def refusal(code: int) -> str:
        assert code == 2
        return " ".join(capsys.readouterr().err.split())  # (a long message is wrapped)

    err = refusal(ppo(workspace.overrides(root)))  # auto
    assert f"{root / checkpoint.LATEST_FILE} names step 2, but checkpoint {step} was written by verl" in err
    assert start in err and another in err and leave_out not in err
    err = refusal(ppo(workspace.overrides(tmp_path / "new", "trainer.resume_mode=resume_path",
                                          f"trainer.resume_from_path={step}")))
    assert f"trainer.resume_from_path: checkpoint {step} was written by verl" in err
    assert start in err and leave_out in err and "another trainer.default_local_dir" not in err
    err = refusal(ppo(workspace.overrides(root, "trainer.resume_mode=resume_path",
                                          f"trainer.resume_from_path={step}")))
    assert start in err and leave_out in err and another in err
    verl_folder = (f"{root} holds checkpoints verl wrote (global_step_2; "
                   "global_step_2/actor/model_world_size_1_rank_0.pt is verl's), which this trainer cannot resume, and the saves of a new PPO run there would replace "
                   "them (its global_step_N take their names): set another trainer.default_local_dir. To start from "
                   f"verl's newest actor: its {hf} holds the actor as a Hugging Face model, from which {start}")
    assert verl_folder in refusal(ppo(workspace.overrides(root, "trainer.resume_mode=disable")))
    # our own checkpoint named as resume_path, saved on into verl's folder: refused as disable is
    ours = tmp_path / "ours"
    checkpoint.write_checkpoint(ours, 1, lambda files: files.text("actor/model_state.pt", "ours") or ["actor"])
    assert verl_folder in refusal(ppo(workspace.overrides(root, "trainer.resume_mode=resume_path",
                                                          f"trainer.resume_from_path={ours / 'global_step_1'}")))
    assert _files(root) == before
    # a caller that starts afresh itself, or saves there: refused, nothing changed
    with pytest.raises(CheckpointError) as info:
        checkpoint.start_afresh(root)
    assert " ".join(str(info.value).split()) == verl_folder
    with pytest.raises(CheckpointError, match="holds a checkpoint verl wrote .* which no save replaces"):
        checkpoint.write_checkpoint(root, 2, lambda files: files.text("actor/model_state.pt", "new") or ["actor"])
    assert _files(root) == before
    # without verl's marker auto finds no checkpoint of ours: refused as disable is, not started afresh there
    (root / checkpoint.LATEST_FILE).unlink()
    before = _files(root)
    assert verl_folder in refusal(ppo(workspace.overrides(root)))
    assert _files(root) == before


def test_a_run_that_only_validates_may_use_verls_folder_but_not_resume_verls_checkpoint(workspace, tmp_path,
                                                                                       capsys):
    """trainer.val_only saves no checkpoint, so verl's folder as its default_local_dir is no danger: validating the
    base model there (disable) or one of ours (resume_path) runs and leaves verl's files as they were; under auto,
    verl's marker would have it resume verl's checkpoint, which stays refused."""
    from rlhf_core.cli.train import ppo

    root = tmp_path / "checkpoints" / "verl_examples" / "gsm8k"
    step = _verl_checkpoint(root, hf_weights=True)
    before = _files(root)
    assert ppo(workspace.overrides(root, "trainer.val_only=true", "trainer.resume_mode=disable")) == 0
    ours = tmp_path / "ours"
    # one step is a checkpoint of ours to validate (the default 30 epochs would train 120 steps to the same end)
    assert ppo(workspace.overrides(ours, "trainer.resume_mode=disable", "trainer.total_training_steps=1")) == 0
    assert ppo(workspace.overrides(root, "trainer.val_only=true", "trainer.resume_mode=resume_path",
                                   f"trainer.resume_from_path={checkpoint.latest_checkpoint(ours)}")) == 0
    after = _files(root)
    assert {name: data for name, data in after.items() if name in before} == before
    assert not [name for name in after if name.startswith("global_step_") and name not in before]
    capsys.readouterr()
    assert ppo(workspace.overrides(root, "trainer.val_only=true")) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{root / checkpoint.LATEST_FILE} names step 2, but checkpoint {step} was written by verl" in err


def test_a_folder_verl_wrote_is_neither_resumed_nor_saved_over_by_a_reward_model_run(workspace, tmp_path, capsys):
    """rlhf-train-rm as PPO: each resume mode in (or from) verl's folder is refused before anything there changes,
    and the refusals name the reward model's keys."""
    from rlhf_core.cli.train import train_rm
    from rlhf_core.data.preference import synthetic_pairs, write_splits
    from rlhf_core.data.synthetic import DATA_SOURCE

    pairs = tmp_path / "pairs"
    write_splits(pairs, *synthetic_pairs(8, 4, seed=0), DATA_SOURCE)
    root = tmp_path / "verl"
    step = _verl_checkpoint(root, hf_weights=True)
    hf = step / "actor" / "huggingface"
    before = _files(root)
    start = f"a new run can start: reward_model.train.model.path={hf}"
    another = f"set another reward_model.train.default_local_dir than {root}"

    def refusal(out: Path, *extra: str) -> str:
        assert train_rm(["trainer.device=cpu", "trainer.n_gpus_per_node=1",
                         f"reward_model.train.model.path={workspace.model}",
                         f"reward_model.train.train_files={pairs / 'train.parquet'}",
                         f"reward_model.train.val_files={pairs / 'val.parquet'}",
                         "reward_model.train.train_batch_size=4", "reward_model.train.micro_batch_size_per_gpu=4",
                         f"reward_model.train.default_local_dir={out}", *extra]) == 2
        return " ".join(capsys.readouterr().err.split())

    err = refusal(root)
    assert f"names step 2, but checkpoint {step} was written by verl" in err and start in err and another in err
    err = refusal(tmp_path / "new", "reward_model.train.resume_mode=resume_path",
                  f"reward_model.train.resume_from_path={step}")
    assert f"reward_model.train.resume_from_path: checkpoint {step} was written by verl" in err and start in err
    assert "leave out reward_model.train.resume_mode=resume_path and reward_model.train.resume_from_path" in err
    assert (f"{root} holds checkpoints verl wrote (global_step_2; global_step_2/actor/model_world_size_1_rank_0.pt "
            "is verl's), which this trainer cannot resume, and the saves of a new reward-model run there would "
            "replace them (its global_step_N take their names): set another reward_model.train.default_local_dir"
            ) in refusal(root, "reward_model.train.resume_mode=disable")
    assert _files(root) == before
    with pytest.raises(CheckpointError, match="the saves of a new reward-model run there would replace them"):
        checkpoint.start_afresh(root, "reward_model.train", "reward-model")
    assert _files(root) == before


def test_resume_modes(workspace, trained, tmp_path):
    _, out = trained
    auto = load_config(tiny_overrides(workspace, out))
    assert checkpoint.find_resume_checkpoint(auto) == out / "global_step_2"
    assert checkpoint.find_resume_checkpoint(load_config(tiny_overrides(workspace, tmp_path / "empty"))) is None
    disabled = load_config(tiny_overrides(workspace, out, "trainer.resume_mode=disable"))
    assert checkpoint.find_resume_checkpoint(disabled) is None
    chosen = load_config(tiny_overrides(workspace, tmp_path / "elsewhere", "trainer.resume_mode=resume_path",
                                        f"trainer.resume_from_path={out / 'global_step_1'}"))
    assert checkpoint.find_resume_checkpoint(chosen) == out / "global_step_1"
    for wrong, needle in ((out, "must be global_step_N"), (out / "global_step_8", "global_step_8 does not exist")):
        cfg = load_config(tiny_overrides(workspace, out, "trainer.resume_mode=resume_path",
                                         f"trainer.resume_from_path={wrong}"))
        with pytest.raises(CheckpointError, match=f"trainer.resume_from_path: .*{needle}"):
            checkpoint.find_resume_checkpoint(cfg)
    # a path that names no global_step_N is told the checkpoint it likely means: the folder's latest, or the one it
    # lies in; nothing where there is none
    for wrong, meant in ((out, f"; it is a folder of checkpoints, whose latest is {out / 'global_step_2'}: "
                               f"trainer.resume_from_path={out / 'global_step_2'} resumes from it"),
                         (out / "global_step_1" / "actor" / "huggingface",
                          f"; it lies inside the checkpoint {out / 'global_step_1'}: "
                          f"trainer.resume_from_path={out / 'global_step_1'} resumes from it"),
                         (tmp_path, "")):
        cfg = load_config(tiny_overrides(workspace, tmp_path / "new", "trainer.resume_mode=resume_path",
                                         f"trainer.resume_from_path={wrong}"))
        with pytest.raises(CheckpointError) as info:
            checkpoint.find_resume_checkpoint(cfg)
        assert str(info.value) == (f"trainer.resume_from_path: {wrong} is not a checkpoint directory: its name must "
                                   f"be global_step_N{meant}")


DENIED = {
    "data.train_batch_size": "16", "actor_rollout_ref.rollout.n": "4", "data.max_response_length": "16",
    "algorithm.adv_estimator": "grpo", "trainer.seed": "7", "actor_rollout_ref.actor.ppo_mini_batch_size": "8",
    "actor_rollout_ref.model.path": "/elsewhere/model", "actor_rollout_ref.actor.optim.weight_decay": "0.5",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "cispo", "algorithm.filter_groups.enable": "true",
}  # (the disable_dropout keys: test_a_key_the_checkpoint_predates_compares_as_it_then_was, by the model's rates)
ALLOWED = {
    "trainer.logger": "[console]", "trainer.test_freq": "5", "trainer.save_freq": "3",
    "trainer.total_training_steps": "50", "trainer.experiment_name": "renamed", "trainer.guard.max_kl": "0.5",
    "trainer.guard.max_val_drop": "null", "trainer.warn_kl": "0.5", "trainer.prometheus_port": "9400",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "2", "data.val_batch_size": "4",
    "reward_model.train.margin": "0.5", "reward_model.overlong_buffer.log": "true",
    "trainer.val_only": "true", "trainer.balance_batch": "false",
    "actor_rollout_ref.nccl_timeout": "3600",  # raised after a hang: the stall notice points at it
    "actor_rollout_ref.actor.optim.lr": "0.5", "critic.optim.lr": "0.5",  # a resume's schedule takes the new rate
    "data.val_max_samples": "4",  # fewer validation prompts, as other validation files: no step trains on them
}


def test_resume_refuses_config_changes_that_matter_and_allows_harmless_ones(workspace, trained):
    _, out = trained
    ckpt = out / "global_step_2"
    base = tiny_overrides(workspace, out, "trainer.total_training_steps=2")
    checkpoint.check_config(ckpt, load_config(base))
    allowed = load_config(base + [f"{k}={v}" for k, v in ALLOWED.items()], validate=False)
    checkpoint.check_config(ckpt, allowed)
    for key, value in DENIED.items():
        with pytest.raises(CheckpointError) as info:
            checkpoint.check_config(ckpt, load_config(base + [f"{key}={value}"], validate=False))
        assert f"cannot resume from {ckpt}" in str(info.value)
        if key in checkpoint.MODEL_PATH_KEYS:  # compared as the folder's content (with the keys that follow it)
            assert f"{key}, " in str(info.value), key
            assert "/elsewhere/model is not a model folder (the checkpoint was trained from" in str(info.value)
        else:
            assert f"{key}: " in str(info.value) and "in the checkpoint" in str(info.value), key
    everything = load_config(base + [f"{k}={v}" for k, v in DENIED.items()], validate=False)
    assert sorted(checkpoint.config_differences(yaml.safe_load((ckpt / "config.yaml").read_text()),
                                                everything.to_dict())) == \
        sorted(DENIED)  # not the keys left null that stand for these (critic.model.path, data.tokenizer, ...)


def test_a_key_that_follows_the_actors_compares_resolved():
    """A checkpoint written when the critic's keys held their values (as before they defaulted to null = the
    actor's) resumes under the same command; one whose value the null now resolves otherwise does not."""
    current = PPOConfig().to_dict()
    saved = copy.deepcopy(current)
    saved["critic"].update(loss_agg_mode="token-mean", shuffle=False)
    saved["critic"]["model"]["trust_remote_code"] = False
    assert checkpoint.config_differences(saved, current) == []
    # paths that stand for the actor's, written out (through a chain: the data's tokenizer is the actor's
    # tokenizer, which is its model directory), resume; another directory does not
    policy = current["actor_rollout_ref"]["model"]["path"]
    written = copy.deepcopy(current)
    written["critic"]["model"].update(path=policy, tokenizer_path=policy)
    written["data"]["tokenizer"] = policy
    assert checkpoint.config_differences(saved, written) == []
    written["critic"]["model"]["path"] = "/elsewhere"
    assert checkpoint.config_differences(saved, written) == ["critic.model.path"]
    current["actor_rollout_ref"]["actor"]["loss_agg_mode"] = saved["actor_rollout_ref"]["actor"]["loss_agg_mode"] = \
        "seq-mean-token-mean"  # the critic followed token-mean then, the actor's seq-mean-token-mean now
    assert checkpoint.config_differences(saved, current) == ["critic.loss_agg_mode"]
    # without a critic (GRPO) its keys are read by no one; trust_remote_code is a permission, not math
    for tree in (saved, current):
        tree["algorithm"]["adv_estimator"] = "grpo"
    current["critic"]["model"]["trust_remote_code"] = current["actor_rollout_ref"]["model"]["trust_remote_code"] = True
    assert checkpoint.config_differences(saved, current) == []
    # the mappings the user fills are compared whole: an override_config entry added since is a change
    current["actor_rollout_ref"]["model"]["override_config"] = {"rope_theta": 1000.0}
    assert checkpoint.config_differences(saved, current) == ["actor_rollout_ref.model.override_config"]


def test_a_checkpoint_before_max_samples_kept_every_prompt():
    """A checkpoint written before data.train_max_samples / val_max_samples existed trained on every prompt: it
    resumes at -1 (all) and is refused with a cut of the training prompts, which would train on other prompts from
    the same step on; a cut of the validation prompts resumes, as other validation files do."""
    saved = PPOConfig().to_dict()
    for key in ("train_max_samples", "val_max_samples"):
        del saved["data"][key]
    current = PPOConfig().to_dict()
    assert checkpoint.config_differences(saved, current) == []
    current["data"]["val_max_samples"] = 20
    assert checkpoint.config_differences(saved, current) == []
    current["data"]["train_max_samples"] = 100
    assert checkpoint.config_differences(saved, current) == ["data.train_max_samples"]


def test_a_key_the_checkpoint_predates_compares_as_it_then_was(tmp_path):
    """A checkpoint written before the dropout keys existed trained with the models' dropout (false): for a model
    with dropout, resumed with a key true it is refused naming the key, what the run ran as and the override that
    resumes it; with the keys false it resumes. A newer checkpoint whose key differs is refused as well. For a
    model whose config has no non-zero rate the keys change nothing: it resumes either way."""
    plain = random_toy_model(tmp_path / "plain", n_layers=1, hidden_size=32, max_position_embeddings=64)
    dropping = tmp_path / "dropping"
    shutil.copytree(plain, dropping)
    config = json.loads((dropping / "config.json").read_text())
    (dropping / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    keys = ["actor_rollout_ref.model.disable_dropout", "critic.model.disable_dropout"]
    on = [f"{key}=true" for key in keys]
    for model in (plain, dropping):
        current = load_config([f"actor_rollout_ref.model.path={model}"])
        saved = current.to_dict()
        newer = copy.deepcopy(saved)
        del saved["actor_rollout_ref"]["model"]["disable_dropout"], saved["critic"]["model"]["disable_dropout"]
        assert checkpoint.config_differences(saved, current.to_dict()) == []
        off = load_config([f"actor_rollout_ref.model.path={model}", *on])
        expected = keys if model == dropping else []
        assert sorted(checkpoint.config_differences(saved, off.to_dict())) == expected
        assert sorted(checkpoint.config_differences(newer, off.to_dict())) == expected
    (tmp_path / checkpoint.CONFIG_FILE).write_text(yaml.safe_dump(saved))
    with pytest.raises(CheckpointError) as refused:
        checkpoint.check_config(tmp_path, off)
    assert ("(actor_rollout_ref.model.disable_dropout: True now (not in the checkpoint, which predates the key: it "
            "ran as False; actor_rollout_ref.model.disable_dropout=false resumes it); critic.model.disable_dropout: "
            "True now (not in the checkpoint, which predates the key: it ran as False; "
            "critic.model.disable_dropout=false resumes it))") in str(refused.value)
    checkpoint.check_config(tmp_path, load_config([f"actor_rollout_ref.model.path={dropping}"]))
    # a model folder whose config cannot be read: the keys are compared as written
    gone = load_config([f"actor_rollout_ref.model.path={tmp_path / 'gone'}"])
    saved["actor_rollout_ref"]["model"]["path"] = str(tmp_path / "gone")
    assert checkpoint.config_differences(saved, gone.to_dict()) == []
    assert sorted(checkpoint.config_differences(saved, load_config([f"actor_rollout_ref.model.path={tmp_path / 'gone'}",
                                                                      *on]).to_dict())) == keys


def test_the_reward_models_chat_template_keywords_compare_as_before_the_key_where_it_is_read():
    """A checkpoint written before reward_model.model.input_chat_template_kwargs existed rendered the policy's
    prompts for the reward model without keywords ({}): with the reward model on and keywords now, refused; with
    the reward model off in both runs the key is read by no one."""
    keywords = "data.apply_chat_template_kwargs={enable_thinking: false}"  # the key follows the policy's
    for enable, expected in (("true", ["reward_model.model.input_chat_template_kwargs"]), ("false", [])):
        current = load_config([keywords, f"reward_model.enable={enable}"], validate=False).to_dict()
        saved = copy.deepcopy(current)
        del saved["reward_model"]["model"]["input_chat_template_kwargs"]
        assert checkpoint.config_differences(saved, current) == expected
        as_then = load_config([keywords, f"reward_model.enable={enable}", "reward_model.model.input_chat_template_kwargs={}"],
                              validate=False)
        assert checkpoint.config_differences(saved, as_then.to_dict()) == []


def test_runtime_coefficients_are_saved_as_trainer_state_and_the_config_stays_as_started(workspace, scratch):
    trainer, root = scratch
    saved = trainer.kl_ctrl, trainer.kl_loss_coef
    trainer.kl_ctrl, trainer.kl_loss_coef = AdaptiveKLController(0.25, 0.01, 50), 0.004  # as a guard leaves them
    try:
        path = checkpoint.save_checkpoint(trainer, root)
    finally:
        trainer.kl_ctrl, trainer.kl_loss_coef = saved
    fresh = build_trainer(load_config(tiny_overrides(workspace, root)))
    fresh.load_checkpoint(path)
    assert fresh.kl_loss_coef == 0.004
    assert isinstance(fresh.kl_ctrl, AdaptiveKLController)
    assert (fresh.kl_ctrl.value, fresh.kl_ctrl.target, fresh.kl_ctrl.horizon) == (0.25, 0.01, 50)
    assert fresh.config.actor_rollout_ref.actor.kl_loss_coef == 0.001  # the config is what the run started with
    assert fresh.config.algorithm.kl_ctrl.target_kl == 0.1
    state = checkpoint.read_trainer_state(path)
    assert state["kl_loss_coef"] == 0.004 and state["format"] == checkpoint.FORMAT_VERSION


def _save_keeping(trainer, root, steps, max_actor, max_critic) -> dict[int, list[str]]:
    """Save at ``steps`` with these ``max_*_ckpt_to_keep``; the parts left in each checkpoint."""
    cfg = trainer.config.trainer
    cfg.max_actor_ckpt_to_keep, cfg.max_critic_ckpt_to_keep = max_actor, max_critic
    try:
        for step in steps:
            trainer.global_step = step
            checkpoint.save_checkpoint(trainer, root)
    finally:
        cfg.max_actor_ckpt_to_keep = cfg.max_critic_ckpt_to_keep = None
    return {step: sorted(p.name for p in path.iterdir() if p.is_dir()) for step, path in
            checkpoint.list_checkpoints(root)}


def test_pruning_keeps_the_latest_and_the_protected(scratch):
    trainer, root = scratch
    trainer.guard.best_step = 1  # the val-drop guard's rollback target
    try:
        layout = _save_keeping(trainer, root, range(3, 7), 2, 1)
    finally:
        trainer.guard.best_step = None
    assert layout == {1: ["actor", "critic"], 5: ["actor"], 6: ["actor", "critic"]}
    assert checkpoint.latest_checkpoint(root) == root / "global_step_6"
    with pytest.raises(CheckpointError, match="global_step_5 .*critic/model_state.pt"):
        trainer.load_checkpoint(root / "global_step_5")


def test_zero_checkpoints_to_keep_keeps_them_all_as_in_verl(scratch):
    trainer, root = scratch
    layout = _save_keeping(trainer, root, range(3, 6), 0, 1)
    assert {3, 4, 5} <= set(layout) and max(layout) == 5
    assert all(parts == (["actor", "critic"] if step == 5 else ["actor"]) for step, parts in layout.items())


def test_after_a_guard_moves_latest_back_newer_checkpoints_are_replaced_not_counted(scratch):
    trainer, root = scratch
    for step in (3, 4):
        trainer.global_step = step
        checkpoint.save_checkpoint(trainer, root)
    checkpoint.mark_latest(root, 2)  # what a guard's stop does
    assert checkpoint.latest_checkpoint(root) == root / "global_step_2"
    stale = (root / "global_step_3" / "manifest.json").stat().st_mtime_ns
    _save_keeping(trainer, root, [3], 1, 1)  # the rerun reaches step 3 again
    assert (root / "global_step_3" / "manifest.json").stat().st_mtime_ns != stale
    assert [step for step, _ in checkpoint.list_checkpoints(root)] == [3, 4]
    assert checkpoint.latest_checkpoint(root) == root / "global_step_3"
    assert not [p for p in root.iterdir() if p.name.startswith(".")]

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_checkpoint_round_trip_and_resume(workspace, tmp_path):
    out = tmp_path / "cuda"
    overrides = tiny_overrides(workspace, out, "trainer.device=cuda", "trainer.total_training_steps=2",
                               "trainer.save_freq=1")
    reference = build_trainer(load_config(overrides))
    metrics: dict[int, dict] = {}
    reference.logger = lambda m, step: metrics.__setitem__(step, dict(m))
    reference.fit()
    cuda_rng = torch.load(out / "global_step_1" / "rng_state.pt")["cuda"]
    assert cuda_rng is not None and len(cuda_rng) == torch.cuda.device_count()

    resumed = build_trainer(load_config(overrides))
    resumed.load_checkpoint(out / "global_step_1")
    assert all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), cuda_rng))
    assert next(resumed.actor.module.parameters()).is_cuda
    again: dict[int, dict] = {}
    resumed.logger = lambda m, step: again.__setitem__(step, dict(m))
    resumed.fit()
    for key in ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/ppo_kl", "critic/values/mean"):
        assert again[2][key] == pytest.approx(metrics[2][key], rel=1e-4, abs=1e-6), key


def test_one_run_at_a_time_holds_a_checkpoint_folder(tmp_path):
    """Two runs saving into one folder replace each other's checkpoints: the second is refused while the first
    runs (here another process holding the lock); once that one has ended, however it ended, the folder is free."""
    lock = tmp_path / checkpoint.RUN_LOCK
    with checkpoint.run_lock(tmp_path):
        assert lock.read_text() == f"{os.getpid()}\n"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[2]); from rlhf_core.training import "
         "checkpoint; import time\nwith checkpoint.run_lock(sys.argv[1]):\n    print('held', flush=True)\n"
         "    time.sleep(60)", str(tmp_path), str(Path(checkpoint.__file__).parents[2])],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match=f"is in use by another run \\(pid {holder.pid}"):
            with checkpoint.run_lock(tmp_path):
                pass
    finally:
        holder.kill()  # killed while holding it: the kernel releases the lock
        holder.wait()
    with checkpoint.run_lock(tmp_path):
        assert lock.read_text() == f"{os.getpid()}\n"


def test_a_resume_knows_the_model_by_its_content_not_by_how_its_path_is_written(workspace, trained, tmp_path):
    """The same model folder at its absolute path, or copied elsewhere, resumes (the path as written differed, and
    was refused); another model is refused by its content, naming the folders and the files that differ."""
    _, out = trained
    ckpt = out / "global_step_2"
    base = tiny_overrides(workspace, out, "trainer.total_training_steps=2")
    model = Path(load_config(base).actor_rollout_ref.model.path)
    copy_of_it = tmp_path / "copy"
    shutil.copytree(model, copy_of_it)
    for path in (model.resolve(), copy_of_it):
        checkpoint.check_config(ckpt, load_config(base + [f"actor_rollout_ref.model.path={path}"]))
    other = tmp_path / "other"
    random_toy_model(other, n_layers=1, hidden_size=32, max_position_embeddings=512, seed=1)
    with pytest.raises(CheckpointError, match=f"{other} is not the model the checkpoint was trained from, "
                                              rf"{model.resolve()} \(.*model.safetensors.* differ\)"):
        checkpoint.check_config(ckpt, load_config(base + [f"actor_rollout_ref.model.path={other}"]))


def test_a_resume_reads_each_model_folder_once(workspace, trained, tmp_path, monkeypatch):
    """A resumed run fingerprints its model folders before any model loads (a checkpoint of another model fails
    fast) and keeps them for its checkpoints: each file of a folder, named by one key or several, is read once."""
    from rlhf_core import main_ppo

    _, out = trained
    model = tmp_path / "model"  # a folder of its own: none of this process's fingerprints is of it yet
    shutil.copytree(workspace.model, model)
    # read as if a minute later: a folder whose files were written or copied just now (its status-change times,
    # which no utime sets back) is read anew each time, one written a while ago is read once
    clock = checkpoint._clock_ns
    monkeypatch.setattr(checkpoint, "_clock_ns", lambda: clock() + 60_000_000_000)
    reads: dict[str, int] = {}

    def counting(file, *args, **kwargs):
        if Path(file).parent == model:
            reads[Path(file).name] = reads.get(Path(file).name, 0) + 1
        return open(file, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "open", counting, raising=False)  # what folder_fingerprint reads with
    result = main_ppo.run(load_config(tiny_overrides(
        workspace, tmp_path / "run", "trainer.total_training_steps=2", "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={out / 'global_step_2'}", model=model)), handle_signals=False)
    assert result.resumed_from == str(out / "global_step_2")
    assert "model.safetensors" in reads and set(reads.values()) == {1}, reads


def test_a_model_folder_is_fingerprinted_anew_when_its_files_change(tmp_path, monkeypatch):
    """What a fingerprint is read once for must not hide a change: a file rewritten (same size, other bytes),
    added or replaced is read again, and so is a folder written too recently for its times to tell."""
    model = random_toy_model(tmp_path / "model", n_layers=1, hidden_size=32, max_position_embeddings=512, seed=0)
    weights = model / "model.safetensors"
    hour_ago = weights.stat().st_mtime - 3600
    for file in model.iterdir():
        os.utime(file, (hour_ago, hour_ago))
    hashed: list[str] = []
    sha256 = hashlib.sha256
    monkeypatch.setattr(checkpoint.hashlib, "sha256", lambda: hashed.append("") or sha256())
    # the files' status-change times are now's, which no utime sets back: read as if 10 s later at first
    clock, later = checkpoint._clock_ns, [10_000_000_000]
    monkeypatch.setattr(checkpoint, "_clock_ns", lambda: clock() + later[0])
    first = checkpoint.folder_fingerprint(model)
    read = len(hashed)
    assert checkpoint.folder_fingerprint(model) == first and len(hashed) == read  # unchanged: not read again
    later[0] = 0
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))  # same size, just written
    changed = checkpoint.folder_fingerprint(model)
    assert changed["model.safetensors"] != first["model.safetensors"] and len(hashed) == 2 * read
    assert checkpoint.folder_fingerprint(model) == changed and len(hashed) == 3 * read  # too recent to trust
    os.utime(weights, (hour_ago, hour_ago))
    checkpoint.folder_fingerprint(model)
    (model / "added_tokens.json").write_text("{}")
    os.utime(model / "added_tokens.json", (hour_ago, hour_ago))
    assert "added_tokens.json" in checkpoint.folder_fingerprint(model)


def test_a_model_folder_copied_over_with_its_times_kept_is_fingerprinted_anew(tmp_path):
    """Another model of the same shapes copied to the same path (removed first, as a deploy does), its files'
    modification times kept (copytree/copy2, cp -p, an archive) and the freed inode numbers given back: the
    fingerprint is of the model now there, not the one read before."""
    hour_ago = time.time() - 3600
    releases = []
    for name, byte in (("release_a", b"A"), ("release_b", b"B")):
        release = tmp_path / name
        release.mkdir()
        (release / "config.json").write_text('{"n_layer": 1}')
        (release / "model.safetensors").write_bytes(byte * 100_000)  # the same size: the same architecture
        for file in release.iterdir():
            os.utime(file, (hour_ago, hour_ago))  # both released at the same second
        releases.append(release)
    model = tmp_path / "model"
    shutil.copytree(releases[0], model)
    first = checkpoint.folder_fingerprint(model)
    shutil.rmtree(model)
    shutil.copytree(releases[1], model)
    assert checkpoint.folder_fingerprint(model) == checkpoint.folder_fingerprint(releases[1]) != first


def test_a_folder_copied_in_just_now_with_its_times_kept_is_read_again_next_time(tmp_path):
    """A file system whose clock is coarse may give the next copy over it the same status-change time: a folder
    whose files arrived (status change) within the recent window is not kept, whatever modification time the
    copy kept."""
    hour_ago = time.time() - 3600
    release = tmp_path / "release"
    release.mkdir()
    (release / "config.json").write_text('{"n_layer": 1}')
    (release / "model.safetensors").write_bytes(b"A" * 1000)
    for file in release.iterdir():
        os.utime(file, (hour_ago, hour_ago))
    model = tmp_path / "model"
    shutil.copytree(release, model)
    checkpoint.folder_fingerprint(model)
    assert model.resolve() not in checkpoint._FINGERPRINTS


def test_two_model_paths_that_name_no_folder_are_told_apart_by_their_paths():
    key = "actor_rollout_ref.model.path"
    saved = {key: {"path": "/models/a", "files": None}}
    assert checkpoint._model_problems(saved, {key: {"path": "/models/a", "files": None}}) == []
    assert checkpoint._model_problems(saved, {key: {"path": "/models/b", "files": None}}) == [
        f"{key}: /models/b is not a model folder (the checkpoint was trained from /models/a)"]


def test_a_null_data_seed_shuffles_with_the_trainer_seed_and_resumes_as_that_number(workspace):
    """Newer verl's data.seed default is null (an unseeded shuffle there; refused here before): it takes
    trainer.seed, and a checkpoint saved with the number itself resumes under the null."""
    config = load_config(tiny_overrides(workspace, workspace.root / "unused", "data.seed=null", "trainer.seed=7"))
    assert config.data.seed is None and config.value("data.seed") == 7
    trainer = build_trainer(config)
    order = [trainer.sampler.next_batch() for _ in range(3)]
    numbered = build_trainer(load_config(tiny_overrides(workspace, workspace.root / "unused", "data.seed=7",
                                                        "trainer.seed=7")))
    assert [numbered.sampler.next_batch() for _ in range(3)] == order
    default = build_trainer(load_config(tiny_overrides(workspace, workspace.root / "unused", "trainer.seed=7")))
    assert [default.sampler.next_batch() for _ in range(3)] != order  # (data.seed 1: another order)
    saved = PPOConfig().to_dict()
    saved["data"]["seed"], saved["trainer"]["seed"] = 7, 7
    current = copy.deepcopy(saved)
    current["data"]["seed"] = None
    assert checkpoint.config_differences(saved, current) == []
    current["trainer"]["seed"] = 8  # the null now stands for another number
    assert sorted(checkpoint.config_differences(saved, current)) == ["data.seed", "trainer.seed"]


def test_a_run_started_afresh_moves_the_earlier_runs_records_aside(workspace, tmp_path, capsys):
    """resume_mode=disable in a folder of an earlier run: its metrics.jsonl held that run's steps, then this one's
    from step 1 again. Now that run's records move aside and this run's file holds its own steps alone."""
    from rlhf_core import main_ppo

    out = tmp_path / "run"

    def steps(name: str) -> list[int]:
        return [json.loads(line)["step"] for line in (out / name).read_text().splitlines()]

    main_ppo.run(load_config(tiny_overrides(workspace, out, "trainer.total_training_steps=2", "trainer.test_freq=1")))
    assert steps("metrics.jsonl") == [1, 2]
    main_ppo.run(load_config(tiny_overrides(workspace, out, "trainer.total_training_steps=1", "trainer.test_freq=1",
                                            "trainer.resume_mode=disable")))
    assert steps("metrics.jsonl") == [1] and steps("metrics.jsonl.prev") == [1, 2]
    assert "its records are moved aside (metrics.jsonl to metrics.jsonl.prev)" in capsys.readouterr().err
    # a third run: the second run's records go to the next free name; a folder that holds records but no
    # checkpoint (removed by hand) is told so as well
    shutil.rmtree(out / "global_step_1")
    shutil.rmtree(out / "global_step_2")
    main_ppo.run(load_config(tiny_overrides(workspace, out, "trainer.total_training_steps=1",
                                            "trainer.resume_mode=disable")))
    assert steps("metrics.jsonl") == [1] and steps("metrics.jsonl.prev.2") == [1]
    assert (f"notice: trainer.resume_mode=disable starts a new run in {out}: an earlier run's records there are "
            "moved aside (metrics.jsonl to metrics.jsonl.prev.2)") in capsys.readouterr().err


def test_a_run_started_afresh_moves_tensorboard_and_the_tracking_run_ids_aside(workspace, tmp_path, capsys,
                                                                              monkeypatch):
    """resume_mode=disable after a 2-step run: TensorBoard showed steps 1, 2, 1 as one run; and the earlier run's
    wandb id stayed in tracking_runs.json for a resume of the new run (which logged no wandb) to go on in."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlhf_core import main_ppo

    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"

    def steps(folder: str) -> list[int]:
        events = EventAccumulator(str(out / folder))
        events.Reload()
        return [event.step for event in events.Scalars("critic/score/mean")]

    def run(*extra: str) -> None:
        main_ppo.run(load_config(tiny_overrides(workspace, out, "trainer.test_freq=-1", *extra)))

    run("trainer.total_training_steps=2", "trainer.logger=[file,wandb,tensorboard]")
    first_id = json.loads((out / "tracking_runs.json").read_text())["wandb"]
    run("trainer.total_training_steps=1", "trainer.logger=[file,tensorboard]", "trainer.resume_mode=disable")
    assert steps("tensorboard") == [1] and steps("tensorboard.prev") == [1, 2]
    assert not (out / "tracking_runs.json").exists()
    assert json.loads((out / "tracking_runs.json.prev").read_text()) == {"wandb": first_id}
    assert ("its records are moved aside (metrics.jsonl to metrics.jsonl.prev, tensorboard to tensorboard.prev, "
            "tracking_runs.json to tracking_runs.json.prev)") in capsys.readouterr().err
    # the new run resumed with wandb: a wandb run of its own, not the earlier run's
    run("trainer.total_training_steps=2", "trainer.logger=[file,wandb,tensorboard]")
    assert json.loads((out / "tracking_runs.json").read_text())["wandb"] != first_id
    assert steps("tensorboard") == [1, 2]


def test_a_fresh_auto_run_moves_records_left_without_a_checkpoint_aside(workspace, tmp_path, capsys):
    """resume_mode=auto in a folder whose earlier run was killed before its first save: no checkpoint to resume,
    but that run's steps were in metrics.jsonl, and this run's step 1 followed them. They now move aside."""
    from rlhf_core import main_ppo

    out = tmp_path / "run"
    out.mkdir()
    left = [{"step": 1, "critic/score/mean": 0.5}, {"step": 2, "critic/score/mean": 0.25}]
    (out / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in left))
    main_ppo.run(load_config(tiny_overrides(workspace, out, "trainer.total_training_steps=1")))
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert [json.loads(line) for line in (out / "metrics.jsonl.prev").read_text().splitlines()] == left
    assert (f"notice: trainer.default_local_dir {out} holds records of an earlier run that saved no checkpoint: "
            "moved aside (metrics.jsonl to metrics.jsonl.prev)") in capsys.readouterr().err
    # resumed (auto, a checkpoint now there), the run's records stay where they are
    main_ppo.run(load_config(tiny_overrides(workspace, out, "trainer.total_training_steps=2")))
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert not (out / "metrics.jsonl.prev.2").exists()


def test_a_resume_already_at_the_end_says_the_run_is_complete_and_how_to_go_on(workspace, tmp_path, capsys):
    """Resumed at or past its last step, a run trained nothing and said only "done: 0 steps": now it says the run
    was complete and which limit to raise, and still exits 0."""
    from rlhf_core.cli.train import ppo

    out = tmp_path / "run"
    assert ppo(tiny_overrides(workspace, out, "trainer.total_training_steps=2")) == 0
    capsys.readouterr()
    assert ppo(tiny_overrides(workspace, out, "trainer.total_training_steps=1")) == 0
    captured = capsys.readouterr()
    assert (f"notice: the run is already complete: {out / 'global_step_2'} is at step 2 and this run ends at step 1 "
            "(trainer.total_training_steps=1), so nothing is trained; to train on from it, raise "
            "trainer.total_training_steps above 2 and run again") in captured.err
    assert "done: 0 steps (now at step 2)" in captured.out
    # the data's end: 32 prompts, 8 a step, one epoch (4 steps); trained on to it, then run again
    assert ppo(tiny_overrides(workspace, out, "trainer.total_epochs=1")) == 0
    assert "already complete" not in capsys.readouterr().err
    assert ppo(tiny_overrides(workspace, out, "trainer.total_epochs=1")) == 0
    assert (f"notice: the run is already complete: {out / 'global_step_4'} is at step 4 and this run ends at step 4 "
            "(trainer.total_epochs=1 of 4 batches each), so nothing is trained; to train on from it, raise "
            "trainer.total_epochs to 2 or more and run again") in capsys.readouterr().err
    # a step limit past the data's end does not end the run: only the epochs are named (it was told to raise the
    # steps "with it"); a step limit at the data's end ends it too, so both are named, and raising both goes on
    assert ppo(tiny_overrides(workspace, out, "trainer.total_epochs=1", "trainer.total_training_steps=9")) == 0
    assert ("this run ends at step 4 (trainer.total_epochs=1 of 4 batches each), so nothing is trained; to train "
            "on from it, raise trainer.total_epochs to 2 or more and run again") in capsys.readouterr().err
    assert ppo(tiny_overrides(workspace, out, "trainer.total_epochs=1", "trainer.total_training_steps=4")) == 0
    assert ("this run ends at step 4 (trainer.total_training_steps=4 and trainer.total_epochs=1 of 4 batches each), "
            "so nothing is trained; to train on from it, raise trainer.total_training_steps above 4 and "
            "trainer.total_epochs to 2 or more and run again") in capsys.readouterr().err
    assert checkpoint.latest_checkpoint(out) == out / "global_step_4"
    assert ppo(tiny_overrides(workspace, out, "trainer.total_epochs=2", "trainer.total_training_steps=5")) == 0
    assert checkpoint.latest_checkpoint(out) == out / "global_step_5"
    # resumed by resume_path into a new folder, already complete: nothing is logged there, and no metrics file named
    capsys.readouterr()
    elsewhere = tmp_path / "elsewhere"
    assert ppo(tiny_overrides(workspace, elsewhere, "trainer.total_epochs=2", "trainer.total_training_steps=5",
                              "trainer.resume_mode=resume_path", f"trainer.resume_from_path={out / 'global_step_5'}")) == 0
    captured = capsys.readouterr()
    assert f"notice: the run is already complete: {out / 'global_step_5'} is at step 5" in captured.err
    assert not (elsewhere / "metrics.jsonl").exists()
    assert captured.out.splitlines()[-1] == f"outputs: {elsewhere}"


def test_a_resume_may_ship_another_ray_runtime_env():
    """Where the workers' code and environment come from (trainer.ray_runtime_env, verl's
    ray_kwargs.ray_init.runtime_env) changes no step's math: a run resumes under another one, as under another
    trainer.ray_address, and a checkpoint saved before the key existed resumes with it set."""
    current = PPOConfig().to_dict()
    saved = copy.deepcopy(current)
    current["trainer"]["ray_runtime_env"] = {"env_vars": {"HF_HOME": "/cache"}, "py_modules": ["/src/my_ext"]}
    assert checkpoint.config_differences(saved, current) == []
    del saved["trainer"]["ray_runtime_env"]
    assert checkpoint.config_differences(saved, current) == []
    current["trainer"]["seed"] = 2  # (the comparison itself still sees a key that matters)
    assert checkpoint.config_differences(saved, current) == ["trainer.seed"]


def test_a_resume_knows_the_custom_reward_by_its_code_not_by_how_its_path_is_written(workspace, tmp_path,
                                                                                      monkeypatch):
    """The reward file at its absolute path, or moved and renamed with its helper module, resumes (its path as
    written differed, and was refused); the same path holding other code (the file or a module it imports from
    beside it) is refused, naming the file that differs. Comments and layout are not code."""
    def reward_folder(where, name, score):
        where.mkdir(parents=True)
        (where / "helper.py").write_text(f"def score():\n    return {score}\n")
        (where / name).write_text("from helper import score\n\n\ndef compute_score(data_source, solution_str, "
                                  "ground_truth, extra_info=None):\n    return score()\n")
        return where / name

    monkeypatch.chdir(tmp_path)
    reward_folder(tmp_path / "rw", "reward.py", 1.0)
    base = tiny_overrides(workspace, tmp_path / "out")
    trained_with = load_config(base + ["custom_reward_function.path=rw/reward.py"])
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / checkpoint.CONFIG_FILE).write_text(yaml.safe_dump(trained_with.to_dict()))
    (ckpt / checkpoint.MODELS_FILE).write_text(json.dumps(checkpoint.model_fingerprints(trained_with)))
    moved = reward_folder(tmp_path / "elsewhere", "renamed.py", 1.0)
    moved.write_text("# the same reward\n" + moved.read_text().replace("return score()", "return  score( )"))
    for path in (tmp_path / "rw" / "reward.py", moved):
        checkpoint.check_config(ckpt, load_config(base + [f"custom_reward_function.path={path}"]))
    # the reward dropped: the rest of the run would train under the built-in rule
    with pytest.raises(CheckpointError, match=r"custom_reward_function.path: 'rw/reward.py' in the checkpoint, None "
                                              "now"):
        checkpoint.check_config(ckpt, load_config(base + ["custom_reward_function.path=null"]))
    (tmp_path / "rw" / "helper.py").write_text("def score(:\n")  # being edited: not Python
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'rw' / 'reward.py'} cannot be read as Python now"):
        checkpoint.check_config(ckpt, trained_with)
    (tmp_path / "rw" / "helper.py").write_text("def score():\n    return -1.0\n")
    with pytest.raises(CheckpointError, match=rf"custom_reward_function.path: {tmp_path / 'rw' / 'reward.py'} holds "
                                              r"other reward code than the checkpoint was trained with \(helper.py "
                                              r"differs\)"):
        checkpoint.check_config(ckpt, trained_with)


def test_a_fixed_reward_function_resumes_where_the_run_allows_a_change_of_reward_code(workspace, tmp_path,
                                                                                      monkeypatch, capsys):
    """A reward function fixed after it failed (its code edited at the same path) resumes with
    trainer.allow_reward_code_change=true, with a notice naming the file that differs; without the key the
    refusal names it as the way on. Code that does not read as Python, or a reward dropped, stays refused."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):"
                                        "\n    return 1.0 / 0.0\n")
    base = tiny_overrides(workspace, tmp_path / "out") + ["custom_reward_function.path=reward.py"]
    trained_with = load_config(base)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / checkpoint.CONFIG_FILE).write_text(yaml.safe_dump(trained_with.to_dict()))
    (ckpt / checkpoint.MODELS_FILE).write_text(json.dumps(checkpoint.model_fingerprints(trained_with)))
    (tmp_path / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):"
                                        "\n    return 0.0\n")
    with pytest.raises(CheckpointError, match=r"holds other reward code than the checkpoint was trained with \(the "
                                              r"reward file differs\); a resume under another reward is not the run "
                                              r"it continues \(trainer.allow_reward_code_change=true resumes with it"):
        checkpoint.check_config(ckpt, trained_with)
    capsys.readouterr()
    checkpoint.check_config(ckpt, load_config(base + ["trainer.allow_reward_code_change=true"]))
    assert capsys.readouterr().err == (
        "notice: custom_reward_function.path: resuming with other reward code than the checkpoint was trained with "
        "(the reward file differs), as trainer.allow_reward_code_change=true allows: the steps before were scored by "
        "the old code\n")
    with pytest.raises(CheckpointError, match=r"custom_reward_function.path: 'reward.py' in the checkpoint, None now"):
        checkpoint.check_config(ckpt, load_config(base + ["trainer.allow_reward_code_change=true",
                                                          "custom_reward_function.path=null"]))
    (tmp_path / "reward.py").write_text("def compute_score(:\n")
    with pytest.raises(CheckpointError, match="cannot be read as Python now"):
        checkpoint.check_config(ckpt, load_config(base + ["trainer.allow_reward_code_change=true"]))


def test_a_full_disk_while_a_run_saves_says_to_free_space_and_rerun_to_resume_from_the_checkpoint_kept(
        scratch, monkeypatch):
    """A run's save that met a full disk said "free space or set trainer.default_local_dir to a larger disk": a
    rerun in another folder finds no checkpoint and starts afresh, and nothing said how to go on from the one kept."""
    trainer, root = scratch
    assert trainer.config.trainer.resume_mode == "auto"  # (a rerun of the same command resumes)
    _fail_on_call(monkeypatch, 1, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(CheckpointError) as info:
        trainer.save_checkpoint()
    assert str(info.value) == (
        f"disk full while writing actor/model_state.pt of checkpoint {root / 'global_step_3'} (No space left on "
        f"device); the previous checkpoint {root / 'global_step_2'} is intact: free space on that disk, then rerun "
        "the same command to resume from it")
    assert (root / checkpoint.LATEST_FILE).read_text() == "2\n"


def test_a_full_disk_while_safetensors_writes_the_hf_export_is_a_disk_full_checkpoint_error(scratch, monkeypatch):
    """safetensors reports a failed write in an error of its own, no OSError ("I/O error: No space left on device
    (os error 28)"): a full disk as the checkpoint's huggingface/ folder was written came out as that error's
    traceback (exit 1), without "disk full", the checkpoint kept or the way on."""
    from safetensors import SafetensorError
    from transformers import modeling_utils

    trainer, root = scratch

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(modeling_utils, "safe_save_file", full_disk)
    with pytest.raises(CheckpointError) as info:
        trainer.save_checkpoint()
    assert str(info.value) == (
        f"disk full while writing actor/huggingface/ of checkpoint {root / 'global_step_3'} (No space left on "
        f"device); the previous checkpoint {root / 'global_step_2'} is intact: free space on that disk, then rerun "
        "the same command to resume from it")
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert (root / checkpoint.LATEST_FILE).read_text() == "2\n"
    assert not (root / "global_step_3").exists() and not [p for p in root.iterdir() if p.name.startswith(".")]


def test_pythons_and_numpys_random_streams_resume_where_they_were(tmp_path):
    """A reward function drawing from ``random`` or ``np.random`` draws after a resume what the run would have
    drawn (the cached Gaussian of NumPy's legacy generator included), as torch's generator does."""
    import random

    import numpy as np

    for seed in (random.seed, np.random.seed, torch.manual_seed):
        seed(7)
    random.random(), np.random.random(), np.random.normal()  # off the seed, a Gaussian cached
    path = tmp_path / "rng_state.pt"
    torch.save(checkpoint.rng_state(), path)
    expected = (random.random(), float(np.random.random()), float(np.random.normal()), float(torch.rand(1)))
    for seed in (random.seed, np.random.seed, torch.manual_seed):  # as a fresh process's start seeds them
        seed(99)
    checkpoint.set_rng_state(checkpoint.load_file(path))
    assert (random.random(), float(np.random.random()), float(np.random.normal()), float(torch.rand(1))) == expected


def test_checkpoints_newer_than_the_latest_do_not_count_against_the_limit(tmp_path):
    """After a guard moved latest back to step 2 and the rerun saved step 3 again, a limit of 2 keeps steps 2 and 3
    (the newest two up to latest) and leaves the abandoned step 4 alone: counting it would delete step 2."""
    def fill(files):
        for part in ("actor", "critic"):
            files.text(f"{part}/model_state.pt", "w")
        return ["actor", "critic"]

    for step in (1, 2, 3, 4):
        checkpoint.write_checkpoint(tmp_path, step, fill)
    checkpoint.mark_latest(tmp_path, 2)
    checkpoint.write_checkpoint(tmp_path, 3, fill)
    checkpoint.prune_checkpoints(tmp_path, 2, 2)
    assert [step for step, _ in checkpoint.list_checkpoints(tmp_path)] == [2, 3, 4]


@pytest.mark.parametrize("override", ["critic.optim.weight_decay=0.5", "critic.optim.lr_warmup_steps=3",
                                      "critic.optim.lr_scheduler_type=cosine"])
def test_a_resume_refuses_a_changed_critic_optimizer(override):
    saved = load_config(["algorithm.adv_estimator=gae"], validate=False).to_dict()
    now = load_config(["algorithm.adv_estimator=gae", override], validate=False).to_dict()
    assert checkpoint.config_differences(saved, now) == [override.split("=")[0]]


def test_skipped_update_counts_resume_as_saved(workspace, tmp_path):
    """training/skipped_steps counts a run's skipped updates in total: a resume goes on from the saved counts."""
    trainer = build_trainer(load_config(tiny_overrides(workspace, tmp_path)))
    trainer.global_step = 1
    trainer.actor.skipped_steps, trainer.critic.skipped_steps = 3, 1
    path = checkpoint.save_checkpoint(trainer, tmp_path)
    fresh = build_trainer(load_config(tiny_overrides(workspace, tmp_path)))
    fresh.load_checkpoint(path)
    assert (fresh.actor.skipped_steps, fresh.critic.skipped_steps) == (3, 1)


def test_a_checkpoint_of_another_format_is_refused_by_name(workspace, tmp_path):
    trainer = build_trainer(load_config(tiny_overrides(workspace, tmp_path)))
    trainer.global_step = 1
    path = checkpoint.save_checkpoint(trainer, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format"] = checkpoint.FORMAT_VERSION - 1
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"has format {checkpoint.FORMAT_VERSION - 1}, this version reads "
                                              f"format {checkpoint.FORMAT_VERSION}"):
        build_trainer(load_config(tiny_overrides(workspace, tmp_path))).load_checkpoint(path)


def test_a_rollback_has_the_rollout_engine_reload_the_restored_weights(workspace, tmp_path, monkeypatch):
    """vLLM keeps its own copy of the weights: after a guard's rollback its next rollout must sample from the
    restored ones, not the abandoned ones (the hf rollout reads the actor's own, so only the call can be seen)."""
    trainer = build_trainer(load_config(tiny_overrides(workspace, tmp_path)))
    trainer.global_step = 1
    path = checkpoint.save_checkpoint(trainer, tmp_path)
    calls = []
    monkeypatch.setattr(trainer.actor.rollout, "sync_weights", lambda: calls.append(1))
    checkpoint.restore_weights(trainer, path)
    assert calls == [1]
