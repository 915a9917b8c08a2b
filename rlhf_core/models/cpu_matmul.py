"""fp32 linear layers on CPU through oneDNN rather than the BLAS behind ``torch.mm`` (``trainer.cpu_matmul``).

torch's CPU build runs ``F.linear`` and ``torch.mm`` on MKL's sgemm. oneDNN, which ships in the same
build (inductor calls it for frozen linear layers), has its own just-in-time kernels for the CPU it
finds. On the 2-core AMD EPYC (AVX-512) these benchmarks ran on, oneDNN took about half MKL's time for
every matmul of a linear layer, forward, input gradient and weight gradient alike, and 0.6x at a decode
step's 16 rows (``bench/roofline.py``, ``bench/RESULTS.md``), in true fp32: its error against float64 is
of MKL's order (1e-6 relative), not bf16's.

:func:`route` gives a model's ``nn.Linear`` layers a forward that calls oneDNN's linear op where it
applies (a CPU float32 input and weight, not sharded, not being compiled) and ``F.linear`` elsewhere;
the layers stay ``nn.Linear`` with the same parameters and state dict. Their backward is written here
as two more oneDNN products: ``grad_input = grad_out @ W`` and ``grad_W = grad_out^T @ input``.
Which kernel runs is one choice for the process (:func:`configure`), as torch's own backend flags are.

For generation, :func:`packed_weights` also holds each routed weight in a packed layout for the batch's
row count while the rollout runs (one copy of the weights, made per rollout since the update changes them):
each decode step then reads weights laid out as its kernel wants them. Under ``auto`` on an Intel CPU the
float32 ones are packed for MKL's sgemm (:class:`MKLPacked`), which took 0.86-0.97x the time of oneDNN's
packed products for a whole decode step on the Intel Xeon with AMX (the demo, random 25M and SmolLM2 models
at 16 and 64 rows); elsewhere, and for bfloat16 products, they are in oneDNN's blocked layout. MKL reserves
about 3x a weight's bytes for its copy and writes a third: with glibc's heap kept, a process that only
generates settles at about 2.2x the weights' bytes more resident memory than with oneDNN's copies, while in
the trainer, whose update reuses that heap, SmolLM2's resident memory rose 1.3%.

``auto``, the default, decides by the CPU. What matters is which kernels MKL picks: on Intel CPUs it runs
its AVX-512 code, on AMD CPUs its AVX2 code even where the CPU has AVX-512. So on an AMD CPU with AVX-512
every product goes to oneDNN (above). Elsewhere MKL's kernels are the fast ones for the update: on an
AVX2-only AMD EPYC (Zen 3) the model's forward and backward took 1.24-1.36x the time on oneDNN, and on an
Intel Xeon with AVX-512 1.24-1.38x, partly because oneDNN's linear op copies a transposed operand to make it
contiguous for the weight gradient, which ``torch.mm`` need not do (``bench/RESULTS.md``). There the products
with gradients stay on BLAS, and only the rollout's decode steps run on packed oneDNN weights (0.55-0.69x
BLAS's time for a decode step's products at 16 rows on the Zen 3, 0.8x on the Xeon). ``onednn`` and ``blas``
force one kernel everywhere (``blas``: no packed weights either).

``trainer.cpu_matmul_dtype=bfloat16`` (:func:`configure`'s ``dtype``) runs the products of the linear layers
inside the transformer blocks in bfloat16: each call casts its input and weight, multiplies (float32
accumulation inside the kernel) and hands back float32, the bias added in float32; the cast weight is kept
until the weight changes (one more copy of the blocks' weights, at 2 bytes a parameter); the backward's two
products likewise, so gradients, weights, optimizer state, norms, attention, the LM and value heads and the
losses all stay float32, as in GPU mixed precision. The rollout packs the blocks' weights in bfloat16 too
(in oneDNN's layout where the CPU has AVX-NE-CONVERT or AVX-512 BW/VL/DQ, which oneDNN needs for it; as plain
bfloat16 tensors elsewhere). On a
CPU with AMX (Intel Xeon, Sapphire Rapids and later) a bfloat16 product ran at 2.4-2.9 TFLOP/s on 2 cores
against 0.3 for float32, and SmolLM2's PPO step took 0.61-0.66x the time (``bench/RESULTS.md``); without AMX or
AVX512-BF16 the products are emulated, and the trainer says so.

oneDNN keeps the kernel it builds for each new shape twice over, in its own primitive cache and in ideep's
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` and ``LRU_CACHE_CAPACITY``, 1024 entries each by default), and frees it
only when both have let it go. Prompt and response widths vary from batch to batch, so a run meets new shapes
for a while: the memory in use climbs over the first hundred or so steps, then levels off. The demo's PPO (8
prompts x 2 responses a step, on the AMD EPYC above) held 184 MB more after 150 steps than after 10, 2.9 MB a
step at first and 0.24 by the end, where ``blas`` held 9 MB more; both variables set to 8 before the process
starts kept it at 0.2 MB a step (one of them alone did not); 64 did too, 256 did not. What the caps cost in speed
(kernels built again), with the machine to itself: 64 no cost a run could see (0.98x the uncapped step), 8 about
10% (1.10x; ``bench/onednn_cache.py``).
"""

from __future__ import annotations

import contextlib
import functools
import platform
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from rlhf_core.config import CPU_MATMUL_DTYPES as DTYPE_CHOICES
from rlhf_core.config import CPU_MATMULS as CHOICES
from rlhf_core.workers.distributed import block_classes

KERNELS = ("onednn", "blas")  # what ``auto`` resolves to for the products with gradients


def avx512() -> bool:
    """Whether torch's CPU kernels found AVX-512 on this machine."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


@functools.cache
def _cpuinfo(field: str) -> str:
    """The first ``field`` line's value in ``/proc/cpuinfo``, or ``""`` where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``, ...), or ``""`` where it cannot be read."""
    text = _cpuinfo("vendor_id") or platform.processor()  # e.g. "AMD64 Family 25 ..., AuthenticAMD" on Windows
    return next((name for name in ("AuthenticAMD", "GenuineIntel") if name in text), text)


def native_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AMX or AVX512-BF16), as far as Linux tells."""
    return bool({"amx_bf16", "avx512_bf16"} & set(_cpuinfo("flags").split()))


def onednn_packs_bfloat16() -> bool:
    """Whether oneDNN can lay out bfloat16 weights for its linear op on this CPU: it needs AVX-NE-CONVERT or
    AVX-512 with its BW, VL and DQ parts (torch's check for ``_reorder_linear_weight``); without them the
    rollout's bfloat16 decode weights stay plain tensors."""
    flags = set(_cpuinfo("flags").split())
    return "avx_ne_convert" in flags or {"avx512bw", "avx512vl", "avx512dq"} <= flags


def resolve(kind: str) -> str:
    """The kernel the routed layers' products with gradients run on for the choice ``kind``: for ``auto``,
    oneDNN on an AMD CPU with AVX-512 (where MKL keeps to its AVX2 kernels), BLAS elsewhere."""
    if kind == "auto":
        return "onednn" if avx512() and cpu_vendor() == "AuthenticAMD" else "blas"
    return kind


_kind = "auto"
_training = resolve(_kind)
_dtype = torch.float32  # what the transformer blocks' products run in (trainer.cpu_matmul_dtype)
_optimizer_steps = 0  # every optimizer's steps in this process: fused AdamW changes weights without a version bump


def _count_step(*_) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_step)


def configure(kind: str, dtype: str = "float32") -> None:
    """``auto`` (by the CPU, see the module docstring), ``onednn`` (the routed layers call oneDNN where it
    applies) or ``blas`` (every layer calls ``F.linear``, and the rollout packs no weights); ``dtype``: the
    products of the linear layers inside the transformer blocks in ``float32`` or ``bfloat16``."""
    global _kind, _training, _dtype
    if kind not in CHOICES:
        raise ValueError(f"trainer.cpu_matmul must be one of {', '.join(CHOICES)}, got {kind!r}")
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"trainer.cpu_matmul_dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    _kind, _training, _dtype = kind, resolve(kind), getattr(torch, dtype)


def current() -> str:
    """The choice as configured (``auto`` included)."""
    return _kind


def product_dtype() -> torch.dtype:
    """What the routed layers inside the transformer blocks multiply in."""
    return _dtype


def training_kernel() -> str:
    """What the products with gradients run on: ``onednn`` or ``blas``."""
    return _training


def available() -> bool:
    """Whether this torch build has oneDNN and its linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def mkl_available() -> bool:
    """Whether this torch build has MKL's packed sgemm ops (the reorder and the product)."""
    return (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))


def onednn_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``input @ weight.T (+ bias)`` for 2-D float32 CPU tensors, by oneDNN (any strides)."""
    return torch.ops.mkldnn._linear_pointwise(input, weight, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = input.reshape(-1, input.shape[-1])  # (tokens, in)
        ctx.save_for_backward(flat, weight)
        ctx.input_shape, ctx.has_bias = input.shape, bias is not None
        return onednn_linear(flat, weight, bias).view(*input.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        flat, weight = ctx.saved_tensors
        grad = grad_out.reshape(-1, grad_out.shape[-1])  # (tokens, out)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = onednn_linear(grad, weight.t()).view(ctx.input_shape)  # grad @ W: (tokens, in)
        if ctx.needs_input_grad[1]:
            grad_weight = onednn_linear(grad.t(), flat.t())  # grad^T @ input: (out, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_input, grad_weight, grad_bias


class _LowPrecisionLinear(torch.autograd.Function):
    """``input @ weight.T (+ bias)`` with the three products in ``low_weight``'s dtype (bfloat16, a copy of
    ``weight``): float32 in and out, the bias added in float32; the gradients are float32 as the parameters are."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                low_weight: torch.Tensor) -> torch.Tensor:
        flat = input.reshape(-1, input.shape[-1]).to(low_weight.dtype)  # (tokens, in)
        ctx.save_for_backward(flat, low_weight)
        ctx.input_shape = input.shape
        out = F.linear(flat, low_weight).to(input.dtype)
        if bias is not None:
            out += bias
        return out.view(*input.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        flat, low_weight = ctx.saved_tensors
        grad = grad_out.reshape(-1, grad_out.shape[-1])  # (tokens, out)
        low_grad = grad.to(flat.dtype)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = torch.mm(low_grad, low_weight).to(grad_out.dtype).view(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            grad_weight = torch.mm(low_grad.t(), flat).to(grad_out.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_input, grad_weight, grad_bias, None


def plain_cpu_float32(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a plain (not sharded) float32 CPU tensor: what oneDNN takes."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and type(weight.data) is torch.Tensor


def _onednn_input(input: torch.Tensor) -> bool:
    return (input.device.type == "cpu" and input.dtype == torch.float32 and input.numel() > 0
            and not torch.compiler.is_compiling())


class RoutedLinear(torch.nn.Linear):
    """``nn.Linear`` whose CPU float32 products run on oneDNN (see the module docstring)."""

    packed_weight: torch.Tensor | None = None  # the weight in oneDNN's layout, inside packed_weights() only
    in_block = False  # inside a transformer block: multiplies in product_dtype() (not the heads)
    _low: tuple[tuple, torch.Tensor] | None = None  # (the weight's identity and version, its low-precision copy)

    def _low_weight(self) -> torch.Tensor:
        """The weight in ``product_dtype()``, cast again only after the weight may have changed (any optimizer's
        step, or an in-place write such as a load, which bumps its version): the micro-batches of an update, and
        the passes without gradients between two steps, share one cast."""
        weight = self.weight
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # sharded, FSDP2 gathers the weight into a buffer of its own before each forward, and a load writes
            # the shards, not that buffer: nothing stable to key a kept copy on, so cast at each call
            return weight.detach().to(_dtype)
        key = (weight.data_ptr(), weight._version, weight.shape, _dtype, _optimizer_steps)
        if self._low is None or self._low[0] != key:
            self._low = (key, weight.detach().to(_dtype))
        return self._low[1]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _onednn_input(input):
            if self.packed_weight is not None and not torch.is_grad_enabled():
                out = decode_product(input.reshape(-1, input.shape[-1]), self.packed_weight, self.bias)
                return out.view(*input.shape[:-1], self.out_features)
            if plain_cpu_float32(self.weight):
                if self.in_block and _dtype != torch.float32:
                    return _LowPrecisionLinear.apply(input, self.weight, self.bias, self._low_weight())
                if _training == "onednn":
                    return _OneDNNLinear.apply(input, self.weight, self.bias)
        return F.linear(input, self.weight, self.bias)


def packs() -> bool:
    """Whether decode steps read weights reordered by oneDNN (:func:`decode_weight`): a build with the reorder
    op, and a kernel choice other than ``blas``."""
    return available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and _kind != "blas"


def mkl_packs() -> bool:
    """Whether the decode steps' float32 products run on MKL's packed sgemm (:func:`decode_weight`): ``auto``
    on an Intel CPU, where MKL runs its own best code, with a build that has the op (inductor's for frozen
    float32 linear layers). On AMD CPUs MKL keeps to its AVX2 code, and oneDNN's packed layout stays."""
    return _kind == "auto" and cpu_vendor() == "GenuineIntel" and mkl_available()


class MKLPacked(NamedTuple):
    """A float32 weight (out, in) in MKL's packed layout for products of ``rows`` rows. MKL multiplies other
    row counts by ``original``, the weight itself where it outlives the copy (a layer's parameter); without it
    (a stack of several layers' weights, made for the copy) only ``rows`` rows may multiply."""

    packed: torch.Tensor
    rows: int
    shape: torch.Size
    original: torch.Tensor | None

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def __call__(self, input: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        original = self.original
        if original is None:
            if input.shape[0] != self.rows:
                raise ValueError(f"this weight was packed for products of {self.rows} rows, not {input.shape[0]}")
            original = _NOTHING.expand(self.shape)  # read only at another row count
        return torch.ops.mkl._mkl_linear(input, self.packed, original, bias, self.rows)


_NOTHING = torch.zeros(())


def decode_weight(weight: torch.Tensor, rows: int, in_block: bool, persistent: bool = False
                  ) -> torch.Tensor | MKLPacked:
    """A copy of ``weight`` for products without gradients at ``rows`` rows, for :func:`decode_product`: in
    ``product_dtype()`` inside the transformer blocks (``in_block``), float32 outside. A plain CPU float32
    ``weight`` is laid out for that row count: by MKL where :func:`mkl_packs` and the product is float32, else
    by oneDNN (an mkldnn tensor) where :func:`packs` (and, for bfloat16, :func:`onednn_packs_bfloat16`);
    otherwise the copy is a plain contiguous tensor.
    ``persistent``: ``weight`` outlives the copy (a layer's own parameter), so other row counts may multiply it."""
    dtype = _dtype if in_block else torch.float32
    if plain_cpu_float32(weight) and dtype == torch.float32 and mkl_packs():
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach().contiguous(), rows)
        return MKLPacked(packed, rows, weight.shape, weight.detach() if persistent else None)
    low = weight.detach().to(dtype)
    if packs() and plain_cpu_float32(weight) and (dtype == torch.float32 or onednn_packs_bfloat16()):
        return torch.ops.mkldnn._reorder_linear_weight(low, rows)
    return low.contiguous()


def decode_product(input: torch.Tensor, weight: torch.Tensor | MKLPacked, bias: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """``input @ weight.T (+ bias)`` for a 2-D ``input`` and a weight from :func:`decode_weight`: by MKL on an
    :class:`MKLPacked` weight, oneDNN on a reordered one, ``F.linear`` on a plain one; a bfloat16 weight
    multiplies a bfloat16 copy of the input, and the output is the input's dtype with the bias added in it."""
    if isinstance(weight, MKLPacked):
        return weight(input, bias)
    product = onednn_linear if weight.is_mkldnn else F.linear
    if weight.dtype == input.dtype:
        return product(input, weight, bias)
    out = product(input.to(weight.dtype), weight).to(input.dtype)
    if bias is not None:
        out += bias
    return out


@contextlib.contextmanager
def packed_weights(model: torch.nn.Module, rows: int) -> Iterator[None]:
    """While inside, the routed layers of ``model`` run their products without gradients on a copy of their
    weights packed for ``rows`` rows (a decode step's batch; :func:`decode_weight`), in ``product_dtype()``
    inside the transformer blocks; the copies are dropped on exit."""
    layers = ([m for m in model.modules() if type(m) is RoutedLinear and plain_cpu_float32(m.weight)]
              if packs() or mkl_packs() else [])
    try:
        for layer in layers:
            layer.packed_weight = decode_weight(layer.weight, rows, layer.in_block, persistent=True)
        yield
    finally:
        for layer in layers:
            layer.packed_weight = None


def route(model: torch.nn.Module) -> int:
    """Give every plain ``nn.Linear`` of ``model`` the routed forward (in place; a no-op without oneDNN),
    marking those inside its transformer blocks (``_no_split_modules``). Returns how many were routed."""
    if not available():
        return 0
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    blocks = block_classes(model)
    inside = {id(m) for block in model.modules() if type(block).__name__ in blocks for m in block.modules()}
    for layer in layers:
        layer.__class__ = RoutedLinear
        layer.in_block = id(layer) in inside
    return len(layers)
