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

For generation, :func:`packed_weights` also holds each routed weight in oneDNN's blocked layout for the
batch's row count while the rollout runs (one copy of the weights, made per rollout since the update
changes them): each decode step then reads weights laid out as its kernel wants them.

``auto``, the default, decides by the CPU. Where torch finds AVX-512, every product goes to oneDNN (above).
On an AVX2-only CPU (a 2-core AMD EPYC of the Zen 3 family, ``bench/RESULTS.md``), MKL's own AVX2 kernels
are the fast ones: the same model's forward and backward took 1.24-1.36x the time on oneDNN, partly because
oneDNN's linear op copies a transposed operand to make it contiguous, which ``torch.mm`` need not do. There
the products with gradients stay on BLAS, and only the rollout's decode steps run on packed oneDNN weights
(0.55-0.69x BLAS's time for a decode step's products at 16 rows on that CPU). ``onednn`` and ``blas`` force one
kernel everywhere (``blas``: no packed weights either).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from rlhf_core.config import CPU_MATMULS as CHOICES

KERNELS = ("onednn", "blas")  # what ``auto`` resolves to for the products with gradients


def avx512() -> bool:
    """Whether torch's CPU kernels found AVX-512 on this machine."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def resolve(kind: str) -> str:
    """The kernel the routed layers' products with gradients run on for the choice ``kind``."""
    if kind == "auto":
        return "onednn" if avx512() else "blas"
    return kind


_kind = "auto"
_training = resolve(_kind)


def configure(kind: str) -> None:
    """``auto`` (by the CPU, see the module docstring), ``onednn`` (the routed layers call oneDNN where it
    applies) or ``blas`` (every layer calls ``F.linear``, and the rollout packs no weights)."""
    global _kind, _training
    if kind not in CHOICES:
        raise ValueError(f"trainer.cpu_matmul must be one of {', '.join(CHOICES)}, got {kind!r}")
    _kind, _training = kind, resolve(kind)


def current() -> str:
    """The choice as configured (``auto`` included)."""
    return _kind


def training_kernel() -> str:
    """What the products with gradients run on: ``onednn`` or ``blas``."""
    return _training


def available() -> bool:
    """Whether this torch build has oneDNN and its linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


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


def _onednn_weight(weight: torch.Tensor) -> bool:
    """Whether oneDNN takes ``weight``: a plain (not sharded) float32 CPU tensor."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and type(weight.data) is torch.Tensor


def _onednn_input(input: torch.Tensor) -> bool:
    return (input.device.type == "cpu" and input.dtype == torch.float32 and input.numel() > 0
            and not torch.compiler.is_compiling())


class RoutedLinear(torch.nn.Linear):
    """``nn.Linear`` whose CPU float32 products run on oneDNN (see the module docstring)."""

    packed_weight: torch.Tensor | None = None  # the weight in oneDNN's layout, inside packed_weights() only

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _onednn_input(input):
            if self.packed_weight is not None and not torch.is_grad_enabled():
                flat = input.reshape(-1, input.shape[-1])
                return onednn_linear(flat, self.packed_weight, self.bias).view(*input.shape[:-1], self.out_features)
            if _training == "onednn" and _onednn_weight(self.weight):
                return _OneDNNLinear.apply(input, self.weight, self.bias)
        return F.linear(input, self.weight, self.bias)


@contextlib.contextmanager
def packed_weights(model: torch.nn.Module, rows: int) -> Iterator[None]:
    """While inside, the routed layers of ``model`` run their products without gradients on a copy of their
    weights reordered by oneDNN for ``rows`` rows (a decode step's batch); the copies are dropped on exit."""
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    use = reorder is not None and _kind != "blas"
    layers = [m for m in model.modules() if type(m) is RoutedLinear and _onednn_weight(m.weight)] if use else []
    try:
        for layer in layers:
            layer.packed_weight = reorder(layer.weight.detach(), rows)
        yield
    finally:
        for layer in layers:
            layer.packed_weight = None


def route(model: torch.nn.Module) -> int:
    """Give every plain ``nn.Linear`` of ``model`` the routed forward (in place; a no-op without oneDNN).
    Returns how many layers were routed."""
    if not available():
        return 0
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    for layer in layers:
        layer.__class__ = RoutedLinear
    return len(layers)
