"""The training commands: ``rlhf-ppo`` (PPO), ``rlhf-train-rm`` (a reward model) and the smoke test.

    rlhf ppo [--config FILE ...] [key=value ...]        # also rlhf-ppo, python -m rlhf_core.main_ppo
    rlhf train-rm [--config FILE ...] [key=value ...]   # also rlhf-train-rm
    rlhf smoke [--config FILE ...] [key=value ...]      # also python -m rlhf_core.pipeline.smoke
    rlhf ppo --cfg job [--config FILE ...] [key=value ...]   # (each of the three) print the config, run nothing

Exit codes, alike for the three: 0 done; 1 the run failed (``ppo``: a guard stopped it, a worker failed or a logger
could not record a step; ``train-rm``: a guard stopped it (``reward_model.train.max_consecutive_skips`` steps in a
row, or all the run's steps, took no update on a non-finite loss or gradient), a worker failed, the weights or a
validation's loss were not finite, or a logger could not record a step; ``smoke``: a check failed); 2 bad input,
refused before anything trains (config, data, preference data, model, checkpoint) or met on the way (``ppo`` and
``smoke``: a reward function that failed, by raising or returning NaN, inf or no number; ``ppo`` and ``train-rm``: a
checkpoint that could not be written); 128 + signal number after Ctrl-C (130) or SIGTERM (143) (``ppo`` and
``train-rm``: once the step under way is saved, or at once without saving after a second one, or where no step is
under way: while the run starts or closes, or with ``trainer.save_on_interrupt=false``; the message names the
checkpoint left).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from rlhf_core.cli import CONFIG_HELP, interrupting_signal, program, refuse_hydra_options, unwritable
from rlhf_core.cli.config import print_resolved
from rlhf_core.config import ConfigError, load_config

# The training library (torch, transformers: seconds to import) is imported once a command has parsed its arguments
# and read its config: --help, a wrong option and a refused config key answer at once. The four it calls to run are
# named here, so that a test can put its own in their place.


def run(cfg):
    """:func:`rlhf_core.main_ppo.run`: PPO training."""
    from rlhf_core.main_ppo import run as run_ppo

    return run_ppo(cfg)


def run_smoke_test(cfg, work_dir):
    """:func:`rlhf_core.pipeline.smoke.run_smoke_test`: the dry run."""
    from rlhf_core.pipeline.smoke import run_smoke_test as dry_run

    return dry_run(cfg, work_dir)


def preflight(cfg):
    """:func:`rlhf_core.training.reward_trainer.preflight`: a reward model's input checked, its pairs read."""
    from rlhf_core.training.reward_trainer import preflight as check

    return check(cfg)


def RewardModelTrainer(cfg, frames):
    """A :class:`rlhf_core.training.reward_trainer.RewardModelTrainer`."""
    from rlhf_core.training import reward_trainer

    return reward_trainer.RewardModelTrainer(cfg, frames)


# Hydra's -c/--cfg, which verl's commands take (Hydra parses their command line): print the config and exit
HYDRA_CFG = ("job", "hydra", "all")


def hydra_cfg(text: str) -> str:
    """-c/--cfg's value: job, hydra or all. Anything else is taken for a config file (ZenML's ``pipeline run`` and
    ``rlhf schedule`` name theirs with -c), which is given here with --config (argparse names the option)."""
    if text in HYDRA_CFG:
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not job, hydra or all: -c/--cfg is Hydra's option that prints the "
                                     "config and exits, as in verl's commands (-c job: the run's config); give a "
                                     f"config file with --config {text}")


def add_print_config(parser: argparse.ArgumentParser) -> None:
    """A training command's -c/--cfg and --resolve, as verl's commands take them from Hydra."""
    parser.add_argument("-c", "--cfg", type=hydra_cfg, metavar="{job,hydra,all}",
                        help="print the config that --config and the overrides resolve to, as rlhf config does, and "
                             "exit without running (Hydra's option in verl's commands; job and all print the same: "
                             "the config is not composed by Hydra here, so there is no hydra part)")
    parser.add_argument("--resolve", action="store_true",
                        help="with --cfg, as in Hydra (the config printed is resolved already)")


def print_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int | None:
    """Where ``args`` holds --cfg: print the config (exit status 0; 2 where it has errors, each said) and return the
    status; None where the command runs. --resolve without --cfg exits through ``parser.error``."""
    if args.cfg is None:
        if args.resolve:
            parser.error("--resolve goes with --cfg job (it asks Hydra to resolve the config printed): give both, or "
                         "neither to run")
        return None
    if args.cfg == "hydra":
        parser.error("--cfg hydra prints Hydra's own settings (its run folder, logging), and the config is not "
                     "composed by Hydra here: --cfg job prints the run's config")
    return print_resolved(args.overrides, args.config)


@contextlib.contextmanager
def _signals_held():
    """Ctrl-C and SIGTERM ignored inside (main thread only; elsewhere Python delivers no signals anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, signal.SIG_IGN) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def stopped_at_once(folder: str | None, saves_on_interrupt: bool, rerun: str | None,
                    checkpoint: Path | None = None, sig: signal.Signals = signal.SIGINT) -> str:
    """What a Ctrl-C (or a SIGTERM, ``sig``) that reached the command as KeyboardInterrupt left: one that came
    outside the training steps (while the run checked its input, loaded its models or a checkpoint, or closed),
    where every step trained is saved, or any with ``trainer.save_on_interrupt=false``. ``folder``: the run's
    checkpoint folder, None before its config was read; ``rerun``: how a rerun resumes from its latest checkpoint;
    ``checkpoint``: that checkpoint where the run says it (one resumed from another folder, nothing saved since),
    else the folder's."""
    if folder is None:
        return f"interrupted by {sig.name} before the run started: nothing was trained or written"
    from rlhf_core.training.checkpoint import latest_or_none

    latest = checkpoint or latest_or_none(Path(os.path.expanduser(folder)))
    if not saves_on_interrupt:
        kept = (f"the latest checkpoint {latest} is as it was: {rerun} to resume from it"
                if latest is not None else "no checkpoint was saved")
        return f"interrupted by {sig.name}: stopped at once without saving (trainer.save_on_interrupt=false); {kept}"
    kept = f"the latest checkpoint is {latest}" if latest is not None else "no checkpoint is saved"
    return (f"interrupted by {sig.name} outside the training steps (while the run started or closed): stopped at "
            f"once, no trained step lost; {kept}")


def releases_ray(command):
    """``command`` stops the Ray connection it made (a local cluster it started, or one it joined) before it
    returns, with Ctrl-C and SIGTERM held off for those seconds: left to Ray's exit hook, a second signal then
    interrupted it and left Ray's agent processes running without a parent. A connection that was up before the
    command (its caller's) stays."""
    @functools.wraps(command)
    def wrapped(argv: list[str] | None = None) -> int:
        ray = sys.modules.get("ray")
        connected = ray is not None and ray.is_initialized()
        try:
            return command(argv)
        finally:
            ray = sys.modules.get("ray")
            if not connected and ray is not None and ray.is_initialized():
                with _signals_held():
                    ray.shutdown()
    return wrapped


def _failure(exc: BaseException | None) -> tuple[str, int] | None:
    """(the message, the exit status) of a run that failed with ``exc`` (PPO's or a reward model's), None for an
    error these commands do not know (a bug: its traceback is shown)."""
    if isinstance(exc, ConfigError):  # (before the library is imported: a refused config is told at once)
        return str(exc), 2
    from rlhf_core.data.dataset import DataError
    from rlhf_core.data.preference import PreferenceDataError
    from rlhf_core.main_ppo import PreflightError
    from rlhf_core.models.loading import ModelError
    from rlhf_core.rewards.manager import RewardError
    from rlhf_core.training.checkpoint import CheckpointError
    from rlhf_core.training.dynamic_sampling import NothingToTrain
    from rlhf_core.training.guards import GuardError, TrainingInterrupted
    from rlhf_core.training.monitoring import PortInUseError
    from rlhf_core.training.reward_trainer import RewardTrainingError
    from rlhf_core.training.trainer import LoggingError
    from rlhf_core.workers.group import WorkerError

    if isinstance(exc, RewardError):  # the user's reward function, not the run: its message says which checkpoint
        return f"error: {exc}", 2
    if isinstance(exc, (PreflightError, DataError, PreferenceDataError, RewardTrainingError, ModelError,
                        CheckpointError, PortInUseError)):
        return str(exc), 2
    if isinstance(exc, (GuardError, WorkerError, LoggingError, NothingToTrain)):
        return f"error: {exc}", 1
    if isinstance(exc, TrainingInterrupted):
        return str(exc), 128 + exc.signal_number
    return None


def _reported(exc: Exception) -> int:
    """Say the error a run failed with (:func:`_failure`) and return its exit status: the one way ``ppo``,
    ``train-rm`` and ``smoke`` report a failure. An error they do not know goes on (called in its ``except``: a bare
    raise)."""
    if (said := _failure(exc)) is None:
        raise  # (called inside the handler of ``exc``: it goes on with its traceback)
    print(said[0], file=sys.stderr)
    return said[1]


def _interrupted_while_failing(interrupt: KeyboardInterrupt) -> int | None:
    """Where a Ctrl-C came while a failed run closed (its workers, its trackers), that failure said as its own
    handler says it, with its status (the Ctrl-C lost nothing more). None: the Ctrl-C came on its own, or while some
    code handled an error of its own (a library's fallback on a KeyError), which is no failure of the run."""
    said = _failure(interrupt.__context__)
    if said is None:
        return None
    came = "a Ctrl-C" if interrupting_signal(interrupt) is signal.SIGINT else "a SIGTERM"
    print(f"{said[0]}\n({came} came while the run closed after that; nothing else was lost)", file=sys.stderr)
    return said[1]


@releases_ray
def ppo(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=program("rlhf-ppo"), description="PPO training with verl's config keys.")
    parser.add_argument("--config", action="append", metavar="FILE", help=CONFIG_HELP)
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data.train_batch_size=64")
    add_print_config(parser)
    refuse_hydra_options(parser, argv)
    args = parser.parse_intermixed_args(argv)  # overrides on both sides of --config
    if (printed := print_config(parser, args)) is not None:
        return printed
    cfg = None
    try:
        cfg = load_config(args.overrides, config_file=args.config)
        result = run(cfg)
    except KeyboardInterrupt as interrupt:  # (within the steps, stop_on_signals turns it into TrainingInterrupted)
        if (status := _interrupted_while_failing(interrupt)) is not None:
            return status
        from rlhf_core.training.checkpoint import rerun_point

        told = getattr(interrupt, "rerun", None)  # (advice, checkpoint): the trainer's, as run() found them
        if told is None and cfg is not None:  # no trainer yet: nothing loaded, nothing saved by this run
            told = rerun_point(cfg.trainer, None, None)
        rerun, checkpoint = told or (None, None)
        sig = interrupting_signal(interrupt)
        print(stopped_at_once(cfg and cfg.trainer.default_local_dir, cfg is None or cfg.trainer.save_on_interrupt,
                              rerun, checkpoint, sig=sig), file=sys.stderr)
        return 128 + sig
    except Exception as exc:
        return _reported(exc)
    acc = result.final_val_acc
    trained = len(result.history)  # this run's steps (a resumed run's count goes on from its checkpoint's)
    done = (f"validated at step {result.steps}" if cfg.trainer.val_only  # (its history: the validation's record)
            else f"{trained} step{'' if trained == 1 else 's'}"
            + (f" (now at step {result.steps})" if result.resumed_from else ""))
    print(f"done: {done} in {result.wall_s:.0f} s" + (f"; final validation accuracy {acc:.3f}" if acc is not None else ""))
    print(f"outputs: {result.local_dir}" + (f" (metrics: {result.metrics_file})" if result.metrics_file else ""))
    return 0


@releases_ray
def train_rm(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=program("rlhf-train-rm"),
        description="Train a reward model (scalar head, Bradley-Terry loss) on preference pairs; the keys are "
                    "those of the PPO config tree: reward_model.train.* for the model, pairs, batches and optimizer, "
                    "trainer.* for where it runs (device, n_gpus_per_node, nnodes, logger; the defaults are "
                    "verl's 8 GPUs: on CPU give trainer.device=cpu trainer.n_gpus_per_node=1).",
    )
    parser.add_argument("--config", action="append", metavar="FILE", help=CONFIG_HELP)
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. reward_model.train.model.path=DIR")
    add_print_config(parser)
    refuse_hydra_options(parser, argv)
    args = parser.parse_intermixed_args(argv)  # overrides on both sides of --config
    if (printed := print_config(parser, args)) is not None:
        return printed
    cfg = None
    try:
        cfg = load_config(args.overrides, config_file=args.config)
        frames = preflight(cfg)
    except KeyboardInterrupt as interrupt:
        sig = interrupting_signal(interrupt)
        print(stopped_at_once(cfg and cfg.reward_model.train.default_local_dir, True, None, sig=sig), file=sys.stderr)
        return 128 + sig
    except Exception as exc:
        return _reported(exc)
    trainer_cfg = cfg.trainer
    loggers = [name for name in trainer_cfg.logger if name != "console"] + ["file"]
    started = time.time()
    trainer = None
    try:
        from rlhf_core.main_ppo import stop_on_signals
        from rlhf_core.training.reward_trainer import HF_DIR
        from rlhf_core.training.tracking import Tracking

        trainer = RewardModelTrainer(cfg, frames)
        try:
            # the checkpoint checks (its kind, its files, the config) before any tracking: a refused run leaves
            # the folder's wandb and MLflow runs and its TensorBoard events as they were; a signal while the run
            # starts (a checkpoint verified, loaded) stops it before its next step
            with stop_on_signals(trainer, trainer_cfg.save_on_interrupt), trainer.started(), \
                    Tracking(loggers, trainer_cfg.project_name, f"{trainer_cfg.experiment_name}-reward_model",
                             trainer.local_dir, config=cfg.to_dict(), total_steps=max(trainer.total_steps, 1),
                             resume_step=trainer.global_step if trainer.resumed_from is not None else None
                             ) as tracking:  # (a resumed run goes on in its wandb and MLflow runs)
                val = trainer.train(tracking.log)
        finally:
            trainer.shutdown()
    except KeyboardInterrupt as interrupt:  # (within the steps, stop_on_signals turns it into TrainingInterrupted)
        if (status := _interrupted_while_failing(interrupt)) is not None:
            return status
        from rlhf_core.training.checkpoint import rerun_point

        rm = cfg.reward_model.train
        rerun, checkpoint = (trainer.rerun_point() if trainer is not None  # else nothing loaded, nothing saved
                             else rerun_point(rm, None, None, "reward_model.train"))
        sig = interrupting_signal(interrupt)
        print(stopped_at_once(rm.default_local_dir, trainer_cfg.save_on_interrupt, rerun, checkpoint, sig=sig),
              file=sys.stderr)
        return 128 + sig
    except Exception as exc:  # (TrainingInterrupted too: 128 + its signal)
        return _reported(exc)
    shown = ", ".join(f"{k} {v:.4f}" for k, v in val.items())  # a NaN shown as nan, not left out
    print(f"reward model: at step {trainer.global_step} after {time.time() - started:.0f} s; {shown or 'no validation'}")
    print(f"HF export: {trainer.local_dir / HF_DIR}  (AutoModelForSequenceClassification.from_pretrained)")
    print(f"metrics: {trainer.local_dir / 'metrics.jsonl'}")
    return 0


def smoke(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=program("python -m rlhf_core.pipeline.smoke"), description="Dry-run a PPO config.")
    parser.add_argument("--config", action="append", metavar="FILE", help=CONFIG_HELP)
    parser.add_argument("--work-dir", help="where to write the clone, data and checkpoints (default: a temp dir)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    add_print_config(parser)
    refuse_hydra_options(parser, argv)
    args = parser.parse_intermixed_args(argv)  # overrides on both sides of --config
    if (printed := print_config(parser, args)) is not None:
        return printed
    try:
        cfg = load_config(args.overrides, config_file=args.config)
    except Exception as exc:
        return _reported(exc)
    if args.work_dir and (problem := unwritable(Path(args.work_dir))):
        print(f"error: --work-dir {args.work_dir}: {problem}; give a folder this user may write", file=sys.stderr)
        return 2
    from rlhf_core.pipeline.smoke import SmokeTestError

    with tempfile.TemporaryDirectory(prefix="rlhf-smoke-") as scratch:
        try:
            report = run_smoke_test(cfg, args.work_dir or scratch)
        except SmokeTestError as exc:
            print(exc, file=sys.stderr)
            return 1
        except Exception as exc:  # its model or data cannot be used, its reward function failed, ... as in rlhf-ppo
            return _reported(exc)
        except KeyboardInterrupt:  # (python -m rlhf_core.pipeline.smoke runs it without rlhf's own line for it)
            print("interrupted by SIGINT: the dry run stopped before its checks ended; it wrote nothing of the run's",
                  file=sys.stderr)
            return 128 + signal.SIGINT
    print(report.summary())
    return 0
