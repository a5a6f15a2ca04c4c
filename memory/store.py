"""The experience store: users, sessions, turns, feedback, adapters and lessons.

SQLModel tables on SQLite (WAL) by default, PostgreSQL by URL. The store is the
source of truth: events on the bus carry ids only, and a consumer that was
away catches up from here.

Every public :class:`Store` method is ``async`` and runs its database work in a
worker thread (``anyio.to_thread.run_sync``) with its own short session that
commits before the method returns, so a write never blocks the event loop and
returned rows are detached copies that stay readable afterwards.

Timestamps are timezone-aware UTC in Python whatever the database keeps
(SQLite has no time zones: values are stored as naive UTC and read back aware).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import anyio.to_thread
from pydantic import model_validator
from sqlalchemy import JSON, DateTime, Engine, event, func, or_, update
from sqlalchemy import delete as sa_delete
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError
from sqlalchemy.pool import StaticPool
from sqlalchemy.types import TypeDecorator
from sqlmodel import Field, Session, SQLModel, create_engine, select

T = TypeVar("T")

NEXT_STATE_KINDS = frozenset({"tool_result", "user_message", "feedback"})
ADAPTER_SCOPES = frozenset({"global", "user"})
ADAPTER_STATUSES = frozenset({"candidate", "live", "rejected", "retired"})


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
    response_text: str = ""
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
    text: str | None = None
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
    text: str
    kind: str = "hint"
    source_turn_id: str | None = None
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class Lesson(_LessonFields, table=True):
    __tablename__ = "lessons"

    id: int | None = Field(default=None, primary_key=True)


class LessonPublic(_LessonFields):
    id: int


TABLES = [User.__table__, ChatSession.__table__, Turn.__table__, Feedback.__table__,
          Adapter.__table__, Lesson.__table__]  # fmt: skip


# ----------------------------------------------------------------------------- engine


def open_store(url: str) -> Store:
    """Open (and create the tables of) the store at ``url``.

    ``sqlite:///relative/or/absolute.db`` (parent folder created; WAL journal),
    ``sqlite://`` (in memory, for tests), or ``postgresql://user:pw@host/db``
    (driven by psycopg 3). Raises ``ValueError`` for anything else.
    """
    engine = _create_engine(_parse_url(url))
    SQLModel.metadata.create_all(engine, tables=TABLES)
    return Store(engine)


def _parse_url(url: str) -> URL:
    hint = "use sqlite:///path/to/whet.db or postgresql://user:password@host:5432/dbname"
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"store URL is empty: {hint}")
    try:
        parsed = make_url(url.strip())
    except ArgumentError:
        raise ValueError(f"store URL {url!r} is not a database URL: {hint}") from None
    if parsed.drivername in ("postgresql", "postgres", "postgresql+psycopg"):
        return parsed.set(drivername="postgresql+psycopg")
    if parsed.drivername in ("sqlite", "sqlite+pysqlite"):
        return parsed
    raise ValueError(f"store URL scheme {parsed.drivername!r} is not supported: {hint}")


def _create_engine(url: URL) -> Engine:
    if url.get_backend_name() == "postgresql":
        return create_engine(url, pool_pre_ping=True)
    database = url.database or ""
    connect_args = {"check_same_thread": False}
    if database in ("", ":memory:"):
        # one shared connection, or every thread would see its own empty database
        engine = create_engine(url, connect_args=connect_args, poolclass=StaticPool)
    else:
        path = Path(database).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url.set(database=str(path)), connect_args=connect_args)
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    # writers queue behind each other instead of failing with "database is locked"
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _insert_ignore(db: Session, table: Any, **values: Any) -> int:
    """INSERT that does nothing when the primary key exists (race-free get-or-create)."""
    dialect = postgresql if db.get_bind().dialect.name == "postgresql" else sqlite
    result = db.execute(dialect.insert(table).values(**values).on_conflict_do_nothing())
    return result.rowcount


class _Clock:
    """utcnow that never repeats or goes back within one process, so turn order is total."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = datetime.min.replace(tzinfo=UTC)

    def now(self) -> datetime:
        with self._lock:
            self._last = max(utcnow(), self._last + timedelta(microseconds=1))
            return self._last


# ----------------------------------------------------------------------------- store


class Store:
    """Async access to the experience store. Build with :func:`open_store`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._clock = _Clock()

    async def _run(self, work: Callable[[Session], T]) -> T:
        def call() -> T:
            with Session(self.engine, expire_on_commit=False) as db:
                result = work(db)
                db.commit()
                return result

        return await anyio.to_thread.run_sync(call)

    async def aclose(self) -> None:
        """Dispose of the engine's connections."""
        await anyio.to_thread.run_sync(self.engine.dispose)

    # ---- users and sessions

    async def ensure_user(self, user_id: str) -> None:
        """Create the user if missing; safe to call concurrently for the same new user."""
        _check_id("user_id", user_id)
        await self._run(lambda db: _insert_ignore(db, User.__table__, id=user_id, created_at=utcnow()))

    async def get_session(self, session_id: str) -> ChatSession | None:
        return await self._run(lambda db: db.get(ChatSession, session_id))

    async def create_session(self, user_id: str, session_id: str | None = None) -> ChatSession:
        """Create a session (and its user). An explicit id that exists already is returned when
        it is the same user's, and raises ``PermissionError`` when it belongs to someone else."""
        _check_id("user_id", user_id)
        sid = session_id or "sess_" + uuid.uuid4().hex
        _check_id("session_id", sid)

        def work(db: Session) -> ChatSession:
            now = utcnow()
            _insert_ignore(db, User.__table__, id=user_id, created_at=now)
            _insert_ignore(db, ChatSession.__table__, id=sid, user_id=user_id, tip_hash=None,
                           created_at=now, updated_at=now)  # fmt: skip
            row = db.get(ChatSession, sid)
            if row is None or row.user_id != user_id:
                raise PermissionError(f"session {sid!r} belongs to another user; use a new session id")
            return row

        return await self._run(work)

    async def find_session_by_tip(self, user_id: str, tip_hash: str) -> ChatSession | None:
        """The user's most recently updated session whose conversation ends at ``tip_hash``."""
        query = (
            select(ChatSession)
            .where(ChatSession.user_id == user_id, ChatSession.tip_hash == tip_hash)
            .order_by(ChatSession.updated_at.desc())
            .limit(1)
        )
        return await self._run(lambda db: db.exec(query).first())

    async def set_session_tip(self, session_id: str, tip_hash: str) -> None:
        """Record where the conversation now stands; raises ``KeyError`` for an unknown session."""
        statement = (
            update(ChatSession)
            .where(ChatSession.id == session_id)
            .values(tip_hash=tip_hash, updated_at=utcnow())
        )

        def work(db: Session) -> None:
            if db.execute(statement).rowcount == 0:
                raise KeyError(f"unknown session {session_id!r}")

        await self._run(work)

    # ---- turns

    async def add_turn(self, turn: TurnCreate, *, turn_id: str | None = None) -> Turn:
        """Record one model action. The session must exist and belong to ``turn.user_id``
        (``KeyError`` / ``PermissionError`` otherwise). ``turn_id`` lets the caller name the
        turn before it is written (streaming answers carry the id before the turn exists)."""
        update_fields: dict[str, Any] = {"created_at": self._clock.now()}
        if turn_id is not None:
            update_fields["id"] = turn_id
        row = Turn.model_validate(turn, update=update_fields)

        def work(db: Session) -> Turn:
            session = db.get(ChatSession, row.session_id)
            if session is None:
                raise KeyError(
                    f"unknown session {row.session_id!r}: create it with Store.create_session first"
                )
            if session.user_id != row.user_id:
                raise PermissionError(f"session {row.session_id!r} does not belong to user {row.user_id!r}")
            db.add(row)
            return row

        return await self._run(work)

    async def close_turn(self, turn_id: str, kind: str, next_state: dict[str, Any]) -> Turn | None:
        """Attach the next state to a still-open turn, atomically: of several concurrent calls
        exactly one wins. Returns the closed turn, or None if unknown or already closed."""
        if kind not in NEXT_STATE_KINDS:
            raise ValueError(f"next state kind {kind!r} is not one of {sorted(NEXT_STATE_KINDS)}")
        statement = (
            update(Turn)
            .where(Turn.id == turn_id, Turn.closed_at.is_(None))
            .values(closed_at=utcnow(), next_state_kind=kind, next_state=next_state)
        )

        def work(db: Session) -> Turn | None:
            if db.execute(statement).rowcount != 1:
                return None
            return db.get(Turn, turn_id, populate_existing=True)

        return await self._run(work)

    async def open_turns(self, session_id: str) -> list[Turn]:
        """The session's turns still waiting for their next state, oldest first."""
        query = (
            select(Turn)
            .where(Turn.session_id == session_id, Turn.closed_at.is_(None))
            .order_by(Turn.created_at, Turn.step)
        )
        return await self._run(lambda db: list(db.exec(query).all()))

    async def get_turn(self, turn_id: str) -> Turn | None:
        return await self._run(lambda db: db.get(Turn, turn_id))

    async def list_turns(
        self,
        *,
        session_id: str | None = None,
        user_id: str | None = None,
        limit: int = 50,
        since: datetime | None = None,
    ) -> list[Turn]:
        """Newest first; ``since`` keeps only turns created strictly after it."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        query = select(Turn)
        if session_id is not None:
            query = query.where(Turn.session_id == session_id)
        if user_id is not None:
            query = query.where(Turn.user_id == user_id)
        if since is not None:
            query = query.where(Turn.created_at > since)
        query = query.order_by(Turn.created_at.desc()).limit(limit)
        return await self._run(lambda db: list(db.exec(query).all()))

    # ---- feedback

    async def add_feedback(self, turn_id: str, user_id: str, score: float, text: str | None) -> Feedback:
        """Store explicit feedback on a turn; ``KeyError`` if the turn is unknown."""
        if not -1.0 <= score <= 1.0:
            raise ValueError(f"feedback score must be between -1 and 1, got {score}")
        row = Feedback(turn_id=turn_id, user_id=user_id, score=float(score), text=text)

        def work(db: Session) -> Feedback:
            if db.get(Turn, turn_id) is None:
                raise KeyError(f"unknown turn {turn_id!r}")
            db.add(row)
            try:
                db.flush()
            except IntegrityError:  # the turn was forgotten in between
                raise KeyError(f"unknown turn {turn_id!r}") from None
            return row

        return await self._run(work)

    async def list_feedback(self, turn_id: str) -> list[Feedback]:
        query = select(Feedback).where(Feedback.turn_id == turn_id).order_by(Feedback.id)
        return await self._run(lambda db: list(db.exec(query).all()))

    # ---- lessons

    async def add_lesson(
        self, user_id: str, text: str, *, kind: str = "hint", source_turn_id: str | None = None
    ) -> Lesson:
        """Store a lesson for the user (created if missing)."""
        _check_id("user_id", user_id)
        if not text.strip():
            raise ValueError("lesson text is empty")
        row = Lesson(user_id=user_id, text=text, kind=kind, source_turn_id=source_turn_id)

        def work(db: Session) -> Lesson:
            _insert_ignore(db, User.__table__, id=user_id, created_at=utcnow())
            db.add(row)
            db.flush()
            return row

        return await self._run(work)

    async def list_lessons(self, user_id: str | None = None) -> list[Lesson]:
        """Lessons, oldest first; all users' when ``user_id`` is None."""
        query = select(Lesson).order_by(Lesson.id)
        if user_id is not None:
            query = query.where(Lesson.user_id == user_id)
        return await self._run(lambda db: list(db.exec(query).all()))

    # ---- adapters

    async def add_adapter(self, adapter: Adapter) -> Adapter:
        """Register an adapter version; ``ValueError`` if its id exists already."""
        _check_adapter(adapter.scope, adapter.status, adapter.user_id)
        row = Adapter.model_validate(adapter)

        def work(db: Session) -> Adapter:
            if db.get(Adapter, row.id) is not None:
                raise ValueError(f"adapter {row.id!r} exists already; pick a new version id")
            db.add(row)
            return row

        return await self._run(work)

    async def get_adapter(self, adapter_id: str) -> Adapter | None:
        return await self._run(lambda db: db.get(Adapter, adapter_id))

    async def list_adapters(self, scope: str | None = None, user_id: str | None = None) -> list[Adapter]:
        """Adapters, oldest first, optionally of one scope and/or one user."""
        query = select(Adapter).order_by(Adapter.created_at, Adapter.id)
        if scope is not None:
            query = query.where(Adapter.scope == scope)
        if user_id is not None:
            query = query.where(Adapter.user_id == user_id)
        return await self._run(lambda db: list(db.exec(query).all()))

    async def live_adapter(self, scope: str, user_id: str | None = None) -> Adapter | None:
        """The live adapter of a scope (and user, for per-user scope): the latest promoted."""
        owner = Adapter.user_id.is_(None) if user_id is None else Adapter.user_id == user_id
        query = (
            select(Adapter)
            .where(Adapter.status == "live", Adapter.scope == scope, owner)
            .order_by(Adapter.promoted_at.desc(), Adapter.created_at.desc())
            .limit(1)
        )
        return await self._run(lambda db: db.exec(query).first())

    async def update_adapter(self, adapter_id: str, **fields: Any) -> Adapter:
        """Change fields of an adapter row (e.g. ``status="live", promoted_at=...``)."""
        allowed = set(Adapter.model_fields) - {"id"}
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"cannot update adapter fields {sorted(unknown)}; allowed: {sorted(allowed)}")

        def work(db: Session) -> Adapter:
            row = db.get(Adapter, adapter_id)
            if row is None:
                raise KeyError(f"unknown adapter {adapter_id!r}")
            for name, value in fields.items():
                setattr(row, name, value)
            _check_adapter(row.scope, row.status, row.user_id)
            db.add(row)
            return row

        return await self._run(work)

    # ---- whole-store operations

    async def forget_user(self, user_id: str) -> dict[str, int]:
        """Delete everything stored for a user; returns how many rows went from each table.
        Adapter files on disk and index entries are the caller's to remove."""
        user_turns = select(Turn.id).where(Turn.user_id == user_id)
        statements = {
            "feedback": sa_delete(Feedback).where(
                or_(Feedback.user_id == user_id, Feedback.turn_id.in_(user_turns))
            ),
            "turns": sa_delete(Turn).where(Turn.user_id == user_id),
            "lessons": sa_delete(Lesson).where(Lesson.user_id == user_id),
            "sessions": sa_delete(ChatSession).where(ChatSession.user_id == user_id),
            "adapters": sa_delete(Adapter).where(Adapter.scope == "user", Adapter.user_id == user_id),
            "users": sa_delete(User).where(User.id == user_id),
        }
        return await self._run(lambda db: {name: db.execute(s).rowcount for name, s in statements.items()})

    async def stats(self) -> dict[str, int]:
        """Row counts for /metrics."""
        queries = {
            "users": select(func.count()).select_from(User),
            "sessions": select(func.count()).select_from(ChatSession),
            "turns": select(func.count()).select_from(Turn),
            "open_turns": select(func.count()).select_from(Turn).where(Turn.closed_at.is_(None)),
            "feedback": select(func.count()).select_from(Feedback),
            "lessons": select(func.count()).select_from(Lesson),
            "adapters": select(func.count()).select_from(Adapter),
        }
        return await self._run(lambda db: {name: int(db.exec(q).one()) for name, q in queries.items()})


def _check_id(name: str, value: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")


def _check_adapter(scope: str, status: str, user_id: str | None) -> None:
    if scope not in ADAPTER_SCOPES:
        raise ValueError(f"adapter scope {scope!r} is not one of {sorted(ADAPTER_SCOPES)}")
    if status not in ADAPTER_STATUSES:
        raise ValueError(f"adapter status {status!r} is not one of {sorted(ADAPTER_STATUSES)}")
    if scope == "user" and not user_id:
        raise ValueError("a per-user adapter (scope='user') needs a user_id")
