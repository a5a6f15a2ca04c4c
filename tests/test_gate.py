"""The promotion gate's decision on replayed numbers (no model needed)."""

from __future__ import annotations

from whet.learner.gate import ANSWER_OPENING, PinnedAction, PromotionGate, Replayed


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


def test_a_held_out_margin_on_fewer_turns_than_it_needs_is_reported_but_does_not_decide():
    one_turn = [Replayed(1, -1.0, -1.3)]  # one good held-out action a little less likely: margin -0.3
    items = [Replayed(0, -0.5, -0.5)] * 4
    decision = PromotionGate(holdout_min_turns=4).decide(one_turn, items)
    assert decision.accepted and "1 turn(s), fewer than the 4 it needs" in decision.reason
    assert abs(decision.metrics["preference_margin"] + 0.3) < 1e-9 and decision.metrics["holdout_min_turns"] == 4
    assert decision.reason.startswith("passed regression replay")  # the held-out check is not claimed
    four_turns = one_turn * 2 + [Replayed(-1, -1.0, -1.0)] * 2
    decision = PromotionGate(holdout_min_turns=4).decide(four_turns, items)
    assert not decision.accepted and "held-out preference margin -0.3000" in decision.reason
    assert not PromotionGate().decide(one_turn, items).accepted  # the gate alone: one turn decides
    assert PromotionGate(holdout_min_turns=4).decide(one_turn, []).reason.startswith("no regression data: passed")


def test_a_falling_regression_average_is_rejected():
    items = [Replayed(0, -0.5, -0.6)] * 4
    decision = PromotionGate(regression_tolerance=0.05).decide([], items)
    assert not decision.accepted and "regression set likelihood fell" in decision.reason


def test_steps_each_within_the_average_tolerance_are_rejected_once_together_they_fall_too_far_below_the_base():
    gate = PromotionGate(regression_tolerance=0.05, regression_total_tolerance=0.08)
    base = [-0.5, -0.4]
    # each step falls 0.04 from the live version: the first two lineage steps are fine, the third is not
    first = gate.decide([], [Replayed(0, -0.5, -0.54), Replayed(0, -0.4, -0.44)], base=base)
    assert first.accepted and abs(first.metrics["regression_total_drift"] + 0.04) < 1e-9
    second = gate.decide([], [Replayed(0, -0.54, -0.58), Replayed(0, -0.44, -0.48)], base=base)
    assert second.accepted and abs(second.metrics["regression_total_drift"] + 0.08) < 1e-9
    third = gate.decide([], [Replayed(0, -0.58, -0.62), Replayed(0, -0.48, -0.52)], base=base)
    assert not third.accepted and "from the base model's" in third.reason
    assert abs(third.metrics["regression_drift"] + 0.04) < 1e-9  # each step alone is within its tolerance
    # a step back towards the base passes again; a step saved before the base was recorded is not held to it
    assert gate.decide([], [Replayed(0, -0.58, -0.55), Replayed(0, -0.48, -0.45)], base=base).accepted
    # a lineage already beyond the bound (promoted before it was set) may still step back towards the base
    back = gate.decide([], [Replayed(0, -0.62, -0.60), Replayed(0, -0.52, -0.50)], base=base)
    assert back.accepted and abs(back.metrics["regression_total_drift"] + 0.10) < 1e-9
    unchecked = gate.decide([], [Replayed(0, -0.58, -0.62), Replayed(0, -0.48, -0.52)])
    assert unchecked.accepted and unchecked.metrics["regression_total_drift"] is None


def test_a_candidate_that_gets_a_pinned_turn_wrong_which_live_got_right_is_rejected():
    items = [Replayed(0, -0.5, -0.5)] * 3  # the likelihoods hold
    gate = PromotionGate(regression_actions_lost=0)
    # live right on turns 0 and 1; the candidate fixes turn 2 but loses turn 1
    decision = gate.decide([], items, [(True, True), (True, False), (False, True)])
    assert not decision.accepted and "1 pinned turn(s)" in decision.reason
    assert decision.metrics["regression_actions_kept"] == [2, 2] and decision.metrics["regression_actions_lost"] == 1
    assert decision.metrics["regression_actions_lost_items"] == [1]
    assert gate.decide([], items, [(True, True), (False, False), (False, True)]).accepted
    assert PromotionGate(regression_actions_lost=1).decide([], items, [(True, False)]).accepted
    assert PromotionGate().decide([], items, [(True, False)]).accepted  # unchecked


def _pinned(response: str, messages: list | None = None) -> PinnedAction:
    tools = [{"type": "function", "function": {"name": "add_note", "parameters": {"properties": {
        "text": {"type": "string"}, "list_name": {"type": "string", "default": "inbox"},
        "kind": {"type": "string", "default": "note"}}}}}]  # fmt: skip
    return PinnedAction.of({"messages": messages or [{"role": "user", "content": "?"}], "response": response,
                            "tools": tools})  # fmt: skip


def _call(arguments: str) -> str:
    return f'<tool_call>\n{{"name": "add_note", "arguments": {arguments}}}\n</tool_call>'


def test_a_pinned_call_is_kept_by_the_same_tool_and_arguments_defaults_and_case_aside():
    pinned = _pinned(_call('{"text": "my shoe size is 43"}'))
    assert pinned.kept(_call('{"text": "My shoe size is 43", "list_name": "inbox"}'))  # the default, written out
    assert not pinned.kept(_call('{"text": "my shoe size is 43", "list_name": "errands"}'))  # a user's list leaked in
    assert not pinned.kept(_call('{"text": "my shoe size is 44"}'))
    assert not pinned.kept("Noted: your shoe size is 43.")  # no call
    assert not pinned.kept(_call('{"text": "my shoe size is 43"}') + _call('{"text": "again"}'))
    assert not pinned.kept('<tool_call>\n{"name": "add_note", "arguments": \n</tool_call>')  # unreadable


def test_a_pinned_answer_calls_nothing_and_keeps_the_numbers_it_read_from_the_tools():
    messages = [{"role": "user", "content": "What's 22 plus 45?"},
                {"role": "assistant", "content": "", "tool_calls": []},
                {"role": "tool", "content": '{"expression": "22 + 45", "result": 67}'}]  # fmt: skip
    pinned = _pinned("The answer is 67.", messages)
    assert pinned.kept("22 + 45 = 67.")
    assert not pinned.kept("The answer is 76.")
    assert not pinned.kept(_call('{"text": "67"}'))
    assert pinned.kept("22 plus 45 is 67.")  # the request's numbers may be said again
    assert not pinned.kept("It is 7 on Sunday: 67.")  # every number kept, and one made up
    dated = [{"role": "user", "content": "Which date is 78 days from 2027-01-02?"},
             {"role": "assistant", "content": "", "tool_calls": []},
             {"role": "tool", "content": '{"date": "2027-03-21", "weekday": "Sunday", "time": "05:30"}'}]  # fmt: skip
    pinned = _pinned("That is Sunday, 2027-03-21.", dated)
    assert pinned.kept("2027-03-21 is a Sunday, 78 days from 2027-01-02.") and pinned.kept("Sunday 2027-03-21, at 5:30.")
    assert not pinned.kept("It is 7 on Sunday in 2027-03-21.")  # bench run DX's lineage, which passed before
    small_talk = _pinned("A giraffe's tongue can be about 50 centimetres long.")  # 50 comes from no tool
    assert small_talk.kept("Giraffes sleep standing up.") and not small_talk.kept(_call('{"text": "giraffes"}'))
    assert small_talk.kept("Giraffes sleep 2 hours a day.")  # with no tool result, any number may be written
    assert not small_talk.kept("")  # a reply that ends at once answers nothing


def test_the_greedy_check_reads_only_the_opening_of_an_answer_with_no_number_to_keep():
    messages = [{"role": "user", "content": "What's 22 plus 45?"},
                {"role": "assistant", "content": "", "tool_calls": []},
                {"role": "tool", "content": '{"expression": "22 + 45", "result": 67}'}]  # fmt: skip
    assert _pinned("The answer is 67.", messages).tokens(40) == 48  # its number must be read
    assert _pinned(_call('{"text": "my shoe size is 43"}')).tokens(40) == 48  # a call is read whole
    small_talk = _pinned("Giraffes sleep standing up, and only for a few minutes at a time.")
    assert small_talk.tokens(40) == ANSWER_OPENING and small_talk.tokens(3) == 11
    assert not small_talk.kept("<tool_call>\n{\"name\": \"add_note\", \"argu")  # a call cut off
    assert not small_talk.kept("Sure! <tool_")  # cut off as the call opened
    assert small_talk.kept("Giraffes sleep standing up, and only")  # an answer cut off
