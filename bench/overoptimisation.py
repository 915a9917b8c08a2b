"""Over-optimisation watch: PPO on the demo task against a planted reward model that pays for length.

The proxy reward is the response length (a stand-in for a learned reward model with a length bias,
the commonest flaw of real ones); the gold reward is the GSM8K rule. Validation logs both side by side
(``val-aux/<source>/reward/mean@1`` and ``val-aux/<source>/gold_reward/mean@1``); the guard
``trainer.guard.overopt_patience`` rolls the run back to its best-gold checkpoint, or stops it, once
the proxy has risen while the gold fell for that many validations in a row. Prints one line per
validation and what the guard did.

    python bench/overoptimisation.py [--steps 16] [--test-freq 2] [--patience 2] [--action stop]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from rlhf_core.batch import Batch
from rlhf_core.config import load_config
from rlhf_core.main_ppo import build_trainer
from rlhf_core.models.toy import ensure_toy_model
from rlhf_core.rewards.manager import RewardManager
from rlhf_core.rewards.reward_model import RewardModelManager
from rlhf_core.training.guards import GuardError, proxy_and_gold

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import REPO, prepare_data  # noqa: E402


class LengthPayingRewardModel:
    """The planted proxy: the number of response tokens, as a share of the response budget."""

    def __init__(self, budget: int):
        self.budget = budget

    def compute_rm_score(self, batch: Batch) -> torch.Tensor:
        return batch["response_mask"].sum(-1).float() / self.budget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="demo model directory (default: the cached demo build)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--test-freq", type=int, default=2)
    parser.add_argument("--patience", type=int, default=2)
    parser.add_argument("--action", default="rollback", choices=["rollback", "stop"])
    parser.add_argument("--n-val", type=int, default=200)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "overopt"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(2)
    out = Path(args.out)
    model = Path(args.model) if args.model else ensure_toy_model("demo")
    train, val, _ = prepare_data(out / "data", n_train=4000, n_val=args.n_val, n_report=0, seed=1)
    cfg = load_config([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={train}", f"data.val_files={val}",
        f"trainer.total_training_steps={args.steps}", f"trainer.test_freq={args.test_freq}", "trainer.logger=[]",
        f"trainer.default_local_dir={out / 'run'}", "trainer.resume_mode=disable", "trainer.val_before_train=true",
        "actor_rollout_ref.actor.use_kl_loss=false", f"trainer.guard.overopt_patience={args.patience}",
        f"trainer.guard.overopt_action={args.action}", "trainer.guard.max_val_drop=null", "trainer.seed=1",
        *args.overrides], config_file=REPO / "configs" / "ppo_demo_cpu.yaml")
    trainer = build_trainer(cfg)
    trainer.reward_manager = RewardModelManager(
        RewardManager(trainer.tokenizer), LengthPayingRewardModel(cfg.data.max_response_length), cfg.reward_model)
    rows = []

    def log(metrics: dict, step: int) -> None:
        proxy, gold = proxy_and_gold(metrics)
        if proxy is not None:
            rows.append({"step": step, "proxy": proxy, "gold": gold,
                         "rollbacks": metrics.get("training/rollbacks", 0)})
            print(f"step {step:3d}  proxy (length share) {proxy:.3f}  gold (rule) {gold:.3f}  "
                  f"rollbacks {rows[-1]['rollbacks']}", flush=True)
        elif "critic/score/mean" in metrics:
            print(f"step {step:3d}  train proxy {metrics['critic/score/mean']:.3f}  "
                  f"gold {metrics.get('critic/gold_reward/mean', float('nan')):.3f}", flush=True)

    trainer.logger = log
    started, stopped = time.perf_counter(), None
    try:
        trainer.fit()
    except GuardError as exc:
        stopped = str(exc)
    finally:
        trainer.close()
    result = {"validations": rows, "best_gold_step": trainer.overopt.best_step, "rollbacks": trainer.overopt.rollbacks,
              "stopped": stopped, "wall_seconds": time.perf_counter() - started, "steps": trainer.global_step}
    (out / "overoptimisation.json").write_text(json.dumps(result, indent=1))
    print(f"\nbest gold at step {result['best_gold_step']}; over-optimisation rollbacks {result['rollbacks']}"
          + (f"; stopped: {stopped}" if stopped else "") + f"; {result['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
