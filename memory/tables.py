"""The experience store's tables, and the models that cross its boundary.

Schemas are split by direction: ``TurnCreate`` is what the runtime supplies,
``Turn`` the table row, ``TurnPublic`` what the API returns; a table row never
leaves the API. Timestamps are timezone-aware UTC in Python whatever the
database keeps (SQLite has no time zones: values are stored as naive UTC and
read back aware).
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime
from typing import Any

from pydantic import model_validator
from sqlalchemy import JSON, DateTime
from sqlalchemy.types import TypeDecorator
from sqlmodel import AutoString, Field, SQLModel

NEXT_STATE_KINDS = frozenset({"tool_result", "user_message", "feedback"})
ADAPTER_SCOPES = frozenset({"global", "user"})
ADAPTER_STATUSES = frozenset({"candidate", "live", "rejected", "retired"})
APPROVAL_STATUSES = frozenset({"pending", "approved", "rejected", "expired"})
# the judge of a turn whose request said ``store: false``: served and kept for its session, never learned from
UNLEARNED_JUDGE = "store:false"


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always timezone-aware UTC on the Python side.

    Naive datetimes given to the database are taken to be UTC already.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        # SQLite keeps text without an offset; store naive UTC so text order is time order
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


_NUL, _ESC = "\x00", "\ue000"  # the escape is a private-use character, doubled as ESC+"1"
_TO_STORE = re.compile("[\x00\ue000]")
_FROM_STORE = re.compile("\ue000([01])")


class NulSafeText(TypeDecorator[str]):
    """Text that may hold NUL, which PostgreSQL text columns refuse: escaped reversibly there.

    On PostgreSQL NUL is kept as U+E000 "0" and U+E000 itself as U+E000 "1"; SQLite keeps
    NUL as it is, so its rows are unchanged. (JSON columns need nothing: NUL is ``\\u0000``
    in JSON text, which the ``json`` type keeps.)
    """

    impl = AutoString
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Any) -> str | None:
        if value is None or dialect.name != "postgresql" or not _TO_STORE.search(value):
            return value
        return _TO_STORE.sub(lambda m: _ESC + ("0" if m.group() == _NUL else "1"), value)

    def process_result_value(self, value: str | None, dialect: Any) -> str | None:
        if value is None or dialect.name != "postgresql" or _ESC not in value:
            return value
        return _FROM_STORE.sub(lambda m: _NUL if m.group(1) == "0" else _ESC, value)


# ----------------------------------------------------------------------------- tables


class User(SQLModel, table=True):
    __tablename__ = "users"

    id: str = Field(primary_key=True)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class ChatSession(SQLModel, table=True):
    __tablename__ = "sessions"

    id: str = Field(primary_key=True)
    user_id: str = Field(foreign_key="users.id", index=True)
    # hash of the conversation as it stands after the last reply (computed by the runtime)
    tip_hash: str | None = Field(default=None, index=True)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class TurnCreate(SQLModel):
    """Everything the runtime supplies for one model action (one agent step)."""

    session_id: str = Field(foreign_key="sessions.id", index=True)
    user_id: str = Field(foreign_key="users.id", index=True)
    # one chat request = several turns, one per agent step
    request_id: str = Field(index=True)
    step: int = Field(ge=0)
    model: str
    # adapter version; None = base weights
    policy_version: str | None = None
    prompt_messages: list[dict[str, Any]] = Field(default_factory=list, sa_type=JSON)
    tool_names: list[str] = Field(default_factory=list, sa_type=JSON)
    prompt_token_ids: list[int] = Field(default_factory=list, sa_type=JSON)
    response_text: str = Field(default="", sa_type=NulSafeText)
    response_token_ids: list[int] = Field(default_factory=list, sa_type=JSON)
    response_logprobs: list[float] = Field(default_factory=list, sa_type=JSON)
    # OpenAI shape: {"id", "type": "function", "function": {"name", "arguments"}}
    tool_calls: list[dict[str, Any]] = Field(default_factory=list, sa_type=JSON)

    @model_validator(mode="after")
    def _logprobs_match_tokens(self) -> TurnCreate:
        ids, logprobs = self.response_token_ids, self.response_logprobs
        if ids and logprobs and len(ids) != len(logprobs):
            raise ValueError(
                f"response_logprobs has {len(logprobs)} entries but response_token_ids has {len(ids)}: "
                "record one behaviour log-prob per generated token (or none at all)"
            )
        return self


def new_turn_id() -> str:
    """A fresh turn id; the runtime may draw one before the turn is written (streaming)."""
    return "turn_" + uuid.uuid4().hex


class _TurnOutcome(SQLModel):
    closed_at: datetime | None = Field(default=None, sa_type=UTCDateTime, index=True)
    # "tool_result" | "user_message" | "feedback"
    next_state_kind: str | None = None
    next_state: dict[str, Any] | None = Field(default=None, sa_type=JSON)


class Turn(TurnCreate, _TurnOutcome, table=True):
    __tablename__ = "turns"

    id: str = Field(default_factory=new_turn_id, primary_key=True)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime, index=True)


class TurnPublic(TurnCreate, _TurnOutcome):
    """A turn as the API returns it."""

    id: str
    created_at: datetime


class _FeedbackFields(SQLModel):
    turn_id: str = Field(foreign_key="turns.id", index=True)
    user_id: str
    score: float = Field(ge=-1.0, le=1.0)
    text: str | None = Field(default=None, sa_type=NulSafeText)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class Feedback(_FeedbackFields, table=True):
    __tablename__ = "feedback"

    id: int | None = Field(default=None, primary_key=True)


class FeedbackPublic(_FeedbackFields):
    id: int


class Adapter(SQLModel, table=True):
    __tablename__ = "adapters"

    # the version, e.g. "global-0003"
    id: str = Field(primary_key=True)
    scope: str = "global"
    user_id: str | None = Field(default=None, index=True)
    path: str
    status: str = "candidate"
    parent: str | None = None
    metrics: dict[str, Any] = Field(default_factory=dict, sa_type=JSON)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    promoted_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class AdapterPublic(SQLModel):
    id: str
    scope: str
    user_id: str | None
    path: str
    status: str
    parent: str | None
    metrics: dict[str, Any]
    created_at: datetime
    promoted_at: datetime | None


class _LessonFields(SQLModel):
    user_id: str = Field(foreign_key="users.id", index=True)
    text: str = Field(sa_type=NulSafeText)
    kind: str = "hint"
    source_turn_id: str | None = None
    # the similarity a request needs to this lesson for the agent to show it, where the lesson check
    # narrowed it (it broke pinned turns as close as that, less a margin); None: the agent's floor
    min_score: float | None = None
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class Lesson(_LessonFields, table=True):
    __tablename__ = "lessons"

    id: int | None = Field(default=None, primary_key=True)


class LessonPublic(_LessonFields):
    id: int


class Judgment(SQLModel, table=True):
    """A judge's verdict on one closed turn, and whether training has consumed it.

    ``trained_in`` is the learner's consumption cursor: the adapter version whose
    batch trained this turn (set in the same transaction that registers that
    version), so each turn is trained at most once per adapter lineage.
    """

    __tablename__ = "judgments"

    turn_id: str = Field(foreign_key="turns.id", primary_key=True)
    user_id: str = Field(index=True)
    request_id: str = Field(index=True)
    # copied from the turn: the rolling score of a live adapter is a query on this column
    policy_version: str | None = Field(default=None, index=True)
    score: int = Field(ge=-1, le=1)
    hint: str | None = Field(default=None, sa_type=NulSafeText)
    reason: str = Field(default="", sa_type=NulSafeText)
    judge: str = ""
    split: str = "train"  # train | holdout (the promotion gate replays holdout turns)
    trainable: bool = False  # has the engine's token ids and log-probs, and a signal to learn from
    trained_in: str | None = Field(default=None, index=True)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class JudgmentPublic(SQLModel):
    turn_id: str
    user_id: str
    request_id: str
    policy_version: str | None
    score: int
    hint: str | None
    reason: str
    judge: str
    split: str
    trainable: bool
    trained_in: str | None
    created_at: datetime


def new_approval_id() -> str:
    return "appr_" + uuid.uuid4().hex


class Approval(SQLModel, table=True):
    """A model step held until a person decides: its tool calls run only once approved.

    ``calls`` are the step's tool calls that need approval (OpenAI shape); ``resume`` is the
    agent's own record of where the request stood, so the decision can continue it on any
    replica. The status moves once, from "pending" to "approved", "rejected" or "expired".
    """

    __tablename__ = "approvals"

    id: str = Field(default_factory=new_approval_id, primary_key=True)
    turn_id: str = Field(foreign_key="turns.id", index=True)  # the held step
    session_id: str = Field(index=True)
    user_id: str = Field(index=True)  # who owns the turn, and so may decide
    request_id: str
    calls: list[dict[str, Any]] = Field(default_factory=list, sa_type=JSON)
    resume: dict[str, Any] = Field(default_factory=dict, sa_type=JSON)
    status: str = Field(default="pending", index=True)
    reason: str | None = Field(default=None, sa_type=NulSafeText)
    decided_by: str | None = None
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    expires_at: datetime = Field(sa_type=UTCDateTime, index=True)
    decided_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


TABLES = [User.__table__, ChatSession.__table__, Turn.__table__, Feedback.__table__,
          Adapter.__table__, Lesson.__table__, Judgment.__table__, Approval.__table__]  # fmt: skip
