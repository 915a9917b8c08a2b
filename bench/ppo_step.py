"""The cost of one PPO iteration: where the time goes, and how close the trainer is to the floor.

The trainer runs N iterations on a fixed prompt batch after a warm-up; per-phase times come
from its own ``timing_s/*`` metrics. The floor is a minimal hand-written PPO iteration on the
same model and batch with the same math (one ``generate`` call, then plain forward/backward
passes, no trainer, workers or batching machinery), timed in the same process. Prints
``trainer/floor: <ratio of median step times>`` and the per-phase comparison.

    python bench/ppo_step.py [--iters 5] [--model demo|random] [--hidden 128 --layers 4] [--growth]
    python bench/ppo_step.py --growth-model outputs/smollm2-135m-instruct --growth-batch 2 --growth-response 16 \
        --iters 1                       # the growth table (time and peak RSS per phase) of a real checkpoint
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from roofline import WHOLE_ROWS  # bench/roofline.py, beside this script

from rlhf_core import algos
from rlhf_core.config import load_config
from rlhf_core.data.synthetic import build_dataset
from rlhf_core.main_ppo import trainer_session
from rlhf_core.models.loading import load_critic
from rlhf_core.models.toy import ensure_toy_model, random_toy_model

REPO = Path(__file__).resolve().parents[1]
PHASES = ["gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor"]


def floor_step(trainer, actor, ref, critic, actor_opt, critic_opt, prompts, cfg) -> dict[str, float]:
    """One PPO iteration in plain torch and transformers: the same math with none of the trainer's machinery.

    A baseline of plain library calls rather than a lower bound on the work: ``generate`` encodes each prompt
    once per sample, the passes compute logits at every position, and the models keep transformers' kernels
    (not the trainer's packed or oneDNN ones), so the trainer can, and does, come in under it."""
    n = cfg.actor_rollout_ref.rollout.n
    eos, pad = trainer.tokenizer.eos_token_id, trainer.tokenizer.pad_token_id
    times: dict[str, float] = {}

    def mark(name, start):
        times[name] = time.perf_counter() - start

    start = time.perf_counter()
    with torch.no_grad():
        out = actor.generate(input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"],
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n,
                             max_new_tokens=cfg.data.max_response_length, eos_token_id=eos, pad_token_id=pad)
    prompt_len = prompts["input_ids"].shape[1]
    responses = out[:, prompt_len:]  # (bs, R)
    after_eos = (responses == eos).long().cumsum(-1) - (responses == eos).long()  # tokens after the first EOS
    response_mask = (after_eos == 0).float()
    attention_mask = torch.cat([prompts["attention_mask"].repeat_interleave(n, 0), response_mask.long()], 1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    mark("gen", start)

    start = time.perf_counter()
    texts = trainer.tokenizer.batch_decode(responses, skip_special_tokens=True)
    truths = [t for t in prompts.meta["ground_truth"] for _ in range(n)]
    from rlhf_core.rewards.gsm8k import compute_score

    scores = torch.zeros_like(response_mask)
    last = (response_mask.sum(-1).long() - 1).clamp(min=0)
    scores[torch.arange(len(texts)), last] = torch.tensor([compute_score(t, g) for t, g in zip(texts, truths)])
    mark("reward", start)

    R = responses.shape[1]

    micro = cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
    chunks = [slice(lo, lo + micro) for lo in range(0, out.shape[0], micro)]

    def log_prob_of(model):
        parts = []
        for sl in chunks:
            logits = model(input_ids=out[sl], attention_mask=attention_mask[sl], position_ids=position_ids[sl]).logits
            parts.append(algos.logprobs_from_logits(logits[:, prompt_len - 1:-1].float(), responses[sl]))
        return torch.cat(parts)

    start = time.perf_counter()
    with torch.no_grad():
        old_log_prob = log_prob_of(actor)
    mark("old_log_prob", start)
    start = time.perf_counter()
    with torch.no_grad():
        ref_log_prob = log_prob_of(ref)
    mark("ref", start)

    def values_of(model):
        return torch.cat([model(input_ids=out[sl], attention_mask=attention_mask[sl], position_ids=position_ids[sl],
                                use_cache=False).logits[:, prompt_len - 1:-1, 0].float() for sl in chunks])

    start = time.perf_counter()
    with torch.no_grad():
        values = values_of(critic) * response_mask
    mark("values", start)
    start = time.perf_counter()
    advantages, returns = algos.compute_gae_advantage_return(scores, values, response_mask, 1.0,
                                                             cfg.algorithm.lam)
    mark("adv", start)

    mini = cfg.actor_rollout_ref.actor.ppo_mini_batch_size * n
    start = time.perf_counter()
    for lo in range(0, len(texts), mini):
        critic_opt.zero_grad()
        tokens = response_mask[lo:lo + mini].sum()
        for mlo in range(lo, min(lo + mini, len(texts)), cfg.critic.ppo_micro_batch_size_per_gpu):
            sl = slice(mlo, min(mlo + cfg.critic.ppo_micro_batch_size_per_gpu, lo + mini))
            vpred = critic(input_ids=out[sl], attention_mask=attention_mask[sl], position_ids=position_ids[sl],
                           use_cache=False).logits[:, prompt_len - 1:-1, 0].float()
            loss, _ = algos.compute_value_loss(vpred, returns[sl], values[sl], response_mask[sl],
                                               cfg.critic.cliprange_value, global_token_count=tokens)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
        critic_opt.step()
    mark("update_critic", start)
    start = time.perf_counter()
    actor_cfg = cfg.actor_rollout_ref.actor
    for lo in range(0, len(texts), mini):
        actor_opt.zero_grad()
        tokens = response_mask[lo:lo + mini].sum()
        for mlo in range(lo, min(lo + mini, len(texts)), actor_cfg.ppo_micro_batch_size_per_gpu):
            sl = slice(mlo, min(mlo + actor_cfg.ppo_micro_batch_size_per_gpu, lo + mini))
            logits = actor(input_ids=out[sl], attention_mask=attention_mask[sl], position_ids=position_ids[sl]).logits
            log_prob = algos.logprobs_from_logits(logits[:, prompt_len - 1:-1].float(), responses[sl])
            loss, _ = algos.compute_policy_loss(old_log_prob[sl], log_prob, advantages[sl], response_mask[sl],
                                                global_token_count=tokens)
            if actor_cfg.use_kl_loss:
                kl = algos.kl_penalty(log_prob, ref_log_prob[sl], actor_cfg.kl_loss_type)
                loss = loss + actor_cfg.kl_loss_coef * algos.agg_loss(kl, response_mask[sl], "token-mean",
                                                                      global_token_count=tokens)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
        actor_opt.step()
    mark("update_actor", start)
    times["step"] = sum(times.values())
    times["tokens"] = float(attention_mask.sum())
    times["response_tokens"] = float(response_mask.sum())
    assert R > 0
    return times


class PhaseMemory:
    """Peak resident memory per trainer phase: a thread samples VmRSS every 10 ms while a phase hook of
    the trainer (``trainer.phase_hooks``) tags which phase is running (the innermost one)."""

    def __init__(self, trainer):
        import threading

        self.trainer = trainer
        self.peaks: dict[str, float] = {}
        self.stack: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def rss_gb() -> float:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20  # kB -> GiB
        return float("nan")

    def _sample(self) -> None:
        while not self.stop.wait(0.01):
            if self.stack:
                phase = self.stack[-1]
                self.peaks[phase] = max(self.peaks.get(phase, 0.0), self.rss_gb())

    @contextmanager
    def tag(self, name: str):
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()

    def __enter__(self):
        self.trainer.phase_hooks.append(self.tag)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.trainer.phase_hooks.remove(self.tag)


def growth_shape(model: Path, work: Path, batch: int, response: int, args) -> dict:
    """One shape of the growth table, timed (and its memory sampled) in this process."""
    if not (work / "data" / "train.parquet").exists():
        build_dataset(work / "data", n_train=256, n_test=8, seed=0, max_ops=1)
    cfg = load_config([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={work / 'data/train.parquet'}",
        f"data.val_files={work / 'data/test.parquet'}", "trainer.logger=[]",
        f"trainer.default_local_dir={work / 'growth'}", f"data.train_batch_size={batch}",
        f"data.max_response_length={response}", f"actor_rollout_ref.actor.ppo_mini_batch_size={max(1, batch // 2)}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={max(1, batch // 2)}",
        f"critic.ppo_micro_batch_size_per_gpu={max(1, batch // 2)}", *WHOLE_ROWS, *args.overrides,
    ], config_file=REPO / "configs" / "ppo_demo_cpu.yaml")
    with trainer_session(cfg) as trainer:
        loaded = PhaseMemory.rss_gb()
        prompts = trainer.train_dataset.collate(list(range(batch)))
        with PhaseMemory(trainer) as memory:
            runs = [trainer.train_step(prompts) for _ in range(args.warmup + args.iters)][args.warmup:]
        n = cfg.actor_rollout_ref.rollout.n
        return {"step": statistics.median(r["timing_s/step"] for r in runs),
                "tokens": statistics.median(r["perf/total_num_tokens"] for r in runs),
                "response_tokens": statistics.median(r["response_length/mean"] for r in runs) * batch * n,
                "rss_loaded_gb": loaded, "rss_peak_gb": memory.peaks}


def growth(model: Path, work: Path, args) -> None:
    """Step time and peak memory as the work grows: batch x2, x4 and response length x2, x4, against the
    base. Each shape runs in a fresh process, so that one shape's memory high-water mark (which the
    allocator keeps) does not show up in the next."""
    import json
    import subprocess
    import sys

    batch0, response0 = args.growth_batch, args.growth_response
    shapes = [("base", 1, 1), ("batch x2", 2, 1), ("batch x4", 4, 1), ("response x2", 1, 2), ("response x4", 1, 4)]
    rows = []
    for label, batch_factor, response_factor in shapes:
        batch, response = batch0 * batch_factor, response0 * response_factor
        command = [sys.executable, __file__, "--growth-shape", f"{batch}:{response}", "--growth-model", str(model),
                   "--work", str(work), "--iters", str(args.iters), "--warmup", str(args.warmup),
                   "--threads", str(args.threads), *args.overrides]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        record = json.loads(out.strip().splitlines()[-1])
        rows.append((label, batch, response, record))
        print(f"[growth] {label}: {record['step']:.2f} s, peak RSS {max(record['rss_peak_gb'].values()):.2f} GiB",
              flush=True)
    base = rows[0][3]
    phases = [p for p in ("gen", "ref", "values", "update_critic", "update_actor") if p in base["rss_peak_gb"]]
    print(f"\ngrowth (model {model}, {args.iters} iterations after {args.warmup} warm-up each, a fresh process each)")
    print(f"{'shape':<13}{'prompts':>8}{'resp':>6}{'step s':>9}{'x time':>8}{'x tokens':>10}{'x resp tok':>11}"
          f"{'time/token':>11}{'RSS load':>9}" + "".join(f"{p[:12]:>13}" for p in phases) + f"{'x peak-load':>12}")
    peak0 = max(base["rss_peak_gb"].values()) - base["rss_loaded_gb"]
    for label, batch, response, r in rows:
        x_time, x_tokens = r["step"] / base["step"], r["tokens"] / base["tokens"]
        peak = max(r["rss_peak_gb"].values()) - r["rss_loaded_gb"]
        print(f"{label:<13}{batch:>8}{response:>6}{r['step']:>9.3f}{x_time:>8.2f}{x_tokens:>10.2f}"
              f"{r['response_tokens'] / base['response_tokens']:>11.2f}{x_time / x_tokens:>11.2f}"
              f"{r['rss_loaded_gb']:>9.2f}" + "".join(f"{r['rss_peak_gb'].get(p, float('nan')):>13.2f}" for p in phases)
              + f"{peak / peak0 if peak0 > 0 else float('nan'):>12.2f}")
    print("x time / x tokens near 1.00 means linear growth; above 1, the work grows faster than the tokens "
          "(attention is quadratic in the sequence length; generation adds one forward per response token). "
          "RSS columns: GiB after loading, then the peak during each phase; x peak-load: the growth of the "
          "memory the step adds above the loaded models, to set against x tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--model", choices=["demo", "random"], default="demo")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--growth", action="store_true",
                        help="also time batch x2, x4 and response length x2, x4 (a random-weight model, whose "
                             "responses run to the length limit)")
    parser.add_argument("--growth-model", help="a model directory for the growth table instead of the random one "
                                               "(e.g. outputs/smollm2-135m-instruct); skips the floor comparison")
    parser.add_argument("--growth-batch", type=int, default=16, help="prompts of the growth table's base shape")
    parser.add_argument("--growth-response", type=int, default=32, help="response length of its base shape")
    parser.add_argument("--growth-shape", help=argparse.SUPPRESS)  # BATCH:RESPONSE, one shape in this process
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.growth_shape:
        import json

        batch, response = map(int, args.growth_shape.split(":"))
        print(json.dumps(growth_shape(Path(args.growth_model), Path(args.work), batch, response, args)))
        return
    work = Path(tempfile.mkdtemp(prefix="ppo_step_"))
    if args.growth_model:
        growth(Path(args.growth_model), work, args)
        return
    if args.model == "demo":
        model = ensure_toy_model("demo")
    else:
        model = random_toy_model(work / "model", n_layers=args.layers, hidden_size=args.hidden, seed=0)
    build_dataset(work / "data", n_train=256, n_test=8, seed=0, max_ops=1)
    cfg = load_config([f"actor_rollout_ref.model.path={model}", f"data.train_files={work / 'data/train.parquet'}",
                       f"data.val_files={work / 'data/test.parquet'}", "trainer.logger=[]",
                       f"trainer.default_local_dir={work / 'out'}", *WHOLE_ROWS, *args.overrides],
                      config_file=REPO / "configs" / "ppo_demo_cpu.yaml")
    with trainer_session(cfg) as trainer:
        prompts = trainer.train_dataset.collate(list(range(cfg.data.train_batch_size)))
        n_params = sum(p.numel() for p in trainer.actor.module.parameters())

        ours = []
        for i in range(args.warmup + args.iters):
            metrics = trainer.train_step(prompts)
            if i >= args.warmup:
                ours.append(metrics)
        peak_ours = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

        from transformers import AutoModelForCausalLM

        actor = AutoModelForCausalLM.from_pretrained(str(model)).eval()
        ref = AutoModelForCausalLM.from_pretrained(str(model)).eval()
        critic = load_critic(model)
        actor_opt = torch.optim.AdamW(actor.parameters(), lr=cfg.actor_rollout_ref.actor.optim.lr)
        critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.critic.optim.lr)
        floor = []
        for i in range(args.warmup + args.iters):
            times = floor_step(trainer, actor, ref, critic, actor_opt, critic_opt, prompts, cfg)
            if i >= args.warmup:
                floor.append(times)

        def med(rows, key):
            return statistics.median(r[key] for r in rows)

        print(f"model: {model} ({n_params / 1e6:.2f}M parameters), batch {cfg.data.train_batch_size} prompts x "
              f"{cfg.actor_rollout_ref.rollout.n} samples, response <= {cfg.data.max_response_length} tokens, "
              f"{args.iters} iterations after {args.warmup} warm-up, {args.threads} threads")
        print(f"{'phase':<15}{'ours s':>10}{'floor s':>10}{'ratio':>8}")
        for phase in PHASES:
            f = med(floor, phase)
            if f"timing_s/{phase}" not in ours[0]:  # a pass ours left out (on-policy: no old log-probs)
                print(f"{phase:<15}{'-':>10}{f:>10.3f}{'-':>8}")
                continue
            o = med(ours, f"timing_s/{phase}")
            print(f"{phase:<15}{o:>10.3f}{f:>10.3f}{(o / f if f else float('nan')):>8.2f}")
        step_ours, step_floor = med(ours, "timing_s/step"), med(floor, "step")
        gen_share = med(ours, "timing_s/gen") / step_ours
        tokens_ours = med(ours, "perf/total_num_tokens") / step_ours
        tokens_floor = med(floor, "tokens") / step_floor
        print(f"step: ours {step_ours:.3f} s, floor {step_floor:.3f} s")
        print(f"tokens/s: ours {tokens_ours:.0f}, floor {tokens_floor:.0f}")
        print(f"generation share of the step: {gen_share:.0%} (training {1 - gen_share:.0%})")
        print(f"peak RSS after our iterations: {peak_ours:.2f} GiB")
        print(f"response tokens per step: ours {med(ours, 'response_length/mean') * len(prompts) * cfg.actor_rollout_ref.rollout.n:.0f}, "
              f"floor {med(floor, 'response_tokens'):.0f}")
        print(f"trainer/floor: {step_ours / step_floor:.2f}")
    if args.growth:
        growth(random_toy_model(work / "growth_model", n_layers=args.layers, hidden_size=args.hidden, seed=0),
               work, args)


if __name__ == "__main__":
    main()
