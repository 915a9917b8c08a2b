"""Where a forward and backward pass of the update spends its time on the CPU, part by part, unprofiled.

``torch.profiler`` on 2 cores slows the many short elementwise operations several-fold (see "Profiling" in
RESULTS.md), so this script times each kind of work of one transformer pass on its own, at the pass's shapes,
the parts alternating with the whole pass in one process (a change in the machine's speed hits each alike), each
call writing its gradients afresh as the pass does:

- ``whole``: the model's forward and backward over ``--rows`` rows of ``--positions`` tokens (``--padding`` of them
  left padding), the loss the mean log-probability of each next token, the linear layers routed as the trainer
  routes them (``trainer.cpu_matmul``);
- ``products``: one block's linear layers, forward and both gradients, times the number of blocks;
- ``lm head``: the LM head's product and the log-softmax over the vocabulary, forward and backward;
- ``attention``: ``scaled_dot_product_attention`` with the pass's causal, left-padded boolean mask (grouped
  key/value heads as the model has them), times the blocks;
- ``rms norms``: the model's own norm module, twice a block and once at the end;
- ``silu x up``: the MLP's activation and its product with the up projection, times the blocks;
- ``rotary``: transformers' rotation of the queries and keys, times the blocks;
- ``rest``: ``whole`` less the parts (residual adds, reshapes, the embedding, Python).

Beside them, the reference of ``roofline.py``: the faster kernel's fp32 rate of the largest product of a block at
the pass's tokens. The products' own rate (6 x body parameters x tokens over ``products``) over that reference says
how near the products come; the whole pass's rate over it is what ``roofline.py`` reports for an update.

    python bench/update_parts.py [--models random25m,smollm2] [--rows 8] [--positions 267] [--padding 20] [--reps 5]
                                 [--cpu-matmul auto]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rlhf_core.models import cpu_matmul
from rlhf_core.models.loading import load_actor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import available_models, matmul_gflops, matmul_params  # noqa: E402


def _timed(fn, leaves) -> float:
    """One call's seconds, its leaves' gradients set to None first: the whole pass writes each gradient afresh, and
    a call that added to the last call's gradient would time an addition the pass never makes."""
    for leaf in leaves:
        leaf.grad = None
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _grad_input(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


def allowed_keys(rows: int, positions: int, padding: int) -> torch.Tensor:
    """The boolean mask (rows, 1, positions, positions) of a pass over left-padded rows: each query sees the keys up
    to its own, none of the padding; a padding query sees itself alone (a row of no keys would be NaN)."""
    allowed = torch.ones(positions, positions, dtype=torch.bool).tril()[None, None].repeat(rows, 1, 1, 1)
    allowed[..., :padding] = False
    allowed[:, :, torch.arange(padding), torch.arange(padding)] = True
    return allowed


def parts(model: torch.nn.Module, rows: int, positions: int,
          padding: int) -> dict[str, tuple[callable, int, list[torch.Tensor]]]:
    """Each part's call (one forward and backward), how many times a pass makes it, and the leaves (inputs and
    weights) its backward writes gradients into; ``whole`` sets the model's gradients to None itself."""
    config = model.config
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or hidden // heads
    tokens = rows * positions
    block = model.model.layers[0]
    ids = torch.randint(3, config.vocab_size, (rows, positions))
    mask = torch.ones(rows, positions, dtype=torch.long)
    mask[:, :padding] = 0

    def whole():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        log_probs = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])
        (-log_probs.mean()).backward()

    linears = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {id(m): _grad_input(tokens, m.in_features) for m in linears}
    grads = {id(m): torch.randn(tokens, m.out_features) for m in linears}

    def products():
        for m in linears:
            m(inputs[id(m)]).backward(grads[id(m)])

    head, head_in = model.get_output_embeddings(), _grad_input(rows, positions, hidden)
    targets = ids[:, :, None]

    def lm_head():
        (-head(head_in).float().log_softmax(-1).gather(-1, targets).mean()).backward()

    q, k, v = _grad_input(rows, heads, positions, dim), _grad_input(rows, kv_heads, positions, dim), \
        _grad_input(rows, kv_heads, positions, dim)
    allowed = allowed_keys(rows, positions, padding)

    def attention():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=kv_heads != heads)
        out.backward(torch.ones_like(out))

    norm, norm_in = block.input_layernorm, _grad_input(rows, positions, hidden)

    def rms_norms():
        norm(norm_in).backward(torch.ones(rows, positions, hidden))

    gate, up = _grad_input(rows, positions, inter), _grad_input(rows, positions, inter)

    def silu_up():
        (F.silu(gate) * up).backward(torch.ones(rows, positions, inter))

    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    cos, sin = torch.randn(rows, positions, dim), torch.randn(rows, positions, dim)

    def rotary():
        rq, rk = apply_rotary_pos_emb(q, k, cos, sin)
        torch.autograd.backward([rq, rk], [torch.ones_like(rq), torch.ones_like(rk)])

    block_weights = [p for m in linears for p in m.parameters()]
    return {"whole": (whole, 1, []),
            "products": (products, layers, [*inputs.values(), *block_weights]),
            "lm head": (lm_head, 1, [head_in, *head.parameters()]),
            "attention": (attention, layers, [q, k, v]),
            "rms norms": (rms_norms, 2 * layers + 1, [norm_in, *norm.parameters()]),
            "silu x up": (silu_up, layers, [gate, up]),
            "rotary": (rotary, layers, [q, k])}


def run(name: str, path: Path, args) -> None:
    model = load_actor(path)
    cpu_matmul.route(model)
    model.train()
    config = model.config
    tokens = args.rows * args.positions
    calls = parts(model, args.rows, args.positions, args.padding)
    for fn, _, _ in calls.values():  # warm-up: allocations, the thread pool, oneDNN's primitives
        fn()
    samples = {part: [] for part in calls}
    for _ in range(args.reps):
        for part, (fn, count, leaves) in calls.items():
            samples[part].append(_timed(fn, leaves) * count)
    ms = {part: statistics.median(times) * 1e3 for part, times in samples.items()}
    reference = max(matmul_gflops(tokens, config.hidden_size, config.intermediate_size).values())
    body, head = matmul_params(model)
    real = args.rows * (args.positions - args.padding)  # the roofline counts the mask's tokens
    print(f"\n{name}: {args.rows} rows x {args.positions} positions ({args.padding} left padding), "
          f"{config.num_hidden_layers} blocks, cpu_matmul={cpu_matmul.current()}; medians of {args.reps}")
    print(f"{'part':<12}{'ms':>10}{'of whole':>10}")
    parts_ms = 0.0
    for part, value in ms.items():
        if part != "whole":
            parts_ms += value
        print(f"{part:<12}{value:>10.1f}{value / ms['whole']:>10.2f}")
    print(f"{'rest':<12}{ms['whole'] - parts_ms:>10.1f}{(ms['whole'] - parts_ms) / ms['whole']:>10.2f}")
    products_rate = 6 * body * tokens / (ms["products"] / 1e3) / 1e9
    whole_rate = 6 * (body + head) * real / (ms["whole"] / 1e3) / 1e9
    print(f"reference (roofline's matmul rate at {tokens} tokens): {reference:.1f} GFLOP/s")
    print(f"products' own rate: {products_rate:.1f} GFLOP/s = {products_rate / reference:.2f} of the reference")
    print(f"whole pass (6 x matmul parameters x unpadded tokens): {whole_rate:.1f} GFLOP/s = "
          f"{whole_rate / reference:.2f} of the reference")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="random25m,smollm2")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--positions", type=int, default=267)
    parser.add_argument("--padding", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-matmul", default="auto", help="trainer.cpu_matmul: auto | onednn | blas")
    args = parser.parse_args()
    if not 0 <= args.padding < args.positions:
        parser.error("--padding must be at least 0 and below --positions")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cpu_matmul.configure(args.cpu_matmul)
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in available_models(args.models, Path(tmp)):
            run(name, path, args)


if __name__ == "__main__":
    main()
