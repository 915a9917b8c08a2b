"""The actor worker: the policy, its rollout engine and the frozen reference, colocated.

It computes log-probs of responses (old policy and reference) and performs the PPO
policy update: ``ppo_epochs`` x mini-batches x micro-batches with gradient
accumulation, losses normalised over the whole mini-batch, gradient clipping and
skipping of mini-batch updates whose loss or gradient is not finite.
"""

from __future__ import annotations

import torch

from rlhf_core import algos
from rlhf_core.batch import Batch
from rlhf_core.config import ActorRolloutRefConfig
from rlhf_core.models.loading import load_actor, make_reference
from rlhf_core.rollout import SamplingParams, make_rollout_engine
from rlhf_core.workers.common import (
    batch_token_counts,
    build_optimizer,
    build_scheduler,
    clip_and_check,
    micro_batches,
    pad_response,
    trimmed_inputs,
)


def response_log_prob(model: torch.nn.Module, batch: Batch, temperature: float,
                      with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the response tokens of ``batch`` under ``model``: (bs, R) each."""
    inputs, response_start, kept = trimmed_inputs(batch)
    logits = model(**inputs, use_cache=False).logits  # (bs, L, V)
    logits = logits[:, response_start - 1:response_start - 1 + kept].float()  # position t predicts t+1
    if temperature and temperature != 1.0:
        logits = logits / temperature
    responses = batch["responses"][:, :kept]
    log_prob = pad_response(algos.logprobs_from_logits(logits, responses), batch["responses"].shape[1])
    entropy = None
    if with_entropy:
        entropy = pad_response(algos.entropy_from_logits(logits), batch["responses"].shape[1])
    return log_prob, entropy


class ActorWorker:
    def __init__(self, config: ActorRolloutRefConfig, tokenizer, total_steps: int, need_ref: bool,
                 seed: int = 0, device: str = "cpu"):
        self.config = config
        model_cfg, actor_cfg = config.model, config.actor
        self.device = torch.device(device)
        torch.manual_seed(seed)
        self.module = load_actor(model_cfg.path, model_cfg.dtype, model_cfg.enable_gradient_checkpointing,
                                 model_cfg.trust_remote_code, self.device)
        self.ref_module = make_reference(self.module) if need_ref else None
        self.optimizer = build_optimizer(self.module.parameters(), actor_cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, actor_cfg.optim, total_steps)
        self.rollout = make_rollout_engine(config.rollout.name, self.module, tokenizer, seed=seed)
        self.shuffle_generator = torch.Generator().manual_seed(seed + 1)
        self.skipped_steps = 0

    # ------------------------------------------------------------------ rollout
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        self.rollout.resume()
        try:
            return self.rollout.generate(prompts, params)
        finally:
            self.rollout.release()

    # ------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def _log_prob(self, model: torch.nn.Module, batch: Batch, micro: int | None, dynamic: bool, max_tok: int,
                  with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        log_probs, entropies = [], []
        for mb in micro_batches(batch, micro, dynamic, max_tok):
            log_prob, entropy = response_log_prob(model, mb.to(self.device), self.config.rollout.temperature,
                                                  with_entropy)
            log_probs.append(log_prob.cpu())
            if entropy is not None:
                entropies.append(entropy.cpu())
        return torch.cat(log_probs), (torch.cat(entropies) if with_entropy else None)

    def compute_log_prob(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Old log-probs and entropies under the current policy, (bs, R) each."""
        rollout = self.config.rollout
        return self._log_prob(self.module, batch, rollout.log_prob_micro_batch_size_per_gpu,
                              rollout.log_prob_use_dynamic_bsz, rollout.log_prob_max_token_len_per_gpu, True)

    def compute_ref_log_prob(self, batch: Batch) -> torch.Tensor:
        if self.ref_module is None:
            raise RuntimeError("no reference policy: enable algorithm.use_kl_in_reward or actor.use_kl_loss")
        ref = self.config.ref
        return self._log_prob(self.ref_module, batch, ref.log_prob_micro_batch_size_per_gpu,
                              ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu, False)[0]

    # ------------------------------------------------------------------ update
    def update_policy(self, batch: Batch, n_per_prompt: int) -> dict[str, float]:
        """PPO policy update on a rollout batch with ``old_log_prob``, ``advantages`` (and ``ref_log_prob``)."""
        cfg = self.config.actor
        mini_rows = cfg.ppo_mini_batch_size * n_per_prompt
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}

        def record(name: str, value: float) -> None:
            sums[name] = sums.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1

        self.module.train()
        for _ in range(cfg.ppo_epochs):
            order = (torch.randperm(len(batch), generator=self.shuffle_generator) if cfg.shuffle
                     else torch.arange(len(batch)))
            for start in range(0, len(batch), mini_rows):
                mini = batch.select(order[start:start + mini_rows])
                token_count, seq_count = batch_token_counts(mini)
                counts_kw = {"global_token_count": max(token_count, 1), "global_seq_count": max(seq_count, 1)}
                self.optimizer.zero_grad(set_to_none=True)
                step_metrics: dict[str, float] = {}
                loss_finite = True
                for mb in micro_batches(mini, cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz,
                                        cfg.ppo_max_token_len_per_gpu):
                    mb = mb.to(self.device)
                    mask = mb["response_mask"]
                    need_entropy = cfg.entropy_coeff != 0
                    log_prob, entropy = response_log_prob(self.module, mb, self.config.rollout.temperature,
                                                          need_entropy)
                    pg_loss, pg_metrics = algos.compute_policy_loss(
                        mb["old_log_prob"], log_prob, mb["advantages"], mask,
                        cfg.clip_ratio, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c,
                        cfg.loss_agg_mode, **counts_kw,
                    )
                    loss = pg_loss
                    share = float(mask.sum()) / max(token_count, 1)  # this micro-batch's share of the tokens
                    if need_entropy:
                        entropy_loss = algos.agg_loss(entropy, mask, cfg.loss_agg_mode, **counts_kw)
                        loss = loss - cfg.entropy_coeff * entropy_loss
                    if cfg.use_kl_loss:
                        kld = algos.kl_penalty(log_prob, mb["ref_log_prob"], cfg.kl_loss_type)
                        kl_loss = algos.agg_loss(kld, mask, cfg.loss_agg_mode, **counts_kw)
                        loss = loss + cfg.kl_loss_coef * kl_loss
                        step_metrics["actor/kl_loss"] = step_metrics.get("actor/kl_loss", 0.0) + kl_loss.item()
                        step_metrics["actor/kl_coef"] = cfg.kl_loss_coef
                    loss_finite = loss_finite and bool(torch.isfinite(loss))
                    loss.backward()
                    step_metrics["actor/pg_loss"] = step_metrics.get("actor/pg_loss", 0.0) + pg_loss.item()
                    for name, value in pg_metrics.items():  # token-weighted over the mini-batch
                        step_metrics[name] = step_metrics.get(name, 0.0) + value * share
                grad_norm, finite = clip_and_check(self.module.parameters(), cfg.grad_clip)
                if finite and loss_finite:
                    self.optimizer.step()
                else:
                    self.skipped_steps += 1
                    self.optimizer.zero_grad(set_to_none=True)
                record("actor/grad_norm", grad_norm)
                for name, value in step_metrics.items():
                    record(name, value)
        self.scheduler.step()
        self.module.eval()
        metrics = {name: sums[name] / counts[name] for name in sums}
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        self.rollout.sync_weights()
        return metrics

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "shuffle_generator": self.shuffle_generator.get_state(),
                "rollout_generator": self.rollout.generator.get_state()
                if hasattr(self.rollout, "generator") else None}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.shuffle_generator.set_state(state["shuffle_generator"])
        if state.get("rollout_generator") is not None and hasattr(self.rollout, "generator"):
            self.rollout.generator.set_state(state["rollout_generator"])
