"""The linear layers' kernel on CPU (``trainer.cpu_matmul``): torch.mm's BLAS against oneDNN, and huge pages.

Four measurements, each kernel alternating with the other in one process (medians of ``--reps``):

1. the three products of one linear layer at the update's shape, (rows x hidden) @ (hidden x intermediate):
   forward, input gradient and weight gradient, in GFLOP/s, with each result's largest error against the
   same product in float64 (relative to the largest entry), so that speed is not bought with precision;
2. a decode step's products: every linear layer of the model once, and the fused step's stacked products
   (:mod:`rlhf_core.rollout.fused_decode`), at ``--decode-rows`` rows, by BLAS, by oneDNN, by oneDNN on
   weights reordered into its blocked layout (what the rollout does elsewhere), and by MKL's packed sgemm
   (what the rollout does on Intel CPUs under ``trainer.cpu_matmul=auto``);
3. the model's forward and backward over ``--batch`` x ``--seq`` tokens (LM head on the last 64 positions),
   every linear layer on one kernel, then on the other;
4. a fresh 200 MB tensor filled and added to, in a child process with and without
   ``THP_MEM_ALLOC_ENABLE`` (read by torch's allocator once, at its first allocation).

    python bench/cpu_matmul.py [--model outputs/smollm2-135m-instruct] [--reps 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F
from roofline import SMOLLM2, require_model_dir, run_times  # bench/roofline.py, beside this script

from rlhf_core.models import cpu_matmul
from rlhf_core.models.loading import load_actor
from rlhf_core.rollout import fused_decode

FRESH_TENSOR = """
import time, torch
torch.set_num_threads({threads})
times = []
for _ in range(10):
    start = time.perf_counter()
    x = torch.empty(50_000_000)
    x.fill_(1.0)
    y = x + 1
    del x, y
    times.append(time.perf_counter() - start)
print(sorted(times)[5])
"""


def median_seconds(fn, reps: int) -> float:
    return statistics.median(run_times(fn, reps))


def rel_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).abs().max() / exact.abs().max())


def layer_products(rows: int, hidden: int, intermediate: int, reps: int) -> None:
    torch.manual_seed(0)
    x, grad = torch.randn(rows, hidden), torch.randn(rows, intermediate)
    weight = torch.randn(intermediate, hidden) / hidden ** 0.5
    flop = 2 * rows * hidden * intermediate
    products = {  # name: (exact, BLAS, oneDNN)
        "forward": (x.double() @ weight.double().T, lambda: x @ weight.T,
                    lambda: cpu_matmul.onednn_linear(x, weight)),
        "input grad": (grad.double() @ weight.double(), lambda: grad @ weight,
                       lambda: cpu_matmul.onednn_linear(grad, weight.t())),
        "weight grad": (grad.double().T @ x.double(), lambda: grad.T @ x,
                        lambda: cpu_matmul.onednn_linear(grad.t(), x.t())),
    }
    print(f"\none linear layer, ({rows} x {hidden}) @ ({hidden} x {intermediate}), medians of {reps}:")
    print(f"{'product':<13}{'BLAS GFLOP/s':>13}{'oneDNN':>9}{'ratio':>7}{'BLAS err':>10}{'oneDNN err':>11}")
    for name, (exact, blas, onednn) in products.items():
        seconds = {}
        for kernel, fn in (("blas", blas), ("onednn", onednn)):
            seconds[kernel] = median_seconds(fn, reps)
        print(f"{name:<13}{flop / seconds['blas'] / 1e9:>13.1f}{flop / seconds['onednn'] / 1e9:>9.1f}"
              f"{seconds['blas'] / seconds['onednn']:>7.2f}{rel_error(blas(), exact):>10.1e}"
              f"{rel_error(onednn(), exact):>11.1e}")


def decode_weights(model: torch.nn.Module, fused: bool) -> list[torch.Tensor]:
    """The weights a decode step multiplies by: every linear layer's, or (``fused``) those of the rollout's fused
    step for llama-family models (q/k/v stacked, o, gate/up stacked, down per layer, then the LM head)."""
    if not fused:
        return [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = [torch.cat([linear.weight for linear in group]).detach()
               for layer in model.model.layers for group in fused_decode.layer_products(layer)]
    return weights + [model.lm_head.weight.detach()]


def decode_products(model: torch.nn.Module, rows: int, reps: int, fused: bool = False) -> None:
    weights = decode_weights(model, fused)
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    weight_bytes = sum(w.numel() for w in weights) * 4
    variants = {
        "BLAS (F.linear)": lambda: [F.linear(inputs[w.shape[1]], w) for w in weights],
        "oneDNN": lambda: [cpu_matmul.onednn_linear(inputs[w.shape[1]], w) for w in weights],
        "oneDNN, packed": lambda: [cpu_matmul.onednn_linear(inputs[w.shape[1]], p) for w, p in zip(weights, packed)],
    }
    if cpu_matmul.mkl_available():  # MKL's packed sgemm, what inductor uses for frozen float32 layers
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
        variants["MKL, packed"] = lambda: [torch.ops.mkl._mkl_linear(inputs[w.shape[1]], m, w, None, rows)
                                           for w, m in zip(weights, mkl)]
    times = {name: [] for name in variants}
    with torch.no_grad():
        for _ in range(reps):  # alternating, so that a change in the machine's speed hits each alike
            for name, fn in variants.items():
                times[name].append(median_seconds(fn, 2))
    print(f"\na decode step's products{' as the fused step has them' if fused else ''}: {len(weights)} products "
          f"({weight_bytes / 1e6:.0f} MB of weights) at {rows} rows, medians of {reps}:")
    base = statistics.median(times["BLAS (F.linear)"])
    for name, t in times.items():
        print(f"{name:<18}{statistics.median(t) * 1e3:>8.1f} ms{weight_bytes / statistics.median(t) / 1e9:>7.1f} GB/s"
              f"{statistics.median(t) / base:>7.2f}x BLAS")


def model_pass(model: torch.nn.Module, batch: int, seq: int, reps: int) -> None:
    ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))

    def forward_backward():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=64).logits
        logits.float().logsumexp(-1).mean().backward()

    times = {kernel: [] for kernel in cpu_matmul.KERNELS}
    before = cpu_matmul.current()
    for _ in range(reps):
        for kernel in cpu_matmul.KERNELS:
            cpu_matmul.configure(kernel)
            times[kernel].append(median_seconds(forward_backward, 1))
    cpu_matmul.configure(before)
    blas, onednn = statistics.median(times["blas"]), statistics.median(times["onednn"])
    print(f"\nforward + backward of {batch} x {seq} tokens, medians of {reps}: BLAS {blas:.2f} s, oneDNN "
          f"{onednn:.2f} s ({onednn / blas:.2f}x)")


def fresh_tensor(threads: int) -> None:
    seconds = {}
    for setting in ("0", "1"):
        env = {**os.environ, "THP_MEM_ALLOC_ENABLE": setting}
        out = subprocess.run([sys.executable, "-c", FRESH_TENSOR.format(threads=threads)], env=env,
                             capture_output=True, text=True, check=True)
        seconds[setting] = float(out.stdout)
    print(f"\na fresh 200 MB tensor filled and added to (median of 10): 4 KB pages {seconds['0'] * 1e3:.0f} ms, "
          f"THP_MEM_ALLOC_ENABLE=1 {seconds['1'] * 1e3:.0f} ms ({seconds['1'] / seconds['0']:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=3200, help="rows of the update-shaped product")
    parser.add_argument("--decode-rows", default="16", help="comma-separated row counts of the decode products")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=200)
    args = parser.parse_args()
    if not cpu_matmul.available():
        raise SystemExit("this torch build has no oneDNN linear op")
    torch.set_num_threads(args.threads)
    model = load_actor(require_model_dir(parser, args.model))
    config = model.config
    layer_products(args.rows, config.hidden_size, config.intermediate_size, args.reps)
    for rows in (int(r) for r in str(args.decode_rows).split(",")):
        decode_products(model, rows, args.reps)
        decode_products(model, rows, args.reps, fused=True)
    model_pass(model, args.batch, args.seq, max(1, args.reps // 2))
    fresh_tensor(args.threads)


if __name__ == "__main__":
    main()
