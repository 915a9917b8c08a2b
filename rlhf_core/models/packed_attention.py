"""Attention for packed rows (``use_remove_padding``) without flash attention: CPU, or CUDA without flash-attn.

:func:`rlhf_core.workers.common.packed_inputs` puts the valid tokens of a micro-batch in one row, with position
ids that restart at 0 at each sequence. Everything in a decoder layer but attention works position by position,
so on that row the products, norms and MLPs compute real tokens only, none of the pad tokens a padded micro-batch
carries (a fifth to a third of the positions for 16 GSM8K prompts of 51-209 tokens). Attention has to keep the
sequences apart: flash attention's variable-length kernel does it on CUDA, and transformers' sdpa does it with a
(tokens x tokens) block-diagonal mask, quadratic in the packed row's length.

Here, attention for a packed row lays its queries, keys and values out one sequence per row, right-padded to the
longest (an index copy, and its gradient an index back), runs torch's scaled-dot-product attention with
``is_causal`` and packs the output back. With every pad after its sequence's tokens, causal attention never lets
a real token see one, so no mask is built (:func:`packed_sdpa_mask` asks transformers for none); the pad rows'
outputs are dropped. Calls that are not a packed row
(the rollout's left-padded prompts, decode steps against a KV cache, a single sequence) go to transformers' sdpa
attention unchanged, with its usual masks.

Importing this module registers the implementation under :data:`NAME` with transformers' attention and mask
interfaces; load a model with ``attn_implementation=NAME`` to use it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_packed"


class Layout:
    """Where the tokens of a packed row go in a (sequences, longest) grid: ``dest[t]`` is token t's flat index."""

    def __init__(self, position_ids: torch.Tensor):
        positions = position_ids.reshape(-1)
        starts = torch.ones_like(positions, dtype=torch.bool)
        starts[1:] = positions[1:] != positions[:-1] + 1  # a new sequence wherever the positions do not run on
        sequence = starts.cumsum(0) - 1
        first = starts.nonzero().squeeze(1)
        lengths = torch.diff(first, append=first.new_tensor([positions.numel()]))
        self.sequences = int(first.numel())
        self.longest = int(lengths.max())
        column = torch.arange(positions.numel(), device=positions.device) - first[sequence]
        self.dest = sequence * self.longest + column

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(1, heads, T, dim) packed -> (sequences, heads, longest, dim), zeros after each sequence."""
        heads, dim = x.shape[1], x.shape[3]
        flat = x[0].transpose(0, 1)  # (T, heads, dim)
        grid = flat.new_zeros(self.sequences * self.longest, heads, dim).index_copy(0, self.dest, flat)
        return grid.view(self.sequences, self.longest, heads, dim).transpose(1, 2)

    def to_packed(self, x: torch.Tensor) -> torch.Tensor:
        """(sequences, heads, longest, dim) -> (1, T, heads, dim), the layout attention functions return."""
        heads, dim = x.shape[1], x.shape[3]
        return x.transpose(1, 2).reshape(-1, heads, dim).index_select(0, self.dest)[None]


_last: tuple[torch.Tensor, Layout] | None = None  # the layers of one forward share its position ids


def packed_layout(query: torch.Tensor, key: torch.Tensor, position_ids: torch.Tensor | None) -> Layout | None:
    """The layout of a packed row of several sequences, or None for anything else (batches of padded rows,
    queries against a KV cache, one sequence)."""
    global _last
    if position_ids is None or query.shape[0] != 1 or key.shape[2] != query.shape[2] or query.shape[2] < 2:
        return None
    if _last is not None and _last[0] is position_ids:
        return _last[1] if _last[1].sequences > 1 else None
    layout = Layout(position_ids)
    _last = (position_ids, layout)
    return layout if layout.sequences > 1 else None


def packed_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (1, heads, T, dim), key and value (1, kv heads, T, dim)
    for a packed row; returns ((1, T, heads, dim), None)."""
    layout = packed_layout(query, key, kwargs.get("position_ids"))
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    window = kwargs.get("sliding_window")
    if window is not None and layout.longest > window:
        raise NotImplementedError(f"packed rows with a sliding attention window ({window} positions) shorter than a "
                                  f"sequence ({layout.longest}): set use_remove_padding=false for this model")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("packed rows with soft-capped attention or attention sinks: set "
                                  "use_remove_padding=false for this model")
    out = F.scaled_dot_product_attention(
        layout.to_rows(query), layout.to_rows(key), layout.to_rows(value), is_causal=True, scale=scaling,
        dropout_p=dropout if module.training else 0.0, enable_gqa=key.shape[1] != query.shape[1])
    return layout.to_packed(out), None


def packed_sdpa_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                     attention_mask: torch.Tensor | None = None, local_size: int | None = None, **kwargs):
    """No mask for one row of queries over its own keys without padding, cache or window (a packed row, whose
    sequences :func:`packed_sdpa_forward` keeps apart itself, or a single sequence, which sdpa then runs with
    ``is_causal``): for a packed row transformers would build the (tokens x tokens) block-diagonal mask, quadratic in
    its length, that the forward never reads. Any other call gets transformers' sdpa mask."""
    if (batch_size == 1 and attention_mask is None and q_length == kv_length and not q_offset and not kv_offset
            and local_size is None):
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask,
                     local_size=local_size, **kwargs)


AttentionInterface.register(NAME, packed_sdpa_forward)
AttentionMaskInterface.register(NAME, packed_sdpa_mask)
