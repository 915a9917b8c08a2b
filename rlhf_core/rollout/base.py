"""The rollout engine contract: generate responses for a batch of prompts.

An engine shares the actor's weights (the hybrid engine): ``sync_weights`` makes it
use the actor's latest parameters, ``release``/``resume`` free and retake whatever
memory it holds between rollouts (the KV cache of vLLM; nothing for HF generate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from rlhf_core.batch import Batch


@dataclass
class SamplingParams:
    n: int = 1
    max_new_tokens: int = 64
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False  # keep sampling after EOS, to max_new_tokens (fixed-length responses)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Prompts (left-padded ``input_ids``, ``attention_mask``, ``position_ids``; B rows) ->
        B * n rows, each prompt's samples adjacent, with ``prompts`` (B*n, P), ``responses`` (B*n, R),
        ``response_mask`` (B*n, R; EOS kept, everything after it 0; all 1 with ``ignore_eos``) and the full ``input_ids``,
        ``attention_mask``, ``position_ids`` (B*n, P+R). Per-row meta is repeated alongside."""
        ...

    def sync_weights(self) -> None:
        """Use the actor's current weights for the next generation."""
        ...

    def release(self) -> None:
        """Free memory held between rollouts."""
        ...

    def resume(self) -> None:
        """Retake what ``release`` freed."""
        ...
