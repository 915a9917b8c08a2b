"""Rollout with the actor module itself (no weight copy): a KV-cached sampling loop.

Each prompt is encoded once; its KV cache is then repeated for the ``n`` samples of
its group, so the prompt cost does not grow with ``n``. The cache has room for the whole
response from the start (:mod:`rlhf_core.rollout.cache`), so decode steps write in place
rather than copy the cache, and the prompt pass runs the LM head on its last position only. On CPU
the decode steps of llama and qwen2 models run :class:`~rlhf_core.rollout.fused_decode.FusedDecoder`
(the same step in fewer, fused operations); other models' linear layers read a copy of their weights
packed for the rollout, in MKL's layout or oneDNN's (:func:`rlhf_core.models.cpu_matmul.packed_weights`).
The loop stops when every sequence has produced EOS (or when ``synced`` says every rank has,
so that sharded models run the same number of forward passes on every rank); with ``ignore_eos``
an EOS is a token like any other and every response runs to ``max_new_tokens``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from rlhf_core.batch import Batch
from rlhf_core.models import cpu_matmul
from rlhf_core.models.loading import cache_argument, takes_logits_to_keep
from rlhf_core.rollout.base import SamplingParams, call_seed, stop_tokens
from rlhf_core.rollout.cache import PreallocatedCache
from rlhf_core.rollout.fused_decode import FusedDecoder, unsupported

#: decode steps on :class:`FusedDecoder` where the model and device allow (off: transformers' layers, as for
#: every other model)
FUSED_DECODE = True


def sample_next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from ``logits`` (bs, V): greedy, or temperature / top-k / top-p sampling. Greedy takes the
    first of equal maxima (as ``torch.argmax``, HF's greedy search and vLLM's); a row whose logits hold NaN gets
    ``V``, as :func:`draw_from` gives it (argmax would pick the NaN's own index, a token like any other). Top-k keeps
    every token tied with the k-th; top-p keeps the smallest set of the likeliest tokens whose mass reaches
    ``top_p`` (the token that crosses it stays). Where that set needs only some of a tie at its edge, the higher ids
    stay, as in transformers' ``TopPLogitsWarper``."""
    if params.greedy:
        top, token = logits.max(dim=-1)  # max propagates NaN
        return torch.where(top.isnan(), logits.shape[-1], token)
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (bs, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        # summed from the least likely up, so that the many small masses of a large vocabulary's tail are added
        # while the running sum is small too (from the likeliest down, each would round at the ulp of top_p)
        sorted_logits, order = torch.sort(logits, dim=-1)
        tail = sorted_logits.softmax(-1).cumsum(-1)  # (bs, V): each token's mass with that of all less likely ones
        drop_sorted = tail <= 1 - params.top_p  # what stays still holds top_p: the token that crosses it stays
        drop_sorted[:, -1] = False  # the likeliest token always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return draw_from(logits.softmax(dim=-1), generator)


#: entries per block of the two-level draw of :func:`draw_from`
CDF_BLOCK = 256


def draw_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of ``probs`` (bs, V), drawn with those probabilities by inverting the CDF.

    ``torch.multinomial`` draws an exponential variate for every vocabulary entry (bs x V random
    numbers per token: 20 ms a step for 16 rows of a 49k vocabulary on 2 AVX2 cores); one uniform per
    row does the same draw. It is inverted in two levels: the masses of blocks of :data:`CDF_BLOCK`
    entries pick a block, then the cumulative sum of that block's entries picks the entry, so that the
    only pass over the whole vocabulary is a vectorised block sum (16 rows of a 49k vocabulary: 0.3-0.4
    ms, against 0.9-8.8 ms for one float64 cumulative sum over all of it, ``bench/decode.py``). The
    running sums, over the blocks and within the chosen one, are float64, so a rare token's mass is not
    rounded away against a total of 1 (its block's float32 mass only scales where in the block the draw
    falls); an entry of zero probability adds nothing to either sum and is never returned. A row whose
    probabilities hold NaN (logits that did) has no CDF to invert: it gets ``V``, one past the last entry,
    which :meth:`HFRolloutEngine.generate` reports (nothing is indexed out of range here, on any device).
    """
    rows, vocab = probs.shape
    # drawn where the generator lives: an engine built on offloaded (CPU) shards keeps a CPU generator while
    # the gathered weights compute on the GPU
    u = torch.rand(rows, 1, generator=generator, device=generator.device if generator is not None else probs.device,
                   dtype=torch.float64).to(probs.device)
    if vocab <= CDF_BLOCK:  # one block: its cumulative sum is the whole CDF
        return _invert(probs.double().cumsum(-1), u).squeeze(-1)
    blocks = -(-vocab // CDF_BLOCK)
    if vocab % CDF_BLOCK:
        probs = torch.nn.functional.pad(probs, (0, blocks * CDF_BLOCK - vocab))  # zero mass: never drawn
    grouped = probs.view(rows, blocks, CDF_BLOCK)
    outer = grouped.sum(-1).double().cumsum(-1)  # (bs, blocks)
    block = _invert(outer, u).clamp(max=blocks - 1)  # (bs, 1); a NaN row's search runs past the end
    before = torch.where(block > 0, outer.gather(1, (block - 1).clamp(min=0)), 0.0)
    share = (u * outer[:, -1:] - before) / (outer.gather(1, block) - before)  # where in its block the draw falls
    inner = grouped.gather(1, block[:, :, None].expand(rows, 1, CDF_BLOCK)).squeeze(1).double().cumsum(-1)
    return (block * CDF_BLOCK + _invert(inner, share.clamp(0, 1))).clamp(max=vocab).squeeze(-1)


def _invert(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(bs, 1) indices of the first entries of the running sums ``cdf`` (bs, K) above ``u`` (bs, 1) in [0, 1]
    times their totals; the target is kept below the total, so an entry of zero mass is never returned."""
    total = cdf[:, -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)


class NonFiniteLogits(FloatingPointError):
    """The policy's logits held NaN where a token was to be sampled: there are no probabilities to draw from."""


def _nan_logits_error(step: int, rows: list[int]) -> NonFiniteLogits:
    """The error, whose ``where`` says what was found without the advice, which is a training run's."""
    shown = ", ".join(map(str, rows[:8])) + (f" and {len(rows) - 8} more" if len(rows) > 8 else "")
    where = (f"the policy's logits held NaN (or inf) at response token {step} of rows {shown}, so there is no "
             "distribution to sample from")
    error = NonFiniteLogits(
        f"{where}. This usually means a diverged update (too high a learning rate, "
        "actor_rollout_ref.actor.optim.lr; look for a large or non-finite actor/grad_norm in the steps before): "
        "weights an update made NaN show first here, at the next rollout, even where that update's own loss and "
        "gradient were finite, so trainer.guard's non-finite check (trainer.guard.max_consecutive_skips steps in a "
        "row with a non-finite loss or gradient) does not reach them and the run stops here without a rollback; or "
        "a bad checkpoint or model directory (NaN in its weights)")
    error.where = where
    return error


class HFRolloutEngine:
    """Generation with a transformers causal LM, sharing the actor's module."""

    def __init__(self, module: torch.nn.Module, tokenizer, seed: int = 0,
                 synced: Callable[[bool, bool], tuple[bool, bool]] | None = None):
        self.module = module
        eos_ids, self.pad_id = stop_tokens(module, tokenizer)
        self.eos_ids = torch.tensor(eos_ids)
        self.seed = seed
        self.generator = torch.Generator(device=self._device()).manual_seed(seed)
        self.cache_arg = cache_argument(type(module))
        self.synced = synced  # all-reduce (every local row is done, a local row failed) across ranks; None = one rank
        #: the last rollout's seconds before its first token could be drawn (the decode weights, the prompts' pass)
        #: and in its decode loop (each step: a draw, then a forward of one token a row), with the loop's forwards
        self.last_timing: dict[str, float] = {}

    def _device(self) -> torch.device:
        return next(self.module.parameters()).device

    def sync_weights(self) -> None:  # the module is the actor itself
        pass

    def release(self) -> None:
        pass

    def resume(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        start = time.perf_counter()
        device = self._device()
        was_training = self.module.training
        self.module.eval()
        prompt_ids = prompts["input_ids"].to(device)
        prompt_mask = prompts["attention_mask"].to(device)
        prompt_pos = prompts["position_ids"].to(device)
        n = params.n
        eos_ids = self.eos_ids.to(device)
        generator = (self.generator if params.seed is None
                     else torch.Generator(device=self.generator.device).manual_seed(call_seed(self.seed, params.seed)))

        # the decode steps' weights for their row count, copied for this rollout (the update changes them): the
        # fused step's own, or the model's layers' packed (MKL's layout or oneDNN's)
        # (the fused step takes only models whose weights are on the CPU)
        decode_rows = prompt_ids.shape[0] * n
        fused = FusedDecoder(self.module, decode_rows) if FUSED_DECODE and unsupported(self.module) is None else None
        with contextlib.nullcontext() if fused else cpu_matmul.packed_weights(self.module, rows=decode_rows):
            # room for the prompt and the whole response, written in place by every forward below
            cache = PreallocatedCache(prompt_ids.shape[1] + params.max_new_tokens)
            head = {"logits_to_keep": 1} if takes_logits_to_keep(type(self.module)) else {}  # the last position only
            out = self.module(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=prompt_pos,
                              use_cache=True, **{self.cache_arg: cache}, **head)
            logits = out.logits[:, -1, :]  # (B, V)
            if n > 1:
                cache.batch_repeat_interleave(n)
                logits = logits.repeat_interleave(n, dim=0)
                prompt_ids = prompt_ids.repeat_interleave(n, dim=0)
                prompt_mask = prompt_mask.repeat_interleave(n, dim=0)
                prompt_pos = prompt_pos.repeat_interleave(n, dim=0)
            rows = prompt_ids.shape[0]
            attention_mask = prompt_mask
            next_pos = prompt_pos[:, -1] + 1  # (B*n,)
            done = torch.zeros(rows, dtype=torch.bool, device=device)
            tokens, masks = [], []
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the prompts' pass counts as prefill, not as the first step
            first, forwards, failure = time.perf_counter(), 0, None
            for step in range(params.max_new_tokens):
                token = sample_next_token(logits, params, generator)
                token = torch.where(done, torch.full_like(token, self.pad_id), token)
                valid = ~done  # this token belongs to the response (EOS included)
                tokens.append(token)
                masks.append(valid)
                if not params.ignore_eos:
                    done = done | torch.isin(token, eos_ids)
                # draw_from gives V to a row whose logits held NaN: read with the end test, in the same transfer,
                # and stopped before that token reaches the embedding (out of range: an index error, on CUDA a
                # device-side assert)
                nan_rows = token >= logits.shape[-1]
                all_done, broken = torch.stack([done.all(), nan_rows.any()]).tolist()
                # sharded: every rank stops at the same step, done or failed, so none waits on one that raised
                all_done, failed = self.synced(all_done, broken) if self.synced is not None else (all_done, broken)
                if failed:
                    failure = (_nan_logits_error(step, nan_rows.nonzero().flatten().tolist()) if broken else
                               NonFiniteLogits(f"another rank's policy logits held NaN (or inf) at response token "
                                               f"{step}: that rank's error says where and what usually causes it"))
                    break
                if all_done or step == params.max_new_tokens - 1:
                    break
                attention_mask = torch.cat([attention_mask, valid.long()[:, None]], dim=1)
                if fused is not None:
                    logits = fused(token, attention_mask, next_pos, cache)
                else:
                    out = self.module(input_ids=token[:, None], attention_mask=attention_mask,
                                      position_ids=next_pos[:, None], use_cache=True, **{self.cache_arg: cache})
                    logits = out.logits[:, -1, :]
                next_pos = next_pos + 1
                forwards += 1
        self.last_timing = {"prefill_s": first - start, "decode_s": time.perf_counter() - first,
                            "decode_forwards": forwards}
        if was_training:
            self.module.train()
        if failure is not None:
            raise failure

        responses = torch.stack(tokens, dim=1)  # (B*n, R)
        response_mask = torch.stack(masks, dim=1).long()  # (B*n, R)
        steps = torch.arange(1, responses.shape[1] + 1, device=device)
        response_pos = prompt_pos[:, -1:] + steps  # (B*n, R)
        result = Batch(
            {
                "prompts": prompt_ids,
                "responses": responses,
                "response_mask": response_mask,
                "input_ids": torch.cat([prompt_ids, responses], dim=1),
                "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
                "position_ids": torch.cat([prompt_pos, response_pos], dim=1),
            },
            {k: [x for x in v for _ in range(n)] for k, v in prompts.meta.items()},
        )
        return result.to("cpu")
