"""One decode step of a Llama-family model with its projections fused, for the HF rollout on CPU.

For one new token per row, transformers' decoder layer is some sixty small operations: seven projections,
the RMS norms written out, rotary embedding through ``rotate_half``, the cache's and the modules' own
bookkeeping. At a decode step's few rows each of them is short, so what surrounds them costs a fifth to a
third of the step on 2 CPU cores (``bench/decode.py``). :class:`FusedDecoder` runs the same step from the
same parameters and KV cache with four products per layer (q, k and v in one, gate and up in one, o, down),
torch's RMS norm kernel (each norm's weight folded into the float32 product after it:
``W (w * x) = (W diag(w)) x``), and the rotation of q's and k's heads in one pass. Its logits are transformers' to
float32 rounding (``tests/test_fused_decode.py``). The products read copies of the weights made once per
rollout for the step's row count (:func:`rlhf_core.models.cpu_matmul.decode_weight`: MKL's or oneDNN's packed
layout, the blocks in ``trainer.cpu_matmul_dtype``), as the rollout's packed layers do otherwise.

:func:`unsupported` says why a model cannot take it; the rollout then runs transformers' layers. It takes
llama and qwen2 models with full attention, a SiLU MLP, RMS norms, a rotary embedding given by the module's
inverse frequencies (default, linear, llama3 or yarn), and float32 ``nn.Linear`` projections held whole on
the CPU (not sharded). Projections wrapped by PEFT's LoRA are multiplied by one weight per rollout,
``W + (alpha / r) B A`` of the active adapter (the base weight alone while the adapters are off); DoRA, adapter
biases and several adapters at once are not taken. The prompt pass is transformers' in every case.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from rlhf_core.models import cpu_matmul, lora

ARCHITECTURES = frozenset({"llama", "qwen2"})
#: rope types whose rotation is fixed by the module's ``inv_freq`` and ``attention_scaling`` at every length
ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
#: a decoder layer's projections as the step multiplies them, one product per group: q/k/v, o, gate/up, down
PRODUCTS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
            ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))


def layer_products(layer: torch.nn.Module) -> list[list[torch.nn.Module | None]]:
    """The linear layers of a decoder ``layer`` grouped as :data:`PRODUCTS` (None where the layer has no such one)."""
    return [[getattr(getattr(layer, part, None), name, None) for name in names] for part, names in PRODUCTS]


def _is_lora_linear(layer: object) -> bool:
    """Whether ``layer`` is a PEFT LoRA wrapper around a linear layer (its ``base_layer``)."""
    return hasattr(layer, "base_layer") and hasattr(layer, "lora_A") and hasattr(layer, "get_delta_weight")


def _base(layer: object) -> object:
    """The linear layer that does the product: the base layer under a LoRA wrapper, else ``layer``."""
    return layer.base_layer if _is_lora_linear(layer) else layer


def _active_adapters(layer) -> list[str]:
    """The LoRA adapters that change ``layer``'s output now (none while they are off or merged into its weight)."""
    if layer.disable_adapters or layer.merged:
        return []
    return [name for name in layer.active_adapters if name in layer.lora_A]


def _adapter_problem(layer: object) -> str | None:
    """Why a LoRA-wrapped ``layer`` cannot be multiplied as one merged weight (None where it can, or unwrapped)."""
    if not _is_lora_linear(layer):
        return None
    adapters = _active_adapters(layer)
    if len(adapters) > 1:
        return f"several LoRA adapters are active at once ({adapters})"
    if any(layer.use_dora.get(name) for name in adapters):
        return "its LoRA adapters are DoRA"
    if any(getattr(layer, "lora_bias", {}).get(name) for name in adapters):
        return "its LoRA adapters have biases"
    return None


def _plain_linear(layer: object) -> bool:
    """Whether ``layer``, or the base layer under its LoRA wrapper, is a plain float32 CPU linear layer (what the
    adapters themselves allow is :func:`_adapter_problem`'s to say)."""
    base = _base(layer)
    return type(base) in (torch.nn.Linear, cpu_matmul.RoutedLinear) and cpu_matmul.plain_cpu_float32(base.weight)


def _weight(layer: torch.nn.Module) -> torch.Tensor:
    """The weight ``layer`` multiplies by, LoRA merged in: ``W + (alpha / r) B A`` of the active adapter."""
    weight = _base(layer).weight.detach()
    if _is_lora_linear(layer):
        for name in _active_adapters(layer):
            weight = weight + layer.get_delta_weight(name).detach()
    return weight


def unsupported(module: torch.nn.Module) -> str | None:
    """Why :class:`FusedDecoder` cannot run ``module`` (a transformers causal LM, PEFT-wrapped or not), or None
    where it can."""
    for layer in module.modules():
        if (problem := _adapter_problem(layer)) is not None:
            return problem
    module = lora.base_model(module)
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        return f"model_type {model_type!r} is not one of {sorted(ARCHITECTURES)}"
    body = getattr(module, "model", None)
    if not all(hasattr(body, name) for name in ("layers", "embed_tokens", "norm", "rotary_emb")):
        return f"{type(module).__name__} does not hold a decoder with layers, embeddings, norm and rotary embedding"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} is not silu"
    rope_type = getattr(body.rotary_emb, "rope_type", None)
    if rope_type not in ROPE_TYPES or not hasattr(body.rotary_emb, "inv_freq"):
        return f"rope type {rope_type!r} is not one of {sorted(ROPE_TYPES)}"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "some layers use sliding-window attention"
    if getattr(config, "use_sliding_window", False) or getattr(config, "pretraining_tp", 1) != 1:
        return "sliding-window attention or tensor-parallel pretraining layout"
    for index, layer in enumerate(body.layers):
        if not all(_plain_linear(linear) for group in layer_products(layer) for linear in group):
            return f"layer {index}'s projections are not plain float32 CPU linear layers (sharded or moved)"
        if not all(type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon")
                   for norm in (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))):
            return f"layer {index}'s norms are not RMS norms"
    if not _plain_linear(getattr(module, "lm_head", None)):
        return "the LM head is not a plain float32 CPU linear layer"
    if not (type(body.norm).__name__.endswith("RMSNorm") and hasattr(body.norm, "variance_epsilon")):
        return "the final norm is not an RMS norm"
    return None


class _Layer(NamedTuple):
    norm1: torch.Tensor | None  # None: folded into the q/k/v product
    eps1: float
    norm2: torch.Tensor | None  # None: folded into the gate/up product
    eps2: float
    products: list[tuple[torch.Tensor, torch.Tensor | None]]  # (weight, bias) of q/k/v, o, gate/up, down


def _in_block(linear: torch.nn.Linear) -> bool:
    """Whether the layer multiplies in ``product_dtype()``, as :func:`rlhf_core.models.cpu_matmul.route` marks
    the layers inside transformer blocks (an unrouted layer multiplies in float32 everywhere)."""
    return getattr(_base(linear), "in_block", False)


def _folds(linear: torch.nn.Module) -> bool:
    """Whether the weight of the RMS norm before ``linear`` is folded into its copy: where it multiplies in float32
    (in bfloat16 the norm's weight stays on the float32 side of the rounding, as in the layers)."""
    return not _in_block(linear) or cpu_matmul.product_dtype() == torch.float32


def _product(linears: list[torch.nn.Module], rows: int, scale: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layers' weights (LoRA merged in) stacked into one product for ``rows`` rows, and their biases (zeros
    where a layer has none, None where none has). ``scale`` (the inputs' width) multiplies the weights' columns:
    ``W (w * x) = (W diag(w)) x`` takes an RMS norm's weight ``w`` into the product."""
    weight = _weight(linears[0]) if len(linears) == 1 else torch.cat([_weight(linear) for linear in linears])
    if scale is not None:  # in place on a copy made here (stacked or merged); the layers' own weights stay as they are
        owned = len(linears) > 1 or weight.data_ptr() != _base(linears[0]).weight.data_ptr()
        weight = weight.mul_(scale) if owned else weight * scale
    weight = cpu_matmul.decode_weight(weight, rows, _in_block(linears[0]))
    bases = [_base(linear) for linear in linears]
    if all(base.bias is None for base in bases):
        return weight, None
    return weight, torch.cat([base.bias.detach() if base.bias is not None
                              else base.weight.new_zeros(base.out_features) for base in bases])


class FusedDecoder:
    """The decode step of ``module`` at ``rows`` rows, on copies of its weights taken now (make one per rollout:
    an update changes the weights). ``module`` must pass :func:`unsupported`."""

    def __init__(self, module: torch.nn.Module, rows: int):
        reason = unsupported(module)
        if reason is not None:
            raise ValueError(f"the fused decode step cannot run this model: {reason}")
        module = lora.base_model(module)
        config, body = module.config, module.model
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.intermediate = config.intermediate_size
        self.embed = body.embed_tokens
        self.inv_freq = body.rotary_emb.inv_freq.detach().float()
        self.rope_scaling = float(getattr(body.rotary_emb, "attention_scaling", 1.0))
        self.layers = [self._layer(layer, rows) for layer in body.layers]
        self.final_norm, scale, self.final_eps = self._norm(body.norm, module.lm_head)
        self.head = _product([module.lm_head], rows, scale)

    @staticmethod
    def _norm(norm: torch.nn.Module, linear: torch.nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        """The RMS norm before ``linear``: its weight where the step applies it and where the product after it
        takes it in (one of the two None, by :func:`_folds`), and its eps."""
        weight = norm.weight.detach()
        return (None, weight, norm.variance_epsilon) if _folds(linear) else (weight, None, norm.variance_epsilon)

    def _layer(self, layer: torch.nn.Module, rows: int) -> _Layer:
        qkv, o, gate_up, down = layer_products(layer)
        norm1, scale1, eps1 = self._norm(layer.input_layernorm, qkv[0])
        norm2, scale2, eps2 = self._norm(layer.post_attention_layernorm, gate_up[0])
        return _Layer(norm1, eps1, norm2, eps2, [_product(qkv, rows, scale1), _product(o, rows),
                                                 _product(gate_up, rows, scale2), _product(down, rows)])

    def _rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Factors that rotate each row's heads at ``positions`` (rows,) as transformers' rotary embedding does
        (float32 angles, times the rope type's attention scaling), for a head viewed as its two halves (2, d/2):
        ``x * cos + x.flip(halves) * sin`` gives ``(x1 cos - x2 sin, x2 cos + x1 sin)``. Both (rows, 1, 2, d/2)."""
        angles = positions[:, None].float() * self.inv_freq[None, :]
        cos, sin = angles.cos() * self.rope_scaling, angles.sin() * self.rope_scaling
        return torch.stack((cos, cos), 1)[:, None], torch.stack((-sin, sin), 1)[:, None]

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                 cache: Cache) -> torch.Tensor:
        """Logits (rows, V) after ``tokens`` (rows,) at ``positions`` (rows,), whose keys and values are
        appended to ``cache`` (filled by the prompt pass); ``attention_mask`` (rows, cached + 1) marks the
        positions each row attends to, the new one included."""
        rows = tokens.shape[0]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        cos, sin = self._rotation(positions)
        mask = attention_mask.bool()[:, None, None, :]
        x = self.embed(tokens)  # (rows, hidden)
        product = cpu_matmul.decode_product
        for index, layer in enumerate(self.layers):
            qkv, o, gate_up, down = layer.products
            h = F.rms_norm(x, (x.shape[-1],), layer.norm1, layer.eps1)
            qkv_out = product(h, *qkv)
            # q's and k's heads side by side, each as its two halves, rotated in one pass
            qk = qkv_out[:, :(heads + kv_heads) * dim].reshape(rows, heads + kv_heads, 2, dim // 2)
            qk = torch.addcmul(qk * cos, qk.flip(2), sin).view(rows, heads + kv_heads, 1, dim)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv_out[:, (heads + kv_heads) * dim:].reshape(rows, kv_heads, 1, dim)
            keys, values = cache.update(k, v, index)
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                      enable_gqa=kv_heads != heads)
            x = x + product(attended.reshape(rows, heads * dim), *o)
            h = F.rms_norm(x, (x.shape[-1],), layer.norm2, layer.eps2)
            up = product(h, *gate_up)
            x = x + product(F.silu(up[:, :self.intermediate]) * up[:, self.intermediate:], *down)
        return product(F.rms_norm(x, (x.shape[-1],), self.final_norm, self.final_eps), *self.head)
