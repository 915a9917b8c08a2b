"""A tiny offline language model for the demo, the tests and the benchmarks.

The model is a small Llama decoder over a character-level tokenizer (printable ASCII plus newline
and four special tokens), saved as a standard Hugging Face folder: ``AutoTokenizer`` and
``AutoModelForCausalLM.from_pretrained`` load it with no network access.

Presets:

* ``demo``: warm-started by supervised fine-tuning on synthetic arithmetic word problems
  (:mod:`rlhf_core.data.synthetic`), half of whose solutions carry a systematic slip, so that it
  solves a good share of held-out problems but far from all of them, and often samples the right
  answer where it writes the slip: room for PPO to improve;
* ``test``: a much smaller model trained for a handful of steps, built in seconds for unit tests.

A build is deterministic for a seed and is cached by a hash of its settings: a folder whose
``toy_build.json`` (written last, atomically) carries the same hash is reused as is.

Usage::

    python -m rlhf_core.models.toy [--output DIR] [--preset demo|test] [--seed S] [--force] [--threads N]

builds into ``DIR`` (default: the cache folder of :func:`ensure_toy_model`) and prints the model
size, the build time and the greedy and sampled accuracy on held-out problems.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import random
import re
import string
import sys
import time
from collections.abc import Iterator
from pathlib import Path

if __name__ == "__main__":  # run as `rlhf toy-model` is (rlhf_core.cli), before the imports below (torch and
    # transformers), so that a Ctrl-C in the command's first seconds ends it with one line and exit 130, not a
    # traceback
    from rlhf_core.cli import _run

    sys.exit(_run("toy-model", None, "python -m rlhf_core.models.toy"))

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rlhf_core.atomic import current_umask, staged_directory, write_text_atomic
from rlhf_core.data.schema import INSTRUCTION
from rlhf_core.data.synthetic import DATA_SOURCE, iter_problems, validate_options
from rlhf_core.progress import transformers_bars
from rlhf_core.rewards.gsm8k import compute_score

# Bump whenever a change here alters what a build produces, so that cached builds are redone.
CODE_VERSION = 2
MARKER = "toy_build.json"
CACHE_ENV = "RLHF_TOY_CACHE"

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARACTERS = tuple(string.digits + string.ascii_letters + string.punctuation + " \n")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}Assistant: {{ message['content'] }}{{ eos_token }}\n"
    "{% else %}{{ message['content'] }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)

# The task both presets are trained on (and that the demo's RL dataset should use, e.g.
# ``build_dataset(out, n_train, n_test, seed, **TOY_TASK)``): one-step problems, all four
# operations, operands up to 12.
#
# The demo model (0.54M parameters) is warm-started on solutions of which half carry a
# systematic slip (:func:`with_slip`: the working is right, the final answer line repeats the
# problem's first number), as SFT data with a recurring mistake would. It learns the format, the
# copying and most of the arithmetic, and writes the slip about half the time: with seed 0 it
# answers 40.7% of 1,000 held-out problems right greedily and 33.5% when sampling at temperature 1,
# so its samples hold right answers often but not by default, which is what PPO can select.
TOY_TASK = {
    "min_ops": 1,
    "max_ops": 1,
    "min_operand": 1,
    "max_operand": 12,
    "max_value": 999,
    "operations": ["+", "-", "*", "/"],
}

PRESETS: dict[str, dict] = {
    "demo": {
        "hidden_size": 128,
        "num_layers": 2,
        "num_heads": 4,
        "intermediate_size": 512,
        "max_position_embeddings": 1024,
        "task": TOY_TASK,
        "slip_rate": 0.5,
        "train_steps": 1000,
        "batch_size": 24,
        "learning_rate": 3e-3,
        "warmup_steps": 10,
        "min_lr_ratio": 0.0,
        "weight_decay": 0.01,
        "eval_problems": 1000,
        "eval_batch_size": 250,
        "max_new_tokens": 64,
        "sample_temperature": 1.0,
    },
    "test": {
        "hidden_size": 32,
        "num_layers": 1,
        "num_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 1024,
        "task": TOY_TASK,
        "train_steps": 4,
        "batch_size": 8,
        "learning_rate": 3e-3,
        "warmup_steps": 1,
        "min_lr_ratio": 0.0,
        "weight_decay": 0.01,
        "eval_problems": 16,
        "eval_batch_size": 16,
        "max_new_tokens": 48,
        "sample_temperature": 1.0,
    },
}


# ----------------------------------------------------------------------------- tokenizer


def build_char_tokenizer(model_max_length: int = 1024) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer: one token per character, decoding reproduces text exactly.

    The vocabulary is ``<pad> <s> </s> <unk>`` (ids 0-3) then printable ASCII and newline; any
    other character (tab, non-ASCII) becomes ``<unk>``. No special token is added when encoding.
    """
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token; ``[\s\S]`` matches newlines too.
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins the pieces with nothing between them, so spaces and newlines survive untouched.
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        padding_side="left",
    )


# ----------------------------------------------------------------------------- model


def _llama_config(
    tokenizer,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
) -> LlamaConfig:
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})")
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
    )


def _generation_config(tokenizer) -> GenerationConfig:
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _save(model: LlamaForCausalLM, tokenizer, output_dir: Path, progress: bool = False) -> None:
    model.generation_config = _generation_config(tokenizer)
    with transformers_bars(progress):
        model.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
    # Name the generic fast-tokenizer class, which every transformers release (4.x as well as 5.x)
    # resolves to a tokenizer driven by tokenizer.json alone.
    config_path = output_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    # Some writers create files readable by their owner only; give every file the usual mode.
    mode = 0o666 & ~current_umask()
    for path in output_dir.iterdir():
        if path.is_file():
            os.chmod(path, mode)


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def random_toy_model(
    output_dir: str | Path,
    n_layers: int = 2,
    hidden_size: int = 128,
    n_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    seed: int = 0,
) -> Path:
    """Save a random-weight toy-architecture model (with the character tokenizer) to ``output_dir``.

    ``n_heads`` defaults to ``hidden_size // 64`` (at least 1 head, 64-wide heads) and
    ``intermediate_size`` to ``4 * hidden_size``.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    heads = n_heads or max(1, hidden_size // 64)
    tokenizer = build_char_tokenizer(max_position_embeddings)
    config = _llama_config(
        tokenizer, hidden_size, n_layers, heads, intermediate_size or 4 * hidden_size, max_position_embeddings
    )
    with _seeded(seed):
        model = LlamaForCausalLM(config)
    _save(model, tokenizer, out)
    return out


# ----------------------------------------------------------------------------- data


def prompt_text(tokenizer, question: str) -> str:
    """The chat-formatted prompt for a synthetic question, as the RL dataset presents it."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question + INSTRUCTION}], tokenize=False, add_generation_prompt=True
    )


def _encode(tokenizer, problem: dict) -> tuple[list[int], list[int]]:
    prompt = tokenizer(prompt_text(tokenizer, problem["question"]), add_special_tokens=False)["input_ids"]
    response = tokenizer(problem["solution"], add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id
    ]
    return prompt, response


def _collate(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch with labels on the response tokens only."""
    width = max(len(p) + len(r) for p, r in pairs)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    for i, (p, r) in enumerate(pairs):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r)
        mask[i, :n] = 1
        labels[i, len(p) : n] = torch.tensor(r)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _problem_seeds(seed: int) -> tuple[str, str]:
    return f"toy-warmstart-train-{seed}", f"toy-warmstart-eval-{seed}"


def heldout_problems(preset: str = "demo", seed: int = 0, n: int | None = None) -> list[dict]:
    """The held-out problems a build of ``preset`` with ``seed`` is evaluated on (none seen in training)."""
    settings = preset_settings(preset)
    n = settings["eval_problems"] if n is None else n
    _, eval_seed = _problem_seeds(seed)
    train_questions = {p["question"] for p in _training_problems(settings, seed)}
    out, seen = [], set(train_questions)
    for problem in iter_problems(eval_seed, **settings["task"]):
        if problem["question"] not in seen:
            seen.add(problem["question"])
            out.append(problem)
            if len(out) == n:
                break
    return out


def _training_problems(settings: dict, seed: int) -> list[dict]:
    train_seed, _ = _problem_seeds(seed)
    stream = iter_problems(train_seed, **settings["task"])
    problems = [next(stream) for _ in range(settings["train_steps"] * settings["batch_size"])]
    rate = settings.get("slip_rate", 0.0)
    if rate > 0:
        rng = random.Random(f"toy-slips-{seed}")
        problems = [with_slip(p) if rng.random() < rate else p for p in problems]
    return problems


def with_slip(problem: dict) -> dict:
    """The problem with a systematic slip in its solution: the final answer line repeats the
    problem's first number instead of the result worked out above it (the working stays right).

    Warm-start data with a share of such solutions gives a policy that knows the right answer
    but often writes the slip: what RL should learn to select against.
    """
    first = re.search(r"\d+", problem["question"]).group(0)
    working, _, _ = problem["solution"].rpartition("####")
    return {**problem, "solution": f"{working}#### {first}"}


# ----------------------------------------------------------------------------- evaluation


def operation_of(problem: dict) -> str:
    """The first operation (``+ - * /``) in a synthetic problem's solution."""
    annotation = problem["solution"].split("<<", 1)[1]
    return annotation.lstrip("0123456789")[:1]


def accuracy_by_operation(problems: list[dict], correct: list[bool]) -> dict[str, float]:
    """Accuracy per first operation, for the operations present."""
    totals: dict[str, list[int]] = {}
    for problem, ok in zip(problems, correct):
        hits = totals.setdefault(operation_of(problem), [0, 0])
        hits[0] += int(ok)
        hits[1] += 1
    return {op: round(hit / count, 4) for op, (hit, count) in sorted(totals.items())}


def _score(response: str, answer: str) -> float:
    return compute_score(response, answer, method="strict")


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    problems: list[dict],
    do_sample: bool = False,
    temperature: float = 1.0,
    batch_size: int = 250,
    max_new_tokens: int = 64,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """Accuracy of ``model`` on ``problems`` under the GSM8K strict rule, with lengths seen.

    Greedy decoding, or pure sampling at ``temperature`` (no top-k / top-p) seeded by ``seed``.
    """
    model.eval()
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    correct, response_lengths, samples = [], [], []
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    starts = range(0, len(problems), batch_size)
    if progress:
        from rlhf_core.progress import progress_bar

        starts = progress_bar(starts, desc="sampled eval" if do_sample else "greedy eval", unit="batch")
    try:
        for start in starts:
            chunk = problems[start : start + batch_size]
            prompts = [prompt_text(tokenizer, p["question"]) for p in chunk]
            enc = tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt").to(
                model.device
            )
            kwargs = (
                {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
                if do_sample
                else {"do_sample": False}
            )
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **kwargs,
            )
            new = out[:, enc["input_ids"].shape[1] :]
            for problem, row in zip(chunk, new.tolist()):
                if tokenizer.eos_token_id in row:
                    row = row[: row.index(tokenizer.eos_token_id) + 1]
                row = [t for t in row if t != tokenizer.pad_token_id]
                response_lengths.append(len(row))
                text = tokenizer.decode(row, skip_special_tokens=True)
                correct.append(_score(text, problem["answer"]) == 1.0)
                if len(samples) < 5:
                    samples.append(text)
    finally:
        torch.random.set_rng_state(generator_state)
        tokenizer.padding_side = padding_side
    return {
        "accuracy": sum(correct) / max(1, len(problems)),
        "correct": correct,
        "n": len(problems),
        "max_response_tokens": max(response_lengths, default=0),
        "samples": samples,
    }


# ----------------------------------------------------------------------------- build


def preset_settings(preset: str) -> dict:
    if preset not in PRESETS:
        raise ValueError(f"unknown toy preset {preset!r}; choose from {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[preset])


def settings_hash(preset: str = "demo", seed: int = 0) -> str:
    """The cache key of a build: preset values, code version and seed."""
    payload = {
        "code_version": CODE_VERSION,
        "preset": preset,
        "settings": preset_settings(preset),
        "seed": seed,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def read_marker(output_dir: str | Path) -> dict | None:
    """The completed-build record in ``output_dir``, or None when there is none (or it is unreadable)."""
    try:
        return json.loads((Path(output_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch's global generator for the block, restoring its previous state afterwards."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def auto_threads(limit: int = 4) -> int:
    """Torch threads for a build: the CPUs not already busy (by the 1-minute load), 1 to ``limit``.

    On a shared machine extra threads that must wait for a core slow small models down a lot;
    the build's result does not depend on the thread count.
    """
    cpus = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except (AttributeError, OSError):
        busy = 0.0
    return max(1, min(limit, cpus, int(cpus - busy + 0.5)))


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _warm_start(
    model, tokenizer, settings: dict, seed: int, progress: bool, device: str = "cpu"
) -> list[float]:
    problems = _training_problems(settings, seed)
    random.Random(f"toy-order-{seed}").shuffle(problems)
    encoded = [_encode(tokenizer, p) for p in problems]
    batch_size, steps = settings["batch_size"], settings["train_steps"]
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if param.ndim < 2 or "norm" in name else decay).append(param)
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": settings["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=settings["learning_rate"],
        betas=(0.9, 0.98),
        eps=1e-8,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: _lr_factor(s, settings["warmup_steps"], steps, settings["min_lr_ratio"])
    )
    losses = []
    bar = None
    if progress:
        from rlhf_core.progress import progress_bar

        bar = progress_bar(total=steps, desc="warm start", unit="step")
    model.train()
    try:  # (closed on an error or Ctrl-C too: on a terminal an open bar holds back other output's partial lines)
        for step in range(steps):
            batch = _collate(encoded[step * batch_size : (step + 1) * batch_size], tokenizer.pad_token_id)
            batch = {key: value.to(device) for key, value in batch.items()}
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
    finally:
        if bar is not None:
            bar.close()
    model.eval()
    return losses


def _build_into(output_dir: Path, preset: str, seed: int, progress: bool, threads: int) -> dict:
    settings = preset_settings(preset)
    validate_options(**settings["task"])
    started = time.perf_counter()
    with _threads(threads), _seeded(seed):
        tokenizer = build_char_tokenizer(settings["max_position_embeddings"])
        config = _llama_config(
            tokenizer,
            settings["hidden_size"],
            settings["num_layers"],
            settings["num_heads"],
            settings["intermediate_size"],
            settings["max_position_embeddings"],
        )
        model = LlamaForCausalLM(config)
        losses = _warm_start(model, tokenizer, settings, seed, progress)
        train_seconds = time.perf_counter() - started
        heldout = heldout_problems(preset, seed)
        eval_kwargs = {
            "batch_size": settings["eval_batch_size"],
            "max_new_tokens": settings["max_new_tokens"],
        }
        greedy = evaluate(model, tokenizer, heldout, do_sample=False, progress=progress, **eval_kwargs)
        sampled = evaluate(
            model,
            tokenizer,
            heldout,
            do_sample=True,
            temperature=settings["sample_temperature"],
            seed=seed,
            progress=progress,
            **eval_kwargs,
        )
        prompt_tokens = max(len(_encode(tokenizer, p)[0]) for p in heldout)
        reference_tokens = max(len(_encode(tokenizer, p)[1]) for p in heldout)
    _save(model, tokenizer, output_dir)
    return {
        "hash": settings_hash(preset, seed),
        "code_version": CODE_VERSION,
        "preset": preset,
        "seed": seed,
        "settings": settings,
        "data_source": DATA_SOURCE,
        "parameters": count_parameters(model),
        "build_seconds": round(time.perf_counter() - started, 2),
        "threads": threads,
        "train_seconds": round(train_seconds, 2),
        "final_loss": round(sum(losses[-10:]) / max(1, len(losses[-10:])), 4),
        "greedy_accuracy": greedy["accuracy"],
        "greedy_accuracy_by_operation": accuracy_by_operation(heldout, greedy["correct"]),
        "sampled_accuracy": sampled["accuracy"],
        "sampled_accuracy_by_operation": accuracy_by_operation(heldout, sampled["correct"]),
        "sample_temperature": settings["sample_temperature"],
        "eval_problems": len(heldout),
        "max_prompt_tokens": prompt_tokens,
        "max_reference_response_tokens": reference_tokens,
        "max_generated_response_tokens": max(greedy["max_response_tokens"], sampled["max_response_tokens"]),
        "greedy_samples": greedy["samples"],
    }


def build_toy_model(
    output_dir: str | Path,
    preset: str = "demo",
    seed: int = 0,
    force: bool = False,
    progress: bool = True,
    threads: int | None = None,
) -> Path:
    """Build (or reuse) the ``preset`` toy model in ``output_dir`` and return the folder.

    A folder whose marker carries this build's hash is returned untouched unless ``force``.
    Otherwise the old marker is removed first, the model and tokenizer are written, and the marker
    (hash, settings, measured accuracies) is written last. ``threads`` sets torch's intra-op threads
    for the build (default :func:`auto_threads`).
    """
    out = Path(output_dir)
    expected = settings_hash(preset, seed)
    marker = read_marker(out)
    if not force and marker is not None and marker.get("hash") == expected:
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    record = _build_into(out, preset, seed, progress, threads or auto_threads())
    write_text_atomic(out / MARKER, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return out


def default_cache_dir() -> Path:
    """``$RLHF_TOY_CACHE`` if set, else ``~/.cache/rlhf_ppo/toy``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rlhf_ppo" / "toy"


def ensure_toy_model(
    preset: str = "demo", seed: int = 0, progress: bool = True, threads: int | None = None
) -> Path:
    """The cached ``preset`` build for ``seed`` at ``<cache>/<preset>-<hash>``, built on first use.

    The build happens in a temporary sibling folder that is renamed into place when complete, so
    concurrent callers never see a half-written model.
    """
    cache = default_cache_dir()
    final = cache / f"{preset}-{settings_hash(preset, seed)}"
    marker = read_marker(final)
    if marker is not None and marker.get("hash") == settings_hash(preset, seed):
        return final

    def finished(folder: Path) -> bool:  # a concurrent build that finished first: use it
        return read_marker(folder) is not None  # (one without its marker was interrupted: replaced)

    if progress:
        print(f"building the {preset!r} toy model once (a warm start of minutes on a few CPU cores); it is cached at "
              f"{final} (${CACHE_ENV} moves the cache)", file=sys.stderr, flush=True)
    with staged_directory(final, replace=True, keep_existing=finished) as staging:
        build_toy_model(staging, preset, seed, force=True, progress=progress, threads=threads)
    return final
