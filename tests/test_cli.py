"""The umbrella command: ``rlhf <command> [args]`` runs the same functions as the old command paths."""

from __future__ import annotations

import ast
import importlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from rlhf_core import cli, main_ppo
from rlhf_core.config import load_config
from rlhf_core.main_ppo import build_trainer

# the commands the README documents, written out here rather than read from the table
DOCUMENTED = ["ppo", "train-rm", "smoke", "gsm8k", "synthetic", "preference", "validate", "toy-model", "gguf",
              "evaluate", "lineage", "demo-summary", "schedule", "config"]


def _python(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(cwd)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def test_help_lists_every_command_with_one_line_and_imports_no_command(repo_root):
    # in a fresh interpreter: the listing must not pull in torch (or any command's module)
    probe = ("import sys\nfrom rlhf_core.cli import main\ncode = main(['--help'])\n"
             "loaded = sorted(m for m in ('torch', 'pandas', 'rlhf_core.cli.train', 'rlhf_core.cli.data') "
             "if m in sys.modules)\nprint('loaded:', loaded)\nsys.exit(code)")
    done = _python("-c", probe, cwd=repo_root)
    assert done.returncode == 0, done.stderr
    listed = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")]
    assert listed == DOCUMENTED
    assert all(len(line.split()) > 2 for line in done.stdout.splitlines() if line.startswith("  "))
    assert done.stdout.splitlines()[-1] == "loaded: []"


def _import_probe(command: str, wrong: list[str], modules: tuple[str, ...]) -> str:
    """Python that runs ``rlhf COMMAND --help`` and ``rlhf COMMAND WRONG...``, then prints their exit codes with the
    last line of the second's error, and which of ``modules`` they imported."""
    return ("import contextlib, io, sys\nfrom rlhf_core.cli import main\ncodes = []\n"
            f"for argv in (['--help'], {wrong!r}):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:\n"
            "        try:\n"
            f"            codes.append(main([{command!r}, *argv]))\n"
            "        except SystemExit as exited:\n"
            "            codes.append(exited.code)\n"
            "print(codes, err.getvalue().splitlines()[-1])\n"
            f"print('loaded:', sorted(m for m in {modules!r} if m in sys.modules))")


@pytest.mark.parametrize("command", ["ppo", "train-rm", "smoke"])
def test_a_training_commands_help_and_a_refused_config_key_answer_without_importing_torch(repo_root, command):
    """``rlhf-ppo --help`` (and a misspelt key) took seconds: the command's module imported torch and transformers
    before it parsed its arguments."""
    done = _python("-c", _import_probe(command, ["trainer.total_trainig_steps=2"], ("torch", "transformers", "pandas")),
                   cwd=repo_root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "[0, 2]   - unknown config key trainer.total_trainig_steps; did you mean trainer.total_training_steps?",
        "loaded: []"]


@pytest.mark.parametrize(("command", "wrong", "said"), [
    ("toy-model", ["--threads", "0"], "rlhf toy-model: error: --threads must be at least 1"),
    ("gguf", ["--output", "out"], "rlhf gguf: error: one of the arguments --gguf --package is required")])
def test_the_model_commands_help_and_a_usage_error_answer_without_importing_torch(repo_root, command, wrong, said):
    """``rlhf toy-model --help`` and ``rlhf gguf --help`` took about 5 s: their module imported the toy model's
    (torch, transformers) before it parsed the arguments."""
    done = _python("-c", _import_probe(command, wrong, ("torch", "transformers", "numpy")), cwd=repo_root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"[0, 2] {said}", "loaded: []"]


def test_the_toy_models_presets_named_for_its_help_are_those_it_builds():
    from rlhf_core.cli import models
    from rlhf_core.models import toy

    assert sorted(models.TOY_PRESETS) == sorted(toy.PRESETS) == ["demo", "test"]


# the library modules a data command imports once it has parsed its arguments (seconds: pandas, and GX for validate)
DATA_LIBRARIES = ("pandas", "numpy", "pyarrow", "torch", "great_expectations", "rlhf_core.data.gsm8k",
                  "rlhf_core.data.synthetic", "rlhf_core.data.preference", "rlhf_core.data.validation")


@pytest.mark.parametrize(("command", "wrong", "said"), [
    ("gsm8k", ["--input", "in", "--output", "out", "--max-rows", "0"], "rlhf gsm8k: error: --max-rows must be at least 1"),
    ("synthetic", ["--output", "out", "--n-train", "0", "--n-test", "5"],
     "rlhf synthetic: error: --n-train must be at least 1"),
    ("preference", ["--synthetic", "--output", "out", "--n-val", "0"],
     "rlhf preference: error: --n-train and --n-val must be at least 1"),
    ("preference", ["--gsm8k-solutions", "solutions.jsonl", "--output", "out", "--val-fraction", "1.5"],
     "rlhf preference: error: --val-fraction must be in (0, 1), got 1.5"),  # (exit 1, as bad data, once read)
    ("validate", ["--json"], "rlhf validate: error: the following arguments are required: train")])
def test_the_data_commands_help_and_a_usage_error_answer_without_importing_pandas(repo_root, command, wrong, said):
    """``rlhf gsm8k --help`` (synthetic, preference, validate) took about 2.5 s: their module imported the data
    library (pandas) before it parsed the arguments."""
    done = _python("-c", _import_probe(command, wrong, DATA_LIBRARIES), cwd=repo_root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"[0, 2] {said}", "loaded: []"]


@pytest.mark.parametrize("module", ["rlhf_core.data.gsm8k", "rlhf_core.data.synthetic", "rlhf_core.data.preference",
                                    "rlhf_core.data.validation"])
def test_a_data_modules_python_m_help_answers_without_importing_pandas(repo_root, module):
    probe = ("import contextlib, io, runpy, sys\nsys.argv = ['x', '--help']\n"
             "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
             "    try:\n"
             f"        runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
             "    except SystemExit as exited:\n"
             "        code = exited.code\n"
             "print(code, out.getvalue().splitlines()[0])\n"
             f"print('loaded:', sorted(m for m in {DATA_LIBRARIES!r} if m in sys.modules))")
    done = _python("-c", probe, cwd=repo_root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith(f"0 usage: python -m {module} [-h]")
    assert done.stdout.splitlines()[1:] == ["loaded: []"]


def test_the_schedulers_help_and_a_usage_error_answer_without_importing_torch(repo_root):
    """``rlhf-schedule --help`` took seconds: the command imported the run-config checks (torch, pandas)
    before it parsed its arguments."""
    done = _python("-c", _import_probe("schedule", ["--cron", "0 3 * * *"], ("torch", "zenml", "pandas")), cwd=repo_root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "[0, 2] rlhf schedule: error: the following arguments are required: -c/--config", "loaded: []"]


def test_every_command_resolves_to_a_function():
    for name, (module, function, _) in cli.COMMANDS.items():
        assert callable(getattr(importlib.import_module(module), function)), name


# python -m of a command with a console script was shown as that script (rlhf-train-rm), not as what was run
@pytest.mark.parametrize(("command", "module", "own_name"),
                         [("lineage", "rlhf_core.pipeline.lineage", "python -m rlhf_core.pipeline.lineage"),
                          ("train-rm", "rlhf_core.training.reward_trainer",
                           "python -m rlhf_core.training.reward_trainer"),
                          ("schedule", "rlhf_core.pipeline.schedule", "python -m rlhf_core.pipeline.schedule"),
                          ("ppo", "rlhf_core.main_ppo", "python -m rlhf_core.main_ppo"),
                          ("gsm8k", "rlhf_core.data.gsm8k", "python -m rlhf_core.data.gsm8k")])
def test_a_commands_help_is_that_of_its_module_path_under_the_name_typed(repo_root, command, module, own_name):
    umbrella = _python("-m", "rlhf_core.cli", command, "--help", cwd=repo_root)
    old_path = _python("-m", module, "--help", cwd=repo_root)
    assert umbrella.returncode == old_path.returncode == 0, umbrella.stderr + old_path.stderr
    assert umbrella.stdout.startswith(f"usage: rlhf {command} [-h]")
    assert old_path.stdout.startswith(f"usage: {own_name} [-h]")
    # the same options and text; argparse only wraps the usage lines to the name's width
    assert umbrella.stdout.split("\n\n", 1)[1] == old_path.stdout.split("\n\n", 1)[1]
    assert "--help" in umbrella.stdout


@pytest.mark.parametrize(("script", "function"), [("rlhf-train-rm", "rlhf_train_rm"), ("rlhf-schedule", "rlhf_schedule")])
def test_a_console_scripts_help_names_the_script(repo_root, script, function):
    probe = f"import sys\nsys.argv = [{script!r}, '--help']\nfrom rlhf_core import cli\nsys.exit(cli.{function}())"
    done = _python("-c", probe, cwd=repo_root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {script} [-h]")


def test_a_commands_errors_name_it_as_typed_and_the_name_does_not_stick(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["config", "--no-such-option"])
    assert exited.value.code == 2
    assert "rlhf config: error: unrecognized arguments: --no-such-option" in capsys.readouterr().err
    assert cli.program("python -m rlhf_core.config") == "python -m rlhf_core.config"


def test_arguments_and_exit_codes_pass_through(capsys):
    assert cli.main(["config", "trainer.total_epochs=7", "trainer.seed=12"]) == 0
    tree = yaml.safe_load(capsys.readouterr().out)
    assert tree["trainer"]["total_epochs"] == 7 and tree["trainer"]["seed"] == 12
    assert cli.main(["config", "data.no_such_key=1"]) == 2
    assert "data.no_such_key" in capsys.readouterr().err


@pytest.mark.parametrize("given", [["data.train_batch_size=8"], ["--config", "run.yaml"]])
def test_config_defaults_with_overrides_or_a_file_exits_2_rather_than_ignoring_them(capsys, given):
    with pytest.raises(SystemExit) as exited:
        cli.main(["config", "--defaults", *given])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines()[-1] == ("rlhf config: error: --defaults prints the defaults alone: drop --config "
                                             "and the overrides, or drop --defaults to print the config they resolve to")


def test_an_unknown_command_exits_2_naming_the_valid_ones(capsys):
    assert cli.main(["trian", "--help"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "unknown command 'trian'" in captured.err
    for name in DOCUMENTED:
        assert name in captured.err


def test_no_command_prints_the_usage_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "usage: rlhf <command>" in capsys.readouterr().err


def _is_main_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"


def test_the_library_parses_no_arguments_and_imports_the_commands_only_to_run_them(repo_root):
    misplaced = []
    for path in sorted((repo_root / "rlhf_core").rglob("*.py")):
        if "cli" in path.relative_to(repo_root / "rlhf_core").parts:
            continue
        tree = ast.parse(path.read_text())
        in_main = {id(node) for block in tree.body if _is_main_block(block) for node in ast.walk(block)}
        for node in ast.walk(tree):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name == "argparse" or (name.startswith("rlhf_core.cli") and id(node) not in in_main):
                    misplaced.append(f"{path.relative_to(repo_root)}:{node.lineno} imports {name}")
    assert misplaced == []


def test_a_model_directory_that_is_not_there_exits_2_with_one_line(tmp_path, capsys):
    from rlhf_core.cli.pipeline import evaluate
    from rlhf_core.cli.train import smoke

    missing = tmp_path / "no_model"
    assert smoke([f"actor_rollout_ref.model.path={missing}", f"--work-dir={tmp_path / 'w'}"]) == 2
    assert f"actor_rollout_ref.model.path: {missing} is not a directory" in capsys.readouterr().err
    assert evaluate([str(missing), str(tmp_path / "val.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err



def test_a_folder_given_where_a_file_goes_is_called_a_folder(tmp_path, capsys):
    """A folder passed as the config file or a preference file was said not to exist."""
    from rlhf_core.cli.train import train_rm

    assert cli.main(["config", "--config", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"  - config file {tmp_path} is a folder: name the YAML file in it"
    assert train_rm([f"reward_model.train.train_files={tmp_path}", "reward_model.train.val_files=null"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"reward_model.train.train_files: preference file {tmp_path} is a folder: name its parquet file(s), e.g. "
        "[a.parquet,b.parquet]"]


def test_a_folder_given_as_the_run_config_or_the_gsm8k_solutions_is_called_a_folder(tmp_path, capsys):
    """rlhf-schedule -c FOLDER and rlhf preference --gsm8k-solutions FOLDER said the folder did not exist."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["schedule", "--cron", "0 3 * * *", "-c", str(tmp_path)])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"rlhf schedule: error: run config {tmp_path} is a folder: "
                                                        "name the YAML file in it")
    assert cli.main(["preference", "--gsm8k-solutions", str(tmp_path), "--output", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: {tmp_path} is a folder; point --gsm8k-solutions at example_model_solutions.jsonl of the GSM8K release"]
    (tmp_path / "example_model_solutions.jsonl").write_text("")
    assert cli.main(["preference", "--gsm8k-solutions", str(tmp_path), "--output", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: {tmp_path} is a folder; point --gsm8k-solutions at example_model_solutions.jsonl of the GSM8K "
        f"release: {tmp_path / 'example_model_solutions.jsonl'}"]


def test_a_smoke_work_dir_that_cannot_be_written_exits_2_with_one_line(tmp_path, capsys):
    from rlhf_core.cli.train import smoke

    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    assert smoke([f"--work-dir={a_file}"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --work-dir {a_file}: a file, not a folder; give a folder this user may write"]


def test_a_reward_function_that_fails_in_the_dry_run_exits_2_with_one_line_as_in_ppo(monkeypatch, capsys):
    """The dry run's reward error (or any other rlhf-ppo reports in one line) came out of rlhf smoke as a
    traceback; rlhf-ppo says it in one line and exits 2."""
    from rlhf_core.cli import train
    from rlhf_core.rewards.manager import NonFiniteReward

    said = ("reward function 'compute_score' returned a non-finite score (nan) for sample 0 "
            "(data_source='synthetic/arithmetic'); a score must be a finite number")
    for command, patched in ((train.smoke, "run_smoke_test"), (train.ppo, "run")):
        monkeypatch.setattr(train, patched, _failing_with(NonFiniteReward(said, "compute_score", 0, "s")))
        assert command([]) == 2
        assert capsys.readouterr().err.splitlines() == [f"error: {said}"]


def test_an_output_folder_that_cannot_be_made_exits_2_with_one_line(tmp_path, capsys, monkeypatch):
    """An --output (or --html) that cannot be written came out as the OSError's traceback, the HTML report's after
    the whole evaluation; a file in the way stands in here for a read-only folder (the tests may run as root)."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    out = a_file / "out"
    for argv in (["synthetic", "--output", str(out), "--n-train", "4", "--n-test", "2"],
                 ["preference", "--synthetic", "--output", str(out), "--n-train", "4", "--n-val", "2"]):
        assert cli.main(argv) == 2, argv
        assert capsys.readouterr().err.splitlines() == [
            f"error: {out}: Not a directory; give an --output folder this user may write"]
    # an --output written with ~ (as gsm8k's default is), which the shell leaves where '=' joins it to the option:
    # the home folder's, as the trainer reads it (synthetic and preference made a folder named '~' here)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for argv in (["synthetic", "--output=~/notes.txt/out", "--n-train", "4", "--n-test", "2"],
                 ["preference", "--synthetic", "--output=~/notes.txt/out", "--n-train", "4", "--n-val", "2"]):
        assert cli.main(argv) == 2, argv
        assert capsys.readouterr().err.splitlines() == [
            f"error: {out}: Not a directory; give an --output folder this user may write"]
    assert cli.main(["synthetic", "--output=~/made", "--n-train", "4", "--n-test", "2"]) == 0
    assert (tmp_path / "made" / "train.parquet").is_file() and not (tmp_path / "~").exists()
    capsys.readouterr()
    assert cli.main(["toy-model", "--preset", "test", "--output=~/notes.txt/out"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: cannot build into {out}: Not a directory; give --output a folder this user may write"]
    assert cli.main(["gguf", "--gguf=~/missing.gguf", "--output=~/imported"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: --gguf {tmp_path / 'missing.gguf'}: no such file"]
    assert not (tmp_path / "~").exists() and not (tmp_path / "imported").exists()
    assert cli.main(["toy-model", "--preset", "test", "--output", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: cannot build into {out}: Not a directory; give --output a folder this user may write"]
    with pytest.raises(SystemExit) as exited:  # before the model or the data are read
        cli.main(["evaluate", str(tmp_path / "model"), str(tmp_path / "val.parquet"), "--html", str(tmp_path)])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"rlhf evaluate: error: --html {tmp_path}: a folder; name "
                                                        "the file to write")


def test_a_file_given_as_the_output_folder_is_called_a_file(tmp_path, capsys):
    """An --output that names a file, not a folder, was told as the folder's mkdir error: '[Errno 17] File exists'."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    gsm8k = tmp_path / "gsm8k"
    gsm8k.mkdir()
    for split in ("train", "test"):
        (gsm8k / f"{split}.jsonl").write_text('{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\\n#### 5"}\n')
    for argv in (["synthetic", "--output", str(a_file), "--n-train", "4", "--n-test", "2"],
                 ["preference", "--synthetic", "--output", str(a_file), "--n-train", "4", "--n-val", "2"],
                 ["gsm8k", "--input", str(gsm8k), "--output", str(a_file)]):
        assert cli.main(argv) == 2, argv
        assert capsys.readouterr().err.splitlines() == [
            f"error: {a_file}: a file, not a folder; give an --output folder this user may write"], argv

def _data_command(kind, source, out, *extra):
    return {"gsm8k": ["gsm8k", "--input", str(source), "--output", str(out)],
            "synthetic": ["synthetic", "--output", str(out), "--n-train", "4", "--n-test", "2"],
            "preference": ["preference", "--synthetic", "--output", str(out), "--n-train", "4", "--n-val", "2"]}[kind] \
        + list(extra)


@pytest.mark.parametrize("kind", ["gsm8k", "synthetic", "preference"])
def test_a_data_command_stopped_while_writing_leaves_no_output_or_the_previous_one(kind, tmp_path, monkeypatch,
                                                                                 capsys):
    """A Ctrl-C after the first file was written left it in the output folder (a train.parquet without its test
    split, which a later run took for existing output, or, with --overwrite, a new train.parquet beside the old
    test.parquet), and an interrupted first write an empty folder: now both files appear, or none."""
    import pandas as pd

    source = tmp_path / "in"
    source.mkdir()
    for split, rows in (("train", 3), ("test", 2)):
        (source / f"{split}.jsonl").write_text("".join(
            f'{{"question": "What is {i} + 1?", "answer": "{i} + 1 = {i + 1}\\n#### {i + 1}"}}\n'
            for i in range(rows)))
    write = pd.DataFrame.to_parquet
    calls = []

    def first_file_then_ctrl_c(frame, *args, **kwargs):
        calls.append(frame)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return write(frame, *args, **kwargs)

    out = tmp_path / "new" / "data"  # neither folder there yet
    monkeypatch.setattr(pd.DataFrame, "to_parquet", first_file_then_ctrl_c)
    assert cli.main(_data_command(kind, source, out)) == 130
    assert len(calls) == 2 and not (tmp_path / "new").exists()
    monkeypatch.setattr(pd.DataFrame, "to_parquet", write)
    assert cli.main(_data_command(kind, source, out)) == 0
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    assert sorted(before) == sorted({"preference": ["train.parquet", "val.parquet"]}.get(
        kind, ["train.parquet", "test.parquet"]))
    calls.clear()
    monkeypatch.setattr(pd.DataFrame, "to_parquet", first_file_then_ctrl_c)
    # other problems, so that a file written now would differ from the one before
    (source / "train.jsonl").write_text('{"question": "What is 5 + 5?", "answer": "5 + 5 = 10\\n#### 10"}\n')
    seed = [] if kind == "gsm8k" else ["--seed", "1"]
    assert cli.main(_data_command(kind, source, out, "--overwrite", *seed)) == 130
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert capsys.readouterr().err.splitlines()[-1].startswith("interrupted by SIGINT: rlhf ")


# --- rlhf-ppo: a reward function that fails mid-run ---------------------------------------------------------

# The tiny run scores 8 prompts x 2 responses a step; these fail from the second step's first response on.
NAN_FROM_STEP_2 = (
    "calls = [0]\n"
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    calls[0] += 1\n"
    "    return float('nan') if calls[0] > 16 else float(solution_str[:1].isdigit())\n"
)
RAISES_FROM_STEP_2 = (
    "calls = [0]\n"
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    calls[0] += 1\n"
    "    if calls[0] > 16:\n"
    "        raise KeyError('no rubric for this answer')\n"
    "    return float(solution_str[:1].isdigit())\n"
)
RAISES_IN_VALIDATION = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    if extra_info['split'] == 'test':\n"
    "        raise ValueError('the grader is down')\n"
    "    return float(solution_str[:1].isdigit())\n"
)


def _only_step_1_saved(out):
    """The step-1 checkpoint is the latest, whole (every file's size and hash as its manifest says), and
    nothing of step 2 was written, not even a staging folder."""
    from rlhf_core.training import checkpoint

    latest = checkpoint.latest_checkpoint(out)
    assert latest == out / "global_step_1"
    checkpoint.read_manifest(latest, verify=True)
    assert checkpoint.read_trainer_state(latest)["global_step"] == 1
    assert sorted(p.name for p in out.iterdir() if "global_step" in p.name) == ["global_step_1"]


@pytest.mark.parametrize(("reward", "extra", "said"), [
    (NAN_FROM_STEP_2, [], ["error: training step 2 failed: reward function 'compute_score' returned a non-finite "
                           "score (nan) for sample 0 (data_source='synthetic/arithmetic'); a score must be a finite number"]),
    (RAISES_FROM_STEP_2, [], ["error: training step 2 failed: reward function 'compute_score' failed on sample 0 "
                              "(data_source='synthetic/arithmetic', extra_info.index=<n>): KeyError: 'no rubric for "
                              "this answer'"]),
    (RAISES_IN_VALIDATION, ["trainer.test_freq=2"],
     ["error: validating after step 2 failed: reward function 'compute_score' failed on sample 0 "
      "(data_source='synthetic/arithmetic', extra_info.index=<n>): ValueError: the grader is down"]),
], ids=["nan", "raises", "raises-in-validation"])
def test_a_failing_reward_function_exits_2_naming_the_step_and_sample_and_the_intact_checkpoint(
        workspace, one_thread, tmp_path, capsys, reward, extra, said):
    from rlhf_core.cli.train import ppo

    (tmp_path / "reward.py").write_text(reward)
    out = tmp_path / "out"
    code = ppo(workspace.overrides(out, f"custom_reward_function.path={tmp_path / 'reward.py'}",
                                   "trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.test_freq=-1",
                                   *extra))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()[-2:]  # the message's two lines end the output
    # <n>: the problem's index in its file, whichever the sampler drew first
    assert re.fullmatch(re.escape(said[0]).replace("<n>", "[0-9]+"), lines[0]), lines[0]
    assert lines[1] == (f"the latest checkpoint {out / 'global_step_1'} is intact: fix the reward function "
                        "(an edit of its code also needs trainer.allow_reward_code_change=true), then rerun the same "
                        "command to resume from it")
    assert "Traceback" not in err
    _only_step_1_saved(out)


def test_a_run_runs_its_reward_file_once(workspace, one_thread, tmp_path, capsys):
    """The preflight loaded the reward file and the trainer loaded it again: top-level code that cannot run twice
    in a process (a metric registered with prometheus_client) passed the preflight, then failed the run with a
    traceback (exit 1), and any costly set-up (a judge model) was done twice."""
    from rlhf_core.cli.train import ppo

    loads = tmp_path / "loads.txt"
    (tmp_path / "reward.py").write_text(
        f"with open({str(loads)!r}, 'a') as log:\n    log.write('loaded\\n')\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0 if solution_str[:1].isdigit() else 0.0\n")
    code = ppo(workspace.overrides(tmp_path / "out", f"custom_reward_function.path={tmp_path / 'reward.py'}",
                                   "trainer.total_training_steps=1", "trainer.test_freq=-1"))
    assert code == 0, capsys.readouterr().err
    assert loads.read_text() == "loaded\n"


# --- rlhf-ppo: Ctrl-C and SIGTERM, the handler's messages ----------------------------------------------------


def _fake_trainer(root, step=0):
    """What :func:`main_ppo.stop_on_signals` reads of a trainer: its step, the step under way, its stop flag and
    checkpoint folder."""
    from types import SimpleNamespace

    return SimpleNamespace(global_step=step, step_under_way=None, stop_requested=None, checkpoint_dir=root)


def _signal(sig=signal.SIGINT):
    signal.getsignal(sig)(sig, None)  # the handler stop_on_signals installed, as Python would call it


def _save_step(root, step):
    from rlhf_core.training.checkpoint import write_checkpoint

    return write_checkpoint(root, step, lambda files: [])


def test_a_signal_while_a_step_is_validated_or_saved_says_that_step_is_the_last(tmp_path, capsys):
    # the loop checks between steps: a step already trained (its validation or save under way) is the last one
    trainer = _fake_trainer(tmp_path, step=3)  # step 3 trained; its validation and save follow
    with main_ppo.stop_on_signals(trainer):
        _signal()
    err = capsys.readouterr().err
    assert trainer.stop_requested == ("SIGINT", signal.SIGINT)
    assert "received SIGINT: stopping after step 3, once what is left of it" in err
    assert "step 4 will not start" in err and "finishing step 4" not in err


def test_a_signal_during_a_steps_training_says_that_step_is_finished_first(tmp_path, capsys):
    trainer = _fake_trainer(tmp_path, step=2)
    trainer.step_under_way = 3  # fit_step has drawn step 3's batch and trains it
    with main_ppo.stop_on_signals(trainer):
        _signal(signal.SIGTERM)
    err = capsys.readouterr().err
    assert "received SIGTERM: finishing step 3 (with its validation, if due, and checkpoint), then stopping" in err


@pytest.mark.usefixtures("one_thread")
def test_the_trainer_says_which_step_is_under_way(workspace, tmp_path):
    """What the stop handler reads: set from the drawing of a step's batch to the end of its training."""
    trainer = build_trainer(load_config(workspace.overrides(tmp_path / "run", "trainer.total_training_steps=1",
                                                            "trainer.test_freq=1")))
    seen = {}
    train_step, validate = trainer.train_step, trainer.validate

    def recording_train_step(batch):
        seen["training"] = trainer.step_under_way
        return train_step(batch)

    def recording_validate():
        seen["validating"] = trainer.step_under_way
        return validate()

    trainer.train_step, trainer.validate = recording_train_step, recording_validate
    trainer.fit_step()
    assert seen == {"training": 1, "validating": None} and trainer.step_under_way is None


@pytest.mark.usefixtures("one_thread")
def test_a_run_started_afresh_says_how_to_resume_it(workspace, tmp_path):
    """Rerunning a command with trainer.resume_mode=disable would start afresh again (its checkpoints' marker
    removed): the interrupted run's message names resume_mode=auto instead of the same command."""
    from rlhf_core.training.guards import TrainingInterrupted

    trainer = build_trainer(load_config(workspace.overrides(tmp_path / "run", "trainer.resume_mode=disable")))
    trainer.fit_step(validate=lambda step, metrics: False)
    trainer.stop_requested = ("SIGINT", signal.SIGINT)
    with pytest.raises(TrainingInterrupted, match=r"checkpoint saved at .*global_step_1; rerun with "
                                                  r"trainer.resume_mode=auto to resume$"):
        trainer._stop_if_requested()


def test_a_signal_before_the_first_step_says_so(tmp_path, capsys):
    trainer = _fake_trainer(tmp_path)
    with main_ppo.stop_on_signals(trainer):  # e.g. the validation before training
        _signal()
    assert "received SIGINT: stopping before step 1" in capsys.readouterr().err


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.parametrize("saved", [True, False])
def test_a_second_signal_stops_now_naming_the_checkpoint_left_as_it_was(tmp_path, monkeypatch, capsys, sig, code,
                                                                        saved):
    from rlhf_core.cli import train

    latest = _save_step(tmp_path, 2) if saved else None
    trainer = _fake_trainer(tmp_path, step=3)

    def run(cfg):  # the second signal arrives in step 3's checkpoint save, a real one (not a call of the handler)
        with main_ppo.stop_on_signals(trainer):
            signal.raise_signal(sig)
            try:
                signal.raise_signal(sig)
                time.sleep(5)  # (not reached: the handler raises as the signal arrives)
            except KeyboardInterrupt as exc:  # as torch's zip writer does with it: another error in its place
                raise RuntimeError("unexpected pos 317632 vs 317584") from exc

    monkeypatch.setattr(train, "run", run)
    before = signal.getsignal(sig)
    assert train.ppo([]) == code
    assert signal.getsignal(sig) is before
    name = signal.Signals(sig).name
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith(f"received {name}: stopping after step 3")
    kept = (f"the latest checkpoint {latest} is as it was: rerun the same command to resume from it" if saved
            else "no checkpoint was saved yet")
    assert lines[1:] == [f"second {name}: stopped now without saving; {kept}"]



def _ctrl_c_in(command, argv):
    """``command(argv)``, where a Ctrl-C arrives under Python's own handler (as while a run checks its input or
    loads its models, before the training steps' handler is in place): it must not come out as a traceback."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return command(argv)
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C came out of the command as a KeyboardInterrupt (a traceback)")
    finally:
        signal.signal(signal.SIGINT, previous)


# Put before a console script's two lines: this process is sent SIGINT as it first imports one of the packages a
# command's first seconds go to (torch, ZenML, ...), inside that import, where a Ctrl-C is most likely to come.
CTRL_C_AS_IT_STARTS = """\
import importlib.abc
import os
import signal
import sys


class CtrlCAtImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in {"torch", "transformers", "zenml", "pandas", "numpy", "yaml", "hydra",
                                          "omegaconf"}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None


sys.meta_path.insert(0, CtrlCAtImport())
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal starts it (a harness run in the
# background hands its processes SIGINT ignored, and Python then keeps it ignored)
"""

# each console script, with arguments that take it past its imports, and the name its line gives it
SCRIPTS = {"rlhf": (["ppo", "--help"], "rlhf ppo"), "rlhf-ppo": (["--help"], "rlhf-ppo"),
           "rlhf-train-rm": (["--help"], "rlhf-train-rm"), "rlhf-lineage": (["--model", "m"], "rlhf-lineage"),
           "rlhf-schedule": (["--help"], "rlhf-schedule"), "rlhf-demo-summary": (["m"], "rlhf-demo-summary")}


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_ctrl_c_as_a_console_script_starts_exits_130_with_one_line(repo_root, tmp_path, script):
    """A Ctrl-C while a command imports torch or ZenML, in its first seconds, came out of its console script as a
    traceback (the script imported the command's module before any of the command's code ran)."""
    table = (repo_root / "pyproject.toml").read_text().split("[project.scripts]\n")[1].split("\n[")[0]
    scripts = dict(re.findall(r'^([\w-]+) = "([^"]+)"$', table, re.M))  # (tomllib is Python 3.11's)
    assert set(scripts) == set(SCRIPTS)
    module, function = scripts[script].split(":")
    runner = tmp_path / script  # what pip writes as the script, after the Ctrl-C's hook
    runner.write_text(CTRL_C_AS_IT_STARTS + f"from {module} import {function}\nsys.exit({function}())\n")
    argv, name = SCRIPTS[script]
    env = {**os.environ, "PYTHONPATH": str(repo_root), "ZENML_CONFIG_PATH": str(tmp_path / "zenml")}
    done = subprocess.run([sys.executable, str(runner), *argv], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=120)
    assert (done.returncode, done.stderr.splitlines()) == (
        130, [f"interrupted by SIGINT: {name} stopped as it started: nothing was done"]), done.stderr[-2000:]


# the modules ``python -m`` runs as commands (the README's and the commands' usage lines name them), each with
# arguments that take it to its first import of torch, pandas, ZenML or Hydra (--help, where it parses after them;
# arguments it takes, where it imports them once it has parsed: each would write into ``out``)
PYTHON_M = {"rlhf_core.main_ppo": ["--help"], "rlhf_core.training.reward_trainer": ["--help"],
            "rlhf_core.pipeline.smoke": ["--help"], "rlhf_core.pipeline.evaluate": ["--help"],
            "rlhf_core.pipeline.lineage": ["--help"], "rlhf_core.pipeline.schedule": ["--help"],
            "rlhf_core.config": ["--help"], "rlhf_core.models.toy": ["--preset", "test", "--output", "out"],
            "rlhf_core.data.gsm8k": ["--input", "in", "--output", "out"],
            "rlhf_core.data.synthetic": ["--output", "out", "--n-train", "4", "--n-test", "2"],
            "rlhf_core.data.preference": ["--synthetic", "--output", "out"],
            "rlhf_core.data.validation": ["train.parquet", "--html", "out"]}


def _python_m_at_a_ctrl_c(repo_root, tmp_path, module: str, argv: list[str]) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGV...`` in ``tmp_path``, sent SIGINT as it first imports torch, ZenML, pandas, ..."""
    runner = tmp_path / "python_m"  # what ``python -m`` does, after the Ctrl-C's hook
    runner.write_text(CTRL_C_AS_IT_STARTS + "import runpy\n"
                      f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")
    env = {**os.environ, "PYTHONPATH": str(repo_root), "ZENML_CONFIG_PATH": str(tmp_path / "zenml")}
    return subprocess.run([sys.executable, str(runner), *argv], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=120)


@pytest.mark.parametrize("module", PYTHON_M)
def test_a_ctrl_c_as_python_m_starts_exits_130_with_one_line(repo_root, tmp_path, module):
    """``python -m rlhf_core.<module>`` ran the module itself, whose own imports (torch, pandas, Hydra) came before
    any code that could take a Ctrl-C, or its ``__main__`` block imported the command's module (ZenML) outside
    it: it came out as a traceback. (The toy model's and the data commands import torch or pandas once they have
    parsed their arguments.)"""
    done = _python_m_at_a_ctrl_c(repo_root, tmp_path, module, PYTHON_M[module])
    assert (done.returncode, done.stderr.splitlines()) == (
        130, [f"interrupted by SIGINT: python -m {module} stopped as it started: nothing was done"]), \
        done.stderr[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["evaluate", "model", "val.parquet"],
                                  ["schedule", "--every", "60", "-c", "retrain.yaml"]])
def test_a_ctrl_c_as_evaluate_or_schedule_imports_past_its_arguments_says_nothing_was_done(repo_root, tmp_path,
                                                                                       argv):
    """Past their arguments, the evaluation and the schedule import torch and pandas outside the guard the other
    commands put around those imports: a Ctrl-C there said the command stopped before it finished, where it had
    done nothing."""
    (tmp_path / "retrain.yaml").write_text("parameters: {}\n")
    runner = tmp_path / "rlhf"  # the console script, after the Ctrl-C's hook, here at the command's own imports
    start = CTRL_C_AS_IT_STARTS.index("name.partition")
    heavy = CTRL_C_AS_IT_STARTS[start:CTRL_C_AS_IT_STARTS.index(":\n", start)]  # the condition of its if
    hook = CTRL_C_AS_IT_STARTS.replace(heavy, 'name in ("rlhf_core.config", "rlhf_core.pipeline.run_config")')
    runner.write_text(hook + "from rlhf_core.cli import main\nsys.exit(main())\n")
    env = {**os.environ, "PYTHONPATH": str(repo_root), "ZENML_CONFIG_PATH": str(tmp_path / "zenml")}
    done = subprocess.run([sys.executable, str(runner), *argv], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=120)
    assert (done.returncode, done.stderr.splitlines()) == (
        130, [f"interrupted by SIGINT: rlhf {argv[0]} stopped as it started: nothing was done"]), done.stderr[-2000:]


def test_a_ctrl_c_as_a_gguf_import_reads_its_file_exits_130_with_one_line_and_leaves_no_folder(repo_root, tmp_path):
    """The GGUF import parses its arguments and checks its output folder before it imports the GGUF reader (numpy)
    and then transformers: a Ctrl-C there is one line, and the import leaves nothing behind."""
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + bytes(60))
    done = _python_m_at_a_ctrl_c(repo_root, tmp_path, "rlhf_core.models.gguf",
                                 ["--gguf", "model.gguf", "--output", "out"])
    assert (done.returncode, done.stderr.splitlines()) == (
        130, ["interrupted by SIGINT: python -m rlhf_core.models.gguf stopped before it finished"]), \
        done.stderr[-2000:]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.gguf", "python_m"]


def test_a_ctrl_c_during_the_dry_run_exits_130_with_one_line(monkeypatch, capsys):
    """python -m rlhf_core.pipeline.smoke calls the command itself: a Ctrl-C in the dry run came out as a
    traceback."""
    from rlhf_core.cli import train

    monkeypatch.setattr(train, "run_smoke_test", lambda cfg, work_dir: signal.raise_signal(signal.SIGINT))
    assert _ctrl_c_in(train.smoke, []) == 130
    assert capsys.readouterr().err.splitlines() == [
        "interrupted by SIGINT: the dry run stopped before its checks ended; it wrote nothing of the run's"]


@pytest.mark.parametrize("saves_on_interrupt", [True, False])
@pytest.mark.parametrize("resume_mode", ["auto", "resume_path"])
def test_a_ctrl_c_outside_the_training_steps_exits_130_naming_the_checkpoint_left(tmp_path, monkeypatch, capsys,
                                                                                  resume_mode, saves_on_interrupt):
    """A folder whose latest is step 5: auto names it; a run sent back to step 2, stopped before it saved, names
    step 2, which the same command resumes again, where resume_mode=auto would take step 5, the checkpoints it set
    out to leave."""
    from rlhf_core.cli import train

    _save_step(tmp_path, 2)
    _save_step(tmp_path, 5)

    def run(cfg):  # e.g. the models loading: Python's handler raises KeyboardInterrupt
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(train, "run", run)
    argv = [f"trainer.default_local_dir={tmp_path}", f"trainer.save_on_interrupt={saves_on_interrupt}"]
    if resume_mode == "resume_path":
        argv += ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path}/global_step_2"]
    latest = tmp_path / ("global_step_2" if resume_mode == "resume_path" else "global_step_5")
    assert _ctrl_c_in(train.ppo, argv) == 130
    said = ("interrupted by SIGINT outside the training steps (while the run started or closed): stopped at once, no "
            f"trained step lost; the latest checkpoint is {latest}" if saves_on_interrupt
            else "interrupted by SIGINT: stopped at once without saving (trainer.save_on_interrupt=false); the latest "
                 f"checkpoint {latest} is as it was: rerun the same command to resume from it")
    assert capsys.readouterr().err.splitlines() == [said]


@pytest.mark.usefixtures("one_thread")
def test_a_ctrl_c_in_a_resume_path_run_names_the_path_until_the_run_saves(workspace, tmp_path, monkeypatch, capsys):
    """With trainer.save_on_interrupt=false a Ctrl-C in a step (or as the checkpoint loads) leaves the run as
    KeyboardInterrupt: before the run sent back to step 2 saves, the same command resumes step 2 again; once it has
    saved step 3, its own step 3 is the latest, which only resume_mode=auto resumes (the same command would go back
    to step 2)."""
    from rlhf_core.cli import train
    from rlhf_core.training.trainer import PPOTrainer

    out = tmp_path / "out"
    assert train.ppo(workspace.overrides(out, "trainer.total_training_steps=4", "trainer.save_freq=1",
                                         "trainer.test_freq=-1")) == 0
    capsys.readouterr()
    train_step = PPOTrainer.train_step
    stop_in = []

    def interrupted(self, prompts):
        if self.global_step + 1 in stop_in:  # Python's handler raises KeyboardInterrupt in the step
            signal.raise_signal(signal.SIGINT)
        return train_step(self, prompts)

    load_checkpoint = PPOTrainer.load_checkpoint

    def loading(self, path):  # the trainer built, the checkpoint not yet loaded
        if "load" in stop_in:
            signal.raise_signal(signal.SIGINT)
        return load_checkpoint(self, path)

    monkeypatch.setattr(PPOTrainer, "train_step", interrupted)
    monkeypatch.setattr(PPOTrainer, "load_checkpoint", loading)
    argv = workspace.overrides(out, "trainer.total_training_steps=4", "trainer.save_freq=1", "trainer.test_freq=-1",
                               "trainer.resume_mode=resume_path", f"trainer.resume_from_path={out}/global_step_2",
                               "trainer.save_on_interrupt=false")
    for step, kept in (("load", f"{out}/global_step_2 is as it was: rerun the same command"),
                       (3, f"{out}/global_step_2 is as it was: rerun the same command"),
                       (4, f"{out}/global_step_3 is as it was: rerun with trainer.resume_mode=auto")):
        stop_in[:] = [step]
        assert _ctrl_c_in(train.ppo, argv) == 130
        assert capsys.readouterr().err.splitlines()[-1] == (
            "interrupted by SIGINT: stopped at once without saving (trainer.save_on_interrupt=false); the latest "
            f"checkpoint {kept} to resume from it")


# A SIGTERM where the training steps' handler is not in place: Python's default ended the process at once, killed
# by the signal, with no line naming the checkpoint left (and, after ray.init, Ray's C++ handler aborted it). It is
# sent in a process of its own: without the command's handler it would end the test run.
SIGTERM_AS_IT_LOADS = """\
import signal
import sys

from rlhf_core import cli
from rlhf_core.cli import train


def loading(*args):  # the models or a checkpoint loading, or a step with trainer.save_on_interrupt=false
    if sys.argv[1] == "ppo-in-ray-get":  # Ray raises a KeyboardInterrupt of its own for what the handler raised
        try:
            signal.raise_signal(signal.SIGTERM)
        except KeyboardInterrupt:
            pass
        raise KeyboardInterrupt
    signal.raise_signal(signal.SIGTERM)


train.run = loading  # rlhf-ppo
train.preflight = lambda cfg: None  # rlhf-train-rm
train.RewardModelTrainer = loading
command = sys.argv[1].removesuffix("-in-ray-get")
sys.exit(cli._run(command, sys.argv[2:], "rlhf-" + command))
"""


@pytest.mark.parametrize(("saves_on_interrupt", "ppo"), [(True, "ppo"), (False, "ppo"), (False, "ppo-in-ray-get")])
def test_a_sigterm_outside_the_training_steps_exits_143_naming_the_checkpoint_left(repo_root, tmp_path,
                                                                                  saves_on_interrupt, ppo):
    latest = _save_step(tmp_path / "ppo", 2)
    runner = tmp_path / "runner.py"
    runner.write_text(SIGTERM_AS_IT_LOADS)
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    # both commands at once, each in its own folder: their seconds go to imports, and neither reads the other's
    commands = ([ppo, f"trainer.default_local_dir={tmp_path / 'ppo'}", f"trainer.save_on_interrupt={saves_on_interrupt}"],
                ["train-rm", f"reward_model.train.default_local_dir={tmp_path / 'rm'}"])
    started = [subprocess.Popen([sys.executable, str(runner), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=tmp_path, env=env) for argv in commands]
    (_, ppo_err), (_, rm_err) = [process.communicate(timeout=120) for process in started]
    said = ("interrupted by SIGTERM outside the training steps (while the run started or closed): stopped at once, no "
            f"trained step lost; the latest checkpoint is {latest}" if saves_on_interrupt
            else "interrupted by SIGTERM: stopped at once without saving (trainer.save_on_interrupt=false); the "
                 f"latest checkpoint {latest} is as it was: rerun the same command to resume from it")
    assert (started[0].returncode, ppo_err.splitlines()) == (143, [said]), ppo_err[-2000:]
    assert (started[1].returncode, rm_err.splitlines()) == (143, [
        "interrupted by SIGTERM outside the training steps (while the run started or closed): stopped at once, no "
        "trained step lost; no checkpoint is saved"]), rm_err[-2000:]


@pytest.mark.parametrize("script", ["rlhf-ppo", "rlhf-train-rm"])
def test_a_sigterm_as_a_training_command_starts_exits_143_with_one_line(repo_root, tmp_path, script):
    module, function = {"rlhf-ppo": ("rlhf_core.cli", "rlhf_ppo"),
                        "rlhf-train-rm": ("rlhf_core.cli", "rlhf_train_rm")}[script]
    runner = tmp_path / script  # SIGTERM in place of the Ctrl-C, as the command first imports torch
    runner.write_text(CTRL_C_AS_IT_STARTS.replace("signal.SIGINT)\n", "signal.SIGTERM)\n", 1)
                      + f"from {module} import {function}\nsys.exit({function}())\n")
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    done = subprocess.run([sys.executable, str(runner), "--help"], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=120)
    assert (done.returncode, done.stderr.splitlines()) == (
        143, [f"interrupted by SIGTERM: {script} stopped as it started: nothing was done"]), done.stderr[-2000:]


def test_ray_init_leaves_the_commands_sigterm_handler_in_place(monkeypatch):
    """ray.init puts in a SIGTERM handler of its own, sys.exit(15): a SIGTERM between the workers' start and the
    training steps (or with trainer.save_on_interrupt=false) then ended rlhf-ppo with status 15 and no line, or with
    Ray's C++ handler, an abort. The command's handler stays; a default one is Ray's to replace, as before."""
    from types import SimpleNamespace

    import ray

    from rlhf_core.workers.group import ensure_ray

    def rays_handler(signum, frame):
        sys.exit(signum)

    def init(**kwargs):
        signal.signal(signal.SIGTERM, rays_handler)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node"))
    monkeypatch.setattr("rlhf_core.workers.group._connection", None)  # (restored after: what this test connects)
    before = signal.getsignal(signal.SIGTERM)
    try:
        with cli.sigterm_as_interrupt():
            commands = signal.getsignal(signal.SIGTERM)
            ensure_ray(None, 1, "cpu")
            assert signal.getsignal(signal.SIGTERM) is commands
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        ensure_ray(None, 1, "cpu")
        assert signal.getsignal(signal.SIGTERM) is rays_handler
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_ctrl_c_while_the_reward_model_loads_exits_130_saying_nothing_was_saved(tmp_path, monkeypatch, capsys):
    from rlhf_core.cli import train

    def loading(cfg, frames):
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(train, "preflight", lambda cfg: None)
    monkeypatch.setattr(train, "RewardModelTrainer", loading)
    assert _ctrl_c_in(train.train_rm, [f"reward_model.train.default_local_dir={tmp_path / 'rm'}"]) == 130
    assert capsys.readouterr().err.splitlines() == [
        "interrupted by SIGINT outside the training steps (while the run started or closed): stopped at once, no "
        "trained step lost; no checkpoint is saved"]


@pytest.mark.parametrize("resume_mode", ["auto", "resume_path"])
def test_a_ctrl_c_while_the_reward_model_loads_names_the_checkpoint_a_rerun_resumes(tmp_path, monkeypatch, capsys,
                                                                                   resume_mode):
    """As PPO's: a folder whose latest is step 5; a run sent back to step 2, stopped as its trainer is built (nothing
    loaded or saved), names step 2 and the same command, where resume_mode=auto would take step 5."""
    from rlhf_core.cli import train

    _save_step(tmp_path, 2)
    _save_step(tmp_path, 5)

    def loading(cfg, frames):
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(train, "preflight", lambda cfg: None)
    monkeypatch.setattr(train, "RewardModelTrainer", loading)
    argv = [f"reward_model.train.default_local_dir={tmp_path}", "trainer.save_on_interrupt=false"]
    if resume_mode == "resume_path":
        argv += ["reward_model.train.resume_mode=resume_path",
                 f"reward_model.train.resume_from_path={tmp_path}/global_step_2"]
    assert _ctrl_c_in(train.train_rm, argv) == 130
    latest = tmp_path / ("global_step_2" if resume_mode == "resume_path" else "global_step_5")
    assert capsys.readouterr().err.splitlines() == [
        "interrupted by SIGINT: stopped at once without saving (trainer.save_on_interrupt=false); the latest "
        f"checkpoint {latest} is as it was: rerun the same command to resume from it"]


def test_a_ctrl_c_while_a_failed_run_closes_says_the_failure_with_its_status(tmp_path, monkeypatch, capsys):
    """A guard's stop (PPO) or a worker's failure (reward model) on its way out when a Ctrl-C comes (the run closing
    its workers or trackers): the failure is said, with its own status, not hidden behind "no trained step lost"
    and 130."""
    import contextlib
    from types import SimpleNamespace

    from rlhf_core.cli import train
    from rlhf_core.training.guards import GuardError
    from rlhf_core.workers.group import WorkerError

    def closing_after(error):
        def failing(*args):
            try:
                raise error
            finally:  # (the run closes its workers as the error leaves)
                signal.raise_signal(signal.SIGINT)
        return failing

    monkeypatch.setattr(train, "run", closing_after(GuardError("KL 812.3 above trainer.max_kl 10")))
    assert _ctrl_c_in(train.ppo, [f"trainer.default_local_dir={tmp_path}"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: KL 812.3 above trainer.max_kl 10",
        "(a Ctrl-C came while the run closed after that; nothing else was lost)"]

    def failing(log):
        raise WorkerError("worker rank 1 died")

    def trainer(cfg, frames):  # the Ctrl-C comes as the workers shut down, after the steps' handler is gone
        return SimpleNamespace(local_dir=tmp_path / "rm", total_steps=4, global_step=0, resumed_from=None,
                               stop_requested=None, started=contextlib.nullcontext, train=failing,
                               shutdown=lambda: signal.raise_signal(signal.SIGINT))

    monkeypatch.setattr(train, "preflight", lambda cfg: None)
    monkeypatch.setattr(train, "RewardModelTrainer", trainer)
    assert _ctrl_c_in(train.train_rm, [f"reward_model.train.default_local_dir={tmp_path / 'rm'}"]) == 1
    assert capsys.readouterr().err.splitlines()[-2:] == [
        "error: worker rank 1 died", "(a Ctrl-C came while the run closed after that; nothing else was lost)"]
    # a Ctrl-C while some code handles an error of its own (a library's fallback on a KeyError) is a Ctrl-C alone
    monkeypatch.setattr(train, "run", closing_after(KeyError("tokenizer_class")))
    assert _ctrl_c_in(train.ppo, [f"trainer.default_local_dir={tmp_path}"]) == 130
    assert capsys.readouterr().err.splitlines() == [
        "interrupted by SIGINT outside the training steps (while the run started or closed): stopped at once, no "
        "trained step lost; no checkpoint is saved"]


def test_a_reward_model_worker_that_fails_exits_1_as_ppos_workers(tmp_path, monkeypatch, capsys):
    """Exit 1 is a run that failed (PPO: a guard's stop or a worker's failure), 2 input refused; rlhf-train-rm
    alone gave a failed worker 3."""
    import contextlib
    from types import SimpleNamespace

    from rlhf_core.cli import train
    from rlhf_core.workers.group import WorkerError

    def train_steps(log):
        raise WorkerError("worker rank 1 (pid 4242) died during train_step")

    def trainer(cfg, frames):
        return SimpleNamespace(local_dir=tmp_path / "rm", total_steps=4, global_step=0, resumed_from=None,
                               started=contextlib.nullcontext, train=train_steps, shutdown=lambda: None)

    monkeypatch.setattr(train, "preflight", lambda cfg: None)
    monkeypatch.setattr(train, "RewardModelTrainer", trainer)
    assert train.train_rm([f"reward_model.train.default_local_dir={tmp_path / 'rm'}"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == "error: worker rank 1 (pid 4242) died during train_step"


def _failing_with(error):
    def failing(*args, **kwargs):
        raise error
    return failing


@pytest.mark.parametrize("error, said, status", [
    ("CheckpointError", "checkpoint /runs/global_step_2 could not be written: No space left on device", 2),
    ("ModelError", "reward_model.train.model.path: /models/rm has no weights", 2),
    ("WorkerError", "error: worker rank 1 (pid 4242) died during train_step", 1),
    ("GuardError", "error: KL 812.3 above trainer.max_kl 10", 1),
    ("NothingToTrain", "error: training step 3 failed: dynamic sampling: 1 prompt group(s) kept in 4 generation "
                       "batches, fewer than one mini-batch of 2 prompts that every worker can share", 1),
])
def test_ppo_and_train_rm_report_a_failure_alike(tmp_path, monkeypatch, capsys, error, said, status):
    """rlhf-ppo and rlhf-train-rm say a failure in one way, same line and status: rlhf-train-rm put "error: "
    before a checkpoint's error, which rlhf-ppo does not, and a model that failed to load while the reward model
    started came out of it as a traceback (rlhf-ppo: one line, exit 2)."""
    import contextlib
    from types import SimpleNamespace

    from rlhf_core.cli import train
    from rlhf_core.models.loading import ModelError
    from rlhf_core.training.checkpoint import CheckpointError
    from rlhf_core.training.dynamic_sampling import NothingToTrain
    from rlhf_core.training.guards import GuardError
    from rlhf_core.workers.group import WorkerError

    kind = {"CheckpointError": CheckpointError, "ModelError": ModelError, "WorkerError": WorkerError,
            "GuardError": GuardError, "NothingToTrain": NothingToTrain}[error]
    message = said.removeprefix("error: ")
    monkeypatch.setattr(train, "run", _failing_with(kind(message)))
    assert train.ppo([f"trainer.default_local_dir={tmp_path / 'ppo'}"]) == status
    assert capsys.readouterr().err.splitlines() == [said]

    def trainer(cfg, frames):
        return SimpleNamespace(local_dir=tmp_path / "rm", total_steps=4, global_step=0, resumed_from=None,
                               started=contextlib.nullcontext, train=_failing_with(kind(message)),
                               shutdown=lambda: None)

    monkeypatch.setattr(train, "preflight", lambda cfg: None)
    monkeypatch.setattr(train, "RewardModelTrainer", trainer)
    assert train.train_rm([f"reward_model.train.default_local_dir={tmp_path / 'rm'}"]) == status
    assert capsys.readouterr().err.splitlines() == [said]
    # and where the reward model's weights fail to load, before its steps
    monkeypatch.setattr(train, "RewardModelTrainer", _failing_with(kind(message)))
    assert train.train_rm([f"reward_model.train.default_local_dir={tmp_path / 'rm'}"]) == status
    assert capsys.readouterr().err.splitlines() == [said]

def test_a_second_run_into_a_busy_checkpoint_folder_is_refused_before_loading(workspace, tmp_path, capsys,
                                                                               monkeypatch):
    from rlhf_core.cli.train import ppo
    from rlhf_core.training.checkpoint import RUN_LOCK, run_lock

    def no_models(*args, **kwargs):
        raise AssertionError("models were loaded into a folder another run holds")

    monkeypatch.setattr(main_ppo, "build_trainer", no_models)
    out = tmp_path / "out"
    with run_lock(out):  # another run saving here (a lock taken on another open file conflicts, in one process too)
        assert ppo(workspace.overrides(out, "trainer.total_training_steps=1")) == 2
    assert f"{out} is in use by another run (pid {os.getpid()}, {out / RUN_LOCK})" in capsys.readouterr().err


@pytest.mark.usefixtures("one_thread")
def test_the_closing_line_counts_the_steps_this_run_trained(workspace, tmp_path, capsys):
    from rlhf_core.cli.train import ppo

    out = tmp_path / "out"
    assert ppo(workspace.overrides(out, "trainer.total_training_steps=1", "trainer.val_before_train=false")) == 0
    assert "done: 1 step in" in capsys.readouterr().out
    assert ppo(workspace.overrides(out, "trainer.total_training_steps=2", "trainer.val_before_train=false")) == 0
    assert "done: 1 step (now at step 2) in" in capsys.readouterr().out  # resumed from step 1
    assert ppo(workspace.overrides(out, "trainer.total_training_steps=2", "trainer.val_only=true")) == 0
    assert "done: validated at step 2 in" in capsys.readouterr().out


def test_the_closing_lines_give_the_final_validation_accuracy_and_every_validation_metric(tmp_path, monkeypatch,
                                                                                         capsys):
    """rlhf-ppo's summary gives the run's last validation accuracy (not its last training score), to three places;
    rlhf-train-rm's gives each validation metric, a NaN one as nan rather than leaving it out."""
    import contextlib
    from types import SimpleNamespace

    from rlhf_core.cli import train
    from rlhf_core.main_ppo import RunResult

    result = RunResult(steps=3, wall_s=12.4, local_dir="/runs/x", checkpoint=None, history=[None] * 3,
                       final_val_acc=0.625, final_score=0.1, metrics_file="/runs/x/metrics.jsonl")
    monkeypatch.setattr(train, "run", lambda cfg: result)
    assert train.ppo([f"trainer.default_local_dir={tmp_path / 'ppo'}"]) == 0
    assert capsys.readouterr().out.splitlines() == ["done: 3 steps in 12 s; final validation accuracy 0.625",
                                                    "outputs: /runs/x (metrics: /runs/x/metrics.jsonl)"]

    def trainer(cfg, frames):
        return SimpleNamespace(local_dir=tmp_path / "rm", total_steps=4, global_step=4, resumed_from=None,
                               started=contextlib.nullcontext, shutdown=lambda: None,
                               train=lambda log: {"val/acc": 0.75, "val/loss": float("nan")})

    monkeypatch.setattr(train, "preflight", lambda cfg: None)
    monkeypatch.setattr(train, "RewardModelTrainer", trainer)
    assert train.train_rm([f"reward_model.train.default_local_dir={tmp_path / 'rm'}"]) == 0
    summary = capsys.readouterr().out.splitlines()[0]
    # (the seconds are the wall time of the command)
    assert re.fullmatch(r"reward model: at step 4 after \d+ s; val/acc 0\.7500, val/loss nan", summary), summary


def test_a_command_that_connected_to_ray_disconnects_with_signals_held(monkeypatch):
    """Ray's own exit hook took seconds after the "interrupted" message; a second signal then interrupted it and
    left Ray's agents running, orphaned. The commands now disconnect themselves, signals ignored meanwhile."""
    from rlhf_core.cli.train import releases_ray

    seen = []

    class FakeRay:
        up = False

        def is_initialized(self):
            return self.up

        def shutdown(self):
            seen.append((signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)))
            self.up = False

    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    before = signal.getsignal(signal.SIGINT)

    def connects(argv=None):
        fake.up = True
        raise RuntimeError("failed after connecting")

    with pytest.raises(RuntimeError):
        releases_ray(connects)()
    assert seen == [(signal.SIG_IGN, signal.SIG_IGN)] and not fake.up
    assert signal.getsignal(signal.SIGINT) is before  # restored
    fake.up = True  # a connection the caller had made before the command stays
    assert releases_ray(lambda argv=None: 0)() == 0
    assert seen == [(signal.SIG_IGN, signal.SIG_IGN)] and fake.up


def _two_config_files(tmp_path):
    first = tmp_path / "first.yaml"
    first.write_text("data:\n  train_batch_size: 64\n  max_prompt_length: 100\ntrainer:\n  seed: 3\n  nnodes: 2\n")
    second = tmp_path / "second.yaml"
    second.write_text("data:\n  train_batch_size: 32\ntrainer:\n  nnodes: 1\n")
    return str(first), str(second)


def test_repeated_config_files_merge_in_order_under_the_command_line(tmp_path, capsys, monkeypatch):
    first, second = _two_config_files(tmp_path)
    # rlhf config prints the tree: the second file's keys over the first's, the first's others kept, the
    # command line over both
    assert cli.main(["config", "--config", first, "trainer.seed=4", "--config", second,
                     "actor_rollout_ref.actor.ppo_mini_batch_size=32"]) == 0
    tree = yaml.safe_load(capsys.readouterr().out)
    assert (tree["data"]["train_batch_size"], tree["data"]["max_prompt_length"]) == (32, 100)
    assert (tree["trainer"]["nnodes"], tree["trainer"]["seed"]) == (1, 4)
    # rlhf ppo trains the same tree
    from rlhf_core.cli import train as train_cli
    from rlhf_core.config import ConfigError

    seen = []

    def stop(cfg):
        seen.append(cfg)
        raise ConfigError(["stopped before training"])

    monkeypatch.setattr(train_cli, "run", stop)
    assert cli.main(["ppo", "--config", second, "--config", first, "actor_rollout_ref.actor.ppo_mini_batch_size=32",
                     "trainer.n_gpus_per_node=1"]) == 2
    assert (seen[0].data.train_batch_size, seen[0].trainer.nnodes, seen[0].trainer.seed) == (64, 2, 3)
    assert load_config(["actor_rollout_ref.actor.ppo_mini_batch_size=32"], config_file=[first, second],
                       notice=lambda _: None, validate=False).data.train_batch_size == 32


def test_config_help_says_repeated_files_merge_in_order(capsys):
    with pytest.raises(SystemExit):
        cli.main(["ppo", "--help"])
    assert "repeat it to merge several in order" in " ".join(capsys.readouterr().out.split())


def test_train_rm_help_says_where_the_run_is_placed(capsys):
    """The reward model's keys are under reward_model.train, but its device and workers are trainer.*'s, whose
    defaults (cuda, 8 workers) refuse a run on a CPU machine: the help names the two overrides."""
    with pytest.raises(SystemExit):
        cli.main(["train-rm", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "trainer.* for where it runs" in out and "trainer.device=cpu trainer.n_gpus_per_node=1" in out


@pytest.mark.parametrize(("argv", "said"), [
    (["--config-path=recipe/dapo/config", "--config-name=dapo_trainer"],
     "--config-path and --config-name are Hydra's, which does not load the config here: give that file with "
     "--config, e.g. --config recipe/dapo/config/dapo_trainer.yaml"),
    (["--config-name", "ppo_trainer"], "verl's ppo_trainer tree is the defaults here; drop --config-name"),
    # a relative --config-path is read from verl/trainer, so "config" is verl's own folder (verl's examples write
    # it so): the file there was given as a file of one's own to pass with --config
    (["--config-path=config", "--config-name=ppo_trainer"],
     "verl's ppo_trainer tree is the defaults here; drop --config-path and --config-name"),
    (["--config-path=config", "--config-name='ppo_megatron_trainer.yaml'"],
     "verl's ppo_megatron_trainer is the config of its Megatron backend, which is not one here (the workers shard "
     "with FSDP2, as verl's ppo_trainer, whose tree is the defaults here): drop --config-path and --config-name; the "
     "command's .megatron. keys are refused"),
    (["--config-name", "ppo_megatron_trainer"], "drop --config-name; the command's .megatron. keys are refused"),
    (["-cp", "conf", "-cn", "exp.yaml"], "--config conf/exp.yaml"),
    (["--config-path", "conf"], "give the YAML file itself with --config FILE"),
])
@pytest.mark.parametrize("command", ["ppo", "config"])
def test_hydras_config_options_point_to_config_file(command, argv, said, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([command, *argv, "data.train_batch_size=8"])
    assert info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert said in err and "unrecognized arguments" not in err


@pytest.mark.parametrize("command", ["ppo", "train-rm", "smoke"])
@pytest.mark.parametrize("cfg", [["--cfg", "job"], ["-c", "job"], ["-c", "all", "--resolve"]])
def test_hydras_cfg_job_prints_the_config_and_runs_nothing(tmp_path, capsys, monkeypatch, command, cfg):
    """verl's commands print their config with Hydra's --cfg job (-c job) and exit; here it was refused as
    'unrecognized arguments: --cfg'."""
    from rlhf_core.cli import train as train_cli

    def ran(*args):
        raise AssertionError("the command ran")

    for name in ("run", "preflight", "run_smoke_test"):
        monkeypatch.setattr(train_cli, name, ran)
    first, _ = _two_config_files(tmp_path)  # (train_batch_size 64, max_prompt_length 100, nnodes 2, seed 3)
    assert cli.main([command, *cfg, "--config", first, "trainer.seed=9", "trainer.n_gpus_per_node=1",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=32"]) == 0
    tree = yaml.safe_load(capsys.readouterr().out)
    assert (tree["data"]["train_batch_size"], tree["data"]["max_prompt_length"]) == (64, 100)
    assert tree["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] == 32
    assert (tree["trainer"]["nnodes"], tree["trainer"]["seed"], tree["trainer"]["n_gpus_per_node"]) == (2, 9, 1)
    assert tree["trainer"]["total_epochs"] == 30  # a key neither set: its default (verl's)


@pytest.mark.parametrize(("argv", "said"), [
    # -c names the config file in zenml pipeline run and rlhf schedule; in verl's commands it is Hydra's --cfg
    (["-c", "run.yaml"], "argument -c/--cfg: 'run.yaml' is not job, hydra or all: -c/--cfg is Hydra's option that "
                         "prints the config and exits, as in verl's commands (-c job: the run's config); give a "
                         "config file with --config run.yaml"),
    (["--cfg", "hydra"], "--cfg hydra prints Hydra's own settings (its run folder, logging), and the config is not "
                         "composed by Hydra here: --cfg job prints the run's config"),
    (["--resolve"], "--resolve goes with --cfg job (it asks Hydra to resolve the config printed): give both, or "
                    "neither to run")])
def test_a_config_file_given_with_c_or_hydras_cfg_hydra_is_refused_naming_the_option(capsys, argv, said):
    with pytest.raises(SystemExit) as info:
        cli.main(["ppo", *argv, "trainer.seed=9"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"rlhf ppo: error: {said}"


# --- zenml pipeline run: the run config's parameters ----------------------------------------------------------


@pytest.mark.parametrize(("pipeline", "parameters"), [
    ("pipelines.rlhf_ppo.rlhf_ppo_pipeline", "trainer_config, overrides, train_files, val_files, min_improvement, alpha"),
    ("pipelines.retrain.rlhf_retrain_pipeline",
     "trainer_config, overrides, train_files, val_files, min_improvement, alpha, force"),
])
def test_a_run_configs_unknown_or_mistyped_parameter_exits_1_naming_it_without_a_traceback(repo_root, tmp_path,
                                                                                            pipeline, parameters):
    """ZenML checks a run config's parameters against the pipeline function before its body (and the checks of
    the trainer config) runs: a misspelt parameter or a value of the wrong type came out as pydantic's traceback."""
    run_config = tmp_path / "run.yaml"
    run_config.write_text("parameters:\n  trainer_config: configs/ppo_demo_cpu.yaml\n  min_improvment: 0.01\n"
                          "  alpha: abc\n")
    env = {**os.environ, "PYTHONPATH": str(repo_root), "ZENML_CONFIG_PATH": str(tmp_path / "zenml"),
           "ZENML_ANALYTICS_OPT_IN": "false", "ZENML_ENABLE_RICH_TRACEBACK": "false", "COLUMNS": "200"}
    zenml = ["-c", "from zenml.cli.cli import cli; cli()", "pipeline", "run"]
    done = subprocess.run([sys.executable, *zenml, pipeline, "-c", str(run_config)],
                          capture_output=True, text=True, cwd=repo_root, env=env, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "Traceback" not in output and "pydantic" not in output
    lines = output.splitlines()
    told = lines.index("Error: the pipeline's parameters cannot run; nothing was started:")
    assert sorted(lines[told + 1:told + 3]) == [
        "  - alpha='abc': Input should be a valid number, unable to parse string as a number (alpha takes float)",
        f"  - min_improvment is not a parameter of {pipeline.rsplit('.', 1)[1]}; did you mean min_improvement? (its "
        f"parameters: {parameters})"]


def test_a_run_configs_unknown_step_or_step_parameter_exits_1_naming_it_without_a_traceback(repo_root, tmp_path):
    """ZenML ignored the settings of a misspelt step with a warning (the run went on with the step's defaults) and
    refused a step's misspelt parameter through a traceback."""
    from rlhf_core.data.synthetic import build_dataset

    paths = build_dataset(tmp_path / "data", n_train=4, n_test=2, seed=0, max_ops=1)
    run_config = tmp_path / "run.yaml"
    run_config.write_text(f"parameters:\n  trainer_config: configs/ppo_demo_cpu.yaml\n  train_files: {paths['train']}\n"
                          f"  val_files: {paths['test']}\nsteps:\n  evalute:\n    parameters:\n      max_problems: 4\n"
                          "  smoke_test:\n    parameters:\n      n_prompt: 4\n")
    env = {**os.environ, "PYTHONPATH": str(repo_root), "ZENML_CONFIG_PATH": str(tmp_path / "zenml"),
           "ZENML_ANALYTICS_OPT_IN": "false", "ZENML_ENABLE_RICH_TRACEBACK": "false", "COLUMNS": "200"}
    zenml = ["-c", "from zenml.cli.cli import cli; cli()", "pipeline", "run"]
    done = subprocess.run([sys.executable, *zenml, "pipelines.rlhf_ppo.rlhf_ppo_pipeline", "-c", str(run_config)],
                          capture_output=True, text=True, cwd=repo_root, env=env, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "Traceback" not in output
    lines = output.splitlines()
    told = lines.index("Error: the pipeline's parameters cannot run; nothing was started:")
    assert lines[told + 1] == (
        "  - steps.evalute is not a step of rlhf_ppo_pipeline; did you mean evaluate? (its steps: load_ppo_config, "
        "validate_data, define_reward, smoke_test, train_ppo, evaluate, promote)")
    assert lines[told + 2].startswith(  # (then the step's parameters, n_prompts and response_length among them)
        "  - steps.smoke_test.parameters.n_prompt is not a parameter of the step smoke_test; did you mean n_prompts? "
        "(its parameters: ppo_config, reward_spec, ")


@pytest.mark.parametrize(("module", "name"), [("pipelines.rlhf_ppo", "rlhf_ppo_pipeline"),
                                              ("pipelines.rlhf_rm", "rlhf_rm_pipeline"),
                                              ("pipelines.retrain", "rlhf_retrain_pipeline")])
def test_a_pipeline_module_run_as_a_script_says_how_to_run_it_and_exits_2(repo_root, tmp_path, module, name):
    """python -m pipelines.<name> -c CONFIG did nothing and exited 0, as if the run had gone through."""
    env = {**os.environ, "PYTHONPATH": str(repo_root), "ZENML_CONFIG_PATH": str(tmp_path / "zenml"),
           "ZENML_ANALYTICS_OPT_IN": "false"}
    done = subprocess.run([sys.executable, "-m", module, "-c", "configs/demo_cpu.yaml"], capture_output=True,
                          text=True, cwd=repo_root, env=env, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == (f"{module} is run by ZenML's command: zenml pipeline run {module}.{name} "
                                            "-c RUN_CONFIG.yaml" + (" (or on a schedule: rlhf-schedule)"
                                                                    if name == "rlhf_retrain_pipeline" else ""))


def test_a_parameter_of_a_union_type_is_named_once_without_the_unions_branches():
    """pydantic names a union's branch in an error's location (train_files[str], train_files[list[str]]): one
    mistake read as two lines about keys that do not exist."""
    import pydantic

    from rlhf_core.pipeline.checked import parameter_problems

    def pipeline(train_files: str | list[str] | None = None, alpha: float = 0.05, steps: list[int] | None = None,
                 overrides: list[str] | None = None):
        pass

    with pytest.raises(pydantic.ValidationError) as error:
        pydantic.validate_call(pipeline)(train_files=["a.parquet", 3], alpha="abc", steps=[1, "x"],
                                         overrides=[{"trainer.seed": 1}, {"trainer.total_epochs": 2}])
    assert parameter_problems(pipeline, error.value) == [
        "train_files=['a.parquet', 3]: fits none of the types it may take (train_files takes str | list[str] | None)",
        "alpha='abc': Input should be a valid number, unable to parse string as a number (alpha takes float)",
        # (one error where the value's own position is wrong: named by it)
        "steps[1]='x': Input should be a valid integer, unable to parse string as an integer (steps takes "
        "list[int] | None)",
        # (YAML's "- trainer.seed: 1" for "- trainer.seed=1": each element named by its position)
        "overrides[0]={'trainer.seed': 1}: Input should be a valid string (overrides takes list[str] | None)",
        "overrides[1]={'trainer.total_epochs': 2}: Input should be a valid string (overrides takes list[str] | None)"]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("save_freq", [1, 2])
def test_a_logger_that_cannot_write_stops_the_run_with_one_line_and_exit_1_whether_the_step_saves_or_not(
        workspace, tmp_path, capsys, save_freq):
    from rlhf_core.cli.train import ppo

    out = tmp_path / "out"
    (out / "metrics.jsonl").mkdir(parents=True)  # the file logger's file is a folder
    assert ppo(workspace.overrides(out, "trainer.total_training_steps=2", f"trainer.save_freq={save_freq}",
                                   "trainer.val_before_train=false", "trainer.test_freq=-1",
                                   "trainer.logger=[file]")) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (
        f"error: logging the metrics of step 1 failed (IsADirectoryError: [Errno 21] Is a directory: "
        f"'{out / 'metrics.jsonl'}')" + (", so its checkpoint is not kept (a rerun trains the step again and logs it)"
                                          if save_freq == 1 else "") + "; no checkpoint was saved yet")
    assert not list(out.glob("global_step_*"))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("when", "step"), [(["trainer.val_before_train=false", "trainer.test_freq=1"], 1),
                                            (["trainer.val_before_train=true", "trainer.test_freq=-1"], 0),
                                            (["trainer.val_only=true"], 0)])
def test_a_logger_that_cannot_write_the_validation_generations_stops_the_run_with_one_line_and_exit_1(
        workspace, tmp_path, capsys, when, step):
    from rlhf_core.cli.train import ppo

    out = tmp_path / "out"
    (out / "val_generations.jsonl").mkdir(parents=True)  # the file logger's generations file is a folder
    assert ppo(workspace.overrides(out, "trainer.total_training_steps=2", "trainer.save_freq=1", *when,
                                   "trainer.log_val_generations=2", "trainer.logger=[file]")) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (
        f"error: logging the validation generations of step {step} failed (IsADirectoryError: [Errno 21] Is a "
        f"directory: '{out / 'val_generations.jsonl'}'); no checkpoint was saved yet")
    assert not list(out.glob("global_step_*"))


@pytest.mark.usefixtures("one_thread")
def test_a_checkpoint_that_cannot_be_written_exits_2_though_the_logger_fails_too(
        workspace, tmp_path, capsys, monkeypatch):
    import errno

    from rlhf_core.cli.train import ppo
    from rlhf_core.training import checkpoint, tracking

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_fill", disk_full)  # the checkpoint's files cannot be written
    monkeypatch.setattr(tracking.FileLogger, "log", disk_full)  # nor can the step's metrics
    out = tmp_path / "out"
    assert ppo(workspace.overrides(out, "trainer.total_training_steps=2", "trainer.save_freq=1",
                                   "trainer.val_before_train=false", "trainer.test_freq=-1")) == 2
    err = capsys.readouterr().err.splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[-1].startswith(f"disk full while writing checkpoint {out / 'global_step_1'}"), err[-1]
    assert err[-2] == ("error: logging the metrics of step 1 failed (OSError: [Errno 28] No space left on device: "
                       f"'{out / 'metrics.jsonl'}'); no checkpoint was saved yet")


@pytest.mark.usefixtures("one_thread")
def test_a_full_disk_under_the_tensorboard_logger_stops_the_run_with_one_line_naming_its_folder(
        workspace, tmp_path, capsys, monkeypatch):
    """TensorBoard writes its events from a thread of its own and raises the thread's error again as the writer
    closes: that second raise, as the run's trackers closed, took the place of the run's error, so a full disk came
    out as a traceback of the closing, without the step, the folder or the way on. The thread's own traceback (its
    error reaches the logger at the next write or flush) is not printed either."""
    import errno
    import threading

    thread_errors = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)  # what Python prints a thread's error with

    from tensorboard.compat.tensorflow_stub.io import gfile

    from rlhf_core.cli.train import ppo
    from rlhf_core.training.tracking import read_metrics

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gfile.LocalFileSystem, "append", disk_full)  # every event the writer thread writes
    out = tmp_path / "out"
    assert ppo(workspace.overrides(out, "trainer.total_training_steps=2", "trainer.save_freq=2",
                                   "trainer.val_before_train=false", "trainer.test_freq=-1",
                                   "trainer.logger=[file,tensorboard]")) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (
        f"error: logging the metrics of step 1 failed (OSError: [Errno 28] No space left on device: "
        f"'{out / 'tensorboard'}'); no checkpoint was saved yet"), err[-2000:]
    assert [record["step"] for record in read_metrics(out / "metrics.jsonl")] == [1]  # the file logger's, before
    assert not list(out.glob("global_step_*"))
    assert [f"{type(args.exc_value).__name__}: {args.exc_value}" for args in thread_errors] == []
