"""``python -m rlhf_core.config`` (``rlhf config``): print the resolved PPO config tree, or the commented
defaults (``--defaults``, the source of configs/ppo_trainer.yaml).

Exit codes: 0 printed; 2 the config has errors (each on stderr).
"""

from __future__ import annotations

import argparse
import sys

from rlhf_core.cli import CONFIG_HELP, program, refuse_hydra_options
from rlhf_core.config import ConfigError, defaults_yaml, load_config


def config(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=program("python -m rlhf_core.config"), description="Print the resolved PPO config tree as YAML."
    )
    parser.add_argument("--config", action="append", metavar="FILE", help=CONFIG_HELP)
    parser.add_argument("--defaults", action="store_true", help="print the commented default tree and exit")
    parser.add_argument("overrides", nargs="*", help="overrides in Hydra's syntax (key=value, +key=value, ~key), "
                        "e.g. data.train_batch_size=64 trainer.logger='[console,file]'")
    refuse_hydra_options(parser, argv)
    args = parser.parse_intermixed_args(argv)  # overrides on both sides of --config
    if args.defaults:
        if args.overrides or args.config:  # (they would be ignored: the commented tree is the defaults alone)
            parser.error("--defaults prints the defaults alone: drop --config and the overrides, or drop --defaults "
                         "to print the config they resolve to")
        sys.stdout.write(defaults_yaml())
        return 0
    return print_resolved(args.overrides, args.config)


def print_resolved(overrides: list[str], config_files: list[str] | None) -> int:
    """Print the config that ``config_files`` and ``overrides`` resolve to (exit status 0), or its errors, each
    said (2): what ``rlhf config`` and a training command's ``--cfg job`` print."""
    try:
        cfg = load_config(overrides, config_file=config_files)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    sys.stdout.write(cfg.to_yaml())
    return 0
