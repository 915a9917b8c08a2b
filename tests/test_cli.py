"""The umbrella command: ``rlhf <command> [args]`` runs the same functions as the old command paths."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys

import pytest
import yaml

from rlhf_core import cli

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


def test_every_command_resolves_to_a_function():
    for name, (module, function, _) in cli.COMMANDS.items():
        assert callable(getattr(importlib.import_module(module), function)), name


@pytest.mark.parametrize(("command", "module"), [("lineage", "rlhf_core.pipeline.lineage"),
                                                  ("gsm8k", "rlhf_core.data.gsm8k")])
def test_a_commands_help_is_that_of_its_module_path(repo_root, command, module):
    umbrella = _python("-m", "rlhf_core.cli", command, "--help", cwd=repo_root)
    old_path = _python("-m", module, "--help", cwd=repo_root)
    assert umbrella.returncode == old_path.returncode == 0, umbrella.stderr + old_path.stderr
    assert umbrella.stdout == old_path.stdout
    assert "usage: " in umbrella.stdout and "--help" in umbrella.stdout


def test_arguments_and_exit_codes_pass_through(capsys):
    assert cli.main(["config", "trainer.total_epochs=7", "trainer.seed=12"]) == 0
    tree = yaml.safe_load(capsys.readouterr().out)
    assert tree["trainer"]["total_epochs"] == 7 and tree["trainer"]["seed"] == 12
    assert cli.main(["config", "data.no_such_key=1"]) == 2
    assert "data.no_such_key" in capsys.readouterr().err


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
