"""Rollout engines: HF generate (CPU/GPU) and vLLM (GPU)."""

from rlhf_core.rollout.base import RolloutEngine, SamplingParams

__all__ = ["ROLLOUT_NAMES", "RolloutEngine", "SamplingParams", "make_rollout_engine"]

#: the engines ``make_rollout_engine`` builds, by ``actor_rollout_ref.rollout.name``
ROLLOUT_NAMES = ("hf", "vllm")


def make_rollout_engine(name: str, module, tokenizer, seed: int = 0, **kwargs) -> RolloutEngine:
    """The engine named by ``actor_rollout_ref.rollout.name``; vllm is imported only when asked for."""
    if name == "hf":
        from rlhf_core.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(module, tokenizer, seed=seed, **kwargs)
    if name == "vllm":
        from rlhf_core.rollout.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine(module, tokenizer, seed=seed, **kwargs)
    raise ValueError(f"actor_rollout_ref.rollout.name={name!r}: no such rollout engine here (valid: {', '.join(ROLLOUT_NAMES)})")
