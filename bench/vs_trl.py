"""Ours against TRL's GRPOTrainer, side by side, at equal work, on CPU.

Both trainers get the same model directory, the same prompts (synthetic arithmetic, the chat
template applied by each), the same group size, response length, learning rate and number of
optimisation steps; GRPO advantages, no KL term (TRL ``beta=0``, ours ``use_kl_loss=false``),
one optimiser step per generation batch, one pass over it, in micro-batches of ``--micro`` sequences in both
(``--trl-micro all``: TRL takes all of them in one), AdamW with betas (0.9, 0.95) in both (TRL's default beta2 is
0.999), float32 weights in both, activation checkpointing off in both (TRL's ``GRPOConfig`` turns it on unless told;
``--checkpointing`` turns it on in both). Step times and tokens per second are medians over the steps after a
warm-up, ours in this process and TRL's in a child process, one after the other. Prints

    ours/trl step time: 0.61
    ours/trl tokens per second: 1.64

per model (the demo's tiny model, a random-weight ~25M-parameter one on synthetic arithmetic, and
``smollm2``: the real SmolLM2-135M-Instruct of ``make real-model`` on real GSM8K train prompts from
``GSM8K_DIR``), and both trainers' mean reward over the last steps, so that speed is not bought
with learning.

Our trainer keeps glibc's heap for reuse (``trainer.keep_freed_memory``, on by default); TRL leaves glibc
as it comes. So TRL runs in a fresh process of its own (``--trl-heap default``, as a TRL user has it), or,
with ``--trl-heap kept``, in one that applies the same setting first, which shows how much of the gap is
that setting.

Sampled responses end at EOS, so the two trainers' token counts differ by chance (with random
weights, EOS comes at a random step). ``--fixed-length`` makes every response ``--response`` tokens
long in both, so that tokens per second compares speed alone.

Ours runs with ``use_shared_prefix`` (each prompt's tokens computed once for its group in the update, as
the demo config does); ``--shared-prefix off`` runs every row whole, ``both`` runs ours both ways; ``--packed`` adds a run of ours with
every row whole and packed without padding (``use_remove_padding``, as verl runs on GPUs).

Needs the ``bench`` extra (``pip install -e ".[bench]"``, which brings TRL).

    python bench/vs_trl.py [--steps 6] [--warmup 1] [--prompts 8] [--group 4] [--response 64]
    python bench/vs_trl.py --models smollm2 --prompts 4 --steps 3      # the real checkpoint
    python bench/vs_trl.py --models random20m --fixed-length           # equal token counts
    python bench/vs_trl.py --models random20m --shared-prefix both     # ours without and with use_shared_prefix
    python bench/vs_trl.py --models random20m --shared-prefix off --packed   # ours padded, then packed (use_remove_padding)
    python bench/vs_trl.py --models smollm2 --prompts 4 --steps 3 --bf16   # both in bf16 mixed precision
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from roofline import SMOLLM2, require_model_dir  # bench/roofline.py, beside this script

from rlhf_core import heap
from rlhf_core.config import load_config
from rlhf_core.data.gsm8k import preprocess_gsm8k
from rlhf_core.data.synthetic import build_dataset
from rlhf_core.main_ppo import trainer_session
from rlhf_core.models.toy import ensure_toy_model, random_toy_model
from rlhf_core.rewards.gsm8k import compute_score

REPO = Path(__file__).resolve().parents[1]
LAYOUT_TAGS = {"whole": "", "shared": ", shared prefix", "packed": ", packed"}


def run_ours(model: Path, data: Path, args, max_prompt: int, layout: str = "whole") -> dict:
    """Our trainer's GRPO steps; ``layout``: ``whole`` (every row padded whole), ``shared`` (each prompt computed
    once for its group, ``use_shared_prefix``) or ``packed`` (rows whole, packed without padding,
    ``use_remove_padding``)."""
    cfg = load_config([f"data.max_prompt_length={max_prompt}",
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}", f"data.train_batch_size={args.prompts}",
        f"data.max_response_length={args.response}", "data.shuffle=false",
        f"actor_rollout_ref.rollout.n={args.group}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro or args.prompts}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.prompts * args.group}",
        "actor_rollout_ref.actor.ppo_epochs=1", "actor_rollout_ref.actor.use_kl_loss=false",
        f"actor_rollout_ref.actor.optim.lr={args.lr}", "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
        "actor_rollout_ref.actor.optim.betas=[0.9,0.95]",  # stated, as TRL's adam_beta1/2 below
        "actor_rollout_ref.actor.optim.weight_decay=0.0", "actor_rollout_ref.actor.entropy_coeff=0.0",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "trainer.logger=[]",
        f"trainer.default_local_dir={data.parent / 'ours'}", "trainer.val_before_train=false",
        f"actor_rollout_ref.rollout.ignore_eos={str(args.fixed_length).lower()}",
        f"actor_rollout_ref.model.use_shared_prefix={str(layout == 'shared').lower()}",
        f"actor_rollout_ref.model.use_remove_padding={str(layout == 'packed').lower()}",
        f"trainer.cpu_matmul_dtype={'bfloat16' if args.bf16 else 'float32'}",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(args.checkpointing).lower()}",
    ], config_file=REPO / "configs" / "ppo_demo_cpu.yaml")
    with trainer_session(cfg) as trainer:
        times, tokens, rewards, phases = [], [], [], []
        for step in range(args.warmup + args.steps):
            _, rows = trainer.sampler.next_batch()
            start = time.perf_counter()
            metrics = trainer.train_step(trainer.train_dataset.collate(rows))
            elapsed = time.perf_counter() - start
            trainer.global_step += 1
            if step >= args.warmup:
                times.append(elapsed)
                tokens.append(metrics["response_length/mean"] * args.prompts * args.group)  # EOS included, as TRL's
                rewards.append(metrics["critic/score/mean"])
                phases.append({k.removeprefix("timing_s/"): v for k, v in metrics.items()
                               if k.startswith("timing_s/") and k != "timing_s/step"})
    phase_s = {name: statistics.median(p[name] for p in phases) for name in phases[0]}
    return {"step_s": statistics.median(times), "tokens_per_s": median_rate(tokens, times),
            "reward": statistics.mean(rewards[-args.last:]), "phases": phase_s}


def median_rate(tokens: list[float], times: list[float]) -> float:
    """The median over the timed steps of each step's tokens / seconds: the same statistic as the step time's
    median, so that a single slow step moves neither ratio (a sum over a sum would take it in, a median not)."""
    return statistics.median(count / seconds for count, seconds in zip(tokens, times, strict=True))


def micro_layout(args) -> tuple[int, int]:
    """TRL's (per_device_train_batch_size, gradient_accumulation_steps) for one optimiser step over the
    generation batch of ``--prompts`` x ``--group`` sequences: micro-batches of ``--micro`` sequences
    (default ``--prompts``, as ours), or all of them at once with ``--trl-micro all``."""
    rows = args.prompts * args.group
    micro = rows if args.trl_micro == "all" else (args.micro or args.prompts)
    if rows % micro:
        raise SystemExit(f"--micro {micro} does not divide the {rows} sequences of a step")
    return micro, rows // micro


def run_trl_in_child(model: Path, data: Path, args) -> dict:
    """:func:`run_trl` in a fresh (spawned) process: its own C heap, which our trainer's settings do not reach,
    kept for reuse as ours is only under ``--trl-heap kept``."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_trl, model, data, args).result()


def run_trl(model: Path, data: Path, args) -> dict:
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.trl_heap == "kept" and not heap.keep_freed_memory():
        raise SystemExit("--trl-heap kept: this process's C library is not glibc")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    frame = pd.read_parquet(data / "train.parquet")
    dataset = Dataset.from_dict({
        "prompt": [list(p) for p in frame["prompt"]],
        "ground_truth": [r["ground_truth"] for r in frame["reward_model"]],
    })

    def reward(completions, ground_truth, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [compute_score(t, g) for t, g in zip(texts, ground_truth)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], 0.0

        def on_step_begin(self, *_, model=None, **__):
            # the Trainer turns checkpointing on inside train(), so it is checked here, on the model it trains
            if model is not None and model.is_activation_checkpointing != args.checkpointing:
                raise RuntimeError(f"TRL trains with activation checkpointing {model.is_activation_checkpointing}, "
                                   f"asked for {args.checkpointing}: the two trainers would not do the same work")
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.start)

    micro, accumulation = micro_layout(args)
    config = GRPOConfig(
        output_dir=str(data.parent / "trl"), use_cpu=True, bf16=args.bf16, report_to="none",
        # one generation of --prompts x --group sequences a step, one optimiser step over it in `accumulation`
        # micro-batches of `micro` (loss_type "dapo", TRL's default: the token mean over the whole generation
        # batch, as ours with loss_agg_mode=token-mean)
        per_device_train_batch_size=micro, num_generations=args.group, loss_type="dapo",
        gradient_accumulation_steps=accumulation, steps_per_generation=accumulation, num_iterations=1,
        max_completion_length=args.response, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.95,  # as configs/ppo_demo_cpu.yaml (TRL's default beta2 is 0.999)
        max_grad_norm=1.0, max_steps=args.warmup + args.steps, logging_steps=1, save_strategy="no",
        shuffle_dataset=False, seed=1, disable_tqdm=True, dataloader_num_workers=0,
        # stated, not left to TRL: GRPOConfig turns activation checkpointing on by default (TRL >= 1.0), which
        # recomputes each forward in the backward; ours follows --checkpointing too
        activation_checkpointing=args.checkpointing,  # transformers 5's name (gradient_checkpointing warns)
        # EOS suppressed until the last token: every completion is --response tokens, as ours with ignore_eos
        generation_kwargs={"min_new_tokens": args.response} if args.fixed_length else None,
    )
    clock = Clock()
    # float32 weights, as ours loads them (transformers 5 loads in the dtype of config.json unless told)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32),
                          reward_funcs=reward, args=config,
                          train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(str(model)),
                          callbacks=[clock])
    trainer.train()
    logs = [row for row in trainer.state.log_history if "reward" in row]
    times = clock.times[args.warmup:]
    lengths = [row["completions/mean_length"] for row in logs][args.warmup:]  # EOS included, as ours
    rewards = [row["reward"] for row in logs][args.warmup:]
    return {"step_s": statistics.median(times),
            "tokens_per_s": median_rate([length * args.prompts * args.group for length in lengths], times),
            "reward": statistics.mean(rewards[-args.last:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed optimisation steps per trainer")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--last", type=int, default=3, help="steps averaged for the final reward")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--micro", type=int, default=None,
                        help="sequences per update micro-batch in both trainers (default --prompts; TRL: "
                             "per_device_train_batch_size, with gradient_accumulation_steps = steps_per_generation = "
                             "--prompts x --group / --micro, still one optimiser step per generation)")
    parser.add_argument("--trl-micro", choices=("same", "all"), default="same",
                        help="TRL's micro-batches: --micro sequences, as ours (same), or all --prompts x --group in one "
                             "(all: the layout of the figures in bench/RESULTS.md up to now)")
    parser.add_argument("--fixed-length", action="store_true",
                        help="every response runs to --response tokens in both trainers (ours: rollout.ignore_eos; "
                             "TRL: min_new_tokens), so that both do exactly the same number of tokens")
    parser.add_argument("--shared-prefix", choices=("off", "on", "both"), default="on",
                        help="our actor_rollout_ref.model.use_shared_prefix, on in configs/ppo_demo_cpu.yaml (each "
                             "prompt computed once for its group in the update); both: ours without, then with")
    parser.add_argument("--packed", action="store_true",
                        help="also run ours with every row whole and packed without padding "
                             "(actor_rollout_ref.model.use_remove_padding), after the --shared-prefix runs")
    parser.add_argument("--bf16", action="store_true",
                        help="mixed precision in both: ours trainer.cpu_matmul_dtype=bfloat16, TRL's bf16=True (autocast)")
    parser.add_argument("--checkpointing", action="store_true",
                        help="activation checkpointing in both trainers (ours: actor_rollout_ref.model."
                             "enable_gradient_checkpointing; TRL: activation_checkpointing); off in both by default")
    parser.add_argument("--trl-heap", choices=("default", "kept"), default="default",
                        help="TRL's process under glibc's defaults, as TRL runs (default), or with glibc's heap "
                             "kept as our trainer keeps it (kept)")
    parser.add_argument("--models", default="demo,random20m", help="comma list of demo, random20m, smollm2")
    parser.add_argument("--real-model", default=str(SMOLLM2),
                        help="the smollm2 model directory (make real-model)")
    parser.add_argument("--gsm8k", default=os.environ.get("GSM8K_DIR", str(REPO.parent / "shared" / "data" / "gsm8k")),
                        help="the GSM8K release (the smollm2 run's prompts)")
    args = parser.parse_args()
    missing = [name for name in ("trl", "datasets") if importlib.util.find_spec(name) is None]
    if missing:  # found out now, not after our trainer's minutes of steps
        parser.error(f"{' and '.join(missing)} not installed: `make bench-setup` installs the bench extra")
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    work = Path(tempfile.mkdtemp(prefix="vs_trl_"))
    models = {}  # name -> (model directory, prompt data directory, longest prompt in tokens)
    for name in args.models.split(","):
        if name in ("demo", "random20m") and not (work / "data").exists():
            build_dataset(work / "data", n_train=512, n_test=8, seed=0, max_ops=1, max_operand=12)
        if name == "demo":
            models[name] = (ensure_toy_model("demo"), work / "data", 256)
        elif name == "random20m":  # hidden 512 x 6 layers: about 25M parameters
            models[name] = (random_toy_model(work / "random20m", n_layers=6, hidden_size=512, seed=0),
                            work / "data", 256)
        elif name == "smollm2":
            real_model = require_model_dir(parser, args.real_model)
            preprocess_gsm8k(args.gsm8k, work / "gsm8k", max_rows=512)
            models[name] = (real_model, work / "gsm8k", 512)
        else:
            parser.error(f"unknown model {name!r}; use demo, random20m or smollm2")
    lines = []
    for name, (model, data, max_prompt) in models.items():
        from transformers import AutoModelForCausalLM

        params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(model)).parameters())
        layouts = {"off": ["whole"], "on": ["shared"], "both": ["whole", "shared"]}[args.shared_prefix]
        runs = {layout: run_ours(model, data, args, max_prompt, layout)
                for layout in layouts + ["packed"] * args.packed}
        trl = run_trl_in_child(model, data, args)
        lines.append(f"[{name}] ~{params / 1e6:.1f}M parameters, {args.prompts} prompts x {args.group} samples, "
                     f"response {'=' if args.fixed_length else '<='} {args.response}, {args.steps} steps after "
                     f"{args.warmup} warm-up, {args.threads} threads{', bf16 mixed precision' if args.bf16 else ''}, "
                     f"activation checkpointing {'on' if args.checkpointing else 'off'} in both, "
                     f"micro-batches of {args.micro or args.prompts} (ours) and {micro_layout(args)[0]} (TRL), "
                     f"TRL's heap: {'kept, as ours' if args.trl_heap == 'kept' else 'glibc defaults'}")
        for layout, ours in runs.items():
            tag = f"{name}{LAYOUT_TAGS[layout]}"
            lines += [
                f"[{tag}] step time: ours {ours['step_s']:.3f} s, trl {trl['step_s']:.3f} s",
                f"[{tag}] tokens per second: ours {ours['tokens_per_s']:.0f}, trl {trl['tokens_per_s']:.0f}",
                f"[{tag}] mean reward over the last {args.last} steps: ours {ours['reward']:.3f}, trl {trl['reward']:.3f}",
                f"[{tag}] our phases (median s): "
                + ", ".join(f"{phase} {seconds:.3f}" for phase, seconds in ours["phases"].items()),
                f"[{tag}] ours/trl step time: {ours['step_s'] / trl['step_s']:.2f}",
                f"[{tag}] ours/trl tokens per second: {ours['tokens_per_s'] / trl['tokens_per_s']:.2f}",
            ]
        print("\n".join(lines[-(1 + 6 * len(runs)):]), flush=True)
    print("\nsummary")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
