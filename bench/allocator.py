"""Which C allocator the trainer should run under: glibc's malloc against a preloaded jemalloc or tcmalloc.

glibc hands blocks above its mmap threshold back to the kernel when they are freed, so each new
activation or gradient of that size is faulted in page by page; a caching allocator keeps them, and so does
glibc under the trainer's ``trainer.keep_freed_memory`` (on by default: ``default`` here).
``glibc-defaults`` is glibc as it comes (that key off).
The allocator is chosen when the process starts (``LD_PRELOAD``), so each is measured in its own
process: ``bench/roofline.py`` is run once per allocator per round, the allocators alternating,
and each phase's median seconds are compared with the default's of the same round.

    python bench/allocator.py [--models smollm2] [--rounds 2] [--iters 2] [--allocators default,glibc-defaults,tcmalloc]

jemalloc and tcmalloc are Debian's ``libjemalloc2`` and ``libtcmalloc-minimal4``; an allocator
whose library is not installed is left out with a note. ``jemalloc-keep`` is jemalloc told to keep
freed pages (``MALLOC_CONF``, as Intel's PyTorch CPU guide sets it). To run the trainer under one:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 python -m rlhf_core.main_ppo ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIBRARY_DIRS = ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"]
LIBRARIES = {"jemalloc": ["libjemalloc.so.2"], "tcmalloc": ["libtcmalloc_minimal.so.4", "libtcmalloc.so.4"]}
# jemalloc with freed pages kept (no decay back to the kernel) and every size served from its arenas,
# the settings Intel's PyTorch CPU tuning guide gives
JEMALLOC_KEEP = ("oversize_threshold:1,background_thread:true,metadata_thp:auto,"
                 "dirty_decay_ms:9000000000,muzzy_decay_ms:9000000000")
VARIANTS = {"jemalloc": ("jemalloc", None), "jemalloc-keep": ("jemalloc", JEMALLOC_KEEP), "tcmalloc": ("tcmalloc", None)}
PHASES = ["step", "gen", "update_actor", "update_critic", "values", "ref", "old_log_prob"]


def find_library(name: str) -> str | None:
    for folder in LIBRARY_DIRS:
        for file in LIBRARIES[name]:
            if (Path(folder) / file).is_file():
                return str(Path(folder) / file)
    return None


def run_roofline(preload: tuple[str, str | None] | None, args, out: Path, overrides: list[str]) -> list[dict]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.pop("MALLOC_CONF", None)
    if preload:
        env["LD_PRELOAD"] = preload[0]
        if preload[1]:
            env["MALLOC_CONF"] = preload[1]
    command = [sys.executable, str(HERE / "roofline.py"), "--models", args.models, "--iters", str(args.iters),
               "--threads", str(args.threads), "--json", str(out), *overrides]
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2", help="as bench/roofline.py's --models")
    parser.add_argument("--rounds", type=int, default=2, help="times each allocator is run, alternating")
    parser.add_argument("--iters", type=int, default=2, help="timed trainer steps per run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--allocators", default="default,glibc-defaults,jemalloc,jemalloc-keep,tcmalloc")
    args = parser.parse_args()
    allocators = {}  # name -> (preload, the trainer's overrides)
    for name in args.allocators.split(","):
        if name == "default":
            allocators[name] = (None, [])
        elif name == "glibc-defaults":  # glibc as it comes
            allocators[name] = (None, ["trainer.keep_freed_memory=false"])
        elif name in VARIANTS:
            library, conf = VARIANTS[name]
            path = find_library(library)
            if path is None:
                print(f"{name}: left out, none of {LIBRARIES[library]} under {LIBRARY_DIRS}")
                continue
            allocators[name] = ((path, conf), [])
        else:
            parser.error(f"unknown allocator {name!r}: use default, glibc-defaults, {', '.join(VARIANTS)}")
    if "default" not in allocators:
        parser.error("the default allocator is the baseline: keep it in --allocators")
    work = Path(tempfile.mkdtemp(prefix="allocator_"))
    results: dict[str, list[list[dict]]] = {name: [] for name in allocators}  # allocator -> rounds -> rows
    for round_ in range(args.rounds):
        for name, (preload, overrides) in allocators.items():
            rows = run_roofline(preload, args, work / f"{name}_{round_}.json", overrides)
            results[name].append(rows)
            for row in rows:
                print(f"round {round_ + 1} {name:<15} {row['model']:<10} "
                      + " ".join(f"{p} {row['phases'][p]:.2f}" for p in PHASES if p in row["phases"]), flush=True)

    print(f"\n{'model':<10}{'allocator':<16}{'phase':<14}{'median s':>9}{'x default':>10}{'faster in':>10}")
    for index, model_row in enumerate(results["default"][0]):
        for phase in PHASES:
            if phase not in model_row["phases"]:
                continue
            base = [rounds[index]["phases"][phase] for rounds in results["default"]]
            if not statistics.median(base):  # a phase the step skipped (0 s): nothing to compare
                continue
            for name in allocators:
                mine = [rounds[index]["phases"][phase] for rounds in results[name]]
                wins = sum(m < b for m, b in zip(mine, base))
                print(f"{model_row['model']:<10}{name:<16}{phase:<14}{statistics.median(mine):>9.2f}"
                      f"{statistics.median(mine) / statistics.median(base):>10.2f}"
                      f"{'' if name == 'default' else f'{wins}/{len(mine)}':>10}")
    print("x default: median seconds over the default allocator's; faster in: rounds in which this allocator's "
          "run beat the default's run of the same round")


if __name__ == "__main__":
    main()
