"""The workers' AdamW: the fused kernel where the device has one, and the textbook update either way."""

from __future__ import annotations

import math

import torch

from rlhf_core.config import OptimConfig
from rlhf_core.workers.common import build_optimizer


def _adamw_by_hand(values: list[torch.Tensor], grads: list[list[torch.Tensor]], lr: float, betas, wd: float,
                   eps: float = 1e-8) -> list[torch.Tensor]:
    """Loshchilov & Hutter's AdamW written out in float64: decoupled decay, then the bias-corrected step."""
    b1, b2 = betas
    out = []
    for value, steps in zip(values, grads):
        p = value.double().clone()
        m = torch.zeros_like(p)
        v = torch.zeros_like(p)
        for t, g in enumerate(steps, start=1):
            g = g.double()
            p = p * (1 - lr * wd)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            m_hat = m / (1 - b1**t)
            v_hat = v / (1 - b2**t)
            p = p - lr * m_hat / (v_hat.sqrt() + eps)
        out.append(p)
    return out


def test_cpu_parameters_get_the_fused_step_and_it_is_adamw():
    torch.manual_seed(0)
    optim = OptimConfig(lr=1e-2, betas=[0.9, 0.95], weight_decay=0.1)
    params = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(3))]
    start = [p.detach().clone() for p in params]
    grads = [[torch.randn_like(p) for _ in range(4)] for p in params]
    optimizer = build_optimizer(params, optim)
    assert optimizer.defaults["fused"] is True
    for step in range(4):
        for p, g in zip(params, grads):
            p.grad = g[step].clone()
        optimizer.step()
    expected = _adamw_by_hand(start, grads, 1e-2, (0.9, 0.95), 0.1)
    for p, want in zip(params, expected):
        torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-6)
    # four steps of lr 1e-2 move a weight by up to about 4e-2: the check above is not vacuous
    assert max(float((p.detach().double() - s.double()).abs().max()) for p, s in zip(params, start)) > 1e-2


def test_parameters_without_a_fused_kernel_fall_back_to_the_plain_step():
    params = [torch.nn.Parameter(torch.zeros(4, device="meta"))]
    optimizer = build_optimizer(params, OptimConfig(lr=1e-3))
    assert not optimizer.defaults["fused"]


def test_state_of_the_plain_step_loads_into_the_fused_one():
    """A checkpoint written by the per-parameter AdamW resumes under the fused one, to the same weights."""
    torch.manual_seed(1)
    optim = OptimConfig(lr=5e-3, betas=[0.9, 0.999], weight_decay=0.01)
    weights = torch.randn(6, 4)
    grads = [torch.randn(6, 4) for _ in range(3)]
    plain_param = torch.nn.Parameter(weights.clone())
    plain = torch.optim.AdamW([plain_param], lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)
    for g in grads[:2]:
        plain_param.grad = g.clone()
        plain.step()
    resumed_param = torch.nn.Parameter(plain_param.detach().clone())
    resumed = build_optimizer([resumed_param], optim)
    resumed.load_state_dict(plain.state_dict())
    resumed_param.grad = grads[2].clone()
    resumed.step()
    want = _adamw_by_hand([weights], [grads], optim.lr, (0.9, 0.999), optim.weight_decay)[0]
    torch.testing.assert_close(resumed_param.detach().double(), want, rtol=1e-5, atol=1e-6)
    assert math.isclose(float(resumed.state[resumed_param]["step"]), 3.0)
