"""Linear layers routed to oneDNN on CPU (``trainer.cpu_matmul``): the same values and gradients as the
float64 products written out here, the plain path where oneDNN does not apply, and models that load, copy,
take LoRA adapters and train as before."""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from rlhf_core.batch import Batch
from rlhf_core.config import ConfigError, load_config
from rlhf_core.data.dataset import left_pad
from rlhf_core.models import cpu_matmul, lora
from rlhf_core.models.loading import load_actor, load_tokenizer
from rlhf_core.models.toy import random_toy_model
from rlhf_core.rollout import SamplingParams, hf, make_rollout_engine

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason="this torch build has no oneDNN linear op")


@pytest.fixture
def onednn_calls(monkeypatch):
    """How many products went through oneDNN."""
    calls = []
    real = cpu_matmul.onednn_linear

    def counting(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(cpu_matmul, "onednn_linear", counting)
    return calls


@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_are_the_products_in_float64(bias, kind, onednn_calls):
    kind("onednn")
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 20, bias=bias)
    weight, b = layer.weight.detach().double(), (layer.bias.detach().double() if bias else None)
    assert cpu_matmul.route(layer) == 1
    x = torch.randn(3, 7, 48, requires_grad=True)
    upstream = torch.randn(3, 7, 20)
    out = layer(x)
    out.backward(upstream)
    assert len(onednn_calls) == 3  # forward, input gradient, weight gradient

    x64, g64 = x.detach().double().reshape(21, 48), upstream.double().reshape(21, 20)
    expected = x64 @ weight.T + (b if bias else 0)
    torch.testing.assert_close(out.double().reshape(21, 20), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double().reshape(21, 48), g64 @ weight, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad.double(), g64.T @ x64, rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(layer.bias.grad.double(), g64.sum(0), rtol=1e-5, atol=1e-5)
    assert out.shape == (3, 7, 20) and x.grad.shape == x.shape


def test_blas_and_the_inputs_oneDNN_does_not_take_run_the_plain_linear(kind, onednn_calls):
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    plain = copy.deepcopy(layer)
    cpu_matmul.route(layer)
    x = torch.randn(5, 16)
    kind("blas")
    assert torch.equal(layer(x), plain(x))  # the same kernel: equal to the bit
    kind("onednn")
    assert layer(torch.randn(0, 16)).shape == (0, 8)  # no rows
    half = copy.deepcopy(layer).to(torch.bfloat16)
    assert torch.equal(half(x.bfloat16()), F.linear(x.bfloat16(), half.weight, half.bias))
    assert onednn_calls == []
    layer(x)
    assert len(onednn_calls) == 1


def test_a_routed_model_loads_copies_takes_lora_and_trains_as_the_plain_one(tmp_path, kind, onednn_calls):
    kind("onednn")
    path = random_toy_model(tmp_path / "model", n_layers=2, hidden_size=64, seed=0)
    model = load_actor(path)  # routed at load
    kind("blas")
    plain = load_actor(path)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is cpu_matmul.RoutedLinear for m in linears)
    assert list(model.state_dict()) == list(plain.state_dict())

    ids = torch.randint(3, 40, (4, 12))

    def loss_and_grads(m):
        m.zero_grad()
        loss = m(input_ids=ids, use_cache=False).logits.logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters()]

    kind("onednn")
    loss, grads = loss_and_grads(model)
    assert len(onednn_calls) == 3 * len(linears)
    kind("blas")
    plain_loss, plain_grads = loss_and_grads(plain)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-6)
    for grad, plain_grad in zip(grads, plain_grads):
        torch.testing.assert_close(grad, plain_grad, rtol=1e-4, atol=1e-6)

    kind("onednn")
    assert type(copy.deepcopy(model).lm_head) is cpu_matmul.RoutedLinear  # the reference is a deep copy
    adapted = lora.apply_lora(model, rank=4, alpha=8, target_modules="all-linear")
    adapted.train()
    out = adapted(input_ids=ids, use_cache=False).logits.logsumexp(-1).mean()
    out.backward()
    lora_grads = [p.grad for n, p in adapted.named_parameters() if "lora_A" in n]
    assert lora_grads and all(g is not None for g in lora_grads)


def test_the_key_takes_auto_by_default_and_the_two_kernels():
    assert load_config([]).trainer.cpu_matmul == "auto"
    assert load_config(["trainer.cpu_matmul=blas"]).trainer.cpu_matmul == "blas"
    with pytest.raises(ConfigError, match="trainer.cpu_matmul"):
        load_config(["trainer.cpu_matmul=mkl"])
    with pytest.raises(ValueError, match="trainer.cpu_matmul"):
        cpu_matmul.configure("mkl")


@pytest.mark.parametrize(("capability", "vendor", "training", "decoding"), [
    ("AVX512", "AuthenticAMD", "onednn", "onednn"), ("AVX512_BF16", "AuthenticAMD", "onednn", "onednn"),
    ("AVX512", "GenuineIntel", "blas", "mkl"), ("AVX2", "GenuineIntel", "blas", "mkl"),
    ("AVX512", "", "blas", "onednn"), ("AVX2", "AuthenticAMD", "blas", "onednn"),
    ("DEFAULT", "AuthenticAMD", "blas", "onednn")])
def test_auto_trains_on_oneDNN_on_AMD_with_AVX512_only_and_decodes_on_MKL_packed_weights_on_Intel(
        capability, vendor, training, decoding, kind, onednn_calls, monkeypatch):
    if decoding == "mkl" and not cpu_matmul.mkl_available():
        pytest.skip("this torch build has no MKL packed sgemm")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(cpu_matmul, "cpu_vendor", lambda: vendor)
    kind("auto")
    assert cpu_matmul.current() == "auto" and cpu_matmul.training_kernel() == training
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    cpu_matmul.route(layer)
    x = torch.randn(5, 16, requires_grad=True)
    layer(x).sum().backward()
    assert len(onednn_calls) == (3 if training == "onednn" else 0)  # forward and both gradients, or none
    torch.testing.assert_close(layer.weight.grad, torch.ones(5, 8).T @ x.detach())
    onednn_calls.clear()
    with torch.no_grad(), cpu_matmul.packed_weights(layer, rows=5):
        if decoding == "mkl":
            assert isinstance(layer.packed_weight, cpu_matmul.MKLPacked)
        else:
            assert layer.packed_weight.is_mkldnn
        out = layer(x)
    torch.testing.assert_close(out.double(), x.detach().double() @ layer.weight.detach().double().T
                               + layer.bias.detach().double(), rtol=1e-5, atol=1e-5)
    assert len(onednn_calls) == (1 if decoding == "onednn" else 0) and layer.packed_weight is None
    kind("onednn")  # a kernel named outright packs for oneDNN on any CPU
    with torch.no_grad(), cpu_matmul.packed_weights(layer, rows=5):
        assert layer.packed_weight.is_mkldnn


@pytest.mark.skipif(not cpu_matmul.mkl_available(), reason="this torch build has no MKL packed sgemm")
@pytest.mark.parametrize("bias", [True, False])
def test_mkl_packed_products_are_the_products_in_float64_at_every_row_count_they_may_take(
        bias, kind, monkeypatch):
    monkeypatch.setattr(cpu_matmul, "cpu_vendor", lambda: "GenuineIntel")
    kind("auto")
    torch.manual_seed(0)
    weight, b = torch.randn(24, 40), (torch.randn(24) if bias else None)
    exact = lambda x: x.double() @ weight.double().T + (b.double() if bias else 0)  # noqa: E731
    own = cpu_matmul.decode_weight(weight, rows=6, in_block=False, persistent=True)
    stacked = cpu_matmul.decode_weight(weight.clone(), rows=6, in_block=False)  # a copy made for the packing
    assert isinstance(own, cpu_matmul.MKLPacked) and own.original is not None and stacked.original is None
    assert own.dtype == torch.float32 and own.shape == (24, 40)
    for rows in (6, 3, 11):
        x = torch.randn(rows, 40)
        torch.testing.assert_close(cpu_matmul.decode_product(x, own, b).double(), exact(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(6, 40)
    torch.testing.assert_close(cpu_matmul.decode_product(x, stacked, b).double(), exact(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="packed for products of 6 rows, not 3"):
        cpu_matmul.decode_product(torch.randn(3, 40), stacked, b)


@pytest.mark.skipif(not cpu_matmul.mkl_available(), reason="this torch build has no MKL packed sgemm")
@pytest.mark.skipif(not cpu_matmul.onednn_packs_bfloat16(),
                    reason="oneDNN lays out bfloat16 weights only with AVX-NE-CONVERT or AVX-512 BW/VL/DQ")
def test_on_intel_bfloat16_block_weights_stay_on_oneDNN_while_the_head_packs_for_MKL(kind, monkeypatch):
    """MKL packs no bfloat16: only the float32 products take its layout."""
    monkeypatch.setattr(cpu_matmul, "cpu_vendor", lambda: "GenuineIntel")
    kind("auto", "bfloat16")
    weight = torch.randn(24, 40)
    block = cpu_matmul.decode_weight(weight, rows=4, in_block=True)
    head = cpu_matmul.decode_weight(weight, rows=4, in_block=False)
    assert block.is_mkldnn and block.dtype == torch.bfloat16
    assert isinstance(head, cpu_matmul.MKLPacked)


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_without_onednn_bfloat16_support_block_weights_stay_plain_bfloat16(kind, monkeypatch, vendor):
    """On an AVX2-only CPU oneDNN refuses to lay out bfloat16 weights: the decode copy is a plain bfloat16 tensor
    whose products are those of the rounded operands, and the float32 head is packed as before."""
    monkeypatch.setattr(cpu_matmul, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(cpu_matmul, "onednn_packs_bfloat16", lambda: False)
    kind("auto", "bfloat16")
    weight, x = torch.randn(24, 40), torch.randn(4, 40)
    block = cpu_matmul.decode_weight(weight, rows=4, in_block=True)
    head = cpu_matmul.decode_weight(weight, rows=4, in_block=False)
    assert type(block) is torch.Tensor and not block.is_mkldnn and block.dtype == torch.bfloat16
    assert block.is_contiguous() and torch.equal(block, weight.bfloat16())
    expected = (x.bfloat16().double() @ weight.bfloat16().double().T)  # the rounded operands' exact products
    out = cpu_matmul.decode_product(x, block)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), expected, rtol=2**-7, atol=1e-2)
    assert not torch.allclose(out, x @ weight.T, rtol=1e-5, atol=1e-5)  # bfloat16's rounding shows
    if vendor == "GenuineIntel":
        assert isinstance(head, cpu_matmul.MKLPacked)
    else:
        assert head.is_mkldnn and head.dtype == torch.float32
    kind("blas")  # nothing packed at all
    plain = cpu_matmul.decode_weight(weight, rows=4, in_block=False)
    assert type(plain) is torch.Tensor and not plain.is_mkldnn


@pytest.mark.parametrize(("flags", "native", "onednn_bf16"), [
    ("fpu avx2 avx512f avx512bw avx512vl avx512dq amx_bf16 amx_tile", True, True),
    ("fpu avx2 avx512f avx512_bf16", True, False),  # AVX-512 without BW/VL/DQ: no oneDNN bfloat16 layout
    ("fpu avx2 fma avx_ne_convert", False, True), ("fpu avx2 fma", False, False)])
def test_the_cpu_vendor_and_bfloat16_support_are_read_from_cpuinfo(monkeypatch, tmp_path, flags, native, onednn_bf16):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(info if path == "/proc/cpuinfo" else path, *a, **k))
    cpu_matmul._cpuinfo.cache_clear()
    try:
        assert cpu_matmul.cpu_vendor() == "AuthenticAMD"
        assert cpu_matmul.native_bf16() is native
        assert cpu_matmul.onednn_packs_bfloat16() is onednn_bf16
    finally:
        cpu_matmul._cpuinfo.cache_clear()


def test_importing_the_package_leaves_the_allocator_environment_alone():
    """Huge pages for torch's tensors (THP_MEM_ALLOC_ENABLE) are the environment's choice, not the package's."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", "import os, rlhf_core; print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


def test_packed_weights_give_the_same_products_and_are_dropped_on_exit(kind, onednn_calls):
    kind("onednn")
    torch.manual_seed(0)
    layer = torch.nn.Linear(40, 24)
    cpu_matmul.route(layer)
    decode, prompt = torch.randn(6, 40), torch.randn(2, 9, 40)
    with torch.no_grad():
        expected = layer(decode), layer(prompt)
        with pytest.raises(RuntimeError, match="inside"), cpu_matmul.packed_weights(layer, rows=6):
            assert layer.packed_weight is not None and layer.packed_weight.is_mkldnn
            got = layer(decode), layer(prompt)  # the decode rows it was packed for, and another count
            raise RuntimeError("inside")
    assert layer.packed_weight is None  # dropped, even on an error
    assert all(torch.equal(g, e) for g, e in zip(got, expected))  # the same kernel on another layout
    assert len(onednn_calls) == 4

    with cpu_matmul.packed_weights(layer, rows=6):  # with gradients the parameter itself is used
        x = torch.randn(3, 40, requires_grad=True)
        layer(x).sum().backward()
    torch.testing.assert_close(layer.weight.grad, torch.ones(3, 24).T @ x.detach())
    kind("blas")
    with cpu_matmul.packed_weights(layer, rows=6):
        assert layer.packed_weight is None


def test_the_rollout_decodes_on_packed_weights_and_samples_as_without(tmp_path, kind, monkeypatch):
    """The model's own layers in the decode steps (a model the fused step does not take)."""
    kind("onednn")
    monkeypatch.setattr(hf, "FUSED_DECODE", False)
    path = random_toy_model(tmp_path / "model", n_layers=1, hidden_size=32, seed=3)
    model, tokenizer = load_actor(path), load_tokenizer(path)
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ["ab", "cde"]]
    prompts = Batch(left_pad(ids, tokenizer.pad_token_id), {})
    params = SamplingParams(n=2, max_new_tokens=8, ignore_eos=True)
    packed_rows = []
    real = cpu_matmul.onednn_linear

    def spying(input, weight, bias=None):
        if weight.is_mkldnn:
            packed_rows.append(input.shape[0])
        return real(input, weight, bias)

    monkeypatch.setattr(cpu_matmul, "onednn_linear", spying)
    packed = make_rollout_engine("hf", model, tokenizer, seed=4).generate(prompts, params)
    layers = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
    # the prompt pass (2 prompts x 3 columns; the LM head on each prompt's last position only), then 7 decode
    # steps of 4 rows through every layer
    assert packed_rows == [2 * 3] * (layers - 1) + [2] + [4] * (7 * layers)
    monkeypatch.setattr(hf.cpu_matmul, "packed_weights", lambda module, rows: contextlib.nullcontext())
    plain = make_rollout_engine("hf", model, tokenizer, seed=4).generate(prompts, params)
    assert torch.equal(packed["responses"], plain["responses"])


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bfloat16, held in float64."""
    return t.detach().to(torch.bfloat16).double()


def test_bfloat16_products_are_the_products_of_the_rounded_operands_with_float32_gradients(kind, onednn_calls):
    kind("auto", "bfloat16")
    assert cpu_matmul.product_dtype() == torch.bfloat16
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32)
    cpu_matmul.route(layer)
    layer.in_block = True  # a layer alone is in no block; inside one it multiplies in bfloat16
    x = torch.randn(4, 5, 64, requires_grad=True)
    upstream = torch.randn(4, 5, 32)
    out = layer(x)
    out.backward(upstream)
    assert onednn_calls == [] and out.dtype == x.grad.dtype == layer.weight.grad.dtype == torch.float32

    x64, g64, w64 = x.detach().double().reshape(20, 64), upstream.double().reshape(20, 32), layer.weight.detach().double()
    exact = x64 @ w64.T + layer.bias.detach().double()
    rounded = _bf16(x64) @ _bf16(w64).T + layer.bias.detach().double()
    got = out.detach().double().reshape(20, 32)
    scale = exact.abs().max()
    # the products of the bfloat16-rounded operands, to the rounding of a bfloat16 result (2^-8 relative) ...
    assert (got - rounded).abs().max() <= 2 ** -8 * rounded.abs().max()
    # ... and not float32's: bfloat16 rounding of the operands shows at this size
    assert (got - exact).abs().max() > 1e-4 * scale
    # the gradients likewise: products of the rounded operands, not float32's
    for grad, rounded, exact in ((x.grad.double().reshape(20, 64), _bf16(g64) @ _bf16(w64), g64 @ w64),
                                 (layer.weight.grad.double(), _bf16(g64).T @ _bf16(x64), g64.T @ x64)):
        assert (grad - rounded).abs().max() <= 2 ** -8 * rounded.abs().max()
        assert (grad - exact).abs().max() > 1e-4 * exact.abs().max()
    torch.testing.assert_close(layer.bias.grad.double(), g64.sum(0), rtol=1e-6, atol=1e-6)  # float32, not rounded


@pytest.mark.parametrize("onednn_layout", [True, False])
def test_bfloat16_decode_products_add_the_bias(kind, monkeypatch, onednn_layout):
    """Qwen2's query, key and value layers have biases: the bfloat16 decode product adds them, on oneDNN's layout
    and on the plain bfloat16 copy a CPU without it gets."""
    if onednn_layout and not cpu_matmul.onednn_packs_bfloat16():
        pytest.skip("oneDNN lays out bfloat16 weights only with AVX-NE-CONVERT or AVX-512 BW/VL/DQ")
    if not onednn_layout:
        monkeypatch.setattr(cpu_matmul, "onednn_packs_bfloat16", lambda: False)
    kind("onednn", "bfloat16")
    torch.manual_seed(0)
    layer = torch.nn.Linear(40, 24)
    cpu_matmul.route(layer)
    layer.in_block = True
    x = torch.randn(6, 40)
    expected = _bf16(x) @ _bf16(layer.weight).T + layer.bias.detach().double()
    with torch.no_grad(), cpu_matmul.packed_weights(layer, rows=6):
        weight = layer.packed_weight
        assert weight.dtype == torch.bfloat16 and weight.is_mkldnn is onednn_layout
        got = layer(x).double()
    # the rounded operands' products plus the bias, to the rounding of a bfloat16 result (2^-8 relative)
    assert (got - expected).abs().max() <= 2 ** -8 * expected.abs().max()


def test_bfloat16_stays_inside_the_blocks_and_in_packed_decode_weights(tmp_path, kind):
    path = random_toy_model(tmp_path / "model", n_layers=2, hidden_size=64, seed=0)
    kind("auto", "bfloat16")
    model = load_actor(path)
    routed = {name: m for name, m in model.named_modules() if type(m) is cpu_matmul.RoutedLinear}
    assert not routed["lm_head"].in_block
    assert all(m.in_block for name, m in routed.items() if name != "lm_head") and len(routed) > 1
    ids = torch.randint(3, 40, (3, 10))
    with torch.no_grad():
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        assert torch.equal(model.lm_head(hidden), F.linear(hidden, model.lm_head.weight))  # the head in float32
        with cpu_matmul.packed_weights(model, rows=3):
            assert routed["lm_head"].packed_weight.dtype == torch.float32
            assert all(m.packed_weight.dtype == torch.bfloat16 for n, m in routed.items() if n != "lm_head")
            packed = model(input_ids=ids, use_cache=False).logits
        unpacked = model(input_ids=ids, use_cache=False).logits
        kind("auto", "float32")
        full = model(input_ids=ids, use_cache=False).logits
    # packed and unpacked bfloat16 products agree to bfloat16's rounding, and both differ from float32
    torch.testing.assert_close(packed, unpacked, rtol=2e-2, atol=2e-2)
    assert (unpacked - full).abs().max() > 1e-5


def test_the_product_dtype_key(kind):
    assert load_config([]).trainer.cpu_matmul_dtype == "float32"
    assert load_config(["trainer.cpu_matmul_dtype=bfloat16"]).trainer.cpu_matmul_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="trainer.cpu_matmul_dtype"):
        load_config(["trainer.cpu_matmul_dtype=float16"])
    with pytest.raises(ValueError, match="trainer.cpu_matmul_dtype"):
        cpu_matmul.configure("auto", "float16")


@pytest.mark.parametrize("fused", [True, False])
def test_the_bfloat16_weight_is_cast_again_after_each_change_of_the_weight(kind, fused):
    kind("auto", "bfloat16")
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 16)
    cpu_matmul.route(layer)
    layer.in_block = True
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, fused=fused)
    x = torch.randn(6, 32)

    def expected():  # the product of the weight as it is now, rounded to bfloat16
        return (x.bfloat16() @ layer.weight.detach().bfloat16().T).float() + layer.bias.detach()

    for _ in range(3):
        out = layer(x)
        torch.testing.assert_close(out.detach(), expected(), rtol=1e-2, atol=1e-2)
        out.square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    layer(x)
    first = layer._low[1]
    layer(x)
    assert layer._low[1] is first  # unchanged weight: the same copy
    with torch.no_grad():
        layer.weight.mul_(-1.0)  # any in-place change
    torch.testing.assert_close(layer(x).detach(), expected(), rtol=1e-2, atol=1e-2)
    layer.load_state_dict({"weight": torch.zeros(16, 32), "bias": torch.zeros(16)})
    assert torch.equal(layer(x), torch.zeros(6, 16))


def test_sharded_bfloat16_layers_cast_at_each_call_and_keep_no_copy(kind, monkeypatch):
    """Under a process group (FSDP2 gathers each weight into its own buffer before a forward, and a load writes the
    shards), a kept copy could go stale unseen: the layer casts its weight at every call instead."""
    kind("auto", "bfloat16")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 16)
    cpu_matmul.route(layer)
    layer.in_block = True
    x = torch.randn(6, 32)
    expected = (x.bfloat16() @ layer.weight.detach().bfloat16().T).float() + layer.bias.detach()
    torch.testing.assert_close(layer(x).detach(), expected, rtol=1e-2, atol=1e-2)
    assert layer._low is None
