"""torch.distributed for the multi-worker path: process groups, small all-reduces, FSDP2 sharding,
full state dicts and sharded checkpoints.

Every collective helper returns its input unchanged when no process group with more than one
rank is up, so the workers call them unconditionally and the single-process path is untouched.

Sharding follows the FSDP2 recipe: ``fully_shard`` on every transformer block (the classes a
model lists in ``_no_split_modules``), then on the root, which keeps the embeddings, the final
norm and the heads. Gradients are *summed* across ranks (divide factor 1): the losses are
already divided by the token (or sequence) count of the global mini-batch, so the sum over ranks
is the gradient one worker would compute on the whole mini-batch.
"""

from __future__ import annotations

import datetime
import os
import socket
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from rlhf_core.models import lora

# ----------------------------------------------------------------------------- process groups


_JOINED = False  # this process is a rank of a worker group (not merely a library's own process group)


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, backend: str,
                       timeout_s: float = 1800.0) -> None:
    """Join the default process group as a worker's rank; also sets the torchrun-style environment
    (vLLM's external launcher reads it)."""
    global _JOINED
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": master_addr,
                       "MASTER_PORT": str(master_port)})
    os.environ.setdefault("LOCAL_RANK", "0")  # each worker sees only its own device
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    _JOINED = True


def in_worker_group() -> bool:
    """Whether this process joined a worker group through :func:`init_process_group`: its models are
    then sharded. (vLLM starts a one-rank process group of its own in a single process; that one does
    not count.)"""
    return _JOINED and is_initialized()


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_distributed() -> bool:
    """A process group with more than one rank is up."""
    return is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def _device() -> torch.device:
    """Where collectives run: the current GPU under NCCL, the CPU under gloo."""
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ----------------------------------------------------------------------------- small collectives


def _all_reduce_floats(values: list[float], op) -> list[float]:
    """``values`` reduced element-wise over the ranks by ``op``, in float64."""
    if not is_distributed() or not values:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum of ``values`` over the ranks (float64, so token counts stay exact)."""
    return _all_reduce_floats(values, dist.ReduceOp.SUM)


def all_reduce_max(value: int) -> int:
    if not is_distributed():
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def all_reduce_max_floats(values: list[float]) -> list[float]:
    """Element-wise maximum of ``values`` over the ranks (float64; a minimum is minus the maximum of the negated)."""
    return _all_reduce_floats(values, dist.ReduceOp.MAX)


def all_true(flag: bool) -> bool:
    """True only if ``flag`` is true on every rank."""
    if not is_distributed():
        return flag
    tensor = torch.tensor([int(flag)], dtype=torch.int64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return bool(tensor.item())


def all_done(local_done: bool, local_failed: bool = False) -> tuple[bool, bool]:
    """The ``synced`` hook of the HF rollout: (every rank is done, some rank failed), in one all-reduce. Generating
    stops only when every rank is done, so a sharded model runs the same number of forward passes (and
    all-gathers) everywhere, or when any rank cannot go on (NaN logits), so that none is left waiting for it."""
    if not is_distributed():
        return local_done, local_failed
    tensor = torch.tensor([int(not local_done), int(local_failed)], dtype=torch.int64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    not_done, failed = tensor.tolist()
    return not not_done, bool(failed)


# ----------------------------------------------------------------------------- FSDP2


def block_classes(module: torch.nn.Module) -> set[str]:
    """Class names of the transformer blocks (``_no_split_modules``), looking through PEFT wrappers."""
    for candidate in module.modules():
        names = getattr(candidate, "_no_split_modules", None)
        if names:
            return set(names)
    return set()


def mixed_precision(device: torch.device, param_dtype: str, reduce_dtype: str):
    """FSDP2 mixed precision: gathered parameters in ``param_dtype`` and gradients reduced in
    ``reduce_dtype`` on GPU; on CPU everything stays in the stored dtype (bf16 matmuls are slow there)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from rlhf_core.models.loading import DTYPES

    if device.type != "cuda":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])


def fsdp_wrap(module: torch.nn.Module, device: torch.device, fsdp_config) -> torch.nn.Module:
    """Shard ``module`` in place with ``fully_shard`` (blocks, then root) over all ranks; returns it.

    ``fsdp_config`` is a :class:`rlhf_core.config.FSDPConfig`: ``param_offload`` keeps the shards on
    the CPU between uses (GPU runs), ``reshard_after_forward`` frees gathered blocks after each
    forward, ``param_dtype`` / ``reduce_dtype`` set the GPU mixed precision.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size(),))
    offload = CPUOffloadPolicy(pin_memory=True) if fsdp_config.param_offload and device.type == "cuda" \
        else OffloadPolicy()
    kwargs = {"mesh": mesh, "reshard_after_forward": fsdp_config.reshard_after_forward,
              "mp_policy": mixed_precision(device, fsdp_config.param_dtype, fsdp_config.reduce_dtype),
              "offload_policy": offload}
    blocks = block_classes(module)
    wrapped = [sub for sub in module.modules() if type(sub).__name__ in blocks]
    if not wrapped:
        raise ValueError(f"cannot find the transformer blocks of {type(module).__name__} to shard "
                         "(it lists no _no_split_modules)")
    for block in wrapped:
        fully_shard(block, **kwargs)
    fully_shard(module, **kwargs)
    # token-classification heads return their logits as a view; nothing here edits outputs in place
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)  # sum, not average: losses carry the global normalisation
            sub.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    return module


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` (or, under a PEFT wrapper, the model inside it) is sharded with FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(sub, FSDPModule) for sub in module.modules())


@contextmanager
def gathered(module: torch.nn.Module, reshard_after: bool):
    """Inside, a sharded ``module`` holds its full parameters: gathered once on entry instead of block
    by block at every forward (a decode loop runs one forward per token). On exit the parameters are
    sharded again and ``reshard_after_forward`` goes back to ``reshard_after``."""
    from torch.distributed.fsdp import FSDPModule

    roots = [sub for sub in module.modules() if isinstance(sub, FSDPModule)][:1]
    if not roots:
        yield
        return
    root = roots[0]
    root.set_reshard_after_forward(False)
    for sub in root.modules():
        if isinstance(sub, FSDPModule):
            sub.unshard()
    try:
        yield
    finally:
        for sub in root.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()
        root.set_reshard_after_forward(reshard_after)
        root.set_reshard_after_forward(False, recurse=False)  # FSDP2's own choice for the root


def grad_norm_value(norm: torch.Tensor) -> float:
    """The float of ``clip_grad_norm_``'s result; with FSDP2 it is a replicated DTensor of the total norm."""
    from torch.distributed.tensor import DTensor

    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def full_state_dict(module: torch.nn.Module, only_trainable: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded state dict on CPU: on rank 0 only when sharded (other ranks get {}), else everywhere. With
    ``only_trainable``, the tensors of parameters that train (LoRA adapters) alone: the frozen ones are not
    gathered."""
    if not is_sharded(module):
        state = lora.trainable_state_dict(module) if only_trainable else module.state_dict()
        return {name: tensor.detach().cpu() for name, tensor in state.items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                 ignore_frozen_params=only_trainable))


def iter_full_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) one at a time on every rank, gathering each shard as it goes: peak memory is
    one unsharded tensor, not the model. Every rank must iterate to the end (each step is a collective)."""
    from torch.distributed.tensor import DTensor

    device = _device()
    for name, tensor in module.state_dict().items():
        if isinstance(tensor, DTensor):
            if tensor.device != device:  # shards offloaded to the CPU: NCCL gathers on the GPU
                tensor = tensor.to(device)
            tensor = tensor.full_tensor()
        yield name, tensor.detach()


# ----------------------------------------------------------------------------- sharded checkpoints


def _state_options(only_trainable: bool):
    """Only the trainable tensors (LoRA adapters): the frozen base weights come from the model path."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=only_trainable, strict=not only_trainable)


def _only_trainable(module: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a model state dict) without the tensors of frozen parameters under any of their names.

    ``ignore_frozen_params`` drops a frozen parameter by the first name it has only (torch's state_dict helpers
    walk ``named_parameters()``, which lists a shared parameter once): a tied embedding's second name
    (``lm_head.weight``) stayed, and a LoRA checkpoint of a worker group held the whole frozen matrix, which one
    worker's (:func:`rlhf_core.models.lora.trainable_state_dict`) does not."""
    trainable = {name for name, param in module.named_parameters(remove_duplicate=False) if param.requires_grad}
    return {name: value for name, value in state.items() if name in trainable}


def save_sharded(folder: str | os.PathLike, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 only_trainable: bool = False) -> None:
    """Every rank writes its shards of the model and optimizer state into ``folder`` (torch DCP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(module, optimizer, options=_state_options(only_trainable))
    if only_trainable:
        model_state = _only_trainable(module, model_state)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder))


def load_sharded(folder: str | os.PathLike, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 only_trainable: bool = False) -> None:
    """Read what :func:`save_sharded` wrote (any world size) into ``module`` (and ``optimizer``). With
    ``only_trainable`` only the trainable tensors are read: a frozen one that an older checkpoint holds (a tied
    ``lm_head.weight``) is left where it is."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    options = _state_options(only_trainable)
    model_state, optim_state = get_state_dict(module, optimizer or [], options=options)
    if only_trainable:
        model_state = _only_trainable(module, model_state)
    state = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optim_state
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(module, optimizer or [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}), options=options)
