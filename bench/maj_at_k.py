"""The CPU time of validation's metrics at many samples a prompt: ``stats.validation_metrics`` over GSM8K's test
set's size (1319 problems) at ``val_kwargs.n`` responses each, with and without the graded answers that ``maj@k``
votes on; the difference is the vote's share.

The answers are drawn, a quarter of the problems each: a strong model's (the right answer 40-95% of responses, the
rest among six wrong ones, 3% none), a spread of up to 40 wrong answers (30% right, 10% none), half right with three
wrong answers, and a Dirichlet mix of 1-11 answers with up to 20% unanswered. CPU seconds of this process
(``time.process_time``), the best of ``--reps``.

    python bench/maj_at_k.py [--prompts 1319] [--n 64] [--reps 3] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from rlhf_core.stats import validation_metrics


def drawn_answers(prompts: int, n: int, seed: int) -> tuple[list[str | None], list[int]]:
    """``n`` answers to each of ``prompts`` problems ("R" the right one, None unanswered) and their problems' ids."""
    rng = np.random.default_rng(seed)
    answers, ids = [], []
    for prompt in range(prompts):
        draws, kind = rng.random(n), prompt % 4
        if kind == 0:
            share, wrong = rng.uniform(0.4, 0.95), rng.integers(1, 7, size=n)
            row = ["R" if r < share else None if r > 0.97 else str(w) for r, w in zip(draws, wrong)]
        elif kind == 1:
            wrong = rng.integers(1, 41, size=n)
            row = ["R" if r < 0.3 else None if r > 0.9 else str(w) for r, w in zip(draws, wrong)]
        elif kind == 2:
            wrong = rng.integers(1, 4, size=n)
            row = ["R" if r < 0.5 else str(w) for r, w in zip(draws, wrong)]
        else:
            distinct = int(rng.integers(1, 12))
            picks = rng.choice(distinct, size=n, p=rng.dirichlet(np.full(distinct, 0.5)))
            unanswered = rng.uniform(0, 0.2)
            row = [None if r < unanswered else "R" if a == 0 else str(a) for r, a in zip(draws, picks)]
        answers += row
        ids += [prompt] * n
    return answers, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=1319)
    parser.add_argument("--n", type=int, default=64, help="responses a problem (val_kwargs.n)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    answers, ids = drawn_answers(args.prompts, args.n, args.seed)
    acc = [float(answer == "R") for answer in answers]
    sources = ["openai/gsm8k"] * len(acc)

    def best(*given) -> tuple[float, dict[str, float]]:
        times = []
        for _ in range(args.reps):
            started = time.process_time()
            metrics = validation_metrics(sources, ids, acc, acc, *given)
            times.append(time.process_time() - started)
        return min(times), metrics

    plain, _ = best()
    voted, metrics = best(answers)
    print(f"{args.prompts} problems x {args.n} responses: validation_metrics {plain:.2f} s of CPU without the "
          f"answers, {voted:.2f} s with them: maj@k {voted - plain:.2f} s")
    print("maj@k means:", {key.split("/")[-2]: round(value, 4) for key, value in sorted(metrics.items())
                           if "maj@" in key and key.endswith("/mean")})


if __name__ == "__main__":
    main()
