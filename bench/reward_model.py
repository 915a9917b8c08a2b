"""Reward-model benchmark: held-out pair accuracy of a reward model trained with rlhf-train-rm.

Tasks:

* ``demo``: synthetic preferences on the demo task (chosen: the right final answer; rejected: the
  demo model's slip, the first number of the problem), questions disjoint between train and
  held-out. The reward model starts from the warm-started demo model.
* ``gsm8k``: the real model-solution pairs of the GSM8K release (a correct against an incorrect
  solution to the same question), split by question. These are GSM8K *test* questions.

Prints one line per task:

    held-out pair accuracy 0.97 (400 pairs, 400 questions) after 62 steps, 95 s [demo]

and writes the figures to ``--out/reward_model.json``.

    python bench/reward_model.py [--tasks demo,gsm8k] [--model DIR] [--epochs 1] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from rlhf_core.config import load_config
from rlhf_core.data.preference import gsm8k_solution_pairs, split_by_group, synthetic_pairs, write_splits
from rlhf_core.data.synthetic import DATA_SOURCE
from rlhf_core.models.toy import ensure_toy_model
from rlhf_core.training.reward_trainer import HF_DIR, RewardModelTrainer

REPO = Path(__file__).resolve().parents[1]
#: per task: (train batch, micro batch, lr, max_length)
SETTINGS = {"demo": (32, 16, 2e-3, 256), "gsm8k": (32, 8, 1e-3, 1024)}


def prepare(task: str, work: Path, n_train: int, n_val: int, gsm8k_dir: Path,
            max_pairs: tuple[int | None, int | None] = (None, None)) -> Path:
    out = work / f"pairs_{task}"
    if task == "demo":
        train, val = synthetic_pairs(n_train, n_val, seed=0)
        source = DATA_SOURCE
    else:
        pairs = gsm8k_solution_pairs(gsm8k_dir / "example_model_solutions.jsonl")
        train, val = split_by_group(pairs, 0.2, seed=0)
        train, val = train[:max_pairs[0]], val[:max_pairs[1]]  # a subset keeps the split by question
        source = "openai/gsm8k"
    write_splits(out, train, val, source, overwrite=True)
    return out


def run(task: str, model: Path, pairs: Path, work: Path, epochs: int, lora_rank: int, steps: int | None,
        measure_before: bool = True, max_length: int | None = None) -> dict:
    batch, micro, lr, default_length = SETTINGS[task]
    max_length = max_length or default_length
    overrides = [
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", f"reward_model.train.model.path={model}",
        f"reward_model.train.train_files={pairs / 'train.parquet'}",
        f"reward_model.train.val_files={pairs / 'val.parquet'}",
        f"reward_model.train.train_batch_size={batch}", f"reward_model.train.micro_batch_size_per_gpu={micro}",
        f"reward_model.train.optim.lr={lr}", "reward_model.train.optim.lr_warmup_steps_ratio=0.05",
        "reward_model.train.optim.lr_scheduler_type=cosine", f"reward_model.train.max_length={max_length}",
        f"reward_model.train.total_epochs={epochs}", "reward_model.train.resume_mode=disable",
        f"reward_model.train.default_local_dir={work / f'rm_{task}'}",
        f"reward_model.train.model.lora_rank={lora_rank}", "reward_model.train.model.lora_alpha=16",
    ]
    if steps:
        overrides.append(f"reward_model.train.total_training_steps={steps}")
    cfg = load_config(overrides)
    started = time.perf_counter()
    trainer = RewardModelTrainer(cfg)
    before = trainer.validate() if measure_before else {"val/pair_accuracy": float("nan")}
    loaded = time.perf_counter()
    val = trainer.fit()
    seconds = time.perf_counter() - loaded
    n_val = len(trainer.val_pairs)
    record = {"task": task, "model": str(model), "path": str(trainer.local_dir / HF_DIR), "lora_rank": lora_rank, "train_pairs": len(trainer.train_pairs),
              "val_pairs": n_val, "steps": trainer.global_step, "train_seconds": round(seconds, 1),
              "total_seconds": round(time.perf_counter() - started, 1),
              "pair_accuracy_before": before["val/pair_accuracy"], "pair_accuracy": val["val/pair_accuracy"],
              "val_loss": val["val/loss"], "val_margin_mean": val["val/margin_mean"],
              "settings": {"train_batch_size": batch, "micro_batch_size_per_gpu": micro, "lr": lr,
                           "max_length": max_length, "epochs": epochs}}
    print(f"held-out pair accuracy {before['val/pair_accuracy']:.3f} -> {val['val/pair_accuracy']:.3f} "
          f"({n_val} pairs) after {trainer.global_step} steps, {seconds:.0f} s [{task}]", flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="demo,gsm8k")
    parser.add_argument("--model", type=Path, default=None, help="base model (default: the demo model)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="stop each run after this many steps")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--max-length", type=int, default=None, help="tokens per sequence (default per task)")
    parser.add_argument("--skip-before", action="store_true", help="do not measure the untrained head first")
    parser.add_argument("--n-train", type=int, default=2000, help="synthetic training pairs (demo)")
    parser.add_argument("--n-val", type=int, default=400, help="synthetic held-out pairs (demo)")
    parser.add_argument("--max-train-pairs", type=int, default=None, help="gsm8k: train on the first N pairs")
    parser.add_argument("--max-val-pairs", type=int, default=None, help="gsm8k: hold out the first N pairs")
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "bench_reward_model")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    model = args.model or ensure_toy_model("demo")
    gsm8k_dir = Path(os.environ.get("GSM8K_DIR", REPO.parent / "shared" / "data" / "gsm8k"))
    records = []
    for task in args.tasks.split(","):
        pairs = prepare(task, args.work, args.n_train, args.n_val, gsm8k_dir,
                        (args.max_train_pairs, args.max_val_pairs))
        records.append(run(task, model, pairs, args.work, args.epochs, args.lora_rank, args.steps,
                           measure_before=not args.skip_before, max_length=args.max_length))
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "load": os.getloadavg(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "runs": records}
    (args.out / "reward_model.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
