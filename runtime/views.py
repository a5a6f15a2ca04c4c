"""What the web page reads: sessions as conversations, and the learner's state for one user.

Pure reads of the store shaped for people (the page at ``/``); the routes in ``app.py`` only
scope them to the calling user. Table rows never leave: each view maps them to a model from
``whet.runtime.schemas``.
"""

from __future__ import annotations

import json
from itertools import groupby
from typing import Any

from whet.memory.store import Store
from whet.memory.tables import Adapter, Approval, Judgment, Turn
from whet.runtime.approvals import approval_view
from whet.runtime.chat import new_session_messages
from whet.runtime.chat_format import parse_tool_calls
from whet.runtime.schemas import (
    AdapterView,
    Exchange,
    JudgedTurn,
    LearningView,
    LessonView,
    SessionDetail,
    SessionSummary,
    ToolStep,
)

SESSION_TURNS = 1000  # turns read per session (a long session shows its latest requests)


async def session_list(store: Store, user_id: str, limit: int) -> list[SessionSummary]:
    out = []
    for session in await store.list_sessions(user_id, limit):
        turns = await store.list_turns(session_id=session.id, limit=SESSION_TURNS)
        if not turns:
            continue  # a session named by a request that failed before its first turn
        first = min(turns, key=lambda t: (t.created_at, t.step))
        title = _user_text(first) or "(tool results)"
        out.append(SessionSummary(id=session.id, title=title[:120], turns=len(turns),
                                  created_at=session.created_at, updated_at=session.updated_at))  # fmt: skip
    return out


async def session_detail(store: Store, session_id: str) -> SessionDetail:
    turns = sorted(await store.list_turns(session_id=session_id, limit=SESSION_TURNS),
                   key=lambda t: (t.created_at, t.step))  # fmt: skip
    pending = {a.turn_id: a for a in await store.list_approvals(status="pending", session_id=session_id)}
    exchanges = []
    for request_id, group in groupby(turns, key=lambda t: t.request_id):
        exchanges.append(await _exchange(store, request_id, list(group), pending))
    messages: list[dict[str, Any]] = []
    for exchange in exchanges:
        if exchange.user is not None:
            messages.append({"role": "user", "content": exchange.user})
        messages.append({"role": "assistant", "content": exchange.answer})
    return SessionDetail(id=session_id, exchanges=exchanges, messages=messages)


async def _exchange(store: Store, request_id: str, steps: list[Turn], pending: dict[str, Approval]) -> Exchange:
    tools, texts = [], []
    approval = pending.get(steps[-1].id)
    held = {c["id"] for c in approval.calls} if approval else set()
    for turn in steps:
        content, _, _ = parse_tool_calls(turn.response_text)
        if content:
            texts.append(content)
        results = {}
        if turn.next_state_kind == "tool_result":
            results = {r.get("tool_call_id"): r.get("content", "") for r in (turn.next_state or {}).get("results", [])}
        for call in turn.tool_calls:
            result = results.get(call["id"])
            tools.append(ToolStep(name=call["function"]["name"], arguments=call["function"].get("arguments", "{}"),
                                  result=result, is_error=bool(result and result.startswith("error:")),
                                  waiting=call["id"] in held))  # fmt: skip
    answer = steps[-1]
    feedback = [{"score": f.score, "text": f.text} for f in await store.list_feedback(answer.id)]
    judgment = await store.get_judgment(answer.id)
    verdict = None if judgment is None else {"score": judgment.score, "hint": judgment.hint, "reason": judgment.reason}
    return Exchange(
        request_id=request_id, user=_user_text(steps[0]), tools=tools, answer="\n\n".join(texts),
        turn_id=answer.id, policy_version=answer.policy_version, created_at=steps[0].created_at,
        feedback=feedback, verdict=verdict, approval=approval_view(approval) if approval else None,
    )


def _user_text(turn: Turn) -> str | None:
    """What the user said in the request that produced ``turn`` (None: it carried tool results)."""
    said = [m for m in new_session_messages(turn.prompt_messages) if m["role"] == "user"]
    return said[-1].get("content") if said else None


async def learning_view(store: Store, scope: str, learner: dict[str, Any] | None, user_id: str) -> LearningView:
    adapters = await store.list_adapters(scope="global") + await store.list_adapters(scope="user", user_id=user_id)
    adapters.sort(key=lambda a: (a.created_at, a.id))
    global_live = await store.live_adapter("global")
    user_live = await store.live_adapter("user", user_id)
    live = {"global": global_live.id if global_live else None, "user": user_live.id if user_live else None}
    judged = await store.recent_judgments(user_id, limit=200)
    lessons = await store.list_lessons(user_id)
    return LearningView(
        scope=scope, learner=learner, live=live,
        adapters=[_adapter_view(a) for a in adapters],
        judgments=[_judged(j, t) for j, t in judged],
        lessons=[LessonView.model_validate(lesson, from_attributes=True) for lesson in lessons],
    )


def _adapter_view(adapter: Adapter) -> AdapterView:
    metrics = adapter.metrics or {}
    rolled_back = metrics.get("rolled_back")
    status = "rolled back" if rolled_back and adapter.status == "retired" else adapter.status
    return AdapterView(
        id=adapter.id, scope=adapter.scope, user_id=adapter.user_id, status=status, parent=adapter.parent,
        created_at=adapter.created_at, promoted_at=adapter.promoted_at, gate=metrics.get("gate"),
        train=metrics.get("train"), seconds=metrics.get("seconds"), repairs=metrics.get("repairs") or None,
        replayed=metrics.get("replayed") or None, rolled_back=rolled_back,
    )


def _judged(judgment: Judgment, turn: Turn) -> JudgedTurn:
    content, _, _ = parse_tool_calls(turn.response_text)
    calls = ", ".join(f"{c['function']['name']}({c['function'].get('arguments', '')})" for c in turn.tool_calls)
    action = " ".join(part for part in (content, calls and f"[calls {calls}]") if part)
    return JudgedTurn(
        turn_id=turn.id, session_id=turn.session_id, created_at=judgment.created_at, score=judgment.score,
        hint=judgment.hint, reason=judgment.reason, judge=judgment.judge, policy_version=judgment.policy_version,
        action=action[:400], next_state=_next_state_text(turn)[:400],
    )


def _next_state_text(turn: Turn) -> str:
    state = turn.next_state or {}
    if turn.next_state_kind == "user_message":
        return " ".join(str(m.get("content") or "") for m in state.get("messages", []))
    if turn.next_state_kind == "tool_result":
        return " ".join(str(r.get("content", "")) for r in state.get("results", []))
    if turn.next_state_kind == "feedback":
        thumbs = {1.0: "👍", -1.0: "👎"}.get(state.get("score"), f"score {state.get('score')}")
        return f"{thumbs} {state.get('text') or ''}".strip()
    return json.dumps(state)[:400] if state else ""
