"""Ray worker groups: the trainer's process drives N workers, each one rank of torch.distributed.

:class:`WorkerGroup` is the generic part: it reserves one bundle per worker in a Ray placement
group (``{"GPU": 1, "CPU": 1}``, or ``{"CPU": 1}`` with ``trainer.device=cpu``), starts one
worker per bundle (rank = bundle index), makes them join one process group (NCCL on GPU, gloo
on CPU), and calls their methods: the same arguments on every rank, or one :class:`Batch` share
per rank. A worker that raises or dies fails the call at once with a :class:`WorkerError`
naming the rank and carrying the worker's own error; the group is then shut down, since its
other ranks may be blocked in a collective that will never complete.

The PPO part follows verl's hybrid engine: every worker (:class:`HybridWorker`) holds the actor
with its rollout engine and reference and, for GAE, the critic, all sharded with FSDP2 over the
group (and, with ``reward_model.enable``, the reward model, scored through :class:`RewardModelGroup`).
:class:`ActorGroup` and :class:`CriticGroup` are what the trainer sees: the methods of
:class:`~rlhf_core.workers.actor.ActorWorker` and :class:`~rlhf_core.workers.critic.CriticWorker`,
with the batch split by rank and the results gathered back in order.

Ray: ``trainer.ray_address`` or ``$RAY_ADDRESS`` joins an existing cluster (where ``rlhf_core`` and any
``external_lib`` must be installed on every node, or the latter shipped with ``trainer.ray_runtime_env``, and
``trainer.default_local_dir`` be a shared filesystem);
otherwise a local cluster sized to this machine (and the group) is started, and started again larger for a
larger group once this process's groups on it are shut down.
"""

from __future__ import annotations

import copy
import os
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

from rlhf_core.batch import Batch
from rlhf_core.config import PPOConfig, attribute
from rlhf_core.progress import plain_colours
from rlhf_core.rollout import SamplingParams
from rlhf_core.workers import distributed
from rlhf_core.workers.common import peak_memory_gb

#: How long to wait, after a first failure, for the others (to report a death rather than its echo).
FAILURE_GRACE_S = 2.0
#: A call still running after this many seconds (or after STALL_FACTOR times the previous call of the same kind,
#: if that is longer: the same method, and for those that do unlike work, the same role or sampling) gets a
#: notice naming the ranks still in it, and again each time its age doubles: a rank that hangs otherwise shows
#: nothing until the collective timeout fails the call.
STALL_NOTICE_S = 300.0
STALL_FACTOR = 3.0
#: How long the address of a Ray cluster to join has to answer, as Ray, before ``ray.init`` is tried on it.
RAY_CONNECT_TIMEOUT_S = 5.0
#: How long an address that a command's preflight found answering as Ray is joined without asking it again.
RAY_ANSWER_KEPT_S = 600.0
#: The first bytes a client sends on an HTTP/2 connection (RFC 9113, 3.4): the preface, then an empty SETTINGS
#: frame. Any HTTP/2 server (gRPC, as Ray's GCS and its client server speak) answers with a SETTINGS frame.
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS_FRAME = 4  # the type byte of a frame's 9-byte header (length 3, type 1, flags 1, stream 4)
#: What is asked of the server, by the kind of address: Ray's GCS (``host:port``) the cluster's id, as Ray's own
#: GCS client asks first; a Ray client server (``ray://host:port``) a PING, as ``ray.util.client`` does. Each
#: request is its protobuf bytes: GetClusterIdRequest has no field; ClusterInfoRequest's field 1 (a varint) is PING, 6.
_RAY_CALLS = {
    False: ("Ray's GCS", "/ray.rpc.NodeInfoGcsService/GetClusterId", b""),
    True: ("a Ray client server", "/ray.rpc.RayletDriver/ClusterInfo", b"\x08\x06"),
}


class WorkerError(RuntimeError):
    """A worker of a group raised or died; the message names the rank, the method and the cause."""


# ----------------------------------------------------------------------------- the remote side


class DistributedWorker:
    """Base class of a remote worker: its rank, and joining the group's process group."""

    def __init__(self, rank: int, world_size: int, device: str = "cpu", threads: int = 1):
        self.rank, self.world_size = rank, world_size
        self.device = device
        if device == "cuda":
            torch.cuda.set_device(0)  # Ray shows each worker only the GPU of its bundle
        else:
            torch.set_num_threads(threads)

    def node_address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), distributed.free_port()

    def init_distributed(self, master_addr: str, master_port: int, backend: str, timeout_s: float) -> None:
        distributed.init_process_group(self.rank, self.world_size, master_addr, master_port, backend, timeout_s)

    def pid(self) -> int:
        return os.getpid()

    def code(self) -> tuple[str, str]:
        return code_fingerprint()


def code_fingerprint() -> tuple[str, str]:
    """Where this process imports ``rlhf_core`` from, and a SHA-256 over its Python files (each one's path in the
    package and bytes): what the driver and each worker compare as a group starts (:func:`code_mismatch`)."""
    import hashlib

    import rlhf_core

    root = Path(rlhf_core.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return str(root), digest.hexdigest()


def code_mismatch(driver: tuple[str, str], workers: Sequence[tuple[str, str]]) -> str | None:
    """A warning where workers import other ``rlhf_core`` code than the driver (``(folder, digest)`` each, as
    :func:`code_fingerprint` gives them): on an existing cluster each node imports its own installation, which the
    driver's checkout or ``PYTHONPATH`` does not reach. None where every worker's is the driver's."""
    other = [rank for rank, (_, digest) in enumerate(workers) if digest != driver[1]]
    if not other:
        return None
    ranks = ", ".join(map(str, other))
    folders = ", ".join(sorted({workers[rank][0] for rank in other}))
    return (f"warning: the workers of rank{'s' if len(other) > 1 else ''} {ranks} import other rlhf_core code "
            f"({folders}) than this process ({driver[0]}): they may train, score or save otherwise than this "
            "process expects. Install the same rlhf_core on every node of the Ray cluster, or ship it with "
            "trainer.ray_runtime_env (py_modules)")


#: The Ray connection this process made, while Ray is on it: the node id of the driver, the runtime_env it was made
#: with and, for a local cluster it started, the CPUs and GPUs it was given (None where it joined a cluster). None
#: where it made none, or where a caller connected Ray since.
_connection: dict | None = None
#: The worker groups still alive in this process (a group leaves at its shutdown, or when no one holds it).
_live_groups: weakref.WeakSet = weakref.WeakSet()


def _made_here() -> dict | None:
    """:data:`_connection`, where Ray is on that connection now."""
    import ray

    if _connection is None or not ray.is_initialized() or \
            _connection["node"] != ray.get_runtime_context().get_node_id():
        return None
    return _connection


def started_here() -> dict | None:
    """The local cluster this process started (``{"CPU": n, "GPU": m}``), where Ray is connected to it now."""
    made = _made_here()
    return None if made is None else made["local"]


def _for_ray(runtime_env: dict) -> dict:
    """``runtime_env`` as Ray takes it: its ``env_vars`` strings, as the command line or YAML wrote them
    (``env_vars.X=false`` or ``=1`` reach here as a bool or a number, which Ray refuses), without those set to
    null (a YAML ``X: null``), which would otherwise reach every worker as the string "None"."""
    env_vars = runtime_env.get("env_vars")
    if not isinstance(env_vars, dict):
        return dict(runtime_env)
    spelt = {name: str(value).lower() if isinstance(value, bool) else str(value)
             for name, value in env_vars.items() if value is not None}
    return {**runtime_env, "env_vars": spelt}


def _cpus_and_gpus(resources: dict) -> dict:
    """The CPUs and GPUs of Ray's ``resources`` (without its per-placement-group keys, ``CPU_group_...``)."""
    return {kind: resources.get(kind, 0.0) for kind in ("CPU", "GPU")}


def _workers(count: int, bundle: dict) -> str:
    return f"1 worker of {bundle}" if count == 1 else f"{count} workers of {bundle} each"


def _held_by_live_groups() -> dict:
    """The CPUs and GPUs that this process's live worker groups reserve."""
    held = {"CPU": 0.0, "GPU": 0.0}
    for live in list(_live_groups):
        for kind, n in getattr(live, "holds", {}).items():
            held[kind] += n
    return held


def _refused(runtime_env: dict, exc: Exception) -> str:
    reason = " ".join(str(exc).split())[:300].rstrip(".")
    return (f"trainer.ray_runtime_env (verl's ray_kwargs.ray_init.runtime_env) is refused by Ray: {reason}; it was "
            f"{runtime_env} (a relative path in it is read from the directory the command runs in, {os.getcwd()})")


def _check_runtime_env(runtime_env: dict) -> None:
    """Ray's own checks of ``runtime_env`` (its fields' types, that its local paths exist), before Ray starts."""
    if not runtime_env:
        return
    from ray.runtime_env import RuntimeEnv

    try:
        RuntimeEnv(**runtime_env)
    except (TypeError, ValueError) as exc:
        raise WorkerError(_refused(runtime_env, exc)) from None


def address_problem(address: str, remember: bool = False) -> str | None:
    """Why no Ray cluster can be joined at ``address`` (``host:port`` or ``ray://host:port``): its host does not
    resolve, nothing answers at its port, or what answers is not Ray (a web server, a listener that says nothing),
    each found within about :data:`RAY_CONNECT_TIMEOUT_S`, where ``ray.init`` retries for many minutes (some 45 s
    a try, 20 tries), printing only Ray's own warnings. None where Ray answers; ``auto`` and addresses of other
    forms are left to Ray. With ``remember`` (a command's preflight), an address where Ray answers is noted for
    the next :func:`ensure_ray` to join without asking it again."""
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit() or (":" in host and not host.startswith("[")):  # (a bare IPv6 address)
        return None
    client = address.startswith("ray://")
    try:
        answer = _what_answers(host, int(port), client)
    except socket.gaierror as exc:
        return (f"trainer.ray_address (or RAY_ADDRESS) {address!r}: cannot resolve the host {host!r} "
                f"({exc.strerror or exc}); fix the address")
    except OSError as exc:
        return (f"trainer.ray_address (or RAY_ADDRESS) {address!r}: nothing answers at {host}:{port} within "
                f"{RAY_CONNECT_TIMEOUT_S:.0f} s ({exc.strerror or exc}); start the cluster there (ray start --head "
                f"--port {port}) or fix the address")
    if answer is not None:
        fix = ("give ray://<head>:<its --ray-client-server-port, 10001 by default>, or the head's GCS address "
               "without ray:// (port 6379 by default)") if client else \
              ("give the head's GCS address (ray start --head prints it; port 6379 by default), or a Ray client "
               "server's as ray://<head>:10001")
        return (f"trainer.ray_address (or RAY_ADDRESS) {address!r}: what answers at {host}:{port} is not "
                f"{_RAY_CALLS[client][0]}: {answer}; {fix}")
    if remember:
        _answered[address] = time.monotonic()
    return None


#: Addresses a preflight found answering as Ray, with when: the next ensure_ray joins one of them (within
#: RAY_ANSWER_KEPT_S) without asking again, so that a command asks an address once
_answered: dict[str, float] = {}


def _answered_lately(address: str) -> bool:
    """Whether a preflight found Ray at ``address`` within :data:`RAY_ANSWER_KEPT_S`; the note is used up."""
    found = _answered.pop(address, None)
    return found is not None and time.monotonic() - found < RAY_ANSWER_KEPT_S


def _what_answers(host: str, port: int, client: bool) -> str | None:
    """What answers at ``host:port`` where it is not Ray (its GCS; a client server where ``client``), in words;
    None where Ray does. Raises OSError where nothing answers (the host unknown, the connection refused or not
    made within :data:`RAY_CONNECT_TIMEOUT_S`).

    Two questions, within the timeout together: is it an HTTP/2 server (it answers HTTP/2's preface with a
    SETTINGS frame), and does it answer Ray's own first call (:data:`_RAY_CALLS`)? A cluster that asks for a
    token (RAY_AUTH_MODE) refuses the call unauthenticated: it is Ray, and ray.init says what it wants. A cluster
    on TLS (RAY_USE_TLS) is asked nothing past the connection."""
    import grpc

    deadline = time.monotonic() + RAY_CONNECT_TIMEOUT_S
    within = f"within {RAY_CONNECT_TIMEOUT_S:.0f} s"
    with socket.create_connection((host.strip("[]"), port), timeout=RAY_CONNECT_TIMEOUT_S) as conn:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
            return None
        conn.settimeout(max(deadline - time.monotonic(), 0.5))
        try:
            conn.sendall(_HTTP2_PREFACE)
            first = conn.recv(256)
        except TimeoutError:
            return f"it accepts the connection but sends nothing {within}"
        except OSError as exc:
            return f"it accepts the connection, then drops it ({exc.strerror or exc})"
    if not first:
        return "it accepts the connection and closes it without a word"
    if len(first) < 9 or first[3] != _SETTINGS_FRAME:  # not an HTTP/2 server
        said = first.split(b"\n")[0].strip().decode("ascii", "replace")[:80]
        web = first.startswith(b"HTTP/") or first.lstrip().lower().startswith((b"<!doctype html", b"<html"))
        return f"{'a web server (HTTP/1)' if web else 'a server that does not speak gRPC'}, which says {said!r}"
    _, method, request = _RAY_CALLS[client]
    channel = grpc.insecure_channel(f"{host}:{port}", options=[("grpc.enable_http_proxy", 0)])  # (as Ray's own)
    try:
        channel.unary_unary(method)(request, timeout=max(deadline - time.monotonic(), 0.5))
    except grpc.RpcError as exc:
        if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return None
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"an HTTP/2 server, which does not answer {method} {within}"
        details = f": {exc.details()}" if exc.details() else ""
        return f"an HTTP/2 server, which answers {method} with {exc.code().name}{details}"
    finally:
        channel.close()
    return None


def ensure_ray(address: str | None, world_size: int, device: str, runtime_env: dict | None = None) -> None:
    """Connect to ``address`` / ``$RAY_ADDRESS``, or start a local cluster with room for ``world_size`` workers;
    either with ``runtime_env`` (``trainer.ray_runtime_env``: what every worker of the job gets, on any node).

    A local cluster keeps the size it started with; where it is this process's own, too small for ``world_size``
    workers and no worker group of this process is alive on it (a larger group after a smaller one shut down),
    it is stopped and started again large enough. Otherwise a connection made before (by this process's caller,
    or for an earlier group) is kept as it is, with the runtime_env it was made with."""
    global _connection
    import ray

    plain_colours()  # (Ray reads it as it prints a worker's line, in this process)
    runtime_env = _for_ray(runtime_env or {})
    cpus = max(os.cpu_count() or 1, world_size)  # one CPU per worker; a smaller machine runs them oversubscribed
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if ray.is_initialized():
        made, own = _made_here(), started_here()
        if own is None or (cpus <= own["CPU"] and gpus <= own["GPU"]) or len(_live_groups):
            if runtime_env and (made is None or made["runtime_env"] != runtime_env):
                print(f"notice: trainer.ray_runtime_env={runtime_env} is not applied: Ray was started or joined "
                      "before, and its workers run with the runtime_env it was given then", file=sys.stderr,
                      flush=True)
            return
        _check_runtime_env(runtime_env)  # before the cluster is stopped to start again
        ray.shutdown()
        cpus, gpus = max(cpus, own["CPU"]), max(gpus, own["GPU"])
        print(f"notice: the local Ray cluster this process started ({own}) is too small for {world_size} workers "
              f"and runs none: started again with {{'CPU': {cpus}, 'GPU': {gpus}}}", file=sys.stderr, flush=True)
    _check_runtime_env(runtime_env)
    address = address or os.environ.get("RAY_ADDRESS")
    if address and not _answered_lately(address) and (problem := address_problem(address)) is not None:
        raise WorkerError(problem)
    # ray.init puts in a SIGTERM handler of its own (sys.exit(15)): the command's (rlhf_core.cli: a SIGTERM said
    # as a Ctrl-C is, exit 143) stays; a default one is left to Ray's, as before
    sigterm = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        if address:
            ray.init(address=address, runtime_env=runtime_env or None)
            local = None
        else:
            ray.init(num_cpus=cpus, num_gpus=gpus, include_dashboard=False, runtime_env=runtime_env or None)
            local = {"CPU": cpus, "GPU": gpus}
    except ConnectionError as exc:  # refused, timed out, or an authentication the cluster asks for
        raise WorkerError(f"cannot connect to the Ray cluster at trainer.ray_address={address!r} (or "
                          f"RAY_ADDRESS): {' '.join(str(exc).split())[:300]}; check the address, that the cluster "
                          "is up (ray status there), and the cluster's authentication (RAY_AUTH_MODE and its "
                          "token)") from None
    except (TypeError, ValueError) as exc:  # what Ray checks of the runtime_env only as it starts (a py_modules
        if not runtime_env:  # entry that is neither a directory, a .py nor a .whl file)
            raise
        if ray.is_initialized():
            ray.shutdown()
        raise WorkerError(_refused(runtime_env, exc)) from None
    finally:
        if callable(sigterm):
            signal.signal(signal.SIGTERM, sigterm)
    _connection = {"node": ray.get_runtime_context().get_node_id(), "runtime_env": runtime_env, "local": local}


class WorkerGroup:
    """``world_size`` instances of ``worker_cls`` (a :class:`DistributedWorker`) in one process group."""

    def __init__(self, worker_cls: type, world_size: int, device: str = "cpu", ray_address: str | None = None,
                 placement_timeout_s: float = 300.0, collective_timeout_s: float = 1800.0,
                 runtime_env: dict | None = None):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ensure_ray(ray_address, world_size, device, runtime_env)
        self.world_size = world_size
        self.failed: str | None = None
        self.collective_timeout_s = collective_timeout_s
        self._last: dict[str, float] = {}  # kind of call (its method, or dispatch's kind) -> previous call's seconds
        bundle = {"CPU": 1, "GPU": 1} if device == "cuda" else {"CPU": 1}
        self.holds = {kind: need * world_size for kind, need in bundle.items()}  # what its placement group reserves
        total = _cpus_and_gpus(ray.cluster_resources())
        short = {kind: total[kind] for kind, need in self.holds.items() if total[kind] < need}
        # this process's local cluster does not grow, and what this process's live groups hold on it nothing frees
        # while this waits: a group that does not fit beside them fails at once (counted from the groups, since
        # Ray's available resources lag a group's shutdown by a moment)
        own = started_here()
        if own is not None:
            held = _held_by_live_groups()
            if short or any(total[kind] - held[kind] < need for kind, need in self.holds.items()):
                raise WorkerError(self._cannot_place_here(bundle, total, own, held, short))
        elif short:  # it may grow (an autoscaling cluster): say why the wait, rather than wait in silence
            print(f"waiting up to {placement_timeout_s:.0f} s to place {_workers(world_size, bundle)}: the Ray "
                  f"cluster has {short} now", file=sys.stderr, flush=True)
        self.placement_group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        ready, _ = ray.wait([self.placement_group.ready()], timeout=placement_timeout_s)
        if not ready:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
            where = ("the local Ray cluster this process started" if own is not None else "the Ray cluster")
            also = ("; lower trainer.n_gpus_per_node * trainer.nnodes or add nodes" if own is None else
                    ": Ray tasks or actors other than this process's worker groups hold the rest")
            raise WorkerError(
                f"cannot place {_workers(world_size, bundle)} within {placement_timeout_s:.0f} s: {where} "
                f"has {total}, of which {_cpus_and_gpus(ray.available_resources())} are free{also}")
        _live_groups.add(self)
        remote_cls = ray.remote(worker_cls)
        self.workers = [
            remote_cls.options(
                num_cpus=1, num_gpus=1 if device == "cuda" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=rank),
            ).remote(rank, world_size, device)
            for rank in range(world_size)
        ]
        self.pids = self.execute_all("pid")
        if (mismatch := code_mismatch(code_fingerprint(), self.execute_all("code"))) is not None:
            print(mismatch, file=sys.stderr, flush=True)
        master_addr, master_port = self.execute_rank(0, "node_address")
        self.execute_all("init_distributed", master_addr, master_port, distributed.backend_for(device),
                         collective_timeout_s)

    def _cannot_place_here(self, bundle: dict, total: dict, own: dict, held: dict, short: dict) -> str:
        """Why this group does not fit on the local cluster this process started (``own``, as it started), whose
        size is ``total`` and of which this process's live groups hold ``held``."""
        alive = len(_live_groups)
        groups = f"{alive} worker group{'s' if alive != 1 else ''} of this process"
        run, hold = ("run", "hold") if alive != 1 else ("runs", "holds")
        if short and alive:
            why = f"{groups} still {run} on it, so it was not started again larger: shut them down first"
        elif short:
            why = "this machine has no more"
        else:
            why = f"{groups} {hold} {held} of it: shut {'them' if alive != 1 else 'it'} down first"
        return (f"cannot place {_workers(self.world_size, bundle)}: the local Ray cluster this process "
                f"started has {total} (its size when it started: {own}); {why}, or lower "
                "trainer.n_gpus_per_node * trainer.nnodes")

    # ------------------------------------------------------------------ calls
    def execute_all(self, method: str, *args, **kwargs) -> list:
        """``method(*args, **kwargs)`` on every rank; the results in rank order."""
        self._check_alive(method)
        return self._wait([getattr(w, method).remote(*args, **kwargs) for w in self.workers], method)

    def execute_rank(self, rank: int, method: str, *args, **kwargs):
        self._check_alive(method)
        return self._wait([getattr(self.workers[rank], method).remote(*args, **kwargs)], method, ranks=[rank])[0]

    def dispatch(self, method: str, shares: list[Batch], *args, kind: str | None = None, **kwargs) -> list:
        """``method(shares[rank], *args, **kwargs)`` on each rank; the results in rank order. ``kind`` tells calls
        of one method that do unlike work apart (the actor's and the critic's updates, training and validation
        rollouts), so that each waits on its own previous call's time before a stall notice."""
        if len(shares) != self.world_size:
            raise ValueError(f"{len(shares)} batch shares for {self.world_size} workers")
        self._check_alive(method)
        refs = [getattr(w, method).remote(share, *args, **kwargs) for w, share in zip(self.workers, shares)]
        return self._wait(refs, method, kind=kind)

    def _check_alive(self, method: str) -> None:
        if self.failed is not None:
            raise WorkerError(f"cannot call {method}: the worker group was shut down after a failure ({self.failed})")

    def _wait(self, refs: list, method: str, ranks: list[int] | None = None, kind: str | None = None) -> list:
        """Results of ``refs`` in order; on the first failure, the failure (see :meth:`_raise`)."""
        import ray

        ranks = ranks if ranks is not None else list(range(len(refs)))
        rank_of = {ref: rank for ref, rank in zip(refs, ranks)}
        results: dict = {}
        pending = list(refs)
        started = time.monotonic()
        finished: dict[int, float] = {}  # rank -> seconds it took
        kind = kind or method
        notice_at = max(STALL_NOTICE_S, STALL_FACTOR * self._last.get(kind, 0.0))
        while pending:
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=max(0.0, notice_at - (time.monotonic() - started)))
            if not ready:
                self._stall_notice(method, kind, time.monotonic() - started, [rank_of[ref] for ref in pending],
                                   finished)
                notice_at *= 2
                continue
            for ref in ready:
                try:
                    results[ref] = ray.get(ref)
                except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
                    failures = [(rank_of[ref], exc)] + self._more_failures(pending, rank_of)
                    self._raise(method, failures)
                finished[rank_of[ref]] = time.monotonic() - started
        self._last[kind] = time.monotonic() - started
        return [results[ref] for ref in refs]

    def _stall_notice(self, method: str, kind: str, elapsed: float, running: list[int],
                      finished: dict[int, float]) -> None:
        """Say which ranks are still in ``method``, and what happens if one of them hangs."""
        pids = getattr(self, "pids", None)
        who = ", ".join(f"{rank} (pid {pids[rank]})" if pids else str(rank) for rank in sorted(running))
        line = f"notice: {method} has run {elapsed:.0f} s on rank{'s' if len(running) > 1 else ''} {who}"
        if finished:
            done = sorted(finished)
            line += (f"; rank{'s' if len(done) > 1 else ''} {', '.join(map(str, done))} finished it after "
                     f"{max(finished.values()):.0f} s")
        if kind in self._last:
            line += f"; its previous call took {self._last[kind]:.0f} s"
        pid = f" {pids[min(running)]}" if pids else " PID"
        print(f"{line}. A rank that hangs holds the others at their next collective until "
              f"actor_rollout_ref.nccl_timeout ({self.collective_timeout_s:.0f} s) fails the call (a hang outside "
              f"any collective is not timed out); `py-spy dump --pid{pid}` shows where a rank is.",
              file=sys.stderr, flush=True)

    @staticmethod
    def _more_failures(pending: list, rank_of: dict) -> list:
        import ray

        more = []
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=FAILURE_GRACE_S) if pending else ([], [])
        for ref in ready:
            try:
                ray.get(ref)
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
                more.append((rank_of[ref], exc))
        return more

    def _raise(self, method: str, failures: list) -> None:
        """Shut the group down and raise the most telling failure: a dead worker before the errors
        its peers see in their collectives."""
        import ray

        failures.sort(key=lambda item: not isinstance(item[1], ray.exceptions.RayActorError))
        rank, exc = failures[0]
        pid = self.pids[rank] if getattr(self, "pids", None) else "?"
        if isinstance(exc, ray.exceptions.RayActorError):
            cause = f"worker rank {rank} (pid {pid}) died during {method}: {exc}"
        else:
            cause = f"worker rank {rank} (pid {pid}) raised in {method}:\n{exc}"
        others = sorted({r for r, _ in failures[1:]} - {rank})
        if others:
            cause += f"\n(ranks {others} failed after it)"
        self.failed = f"rank {rank} failed in {method}"
        self.shutdown()
        raise WorkerError(cause) from exc

    def shutdown(self) -> None:
        """Stop every worker and free the placement group (idempotent)."""
        import ray

        for worker in getattr(self, "workers", []):
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.workers = []
        if getattr(self, "placement_group", None) is not None:
            try:
                ray.util.remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001 - already removed
                pass
            self.placement_group = None
        _live_groups.discard(self)
        self.failed = self.failed or "shut down"


# ----------------------------------------------------------------------------- batch layouts


def split_evenly(batch: Batch, parts: int) -> tuple[list[Batch], int]:
    """``parts`` equal consecutive shares of ``batch``, padded (by repeating its last row) to a multiple
    of ``parts``; returns (shares, number of padding rows, all at the end of the last share)."""
    pad = -len(batch) % parts
    if pad:
        batch = Batch.concat([batch, batch.select([len(batch) - 1] * pad)])
    return batch.chunk(parts), pad


def balanced_order(lengths: Sequence[int], parts: int) -> list[int]:
    """An order of the rows whose ``parts`` equal consecutive shares carry about equal token totals (verl's
    ``balance_batch``): the longest row first, each to the share with the fewest tokens that has room."""
    size = len(lengths) // parts
    shares: list[list[int]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        part = min((p for p in range(parts) if len(shares[p]) < size), key=lambda p: (totals[p], p))
        shares[part].append(row)
        totals[part] += lengths[row]
    return [row for share in shares for row in sorted(share)]


def _tokens(batch: Batch) -> list[int]:
    return batch["attention_mask"].sum(-1).tolist()


def minibatch_shares(batch: Batch, mini_rows: int, parts: int, balance: bool = False) -> list[Batch]:
    """Each rank's share of a rollout batch for a PPO update: rank r gets the r-th ``1/parts`` of every
    mini-batch of ``mini_rows`` consecutive rows, so rank r's k-th local mini-batch is its part of the
    k-th global one and N workers update on exactly the mini-batches one worker would (without ``shuffle``:
    with it each rank shuffles its own share, as verl's ranks do, so the mini-batches are drawn otherwise than
    one worker's, as unbiased). With ``balance``
    each mini-batch's rows are first ordered so that its parts carry about equal tokens (the same rows in
    the same mini-batch: the update is the same, the ranks wait less on each other; with ``shuffle`` the
    ranks then shuffle other shares, so other rows meet in a mini-batch)."""
    if len(batch) % mini_rows or mini_rows % parts:
        raise ValueError(f"a batch of {len(batch)} rows in mini-batches of {mini_rows} cannot be shared evenly "
                         f"by {parts} workers")
    share = mini_rows // parts
    order = list(range(len(batch)))
    if balance:
        tokens = _tokens(batch)
        order = [start + i for start in range(0, len(batch), mini_rows)
                 for i in balanced_order(tokens[start:start + mini_rows], parts)]
    rows = [[order[start + r * share + k] for start in range(0, len(batch), mini_rows) for k in range(share)]
            for r in range(parts)]
    return [batch.select(r) for r in rows]


def gather(batches: list[Batch], drop_last: int = 0) -> Batch:
    """The ranks' outputs concatenated in rank order, less ``drop_last`` padding rows at the end."""
    widths = {b["responses"].shape[1] for b in batches if "responses" in b}
    if len(widths) > 1:
        raise WorkerError(f"workers returned responses of different lengths {sorted(widths)}; generation must run "
                          "the same number of steps on every rank")
    merged = Batch.concat(batches)
    return merged.select(slice(0, len(merged) - drop_last)) if drop_last else merged


# ----------------------------------------------------------------------------- the PPO workers


class HybridWorker(DistributedWorker):
    """One rank of the hybrid engine: actor + rollout + reference (and the critic), FSDP2-sharded."""

    def setup(self, config: PPOConfig, total_steps: int, use_ref: bool, use_critic: bool) -> None:
        from rlhf_core import heap
        from rlhf_core.models import cpu_matmul
        from rlhf_core.models.loading import WORKER_IMPORT_HINT, import_external_lib, load_tokenizer
        from rlhf_core.workers.actor import build_actor
        from rlhf_core.workers.critic import build_critic

        arr = config.actor_rollout_ref
        import_external_lib(arr.model.external_lib, hint=WORKER_IMPORT_HINT)
        cpu_matmul.configure(config.trainer.cpu_matmul, config.trainer.cpu_matmul_dtype)
        heap.configure(config.trainer.keep_freed_memory)
        tokenizer = load_tokenizer(config.value("actor_rollout_ref.model.tokenizer_path"), arr.model.trust_remote_code)
        seed, device = config.trainer.seed, self.device
        self.actor = build_actor(config, tokenizer, total_steps, use_ref, seed, device)
        self.critic = None
        if use_critic:
            self.critic = build_critic(config, total_steps, seed, device)
        self.reward_model = None
        if config.reward_model.enable:
            from rlhf_core.rewards.reward_model import RewardModelWorker

            self.reward_model = RewardModelWorker(config.reward_model, device=device,
                                                  policy_path=config.actor_rollout_ref.model.path)

    def _role(self, role: str):
        return self.actor if role == "actor" else self.critic

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        return self.actor.generate(prompts, params)

    def compute_log_prob(self, batch: Batch):
        return self.actor.compute_log_prob(batch)

    def compute_ref_log_prob(self, batch: Batch):
        return self.actor.compute_ref_log_prob(batch)

    def compute_values(self, batch: Batch):
        return self.critic.compute_values(batch)

    def compute_rm_score(self, batch: Batch):
        return self.reward_model.compute_rm_score(batch)

    def update(self, batch: Batch, role: str, n_per_prompt: int, **kwargs) -> tuple[dict[str, float], int]:
        """(metrics, optimizer steps skipped in this call) of a policy or critic update on this rank's share;
        ``kwargs`` go to the update (the policy's ``kl_loss_coef``)."""
        worker = self._role(role)
        skipped = worker.skipped_steps
        metrics = worker.update_policy(batch, n_per_prompt, **kwargs) if role == "actor" \
            else worker.update_critic(batch, n_per_prompt)
        return metrics, worker.skipped_steps - skipped

    def save_shards(self, role: str, folder: str) -> None:
        self._role(role).save_shards(folder)

    def load_shards(self, role: str, folder: str, weights_only: bool) -> None:
        self._role(role).load_shards(folder, weights_only)

    def weights_finite(self, role: str) -> bool:
        return self._role(role).weights_finite()

    def save_hf(self, folder: str) -> None:
        self.actor.save_hf(folder)

    def save_adapter(self, folder: str) -> None:
        self.actor.save_adapter(folder)

    def scale_lr(self, factor: float, role: str = "actor") -> None:
        self._role(role).scale_lr(factor)

    def peak_memory_gb(self) -> float:
        return peak_memory_gb()


class _RoleGroup:
    """What the trainer and the checkpoint code see of one role on a worker group."""

    sharded = True
    role = ""

    def __init__(self, group: WorkerGroup, mini_batch_size: int, balance: bool = False):
        self.group = group
        self.mini_batch_size = mini_batch_size  # prompts per optimizer step
        self.balance = balance  # trainer.balance_batch: the ranks' shares carry about equal tokens
        self.skipped_steps = 0

    def _map(self, method: str, batch: Batch) -> list:
        """``method`` on even shares of ``batch``, one per rank; each rank's results (one per row) joined in
        the batch's row order. With ``balance`` the rows are first laid out so that the shares carry about
        equal tokens, and the results put back in order."""
        parts = self.group.world_size
        if self.balance and len(batch) % parts == 0:
            order = balanced_order(_tokens(batch), parts)
            results = self.group.dispatch(method, batch.select(order).chunk(parts))
            back = torch.empty(len(order), dtype=torch.long)
            back[torch.tensor(order)] = torch.arange(len(order))
            return [_cat(list(parts_of), 0)[back] for parts_of in _columns(results)]
        shares, pad = split_evenly(batch, parts)
        return [_cat(list(parts_of), pad) for parts_of in _columns(self.group.dispatch(method, shares))]

    def _update(self, batch: Batch, n_per_prompt: int, **kwargs) -> dict[str, float]:
        shares = minibatch_shares(batch, self.mini_batch_size * n_per_prompt, self.group.world_size, self.balance)
        results = self.group.dispatch("update", shares, self.role, n_per_prompt, kind=f"update ({self.role})",
                                      **kwargs)
        self.skipped_steps += results[0][1]  # the skip decision is the same on every rank
        return results[0][0]  # metrics are already reduced over the ranks

    def save_shards(self, folder: str | Path) -> None:
        self.group.execute_all("save_shards", self.role, absolute(folder))

    def load_shards(self, folder: str | Path, weights_only: bool = False) -> None:
        self.group.execute_all("load_shards", self.role, absolute(folder), weights_only)

    def weights_finite(self) -> bool:
        """Whether every rank's shards of the role's weights hold finite values."""
        return all(self.group.execute_all("weights_finite", self.role))

    def scale_lr(self, factor: float) -> None:
        self.group.execute_all("scale_lr", factor, self.role)


def absolute(path: str | Path) -> str:
    """``path`` against the driver's working directory: a worker of an existing Ray cluster runs in the
    cluster's own, where a relative path names another folder (its shards went there, the checkpoint lacked
    them)."""
    return os.path.abspath(os.path.expanduser(str(path)))


# the config's local paths a worker reads or writes (models, tokenizers, checkpoints, a reward file)
WORKER_PATH_KEYS = ("actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path", "critic.model.path",
                    "critic.model.tokenizer_path", "reward_model.model.path", "reward_model.model.input_tokenizer",
                    "data.tokenizer", "custom_reward_function.path", "trainer.default_local_dir",
                    "trainer.resume_from_path")


def for_workers(config, keys: Sequence[str] = WORKER_PATH_KEYS, folders: Sequence[str] = ("trainer.default_local_dir",)):
    """A copy of ``config`` (a :class:`PPOConfig`, or a section of one with ``keys`` of its own) whose relative
    local paths under ``keys`` (those that exist here, and the ``folders`` a run creates) are absolute against
    the driver's working directory, as the workers must read them (:func:`absolute`). The driver's own config,
    the one checkpoints record and resumes compare, stays as given."""
    copied = copy.deepcopy(config)
    for key in keys:
        section, _, name = key.rpartition(".")
        node = attribute(copied, section)
        value = getattr(node, name)
        if isinstance(value, str) and value and not os.path.isabs(os.path.expanduser(value)) \
                and (os.path.exists(value) or key in folders):
            setattr(node, name, absolute(value))
    return copied


def _cat(parts: list[torch.Tensor], pad: int) -> torch.Tensor:
    merged = torch.cat(parts)
    return merged[:len(merged) - pad] if pad else merged


def _columns(results: list) -> list[tuple]:
    """Per-rank results as columns: ((rank 0's, rank 1's, ...),) for one tensor each, or one column per
    element of the tuples the method returns."""
    return list(zip(*results)) if isinstance(results[0], tuple) else [tuple(results)]


class ActorGroup(_RoleGroup):
    role = "actor"

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        shares, pad = split_evenly(prompts, self.group.world_size)
        # validation's rollouts (its own n, sampling and streams) are timed apart from training's
        drawn = "greedy" if params.greedy else "sampled" if params.seed is None else "sampled, seeded"
        kind = f"generate (n={params.n}, {drawn})"
        return gather(self.group.dispatch("generate", shares, params, kind=kind), drop_last=pad * params.n)

    def compute_log_prob(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        log_prob, entropy = self._map("compute_log_prob", batch)
        return log_prob, entropy

    def compute_ref_log_prob(self, batch: Batch) -> torch.Tensor:
        [log_prob] = self._map("compute_ref_log_prob", batch)
        return log_prob

    def update_policy(self, batch: Batch, n_per_prompt: int, kl_loss_coef: float | None = None) -> dict[str, float]:
        return self._update(batch, n_per_prompt, kl_loss_coef=kl_loss_coef)

    def save_hf(self, target: str | Path) -> None:
        self.group.execute_all("save_hf", absolute(target))

    def save_adapter(self, target: str | Path) -> None:
        self.group.execute_all("save_adapter", absolute(target))

    def peak_memory_gb(self) -> float:
        return max(self.group.execute_all("peak_memory_gb"))


class CriticGroup(_RoleGroup):
    role = "critic"

    def compute_values(self, batch: Batch) -> torch.Tensor:
        [values] = self._map("compute_values", batch)
        return values

    def update_critic(self, batch: Batch, n_per_prompt: int) -> dict[str, float]:
        return self._update(batch, n_per_prompt)


class RewardModelGroup:
    """The reward model on a worker group, sharded with FSDP2 like the critic: each rank scores an even share."""

    def __init__(self, group: WorkerGroup):
        self.group = group

    def compute_rm_score(self, batch: Batch) -> torch.Tensor:
        shares, pad = split_evenly(batch, self.group.world_size)
        return _cat(self.group.dispatch("compute_rm_score", shares), pad)


def build_worker_groups(config: PPOConfig, total_steps: int, use_ref: bool, use_critic: bool,
                        worker_cls: type = HybridWorker) -> tuple[WorkerGroup, ActorGroup, CriticGroup | None]:
    """Start ``trainer.n_gpus_per_node * trainer.nnodes`` hybrid workers and load the models on them."""
    trainer = config.trainer
    started = time.perf_counter()
    group = WorkerGroup(worker_cls, config.world_size, device=trainer.device, ray_address=trainer.ray_address,
                        collective_timeout_s=config.actor_rollout_ref.nccl_timeout,
                        runtime_env=trainer.ray_runtime_env)
    try:
        group.execute_all("setup", for_workers(config), total_steps, use_ref, use_critic)
    except BaseException:
        group.shutdown()
        raise
    arr = config.actor_rollout_ref
    balance = trainer.balance_batch
    actor = ActorGroup(group, arr.actor.ppo_mini_batch_size, balance)
    critic = CriticGroup(group, config.value("critic.ppo_mini_batch_size"), balance) \
        if use_critic else None
    print(f"started {config.world_size} workers ({trainer.device}, FSDP2) in {time.perf_counter() - started:.1f} s",
          file=sys.stderr, flush=True)
    return group, actor, critic
