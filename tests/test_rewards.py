"""GSM8K reward rule, reward registry, custom reward loading and the reward manager."""

from __future__ import annotations

import functools
import json
import math
import os
import string
import sys
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rlhf_core.data.schema import extract_final_answer
from rlhf_core.rewards import (
    REWARD_FNS,
    BatchRewardFn,
    UnknownDataSourceError,
    get_reward_fn,
    known_data_sources,
    load_custom_reward_fn,
)
from rlhf_core.rewards.gsm8k import SOLUTION_CLIP_CHARS, compute_score, extract_solution
from rlhf_core.rewards.manager import RewardManager

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


@pytest.fixture(scope="module")
def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus [PAD]=0, [EOS]=1, [UNK]=2; decoding concatenates."""
    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2}
    for char in sorted(set(string.printable)):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]"
    )


def _batch(tokenizer, texts: list[str], length: int = 40, eos: bool = False):
    """Right-padded ids and mask; ``eos`` appends [EOS] as the last valid token."""
    ids = torch.zeros((len(texts), length), dtype=torch.long)
    mask = torch.zeros((len(texts), length), dtype=torch.long)
    for row, text in enumerate(texts):
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"] + (
            [tokenizer.eos_token_id] if eos else []
        )
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[row, : len(tokens)] = 1
    return ids, mask


# --- extraction and scoring: hand cases ----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "method", "expected"),
    [
        ("so 48 + 24 = 72\n#### 72", "strict", "72"),
        ("#### 1,080", "strict", "1080"),  # thousands separators removed
        ("#### -47", "strict", "-47"),
        ("#### 0.5", "strict", "0.5"),
        ("#### 5\nwait, no\n#### 6", "strict", "6"),  # last match wins
        ("####72", "strict", None),  # the space after #### is required
        ("#### $18", "strict", None),  # the strict pattern has no room for a dollar sign
        ("#### .", "strict", None),  # a marker before no digits holds no answer: no format score, no maj@k vote
        ("#### ,", "strict", None),
        ("#### 3\n#### .", "strict", None),  # the last marker is the answer, and it holds none
        ("the answer is 72", "strict", None),
        ("", "strict", None),
        ("it costs $1,250 in total", "flexible", "1250"),
        ("first 3, then -4", "flexible", "-4"),
        ("12 apples .", "flexible", "12"),  # a lone '.' is not a number
        ("12 apples ...", "flexible", "..."),  # but only '' and '.' are passed over, as in verl
        ("#### 5 but really 7", "flexible", "7"),  # flexible ignores the marker
        ("no digits at all.", "flexible", None),
        ("The answer is 18.", "flexible", "18."),  # the period is part of the match, as in verl
    ],
)
def test_extract_solution(text, method, expected):
    assert extract_solution(text, method) == expected


def test_only_last_300_characters_count():
    filler = "x" * SOLUTION_CLIP_CHARS
    assert extract_solution("#### 42" + filler, "strict") is None
    assert extract_solution("7" + filler, "flexible") is None
    inside = "#### 42" + "x" * (SOLUTION_CLIP_CHARS - len("#### 42"))
    assert len(inside) == SOLUTION_CLIP_CHARS and extract_solution(inside, "strict") == "42"
    assert extract_solution("y" + inside, "strict") == "42"
    # A marker cut by the window is not seen (only " 42" and later remain).
    assert extract_solution("#### 42" + "x" * (SOLUTION_CLIP_CHARS - 3), "strict") is None
    assert compute_score("#### 42" + filler, "42") == 0.0


def test_compute_score_values():
    assert compute_score("#### 72", "72") == 1.0
    assert compute_score("#### 1,080", "1080") == 1.0
    assert compute_score("#### 71", "72") == 0.0
    assert compute_score("#### 71", "72", format_score=0.1) == 0.1  # well-formed but wrong
    assert compute_score("no answer", "72", format_score=0.1) == 0.0  # nothing found: always 0
    assert compute_score("#### 72", "72", score=2.0) == 2.0
    assert compute_score("72.0 is it", "72", method="flexible") == 0.0  # exact string match only
    assert compute_score("so it is 72", "72", method="flexible") == 1.0
    assert compute_score("so it is 72", "72") == 0.0  # strict needs the marker
    assert isinstance(compute_score("#### 72", "72"), float)


def test_a_ground_truth_is_cleaned_as_the_answer_is_and_a_stored_number_read_as_written():
    """A ground truth with thousands commas, or a numeric parquet column's float, is matched by the answer a
    correct response writes; a string with a fraction stays exact."""
    import numpy as np

    for answer, truth in [("#### 1000", "1,000"), ("#### 1,000", "1,000"), ("#### 18", 18.0), ("#### 18", 18),
                          ("#### 18", np.float64(18.0)), ("#### 18", np.int64(18)), ("#### 2.5", 2.5),
                          ("#### -3", -3.0), ("#### 70000", 70000.0), ("#### 12", "$12"),
                          # a float32 column: its 0.1 is 0.10000000149011612 as a double, the answer 0.1 as written
                          ("#### 0.1", np.float32(0.1)), ("#### 1.2", np.float32(1.2)),
                          ("#### 0.00001", 1e-05)]:  # never the exponent form repr gives ("1e-05")
        assert compute_score(answer, truth) == 1.0, (answer, truth)
    for answer, truth in [("#### 18", "18.0"), ("#### 18.0", 18.0), ("#### 2", 2.5), ("#### 1", True)]:
        assert compute_score(answer, truth) == 0.0, (answer, truth)


NOT_AS_WRITTEN = "is not a number as answers write them"


# (ground truth, why a right answer written as numbers are fails to match it, and that right answer)
@pytest.mark.parametrize("truth, reason, right", [
    ("18", None, "18"), ("1,000", None, "1000"), ("$12", None, "12"), ("-$12", None, "-12"), ("-3", None, "-3"),
    ("2.5", None, "2.5"), ("2.50", None, "2.50"), (18.0, None, "18"), (np.float32(0.1), None, "0.1"),
    (b"7", None, "7"), (Decimal("1.5"), None, "1.5"),
    (Decimal("18.0"), "'18.0' is an integer written with a fraction of zeros", "18"),  # a decimal128's scale
    ("18.0", "'18.0' is an integer written with a fraction of zeros: responses answering '#### 18' score 0", "18"),
    ("18.", "'18.' is an integer written with a fraction of zeros", "18"),
    (".5", f"'.5' {NOT_AS_WRITTEN}", "0.5"), ("12$", None, "12"),
    ("007", f"'007' {NOT_AS_WRITTEN}", "7"), ("1.2.3", f"'1.2.3' {NOT_AS_WRITTEN}", None), (float("nan"), f"'nan' {NOT_AS_WRITTEN}", None),
    ("four", f"'four' {NOT_AS_WRITTEN}", "4"), ("", f"'' {NOT_AS_WRITTEN}", None),
    ("12 apples", f"'12 apples' {NOT_AS_WRITTEN}", "12"),
    (["4"], "a list (['4']), not a number or the text of one", None), (True, "a bool (True), not a number", None),
    ({"answer": "4"}, "a dict ({'answer': '4'}), not a number", None),
])
def test_a_ground_truth_a_right_answer_cannot_match_says_why(truth, reason, right):
    from rlhf_core.rewards.gsm8k import unanswerable

    found = unanswerable(truth)
    assert found == reason if reason is None else found.startswith(reason), found
    if right is not None and not isinstance(truth, (list, dict, bool)):  # the right answer, as a response writes it
        assert compute_score(f"The answer is {right}.\n#### {right}", truth) == (1.0 if reason is None else 0.0), truth


def test_a_marker_without_digits_earns_no_format_score():
    assert compute_score("#### .", "18", format_score=0.1) == 0.0
    assert compute_score("#### ,", "", format_score=0.1) == 0.0  # not a match of an empty ground truth either


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match="unknown GSM8K extraction method 'loose'"):
        compute_score("#### 1", "1", method="loose")


# --- extraction: properties ---------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=600), method=st.sampled_from(["strict", "flexible"]))
def test_parser_never_raises(text, method):
    answer = extract_solution(text, method)
    assert answer is None or (answer not in ("", ".") and "," not in answer and "$" not in answer)
    assert compute_score(text, "1", method=method, format_score=0.25) in (0.0, 0.25, 1.0)


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.text(alphabet=string.ascii_letters + " \n+-=*/", max_size=200),
    value=st.integers(min_value=-(10**12), max_value=10**12),
)
def test_marked_integer_round_trips(prefix, value):
    text = f"{prefix}\n#### {value:,}"
    assert extract_solution(text, "strict") == str(value)
    assert compute_score(text, str(value)) == 1.0
    assert compute_score(text, str(value), method="flexible") == 1.0


# --- real data ----------------------------------------------------------------------------------


@pytest.mark.parametrize("split", ["train", "test"])
def test_reference_solutions_score_full(gsm8k_dir, split):
    rows = _read_jsonl(gsm8k_dir / f"{split}.jsonl")
    failures = [
        i
        for i, row in enumerate(rows)
        if compute_score(row["answer"], extract_final_answer(row["answer"])) != 1.0
    ]
    assert len(rows) == {"train": 7473, "test": 1319}[split]
    assert failures == []


def _model_solution_agreement(gsm8k_dir: Path, method: str) -> tuple[float, int, list]:
    """Share of (question, model) pairs where ``score == 1`` agrees with the ``is_correct`` label.

    Ground truth comes from test.jsonl (same questions, same order). Model solutions end with
    ``A: <answer>`` rather than ``#### <answer>``; for ``strict`` the final ``A:`` is rewritten as
    ``#### `` so the rule the trainer uses is tested as it is, for ``flexible`` the text is scored
    unchanged.
    """
    reference = _read_jsonl(gsm8k_dir / "test.jsonl")
    examples = _read_jsonl(gsm8k_dir / "example_model_solutions.jsonl")
    assert len(examples) == len(reference) == 1319
    agree, total, disagreements = 0, 0, []
    for row, (ref, example) in enumerate(zip(reference, examples)):
        assert example["question"] == ref["question"], f"row {row}: question differs from test.jsonl"
        truth = extract_final_answer(ref["answer"])
        for model in MODELS:
            solution, label = example[model]["solution"], example[model]["is_correct"]
            if method == "strict" and "A:" in solution:
                head, answer = solution.rsplit("A:", 1)
                solution = f"{head}#### {answer.strip()}"
            correct = compute_score(solution, truth, method=method) == 1.0
            total += 1
            agree += correct == label
            if correct != label:
                disagreements.append((row, model, truth, solution[-60:]))
    return agree / total, total, disagreements


@pytest.mark.parametrize("method", ["strict", "flexible"])
def test_agreement_with_model_solution_labels(gsm8k_dir, method):
    # The is_correct labels were produced by comparing each model's final answer with the reference
    # answer, so the rule must reproduce every one: a parser that kept commas, dropped a minus sign or
    # cut decimals disagrees on 2 to 11 of these solutions, so no disagreement at all is allowed.
    agreement, total, disagreements = _model_solution_agreement(gsm8k_dir, method)
    print(f"\n{method}: score agrees with is_correct on {agreement:.4f} of {total} model solutions")
    assert total == 4 * 1319
    assert disagreements == []


# --- registry -----------------------------------------------------------------------------------


def test_registry_lookups():
    assert known_data_sources() == sorted(REWARD_FNS)
    assert {"openai/gsm8k", "synthetic/arithmetic"} <= set(known_data_sources())
    for source in ("openai/gsm8k", "synthetic/arithmetic"):
        fn = get_reward_fn(source)
        assert fn(data_source=source, solution_str="#### 3", ground_truth="3", extra_info=None) == {
            "score": 1.0, "acc": 1.0, "pred": "3"}
        assert fn(source, "#### 4", "3", {}) == {"score": 0.0, "acc": 0.0, "pred": "4"}
        assert fn(source, "it is 3", "3", {}) == {"score": 0.0, "acc": 0.0, "pred": None}


def test_unknown_data_source_error():
    with pytest.raises(KeyError) as caught:
        get_reward_fn("lighteval/MATH")
    message = str(caught.value)
    assert "'lighteval/MATH'" in message and "openai/gsm8k" in message and "synthetic/arithmetic" in message
    assert "custom_reward_function.path" in message
    assert not message.startswith('"')  # plain text, not a quoted KeyError repr
    assert isinstance(caught.value, ValueError)


# --- custom reward functions --------------------------------------------------------------------


def test_load_custom_reward_fn(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str.strip() == ground_truth), 'length': len(solution_str)}\n"
    )
    fn = load_custom_reward_fn(path)
    assert fn("any", "5", "5", None) == {"score": 1.0, "length": 1}
    # each load runs the file afresh: module-level state starts anew (a seeded generator, a counter)
    path.write_text("import itertools\n_calls = itertools.count()\n"
                    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float(next(_calls))\n")
    first, second = load_custom_reward_fn(path), load_custom_reward_fn(path)
    assert [first("a", "", "", None), first("a", "", "", None), second("a", "", "", None)] == [0.0, 1.0, 0.0]


def test_a_reward_file_imports_the_modules_beside_it(tmp_path, monkeypatch):
    """``from helper import f`` in a reward file finds helper.py beside it, as a script's import does, though
    neither its folder nor the current directory is on the path (the rlhf-ppo entry point puts neither there)."""
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", ".", str(tmp_path))])
    folder = tmp_path / "rewards"
    folder.mkdir()
    (folder / "reward_helper_beside.py").write_text("def normalise(text):\n    return text.strip().lower()\n")
    (folder / "with_helper.py").write_text(
        "from reward_helper_beside import normalise\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(normalise(solution_str) == normalise(ground_truth))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "reward_helper_beside", raising=False)
    fn = load_custom_reward_fn("rewards/with_helper.py")
    assert (fn("any", " Yes", "yes", None), fn("any", "no", "yes", None)) == (1.0, 0.0)
    assert sys.path[-1] == str(folder.resolve())  # after every other entry: it hides no package of the same name
    sys.modules.pop("reward_helper_beside", None)


def _two_grading_folders(tmp_path, monkeypatch, helper: str, inside: bool) -> None:
    """``exact/`` and ``casefree/`` under ``tmp_path``, each a reward.py grading by a module ``helper`` of its own
    beside it (an exact match; one without case), imported at the file's top or, ``inside``, in its function."""
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, helper, raising=False)
    top, within = ("", f"    from {helper} import grade\n") if inside else (f"from {helper} import grade\n\n", "")
    for name, rule in (("exact", "answer == truth"), ("casefree", "answer.lower() == truth.lower()")):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{helper}.py").write_text(f"def grade(answer, truth):\n    return {rule}\n")
        (tmp_path / name / "reward.py").write_text(
            f"{top}def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n{within}"
            "    return float(grade(solution_str, ground_truth))\n")


def test_each_reward_file_imports_its_own_helper_anew(tmp_path, monkeypatch):
    """Two reward folders each with a helper.py of its own: each reward grades by its own helper, whichever loaded
    first; a helper edited between two loads is imported as it is now; the earlier folder leaves the path."""
    _two_grading_folders(tmp_path, monkeypatch, "reward_grading_helper", inside=False)
    exact = load_custom_reward_fn(tmp_path / "exact" / "reward.py")
    casefree = load_custom_reward_fn(tmp_path / "casefree" / "reward.py")
    assert (exact("s", "YES", "yes", None), casefree("s", "YES", "yes", None)) == (0.0, 1.0)
    assert str(tmp_path / "exact") not in sys.path and sys.path[-1] == str(tmp_path / "casefree")
    (tmp_path / "exact" / "reward_grading_helper.py").write_text("def grade(answer, truth):\n    return True\n")
    assert load_custom_reward_fn(tmp_path / "exact" / "reward.py")("s", "no", "yes", None) == 1.0
    assert exact("s", "YES", "yes", None) == 0.0  # a reward loaded before keeps the helper it imported
    # a folder that was on the path before (the project's, the current directory) stays on it, where it was
    sys.path.insert(0, str(tmp_path / "casefree"))
    load_custom_reward_fn(tmp_path / "casefree" / "reward.py")
    load_custom_reward_fn(tmp_path / "exact" / "reward.py")
    assert sys.path[0] == str(tmp_path / "casefree") and sys.path[-1] == str(tmp_path / "exact")
    sys.modules.pop("reward_grading_helper", None)


def test_a_helper_a_reward_imports_inside_its_function_is_its_own_folders(tmp_path, monkeypatch):
    """A helper imported when the function first runs, not as the file loads, stayed in sys.modules: the second
    folder's reward graded by the first folder's helper."""
    _two_grading_folders(tmp_path, monkeypatch, "reward_lazy_helper", inside=True)
    assert load_custom_reward_fn(tmp_path / "exact" / "reward.py")("s", "YES", "yes", None) == 0.0
    assert load_custom_reward_fn(tmp_path / "casefree" / "reward.py")("s", "YES", "yes", None) == 1.0
    sys.modules.pop("reward_lazy_helper", None)


def test_a_reward_file_rewritten_within_the_same_second_at_the_same_size_runs_as_it_is_now(tmp_path, monkeypatch):
    """The loader's bytecode cache trusts a .pyc whose source has the size and modification second it recorded:
    the file edited in that second (a pipeline's steps load it a moment apart) ran as it was."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # (as a user's Python runs: the tests' env sets it)
    path = tmp_path / "same_size_reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    stat = path.stat()
    assert load_custom_reward_fn(path)("s", "", "", None) == 1.0
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the same second and size as the first load saw
    assert path.stat().st_size == stat.st_size
    assert load_custom_reward_fn(path)("s", "", "", None) == 0.0


def test_an_async_reward_function_is_awaited(tmp_path, char_tokenizer):
    """verl awaits an ``async def compute_score``; here it was called and its coroutine refused as a result, at
    the first batch after the models loaded."""
    path = tmp_path / "async_reward.py"
    path.write_text(
        "import asyncio\n\n"
        "async def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    await asyncio.sleep(0)\n"
        "    return {'score': float(solution_str == ground_truth), 'length': len(solution_str)}\n\n"
        "async def batch(data_sources, solution_strs, ground_truths, extra_infos):\n"
        "    return [float(s == g) for s, g in zip(solution_strs, ground_truths)]\n")
    ids, mask = _batch(char_tokenizer, ["7", "42"])
    scores, extras = RewardManager(char_tokenizer, reward_fn=load_custom_reward_fn(path))(ids, mask, ["s"] * 2,
                                                                                         ["7", "41"])
    assert scores.sum(-1).tolist() == [1.0, 0.0] and list(extras["length"]) == [1.0, 2.0]
    batched = RewardManager(char_tokenizer, reward_fn=BatchRewardFn(load_custom_reward_fn(path, "batch")))
    scores, _ = batched(ids, mask, ["s"] * 2, ["7", "42"])
    assert scores.sum(-1).tolist() == [1.0, 1.0]


def test_a_package_an_environment_inside_the_rewards_folder_installed_is_imported_once(tmp_path, monkeypatch):
    """A reward in the project root, whose .venv is inside it: the packages the reward is the first to import live
    under its folder, yet are not beside it; imported anew at the next load, some fail (a registry that refuses a
    second registration), so they stay as imported."""
    site = tmp_path / ".venv" / "lib" / "site-packages"
    (site / "reward_env_package").mkdir(parents=True)
    (site / "reward_env_package" / "__init__.py").write_text("LOADS = []\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(site)])
    monkeypatch.delitem(sys.modules, "reward_env_package", raising=False)
    (tmp_path / "reward.py").write_text("import reward_env_package\n\n"
                                        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return 1.0\n")
    load_custom_reward_fn(tmp_path / "reward.py")
    first = sys.modules["reward_env_package"]
    load_custom_reward_fn(tmp_path / "reward.py")
    assert sys.modules["reward_env_package"] is first
    sys.modules.pop("reward_env_package", None)


def test_reward_kwargs_are_bound_and_checked(tmp_path):
    path = tmp_path / "scaled.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
                    "    return scale * float(solution_str.strip() == ground_truth)\n")
    assert load_custom_reward_fn(path, reward_kwargs={"scale": 0.25})("any", "5", "5", None) == 0.25
    assert load_custom_reward_fn(path)("any", "5", "5", None) == 1.0
    with pytest.raises(TypeError, match=r"reward_kwargs \{'scael': 2\} do not fit 'compute_score'"):
        load_custom_reward_fn(path, reward_kwargs={"scael": 2})


def test_a_reward_may_check_in_a_process_pool(tmp_path):
    """A reward that hands its own functions to a (forked) multiprocessing pool, as sandboxed checkers do:
    the pool's workers find them by module name, so the loaded file stays registered."""
    path = tmp_path / "pooled.py"
    path.write_text(
        "import multiprocessing\n\n"
        "def _check(pair):\n"
        "    return float(pair[0].strip() == pair[1])\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    with multiprocessing.get_context('fork').Pool(1) as pool:\n"
        "        return pool.map(_check, [(solution_str, ground_truth)])[0]\n")
    fn = load_custom_reward_fn(path)
    assert (fn("any", " 7", "7", None), fn("any", "8", "7", None)) == (1.0, 0.0)
    # loaded again (the reference check loads it once per data source), the first copy still works
    again = load_custom_reward_fn(path)
    assert (fn("any", " 7", "7", None), again("any", "7", "7", None)) == (1.0, 1.0)


def test_custom_fn_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.py.*custom_reward_function\.path"):
        load_custom_reward_fn(tmp_path / "nope.py", "compute_score")
    with pytest.raises(FileNotFoundError, match="it is a folder"):
        load_custom_reward_fn(tmp_path, "compute_score")


def test_custom_fn_missing_function_lists_defined_ones(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(
        "import math\n"
        "def reward_a(data_source, solution_str, ground_truth, extra_info):\n    return 1.0\n"
        "def reward_b(data_source, solution_str, ground_truth, extra_info):\n    return 0.0\n"
        "def _helper():\n    pass\n"
    )
    with pytest.raises(AttributeError) as caught:
        load_custom_reward_fn(path, "compute_score")
    message = str(caught.value)
    assert "no function 'compute_score'" in message and "reward_a, reward_b" in message
    assert "_helper" not in message and "sqrt" not in message
    assert "custom_reward_function.name" in message


def test_custom_fn_not_callable_and_broken_file(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text("compute_score = 3\n")
    with pytest.raises(TypeError, match="is a int, not a function"):
        load_custom_reward_fn(path, "compute_score")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('cannot import this')\n")
    with pytest.raises(ImportError, match="broken.py.*cannot import this"):
        load_custom_reward_fn(broken, "compute_score")


def test_a_custom_fn_that_cannot_take_the_managers_arguments_is_refused_before_training(tmp_path):
    """fn(solution_str, ground_truth) failed with "unexpected keyword argument 'data_source'" at the first batch,
    after the models had loaded and generated; a per-response function under the batch manager likewise."""
    from rlhf_core.config import load_config
    from rlhf_core.rewards import custom_reward_fn

    path = tmp_path / "rewards.py"
    path.write_text("def two_args(solution_str, ground_truth):\n    return 0.0\n\n"
                    "def per_response(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n\n"
                    "def flexible(**kwargs):\n    return 0.0\n")

    def loaded(name, *extra):
        return custom_reward_fn(load_config([f"custom_reward_function.path={path}",
                                             f"custom_reward_function.name={name}", *extra], validate=False))

    with pytest.raises(TypeError, match=r"'two_args' in .* cannot be called as the reward manager calls it for each "
                                        r"response, fn\(data_source=\.\.\., solution_str=.*unexpected keyword"):
        loaded("two_args")
    assert loaded("per_response") is not None and loaded("flexible") is not None
    with pytest.raises(TypeError, match=r"for reward_model.reward_manager=batch, fn\(data_sources=\.\.\."):
        loaded("per_response", "reward_model.reward_manager=batch")


def test_custom_fn_wrong_return_type_is_caught_by_manager(tmp_path, char_tokenizer):
    path = tmp_path / "rewards.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return 'correct' if solution_str == ground_truth else 0.0\n"
    )
    manager = RewardManager(char_tokenizer, reward_fn=load_custom_reward_fn(path))
    ids, mask = _batch(char_tokenizer, ["1", "2"])
    with pytest.raises(TypeError, match=r"returned str .*sample 1 \(data_source='mine'\)"):
        manager(ids, mask, ["mine", "mine"], ["9", "2"])


def test_dict_without_score_is_rejected(char_tokenizer):
    manager = RewardManager(char_tokenizer, reward_fn=lambda **_: {"acc": 1.0})
    ids, mask = _batch(char_tokenizer, ["1"])
    with pytest.raises(TypeError, match=r"a dict with no 'score' \(keys \['acc'\]\) for sample 0"):
        manager(ids, mask, ["x"], ["1"])


def test_a_score_held_in_a_tensor_is_read_as_its_number(char_tokenizer):
    """A reward computed with torch or numpy returns ``torch.tensor(0.5)`` or a 0-d array (a batch function a
    tensor of scores, one 0-d tensor a response), which verl's managers write into the reward tensor as a float:
    it stopped the run at the first batch. A tensor of several numbers is no score."""
    def reward(solution_str, **_):
        value = float(solution_str)
        return {"score": torch.tensor(value / 4), "acc": torch.tensor(value == 2.0), "half": np.array(value / 2)}

    ids, mask = _batch(char_tokenizer, ["2", "3"])
    scores, extras = RewardManager(char_tokenizer, reward_fn=reward)(ids, mask, ["s"] * 2, [""] * 2)
    assert scores[:, 0].tolist() == [0.5, 0.75]
    assert extras["acc"].tolist() == [1.0, 0.0] and extras["half"].tolist() == [1.0, 1.5]
    bare = RewardManager(char_tokenizer, reward_fn=lambda solution_str, **_: torch.tensor(float(solution_str)))
    assert bare(ids, mask, ["s"] * 2, [""] * 2)[1]["score"].tolist() == [2.0, 3.0]
    batched = BatchRewardFn(lambda solution_strs, **_: torch.tensor([float(s) == 3.0 for s in solution_strs]))
    _, extras = RewardManager(char_tokenizer, reward_fn=batched)(ids, mask, ["s"] * 2, [""] * 2)
    assert extras["score"].tolist() == [0.0, 1.0] and extras["acc"].tolist() == [0.0, 1.0]
    several = RewardManager(char_tokenizer, reward_fn=lambda **_: {"score": torch.tensor([1.0, 0.0])})
    with pytest.raises(TypeError, match=r"a dict with a 'score' of Tensor \(tensor\(\[1\., 0\.\]\)\) for sample 0"):
        several(ids, mask, ["s"] * 2, [""] * 2)


# --- reward manager -----------------------------------------------------------------------------


def test_score_on_last_valid_token(char_tokenizer):
    texts = ["so #### 12", "#### 7", "", "answer 5"]
    ids, mask = _batch(char_tokenizer, texts, eos=True)
    mask[2] = 0  # a response with no valid token at all
    ids[2] = char_tokenizer.pad_token_id
    manager = RewardManager(char_tokenizer)
    scores, extras = manager(
        ids,
        mask,
        ["openai/gsm8k", "synthetic/arithmetic", "openai/gsm8k", "openai/gsm8k"],
        ["12", "8", "1", "5"],
    )
    assert scores.dtype == torch.float32 and scores.shape == ids.shape
    assert extras["responses"] == texts  # [EOS] dropped by skip_special_tokens
    last = [len(text) for text in texts]  # index of [EOS], the last valid token
    assert scores[0, last[0]] == 1.0 and scores[0].sum() == 1.0
    assert scores[1].abs().sum() == 0.0  # wrong answer scores 0
    assert scores[3].abs().sum() == 0.0  # strict rule: no #### marker
    assert extras["score"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert extras["acc"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert extras["score"].dtype == torch.float32
    # the empty response's GSM8K score is 0, which would hide where it landed: a rule scoring "" as -1 shows
    # that a response with no valid token is still scored and reported, but its row has no place for the score
    marked = RewardManager(char_tokenizer, reward_fn=lambda solution_str, **_: -1.0 if solution_str == "" else 1.0)
    scores, extras = marked(ids, mask, ["s"] * 4, [""] * 4)
    assert extras["score"].tolist() == [1.0, 1.0, -1.0, 1.0]
    expected = torch.zeros(ids.shape)
    for row in (0, 1, 3):
        expected[row, last[row]] = 1.0
    torch.testing.assert_close(scores, expected)


def test_a_batch_reward_function_scores_the_batch_in_one_call(char_tokenizer):
    calls = []

    def batch_reward(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
        calls.append((list(data_sources), list(solution_strs), list(ground_truths), list(extra_infos)))
        return [{"score": float(s.endswith(g)) + bonus, "pred": s[-1:]} if i % 2 else float(s.endswith(g))
                for i, (s, g) in enumerate(zip(solution_strs, ground_truths))]

    texts = ["#### 12", "#### 7", "x 3"]
    ids, mask = _batch(char_tokenizer, texts, eos=True)
    manager = RewardManager(char_tokenizer, BatchRewardFn(functools.partial(batch_reward, bonus=0.5)))
    scores, extras = manager(ids, mask, ["a", "b", "c"], ["12", "8", "3"], [{"i": 0}, None, {"i": 2}])
    assert calls == [(["a", "b", "c"], texts, ["12", "8", "3"], [{"i": 0}, None, {"i": 2}])]  # once, whole lists
    # rows 0 and 2 return numbers (1 and 1), row 1 a dict (0 + bonus 0.5), each on its last valid token
    assert extras["score"].tolist() == [1.0, 0.5, 1.0] and extras["acc"].tolist() == [1.0, 0.0, 1.0]
    assert scores[1, len(texts[1])] == 0.5 and scores.sum() == 2.5
    assert extras["pred"] == [None, "7", None]
    # called as a function of one response (the reward's reference check), a batch of one
    assert BatchRewardFn(batch_reward)("a", "#### 12", "12", None) == 1.0
    short = RewardManager(char_tokenizer, BatchRewardFn(lambda **kw: [1.0]))
    with pytest.raises(TypeError, match="returned 1 scores for 3 responses"):
        short(ids, mask, ["a", "b", "c"], ["12", "8", "3"])


def test_custom_fn_overrides_registry_and_reports_extra_keys(char_tokenizer):
    def reward(data_source, solution_str, ground_truth, extra_info):
        if extra_info and extra_info.get("plain"):
            return 0.5
        return {"score": 0.5, "acc": True, "length": len(solution_str), "note": "text is ignored"}

    ids, mask = _batch(char_tokenizer, ["abc", "de"])
    scores, extras = RewardManager(char_tokenizer, reward_fn=reward, full_score=0.5)(
        ids, mask, ["unregistered/source", "also/unknown"], ["", ""], [{}, {"plain": True}]
    )
    assert scores[0, 2] == 0.5 and scores[1, 1] == 0.5
    assert extras["acc"].tolist() == [1.0, 1.0]  # dict 'acc'; number >= full_score
    assert extras["length"][0] == 3.0 and math.isnan(extras["length"][1])
    assert "note" not in extras


def test_numpy_values_in_a_dict_are_read_and_a_non_numeric_acc_is_refused(char_tokenizer):
    """``np.isclose`` returns numpy's bool, which is not a ``numbers.Real``: its 'acc' (and extras) went unread,
    and the accuracy fell back to score >= full score (0.8 < 1: every answer counted wrong)."""
    def reward(solution_str, **_):
        right = np.isclose(float(solution_str), 2.0)
        return {"score": 0.8 * right, "acc": right, "close": right, "gap": np.float32(abs(float(solution_str) - 2))}

    ids, mask = _batch(char_tokenizer, ["2", "3"])
    _, extras = RewardManager(char_tokenizer, reward_fn=reward)(ids, mask, ["s"] * 2, [""] * 2)
    assert extras["score"].tolist() == [pytest.approx(0.8), 0.0]
    assert extras["acc"].tolist() == [1.0, 0.0]
    assert extras["close"].tolist() == [1.0, 0.0] and extras["gap"].tolist() == [0.0, 1.0]
    wordy = RewardManager(char_tokenizer, reward_fn=lambda **_: {"score": 1.0, "acc": "yes"})
    with pytest.raises(TypeError, match=r"non-numeric 'acc' \('yes'\) for sample 0"):
        wordy(ids, mask, ["s"] * 2, [""] * 2)


def test_dict_without_acc_is_accurate_at_full_score(char_tokenizer):
    # "b" earns a format credit of 0.1: a positive score, but not a right answer
    credit = {"a": 1.0, "b": 0.1, "c": -1.0}
    ids, mask = _batch(char_tokenizer, ["a", "b", "c"])
    manager = RewardManager(char_tokenizer, reward_fn=lambda solution_str, **_: {"score": credit[solution_str]})
    scores, extras = manager(ids, mask, ["s"] * 3, [""] * 3)
    assert extras["acc"].tolist() == [1.0, 0.0, 0.0]
    assert scores[1, 0] == pytest.approx(0.1) and scores[2, 0] == -1.0
    assert "pred" not in extras  # no function said what its responses answer


def test_the_answers_graded_are_reported_for_the_vote(char_tokenizer):
    texts = ["so #### 72", "it is 72", "#### 1,234 then #### 5"]
    ids, mask = _batch(char_tokenizer, texts)
    _, extras = RewardManager(char_tokenizer)(ids, mask, ["openai/gsm8k"] * 3, ["72", "72", "5"])
    assert extras["pred"] == ["72", None, "5"]  # the strict answer the rule grades; none without "#### "
    assert extras["acc"].tolist() == [1.0, 0.0, 1.0]
    assert extras["score"].tolist() == [1.0, 0.0, 1.0]
    assert "pred" not in {key for key, value in extras.items() if isinstance(value, torch.Tensor)}


def test_the_majority_vote_counts_the_answers_the_rule_grades(char_tokenizer):
    from rlhf_core.stats import validation_metrics

    # ground truth 5: one response answers 10; three answer 5 and then check with a product that ends in 10.
    # By the answers graded (after "#### ") the majority says 5, which is right; a vote on each response's last
    # number would say 10 and count the one response that answered 10 (wrong).
    texts = ["#### 10", "#### 5\nCheck: 5*2=10", "#### 5\nCheck: 5*2=10", "#### 5\nCheck: 5*2=10"]
    ids, mask = _batch(char_tokenizer, texts)
    _, extras = RewardManager(char_tokenizer)(ids, mask, ["openai/gsm8k"] * 4, ["5"] * 4)
    metrics = validation_metrics(["openai/gsm8k"] * 4, [0] * 4, extras["acc"].tolist(), extras["score"].tolist(),
                                 extras["pred"])
    assert metrics["val-core/openai/gsm8k/acc/mean@4"] == pytest.approx(0.75)
    assert metrics["val-core/openai/gsm8k/acc/maj@4/mean"] == 1.0


def test_failing_reward_fn_names_the_sample(char_tokenizer):
    def reward(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "boom":
            raise ZeroDivisionError("division by zero in my rule")
        return 1.0

    ids, mask = _batch(char_tokenizer, ["fine", "boom", "fine"])
    with pytest.raises(RuntimeError, match=r"sample 1 \(data_source='src/b'\).*ZeroDivisionError") as caught:
        RewardManager(char_tokenizer, reward_fn=reward)(ids, mask, ["src/a", "src/b", "src/c"], ["", "", ""])
    assert isinstance(caught.value.__cause__, ZeroDivisionError)


def test_unknown_data_source_in_batch(char_tokenizer):
    ids, mask = _batch(char_tokenizer, ["#### 1", "#### 1"])
    with pytest.raises(
        UnknownDataSourceError, match=r"sample 1: .*'mystery/source'.*custom_reward_function\.path"
    ):
        RewardManager(char_tokenizer)(ids, mask, ["openai/gsm8k", "mystery/source"], ["1", "1"])


def test_non_finite_score_is_rejected(char_tokenizer):
    ids, mask = _batch(char_tokenizer, ["x"])
    with pytest.raises(ValueError, match="non-finite score"):
        RewardManager(char_tokenizer, reward_fn=lambda **_: float("nan"))(ids, mask, ["s"], [""])


def _scored_as(results: dict[str, object]):
    """A reward function that answers each response text with ``results[text]``: raised if an exception."""
    def compute_score(data_source, solution_str, ground_truth, extra_info, scale=1.0):
        result = results.get(solution_str, 1.0)
        if isinstance(result, Exception):
            raise result
        return result

    return compute_score


@pytest.mark.parametrize(("result", "kind", "builtin", "said"), [
    (ZeroDivisionError("my rule divided by zero"), "RewardFunctionFailed", RuntimeError,
     "failed on sample 1 (data_source='src/b'): ZeroDivisionError: my rule divided by zero"),
    (float("nan"), "NonFiniteReward", ValueError, "returned a non-finite score (nan) for sample 1 (data_source='src/b')"),
    (-math.inf, "NonFiniteReward", ValueError, "returned a non-finite score (-inf) for sample 1"),
    ({"score": math.inf}, "NonFiniteReward", ValueError, "returned a non-finite score (inf) for sample 1"),
    ("1.0", "BadRewardResult", TypeError, "returned str ('1.0') for sample 1 (data_source='src/b')"),
], ids=["raises", "nan", "-inf", "dict-inf", "str"])
def test_a_reward_functions_failure_is_a_reward_error_naming_function_sample_and_source(
        char_tokenizer, result, kind, builtin, said):
    import pickle

    from rlhf_core.rewards import manager as manager_module

    ids, mask = _batch(char_tokenizer, ["fine", "bad", "fine"])
    # reward_kwargs bound (a functools.partial): the message names the function, not the partial
    fn = functools.partial(_scored_as({"bad": result}), scale=2.0)
    with pytest.raises(manager_module.RewardError) as caught:
        RewardManager(char_tokenizer, reward_fn=fn)(ids, mask, ["src/a", "src/b", "src/c"], ["", "", ""])
    error = caught.value
    assert type(error).__name__ == kind and isinstance(error, builtin)  # what code catching the old error expects
    assert f"reward function 'compute_score' {said}" in str(error)
    assert (error.function, error.sample, error.data_source, error.step) == ("compute_score", 1, "src/b", None)
    if isinstance(result, Exception):
        assert error.__cause__ is result
    # it keeps its class and fields across a process boundary (pickled, as Ray or a process pool send errors)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert (copy.function, copy.sample, copy.data_source) == ("compute_score", 1, "src/b")
    # and put in the run's context, it stays what it was
    error.step = 4
    said_again = error.reworded(f"training step 4 failed: {error}")
    assert type(said_again) is type(error) and (said_again.sample, said_again.step) == (1, 4)


def test_a_batch_reward_functions_failure_is_a_reward_error(char_tokenizer):
    from rlhf_core.rewards.manager import BadRewardResult, RewardError, RewardFunctionFailed

    ids, mask = _batch(char_tokenizer, ["a", "b"])

    def broken(data_sources, solution_strs, ground_truths, extra_infos):
        return [len(s) / None for s in solution_strs]  # a TypeError of its own

    with pytest.raises(RewardFunctionFailed, match=r"batch reward function 'broken' failed on a batch of 2: "
                                                   r"TypeError: unsupported operand") as caught:
        RewardManager(char_tokenizer, BatchRewardFn(broken))(ids, mask, ["s", "s"], ["", ""])
    assert isinstance(caught.value, RewardError) and caught.value.sample is None
    with pytest.raises(BadRewardResult, match="returned 1 scores for 2 responses"):
        RewardManager(char_tokenizer, BatchRewardFn(lambda **kw: [1.0]))(ids, mask, ["s", "s"], ["", ""])
    # a dict of lists is not verl's batch result (a list of one number or dict per response): its keys are not
    # taken for the scores, whether there are fewer of them than responses or as many
    columns = BatchRewardFn(lambda solution_strs, **kw: {"score": [1.0] * len(solution_strs)})
    with pytest.raises(BadRewardResult, match=r"returned a dict \(keys 'score'\), not a list of 2 scores nor a dict "
                                              r"keyed by position \(0 to 1\): return one number or dict per response"):
        RewardManager(char_tokenizer, columns)(ids, mask, ["s", "s"], ["", ""])
    by_name = BatchRewardFn(lambda **kw: {"first": 1.0, "second": 0.0})
    with pytest.raises(BadRewardResult, match=r"returned a dict \(keys 'first', 'second'\), not a list of 2"):
        RewardManager(char_tokenizer, by_name)(ids, mask, ["s", "s"], ["", ""])
    # positions counted from 1, or one too many, are not the batch's positions
    from_one = BatchRewardFn(lambda **kw: {1: 1.0, 2: 0.0})
    with pytest.raises(BadRewardResult, match=r"returned a dict \(keys 1, 2\), not a list of 2 scores nor a dict "
                                              r"keyed by position \(0 to 1\)"):
        RewardManager(char_tokenizer, from_one)(ids, mask, ["s", "s"], ["", ""])
    one_more = BatchRewardFn(lambda **kw: {0: 1.0, 1: 0.0, 2: 0.5})
    with pytest.raises(BadRewardResult, match=r"returned a dict \(keys 0, 1, 2\), not a list of 2 scores"):
        RewardManager(char_tokenizer, one_more)(ids, mask, ["s", "s"], ["", ""])
    with pytest.raises(TypeError, match=r"returned an empty dict, not a list of 1 scores nor a dict keyed by "
                                        r"position \(0\)"):
        BatchRewardFn(lambda **kw: {})("s", "a", "")
    # nor are a text's characters (two of them for two responses would have been taken, and refused one by one)
    with pytest.raises(BadRewardResult, match=r"returned str '10', not a list of 2 scores"):
        RewardManager(char_tokenizer, BatchRewardFn(lambda **kw: "10"))(ids, mask, ["s", "s"], ["", ""])
    with pytest.raises(RewardError, match=r"non-finite score \(nan\) for sample 1 \(data_source='t'\)"):
        RewardManager(char_tokenizer, BatchRewardFn(lambda **kw: [1.0, math.nan]))(ids, mask, ["s", "t"], ["", ""])


def test_a_batch_reward_function_may_key_its_scores_by_position(char_tokenizer):
    # verl's batch manager reads scores[i] for each position i, so a dict keyed 0 .. n-1 scores as the list would,
    # whatever order its keys were written in
    ids, mask = _batch(char_tokenizer, ["a", "bb", "ccc"])

    def by_position(data_sources, solution_strs, ground_truths, extra_infos):
        return {2: {"score": 0.25, "acc": 0.0}, 0: 1.0, 1: {"score": 0.5, "acc": 1.0}}

    scores, extras = RewardManager(char_tokenizer, BatchRewardFn(by_position))(
        ids, mask, ["s", "s", "s"], ["", "", ""])
    # the score sits on each response's last token: lengths 1, 2 and 3
    assert scores[0, 0].item() == 1.0 and scores[1, 1].item() == 0.5 and scores[2, 2].item() == 0.25
    assert scores.sum().item() == 1.75
    assert extras["score"].tolist() == [1.0, 0.5, 0.25]
    assert extras["acc"].tolist() == [1.0, 1.0, 0.0]  # a number's accuracy is score >= 1; a dict's is its acc
    # called for one response (the reference check), position 0 is its score
    assert BatchRewardFn(lambda **kw: {0: 0.75})("s", "a", "") == 0.75


def test_input_validation(char_tokenizer):
    ids, mask = _batch(char_tokenizer, ["a", "b"])
    manager = RewardManager(char_tokenizer)
    with pytest.raises(ValueError, match="data_sources has 1 entries but the batch has 2"):
        manager(ids, mask, ["openai/gsm8k"], ["1", "2"])
    with pytest.raises(ValueError, match="shape"):
        manager(ids, mask[:, :-1], ["openai/gsm8k"] * 2, ["1", "2"])
    with pytest.raises(ValueError, match="only 0 and 1"):
        manager(ids, mask * 2, ["openai/gsm8k"] * 2, ["1", "2"])


def test_decodes_in_one_batch_call(char_tokenizer):
    calls = []

    class Spy:
        def batch_decode(self, sequences, skip_special_tokens=False):
            calls.append(skip_special_tokens)
            return char_tokenizer.batch_decode(sequences, skip_special_tokens=skip_special_tokens)

        def decode(self, *args, **kwargs):  # pragma: no cover - must not be used
            raise AssertionError("decode per sample; use batch_decode")

    ids, mask = _batch(char_tokenizer, ["#### 1", "#### 2", "#### 3"], eos=True)
    _, extras = RewardManager(Spy())(ids, mask, ["openai/gsm8k"] * 3, ["1", "2", "4"])
    assert calls == [True]
    assert extras["score"].tolist() == [1.0, 1.0, 0.0]
    # text the caller has decoded already is scored as it is, not decoded again
    calls.clear()
    scores, given = RewardManager(Spy())(ids, mask, ["openai/gsm8k"] * 3, ["1", "2", "4"],
                                         responses=["#### 1", "#### 2", "#### 3"])
    assert calls == []
    assert torch.equal(scores, RewardManager(char_tokenizer)(ids, mask, ["openai/gsm8k"] * 3, ["1", "2", "4"])[0])
    assert given["score"].tolist() == [1.0, 1.0, 0.0] and given["responses"] == ["#### 1", "#### 2", "#### 3"]
    with pytest.raises(ValueError, match="responses has 2 entries but the batch has 3"):
        RewardManager(Spy())(ids, mask, ["openai/gsm8k"] * 3, ["1", "2", "4"], responses=["#### 1", "#### 2"])


# --- the reward's self-check (define_reward) ---------------------------------------------------


@pytest.mark.parametrize("returned, right", [
    ("np.float32(answer == ground_truth)", [True, False]),
    ("np.bool_(answer == ground_truth)", [True, False]),
    ("torch.tensor(float(answer == ground_truth))", [True, False]),
    ("{'score': 1.0 if answer == ground_truth else 0.2, 'acc': None}", [True, False]),
    ("{'score': 1.0, 'acc': np.isclose(float(answer), float(ground_truth))}", [True, False]),
    # a partial acc is no full marks: the evaluation refuses it, where the check passed it as right (acc above 0)
    ("{'score': 0.2, 'acc': 0.2 + 0.8 * (answer == ground_truth)}", [True, False]),
    # results training refuses earn no marks, whatever their acc says
    ("{'acc': 1.0}", [False, False]),
    ("{'score': float('nan'), 'acc': True}", [False, False]),
    ("{'score': 'right', 'acc': 1}", [False, False]),
])
def test_the_reference_check_reads_a_result_as_training_does(tmp_path, returned, right):
    """A reference solution earns full marks on the result training counts as right: a score in numpy's types or
    a tensor (training reads np.float32(1.0) as 1.0; the check failed every row and stopped the pipeline), and a
    dict whose acc is None falls back to its score, as the reward manager does; a dict training refuses (no
    score, a non-finite one, a score that is no number) is no full marks, whatever its acc."""
    import pandas as pd

    from rlhf_core.config import PPOConfig
    from rlhf_core.pipeline.evaluate import check_reference_solutions

    path = tmp_path / "val.parquet"
    pd.DataFrame([{"data_source": "mine", "prompt": [{"role": "user", "content": f"q{row}"}],
                   "reward_model": {"style": "rule", "ground_truth": truth},
                   "extra_info": {"index": row, "answer": f"so #### {answer}"}}
                  for row, (truth, answer) in enumerate([("5", "5"), ("7", "8")])]).to_parquet(path, index=False)
    reward = tmp_path / "typed.py"
    reward.write_text("import numpy as np\nimport torch\n\n"
                      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    answer = solution_str.rsplit('#### ', 1)[-1]\n"
                      f"    return {returned}\n")
    cfg = PPOConfig()
    cfg.data.val_files = str(path)
    cfg.custom_reward_function.path = str(reward)
    check = check_reference_solutions(cfg)
    assert check.checked == 2
    assert [m["row"] for m in check.mismatches] == [row for row, ok in enumerate(right) if not ok]


# (the result a reward function returns, as Python source; what training does with it: "refused", or accepted
# with full marks (True) or without (False)), worked out from the rules of rlhf_core.rewards.result by hand
READ_ALIKE = [
    ("1.0", True), ("0.5", False), ("True", True), ("np.float32(1.0)", True), ("torch.tensor(1.0)", True),
    ("np.array(1.0)", True), ("torch.tensor([1.0])", "refused"), ("'1.0'", "refused"), ("None", "refused"),
    ("float('nan')", "refused"), ("{'score': 1.0}", True), ("{'score': 0.0, 'acc': True}", True),
    ("{'score': 1.0, 'acc': 0}", False), ("{'score': 1.0, 'acc': float('nan')}", False),  # NaN acc: not graded
    ("{'score': 1.0, 'acc': 'yes'}", "refused"), ("{'acc': 1.0}", "refused"), ("{'score': math.inf}", "refused"),
    ("{'score': 1.0, 'pred': 3}", True),
    # a mapping that is no dict: the self-check gave it full marks, training stopped on it
    ("types.MappingProxyType({'score': 1.0})", "refused"),
    # an int no float holds: training stopped on a metric of one with a bare OverflowError, the self-check passed
    # it; as a score, both stopped with that OverflowError. It reads as inf.
    ("{'score': 1.0, 'digits': 10**400}", True), ("10**400", "refused"),
]


@pytest.mark.parametrize("returned, training", READ_ALIKE, ids=[source for source, _ in READ_ALIKE])
def test_the_reference_check_accepts_exactly_what_training_accepts(tmp_path, char_tokenizer, returned, training):
    """The pipeline's self-check and the reward manager read a result with the one reader: a result training
    stops on is a mismatch of the check, said with training's reason, and one training takes earns full marks in
    the check exactly where training counts it right."""
    import types

    import pandas as pd

    from rlhf_core.config import PPOConfig
    from rlhf_core.pipeline.evaluate import check_reference_solutions
    from rlhf_core.rewards.manager import RewardError

    ids, mask = _batch(char_tokenizer, ["#### 5"])
    result = eval(returned, {"np": np, "torch": torch, "math": math, "types": types})
    try:
        _, extras = RewardManager(char_tokenizer, reward_fn=lambda **kw: result)(ids, mask, ["mine"], ["5"])
        trained = bool(extras["acc"][0] > 0)
    except RewardError:
        trained = "refused"
    assert trained == training

    path = tmp_path / "val.parquet"
    pd.DataFrame([{"data_source": "mine", "prompt": [{"role": "user", "content": "q"}],
                   "reward_model": {"style": "rule", "ground_truth": "5"},
                   "extra_info": {"index": 0, "answer": "#### 5"}}]).to_parquet(path, index=False)
    reward = tmp_path / "returns.py"
    reward.write_text("import math\nimport types\n\nimport numpy as np\nimport torch\n\n"
                      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      f"    return {returned}\n")
    cfg = PPOConfig()
    cfg.data.val_files = str(path)
    cfg.custom_reward_function.path = str(reward)
    check = check_reference_solutions(cfg)
    assert check.checked == 1
    if training is True:
        assert check.mismatches == [], check.summary()
    else:
        assert len(check.mismatches) == 1
        assert ("refused" in check.mismatches[0]) == (training == "refused")
    if training == "refused":  # the summary says why, in the words training stops with
        assert "(training refuses it: returned " in check.summary()
