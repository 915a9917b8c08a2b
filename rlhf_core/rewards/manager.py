"""Turn generated responses into token-level rewards.

:class:`RewardManager` decodes each response, scores it with the reward function for its
``data_source`` (or one custom function for every source) and puts the scalar score on the
response's last valid token, the convention PPO's advantage estimators expect. A reward function
that raises, returns something that is not a score, or returns NaN or inf stops the scoring with a
:class:`RewardError` naming the function, the sample and its data source, before the score can reach
an update or a checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from rlhf_core.rewards import BatchRewardFn, RewardFn, UnknownDataSourceError, get_reward_fn
from rlhf_core.rewards.result import NotFinite, RewardResult, RewardResultError, awaited, read_reward_result


class RewardError(Exception):
    """A reward function failed on a response: it raised, returned something that is not a score, or returned
    NaN or inf. The user's code, not the run, is at fault: the training command reports it without a traceback.

    ``function`` is the reward function's name, ``sample`` the response's index in the scored batch and
    ``data_source`` its source (both None where a batch function failed on the whole batch); the function's own
    exception, where it raised, is chained (``__cause__``) and its text is in the message. ``step`` is the
    training step whose rollouts were being scored, where the caller knows it (:func:`rlhf_core.main_ppo.run`
    sets it; None for a validation's scores). Each kind below is also a built-in error (RuntimeError, TypeError,
    ValueError: the one the manager raised for it before, so that code catching that still catches it; a
    TypeError a batch function raises itself is now a RewardFunctionFailed, as any other error it raises).
    """

    def __init__(self, message: str, function: str | None = None, sample: int | None = None,
                 data_source: str | None = None) -> None:
        super().__init__(message)
        self.function, self.sample, self.data_source = function, sample, data_source
        self.step: int | None = None

    def reworded(self, message: str) -> RewardError:
        """The same error (same class and fields) with ``message``, e.g. this one's put in the run's context
        (the step, the checkpoint left); raise it ``from`` this one."""
        error = type(self)(message, self.function, self.sample, self.data_source)
        error.step = self.step
        return error


class RewardFunctionFailed(RewardError, RuntimeError):
    """The reward function raised (its exception chained, its type and text in the message)."""


class BadRewardResult(RewardError, TypeError):
    """The reward function returned something other than a number or a dict with a numeric ``"score"``."""


class NonFiniteReward(RewardError, ValueError):
    """The reward function returned NaN or inf, which would turn every advantage and weight it reaches into NaN."""


def _fn_name(fn: Any) -> str:
    """A reward function's name for messages; that of the function inside a partial (``reward_kwargs`` bound)."""
    return getattr(getattr(fn, "func", fn), "__name__", repr(fn))


class RewardManager:
    """Score a batch of responses.

    Args:
        tokenizer: anything with ``batch_decode(list_of_id_lists, skip_special_tokens=True)``.
        reward_fn: ``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``
            used for every sample whatever its source; when None, each sample's function is
            looked up in :data:`rlhf_core.rewards.REWARD_FNS` by its data_source.
        full_score: the score of a fully correct answer; a numeric result ``>= full_score``
            counts as accurate in ``extras["acc"]`` (1.0 for the built-in rules), and so does a dict
            result without an ``"acc"`` entry whose ``"score"`` is.
    """

    def __init__(self, tokenizer: Any, reward_fn: RewardFn | None = None, full_score: float = 1.0) -> None:
        if reward_fn is not None and not callable(reward_fn):
            raise TypeError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.full_score = float(full_score)

    def score_batch(self, batch) -> tuple[torch.Tensor, dict[str, Any]]:
        """:meth:`__call__` on a rollout :class:`~rlhf_core.batch.Batch` (its responses, mask and metadata)."""
        return self(batch["responses"], batch["response_mask"], batch.meta["data_source"],
                    batch.meta["ground_truth"], batch.meta["extra_info"])

    def _fn_for(self, data_source: str) -> RewardFn:
        return self.reward_fn if self.reward_fn is not None else get_reward_fn(data_source)

    def __call__(
        self,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        data_sources: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict | None] | None = None,
        responses: Sequence[str] | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Score every response.

        Args:
            response_ids: (bs, T) token ids.
            response_mask: (bs, T) of 0/1, 1 on the response's valid tokens (right padding:
                valid tokens first, then zeros).
            data_sources, ground_truths: one per response.
            extra_infos: one dict (or None) per response, passed on to the reward function.
            responses: the text of each response, where the caller has decoded them already (:meth:`decode`
                of these ids and mask); they are not decoded a second time (a tokenizer's decode is a
                large part of scoring a long batch). None: decoded here.

        Returns:
            ``token_level_scores``: float32 (bs, T), zero except each response's score placed on
            its last valid token (the last position where the mask is 1). A response with no
            valid token is still scored (on the empty string) and reported in ``extras``, but
            its row of ``token_level_scores`` stays all zero, since there is no token to carry it.

            ``extras``: ``"score"`` float32 (bs,), ``"acc"`` float32 (bs,) (for a dict result its
            ``"acc"`` entry if present, else ``score >= full_score``, as for a number),
            ``"responses"`` the decoded strings, ``"pred"`` (when the function returns one) the
            answer each response gives as a string (None for none), and one float32 (bs,) tensor
            per other numeric key returned by dict-returning functions (NaN for samples that did
            not return it).

        Raises:
            ValueError: inconsistent shapes or lengths, or a mask that is not 0/1.
            UnknownDataSourceError: a data_source without a built-in function (and no custom one).
            RewardFunctionFailed: (a RewardError and a RuntimeError) the reward function raised on a
                sample (index, data_source and the original error in the message; the original is chained).
            BadRewardResult: (a RewardError and a TypeError) the reward function returned something other
                than a number or a dict with a numeric ``"score"``, naming the sample.
            NonFiniteReward: (a RewardError and a ValueError) the reward function returned NaN or inf,
                naming the sample.
        """
        if response_ids.dim() != 2:
            raise ValueError(f"response_ids must be (batch, length), got shape {tuple(response_ids.shape)}")
        if response_mask.shape != response_ids.shape:
            raise ValueError(
                f"response_mask shape {tuple(response_mask.shape)} differs from response_ids shape "
                f"{tuple(response_ids.shape)}"
            )
        batch, length = response_ids.shape
        for label, values in (("data_sources", data_sources), ("ground_truths", ground_truths)):
            if len(values) != batch:
                raise ValueError(f"{label} has {len(values)} entries but the batch has {batch} responses")
        if extra_infos is None:
            extra_infos = [None] * batch
        elif len(extra_infos) != batch:
            raise ValueError(
                f"extra_infos has {len(extra_infos)} entries but the batch has {batch} responses"
            )

        if responses is None:
            responses, valid = self.decode(response_ids, response_mask)
        else:
            if len(responses) != batch:
                raise ValueError(f"responses has {len(responses)} entries but the batch has {batch} responses")
            responses, valid = list(responses), self.valid_mask(response_mask)

        scores: list[float] = []
        accs: list[float] = []
        preds: list[str | None] = [None] * batch
        any_pred = False
        metrics: dict[str, list[float]] = {}
        results = self._results(responses, data_sources, ground_truths, extra_infos)
        for i, (fn, result) in enumerate(results):
            data_source = data_sources[i]
            read = self._unpack(result, i, data_source, fn)
            if read.has_pred:
                any_pred = True
                preds[i] = read.pred
            scores.append(read.score)
            accs.append(read.acc)
            for key, value in read.extra.items():
                metrics.setdefault(key, [math.nan] * batch)[i] = value

        token_level_scores = torch.zeros((batch, length), dtype=torch.float32, device=response_ids.device)
        if batch and length:
            positions = torch.arange(length).expand(batch, length)
            last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=1).values
            rows = torch.nonzero(last >= 0).flatten()
            token_level_scores[rows.to(response_ids.device), last[rows].to(response_ids.device)] = (
                torch.tensor(
                    [scores[r] for r in rows.tolist()], dtype=torch.float32, device=response_ids.device
                )
            )

        extras: dict[str, Any] = {
            "score": torch.tensor(scores, dtype=torch.float32),
            "acc": torch.tensor(accs, dtype=torch.float32),
        }
        for key, values in metrics.items():
            extras[key] = torch.tensor(values, dtype=torch.float32)
        extras["responses"] = responses
        if any_pred:
            extras["pred"] = preds
        return token_level_scores, extras

    def decode(self, response_ids: torch.Tensor, response_mask: torch.Tensor) -> tuple[list[str], torch.Tensor]:
        """Each response's valid tokens as text (special tokens left out), and the mask as a CPU bool tensor."""
        valid = self.valid_mask(response_mask)
        ids = response_ids.detach().cpu()
        id_lists = [ids[i][valid[i]].tolist() for i in range(len(ids))]
        return (list(self.tokenizer.batch_decode(id_lists, skip_special_tokens=True)) if id_lists else []), valid

    @staticmethod
    def valid_mask(response_mask: torch.Tensor) -> torch.Tensor:
        """``response_mask`` as a CPU bool tensor; a ValueError unless it holds only 0 and 1."""
        valid = response_mask.detach().cpu()
        if not bool(((valid == 0) | (valid == 1)).all()):
            raise ValueError("response_mask must contain only 0 and 1")
        return valid.bool()

    def _results(self, responses: list[str], data_sources: Sequence[str], ground_truths: Sequence[Any],
                 extra_infos: Sequence[Any]) -> list[tuple[RewardFn, Any]]:
        """(function, result) of each response: one call a response, or one for the batch (BatchRewardFn)."""
        if isinstance(self.reward_fn, BatchRewardFn):
            if not responses:
                return []
            fn = self.reward_fn
            name = _fn_name(fn.fn)
            try:
                results = fn.score_batch(list(data_sources), responses, list(ground_truths), list(extra_infos))
            except Exception as exc:
                if isinstance(exc, TypeError) and str(exc).startswith("batch reward function"):
                    raise BadRewardResult(str(exc), name) from exc  # BatchRewardFn's check of the list returned
                raise RewardFunctionFailed(f"batch reward function {name!r} failed on a batch of {len(responses)}: "
                                           f"{type(exc).__name__}: {exc}", name) from exc
            return [(fn.fn, result) for result in results]
        out = []
        for i, data_source in enumerate(data_sources):
            try:
                fn = self._fn_for(data_source)
            except UnknownDataSourceError as exc:
                raise UnknownDataSourceError(f"sample {i}: {exc}") from None
            try:
                result = awaited(fn(
                    data_source=data_source,
                    solution_str=responses[i],
                    ground_truth=ground_truths[i],
                    extra_info=extra_infos[i],
                ))
            except Exception as exc:
                name = _fn_name(fn)
                index = extra_infos[i].get("index") if isinstance(extra_infos[i], dict) else None
                problem = f", extra_info.index={index!r}" if index is not None else ""
                raise RewardFunctionFailed(
                    f"reward function {name!r} failed on sample {i} "
                    f"(data_source={data_source!r}{problem}): {type(exc).__name__}: {exc}", name, i, data_source
                ) from exc
            out.append((fn, result))
        return out

    def _unpack(self, result: Any, index: int, data_source: str, fn: RewardFn) -> RewardResult:
        """One reward result read (:func:`read_reward_result`, as the reference check reads it); what it refuses
        raised as a :class:`BadRewardResult` or :class:`NonFiniteReward` naming the function and the sample."""
        try:
            return read_reward_result(result, self.full_score)
        except RewardResultError as exc:
            name = _fn_name(fn)
            kind = NonFiniteReward if isinstance(exc, NotFinite) else BadRewardResult
            raise kind(f"reward function {name!r} returned {exc.returned} for sample {index} "
                       f"(data_source={data_source!r}); {exc.advice}", name, index, data_source) from None
