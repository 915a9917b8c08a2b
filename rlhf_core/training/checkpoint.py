"""Checkpoints: atomic saves, exact resume, rollback targets and the Hugging Face export.

Layout under ``trainer.default_local_dir`` (verl's, with our file names)::

    latest_checkpointed_iteration.txt     N, the step of the newest complete checkpoint
    global_step_N/
      actor/model_state.pt                module.state_dict() (with LoRA: the adapters only)  (torch.save)
      actor/optim_state.pt                {"optimizer": ..., "scheduler": ...}
      actor/extra_state.pt                the worker's generators (mini-batch shuffle, rollout sampling)
      actor/huggingface/                  save_pretrained of the actor + its tokenizer: a plain HF model
      actor/lora_adapter/                 with LoRA: the actor's adapter as peft saves it, over model.path (verl's)
      critic/model_state.pt, optim_state.pt, extra_state.pt     (GAE only)
      trainer_state.json                  trainer.state_dict(): step, sampler, KL coefficients, guards, skips,
                                          the run's seeds, library versions, code hash and threads
      rng_state.pt                        python random, numpy, torch CPU (and CUDA) generator states
      config.yaml                         the resolved config the run started with
      manifest.json                       every file above with its size and SHA-256; written last

With several workers (FSDP2) each role directory holds instead ``dcp/`` (every rank's shards of
the model and optimizer state, torch.distributed.checkpoint) and ``extra_state_rank_R.pt`` (each
rank's scheduler and generators, and the torch generators of its process, which dropout draws
from), written by the workers themselves: ``default_local_dir`` must then be a filesystem every
worker sees. ``huggingface/`` and ``lora_adapter/`` are gathered and written by rank 0.
Either layout loads on any number of workers (:func:`saved_workers` counts those that saved it):
shards re-split or gather into one process, one worker's whole tensors are cut into shards, and a
rank the saved run did not have takes rank 0's schedule and shuffle state and seeds its own
sampling generator as a fresh run would (:func:`rlhf_core.workers.common.load_saved`).

A save writes everything into ``.global_step_N.tmp-XXXX`` in the same directory, fsyncs
each file and directory, renames it to ``global_step_N`` and only then replaces
``latest_checkpointed_iteration.txt`` (temp file, fsync, ``os.replace``). A save that
fails at any point removes its temp directory, leaves the previous latest checkpoint
as it was and raises :class:`CheckpointError` saying what failed. A directory without
its manifest, or whose files do not match it, is incomplete and is never loaded. Before a resume
(and a guard's rollback) every file's SHA-256 is checked too, so that a file damaged in place (the
same size, other bytes) is refused as well; checkpoints written before the manifest held hashes
are checked by size only. A refusal of the checkpoint to resume from names the newest earlier one
that passes the same checks. ``trainer.resume_mode=auto`` refuses a directory that holds
checkpoints but no ``latest_checkpointed_iteration.txt`` rather than starting a new run over them.

Resuming refuses a checkpoint whose config differs from the current one outside
:data:`RESUME_SAFE_KEYS` (logging, frequencies, run length, names, guard and warning
thresholds, memory knobs and the number of workers, which leave the math unchanged): anything
else may change shapes, batch sizes or the training math, and the error names the keys. A
global batch that does not divide over the new number of workers is refused by the config's
own checks before that. A checkpoint of another kind of run (the reward model's, which holds
``reward_model/`` instead of ``actor/``) is refused for what it is before any of that (:func:`refuse_other_kind`),
and so is one verl wrote (each rank's ``model_world_size_W_rank_R.pt``, ``data.pt``): neither resumed nor, in
``default_local_dir``, replaced by a new run's saves in any resume mode (:func:`refuse_verl`).

This module deals in files; the state comes from its owners: ``trainer.workers()`` (each worker's
``state_dict()`` or shards), ``trainer.state_dict()`` / ``load_state_dict()`` (the loop's own state),
``trainer.config_yaml`` and ``trainer.protected_steps()`` (what the guards may still restore).

``max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep`` prune the actor or critic part
of the oldest checkpoints (a directory left with neither is removed); the latest
checkpoint and those the guards may still restore are never pruned.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import hashlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np
import torch
import yaml
from transformers import AutoConfig

from rlhf_core.algos import ADV_ESTIMATORS_NEED_CRITIC
from rlhf_core.atomic import (
    fsync_dir,
    fsync_tree,
    running_elsewhere,
    staged_directory,
    staging_owner,
    write_text_atomic,
)
from rlhf_core.config import OPEN_KEYS, followed
from rlhf_core.models import loading, lora
from rlhf_core.workers import common
from rlhf_core.workers.group import WorkerError

LATEST_FILE = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
RNG_STATE = "rng_state.pt"
CONFIG_FILE = "config.yaml"
HF_DIR = "huggingface"
REWARD_PATH_KEY = "custom_reward_function.path"  # its code is fingerprinted beside the model folders
MODELS_FILE = "models.json"  # the fingerprints of the model folders the run loads (model_fingerprints)
# the config keys that name a model folder: a resume compares the folders' contents, not the paths as written
MODEL_PATH_KEYS = ("actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path", "critic.model.path",
                   "critic.model.tokenizer_path", "reward_model.model.path")
# the files of a model folder that loading reads (weights, config, tokenizer, chat template)
_MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "*.bin",
                "*.bin.index.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab*",
                "merges.txt", "chat_template*")
_WHOLE_BELOW = 8 << 20  # files up to 8 MiB are hashed whole; larger ones (weights) in evenly spaced samples
_SAMPLES, _SAMPLE_BYTES = 64, 64 << 10
PARTS = ("actor", "critic")
FORMAT_VERSION = 2  # 2: the trainer's runtime coefficients are its own state (kl_loss_coef, the controller type)
_STEP_DIR = re.compile(r"global_step_(\d+)")
_TRASH = re.compile(r"\.trash-.+-(\d+)-\d+")  # _remove's names: .trash-<global_step_N[-part]>-<pid>-<ns>

#: Config keys (fnmatch patterns) that may differ between a checkpoint and the run resuming it.
RESUME_SAFE_KEYS = (
    "trainer.project_name", "trainer.experiment_name", "trainer.logger", "trainer.log_val_generations",
    "trainer.total_epochs", "trainer.total_training_steps", "trainer.save_freq", "trainer.test_freq",
    "trainer.val_before_train", "trainer.resume_mode", "trainer.resume_from_path", "trainer.default_local_dir",
    "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep", "trainer.device",
    "trainer.save_on_interrupt", "trainer.guard.*", "trainer.warn_*", "trainer.prometheus_port",
    "trainer.ray_address", "trainer.ray_runtime_env*", "actor_rollout_ref.nccl_timeout", "trainer.profile_steps",
    "trainer.profile_dir", "trainer.val_only", "trainer.allow_reward_code_change",
    "trainer.balance_batch",  # the same mini-batches, laid out otherwise over the workers
    # the number of workers: the state re-splits over them and the losses are normalised over the global
    # mini-batch; the config's own checks refuse batches that do not divide over them (load_checkpoint says
    # what then differs from the saved run)
    "trainer.n_gpus_per_node", "trainer.nnodes",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",  # how vLLM lays the engine out over them
    # what is validated, as the validation files themselves: no step trains on it
    "data.val_files", "data.val_max_samples", "data.val_batch_size", "actor_rollout_ref.rollout.val_kwargs.*",
    "reward_model.train.*",  # training a reward model (rlhf-train-rm checks its own resumes)
    # memory and speed knobs: losses are normalised over the mini-batch, so these leave the math unchanged (the
    # sharding's param_dtype / reduce_dtype change the rounding on a GPU, as a change of precision would)
    "*.ppo_micro_batch_size_per_gpu", "*.log_prob_micro_batch_size_per_gpu", "*.ppo_max_token_len_per_gpu",
    "*.log_prob_max_token_len_per_gpu", "*.use_dynamic_bsz", "*.log_prob_use_dynamic_bsz",
    "*.enable_gradient_checkpointing", "*.fsdp_config.*", "*.trust_remote_code", "actor_rollout_ref.rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.free_cache_engine", "actor_rollout_ref.rollout.enforce_eager",
    "actor_rollout_ref.rollout.max_num_batched_tokens", "actor_rollout_ref.rollout.enable_chunked_prefill",
    "reward_model.micro_batch_size_per_gpu",
    # follows the policy's tokenizer_path (else its model.path) by default, a change of which is refused by itself
    "reward_model.model.input_tokenizer",
    "reward_model.overlong_buffer.log",
    # the way on after dynamic sampling kept nothing in its generation batches: how many a step may draw from now
    # on, which the saved state does not depend on
    "algorithm.filter_groups.max_num_gen_batches",
    # the way on after a guard's stop (an absurd rate): the schedule goes on from the step resumed, at the new
    # rate (load_checkpoint rescales it, saying so)
    "actor_rollout_ref.actor.optim.lr", "critic.optim.lr",
)
#: what each key added since checkpoints were first written did before it existed: a checkpoint saved without
#: the key compares as if it held this value, so that a resume under a new default that changes the training
#: (an older reward model trained with its dropout, before disable_dropout=true) is refused as any change is
FORMER_VALUES: dict[str, Any] = {
    "actor_rollout_ref.model.disable_dropout": False,
    "critic.model.disable_dropout": False,
    "reward_model.train.disable_dropout": False,  # the updates ran with the backbone's dropout
    "reward_model.train.overlong": "truncate",  # a pair over max_length was cut, never left out
    "reward_model.train.apply_chat_template_kwargs": {},  # the pairs were encoded without keywords
    "reward_model.max_length": None,  # the model's positions (longer failed)
    "reward_model.model.input_chat_template_kwargs": {},  # the policy's prompts were rendered as they came
    "data.train_max_samples": -1,  # every prompt of the files was kept
}
#: each disable_dropout key, by the config section of the model it acts on (its path, override_config and
#: trust_remote_code): on a model whose config has no non-zero noise rate the key changes nothing
DROPOUT_KEYS = {
    "actor_rollout_ref.model.disable_dropout": "actor_rollout_ref.model",
    "critic.model.disable_dropout": "critic.model",
    "reward_model.train.disable_dropout": "reward_model.train.model",
}


def with_former_values(saved_flat: dict[str, Any]) -> dict[str, Any]:
    """A saved config's flattened keys (:func:`flatten_config`) with each key of :data:`FORMER_VALUES` it lacks
    at the value it stands for."""
    return {**FORMER_VALUES, **saved_flat}


def draws_noise(flat: dict[str, Any], key: str) -> bool:
    """Whether the model that the disable_dropout ``key`` (of :data:`DROPOUT_KEYS`) acts on has a non-zero noise
    rate (dropout, a router's jitter) in its config, with the section's override_config; ``flat``: the current
    config's flattened keys, nulls resolved. True where the config cannot be read: the key may then matter."""
    section = DROPOUT_KEYS[key]
    try:
        config = AutoConfig.from_pretrained(str(loading.resolve(flat[f"{section}.path"])),
                                            trust_remote_code=bool(flat.get(f"{section}.trust_remote_code")),
                                            **(flat.get(f"{section}.override_config") or {}))
    except Exception:  # noqa: BLE001 - no readable config: compare the key as written
        return True
    return any(loading.dropout_rates(config).values())


def difference_text(key: str, saved_flat: dict[str, Any], old: dict[str, Any], new: dict[str, Any]) -> str:
    """How ``key`` differs between a checkpoint (``saved_flat``: its flattened keys as saved; ``old``: with
    :data:`FORMER_VALUES` and nulls resolved) and now (``new``): a key the checkpoint predates says what the run
    ran as and the override that resumes it."""
    if key not in saved_flat and key in FORMER_VALUES:
        then = old[key]
        written = then if isinstance(then, str) else json.dumps(then)
        return (f"{key}: {new[key]!r} now (not in the checkpoint, which predates the key: it ran as {then!r}; "
                f"{key}={written} resumes it)")
    return f"{key}: {old[key]!r} in the checkpoint, {new[key]!r} now"


# the learning rates RESUME_SAFE_KEYS lets change, by the checkpoint part whose schedule they set
LEARNING_RATES = {"actor": "actor_rollout_ref.actor.optim.lr", "critic": "critic.optim.lr"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, found, or used; the message names the path."""


# ----------------------------------------------------------------------------- finding checkpoints


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def step_of(path: str | os.PathLike) -> int:
    """N of a ``global_step_N`` directory; CheckpointError for any other name."""
    match = _STEP_DIR.fullmatch(Path(path).name)
    if not match:
        raise CheckpointError(f"{path} is not a checkpoint directory: its name must be global_step_N")
    return int(match.group(1))


def read_manifest(path: str | os.PathLike, verify: bool = False) -> dict:
    """The manifest of a complete checkpoint; CheckpointError naming the path if it is missing or incomplete.

    Each file must have the size the manifest records; with ``verify`` also its SHA-256 (where the
    manifest has them: not in checkpoints written before), which reads every file, so only before
    loading one.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise CheckpointError(_verl_refusal(path) or
                              f"checkpoint {path} is incomplete: it has no {MANIFEST} (its save did not finish)")
    try:
        manifest = json.loads(manifest_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} is incomplete: {manifest_file} is unreadable ({exc})") from exc
    missing = [rel for rel, size in manifest["files"].items()
               if not (path / rel).is_file() or (path / rel).stat().st_size != size]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise CheckpointError(f"checkpoint {path} is incomplete: {shown} missing or truncated "
                              "(pruned by max_*_ckpt_to_keep, or copied partially?)")
    if verify:
        _check_hashes(path, manifest)
    return manifest


def _verl_files(path: Path) -> list[Path]:
    """The files of ``path`` that only verl writes into a checkpoint: each rank's
    ``<part>/model_world_size_W_rank_R.pt``, the dataloader's ``data.pt``."""
    return sorted(path.glob("*/model_world_size_*_rank_*.pt")) + sorted(path.glob("data.pt"))


#: the key a run's model is read from, by the section of its resume keys
MODEL_KEYS = {"trainer": "actor_rollout_ref.model.path", "reward_model.train": "reward_model.train.model.path"}


def _verl_start(path: Path, section: str) -> str:
    """How a new run starts from the actor of verl's checkpoint ``path`` (as the model of ``section``'s run)."""
    key = MODEL_KEYS.get(section, MODEL_KEYS["trainer"])
    hf = path / "actor" / HF_DIR
    weights = [f for pattern in ("*.safetensors", "*.bin") for f in hf.glob(pattern)] if hf.is_dir() else []
    if weights:
        return f"its {hf} holds the actor as a Hugging Face model, from which a new run can start: {key}={hf}"
    if hf.is_dir():
        return (f"its {hf} holds no weights (verl writes them there only with hf_model among the checkpoint's save "
                "contents): merge the shards into a Hugging Face model with verl's model merger and start a new run "
                f"from it as {key}")
    return f"merge its shards into a Hugging Face model with verl's model merger and start a new run from it as {key}"


def _verl_refusal(path: Path, section: str = "trainer", resume_path: bool = False,
                  local_dir: str | os.PathLike | None = None) -> str | None:
    """Why ``path``, a folder without a manifest, cannot be resumed where verl wrote it (:func:`_verl_files`), and
    how to go on; None where it holds no such file. The new run must not save into verl's folder (its
    ``global_step_N`` would replace verl's, the model it starts from among them): so the way on names another
    ``default_local_dir`` where the run's (``local_dir``; unknown: assumed) is that folder, and, for a run given the
    checkpoint as ``resume_from_path`` (``resume_path``), to leave resume_path out."""
    found = _verl_files(path)
    if not found:
        return None
    folder = path.parent
    same = local_dir is None or Path(os.path.expanduser(str(local_dir))).resolve() == folder.resolve()
    steps = []
    if resume_path:
        steps.append(f"leave out {section}.resume_mode=resume_path and {section}.resume_from_path (a new run starts "
                     "with auto or disable)")
    if same:
        steps.append(f"set another {section}.default_local_dir than {folder}: a new run there, with any resume_mode, "
                     "would save its global_step_N over verl's checkpoints, the model it starts from among them")
    return (f"checkpoint {path} was written by verl (it holds {found[0].relative_to(path)}), whose checkpoints this "
            f"trainer cannot resume; {_verl_start(path, section)}" + ("; and " + " and ".join(steps) if steps else ""))


def verl_steps(root: str | os.PathLike) -> list[Path]:
    """The ``global_step_N`` folders under ``root`` that verl wrote (no manifest of ours, verl's files), oldest
    first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(match.group(1)), child) for child in root.iterdir()
             if (match := _STEP_DIR.fullmatch(child.name)) and child.is_dir() and not (child / MANIFEST).exists()
             and _verl_files(child)]
    return [path for _, path in sorted(found)]


def refuse_verl(root: str | os.PathLike, resume_mode: str, resume_from_path: str | None, section: str = "trainer",
                kind: str = "PPO", saves: bool = True) -> None:
    """CheckpointError where a run of ``kind`` would resume from a checkpoint verl wrote (``resume_from_path``, or
    the one the latest marker of ``root`` names under ``auto``), or save into a folder holding such checkpoints
    (``root``, its ``default_local_dir``, in every mode, where the run ``saves``: a ``val_only`` run writes no
    checkpoint): nothing of verl's is read as ours, and nothing of verl's is replaced. ``section`` holds the run's
    resume keys. Call it before the run takes ``root``'s lock."""
    root = Path(os.path.expanduser(str(root)))
    if resume_mode == "resume_path" and resume_from_path:
        path = Path(os.path.expanduser(resume_from_path))
        why = None if (path / MANIFEST).exists() else _verl_refusal(path, section, True, root)
        if why:
            raise CheckpointError(f"{section}.resume_from_path: {why}")
    marked = _marked_step(root)
    if resume_mode == "auto" and marked is not None and not (step_dir(root, marked) / MANIFEST).exists():
        why = _verl_refusal(step_dir(root, marked), section, False, root)
        if why:
            raise CheckpointError(f"{root / LATEST_FILE} names step {marked}, but {why}")
    if saves:
        refuse_verl_folder(root, section, kind)


def refuse_verl_folder(root: str | os.PathLike, section: str = "trainer", kind: str = "PPO") -> None:
    """CheckpointError where ``root`` holds checkpoints verl wrote (:func:`verl_steps`): a new ``kind`` run saving
    there would replace them (its ``global_step_N`` take their names), the one it may start from among them. Asked
    in every resume mode (:func:`refuse_verl`): a run saves into its ``default_local_dir`` whatever it resumes."""
    found = verl_steps(root)
    if not found:
        return
    names = ("..., " if len(found) > 3 else "") + ", ".join(path.name for path in found[-3:])
    example = _verl_files(found[-1])[0].relative_to(root).as_posix()
    raise CheckpointError(
        f"{root} holds checkpoints verl wrote ({names}; {example} is verl's), which this trainer cannot resume, "
        f"and the saves of a new {kind} run there would replace them (its global_step_N take their names): set "
        f"another {section}.default_local_dir. To start from verl's newest actor: {_verl_start(found[-1], section)}")


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256_files(folder: Path, rels: list[str]) -> dict[str, str]:
    """SHA-256 of ``folder/rel`` for each ``rel``, a few files at a time (hashing and reading release the GIL)."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        return dict(zip(rels, pool.map(lambda rel: _sha256_of(folder / rel), rels)))


# checkpoint directory -> the (file, inode, size, mtime, ctime) its hashes last matched with: a resume checks
# the checkpoint before loading models and again as it loads it, and reading a large one twice is not free
_HASHES_MATCHED: dict[Path, tuple] = {}


def _check_hashes(path: Path, manifest: dict) -> None:
    expected = manifest.get("sha256") or {}  # none: saved before the manifest held hashes, sizes only
    rels = sorted(rel for rel in manifest["files"] if rel in expected)
    if not rels:
        return
    stats = [(path / rel).stat() for rel in rels]
    seen = tuple((rel, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for rel, st in zip(rels, stats))
    key = path.resolve()
    if _HASHES_MATCHED.get(key) == seen:
        return
    try:
        actual = _sha256_files(path, rels)
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {exc}") from exc
    damaged = [rel for rel in rels if actual[rel] != expected[rel]]
    if damaged:
        _HASHES_MATCHED.pop(key, None)
        shown = ", ".join(damaged[:3]) + (f" and {len(damaged) - 3} more" if len(damaged) > 3 else "")
        raise CheckpointError(f"checkpoint {path} is corrupt: {shown} changed since it was saved (its SHA-256 "
                              f"differs from the one in {MANIFEST}: damaged on disk or overwritten)")
    _HASHES_MATCHED[key] = seen


def _read_trainer_state(path: Path) -> dict:
    """``trainer_state.json`` of the checkpoint ``path``, parsed; CheckpointError naming it if it does not parse."""
    file = path / TRAINER_STATE
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"checkpoint {path} is corrupt: {file} is unreadable ({exc})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} is corrupt: {file} holds no trainer state")
    return state


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """The manifest of a checkpoint that is complete and undamaged: every file of the size and SHA-256 the
    manifest records, and its ``trainer_state.json`` readable (checked by the hashes of newer checkpoints,
    parsed for older ones); else CheckpointError naming the file. Reads the whole checkpoint."""
    path = Path(path)
    manifest = read_manifest(path, verify=True)
    if TRAINER_STATE in manifest["files"]:
        _read_trainer_state(path)
    return manifest


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, directory) of every ``global_step_N`` directory with a manifest, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if match and (child / MANIFEST).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


#: a checkpoint a save set aside to replace it (``.global_step_N.old-<pid>-<ns>``, :mod:`rlhf_core.atomic`)
_SET_ASIDE = re.compile(r"\.(global_step_\d+)\.old-\d+-(\d+)")


def recover_set_aside(root: str | os.PathLike) -> list[Path]:
    """Put back the checkpoints a save set aside to replace them and never replaced: a process killed between
    moving the old ``global_step_N`` aside and moving the new one into place leaves the set-aside folder as the
    only copy, and the latest marker naming a checkpoint that is not there. A complete one (its manifest there)
    whose process is gone becomes ``global_step_N`` again; the newest first where there are several. Returns the
    checkpoints put back."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = sorted(((int(match.group(2)), child, root / match.group(1)) for child in root.iterdir()
                    if (match := _SET_ASIDE.fullmatch(child.name)) and child.is_dir()), reverse=True)
    restored = []
    for _, aside, target in found:
        if target.exists() or not (aside / MANIFEST).is_file() or running_elsewhere(staging_owner(aside.name)):
            continue
        os.rename(aside, target)
        fsync_dir(root)
        restored.append(target)
    return restored


def latest_checkpoint(root: str | os.PathLike, verify: bool = False) -> Path | None:
    """The checkpoint named by ``latest_checkpointed_iteration.txt``; None when there is no such file.

    CheckpointError when it names no complete checkpoint; with ``verify``, none that passes
    :func:`verify_checkpoint` (which reads it whole). A checkpoint a killed save had set aside to replace it is
    put back first (:func:`recover_set_aside`).
    """
    marker = Path(root) / LATEST_FILE
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{marker} should hold a step number, found {text[:40]!r}")
    path = step_dir(root, int(text))
    if not path.exists():
        recover_set_aside(root)
    try:
        verify_checkpoint(path) if verify else read_manifest(path)
    except CheckpointError as exc:
        raise CheckpointError(f"{marker} names step {text}, but {exc}") from exc
    return path


def latest_or_none(root: str | os.PathLike) -> Path | None:
    """:func:`latest_checkpoint`, or None where its marker names none that is complete: the checkpoint a rerun
    resumes from, for a failure's message (which must not fail in turn)."""
    try:
        return latest_checkpoint(root)
    except CheckpointError:
        return None


def _marked_step(root: Path) -> int | None:
    """The step ``latest_checkpointed_iteration.txt`` names; None without one, or if it names none."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        text = (root / LATEST_FILE).read_text().strip()
        return int(text) if text.isdigit() else None
    return None


def newest_intact(root: str | os.PathLike, before: int | None = None) -> Path | None:
    """The newest checkpoint under ``root`` (older than step ``before``, where given) that passes
    :func:`verify_checkpoint`; None if there is none."""
    for step, path in reversed(list_checkpoints(root)):
        if before is not None and step >= before:
            continue
        try:
            verify_checkpoint(path)
        except CheckpointError:
            continue
        return path
    return None


def intact_instead(path: Path, section: str = "trainer") -> str:
    """:func:`_resume_instead` for the refused checkpoint ``path``; nothing where it is no ``global_step_N``.
    ``section`` holds the run's resume keys (``reward_model.train`` for a reward model's)."""
    match = _STEP_DIR.fullmatch(path.name)
    return _resume_instead(path.parent, int(match.group(1)), section) if match and path.parent.is_dir() else ""


def _resume_instead(root: Path, before: int | None, section: str = "trainer") -> str:
    """What to say after refusing the checkpoint of step ``before`` under ``root``: the one to resume from instead;
    nothing after a checkpoint of verl's, whose refusal itself says how to go on."""
    refused = step_dir(root, before) if before is not None else None
    if refused is not None and not (refused / MANIFEST).is_file() and _verl_refusal(refused):
        return ""
    intact = newest_intact(root, before)
    earlier = "earlier " if before is not None else ""
    if intact is None:
        return f". No {earlier}checkpoint under {root} is intact either"
    return (f". The newest {earlier}checkpoint that is intact is {intact}: to resume from it, run with "
            f"{section}.resume_mode=resume_path {section}.resume_from_path={intact}")


def checkpoint_meant(path: Path, section: str = "trainer") -> str:
    """For a ``resume_from_path`` that names no ``global_step_N`` folder: the checkpoint it likely means, where
    there is one (the folder of checkpoints' latest, or the checkpoint the path lies in: its ``actor/`` say);
    nothing for a ``global_step_N`` path. ``section`` holds the run's resume keys."""
    if _STEP_DIR.fullmatch(path.name):
        return ""
    inside = next((parent for parent in path.parents if _STEP_DIR.fullmatch(parent.name)), None)
    if inside is not None:
        return f"; it lies inside the checkpoint {inside}: {section}.resume_from_path={inside} resumes from it"
    if path.is_dir() and list_checkpoints(path):
        latest = latest_or_none(path) or newest_intact(path)
        if latest is not None:
            return (f"; it is a folder of checkpoints, whose latest is {latest}: {section}.resume_from_path={latest} "
                    f"resumes from it")
    return ""


def find_resume_checkpoint(config) -> Path | None:
    """The checkpoint ``trainer.resume_mode`` asks to resume from, or None to start afresh.

    ``auto``: the latest checkpoint under ``trainer.default_local_dir`` if there is one;
    ``disable``: None; ``resume_path``: ``trainer.resume_from_path``, a ``global_step_N`` directory.
    The checkpoint is verified whole (:func:`verify_checkpoint`), before any model loads; a refusal
    names the newest earlier checkpoint that is intact. ``auto`` also refuses a directory holding
    checkpoints but no ``latest_checkpointed_iteration.txt``: starting afresh there would replace
    them one by one with a new run's. In every mode, checkpoints verl wrote are refused (:func:`refuse_verl`):
    as the one to resume from, and in ``default_local_dir``, where this run's saves would replace them.
    """
    trainer = config.trainer
    if trainer.resume_mode in ("auto", "disable", "resume_path"):
        refuse_verl(trainer.default_local_dir, trainer.resume_mode, trainer.resume_from_path,
                    saves=not trainer.val_only)  # (a run that only validates writes no checkpoint there)
    if trainer.resume_mode == "disable":
        return None
    if trainer.resume_mode == "resume_path":
        if not trainer.resume_from_path:
            raise CheckpointError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        path = Path(os.path.expanduser(trainer.resume_from_path))
        try:
            step_of(path)
        except CheckpointError as exc:
            raise CheckpointError(f"trainer.resume_from_path: {exc}{checkpoint_meant(path)}") from exc
        try:
            manifest = verify_checkpoint(path)
        except CheckpointError as exc:
            raise CheckpointError(f"trainer.resume_from_path: {exc}{intact_instead(path)}") from exc
        refuse_other_kind(path, manifest, "PPO", "trainer.resume_from_path")
        return path
    if trainer.resume_mode == "auto":
        root = Path(os.path.expanduser(trainer.default_local_dir))
        try:
            latest = latest_checkpoint(root, verify=True)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc}{_resume_instead(root, _marked_step(root))}") from exc
        if latest is None and list_checkpoints(root):
            raise CheckpointError(unmarked_refusal(root))
        if latest is not None:
            refuse_other_kind(latest, read_manifest(latest), "PPO", "trainer.default_local_dir")
        return latest
    raise CheckpointError(f"trainer.resume_mode={trainer.resume_mode!r} is not one of auto, disable, resume_path")


#: the kinds of run that save checkpoints, by the part each saves (a manifest's ``parts``) and the command that
#: trains it: PPO's hold ``actor/`` (and ``critic/``), the reward model's ``reward_model/``
KINDS = {"PPO": ("actor", "rlhf-ppo"), "reward-model": ("reward_model", "rlhf-train-rm")}


def checkpoint_kind(manifest: dict) -> str | None:
    """The kind of run (a key of :data:`KINDS`) that saved the checkpoint whose manifest this is; None where its
    parts are none of theirs."""
    parts = set(manifest.get("parts") or ()) | {rel.split("/", 1)[0] for rel in manifest["files"] if "/" in rel}
    return next((kind for kind, (part, _) in KINDS.items() if part in parts), None)


def refuse_other_kind(path: Path, manifest: dict, kind: str, key: str) -> None:
    """CheckpointError where the checkpoint ``path`` was saved by another kind of run than ``kind`` (a reward
    model's where PPO resumes, or the reverse): no config of this run could resume it, so the message says what
    it is and to set ``key`` (the folder or path the run resumes from) to another."""
    found = checkpoint_kind(manifest)
    if found is None or found == kind:
        return
    part, command = KINDS[found]
    hint = (f"; to score PPO's rollouts with that reward model, set reward_model.enable=true "
            f"reward_model.model.path={path.parent / HF_DIR}" if found == "reward-model" else "")
    raise CheckpointError(f"{path} is a {found} checkpoint ({command}'s: it holds {part}/), not a {kind} one, so this "
                          f"run cannot resume from it: use another {key}{hint}")


def saved_workers(manifest: dict, part: str) -> int:
    """How many workers wrote ``part`` (``actor``, ``critic``, ``reward_model``) of the checkpoint whose
    manifest this is: a worker group one ``extra_state_rank_R.pt`` per rank, one worker none."""
    prefix = f"{part}/"
    return common.saved_workers(rel[len(prefix):] for rel in manifest["files"] if rel.startswith(prefix))


def _last_names(found: list[tuple[int, Path]]) -> str:
    """The last three of :func:`list_checkpoints`' folders by name, for a message."""
    return ("..., " if len(found) > 3 else "") + ", ".join(path.name for _, path in found[-3:])


def unmarked_refusal(root: Path, section: str = "trainer") -> str:
    """The refusal of ``resume_mode=auto`` in ``root``, which holds checkpoints but no marker naming the latest;
    ``section`` holds the run's resume keys (``reward_model.train`` for a reward model's)."""
    found = list_checkpoints(root)
    steps = _last_names(found)
    intact = newest_intact(root)
    verdict = (f"the newest intact one is {intact}" if intact is not None
               else "none of them is intact (missing files or other hashes than their manifest's)")
    resume = (f"to continue that run, resume from it with {section}.resume_mode=resume_path "
              f"{section}.resume_from_path={intact}; " if intact is not None else "")
    return (f"{root} holds checkpoints ({steps}) but no {LATEST_FILE}, which names the one to resume from "
            f"(deleted, lost in a copy, or the run killed as its first save ended?); {verdict}. "
            f"{section}.resume_mode=auto does not guess: {resume}to start a new run, set another "
            f"{section}.default_local_dir, or {section}.resume_mode=disable to start afresh in this one (its saves "
            "then replace those checkpoints step by step, and later steps of the old run stay until reached)")


def rerun_advice(resume_mode: str, section: str = "trainer") -> str:
    """How to rerun a run so that it resumes from its latest checkpoint: the same command where ``resume_mode`` is
    ``auto``; otherwise ``disable`` would start afresh and ``resume_path`` go back to the path it names."""
    return "rerun the same command" if resume_mode == "auto" else f"rerun with {section}.resume_mode=auto"


class RerunPoint(NamedTuple):
    """How a rerun of a stopped or failed run resumes (:func:`rerun_advice`), and the checkpoint it resumes from
    (None where there is none)."""

    advice: str
    checkpoint: Path | None


def rerun_point(settings, resumed_from: Path | None, last_saved: Path | None,
                section: str = "trainer") -> RerunPoint:
    """The :class:`RerunPoint` of a run set by ``settings`` (the config's ``section``: PPO's ``trainer`` or
    ``reward_model.train``) that loaded ``resumed_from`` and last saved ``last_saved``. A run resumed from
    ``resume_from_path`` that has saved nothing since, or that stopped before it loaded it (both None), goes back
    to that path with the same command: ``auto`` would take the folder's latest, which may be the checkpoints it
    set out to leave."""
    path = resumed_from or settings.resume_from_path
    if settings.resume_mode == "resume_path" and last_saved == resumed_from and path:
        return RerunPoint("rerun the same command", Path(os.path.expanduser(str(path))))
    return RerunPoint(rerun_advice(settings.resume_mode, section),
                      latest_or_none(Path(os.path.expanduser(settings.default_local_dir))))


def start_afresh(root: str | os.PathLike, section: str = "trainer", kind: str = "PPO") -> None:
    """A run started with ``resume_mode=disable`` in ``root``, which may hold an earlier run's checkpoints: their
    latest marker goes (with a notice), so that a rerun with ``auto`` resumes this run once it has saved, and
    before that refuses (:func:`unmarked_refusal`, naming the earlier run's newest intact checkpoint) rather
    than resume the run this one set out to replace. The checkpoints themselves stay; this run's saves replace
    them step by step. The earlier run's ``metrics.jsonl``, validation samples, TensorBoard events and tracking run
    ids are moved aside (:func:`~rlhf_core.training.tracking.set_aside_run_files`), so that this run's records
    start afresh rather than follow that run's steps, and its resumes never go on in that run's wandb or MLflow
    run. Checkpoints of another ``kind`` of run (a reward model's in PPO's
    folder, or the reverse) and checkpoints verl wrote (:func:`refuse_verl_folder`) are refused (CheckpointError),
    before anything in ``root`` changes: this run's saves would replace them. Call it holding :func:`run_lock`."""
    root = Path(root)
    refuse_verl_folder(root, section, kind)  # before the marker goes: this run's saves would replace them
    found = list_checkpoints(root)
    others = [path for _, path in found if _kind_of(path) not in (None, kind)]
    if others:
        other = _kind_of(others[-1])
        raise CheckpointError(f"{root} holds {other} checkpoints ({_last_names(found)}; {KINDS[other][1]}'s), and "
                              f"this {kind} run's saves would replace them: use another {section}.default_local_dir")
    marker = root / LATEST_FILE
    if marker.exists():  # (also one naming a checkpoint that is gone: auto would then fail on it)
        marker.unlink()
        fsync_dir(root)
    aside = _set_aside(root)
    if found:
        print(f"notice: {section}.resume_mode=disable starts a new run in {root}, which holds an earlier run's "
              f"checkpoints ({_last_names(found)}): their {LATEST_FILE} is removed, so that a rerun resumes this run "
              "once it has saved and never that one; this run's saves replace them step by step (another "
              f"{section}.default_local_dir keeps them apart)" + (f"; its records are moved aside ({aside})"
                                                                 if aside else ""), file=sys.stderr, flush=True)
    elif aside:
        print(f"notice: {section}.resume_mode=disable starts a new run in {root}: an earlier run's records there are "
              f"moved aside ({aside}), so that this run's start afresh", file=sys.stderr, flush=True)


def set_aside_unsaved_records(root: str | os.PathLike, section: str = "trainer") -> None:
    """A run that starts afresh in ``root`` without ``resume_mode=disable`` (``auto`` finding no checkpoint): the
    records an earlier run left there before it saved anything (one killed before its first save) are moved aside
    with a notice, as :func:`start_afresh` moves them, so that this run's step 1 does not follow that run's steps
    in ``metrics.jsonl``. Call it holding :func:`run_lock`."""
    aside = _set_aside(root)
    if aside:
        print(f"notice: {section}.default_local_dir {root} holds records of an earlier run that saved no checkpoint: "
              f"moved aside ({aside}), so that this run's records start afresh", file=sys.stderr, flush=True)


def _set_aside(root: str | os.PathLike) -> str:
    """Move an earlier run's records in ``root`` aside (:func:`~rlhf_core.training.tracking.set_aside_run_files`);
    what was moved where, as a notice says it ("metrics.jsonl to metrics.jsonl.prev, ..."), empty where nothing."""
    from rlhf_core.training.tracking import set_aside_run_files

    return ", ".join(f"{old.name} to {new.name}" for old, new in set_aside_run_files(root))


def _kind_of(path: Path) -> str | None:
    """:func:`checkpoint_kind` of the checkpoint ``path``; None where its manifest does not read."""
    try:
        return checkpoint_kind(read_manifest(path))
    except CheckpointError:
        return None


def holds_parts(path: str | os.PathLike, parts: Iterable[str]) -> bool:
    """Whether the checkpoint ``path`` is complete and holds each of ``parts`` (``max_*_ckpt_to_keep`` prunes
    the actor's and the critic's apart): one a rollback can restore."""
    try:
        files = read_manifest(path)["files"]
    except CheckpointError:
        return False
    return all(any(rel.startswith(f"{part}/") for rel in files) for part in parts)


def read_trainer_state(path: str | os.PathLike) -> dict:
    """``trainer_state.json`` of a complete checkpoint (step, sampler, KL controller, guard, ...)."""
    read_manifest(path)
    return _read_trainer_state(Path(path))


# ----------------------------------------------------------------------------- low-level writing


class _HashingFile:
    """The file object a checkpoint file is written through: hashes the bytes as they pass (the manifest's
    SHA-256, without reading the file back) and keeps the OSError of a failed write.

    torch.save's zip writer, when a write fails midway (ENOSPC, EFBIG), raises a RuntimeError of its own
    ("unexpected pos ...") while the OSError unwinds, which would hide the errno the message is chosen by.
    """

    def __init__(self, file: IO[bytes]):
        self.file = file
        self.sha256 = hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            written = self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.sha256.update(data)  # a buffered file writes all of it or raises
        return written

    def flush(self) -> None:
        self.file.flush()


def _write(path: Path, write: Callable[[IO[bytes]], Any]) -> str:
    """Create ``path``, fill it with ``write(file)``, and fsync it; returns its SHA-256. Every checkpoint file
    goes through here; a failed write raises its OSError, whatever the writer made of it."""
    with open(path, "xb") as f:
        sink = _HashingFile(f)
        try:
            write(sink)
        except Exception as exc:
            if sink.error is not None and exc is not sink.error:
                raise sink.error from None  # torch's RuntimeError only restates it, without the errno
            raise
        f.flush()
        os.fsync(f.fileno())
    return sink.sha256.hexdigest()


# how a writer outside Python (safetensors' Rust code) words the OS error it met: "I/O error: No space left on
# device (os error 28)"
_FOREIGN_OS_ERROR = re.compile(r"(?:I/O error: )?([^:()]+?) \(os error (\d+)\)")


def os_error_of(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: itself, the one a worker of a group met (:func:`_raised_within`: a sharded save
    writes in the workers), or the one a library reported in an error type of its own (safetensors'
    SafetensorError on a full disk), rebuilt with its errno so that the message can say "disk full"; None for any
    other error."""
    inner = _raised_within(exc)
    if inner is not None:
        return os_error_of(inner)
    if isinstance(exc, OSError):
        return exc
    match = _FOREIGN_OS_ERROR.search(str(exc))
    return OSError(int(match.group(2)), match.group(1)) if match else None


def _raised_within(exc: BaseException) -> BaseException | None:
    """The error ``exc`` carries from elsewhere: a worker's own (a :class:`WorkerError` holds Ray's error, whose
    ``cause`` it is), or the first rank's that torch.distributed.checkpoint gathered into its CheckpointException
    (``failures``: rank -> (error, traceback)); None where ``exc`` is the error itself."""
    if isinstance(exc, WorkerError):
        return getattr(exc.__cause__, "cause", None)
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) and isinstance(first[0], BaseException) else None
    return None


def _remove(path: Path, root: Path) -> None:
    """Take ``path`` (``root``'s ``global_step_N`` or a part of one) out of view atomically, renamed into ``root``
    (``.trash-global_step_N-actor-<pid>-<ns>``), then delete it: a process killed while deleting leaves it where
    :func:`_remove_stale` sweeps, not inside a checkpoint that stays."""
    if not path.exists():
        return
    name = "-".join(path.relative_to(root).parts)
    trash = root / f".trash-{name}-{os.getpid()}-{time.monotonic_ns()}"
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_stale(root: Path) -> None:
    """Temp, set-aside and trash directories, and the latest marker's temp files, left by a process killed
    mid-save. Those of another process still running on this machine (another run saving into the same
    directory, whose save this would break) are left; names without a pid (older versions) count as stale. Trash
    that older versions left inside a checkpoint (``global_step_N/.trash-actor-...``) goes too."""
    for child in [*root.iterdir(), *root.glob("global_step_*/.trash-*")]:
        name = child.name
        if name.startswith(".global_step_") and child.is_dir():
            owner = staging_owner(name)
        elif name.startswith(".trash-") and child.is_dir():
            match = _TRASH.fullmatch(name)
            owner = int(match.group(1)) if match else None
        elif name.startswith(f".{LATEST_FILE}.") and name.endswith(".tmp") and child.is_file():
            owner = staging_owner(name)
        else:
            continue
        if running_elsewhere(owner):  # this process saves one checkpoint at a time: its own are a failed save's
            continue
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                child.unlink()


def mark_latest(root: str | os.PathLike, step: int) -> None:
    """Make the complete checkpoint of ``step`` the one a resume starts from."""
    read_manifest(step_dir(root, step))
    write_text_atomic(Path(root) / LATEST_FILE, f"{step}\n")


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a write refused for want of space (a full disk, a quota used up)."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def not_writable(exc: BaseException) -> bool:
    """Whether ``exc`` is a write refused by the folder's permissions or a read-only filesystem."""
    return isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)


def _explain(exc: OSError, root: Path, final: Path, current: str | None, resumable: bool = False,
             key: str = "trainer.default_local_dir") -> str:
    """What failed, and where; ``key``: the setting that names ``root``. Unless ``resumable``, the message goes on
    to free space or fix the folder's permissions, or set ``key``; a ``resumable`` one goes on naming the checkpoint
    a rerun resumes from and how (:func:`way_on`), so it is not told to go to another folder, where a rerun would
    find no checkpoint and start afresh."""
    what = f"{current} of checkpoint {final}" if current else f"checkpoint {final}"
    if disk_full(exc):
        advice = "" if resumable else f"; free space or set {key} to a larger disk"
        return f"disk full while writing {what}{advice} ({exc.strerror or exc})"
    if not_writable(exc):
        tail = f" while writing {what}" if resumable else f"; fix its permissions or set {key}"
        return f"checkpoint directory {root} is not writable ({exc.strerror or exc}){tail}"
    if exc.errno == errno.ENOTDIR or isinstance(exc, NotADirectoryError):
        return f"checkpoint directory {root} is not a directory; set {key}"
    return f"could not write {what}: {exc}"


def way_on(exc: BaseException | None, root: Path, rerun: str, key: str) -> str:
    """How a run that ``exc`` stopped (a save into ``root`` or a write beside it that failed; None: another cause)
    goes on from the checkpoint kept there (``rerun``: :func:`rerun_advice`; ``key``: the setting that names
    ``root``). A full disk wants space first. An unwritable folder may also be left for another one, but only with
    its checkpoints and latest marker moved along: a rerun in a folder without them starts afresh, and the
    checkpoints hold no path of the folder they were saved in."""
    if disk_full(exc):
        return f"free space on that disk, then {rerun} to resume from it"
    if not_writable(exc):
        return (f"make {root} writable again (its permissions, or remount a read-only filesystem), then {rerun} to "
                f"resume from it; or move {root} with its checkpoints and {LATEST_FILE} to a writable place and set "
                f"{key} to that place for the rerun (in a folder without them a rerun starts afresh)")
    return f"{rerun} to resume from it"


def resume_point(latest: Path | None, exc: BaseException | None, root: Path, rerun: str, key: str,
                 first: str = "") -> str:
    """What a trainer's error says of going on: that no checkpoint was saved yet (``latest`` None), or that
    ``latest``, the one a rerun resumes from, is intact and how to go on from it (``first``: what to do before,
    then :func:`way_on` for ``exc``, ``root``, ``rerun`` and ``key``)."""
    if latest is None:
        return "no checkpoint was saved yet"
    return f"the latest checkpoint {latest} is intact: {first}{way_on(exc, root, rerun, key)}"


class CheckpointFiles:
    """Writes the files of one checkpoint into its staging directory and remembers their sizes and hashes.

    Every file is created new and fsynced; ``sizes`` (path relative to the checkpoint: bytes) and
    ``hashes`` (the same paths: SHA-256) go into the manifest, and ``current`` names the file being
    written, for the error message.
    """

    def __init__(self, folder: Path, key: str = "trainer.default_local_dir"):
        self.folder = folder
        self.key = key  # the setting that names the folder of checkpoints, for the errors
        self.sizes: dict[str, int] = {}
        self.hashes: dict[str, str] = {}
        self.current: str | None = None

    def write(self, rel: str, write: Callable[[IO[bytes]], Any]) -> None:
        self.current = rel
        path = self.folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        self.hashes[rel] = _write(path, write)
        self.sizes[rel] = path.stat().st_size

    def torch(self, rel: str, obj: Any) -> None:
        self.write(rel, lambda f: torch.save(obj, f))

    def text(self, rel: str, text: str) -> None:
        self.write(rel, lambda f: f.write(text.encode()))

    def tree(self, rel: str, fill: Callable[[Path], None]) -> None:
        """A directory written by someone else's save function (``save_pretrained``)."""
        self.current = rel + "/"
        target = self.folder / rel
        try:
            fill(target)
        except Exception as exc:
            if (error := os_error_of(exc)) is not None and error is not exc:
                raise error from exc  # (safetensors' full disk: said as the OSError it is)
            raise
        fsync_tree(target)
        rels = [file.relative_to(self.folder).as_posix() for file in sorted(target.rglob("*")) if file.is_file()]
        if not rels:  # e.g. workers that wrote to another folder: a manifest must never list an empty part
            raise CheckpointError(f"{rel}: its save wrote no files into {target} (workers on another node or "
                                  "with another working directory write where they see the path: give "
                                  f"{self.key} as an absolute path every worker can write)")
        for rel in rels:
            self.sizes[rel] = (self.folder / rel).stat().st_size
        # written by others (other processes, with shards): read back to hash, mostly from the page cache
        self.hashes.update(_sha256_files(self.folder, rels))


# ----------------------------------------------------------------------------- what goes in


def rng_state() -> dict:
    """The state of every random stream (python, numpy, torch CPU and CUDA), as ``torch.save`` keeps it."""
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {"bit_generator": numpy_state["bit_generator"],
                  "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                  "pos": int(numpy_state["state"]["pos"]), "has_gauss": int(numpy_state["has_gauss"]),
                  "gauss": float(numpy_state["gauss"])},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    return state


def set_rng_state(state: dict) -> None:
    """Restore the random streams :func:`rng_state` saved (CUDA only onto as many devices)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state({"bit_generator": numpy_state["bit_generator"],
                         "state": {"key": numpy_state["key"].numpy().astype(np.uint32), "pos": numpy_state["pos"]},
                         "has_gauss": numpy_state["has_gauss"], "gauss": numpy_state["gauss"]})
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


def _write_hf(trainer, target: Path) -> None:
    trainer.actor.save_hf(target)  # LoRA merged; with several workers gathered and written by rank 0
    trainer.tokenizer.save_pretrained(target)


def _lora_actor(trainer) -> bool:
    """Whether the actor trains LoRA adapters: its checkpoints and exports then hold the peft adapter folder."""
    return trainer.config.actor_rollout_ref.model.lora_rank > 0


def _fill(files: CheckpointFiles, trainer) -> list[str]:
    parts = []
    for name, worker in trainer.workers().items():
        if worker.sharded:  # each rank writes its own shards (and generators)
            files.tree(name, worker.save_shards)
            parts.append(name)
            continue
        state = worker.state_dict()
        files.torch(f"{name}/model_state.pt", state.pop("model"))
        files.torch(f"{name}/optim_state.pt", {"optimizer": state.pop("optimizer"),
                                               "scheduler": state.pop("scheduler")})
        files.torch(f"{name}/extra_state.pt", state)
        parts.append(name)
    files.tree(f"actor/{HF_DIR}", lambda target: _write_hf(trainer, target))
    if _lora_actor(trainer):  # the critic's adapter is in its state only, as verl's
        files.tree(f"actor/{lora.ADAPTER_DIR}", trainer.actor.save_adapter)
    state = {"format": FORMAT_VERSION, **trainer.state_dict(), "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    files.text(TRAINER_STATE, json.dumps(state, indent=1))
    files.torch(RNG_STATE, rng_state())
    files.text(CONFIG_FILE, trainer.config_yaml)
    files.text(MODELS_FILE, json.dumps(getattr(trainer, "model_fingerprints", {}), indent=1))
    return parts


# ----------------------------------------------------------------------------- saving


def write_checkpoint(root: str | os.PathLike, step: int, fill: Callable[[CheckpointFiles], list[str]],
                     before_latest: Callable[[], None] | None = None, rerun: str | None = None,
                     key: str = "trainer.default_local_dir") -> Path:
    """Write ``root/global_step_<step>`` atomically and mark it latest; returns its directory.

    ``fill(files)`` writes the checkpoint's files through ``files`` and returns the parts it saved
    (``["actor", "critic"]``); the manifest follows. The directory is staged as
    ``.global_step_N.tmp-XXXX`` and renamed into place; a checkpoint of the same step (saved again
    after resuming from an older one) is removed only once the new one is in place and marked
    latest. Any failure leaves the checkpoints and the latest marker as they were and raises
    :class:`CheckpointError` saying what failed. ``before_latest()`` runs once the files are written, before the
    checkpoint moves into place and is marked latest (the step's record is logged there: a run killed after the
    marker resumes after the step, so the record must be written by then). ``rerun``: how a rerun resumes from the
    latest checkpoint (:func:`rerun_advice`), which the error then says after naming that checkpoint intact (a full
    disk: "free space, then ..."). ``key``: the setting that names ``root``, as the errors name it
    (``reward_model.train.default_local_dir`` for a reward model's).
    """
    root = Path(os.path.expanduser(str(root)))
    final = step_dir(root, step)
    if not (final / MANIFEST).exists() and (verl := _verl_files(final)):  # (the runs refuse such a folder first)
        raise CheckpointError(f"{final} holds a checkpoint verl wrote ({verl[0].relative_to(final)}), "
                              f"which no save replaces: save into another {key}")
    previous = None
    with contextlib.suppress(CheckpointError, OSError):
        recover_set_aside(root)  # (before the sweep below, which removes what is set aside)
        previous = latest_checkpoint(root)
    intact = f"; the previous checkpoint {previous} is intact" if previous else ""
    files: CheckpointFiles | None = None

    def mark_latest_now() -> None:  # once in place; a failure here puts things back as they were
        files.current = LATEST_FILE
        write_text_atomic(root / LATEST_FILE, f"{step}\n")

    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale(root)
        with staged_directory(final, replace=True, after_move=mark_latest_now, usual_modes=False) as tmp:
            files = CheckpointFiles(tmp, key)
            parts = fill(files)
            files.text(MANIFEST, json.dumps({"format": FORMAT_VERSION, "step": step, "parts": parts,
                                             "files": dict(files.sizes), "sha256": dict(files.hashes)}, indent=1))
            files.current = None
            if before_latest is not None:
                before_latest()
    except OSError as exc:
        resumable = previous is not None and rerun is not None
        if resumable:
            intact += f": {way_on(exc, root, rerun, key)}"
        raise CheckpointError(_explain(exc, root, final, files.current if files else None, resumable, key)
                              + intact) from exc
    return final


def save_checkpoint(trainer, root: str | os.PathLike, before_latest: Callable[[], None] | None = None,
                    rerun: str | None = None) -> Path:
    """Save the trainer's full state as ``root/global_step_<trainer.global_step>``, atomically.

    Then marks it latest and prunes old checkpoints (``trainer.max_*_ckpt_to_keep``, never the
    latest nor ``trainer.protected_steps()``). Returns the checkpoint directory. ``before_latest``, ``rerun``: as for
    :func:`write_checkpoint`.
    """
    final = write_checkpoint(root, int(trainer.global_step), lambda files: _fill(files, trainer), before_latest, rerun)
    cfg = trainer.config.trainer
    prune_checkpoints(final.parent, cfg.max_actor_ckpt_to_keep, cfg.max_critic_ckpt_to_keep,
                      trainer.protected_steps(int(trainer.global_step)))
    return final


def prune_checkpoints(root: str | os.PathLike, max_actor: int | None, max_critic: int | None,
                      protected: Iterable[int] = ()) -> list[Path]:
    """Remove the actor (critic) part of all but the newest ``max_actor`` (``max_critic``) checkpoints.

    The latest checkpoint and the ``protected`` steps are kept whole; a checkpoint left with
    neither part is removed. Checkpoints newer than the latest (left by a run that a guard
    rolled back to an older one) are neither counted nor pruned: the run replaces them as it
    reaches their steps again. Returns the paths removed.
    """
    root = Path(root)
    keep = set(protected)
    latest = _marked_step(root)
    if latest is not None:
        keep.add(latest)
    removed: list[Path] = []
    checkpoints = [(step, path) for step, path in list_checkpoints(root) if latest is None or step <= latest]
    for part, limit in (("actor", max_actor), ("critic", max_critic)):
        if limit is None or limit <= 0:
            continue
        having = [(step, path) for step, path in checkpoints if (path / part).is_dir()]
        for step, path in having[:-limit] if len(having) > limit else []:
            if step not in keep:
                _remove(path / part, root)
                removed.append(path / part)
    for step, path in checkpoints:
        if step not in keep and not any((path / part).is_dir() for part in PARTS):
            _remove(path, root)
            removed.append(path)
    return removed


def export_hf(trainer, directory: str | os.PathLike) -> Path:
    """Write the actor as a plain Hugging Face model directory (weights, config, tokenizer), atomically.

    With LoRA (``actor_rollout_ref.model.lora_rank > 0``) the directory also holds ``lora_adapter/``: the actor's
    adapter as peft saves it over model.path, as in a checkpoint's ``actor/lora_adapter/``, so that
    ``PeftModel.from_pretrained(base, directory / "lora_adapter")`` is the policy the merged weights beside it
    hold. Both are written from the actor's weights now (after :func:`load_checkpoint`, the checkpoint's, also
    one saved before checkpoints held the adapter folder), never copied from a checkpoint the actor may have
    trained past since."""
    target = Path(os.path.expanduser(str(directory)))
    if target.exists() and any(target.iterdir()):
        raise CheckpointError(f"{target} already exists and is not empty; export into a new directory")
    try:
        with staged_directory(target, replace=True, usual_modes=False) as tmp:  # replace: an empty folder
            _write_hf(trainer, tmp)
            if _lora_actor(trainer):
                trainer.actor.save_adapter(tmp / lora.ADAPTER_DIR)
    except Exception as exc:
        if (error := os_error_of(exc)) is None:
            raise
        why = error.strerror or error
        if disk_full(error):  # (an export is no run's folder: no trainer.default_local_dir names it)
            message = f"disk full while exporting to {target}; free space or export to a folder on another disk ({why})"
        elif not_writable(error):
            message = f"{target.parent} is not writable ({why}); export to a folder you may write"
        else:
            message = f"could not export to {target}: {error}"
        raise CheckpointError(message) from exc
    return target


# ----------------------------------------------------------------------------- loading


def flatten_config(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config tree as one level of dotted keys: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; the mappings
    whose keys the user names (``OPEN_KEYS``: reward_kwargs, override_config, ...) stay whole values."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and f"{prefix}{key}" not in OPEN_KEYS:
            flat.update(flatten_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_differences(saved: dict, current: dict) -> list[str]:
    """Keys whose values differ between two config trees and are not in :data:`RESUME_SAFE_KEYS`.

    Keys absent from ``saved`` (written by an older version) are not compared, but for those of
    :data:`FORMER_VALUES`, which compare as the value they stand for.
    """
    old_flat, new_flat = with_former_values(flatten_config(saved)), flatten_config(current)
    old, new = _resolved(old_flat), _resolved(new_flat)
    no_critic = not _has_critic(saved) and not _has_critic(current)  # the critic's keys are read by no one
    # nor, without a reward model, the keys of its model (reward_model.reward_manager, overlong_buffer ... are the
    # rule-based reward's too)
    no_reward_model = not _has_reward_model(saved) and not _has_reward_model(current)
    return [key for key in new if key in old and old[key] != new[key]
            and not (no_critic and key.startswith("critic."))
            and not (no_reward_model and key.startswith("reward_model.model."))
            and not (old_flat[key] is None and new_flat[key] is None)  # null in both: the key it stands for differs
            and not any(fnmatch.fnmatchcase(key, pattern) for pattern in RESUME_SAFE_KEYS)
            and not (key in DROPOUT_KEYS and not draws_noise(new, key))]  # a model without dropout: no change


def _has_reward_model(tree: dict) -> bool:
    return bool(tree.get("reward_model", {}).get("enable"))


def _has_critic(tree: dict) -> bool:
    return tree.get("algorithm", {}).get("adv_estimator") in ADV_ESTIMATORS_NEED_CRITIC


def _resolved(flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` with each null that stands for another key's value (:data:`~rlhf_core.config.FOLLOWS`) replaced
    by it, so that a checkpoint written when the key held that value itself compares equal."""
    return {key: followed(flat.get, key) for key in flat}


def saved_config(path: str | os.PathLike) -> dict:
    """The config tree the checkpoint ``path`` was saved with (its ``config.yaml``); CheckpointError if unreadable."""
    path = Path(path)
    try:
        return yaml.safe_load((path / CONFIG_FILE).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read {CONFIG_FILE} ({exc})") from exc


# folder_fingerprint's results in this process: the folder's resolved path -> (what each of its files' stat said
# when it was read, its fingerprint). A resumed run fingerprints its folders before any model loads and again
# as the trainer starts, each folder under every key that names it (the actor's path is also, followed, its
# tokenizer's and the critic's): each ~4 MiB of weights read once. One entry a folder, replaced when it changes.
_FINGERPRINTS: dict[Path, tuple[tuple, dict[str, str]]] = {}
# a file written this shortly before it was read is read again next time: a file system's clock may be coarse
# (a kernel tick, or seconds), and a second write within the same tick and of the same size would look unchanged
_RECENT_NS = 2_000_000_000
_clock_ns = time.time_ns  # what "recent" is measured from (a test reads a folder as if later)


def folder_fingerprint(directory: str | os.PathLike) -> dict[str, str]:
    """A model folder's content, file by file (those of :data:`_MODEL_FILES`): ``name -> "size:sha256"`` of the
    whole file up to 8 MiB, else of 64 evenly spaced 64 KiB samples (weights: a copy of the folder, or the
    same folder at another path, fingerprints the same; weights trained on, or another model, do not).

    Read once a process for a folder whose files are unchanged: the same files (names, sizes, modification and
    status-change times, devices and inodes) as when it was last read here give that fingerprint again; any
    change reads it anew, and so does a folder with a file written within :data:`_RECENT_NS` of the read. The
    status-change time is the one no copy can set back: ``shutil.copytree``/``copy2``, ``cp -p`` and archives keep
    the modification times of what they copy, and a folder removed and copied again over can get the freed
    inode numbers back."""
    started = _clock_ns()
    directory = Path(os.path.expanduser(str(directory)))
    names = sorted({f.name for pattern in _MODEL_FILES for f in directory.glob(pattern) if f.is_file()})
    stats = {name: (directory / name).stat() for name in names}
    seen = tuple((name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino)
                 for name, st in stats.items())
    folder = directory.resolve()
    cached = _FINGERPRINTS.get(folder)
    if cached is not None and cached[0] == seen:
        return dict(cached[1])
    digests = {}
    for name in names:
        file = directory / name
        size = stats[name].st_size
        digest = hashlib.sha256()
        with open(file, "rb") as handle:
            if size <= _WHOLE_BELOW:
                digest.update(handle.read())
            else:
                for k in range(_SAMPLES):
                    handle.seek((size - _SAMPLE_BYTES) * k // (_SAMPLES - 1))
                    digest.update(handle.read(_SAMPLE_BYTES))
        digests[name] = f"{size}:{digest.hexdigest()}"
    # a copy keeps the modification time it copies: its status-change time says when the file came here
    if all(max(st.st_mtime_ns, st.st_ctime_ns) < started - _RECENT_NS for st in stats.values()):
        _FINGERPRINTS[folder] = (seen, digests)
    else:
        _FINGERPRINTS.pop(folder, None)
    return dict(digests)


def model_fingerprints(config) -> dict[str, dict]:
    """For each key of :data:`MODEL_PATH_KEYS` the run reads (the critic's with a critic, the reward model's
    when enabled), nulls followed as they resolve: ``{"path": the absolute path, "files": folder_fingerprint}``,
    or ``"files": None`` where the key names no folder; and ``custom_reward_function.path``'s
    :func:`reward_code_fingerprint` where it is set. Saved in every checkpoint."""
    tree = config.to_dict()
    flat = _resolved(flatten_config(tree))
    found = {}
    for key in MODEL_PATH_KEYS:
        value = flat.get(key)
        if not isinstance(value, str) or (key.startswith("critic.") and not _has_critic(tree)) \
                or (key.startswith("reward_model.") and not tree.get("reward_model", {}).get("enable")):
            continue
        folder = Path(os.path.expanduser(value))
        found[key] = {"path": str(folder.resolve()), "files": folder_fingerprint(folder) if folder.is_dir() else None}
    reward = flat.get(REWARD_PATH_KEY)
    if isinstance(reward, str) and reward:
        found[REWARD_PATH_KEY] = reward_code_fingerprint(reward)
    return found


def reward_code_fingerprint(path: str | os.PathLike) -> dict:
    """A custom reward file's code and that of the modules it imports from beside it (as the reward spec reads
    them): ``{"path": the absolute path, "files": {file, relative to the reward's folder where it is inside it:
    SHA-256 of its syntax tree written back}}``, comments and layout aside; ``"files": None`` where the file cannot
    be read or parsed (loading the reward then says why)."""
    import ast

    from rlhf_core.pipeline.reward_code import user_code  # (the reward spec's walk of the user's modules)

    file = Path(os.path.expanduser(str(path))).resolve()
    try:
        _, _, read = user_code(file)
    except (OSError, SyntaxError, ValueError):
        return {"path": str(file), "files": None}
    return {"path": str(file), "files": {  # (the file itself by its role: renamed or moved, the same code resumes)
        "the reward file" if name == file else
        str(name.relative_to(file.parent)) if name.is_relative_to(file.parent) else str(name):
            hashlib.sha256(ast.unparse(ast.parse(text)).encode()).hexdigest()
        for name, text in read.items()}}


def data_fingerprints(paths: Iterable[str | os.PathLike]) -> list[dict[str, str]]:
    """The training files' content, in ``data.train_files``' order: ``{"path": the absolute path, "sha256": of the
    file's bytes}`` each. Saved in every checkpoint's trainer state (``train_files``) beside the sampler's place in
    the data, which counts these files' rows: a resume on files whose rows are other prompts, or the same in another
    order, would take its next batches from other prompts than the saved run's (:func:`changed_data_files`).
    GSM8K's training set (7473 rows, 3.4 MB of parquet) hashes in about 2 ms."""
    found = []
    for path in paths:
        path = Path(os.path.expanduser(str(path)))
        found.append({"path": str(path.resolve()), "sha256": _sha256_of(path)})
    return found


def changed_data_files(saved: list[dict] | None, current: list[dict[str, str]]) -> list[str]:
    """The paths of ``current`` (:func:`data_fingerprints`) whose bytes differ from those a checkpoint recorded at
    the same place in ``data.train_files`` (``saved``; None, an older checkpoint's: none are said to differ). The
    list of files itself is the config's to compare."""
    if not saved:
        return []
    return [now["path"] for then, now in zip(saved, current) if then.get("sha256") != now["sha256"]]


def _model_problems(saved: dict[str, dict], current: dict[str, dict], reward_change: bool = False,
                    notices: bool = True) -> list[str]:
    """The model folders of ``current`` whose content differs from the ones a checkpoint was trained from
    (``saved``, its :data:`MODELS_FILE`), each said once with the keys that name it, both paths and the files
    that differ. A key the run no longer reads is left to the config's own comparison. With ``reward_change``
    (``trainer.allow_reward_code_change``) custom reward code that differs but reads is said in a notice instead (where
    ``notices``)."""
    differing: dict[str, list[str]] = {}  # what is wrong -> the keys that name that folder
    for key, then in saved.items():
        now = current.get(key)
        if now is None or now["files"] == then["files"] and (now["files"] is not None or now["path"] == then["path"]):
            continue  # (two paths that name no folder are told apart by the paths themselves)
        changed = sorted(name for name in set(now["files"] or {}) | set(then["files"] or {})
                         if (now["files"] or {}).get(name) != (then["files"] or {}).get(name))
        differ = f"{', '.join(changed) or 'unreadable'} differ{'s' if len(changed) == 1 else ''}"
        if key == REWARD_PATH_KEY and reward_change and now["files"] is not None:
            if notices:
                print(f"notice: {key}: resuming with other reward code than the checkpoint was trained with "
                      f"({differ}), as trainer.allow_reward_code_change=true allows: the steps before were scored by "
                      "the old code", file=sys.stderr)
            continue
        if key == REWARD_PATH_KEY and now["files"] is None:
            what = (f"{now['path']} cannot be read as Python now (the checkpoint was trained with the code of "
                    f"{then['path']})")
        elif key == REWARD_PATH_KEY:
            what = (f"{now['path']} holds other reward code than the checkpoint was trained with ({differ}); a "
                    "resume under another reward is not the run it continues" if now["path"] == then["path"] else
                    f"{now['path']} is not the reward code the checkpoint was trained with, {then['path']} "
                    f"({differ})") + " (trainer.allow_reward_code_change=true resumes with it, a fixed reward say)"
        elif now["files"] is None:
            what = f"{now['path']} is not a model folder (the checkpoint was trained from {then['path']})"
        else:
            files = f"{', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''} differ"
            what = (f"{now['path']} holds another model than when the checkpoint was trained from it ({files})"
                    if now["path"] == then["path"] else
                    f"{now['path']} is not the model the checkpoint was trained from, {then['path']} ({files})")
        differing.setdefault(what, []).append(key)
    return [f"{', '.join(keys)}: {what}" for what, keys in differing.items()]


def check_config(path: str | os.PathLike, config, models: dict[str, dict] | None = None, notices: bool = True) -> None:
    """Refuse to resume from ``path`` when its config differs from ``config`` in a key that matters, or a model
    folder it names holds another model than the checkpoint's (``models``: ``config``'s
    :func:`model_fingerprints`, computed when not given). The model folders are compared by content, so the same
    model at another path (relative or absolute, copied) resumes; a checkpoint without fingerprints (an older
    one) has its paths compared as written. ``notices=False`` leaves out what a resume goes on with but says (other
    reward code, where the config allows it): a check before the load, which says it."""
    path = Path(path)
    saved = saved_config(path)
    current = config.to_dict()
    fingerprints = path / MODELS_FILE
    saved_models = json.loads(fingerprints.read_text()) if fingerprints.is_file() else None
    if saved_models is not None:  # (an older checkpoint's paths are compared as written: no folder is read)
        models = model_fingerprints(config) if models is None else models
    # a key compared by content in both (a path given otherwise, the same model or reward code) is not compared as
    # written; one the run no longer sets (a custom reward dropped) is
    differing = [key for key in config_differences(saved, current)
                 if saved_models is None or key not in saved_models or key not in models]
    problems = []
    if differing:
        # nulls as they resolve, and the keys the checkpoint predates as they stand
        saved_flat = flatten_config(saved)
        old, new = _resolved(with_former_values(saved_flat)), _resolved(flatten_config(current))
        problems.append("; ".join(difference_text(k, saved_flat, old, new) for k in differing))
    if saved_models is not None:
        problems += _model_problems(saved_models, models, config.trainer.allow_reward_code_change, notices)
    if problems:
        raise CheckpointError(
            f"cannot resume from {path}: the config differs in keys that change shapes, batch sizes or the "
            f"training math ({'; '.join(problems)}). Restore those values, or start a new run with "
            "trainer.resume_mode=disable or another trainer.default_local_dir")


def load_file(path: Path, device: torch.device | str = "cpu") -> Any:
    """One ``torch.save`` file of a checkpoint (tensors and plain data only); CheckpointError if unreadable."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
        raise CheckpointError(f"checkpoint file {path} cannot be read: {exc}") from exc


def _load_worker(path: Path, name: str, worker, saved: int, weights_only: bool = False) -> None:
    """``path/name``, written by ``saved`` workers, into ``worker``: a worker group's ranks each read it
    (counting the saved workers from its files), one worker here."""
    try:
        if worker.sharded:
            worker.load_shards(path / name, weights_only)
        else:
            common.load_saved(worker, path / name, saved, weights_only)
    except Exception as exc:  # noqa: BLE001 - the workers' errors come wrapped; say which checkpoint
        raise CheckpointError(f"checkpoint {path / name} cannot be loaded into the {name} being trained: {exc}") \
            from exc


def _loadable(trainer, path: Path) -> tuple[Path, dict[str, int]]:
    """(the checkpoint's path, how many workers saved each of the parts the trainer loads), once it is verified
    whole (:func:`verify_checkpoint`)."""
    path = Path(os.path.expanduser(str(path)))
    manifest = verify_checkpoint(path)
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {manifest.get('format')}, this version reads format "
                              f"{FORMAT_VERSION}: start a new run (trainer.resume_mode=disable or another "
                              "trainer.default_local_dir)")
    for name in trainer.workers():
        if name not in manifest["parts"] or not (path / name).is_dir():
            raise CheckpointError(f"checkpoint {path} has no {name} state (pruned by max_{name}_ckpt_to_keep, "
                                  "or saved by a run without a critic)")
    return path, {name: saved_workers(manifest, name) for name in trainer.workers()}


def _world_size(trainer) -> int:
    group = getattr(trainer, "worker_group", None)
    return group.world_size if group is not None else 1


def resplit_notice(trainer, path: Path, saved: int, world: int) -> str:
    """The notice of a resume on another number of workers than saved the checkpoint: what carries over
    exactly, and why the run then does not continue bit for bit as the saved run would have."""
    config = trainer.config
    arr = config.actor_rollout_ref
    why = ["the sums over the workers (gradients, losses) round otherwise"]
    if arr.rollout.do_sample:
        why.append("each worker samples its share of the prompts with its own generator (one the saved run did not "
                   "have starts from the seed), so other responses are drawn")
    if arr.actor.shuffle or ("critic" in trainer.workers() and config.value("critic.shuffle")):
        why.append("each worker shuffles its own share of the batch into mini-batches, so they are drawn otherwise")
    if config.algorithm.filter_groups.enable:
        why.append("a dynamic-sampling round that runs out of generation batches trains its groups in whole "
                   "mini-batches on a worker group and all of them on one worker, so such a round trains otherwise")
    return (f"notice: {path} was saved by {saved} worker(s) and is re-split over {world}: the weights, optimizer "
            "moments and learning-rate schedule carry over exactly, but the run does not continue bit for bit as "
            f"the saved run would have: {'; '.join(why)}")


def load_checkpoint(trainer, path: str | os.PathLike) -> None:
    """Restore everything :func:`save_checkpoint` saved, for an exact resume; on another number of workers
    than saved it, re-split (with a notice saying what then differs from the saved run).

    Raises CheckpointError naming the path when the checkpoint is missing, incomplete, saved with a
    config that differs in a key that matters, or saved from a model of another shape.
    """
    path = Path(os.path.expanduser(str(path)))
    try:
        verify_checkpoint(path)  # (_loadable's check then finds it verified)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}{intact_instead(path)}") from exc
    path, saved = _loadable(trainer, path)
    check_config(path, trainer.config, getattr(trainer, "model_fingerprints", None))
    state = _read_trainer_state(path)  # before the workers load, so that an unreadable one fails fast
    for name, worker in trainer.workers().items():
        _load_worker(path, name, worker, saved[name])
    _follow_new_rates(trainer, path)
    trainer.load_state_dict(state)
    set_rng_state(load_file(path / RNG_STATE, "cpu"))
    if not trainer.actor.sharded:  # sharded workers sync as they load
        trainer.actor.rollout.sync_weights()
    world = _world_size(trainer)
    if saved["actor"] != world:
        print(resplit_notice(trainer, path, saved["actor"], world), file=sys.stderr, flush=True)


def _follow_new_rates(trainer, path: Path) -> None:
    """Where this run's learning rate differs from the checkpoint's, the loaded schedule (its base rates saved
    with it, a guard's factor included) goes on at this run's: its rates scaled by new / old, with a notice."""
    saved = flatten_config(saved_config(path))
    current = flatten_config(trainer.config.to_dict())
    for name, worker in trainer.workers().items():
        key = LEARNING_RATES.get(name)
        old, new = saved.get(key), current.get(key)
        if key is None or old is None or old == new:
            continue
        if not old > 0:
            raise CheckpointError(f"cannot resume from {path} with {key}={new}: its schedule ran at {old}, which "
                                  "no factor takes to another rate")
        worker.scale_lr(new / old)
        print(f"notice: {key} is {new} now, {old} in {path}: its schedule goes on from step "
              f"{step_of(path)} at the new rate", file=sys.stderr, flush=True)


def restore_weights(trainer, path: str | os.PathLike) -> None:
    """Roll the workers back to a checkpoint's weights and optimizer moments (a guard's rollback), whatever
    the number of workers that saved it.

    The step counter, the LR schedule position, the data sampler and the random streams are
    left as they are, so training carries on with new batches. The current learning rate is
    re-applied after loading the optimizer state (which carries the checkpoint's). A checkpoint saved with
    a config that differs in a key that matters is refused (CheckpointError), as at a resume.
    """
    path, saved = _loadable(trainer, path)
    check_config(path, trainer.config, getattr(trainer, "model_fingerprints", None))
    for name, worker in trainer.workers().items():
        _load_worker(path, name, worker, saved[name], weights_only=True)
    if not trainer.actor.sharded:
        trainer.actor.rollout.sync_weights()


def load_model_state(path: str | os.PathLike, part: str = "actor") -> dict[str, torch.Tensor]:
    """The saved ``state_dict`` of a checkpoint's actor or critic model."""
    path = Path(path)
    read_manifest(path)
    return load_file(path / part / "model_state.pt")


RUN_LOCK = ".run.lock"


@contextlib.contextmanager
def run_lock(root: str | os.PathLike, key: str = "trainer.default_local_dir"):
    """Hold ``root`` for this run while inside: a second run writing checkpoints into the same folder would
    replace the first's and sweep its saves' temporary folders. The lock is an exclusive ``flock`` on
    ``root/.run.lock`` (which names the holder's pid for the message): the kernel releases it when its process
    ends, however it ends, so a killed run's lock is free. CheckpointError naming the holder if another
    process holds it; ``key`` is the setting that names the folder. (On a filesystem without flock, e.g. some
    network ones, the lock holds on one machine.)"""
    import fcntl

    root = Path(os.path.expanduser(str(root)))
    root.mkdir(parents=True, exist_ok=True)
    lock = root / RUN_LOCK
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise CheckpointError(
                f"{root} is in use by another run (pid {holder}, {lock}): two runs saving into one folder "
                f"replace each other's checkpoints; set another {key}, or stop that run") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race with a run opening it)


def check_writable(root: str | os.PathLike, rerun: str = "rerun the same command",
                   key: str = "trainer.default_local_dir") -> None:
    """Raise CheckpointError unless checkpoints can be written under ``root`` (creates it). Where ``root`` holds a
    run's checkpoints (a rerun after a save it refused), the error says how to resume from its latest, here or in
    the folder moved whole (:func:`way_on`; ``rerun``: :func:`rerun_advice`), not to set another ``key``: a run
    there finds no checkpoint and starts afresh."""
    root = Path(os.path.expanduser(str(root)))
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        latest = latest_or_none(root) if root.is_dir() else None
        if latest is not None and (not_writable(exc) or disk_full(exc)):
            state = "is not writable" if not_writable(exc) else "is on a full disk"
            raise CheckpointError(f"checkpoint directory {root} {state} ({exc.strerror or exc}); its latest checkpoint "
                                  f"{latest} is intact: {way_on(exc, root, rerun, key)}") from exc
        raise CheckpointError(_explain(exc, root, root, None, key=key)) from exc
