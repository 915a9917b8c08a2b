"""Log-probs (and entropies) of given tokens, a chunk of positions at a time.

A response's log-probs need ``log_softmax(z / T)`` at the sampled tokens only, with ``z = h @ W.T``
the (positions x vocabulary) logits: for SmolLM2's 49k vocabulary and 1,024 response tokens, 200 MB
in fp32. Done whole, the log-softmax, the gather, the entropy metric and their backward passes each
go over tensors of that size several times, and each pass, with its allocation, runs at memory speed.

- :func:`logits_log_prob` takes the logits as the model built them and does that work ``LOGITS_CHUNK``
  positions at a time, in buffers that stay in cache; its backward pass writes the logits' gradient
  chunk by chunk, over the logits themselves where the caller gives them up (``overwrite``: the actor
  does for a plain linear head). It is the actor's default: on the 2-core CPU 0.56-0.66x the time and
  less than half the memory of the whole-tensor path for the SmolLM2 head (``bench/fused_head.py``).
- :func:`chunked_head_log_prob` (``use_fused_kernels``) runs the LM head itself on ``chunk_size``
  positions at a time, so that the logits are never built whole; the backward pass recomputes each
  chunk's logits from the saved hidden states (one more head matmul) and accumulates the gradients of
  the hidden states and the head's weight. The least memory, at the cost of that matmul.

With ``p = softmax(z)``, ``d log p_label / dz = onehot(label) - p`` and
``d entropy / dz = -p * (log p + entropy)``, times ``1 / T`` for the temperature.
"""

from __future__ import annotations

import torch

from rlhf_core.models import cpu_matmul

#: positions per chunk through the head: 256 x 49k fp32 is 50 MB
DEFAULT_CHUNK = 256
#: positions per chunk of given logits: 16 x 49k fp32 is 3 MB, so that a chunk's passes stay in cache
LOGITS_CHUNK = 16
#: architectures whose logits are exactly ``hidden @ lm_head.weight.T`` (no scaling, soft-capping or bias)
PLAIN_HEADS = frozenset({"llama", "qwen2", "qwen3", "mistral"})


def plain_score_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The scalar head (``score``) of a transformers token- or sequence-classification model where its
    output is known to be exactly ``head(decoder output)`` at each position (a plain architecture, dropout
    0): a critic's values, a reward model's per-token scores; else None."""
    if getattr(getattr(model, "config", None), "model_type", None) not in PLAIN_HEADS:
        return None
    return getattr(model, "score", None)


def supports_fused_head(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a transformers causal LM) can take :func:`chunked_head_log_prob`: a plain
    linear head without bias on a decoder it exposes, in an architecture known to apply nothing else."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return (getattr(getattr(model, "config", None), "model_type", None) in PLAIN_HEADS
            and type(head) in (torch.nn.Linear, cpu_matmul.RoutedLinear) and head.bias is None
            and hasattr(model, "get_decoder"))


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # bf16/fp16 -> fp32, fp64 stays


def _scaled(logits: torch.Tensor, acc: torch.dtype, temperature: float) -> torch.Tensor:
    logits = logits.to(acc)
    return logits / temperature if temperature != 1.0 else logits


def _chunk_forward(z: torch.Tensor, labels: torch.Tensor, with_entropy: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Log-probs at ``labels``, log-normaliser and entropy of the rows of ``z`` (rows, V), which is
    left as it is. The exponentials are built once, in a chunk-sized buffer."""
    top = z.amax(-1, keepdim=True)
    expz = torch.sub(z, top).exp_()  # exp(z - max): (rows, V)
    total = expz.sum(-1)
    lse = top.squeeze(-1) + total.log()
    log_prob = z.gather(-1, labels[:, None]).squeeze(-1) - lse
    # entropy = logsumexp(z) - sum(softmax(z) * z)
    entropy = lse - expz.mul_(z).sum(-1) / total if with_entropy else None
    return log_prob, lse, entropy


def _chunk_grad(z: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, grad_log_prob: torch.Tensor | None,
                grad_entropy: torch.Tensor | None, entropy: torch.Tensor | None, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """The gradient with respect to ``z`` (rows, V) of ``sum(g_lp * log_prob + g_ent * entropy)``, in ``out``
    when given (which may be ``z`` itself): with ``p = softmax(z)``,
    ``d log_prob / dz = onehot(label) - p`` and ``d entropy / dz = -p * (log p + entropy)``."""
    if grad_log_prob is None and grad_entropy is None:
        return torch.zeros_like(z) if out is None else out.zero_()
    log_p = torch.sub(z, lse[:, None], out=out)
    if grad_entropy is None:
        grad = log_p.exp_().mul_(-grad_log_prob[:, None])
    else:
        weight = log_p.add(entropy[:, None]).mul_(grad_entropy[:, None])  # g_ent * (log p + entropy)
        if grad_log_prob is not None:
            weight.add_(grad_log_prob[:, None])
        grad = log_p.exp_().mul_(weight).neg_()
    if grad_log_prob is not None:
        grad.scatter_add_(-1, labels[:, None], grad_log_prob[:, None])
    return grad


def _upstream(rows: slice, grad_log_prob: torch.Tensor | None, grad_entropy: torch.Tensor | None,
              entropy: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor | None, ...]:
    """The incoming gradients of ``rows`` in ``acc`` (None where there is none), and the entropies that
    the entropy's gradient needs: the last three arguments of :func:`_chunk_grad`."""
    return (None if grad_log_prob is None else grad_log_prob[rows].to(acc),
            None if grad_entropy is None else grad_entropy[rows].to(acc),
            None if grad_entropy is None else entropy[rows])


def _forward_chunks(chunk_logits, labels: torch.Tensor, acc: torch.dtype, chunk_size: int, with_entropy: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_chunk_forward` over the rows ``chunk_logits(rows)`` gives, ``chunk_size`` at a time: the
    log-probs, log-normalisers and entropies (empty without ``with_entropy``) of all rows, in ``acc``."""
    n = labels.shape[0]
    log_prob, log_norm = (labels.new_empty(n, dtype=acc) for _ in range(2))
    entropy = labels.new_empty(n if with_entropy else 0, dtype=acc)
    for start in range(0, n, chunk_size):
        rows = slice(start, start + chunk_size)
        log_prob[rows], log_norm[rows], chunk_entropy = _chunk_forward(chunk_logits(rows), labels[rows], with_entropy)
        if with_entropy:
            entropy[rows] = chunk_entropy
    return log_prob, log_norm, entropy


class _LogitsLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, temperature: float, chunk_size: int,
                with_entropy: bool, overwrite: bool):
        acc = _accumulation_dtype(logits.dtype)
        log_prob, log_norm, entropy = _forward_chunks(
            lambda rows: _scaled(logits[rows], acc, temperature), labels, acc, chunk_size, with_entropy)
        ctx.save_for_backward(logits, labels, log_norm, entropy)
        ctx.temperature, ctx.chunk_size, ctx.overwrite = temperature, chunk_size, overwrite
        ctx.set_materialize_grads(False)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, labels, log_norm, entropy = ctx.saved_tensors
        acc, temperature = log_norm.dtype, ctx.temperature
        # with ``overwrite`` the gradient takes the logits' own storage (a chunk's logits are read before its
        # gradient is written): no second logits-sized tensor, whose fresh pages cost as much as the passes
        # over it. The write bumps the logits' version, so a second backward through them fails loudly.
        grad = logits if ctx.overwrite else torch.empty_like(logits)
        # fp32 logits at temperature 1 are used as they are and each chunk's gradient is written into
        # `grad`; otherwise the chunk's scaled copy is overwritten by its gradient
        direct = logits.dtype == acc and temperature == 1.0
        for start in range(0, logits.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            z = _scaled(logits[rows], acc, temperature)
            chunk = _chunk_grad(z, labels[rows], log_norm[rows],
                                *_upstream(rows, grad_log_prob, grad_entropy, entropy, acc),
                                out=grad[rows] if direct else z)
            if not direct:
                grad[rows] = chunk.div_(temperature) if temperature != 1.0 else chunk
        return grad, None, None, None, None, None


class _ChunkedHeadLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                chunk_size: int, with_entropy: bool):
        acc = _accumulation_dtype(hidden.dtype)
        log_prob, log_norm, entropy = _forward_chunks(
            lambda rows: _scaled(hidden[rows] @ weight.T, acc, temperature), labels, acc, chunk_size, with_entropy)
        ctx.save_for_backward(hidden, weight, labels, log_norm, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        hidden, weight, labels, log_norm, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        acc, temperature = log_norm.dtype, ctx.temperature
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            h = hidden[rows]
            z = _scaled(h @ weight.T, acc, temperature)  # the chunk's logits again, overwritten by their gradient
            grad_logits = _chunk_grad(z, labels[rows], log_norm[rows],
                                      *_upstream(rows, grad_log_prob, grad_entropy, entropy, acc), out=z)
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


def _flat_call(function, inputs: torch.Tensor, extra: tuple, labels: torch.Tensor, temperature: float,
               chunk_size: int, with_entropy: bool, *options) -> tuple[torch.Tensor, torch.Tensor | None]:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    lead = labels.shape
    log_prob, entropy = function.apply(inputs.reshape(-1, inputs.shape[-1]), *extra, labels.reshape(-1).long(),
                                       float(temperature or 1.0), chunk_size, with_entropy, *options)
    return log_prob.reshape(lead), (entropy.reshape(lead) if with_entropy else None)


def logits_log_prob(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                    chunk_size: int = LOGITS_CHUNK, with_entropy: bool = False, overwrite: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(logits / temperature)`` at ``labels``, and optionally the entropy of each position's
    distribution, both differentiable. Shapes: logits (..., V), labels (...) -> (...) each, in float32
    (float64 for float64 logits).

    ``overwrite``: the backward pass writes the logits' gradient over the logits themselves. Only for
    logits that nothing reads after it: no other backward function may have saved them (a plain linear
    head's output qualifies; a soft-capped one, whose ``tanh`` saved its output, does not)."""
    return _flat_call(_LogitsLogProb, logits, (), labels, temperature, chunk_size, with_entropy, overwrite)


def chunked_head_log_prob(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                          chunk_size: int = DEFAULT_CHUNK, with_entropy: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(hidden @ weight.T / temperature)`` at ``labels``, and optionally the entropy of each
    position's distribution, both differentiable. Shapes: hidden (..., H), weight (V, H), labels (...) ->
    (...) each, in float32 (float64 for float64 inputs)."""
    return _flat_call(_ChunkedHeadLogProb, hidden, (weight,), labels, temperature, chunk_size, with_entropy)
