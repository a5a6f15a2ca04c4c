"""Objectives as pure functions of tensors: gradient signs, clipping, masking, composition."""

from __future__ import annotations

import math

import pytest
import torch

from whet.learner.objective import (
    BinaryRL,
    Combined,
    HindsightAction,
    HindsightDistillation,
    HindsightOPD,
    RunningBaseline,
    TokenBatch,
    blamed_tokens,
    build_objective,
    clipped_surrogate,
    kl_penalty,
    opd_advantages,
)


def leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def token_grad(ratio: float, advantage: float, clip_low: float = 0.2, clip_high: float = 0.28) -> float:
    """d loss / d logp for one token whose importance ratio is ``ratio``."""
    logp = leaf([[math.log(ratio)]])
    old_logp = torch.zeros(1, 1)
    loss = clipped_surrogate(
        logp, old_logp, torch.tensor([[advantage]]), torch.ones(1, 1), clip_low, clip_high
    )
    loss.backward()
    return float(logp.grad[0, 0])


def test_binary_rl_at_ratio_one_pushes_good_tokens_up_and_bad_tokens_down_by_advantage_over_tokens():
    logp = leaf([[-1.0, -2.0, -0.5], [-0.3, -1.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    batch = TokenBatch(
        logp=logp, old_logp=logp.detach().clone(), mask=mask, scores=torch.tensor([1, -1]), baseline=0.25
    )
    loss, stats = BinaryRL().loss(batch)
    loss.backward()
    advantages = torch.tensor([[0.75], [-1.25]])
    torch.testing.assert_close(logp.grad, -advantages * mask / 5.0)
    assert (logp.grad[0] < 0).all()  # descent raises the log-probs of the +1 response
    assert (logp.grad[1, :2] > 0).all()  # and lowers those of the -1 response
    assert logp.grad[1, 2] == 0.0  # padding gets nothing
    assert stats["tokens"] == 5.0
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["clip_frac"] == 0.0


def test_positive_advantage_above_the_upper_clip_gets_no_gradient():
    assert token_grad(1.3, 1.0) == 0.0
    assert token_grad(1.3, 1.0, clip_high=0.35) < 0.0


def test_upper_clip_is_wider_than_lower_clip():
    # A deviation of 0.25 from 1 is inside the upper bound (1.28) but outside the lower one (0.8).
    assert token_grad(1.25, 1.0) == pytest.approx(-1.25)
    assert token_grad(1.25, 1.0, clip_high=0.2) == 0.0
    assert token_grad(0.75, -1.0) == 0.0


def test_negative_advantage_is_clipped_only_below_and_positive_only_above():
    # A ratio already below the floor cannot be pushed further down, but can be pushed back up.
    assert token_grad(0.75, -1.0) == 0.0
    assert token_grad(0.75, 1.0) == pytest.approx(-0.75)
    assert token_grad(0.85, -1.0) == pytest.approx(0.85)
    # A ratio above the ceiling cannot be pushed further up, but a bad token there is still pushed down.
    assert token_grad(1.3, -1.0) == pytest.approx(1.3)


def test_clip_fraction_counts_tokens_whose_gradient_the_clip_removed():
    logp = leaf([[math.log(1.3), 0.0, math.log(0.7)]])
    batch = TokenBatch(
        logp=logp, old_logp=torch.zeros(1, 3), mask=torch.ones(1, 3), scores=torch.tensor([1]), baseline=0.0
    )
    _, stats = BinaryRL().loss(batch)
    assert stats["clip_frac"] == pytest.approx(1 / 3)


def test_binary_rl_ignores_score_zero_samples_even_with_a_baseline():
    logp = leaf([[-1.0, -2.0], [-0.5, -0.7]])
    batch = TokenBatch(
        logp=logp,
        old_logp=logp.detach().clone(),
        mask=torch.ones(2, 2),
        scores=torch.tensor([1, 0]),
        baseline=0.5,
    )
    loss, stats = BinaryRL().loss(batch)
    loss.backward()
    assert (logp.grad[0] < 0).all()
    assert (logp.grad[1] == 0).all()
    assert stats["tokens"] == 2.0
    assert stats["adv_mean"] == pytest.approx(0.5)


def test_binary_rl_with_no_scored_sample_is_a_zero_loss_that_still_backpropagates():
    logp = leaf([[-1.0, -2.0]])
    batch = TokenBatch(
        logp=logp,
        old_logp=logp.detach().clone(),
        mask=torch.ones(1, 2),
        scores=torch.tensor([0]),
        baseline=0.3,
    )
    loss, stats = BinaryRL().loss(batch)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert (logp.grad == 0).all()
    assert stats["tokens"] == 0.0


def test_opd_pushes_tokens_the_teacher_prefers_up_and_others_down_only_for_hinted_samples():
    logp = leaf([[-1.0, -1.0], [-1.0, -1.0]])
    teacher = torch.tensor([[-0.5, -1.5], [float("nan"), float("nan")]])  # the unhinted row is never read
    batch = TokenBatch(
        logp=logp,
        old_logp=logp.detach().clone(),
        mask=torch.ones(2, 2),
        scores=torch.tensor([0, 0]),
        baseline=0.0,
        teacher_logp=teacher,
        has_hint=torch.tensor([True, False]),
    )
    loss, stats = HindsightOPD().loss(batch)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, 0.25], [0.0, 0.0]]))
    assert stats["tokens"] == 2.0
    assert math.isfinite(stats["loss"])


def test_opd_advantages_are_teacher_minus_student_within_the_clip():
    logp = leaf([[-1.0, -1.0, -20.0]])
    advantages = opd_advantages(torch.tensor([[-0.5, -9.0, -1.0]]), logp, clip=5.0)
    torch.testing.assert_close(advantages, torch.tensor([[0.5, -5.0, 5.0]]))
    assert not advantages.requires_grad


@pytest.mark.parametrize("teacher, has_hint", [(None, None), (torch.zeros(1, 2), torch.tensor([False]))])
def test_opd_without_hints_is_a_zero_loss_that_still_backpropagates(teacher, has_hint):
    logp = leaf([[-1.0, -2.0]])
    batch = TokenBatch(
        logp=logp,
        old_logp=logp.detach().clone(),
        mask=torch.ones(1, 2),
        scores=torch.tensor([1]),
        baseline=0.0,
        teacher_logp=teacher,
        has_hint=has_hint,
    )
    loss, stats = HindsightOPD().loss(batch)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert (logp.grad == 0).all()
    assert stats["opd_loss"] == 0.0


def random_batch(seed: int, with_ref: bool) -> TokenBatch:
    generator = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(3, 4, generator=generator) * 3).requires_grad_()
    return TokenBatch(
        logp=logp,
        old_logp=logp.detach() + 0.1 * torch.randn(3, 4, generator=generator),
        mask=torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]]),
        scores=torch.tensor([1, -1, 0]),
        baseline=0.2,
        teacher_logp=logp.detach() + torch.randn(3, 4, generator=generator),
        has_hint=torch.tensor([False, True, True]),
        ref_logp=logp.detach() + 0.2 * torch.randn(3, 4, generator=generator) if with_ref else None,
    )


def test_combined_is_the_weighted_sum_of_its_parts():
    rl, opd = BinaryRL(), HindsightOPD(advantage_clip=2.0)
    batch = random_batch(0, with_ref=True)
    combined, stats = Combined(rl, opd, rl_weight=0.7, opd_weight=0.3, kl_weight=0.1).loss(batch)
    combined.backward()
    combined_grad = batch.logp.grad.clone()
    batch.logp.grad = None

    expected = (
        0.7 * rl.loss(batch)[0]
        + 0.3 * opd.loss(batch)[0]
        + 0.1 * kl_penalty(batch.logp, batch.ref_logp, batch.mask)
    )
    expected.backward()
    torch.testing.assert_close(combined, expected)
    torch.testing.assert_close(combined_grad, batch.logp.grad)
    assert stats["loss"] == pytest.approx(float(expected.detach()))
    assert stats["kl"] > 0.0
    assert stats["rl_tokens"] == 6.0 and stats["opd_tokens"] == 5.0


def test_combined_with_a_kl_weight_but_no_reference_log_probs_is_refused():
    with pytest.raises(ValueError, match="ref_logp"):
        Combined(BinaryRL(), HindsightOPD(), kl_weight=0.1).loss(random_batch(1, with_ref=False))


def test_kl_penalty_is_zero_at_the_reference_and_positive_away_from_it():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert float(kl_penalty(logp, logp.clone(), mask)) == 0.0
    assert float(kl_penalty(logp, logp + torch.tensor([[0.3, -0.4, 0.0]]), mask)) > 0.0
    # Padding does not count, whatever it holds.
    assert float(kl_penalty(logp, logp + torch.tensor([[0.0, 0.0, 50.0]]), mask)) == 0.0


def test_build_objective_turns_each_kind_into_its_class():
    assert isinstance(build_objective("rl", clip_high=0.3), BinaryRL)
    assert build_objective("rl", clip_high=0.3).clip_high == 0.3
    assert build_objective("opd", advantage_clip=2.0) == HindsightOPD(advantage_clip=2.0)  # sampled tokens by default
    assert build_objective("opd", hindsight="distribution") == HindsightDistillation()
    combined = build_objective("combined", rl_weight=0.5, opd_weight=2.0, kl_weight=0.01)
    assert combined == Combined(BinaryRL(), HindsightOPD(), rl_weight=0.5, opd_weight=2.0, kl_weight=0.01)
    assert build_objective("combined", hindsight="distribution").needs_distributions and not combined.needs_distributions
    assert build_objective("combined", hindsight="action").needs_teacher_actions and not combined.needs_teacher_actions
    with pytest.raises(ValueError, match="'sampled'.*action, distribution, token"):
        build_objective("opd", hindsight="sampled")


def test_hindsight_distillation_moves_the_student_toward_the_teachers_distribution_on_hinted_samples_only():
    # two samples, two positions, a vocabulary of three; the teacher wants token 2 where the student wants 0
    student_logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]],
                                  requires_grad=True)  # [B, T, V]
    teacher = torch.log_softmax(torch.tensor([[[0.0, 0.0, 4.0]] * 2] * 2), dim=-1)  # [B, T, V]
    student = torch.log_softmax(student_logits, dim=-1)
    batch = TokenBatch(logp=student[..., 0], old_logp=torch.zeros(2, 2), mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
                       scores=torch.zeros(2), baseline=0.0, has_hint=torch.tensor([True, False]),
                       student_dist=student, teacher_dist=teacher)  # fmt: skip
    loss, stats = HindsightDistillation().loss(batch)
    loss.backward()
    grad = student_logits.grad
    assert float(loss.detach()) > 0 and stats["tokens"] == 2.0
    assert grad[0, 0, 2] < 0 and grad[0, 0, 0] > 0  # descending the loss raises token 2, lowers token 0
    assert torch.all(grad[1] == 0)  # no hint: nothing to learn
    at_teacher = TokenBatch(logp=teacher[..., 0], old_logp=torch.zeros(2, 2), mask=torch.ones(2, 2),
                            scores=torch.zeros(2), baseline=0.0, has_hint=torch.tensor([True, True]),
                            student_dist=teacher.clone(), teacher_dist=teacher)  # fmt: skip
    assert float(HindsightDistillation().loss(at_teacher)[0]) == pytest.approx(0.0, abs=1e-6)


def test_hindsight_action_raises_the_teachers_action_on_rows_that_have_one_only():
    logits = torch.zeros(2, 3, 4, requires_grad=True)  # [B, A, V]
    action = torch.tensor([[1, 2, 3], [0, 0, 0]])  # [B, A]
    action_logp = torch.log_softmax(logits, dim=-1).gather(-1, action[..., None])[..., 0]  # [B, A]
    batch = TokenBatch(logp=torch.zeros(2, 1), old_logp=torch.zeros(2, 1), mask=torch.ones(2, 1),
                       scores=torch.zeros(2), baseline=0.0, action_logp=action_logp,
                       action_mask=torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))  # fmt: skip
    loss, stats = HindsightAction().loss(batch)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(math.log(4)) and stats["tokens"] == 2.0
    assert logits.grad[0, 0, 1] < 0 and logits.grad[0, 1, 2] < 0  # descending raises the teacher's tokens
    assert torch.all(logits.grad[0, 2] == 0) and torch.all(logits.grad[1] == 0)  # masked: nothing learnt
    empty = TokenBatch(logp=torch.zeros(1, 1, requires_grad=True), old_logp=torch.zeros(1, 1), mask=torch.ones(1, 1),
                       scores=torch.zeros(1), baseline=0.0)  # fmt: skip
    assert float(HindsightAction().loss(empty)[0].detach()) == 0.0


def test_build_objective_rejects_unknown_kinds_naming_the_valid_ones():
    with pytest.raises(ValueError, match="'grpo'.*combined, opd, rl"):
        build_objective("grpo")


def test_build_objective_refuses_a_kl_weight_it_would_drop():
    with pytest.raises(ValueError, match="combined"):
        build_objective("rl", kl_weight=0.1)


def test_running_baseline_starts_at_the_first_batch_mean_and_moves_toward_later_ones():
    baseline = RunningBaseline(momentum=0.9)
    assert baseline.update([1, 1, 0, 0]) == pytest.approx(0.5)
    assert baseline.update([-1, -1]) == pytest.approx(0.9 * 0.5 - 0.1)
    assert baseline.update([]) == pytest.approx(0.35)
    assert baseline.count == 2


def test_running_baseline_round_trips_through_a_dict():
    baseline = RunningBaseline(momentum=0.8)
    baseline.update([1, -1, 1])
    restored = RunningBaseline.from_dict(baseline.to_dict())
    assert restored == baseline
    assert restored.update([1]) == baseline.update([1])


def test_binary_rl_negative_weight_scales_only_the_negative_advantages():
    def grads(weight: float) -> torch.Tensor:
        logp = leaf([[-1.0, -2.0], [-0.5, -0.7]])
        batch = TokenBatch(logp=logp, old_logp=logp.detach().clone(), mask=torch.ones(2, 2),
                           scores=torch.tensor([1, -1]), baseline=0.0)  # fmt: skip
        BinaryRL(negative_weight=weight).loss(batch)[0].backward()
        return logp.grad

    plain, half, none = grads(1.0), grads(0.5), grads(0.0)
    torch.testing.assert_close(half[0], plain[0])  # the success is learned as before
    torch.testing.assert_close(none[0], plain[0])
    torch.testing.assert_close(half[1], plain[1] * 0.5)  # the failure pushes half as hard
    assert (plain[1] > 0).all() and (none[1] == 0).all()  # or not at all
    with pytest.raises(ValueError, match="negative_weight"):
        BinaryRL(negative_weight=1.5)


def test_blamed_tokens_are_the_span_where_the_wrong_response_and_the_hinted_action_differ():
    assert blamed_tokens([1, 2, 3, 4, 5], [1, 2, 9, 9, 4, 5]) == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert blamed_tokens([1, 2, 3], [1, 2, 3, 4]) == [0.0, 0.0, 0.0]  # nothing wrong, something missing
    assert blamed_tokens([1, 2, 3, 4], [1, 2]) == [0.0, 0.0, 1.0, 1.0]
    assert blamed_tokens([7, 8], [1, 2]) == [1.0, 1.0]
    assert blamed_tokens([1, 1, 1], [1, 1]) == [0.0, 0.0, 1.0]  # prefix and suffix never overlap
    assert blamed_tokens([1, 2, 3], None) == [1.0, 1.0, 1.0]  # no action: by default the whole response
    assert blamed_tokens([1, 2, 3], None, unhinted=False) == [0.0, 0.0, 0.0]  # ... or none of it


def test_binary_rl_scores_only_the_tokens_the_rl_mask_names():
    logp = leaf([[-1.0, -2.0, -0.5], [-0.5, -0.7, -0.1]])
    batch = TokenBatch(logp=logp, old_logp=logp.detach().clone(), mask=torch.ones(2, 3), scores=torch.tensor([-1, 1]),
                       baseline=0.0, rl_mask=torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]]))  # fmt: skip
    loss, stats = BinaryRL().loss(batch)
    loss.backward()
    assert stats["tokens"] == 4.0
    assert logp.grad[0, 0] == 0 and logp.grad[0, 2] == 0 and logp.grad[0, 1] > 0  # only the wrong token goes down
    assert (logp.grad[1] < 0).all()


def test_the_objective_follows_its_config_section():
    from whet.config.settings import ObjectiveConfig
    from whet.learner.objective import Combined, HindsightAction, objective_from_config

    built = objective_from_config(ObjectiveConfig(hindsight="action", rl_negative_weight=0.25, rl_weight=0.5))
    assert isinstance(built, Combined) and isinstance(built.opd, HindsightAction)
    assert built.rl.negative_weight == 0.25 and built.rl_weight == 0.5


def test_the_contrast_between_teacher_actions_needs_hindsight_actions_and_refuses_other_forms_by_name():
    assert build_objective("combined", hindsight="action", contrast_weight=1.0).contrast_weight == 1.0
    assert build_objective("opd", hindsight="action", contrast_weight=0.5).contrast_weight == 0.5
    for kind, hindsight in (("combined", "token"), ("combined", "distribution"), ("rl", "action")):
        with pytest.raises(ValueError, match="contrast_weight"):
            build_objective(kind, hindsight=hindsight, contrast_weight=1.0)
    with pytest.raises(ValueError, match="contrast_weight"):
        HindsightAction(contrast_weight=-1.0)
