"""The project's commands in one place: ``rlhf <command> [args]``.

Each command is a function ``(argv) -> exit code`` in the module of its role (train, data, models,
pipeline, config); the modules do the argument parsing, the printing and the exit codes, and call
the library for everything else. The library's ``python -m`` paths and the ``rlhf-*`` console
scripts call the same functions. A command's module is imported only when it runs, so ``rlhf --help``
starts without torch, and the console scripts (``rlhf_ppo`` ... below) import it the same way: a Ctrl-C while
torch or ZenML import, in a command's first seconds, ends it with one line and exit status 130, not a traceback.
The training commands (``ppo``, ``train-rm``) take a SIGTERM as they take a Ctrl-C where the training steps' own
handler is not in place (while a run starts or closes, or with ``trainer.save_on_interrupt=false``): one line naming
SIGTERM and the checkpoint left, and exit status 143. ``schedule`` passes it on to the run under way, waits for that
run to end, and says so in one line, with 143.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from rlhf_core.interrupts import Terminated

# name -> (module, function, one line of help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "ppo": ("rlhf_core.cli.train", "ppo", "PPO training with verl's config keys (also rlhf-ppo)"),
    "train-rm": ("rlhf_core.cli.train", "train_rm", "train a reward model on preference pairs (also rlhf-train-rm)"),
    "smoke": ("rlhf_core.cli.train", "smoke", "dry-run a PPO config on a tiny clone of its model"),
    "gsm8k": ("rlhf_core.cli.data", "gsm8k", "convert GSM8K into verl-style train/test parquet files"),
    "synthetic": ("rlhf_core.cli.data", "synthetic", "write synthetic arithmetic problems as train/test parquet files"),
    "preference": ("rlhf_core.cli.data", "preference", "write preference pairs as train/val parquet files"),
    "validate": ("rlhf_core.cli.data", "validate", "validate prompt or preference parquet files with GX"),
    "toy-model": ("rlhf_core.cli.models", "toy_model", "build the tiny offline toy model"),
    "gguf": ("rlhf_core.cli.models", "gguf", "import a GGUF file into a local HF model directory"),
    "evaluate": ("rlhf_core.cli.pipeline", "evaluate", "greedy accuracy of a model directory on validation data"),
    "lineage": ("rlhf_core.cli.pipeline", "lineage", "the data, reward, checkpoint and decision behind a model version "
                "(also rlhf-lineage)"),
    "demo-summary": ("rlhf_core.cli.pipeline", "demo_summary", "summarise the latest run of a model "
                     "(also rlhf-demo-summary)"),
    "schedule": ("rlhf_core.cli.pipeline", "schedule", "run the retraining pipeline on a schedule (also rlhf-schedule)"),
    "config": ("rlhf_core.cli.config", "config", "print the resolved PPO config tree, or its commented defaults"),
}


#: the help of the commands' --config
CONFIG_HELP = ("YAML file of overrides applied before the command line; repeat it to merge several in order, a later "
               "file's keys overriding an earlier one's (as the command line's override them all)")


# Hydra's options of verl's entry points, which these commands do not take: name -> what it gives
HYDRA_OPTIONS = {"--config-path": "path", "-cp": "path", "--config-name": "name", "-cn": "name",
                 "--config-dir": "dir", "-cd": "dir"}


def hydra_options_problem(argv: Sequence[str]) -> str | None:
    """What to say where ``argv`` holds Hydra's ``--config-path``/``--config-name`` (or ``--config-dir``), as verl's
    commands take them, else None: the file they name is given here as ``--config FILE`` (argparse would only
    call them unrecognized arguments)."""
    found: dict[str, tuple[str, str]] = {}
    for i, arg in enumerate(argv):
        option, equals, value = arg.partition("=")
        if option in HYDRA_OPTIONS:
            if not equals:
                value = argv[i + 1] if i + 1 < len(argv) else ""
            found[HYDRA_OPTIONS[option]] = (option, value.strip("'\""))
    if not found:
        return None
    used = " and ".join(option for option, _ in found.values())
    name = found.get("name", ("", ""))[1]
    folder = found.get("path", ("", ""))[1] or found.get("dir", ("", ""))[1]
    said = f"{used} {'are' if len(found) > 1 else 'is'} Hydra's, which does not load the config here"
    if not name:
        return f"{said}: give the YAML file itself with --config FILE (repeat it for several, merged in order)"
    # a relative --config-path is read from the folder of verl's main module (verl/trainer), so "config" is verl's
    verls_folder = not folder or folder.rstrip("/").removeprefix("./") in ("config", "verl/trainer/config")
    stem = name.removesuffix(".yaml")
    if stem == "ppo_trainer" and verls_folder:
        return f"{said}: verl's ppo_trainer tree is the defaults here; drop {used} and give your overrides"
    if stem == "ppo_megatron_trainer" and verls_folder:
        return (f"{said}: verl's ppo_megatron_trainer is the config of its Megatron backend, which is not one here "
                f"(the workers shard with FSDP2, as verl's ppo_trainer, whose tree is the defaults here): drop {used}; "
                "the command's .megatron. keys are refused")
    file = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
    where = f"{folder.rstrip('/')}/{file}" if folder else f"verl/trainer/config/{file} (verl's config folder)"
    return (f"{said}: give that file with --config, e.g. --config {where}, by its path from here (Hydra reads a "
            "relative --config-path from the folder of verl's main module); a defaults list in it may name only "
            "verl's ppo_trainer and _self_")


def refuse_hydra_options(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> None:
    """Exit through ``parser.error`` (code 2) where ``argv`` (None: the process's) holds Hydra's config options."""
    problem = hydra_options_problem(sys.argv[1:] if argv is None else argv)
    if problem is not None:
        parser.error(problem)


def unwritable(folder: Path) -> str | None:
    """Why files cannot be written in ``folder`` (made where missing), None where they can: told before a command
    spends minutes on what it would write there."""
    if folder.exists() and not folder.is_dir():
        return "a file, not a folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


# the commands that take a SIGTERM as a Ctrl-C (:func:`sigterm_as_interrupt`): those whose runs keep checkpoints,
# and the scheduler of such runs, which passes it on to the run under way
SIGTERM_AS_INTERRUPT = ("ppo", "train-rm", "schedule")


# set by :func:`sigterm_as_interrupt`'s handler: Ray turns an exception a signal handler raised inside ``ray.get``
# into a KeyboardInterrupt of its own, so the Terminated may reach the command as a plain KeyboardInterrupt
_terminated = False


def interrupting_signal(interrupt: BaseException) -> signal.Signals:
    """The signal a KeyboardInterrupt stands for: SIGTERM for :class:`Terminated` (or any once a SIGTERM came under
    :func:`sigterm_as_interrupt`), else SIGINT (Ctrl-C)."""
    return signal.SIGTERM if isinstance(interrupt, Terminated) or _terminated else signal.SIGINT


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While inside, a SIGTERM raises :class:`Terminated`: with Python's default it ended the process at once, with
    no line and nothing closed, where a Ctrl-C said what it left (a run starting, closing, or with
    ``trainer.save_on_interrupt=false``). Only in the main thread (where Python delivers signals), and only over
    SIGTERM's default disposition (one ignored or handled by the caller stays so)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    global _terminated

    def handler(signum, frame):
        global _terminated
        _terminated = True
        raise Terminated(signal.Signals(signum).name)

    _terminated = False
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# set while a command imports its library once it has parsed its arguments (:func:`importing`), and left set where
# a Ctrl-C ends that import: :func:`_run` then says that nothing was done
_importing = False


@contextlib.contextmanager
def importing():
    """Around the imports a command makes after parsing its arguments (torch, transformers, pandas: seconds, where
    ``--help`` and a usage error answer without them): a Ctrl-C inside stops the command as it started, before it did
    anything, and :func:`_run`'s line says so."""
    global _importing
    _importing = True
    yield  # (a KeyboardInterrupt leaves the flag set for _run, which clears it)
    _importing = False


# the name the running command was started by (``rlhf <command>``, its console script or its ``python -m`` path),
# so that its parser names itself as the user typed it
_running: str | None = None


def chat_template_kwargs(text: str) -> dict:
    """``--chat-template-kwargs``' value: a JSON object of the chat template's variables, as
    ``data.apply_chat_template_kwargs`` holds them (argparse names the option with the reason)."""
    from rlhf_core.config import RENDERER_ARGUMENTS  # (here: the listing of the commands imports no config)

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({' '.join(str(exc).split())}): {text!r}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of keywords is needed, e.g. '{{\"enable_thinking\": "
                                         f"false}}', not {text!r}")
    arguments = [key for key in value if key in RENDERER_ARGUMENTS]
    if arguments:
        raise argparse.ArgumentTypeError(f"{arguments[0]} is an argument of apply_chat_template, not a variable of the "
                                         "chat template: every prompt is rendered as the trainer renders it (with the "
                                         "generation prompt, to token ids, cut to the length given)")
    return value


def program(default: str) -> str:
    """The name a command's parser shows in its usage and errors: the one :func:`_run` was given (``rlhf
    <command>``, a console script, a ``python -m`` path), else ``default`` (its function called directly)."""
    return _running or default


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: rlhf <command> [args]    (rlhf <command> --help: the command's options)", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_line}" for name, (_, _, help_line) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(usage(), file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"rlhf: unknown command '{name}'; the commands are: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return _run(name, rest, f"rlhf {name}")


def _run(name: str, argv: Sequence[str] | None, prog: str) -> int:
    """Command ``name`` of :data:`COMMANDS` on ``argv`` (None: the process's), its module imported here. A Ctrl-C
    the command does not handle itself (one while its module imports torch or ZenML, or while it imports them once
    it has parsed its arguments: :func:`importing`) ends it
    with one line naming ``prog`` and 128 + SIGINT, where it came out as a traceback; a SIGTERM to a training
    command alike, with 128 + SIGTERM."""
    global _running, _terminated, _importing
    module, function, _ = COMMANDS[name]
    command = None
    _running, _importing = prog, False
    try:
        with sigterm_as_interrupt() if name in SIGTERM_AS_INTERRUPT else contextlib.nullcontext():
            command = getattr(importlib.import_module(module), function)
            return command(argv)
    except KeyboardInterrupt as interrupt:
        sig = interrupting_signal(interrupt)
        started = command is not None and not _importing
        said = "stopped before it finished" if started else "stopped as it started: nothing was done"
        print(f"interrupted by {sig.name}: {prog} {said}", file=sys.stderr)
        return 128 + sig
    finally:
        _running, _terminated, _importing = None, False, False


# The console scripts beside ``rlhf`` (pyproject's [project.scripts]), each named after its script: a script that
# named the command's own function imported its module (torch) before any code here could take a Ctrl-C.


def rlhf_ppo() -> int:
    return _run("ppo", None, "rlhf-ppo")


def rlhf_train_rm() -> int:
    return _run("train-rm", None, "rlhf-train-rm")


def rlhf_lineage() -> int:
    return _run("lineage", None, "rlhf-lineage")


def rlhf_schedule() -> int:
    return _run("schedule", None, "rlhf-schedule")


def rlhf_demo_summary() -> int:
    return _run("demo-summary", None, "rlhf-demo-summary")
