"""The data commands: GSM8K and synthetic prompt files, preference pairs, and their validation.

    rlhf gsm8k --input IN --output OUT                 # python -m rlhf_core.data.gsm8k
    rlhf synthetic --output OUT --n-train N --n-test M # python -m rlhf_core.data.synthetic
    rlhf preference --synthetic --output DIR           # python -m rlhf_core.data.preference
    rlhf validate TRAIN.parquet... [--val VAL.parquet...]  # python -m rlhf_core.data.validation

Each library module's docstring gives its command's options and exit codes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from rlhf_core.cli import chat_template_kwargs, importing, program
from rlhf_core.data.options import GSM8K_LAYOUTS, SYNTHETIC_DEFAULTS, TEST_SET_WARNING  # (imports nothing)

# ----------------------------------------------------------------------------- prompt data


def _os_problem(exc: OSError, output: str) -> str:
    """An OSError as one line: the path and the reason, and where it is ``output`` or in it (a folder that
    cannot be made or written), what to do. (Called once the command has imported its library, pandas.)"""
    from rlhf_core.data.validation import one_line

    if exc.filename is None:
        return one_line(str(exc))
    # (a file where the folder goes: the folder's mkdir said only "File exists")
    reason = "a file, not a folder" if isinstance(exc, FileExistsError) and os.path.isfile(exc.filename) else None
    said = f"{exc.filename}: {reason or exc.strerror or exc}"
    within = Path(os.path.abspath(exc.filename)).is_relative_to(os.path.abspath(output))
    return f"{said}; give an --output folder this user may write" if within else said


def gsm8k(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=program("python -m rlhf_core.data.gsm8k"),
        description="Convert GSM8K (jsonl or parquet layout) into verl-style train.parquet and test.parquet.",
    )
    # verl's examples/data_preprocess/gsm8k.py names the two folders --local_dataset_path and --local_save_dir
    # (--local_dir before it): a command written for it runs here as it is
    parser.add_argument(
        "--input", "--local_dataset_path", dest="input", required=True,
        help="folder with train.jsonl/test.jsonl or [main/]train-*.parquet (a download of openai/gsm8k; nothing is "
             "downloaded here)",
    )
    parser.add_argument("--output", "--local_save_dir", "--local_dir", dest="output", default="~/data/gsm8k",
                        type=os.path.expanduser,
                        help="folder to write train.parquet and test.parquet into (default: ~/data/gsm8k, verl's, "
                             "where data.train_files' default looks)")
    parser.add_argument("--hdfs_dir", help=argparse.SUPPRESS)
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files")
    parser.add_argument(
        "--skip-invalid",
        action="store_true",
        help="leave out rows whose answer has no '####' (and say how many)",
    )
    parser.add_argument(
        "--layout",
        choices=GSM8K_LAYOUTS,
        default="auto",
        help="input layout; auto prefers jsonl when both are present",
    )
    parser.add_argument("--max-rows", type=int, default=None,
                        help="keep the first N rows of each split (a small training or evaluation set)")
    args = parser.parse_args(argv)
    if args.max_rows is not None and args.max_rows < 1:
        parser.error("--max-rows must be at least 1")
    if args.hdfs_dir is not None:
        parser.error("--hdfs_dir (verl's copy of the output to HDFS) is not done here: copy the --output folder "
                     "there yourself")
    with importing():
        from rlhf_core.data.gsm8k import MAX_REPORTED, SPLITS, GSM8KDataError, preprocess_gsm8k

    try:
        summary = preprocess_gsm8k(args.input, args.output, args.overwrite, args.skip_invalid, args.layout,
                                   args.max_rows)
    except OSError as exc:  # an output folder that cannot be written (read-only, a file in its path)
        print(f"error: {_os_problem(exc, args.output)}", file=sys.stderr)
        return 2
    except GSM8KDataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name in SPLITS:
        info = summary[name]
        for description in info["skipped_rows"][:MAX_REPORTED]:
            print(f"skipped {description}", file=sys.stderr)
        skipped = f", skipped {info['skipped']} invalid row(s)" if args.skip_invalid else ""
        print(f"{name}: {info['rows']} rows -> {info['output']} (from {summary['layout']} input{skipped})")
    return 0


def synthetic(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=program("python -m rlhf_core.data.synthetic"),
        description="Write synthetic GSM8K-style arithmetic problems as verl-style train/test parquet files. "
                    "The defaults give problems of up to 3 operations; the demo model's task (configs/ppo_demo_cpu.yaml,"
                    " whose prompt and response budgets it fits) is --max-ops 1 --max-operand 12.",
    )
    parser.add_argument("--output", required=True, type=os.path.expanduser,
                        help="folder to write train.parquet and test.parquet into")
    parser.add_argument("--n-train", type=int, required=True, help="number of training problems")
    parser.add_argument("--n-test", type=int, required=True, help="number of test problems")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--min-ops", type=int, default=SYNTHETIC_DEFAULTS["min_ops"], help="fewest operations (default %(default)s)"
    )
    parser.add_argument(
        "--max-ops", type=int, default=SYNTHETIC_DEFAULTS["max_ops"], help="most operations (default %(default)s)"
    )
    parser.add_argument(
        "--min-operand", type=int, default=SYNTHETIC_DEFAULTS["min_operand"], help="smallest operand (default %(default)s)"
    )
    parser.add_argument(
        "--max-operand", type=int, default=SYNTHETIC_DEFAULTS["max_operand"], help="largest operand (default %(default)s)"
    )
    parser.add_argument(
        "--max-value",
        type=int,
        default=SYNTHETIC_DEFAULTS["max_value"],
        help="largest intermediate amount (default %(default)s; 0 for no limit)",
    )
    parser.add_argument(
        "--operations", default="".join(SYNTHETIC_DEFAULTS["operations"]),
        help="operations to use, e.g. '+-' (default '%(default)s')",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files")
    args = parser.parse_args(argv)
    options = {
        "min_ops": args.min_ops,
        "max_ops": args.max_ops,
        "min_operand": args.min_operand,
        "max_operand": args.max_operand,
        "max_value": args.max_value or None,
        "operations": tuple(args.operations.replace(",", "").replace(" ", "")),
    }
    for name in ("n_train", "n_test"):  # an empty split is refused by the validation and the trainer
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    with importing():
        from rlhf_core.data.synthetic import build_dataset, validate_options

    try:
        validate_options(**options)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        paths = build_dataset(args.output, args.n_train, args.n_test, args.seed, args.overwrite, **options)
    except OSError as exc:
        print(f"error: {_os_problem(exc, args.output)}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"train: {args.n_train} rows -> {paths['train']}")
    print(f"test: {args.n_test} rows -> {paths['test']}")
    return 0


# ----------------------------------------------------------------------------- preference pairs


def _off_excluded(pairs: list[dict], apart: set[str], excluded: str, source: str, unit: str) -> list[dict]:
    """The pairs on no question of ``--exclude``, after a line saying how many it took (over how many of ``unit``);
    PreferenceDataError where it takes every pair of ``source``. (Called once the command has imported its
    library.)"""
    from rlhf_core.data.preference import PreferenceDataError, drop_questions

    pairs, dropped = drop_questions(pairs, apart)
    print(f"excluded: {len(dropped)} pair(s) over {len({p['group'] for p in dropped})} {unit}(s) of {excluded}")
    if not pairs:
        raise PreferenceDataError(f"every pair of {source} is on a question of --exclude ({excluded}): no pair is left")
    return pairs


def preference(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=program("python -m rlhf_core.data.preference"),
        description="Write preference pairs (prompt, chosen, rejected) as train/val parquet files, split by "
                    "question.",
        epilog=TEST_SET_WARNING,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gsm8k-solutions", metavar="FILE",
                        help="example_model_solutions.jsonl of the GSM8K release (GSM8K test questions)")
    source.add_argument("--synthetic", action="store_true",
                        help="pairs on the demo task: the right final answer vs the demo model's slip")
    source.add_argument("--trl", nargs="+", metavar="FILE",
                        help="TRL preference file(s), parquet or JSON lines: chosen and rejected as text or chat "
                             "messages, with a prompt column or without one (conversations: the messages both begin "
                             "with are the prompt)")
    parser.add_argument("--output", required=True, type=os.path.expanduser,
                        help="folder to write train.parquet and val.parquet into")
    # None = not given: each source refuses the other's options instead of ignoring them
    parser.add_argument("--val-fraction", type=float, default=None,
                        help="GSM8K and TRL: share of questions (prompts) held out for validation (default 0.2)")
    parser.add_argument("--data-source", default=None,
                        help="TRL: the pairs' data_source (default: the first file's name without its suffix)")
    parser.add_argument("--n-train", type=int, default=None, help="synthetic: training questions (default 2000)")
    parser.add_argument("--n-val", type=int, default=None, help="synthetic: validation questions (default 400)")
    parser.add_argument("--exclude", nargs="+", metavar="PATH", default=[],
                        help="prompt parquet file(s), or folders of them, whose questions no pair may be on (the "
                             "evaluation prompts: a reward model fitted on them leaks them into the PPO reward); "
                             "GSM8K drops such pairs, synthetic draws other questions in their place")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the split or the problems (default 0)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files")
    args = parser.parse_args(argv)
    this = "--synthetic" if args.synthetic else "--trl" if args.trl else "--gsm8k-solutions"
    sources = {"--n-train": ["--synthetic"], "--n-val": ["--synthetic"], "--val-fraction": ["--gsm8k-solutions", "--trl"],
               "--data-source": ["--trl"]}
    given = [option for option, users in sources.items()
             if this not in users and getattr(args, option[2:].replace("-", "_")) is not None]
    if given:
        others = list(dict.fromkeys(user for option in given for user in sources[option]))
        verb, pronoun = ("apply", "them") if len(given) > 1 else ("applies", "it")
        parser.error(f"{' and '.join(given)} only {verb} to {' and '.join(others)}; {this} does not use {pronoun}")
    n_train = 2000 if args.n_train is None else args.n_train
    n_val = 400 if args.n_val is None else args.n_val
    if args.synthetic and (n_train < 1 or n_val < 1):
        parser.error("--n-train and --n-val must be at least 1")
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:  # (before the source is read)
        parser.error(f"--val-fraction must be in (0, 1), got {args.val_fraction:g}")
    with importing():
        from rlhf_core.data.preference import (
            GSM8K_SOURCE,
            PreferenceDataError,
            drop_questions,
            gsm8k_solution_pairs,
            prompt_questions,
            split_by_group,
            synthetic_pairs,
            trl_pairs,
            write_splits,
        )
        from rlhf_core.data.synthetic import DATA_SOURCE

    excluded = " ".join(args.exclude)
    try:
        apart = prompt_questions(args.exclude) if args.exclude else set()
        if args.synthetic:
            if apart:
                # the same seed without --exclude: its pairs on excluded questions are the ones drawn again
                replaced = sum(len(drop_questions(pairs, apart)[1])
                               for pairs in synthetic_pairs(n_train, n_val, args.seed))
                try:
                    train, val = synthetic_pairs(n_train, n_val, args.seed, exclude=apart)
                except ValueError as exc:
                    raise PreferenceDataError(
                        f"the demo task has too few questions outside the prompt data of --exclude ({excluded}) for "
                        f"--n-train {n_train} and --n-val {n_val}: ask for fewer ({exc})") from exc
                print(f"excluded: {replaced} pair(s) on questions of {excluded}, drawn again on other questions")
            else:
                train, val = synthetic_pairs(n_train, n_val, args.seed)
            data_source = DATA_SOURCE
        elif args.trl:
            pairs = []
            for path in args.trl:
                read, identical, repeated, form = trl_pairs(path)
                left_out = "".join(f", {count} left out: {why}" for count, why in (
                    (identical, "chosen and rejected the same"), (repeated, "the same pair as an earlier row")) if count)
                print(f"read: {len(read)} pairs from {path} ({form}{left_out})")
                pairs.extend(read)
            if not pairs:
                raise PreferenceDataError(f"{' '.join(args.trl)} hold(s) no pair whose chosen and rejected differ")
            if apart:
                pairs = _off_excluded(pairs, apart, excluded, " ".join(args.trl), "prompt")
            train, val = split_by_group(pairs, 0.2 if args.val_fraction is None else args.val_fraction, args.seed)
            data_source = args.data_source or Path(args.trl[0]).name.split(".")[0]
        else:
            pairs = gsm8k_solution_pairs(args.gsm8k_solutions)
            if not pairs:
                raise PreferenceDataError(f"{args.gsm8k_solutions} yields no pair: no question has both a correct "
                                          "and an incorrect solution")
            if apart:
                pairs = _off_excluded(pairs, apart, excluded, args.gsm8k_solutions, "question")
            train, val = split_by_group(pairs, 0.2 if args.val_fraction is None else args.val_fraction, args.seed)
            data_source = GSM8K_SOURCE
            print(f"warning: {TEST_SET_WARNING}", file=sys.stderr)
        paths = write_splits(args.output, train, val, data_source, overwrite=args.overwrite)
    except OSError as exc:
        print(f"error: {_os_problem(exc, args.output)}", file=sys.stderr)
        return 2
    except (PreferenceDataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for split, pairs in (("train", train), ("val", val)):
        questions = len({p["group"] for p in pairs})
        print(f"{split}: {len(pairs)} pairs over {questions} {'prompts' if args.trl else 'questions'} -> {paths[split]}")
    return 0


# ----------------------------------------------------------------------------- validation


def _validate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=program("python -m rlhf_core.data.validation"), description="Validate verl "
                                     "prompt or preference parquet files (told by their columns) with GX.")
    parser.add_argument("train", nargs="+", help="training parquet file(s), joined as data.train_files joins them")
    parser.add_argument("--val", nargs="+", help="validation parquet file(s) (also checked for train/val leakage)")
    parser.add_argument("--tokenizer", help="saved tokenizer directory for a length limit in tokens")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the tokenizer code the --tokenizer folder holds (its auto_map), as "
                             "actor_rollout_ref.model.trust_remote_code=true lets training")
    parser.add_argument("--max-prompt-length", type=int, help="prompt data: largest prompt in tokens")
    parser.add_argument("--max-length", type=int, help="preference data: largest prompt + response in tokens")
    parser.add_argument("--max-chars", type=int, help="preference data: largest prompt + response in characters")
    parser.add_argument("--overlong-tolerance", type=float, default=0.0,
                        help="share of rows allowed over the length limit (default 0)")
    parser.add_argument("--custom-reward", action="store_true",
                        help="prompt data scored by a custom reward function (custom_reward_function.path): "
                             "any data_source and any form of ground truth, or none, as the trainer takes it "
                             "(implies --no-ground-truth)")
    parser.add_argument("--no-ground-truth", dest="ground_truth_required", action="store_false",
                        help="prompt data trained without a ground truth: a reward model with "
                             "reward_model.rule_coef=0 (a custom reward function: --custom-reward); rows may leave "
                             "reward_model.ground_truth out and files may lack the reward_model column")
    parser.add_argument("--chat-template-kwargs", type=chat_template_kwargs, default=None, metavar="JSON",
                        help="keywords to the chat template when lengths are measured, as the trainer gets them "
                             "(prompt data: data.apply_chat_template_kwargs; preference data: reward_model.train."
                             "apply_chat_template_kwargs), e.g. '{\"enable_thinking\": false}'")
    parser.add_argument("--prompt-key", default="prompt",
                        help="prompt data: the prompt column, as data.prompt_key names it (default prompt)")
    parser.add_argument("--reward-fn-key", default="data_source",
                        help="prompt data: the column naming each row's reward, as data.reward_fn_key "
                             "(default data_source)")
    parser.add_argument("--html", help="also write GX's HTML report (a Data Docs page) to this file")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of the summary")
    return parser


#: the options the library's errors name, as the user typed them (not as its parameters)
_VALIDATE_OPTIONS = {"tokenizer": "--tokenizer", "max_prompt_length": "--max-prompt-length",
                     "max_length": "--max-length", "max_chars": "--max-chars",
                     "overlong_tolerance": "--overlong-tolerance", "ground_truth_required": "--no-ground-truth"}


def validate(argv: Sequence[str] | None = None) -> int:
    args = _validate_parser().parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    with importing():
        from rlhf_core.data.validation import DataReadError, one_line, validate_dataset

    try:
        report = validate_dataset(args.train, args.val, args.tokenizer, args.max_prompt_length,
                                  max_length=args.max_length, max_chars=args.max_chars,
                                  overlong_tolerance=args.overlong_tolerance, custom_reward=args.custom_reward,
                                  template_kwargs=args.chat_template_kwargs, prompt_key=args.prompt_key,
                                  reward_fn_key=args.reward_fn_key, trust_remote_code=args.trust_remote_code,
                                  # a custom reward gets None where a row has none, as in training
                                  ground_truth_required=args.ground_truth_required and not args.custom_reward,
                                  option_names=_VALIDATE_OPTIONS)
    except DataReadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # an inconsistent limit, or one for the other kind of data
        print(f"error: {', '.join(args.train)}: {one_line(str(exc))}", file=sys.stderr)
        return 2
    if args.html:
        try:
            Path(args.html).write_text(report.to_html(), encoding="utf-8")
        except OSError as exc:
            print(f"error: cannot write {args.html}: {one_line(exc.strerror or str(exc))}", file=sys.stderr)
            return 2
    text = json.dumps(report.to_dict(), indent=2, ensure_ascii=False) if args.json else report.summary()
    try:
        print(text, flush=True)
    except BrokenPipeError:  # e.g. piped into `head`; the exit status still tells the outcome
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if report.success else 1
