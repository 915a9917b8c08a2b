"""The small-model dry run: catch a broken run in two minutes on a CPU, not after hours on GPUs.

The run config is kept exactly, except for what must shrink:

* the model: a random-weight clone of the target's architecture (same model type and tokenizer,
  two small layers), unless the target is already tiny (under ``tiny_threshold`` parameters,
  counted from its config without loading weights);
* the data: the first ``n_prompts`` training prompts the trainer keeps (``data.filter_overlong_prompts``
  drops some) and as many validation prompts;
* batch sizes shrunk consistently (one mini-batch of all prompts; micro-batches that divide it),
  short responses, one process, the HF rollout on CPU unless a GPU is there, two iterations.

Then it checks what a real run would trip over first: every loss and gradient norm finite, no
skipped step, the first step on-policy (``actor/ppo_kl`` ~ 0: the log-probs of the update match
those of the rollout), and a checkpoint that saves, loads into a fresh trainer and restores the
weights exactly; and, for a run whose policy is evaluated after training (the pipeline's), that the reward's
acc on the validation responses is 0 or 1, as the evaluation counts each problem. The first failing check raises
:class:`SmokeTestError` naming it.

    python -m rlhf_core.pipeline.smoke --config configs/ppo_demo_cpu.yaml [key=value ...]
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as `rlhf smoke` is (rlhf_core.cli), before the imports below (pandas and
    # torch), so that a Ctrl-C in the command's first seconds ends it with one line and exit 130, not a
    # traceback
    from rlhf_core.cli import _run

    sys.exit(_run("smoke", None, "python -m rlhf_core.pipeline.smoke"))

import pandas as pd
import torch

from rlhf_core.config import DataConfig, PPOConfig, validate_config
from rlhf_core.data.dataset import DataError, RLHFDataset, check_files, read_frames, too_few_prompts

TINY_THRESHOLD = 5_000_000
KL_TOLERANCE = 1e-3
FINITE_KEYS = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm",
               "actor/entropy", "critic/score/mean")


class SmokeTestError(RuntimeError):
    """A check of the dry run failed; the message names the check and what to look at."""


@dataclass
class SmokeReport:
    target_model: str
    model: str
    cloned: bool
    target_parameters: int
    parameters: int
    n_prompts: int
    steps: int
    reward_model: str | None = None  # the reward model that scored the dry run's rollouts, if one did
    checks: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(check["passed"] for check in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}

    def summary(self) -> str:
        what = (f"a 2-layer random clone ({self.parameters:,} parameters) of {self.target_model} "
                f"({self.target_parameters:,})" if self.cloned else f"{self.model} ({self.parameters:,} parameters)")
        scored = f", scored by the reward model {self.reward_model}" if self.reward_model else ""
        lines = [f"smoke test {'PASSED' if self.passed else 'FAILED'} in {self.wall_s:.1f} s: {self.steps} PPO "
                 f"iterations of the run config on {self.n_prompts} prompts with {what}{scored}"]
        lines += [f"  [{'ok' if c['passed'] else 'FAIL'}] {c['name']}: {c['detail']}" for c in self.checks]
        return "\n".join(lines)


# ----------------------------------------------------------------------------- the model


def count_parameters_from_config(model_path: str | Path, trust_remote_code: bool = False) -> int:
    """Parameters of the model in ``model_path``, built on the meta device (no weights are read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(Path(model_path).expanduser()), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def build_tiny_clone(model_path: str | Path, output_dir: str | Path, tokenizer_path: str | Path | None = None,
                     num_layers: int = 2, hidden_size: int = 64, num_heads: int = 4, intermediate_size: int = 128,
                     seed: int = 0, trust_remote_code: bool = False) -> Path:
    """Save a random-weight model of the same type as ``model_path`` with small layers, and its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    source = Path(model_path).expanduser()
    out = Path(output_dir)
    config = AutoConfig.from_pretrained(str(source), trust_remote_code=trust_remote_code)
    config.num_hidden_layers = num_layers
    config.hidden_size = hidden_size
    if hasattr(config, "intermediate_size"):
        config.intermediate_size = intermediate_size
    if hasattr(config, "num_attention_heads"):
        config.num_attention_heads = num_heads
        kv_heads = getattr(config, "num_key_value_heads", None)
        if kv_heads is not None:  # keep grouped-query attention when the target has it
            config.num_key_value_heads = max(d for d in range(1, num_heads + 1)
                                             if num_heads % d == 0 and d <= min(kv_heads, num_heads))
        if getattr(config, "head_dim", None) is not None:
            config.head_dim = hidden_size // num_heads
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:num_layers]
    if getattr(config, "max_window_layers", None) is not None:
        config.max_window_layers = min(config.max_window_layers, num_layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(str(Path(tokenizer_path or source).expanduser()),
                                              trust_remote_code=trust_remote_code)
    tokenizer.save_pretrained(out)
    try:
        GenerationConfig.from_pretrained(str(source)).save_pretrained(out)
    except OSError:  # no generation_config.json: the model config's defaults stand
        pass
    return out


# ----------------------------------------------------------------------------- data and config


def first_prompts(files: str | Sequence[str], tokenizer, data: DataConfig, n_prompts: int,
                  key: str, require_ground_truth: bool = True, max_samples: int = -1,
                  seed: int | None = None) -> tuple[pd.DataFrame, RLHFDataset]:
    """The rows of the first ``n_prompts`` prompts that the trainer keeps from ``files`` (in order), and the
    dataset of all it keeps.

    The files are loaded as the trainer loads them (:class:`RLHFDataset`, with ``data.train_max_samples`` or
    ``val_max_samples`` as ``max_samples``, drawn with ``seed``), so a row it drops is skipped here too and any
    row it would refuse stops the dry run the same way. They are read once: the dataset is given the frame the
    kept rows are then taken from (a training file can be large)."""
    frame = read_frames(check_files(files, key))
    dataset = RLHFDataset(files, tokenizer, data, key=key, require_ground_truth=require_ground_truth, frame=frame,
                          max_samples=max_samples, seed=seed)
    kept = frame.iloc[dataset.positions[:n_prompts]]
    return kept.drop(columns=["_source_file", "_source_row"]).reset_index(drop=True), dataset


def write_parquet(frame: pd.DataFrame, output: str | Path) -> Path:
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(output, index=False)
    return output


def _divisor_at_most(total: int, limit: int | None) -> int:
    limit = total if limit is None else max(1, min(limit, total))
    return max(d for d in range(1, limit + 1) if total % d == 0)


def scale_config(cfg: PPOConfig, model_path: str | Path, train_file: Path, val_file: Path | None, work_dir: Path,
                 n_prompts: int, response_length: int, cloned: bool, steps: int = 2) -> PPOConfig:
    """The run config shrunk for the dry run (see the module docstring); validated."""
    small = copy.deepcopy(cfg)
    data, arr, critic, trainer = small.data, small.actor_rollout_ref, small.critic, small.trainer
    arr.model.path = str(model_path)
    if cloned:  # the clone carries the target's tokenizer and also initialises the critic
        arr.model.tokenizer_path = None
        critic.model.path = None
        critic.model.tokenizer_path = None
    data.train_files, data.val_files = [str(train_file)], [str(val_file)] if val_file is not None else []
    data.train_batch_size = n_prompts
    data.gen_batch_size = None  # each of dynamic sampling's generation rounds draws the dry run's prompts
    data.val_batch_size = None
    data.max_response_length = min(response_length, cfg.data.max_response_length)
    sequences = n_prompts * arr.rollout.n
    actor = arr.actor
    actor.ppo_mini_batch_size = n_prompts  # one mini-batch: the first update starts exactly on-policy
    actor.ppo_micro_batch_size_per_gpu = _divisor_at_most(sequences, actor.ppo_micro_batch_size_per_gpu)
    if critic.ppo_mini_batch_size is not None:
        critic.ppo_mini_batch_size = n_prompts
    critic.ppo_micro_batch_size_per_gpu = _divisor_at_most(sequences, critic.ppo_micro_batch_size_per_gpu)
    for section in (arr.rollout, arr.ref):
        section.log_prob_micro_batch_size_per_gpu = _divisor_at_most(sequences,
                                                                     section.log_prob_micro_batch_size_per_gpu)
    on_gpu = cfg.trainer.device == "cuda" and torch.cuda.is_available()
    trainer.device = "cuda" if on_gpu else "cpu"
    if not on_gpu:
        arr.rollout.name = "hf"
    trainer.n_gpus_per_node, trainer.nnodes = 1, 1
    trainer.total_training_steps, trainer.total_epochs = steps, steps
    groups = small.algorithm.filter_groups
    if groups.enable:  # a step may draw several generation rounds: data for as many as it is allowed
        groups.max_num_gen_batches = groups.max_num_gen_batches if groups.max_num_gen_batches > 0 else 8
        trainer.total_epochs = steps * groups.max_num_gen_batches
    # one validation, after the last step (test_freq -1 would be none): a reward that breaks on the validation
    # split fails here, not in the run
    trainer.test_freq, trainer.save_freq, trainer.val_before_train = steps, -1, False
    trainer.critic_warmup = 0  # the actor must update on the first step for the KL check
    trainer.resume_mode, trainer.resume_from_path = "disable", None
    trainer.default_local_dir = str(work_dir / "checkpoints")
    trainer.logger = []
    if hasattr(trainer, "prometheus_port"):
        trainer.prometheus_port = None
    validate_config(small)
    return small


# ----------------------------------------------------------------------------- the checks


def _check(report: SmokeReport, name: str, passed: bool, detail: str) -> None:
    report.checks.append({"name": name, "passed": bool(passed), "detail": detail})
    if not passed:
        raise SmokeTestError(f"smoke test failed at '{name}': {detail}\n{report.summary()}")


def _move_trainable(module: torch.nn.Module) -> None:
    """Add 1 to every parameter ``module`` trains (a LoRA adapter's, not the frozen base it loads again)."""
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.requires_grad:
                parameter.add_(1.0)


def _state_differences(module_a: torch.nn.Module, module_b: torch.nn.Module) -> list[str]:
    state_a, state_b = module_a.state_dict(), module_b.state_dict()
    if state_a.keys() != state_b.keys():
        return sorted(set(state_a) ^ set(state_b))
    return [name for name, value in state_a.items() if not torch.equal(value, state_b[name])]


#: the start of the notices loading a prompt file gives (its truncation, its prompts that end with an answer, ...)
DATA_NOTICES = ("notice: data.train_files: ", "notice: data.val_files: ")


class WithoutNotices:
    """A text stream that passes what is written to ``out`` as it comes, but for the lines that start with one of
    ``starts``: a line is held back only while what has come of it could still be one of them, so a progress bar
    (``\\r`` frames, no newline) and every other line reach ``out`` at once and in order."""

    def __init__(self, out, starts: tuple[str, ...]) -> None:
        self.out, self.starts = out, starts
        self.held = ""  # the start of the line being written, while it could still be one left out
        self.leaving = False  # the line being written is one left out: until its newline

    def write(self, text: str) -> int:
        for piece in re.split(r"(?<=\n)", text):
            if not piece:
                continue
            whole = piece.endswith("\n")
            if self.leaving:
                self.leaving = not whole
                continue
            line, self.held = self.held + piece, ""
            if line.startswith(self.starts):
                self.leaving = not whole
            elif not whole and any(start.startswith(line) for start in self.starts):
                self.held = line
            else:
                self.out.write(line)
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def close_line(self) -> None:
        """Write what is held (a line that ended before it could be told apart) to ``out``."""
        if self.held:
            self.out.write(self.held)
            self.held = ""

    def __getattr__(self, name: str):  # encoding, isatty, fileno ...: the stream's own
        return getattr(self.out, name)


def _right_or_wrong(cfg: PPOConfig, verdicts: Sequence[tuple[str, float]]) -> tuple[bool, str]:
    """(passed, detail) of the evaluation's check of the reward's acc on the dry run's validation responses."""
    from rlhf_core.pipeline.evaluate import NotRightOrWrong, check_right_or_wrong

    custom = cfg.custom_reward_function
    reward = f"the reward function {custom.name!r} of {custom.path}" if custom.path else "the reward"
    try:
        check_right_or_wrong(verdicts, reward)
    except NotRightOrWrong as exc:
        return False, (f"{exc} (on the dry run's validation responses: the evaluation after training would refuse "
                       "the reward there)")
    return True, (f"the reward's acc is 0 or 1 on all {len(verdicts)} validation responses, as the evaluation "
                  "after training counts each problem right or wrong")


@contextlib.contextmanager
def _dry_run_session(small: PPOConfig, cloned: bool, own_cap: bool, reward_fn):
    """:func:`~rlhf_core.main_ppo.trainer_session` of the dry run's config, its datasets' notices left out of
    stderr: they read the dry run's copies of the prompts first_prompts took from the run's files, where it said
    them once with the run's files and counts (each copy's said them again, of its few rows, once a trainer).

    Of the trainer's warnings about a run that cannot learn, the one about scores that tell no responses apart
    ("flat": a reward that scores every response the same teaches nothing, in the run as here) is given where
    the model is the run's own (not ``cloned``: a random clone's answers all fail a sound reward alike). The one
    about responses cut off at data.max_response_length, and so about a step both cut off and scored alike (which
    the trainer puts down to the cut), only where that length is the run config's own (``own_cap``: no longer
    than the dry run's ``response_length``, the run cuts them there too) and the model too: at a cap of the dry
    run's own it told the user to raise a length the run config already sets higher, and a random clone's
    answers seldom end."""
    from rlhf_core.main_ppo import trainer_session

    stuck = () if cloned else ("clip", "flat") if own_cap else ("flat",)
    with contextlib.ExitStack() as stack:
        stream = WithoutNotices(sys.stderr, DATA_NOTICES)
        try:
            with contextlib.redirect_stderr(stream):  # (only while the trainer is built: its steps print as they go)
                trainer = stack.enter_context(trainer_session(small, stuck_warnings=stuck, reward_fn=reward_fn))
        finally:
            stream.close_line()
        yield trainer


def run_smoke_test(cfg: PPOConfig, work_dir: str | Path, n_prompts: int = 4, response_length: int = 16,
                   steps: int = 2, tiny_threshold: int = TINY_THRESHOLD, evaluated: bool = False) -> SmokeReport:
    """Run the dry run of ``cfg`` in ``work_dir``; returns the report or raises SmokeTestError.

    ``evaluated``: the trained policy is evaluated after the run (the pipeline's evaluate step), which counts each
    problem right or wrong; the dry run's validation responses are then checked as it checks its own
    (:func:`~rlhf_core.pipeline.evaluate.check_right_or_wrong`): a reward giving an acc of 0.2 fails here, not
    after the whole training. Training alone takes such a reward (its validation averages the acc)."""
    from rlhf_core.main_ppo import preflight
    from rlhf_core.models.loading import check_policy_dir, load_tokenizer
    from rlhf_core.training.checkpoint import latest_checkpoint

    started = time.perf_counter()
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    model_cfg = cfg.actor_rollout_ref.model
    # ModelError naming the key, not a hub lookup; and a reward model, which its causal-LM clone would hide
    target = check_policy_dir(model_cfg.path, need_weights=False)
    target_parameters = count_parameters_from_config(target, model_cfg.trust_remote_code)
    cloned = target_parameters >= tiny_threshold
    model_path = target
    if cloned:
        model_path = build_tiny_clone(target, work_dir / "tiny_model", model_cfg.tokenizer_path,
                                      trust_remote_code=model_cfg.trust_remote_code)
    parameters = count_parameters_from_config(model_path, model_cfg.trust_remote_code) if cloned else target_parameters
    tokenizer = load_tokenizer(cfg.value("actor_rollout_ref.model.tokenizer_path"), model_cfg.trust_remote_code)
    # the prompts data.train_max_samples keeps, as the trainer draws them: the dry run's batch is then at most
    # that many (a batch of n_prompts over it failed the shrunk config's check, naming a batch size not the user's)
    seed = cfg.value("data.seed")
    train_rows, kept = first_prompts(cfg.data.train_files, tokenizer, cfg.data, n_prompts, "data.train_files",
                                     cfg.needs_ground_truth(), cfg.data.train_max_samples, seed)
    # the real run draws this many prompts a round and stops when the kept ones are fewer: say so now, not there
    batch_key, batch = cfg.prompt_batch()
    if len(kept) < batch:  # (input refused, as the trainer's own check refuses it: not a failed check)
        raise DataError(too_few_prompts(batch_key, batch, len(kept), kept.dropped_overlong, kept.sampled))
    train_file = write_parquet(train_rows, work_dir / "data" / "train.parquet")
    val_file = None  # a config without validation files runs without validation, here as in training
    if cfg.data.val_files:
        val_rows, _ = first_prompts(cfg.data.val_files, tokenizer, cfg.data, n_prompts, "data.val_files",
                                    cfg.needs_ground_truth(), cfg.data.val_max_samples, seed)
        val_file = write_parquet(val_rows, work_dir / "data" / "val.parquet")
    n_prompts = len(train_rows)
    small = scale_config(cfg, model_path, train_file, val_file, work_dir, n_prompts, response_length, cloned, steps)
    report = SmokeReport(str(target), str(model_path), cloned, target_parameters, parameters, n_prompts, steps,
                         small.reward_model.model.path if small.reward_model.enable else None)

    reward_fn = preflight(small)  # (the reward file runs once: both of the dry run's trainers score with it)
    own_cap = cfg.data.max_response_length <= response_length  # (the shrunk config keeps the run's length then)
    with _dry_run_session(small, cloned, own_cap, reward_fn) as trainer:
        # the run's log-prob pass, which its one mini-batch would skip: step 1's KL is then that pass against the
        # update's own forward, as in a run of several mini-batches (0 by construction without it)
        trainer.always_old_log_prob = True
        history = trainer.fit()
        report.metrics = [{k: float(v) for k, v in step.metrics.items() if isinstance(v, (int, float))}
                          for step in history]
        _check(report, "iterations", len(history) == steps, f"{len(history)} of {steps} PPO iterations ran")
        bad = [f"step {i + 1} {key}={metrics[key]}" for i, metrics in enumerate(report.metrics)
               for key in FINITE_KEYS if key in metrics and not math.isfinite(metrics[key])]
        _check(report, "finite losses", not bad, ", ".join(bad) or "every loss and gradient norm is finite")
        skipped = report.metrics[-1].get("training/skipped_steps", 0.0)
        _check(report, "no skipped updates", skipped == 0,
               f"{skipped:.0f} optimizer steps skipped for non-finite gradients")
        first_kl = report.metrics[0].get("actor/ppo_kl")
        _check(report, "on-policy first step", first_kl is not None and abs(first_kl) < KL_TOLERANCE,
               f"actor/ppo_kl on step 1 = {first_kl} (must be |kl| < {KL_TOLERANCE}: the update's log-probs must "
               "equal the rollout's; look at dropout, dtype or padding differences between the two)")

        if evaluated and trainer.val_verdicts:  # (no validation files: no problem the evaluation would grade)
            _check(report, "right or wrong", *_right_or_wrong(cfg, trainer.val_verdicts))

        root = Path(small.trainer.default_local_dir)
        latest = latest_checkpoint(root)
        if latest is None or not latest.name.endswith(f"_{trainer.global_step}"):
            latest = trainer.save_checkpoint()
        with _dry_run_session(small, cloned, own_cap, reward_fn) as fresh:
            # moved off the weights it starts from (training's too: a random clone's flat scores leave the actor
            # where it began), so that only what the checkpoint restores makes the two equal
            _move_trainable(fresh.actor.module)
            if fresh.critic is not None:
                _move_trainable(fresh.critic.module)
            fresh.load_checkpoint(latest)
            differing = _state_differences(trainer.actor.module, fresh.actor.module)
            if trainer.critic is not None:
                differing += [f"critic.{name}" for name in _state_differences(trainer.critic.module,
                                                                              fresh.critic.module)]
        _check(report, "checkpoint round trip", not differing,
               f"saved {latest.name} and loaded it into a fresh trainer: "
               + (f"{len(differing)} tensors differ, e.g. {differing[:3]}" if differing else "weights equal"))
    report.wall_s = time.perf_counter() - started
    return report
