"""Packed rows against padded ones in the update's forward and backward (``use_remove_padding`` on the CPU).

    make real-model && GSM8K_DIR=/path/to/gsm8k python bench/packing.py

A batch as the rollout lays it out (prompts left-padded, responses right-padded) from real text: the first
``--prompts`` GSM8K test questions in SmolLM2's chat template, each answered ``--group`` times by the real model
solutions of the release's ``example_model_solutions.jsonl`` (its four solvers in turn, so answers differ in
length), cut at ``--max-response`` tokens. The actor's forward and backward (log-probs and entropy of the
response tokens, as the update takes them) and the critic's (values) run over it in micro-batches of ``--micro``
rows, made as the workers make them (rows sorted by length, all-padding columns cut), in each layout: rows
padded, rows packed (:mod:`rlhf_core.models.packed_attention`) and, with ``--group`` above 1, each prompt once
for its group (``use_shared_prefix``), alternating in one process, ``--rounds`` times; medians.

Printed: positions computed (padded) against tokens, seconds, packed over padded, and each pass's products as a
fraction of the float32 matmul rate measured in the same process at the micro-batch's shape (6 x parameters x
tokens, as ``roofline.py`` counts them: real tokens only, so computed padding counts against the fraction).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import SMOLLM2, matmul_params, measured_rates, require_model_dir  # bench/roofline.py

from rlhf_core.batch import Batch
from rlhf_core.models import packed_attention
from rlhf_core.models.fused_head import supports_fused_head
from rlhf_core.models.loading import load_actor, load_critic, load_tokenizer
from rlhf_core.workers.actor import response_log_prob
from rlhf_core.workers.common import kept_columns, micro_batch_rows
from rlhf_core.workers.critic import response_values

REPO = Path(__file__).resolve().parents[1]
SOLVERS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")


def gsm8k_batch(tokenizer, gsm8k: Path, n_prompts: int, group: int, max_response: int) -> Batch:
    """``n_prompts`` real questions, each with ``group`` real model answers (a row each, a question's rows
    together), laid out as the rollout lays them out."""
    with open(gsm8k / "example_model_solutions.jsonl") as f:
        records = [json.loads(line) for _, line in zip(range(n_prompts), f)]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True,
                                             tokenize=False) for r in records]
    prompt_ids = [ids for p in prompts for ids in [tokenizer(p, add_special_tokens=False)["input_ids"]] * group]
    answers = [r[SOLVERS[(i + j) % len(SOLVERS)]]["solution"] for i, r in enumerate(records) for j in range(group)]
    response_ids = [(tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])[:max_response]
                    for a in answers]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    p_len, r_len = max(map(len, prompt_ids)), max(map(len, response_ids))
    prompts_t = torch.tensor([[pad] * (p_len - len(p)) + p for p in prompt_ids])
    responses_t = torch.tensor([r + [pad] * (r_len - len(r)) for r in response_ids])
    prompt_mask = torch.tensor([[0] * (p_len - len(p)) + [1] * len(p) for p in prompt_ids])
    response_mask = torch.tensor([[1] * len(r) + [0] * (r_len - len(r)) for r in response_ids])
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return Batch({"prompts": prompts_t, "responses": responses_t, "response_mask": response_mask,
                  "input_ids": torch.cat([prompts_t, responses_t], 1), "attention_mask": attention_mask,
                  "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0)})


def positions(batch: Batch, groups: list[list[int]]) -> int:
    """Positions a padded pass computes: each micro-batch's rows x the columns its forward keeps."""
    prompt_len = batch["prompts"].shape[1]
    return sum(len(rows) * (prompt_len - first + kept) for rows in groups
               for first, kept in [kept_columns(batch.select(rows))])


LAYOUTS = {"padded": {}, "packed": {"remove_padding": True}, "shared": {"shared_prefix": True}}


def actor_pass(model, batch: Batch, groups, layout: str) -> torch.Tensor:
    for rows in groups:
        log_prob, entropy = response_log_prob(model, batch.select(rows), temperature=1.0, with_entropy=True,
                                              fused_head=supports_fused_head(model), **LAYOUTS[layout])
        (log_prob.sum() + 0.01 * entropy.sum()).backward()
    return log_prob.detach()


def critic_pass(model, batch: Batch, groups, layout: str) -> torch.Tensor:
    for rows in groups:
        values = response_values(model, batch.select(rows), **LAYOUTS[layout])
        values.square().sum().backward()
    return values.detach()


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--gsm8k", default=os.environ.get("GSM8K_DIR", str(REPO.parent / "shared" / "data" / "gsm8k")))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=1, help="answers a question (up to 4 differ; >1 adds the shared "
                                                              "prefix's layout)")
    parser.add_argument("--micro", type=int, default=16, help="rows per micro-batch (sorted by length, as the workers)")
    parser.add_argument("--max-response", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model_dir = require_model_dir(parser, args.model)
    if not (Path(args.gsm8k) / "example_model_solutions.jsonl").is_file():
        parser.error(f"no example_model_solutions.jsonl under {args.gsm8k}: set GSM8K_DIR or --gsm8k")
    torch.set_num_threads(args.threads)

    tokenizer = load_tokenizer(model_dir)
    batch = gsm8k_batch(tokenizer, Path(args.gsm8k), args.prompts, args.group, args.max_response)
    layouts = ["padded", "packed"] + (["shared"] if args.group > 1 else [])
    groups = {layout: micro_batch_rows(batch, args.micro, use_dynamic_bsz=False, max_token_len=0,
                                       by_prompt=layout == "shared") for layout in layouts}
    tokens = int(batch["attention_mask"].sum())
    response_tokens = int(batch["response_mask"].sum())
    padded_positions = positions(batch, groups["padded"])
    padded = (load_actor(model_dir).train(), load_critic(model_dir).train())
    packed = (load_actor(model_dir, attn_implementation=packed_attention.NAME).train(),
              load_critic(model_dir, attn_implementation=packed_attention.NAME).train())
    packed[1].load_state_dict(padded[1].state_dict())  # the same value head
    models = {"padded": padded, "packed": packed, "shared": padded}

    lengths = batch["attention_mask"].sum(-1)
    print(f"{len(batch)} rows ({args.prompts} questions x {args.group}), micro-batches of {args.micro}: sequences "
          f"{int(lengths.min())}-{int(lengths.max())} tokens; {tokens} tokens ({response_tokens} in responses), "
          f"{padded_positions} positions padded ({1 - tokens / padded_positions:.1%} of them padding)")
    check = {layout: actor_pass(models[layout][0], batch, [list(range(len(batch)))], layout) for layout in layouts}
    for layout in layouts[1:]:
        print(f"log-probs, {layout} against padded: max difference "
              f"{float((check[layout] - check['padded']).abs().max()):.2e}")

    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for layout in layouts:
            actor, critic = models[layout]
            for name, model, fn in (("actor", actor, actor_pass), ("critic", critic, critic_pass)):
                model.zero_grad(set_to_none=True)
                times.setdefault((name, layout), []).append(timed(fn, model, batch, groups[layout], layout))

    micro_tokens = int(tokens / len(groups["padded"]))
    config = padded[0].config
    rates, _ = measured_rates(micro_tokens, config.hidden_size, config.intermediate_size, "float32")
    print(f"float32 matmul rate at ({micro_tokens} x {config.hidden_size}) @ ({config.hidden_size} x "
          f"{config.intermediate_size}): {rates.body:.1f} GFLOP/s\n")
    print(f"{'pass':<8}{'layout':<8}{'s':>8}{'x padded':>10}{'frac':>7}")
    for name, index in (("actor", 0), ("critic", 1)):
        body, head = matmul_params(padded[index])
        seconds_at_rate = 6 * (body * tokens / rates.body + head * response_tokens / rates.head) / 1e9
        medians = {layout: statistics.median(times[(name, layout)]) for layout in layouts}
        for layout, seconds in medians.items():
            print(f"{name:<8}{layout:<8}{seconds:>8.2f}{seconds / medians['padded']:>10.2f}"
                  f"{seconds_at_rate / seconds:>7.2f}")
    print("frac: the whole rows' products (6 x matmul parameters x real tokens, the LM head on response tokens) at "
          "the measured rate, over the pass's seconds (1.00 = at the limit); the shared prefix computes each prompt "
          "once, so its fraction counts work it does not do")


if __name__ == "__main__":
    main()
