"""Recording experience: store first, then the event.

Every write that others react to goes through :class:`Experience`, so the
rule "the store commits first; only then is an event published" lives in one
place. Events carry ids only; a consumer that was away catches up from the
store.
"""

from __future__ import annotations

from typing import Any

from whet.memory.bus import FEEDBACK_ADDED, TURN_CLOSED, Bus
from whet.memory.store import Store
from whet.memory.tables import UNLEARNED_JUDGE, Feedback, Judgment, Turn, TurnCreate


class Experience:
    def __init__(self, store: Store, bus: Bus) -> None:
        self.store = store
        self.bus = bus

    async def record(self, turn: TurnCreate, turn_id: str | None = None, *, learn: bool = True,
                     tip_hash: str | None = None) -> Turn:  # fmt: skip
        """Store one model action (and the session's new tip, when given). ``learn=False`` (a request
        with ``store: false``): it is kept for its session like any other, with a neutral verdict that
        no judge replaces, so it never becomes a training sample, a lesson or credit."""
        row = await self.store.add_turn(turn, turn_id=turn_id, tip_hash=tip_hash)
        if not learn:
            await self.store.save_judgment(Judgment(
                turn_id=row.id, user_id=row.user_id, request_id=row.request_id, policy_version=row.policy_version,
                score=0, hint=None, reason="the request said store: false", judge=UNLEARNED_JUDGE, split="train",
                trainable=False))  # fmt: skip
        return row

    async def close(self, turn_id: str, kind: str, next_state: dict[str, Any]) -> Turn | None:
        """Close a turn with the next state that followed it; None when it was already closed."""
        turn = await self.store.close_turn(turn_id, kind, next_state)
        if turn is not None:
            await self.bus.publish(
                TURN_CLOSED,
                {"turn_id": turn.id, "session_id": turn.session_id, "user_id": turn.user_id, "kind": kind},
            )
        return turn

    async def close_open(self, session_id: str, kind: str, next_state: dict[str, Any]) -> list[Turn]:
        """Close every turn of the session still waiting for its next state, except a step held
        for approval: a person's decision on it is its next state (or its expiry)."""
        closed = []
        for turn in await self.store.open_turns(session_id, unheld=True):
            done = await self.close(turn.id, kind, next_state)
            if done is not None:
                closed.append(done)
        return closed

    async def feedback(self, turn: Turn, score: float, text: str | None) -> tuple[Feedback, bool]:
        """Store feedback; it also closes the turn when nothing else has. Returns (row, closed_now)."""
        row = await self.store.add_feedback(turn.id, turn.user_id, score, text)
        closed = await self.close(turn.id, "feedback", {"feedback_id": row.id, "score": score, "text": text})
        event = {"feedback_id": row.id, "turn_id": turn.id, "user_id": turn.user_id}
        await self.bus.publish(FEEDBACK_ADDED, event)
        return row, closed is not None
