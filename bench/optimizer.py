"""The AdamW step the workers take: torch's per-parameter loop against its fused kernel, on a model's shapes.

The fused one is the workers' own (``build_optimizer``), the plain one torch's default. Both step tensors of the model's parameter shapes with random gradients, alternating in
one process (this machine's timings drift between processes); prints the median seconds per step
and the ratio.

    python bench/optimizer.py [--model outputs/smollm2-135m-instruct] [--steps 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from roofline import SMOLLM2, require_model_dir  # bench/roofline.py, beside this script

from rlhf_core.config import OptimConfig
from rlhf_core.workers.common import build_optimizer


def parameter_shapes(model: Path) -> list[torch.Size]:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    return [p.shape for p in module.parameters()]


def seconds_per_step(shapes, fused: bool, steps: int) -> float:
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    optim = OptimConfig(lr=1e-4, weight_decay=0.01)
    optimizer = (build_optimizer(params, optim) if fused else  # the workers' own
                 torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay))
    assert bool(optimizer.defaults["fused"]) == fused
    optimizer.step()  # creates the moments
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = require_model_dir(parser, args.model)
    torch.set_num_threads(args.threads)
    shapes = parameter_shapes(model)
    count = sum(torch.Size(s).numel() for s in shapes)
    times = {"plain": [], "fused": []}
    for kind in times:  # a round not counted: the process's first steps pay its one-off costs (allocation, threads)
        seconds_per_step(shapes, kind == "fused", 1)
    for _ in range(args.rounds):
        for kind in times:
            times[kind].append(seconds_per_step(shapes, kind == "fused", args.steps))
    plain, fused = statistics.median(times["plain"]), statistics.median(times["fused"])
    print(f"{model.name}: {count / 1e6:.1f}M parameters in {len(shapes)} tensors, {args.threads} threads")
    for kind, values in times.items():
        print(f"{kind:<6} AdamW step: median {statistics.median(values):.3f} s  (rounds: "
              + ", ".join(f"{v:.3f}" for v in values) + ")")
    print(f"fused/plain: {fused / plain:.2f}")


if __name__ == "__main__":
    main()
