"""A real pretrained checkpoint on real data: SmolLM2-135M-Instruct on GSM8K, on CPU.

1. The base model's greedy accuracy on the first ``--eval`` GSM8K test problems, graded strict
   (the answer after ``####``, the format the prompt asks for) and flexible (the last number).
2. ``--steps`` PPO iterations (GAE with a critic, KL loss against the reference) on GSM8K train
   prompts, with the trainer's per-phase times, tokens per second and the process's peak RSS.
3. The checkpoint's HF export reloaded with ``AutoModelForCausalLM``: its logits equal the trained actor's.

Prints a summary and writes it to ``bench/results/real_model.json``. Needs the imported model
(``make real-model``) and the GSM8K release (``GSM8K_DIR``).

    python bench/real_model.py [--model outputs/smollm2-135m-instruct] [--eval 128] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

REPO = Path(__file__).resolve().parents[1]
PHASES = ["gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor"]


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # ru_maxrss is in KiB on Linux


def prepare_data(gsm8k_dir: Path, work: Path, n_eval: int, n_train: int) -> tuple[Path, Path]:
    """verl-schema parquet files of the first ``n_train`` train and ``n_eval`` test problems."""
    from rlhf_core.data.gsm8k import preprocess_gsm8k

    full = work / "gsm8k"
    preprocess_gsm8k(gsm8k_dir, full)
    train, test = work / "train.parquet", work / "test.parquet"
    pd.read_parquet(full / "train.parquet").head(n_train).to_parquet(train, index=False)
    pd.read_parquet(full / "test.parquet").head(n_eval).to_parquet(test, index=False)
    return train, test


@torch.no_grad()
def base_accuracy(model_dir: Path, test_file: Path, max_new_tokens: int, batch_size: int) -> dict:
    """Greedy responses once, graded both ways."""
    from rlhf_core.batch import Batch
    from rlhf_core.config import DataConfig
    from rlhf_core.data.dataset import RLHFDataset
    from rlhf_core.models.loading import load_actor, load_tokenizer
    from rlhf_core.rewards.gsm8k import compute_score
    from rlhf_core.rollout import SamplingParams, make_rollout_engine

    tokenizer = load_tokenizer(model_dir)
    dataset = RLHFDataset(test_file, tokenizer, DataConfig(max_prompt_length=512), key="test")
    engine = make_rollout_engine("hf", load_actor(model_dir), tokenizer, seed=0)
    params = SamplingParams(n=1, max_new_tokens=max_new_tokens, do_sample=False)
    strict, flexible, lengths, ended, tokens = [], [], [], [], 0
    example = None
    start = time.perf_counter()
    for first in range(0, len(dataset), batch_size):
        rows = list(range(first, min(first + batch_size, len(dataset))))
        batch: Batch = engine.generate(dataset.collate(rows), params)
        mask = batch["response_mask"].bool()
        for row, index in enumerate(rows):
            ids = batch["responses"][row][mask[row]].tolist()
            text = tokenizer.decode(ids, skip_special_tokens=True)
            truth = dataset.rows[index]["ground_truth"]
            strict.append(compute_score(text, truth, method="strict"))
            flexible.append(compute_score(text, truth, method="flexible"))
            lengths.append(len(ids))
            ended.append(bool(ids) and ids[-1] in engine.eos_ids.tolist())
            example = example or {"question": dataset.rows[index]["messages"][-1]["content"], "response": text,
                                  "ground_truth": truth}
        tokens += int(mask.sum())
        print(f"  base model: {len(strict)}/{len(dataset)} problems answered, {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)
    wall = time.perf_counter() - start
    n = len(strict)
    return {"n": n, "strict_acc": sum(strict) / n, "flexible_acc": sum(flexible) / n,
            "mean_response_tokens": sum(lengths) / n, "ended_with_eos": sum(ended) / n,
            "max_new_tokens": max_new_tokens, "wall_s": wall, "generated_tokens_per_s": tokens / wall,
            "example": example}


def ppo_config(model_dir: Path, train_file: Path, val_file: Path, out: Path, args):
    from rlhf_core.config import load_config

    micro = min(8, args.prompts * args.n)
    return load_config([
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={train_file}", f"data.val_files={val_file}",
        f"data.train_batch_size={args.prompts}", "data.max_prompt_length=320",
        f"data.max_response_length={args.response_length}", f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}", f"critic.ppo_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.optim.lr=1e-6", "critic.optim.lr=1e-5", "algorithm.adv_estimator=gae",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false", "critic.model.enable_gradient_checkpointing=false",
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.logger=[console]",
        f"trainer.total_training_steps={args.steps}", f"trainer.default_local_dir={out}",
    ])


def ppo_steps(cfg, model_dir: Path, args) -> dict:
    from transformers import AutoModelForCausalLM

    from rlhf_core.main_ppo import build_trainer, preflight

    preflight(cfg)
    start = time.perf_counter()
    trainer = build_trainer(cfg)
    load_s = time.perf_counter() - start
    steps = []
    for _ in range(args.steps):
        _, rows = trainer.sampler.next_batch()
        metrics = trainer.train_step(trainer.train_dataset.collate(rows))
        trainer.global_step += 1
        steps.append({k: v for k, v in metrics.items() if k.startswith(("timing_s/", "perf/", "response_length/mean",
                                                                         "critic/score/mean", "actor/ppo_kl",
                                                                         "actor/pg_loss", "critic/vf_loss"))})
        print(f"step {len(steps)}: {metrics['timing_s/step']:.1f} s, {metrics['perf/throughput']:.1f} tokens/s, "
              f"score {metrics['critic/score/mean']:.3f}, response length {metrics['response_length/mean']:.1f}",
              file=sys.stderr, flush=True)
    save_start = time.perf_counter()
    export = trainer.save_checkpoint() / "actor" / "huggingface"
    save_s = time.perf_counter() - save_start
    reloaded = AutoModelForCausalLM.from_pretrained(export).eval()
    ids = torch.tensor([trainer.train_dataset.prompt_ids[0]])
    with torch.no_grad():
        theirs = reloaded(input_ids=ids).logits
        ours = trainer.actor.forward_module.eval()(input_ids=ids).logits
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    trainer.close()
    return {"load_s": load_s, "save_s": save_s, "steps": steps, "export": str(export),
            "export_max_logit_diff": float((theirs - ours).abs().max()),
            "trained_vs_base_max_logit_diff": float((ours - base_logits).abs().max())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "outputs" / "smollm2-135m-instruct"))
    parser.add_argument("--gsm8k", default=os.environ.get("GSM8K_DIR", str(REPO.parent / "shared" / "data" / "gsm8k")))
    parser.add_argument("--eval", type=int, default=128, help="test problems for the base accuracy (0: skip it)")
    parser.add_argument("--eval-tokens", type=int, default=128, help="greedy response budget")
    parser.add_argument("--eval-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2, help="PPO iterations")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per PPO iteration")
    parser.add_argument("--n", type=int, default=2, help="responses per prompt")
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "real_model.json"))
    args = parser.parse_args(argv)
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        print(f"error: no model at {model_dir}; run `make real-model` first", file=sys.stderr)
        return 2
    gsm8k = Path(args.gsm8k)
    if not (gsm8k / "test.jsonl").is_file() and not (gsm8k / "main").is_dir():
        print(f"error: no GSM8K release at {gsm8k}; set GSM8K_DIR", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    result: dict = {"command": " ".join(["python", "bench/real_model.py", *(argv or sys.argv[1:])]),
                    "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
                               f"{torch.get_num_threads()} threads",
                    "load_average_before": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlhf-real-") as work:
        train, test = prepare_data(gsm8k, Path(work), max(args.eval, 1), args.prompts * args.steps)
        cfg = ppo_config(model_dir, train, test, Path(work) / "ckpt", args)  # a bad setting fails before any work
        if args.eval:
            result["base"] = base_accuracy(model_dir, test, args.eval_tokens, args.eval_batch)
            print(f"base greedy accuracy on {result['base']['n']} GSM8K test problems: strict "
                  f"{result['base']['strict_acc']:.3f}, flexible {result['base']['flexible_acc']:.3f} "
                  f"({result['base']['wall_s']:.0f} s)", file=sys.stderr, flush=True)
        result["ppo"] = ppo_steps(cfg, model_dir, args)
    result["wall_s"] = time.perf_counter() - start
    result["peak_rss_gb"] = peak_rss_gb()
    result["load_average_after"] = os.getloadavg()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")

    base, ppo = result.get("base"), result["ppo"]
    if base:
        print(f"base: strict {base['strict_acc']:.3f}, flexible {base['flexible_acc']:.3f} on {base['n']} problems; "
              f"mean response {base['mean_response_tokens']:.0f} tokens, {base['ended_with_eos']:.0%} ended with EOS; "
              f"{base['generated_tokens_per_s']:.0f} generated tokens/s")
    for i, step in enumerate(ppo["steps"], 1):
        phases = ", ".join(f"{p} {step.get(f'timing_s/{p}', 0):.1f}" for p in PHASES)
        print(f"ppo step {i}: {step['timing_s/step']:.1f} s ({phases}); {step['perf/throughput']:.1f} tokens/s")
    print(f"export reloaded: max |logit difference| {ppo['export_max_logit_diff']:.2e} "
          f"(trained vs base {ppo['trained_vs_base_max_logit_diff']:.2e})")
    print(f"peak RSS {result['peak_rss_gb']:.2f} GB; wall {result['wall_s']:.0f} s; written {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
