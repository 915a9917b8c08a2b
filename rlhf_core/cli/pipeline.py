"""The pipeline commands: evaluate a policy, show a model version's lineage, summarise the demo run,
schedule retraining.

    rlhf evaluate MODEL_DIR VAL.parquet [--html out.html]   # python -m rlhf_core.pipeline.evaluate
    rlhf lineage [--model NAME] [--version N] [--json]      # also rlhf-lineage
    rlhf lineage --version N --reward-source                # the custom reward's files it kept
    rlhf demo-summary [--model NAME]                        # also rlhf-demo-summary
    rlhf schedule --cron "0 3 * * *" -c CONFIG              # also rlhf-schedule

``evaluate`` imports torch when it runs, so the other three start without it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shlex
import signal
import sys
from pathlib import Path

from rlhf_core.cli import chat_template_kwargs, importing, program, unwritable
from rlhf_core.pipeline.lineage import (
    LineageError,
    default_client,
    format_lineage,
    get_version,
    reward_source,
    version_run_id,
)
from rlhf_core.pipeline.lineage import lineage as read_lineage
from rlhf_core.pipeline.promotion import stage_disagreement
from rlhf_core.pipeline.schedule import (
    RETRAIN_PIPELINE,
    ScheduleTerminated,
    crontab_line,
    make_trigger,
    run_pipeline,
    serve,
)

#: what ``evaluate`` generates with where neither an option nor the config of the run that saved MODEL says
EVALUATE_DEFAULTS = {"prompt_key": "prompt", "max_prompt_length": 1024, "max_response_length": 64,
                     "apply_chat_template_kwargs": {}, "truncation": "left"}
FROM_RUN = "where MODEL is a checkpoint, its run's"
#: how the line saying what came from a checkpoint's config names each of its values
EVALUATE_OPTIONS = {"prompt_key": "--prompt-key", "max_prompt_length": "--max-prompt-length",
                    "max_response_length": "--max-response-length",
                    "apply_chat_template_kwargs": "--chat-template-kwargs", "truncation": "truncation"}


def evaluate_names(prog: str, truncation: str = "left") -> dict[str, str]:
    """Training's data keys that the evaluation's notices and errors name, as ``evaluate`` run as ``prog`` says them:
    its own options, or what it does in their place (it cuts a long prompt's start unless a checkpoint's run cut
    another way, ``truncation``, and routes by the data_source column)."""
    return {
        "data.val_files": "val_files",
        "data.max_prompt_length": "--max-prompt-length",
        f"data.truncation={truncation}": "truncation" if truncation == "left" else f"truncation={truncation}",
        "data.prompt_key": "--prompt-key",
        "data.reward_fn_key, which": "the column that",
        "evaluate with a custom reward function":
            "evaluate with a custom reward function (here: --custom-reward FILE.py)",
        "a list: val_files=[a.parquet,b.parquet]": f"several, one after another: {prog} MODEL a.parquet b.parquet",
    }


def evaluate(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=program("python -m rlhf_core.pipeline.evaluate"),
                                     description="Greedy accuracy of a HF model directory on a validation parquet.")
    parser.add_argument("model", help="HF model directory, global_step_N checkpoint or checkpoint root")
    parser.add_argument("val_files", nargs="+", help="validation parquet file(s) of prompts, verl schema")
    # (unset, None: where MODEL is a checkpoint, the value its run trained with stands in for the default)
    parser.add_argument("--prompt-key", help="the column of the prompts, as data.prompt_key (default: "
                                             f"{EVALUATE_DEFAULTS['prompt_key']}; {FROM_RUN} data.prompt_key)")
    parser.add_argument("--max-prompt-length", type=int,
                        help="a longer prompt keeps its last this many tokens (default: "
                             f"{EVALUATE_DEFAULTS['max_prompt_length']}; {FROM_RUN} data.max_prompt_length, "
                             "cut as its data.truncation cuts, where that is left, right or middle)")
    parser.add_argument("--max-response-length", type=int,
                        help="greedy responses are cut at this many tokens (default: "
                             f"{EVALUATE_DEFAULTS['max_response_length']}; {FROM_RUN} data.max_response_length)")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts generated at once (default: %(default)s)")
    parser.add_argument("--max-problems", type=int, help="evaluate a sample of this many, stratified by data source")
    parser.add_argument("--sample-seed", type=int, default=0, help="which problems --max-problems keeps (default: %(default)s)")
    parser.add_argument("--custom-reward", metavar="FILE.py",
                        help="grade with the function of this file (as custom_reward_function.path), not the "
                             "built-in rules by data source; it also grades prompts without a ground truth")
    parser.add_argument("--custom-reward-name", default="compute_score",
                        help="its function's name, as custom_reward_function.name (default: %(default)s)")
    parser.add_argument("--reward-kwarg", action="append", default=[], metavar="KEY=VALUE",
                        help="a keyword argument the function is called with (repeatable), read as training reads "
                             "+custom_reward_function.reward_kwargs.KEY=VALUE")
    parser.add_argument("--reward-manager", choices=("naive", "batch"), default="naive",
                        help="how the function is called, as reward_model.reward_manager: naive, once a response; "
                             "batch, once a batch with lists (data_sources, solution_strs, ground_truths, "
                             "extra_infos), returning one result a response (default: %(default)s)")
    parser.add_argument("--chat-template-kwargs", type=chat_template_kwargs, metavar="JSON",
                        help="the chat template's variables the policy was trained with (data.apply_chat_template_"
                             "kwargs), e.g. '{\"enable_thinking\": false}' (default: none; "
                             f"{FROM_RUN} data.apply_chat_template_kwargs)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the model code the model folder holds (its config.json's auto_map), as "
                             "actor_rollout_ref.model.trust_remote_code=true lets training")
    parser.add_argument("--external-lib", metavar="MODULE",
                        help="import this module first (it registers a custom architecture with transformers), as "
                             "actor_rollout_ref.model.external_lib")
    parser.add_argument("--html", help="write the HTML report here")
    args = parser.parse_args(argv)
    for flag, value in (("--batch-size", args.batch_size), ("--max-problems", args.max_problems),
                        ("--max-prompt-length", args.max_prompt_length),
                        ("--max-response-length", args.max_response_length)):
        if value is not None and value < 1:
            parser.error(f"{flag} {value} must be >= 1")
    if args.sample_seed < 0:
        parser.error(f"--sample-seed {args.sample_seed} must be >= 0")
    if args.reward_kwarg and not args.custom_reward:
        parser.error("--reward-kwarg is given to the function of --custom-reward FILE.py; name that file")
    if args.reward_manager == "batch" and not args.custom_reward:
        parser.error("--reward-manager batch calls the function of --custom-reward FILE.py; name that file")
    for item in args.reward_kwarg:
        key, equals, _ = item.partition("=")
        if not (equals and key.strip().isidentifier()):
            parser.error(f"--reward-kwarg {item!r}: write KEY=VALUE, KEY a Python name (e.g. --reward-kwarg scale=2)")
    with importing():
        from rlhf_core.config import ConfigError, load_config

    try:  # the values read as training reads +custom_reward_function.reward_kwargs.KEY=VALUE
        reward_config = load_config([f"+custom_reward_function.reward_kwargs.{item.strip()}" for item in
                                     args.reward_kwarg], validate=False)
    except ConfigError as exc:
        parser.error(f"--reward-kwarg: {'; '.join(exc.errors)}")
    # the reward keys training reads, so that the reward loads as training loads it (custom_reward_fn)
    reward_config.custom_reward_function.path = args.custom_reward
    reward_config.custom_reward_function.name = args.custom_reward_name
    reward_config.reward_model.reward_manager = args.reward_manager
    if args.html:  # before the evaluation, not after it
        folder = Path(args.html).resolve().parent
        if not folder.is_dir():
            parser.error(f"--html {args.html}: the folder {folder} does not exist")
        if Path(args.html).is_dir():
            parser.error(f"--html {args.html}: a folder; name the file to write")
        if problem := unwritable(folder):
            parser.error(f"--html {args.html}: the folder {folder} cannot be written ({problem})")
    with importing():
        from rlhf_core import stats
        from rlhf_core.config import DataConfig
        from rlhf_core.data.dataset import DataError, check_files, missing_columns_problem, needed_columns
        from rlhf_core.models.loading import ModelError, import_external_lib
        from rlhf_core.pipeline.evaluate import (
            evaluate_policy,
            evaluation_html,
            resolve_policy_dir,
            reworded,
            run_data_settings,
        )
        from rlhf_core.rewards import UnknownDataSourceError, custom_reward_fn
        from rlhf_core.rewards.manager import RewardError
        from rlhf_core.rollout.hf import NonFiniteLogits
        from rlhf_core.training.checkpoint import CheckpointError

    problems = []  # the model folder, the files and their columns, named as given here, before the model loads
    checkpoint, run, unread = None, {}, None  # the checkpoint MODEL is and its run's data settings
    try:
        import_external_lib(args.external_lib, "--external-lib")
        policy_dir = resolve_policy_dir(args.model)
    except (ModelError, FileNotFoundError) as exc:
        problems.append(str(exc))
    else:
        try:
            checkpoint, run = run_data_settings(policy_dir)
        except CheckpointError as exc:
            unread = exc
    if run.get("truncation") == "error":  # the run refused over-long prompts; here one is cut, as by default
        del run["truncation"]
    given = {"prompt_key": args.prompt_key, "max_prompt_length": args.max_prompt_length,
             "max_response_length": args.max_response_length, "apply_chat_template_kwargs": args.chat_template_kwargs}
    taken = {key: value for key, value in run.items() if given.get(key) is None}  # an option given wins
    settings = {**EVALUATE_DEFAULTS, **taken, **{key: value for key, value in given.items() if value is not None}}
    data = DataConfig(**{**settings, "apply_chat_template_kwargs": dict(settings["apply_chat_template_kwargs"])})
    names = evaluate_names(parser.prog, data.truncation)
    try:  # what loading a reward file raises (see load_custom_reward_fn), and a function the calls do not fit
        reward_fn = custom_reward_fn(reward_config)
    except (FileNotFoundError, ImportError, AttributeError, TypeError) as exc:
        batch = False  # whether a function the calls of each response do not fit is one of whole batches
        if args.reward_manager == "naive" and "calls it for each response" in str(exc):
            reward_config.reward_model.reward_manager = "batch"
            with contextlib.suppress(FileNotFoundError, ImportError, AttributeError, TypeError):
                batch = custom_reward_fn(reward_config) is not None
        # the loader names training's keys; here the options stand for them
        message = reworded(str(exc), {"custom_reward_function.reward_kwargs": "--reward-kwarg",
                                      "custom_reward_function.name": "--custom-reward-name",
                                      "custom_reward_function.path": "--custom-reward",
                                      "reward_model.reward_manager=batch": "--reward-manager batch",
                                      **({"for each response": "for each response (a function of whole batches: "
                                                               "--reward-manager batch)"} if batch else {})})
        print(f"error: --custom-reward: {message}", file=sys.stderr)
        return 2
    try:
        paths = check_files(args.val_files, "val_files")
        missing = missing_columns_problem(paths, needed_columns(data, reward_fn is None), "val_files",
                                          data.prompt_key, prompt_option="--prompt-key ")
        missing = missing and reworded(missing, names)
        if missing and "prompt_key" in taken and repr(data.prompt_key) in missing.partition("; found")[0]:
            missing += (f" (the prompt column {data.prompt_key!r} is the data.prompt_key of the run that saved "
                        f"{checkpoint}; --prompt-key COLUMN names another)")  # (not an option the user gave)
        problems.append(missing)
    except DataError as exc:
        problems.append(reworded(str(exc), names))
    if any(problems):
        print("\n".join(f"error: {problem}" for problem in problems if problem), file=sys.stderr)
        return 2
    if unread is not None:
        print(f"notice: {' '.join(str(unread).split())}: evaluating with the options' own defaults where none is "
              "given", file=sys.stderr)  # (on one line: a YAML error's message spans several)
    said = [f"{EVALUATE_OPTIONS[key]}{'=' if key == 'truncation' else ' '}"
            f"{shlex.quote(json.dumps(value)) if isinstance(value, dict) else value}"
            for key, value in taken.items() if value != {}]
    if said:  # (the values the user did not give, which the run that saved the checkpoint trained with)
        print(f"notice: as the run that saved {checkpoint} trained (data.* of its config.yaml): {', '.join(said)}; "
              "an option given here wins over its run's value", file=sys.stderr)
    try:
        result = evaluate_policy(args.model, args.val_files, data, batch_size=args.batch_size, reward_fn=reward_fn,
                                 max_problems=args.max_problems, sample_seed=args.sample_seed,
                                 trust_remote_code=args.trust_remote_code, names=names)
    except UnknownDataSourceError as exc:
        print(f"error: {exc.args[0]} (here: --custom-reward FILE.py)", file=sys.stderr)
        return 2
    except (DataError, ModelError, FileNotFoundError) as exc:  # input it cannot use; anything else is a bug
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RewardError as exc:  # the reward function raised or returned what is not a score (2, as rlhf-ppo's)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except NonFiniteLogits as exc:  # the model loaded and its weights gave NaN: the evaluation ran and failed
        print(f"error: evaluating {policy_dir} failed: {getattr(exc, 'where', exc)}: its weights hold NaN or inf, "
              "or give them (a checkpoint saved from a diverged run)", file=sys.stderr)
        return 1
    low, high = result.interval
    print(f"accuracy {result.accuracy:.2%} (95% interval [{low:.1%}, {high:.1%}]) on {result.n} of "
          f"{result.total_problems} prompts ({result.model}); on {result.n} problems an accuracy near 50% is known "
          f"to +-{stats.half_width(result.n):.1%} (95%)")
    if args.html:  # what the line above says of the problems, in the report too: its table gives n alone
        sample = (f" (--max-problems, stratified by data source, --sample-seed {args.sample_seed})"
                  if result.n < result.total_problems else "")
        note = (f"Evaluated on {result.n} of {result.total_problems} problems{sample}: an accuracy near 50% is known "
                f"to +-{stats.half_width(result.n):.1%} (95%).")
        Path(args.html).write_text(evaluation_html({"policy": result}, notes=[note]))
        print(f"report: {args.html}")
    return 0


def lineage(argv: list[str] | None = None, client=None) -> int:
    parser = argparse.ArgumentParser(prog=program("rlhf-lineage"),
                                     description="Show the data, reward, checkpoint and decision behind a model version.")
    parser.add_argument("--model", help="model name (default: the only model, or the last one promoted)")
    parser.add_argument("--version", help="version number, name or stage (default: production)")
    parser.add_argument("--json", action="store_true", help="print the chain as JSON")
    parser.add_argument("--reward-source", action="store_true",
                        help="print the text of each file of the version's custom reward (the reward file and "
                             "the modules it imports), as its reward spec kept it, each under its path")
    args = parser.parse_args(argv)
    try:
        if args.reward_source:
            print(reward_source(args.model, args.version, client=client), end="")
            return 0
        record = read_lineage(args.model, args.version, client=client)
    except LineageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(record, indent=2) if args.json else format_lineage(record))
    return 0


def demo_summary(argv: list[str] | None = None, client=None) -> int:
    """``rlhf-demo-summary``: the model's latest run, its promotion decision, and how to browse it."""
    parser = argparse.ArgumentParser(prog=program("rlhf-demo-summary"), description="Summarise the latest run of a model.")
    parser.add_argument("--model", default="demo-ppo-policy", help="model name (default demo-ppo-policy)")
    args = parser.parse_args(argv)
    client = client or default_client()
    try:
        latest = get_version(client, args.model, "latest", version_option=False)
    except LineageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    meta = latest.run_metadata
    run_id = version_run_id(latest)  # (a run that failed before promotion recorded none in the metadata)
    run = client.get_pipeline_run(run_id) if run_id is not None else None
    try:
        production = client.get_model_version(args.model, "production").name
    except KeyError:
        production = None
    print(f"run:        {run.name if run else '?'} ({run.status if run else 'no run recorded'})")
    if "skipped" in meta:  # a retraining run with nothing new: no model was trained or evaluated
        print(f"model:      {args.model} version {latest.name}: training skipped: {meta['skipped']}")
    else:
        def shown(value):  # (4 places, as the decision's figures; the metadata keeps the exact fraction)
            return f"{value:.4f}" if isinstance(value, float) else value

        print(f"model:      {args.model} version {latest.name}: accuracy {shown(meta.get('accuracy', 'n/a'))} "
              f"(base model {shown(meta.get('base_accuracy', 'n/a'))})")
    if "failed_step" in meta and "decision_reason" not in meta:  # recorded by the pipelines' failure hook
        print(f"decision:   none: the run failed at step {meta['failed_step']}: {meta.get('failure', '')}")
    else:
        print(f"decision:   {meta.get('decision_reason', 'none recorded (did the run reach promote?)')}")
        if "failed_step" in meta:  # promote stopped after recording its decision
            print(f"failed:     the run failed at step {meta['failed_step']}: {meta.get('failure', '')}")
    if "failed_step" in meta and "advice" in meta:
        print(f"to go on:   {meta['advice']}")
    disagreement = stage_disagreement(production is not None and production == latest.name, meta)
    if disagreement:
        print(f"stage:      {disagreement}")
    print(f"production: {'version ' + production if production else 'none yet'}")
    print("browse:")
    if production:
        print(f"  rlhf-lineage --model {args.model}            # data -> ... -> promotion of the production version")
    else:  # without one, the default (the production version) has nothing to show
        print(f"  rlhf-lineage --model {args.model} --version {latest.name}   # data -> ... -> this run's version")
    print("  zenml login --local                         # the dashboard on http://127.0.0.1:8237")
    if run is not None:
        print(f"  then open http://127.0.0.1:8237/projects/{client.active_project.name}/runs/{run.id}")
    print("  zenml login --local --blocking              # the same in the foreground; Ctrl-C stops it")
    print("  zenml logout --local                        # stop the background dashboard")
    return 0


def schedule(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=program("rlhf-schedule"), description="Run the retraining pipeline on a schedule.")
    when = parser.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", help="crontab expression, e.g. '0 3 * * *' (03:00 every day, local time)")
    when.add_argument("--every", type=float, metavar="SECONDS", help="a fixed interval instead of a cron expression")
    parser.add_argument("-c", "--config", required=True, help="the pipeline run config, e.g. configs/retrain_demo.yaml")
    parser.add_argument("--pipeline", default=RETRAIN_PIPELINE, help=f"pipeline source (default {RETRAIN_PIPELINE})")
    parser.add_argument("--print-crontab", action="store_true", help="print the crontab line and exit")
    parser.add_argument("--run-now", action="store_true", help="also run once right away")
    parser.add_argument("--max-runs", type=int, help="stop after this many runs (default: run until Ctrl-C)")
    args = parser.parse_args(argv)
    if Path(args.config).is_dir():
        parser.error(f"run config {args.config} is a folder: name the YAML file in it")
    if not Path(args.config).is_file():
        parser.error(f"run config {args.config} does not exist")
    if args.max_runs is not None and args.max_runs < 1:
        parser.error(f"--max-runs {args.max_runs} must be >= 1")
    # (imported once the arguments are read: it imports torch and pandas, seconds that --help need not wait for)
    with importing():
        from rlhf_core.pipeline.run_config import check_run_config_file
    try:
        if args.print_crontab and args.cron is None:
            parser.error("--print-crontab needs --cron")
        # a bad expression is told before the config is read (the crontab line's times are cron's, in its zone)
        make_trigger(cron=args.cron, every=args.every, timezone="UTC" if args.print_crontab else None)
        check_run_config_file(args.config, args.pipeline)  # once now, rather than at each scheduled run
        if args.print_crontab:
            print(crontab_line(args.cron, args.config, args.pipeline))
            return 0
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        runs = serve(lambda: run_pipeline(args.config, args.pipeline), cron=args.cron, every=args.every,
                     max_runs=args.max_runs, run_now=args.run_now)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ScheduleTerminated as stop:  # one line, and 128 + SIGTERM, as the other commands end on it
        failed = sum("error" in run for run in stop.finished)
        under_way = "; no run was under way" if not stop.stopped else "; the run under way was passed the " \
            f"SIGTERM and ended with status {', '.join(map(str, stop.stopped))} (its output above says what it saved)"
        print(f"interrupted by SIGTERM: {parser.prog} stopped after {len(stop.finished)} scheduled run(s)"
              f"{f' ({failed} failed)' if failed else ''}{under_way}", file=sys.stderr)
        return 128 + signal.SIGTERM
    failed = sum("error" in run for run in runs or [])
    if failed:
        print(f"error: {failed} of {len(runs)} scheduled runs failed (the log above says why)", file=sys.stderr)
    return 1 if failed else 0
