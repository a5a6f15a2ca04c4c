"""Lessons: what a judged request teaches, in words, for retrieval memory.

A verdict with a hint, or a clear success (a +1 on a request that used tools),
becomes a lesson at once, so the very next request benefits before any weight
changes. The lesson names the request it came from, because retrieval matches
lessons to new requests by similarity. A success whose calls hold nothing but
what the request said ("What date is 60 days after 2026-05-11?" answered with
``add_to_date(2026-05-11, 60)``) teaches no lesson: the next such request says
its own values, and shown beside it the copy only misleads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from whet.learner.judge import CONTENT_FREE_HINTS, Verdict, correction_hint, request_asks
from whet.learner.prompt import canonical_arguments, content_text, parse_arguments, user_texts
from whet.memory.index import LESSON_ASKED, argument_values
from whet.memory.tables import Turn

MAX_CHARS = 300


def lesson_for(verdict: Verdict, request: Sequence[Turn]) -> tuple[str, str] | None:
    """(text, kind) of the lesson a request's final verdict teaches, or None.

    ``request``: the request's turns in step order; the verdict is on the last one.
    """
    if not request:
        return None
    asked = asked_text(request[0].prompt_messages)
    if verdict.hint and not verdict.hint.startswith(CONTENT_FREE_HINTS):  # "wrong" alone: nothing to reuse
        return lesson_text(asked, hint=verdict.hint), "hint"
    if verdict.score <= 0:
        return None
    answer = _answer(request[-1])
    calls = [call["function"] for turn in request if not ignores_correction(turn) and not misreported(turn, answer)
             for call in turn.tool_calls if call.get("id") not in _failed(turn)]  # fmt: skip
    if calls and says_more(asked, calls):
        return lesson_text(asked, calls=calls), "success"
    return None


def says_more(asked: str, calls: Sequence[Mapping[str, Any]]) -> bool:
    """Whether ``calls`` (OpenAI function dicts) pass a word the request ``asked`` did not have:
    the user's city for "What time is it at home?", the list for "Remind me to ...", the unit
    for "How hot is 12 °C?". A call built only from the request's own words (a sum, a date and
    its days, "Put X on the car list.") is what any request of its kind spells for itself.

    Why it matters: beside a new date request, such a lesson about another date made the model
    drop the new request's days (bench/results/RUNS.md, stop 46), and a user who thanks at random
    would make "calling add_note(22 plus 45)" a lesson for every sum; a lesson that carries
    nothing new cannot help the request it is shown to."""
    said = _words(asked)
    for call in calls:
        arguments = parse_arguments(call.get("arguments"))
        values = argument_values(arguments) if isinstance(arguments, dict) else [str(call.get("arguments") or "")]
        if any(_words(_plain_number(value)) - said for value in values):
            return True
    return False


def _plain_number(value: str) -> str:
    """A whole number written as a float ("40.0") as the request writes it ("40")."""
    try:
        number = float(value)
    except ValueError:
        return value
    return str(int(number)) if number.is_integer() and abs(number) < 1e15 else value


def _results(turn: Turn) -> list[dict[str, Any]]:
    """The tool results that followed ``turn`` (none when its next state was not a tool's)."""
    if turn.next_state_kind != "tool_result":
        return []
    return (turn.next_state or {}).get("results") or []


def _carried(turn: Turn) -> set[str]:
    """The words of ``turn``'s tool calls' argument values."""
    arguments = [parse_arguments(call["function"].get("arguments")) for call in turn.tool_calls]
    return {w for a in arguments if isinstance(a, dict) for value in argument_values(a) for w in _words(value)}


def _failed(turn: Turn) -> set[str]:
    """The ids of ``turn``'s tool calls whose result was an error: a user who was satisfied in
    the end did not make a call that failed "right" (the answer came from somewhere else)."""
    return {r.get("tool_call_id") for r in _results(turn)
            if content_text(r.get("content")).strip().lower().startswith("error:")}  # fmt: skip


def ignores_correction(turn: Turn) -> bool:
    """Whether ``turn`` answered a correction that named what was meant with tool calls that carry
    none of it: "No, I meant Tokyo time, Sam lives in Tokyo." answered with ``now(Tbilisi)``.

    The user may still move on (the answer said "Tokyo" whatever the tool returned), and the
    request ends well; the call was not what made it so, and neither a lesson nor training may say
    it was right. What the correction named is its words that the request did not have; a call
    heeds it when one of its argument values holds one of them. Corrections that name nothing
    ("That's wrong.") leave nothing to check."""
    if not turn.tool_calls:
        return False
    asks = user_texts(turn.prompt_messages)
    if len(asks) < 2:
        return False
    hint = correction_hint(asks[-1])
    if hint is None or hint.startswith(CONTENT_FREE_HINTS):
        return False
    named = _words(asks[-1]) - _words(_asked(asks))
    return bool(named) and not named & _carried(turn)


def misreported(turn: Turn, answer: str) -> bool:
    """Whether ``answer``, the reply the user read, told them the request's own words where
    ``turn``'s calls put words of their own: "Add order new glasses to my errands list." answered
    with ``add_note(list_name="travel")`` (a look-alike lesson's list copied over the one the
    request named) and then "Added order new glasses to your errands list.".

    The user sees only the answer; thanks for it vouch for what it said, not for a call it did not
    report. Such a lesson taught every later reminder the wrong list (bench/results/RUNS.md, stop
    62). The answer misreports when it shows none of the words the calls added to the request and
    states a word of the user's that neither the calls nor their results hold. An answer that
    shows what a call added ("It is 21:57 in Lisbon.") or only what it returned ("50 km = 31.07
    mi.") reports the call."""
    if not turn.tool_calls or not answer:
        return False
    asked = set().union(*map(_words, request_asks(user_texts(turn.prompt_messages))))
    carried = _carried(turn)
    said = _words(answer)
    if (carried - asked) & said:
        return False
    returned = set().union(*(_words(content_text(r.get("content"))) for r in _results(turn)))
    return bool(said & (asked - carried - returned))


def _answer(turn: Turn) -> str:
    """The reply ``turn`` gave the user in words ("" when it called a tool)."""
    return "" if turn.tool_calls else (turn.response_text or "")


def _words(text: str) -> set[str]:
    """The words of ``text`` that can name something: numbers, and words of three letters or more."""
    return {w for w in re.findall(r"\w+", text.casefold()) if len(w) >= 3 or w.isdigit()}


def asked_text(messages: Sequence[dict[str, Any]]) -> str:
    """What the user asked for: the last user message that is not a correction, a re-ask of the
    one before it, or thanks. After "No, I meant Lisbon time." the request is still "What time is it
    at home?", and a lesson keyed by the correction would never be retrieved for the next such
    request; nor one keyed by "Thank you!", which a user said to the wrong answer before correcting
    it (the noisy profile's lessons were keyed so)."""
    return _asked(user_texts(messages))


def _asked(asks: Sequence[str]) -> str:
    """:func:`asked_text` over the user messages' texts."""
    request = request_asks(asks)
    return request[0] if request else ""


def lesson_text(asked: str, *, hint: str | None = None, calls: Sequence[Mapping[str, Any]] = ()) -> str:
    """The lesson's words: the request it came from, then the hint, or the calls that were right.

    ``calls``: OpenAI function dicts (``name``, ``arguments``). The demo policy is trained on
    lessons written by this function, so that it can read them.
    """
    asked = asked.strip()
    where = LESSON_ASKED.format(asked=_clip(asked, 120)) if asked else ""
    if hint:
        return _clip(where + hint, MAX_CHARS)
    used = ", ".join(f"{c['name']}({canonical_arguments(c.get('arguments', '{}'))})" for c in calls)
    return _clip(f"{where}calling {used} was right.", MAX_CHARS)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"
