"""The experience store on SQLite in tmp_path, and the core round trip on PostgreSQL."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import anyio
import pytest
from sqlalchemy import event, text

from whet.memory import Adapter, Store, TurnCreate, TurnPublic, open_store
from whet.memory.tables import Approval, utcnow

pytestmark = pytest.mark.anyio


@pytest.fixture
async def store(tmp_path) -> AsyncIterator[Store]:
    store = open_store(f"sqlite:///{tmp_path}/db/whet.db")
    yield store
    await store.aclose()


def turn_for(session_id: str, user_id: str, *, step: int = 0, request_id: str = "req-1") -> TurnCreate:
    return TurnCreate(
        session_id=session_id,
        user_id=user_id,
        request_id=request_id,
        step=step,
        model="smollm2",
        policy_version="global-0001",
        prompt_messages=[{"role": "user", "content": "what time is it?"}],
        tool_names=["get_current_time"],
        prompt_token_ids=[101, 2054, 2051],
        response_text="",
        response_token_ids=[7, 8, 9],
        response_logprobs=[-0.25, -1.5, -0.125],
        tool_calls=[{"id": "call_1", "type": "function",
                     "function": {"name": "get_current_time", "arguments": "{}"}}],  # fmt: skip
    )


async def exercise_core_round_trip(store: Store) -> None:
    """The path every request takes; shared by the SQLite and PostgreSQL tests."""
    await store.ensure_user("alice")
    session = await store.create_session("alice")
    added = await store.add_turn(turn_for(session.id, "alice"))
    assert added.id.startswith("turn_") and added.closed_at is None

    fetched = await store.get_turn(added.id)
    assert fetched is not None
    assert fetched.response_token_ids == [7, 8, 9]
    assert fetched.response_logprobs == [-0.25, -1.5, -0.125]
    assert fetched.tool_calls[0]["function"]["name"] == "get_current_time"
    assert fetched.created_at.tzinfo is not None and fetched.created_at.utcoffset() == timedelta(0)
    assert [t.id for t in await store.open_turns(session.id)] == [added.id]

    closed = await store.close_turn(added.id, "tool_result", {"content": "12:00"})
    assert closed is not None and closed.next_state == {"content": "12:00"}
    assert closed.next_state_kind == "tool_result" and closed.closed_at is not None
    assert await store.close_turn(added.id, "feedback", {"score": 1}) is None
    assert await store.open_turns(session.id) == []

    feedback = await store.add_feedback(added.id, "alice", -1.0, "wrong zone")
    assert [f.id for f in await store.list_feedback(added.id)] == [feedback.id]
    lesson = await store.add_lesson("alice", "alice lives in Berlin", source_turn_id=added.id)
    assert [x.text for x in await store.list_lessons("alice")] == [lesson.text]

    await store.set_session_tip(session.id, "tip-1")
    found = await store.find_session_by_tip("alice", "tip-1")
    assert found is not None and found.id == session.id
    assert await store.find_session_by_tip("bob", "tip-1") is None

    assert await store.stats() == {"users": 1, "sessions": 1, "turns": 1, "open_turns": 0,
                                   "feedback": 1, "lessons": 1, "adapters": 0, "judgments": 0}  # fmt: skip
    # a turn can move the tip in its own transaction; a new session says it is new, once
    row, made = await store.open_session("alice", "sess-tip")
    again, made_again = await store.open_session("alice", "sess-tip")
    assert made and not made_again and again.id == row.id
    tipped = await store.add_turn(TurnCreate(session_id=row.id, user_id="alice", step=0, model="m",
                                             request_id="r-tip", response_text="hi"), tip_hash="tip-2")  # fmt: skip
    assert (await store.find_session_by_tip("alice", "tip-2")).id == row.id
    # a step held for approval is not among the turns a new message closes
    held = await store.add_turn(TurnCreate(session_id=row.id, user_id="alice", step=1, model="m",
                                           request_id="r-tip", response_text="delete?"))  # fmt: skip
    await store.add_approval(Approval(turn_id=held.id, session_id=row.id, user_id="alice", request_id="r-tip",
                                      calls=[], resume={}, created_at=utcnow(),
                                      expires_at=utcnow() + timedelta(minutes=5)))  # fmt: skip
    assert [t.id for t in await store.open_turns(row.id)] == [tipped.id, held.id]
    assert [t.id for t in await store.open_turns(row.id, unheld=True)] == [tipped.id]

    assert (await store.forget_user("alice"))["turns"] == 3
    assert await store.get_turn(added.id) is None


async def test_core_round_trip_on_sqlite(store):
    await exercise_core_round_trip(store)


async def test_sqlite_store_runs_in_wal_mode_with_foreign_keys(store):
    with store.engine.connect() as connection:
        assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert connection.execute(text("PRAGMA foreign_keys")).scalar() == 1


@pytest.mark.parametrize("sync, level", [("normal", 1), ("full", 2)])
def test_sqlite_sync_sets_the_synchronous_pragma(tmp_path, sync, level):
    store = open_store(f"sqlite:///{tmp_path}/whet.db", sync)
    with store.engine.connect() as connection:
        assert connection.execute(text("PRAGMA synchronous")).scalar() == level
    store.engine.dispose()
    with pytest.raises(ValueError, match="sqlite_sync"):
        open_store(f"sqlite:///{tmp_path}/other.db", "off")


def test_a_turn_committed_with_sqlite_sync_normal_survives_its_process_being_killed(tmp_path):
    """``normal`` gives up durability on power loss only: kill -9 right after a commit loses nothing."""
    script = f"""
import asyncio, os, signal
from whet.memory import TurnCreate, open_store
async def main():
    store = open_store("sqlite:///{tmp_path}/whet.db", "normal")
    session = await store.create_session("alice")
    await store.add_turn(TurnCreate(session_id=session.id, user_id="alice", step=0, model="m",
                                    request_id="r1", response_text="kept"))
    os.kill(os.getpid(), signal.SIGKILL)
asyncio.run(main())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr
    store = open_store(f"sqlite:///{tmp_path}/whet.db")
    with store.engine.connect() as connection:
        assert connection.execute(text("SELECT response_text FROM turns")).scalars().all() == ["kept"]


async def test_store_work_runs_off_the_event_loop_thread(store):
    loop_thread = threading.get_ident()
    threads: set[int] = set()
    event.listen(store.engine, "before_cursor_execute", lambda *args: threads.add(threading.get_ident()))
    await store.ensure_user("alice")
    await store.list_turns()
    assert threads and loop_thread not in threads


async def test_close_turn_closes_only_once_when_called_concurrently(store):
    session = await store.create_session("alice")
    turn = await store.add_turn(turn_for(session.id, "alice"))
    results = []

    async def close(kind: str) -> None:
        results.append(await store.close_turn(turn.id, kind, {"by": kind}))

    async with anyio.create_task_group() as group:
        for i in range(12):
            group.start_soon(close, "feedback" if i % 2 else "user_message")
    winners = [r for r in results if r is not None]
    assert len(results) == 12 and len(winners) == 1
    stored = await store.get_turn(turn.id)
    assert stored.next_state == winners[0].next_state and stored.next_state_kind == winners[0].next_state_kind


async def test_close_turn_of_unknown_turn_returns_none_and_bad_kind_is_refused(store):
    assert await store.close_turn("turn_missing", "feedback", {}) is None
    with pytest.raises(ValueError, match="tool_result"):
        await store.close_turn("turn_missing", "telepathy", {})


async def test_list_turns_is_newest_first_and_since_is_strictly_after(store):
    session = await store.create_session("alice")
    turns = [await store.add_turn(turn_for(session.id, "alice", step=i)) for i in range(4)]
    listed = await store.list_turns(session_id=session.id)
    assert [t.id for t in listed] == [t.id for t in reversed(turns)]
    assert [t.id for t in await store.list_turns(user_id="alice", limit=2)] == [turns[3].id, turns[2].id]
    newer = await store.list_turns(since=turns[1].created_at)
    assert [t.id for t in newer] == [turns[3].id, turns[2].id]
    assert await store.list_turns(user_id="bob") == []


async def test_concurrent_ensure_user_for_a_new_user_succeeds(store):
    async with anyio.create_task_group() as group:
        for _ in range(10):
            group.start_soon(store.ensure_user, "newcomer")
    assert (await store.stats())["users"] == 1


async def test_explicit_session_id_is_reused_by_its_owner_and_refused_to_others(store):
    first = await store.create_session("alice", "shared-id")
    again = await store.create_session("alice", "shared-id")
    assert again.id == first.id and again.user_id == "alice"
    with pytest.raises(PermissionError, match="another user"):
        await store.create_session("mallory", "shared-id")


async def test_turn_for_unknown_or_foreign_session_is_refused(store):
    session = await store.create_session("alice")
    await store.ensure_user("mallory")
    with pytest.raises(KeyError, match="create_session"):
        await store.add_turn(turn_for("no-such-session", "alice"))
    with pytest.raises(PermissionError):
        await store.add_turn(turn_for(session.id, "mallory"))


async def test_turn_with_logprobs_not_matching_tokens_is_refused():
    with pytest.raises(ValueError, match="one behaviour log-prob per generated token"):
        TurnCreate(session_id="s", user_id="u", request_id="r", step=0, model="m",
                   response_token_ids=[1, 2], response_logprobs=[-0.1])  # fmt: skip


async def test_feedback_on_unknown_turn_raises_key_error(store):
    with pytest.raises(KeyError, match="turn_missing"):
        await store.add_feedback("turn_missing", "alice", 1.0, None)


async def test_feedback_score_outside_minus_one_to_one_is_refused(store):
    session = await store.create_session("alice")
    turn = await store.add_turn(turn_for(session.id, "alice"))
    with pytest.raises(ValueError, match="between -1 and 1"):
        await store.add_feedback(turn.id, "alice", 2.0, None)


async def test_forget_user_removes_everything_of_that_user_only(store):
    for user in ("alice", "bob"):
        session = await store.create_session(user)
        turn = await store.add_turn(turn_for(session.id, user))
        await store.add_feedback(turn.id, user, 1.0, "good")
        await store.add_lesson(user, f"{user} prefers metric units", source_turn_id=turn.id)
        await store.add_adapter(Adapter(id=f"user-{user}-0001", scope="user", user_id=user, path="/a"))
    await store.add_adapter(Adapter(id="global-0001", scope="global", path="/g"))

    removed = await store.forget_user("alice")

    assert removed == {"approvals": 0, "judgments": 0, "feedback": 1, "turns": 1, "lessons": 1, "sessions": 1, "adapters": 1, "users": 1}
    assert await store.list_turns(user_id="alice") == []
    assert await store.list_lessons("alice") == []
    assert [a.id for a in await store.list_adapters()] == ["user-bob-0001", "global-0001"]
    assert len(await store.list_turns(user_id="bob")) == 1
    assert len(await store.list_lessons("bob")) == 1
    assert (await store.stats())["feedback"] == 1


async def test_live_adapter_is_the_latest_promoted_of_its_scope(store):
    await store.add_adapter(Adapter(id="global-0001", path="/1"))
    await store.add_adapter(Adapter(id="global-0002", path="/2", parent="global-0001"))
    assert await store.live_adapter("global") is None
    then = datetime.now(UTC)
    await store.update_adapter("global-0001", status="live", promoted_at=then)
    await store.update_adapter("global-0002", status="live", promoted_at=then + timedelta(seconds=1))
    live = await store.live_adapter("global")
    assert live is not None and live.id == "global-0002"
    assert await store.live_adapter("user", "alice") is None
    with pytest.raises(ValueError, match="status"):
        await store.update_adapter("global-0001", status="bogus")
    with pytest.raises(KeyError):
        await store.update_adapter("global-9999", status="retired")
    with pytest.raises(ValueError, match="exists already"):
        await store.add_adapter(Adapter(id="global-0001", path="/again"))


async def test_returned_rows_stay_readable_and_convert_to_public_models(store):
    session = await store.create_session("alice")
    turn = await store.add_turn(turn_for(session.id, "alice"))
    public = TurnPublic.model_validate((await store.list_turns())[0])
    assert public.id == turn.id and public.prompt_token_ids == [101, 2054, 2051]
    assert public.created_at.utcoffset() == timedelta(0)


@pytest.mark.parametrize("url", ["", "mysql://root@localhost/whet", "not a url", "sqlite+aiosqlite:///x.db"])
def test_bad_store_url_raises_value_error_naming_the_fix(url):
    with pytest.raises(ValueError, match="sqlite:///"):
        open_store(url)


@pytest.mark.loopback
async def test_core_round_trip_on_postgresql(postgres_schema_url):
    store = open_store(postgres_schema_url)
    try:
        assert store.engine.dialect.name == "postgresql"
        await exercise_core_round_trip(store)
        session = await store.create_session("bob")
        turn = await store.add_turn(turn_for(session.id, "bob"))
        results = []

        async def close() -> None:
            results.append(await store.close_turn(turn.id, "feedback", {"score": 1}))

        async with anyio.create_task_group() as group:
            for _ in range(8):
                group.start_soon(close)
        assert sum(r is not None for r in results) == 1
    finally:
        await store.aclose()


NUL_TEXT = "before\x00after \ue000 \ue0000 \\0 end\x00"  # NUL, and the escape character itself


async def exercise_nul_round_trip(store: Store) -> None:
    """What was said is stored as said, NUL bytes included; a NUL id is simply not found."""
    from whet.memory import Judgment

    session = await store.create_session("nul-user")
    created = turn_for(session.id, "nul-user")
    created.response_text = NUL_TEXT
    created.prompt_messages = [{"role": "user", "content": NUL_TEXT}]
    created.tool_calls = [{"id": "c", "type": "function", "function": {"name": "x", "arguments": NUL_TEXT}}]
    turn = await store.add_turn(created)
    await store.close_turn(turn.id, "user_message", {"messages": [{"role": "user", "content": NUL_TEXT}]})
    feedback = await store.add_feedback(turn.id, "nul-user", 1.0, NUL_TEXT)
    lesson = await store.add_lesson("nul-user", NUL_TEXT)
    await store.save_judgment(Judgment(turn_id=turn.id, user_id="nul-user", request_id="req-1", score=-1,
                                       hint=NUL_TEXT, reason=NUL_TEXT))
    again = await store.get_turn(turn.id)
    assert again.response_text == NUL_TEXT
    assert again.prompt_messages[0]["content"] == NUL_TEXT
    assert again.tool_calls[0]["function"]["arguments"] == NUL_TEXT
    assert again.next_state["messages"][0]["content"] == NUL_TEXT
    assert (await store.list_feedback(turn.id))[0].text == feedback.text == NUL_TEXT
    assert (await store.get_lesson(lesson.id)).text == NUL_TEXT
    judgment = await store.get_judgment(turn.id)
    assert judgment.hint == judgment.reason == NUL_TEXT
    assert await store.get_turn("turn_\x00") is None
    with pytest.raises(KeyError):
        await store.add_feedback("turn_\x00", "nul-user", 1.0, None)


async def test_text_with_nul_bytes_round_trips_on_sqlite(store):
    await exercise_nul_round_trip(store)


@pytest.mark.loopback
async def test_text_with_nul_bytes_round_trips_on_postgresql(postgres_schema_url):
    store = open_store(postgres_schema_url)
    try:
        await exercise_nul_round_trip(store)
    finally:
        await store.aclose()


async def exercise_lesson_ids(store: Store) -> None:
    """What a replica's follower compares its index against: the ids and a bounded count; a narrowed lesson."""
    first = await store.add_lesson("ida", "ida lives in Oslo")
    second = await store.add_lesson("ida", "ida walks")
    third = await store.add_lesson("jo", "jo reads")
    assert await store.lesson_ids() == {first.id, second.id, third.id}
    assert await store.delete_lesson(second.id)
    assert await store.lesson_ids() == {first.id, third.id}
    assert await store.count_lessons(up_to=second.id) == 1
    assert await store.count_lessons(up_to=third.id) == 2
    # narrowed: stored again under a new id (what a follower's catch-up sees: a new id, an old one gone)
    narrowed = await store.narrow_lesson(first.id, 0.7)
    assert narrowed.id > third.id and narrowed.min_score == 0.7
    assert (narrowed.user_id, narrowed.text, narrowed.kind, narrowed.source_turn_id, narrowed.created_at) == (
        first.user_id, first.text, first.kind, first.source_turn_id, first.created_at)
    assert await store.lesson_ids() == {third.id, narrowed.id} and await store.get_lesson(first.id) is None
    assert await store.narrow_lesson(second.id, 0.7) is None  # gone already


async def test_lesson_ids_and_bounded_counts_on_sqlite(store):
    await exercise_lesson_ids(store)


@pytest.mark.loopback
async def test_lesson_ids_and_bounded_counts_on_postgresql(postgres_schema_url):
    store = open_store(postgres_schema_url)
    try:
        await exercise_lesson_ids(store)
    finally:
        await store.aclose()


def exercise_new_column_migration(url: str) -> None:
    """A store written before ``lessons.min_score`` existed opens with the column added; its lessons read
    NULL there, and a lesson written now keeps its floor."""
    from sqlalchemy import text

    async def check() -> None:
        store = open_store(url)
        try:
            old = await store.add_lesson("ida", "ida lives in Oslo")
            with store.engine.begin() as db:  # the table as an older whet made it
                db.execute(text('ALTER TABLE "lessons" DROP COLUMN "min_score"'))
        finally:
            await store.aclose()
        store = open_store(url)
        try:
            new = await store.add_lesson("ida", "ida walks", min_score=0.75)
            assert [(lesson.id, lesson.min_score) for lesson in await store.list_lessons("ida")] == [
                (old.id, None), (new.id, 0.75)]  # fmt: skip
        finally:
            await store.aclose()

    anyio.run(check)


def test_an_older_sqlite_store_gains_the_new_lesson_column(tmp_path):
    exercise_new_column_migration(f"sqlite:///{tmp_path / 'whet.db'}")


@pytest.mark.loopback
def test_an_older_postgresql_store_gains_the_new_lesson_column(postgres_schema_url):
    exercise_new_column_migration(postgres_schema_url)


async def exercise_close_waits_for_a_query_its_caller_abandoned(store: Store) -> None:
    """whet's background tasks are cancelled at shutdown (``task.cancel()``), which abandons a store call's
    worker thread mid-query; the store closes that thread's connection once the query is done, rather than
    disposing of the pool under it and leaving the connection open until it is collected."""
    release, held = threading.Event(), []

    def slow(db) -> None:
        held.append(db.connection().connection.dbapi_connection)
        release.wait(10)

    caller = asyncio.create_task(store._run(slow))
    with anyio.fail_after(5):
        while not held:
            await anyio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    closing = asyncio.create_task(store.aclose())
    await anyio.sleep(0.1)
    assert not closing.done()  # waiting for the query
    release.set()
    with anyio.fail_after(5):
        await closing
    with pytest.raises(Exception, match="closed"):
        held[0].cursor().execute("SELECT 1")


async def test_closing_waits_for_a_query_whose_caller_was_cancelled(tmp_path):
    await exercise_close_waits_for_a_query_its_caller_abandoned(open_store(f"sqlite:///{tmp_path}/whet.db"))


@pytest.mark.loopback
async def test_closing_waits_for_a_query_whose_caller_was_cancelled_on_postgresql(postgres_schema_url):
    await exercise_close_waits_for_a_query_its_caller_abandoned(open_store(postgres_schema_url))
