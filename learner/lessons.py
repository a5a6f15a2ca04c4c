"""Lessons: what a judged request teaches, in words, for retrieval memory.

A verdict with a hint, or a clear success (a +1 on a request that used tools),
becomes a lesson at once, so the very next request benefits before any weight
changes. The lesson names the request it came from, because retrieval matches
lessons to new requests by similarity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from whet.learner.judge import CONTENT_FREE_HINTS, Verdict, correction_hint, is_requery
from whet.learner.prompt import canonical_arguments, content_text
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
    calls = [call["function"] for turn in request for call in turn.tool_calls if call.get("id") not in _failed(turn)]
    if verdict.score > 0 and calls:
        return lesson_text(asked, calls=calls), "success"
    return None


def _failed(turn: Turn) -> set[str]:
    """The ids of ``turn``'s tool calls whose result was an error: a user who was satisfied in
    the end did not make a call that failed "right" (the answer came from somewhere else)."""
    if turn.next_state_kind != "tool_result":
        return set()
    results = (turn.next_state or {}).get("results") or []
    return {r.get("tool_call_id") for r in results
            if content_text(r.get("content")).strip().lower().startswith("error:")}  # fmt: skip


def asked_text(messages: Sequence[dict[str, Any]]) -> str:
    """What the user asked for: the last user message that is not a correction or a re-ask of the
    one before it. After "No, I meant Lisbon time." the request is still "What time is it at home?",
    and a lesson keyed by the correction would never be retrieved for the next such request."""
    asks = [content_text(m.get("content")) for m in messages if m.get("role") == "user"]
    for i in range(len(asks) - 1, 0, -1):
        if correction_hint(asks[i]) is None and not is_requery(asks[i], asks[i - 1]):
            return asks[i]
    return asks[0] if asks else ""


def lesson_text(asked: str, *, hint: str | None = None, calls: Sequence[Mapping[str, Any]] = ()) -> str:
    """The lesson's words: the request it came from, then the hint, or the calls that were right.

    ``calls``: OpenAI function dicts (``name``, ``arguments``). The demo policy is trained on
    lessons written by this function, so that it can read them.
    """
    asked = asked.strip()
    where = f'When asked "{_clip(asked, 120)}": ' if asked else ""
    if hint:
        return _clip(where + hint, MAX_CHARS)
    used = ", ".join(f"{c['name']}({canonical_arguments(c.get('arguments', '{}'))})" for c in calls)
    return _clip(f"{where}calling {used} was right.", MAX_CHARS)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"
