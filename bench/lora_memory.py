"""Peak memory of a PPO step with and without LoRA, on the same random model (about 20M parameters).

Each variant runs in a fresh process (peak RSS only grows): it builds the trainer (actor,
reference, critic; GAE with a KL loss), runs warm-up steps, and reports the process's peak resident
set size after loading and after the steps. Without LoRA the process holds the actor, a frozen
reference copy, the critic, their gradients and AdamW moments; with LoRA (actor and critic) the
reference is the actor with its adapters off, and gradients and moments exist for the adapters
only. Prints both and their ratio.

    python bench/lora_memory.py [--hidden 512 --layers 6] [--rank 8] [--steps 1]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(args) -> None:
    import torch

    from rlhf_core.config import load_config
    from rlhf_core.main_ppo import trainer_session

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    lora = [f"actor_rollout_ref.model.lora_rank={args.rank}", f"critic.model.lora_rank={args.rank}",
            f"actor_rollout_ref.model.lora_alpha={2 * args.rank}", f"critic.model.lora_alpha={2 * args.rank}"]
    cfg = load_config([
        f"actor_rollout_ref.model.path={work / 'model'}", f"data.train_files={work / 'data' / 'train.parquet'}",
        f"data.val_files={work / 'data' / 'test.parquet'}", "data.train_batch_size=2", "data.max_prompt_length=320",
        "data.max_response_length=16", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "critic.model.enable_gradient_checkpointing=false", "trainer.n_gpus_per_node=1", "trainer.device=cpu",
        "trainer.val_before_train=false", "trainer.logger=[]", f"trainer.default_local_dir={work / 'out'}",
        *(lora if args.variant == "lora" else []),
    ])
    with trainer_session(cfg) as trainer:
        loaded = peak_rss_mib()
        trainable = sum(p.numel() for p in trainer.actor.module.parameters() if p.requires_grad)
        prompts = trainer.train_dataset.collate([0, 1])
        for _ in range(args.steps):
            trainer.train_step(prompts)
        print(json.dumps({"loaded_mib": loaded, "peak_mib": peak_rss_mib(), "actor_trainable": trainable,
                          "state_mib": state_mib(trainer)}))


def state_mib(trainer) -> float:
    """Weights, gradients and optimizer moments the trainer holds between steps (distinct tensors)."""
    tensors = {}
    workers = [trainer.actor] + ([trainer.critic] if trainer.critic is not None else [])
    for worker in workers:
        modules = [worker.module] + ([worker.ref_module] if getattr(worker, "ref_module", None) is not None else [])
        for module in modules:
            for param in module.parameters():
                tensors[param.data_ptr()] = param.nbytes
                if param.grad is not None:
                    tensors[param.grad.data_ptr()] = param.grad.nbytes
        for state in worker.optimizer.state.values():
            for value in state.values():
                if hasattr(value, "nbytes") and value.numel() > 1:
                    tensors[value.data_ptr()] = value.nbytes
    return sum(tensors.values()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variant", choices=["full", "lora"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        child(args)
        return

    from rlhf_core.data.synthetic import build_dataset
    from rlhf_core.models.toy import random_toy_model

    work = Path(tempfile.mkdtemp(prefix="lora_memory_"))
    model = random_toy_model(work / "model", n_layers=args.layers, hidden_size=args.hidden,
                             max_position_embeddings=512, seed=0)
    build_dataset(work / "data", n_train=8, n_test=2, seed=0, max_ops=1)
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model).parameters())
    results = {}
    for variant in ("full", "lora"):
        command = [sys.executable, __file__, "--variant", variant, "--work", str(work), "--rank", str(args.rank),
                   "--steps", str(args.steps), "--threads", str(args.threads)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"model: {params / 1e6:.1f}M parameters ({args.layers} layers, hidden {args.hidden}); PPO (GAE, KL loss) on "
          f"2 prompts x 2 responses <= 16 tokens, {args.steps} step(s); LoRA rank {args.rank} on all linear layers")
    print(f"{'':<6}{'trainable':>12}{'RSS loaded MiB':>16}{'peak RSS MiB':>14}{'state MiB':>11}")
    for variant, row in results.items():
        print(f"{variant:<6}{row['actor_trainable']:>12,}{row['loaded_mib']:>16.0f}{row['peak_mib']:>14.0f}"
              f"{row['state_mib']:>11.0f}")
    full, lora = results["full"]["peak_mib"], results["lora"]["peak_mib"]
    print(f"peak RSS with LoRA / without: {lora / full:.2f} ({abs(full - lora):.0f} MiB "
          f"{'less' if lora <= full else 'more'}); weights + gradients + "
          f"AdamW moments held: {results['lora']['state_mib'] / results['full']['state_mib']:.2f} of full")
    print("(state MiB: actor, reference and critic weights, their gradients and optimizer moments after the step)")


if __name__ == "__main__":
    main()
