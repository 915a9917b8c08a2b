"""The update's attention on the CPU, forward and backward, by torch's kernels and masks.

At the update's shapes (SmolLM2: 9 heads of 64 dimensions; 16 rows of 136 positions by default), one call of
``torch.nn.functional.scaled_dot_product_attention`` and the backward of its output's sum, timed as:

- ``flash, padding mask``: the boolean mask the trainer's rows carry (causal, each row's left padding masked), on
  the kernel torch picks on CPU (flash attention);
- ``flash, float mask``: the same mask as additive float32;
- ``flash, is_causal``: no mask, causal only: what rows with all their padding at the end could use;
- ``math``: the same masked call on torch's math backend;
- ``products``: the scores, the masked softmax and the weighted sum written out as tensor operations.

All run alternately in one process, medians printed, so that a change in the machine's speed hits each alike.

    python bench/attention.py [--rows 16] [--positions 136] [--heads 9] [--head-dim 64] [--padding 3] [--reps 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--positions", type=int, default=136)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--padding", type=int, default=3, help="left-padding positions of every row")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n, h, length, d = args.rows, args.heads, args.positions, args.head_dim
    q, k, v = (torch.randn(n, h, length, d, requires_grad=True) for _ in range(3))
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    allowed[args.padding:, :args.padding] = False  # real tokens never see the left padding
    mask = allowed[None, None].expand(n, 1, length, length).contiguous()
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))

    def products() -> torch.Tensor:
        scores = (q @ k.transpose(-1, -2)) * d ** -0.5
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v

    def math() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    variants = {
        "flash, padding mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "flash, float mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=additive),
        "flash, is_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "math": math,
        "products": products,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(args.reps + 1):
        for name, forward in variants.items():
            start = time.perf_counter()
            forward().sum().backward()
            if rep:  # the first round warms each kernel up
                times[name].append(time.perf_counter() - start)
            q.grad = k.grad = v.grad = None  # each call writes fresh gradients, not adds to the last call's
    # over the whole L x L grid: 2 products forward (scores, weighted sum), 4 backward, 2 n h L^2 d FLOP each
    flop = 12 * n * h * length * length * d
    print(f"attention forward and backward, {n} rows x {h} heads x {length} positions x {d}, {args.threads} threads, "
          f"medians of {args.reps}:")
    base = statistics.median(times["flash, padding mask"])
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"  {name:<20} {median * 1e3:8.2f} ms  {median / base:5.2f}x  {flop / median / 1e9:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
