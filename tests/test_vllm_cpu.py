"""The vLLM rollout engine's own logic on the CPU: a hand-written stand-in for the few vllm names the engine
imports answers with fixed tokens and log-probs, so that the batch built from vLLM's outputs, the engine's
arguments, the prompts of a tensor-parallel engine and the sleep / wake / weight-loading order are checked
without a GPU or vllm (tests/test_vllm.py runs the real engine)."""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from typing import TypedDict

import pytest
import torch
from transformers import GenerationConfig

from rlhf_core.batch import Batch
from rlhf_core.config import load_config
from rlhf_core.models.loading import load_tokenizer
from rlhf_core.models.toy import random_toy_model
from rlhf_core.rollout import SamplingParams, make_rollout_engine
from rlhf_core.workers import distributed

# where the torch model sits inside llm.llm_engine: V1 in one process, V0, and older V0 releases
V1_MODEL = "engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model"
V0_MODEL = "model_executor.driver_worker.worker.model_runner.model"
OLD_V0_MODEL = "model_executor.driver_worker.model_runner.model"
RIVAL = 99  # a token never sampled here, listed in every step beside the sampled one


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_toy_model(tmp_path_factory.mktemp("vllm_cpu") / "model", n_layers=1, hidden_size=32, seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    tok = load_tokenizer(model_dir)
    assert tok.pad_token_id != tok.eos_token_id  # so that padding and a sampled EOS can be told apart
    return tok


@dataclasses.dataclass
class Logprob:  # vllm.sequence.Logprob
    logprob: float


@dataclasses.dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None


@dataclasses.dataclass
class RequestOutput:
    outputs: list[CompletionOutput]


class TokensPrompt(TypedDict):  # a TypedDict in vllm.inputs too: calling it makes a plain dict
    prompt_token_ids: list[int]


class FakeSamplingParams:
    def __init__(self, **kwargs):
        if kwargs.get("temperature") == 0 and kwargs.get("n", 1) > 1:  # as vLLM's _verify_greedy_sampling
            raise ValueError("n must be 1 when using greedy sampling.")
        self.kwargs = kwargs


class HostTensor:
    """An actor tensor as ``weights()`` yields it: ``to`` notes the device asked for and casts on the CPU."""

    def __init__(self, values: torch.Tensor, devices: list):
        self.values, self.devices = values, devices

    def to(self, device, dtype):
        self.devices.append(torch.device(device))
        return self.values.to(dtype=dtype)


def _nest(path: str, leaf):
    node = leaf
    for name in reversed(path.split(".")):
        node = types.SimpleNamespace(**{name: node})
    return node


class FakeVLLM:
    """vllm's ``LLM``, ``SamplingParams``, ``inputs.TokensPrompt`` and ``engine.arg_utils.EngineArgs`` in
    ``sys.modules`` (undone after the test). ``script`` maps a prompt's tokens to its samples, each
    ``(token_ids, log-probs)``, which ends where vLLM's stop check ends it: at the first token that is ``eos`` (the
    EOS of the tokenizer vLLM loads; not with ``ignore_eos``) or one of the request's ``stop_token_ids`` (even with
    ``ignore_eos``), that token kept. What the engine asks for is recorded: ``built`` (the LLM's arguments and
    VLLM_ENABLE_V1_MULTIPROCESSING at that moment), ``requests``, ``events`` (sleep, wake, loads, CUDA calls)
    and ``loaded`` (what ``model.load_weights`` received)."""

    def __init__(self, monkeypatch, engine_fields=("logprobs_mode", "generation_config"), model_path=V1_MODEL):
        self.script: dict[tuple[int, ...], list[tuple[list[int], list[float]]]] = {}
        self.eos: int | None = None
        self.built, self.requests, self.events, self.loaded, self.devices = [], [], [], [], []
        self.actor = {"model.embed_tokens.weight": torch.tensor([[1.5, -2.0], [0.25, 3.0]]),
                      "lm_head.weight": torch.tensor([[-0.5, 0.125]])}
        self.weight_calls = 0
        fake = self

        class Model:
            def load_weights(self, weights):
                fake.loaded = list(weights)
                fake.events.append("load_weights")

        class LLM:
            def __init__(self, **kwargs):
                fake.built.append((kwargs, os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")))
                self.llm_engine = _nest(model_path, Model())

            def sleep(self, level):
                fake.events.append(f"sleep(level={level})")

            def wake_up(self, tags):
                fake.events.append(f"wake_up({','.join(tags)})")

            def reset_prefix_cache(self):
                fake.events.append("reset_prefix_cache")

            def generate(self, prompts, sampling, **kwargs):
                ids = [p["prompt_token_ids"] for p in prompts]
                each = sampling if isinstance(sampling, list) else [sampling] * len(ids)  # one, or one a prompt
                assert len(each) == len(ids)
                fake.requests.append((ids, [s.kwargs for s in sampling] if isinstance(sampling, list)
                                      else sampling.kwargs, kwargs))
                return [RequestOutput([
                    CompletionOutput(tokens, [{token: Logprob(lp), RIVAL: Logprob(-0.01)}
                                              for token, lp in zip(tokens, lps)])
                    for tokens, lps in (fake.stopped(*sample, s.kwargs) for sample in fake.script[tuple(p)][:s.kwargs["n"]])])
                    for p, s in zip(ids, each)]

        vllm = types.ModuleType("vllm")
        vllm.LLM, vllm.SamplingParams = LLM, FakeSamplingParams
        vllm.inputs = types.ModuleType("vllm.inputs")
        vllm.inputs.TokensPrompt = TokensPrompt
        vllm.engine = types.ModuleType("vllm.engine")
        vllm.engine.arg_utils = types.ModuleType("vllm.engine.arg_utils")
        vllm.engine.arg_utils.EngineArgs = dataclasses.make_dataclass(
            "EngineArgs", [("model", str)] + [(name, str, dataclasses.field(default="")) for name in engine_fields])
        for module in (vllm, vllm.inputs, vllm.engine, vllm.engine.arg_utils):
            monkeypatch.setitem(sys.modules, module.__name__, module)
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the engine must set it: restored afterwards
        # no GPU: the device the weights go to is only named, and the CUDA calls are recorded in order
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: self.events.append("synchronize"))
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: self.events.append("empty_cache"))

    def stopped(self, tokens: list[int], log_probs: list[float], kwargs: dict) -> tuple[list[int], list[float]]:
        """A scripted sample as vLLM returns it under the request's ``kwargs``."""
        stops = set(kwargs.get("stop_token_ids") or ())
        if self.eos is not None and not kwargs.get("ignore_eos"):
            stops.add(self.eos)
        end = next((i + 1 for i, token in enumerate(tokens) if token in stops), len(tokens))
        return tokens[:end], log_probs[:end]

    def weights(self):
        self.weight_calls += 1
        return iter([(name, HostTensor(values.clone(), self.devices)) for name, values in self.actor.items()])


@pytest.fixture
def fake(monkeypatch):
    return FakeVLLM(monkeypatch)


def _rollout_config(*overrides: str):
    return load_config(["actor_rollout_ref.rollout.name=vllm", *overrides]).actor_rollout_ref.rollout


def _engine(fake, tokenizer, model_dir, *overrides: str, seed: int = 0, max_model_len: int | None = 512,
            trust_remote_code: bool = False, hf_overrides: dict | None = None, module: torch.nn.Module | None = None,
            **engine_kwargs):
    """Built as the actor worker builds it; the module (the actor's) is read for its generation config only (vLLM
    keeps its own copy of the model): by default one without."""
    return make_rollout_engine("vllm", module if module is not None else torch.nn.Linear(2, 2), tokenizer, seed=seed,
                               config=_rollout_config(*overrides), model_path=str(model_dir),
                               max_model_len=max_model_len, weights=fake.weights,
                               trust_remote_code=trust_remote_code, hf_overrides=hf_overrides, **engine_kwargs)


def test_the_batch_pads_masks_and_repeats_vllms_samples(fake, tokenizer, model_dir):
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    # prompts of 2, 4 and 1 tokens, left-padded
    prompts = Batch({
        "input_ids": torch.tensor([[pad, pad, 5, 6], [7, 8, 9, 10], [pad, pad, pad, 11]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]]),
        "position_ids": torch.tensor([[0, 0, 0, 1], [0, 1, 2, 3], [0, 0, 0, 0]]),
    }, {"uid": [10, 11, 12], "ground_truth": ["11", "34", "0"]})
    # EOS early, at once, as the last of the 4 tokens, or never (cut at max_tokens)
    fake.script = {
        (5, 6): [([20, 21, eos], [-0.5, -1.25, -0.125]), ([22, 23, 24, 25], [-2.0, -0.25, -0.75, -1.5])],
        (7, 8, 9, 10): [([eos], [-3.0]), ([30, 31, 32, eos], [-0.5, -0.5, -0.5, -0.0625])],
        (11,): [([40, 41, 42, 43], [-1.0, -0.5, -0.25, -0.125]), ([44, eos], [-0.375, -0.875])],
    }
    engine = _engine(fake, tokenizer, model_dir)
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=4, temperature=0.7, top_p=0.9))

    # vLLM gets the prompts without their padding and samples the n responses itself
    [(sent, sampling, options)] = fake.requests
    assert sent == [[5, 6], [7, 8, 9, 10], [11]]
    assert sampling == {"n": 2, "max_tokens": 4, "logprobs": 0, "temperature": 0.7, "top_p": 0.9, "top_k": -1,
                        "ignore_eos": False, "stop_token_ids": [eos]}
    assert options == {"use_tqdm": False}

    prompt_rows = [[pad, pad, 5, 6]] * 2 + [[7, 8, 9, 10]] * 2 + [[pad, pad, pad, 11]] * 2
    responses = [[20, 21, eos, pad], [22, 23, 24, 25], [eos, pad, pad, pad], [30, 31, 32, eos],
                 [40, 41, 42, 43], [44, eos, pad, pad]]
    response_mask = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert out["prompts"].tolist() == prompt_rows
    assert out["responses"].tolist() == responses
    assert out["response_mask"].tolist() == response_mask
    assert out["input_ids"].tolist() == [p + r for p, r in zip(prompt_rows, responses)]
    assert out["attention_mask"].tolist() == [
        [0, 0, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 0, 0]]
    # the response continues from the last prompt position, padding or not
    assert out["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3, 4, 5]] * 2 + [[0, 1, 2, 3, 4, 5, 6, 7]] * 2 + [
        [0, 0, 0, 0, 1, 2, 3, 4]] * 2
    # the sampled token's own log-prob, not the rival's, and 0 past the response
    assert torch.equal(out["rollout_log_prob"], torch.tensor([
        [-0.5, -1.25, -0.125, 0.0], [-2.0, -0.25, -0.75, -1.5], [-3.0, 0.0, 0.0, 0.0],
        [-0.5, -0.5, -0.5, -0.0625], [-1.0, -0.5, -0.25, -0.125], [-0.375, -0.875, 0.0, 0.0]]))
    assert out.meta == {"uid": [10, 10, 11, 11, 12, 12], "ground_truth": ["11", "11", "34", "34", "0", "0"]}
    assert {k: v.dtype for k, v in out.tensors.items()} == {
        "prompts": torch.long, "responses": torch.long, "response_mask": torch.long, "input_ids": torch.long,
        "attention_mask": torch.long, "position_ids": torch.long, "rollout_log_prob": torch.float32}


def test_with_ignore_eos_every_sampled_token_stays_in_the_mask(fake, tokenizer, model_dir):
    eos = tokenizer.eos_token_id
    prompts = Batch({"input_ids": torch.tensor([[5, 6]]), "attention_mask": torch.tensor([[1, 1]]),
                     "position_ids": torch.tensor([[0, 1]])}, {"uid": [0]})
    fake.script = {(5, 6): [([eos, 20, eos], [-1.0, -2.0, -0.5])]}
    out = _engine(fake, tokenizer, model_dir).generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert fake.requests[0][1]["ignore_eos"] is True
    assert out["responses"].tolist() == [[eos, 20, eos]]
    assert out["response_mask"].tolist() == [[1, 1, 1]]


def _with_generation_eos(eos_token_id) -> torch.nn.Module:
    """A stand-in for the actor's module whose generation config names ``eos_token_id`` (an int or a list)."""
    module = torch.nn.Linear(2, 2)
    module.generation_config = GenerationConfig(eos_token_id=eos_token_id)
    return module


def test_every_eos_id_of_the_generation_config_ends_a_response_as_the_tokenizers_eos_does(fake, tokenizer, model_dir):
    """A model whose generation config lists a second EOS (as Qwen2.5-Instruct's two, Llama 3.1 Instruct's three)
    beside the tokenizer's: vLLM is asked to stop at both, and a row ended by the other id has the layout of one
    ended by EOS (the id kept, with its log-prob, padding after it), as the HF rollout stops on either."""
    pad, eos, other = tokenizer.pad_token_id, tokenizer.eos_token_id, 9
    fake.eos = eos  # the EOS of the tokenizer vLLM loads
    module = _with_generation_eos([other, eos])
    prompts = Batch({"input_ids": torch.tensor([[5, 6]]), "attention_mask": torch.tensor([[1, 1]]),
                     "position_ids": torch.tensor([[0, 1]])}, {"uid": [0]})
    # the model goes on after the other id, and after EOS, where nothing stops it
    fake.script = {(5, 6): [([20, other, 21, 22], [-0.5, -0.25, -1.0, -2.0]),
                            ([23, eos, 24, 25], [-0.75, -0.125, -1.5, -3.0])]}
    out = _engine(fake, tokenizer, model_dir, module=module).generate(prompts, SamplingParams(n=2, max_new_tokens=4))
    assert fake.requests[0][1]["stop_token_ids"] == [eos, other]
    assert out["responses"].tolist() == [[20, other, pad, pad], [23, eos, pad, pad]]
    assert out["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 0, 0]]
    assert out["rollout_log_prob"].tolist() == [[-0.5, -0.25, 0.0, 0.0], [-0.75, -0.125, 0.0, 0.0]]

    # ignore_eos: no id ends a response (vLLM would still stop at a stop id), as none ends the HF rollout's
    out = _engine(fake, tokenizer, model_dir, module=module).generate(
        prompts, SamplingParams(n=2, max_new_tokens=4, ignore_eos=True))
    assert fake.requests[1][1]["stop_token_ids"] == []
    assert out["responses"].tolist() == [[20, other, 21, 22], [23, eos, 24, 25]]
    assert out["response_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]


@pytest.mark.parametrize(("eos_token_id", "generation_eos", "pad", "stop_token_ids"), [
    (3, None, 3, [3]),  # the tokenizer's EOS pads
    (3, [3, 1], 1, [1, 3]),  # the least of the ends pads, as in the HF rollout (not the tokenizer's EOS)
    (None, [6, 4], 4, [4, 6]),  # a tokenizer without EOS: the generation config's ids end and pad the responses
])
def test_without_a_pad_token_responses_are_padded_as_the_hf_rollout_pads_them(fake, model_dir, eos_token_id,
                                                                            generation_eos, pad, stop_token_ids):
    tokenizer = types.SimpleNamespace(pad_token_id=None, eos_token_id=eos_token_id)
    module = _with_generation_eos(generation_eos) if generation_eos is not None else None
    prompts = Batch({"input_ids": torch.tensor([[7]]), "attention_mask": torch.tensor([[1]]),
                     "position_ids": torch.tensor([[0]])}, {"uid": [0]})
    fake.script = {(7,): [([20], [-1.0])]}
    out = _engine(fake, tokenizer, model_dir, module=module).generate(prompts, SamplingParams(max_new_tokens=3))
    assert fake.requests[0][1]["stop_token_ids"] == stop_token_ids
    assert out["responses"].tolist() == [[20, pad, pad]]
    assert out["response_mask"].tolist() == [[1, 0, 0]]


def test_a_tokenizer_and_model_without_any_eos_are_refused(fake, model_dir):
    tokenizer = types.SimpleNamespace(pad_token_id=0, eos_token_id=None)
    with pytest.raises(ValueError, match="name no EOS token"):
        _engine(fake, tokenizer, model_dir)


@pytest.mark.parametrize(("params", "temperature", "top_k"), [
    (SamplingParams(do_sample=False, temperature=0.7), 0.0, -1),  # greedy: vLLM's temperature 0
    (SamplingParams(temperature=0.0), 0.0, -1),
    (SamplingParams(temperature=1.3, top_k=5), 1.3, 5),
    (SamplingParams(top_k=0), 1.0, -1),  # 0 is "off" here, -1 in vLLM
])
def test_sampling_settings_reach_vllm(fake, tokenizer, model_dir, params, temperature, top_k):
    prompts = Batch({"input_ids": torch.tensor([[5]]), "attention_mask": torch.tensor([[1]]),
                     "position_ids": torch.tensor([[0]])}, {"uid": [0]})
    fake.script = {(5,): [([20], [-1.0])]}
    _engine(fake, tokenizer, model_dir).generate(prompts, params)
    sampling = fake.requests[0][1]
    assert (sampling["temperature"], sampling["top_k"]) == (temperature, top_k)


def test_a_seeded_call_gives_each_prompt_a_seed_of_its_own_from_the_engines_seed(fake, tokenizer, model_dir):
    """Validation's draws (``SamplingParams.seed``): one vLLM request seed a prompt, the same for the same call and
    engine seed, other for another prompt, call or engine; a greedy call and an unseeded one carry no seed."""
    prompts = Batch({"input_ids": torch.tensor([[5, 6], [0, 7]]), "attention_mask": torch.tensor([[1, 1], [0, 1]]),
                     "position_ids": torch.tensor([[0, 1], [0, 0]])}, {"uid": [0, 1]})
    fake.script = {(5, 6): [([20], [-0.5])] * 2, (7,): [([30, 31], [-0.25, -1.0])] * 2}
    seeded = SamplingParams(n=2, max_new_tokens=2, seed=3)
    for engine_seed, params in [(0, seeded), (0, seeded), (0, dataclasses.replace(seeded, seed=4)), (1, seeded),
                                (0, dataclasses.replace(seeded, seed=None)),
                                (0, dataclasses.replace(seeded, do_sample=False))]:
        _engine(fake, tokenizer, model_dir, seed=engine_seed).generate(prompts, params)
    (_, first, _), (_, again, _), (_, other_call, _), (_, other_engine, _), (_, unseeded, _), (_, greedy, _) = fake.requests
    seeds = [[request["seed"] for request in call] for call in (first, again, other_call, other_engine)]
    assert [request["n"] for request in first] == [2, 2]
    assert seeds[0] == seeds[1] and len(set(seeds[0])) == 2  # repeatable, and one a prompt
    assert not set(seeds[0]) & set(seeds[2]) and not set(seeds[0]) & set(seeds[3])
    assert "seed" not in unseeded and "seed" not in greedy and greedy["n"] == 1


def test_greedy_samples_are_asked_one_request_each(fake, tokenizer, model_dir):
    """vLLM refuses n > 1 when greedy: each prompt goes n times with n=1, its n rows adjacent."""
    prompts = Batch({"input_ids": torch.tensor([[5, 6], [0, 7]]), "attention_mask": torch.tensor([[1, 1], [0, 1]]),
                     "position_ids": torch.tensor([[0, 1], [0, 0]])}, {"uid": [0, 1]})
    fake.script = {(5, 6): [([20], [-0.5])], (7,): [([30, 31], [-0.25, -1.0])]}
    out = _engine(fake, tokenizer, model_dir).generate(prompts, SamplingParams(n=3, max_new_tokens=2, do_sample=False))
    [(sent, sampling, _)] = fake.requests
    assert sent == [[5, 6]] * 3 + [[7]] * 3 and (sampling["n"], sampling["temperature"]) == (1, 0.0)
    pad = tokenizer.pad_token_id
    assert out["responses"].tolist() == [[20, pad]] * 3 + [[30, 31]] * 3
    assert out["rollout_log_prob"].tolist() == [[-0.5, 0.0]] * 3 + [[-0.25, -1.0]] * 3
    assert out.meta == {"uid": [0, 0, 0, 1, 1, 1]}


def test_engine_arguments(fake, tokenizer, model_dir):
    _engine(fake, tokenizer, model_dir, "actor_rollout_ref.rollout.dtype=float32",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
            "actor_rollout_ref.rollout.max_num_batched_tokens=256", seed=7, max_model_len=512)
    [(kwargs, multiprocessing)] = fake.built
    assert multiprocessing == "0"  # the engine core in this process, so that its model can be reached
    assert kwargs == {
        "model": str(model_dir), "tokenizer": str(model_dir), "dtype": "float32", "tensor_parallel_size": 1, "gpu_memory_utilization": 0.3,
        "enforce_eager": True, "enable_sleep_mode": True, "trust_remote_code": False,
        "max_num_batched_tokens": 512,  # raised to one whole sequence
        "enable_chunked_prefill": True, "disable_custom_all_reduce": True, "skip_tokenizer_init": False, "seed": 7, "max_model_len": 512,
        "logprobs_mode": "processed_logprobs", "generation_config": "vllm"}


def test_engine_arguments_of_an_older_vllm_in_a_worker_group(monkeypatch, tokenizer, model_dir):
    fake = FakeVLLM(monkeypatch, engine_fields=())  # no logprobs_mode or generation_config yet
    monkeypatch.setattr(distributed, "in_worker_group", lambda: True)
    _engine(fake, tokenizer, model_dir, "actor_rollout_ref.rollout.free_cache_engine=false",
            "actor_rollout_ref.rollout.enforce_eager=false", "actor_rollout_ref.rollout.enable_chunked_prefill=false",
            seed=3, max_model_len=None, trust_remote_code=True, hf_overrides={"attention_dropout": 0.0})
    assert fake.built[0][0] == {
        "model": str(model_dir), "tokenizer": str(model_dir), "dtype": "bfloat16", "tensor_parallel_size": 1, "gpu_memory_utilization": 0.5,
        "enforce_eager": False, "enable_sleep_mode": False, "trust_remote_code": True,
        "max_num_batched_tokens": 8192, "enable_chunked_prefill": False, "disable_custom_all_reduce": True,
        "skip_tokenizer_init": False,
        "seed": 3, "distributed_executor_backend": "external_launcher",
        "hf_overrides": {"attention_dropout": 0.0}}  # the actor's model.override_config


def test_vllm_reads_the_actors_tokenizer_where_model_tokenizer_path_puts_it(fake, tokenizer, model_dir, tmp_path):
    """With model.tokenizer_path, the folder the actor's tokenizer came from, not model.path, is vLLM's tokenizer (the
    EOS vLLM stops at; a model folder may hold no tokenizer at all): as the engine is given it, and as the actor
    worker gives it."""
    from rlhf_core.workers.actor import ActorWorker

    elsewhere = str(tmp_path / "tokenizer")
    _engine(fake, tokenizer, model_dir, tokenizer_path=elsewhere)
    assert fake.built[-1][0]["tokenizer"] == elsewhere

    cfg = load_config([f"actor_rollout_ref.model.path={model_dir}", f"actor_rollout_ref.model.tokenizer_path={elsewhere}",
                       "actor_rollout_ref.rollout.name=vllm"], validate=False)
    ActorWorker(cfg.resolved().actor_rollout_ref, tokenizer, total_steps=1, need_ref=False, max_model_len=512)
    assert (fake.built[-1][0]["model"], fake.built[-1][0]["tokenizer"]) == (str(model_dir), elsewhere)


def _tensor_parallel_pair(monkeypatch, rank: int, partner_prompts: list[list[int]]) -> tuple[list, object]:
    """This process as global rank ``rank`` of a two-rank run with tensor_model_parallel_size=2, the other
    rank of its engine holding ``partner_prompts``; returns the collectives asked for and the engine's group."""
    group, calls, position = object(), [], rank % 2

    def new_subgroups(group_size, backend):
        calls.append(("new_subgroups", group_size, backend))
        return group, [group]

    def all_gather_object(gathered, obj, group=None):
        calls.append(("all_gather_object", group))
        gathered[position], gathered[1 - position] = obj, partner_prompts

    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(distributed, "rank", lambda: rank)
    monkeypatch.setattr(torch.distributed, "new_subgroups", new_subgroups)
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: position)
    return calls, group


def test_both_ranks_of_a_tensor_parallel_engine_get_the_same_seed(fake, tokenizer, model_dir, monkeypatch):
    """The seed each rank's engine is built with, as the actor worker computes it (rollout_seed): ranks 0 and 1 serve
    engine 0, ranks 2 and 3 engine 1; the HF rollout's ranks each draw their own."""
    from rlhf_core.workers.actor import ROLLOUT_SEED_STRIDE, rollout_seed

    rollout = load_config(["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
                          validate=False).actor_rollout_ref.rollout
    for rank in range(4):
        _tensor_parallel_pair(monkeypatch, rank, [])
        _engine(fake, tokenizer, model_dir, "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                seed=rollout_seed(10, rank, rollout))
    assert [kwargs["seed"] for kwargs, _ in fake.built] == [10, 10, 10 + ROLLOUT_SEED_STRIDE, 10 + ROLLOUT_SEED_STRIDE]
    assert {kwargs["tensor_parallel_size"] for kwargs, _ in fake.built} == {2}
    hf = load_config(["actor_rollout_ref.rollout.tensor_model_parallel_size=2"], validate=False).actor_rollout_ref.rollout
    assert [rollout_seed(10, rank, hf) for rank in range(3)] == [10, 10 + ROLLOUT_SEED_STRIDE, 10 + 2 * ROLLOUT_SEED_STRIDE]


@pytest.mark.parametrize("rank", [2, 3])
def test_a_tensor_parallel_engine_serves_both_ranks_and_each_keeps_its_own(fake, tokenizer, model_dir,
                                                                             monkeypatch, rank):
    pad = tokenizer.pad_token_id
    partner = [[50, 51, 52], [53]]
    calls, group = _tensor_parallel_pair(monkeypatch, rank, partner)
    prompts = Batch({"input_ids": torch.tensor([[pad, 5, 6], [7, 8, 9]]),
                     "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
                     "position_ids": torch.tensor([[0, 0, 1], [0, 1, 2]])}, {"uid": [0, 1]})
    fake.script = {(50, 51, 52): [([60, 61], [-1.0, -1.0])], (53,): [([62], [-1.0])],
                   (5, 6): [([20, 21], [-0.5, -0.25])], (7, 8, 9): [([22], [-0.75])]}
    engine = _engine(fake, tokenizer, model_dir, "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    out = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=2))
    assert calls == [("new_subgroups", 2, "gloo"), ("all_gather_object", group)]
    # one request for the whole engine, in rank order
    mine = [[5, 6], [7, 8, 9]]
    assert fake.requests[0][0] == (partner + mine if rank % 2 else mine + partner)
    assert out["responses"].tolist() == [[20, 21], [22, pad]]
    assert out["rollout_log_prob"].tolist() == [[-0.5, -0.25], [-0.75, 0.0]]
    assert out.meta == {"uid": [0, 1]}


def _loaded(fake):
    return {name: tensor for name, tensor in fake.loaded}


def test_weights_are_loaded_between_waking_the_weights_and_the_kv_cache_and_only_when_stale(fake, tokenizer,
                                                                                           model_dir):
    engine = _engine(fake, tokenizer, model_dir)
    assert fake.events == ["sleep(level=1)", "empty_cache"]  # asleep from the start: training comes first
    assert fake.weight_calls == 0

    fake.events.clear()
    engine.resume()  # the checkpoint's weights are not the actor's: load them
    assert fake.events == ["wake_up(weights)", "load_weights", "synchronize", "reset_prefix_cache",
                           "wake_up(kv_cache)"]
    assert fake.weight_calls == 1

    fake.events.clear()
    engine.release()
    engine.release()  # already asleep
    engine.resume()  # the actor has not changed
    assert fake.events == ["sleep(level=1)", "empty_cache", "wake_up(weights)", "wake_up(kv_cache)"]
    assert fake.weight_calls == 1

    fake.events.clear()
    engine.resume()  # already awake and current
    assert fake.events == []

    fake.events.clear()
    engine.release()
    fake.actor["lm_head.weight"] = torch.tensor([[4.0, -0.25]])  # an actor update
    engine.sync_weights()
    assert fake.events == ["sleep(level=1)", "empty_cache"]  # nothing moves until the next rollout
    engine.resume()
    assert fake.events[2:] == ["wake_up(weights)", "load_weights", "synchronize", "reset_prefix_cache",
                               "wake_up(kv_cache)"]
    assert fake.weight_calls == 2
    assert _loaded(fake)["lm_head.weight"].tolist() == [[4.0, -0.25]]  # the new values, not the first load's


def test_without_free_cache_engine_the_engine_never_sleeps(fake, tokenizer, model_dir):
    engine = _engine(fake, tokenizer, model_dir, "actor_rollout_ref.rollout.free_cache_engine=false")
    engine.resume()
    engine.release()
    engine.resume()
    # never asleep, so the prefix cache (keyed by tokens, not weights) is reset with each load
    assert fake.events == ["load_weights", "synchronize", "reset_prefix_cache"]
    engine.sync_weights()
    engine.resume()
    assert fake.events == ["load_weights", "synchronize", "reset_prefix_cache"] * 2
    assert fake.weight_calls == 2


@pytest.mark.parametrize(("dtype", "torch_dtype"), [("bfloat16", torch.bfloat16), ("float32", torch.float32)])
def test_the_actors_tensors_go_to_the_gpu_in_the_rollout_dtype(fake, tokenizer, model_dir, dtype, torch_dtype):
    _engine(fake, tokenizer, model_dir, f"actor_rollout_ref.rollout.dtype={dtype}").resume()
    assert [name for name, _ in fake.loaded] == ["model.embed_tokens.weight", "lm_head.weight"]
    loaded = _loaded(fake)
    assert [t.dtype for t in loaded.values()] == [torch_dtype] * 2  # torch.equal below does not compare dtypes
    # values a bfloat16 holds exactly
    assert torch.equal(loaded["model.embed_tokens.weight"], torch.tensor([[1.5, -2.0], [0.25, 3.0]], dtype=torch_dtype))
    assert torch.equal(loaded["lm_head.weight"], torch.tensor([[-0.5, 0.125]], dtype=torch_dtype))
    assert fake.devices == [torch.device("cuda", 0)] * 2


@pytest.mark.parametrize("path", [V1_MODEL, V0_MODEL, OLD_V0_MODEL])
def test_the_model_is_found_wherever_the_vllm_version_keeps_it(monkeypatch, tokenizer, model_dir, path):
    fake = FakeVLLM(monkeypatch, model_path=path)
    _engine(fake, tokenizer, model_dir).resume()
    assert "load_weights" in fake.events


def test_an_unreachable_model_is_an_error_not_a_silent_skip(monkeypatch, tokenizer, model_dir):
    fake = FakeVLLM(monkeypatch, model_path="engine_core.client.model")  # a multiprocess engine core
    engine = _engine(fake, tokenizer, model_dir)
    with pytest.raises(RuntimeError, match="cannot reach the model inside the vLLM engine"):
        engine.resume()
