"""Guards: what the trainer does when a run goes wrong, decided step by step.

:class:`Guard` watches every step's metrics and every validation and answers with a
:class:`GuardEvent` when a limit of ``trainer.guard`` is crossed; the trainer carries
the event out (restore a checkpoint, adjust the KL control, stop). Three guards:

non-finite steps
    A step whose loss or gradient was not finite is skipped by the workers (no
    optimizer step). After ``max_consecutive_skips`` such steps in a row the run
    restores the anchor of the streak (below), marks it latest and stops with a
    :class:`GuardError`: the cause (data, reward, learning rate) needs a person.
KL explosion
    The measured KL is the largest of ``actor/ppo_kl``, ``actor/reward_kl_penalty``
    and ``actor/kl_loss`` (per token) present in the step's metrics (a non-finite value counts as
    above any limit). After ``patience`` consecutive steps above ``max_kl`` the run
    restores the anchor of the streak and tightens the KL control
    (:func:`tighten_kl_control` says how; the trainer applies it), then continues.
validation drop
    When the validation accuracy falls more than ``max_val_drop`` below the best seen,
    the run restores the checkpoint of the best validation and continues. So that one
    exists, the trainer saves a checkpoint whenever a validation sets a new best.

A rollback restores the weights and the optimizer moments of the checkpoint; the step
counter, the LR schedule, the data order and the random streams carry on, so the run
sees new batches instead of replaying the ones that led it astray. Each rollback is
counted (``training/rollbacks``); once ``max_rollbacks`` have been made, the next
trigger restores its checkpoint and stops the run with a :class:`GuardError`.

A streak's anchor is the newest checkpoint of weights not known to be bad. A non-finite streak
from step k restores a checkpoint of step k-2 or earlier: the checkpoint of step k-1 holds the
very weights whose gradient was not finite (a skipped step changes nothing), which may be what
fails (a learning rate too high wrecks the weights with a finite gradient, and the next step's
gradient is not finite). A KL streak from step k does the same where the KL of step k-1's
weights to the reference (``actor/reward_kl_penalty``, ``actor/kl_loss``) was over the limit,
and restores step k-1 or earlier where only step k's own update moved too far (``actor/ppo_kl``).
Right after a rollback at step G to step S, step G+1 runs on S's weights: its suspect weights are S's, and
such a streak restores a checkpoint before S (:meth:`Guard.weights_of`), not S again.

After a rollback to step S, by any guard (the over-optimisation guard's below included), no guard
targets a step after S: those checkpoints hold the weights the rollback abandoned. Each guard forgets
them (:meth:`Guard.on_restore`, :meth:`OverOptimisationGuard.on_restore`): a streak under way ends, and
a best validation after S gives way to S's own validation where one was seen, else to none, so that the
next validation sets a new best and the trainer checkpoints it. For this each guard keeps the scores of
the validations at saved steps (in its ``state_dict``; a checkpoint without them clears the best instead).
The checkpoint the trainer writes right after a rollback (at the step G the run had reached) holds S's weights,
so it takes S's scores: a later rollback to G finds S's validation there.
A resume replaces a best whose checkpoint is not among those it can restore with the best validated one that is
(:meth:`Guard.keep_restorable`).

The checkpoints a guard may still need (the best one, the anchor while a streak is running,
and, while the non-finite or KL guard is on, the one before the latest: the anchor of a
streak that starts at the next step) are reported by :meth:`Guard.protected_steps` and never
pruned.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from rlhf_core.algos import AdaptiveKLController, FixedKLController
from rlhf_core.config import GuardConfig, PPOConfig

KL_METRICS = ("actor/ppo_kl", "actor/reward_kl_penalty", "actor/kl_loss")
#: read in place of ``actor/kl_loss`` where the step has it: verl's ``actor/kl_loss`` is aggregated as the
#: loss is, with ``loss_agg_mode=seq-mean-token-sum`` a sum over each response's tokens, not a KL per token
KL_LOSS_TOKEN_MEAN = "actor/kl_loss_token_mean"
# of the weights the step started from
KL_TO_REFERENCE = ("actor/reward_kl_penalty", "actor/kl_loss", KL_LOSS_TOKEN_MEAN)
KL_LOSS_COEF_FACTOR = 2.0  # a KL rollback with actor.use_kl_loss multiplies kl_loss_coef by this
LR_FACTOR = 0.5  # a KL rollback with no KL term at all multiplies the actor learning rate by this
MIN_ADAPTIVE_KL_COEF = 1e-3  # an adaptive controller cannot grow from a zero coefficient


class GuardError(RuntimeError):
    """A guard stopped the run; the message says what happened and what was restored."""


class TrainingInterrupted(Exception):
    """Ctrl-C or SIGTERM stopped the run between steps (after saving a checkpoint when asked to)."""

    def __init__(self, signal_name: str, signal_number: int, step: int, checkpoint: str | None,
                 rerun: str = "rerun the same command"):
        self.signal_name, self.signal_number, self.step, self.checkpoint = signal_name, signal_number, step, checkpoint
        saved = f"checkpoint saved at {checkpoint}; {rerun} to resume" if checkpoint else "no checkpoint saved"
        super().__init__(f"interrupted by {signal_name} after step {step}: {saved}")


@dataclass
class GuardEvent:
    """What a guard asks the trainer to do.

    ``action`` is ``rollback`` (restore ``target_step`` and continue) or ``stop`` (restore
    ``target_step`` when there is one, then raise). ``target_step`` is None when no checkpoint
    was saved early enough to restore.
    """

    kind: str  # non_finite | kl_explosion | val_drop | over_optimisation
    action: str  # rollback | stop
    target_step: int | None
    message: str


def best_validated(validated: Mapping[int, object], score) -> tuple[int, object] | None:
    """The (step, validation) of ``validated`` whose ``score(validation)`` is highest, the earliest step among
    equals (the one a run that saw them in order kept as its best); None where there are none."""
    return max(validated.items(), key=lambda item: (score(item[1]), -item[0]), default=None)


def measured_kl(metrics: Mapping[str, float]) -> float | None:
    """The step's KL: the largest of :data:`KL_METRICS` present (the KL loss per token,
    :data:`KL_LOSS_TOKEN_MEAN`, where the step has it); ``inf`` when one is not finite; None when there is
    none. The KL guard, the console warnings and the Prometheus gauge all read this one."""
    per_token = metrics.get(KL_LOSS_TOKEN_MEAN) is not None
    keys = [KL_LOSS_TOKEN_MEAN if key == "actor/kl_loss" and per_token else key for key in KL_METRICS]
    values = [float(metrics[k]) for k in keys if k in metrics and metrics[k] is not None]
    if not values:
        return None
    return max(v if math.isfinite(v) else math.inf for v in values)


class Guard:
    """The state of the three guards; ``state_dict`` goes into every checkpoint."""

    def __init__(self, config: GuardConfig):
        self.config = config
        self.consecutive_skips = 0
        self.skip_anchor: int | None = None  # the current skip streak's anchor (see the module's note)
        self.kl_streak = 0
        self.kl_anchor: int | None = None  # the current KL streak's anchor
        self.best_val: float | None = None
        self.best_step: int | None = None
        self.rollbacks = 0
        self.saved: list[int] = []  # the steps of the checkpoints saved (or found at a resume), in order
        #: the accuracy of each validation at a step in ``saved`` (and of those since the last save): what a
        #: rollback's weights scored, which becomes the best when the rollback abandons the best's weights
        self.validated: dict[int, float] = {}
        #: after a rollback at step G to S: G -> S, the step whose weights the run went on from after step G
        self.went_on_from: dict[int, int] = {}

    # ------------------------------------------------------------------ observations
    def on_checkpoint(self, step: int) -> None:
        """A checkpoint of ``step`` now exists (a rollback's later saves replace newer ones)."""
        self.saved = [s for s in self.saved if s < step] + [step]
        self.validated = {s: v for s, v in self.validated.items() if s in self.saved}

    def on_restore(self, step: int, at: int | None = None) -> None:
        """A rollback (any guard's) restored the checkpoint of ``step``: the checkpoints saved after it hold the
        weights it abandoned, so no later rollback may target them (the next save follows ``step``). A streak
        under way ends here too: its steps ran on the abandoned weights, and its anchor may be one of their
        checkpoints (a KL streak that a validation drop interrupts would restore the weights it left). So are
        the validations after ``step``: a best among them gives way to ``step``'s own validation, or to none where
        it was not validated (the next validation then sets it, and the trainer checkpoints it). Not to an
        earlier best: the checkpoint of one that a later best replaced may have been pruned.

        ``at``: the step the run has reached, whose checkpoint (the rollback's re-save) will hold ``step``'s
        weights: it is given ``step``'s validation, so that a rollback to it later finds that score."""
        self.saved = [s for s in self.saved if s <= step]
        self.consecutive_skips, self.skip_anchor = 0, None
        self.kl_streak, self.kl_anchor = 0, None
        self.validated = {s: v for s, v in self.validated.items() if s <= step}
        self.went_on_from = {s: w for s, w in self.went_on_from.items() if s <= step}
        if at is not None:
            self.went_on_from[at] = self.weights_of(step)
        if at is not None and step in self.validated:
            self.validated[at] = self.validated[step]
        if self.best_step is not None and self.best_step > step:
            self.best_step = step if step in self.validated else None
            self.best_val = self.validated.get(step)

    def keep_restorable(self, saved: list[int]) -> None:
        """At a resume: ``saved`` are the checkpoints the run can restore (its own, whole beside the one loaded).
        A best among the others (a rollback could not restore it; a checkpoint from before the rule of
        :meth:`on_restore` may name one a rollback abandoned) gives way to the best of the validations kept, or to
        none, and their validations are dropped; a streak's anchor among them gives way to the newest restorable
        checkpoint before it (:meth:`anchor`)."""
        self.saved = list(saved)
        self.validated = {s: v for s, v in self.validated.items() if s in self.saved}
        if self.best_step is not None and self.best_step not in self.saved:
            kept = best_validated(self.validated, lambda accuracy: accuracy)
            self.best_step, self.best_val = kept if kept else (None, None)
        # a streak under way keeps going, anchored on the newest checkpoint it can restore at or before its own
        self.skip_anchor = self.anchor(self.skip_anchor) if self.skip_anchor is not None else None
        self.kl_anchor = self.anchor(self.kl_anchor) if self.kl_anchor is not None else None

    def weights_of(self, step: int) -> int:
        """The step whose weights the run held after ``step``: ``step`` itself, or after a rollback at ``step`` the
        step it restored (followed back where that was itself a rollback's)."""
        while step in self.went_on_from:
            step = self.went_on_from[step]
        return step

    def anchor(self, last_good: int) -> int | None:
        """The newest checkpoint of step ``last_good`` or earlier."""
        return next((s for s in reversed(self.saved) if s <= last_good), None)

    def observe_step(self, step: int, metrics: Mapping[str, float], skipped: bool) -> GuardEvent | None:
        """Check one finished step; ``skipped`` is True when any of its updates was skipped."""
        cfg = self.config
        suspect = self.weights_of(step - 1)  # the weights this step ran on
        if skipped:
            if self.consecutive_skips == 0:
                self.skip_anchor = self.anchor(suspect - 1)
            self.consecutive_skips += 1
            if cfg.max_consecutive_skips is not None and self.consecutive_skips >= cfg.max_consecutive_skips:
                target = self.skip_anchor
                return GuardEvent(
                    "non_finite", "stop", target,
                    f"{self.consecutive_skips} consecutive steps (up to step {step}) had a non-finite loss or "
                    f"gradient and were skipped (trainer.guard.max_consecutive_skips="
                    f"{cfg.max_consecutive_skips}); check the rewards and the data for NaN/inf and lower the "
                    "learning rate (actor_rollout_ref.actor.optim.lr and critic.optim.lr may change on a resume)")
        else:
            self.consecutive_skips, self.skip_anchor = 0, None

        kl = measured_kl(metrics)
        if cfg.max_kl is not None and kl is not None and not kl <= cfg.max_kl:
            if self.kl_streak == 0:
                before = measured_kl({k: v for k, v in metrics.items() if k in KL_TO_REFERENCE})
                self.kl_anchor = self.anchor(suspect - 1 if before is not None and not before <= cfg.max_kl
                                             else step - 1)
            self.kl_streak += 1
            if self.kl_streak >= cfg.patience:
                target = self.kl_anchor
                reason = (f"KL {kl:.4g} > trainer.guard.max_kl={cfg.max_kl} for {self.kl_streak} consecutive "
                          f"steps (up to step {step})")
                self.kl_streak, self.kl_anchor = 0, None
                return self._rollback("kl_explosion", target, reason)
        else:
            self.kl_streak, self.kl_anchor = 0, None
        return None

    def observe_validation(self, step: int, accuracy: float | None) -> tuple[bool, GuardEvent | None]:
        """Check a validation; returns (new best that needs a checkpoint at ``step``, event)."""
        cfg = self.config
        if accuracy is None or cfg.max_val_drop is None:
            return False, None
        self.validated[step] = float(accuracy)
        if self.best_val is None or accuracy > self.best_val:
            self.best_val, self.best_step = float(accuracy), step
            return True, None
        if _exceeds(self.best_val - accuracy, cfg.max_val_drop):
            reason = (f"validation accuracy fell from the best {self.best_val:.4g} (step {self.best_step}) to "
                      f"{accuracy:.4g} at step {step}: a drop of {self.best_val - accuracy:.4g} > "
                      f"trainer.guard.max_val_drop={cfg.max_val_drop}")
            return False, self._rollback("val_drop", self.best_step, reason)
        return False, None

    def _rollback(self, kind: str, target: int | None, reason: str) -> GuardEvent:
        if self.rollbacks >= self.config.max_rollbacks:
            return GuardEvent(kind, "stop", target,
                              f"{reason}; the run already rolled back {self.rollbacks} time(s) "
                              f"(trainer.guard.max_rollbacks={self.config.max_rollbacks})")
        self.rollbacks += 1
        return GuardEvent(kind, "rollback", target, reason)

    # ------------------------------------------------------------------ checkpoints
    def protected_steps(self, saving: int | None = None) -> set[int]:
        """Checkpoints a guard may restore later: never prune these. ``saving``: the step whose checkpoint is
        being written (pruning runs before :meth:`on_checkpoint` records it), so that the one before it is kept."""
        saved = self.saved if saving is None else [s for s in self.saved if s < saving] + [saving]
        streaks_watched = self.config.max_consecutive_skips is not None or self.config.max_kl is not None
        next_anchors: set[int | None] = set()
        if streaks_watched and saved:
            # a streak from the next step restores the one before the latest or, where the latest is a rollback's
            # re-save, the one before the weights it holds
            held = self.weights_of(saved[-1])
            next_anchors = {saved[-2] if len(saved) >= 2 else None, next((s for s in reversed(saved) if s < held), None)}
        return {s for s in (self.best_step, self.skip_anchor, self.kl_anchor, *next_anchors) if s is not None}

    def state_dict(self) -> dict:
        return {"consecutive_skips": self.consecutive_skips, "skip_anchor": self.skip_anchor,
                "kl_streak": self.kl_streak, "kl_anchor": self.kl_anchor, "best_val": self.best_val,
                "best_step": self.best_step, "rollbacks": self.rollbacks, "saved": list(self.saved),
                "validated": [[step, accuracy] for step, accuracy in sorted(self.validated.items())],
                "went_on_from": [[step, restored] for step, restored in sorted(self.went_on_from.items())]}

    def load_state_dict(self, state: Mapping) -> None:
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self.skip_anchor = state.get("skip_anchor")
        self.kl_streak = int(state.get("kl_streak", 0))
        self.kl_anchor = state.get("kl_anchor")
        self.best_val = state.get("best_val")
        self.best_step = state.get("best_step")
        self.rollbacks = int(state.get("rollbacks", 0))
        # the steps this run saved before (older checkpoints have no list: none of their folder's is taken on
        # trust, as another run's may lie beside them)
        self.saved = [int(s) for s in state.get("saved", [])]
        # older checkpoints kept no validations but the best's
        self.validated = {int(step): float(accuracy) for step, accuracy in state.get("validated", [])}
        if self.best_step is not None:
            self.validated.setdefault(self.best_step, self.best_val)
        self.went_on_from = {int(step): int(restored) for step, restored in state.get("went_on_from", [])}


def _exceeds(drop: float, limit: float) -> bool:
    """Whether ``drop`` is more than ``limit``, a difference of accuracies that equals the limit counting as equal
    whatever its rounding (0.8 - 0.6 is 0.20000000000000007, 0.7 - 0.5 is 0.19999999999999996)."""
    return drop > limit and not math.isclose(drop, limit, rel_tol=1e-9, abs_tol=1e-12)


@dataclass
class KLTightening:
    """What a KL rollback changes; the trainer applies it (its KL controller, coefficient, learning rate)."""

    kl_ctrl: FixedKLController | AdaptiveKLController | None = None  # the controller to use from now on
    kl_loss_coef: float | None = None  # the new actor.kl_loss_coef
    lr_factor: float | None = None  # multiply the actor learning rate (and its schedule) by this
    summary: str = ""


def tighten_kl_control(config: PPOConfig, kl_ctrl, kl_loss_coef: float) -> KLTightening:
    """After a KL rollback, how to make the policy stay closer to where it was (reads, never writes, state).

    * KL in the reward (``algorithm.use_kl_in_reward``): a fixed controller becomes adaptive
      (Ziegler et al.) with ``trainer.guard.target_kl``, starting from the current coefficient
      (at least 1e-3); an adaptive one gets the lower of its target and ``target_kl`` (and a coefficient of at
      least 1e-3: one at 0 would stay there).
    * KL loss (``actor.use_kl_loss``): ``kl_loss_coef`` is doubled (there is no controller to adapt), from 1e-3 at
      least (twice 0 is 0).
    * Neither: the only lever left on ``actor/ppo_kl`` is the step size; the actor learning
      rate (its schedule included) is halved.
    """
    guard_cfg, kl_cfg = config.trainer.guard, config.algorithm.kl_ctrl
    decision, changes = KLTightening(), []
    if config.algorithm.use_kl_in_reward:
        if isinstance(kl_ctrl, AdaptiveKLController):
            target = min(kl_ctrl.target, guard_cfg.target_kl)
            decision.kl_ctrl = AdaptiveKLController(max(kl_ctrl.value, MIN_ADAPTIVE_KL_COEF), target, kl_ctrl.horizon)
            changes.append(f"adaptive KL controller target {target:.4g}")
        else:
            start = max(kl_ctrl.value, MIN_ADAPTIVE_KL_COEF)
            decision.kl_ctrl = AdaptiveKLController(start, guard_cfg.target_kl, kl_cfg.horizon)
            changes.append(f"KL controller fixed -> adaptive (target_kl {guard_cfg.target_kl}, coef {start:.4g})")
    if config.actor_rollout_ref.actor.use_kl_loss:
        decision.kl_loss_coef = max(kl_loss_coef, MIN_ADAPTIVE_KL_COEF) * KL_LOSS_COEF_FACTOR
        changes.append(f"actor kl_loss_coef -> {decision.kl_loss_coef:.4g}")
    if not changes:
        decision.lr_factor = LR_FACTOR
        changes.append(f"actor learning rate x{LR_FACTOR} (no KL term to tighten)")
    decision.summary = "; ".join(changes)
    return decision


def proxy_and_gold(metrics: Mapping[str, float]) -> tuple[float | None, float | None]:
    """The validation's proxy reward and gold reward (``val-aux/<source>/gold_reward/mean@n``, the rule), each the
    mean over the data sources that have a gold reward, both measured on the same responses. (None, None) unless
    there is such a pair (a run with a reward model and rows with a ground truth).

    The proxy is the reward model's score (``val-aux/<source>/rm_score/mean@n``), as in Gao et al.: PPO's reward
    adds ``reward_model.rule_coef`` times the rule's score, which falls with the gold, so a reward model rising
    while the gold falls can leave that sum flat. Without a model score (a custom reward function reporting its
    own gold) it is the reward, ``reward/mean@n``. A source whose prompts are only partly graded gives the proxy of
    its graded ones (``graded_rm_score``, ``graded_reward``); a source with none graded is left out of both."""
    found: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        if match := _VALIDATION_REWARD.fullmatch(key):
            found.setdefault(match[1], {})[match[2]] = value
    pairs = [(next((source[key] for key in _PROXIES if key in source), None), source["gold_reward"])
             for source in found.values() if "gold_reward" in source]
    pairs = [(proxy, gold) for proxy, gold in pairs if proxy is not None]
    if not pairs:
        return None, None
    return sum(p for p, _ in pairs) / len(pairs), sum(g for _, g in pairs) / len(pairs)


#: a source's validation reward (``reward``), the reward model's score (``rm_score``), each of its graded responses
#: alone, and its gold reward
_VALIDATION_REWARD = re.compile(r"val-aux/(.+)/(reward|graded_reward|rm_score|graded_rm_score|gold_reward)/mean@\d+")
#: the proxy of a source: the first of these it logs
_PROXIES = ("graded_rm_score", "rm_score", "graded_reward", "reward")


class OverOptimisationGuard:
    """Reward-model over-optimisation (Gao et al. 2022, "Scaling laws for reward model overoptimization").

    Past some distance from the start, a policy pushed up a learned (proxy) reward keeps raising it
    while the true (gold) reward turns down. At every validation that carries both, this guard
    compares them with the previous validation: after ``trainer.guard.overopt_patience`` validations
    in a row where the proxy rose and the gold fell, it asks for a rollback to the checkpoint of the
    best gold reward seen (``overopt_action=rollback``; the trainer also tightens the KL control, as
    after a KL explosion, so the policy drifts more slowly the next time) or a stop there
    (``overopt_action=stop``, or once ``max_rollbacks`` of its own have been made). So that the best
    gold checkpoint exists, :meth:`observe` reports each new best for the trainer to save.

    After any guard's rollback to step S (:meth:`on_restore`) the comparison goes on from what S's weights
    scored (with nothing where S was not validated) and the streak ends; a best gold after S (of weights the
    rollback abandoned) gives way to S's own, or to none (as :meth:`Guard.on_restore` says).
    """

    def __init__(self, config: GuardConfig):
        self.config = config
        self.streak = 0
        self.previous: tuple[float, float] | None = None  # (proxy, gold) of the last validation
        self.best_gold: float | None = None
        self.best_proxy: float | None = None
        self.best_step: int | None = None
        self.rollbacks = 0
        #: (proxy, gold) of each validation at a checkpointed step (and of those since the last save)
        self.validated: dict[int, tuple[float, float]] = {}

    def observe(self, step: int, proxy: float | None, gold: float | None) -> tuple[bool, GuardEvent | None]:
        """Check one validation; returns (a new best gold that needs a checkpoint at ``step``, event)."""
        cfg = self.config
        if cfg.overopt_patience is None or proxy is None or gold is None:
            return False, None
        self.validated[step] = (float(proxy), float(gold))
        new_best = self.best_gold is None or gold > self.best_gold
        if new_best:
            self.best_gold, self.best_proxy, self.best_step = float(gold), float(proxy), step
        diverging = self.previous is not None and proxy > self.previous[0] and gold < self.previous[1]
        self.streak = self.streak + 1 if diverging else 0
        self.previous = (float(proxy), float(gold))
        if self.streak < cfg.overopt_patience or self.best_step == step:
            # (a best gold at this very step: no earlier checkpoint scored better, and this one is not saved yet;
            # the trainer saves it now, so a divergence that goes on rolls back to it)
            return new_best, None
        reason = (f"reward over-optimisation: the proxy (reward model) reward rose while the gold (rule) reward "
                  f"fell for {self.streak} validations in a row (up to step {step}: proxy {proxy:.4g}, gold "
                  f"{gold:.4g}; best gold {self.best_gold:.4g} at step {self.best_step}; "
                  f"trainer.guard.overopt_patience={cfg.overopt_patience})")
        self.streak = 0
        self.previous = (self.best_proxy, self.best_gold)  # what the restored policy scored
        if cfg.overopt_action == "stop":
            return False, GuardEvent("over_optimisation", "stop", self.best_step, reason)
        if self.rollbacks >= cfg.max_rollbacks:
            return False, GuardEvent("over_optimisation", "stop", self.best_step,
                                     f"{reason}; already rolled back {self.rollbacks} time(s) for this "
                                     f"(trainer.guard.max_rollbacks={cfg.max_rollbacks})")
        self.rollbacks += 1
        return False, GuardEvent("over_optimisation", "rollback", self.best_step, reason)

    def on_restore(self, step: int, at: int | None = None) -> None:
        """A rollback (any guard's) restored the checkpoint of ``step``: the next validation is compared with
        what ``step``'s weights scored (with nothing where they were not validated), a streak under way ends,
        and a best gold after ``step`` gives way to ``step``'s own (or to none: the next validation sets it, and
        the trainer checkpoints it). ``at``: the step whose checkpoint will hold ``step``'s weights (the
        rollback's re-save), given ``step``'s scores as in :meth:`Guard.on_restore`."""
        self.validated = {s: scores for s, scores in self.validated.items() if s <= step}
        self.streak, self.previous = 0, self.validated.get(step)
        if at is not None and self.previous is not None:
            self.validated[at] = self.previous
        if self.best_step is not None and self.best_step > step:
            self.best_step = step if self.previous is not None else None
            self.best_proxy, self.best_gold = self.previous or (None, None)

    def keep_restorable(self, saved: list[int]) -> None:
        """``saved``: the checkpoints a rollback can restore (:attr:`Guard.saved`, after each save and at a resume).
        The validations of other steps are dropped, and a best gold among them (at a resume, one not whole beside
        the checkpoint loaded, or one a rollback abandoned before :meth:`on_restore`'s rule) gives way to the best
        of the validations kept, or to none."""
        self.validated = {s: scores for s, scores in self.validated.items() if s in saved}
        if self.best_step is not None and self.best_step not in saved:
            kept = best_validated(self.validated, lambda scores: scores[1])  # (proxy, gold): by gold
            self.best_step, (self.best_proxy, self.best_gold) = (kept[0], kept[1]) if kept else (None, (None, None))

    def protected_steps(self) -> set[int]:
        """The best-gold checkpoint: never prune it."""
        return {self.best_step} if self.best_step is not None else set()

    def state_dict(self) -> dict:
        return {"streak": self.streak, "previous": list(self.previous) if self.previous else None,
                "best_gold": self.best_gold, "best_proxy": self.best_proxy, "best_step": self.best_step,
                "rollbacks": self.rollbacks,
                "validated": [[step, *scores] for step, scores in sorted(self.validated.items())]}

    def load_state_dict(self, state: Mapping) -> None:
        self.streak = int(state.get("streak", 0))
        previous = state.get("previous")
        self.previous = (float(previous[0]), float(previous[1])) if previous else None
        self.best_gold, self.best_proxy = state.get("best_gold"), state.get("best_proxy")
        self.best_step = state.get("best_step")
        self.rollbacks = int(state.get("rollbacks", 0))
        # older checkpoints kept no validations but the best's
        self.validated = {int(step): (float(proxy), float(gold)) for step, proxy, gold in state.get("validated", [])}
        if self.best_step is not None:
            self.validated.setdefault(self.best_step, (self.best_proxy, self.best_gold))
