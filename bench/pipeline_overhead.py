"""What the ZenML pipeline costs on top of its steps: the demo pipeline's wall time minus its steps' own time.

Runs ``rlhf_ppo_pipeline`` with ``configs/demo_cpu.yaml`` in-process on a throwaway local store
(SQLite, local orchestrator, nothing from the checkout's own ``.zen`` touched), times the whole
call, and reads each step's start and end from the store. Prints per-step durations and

    pipeline overhead: 9.8 s (wall 312.4 s - steps 302.6 s)

The steps' durations as ZenML records them include loading their inputs and saving their
outputs; the overhead is what lies outside every step: compiling and registering the run,
launching each step, the store's bookkeeping between steps, and finishing the run.
Needs the demo assets (``make demo-assets``).

    python bench/pipeline_overhead.py [--steps 10] [--config configs/demo_cpu.yaml]
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "demo_cpu.yaml"))
    parser.add_argument("--steps", type=int, default=None, help="PPO steps (default: the config's)")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="rlhf-zenml-bench-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    os.environ.update({"ZENML_CONFIG_PATH": str(home / "config"), "ZENML_REPOSITORY_PATH": str(home),
                       "ZENML_ANALYTICS_OPT_IN": "false", "ZENML_LOGGING_VERBOSITY": "WARN",
                       "ZENML_AUTO_OPEN_DASHBOARD": "false"})
    os.chdir(REPO)  # the config's data and model paths are relative to the repository

    import yaml
    from zenml.client import Client
    from zenml.utils import source_utils

    from pipelines.rlhf_ppo import rlhf_ppo_pipeline

    source_utils.set_custom_source_root(str(REPO))
    config_path = Path(args.config)
    if args.steps is not None:
        config = yaml.safe_load(config_path.read_text())
        config["parameters"]["overrides"] = [o for o in config["parameters"].get("overrides", [])
                                             if not o.startswith("trainer.total_training_steps=")]
        config["parameters"]["overrides"].append(f"trainer.total_training_steps={args.steps}")
        config_path = home / "run_config.yaml"
        config_path.write_text(yaml.safe_dump(config))
    start = time.perf_counter()
    run = rlhf_ppo_pipeline.with_options(config_path=str(config_path))()
    wall = time.perf_counter() - start
    run = Client().get_pipeline_run(run.id)
    durations = {}
    for name, step in run.steps.items():
        durations[name] = (step.end_time - step.start_time).total_seconds()
    steps_total = sum(durations.values())
    print(f"run {run.name}: {run.status}")
    for name, seconds in sorted(durations.items(), key=lambda kv: run.steps[kv[0]].start_time):
        print(f"  {name:<18}{seconds:8.1f} s")
    model_name = yaml.safe_load(config_path.read_text())["model"]["name"]
    version = Client().get_model_version(model_name, "latest")
    meta = version.run_metadata
    print(f"model {model_name} version {version.number}: promoted={meta.get('promoted')} "
          f"({meta.get('decision_reason')})")
    print(f"pipeline overhead: {wall - steps_total:.1f} s (wall {wall:.1f} s - steps {steps_total:.1f} s)")


if __name__ == "__main__":
    main()
