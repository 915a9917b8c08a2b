"""A learned reward model in PPO: load it, score sequences with it, combine it with the rule.

A reward model is a Hugging Face sequence-classification directory with one label
(``num_labels=1``), its tokenizer, and ``config.pad_token_id`` set. The score of a sequence
(prompt + response) is the head's output at the sequence's last non-pad token; PPO places it on
the response's last valid token, where the rule reward goes too.

Two ways in, as verl has them (``reward_model.model.input_tokenizer``):

* the same tokenizer (vocabulary and EOS) and chat template as the policy, rendered with the same keyword
  arguments (``reward_model.model.input_chat_template_kwargs``, the policy's ``data.apply_chat_template_kwargs``,
  against those the reward model was trained with, :data:`TEMPLATE_KWARGS` in its config.json), or
  ``input_tokenizer: null``: the policy's token ids are fed as they are (all-padding columns trimmed,
  the padding set to the reward model's pad id);
* anything else: each response is decoded with the input tokenizer and the conversation (the raw
  prompt messages, then the response as the assistant's turn) is rendered with the reward model's
  own chat template and keyword arguments and re-tokenized, with EOS where the policy's response
  ended with one (not after a response cut at ``data.max_response_length``). This needs the raw
  chat messages in the batch (``data.return_raw_chat=true``).

:class:`RewardModelManager` then combines, per sequence,

    score = rm_coef * model score + rule_coef * rule score

and keeps the rule score apart as the gold reward (``extras["gold_reward"]``) next to the model
score (``extras["rm_score"]``), so validation can log the proxy and the gold side by side.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig

from rlhf_core.batch import Batch
from rlhf_core.config import RewardModelConfig
from rlhf_core.data.dataset import left_pad, prompt_token_ids
from rlhf_core.data.schema import plain_value
from rlhf_core.models import cpu_matmul
from rlhf_core.models.fused_head import plain_score_head
from rlhf_core.models.loading import DTYPES, ModelError, check_model_dir, check_tokenizer_dir, resolve
from rlhf_core.progress import bars_about
from rlhf_core.rollout.base import end_ids
from rlhf_core.workers import distributed
from rlhf_core.workers.common import (
    map_micro_batches,
    resolve_shared_prefix,
    shared_prompt_hidden,
    trimmed_inputs,
)

KEY = "reward_model.model.path"
#: the reward model's config.json attribute holding the chat-template keyword arguments it was trained with
TEMPLATE_KWARGS = "chat_template_kwargs"


# ----------------------------------------------------------------------------- checks (no weights loaded)


def check_reward_model_dir(path: str | os.PathLike | None, trust_remote_code: bool = False) -> Path:
    """Raise ModelError unless ``path`` is a loadable reward-model directory: an HF config with one label,
    a sequence-classification architecture and a pad token id, weights, and a tokenizer."""
    if not path:
        raise ModelError(f"{KEY} is not set: reward_model.enable=true needs the directory of a reward model")
    export = resolve(path) / "huggingface"
    if (export / "config.json").is_file() and not (export.parent / "config.json").is_file():
        raise ModelError(f"{KEY}: {export.parent} is a reward model's training folder; the model is its export, "
                         f"{KEY}={export}")
    folder = check_model_dir(path, KEY)
    check_tokenizer_dir(folder, KEY)
    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any unreadable config is reported the same way
        raise ModelError(f"{KEY}: {folder}/config.json cannot be loaded: {type(exc).__name__}: {exc}") from exc
    architectures = list(getattr(config, "architectures", None) or [])
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ModelError(f"{KEY}: {folder} holds a {', '.join(architectures)} model, not a sequence-classification "
                         "reward model; save one with AutoModelForSequenceClassification (num_labels=1)")
    if config.num_labels != 1:
        raise ModelError(f"{KEY}: {folder} has num_labels={config.num_labels}; a reward model has one scalar "
                         "output (num_labels=1)")
    if getattr(config, "pad_token_id", None) is None:
        raise ModelError(f"{KEY}: {folder}/config.json has no pad_token_id; set it to the tokenizer's pad token id "
                         "so that padded sequences are scored at their last real token")
    if missing := missing_head_weights(folder, config, trust_remote_code):
        raise untrained_head_error(folder, missing)
    return folder


def checkpoint_keys(folder: Path) -> set[str] | None:
    """The names of the weights stored in ``folder``, read from the safetensors header or index alone; None where
    they cannot be read so (a pytorch_model.bin, an unreadable file): the load's own report then says."""
    from safetensors import SafetensorError, safe_open

    try:
        if (folder / "model.safetensors.index.json").is_file():
            return set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])
        if (folder / "model.safetensors").is_file():
            with safe_open(str(folder / "model.safetensors"), "pt") as weights:
                return set(weights.keys())
    except (OSError, ValueError, KeyError, SafetensorError):
        return None
    return None


def missing_head_weights(folder: Path, config, trust_remote_code: bool = False) -> list[str]:
    """The scoring head's weights (``score.weight``, ...) that ``folder``'s checkpoint lacks: all of them for a
    causal LM's weights under a sequence-classification config, which transformers would load with a random head
    (saying only "newly initialized"). The model is built on the meta device to name its head; no weights load."""
    keys = checkpoint_keys(folder)
    if keys is None:
        return []
    try:
        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - a model transformers cannot build is the load's to report
        return []
    name = reward_head_name(model)
    return sorted(f"{name}.{param}" for param, _ in getattr(model, name).named_parameters()
                  if f"{name}.{param}" not in keys)


def untrained_head_error(folder: Path, missing) -> ModelError:
    return ModelError(f"{KEY}: {folder} has no trained score head (its weights lack {', '.join(sorted(missing))}): "
                      "it holds a language model's weights under a sequence-classification config, and its head "
                      "would start random, so PPO would chase noise; train a reward model from it (rlhf-train-rm, "
                      "or the rlhf_rm pipeline) and use that export")


def load_rm_tokenizer(folder: str | os.PathLike, trust_remote_code: bool = False, key: str = KEY):
    try:
        return AutoTokenizer.from_pretrained(str(resolve(folder)), trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001
        raise ModelError(f"{key}: the tokenizer in {folder} cannot be loaded: {type(exc).__name__}: {exc}") from exc


def trained_template_kwargs(folder: str | os.PathLike, trust_remote_code: bool = False) -> dict:
    """The chat-template keyword arguments the reward model in ``folder`` was trained with: its config.json's
    :data:`TEMPLATE_KWARGS` (written by rlhf-train-rm), none for a model without that record."""
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    return dict(getattr(config, TEMPLATE_KWARGS, None) or {})


def stop_ids(folder: str | os.PathLike, tokenizer) -> set[int]:
    """The ids a policy's response ends with where it was not cut, as the rollout stops on them: the tokenizer's
    EOS and those of the generation config in ``folder``, where it holds one."""
    try:
        eos = GenerationConfig.from_pretrained(str(resolve(folder))).eos_token_id
    except OSError:  # a tokenizer directory without the model's generation_config.json
        eos = None
    return end_ids(eos, tokenizer)


def same_tokenization(a, b, a_kwargs: dict | None = None, b_kwargs: dict | None = None) -> bool:
    """Whether two tokenizers turn a conversation into the same ids: same vocabulary and chat template,
    rendered with the same keyword arguments (``a_kwargs`` for ``a``, ``b_kwargs`` for ``b``), and the same EOS,
    which closes a response (a reward model trained with another, such as a base model's tokenizer against its
    instruct policy's, reads its score where that EOS stood, not at the policy's stop token)."""
    template = getattr(a, "chat_template", None)
    return (a.get_vocab() == b.get_vocab() and template == getattr(b, "chat_template", None)
            and (not template or (a_kwargs or {}) == (b_kwargs or {})) and a.eos_token_id == b.eos_token_id)


def needs_template_switch(config: RewardModelConfig, input_tokenizer=None, folder: Path | None = None) -> bool:
    """Whether responses must be decoded and re-encoded for the reward model (tokenizers only, no weights).

    ``input_tokenizer`` (a loaded tokenizer) stands for ``reward_model.model.input_tokenizer``;
    with that key null, the ids are fed as they are. ``folder``: the reward model's directory where the caller
    has checked it already (:func:`check_reward_model_dir`), else it is checked here.
    """
    model_cfg = config.model
    if input_tokenizer is None and not model_cfg.input_tokenizer:
        return False
    if folder is None:
        folder = check_reward_model_dir(model_cfg.path, model_cfg.trust_remote_code)
    return reads_otherwise(config, load_rm_tokenizer(folder, model_cfg.trust_remote_code),
                           trained_template_kwargs(folder, model_cfg.trust_remote_code), input_tokenizer)


def reads_otherwise(config: RewardModelConfig, tokenizer, template_kwargs: dict, input_tokenizer=None) -> bool:
    """Whether a reward model with ``tokenizer``, trained with ``template_kwargs``, must have responses decoded and
    re-encoded: :func:`needs_template_switch` of a reward model known by its tokenizer and keywords alone (one yet
    to be trained from ``reward_model.train``, whose export keeps them)."""
    model_cfg = config.model
    if input_tokenizer is None:
        if not model_cfg.input_tokenizer:
            return False
        input_tokenizer = load_rm_tokenizer(model_cfg.input_tokenizer, model_cfg.trust_remote_code,
                                            "reward_model.model.input_tokenizer")
    return not same_tokenization(input_tokenizer, tokenizer, model_cfg.input_chat_template_kwargs, template_kwargs)


# ----------------------------------------------------------------------------- the forward


def reward_head_name(model: torch.nn.Module) -> str:
    """The attribute holding a sequence-classification model's scalar head (``score`` in the Llama/Qwen/Mistral
    family), which is also its weights' prefix."""
    for name in ("score", "classifier", "v_head"):
        if isinstance(getattr(model, name, None), torch.nn.Module):
            return name
    raise ModelError(f"{KEY}: {type(model).__name__} has no 'score' (or 'classifier') head to read the reward from")


def reward_head(model: torch.nn.Module) -> torch.nn.Module:
    """The scalar head of a sequence-classification model (:func:`reward_head_name`)."""
    return getattr(model, reward_head_name(model))


def scored_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """Which tokens may carry a sequence's score: valid ones (``attention_mask``) that are not the pad id. (bs, L).

    The score is read at the last of them, where transformers' sequence-classification pooling reads it
    (the last token that is not padding), so that PPO scores where the reward model was trained to score
    and where its export scores: with a pad id equal to EOS (tokenizers without a pad token), the token
    before a closing EOS."""
    valid = attention_mask.bool()
    return valid & (input_ids != pad_id) if pad_id is not None else valid


def sequence_scores(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The head's output at each sequence's last scored token (:func:`scored_tokens`; the last valid token
    where a row has none). (bs,).

    The per-token head outputs are captured from the head itself, so padding on either side is read
    by the mask and the pad id together.
    """
    captured: list[torch.Tensor] = []
    hook = reward_head(model).register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    finally:
        hook.remove()
    per_token = captured[-1][..., 0].float()  # (bs, L)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    scored = scored_tokens(input_ids, attention_mask, model.config.pad_token_id)
    scored = torch.where(scored.any(-1, keepdim=True), scored, attention_mask.bool())
    last = (positions * scored.long()).argmax(-1)  # (bs,)
    return per_token[torch.arange(per_token.shape[0], device=per_token.device), last]


def shared_prefix_scores(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """:func:`sequence_scores` of rollout rows (prompts left-padded, responses right-padded) with each distinct
    prompt run once (``reward_model.model.use_shared_prefix``, a head that is a plain layer on the decoder's
    output): the head on the hidden state of each row's last response token, or of its prompt's last token
    where the response is empty. (bs,)."""
    hidden, _ = shared_prompt_hidden(model.base_model, batch, through_last=True)  # index j: response column j - 1
    response_valid = scored_tokens(batch["responses"], batch["attention_mask"][:, batch["prompts"].shape[1]:],
                                   model.config.pad_token_id).long()
    columns = torch.arange(1, response_valid.shape[1] + 1, device=response_valid.device)
    last = (columns * response_valid).max(-1).values  # 1 + the last valid response column; 0 where none
    return reward_head(model)(hidden[torch.arange(len(batch), device=hidden.device), last])[..., 0].float()


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(bs,) sequence scores -> (bs, T) token-level scores, each on its response's last valid token."""
    token_level = torch.zeros(response_mask.shape, dtype=torch.float32)
    valid = response_mask.cpu().bool()
    positions = torch.arange(valid.shape[1])
    last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=1).values
    rows = torch.nonzero(last >= 0).flatten()
    token_level[rows, last[rows]] = scores.float().cpu()[rows]
    return token_level


class RewardModelWorker:
    """The reward model on one worker (alone, or one FSDP2-sharded rank of a worker group)."""

    def __init__(self, config: RewardModelConfig, device: str = "cpu", dtype: str = "float32",
                 policy_path: str | None = None):
        """``policy_path``: the policy's model directory, whose generation config names the ids its rollout stops
        on (default: the input tokenizer's directory)."""
        model_cfg = config.model
        self.config = config
        self.device = torch.device(device)
        folder = check_reward_model_dir(model_cfg.path, model_cfg.trust_remote_code)
        self.tokenizer = load_rm_tokenizer(folder, model_cfg.trust_remote_code)
        self.input_tokenizer = (load_rm_tokenizer(model_cfg.input_tokenizer, model_cfg.trust_remote_code,
                                                  "reward_model.model.input_tokenizer")
                                if model_cfg.input_tokenizer else None)
        self.input_stop_ids = (stop_ids(policy_path or model_cfg.input_tokenizer, self.input_tokenizer)
                               if self.input_tokenizer is not None else set())
        self.template_kwargs = trained_template_kwargs(folder, model_cfg.trust_remote_code)
        self.switch_template = (self.input_tokenizer is not None
                                and not same_tokenization(self.input_tokenizer, self.tokenizer,
                                                          model_cfg.input_chat_template_kwargs, self.template_kwargs))
        with bars_about(f"{folder}, as the reward model"):
            module, loading = AutoModelForSequenceClassification.from_pretrained(
                str(folder), dtype=DTYPES[dtype], trust_remote_code=model_cfg.trust_remote_code,
                output_loading_info=True)
        # checked above where the weights' names could be read without loading them; here for every checkpoint
        if missing := [key for key in loading["missing_keys"] if key.startswith(f"{reward_head_name(module)}.")]:
            raise untrained_head_error(folder, missing)
        module.config.use_cache = False
        # what a re-encoded sequence may hold: longer ones lose their first tokens (see encode_response)
        self.max_length = config.max_length or getattr(module.config, "max_position_embeddings", None)
        self.noted_cut = False
        module = module.to(self.device).eval()
        cpu_matmul.route(module)
        for param in module.parameters():
            param.requires_grad_(False)
        self.sharded = distributed.in_worker_group()
        if self.sharded:
            distributed.fsdp_wrap(module, self.device, model_cfg.fsdp_config)
        self.module = module
        self.pad_id = int(module.config.pad_token_id)
        self.shared_prefix = resolve_shared_prefix(
            model_cfg.use_shared_prefix, module, "reward_model.model.use_shared_prefix", sharded=self.sharded,
            retokenized=self.switch_template, head_runs=plain_score_head(module) is not None).scoring

    def _direct_inputs(self, batch: Batch) -> Batch:
        inputs, _, _ = trimmed_inputs(batch)
        mask = inputs["attention_mask"]
        inputs["input_ids"] = inputs["input_ids"].masked_fill(mask == 0, self.pad_id)
        return Batch(inputs)

    def _switched_inputs(self, batch: Batch) -> Batch:
        if "raw_prompt" not in batch:
            raise ValueError("the reward model's tokenizer or chat template differs from the policy's, so responses "
                             "are re-encoded from the chat messages: set data.return_raw_chat=true")
        valid = batch["response_mask"].bool()
        response_ids = [batch["responses"][i][valid[i]].tolist() for i in range(len(batch))]
        responses = self.input_tokenizer.batch_decode(response_ids, skip_special_tokens=True)
        # the decoded text has lost the policy's stop token (a special token), so whether a response ended is read
        # from its ids: one cut at data.max_response_length gets no EOS, as its ids fed as they are have none
        encoded = [encode_response(self.tokenizer, messages, response, self.max_length,
                                   chat_template_kwargs=self.template_kwargs,
                                   eos=bool(policy_ids) and policy_ids[-1] in self.input_stop_ids)
                   for messages, response, policy_ids in zip(batch.meta["raw_prompt"], responses, response_ids)]
        cut = [prompt_cut + response_cut for _, prompt_cut, response_cut in encoded]
        if any(cut) and not self.noted_cut:
            self.noted_cut = True
            print(f"notice: {sum(map(bool, cut))} of {len(cut)} sequences re-encoded for the reward model were "
                  f"longer than its {self.max_length} tokens (reward_model.max_length, or its "
                  "max_position_embeddings) and lost their first tokens, the prompt's start first (up to "
                  f"{max(cut)}); said once", file=sys.stderr, flush=True)
        return Batch(left_pad([ids for ids, _, _ in encoded], self.pad_id))

    @torch.no_grad()
    def compute_rm_score(self, batch: Batch) -> torch.Tensor:
        """One score per sequence of ``batch`` (bs,), micro-batched by ``reward_model.micro_batch_size_per_gpu``."""
        if len(batch) == 0:
            return torch.zeros(0)
        if self.shared_prefix:  # the rollout rows as they are: prompts and responses apart
            return map_micro_batches(batch, lambda mb: shared_prefix_scores(self.module, mb.to(self.device)),
                                     self.config.micro_batch_size_per_gpu, False, 0, by_prompt=True)
        inputs = self._switched_inputs(batch) if self.switch_template else self._direct_inputs(batch)
        return map_micro_batches(inputs, lambda mb: sequence_scores(self.module, **mb.to(self.device).tensors),
                                 self.config.micro_batch_size_per_gpu, False, 0)


def conversation_ids(tokenizer, messages: list[dict], responses: Sequence[str],
                     chat_template_kwargs: dict | None = None, eos: bool = True) -> tuple[list[int], list[list[int]]]:
    """(prompt ids, each response's ids): ``messages`` in the chat template with ``chat_template_kwargs`` and the
    generation prompt (rendered once for all the responses), then each of ``responses`` + EOS (unless ``eos`` is
    false), as PPO's rollout lays a prompt and its response out: the layout the reward model trains on and scores
    (the prompt's ids are the PPO dataset's, :func:`~rlhf_core.data.dataset.prompt_token_ids`, with a chat template or
    without)."""
    # (a list inside a message, read from parquet as a NumPy array, handed to the template as a list)
    prompt_ids = prompt_token_ids(tokenizer, [plain_value(dict(m)) for m in messages], chat_template_kwargs)
    # (verbose=False: no "longer than the maximum ... indexing errors" warning for a text cut to max_length later)
    closing = [tokenizer.eos_token_id] if eos else []
    return prompt_ids, [tokenizer(response, add_special_tokens=False, verbose=False)["input_ids"] + closing
                        for response in responses]


def cut_from_the_left(prompt_ids: list[int], responses: list[list[int]],
                      max_length: int | None) -> list[tuple[list[int], int, int]]:
    """Each of ``responses`` after ``prompt_ids``, at most ``max_length`` tokens, cut from the left so that the end,
    where the score is read, stays. The responses keep one prompt window: the prompt loses the tokens the longest
    sequence must lose (at most all of it), so that a pair's two sides are read in the same context; then a
    response still too long loses its own first tokens. Returns (ids, prompt tokens cut, response tokens cut) each."""
    if max_length is None:
        return [(prompt_ids + response, 0, 0) for response in responses]
    prompt_cut = min(max(len(prompt_ids) + max(map(len, responses)) - max_length, 0), len(prompt_ids))
    context = prompt_ids[prompt_cut:]
    cuts = [max(len(context) + len(response) - max_length, 0) for response in responses]
    return [(context + response[cut:], prompt_cut, cut) for response, cut in zip(responses, cuts)]


def encode_response(tokenizer, messages: list[dict], response: str, max_length: int | None = None,
                    chat_template_kwargs: dict | None = None, eos: bool = True) -> tuple[list[int], int, int]:
    """Token ids of ``messages`` + ``response`` + EOS (:func:`conversation_ids`), over ``max_length`` cut from the
    left, the prompt's first, then the response's (its end, where the score is read, is kept). Returns (ids, prompt
    tokens cut, response tokens cut)."""
    prompt_ids, response_ids = conversation_ids(tokenizer, messages, [response], chat_template_kwargs, eos)
    return cut_from_the_left(prompt_ids, response_ids, max_length)[0]


# ----------------------------------------------------------------------------- the combination


class RewardModelManager:
    """The rule reward manager plus a reward model: ``rm_coef * model + rule_coef * rule`` per sequence.

    ``scorer`` is anything with ``compute_rm_score(batch) -> (bs,)``: a :class:`RewardModelWorker`, or
    the reward model on a worker group (:class:`rlhf_core.workers.group.RewardModelGroup`).
    """

    def __init__(self, rule, scorer, config: RewardModelConfig):
        self.rule, self.scorer = rule, scorer
        self.rm_coef, self.rule_coef = float(config.rm_coef), float(config.rule_coef)

    def score_batch(self, batch: Batch) -> tuple[torch.Tensor, dict[str, Any]]:
        extras = self._rule_extras(batch)
        rm_score = self.scorer.compute_rm_score(batch).float()  # (bs,)
        gold = extras["score"].float()  # (bs,)
        score = self.rm_coef * rm_score + (self.rule_coef * gold if self.rule_coef else 0.0)  # gold NaN: no truth
        extras = {**extras, "score": score, "rm_score": rm_score, "gold_reward": gold}
        return place_on_last_token(score, batch["response_mask"]), extras

    def _rule_extras(self, batch: Batch) -> dict[str, Any]:
        """The rule's extras for every row. A built-in rule grades against a ground truth, so on rows without
        one (prompts alone, which the dataset takes where ``rule_coef`` is 0) it is not called: their score,
        accuracy and other numbers are NaN and their ``pred`` None. A custom function is called on every row."""
        truths = batch.meta["ground_truth"]
        known = [i for i, truth in enumerate(truths) if truth is not None]
        if len(known) == len(truths) or getattr(self.rule, "reward_fn", None) is not None:
            return self.rule.score_batch(batch)[1]
        # every row's text is logged, and the graded rows' text is the rule's: decoded once, for both
        responses, _ = self.rule.decode(batch["responses"], batch["response_mask"])
        extras: dict[str, Any] = {"score": torch.full((len(truths),), float("nan")),
                                  "acc": torch.full((len(truths),), float("nan"))}
        if known:
            rows, meta = torch.tensor(known), batch.meta
            _, graded = self.rule(batch["responses"][rows], batch["response_mask"][rows],
                                  [meta["data_source"][i] for i in known], [truths[i] for i in known],
                                  [meta["extra_info"][i] for i in known], responses=[responses[i] for i in known])
            for key, values in graded.items():
                if isinstance(values, torch.Tensor):
                    extras.setdefault(key, torch.full((len(truths),), float("nan")))[rows] = values.float()
                elif key == "pred":
                    extras["pred"] = [None] * len(truths)
                    for i, value in zip(known, values):
                        extras["pred"][i] = value
        extras["responses"] = responses
        return extras
