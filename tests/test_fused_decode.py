"""The fused decode step against transformers' own layers, and the rollout's use of it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from rlhf_core.batch import Batch
from rlhf_core.data.dataset import left_pad
from rlhf_core.models import cpu_matmul, lora
from rlhf_core.models.loading import cache_argument, load_actor, load_tokenizer
from rlhf_core.models.toy import random_toy_model
from rlhf_core.rollout import SamplingParams, hf, make_rollout_engine
from rlhf_core.rollout.cache import PreallocatedCache
from rlhf_core.rollout.fused_decode import FusedDecoder, unsupported

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
FUSED_CALL = FusedDecoder.__call__
CONFIGS = {
    "llama, grouped kv heads, tied": lambda: LlamaConfig(**SMALL, tie_word_embeddings=True),
    "llama, biases, linear rope, untied": lambda: LlamaConfig(
        **SMALL, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "llama, llama3 rope, one kv head per head": lambda: LlamaConfig(
        **{**SMALL, "num_key_value_heads": 4}, rope_parameters=LLAMA3_ROPE),
    "qwen2 (q, k, v biases)": lambda: Qwen2Config(**SMALL, tie_word_embeddings=False),
    # yarn scales cos and sin by 0.1 ln(factor) + 1 = 1.1386; the rope types above all scale by 1
    "llama, yarn rope": lambda: LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}),
    "llama, head_dim 32": lambda: LlamaConfig(**SMALL, head_dim=32),  # not hidden_size / heads (16)
}


def _model(config) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    for parameter in model.parameters():  # biases and norms away from their initial 0 and 1
        parameter.data.add_(torch.randn_like(parameter) * 0.05)
    cpu_matmul.route(model)
    return model


def _prompt(rows: int, length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompts of 2 to ``length`` tokens: ids, mask, positions."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, length + 1, (rows,), generator=g)
    mask = (torch.arange(length) >= length - lengths[:, None]).long()
    return torch.randint(3, vocab, (rows, length), generator=g) * mask, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _decode(model, step, tokens: torch.Tensor, rows: int = 5, length: int = 7) -> list[torch.Tensor]:
    """The logits of each of ``tokens``' columns fed one per step after a prompt pass by transformers;
    ``step(token, mask, positions, cache)`` runs one decode step."""
    ids, mask, positions = _prompt(rows, length, model.config.vocab_size)
    cache = PreallocatedCache(length + tokens.shape[1])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
              **{cache_argument(type(model)): cache})
    next_pos, logits = positions[:, -1] + 1, []
    for column in tokens.T:
        mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype)], dim=1)
        logits.append(step(column, mask, next_pos, cache))
        next_pos = next_pos + 1
    return logits


def _layers_step(model):
    @torch.no_grad()
    def step(token, mask, positions, cache):
        return model(input_ids=token[:, None], attention_mask=mask, position_ids=positions[:, None],
                     use_cache=True, **{cache_argument(type(model)): cache}).logits[:, -1]
    return step


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("kernel", ["onednn", "blas", "auto, Intel"])
def test_the_fused_step_gives_transformers_logits(name, kernel, kind, monkeypatch):
    if kernel == "auto, Intel":  # MKL's packed products
        if not cpu_matmul.mkl_available():
            pytest.skip("this torch build has no MKL packed sgemm")
        monkeypatch.setattr(cpu_matmul, "cpu_vendor", lambda: "GenuineIntel")
    kind(kernel.split(",")[0])
    model = _model(CONFIGS[name]())
    assert unsupported(model) is None
    tokens = torch.randint(3, model.config.vocab_size, (5, 6), generator=torch.Generator().manual_seed(2))
    expected = _decode(model, _layers_step(model), tokens)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    fused = FusedDecoder(model, rows=5)
    # the norms' weights ride in the float32 products' copies; the model's own tensors are untouched
    assert fused.layers[0].norm1 is None and fused.layers[0].norm2 is None and fused.final_norm is None
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
    if kernel == "onednn":  # packed for the step's rows: the same copies the model's layers read otherwise
        assert fused.layers[0].products[0][0].is_mkldnn and fused.head[0].is_mkldnn
    elif kernel == "auto, Intel":
        assert all(isinstance(w, cpu_matmul.MKLPacked) for w in (fused.layers[0].products[0][0], fused.head[0]))
    got = _decode(model, fused, tokens)
    for step, (a, b) in enumerate(zip(expected, got)):
        assert b.shape == a.shape == (5, model.config.vocab_size)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    assert (expected[-1] - expected[0]).abs().max() > 0.1  # the steps differ: the cache and rotation move


def test_in_bfloat16_the_fused_step_rounds_as_the_layers_do(kind):
    """trainer.cpu_matmul_dtype=bfloat16: both multiply bfloat16 copies inside the blocks, the head in float32."""
    model = _model(CONFIGS["llama, grouped kv heads, tied"]())
    # two decode steps: from the third on, the two attentions' last-bit float32 differences (both right) can flip a
    # bfloat16 rounding of the next product's input, which moves the logits by bfloat16's rounding itself (seen
    # on an AVX2 CPU: identical logits for two steps, then 0.0057 apart against 0.0085 from float32)
    tokens = torch.randint(3, model.config.vocab_size, (5, 2), generator=torch.Generator().manual_seed(2))
    kind("auto")
    float32 = _decode(model, _layers_step(model), tokens)
    kind("auto", "bfloat16")
    fused = FusedDecoder(model, rows=5)
    assert fused.layers[0].products[0][0].dtype == fused.layers[0].products[3][0].dtype == torch.bfloat16
    # in bfloat16 the norms keep their weights on the float32 side, as the layers do; the float32 head takes its own
    assert fused.layers[0].norm1 is not None and fused.final_norm is None
    assert fused.head[0].dtype == torch.float32
    unrouted = AutoModelForCausalLM.from_config(CONFIGS["llama, grouped kv heads, tied"]())
    assert FusedDecoder(unrouted, rows=5).layers[0].products[0][0].dtype == torch.float32  # as its own layers multiply
    got = _decode(model, fused, tokens)
    with cpu_matmul.packed_weights(model, rows=5):
        layers = _decode(model, _layers_step(model), tokens)
    for a, b, c in zip(layers, got, float32):
        rounding = (a - c).abs().max()
        assert rounding > 1e-4  # bfloat16 products do change the logits
        assert (b - a).abs().max() <= 0.05 * rounding


@pytest.mark.parametrize("case, reason", [
    ("mistral", "model_type 'mistral'"),
    ("gelu", "hidden_act 'gelu'"),
    ("dynamic rope", "rope type 'dynamic'"),
    ("sliding window", "sliding-window"),
    ("dora", "DoRA"),
    ("float64", "plain float32"),
])
def test_models_it_does_not_know_are_named_with_the_reason(case, reason):
    if case == "mistral":
        model = AutoModelForCausalLM.from_config(MistralConfig(**SMALL))
    elif case == "gelu":
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL, hidden_act="gelu"))
    elif case == "dynamic rope":
        model = AutoModelForCausalLM.from_config(LlamaConfig(
            **SMALL, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}))
    elif case == "sliding window":
        model = AutoModelForCausalLM.from_config(Qwen2Config(
            **SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=1))
    elif case == "dora":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(AutoModelForCausalLM.from_config(LlamaConfig(**SMALL)),
                               LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True))
    else:
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL)).double()
    assert reason in unsupported(model)
    with pytest.raises(ValueError, match="cannot run this model"):
        FusedDecoder(model, rows=2)


def _with_adapters(model: torch.nn.Module, rank: int, std: float, seed: int,
                   targets: str | list[str] = "all-linear") -> torch.nn.Module:
    """``model`` with LoRA adapters of ``rank`` on ``targets`` (default every projection), A and B drawn from
    N(0, std^2) (PEFT starts B at zero, where the adapters would change nothing)."""
    model = lora.apply_lora(model, rank, 2 * rank, targets)
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in model.named_parameters():
        if ".lora_" in name:
            parameter.data = torch.randn(parameter.shape, generator=generator) * std
    return model


def _lora_model(head: bool = False) -> torch.nn.Module:
    """The first configuration with LoRA adapters of rank 4 on every projection, A and B away from zero; with
    ``head``, the untied configuration with adapters on some projections and on its output head."""
    if head:
        return _with_adapters(_model(CONFIGS["llama, biases, linear rope, untied"]()), 4, 0.2, seed=5,
                              targets=["q_proj", "down_proj", "lm_head"]).eval()
    return _with_adapters(_model(CONFIGS["llama, grouped kv heads, tied"]()), 4, 0.2, seed=5).eval()


@pytest.mark.parametrize("head", [False, True], ids=["projections", "some_projections_and_the_untied_head"])
def test_with_lora_the_fused_step_gives_the_adapted_layers_logits(kind, head):
    kind("auto")
    model = _lora_model(head)
    assert hasattr(lora.base_model(model).lm_head, "lora_A") == head
    tokens = torch.randint(3, model.config.vocab_size, (5, 5), generator=torch.Generator().manual_seed(2))
    adapted = _decode(model, _layers_step(model), tokens)
    # the PEFT model, and the transformers model inside it with its wrapped layers (what the actor's rollout holds)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    for module in (model, lora.base_model(model)):
        assert unsupported(module) is None
        got = _decode(model, FusedDecoder(module, rows=5), tokens)
        assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
        for step, (a, b) in enumerate(zip(adapted, got)):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"{type(module).__name__}, step {step}")
    # with the adapters off (the reference policy's setting) the step multiplies the base weights alone
    with model.disable_adapter():
        base = _decode(model, _layers_step(model), tokens)
        off = _decode(model, FusedDecoder(model, rows=5), tokens)
    for a, b in zip(base, off):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert (adapted[0] - base[0]).abs().max() > 0.05  # the adapters do change the logits


def _engine_run(tmp_path, monkeypatch, fused: bool, lora_rank: int = 0):
    path = tmp_path / "model"
    if not path.exists():
        random_toy_model(path, n_layers=2, hidden_size=32, seed=3)
    model, tokenizer = load_actor(path), load_tokenizer(path)
    if lora_rank:  # adapters that change what is sampled, the same in every run
        model = _with_adapters(model, lora_rank, 0.5, seed=6)
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ["ab", "cde", "f"]]
    prompts = Batch(left_pad(ids, tokenizer.pad_token_id), {})
    monkeypatch.setattr(hf, "FUSED_DECODE", fused)
    steps = []

    def counting(self, *args):
        steps.append(args[0].shape[0])
        return FUSED_CALL(self, *args)

    monkeypatch.setattr(FusedDecoder, "__call__", counting)
    out = make_rollout_engine("hf", model, tokenizer, seed=4).generate(
        prompts, SamplingParams(n=2, max_new_tokens=12, temperature=1.0))
    return out, steps


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_the_rollout_samples_the_same_tokens_with_the_fused_step(tmp_path, monkeypatch, kind, lora_rank):
    kind("onednn")
    layers, no_steps = _engine_run(tmp_path, monkeypatch, fused=False, lora_rank=lora_rank)
    fused, steps = _engine_run(tmp_path, monkeypatch, fused=True, lora_rank=lora_rank)
    assert no_steps == [] and steps == [6] * (fused["responses"].shape[1] - 1)  # every decode step, 3 x 2 rows
    for key in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(fused[key], layers[key]), key
    assert fused["responses"].shape[1] > 1


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("lora_rank", [0, 4])
@pytest.mark.parametrize("name", ["llama, grouped kv heads, tied", "qwen2 (q, k, v biases)"])
def test_each_greedy_step_gives_the_logits_of_a_plain_forward_of_its_row_alone(name, lora_rank, fused, monkeypatch,
                                                                               kind):
    """Prompts of 1 to 7 tokens left-padded together, n=2 greedy samples each, on a random model built here: the
    logits each step's choice is made from are those of one forward of the row's own tokens (no padding, no cache,
    positions 0..L-1), the choice is their argmax, and the rows end at either of the generation_config's EOS ids."""
    kind("auto")
    monkeypatch.setattr(hf, "FUSED_DECODE", fused)
    model = _model(CONFIGS[name]())
    if lora_rank:
        model = _with_adapters(model, lora_rank, 0.2, seed=5).eval()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(6, model.config.vocab_size, (length,), generator=generator).tolist()
               for length in (1, 7, 3, 5)]
    # the first prompt's greedy continuation by plain forwards: its first new token after the first that it has
    # not given before, made the generation_config's second EOS id (the tokenizer's is 2), ends that prompt's rows
    chain = list(prompts[0])
    for _ in range(6):
        with torch.no_grad():
            chain.append(int(model(input_ids=torch.tensor([chain])).logits[0, -1].argmax()))
    continuation = chain[len(prompts[0]):]
    stop = next(i for i in range(1, 6) if continuation[i] not in continuation[:i] and 2 not in continuation[:i + 1])
    ending = continuation[:stop + 1]
    eos_ids, pad = [2, ending[-1]], 0
    model.generation_config.eos_token_id = eos_ids
    tokenizer = type("Tokenizer", (), {"eos_token_id": 2, "pad_token_id": pad})()
    seen = []  # the logits of each step, (rows, V)
    sample = hf.sample_next_token
    monkeypatch.setattr(hf, "sample_next_token", lambda logits, p, g: seen.append(logits.double()) or sample(logits, p, g))
    steps = []
    monkeypatch.setattr(FusedDecoder, "__call__", lambda self, *args: steps.append(1) or FUSED_CALL(self, *args))
    out = make_rollout_engine("hf", model, tokenizer).generate(
        Batch(left_pad(prompts, pad), {}), SamplingParams(n=2, max_new_tokens=10, do_sample=False))

    assert len(steps) == (len(seen) - 1 if fused else 0)
    assert out["responses"][:2, :len(ending)].tolist() == [ending] * 2
    assert out["response_mask"][:2].sum(-1).tolist() == [len(ending)] * 2
    width = max(map(len, prompts))
    for row, response in enumerate(out["responses"].tolist()):
        prompt = prompts[row // 2]
        length = int(out["response_mask"][row].sum())
        assert out["response_mask"][row].tolist() == [1] * length + [0] * (len(response) - length)
        if length < 10:
            assert response[length - 1] in eos_ids and response[length:] == [pad] * (len(response) - length)
        ids = prompt + response[:length]
        real = out["attention_mask"][row].bool()
        assert out["input_ids"][row][real].tolist() == ids
        assert out["position_ids"][row][real].tolist() == list(range(len(ids)))
        with torch.no_grad():
            plain = model(input_ids=torch.tensor([ids[:-1]])).logits[0, -length:].double()  # (length, V)
        got = torch.stack([seen[step][row] for step in range(length)])
        torch.testing.assert_close(got, plain, rtol=0, atol=5e-5, msg=f"row {row}")
        assert response[:length] == plain.argmax(-1).tolist()
        if len(prompt) < width:  # the check can fail: the row with its padding attended to gives other logits
            with torch.no_grad():
                unmasked = model(input_ids=torch.tensor([[pad] * (width - len(prompt)) + prompt])).logits[0, -1]
            assert (unmasked.double() - plain[0]).abs().max() > 1e-2
