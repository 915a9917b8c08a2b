"""The critic worker: a token-level value model, its value predictions and its clipped update."""

from __future__ import annotations

import torch

from rlhf_core import algos
from rlhf_core.batch import Batch
from rlhf_core.config import CriticConfig
from rlhf_core.models.loading import load_critic
from rlhf_core.workers.common import (
    batch_token_counts,
    build_optimizer,
    build_scheduler,
    clip_and_check,
    micro_batches,
    pad_response,
    trimmed_inputs,
)


def response_values(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """V(s_t) for each response token t: the value read at the position before the token. (bs, R)."""
    inputs, response_start, kept = trimmed_inputs(batch)
    values = model(**inputs).logits[..., 0]  # (bs, L)
    values = values[:, response_start - 1:response_start - 1 + kept].float()
    return pad_response(values, batch["responses"].shape[1]) * batch["response_mask"]


class CriticWorker:
    def __init__(self, config: CriticConfig, model_path: str, dtype: str, total_steps: int,
                 mini_batch_size: int, use_dynamic_bsz: bool, ppo_epochs: int, seed: int = 0, device: str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        self.module = load_critic(model_path, dtype, config.model.enable_gradient_checkpointing,
                                  config.model.trust_remote_code, self.device, seed=seed)
        self.optimizer = build_optimizer(self.module.parameters(), config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.optim, total_steps)
        self.mini_batch_size = config.ppo_mini_batch_size or mini_batch_size
        self.use_dynamic_bsz = use_dynamic_bsz if config.use_dynamic_bsz is None else config.use_dynamic_bsz
        self.ppo_epochs = config.ppo_epochs or ppo_epochs
        self.shuffle_generator = torch.Generator().manual_seed(seed + 2)
        self.skipped_steps = 0

    def _micro_batches(self, batch: Batch) -> list[Batch]:
        cfg = self.config
        return micro_batches(batch, cfg.ppo_micro_batch_size_per_gpu, self.use_dynamic_bsz,
                             cfg.ppo_max_token_len_per_gpu)

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        return torch.cat([response_values(self.module, mb.to(self.device)).cpu()
                          for mb in self._micro_batches(batch)])

    def update_critic(self, batch: Batch, n_per_prompt: int) -> dict[str, float]:
        """Clipped value regression on ``returns`` around the rollout-time ``values``."""
        cfg = self.config
        mini_rows = self.mini_batch_size * n_per_prompt
        sums: dict[str, float] = {}
        steps = 0
        self.module.train()
        for _ in range(self.ppo_epochs):
            order = (torch.randperm(len(batch), generator=self.shuffle_generator) if cfg.shuffle
                     else torch.arange(len(batch)))
            for start in range(0, len(batch), mini_rows):
                mini = batch.select(order[start:start + mini_rows])
                token_count, seq_count = batch_token_counts(mini)
                counts_kw = {"global_token_count": max(token_count, 1), "global_seq_count": max(seq_count, 1)}
                self.optimizer.zero_grad(set_to_none=True)
                vf_loss_sum, clipfrac_sum = 0.0, 0.0
                loss_finite = True
                for mb in self._micro_batches(mini):
                    mb = mb.to(self.device)
                    vpreds = response_values(self.module, mb)
                    vf_loss, clipfrac = algos.compute_value_loss(
                        vpreds, mb["returns"], mb["values"], mb["response_mask"], cfg.cliprange_value,
                        cfg.loss_agg_mode, **counts_kw,
                    )
                    loss_finite = loss_finite and bool(torch.isfinite(vf_loss))
                    vf_loss.backward()
                    vf_loss_sum += vf_loss.item()
                    clipfrac_sum += clipfrac * float(mb["response_mask"].sum()) / max(token_count, 1)
                grad_norm, finite = clip_and_check(self.module.parameters(), cfg.grad_clip)
                if finite and loss_finite:
                    self.optimizer.step()
                else:
                    self.skipped_steps += 1
                    self.optimizer.zero_grad(set_to_none=True)
                for name, value in (("critic/vf_loss", vf_loss_sum), ("critic/vf_clipfrac", clipfrac_sum),
                                    ("critic/grad_norm", grad_norm)):
                    sums[name] = sums.get(name, 0.0) + value
                steps += 1
        self.scheduler.step()
        self.module.eval()
        metrics = {name: value / steps for name, value in sums.items()}
        metrics["critic/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def state_dict(self) -> dict:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "shuffle_generator": self.shuffle_generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.shuffle_generator.set_state(state["shuffle_generator"])
