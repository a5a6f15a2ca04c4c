"""Judges: the rules on each kind of next state, the LLM judge's votes and hints, the HTTP chat
model, and composition."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import structlog

from whet.learner.judge import (
    ChatModel,
    ComposedJudge,
    Judge,
    JudgeError,
    LLMJudge,
    NextState,
    OpenAIChat,
    RulesJudge,
    Verdict,
    correction_hint,
    majority,
    parse_vote,
)
from whet.memory.store import Feedback, Turn

CONTEXT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What time is it in Lisbon right now?"},
]


def _turn(kind: str | None, state: dict[str, Any] | None, **fields: Any) -> Turn:
    values: dict[str, Any] = {
        "session_id": "s", "user_id": "u", "request_id": "r", "step": 0, "model": "m",
        "prompt_messages": CONTEXT, "response_text": "It is 14:05 in London.",
        "next_state_kind": kind, "next_state": state,
    }  # fmt: skip
    return Turn(**{**values, **fields})


def _reply(text: str) -> Turn:
    return _turn("user_message", {"messages": [{"role": "user", "content": text}]})


def _feedback(score: float, text: str | None = None, *, seconds: int = 0) -> Feedback:
    created = datetime(2025, 1, 1, tzinfo=UTC) + timedelta(seconds=seconds)
    return Feedback(turn_id="t", user_id="u", score=score, text=text, created_at=created)


def _rules(turn: Turn, feedback: tuple[Feedback, ...] = ()) -> Verdict:
    return RulesJudge().decide(turn, NextState.of(turn, feedback), turn.prompt_messages)


class ScriptedChat:
    """A ChatModel twin answering from a queue (an exception in the queue is raised)."""

    def __init__(self, answers: list[str | Exception]) -> None:
        self.answers = list(answers)
        self.calls: list[dict[str, Any]] = []

    async def complete(self, messages: list[dict[str, Any]], *, temperature: float, max_tokens: int) -> str:
        self.calls.append({"messages": messages, "temperature": temperature, "max_tokens": max_tokens})
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


class FixedJudge:
    """A judge twin with a fixed verdict (or error), counting its calls."""

    def __init__(self, name: str, verdict: Verdict | Exception) -> None:
        self.name, self.verdict, self.calls = name, verdict, 0

    async def judge(self, turn: Turn, next_state: NextState, context: list[dict[str, Any]]) -> Verdict:
        self.calls += 1
        if isinstance(self.verdict, Exception):
            raise self.verdict
        return self.verdict


# ----------------------------------------------------------------------------- verdicts and next states


@pytest.mark.parametrize("score", [2, -2, True, 0.5])
def test_a_verdict_refuses_a_score_other_than_minus_one_zero_or_plus_one(score):
    with pytest.raises(ValueError, match="-1, 0 or \\+1"):
        Verdict(score, None, "x", "rules")


def test_next_state_of_a_closed_turn_carries_its_kind_data_and_feedback_oldest_first():
    turn = _reply("thanks")
    late, early = _feedback(-1.0, seconds=5), _feedback(1.0, seconds=1)
    state = NextState.of(turn, [late, early])
    assert state.kind == "user_message"
    assert state.data == turn.next_state
    assert state.feedback == (early, late)


def test_next_state_of_an_open_turn_is_feedback_when_rows_exist_and_an_error_otherwise():
    turn = _turn(None, None)
    assert NextState.of(turn, [_feedback(1.0)]).kind == "feedback"
    with pytest.raises(ValueError, match="still open"):
        NextState.of(turn)


@pytest.mark.anyio
async def test_the_shipped_judges_and_chat_models_satisfy_their_protocols():
    rules, chat = RulesJudge(), OpenAIChat("http://judge.test/v1", model="m")
    judges = [rules, LLMJudge(ScriptedChat([])), ComposedJudge(rules, LLMJudge(ScriptedChat([])))]
    assert all(isinstance(judge, Judge) for judge in judges)
    assert [judge.name for judge in judges] == ["rules", "llm", "rules+llm"]
    assert isinstance(chat, ChatModel) and isinstance(ScriptedChat([]), ChatModel)
    await chat.aclose()


# ----------------------------------------------------------------------------- rules: feedback


@pytest.mark.parametrize(("score", "expected"), [(1.0, 1), (0.3, 1), (0.0, 0), (-0.2, -1), (-1.0, -1)])
def test_explicit_feedback_sign_is_the_score(score, expected):
    verdict = _rules(_turn("feedback", {"feedback_id": 1, "score": score, "text": None}), (_feedback(score),))
    assert (verdict.score, verdict.hint, verdict.judge) == (expected, None, "rules")


def test_explicit_negative_feedback_overrides_a_thankful_reply_and_its_text_is_the_hint():
    verdict = _rules(_reply("Thanks, perfect!"), (_feedback(-1.0, "Use Celsius for me."),))
    assert verdict.score == -1
    assert verdict.hint == "The user said: Use Celsius for the user"


def test_the_latest_feedback_row_wins():
    rows = (_feedback(-1.0, "bad", seconds=1), _feedback(1.0, "ok now", seconds=9))
    assert _rules(_reply("hmm"), rows).score == 1


def test_negative_feedback_phrased_as_a_correction_gets_the_correction_hint():
    verdict = _rules(_turn("feedback", {"feedback_id": 3, "score": -1.0, "text": "No, I meant Lisbon time"}))
    assert (verdict.score, verdict.hint) == (-1, 'The user meant "Lisbon time"')


def test_a_feedback_next_state_without_rows_is_read_from_its_data():
    positive = _rules(_turn("feedback", {"feedback_id": 1, "score": 0.5, "text": "nice"}))
    negative = _rules(_turn("feedback", {"feedback_id": 2, "score": -0.5, "text": "too long"}))
    assert (positive.score, positive.hint) == (1, None)
    assert (negative.score, negative.hint) == (-1, "The user said: too long")


# ----------------------------------------------------------------------------- rules: tool results


def test_a_tool_error_scores_minus_one_with_a_hint_naming_the_tool():
    results = [
        {"role": "tool", "tool_call_id": "c1", "name": "get_time", "content": "14:05"},
        {"role": "tool", "tool_call_id": "c2", "name": "get_weather", "content": "error: unknown city 'Lisbn'"},
    ]
    verdict = _rules(_turn("tool_result", {"results": results}))
    assert verdict.score == -1
    assert verdict.hint == "Calling get_weather failed: unknown city 'Lisbn'"


def test_a_tool_error_without_a_name_takes_it_from_the_call_and_is_trimmed():
    call = {"id": "c9", "type": "function", "function": {"name": "search", "arguments": "{}"}}
    results = [{"role": "tool", "tool_call_id": "c9", "content": "error: " + "x" * 500}]
    verdict = _rules(_turn("tool_result", {"results": results}, tool_calls=[call]))
    assert verdict.score == -1
    assert verdict.hint is not None and verdict.hint.startswith("Calling search failed: xxx")
    assert len(verdict.hint) <= 240


def test_a_tool_result_without_error_is_neutral():
    results = [{"role": "tool", "tool_call_id": "c1", "name": "get_time", "content": "14:05 WEST"}]
    verdict = _rules(_turn("tool_result", {"results": results}))
    assert (verdict.score, verdict.hint, verdict.reason) == (0, None, "tool ran without error")


# ----------------------------------------------------------------------------- rules: the user's reply


def test_no_i_meant_lisbon_time_becomes_the_hint_the_user_meant_lisbon_time():
    verdict = _rules(_reply("No, I meant Lisbon time"))
    assert (verdict.score, verdict.hint, verdict.judge) == (-1, 'The user meant "Lisbon time"', "rules")


@pytest.mark.parametrize(
    ("reply", "hint"),
    [
        ("no I meant my home in Lisbon.", 'The user meant "the user\'s home in Lisbon"'),
        ("I meant Porto", 'The user meant "Porto"'),
        ("I said Celsius!", 'The user said "Celsius"'),
        ("Not Paris, Lisbon", 'The user wants "Lisbon", not "Paris"'),
        ("not Paris but Lisbon.", 'The user wants "Lisbon", not "Paris"'),
        ("No, not Paris, Lisbon", 'The user wants "Lisbon", not "Paris"'),
        ("Actually, I'm in Porto.", 'The user clarified: "the user is in Porto"'),
        ("That's wrong, the meeting is on Friday", 'The user corrected: "the meeting is on Friday"'),
        ("That\u2019s not right.", "The user said it was wrong: That's not right"),
        ("wrong", "The user said it was wrong: wrong"),
        ("No. Use Celsius.", 'The user corrected: "Use Celsius"'),
    ],
)
def test_a_correction_scores_minus_one_with_a_hint_taken_from_it(reply, hint):
    verdict = _rules(_reply(reply))
    assert (verdict.score, verdict.hint) == (-1, hint)


def test_a_correction_hint_is_capped():
    hint = correction_hint("I meant " + "very " * 100 + "far")
    assert hint is not None and len(hint) <= 200 and hint.startswith('The user meant "very very')


def test_thanks_followed_by_a_correction_is_a_correction():
    verdict = _rules(_reply("Thanks, but no, I meant Lisbon time"))
    assert (verdict.score, verdict.hint) == (-1, 'The user meant "Lisbon time"')


def test_repeating_the_request_is_a_requery():
    verdict = _rules(_reply("what time is it in Lisbon now?"))
    assert verdict.score == -1
    assert verdict.hint == "The user had to ask again: what time is it in Lisbon now"


@pytest.mark.parametrize("reply", ["Again: the time in Lisbon", "I already asked you this", "please answer the question",
                                   "that's not what I asked"])  # fmt: skip
def test_a_requery_marker_is_a_requery(reply):
    verdict = _rules(_reply(reply))
    assert verdict.score == -1
    assert verdict.hint is not None and verdict.hint.startswith("The user had to ask again: ")


@pytest.mark.parametrize("reply", ["Thanks!", "thank you", "thx", "ok thanks", "Perfect.", "great", "that's right",
                                   "Exactly", "cool", "not bad, thanks"])  # fmt: skip
def test_thanks_or_praise_scores_plus_one_without_a_hint(reply):
    verdict = _rules(_reply(reply))
    assert (verdict.score, verdict.hint, verdict.reason) == (1, None, "the user said thanks")


@pytest.mark.parametrize("reply", ["?", "what?", "huh", "Hmmm...", "", "no", "I don't understand"])
def test_an_unclear_reply_is_neutral(reply):
    verdict = _rules(_reply(reply))
    assert (verdict.score, verdict.hint) == (0, None)


def test_a_new_request_means_the_user_moved_on():
    verdict = _rules(_reply("Now book a table for two at eight"))
    assert (verdict.score, verdict.hint, verdict.reason) == (1, None, "the user moved on")


def test_a_reply_without_a_user_message_is_neutral():
    turn = _turn("user_message", {"messages": [{"role": "tool", "tool_call_id": "c", "content": "x"}]})
    assert _rules(turn).score == 0


@pytest.mark.anyio
async def test_the_rules_judge_is_awaitable_like_any_judge():
    turn = _reply("No, I meant Lisbon time")
    verdict = await RulesJudge().judge(turn, NextState.of(turn), CONTEXT)
    assert verdict == _rules(turn)


# ----------------------------------------------------------------------------- llm judge


@pytest.mark.parametrize(
    ("answer", "vote"),
    [("fine\nSCORE: +1", 1), ("SCORE: -1", -1), ("score: 0", 0), ("SCORE: 1 ... SCORE: -1", -1),
     ("SCORE: 10", None), ("I think it helped", None)],
)  # fmt: skip
def test_a_vote_is_the_last_score_line(answer, vote):
    assert parse_vote(answer) == vote


@pytest.mark.parametrize(("votes", "score"), [([1, 1, -1], 1), ([-1, 0, -1], -1), ([1, -1], 0), ([], 0)])
def test_the_majority_vote_wins_and_ties_or_no_votes_are_zero(votes, score):
    assert majority(votes) == score


@pytest.mark.anyio
async def test_the_llm_judge_takes_the_majority_of_its_votes():
    turn = _turn("tool_result", {"results": [{"role": "tool", "name": "get_time", "content": "14:05"}]})
    chat = ScriptedChat(["It helped.\nSCORE: +1", "SCORE: -1", "SCORE: +1"])
    verdict = await LLMJudge(chat, votes=3, temperature=0.7).judge(turn, NextState.of(turn), CONTEXT)
    assert (verdict.score, verdict.hint, verdict.judge) == (1, None, "llm")
    assert verdict.reason == "llm votes +1:2 0:0 -1:1"
    assert [call["temperature"] for call in chat.calls] == [0.7] * 3  # no hint call on a tool result +1


@pytest.mark.anyio
async def test_a_tie_is_zero_and_unparseable_votes_are_not_counted():
    turn = _turn("tool_result", {"results": [{"role": "tool", "name": "get_time", "content": "14:05"}]})
    chat = ScriptedChat(["SCORE: +1", "SCORE: -1", "no idea", "SCORE: 0", "SCORE: 0", "SCORE: +1", "SCORE: -1"])
    tie = await LLMJudge(chat, votes=4).judge(turn, NextState.of(turn), CONTEXT)
    assert (tie.score, tie.reason) == (0, "llm votes +1:1 0:1 -1:1 unparsed:1")
    chat = ScriptedChat(["maybe", "dunno"])
    none = await LLMJudge(chat, votes=2).judge(turn, NextState.of(turn), CONTEXT)
    assert (none.score, none.hint) == (0, None)


@pytest.mark.anyio
async def test_a_negative_majority_asks_for_a_hint_at_temperature_zero():
    turn = _turn("tool_result", {"results": [{"role": "tool", "name": "get_time", "content": "error: no tz"}]})
    chat = ScriptedChat(["SCORE: -1"] * 3 + ["Pass the IANA zone name, e.g. Europe/Lisbon.\nBecause..."])
    verdict = await LLMJudge(chat).judge(turn, NextState.of(turn), CONTEXT)
    assert (verdict.score, verdict.hint) == (-1, "Pass the IANA zone name, e.g. Europe/Lisbon.")
    assert chat.calls[-1]["temperature"] == 0.0 and len(chat.calls) == 4
    assert "NONE" in chat.calls[-1]["messages"][0]["content"]


@pytest.mark.anyio
async def test_a_hint_answer_of_none_means_no_hint():
    turn = _reply("ok, and tomorrow?")
    chat = ScriptedChat(["SCORE: +1"] * 3 + ["NONE."])
    verdict = await LLMJudge(chat).judge(turn, NextState.of(turn), CONTEXT)
    assert (verdict.score, verdict.hint) == (1, None)
    assert len(chat.calls) == 4  # a user message always gets the hint question


@pytest.mark.anyio
async def test_the_llm_judge_prompt_shows_recent_context_action_calls_and_next_state():
    context = [{"role": "system", "content": "old system"}] + [
        {"role": "user", "content": f"message {i}"} for i in range(10)
    ] + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "Europe/London"}'}}]}]
    turn = _reply("No, I meant Lisbon time")
    chat = ScriptedChat(["SCORE: -1"] + ["Use the user's time zone, Lisbon."])
    verdict = await LLMJudge(chat, votes=1, max_context_messages=4).judge(turn, NextState.of(turn), context)
    prompt = chat.calls[0]["messages"][1]["content"]
    assert "old system" not in prompt and "message 6" not in prompt and "user: message 7" in prompt
    assert '[calls get_time({"tz": "Europe/London"})]' in prompt
    assert "It is 14:05 in London." in prompt and "user: No, I meant Lisbon time" in prompt
    assert "SCORE: +1" in chat.calls[0]["messages"][0]["content"]
    assert verdict.hint == "Use the user's time zone, Lisbon."


@pytest.mark.anyio
async def test_the_llm_judge_prompt_shows_explicit_feedback():
    turn = _turn("feedback", {"feedback_id": 1, "score": -1.0, "text": "too verbose"})
    chat = ScriptedChat(["SCORE: -1", "Answer in one sentence."])
    verdict = await LLMJudge(chat, votes=1).judge(turn, NextState.of(turn), CONTEXT)
    assert "score -1.00, comment: too verbose" in chat.calls[0]["messages"][1]["content"]
    assert verdict.hint == "Answer in one sentence."


@pytest.mark.anyio
async def test_a_model_error_propagates_from_the_llm_judge():
    turn = _reply("hmm")
    chat = ScriptedChat(["SCORE: +1", JudgeError("model down"), "SCORE: +1"])
    with pytest.raises(JudgeError, match="model down"):
        await LLMJudge(chat).judge(turn, NextState.of(turn), CONTEXT)


def test_the_llm_judge_needs_at_least_one_vote():
    with pytest.raises(ValueError, match="votes"):
        LLMJudge(ScriptedChat([]), votes=0)


# ----------------------------------------------------------------------------- OpenAIChat


@pytest.mark.anyio
async def test_openai_chat_posts_the_chat_completion_request_and_returns_the_content():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": "SCORE: +1"}}]})

    chat = OpenAIChat("http://judge.test/v1/", "sk-test", model="qwen", transport=httpx.MockTransport(handler))
    messages = [{"role": "user", "content": "hi"}]
    assert await chat.complete(messages, temperature=0.7, max_tokens=64) == "SCORE: +1"
    await chat.aclose()
    (request,) = seen
    assert request.method == "POST" and str(request.url) == "http://judge.test/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer sk-test"
    assert json.loads(request.content) == {"model": "qwen", "messages": messages, "temperature": 0.7, "max_tokens": 64}


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("response", "match"),
    [(httpx.Response(503, text="overloaded"), "HTTP 503: overloaded"),
     (httpx.Response(200, text="<html>"), "without choices"),
     (httpx.Response(200, json={"choices": []}), "without choices")],
)  # fmt: skip
async def test_openai_chat_turns_bad_answers_into_judge_errors(response, match):
    chat = OpenAIChat("http://judge.test/v1", model="m", transport=httpx.MockTransport(lambda _: response))
    with pytest.raises(JudgeError, match=match):
        await chat.complete([], temperature=0.0, max_tokens=8)
    await chat.aclose()


@pytest.mark.anyio
async def test_openai_chat_reports_timeouts_and_unreachable_servers_as_judge_errors():
    def timeout(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    for handler, match in ((timeout, "timed out after 5.0s"), (refused, "cannot reach")):
        chat = OpenAIChat("http://judge.test/v1", model="m", timeout=5.0, transport=httpx.MockTransport(handler))
        with pytest.raises(JudgeError, match=match):
            await chat.complete([], temperature=0.0, max_tokens=8)
        await chat.aclose()


# ----------------------------------------------------------------------------- composition


@pytest.mark.anyio
async def test_the_composed_judge_asks_the_second_judge_only_when_the_first_has_nothing_to_say():
    turn = _reply("x")
    llm = FixedJudge("llm", Verdict(1, "Be brief.", "llm votes +1:3 0:0 -1:0", "llm"))
    for first, asked in [
        (Verdict(0, None, "unclear", "rules"), True),
        (Verdict(-1, "The user meant Lisbon time", "correction", "rules"), False),
        (Verdict(1, None, "moved on", "rules"), False),
        (Verdict(0, "Calling x failed: y", "odd", "rules"), False),
    ]:
        calls_before = llm.calls
        verdict = await ComposedJudge(FixedJudge("rules", first), llm).judge(turn, NextState.of(turn), CONTEXT)
        assert (llm.calls > calls_before) is asked
        assert verdict == (llm.verdict if asked else first)


@pytest.mark.anyio
async def test_the_composed_judge_keeps_the_first_verdict_when_the_second_fails():
    turn = _turn("tool_result", {"results": [{"role": "tool", "name": "get_time", "content": "14:05"}]})
    composed = ComposedJudge(RulesJudge(), LLMJudge(ScriptedChat([JudgeError("HTTP 500")] * 3)))
    assert composed.name == "rules+llm"
    with structlog.testing.capture_logs() as logs:
        verdict = await composed.judge(turn, NextState.of(turn), CONTEXT)
    assert (verdict.score, verdict.judge, verdict.reason) == (0, "rules", "tool ran without error")
    assert [(log["event"], log["log_level"], log["error"]) for log in logs] == [("judge_failed", "warning", "HTTP 500")]


def test_the_judge_module_imports_neither_the_runtime_nor_fastapi():
    # a fresh interpreter: this test session has imported the runtime elsewhere
    code = (
        "import sys, whet.learner.judge\n"
        "bad = [m for m in sys.modules if m.startswith(('whet.runtime', 'fastapi'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_request_asked_again_after_a_correction_is_a_requery_not_a_new_request():
    # bench run DZ: "What date is 60 days after 2026-05-11?", a wrong answer, "That's not what I asked.", a call
    # to add_note, then the request word for word: read against the correction alone it was "moved on" (+1)
    asked = "What date is 60 days after 2026-05-11?"
    context = [*CONTEXT[:1], {"role": "user", "content": asked}, {"role": "assistant", "content": "It is 02:07 in London."},
               {"role": "user", "content": "That's not what I asked."}]  # fmt: skip
    verdict = _rules(_turn("user_message", {"messages": [{"role": "user", "content": asked}]}, prompt_messages=context))
    assert (verdict.score, verdict.reason) == (-1, "the user asked again")
    assert verdict.hint == "The user had to ask again: What date is 60 days after 2026-05-11"
    # after a correction that names a value too
    context[-1] = {"role": "user", "content": "No, I meant the date in 2027."}
    assert _rules(_turn("user_message", {"messages": [{"role": "user", "content": asked}]}, prompt_messages=context)).score == -1
    # an earlier request the user moved on from is not the one answered: asking it again is a new request
    moved_on = [*context[:3], {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You're welcome!"},
                {"role": "user", "content": "Note that my shoe size is 43."}]  # fmt: skip
    verdict = _rules(_turn("user_message", {"messages": [{"role": "user", "content": asked}]}, prompt_messages=moved_on))
    assert (verdict.score, verdict.reason) == (1, "the user moved on")
    # nor does thanks tie a request to the one before it
    thanked = [*context[:3], {"role": "user", "content": "Thanks!"}]
    verdict = _rules(_turn("user_message", {"messages": [{"role": "user", "content": asked}]}, prompt_messages=thanked))
    assert (verdict.score, verdict.reason) == (1, "the user moved on")


def test_a_reply_that_repeats_the_whole_request_inside_more_words_is_a_requery():
    from whet.learner.judge import is_requery

    assert is_requery("Is it late at home? Please answer the question.", "Is it late at home?")
    assert is_requery("I asked: What time is it for Sam?", "What time is it for Sam?")
    assert not is_requery("What time is it in Paris?", "What time is it at home?")  # a new request
    assert not is_requery("Thanks!", "Is it late at home?")


def test_a_lesson_is_keyed_by_what_was_asked_not_by_the_correction_and_a_reask_teaches_no_lesson():
    from types import SimpleNamespace

    from whet.learner.judge import Verdict
    from whet.learner.lessons import lesson_for

    asked = [{"role": "user", "content": "Is it late at home?"}, {"role": "assistant", "content": "It is 9:00 in Paris."},
             {"role": "user", "content": "Is it late at home? Please answer the question."},
             {"role": "assistant", "content": "It is 9:00 in Paris."}, {"role": "user", "content": "No, I meant Lisbon time."}]
    call = {"function": {"name": "now", "arguments": '{"timezone": "Lisbon"}'}}
    retry = SimpleNamespace(prompt_messages=asked, tool_calls=[call], next_state_kind=None, next_state=None)
    text, kind = lesson_for(Verdict(1, None, "the user said thanks", "rules"), [retry])
    assert (text, kind) == ('When asked "Is it late at home?": calling now({"timezone": "Lisbon"}) was right.', "success")
    bare = Verdict(-1, "The user said it was wrong: That's wrong", "the user corrected the answer", "rules")
    assert lesson_for(bare, [retry]) is None  # says only that it was wrong: nothing to reuse
    reask = Verdict(-1, "The user had to ask again: Is it late at home", "the user asked again", "rules")
    assert lesson_for(reask, [SimpleNamespace(prompt_messages=asked[:1], tool_calls=[], next_state_kind=None,
                                              next_state=None)]) is None  # fmt: skip


def test_a_call_that_carries_nothing_the_correction_named_is_never_a_success_lesson():
    from types import SimpleNamespace

    from whet.learner.judge import Verdict
    from whet.learner.lessons import ignores_correction, lesson_for

    corrected = [{"role": "user", "content": "Can I call Sam now, what time is it there?"},
                 {"role": "assistant", "content": "It is 10:31 in Sydney."},
                 {"role": "user", "content": "No, I meant Tokyo time, Sam lives in Tokyo."}]  # fmt: skip

    def retry(arguments, messages=corrected):
        call = {"id": "c1", "function": {"name": "now", "arguments": arguments}}
        return SimpleNamespace(prompt_messages=messages, tool_calls=[call], next_state_kind=None, next_state=None)

    moved_on = Verdict(1, None, "the user moved on", "rules")  # the answer said "Tokyo"; the call asked for Tbilisi
    assert ignores_correction(retry('{"timezone": "Tbilisi"}'))
    assert lesson_for(moved_on, [retry('{"timezone": "Tbilisi"}')]) is None
    for heeded in ('{"timezone": "Tokyo"}', '{"timezone": "Asia/Tokyo"}'):
        assert not ignores_correction(retry(heeded))
        assert "Tokyo" in lesson_for(moved_on, [retry(heeded)])[0]
    # what the request already said is not what the correction named; a number can be named
    listed = [{"role": "user", "content": "Remind me to water the plants."}, {"role": "assistant", "content": "Done."},
              {"role": "user", "content": "No, put it on my errands list."}]  # fmt: skip
    note = '{{"text": "water the plants", "list_name": "{}", "kind": "todo"}}'
    assert ignores_correction(retry(note.format("todo"), listed))
    assert not ignores_correction(retry(note.format("errands"), listed))
    km = [{"role": "user", "content": "How far is 15 km?"}, {"role": "user", "content": "No, I meant 12 km."}]
    assert not ignores_correction(retry('{"value": 12, "from_unit": "km"}', km))
    # a first try, a correction that names nothing, and a reply that is no correction are not judged here
    assert not ignores_correction(retry('{"timezone": "Tbilisi"}', corrected[:1]))
    wrong = [*corrected[:2], {"role": "user", "content": "That's wrong."}]
    assert not ignores_correction(retry('{"timezone": "Tbilisi"}', wrong))
    thanks = [*corrected[:2], {"role": "user", "content": "Thanks! And the time in Paris?"}]
    assert not ignores_correction(retry('{"timezone": "Paris"}', thanks))


def test_a_success_lesson_leaves_out_the_calls_that_failed():
    from types import SimpleNamespace

    from whet.learner.judge import Verdict
    from whet.learner.lessons import lesson_for

    asked = [{"role": "user", "content": "Is it late at home?"}]
    bad = {"id": "c1", "function": {"name": "now", "arguments": '{"timezone": "Champagne"}'}}
    good = {"id": "c2", "function": {"name": "now", "arguments": '{"timezone": "Lisbon"}'}}

    def step(call, content):
        results = {"results": [{"tool_call_id": call["id"], "name": "now", "content": content}]}
        return SimpleNamespace(prompt_messages=asked, tool_calls=[call], next_state_kind="tool_result", next_state=results)

    thanks = Verdict(1, None, "the user said thanks", "rules")
    failed = step(bad, "error: Unknown timezone 'Champagne'.")
    assert lesson_for(thanks, [failed]) is None  # the answer did not come from that call
    text, kind = lesson_for(thanks, [failed, step(good, '{"time": "09:00"}')])
    assert kind == "success" and "Lisbon" in text and "Champagne" not in text


def test_a_success_that_holds_only_the_requests_own_words_teaches_no_lesson():
    from types import SimpleNamespace

    from whet.learner.judge import Verdict
    from whet.learner.lessons import lesson_for, says_more

    thanks = Verdict(1, None, "the user said thanks", "rules")

    def thanked(request, name, arguments):
        call = {"id": "c1", "function": {"name": name, "arguments": arguments}}
        turn = SimpleNamespace(prompt_messages=[{"role": "user", "content": request}], tool_calls=[call],
                               next_state_kind=None, next_state=None)
        return lesson_for(thanks, [turn])

    # the request spells every value: the next such request spells its own
    assert thanked("What date is 60 days after 2026-05-11?", "add_to_date", '{"date": "2026-05-11", "days": 60}') is None
    assert thanked("Put book the dentist on the car list.", "add_note",
                   '{"text": "book the dentist", "list_name": "car"}') is None
    assert thanked("What's 22 plus 45?", "add_note", '{"text": "22 plus 45"}') is None  # thanked at random
    assert thanked("Convert 40 celsius to fahrenheit.", "convert",
                   '{"value": 40.0, "from_unit": "Celsius", "to_unit": "fahrenheit"}') is None  # 40.0 is the 40 asked
    # a word the request did not have is what the lesson is for
    text, kind = thanked("What time is it at home?", "now", '{"timezone": "Seoul"}')
    assert kind == "success" and "Seoul" in text
    assert thanked("How hot is 12 °C?", "convert", '{"value": 12, "from_unit": "celsius", "to_unit": "kelvin"}')
    assert thanked("Can you remind me to print the tickets?", "add_note", '{"text": "print the tickets", "list_name": "work"}')
    assert thanked("What's 22 plus 45?", "calculate", '{"expression": "22 + 45.5"}')  # a number not asked
    assert says_more("Note this.", [{"name": "add_note", "arguments": "{not json"}])  # unreadable: kept, as before
    # a hint is a lesson whatever it names: the user said it
    hint = Verdict(-1, 'The user meant "40 celsius"', "the user corrected the answer", "rules")
    turn = SimpleNamespace(prompt_messages=[{"role": "user", "content": "Convert 40 celsius to fahrenheit."}],
                           tool_calls=[], next_state_kind=None, next_state=None)
    assert lesson_for(hint, [turn])[1] == "hint"


def test_thanks_said_to_a_wrong_answer_before_the_correction_is_not_what_was_asked():
    """"Thank you!" to a wrong answer, then "No, I meant Lisbon time.": the lesson is keyed by the
    request, not by the thanks (a lesson keyed "Thank you!" is found for nothing the user asks)."""
    from whet.learner.judge import is_acknowledgement
    from whet.learner.lessons import asked_text

    for said in ("Thank you!", "Perfect, thank you.", "That's right, thanks.", "Got it.", "Ok.", "Good to know."):
        assert is_acknowledgement(said), said
        messages = [{"role": "user", "content": "Is it late at home?"}, {"role": "assistant", "content": "9:00 in Paris."},
                    {"role": "user", "content": said}, {"role": "assistant", "content": "You're welcome!"},
                    {"role": "user", "content": "No, I meant Lisbon time."}]  # fmt: skip
        assert asked_text(messages) == "Is it late at home?"
    for request in ("Thanks! And the time in Paris?", "Great, now note that I'm out tomorrow.", "Okay, what is 2 plus 2?",
                    "Thanks, but not Paris, Lisbon.", "What time is it in Tokyo?"):  # fmt: skip
        assert not is_acknowledgement(request), request
    followed = [{"role": "user", "content": "Is it late at home?"}, {"role": "assistant", "content": "9:00 in Lisbon."},
                {"role": "user", "content": "Thanks! And the time in Paris?"}]  # fmt: skip
    assert asked_text(followed) == "Thanks! And the time in Paris?"


def test_thanks_for_an_answer_that_misreports_its_call_teach_no_success_lesson():
    from types import SimpleNamespace

    from whet.learner.judge import Verdict
    from whet.learner.lessons import lesson_for, misreported

    thanks = Verdict(1, None, "the user said thanks", "rules")

    def request(asked, arguments, name, result, answer):
        messages = [{"role": "user", "content": asked}]
        call = {"id": "c1", "function": {"name": name, "arguments": arguments}}
        state = {"results": [{"role": "tool", "tool_call_id": "c1", "name": name, "content": result}]}
        called = SimpleNamespace(prompt_messages=messages, tool_calls=[call], next_state_kind="tool_result",
                                 next_state=state, response_text="<tool_call>…</tool_call>")
        answered = SimpleNamespace(prompt_messages=messages, tool_calls=[], next_state_kind="user_message",
                                   next_state=None, response_text=answer)
        return [called, answered]

    # a look-alike lesson's list written over the one the request named; the answer names the request's
    note = '{"text": "order new glasses", "list_name": "travel", "kind": "todo"}'
    saved = '{"id": 12, "text": "order new glasses", "list": "travel", "kind": "todo"}'
    lied = request("Add order new glasses to my errands list.", note, "add_note", saved,
                   "Added order new glasses to your errands list.")
    assert misreported(lied[0], lied[1].response_text)
    assert lesson_for(thanks, lied) is None
    # the same call, reported as it was: the user saw "travel" and thanked it
    told = request("Add order new glasses to my errands list.", note, "add_note", saved,
                   "Added order new glasses to your travel list.")
    assert not misreported(told[0], told[1].response_text)
    assert '"list_name": "travel"' in lesson_for(thanks, told)[0]
    # an answer that shows what the call added, or only what the tool returned, reports the call
    home = request("What time is it at home?", '{"timezone": "Lisbon"}', "now",
                   '{"timezone": "Europe/Lisbon", "time": "21:57:32"}', "It is 21:57 on Friday in Lisbon.")
    assert lesson_for(thanks, home)[1] == "success"
    km = request("The hotel is 50 km from the airport, how far is that?",
                 '{"value": 50, "from_unit": "km", "to_unit": "miles"}', "convert",
                 '{"value": 50.0, "from_unit": "km", "to_unit": "mi", "text": "50 km = 31.07 mi"}', "50 km = 31.07 mi.")
    assert not misreported(km[0], km[1].response_text)
    assert '"to_unit": "miles"' in lesson_for(thanks, km)[0]
