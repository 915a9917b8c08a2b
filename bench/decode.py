"""The HF rollout's decode step, head to head with transformers' defaults, against the bandwidth bound.

Three variants of the same sampling loop, run alternately in one process so that a change in the
machine's speed hits both alike:

- ``dynamic``: transformers' ``DynamicCache`` (every step concatenates the whole cache),
  ``torch.multinomial`` (a random number per vocabulary entry) and the LM head over every prompt
  position in the prompt pass: what the rollout did before;
- ``layers``: the rollout as it is (a preallocated cache written in place, two-level inverse-CDF sampling,
  the LM head on the prompt's last position only) with the decode steps run by transformers' layers on
  packed weights, as for models the fused step does not take;
- ``ours``: the same with the fused decode step (:mod:`rlhf_core.rollout.fused_decode`) where the model
  allows it (llama and qwen2; the demo, random 25M and SmolLM2 models are llama);
- ``ours, oneDNN``: the fused step with every weight in oneDNN's packed layout, where ``ours`` packs the
  float32 ones for MKL's sgemm (``--cpu-matmul auto`` on an Intel CPU; elsewhere the two are the same).

The draws alone are timed too: multinomial, the one-level float64 CDF the rollout used before, and
the two-level one it uses now (:func:`rlhf_core.rollout.hf.draw_from`).

A decode step is timed as (time for R tokens - time for 1 token) / (R - 1), so that the prompt pass
is left out, with EOS switched off so that every row runs all R steps (the 1-token time the fastest of three
since 2026-12-05; a single sample could exceed the steps' share under load and make the figure negative). The bound is the one of
``bench/roofline.py``: the longer of reading every weight once at the measured bandwidth and the
step's products at the faster kernel's matmul rate. ``--cpu-matmul`` picks the linear layers' kernel
(``trainer.cpu_matmul``), ``--cpu-matmul-dtype`` the blocks' product dtype (``trainer.cpu_matmul_dtype``).

With ``--lora-rank R`` the model is wrapped with PEFT LoRA adapters of rank R on every projection (B drawn
away from zero), as an actor with ``actor_rollout_ref.model.lora_rank=R`` is: ``layers`` then runs PEFT's
wrapped layers (the base weights packed, the adapters' two small products beside each), ``ours`` the fused
step on weights with the adapters merged in once per rollout.

With ``--layouts flat,ragged`` the prompts are also taken at 1/2 to all of ``--prompt-len`` tokens,
left-padded as the trainer's are (so that attention has a padding mask), alternating with the
flat ones in the same process.

    python bench/decode.py [--models demo,random25m,smollm2] [--rows 16,64] [--layouts flat] [--reps 3] [--lora-rank R]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import rlhf_core.rollout.hf as hf
from rlhf_core.batch import Batch
from rlhf_core.models import cpu_matmul, lora
from rlhf_core.models.loading import load_actor, load_tokenizer
from rlhf_core.rollout import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import (  # noqa: E402
    available_models,
    cache_bytes,
    decode_bound_s,
    measured_rates,
    read_bandwidth_gbs,
    run_times,
    weight_bytes,
)


def _multinomial(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _one_level_cdf(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The inverse-CDF draw before the two-level one: a float64 cumulative sum over the whole vocabulary."""
    cdf = probs.double().cumsum(dim=-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=probs.shape[-1] - 1).squeeze(-1)


def draw_ms(rows: int, vocab: int, reps: int = 50) -> dict[str, float]:
    """Median ms of one token per row from ``rows`` distributions over ``vocab`` entries, by each draw."""
    generator = torch.Generator().manual_seed(0)
    probs = (torch.randn(rows, vocab, generator=generator) * 3).softmax(-1)
    draws = {"multinomial": _multinomial, "one-level CDF": _one_level_cdf, "two-level CDF": hf.draw_from}
    return {name: statistics.median(run_times(functools.partial(draw, probs, generator), reps)) * 1e3
            for name, draw in draws.items()}


def with_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """``model`` with LoRA adapters of ``rank`` on every projection, as the actor applies them, B away from zero."""
    torch.manual_seed(0)
    model = lora.apply_lora(model, rank, 2 * rank, "all-linear")
    for name, parameter in model.named_parameters():
        if ".lora_B." in name:
            parameter.data.normal_(0.0, 0.01)
    return model


VARIANTS = {
    "dynamic": {"PreallocatedCache": lambda capacity: DynamicCache(), "draw_from": _multinomial,
                "takes_logits_to_keep": lambda cls: False, "FUSED_DECODE": False},
    "layers": {"PreallocatedCache": hf.PreallocatedCache, "draw_from": hf.draw_from,
               "takes_logits_to_keep": hf.takes_logits_to_keep, "FUSED_DECODE": False},
    "ours": {"PreallocatedCache": hf.PreallocatedCache, "draw_from": hf.draw_from,
             "takes_logits_to_keep": hf.takes_logits_to_keep, "FUSED_DECODE": True},
    "ours, oneDNN": {"PreallocatedCache": hf.PreallocatedCache, "draw_from": hf.draw_from,
                     "takes_logits_to_keep": hf.takes_logits_to_keep, "FUSED_DECODE": True, "mkl": False},
}
MKL_PACKS = cpu_matmul.mkl_packs


def _use(variant: str) -> None:
    settings = dict(VARIANTS[variant])
    cpu_matmul.mkl_packs = MKL_PACKS if settings.pop("mkl", True) else (lambda: False)
    for name, value in settings.items():
        setattr(hf, name, value)


def _prompts(rows: int, prompt_len: int, vocab: int, ragged: bool, seed: int = 0) -> Batch:
    """Random prompts of ``prompt_len`` tokens, or (``ragged``) of 1/2 to all of it, left-padded as the
    trainer's are (so that the attention has a padding mask)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt_len), generator=g)
    lengths = (torch.randint(prompt_len // 2, prompt_len + 1, (rows,), generator=g) if ragged
               else torch.full((rows,), prompt_len))
    mask = (torch.arange(prompt_len) >= prompt_len - lengths[:, None]).long()
    return Batch({"input_ids": ids * mask, "attention_mask": mask,
                  "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}, {})


def decode_ms(engine, prompts: Batch, n: int, tokens: int) -> float:
    def seconds(new_tokens: int) -> float:
        start = time.perf_counter()
        out = engine.generate(prompts, SamplingParams(n=n, temperature=1.0, max_new_tokens=new_tokens))
        assert out["responses"].shape[1] == new_tokens  # EOS is off: every row ran every step
        return time.perf_counter() - start
    # the one-token rollout (the fixed cost taken off) at its fastest of 3: one sample of it, noisier than the
    # long rollout on a loaded machine, could exceed the steps' share and make the figure negative
    fixed = min(seconds(1) for _ in range(3))
    step = (seconds(tokens) - fixed) / (tokens - 1) * 1e3
    return step if step > 0 else float("nan")  # noise larger than the steps: no figure rather than a wrong one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,random25m,smollm2")
    parser.add_argument("--rows", default="16,64", help="sequences per decode step (prompts x 4 samples; under 4 rows, one prompt x that many)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--layouts", default="flat",
                        help="flat (every prompt --prompt-len tokens) and/or ragged (1/2 to all of it, left-padded)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-matmul", default="auto", choices=cpu_matmul.CHOICES)
    parser.add_argument("--cpu-matmul-dtype", default="float32", choices=cpu_matmul.DTYPE_CHOICES)
    parser.add_argument("--lora-rank", type=int, default=0, help="wrap the model with LoRA adapters of this rank")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu_matmul.configure(args.cpu_matmul, args.cpu_matmul_dtype)
    layouts = args.layouts.split(",")
    if not set(layouts) <= {"flat", "ragged"}:
        parser.error(f"--layouts takes flat and/or ragged, got {args.layouts}")
    work = Path(tempfile.mkdtemp(prefix="decode_"))
    lines, draws = [], []
    for name, path in available_models(args.models, work):
        model, tokenizer = load_actor(path), load_tokenizer(path)
        if args.lora_rank:
            model = with_lora(model, args.lora_rank)
        engine = hf.HFRolloutEngine(model, tokenizer, seed=0)
        engine.eos_ids = torch.tensor([-1])  # no token ends a row: R steps for every row
        rates, _ = measured_rates(2048, model.config.hidden_size, model.config.intermediate_size, args.cpu_matmul_dtype)
        bandwidth = read_bandwidth_gbs(weight_bytes(model))
        for rows in (int(r) for r in args.rows.split(",")):
            n = min(4, rows)
            if rows % n:
                parser.error(f"--rows takes multiples of 4 (or 1 to 3), got {rows}")
            prompts = {layout: _prompts(rows // n, args.prompt_len, min(tokenizer.vocab_size, 1000), layout == "ragged")
                       for layout in layouts}
            bound = decode_bound_s(model, rows, rates, bandwidth) * 1e3
            bound_kv = decode_bound_s(model, rows, rates, bandwidth,
                                      cache_bytes(model, rows, args.prompt_len + args.tokens / 2)) * 1e3
            draws.append(f"{name}, {rows} rows x {model.config.vocab_size} entries: " + ", ".join(
                f"{draw} {ms:.2f} ms" for draw, ms in draw_ms(rows, model.config.vocab_size).items()))
            times = {(v, layout): [] for layout in layouts for v in VARIANTS}
            for variant in VARIANTS:  # warm-up
                _use(variant)
                decode_ms(engine, prompts[layouts[0]], n, 4)
            for _ in range(args.reps):
                for variant, layout in times:
                    _use(variant)
                    times[variant, layout].append(decode_ms(engine, prompts[layout], n, args.tokens))
            _use("ours")
            med = {key: statistics.median(t) for key, t in times.items()}
            for layout in layouts:
                old, layer, new, onednn = (med[variant, layout]
                                           for variant in ("dynamic", "layers", "ours", "ours, oneDNN"))
                lines.append(f"{name:<11}{rows:>5}{layout:>8}{old:>12.1f}{layer:>11.1f}{new:>10.1f}{old / new:>9.2f}"
                             f"{new / layer:>12.2f}{onednn:>11.1f}{new / onednn:>12.2f}{bound:>10.1f}{new / bound:>9.2f}"
                             f"{new / bound_kv:>8.2f}")
                print(lines[-1], flush=True)
    print(f"\n{'model':<11}{'rows':>5}{'prompts':>8}{'dynamic ms':>12}{'layers ms':>11}{'ours ms':>10}{'speed-up':>9}"
          f"{'ours/layers':>12}{'oneDNN ms':>11}{'ours/oneDNN':>12}{'bound ms':>10}{'x bound':>9}{'x b+kv':>8}")
    print("\n".join(lines))
    print("\none token per row drawn from softmax probabilities (medians of 50):\n" + "\n".join(draws))
    print(f"medians of {args.reps}, prompts of {args.prompt_len} tokens (ragged: {args.prompt_len // 2} to "
          f"{args.prompt_len}, left-padded), {args.tokens} new tokens, "
          f"{args.threads} threads, linear layers on {args.cpu_matmul}, blocks' products in {args.cpu_matmul_dtype}"
          f"{f', LoRA adapters of rank {args.lora_rank}' if args.lora_rank else ''}; speed-up: dynamic over "
          "ours; ours/layers: the fused step's time over transformers' layers'; ours/oneDNN: over the fused step's "
          f"on oneDNN's packed weights (MKL's packed products in ours: {MKL_PACKS()}); x bound: our decode step over the "
          "longer of weight bytes / bandwidth and its products at the matmul rate (1.00 = at the limit); x b+kv: the "
          "same with the keys and values attention reads added to the bytes (the prompt and half the new tokens, a row)")


if __name__ == "__main__":
    main()
