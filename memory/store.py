"""The experience store: users, sessions, turns, feedback, adapters and lessons.

SQLModel tables on SQLite (WAL) by default, PostgreSQL by URL. The store is the
source of truth: events on the bus carry ids only, and a consumer that was
away catches up from here.

Every public :class:`Store` method is ``async`` and runs its database work in a
worker thread (``anyio.to_thread.run_sync``) with its own short session that
commits before the method returns, so a write never blocks the event loop and
returned rows are detached copies that stay readable afterwards.

The tables themselves are in :mod:`whet.memory.tables`.
"""

from __future__ import annotations

import errno
import functools
import threading
import uuid
from collections.abc import Callable, Collection
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import anyio.to_thread
import structlog
from sqlalchemy import Engine, bindparam, event, func, insert, inspect, or_, update
from sqlalchemy import delete as sa_delete
from sqlalchemy import text as sql_text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.pool import StaticPool
from sqlmodel import Session, SQLModel, create_engine, select

from whet.memory.tables import (
    ADAPTER_SCOPES,
    ADAPTER_STATUSES,
    APPROVAL_STATUSES,
    NEXT_STATE_KINDS,
    TABLES,
    UNLEARNED_JUDGE,
    Adapter,
    Approval,
    ChatSession,
    Feedback,
    Judgment,
    Lesson,
    Turn,
    TurnCreate,
    User,
    utcnow,
)

T = TypeVar("T")
log = structlog.get_logger(__name__)


class StoreUnavailable(RuntimeError):
    """The database cannot be reached (or stayed locked) just now: nothing was written; retry later."""


class StoreFull(RuntimeError):
    """The database's disk is full: the write was rolled back and nothing was stored."""


def _store_error(exc: OperationalError | InterfaceError | OSError) -> StoreUnavailable | StoreFull:
    """A driver's failure as what it means to a caller: a full disk, or a database out of reach.

    SQLite says ``SQLITE_FULL`` (13) for a full disk, PostgreSQL SQLSTATE 53100; both roll back."""
    cause = exc if isinstance(exc, OSError) else exc.orig
    full = (
        getattr(cause, "sqlite_errorcode", None) == 13
        or getattr(cause, "sqlstate", None) == "53100"
        or getattr(cause, "errno", None) == errno.ENOSPC
    )
    reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200]
    if full:
        return StoreFull(f"the store's disk is full; nothing was written ({reason})")
    return StoreUnavailable(f"the store is unavailable; nothing was written ({reason})")


# ----------------------------------------------------------------------------- engine


def open_store(url: str, sqlite_sync: str = "normal") -> Store:
    """Open (and create the tables of) the store at ``url``.

    ``sqlite:///relative/or/absolute.db`` (parent folder created; WAL journal),
    ``sqlite://`` (in memory, for tests), or ``postgresql://user:pw@host/db``
    (driven by psycopg 3). Raises ``ValueError`` for anything else.

    ``sqlite_sync`` (``store.sqlite_sync``): ``normal`` commits to the WAL without waiting for the
    disk: a committed turn survives whet being killed or crashing, and the file is never corrupted,
    but a power cut or an OS crash can take the last commits back. ``full`` waits for the disk on
    every commit (a few ms each on most disks, several per request) and survives those too.
    """
    if sqlite_sync not in ("normal", "full"):
        raise ValueError(f"sqlite_sync must be 'normal' or 'full', not {sqlite_sync!r}")
    engine = _create_engine(_parse_url(url), sqlite_sync)
    SQLModel.metadata.create_all(engine, tables=TABLES)
    _add_new_columns(engine)
    return Store(engine)


def _add_new_columns(engine: Engine) -> None:
    """Add the columns a newer whet gave an existing table (``create_all`` makes only missing tables).
    Only nullable columns are ever added after a release, so an old row reads as NULL there."""
    inspector = inspect(engine)
    with engine.begin() as db:
        for table in TABLES:
            have = {column["name"] for column in inspector.get_columns(table.name)}
            for column in table.columns:
                if column.name in have:
                    continue
                if not column.nullable or column.primary_key:
                    raise RuntimeError(f"the store's table {table.name} lacks column {column.name}, which cannot be "
                                       "added to existing rows: move the old store aside or delete it")
                kind = column.type.compile(dialect=engine.dialect)
                # PostgreSQL: replicas starting together may race to add it; SQLite has one host, and no such clause
                guard = "IF NOT EXISTS " if engine.dialect.name == "postgresql" else ""
                db.execute(sql_text(f'ALTER TABLE "{table.name}" ADD COLUMN {guard}"{column.name}" {kind}'))


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


def _create_engine(url: URL, sqlite_sync: str = "normal") -> Engine:
    if url.get_backend_name() == "postgresql":
        # a database that stops answering is a StoreUnavailable after 10 s, never a request that hangs
        timeout = {} if "connect_timeout" in url.query else {"connect_timeout": 10}
        return create_engine(url, pool_pre_ping=True, connect_args=timeout)
    database = url.database or ""
    connect_args = {"check_same_thread": False}
    if database in ("", ":memory:"):
        # one shared connection, or every thread would see its own empty database
        engine = create_engine(url, connect_args=connect_args, poolclass=StaticPool)
    else:
        path = Path(database).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url.set(database=str(path)), connect_args=connect_args)
    event.listen(engine, "connect", lambda connection, _record: _sqlite_pragmas(connection, sqlite_sync))
    return engine


def _sqlite_pragmas(dbapi_connection: Any, sync: str) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA synchronous={'FULL' if sync == 'full' else 'NORMAL'}")  # see open_store
    # writers queue behind each other instead of failing with "database is locked"
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


@functools.cache
def _insert_ignore_statement(dialect_name: str, table: Any, columns: tuple[str, ...]) -> Any:
    # built once per shape: SQLAlchemy spends more building and keying a statement than SQLite
    # spends running it, and this runs on every request
    dialect = postgresql if dialect_name == "postgresql" else sqlite
    statement = dialect.insert(table).values({c: bindparam(c) for c in columns}).on_conflict_do_nothing()
    return statement.returning(list(table.primary_key.columns)[0])


def _insert_ignore(db: Session | Connection, table: Any, **values: Any) -> bool:
    """INSERT that does nothing when the primary key exists (race-free get-or-create); True if it
    inserted (RETURNING, as rowcount is not reliable for this statement on every driver)."""
    dialect = db.dialect if isinstance(db, Connection) else db.get_bind().dialect
    statement = _insert_ignore_statement(dialect.name, table, tuple(values))
    return db.execute(statement, values).first() is not None


# a turn's row, and the session's tip with it: built once (see _insert_ignore_statement)
_INSERT_TURN = insert(Turn.__table__)
_SESSION_ROW = select(ChatSession.__table__).where(ChatSession.id == bindparam("sid"))
_SESSION_OWNER = select(ChatSession.user_id).where(ChatSession.id == bindparam("sid"))
_SET_TIP = (update(ChatSession).where(ChatSession.id == bindparam("sid"))
            .values(tip_hash=bindparam("tip"), updated_at=bindparam("at")))  # fmt: skip


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


def _guarded(call: Callable[[], T]) -> T:
    """``call()``, with the database's failures as StoreUnavailable (out of reach) or StoreFull (disk full)."""
    try:
        return call()
    except (OperationalError, InterfaceError) as exc:  # connection lost or refused, disk full, locked
        raise _store_error(exc) from exc
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise _store_error(exc) from exc


class Store:
    """Async access to the experience store. Build with :func:`open_store`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._clock = _Clock()

    async def _run(self, work: Callable[[Session], T]) -> T:
        """``work`` in one committed transaction. Raises StoreUnavailable (database out of reach)
        or StoreFull (disk full); either way nothing of ``work`` was stored."""

        def call() -> T:
            with Session(self.engine, expire_on_commit=False) as db:
                result = work(db)
                db.commit()
                return result

        return await anyio.to_thread.run_sync(_guarded, call)

    async def _run_core(self, work: Callable[[Connection], T]) -> T:
        """:meth:`_run` for Core statements on a bare connection: the ORM session's own bookkeeping
        costs more than a small INSERT, which matters on the paths every request takes."""

        def call() -> T:
            with self.engine.begin() as connection:
                return work(connection)

        return await anyio.to_thread.run_sync(_guarded, call)

    async def aclose(self, wait_s: float = 10.0) -> None:
        """Dispose of the engine's connections, once those checked out are back (up to ``wait_s``).

        A task cancelled at shutdown may leave its worker thread mid-query: the connection that thread
        holds comes back to the pool only when the query ends, and a pool disposed before then never
        closes it (psycopg warns when such a connection is collected)."""
        checked_out = getattr(self.engine.pool, "checkedout", lambda: 0)
        with anyio.move_on_after(wait_s):
            while checked_out():
                await anyio.sleep(0.02)
        if left := checked_out():
            log.warning("store.close_with_connections_out", connections=left, waited_s=wait_s)
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
        return (await self.open_session(user_id, session_id))[0]

    async def open_session(self, user_id: str, session_id: str | None = None) -> tuple[ChatSession, bool]:
        """:meth:`create_session`, and whether this call made the session (a new one has no turns yet)."""
        _check_id("user_id", user_id)
        sid = session_id or "sess_" + uuid.uuid4().hex
        _check_id("session_id", sid)

        def work(db: Connection) -> tuple[ChatSession, bool]:
            now = utcnow()
            _insert_ignore(db, User.__table__, id=user_id, created_at=now)
            made = _insert_ignore(db, ChatSession.__table__, id=sid, user_id=user_id, tip_hash=None,
                                  created_at=now, updated_at=now)  # fmt: skip
            if made:  # what was just written: no read back
                return ChatSession(id=sid, user_id=user_id, tip_hash=None, created_at=now, updated_at=now), True
            found = db.execute(_SESSION_ROW, {"sid": sid}).first()
            if found is None or found.user_id != user_id:
                raise PermissionError(f"session {sid!r} belongs to another user; use a new session id")
            return ChatSession.model_validate(found._mapping), False

        return await self._run_core(work)

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
        def work(db: Session) -> None:
            if db.execute(_SET_TIP, {"sid": session_id, "tip": tip_hash, "at": utcnow()}).rowcount == 0:
                raise KeyError(f"unknown session {session_id!r}")

        await self._run(work)

    async def list_sessions(self, user_id: str, limit: int = 50) -> list[ChatSession]:
        """The user's sessions, most recently updated first."""
        query = (
            select(ChatSession)
            .where(ChatSession.user_id == user_id)
            .order_by(ChatSession.updated_at.desc())
            .limit(limit)
        )
        return await self._run(lambda db: list(db.exec(query).all()))

    # ---- turns

    async def add_turn(self, turn: TurnCreate, *, turn_id: str | None = None, tip_hash: str | None = None) -> Turn:
        """Record one model action. The session must exist and belong to ``turn.user_id``
        (``KeyError`` / ``PermissionError`` otherwise). ``turn_id`` lets the caller name the
        turn before it is written (streaming answers carry the id before the turn exists).
        ``tip_hash``: the session's new tip (:meth:`set_session_tip`), written in the same transaction."""
        update_fields: dict[str, Any] = {"created_at": self._clock.now()}
        if turn_id is not None:
            update_fields["id"] = turn_id
        row = Turn.model_validate(turn, update=update_fields)
        values = {column.name: getattr(row, column.name) for column in Turn.__table__.columns}

        def work(db: Connection) -> Turn:
            # Core statements, not the ORM unit of work: this runs on every model step, and the
            # ORM's flush costs more than the INSERT itself
            user_id = db.execute(_SESSION_OWNER, {"sid": row.session_id}).scalar()
            if user_id is None:
                raise KeyError(
                    f"unknown session {row.session_id!r}: create it with Store.create_session first"
                )
            if user_id != row.user_id:
                raise PermissionError(f"session {row.session_id!r} does not belong to user {row.user_id!r}")
            db.execute(_INSERT_TURN, values)
            if tip_hash is not None:
                db.execute(_SET_TIP, {"sid": row.session_id, "tip": tip_hash, "at": utcnow()})
            return row

        return await self._run_core(work)

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

    async def open_turns(self, session_id: str, *, unheld: bool = False) -> list[Turn]:
        """The session's turns still waiting for their next state, oldest first; ``unheld``: not
        those held for a pending approval (a person's decision is their next state)."""
        query = select(Turn).where(Turn.session_id == session_id, Turn.closed_at.is_(None))
        if unheld:
            held = select(Approval.turn_id).where(Approval.session_id == session_id, Approval.status == "pending")
            query = query.where(Turn.id.not_in(held))
        query = query.order_by(Turn.created_at, Turn.step)
        return await self._run(lambda db: list(db.exec(query).all()))

    async def get_turn(self, turn_id: str) -> Turn | None:
        if "\x00" in turn_id:  # never an id this store made (and PostgreSQL refuses NUL in a query)
            return None
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
        if "\x00" in (session_id or "") + (user_id or ""):  # no id holds NUL (PostgreSQL refuses it in a query)
            return []
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
        if "\x00" in turn_id:
            raise KeyError(f"unknown turn {turn_id!r}")
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
        self, user_id: str, text: str, *, kind: str = "hint", source_turn_id: str | None = None,
        min_score: float | None = None,
    ) -> Lesson:
        """Store a lesson for the user (created if missing); ``min_score``: see :attr:`Lesson.min_score`."""
        _check_id("user_id", user_id)
        if not text.strip():
            raise ValueError("lesson text is empty")
        row = Lesson(user_id=user_id, text=text, kind=kind, source_turn_id=source_turn_id, min_score=min_score)

        def work(db: Session) -> Lesson:
            _insert_ignore(db, User.__table__, id=user_id, created_at=utcnow())
            db.add(row)
            db.flush()
            return row

        return await self._run(work)

    async def narrow_lesson(self, lesson_id: int, min_score: float) -> Lesson | None:
        """Lesson ``lesson_id`` again under a new id with ``min_score`` (:attr:`Lesson.min_score`), the old
        row deleted, in one transaction; None when it is gone. A new id, not an update in place: a
        replica that misses the bus events still finds both changes when it catches up (the new id
        above its cursor, the old one missing from the store)."""

        def work(db: Session) -> Lesson | None:
            old = db.get(Lesson, lesson_id)
            if old is None:
                return None
            row = Lesson(user_id=old.user_id, text=old.text, kind=old.kind, source_turn_id=old.source_turn_id,
                         min_score=min_score, created_at=old.created_at)  # fmt: skip
            db.delete(old)
            db.add(row)
            db.flush()
            return row

        return await self._run(work)

    async def get_lesson(self, lesson_id: int) -> Lesson | None:
        return await self._run(lambda db: db.get(Lesson, lesson_id))

    async def list_lessons(self, user_id: str | None = None, *, after_id: int = 0) -> list[Lesson]:
        """Lessons, oldest first; all users' when ``user_id`` is None; only ids above ``after_id``."""
        query = select(Lesson).where(Lesson.id > after_id).order_by(Lesson.id)
        if user_id is not None:
            query = query.where(Lesson.user_id == user_id)
        return await self._run(lambda db: list(db.exec(query).all()))

    async def lesson_ids(self) -> set[int]:
        """The ids of every stored lesson (what a replica's index may hold)."""
        return await self._run(lambda db: set(db.exec(select(Lesson.id)).all()))

    async def count_lessons(self, *, up_to: int) -> int:
        """How many stored lessons have an id of at most ``up_to``."""
        query = select(func.count()).select_from(Lesson).where(Lesson.id <= up_to)
        return await self._run(lambda db: db.exec(query).one())

    async def delete_lesson(self, lesson_id: int) -> bool:
        """Delete one lesson row; True if it existed. The index entry is the caller's to remove."""
        statement = sa_delete(Lesson).where(Lesson.id == lesson_id)
        return await self._run(lambda db: db.execute(statement).rowcount == 1)

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
        return await self._run(lambda db: db.exec(_live_query(scope, user_id)).first())

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

    # ---- judgments: the learner's input, and its consumption cursor

    async def unjudged_turns(self, limit: int = 256) -> list[Turn]:
        """Closed turns that have no verdict yet, oldest closed first (the learner's catch-up)."""
        judged = select(Judgment.turn_id)
        query = (
            select(Turn)
            .where(Turn.closed_at.is_not(None), Turn.id.not_in(judged))
            .order_by(Turn.closed_at, Turn.step)
            .limit(limit)
        )
        return await self._run(lambda db: list(db.exec(query).all()))

    async def request_turns(self, request_id: str) -> list[Turn]:
        """The turns (agent steps) of one chat request, in step order."""
        query = select(Turn).where(Turn.request_id == request_id).order_by(Turn.step)
        return await self._run(lambda db: list(db.exec(query).all()))

    async def request_split(self, request_id: str) -> str | None:
        """The split an earlier verdict of this request was given, if any (all its steps share one)."""
        query = select(Judgment.split).where(Judgment.request_id == request_id, Judgment.judge != UNLEARNED_JUDGE)
        return await self._run(lambda db: db.exec(query.limit(1)).first())

    async def request_ordinal(self, user_id: str, request_id: str) -> int:
        """How many of ``user_id``'s requests began before ``request_id`` did, leaving out those sent
        with ``store: false`` (they never learn): the same number for every step of the request,
        and for the same conversation replayed into a fresh store."""

        def work(db: Session) -> int:
            began = db.exec(select(func.min(Turn.created_at)).where(Turn.request_id == request_id)).one()
            if began is None:
                return 0
            unlearned = select(Judgment.turn_id).where(Judgment.judge == UNLEARNED_JUDGE, Judgment.user_id == user_id)
            query = select(func.count(func.distinct(Turn.request_id))).where(
                Turn.user_id == user_id, Turn.created_at < began, Turn.id.not_in(unlearned))
            return db.exec(query).one()

        return await self._run(work)

    async def save_judgment(self, judgment: Judgment) -> Judgment:
        """Insert or replace the verdict on a turn. A verdict already consumed by training keeps
        its cursor (``trained_in``): a later verdict is recorded, the turn is not trained again."""
        row = Judgment.model_validate(judgment)

        def work(db: Session) -> Judgment:
            existing = db.get(Judgment, row.turn_id)
            if existing is None:
                db.add(row)
                return row
            for name in ("score", "hint", "reason", "judge", "trainable", "policy_version"):
                setattr(existing, name, getattr(row, name))
            existing.updated_at = utcnow()
            db.add(existing)
            return existing

        return await self._run(work)

    async def get_judgment(self, turn_id: str) -> Judgment | None:
        return await self._run(lambda db: db.get(Judgment, turn_id))

    async def list_judgments(
        self, *, request_id: str | None = None, trained_in: str | None = None, limit: int = 1000
    ) -> list[Judgment]:
        """Verdicts, oldest first, optionally of one request or one adapter version's batch."""
        query = select(Judgment)
        if request_id is not None:
            query = query.where(Judgment.request_id == request_id)
        if trained_in is not None:
            query = query.where(Judgment.trained_in == trained_in)
        query = query.order_by(Judgment.created_at, Judgment.turn_id).limit(limit)
        return await self._run(lambda db: list(db.exec(query).all()))

    async def recent_judgments(self, user_id: str, limit: int = 200) -> list[tuple[Judgment, Turn]]:
        """The user's verdicts with their turns, newest first."""
        query = (
            select(Judgment, Turn)
            .join(Turn, Turn.id == Judgment.turn_id)
            .where(Judgment.user_id == user_id)
            .order_by(Judgment.created_at.desc(), Judgment.turn_id)
            .limit(limit)
        )
        return await self._run(lambda db: [(j, t) for j, t in db.exec(query).all()])

    async def samples(
        self, *, split: str, user_id: str | None = None, untrained: bool = False, limit: int = 256
    ) -> list[tuple[Judgment, Turn]]:
        """Trainable verdicts with their turns, oldest first: ``split`` "train" or "holdout",
        one user's only when ``user_id`` is given, not yet consumed when ``untrained``."""
        query = (
            select(Judgment, Turn)
            .join(Turn, Turn.id == Judgment.turn_id)
            .where(Judgment.trainable, Judgment.split == split)
        )
        if user_id is not None:
            query = query.where(Judgment.user_id == user_id)
        if untrained:
            query = query.where(Judgment.trained_in.is_(None))
        query = query.order_by(Judgment.created_at, Judgment.turn_id).limit(limit)
        return await self._run(lambda db: [(j, t) for j, t in db.exec(query).all()])

    async def recent_scores(self, policy_version: str | None, limit: int) -> list[int]:
        """The latest nonzero verdicts on turns that ``policy_version`` produced (None = base weights)."""
        query = (
            select(Judgment.score)
            .where(_is(Judgment.policy_version, policy_version), Judgment.score != 0)
            .order_by(Judgment.created_at.desc())
            .limit(limit)
        )
        return await self._run(lambda db: list(db.exec(query).all()))

    async def lineage_hints(self, *, user_id: str | None, lineage: Collection[str], taught: bool, limit: int,
                            offset: int = 0) -> list[tuple[Judgment, Turn]]:  # fmt: skip
        """Hinted training verdicts with their turns, newest first; one user's only when ``user_id`` is given,
        ``limit`` of them from ``offset`` on. ``taught``: those a version of ``lineage`` (the live adapter and
        its ancestors) was trained on, what the served weights were taught; otherwise those whose step was
        rejected or retired and is not one of ``lineage``, what the served weights were never taught."""
        query = (
            select(Judgment, Turn)
            .join(Turn, Turn.id == Judgment.turn_id)
            .join(Adapter, Adapter.id == Judgment.trained_in)
            .where(Judgment.trainable, Judgment.split == "train", Judgment.hint.is_not(None), Judgment.hint != "")
        )
        if taught:
            query = query.where(Judgment.trained_in.in_(list(lineage)))
        else:
            query = query.where(Adapter.status.in_(("rejected", "retired")), Judgment.trained_in.not_in(list(lineage)))
        if user_id is not None:
            query = query.where(Judgment.user_id == user_id)
        query = query.order_by(Judgment.created_at.desc(), Judgment.turn_id).offset(offset).limit(limit)
        return await self._run(lambda db: [(j, t) for j, t in db.exec(query).all()])

    async def untrained_counts(self) -> dict[str, int]:
        """Trainable "train" verdicts that no step has consumed yet, counted by user."""
        query = _grouped_count(Judgment.user_id).where(
            Judgment.trainable, Judgment.split == "train", Judgment.trained_in.is_(None)
        )
        return await self._run(lambda db: dict(db.exec(query).all()))

    async def rejected_children(self, scope: str, user_id: str | None, parent: str | None) -> int:
        """How many versions of a lineage made from ``parent`` (None: the base weights) the gate turned away."""
        query = select(func.count()).select_from(Adapter).where(
            Adapter.scope == scope, _is(Adapter.user_id, user_id), _is(Adapter.parent, parent), Adapter.status == "rejected"
        )
        return await self._run(lambda db: db.exec(query).one())

    async def register_candidate(self, adapter: Adapter, turn_ids: list[str]) -> int:
        """Register a trained adapter version and mark its batch consumed, in one transaction.

        Idempotent: registering the same version again (a restart finishing an interrupted
        step) adds nothing. Returns how many verdicts this call marked."""
        _check_adapter(adapter.scope, adapter.status, adapter.user_id)
        row = Adapter.model_validate(adapter)
        mark = (
            update(Judgment)
            .where(Judgment.turn_id.in_(turn_ids), Judgment.trained_in.is_(None))
            .values(trained_in=row.id, updated_at=utcnow())
        )

        def work(db: Session) -> int:
            if db.get(Adapter, row.id) is None:
                db.add(row)
                db.flush()
            return db.execute(mark).rowcount if turn_ids else 0

        return await self._run(work)

    async def promote_adapter(self, adapter_id: str, **metrics: Any) -> tuple[Adapter, Adapter | None]:
        """Make ``adapter_id`` the live adapter of its scope (and user); the one live before is
        retired. Returns (now live, retired or None). ``metrics`` are merged into the row's."""

        def work(db: Session) -> tuple[Adapter, Adapter | None]:
            row = db.get(Adapter, adapter_id)
            if row is None:
                raise KeyError(f"unknown adapter {adapter_id!r}")
            before = db.exec(_live_query(row.scope, row.user_id)).first()
            if before is not None and before.id != row.id:
                before.status = "retired"
                db.add(before)
            else:
                before = None
            row.status, row.promoted_at = "live", utcnow()
            row.metrics = {**row.metrics, **metrics}
            db.add(row)
            return row, before

        return await self._run(work)

    async def rollback_adapter(self, scope: str, user_id: str | None, reason: str) -> tuple[Adapter, Adapter | None]:
        """Retire the live adapter of a scope and bring its parent back (None: base weights).
        Returns (rolled back, now live). ``LookupError`` when nothing is live."""

        def work(db: Session) -> tuple[Adapter, Adapter | None]:
            live = db.exec(_live_query(scope, user_id)).first()
            if live is None:
                raise LookupError(f"no live adapter for scope {scope!r}{f' user {user_id!r}' if user_id else ''}")
            live.status = "retired"
            live.metrics = {**live.metrics, "rolled_back": reason, "rolled_back_at": utcnow().isoformat()}
            db.add(live)
            parent = db.get(Adapter, live.parent) if live.parent else None
            if parent is not None:
                parent.status, parent.promoted_at = "live", utcnow()
                db.add(parent)
            return live, parent

        return await self._run(work)

    # ---- approvals

    async def add_approval(self, approval: Approval) -> Approval:
        return await self._run(lambda db: (db.add(approval), approval)[1])

    async def get_approval(self, approval_id: str) -> Approval | None:
        if "\x00" in approval_id:
            return None
        return await self._run(lambda db: db.get(Approval, approval_id))

    async def list_approvals(self, user_id: str | None = None, status: str | None = "pending",
                             limit: int = 100, session_id: str | None = None) -> list[Approval]:  # fmt: skip
        """Newest first; ``user_id`` None means every user's, ``status`` None every status."""
        query = select(Approval)
        if session_id is not None:
            query = query.where(Approval.session_id == session_id)
        if user_id is not None:
            query = query.where(Approval.user_id == user_id)
        if status is not None:
            query = query.where(Approval.status == status)
        query = query.order_by(Approval.created_at.desc()).limit(limit)
        return await self._run(lambda db: list(db.exec(query).all()))

    async def decide_approval(
        self, approval_id: str, status: str, *, by: str | None = None, reason: str | None = None,
        now: datetime | None = None,
    ) -> Approval | None:  # fmt: skip
        """Move a pending approval to ``status``, atomically: of concurrent deciders one wins.

        "approved" and "rejected" win only before ``expires_at``, "expired" only after it.
        Returns the decided row, or None when it was not pending (or not in time) any more.
        """
        if status not in APPROVAL_STATUSES - {"pending"}:
            raise ValueError(f"an approval is decided as approved, rejected or expired, not {status!r}")
        now = now or utcnow()
        due = Approval.expires_at <= now if status == "expired" else Approval.expires_at > now
        statement = (
            update(Approval)
            .where(Approval.id == approval_id, Approval.status == "pending", due)
            .values(status=status, decided_by=by, reason=reason, decided_at=now)
        )

        def work(db: Session) -> Approval | None:
            if db.execute(statement).rowcount != 1:
                return None
            return db.get(Approval, approval_id, populate_existing=True)

        return await self._run(work)

    async def due_approvals(self, now: datetime | None = None, limit: int = 100) -> list[Approval]:
        """Pending approvals past their expiry, oldest first."""
        query = (
            select(Approval)
            .where(Approval.status == "pending", Approval.expires_at <= (now or utcnow()))
            .order_by(Approval.expires_at)
            .limit(limit)
        )
        return await self._run(lambda db: list(db.exec(query).all()))

    # ---- whole-store operations

    async def forget_user(self, user_id: str) -> dict[str, int]:
        """Delete everything stored for a user; returns how many rows went from each table.
        Adapter files on disk and index entries are the caller's to remove."""
        user_turns = select(Turn.id).where(Turn.user_id == user_id)
        statements = {
            "approvals": sa_delete(Approval).where(
                or_(Approval.user_id == user_id, Approval.turn_id.in_(user_turns))
            ),
            "judgments": sa_delete(Judgment).where(
                or_(Judgment.user_id == user_id, Judgment.turn_id.in_(user_turns))
            ),
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

    async def learning_counts(self) -> dict[str, dict[str, int]]:
        """Verdicts by score and adapter versions by status, for /metrics."""

        def work(db: Session) -> dict[str, dict[str, int]]:
            verdicts = {f"{score:+d}" if score else "0": n for score, n in db.exec(_grouped_count(Judgment.score))}
            adapters = {status: n for status, n in db.exec(_grouped_count(Adapter.status))}
            return {"verdicts": verdicts, "adapters": adapters}

        return await self._run(work)

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
            "judgments": select(func.count()).select_from(Judgment),
        }
        return await self._run(lambda db: {name: int(db.exec(q).one()) for name, q in queries.items()})


def _grouped_count(column: Any) -> Any:
    return select(column, func.count()).group_by(column)


def _is(column: Any, value: str | None) -> Any:
    """``column`` equals ``value``, or is NULL where ``value`` is None (SQL's ``= NULL`` matches nothing)."""
    return column.is_(None) if value is None else column == value


def _live_query(scope: str, user_id: str | None) -> Any:
    return (
        select(Adapter)
        .where(Adapter.status == "live", Adapter.scope == scope, _is(Adapter.user_id, user_id))
        .order_by(Adapter.promoted_at.desc(), Adapter.created_at.desc())
        .limit(1)
    )


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
