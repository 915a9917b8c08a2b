"""The LM head's log-prob pass, forward and backward: four ways through the (positions x vocab) logits.

For each vocabulary, ``positions`` response tokens with hidden size ``hidden`` go through the head,
log-softmax at the labels (and the entropy, as a metric without gradient, as the actor's update
measures it), and back to the hidden states and the head's weight:

- ``whole``: ``linear``, then :func:`rlhf_core.algos.logprobs_from_logits` and
  :func:`rlhf_core.algos.entropy_from_logits` on the whole logits (what the actor did before);
- ``logits``: ``linear``, then :func:`rlhf_core.models.fused_head.logits_log_prob`, the softmax work
  a few positions at a time, the gradient in a tensor of its own;
- ``overwrite``: the same, the gradient written over the logits (``overwrite=True``: what the actor does
  for a plain linear head);
- ``chunked``: :func:`rlhf_core.models.fused_head.chunked_head_log_prob`, the head itself in chunks,
  recomputed in the backward pass (``use_fused_kernels``).

Each variant runs in a fresh process; memory is the peak RSS above the RSS once the inputs exist.

    python bench/fused_head.py [--shapes smollm2,qwen05b] [--positions 1024] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

SHAPES = {"smollm2": (576, 49152), "qwen05b": (896, 151936)}  # (hidden, vocabulary)


def rss_gb() -> float:
    """The process's resident memory now (``VmRSS``), in GB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1e6
    raise RuntimeError("no VmRSS in /proc/self/status")


def one(variant: str, hidden: int, vocab: int, positions: int, reps: int, threads: int) -> dict:
    from rlhf_core import algos
    from rlhf_core.models.fused_head import chunked_head_log_prob, logits_log_prob

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(positions, hidden, generator=g) * 0.5
    w0 = torch.randn(vocab, hidden, generator=g) * 0.05
    labels = torch.randint(0, vocab, (positions,), generator=g)
    upstream = torch.linspace(-1, 1, positions)
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    base = rss_gb()

    def step() -> None:
        h.grad = w.grad = None
        if variant == "whole":
            logits = torch.nn.functional.linear(h, w)[None].float()
            log_prob = algos.logprobs_from_logits(logits, labels[None])[0]
            with torch.no_grad():
                algos.entropy_from_logits(logits)
        elif variant in ("logits", "overwrite"):
            log_prob, _ = logits_log_prob(torch.nn.functional.linear(h, w), labels, with_entropy=True,
                                          overwrite=variant == "overwrite")
        else:
            log_prob, _ = chunked_head_log_prob(h, w, labels, with_entropy=True)
        (log_prob * upstream).sum().backward()

    step()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    return {"seconds": min(times), "extra_gb": peak - base}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="smollm2,qwen05b")
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # variant:shape, in a child process
    args = parser.parse_args()
    if args.one:
        variant, shape = args.one.split(":")
        print(json.dumps(one(variant, *SHAPES[shape], args.positions, args.reps, args.threads)))
        return
    variants = ("whole", "logits", "overwrite", "chunked")
    rows = []
    for shape in args.shapes.split(","):
        result = {}
        for variant in variants:
            out = subprocess.run([sys.executable, __file__, "--one", f"{variant}:{shape}", "--positions",
                                  str(args.positions), "--reps", str(args.reps), "--threads", str(args.threads)],
                                 check=True, capture_output=True, text=True).stdout
            result[variant] = json.loads(out.strip().splitlines()[-1])
        hidden, vocab = SHAPES[shape]
        whole = result["whole"]["seconds"]
        rows.append(f"{shape:<9}{hidden:>7}{vocab:>8}" + "".join(
            f"{result[v]['seconds']:>9.2f}{result[v]['seconds'] / whole:>7.2f}{result[v]['extra_gb']:>7.2f}"
            for v in variants))
        print(rows[-1], flush=True)
    print(f"\n{'':<24}" + "".join(f"{v:^23}" for v in variants))
    print(f"{'shape':<9}{'hidden':>7}{'vocab':>8}" + f"{'s':>9}{'ratio':>7}{'GB':>7}" * len(variants))
    print("\n".join(rows))
    print(f"{args.positions} positions, forward and backward, best of {args.reps}, {args.threads} threads; "
          "ratio: time over whole's; GB: peak RSS above the inputs")

if __name__ == "__main__":
    main()
