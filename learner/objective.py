"""Training objectives on the policy's own tokens: binary RL, hindsight OPD, and their sum.

Each sample is one recorded model action. Two signals from its next state become two losses
on the same response tokens, both a clipped policy gradient against the behaviour log-probs
that serving recorded:

- *evaluative* (binary RL): the judge's score in {-1, 0, +1}, minus a running baseline, is one
  advantage for every token of the response;
- *directive* (hindsight on-policy distillation): the same policy, shown the judge's hint,
  is the teacher; ``logp_teacher(a_t) - logp_student(a_t)`` is a per-token advantage that
  says which tokens the hint makes more or less likely.

This follows OpenClaw-RL ("Train Any Agent Simply by Talking", Wang et al. 2026), with
DAPO's asymmetric clip (0.2 / 0.28). Where it departs:

- the RL advantage is ``score - baseline`` with a per-scope running baseline (turns arrive
  one at a time, so there is no group to normalise over), where the paper uses ``A = r``;
  because of the baseline, score-0 samples are masked out rather than left at ``A = 0``;
- the OPD advantage is clamped to ``[-advantage_clip, advantage_clip]``: one token the hint
  makes near-certain would otherwise dominate the step;
- ``Combined`` sums two losses, each a token mean over its own samples, where the paper
  mixes the advantages into one; an optional k3 KL to the base model (adapter off) is added.

Everything here is a pure function of tensors; the trainer computes the log-probs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch


@dataclass
class TokenBatch:
    """A padded batch of recorded actions, as log-probs of their response tokens."""

    logp: torch.Tensor  # [B, T] current policy, requires grad
    old_logp: torch.Tensor  # [B, T] behaviour log-probs recorded at serving time
    mask: torch.Tensor  # [B, T] 1.0 on real response tokens, 0.0 on padding
    scores: torch.Tensor  # [B] judge scores in {-1, 0, +1}
    baseline: float  # running baseline of the adapter scope
    teacher_logp: torch.Tensor | None = None  # [B, T] same policy with the hint, no grad
    has_hint: torch.Tensor | None = None  # [B] bool
    ref_logp: torch.Tensor | None = None  # [B, T] base model (adapter disabled), no grad
    # whole next-token distributions, for objectives that need them (``needs_distributions``)
    student_dist: torch.Tensor | None = None  # [B, T, V] log-softmax of the current policy, requires grad
    teacher_dist: torch.Tensor | None = None  # [B, T, V] log-softmax of the hinted teacher, no grad
    # the hinted teacher's own action, for objectives that learn it (``needs_teacher_actions``)
    action_logp: torch.Tensor | None = None  # [B, A] the current policy's log-probs of it, requires grad
    action_mask: torch.Tensor | None = None  # [B, A] 1.0 on its tokens; an all-zero row: no action to learn
    # the response tokens the evaluative signal scores; None: all of them (see :func:`blamed_tokens`)
    rl_mask: torch.Tensor | None = None  # [B, T]


class Objective(Protocol):
    def loss(self, batch: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """(scalar loss to call backward on, python-float stats for logs)."""
        ...

    def reads(self, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Which rows of ``batch.logp`` (and ``student_dist``) and which of ``batch.action_logp`` the loss and its
        statistics read, [B] bool each; the others may hold anything. Every loss here is a sum of one term per
        token over denominators that count tokens, not values, so a row's gradient is the same whatever the
        other rows hold: the trainer reads each row it needs once, with its graph, a few at a time."""
        ...


def _no_rows(batch: TokenBatch) -> torch.Tensor:
    return torch.zeros(batch.mask.shape[0], dtype=torch.bool, device=batch.mask.device)  # [B]


def _hinted_rows(batch: TokenBatch, present: torch.Tensor | None) -> torch.Tensor:
    if present is None or batch.has_hint is None:
        return _no_rows(batch)
    return batch.has_hint & batch.mask.bool().any(-1)  # [B]


def _token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)  # []


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> torch.Tensor:
    """PPO/DAPO clipped policy-gradient loss, token mean over ``mask``.

    ``ratio = exp(logp - old_logp)``; ``loss_t = -min(ratio * A_t, clip(ratio, 1 - clip_low,
    1 + clip_high) * A_t)``. ``advantages`` broadcasts to [B, T] ([B, 1] for one advantage per
    sequence). The ratio is taken against the behaviour log-probs that serving recorded, so
    the same clip that bounds the step also bounds how far a stale sample (generated by an
    older adapter) can move the policy. Padding is kept out of ``exp`` so that whatever the
    recorder left there cannot turn the loss or its gradient into NaN.
    """
    log_ratio = torch.where(mask > 0, logp - old_logp, torch.zeros_like(logp))  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    unclipped = ratio * advantages  # [B, T]
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages  # [B, T]
    return _token_mean(-torch.minimum(unclipped, clipped), mask)  # []


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(policy || ref): ``exp(ref - logp) - (ref - logp) - 1``, token mean; >= 0."""
    diff = torch.where(mask > 0, ref_logp - logp, torch.zeros_like(logp))  # [B, T]
    return _token_mean(torch.exp(diff) - diff - 1.0, mask)  # []


def opd_advantages(teacher_logp: torch.Tensor, logp: torch.Tensor, clip: float) -> torch.Tensor:
    """Per-token hindsight advantage ``teacher_logp - logp`` (student detached), in [-clip, clip]."""
    return (teacher_logp - logp.detach()).clamp(-clip, clip)  # [B, T]


def blamed_tokens(response: Sequence[int], action: Sequence[int] | None, unhinted: bool = True) -> list[float]:
    """Which tokens of a wrong ``response`` the evaluative signal should push down, given the
    ``action`` the hinted teacher wrote instead: the span between the prefix and the suffix the two
    share (1.0 there, 0.0 elsewhere); without an action, all of them when ``unhinted``, else none.

    A -1 says the action was wrong, not which tokens: pushed down whole, ``add_note(text=...,
    list_name="inbox", kind="todo")`` would lose the markup, the tool's name and the ``kind`` it got
    right with the one list name it got wrong. The hindsight action names the tokens that had to
    change; the rest were what the teacher would write too. Without one (a hint that names nothing,
    "That's wrong." or "The user had to ask again", or a teacher that wrote what the student did)
    nothing says where the mistake was: "Add order new glasses to my errands list." answered with
    ``add_note(text="new glasses", list_name="errands")``, then "That's wrong.", pushes down the list
    the request named with the text it cut short (bench/results/RUNS.md, stop 65: the same arm later
    put "Put buy milk on the reminders list." on ``todo``; a candidate cause, not measured). With
    ``unhinted`` off (``learner.objective.blame_unhinted: false``; on by default until a bench run
    measures it off) such a -1 teaches nothing."""
    if action is None:
        return [1.0 if unhinted else 0.0] * len(response)
    head = 0
    while head < min(len(response), len(action)) and response[head] == action[head]:
        head += 1
    tail = 0
    while tail < min(len(response), len(action)) - head and response[-1 - tail] == action[-1 - tail]:
        tail += 1
    return [1.0 if head <= i < len(response) - tail else 0.0 for i in range(len(response))]


def _zero_loss(logp: torch.Tensor) -> torch.Tensor:
    # Still connected to the graph, so the trainer can call backward on every batch.
    return (logp * 0.0).sum()  # []


def _policy_gradient(
    name: str,
    batch: TokenBatch,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    loss = clipped_surrogate(batch.logp, batch.old_logp, advantages, mask, clip_low, clip_high)  # []
    with torch.no_grad():
        log_ratio = torch.where(mask > 0, batch.logp - batch.old_logp, torch.zeros_like(batch.logp))  # [B, T]
        ratio = torch.exp(log_ratio)  # [B, T]
        adv = torch.broadcast_to(advantages, ratio.shape)  # [B, T]
        # Tokens whose gradient the clip removed: above the ceiling going up, below the floor going down.
        clipped = ((ratio > 1.0 + clip_high) & (adv > 0)) | ((ratio < 1.0 - clip_low) & (adv < 0))  # [B, T]
        stats = {
            "ratio_mean": float(_token_mean(ratio, mask)),
            "clip_frac": float(_token_mean(clipped.to(mask.dtype), mask)),
            "adv_mean": float(_token_mean(adv, mask)),
            "tokens": float(mask.sum()),
        }
    value = float(loss.detach())
    return loss, {"loss": value, name: value, **stats}


_EMPTY_STATS = {"ratio_mean": 0.0, "clip_frac": 0.0, "adv_mean": 0.0, "tokens": 0.0}


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")


@dataclass(frozen=True)
class BinaryRL:
    """Evaluative signal: one advantage ``score - baseline`` for every token of a response.

    Score-0 samples are masked out, not given ``A = 0``: with a baseline their advantage would
    be ``-baseline``, which would punish (or reward) an action the judge could not evaluate.

    ``negative_weight`` scales the advantages below zero. A -1 says the action was wrong but
    not which of its tokens: pushed down whole, a wrong tool call loses its format with its
    value (the call markup, the tool's name), and a hint, where there is one, already teaches the
    right action token by token. 1.0 is the plain policy gradient; 0.0 learns from successes only.
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    negative_weight: float = 1.0
    blame_unhinted: bool = True  # with a hindsight action: a -1 without one pushes down its whole response

    def __post_init__(self) -> None:
        _check_clip(self.clip_low, self.clip_high)
        if not 0.0 <= self.negative_weight <= 1.0:
            raise ValueError(f"negative_weight must be in [0, 1], got {self.negative_weight}")

    def loss(self, batch: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        scored = batch.scores != 0  # [B]
        if not bool(scored.any()):
            return _zero_loss(batch.logp), {"loss": 0.0, "rl_loss": 0.0, **_EMPTY_STATS}
        mask = batch.mask * scored.to(batch.mask.dtype)[:, None]  # [B, T]
        if batch.rl_mask is not None:
            mask = mask * batch.rl_mask  # [B, T]
        advantages = (batch.scores.to(batch.logp.dtype) - batch.baseline)[:, None]  # [B, 1]
        advantages = torch.where(advantages < 0, advantages * self.negative_weight, advantages)  # [B, 1]
        return _policy_gradient("rl_loss", batch, advantages, mask, self.clip_low, self.clip_high)

    def reads(self, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        mask = batch.mask if batch.rl_mask is None else batch.mask * batch.rl_mask  # [B, T]
        return (batch.scores != 0) & mask.bool().any(-1), _no_rows(batch)


@dataclass(frozen=True)
class HindsightOPD:
    """Directive signal: the policy with the hint in its context teaches the policy without it.

    Only samples with a hint contribute; the teacher's log-probs of the other samples are
    ignored whatever they hold.
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    advantage_clip: float = 5.0

    def __post_init__(self) -> None:
        _check_clip(self.clip_low, self.clip_high)
        if self.advantage_clip <= 0.0:
            raise ValueError(f"advantage_clip must be > 0, got {self.advantage_clip}")

    def loss(self, batch: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        hinted = batch.has_hint
        if batch.teacher_logp is None or hinted is None or not bool(hinted.any()):
            return _zero_loss(batch.logp), {"loss": 0.0, "opd_loss": 0.0, **_EMPTY_STATS}
        mask = batch.mask * hinted.to(batch.mask.dtype)[:, None]  # [B, T]
        advantages = opd_advantages(batch.teacher_logp, batch.logp, self.advantage_clip)  # [B, T]
        advantages = torch.where(mask > 0, advantages, torch.zeros_like(advantages))  # [B, T]
        return _policy_gradient("opd_loss", batch, advantages, mask, self.clip_low, self.clip_high)

    def reads(self, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return _hinted_rows(batch, batch.teacher_logp), _no_rows(batch)


@dataclass(frozen=True)
class HindsightDistillation:
    """Directive signal, whole distributions: at every position of the response the policy
    moves toward the hinted teacher's next-token distribution, ``KL(teacher || student)``.

    :class:`HindsightOPD` scores only the tokens the student sampled: where the student wrote
    ``Paris`` and the hint says Lisbon it pushes ``Paris`` down, but says nothing about where the
    mass should go. The full distribution names ``Lisbon`` at that position, so one corrected
    action teaches the right value, not just that the sampled one was wrong. Positions are the
    student's own (on-policy, as in GKD); only samples with a hint contribute.
    """

    needs_distributions = True

    def loss(self, batch: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        hinted = batch.has_hint
        if batch.teacher_dist is None or batch.student_dist is None or hinted is None or not bool(hinted.any()):
            return _zero_loss(batch.logp), {"loss": 0.0, "opd_loss": 0.0, **_EMPTY_STATS}
        mask = batch.mask * hinted.to(batch.mask.dtype)[:, None]  # [B, T]
        teacher = batch.teacher_dist  # [B, T, V]
        kl = (teacher.exp() * (teacher - batch.student_dist)).sum(-1)  # [B, T]
        kl = torch.where(mask > 0, kl, torch.zeros_like(kl))  # [B, T]: padding rows hold anything
        loss = _token_mean(kl, mask)  # []
        with torch.no_grad():
            agree = (teacher.argmax(-1) == batch.student_dist.argmax(-1)).to(mask.dtype)  # [B, T]
            stats = {"ratio_mean": 1.0, "clip_frac": 0.0, "adv_mean": float(_token_mean(agree, mask)),
                     "tokens": float(mask.sum())}  # adv_mean here: share of positions where both pick the same token
        value = float(loss.detach())
        return loss, {"loss": value, "opd_loss": value, **stats}

    def reads(self, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return _hinted_rows(batch, batch.teacher_dist), _no_rows(batch)


@dataclass(frozen=True)
class HindsightAction:
    """Directive signal, the teacher's own action: the policy with the hint in its context
    writes the action it would have taken (greedy), and the policy without the hint learns to
    write it, ``-log p_student(teacher action | prompt)`` (context distillation).

    The other two forms score the *student's* positions: on a 135M model a wrong value
    ("Tokyo") pushed down token by token does not become the right one, and a sequence-level
    push on a tool call's format tokens wore the format away (the weights-only arm of ``whet
    bench learn`` fell from 0.33 to 0.00). The teacher's action names the right value in the
    right format, so one correction teaches the whole call. It departs from on-policy
    distillation in that the tokens are the teacher's, not the student's. A row whose teacher
    wrote nothing new (the same action as the student, or none) has an all-zero mask.
    """

    needs_teacher_actions = True
    # > 0: each pass also raises every teacher action against the other teacher actions of the step that call
    # the same tool with other values, on its own prompt (the trainer's contrast, LoraTrainer._contrast)
    contrast_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.contrast_weight < 0.0:
            raise ValueError(f"contrast_weight must be >= 0, got {self.contrast_weight}")

    def loss(self, batch: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        if batch.action_logp is None or batch.action_mask is None or not bool(batch.action_mask.any()):
            return _zero_loss(batch.logp), {"loss": 0.0, "opd_loss": 0.0, **_EMPTY_STATS}
        mask = batch.action_mask  # [B, A]
        loss = _token_mean(-batch.action_logp, mask)  # []
        with torch.no_grad():
            stats = {"ratio_mean": 1.0, "clip_frac": 0.0, "tokens": float(mask.sum()),
                     "adv_mean": float(_token_mean(batch.action_logp.exp(), mask))}  # adv_mean: mean p(teacher token)
        value = float(loss.detach())
        return loss, {"loss": value, "opd_loss": value, **stats}

    def reads(self, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        acted = _no_rows(batch) if batch.action_mask is None else batch.action_mask.bool().any(-1)  # [B]
        return _no_rows(batch), acted


@dataclass(frozen=True)
class Combined:
    """``rl_weight * rl + opd_weight * opd (+ kl_weight * k3 KL to the base model)``; the default."""

    rl: BinaryRL
    opd: HindsightOPD | HindsightDistillation | HindsightAction
    rl_weight: float = 1.0
    opd_weight: float = 1.0
    kl_weight: float = 0.0

    def __post_init__(self) -> None:
        if min(self.rl_weight, self.opd_weight, self.kl_weight) < 0.0:
            raise ValueError("rl_weight, opd_weight and kl_weight must be >= 0")

    @property
    def needs_distributions(self) -> bool:
        return getattr(self.opd, "needs_distributions", False)

    @property
    def needs_teacher_actions(self) -> bool:
        return getattr(self.opd, "needs_teacher_actions", False)

    @property
    def blame_unhinted(self) -> bool:
        return self.rl.blame_unhinted

    @property
    def contrast_weight(self) -> float:
        return getattr(self.opd, "contrast_weight", 0.0)

    def loss(self, batch: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        if self.kl_weight > 0.0 and batch.ref_logp is None:
            raise ValueError(
                f"kl_weight={self.kl_weight} needs ref_logp (base-model log-probs) in the batch; "
                "compute them with the adapter disabled, or set kl_weight to 0"
            )
        rl_loss, rl_stats = self.rl.loss(batch)
        opd_loss, opd_stats = self.opd.loss(batch)
        loss = self.rl_weight * rl_loss + self.opd_weight * opd_loss  # []
        stats = {"rl_loss": rl_stats["rl_loss"], "opd_loss": opd_stats["opd_loss"], "kl": 0.0}
        if batch.ref_logp is not None:
            kl = kl_penalty(batch.logp, batch.ref_logp, batch.mask)  # []
            stats["kl"] = float(kl.detach())
            if self.kl_weight > 0.0:
                loss = loss + self.kl_weight * kl  # []
        for prefix, part in (("rl", rl_stats), ("opd", opd_stats)):
            stats.update({f"{prefix}_{key}": part[key] for key in _EMPTY_STATS})
        return loss, {"loss": float(loss.detach()), **stats}

    def reads(self, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Both terms' rows, weighed at 0 or not (their statistics read them), and every row under the KL."""
        (rl, rl_acts), (opd, opd_acts) = self.rl.reads(batch), self.opd.reads(batch)
        every = batch.mask.bool().any(-1) if batch.ref_logp is not None else _no_rows(batch)  # [B]
        return rl | opd | every, rl_acts | opd_acts


_BUILDERS: dict[str, Callable[..., Objective]] = {
    "rl": lambda rl, opd, **_: rl,
    "opd": lambda rl, opd, **_: opd,
    "combined": lambda rl, opd, **weights: Combined(rl, opd, **weights),
}


_HINDSIGHT: dict[str, Callable[..., HindsightOPD | HindsightDistillation | HindsightAction]] = {
    "token": lambda contrast_weight=0.0, **kw: HindsightOPD(**kw),
    "distribution": lambda **_: HindsightDistillation(),
    "action": lambda contrast_weight=0.0, **_: HindsightAction(contrast_weight=contrast_weight),
}


def build_objective(
    kind: str,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    advantage_clip: float = 5.0,
    rl_weight: float = 1.0,
    opd_weight: float = 1.0,
    kl_weight: float = 0.0,
    hindsight: str = "token",
    rl_negative_weight: float = 1.0,
    blame_unhinted: bool = True,
    contrast_weight: float = 0.0,
) -> Objective:
    """The objective named by config: ``rl``, ``opd`` or ``combined``.

    ``hindsight``: how hints teach: ``token`` (:class:`HindsightOPD`, the sampled tokens' advantage),
    ``distribution`` (:class:`HindsightDistillation`, the whole next-token distribution) or
    ``action`` (:class:`HindsightAction`, the hinted teacher's own action).
    ``rl_negative_weight``: :class:`BinaryRL`'s scale on negative advantages; ``blame_unhinted``: whether a
    -1 with no hindsight action pushes down its whole response (:func:`blamed_tokens`); ``contrast_weight``:
    :class:`HindsightAction`'s contrast between teacher actions (``action`` only).

    The weights apply to ``combined`` only; a KL term with a single objective is
    ``combined`` with the other weight at 0, so ``kl_weight > 0`` elsewhere is refused
    rather than silently dropped.
    """
    if kind not in _BUILDERS:
        raise ValueError(f"unknown objective {kind!r}; valid: {', '.join(sorted(_BUILDERS))}")
    if kl_weight > 0.0 and kind != "combined":
        raise ValueError(f"kl_weight applies to objective 'combined' only, not {kind!r}")
    if hindsight not in _HINDSIGHT:
        raise ValueError(f"unknown hindsight form {hindsight!r}; valid: {', '.join(sorted(_HINDSIGHT))}")
    if contrast_weight > 0.0 and (hindsight != "action" or kind == "rl"):
        raise ValueError(f"contrast_weight contrasts hindsight actions: it needs hindsight 'action' and a hint term, "
                         f"not objective {kind!r} with hindsight {hindsight!r}")
    rl = BinaryRL(clip_low=clip_low, clip_high=clip_high, negative_weight=rl_negative_weight,
                  blame_unhinted=blame_unhinted)
    opd = _HINDSIGHT[hindsight](clip_low=clip_low, clip_high=clip_high, advantage_clip=advantage_clip,
                                contrast_weight=contrast_weight)
    weights = {"rl_weight": rl_weight, "opd_weight": opd_weight, "kl_weight": kl_weight}
    return _BUILDERS[kind](rl, opd, **weights)


def objective_from_config(o: Any) -> Objective:
    """The objective a ``learner.objective`` config section names (``ObjectiveConfig``)."""
    return build_objective(o.kind, clip_low=o.clip_low, clip_high=o.clip_high, advantage_clip=o.advantage_clip,
                           rl_weight=o.rl_weight, opd_weight=o.opd_weight, kl_weight=o.kl_weight,
                           hindsight=o.hindsight, rl_negative_weight=o.rl_negative_weight,
                           blame_unhinted=o.blame_unhinted, contrast_weight=o.contrast_weight)  # fmt: skip


@dataclass
class RunningBaseline:
    """EMA of batch-mean judge scores for one adapter scope; the first batch sets it outright."""

    value: float = 0.0
    momentum: float = 0.9
    count: int = 0

    def update(self, scores: list[int]) -> float:
        """Fold in one batch of scores (an empty batch changes nothing); return the new value."""
        if not scores:
            return self.value
        batch_mean = sum(scores) / len(scores)
        if self.count == 0:
            self.value = batch_mean
        else:
            self.value = self.momentum * self.value + (1.0 - self.momentum) * batch_mean
        self.count += 1
        return self.value

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunningBaseline:
        return cls(value=float(data["value"]), momentum=float(data["momentum"]), count=int(data["count"]))
