"""Lessons: what a judged request teaches, in words, for retrieval memory.

A verdict with a hint, or a clear success (a +1 on a request that used tools),
becomes a lesson at once, so the very next request benefits before any weight
changes. The lesson names the request it came from, because retrieval matches
lessons to new requests by similarity.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from whet.learner.judge import Verdict
from whet.memory.tables import Turn

MAX_CHARS = 300


def lesson_for(verdict: Verdict, request: Sequence[Turn]) -> tuple[str, str] | None:
    """(text, kind) of the lesson a request's final verdict teaches, or None.

    ``request``: the request's turns in step order; the verdict is on the last one.
    """
    if not request:
        return None
    asked = _last_user_text(request[0].prompt_messages)
    where = f'When asked "{_clip(asked, 120)}": ' if asked else ""
    if verdict.hint:
        return _clip(where + verdict.hint, MAX_CHARS), "hint"
    calls = [call["function"] for turn in request for call in turn.tool_calls]
    if verdict.score > 0 and calls:
        used = ", ".join(f"{c['name']}({_args(c.get('arguments'))})" for c in calls)
        return _clip(f"{where}calling {used} was right.", MAX_CHARS), "success"
    return None


def _last_user_text(messages: Sequence[dict]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user" and isinstance(message.get("content"), str):
            return message["content"].strip()
    return ""


def _args(arguments: object) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments, ensure_ascii=False, sort_keys=True)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"
