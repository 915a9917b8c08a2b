"""The local Ray cluster a worker group starts: sized for the group, started again larger where it is this
process's own and idle, and how ``trainer.ray_address`` is joined."""

from __future__ import annotations

import time
import weakref

import pytest

ray = pytest.importorskip("ray")

from rlhf_core.workers import group  # noqa: E402


class _RunningGroup:  # stands for a worker group of this process that is still alive
    pass


def test_a_larger_group_starts_this_processs_idle_local_cluster_again(monkeypatch, capsys):
    """A 1-CPU machine: a group of 1 starts a cluster of 1 CPU; a group of 2 after it (the first shut down) gets
    a cluster of 2, where it waited for the placement timeout and failed saying "add nodes"."""
    if ray.is_initialized():  # another module's cluster
        ray.shutdown()
    monkeypatch.setattr(group.os, "cpu_count", lambda: 1)
    try:
        group.ensure_ray(None, 1, "cpu")
        assert ray.cluster_resources()["CPU"] == 1.0
        group.ensure_ray(None, 2, "cpu")
        assert ray.cluster_resources()["CPU"] == 2.0
        assert "started again with {'CPU': 2, 'GPU': 0}" in capsys.readouterr().err
        # with a group of this process alive on it, it stays as it is, and a group too large for it fails at once
        # saying whose cluster it is
        running = _RunningGroup()
        monkeypatch.setattr(group, "_live_groups", weakref.WeakSet([running]))
        started = time.monotonic()
        with pytest.raises(group.WorkerError, match=r"cannot place 3 workers of \{'CPU': 1\} each: the local Ray "
                                                    r"cluster this process started has \{.*'CPU': 2\.0.*\} \(its size "
                                                    r"when it started: \{'CPU': 2, 'GPU': 0\}\); 1 worker group of "
                                                    r"this process still runs on it"):
            group.WorkerGroup(group.DistributedWorker, 3, placement_timeout_s=600)
        assert time.monotonic() - started < 60  # not the 600 s of the placement timeout
        assert ray.cluster_resources()["CPU"] == 2.0
    finally:
        ray.shutdown()


def test_a_cluster_this_process_did_not_start_is_never_started_again(monkeypatch):
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)  # the caller's, as a test fixture's
    try:
        monkeypatch.setattr(ray, "shutdown", lambda: pytest.fail("the caller's cluster was stopped"))
        group.ensure_ray(None, 2, "cpu")
        assert group.started_here() is None
    finally:
        monkeypatch.undo()
        ray.shutdown()
