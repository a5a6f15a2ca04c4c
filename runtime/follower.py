"""The follower: this server keeping up with what the learner publishes.

Two paths lead to the same state. Bus events are the fast path:
``adapter.published`` goes to the adapter router, ``lesson.added`` into the
lesson index, ``lesson.deleted`` out of it. A poll of the store every ``learner.poll_s`` seconds is the sure
path: a learner on another machine, an MQTT message lost while this process
was away, or an event that never came still arrive within one period. Both
paths are idempotent, so an event delivered twice, or a poll that finds what
an event already brought, changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import anyio
import structlog

from whet.memory.bus import (
    ADAPTER_PUBLISHED,
    BUS_RECONNECTED,
    LESSON_ADDED,
    LESSON_DELETED,
    USER_FORGOTTEN,
    Bus,
    Event,
)
from whet.memory.index import LessonIndex, index_items
from whet.memory.store import Store
from whet.runtime.adapters import AdapterRouter

log = structlog.get_logger()


class Follower:
    """Follows the bus and polls the store until its context exits.

    ``lesson_cursor``: the highest lesson id already indexed (the poll indexes those above it).
    Entering subscribes first and then catches up once, so nothing published in
    between is missed, and the router serves the store's live adapters before
    the first request.
    """

    def __init__(
        self,
        store: Store,
        bus: Bus,
        adapters: AdapterRouter,
        index: LessonIndex,
        poll_s: float,
        lesson_cursor: int = 0,
    ) -> None:
        self.store = store
        self.bus = bus
        self.adapters = adapters
        self.index = index
        self.poll_s = poll_s
        self.lesson_cursor = lesson_cursor
        self.handled = 0  # events handled so far, failed ones included
        self._progress = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Follower:
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(ready), name="whet-follower")
        self._task.add_done_callback(_report_death)
        try:
            await asyncio.wait([self._task, ready], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # startup cancelled: take the task down with it
            self._task.cancel()
            raise
        if self._task.done():  # it could not even subscribe: a bug, let it surface at start
            self._task.result()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def wait_until(self, check: Callable[[], bool]) -> None:
        """Return once ``check()`` holds, re-checking after every event and poll handled.

        Never times out by itself: bound it (``anyio.fail_after``)."""
        while True:
            progressed = self._progress
            if check():
                return
            await progressed.wait()

    async def catch_up(self) -> None:
        """Make adapters and the lesson index match the store (what one poll does)."""
        try:
            await self.adapters.reconcile()
        except Exception:  # the store may be briefly unreachable; the next poll tries again
            log.exception("follower.reconcile_failed")
        try:
            await self._index_new_lessons()
            await self._drop_deleted_lessons()
        except Exception:
            log.exception("follower.lessons_failed")
        self._notify()

    # -- the task ---------------------------------------------------------------

    async def _run(self, ready: asyncio.Future[None]) -> None:
        names = (ADAPTER_PUBLISHED, LESSON_ADDED, LESSON_DELETED, USER_FORGOTTEN, BUS_RECONNECTED)
        async with self.bus.subscribe(*names) as events:
            await self.catch_up()
            ready.set_result(None)
            # when the bus closes (shutdown) the events end; the poll goes on until cancelled
            async with asyncio.TaskGroup() as group:
                group.create_task(self._poll(), name="whet-follower-poll")
                async for event in events:
                    await self._handle(event)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.catch_up()

    async def _handle(self, event: Event) -> None:
        try:
            if event.name == ADAPTER_PUBLISHED:
                await self.adapters.apply(event.data)
            elif event.name == LESSON_ADDED:
                await self._index_lesson(event.data)
            elif event.name == LESSON_DELETED:  # deleted through another replica: stop offering it here too
                await anyio.to_thread.run_sync(self.index.remove, int(event.data["lesson_id"]))
            elif event.name == BUS_RECONNECTED:  # what was published while the link was down may not come
                await self.catch_up()
            elif event.name == USER_FORGOTTEN:  # the store has forgotten them already; so must this replica
                user_id = str(event.data["user_id"])
                await anyio.to_thread.run_sync(self.index.remove_user, user_id)
                await self.adapters.deactivate(user_id)
        except Exception:  # one bad event must not stop the follower; the poll repairs what it missed
            log.exception("follower.event_failed", event=event.name, data=event.data)
        self.handled += 1
        self._notify()

    async def _index_lesson(self, data: dict[str, Any]) -> None:
        lesson = await self.store.get_lesson(int(data["lesson_id"]))
        if lesson is None or lesson.id is None:  # forgotten since: nothing to index
            return
        # the cursor stays the poll's: an event may overtake a lower id that is still on its way
        await anyio.to_thread.run_sync(self.index.add_many, index_items([lesson]))

    async def _index_new_lessons(self) -> None:
        lessons = await self.store.list_lessons(after_id=self.lesson_cursor)
        items = index_items(lessons)
        if items:
            await anyio.to_thread.run_sync(self.index.add_many, items)
            self.lesson_cursor = max(self.lesson_cursor, max(item[0] for item in items))

    async def _drop_deleted_lessons(self) -> None:
        """Drop indexed lessons the store no longer has (a missed ``lesson.deleted`` or ``user.forgotten``)."""
        # the index is read first: whatever it held then was committed before the store is read,
        # so a lesson missing from the store now was deleted (one indexed meanwhile is not looked at)
        indexed = await anyio.to_thread.run_sync(self.index.ids)
        if not indexed or await self.store.count_lessons(up_to=max(indexed)) == len(indexed):
            return  # the usual case, found without reading every id: the store has as many as the index
        gone = indexed - await self.store.lesson_ids()
        if gone:
            await anyio.to_thread.run_sync(self.index.remove_many, gone)

    def _notify(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()


def _report_death(task: asyncio.Task[None]) -> None:
    """The follower only ends by cancellation; anything else is a bug that must not pass silently."""
    if not task.cancelled() and task.exception() is not None:
        log.error("follower.died", error=repr(task.exception()), note="adapters and lessons no longer follow the store")
