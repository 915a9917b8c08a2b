"""The bench scripts: the decode bound of bench/roofline.py and bench/decode.py, worked out by hand on SmolLM2-135M's
shapes (built on the meta device: no weights), bench/vs_trl.py's check for TRL, and the parts bench/update_parts.py
times."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from roofline import Rates, cache_bytes, decode_bound_s, matmul_params, micro_batch_tokens, trainer_config  # noqa: E402

SMOLLM2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def smollm2():
    with torch.device("meta"):
        return LlamaForCausalLM(SMOLLM2)


def test_the_products_and_the_cache_a_decode_step_reads(smollm2):
    # per layer q, o 576 x 576; k, v 576 x 192; gate, up, down 576 x 1536: 3,538,944 a layer, 30 layers
    assert matmul_params(smollm2) == (106_168_320, 49152 * 576)
    # keys and values: 30 layers x 2 x 3 heads x 64 x 4 bytes = 46,080 a position; 16 rows of 104 positions
    assert cache_bytes(smollm2, rows=16, positions=104) == 16 * 104 * 46_080  # 76.7 MB


def test_the_bound_is_the_longer_of_the_bytes_read_and_the_products(smollm2):
    weights = (106_168_320 + 49152 * 576) * 4  # float32 blocks and head: 537,919,488 bytes (the RMS norms not counted)
    rates = Rates(body=400.0, head=400.0)  # GFLOP/s
    read = decode_bound_s(smollm2, rows=16, rates=rates, bandwidth_gbs=28.0)
    assert read == pytest.approx(weights / 28.0 / 1e9)  # 19.2 ms: memory-bound at 16 rows
    with_cache = decode_bound_s(smollm2, rows=16, rates=rates, bandwidth_gbs=28.0, cache_bytes=76_677_120)
    assert with_cache == pytest.approx((weights + 76_677_120) / 28.0 / 1e9)  # 21.95 ms
    products = 2 * 256 * (106_168_320 + 49152 * 576) / 400.0 / 1e9  # 256 rows: 172 ms of products
    assert decode_bound_s(smollm2, rows=256, rates=rates, bandwidth_gbs=28.0) == pytest.approx(products)


def test_a_lora_projection_counts_as_one_weight_of_its_base_shape():
    """The fused decode step multiplies each adapted projection's W + (alpha / r) B A, one weight of W's shape:
    the adapter's factors add no bytes to read and no products (``bench/decode.py --lora-rank``'s bound)."""
    from rlhf_core.models import lora

    config = LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=32, tie_word_embeddings=True)
    model = lora.apply_lora(LlamaForCausalLM(config), 2, 4, "all-linear")
    # a layer: q, o 8 x 8; k, v 8 x 4 (2 KV heads of 2); gate, up, down 8 x 16: 64 + 32 + 32 + 64 + 3 x 128 = 576;
    # the tied LM head 32 x 8 (the rank-2 factors, 256 a layer, are not counted)
    assert matmul_params(model) == (2 * 576, 32 * 8)


def _roofline_config(name: str, *overrides: str):
    return trainer_config(name, Path("model"), Path("work"), Namespace(response=64, overrides=list(overrides)))


def test_each_pass_is_set_against_the_rate_at_its_own_micro_batch():
    # the demo and 25M models: 16 prompts x 4 samples, the updates and the values pass in micro-batches of 64
    # sequences, the log-prob passes in 16; 16,000 tokens in all (250 a sequence): 64 x 250 and 16 x 250
    assert micro_batch_tokens(_roofline_config("random25m"), sequences=64, tokens=16_000) == {
        "update_actor": 16_000, "update_critic": 16_000, "values": 16_000, "old_log_prob": 4_000, "ref": 4_000}
    # SmolLM2's 4 x 4 with the updates in micro-batches of 4 (bench/RESULTS.md, "Smaller micro-batches"): 2,176
    # tokens, 136 a sequence; the updates' and the values pass's at 4 x 136, the log-prob passes' at all 16 rows
    four = _roofline_config("smollm2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                            "critic.ppo_micro_batch_size_per_gpu=4")
    assert micro_batch_tokens(four, sequences=16, tokens=2_176) == {
        "update_actor": 544, "update_critic": 544, "values": 544, "old_log_prob": 2_176, "ref": 2_176}


def test_under_dynamic_batching_a_pass_is_set_against_its_token_cap():
    # the actor's 3,000 tokens; the log-prob passes follow it (their nulls); the critic follows its switch and
    # keeps its own cap (32,768: more than the step's 16,000 tokens, so all of them)
    dynamic = _roofline_config("random25m", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                               "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=3000")
    assert micro_batch_tokens(dynamic, sequences=64, tokens=16_000) == {
        "update_actor": 3_000, "update_critic": 16_000, "values": 16_000, "old_log_prob": 3_000, "ref": 3_000}


def test_vs_trl_stops_before_training_when_trl_is_missing(monkeypatch, capsys):
    """Without TRL (it comes with the bench extra) the side-by-side run must stop at once, not after our
    trainer's minutes of steps, and say how to install it."""
    import importlib.util

    import vs_trl

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("trl", "datasets") else real_find_spec(name, *a))
    monkeypatch.setattr(vs_trl, "run_ours", lambda *a, **k: pytest.fail("our trainer ran before the check"))
    monkeypatch.setattr(sys, "argv", ["vs_trl.py", "--models", "demo"])
    with pytest.raises(SystemExit) as stop:
        vs_trl.main()
    assert stop.value.code == 2
    assert "trl and datasets not installed: `make bench-setup`" in capsys.readouterr().err


def test_update_parts_time_every_product_of_a_block_and_the_pass_s_own_mask():
    """Each part makes the work it stands for: the products part every linear layer of a block (q, k, v, o, gate,
    up, down), forward and both gradients; the attention part the causal mask with the left padding masked as keys
    (a padding query attends to itself alone); the counts a pass makes (two norms a block and the final one)."""
    from update_parts import allowed_keys, parts

    config = LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=32)
    model = LlamaForCausalLM(config)
    calls = parts(model, rows=2, positions=5, padding=2)
    assert {name: count for name, (_, count, _) in calls.items()} == {
        "whole": 1, "products": 3, "lm head": 1, "attention": 3, "rms norms": 7, "silu x up": 3, "rotary": 3}
    calls["products"][0]()
    block = model.model.layers[0]
    linears = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 7 and all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in linears)
    assert all(p.grad is None for p in model.model.layers[1].parameters())
    allowed = allowed_keys(2, 5, 2)
    expected = torch.tensor([[1, 0, 0, 0, 0],   # padding: itself only
                             [0, 1, 0, 0, 0],
                             [0, 0, 1, 0, 0],   # the first real token: itself
                             [0, 0, 1, 1, 0],
                             [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert allowed.shape == (2, 1, 5, 5) and all(torch.equal(row[0], expected) for row in allowed)


def test_each_timed_part_writes_its_gradients_afresh_as_the_whole_pass_does():
    """The whole pass writes each gradient once; a part whose timed calls added to the last call's gradients would
    time an addition the pass never makes. After the warm-up and two timed rounds each gradient is one call's, worked
    out by hand, and every weight a part's backward reaches is among the leaves set to None before its call."""
    from update_parts import _timed, parts

    config = LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=32)
    model = LlamaForCausalLM(config)
    calls = parts(model, rows=2, positions=5, padding=2)
    for fn, _, _ in calls.values():  # the warm-up, untimed, as the script makes it
        fn()
    for _ in range(2):
        for fn, _, leaves in calls.values():
            _timed(fn, leaves)
    # silu(gate) * up under an upstream of ones: d/d up = gate s, d/d gate = up s (1 + gate (1 - s)), s = sigmoid(gate)
    gate, up = calls["silu x up"][2]
    s = torch.sigmoid(gate.detach())
    torch.testing.assert_close(up.grad, gate.detach() * s)
    torch.testing.assert_close(gate.grad, up.detach() * s * (1 + gate.detach() * (1 - s)))
    # the norm's weight scales x / rms(x): under an upstream of ones its gradient is that summed over rows and positions
    norm_in, weight = calls["rms norms"][2]
    x = norm_in.detach()
    normed = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
    torch.testing.assert_close(weight.grad, normed.sum((0, 1)))
    for name, (fn, _, leaves) in calls.items():
        if name == "whole":  # it sets the model's gradients to None itself
            continue
        model.zero_grad(set_to_none=True)
        fn()
        written = {id(p) for p in model.parameters() if p.grad is not None}
        assert written <= {id(leaf) for leaf in leaves}, name  # products, lm head and rms norms reach weights
