"""Does ``torch.compile`` shorten the update's forward and backward on this machine?

``--blocks layers``: each decoder layer of the model is compiled (``module.compile()``, inductor; C++
on CPU, static shapes). ``--blocks mlp-norms``: what ``actor_rollout_ref.actor.use_torch_compile``
compiles (``compile_blocks``: each MLP and RMS norm, dynamic shapes). A forward and backward of random
tokens through the model's body is then timed compiled and eager, alternating in one process (this
machine's timings drift between processes). Prints the compile time and, per round, the best of
``--reps`` passes each way.

    python bench/compile.py [--model outputs/smollm2-135m-instruct] [--blocks layers|mlp-norms] [--rows 16]
                            [--tokens 135] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import torch
from roofline import SMOLLM2, require_model_dir  # bench/roofline.py, beside this script

from rlhf_core.models.loading import compile_blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=135, help="tokens per row (SmolLM2's update: 71 + 64)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--blocks", choices=("layers", "mlp-norms"), default="layers")
    args = parser.parse_args()
    model = require_model_dir(parser, args.model)
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    module = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ids = torch.randint(0, module.config.vocab_size, (args.rows, args.tokens))
    mask = torch.ones_like(ids)

    def step() -> None:
        hidden = module.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        hidden.float().pow(2).mean().backward()
        module.zero_grad(set_to_none=True)

    def best() -> float:
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return min(times)

    step()  # warm-up, eager
    start = time.perf_counter()
    if args.blocks == "layers":
        layers = list(module.model.layers)
        for layer in layers:
            layer.compile(dynamic=False)
    else:
        layers = compile_blocks(module)
    step()
    print(f"compile and first compiled pass: {time.perf_counter() - start:.1f} s", flush=True)
    compiled = [layer._compiled_call_impl for layer in layers]
    wins = 0
    for round_ in range(args.rounds):
        for layer in layers:
            layer._compiled_call_impl = None  # nn.Module's own switch between the two
        eager_s = best()
        for layer, fn in zip(layers, compiled):
            layer._compiled_call_impl = fn
        compiled_s = best()
        wins += compiled_s < eager_s
        print(f"round {round_ + 1}: eager {eager_s:.2f} s, compiled {compiled_s:.2f} s, "
              f"compiled/eager {compiled_s / eager_s:.2f}", flush=True)
    print(f"compiled faster in {wins} of {args.rounds} rounds")


if __name__ == "__main__":
    main()
