"""How far each PPO phase is from what this machine allows.

Measured in the same process, beside the trainer's steps:

- the fp32 matrix-multiply rate (GFLOP/s) at each pass's shape: (tokens of one of its micro-batches) x
  hidden @ hidden x intermediate, the largest matmul of a transformer block, by each kernel torch has
  on CPU (``torch.mm``'s BLAS and oneDNN, ``trainer.cpu_matmul``); the faster is the machine's rate. A pass's
  micro-batch is its own (:func:`micro_batch_tokens`): the updates' and the values pass's
  ``ppo_micro_batch_size_per_gpu`` sequences, the log-prob passes' ``log_prob_micro_batch_size_per_gpu``
  (64 and 16 for the demo and 25M models here; before 2026-12-06 every pass was set against the rate at 16
  sequences). It is taken again right after each timed step, and each step's phases are set against the rate
  measured after that step (a 2-core VM's speed can drift by a fifth within a process); the fractions printed
  are the medians over the timed steps, the rate printed is the actor update's median rate, with its range;
- the memory bandwidth (GB/s): one read of a tensor the size of the model's weights.

Then each phase of a few trainer iterations against its bound:

- update and log-prob passes: achieved FLOP/s over the matmul rate, with 6 x (matmul parameters) x
  tokens for a forward and backward and 2 x for a forward alone (embeddings are look-ups, not
  matmuls; the LM head counts only on the positions it runs on, the actor's response positions, and
  not at all in the critic's phases: the critic has a scalar value head in its place);
- generation: seconds per decode step over its roofline, the longer of reading every weight once
  (weight bytes / bandwidth) and its products (2 x matmul parameters x rows / matmul rate). A decode step is
  one turn of the HF rollout's decode loop (a draw and a one-token forward of every row), timed by the engine
  apart from its prefill (the decode weights made for the rollout, the prompts' pass), which is printed
  beside; before 2026-12-03 the column was the whole generation over its steps, prefill included.

    python bench/roofline.py [--models demo,random25m,smollm2] [--warmup 3] [--iters 2] [--threads 2] [--json rows.json]
                             [--gsm8k DIR] [key=value ...]

Tokens are the real ones (the attention mask's), so padding a phase computes counts against it: the synthetic
prompts are nearly even (1-3% of SmolLM2's micro-batch is padding), real GSM8K prompts (``--gsm8k``) are not.

The timed steps come after ``--warmup`` steps (3 by default): under glibc's allocator the process's heap
grows over the first two or three steps, and the updates of those steps fault in fresh pages that a long
run does not (SmolLM2's critic update: 916k, 332k, 113k, 50k, 28k minor faults in steps 1-5, resident
memory 4.3, 9.4, 9.7, 9.8, 9.8 GB; ``bench/page_faults.py --warmup 0 --iters 5``).

``smollm2`` needs the imported checkpoint (``make real-model``); it is skipped with a reason otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from rlhf_core.config import load_config
from rlhf_core.data.gsm8k import preprocess_gsm8k
from rlhf_core.data.synthetic import build_dataset
from rlhf_core.main_ppo import build_trainer
from rlhf_core.models import cpu_matmul
from rlhf_core.models.toy import ensure_toy_model, random_toy_model

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO / "outputs" / "smollm2-135m-instruct"


#: every row runs its whole prompt: the FLOP counts and floors of these benchmarks assume it (the demo
#: config turns use_shared_prefix on, which computes a prompt once per group)
WHOLE_ROWS = ("actor_rollout_ref.model.use_shared_prefix=false", "critic.model.use_shared_prefix=false")


def require_model_dir(parser: argparse.ArgumentParser, path: str | Path) -> Path:
    """``path`` as a Path, or the parser's usage error where it holds no model (no ``config.json``)."""
    if not (Path(path) / "config.json").is_file():
        parser.error(f"{path} is not a model directory: run `make real-model`, or pass another")
    return Path(path)


def run_times(fn, reps: int) -> list[float]:
    """Seconds of ``reps`` calls of ``fn`` after one warm-up call (allocations, thread pool)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _best_seconds(fn, reps: int) -> float:
    return min(run_times(fn, reps))


def matmul_gflops(tokens: int, hidden: int, intermediate: int, reps: int = 5) -> dict[str, float]:
    """fp32 GFLOP/s of (tokens, hidden) @ (hidden, intermediate), 2 * t * h * i floating-point operations, by
    ``torch.mm`` (``blas``) and, where torch has it, by oneDNN (``onednn``)."""
    a = torch.randn(tokens, hidden)
    b = torch.randn(hidden, intermediate)
    flop = 2 * tokens * hidden * intermediate
    rates = {"blas": flop / _best_seconds(lambda: torch.mm(a, b), reps) / 1e9}
    if cpu_matmul.available():
        weight = b.t().contiguous()  # (intermediate, hidden), as a linear layer holds it
        rates["onednn"] = flop / _best_seconds(lambda: cpu_matmul.onednn_linear(a, weight), reps) / 1e9
    return rates


def bf16_matmul_gflops(tokens: int, hidden: int, intermediate: int, reps: int = 5) -> float:
    """GFLOP/s of the same product with bfloat16 operands (``torch.mm``: oneDNN's kernels; AMX where the CPU has
    it), the rate of ``trainer.cpu_matmul_dtype=bfloat16``'s products."""
    a, b = torch.randn(tokens, hidden, dtype=torch.bfloat16), torch.randn(hidden, intermediate, dtype=torch.bfloat16)
    return 2 * tokens * hidden * intermediate / _best_seconds(lambda: torch.mm(a, b), reps) / 1e9


def read_bandwidth_gbs(n_bytes: int, reps: int = 5) -> float:
    """GB/s of one pass over ``n_bytes`` of fp32 (a sum: each element read once, next to no arithmetic)."""
    data = torch.randn(max(1, n_bytes // 4))
    seconds = _best_seconds(lambda: data.sum(), reps)
    return data.numel() * 4 / seconds / 1e9


class Rates(NamedTuple):
    """GFLOP/s of the transformer blocks' products (float32, or bfloat16 under ``cpu_matmul_dtype``) and of the
    LM head's (float32 always)."""

    body: float
    head: float


def measured_rates(tokens: int, hidden: int, intermediate: int, product_dtype: str) -> tuple[Rates, dict[str, float]]:
    """The blocks' and the LM head's matmul rates for products in ``product_dtype`` (``trainer.cpu_matmul_dtype``):
    the faster float32 kernel's, or bfloat16's for the blocks; with every rate measured, by kernel."""
    by_kernel = matmul_gflops(tokens, hidden, intermediate)
    float32 = max(by_kernel.values())
    if product_dtype == "bfloat16":
        by_kernel["bf16"] = bf16_matmul_gflops(tokens, hidden, intermediate)
    return Rates(by_kernel.get("bf16", float32), float32), by_kernel


def decode_bound_s(module: torch.nn.Module, rows: int, rates: Rates, bandwidth_gbs: float,
                   cache_bytes: int = 0) -> float:
    """A decode step's roofline: every weight read once (and ``cache_bytes`` of keys and values, where given), or
    its products at the matmul rates, whichever is longer."""
    body, head = matmul_params(module)
    return max((weight_bytes(module) + cache_bytes) / bandwidth_gbs,
               2 * rows * (body / rates.body + head / rates.head)) / 1e9


def cache_bytes(module: torch.nn.Module, rows: int, positions: float) -> int:
    """Bytes of keys and values a decode step's attention reads: ``positions`` cached per row (on average over
    the steps: the prompt's width and half the response), every layer, key and value heads, in the model's dtype."""
    config = module.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim
    return int(rows * positions * per_position * next(module.parameters()).element_size())


def micro_batch_tokens(cfg, sequences: int, tokens: float) -> dict[str, int]:
    """Tokens of one micro-batch of each pass, the shape its products run at: the pass's sequences per
    micro-batch (no more than the step's) at the step's mean tokens a sequence, or under dynamic
    batching its token cap (no more than the step's ``tokens``). The actor's and the critic's updates take their
    ``ppo_micro_batch_size_per_gpu``, the values pass the critic's, the log-prob passes their
    ``log_prob_micro_batch_size_per_gpu``."""
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    ref, critic = cfg.actor_rollout_ref.ref, cfg.critic

    def shape(micro: int | None, dynamic: bool | None, cap: int | None) -> int:
        if actor.use_dynamic_bsz if dynamic is None else dynamic:  # a null follows the actor's setting
            return int(min(actor.ppo_max_token_len_per_gpu if cap is None else cap, tokens))
        return int(min(micro or sequences, sequences) * tokens / sequences)

    critic_shape = shape(critic.ppo_micro_batch_size_per_gpu, critic.use_dynamic_bsz, critic.ppo_max_token_len_per_gpu)
    return {
        "update_actor": shape(actor.ppo_micro_batch_size_per_gpu, actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu),
        "update_critic": critic_shape,
        "values": critic_shape,
        "old_log_prob": shape(rollout.log_prob_micro_batch_size_per_gpu, rollout.log_prob_use_dynamic_bsz,
                              rollout.log_prob_max_token_len_per_gpu),
        "ref": shape(ref.log_prob_micro_batch_size_per_gpu, ref.log_prob_use_dynamic_bsz,
                     ref.log_prob_max_token_len_per_gpu),
    }


def matmul_params(module: torch.nn.Module) -> tuple[int, int]:
    """(parameters of the Linear layers other than the LM head, parameters of the LM head); a critic (a
    token-classification model: a scalar ``score`` on every position, no LM head) has 0 of the latter. A LoRA
    adapter's two factors (PEFT's ``lora_A`` and ``lora_B``) are left out: its projection counts as one weight of
    the base layer's shape, the ``W + (alpha / r) B A`` the fused decode step multiplies. (A LoRA actor's update,
    whose base weights take no weight gradient, does less than 6 x these per token: the update fractions are
    for full-weight training.)"""
    head = module.get_output_embeddings()
    factors = {id(factor) for m in module.modules() for name in ("lora_A", "lora_B")
               if isinstance(getattr(m, name, None), torch.nn.ModuleDict) for factor in getattr(m, name).values()}
    body = sum(m.weight.numel() for m in module.modules()
               if isinstance(m, torch.nn.Linear) and m is not head and id(m) not in factors)
    return body, 0 if head is None else head.weight.numel()


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes one decode step reads: every matmul weight once (the embedding only a row per token), the blocks'
    in ``cpu_matmul.product_dtype()`` (the rollout packs them so)."""
    body, head = matmul_params(module)
    size = next(module.parameters()).element_size()
    return body * min(size, cpu_matmul.product_dtype().itemsize) + head * size


def _model(name: str, work: Path) -> Path | None:
    if name == "demo":
        return ensure_toy_model("demo")
    if name == "random25m":
        return random_toy_model(work / "random25m", n_layers=6, hidden_size=512, seed=0)
    if name == "smollm2":
        return SMOLLM2 if (SMOLLM2 / "config.json").is_file() else None
    raise SystemExit(f"unknown model {name!r}: use demo, random25m or smollm2")


def available_models(names: str, work: Path) -> Iterator[tuple[str, Path]]:
    """(name, model directory) for each of the comma-separated ``names`` whose checkpoint is at hand."""
    for name in names.split(","):
        model = _model(name, work)
        if model is None:
            print(f"{name}: skipped, no checkpoint at {SMOLLM2} (run `make real-model`)")
            continue
        yield name, model


def trainer_config(name: str, model: Path, work: Path, args):
    """The PPO config these benchmarks run ``model`` with: 4 prompts x 4 samples for SmolLM2, 16 x 4 otherwise,
    one mini-batch and one micro-batch per update, every row whole, ``args.response`` tokens at most."""
    batch, n = (4, 4) if name == "smollm2" else (16, 4)
    return load_config([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={work / 'data/train.parquet'}",
        f"data.val_files={work / 'data/test.parquet'}", "trainer.logger=[]",
        f"trainer.default_local_dir={work / name}", f"data.train_batch_size={batch}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}", f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={batch * n}",
        f"critic.ppo_micro_batch_size_per_gpu={batch * n}", f"data.max_response_length={args.response}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16", *WHOLE_ROWS, *args.overrides,
    ], config_file=REPO / "configs" / "ppo_demo_cpu.yaml")


def run(name: str, model: Path, work: Path, args) -> dict:
    cfg = trainer_config(name, model, work, args)
    batch, n = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n
    trainer = build_trainer(cfg)
    try:
        module = trainer.actor.module
        hf_config = module.config
        params = {"actor": matmul_params(module)}
        if trainer.critic is not None:
            params["critic"] = matmul_params(trainer.critic.module)
        prompts = trainer.train_dataset.collate(list(range(batch)))
        engine = trainer.actor.rollout
        sequences = batch * n
        runs, rollouts, step_rates = [], [], []
        for i in range(args.warmup + args.iters):
            runs.append(trainer.train_step(prompts))
            rollouts.append(dict(getattr(engine, "last_timing", {})))  # the HF engine's prefill and decode loop
            if i >= args.warmup:  # the rates beside each timed step: this machine's speed drifts within a process
                shapes = {phase: t for phase, t in micro_batch_tokens(cfg, sequences,
                                                                      runs[-1]["perf/total_num_tokens"]).items()
                          if phase == "update_actor" or f"timing_s/{phase}" in runs[-1]}  # the passes that ran
                at_shape = {t: measured_rates(t, hf_config.hidden_size, hf_config.intermediate_size,
                                              cfg.trainer.cpu_matmul_dtype) for t in sorted(set(shapes.values()))}
                step_rates.append({phase: at_shape[t] for phase, t in shapes.items()})
        runs, rollouts = runs[args.warmup:], rollouts[args.warmup:]
        bandwidth = read_bandwidth_gbs(weight_bytes(module))
    finally:
        trainer.close()

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    tokens = med("perf/total_num_tokens")
    decode_steps = med("response_length/max")
    update_rates = [step["update_actor"] for step in step_rates]  # the printed rate: the actor update's
    at = Rates(*(statistics.median(getattr(step_at, f) for step_at, _ in update_rates) for f in Rates._fields))
    rates = {k: statistics.median(by_kernel[k] for _, by_kernel in update_rates) for k in update_rates[0][1]}
    rate_range = (min(step_at.body for step_at, _ in update_rates), max(step_at.body for step_at, _ in update_rates))

    def fraction(phase: str, passes: int, model: str = "actor") -> float | None:
        """Seconds the phase's products take at the rates measured right after its step at its micro-batch's
        shape, over the seconds it took, the median over the timed steps; the products are those of the model
        that runs the phase (the critic's: its blocks and value head, no LM head)."""
        key = f"timing_s/{phase}"
        if key not in runs[0] or not med(key):  # never run, or skipped (an on-policy step's old_log_prob: 0 s)
            return None
        body, head = params[model]
        return statistics.median(
            passes * (body * r["perf/total_num_tokens"] / step_at.body
                      + head * r["response_length/mean"] * sequences / step_at.head) / 1e9 / r[key]
            for r, step_at in zip(runs, (step[phase][0] for step in step_rates)))

    gen_per_token_s = med("timing_s/gen") / max(decode_steps, 1)  # the whole generation, prefill included
    if all(r.get("decode_forwards") for r in rollouts):  # the decode loop alone, its prefill apart
        decode_s = statistics.median(r["decode_s"] / r["decode_forwards"] for r in rollouts)
        prefill_s = statistics.median(r["prefill_s"] for r in rollouts)
    else:  # an engine that does not say
        decode_s, prefill_s = gen_per_token_s, None
    bound_s = decode_bound_s(module, sequences, at, bandwidth)
    cached = cache_bytes(module, sequences, prompts["input_ids"].shape[1] + decode_steps / 2)
    bound_kv_s = decode_bound_s(module, sequences, at, bandwidth, cached)
    return {
        "model": name, "params_m": sum(p.numel() for p in module.parameters()) / 1e6,
        "matmul_gflops": at.body, "matmul_gflops_by_kernel": rates, "matmul_gflops_range": rate_range,
        "cpu_matmul": f"{cfg.trainer.cpu_matmul} ({cpu_matmul.training_kernel()} with gradients), blocks' products "
                      f"in {cfg.trainer.cpu_matmul_dtype}",
        "bandwidth_gbs": bandwidth, "step_s": med("timing_s/step"),
        "update_actor": fraction("update_actor", 6), "update_critic": fraction("update_critic", 6, "critic"),
        "old_log_prob": fraction("old_log_prob", 2), "ref": fraction("ref", 2),
        "values": fraction("values", 2, "critic"),
        "decode_ms": decode_s * 1e3, "decode_bound_ms": bound_s * 1e3, "decode_x_bound": decode_s / bound_s,
        "decode_x_bound_kv": decode_s / bound_kv_s, "cache_mb": cached / 1e6,
        "prefill_s": prefill_s, "gen_ms_per_token": gen_per_token_s * 1e3,
        "batch": sequences, "tokens": tokens,
        "phases": {key.removeprefix("timing_s/"): med(key) for key in runs[0] if key.startswith("timing_s/")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,random25m,smollm2")
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the heap's growth settles)")
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gsm8k", metavar="DIR", help="prompts from this GSM8K release (its first train questions, "
                        "whose lengths vary) instead of the synthetic ones (nearly even)")
    parser.add_argument("--json", help="also write the rows (with each phase's median seconds) to this file")
    parser.add_argument("overrides", nargs="*", help="trainer key=value overrides")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="roofline_"))
    if args.gsm8k:
        preprocess_gsm8k(args.gsm8k, work / "data", max_rows=64)
    else:
        build_dataset(work / "data", n_train=64, n_test=8, seed=0, max_ops=1)
    rows = [run(name, model, work, args) for name, model in available_models(args.models, work)]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    print(f"\n{'model':<11}{'params':>8}{'GFLOP/s':>9}{'GB/s':>7}{'step s':>8}{'upd act':>8}{'upd crit':>9}"
          f"{'old lp':>7}{'ref':>6}{'values':>7}{'decode ms':>10}{'bound ms':>9}{'x bound':>8}{'x b+kv':>7}")
    for r in rows:
        print(f"{r['model']:<11}{r['params_m']:>7.1f}M{r['matmul_gflops']:>9.1f}{r['bandwidth_gbs']:>7.1f}"
              f"{r['step_s']:>8.2f}{pct(r['update_actor']):>8}{pct(r['update_critic']):>9}{pct(r['old_log_prob']):>7}"
              f"{pct(r['ref']):>6}{pct(r['values']):>7}{r['decode_ms']:>10.2f}{r['decode_bound_ms']:>9.2f}"
              f"{r['decode_x_bound']:>8.2f}{r['decode_x_bound_kv']:>7.2f}")
    for r in rows:
        low, high = r["matmul_gflops_range"]
        print(f"{r['model']}: matmul GFLOP/s by kernel " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                                  r["matmul_gflops_by_kernel"].items())
              + f" (medians after the timed steps, at the actor update's micro-batch; the blocks' rate ranged {low:.1f}-{high:.1f}); the trainer's "
              f"linear layers ran on {r['cpu_matmul']}")
        if r["prefill_s"] is not None:
            print(f"{r['model']}: the rollout's prefill (decode weights, prompts' pass) {r['prefill_s']:.2f} s; its "
                  f"generation over its tokens, prefill included, {r['gen_ms_per_token']:.2f} ms a token")
    print("GFLOP/s: the blocks' matmul rate at the actor update's micro-batch (the faster float32 kernel's, or bf16's "
          "under cpu_matmul_dtype=bfloat16; the LM head's is float32's); update/log-prob columns: the seconds the "
          "phase's products take at those rates, measured at the phase's own micro-batch, over the seconds it took "
          "(1.00 = at the limit); decode ms: the rollout's decode loop per step (a draw "
          "and a one-token forward of every row; the prefill apart), or where the engine does not time it, the "
          "generation over its steps; x bound: decode ms over the longer of weight bytes / bandwidth and its products "
          "at those rates (1.00 = at the limit); x b+kv: the same with the keys and values attention reads added to "
          "the bytes (the prompt's width and half the response, a row; " + ", ".join(
              f"{r['model']} {r['cache_mb']:.0f} MB" for r in rows) + ")")


if __name__ == "__main__":
    main()
