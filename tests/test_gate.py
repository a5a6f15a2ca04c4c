"""The promotion gate's decision on replayed numbers (no model needed)."""

from __future__ import annotations

from whet.learner.gate import PromotionGate, Replayed


def test_one_regression_item_falling_far_is_rejected_even_when_the_average_holds():
    # fifteen items unchanged, one (a city copied from a lesson into a request naming another) falls 0.6 nats/token
    items = [Replayed(0, -0.5, -0.5)] * 15 + [Replayed(0, -0.3, -0.9)]
    assert PromotionGate(regression_tolerance=0.05).decide([], items).accepted  # the average: -0.0375
    decision = PromotionGate(regression_tolerance=0.05, regression_item_tolerance=0.25).decide([], items)
    assert not decision.accepted and "regression item" in decision.reason
    assert abs(decision.metrics["regression_worst"] + 0.6) < 1e-9


def test_the_gate_accepts_within_every_tolerance_and_says_what_it_checked():
    holdout = [Replayed(1, -1.0, -0.8), Replayed(-1, -1.0, -1.2)]
    items = [Replayed(0, -0.5, -0.52), Replayed(0, -0.4, -0.38)]
    decision = PromotionGate(regression_item_tolerance=0.25).decide(holdout, items)
    assert decision.accepted and decision.reason == "passed held-out and regression replay"
    assert abs(decision.metrics["preference_margin"] - 0.4) < 1e-9


def test_a_falling_regression_average_is_rejected():
    items = [Replayed(0, -0.5, -0.6)] * 4
    decision = PromotionGate(regression_tolerance=0.05).decide([], items)
    assert not decision.accepted and "regression set likelihood fell" in decision.reason
