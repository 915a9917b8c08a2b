"""PPO throughput on one GPU with a random-weight model of Qwen2.5-0.5B's shapes, HF and vLLM rollout.

The model is a Llama decoder with Qwen2.5-0.5B's sizes (hidden 896, 24 layers, 14 query and 2
key/value heads, MLP 4864, vocabulary 151,936, tied embeddings: about 494M parameters) and random
weights, saved with the project's character tokenizer, so nothing is downloaded. Random weights
rarely stop early, so responses run to the length limit: every step does the full work.

For each rollout engine the trainer runs warm-up steps and then timed steps of GAE PPO with a KL
loss (actor, critic and reference on the GPU, bf16 parameters) and prints, per engine, verl's
``perf/throughput`` (prompt + response tokens per second per GPU over the whole step), the
generation rate, and the share of the step spent generating; then the ratio to the ~1.3k tokens/s
per GPU that verl's own example log shows for this model size (target: at least 2x on an H200).
Planned to finish in under 8 minutes on one GPU.

``--smoke`` runs the same code on the CPU with a two-layer model of a few thousand parameters and a handful
of rows, so that the script's own path is tested where there is no GPU (its figures mean nothing).

    python bench/gpu_throughput.py [--engines hf,vllm] [--batch 128 --n 4 --response 256] [--steps 3] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from roofline import WHOLE_ROWS  # bench/roofline.py, beside this script

from rlhf_core.config import load_config
from rlhf_core.data.synthetic import build_dataset
from rlhf_core.main_ppo import trainer_session
from rlhf_core.models import toy

REPO = Path(__file__).resolve().parents[1]
# The low end of the 1.3-1.6k tokens/s/GPU commonly quoted for verl's GSM8K PPO quickstart on Qwen2.5-0.5B
# (vLLM rollout, a real model whose responses end at EOS, the GPU of that log). Not measured here and not the
# same work: this script's random weights run every response to its full length on whatever GPU it is given,
# so the ratio printed beside it places the figure, it does not rank the two.
VERL_REFERENCE_TOKENS_PER_S = 1300.0


def qwen25_05b_shaped(out: Path, smoke: bool = False) -> Path:
    """Qwen2.5-0.5B's shapes with random bf16 weights at ``out`` (``smoke``: two small layers, on the CPU)."""
    tokenizer = toy.build_char_tokenizer(2048)
    sizes = (dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128) if smoke else
             dict(hidden_size=896, num_layers=24, num_heads=14, intermediate_size=4864))
    config = toy._llama_config(tokenizer, **sizes, max_position_embeddings=2048)
    if not smoke:
        config.vocab_size = 151_936  # the real vocabulary's size (the character tokenizer uses the first ids)
    config.num_key_value_heads = 2
    config.rope_theta = 1_000_000.0
    with torch.device("cpu" if smoke else "cuda"):
        model = toy.LlamaForCausalLM(config).to(torch.bfloat16)
    toy._save(model.cpu(), tokenizer, out)
    del model
    torch.cuda.empty_cache()
    return out


def run(engine: str, model: Path, work: Path, args) -> dict:
    cfg = load_config([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={work / 'data/train.parquet'}",
        f"data.val_files={work / 'data/test.parquet'}", f"data.train_batch_size={args.batch}",
        "data.max_prompt_length=512", f"data.max_response_length={args.response}",
        f"actor_rollout_ref.rollout.name={engine}", f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch // 2}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro}",
        f"critic.ppo_micro_batch_size_per_gpu={args.micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={2 * args.micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={2 * args.micro}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true", "critic.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.model.dtype=bfloat16", f"trainer.device={args.device}", "trainer.n_gpus_per_node=1",
        "trainer.logger=[]", f"trainer.default_local_dir={work / engine}", "trainer.val_before_train=false",
        *WHOLE_ROWS,  # gradient checkpointing is on, which the shared prefix cannot run with
    ], config_file=REPO / "configs" / "ppo_demo_cpu.yaml")
    with trainer_session(cfg) as trainer:
        rows = []
        for step in range(args.warmup + args.steps):
            _, batch_rows = trainer.sampler.next_batch()
            metrics = trainer.train_step(trainer.train_dataset.collate(batch_rows))
            trainer.global_step += 1
            print(f"[{engine}] step {step + 1}: {metrics['timing_s/step']:.1f} s, "
                  f"{metrics['perf/throughput']:.0f} tokens/s/GPU", flush=True)
            if step >= args.warmup:
                rows.append(metrics)
    del trainer
    torch.cuda.empty_cache()
    return {key: statistics.median(r[key] for r in rows) for key in
            ("timing_s/step", "timing_s/gen", "perf/throughput", "perf/rollout_tokens_per_s",
             "perf/max_memory_allocated_gb")}


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default=None,
                        help="comma-separated rollout engines (default hf,vllm; with --smoke, hf: vLLM needs a GPU)")
    parser.add_argument("--batch", type=int, default=128, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="responses per prompt")
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true",
                        help="on the CPU, a tiny model, 4 prompts x 2, responses of 8 tokens, one step each")
    args = parser.parse_args(argv)
    args.engines = args.engines or ("hf" if args.smoke else "hf,vllm")
    args.micro, args.device = 32, "cuda"
    if args.smoke:
        args.batch, args.n, args.response, args.warmup, args.steps = 4, 2, 8, 1, 1
        args.micro, args.device = 4, "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("bench/gpu_throughput.py needs a CUDA GPU (--smoke runs its code on the CPU)")
    work = Path(tempfile.mkdtemp(prefix="gpu_throughput_"))
    build_dataset(work / "data", n_train=4096, n_test=16, seed=0, max_ops=2)
    model = qwen25_05b_shaped(work / "model", smoke=args.smoke)
    print(f"{'CPU smoke run' if args.smoke else 'GPU: ' + torch.cuda.get_device_name()}; model: "
          f"{'two small layers' if args.smoke else 'Qwen2.5-0.5B shapes'}, random weights; "
          f"{args.batch} prompts x {args.n}, responses of {args.response} tokens")
    results = {engine: run(engine, model, work, args) for engine in args.engines.split(",")}
    for engine, r in results.items():
        print(f"[{engine}] step {r['timing_s/step']:.1f} s (generation {r['timing_s/gen'] / r['timing_s/step']:.0%}); "
              f"perf/throughput {r['perf/throughput']:.0f} tokens/s/GPU "
              f"({r['perf/throughput'] / VERL_REFERENCE_TOKENS_PER_S:.1f}x the 1.3k quoted for verl, not the same work); "
              f"generation {r['perf/rollout_tokens_per_s']:.0f} response tokens/s; "
              f"peak {r['perf/max_memory_allocated_gb']:.1f} GiB")
    return results


if __name__ == "__main__":
    main()
