"""The rollout engine contract: generate responses for a batch of prompts.

An engine shares the actor's weights (the hybrid engine): ``sync_weights`` makes it
use the actor's latest parameters, ``release``/``resume`` free and retake whatever
memory it holds between rollouts (the KV cache of vLLM; nothing for HF generate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

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
    #: None: draw from the engine's running generator (training: its state is saved with a checkpoint). A number:
    #: draw this call's samples from a stream of their own, made from the engine's seed and this number
    #: (:func:`call_seed`), which leaves the running generator where it was: validation draws the same way at every
    #: validation, and how often it runs does not change what training samples
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0


def stop_tokens(module, tokenizer) -> tuple[list[int], int]:
    """The ids that end a response, sorted, and the id that pads a response after its end, for every engine alike.

    A response ends at the tokenizer's EOS and at every id of the model's ``generation_config.eos_token_id`` (an int
    or a list: Qwen2.5-Instruct lists two, Llama 3.1 Instruct three), as transformers' ``generate`` stops; the pad is
    the tokenizer's, else the least of those ids. ``module`` without a generation config (an engine that keeps its
    own copy of the model) adds none."""
    config = getattr(module, "generation_config", None)
    ids = end_ids(config.eos_token_id if config is not None else None, tokenizer)
    if not ids:
        raise ValueError("the tokenizer and the model's generation_config name no EOS token")
    return sorted(ids), tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(ids)


def end_ids(generation_eos: int | list[int] | None, tokenizer) -> set[int]:
    """The ids that end a response: ``generation_eos`` (a generation config's ``eos_token_id``: an int, a list or
    None) and the tokenizer's EOS."""
    ids = set(generation_eos if isinstance(generation_eos, list) else [] if generation_eos is None else [generation_eos])
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


def call_seed(*numbers: int) -> int:
    """A seed for a stream of its own, derived from ``numbers`` (an engine's seed, a call's, a prompt's index)
    through numpy's SeedSequence: nearby inputs give unrelated streams, and none is an engine's own seed."""
    return int(np.random.SeedSequence([*numbers]).generate_state(1, np.uint64)[0] >> np.uint64(1))  # < 2**63


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
