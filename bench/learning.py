"""Learning proof: PPO lifts the warm-started tiny model's greedy accuracy on held-out problems.

For each run (gae, grpo, gae + KL loss, the dapo and gspo recipes, rm) the same warm-started demo
model trains for a wall-clock budget on synthetic arithmetic prompts; greedy accuracy is measured
before and after on 1,000 problems held out from the warm start, the RL prompts and the run itself
(``--n-report``: no validation, guard or rollback sees them), beside the trainer's own validation set
(``--n-val``, as many others), on which its guards choose checkpoints; and at the end the KL of the policy
to the base model on its own samples. Prints one line per run:

    accuracy: 0.31 -> 0.52 (+21.0 points) on 1000 untouched problems (validation set 0.30 -> 0.53) in 40 steps, 480 s [gae]

and saves the reward and accuracy curves as a PNG.

The ``rm`` run trains against a learned reward model instead of the rule: a Bradley-Terry reward
model is first fitted on synthetic preference pairs of the demo task
(:func:`rlhf_core.data.preference.synthetic_pairs`; chosen: the right final answer; rejected: the
demo's systematic slip, :func:`rlhf_core.models.toy.with_slip`), starting
from the demo model, by the project's reward-model trainer with the settings of
``bench/reward_model.py``; its held-out pair accuracy is reported beside the policy's held-out gold
(rule) accuracy before and after PPO. The pairs' questions are disjoint from the RL prompts and from
both held-out sets.

    python bench/learning.py [--minutes 10] [--runs gae,grpo,kl_loss,rm,dapo,gspo] [--out bench/results]
        [--model DIR] [--rm-pairs 2000]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch
from reward_model import run as train_reward_model  # bench/reward_model.py, beside this script

from rlhf_core.config import load_config
from rlhf_core.data.dataset import RLHFDataset
from rlhf_core.data.preference import synthetic_pairs, write_splits
from rlhf_core.data.schema import make_record
from rlhf_core.data.synthetic import DATA_SOURCE, generate_problems
from rlhf_core.main_ppo import trainer_session
from rlhf_core.models.toy import ensure_toy_model, heldout_problems, preset_settings

REPO = Path(__file__).resolve().parents[1]
RUNS = {
    "gae": ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=false"],
    "grpo": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=false"],
    "kl_loss": ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true"],
    "rm": ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=false", "reward_model.enable=true",
           "reward_model.micro_batch_size_per_gpu=128"],  # + reward_model.model.path, set by main()
    # DAPO (Yu et al. 2025): no KL, clip-higher, token-mean loss, dynamic sampling, overlong shaping
    "dapo": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=false",
             "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
             "actor_rollout_ref.actor.loss_agg_mode=token-mean", "algorithm.filter_groups.enable=true",
             "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=10",
             "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=16",
             "reward_model.overlong_buffer.penalty_factor=1.0"],
    # GSPO (Zheng et al. 2025): GRPO advantages, the sequence-level ratio with the paper's clip range
    "gspo": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=false",
             "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.clip_ratio_low=3e-4",
             "actor_rollout_ref.actor.clip_ratio_high=4e-4"],
}


def prepare_data(out: Path, n_train: int, n_val: int, n_report: int, seed: int) -> tuple[Path, Path, Path | None]:
    """RL prompts from the demo task; a validation set for the trainer and its guards, and a report set that
    only the before/after measurements see (none when ``n_report`` is 0), both held out from the warm start
    and the prompts."""
    out.mkdir(parents=True, exist_ok=True)
    heldout = heldout_problems("demo", seed=0, n=n_val + n_report)
    val, report = heldout[:n_val], heldout[n_val:]
    task = preset_settings("demo")["task"]
    train = generate_problems(n_train, seed=seed + 17, unique=True, exclude={p["question"] for p in heldout},
                              **task)
    paths = []
    for split, problems in (("train", train), ("test", val), ("report", report))[:3 if n_report else 2]:
        rows = [make_record(p["question"], p["solution"], p["answer"], split, i, DATA_SOURCE)
                for i, p in enumerate(problems)]
        path = out / f"{split}.parquet"
        pd.DataFrame(rows).to_parquet(path)
        paths.append(path)
    return paths[0], paths[1], paths[2] if n_report else None


def report_accuracy(trainer, report: RLHFDataset) -> float:
    """Greedy accuracy on the report set, through the trainer's own validation (the same prompts, sampling
    settings and scoring), with its validation set put back afterwards."""
    kept = trainer.val_dataset
    trainer.val_dataset = report
    try:
        return trainer.val_accuracy(trainer.validate())
    finally:
        trainer.val_dataset = kept


@torch.no_grad()
def kl_to_base(trainer, base_model: Path, n_prompts: int = 64) -> float:
    """Mean per-token KL(policy || base) on responses the policy samples for validation prompts.

    The k1 estimate (log pi - log pi_base, averaged over sampled response tokens), which is
    unbiased for the KL of the sampled sequences; the same for every run, whether or not it
    trained with a reference model.
    """
    from transformers import AutoModelForCausalLM

    from rlhf_core.workers.actor import response_log_prob

    base = AutoModelForCausalLM.from_pretrained(str(base_model)).eval()
    prompts = trainer.val_dataset.collate(list(range(min(n_prompts, len(trainer.val_dataset)))))
    batch = trainer.actor.generate(prompts, trainer._train_params())
    log_prob, _ = trainer.actor.compute_log_prob(batch)
    base_log_prob, _ = response_log_prob(base, batch, trainer.config.actor_rollout_ref.rollout.temperature,
                                         False, False)
    mask = batch["response_mask"].float()
    return float(((log_prob - base_log_prob) * mask).sum() / mask.sum())


def run_one(name: str, model: Path, train: Path, val: Path, report: Path, minutes: float, out: Path,
            extra: list[str], guard_every: int = 0) -> dict:
    """Train for ``minutes`` of step time; greedy accuracy on the validation set before, at 1/4, 1/2, 3/4 and
    after, and on the report set before and after.

    Each step is the trainer's own (``fit_step``), with its guards: a validation-accuracy drop (or,
    with a reward model, over-optimisation) rolls back to the best checkpoint. With ``guard_every``
    (the rm run) it also validates every that many steps, as ``trainer.test_freq`` would."""
    import shutil

    from rlhf_core.training.guards import GuardError

    shutil.rmtree(out / name, ignore_errors=True)  # its checkpoints start afresh
    overrides = [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={train}", f"data.val_files={val}",
        "trainer.total_training_steps=100000", "trainer.logger=[]", f"trainer.default_local_dir={out / name}",
        "data.val_batch_size=500", "trainer.resume_mode=disable", *RUNS[name], *extra,
    ]
    cfg = load_config(overrides, config_file=REPO / "configs" / "ppo_demo_cpu.yaml")
    with trainer_session(cfg) as trainer:
        report_set = RLHFDataset(str(report), trainer.tokenizer, trainer.config.data, key="report")
        report_before = report_accuracy(trainer, report_set)
        before = trainer.val_accuracy(trainer.validate_before_train())
        curve, budget, start = [], minutes * 60, time.perf_counter()
        marks = {budget * f for f in (0.25, 0.5, 0.75)}
        acc_curve, events = [(0, 0.0, before)], []
        train_seconds = 0.0

        def due(step: int, metrics: dict) -> bool:  # a quarter of the budget passed, or the guard's schedule
            passed = {m for m in marks if train_seconds + metrics["timing_s/step"] >= m}
            marks.difference_update(passed)
            return bool(passed) or bool(guard_every and step % guard_every == 0)

        while train_seconds < budget:
            try:
                result = trainer.fit_step(validate=due)
            except GuardError as exc:
                print(f"[{name}] {exc}", flush=True)
                break
            metrics = result.metrics
            train_seconds += metrics["timing_s/step"]
            curve.append({"step": result.step, "seconds": train_seconds,
                          "score": metrics["critic/score/mean"], "kl_loss": metrics.get("actor/kl_loss"),
                          "response_length": metrics["response_length/mean"]})
            accuracy = trainer.val_accuracy(metrics)
            if accuracy is not None:
                acc_curve.append((result.step, train_seconds, accuracy))
            if result.event is not None:
                events.append({"step": result.step, "kind": result.event.kind, "action": result.event.action,
                               "target_step": result.event.target_step})
            print(f"[{name}] step {result.step} {train_seconds:.0f}s score {metrics['critic/score/mean']:.3f} "
                  f"length {metrics['response_length/mean']:.1f}", flush=True)
        after = trainer.val_accuracy(trainer.validate())
        acc_curve.append((trainer.global_step, train_seconds, after))
        report_after = report_accuracy(trainer, report_set)
        return {"name": name, "report_before": report_before, "report_after": report_after,
                "report_problems": len(report_set), "before": before, "after": after, "steps": trainer.global_step,
                "train_seconds": train_seconds, "wall_seconds": time.perf_counter() - start,
                "kl_to_base": kl_to_base(trainer, model), "curve": curve, "acc_curve": acc_curve,
                "guard_events": events}


def summary_line(r: dict) -> str:
    delta = 100 * (r["report_after"] - r["report_before"])
    rm = (f", reward model held-out pair accuracy {r['pair_acc_before']:.2f} -> {r['pair_acc']:.2f} "
          f"({r['rm_steps']} steps, {r['rm_train_seconds']:.0f} s)") if "pair_acc" in r else ""
    return (f"accuracy: {r['report_before']:.3f} -> {r['report_after']:.3f} ({delta:+.1f} points) on "
            f"{r['report_problems']} untouched problems (validation set {r['before']:.3f} -> {r['after']:.3f}) "
            f"in {r['steps']} steps, "
            f"{r['train_seconds']:.0f} s, KL to base {r['kl_to_base']:.5f}{rm} [{r['name']}]")


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for result in results:
        seconds = [c["seconds"] for c in result["curve"]]
        scores = pd.Series([c["score"] for c in result["curve"]]).rolling(5, min_periods=1).mean()
        left.plot(seconds, scores, label=result["name"])
        right.plot([a[1] for a in result["acc_curve"]], [a[2] for a in result["acc_curve"]], marker="o",
                   label=result["name"])
    left.set(title="training reward (rolling mean of 5 steps)", xlabel="training seconds", ylabel="mean score")
    right.set(title="greedy accuracy, the validation set", xlabel="training seconds", ylabel="accuracy")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="training budget per run")
    parser.add_argument("--runs", default="gae,grpo,kl_loss", help=f"comma list of {', '.join(RUNS)}")
    parser.add_argument("--n-val", type=int, default=1000, help="validation problems (the trainer's and its guards')")
    parser.add_argument("--n-report", type=int, default=1000,
                        help="problems only the before/after measurements see (the headline accuracy)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--model", default=None, help="demo model directory (default: the cached demo build)")
    parser.add_argument("--rm-pairs", type=int, default=2000,
                        help="problems for the rm run's reward-model training pairs (less those whose slip "
                             "gives the right answer)")
    parser.add_argument("--rm-epochs", type=int, default=1, help="its epochs over them")
    parser.add_argument("--rm-guard-every", type=int, default=3,
                        help="the rm run also validates every N steps, for the over-optimisation guard "
                             "(0: at the quarter marks only)")
    parser.add_argument("overrides", nargs="*", help="extra trainer overrides for every run")
    args = parser.parse_args()
    torch.set_num_threads(2)
    out = Path(args.out)
    model = Path(args.model) if args.model else ensure_toy_model("demo")
    train, val, report = prepare_data(out / "data", n_train=20000, n_val=args.n_val, n_report=args.n_report,
                                      seed=args.seed)
    results = []
    for name in args.runs.split(","):
        extra, rm = [], {}
        if name == "rm":
            exclude = set()
            for path in (train, val, report):
                exclude |= set(pd.read_parquet(path)["extra_info"].map(lambda e: e["question"]))
            pairs = synthetic_pairs(args.rm_pairs, 500, seed=args.seed + 101, task=preset_settings("demo")["task"],
                                    exclude=exclude)
            pair_dir = out / "data" / "preference"
            write_splits(pair_dir, *pairs, DATA_SOURCE, overwrite=True)
            record = train_reward_model("demo", model, pair_dir, out, args.rm_epochs, lora_rank=0, steps=None)
            rm = {"pair_acc_before": record["pair_accuracy_before"], "pair_acc": record["pair_accuracy"],
                  "rm_steps": record["steps"], "rm_train_seconds": record["train_seconds"],
                  "rm_train_pairs": record["train_pairs"], "rm_val_pairs": record["val_pairs"],
                  "path": record["path"]}
            print(f"reward model: held-out pair accuracy {rm['pair_acc_before']:.3f} -> {rm['pair_acc']:.3f} in "
                  f"{rm['rm_train_seconds']:.0f} s", flush=True)
            extra = [f"reward_model.model.path={rm['path']}"]
        results.append(run_one(name, model, train, val, report, args.minutes, out,
                               args.overrides + [f"trainer.seed={args.seed}"] + extra,
                               guard_every=args.rm_guard_every if name == "rm" else 0))
        results[-1].update(rm)
        print(summary_line(results[-1]), flush=True)
    plot(results, out / "learning_curves.png")
    (out / "learning.json").write_text(json.dumps(results, indent=1))
    print(f"\nmodel: {model}\nvalidation: {args.n_val} held-out problems, report: {args.n_report} more, greedy\n"
          f"curves: {out / 'learning_curves.png'}")
    for result in results:
        print(summary_line(result))


if __name__ == "__main__":
    main()
