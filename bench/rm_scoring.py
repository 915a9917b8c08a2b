"""A learned reward model scoring a PPO batch: every row whole against each prompt run once.

The reward model is SmolLM2-135M-Instruct with a random one-label head (the scores' values do not
matter here, only the work and that both paths agree). The batch is real: GSM8K test questions in
SmolLM2's chat template, each with the four model solutions of the GSM8K release as its responses
(``rollout.n = 4``), cut to ``--response`` tokens and ended with EOS, laid out as the rollout lays
them out. Both paths score the same batch, alternating in one process (this machine's speed drifts
between processes); prints the median seconds of each, the ratio, and the largest difference
between their scores.

    python bench/rm_scoring.py [--prompts 16] [--response 64] [--micro 16] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from roofline import REPO, SMOLLM2, require_model_dir  # bench/roofline.py, beside this script

from rlhf_core.batch import Batch
from rlhf_core.config import load_config
from rlhf_core.data.dataset import left_pad
from rlhf_core.rewards.reward_model import RewardModelWorker

SOLVERS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")


def reward_model_from(model: Path, folder: Path) -> Path:
    """``model`` (a causal LM directory) as a one-label sequence-classification model, head drawn at random."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    config = AutoConfig.from_pretrained(model, num_labels=1)
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(model, config=config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def gsm8k_batch(tokenizer, solutions_file: Path, prompts: int, response: int) -> Batch:
    """``prompts`` GSM8K questions x their four model solutions, as a rollout batch."""
    with open(solutions_file) as handle:
        rows = [json.loads(line) for _, line in zip(range(prompts), handle)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompt_ids, response_ids = [], []
    for row in rows:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        for solver in SOLVERS:
            prompt_ids.append(list(ids))
            answer = tokenizer(row[solver]["solution"], add_special_tokens=False)["input_ids"][:response - 1]
            response_ids.append(answer + [tokenizer.eos_token_id])
    left = left_pad(prompt_ids, pad)
    width = max(len(r) for r in response_ids)
    responses = torch.full((len(response_ids), width), pad)
    mask = torch.zeros((len(response_ids), width), dtype=torch.long)
    for i, ids in enumerate(response_ids):
        responses[i, :len(ids)] = torch.tensor(ids)
        mask[i, :len(ids)] = 1
    positions = left["position_ids"][:, -1:] + torch.arange(1, width + 1)
    return Batch({"prompts": left["input_ids"], "responses": responses, "response_mask": mask,
                  "input_ids": torch.cat([left["input_ids"], responses], 1),
                  "attention_mask": torch.cat([left["attention_mask"], mask], 1),
                  "position_ids": torch.cat([left["position_ids"], positions], 1)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(SMOLLM2), help="causal LM directory the reward model is made from")
    parser.add_argument("--gsm8k", default=os.environ.get("GSM8K_DIR", str(REPO.parent / "shared" / "data" / "gsm8k")))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--response", type=int, default=64, help="longest response in tokens (EOS included)")
    parser.add_argument("--micro", type=int, default=16, help="reward_model.micro_batch_size_per_gpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = require_model_dir(parser, args.model)
    solutions = Path(args.gsm8k) / "example_model_solutions.jsonl"
    if not solutions.is_file():
        parser.error(f"no {solutions}: point --gsm8k (or GSM8K_DIR) at the GSM8K release")
    torch.set_num_threads(args.threads)
    folder = reward_model_from(model, Path(tempfile.mkdtemp(prefix="rm_scoring_")) / "rm")
    workers = {}
    for shared in (False, True):
        cfg = load_config([f"reward_model.model.path={folder}", f"reward_model.model.input_tokenizer={folder}",
                           "reward_model.enable=true", f"reward_model.model.use_shared_prefix={str(shared).lower()}",
                           f"reward_model.micro_batch_size_per_gpu={args.micro}"], validate=False).reward_model
        workers["shared" if shared else "whole"] = RewardModelWorker(cfg)
    shutil.rmtree(folder.parent, ignore_errors=True)  # loaded: the reward model's copy (some 500 MB) may go
    batch = gsm8k_batch(workers["whole"].tokenizer, solutions, args.prompts, args.response)
    prompt_tokens = int(batch["attention_mask"][:, :batch["prompts"].shape[1]].sum()) // len(SOLVERS)
    response_tokens = int(batch["response_mask"].sum())
    times: dict[str, list[float]] = {name: [] for name in workers}
    scores = {}
    for name, worker in workers.items():  # warm-up
        scores[name] = worker.compute_rm_score(batch)
    for _ in range(args.reps):
        for name, worker in workers.items():
            start = time.perf_counter()
            worker.compute_rm_score(batch)
            times[name].append(time.perf_counter() - start)
    whole, shared = statistics.median(times["whole"]), statistics.median(times["shared"])
    print(f"{model.name} as a reward model, {args.prompts} GSM8K prompts x {len(SOLVERS)} real solutions "
          f"(<= {args.response} tokens), micro-batch {args.micro}, {args.threads} threads")
    print(f"tokens: {prompt_tokens} distinct prompt tokens (mean {prompt_tokens / args.prompts:.0f}), "
          f"{response_tokens} response tokens")
    for name, values in times.items():
        print(f"{name:<6} rows: median {statistics.median(values):.2f} s  (reps: "
              + ", ".join(f"{v:.2f}" for v in values) + ")")
    print(f"shared/whole: {shared / whole:.2f}; largest score difference "
          f"{float((scores['shared'] - scores['whole']).abs().max()):.2e} "
          f"(scores spread {float(scores['whole'].std()):.3f})")


if __name__ == "__main__":
    main()
