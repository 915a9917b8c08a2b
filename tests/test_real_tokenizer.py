"""A real BPE tokenizer (SmolLM2-135M-Instruct's: ChatML template, ``<|im_end|>`` as EOS and pad)
through the prompt, rollout, reward and preflight paths that the character tokenizer cannot exercise.

SmolLM2's special tokens: 0 ``<|endoftext|>``, 1 ``<|im_start|>``, 2 ``<|im_end|>`` (EOS and pad).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import save_file
from transformers import GenerationConfig, LlamaConfig

from rlhf_core.batch import Batch
from rlhf_core.cli.train import ppo
from rlhf_core.config import DataConfig, load_config
from rlhf_core.data.dataset import DataError, RLHFDataset
from rlhf_core.main_ppo import PreflightError, preflight
from rlhf_core.models.loading import load_tokenizer
from rlhf_core.rewards import get_reward_fn
from rlhf_core.rewards.manager import RewardManager
from rlhf_core.rollout import SamplingParams, make_rollout_engine

END_OF_TEXT, IM_START, IM_END = 0, 1, 2
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir):
    return load_tokenizer(smollm2_tokenizer_dir)


def _parquet(path: Path, prompts: list[list[dict]], truths: list[str] | None = None) -> Path:
    truths = truths or ["42"] * len(prompts)
    pd.DataFrame({
        "data_source": ["openai/gsm8k"] * len(prompts),
        "prompt": prompts,
        "ability": ["math"] * len(prompts),
        "reward_model": [{"style": "rule", "ground_truth": t} for t in truths],
        "extra_info": [{"split": "test", "index": i} for i in range(len(prompts))],
    }).to_parquet(path, index=False)
    return path


def test_the_fixture_is_the_bpe_chat_tokenizer(tokenizer):
    assert len(tokenizer) == 49152
    assert tokenizer.convert_ids_to_tokens([END_OF_TEXT, IM_START, IM_END]) == [
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == IM_END
    assert len(tokenizer("Tom has twelve apples.", add_special_tokens=False)["input_ids"]) < 10  # words, not chars


def test_prompt_ids_are_the_chat_template_with_a_generation_prompt(tokenizer, tmp_path):
    with_system = [{"role": "system", "content": "You solve math."}, {"role": "user", "content": "What is 7*6?"}]
    without_system = [{"role": "user", "content": "What is 7*6?"}]
    data = RLHFDataset(_parquet(tmp_path / "p.parquet", [with_system, without_system]), tokenizer,
                       DataConfig(max_prompt_length=128))
    expected_text = [
        "<|im_start|>system\nYou solve math.<|im_end|>\n<|im_start|>user\nWhat is 7*6?<|im_end|>\n"
        "<|im_start|>assistant\n",
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 7*6?<|im_end|>\n"
        "<|im_start|>assistant\n",
    ]
    for ids, messages, text in zip(data.prompt_ids, [with_system, without_system], expected_text):
        assert ids == list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
        assert tokenizer.decode(ids) == text
        assert ids[0] == IM_START and ids.count(IM_END) == 2  # the pad id appears inside every prompt
    # left padding with pad = EOS: the mask comes from the lengths, not from comparing ids with the pad id
    batch = data.collate([0, 1])
    lengths = [len(ids) for ids in data.prompt_ids]
    assert batch["attention_mask"].sum(-1).tolist() == lengths
    short = 0 if lengths[0] < lengths[1] else 1
    gap = max(lengths) - min(lengths)
    assert batch["attention_mask"][short, :gap].sum() == 0 and batch["attention_mask"][short, gap:].all()
    assert batch["input_ids"][short, gap:].tolist() == data.prompt_ids[short]


@pytest.mark.parametrize("mode", ["left", "right", "error"])
def test_truncation_counts_bpe_tokens(tokenizer, tmp_path, mode):
    question = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. " * 3
    messages = [{"role": "user", "content": question}]
    full = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    limit = 40
    assert len(full) > limit and len(full) < len(question) // 2  # BPE: far fewer tokens than characters
    path = _parquet(tmp_path / "long.parquet", [[{"role": "user", "content": "Hi"}], messages])
    config = DataConfig(max_prompt_length=limit, truncation=mode)
    if mode == "error":
        with pytest.raises(DataError, match=rf"long.parquet row 1: prompt has {len(full)} tokens > "
                                            rf"data.max_prompt_length \({limit}\)"):
            RLHFDataset(path, tokenizer, config)
        return
    ids = RLHFDataset(path, tokenizer, config).prompt_ids[1]
    assert len(ids) == limit
    if mode == "left":  # the question's end and the generation prompt survive
        assert ids == full[len(full) - limit:]
        assert tokenizer.decode(ids).endswith("half as many clips in May. <|im_end|>\n<|im_start|>assistant\n")
    else:  # the system turn and the question's start survive
        assert ids == full[:limit]
        assert tokenizer.decode(ids).startswith(f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n<|im_start|>user\n")


class ScriptedLM(torch.nn.Module):
    """A causal LM that emits ``scripts[row][step]`` (the last entry once a script runs out)."""

    def __init__(self, scripts: list[list[int]], eos, vocab: int = 49152):
        super().__init__()
        self.scripts, self.vocab = scripts, vocab
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=IM_END)
        self.calls = 0

    def forward(self, input_ids, attention_mask, position_ids, use_cache=True, **kwargs):
        step, self.calls = self.calls, self.calls + 1
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], self.vocab), -1e4)
        for row in range(input_ids.shape[0]):
            script = self.scripts[row]
            logits[row, -1, script[min(step, len(script) - 1)]] = 0.0
        return type("Out", (), {"logits": logits})()


def _prompt_batch(tokenizer, n_rows: int) -> Batch:
    from rlhf_core.data.dataset import left_pad

    ids = [list(tokenizer.apply_chat_template([{"role": "user", "content": f"Question {i}"}],
                                              add_generation_prompt=True, return_dict=False)) for i in range(n_rows)]
    return Batch(left_pad(ids, tokenizer.pad_token_id), {"uid": list(range(n_rows))})


def test_generation_stops_at_im_end_which_stays_in_the_mask_and_pad_eos_does_not_cut(tokenizer):
    short = tokenizer("#### 7", add_special_tokens=False)["input_ids"]
    long = tokenizer("Three plus four is seven. #### 7", add_special_tokens=False)["input_ids"]
    assert IM_END not in short + long
    module = ScriptedLM([short + [IM_END, 99, 98], long + [IM_END, 97]], eos=IM_END)
    engine = make_rollout_engine("hf", module, tokenizer)
    out = engine.generate(_prompt_batch(tokenizer, 2), SamplingParams(max_new_tokens=30, do_sample=False))
    width = len(long) + 1
    assert out["responses"].shape == (2, width)  # stopped once both rows had <|im_end|>, not at 30
    assert out["response_mask"].tolist() == [[1] * (len(short) + 1) + [0] * (width - len(short) - 1), [1] * width]
    assert out["responses"][0].tolist() == short + [IM_END] * (width - len(short))  # pad = EOS after the end
    assert out["responses"][1].tolist() == long + [IM_END]  # the longer row runs to its own end
    assert module.calls == width


def test_every_eos_id_of_the_generation_config_stops_a_row(tokenizer):
    """Qwen's generation_config lists two EOS ids ([<|im_end|>, <|endoftext|>]); either ends a row."""
    words = tokenizer("one two three", add_special_tokens=False)["input_ids"]
    scripts = [words[:1] + [END_OF_TEXT], words + [IM_END], words[:2] + [IM_START] + words[:1] + [IM_END]]
    two_eos = make_rollout_engine("hf", ScriptedLM(scripts, eos=[IM_END, END_OF_TEXT]), tokenizer)
    out = two_eos.generate(_prompt_batch(tokenizer, 3), SamplingParams(max_new_tokens=12, do_sample=False))
    assert out["response_mask"].sum(-1).tolist() == [2, len(words) + 1, 5]  # <|im_start|> is no EOS
    one_eos = make_rollout_engine("hf", ScriptedLM(scripts, eos=IM_END), tokenizer)
    out = one_eos.generate(_prompt_batch(tokenizer, 3), SamplingParams(max_new_tokens=12, do_sample=False))
    assert out["response_mask"].sum(-1).tolist()[0] == 12  # without it in the config, <|endoftext|> runs on


def test_the_reward_sees_the_decoded_answer_without_special_tokens(tokenizer):
    texts = ["Six times seven is 42.\n#### 42", "#### 41"]
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] + [IM_END] for t in texts]
    width = max(map(len, rows)) + 2
    responses = torch.tensor([r + [IM_END] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    seen = []

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(solution_str)
        return get_reward_fn("openai/gsm8k")(data_source, solution_str, ground_truth, extra_info)

    scores, extras = RewardManager(tokenizer, reward)(responses, mask, ["openai/gsm8k"] * 2, ["42", "42"])
    assert seen == texts  # no <|im_end|>, no padding, nothing lost at BPE merges
    assert extras["score"].tolist() == [1.0, 0.0]
    assert scores[0, len(rows[0]) - 1] == 1.0 and scores[0].sum() == 1.0  # on the EOS, the last valid token


def test_the_real_model_answers_and_stops_at_im_end(tokenizer, smollm2_dir):
    from rlhf_core.models.loading import load_actor

    actor = load_actor(smollm2_dir)
    assert actor.generation_config.eos_token_id == IM_END
    messages = [[{"role": "user", "content": "What is 2+3? Answer with a number."}]]
    ids = [list(tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False)) for m in messages]
    from rlhf_core.data.dataset import left_pad

    out = make_rollout_engine("hf", actor, tokenizer).generate(
        Batch(left_pad(ids, IM_END), {"uid": [0]}), SamplingParams(max_new_tokens=40, do_sample=False))
    length = int(out["response_mask"][0].sum())
    assert length < 40 and out["responses"][0, length - 1] == IM_END
    assert "5" in tokenizer.decode(out["responses"][0, :length], skip_special_tokens=True)


# ----------------------------------------------------------------------------- preflight


def _model_dir(path: Path, tokenizer_dir: Path, vocab_size: int) -> Path:
    """A model directory whose weights cannot load (a whole safetensors file with none of the model's tensors):
    preflight reads its header alone."""
    path.mkdir(parents=True)
    LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=1024).save_pretrained(path)
    save_file({}, path / "model.safetensors")
    for name in tokenizer_dir.iterdir():
        if name.is_file() and name.name != "gguf_import.json":
            shutil.copy(name, path / name.name)
    return path


def _overrides(root: Path, actor: Path, *extra: str) -> list[str]:
    data = _parquet(root / "train.parquet", [[{"role": "user", "content": "What is 6*7?"}]] * 4)
    return [f"actor_rollout_ref.model.path={actor}", f"data.train_files={data}", f"data.val_files={data}",
            "data.train_batch_size=4", "data.max_prompt_length=128", "data.max_response_length=64",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.device=cpu",
            "trainer.n_gpus_per_node=1", f"trainer.default_local_dir={root / 'out'}", *extra]


def _config(root: Path, actor: Path, *extra: str):
    return load_config(_overrides(root, actor, *extra))


def _without_template(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    assert not load_tokenizer(target).chat_template
    return target


def test_preflight_passes_the_real_tokenizer_without_loading_weights(smollm2_tokenizer_dir, tmp_path):
    actor = _model_dir(tmp_path / "actor", smollm2_tokenizer_dir, 49152)
    preflight(_config(tmp_path, actor))  # no error; the garbage weights were never read
    preflight(_config(tmp_path, actor, "data.val_files=[]"))  # no validation set: the trainer runs without one


def test_a_tokenizer_without_a_chat_template_is_a_preflight_error(smollm2_tokenizer_dir, tmp_path, capsys):
    actor = _model_dir(tmp_path / "actor", smollm2_tokenizer_dir, 49152)
    plain = _without_template(smollm2_tokenizer_dir, tmp_path / "plain")
    with pytest.raises(PreflightError) as error:
        preflight(_config(tmp_path, actor, f"actor_rollout_ref.model.tokenizer_path={plain}"))
    assert len(error.value.errors) == 1
    assert error.value.errors[0].startswith(f"actor_rollout_ref.model.tokenizer_path: the tokenizer in {plain} "
                                            "has no chat template")
    no_template_model = _model_dir(tmp_path / "plain_model", plain, 49152)
    code = ppo(_overrides(tmp_path, no_template_model))  # the command line: exit 2, the key named
    assert code == 2
    assert "actor_rollout_ref.model.path: the tokenizer in" in capsys.readouterr().err


def test_actor_and_critic_with_different_vocabularies_are_a_preflight_error(smollm2_tokenizer_dir, tmp_path):
    from rlhf_core.models.toy import build_char_tokenizer

    actor = _model_dir(tmp_path / "actor", smollm2_tokenizer_dir, 49152)
    chars = tmp_path / "chars"
    build_char_tokenizer().save_pretrained(chars)
    char_vocab = len(load_tokenizer(chars))
    critic = _model_dir(tmp_path / "critic", chars, char_vocab)
    with pytest.raises(PreflightError) as error:
        preflight(_config(tmp_path, actor, f"critic.model.path={critic}"))
    assert [e.split(" ", 1)[0] for e in error.value.errors] == ["critic.model.path", "critic.model.path:"]
    assert error.value.errors[0].startswith(f"critic.model.path and actor_rollout_ref.model.path have different "
                                            f"vocabularies ({char_vocab} vs 49152 tokens; id 0 is '<pad>' vs "
                                            "'<|endoftext|>')")
    assert error.value.errors[1].startswith(f"critic.model.path: {critic} has vocab_size {char_vocab} but the "
                                            "tokenizer of actor_rollout_ref.model.path has 49152 tokens")
    # the critic's tokenizer named on its own: the same check, under that key
    with pytest.raises(PreflightError) as error:
        preflight(_config(tmp_path, actor, f"critic.model.tokenizer_path={chars}"))
    assert [e.split(" ", 1)[0] for e in error.value.errors] == ["critic.model.tokenizer_path"]
    # without a critic (GRPO) nothing is compared
    preflight(_config(tmp_path, actor, f"critic.model.path={critic}", "algorithm.adv_estimator=grpo",
                      "actor_rollout_ref.rollout.n=2"))
