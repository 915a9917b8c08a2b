"""Log-probs of given tokens through the LM head in chunks of positions, never the whole logits tensor.

A response's log-probs need ``log_softmax(h @ W.T / T)`` at the sampled tokens only, but the usual
path builds the (positions x vocabulary) fp32 logits, keeps them (and a softmax of the same size)
for the backward pass, and builds their gradient there: for SmolLM2's 49k vocabulary and 1,024
response tokens that is 200 MB per tensor. Here the head runs on ``chunk_size`` positions at a
time; the backward pass recomputes each chunk's logits from the saved hidden states (one more
head matmul) and accumulates the gradients of the hidden states and the head's weight, so the
largest temporary is (chunk_size x vocabulary).

The gradient is the one of ``log_softmax`` gathered at the labels:
``d logp_i / d z_i = onehot(label_i) - softmax(z_i)``, times ``1 / T`` for the temperature.
"""

from __future__ import annotations

import torch

#: positions per chunk: 256 x 49k fp32 is 50 MB
DEFAULT_CHUNK = 256
#: architectures whose logits are exactly ``hidden @ lm_head.weight.T`` (no scaling, soft-capping or bias)
PLAIN_HEADS = frozenset({"llama", "qwen2", "qwen3", "mistral"})


def supports_fused_head(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a transformers causal LM) can take :func:`chunked_head_log_prob`: a plain
    linear head without bias on a decoder it exposes, in an architecture known to apply nothing else."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return (getattr(getattr(model, "config", None), "model_type", None) in PLAIN_HEADS
            and type(head) is torch.nn.Linear and head.bias is None and hasattr(model, "get_decoder"))


class _ChunkedHeadLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                chunk_size: int, with_entropy: bool):
        n, acc = hidden.shape[0], torch.promote_types(hidden.dtype, torch.float32)  # bf16 -> fp32, fp64 stays
        log_prob = hidden.new_empty(n, dtype=acc)
        log_norm = hidden.new_empty(n, dtype=acc)
        entropy = hidden.new_empty(n, dtype=acc) if with_entropy else None
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            logits = (hidden[rows] @ weight.T).to(acc)
            if temperature != 1.0:
                logits /= temperature
            lse = torch.logsumexp(logits, dim=-1)
            log_norm[rows] = lse
            log_prob[rows] = logits.gather(-1, labels[rows, None]).squeeze(-1) - lse
            if with_entropy:  # logsumexp(z) - sum(softmax(z) * z)
                entropy[rows] = lse - (torch.exp(logits - lse[:, None]) * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, labels, log_norm)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        if entropy is None:
            return log_prob, log_prob.new_zeros(0)
        ctx.mark_non_differentiable(entropy)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob: torch.Tensor, _grad_entropy):
        hidden, weight, labels, log_norm = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        acc = log_norm.dtype
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
        temperature = ctx.temperature
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            h = hidden[rows]
            logits = (h @ weight.T).to(acc)
            if temperature != 1.0:
                logits /= temperature
            g = grad_log_prob[rows].to(acc)
            # d/dz of (z[label] - logsumexp(z)), times the incoming gradient: g * (onehot - softmax)
            grad_logits = torch.exp_(logits.sub_(log_norm[rows, None])).mul_(-g[:, None])
            grad_logits.scatter_add_(-1, labels[rows, None], g[:, None])
            if temperature != 1.0:
                grad_logits /= temperature
            grad_logits = grad_logits.to(hidden.dtype)
            if need_hidden:
                grad_hidden[rows] = grad_logits @ weight
            if need_weight:
                grad_weight.addmm_(grad_logits.T.to(acc), h.to(acc))
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def chunked_head_log_prob(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                          chunk_size: int = DEFAULT_CHUNK, with_entropy: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(hidden @ weight.T / temperature)`` at ``labels``, and optionally the entropy of each
    position's distribution (without gradient). Shapes: hidden (..., H), weight (V, H), labels (...) ->
    (...) each, in float32 (float64 for float64 inputs)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    lead = labels.shape
    log_prob, entropy = _ChunkedHeadLogProb.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                                  labels.reshape(-1).long(), float(temperature or 1.0),
                                                  chunk_size, with_entropy)
    return log_prob.reshape(lead), (entropy.reshape(lead) if with_entropy else None)
