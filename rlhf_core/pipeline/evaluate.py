"""How good is a policy, and is the reward that says so the one we think it is.

* :func:`evaluate_policy`: greedy accuracy of a local HF model directory on a validation set,
  generated with the project's HF rollout engine and scored by the :class:`RewardManager`, as
  training scores it; a few right and wrong responses are kept as examples.
* :func:`reward_spec` and :func:`check_reference_solutions`: the identity of the reward (which
  function, its parameters, a SHA-256 of its source) and the self-check that every reference
  solution in the validation data earns full marks against its own ground truth.
* :func:`training_curves_png` and :func:`evaluation_html`: the figures and the HTML report.

    python -m rlhf_core.pipeline.evaluate MODEL_DIR VAL.parquet [--max-response-length 64] [--html out.html]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import html
import inspect
import io
import json
import math
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from rlhf_core.config import DataConfig, PPOConfig
from rlhf_core.data.dataset import as_file_list
from rlhf_core.rewards import RewardFn, get_reward_fn, load_custom_reward_fn

EXAMPLES_PER_KIND = 3


# ----------------------------------------------------------------------------- where the policy is


def resolve_policy_dir(path: str | Path) -> Path:
    """The HF model directory inside ``path``.

    ``path`` may be a HF model directory itself, a ``global_step_N`` checkpoint, or a checkpoint
    root holding ``latest_checkpointed_iteration.txt`` (the actor's ``huggingface/`` export of the
    latest step is used).
    """
    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        return folder
    if (folder / "latest_checkpointed_iteration.txt").is_file():
        from rlhf_core.training.checkpoint import latest_checkpoint

        latest = latest_checkpoint(folder)
        if latest is not None:
            return resolve_policy_dir(latest)
    for candidate in (folder / "actor" / "huggingface", folder / "huggingface"):
        if (candidate / "config.json").is_file():
            return candidate
    raise FileNotFoundError(
        f"{folder} holds no HF model: expected config.json there, in actor/huggingface/ (a global_step_N "
        "checkpoint) or under the step named by latest_checkpointed_iteration.txt (a checkpoint root)")


# ----------------------------------------------------------------------------- policy accuracy


@dataclass
class EvalResult:
    """Greedy accuracy of one model on one validation set."""

    model: str
    accuracy: float
    n: int
    mean_score: float
    per_source: dict[str, float]
    mean_response_length: float
    examples: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvalResult:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def _pick_examples(rows: list[dict[str, Any]], per_kind: int) -> list[dict[str, Any]]:
    right = [row for row in rows if row["correct"]][:per_kind]
    wrong = [row for row in rows if not row["correct"]][:per_kind]
    return right + wrong


@torch.no_grad()
def evaluate_policy(
    model_dir: str | Path,
    val_files: str | Sequence[str],
    data_config: DataConfig | None = None,
    max_new_tokens: int | None = None,
    batch_size: int = 64,
    reward_fn: RewardFn | None = None,
    tokenizer_path: str | Path | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    examples_per_kind: int = EXAMPLES_PER_KIND,
) -> EvalResult:
    """Greedy (one response per prompt) accuracy of the model in ``model_dir`` on ``val_files``.

    ``data_config`` gives the prompt settings (key, length limit, truncation) and, when
    ``max_new_tokens`` is None, the response length; ``reward_fn`` replaces the built-in reward
    by data source, as ``custom_reward_function`` does in training.
    """
    from rlhf_core.data.dataset import RLHFDataset
    from rlhf_core.models.loading import load_actor, load_tokenizer
    from rlhf_core.rewards.manager import RewardManager
    from rlhf_core.rollout import SamplingParams, make_rollout_engine

    data_config = data_config or DataConfig()
    model_dir = resolve_policy_dir(model_dir)
    tokenizer = load_tokenizer(tokenizer_path or model_dir)
    dataset = RLHFDataset(val_files, tokenizer, data_config, key="data.val_files")
    module = load_actor(model_dir, dtype=dtype, device=device)
    engine = make_rollout_engine("hf", module, tokenizer, seed=0)
    params = SamplingParams(n=1, max_new_tokens=max_new_tokens or data_config.max_response_length, do_sample=False)
    manager = RewardManager(tokenizer, reward_fn)

    rows: list[dict[str, Any]] = []
    scores: list[float] = []
    lengths: list[float] = []
    for start in range(0, len(dataset), batch_size):
        indices = list(range(start, min(start + batch_size, len(dataset))))
        batch = engine.generate(dataset.collate(indices), params)
        _, extras = manager(batch["responses"], batch["response_mask"], batch.meta["data_source"],
                            batch.meta["ground_truth"], batch.meta["extra_info"])
        lengths += batch["response_mask"].sum(-1).float().tolist()
        for row, index in enumerate(indices):
            scores.append(float(extras["score"][row]))
            rows.append({
                "index": dataset.rows[index]["index"],
                "data_source": batch.meta["data_source"][row],
                "prompt": dataset.rows[index]["messages"][-1]["content"],
                "response": extras["responses"][row],
                "ground_truth": batch.meta["ground_truth"][row],
                "score": float(extras["score"][row]),
                "correct": bool(extras["acc"][row] > 0),
            })
    per_source: dict[str, list[bool]] = {}
    for row in rows:
        per_source.setdefault(row["data_source"], []).append(row["correct"])
    return EvalResult(
        model=str(model_dir),
        accuracy=float(np.mean([row["correct"] for row in rows])),
        n=len(rows),
        mean_score=float(np.mean(scores)),
        per_source={source: float(np.mean(values)) for source, values in sorted(per_source.items())},
        mean_response_length=float(np.mean(lengths)),
        examples=_pick_examples(rows, examples_per_kind),
    )


# ----------------------------------------------------------------------------- the reward under test


def _reward_callables(cfg: PPOConfig, data_sources: Sequence[str]) -> dict[str, RewardFn]:
    custom = cfg.custom_reward_function
    if custom.path:
        fn = load_custom_reward_fn(custom.path, custom.name)
        return {source: fn for source in data_sources}
    return {source: get_reward_fn(source) for source in data_sources}


def _source_closure(fn: Callable) -> str:
    """The function's source plus that of the modules and functions its body names (one level)."""
    parts = [inspect.getsource(fn)]
    code = getattr(fn, "__code__", None)
    scope = getattr(fn, "__globals__", {})
    for name in (code.co_names if code else ()):
        target = scope.get(name)
        if isinstance(target, types.ModuleType) or inspect.isfunction(target):
            try:
                parts.append(inspect.getsource(target))
            except (OSError, TypeError):  # built-in or C modules have no source
                continue
    return "\n".join(parts)


def _called_functions(fn: Callable) -> list[Callable]:
    """Functions the body reaches as ``module.name`` (``gsm8k.compute_score``) or by a global name."""
    code = getattr(fn, "__code__", None)
    scope = getattr(fn, "__globals__", {})
    names = code.co_names if code else ()
    found = []
    for position, name in enumerate(names):
        target = scope.get(name)
        if inspect.isfunction(target):
            found.append(target)
        elif isinstance(target, types.ModuleType) and position + 1 < len(names):
            attribute = getattr(target, names[position + 1], None)
            if inspect.isfunction(attribute):
                found.append(attribute)
    return found


def _identity(fn: Callable, custom_path: str | None) -> str:
    name = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
    if custom_path:
        return f"{Path(custom_path).expanduser().resolve()}:{name}"
    return f"{fn.__module__}.{name}"


def _parameters(fn: Callable) -> dict[str, Any]:
    defaults = {}
    for name, parameter in inspect.signature(fn).parameters.items():
        if parameter.default is not inspect.Parameter.empty and name != "extra_info":
            value = parameter.default
            defaults[name] = value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
    return defaults


def read_data_sources(files: str | Sequence[str], column: str = "data_source") -> list[str]:
    sources: set[str] = set()
    for path in as_file_list(files):
        sources.update(pd.read_parquet(path, columns=[column])[column].astype(str))
    return sorted(sources)


def reward_spec(cfg: PPOConfig, data_sources: Sequence[str] | None = None, full_score: float = 1.0) -> dict[str, Any]:
    """Which reward scores these data: one entry per data source, and one hash over all of them.

    Each entry names the function (``module.qualname``, or ``/abs/file.py:name`` for a custom
    one), its keyword defaults and the SHA-256 of its source (with the modules and functions its
    body calls into); ``sha256`` over the whole spec changes whenever any of that does.
    """
    if data_sources is None:
        data_sources = read_data_sources(cfg.data.val_files, cfg.data.reward_fn_key)
    custom = cfg.custom_reward_function
    functions = {}
    for source, fn in _reward_callables(cfg, data_sources).items():
        functions[source] = {
            "function": _identity(fn, custom.path),
            "parameters": _parameters(fn),
            "calls": {f"{f.__module__}.{f.__qualname__}": _parameters(f) for f in _called_functions(fn)},
            "source_sha256": hashlib.sha256(_source_closure(fn).encode()).hexdigest(),
        }
    spec = {
        "kind": "custom" if custom.path else "builtin",
        "custom_path": str(Path(custom.path).expanduser().resolve()) if custom.path else None,
        "custom_name": custom.name if custom.path else None,
        "full_score": float(full_score),
        "functions": functions,
    }
    spec["sha256"] = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
    return spec


def _full_marks(result: Any, full_score: float) -> bool:
    if isinstance(result, Mapping):
        if "acc" in result:
            return bool(result["acc"])
        result = result.get("score")
    return isinstance(result, (int, float)) and math.isfinite(result) and result >= full_score


@dataclass
class ReferenceCheck:
    """The reward's self-check against the reference solutions of a dataset."""

    checked: int
    mismatches: list[dict[str, Any]]

    @property
    def success(self) -> bool:
        return not self.mismatches

    def summary(self, limit: int = 10) -> str:
        if self.checked == 0:
            return "warning: no reference solutions (extra_info.answer) to check the reward against"
        if not self.mismatches:
            return f"reward self-check passed: all {self.checked} reference solutions earn full marks"
        lines = [f"reward self-check FAILED: {len(self.mismatches)} of {self.checked} reference solutions "
                 "do not earn full marks against their own ground truth:"]
        for item in self.mismatches[:limit]:
            lines.append(f"  {item['file']} row {item['row']} (data_source={item['data_source']}): ground truth "
                         f"{item['ground_truth']!r}, reward {item['result']}, solution ends {item['solution_end']!r}")
        if len(self.mismatches) > limit:
            lines.append(f"  ... and {len(self.mismatches) - limit} more")
        return "\n".join(lines)


def check_reference_solutions(cfg: PPOConfig, files: str | Sequence[str] | None = None,
                              full_score: float = 1.0) -> ReferenceCheck:
    """Score every ``extra_info.answer`` against its ``reward_model.ground_truth``; all must be full marks."""
    files = cfg.data.val_files if files is None else files
    key = cfg.data.reward_fn_key
    checked, mismatches = 0, []
    fns: dict[str, RewardFn] = {}
    for path in as_file_list(files):
        frame = pd.read_parquet(path)
        for row, record in enumerate(frame.to_dict("records")):
            extra = record.get("extra_info")
            extra = dict(extra) if isinstance(extra, Mapping) else {}
            solution = extra.get("answer")
            if not isinstance(solution, str):
                continue
            source = str(record[key])
            reward_model = record.get("reward_model")
            ground_truth = reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
            if source not in fns:
                fns.update(_reward_callables(cfg, [source]))
            try:
                result = fns[source](data_source=source, solution_str=solution, ground_truth=ground_truth,
                                     extra_info=extra)
            except Exception as exc:  # noqa: BLE001 - a crashing reward is a mismatch, reported with its row
                result = f"{type(exc).__name__}: {exc}"
            checked += 1
            if not _full_marks(result, full_score):
                mismatches.append({"file": str(path), "row": row, "index": extra.get("index", row),
                                   "data_source": source, "ground_truth": ground_truth,
                                   "result": result if isinstance(result, (int, float, str)) else repr(result),
                                   "solution_end": solution[-60:]})
    return ReferenceCheck(checked, mismatches)


# ----------------------------------------------------------------------------- figures and report


def _png(figure) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return buffer.getvalue()


def _series(history: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for record in history:
        value = record.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            steps.append(int(record.get("step", record.get("training/global_step", len(steps) + 1))))
            values.append(float(value))
    return steps, values


def training_curves_png(history: Sequence[Mapping[str, Any]]) -> bytes:
    """Reward, KL and validation accuracy against the training step, one panel each, as PNG bytes."""
    from matplotlib.figure import Figure

    keys = sorted({k for record in history for k in record})
    panels = [
        ("reward", ["critic/score/mean", "critic/rewards/mean"]),
        ("KL", [k for k in ("actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty") if k in keys]),
        ("validation accuracy", [k for k in keys if k.startswith("val-core/") and "/acc/" in k]),
    ]
    figure = Figure(figsize=(12, 3.4))
    for column, (title, names) in enumerate(panels):
        axes = figure.add_subplot(1, 3, column + 1)
        for name in names:
            steps, values = _series(history, name)
            if values:
                axes.plot(steps, values, marker="o" if len(values) < 30 else None, markersize=3, label=name)
        axes.set_title(title)
        axes.set_xlabel("training step")
        axes.grid(alpha=0.3)
        if axes.lines:
            axes.legend(fontsize=7)
        else:
            axes.text(0.5, 0.5, "not logged", ha="center", va="center", transform=axes.transAxes)
    figure.tight_layout()
    return _png(figure)


def accuracy_bar_png(results: Mapping[str, EvalResult]) -> bytes:
    """Accuracy per model (and per data source when there are several), as PNG bytes."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5, 3.2))
    axes = figure.add_subplot(1, 1, 1)
    names = list(results)
    values = [results[name].accuracy for name in names]
    bars = axes.bar(names, values, color=["#9aa5b1", "#2f80ed", "#27ae60"][: len(names)])
    for bar, value in zip(bars, values):
        axes.text(bar.get_x() + bar.get_width() / 2, value + 0.01, f"{value:.1%}", ha="center", fontsize=9)
    axes.set_ylim(0, max(1.0, max(values, default=0) + 0.1))
    axes.set_ylabel("greedy accuracy")
    axes.set_title(f"validation accuracy (n={next(iter(results.values())).n if results else 0})")
    figure.tight_layout()
    return _png(figure)


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}"/>'


def evaluation_html(results: Mapping[str, EvalResult], curves_png: bytes | None = None,
                    title: str = "Policy evaluation") -> str:
    """A self-contained HTML page: the accuracy figure, the curves, and right and wrong examples."""
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{r.accuracy:.2%}</td><td>{r.n}</td><td>{r.mean_score:.3f}</td>"
        f"<td>{r.mean_response_length:.1f}</td><td><code>{html.escape(r.model)}</code></td></tr>"
        for name, r in results.items())
    parts = [
        f"<html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;margin:1.5em} table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top} pre{white-space:pre-wrap;margin:0}"
        ".right{background:#eefbea}.wrong{background:#fdecea}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        "<table><tr><th>model</th><th>accuracy</th><th>prompts</th><th>mean reward</th>"
        f"<th>mean response tokens</th><th>path</th></tr>{rows}</table>",
        _img(accuracy_bar_png(results), "accuracy"),
    ]
    if curves_png:
        parts += ["<h2>Training curves</h2>", _img(curves_png, "training curves")]
    for name, result in results.items():
        parts.append(f"<h2>Examples: {html.escape(name)}</h2><table><tr><th></th><th>prompt</th>"
                     "<th>response</th><th>ground truth</th></tr>")
        for example in result.examples:
            kind = "right" if example["correct"] else "wrong"
            parts.append(f"<tr class='{kind}'><td>{kind}</td><td><pre>{html.escape(example['prompt'])}</pre></td>"
                         f"<td><pre>{html.escape(example['response'])}</pre></td>"
                         f"<td>{html.escape(str(example['ground_truth']))}</td></tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    return "".join(parts)


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_core.pipeline.evaluate",
                                     description="Greedy accuracy of a HF model directory on a validation parquet.")
    parser.add_argument("model", help="HF model directory, global_step_N checkpoint or checkpoint root")
    parser.add_argument("val_files", nargs="+", help="validation parquet file(s), verl schema")
    parser.add_argument("--max-prompt-length", type=int, default=1024)
    parser.add_argument("--max-response-length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--html", help="write the HTML report here")
    args = parser.parse_args(argv)
    data = DataConfig(max_prompt_length=args.max_prompt_length, max_response_length=args.max_response_length,
                      truncation="left")
    result = evaluate_policy(args.model, args.val_files, data, batch_size=args.batch_size)
    print(f"accuracy {result.accuracy:.2%} on {result.n} prompts ({result.model})")
    if args.html:
        Path(args.html).write_text(evaluation_html({"policy": result}))
        print(f"report: {args.html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

