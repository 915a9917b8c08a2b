"""The toy model: character tokenizer round trips, HF loading, generation, build cache and determinism.

Only the small ``test`` preset is built here.
"""

from __future__ import annotations

import json
import re
import string

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_core.cli.models import toy_model
from rlhf_core.data.schema import INSTRUCTION
from rlhf_core.models import toy

TEXTS = [
    "What is 3+4?",
    "  two  spaces, then a tab-free line\nand a newline\n\nand two more\n",
    "Tom has 7 apples. He buys 5 more.\nHe has 7 + 5 = <<7+5=12>>12 apples.\n#### 12",
    string.printable.replace("\t", "").replace("\r", "").replace("\x0b", "").replace("\x0c", ""),
    " leading and trailing ",
    "",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy") / "test-model"
    path = toy.build_toy_model(out, preset="test", seed=0, progress=False)
    assert path == out
    return out


@pytest.fixture(scope="module")
def tokenizer(built):
    return AutoTokenizer.from_pretrained(built)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip_from_pretrained(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text), "one token per character"
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == text


def test_tokenizer_special_tokens(tokenizer):
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == (
        "<pad>",
        "<s>",
        "</s>",
        "<unk>",
    )
    assert (
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.unk_token_id,
    ) == (0, 1, 2, 3)
    assert len(tokenizer) == 4 + 95 + 1  # specials, printable ASCII, newline
    assert (
        tokenizer("What is 3+4?")["input_ids"]
        == tokenizer("What is 3+4?", add_special_tokens=False)["input_ids"]
    ), "no special tokens are added"
    assert tokenizer.decode(tokenizer("é\tx")["input_ids"]) == "<unk><unk>x"
    assert tokenizer.is_fast


def test_load_tokenizer_pads_on_the_left_with_eos_where_a_tokenizer_has_no_pad_token(built, tmp_path):
    """Batched prompts need a pad token; many base models' tokenizers (Llama's, GPT-2's) ship none, and their EOS
    stands in for it. A tokenizer's own pad token is kept."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from rlhf_core.models.loading import load_tokenizer

    vocabulary = {"[UNK]": 0, "</s>": 1, "a": 2}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]")),
                            unk_token="[UNK]", eos_token="</s>").save_pretrained(tmp_path / "no_pad")
    assert AutoTokenizer.from_pretrained(tmp_path / "no_pad").pad_token is None
    loaded = load_tokenizer(tmp_path / "no_pad")
    assert (loaded.pad_token, loaded.pad_token_id, loaded.padding_side) == ("</s>", 1, "left")
    own = load_tokenizer(built)
    assert (own.pad_token, own.pad_token_id, own.padding_side) == ("<pad>", 0, "left")


def test_build_char_tokenizer_matches_saved(tokenizer):
    fresh = toy.build_char_tokenizer()
    assert fresh.get_vocab() == tokenizer.get_vocab()
    for text in TEXTS:
        assert fresh(text)["input_ids"] == tokenizer(text)["input_ids"]
        assert fresh.decode(fresh(text)["input_ids"]) == text


def test_chat_template(tokenizer):
    user = [{"role": "user", "content": "What is 3+4?"}]
    assert tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == (
        "User: What is 3+4?\nAssistant: "
    )
    assert tokenizer.apply_chat_template(user, tokenize=False) == "User: What is 3+4?\n"
    dialogue = user + [{"role": "assistant", "content": "#### 7"}]
    assert (
        tokenizer.apply_chat_template(dialogue, tokenize=False)
        == "User: What is 3+4?\nAssistant: #### 7</s>\n"
    )
    ids = tokenizer.apply_chat_template(user, tokenize=True, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    assert tokenizer.decode(ids) == "User: What is 3+4?\nAssistant: "
    assert toy.prompt_text(tokenizer, "Q?") == f"User: Q?{INSTRUCTION}\nAssistant: "


def test_model_loads_and_generates(built, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(built)
    config = model.config
    assert config.model_type == "llama"
    assert config.tie_word_embeddings
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)
    assert config.vocab_size == len(tokenizer)
    assert config.max_position_embeddings >= 512
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    tokenizer.padding_side = "left"
    prompts = [
        toy.prompt_text(tokenizer, "Tom has 7 apples. He buys 5 more. How many apples does he have now?"),
        toy.prompt_text(tokenizer, "What is 3+4?"),
    ]
    enc = tokenizer(prompts, padding=True, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    prompt_len = enc["input_ids"].shape[1]
    assert out.shape[0] == 2 and prompt_len < out.shape[1] <= prompt_len + 8
    # greedy: the first new token of the longest (unpadded) prompt is the argmax of a plain forward pass
    assert bool(enc["attention_mask"][0].all())
    with torch.no_grad():
        logits = model(input_ids=enc["input_ids"][:1]).logits[0, -1]
    assert int(out[0, prompt_len]) == int(logits.argmax())
    # character tokens: the new ids decode to text that encodes back to the same ids
    new_ids = [i for i in out[0, prompt_len:].tolist() if i not in tokenizer.all_special_ids]
    assert tokenizer(tokenizer.decode(new_ids), add_special_tokens=False)["input_ids"] == new_ids


def test_marker_records_the_build(built):
    marker = json.loads((built / toy.MARKER).read_text())
    assert marker["hash"] == toy.settings_hash("test", 0)
    assert marker["preset"] == "test" and marker["seed"] == 0
    assert marker["settings"] == toy.preset_settings("test")
    # vocab 100, hidden 32, 1 layer, MLP 64, 2 heads and 2 KV heads (so k and v are 32 x 32), no biases: the
    # embedding (the tied head counted once), q/k/v/o, gate/up/down, and two layer norms plus the final one
    assert marker["parameters"] == 100 * 32 + 4 * 32 * 32 + 3 * 32 * 64 + 3 * 32  # 13,536
    assert marker["eval_problems"] == toy.PRESETS["test"]["eval_problems"]
    # each accuracy is the count-weighted mean of its per-operation accuracies (those rounded to 4 places): the
    # first operation of a solution is the sign after the first number of its "<<a+b=c>>" annotation
    problems = toy.heldout_problems("test", 0)
    operations = [problem["solution"].split("<<", 1)[1].lstrip(string.digits)[0] for problem in problems]
    for key in ("greedy_accuracy", "sampled_accuracy"):
        by_operation = marker[f"{key}_by_operation"]
        assert set(by_operation) == set(operations)
        weighted = sum(by_operation[op] * operations.count(op) for op in by_operation) / len(problems)
        assert marker[key] == pytest.approx(weighted, abs=1e-4)


def _greedy_text(model, tokenizer, question: str, max_new_tokens: int) -> str:
    """A plain greedy loop: the whole sequence through the model at each step, argmax, stop at EOS."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question + INSTRUCTION}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(input_ids=ids).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokenizer.decode(new, skip_special_tokens=True)


def test_marker_greedy_figures_match_a_plain_greedy_rescoring(built, tokenizer):
    """The saved model, decoded greedily by a plain loop here, gives the marker's greedy samples and accuracy
    (right: the last "#### <number>" of the response, commas dropped, equals the problem's answer)."""
    marker = json.loads((built / toy.MARKER).read_text())
    model = AutoModelForCausalLM.from_pretrained(built).eval()
    problems = toy.heldout_problems("test", 0)
    texts = [_greedy_text(model, tokenizer, p["question"], marker["settings"]["max_new_tokens"]) for p in problems]
    assert marker["greedy_samples"] == texts[:5]

    def right(text: str, answer: str) -> bool:
        found = re.findall(r"#### (-?[0-9.,]+)", text)
        return bool(found) and found[-1].replace(",", "") == answer.replace(",", "")

    assert marker["greedy_accuracy"] == sum(right(t, p["answer"]) for t, p in zip(texts, problems)) / len(problems)
    assert marker["max_prompt_tokens"] > marker["max_reference_response_tokens"] > 0
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (built / name).is_file(), name


def test_second_build_reuses_the_folder(built):
    marker, weights = built / toy.MARKER, built / "model.safetensors"
    before = (marker.stat().st_mtime_ns, weights.stat().st_mtime_ns)
    assert toy.build_toy_model(built, preset="test", seed=0, progress=False) == built
    assert (marker.stat().st_mtime_ns, weights.stat().st_mtime_ns) == before


def test_hash_depends_on_seed_preset_and_code_version(monkeypatch):
    assert toy.settings_hash("test", 0) == toy.settings_hash("test", 0)
    assert toy.settings_hash("test", 0) != toy.settings_hash("test", 1)
    assert toy.settings_hash("test", 0) != toy.settings_hash("demo", 0)
    before = toy.settings_hash("test", 0)
    monkeypatch.setattr(toy, "CODE_VERSION", toy.CODE_VERSION + 1)
    assert toy.settings_hash("test", 0) != before
    with pytest.raises(ValueError, match="unknown toy preset"):
        toy.settings_hash("huge", 0)


def test_same_seed_same_weights_other_seed_rebuilds(built, tmp_path):
    again = toy.build_toy_model(tmp_path / "again", preset="test", seed=0, progress=False, threads=1)
    first, second = load_file(built / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    # A different seed in the same folder is a different build: it is redone, not reused.
    toy.build_toy_model(again, preset="test", seed=1, progress=False)
    assert toy.read_marker(again)["hash"] == toy.settings_hash("test", 1)
    third = load_file(again / "model.safetensors")
    assert not all(torch.equal(first[k], third[k]) for k in first)


def test_incomplete_or_forced_build_is_redone(tmp_path):
    out = toy.build_toy_model(tmp_path / "m", preset="test", seed=2, progress=False)
    marker = out / toy.MARKER
    first = marker.stat().st_mtime_ns
    toy.build_toy_model(out, preset="test", seed=2, force=True, progress=False)
    assert marker.stat().st_mtime_ns != first
    marker.unlink()  # as if the build had been interrupted before its last write
    assert toy.read_marker(out) is None
    toy.build_toy_model(out, preset="test", seed=2, progress=False)
    assert toy.read_marker(out)["hash"] == toy.settings_hash("test", 2)


def test_ensure_toy_model_uses_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(toy.CACHE_ENV, str(tmp_path / "cache"))
    assert toy.default_cache_dir() == tmp_path / "cache"
    path = toy.ensure_toy_model("test", seed=0, progress=False)
    assert path == tmp_path / "cache" / f"test-{toy.settings_hash('test', 0)}"
    mtime = (path / toy.MARKER).stat().st_mtime_ns
    assert toy.ensure_toy_model("test", seed=0, progress=False) == path
    assert (path / toy.MARKER).stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name], "no staging folder is left"
    monkeypatch.delenv(toy.CACHE_ENV)
    assert toy.default_cache_dir().parts[-3:] == (".cache", "rlhf_ppo", "toy")


def test_random_toy_model(tmp_path):
    out = toy.random_toy_model(tmp_path / "rand", n_layers=3, hidden_size=64, intermediate_size=96, seed=1)
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "llama"
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.intermediate_size) == (
        3,
        64,
        96,
    )
    assert tokenizer.decode(tokenizer("a b\nc")["input_ids"]) == "a b\nc"
    assert not (out / toy.MARKER).exists()
    again = toy.random_toy_model(tmp_path / "rand2", n_layers=3, hidden_size=64, intermediate_size=96, seed=1)
    first, second = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert all(torch.equal(first[k], second[k]) for k in first)
    with pytest.raises(ValueError, match="multiple"):
        toy.random_toy_model(tmp_path / "bad", hidden_size=64, n_heads=3)


def test_cli_reports_the_build(built, capsys):
    assert toy_model(["--output", str(built), "--preset", "test", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert "parameters:" in out and "greedy accuracy:" in out and "sampled accuracy" in out
    assert "(reused)" in out


@pytest.mark.parametrize("cpus, load, expected", [
    (8, 0.0, 4),     # an idle machine: capped at 4
    (3, 0.4, 3),     # fewer CPUs than the cap
    (8, 6.2, 2),     # 1.8 CPUs free, rounded
    (16, 13.4, 3),   # 2.6 free
    (2, 5.0, 1),     # overloaded: still one
    (8, None, 4),    # no load average on this platform: as if idle
    (None, 0.0, 1),  # CPU count unknown
])
def test_threads_follow_the_free_cpus(monkeypatch, cpus, load, expected):
    def loadavg():
        if load is None:
            raise OSError("no load average")
        return (load, load, load)

    monkeypatch.setattr(toy.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(toy.os, "getloadavg", loadavg)
    assert toy.auto_threads() == expected


def test_a_slip_keeps_the_working_and_writes_the_first_number_as_the_answer():
    problem = {"question": "Eli has 4 marbles. He gets 11 more marbles from his mother. How many marbles does Eli "
                           "have at the end?",
               "solution": "He has 4 + 11 = <<4+11=15>>15 marbles.\n#### 15", "answer": "15"}
    slipped = toy.with_slip(problem)
    assert slipped["solution"] == "He has 4 + 11 = <<4+11=15>>15 marbles.\n#### 4"
    assert slipped["answer"] == "15" and problem["solution"].endswith("#### 15")  # the truth and the input stay
    from rlhf_core.rewards.gsm8k import compute_score

    assert compute_score(slipped["solution"], slipped["answer"]) == 0.0


def test_the_slip_rate_sets_the_share_of_slipped_training_solutions():
    settings = {**toy.preset_settings("test"), "train_steps": 1000, "batch_size": 8, "slip_rate": 0.3}
    problems = toy._training_problems(settings, seed=0)
    slipped = [p for p in problems if p["solution"].rpartition("#### ")[2] != p["answer"]]
    # a slip can coincide with the right answer (4 * 1 = 4), so count the written answers that differ
    assert 0.27 < len(slipped) / len(problems) < 0.32  # 8,000 draws: one standard error is 0.005
    clean = toy._training_problems({**settings, "slip_rate": 0.0}, seed=0)
    assert all(p["solution"].rpartition("#### ")[2] == p["answer"] for p in clean)


def test_a_build_stopped_under_its_bar_on_a_terminal_gives_the_streams_back(monkeypatch):
    """On a terminal the build's bars route other output around themselves while open (sys.stdout and sys.stderr
    stand in for the terminal's): a Ctrl-C in the warm start's loop left its bar open, so the streams stayed
    rerouted and a partial line printed after it was held back. (The evaluation's bar wraps its loop and closes as
    the loop is left.)"""
    import sys

    from rlhf_core import progress

    monkeypatch.setattr(progress, "is_terminal", lambda stream: True)
    settings = {**toy.preset_settings("test"), "train_steps": 3}
    tokenizer = toy.build_char_tokenizer(settings["max_position_embeddings"])
    model = toy.LlamaForCausalLM(toy._llama_config(tokenizer, 16, 1, 2, 32, settings["max_position_embeddings"]))
    calls = []

    def stopped(*args, **kwargs):
        calls.append(1)
        raise KeyboardInterrupt

    streams = (sys.stdout, sys.stderr)
    seen = None
    try:
        monkeypatch.setattr(toy, "_collate", stopped)
        toy._warm_start(model, tokenizer, settings, seed=0, progress=True)
    except KeyboardInterrupt:  # as the command's handler sees it: the interrupted frames (and the bar) still alive
        seen = ((sys.stdout, sys.stderr) == streams, progress.TerminalBar._open)
    finally:
        sys.stdout, sys.stderr = streams  # (put back for the other tests, whatever happened)
        progress.TerminalBar._open, progress.TerminalBar._streams = 0, None
    assert calls == [1]
    assert seen == (True, 0)
