"""Rollout with vLLM (GPU, extra ``gpu``): vLLM as a library inside each actor worker.

One engine per worker process shares the GPU with training (verl's hybrid engine):

* the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so its model can be
  handed new weights directly; under a worker group vLLM joins the training world
  (``distributed_executor_backend="external_launcher"``) and every ``tensor_model_parallel_size``
  consecutive ranks form one tensor-parallel engine that serves the prompts of all its ranks;
* ``free_cache_engine``: between rollouts the engine sleeps (weights offloaded, KV cache freed),
  leaving the memory to training; :meth:`resume` wakes the weights, loads new ones if the actor
  has changed, then wakes the KV cache;
* :meth:`sync_weights` (called after every actor update) marks the weights stale; the next
  :meth:`resume` streams the actor's full tensors (``weights()``: gathered from the FSDP2 shards
  one tensor at a time, LoRA merged) into ``model.load_weights``, with nothing written to disk;
* a response ends where the HF rollout's ends (:func:`~rlhf_core.rollout.base.stop_tokens`: the tokenizer's EOS
  and every EOS id of the model's generation config, all passed as ``stop_token_ids``) and is padded alike;
* the sampled tokens' log-probs come back (``SamplingParams(logprobs=0)``) as
  ``rollout_log_prob`` so that the trainer can log how far they are from the training engine's
  recomputed ``old_log_prob`` (``rollout/logprob_gap``).

vllm is imported when an engine is built, never at package import.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator

import torch

from rlhf_core.batch import Batch
from rlhf_core.rollout.base import SamplingParams, call_seed, stop_tokens
from rlhf_core.workers import distributed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _engine_model(llm) -> torch.nn.Module:
    """The torch model inside an in-process vLLM engine (the attribute path differs across versions)."""
    engine = llm.llm_engine
    for path in ("model_executor.driver_worker.worker.model_runner.model",
                 "engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model",
                 "model_executor.driver_worker.model_runner.model"):
        node = engine
        try:
            for name in path.split("."):
                node = getattr(node, name)
        except AttributeError:
            continue
        return node
    raise RuntimeError("cannot reach the model inside the vLLM engine to load new weights; is "
                       "VLLM_ENABLE_V1_MULTIPROCESSING=0 honoured by this vLLM version?")


class VLLMRolloutEngine:
    """The RolloutEngine protocol on a vLLM ``LLM`` that receives the actor's weights in memory."""

    def __init__(self, module: torch.nn.Module, tokenizer, config, model_path: str,
                 weights: Callable[[], Iterator[tuple[str, torch.Tensor]]], max_model_len: int | None = None,
                 seed: int = 0, trust_remote_code: bool = False, hf_overrides: dict | None = None,
                 tokenizer_path: str | None = None):
        """``config`` is the ``actor_rollout_ref.rollout`` section; ``weights`` yields the actor's
        full tensors under transformers names (on every rank: gathering them is a collective);
        ``hf_overrides`` are the model config attributes the actor loaded with (``model.override_config``);
        ``tokenizer_path`` is the folder of ``tokenizer`` (``model.tokenizer_path``; None: ``model_path``)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vllm is imported: an in-process core
        from vllm import LLM
        from vllm.engine.arg_utils import EngineArgs

        self.module = module
        self.seed = seed
        self.weights = weights
        self.config = config
        self.dtype = DTYPES[config.dtype]
        # the HF rollout's ends of a response (the tokenizer's EOS and the actor's generation_config.eos_token_id): vLLM
        # ends a request at the EOS of the tokenizer it loads from model_path, and at the generation config's other ids
        # only where its version reads them with generation_config="vllm"; the whole set goes as stop_token_ids, which
        # vLLM treats as EOS (the token kept as the response's last, with its log-prob)
        self.eos_ids, self.pad_id = stop_tokens(module, tokenizer)
        self.tp = config.tensor_model_parallel_size
        self.tp_group = None
        if distributed.is_distributed() and self.tp > 1:  # every rank makes every group, then keeps its own
            self.tp_group, _ = torch.distributed.new_subgroups(group_size=self.tp, backend="gloo")
        kwargs = {
            # the actor's tokenizer, whose EOS vLLM stops at, rather than whatever model_path holds (maybe none)
            "model": model_path, "tokenizer": tokenizer_path or model_path, "dtype": config.dtype, "tensor_parallel_size": self.tp,
            "gpu_memory_utilization": config.gpu_memory_utilization, "enforce_eager": config.enforce_eager,
            "enable_sleep_mode": config.free_cache_engine, "trust_remote_code": trust_remote_code,
            "max_num_batched_tokens": max(config.max_num_batched_tokens, max_model_len or 0),
            "enable_chunked_prefill": config.enable_chunked_prefill,
            "disable_custom_all_reduce": True, "skip_tokenizer_init": False,
            "seed": seed,  # the actor gives every rank of one tensor-parallel engine the same (rollout_seed)
        }
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        if hf_overrides:
            kwargs["hf_overrides"] = hf_overrides
        if distributed.in_worker_group():
            kwargs["distributed_executor_backend"] = "external_launcher"  # vLLM joins the training world
        engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
        if "logprobs_mode" in engine_fields:
            # log-probs after the sampler's processing: temperature, as the training engine's, but also top-k /
            # top-p renormalised over the kept tokens (config validation keeps rollout correction off then)
            kwargs["logprobs_mode"] = "processed_logprobs"
        if "generation_config" in engine_fields:  # our sampling settings only, not the model's defaults
            kwargs["generation_config"] = "vllm"
        self.llm = LLM(**kwargs)
        self.awake = True
        self.stale = True  # the engine holds the checkpoint's weights, not (yet) the actor's
        self.release()

    # ------------------------------------------------------------------ memory and weights
    def sync_weights(self) -> None:
        """The actor changed: load its weights before the next generation."""
        self.stale = True

    def release(self) -> None:
        """Sleep: offload the weights and free the KV cache (``free_cache_engine``)."""
        if self.config.free_cache_engine and self.awake:
            self.llm.sleep(level=1)
            self.awake = False
            torch.cuda.empty_cache()

    def resume(self) -> None:
        """Wake the weights, load the actor's if they changed, then wake the KV cache."""
        sleeping = self.config.free_cache_engine and not self.awake
        if sleeping:
            self.llm.wake_up(tags=["weights"])
        if self.stale:
            self._load_weights()
        if sleeping:
            self.llm.wake_up(tags=["kv_cache"])
        self.awake = True

    @torch.no_grad()
    def _load_weights(self) -> None:
        model = _engine_model(self.llm)
        device = torch.device("cuda", torch.cuda.current_device())
        model.load_weights((name, tensor.to(device=device, dtype=self.dtype)) for name, tensor in self.weights())
        torch.cuda.synchronize()
        # cached prefixes are keyed by tokens, not weights: without free_cache_engine (whose sleep resets it) a
        # prompt seen before would reuse keys and values of the old policy
        self.llm.reset_prefix_cache()
        self.stale = False

    # ------------------------------------------------------------------ generation
    def _group_prompts(self, prompts: list[list[int]]) -> tuple[list[list[int]], slice]:
        """With tensor parallelism, the prompts of every rank of this engine, and where this rank's are."""
        if self.tp_group is None:
            return prompts, slice(0, len(prompts))
        gathered: list = [None] * self.tp
        torch.distributed.all_gather_object(gathered, prompts, group=self.tp_group)
        position = torch.distributed.get_rank(self.tp_group)
        start = sum(len(p) for p in gathered[:position])
        return [p for part in gathered for p in part], slice(start, start + len(prompts))

    @torch.no_grad()
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        prompt_ids, prompt_mask = prompts["input_ids"], prompts["attention_mask"]
        own = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]  # no left padding
        everyone, mine = self._group_prompts(own)
        n, width = params.n, params.max_new_tokens  # every rank pads to the same width
        copies = n if params.greedy else 1  # vLLM refuses n > 1 when greedy: each prompt goes n times, n=1
        options = dict(
            n=n // copies, max_tokens=width, logprobs=0,
            temperature=0.0 if params.greedy else params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1, ignore_eos=params.ignore_eos,
            # with ignore_eos none: vLLM ends a request at a stop id even then
            stop_token_ids=[] if params.ignore_eos else list(self.eos_ids),
        )
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in everyone for _ in range(copies)]
        if params.seed is None or params.greedy:
            sampling = VLLMSamplingParams(**options)
        else:  # a stream of its own for each prompt (vLLM's per-request seed; a request's n samples draw from
            # seed, seed + 1, ...), the same on every rank of the engine, and the engine's generator left alone
            sampling = [VLLMSamplingParams(**options, seed=call_seed(self.seed, params.seed, index))
                        for index in range(len(requests))]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)[mine.start * copies:mine.stop * copies]
        samples = [sample for request in outputs for sample in request.outputs]  # a prompt's n are adjacent

        rows = len(own) * n
        responses = torch.full((rows, width), self.pad_id, dtype=torch.long)
        response_mask = torch.zeros(rows, width, dtype=torch.long)
        rollout_log_prob = torch.zeros(rows, width)
        for row, sample in enumerate(samples):
            length = len(sample.token_ids)
            responses[row, :length] = torch.tensor(sample.token_ids, dtype=torch.long)
            response_mask[row, :length] = 1  # EOS, when sampled, is kept
            if sample.logprobs is not None:
                rollout_log_prob[row, :length] = torch.tensor(
                    [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)])
        prompt_ids = prompt_ids.repeat_interleave(n, dim=0).cpu()
        prompt_mask = prompt_mask.repeat_interleave(n, dim=0).cpu()
        prompt_pos = prompts["position_ids"].repeat_interleave(n, dim=0).cpu()
        response_pos = prompt_pos[:, -1:] + torch.arange(1, width + 1)  # (B*n, R)
        return Batch(
            {
                "prompts": prompt_ids, "responses": responses, "response_mask": response_mask,
                "input_ids": torch.cat([prompt_ids, responses], dim=1),
                "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
                "position_ids": torch.cat([prompt_pos, response_pos], dim=1),
                "rollout_log_prob": rollout_log_prob,
            },
            {k: [x for x in v for _ in range(n)] for k, v in prompts.meta.items()},
        )
