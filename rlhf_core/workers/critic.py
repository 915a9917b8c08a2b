"""The critic worker: a token-level value model, its value predictions and its clipped update.

As for the actor, the same class runs alone or as one FSDP2-sharded rank of a worker group,
optionally with LoRA adapters (``critic.model.lora_rank``) and a fully trained value head.
"""

from __future__ import annotations

import torch

from rlhf_core import algos
from rlhf_core.batch import Batch
from rlhf_core.config import CriticConfig, PPOConfig, require_resolved
from rlhf_core.models import lora
from rlhf_core.models.fused_head import plain_score_head
from rlhf_core.models.loading import attention_for, load_critic
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


def response_values(model: torch.nn.Module, batch: Batch, remove_padding: bool = False,
                    shared_prefix: bool = False) -> torch.Tensor:
    """V(s_t) for each response token t: the value read at the position before the token. (bs, R).
    ``shared_prefix`` (``use_shared_prefix``, for a model with a :func:`plain_score_head`) runs each distinct
    prompt once (:func:`shared_prompt_hidden`)."""
    prompt_len, response_len = batch["prompts"].shape[1], batch["responses"].shape[1]
    if remove_padding:
        inputs, valid = packed_inputs(batch)
        values = unpack(model(**inputs, use_cache=False).logits[0, :, 0].float(), valid)  # (bs, L)
        return values[:, prompt_len - 1:prompt_len - 1 + response_len] * batch["response_mask"]
    if shared_prefix:
        hidden, _ = shared_prompt_hidden(model.base_model, batch)
        return pad_response(plain_score_head(model)(hidden)[..., 0].float(), response_len) * batch["response_mask"]
    inputs, response_start, kept = trimmed_inputs(batch)
    values = model(**inputs, use_cache=False).logits[..., 0]  # (bs, L)
    values = values[:, response_start - 1:response_start - 1 + kept].float()
    return pad_response(values, response_len) * batch["response_mask"]


class CriticWorker(CheckpointableWorker):
    def __init__(self, config: CriticConfig, dtype: str, total_steps: int, seed: int = 0, device: str = "cpu",
                 loss_scale_factor: int | None = None):
        """``config``: the critic section of :meth:`~rlhf_core.config.PPOConfig.resolved` (the keys that
        default to the actor's filled in); ``loss_scale_factor``: Dr. GRPO's divisor (None: each batch's
        response width; :func:`build_critic` passes data.max_response_length, as verl's critic divides by it,
        whatever the actor's loss_scale_factor)."""
        require_resolved(config, "critic")
        self.config = config
        self.device = torch.device(device)
        model_cfg = config.model
        self.loss_scale_factor = loss_scale_factor
        module = load_critic(model_cfg.path, dtype, model_cfg.enable_gradient_checkpointing,
                             model_cfg.trust_remote_code, self.device, seed=seed,
                             attn_implementation=attention_for(model_cfg.use_remove_padding, self.device),
                             override_config=model_cfg.override_config)
        dropout_off(module, model_cfg.disable_dropout, "critic.model.disable_dropout")  # no export: rates not kept
        self.lora = model_cfg.lora_rank > 0
        if self.lora:
            module = lora.apply_lora(module, model_cfg.lora_rank, model_cfg.lora_alpha, model_cfg.target_modules,
                                     critic=True)
        self.sharded = distributed.in_worker_group()  # one rank of a worker group: FSDP2
        if self.sharded:
            distributed.fsdp_wrap(lora.base_model(module), self.device, config.fsdp_config)
        self.module = module
        self.forward_module = lora.base_model(module)
        self.remove_padding = resolve_remove_padding(model_cfg.use_remove_padding, self.forward_module,
                                                     "critic.model.use_remove_padding")
        self.shared_prefix = resolve_shared_prefix(
            model_cfg.use_shared_prefix, self.forward_module, "critic.model.use_shared_prefix",
            sharded=self.sharded, remove_padding=self.remove_padding,
            gradient_checkpointing=model_cfg.enable_gradient_checkpointing, head_runs=plain_score_head(self.forward_module) is not None)
        self.optimizer = build_optimizer([p for p in module.parameters() if p.requires_grad], config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.optim, total_steps)
        self.shuffle_generator = torch.Generator().manual_seed(seed + 2)
        self.skipped_steps = 0

    def _micro_batching(self, shared: bool) -> tuple[int | None, bool, int, bool]:
        cfg = self.config
        return cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu, shared

    def _micro_batches(self, batch: Batch) -> list[Batch]:
        return micro_batches(batch, *self._micro_batching(self.shared_prefix.update))

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        shared = self.shared_prefix.scoring
        return map_micro_batches(batch, lambda mb: response_values(self.forward_module, mb.to(self.device),
                                                                   self.remove_padding, shared),
                                 *self._micro_batching(shared))

    def update_critic(self, batch: Batch, n_per_prompt: int) -> dict[str, float]:
        """Clipped value regression on ``returns`` around the rollout-time ``values``.

        As one of N ranks, ``batch`` is this rank's share and each mini-batch its ``1/N`` of the global one.
        """
        cfg = self.config
        return ppo_update(self, batch, prefix="critic", epochs=cfg.ppo_epochs, shuffle=cfg.shuffle,
                          mini_rows=cfg.ppo_mini_batch_size * n_per_prompt // distributed.world_size(),
                          micro_batches_of=self._micro_batches, loss_fn=self.value_loss, grad_clip=cfg.grad_clip,
                          fsdp_config=cfg.fsdp_config)

    def value_loss(self, mb: Batch, token_count: int, seq_count: int) -> tuple[torch.Tensor, dict, dict]:
        """The clipped value loss of one micro-batch, normalised by the global mini-batch counts."""
        cfg = self.config
        vpreds = response_values(self.forward_module, mb, self.remove_padding, self.shared_prefix.update)
        vf_loss, clipfrac = algos.compute_value_loss(
            vpreds, mb["returns"], mb["values"], mb["response_mask"], cfg.cliprange_value, cfg.loss_agg_mode,
            global_token_count=token_count, global_seq_count=seq_count, loss_scale_factor=self.loss_scale_factor)
        mask = mb["response_mask"].to(vpreds.dtype)
        clipped = clipfrac * float(mask.sum()) / token_count  # token-weighted over the mini-batch
        vpred_mean = float((vpreds.detach() * mask).sum()) / token_count  # likewise: the mini-batch's mean
        return vf_loss, {"critic/vf_loss": vf_loss.item(), "critic/vf_clipfrac": clipped,
                         "critic/vpred_mean": vpred_mean}, {}


def build_critic(config: PPOConfig, total_steps: int, seed: int, device: str) -> CriticWorker:
    """The critic of ``config``, its unset keys taken from the actor's (as verl's config interpolates them)."""
    resolved = config.resolved()
    return CriticWorker(resolved.critic, resolved.actor_rollout_ref.model.dtype, total_steps, seed=seed,
                        device=device, loss_scale_factor=resolved.data.max_response_length)
