"""The actor worker: the policy, its rollout engine and the frozen reference, colocated.

It computes log-probs of responses (old policy and reference) and performs the PPO
policy update: ``ppo_epochs`` x mini-batches x micro-batches with gradient
accumulation, losses normalised over the whole mini-batch, gradient clipping and
skipping of mini-batch updates whose loss or gradient is not finite.

The same class runs alone in the trainer's process or as one rank of a worker group
(:mod:`rlhf_core.workers.group`): when a process group is up, the policy and the
reference are sharded with FSDP2 and the mini-batch is the union of the ranks' shares
(token counts, metrics and the skip decision are all-reduced). With LoRA the reference
is the policy itself with its adapters switched off.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import torch

from rlhf_core import algos
from rlhf_core.batch import Batch
from rlhf_core.config import ActorRolloutRefConfig, PPOConfig, require_resolved
from rlhf_core.models import lora
from rlhf_core.models.fused_head import chunked_head_log_prob, logits_log_prob, supports_fused_head
from rlhf_core.models.loading import (
    attention_for,
    compile_blocks,
    config_with,
    load_actor,
    make_reference,
    resolve,
    save_hf_model,
    takes_logits_to_keep,
)
from rlhf_core.progress import transformers_bars
from rlhf_core.rollout import SamplingParams, make_rollout_engine
from rlhf_core.training.guards import KL_LOSS_TOKEN_MEAN  # (the KL loss's mean over tokens, beside verl's)
from rlhf_core.workers import distributed
from rlhf_core.workers.common import (
    CheckpointableWorker,
    build_optimizer,
    build_scheduler,
    dropout_off,
    map_micro_batches,
    micro_batches,
    packed_inputs,
    pad_response,
    ppo_update,
    resolve_remove_padding,
    resolve_shared_prefix,
    shared_prompt_hidden,
    trimmed_inputs,
    unpack,
)

#: engine e of a group samples with seed + ROLLOUT_SEED_STRIDE * e (engine 0, and one worker, with the seed itself;
#: an engine is a rank, or a tensor-parallel vLLM engine's ranks: :func:`rollout_seed`)
ROLLOUT_SEED_STRIDE = 1_000_003


def response_log_prob(model: torch.nn.Module, batch: Batch, temperature: float,
                      with_entropy: bool, remove_padding: bool = False, entropy_grad: bool = True,
                      fused_head: bool = False, shared_prefix: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the response tokens of ``batch`` under ``model``: (bs, R) each, 0
    where ``response_mask`` is 0 (so that they do not depend on which rows share a micro-batch).
    With ``entropy_grad=False`` the entropies carry no gradient. Log-softmax, gather and entropy run a
    few positions at a time over the logits (:func:`logits_log_prob`); ``fused_head``
    (``use_fused_kernels``, for a model that :func:`supports_fused_head`) runs the LM head that way too
    (:func:`chunked_head_log_prob`), so that the logits are never built whole. ``shared_prefix``
    (``use_shared_prefix``, for a model that :func:`supports_fused_head`) runs each distinct prompt once
    (:func:`shared_prompt_hidden`)."""
    if remove_padding:
        log_prob, entropy = packed_response_log_prob(model, batch, temperature, with_entropy, fused_head)
    elif shared_prefix:
        log_prob, entropy = shared_response_log_prob(model, batch, temperature, with_entropy, fused_head)
    elif fused_head:
        log_prob, entropy = fused_response_log_prob(model, batch, temperature, with_entropy)
    else:
        log_prob, entropy = padded_response_log_prob(model, batch, temperature, with_entropy)
    mask = batch["response_mask"]
    if entropy is not None and not entropy_grad:
        entropy = entropy.detach()  # a metric only: the backward pass skips its term
    return log_prob * mask, (entropy * mask if entropy is not None else None)


def _predicting_inputs(batch: Batch) -> tuple[dict[str, torch.Tensor], int, int]:
    """:func:`trimmed_inputs` less the last column: position t predicts token t+1, so the last kept
    response token is read but never fed. The last ``kept`` positions predict the response."""
    inputs, response_start, kept = trimmed_inputs(batch)
    return {k: v[:, :-1] for k, v in inputs.items()}, response_start, kept


def padded_response_log_prob(model: torch.nn.Module, batch: Batch, temperature: float,
                             with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`response_log_prob` on the micro-batch's rows, less the columns that are padding in all of them."""
    inputs, response_start, kept = _predicting_inputs(batch)
    # the LM head runs on the positions that predict the response only (for a 150k-token vocabulary, a
    # good share of the forward's work), and the logits come out contiguous, as the chunks want them
    if takes_logits_to_keep(type(model)):
        logits = model(**inputs, use_cache=False, logits_to_keep=kept).logits  # (bs, kept, V)
    else:
        logits = model(**inputs, use_cache=False).logits[:, response_start - 1:]
    log_prob, entropy = logits_log_prob(logits, batch["responses"][:, :kept], temperature, with_entropy=with_entropy,
                                        overwrite=supports_fused_head(model))
    response_len = batch["responses"].shape[1]
    return pad_response(log_prob, response_len), (pad_response(entropy, response_len) if with_entropy else None)


def fused_response_log_prob(model: torch.nn.Module, batch: Batch, temperature: float,
                            with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`padded_response_log_prob` with the decoder's hidden states through the LM head in chunks."""
    inputs, response_start, kept = _predicting_inputs(batch)
    hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state  # (bs, L - 1, H)
    hidden = hidden[:, response_start - 1:]  # the positions that predict the response
    return _head_log_prob(model, hidden, batch, temperature, with_entropy, chunked=True)


def shared_response_log_prob(model: torch.nn.Module, batch: Batch, temperature: float, with_entropy: bool,
                             fused_head: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`padded_response_log_prob` with each distinct prompt run once (:func:`shared_prompt_hidden`),
    then the LM head, whole or in chunks (``fused_head``)."""
    hidden, _ = shared_prompt_hidden(model.get_decoder(), batch)
    return _head_log_prob(model, hidden, batch, temperature, with_entropy, chunked=fused_head)


def _head_log_prob(model: torch.nn.Module, hidden: torch.Tensor, batch: Batch, temperature: float,
                   with_entropy: bool, chunked: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the first ``kept`` response tokens from the decoder's ``hidden`` states
    (bs, kept, H) at the positions that predict them, (bs, R) each. The LM head, whole or in chunks
    (``chunked``), runs only where ``response_mask`` holds a token, not on the padding of shorter responses."""
    mask = batch["response_mask"].bool()
    kept = mask[:, :hidden.shape[1]]
    labels = batch["responses"][:, :hidden.shape[1]][kept][None]
    log_prob, entropy = _tokens_log_prob(model, hidden[kept][None], labels, temperature, with_entropy, chunked)
    return unpack(log_prob[0], mask), (unpack(entropy[0], mask) if with_entropy else None)


def _tokens_log_prob(model: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, temperature: float,
                     with_entropy: bool, chunked: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of ``labels`` (1, N) from the hidden states that predict them (1, N, H), through
    the LM head whole or in chunks (``chunked``)."""
    head = model.get_output_embeddings()
    if chunked:
        return chunked_head_log_prob(hidden, head.weight, labels, temperature, with_entropy=with_entropy)
    return logits_log_prob(head(hidden), labels, temperature, with_entropy=with_entropy,
                           overwrite=supports_fused_head(model))


def packed_response_log_prob(model: torch.nn.Module, batch: Batch, temperature: float, with_entropy: bool,
                             fused_head: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`response_log_prob` on one packed row without pad tokens (``use_remove_padding``). The LM head runs
    on the positions that predict a response token only (through the model's ``logits_to_keep``, or in chunks
    with ``fused_head``), not on the prompts'."""
    inputs, valid = packed_inputs(batch)
    response_mask = batch["response_mask"].bool()
    prompt_len, response_len = batch["prompts"].shape[1], batch["responses"].shape[1]
    predicts = torch.zeros_like(valid)  # (bs, L): the positions whose next token is a response token
    predicts[:, prompt_len - 1:prompt_len - 1 + response_len] = response_mask
    keep = predicts[valid].nonzero().squeeze(1)  # their places in the packed row, in the responses' order
    labels = batch["responses"][response_mask][None]  # (1, N)
    if fused_head:
        hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state[:, keep]  # (1, N, H)
        log_prob, entropy = _tokens_log_prob(model, hidden, labels, temperature, with_entropy, chunked=True)
    else:
        if takes_logits_to_keep(type(model)):
            logits = model(**inputs, use_cache=False, logits_to_keep=keep).logits  # (1, N, V)
        else:
            logits = model(**inputs, use_cache=False).logits[:, keep]
        log_prob, entropy = logits_log_prob(logits, labels, temperature, with_entropy=with_entropy,
                                            overwrite=supports_fused_head(model))
    # the response tokens' values, in row order, back into the (bs, R) layout
    return unpack(log_prob[0], response_mask), (unpack(entropy[0], response_mask) if with_entropy else None)


def rollout_seed(seed: int, rank: int, rollout) -> int:
    """The sampling seed of ``rank``'s rollout engine: each engine draws its own stream, clear of the shuffle
    generators' seeds (seed + 1, seed + 2). An engine is one rank, or for vLLM the ``tensor_model_parallel_size``
    ranks that serve one model together, which must sample alike and so share one seed."""
    ranks_an_engine = rollout.tensor_model_parallel_size if rollout.name == "vllm" else 1
    return seed + ROLLOUT_SEED_STRIDE * (rank // ranks_an_engine)


class ActorWorker(CheckpointableWorker):
    def __init__(self, config: ActorRolloutRefConfig, tokenizer, total_steps: int, need_ref: bool,
                 seed: int = 0, device: str = "cpu", max_model_len: int | None = None):
        """``config``: the section of :meth:`~rlhf_core.config.PPOConfig.resolved` (its nulls that stand for
        other keys filled in)."""
        require_resolved(config, "actor_rollout_ref")
        self.config = config
        model_cfg, actor_cfg = config.model, config.actor
        self.loss_scale_factor = actor_cfg.loss_scale_factor  # Dr. GRPO's constant divisor
        self.device = torch.device(device)
        torch.manual_seed(seed)
        module = load_actor(model_cfg.path, model_cfg.dtype, model_cfg.enable_gradient_checkpointing,
                            model_cfg.trust_remote_code, self.device,
                            attn_implementation=attention_for(model_cfg.use_remove_padding, self.device),
                            override_config=model_cfg.override_config)
        # before the reference copies it: the update's, the old and the reference log-probs all without dropout
        self.base_dropout = dropout_off(module, model_cfg.disable_dropout, "actor_rollout_ref.model.disable_dropout")
        self.lora = model_cfg.lora_rank > 0
        if self.lora:
            module = lora.apply_lora(module, model_cfg.lora_rank, model_cfg.lora_alpha, model_cfg.target_modules)
        reference = make_reference(module) if need_ref and not self.lora else None
        self.sharded = distributed.in_worker_group()  # one rank of a worker group: FSDP2
        if self.sharded:
            distributed.fsdp_wrap(lora.base_model(module), self.device, actor_cfg.fsdp_config)
            if reference is not None:
                distributed.fsdp_wrap(reference, self.device, config.ref.fsdp_config)
        if actor_cfg.use_torch_compile:
            for model in (module, reference):
                if model is not None:
                    compile_blocks(model)
        self.module = module  # the trained module (a PEFT wrapper with LoRA)
        self.forward_module = lora.base_model(module)  # the transformers model (adapters active, if any)
        self.ref_module = reference
        self.need_ref = need_ref
        self.remove_padding = resolve_remove_padding(model_cfg.use_remove_padding, self.forward_module,
                                                     "actor_rollout_ref.model.use_remove_padding")
        self.fused_head = model_cfg.use_fused_kernels and self._fused_head_runs()
        self.shared_prefix = resolve_shared_prefix(
            model_cfg.use_shared_prefix, self.forward_module, "actor_rollout_ref.model.use_shared_prefix",
            sharded=self.sharded, remove_padding=self.remove_padding,
            gradient_checkpointing=model_cfg.enable_gradient_checkpointing, head_runs=supports_fused_head(self.forward_module))
        self.optimizer = build_optimizer([p for p in module.parameters() if p.requires_grad], actor_cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, actor_cfg.optim, total_steps)
        rollout = config.rollout
        if rollout.name == "vllm":
            engine_kwargs = {"config": rollout, "model_path": str(resolve(model_cfg.path)),
                             "tokenizer_path": str(resolve(model_cfg.tokenizer_path)),
                             "max_model_len": max_model_len, "weights": self.rollout_weights,
                             "trust_remote_code": model_cfg.trust_remote_code,
                             "hf_overrides": dict(model_cfg.override_config)}
        else:
            engine_kwargs = {"synced": distributed.all_done if self.sharded else None}
        self.rollout = make_rollout_engine(rollout.name, self.forward_module, tokenizer,
                                           seed=rollout_seed(seed, distributed.rank(), rollout), **engine_kwargs)
        self.shuffle_generator = torch.Generator().manual_seed(seed + 1)
        self.skipped_steps = 0

    def _fused_head_runs(self) -> bool:
        """``use_fused_kernels`` as it can run: in one process (the decoder is called without the sharded
        root module), with a plain head; elsewhere a one-line notice and the usual path."""
        why = ("the model is sharded over a worker group" if self.sharded
               else None if supports_fused_head(self.forward_module)
               else f"the {getattr(self.forward_module.config, 'model_type', '?')} head is not a plain linear layer")
        if why and distributed.rank() == 0:
            print(f"notice: actor_rollout_ref.model.use_fused_kernels=true is not used: {why}, so log-probs go "
                  "through the whole logits", file=sys.stderr, flush=True)
        return why is None

    # ------------------------------------------------------------------ rollout
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        self.rollout.resume()
        try:
            if self.sharded and self.config.rollout.name == "hf":  # gather the weights once, not per token
                with distributed.gathered(self.forward_module, self.config.actor.fsdp_config.reshard_after_forward):
                    return self.rollout.generate(prompts, params)
            return self.rollout.generate(prompts, params)
        finally:
            self.rollout.release()

    def rollout_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's full weights under transformers names (LoRA merged), one tensor at a time; sharded,
        every rank must iterate to the end (each tensor is gathered from the shards)."""
        tensors = distributed.iter_full_tensors(self.module)
        return lora.merged_tensors(tensors, lora.lora_scaling(self.module)) if self.lora else tensors

    # ------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def _log_prob(self, batch: Batch, micro: int | None, dynamic: bool, max_tok: int,
                  with_entropy: bool, model: torch.nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        model = model if model is not None else self.forward_module
        return map_micro_batches(batch, lambda mb: response_log_prob(
            model, mb.to(self.device), self.config.rollout.temperature, with_entropy, self.remove_padding,
            fused_head=self.fused_head, shared_prefix=self.shared_prefix.scoring), micro, dynamic, max_tok,
            by_prompt=self.shared_prefix.scoring)

    def compute_log_prob(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Old log-probs and entropies under the current policy, (bs, R) each."""
        rollout = self.config.rollout
        return self._log_prob(batch, rollout.log_prob_micro_batch_size_per_gpu, rollout.log_prob_use_dynamic_bsz,
                              rollout.log_prob_max_token_len_per_gpu, True)

    def compute_ref_log_prob(self, batch: Batch) -> torch.Tensor:
        if not self.need_ref:
            raise RuntimeError("no reference policy: enable algorithm.use_kl_in_reward or actor.use_kl_loss")
        ref = self.config.ref
        adapters_off = self.module.disable_adapter() if self.lora else nullcontext()
        with adapters_off:
            return self._log_prob(batch, ref.log_prob_micro_batch_size_per_gpu, ref.log_prob_use_dynamic_bsz,
                                  ref.log_prob_max_token_len_per_gpu, False, model=self.ref_module)[0]

    # ------------------------------------------------------------------ update
    def update_policy(self, batch: Batch, n_per_prompt: int, kl_loss_coef: float | None = None) -> dict[str, float]:
        """PPO policy update on a rollout batch with ``old_log_prob``, ``advantages`` (and ``ref_log_prob``).

        ``kl_loss_coef`` is the trainer's current coefficient of the KL loss (default: the config's).
        As one of N ranks, ``batch`` is this rank's share: each mini-batch is this rank's
        ``1/N`` of the global mini-batch (the worker group lays the rows out that way).

        Without ``old_log_prob`` the update is on-policy (one epoch over one mini-batch, so the policy
        is still the one that sampled): the old log-probs are this forward pass's own, detached
        (ratio 1, the same value and gradient as a separate recomputation), and the entropy of the
        batch is measured here as ``actor/entropy``.
        """
        cfg = self.config.actor
        coef = cfg.kl_loss_coef if kl_loss_coef is None else kl_loss_coef
        metrics = ppo_update(
            self, batch, prefix="actor", epochs=cfg.ppo_epochs, shuffle=cfg.shuffle,
            mini_rows=cfg.ppo_mini_batch_size * n_per_prompt // distributed.world_size(),
            micro_batches_of=lambda mini: micro_batches(mini, cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz,
                                                        cfg.ppo_max_token_len_per_gpu,
                                                        by_prompt=self.shared_prefix.update),
            loss_fn=lambda mb, tokens, seqs: self.policy_loss(mb, tokens, seqs, coef),
            grad_clip=cfg.grad_clip, fsdp_config=cfg.fsdp_config)
        self.rollout.sync_weights()
        return metrics

    def policy_loss(self, mb: Batch, token_count: int, seq_count: int,
                    kl_loss_coef: float) -> tuple[torch.Tensor, dict[str, float], dict[str, float]]:
        """The loss of one micro-batch of the policy update: the policy loss of ``policy_loss.loss_mode``
        (weighted by rollout correction's ``rollout_is_weights`` when the batch has them), minus the entropy
        bonus, plus the KL loss to the reference; normalised by the global mini-batch counts (and
        ``loss_scale_factor``). Returns (loss, metrics to sum over micro-batches and ranks, metrics that are
        the same everywhere)."""
        cfg = self.config.actor
        counts_kw = {"global_token_count": token_count, "global_seq_count": seq_count,
                     "loss_scale_factor": self.loss_scale_factor}
        mask = mb["response_mask"]
        on_policy = "old_log_prob" not in mb
        entropy_bonus = cfg.entropy_coeff != 0
        # on-policy the entropy is also the batch's entropy metric; without a bonus it stays out of the graph
        log_prob, entropy = response_log_prob(self.forward_module, mb, self.config.rollout.temperature,
                                              entropy_bonus or on_policy, self.remove_padding,
                                              entropy_grad=entropy_bonus, fused_head=self.fused_head,
                                              shared_prefix=self.shared_prefix.update)
        summed: dict[str, float] = {}
        constant: dict[str, float] = {}
        if on_policy:
            old_log_prob = log_prob.detach()
            # aggregated as the loss is (verl's metric): summed over micro-batches it is the mini-batch's
            summed["actor/entropy"] = float(algos.agg_loss(entropy.detach(), mask, cfg.loss_agg_mode, **counts_kw))
        else:
            old_log_prob = mb["old_log_prob"]
        compute_policy_loss = algos.get_policy_loss_fn(cfg.policy_loss.loss_mode)
        pg_loss, pg_metrics = compute_policy_loss(
            old_log_prob, log_prob, mb["advantages"], mask,
            cfg.clip_ratio, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c,
            cfg.loss_agg_mode, rollout_is_weights=mb.tensors.get("rollout_is_weights"), **counts_kw,
        )
        loss = pg_loss
        if entropy_bonus:
            entropy_loss = algos.agg_loss(entropy, mask, cfg.loss_agg_mode, **counts_kw)
            loss = loss - cfg.entropy_coeff * entropy_loss
        if cfg.use_kl_loss:
            kld = algos.kl_penalty(log_prob, mb["ref_log_prob"], cfg.kl_loss_type)
            kl_loss = algos.agg_loss(kld, mask, cfg.loss_agg_mode, **counts_kw)
            loss = loss + kl_loss_coef * kl_loss
            summed["actor/kl_loss"] = kl_loss.item()
            # per token whatever loss_agg_mode (seq-mean-token-sum sums each response's tokens): the KL guard's figure
            summed[KL_LOSS_TOKEN_MEAN] = float(algos.masked_sum(kld.detach(), mask)) / token_count
            constant["actor/kl_coef"] = kl_loss_coef
        summed["actor/pg_loss"] = pg_loss.item()
        share = float(mask.sum()) / token_count  # this micro-batch's share of the mini-batch's tokens
        for name, value in pg_metrics.items():  # token-weighted over the mini-batch
            summed[name] = value * share
        return loss, summed, constant

    # ------------------------------------------------------------------ state
    def extra_state(self) -> dict:
        return {**super().extra_state(), "rollout_generator": self.rollout.generator.get_state()
                if hasattr(self.rollout, "generator") else None}

    def load_extra_state(self, state: dict) -> None:
        super().load_extra_state(state)
        saved = state.get("rollout_generator")
        if saved is None or not hasattr(self.rollout, "generator"):
            return
        generator = self.rollout.generator
        if saved.numel() != generator.get_state().numel():  # saved on another kind of device (trainer.device)
            if distributed.rank() == 0:
                print(f"notice: the rollout's random stream was saved on another kind of device than this run's "
                      f"({generator.device.type}), whose stream cannot take it: sampling goes on from a fresh "
                      "stream of the run's seed, so the responses differ from the saved run's",
                      file=sys.stderr, flush=True)
            return
        generator.set_state(saved)

    def load_shards(self, folder: str | Path, weights_only: bool = False) -> None:
        super().load_shards(folder, weights_only)
        self.rollout.sync_weights()

    # ------------------------------------------------------------------ export
    def save_hf(self, target: str | Path) -> None:
        """The policy as a plain transformers model directory (LoRA merged); sharded, every rank must call
        this (the weights are gathered) and rank 0 writes. Without transformers' "Writing model shards" bar,
        which at every save would stand in the training bar's log (here, so that a Ray worker's save has none)."""
        with transformers_bars(False):
            if not self.lora and not self.sharded and not self.base_dropout:
                self.module.save_pretrained(target)
                return
            state = distributed.full_state_dict(self.module)  # {} on ranks other than 0 when sharded
            if distributed.rank() == 0:
                if self.lora:
                    state = lora.merged_state_dict(state, lora.lora_scaling(self.module))
                # the base's dropout rates, not the run's zeros: a model fine-tuned from the export gets them back
                save_hf_model(self.forward_module, state, target,
                              config_with(self.forward_module.config, self.base_dropout))

    def save_adapter(self, target: str | Path) -> None:
        """The LoRA adapter as peft saves it (:func:`lora.save_adapter`), over the base model at model.path made
        absolute; sharded, every rank must call this (the adapters are gathered) and rank 0 writes."""
        state = distributed.full_state_dict(self.module, only_trainable=True)  # {} on ranks other than 0 when sharded
        if distributed.rank() == 0:
            lora.save_adapter(self.module, state, target, Path(resolve(self.config.model.path)).absolute())


def build_actor(config: PPOConfig, tokenizer, total_steps: int, need_ref: bool, seed: int, device: str) -> ActorWorker:
    """The actor (with its rollout engine and reference) of ``config``, its unset keys resolved."""
    resolved = config.resolved()
    return ActorWorker(resolved.actor_rollout_ref, tokenizer, total_steps, need_ref, seed=seed, device=device,
                       max_model_len=config.data.max_prompt_length + config.data.max_response_length)
