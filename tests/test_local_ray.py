"""The local Ray cluster a worker group starts: sized for the group, started again larger where it is this
process's own and idle, and how ``trainer.ray_address`` is joined."""

from __future__ import annotations

import socket
import threading
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


def test_a_group_that_does_not_fit_beside_a_live_group_of_this_process_fails_at_once(monkeypatch):
    """A 1-CPU machine whose CPU a live group of this process holds: a second group waited the whole placement
    timeout, though nothing could free them while the driver waited. Right after that group is shut down, a group
    as large is placed (Ray's count of available CPUs lags the shutdown by a moment: it is not what decides)."""
    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setattr(group.os, "cpu_count", lambda: 1)
    first = None
    try:
        first = group.WorkerGroup(group.DistributedWorker, 1, placement_timeout_s=60)
        started = time.monotonic()
        with pytest.raises(group.WorkerError) as info:
            group.WorkerGroup(group.DistributedWorker, 1, placement_timeout_s=30)
        assert time.monotonic() - started < 10  # not the 30 s of its placement timeout
        assert str(info.value) == (
            "cannot place 1 worker of {'CPU': 1}: the local Ray cluster this process started has "
            "{'CPU': 1.0, 'GPU': 0.0} (its size when it started: {'CPU': 1, 'GPU': 0}); 1 worker group of this "
            "process holds {'CPU': 1.0, 'GPU': 0.0} of it: shut it down first, or lower "
            "trainer.n_gpus_per_node * trainer.nnodes")  # Ray's CPU_group_<id> keys of the placement group unsaid
        first.shutdown()
        group.WorkerGroup(group.DistributedWorker, 1, placement_timeout_s=30).shutdown()
    finally:
        if first is not None:
            first.shutdown()
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


def closed_port() -> int:
    """A local port where nothing listens (one the system handed out, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("scheme", ["", "ray://"], ids=["gcs", "ray_client"])
def test_joining_an_address_where_nothing_answers_fails_in_seconds_on_every_path(monkeypatch, scheme):
    """Every worker group joins Ray through ensure_ray: PPO's trainer built as a library or in a pipeline step, the
    reward model's trainer. An address where nothing answers failed there only once ray.init had retried for many
    minutes (still trying after 200 s; the PPO command's preflight alone said it at once); given as the key or as RAY_ADDRESS, it now fails
    within the probe's seconds, before Ray starts, saying what to do."""
    if ray.is_initialized():
        ray.shutdown()
    port = closed_port()
    address = f"{scheme}127.0.0.1:{port}"
    expected = (f"trainer.ray_address (or RAY_ADDRESS) '{address}': nothing answers at 127.0.0.1:{port} within 5 s "
                f"(Connection refused); start the cluster there (ray start --head --port {port}) or fix the address")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for given in (address, None):
        if given is None:
            monkeypatch.setenv("RAY_ADDRESS", address)
        started = time.monotonic()
        with pytest.raises(group.WorkerError) as info:
            group.ensure_ray(given, 2, "cpu")
        assert time.monotonic() - started < 5
        assert str(info.value) == expected
        assert not ray.is_initialized()


class _Listener:
    """A local TCP server that is not Ray: each connection it accepts gets ``reply`` (after reading what the client
    sent first, as a web server reads a request), or nothing at all, the connection held open."""

    def __init__(self, reply: bytes | None):
        self.reply, self.held = reply, []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.held.append(conn)
            if self.reply is not None:
                conn.recv(1024)
                conn.sendall(self.reply)
                conn.close()

    def close(self):
        self.sock.close()
        for conn in self.held:
            conn.close()


GCS_FIX = "give the head's GCS address (ray start --head prints it; port 6379 by default), or a Ray client server's " \
          "as ray://<head>:10001"
CLIENT_FIX = "give ray://<head>:<its --ray-client-server-port, 10001 by default>, or the head's GCS address without " \
             "ray:// (port 6379 by default)"


@pytest.mark.parametrize("scheme", ["", "ray://"], ids=["gcs", "ray_client"])
def test_an_address_where_something_else_than_ray_listens_is_refused_naming_what_answers(monkeypatch, scheme):
    """A web server, or any listener, at the address passed the check (a connection was made), and ray.init then
    retried for minutes or failed with Ray's own words. Now what answers is told from Ray within the check's
    seconds, and named: a listener that says nothing (within a 1 s timeout here), a web server by its status line."""
    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray_kind, fix = ("a Ray client server", CLIENT_FIX) if scheme else ("Ray's GCS", GCS_FIX)
    silent, web = _Listener(None), _Listener(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    try:
        started = time.monotonic()
        with pytest.raises(group.WorkerError) as info:
            group.ensure_ray(f"{scheme}127.0.0.1:{web.port}", 2, "cpu")
        assert time.monotonic() - started < 2  # it answers at once: no timeout waited
        assert str(info.value) == (
            f"trainer.ray_address (or RAY_ADDRESS) '{scheme}127.0.0.1:{web.port}': what answers at "
            f"127.0.0.1:{web.port} is not {ray_kind}: a web server (HTTP/1), which says 'HTTP/1.1 400 Bad Request'; "
            f"{fix}")
        monkeypatch.setattr(group, "RAY_CONNECT_TIMEOUT_S", 1.0)
        started = time.monotonic()
        with pytest.raises(group.WorkerError) as info:
            group.ensure_ray(f"{scheme}127.0.0.1:{silent.port}", 2, "cpu")
        assert time.monotonic() - started < 3
        assert str(info.value) == (
            f"trainer.ray_address (or RAY_ADDRESS) '{scheme}127.0.0.1:{silent.port}': what answers at "
            f"127.0.0.1:{silent.port} is not {ray_kind}: it accepts the connection but sends nothing within 1 s; "
            f"{fix}")
        assert silent.held  # (it was reached: the connection was made, then nothing came)
        assert not ray.is_initialized()
    finally:
        silent.close()
        web.close()


def test_a_grpc_server_that_is_not_ray_is_refused_and_a_ray_head_passes():
    """An HTTP/2 (gRPC) server answers HTTP/2's greeting as Ray's GCS does: the call Ray's own client makes first
    tells them apart. The GCS of a real (local) Ray cluster passes."""
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # no service at all
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        problem = group.address_problem(f"127.0.0.1:{port}")
        assert problem.startswith(
            f"trainer.ray_address (or RAY_ADDRESS) '127.0.0.1:{port}': what answers at 127.0.0.1:{port} is not "
            "Ray's GCS: an HTTP/2 server, which answers /ray.rpc.NodeInfoGcsService/GetClusterId with "
            "UNIMPLEMENTED")
        assert problem.endswith(GCS_FIX)
        assert group.address_problem(f"ray://127.0.0.1:{port}").startswith(
            f"trainer.ray_address (or RAY_ADDRESS) 'ray://127.0.0.1:{port}': what answers at 127.0.0.1:{port} is not "
            "a Ray client server: an HTTP/2 server, which answers /ray.rpc.RayletDriver/ClusterInfo with UNIMPLEMENTED")
    finally:
        server.stop(None)
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        gcs = ray.get_runtime_context().gcs_address
        assert group.address_problem(gcs) is None
        # its port written as a client server's: the GCS does not answer the client's PING
        assert "is not a Ray client server: an HTTP/2 server, which answers /ray.rpc.RayletDriver/ClusterInfo " \
               "with UNIMPLEMENTED" in group.address_problem(f"ray://{gcs}")
    finally:
        ray.shutdown()


class _FakeContext:
    def get_node_id(self):
        return "node-a"


@pytest.mark.parametrize("address", ["10.0.0.9:6379", None], ids=["joined", "started"])
def test_the_runtime_env_goes_to_ray_init(monkeypatch, tmp_path, address):
    calls = []
    monkeypatch.setattr(group, "_what_answers", lambda *_: None)  # Ray answers at the made-up address
    monkeypatch.setattr(ray, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(ray, "get_runtime_context", _FakeContext)
    monkeypatch.setattr(group, "_connection", None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    package = tmp_path / "my_arch"  # (a folder on the driver: Ray ships it from there, to any node)
    package.mkdir()
    env = {"py_modules": [str(package)], "env_vars": {"A": "1", "B": 2, "C": False}}
    group.ensure_ray(address, 2, "cpu", env)
    # Ray takes strings only: the command line's B=2 and C=false as they were written
    assert len(calls) == 1
    assert calls[0]["runtime_env"] == {"py_modules": [str(package)], "env_vars": {"A": "1", "B": "2", "C": "false"}}
    assert calls[0].get("address") == address


def test_an_env_var_removed_or_null_does_not_reach_ray_init(monkeypatch, tmp_path):
    """A run config's env var removed with ~ (or set to null in a YAML file) is not set for the workers: it
    reached them as the string "None"."""
    from rlhf_core.config import load_config

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(ray, "get_runtime_context", _FakeContext)
    monkeypatch.setattr(group, "_connection", None)
    monkeypatch.setattr(group, "_what_answers", lambda *_: None)  # Ray answers at the made-up address
    run_config = tmp_path / "run.yaml"
    run_config.write_text("trainer:\n  ray_runtime_env:\n    env_vars:\n      CUDA_LAUNCH_BLOCKING: '1'\n"
                          "      HF_HOME: /cache\n      TOKENIZERS_PARALLELISM: null\n")
    config = load_config(["~ray_kwargs.ray_init.runtime_env.env_vars.CUDA_LAUNCH_BLOCKING"], config_file=run_config,
                         validate=False)
    group.ensure_ray("10.0.0.9:6379", 2, "cpu", config.trainer.ray_runtime_env)
    assert calls[0]["runtime_env"] == {"env_vars": {"HF_HOME": "/cache"}}


REFUSED = "trainer.ray_runtime_env (verl's ray_kwargs.ray_init.runtime_env) is refused by Ray: "


def test_a_runtime_env_ray_refuses_is_named_as_the_key_before_ray_starts(monkeypatch, tmp_path):
    """A py_modules folder that is not there failed as Ray's bare ValueError, after Ray had started, without
    naming the key."""
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **_: pytest.fail("Ray was started"))
    monkeypatch.setattr(group, "_connection", None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    missing = tmp_path / "my_ext"
    with pytest.raises(group.WorkerError) as info:
        group.ensure_ray(None, 2, "cpu", {"py_modules": [str(missing)]})
    assert str(info.value).startswith(f"{REFUSED}{missing} is not a valid path; it was "
                                      f"{{'py_modules': ['{missing}']}}")
    with pytest.raises(group.WorkerError, match="env_vars"):  # a field of the wrong type
        group.ensure_ray(None, 2, "cpu", {"env_vars": ["A=1"]})


@pytest.mark.parametrize("address", ["10.0.0.9:6379", None], ids=["joined", "started"])
def test_what_ray_init_refuses_of_the_runtime_env_names_the_key(monkeypatch, tmp_path, address):
    """What Ray checks only as it starts (a py_modules file that is neither .py nor .whl), said as the key; an
    error of ray.init without a runtime_env is not put on it."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not a module")
    refusal = f"py_modules entry must be a .py file, a directory, or a .whl file; got {notes}"

    def refuse(**kwargs):
        raise ValueError(refusal)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(group, "_connection", None)
    monkeypatch.setattr(group, "_what_answers", lambda *_: None)  # Ray answers at the made-up address
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(group.WorkerError) as info:
        group.ensure_ray(address, 2, "cpu", {"py_modules": [str(notes)]})
    assert str(info.value).startswith(f"{REFUSED}{refusal}; it was {{'py_modules': ['{notes}']}}")
    with pytest.raises(ValueError, match="py_modules entry must be") as info:
        group.ensure_ray(address, 2, "cpu")
    assert not isinstance(info.value, group.WorkerError)


def test_the_cli_says_the_runtime_env_ray_refuses_in_one_line(workspace, tmp_path, capsys):
    """rlhf-ppo with 2 workers and a py_modules folder that is not there: exit 1, the message alone (it showed
    Ray's ValueError with a traceback)."""
    from rlhf_core.cli.train import ppo

    if ray.is_initialized():  # another module's cluster: its runtime_env would be kept, and this one not checked
        ray.shutdown()
    missing = tmp_path / "my_ext"
    code = ppo(workspace.overrides(tmp_path / "out", "trainer.n_gpus_per_node=2", "trainer.total_training_steps=1",
                                   f"+trainer.ray_runtime_env.py_modules=[{missing}]"))
    err = capsys.readouterr().err
    assert code == 1
    assert err.splitlines()[-1].startswith(f"error: {REFUSED}{missing} is not a valid path")
    assert "Traceback" not in err and not ray.is_initialized()


def test_the_ppo_command_asks_the_ray_address_once(workspace, tmp_path, monkeypatch, capsys):
    """rlhf-ppo on 2 workers asked trainer.ray_address in its preflight and again as its worker group joined it."""
    from rlhf_core.cli.train import ppo

    asked = []
    monkeypatch.setattr(group, "_what_answers", lambda *args: asked.append(args))  # Ray answers (None), counted

    def refuse(**_):
        raise ConnectionError("refused here")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code = ppo(workspace.overrides(tmp_path / "out", "trainer.n_gpus_per_node=2", "trainer.total_training_steps=1",
                                   "trainer.ray_address=ray://127.0.0.1:10001"))
    assert code == 1
    assert "cannot connect to the Ray cluster at trainer.ray_address='ray://127.0.0.1:10001' (or RAY_ADDRESS): " \
           "refused here" in capsys.readouterr().err
    assert asked == [("127.0.0.1", 10001, True)]


def test_a_runtime_env_that_comes_after_ray_was_connected_says_it_is_not_applied(monkeypatch, capsys):
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # the caller's connection
    monkeypatch.setattr(ray, "init", lambda **_: pytest.fail("connected twice"))
    monkeypatch.setattr(group, "_connection", None)
    group.ensure_ray(None, 2, "cpu", {"env_vars": {"A": "1"}})
    assert "notice: trainer.ray_runtime_env={'env_vars': {'A': '1'}} is not applied" in capsys.readouterr().err


def test_the_trainers_worker_groups_get_the_configs_runtime_env(monkeypatch):
    from rlhf_core.config import load_config

    given = {}

    class Recorder:
        def __init__(self, *args, **kwargs):
            given.update(kwargs)
            raise RuntimeError("recorded")

    monkeypatch.setattr(group, "WorkerGroup", Recorder)
    config = load_config(["+ray_kwargs.ray_init.runtime_env.env_vars.A=1", "trainer.n_gpus_per_node=2"],
                         validate=False)
    with pytest.raises(RuntimeError, match="recorded"):
        group.build_worker_groups(config, 1, use_ref=False, use_critic=False)
    assert given["runtime_env"] == {"env_vars": {"A": 1}}


def test_a_worker_that_cannot_import_external_lib_says_every_node_needs_it():
    """The driver imported it (from its PYTHONPATH, say); a worker on a joined cluster, started without that
    PYTHONPATH, did not: setting PYTHONPATH for the command, as the driver's hint says, would not have helped."""
    import torch

    from rlhf_core.config import load_config
    from rlhf_core.models.loading import ModelError

    config = load_config(["actor_rollout_ref.model.external_lib=no_such_module_here"], validate=False)
    threads = torch.get_num_threads()
    try:
        with pytest.raises(ModelError) as info:
            group.HybridWorker(0, 1, "cpu").setup(config, 1, use_ref=False, use_critic=False)
    finally:
        torch.set_num_threads(threads)
    message = str(info.value)
    assert message.startswith("actor_rollout_ref.model.external_lib: module 'no_such_module_here' cannot be imported")
    assert "it must be importable on every node of the cluster" in message
    assert "PYTHONPATH=. ..." not in message
    # the shipping it names is a valid override, and reaches ray.init as Ray's runtime_env
    shipped = load_config(["+ray_kwargs.ray_init.runtime_env.py_modules=[/path/to/its/package]"], validate=False)
    assert "+ray_kwargs.ray_init.runtime_env.py_modules=[/path/to/its/package]" in message
    assert shipped.trainer.ray_runtime_env == {"py_modules": ["/path/to/its/package"]}


def test_workers_importing_other_rlhf_core_code_than_the_driver_are_warned(ray_cluster, monkeypatch, capsys):
    """On an existing cluster each node imports its own rlhf_core: a group whose workers' code differs from the
    driver's says so as it starts (here the driver's fingerprint is made another one), and one whose code is the
    driver's says nothing."""
    import hashlib
    from pathlib import Path

    import rlhf_core

    root = Path(rlhf_core.__file__).resolve().parent
    digest = hashlib.sha256()  # the package's files, worked out here as the fingerprint is defined
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    assert group.code_fingerprint() == (str(root), digest.hexdigest())
    same = group.WorkerGroup(group.DistributedWorker, 2)
    same.shutdown()
    assert "rlhf_core code" not in capsys.readouterr().err
    monkeypatch.setattr(group, "code_fingerprint", lambda: ("/driver/rlhf_core", "0" * 64))
    other = group.WorkerGroup(group.DistributedWorker, 2)
    other.shutdown()
    assert (f"warning: the workers of ranks 0, 1 import other rlhf_core code ({root}) than this process "
            "(/driver/rlhf_core)") in capsys.readouterr().err
    assert group.code_mismatch(("/a", "1"), [("/a", "1"), ("/b", "2")]).startswith(
        "warning: the workers of rank 1 import other rlhf_core code (/b) than this process (/a)")


def test_workers_whose_rlhf_core_differs_in_the_same_folder_are_warned():
    """A node's installation at the same path as the driver's may still hold other code: the files' digest tells,
    not the folder."""
    driver = ("/opt/rlhf_core", "aaa")
    assert group.code_mismatch(driver, [driver, driver]) is None
    assert group.code_mismatch(driver, [driver, ("/opt/rlhf_core", "bbb")]).startswith(
        "warning: the workers of rank 1 import other rlhf_core code (/opt/rlhf_core) than this process "
        "(/opt/rlhf_core)")


_WORKER_PRINTS = """
import pathlib, sys, time
import ray
from rlhf_core.workers import group

group.ensure_ray(None, 1, "cpu")

@ray.remote(num_cpus=1)
def say():
    print("a line from a worker", file=sys.stderr, flush=True)

ray.get(say.remote())
log = pathlib.Path(sys.argv[1])
deadline = time.monotonic() + 60  # (the driver prints a worker's lines as Ray forwards them, within a second or so)
while "a line from a worker" not in log.read_text() and time.monotonic() < deadline:
    time.sleep(0.2)
ray.shutdown()
"""


def test_a_workers_lines_in_a_log_carry_no_colour_codes(tmp_path):
    """``rlhf-ppo ... > log 2>&1`` on Ray's workers: each worker line came as ``ESC[36m(HybridWorker pid=...)ESC[0m``,
    Ray's colour escapes in a file read as text. The driver, here a process whose output is a file, as a user's
    is, now prints the prefix plain."""
    import os
    import subprocess
    import sys

    log = tmp_path / "log"
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_COLOR_PREFIX", "RAY_ADDRESS")}
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-c", _WORKER_PRINTS, str(log)], stdout=out, stderr=subprocess.STDOUT,
                              env=env, timeout=240)
    text = log.read_text()
    worker_lines = [line for line in text.splitlines() if line.endswith("a line from a worker")]
    assert done.returncode == 0 and len(worker_lines) == 1, text
    assert worker_lines[0].startswith("(say pid=") and "\x1b" not in text, text
