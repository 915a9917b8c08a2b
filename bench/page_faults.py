"""Page faults and kernel time of the PPO updates: how much of an update the kernel spends backing fresh tensors.

Builds the trainer as ``bench/roofline.py`` does (same model, batch and settings), runs ``--warmup`` steps,
then ``--iters`` steps with ``getrusage`` read around each worker's update: minor page faults, user and
kernel (system) CPU seconds, wall seconds. Each line is one update of one step; the step's phases follow.

The C allocator is the process's: compare allocators by running this under each, e.g.

    python bench/page_faults.py --models smollm2                                  # glibc, heap kept (the default)
    python bench/page_faults.py --models smollm2 trainer.keep_freed_memory=false  # glibc as it comes
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 python bench/page_faults.py --models smollm2

``--keep-grads`` zeroes gradients in place between steps instead of freeing them (``set_to_none=False``), to
see whether allocating them again is what faults.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import torch
from fused_head import rss_gb  # bench/fused_head.py, beside this script
from roofline import available_models, trainer_config  # bench/roofline.py, beside this script

from rlhf_core.data.synthetic import build_dataset
from rlhf_core.main_ppo import build_trainer

UPDATES = {"actor": "update_policy", "critic": "update_critic"}


def counted(method, role: str, lines: list[str]):
    """``method`` with the process's faults, CPU seconds and resident memory after its call appended to ``lines``."""
    def wrapper(*args, **kwargs):
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        out = method(*args, **kwargs)
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - start
        lines.append(f"{role:<7}{after.ru_minflt - before.ru_minflt:>12,}{after.ru_majflt - before.ru_majflt:>8}"
                     f"{after.ru_utime - before.ru_utime:>9.2f}{after.ru_stime - before.ru_stime:>9.2f}{wall:>9.2f}"
                     f"{rss_gb():>9.2f}")
        return out
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2", help="as bench/roofline.py's --models")
    parser.add_argument("--iters", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep-grads", action="store_true", help="zero gradients in place rather than free them")
    parser.add_argument("overrides", nargs="*", help="trainer key=value overrides")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.keep_grads:
        zero_grad = torch.optim.Optimizer.zero_grad
        torch.optim.Optimizer.zero_grad = lambda self, set_to_none=True: zero_grad(self, set_to_none=False)
    work = Path(tempfile.mkdtemp(prefix="page_faults_"))
    build_dataset(work / "data", n_train=64, n_test=8, seed=0, max_ops=1)
    for name, model in available_models(args.models, work):
        cfg = trainer_config(name, model, work, args)
        trainer = build_trainer(cfg)
        try:
            prompts = trainer.train_dataset.collate(list(range(cfg.data.train_batch_size)))
            for _ in range(args.warmup):
                trainer.train_step(prompts)
            lines: list[str] = []
            for role, method in UPDATES.items():
                worker = getattr(trainer, role)
                setattr(worker, method, counted(getattr(worker, method), role, lines))
            for step in range(args.iters):
                metrics = trainer.train_step(prompts)
                phases = {k.removeprefix("timing_s/"): v for k, v in metrics.items() if k.startswith("timing_s/")}
                print(f"\n{name}, step {step + 1} after {args.warmup} warm-up"
                      f"{', gradients kept' if args.keep_grads else ''}:")
                print(f"{'update':<7}{'minor faults':>12}{'major':>8}{'user s':>9}{'system s':>9}{'wall s':>9}{'RSS GB':>9}")
                print("\n".join(lines))
                print("phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()), flush=True)
                lines.clear()
        finally:
            trainer.close()
    print("\nuser/system s: CPU seconds of all the process's threads over the update (2 threads: up to twice the "
          "wall time); minor faults: pages the kernel backed on first touch; RSS GB: the process's resident memory after the update")


if __name__ == "__main__":
    main()
