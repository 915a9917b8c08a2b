"""Data-parallel scaling on CPU: PPO step time and tokens/s with 1 and 2 workers (Ray + FSDP2, gloo).

The same config and prompt batch run three ways, each worker with one torch thread:

* ``1 process``: the single-process trainer (no Ray, no sharding), the baseline;
* ``1 worker``: the worker-group path with one rank (Ray and FSDP2 overheads, no parallelism);
* ``2 workers``: two ranks, each with half of every batch.

Prints the median step time and tokens/s (prompt + response tokens per second of a step) of each,
and the speed-up and parallel efficiency (speed-up / workers) of 2 workers over 1 worker and over
1 process. On a shared or 2-core machine the figures move with whatever else runs there.

    python bench/scaling.py [--iters 3] [--hidden 128 --layers 4] [--batch 8 --n 2 --response 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlhf_core.config import load_config
from rlhf_core.data.synthetic import build_dataset
from rlhf_core.main_ppo import trainer_session
from rlhf_core.models.toy import random_toy_model


def overrides(work: Path, model: Path, args, workers: int) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={work / 'data' / 'train.parquet'}",
        f"data.val_files={work / 'data' / 'test.parquet'}", f"data.train_batch_size={args.batch}",
        "data.max_prompt_length=320", f"data.max_response_length={args.response}",
        f"actor_rollout_ref.rollout.n={args.n}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.batch * args.n // 2}",
        f"critic.ppo_micro_batch_size_per_gpu={args.batch * args.n // 2}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.batch * args.n // 2}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={args.batch * args.n // 2}",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "critic.model.enable_gradient_checkpointing=false", "actor_rollout_ref.actor.optim.lr=1e-4",
        "critic.optim.lr=1e-4", f"trainer.n_gpus_per_node={workers}", "trainer.device=cpu",
        "trainer.val_before_train=false", "trainer.logger=[]", f"trainer.default_local_dir={work / 'out'}",
    ]


def measure(work: Path, model: Path, args, workers: int, group: bool) -> dict[str, float]:
    """Median step seconds and tokens/s over ``args.iters`` steps on one fixed batch, after warm-up."""
    with trainer_session(load_config(overrides(work, model, args, workers)), use_worker_group=group) as trainer:
        prompts = trainer.train_dataset.collate(list(range(args.batch)))
        timed = [trainer.train_step(prompts) for _ in range(args.warmup + args.iters)][args.warmup:]

        def median(value) -> float:
            return statistics.median(value(metrics) for metrics in timed)

        return {"step_s": median(lambda m: m["timing_s/step"]),
                "tokens_per_s": median(lambda m: m["perf/total_num_tokens"] / m["timing_s/step"]),
                "gen_s": median(lambda m: m["timing_s/gen"]), "update_s": median(lambda m: m["timing_s/update_actor"])}


def _matmuls(_: int = 0) -> float:
    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    started = time.perf_counter()
    for _ in range(300):
        a @ a
    return time.perf_counter() - started


def parallel_capacity() -> float:
    """The speed-up two processes can have on this machine now: a fixed single-thread matmul loop in
    one process, then in two at once (2.0 on two idle cores; less when others share them)."""
    import multiprocessing

    _matmuls()  # start-up, as the two processes get below
    alone = _matmuls()
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.map(_matmuls, [0, 0])  # start-up
        together = max(pool.map(_matmuls, [0, 0]))
    return 2 * alone / together


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="prompts per step")
    parser.add_argument("--n", type=int, default=2, help="responses per prompt")
    parser.add_argument("--response", type=int, default=16, help="max response tokens")
    args = parser.parse_args()
    torch.set_num_threads(1)  # every worker gets one thread; so does the baseline
    work = Path(tempfile.mkdtemp(prefix="scaling_"))
    model = random_toy_model(work / "model", n_layers=args.layers, hidden_size=args.hidden,
                             max_position_embeddings=512, seed=0)
    build_dataset(work / "data", n_train=max(64, args.batch), n_test=4, seed=0, max_ops=1)

    capacity = parallel_capacity()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    started = time.perf_counter()
    rows = {
        "1 process": measure(work, model, args, 1, group=False),
        "1 worker": measure(work, model, args, 1, group=True),
        "2 workers": measure(work, model, args, 2, group=True),
    }
    ray.shutdown()
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model).parameters())
    print(f"model: {params / 1e6:.2f}M parameters ({args.layers} layers, hidden {args.hidden}); batch {args.batch} "
          f"prompts x {args.n} responses <= {args.response} tokens; median of {args.iters} steps after "
          f"{args.warmup} warm-up; 1 torch thread per worker; {time.perf_counter() - started:.0f} s in all")
    print(f"{'':<11}{'step s':>9}{'tokens/s':>10}{'gen s':>8}{'actor s':>9}")
    for name, row in rows.items():
        print(f"{name:<11}{row['step_s']:>9.2f}{row['tokens_per_s']:>10.0f}{row['gen_s']:>8.2f}{row['update_s']:>9.2f}")
    print(f"machine: two processes of a fixed matmul loop run {capacity:.2f}x as fast as one (2.00 on two idle "
          "cores): the ceiling for 2 workers here")
    two = rows["2 workers"]["step_s"]
    for base in ("1 worker", "1 process"):
        speedup = rows[base]["step_s"] / two
        print(f"2 workers vs {base}: speed-up {speedup:.2f}x, efficiency {speedup / 2:.0%}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
