"""The typed config tree, with verl's key names and defaults, built on OmegaConf structured configs.

The dataclasses below are the schema (each key's default and one-line help, mirrored by
``configs/ppo_trainer.yaml``). Loading order: the defaults, then optional YAML files of overrides (in the order
given, a later file's keys overriding an earlier one's), then command-line overrides in Hydra's grammar, as verl
users type them:

    key=value   +key=value   ~key (back to the default)   trainer.logger=[console,wandb]
    data.train_files='["a.parquet","b.parquet"]'   trainer.default_local_dir=out/${trainer.experiment_name}

``~`` on an entry of a mapping whose keys the user names (``OPEN_KEYS``: ``~trainer.ray_runtime_env.env_vars.X``)
removes that entry.

OmegaConf types each value against the schema and resolves ``${...}`` interpolations. What it does not do
is done here: the aliases (with a notice), "did you mean" for unknown keys, and the consistency checks of
:func:`validate_config`. Every problem is collected and raised together as a :class:`ConfigError` before
any model or data is touched; each message names the key, the value and the fix.

    python -m rlhf_core.config [--config FILE ...] [key=value ...]

prints the resolved tree as YAML (exit 0) or the errors on stderr (exit 2).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import difflib
import functools
import math
import os
import re
import shlex
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

if __name__ == "__main__":  # run as `rlhf config` is (rlhf_core.cli), before the imports below (Hydra and
    # OmegaConf), so that a Ctrl-C in the command's first seconds ends it with one line and exit 130, not a
    # traceback
    from rlhf_core.cli import _run

    sys.exit(_run("config", None, "python -m rlhf_core.config"))

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    ConfigTypeError,
    GrammarParseError,
    InterpolationResolutionError,
    KeyValidationError,
    MissingMandatoryValue,
    ValidationError,
)

# ----------------------------------------------------------------------------- names without a registry
# (estimators, KL types, aggregation modes, KL controllers, policy losses, dynamic-sampling metrics, rollout
# correction modes, rollout engines and loggers are the keys of their registries in algos, rollout and tracking:
# validate_config reads them there)

STRATEGIES = ("fsdp", "fsdp2")
TRUNCATIONS = ("error", "left", "right", "middle")
LR_SCHEDULERS = ("constant", "cosine")
RESUME_MODES = ("auto", "disable", "resume_path")
DEVICES = ("cpu", "cuda")
OVERLONG_PAIRS = ("truncate", "drop")  # reward_model.train.overlong: what rlhf-train-rm does with a long pair
CPU_MATMULS = ("auto", "onednn", "blas")  # trainer.cpu_matmul: rlhf_core.models.cpu_matmul's choices
CPU_MATMUL_DTYPES = ("float32", "bfloat16")  # trainer.cpu_matmul_dtype
DTYPES = ("float32", "bfloat16", "float16")
#: the keys of apply_chat_template that are its own arguments, not variables of the chat template, each with what
#: decides it here instead: in a *chat_template_kwargs mapping one is given twice (every prompt then fails, blamed on
#: its row), or changes what every prompt is without a word (max_length cut each to so many tokens)
RENDERER_ARGUMENTS = {
    "add_generation_prompt": "every prompt ends in the template's generation prompt",
    "continue_final_message": "every prompt ends in the template's generation prompt",
    "conversation": "the messages are each row's prompt",
    "chat_template": "the chat template is the tokenizer's: put it in its tokenizer_config.json (chat_template)",
    "tokenize": "the prompts are rendered to token ids",
    "return_dict": "the prompts are rendered to token ids",
    "return_tensors": "the prompts are rendered to token ids",
    "return_assistant_tokens_mask": "the prompts are rendered to token ids",
    "tokenizer_kwargs": "the prompts are rendered to token ids",
    "padding": "the prompts are padded as they are batched",
    "truncation": "over-long prompts are cut as data.max_prompt_length and data.truncation say",
    "max_length": "over-long prompts are cut as data.max_prompt_length and data.truncation say",
}


#: a string or a list of strings: OmegaConf has no union of the two, so validate_config checks it
StrOrList = Any


def _k(default: Any, help: str) -> Any:  # noqa: A002 - 'help' reads best in the tree below
    """A config key: its default and the one-line comment written beside it in the YAML."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _section(cls: type, help: str) -> Any:  # noqa: A002
    return field(default_factory=cls, metadata={"help": help})


# ${coalesce:a,b}: the first of its values that is not null. A default that follows another key through
# an interpolation needs it where that key may itself be null (the policy's tokenizer_path), since null
# keeps a meaning of its own in the key that follows (verl's reward_model.model.input_tokenizer)
if not OmegaConf.has_resolver("coalesce"):
    OmegaConf.register_new_resolver("coalesce", lambda *values: next((v for v in values if v is not None), None))


# ----------------------------------------------------------------------------- the tree


@dataclass
class DataConfig:
    tokenizer: str | None = _k(None, "tokenizer the data checks measure prompts with; null = the actor's, with "
                                     "which training renders them (another must share its vocabulary and chat "
                                     "template)")
    train_files: StrOrList = _k("~/data/gsm8k/train.parquet", "training parquet file(s), verl schema")
    val_files: StrOrList = _k("~/data/gsm8k/test.parquet", "validation parquet file(s)")
    train_max_samples: int = _k(-1, "training prompts kept (before filter_overlong_prompts): with data.shuffle a "
                                     "draw seeded by data.seed, else the first ones, as verl's; -1 = all")
    val_max_samples: int = _k(-1, "validation prompts the trainer's validation keeps, drawn as train_max_samples "
                                  "(data.shuffle and data.seed decide, as in verl); -1 = all; the pipelines' "
                                  "evaluate step reads every prompt, capped by its own max_problems")
    prompt_key: str = _k("prompt", "column holding the chat messages of each prompt")
    reward_fn_key: str = _k("data_source", "column that selects the reward function")
    max_prompt_length: int = _k(512, "prompts longer than this (in tokens) are truncated or rejected")
    max_response_length: int = _k(512, "maximum number of generated tokens per response")
    train_batch_size: int = _k(1024, "prompts per PPO iteration")
    gen_batch_size: int | None = _k(None, "prompts per generation round of dynamic sampling "
                                          "(algorithm.filter_groups); null = train_batch_size")
    val_batch_size: int | None = _k(None, "prompts per validation batch; null = the whole validation set")
    return_raw_chat: bool = _k(False, "keep the raw chat messages in the batch")
    shuffle: bool = _k(True, "shuffle the training prompts each epoch")
    seed: int | None = _k(1, "seed of the training-data shuffle; null = trainer.seed (newer verl's null, an unseeded "
                             "shuffle, stays reproducible here)")
    truncation: str = _k("error", "over-long prompts: error | left | right | middle (keep both ends)")
    filter_overlong_prompts: bool = _k(False, "drop prompts longer than max_prompt_length before training")
    apply_chat_template_kwargs: dict[str, Any] = _k({}, "keyword arguments to the tokenizer's chat template, e.g. "
                                                        "enable_thinking: false")


TARGET_MODULES_HELP = ("linear layers that get LoRA adapters: a list of names or their last parts, e.g. "
                       "[q_proj,v_proj]; a string is one regular expression over whole names; all-linear: "
                       "all but the output head")
SHARED_PREFIX_HELP = ("run each distinct prompt of a micro-batch once, its rollout.n responses attending to its "
                      "KV cache: the same values and gradients for 1/n of the prompt's work (one process, padded "
                      "rows, Llama/Qwen/Mistral heads; with gradient checkpointing the passes without gradients "
                      "only; else the usual path)")


@dataclass
class ModelConfig:
    path: str = _k("~/models/deepseek-llm-7b-chat", "local HF model directory of the policy")
    tokenizer_path: str | None = _k(None, "tokenizer directory; null = model.path")
    dtype: str = _k("float32", "dtype of the trained weights: float32 | bfloat16 | float16")
    enable_gradient_checkpointing: bool = _k(True, "recompute activations in backward to save memory")
    use_remove_padding: bool = _k(False, "pack sequences without pad tokens (flash-attn on CUDA, or the CPU)")
    use_fused_kernels: bool = _k(False, "log-probs through the LM head in chunks of positions, never the whole "
                                        "(tokens x vocabulary) logits: less memory, one more head matmul "
                                        "(one process, padded rows, Llama/Qwen/Mistral heads; else the usual path)")
    use_shared_prefix: bool = _k(False, SHARED_PREFIX_HELP)
    lora_rank: int = _k(0, "LoRA rank; 0 trains all weights")
    lora_alpha: int = _k(16, "LoRA scaling numerator")
    target_modules: StrOrList = _k("all-linear", TARGET_MODULES_HELP)
    trust_remote_code: bool = _k(False, "allow model code from the model directory")
    external_lib: str | None = _k(None, "python module imported before loading (custom architectures)")
    override_config: dict[str, Any] = _k({}, "model config attributes set before loading, e.g. attention_dropout: 0.0")
    disable_dropout: bool = _k(False, "every dropout (and MoE router jitter) of the policy and its reference off for the run, so the "
                                      "updates see the log-probs the rollout-time passes computed (TRL's GRPO "
                                      "option; verl keeps dropout); exports keep the base's dropout settings")


@dataclass
class OptimConfig:
    lr: float = _k(1e-6, "AdamW learning rate")
    betas: list[float] = _k([0.9, 0.999], "AdamW betas")
    weight_decay: float = _k(0.01, "AdamW weight decay")
    lr_warmup_steps: int = _k(-1, "warm-up steps, the rate rising linearly from 0 (as verl's); "
                                  "-1 = use lr_warmup_steps_ratio")
    lr_warmup_steps_ratio: float = _k(0.0, "warm-up steps as a share of total training steps")
    lr_scheduler_type: str = _k("constant", "after warm-up: constant | cosine")
    min_lr_ratio: float = _k(0.0, "cosine schedule floor as a share of lr")
    num_cycles: float = _k(0.5, "cosine cycles over the run (0.5 = one half-wave down)")


@dataclass
class FSDPConfig:
    param_offload: bool = _k(False, "keep sharded parameters on CPU between uses")
    optimizer_offload: bool = _k(False, "keep optimizer state on CPU")
    reshard_after_forward: bool = _k(True, "free gathered parameters after each forward")
    param_dtype: str = _k("bfloat16", "dtype of gathered parameters in forward/backward on GPU (CPU: float32)")
    reduce_dtype: str = _k("float32", "dtype of the gradient reduce-scatter on GPU (CPU: float32)")


@dataclass
class PolicyLossConfig:
    loss_mode: str = _k("vanilla", "vanilla (PPO clip) | gspo (sequence-level ratio; always seq-mean-token-mean) | "
                                   "cispo (truncated, detached IS weight)")


@dataclass
class ActorConfig:
    strategy: str = _k("fsdp", "training backend: fsdp | fsdp2 (both use torch FSDP2 fully_shard)")
    ppo_mini_batch_size: int = _k(256, "prompts per optimizer step (times rollout.n sequences)")
    ppo_micro_batch_size_per_gpu: int | None = _k(4, "sequences per forward/backward on one worker")
    use_dynamic_bsz: bool = _k(False, "cut micro-batches by token count instead of sequence count")
    ppo_max_token_len_per_gpu: int = _k(16384, "tokens per micro-batch with use_dynamic_bsz")
    ppo_epochs: int = _k(1, "passes over each rollout batch")
    shuffle: bool = _k(False, "shuffle sequences between mini-batches")
    clip_ratio: float = _k(0.2, "PPO clip range epsilon")
    clip_ratio_low: float | None = _k(None, "lower clip range; null = clip_ratio")
    clip_ratio_high: float | None = _k(None, "upper clip range; null = clip_ratio")
    clip_ratio_c: float = _k(3.0, "dual-clip bound for negative advantages (> 1)")
    loss_agg_mode: str = _k("token-mean", "token-mean | seq-mean-token-sum | seq-mean-token-mean | "
                                          "seq-mean-token-sum-norm")
    loss_scale_factor: int | None = _k(None, "divisor of seq-mean-token-sum-norm (Dr. GRPO); null = "
                                             "data.max_response_length, the same for every batch")
    policy_loss: PolicyLossConfig = _section(PolicyLossConfig, "which policy loss")
    entropy_coeff: float = _k(0.0, "entropy bonus coefficient")
    use_kl_loss: bool = _k(False, "add a KL(actor || ref) term to the policy loss")
    kl_loss_coef: float = _k(0.001, "coefficient of the KL loss")
    kl_loss_type: str = _k("low_var_kl", "KL estimator of the KL loss: kl | abs | mse | low_var_kl (k1/k2/k3); "
                                         "with + (k3+): its value, k2's gradient")
    grad_clip: float = _k(1.0, "clip the gradient norm to this value; inf = no clipping")
    use_torch_compile: bool = _k(False, "torch.compile (inductor, dynamic shapes) each MLP and RMS norm of the "
                                        "policy and reference, fusing their elementwise work; on by default in "
                                        "verl, off here: on 2 CPU cores it did not pay for its compile time "
                                        "(bench/RESULTS.md)")
    optim: OptimConfig = _section(OptimConfig, "actor optimizer")
    fsdp_config: FSDPConfig = _section(FSDPConfig, "actor sharding")


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int | None = _k(16, "sequences per reference forward")
    log_prob_use_dynamic_bsz: bool | None = _k(None, "cut reference micro-batches by tokens; null = the actor's "
                                                     "use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int | None = _k(None, "tokens per reference micro-batch; null = the actor's "
                                                          "ppo_max_token_len_per_gpu")
    fsdp_config: FSDPConfig = _section(FSDPConfig, "reference sharding")


@dataclass
class ValKwargsConfig:
    do_sample: bool = _k(False, "sample during validation (false = greedy)")
    temperature: float = _k(0.0, "validation temperature when sampling")
    top_p: float = _k(1.0, "validation nucleus sampling")
    top_k: int = _k(-1, "validation top-k; -1 = off")
    n: int = _k(1, "responses per validation prompt")


@dataclass
class RolloutConfig:
    name: str = _k("hf", "rollout engine: hf (transformers generate) | vllm (GPU)")
    n: int = _k(1, "responses sampled per prompt")
    temperature: float = _k(1.0, "sampling temperature")
    top_p: float = _k(1.0, "nucleus sampling threshold")
    top_k: int = _k(-1, "top-k sampling; -1 = off")
    do_sample: bool = _k(True, "sample (false = greedy) during training rollouts")
    ignore_eos: bool = _k(False, "training rollouts sample past EOS to max_response_length (fixed-length "
                                 "responses, as for throughput benchmarks); validation always stops at EOS")
    dtype: str = _k("bfloat16", "dtype of the rollout engine's weights (vllm)")
    tensor_model_parallel_size: int = _k(1, "vLLM tensor parallel size")
    gpu_memory_utilization: float = _k(0.5, "share of GPU memory vLLM may take")
    free_cache_engine: bool = _k(True, "sleep vLLM and free its KV cache while training")
    enforce_eager: bool = _k(True, "disable CUDA graphs in vLLM")
    max_num_batched_tokens: int = _k(8192, "vLLM scheduler token budget")
    enable_chunked_prefill: bool = _k(True, "vLLM splits long prompts' prefill into chunks")
    log_prob_micro_batch_size_per_gpu: int | None = _k(8, "sequences per old-log-prob forward")
    log_prob_use_dynamic_bsz: bool | None = _k(None, "cut old-log-prob micro-batches by tokens; null = the "
                                                     "actor's use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int | None = _k(None, "tokens per old-log-prob micro-batch; null = the actor's "
                                                          "ppo_max_token_len_per_gpu")
    val_kwargs: ValKwargsConfig = _section(ValKwargsConfig, "generation settings for validation")


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = _k(True, "actor, rollout and reference share workers and weights")
    nccl_timeout: int = _k(1800, "seconds a collective between workers (NCCL, or gloo on CPU) waits for a peer "
                                 "before the call fails (verl: 600; longer here for slow CPU steps)")
    model: ModelConfig = _section(ModelConfig, "the policy model")
    actor: ActorConfig = _section(ActorConfig, "the policy update")
    ref: RefConfig = _section(RefConfig, "the frozen reference policy")
    rollout: RolloutConfig = _section(RolloutConfig, "response generation")


@dataclass
class CriticModelConfig:
    path: str | None = _k(None, "critic initialisation; null = the actor's model path")
    tokenizer_path: str | None = _k(None, "tokenizer directory; null = the actor's")
    enable_gradient_checkpointing: bool = _k(True, "recompute activations in backward")
    use_remove_padding: bool = _k(False, "pack sequences without pad tokens (flash-attn on CUDA, or the CPU)")
    use_shared_prefix: bool = _k(False, SHARED_PREFIX_HELP)
    lora_rank: int = _k(0, "LoRA rank of the critic; 0 trains all weights")
    lora_alpha: int = _k(16, "LoRA scaling numerator")
    target_modules: StrOrList = _k("all-linear", TARGET_MODULES_HELP)
    trust_remote_code: bool | None = _k(None, "allow model code from the model directory; null = the actor's "
                                              "setting")
    override_config: dict[str, Any] = _k({}, "critic model config attributes set before loading")
    disable_dropout: bool = _k(False, "every dropout (and MoE router jitter) of the value model off for the run, so the update's "
                                      "predictions start at the rollout-time values (verl keeps dropout)")


@dataclass
class CriticConfig:
    strategy: str = _k("fsdp", "training backend: fsdp | fsdp2")
    model: CriticModelConfig = _section(CriticModelConfig, "the value model")
    optim: OptimConfig = _section(lambda: OptimConfig(lr=1e-5), "critic optimizer")
    ppo_mini_batch_size: int | None = _k(None, "prompts per critic step; null = the actor's")
    ppo_micro_batch_size_per_gpu: int | None = _k(4, "sequences per critic forward/backward")
    use_dynamic_bsz: bool | None = _k(None, "token-count micro-batches; null = the actor's setting")
    ppo_max_token_len_per_gpu: int = _k(32768, "tokens per critic micro-batch with dynamic batching")
    ppo_epochs: int | None = _k(None, "passes over each rollout batch; null = the actor's")
    shuffle: bool | None = _k(None, "shuffle sequences between mini-batches; null = the actor's setting")
    grad_clip: float = _k(1.0, "clip the critic gradient norm to this value; inf = no clipping")
    cliprange_value: float = _k(0.5, "value clipping range around the old values")
    loss_agg_mode: str | None = _k(None, "token-mean | seq-mean-token-sum | seq-mean-token-mean | "
                                         "seq-mean-token-sum-norm; null = the actor's")
    fsdp_config: FSDPConfig = _section(FSDPConfig, "critic sharding")


@dataclass
class OverlongBufferConfig:
    enable: bool = _k(False, "DAPO's soft penalty on responses that run into the last len tokens before the limit")
    len: int = _k(0, "tokens before data.max_response_length where the penalty grows linearly from 0")
    penalty_factor: float = _k(1.0, "penalty at data.max_response_length (subtracted from the score)")
    log: bool = _k(False, "log critic/overlong_reward/mean and critic/overlong/ratio")


@dataclass
class RewardTrainModelConfig:
    path: str = _k("~/models/deepseek-llm-7b-chat", "causal LM (or reward model) directory the reward model starts "
                                                      "from; a one-label scalar head is added")
    tokenizer_path: str | None = _k(None, "tokenizer directory; null = path")
    dtype: str = _k("float32", "dtype of the trained weights: float32 | bfloat16 | float16")
    enable_gradient_checkpointing: bool = _k(False, "recompute activations in backward to save memory")
    lora_rank: int = _k(0, "LoRA rank; 0 trains all weights (the scalar head is always trained in full)")
    lora_alpha: int = _k(16, "LoRA scaling numerator")
    target_modules: StrOrList = _k("all-linear", TARGET_MODULES_HELP)
    trust_remote_code: bool = _k(False, "allow model code from the model directory")


@dataclass
class RewardTrainConfig:
    train_files: StrOrList = _k("~/data/preference/train.parquet", "preference parquet file(s): prompt, "
                                                                           "chosen, rejected")
    val_files: StrOrList = _k("~/data/preference/val.parquet", "held-out preference file(s); null "
                                                                               "= no validation")
    model: RewardTrainModelConfig = _section(RewardTrainModelConfig, "the backbone and its adapters")
    train_batch_size: int = _k(64, "pairs per optimizer step (over all workers)")
    micro_batch_size_per_gpu: int = _k(8, "pairs per forward/backward on one worker (2 sequences each)")
    max_length: int | None = _k(None, "tokens per prompt + response, at most the model's positions; null = the "
                                      "model's max_position_embeddings (1024 where it names none), as the run then "
                                      "records; longer pairs (overlong=truncate) lose tokens from the left: the same "
                                      "prompt tokens on both sides (one context for the two), then a response's own "
                                      "start; a pair left with the same ids on both sides is dropped")
    overlong: str = _k("truncate", "a pair with either side over max_length: truncate (cut from the left as "
                                   "max_length says, the pair kept) | drop (left out of training and validation, as "
                                   "TRL's RewardTrainer: each text scored whole, but fewer pairs, long answers first)")
    apply_chat_template_kwargs: dict[str, Any] = _k("${data.apply_chat_template_kwargs}",
                                                    "keyword arguments to the chat template when encoding the pairs, "
                                                    "recorded in the export's config.json (chat_template_kwargs)")
    total_epochs: int = _k(1, "passes over the training pairs")
    total_training_steps: int | None = _k(None, "stop after this many optimizer steps; null = epochs decide")
    margin: float = _k(0.0, "Bradley-Terry margin m: loss = -log sigmoid(r_chosen - r_rejected - m)")
    grad_clip: float = _k(1.0, "clip the gradient norm to this value; inf = no clipping")
    max_consecutive_skips: int | None = _k(3, "consecutive steps with a non-finite loss or gradient (skipped, no "
                                              "update) before the run stops (exit 1); null = off (a run whose every "
                                              "step was skipped stops either way, exporting nothing)")
    disable_dropout: bool = _k(True, "train with every dropout (and MoE router jitter) of the backbone and head off (as TRL's reward "
                                     "trainer): the loss compares two scores as PPO reads them, without dropout; "
                                     "the export keeps the base's dropout settings")
    optim: OptimConfig = _section(lambda: OptimConfig(lr=1e-5, lr_warmup_steps_ratio=0.03),
                                  "reward-model optimizer (AdamW; warm-up then constant | cosine)")
    fsdp_config: FSDPConfig = _section(FSDPConfig, "reward-model sharding with several workers")
    seed: int = _k(1, "seed of the head init and the pair order")
    test_freq: int = _k(-1, "validate every N steps; -1 = only at the end")
    save_freq: int = _k(-1, "checkpoint every N steps (and at the end); -1 = only at the end")
    default_local_dir: str = _k("checkpoints/${trainer.project_name}/${trainer.experiment_name}/reward_model",
                                "reward-model checkpoints, metrics.jsonl and the huggingface/ export")
    resume_mode: str = _k("auto", "auto (the latest checkpoint in default_local_dir, if any) | disable | "
                                  "resume_path")
    resume_from_path: str | None = _k(None, "global_step_N directory for resume_mode=resume_path")
    min_pair_accuracy: float = _k(0.0, "the pipeline stops before PPO when held-out pair accuracy is below this")


@dataclass
class RewardModelModelConfig:
    path: str | None = _k(None, "HF sequence-classification directory (num_labels=1, with its tokenizer) of the "
                                "reward model")
    input_tokenizer: str | None = _k("${coalesce:${actor_rollout_ref.model.tokenizer_path},"
                                     "${actor_rollout_ref.model.path}}",
                                     "tokenizer of the policy's ids (the policy's tokenizer_path, else its path); "
                                     "where it or input_chat_template_kwargs differs from the reward model's, "
                                     "responses are decoded and re-encoded with the reward model's chat template; "
                                     "null = feed the policy's ids as they are")
    input_chat_template_kwargs: dict[str, Any] = _k("${data.apply_chat_template_kwargs}",
                                                    "chat-template keyword arguments of the policy's prompts, "
                                                    "compared with those the reward model was trained with (its "
                                                    "config.json's chat_template_kwargs; none where absent)")
    trust_remote_code: bool = _k(False, "allow model code from the reward model directory")
    use_shared_prefix: bool = _k(False, "score each distinct prompt of a micro-batch once, its rollout.n responses "
                                        "attending to its KV cache: the same scores for 1/n of the prompt's work "
                                        "(one process, the policy's own ids, Llama/Qwen/Mistral heads; else the "
                                        "usual path)")
    fsdp_config: FSDPConfig = _section(FSDPConfig, "reward model sharding (with more than one worker)")


@dataclass
class RewardModelConfig:
    enable: bool = _k(False, "score responses with a learned reward model (reward_model.model.path)")
    model: RewardModelModelConfig = _section(RewardModelModelConfig, "the reward model")
    micro_batch_size_per_gpu: int = _k(16, "sequences per reward-model forward on one worker")
    max_length: int | None = _k(None, "where the reward model re-encodes each conversation (its tokenizer or chat "
                                      "template differs from the policy's): the longest sequence it scores; longer "
                                      "ones lose tokens from the left, the prompt's first, so the response's end, "
                                      "where the score is read, stays; null = its max_position_embeddings (the "
                                      "policy's ids scored as they are are never cut)")
    rm_coef: float = _k(1.0, "with enable: score = rm_coef * model score + rule_coef * rule score, on the last "
                             "response token")
    rule_coef: float = _k(0.0, "weight of the rule (or custom) reward in that sum; 0 = the model alone (as verl); "
                               "the rule is still logged as the gold reward (on prompts that have a ground truth: "
                               "with 0, data rows may leave it out)")
    reward_manager: str = _k("naive", "naive (the function per response; dapo: the same, its overlong shaping under "
                                      "overlong_buffer) | batch (custom_reward_function called once a batch with "
                                      "lists: data_sources, solution_strs, ground_truths, extra_infos)")
    overlong_buffer: OverlongBufferConfig = _section(OverlongBufferConfig, "DAPO overlong reward shaping")
    train: RewardTrainConfig = _section(RewardTrainConfig, "training a reward model on preference pairs "
                                                           "(rlhf-train-rm)")


@dataclass
class CustomRewardFunctionConfig:
    path: str | None = _k(None, "python file defining a reward function; null = built-in rules")
    name: str = _k("compute_score", "function name in that file")
    reward_kwargs: dict[str, Any] = _k({}, "keyword arguments given to the function at every call")


@dataclass
class KLCtrlConfig:
    type: str = _k("fixed", "KL-in-reward coefficient controller: fixed | adaptive")
    kl_coef: float = _k(0.001, "initial KL coefficient beta")
    horizon: int = _k(10000, "adaptive controller horizon")
    target_kl: float = _k(0.1, "adaptive controller target KL")


@dataclass
class FilterGroupsConfig:
    enable: bool = _k(False, "DAPO dynamic sampling: drop prompt groups whose responses all score the same")
    metric: str = _k("seq_reward", "what must differ within a group: seq_reward (summed token scores) | "
                                   "seq_final_reward (the same; no KL in the reward) | score | acc | a number a "
                                   "custom reward function reports")
    max_num_gen_batches: int = _k(10, "generation batches per step before training on a partial batch; <= 0 = no "
                                      "limit")


@dataclass
class RolloutCorrectionConfig:
    rollout_is: str | None = _k(None, "truncated importance weights pi_train / pi_rollout: null | token | sequence")
    rollout_is_threshold: float = _k(2.0, "upper bound of the importance weights")
    rollout_rs: str | None = _k(None, "rejection of out-of-bound tokens/responses from the losses (the KL penalty "
                                      "and advantages stay over all sampled tokens): null | token_k1|k2|k3 | "
                                      "seq_sum_k1|k2|k3 | seq_mean_k1|k2|k3 | seq_max_k2|k3")
    rollout_rs_threshold: float | None = _k(None, "rejection bound: k1 ratio in [1/t, t], k2/k3 statistic <= t")


@dataclass
class AlgorithmConfig:
    gamma: float = _k(1.0, "discount factor")
    lam: float = _k(1.0, "GAE lambda")
    adv_estimator: str = _k("gae", "gae | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | remax "
                                   "| grpo_passk")
    norm_adv_by_std_in_grpo: bool = _k(True, "divide GRPO advantages by the group std (false + "
                                             "loss_agg_mode=seq-mean-token-sum-norm = Dr. GRPO)")
    use_kl_in_reward: bool = _k(False, "subtract beta * KL(actor || ref) from the token rewards")
    kl_penalty: str = _k("kl", "KL estimator in the reward: kl | abs | mse | low_var_kl (k1/k2/k3); with + its "
                               "value alone (a reward carries no gradient)")
    kl_ctrl: KLCtrlConfig = _section(KLCtrlConfig, "KL-in-reward controller")
    filter_groups: FilterGroupsConfig = _section(FilterGroupsConfig, "DAPO dynamic sampling")
    rollout_correction: RolloutCorrectionConfig = _section(
        RolloutCorrectionConfig, "importance weights and rejection between the rollout engine's log-probs and the "
                                 "trainer's (vLLM; a no-op with hf)")


@dataclass
class GuardConfig:
    max_consecutive_skips: int | None = _k(3, "consecutive steps with a non-finite loss or gradient before "
                                              "restoring the last good checkpoint and stopping; null = off")
    max_kl: float | None = _k(1.0, "KL per token (actor/ppo_kl, actor/reward_kl_penalty, the KL loss as "
                                   "actor/kl_loss_token_mean) above this is an explosion; null = off")
    patience: int = _k(3, "consecutive steps above max_kl before rolling back")
    target_kl: float = _k(0.01, "target KL of the adaptive KL controller switched on after a KL rollback")
    max_val_drop: float | None = _k(0.2, "roll back to the best checkpoint when validation accuracy falls this "
                                         "far below the best seen; null = off")
    max_rollbacks: int = _k(3, "rollbacks each guard may make in a run (the KL / skip / val-drop guard and the "
                               "over-optimisation guard count apart); its next trigger stops the run with an error")
    overopt_patience: int | None = _k(3, "with a reward model: validations in a row where its score (the proxy, "
                                         "whatever rule_coef mixes in) rose while the gold (rule) reward fell "
                                         "before acting; null = off")
    overopt_action: str = _k("rollback", "then: rollback (to the best-gold checkpoint) | stop")


@dataclass
class TrainerConfig:
    project_name: str = _k("verl_examples", "project name for loggers and checkpoint paths")
    experiment_name: str = _k("gsm8k", "run name for loggers and checkpoint paths")
    logger: list[str] = _k(["console"], "console | file | tensorboard | wandb | mlflow")
    log_val_generations: int = _k(0, "validation samples (prompt, response, score) logged after each validation: "
                                     "printed, in val_generations.jsonl, and to tensorboard, wandb or mlflow")
    total_epochs: int = _k(30, "passes over the training data")
    total_training_steps: int | None = _k(None, "stop after this many steps, or after total_epochs if sooner; also "
                                                "the learning-rate schedule's length, as in verl; null = epochs decide")
    save_freq: int = _k(-1, "save a checkpoint every N steps and after the last; -1 = after the last only (verl "
                            "writes none then: the run's result is kept here); the guards save besides after a "
                            "validation that sets a new best (the one before training too) and after a rollback")
    test_freq: int = _k(-1, "validate every N steps and after the last, as verl; -1 (or 0) = no validation while "
                            "training (val_before_train is its own switch)")
    val_before_train: bool = _k(True, "validate before the first step")
    val_only: bool = _k(False, "validate the model (or the checkpoint resumed) and stop, without training")
    balance_batch: bool = _k(True, "with several workers: lay rows out so each worker's share of a log-prob, value "
                                   "or update pass carries about equal tokens (the same mini-batches)")
    critic_warmup: int = _k(0, "steps that train only the critic (adv_estimator=gae; 0 for the others, which train none)")
    resume_mode: str = _k("auto", "auto (the latest checkpoint in default_local_dir, if any) | disable | "
                                  "resume_path")
    resume_from_path: str | None = _k(None, "global_step_N directory for resume_mode=resume_path")
    allow_reward_code_change: bool = _k(False, "resume from a checkpoint trained with other custom reward code (a "
                                               "reward function fixed after it failed) with a notice; off, such a "
                                               "resume is refused")
    default_local_dir: str = _k(
        "checkpoints/${trainer.project_name}/${trainer.experiment_name}", "checkpoint and metrics directory"
    )
    max_actor_ckpt_to_keep: int | None = _k(None, "keep at most this many actor checkpoints (never pruned: the "
                                                  "latest, a guard's rollback target, and while the non-finite or "
                                                  "KL guard is on, the one before the latest); null or 0 = all")
    max_critic_ckpt_to_keep: int | None = _k(None, "keep at most this many critic checkpoints; null or 0 = all")
    default_hdfs_dir: str | None = _k(None, "verl's HDFS copy of the checkpoints: only null (checkpoints stay in "
                                            "default_local_dir)")
    del_local_ckpt_after_load: bool = _k(False, "verl's removal of the local checkpoint once loaded (with an HDFS "
                                                "copy): only false")
    n_gpus_per_node: int = _k(8, "workers per node (GPUs, or CPU processes with device=cpu)")
    nnodes: int = _k(1, "number of nodes")
    ray_address: str | None = _k(None, "Ray cluster to join with more than one worker (verl's "
                                       "ray_kwargs.ray_init.address); null = $RAY_ADDRESS, else a local cluster")
    ray_runtime_env: dict[str, Any] = _k({}, "Ray's runtime_env given to ray.init where this process joins or starts "
                                             "Ray (verl's ray_kwargs.ray_init.runtime_env), e.g. {py_modules: [lib]} "
                                             "ships a module to every node's workers, {env_vars: {K: V}}")
    device: str = _k("cuda", "cuda | cpu")
    cpu_matmul: str = _k("auto", "kernel of float32 linear layers on CPU: auto (oneDNN on AMD CPUs with "
                                 "AVX-512; elsewhere BLAS; decoding on packed weights, MKL's on Intel CPUs, oneDNN's "
                                 "elsewhere) | onednn | blas (torch.mm's, MKL); "
                                 "bench/RESULTS.md compares them")
    cpu_matmul_dtype: str = _k("float32", "dtype of the transformer blocks' matmuls on CPU: float32 | bfloat16 "
                                          "(weights, optimizer, heads and losses stay float32; pays on CPUs with AMX)")
    keep_freed_memory: bool = _k(True, "glibc: serve blocks up to 1 GB from the heap and keep freed memory for "
                                       "reuse, so large tensors are not faulted in afresh at every micro-batch "
                                       "(resident memory stays at its high-water mark); false = glibc's defaults")
    seed: int = _k(1, "seed of model init, sampling, mini-batch order, Python's and NumPy's global streams")
    save_on_interrupt: bool = _k(True, "on Ctrl-C or SIGTERM finish the current step, save a checkpoint, exit")
    guard: GuardConfig = _section(GuardConfig, "rollbacks and stops on non-finite steps, KL explosions, "
                                               "validation drops")
    warn_kl: float | None = _k(0.02, "console warning when the step's KL exceeds this; null = off")
    warn_grad_norm: float | None = _k(5.0, "console warning when a grad norm exceeds this; null = off")
    prometheus_port: int | None = _k(None, "serve Prometheus gauges on 127.0.0.1:PORT; null = off")
    profile_steps: list[int] | None = _k(None, "record a torch.profiler trace of these steps, e.g. [2,3]; null = off")
    profile_dir: str = _k("${trainer.default_local_dir}/profile", "where the traces go (TensorBoard / Perfetto "
                                                                   "*.pt.trace.json)")


@dataclass
class PPOConfig:
    data: DataConfig = _section(DataConfig, "prompt data")
    actor_rollout_ref: ActorRolloutRefConfig = _section(ActorRolloutRefConfig, "policy, rollout and reference")
    critic: CriticConfig = _section(CriticConfig, "the value model and its update")
    reward_model: RewardModelConfig = _section(RewardModelConfig, "learned reward model")
    custom_reward_function: CustomRewardFunctionConfig = _section(
        CustomRewardFunctionConfig, "user reward function"
    )
    algorithm: AlgorithmConfig = _section(AlgorithmConfig, "advantages and KL in reward")
    trainer: TrainerConfig = _section(TrainerConfig, "the run: steps, logging, checkpoints, workers")

    @property
    def world_size(self) -> int:
        return self.trainer.n_gpus_per_node * self.trainer.nnodes

    def needs_ground_truth(self) -> bool:
        """Whether every prompt row needs ``reward_model.ground_truth``: only a built-in rule reward that counts
        in the score reads it. A custom function gets None for a row without one; with a reward model and
        ``rule_coef=0`` the rule is skipped on such rows (their gold reward and accuracy are not known)."""
        rm = self.reward_model
        return not (self.custom_reward_function.path or (rm.enable and rm.rule_coef == 0))

    def prompt_batch(self) -> tuple[str, int]:
        """(key, value) of the prompts the trainer draws at once: ``data.gen_batch_size`` where dynamic sampling
        draws its generation rounds of that many (verl's DAPO key), else ``data.train_batch_size``."""
        if self.algorithm.filter_groups.enable and self.data.gen_batch_size:
            return "data.gen_batch_size", self.data.gen_batch_size
        return "data.train_batch_size", self.data.train_batch_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)

    def value(self, key: str) -> Any:
        """The value of dotted ``key``; for a null key of :data:`FOLLOWS`, the value it stands for."""
        return followed(functools.partial(attribute, self), key)

    def resolved(self) -> PPOConfig:
        """A copy with each null of :data:`FOLLOWS` replaced by the value it stands for: what the workers read."""
        out = copy.deepcopy(self)
        values = {key: self.value(key) for key in FOLLOWS}
        for key, value in values.items():
            section, _, name = key.rpartition(".")
            setattr(attribute(out, section), name, value)
        return out

    @classmethod
    def from_dict(cls, tree: Mapping[str, Any]) -> PPOConfig:
        """The validated config of a ``to_dict()`` tree: the form in which it travels between pipeline steps. The
        tree is resolved already, so a ``${`` in its text is text (a value written ``\\${...}``), escaped here so
        that OmegaConf does not read it as an interpolation a second time."""
        return _build([OmegaConf.create(_escaped(dict(tree)))], (), notice=_stderr, validate=True)


def _escaped(value: Any) -> Any:
    """``value`` (a resolved tree) with each ``${`` of its text written as OmegaConf's literal ``\\${``, and the
    backslashes before it doubled (OmegaConf reads ``\\\\${`` as one backslash before an interpolation)."""
    if isinstance(value, str):
        return re.sub(r"(\\*)\$\{", lambda found: found.group(1) * 2 + "\\${", value)
    if isinstance(value, Mapping):
        return {key: _escaped(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_escaped(item) for item in value]
    return value


# ----------------------------------------------------------------------------- aliases

# alias -> (canonical key, extra assignments made alongside)
ALIASES: dict[str, tuple[str, dict[str, Any]]] = {
    "actor_rollout_ref.actor.optim.max_grad_norm": ("actor_rollout_ref.actor.grad_clip", {}),
    "critic.optim.max_grad_norm": ("critic.grad_clip", {}),
    "trainer.checkpoint.every_n_steps": ("trainer.save_freq", {}),
    "algorithm.kl_ctrl_target": ("algorithm.kl_ctrl.target_kl", {"algorithm.kl_ctrl.type": "adaptive"}),
    # verl's deprecated name of the schedule
    "actor_rollout_ref.actor.optim.warmup_style": ("actor_rollout_ref.actor.optim.lr_scheduler_type", {}),
    "critic.optim.warmup_style": ("critic.optim.lr_scheduler_type", {}),
    # verl's names in older examples and on other backends
    "actor_rollout_ref.model.use_rmpad": ("actor_rollout_ref.model.use_remove_padding", {}),
    "critic.model.use_rmpad": ("critic.model.use_remove_padding", {}),
    "actor_rollout_ref.actor.optim.clip_grad": ("actor_rollout_ref.actor.grad_clip", {}),
    "critic.optim.clip_grad": ("critic.grad_clip", {}),
    # verl's name until it was renamed log_val_generations (it logs to any logger there since)
    "trainer.val_generations_to_log_to_wandb": ("trainer.log_val_generations", {}),
    # verl's one list of what a checkpoint saves and loads, until it was split in two (load_contents follows
    # save_contents there by default); both are keys without effect here, judged as save_contents is
    **{f"{section}.checkpoint.contents": (f"{section}.checkpoint.save_contents", {})
       for section in ("actor_rollout_ref.actor", "critic")},
}

# verl's shard-group sizes: a size below 0 or of at least the workers is one group over all of them (verl's mesh
# reads it so), which is what FSDP2 does here; a smaller one asks for hybrid sharding, which is not done here.
# Judged once the worker count is settled (see _assign_deferred).
FSDP_SECTIONS = ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config", "critic.model.fsdp_config",
                 "critic.fsdp_config", "reward_model.model.fsdp_config")
FSDP_SIZES = tuple(f"{section}.fsdp_size" for section in FSDP_SECTIONS)

# verl's fsdp_config.model_dtype: the dtype a worker loads its model's weights in and keeps them (verl: fp32 for the
# actor and the critic, bf16 for the reference), written short or long. The policy's weights are in
# actor_rollout_ref.model.dtype here, which the actor's key sets (as an alias, its value in the long name)
POLICY_MODEL_DTYPE = "actor_rollout_ref.actor.fsdp_config.model_dtype"
VERL_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", **{dtype: dtype for dtype in DTYPES}}
# ... while the reference is a copy of the policy's weights and the critic is loaded in the policy's dtype
# (build_critic): their keys are judged against it once every key is set (_assign_deferred), each with what it is
FOLLOWER_MODEL_DTYPES: dict[str, str] = {
    "actor_rollout_ref.ref.fsdp_config.model_dtype": "the reference is a copy of the policy's weights, kept in "
                                                     "actor_rollout_ref.model.dtype ({dtype})",
    **{f"{section}.model_dtype": "the critic is loaded in the policy's dtype, actor_rollout_ref.model.dtype ({dtype})"
       for section in ("critic.model.fsdp_config", "critic.fsdp_config")},
}


def _any(value: Any) -> bool:
    return True


def _off(value: Any) -> bool:
    return value is None or str(value).lower() in ("false", "0", "none", "null")


def _null(value: Any) -> bool:
    return value is None or str(value).lower() in ("none", "null")


def _all_state(value: Any) -> bool:  # a checkpoint's contents: everything this trainer saves (hf_model too)
    return isinstance(value, list | tuple) and {"model", "optimizer", "extra"} <= set(value) <= {
        "model", "optimizer", "extra", "hf_model"}


_NOT_PASSED_TO_VLLM = "not passed to vLLM here, which runs with its own default for it"
_NAMED_MANAGERS = ("the reward manager is picked by its name, reward_model.reward_manager; a class of your own is not "
                   "loaded here: give your scoring as custom_reward_function.path (reward_manager=naive calls it per "
                   "response, batch once a batch)")
_SCORED_IN_LINE = ("rewards are computed after each rollout, a reward model's in the trainer's workers, to the "
                   "same scores")

# verl keys with no counterpart here: each with the values that mean what this trainer does anyway
# (accepted with a notice) and what it does instead (any other value is an error that says so)
WITHOUT_EFFECT: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{f"{section}.ulysses_sequence_parallel_size": (lambda v: str(v) == "1", "there is no sequence parallelism here")
       for section in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model")},
    **{key: (lambda v: str(v) == "-1", "FSDP2 shards over all the workers") for key in FSDP_SIZES},
    **{f"{section}.grad_offload": (lambda v: str(v).lower() == "false", "gradients stay on the device")
       for section in ("actor_rollout_ref.actor.fsdp_config", "critic.model.fsdp_config", "critic.fsdp_config")},
    "actor_rollout_ref.rollout.mode": (lambda v: True, "rollouts run in the trainer's workers, one batch at a time"),
    "actor_rollout_ref.rollout.calculate_log_probs": (
        lambda v: True, "the vllm rollout always returns its log-probs, the hf one none"),
    "trainer.use_legacy_worker_impl": (lambda v: True, "this trainer has one worker implementation"),
    # verl's rollout correction beyond what is here, at its defaults (off): the trainer recomputes the old log-probs
    # (verl's decoupled mode), weights are truncated and not renormalised, and rejection bounds are rollout_rs_threshold's
    **{f"algorithm.rollout_correction.{name}": (_off, "the trainer recomputes the old log-probs, the rollout's are "
                                                      "weighed against them (verl's decoupled mode)")
       for name in ("bypass_mode", "bypass_old_logprob_for_rollout", "use_policy_gradient",
                    "use_pure_rollout_correction")},
    "algorithm.rollout_correction.loss_type": (lambda v: str(v) == "ppo_clip",
                                               "it is read in verl's bypass mode, which is not here: the policy loss "
                                               "is actor_rollout_ref.actor.policy_loss.loss_mode's"),
    "algorithm.rollout_correction.rollout_is_batch_normalize": (
        _off, "the importance weights are used as truncated, not renormalised to a batch mean of 1"),
    "algorithm.rollout_correction.rollout_rs_threshold_lower": (
        _null, "a k1 rejection keeps ratios in [1/t, t] for rollout_rs_threshold t"),
    "algorithm.rollout_correction.rollout_token_veto_threshold": (_null, "no per-token veto of a response is applied"),
    "reward_model.model.use_remove_padding": (lambda v: True, "the reward model scores padded rows"),
    "reward_model.model.use_rmpad": (lambda v: True, "the reward model scores padded rows"),
    "reward_model.use_dynamic_bsz": (lambda v: True, "the reward model scores micro_batch_size_per_gpu rows a pass"),
    "reward_model.forward_max_token_len_per_gpu": (
        lambda v: True, "the reward model scores micro_batch_size_per_gpu rows a pass"),
    "actor_rollout_ref.model.use_shm": (lambda v: True, "models load from their directory"),
    "actor_rollout_ref.model.use_liger": (
        lambda v: True, "Liger's kernels are not used; model.use_fused_kernels chunks the LM head"),
    "actor_rollout_ref.model.fused_kernel_options.impl_backend": (
        lambda v: True, "model.use_fused_kernels runs this project's chunked head"),
    "actor_rollout_ref.actor.entropy_checkpointing": (lambda v: True, "the entropy is computed chunk by chunk"),
    "actor_rollout_ref.rollout.load_format": (lambda v: True, "the rollout takes the actor's weights after each update"),
    "actor_rollout_ref.rollout.layered_summon": (lambda v: True, "LoRA weights are merged once per rollout"),
    "actor_rollout_ref.model.lora.merge": (
        _any, "the vLLM rollout is given the policy's weights with the LoRA adapters merged in (W + (alpha / r) B A) "
              "after each update, never the adapters apart; the hf rollout generates with the policy itself"),
    # verl's older switches, at their off values (its ppo_trainer.yaml of the 0.3 releases spells each)
    "actor_rollout_ref.rollout.use_fire_sampling": (
        _off, "every response token is sampled at rollout.temperature (FIRE's hotter first token is not done here)"),
    "actor_rollout_ref.rollout.chat_scheduler": (
        _null, "rollouts run in the trainer's workers, one batch at a time, without verl's chat scheduler"),
    **{f"actor_rollout_ref.model.{name}": (
        _off, "log-probs are computed from the model's logits, or through the LM head in chunks with "
              "model.use_fused_kernels") for name in ("use_fused_loss", "return_last_hidden_state")},
    # sharding knobs of verl's FSDP1 wrapper and engine
    **{f"{section}.wrap_policy.min_num_params": (_any, "FSDP2 shards each decoder layer and then the whole model")
       for section in FSDP_SECTIONS},
    **{f"{section}.forward_prefetch": (_any, "FSDP2 prefetches as torch sets it") for section in FSDP_SECTIONS},
    **{f"{section}.offload_policy": (_off, "offloading is set with fsdp_config.param_offload and optimizer_offload")
       for section in FSDP_SECTIONS},
    # (the policy's, the reference's and the critic's model_dtype: see POLICY_MODEL_DTYPE and FOLLOWER_MODEL_DTYPES)
    "reward_model.model.fsdp_config.model_dtype": (
        lambda v: str(v) in ("fp32", "float32"),
        "the reward model is loaded in float32; fsdp_config.param_dtype sets the compute dtype"),
    **{f"{section}.strategy": (lambda v: v in STRATEGIES, "the reference and the reward model run as the actor does, "
                                                          "sharded with FSDP2")
       for section in ("actor_rollout_ref.ref", "reward_model")},
    # newer verl's engine config repeats these in each fsdp_config
    **{f"{section}.use_orig_params": (_any, "FSDP2 shards the parameters as they are") for section in FSDP_SECTIONS},
    **{f"{section}.ulysses_sequence_parallel_size": (lambda v: str(v) == "1", "there is no sequence parallelism here")
       for section in FSDP_SECTIONS},
    **{f"{section}.{name}": (_any, "the entropy is computed chunk by chunk")
       for section in FSDP_SECTIONS for name in ("entropy_from_logits_with_chunking", "entropy_checkpointing")},
    **{f"{section}.use_torch_compile": (_any, "actor_rollout_ref.actor.use_torch_compile decides")
       for section in ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config")},
    **{f"{section}.use_torch_compile": (_any, "the critic is not compiled here (only the actor and its reference "
                                              "are, with actor_rollout_ref.actor.use_torch_compile)")
       for section in ("critic.model.fsdp_config", "critic.fsdp_config")},
    "reward_model.model.fsdp_config.use_torch_compile": (
        _any, "the reward model is not compiled here (only the actor and its reference are, with "
              "actor_rollout_ref.actor.use_torch_compile)"),
    **{f"{section}.forward_only": (_any, "the reference and the reward model only run forward, the actor and the "
                                         "critic train") for section in FSDP_SECTIONS},
    **{f"{section}.strategy": (lambda v: v in STRATEGIES, "the workers shard with FSDP2")
       for section in FSDP_SECTIONS},
    # newer verl's optimizer choice: AdamW from torch.optim is the one optimizer here
    **{f"{section}.optim.optimizer": (lambda v: str(v) == "AdamW", "the optimizer is torch.optim.AdamW")
       for section in ("actor_rollout_ref.actor", "critic")},
    **{f"{section}.optim.optimizer_impl": (lambda v: str(v) == "torch.optim", "the optimizer is torch.optim.AdamW")
       for section in ("actor_rollout_ref.actor", "critic")},
    **{f"{section}.optim.override_optimizer_config": (
        lambda v: _null(v) or v == {}, "AdamW takes optim.lr, betas and weight_decay, and torch's defaults else")
       for section in ("actor_rollout_ref.actor", "critic")},
    "actor_rollout_ref.actor.freeze_vision_tower": (_off, "prompts are text: there is no vision tower"),
    "actor_rollout_ref.model.hf_config_path": (_null, "the model's config is read from model.path"),
    "actor_rollout_ref.rollout.data_parallel_size": (lambda v: str(v) == "1",
                                                     "each worker's rollout engine generates its share of the batch"),
    "actor_rollout_ref.rollout.expert_parallel_size": (lambda v: str(v) == "1", "there is no expert parallelism here"),
    "reward_model.enable_resource_pool": (_off, "the reward model runs in the trainer's workers"),
    # the reward model's own pool (verl's defaults: 8 GPUs a node, 0 nodes), sized only with enable_resource_pool
    **{f"reward_model.{name}": (_any, "read only with reward_model.enable_resource_pool, which is not supported here: "
                                      "the reward model runs in the trainer's workers")
       for name in ("n_gpus_per_node", "nnodes")},
    "actor_rollout_ref.actor.checkpoint.save_contents": (
        _all_state, "the actor's checkpoints hold its model, optimizer and extra state, with a huggingface/ export "
                    "of the model"),
    "critic.checkpoint.save_contents": (
        _all_state, "the critic's checkpoints hold its model, optimizer and extra state, without a huggingface/ "
                    "export (only the actor's model is exported)"),
    **{f"{section}.checkpoint.load_contents": (lambda v: _all_state(v) or v == "${.save_contents}",
                                               "a resume loads the model, optimizer and extra state")
       for section in ("actor_rollout_ref.actor", "critic")},
    **{f"{section}.checkpoint.async_save": (_off, "checkpoints are written before the next step starts")
       for section in ("actor_rollout_ref.actor", "critic")},
    **{f"{section}.optim.total_training_steps": (_any, "the schedule's length is trainer.total_training_steps or what "
                                                       "the data give, as verl sets this key itself")
       for section in ("actor_rollout_ref.actor", "critic")},
    **{f"{section}.entropy_from_logits_with_chunking": (_any, "the entropy is computed chunk by chunk")
       for section in ("actor_rollout_ref.actor", "actor_rollout_ref.ref")},
    "actor_rollout_ref.ref.entropy_checkpointing": (_any, "the reference computes no entropy"),
    "actor_rollout_ref.ref.model": (_null, "the reference is actor_rollout_ref.model's weights as they were loaded"),
    "actor_rollout_ref.ref.use_torch_compile": (_any, "the reference runs as actor.use_torch_compile says"),
    **{f"actor_rollout_ref.actor.policy_loss.{name}": (
        _any, "read only by verl's clip_cov and kl_cov loss modes, which are not implemented here")
       for name in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")},
    "actor_rollout_ref.actor.tis_imp_ratio_cap": (
        lambda v: isinstance(v, int | float) and v <= 0,
        "truncated importance sampling is algorithm.rollout_correction.rollout_is=token with rollout_is_threshold"),
    **{f"{section}.enable_activation_offload": (_off, "activations stay on the device; "
                                                      "model.enable_gradient_checkpointing saves their memory")
       for section in ("actor_rollout_ref.model", "critic.model")},
    "actor_rollout_ref.model.custom_chat_template": (
        _null, "the chat template is the tokenizer's: put it in its tokenizer_config.json (chat_template)"),
    "actor_rollout_ref.model.exclude_modules": (_null, "LoRA adapts the modules model.target_modules names"),
    "actor_rollout_ref.model.lora_adapter_path": (
        _null, "LoRA adapters start fresh here (B = 0): to start from a trained adapter, merge it into its base model "
               "(peft's merge_and_unload, then save_pretrained) and give that directory as actor_rollout_ref.model.path "
               "(the reference is then the merged model)"),
    **{f"{section}.use_shm": (_any, "models load from their directory") for section in ("critic.model", "reward_model.model")},
    "reward_model.model.use_fused_kernels": (_any, "the reward model scores with its own head"),
    # the rollout engine's knobs this trainer does not pass on, and verl's agent and multi-turn machinery
    **{f"actor_rollout_ref.rollout.{name}": (_any, _NOT_PASSED_TO_VLLM)
       for name in ("cudagraph_capture_sizes", "max_model_len", "max_num_seqs", "disable_log_stats",
                    "enable_prefix_caching", "multi_stage_wake_up", "update_weights_bucket_megabytes",
                    "checkpoint_engine.update_weights_bucket_megabytes",  # (newer verl's place of the one before)
                    "skip_tokenizer_init")},
    "actor_rollout_ref.rollout.over_sample_rate": (lambda v: str(v) in ("0", "0.0"),
                                                   "every prompt's responses are generated to the end"),
    "actor_rollout_ref.rollout.multi_turn.enable": (_off, "multi-turn rollouts with tools are not done here"),
    "actor_rollout_ref.rollout.skip_rollout": (_off, "rollouts are always generated"),
    "actor_rollout_ref.rollout.skip_dump_dir": (_any, "rollouts are always generated"),
    "actor_rollout_ref.rollout.trace.backend": (_null, "rollouts are not traced here"),
    # data loading
    "data.use_shm": (_any, "data files are read from their path"),
    **{f"data.{name}": (_any, "the dataset's rows are this trainer's own (text prompts, tokenized here)")
       for name in ("return_raw_input_ids", "return_full_prompt", "return_multi_modal_inputs")},
    "data.dataloader_num_workers": (_any, "prompts are read and tokenized in the trainer's process"),
    "data.filter_overlong_prompts_workers": (_any, "prompts are filtered in the trainer's process"),
    "data.validation_shuffle": (_any, "validation goes through its problems in file order (the metrics are the same)"),
    **{f"data.{name}": (_any, "prompts are text; the column is not read") for name in ("image_key", "video_key")},
    "data.trust_remote_code": (_any, "the data tokenizer is loaded with actor_rollout_ref.model.trust_remote_code"),
    **{f"data.custom_cls.{name}": (_null, "prompts are read from parquet files in verl's format (JSON "
                                          "Lines are refused: write them as parquet); a custom dataset class is not "
                                          "supported") for name in ("path", "name")},
    **{f"data.sampler.{name}": (_null, "prompts are drawn in order or shuffled with data.seed; "
                                       "a custom sampler (curriculum) is not supported")
       for name in ("class_path", "class_name")},
    **{f"data.datagen.{name}": (_null, "prompts are not generated during training here") for name in ("path", "name")},
    "data.image_patch_size": (_any, "prompts are text; no image is cut into patches"),
    "data.tool_config_path": (_null, "prompts are measured without tool schemas: multi-turn rollouts with tools are "
                                     "not done here"),
    "data.databuffer.enable": (_off, "filtered prompts are not kept for reuse here"),
    # critic and reward
    **{f"critic.{name}": (_any, "the critic's value pass runs critic.ppo_micro_batch_size_per_gpu rows (or "
                                "ppo_max_token_len_per_gpu tokens with dynamic batching) at a time")
       for name in ("forward_micro_batch_size", "forward_micro_batch_size_per_gpu", "forward_max_token_len_per_gpu")},
    "reward_model.launch_reward_fn_async": (_any, "rewards are computed in line, to the same scores"),
    # newer verl's reward loop: the reward model served by a rollout engine and scored by reward workers
    **{f"reward_model.{name}": (_any, _SCORED_IN_LINE) for name in ("use_reward_loop", "num_workers")},
    "reward_model.reward_loop_source": (lambda v: str(v) == "register", _NAMED_MANAGERS),
    **{f"reward_model.{name}": (_null, _NAMED_MANAGERS) for name in ("reward_loop_module_path", "reward_loop_class_name")},
    "reward_model.sandbox_fusion.url": (_null, "sandboxed code execution is not done here: score with a "
                                               "custom_reward_function"),
    "algorithm.use_pf_ppo": (_off, "PF-PPO's reweighting of the batch is not done here"),
    # the trainer's loop
    **{f"trainer.{name}": (_null, "rollouts are not written out here; trainer.log_val_generations logs validation "
                                  "samples (val_generations.jsonl with the file logger)")
       for name in ("rollout_data_dir", "validation_data_dir")},
    "trainer.esi_redundant_time": (_any, "checkpoints are saved on save_freq, at the end and on a stop signal"),
    "trainer.ray_wait_register_center_timeout": (_any, "workers are waited for 300 s"),
    "trainer.wandb_proxy": (_null, "wandb takes its proxy from the HTTPS_PROXY environment variable (and runs offline "
                                   "unless WANDB_MODE=online): set that"),
    "global_profiler.tool": (_null, "trainer.profile_steps records torch.profiler traces"),
    "global_profiler.steps": (_null, "trainer.profile_steps records torch.profiler traces"),
    "ray_kwargs.timeline_json_file": (_null, "no Ray timeline is written here"),
}
# sections of verl keys with no counterpart: each key below one is taken with a notice, unless WITHOUT_EFFECT names
# it; the sections are read only where a key of WITHOUT_EFFECT switches them on
WITHOUT_EFFECT_BELOW: dict[str, str] = {
    "actor_rollout_ref.rollout.engine_kwargs.": _NOT_PASSED_TO_VLLM,
    "actor_rollout_ref.rollout.multi_turn.": "read only with multi_turn.enable, which is not supported here",
    "actor_rollout_ref.rollout.agent.": "rollouts run in the trainer's workers, without verl's agent loop",
    "actor_rollout_ref.rollout.trace.": "rollouts are not traced here",
    "reward_model.sandbox_fusion.": "read only with sandbox_fusion.url, which is not supported here",
    "reward_model.rollout.": "the reward model scores with its classification head in the trainer's workers, not "
                             "through a rollout engine",
    "algorithm.pf_ppo.": "read only with algorithm.use_pf_ppo, which is not supported here",
    "data.databuffer.": "read only with data.databuffer.enable, which is not supported here",
    "global_profiler.": "trainer.profile_steps records torch.profiler traces",
    **{section: "Ray starts (or is joined, trainer.ray_address) with its own settings and trainer.ray_runtime_env"
       for section in ("ray_kwargs.", "ray_init.")},  # (ray_init: verl's section before ray_kwargs)
    **{f"{section}.profiler.": "trainer.profile_steps records torch.profiler traces"
       for section in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout", "critic",
                       "reward_model")},
}
# in those sections, the keys whose only harmless value is off
for _section in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout", "critic",
                 "reward_model"):
    WITHOUT_EFFECT[f"{_section}.profiler.enable"] = (_off, "trainer.profile_steps records torch.profiler traces")


def without_effect(key: str) -> tuple[Callable[[Any], bool], str] | None:
    """What :data:`WITHOUT_EFFECT` (or a section of :data:`WITHOUT_EFFECT_BELOW`) says of verl's ``key``: the
    test of its harmless values and what this trainer does instead; None for a key of this trainer's own (or one
    of verl's that :data:`PREFIX_ALIASES` places here). An entry below such a key is judged as the key is."""
    if key in WITHOUT_EFFECT:
        return WITHOUT_EFFECT[key]
    for held in WITHOUT_EFFECT:  # an entry of a mapping verl's key holds (optim.override_optimizer_config.fused)
        if key.startswith(f"{held}."):
            return WITHOUT_EFFECT[held]
    if _prefix_alias(key) is not None:
        return None
    for section, instead in WITHOUT_EFFECT_BELOW.items():
        if key.startswith(section):
            return _any, instead
    return None
# sections of backends this trainer does not have: any key below them is refused with the reason
REFUSED_SECTIONS = {".megatron.": "Megatron is not a backend here: the workers shard with FSDP2 (strategy=fsdp)"}

# keys whose null means "the value of that other key" (as verl's config interpolates them), possibly through
# another such key: the workers are built from PPOConfig.resolved(), and a resume compares them resolved
FOLLOWS: dict[str, str] = {
    "critic.model.path": "actor_rollout_ref.model.path",
    "critic.model.tokenizer_path": "actor_rollout_ref.model.tokenizer_path",
    "actor_rollout_ref.model.tokenizer_path": "actor_rollout_ref.model.path",
    "data.tokenizer": "actor_rollout_ref.model.tokenizer_path",
    "data.seed": "trainer.seed",
    "actor_rollout_ref.actor.loss_scale_factor": "data.max_response_length",
    "critic.loss_agg_mode": "actor_rollout_ref.actor.loss_agg_mode",
    "critic.shuffle": "actor_rollout_ref.actor.shuffle",
    "critic.model.trust_remote_code": "actor_rollout_ref.model.trust_remote_code",
    "critic.ppo_mini_batch_size": "actor_rollout_ref.actor.ppo_mini_batch_size",
    "critic.ppo_epochs": "actor_rollout_ref.actor.ppo_epochs",
    "critic.use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
}


def followed(value_of: Callable[[str], Any], key: str) -> Any:
    """``key``'s value, or where it is null and in :data:`FOLLOWS`, the value it stands for (followed through
    keys that are null in turn); ``value_of`` reads a dotted key."""
    value = value_of(key)
    while value is None and key in FOLLOWS:
        key = FOLLOWS[key]
        value = value_of(key)
    return value


def require_resolved(section: Any, prefix: str) -> None:
    """Refuse a config section (``section`` at dotted ``prefix``) in which a key of :data:`FOLLOWS` is still
    null: a worker reads its keys as they are, so it must be given a section of :meth:`PPOConfig.resolved`."""
    start = f"{prefix}."
    unresolved = [key for key in FOLLOWS if key.startswith(start) and attribute(section, key[len(start):]) is None]
    if unresolved:
        raise ValueError(f"{', '.join(unresolved)} null: build the worker from PPOConfig.resolved()'s {prefix}")


def attribute(node: Any, dotted: str) -> Any:
    """The attribute of ``node`` at the dotted path ``dotted`` (``node`` itself for an empty one)."""
    for name in dotted.split(".") if dotted else ():
        node = getattr(node, name)
    return node


# sections verl keeps elsewhere: every key below the first stands for the same key below the second
PREFIX_ALIASES: dict[str, str] = {
    "critic.model.fsdp_config.": "critic.fsdp_config.",  # verl's place for the critic's sharding
    "reward_model.reward_kwargs.overlong_buffer_cfg.": "reward_model.overlong_buffer.",  # verl's DAPO recipe
    "custom_reward_function.overlong_buffer.": "reward_model.overlong_buffer.",  # the recipe's first version
    "ray_kwargs.ray_init.runtime_env.": "trainer.ray_runtime_env.",  # what verl gives ray.init
    "ray_kwargs.ray_init.address.": "trainer.ray_address.",  # (the key itself: no key is below it)
}

# newest verl gathers the reward settings in one section, reward: each of its keys (or a key below a section
# ending in ".") stands for the key the verl releases before it wrote, which is judged here as that key is (verl
# moves the older keys there itself, in migrate_legacy_reward_impl)
NEWER_REWARD_KEYS: dict[str, str] = {
    "reward.reward_model.model_path": "reward_model.model.path",
    "reward.reward_model.rollout.": "reward_model.rollout.",
    "reward.reward_model.": "reward_model.",  # enable, enable_resource_pool, n_gpus_per_node, nnodes
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.reward_manager.source": "reward_model.reward_loop_source",
    "reward.reward_manager.module.path": "reward_model.reward_loop_module_path",
    "reward.reward_manager.module.name": "reward_model.reward_loop_class_name",
    "reward.custom_reward_function.": "custom_reward_function.",
    "reward.reward_kwargs.": "reward_model.reward_kwargs.",
    "reward.num_workers": "reward_model.num_workers",
    "reward.sandbox_fusion.": "reward_model.sandbox_fusion.",
}


def _older_reward_key(key: str, notice: Callable[[str], None]) -> str:
    """``key``, or where it is newest verl's name in its reward section, the older key it stands for (with a
    notice that says so)."""
    for newer, older in NEWER_REWARD_KEYS.items():
        if key == newer or (newer.endswith(".") and key.startswith(newer)):
            taken = older + key[len(newer):]
            notice(f"notice: {key} is newer verl's name of {taken}, taken as it")
            return taken
    return key


def _prefix_alias(key: str) -> str | None:
    """The key that ``key`` (below a section of :data:`PREFIX_ALIASES`, or that section itself) stands for."""
    for prefix, canonical_prefix in PREFIX_ALIASES.items():
        if f"{key}.".startswith(prefix):
            return f"{canonical_prefix}{f'{key}.'[len(prefix):]}"[:-1]
    return None

# verl keys that repeat another key's value (verl's config interpolates them from it), each with what reads that
# value here: taken where they hold the same value (or null), refused where they differ
MIRRORS: dict[str, tuple[str, str]] = {
    # the DAPO recipe's response budget of the length penalty
    "reward_model.reward_kwargs.max_resp_len": (
        "data.max_response_length", "to which the overlong penalty (reward_model.overlong_buffer) counts here"),
    "actor_rollout_ref.rollout.prompt_length": ("data.max_prompt_length", "which the rollout reads here"),
    "actor_rollout_ref.rollout.response_length": ("data.max_response_length", "which the rollout reads here"),
    "critic.rollout_n": ("actor_rollout_ref.rollout.n", "which the critic reads here"),
    "actor_rollout_ref.actor.use_remove_padding": ("actor_rollout_ref.model.use_remove_padding",
                                                   "which the actor reads here"),
    "actor_rollout_ref.actor.use_fused_kernels": ("actor_rollout_ref.model.use_fused_kernels",
                                                  "which the actor reads here"),
    "critic.model.external_lib": ("actor_rollout_ref.model.external_lib", "the one module imported for every model"),
    "reward_model.model.external_lib": ("actor_rollout_ref.model.external_lib",
                                        "the one module imported for every model"),
}
# verl's switch of the critic: null = the advantage estimator decides, as it always does here
CRITIC_ENABLE = "critic.enable"
# keys whose "none" is written [] (validation refuses their null), with what [] means there
EMPTY_NOT_NULL: dict[str, str] = {"data.val_files": "no validation"}
# keys that take a string or a list of strings (validated as such), with the one of them whose null is taken
STR_OR_LIST_KEYS = ("data.train_files", "data.val_files", "actor_rollout_ref.model.target_modules",
                    "critic.model.target_modules", "reward_model.train.train_files", "reward_model.train.val_files",
                    "reward_model.train.model.target_modules")
STR_OR_LIST_NULL = frozenset({"reward_model.train.val_files"})  # no held-out pairs
# verl keys whose null stands for this trainer's default
NULL_IS_DEFAULT = frozenset({"actor_rollout_ref.actor.optim.min_lr_ratio", "critic.optim.min_lr_ratio",
                             "reward_model.micro_batch_size_per_gpu"})

# verl's deprecated micro-batch sizes over all workers: set, each stands for its per-worker key at
# value / (n_gpus_per_node * nnodes); null (as verl's generated config holds them) sets nothing
GLOBAL_MICRO_BATCHES: dict[str, str] = {
    "actor_rollout_ref.actor.ppo_micro_batch_size": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size":
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size": "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size": "critic.ppo_micro_batch_size_per_gpu",
    "reward_model.micro_batch_size": "reward_model.micro_batch_size_per_gpu",
}
# per-worker micro-batch sizes whose null validation takes only with dynamic batching on (or the size over all
# workers above given in its place)
NULL_NEEDS_DYNAMIC = frozenset({"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                                "critic.ppo_micro_batch_size_per_gpu"})


# ----------------------------------------------------------------------------- errors


class ConfigError(ValueError):
    """One or more invalid settings; ``errors`` holds one message per problem."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("invalid config:\n" + "\n".join(f"  - {e}" for e in self.errors))

    def __reduce__(self):  # rebuilt from its errors: a worker's error reaches the driver (Ray pickles it) whole,
        return type(self), (self.errors,), self.__dict__  # its notes (how to go on) and other attributes too


# ----------------------------------------------------------------------------- loading


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _leaves(node: DictConfig, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every ``(dotted key, value)`` below ``node``: mappings are walked (an alias is a key), lists are values."""
    for key, value in node.items_ex(resolve=False):
        dotted = f"{prefix}{key}"
        if isinstance(value, DictConfig) and dotted not in ALIASES and dotted not in OPEN_KEYS:
            yield from _leaves(value, dotted + ".")
        else:
            yield dotted, OmegaConf.to_container(value) if isinstance(value, ListConfig | DictConfig) else value


@functools.cache
def _known_keys() -> tuple[str, ...]:
    return tuple(key for key, _ in _leaves(OmegaConf.structured(PPOConfig)))


@functools.cache
def _known_keys_and_sections() -> frozenset[str]:
    return frozenset(key.rsplit(".", i)[0] for key in _known_keys() for i in range(key.count(".") + 1))


# keys verl itself dropped, with what took their place there (a close spelling would point elsewhere)
REPLACED_IN_VERL: dict[str, str] = {
    "actor_rollout_ref.actor.use_token_level_loss": "actor_rollout_ref.actor.loss_agg_mode=token-mean (true) or "
                                                    "seq-mean-token-mean (false), as verl replaced it",
}


def _suggest(key: str) -> str:
    if key in REPLACED_IN_VERL:
        return f"; use {REPLACED_IN_VERL[key]}"
    known = _known_keys()
    if f"actor_rollout_ref.{key}" in known:  # verl's short forms, actor.* / ref.* / rollout.*: the policy's section
        return f"; did you mean actor_rollout_ref.{key}?"
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close:  # the right leaf name in the wrong section, or a misspelt leaf
        leaves = {k.rsplit(".", 1)[-1]: k for k in reversed(known)}
        leaf = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(leaves), n=1)
        close = [leaves[leaf[0]]] if leaf else []
    if not close:
        return ""
    return f"; did you mean {_policy_first(key, close[0], known)}?"


def _policy_first(key: str, match: str, known: Iterable[str]) -> str:
    """``match``, or where it is the critic's or a reward model's key, ``key`` does not name that section, and the
    policy's section has a key ending as ``match`` does over as many parts as ``key`` has (``model.lora_rank``:
    critic.model.lora_rank and actor_rollout_ref.model.lora_rank), the policy's: a key written without its
    section is the policy's more often than not, as in verl's guides, and the closest spelling is only the
    shortest."""
    section = match.split(".", 1)[0]
    if section not in ("critic", "reward_model") or key.split(".", 1)[0] == section:
        return match
    tail = ".".join(match.split(".")[-(key.count(".") + 1):])
    return next((k for k in known if k.startswith("actor_rollout_ref.") and k.endswith("." + tail)), match)


# verl's deprecated switches: what setting one to true stands for (false or ~key: nothing)
SWITCHES: dict[str, dict[str, Any]] = {
    "trainer.remove_previous_ckpt_in_save": {"trainer.max_actor_ckpt_to_keep": 1, "trainer.max_critic_ckpt_to_keep": 1},
}


def _targets(key: str, value: Any, notice: Callable[[str], None], errors: list[str]) -> dict[str, Any]:
    """The assignments that setting ``key`` makes: itself, or the key an alias stands for (with a notice)."""
    if key in SWITCHES and isinstance(value, bool | None):
        if value:
            notice(f"notice: {key} is deprecated (as in verl); use "
                   + " and ".join(f"{k}={v}" for k, v in SWITCHES[key].items()))
        return SWITCHES[key] if value else {}
    for section, reason in REFUSED_SECTIONS.items():
        if section in f".{key}":
            errors.append(f"{key} is not supported: {reason}")
            return {}
    if key.rsplit(".", 1)[-1] == "_target_" or (value is None and key in NULL_IS_DEFAULT):
        return {}  # the class verl builds a section as; a null verl leaves for its default: nothing to set here
    if key == "reward_model.reward_manager" and value == "prime":
        notice("notice: reward_model.reward_manager='prime' is taken as 'naive': each response is scored by the "
               "reward function in turn (verl's prime runs the same scoring in a process pool)")
        return {key: "naive"}
    if key == POLICY_MODEL_DTYPE:  # (null, verl's default for the actor, sets nothing: model.dtype keeps its value)
        if value is None:
            return {}
        if (dtype := VERL_DTYPES.get(str(value))) is None:
            errors.append(f"{key}={value!r} is not one of {', '.join(VERL_DTYPES)}")
            return {}
        notice(f"notice: {key}={value!r} is taken as actor_rollout_ref.model.dtype={dtype}, the dtype the policy's "
               "weights are loaded and trained in here")
        return {"actor_rollout_ref.model.dtype": dtype}
    if key == "trainer.logger" and "tracking" in (names := [value] if isinstance(value, str) else list(value or [])):
        return {key: _tracking_as_wandb(names, notice)}
    if (verl_only := without_effect(key)) is not None:
        harmless, instead = verl_only
        if harmless(value):
            notice(f"notice: {key}={value!r} has no effect: {instead}")
        else:
            errors.append(f"{key}={value!r} is not supported: {instead}")
        return {}
    if (placed := _prefix_alias(key)) is not None:  # verl's own key: taken without a notice
        return {placed: value}
    if key not in ALIASES:
        return {key: value}
    canonical, extra = ALIASES[key]
    if value is None and _default(canonical) is not None:  # verl's generated config: null, the key unused
        return {}
    also = "".join(f" and {k}={v}" for k, v in extra.items())  # what the alias sets besides (kl_ctrl.type)
    notice(f"notice: {key} is an alias; use {canonical}{also}")
    if without_effect(canonical) is not None:  # an alias of a verl key without effect: judged as that key
        return {**_targets(canonical, value, notice, errors), **extra}
    return {canonical: value, **extra}


def _tracking_as_wandb(names: list[str], notice: Callable[[str], None]) -> list[str]:
    """trainer.logger's ``names`` with verl's deprecated 'tracking' taken as wandb (once, with a notice)."""
    if "tracking" not in names:
        return names
    notice("notice: trainer.logger: 'tracking' is verl's deprecated name of 'wandb', taken as wandb")
    return list(dict.fromkeys("wandb" if name == "tracking" else name for name in names))


REWARD_MANAGERS = ("naive", "dapo", "batch")
# lists that take one name as a list of it
ONE_OR_LIST = frozenset({"trainer.logger"})
# mappings whose keys the user names (``+custom_reward_function.reward_kwargs.scale=2`` or a YAML mapping)
OPEN_KEYS = frozenset({"custom_reward_function.reward_kwargs", "data.apply_chat_template_kwargs", "trainer.ray_runtime_env",
                       "actor_rollout_ref.model.override_config", "critic.model.override_config",
                       "reward_model.train.apply_chat_template_kwargs", "reward_model.model.input_chat_template_kwargs"})


def _assign(cfg: DictConfig, key: str, value: Any, errors: list[str], merge: bool = True) -> None:
    """Set one key (or a section) of the schema, typed by OmegaConf; a problem is added to ``errors``."""
    if key not in _known_keys_and_sections() and not any(key.startswith(open_key + ".") for open_key in OPEN_KEYS):
        errors.append(f"unknown config key {key}{_suggest(key)}")
        return
    if key in ONE_OR_LIST and isinstance(value, str):  # verl's trainer.logger=console
        value = [value]
    open_key = _open_key(key)
    followed_key = _interpolation(cfg, open_key) if open_key else None
    if followed_key is not None:  # OmegaConf would write the entry into the mapping followed
        errors.append(f"{key}: {open_key} is {followed_key} until it is set; set it whole, e.g. "
                      f"{open_key}={{{key[len(open_key) + 1:]}: {value}}}")
        return
    try:
        OmegaConf.update(cfg, key, value, merge=merge)
    except ValidationError as exc:
        if value is None and isinstance(OmegaConf.select(cfg, key), DictConfig):  # a section left empty (`trainer:`)
            errors.append(f"{key} is empty (null): put its keys under it, or leave it out")
            return
        hint = f"; write a list, e.g. {key}=[a,b]" if "is not a ListConfig" in exc.msg else ""
        errors.append(f"{key}={value!r}: {exc.msg.splitlines()[0].rstrip('.')}{hint}")
    except GrammarParseError as exc:
        errors.append(f"{key}={value!r} holds a ${{...}} that does not parse ({exc.msg.splitlines()[0]}): close it "
                      "with }, or write \\${ for the text ${")
    except KeyValidationError as exc:  # a number (or a bool) as a key of an open mapping
        mapping = exc.full_key.rpartition(".")[0]
        errors.append(f"{key}={value!r}: {mapping} takes names as its keys, not {exc.key!r}: name each entry, e.g. "
                      f"{mapping}={{a: 1}}")
    except (ConfigTypeError, ConfigKeyError) as exc:  # a list where a mapping goes, a mapping where a list goes
        if isinstance(value, dict) and isinstance(OmegaConf.select(cfg, key, throw_on_resolution_failure=False),
                                                  DictConfig):  # the fault is below: each entry set on its
            before = len(errors)                               # own, as a file's are, names the one at fault
            for name, item in value.items():
                _assign(cfg, f"{key}.{name}", item, errors, merge)
            if len(errors) == before:
                errors.append(f"{key}={value!r}: {exc.msg.splitlines()[0]}")
        elif isinstance(value, dict):
            errors.append(f"{key}={value!r}: {key} takes a list, not a mapping; write a list, e.g. {key}=[a,b]")
        elif isinstance(value, list):
            errors.append(f"{key}={value!r}: {key} takes a mapping, not a list; write name: value entries, e.g. "
                          f"{key}={{a: 1}}")
        else:
            errors.append(f"{key}={value!r}: {exc.msg.splitlines()[0]}")


def _takes_null(cfg: DictConfig, key: str) -> bool:
    """Whether ``key`` of ``cfg`` may be set to null (its field is Optional)."""
    try:
        OmegaConf.update(copy.deepcopy(cfg), key, None, merge=False)
    except ValidationError:
        return False
    return True


def _open_key(key: str) -> str | None:
    """The open mapping (one of ``OPEN_KEYS``) that ``key`` names an entry of, or None."""
    return next((k for k in OPEN_KEYS if key.startswith(k + ".")), None)


def _delete_entry(cfg: DictConfig, key: str, written: str, errors: list[str]) -> None:
    """``~written``: take ``key``, an entry of an open mapping, out of it. There is no default to go back to (a
    None left there would reach its reader: Ray would give every worker the string "None" for an env var)."""
    open_key = _open_key(key)
    if (followed_key := _interpolation(cfg, open_key)) is not None:  # deleting would change the mapping followed
        errors.append(f"~{written}: {open_key} is {followed_key} until it is set; set it whole instead")
        return
    section, _, name = key.rpartition(".")
    node = OmegaConf.select(cfg, section)
    if not isinstance(node, DictConfig):
        held = "is not set" if node is None else f"is not a mapping: set it whole, e.g. {section}=[...]"
        errors.append(f"~{written}: there is no {name} to remove ({section} {held})")
        return
    if name not in node:
        errors.append(f"~{written}: there is no {name} in {section} to remove (it holds "
                      f"{', '.join(map(str, node)) or 'nothing'})")
        return
    del node[name]


def _interpolation(cfg: DictConfig, key: str) -> str | None:
    """The ``${...}`` text that ``key`` of ``cfg`` holds, or None where it holds a value."""
    section, _, name = key.rpartition(".")
    node = OmegaConf.select(cfg, section) if section else cfg
    return OmegaConf.to_container(node)[name] if OmegaConf.is_interpolation(node, name) else None


def _default(key: str) -> Any:
    """The schema's default of ``key``: a value, or a whole section (None for a key it does not have)."""
    return functools.reduce(lambda node, name: getattr(node, name, None), key.split("."), PPOConfig())


@functools.cache
def _parser() -> OverridesParser:
    return OverridesParser.create()


def _same_key_twice(origins: dict[str, tuple[str, Any]], target: str, key: str, value: Any,
                    errors: list[str]) -> None:
    """Record that ``key`` set ``target`` to ``value``; two spellings of one key (verl's alias and the key, or two
    of verl's) that set it to different values in the same place (the file, or the command line) are refused:
    the one written last won, silently."""
    source, before = origins.get(target, (key, value))
    if source != key and before != value:
        errors.append(f"{key}={value!r} and {source}={before!r} both set {target} (verl's spellings of one key): "
                      "keep one")
    origins[target] = (key, value)


def _switched(origins: dict[str, tuple[str, Any]], switch: str, key: str, value: Any, errors: list[str]) -> None:
    """Record in ``origins`` what verl's deprecated ``switch`` (written ``key``) sets at ``value``: on, its
    targets, refused beside one of them given another value in the same place, as two spellings of one key are;
    off or deleted, nothing (what it recorded on is forgotten). Its last value is applied in _assign_deferred."""
    for target, target_value in SWITCHES[switch].items():
        if value:
            _same_key_twice(origins, target, key, target_value, errors)
        elif origins.get(target, ("", None))[0] == key:
            del origins[target]


def _apply_override(cfg: DictConfig, text: str, notice: Callable[[str], None], errors: list[str],
                    deferred: dict[str, Any], given: dict[str, Any],
                    origins: dict[str, tuple[str, Any]] | None = None,
                    verl_only: dict[str, Any] | None = None) -> None:
    """One command-line override in Hydra's grammar: ``key=value``, ``+key=value``, ``++key=value``, ``~key``;
    ``given`` records the schema keys it sets (a deleted one goes back to its default, no longer given),
    ``origins`` the spelling that set each (forgotten where it is deleted: another spelling may set it again), and
    ``verl_only`` the value of each key without effect it sets (see _resolved_value)."""
    origins = {} if origins is None else origins
    verl_only = {} if verl_only is None else verl_only
    try:
        override = _parser().parse_override(text)
    except HydraException as exc:
        if "=" not in text and text.lower().endswith((".yaml", ".yml")):  # a config file given as an override
            errors.append(f"override {text!r} names a YAML file, not key=value: give a config file as --config {text} "
                          "(in a pipeline's run config, as its trainer_config)")
            return
        errors.append(f"override {text!r} is not key=value ({str(exc).splitlines()[0]}); quote a value that "
                      "holds special characters, e.g. data.train_files='~/data/train.parquet' (on a shell's "
                      "command line inside double quotes, which the shell removes: "
                      "\"data.train_files='~/data/train.parquet'\")")
        return
    if not override.key_or_group:  # '=3', '+=3', '~': Hydra's grammar takes them, as the key ''
        errors.append(f"override {text!r} names no key: write key=value (e.g. trainer.total_training_steps=3), "
                      "+key=value or ~key")
        return
    key = _older_reward_key(override.key_or_group, notice)
    if key == "hydra" or key.startswith(("hydra.", "hydra/")):  # as a config file's hydra: section
        notice(f"notice: {text} is Hydra's own setting (its run folder, logging, working directory), not read "
               "here: relative paths are read from the current folder, and the checkpoints and metrics go to "
               "trainer.default_local_dir")
        return
    if without_effect(key) is not None:
        if override.is_delete():
            verl_only.pop(key, None)
        else:
            verl_only[key] = override.value()
    if override.package is not None or override.is_sweep_override():
        errors.append(f"override {text!r}: sweeps and @package are not supported here; write a list as "
                      f"{key}=[a,b]")
    elif override.is_delete():  # ~key: back to the default
        if override.value_type is not None:
            errors.append(f"override {text!r}: write ~{key} (deleting only a given value is not supported)")
            return
        if key in deferred or _deferred(key, None):  # a value held until every key is set (see _deferred):
            deferred.pop(key, None)                   # dropped, whatever held it (a shard size, an interpolation)
            if key in SWITCHES:
                _switched(origins, key, override.key_or_group, None, errors)
            return
        if without_effect(key) is not None or (key in ALIASES and without_effect(ALIASES[key][0]) is not None):
            return  # a verl key without effect (or its alias) set nothing
        if key in ALIASES or key == POLICY_MODEL_DTYPE:  # ~alias: back to the default, the key it stands for (and
            canonical, extra = ALIASES.get(key, ("actor_rollout_ref.model.dtype", {}))  # what it sets besides)
            for target in (canonical, *extra):
                _assign(cfg, target, _default(target), errors, merge=False)
                given.pop(target, None)
                origins.pop(target, None)
            return
        for target in _targets(key, None, notice, errors):
            if _open_key(target) is not None:  # a key the user named in an open mapping: gone, as Hydra's ~ does
                _delete_entry(cfg, target, key, errors)
            else:
                _assign(cfg, target, _default(target), errors, merge=False)
            given.pop(target, None)
            origins.pop(target, None)
    elif (problem := _none_as_text(cfg, key, override.value())) is not None:
        errors.append(problem)
    elif _deferred(key, override.value()):
        deferred[key] = override.value()
        if key in SWITCHES:
            _switched(origins, key, override.key_or_group, override.value(), errors)
    else:  # key=value, +key=value and ++key=value all set a key of the schema
        for target, value in _targets(key, override.value(), notice, errors).items():
            _same_key_twice(origins, target, override.key_or_group, value, errors)
            _assign(cfg, target, value, errors)
            given[target] = value


def _none_as_text(cfg: DictConfig, key: str, value: Any, in_file: bool = False) -> str | None:
    """The problem of ``KEY=None`` (which Hydra, as YAML, reads as the text 'None') on a key that takes null: a
    verl key whose null sets nothing before it reaches the schema (a global micro-batch size, a key without
    effect, one whose null is its default, one that repeats another key, the critic's switch, an alias whose null
    is verl's unused key, a deprecated switch, a model_dtype), or a key of the schema whose field is Optional (the
    key an alias stands for, named as such), else None: the text fails there as something else (two sizes set, a
    value not supported, a type), or is taken as text (an entry of an open mapping, a text key without null). The
    advice is written as the key was: ``KEY=null`` on the command line, ``name: null`` under its section in a file (a
    micro-batch size whose null needs dynamic batching: with it, or a size instead)."""
    if value not in ("None", "none"):
        return None
    verl_only = without_effect(key)
    if verl_only is not None and verl_only[0](value):  # a key without effect whatever it holds: the text is as
        return None                                    # harmless (verl's nsys option kill: none, nsys's own word)
    refused: list[str] = []
    if key in GLOBAL_MICRO_BATCHES or key in NULL_IS_DEFAULT or key in MIRRORS or key == CRITIC_ENABLE or (
            verl_only is not None and verl_only[0](None)) or (  # an alias or a switch whose null sets nothing
            (key in ALIASES or key in SWITCHES or key == POLICY_MODEL_DTYPE) and not _targets(
                key, None, lambda _: None, refused) and not refused) or key in FOLLOWER_MODEL_DTYPES:
        target = key
    else:  # the keys of the schema it sets (its notices and refusals are said when it is set)
        targets = [target for target, text in _targets(key, value, lambda _: None, []).items() if text == value
                   and target in _known_keys_and_sections() and _open_key(target) is None and _takes_null(cfg, target)]
        if not targets:
            return None
        target = targets[0]
    section, _, name = target.rpartition(".")
    if target in STR_OR_LIST_KEYS and target not in STR_OR_LIST_NULL and target not in EMPTY_NOT_NULL:
        example = "[a,b]" if not in_file else "[a, b]"
        write = f"{target}={example}" if not in_file else f"{name}: {example}" + (f" under {section}" if section else "")
        return f"{target}={value!r}: None is read as text, and {target} takes no null: a string or a list, e.g. {write}"
    if target in NULL_NEEDS_DYNAMIC:  # null alone is refused by validation: the choices that are taken
        over_all = next(k for k, per_worker in GLOBAL_MICRO_BATCHES.items() if per_worker == target)
        said = f"{target}={value!r}: None is read as text: write "
        if not in_file:
            return (f"{said}{target}=null with {section}.use_dynamic_bsz=True; without dynamic batching it "
                    f"takes a size, e.g. {target}={_default(target)} (or {over_all} over all workers in its "
                    "place)")
        return (f"{said}{name}: null and use_dynamic_bsz: true under {section}; without dynamic batching it "
                f"takes a size, e.g. {name}: {_default(target)} (or {over_all.rpartition('.')[2]} over all "
                "workers in its place)")
    null, meaning = ("[]", f" ({EMPTY_NOT_NULL[target]})") if target in EMPTY_NOT_NULL else ("null", "")
    write = f"{target}={null}" if not in_file else f"{name}: {null}" + (f" under {section}" if section else "")
    return f"{target}={value!r}: None is read as text: write {write}{meaning}"


def _deferred(key: str, value: Any) -> bool:
    """Whether ``key`` is settled once every other key is: a value that depends on the others (a deprecated
    size over all workers, a key that repeats another's value, verl's critic switch and shard-group sizes, the
    reference's and the critic's model_dtype, an interpolation on a key without effect), or a deprecated switch,
    whose last value decides (a later false or ~key undoes a true)."""
    return key in GLOBAL_MICRO_BATCHES or key in MIRRORS or key == CRITIC_ENABLE or key in FOLLOWER_MODEL_DTYPES or (
        key in SWITCHES and isinstance(value, bool | None)) or (
        key in FSDP_SIZES and value is not None) or (
        without_effect(key) is not None and isinstance(value, str) and value.startswith("${"))


def _resolved_value(cfg: DictConfig, value: Any, verl_only: Mapping[str, Any]) -> Any:
    """``value`` with its ``${...}`` interpolation resolved against ``cfg`` and the keys without effect given,
    ``verl_only`` (as verl's config would resolve it: verl's reference reads the actor's
    ulysses_sequence_parallel_size so, a key that sets nothing here)."""
    if not (isinstance(value, str) and value.startswith("${")):
        return value
    tree = OmegaConf.to_container(cfg)
    for key, held in verl_only.items():
        *sections, name = key.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
            if not isinstance(node, dict):  # (below a key of the schema: nothing to read there)
                break
        else:
            node.setdefault(name, held)
    try:
        return OmegaConf.create({**tree, "_probe": value})._probe
    except Exception:  # noqa: BLE001 - an interpolation that does not resolve here is reported as given
        return value


def _assign_deferred(cfg: DictConfig, values: dict[str, Any], notice: Callable[[str], None],
                     errors: list[str], given: dict[str, Any], verl_only: Mapping[str, Any]) -> None:
    """verl's deprecated micro-batch sizes over all workers, as their per-worker keys (see GLOBAL_MICRO_BATCHES),
    the DAPO recipe's response budget of its length penalty, which must be data.max_response_length, the
    reference's and the critic's model_dtype, judged against the policy's, and the interpolations given to keys
    without effect, judged by what they resolve to (``verl_only``: the values of those keys given, which they may
    read)."""
    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    for key, value in values.items():
        value = _resolved_value(cfg, value, verl_only)
        if without_effect(key) is not None and (value is None or key not in FSDP_SIZES):  # a null as a written one
            _targets(key, value, notice, errors)  # a notice, or an error saying what the trainer does instead
            continue
        if value is None:
            continue
        if key in SWITCHES:  # on: its targets, over theirs given elsewhere (as verl's switch decides); off: nothing
            for target, target_value in _targets(key, value, notice, errors).items():
                if given.get(target) not in (None, target_value):
                    notice(f"notice: {target}={given[target]!r} is not read: {key}=true sets {target}={target_value} "
                           f"(as in verl); set {key}=false to keep {given[target]!r}")
                _assign(cfg, target, target_value, errors)
                given[target] = target_value
            continue
        if key in FSDP_SIZES and isinstance(value, int) and not isinstance(value, bool) and (
                value < 0 or value >= world):
            notice(f"notice: {key}={value!r} has no effect: FSDP2 shards over all the {world} workers")
            continue
        if key in FSDP_SIZES:
            errors.append(f"{key}={value!r} is not supported: FSDP2 shards over all the {world} workers "
                          f"(trainer.n_gpus_per_node * trainer.nnodes); hybrid sharding over groups of fewer is "
                          "not done here: set -1")
            continue
        if key in MIRRORS:
            canonical, reader = MIRRORS[key]
            if value != (held := OmegaConf.select(cfg, canonical)):
                errors.append(f"{key}={value!r} differs from {canonical} ({held!r}), {reader}")
            elif not key.startswith("reward_model.reward_kwargs."):
                notice(f"notice: {key}={value!r} is taken: it repeats {canonical}, {reader}")
            continue
        if key == CRITIC_ENABLE:
            from rlhf_core import algos  # imported where needed, as in validate_config

            used = cfg.algorithm.adv_estimator in algos.ADV_ESTIMATORS_NEED_CRITIC
            if not isinstance(value, bool) or value != used:
                errors.append(f"{key}={value!r} is not supported: the critic is trained where the advantage estimator "
                              f"needs it (algorithm.adv_estimator={cfg.algorithm.adv_estimator} "
                              f"{'does' if used else 'does not'})")
            else:
                notice(f"notice: {key}={value!r} is taken: algorithm.adv_estimator={cfg.algorithm.adv_estimator} "
                       f"{'trains' if used else 'uses no'} critic")
            continue
        if key in FOLLOWER_MODEL_DTYPES:  # judged against the policy's dtype, whichever spelling set it
            dtype, policy = VERL_DTYPES.get(str(value)), OmegaConf.select(cfg, "actor_rollout_ref.model.dtype")
            what = FOLLOWER_MODEL_DTYPES[key].format(dtype=policy)
            if dtype is None:
                errors.append(f"{key}={value!r} is not one of {', '.join(VERL_DTYPES)}")
            elif dtype == policy:
                notice(f"notice: {key}={value!r} is taken: {what}")
            elif key.startswith("actor_rollout_ref.ref."):  # (verl's own default: a bf16 reference beside an fp32
                # actor; a copy in the policy's dtype changes the reference's log-probs by their rounding alone)
                notice(f"notice: {key}={value!r} has no effect: {what}")
            else:  # a critic trained in another dtype than asked for
                errors.append(f"{key}={value!r} is not supported: {what}; leave it out, or set "
                              f"actor_rollout_ref.model.dtype={dtype} for both")
            continue
        per_worker = GLOBAL_MICRO_BATCHES[key]
        if given.get(per_worker) is not None:  # set by the user, to any value (verl's generated config holds it null)
            errors.append(f"{key} and {per_worker} are both set (as in verl, one or the other)")
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % world:
            errors.append(f"{key}={value!r} (deprecated, over all {world} workers) must be a positive multiple of "
                          f"trainer.n_gpus_per_node * trainer.nnodes; or set {per_worker}")
            continue
        notice(f"notice: {key} is deprecated (as in verl): {per_worker}={value // world} set in its place")
        _assign(cfg, per_worker, value // world, errors)


def _read_yaml(path: Path) -> DictConfig:
    if path.is_dir():
        raise ConfigError([f"config file {path} is a folder: name the YAML file in it"])
    if not path.is_file():
        raise ConfigError([f"config file {path} does not exist"])
    try:
        tree = OmegaConf.load(path)
    except yaml.YAMLError as exc:
        raise ConfigError([f"config file {path} is not valid YAML: {exc}"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([f"config file {path} is not UTF-8 text (byte {exc.start}: {exc.reason})"]) from exc
    except GrammarParseError as exc:  # OmegaConf parses each ${...} as it reads the file
        raise ConfigError([f"config file {path}: {exc.full_key} holds a ${{...}} that does not parse "
                           f"({exc.msg.splitlines()[0]}): close it with }}, or write \\${{ for the text ${{"]) from exc
    except KeyValidationError as exc:  # a key YAML reads as null (null: 1, ~: 1, or a bare ? line), a traceback before
        raise ConfigError([f"config file {path}: {_where_in_file(exc.full_key)} has a key that is null (null or ~ "
                           "written as a key): write the key's name, or remove that line"]) from exc
    except OSError as exc:  # (OmegaConf refuses a file that is one number or bool with an OSError of its own)
        if "Invalid loaded object type" not in str(exc):
            raise ConfigError([f"config file {path} cannot be read: {exc.strerror or exc}"]) from exc
        tree = None
    if not isinstance(tree, DictConfig):
        raise ConfigError([f"config file {path} must hold a mapping of config keys"])
    if len(tree) == 1 and tree[next(iter(tree))] is None and isinstance(text := yaml.safe_load(path.read_text()), str):
        # one line of text (OmegaConf reads it as a key): overrides written into the file, 'trainer.seed=3'
        raise ConfigError([f"config file {path} must hold a mapping of config keys, not the text {text!r}: write "
                           "each key under its section (trainer:, then seed: 3 indented), or give key=value "
                           "overrides on the command line"])
    if blank := [(section, key) for section, key in _keys_in_file(OmegaConf.to_container(tree)) if not str(key).strip()]:
        # (read as the key '' of its section: "unknown config key trainer." with a near name that was no help)
        raise ConfigError([f"config file {path}: {_where_in_file(section)} has a key that is "
                           f"{'empty' if key == '' else 'blank'} ({key!r}): write the key's name, or remove that line"
                           for section, key in blank])
    parameters = tree.get("parameters")
    if isinstance(parameters, DictConfig) and "trainer_config" in parameters:  # a pipeline's, not a trainer's
        raise ConfigError([f"config file {path} is a ZenML pipeline run config (its parameters name the trainer "
                           f"config {parameters.get('trainer_config')!r}, with overrides of its own): run the pipeline "
                           f"it is for with it (zenml pipeline run pipelines.rlhf_ppo.rlhf_ppo_pipeline -c {path}, "
                           "or the retraining or reward-model pipeline), or give the trainer config itself here"])
    return tree


def _keys_in_file(node: Any, section: str = "") -> Iterator[tuple[str, Any]]:
    """``(section, key)`` for every key of the mappings in ``node`` (a file's tree as plain dicts and lists), each
    with the dotted section that holds it ('' for the top level; a list's item as section[i])."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield section, key
            yield from _keys_in_file(value, f"{section}.{key}" if section else str(key))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _keys_in_file(item, f"{section}[{i}]")


def _where_in_file(section: str) -> str:
    """A section of a config file as its problems name it: its dotted key, or the file's top level."""
    return section if section else "the top level"


def _build(trees: Iterable[DictConfig], overrides: Iterable[str], notice: Callable[[str], None],
           validate: bool, sources: Sequence[str | os.PathLike] = ()) -> PPOConfig:
    """Defaults, then the keys of each of ``trees`` in turn (a later one's override an earlier one's), then
    ``overrides``; resolved, typed and (optionally) validated. ``sources``: the files the trees were read from,
    named beside the problems of their keys."""
    said: list[str] = []  # the notices given, so that the resolved trainer.logger's is not said again

    def notice_kept(message: str) -> None:
        said.append(message)
        notice(message)

    cfg = OmegaConf.structured(PPOConfig)
    errors: list[str] = []
    deferred: dict[str, Any] = {}
    given: dict[str, Any] = {}  # the schema keys the files and the overrides set, with their values
    verl_only: dict[str, Any] = {}  # the keys without effect they set, with theirs (an interpolation may read them)
    set_in_file: dict[str, str] = {}  # the keys the files set, each with the last file that set it
    for position, tree in enumerate(trees):
        first = len(errors)
        in_file: dict[str, tuple[str, Any]] = {}  # each key this file sets: the spelling that set it, and its value
        for written, value in _leaves(tree):
            key = _older_reward_key(written, notice_kept)
            if (problem := _none_as_text(cfg, key, value, in_file=True)) is not None:
                errors.append(problem)
                continue
            if without_effect(key) is not None:
                verl_only[key] = value
            if _deferred(key, value):
                deferred[key] = value
                if key in SWITCHES:
                    _switched(in_file, key, written, value, errors)
                continue
            for target, target_value in _targets(key, value, notice_kept, errors).items():
                _same_key_twice(in_file, target, written, target_value, errors)
                _assign(cfg, target, target_value, errors)
                given[target] = target_value
                if position < len(sources):
                    set_in_file[target] = str(sources[position])
        if position < len(sources):  # (a key misspelt in one of several files, or in a file a pipeline names)
            errors[first:] = [f"{error} (in {sources[position]})" for error in errors[first:]]
    on_command_line: dict[str, tuple[str, Any]] = {}  # (a command line's later value overrides the file's)
    for text in overrides:
        _apply_override(cfg, text, notice_kept, errors, deferred, given, on_command_line, verl_only)
    _assign_deferred(cfg, deferred, notice_kept, errors, given, verl_only)
    if not errors:
        try:
            resolved = OmegaConf.to_object(cfg)  # resolves ${...}
        except InterpolationResolutionError as exc:
            in_file = {key: file for key, file in set_in_file.items() if key not in on_command_line}
            errors.extend(_interpolation_problems(cfg, given, exc, in_file))
        except MissingMandatoryValue as exc:  # verl's ??? for a key its user must set
            errors.append(f"{exc.full_key} must be set (the config holds ??? there)")
        else:  # a 'tracking' written was taken as wandb as it was set; one an interpolation resolves to, here
            resolved.trainer.logger = _tracking_as_wandb(  # (said once where the list held both)
                resolved.trainer.logger, lambda message: None if message in said else notice(message))
            if (unused := _kl_ctrl_unused(resolved, given)) is not None:
                notice(unused)
            for kl_notice in _kl_term_notices(resolved, given):
                notice(kl_notice)
            if (clip := _clip_ratio_notice(resolved, given)) is not None:
                notice(clip)
            for unused in _resume_path_unused(resolved):
                notice(unused)
            for unread in _vllm_only_unread(resolved, given):
                notice(unread)
            if (greedy := _greedy_validation(resolved.actor_rollout_ref.rollout.val_kwargs)) is not None:
                notice(greedy)
    if errors:
        raise ConfigError(errors)
    if validate:
        validate_config(resolved)
    return resolved


def _kl_ctrl_unused(cfg: PPOConfig, given: dict[str, Any]) -> str | None:
    """The notice for ``algorithm.kl_ctrl.*`` set away from its defaults in a run without KL in the reward, where
    nothing reads the controller (verl ignores it alike, silently): a KL loss's coefficient is its own key."""
    if cfg.algorithm.use_kl_in_reward:
        return None
    defaults = KLCtrlConfig()
    changed = [f"algorithm.kl_ctrl.{name}={value!r}" for name, value in dataclasses.asdict(cfg.algorithm.kl_ctrl).items()
               if _set_by_user(given, f"algorithm.kl_ctrl.{name}") and value != getattr(defaults, name)]
    if not changed:
        return None
    actor = cfg.actor_rollout_ref.actor
    loss = (f"the run's KL loss has its own coefficient, actor_rollout_ref.actor.kl_loss_coef={actor.kl_loss_coef!r} "
            "(fixed)" if actor.use_kl_loss else
            "or for a KL loss set actor_rollout_ref.actor.use_kl_loss=true with its own kl_loss_coef (fixed)")
    return (f"notice: {', '.join(changed)} {'has' if len(changed) == 1 else 'have'} no effect: algorithm.kl_ctrl "
            "sets the coefficient of the KL in the reward, and algorithm.use_kl_in_reward=false; set it true for "
            f"that KL{';' if actor.use_kl_loss else ','} {loss}")


#: the rollout keys only the vLLM engine reads (rollout/vllm.py; the actor reads tensor_model_parallel_size too, for
#: the vLLM rollout alone, to seed its ranks)
VLLM_ONLY = ("dtype", "tensor_model_parallel_size", "gpu_memory_utilization", "free_cache_engine", "enforce_eager",
             "max_num_batched_tokens", "enable_chunked_prefill")


def _vllm_only_unread(cfg: PPOConfig, given: dict[str, Any]) -> list[str]:
    """The notices for the keys of :data:`VLLM_ONLY` set away from their defaults where the rollout is hf, which
    reads none of them: verl's rollout is vLLM, so a verl command's engine settings ran transformers' generate
    without a word."""
    key, rollout = "actor_rollout_ref.rollout", cfg.actor_rollout_ref.rollout
    if rollout.name != "hf":
        return []
    defaults = RolloutConfig()
    return [f"notice: {key}.{name}={getattr(rollout, name)!r} has no effect: it is read by the vLLM rollout only "
            f"({key}.name=vllm; GPU), and {key}.name=hf generates with transformers' generate"
            for name in VLLM_ONLY
            if _set_by_user(given, f"{key}.{name}") and getattr(rollout, name) != getattr(defaults, name)]


def _greedy_validation(val_kwargs: ValKwargsConfig) -> str | None:
    """The notice for validation settings that a greedy validation does not read: ``do_sample=false`` decodes
    greedily whatever ``temperature``, ``top_p`` and ``top_k`` say (as verl's vLLM rollout; its agent-loop rollout
    samples at ``val_kwargs.temperature`` whatever ``do_sample`` says), and a temperature of 0 does too; with
    ``n > 1`` each prompt's responses are then one response repeated, its best@n and maj@n its mean@n."""
    key, n = "actor_rollout_ref.rollout.val_kwargs", val_kwargs.n
    repeated = (f", so each prompt's {key}.n={n} responses are one response {n} times over (best@{n}, worst@{n} and "
                f"maj@{n} equal to mean@{n})" if n > 1 else "")
    if val_kwargs.do_sample:
        if val_kwargs.temperature > 0 or n == 1:
            return None
        return (f"notice: {key}.temperature={val_kwargs.temperature} validates greedily{repeated}; set "
                f"{key}.temperature above 0 to sample")
    unread = [f"{key}.{name}={value}" for name, value, read in (
        ("temperature", val_kwargs.temperature, val_kwargs.temperature > 0),
        ("top_p", val_kwargs.top_p, val_kwargs.top_p < 1),
        ("top_k", val_kwargs.top_k, val_kwargs.top_k > 0)) if read]  # (values sampling would read: the defaults are off)
    if not unread and n == 1:
        return None
    effect = f"{', '.join(unread)} {'has' if len(unread) == 1 else 'have'} no effect: " if unread else ""
    return (f"notice: {effect}{key}.do_sample=false validates greedily (verl's agent-loop rollout samples at "
            f"val_kwargs.temperature all the same){repeated}; set {key}.do_sample=true to sample")


#: verl's defaults of actor.clip_ratio_low and clip_ratio_high, which its policy losses read before clip_ratio
VERL_CLIP_BOUND = 0.2


def _kl_term_notices(cfg: PPOConfig, given: dict[str, Any]) -> list[str]:
    """The notices on the run's KL terms: the keys of a KL term that is off, set away from their defaults (nothing
    reads them: a GSM8K recipe's kl_loss_coef and kl_loss_type copied without use_kl_loss=true leave the policy
    with no KL at all), and both terms on at once (the policy held to the reference twice, as verl notes too)."""
    actor, algo = cfg.actor_rollout_ref.actor, cfg.algorithm
    said = []
    for switch, section, values, names, defaults, term in (
            ("use_kl_loss", "actor_rollout_ref.actor", actor, ("kl_loss_coef", "kl_loss_type"), ActorConfig(),
             "the policy loss holds no KL term"),
            ("use_kl_in_reward", "algorithm", algo, ("kl_penalty",), AlgorithmConfig(),
             "the rewards hold no KL penalty")):
        if getattr(values, switch):
            continue
        changed = [f"{section}.{name}={getattr(values, name)!r}" for name in names
                   if _set_by_user(given, f"{section}.{name}") and getattr(values, name) != getattr(defaults, name)]
        if changed:
            said.append(f"notice: {', '.join(changed)} {'has' if len(changed) == 1 else 'have'} no effect: "
                        f"{section}.{switch}=false, so {term}; set it true for that KL")
    if actor.use_kl_loss and algo.use_kl_in_reward:
        said.append(
            "notice: both KL terms are on (algorithm.use_kl_in_reward=true and actor_rollout_ref.actor.use_kl_loss="
            f"true): the policy is held to the reference twice, by the KL penalty in the rewards "
            f"(algorithm.kl_ctrl.kl_coef={algo.kl_ctrl.kl_coef!r}, {algo.kl_ctrl.type}) and by the KL loss "
            f"(kl_loss_coef={actor.kl_loss_coef!r}); set one of them false for one KL term")
    return said


def _clip_ratio_notice(cfg: PPOConfig, given: dict[str, Any]) -> str | None:
    """The notice for a ``clip_ratio`` set away from 0.2 with a bound of its own left null: here that bound is
    ``clip_ratio``, while verl's ``clip_ratio_low`` and ``clip_ratio_high`` default to 0.2 and take precedence, so the
    same command clips otherwise in verl (``clip_ratio=0.1`` alone: [0.9, 1.1] here, [0.8, 1.2] there)."""
    actor, key = cfg.actor_rollout_ref.actor, "actor_rollout_ref.actor"
    following = [name for name in ("clip_ratio_low", "clip_ratio_high") if getattr(actor, name) is None]
    if not following or actor.clip_ratio == VERL_CLIP_BOUND or not _set_by_user(given, f"{key}.clip_ratio"):
        return None
    low, high = (actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low,
                 actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high)
    verl_low, verl_high = (VERL_CLIP_BOUND if actor.clip_ratio_low is None else actor.clip_ratio_low,
                           VERL_CLIP_BOUND if actor.clip_ratio_high is None else actor.clip_ratio_high)
    return (f"notice: {key}.clip_ratio={actor.clip_ratio:g} clips the ratio to [{1 - low:g}, {1 + high:g}] here, "
            f"{' and '.join(following)} (null) following it; verl's clip_ratio_low and clip_ratio_high default to "
            f"{VERL_CLIP_BOUND:g} and come first there, so verl clips the same command at [{1 - verl_low:g}, "
            f"{1 + verl_high:g}]; set {' and '.join(following)} to say which")


def _set_by_user(given: dict[str, Any], key: str) -> bool:
    """Whether a file or an override set ``key``, by its own name or in a mapping given to a section above it."""
    parts = key.split(".")
    return any(".".join(parts[:end]) in given for end in range(1, len(parts) + 1))


def _resume_path_unused(cfg: PPOConfig) -> list[str]:
    """The notices for a ``resume_from_path`` set where its ``resume_mode`` (auto or disable) does not read it: a
    run given the checkpoint to go on from, without resume_mode=resume_path, trained from the model without a word
    (as verl's does), or went on from the folder's own latest checkpoint instead."""
    said = []
    for key, section in (("trainer", cfg.trainer), ("reward_model.train", cfg.reward_model.train)):
        if not section.resume_from_path or section.resume_mode not in ("auto", "disable"):
            continue
        does = (f"resumes from the latest checkpoint in {key}.default_local_dir, and starts a new run where there is "
                "none" if section.resume_mode == "auto" else "starts a new run")
        said.append(f"notice: {key}.resume_from_path={section.resume_from_path} is not read: {key}.resume_mode="
                    f"{section.resume_mode} {does}; to resume from that checkpoint, set {key}.resume_mode=resume_path")
    return said


# ${trainer.experiment_name}: an interpolation of another key (no resolver); Hydra's ${now:%Y%m%d}
_KEY_READ = re.compile(r"\$\{([\w.-]+)\}")
_NOW = re.compile(r"\$\{now:([^}]*)\}")


def _interpolation_problems(cfg: DictConfig, given: dict[str, Any], exc: InterpolationResolutionError,
                            in_file: dict[str, str]) -> list[str]:
    """``exc`` said of each key the user set whose own value fails to resolve (``trainer.experiment_name=
    ${now:...}``), not of a key that reads it (``trainer.default_local_dir: ckpt/${trainer.experiment_name}``, or
    ``reward_model.train.default_local_dir``, which reads the experiment's name): the first key that read it is
    named beside it. ``in_file``: the keys a config file set last, with that file."""
    failing: dict[str, str] = {}  # each given key that does not resolve, with what its resolution said
    for key, value in given.items():
        if isinstance(value, str) and "${" in value:
            try:
                OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
            except InterpolationResolutionError as own:
                failing[key] = own.msg.splitlines()[0]

    def failing_itself(key: str, seen: frozenset[str]) -> str:  # followed through the failing keys it reads
        for read in _KEY_READ.findall(given[key]):
            if read in failing and read not in seen:
                return failing_itself(read, seen | {read})
        return key

    said = exc.msg.splitlines()[0]
    culprits = list(dict.fromkeys(failing_itself(key, frozenset({key})) for key in failing)) or [exc.full_key]
    problems = []
    for culprit in culprits:
        message = failing.get(culprit, said)
        problem = f"{culprit}: {message}"
        if message == said and culprit != exc.full_key:
            problem += f" (read by {exc.full_key})"
        if "interpolation type now" in message:
            problem += "; Hydra's ${now:...} is not registered here: " + _date_instead(culprit, given, in_file)
        problems.append(problem)
    return problems


def _date_instead(key: str, given: dict[str, Any], in_file: dict[str, str]) -> str:
    """How to give the date that ``key``'s ``${now:...}`` asks for: written out in the config file that set the
    key, or from the shell on the command line; a key inside a list or an open mapping (``trainer.logger[1]``) is
    given as the whole value that holds it, as it was written."""
    owner = next((k for k in given if key == k or key.startswith((f"{k}.", f"{k}["))), key)
    value = given.get(owner)
    if not isinstance(value, str | list | dict):
        return f"give the date from the shell, e.g. {key}=run_$(date +%Y%m%d_%H%M%S)"
    if owner in in_file:
        written = _dated(value, lambda now: datetime.datetime.now().strftime(now.group(1)))
        return f"write the value itself in {in_file[owner]}, e.g. {owner.rpartition('.')[2]}: {_flow(written)}"
    from_shell = _dated(value, lambda now: f"$(date {shlex.quote('+' + now.group(1))})")
    shown = from_shell if isinstance(from_shell, str) else f'"{_override_flow(value)}"'  # (it holds spaces)
    if isinstance(value, str) and not _read_as_written(_dated(value, lambda now: datetime.datetime.now().strftime(
            now.group(1)))):  # the date quoted for Hydra, inside the shell's quotes
        shown = f'"\'{from_shell}\'"'
    return f"give the date from the shell, e.g. {owner}={shown}"


def _read_as_written(text: str, text_only: bool = False) -> bool:
    """Whether Hydra reads ``text``, given unquoted on the command line, as that text: a date written
    20261206_105832 is read as the number 20261206105832 there, 12.10 as 12.1. ``text_only``: as text, not
    as a number written the same (20261206), which nothing turns back into text in a list or a mapping."""
    try:
        read = _parser().parse_override(f"key={text}").value()
    except HydraException:
        return False
    return str(read) == text and (isinstance(read, str) or not text_only)


def _override_flow(value: Any) -> str:
    """A list or mapping ``value`` as Hydra reads it back from a shell's command line (inside double quotes),
    each ``${now:...}`` given by the shell's date: ``[a, b]``, ``{k: v}``, a text quoted for Hydra where it
    would read it as something else (the date 20261206 as a number, true as a switch)."""
    if isinstance(value, list):
        return "[" + ", ".join(map(_override_flow, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{name}: {_override_flow(item)}" for name, item in value.items()) + "}"
    if not isinstance(value, str):
        return _flow(value)  # a number, a switch or null, as Hydra reads it too
    today = _dated(value, lambda now: datetime.datetime.now().strftime(now.group(1)))
    if _read_as_written(today, text_only=True):
        return _dated(value, lambda now: f"$(date {shlex.quote('+' + now.group(1))})")
    in_quotes = _dated(value.replace("'", "\\'"), lambda now: f"$(date {shlex.quote('+' + now.group(1))})")
    return f"'{in_quotes}'"  # (a quote in the text escaped for Hydra, not the shell's around a date's format)


def _dated(value: Any, date: Callable[[re.Match], str]) -> Any:
    """``value`` with each ``${now:...}`` in its text (in its lists and mappings too) replaced by ``date``'s."""
    if isinstance(value, str):
        return _NOW.sub(date, value)
    if isinstance(value, list):
        return [_dated(item, date) for item in value]
    if isinstance(value, dict):
        return {name: _dated(item, date) for name, item in value.items()}
    return value


def _flow(value: Any) -> str:
    """``value`` as YAML writes it on one line: text as it is, or quoted where YAML would read it as something else
    (a date written 20261206_105832 is read as a number there, 10:58 as one of minutes), a list as ``[a, b]``, a
    mapping as ``{k: v}``."""
    flow = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, sort_keys=False)
    return flow.removesuffix("...\n").strip()  # (the end of document YAML writes after a lone text)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


#: entries of a Hydra defaults list that name verl's own tree, which is this trainer's defaults
VERL_OWN_DEFAULTS = frozenset({"ppo_trainer", "_self_"})


def _sets_hydra_group(entry: Any) -> bool:
    """Whether a defaults-list entry chooses one of Hydra's own settings (``override hydra/job_logging:
    disabled``): those are Hydra's, as the ``hydra:`` section is, not the trainer's."""
    if not isinstance(entry, dict) or len(entry) != 1:
        return False
    group = str(next(iter(entry))).strip()
    group = group.removeprefix("override").strip().lstrip("/")
    return group.startswith("hydra/")


def _without_hydra_keys(tree: DictConfig, path: Path, notice: Callable[[str], None]) -> DictConfig:
    """A verl experiment file's tree without Hydra's keys: a ``defaults`` list naming only verl's ppo_trainer (and
    ``_self_`` after it) is dropped with a notice, since that tree is the defaults here; one naming other files is
    refused, since the files it names are not read, and so is ``_self_`` before ppo_trainer, with which Hydra
    applies verl's defaults over the file's own keys. ``hydra`` (Hydra's own settings: search path, run folder)
    and the defaults list's ``override hydra/...`` entries are dropped with a notice."""
    if "defaults" in tree:
        listed = OmegaConf.to_container(tree["defaults"]) if isinstance(tree["defaults"], ListConfig | DictConfig) \
            else tree["defaults"]
        entries = listed if isinstance(listed, list) else [listed]

        def shown(chosen: list) -> str:
            return ", ".join(", ".join(f"{k}: {v}" for k, v in e.items()) if isinstance(e, dict) else str(e)
                             for e in chosen)

        if hydra_settings := [e for e in entries if _sets_hydra_group(e)]:
            notice(f"notice: config file {path}: its defaults list's {shown(hydra_settings)} (Hydra's own "
                   "settings) is not read here")
            entries = [e for e in entries if not _sets_hydra_group(e)]
        if any(not isinstance(e, str) or e.lstrip("/") not in VERL_OWN_DEFAULTS for e in entries):
            raise ConfigError([
                f"config file {path}: its Hydra defaults list ({shown(entries)}) is not read here: the files it "
                "names would be merged by Hydra, which does not load this config. Write the keys you need from "
                "them into this file directly (under their sections, e.g. actor_rollout_ref.actor.clip_ratio_high), "
                "or give a file of verl keys as a --config before this one (files merge in order), and delete the "
                "defaults list; a list naming only ppo_trainer and _self_ is taken, as verl's ppo_trainer tree is "
                "the defaults here"])
        names = [e.lstrip("/") for e in entries]
        if "_self_" in names and "ppo_trainer" in names and names.index("_self_") < names.index("ppo_trainer"):
            raise ConfigError([
                f"config file {path}: its defaults list ({shown(entries)}) puts _self_ before ppo_trainer, with "
                "which Hydra applies verl's defaults over this file's own keys, so that those verl sets would not "
                "take effect; here the file's keys always apply over the defaults: put _self_ after ppo_trainer "
                "(or delete the defaults list), and delete from the file the keys meant to stay at verl's defaults"])
        if entries:
            notice(f"notice: config file {path}: its defaults list ({shown(entries)}) is not read: verl's "
                   "ppo_trainer tree is the defaults here, and the file's keys apply over it")
        tree = OmegaConf.masked_copy(tree, [k for k in tree.keys() if k != "defaults"])
    if "hydra" in tree:
        notice(f"notice: config file {path}: hydra.* (Hydra's own settings) is not read here")
        tree = OmegaConf.masked_copy(tree, [k for k in tree.keys() if k != "hydra"])
    return tree


def load_config(
    overrides: Iterable[str] = (),
    config_file: str | Path | Sequence[str | Path] | None = None,
    notice: Callable[[str], None] = _stderr,
    validate: bool = True,
) -> PPOConfig:
    """Build the config: defaults, then ``config_file`` (a YAML tree of overrides, or a list of them merged in
    order: a later file's key overrides an earlier file's, as ``overrides`` then override them all)."""
    if config_file is None:
        files = []
    elif isinstance(config_file, str | os.PathLike):
        files = [config_file]
    else:
        files = list(config_file)
    # ~ is the home folder, as for trainer.default_local_dir: a shell leaves it as written after --config=
    paths = [Path(os.path.expanduser(file)) for file in files]
    trees = [_without_hydra_keys(_read_yaml(path), path, notice) for path in paths]
    return _build(trees, overrides, notice, validate, sources=files)


# ----------------------------------------------------------------------------- validation


# values verl takes that this trainer does not implement: refused as such, not matched to a near name (a near name
# here is another algorithm: clip_cov is not cispo, swanlab not wandb)
VERL_VALUES_NOT_HERE = frozenset({
    "clip_cov", "kl_cov", "gpg", "geo_mean", "gmpo", "sapo", "opo", "grpo_vectorized", "rloo_vectorized",
    "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo", "swanlab", "vemlp_wandb", "clearml", "trackio",
    "full", "sglang", "trtllm", "megatron", "npu"})


def _one_of(errors: list[str], key: str, value: Any, valid: Iterable[str]) -> None:
    valid = tuple(valid)
    if value not in valid and str(value).replace("-", "_").lower() in VERL_VALUES_NOT_HERE:
        errors.append(f"{key}={value!r} (verl's) is not implemented here: one of {', '.join(valid)}")
    elif value not in valid:
        close = difflib.get_close_matches(str(value), valid, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        errors.append(f"{key}={value!r} is not one of {', '.join(valid)}{hint}")


#: float keys where +inf means something, and what: torch's clip_grad_norm_ scales the gradients by max_norm / norm
#: capped at 1, which an infinite max_norm leaves at 1 for every finite norm (a non-finite norm skips the step as ever)
INFINITE_MEANS: dict[str, str] = {
    key: "no clipping" for key in ("actor_rollout_ref.actor.grad_clip", "critic.grad_clip", "reward_model.train.grad_clip")}


@functools.cache
def _float_keys(section: type | None = None, prefix: str = "") -> tuple[str, ...]:
    """The dotted keys below ``section`` (the whole tree by default) that hold floats: typed ``float``,
    ``float | None`` or ``list[float]``."""
    section = section or PPOConfig
    keys: list[str] = []
    types = get_type_hints(section)
    for name in _fields(section):
        kind = types[name]
        if dataclasses.is_dataclass(kind):
            keys += _float_keys(kind, f"{prefix}{name}.")
        elif kind in (float, float | None, list[float]):
            keys.append(f"{prefix}{name}")
    return tuple(keys)


def _non_finite(cfg: PPOConfig) -> dict[str, str]:
    """The error of each float key holding NaN or an infinity, by key. NaN means nothing anywhere; +inf is taken
    only where :data:`INFINITE_MEANS` says what it does (-inf there is left to those keys' own check, > 0)."""
    problems = {}
    for key in _float_keys():
        value = attribute(cfg, key)
        values = value if isinstance(value, list) else [value]
        if key in INFINITE_MEANS:
            if any(v is not None and math.isnan(v) for v in values):
                problems[key] = f"{key}={value} must be a finite number or inf ({INFINITE_MEANS[key]})"
        elif any(v is not None and not math.isfinite(v) for v in values):
            problems[key] = f"{key}={value} must be " + ("finite numbers" if isinstance(value, list) else
                                                         "a finite number")
    return problems


def _positive(errors: list[str], key: str, value: float | None) -> None:
    if value is not None and not value > 0:
        errors.append(f"{key}={value} must be > 0")


def _check_batches(errors: list[str], prefix: str, mini: int, micro: int | None, dynamic: bool,
                   max_tok: int, cfg: PPOConfig, check_train_batch: bool = True,
                   sharing: tuple[tuple[str, int | None, bool], ...] = ()) -> None:
    """The batch arithmetic of one trained model (``prefix``); ``sharing``: (prefix, micro-batch size, dynamic) of
    another model whose mini-batch follows this one's, so that a suggested size fits it too."""
    data, n, world = cfg.data, cfg.actor_rollout_ref.rollout.n, cfg.world_size
    if check_train_batch and data.train_batch_size % mini:
        errors.append(_mini_batch_advice(cfg, prefix, mini, ((prefix, micro, dynamic), *sharing)))
    if dynamic and (mini * n) % world:
        errors.append(
            f"{prefix}.ppo_mini_batch_size * rollout.n ({mini} * {n} = {mini * n} sequences) must be divisible "
            f"by the world size ({world}) so each worker gets an equal share of every mini-batch"
        )
    if dynamic:
        budget = data.max_prompt_length + data.max_response_length
        if max_tok < budget:
            errors.append(
                f"{prefix}.ppo_max_token_len_per_gpu ({max_tok}) must be >= max_prompt_length + "
                f"max_response_length ({budget}) with use_dynamic_bsz, or one sequence cannot fit"
            )
    elif micro is None:
        errors.append(f"{prefix}.ppo_micro_batch_size_per_gpu is required when use_dynamic_bsz is off")
    elif (mini * n) % (micro * world):
        errors.append(
            f"{prefix}.ppo_mini_batch_size * rollout.n ({mini} * {n} = {mini * n} sequences) must be "
            f"divisible by {prefix}.ppo_micro_batch_size_per_gpu * world size ({micro} * {world}): "
            "change either so each worker gets whole micro-batches"
        )


def _mini_batch_advice(cfg: PPOConfig, prefix: str, mini: int,
                       models: tuple[tuple[str, int | None, bool], ...]) -> str:
    """The error of a train batch that ``prefix``'s ppo_mini_batch_size does not divide, with a size that passes
    every check on it: a divisor of data.train_batch_size whose sequences (times rollout.n) split into whole
    micro-batches on every worker, for each of ``models`` (prefix, micro-batch size, dynamic) that trains with it.

    A mini-batch of ``d`` prompts is ``d * n`` sequences; they must be a multiple of ``micro * world`` (or of
    ``world`` with dynamic batching), that is ``d`` a multiple of ``unit / gcd(n, unit)``, so ``d`` is a multiple
    of the least common multiple of those over the models."""
    total, n, world = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, cfg.world_size
    step, needs = 1, {}
    for name, micro, dynamic in models:
        if not dynamic and micro is None:
            continue  # (its own error says it is required)
        unit = world if dynamic else micro * world
        step = math.lcm(step, unit // math.gcd(n, unit))
        need = f"the world size ({world})" if dynamic else f"ppo_micro_batch_size_per_gpu * world size ({micro} * {world})"
        needs.setdefault(need, []).append(name)
    head = f"data.train_batch_size ({total}) must be divisible by {prefix}.ppo_mini_batch_size ({mini})"
    fitting = [d for d in range(step, total + 1, step) if total % d == 0]
    if fitting:
        near = min(fitting, key=lambda d: (abs(d - mini), -d))
        return f"{head}: set ppo_mini_batch_size to a divisor, e.g. {near}"
    whole = max(step, (total + step // 2) // step * step)  # the nearest multiple (the larger of two as near)
    said = "; ".join(f"{' and '.join(names)}: of {need}" for need, names in needs.items())
    return (f"{head}, and no divisor of it gives every worker whole micro-batches (ppo_mini_batch_size * rollout.n "
            f"({n}) must be a multiple, for {said}), which needs a multiple of {step} prompts: set "
            f"data.train_batch_size to a multiple of {step} (e.g. {whole}) or lower ppo_micro_batch_size_per_gpu")


def _check_algorithms(errors: list[str], cfg: PPOConfig) -> None:
    """Policy loss, estimator, dynamic sampling, overlong shaping and rollout correction settings."""
    from rlhf_core import algos  # the registries name the valid values (see validate_config)

    actor, rollout, algo, data = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.algorithm, cfg.data
    prefix = "actor_rollout_ref.actor"
    loss_mode = actor.policy_loss.loss_mode
    _one_of(errors, f"{prefix}.policy_loss.loss_mode", loss_mode, algos.POLICY_LOSS_MODES)
    needed = {"gspo": ("clip_ratio_low", "clip_ratio_high"), "cispo": ("clip_ratio_high",)}.get(loss_mode, ())
    unset = [f"{prefix}.{key}" for key in needed if getattr(actor, key) is None]
    if unset:
        hint = ("the paper clips a sequence's ratio to [1 - 3e-4, 1 + 4e-4]: set clip_ratio_low=3e-4 "
                "clip_ratio_high=4e-4" if loss_mode == "gspo" else
                "it is the truncation bound of the importance weight, far above PPO's 0.2: e.g. clip_ratio_high=5.0")
        errors.append(f"{prefix}.policy_loss.loss_mode={loss_mode} needs {' and '.join(unset)} set; {hint}")
    if loss_mode == "gspo" and actor.loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        errors.append(f"{prefix}.loss_agg_mode={actor.loss_agg_mode} conflicts with policy_loss.loss_mode=gspo, "
                      "whose objective is a mean over sequences of token means: use seq-mean-token-mean")
    _positive(errors, f"{prefix}.loss_scale_factor", actor.loss_scale_factor)
    if algo.adv_estimator == "grpo_passk" and rollout.n < 2:
        errors.append(f"algorithm.adv_estimator=grpo_passk needs actor_rollout_ref.rollout.n >= 2 (got {rollout.n}): "
                      "it credits the best response of each group over the second best")

    groups = algo.filter_groups
    if not (cfg.custom_reward_function.path and str(groups.metric).isidentifier()):  # else: a key the reward reports
        _one_of(errors, "algorithm.filter_groups.metric", groups.metric, algos.FILTER_GROUPS_METRICS)
    if groups.enable and groups.metric == "seq_final_reward" and algo.use_kl_in_reward:
        errors.append("algorithm.filter_groups.metric=seq_final_reward is the reward after the KL penalty, which "
                      "comes here after dynamic sampling has picked the groups (algorithm.use_kl_in_reward=true): use "
                      "seq_reward, the reward before it")
    if data.gen_batch_size is not None:
        _positive(errors, "data.gen_batch_size", data.gen_batch_size)
        if not groups.enable and data.gen_batch_size != data.train_batch_size:
            errors.append(f"data.gen_batch_size={data.gen_batch_size} sets the prompts of each generation round of "
                          "dynamic sampling (algorithm.filter_groups.enable=true); without it each step generates "
                          f"data.train_batch_size ({data.train_batch_size}) prompts: leave it null")
    if groups.enable and rollout.n < 2:
        errors.append(f"algorithm.filter_groups.enable=true needs actor_rollout_ref.rollout.n >= 2 (got {rollout.n}): "
                      "with one response per prompt there is no group to filter")

    overlong = cfg.reward_model.overlong_buffer
    if overlong.enable:
        if not 0 < overlong.len <= cfg.data.max_response_length:  # (the whole length: verl takes it too)
            errors.append(f"reward_model.overlong_buffer.len={overlong.len} must be in (0, data.max_response_length = "
                          f"{cfg.data.max_response_length}] with reward_model.overlong_buffer.enable=true")
        if overlong.penalty_factor < 0:
            errors.append(f"reward_model.overlong_buffer.penalty_factor={overlong.penalty_factor} must be >= 0")

    corr = algo.rollout_correction
    key = "algorithm.rollout_correction"
    if corr.rollout_is is not None:
        _one_of(errors, f"{key}.rollout_is", corr.rollout_is, algos.ROLLOUT_IS_LEVELS)
        _positive(errors, f"{key}.rollout_is_threshold", corr.rollout_is_threshold)
    if corr.rollout_rs is not None:
        _one_of(errors, f"{key}.rollout_rs", corr.rollout_rs, algos.ROLLOUT_RS_MODES)
        if corr.rollout_rs_threshold is None:
            errors.append(f"{key}.rollout_rs={corr.rollout_rs} needs {key}.rollout_rs_threshold set, e.g. 2.0")
        elif corr.rollout_rs.endswith("k1") and not corr.rollout_rs_threshold > 1:
            errors.append(f"{key}.rollout_rs_threshold={corr.rollout_rs_threshold} must be > 1 with "
                          f"rollout_rs={corr.rollout_rs} (it bounds the ratio to [1/t, t])")
        else:
            _positive(errors, f"{key}.rollout_rs_threshold", corr.rollout_rs_threshold)
    truncated = [f"top_p={rollout.top_p}"] * (rollout.top_p < 1) + [f"top_k={rollout.top_k}"] * (rollout.top_k > 0)
    if (corr.rollout_is or corr.rollout_rs) and rollout.name == "vllm" and truncated:
        errors.append(f"{key} with actor_rollout_ref.rollout.name=vllm and {' and '.join(truncated)}: vLLM's "
                      "log-probs are renormalised over the tokens top-k / top-p keep, the trainer's over the whole "
                      "vocabulary, so every ratio would be off even with equal weights; sample without them "
                      "(top_p=1.0, top_k=-1) or turn rollout correction off")


def template_kwargs_problems(cfg: PPOConfig) -> list[str]:
    """The chat-template keyword mappings that name an argument of apply_chat_template itself
    (:data:`RENDERER_ARGUMENTS`). The reward model's two follow ``data.apply_chat_template_kwargs`` by default:
    one holding the same mapping is not named again."""
    data_kwargs = dict(cfg.data.apply_chat_template_kwargs)
    problems = []
    for key, kwargs in (("data.apply_chat_template_kwargs", data_kwargs),
                        ("reward_model.train.apply_chat_template_kwargs",
                         dict(cfg.reward_model.train.apply_chat_template_kwargs)),
                        ("reward_model.model.input_chat_template_kwargs",
                         dict(cfg.reward_model.model.input_chat_template_kwargs))):
        if key != "data.apply_chat_template_kwargs" and kwargs == data_kwargs:
            continue
        problems += [f"{key}.{name} is an argument of apply_chat_template, not a variable of the chat template, and "
                     f"is not taken: {RENDERER_ARGUMENTS[name]}; remove it"
                     for name in kwargs if name in RENDERER_ARGUMENTS]
    return problems


def _optim_problems(errors: list[str], name: str, optim: OptimConfig) -> None:
    """An optimizer section's values AdamW and the schedule can take: a min_lr_ratio below 0 drove the cosine
    schedule's rate below zero (the last steps ascend the loss) and one above 1 raised it; a negative
    weight_decay failed in AdamW once the model had loaded."""
    if len(optim.betas) != 2 or not all(0 <= b < 1 for b in optim.betas):
        errors.append(f"{name}.betas={optim.betas} must be two numbers in [0, 1)")
    if not 0 <= optim.lr_warmup_steps_ratio <= 1:
        errors.append(f"{name}.lr_warmup_steps_ratio={optim.lr_warmup_steps_ratio} must be in [0, 1]")
    if not 0 <= optim.min_lr_ratio <= 1:
        errors.append(f"{name}.min_lr_ratio={optim.min_lr_ratio} must be in [0, 1] (the schedule's floor as a share "
                      "of lr)")
    if not optim.weight_decay >= 0:
        errors.append(f"{name}.weight_decay={optim.weight_decay} must be >= 0")
    _one_of(errors, f"{name}.lr_scheduler_type", optim.lr_scheduler_type, LR_SCHEDULERS)


def validate_config(cfg: PPOConfig) -> None:
    """Raise ConfigError listing every inconsistency; runs before any model is loaded."""
    # the registries name the valid values; imported here so that importing the config does not import torch
    from rlhf_core import algos
    from rlhf_core.rollout import ROLLOUT_NAMES
    from rlhf_core.training.tracking import VALID_LOGGERS

    errors: list[str] = []
    data, arr, algo, trainer = cfg.data, cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
    actor, rollout, critic = arr.actor, arr.rollout, cfg.critic
    if not arr.hybrid_engine:
        errors.append("actor_rollout_ref.hybrid_engine=false: the actor, its rollout and the reference always share "
                      "workers and weights here (verl too supports only the hybrid engine); leave it true")

    for key, value in [
        ("data.train_batch_size", data.train_batch_size),
        ("data.max_prompt_length", data.max_prompt_length),
        ("data.max_response_length", data.max_response_length),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size),
        ("actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs),
        ("actor_rollout_ref.rollout.n", rollout.n),
        ("actor_rollout_ref.rollout.val_kwargs.n", rollout.val_kwargs.n),
        ("trainer.n_gpus_per_node", trainer.n_gpus_per_node),
        ("trainer.nnodes", trainer.nnodes),
        ("trainer.total_epochs", trainer.total_epochs),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu),
        ("critic.ppo_micro_batch_size_per_gpu", critic.ppo_micro_batch_size_per_gpu),
    ]:
        _positive(errors, key, value)
    if errors:  # the batch arithmetic below needs positive sizes
        raise ConfigError(errors)

    critic_mini, critic_dynamic = cfg.value("critic.ppo_mini_batch_size"), cfg.value("critic.use_dynamic_bsz")
    # a critic whose mini-batch follows the actor's (null) trains with the size suggested for the actor's
    follows = algo.adv_estimator == "gae" and critic.ppo_mini_batch_size is None
    _check_batches(errors, "actor_rollout_ref.actor", actor.ppo_mini_batch_size,
                   actor.ppo_micro_batch_size_per_gpu, actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu, cfg,
                   sharing=(("critic", critic.ppo_micro_batch_size_per_gpu, critic_dynamic),) if follows else ())
    if algo.adv_estimator == "gae":
        _positive(errors, "critic.ppo_mini_batch_size", critic.ppo_mini_batch_size)
        _positive(errors, "critic.ppo_epochs", critic.ppo_epochs)  # 0: a value model that never trains
        if critic_mini > 0:
            _check_batches(errors, "critic", critic_mini, critic.ppo_micro_batch_size_per_gpu, critic_dynamic,
                           critic.ppo_max_token_len_per_gpu, cfg,
                           check_train_batch=critic.ppo_mini_batch_size is not None)
    if data.val_batch_size is not None:
        _positive(errors, "data.val_batch_size", data.val_batch_size)
    batch_key, batch = cfg.prompt_batch()
    if 0 < data.train_max_samples < batch:  # (-1, or any size <= 0 as verl reads it, keeps every prompt)
        errors.append(f"data.train_max_samples ({data.train_max_samples}) keeps fewer prompts than {batch_key} "
                      f"({batch}) draws at once: raise it to at least {batch} (-1 keeps all) or lower {batch_key}")
    _positive(errors, "actor_rollout_ref.nccl_timeout", arr.nccl_timeout)
    # the old-log-prob pass, and the reference's where a KL uses it: a size of -1 cut no micro-batch (an IndexError
    # after the models loaded), and 0 or null without dynamic batching ran the whole batch in one forward
    uses_ref = algo.use_kl_in_reward or actor.use_kl_loss
    for section in ("actor_rollout_ref.rollout",) + (("actor_rollout_ref.ref",) if uses_ref else ()):
        key = f"{section}.log_prob_micro_batch_size_per_gpu"
        _positive(errors, key, cfg.value(key))
        if cfg.value(key) is None and not cfg.value(f"{section}.log_prob_use_dynamic_bsz"):
            errors.append(f"{key} is required when {section}.log_prob_use_dynamic_bsz is off")

    for key, value in [
        ("actor_rollout_ref.actor.clip_ratio", actor.clip_ratio),
        ("actor_rollout_ref.actor.clip_ratio_low", actor.clip_ratio_low),
        ("actor_rollout_ref.actor.clip_ratio_high", actor.clip_ratio_high),
        ("critic.cliprange_value", critic.cliprange_value),
        ("actor_rollout_ref.actor.optim.lr", actor.optim.lr),
        ("critic.optim.lr", critic.optim.lr),
        ("actor_rollout_ref.actor.grad_clip", actor.grad_clip),
        ("critic.grad_clip", critic.grad_clip),
        ("algorithm.kl_ctrl.horizon", algo.kl_ctrl.horizon),
        ("algorithm.kl_ctrl.target_kl", algo.kl_ctrl.target_kl),
    ]:
        _positive(errors, key, value)
    if actor.clip_ratio_c <= 1:
        errors.append(f"actor_rollout_ref.actor.clip_ratio_c={actor.clip_ratio_c} must be > 1 (dual-clip bound)")
    if not 0 <= algo.lam <= 1:
        errors.append(f"algorithm.lam={algo.lam} must be in [0, 1]")
    if not 0 <= algo.gamma <= 1:  # (0: each token's advantage its own reward against its value, as lam=0 is)
        errors.append(f"algorithm.gamma={algo.gamma} must be in [0, 1]")
    if algo.kl_ctrl.kl_coef < 0:
        errors.append(f"algorithm.kl_ctrl.kl_coef={algo.kl_ctrl.kl_coef} must be >= 0")
    if actor.kl_loss_coef < 0:
        errors.append(f"actor_rollout_ref.actor.kl_loss_coef={actor.kl_loss_coef} must be >= 0")
    for name, sampling in (("actor_rollout_ref.rollout", rollout), ("actor_rollout_ref.rollout.val_kwargs",
                                                                     rollout.val_kwargs)):
        if sampling.temperature < 0:
            errors.append(f"{name}.temperature={sampling.temperature} must be >= 0")
        if not 0 < sampling.top_p <= 1:
            errors.append(f"{name}.top_p={sampling.top_p} must be in (0, 1]")
        if sampling.top_k < -1:
            errors.append(f"{name}.top_k={sampling.top_k} must be >= 1, or -1 or 0 for off")
    if not 0 < rollout.gpu_memory_utilization <= 1:
        errors.append(
            f"actor_rollout_ref.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization} must be in (0, 1]"
        )
    for name, optim in (("actor_rollout_ref.actor.optim", actor.optim), ("critic.optim", critic.optim)):
        _optim_problems(errors, name, optim)

    _one_of(errors, "actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type, algos.KL_TYPES)
    _one_of(errors, "algorithm.kl_penalty", algo.kl_penalty, algos.KL_TYPES)
    _one_of(errors, "algorithm.adv_estimator", algo.adv_estimator, algos.ADV_ESTIMATORS)
    _one_of(errors, "algorithm.kl_ctrl.type", algo.kl_ctrl.type, algos.KL_CTRL_TYPES)
    _one_of(errors, "actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode, algos.LOSS_AGG_MODES)
    if critic.loss_agg_mode is not None:  # null: the actor's
        _one_of(errors, "critic.loss_agg_mode", critic.loss_agg_mode, algos.LOSS_AGG_MODES)
    _one_of(errors, "actor_rollout_ref.rollout.name", rollout.name, ROLLOUT_NAMES)
    _one_of(errors, "actor_rollout_ref.actor.strategy", actor.strategy, STRATEGIES)
    _one_of(errors, "critic.strategy", critic.strategy, STRATEGIES)
    _one_of(errors, "actor_rollout_ref.model.dtype", arr.model.dtype, DTYPES)
    for name, fsdp in (("actor_rollout_ref.actor", actor.fsdp_config), ("actor_rollout_ref.ref", arr.ref.fsdp_config),
                       ("critic", critic.fsdp_config)):
        _one_of(errors, f"{name}.fsdp_config.param_dtype", fsdp.param_dtype, DTYPES)
        _one_of(errors, f"{name}.fsdp_config.reduce_dtype", fsdp.reduce_dtype, DTYPES)
    for name, model in (("actor_rollout_ref.model", arr.model), ("critic.model", critic.model)):
        if model.lora_rank < 0:
            errors.append(f"{name}.lora_rank={model.lora_rank} must be >= 0 (0 trains all weights)")
        if model.lora_rank > 0 and model.lora_alpha <= 0:
            errors.append(f"{name}.lora_alpha={model.lora_alpha} must be > 0 with lora_rank > 0")
    if rollout.name == "vllm":
        if trainer.device != "cuda":
            errors.append("actor_rollout_ref.rollout.name=vllm needs trainer.device=cuda; use "
                          "actor_rollout_ref.rollout.name=hf on CPU")
        tp = rollout.tensor_model_parallel_size
        if tp < 1 or cfg.world_size % tp:
            errors.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} must divide the world size "
                          f"({cfg.world_size} = trainer.n_gpus_per_node * trainer.nnodes)")
    for key in STR_OR_LIST_KEYS:
        value = attribute(cfg, key)
        if value is None and key in STR_OR_LIST_NULL:
            continue
        if not isinstance(value, str) and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            none = "; for no validation, data.val_files=[]" if key == "data.val_files" and value is None else ""
            errors.append(f"{key}={value!r} must be a string or a list of strings, e.g. {key}=[a,b]{none}")
    _one_of(errors, "data.truncation", data.truncation, TRUNCATIONS)
    errors += template_kwargs_problems(cfg)
    _one_of(errors, "trainer.resume_mode", trainer.resume_mode, RESUME_MODES)
    _one_of(errors, "trainer.device", trainer.device, DEVICES)
    _one_of(errors, "trainer.cpu_matmul", trainer.cpu_matmul, CPU_MATMULS)
    _one_of(errors, "trainer.cpu_matmul_dtype", trainer.cpu_matmul_dtype, CPU_MATMUL_DTYPES)
    for name in trainer.logger:
        _one_of(errors, "trainer.logger", name, VALID_LOGGERS)
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        errors.append("trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_N directory)")
    rm = cfg.reward_model
    if rm.enable:
        if not rm.model.path:
            errors.append("reward_model.enable=true needs reward_model.model.path (an HF sequence-classification "
                          "directory with num_labels=1 and its tokenizer)")
        _positive(errors, "reward_model.micro_batch_size_per_gpu", rm.micro_batch_size_per_gpu)
        _positive(errors, "reward_model.max_length", rm.max_length)
        for key, value in (("reward_model.rm_coef", rm.rm_coef), ("reward_model.rule_coef", rm.rule_coef)):
            if value < 0:
                errors.append(f"{key}={value} must be >= 0")
        if rm.rm_coef == 0 and rm.rule_coef == 0:
            errors.append("reward_model.rm_coef and reward_model.rule_coef are both 0: every reward would be 0")
        _one_of(errors, "reward_model.model.fsdp_config.param_dtype", rm.model.fsdp_config.param_dtype, DTYPES)
        _one_of(errors, "reward_model.model.fsdp_config.reduce_dtype", rm.model.fsdp_config.reduce_dtype, DTYPES)
    if trainer.total_training_steps is not None:
        _positive(errors, "trainer.total_training_steps", trainer.total_training_steps)
    if trainer.critic_warmup < 0:
        errors.append(f"trainer.critic_warmup={trainer.critic_warmup} must be >= 0 (0: the actor updates from step 1)")
    elif trainer.critic_warmup > 0 and algo.adv_estimator not in algos.ADV_ESTIMATORS_NEED_CRITIC:
        errors.append(f"trainer.critic_warmup={trainer.critic_warmup} holds the actor back for the critic to train "
                      f"alone, but algorithm.adv_estimator={algo.adv_estimator} trains no critic: those steps would "
                      "train nothing; set trainer.critic_warmup=0")
    _one_of(errors, "reward_model.reward_manager", cfg.reward_model.reward_manager, REWARD_MANAGERS)
    if cfg.reward_model.reward_manager == "batch" and not cfg.custom_reward_function.path:
        errors.append("reward_model.reward_manager=batch calls custom_reward_function with whole batches: set "
                      "custom_reward_function.path (the built-in rules score one response at a time)")
    if trainer.val_only and not data.val_files:
        errors.append("trainer.val_only=true validates on data.val_files: set them")
    if trainer.log_val_generations < 0:
        errors.append(f"trainer.log_val_generations={trainer.log_val_generations} must be >= 0")
    # NumPy's seeding (the max_samples draw, the sampled validation's streams) takes no negative number, which
    # failed the run at its first sampled validation, after training steps
    for key, value in (("trainer.seed", trainer.seed), ("data.seed", data.seed)):
        if value is not None and value < 0:
            errors.append(f"{key}={value} must be >= 0")
    _check_reward_training(errors, cfg)
    if trainer.profile_steps is not None and not all(isinstance(s, int) and s >= 1 for s in trainer.profile_steps):
        errors.append(f"trainer.profile_steps={trainer.profile_steps} must be a list of step numbers >= 1, "
                      "e.g. [2,3]")
    guard = trainer.guard
    for key, value in [
        ("trainer.guard.max_consecutive_skips", guard.max_consecutive_skips),
        ("trainer.guard.max_kl", guard.max_kl),
        ("trainer.guard.patience", guard.patience),
        ("trainer.guard.target_kl", guard.target_kl),
        ("trainer.guard.max_val_drop", guard.max_val_drop),
        ("trainer.warn_kl", trainer.warn_kl),
        ("trainer.warn_grad_norm", trainer.warn_grad_norm),
    ]:
        _positive(errors, key, value)
    for key, value in (("trainer.max_actor_ckpt_to_keep", trainer.max_actor_ckpt_to_keep),
                       ("trainer.max_critic_ckpt_to_keep", trainer.max_critic_ckpt_to_keep)):
        if value is not None and value < 0:
            errors.append(f"{key}={value} must be >= 0 (0 or null: keep all)")
    if trainer.default_hdfs_dir is not None:
        errors.append(f"trainer.default_hdfs_dir={trainer.default_hdfs_dir!r}: there is no HDFS copy here; "
                      "checkpoints stay in trainer.default_local_dir (set it to null)")
    if trainer.del_local_ckpt_after_load:
        errors.append("trainer.del_local_ckpt_after_load=true would delete the only copy of the checkpoint "
                      "(there is no HDFS copy here); set it to false")
    _positive(errors, "trainer.guard.overopt_patience", guard.overopt_patience)
    _one_of(errors, "trainer.guard.overopt_action", guard.overopt_action, ("rollback", "stop"))
    if guard.max_rollbacks < 0:
        errors.append(f"trainer.guard.max_rollbacks={guard.max_rollbacks} must be >= 0")
    _check_algorithms(errors, cfg)
    if trainer.prometheus_port is not None and not 1 <= trainer.prometheus_port <= 65535:
        errors.append(f"trainer.prometheus_port={trainer.prometheus_port} must be a TCP port in 1..65535 "
                      "(or null to switch the exporter off)")
    # NaN or an infinity where it means nothing, which would train on NaN: said once a key, in place of what the
    # range checks above said of the same value (NaN fails each comparison, so most of them refuse it too)
    non_finite = _non_finite(cfg)
    said_of = tuple(f"{key}=" for key in non_finite)
    errors = [*non_finite.values(), *(error for error in errors if not error.startswith(said_of))]
    if errors:
        raise ConfigError(errors)


def reward_training_batch_problems(cfg: PPOConfig) -> list[str]:
    """How ``reward_model.train``'s batch does not share out over the workers (checked by ``rlhf-train-rm``
    alone: a PPO run on another number of workers never uses these keys)."""
    rm, key, world = cfg.reward_model.train, "reward_model.train", cfg.world_size
    if rm.train_batch_size > 0 and rm.micro_batch_size_per_gpu > 0 and \
            rm.train_batch_size % (rm.micro_batch_size_per_gpu * world):
        return [f"{key}.train_batch_size ({rm.train_batch_size}) must be divisible by {key}.micro_batch_size_per_gpu "
                f"* world size ({rm.micro_batch_size_per_gpu} * {world}) so each worker gets whole micro-batches"]
    return []


def _check_reward_training(errors: list[str], cfg: PPOConfig) -> None:
    rm, key = cfg.reward_model.train, "reward_model.train"
    for name in ("train_batch_size", "micro_batch_size_per_gpu", "max_length", "total_epochs",
                 "total_training_steps", "grad_clip", "max_consecutive_skips", "optim.lr"):
        value = rm
        for part in name.split("."):
            value = getattr(value, part)
        _positive(errors, f"{key}.{name}", value)
    if rm.margin < 0:
        errors.append(f"{key}.margin={rm.margin} must be >= 0")
    if not 0 <= rm.min_pair_accuracy <= 1:
        errors.append(f"{key}.min_pair_accuracy={rm.min_pair_accuracy} must be in [0, 1]")
    if rm.model.lora_rank < 0:
        errors.append(f"{key}.model.lora_rank={rm.model.lora_rank} must be >= 0 (0 trains all weights)")
    _optim_problems(errors, f"{key}.optim", rm.optim)
    _one_of(errors, f"{key}.model.dtype", rm.model.dtype, DTYPES)
    _one_of(errors, f"{key}.resume_mode", rm.resume_mode, RESUME_MODES)
    _one_of(errors, f"{key}.overlong", rm.overlong, OVERLONG_PAIRS)
    if rm.resume_mode == "resume_path" and not rm.resume_from_path:
        errors.append(f"{key}.resume_mode=resume_path needs {key}.resume_from_path (a global_step_N directory)")


# ----------------------------------------------------------------------------- the commented YAML


def _scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return text[:-4].strip() if text.endswith("\n...") else text.removesuffix("...").strip()


def defaults_yaml() -> str:
    """The default tree as YAML with each key's one-line comment (the source of configs/ppo_trainer.yaml)."""
    header = (
        "# PPO trainer defaults: verl's key tree, one comment per key.\n"
        "# Generated from rlhf_core/config.py by `python -m rlhf_core.config --defaults`; a test checks each key against it.\n"
        "# Override any key with --config FILE or key=value on the command line.\n"
    )
    return header + _sub_yaml(PPOConfig(), 0) + "\n"


def _sub_yaml(instance: Any, indent: int) -> str:
    lines = []
    for name, f in _fields(type(instance)).items():
        pad = "  " * indent
        value = getattr(instance, name)
        if dataclasses.is_dataclass(value):
            lines.append(f"{pad}{name}:  # {f.metadata['help']}")
            lines.append(_sub_yaml(value, indent + 1))
        else:
            lines.append(f"{pad}{name}: {_scalar(value)}  # {f.metadata['help']}")
    return "\n".join(lines)
