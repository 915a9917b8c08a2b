"""The chunked LM-head log-prob (``use_fused_kernels``) against log_softmax computed directly."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.models.fused_head import chunked_head_log_prob, supports_fused_head
from rlhf_core.models.loading import load_actor
from rlhf_core.models.toy import random_toy_model


def _inputs(n=12, hidden=8, vocab=30, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    return h, w, labels


@pytest.mark.parametrize("chunk", [1, 5, 12, 100])
def test_log_probs_entropies_and_gradients_match_log_softmax(chunk):
    h, w, labels = _inputs()
    weights = torch.linspace(-1, 2, len(labels), dtype=torch.float64)  # an arbitrary upstream gradient
    z = (h @ w.T) / 0.7
    expected = torch.log_softmax(z, -1).gather(-1, labels[:, None]).squeeze(-1)
    p = torch.softmax(z, -1)
    expected_entropy = -(p * torch.log(p)).sum(-1)
    grad_h, grad_w = torch.autograd.grad((expected * weights).sum(), (h, w))

    log_prob, entropy = chunked_head_log_prob(h, w, labels, temperature=0.7, chunk_size=chunk, with_entropy=True)
    torch.testing.assert_close(log_prob, expected)
    torch.testing.assert_close(entropy, expected_entropy.detach())
    assert not entropy.requires_grad
    got_h, got_w = torch.autograd.grad((log_prob * weights).sum(), (h, w))
    torch.testing.assert_close(got_h, grad_h)
    torch.testing.assert_close(got_w, grad_w)


def test_gradcheck_and_batch_shapes():
    h, w, labels = _inputs(n=6, hidden=4, vocab=7)
    assert torch.autograd.gradcheck(lambda a, b: chunked_head_log_prob(a, b, labels, 1.3, 4)[0], (h, w))
    # (bs, T, H) hidden and (bs, T) labels come back as (bs, T), in float32 for float32 inputs
    h32, w32 = h.detach().float().reshape(2, 3, 4), w.detach().float()
    log_prob, entropy = chunked_head_log_prob(h32, w32, labels.reshape(2, 3))
    assert log_prob.shape == (2, 3) and log_prob.dtype == torch.float32 and entropy is None
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_head_log_prob(h32, w32, labels.reshape(2, 3), chunk_size=0)


def test_only_plain_heads_are_fused(tmp_path):
    model = load_actor(random_toy_model(tmp_path / "m", n_layers=1, hidden_size=16, seed=0))
    assert supports_fused_head(model)  # Llama
    model.config.model_type = "gemma2"  # an architecture that soft-caps its logits
    assert not supports_fused_head(model)
