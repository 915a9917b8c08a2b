"""A long run stays steady: what a PPO run holds (memory, open files, threads, disk) as its steps add up.

Runs the demo model's PPO in this process for ``--steps`` steps (small batches, validation and a checkpoint every
``--every`` steps, two checkpoints kept) and reads after each step: the resident memory (``VmRSS``), the memory
still in use (the resident memory after ``malloc_trim(0)`` hands glibc's freed pages back), the open file
descriptors, the threads, the bytes under the run's folder and its ``global_step_N`` folders. Prints them at a few
steps and each one's slope (a least-squares line over the steps after ``--from``), in MB or units a step.

    python bench/steady.py [--steps 60] [--every 10] [--from 10] [overrides ...]
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=8 LRU_CACHE_CAPACITY=8 python bench/steady.py    # oneDNN's caches capped
"""

from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
from pathlib import Path

from rlhf_core.config import load_config
from rlhf_core.main_ppo import run
from rlhf_core.training import trainer as trainer_module

REPO = Path(__file__).resolve().parents[1]
#: the demo's config at 8 prompts x 2 responses a step (a step of about a second), validating 64 prompts
SMALL = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "critic.ppo_micro_batch_size_per_gpu=16",
         "data.val_max_samples=64", "trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=2",
         "trainer.logger=[file]"]


def status(field: str) -> int:
    """A number of ``/proc/self/status`` (``VmRSS`` in kB, ``Threads``: the process's, OpenMP's among them)."""
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) for line in lines if line.startswith(f"{field}:"))


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) if folder.exists() else 0


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ys against xs."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10, help="validation and a checkpoint every this many steps")
    parser.add_argument("--from", dest="start", type=int, default=10, help="the slopes' first step (after warm-up)")
    parser.add_argument("overrides", nargs="*", help="trainer key=value overrides")
    args = parser.parse_args()
    libc = ctypes.CDLL("libc.so.6")
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="steady-") as folder:
        local = Path(folder)
        cfg = load_config([*SMALL, f"trainer.total_training_steps={args.steps}", f"trainer.test_freq={args.every}",
                           f"trainer.save_freq={args.every}", f"trainer.default_local_dir={local}",
                           *args.overrides], config_file=[str(REPO / "configs" / "ppo_demo_cpu.yaml")])
        step_once = trainer_module.PPOTrainer.fit_step

        def measured_step(trainer, *step_args, **step_kwargs):
            result = step_once(trainer, *step_args, **step_kwargs)
            resident = status("VmRSS")
            libc.malloc_trim(0)
            rows.append({"step": trainer.global_step, "rss_mb": resident / 1024, "in_use_mb": status("VmRSS") / 1024,
                         "fds": len(os.listdir("/proc/self/fd")), "threads": status("Threads"),
                         "disk_mb": folder_bytes(local) / 2**20,
                         "checkpoints": sum(1 for path in local.glob("global_step_*") if path.is_dir())})
            return result

        trainer_module.PPOTrainer.fit_step = measured_step
        try:
            run(cfg)
        finally:
            trainer_module.PPOTrainer.fit_step = step_once
    columns = ("rss_mb", "in_use_mb", "fds", "threads", "disk_mb", "checkpoints")
    print(f"{'step':>5} " + " ".join(f"{name:>11}" for name in columns))
    shown = {1, args.start, args.steps // 2, args.steps}
    for row in rows:
        if row["step"] in shown:
            print(f"{row['step']:>5} " + " ".join(f"{row[name]:>11.1f}" for name in columns))
    tail = [row for row in rows if row["step"] >= args.start]
    if len(tail) >= 2:
        steps = [row["step"] for row in tail]
        print(f"slope over steps {steps[0]}-{steps[-1]} (a step): " +
              ", ".join(f"{name} {slope(steps, [row[name] for row in tail]):+.3f}" for name in columns))


if __name__ == "__main__":
    main()
