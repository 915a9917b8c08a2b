"""The chunked log-prob over given logits and through the LM head (``use_fused_kernels``), against
log_softmax and the entropy computed directly."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.models.fused_head import chunked_head_log_prob, logits_log_prob, supports_fused_head
from rlhf_core.models.loading import load_actor
from rlhf_core.models.toy import random_toy_model


def _inputs(n=12, hidden=8, vocab=30, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    return h, w, labels


def _reference(z, labels):
    """Log-probs at ``labels`` and entropies of the rows of ``z``, straight from the definitions."""
    log_p = torch.log_softmax(z, -1)
    return log_p.gather(-1, labels[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("chunk", [1, 5, 12, 100])
def test_head_log_probs_entropies_and_gradients_match_log_softmax(chunk):
    h, w, labels = _inputs()
    weights = torch.linspace(-1, 2, len(labels), dtype=torch.float64)  # arbitrary upstream gradients
    entropy_weights = torch.linspace(0.5, -1.5, len(labels), dtype=torch.float64)
    expected, expected_entropy = _reference((h @ w.T) / 0.7, labels)
    grads = torch.autograd.grad((expected * weights).sum(), (h, w), retain_graph=True)
    both = torch.autograd.grad((expected * weights + expected_entropy * entropy_weights).sum(), (h, w))

    log_prob, entropy = chunked_head_log_prob(h, w, labels, temperature=0.7, chunk_size=chunk, with_entropy=True)
    torch.testing.assert_close(log_prob, expected)
    torch.testing.assert_close(entropy, expected_entropy)
    for got, want in zip(torch.autograd.grad((log_prob * weights).sum(), (h, w), retain_graph=True), grads):
        torch.testing.assert_close(got, want)
    for got, want in zip(torch.autograd.grad((log_prob * weights + entropy * entropy_weights).sum(), (h, w)), both):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("chunk", [1, 5, 12, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logits_log_probs_entropies_and_gradients_match_log_softmax(chunk, temperature):
    g = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(3, 4, 30, generator=g, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, 30, (3, 4), generator=g)
    weights = torch.randn(3, 4, generator=g, dtype=torch.float64)
    entropy_weights = torch.randn(3, 4, generator=g, dtype=torch.float64)
    flat = (logits / temperature).reshape(-1, 30)
    expected, expected_entropy = (t.reshape(3, 4) for t in _reference(flat, labels.reshape(-1)))

    log_prob, entropy = logits_log_prob(logits, labels, temperature, chunk_size=chunk, with_entropy=True)
    torch.testing.assert_close(log_prob, expected)
    torch.testing.assert_close(entropy, expected_entropy)
    for upstream in ((weights, None), (None, entropy_weights), (weights, entropy_weights)):
        def total(lp, ent, upstream=upstream):
            return sum((t * u).sum() for t, u in zip((lp, ent), upstream) if u is not None)
        want, = torch.autograd.grad(total(expected, expected_entropy), logits, retain_graph=True)
        got, = torch.autograd.grad(total(log_prob, entropy), logits, retain_graph=True)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_overwriting_the_logits_gives_the_same_gradients_in_their_storage(temperature, dtype):
    h, w, labels = _inputs(n=10, hidden=6, vocab=40, dtype=dtype, seed=3)
    upstream = torch.linspace(-1, 2, len(labels), dtype=dtype), torch.linspace(0.5, -1.5, len(labels), dtype=dtype)
    expected, expected_entropy = _reference((h @ w.T) / temperature, labels)
    want = torch.autograd.grad((expected * upstream[0] + expected_entropy * upstream[1]).sum(), (h, w))

    logits = h @ w.T
    seen = []
    logits.register_hook(lambda grad: seen.append(grad))
    log_prob, entropy = logits_log_prob(logits, labels, temperature, chunk_size=3, with_entropy=True, overwrite=True)
    total = (log_prob * upstream[0] + entropy * upstream[1]).sum()
    got = torch.autograd.grad(total, (h, w), retain_graph=True)
    for g, expect in zip(got, want):
        torch.testing.assert_close(g, expect)
    assert seen[0].data_ptr() == logits.data_ptr()  # the gradient took the logits' storage
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(total, (h, w))  # the logits are gone: a second backward must not use them


def test_logits_log_prob_in_bf16_is_computed_in_float32():
    g = torch.Generator().manual_seed(2)
    logits = (4 * torch.randn(5, 200, generator=g)).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 200, (5,), generator=g)
    log_prob, _ = logits_log_prob(logits, labels, chunk_size=2)
    assert log_prob.dtype == torch.float32
    expected, _ = _reference(logits.double(), labels)
    torch.testing.assert_close(log_prob.double(), expected, atol=1e-5, rtol=0)  # bf16 inputs, fp32 arithmetic
    log_prob.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    want, = torch.autograd.grad(expected.sum(), logits)
    torch.testing.assert_close(logits.grad.float(), want.float(), atol=1e-2, rtol=0)


def test_float32_logits_far_beyond_exps_range_give_finite_log_probs_and_entropies():
    """fp32 ``exp`` overflows past 88 and underflows to 0 below -103: logits of a few hundred after the
    temperature (as a sharp policy at a low temperature gives) are only safe with the row's maximum taken out."""
    g = torch.Generator().manual_seed(4)
    logits = 40 * torch.randn(6, 50, generator=g)  # / 0.5: |z / T| up to about 250
    logits[:, 0] = logits.amax(-1) - 0.3  # a runner-up close to each row's top: entropies well above 0
    labels = torch.randint(0, 50, (6,), generator=g)
    labels[:2] = 0
    assert (logits / 0.5).abs().max() > 100
    expected, expected_entropy = _reference(logits.double() / 0.5, labels)
    # hidden @ identity.T is the logits themselves, exactly: the head path sees the same numbers
    through_head = chunked_head_log_prob(logits, torch.eye(50), labels, temperature=0.5, chunk_size=4,
                                         with_entropy=True)
    for log_prob, entropy in (logits_log_prob(logits, labels, 0.5, chunk_size=4, with_entropy=True), through_head):
        assert bool(log_prob.isfinite().all()) and bool(entropy.isfinite().all())
        torch.testing.assert_close(log_prob.double(), expected, atol=1e-4, rtol=0)
        torch.testing.assert_close(entropy.double(), expected_entropy, atol=1e-4, rtol=0)


def test_gradcheck_and_batch_shapes():
    h, w, labels = _inputs(n=6, hidden=4, vocab=7)
    assert torch.autograd.gradcheck(lambda a, b: chunked_head_log_prob(a, b, labels, 1.3, 4, True), (h, w))
    z = (h @ w.T).detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: logits_log_prob(x, labels, 1.3, 4, True), (z,))
    # (bs, T, H) hidden and (bs, T) labels come back as (bs, T), in float32 for float32 inputs
    h32, w32 = h.detach().float().reshape(2, 3, 4), w.detach().float()
    log_prob, entropy = chunked_head_log_prob(h32, w32, labels.reshape(2, 3))
    assert log_prob.shape == (2, 3) and log_prob.dtype == torch.float32 and entropy is None
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_head_log_prob(h32, w32, labels.reshape(2, 3), chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        logits_log_prob(h32, labels.reshape(2, 3), chunk_size=0)


def test_only_plain_heads_are_fused(tmp_path):
    model = load_actor(random_toy_model(tmp_path / "m", n_layers=1, hidden_size=16, seed=0))
    assert supports_fused_head(model)  # Llama
    model.config.model_type = "gemma2"  # an architecture that soft-caps its logits
    assert not supports_fused_head(model)
