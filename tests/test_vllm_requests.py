"""How the vLLM rollout asks vLLM for samples, on the CPU: a stand-in ``vllm`` module that answers as vLLM's
``LLM.generate`` does (and refuses what it refuses), so the requests and the rows built from the answers are
checked without a GPU. The engine on a real vLLM is tests/test_vllm.py's (GPU)."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import pytest
import torch

from rlhf_core.batch import Batch
from rlhf_core.rollout import SamplingParams
from rlhf_core.rollout.vllm import VLLMRolloutEngine


@dataclass
class _SamplingParams:
    n: int = 1
    max_tokens: int = 16
    logprobs: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False

    def __post_init__(self):  # as vLLM's SamplingParams._verify_greedy_sampling
        if self.temperature == 0 and self.n > 1:
            raise ValueError("n must be 1 when using greedy sampling.")


@dataclass
class _Sample:
    token_ids: list[int]
    logprobs: list | None = None


@dataclass
class _Request:
    outputs: list[_Sample] = field(default_factory=list)


class _LLM:
    """Answers request r's sample j with tokens [first prompt token, r, j]; keeps what it was asked."""

    def __init__(self):
        self.asked = []

    def generate(self, prompts, sampling, use_tqdm=False):
        self.asked.append(([p["prompt_token_ids"] for p in prompts], sampling))
        return [_Request([_Sample([p["prompt_token_ids"][0], r, j]) for j in range(sampling.n)])
                for r, p in enumerate(prompts)]


@pytest.fixture
def engine(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = _SamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    engine = object.__new__(VLLMRolloutEngine)  # the engine's state, without starting an LLM
    engine.llm, engine.pad_id, engine.tp, engine.tp_group = _LLM(), 0, 1, None
    return engine


def _prompts() -> Batch:
    ids = torch.tensor([[0, 0, 11, 12], [0, 21, 22, 23]])  # left-padded
    mask = (ids != 0).long()
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
                 {"uid": ["a", "b"]})


def test_greedy_samples_go_as_n_requests_of_one(engine):
    """vLLM refuses n > 1 when greedy; each prompt is asked n times with n=1, its n rows adjacent."""
    out = engine.generate(_prompts(), SamplingParams(n=3, max_new_tokens=5, do_sample=False))
    [(asked, sampling)] = engine.llm.asked
    assert asked == [[11, 12]] * 3 + [[21, 22, 23]] * 3 and sampling.n == 1 and sampling.temperature == 0.0
    # request r answers [first prompt token, r, 0]: rows 0-2 are prompt a's three requests, 3-5 prompt b's
    assert out["responses"][:, :3].tolist() == [[11, 0, 0], [11, 1, 0], [11, 2, 0],
                                                [21, 3, 0], [21, 4, 0], [21, 5, 0]]
    assert out["responses"][:, 3:].eq(0).all() and out["response_mask"].sum(-1).tolist() == [3] * 6
    assert out.meta["uid"] == ["a"] * 3 + ["b"] * 3
    assert out["prompts"].tolist() == [[0, 0, 11, 12]] * 3 + [[0, 21, 22, 23]] * 3


def test_sampled_requests_ask_for_n_samples_each(engine):
    out = engine.generate(_prompts(), SamplingParams(n=2, max_new_tokens=4, temperature=0.7))
    [(asked, sampling)] = engine.llm.asked
    assert asked == [[11, 12], [21, 22, 23]] and sampling.n == 2 and sampling.temperature == 0.7
    assert out["responses"][:, :3].tolist() == [[11, 0, 0], [11, 0, 1], [21, 1, 0], [21, 1, 1]]
    assert out.meta["uid"] == ["a", "a", "b", "b"]
