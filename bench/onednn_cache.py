"""What capping oneDNN's kernel caches costs in speed: the same PPO steps with the caches as they come and capped.

oneDNN keeps the kernel it builds for each new shape in its own primitive cache and in ideep's (1,024 entries
each), so the memory in use climbs over a run's first hundred or so steps (``bench/steady.py``);
``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` and ``LRU_CACHE_CAPACITY`` cap them, at the price of kernels built again when
a shape comes back. Both are read when torch loads, so each setting runs in a fresh process: the demo's PPO at
8 prompts x 2 responses a step (steady.py's config, no validation and no checkpoint but the last), ``--steps``
steps, with the two variables unset and then set to each of ``--capacities`` (both to the same value), the
settings taking turns for ``--rounds`` rounds (each round starting one setting further on) so that other work on
the machine falls on all of them alike.

Each run prints the load average when it started and ended, its median seconds a step after ``--from`` warm-up
steps in wall-clock time and in the process's CPU time (which other work on the machine moves less), and the
slope of the memory in use (resident after ``malloc_trim(0)``, as steady.py reads it) in MB a step. The trim
hands the kept heap back, so it is done every ``--every`` steps only and the step after each is left out of the
times. The summary gives each setting's median of its runs and, for the capped ones, the ratio to the uncapped
run of the same round (median and range over the rounds).

    python bench/onednn_cache.py [--capacities 8,64] [--rounds 3] [--steps 40] [--from 5] [--every 5]
                                 [--model demo] [overrides ...]

``--model random25m`` runs a random-weight model of about 25M parameters (hidden 512 x 6 layers, as
``bench/roofline.py``'s) on the demo's data instead of the 0.54M demo model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from steady import SMALL, slope, status  # bench/steady.py, beside this script

REPO = Path(__file__).resolve().parents[1]
VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def one_run(args) -> dict:
    """The PPO steps in this process: each step's seconds and the memory in use every ``args.every`` steps."""
    import ctypes

    from rlhf_core.config import load_config
    from rlhf_core.main_ppo import run
    from rlhf_core.training import trainer as trainer_module

    libc = ctypes.CDLL("libc.so.6")
    seconds: dict[int, float] = {}
    cpu_seconds: dict[int, float] = {}
    in_use_mb: dict[int, float] = {}
    after_trim: set[int] = set()
    with tempfile.TemporaryDirectory(prefix="onednn_cache-") as folder:
        model = [f"actor_rollout_ref.model.path={args.model_path}"] if args.model_path else []
        cfg = load_config([*SMALL, *model, f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1",
                           "trainer.val_before_train=false", "trainer.save_freq=-1",
                           f"trainer.default_local_dir={folder}", *args.overrides],
                          config_file=[str(REPO / "configs" / "ppo_demo_cpu.yaml")])
        step_once = trainer_module.PPOTrainer.fit_step

        def timed_step(trainer, *step_args, **step_kwargs):
            start, cpu_start = time.perf_counter(), time.process_time()
            result = step_once(trainer, *step_args, **step_kwargs)
            seconds[trainer.global_step] = time.perf_counter() - start
            cpu_seconds[trainer.global_step] = time.process_time() - cpu_start
            if trainer.global_step % args.every == 0:
                libc.malloc_trim(0)
                in_use_mb[trainer.global_step] = status("VmRSS") / 1024
                after_trim.add(trainer.global_step + 1)
            return result

        trainer_module.PPOTrainer.fit_step = timed_step
        try:
            run(cfg)
        finally:
            trainer_module.PPOTrainer.fit_step = step_once
    timed = [step for step in sorted(seconds) if step > args.start and step not in after_trim]
    kept = sorted(step for step in in_use_mb if step >= args.start)
    return {"median_s": statistics.median(seconds[step] for step in timed),
            "min_s": min(seconds[step] for step in timed), "max_s": max(seconds[step] for step in timed),
            "cpu_s": statistics.median(cpu_seconds[step] for step in timed), "timed_steps": len(timed),
            "in_use_slope": slope(kept, [in_use_mb[step] for step in kept]) if len(kept) >= 2 else float("nan"),
            "in_use_first": in_use_mb[kept[0]] if kept else float("nan"),
            "in_use_last": in_use_mb[kept[-1]] if kept else float("nan")}


def fresh_run(capacity: int | None, args, model_path: str) -> dict:
    """One run in a new process with oneDNN's two caches at ``capacity`` entries (None: the variables unset)."""
    env = dict(os.environ)
    for name in VARIABLES:
        env.pop(name, None)
        if capacity is not None:
            env[name] = str(capacity)
    command = [sys.executable, __file__, "--one", "--steps", str(args.steps), "--from", str(args.start),
               "--every", str(args.every), "--model-path", model_path, *args.overrides]
    load_before = os.getloadavg()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the run with {label(capacity)} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["load"] = (load_before[0], os.getloadavg()[0])
    return result


def label(capacity: int | None) -> str:
    return "unset" if capacity is None else f"capped {capacity}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacities", default="8,64", help="comma list: each a run with both variables at it")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each setting, the settings taking turns")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--from", dest="start", type=int, default=5,
                        help="warm-up steps: the times and slopes count the steps after it")
    parser.add_argument("--every", type=int, default=5, help="read the memory in use (malloc_trim) every this many "
                                                             "steps; the step after each is not timed")
    parser.add_argument("--model", default="demo", choices=["demo", "random25m"])
    parser.add_argument("--model-path", default="", help=argparse.SUPPRESS)  # the child's model directory
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # one run, in a child process
    parser.add_argument("overrides", nargs="*", help="trainer key=value overrides")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args)))
        return
    if args.every < 2:
        parser.error(f"--every ({args.every}) must be 2 or more: the step after each memory read is not timed")
    if args.steps < args.start + 2:
        parser.error(f"--steps ({args.steps}) must be at least --from + 2 ({args.start + 2}) to leave a step to time")
    capacities: list[int | None] = [None, *(int(value) for value in args.capacities.split(",") if value)]
    with tempfile.TemporaryDirectory(prefix="onednn_cache-") as work:
        model_path = ""
        if args.model == "random25m":
            from rlhf_core.models.toy import random_toy_model

            model_path = str(random_toy_model(Path(work) / "random25m", n_layers=6, hidden_size=512, seed=0))
        print(f"{args.model}, {args.steps} steps a run, times and slopes after step {args.start}, "
              f"memory read every {args.every} steps", flush=True)
        runs: dict[int | None, list[dict]] = {capacity: [] for capacity in capacities}
        for round_ in range(args.rounds):
            turn = round_ % len(capacities)  # each round starts one setting further on: none always runs first
            for capacity in capacities[turn:] + capacities[:turn]:
                result = fresh_run(capacity, args, model_path)
                runs[capacity].append(result)
                print(f"round {round_ + 1} {label(capacity):<13} load {result['load'][0]:.2f} -> "
                      f"{result['load'][1]:.2f}  s/step median {result['median_s']:.3f} "
                      f"({result['min_s']:.3f}-{result['max_s']:.3f}, {result['timed_steps']} steps), CPU "
                      f"{result['cpu_s']:.3f}  in use {result['in_use_first']:.0f} -> {result['in_use_last']:.0f} MB, "
                      f"{result['in_use_slope']:+.2f} MB a step", flush=True)
    print(f"\n{'setting':<13}{'measure':<8}{'median':>8}{'runs':>15}{'x unset':>9}{'rounds':>15}{'lower in':>9}")
    for capacity, results in runs.items():
        for measure, key in (("s/step", "median_s"), ("CPU s", "cpu_s"), ("MB/step", "in_use_slope")):
            values = [result[key] for result in results]
            line = f"{label(capacity):<13}{measure:<8}{statistics.median(values):>8.3f}{range_of(values):>15}"
            if capacity is not None and key != "in_use_slope":
                base = [result[key] for result in runs[None]]
                ratios = [mine / theirs for mine, theirs in zip(values, base)]
                lower = sum(mine < theirs for mine, theirs in zip(values, base))
                line += f"{statistics.median(ratios):>9.3f}{range_of(ratios):>15}{f'{lower}/{len(values)}':>9}"
            print(line)
    print("s/step and CPU s: the median over the runs of each run's median step, in seconds of wall clock and of the "
          "process's CPU time; MB/step: the memory in use's slope; runs: their range; x unset: each run's figure "
          "over the unset run's of the same round (median, then range); lower in: rounds in which the capped run's "
          "figure was below the unset one's")


def range_of(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"

if __name__ == "__main__":
    main()
